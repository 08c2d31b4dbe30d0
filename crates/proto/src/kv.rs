//! The key-value protocol v1 (`docs/KV.md`): PUT, GET, DELETE, FLUSH and BIND over one stream, a
//! 24-byte little-endian request header followed by the key and the value, a 24-byte response
//! header followed (GET only) by the value.
//!
//! Why it is shaped this way:
//! - **Framing is separate from validity**, as in [`crate::native`]. The only framing error a
//!   server sees is a wrong magic ([`RequestError`]); every other defect (unknown version,
//!   opcode or flag, an empty or oversize key, an oversize value, a value on a GET) still
//!   decodes to a [`RequestHeader`] whose [`RequestHeader::payload_length_bytes`] is
//!   `key_length + value_length` whatever the opcode, so the server answers it with an error
//!   [`Status`] and skips exactly that many bytes.
//! - **Bounded frames.** A request that passes [`validate_request`] occupies at most
//!   [`REQUEST_FRAME_SIZE_MAX`] bytes, so a server buffers whole valid requests in a fixed
//!   buffer and never buffers an invalid payload: [`RequestDecoder`] answers the header at once
//!   and then only counts the payload's bytes off as they arrive.
//! - **Keys and values are borrowed**, never copied or owned, by the decoders; the encoders write
//!   into caller-provided buffers.
//! - **Preconditions live in types.** [`validate_request`] is the only maker of a
//!   [`ValidatedRequest`]; a [`Request`] borrowed out of a buffer by [`RequestDecoder`] has a key
//!   of 1 ..= [`KEY_SIZE_MAX_BYTES`] bytes and a value of at most [`VALUE_SIZE_MAX_BYTES`].

use crate::wire::{Fields, FieldsMut};
use crate::{BufferTooSmall, output_prefix};

/// `"RFXK"` read as a little-endian u32.
pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"RFXK");
/// `"RFXV"` read as a little-endian u32.
pub const RESPONSE_MAGIC: u32 = u32::from_le_bytes(*b"RFXV");
/// The only protocol version this crate speaks.
pub const VERSION: u8 = 1;
pub const REQUEST_HEADER_SIZE: usize = 24;
pub const RESPONSE_HEADER_SIZE: usize = 24;
/// A BIND's key: one tenant handle, little-endian.
pub const BIND_KEY_SIZE_BYTES: usize = 8;
/// Longest key. Keys are never empty.
pub const KEY_SIZE_MAX_BYTES: usize = 255;
/// Largest value (64 KiB). Empty values are allowed.
pub const VALUE_SIZE_MAX_BYTES: usize = 64 << 10;
/// Largest valid request on the wire: the header, the longest key, the largest value. A
/// server's receive buffer of this size always holds a whole valid request.
pub const REQUEST_FRAME_SIZE_MAX: usize =
    REQUEST_HEADER_SIZE + KEY_SIZE_MAX_BYTES + VALUE_SIZE_MAX_BYTES;
/// Largest response on the wire: the header and the largest value.
pub const RESPONSE_FRAME_SIZE_MAX: usize = RESPONSE_HEADER_SIZE + VALUE_SIZE_MAX_BYTES;

const _: () = assert!(REQUEST_MAGIC == 0x4b58_4652);
const _: () = assert!(RESPONSE_MAGIC == 0x5658_4652);
const _: () = assert!(KEY_SIZE_MAX_BYTES <= u8::MAX as usize);
const _: () = assert!(KEY_SIZE_MAX_BYTES <= u16::MAX as usize);
const _: () = assert!(VALUE_SIZE_MAX_BYTES <= u32::MAX as usize);
const _: () = assert!(REQUEST_FRAME_SIZE_MAX == 65_815);

// ---------------------------------------------------------------------------------------------
// Opcodes and status codes.

/// Request opcodes; responses echo them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Store `value` under `key`, replacing any earlier value.
    Put = 0x01,
    /// The value stored under `key`.
    Get = 0x02,
    /// Remove `key`; `NOT_FOUND` when it is absent.
    Delete = 0x03,
    /// Every PUT and DELETE answered before this FLUSH was received survives a restart once
    /// FLUSH is answered `OK`.
    Flush = 0x04,
    /// Charge this connection's later requests to the tenant whose 8-byte handle (little-endian,
    /// as the native protocol writes handles) is the key; handle 0: back to the port's tenant.
    Bind = 0x05,
}

/// An opcode value v1 does not define.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown key-value opcode {0:#04x}")]
pub struct UnknownOpcode(pub u8);

impl Opcode {
    #[inline]
    pub const fn from_u8(value: u8) -> Result<Opcode, UnknownOpcode> {
        Ok(match value {
            0x01 => Opcode::Put,
            0x02 => Opcode::Get,
            0x03 => Opcode::Delete,
            0x04 => Opcode::Flush,
            0x05 => Opcode::Bind,
            _ => return Err(UnknownOpcode(value)),
        })
    }

    #[inline]
    pub const fn as_u8(self) -> u8 {
        self as u8
    }
}

/// Response status codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Status {
    Ok = 0,
    /// GET or DELETE of a key that is not stored.
    NotFound = 1,
    /// The key is longer than [`KEY_SIZE_MAX_BYTES`] or the value larger than
    /// [`VALUE_SIZE_MAX_BYTES`].
    TooLarge = 2,
    /// The PUT found no room: the key's probe window in the index, or the value area, is full.
    /// Nothing was changed.
    TableFull = 3,
    /// The request is not well formed (version, opcode, flags, reserved bits, empty key, a
    /// value or key where the opcode takes none).
    Invalid = 4,
    /// The device failed the operation.
    IoError = 5,
    /// BIND named no tenant of the table's namespace; the connection keeps its tenant.
    NoTenant = 6,
    /// The connection's tenant may not do this: it was removed (revoked), or its grant
    /// refuses the request (a read-only tenant writing).
    Permission = 7,
}

/// A status value v1 does not define; clients treat it as an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown key-value status {0}")]
pub struct UnknownStatus(pub u16);

impl Status {
    #[inline]
    pub const fn from_u16(value: u16) -> Result<Status, UnknownStatus> {
        Ok(match value {
            0 => Status::Ok,
            1 => Status::NotFound,
            2 => Status::TooLarge,
            3 => Status::TableFull,
            4 => Status::Invalid,
            5 => Status::IoError,
            6 => Status::NoTenant,
            7 => Status::Permission,
            _ => return Err(UnknownStatus(value)),
        })
    }

    #[inline]
    pub const fn as_u16(self) -> u16 {
        self as u16
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Status::Ok => "ok",
            Status::NotFound => "key not found",
            Status::TooLarge => "key or value too large",
            Status::TableFull => "table full",
            Status::Invalid => "invalid request",
            Status::IoError => "I/O error",
            Status::NoTenant => "no such tenant on the table's namespace",
            Status::Permission => "the connection's tenant may not do this",
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Request header.

/// Broken framing in a request: the server closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("bad key-value request magic {found:#010x} (expected {REQUEST_MAGIC:#010x})")]
    BadMagic { found: u32 },
}

/// A request header as received, every field raw, so it re-encodes byte for byte and the
/// response echoes the opcode even when it is unknown.
///
/// Layout (little-endian): magic u32 @0, version u8 @4, opcode u8 @5, flags u16 @6,
/// request_id u64 @8, key_length u16 @16, reserved u16 @18, value_length u32 @20.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestHeader {
    pub version: u8,
    pub opcode_raw: u8,
    pub flags: u16,
    pub request_id: u64,
    pub key_length_bytes: u16,
    pub reserved: u16,
    pub value_length_bytes: u32,
}

/// Decodes one request header from the front of `buf`: `Ok(None)` with fewer than
/// [`REQUEST_HEADER_SIZE`] bytes, `Ok(Some((header, 24)))` otherwise, `Err` on a wrong magic
/// (close the connection). `header.payload_length_bytes()` bytes follow it.
#[inline]
pub fn decode_request(buf: &[u8]) -> Result<Option<(RequestHeader, usize)>, RequestError> {
    RequestHeader::decode(buf)
}

impl RequestHeader {
    /// A v1 header for `opcode` with the given lengths.
    pub const fn new(
        opcode: Opcode,
        request_id: u64,
        key_length_bytes: u16,
        value_length_bytes: u32,
    ) -> RequestHeader {
        RequestHeader {
            version: VERSION,
            opcode_raw: opcode.as_u8(),
            flags: 0,
            request_id,
            key_length_bytes,
            reserved: 0,
            value_length_bytes,
        }
    }

    #[inline]
    pub const fn opcode(&self) -> Result<Opcode, UnknownOpcode> {
        Opcode::from_u8(self.opcode_raw)
    }

    /// Bytes that follow this header on the wire, whether or not the request is valid: the key
    /// and then the value, for every opcode, known or not. A server that rejects the request
    /// still consumes this many bytes. At most 65,535 + 4 GiB − 1, hence a u64.
    #[inline]
    pub const fn payload_length_bytes(&self) -> u64 {
        self.key_length_bytes as u64 + self.value_length_bytes as u64
    }

    /// See [`decode_request`].
    #[inline]
    pub fn decode(buf: &[u8]) -> Result<Option<(RequestHeader, usize)>, RequestError> {
        let Some(bytes) = buf.first_chunk::<REQUEST_HEADER_SIZE>() else {
            return Ok(None);
        };
        let f = Fields(bytes);
        let magic = f.u32_le::<0>();
        if magic != REQUEST_MAGIC {
            return Err(RequestError::BadMagic { found: magic });
        }
        let header = RequestHeader {
            version: f.u8_at::<4>(),
            opcode_raw: f.u8_at::<5>(),
            flags: f.u16_le::<6>(),
            request_id: f.u64_le::<8>(),
            key_length_bytes: f.u16_le::<16>(),
            reserved: f.u16_le::<18>(),
            value_length_bytes: f.u32_le::<20>(),
        };
        Ok(Some((header, REQUEST_HEADER_SIZE)))
    }

    #[inline]
    pub fn to_bytes(&self) -> [u8; REQUEST_HEADER_SIZE] {
        let mut bytes = [0u8; REQUEST_HEADER_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u32_le::<0>(REQUEST_MAGIC);
        f.put_u8::<4>(self.version);
        f.put_u8::<5>(self.opcode_raw);
        f.put_u16_le::<6>(self.flags);
        f.put_u64_le::<8>(self.request_id);
        f.put_u16_le::<16>(self.key_length_bytes);
        f.put_u16_le::<18>(self.reserved);
        f.put_u32_le::<20>(self.value_length_bytes);
        bytes
    }

    #[inline]
    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, BufferTooSmall> {
        output_prefix(out, REQUEST_HEADER_SIZE)?.copy_from_slice(&self.to_bytes());
        Ok(REQUEST_HEADER_SIZE)
    }
}

// ---------------------------------------------------------------------------------------------
// Validation.

/// A request header that passed [`validate_request`]: version 1, a known opcode, no flags or
/// reserved bits, and lengths that fit the opcode and the limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ValidatedRequest {
    opcode: Opcode,
    request_id: u64,
    key_length_bytes: u8,
    value_length_bytes: u32,
}

impl ValidatedRequest {
    #[inline]
    pub const fn opcode(&self) -> Opcode {
        self.opcode
    }
    #[inline]
    pub const fn request_id(&self) -> u64 {
        self.request_id
    }
    /// 1 ..= 255 for PUT, GET and DELETE; 8 for BIND; 0 for FLUSH.
    #[inline]
    pub const fn key_length_bytes(&self) -> usize {
        self.key_length_bytes as usize
    }
    /// At most [`VALUE_SIZE_MAX_BYTES`]; 0 for everything but PUT.
    #[inline]
    pub const fn value_length_bytes(&self) -> usize {
        self.value_length_bytes as usize
    }
    /// The whole frame: header, key and value (at most [`REQUEST_FRAME_SIZE_MAX`]).
    #[inline]
    pub const fn frame_length_bytes(&self) -> usize {
        REQUEST_HEADER_SIZE + self.key_length_bytes() + self.value_length_bytes()
    }
}

/// Checks a decoded header; the error is the status to answer with. Either way the server
/// consumes `header.payload_length_bytes()`.
///
/// Order of checks (the first failing one decides the status):
/// 1. version ≠ 1, unknown opcode, flags or reserved not zero → `INVALID`;
/// 2. key longer than 255 bytes, or value larger than 64 KiB → `TOO_LARGE`;
/// 3. FLUSH with a key, PUT/GET/DELETE with an empty key, or BIND with a key of other than
///    [`BIND_KEY_SIZE_BYTES`] bytes → `INVALID`;
/// 4. GET, DELETE, FLUSH or BIND with a value → `INVALID`.
pub fn validate_request(header: &RequestHeader) -> Result<ValidatedRequest, Status> {
    if header.version != VERSION || header.flags != 0 || header.reserved != 0 {
        return Err(Status::Invalid);
    }
    let opcode = header.opcode().map_err(|_| Status::Invalid)?;
    if usize::from(header.key_length_bytes) > KEY_SIZE_MAX_BYTES
        || header.value_length_bytes as usize > VALUE_SIZE_MAX_BYTES
    {
        return Err(Status::TooLarge);
    }
    let key_wanted = opcode != Opcode::Flush;
    if key_wanted != (header.key_length_bytes != 0) {
        return Err(Status::Invalid);
    }
    if opcode == Opcode::Bind && usize::from(header.key_length_bytes) != BIND_KEY_SIZE_BYTES {
        return Err(Status::Invalid);
    }
    if opcode != Opcode::Put && header.value_length_bytes != 0 {
        return Err(Status::Invalid);
    }
    let validated = ValidatedRequest {
        opcode,
        request_id: header.request_id,
        // ≤ 255, checked above.
        key_length_bytes: header.key_length_bytes as u8,
        value_length_bytes: header.value_length_bytes,
    };
    debug_assert!(validated.frame_length_bytes() <= REQUEST_FRAME_SIZE_MAX);
    Ok(validated)
}

// ---------------------------------------------------------------------------------------------
// Whole requests.

/// A valid request with its key and value borrowed from the receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Request<'a> {
    Put {
        key: &'a [u8],
        value: &'a [u8],
    },
    Get {
        key: &'a [u8],
    },
    Delete {
        key: &'a [u8],
    },
    Flush,
    /// `key`: the tenant handle's 8 bytes (see [`Request::bind_handle`]).
    Bind {
        key: &'a [u8],
    },
}

impl<'a> Request<'a> {
    pub const fn opcode(&self) -> Opcode {
        match self {
            Request::Put { .. } => Opcode::Put,
            Request::Get { .. } => Opcode::Get,
            Request::Delete { .. } => Opcode::Delete,
            Request::Flush => Opcode::Flush,
            Request::Bind { .. } => Opcode::Bind,
        }
    }

    /// A BIND's tenant handle: `Some` for a BIND whose key is 8 bytes (always, once decoded).
    pub fn bind_handle(&self) -> Option<u64> {
        match self {
            Request::Bind { key } => key
                .first_chunk::<BIND_KEY_SIZE_BYTES>()
                .filter(|_| key.len() == BIND_KEY_SIZE_BYTES)
                .map(|bytes| u64::from_le_bytes(*bytes)),
            _ => None,
        }
    }

    /// The key (empty for FLUSH).
    pub const fn key(&self) -> &'a [u8] {
        match self {
            Request::Put { key, .. }
            | Request::Get { key }
            | Request::Delete { key }
            | Request::Bind { key } => key,
            Request::Flush => &[],
        }
    }

    /// The value (empty for everything but PUT).
    pub const fn value(&self) -> &'a [u8] {
        match self {
            Request::Put { value, .. } => value,
            _ => &[],
        }
    }

    /// Bytes [`encode_into`](Self::encode_into) writes.
    pub const fn encoded_length_bytes(&self) -> usize {
        REQUEST_HEADER_SIZE + self.key().len() + self.value().len()
    }

    /// The header for this request. The lengths are the key's and the value's, whatever they
    /// are (a client may send an oversize key or value on purpose, and the server answers
    /// `TOO_LARGE`), but they must fit the header's fields: a key of more than 65,535 bytes or a
    /// value of 4 GiB or more is a caller bug.
    pub fn header(&self, request_id: u64) -> RequestHeader {
        let key_length_bytes =
            u16::try_from(self.key().len()).expect("key longer than the header's u16 field");
        let value_length_bytes =
            u32::try_from(self.value().len()).expect("value larger than the header's u32 field");
        RequestHeader::new(
            self.opcode(),
            request_id,
            key_length_bytes,
            value_length_bytes,
        )
    }

    /// Writes the whole frame (header, key, value) to the front of `out`; returns its length.
    pub fn encode_into(&self, request_id: u64, out: &mut [u8]) -> Result<usize, BufferTooSmall> {
        let length = self.encoded_length_bytes();
        let out = output_prefix(out, length)?;
        let (header_out, rest) = out.split_at_mut(REQUEST_HEADER_SIZE);
        header_out.copy_from_slice(&self.header(request_id).to_bytes());
        let (key_out, value_out) = rest.split_at_mut(self.key().len());
        key_out.copy_from_slice(self.key());
        value_out.copy_from_slice(self.value());
        Ok(length)
    }
}

/// What [`RequestDecoder::decode`] found at the front of the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// A valid request, whole; answer it.
    Request {
        request_id: u64,
        request: Request<'a>,
    },
    /// A header that failed [`validate_request`]: answer it with `status` now. Its payload is
    /// skipped by the following calls.
    Rejected {
        header: RequestHeader,
        status: Status,
    },
}

/// Incremental decoder of a server's request stream. Call [`decode`](Self::decode) on the
/// unconsumed front of the receive buffer until it consumes nothing, drop the consumed bytes,
/// read more, repeat.
///
/// It holds one number, the payload bytes of a rejected request still to skip, so an invalid
/// request's payload (up to 4 GiB) is counted off as it streams past and never buffered. A
/// valid request is only returned whole, which needs at most [`REQUEST_FRAME_SIZE_MAX`] bytes
/// of buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestDecoder {
    skip_remaining_bytes: u64,
}

impl RequestDecoder {
    pub const fn new() -> RequestDecoder {
        RequestDecoder {
            skip_remaining_bytes: 0,
        }
    }

    /// Payload bytes of a rejected request still to be skipped.
    pub const fn skip_remaining_bytes(&self) -> u64 {
        self.skip_remaining_bytes
    }

    /// Decodes from the front of `buf`; returns what was found (if anything) and the bytes
    /// consumed. `(None, 0)`: read more. `(None, n > 0)`: `n` payload bytes of a rejected
    /// request were skipped. `Err`: broken framing, close the connection.
    pub fn decode<'a>(
        &mut self,
        buf: &'a [u8],
    ) -> Result<(Option<Decoded<'a>>, usize), RequestError> {
        if self.skip_remaining_bytes > 0 {
            let skipped = self
                .skip_remaining_bytes
                .min(u64::try_from(buf.len()).unwrap_or(u64::MAX));
            self.skip_remaining_bytes -= skipped;
            // ≤ buf.len().
            return Ok((None, skipped as usize));
        }
        let Some((header, header_bytes)) = decode_request(buf)? else {
            return Ok((None, 0));
        };
        let validated = match validate_request(&header) {
            Ok(validated) => validated,
            Err(status) => {
                self.skip_remaining_bytes = header.payload_length_bytes();
                return Ok((Some(Decoded::Rejected { header, status }), header_bytes));
            }
        };
        let Some(frame) = buf.get(..validated.frame_length_bytes()) else {
            return Ok((None, 0));
        };
        let (key, value) = frame[header_bytes..].split_at(validated.key_length_bytes());
        let request = match validated.opcode() {
            Opcode::Put => Request::Put { key, value },
            Opcode::Get => Request::Get { key },
            Opcode::Delete => Request::Delete { key },
            Opcode::Flush => Request::Flush,
            Opcode::Bind => Request::Bind { key },
        };
        debug_assert_eq!(request.encoded_length_bytes(), frame.len());
        let decoded = Decoded::Request {
            request_id: validated.request_id(),
            request,
        };
        Ok((Some(decoded), frame.len()))
    }
}

// ---------------------------------------------------------------------------------------------
// Responses.

/// A response the client cannot interpret; the client closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResponseError {
    #[error("bad key-value response magic {found:#010x} (expected {RESPONSE_MAGIC:#010x})")]
    BadMagic { found: u32 },
    #[error("key-value response version {found}, this client speaks {VERSION}")]
    UnsupportedVersion { found: u8 },
    #[error("key-value response reserved field is {found:#x}, not zero")]
    ReservedNotZero { found: u32 },
    #[error("key-value response carries {found} bytes, at most {VALUE_SIZE_MAX_BYTES} allowed")]
    ValueTooLarge { found: u32 },
}

/// A response header. Opcode and status stay raw: the server echoes opcodes it does not know,
/// and a client treats status values it does not know as errors, not as broken framing.
///
/// Layout (little-endian): magic u32 @0, version u8 @4, opcode u8 @5, status u16 @6,
/// request_id u64 @8, value_length u32 @16, reserved u32 @20.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ResponseHeader {
    pub opcode_raw: u8,
    pub status_raw: u16,
    pub request_id: u64,
    /// Bytes of value that follow: the value of a successful GET, 0 otherwise.
    pub value_length_bytes: u32,
}

/// Decodes one response header (client side). Checks, in order: magic, version, reserved
/// field, value length ≤ 64 KiB.
#[inline]
pub fn decode_response(buf: &[u8]) -> Result<Option<(ResponseHeader, usize)>, ResponseError> {
    ResponseHeader::decode(buf)
}

/// One whole response borrowed from the client's receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseFrame<'a> {
    pub header: ResponseHeader,
    /// The value of a successful GET; empty otherwise.
    pub value: &'a [u8],
    /// Bytes the frame occupied: the header and the value.
    pub length_bytes: usize,
}

/// Decodes one whole response: `Ok(None)` until the header and its value are all in `buf`.
pub fn decode_response_frame(buf: &[u8]) -> Result<Option<ResponseFrame<'_>>, ResponseError> {
    let Some((header, header_bytes)) = decode_response(buf)? else {
        return Ok(None);
    };
    // ≤ 64 KiB, checked by the decoder.
    let length_bytes = header_bytes + header.value_length_bytes as usize;
    Ok(buf
        .get(header_bytes..length_bytes)
        .map(|value| ResponseFrame {
            header,
            value,
            length_bytes,
        }))
}

impl ResponseHeader {
    /// The answer to `header` (valid or not): its opcode and id echoed.
    pub const fn for_request(
        header: &RequestHeader,
        status: Status,
        value_length_bytes: u32,
    ) -> ResponseHeader {
        ResponseHeader {
            opcode_raw: header.opcode_raw,
            status_raw: status.as_u16(),
            request_id: header.request_id,
            value_length_bytes,
        }
    }

    pub const fn new(
        opcode: Opcode,
        status: Status,
        request_id: u64,
        value_length_bytes: u32,
    ) -> ResponseHeader {
        ResponseHeader {
            opcode_raw: opcode.as_u8(),
            status_raw: status.as_u16(),
            request_id,
            value_length_bytes,
        }
    }

    #[inline]
    pub const fn status(&self) -> Result<Status, UnknownStatus> {
        Status::from_u16(self.status_raw)
    }

    #[inline]
    pub const fn opcode(&self) -> Result<Opcode, UnknownOpcode> {
        Opcode::from_u8(self.opcode_raw)
    }

    /// See [`decode_response`].
    pub fn decode(buf: &[u8]) -> Result<Option<(ResponseHeader, usize)>, ResponseError> {
        let Some(bytes) = buf.first_chunk::<RESPONSE_HEADER_SIZE>() else {
            return Ok(None);
        };
        let f = Fields(bytes);
        let magic = f.u32_le::<0>();
        if magic != RESPONSE_MAGIC {
            return Err(ResponseError::BadMagic { found: magic });
        }
        let version = f.u8_at::<4>();
        if version != VERSION {
            return Err(ResponseError::UnsupportedVersion { found: version });
        }
        let reserved = f.u32_le::<20>();
        if reserved != 0 {
            return Err(ResponseError::ReservedNotZero { found: reserved });
        }
        let value_length_bytes = f.u32_le::<16>();
        if value_length_bytes as usize > VALUE_SIZE_MAX_BYTES {
            return Err(ResponseError::ValueTooLarge {
                found: value_length_bytes,
            });
        }
        let header = ResponseHeader {
            opcode_raw: f.u8_at::<5>(),
            status_raw: f.u16_le::<6>(),
            request_id: f.u64_le::<8>(),
            value_length_bytes,
        };
        Ok(Some((header, RESPONSE_HEADER_SIZE)))
    }

    /// The header's bytes. A value length over 64 KiB is a server bug (asserted): the client
    /// would refuse it.
    pub fn to_bytes(&self) -> [u8; RESPONSE_HEADER_SIZE] {
        assert!(self.value_length_bytes as usize <= VALUE_SIZE_MAX_BYTES);
        let mut bytes = [0u8; RESPONSE_HEADER_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u32_le::<0>(RESPONSE_MAGIC);
        f.put_u8::<4>(VERSION);
        f.put_u8::<5>(self.opcode_raw);
        f.put_u16_le::<6>(self.status_raw);
        f.put_u64_le::<8>(self.request_id);
        f.put_u32_le::<16>(self.value_length_bytes);
        // Bytes 20..24 are the reserved field, left zero.
        bytes
    }

    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, BufferTooSmall> {
        output_prefix(out, RESPONSE_HEADER_SIZE)?.copy_from_slice(&self.to_bytes());
        Ok(RESPONSE_HEADER_SIZE)
    }
}
