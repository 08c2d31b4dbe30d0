//! The ReFlex native protocol v1 (`docs/PROTOCOL.md` §1): 32-byte request header, 24-byte
//! response header, HELLO and capabilities bodies, and the validation that turns a decoded
//! request into a typed [`ValidatedRequest`] or an error [`Status`].
//!
//! Why it is shaped this way:
//! - **Framing is separate from validity.** [`decode_request`] fails only on a wrong magic
//!   (broken framing: the server closes that connection). Every other defect — unknown version,
//!   opcode or flag, bad range — still yields a [`RequestHeader`], because the server must answer
//!   it with an error status and skip its payload. [`RequestHeader::payload_length_bytes`] says
//!   how many payload bytes follow *any* header, valid or not.
//! - **The codec never owns payloads.** A WRITE's data goes straight from the socket into the
//!   server's aligned buffers; decoding returns the header and how many bytes it occupied, and the
//!   server moves the payload itself. Many pipelined requests are parsed out of one receive
//!   buffer by calling [`decode_request`] repeatedly on what is left.
//! - **Raw values are kept where they must be echoed.** The header stores the opcode, version
//!   and flags as received; [`RequestHeader::opcode`] and friends parse them on demand.
//! - **Preconditions live in types.** [`validate_request`] is the one place that checks a request
//!   against the server's limits and namespace table; a [`ValidatedIo`] can only be made there,
//!   so code after it can assert instead of re-checking.

use crate::wire::{Fields, FieldsMut};
use crate::{BufferTooSmall, output_prefix};

/// `"RFXQ"` read as a little-endian u32.
pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"RFXQ");
/// `"RFXR"` read as a little-endian u32.
pub const RESPONSE_MAGIC: u32 = u32::from_le_bytes(*b"RFXR");
/// The only protocol version this crate speaks.
pub const VERSION: u8 = 1;
pub const REQUEST_HEADER_SIZE: usize = 32;
pub const RESPONSE_HEADER_SIZE: usize = 24;
pub const HELLO_BODY_SIZE: usize = 16;
/// Fixed part of the capabilities body, before the namespace list.
pub const CAPABILITIES_FIXED_SIZE: usize = 20;
pub const NAMESPACE_ENTRY_SIZE: usize = 16;
pub const NAMESPACE_COUNT_MAX: usize = 256;
/// Largest capabilities body: the fixed part plus [`NAMESPACE_COUNT_MAX`] entries.
pub const CAPABILITIES_SIZE_MAX: usize =
    CAPABILITIES_FIXED_SIZE + NAMESPACE_ENTRY_SIZE * NAMESPACE_COUNT_MAX;
/// Largest body of a control request (REGISTER, UNREGISTER, BIND, REPORT) the server buffers; a longer
/// one is answered `TOO_LARGE` and its payload skipped. Bodies go into a small per-connection
/// buffer, never into the I/O buffer arena, so this bound sizes that buffer.
pub const CONTROL_BODY_MAX_BYTES: u32 = 4096;
/// `request_id` of unsolicited notices (RENEGOTIATE).
pub const NOTICE_REQUEST_ID: u64 = u64::MAX;
pub const BLOCK_SIZE_BYTES_DEFAULT: u32 = 512;
pub const IO_SIZE_MAX_BYTES_DEFAULT: u32 = 1 << 20;

const _: () = assert!(REQUEST_MAGIC == 0x5158_4652);
const _: () = assert!(RESPONSE_MAGIC == 0x5258_4652);
const _: () = assert!(HELLO_BODY_SIZE as u32 <= CONTROL_BODY_MAX_BYTES);
const _: () = assert!(CAPABILITIES_SIZE_MAX == 4116);

// ---------------------------------------------------------------------------------------------
// Opcodes, flags, status codes.

/// Request and response opcodes (§1.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    Hello = 0x01,
    Read = 0x02,
    Write = 0x03,
    Flush = 0x04,
    Trim = 0x05,
    Register = 0x10,
    Unregister = 0x11,
    Bind = 0x12,
    /// A latency-critical tenant's client tells the server what it measured (§1.9).
    Report = 0x13,
    /// Server to client only.
    Renegotiate = 0x20,
}

/// An opcode value §1.3 does not define.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown opcode {0:#04x}")]
pub struct UnknownOpcode(pub u8);

impl Opcode {
    #[inline]
    pub const fn from_u8(value: u8) -> Result<Opcode, UnknownOpcode> {
        Ok(match value {
            0x01 => Opcode::Hello,
            0x02 => Opcode::Read,
            0x03 => Opcode::Write,
            0x04 => Opcode::Flush,
            0x05 => Opcode::Trim,
            0x10 => Opcode::Register,
            0x11 => Opcode::Unregister,
            0x12 => Opcode::Bind,
            0x13 => Opcode::Report,
            0x20 => Opcode::Renegotiate,
            _ => return Err(UnknownOpcode(value)),
        })
    }

    #[inline]
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// Whether a request with this opcode is followed by `length` bytes of payload (§1.1).
    #[inline]
    pub const fn has_request_payload(self) -> bool {
        matches!(
            self,
            Opcode::Write
                | Opcode::Hello
                | Opcode::Register
                | Opcode::Unregister
                | Opcode::Bind
                | Opcode::Report
        )
    }
}

/// Request flags (§1.1): bit 0 is FUA; every other bit must be zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RequestFlags(u16);

impl RequestFlags {
    pub const NONE: RequestFlags = RequestFlags(0);
    pub const FUA: RequestFlags = RequestFlags(1);
    pub const KNOWN: RequestFlags = RequestFlags(1);

    /// Keeps every bit, known or not, so the header re-encodes exactly as received.
    #[inline]
    pub const fn from_bits_retain(bits: u16) -> RequestFlags {
        RequestFlags(bits)
    }
    #[inline]
    pub const fn bits(self) -> u16 {
        self.0
    }
    #[inline]
    pub const fn fua(self) -> bool {
        self.0 & Self::FUA.0 != 0
    }
    /// Bits that v1 does not define.
    #[inline]
    pub const fn unknown_bits(self) -> u16 {
        self.0 & !Self::KNOWN.0
    }
}

/// Response status codes (§1.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Status {
    Ok = 0,
    Invalid = 1,
    OutOfRange = 2,
    Permission = 3,
    NoSuchNamespace = 4,
    TooLarge = 5,
    IoError = 6,
    Busy = 7,
    UnsupportedVersion = 8,
    Refused = 9,
    /// The device is out of space (ENOSPC) or the writer over its quota (EDQUOT).
    NoSpace = 10,
}

/// A status value §1.4 does not define; clients treat it as an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown status {0}")]
pub struct UnknownStatus(pub u16);

impl Status {
    #[inline]
    pub const fn from_u16(value: u16) -> Result<Status, UnknownStatus> {
        Ok(match value {
            0 => Status::Ok,
            1 => Status::Invalid,
            2 => Status::OutOfRange,
            3 => Status::Permission,
            4 => Status::NoSuchNamespace,
            5 => Status::TooLarge,
            6 => Status::IoError,
            7 => Status::Busy,
            8 => Status::UnsupportedVersion,
            9 => Status::Refused,
            10 => Status::NoSpace,
            _ => return Err(UnknownStatus(value)),
        })
    }

    #[inline]
    pub const fn as_u16(self) -> u16 {
        self as u16
    }

    pub const fn is_ok(self) -> bool {
        matches!(self, Status::Ok)
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Status::Ok => "ok",
            Status::Invalid => "invalid request",
            Status::OutOfRange => "out of range",
            Status::Permission => "permission denied",
            Status::NoSuchNamespace => "no such namespace",
            Status::TooLarge => "request too large",
            Status::IoError => "I/O error",
            Status::Busy => "server busy",
            Status::UnsupportedVersion => "unsupported protocol version",
            Status::Refused => "refused",
            Status::NoSpace => "no space left on device",
        };
        f.write_str(name)
    }
}

// ---------------------------------------------------------------------------------------------
// Request header.

/// Broken framing in a request: the server closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("bad request magic {found:#010x} (expected {REQUEST_MAGIC:#010x})")]
    BadMagic { found: u32 },
}

/// A request header as received: every field raw, so it re-encodes byte for byte and the
/// response can echo the opcode even when it is unknown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestHeader {
    pub version: u8,
    pub opcode_raw: u8,
    pub flags: RequestFlags,
    pub request_id: u64,
    pub offset_bytes: u64,
    pub length_bytes: u32,
    pub namespace_id: u32,
}

/// Decodes one request header from the front of `buf`.
///
/// `Ok(None)`: fewer than [`REQUEST_HEADER_SIZE`] bytes, read more. `Ok(Some((header, n)))`: the
/// header occupied the first `n` bytes; `header.payload_length_bytes()` bytes of payload follow.
/// `Err`: broken framing, close the connection.
#[inline]
pub fn decode_request(buf: &[u8]) -> Result<Option<(RequestHeader, usize)>, RequestError> {
    RequestHeader::decode(buf)
}

/// Decodes one response header from the front of `buf` (client side); see [`decode_request`].
#[inline]
pub fn decode_response(buf: &[u8]) -> Result<Option<(ResponseHeader, usize)>, ResponseError> {
    ResponseHeader::decode(buf)
}

impl RequestHeader {
    /// A header with `opcode` and every other field zero except `request_id`.
    pub const fn new(opcode: Opcode, request_id: u64) -> RequestHeader {
        RequestHeader {
            version: VERSION,
            opcode_raw: opcode.as_u8(),
            flags: RequestFlags::NONE,
            request_id,
            offset_bytes: 0,
            length_bytes: 0,
            namespace_id: 0,
        }
    }

    pub const fn read(
        request_id: u64,
        namespace_id: u32,
        offset_bytes: u64,
        length_bytes: u32,
    ) -> RequestHeader {
        RequestHeader {
            offset_bytes,
            length_bytes,
            namespace_id,
            ..Self::new(Opcode::Read, request_id)
        }
    }

    /// A WRITE header; `length_bytes` of payload must follow it.
    pub const fn write(
        request_id: u64,
        namespace_id: u32,
        offset_bytes: u64,
        length_bytes: u32,
        fua: bool,
    ) -> RequestHeader {
        let flags = if fua {
            RequestFlags::FUA
        } else {
            RequestFlags::NONE
        };
        RequestHeader {
            flags,
            offset_bytes,
            length_bytes,
            namespace_id,
            ..Self::new(Opcode::Write, request_id)
        }
    }

    pub const fn flush(request_id: u64, namespace_id: u32) -> RequestHeader {
        RequestHeader {
            namespace_id,
            ..Self::new(Opcode::Flush, request_id)
        }
    }

    pub const fn trim(
        request_id: u64,
        namespace_id: u32,
        offset_bytes: u64,
        length_bytes: u32,
    ) -> RequestHeader {
        RequestHeader {
            offset_bytes,
            length_bytes,
            namespace_id,
            ..Self::new(Opcode::Trim, request_id)
        }
    }

    /// A HELLO header; a [`HelloBody`] must follow it.
    pub const fn hello(request_id: u64) -> RequestHeader {
        RequestHeader {
            length_bytes: HELLO_BODY_SIZE as u32,
            ..Self::new(Opcode::Hello, request_id)
        }
    }

    /// The opcode, if v1 defines it.
    #[inline]
    pub const fn opcode(&self) -> Result<Opcode, UnknownOpcode> {
        Opcode::from_u8(self.opcode_raw)
    }

    /// Bytes of payload that follow this header on the wire, whether or not the request is
    /// valid: `length` for WRITE, HELLO, REGISTER, UNREGISTER, BIND and REPORT, zero for every other
    /// opcode, known or not (§1.1, §1.3). A server that rejects the request still consumes this
    /// many bytes so the stream stays in step.
    #[inline]
    pub const fn payload_length_bytes(&self) -> u32 {
        match Opcode::from_u8(self.opcode_raw) {
            Ok(opcode) if opcode.has_request_payload() => self.length_bytes,
            _ => 0,
        }
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
            flags: RequestFlags::from_bits_retain(f.u16_le::<6>()),
            request_id: f.u64_le::<8>(),
            offset_bytes: f.u64_le::<16>(),
            length_bytes: f.u32_le::<24>(),
            namespace_id: f.u32_le::<28>(),
        };
        Ok(Some((header, REQUEST_HEADER_SIZE)))
    }

    /// The header's wire bytes. Infallible; the caller copies them where they belong.
    #[inline]
    pub fn to_bytes(&self) -> [u8; REQUEST_HEADER_SIZE] {
        let mut bytes = [0u8; REQUEST_HEADER_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u32_le::<0>(REQUEST_MAGIC);
        f.put_u8::<4>(self.version);
        f.put_u8::<5>(self.opcode_raw);
        f.put_u16_le::<6>(self.flags.bits());
        f.put_u64_le::<8>(self.request_id);
        f.put_u64_le::<16>(self.offset_bytes);
        f.put_u32_le::<24>(self.length_bytes);
        f.put_u32_le::<28>(self.namespace_id);
        bytes
    }

    /// Writes the header to the front of `out`; returns the bytes written.
    #[inline]
    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, BufferTooSmall> {
        output_prefix(out, REQUEST_HEADER_SIZE)?.copy_from_slice(&self.to_bytes());
        Ok(REQUEST_HEADER_SIZE)
    }
}

// ---------------------------------------------------------------------------------------------
// Response header.

/// A response header the client cannot interpret; the client closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResponseError {
    #[error("bad response magic {found:#010x} (expected {RESPONSE_MAGIC:#010x})")]
    BadMagic { found: u32 },
    #[error("response version {found}, this client speaks {VERSION}")]
    UnsupportedVersion { found: u8 },
    #[error("response reserved field is {found:#x}, not zero")]
    ReservedNotZero { found: u32 },
}

/// A response header. The opcode and status are kept raw: the server echoes opcodes it does not
/// know, and a client must treat status values it does not know as errors, not as broken framing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ResponseHeader {
    pub opcode_raw: u8,
    pub status_raw: u16,
    pub request_id: u64,
    /// Bytes of payload that follow this header.
    pub length_bytes: u32,
}

impl ResponseHeader {
    pub const fn new(
        opcode_raw: u8,
        status: Status,
        request_id: u64,
        length_bytes: u32,
    ) -> ResponseHeader {
        ResponseHeader {
            opcode_raw,
            status_raw: status.as_u16(),
            request_id,
            length_bytes,
        }
    }

    /// The response to `request`: its opcode and id echoed.
    #[inline]
    pub const fn for_request(
        request: &RequestHeader,
        status: Status,
        length_bytes: u32,
    ) -> ResponseHeader {
        Self::new(request.opcode_raw, status, request.request_id, length_bytes)
    }

    /// An unsolicited RENEGOTIATE notice carrying `length_bytes` of body.
    pub const fn notice(length_bytes: u32) -> ResponseHeader {
        Self::new(
            Opcode::Renegotiate.as_u8(),
            Status::Ok,
            NOTICE_REQUEST_ID,
            length_bytes,
        )
    }

    #[inline]
    pub const fn status(&self) -> Result<Status, UnknownStatus> {
        Status::from_u16(self.status_raw)
    }

    #[inline]
    pub const fn opcode(&self) -> Result<Opcode, UnknownOpcode> {
        Opcode::from_u8(self.opcode_raw)
    }

    /// See [`decode_response`]. Checks, in order: magic, version, reserved field.
    #[inline]
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
        let header = ResponseHeader {
            opcode_raw: f.u8_at::<5>(),
            status_raw: f.u16_le::<6>(),
            request_id: f.u64_le::<8>(),
            length_bytes: f.u32_le::<16>(),
        };
        Ok(Some((header, RESPONSE_HEADER_SIZE)))
    }

    #[inline]
    pub fn to_bytes(&self) -> [u8; RESPONSE_HEADER_SIZE] {
        let mut bytes = [0u8; RESPONSE_HEADER_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u32_le::<0>(RESPONSE_MAGIC);
        f.put_u8::<4>(VERSION);
        f.put_u8::<5>(self.opcode_raw);
        f.put_u16_le::<6>(self.status_raw);
        f.put_u64_le::<8>(self.request_id);
        f.put_u32_le::<16>(self.length_bytes);
        // Bytes 20..24 are the reserved field, left zero.
        bytes
    }

    #[inline]
    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, BufferTooSmall> {
        output_prefix(out, RESPONSE_HEADER_SIZE)?.copy_from_slice(&self.to_bytes());
        Ok(RESPONSE_HEADER_SIZE)
    }
}

// ---------------------------------------------------------------------------------------------
// Bodies.

/// A HELLO or capabilities body that does not follow §1.5. The server answers a malformed HELLO
/// body with `INVALID`; a client treats a malformed capabilities body as a broken server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("body is {found_bytes} bytes, expected {expected_bytes}")]
    WrongLength {
        expected_bytes: usize,
        found_bytes: usize,
    },
    #[error("hello version_max is 0")]
    VersionMaxZero,
    #[error("flags {found:#x} set where v1 defines none")]
    UnknownFlags { found: u32 },
    #[error("reserved bytes are not zero")]
    ReservedNotZero,
    #[error("capabilities version {found}, this client speaks {VERSION}")]
    UnsupportedVersion { found: u16 },
    #[error("{count} namespaces, at most {NAMESPACE_COUNT_MAX} allowed")]
    TooManyNamespaces { count: u32 },
    #[error("block size {found} is not a power of two")]
    BadBlockSize { found: u32 },
    #[error("max I/O size {found} is not a positive multiple of the block size")]
    BadIoSizeMax { found: u32 },
    #[error("window is 0")]
    WindowZero,
    #[error("tenant class {found} is neither 1 (latency-critical) nor 2 (best-effort)")]
    UnknownClass { found: u8 },
    #[error("invalid tenant body: {reason}")]
    InvalidTenant { reason: &'static str },
}

/// Request body of HELLO (§1.5). Flags and reserved bytes are zero in v1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HelloBody {
    /// Highest protocol version the client speaks (≥ 1).
    pub version_max: u16,
    /// The client's Linux I/O priority, `class << 13 | level`; 0 means none.
    pub io_priority: u16,
}

impl HelloBody {
    /// I/O priority class (Linux `IOPRIO_PRIO_CLASS`): 0 none, 1 real-time, 2 best-effort, 3 idle.
    pub const fn io_priority_class(&self) -> u16 {
        self.io_priority >> 13
    }

    /// I/O priority level within the class (Linux `IOPRIO_PRIO_DATA`, 0 highest … 7 lowest).
    pub const fn io_priority_level(&self) -> u16 {
        self.io_priority & 0x1fff
    }

    pub fn to_bytes(&self) -> [u8; HELLO_BODY_SIZE] {
        let mut bytes = [0u8; HELLO_BODY_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u16_le::<0>(self.version_max);
        f.put_u16_le::<2>(self.io_priority);
        // flags (4..8) and reserved (8..16) stay zero.
        bytes
    }

    /// Decodes a complete body (`length` bytes from the header). Checks, in order: length,
    /// version_max, flags, reserved.
    pub fn decode(body: &[u8]) -> Result<HelloBody, BodyError> {
        let bytes: &[u8; HELLO_BODY_SIZE] =
            body.try_into().map_err(|_| BodyError::WrongLength {
                expected_bytes: HELLO_BODY_SIZE,
                found_bytes: body.len(),
            })?;
        let f = Fields(bytes);
        let version_max = f.u16_le::<0>();
        if version_max == 0 {
            return Err(BodyError::VersionMaxZero);
        }
        let flags = f.u32_le::<4>();
        if flags != 0 {
            return Err(BodyError::UnknownFlags { found: flags });
        }
        if f.u64_le::<8>() != 0 {
            return Err(BodyError::ReservedNotZero);
        }
        Ok(HelloBody {
            version_max,
            io_priority: f.u16_le::<2>(),
        })
    }
}

/// One namespace as the server describes it: in the capabilities body and in the namespace
/// table that [`validate_request`] checks against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Namespace {
    pub id: u32,
    pub size_bytes: u64,
    pub read_only: bool,
}

/// Namespace flag bit 0 in the capabilities body.
const NAMESPACE_FLAG_READ_ONLY: u32 = 1;

impl Namespace {
    fn to_bytes(self) -> [u8; NAMESPACE_ENTRY_SIZE] {
        let mut bytes = [0u8; NAMESPACE_ENTRY_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u32_le::<0>(self.id);
        f.put_u32_le::<4>(if self.read_only {
            NAMESPACE_FLAG_READ_ONLY
        } else {
            0
        });
        f.put_u64_le::<8>(self.size_bytes);
        bytes
    }

    fn decode(bytes: &[u8; NAMESPACE_ENTRY_SIZE]) -> Result<Namespace, BodyError> {
        let f = Fields(bytes);
        let flags = f.u32_le::<4>();
        if flags & !NAMESPACE_FLAG_READ_ONLY != 0 {
            return Err(BodyError::UnknownFlags { found: flags });
        }
        Ok(Namespace {
            id: f.u32_le::<0>(),
            read_only: flags & NAMESPACE_FLAG_READ_ONLY != 0,
            size_bytes: f.u64_le::<8>(),
        })
    }
}

/// The fixed part of the capabilities body (§1.5); the namespace list travels beside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Capabilities {
    pub version: u16,
    pub block_size_bytes: u32,
    pub io_size_max_bytes: u32,
    /// Requests a connection may have outstanding before the server stops reading it.
    pub window_requests: u32,
}

impl Capabilities {
    /// The capabilities a server with `limits` announces.
    pub const fn from_limits(limits: &ServerLimits, window_requests: u32) -> Capabilities {
        Capabilities {
            version: VERSION as u16,
            block_size_bytes: limits.block_size_bytes(),
            io_size_max_bytes: limits.io_size_max_bytes(),
            window_requests,
        }
    }

    /// Body size with `namespace_count` entries.
    pub const fn encoded_size(namespace_count: usize) -> usize {
        CAPABILITIES_FIXED_SIZE + NAMESPACE_ENTRY_SIZE * namespace_count
    }

    /// Writes the body to the front of `out`; returns its length (the response's `length`).
    /// More than [`NAMESPACE_COUNT_MAX`] namespaces is a server configuration bug.
    pub fn encode_into(
        &self,
        namespaces: &[Namespace],
        out: &mut [u8],
    ) -> Result<usize, BufferTooSmall> {
        assert!(
            namespaces.len() <= NAMESPACE_COUNT_MAX,
            "namespace table exceeds the protocol limit"
        );
        let size = Self::encoded_size(namespaces.len());
        let out = output_prefix(out, size)?;
        let mut fixed = [0u8; CAPABILITIES_FIXED_SIZE];
        let mut f = FieldsMut(&mut fixed);
        f.put_u16_le::<0>(self.version);
        // Bytes 2..4 are reserved, left zero.
        f.put_u32_le::<4>(self.block_size_bytes);
        f.put_u32_le::<8>(self.io_size_max_bytes);
        f.put_u32_le::<12>(self.window_requests);
        f.put_u32_le::<16>(namespaces.len() as u32);
        let (fixed_out, entries_out) = out.split_at_mut(CAPABILITIES_FIXED_SIZE);
        fixed_out.copy_from_slice(&fixed);
        for (namespace, entry_out) in namespaces
            .iter()
            .zip(entries_out.chunks_exact_mut(NAMESPACE_ENTRY_SIZE))
        {
            entry_out.copy_from_slice(&namespace.to_bytes());
        }
        Ok(size)
    }

    /// Decodes a complete body. Checks, in order: fixed length, version, reserved, block size
    /// (a power of two), max I/O size (a positive multiple of the block size), window (≥ 1),
    /// namespace count (≤ 256), exact length; namespace flags are checked by the iterator, which
    /// yields an error for an entry with unknown flag bits.
    pub fn decode(body: &[u8]) -> Result<(Capabilities, NamespaceEntries<'_>), BodyError> {
        let Some((fixed, entries)) = body.split_first_chunk::<CAPABILITIES_FIXED_SIZE>() else {
            return Err(BodyError::WrongLength {
                expected_bytes: CAPABILITIES_FIXED_SIZE,
                found_bytes: body.len(),
            });
        };
        let f = Fields(fixed);
        let version = f.u16_le::<0>();
        if version != u16::from(VERSION) {
            return Err(BodyError::UnsupportedVersion { found: version });
        }
        if f.u16_le::<2>() != 0 {
            return Err(BodyError::ReservedNotZero);
        }
        let block_size_bytes = f.u32_le::<4>();
        if !block_size_bytes.is_power_of_two() {
            return Err(BodyError::BadBlockSize {
                found: block_size_bytes,
            });
        }
        let io_size_max_bytes = f.u32_le::<8>();
        if io_size_max_bytes == 0 || io_size_max_bytes % block_size_bytes != 0 {
            return Err(BodyError::BadIoSizeMax {
                found: io_size_max_bytes,
            });
        }
        let window_requests = f.u32_le::<12>();
        if window_requests == 0 {
            return Err(BodyError::WindowZero);
        }
        let count = f.u32_le::<16>();
        if count as usize > NAMESPACE_COUNT_MAX {
            return Err(BodyError::TooManyNamespaces { count });
        }
        let expected_bytes = Self::encoded_size(count as usize);
        if body.len() != expected_bytes {
            return Err(BodyError::WrongLength {
                expected_bytes,
                found_bytes: body.len(),
            });
        }
        let capabilities = Capabilities {
            version,
            block_size_bytes,
            io_size_max_bytes,
            window_requests,
        };
        Ok((capabilities, NamespaceEntries { bytes: entries }))
    }
}

/// The namespace list of a decoded capabilities body, decoded lazily without allocating.
#[derive(Clone, Debug)]
pub struct NamespaceEntries<'a> {
    bytes: &'a [u8],
}

impl Iterator for NamespaceEntries<'_> {
    type Item = Result<Namespace, BodyError>;

    fn next(&mut self) -> Option<Self::Item> {
        let (entry, rest) = self.bytes.split_first_chunk::<NAMESPACE_ENTRY_SIZE>()?;
        self.bytes = rest;
        Some(Namespace::decode(entry))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let count = self.bytes.len() / NAMESPACE_ENTRY_SIZE;
        (count, Some(count))
    }
}

impl ExactSizeIterator for NamespaceEntries<'_> {}

// ---------------------------------------------------------------------------------------------
// Tenant bodies (§1.9): REGISTER, UNREGISTER, BIND, REPORT and the RENEGOTIATE notice.

/// Bytes of a REGISTER request body.
pub const REGISTER_BODY_SIZE: usize = 32;
/// Bytes of a tenant-handle body: UNREGISTER and BIND requests, and REGISTER's OK answer.
pub const HANDLE_BODY_SIZE: usize = 8;
/// Bytes of a RENEGOTIATE notice body.
pub const RENEGOTIATE_BODY_SIZE: usize = 56;
/// Bytes of a REPORT request body.
pub const REPORT_BODY_SIZE: usize = 16;
/// Bytes of the first REPORT body, without the backlog: still accepted (as a backlog of 0).
pub const REPORT_BODY_SIZE_WITHOUT_BACKLOG: usize = 8;
/// The handle that names no tenant: in REGISTER, "a new tenant"; in BIND, "back to the
/// connection's default tenant". The server never hands it out.
pub const NO_TENANT_HANDLE: u64 = 0;

const _: () = assert!(REGISTER_BODY_SIZE as u32 <= CONTROL_BODY_MAX_BYTES);
const _: () = assert!(RENEGOTIATE_BODY_SIZE as u32 <= CONTROL_BODY_MAX_BYTES);
const _: () = assert!(REPORT_BODY_SIZE as u32 <= CONTROL_BODY_MAX_BYTES);

/// REGISTER flag bit 0: the tenant may only read (WRITE and TRIM are answered PERMISSION).
const REGISTER_FLAG_READ_ONLY: u16 = 1;
const REGISTER_CLASS_LATENCY_CRITICAL: u8 = 1;
const REGISTER_CLASS_BEST_EFFORT: u8 = 2;

/// What a tenant asks for in REGISTER.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TenantClassRequest {
    /// A p95 read-latency SLO at a reserved rate of 4 KiB I/Os and read mix.
    LatencyCritical {
        latency_us_p95: u32,
        iops: u64,
        read_percent: u8,
    },
    /// A fair share of whatever latency-critical tenants leave.
    BestEffort,
}

/// A REGISTER body (§1.9): a new tenant for one namespace, or a new SLO for an existing one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegisterBody {
    /// The namespace whose device the tenant uses; the handle is valid for it only.
    pub namespace_id: u32,
    pub class: TenantClassRequest,
    /// The tenant may only read.
    pub read_only: bool,
    /// [`NO_TENANT_HANDLE`] registers a new tenant; any other value asks to change that
    /// tenant's SLO (admission runs again; on refusal the old SLO stays).
    pub handle: u64,
}

impl RegisterBody {
    pub fn to_bytes(&self) -> [u8; REGISTER_BODY_SIZE] {
        let mut bytes = [0u8; REGISTER_BODY_SIZE];
        let mut f = FieldsMut(&mut bytes);
        match self.class {
            TenantClassRequest::LatencyCritical {
                latency_us_p95,
                iops,
                read_percent,
            } => {
                f.put_u8::<0>(REGISTER_CLASS_LATENCY_CRITICAL);
                f.put_u8::<1>(read_percent);
                f.put_u32_le::<8>(latency_us_p95);
                f.put_u64_le::<16>(iops);
            }
            TenantClassRequest::BestEffort => f.put_u8::<0>(REGISTER_CLASS_BEST_EFFORT),
        }
        f.put_u16_le::<2>(if self.read_only {
            REGISTER_FLAG_READ_ONLY
        } else {
            0
        });
        f.put_u32_le::<4>(self.namespace_id);
        // Bytes 12..16 are reserved, left zero.
        f.put_u64_le::<24>(self.handle);
        bytes
    }

    /// Decodes a complete body. Checks, in order: length, class, flags, reserved bytes, then
    /// the class's fields (LC: latency and IOPS above 0, read percentage at most 100; BE: all
    /// three 0).
    pub fn decode(body: &[u8]) -> Result<RegisterBody, BodyError> {
        let bytes: &[u8; REGISTER_BODY_SIZE] =
            body.try_into().map_err(|_| BodyError::WrongLength {
                expected_bytes: REGISTER_BODY_SIZE,
                found_bytes: body.len(),
            })?;
        let f = Fields(bytes);
        let class_raw = f.u8_at::<0>();
        if class_raw != REGISTER_CLASS_LATENCY_CRITICAL && class_raw != REGISTER_CLASS_BEST_EFFORT {
            return Err(BodyError::UnknownClass { found: class_raw });
        }
        let flags = f.u16_le::<2>();
        if flags & !REGISTER_FLAG_READ_ONLY != 0 {
            return Err(BodyError::UnknownFlags {
                found: u32::from(flags),
            });
        }
        if f.u32_le::<12>() != 0 {
            return Err(BodyError::ReservedNotZero);
        }
        let read_percent = f.u8_at::<1>();
        let latency_us_p95 = f.u32_le::<8>();
        let iops = f.u64_le::<16>();
        let class = if class_raw == REGISTER_CLASS_LATENCY_CRITICAL {
            let reason = if latency_us_p95 == 0 {
                Some("latency SLO of 0 µs")
            } else if iops == 0 {
                Some("reservation of 0 IOPS")
            } else if read_percent > 100 {
                Some("read percentage above 100")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(BodyError::InvalidTenant { reason });
            }
            TenantClassRequest::LatencyCritical {
                latency_us_p95,
                iops,
                read_percent,
            }
        } else {
            if read_percent != 0 || latency_us_p95 != 0 || iops != 0 {
                return Err(BodyError::InvalidTenant {
                    reason: "best-effort tenant with an SLO",
                });
            }
            TenantClassRequest::BestEffort
        };
        Ok(RegisterBody {
            namespace_id: f.u32_le::<4>(),
            class,
            read_only: flags & REGISTER_FLAG_READ_ONLY != 0,
            handle: f.u64_le::<24>(),
        })
    }
}

/// The body of UNREGISTER and BIND requests and of REGISTER's OK answer: one tenant handle.
pub fn encode_handle(handle: u64) -> [u8; HANDLE_BODY_SIZE] {
    handle.to_le_bytes()
}

/// Decodes a tenant-handle body (exactly [`HANDLE_BODY_SIZE`] bytes).
pub fn decode_handle(body: &[u8]) -> Result<u64, BodyError> {
    let bytes: [u8; HANDLE_BODY_SIZE] = body.try_into().map_err(|_| BodyError::WrongLength {
        expected_bytes: HANDLE_BODY_SIZE,
        found_bytes: body.len(),
    })?;
    Ok(u64::from_le_bytes(bytes))
}

/// The body of a REPORT request (§1.9): the read latency a latency-critical tenant's client
/// measured over its last report interval, end to end (from when each read was due to its
/// answer arriving), and the requests it has waiting to be sent. The server's online
/// self-calibration learns from it what the network and the client add to the server's own
/// time, which no socket statistic shows (a client's wake-ups, its CPU's other work), and
/// whether a tenant kept sending after a squeeze (a backlog the server cannot see: a client
/// with a full window holds its due requests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ReportBody {
    /// Reads answered in the interval.
    pub reads: u32,
    /// Their p95 latency, µs.
    pub read_p95_us: u32,
    /// Requests that were due (their intended send time passed) and not yet sent when the
    /// report was made: they wait in the client because its window is full.
    pub backlog: u32,
}

impl ReportBody {
    pub fn to_bytes(&self) -> [u8; REPORT_BODY_SIZE] {
        let mut body = [0u8; REPORT_BODY_SIZE];
        body[0..4].copy_from_slice(&self.reads.to_le_bytes());
        body[4..8].copy_from_slice(&self.read_p95_us.to_le_bytes());
        body[8..12].copy_from_slice(&self.backlog.to_le_bytes());
        body
    }

    /// Decodes a REPORT body: [`REPORT_BODY_SIZE`] bytes with zero reserved bytes, or the
    /// first body's [`REPORT_BODY_SIZE_WITHOUT_BACKLOG`] (a backlog of 0).
    pub fn decode(body: &[u8]) -> Result<ReportBody, BodyError> {
        if body.len() != REPORT_BODY_SIZE && body.len() != REPORT_BODY_SIZE_WITHOUT_BACKLOG {
            return Err(BodyError::WrongLength {
                expected_bytes: REPORT_BODY_SIZE,
                found_bytes: body.len(),
            });
        }
        let word = |at: usize| {
            body.get(at..at + 4).map_or(0, |bytes| {
                u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
            })
        };
        if word(12) != 0 {
            return Err(BodyError::ReservedNotZero);
        }
        Ok(ReportBody {
            reads: word(0),
            read_p95_us: word(4),
            backlog: word(8),
        })
    }
}

/// Why a RENEGOTIATE notice was sent (§1.9).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum RenegotiateReason {
    /// The tenant sent beyond its reservation until it reached its deficit limit.
    #[default]
    DeficitLimit = 1,
    /// The device turned out slower than its profile (online self-calibration): the
    /// reservation no longer fits, and the tenant is served at `granted_tokens_per_sec`.
    DeviceSlower = 2,
    /// The device is fast enough again: the reservation is honoured in full.
    DeviceRecovered = 3,
}

impl RenegotiateReason {
    fn from_u32(value: u32) -> Option<RenegotiateReason> {
        match value {
            1 => Some(RenegotiateReason::DeficitLimit),
            2 => Some(RenegotiateReason::DeviceSlower),
            3 => Some(RenegotiateReason::DeviceRecovered),
            _ => None,
        }
    }
}

/// The body of a RENEGOTIATE notice (§1.9): the tenant keeps reaching its deficit limit, or
/// the device can no longer honour its reservation (or can again).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RenegotiateBody {
    pub handle: u64,
    /// Deficit episodes of this tenant so far, counting from 1; each brings one notice.
    pub episode: u64,
    /// The reservation: 4 KiB IOPS (0 for best-effort tenants) and its tokens per second
    /// under mixed load.
    pub reserved_iops: u64,
    pub reserved_tokens_per_sec: u64,
    /// Requests per second the tenant sent recently (see `docs/QOS.md`).
    pub observed_iops: u64,
    pub reason: RenegotiateReason,
    /// Tokens per second the schedulers grant the reservation now (mixed load): the
    /// reservation itself, or less while the device is slower than its profile.
    pub granted_tokens_per_sec: u64,
}

impl RenegotiateBody {
    pub fn to_bytes(&self) -> [u8; RENEGOTIATE_BODY_SIZE] {
        let mut bytes = [0u8; RENEGOTIATE_BODY_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u64_le::<0>(self.handle);
        f.put_u64_le::<8>(self.episode);
        f.put_u64_le::<16>(self.reserved_iops);
        f.put_u64_le::<24>(self.reserved_tokens_per_sec);
        f.put_u64_le::<32>(self.observed_iops);
        f.put_u32_le::<40>(self.reason as u32);
        f.put_u64_le::<48>(self.granted_tokens_per_sec);
        bytes
    }

    /// Decodes a complete body. The handle must name a tenant.
    pub fn decode(body: &[u8]) -> Result<RenegotiateBody, BodyError> {
        let bytes: &[u8; RENEGOTIATE_BODY_SIZE] =
            body.try_into().map_err(|_| BodyError::WrongLength {
                expected_bytes: RENEGOTIATE_BODY_SIZE,
                found_bytes: body.len(),
            })?;
        let f = Fields(bytes);
        let handle = f.u64_le::<0>();
        if handle == NO_TENANT_HANDLE {
            return Err(BodyError::InvalidTenant {
                reason: "notice for tenant handle 0",
            });
        }
        let Some(reason) = RenegotiateReason::from_u32(f.u32_le::<40>()) else {
            return Err(BodyError::InvalidTenant {
                reason: "notice with an unknown reason",
            });
        };
        if f.u32_le::<44>() != 0 {
            return Err(BodyError::InvalidTenant {
                reason: "notice with non-zero reserved bytes",
            });
        }
        Ok(RenegotiateBody {
            handle,
            episode: f.u64_le::<8>(),
            reserved_iops: f.u64_le::<16>(),
            reserved_tokens_per_sec: f.u64_le::<24>(),
            observed_iops: f.u64_le::<32>(),
            reason,
            granted_tokens_per_sec: f.u64_le::<48>(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Validation at the edge.

/// A server configuration that violates the protocol's own limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    #[error("block size {0} is not a power of two of at least 512")]
    BlockSize(u32),
    #[error("max I/O size {0} is not a positive multiple of the block size")]
    IoSizeMax(u32),
}

/// The server's I/O limits, checked once when the server starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServerLimits {
    block_size_bytes: u32,
    io_size_max_bytes: u32,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            block_size_bytes: BLOCK_SIZE_BYTES_DEFAULT,
            io_size_max_bytes: IO_SIZE_MAX_BYTES_DEFAULT,
        }
    }
}

impl ServerLimits {
    pub const fn new(
        block_size_bytes: u32,
        io_size_max_bytes: u32,
    ) -> Result<ServerLimits, LimitsError> {
        if !block_size_bytes.is_power_of_two() || block_size_bytes < 512 {
            return Err(LimitsError::BlockSize(block_size_bytes));
        }
        if io_size_max_bytes == 0 || !io_size_max_bytes.is_multiple_of(block_size_bytes) {
            return Err(LimitsError::IoSizeMax(io_size_max_bytes));
        }
        Ok(ServerLimits {
            block_size_bytes,
            io_size_max_bytes,
        })
    }
    #[inline]
    pub const fn block_size_bytes(&self) -> u32 {
        self.block_size_bytes
    }
    #[inline]
    pub const fn io_size_max_bytes(&self) -> u32 {
        self.io_size_max_bytes
    }
}

/// The server's namespaces, looked up by id during validation. Implemented for a slice (a linear
/// scan: a server has a handful); a server with another structure implements it itself.
pub trait NamespaceTable {
    fn namespace(&self, id: u32) -> Option<Namespace>;
}

impl NamespaceTable for [Namespace] {
    #[inline]
    fn namespace(&self, id: u32) -> Option<Namespace> {
        self.iter().find(|namespace| namespace.id == id).copied()
    }
}

/// What a validated data request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IoOp {
    Read,
    Write { fua: bool },
    Flush,
    Trim,
}

/// A READ, WRITE, FLUSH or TRIM that passed [`validate_request`]: the namespace exists, the
/// range is aligned, non-empty (FLUSH: empty), within the namespace and within the size limit,
/// and the tenant may do it. Only `validate_request` makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ValidatedIo {
    request_id: u64,
    op: IoOp,
    namespace_id: u32,
    offset_bytes: u64,
    length_bytes: u32,
}

impl ValidatedIo {
    #[inline]
    pub const fn request_id(&self) -> u64 {
        self.request_id
    }
    #[inline]
    pub const fn op(&self) -> IoOp {
        self.op
    }
    #[inline]
    pub const fn namespace_id(&self) -> u32 {
        self.namespace_id
    }
    /// Byte offset in the namespace; a multiple of the block size (0 for FLUSH).
    #[inline]
    pub const fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }
    /// Length in bytes; a positive multiple of the block size (0 for FLUSH). For WRITE it is
    /// also the payload length; for READ, the response payload length on success.
    #[inline]
    pub const fn length_bytes(&self) -> u32 {
        self.length_bytes
    }
    /// The opcode to echo in the response.
    #[inline]
    pub const fn opcode(&self) -> Opcode {
        match self.op {
            IoOp::Read => Opcode::Read,
            IoOp::Write { .. } => Opcode::Write,
            IoOp::Flush => Opcode::Flush,
            IoOp::Trim => Opcode::Trim,
        }
    }
}

/// A control request whose body has not been read yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ControlOp {
    Register,
    Unregister,
    Bind,
    Report,
}

/// A request that passed validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValidatedRequest {
    Io(ValidatedIo),
    /// HELLO with a body of exactly [`HELLO_BODY_SIZE`] bytes following; decode it with
    /// [`HelloBody::decode`] (a malformed body is answered `INVALID`).
    Hello,
    /// A control request with a body of `body_length_bytes` ≤ [`CONTROL_BODY_MAX_BYTES`].
    Control {
        op: ControlOp,
        body_length_bytes: u32,
    },
}

/// Checks a decoded request against the server's limits and namespaces. The error is the
/// status to answer with; either way the server consumes `header.payload_length_bytes()`.
///
/// Order of checks (the first failing one decides the status; `docs/PROTOCOL.md` §1.7):
/// 1. version ≠ 1 → `UNSUPPORTED_VERSION`;
/// 2. unknown opcode, or RENEGOTIATE (server to client only) → `INVALID`;
/// 3. unknown flag bits, or FUA on anything but WRITE → `INVALID`;
/// 4. HELLO: `length` ≠ 16 → `INVALID`; control opcodes: `length` > 4096 → `TOO_LARGE`;
/// 5. unknown namespace → `NO_SUCH_NAMESPACE`;
/// 6. WRITE or TRIM on a read-only namespace → `PERMISSION`;
/// 7. FLUSH: `offset` or `length` not zero → `INVALID` (otherwise valid);
/// 8. `length` zero → `INVALID`;
/// 9. READ/WRITE `length` > max I/O size → `TOO_LARGE`;
/// 10. `offset` or `length` not a multiple of the block size → `INVALID`;
/// 11. `offset + length` overflows or exceeds the namespace size → `OUT_OF_RANGE`.
#[inline]
pub fn validate_request<T: NamespaceTable + ?Sized>(
    header: &RequestHeader,
    limits: &ServerLimits,
    namespaces: &T,
) -> Result<ValidatedRequest, Status> {
    if header.version != VERSION {
        return Err(Status::UnsupportedVersion);
    }
    let opcode = header.opcode().map_err(|_| Status::Invalid)?;
    if header.flags.unknown_bits() != 0 || (header.flags.fua() && opcode != Opcode::Write) {
        return Err(Status::Invalid);
    }
    let op = match opcode {
        Opcode::Read => IoOp::Read,
        Opcode::Write => IoOp::Write {
            fua: header.flags.fua(),
        },
        Opcode::Flush => IoOp::Flush,
        Opcode::Trim => IoOp::Trim,
        Opcode::Hello => {
            if header.length_bytes as usize != HELLO_BODY_SIZE {
                return Err(Status::Invalid);
            }
            return Ok(ValidatedRequest::Hello);
        }
        Opcode::Register | Opcode::Unregister | Opcode::Bind | Opcode::Report => {
            if header.length_bytes > CONTROL_BODY_MAX_BYTES {
                return Err(Status::TooLarge);
            }
            let op = match opcode {
                Opcode::Register => ControlOp::Register,
                Opcode::Unregister => ControlOp::Unregister,
                Opcode::Bind => ControlOp::Bind,
                _ => ControlOp::Report,
            };
            return Ok(ValidatedRequest::Control {
                op,
                body_length_bytes: header.length_bytes,
            });
        }
        Opcode::Renegotiate => return Err(Status::Invalid),
    };
    let namespace = namespaces
        .namespace(header.namespace_id)
        .ok_or(Status::NoSuchNamespace)?;
    if namespace.read_only && matches!(op, IoOp::Write { .. } | IoOp::Trim) {
        return Err(Status::Permission);
    }
    if op == IoOp::Flush {
        if header.offset_bytes != 0 || header.length_bytes != 0 {
            return Err(Status::Invalid);
        }
    } else {
        if header.length_bytes == 0 {
            return Err(Status::Invalid);
        }
        if matches!(op, IoOp::Read | IoOp::Write { .. })
            && header.length_bytes > limits.io_size_max_bytes
        {
            return Err(Status::TooLarge);
        }
        // `ServerLimits::new` guarantees a power of two, so a mask replaces two divisions.
        let block_mask = u64::from(limits.block_size_bytes) - 1;
        if (header.offset_bytes | u64::from(header.length_bytes)) & block_mask != 0 {
            return Err(Status::Invalid);
        }
        match header
            .offset_bytes
            .checked_add(u64::from(header.length_bytes))
        {
            Some(end_bytes) if end_bytes <= namespace.size_bytes => {}
            _ => return Err(Status::OutOfRange),
        }
    }
    let io = ValidatedIo {
        request_id: header.request_id,
        op,
        namespace_id: header.namespace_id,
        offset_bytes: header.offset_bytes,
        length_bytes: header.length_bytes,
    };
    debug_assert!(io.op == IoOp::Flush || io.length_bytes > 0);
    debug_assert!(io.offset_bytes + u64::from(io.length_bytes) <= namespace.size_bytes);
    Ok(ValidatedRequest::Io(io))
}
