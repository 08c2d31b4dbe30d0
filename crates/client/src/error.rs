//! Typed errors of the client, from the three places things go wrong: the caller asked for
//! something the connection cannot take now ([`SubmitError`]), the server's bytes broke the
//! protocol ([`ProtocolError`], after which the connection is unusable), and the server
//! refused one request ([`ClientError::Status`], after which the connection is fine).

use reflex_proto::native::{BodyError, Opcode, ResponseError, Status};
use thiserror::Error;

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
}
