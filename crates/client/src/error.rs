//! Typed errors of the client, from the places things go wrong: the caller asked for
//! something the connection cannot take now ([`SubmitError`]), the server's bytes broke the
//! protocol ([`ProtocolError`], after which the connection is unusable), the server refused
//! one request ([`ClientError::Status`], after which the connection is fine), and the
//! connection broke ([`ClientError::Closed`], [`ClientError::Io`]; with a
//! [`crate::ReconnectPolicy`] the client repairs it and reports what it could not repeat in
//! [`ClientError::OutcomeUnknown`], or fails with [`ClientError::ReconnectGaveUp`] or
//! [`ClientError::TenantLost`]).

use std::time::Duration;

use reflex_proto::native::{BodyError, Opcode, ResponseError, Status};
use thiserror::Error;

use crate::core::InterruptedRequest;

/// A request the connection core did not accept. Nothing was queued.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// `window` requests are already outstanding; reap some first.
    #[error("window full: {window_requests} requests outstanding")]
    WindowFull { window_requests: u32 },
    /// The id is already in flight on this connection.
    #[error("request id {0} is already in flight")]
    DuplicateId(u64),
    /// The id is reserved for server notices.
    #[error("request id {0} is reserved for server notices")]
    ReservedId(u64),
    /// Larger than the server's `max_io_size` (or, for control bodies, 4 KiB).
    #[error("{length_bytes} bytes exceed the limit of {max_bytes}")]
    TooLarge { length_bytes: u64, max_bytes: u32 },
    /// The buffers are lent to the kernel (a send or receive is in flight) and too small to
    /// take this request without moving; submit again after that operation completes.
    #[error("buffers busy: retry after the in-flight send or receive completes")]
    BuffersBusy,
    /// The connection is broken by an earlier protocol error.
    #[error("connection is broken")]
    Broken,
    /// The connection was lost and is not back (reconnecting gave up); an I/O call tries
    /// again.
    #[error("disconnected: the connection was lost and is not back")]
    Disconnected,
}

/// The server's bytes violate the protocol. The connection cannot be used any more.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("bad response header: {0}")]
    Header(#[from] ResponseError),
    #[error("response for request id {0}, which is not outstanding")]
    UnknownRequestId(u64),
    #[error("response opcode {got:#04x} for a {expected:?} request")]
    OpcodeMismatch { expected: Opcode, got: u8 },
    #[error("{got} payload bytes in a response to {opcode:?} (expected {expected})")]
    UnexpectedLength {
        opcode: Opcode,
        expected: String,
        got: u32,
    },
    #[error("malformed capabilities: {0}")]
    Capabilities(#[from] BodyError),
    #[error("HELLO answered OK without capabilities")]
    NoCapabilities,
    #[error("malformed tenant body: {0}")]
    TenantBody(BodyError),
}

/// Everything a blocking or pipelined client call can fail with.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// The server answered this request with an error status.
    #[error("server refused {opcode:?}: {status}{}", reason_suffix(reason))]
    Status {
        opcode: Opcode,
        status: Status,
        /// The UTF-8 reason the server sent, if any.
        reason: Option<String>,
    },
    /// The server answered with a status value this client does not know (an error by the
    /// protocol's rule).
    #[error(
        "server refused {opcode:?} with unknown status {status_raw}{}",
        reason_suffix(reason)
    )]
    UnknownStatus {
        opcode: Opcode,
        status_raw: u16,
        reason: Option<String>,
    },
    /// REGISTER refused by the server's admission control, with its reason (e.g. "needs
    /// 196K tokens/s, 82K left at 500 µs"). Nothing was registered.
    #[error("registration refused: {reason}")]
    Refused { reason: String },
    #[error("request not accepted: {0}")]
    Submit(#[from] SubmitError),
    /// The server closed the connection.
    #[error("connection closed by the server")]
    Closed,
    /// The connection broke before these requests were answered, and the client reconnected
    /// without repeating them: WRITE, TRIM, REGISTER and UNREGISTER change the server's
    /// state, so each may or may not have taken effect. (A READ or FLUSH is listed only when
    /// the new server cannot take it again, e.g. a smaller maximum I/O size.) Requests not
    /// listed were answered: an acknowledged WRITE is never listed. The connection is back
    /// and the caller decides: rewrite the range, read it back, or give up.
    #[error(
        "connection lost with {} request(s) unanswered, outcome unknown{}",
        requests.len(), first_request_suffix(requests)
    )]
    OutcomeUnknown { requests: Vec<InterruptedRequest> },
    /// Reconnecting failed: `attempts` connection attempts within `elapsed` of the break, the
    /// last one failing with `last_error`. `interrupted` lists the requests that will never
    /// be answered (those that change state have an unknown outcome). The client stays
    /// disconnected; its next call tries again with a fresh budget.
    #[error("gave up reconnecting after {attempts} attempt(s) in {elapsed:?}: {last_error}")]
    ReconnectGaveUp {
        attempts: u32,
        elapsed: Duration,
        #[source]
        last_error: Box<ClientError>,
        interrupted: Vec<InterruptedRequest>,
    },
    /// Reconnected, but the server refused to BIND again the tenant this connection was bound
    /// to: a restarted server forgets the tenants registered over the wire. The new
    /// connection is up and charged to the namespace's default tenant (register and bind
    /// again); nothing was repeated, `interrupted` lists what will never be answered.
    #[error("tenant {handle} lost across a reconnect: {refusal}")]
    TenantLost {
        handle: u64,
        #[source]
        refusal: Box<ClientError>,
        interrupted: Vec<InterruptedRequest>,
    },
}

fn first_request_suffix(requests: &[InterruptedRequest]) -> String {
    match requests.first() {
        Some(request) => format!(
            ", first {:?} of {} bytes at {} of namespace {}",
            request.opcode, request.length_bytes, request.offset_bytes, request.namespace
        ),
        None => String::new(),
    }
}

fn reason_suffix(reason: &Option<String>) -> String {
    match reason {
        Some(reason) if !reason.is_empty() => format!(" ({reason})"),
        _ => String::new(),
    }
}

impl ClientError {
    /// The server status when the server refused the request with a known status.
    pub fn status(&self) -> Option<Status> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            ClientError::Refused { .. } => Some(Status::Refused),
            _ => None,
        }
    }

    /// Whether the connection itself failed (EOF, reset, timeout, any socket error): what a
    /// [`crate::ReconnectPolicy`] repairs.
    pub fn is_connection_lost(&self) -> bool {
        matches!(self, ClientError::Io(_) | ClientError::Closed)
    }

    /// The requests this error says will never be answered: those of
    /// [`ClientError::OutcomeUnknown`], [`ClientError::ReconnectGaveUp`] and
    /// [`ClientError::TenantLost`]; empty for every other error.
    pub fn unanswered_requests(&self) -> &[InterruptedRequest] {
        match self {
            ClientError::OutcomeUnknown { requests } => requests,
            ClientError::ReconnectGaveUp { interrupted, .. }
            | ClientError::TenantLost { interrupted, .. } => interrupted,
            _ => &[],
        }
    }
}
