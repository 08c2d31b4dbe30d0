//! The limits one dataplane runs within, derived from the server's configuration, and the
//! checks that they fit together.

use reflex_qos::Nanos;

use crate::buffers::{ORDER_MAX, PAGE_SIZE, RUN_SIZE_MAX};

/// Device operations one thread keeps in flight.
pub const DEVICE_IN_FLIGHT_PER_THREAD_MAX: u32 = 1024;
/// How long a shutdown waits for clients to take their last responses by default.
pub const DRAIN_TIMEOUT_DEFAULT: Nanos = Nanos(10_000_000_000);
/// Spare receive buffers a dataplane keeps for new or waking connections (more are freed).
pub const RECV_BUFFERS_SPARE_MAX: usize = 64;
/// Connection slots beyond `connections_max` for connections that are still closing, so a
/// connection evicted for a new one need not finish closing first.
pub const CONNECTION_SLACK: u32 = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Requests a connection may have outstanding (advertised in HELLO).
    pub window: u32,
    /// Request slots of the thread.
    pub requests_max: u32,
    /// Open connections of the thread.
    pub connections_max: u32,
    /// Connections kept for each other listener: one port's flood cannot take them.
    pub connections_reserved_per_listener: u32,
    /// Open connections from one address (`None`: no limit).
    pub connections_per_source_max: Option<u32>,
    /// Bytes of each connection's receive buffer (headers and small WRITE payloads).
    pub recv_buffer_bytes: usize,
    /// Bytes of the buffer arena.
    pub arena_bytes: usize,
    /// Arena pages one connection may hold.
    pub connection_pages_max: u32,
    /// Arena pages kept for connections holding at most `connection_pages_share`.
    pub arena_reserve_pages: u32,
    pub connection_pages_share: u32,
    /// A connection that has not completed a request this long after it was accepted closes.
    pub handshake_timeout: Option<Nanos>,
    /// A connection with nothing outstanding and nothing received for this long closes.
    pub idle_timeout: Option<Nanos>,
    /// A partly received request (header or payload) that gets no byte for this long closes
    /// its connection.
    pub receive_timeout: Option<Nanos>,
    /// A send that makes no progress for this long closes its connection (a client that
    /// does not read its answers).
    pub send_timeout: Option<Nanos>,
    /// A device operation outstanding this long is answered with an error (ETIMEDOUT).
    pub device_timeout: Option<Nanos>,
    pub drain_timeout: Nanos,
    pub device_in_flight_max: u32,
    /// A connection with nothing to do for this long gives its receive buffer back and waits
    /// for readiness instead (`None`: never): idle connections then cost no buffer.
    pub park_after: Option<Nanos>,
}

impl Limits {
    /// Limits around an arena of `arena_bytes` with connections allowed `connection_percent`
    /// of it: window 128, 4096 request slots, 1024 connections, 64 KiB receive buffers, no
    /// timeouts and no parking (a simulation or a test sets what it exercises; reflexd derives
    /// its limits from its configuration).
    pub fn with_arena(arena_bytes: usize, connection_percent: u32) -> Limits {
        let (connection_pages_max, arena_reserve_pages, connection_pages_share) =
            Limits::shares_for_arena(arena_bytes, connection_percent);
        Limits {
            window: 128,
            requests_max: 4096,
            connections_max: 1024,
            connections_reserved_per_listener: 0,
            connections_per_source_max: None,
            recv_buffer_bytes: 64 << 10,
            arena_bytes,
            connection_pages_max,
            arena_reserve_pages,
            connection_pages_share,
            handshake_timeout: None,
            idle_timeout: None,
            receive_timeout: None,
            send_timeout: None,
            device_timeout: None,
            drain_timeout: DRAIN_TIMEOUT_DEFAULT,
            device_in_flight_max: DEVICE_IN_FLIGHT_PER_THREAD_MAX,
            park_after: None,
        }
    }

    /// Fair shares of an arena of `arena_bytes`: `(connection_pages_max,
    /// arena_reserve_pages, connection_pages_share)`. A connection may hold `connection_percent`
    /// of it (at least one maximal run); the last eighth is kept for connections holding at
    /// most 64 KiB, less where that would leave no room for one maximal run beside it (a
    /// 1 MiB arena keeps none: its one maximal run needs all of it).
    pub fn shares_for_arena(arena_bytes: usize, connection_percent: u32) -> (u32, u32, u32) {
        assert!((1..=100).contains(&connection_percent));
        let pages = (arena_bytes / PAGE_SIZE) as u32;
        let run_pages = 1u32 << ORDER_MAX;
        let connection_pages_max = ((u64::from(pages) * u64::from(connection_percent) / 100)
            as u32)
            .max(run_pages)
            .min(pages);
        let arena_reserve_pages = (pages / 8).min(pages.saturating_sub(run_pages));
        let connection_pages_share = (64 << 10) / PAGE_SIZE as u32;
        (
            connection_pages_max,
            arena_reserve_pages,
            connection_pages_share,
        )
    }

    /// Checks that the limits fit together (the server validates its configuration first;
    /// this is the dataplane's own guard).
    pub fn check(&self) -> Result<(), String> {
        if self.window == 0 || self.requests_max < self.window {
            return Err(format!(
                "{} request slots cannot hold one window of {}",
                self.requests_max, self.window
            ));
        }
        if self.arena_bytes < RUN_SIZE_MAX || !self.arena_bytes.is_multiple_of(RUN_SIZE_MAX) {
            return Err(format!(
                "arena of {} bytes is not a non-zero multiple of {RUN_SIZE_MAX}",
                self.arena_bytes
            ));
        }
        let largest_unit = crate::frontend::UNIT_BYTES_MAX;
        if self.recv_buffer_bytes < 2 * largest_unit {
            return Err(format!(
                "receive buffer of {} bytes cannot hold two of the largest header and body ({largest_unit})",
                self.recv_buffer_bytes
            ));
        }
        if self.connections_max == 0 {
            return Err("no connections allowed".into());
        }
        if self.connection_pages_max < 1 << ORDER_MAX {
            return Err("a connection's arena share cannot hold one maximal run".into());
        }
        // A run is taken only while the reserve stays free (or the connection holds little):
        // a maximal run must fit beside the reserve, or a request that needs one waits forever.
        let pages = (self.arena_bytes / PAGE_SIZE) as u64;
        if pages < (1u64 << ORDER_MAX) + u64::from(self.arena_reserve_pages) {
            return Err(format!(
                "an arena of {pages} pages with {} reserved cannot hold one maximal run beside \
                 the reserve",
                self.arena_reserve_pages
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(arena_bytes: usize) -> Limits {
        Limits::with_arena(arena_bytes, 25)
    }

    /// Finding 6: a 1 MiB arena kept an eighth in reserve, so its one maximal run could never
    /// be allocated.
    #[test]
    fn the_reserve_leaves_room_for_one_maximal_run() {
        let run_pages = 1u32 << ORDER_MAX;
        for megabytes in [1, 2, 3, 16, 256] {
            let limits = limits(megabytes << 20);
            let pages = (limits.arena_bytes / PAGE_SIZE) as u32;
            assert!(
                limits.arena_reserve_pages + run_pages <= pages,
                "{megabytes} MiB: {limits:?}"
            );
            assert!(limits.connection_pages_max >= run_pages);
            assert_eq!(limits.check(), Ok(()), "{megabytes} MiB");
        }
        assert_eq!(limits(1 << 20).arena_reserve_pages, 0);
        assert_eq!(limits(16 << 20).arena_reserve_pages, 512);
        let squeezed = Limits {
            arena_reserve_pages: 1,
            ..limits(1 << 20)
        };
        assert!(squeezed.check().is_err());
    }
}
