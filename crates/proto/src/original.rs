//! The original ReFlex block protocol (`docs/PROTOCOL.md` §2), for the original clients
//! (mutilate, reflex_nbd): a packed 24-byte little-endian header, 512-byte sectors, no status.
//!
//! Why it is shaped this way: the protocol cannot report an error, so the server's only answer
//! to a request it cannot serve is to close that connection (never to crash, never to send
//! garbage as data). Decoding therefore has two typed failure levels, both fatal to the
//! connection but distinguishable in the log line: [`DecodeError`] (the bytes are not a header:
//! bad magic, unknown opcode) and [`Invalid`] (a well-formed header the server will not serve:
//! empty, too large, out of range, misaligned for the backend). [`validate`] is the only maker of
//! a [`ValidatedIo`]. The original server checked the 1 MiB limit in 4 KiB pages *before*
//! rounding up, so 1 MiB + 1 sector slipped through and overran its buffer array; here the
//! limit is checked on the exact byte length.

use crate::wire::{Fields, FieldsMut};
use crate::{BufferTooSmall, output_prefix};

pub const HEADER_SIZE: usize = 24;
/// The magic field is the header size.
pub const MAGIC: u16 = HEADER_SIZE as u16;
pub const SECTOR_SIZE_BYTES: u32 = 512;
/// The original server's limit: 256 pages of 4 KiB.
pub const IO_SIZE_MAX_BYTES_DEFAULT: u32 = 1 << 20;

const _: () = assert!(IO_SIZE_MAX_BYTES_DEFAULT.is_multiple_of(SECTOR_SIZE_BYTES));

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Opcode {
    /// `CMD_GET`.
    Read = 0,
    /// `CMD_SET`.
    Write = 1,
}

impl Opcode {
    #[inline]
    pub const fn from_u16(value: u16) -> Result<Opcode, DecodeError> {
        match value {
            0 => Ok(Opcode::Read),
            1 => Ok(Opcode::Write),
            _ => Err(DecodeError::UnknownOpcode { found: value }),
        }
    }
    #[inline]
    pub const fn as_u16(self) -> u16 {
        self as u16
    }
}

/// The bytes are not a request header. Close the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("bad magic {found} (expected {MAGIC})")]
    BadMagic { found: u16 },
    #[error("unknown opcode {found} (0 read, 1 write)")]
    UnknownOpcode { found: u16 },
}

/// A header the server will not serve. Close the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("lba_count is 0")]
    ZeroLength,
    #[error("{length_bytes} bytes requested, at most {io_size_max_bytes} allowed")]
    TooLarge {
        length_bytes: u64,
        io_size_max_bytes: u32,
    },
    #[error(
        "offset {offset_bytes} or length {length_bytes} is not a multiple of {alignment_bytes} bytes"
    )]
    Misaligned {
        offset_bytes: u64,
        length_bytes: u64,
        alignment_bytes: u32,
    },
    #[error(
        "lba {lba} + {lba_count} sectors is beyond the namespace end ({namespace_size_bytes} bytes)"
    )]
    OutOfRange {
        lba: u64,
        lba_count: u32,
        namespace_size_bytes: u64,
    },
}

/// A request or response header. Responses use the same layout (§2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    pub opcode: Opcode,
    /// Opaque to the server, echoed back.
    pub handle: [u8; 8],
    /// Start sector (512 bytes each).
    pub lba: u64,
    pub lba_count: u32,
}

impl Header {
    /// Decodes one header from the front of `buf`: `Ok(None)` when fewer than 24 bytes are
    /// there, `Ok(Some((header, 24)))` otherwise. Checks, in order: magic, opcode.
    #[inline]
    pub fn decode(buf: &[u8]) -> Result<Option<(Header, usize)>, DecodeError> {
        let Some(bytes) = buf.first_chunk::<HEADER_SIZE>() else {
            return Ok(None);
        };
        let f = Fields(bytes);
        let magic = f.u16_le::<0>();
        if magic != MAGIC {
            return Err(DecodeError::BadMagic { found: magic });
        }
        let header = Header {
            opcode: Opcode::from_u16(f.u16_le::<2>())?,
            handle: f.bytes::<4, 8>(),
            lba: f.u64_le::<12>(),
            lba_count: f.u32_le::<20>(),
        };
        Ok(Some((header, HEADER_SIZE)))
    }

    #[inline]
    pub fn to_bytes(&self) -> [u8; HEADER_SIZE] {
        let mut bytes = [0u8; HEADER_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u16_le::<0>(MAGIC);
        f.put_u16_le::<2>(self.opcode.as_u16());
        f.put_bytes::<4, 8>(&self.handle);
        f.put_u64_le::<12>(self.lba);
        f.put_u32_le::<20>(self.lba_count);
        bytes
    }

    #[inline]
    pub fn encode_into(&self, out: &mut [u8]) -> Result<usize, BufferTooSmall> {
        output_prefix(out, HEADER_SIZE)?.copy_from_slice(&self.to_bytes());
        Ok(HEADER_SIZE)
    }

    /// Bytes of payload that follow this header in a *request*: `lba_count × 512` for a write,
    /// 0 for a read. A u64: a hostile `lba_count` asks for up to 2 TiB.
    #[inline]
    pub const fn request_payload_length_bytes(&self) -> u64 {
        match self.opcode {
            Opcode::Read => 0,
            Opcode::Write => self.lba_count as u64 * SECTOR_SIZE_BYTES as u64,
        }
    }

    /// Bytes of payload that follow this header in a *response* (client side): `lba_count × 512`
    /// for a read, 0 for a write (whose response carries `lba_count` = 0).
    #[inline]
    pub const fn response_payload_length_bytes(&self) -> u64 {
        match self.opcode {
            Opcode::Read => self.lba_count as u64 * SECTOR_SIZE_BYTES as u64,
            Opcode::Write => 0,
        }
    }
}

/// What the server accepts: the largest request and the alignment its backend needs (512 for
/// buffered files and 512-byte-sector devices, 4096 for O_DIRECT on 4 KiB-sector devices).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Limits {
    pub io_size_max_bytes: u32,
    pub alignment_bytes: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            io_size_max_bytes: IO_SIZE_MAX_BYTES_DEFAULT,
            alignment_bytes: SECTOR_SIZE_BYTES,
        }
    }
}

/// A request that passed [`validate`]: non-empty, within the size limit, aligned, and inside
/// the namespace. Offsets and lengths are in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ValidatedIo {
    header: Header,
    offset_bytes: u64,
    length_bytes: u32,
}

impl ValidatedIo {
    #[inline]
    pub const fn opcode(&self) -> Opcode {
        self.header.opcode
    }
    #[inline]
    pub const fn handle(&self) -> [u8; 8] {
        self.header.handle
    }
    #[inline]
    pub const fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }
    /// For a write, also the payload length; for a read, the response payload length.
    #[inline]
    pub const fn length_bytes(&self) -> u32 {
        self.length_bytes
    }
    /// The response header: the request echoed, with `lba_count` 0 for a write (§2). A read
    /// response is followed by `length_bytes()` of data.
    #[inline]
    pub const fn response_header(&self) -> Header {
        match self.header.opcode {
            Opcode::Read => self.header,
            Opcode::Write => Header {
                lba_count: 0,
                ..self.header
            },
        }
    }
}

/// Checks a decoded header against the limits and the namespace size. Order: zero length, too
/// large, misaligned, out of range.
#[inline]
pub fn validate(
    header: &Header,
    limits: &Limits,
    namespace_size_bytes: u64,
) -> Result<ValidatedIo, Invalid> {
    debug_assert!(limits.alignment_bytes.is_power_of_two());
    debug_assert!(
        limits
            .io_size_max_bytes
            .is_multiple_of(limits.alignment_bytes)
    );
    if header.lba_count == 0 {
        return Err(Invalid::ZeroLength);
    }
    let length_bytes = u64::from(header.lba_count) * u64::from(SECTOR_SIZE_BYTES);
    if length_bytes > u64::from(limits.io_size_max_bytes) {
        return Err(Invalid::TooLarge {
            length_bytes,
            io_size_max_bytes: limits.io_size_max_bytes,
        });
    }
    let out_of_range = Invalid::OutOfRange {
        lba: header.lba,
        lba_count: header.lba_count,
        namespace_size_bytes,
    };
    let offset_bytes = header
        .lba
        .checked_mul(u64::from(SECTOR_SIZE_BYTES))
        .ok_or(out_of_range)?;
    let alignment_bytes = u64::from(limits.alignment_bytes);
    if offset_bytes % alignment_bytes != 0 || length_bytes % alignment_bytes != 0 {
        return Err(Invalid::Misaligned {
            offset_bytes,
            length_bytes,
            alignment_bytes: limits.alignment_bytes,
        });
    }
    match offset_bytes.checked_add(length_bytes) {
        Some(end_bytes) if end_bytes <= namespace_size_bytes => {}
        _ => return Err(out_of_range),
    }
    // `length_bytes` ≤ io_size_max_bytes, a u32.
    let length_bytes = length_bytes as u32;
    Ok(ValidatedIo {
        header: *header,
        offset_bytes,
        length_bytes,
    })
}
