//! Housekeeping every [`HOUSEKEEPING_INTERVAL`]: the connection timeouts (handshake, idle,
//! receive and send progress), device operations past their deadline, and the end of device
//! failure bursts in the log.
//!
//! Why a periodic sweep and not a timer per connection: the limits are seconds long and a
//! tenth of a second late is fine, while a sweep costs nothing per request; it runs only
//! while something can time out, so an idle server sleeps.

use reflex_qos::Nanos;

use super::Dataplane;
use super::connection::ReadState;
use super::request::RequestState;

/// How often timeouts are checked while something can time out.
pub const HOUSEKEEPING_INTERVAL: Nanos = Nanos(100_000_000);

impl Dataplane {
    /// Whether anything can time out (the sweep then needs a deadline).
    pub(super) fn housekeeping_needed(&self) -> bool {
        self.open_connections > 0
            || (self.device_in_flight > 0 && self.limits.device_timeout.is_some())
            || self.device_errors.any_active()
    }

    pub(super) fn housekeeping(&mut self, now: Nanos) {
        if now < self.housekeeping_at {
            return;
        }
        self.housekeeping_at = now + HOUSEKEEPING_INTERVAL;
        self.time_out_connections(now);
        self.mark_late_movers();
        self.park_idle_connections(now);
        self.time_out_device_operations(now);
        self.device_errors.tick(now);
        self.reap_orphaned_tenants(now);
        self.publish_live(now, false);
    }

    fn time_out_connections(&mut self, now: Nanos) {
        let limits = &self.limits;
        let (handshake, idle, receive, send) = (
            limits.handshake_timeout,
            limits.idle_timeout,
            limits.receive_timeout,
            limits.send_timeout,
        );
        let over = |since: Nanos, limit: Option<Nanos>| {
            limit.is_some_and(|limit| now.saturating_since(since) >= limit)
        };
        for index in 0..self.connections.len() as u32 {
            let connection = &mut self.connections[index as usize];
            if !connection.is_open() {
                continue;
            }
            let partial_request = connection.recv_end > connection.recv_start
                || connection.payload.is_some()
                || connection.skip_bytes > 0;
            let reason = if !connection.established && over(connection.accepted_at, handshake) {
                Some("handshake timeout: no request")
            } else if connection.recv_in_flight
                && partial_request
                && over(connection.receive_progress_at, receive)
            {
                Some("receive timeout: a request stopped arriving")
            } else if connection.send_in_flight && over(connection.send_progress_at, send) {
                Some("send timeout: the client does not take its answers")
            } else if let Some(reason) = connection.frontend.expired(now) {
                // The protocol's own timers (NVMe/TCP: keep-alive, an unanswered R2T, a
                // controller gone on another connection).
                Some(reason)
            } else if connection.established
                && connection.read == ReadState::Open
                && connection.outstanding == 0
                && !partial_request
                && over(connection.receive_progress_at, idle)
            {
                Some("idle timeout")
            } else {
                None
            };
            if let Some(reason) = reason {
                self.stats.connections_timed_out += 1;
                tracing::info!(
                    thread = self.thread_index,
                    source = ?connection.source,
                    reason,
                    "closing connection"
                );
                self.abort_connection(index, reason);
            }
        }
    }

    /// Requests of this thread in each state (for tests and metrics).
    pub fn requests_in_state(&self, state: RequestState) -> u32 {
        self.stats.requests_per_state[state as usize]
    }
}
