//! NBD transmission phase: the 28-byte request header, validation against the negotiated
//! export into a [`ValidatedCommand`] or an [`Errno`], and reply header encoders.
//!
//! Why it is shaped this way: this is the hot path, so decoding is one length check and
//! constant-offset reads, and nothing allocates. Only a wrong magic is broken framing; any other
//! defect is answered with an error reply, and a WRITE's payload is consumed whatever its fate
//! ([`RequestHeader::payload_length_bytes`]). Replies are header bytes only ([`ReplyBytes`]):
//! the dataplane sends READ data zero-copy from its own buffer right after them, and since each
//! reply carries the request's cookie, replies may go out in any order. A READ may be answered
//! in pieces ([`Session::reply_read_piece`]); a BLOCK_STATUS answer's payload is encoded by
//! [`encode_block_status`] into the caller's buffer.

use super::{
    BlockSizes, CHUNK_HEADER_SIZE, DEFAULT_MAXIMUM_PAYLOAD_BYTES, Errno, Export,
    REQUEST_HEADER_SIZE, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC, SIMPLE_REPLY_SIZE,
    STRUCTURED_REPLY_MAGIC, TransmissionFlags, chunk, command_flags, meta_context,
};
use crate::wire::{Fields, FieldsMut};

/// Command types (`NBD_CMD_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum CommandType {
    Read = 0,
    Write = 1,
    Disc = 2,
    Flush = 3,
    Trim = 4,
    Cache = 5,
    WriteZeroes = 6,
    BlockStatus = 7,
    Resize = 8,
}

/// A command type the spec does not define.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown NBD command {0}")]
pub struct UnknownCommand(pub u16);

impl CommandType {
    #[inline]
    pub const fn from_u16(value: u16) -> Result<CommandType, UnknownCommand> {
        Ok(match value {
            0 => CommandType::Read,
            1 => CommandType::Write,
            2 => CommandType::Disc,
            3 => CommandType::Flush,
            4 => CommandType::Trim,
            5 => CommandType::Cache,
            6 => CommandType::WriteZeroes,
            7 => CommandType::BlockStatus,
            8 => CommandType::Resize,
            _ => return Err(UnknownCommand(value)),
        })
    }
    #[inline]
    pub const fn as_u16(self) -> u16 {
        self as u16
    }
}

/// Broken framing in transmission: hard disconnect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("bad request magic {found:#010x} (expected {REQUEST_MAGIC:#010x})")]
    BadMagic { found: u32 },
}

/// A request header as received, every field raw so it re-encodes byte for byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RequestHeader {
    pub flags: u16,
    pub command_raw: u16,
    pub cookie: u64,
    pub offset_bytes: u64,
    pub length_bytes: u32,
}

/// Decodes one request header from the front of `buf`: `Ok(None)` when fewer than 28 bytes are
/// there; otherwise the header and the bytes it occupied, after which
/// `header.payload_length_bytes()` bytes of payload follow.
#[inline]
pub fn decode_request(buf: &[u8]) -> Result<Option<(RequestHeader, usize)>, RequestError> {
    RequestHeader::decode(buf)
}

impl RequestHeader {
    /// See [`decode_request`].
    #[inline]
    pub fn decode(buf: &[u8]) -> Result<Option<(RequestHeader, usize)>, RequestError> {
        let Some(bytes) = buf.first_chunk::<REQUEST_HEADER_SIZE>() else {
            return Ok(None);
        };
        let f = Fields(bytes);
        let magic = f.u32_be::<0>();
        if magic != REQUEST_MAGIC {
            return Err(RequestError::BadMagic { found: magic });
        }
        let header = RequestHeader {
            flags: f.u16_be::<4>(),
            command_raw: f.u16_be::<6>(),
            cookie: f.u64_be::<8>(),
            offset_bytes: f.u64_be::<16>(),
            length_bytes: f.u32_be::<24>(),
        };
        Ok(Some((header, REQUEST_HEADER_SIZE)))
    }

    #[inline]
    pub fn to_bytes(&self) -> [u8; REQUEST_HEADER_SIZE] {
        let mut bytes = [0u8; REQUEST_HEADER_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u32_be::<0>(REQUEST_MAGIC);
        f.put_u16_be::<4>(self.flags);
        f.put_u16_be::<6>(self.command_raw);
        f.put_u64_be::<8>(self.cookie);
        f.put_u64_be::<16>(self.offset_bytes);
        f.put_u32_be::<24>(self.length_bytes);
        bytes
    }

    #[inline]
    pub const fn command(&self) -> Result<CommandType, UnknownCommand> {
        CommandType::from_u16(self.command_raw)
    }

    /// Payload bytes that follow this header: `length` for WRITE, 0 otherwise, whether or not
    /// the request is valid. The server consumes them even when it answers with an error.
    #[inline]
    pub const fn payload_length_bytes(&self) -> u32 {
        if self.command_raw == CommandType::Write as u16 {
            self.length_bytes
        } else {
            0
        }
    }
}

/// What a validated request asks for. Offsets and lengths are in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Command {
    Read {
        offset_bytes: u64,
        length_bytes: u32,
    },
    /// `length_bytes` of payload follow the header.
    Write {
        offset_bytes: u64,
        length_bytes: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset_bytes: u64,
        length_bytes: u32,
        fua: bool,
    },
    /// `no_hole`: the range must end up allocated, not trimmed. `fast_zero`: fail with
    /// ENOTSUP rather than zero more slowly than a WRITE would.
    WriteZeroes {
        offset_bytes: u64,
        length_bytes: u32,
        fua: bool,
        no_hole: bool,
        fast_zero: bool,
    },
    /// `NBD_CMD_CACHE`: the client will access the range soon (advisory).
    Cache {
        offset_bytes: u64,
        length_bytes: u32,
    },
    /// `NBD_CMD_BLOCK_STATUS` for `base:allocation`; `req_one`: at most one extent, not
    /// longer than the request.
    BlockStatus {
        offset_bytes: u64,
        length_bytes: u32,
        req_one: bool,
    },
    /// `NBD_CMD_DISC`: finish outstanding requests, send nothing for this one, close.
    Disconnect,
}

/// A request that passed [`Session::validate`]: its command is supported and advertised, its
/// flags apply, the export allows it, and its range is non-empty, aligned, inside the export
/// and (for READ/WRITE) within the maximum payload. Only `validate` makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ValidatedCommand {
    cookie: u64,
    command: Command,
}

impl ValidatedCommand {
    #[inline]
    pub const fn cookie(&self) -> u64 {
        self.cookie
    }
    #[inline]
    pub const fn command(&self) -> Command {
        self.command
    }
}

/// The transmission phase of one connection: the negotiated export, reply style, size
/// constraints and metadata context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Session {
    export_index: usize,
    size_bytes: u64,
    flags: TransmissionFlags,
    block_sizes: BlockSizes,
    structured_replies: bool,
    /// The client asked for `NBD_INFO_BLOCK_SIZE` with `NBD_OPT_GO`, so it must honour the
    /// export's constraints; otherwise the spec's defaults apply.
    block_sizes_agreed: bool,
    /// The client selected `base:allocation` for this export (with structured replies).
    base_allocation: bool,
}

impl Session {
    /// A session on `export` (at `export_index` in the export table), with neither agreed
    /// block sizes nor a metadata context. The handshake makes it; tests and tools may make
    /// one directly.
    pub fn new(export_index: usize, export: &Export, structured_replies: bool) -> Session {
        assert!(
            export.block_sizes.validate().is_ok(),
            "export block sizes must pass BlockSizes::validate (ExportTable::new checks them)"
        );
        Session {
            export_index,
            size_bytes: export.size_bytes,
            flags: export.flags,
            block_sizes: export.block_sizes,
            structured_replies,
            block_sizes_agreed: false,
            base_allocation: false,
        }
    }

    /// The client agreed to the export's block sizes (`NBD_INFO_BLOCK_SIZE` with `GO`).
    #[must_use]
    pub const fn with_block_sizes_agreed(mut self, agreed: bool) -> Session {
        self.block_sizes_agreed = agreed;
        self
    }

    /// The client selected `base:allocation`; it needs structured replies.
    #[must_use]
    pub fn with_base_allocation(mut self, selected: bool) -> Session {
        assert!(
            !selected || self.structured_replies,
            "block status needs structured replies"
        );
        self.base_allocation = selected;
        self
    }
    /// Index of the export in the [`super::ExportTable`]; the driver maps it to a namespace
    /// and tenant.
    pub const fn export_index(&self) -> usize {
        self.export_index
    }
    pub const fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
    pub const fn flags(&self) -> TransmissionFlags {
        self.flags
    }
    pub const fn block_sizes(&self) -> BlockSizes {
        self.block_sizes
    }
    pub const fn structured_replies(&self) -> bool {
        self.structured_replies
    }
    pub const fn block_sizes_agreed(&self) -> bool {
        self.block_sizes_agreed
    }
    /// The id of `base:allocation` when the client selected it.
    pub const fn base_allocation_context(&self) -> Option<u32> {
        if self.base_allocation {
            Some(meta_context::BASE_ALLOCATION_ID)
        } else {
            None
        }
    }

    /// The constraints requests are held to: `(minimum, maximum payload)`. A client that
    /// agreed to the export's block sizes must honour them; one that did not gets the spec's
    /// defaults (any alignment, up to 32 MiB, or the export's maximum if larger), which the
    /// spec asks servers to support for such clients.
    pub fn enforced_block_sizes(&self) -> (u32, u32) {
        if self.block_sizes_agreed {
            (
                self.block_sizes.minimum_bytes,
                self.block_sizes.maximum_bytes,
            )
        } else {
            (
                1,
                self.block_sizes
                    .maximum_bytes
                    .max(DEFAULT_MAXIMUM_PAYLOAD_BYTES),
            )
        }
    }

    /// Checks a request against the export. The error is the value to reply with; either way
    /// the server consumes `header.payload_length_bytes()`.
    ///
    /// Order (the first failing check decides; `docs/NBD.md`):
    /// 1. DISC → `Disconnect`, whatever its other fields;
    /// 2. unknown command, or RESIZE (not offered) → EINVAL;
    /// 3. WRITE, TRIM or WRITE_ZEROES on a read-only export → EPERM;
    /// 4. FLUSH, TRIM, WRITE_ZEROES or CACHE not advertised for this export, or BLOCK_STATUS
    ///    without `base:allocation` selected → EINVAL;
    /// 5. a flag that is unknown or does not apply (FUA without SEND_FUA, NO_HOLE or
    ///    FAST_ZERO outside WRITE_ZEROES, FAST_ZERO without SEND_FAST_ZERO, REQ_ONE outside
    ///    BLOCK_STATUS, DF) → EINVAL;
    /// 6. FLUSH with non-zero offset or length → EINVAL (otherwise valid);
    /// 7. length zero → EINVAL;
    /// 8. READ/WRITE longer than the maximum payload → EINVAL;
    /// 9. offset or length not a multiple of the minimum block size → EINVAL;
    /// 10. beyond the end of the export (or overflowing) → ENOSPC for WRITE and WRITE_ZEROES,
    ///     EINVAL for the others.
    ///
    /// Steps 8 and 9 use [`Self::enforced_block_sizes`].
    #[inline]
    pub fn validate(&self, header: &RequestHeader) -> Result<ValidatedCommand, Errno> {
        let command_type = header.command().map_err(|_| Errno::Inval)?;
        let is_write = matches!(
            command_type,
            CommandType::Write | CommandType::Trim | CommandType::WriteZeroes
        );
        let advertised = match command_type {
            CommandType::Disc => {
                return Ok(ValidatedCommand {
                    cookie: header.cookie,
                    command: Command::Disconnect,
                });
            }
            CommandType::Resize => return Err(Errno::Inval),
            CommandType::Read | CommandType::Write => true,
            CommandType::Flush => self.flags.contains(TransmissionFlags::SEND_FLUSH),
            CommandType::Trim => self.flags.contains(TransmissionFlags::SEND_TRIM),
            CommandType::WriteZeroes => self.flags.contains(TransmissionFlags::SEND_WRITE_ZEROES),
            CommandType::Cache => self.flags.contains(TransmissionFlags::SEND_CACHE),
            CommandType::BlockStatus => self.base_allocation,
        };
        if is_write && self.flags.contains(TransmissionFlags::READ_ONLY) {
            return Err(Errno::Perm);
        }
        if !advertised {
            return Err(Errno::Inval);
        }
        let mut allowed_flags = 0;
        if self.flags.contains(TransmissionFlags::SEND_FUA) {
            allowed_flags |= command_flags::FUA;
        }
        match command_type {
            CommandType::WriteZeroes => {
                allowed_flags |= command_flags::NO_HOLE;
                if self.flags.contains(TransmissionFlags::SEND_FAST_ZERO) {
                    allowed_flags |= command_flags::FAST_ZERO;
                }
            }
            CommandType::BlockStatus => allowed_flags |= command_flags::REQ_ONE,
            _ => {}
        }
        if header.flags & !allowed_flags != 0 {
            return Err(Errno::Inval);
        }
        let fua = header.flags & command_flags::FUA != 0;
        let (offset_bytes, length_bytes) = (header.offset_bytes, header.length_bytes);
        if command_type == CommandType::Flush {
            if offset_bytes != 0 || length_bytes != 0 {
                return Err(Errno::Inval);
            }
            return Ok(ValidatedCommand {
                cookie: header.cookie,
                command: Command::Flush,
            });
        }
        if length_bytes == 0 {
            return Err(Errno::Inval);
        }
        let (minimum_bytes, maximum_bytes) = self.enforced_block_sizes();
        if matches!(command_type, CommandType::Read | CommandType::Write)
            && length_bytes > maximum_bytes
        {
            return Err(Errno::Inval);
        }
        // Minimum block sizes are powers of two, so a mask replaces two divisions.
        let block_mask = u64::from(minimum_bytes) - 1;
        if (offset_bytes | u64::from(length_bytes)) & block_mask != 0 {
            return Err(Errno::Inval);
        }
        let in_range = matches!(offset_bytes.checked_add(u64::from(length_bytes)), Some(end) if end <= self.size_bytes);
        if !in_range {
            let write_like = matches!(command_type, CommandType::Write | CommandType::WriteZeroes);
            return Err(if write_like {
                Errno::NoSpc
            } else {
                Errno::Inval
            });
        }
        let command = match command_type {
            CommandType::Read => Command::Read {
                offset_bytes,
                length_bytes,
            },
            CommandType::Write => Command::Write {
                offset_bytes,
                length_bytes,
                fua,
            },
            CommandType::Trim => Command::Trim {
                offset_bytes,
                length_bytes,
                fua,
            },
            CommandType::Cache => Command::Cache {
                offset_bytes,
                length_bytes,
            },
            CommandType::BlockStatus => Command::BlockStatus {
                offset_bytes,
                length_bytes,
                req_one: header.flags & command_flags::REQ_ONE != 0,
            },
            _ => Command::WriteZeroes {
                offset_bytes,
                length_bytes,
                fua,
                no_hole: header.flags & command_flags::NO_HOLE != 0,
                fast_zero: header.flags & command_flags::FAST_ZERO != 0,
            },
        };
        Ok(ValidatedCommand {
            cookie: header.cookie,
            command,
        })
    }

    /// The reply header for a successful command: for READ, the bytes that precede the
    /// `length_bytes` of data (a simple reply, or an `OFFSET_DATA` chunk with DONE when
    /// structured replies were negotiated); for other commands a simple reply with error 0
    /// (which the spec allows in structured mode, as it carries no payload). `None` for
    /// `Disconnect`, which gets no reply, and for `BlockStatus`, whose reply carries a
    /// payload ([`Self::reply_block_status`]).
    #[inline]
    pub fn reply_ok(&self, command: &ValidatedCommand) -> Option<ReplyBytes> {
        match command.command {
            Command::Disconnect | Command::BlockStatus { .. } => None,
            Command::Read {
                offset_bytes,
                length_bytes,
            } if self.structured_replies => Some(offset_data_chunk(
                command.cookie,
                offset_bytes,
                length_bytes,
                true,
            )),
            _ => Some(ReplyBytes::from(
                SimpleReply {
                    error: 0,
                    cookie: command.cookie,
                }
                .to_bytes(),
            )),
        }
    }

    /// The header before one piece of a READ answered in several (a READ longer than the
    /// server's buffers): with structured replies an `OFFSET_DATA` chunk for the piece's
    /// `length_bytes` at `offset_bytes`, DONE on the last; with simple replies the reply
    /// before the first piece and nothing before the others (the data of all pieces follows
    /// the one reply, in order). A READ in one piece is [`Self::reply_ok`].
    #[inline]
    pub fn reply_read_piece(
        &self,
        cookie: u64,
        offset_bytes: u64,
        length_bytes: u32,
        first: bool,
        last: bool,
    ) -> ReplyBytes {
        if self.structured_replies {
            offset_data_chunk(cookie, offset_bytes, length_bytes, last)
        } else if first {
            ReplyBytes::from(SimpleReply { error: 0, cookie }.to_bytes())
        } else {
            ReplyBytes::from([0u8; 0])
        }
    }

    /// The `BLOCK_STATUS` chunk header (with DONE) before a payload of `payload_bytes` made by
    /// [`encode_block_status`]; `None` unless `command` is a BLOCK_STATUS of this session.
    #[inline]
    pub fn reply_block_status(
        &self,
        command: &ValidatedCommand,
        payload_bytes: u32,
    ) -> Option<ReplyBytes> {
        match command.command {
            Command::BlockStatus { .. } if self.base_allocation => {
                Some(block_status_chunk(command.cookie, payload_bytes))
            }
            _ => None,
        }
    }

    /// The reply to a failed request: an `ERROR` chunk with DONE in structured mode (the spec
    /// requires it for READ and prefers it otherwise), else a simple reply with the error.
    #[inline]
    pub fn reply_error(&self, cookie: u64, error: Errno) -> ReplyBytes {
        if self.structured_replies {
            error_chunk(cookie, error, true)
        } else {
            ReplyBytes::from(
                SimpleReply {
                    error: error.as_u32(),
                    cookie,
                }
                .to_bytes(),
            )
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reply encoding.

/// Largest reply header this module produces: a chunk header plus an 8-byte offset.
const REPLY_BYTES_MAX: usize = CHUNK_HEADER_SIZE + 8;

/// Reply header bytes, inline (no allocation): up to 28 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReplyBytes {
    bytes: [u8; REPLY_BYTES_MAX],
    length: u8,
}

impl ReplyBytes {
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.length as usize]
    }
}

impl<const N: usize> From<[u8; N]> for ReplyBytes {
    #[inline]
    fn from(bytes: [u8; N]) -> ReplyBytes {
        const { assert!(N <= REPLY_BYTES_MAX) };
        let mut reply = ReplyBytes {
            bytes: [0; REPLY_BYTES_MAX],
            length: N as u8,
        };
        reply.bytes[..N].copy_from_slice(&bytes);
        reply
    }
}

/// `NBD_SIMPLE_REPLY_MAGIC` reply: error (0 = success) and cookie. For a successful READ,
/// `length` bytes of data follow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SimpleReply {
    pub error: u32,
    pub cookie: u64,
}

impl SimpleReply {
    #[inline]
    pub fn to_bytes(&self) -> [u8; SIMPLE_REPLY_SIZE] {
        let mut bytes = [0u8; SIMPLE_REPLY_SIZE];
        let mut f = FieldsMut(&mut bytes);
        f.put_u32_be::<0>(SIMPLE_REPLY_MAGIC);
        f.put_u32_be::<4>(self.error);
        f.put_u64_be::<8>(self.cookie);
        bytes
    }
}

/// A structured reply chunk header; `length_bytes` of payload follow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkHeader {
    pub flags: u16,
    pub chunk_type: u16,
    pub cookie: u64,
    pub length_bytes: u32,
}

impl ChunkHeader {
    #[inline]
    pub fn to_bytes(&self) -> [u8; CHUNK_HEADER_SIZE] {
        self.with_payload_room()
    }

    /// The header in the first 20 bytes of an `N`-byte array, the rest zero for the caller.
    #[inline]
    fn with_payload_room<const N: usize>(&self) -> [u8; N] {
        let mut bytes = [0u8; N];
        let mut f = FieldsMut(&mut bytes);
        f.put_u32_be::<0>(STRUCTURED_REPLY_MAGIC);
        f.put_u16_be::<4>(self.flags);
        f.put_u16_be::<6>(self.chunk_type);
        f.put_u64_be::<8>(self.cookie);
        f.put_u32_be::<16>(self.length_bytes);
        bytes
    }

    pub const fn is_done(&self) -> bool {
        self.flags & chunk::FLAG_DONE != 0
    }
}

/// The bytes before `data_length_bytes` of READ data in an `OFFSET_DATA` chunk: the chunk
/// header (length = 8 + data) and the 64-bit offset.
#[inline]
pub fn offset_data_chunk(
    cookie: u64,
    offset_bytes: u64,
    data_length_bytes: u32,
    done: bool,
) -> ReplyBytes {
    assert!(
        data_length_bytes <= super::MAXIMUM_PAYLOAD_BYTES_MAX,
        "a chunk's data is at most u32::MAX - 8 bytes"
    );
    let length_bytes = data_length_bytes + 8;
    let flags = if done { chunk::FLAG_DONE } else { 0 };
    let header = ChunkHeader {
        flags,
        chunk_type: chunk::TYPE_OFFSET_DATA,
        cookie,
        length_bytes,
    };
    let mut bytes: [u8; CHUNK_HEADER_SIZE + 8] = header.with_payload_room();
    FieldsMut(&mut bytes).put_u64_be::<CHUNK_HEADER_SIZE>(offset_bytes);
    ReplyBytes::from(bytes)
}

/// An `ERROR` chunk with no message: header, 32-bit error, 16-bit message length 0.
#[inline]
pub fn error_chunk(cookie: u64, error: Errno, done: bool) -> ReplyBytes {
    let flags = if done { chunk::FLAG_DONE } else { 0 };
    let header = ChunkHeader {
        flags,
        chunk_type: chunk::TYPE_ERROR,
        cookie,
        length_bytes: 6,
    };
    // Error value, then a message length of 0 (bytes 24..26 stay zero).
    let mut bytes: [u8; CHUNK_HEADER_SIZE + 6] = header.with_payload_room();
    FieldsMut(&mut bytes).put_u32_be::<CHUNK_HEADER_SIZE>(error.as_u32());
    ReplyBytes::from(bytes)
}

/// Bytes of one block descriptor in a `BLOCK_STATUS` chunk: extent length and status flags.
pub const BLOCK_DESCRIPTOR_SIZE: usize = 8;

/// A `BLOCK_STATUS` chunk header with DONE; `payload_bytes` (4 + 8 per descriptor) follow.
#[inline]
pub fn block_status_chunk(cookie: u64, payload_bytes: u32) -> ReplyBytes {
    assert!(
        payload_bytes >= 4 + BLOCK_DESCRIPTOR_SIZE as u32
            && (payload_bytes - 4).is_multiple_of(BLOCK_DESCRIPTOR_SIZE as u32),
        "a block status payload is a context id and at least one descriptor"
    );
    let header = ChunkHeader {
        flags: chunk::FLAG_DONE,
        chunk_type: chunk::TYPE_BLOCK_STATUS,
        cookie,
        length_bytes: payload_bytes,
    };
    ReplyBytes::from(header.to_bytes())
}

/// Writes a `BLOCK_STATUS` chunk's payload into `out`: the context id, then one descriptor
/// (length, status flags) per extent. Returns its length, or `None` when `out` is too short or
/// there is no extent or an empty one (a descriptor's length must be non-zero).
pub fn encode_block_status(
    context_id: u32,
    extents: impl IntoIterator<Item = (u32, u32)>,
    out: &mut [u8],
) -> Option<usize> {
    let mut length = 4;
    out.get_mut(..4)?.copy_from_slice(&context_id.to_be_bytes());
    for (extent_bytes, flags) in extents {
        if extent_bytes == 0 {
            return None;
        }
        let descriptor = out.get_mut(length..length + BLOCK_DESCRIPTOR_SIZE)?;
        descriptor[..4].copy_from_slice(&extent_bytes.to_be_bytes());
        descriptor[4..].copy_from_slice(&flags.to_be_bytes());
        length += BLOCK_DESCRIPTOR_SIZE;
    }
    (length > 4).then_some(length)
}

/// A `NONE` chunk with DONE: ends a structured reply whose earlier chunks lacked DONE.
#[inline]
pub fn none_chunk(cookie: u64) -> ReplyBytes {
    let header = ChunkHeader {
        flags: chunk::FLAG_DONE,
        chunk_type: chunk::TYPE_NONE,
        cookie,
        length_bytes: 0,
    };
    ReplyBytes::from(header.to_bytes())
}

// ---------------------------------------------------------------------------------------------
// Reply decoding (client side, tests, fuzzing).

/// A reply that does not start with a known reply magic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplyError {
    #[error("bad reply magic {found:#010x}")]
    BadMagic { found: u32 },
}

/// A decoded reply header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reply {
    Simple(SimpleReply),
    Chunk(ChunkHeader),
}

impl Reply {
    /// Decodes a simple reply or chunk header from the front of `buf`; `Ok(None)` when more
    /// bytes are needed. The payload that follows (READ data, chunk payload) is the caller's.
    pub fn decode(buf: &[u8]) -> Result<Option<(Reply, usize)>, ReplyError> {
        let Some(magic) = buf.first_chunk::<4>() else {
            return Ok(None);
        };
        match u32::from_be_bytes(*magic) {
            SIMPLE_REPLY_MAGIC => {
                let Some(bytes) = buf.first_chunk::<SIMPLE_REPLY_SIZE>() else {
                    return Ok(None);
                };
                let f = Fields(bytes);
                let reply = SimpleReply {
                    error: f.u32_be::<4>(),
                    cookie: f.u64_be::<8>(),
                };
                Ok(Some((Reply::Simple(reply), SIMPLE_REPLY_SIZE)))
            }
            STRUCTURED_REPLY_MAGIC => {
                let Some(bytes) = buf.first_chunk::<CHUNK_HEADER_SIZE>() else {
                    return Ok(None);
                };
                let f = Fields(bytes);
                let header = ChunkHeader {
                    flags: f.u16_be::<4>(),
                    chunk_type: f.u16_be::<6>(),
                    cookie: f.u64_be::<8>(),
                    length_bytes: f.u32_be::<16>(),
                };
                Ok(Some((Reply::Chunk(header), CHUNK_HEADER_SIZE)))
            }
            found => Err(ReplyError::BadMagic { found }),
        }
    }

    pub fn to_bytes(&self) -> ReplyBytes {
        match self {
            Reply::Simple(reply) => ReplyBytes::from(reply.to_bytes()),
            Reply::Chunk(header) => ReplyBytes::from(header.to_bytes()),
        }
    }
}
