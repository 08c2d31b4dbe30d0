//! Wire formats of ReFlex as sans-IO codecs (crate doc with API summary written at the end).
#![forbid(unsafe_code)]

pub mod native;
pub mod nbd;
pub mod original;
mod wire;

/// An encoder was given an output buffer too small for the message. Encoding is otherwise
/// infallible: a caller that sizes its buffers from the `*_SIZE` constants never sees this.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("output buffer holds {available_bytes} bytes, the message needs {needed_bytes}")]
pub struct BufferTooSmall {
    pub needed_bytes: usize,
    pub available_bytes: usize,
}

/// Checks that `out` can hold `needed_bytes` and returns the prefix to fill.
#[inline]
pub(crate) fn output_prefix(
    out: &mut [u8],
    needed_bytes: usize,
) -> Result<&mut [u8], BufferTooSmall> {
    let available_bytes = out.len();
    out.get_mut(..needed_bytes).ok_or(BufferTooSmall {
        needed_bytes,
        available_bytes,
    })
}

/// Every error this crate returns, for callers that want one type (the client library, tools).
/// The server usually matches on the per-protocol errors directly.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("native request: {0}")]
    NativeRequest(#[from] native::RequestError),
    #[error("native response: {0}")]
    NativeResponse(#[from] native::ResponseError),
    #[error("native body: {0}")]
    NativeBody(#[from] native::BodyError),
    #[error("original protocol: {0}")]
    Original(#[from] original::DecodeError),
    #[error("original protocol: {0}")]
    OriginalInvalid(#[from] original::Invalid),
    #[error("nbd handshake: {0}")]
    NbdHandshake(#[from] nbd::HandshakeError),
    #[error("nbd transmission: {0}")]
    NbdRequest(#[from] nbd::RequestError),
    #[error("nbd reply: {0}")]
    NbdReply(#[from] nbd::ReplyError),
    #[error(transparent)]
    BufferTooSmall(#[from] BufferTooSmall),
}
