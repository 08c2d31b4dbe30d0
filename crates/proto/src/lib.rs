//! Wire formats of ReFlex as sans-IO codecs: the native protocol v1, the original ReFlex block
//! protocol, NBD, and the key-value protocol. Nothing here opens a socket, reads a clock or uses
//! `unsafe`; the server and client drivers move bytes, this crate says what they mean.
//!
//! Why: parsing, validation and negotiation are where malformed or hostile input meets the
//! server, so they live in plain, fuzzed, exhaustively tested functions. Decoding separates
//! "need more bytes" (`Ok(None)`) from "malformed" (a typed `thiserror` error); encoding writes
//! fixed-size headers into arrays or caller-provided buffers; payloads are never copied or owned
//! (the driver moves them straight between sockets and its aligned buffers); the data path does
//! not allocate.
//!
//! # API summary
//!
//! ## [`native`] — `docs/PROTOCOL.md` §1 (little-endian)
//! - Server, per request in the receive buffer:
//!   `native::decode_request(buf) -> Result<Option<(RequestHeader, usize)>, RequestError>`
//!   (`Err` = wrong magic: close the connection); then
//!   `header.payload_length_bytes()` bytes follow — consume them whatever happens next; then
//!   `native::validate_request(&header, &ServerLimits, &namespaces) -> Result<ValidatedRequest, Status>`
//!   where `namespaces: &[Namespace]` (or any `NamespaceTable`) and `ValidatedRequest` is
//!   `Io(ValidatedIo)` (getters `op()` = Read/Write{fua}/Flush/Trim, `namespace_id()`,
//!   `offset_bytes()`, `length_bytes()`, `request_id()`, `opcode()`), `Hello` (decode the 16-byte
//!   body with `HelloBody::decode`) or `Control { op, body_length_bytes }` (REGISTER/UNREGISTER/
//!   BIND: decode the body with `RegisterBody::decode` or `decode_handle`).
//! - Tenant bodies (§1.9): `RegisterBody { namespace_id, class: TenantClassRequest, read_only,
//!   handle }` (`to_bytes`/`decode`), `encode_handle`/`decode_handle` (UNREGISTER, BIND, the
//!   REGISTER answer), `RenegotiateBody` (the notice sent with `ResponseHeader::notice`).
//! - Responses: `ResponseHeader::for_request(&header, status, length).to_bytes()` (24 bytes;
//!   echoes the raw opcode and the id), `ResponseHeader::notice(len)` for RENEGOTIATE; HELLO's
//!   body: `Capabilities::from_limits(&limits, window).encode_into(&namespaces, out)`.
//! - Client: `RequestHeader::{read, write, flush, trim, hello}(..).to_bytes()` (32 bytes),
//!   `native::decode_response(buf)`, `response.status()` (unknown values are errors, not
//!   framing), `Capabilities::decode(body) -> (Capabilities, NamespaceEntries)`.
//! - Enums `Opcode`, `Status` have `from_u8`/`from_u16` returning `UnknownOpcode`/`UnknownStatus`.
//!
//! ## [`original`] — `docs/PROTOCOL.md` §2 (little-endian, no status field)
//! - `original::Header::decode(buf) -> Result<Option<(Header, usize)>, DecodeError>` (bad magic,
//!   unknown opcode); `header.request_payload_length_bytes()`;
//!   `original::validate(&header, &Limits, namespace_size_bytes) -> Result<ValidatedIo, Invalid>`.
//!   Any error: log it and close the connection.
//! - Response: `validated.response_header().to_bytes()` (read: echo, then data; write:
//!   `lba_count` 0). Client: `Header::response_payload_length_bytes()`.
//!
//! ## [`nbd`] — `docs/NBD.md` (big-endian)
//! - Handshake: `nbd::ExportTable::new(vec![Export::new(name, size).read_only()...], default)`
//!   once; per connection `Handshake::new(Arc<ExportTable>, HandshakeConfig)`, then
//!   `handle_bytes(&buf) -> Result<usize /*consumed*/, HandshakeError /*hard disconnect*/>`,
//!   `poll_transmit(&mut out) -> usize` (or `pending_output()` + `consume_output(n)`),
//!   `handle_eof()`, `begin_shutdown()`, and `outcome() -> Option<Outcome>`:
//!   `Transmission(Session)` (unconsumed input is already transmission), `Aborted`,
//!   `Disconnected`.
//! - Transmission: `nbd::decode_request(buf) -> Result<Option<(RequestHeader, usize)>, RequestError>`;
//!   `header.payload_length_bytes()` (WRITE only, always consumed);
//!   `session.validate(&header) -> Result<ValidatedCommand, Errno>` (`command()` = Read, Write,
//!   Flush, Trim, WriteZeroes, Disconnect; `cookie()`); reply headers
//!   `session.reply_ok(&command) -> Option<ReplyBytes>` (None for DISC; READ data follows) and
//!   `session.reply_error(cookie, errno)`; lower level `offset_data_chunk`, `error_chunk`,
//!   `none_chunk`, `SimpleReply`, `ChunkHeader`; `Errno::from_linux_errno` for device errors;
//!   `session.export_index()` maps back to the namespace and tenant.
//!
//! ## [`kv`] — `docs/KV.md` (little-endian)
//! - Server: a `kv::RequestDecoder` per connection; `decoder.decode(buf) ->
//!   Result<(Option<Decoded>, usize /*consumed*/), RequestError /*close*/>` where `Decoded` is
//!   `Request { request_id, request: Request::{Put{key,value}, Get{key}, Delete{key}, Flush} }`
//!   (whole, borrowed from `buf`) or `Rejected { header, status }` (answer now; the decoder skips
//!   the payload on later calls). Lower level: `kv::decode_request`,
//!   `header.payload_length_bytes()`, `kv::validate_request(&header) -> Result<ValidatedRequest,
//!   Status>`.
//! - Responses: `ResponseHeader::for_request(&header, status, value_length).to_bytes()`, or
//!   `ResponseHeader::new(opcode, status, request_id, value_length)`; GET's value follows.
//! - Client: `Request::Put { key, value }.encode_into(request_id, out)`,
//!   `kv::decode_response_frame(buf) -> Result<Option<ResponseFrame { header, value,
//!   length_bytes }>, ResponseError /*close*/>`.
//!
//! All the decoders are fuzzed (`fuzz/`, targets `native_request`, `native_response`,
//! `original_request`, `nbd_handshake`, `nbd_request`, `kv_request`, `kv_response`).
#![forbid(unsafe_code)]

pub mod kv;
pub mod memory_pipe;
pub mod native;
pub mod nbd;
pub mod nvme_tcp;
pub mod original;
pub mod psk_file;
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
    #[error("key-value request: {0}")]
    KvRequest(#[from] kv::RequestError),
    #[error("key-value response: {0}")]
    KvResponse(#[from] kv::ResponseError),
    #[error(transparent)]
    BufferTooSmall(#[from] BufferTooSmall),
}
