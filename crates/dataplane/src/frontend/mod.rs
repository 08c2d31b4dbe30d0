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
//! NVMe/TCP (`nvme_tcp_frontend`, `nvme_tcp_admin`, `nvme_tcp_targets`) keeps the most
//! state: a controller per admin queue shared by its I/O queues across threads, commands
//! answered by the frontend itself (admin commands, R2Ts), commands answered once for several
//! requests (data in several PDUs, Dataset Management ranges), and responses with bytes after
//! their data (a read's data digest and response capsule: [`Frontend::encode_read_answer`]).
//!
//! The key-value port (`kv_frontend`, `docs/KV.md`) decodes the KV protocol into
//! [`IoKind::Kv`] requests on the table's namespace; what they do on the device is decided by
//! the table's step machines in `core/kv.rs`, not here.
//!
//! Tenants: an [`IoRequest`] carries the tenant the protocol chose for it (an NBD export's or
//! an original-protocol port's configured tenant), or [`TenantRef::NONE`]; the dataplane
//! resolves the rest (a native connection's BIND, the namespace's default tenant). Native
//! control requests (REGISTER, UNREGISTER, BIND, REPORT) arrive whole, body included, as
//! [`Action::Control`]: their bodies are small and are never received into the I/O arena.

use std::sync::Arc;

use reflex_flash::FlashError;
use reflex_proto::native::{self, Capabilities, RegisterBody, Status};
use reflex_proto::nbd::{self, Errno, Session};
use reflex_proto::original;

use crate::control::{ControlAnswer, ControlBody, REASON_BYTES_MAX, TenantRef};
use crate::namespaces::NamespaceSet;

/// Bytes of a RENEGOTIATE notice's body.
pub const NOTICE_BODY_BYTES: usize = native::RENEGOTIATE_BODY_SIZE;
/// Largest body of a control answer (a handle or a refusal reason).
pub const CONTROL_ANSWER_BYTES_MAX: usize = 4096;
/// The largest unit a front end waits for whole in the receive buffer (a native header with
/// the largest control body); the receive buffer holds at least two.
/// (NVMe/TCP waits for whole PDUs of up to this size: data it reads itself or checks against
/// a data digest.)
pub const UNIT_BYTES_MAX: usize = 8192;

const _: () = assert!(
    native::REQUEST_HEADER_SIZE + native::CONTROL_BODY_MAX_BYTES as usize <= UNIT_BYTES_MAX
);

/// Most extents one NBD BLOCK_STATUS answer reports (the client asks again from where they
/// end), so that its payload fits one page.
pub const BLOCK_STATUS_EXTENTS_MAX: usize = 511;
/// Bytes of the largest BLOCK_STATUS payload: the context id and the descriptors.
pub const BLOCK_STATUS_BODY_BYTES_MAX: usize =
    4 + nbd::BLOCK_DESCRIPTOR_SIZE * BLOCK_STATUS_EXTENTS_MAX;

const _: () = assert!(BLOCK_STATUS_BODY_BYTES_MAX <= crate::buffers::PAGE_SIZE);
const _: () = assert!(REASON_BYTES_MAX <= CONTROL_ANSWER_BYTES_MAX);
const _: () = assert!(NOTICE_BODY_BYTES <= CONTROL_ANSWER_BYTES_MAX);

mod kv_frontend;
pub use kv_frontend::writes as kv_writes;
mod native_frontend;
mod nbd_frontend;
mod nvme_tcp_admin;
mod nvme_tcp_events;
mod nvme_tcp_frontend;
pub mod nvme_tcp_targets;
mod nvme_tcp_tls;
mod original_frontend;
#[cfg(test)]
mod tests;

use nbd_frontend::NbdPhase;
pub use nbd_frontend::{ExportBinding, NbdExports, NbdFrontend};
pub use nvme_tcp_frontend::{NvmeTag, NvmeTcpFrontend, status_for as nvme_status_for};
pub use nvme_tcp_targets::NvmeTcpTargets;
pub use nvme_tcp_tls::NvmeTlsMode;

/// Room for the largest response header of any protocol.
pub const RESPONSE_HEADER_SIZE_MAX: usize = 32;
/// Room for the bytes after a response's body (NVMe/TCP: a read's data digest and its
/// response capsule with a header digest).
pub const RESPONSE_TRAILER_SIZE_MAX: usize = 32;

const _: () = assert!(native::RESPONSE_HEADER_SIZE <= RESPONSE_HEADER_SIZE_MAX);
const _: () = assert!(original::HEADER_SIZE <= RESPONSE_HEADER_SIZE_MAX);
// The largest NBD reply header: an OFFSET_DATA chunk header and its 8-byte offset.
const _: () = assert!(nbd::CHUNK_HEADER_SIZE + 8 <= RESPONSE_HEADER_SIZE_MAX);
const _: () = assert!(nbd::SIMPLE_REPLY_SIZE <= RESPONSE_HEADER_SIZE_MAX);
const _: () = assert!(reflex_proto::kv::RESPONSE_HEADER_SIZE <= RESPONSE_HEADER_SIZE_MAX);
// A KV request's header is waited for whole, like any unit.
const _: () = assert!(reflex_proto::kv::REQUEST_HEADER_SIZE <= UNIT_BYTES_MAX);
// A KV BIND is waited for whole, with its 8-byte key.
const _: () = assert!(
    reflex_proto::kv::REQUEST_HEADER_SIZE + reflex_proto::kv::BIND_KEY_SIZE_BYTES <= UNIT_BYTES_MAX
);

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
        /// The tenant's configured device queue (priority class); `None`: the default.
        device_queue: Option<u16>,
    },
    Nbd,
    NvmeTcp,
    /// The key-value protocol on the table of namespace `namespace_index`, charged to
    /// `tenant` (`NONE`: the namespace's).
    Kv {
        namespace_index: u16,
        tenant: TenantRef,
    },
}

/// The protocol of a connection, with its per-connection protocol state.
#[derive(Debug)]
pub enum Frontend {
    Native,
    Original {
        namespace_index: u16,
        tenant: TenantRef,
        device_queue: Option<u16>,
    },
    Nbd(NbdFrontend),
    /// Boxed: a connection slot stays small.
    NvmeTcp(Box<NvmeTcpFrontend>),
    Kv {
        namespace_index: u16,
        tenant: TenantRef,
    },
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
    NvmeTcp(NvmeTag),
    Kv {
        opcode_raw: u8,
        request_id: u64,
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
    /// cannot discard) write zeroes from a zeroed run. `fua` as for `Trim`. `fast` (NBD's
    /// FAST_ZERO): fail with ENOTSUP rather than write.
    WriteZeroes {
        fua: bool,
        no_hole: bool,
        fast: bool,
    },
    /// Report which extents of the range are allocated (NBD BLOCK_STATUS for
    /// `base:allocation`): a metadata query answered at once, no device I/O. `req_one`: one
    /// extent at most.
    BlockStatus {
        req_one: bool,
    },
    /// A key-value operation on the namespace's table (`core/kv.rs`); `length_bytes` is its
    /// payload, the key (`key_bytes`) then the value.
    Kv {
        opcode: reflex_proto::kv::Opcode,
        key_bytes: u8,
    },
}

/// One piece of a READ's data that a reply carries: a READ longer than a buffer run is sent in
/// pieces (NBD), each from `offset_bytes` in the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadPiece {
    pub offset_bytes: u64,
    pub length_bytes: u32,
    pub first: bool,
    pub last: bool,
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
    /// Answer at once with this and no body: validation failures, control opcodes not
    /// implemented yet, NBD requests during shutdown, NBD's advisory CACHE (success). The
    /// request's payload, if any, is skipped.
    Reply(Answer),
    /// Send the protocol output the frontend holds (NBD handshake replies): the dataplane
    /// takes a run of [`Frontend::pending_output_bytes`] (at most one maximal run), fills it
    /// with [`Frontend::write_output`] and sends it.
    Output,
    /// A native tenant request, body decoded (`docs/PROTOCOL.md` §1.9).
    Control(ControlRequest),
    /// A RENEGOTIATE notice the dataplane queued on the connection (never decoded).
    Notice,
    /// A KV BIND: charge the connection to tenant `handle` of the table's namespace (0: back
    /// to the port's tenant). Answered with a bare KV status.
    KvBind {
        handle: u64,
    },
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
    /// What a latency-critical tenant's client measured (advice for self-calibration).
    Report(native::ReportBody),
}

/// How a request ended, before any protocol shaped it into a status or an errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Ok,
    /// The connection's tenant may not do this (unbound from an unregistered tenant, a
    /// read-only grant, another namespace).
    Permission,
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
    /// The server is shutting down and gave up waiting for the request to be admitted
    /// (native BUSY, NBD ESHUTDOWN; the original protocol has no status and closes).
    ShuttingDown,
    /// A key-value answer other than `OK` (refused by validation, absent key, full table).
    Kv(reflex_proto::kv::Status),
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
            Answer::Permission => Status::Permission,
            Answer::Native(status) => status,
            Answer::ShuttingDown => Status::Busy,
            // Not produced for native requests; the nearest meaning.
            Answer::Nbd(_) | Answer::Unsupported | Answer::Kv(_) => Status::Invalid,
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
            Answer::ShuttingDown => Errno::Shutdown,
            // The tenant may not do this (unbound from an unregistered tenant, read-only).
            Answer::Permission | Answer::Native(Status::Permission) => Errno::Perm,
            Answer::Ok | Answer::Native(_) | Answer::Kv(_) => Errno::Inval,
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
    /// The client asked for TLS and its acknowledgement is queued (NBD's STARTTLS): once
    /// the answers before it have left, the stream continues in TLS.
    StartTls { consumed_bytes: usize },
    /// The peer ended the session cleanly (NBD `ABORT`, `DISC`, end of stream during the
    /// handshake): consume these bytes, read nothing more, answer what is outstanding, close.
    Finish { consumed_bytes: usize },
    /// Broken framing, or a request the protocol cannot refuse politely: close the connection.
    Close(String),
}

impl Frontend {
    /// The state of a new connection accepted on a `protocol` port. NBD needs the export
    /// table (the server passes it whenever it listens for NBD).
    pub fn new(
        protocol: Protocol,
        nbd_exports: Option<&Arc<NbdExports>>,
        nvme_tcp: Option<&Arc<NvmeTcpTargets>>,
    ) -> Frontend {
        match protocol {
            Protocol::Native => Frontend::Native,
            Protocol::Original {
                namespace_index,
                tenant,
                device_queue,
            } => Frontend::Original {
                namespace_index,
                tenant,
                device_queue,
            },
            Protocol::Nbd => {
                let Some(exports) = nbd_exports else {
                    panic!("an NBD listener without an export table");
                };
                Frontend::Nbd(NbdFrontend::new(Arc::clone(exports)))
            }
            Protocol::NvmeTcp => {
                let Some(targets) = nvme_tcp else {
                    panic!("an NVMe/TCP listener without its targets");
                };
                Frontend::NvmeTcp(Box::new(NvmeTcpFrontend::new(Arc::clone(targets))))
            }
            Protocol::Kv {
                namespace_index,
                tenant,
            } => Frontend::Kv {
                namespace_index,
                tenant,
            },
        }
    }

    /// The device queue (priority class) the configuration gives this connection's tenant:
    /// an original-protocol port's or an NBD export's; `None`: the connection's own.
    pub fn device_queue(&self) -> Option<u16> {
        match self {
            Frontend::Native => None,
            Frontend::Original { device_queue, .. } => *device_queue,
            Frontend::Nbd(nbd) => nbd.device_queue(),
            // NVMe/TCP hosts and KV clients have no configured priority class yet: the default
            // queue.
            Frontend::NvmeTcp(_) | Frontend::Kv { .. } => None,
        }
    }

    /// Looks at the unparsed bytes. `&mut self`: a protocol with per-connection state (NBD's
    /// handshake) advances it here.
    pub fn decode(&mut self, input: &[u8], namespaces: &NamespaceSet) -> Decoded {
        match self {
            Frontend::Native => native_frontend::decode(input, namespaces),
            Frontend::Original {
                namespace_index,
                tenant,
                ..
            } => original_frontend::decode(input, *namespace_index, *tenant, namespaces),
            Frontend::Nbd(nbd) => nbd.decode(input),
            Frontend::NvmeTcp(nvme) => {
                nvme.follow_namespaces(namespaces);
                nvme.decode(input)
            }
            Frontend::Kv {
                namespace_index,
                tenant,
            } => kv_frontend::decode(input, *namespace_index, *tenant),
        }
    }

    /// [`Self::encode_response`] with the bytes a protocol sends after the body (written
    /// into `trailer`): `Some((header, trailer))` lengths. A frontend may keep state here
    /// (NVMe/TCP counts the answered parts of a command), so it is called exactly once per
    /// answer.
    pub fn encode_answer(
        &mut self,
        tag: &Tag,
        answer: Answer,
        data_bytes: u32,
        out: &mut [u8; RESPONSE_HEADER_SIZE_MAX],
        trailer: &mut [u8; RESPONSE_TRAILER_SIZE_MAX],
    ) -> Option<(usize, usize)> {
        let _ = trailer;
        match (&mut *self, tag) {
            (Frontend::NvmeTcp(nvme), Tag::NvmeTcp(nvme_tag)) => nvme
                .encode_answer(nvme_tag, answer, out)
                .map(|length| (length, 0)),
            _ => self
                .encode_response(tag, answer, data_bytes, out)
                .map(|length| (length, 0)),
        }
    }

    /// [`Self::encode_read_piece`] with the piece's data (NVMe/TCP digests it) and the bytes
    /// after it (`trailer`): `Some((header, trailer))` lengths.
    pub fn encode_read_answer(
        &mut self,
        tag: &Tag,
        piece: ReadPiece,
        data: &[u8],
        out: &mut [u8; RESPONSE_HEADER_SIZE_MAX],
        trailer: &mut [u8; RESPONSE_TRAILER_SIZE_MAX],
    ) -> Option<(usize, usize)> {
        match (&mut *self, tag) {
            (Frontend::NvmeTcp(nvme), Tag::NvmeTcp(nvme_tag)) => {
                nvme.encode_read(nvme_tag, piece, data, out, trailer)
            }
            _ => self
                .encode_read_piece(tag, piece, out)
                .map(|length| (length, 0)),
        }
    }

    /// The protocol's own timers, checked at each housekeeping sweep: `Some(reason)` closes
    /// the connection (NVMe/TCP: keep-alive, an unanswered R2T, its controller gone).
    pub fn expired(&mut self, now: reflex_qos::Nanos) -> Option<&'static str> {
        match self {
            Frontend::NvmeTcp(nvme) => nvme.expired(now),
            _ => None,
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
                    let reply = match command.command() {
                        nbd::Command::BlockStatus { .. } => {
                            session.reply_block_status(&command, data_bytes)?
                        }
                        _ => session.reply_ok(&command)?,
                    };
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
            // Encoded by `encode_answer`, which keeps the NVMe/TCP frontend's state.
            Tag::NvmeTcp(_) => None,
            Tag::Kv {
                opcode_raw,
                request_id,
            } => put(&kv_frontend::response(
                opcode_raw, request_id, answer, data_bytes,
            )),
        }
    }

    /// The header before a piece of a READ's data: the whole answer's for a READ in one piece;
    /// for NBD pieces, an `OFFSET_DATA` chunk each (structured replies), or the simple reply
    /// before the first piece and nothing before the others. `None` when the protocol cannot
    /// split a READ (the caller closes the connection).
    pub fn encode_read_piece(
        &self,
        tag: &Tag,
        piece: ReadPiece,
        out: &mut [u8; RESPONSE_HEADER_SIZE_MAX],
    ) -> Option<usize> {
        if piece.first && piece.last {
            return self.encode_response(tag, Answer::Ok, piece.length_bytes, out);
        }
        let Tag::Nbd(command) = *tag else {
            return None;
        };
        let session = self.nbd_session()?;
        let reply = if session.structured_replies() {
            nbd::offset_data_chunk(
                command.cookie(),
                piece.offset_bytes,
                piece.length_bytes,
                piece.last,
            )
        } else if piece.first {
            nbd::ReplyBytes::from(
                nbd::SimpleReply {
                    error: 0,
                    cookie: command.cookie(),
                }
                .to_bytes(),
            )
        } else {
            return Some(0);
        };
        let bytes = reply.as_bytes();
        out[..bytes.len()].copy_from_slice(bytes);
        Some(bytes.len())
    }

    /// Writes an NBD BLOCK_STATUS payload for `extents` (at most
    /// [`BLOCK_STATUS_EXTENTS_MAX`]) into `out` (at least [`BLOCK_STATUS_BODY_BYTES_MAX`]);
    /// returns its length. Holes read as zeroes on every device, so a hole is `HOLE | ZERO`.
    pub fn write_block_status(&self, extents: &[reflex_flash::Extent], out: &mut [u8]) -> usize {
        let Some(context_id) = self
            .nbd_session()
            .and_then(|session| session.base_allocation_context())
        else {
            panic!("a block status answer without base:allocation (validation admits none)");
        };
        assert!(extents.len() <= BLOCK_STATUS_EXTENTS_MAX);
        let descriptors = extents.iter().map(|extent| {
            let flags = match extent.allocation {
                reflex_flash::Allocation::Data => 0,
                reflex_flash::Allocation::Hole => {
                    nbd::allocation_flags::HOLE | nbd::allocation_flags::ZERO
                }
            };
            // Extents never pass the request's length, a u32.
            (
                u32::try_from(extent.length_bytes).unwrap_or(u32::MAX),
                flags,
            )
        });
        match nbd::encode_block_status(context_id, descriptors, out) {
            Some(length) => length,
            None => panic!("block status extents that do not encode: {extents:?}"),
        }
    }

    /// Whether the pieces of a READ must go out with nothing between them (an NBD simple
    /// reply: one header, then all the data).
    pub fn read_pieces_exclusive(&self) -> bool {
        self.nbd_session()
            .is_some_and(|session| !session.structured_replies())
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

    /// Whether the connection is past its handshake: an NBD session in transmission. Native
    /// and original-protocol connections have no handshake: their first request counts.
    pub fn in_session(&self) -> bool {
        match self {
            Frontend::Nbd(NbdFrontend { phase, .. }) => matches!(phase, NbdPhase::Transmission(_)),
            Frontend::NvmeTcp(nvme) => nvme.in_session(),
            Frontend::Native | Frontend::Original { .. } | Frontend::Kv { .. } => false,
        }
    }

    /// Whether decoding the same bytes again gives the same request with no other effect (the
    /// dataplane may decode a small WRITE's header, wait for its payload, and decode it again).
    /// Not for NVMe/TCP: decoding a command advances the SQ head, and an H2CData PDU counts
    /// its data into its transfer (finding 12: the second decode found the transfer complete
    /// and ended the connection with a PDU sequence error).
    pub fn decode_is_repeatable(&self) -> bool {
        !matches!(self, Frontend::NvmeTcp(_))
    }

    /// Whether answers (responses with a tag) are no longer sent: an NVMe/TCP connection
    /// whose C2HTermReq is queued (the transport puts nothing after it; the host stops
    /// parsing there). The connection closes once its requests are done.
    pub fn answers_dropped(&self) -> bool {
        match self {
            Frontend::NvmeTcp(nvme) => nvme.terminated(),
            _ => false,
        }
    }

    /// Bytes of protocol output waiting for an [`Action::Output`] request.
    pub fn pending_output_bytes(&self) -> usize {
        match self {
            Frontend::Nbd(NbdFrontend {
                phase: NbdPhase::Handshake(handshake),
                ..
            }) => handshake.pending_output().len(),
            Frontend::NvmeTcp(nvme) => nvme.pending_output_bytes(),
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
            Frontend::NvmeTcp(nvme) => nvme.write_output(out),
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
            Frontend::NvmeTcp(nvme) => nvme.begin_shutdown(),
            Frontend::Native | Frontend::Original { .. } | Frontend::Kv { .. } => false,
        }
    }

    /// The tag of a RENEGOTIATE notice the dataplane sends unasked (native connections only).
    pub fn notice_tag() -> Tag {
        Tag::Native {
            opcode_raw: native::Opcode::Renegotiate.as_u8(),
            request_id: native::NOTICE_REQUEST_ID,
        }
    }

    /// Writes a RENEGOTIATE notice's body into `out` (at least [`NOTICE_BODY_BYTES`]);
    /// returns its length.
    pub fn write_notice(notice: &native::RenegotiateBody, out: &mut [u8]) -> usize {
        out[..NOTICE_BODY_BYTES].copy_from_slice(&notice.to_bytes());
        NOTICE_BODY_BYTES
    }

    /// Writes a control request's answer body (a handle or a refusal reason) into `out` (at
    /// least [`CONTROL_ANSWER_BYTES_MAX`]); returns the answer and the body's length.
    pub fn write_control_answer(answer: &ControlAnswer, out: &mut [u8]) -> (Answer, usize) {
        let length = match &answer.body {
            ControlBody::None => 0,
            ControlBody::Handle(handle) => {
                let bytes = native::encode_handle(*handle);
                out[..bytes.len()].copy_from_slice(&bytes);
                bytes.len()
            }
            ControlBody::Reason(reason) => {
                let bytes = reason.as_bytes();
                assert!(bytes.len() <= REASON_BYTES_MAX);
                out[..bytes.len()].copy_from_slice(bytes);
                bytes.len()
            }
        };
        let status = match answer.status {
            Status::Ok => Answer::Ok,
            status => Answer::Native(status),
        };
        (status, length)
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
