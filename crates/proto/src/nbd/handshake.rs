//! The NBD fixed-newstyle handshake as a sans-IO state machine.
//!
//! Why it is shaped this way: a handshake is a short conversation of variable-length messages
//! that may arrive split anywhere, so the machine accepts whatever bytes the driver has
//! ([`Handshake::handle_bytes`] says how many it consumed), queues its replies in a bounded
//! output buffer ([`Handshake::poll_transmit`]) and reports the end through
//! [`Handshake::outcome`]. It stops consuming at the exact byte where negotiation ends, so
//! bytes the client pipelined after `NBD_OPT_GO` stay in the driver's buffer for the
//! transmission decoder. Everything a client controls is bounded: option data (by
//! [`OPTION_DATA_MAX_BYTES`]; larger data is skipped, not buffered), the number of options
//! ([`HandshakeConfig::options_max`]) and pending output ([`OUTPUT_PENDING_MAX_BYTES`]).
//! Only the violations the spec says end the session (unknown client flags, a bad option
//! magic, an `NBD_OPT_EXPORT_NAME` that cannot be satisfied) are errors; everything else is
//! answered with an option reply and negotiation continues.

use std::sync::Arc;

use super::output::OutputBuffer;
use super::transmission::Session;
use super::{
    EXPORT_NAME_PADDING_SIZE, Export, ExportTable, IHAVEOPT, NBD_MAGIC, OPTION_HEADER_SIZE,
    OPTION_REPLY_MAGIC, STRING_SIZE_MAX, client_flags, handshake_flags, info, meta_context, option,
    reply,
};
use crate::wire::{Cursor, Fields};

/// Largest INFO/GO option data buffered: name length, a name of up to 4096 bytes, the request
/// count and up to 2045 information requests. Longer data is skipped and answered ERR_TOO_BIG.
pub const OPTION_DATA_MAX_BYTES: usize = 8192;
/// The handshake stops reading new options while this much output waits to be sent.
pub const OUTPUT_PENDING_MAX_BYTES: usize = 64 * 1024;
/// Default for [`HandshakeConfig::options_max`].
pub const OPTIONS_MAX_DEFAULT: u32 = 256;

const _: () = assert!(OPTION_DATA_MAX_BYTES >= 4 + STRING_SIZE_MAX + 2);

const MESSAGE_UNSUPPORTED: &str = "option not supported by reflexd";
const MESSAGE_TLS: &str = "TLS is not available on this server";
const MESSAGE_TLS_REQUIRED: &str = "this server requires TLS: send NBD_OPT_STARTTLS first";
const MESSAGE_TLS_AGAIN: &str = "TLS is already active";
const MESSAGE_TLS_ONLY_EXPORT: &str = "this export requires TLS: send NBD_OPT_STARTTLS first";
const MESSAGE_INVALID: &str = "malformed option data";
const MESSAGE_TOO_BIG: &str = "option data too long";
const MESSAGE_UNKNOWN_EXPORT: &str = "no such export";
const MESSAGE_SHUTDOWN: &str = "server is shutting down";
const MESSAGE_BLOCK_SIZE_REQUIRED: &str =
    "this export requires NBD_INFO_BLOCK_SIZE to be requested";
const MESSAGE_STRUCTURED_FIRST: &str = "metadata contexts need structured replies first";
const MESSAGE_TOO_MANY_QUERIES: &str = "too many metadata context queries";
const MESSAGE_BAD_QUERY: &str = "a metadata context query must be namespace:leaf";

/// Server policy for handshakes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandshakeConfig {
    /// Refuse `NBD_OPT_GO` without an `NBD_INFO_BLOCK_SIZE` request (`NBD_REP_ERR_BLOCK_SIZE_REQD`).
    /// Off by default: the spec asks servers not to refuse such clients, and reflexd answers
    /// misaligned requests with EINVAL instead.
    pub block_size_required: bool,
    /// Options one connection may send; the next one ends the session (the spec allows a hard
    /// disconnect for denial of service).
    pub options_max: u32,
    /// Whether `NBD_OPT_STARTTLS` is offered, and whether every other option waits for it.
    pub tls: TlsPolicy,
}

/// The spec's three TLS modes of a server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsPolicy {
    /// NOTLS: `NBD_OPT_STARTTLS` is refused with `NBD_REP_ERR_POLICY`.
    #[default]
    Off,
    /// SELECTIVETLS with no TLS-only export: the client may upgrade.
    Optional,
    /// FORCEDTLS: every option but `STARTTLS` and `ABORT` gets `NBD_REP_ERR_TLS_REQD` until
    /// TLS is active; `NBD_OPT_EXPORT_NAME` before it ends the session.
    Required,
}

impl Default for HandshakeConfig {
    fn default() -> Self {
        HandshakeConfig {
            block_size_required: false,
            options_max: OPTIONS_MAX_DEFAULT,
            tls: TlsPolicy::Off,
        }
    }
}

/// How a handshake ended. The driver sends all pending output before acting on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Enter transmission with this session; input after the consumed bytes is transmission.
    Transmission(Session),
    /// The client sent `NBD_OPT_ABORT`; send the pending ACK, then close.
    Aborted,
    /// The client closed the connection during the handshake ([`Handshake::handle_eof`]).
    Disconnected,
}

/// A client behaviour the spec answers with a hard disconnect.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    #[error("client flags {flags:#x} include bits the server does not know")]
    UnknownClientFlags { flags: u32 },
    #[error("option header magic {found:#018x} is not IHAVEOPT")]
    BadOptionMagic { found: u64 },
    #[error("NBD_OPT_EXPORT_NAME for unknown export {name:?}")]
    UnknownExport { name: String },
    #[error("NBD_OPT_EXPORT_NAME with a {length_bytes}-byte name (at most 4096)")]
    ExportNameTooLong { length_bytes: u32 },
    #[error("more than {options_max} options")]
    TooManyOptions { options_max: u32 },
    #[error("NBD_OPT_EXPORT_NAME while the server shuts down")]
    ShuttingDown,
    #[error("NBD_OPT_EXPORT_NAME without TLS on a server or export that requires it")]
    TlsRequired,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Waiting for the 4-byte client flags (staged).
    ClientFlags,
    /// Waiting for a 16-byte option header (staged).
    OptionHeader,
    /// Buffering `length_bytes` of option data into `data`.
    OptionData { option: Buffered, length_bytes: u32 },
    /// Discarding option data, then answering.
    Skip {
        option: u32,
        remaining_bytes: u32,
        then: AfterSkip,
    },
    /// Negotiation ended (see `outcome`) or failed (see `failure`).
    Finished,
}

/// The options whose data the handshake buffers and interprets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Buffered {
    StartTls,
    ExportName,
    List,
    StructuredReply,
    Info,
    Go,
    ListMetaContext,
    SetMetaContext,
}

impl Buffered {
    const fn code(self) -> u32 {
        match self {
            Buffered::StartTls => option::STARTTLS,
            Buffered::ExportName => option::EXPORT_NAME,
            Buffered::List => option::LIST,
            Buffered::StructuredReply => option::STRUCTURED_REPLY,
            Buffered::Info => option::INFO,
            Buffered::Go => option::GO,
            Buffered::ListMetaContext => option::LIST_META_CONTEXT,
            Buffered::SetMetaContext => option::SET_META_CONTEXT,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AfterSkip {
    Error {
        reply_type: u32,
        message: &'static str,
    },
    Abort,
}

/// Server side of one connection's handshake. Call order for the driver:
/// 1. after accepting, [`poll_transmit`](Self::poll_transmit) the greeting;
/// 2. on received bytes, [`handle_bytes`](Self::handle_bytes), drop the consumed prefix, then
///    `poll_transmit` until it returns 0; repeat while `handle_bytes` makes progress (it stops
///    early while [`OUTPUT_PENDING_MAX_BYTES`] of output wait);
/// 3. on end of stream, [`handle_eof`](Self::handle_eof);
/// 4. after sending everything, act on [`outcome`](Self::outcome).
///
/// An `Err` from `handle_bytes` means hard disconnect: close without sending more.
#[derive(Debug)]
pub struct Handshake {
    exports: Arc<ExportTable>,
    config: HandshakeConfig,
    state: State,
    staging: [u8; OPTION_HEADER_SIZE],
    staged_bytes: usize,
    data: Vec<u8>,
    output: OutputBuffer,
    client_no_zeroes: bool,
    structured_replies: bool,
    /// The export whose `base:allocation` the last `NBD_OPT_SET_META_CONTEXT` selected.
    meta_selection: Option<usize>,
    shutting_down: bool,
    options_count: u32,
    outcome: Option<Outcome>,
    failure: Option<HandshakeError>,
    /// `NBD_OPT_STARTTLS` was acknowledged: the stream continues in TLS.
    tls_active: bool,
    /// ... and the driver has not yet been told ([`Handshake::take_start_tls`]).
    tls_start_pending: bool,
}

impl Handshake {
    /// A new handshake whose greeting is already queued for sending.
    pub fn new(exports: Arc<ExportTable>, config: HandshakeConfig) -> Handshake {
        let mut handshake = Handshake {
            exports,
            config,
            state: State::ClientFlags,
            staging: [0; OPTION_HEADER_SIZE],
            staged_bytes: 0,
            data: Vec::with_capacity(OPTION_DATA_MAX_BYTES),
            output: OutputBuffer::with_capacity(1024),
            client_no_zeroes: false,
            structured_replies: false,
            meta_selection: None,
            shutting_down: false,
            options_count: 0,
            outcome: None,
            failure: None,
            tls_active: false,
            tls_start_pending: false,
        };
        handshake.output.extend_from_slice(&NBD_MAGIC.to_be_bytes());
        handshake.output.extend_from_slice(&IHAVEOPT.to_be_bytes());
        handshake.output.extend_from_slice(
            &(handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES).to_be_bytes(),
        );
        handshake
    }

    /// Whether the driver must start TLS now (once): `NBD_OPT_STARTTLS` was acknowledged, and
    /// every byte after it is TLS. The ACK is in the pending output and must leave in
    /// plaintext first.
    pub fn take_start_tls(&mut self) -> bool {
        std::mem::take(&mut self.tls_start_pending)
    }

    /// Whether TLS was started on this connection.
    pub fn tls_active(&self) -> bool {
        self.tls_active
    }

    /// How the handshake ended, once it has.
    pub fn outcome(&self) -> Option<Outcome> {
        self.outcome
    }

    /// Whether the client negotiated `NBD_OPT_STRUCTURED_REPLY` so far.
    pub fn structured_replies(&self) -> bool {
        self.structured_replies
    }

    /// From now on, options other than ABORT are answered `NBD_REP_ERR_SHUTDOWN`.
    pub fn begin_shutdown(&mut self) {
        self.shutting_down = true;
    }

    /// The client closed its side. A handshake that had not ended ends as `Disconnected`.
    pub fn handle_eof(&mut self) {
        if self.state != State::Finished {
            self.state = State::Finished;
            self.outcome = Some(Outcome::Disconnected);
        }
    }

    /// Bytes waiting to be sent.
    pub fn pending_output(&self) -> &[u8] {
        self.output.pending()
    }

    /// Marks `count` bytes of [`pending_output`](Self::pending_output) as sent.
    pub fn consume_output(&mut self, count: usize) {
        self.output.consume(count);
    }

    /// Copies pending output into `out`; returns the bytes copied (0: nothing to send).
    pub fn poll_transmit(&mut self, out: &mut [u8]) -> usize {
        let pending = self.pending_output();
        let count = pending.len().min(out.len());
        out[..count].copy_from_slice(&pending[..count]);
        self.consume_output(count);
        count
    }

    /// Feeds received bytes; returns how many were consumed. A partial header or option is
    /// consumed and kept inside, so fewer than `input.len()` bytes are consumed only when
    /// negotiation has ended (see [`outcome`](Self::outcome): after `Transmission` the rest is
    /// transmission requests) or when [`OUTPUT_PENDING_MAX_BYTES`] of output wait to be sent
    /// (send them, then offer the rest again).
    pub fn handle_bytes(&mut self, input: &[u8]) -> Result<usize, HandshakeError> {
        if let Some(failure) = &self.failure {
            return Err(failure.clone());
        }
        let mut consumed = 0;
        loop {
            if self.tls_start_pending {
                break; // What follows STARTTLS is TLS: the driver decrypts it first.
            }
            let rest = input.get(consumed..).unwrap_or_default();
            match self.state {
                State::Finished => break,
                State::ClientFlags => {
                    let (taken, complete) = self.stage(rest, super::CLIENT_FLAGS_SIZE);
                    consumed += taken;
                    if !complete {
                        break;
                    }
                    let flags = u32::from_be_bytes([
                        self.staging[0],
                        self.staging[1],
                        self.staging[2],
                        self.staging[3],
                    ]);
                    if flags & !client_flags::KNOWN != 0 {
                        return Err(self.fail(HandshakeError::UnknownClientFlags { flags }));
                    }
                    // A client without FIXED_NEWSTYLE is served fixed newstyle anyway (the spec
                    // allows it): such a client only ever sends NBD_OPT_EXPORT_NAME.
                    self.client_no_zeroes = flags & client_flags::NO_ZEROES != 0;
                    self.state = State::OptionHeader;
                }
                State::OptionHeader => {
                    if self.staged_bytes == 0
                        && self.pending_output().len() >= OUTPUT_PENDING_MAX_BYTES
                    {
                        break;
                    }
                    let (taken, complete) = self.stage(rest, OPTION_HEADER_SIZE);
                    consumed += taken;
                    if !complete {
                        break;
                    }
                    let header = Fields(&self.staging);
                    let (magic, option, length_bytes) = (
                        header.u64_be::<0>(),
                        header.u32_be::<8>(),
                        header.u32_be::<12>(),
                    );
                    if magic != IHAVEOPT {
                        return Err(self.fail(HandshakeError::BadOptionMagic { found: magic }));
                    }
                    self.begin_option(option, length_bytes)?;
                }
                State::OptionData {
                    option,
                    length_bytes,
                } => {
                    let wanted = length_bytes as usize - self.data.len();
                    let taken = wanted.min(rest.len());
                    self.data.extend_from_slice(&rest[..taken]);
                    consumed += taken;
                    if self.data.len() < length_bytes as usize {
                        break;
                    }
                    self.finish_option(option)?;
                }
                State::Skip {
                    option,
                    remaining_bytes,
                    then,
                } => {
                    let taken = (remaining_bytes as usize).min(rest.len());
                    consumed += taken;
                    let remaining_bytes = remaining_bytes - taken as u32;
                    if remaining_bytes > 0 {
                        self.state = State::Skip {
                            option,
                            remaining_bytes,
                            then,
                        };
                        break;
                    }
                    match then {
                        AfterSkip::Error {
                            reply_type,
                            message,
                        } => {
                            self.write_reply(option, reply_type, &[message.as_bytes()]);
                            self.state = State::OptionHeader;
                        }
                        AfterSkip::Abort => {
                            self.write_reply(option, reply::ACK, &[]);
                            self.finish(Outcome::Aborted);
                        }
                    }
                }
            }
        }
        debug_assert!(consumed <= input.len());
        Ok(consumed)
    }

    /// Copies bytes into the staging area until `size` are there; returns (taken, complete).
    fn stage(&mut self, rest: &[u8], size: usize) -> (usize, bool) {
        debug_assert!(size <= self.staging.len() && self.staged_bytes < size);
        let taken = (size - self.staged_bytes).min(rest.len());
        self.staging[self.staged_bytes..self.staged_bytes + taken].copy_from_slice(&rest[..taken]);
        self.staged_bytes += taken;
        let complete = self.staged_bytes == size;
        if complete {
            self.staged_bytes = 0;
        }
        (taken, complete)
    }

    fn fail(&mut self, error: HandshakeError) -> HandshakeError {
        self.state = State::Finished;
        self.failure = Some(error.clone());
        error
    }

    fn finish(&mut self, outcome: Outcome) {
        self.state = State::Finished;
        self.outcome = Some(outcome);
    }

    fn skip_then_error(
        &mut self,
        option: u32,
        length_bytes: u32,
        reply_type: u32,
        message: &'static str,
    ) {
        self.state = State::Skip {
            option,
            remaining_bytes: length_bytes,
            then: AfterSkip::Error {
                reply_type,
                message,
            },
        };
    }

    /// Decides, from the option header alone, whether to buffer the data or skip it.
    fn begin_option(&mut self, option: u32, length_bytes: u32) -> Result<(), HandshakeError> {
        self.options_count += 1;
        if self.options_count > self.config.options_max {
            return Err(self.fail(HandshakeError::TooManyOptions {
                options_max: self.config.options_max,
            }));
        }
        if self.shutting_down && option != option::ABORT {
            if option == option::EXPORT_NAME {
                return Err(self.fail(HandshakeError::ShuttingDown));
            }
            self.skip_then_error(option, length_bytes, reply::ERR_SHUTDOWN, MESSAGE_SHUTDOWN);
            return Ok(());
        }
        if self.config.tls == TlsPolicy::Required
            && !self.tls_active
            && option != option::STARTTLS
            && option != option::ABORT
        {
            if option == option::EXPORT_NAME {
                return Err(self.fail(HandshakeError::TlsRequired));
            }
            self.skip_then_error(
                option,
                length_bytes,
                reply::ERR_TLS_REQD,
                MESSAGE_TLS_REQUIRED,
            );
            return Ok(());
        }
        let buffer = |handshake: &mut Handshake, option: Buffered| {
            handshake.data.clear();
            handshake.state = State::OptionData {
                option,
                length_bytes,
            };
        };
        match option {
            option::EXPORT_NAME => {
                if length_bytes as usize > STRING_SIZE_MAX {
                    return Err(self.fail(HandshakeError::ExportNameTooLong { length_bytes }));
                }
                buffer(self, Buffered::ExportName);
            }
            option::ABORT => {
                // The spec asks servers to ignore any data sent with ABORT.
                self.state = State::Skip {
                    option,
                    remaining_bytes: length_bytes,
                    then: AfterSkip::Abort,
                };
            }
            option::LIST | option::STRUCTURED_REPLY => {
                if length_bytes != 0 {
                    self.skip_then_error(option, length_bytes, reply::ERR_INVALID, MESSAGE_INVALID);
                } else if option == option::LIST {
                    buffer(self, Buffered::List);
                } else {
                    buffer(self, Buffered::StructuredReply);
                }
            }
            option::INFO | option::GO => {
                if length_bytes as usize > OPTION_DATA_MAX_BYTES {
                    self.skip_then_error(option, length_bytes, reply::ERR_TOO_BIG, MESSAGE_TOO_BIG);
                } else if option == option::INFO {
                    buffer(self, Buffered::Info);
                } else {
                    buffer(self, Buffered::Go);
                }
            }
            option::LIST_META_CONTEXT | option::SET_META_CONTEXT => {
                if option == option::SET_META_CONTEXT {
                    // A SET replaces the selection, even when it fails.
                    self.meta_selection = None;
                }
                if length_bytes as usize > OPTION_DATA_MAX_BYTES {
                    self.skip_then_error(option, length_bytes, reply::ERR_TOO_BIG, MESSAGE_TOO_BIG);
                } else if option == option::LIST_META_CONTEXT {
                    buffer(self, Buffered::ListMetaContext);
                } else {
                    buffer(self, Buffered::SetMetaContext);
                }
            }
            option::STARTTLS => {
                if self.config.tls == TlsPolicy::Off {
                    self.skip_then_error(option, length_bytes, reply::ERR_POLICY, MESSAGE_TLS);
                } else if self.tls_active {
                    self.skip_then_error(
                        option,
                        length_bytes,
                        reply::ERR_INVALID,
                        MESSAGE_TLS_AGAIN,
                    );
                } else if length_bytes != 0 {
                    self.skip_then_error(option, length_bytes, reply::ERR_INVALID, MESSAGE_INVALID);
                } else {
                    buffer(self, Buffered::StartTls);
                }
            }
            _ => self.skip_then_error(option, length_bytes, reply::ERR_UNSUP, MESSAGE_UNSUPPORTED),
        }
        Ok(())
    }

    /// Handles an option whose data is complete in `self.data`.
    fn finish_option(&mut self, buffered: Buffered) -> Result<(), HandshakeError> {
        self.state = State::OptionHeader;
        let option = buffered.code();
        match buffered {
            Buffered::StartTls => {
                self.write_reply(option, reply::ACK, &[]);
                self.tls_active = true;
                self.tls_start_pending = true;
            }
            Buffered::ExportName => {
                let exports = Arc::clone(&self.exports);
                let Some((index, export)) = exports.lookup(&self.data) else {
                    let name = String::from_utf8_lossy(&self.data).into_owned();
                    return Err(self.fail(HandshakeError::UnknownExport { name }));
                };
                if export.tls_only && !self.tls_active {
                    return Err(self.fail(HandshakeError::TlsRequired));
                }
                self.output
                    .extend_from_slice(&export.size_bytes.to_be_bytes());
                self.output
                    .extend_from_slice(&export.flags.bits().to_be_bytes());
                if !self.client_no_zeroes {
                    self.output
                        .extend_from_slice(&[0; EXPORT_NAME_PADDING_SIZE]);
                }
                // EXPORT_NAME cannot ask for block sizes: the spec's defaults apply.
                let session = self.session(index, export, false);
                self.finish(Outcome::Transmission(session));
            }
            Buffered::List => {
                let exports = Arc::clone(&self.exports);
                for export in exports.exports() {
                    if export.tls_only && !self.tls_active {
                        continue; // The spec allows leaving TLS-only exports out.
                    }
                    let name = export.name.as_bytes();
                    self.write_reply(
                        option,
                        reply::SERVER,
                        &[&(name.len() as u32).to_be_bytes(), name],
                    );
                }
                self.write_reply(option, reply::ACK, &[]);
            }
            Buffered::StructuredReply => {
                self.structured_replies = true;
                self.write_reply(option, reply::ACK, &[]);
            }
            Buffered::Info | Buffered::Go => self.info_or_go(option),
            Buffered::ListMetaContext | Buffered::SetMetaContext => self.meta_context(option),
        }
        Ok(())
    }

    /// The session for entering transmission on `export`.
    fn session(&self, index: usize, export: &Export, block_sizes_agreed: bool) -> Session {
        let base_allocation =
            self.structured_replies && export.base_allocation && self.meta_selection == Some(index);
        Session::new(index, export, self.structured_replies)
            .with_block_sizes_agreed(block_sizes_agreed)
            .with_base_allocation(base_allocation)
    }

    /// `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`: the only context is
    /// `base:allocation`, matched by its name (and, when listing, by `base:` or no query).
    fn meta_context(&mut self, option: u32) {
        let set = option == option::SET_META_CONTEXT;
        let data = std::mem::take(&mut self.data);
        let exports = Arc::clone(&self.exports);
        let result = match parse_meta_request(&data) {
            Err(MetaError::Malformed) => Err((reply::ERR_INVALID, MESSAGE_INVALID)),
            Err(MetaError::TooManyQueries) => Err((reply::ERR_TOO_BIG, MESSAGE_TOO_MANY_QUERIES)),
            Err(MetaError::BadQuery) => Err((reply::ERR_INVALID, MESSAGE_BAD_QUERY)),
            Ok(_) if set && !self.structured_replies => {
                Err((reply::ERR_INVALID, MESSAGE_STRUCTURED_FIRST))
            }
            Ok(request) => match exports.lookup(request.name) {
                None => Err((reply::ERR_UNKNOWN, MESSAGE_UNKNOWN_EXPORT)),
                Some((index, export)) => Ok((index, export.base_allocation, request)),
            },
        };
        match result {
            Err((reply_type, message)) => {
                self.write_reply(option, reply_type, &[message.as_bytes()])
            }
            Ok((index, offered, request)) => {
                let wanted = request.queries().any(|query| {
                    query == meta_context::BASE_ALLOCATION.as_bytes() || (!set && query == b"base:")
                });
                let matched = offered && (wanted || (!set && request.query_count == 0));
                if matched {
                    // Listed contexts carry id 0, as the spec asks.
                    let id = if set {
                        meta_context::BASE_ALLOCATION_ID
                    } else {
                        0
                    };
                    self.write_reply(
                        option,
                        reply::META_CONTEXT,
                        &[&id.to_be_bytes(), meta_context::BASE_ALLOCATION.as_bytes()],
                    );
                    if set {
                        self.meta_selection = Some(index);
                    }
                }
                self.write_reply(option, reply::ACK, &[]);
            }
        }
        self.data = data;
    }

    /// `NBD_OPT_INFO` and `NBD_OPT_GO`: parse, then INFO replies and ACK, or an error reply.
    fn info_or_go(&mut self, option: u32) {
        let data = std::mem::take(&mut self.data);
        let exports = Arc::clone(&self.exports);
        let result = match parse_info_request(&data) {
            None => Err((reply::ERR_INVALID, MESSAGE_INVALID)),
            Some(request) => match exports.lookup(request.name) {
                None => Err((reply::ERR_UNKNOWN, MESSAGE_UNKNOWN_EXPORT)),
                Some((_, export)) if export.tls_only && !self.tls_active => {
                    Err((reply::ERR_TLS_REQD, MESSAGE_TLS_ONLY_EXPORT))
                }
                Some((index, export)) => Ok((index, export, request)),
            },
        };
        match result {
            Err((reply_type, message)) => {
                self.write_reply(option, reply_type, &[message.as_bytes()])
            }
            Ok((index, export, request)) => {
                self.write_info_replies(option, export, &request);
                if option == option::GO && self.config.block_size_required && !request.block_size {
                    self.write_reply(
                        option,
                        reply::ERR_BLOCK_SIZE_REQD,
                        &[MESSAGE_BLOCK_SIZE_REQUIRED.as_bytes()],
                    );
                } else {
                    self.write_reply(option, reply::ACK, &[]);
                    if option == option::GO {
                        let session = self.session(index, export, request.block_size);
                        self.finish(Outcome::Transmission(session));
                    }
                }
            }
        }
        self.data = data;
    }

    /// INFO_EXPORT, then NAME and DESCRIPTION when asked for (and present), then BLOCK_SIZE
    /// always: the constraints are not the defaults, so the spec wants them advertised.
    fn write_info_replies(&mut self, option: u32, export: &Export, request: &InfoRequest<'_>) {
        let mut export_info = [0u8; 12];
        export_info[..2].copy_from_slice(&info::EXPORT.to_be_bytes());
        export_info[2..10].copy_from_slice(&export.size_bytes.to_be_bytes());
        export_info[10..].copy_from_slice(&export.flags.bits().to_be_bytes());
        self.write_reply(option, reply::INFO, &[&export_info]);
        if request.name_requested {
            self.write_reply(
                option,
                reply::INFO,
                &[&info::NAME.to_be_bytes(), export.name.as_bytes()],
            );
        }
        if request.description && !export.description.is_empty() {
            self.write_reply(
                option,
                reply::INFO,
                &[
                    &info::DESCRIPTION.to_be_bytes(),
                    export.description.as_bytes(),
                ],
            );
        }
        let sizes = export.block_sizes;
        let mut block_size_info = [0u8; 14];
        block_size_info[..2].copy_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        block_size_info[2..6].copy_from_slice(&sizes.minimum_bytes.to_be_bytes());
        block_size_info[6..10].copy_from_slice(&sizes.preferred_bytes.to_be_bytes());
        block_size_info[10..].copy_from_slice(&sizes.maximum_bytes.to_be_bytes());
        self.write_reply(option, reply::INFO, &[&block_size_info]);
    }

    /// Appends one option reply whose payload is the concatenation of `parts`.
    fn write_reply(&mut self, option: u32, reply_type: u32, parts: &[&[u8]]) {
        let length: usize = parts.iter().map(|part| part.len()).sum();
        debug_assert!(
            length <= 2 * STRING_SIZE_MAX + 8,
            "option replies carry bounded strings"
        );
        self.output
            .extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        self.output.extend_from_slice(&option.to_be_bytes());
        self.output.extend_from_slice(&reply_type.to_be_bytes());
        self.output
            .extend_from_slice(&(length as u32).to_be_bytes());
        for part in parts {
            self.output.extend_from_slice(part);
        }
    }
}

/// The parsed data of `NBD_OPT_INFO`/`NBD_OPT_GO`.
struct InfoRequest<'a> {
    name: &'a [u8],
    name_requested: bool,
    description: bool,
    block_size: bool,
}

/// Data: u32 name length, name, u16 request count, u16 × count. `None` when the lengths do not
/// add up to exactly the option length.
fn parse_info_request(data: &[u8]) -> Option<InfoRequest<'_>> {
    let mut cursor = Cursor::new(data);
    let name_length = cursor.u32_be()? as usize;
    let name = cursor.take(name_length)?;
    let count = cursor.u16_be()? as usize;
    if cursor.remaining() != 2 * count {
        return None;
    }
    let mut request = InfoRequest {
        name,
        name_requested: false,
        description: false,
        block_size: false,
    };
    for _ in 0..count {
        match cursor.u16_be()? {
            info::NAME => request.name_requested = true,
            info::DESCRIPTION => request.description = true,
            info::BLOCK_SIZE => request.block_size = true,
            // INFO_EXPORT is always sent; unknown requests are ignored, as the spec requires.
            _ => {}
        }
    }
    Some(request)
}

/// The parsed data of `NBD_OPT_LIST_META_CONTEXT`/`NBD_OPT_SET_META_CONTEXT`.
struct MetaRequest<'a> {
    name: &'a [u8],
    query_count: usize,
    /// The queries, each a u32 length and its bytes (checked by the parser).
    queries: &'a [u8],
}

impl<'a> MetaRequest<'a> {
    fn queries(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        let mut cursor = Cursor::new(self.queries);
        std::iter::from_fn(move || {
            let length = cursor.u32_be()? as usize;
            cursor.take(length)
        })
    }
}

enum MetaError {
    Malformed,
    TooManyQueries,
    BadQuery,
}

/// Data: u32 name length, name, u32 query count, then per query a u32 length and the query.
/// The lengths must add up to exactly the option length; a query must be at most 4096 bytes
/// and hold a `:` after a non-empty namespace.
fn parse_meta_request(data: &[u8]) -> Result<MetaRequest<'_>, MetaError> {
    let mut cursor = Cursor::new(data);
    let name_length = cursor.u32_be().ok_or(MetaError::Malformed)? as usize;
    let name = cursor.take(name_length).ok_or(MetaError::Malformed)?;
    let query_count = cursor.u32_be().ok_or(MetaError::Malformed)? as usize;
    let queries = cursor
        .take(cursor.remaining())
        .ok_or(MetaError::Malformed)?;
    let request = MetaRequest {
        name,
        query_count,
        queries,
    };
    let mut check = Cursor::new(queries);
    for _ in 0..query_count {
        let length = check.u32_be().ok_or(MetaError::Malformed)? as usize;
        let query = check.take(length).ok_or(MetaError::Malformed)?;
        if length > STRING_SIZE_MAX || !query.iter().skip(1).any(|&byte| byte == b':') {
            return Err(MetaError::BadQuery);
        }
    }
    if check.remaining() != 0 {
        return Err(MetaError::Malformed);
    }
    if query_count > meta_context::QUERIES_MAX {
        return Err(MetaError::TooManyQueries);
    }
    Ok(request)
}
