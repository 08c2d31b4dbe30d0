//! The NBD protocol, client side: the fixed-newstyle handshake as a sans-IO state machine
//! ([`ClientHandshake`]), request encoders and a decoder for *simple* replies
//! ([`decode_simple_reply`]).
//!
//! Why it exists: `reflex bench` must load any NBD server (reflexd, nbdkit, qemu-nbd,
//! nbd-server) with a client that batches like its native-protocol engine, so that per-core
//! comparisons measure the servers and not the client. Why it is shaped this way: like the
//! server side, nothing here touches a socket; the driver feeds received bytes to
//! [`ClientHandshake::handle_bytes`] and sends what [`ClientHandshake::pending_output`] holds.
//! The client asks for `NBD_OPT_GO` with an `NBD_INFO_BLOCK_SIZE` request (so it promises to
//! honour the server's size constraints, which lets O_DIRECT servers stay direct) and falls
//! back to `NBD_OPT_EXPORT_NAME` when the server answers `NBD_REP_ERR_UNSUP`, as the spec
//! asks. It never negotiates structured replies: simple replies carry no length, which keeps
//! the client's reply path to one 16-byte decode, and every server supports them. Everything
//! the server controls is bounded ([`OPTION_REPLY_DATA_MAX_BYTES`]); anything unexpected is a
//! typed [`ClientHandshakeError`], never a panic.

use super::output::OutputBuffer;
use super::transmission::{CommandType, RequestHeader};
use super::{
    BlockSizes, EXPORT_NAME_PADDING_SIZE, GREETING_SIZE, IHAVEOPT, NBD_MAGIC, OPTION_HEADER_SIZE,
    OPTION_REPLY_HEADER_SIZE, OPTION_REPLY_MAGIC, REQUEST_HEADER_SIZE, SIMPLE_REPLY_MAGIC,
    SIMPLE_REPLY_SIZE, STRING_SIZE_MAX, STRUCTURED_REPLY_MAGIC, SimpleReply, TransmissionFlags,
    client_flags, handshake_flags, info, option, reply,
};
use crate::wire::Fields;

/// Largest option reply payload the client buffers. INFO replies are at most a 4096-byte
/// string plus 2 bytes; error messages are strings too. Longer replies end the handshake.
pub const OPTION_REPLY_DATA_MAX_BYTES: usize = 16 * 1024;
/// Second word of an oldstyle greeting (`0x00420281861253`): such servers are not supported.
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;

const _: () = assert!(OPTION_REPLY_DATA_MAX_BYTES >= STRING_SIZE_MAX + 2);
/// Size/flags reply to `NBD_OPT_EXPORT_NAME`, without the optional zero padding.
const EXPORT_NAME_REPLY_SIZE: usize = 10;

/// What the server said about the export once transmission begins.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NegotiatedExport {
    pub size_bytes: u64,
    pub flags: TransmissionFlags,
    /// The server's size constraints as sent (`NBD_INFO_BLOCK_SIZE`), or `None` when it sent
    /// none (then the spec's defaults apply: see [`NegotiatedExport::minimum_block_bytes`]).
    /// Only the minimum is checked (a power of two ≤ 64 KiB); servers send a maximum of
    /// `u32::MAX` for "no limit", which [`BlockSizes::validate`] would refuse.
    pub block_sizes: Option<BlockSizes>,
    /// Whether `NBD_OPT_GO` was refused as unsupported and `NBD_OPT_EXPORT_NAME` used instead.
    pub export_name_fallback: bool,
}

impl NegotiatedExport {
    /// Offsets and lengths must be multiples of this (1 when the server sent no constraints).
    pub fn minimum_block_bytes(&self) -> u32 {
        self.block_sizes.map_or(1, |sizes| sizes.minimum_bytes)
    }
    /// Largest READ/WRITE payload: the advertised maximum, or the spec's safe 32 MiB.
    pub fn maximum_payload_bytes(&self) -> u32 {
        self.block_sizes
            .map_or(1 << 25, |sizes| sizes.maximum_bytes)
    }
    pub fn is_read_only(&self) -> bool {
        self.flags.contains(TransmissionFlags::READ_ONLY)
    }
}

/// An `NBD_REP_ERR_*` the server answered the export request with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OptionRefusal {
    Unsupported,
    Policy,
    Invalid,
    Platform,
    TlsRequired,
    UnknownExport,
    Shutdown,
    BlockSizeRequired,
    TooBig,
    /// An error type (bit 31 set) the spec does not define.
    Other(u32),
}

impl OptionRefusal {
    pub const fn from_reply_type(reply_type: u32) -> OptionRefusal {
        match reply_type {
            reply::ERR_UNSUP => OptionRefusal::Unsupported,
            reply::ERR_POLICY => OptionRefusal::Policy,
            reply::ERR_INVALID => OptionRefusal::Invalid,
            reply::ERR_PLATFORM => OptionRefusal::Platform,
            reply::ERR_TLS_REQD => OptionRefusal::TlsRequired,
            reply::ERR_UNKNOWN => OptionRefusal::UnknownExport,
            reply::ERR_SHUTDOWN => OptionRefusal::Shutdown,
            reply::ERR_BLOCK_SIZE_REQD => OptionRefusal::BlockSizeRequired,
            reply::ERR_TOO_BIG => OptionRefusal::TooBig,
            other => OptionRefusal::Other(other),
        }
    }
}

impl std::fmt::Display for OptionRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = match self {
            OptionRefusal::Unsupported => "option not supported (NBD_REP_ERR_UNSUP)",
            OptionRefusal::Policy => "refused by policy (NBD_REP_ERR_POLICY)",
            OptionRefusal::Invalid => "invalid request (NBD_REP_ERR_INVALID)",
            OptionRefusal::Platform => "not supported on this platform (NBD_REP_ERR_PLATFORM)",
            OptionRefusal::TlsRequired => "TLS required (NBD_REP_ERR_TLS_REQD)",
            OptionRefusal::UnknownExport => "unknown export (NBD_REP_ERR_UNKNOWN)",
            OptionRefusal::Shutdown => "server shutting down (NBD_REP_ERR_SHUTDOWN)",
            OptionRefusal::BlockSizeRequired => {
                "block sizes must be requested (NBD_REP_ERR_BLOCK_SIZE_REQD)"
            }
            OptionRefusal::TooBig => "request too big (NBD_REP_ERR_TOO_BIG)",
            OptionRefusal::Other(value) => return write!(f, "error reply {value:#010x}"),
        };
        f.write_str(text)
    }
}

/// Why a handshake failed. Every variant ends the connection.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClientHandshakeError {
    #[error("export name of {length_bytes} bytes is longer than 4096 bytes or contains NUL")]
    ExportName { length_bytes: usize },
    #[error("not an NBD server: greeting starts with {found:#018x}, not NBDMAGIC")]
    BadGreeting { found: u64 },
    #[error("the server speaks oldstyle NBD, which this client does not support")]
    Oldstyle,
    #[error("greeting's second word {found:#018x} is not IHAVEOPT")]
    BadGreetingOption { found: u64 },
    #[error("the server does not offer fixed newstyle negotiation (handshake flags {flags:#06x})")]
    NotFixedNewstyle { flags: u16 },
    #[error("option reply magic {found:#018x} is wrong")]
    BadOptionReplyMagic { found: u64 },
    #[error("option reply for option {found}, but option {expected} was sent")]
    UnexpectedOption { expected: u32, found: u32 },
    #[error("option reply of {length_bytes} bytes is longer than the client accepts")]
    ReplyTooLong { length_bytes: u32 },
    #[error("malformed NBD_REP_INFO (type {info_type}, {length_bytes} bytes)")]
    MalformedInfo { info_type: u16, length_bytes: usize },
    #[error("block sizes {minimum_bytes}/{preferred_bytes}/{maximum_bytes} break the spec's rules")]
    BadBlockSizes {
        minimum_bytes: u32,
        preferred_bytes: u32,
        maximum_bytes: u32,
    },
    #[error("unexpected option reply type {reply_type:#010x}")]
    UnexpectedReply { reply_type: u32 },
    #[error("NBD_REP_ACK without NBD_INFO_EXPORT")]
    MissingExportInfo,
    #[error(
        "the server refused export {export:?}: {refusal}{}",
        message_suffix(message)
    )]
    Refused {
        export: String,
        refusal: OptionRefusal,
        message: String,
    },
    #[error("the server closed the connection during the handshake")]
    Closed,
}

/// Appends an option header (IHAVEOPT, option, data length) to `output`.
fn push_option_header(output: &mut OutputBuffer, option: u32, data_length: usize) {
    debug_assert!(data_length <= STRING_SIZE_MAX + 8);
    let start = output.len();
    output.extend_from_slice(&IHAVEOPT.to_be_bytes());
    output.extend_from_slice(&option.to_be_bytes());
    output.extend_from_slice(&(data_length as u32).to_be_bytes());
    debug_assert_eq!(output.len() - start, OPTION_HEADER_SIZE);
}

fn message_suffix(message: &str) -> String {
    if message.is_empty() {
        String::new()
    } else {
        format!(": {message}")
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Waiting for the 18-byte greeting.
    Greeting,
    /// Waiting for a 20-byte option reply header.
    ReplyHeader,
    /// Buffering an option reply's data.
    ReplyData {
        reply_type: u32,
        length_bytes: usize,
    },
    /// Waiting for the size and flags that answer `NBD_OPT_EXPORT_NAME` (plus padding).
    ExportNameReply {
        length_bytes: usize,
    },
    Finished,
}

/// Client side of one connection's handshake. Call order for the driver:
/// 1. after connecting, [`handle_bytes`](Self::handle_bytes) with what the server sent
///    (the greeting), then send [`pending_output`](Self::pending_output) and
///    [`consume_output`](Self::consume_output) what was sent; repeat until
///    [`outcome`](Self::outcome) is `Some` or an error comes back;
/// 2. on end of stream, [`handle_eof`](Self::handle_eof) (an error: the server gave up).
///
/// `handle_bytes` consumes exactly the handshake's bytes: anything after the final reply is
/// left to the caller (a server sends nothing before the first request, so there is none).
#[derive(Debug)]
pub struct ClientHandshake {
    export_name: String,
    state: State,
    /// The bytes of the message being received: bounded by the largest message accepted.
    staging: Vec<u8>,
    output: OutputBuffer,
    server_no_zeroes: bool,
    export: Option<(u64, TransmissionFlags)>,
    block_sizes: Option<BlockSizes>,
    fallback: bool,
    outcome: Option<NegotiatedExport>,
    failure: Option<ClientHandshakeError>,
}

impl ClientHandshake {
    /// A handshake that will ask for `export_name` (empty: the server's default export).
    pub fn new(export_name: &str) -> Result<ClientHandshake, ClientHandshakeError> {
        if export_name.len() > STRING_SIZE_MAX || export_name.contains('\0') {
            return Err(ClientHandshakeError::ExportName {
                length_bytes: export_name.len(),
            });
        }
        Ok(ClientHandshake {
            export_name: export_name.to_owned(),
            state: State::Greeting,
            staging: Vec::with_capacity(OPTION_REPLY_HEADER_SIZE),
            output: OutputBuffer::with_capacity(64 + export_name.len()),
            server_no_zeroes: false,
            export: None,
            block_sizes: None,
            fallback: false,
            outcome: None,
            failure: None,
        })
    }

    /// The export, once the server accepted it; transmission begins after the consumed bytes.
    pub fn outcome(&self) -> Option<NegotiatedExport> {
        self.outcome
    }

    /// Bytes waiting to be sent.
    pub fn pending_output(&self) -> &[u8] {
        self.output.pending()
    }

    /// Marks `count` bytes of [`pending_output`](Self::pending_output) as sent.
    pub fn consume_output(&mut self, count: usize) {
        self.output.consume(count);
    }

    /// The server closed its side before the handshake ended.
    pub fn handle_eof(&mut self) -> ClientHandshakeError {
        match (&self.failure, self.state) {
            (Some(failure), _) => failure.clone(),
            (None, State::Finished) => ClientHandshakeError::Closed,
            (None, _) => self.fail(ClientHandshakeError::Closed),
        }
    }

    /// Feeds received bytes; returns how many were consumed (all of them until the
    /// handshake ends). An `Err` means: close the connection.
    pub fn handle_bytes(&mut self, input: &[u8]) -> Result<usize, ClientHandshakeError> {
        if let Some(failure) = &self.failure {
            return Err(failure.clone());
        }
        let mut consumed = 0;
        loop {
            let wanted = match self.state {
                State::Finished => break,
                State::Greeting => GREETING_SIZE,
                State::ReplyHeader => OPTION_REPLY_HEADER_SIZE,
                State::ReplyData { length_bytes, .. } => length_bytes,
                State::ExportNameReply { length_bytes } => length_bytes,
            };
            let rest = input.get(consumed..).unwrap_or_default();
            let taken = wanted.saturating_sub(self.staging.len()).min(rest.len());
            self.staging.extend_from_slice(&rest[..taken]);
            consumed += taken;
            if self.staging.len() < wanted {
                break;
            }
            let message = std::mem::take(&mut self.staging);
            let handled = self.handle_message(&message);
            self.staging = message;
            self.staging.clear();
            if let Err(error) = handled {
                return Err(self.fail(error));
            }
        }
        Ok(consumed)
    }

    fn fail(&mut self, error: ClientHandshakeError) -> ClientHandshakeError {
        self.state = State::Finished;
        self.failure = Some(error.clone());
        error
    }

    /// Handles one complete message of the current state.
    fn handle_message(&mut self, message: &[u8]) -> Result<(), ClientHandshakeError> {
        match self.state {
            State::Greeting => self.handle_greeting(message),
            State::ReplyHeader => {
                let Some(bytes) = message.first_chunk::<OPTION_REPLY_HEADER_SIZE>() else {
                    unreachable!("the state machine waits for a whole header");
                };
                let header = Fields(bytes);
                let (magic, option, reply_type, length_bytes) = (
                    header.u64_be::<0>(),
                    header.u32_be::<8>(),
                    header.u32_be::<12>(),
                    header.u32_be::<16>(),
                );
                if magic != OPTION_REPLY_MAGIC {
                    return Err(ClientHandshakeError::BadOptionReplyMagic { found: magic });
                }
                if option != option::GO {
                    return Err(ClientHandshakeError::UnexpectedOption {
                        expected: option::GO,
                        found: option,
                    });
                }
                if length_bytes as usize > OPTION_REPLY_DATA_MAX_BYTES {
                    return Err(ClientHandshakeError::ReplyTooLong { length_bytes });
                }
                self.state = State::ReplyData {
                    reply_type,
                    length_bytes: length_bytes as usize,
                };
                Ok(())
            }
            State::ReplyData { reply_type, .. } => self.handle_reply(reply_type, message),
            State::ExportNameReply { .. } => {
                let Some(bytes) = message.first_chunk::<EXPORT_NAME_REPLY_SIZE>() else {
                    unreachable!("the state machine waits for the whole reply");
                };
                let fields = Fields(bytes);
                self.export = Some((
                    fields.u64_be::<0>(),
                    TransmissionFlags::from_bits_retain(fields.u16_be::<8>()),
                ));
                self.finish()
            }
            State::Finished => Ok(()),
        }
    }

    fn handle_greeting(&mut self, message: &[u8]) -> Result<(), ClientHandshakeError> {
        let Some(bytes) = message.first_chunk::<GREETING_SIZE>() else {
            unreachable!("the state machine waits for the whole greeting");
        };
        let greeting = Fields(bytes);
        let (magic, second, flags) = (
            greeting.u64_be::<0>(),
            greeting.u64_be::<8>(),
            greeting.u16_be::<16>(),
        );
        if magic != NBD_MAGIC {
            return Err(ClientHandshakeError::BadGreeting { found: magic });
        }
        if second == OLDSTYLE_MAGIC {
            return Err(ClientHandshakeError::Oldstyle);
        }
        if second != IHAVEOPT {
            return Err(ClientHandshakeError::BadGreetingOption { found: second });
        }
        if flags & handshake_flags::FIXED_NEWSTYLE == 0 {
            return Err(ClientHandshakeError::NotFixedNewstyle { flags });
        }
        // Only flags the server offered: NO_ZEROES is optional for servers.
        self.server_no_zeroes = flags & handshake_flags::NO_ZEROES != 0;
        let mut client = client_flags::FIXED_NEWSTYLE;
        if self.server_no_zeroes {
            client |= client_flags::NO_ZEROES;
        }
        self.output.extend_from_slice(&client.to_be_bytes());
        // NBD_OPT_GO: name length, name, one information request (block sizes).
        let name = self.export_name.as_bytes();
        let data_length = 4 + name.len() + 2 + 2;
        push_option_header(&mut self.output, option::GO, data_length);
        self.output
            .extend_from_slice(&(name.len() as u32).to_be_bytes());
        self.output.extend_from_slice(name);
        self.output.extend_from_slice(&1u16.to_be_bytes());
        self.output
            .extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        self.state = State::ReplyHeader;
        Ok(())
    }

    /// One complete reply to `NBD_OPT_GO`.
    fn handle_reply(&mut self, reply_type: u32, data: &[u8]) -> Result<(), ClientHandshakeError> {
        self.state = State::ReplyHeader;
        match reply_type {
            reply::INFO => self.handle_info(data),
            reply::ACK => self.finish(),
            reply::ERR_UNSUP => {
                // An old server without NBD_OPT_GO: the spec asks clients to fall back.
                self.fallback = true;
                self.block_sizes = None;
                self.export = None;
                let name = self.export_name.as_bytes();
                push_option_header(&mut self.output, option::EXPORT_NAME, name.len());
                self.output.extend_from_slice(name);
                let padding = if self.server_no_zeroes {
                    0
                } else {
                    EXPORT_NAME_PADDING_SIZE
                };
                self.state = State::ExportNameReply {
                    length_bytes: EXPORT_NAME_REPLY_SIZE + padding,
                };
                Ok(())
            }
            error if error & (1 << 31) != 0 => {
                let shown = data.len().min(STRING_SIZE_MAX);
                Err(ClientHandshakeError::Refused {
                    export: self.export_name.clone(),
                    refusal: OptionRefusal::from_reply_type(error),
                    message: String::from_utf8_lossy(&data[..shown]).into_owned(),
                })
            }
            other => Err(ClientHandshakeError::UnexpectedReply { reply_type: other }),
        }
    }

    /// `NBD_REP_INFO`: export size and flags, block sizes; other types are ignored.
    fn handle_info(&mut self, data: &[u8]) -> Result<(), ClientHandshakeError> {
        let Some(info_type) = data
            .first_chunk::<2>()
            .map(|bytes| u16::from_be_bytes(*bytes))
        else {
            return Err(ClientHandshakeError::MalformedInfo {
                info_type: 0,
                length_bytes: data.len(),
            });
        };
        let malformed = ClientHandshakeError::MalformedInfo {
            info_type,
            length_bytes: data.len(),
        };
        match info_type {
            info::EXPORT => {
                let Some(bytes) = data.first_chunk::<12>().filter(|_| data.len() == 12) else {
                    return Err(malformed);
                };
                let fields = Fields(bytes);
                self.export = Some((
                    fields.u64_be::<2>(),
                    TransmissionFlags::from_bits_retain(fields.u16_be::<10>()),
                ));
            }
            info::BLOCK_SIZE => {
                let Some(bytes) = data.first_chunk::<14>().filter(|_| data.len() == 14) else {
                    return Err(malformed);
                };
                let fields = Fields(bytes);
                let sizes = BlockSizes {
                    minimum_bytes: fields.u32_be::<2>(),
                    preferred_bytes: fields.u32_be::<6>(),
                    maximum_bytes: fields.u32_be::<10>(),
                };
                let valid = sizes.minimum_bytes.is_power_of_two()
                    && sizes.minimum_bytes <= 1 << 16
                    && sizes.maximum_bytes >= sizes.minimum_bytes;
                if !valid {
                    return Err(ClientHandshakeError::BadBlockSizes {
                        minimum_bytes: sizes.minimum_bytes,
                        preferred_bytes: sizes.preferred_bytes,
                        maximum_bytes: sizes.maximum_bytes,
                    });
                }
                self.block_sizes = Some(sizes);
            }
            // The spec: clients ignore information they do not understand (names, descriptions).
            _ => {}
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), ClientHandshakeError> {
        let Some((size_bytes, flags)) = self.export else {
            return Err(ClientHandshakeError::MissingExportInfo);
        };
        self.state = State::Finished;
        self.outcome = Some(NegotiatedExport {
            size_bytes,
            flags,
            block_sizes: self.block_sizes,
            export_name_fallback: self.fallback,
        });
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Transmission: requests out, simple replies in.

/// A READ request header; the reply carries `length_bytes` of data after it on success.
#[inline]
pub fn read_request(
    cookie: u64,
    offset_bytes: u64,
    length_bytes: u32,
) -> [u8; REQUEST_HEADER_SIZE] {
    request(CommandType::Read, 0, cookie, offset_bytes, length_bytes)
}

/// A WRITE request header; `length_bytes` of payload must follow it.
#[inline]
pub fn write_request(
    cookie: u64,
    offset_bytes: u64,
    length_bytes: u32,
    flags: u16,
) -> [u8; REQUEST_HEADER_SIZE] {
    request(
        CommandType::Write,
        flags,
        cookie,
        offset_bytes,
        length_bytes,
    )
}

/// A FLUSH request header.
#[inline]
pub fn flush_request(cookie: u64) -> [u8; REQUEST_HEADER_SIZE] {
    request(CommandType::Flush, 0, cookie, 0, 0)
}

/// `NBD_CMD_DISC`: the server finishes outstanding requests, answers nothing more, closes.
#[inline]
pub fn disconnect_request(cookie: u64) -> [u8; REQUEST_HEADER_SIZE] {
    request(CommandType::Disc, 0, cookie, 0, 0)
}

#[inline]
fn request(
    command: CommandType,
    flags: u16,
    cookie: u64,
    offset_bytes: u64,
    length_bytes: u32,
) -> [u8; REQUEST_HEADER_SIZE] {
    RequestHeader {
        flags,
        command_raw: command.as_u16(),
        cookie,
        offset_bytes,
        length_bytes,
    }
    .to_bytes()
}

/// A reply the client cannot accept: the stream is out of step, close the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SimpleReplyError {
    #[error("bad reply magic {found:#010x} (expected {SIMPLE_REPLY_MAGIC:#010x})")]
    BadMagic { found: u32 },
    #[error("a structured reply arrived, but structured replies were not negotiated")]
    Structured,
}

/// Decodes a simple reply from the front of `buf`: `Ok(None)` until 16 bytes are there.
/// The READ data that follows a successful READ's reply is the caller's: its length is the
/// request's, which only the caller knows (simple replies carry no length).
#[inline]
pub fn decode_simple_reply(buf: &[u8]) -> Result<Option<(SimpleReply, usize)>, SimpleReplyError> {
    let Some(bytes) = buf.first_chunk::<SIMPLE_REPLY_SIZE>() else {
        // Check the magic as soon as it is there, so a broken stream fails early.
        return match buf
            .first_chunk::<4>()
            .map(|magic| u32::from_be_bytes(*magic))
        {
            None | Some(SIMPLE_REPLY_MAGIC) => Ok(None),
            Some(found) => Err(magic_error(found)),
        };
    };
    let fields = Fields(bytes);
    let magic = fields.u32_be::<0>();
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(magic_error(magic));
    }
    let reply = SimpleReply {
        error: fields.u32_be::<4>(),
        cookie: fields.u64_be::<8>(),
    };
    Ok(Some((reply, SIMPLE_REPLY_SIZE)))
}

fn magic_error(found: u32) -> SimpleReplyError {
    if found == STRUCTURED_REPLY_MAGIC {
        SimpleReplyError::Structured
    } else {
        SimpleReplyError::BadMagic { found }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::{
        Errno, Export, ExportTable, Handshake, HandshakeConfig, Outcome, decode_request,
    };
    use super::*;

    const GREETING: [u8; 18] = [
        b'N', b'B', b'D', b'M', b'A', b'G', b'I', b'C', b'I', b'H', b'A', b'V', b'E', b'O', b'P',
        b'T', 0, 0b11,
    ];

    fn option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
        [
            &[0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9][..],
            &option.to_be_bytes(),
            &reply_type.to_be_bytes(),
            &(data.len() as u32).to_be_bytes(),
            data,
        ]
        .concat()
    }

    fn info_export(size: u64, flags: u16) -> Vec<u8> {
        [
            &0u16.to_be_bytes()[..],
            &size.to_be_bytes(),
            &flags.to_be_bytes(),
        ]
        .concat()
    }

    fn info_block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
        [
            &3u16.to_be_bytes()[..],
            &minimum.to_be_bytes(),
            &preferred.to_be_bytes(),
            &maximum.to_be_bytes(),
        ]
        .concat()
    }

    /// Feeds `server` to a new handshake for `name`, all at once and byte by byte; both must
    /// agree. Returns the result and what the client sent.
    fn check(
        name: &str,
        server: &[u8],
    ) -> (Result<NegotiatedExport, ClientHandshakeError>, Vec<u8>) {
        let mut results = Vec::new();
        for chunk_size in [server.len().max(1), 1] {
            let mut client = ClientHandshake::new(name).expect("valid name");
            let mut sent = Vec::new();
            let mut result = None;
            for chunk in server.chunks(chunk_size) {
                let handled = client.handle_bytes(chunk);
                sent.extend_from_slice(client.pending_output());
                client.consume_output(client.pending_output().len());
                match handled {
                    Ok(consumed) => assert_eq!(consumed, chunk.len()),
                    Err(error) => {
                        result = Some(Err(error));
                        break;
                    }
                }
            }
            let result =
                result.unwrap_or_else(|| client.outcome().ok_or_else(|| client.handle_eof()));
            results.push((result, sent));
        }
        assert_eq!(
            results[0], results[1],
            "byte-by-byte feeding changes nothing"
        );
        results.swap_remove(0)
    }

    fn go_request(name: &str) -> Vec<u8> {
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&[0, 1, 0, 3]);
        [
            &b"IHAVEOPT"[..],
            &7u32.to_be_bytes(),
            &(data.len() as u32).to_be_bytes(),
            &data,
        ]
        .concat()
    }

    #[test]
    fn go_with_info_and_ack_yields_the_export() {
        let server = [
            &GREETING[..],
            &option_reply(7, 3, &info_export(1 << 30, 0b1_0000_1111)),
            &option_reply(7, 3, &[0, 1, b'x']), // NAME: ignored
            &option_reply(7, 3, &info_block_size(512, 4096, 1 << 20)),
            &option_reply(7, 1, &[]),
        ]
        .concat();
        let (result, sent) = check("disk", &server);
        let export = result.expect("accepted");
        assert_eq!(export.size_bytes, 1 << 30);
        assert!(export.is_read_only());
        assert_eq!(export.minimum_block_bytes(), 512);
        assert_eq!(export.maximum_payload_bytes(), 1 << 20);
        assert!(!export.export_name_fallback);
        // Client flags FIXED_NEWSTYLE | NO_ZEROES, then GO for "disk" asking for block sizes.
        assert_eq!(sent, [&[0, 0, 0, 3][..], &go_request("disk")].concat());
    }

    #[test]
    fn without_block_sizes_the_spec_defaults_apply_and_no_zeroes_is_not_claimed() {
        let mut greeting = GREETING;
        greeting[17] = 0b01; // FIXED_NEWSTYLE only
        let server = [
            &greeting[..],
            &option_reply(7, 3, &info_export(4096, 1)),
            &option_reply(7, 1, &[]),
        ]
        .concat();
        let (result, sent) = check("", &server);
        let export = result.expect("accepted");
        assert_eq!(export.block_sizes, None);
        assert_eq!(export.minimum_block_bytes(), 1);
        assert_eq!(export.maximum_payload_bytes(), 1 << 25);
        assert_eq!(&sent[..4], &[0, 0, 0, 1]);
    }

    #[test]
    fn unsupported_go_falls_back_to_export_name() {
        for (flags, padding) in [(0b11u8, 0usize), (0b01, 124)] {
            let mut greeting = GREETING;
            greeting[17] = flags;
            let mut server = [
                &greeting[..],
                &option_reply(7, 0x8000_0001, b"old"),
                &(8u64 << 20).to_be_bytes(),
                &3u16.to_be_bytes(),
            ]
            .concat();
            server.resize(server.len() + padding, 0);
            let (result, sent) = check("ns1", &server);
            let export = result.expect("accepted");
            assert_eq!(export.size_bytes, 8 << 20);
            assert_eq!(export.flags.bits(), 3);
            assert!(export.export_name_fallback);
            let export_name = [
                &b"IHAVEOPT"[..],
                &1u32.to_be_bytes(),
                &3u32.to_be_bytes(),
                b"ns1",
            ]
            .concat();
            assert!(sent.ends_with(&export_name));
        }
    }

    #[test]
    fn errors_are_typed() {
        let cases: Vec<(Vec<u8>, ClientHandshakeError)> = vec![
            (
                [
                    &GREETING[..],
                    &option_reply(7, 0x8000_0006, b"no such export"),
                ]
                .concat(),
                ClientHandshakeError::Refused {
                    export: "x".into(),
                    refusal: OptionRefusal::UnknownExport,
                    message: "no such export".into(),
                },
            ),
            (
                [&GREETING[..], &option_reply(7, 1, &[])].concat(),
                ClientHandshakeError::MissingExportInfo,
            ),
            (
                [&GREETING[..], &option_reply(6, 1, &[])].concat(),
                ClientHandshakeError::UnexpectedOption {
                    expected: 7,
                    found: 6,
                },
            ),
            (
                [&GREETING[..], &option_reply(7, 2, &[])].concat(),
                ClientHandshakeError::UnexpectedReply { reply_type: 2 },
            ),
            (
                [&GREETING[..], &option_reply(7, 3, &[0, 0, 1])].concat(),
                ClientHandshakeError::MalformedInfo {
                    info_type: 0,
                    length_bytes: 3,
                },
            ),
            (
                [
                    &GREETING[..],
                    &option_reply(7, 3, &info_block_size(3, 4096, 4096)),
                ]
                .concat(),
                ClientHandshakeError::BadBlockSizes {
                    minimum_bytes: 3,
                    preferred_bytes: 4096,
                    maximum_bytes: 4096,
                },
            ),
            (
                [&GREETING[..], &[0; 8][..], &[0; 12]].concat(),
                ClientHandshakeError::BadOptionReplyMagic { found: 0 },
            ),
            (
                [
                    &GREETING[..],
                    &[0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9],
                    &7u32.to_be_bytes(),
                    &3u32.to_be_bytes(),
                    &u32::MAX.to_be_bytes(),
                ]
                .concat(),
                ClientHandshakeError::ReplyTooLong {
                    length_bytes: u32::MAX,
                },
            ),
            (
                b"HTTP/1.1 400 Bad Request\r\n".to_vec(),
                ClientHandshakeError::BadGreeting {
                    found: u64::from_be_bytes(*b"HTTP/1.1"),
                },
            ),
            (
                [&b"NBDMAGIC"[..], &OLDSTYLE_MAGIC.to_be_bytes(), &[0, 0]].concat(),
                ClientHandshakeError::Oldstyle,
            ),
            (
                [&GREETING[..16], &[0, 0b10]].concat(),
                ClientHandshakeError::NotFixedNewstyle { flags: 0b10 },
            ),
            (GREETING[..10].to_vec(), ClientHandshakeError::Closed),
        ];
        for (server, expected) in cases {
            let (result, _) = check("x", &server);
            assert_eq!(result, Err(expected.clone()));
        }
        let message = ClientHandshakeError::Refused {
            export: "nope".into(),
            refusal: OptionRefusal::UnknownExport,
            message: "no such export".into(),
        }
        .to_string();
        assert_eq!(
            message,
            "the server refused export \"nope\": unknown export (NBD_REP_ERR_UNKNOWN): no such export"
        );
        assert!(ClientHandshake::new(&"n".repeat(4097)).is_err());
        assert!(ClientHandshake::new("a\0b").is_err());
    }

    #[test]
    fn a_failed_handshake_stays_failed() {
        let mut client = ClientHandshake::new("x").expect("name");
        let error = client.handle_bytes(&[0; 18]).expect_err("bad greeting");
        assert_eq!(client.handle_bytes(&GREETING), Err(error.clone()));
        assert_eq!(client.handle_eof(), error);
        assert_eq!(client.outcome(), None);
    }

    #[test]
    fn requests_encode_and_replies_decode() {
        let bytes = read_request(7, 4096, 512);
        let (header, size) = decode_request(&bytes).expect("magic").expect("complete");
        assert_eq!(size, 28);
        assert_eq!(header.command(), Ok(CommandType::Read));
        assert_eq!(
            (header.cookie, header.offset_bytes, header.length_bytes),
            (7, 4096, 512)
        );
        assert_eq!(header.payload_length_bytes(), 0);
        let (header, _) = decode_request(&write_request(8, 0, 1024, 1))
            .expect("magic")
            .expect("complete");
        assert_eq!(header.command(), Ok(CommandType::Write));
        assert_eq!((header.flags, header.payload_length_bytes()), (1, 1024));
        for (bytes, command) in [
            (flush_request(9), CommandType::Flush),
            (disconnect_request(10), CommandType::Disc),
        ] {
            let (header, _) = decode_request(&bytes).expect("magic").expect("complete");
            assert_eq!(header.command(), Ok(command));
        }

        let reply = SimpleReply {
            error: 22,
            cookie: 0x0102_0304_0506_0708,
        }
        .to_bytes();
        assert_eq!(decode_simple_reply(&reply[..15]), Ok(None));
        assert_eq!(decode_simple_reply(&[]), Ok(None));
        let (decoded, size) = decode_simple_reply(&reply)
            .expect("magic")
            .expect("complete");
        assert_eq!(
            (decoded.error, decoded.cookie, size),
            (22, 0x0102_0304_0506_0708, 16)
        );
        assert_eq!(Errno::from_u32(decoded.error), Ok(Errno::Inval));
        assert_eq!(
            decode_simple_reply(&[0x66, 0x8e, 0x33, 0xef]),
            Err(SimpleReplyError::Structured)
        );
        assert_eq!(
            decode_simple_reply(&[0xde, 0xad, 0xbe, 0xef, 0]),
            Err(SimpleReplyError::BadMagic { found: 0xdead_beef })
        );
    }

    /// The client against the server-side [`Handshake`] of this crate, in memory.
    #[test]
    fn round_trip_against_the_server_handshake() {
        let table = ExportTable::new(
            vec![
                Export::new("disk", 1 << 30),
                Export::new("archive", 64 << 20).read_only(),
            ],
            Some("disk"),
        )
        .expect("table");
        let table = Arc::new(table);
        for (name, size, read_only) in [("archive", 64 << 20, true), ("", 1 << 30, false)] {
            let mut server = Handshake::new(Arc::clone(&table), HandshakeConfig::default());
            let mut client = ClientHandshake::new(name).expect("name");
            // Bounded: each round moves every pending byte both ways.
            for _ in 0..8 {
                let to_client = server.pending_output().to_vec();
                server.consume_output(to_client.len());
                let consumed = client.handle_bytes(&to_client).expect("client");
                assert_eq!(consumed, to_client.len());
                let to_server = client.pending_output().to_vec();
                client.consume_output(to_server.len());
                let consumed = server.handle_bytes(&to_server).expect("server");
                assert_eq!(consumed, to_server.len());
                if client.outcome().is_some() && server.outcome().is_some() {
                    break;
                }
            }
            let export = client.outcome().expect("client finished");
            let Some(Outcome::Transmission(session)) = server.outcome() else {
                panic!("server did not enter transmission: {:?}", server.outcome());
            };
            assert_eq!(export.size_bytes, size);
            assert_eq!(export.size_bytes, session.size_bytes());
            assert_eq!(export.flags, session.flags());
            assert_eq!(export.is_read_only(), read_only);
            assert_eq!(export.block_sizes, Some(session.block_sizes()));
            assert!(
                !session.structured_replies(),
                "the client never asks for them"
            );
            // A request the client encodes validates on the server; its reply decodes.
            let (header, _) = decode_request(&read_request(3, 4096, 4096))
                .expect("magic")
                .expect("complete");
            let command = session.validate(&header).expect("valid");
            let reply = session.reply_ok(&command).expect("a READ is answered");
            let (decoded, _) = decode_simple_reply(reply.as_bytes())
                .expect("magic")
                .expect("complete");
            assert_eq!((decoded.cookie, decoded.error), (3, 0));
        }
        // An unknown export is refused with a clear, typed error.
        let mut server = Handshake::new(Arc::clone(&table), HandshakeConfig::default());
        let mut client = ClientHandshake::new("nope").expect("name");
        let greeting = server.pending_output().to_vec();
        server.consume_output(greeting.len());
        client.handle_bytes(&greeting).expect("greeting");
        let request = client.pending_output().to_vec();
        server.handle_bytes(&request).expect("server answers");
        let answer = server.pending_output().to_vec();
        let error = client.handle_bytes(&answer).expect_err("refused");
        assert!(matches!(
            error,
            ClientHandshakeError::Refused {
                refusal: OptionRefusal::UnknownExport,
                ..
            }
        ));
    }
}
