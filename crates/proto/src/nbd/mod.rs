//! The NBD protocol, server side (`NetworkBlockDevice/nbd` `doc/proto.md`; `docs/NBD.md` says
//! what reflexd supports): the fixed-newstyle handshake as a state machine ([`Handshake`]) and
//! the transmission phase as a request decoder, a validator and reply encoders ([`Session`]).
//!
//! Why it is shaped this way: like quinn's protocol core, nothing here touches a socket. The
//! driver feeds received bytes to [`Handshake::handle_bytes`], sends what
//! [`Handshake::poll_transmit`] hands out, and switches to transmission when
//! [`Handshake::outcome`] says so, with the [`Session`] that describes the chosen export. In
//! transmission the hot path is the same as for the native protocol: decode a 28-byte header
//! from the receive buffer, validate it once into a [`ValidatedCommand`] (or an [`Errno`] to
//! reply with), consume [`RequestHeader::payload_length_bytes`] of payload even when the
//! request is invalid, and encode only reply *headers* — read data goes out zero-copy from
//! the dataplane's own buffer. All NBD integers are big-endian.

mod client;
mod handshake;
mod output;
mod transmission;

pub use client::{
    ClientHandshake, ClientHandshakeError, NegotiatedExport, OLDSTYLE_MAGIC,
    OPTION_REPLY_DATA_MAX_BYTES, OptionRefusal, SimpleReplyError, decode_simple_reply,
    disconnect_request, flush_request, read_request, write_request,
};
pub use handshake::{
    Handshake, HandshakeConfig, HandshakeError, OPTION_DATA_MAX_BYTES, OPTIONS_MAX_DEFAULT,
    OUTPUT_PENDING_MAX_BYTES, Outcome, TlsPolicy,
};
pub use transmission::{
    BLOCK_DESCRIPTOR_SIZE, ChunkHeader, Command, CommandType, Reply, ReplyBytes, ReplyError,
    RequestError, RequestHeader, Session, SimpleReply, UnknownCommand, ValidatedCommand,
    block_status_chunk, decode_request, encode_block_status, error_chunk, none_chunk,
    offset_data_chunk,
};

// ---------------------------------------------------------------------------------------------
// Magic numbers and sizes.

/// `"NBDMAGIC"`, first word of the server greeting.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `"IHAVEOPT"`, second word of the greeting and first word of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// First word of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Server greeting: NBDMAGIC, IHAVEOPT, 16-bit handshake flags.
pub const GREETING_SIZE: usize = 18;
pub const CLIENT_FLAGS_SIZE: usize = 4;
/// Option header: IHAVEOPT, option, length.
pub const OPTION_HEADER_SIZE: usize = 16;
/// Option reply header: magic, option, reply type, length.
pub const OPTION_REPLY_HEADER_SIZE: usize = 20;
pub const REQUEST_HEADER_SIZE: usize = 28;
pub const SIMPLE_REPLY_SIZE: usize = 16;
pub const CHUNK_HEADER_SIZE: usize = 20;
/// Zero padding after the EXPORT_NAME reply unless NO_ZEROES was negotiated.
pub const EXPORT_NAME_PADDING_SIZE: usize = 124;
/// Longest string the spec allows (export names, descriptions, messages).
pub const STRING_SIZE_MAX: usize = 4096;
/// Largest maximum payload an export may advertise: a READ's data plus the 8-byte offset must fit
/// the 32-bit length of an `OFFSET_DATA` chunk.
pub const MAXIMUM_PAYLOAD_BYTES_MAX: u32 = u32::MAX - 8;
/// Most exports one server offers; bounds the LIST reply.
pub const EXPORT_COUNT_MAX: usize = 256;
/// The maximum payload the spec asks servers to support for clients that did not negotiate
/// block sizes (2^25), and that such clients should not exceed.
pub const DEFAULT_MAXIMUM_PAYLOAD_BYTES: u32 = 1 << 25;

// ---------------------------------------------------------------------------------------------
// Flags and codes.

/// Handshake flags sent by the server.
pub mod handshake_flags {
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub const NO_ZEROES: u16 = 1 << 1;
}

/// Client flags sent in reply to the greeting.
pub mod client_flags {
    pub const FIXED_NEWSTYLE: u32 = 1 << 0;
    pub const NO_ZEROES: u32 = 1 << 1;
    pub const KNOWN: u32 = FIXED_NEWSTYLE | NO_ZEROES;
}

/// Option codes (`NBD_OPT_*`).
pub mod option {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const PEEK_EXPORT: u32 = 4;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types (`NBD_REP_*`). Errors have bit 31 set.
pub mod reply {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    pub const ERR_UNSUP: u32 = (1 << 31) + 1;
    pub const ERR_POLICY: u32 = (1 << 31) + 2;
    pub const ERR_INVALID: u32 = (1 << 31) + 3;
    pub const ERR_PLATFORM: u32 = (1 << 31) + 4;
    pub const ERR_TLS_REQD: u32 = (1 << 31) + 5;
    pub const ERR_UNKNOWN: u32 = (1 << 31) + 6;
    pub const ERR_SHUTDOWN: u32 = (1 << 31) + 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) + 8;
    pub const ERR_TOO_BIG: u32 = (1 << 31) + 9;
}

/// Information types in `NBD_REP_INFO` replies and INFO/GO requests (`NBD_INFO_*`).
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Command flags (`NBD_CMD_FLAG_*`).
pub mod command_flags {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Metadata contexts (`NBD_OPT_SET_META_CONTEXT`, `NBD_CMD_BLOCK_STATUS`).
pub mod meta_context {
    /// The one context reflexd offers: which extents are allocated (`docs/NBD.md`).
    pub const BASE_ALLOCATION: &str = "base:allocation";
    /// The id reflexd gives `base:allocation` when a client selects it.
    pub const BASE_ALLOCATION_ID: u32 = 1;
    /// Most queries one LIST or SET option may carry (more: `NBD_REP_ERR_TOO_BIG`).
    pub const QUERIES_MAX: usize = 64;
}

/// Status flags of `base:allocation` block descriptors (`NBD_STATE_*`).
pub mod allocation_flags {
    /// Not allocated.
    pub const HOLE: u32 = 1 << 0;
    /// Reads as zeroes.
    pub const ZERO: u32 = 1 << 1;
}

/// Structured reply flags and chunk types.
pub mod chunk {
    pub const FLAG_DONE: u16 = 1 << 0;
    pub const TYPE_NONE: u16 = 0;
    pub const TYPE_OFFSET_DATA: u16 = 1;
    pub const TYPE_OFFSET_HOLE: u16 = 2;
    pub const TYPE_BLOCK_STATUS: u16 = 5;
    pub const TYPE_ERROR: u16 = (1 << 15) + 1;
    pub const TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;
}

/// Transmission flags sent per export (`NBD_FLAG_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TransmissionFlags(u16);

impl TransmissionFlags {
    pub const HAS_FLAGS: TransmissionFlags = TransmissionFlags(1 << 0);
    pub const READ_ONLY: TransmissionFlags = TransmissionFlags(1 << 1);
    pub const SEND_FLUSH: TransmissionFlags = TransmissionFlags(1 << 2);
    pub const SEND_FUA: TransmissionFlags = TransmissionFlags(1 << 3);
    pub const ROTATIONAL: TransmissionFlags = TransmissionFlags(1 << 4);
    pub const SEND_TRIM: TransmissionFlags = TransmissionFlags(1 << 5);
    pub const SEND_WRITE_ZEROES: TransmissionFlags = TransmissionFlags(1 << 6);
    pub const SEND_DF: TransmissionFlags = TransmissionFlags(1 << 7);
    pub const CAN_MULTI_CONN: TransmissionFlags = TransmissionFlags(1 << 8);
    pub const SEND_RESIZE: TransmissionFlags = TransmissionFlags(1 << 9);
    pub const SEND_CACHE: TransmissionFlags = TransmissionFlags(1 << 10);
    pub const SEND_FAST_ZERO: TransmissionFlags = TransmissionFlags(1 << 11);

    /// Flags an export may carry in reflexd: the features this codec implements.
    pub const SUPPORTED: TransmissionFlags = TransmissionFlags(
        Self::HAS_FLAGS.0
            | Self::READ_ONLY.0
            | Self::SEND_FLUSH.0
            | Self::SEND_FUA.0
            | Self::ROTATIONAL.0
            | Self::SEND_TRIM.0
            | Self::SEND_WRITE_ZEROES.0
            | Self::CAN_MULTI_CONN.0
            | Self::SEND_CACHE.0
            | Self::SEND_FAST_ZERO.0,
    );

    /// What a writable reflexd export advertises by default.
    pub const DEFAULT: TransmissionFlags = TransmissionFlags(
        Self::HAS_FLAGS.0
            | Self::SEND_FLUSH.0
            | Self::SEND_FUA.0
            | Self::SEND_TRIM.0
            | Self::SEND_WRITE_ZEROES.0
            | Self::CAN_MULTI_CONN.0
            | Self::SEND_CACHE.0
            | Self::SEND_FAST_ZERO.0,
    );

    pub const fn from_bits_retain(bits: u16) -> TransmissionFlags {
        TransmissionFlags(bits)
    }
    pub const fn bits(self) -> u16 {
        self.0
    }
    pub const fn contains(self, other: TransmissionFlags) -> bool {
        self.0 & other.0 == other.0
    }
    #[must_use]
    pub const fn union(self, other: TransmissionFlags) -> TransmissionFlags {
        TransmissionFlags(self.0 | other.0)
    }
    #[must_use]
    pub const fn difference(self, other: TransmissionFlags) -> TransmissionFlags {
        TransmissionFlags(self.0 & !other.0)
    }
}

/// NBD error values (the spec's restricted errno set).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Errno {
    /// Write, trim or write-zeroes on a read-only export.
    Perm = 1,
    /// The device failed the operation.
    Io = 5,
    /// Out of resources (the spec asks servers to avoid it).
    NoMem = 12,
    /// Unknown command or flag, misaligned request, read or trim beyond the end, bad length.
    Inval = 22,
    /// Write or write-zeroes beyond the end of the export, or the backend is full.
    NoSpc = 28,
    /// Reserved for DF reads and oversized payload-less commands; reflexd does not produce it.
    Overflow = 75,
    /// A `WRITE_ZEROES` with `FAST_ZERO` that would need writes rather than a discard.
    NotSup = 95,
    /// The server is shutting down.
    Shutdown = 108,
}

/// An error value outside the spec's set; clients treat it as EINVAL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown NBD error value {0}")]
pub struct UnknownErrno(pub u32);

impl Errno {
    pub const fn from_u32(value: u32) -> Result<Errno, UnknownErrno> {
        Ok(match value {
            1 => Errno::Perm,
            5 => Errno::Io,
            12 => Errno::NoMem,
            22 => Errno::Inval,
            28 => Errno::NoSpc,
            75 => Errno::Overflow,
            95 => Errno::NotSup,
            108 => Errno::Shutdown,
            _ => return Err(UnknownErrno(value)),
        })
    }
    #[inline]
    pub const fn as_u32(self) -> u32 {
        self as u32
    }

    /// The NBD error for a Linux `errno` from the backend, as the spec recommends: EDQUOT and
    /// EFBIG become ENOSPC, permission errors EPERM, anything without an NBD counterpart EIO.
    pub const fn from_linux_errno(errno: i32) -> Errno {
        match errno {
            1 | 13 | 30 => Errno::Perm,    // EPERM, EACCES, EROFS
            28 | 27 | 122 => Errno::NoSpc, // ENOSPC, EFBIG, EDQUOT
            12 => Errno::NoMem,            // ENOMEM
            22 => Errno::Inval,            // EINVAL
            75 => Errno::Overflow,         // EOVERFLOW
            95 => Errno::NotSup,           // EOPNOTSUPP
            108 => Errno::Shutdown,        // ESHUTDOWN
            _ => Errno::Io,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Exports.

/// Block size constraints advertised in `NBD_INFO_BLOCK_SIZE` and enforced on requests of
/// clients that agreed to them (a client that did not gets the spec's defaults, see
/// [`Session::validate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockSizes {
    /// Alignment of offsets and lengths: a power of two ≤ 64 KiB.
    pub minimum_bytes: u32,
    /// A power of two ≥ max(minimum, 512).
    pub preferred_bytes: u32,
    /// Largest READ/WRITE payload; ≥ preferred and ≤ [`MAXIMUM_PAYLOAD_BYTES_MAX`].
    pub maximum_bytes: u32,
}

impl Default for BlockSizes {
    /// 1 / 4096 / 32 MiB, the spec's defaults: any byte is addressable (reflexd serves
    /// unaligned requests by read-modify-write), 4 KiB-aligned requests avoid it, and READs
    /// and WRITEs of up to 32 MiB are served (in parts of one buffer run).
    fn default() -> Self {
        BlockSizes {
            minimum_bytes: 1,
            preferred_bytes: 4096,
            maximum_bytes: DEFAULT_MAXIMUM_PAYLOAD_BYTES,
        }
    }
}

impl BlockSizes {
    /// Checks the spec's rules ("Size constraints").
    pub const fn validate(&self) -> Result<(), ExportError> {
        let valid = self.minimum_bytes.is_power_of_two()
            && self.minimum_bytes <= 1 << 16
            && self.preferred_bytes.is_power_of_two()
            && self.preferred_bytes >= self.minimum_bytes
            && self.preferred_bytes >= 512
            && self.maximum_bytes >= self.preferred_bytes
            && self.maximum_bytes <= MAXIMUM_PAYLOAD_BYTES_MAX;
        if valid {
            Ok(())
        } else {
            Err(ExportError::BlockSizes(*self))
        }
    }
}

/// One export as offered to NBD clients. reflexd makes one per namespace; the driver maps the
/// export's index in the [`ExportTable`] back to its namespace and tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Export {
    /// UTF-8, no NUL, at most 4096 bytes, unique in the table.
    pub name: String,
    /// Shown to people (`NBD_INFO_DESCRIPTION`); empty means none.
    pub description: String,
    /// A multiple of `block_sizes.minimum_bytes`.
    pub size_bytes: u64,
    pub block_sizes: BlockSizes,
    /// Must include HAS_FLAGS and only bits in [`TransmissionFlags::SUPPORTED`];
    /// SEND_FAST_ZERO only with SEND_WRITE_ZEROES.
    pub flags: TransmissionFlags,
    /// Whether the export offers the `base:allocation` metadata context (block status).
    pub base_allocation: bool,
    /// Served only after `NBD_OPT_STARTTLS` (the spec's SELECTIVETLS mode): INFO and GO
    /// without TLS get `NBD_REP_ERR_TLS_REQD`, `EXPORT_NAME` ends the session, and LIST
    /// leaves it out.
    pub tls_only: bool,
}

impl Export {
    /// A writable export with the default block sizes, [`TransmissionFlags::DEFAULT`] and
    /// `base:allocation`.
    pub fn new(name: impl Into<String>, size_bytes: u64) -> Export {
        Export {
            name: name.into(),
            description: String::new(),
            size_bytes,
            block_sizes: BlockSizes::default(),
            flags: TransmissionFlags::DEFAULT,
            base_allocation: true,
            tls_only: false,
        }
    }

    /// Serves the export only over TLS (see [`Export::tls_only`]).
    #[must_use]
    pub fn tls_only(mut self) -> Export {
        self.tls_only = true;
        self
    }

    /// Marks the export read-only: sets READ_ONLY and drops the write-only features.
    #[must_use]
    pub fn read_only(mut self) -> Export {
        self.flags = self
            .flags
            .union(TransmissionFlags::READ_ONLY)
            .difference(TransmissionFlags::SEND_TRIM)
            .difference(TransmissionFlags::SEND_WRITE_ZEROES)
            .difference(TransmissionFlags::SEND_FAST_ZERO);
        self
    }

    #[must_use]
    pub fn with_base_allocation(mut self, base_allocation: bool) -> Export {
        self.base_allocation = base_allocation;
        self
    }

    #[must_use]
    pub fn with_description(mut self, description: impl Into<String>) -> Export {
        self.description = description.into();
        self
    }

    #[must_use]
    pub fn with_block_sizes(mut self, block_sizes: BlockSizes) -> Export {
        self.block_sizes = block_sizes;
        self
    }

    #[must_use]
    pub fn with_flags(mut self, flags: TransmissionFlags) -> Export {
        self.flags = flags;
        self
    }

    pub const fn is_read_only(&self) -> bool {
        self.flags.contains(TransmissionFlags::READ_ONLY)
    }

    fn validate(&self) -> Result<(), ExportError> {
        check_string(&self.name).map_err(|_| ExportError::Name(self.name.clone()))?;
        check_string(&self.description).map_err(|_| ExportError::Description(self.name.clone()))?;
        self.block_sizes.validate()?;
        if !self
            .size_bytes
            .is_multiple_of(u64::from(self.block_sizes.minimum_bytes))
        {
            return Err(ExportError::SizeNotAligned {
                name: self.name.clone(),
                size_bytes: self.size_bytes,
            });
        }
        let fast_zero_alone = self.flags.contains(TransmissionFlags::SEND_FAST_ZERO)
            && !self.flags.contains(TransmissionFlags::SEND_WRITE_ZEROES);
        if !self.flags.contains(TransmissionFlags::HAS_FLAGS)
            || self.flags.difference(TransmissionFlags::SUPPORTED).bits() != 0
            || fast_zero_alone
        {
            return Err(ExportError::Flags {
                name: self.name.clone(),
                flags: self.flags.bits(),
            });
        }
        Ok(())
    }
}

fn check_string(text: &str) -> Result<(), ()> {
    if text.len() > STRING_SIZE_MAX || text.contains('\0') {
        Err(())
    } else {
        Ok(())
    }
}

/// A configuration error in the export table, found when the server starts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    #[error("export name {0:?} is longer than 4096 bytes or contains NUL")]
    Name(String),
    #[error("description of export {0:?} is longer than 4096 bytes or contains NUL")]
    Description(String),
    #[error("export name {0:?} appears twice")]
    DuplicateName(String),
    #[error("more than {EXPORT_COUNT_MAX} exports")]
    TooMany,
    #[error("block sizes {0:?} break the NBD size-constraint rules")]
    BlockSizes(BlockSizes),
    #[error("export {name:?}: size {size_bytes} is not a multiple of the minimum block size")]
    SizeNotAligned { name: String, size_bytes: u64 },
    #[error(
        "export {name:?}: transmission flags {flags:#06x} lack HAS_FLAGS, include unsupported features, or offer fast zero without write zeroes"
    )]
    Flags { name: String, flags: u16 },
    #[error("default export {0:?} is not in the table")]
    UnknownDefault(String),
}

/// The exports a server offers, validated once and shared (behind an `Arc`) by every handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportTable {
    exports: Vec<Export>,
    default_index: Option<usize>,
}

impl ExportTable {
    /// `default_name` names the export a client gets when it asks for the empty name.
    pub fn new(
        exports: Vec<Export>,
        default_name: Option<&str>,
    ) -> Result<ExportTable, ExportError> {
        if exports.len() > EXPORT_COUNT_MAX {
            return Err(ExportError::TooMany);
        }
        for (index, export) in exports.iter().enumerate() {
            export.validate()?;
            if exports[..index]
                .iter()
                .any(|earlier| earlier.name == export.name)
            {
                return Err(ExportError::DuplicateName(export.name.clone()));
            }
        }
        let default_index = match default_name {
            None => None,
            Some(name) => Some(
                exports
                    .iter()
                    .position(|export| export.name == name)
                    .ok_or_else(|| ExportError::UnknownDefault(name.to_owned()))?,
            ),
        };
        Ok(ExportTable {
            exports,
            default_index,
        })
    }

    pub fn exports(&self) -> &[Export] {
        &self.exports
    }

    /// The name of the export a client gets when it asks for the empty name.
    pub fn default_name(&self) -> Option<&str> {
        self.default_index
            .and_then(|index| self.exports.get(index))
            .map(|export| export.name.as_str())
    }

    pub fn get(&self, index: usize) -> Option<&Export> {
        self.exports.get(index)
    }

    /// The export a client names, with its index: an exact match, or the default export for
    /// the empty name.
    pub fn lookup(&self, name: &[u8]) -> Option<(usize, &Export)> {
        let exact = self
            .exports
            .iter()
            .position(|export| export.name.as_bytes() == name);
        let index = match exact {
            Some(index) => index,
            None if name.is_empty() => self.default_index?,
            None => return None,
        };
        self.exports.get(index).map(|export| (index, export))
    }
}
