//! The ReFlex client library: speak the native protocol v1 (docs/PROTOCOL.md) to `reflexd`.
//!
//! Three layers, from the bottom:
//! - [`ConnectionCore`], sans-IO: encodes requests into a transmit buffer, decodes responses
//!   from received bytes, tracks outstanding request ids, enforces the server's window and
//!   never panics on server bytes (violations become a [`ProtocolError`]). Event loops such
//!   as `reflex bench` drive it with their own sockets (io_uring, epoll).
//!   Its transmit and receive buffers are a [`StreamBuffers`], which other stream protocols'
//!   cores (the NBD core of `reflex bench`) reuse for the same lending contract.
//! - [`Client`], blocking: `connect` (TCP_NODELAY, HELLO, capabilities and namespaces), then
//!   `read`, `write`, `write_fua`, `flush`, `trim`, each returning when answered. A server
//!   refusal is [`ClientError::Status`] carrying the wire status.
//! - [`PipelinedClient`]: `submit_*` under ids of the caller's choosing, `poll_io` without
//!   blocking, `reap` completions in any order.
//! - Tenants (`docs/QOS.md`): `Client::register_lc(ns, latency_us, iops, read_percent)`,
//!   `register_be(ns)`, `register(&RegisterBody)` (read-only tenants, new SLOs) return a
//!   tenant handle or [`ClientError::Refused`] `{ reason }`; `bind(handle)`,
//!   `unregister(handle)`; RENEGOTIATE notices through `poll_notice`/`wait_notice` (blocking)
//!   or `reap` (pipelined and event loops).
//!
//! [`kv::KvClient`] speaks the key-value protocol (`docs/KV.md`) to reflexd's KV port:
//! blocking `put`/`get`/`delete`/`flush`, or `send` several and `receive` their answers.
//!
//! HELLO declares the calling process's Linux I/O priority, read with
//! `ioprio_get(IOPRIO_WHO_PROCESS, 0)` ([`io_priority_of_process`]): run a client under
//! `ionice -c 1` or `ionice -c 3` and the server sees class 1 or 3 without any code change
//! ([`ClientOptions::io_priority`] overrides it).
//!
//! Surviving server restarts is opt-in: `ClientOptions::default().with_reconnect(policy)`
//! with a [`ReconnectPolicy`] (`attempts_max`, `backoff_initial`, `backoff_max`,
//! `give_up_after`). A call that finds the connection ended, reset or (blocking client)
//! unanswered within the timeout connects again with exponential backoff and jitter
//! ([`ReconnectSchedule`]), sends HELLO and BINDs the tenant it was bound to, then repeats
//! the READ, FLUSH and BIND requests left unanswered and reports the WRITE, TRIM, REGISTER
//! and UNREGISTER ones as [`ClientError::OutcomeUnknown`] with their ranges
//! ([`InterruptedRequest`]); an acknowledged write is never reported. Failing that, the call
//! ends with [`ClientError::ReconnectGaveUp`] or [`ClientError::TenantLost`] (a restarted
//! server forgets tenants registered over the wire). Off by default, because it changes
//! what a caller must handle: a write can come back of unknown outcome, calls can block for
//! `give_up_after`, and a FLUSH repeated on a new server covers what that server holds.
//! Protocol v1 has no server instance id, so a re-BIND after a restart cannot tell a handle
//! the new server gave to another tenant from the one it had (`docs/OPERATIONS.md`).
//!
//! Architecture invariant: the core has no I/O and no clock; the std drivers own the socket,
//! the clock and the sleeps between reconnection attempts.
#![deny(unsafe_code)]

mod blocking;
mod call;
mod core;
#[cfg(test)]
mod core_tests;
mod driver;
mod error;
pub mod kv;
pub mod nvme_tcp;
mod nvme_tcp_psk_session;
mod nvme_tcp_tls;
mod pipelined;
mod reconnect;
mod stream_buffers;
mod sys;
mod tls;
mod types;

pub use crate::blocking::{Client, NOTICES_BUFFERED_MAX};
pub use crate::core::{
    Completion, ConnectionCore, CoreOptions, IO_SIZE_MAX_BYTES_LIMIT, InterruptedRequest,
    RECEIVE_BUFFER_MIN, REPORT_REQUEST_ID, WINDOW_REQUESTS_LIMIT,
};
pub use crate::driver::{ClientOptions, HELLO_REQUEST_ID};
pub use crate::error::{ClientError, ProtocolError, SubmitError};
pub use crate::pipelined::PipelinedClient;
pub use crate::reconnect::{JitterSample, ReconnectPolicy, ReconnectSchedule};
pub use crate::stream_buffers::{BuffersBusy, StreamBuffers};
pub use crate::sys::io_priority_of_process;
pub use crate::tls::TlsOptions;
pub use crate::types::Capabilities;
pub use reflex_proto::native::{
    NO_TENANT_HANDLE, NOTICE_REQUEST_ID, Namespace, Opcode, RegisterBody, RenegotiateBody, Status,
    TenantClassRequest, UnknownStatus,
};
