//! Protocol front ends: how a connection's bytes become requests and how results become
//! response headers, for each wire protocol the dataplane serves (native, original ReFlex,
//! NBD).
//!
//! Why a layer of its own: the dataplane loop moves bytes and buffers; it must not know the
//! shape of any header. A listening port speaks a [`Protocol`]; each connection accepted on it
//! gets a [`Frontend`] holding that protocol's per-connection state. [`Frontend::decode`]
//! looks at the unparsed bytes of the receive buffer and says one of: need more bytes; here is
//! a request (validated through the `proto` codecs, with the number of payload bytes that
//! follow it in the stream); bytes consumed without a request (NBD handshake traffic);
//! finish (answer what is outstanding, read nothing more, then close); or close now (broken
//! framing). [`Frontend::encode_response`] turns a request's [`Tag`] and [`Answer`] into
//! header bytes, or says the protocol cannot express that answer (the original protocol has no
//! status field: the connection is closed instead).
//!
//! NBD has a handshake before its requests. The frontend drives `reflex_proto::nbd::Handshake`
//! with the received bytes; whenever the handshake has output to send, `decode` returns an
//! [`Action::Output`] request, for which the dataplane takes a buffer run, lets the frontend
//! copy the output into it ([`Frontend::write_output`]) and sends it like READ data, in order
//! with everything else on the connection. When the handshake yields a session the frontend
//! switches to transmission on the spot: bytes the client pipelined after `NBD_OPT_GO` are
//! decoded as requests in the same pass. Only the handshake allocates (once per connection);
//! transmission decoding and reply encoding allocate nothing.
//!
//! Tenants: an [`IoRequest`] carries the tenant the protocol chose for it (an NBD export's or
//! an original-protocol port's configured tenant), or [`TenantRef::NONE`]; the dataplane
//! resolves the rest (a native connection's BIND, the namespace's default tenant). Native
//! control requests (REGISTER, UNREGISTER, BIND) arrive whole, body included, as
//! [`Action::Control`]: their bodies are small and are never received into the I/O arena.

use std::sync::Arc;

use reflex_flash::FlashError;
use reflex_proto::native::{
    self, Capabilities, ControlOp, RegisterBody, ServerLimits, Status, ValidatedRequest,
};
use reflex_proto::nbd::{self, Errno, ExportTable, Handshake, HandshakeConfig, Session};
use reflex_proto::original;

use crate::control::TenantRef;
use crate::namespaces::NamespaceSet;

/// Room for the largest response header of any protocol.
pub const RESPONSE_HEADER_SIZE_MAX: usize = 32;

const _: () = assert!(native::RESPONSE_HEADER_SIZE <= RESPONSE_HEADER_SIZE_MAX);
const _: () = assert!(original::HEADER_SIZE <= RESPONSE_HEADER_SIZE_MAX);
// The largest NBD reply header: an OFFSET_DATA chunk header and its 8-byte offset.
const _: () = assert!(nbd::CHUNK_HEADER_SIZE + 8 <= RESPONSE_HEADER_SIZE_MAX);
const _: () = assert!(nbd::SIMPLE_REPLY_SIZE <= RESPONSE_HEADER_SIZE_MAX);

/// The protocol a listening port speaks. Each connection accepted there gets a [`Frontend`]
/// made by [`Frontend::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Native,
    /// The original ReFlex block protocol; the listening port fixed the namespace and the
    /// tenant (`NONE`: the namespace's).
    Original {
        namespace_index: u16,
        tenant: TenantRef,
    },
    Nbd,
}

/// The protocol of a connection, with its per-connection protocol state.
#[derive(Debug)]
pub enum Frontend {
    Native,
    Original {
        namespace_index: u16,
        tenant: TenantRef,
    },
    Nbd(NbdFrontend),
}

/// What a response must echo, kept in the request slot from decode to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tag {
    /// No header: the request's run is sent as is (NBD handshake output).
    None,
    Native {
        opcode_raw: u8,
        request_id: u64,
    },
    Original {
        response: original::Header,
    },
    /// A validated NBD command: success replies need its type, offset and length.
    Nbd(nbd::ValidatedCommand),
    /// An NBD request refused before any I/O: only its cookie is echoed.
    NbdRefused {
        cookie: u64,
    },
}

/// A device operation, validated against its namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoRequest {
    pub kind: IoKind,
    pub namespace_index: u16,
    pub offset_bytes: u64,
    pub length_bytes: u32,
    /// Whom the scheduler charges: the NBD export's or original port's configured tenant, or
    /// `NONE` (native connections; unbound exports and ports), which the dataplane resolves.
    pub tenant: TenantRef,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write {
        fua: bool,
    },
    Flush,
    /// Discard the range (it reads back as zeroes). `hint`: a device that cannot discard
    /// succeeds anyway (NBD's TRIM is advisory); without it the device's refusal is the answer
    /// (native TRIM). `fua`: durable before the answer (a flush follows).
    Trim {
        fua: bool,
        hint: bool,
    },
    /// Make the range read as zeroes: discard it, or with `no_hole` (or on a device that
    /// cannot discard) write zeroes from a zeroed run. `fua` as for `Trim`.
    WriteZeroes {
        fua: bool,
        no_hole: bool,
    },
}

impl IoKind {
    /// Whether the request's data travels in a buffer run (READ and WRITE).
    pub fn has_data(self) -> bool {
        matches!(self, IoKind::Read | IoKind::Write { .. })
    }
}

/// What a decoded request asks the dataplane to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Io(IoRequest),
    /// Answer with the server's capabilities (native HELLO); the client's Linux I/O priority
    /// (`class << 13 | level`, 0: none) picks the connection's device priority class.
    Hello {
        io_priority: u16,
    },
    /// Answer at once with this (failure) and no body: validation failures, control opcodes
    /// not implemented yet, NBD requests during shutdown. The request's payload, if any, is
    /// skipped.
    Reply(Answer),
    /// Send the protocol output the frontend holds (NBD handshake replies): the dataplane
    /// takes a run of [`Frontend::pending_output_bytes`] (at most one maximal run), fills it
    /// with [`Frontend::write_output`] and sends it.
    Output,
    /// A native tenant request, body decoded (`docs/PROTOCOL.md` §1.9).
    Control(ControlRequest),
    /// A RENEGOTIATE notice the dataplane queued on the connection (never decoded).
    Notice,
}

/// A native control request with its decoded body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlRequest {
    Register(RegisterBody),
    Unregister {
        handle: u64,
    },
    /// `handle` 0: back to the connection's default tenant.
    Bind {
        handle: u64,
    },
}

/// How a request ended, before any protocol shaped it into a status or an errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Ok,
    /// Refused by native validation with this status.
    Native(Status),
    /// Refused by NBD validation (or shutdown) with this error.
    Nbd(Errno),
    /// The device failed with this Linux errno.
    DeviceError {
        errno: i32,
    },
    /// The device does not implement the operation.
    Unsupported,
}

impl Answer {
    /// A device's failure as an answer.
    pub fn from_device(error: &FlashError) -> Answer {
        match error {
            FlashError::Io { errno } => Answer::DeviceError { errno: *errno },
            FlashError::Unsupported => Answer::Unsupported,
            FlashError::Open { .. } => Answer::DeviceError { errno: libc::EIO },
        }
    }

    pub fn is_ok(self) -> bool {
        self == Answer::Ok
    }

    /// The native protocol's status for this answer.
    pub fn native_status(self) -> Status {
        match self {
            Answer::Ok => Status::Ok,
            Answer::Native(status) => status,
            // Not produced for native requests; the nearest meaning.
            Answer::Nbd(_) | Answer::Unsupported => Status::Invalid,
            Answer::DeviceError {
                errno: libc::ENOSPC | libc::EDQUOT,
            } => Status::NoSpace,
            Answer::DeviceError { .. } => Status::IoError,
        }
    }

    /// The NBD error for a failed answer (`docs/NBD.md`, "Error mapping"). Device errors go
    /// through [`Errno::from_linux_errno`], except the values the spec asks servers not to
    /// send in our situation (ENOMEM: reflexd applies back-pressure instead; EOVERFLOW and
    /// ENOTSUP: reserved for DF and fast zero, which are not offered; ESHUTDOWN: means the
    /// server, not a device): those become EIO, as does an operation the device lacks.
    pub fn nbd_errno(self) -> Errno {
        match self {
            Answer::Nbd(errno) => errno,
            // The tenant may not do this (unbound from an unregistered tenant, read-only).
            Answer::Native(Status::Permission) => Errno::Perm,
            Answer::Ok | Answer::Native(_) => Errno::Inval,
            Answer::Unsupported => Errno::Io,
            Answer::DeviceError { errno } => match Errno::from_linux_errno(errno) {
                Errno::NoMem | Errno::Overflow | Errno::NotSup | Errno::Shutdown => Errno::Io,
                other => other,
            },
        }
    }
}

/// The outcome of looking at the unparsed bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// Not a whole header yet: receive more.
    NeedMore,
    Request {
        /// Bytes of the buffer the request's header (and small body) occupied.
        header_bytes: usize,
        /// Bytes that follow in the stream and belong to this request: a WRITE's data, or a
        /// payload to skip.
        payload_bytes: u64,
        tag: Tag,
        action: Action,
    },
    /// The protocol consumed this many bytes without making a request (NBD handshake).
    Consumed(usize),
    /// The peer ended the session cleanly (NBD `ABORT`, `DISC`, end of stream during the
    /// handshake): consume these bytes, read nothing more, answer what is outstanding, close.
    Finish { consumed_bytes: usize },
    /// Broken framing, or a request the protocol cannot refuse politely: close the connection.
    Close(String),
}

impl Frontend {
    /// The state of a new connection accepted on a `protocol` port. NBD needs the export
    /// table (the server passes it whenever it listens for NBD).
    pub fn new(protocol: Protocol, nbd_exports: Option<&Arc<NbdExports>>) -> Frontend {
        match protocol {
            Protocol::Native => Frontend::Native,
            Protocol::Original {
                namespace_index,
                tenant,
            } => Frontend::Original {
                namespace_index,
                tenant,
            },
            Protocol::Nbd => {
                let Some(exports) = nbd_exports else {
                    panic!("an NBD listener without an export table");
                };
                Frontend::Nbd(NbdFrontend::new(Arc::clone(exports)))
            }
        }
    }

    /// Looks at the unparsed bytes. `&mut self`: a protocol with per-connection state (NBD's
    /// handshake) advances it here.
    pub fn decode(&mut self, input: &[u8], namespaces: &NamespaceSet) -> Decoded {
        match self {
            Frontend::Native => decode_native(input, namespaces),
            Frontend::Original {
                namespace_index,
                tenant,
            } => decode_original(input, *namespace_index, *tenant, namespaces),
            Frontend::Nbd(nbd) => nbd.decode(input),
        }
    }

    /// Writes the response header for `tag` with `answer` and `data_bytes` of payload; `None`
    /// when the protocol cannot carry the answer (the caller closes the connection).
    pub fn encode_response(
        &self,
        tag: &Tag,
        answer: Answer,
        data_bytes: u32,
        out: &mut [u8; RESPONSE_HEADER_SIZE_MAX],
    ) -> Option<usize> {
        let mut put = |bytes: &[u8]| {
            out[..bytes.len()].copy_from_slice(bytes);
            Some(bytes.len())
        };
        match *tag {
            Tag::None => Some(0),
            Tag::Native {
                opcode_raw,
                request_id,
            } => {
                let status = answer.native_status();
                let header =
                    native::ResponseHeader::new(opcode_raw, status, request_id, data_bytes);
                put(&header.to_bytes())
            }
            Tag::Original { response } => {
                if !answer.is_ok() {
                    return None;
                }
                put(&response.to_bytes())
            }
            Tag::Nbd(command) => {
                let session = self.nbd_session()?;
                if answer.is_ok() {
                    let reply = session.reply_ok(&command)?;
                    put(reply.as_bytes())
                } else {
                    put(session
                        .reply_error(command.cookie(), answer.nbd_errno())
                        .as_bytes())
                }
            }
            Tag::NbdRefused { cookie } => {
                let session = self.nbd_session()?;
                put(session.reply_error(cookie, answer.nbd_errno()).as_bytes())
            }
        }
    }

    fn nbd_session(&self) -> Option<&Session> {
        match self {
            Frontend::Nbd(NbdFrontend {
                phase: NbdPhase::Transmission(transmission),
                ..
            }) => Some(&transmission.session),
            _ => None,
        }
    }

    /// Bytes of protocol output waiting for an [`Action::Output`] request.
    pub fn pending_output_bytes(&self) -> usize {
        match self {
            Frontend::Nbd(NbdFrontend {
                phase: NbdPhase::Handshake(handshake),
                ..
            }) => handshake.pending_output().len(),
            _ => 0,
        }
    }

    /// Moves pending output into `out`; returns the bytes written.
    pub fn write_output(&mut self, out: &mut [u8]) -> usize {
        match self {
            Frontend::Nbd(NbdFrontend {
                phase: NbdPhase::Handshake(handshake),
                ..
            }) => handshake.poll_transmit(out),
            _ => 0,
        }
    }

    /// The server begins shutting down. Returns whether the connection should keep reading
    /// while its in-flight requests finish: an NBD session does, so that requests arriving in
    /// the meantime are answered ESHUTDOWN (the spec's graceful shutdown). Everything else
    /// stops reading at once (an NBD connection still in its handshake included: it is closed
    /// once the output already queued is sent).
    pub fn begin_shutdown(&mut self) -> bool {
        match self {
            Frontend::Nbd(nbd) => nbd.begin_shutdown(),
            Frontend::Native | Frontend::Original { .. } => false,
        }
    }

    /// Bytes of body an [`Action::Hello`] needs.
    pub fn hello_body_size_max(namespaces: &NamespaceSet) -> usize {
        Capabilities::encoded_size(namespaces.native_table().len())
    }

    /// Writes the capabilities body into `out`; returns its length.
    pub fn write_hello_body(namespaces: &NamespaceSet, window: u32, out: &mut [u8]) -> usize {
        let capabilities = Capabilities::from_limits(&namespaces.limits(), window);
        match capabilities.encode_into(namespaces.native_table(), out) {
            Ok(length) => length,
            Err(e) => panic!("capabilities buffer sized from encoded_size: {e}"),
        }
    }
}

fn decode_native(input: &[u8], namespaces: &NamespaceSet) -> Decoded {
    let (header, header_bytes) = match native::decode_request(input) {
        Ok(Some(decoded)) => decoded,
        Ok(None) => return Decoded::NeedMore,
        Err(e) => return Decoded::Close(e.to_string()),
    };
    let tag = Tag::Native {
        opcode_raw: header.opcode_raw,
        request_id: header.request_id,
    };
    let payload_bytes = u64::from(header.payload_length_bytes());
    let limits: ServerLimits = namespaces.limits();
    let reply = |status: Status| Decoded::Request {
        header_bytes,
        payload_bytes,
        tag,
        action: Action::Reply(Answer::Native(status)),
    };
    match native::validate_request(&header, &limits, namespaces.native_table()) {
        Err(status) => reply(status),
        Ok(ValidatedRequest::Hello) => {
            // The 16-byte body is small: wait until it is in the buffer with the header.
            let total = header_bytes + native::HELLO_BODY_SIZE;
            let Some(body) = input.get(header_bytes..total) else {
                return Decoded::NeedMore;
            };
            let action = match native::HelloBody::decode(body) {
                Ok(hello) => Action::Hello {
                    io_priority: hello.io_priority,
                },
                Err(_) => Action::Reply(Answer::Native(Status::Invalid)),
            };
            Decoded::Request {
                header_bytes: total,
                payload_bytes: 0,
                tag,
                action,
            }
        }
        Ok(ValidatedRequest::Control {
            op,
            body_length_bytes,
        }) => {
            // Bodies are small (at most 4 KiB, const-asserted to fit the receive buffer):
            // wait until the whole body is there with its header.
            let total = header_bytes + body_length_bytes as usize;
            let Some(body) = input.get(header_bytes..total) else {
                return Decoded::NeedMore;
            };
            let request = match op {
                ControlOp::Register => RegisterBody::decode(body).map(ControlRequest::Register),
                ControlOp::Unregister => {
                    native::decode_handle(body).map(|handle| ControlRequest::Unregister { handle })
                }
                ControlOp::Bind => {
                    native::decode_handle(body).map(|handle| ControlRequest::Bind { handle })
                }
            };
            let action = match request {
                Ok(request) => Action::Control(request),
                Err(_) => Action::Reply(Answer::Native(Status::Invalid)),
            };
            Decoded::Request {
                header_bytes: total,
                payload_bytes: 0,
                tag,
                action,
            }
        }
        Ok(ValidatedRequest::Io(io)) => {
            let Some(namespace_index) = namespaces.index_of(io.namespace_id()) else {
                return reply(Status::NoSuchNamespace);
            };
            let kind = match io.op() {
                native::IoOp::Read => IoKind::Read,
                native::IoOp::Write { fua } => IoKind::Write { fua },
                native::IoOp::Flush => IoKind::Flush,
                native::IoOp::Trim => IoKind::Trim {
                    fua: false,
                    hint: false,
                },
            };
            Decoded::Request {
                header_bytes,
                payload_bytes,
                tag,
                action: Action::Io(IoRequest {
                    kind,
                    namespace_index,
                    offset_bytes: io.offset_bytes(),
                    length_bytes: io.length_bytes(),
                    tenant: TenantRef::NONE,
                }),
            }
        }
    }
}

fn decode_original(
    input: &[u8],
    namespace_index: u16,
    tenant: TenantRef,
    namespaces: &NamespaceSet,
) -> Decoded {
    let (header, header_bytes) = match original::Header::decode(input) {
        Ok(Some(decoded)) => decoded,
        Ok(None) => return Decoded::NeedMore,
        Err(e) => return Decoded::Close(e.to_string()),
    };
    let limits = original::Limits::default();
    let size_bytes = namespaces.size_bytes(namespace_index);
    match original::validate(&header, &limits, size_bytes) {
        Err(e) => Decoded::Close(e.to_string()),
        Ok(io) => {
            let kind = match io.opcode() {
                original::Opcode::Read => IoKind::Read,
                original::Opcode::Write => IoKind::Write { fua: false },
            };
            Decoded::Request {
                header_bytes,
                payload_bytes: header.request_payload_length_bytes(),
                tag: Tag::Original {
                    response: io.response_header(),
                },
                action: Action::Io(IoRequest {
                    kind,
                    namespace_index,
                    offset_bytes: io.offset_bytes(),
                    length_bytes: io.length_bytes(),
                    tenant,
                }),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// NBD

/// Where an export's I/O goes and whom it is charged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportBinding {
    pub namespace_index: u16,
    /// The tenant bound to the export in the configuration; `NONE` when none is (or the
    /// namespace has no QoS): the namespace's default tenant.
    pub tenant: TenantRef,
}

/// The NBD exports of a server: the codec's table (what clients see) and, at the same index,
/// each export's namespace and tenant. Built once at start and shared by every connection.
#[derive(Debug)]
pub struct NbdExports {
    table: Arc<ExportTable>,
    bindings: Vec<ExportBinding>,
    handshake: HandshakeConfig,
}

impl NbdExports {
    /// `exports[i]` is offered as export `i`; `default_name` is the export for the empty name.
    pub fn new(
        exports: Vec<(nbd::Export, ExportBinding)>,
        default_name: Option<&str>,
    ) -> Result<NbdExports, nbd::ExportError> {
        let (exports, bindings): (Vec<_>, Vec<_>) = exports.into_iter().unzip();
        let table = ExportTable::new(exports, default_name)?;
        Ok(NbdExports {
            table: Arc::new(table),
            bindings,
            handshake: HandshakeConfig::default(),
        })
    }

    pub fn table(&self) -> &ExportTable {
        &self.table
    }

    pub fn binding(&self, export_index: usize) -> Option<ExportBinding> {
        self.bindings.get(export_index).copied()
    }
}

/// One NBD connection: handshake, then transmission.
#[derive(Debug)]
pub struct NbdFrontend {
    exports: Arc<NbdExports>,
    phase: NbdPhase,
}

#[derive(Debug)]
enum NbdPhase {
    /// Boxed: the handshake's buffers are large and gone once transmission begins.
    Handshake(Box<Handshake>),
    Transmission(Transmission),
    /// `NBD_OPT_ABORT` or end of stream during the handshake: nothing more to decode.
    Ended,
}

#[derive(Debug, Clone, Copy)]
struct Transmission {
    session: Session,
    binding: ExportBinding,
    /// Requests from now on are answered ESHUTDOWN (except DISC).
    shutting_down: bool,
    /// `NBD_CMD_DISC` arrived: nothing after it is decoded.
    disconnected: bool,
}

impl NbdFrontend {
    fn new(exports: Arc<NbdExports>) -> NbdFrontend {
        let handshake = Handshake::new(Arc::clone(&exports.table), exports.handshake);
        NbdFrontend {
            exports,
            phase: NbdPhase::Handshake(Box::new(handshake)),
        }
    }

    fn decode(&mut self, input: &[u8]) -> Decoded {
        loop {
            let handshake = match &mut self.phase {
                NbdPhase::Handshake(handshake) => handshake,
                NbdPhase::Transmission(transmission) => return transmission.decode(input),
                NbdPhase::Ended => return Decoded::NeedMore,
            };
            // Output first: replies go out in order, and the last ACK before transmission.
            if !handshake.pending_output().is_empty() {
                return Decoded::Request {
                    header_bytes: 0,
                    payload_bytes: 0,
                    tag: Tag::None,
                    action: Action::Output,
                };
            }
            match handshake.outcome() {
                Some(nbd::Outcome::Transmission(session)) => {
                    let Some(binding) = self.exports.binding(session.export_index()) else {
                        return Decoded::Close("the handshake chose an export out of range".into());
                    };
                    self.phase = NbdPhase::Transmission(Transmission {
                        session,
                        binding,
                        shutting_down: false,
                        disconnected: false,
                    });
                    // The bytes after NBD_OPT_GO are requests: decode them now.
                    continue;
                }
                Some(nbd::Outcome::Aborted | nbd::Outcome::Disconnected) => {
                    self.phase = NbdPhase::Ended;
                    return Decoded::Finish { consumed_bytes: 0 };
                }
                None => {}
            }
            if input.is_empty() {
                return Decoded::NeedMore;
            }
            return match handshake.handle_bytes(input) {
                Err(e) => Decoded::Close(format!("NBD handshake: {e}")),
                Ok(0) if handshake.pending_output().is_empty() && handshake.outcome().is_none() => {
                    Decoded::NeedMore
                }
                Ok(consumed) => Decoded::Consumed(consumed),
            };
        }
    }

    fn begin_shutdown(&mut self) -> bool {
        match &mut self.phase {
            NbdPhase::Handshake(handshake) => {
                handshake.begin_shutdown();
                false
            }
            NbdPhase::Transmission(transmission) => {
                transmission.shutting_down = true;
                !transmission.disconnected
            }
            NbdPhase::Ended => false,
        }
    }
}

impl Transmission {
    fn decode(&mut self, input: &[u8]) -> Decoded {
        if self.disconnected {
            return Decoded::NeedMore;
        }
        let (header, header_bytes) = match nbd::decode_request(input) {
            Ok(Some(decoded)) => decoded,
            Ok(None) => return Decoded::NeedMore,
            Err(e) => return Decoded::Close(e.to_string()),
        };
        let payload_bytes = u64::from(header.payload_length_bytes());
        let refuse = |errno: Errno| Decoded::Request {
            header_bytes,
            payload_bytes,
            tag: Tag::NbdRefused {
                cookie: header.cookie,
            },
            action: Action::Reply(Answer::Nbd(errno)),
        };
        let is_disconnect = header.command() == Ok(nbd::CommandType::Disc);
        if self.shutting_down && !is_disconnect {
            return refuse(Errno::Shutdown);
        }
        let command = match self.session.validate(&header) {
            Ok(command) => command,
            Err(errno) => return refuse(errno),
        };
        let (kind, offset_bytes, length_bytes) = match command.command() {
            nbd::Command::Disconnect => {
                self.disconnected = true;
                return Decoded::Finish {
                    consumed_bytes: header_bytes,
                };
            }
            nbd::Command::Read {
                offset_bytes,
                length_bytes,
            } => (IoKind::Read, offset_bytes, length_bytes),
            nbd::Command::Write {
                offset_bytes,
                length_bytes,
                fua,
            } => (IoKind::Write { fua }, offset_bytes, length_bytes),
            nbd::Command::Flush => (IoKind::Flush, 0, 0),
            nbd::Command::Trim {
                offset_bytes,
                length_bytes,
                fua,
            } => (IoKind::Trim { fua, hint: true }, offset_bytes, length_bytes),
            nbd::Command::WriteZeroes {
                offset_bytes,
                length_bytes,
                fua,
                no_hole,
            } => (
                IoKind::WriteZeroes { fua, no_hole },
                offset_bytes,
                length_bytes,
            ),
        };
        Decoded::Request {
            header_bytes,
            payload_bytes,
            tag: Tag::Nbd(command),
            action: Action::Io(IoRequest {
                kind,
                namespace_index: self.binding.namespace_index,
                offset_bytes,
                length_bytes,
                tenant: self.binding.tenant,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn namespaces() -> NamespaceSet {
        let device = reflex_flash::spec::open("null:1M", Default::default())
            .unwrap_or_else(|e| panic!("{e}"));
        NamespaceSet::new(vec![(7, device, false)])
    }

    fn check(mut frontend: Frontend, input: &[u8], expected: Decoded) {
        assert_eq!(frontend.decode(input, &namespaces()), expected);
    }

    fn io(kind: IoKind, offset_bytes: u64, length_bytes: u32) -> Action {
        Action::Io(IoRequest {
            kind,
            namespace_index: 0,
            offset_bytes,
            length_bytes,
            tenant: TenantRef::NONE,
        })
    }

    #[test]
    fn native_requests() {
        let read = native::RequestHeader::read(5, 7, 4096, 4096).to_bytes();
        check(Frontend::Native, &read[..10], Decoded::NeedMore);
        check(
            Frontend::Native,
            &read,
            Decoded::Request {
                header_bytes: 32,
                payload_bytes: 0,
                tag: Tag::Native {
                    opcode_raw: 2,
                    request_id: 5,
                },
                action: io(IoKind::Read, 4096, 4096),
            },
        );
        let write = native::RequestHeader::write(6, 7, 1 << 20, 512, false).to_bytes();
        check(
            Frontend::Native,
            &write,
            Decoded::Request {
                header_bytes: 32,
                payload_bytes: 512,
                tag: Tag::Native {
                    opcode_raw: 3,
                    request_id: 6,
                },
                action: Action::Reply(Answer::Native(Status::OutOfRange)),
            },
        );
        let mut bad = read;
        bad[0] = b'X';
        assert!(matches!(
            Frontend::Native.decode(&bad, &namespaces()),
            Decoded::Close(_)
        ));
        let hello = native::RequestHeader::hello(9).to_bytes();
        check(Frontend::Native, &hello, Decoded::NeedMore);
        let mut with_body = hello.to_vec();
        with_body.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        check(
            Frontend::Native,
            &with_body,
            Decoded::Request {
                header_bytes: 48,
                payload_bytes: 0,
                tag: Tag::Native {
                    opcode_raw: 1,
                    request_id: 9,
                },
                action: Action::Hello { io_priority: 0 },
            },
        );
        // The client's ionice (best effort, level 7) travels with the HELLO.
        with_body[34] = 0x07;
        with_body[35] = 0x40;
        check(
            Frontend::Native,
            &with_body,
            Decoded::Request {
                header_bytes: 48,
                payload_bytes: 0,
                tag: Tag::Native {
                    opcode_raw: 1,
                    request_id: 9,
                },
                action: Action::Hello {
                    io_priority: (2 << 13) | 7,
                },
            },
        );
    }

    #[test]
    fn original_requests() {
        let mut frontend = Frontend::Original {
            namespace_index: 0,
            tenant: TenantRef::NONE,
        };
        let header = original::Header {
            opcode: original::Opcode::Write,
            handle: [1; 8],
            lba: 8,
            lba_count: 8,
        };
        let decoded = frontend.decode(&header.to_bytes(), &namespaces());
        assert!(matches!(
            decoded,
            Decoded::Request {
                payload_bytes: 4096,
                ..
            }
        ));
        let beyond = original::Header {
            lba: 1 << 20,
            ..header
        };
        assert!(matches!(
            frontend.decode(&beyond.to_bytes(), &namespaces()),
            Decoded::Close(_)
        ));
        let tag = Tag::Original { response: header };
        let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
        let failure = Answer::DeviceError { errno: libc::EIO };
        assert_eq!(frontend.encode_response(&tag, failure, 0, &mut out), None);
        assert_eq!(
            frontend.encode_response(&tag, Answer::Ok, 0, &mut out),
            Some(24)
        );
    }

    // ----- NBD -----------------------------------------------------------------------------

    const TENANT: TenantRef = TenantRef { handle: 7, id: 3 };

    fn nbd_frontend() -> Frontend {
        let exports = NbdExports::new(
            vec![
                (
                    nbd::Export::new("ns7", 1 << 20),
                    ExportBinding {
                        namespace_index: 0,
                        tenant: TENANT,
                    },
                ),
                (
                    nbd::Export::new("ro", 1 << 20).read_only(),
                    ExportBinding {
                        namespace_index: 0,
                        tenant: TenantRef::NONE,
                    },
                ),
            ],
            Some("ns7"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        Frontend::new(Protocol::Nbd, Some(&Arc::new(exports)))
    }

    fn option(code: u32, data: &[u8]) -> Vec<u8> {
        let mut bytes = nbd::IHAVEOPT.to_be_bytes().to_vec();
        bytes.extend_from_slice(&code.to_be_bytes());
        bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
        bytes.extend_from_slice(data);
        bytes
    }

    fn go(name: &str) -> Vec<u8> {
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        option(nbd::option::GO, &data)
    }

    fn request(
        command: nbd::CommandType,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
    ) -> Vec<u8> {
        nbd::RequestHeader {
            flags,
            command_raw: command.as_u16(),
            cookie,
            offset_bytes: offset,
            length_bytes: len,
        }
        .to_bytes()
        .to_vec()
    }

    /// Decodes `input` to the end, collecting output and returning the first request found.
    fn drive(frontend: &mut Frontend, mut input: &[u8], output: &mut Vec<u8>) -> Decoded {
        let namespaces = namespaces();
        loop {
            match frontend.decode(input, &namespaces) {
                Decoded::Consumed(count) => input = &input[count..],
                Decoded::Request {
                    action: Action::Output,
                    header_bytes: 0,
                    ..
                } => {
                    let mut run = vec![0u8; frontend.pending_output_bytes()];
                    assert!(!run.is_empty());
                    let written = frontend.write_output(&mut run);
                    assert_eq!(written, run.len());
                    output.extend_from_slice(&run);
                }
                other => return other,
            }
        }
    }

    fn client_start(name: &str, structured: bool) -> Vec<u8> {
        let mut input = nbd::client_flags::FIXED_NEWSTYLE.to_be_bytes().to_vec();
        if structured {
            input.extend_from_slice(&option(nbd::option::STRUCTURED_REPLY, &[]));
        }
        input.extend_from_slice(&go(name));
        input
    }

    #[test]
    fn nbd_handshake_then_pipelined_requests() {
        let mut frontend = nbd_frontend();
        let mut output = Vec::new();
        // Nothing received yet: the greeting goes out first.
        assert_eq!(drive(&mut frontend, &[], &mut output), Decoded::NeedMore);
        assert_eq!(output.len(), nbd::GREETING_SIZE);
        assert_eq!(output[..8], nbd::NBD_MAGIC.to_be_bytes());
        let mut input = client_start("", false);
        let read = request(nbd::CommandType::Read, 0, 42, 4096, 8192);
        input.extend_from_slice(&read);
        let before = output.len();
        let decoded = drive(&mut frontend, &input, &mut output);
        // INFO_EXPORT, INFO_BLOCK_SIZE, ACK: three option replies.
        assert!(output.len() > before + 3 * nbd::OPTION_REPLY_HEADER_SIZE);
        let Decoded::Request {
            header_bytes,
            payload_bytes,
            tag,
            action,
        } = decoded
        else {
            panic!("expected the pipelined READ, got {decoded:?}");
        };
        assert_eq!((header_bytes, payload_bytes), (nbd::REQUEST_HEADER_SIZE, 0));
        assert_eq!(
            action,
            Action::Io(IoRequest {
                kind: IoKind::Read,
                namespace_index: 0,
                offset_bytes: 4096,
                length_bytes: 8192,
                tenant: TENANT,
            })
        );
        let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
        let length = frontend.encode_response(&tag, Answer::Ok, 8192, &mut out);
        assert_eq!(length, Some(nbd::SIMPLE_REPLY_SIZE));
        assert_eq!(out[..4], nbd::SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(out[8..16], 42u64.to_be_bytes());
        // A device error becomes an NBD errno in a simple reply.
        let failure = Answer::DeviceError {
            errno: libc::ENOSPC,
        };
        assert_eq!(
            frontend.encode_response(&tag, failure, 0, &mut out),
            Some(16)
        );
        assert_eq!(out[4..8], (Errno::NoSpc as u32).to_be_bytes());
    }

    #[test]
    fn nbd_structured_reads_and_refusals() {
        let mut frontend = nbd_frontend();
        let mut output = Vec::new();
        let mut input = client_start("ro", true);
        let trim = request(nbd::CommandType::Trim, 0, 7, 0, 4096);
        input.extend_from_slice(&trim);
        let Decoded::Request {
            header_bytes,
            tag,
            action,
            ..
        } = drive(&mut frontend, &input, &mut output)
        else {
            panic!("expected a request");
        };
        assert_eq!(header_bytes, nbd::REQUEST_HEADER_SIZE);
        assert_eq!(tag, Tag::NbdRefused { cookie: 7 });
        assert_eq!(action, Action::Reply(Answer::Nbd(Errno::Perm)));
        let mut out = [0u8; RESPONSE_HEADER_SIZE_MAX];
        let length = frontend.encode_response(&tag, Answer::Nbd(Errno::Perm), 0, &mut out);
        assert_eq!(length, Some(nbd::CHUNK_HEADER_SIZE + 6));
        assert_eq!(out[..4], nbd::STRUCTURED_REPLY_MAGIC.to_be_bytes());

        let read = request(nbd::CommandType::Read, 0, 8, 512, 512);
        let Decoded::Request { tag, .. } = drive(&mut frontend, &read, &mut output) else {
            panic!("expected a request");
        };
        let length = frontend.encode_response(&tag, Answer::Ok, 512, &mut out);
        assert_eq!(length, Some(nbd::CHUNK_HEADER_SIZE + 8));
        assert_eq!(out[6..8], nbd::chunk::TYPE_OFFSET_DATA.to_be_bytes());
        assert_eq!(out[20..28], 512u64.to_be_bytes());

        // A WRITE refused (read-only) still declares its payload so the stream stays in step.
        let write = request(nbd::CommandType::Write, 0, 9, 0, 1024);
        let Decoded::Request { payload_bytes, .. } = drive(&mut frontend, &write, &mut output)
        else {
            panic!("expected a request");
        };
        assert_eq!(payload_bytes, 1024);

        // Shutdown: ESHUTDOWN for new requests, DISC still ends the session.
        assert!(frontend.begin_shutdown());
        let Decoded::Request { action, .. } = drive(&mut frontend, &read, &mut output) else {
            panic!("expected a request");
        };
        assert_eq!(action, Action::Reply(Answer::Nbd(Errno::Shutdown)));
        let disc = request(nbd::CommandType::Disc, 0, 10, 0, 0);
        assert_eq!(
            drive(&mut frontend, &disc, &mut output),
            Decoded::Finish {
                consumed_bytes: nbd::REQUEST_HEADER_SIZE
            }
        );
        assert_eq!(drive(&mut frontend, &read, &mut output), Decoded::NeedMore);
    }

    #[test]
    fn nbd_abort_and_broken_handshakes() {
        let mut frontend = nbd_frontend();
        let mut output = Vec::new();
        let mut input = nbd::client_flags::FIXED_NEWSTYLE.to_be_bytes().to_vec();
        input.extend_from_slice(&option(nbd::option::ABORT, &[]));
        assert_eq!(
            drive(&mut frontend, &input, &mut output),
            Decoded::Finish { consumed_bytes: 0 }
        );
        // Greeting, then the ACK to ABORT.
        assert_eq!(
            output.len(),
            nbd::GREETING_SIZE + nbd::OPTION_REPLY_HEADER_SIZE
        );
        assert!(!frontend.begin_shutdown());

        let mut frontend = nbd_frontend();
        let unknown_flags = 0x80u32.to_be_bytes();
        assert!(matches!(
            drive(&mut frontend, &unknown_flags, &mut output),
            Decoded::Close(_)
        ));
        let mut frontend = nbd_frontend();
        let mut input = client_start("ns7", false);
        input.extend_from_slice(b"not an NBD request, long enough to decode");
        assert!(matches!(
            drive(&mut frontend, &input, &mut output),
            Decoded::Close(_)
        ));
    }

    #[test]
    fn nbd_error_mapping() {
        let errno = |linux| Answer::DeviceError { errno: linux }.nbd_errno();
        assert_eq!(errno(libc::EIO), Errno::Io);
        assert_eq!(errno(libc::ENOSPC), Errno::NoSpc);
        assert_eq!(errno(libc::EDQUOT), Errno::NoSpc);
        assert_eq!(errno(libc::EROFS), Errno::Perm);
        assert_eq!(errno(libc::EINVAL), Errno::Inval);
        // Values the spec asks servers not to send here.
        for linux in [
            libc::ENOMEM,
            libc::EOVERFLOW,
            libc::EOPNOTSUPP,
            libc::ESHUTDOWN,
        ] {
            assert_eq!(errno(linux), Errno::Io, "errno {linux}");
        }
        assert_eq!(Answer::Unsupported.nbd_errno(), Errno::Io);
        assert_eq!(Answer::Nbd(Errno::Perm).nbd_errno(), Errno::Perm);
        assert_eq!(Answer::Unsupported.native_status(), Status::Invalid);
        assert_eq!(
            Answer::DeviceError { errno: libc::EIO }.native_status(),
            Status::IoError
        );
    }

    #[test]
    fn out_of_space_has_its_own_native_status() {
        let status = |linux| Answer::DeviceError { errno: linux }.native_status();
        assert_eq!(status(libc::ENOSPC), Status::NoSpace);
        assert_eq!(status(libc::EDQUOT), Status::NoSpace);
        assert_eq!(status(libc::EIO), Status::IoError);
        assert_eq!(status(libc::EROFS), Status::IoError);
    }
}
