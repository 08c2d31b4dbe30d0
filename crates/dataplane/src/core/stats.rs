//! Counters a dataplane reports (at exit, and to metrics).

use super::request::REQUEST_STATE_COUNT;
use super::tenants::TenantStats;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Driver loop iterations (counted by the driver).
    pub iterations: u64,
    /// Completions the driver reported.
    pub completions: u64,
    pub connections_accepted: u64,
    /// New connections refused by a limit (table, listener share, source address).
    pub connections_refused: u64,
    /// Connections closed to make room for new ones (none had completed a request).
    pub connections_evicted: u64,
    /// Connections closed by a timeout (handshake, idle, receive or send progress).
    pub connections_timed_out: u64,
    /// Times an idle connection gave its receive buffer back and waited for readiness.
    pub connections_parked: u64,
    /// Thread scaling: connections this thread handed to another, and adopted from others.
    pub connections_moved_out: u64,
    pub connections_moved_in: u64,
    /// Of `connections_moved_out`, those moved after a BIND to spread their tenant's
    /// connections over the threads (`[scaling] spread_tenants`).
    pub connections_spread: u64,
    /// Connections whose framing broke (closed after their answers).
    pub framing_errors: u64,
    /// TLS sessions started, and those that failed (handshake refused, bad records).
    pub tls_sessions: u64,
    pub tls_failures: u64,
    pub requests_answered: u64,
    pub requests_per_state: [u32; REQUEST_STATE_COUNT],
    pub transitions: u64,
    pub bytes_read: u64,
    /// READs answered with a loan of the device's memory instead of a copy
    /// ([`crate::Dataplane::handle_device_lent`]).
    pub reads_lent: u64,
    pub bytes_written: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub io_errors: u64,
    /// Device operations answered with an error because they outlived `device_timeout`.
    pub device_timeouts: u64,
    pub sends: u64,
    pub receives: u64,
    /// Times a request waited for a buffer run (arena exhausted, or the connection at its share).
    pub buffer_waits: u64,
    /// Writes that waited at the write gate for an overlapping read-modify-write.
    pub gate_waits: u64,
    /// Key-value requests of this thread's connections whose table steps ran on the table's
    /// owner thread (`core/kv_owner.rs`).
    pub kv_forwarded: u64,
    /// Key-value operations of other threads' connections this thread (the owner) stepped.
    pub kv_guests: u64,
    /// Enters forced by a full submission queue (counted by the driver).
    pub sq_full_flushes: u64,
    pub registered_buffers: bool,
    pub flush_errors: u64,
    /// Requests that found their tenant's queue full and waited (back-pressure).
    pub tenant_queue_full_waits: u64,
    /// Control messages applied (rate updates, revocations, notices).
    pub control_messages: u64,
    pub notices_sent: u64,
    pub notices_dropped: u64,
    /// Inter-core migration: reads this thread sent to others, reads of others it served,
    /// and reads of others it could not serve (answered with an error).
    pub migrated_sent: u64,
    pub migrated_served: u64,
    pub migrated_refused: u64,
    /// What each tenant did on this thread, by handle.
    pub tenants: Vec<TenantStats>,
}
