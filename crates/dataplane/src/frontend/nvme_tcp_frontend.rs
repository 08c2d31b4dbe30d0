//! One NVMe/TCP connection (one queue of a controller): ICReq/ICResp, Connect, then the
//! commands of an admin queue (`nvme_tcp_admin`) or an I/O queue, as dataplane requests.
//!
//! How NVMe/TCP maps onto the dataplane's request model (one request, one answer):
//! - An I/O command becomes an [`IoRequest`]: Read, Write, Flush and Write Zeroes one each,
//!   charged to the tenant the host NQN selected at Connect. A read is answered with a C2HData
//!   header before its data (sent from the run it was read into) and, after the data, the data
//!   digest and the CapsuleResp (or nothing, with C2HData's SUCCESS flag, when the host
//!   disabled SQ flow control).
//! - A write's data comes in the capsule (up to [`IN_CAPSULE_DATA_BYTES`]) or after an R2T
//!   (the R2T is the immediate answer of the capsule; each H2CData PDU then becomes a write
//!   request of its own, received straight into its run). A command whose data came in
//!   several PDUs, and a Dataset Management command's trims, are answered once: the parts'
//!   answers go to a [`Transfer`] slot, and the last one to finish carries the CapsuleResp
//!   (the others send nothing).
//! - With data digests on, a data PDU is checked whole in the receive buffer before the
//!   dataplane copies its data to the run (MAXH2CDATA is then [`MAXH2CDATA_DIGEST_BYTES`]);
//!   a wrong data digest fails the command with Transient Transport Error, as SPDK does.
//! - Admin and fabrics commands are answered by the frontend itself: a CapsuleResp, or an
//!   output (C2HData, data, CapsuleResp) the dataplane sends from a run.
//! - A fatal transport error (a malformed PDU, a wrong header digest, a PDU out of sequence)
//!   queues a C2HTermReq and closes the connection after it; errors of a command get the
//!   spec's status and the stream goes on.
//!
//! Timers: [`NvmeTcpFrontend::expired`] is called at every housekeeping sweep with `now`:
//! the admin queue's keep-alive timeout, an R2T the host never answers, and the controller
//! of an I/O queue gone with its admin queue.

use std::collections::VecDeque;
use std::sync::Arc;

use reflex_proto::native;
use reflex_proto::nbd::Errno;
use reflex_proto::nvme_tcp::command::{
    self, CATTR_DISABLE_SQ_FLOW_CONTROL, CNTLID_DYNAMIC, ConnectData, DSM_RANGE_SIZE, DsmRange,
    admin_opcode, connect_offset, fctype, io_opcode, sgl,
};
use reflex_proto::nvme_tcp::pdu::{
    self, DataHeader, DataSpan, Digests, FatalError, Framing, IcResp, Pdu, PduError, PduType,
    TERM_DATA_MAX, TERM_HLEN, flags,
};
use reflex_proto::nvme_tcp::{Command, Completion, Status};
use reflex_qos::Nanos;

use super::nvme_tcp_events::{NAMESPACE_ATTRIBUTE_NOTICES, NamespaceChanges};
use super::nvme_tcp_targets::{
    AttachRefused, COMMAND_DATA_BYTES_MAX, Controller, ControllerState, IN_CAPSULE_DATA_BYTES,
    MAXH2CDATA_BYTES, MAXH2CDATA_DIGEST_BYTES, NvmeTcpTargets, QueueRefused, TRANSFER_BYTES_MAX,
};
use super::nvme_tcp_tls::{Channel, FirstByte, connect_refusal, first_byte};
use super::{
    Action, Answer, Decoded, IoKind, IoRequest, RESPONSE_HEADER_SIZE_MAX,
    RESPONSE_TRAILER_SIZE_MAX, ReadPiece, Tag, UNIT_BYTES_MAX,
};
use crate::control::TenantRef;

/// The largest PDU the frontend waits for whole in the receive buffer (a PDU whose data it
/// reads itself or checks against its data digest).
pub const GATHERED_PDU_BYTES_MAX: usize = UNIT_BYTES_MAX;
/// In-capsule data an admin queue command may carry (Connect's 1024 bytes, Set Features).
pub const ADMIN_IN_CAPSULE_DATA_BYTES: u32 = COMMAND_DATA_BYTES_MAX;
/// Admin queue entries every host may ask for, whatever the I/O queue limit: the Linux and
/// SPDK initiators open a 32-entry admin queue before they can read CAP.MQES (a host posting
/// more commands than the connection window just waits: the window is back-pressure).
pub const ADMIN_QUEUE_ENTRIES_MIN: u16 = 32;
/// Asynchronous Event Requests an admin queue holds (AERL + 1).
pub const ASYNC_EVENTS_HELD_MAX: usize = 4;

const _: () = assert!(
    pdu::HEADER_BYTES_MAX + COMMAND_DATA_BYTES_MAX as usize + pdu::DIGEST_SIZE
        <= GATHERED_PDU_BYTES_MAX
);
const _: () = assert!(
    pdu::HEADER_BYTES_MAX + IN_CAPSULE_DATA_BYTES as usize + pdu::DIGEST_SIZE
        <= GATHERED_PDU_BYTES_MAX
);
const _: () = assert!(
    pdu::HEADER_BYTES_MAX + MAXH2CDATA_DIGEST_BYTES as usize + pdu::DIGEST_SIZE
        <= GATHERED_PDU_BYTES_MAX
);
// A read's trailer: its data digest, and a CapsuleResp with a header digest.
const _: () = assert!(
    pdu::DIGEST_SIZE + pdu::CAPSULE_RESP_HLEN + pdu::DIGEST_SIZE <= RESPONSE_TRAILER_SIZE_MAX
);
const _: () = assert!(pdu::CAPSULE_RESP_HLEN + pdu::DIGEST_SIZE <= RESPONSE_HEADER_SIZE_MAX);
const _: () = assert!(pdu::DATA_HLEN + pdu::DIGEST_SIZE <= RESPONSE_HEADER_SIZE_MAX);

/// What a response of an NVMe/TCP request carries, kept in its slot from decode to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvmeTag {
    /// A CapsuleResp with this status (answers the frontend decided itself).
    Completion {
        cid: u16,
        status: Status,
        dw0: u32,
        dw1: u32,
    },
    /// An I/O command answered by its request's outcome.
    Io { cid: u16, opcode: u8 },
    /// An R2T asking for a command's data.
    R2t { cid: u16, ttag: u16, length: u32 },
    /// One part of a command answered once for all its parts (`Transfer` `slot`).
    Part { slot: u16, generation: u16 },
}

#[derive(Debug)]
pub(super) enum Phase {
    /// Waiting for ICReq.
    AwaitIcReq,
    /// ICResp sent: only Connect is served.
    AwaitConnect,
    /// A connected queue.
    Queue(Box<Queue>),
}

#[derive(Debug)]
pub(super) struct Queue {
    pub(super) qid: u16,
    /// Entries of the submission queue (SQSIZE + 1).
    pub(super) entries: u16,
    /// SQ head pointer reported in completions (commands received, modulo `entries`).
    pub(super) head: u16,
    pub(super) flow_control: bool,
    pub(super) controller: Arc<Controller>,
    /// Per namespace of the subsystem: the tenant the host's I/O is charged to.
    pub(super) tenants: Vec<TenantRef>,
    /// The admin queue's own state (`None` on I/O queues).
    pub(super) admin: Option<Box<AdminState>>,
}

/// The controller state only the admin queue touches.
#[derive(Debug)]
pub(super) struct AdminState {
    pub(super) cc: u32,
    pub(super) csts: u32,
    /// Keep-alive timeout (`None`: off).
    pub(super) keep_alive: Option<Nanos>,
    /// A command arrived since the last sweep (keep-alive traffic).
    pub(super) alive_noted: bool,
    pub(super) alive_at: Option<Nanos>,
    pub(super) async_event_config: u32,
    /// Features without effect here, as last set (arbitration, power, error recovery), by
    /// feature id.
    pub(super) plain_features: [u32; 16],
    /// The composite sensor's over- and under-temperature thresholds (kelvin), as last set.
    pub(super) temperature_thresholds: [u16; 2],
    /// CIDs of Asynchronous Event Requests held until an event.
    pub(super) events_held: Vec<u16>,
    /// Namespaces that left (or joined) the active list, and their event.
    pub(super) namespace_changes: NamespaceChanges,
}

/// A command answered once for all its parts: its data transfer (R2T) and the device
/// requests it became.
#[derive(Debug)]
pub(super) struct Transfer {
    pub(super) cid: u16,
    pub(super) generation: u16,
    pub(super) kind: TransferKind,
    /// Data bytes the R2T asked for, and received so far.
    pub(super) length: u32,
    pub(super) received: u32,
    /// The R2T went out and not all its data has arrived: the R2T timer runs.
    pub(super) awaiting: bool,
    pub(super) r2t_sent: bool,
    pub(super) awaiting_since: Option<Nanos>,
    /// Parts handed to the dataplane and not answered yet.
    pub(super) outstanding: u32,
    /// Every part has been handed out.
    pub(super) complete: bool,
    /// The first failure of a part.
    pub(super) status: Status,
}

#[derive(Debug)]
pub(super) enum TransferKind {
    /// A write whose data arrives in H2CData PDUs.
    DeviceWrite { io: IoRequest },
    /// Data the frontend reads itself (Connect, Dataset Management ranges, Set Features).
    CommandData { command: Command, data: Vec<u8> },
    /// Dataset Management: its ranges' trims.
    Trims,
    /// The flushes of a shutdown notification (CC.SHN): the shutdown completes after them.
    ShutdownFlush,
}

/// A request the frontend makes itself, handed out before the next PDU is decoded.
#[derive(Debug, Clone, Copy)]
pub(super) struct Internal {
    pub(super) slot: u16,
    pub(super) generation: u16,
    pub(super) namespace_index: u16,
    pub(super) tenant: TenantRef,
    pub(super) kind: InternalKind,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum InternalKind {
    Flush,
    /// A trim of `[offset, end)`, handed out in pieces a request can carry.
    Trim {
        offset_bytes: u64,
        end_bytes: u64,
    },
}

/// One NVMe/TCP connection.
#[derive(Debug)]
pub struct NvmeTcpFrontend {
    pub(super) targets: Arc<NvmeTcpTargets>,
    pub(super) phase: Phase,
    /// Digests and the host's data alignment, for the PDUs this side sends.
    pub(super) framing: Framing,
    pub(super) maxh2cdata: u32,
    /// Protocol output waiting for an `Action::Output` request.
    pub(super) output: Vec<u8>,
    /// A fatal error was reported: close once the TermReq is out.
    pub(super) closing: Option<String>,
    /// Data digest bytes to consume after data the dataplane took.
    digest_skip: usize,
    internal: VecDeque<Internal>,
    pub(super) transfers: Vec<Option<Transfer>>,
    generation: u16,
    /// The server is shutting down: I/O is refused (namespace not ready).
    shutting_down: bool,
    /// Namespace slots removed at run time (hidden from Identify; their I/O is refused by
    /// the dataplane), as of namespace set generation `namespaces_seen`.
    pub(super) removed: Vec<u16>,
    namespaces_seen: u64,
    /// Plaintext or TLS, and the TLS identity (`nvme_tcp_tls.rs`).
    channel: Channel,
}

/// What handling a command leads to (before it becomes a [`Decoded`]).
pub(super) enum Outcome {
    /// A CapsuleResp.
    Complete {
        cid: u16,
        status: Status,
        dw0: u32,
        dw1: u32,
    },
    /// The frontend's output holds the answer (data and CapsuleResp).
    Output,
    /// Nothing to send now (an Asynchronous Event Request held; trims queued).
    Nothing,
}

impl Outcome {
    pub(super) fn status(cid: u16, status: Status) -> Outcome {
        Outcome::Complete {
            cid,
            status,
            dw0: 0,
            dw1: 0,
        }
    }

    pub(super) fn success(cid: u16, dw0: u32) -> Outcome {
        Outcome::Complete {
            cid,
            status: Status::SUCCESS,
            dw0,
            dw1: 0,
        }
    }
}

impl NvmeTcpFrontend {
    pub(super) fn new(targets: Arc<NvmeTcpTargets>) -> NvmeTcpFrontend {
        NvmeTcpFrontend {
            targets,
            phase: Phase::AwaitIcReq,
            framing: Framing::PLAIN,
            maxh2cdata: MAXH2CDATA_BYTES,
            output: Vec::new(),
            closing: None,
            digest_skip: 0,
            internal: VecDeque::new(),
            transfers: (0..2).map(|_| None).collect(),
            generation: 0,
            shutting_down: false,
            removed: Vec::new(),
            namespaces_seen: 0,
            channel: Channel::Undecided,
        }
    }

    /// The TLS handshake is done: `identity` is the PSK identity whose key the host proved.
    pub fn tls_established(&mut self, identity: Option<String>) {
        debug_assert!(matches!(self.channel, Channel::Tls { identity: None }));
        self.channel = Channel::Tls { identity };
    }

    /// Whether the connection started TLS and waits for its identity.
    pub fn awaits_tls_identity(&self) -> bool {
        matches!(self.channel, Channel::Tls { identity: None })
    }

    /// Notes which namespace slots are gone from `namespaces` (once per change of the set);
    /// on an admin queue, a namespace of its subsystem that left the active list since is a
    /// Namespace Attribute Changed event (`nvme_tcp_events.rs`), whose completion then
    /// waits in the output ([`Self::has_output`]).
    pub fn follow_namespaces(&mut self, namespaces: &crate::namespaces::NamespaceSet) {
        if namespaces.generation() == self.namespaces_seen {
            return;
        }
        self.namespaces_seen = namespaces.generation();
        let removed = (0..namespaces.len() as u16)
            .filter(|&index| !namespaces.is_live(index))
            .collect();
        let previous = std::mem::replace(&mut self.removed, removed);
        self.note_namespace_changes(&previous);
    }

    /// Records in the controller's changed namespace list every namespace of its subsystem
    /// whose state differs between `previous` and `self.removed`, and reports the event.
    fn note_namespace_changes(&mut self, previous: &[u16]) {
        let Phase::Queue(queue) = &mut self.phase else {
            return;
        };
        let Some(subsystem) = queue
            .controller
            .subsystem
            .and_then(|index| self.targets.subsystems.get(index))
        else {
            return;
        };
        let Some(admin) = queue.admin.as_deref_mut() else {
            return;
        };
        let notices_enabled = admin.async_event_config & NAMESPACE_ATTRIBUTE_NOTICES != 0;
        for namespace in &subsystem.namespaces {
            let index = namespace.namespace_index;
            if previous.contains(&index) != self.removed.contains(&index) {
                admin
                    .namespace_changes
                    .note(namespace.nsid, notices_enabled);
            }
        }
        self.report_async_event();
    }

    /// Completes a held Asynchronous Event Request with a pending event, if both exist: the
    /// completion waits in the output (sent before the next PDU is decoded).
    pub(super) fn report_async_event(&mut self) {
        let Phase::Queue(queue) = &mut self.phase else {
            return;
        };
        let Some(admin) = queue.admin.as_deref_mut() else {
            return;
        };
        if admin.events_held.is_empty() || self.closing.is_some() {
            return;
        }
        let Some(dw0) = admin.namespace_changes.poll_event() else {
            return;
        };
        // The oldest request carries the event.
        let cid = admin.events_held.remove(0);
        self.output_data(cid, &[], Status::SUCCESS, dw0);
    }

    /// Whether output waits to be sent (an event's completion the host did not ask for
    /// with a command it just sent): the dataplane hands it an output request.
    pub fn has_output(&self) -> bool {
        !self.output.is_empty() && self.closing.is_none()
    }

    /// A connected I/O queue: its state (the queue, the `Arc` of its controller in the table
    /// every thread shares, its tenants) means the same on any thread, so it may move (thread
    /// scaling; over TLS once the identity is known, the session moving with the
    /// connection's link). Not an admin queue (it holds Asynchronous Event Requests
    /// unanswered for as long as the controller lives, and the keep-alive timer), not a
    /// queue still connecting.
    pub fn is_movable_io_queue(&self) -> bool {
        matches!(&self.phase, Phase::Queue(queue) if queue.admin.is_none())
            && match &self.channel {
                Channel::Plain => true,
                Channel::Tls { identity } => identity.is_some(),
                Channel::Undecided => false,
            }
    }

    /// Nothing half-done in the protocol: no output waiting, no data transfer open, no
    /// digest to skip, no internal request queued, not terminating.
    pub fn is_between_commands(&self) -> bool {
        self.output.is_empty()
            && self.closing.is_none()
            && self.digest_skip == 0
            && self.internal.is_empty()
            && self.transfers.iter().all(Option::is_none)
    }

    pub(super) fn in_session(&self) -> bool {
        matches!(self.phase, Phase::Queue(_))
    }

    /// A fatal error's C2HTermReq has been handed to the dataplane (its output request took
    /// it): nothing may follow it on the wire, so answers finished from now on are dropped.
    pub(super) fn terminated(&self) -> bool {
        self.closing.is_some() && self.output.is_empty()
    }

    pub(super) fn begin_shutdown(&mut self) -> bool {
        self.shutting_down = true;
        false
    }

    fn digests(&self) -> Digests {
        match self.phase {
            Phase::AwaitIcReq => Digests::NONE,
            _ => self.framing.digests,
        }
    }

    /// Looks at the unparsed bytes (see the module doc).
    pub(super) fn decode(&mut self, input: &[u8]) -> Decoded {
        if !self.output.is_empty() {
            return output_request(0);
        }
        if let Some(reason) = &self.closing {
            return Decoded::Close(reason.clone());
        }
        if self.digest_skip > 0 {
            if input.len() < self.digest_skip {
                return Decoded::NeedMore;
            }
            return Decoded::Consumed(std::mem::take(&mut self.digest_skip));
        }
        if let Some(request) = self.next_internal() {
            return request;
        }
        if self.channel == Channel::Undecided {
            match first_byte(input, self.targets.options.tls_mode) {
                FirstByte::NeedMore => return Decoded::NeedMore,
                FirstByte::Plain => self.channel = Channel::Plain,
                FirstByte::StartTls => {
                    self.channel = Channel::Tls { identity: None };
                    return Decoded::StartTls { consumed_bytes: 0 };
                }
                FirstByte::Refuse(reason) => {
                    tracing::info!(reason, "NVMe/TCP: connection refused");
                    return Decoded::Close(reason.to_string());
                }
            }
        }
        let decoded = match pdu::decode_header(input, self.digests()) {
            Ok(None) => return Decoded::NeedMore,
            Ok(Some(decoded)) => decoded,
            Err(error) => return self.fatal(error, input),
        };
        match (&self.phase, decoded.pdu) {
            (Phase::AwaitIcReq, Pdu::IcReq(request)) => self.ic_req(request, input),
            (Phase::AwaitIcReq, _) | (_, Pdu::IcReq(_)) => self.fatal(
                PduError::new(FatalError::PduSequence, 0, "ICReq must come first, once"),
                input,
            ),
            (_, Pdu::H2cTermReq(term)) => {
                tracing::debug!(fes = term.fes, fei = term.fei, "NVMe/TCP host terminated");
                Decoded::Finish {
                    consumed_bytes: decoded.total_bytes.min(input.len()),
                }
            }
            (_, Pdu::CapsuleCmd(entry)) => self.capsule(Command(entry), &decoded, input),
            (_, Pdu::H2cData(header)) => self.h2c_data(header, &decoded, input),
            _ => self.fatal(
                PduError::new(
                    FatalError::InvalidHeaderField,
                    0,
                    "a PDU only a controller sends",
                ),
                input,
            ),
        }
    }

    /// Reports a fatal transport error: a C2HTermReq, then the connection closes.
    fn fatal(&mut self, error: PduError, input: &[u8]) -> Decoded {
        tracing::info!(%error, "NVMe/TCP: fatal transport error, terminating the connection");
        let offending = &input[..input.len().min(TERM_DATA_MAX)];
        let mut term = [0u8; TERM_HLEN + TERM_DATA_MAX];
        let length = pdu::encode_term_req(true, &error, offending, &mut term);
        self.output.clear();
        self.output.extend_from_slice(&term[..length]);
        self.closing = Some(format!("NVMe/TCP: {error}"));
        output_request(0)
    }

    fn ic_req(&mut self, request: pdu::IcReq, input: &[u8]) -> Decoded {
        let unsupported =
            |offset: usize, reason| PduError::new(FatalError::UnsupportedParameter, offset, reason);
        if request.pfv != 0 {
            return self.fatal(unsupported(8, "PDU format version not 0"), input);
        }
        let framing = match Framing::new(request.digests, request.hpda) {
            Some(framing) if framing.data_offset(PduType::C2hData) <= RESPONSE_HEADER_SIZE_MAX => {
                framing
            }
            _ => return self.fatal(unsupported(10, "HPDA above what reflexd pads"), input),
        };
        self.framing = framing;
        self.maxh2cdata = if request.digests.data {
            MAXH2CDATA_DIGEST_BYTES
        } else {
            MAXH2CDATA_BYTES
        };
        let response = IcResp {
            pfv: 0,
            cpda: 0,
            digests: request.digests,
            maxh2cdata: self.maxh2cdata,
        };
        self.output
            .extend_from_slice(&pdu::encode_ic_resp(&response));
        self.phase = Phase::AwaitConnect;
        output_request(pdu::IC_PDU_SIZE)
    }

    /// The in-capsule data limit of this queue.
    fn in_capsule_limit(&self) -> u32 {
        match &self.phase {
            Phase::Queue(queue) if queue.admin.is_none() => IN_CAPSULE_DATA_BYTES,
            _ => ADMIN_IN_CAPSULE_DATA_BYTES,
        }
    }

    fn capsule(&mut self, command: Command, decoded: &pdu::Decoded, input: &[u8]) -> Decoded {
        let header_bytes = decoded.header_bytes;
        let skip = (decoded.total_bytes - header_bytes) as u64;
        if let Phase::Queue(queue) = &mut self.phase {
            queue.head = (queue.head + 1) % queue.entries;
        }
        let cid = command.cid();
        if let Some(span) = decoded.data {
            let descriptor = command.sgl();
            let limit = self.in_capsule_limit();
            if span.length > limit
                || descriptor.identifier != sgl::DATA_BLOCK_OFFSET
                || descriptor.address != 0
                || descriptor.length != span.length
            {
                return self.respond(
                    Outcome::status(cid, Status::SGL_DATA_LENGTH_INVALID),
                    header_bytes,
                    skip,
                );
            }
        }
        let outcome = match &self.phase {
            Phase::AwaitConnect => {
                if command.opcode() == admin_opcode::FABRICS && command.fctype() == fctype::CONNECT
                {
                    return self.with_command_data(command, decoded, input);
                }
                Outcome::status(cid, Status::COMMAND_SEQUENCE_ERROR)
            }
            Phase::Queue(queue) if queue.admin.is_some() => {
                return self.admin_capsule(command, decoded, input);
            }
            Phase::Queue(_) => return self.io_capsule(command, decoded, input),
            Phase::AwaitIcReq => unreachable!("decode handles ICReq first"),
        };
        self.respond(outcome, header_bytes, skip)
    }

    /// Turns an outcome into the dataplane's answer, consuming `header_bytes` now and
    /// skipping `skip` bytes of payload after them.
    pub(super) fn respond(&mut self, outcome: Outcome, header_bytes: usize, skip: u64) -> Decoded {
        match outcome {
            Outcome::Complete {
                cid,
                status,
                dw0,
                dw1,
            } => Decoded::Request {
                header_bytes,
                payload_bytes: skip,
                tag: Tag::NvmeTcp(NvmeTag::Completion {
                    cid,
                    status,
                    dw0,
                    dw1,
                }),
                action: Action::Reply(Answer::Ok),
            },
            Outcome::Output => Decoded::Request {
                header_bytes,
                payload_bytes: skip,
                tag: Tag::None,
                action: Action::Output,
            },
            Outcome::Nothing if skip == 0 && header_bytes > 0 => Decoded::Consumed(header_bytes),
            Outcome::Nothing if skip == 0 => {
                // Nothing consumed and nothing to answer: look again (queued work).
                self.next_internal().unwrap_or(Decoded::NeedMore)
            }
            Outcome::Nothing => {
                // Only commands without data are held; anything else is answered.
                Decoded::Consumed(header_bytes + skip as usize)
            }
        }
    }

    /// Runs a command whose data the frontend reads itself: at once when the data is in the
    /// capsule (waiting for the whole PDU), or after an R2T.
    pub(super) fn with_command_data(
        &mut self,
        command: Command,
        decoded: &pdu::Decoded,
        input: &[u8],
    ) -> Decoded {
        let cid = command.cid();
        let header_bytes = decoded.header_bytes;
        let descriptor = command.sgl();
        if let Some(span) = decoded.data {
            match self.gathered_data(span, decoded.total_bytes, input) {
                Gathered::NeedMore => Decoded::NeedMore,
                Gathered::BadDigest => self.respond(
                    Outcome::status(cid, Status::TRANSIENT_TRANSPORT_ERROR),
                    decoded.total_bytes,
                    0,
                ),
                Gathered::Data(data) => {
                    let data = data.to_vec();
                    let outcome = self.execute_with_data(command, &data);
                    self.respond(outcome, decoded.total_bytes, 0)
                }
            }
        } else if descriptor.length == 0 {
            let outcome = self.execute_with_data(command, &[]);
            self.respond(outcome, header_bytes, 0)
        } else if descriptor.identifier != sgl::TRANSPORT_DATA_BLOCK {
            self.respond(
                Outcome::status(cid, Status::SGL_TYPE_INVALID),
                header_bytes,
                0,
            )
        } else if descriptor.length > COMMAND_DATA_BYTES_MAX {
            self.respond(
                Outcome::status(cid, Status::SGL_DATA_LENGTH_INVALID),
                header_bytes,
                0,
            )
        } else {
            let length = descriptor.length;
            let kind = TransferKind::CommandData {
                command,
                data: Vec::with_capacity(length as usize),
            };
            self.request_data(cid, kind, length, header_bytes)
        }
    }

    /// Takes a transfer slot for a command whose data comes by R2T and answers the capsule
    /// with the R2T.
    fn request_data(
        &mut self,
        cid: u16,
        kind: TransferKind,
        length: u32,
        header_bytes: usize,
    ) -> Decoded {
        let Some((slot, generation)) = self.take_slot(cid, kind, length) else {
            // More commands than the queue's entries: the host broke SQ flow control.
            return self.respond(
                Outcome::status(cid, Status::COMMAND_SEQUENCE_ERROR),
                header_bytes,
                0,
            );
        };
        let _ = generation;
        Decoded::Request {
            header_bytes,
            payload_bytes: 0,
            tag: Tag::NvmeTcp(NvmeTag::R2t {
                cid,
                ttag: slot,
                length,
            }),
            action: Action::Reply(Answer::Ok),
        }
    }

    fn take_slot(&mut self, cid: u16, kind: TransferKind, length: u32) -> Option<(u16, u16)> {
        let slot = self.transfers.iter().position(Option::is_none)?;
        self.generation = self.generation.wrapping_add(1);
        let awaiting = length > 0;
        self.transfers[slot] = Some(Transfer {
            cid,
            generation: self.generation,
            kind,
            length,
            received: 0,
            awaiting,
            r2t_sent: false,
            awaiting_since: None,
            outstanding: 0,
            complete: !awaiting,
            status: Status::SUCCESS,
        });
        Some((slot as u16, self.generation))
    }

    /// The data of a PDU the frontend reads whole: waits until all of it (and its digest) is
    /// in `input`, then checks the digest.
    fn gathered_data<'a>(&self, span: DataSpan, total: usize, input: &'a [u8]) -> Gathered<'a> {
        if total > GATHERED_PDU_BYTES_MAX {
            // Sizes are checked before this; a larger PDU cannot be gathered.
            return Gathered::BadDigest;
        }
        if input.len() < total {
            return Gathered::NeedMore;
        }
        let data = &input[span.offset..span.offset + span.length as usize];
        if span.digest {
            let at = span.offset + span.length as usize;
            let mut stored = [0u8; pdu::DIGEST_SIZE];
            stored.copy_from_slice(&input[at..at + pdu::DIGEST_SIZE]);
            if pdu::crc32c(data) != u32::from_le_bytes(stored) {
                tracing::info!("NVMe/TCP: data digest mismatch");
                return Gathered::BadDigest;
            }
        }
        Gathered::Data(data)
    }

    /// Runs a command with its data: Connect, Dataset Management, Set Features.
    fn execute_with_data(&mut self, command: Command, data: &[u8]) -> Outcome {
        match &self.phase {
            Phase::AwaitConnect => self.connect(command, data),
            Phase::Queue(queue) if queue.admin.is_some() => self.admin_with_data(command, data),
            Phase::Queue(_) => match command.opcode() {
                io_opcode::DATASET_MANAGEMENT => self.dataset_management(command, data),
                _ => Outcome::status(command.cid(), Status::INVALID_OPCODE),
            },
            Phase::AwaitIcReq => Outcome::status(command.cid(), Status::COMMAND_SEQUENCE_ERROR),
        }
    }

    /// Fabrics Connect: the admin queue attaches a controller, an I/O queue joins one.
    fn connect(&mut self, command: Command, data: &[u8]) -> Outcome {
        let cid = command.cid();
        let connect = command.connect();
        let invalid = |attribute_in_data: bool, offset: u16| Outcome::Complete {
            cid,
            status: Status::CONNECT_INVALID_PARAMETERS,
            dw0: u32::from(offset) | (u32::from(attribute_in_data) << 16),
            dw1: 0,
        };
        if connect.recfmt != 0 {
            return Outcome::status(cid, Status::CONNECT_INCOMPATIBLE_FORMAT);
        }
        let connect_data = match ConnectData::decode(data) {
            Ok(connect_data) => connect_data,
            Err(command::ConnectDataError::Nqn(offset)) => return invalid(true, offset),
            Err(command::ConnectDataError::Length(_)) => {
                return Outcome::status(cid, Status::SGL_DATA_LENGTH_INVALID);
            }
        };
        let entries = u32::from(connect.sqsize) + 1;
        let entries_max = if connect.qid == 0 {
            self.targets
                .options
                .queue_entries_max
                .max(ADMIN_QUEUE_ENTRIES_MIN)
        } else {
            self.targets.options.queue_entries_max
        };
        if !(2..=u32::from(entries_max)).contains(&entries) {
            return invalid(false, 44);
        }
        let subsystem = match self.targets.subsystem_by_nqn(&connect_data.subsystem_nqn) {
            Ok(subsystem) => subsystem,
            Err(_) => return invalid(true, connect_offset::SUBNQN),
        };
        if let Some(reason) = connect_refusal(
            &self.channel,
            &self.targets,
            &connect_data.host_nqn,
            &connect_data.subsystem_nqn,
            subsystem,
        ) {
            tracing::info!(host = %connect_data.host_nqn, subsystem = %connect_data.subsystem_nqn,
                reason, "NVMe/TCP: Connect refused on this channel");
            return Outcome::status(cid, Status::CONNECT_INVALID_HOST);
        }
        let (controller, admin) = if connect.qid == 0 {
            if connect_data.cntlid != CNTLID_DYNAMIC {
                return invalid(true, connect_offset::CNTLID);
            }
            let controller =
                match self
                    .targets
                    .attach(subsystem, &connect_data.host_nqn, connect_data.host_id)
                {
                    Ok(controller) => controller,
                    Err(AttachRefused::HostNotAllowed) => {
                        tracing::info!(host = %connect_data.host_nqn,
                        subsystem = %connect_data.subsystem_nqn, "NVMe/TCP: host not allowed");
                        return Outcome::status(cid, Status::CONNECT_INVALID_HOST);
                    }
                    Err(AttachRefused::Busy) => {
                        return Outcome::status(cid, Status::CONNECT_CONTROLLER_BUSY);
                    }
                    Err(AttachRefused::UnknownSubsystem) => {
                        return invalid(true, connect_offset::SUBNQN);
                    }
                };
            let keep_alive = (connect.kato_ms > 0).then(|| {
                Nanos(u64::from(connect.kato_ms) * 1_000_000)
                    .max(self.targets.options.keep_alive_timeout_min)
            });
            let admin = AdminState {
                cc: 0,
                csts: 0,
                keep_alive,
                alive_noted: true,
                alive_at: None,
                async_event_config: 0,
                plain_features: [0; 16],
                temperature_thresholds: [
                    reflex_proto::nvme_tcp::admin::WARNING_TEMPERATURE_KELVIN,
                    0,
                ],
                events_held: Vec::new(),
                namespace_changes: NamespaceChanges::default(),
            };
            (controller, Some(Box::new(admin)))
        } else {
            if subsystem.is_none() {
                return invalid(false, 42);
            }
            let Some(controller) =
                self.targets
                    .find(connect_data.cntlid, subsystem, &connect_data.host_nqn)
            else {
                tracing::info!(cntlid = connect_data.cntlid, host = %connect_data.host_nqn,
                    "NVMe/TCP: I/O queue Connect for no live controller of this host");
                return invalid(true, connect_offset::CNTLID);
            };
            match controller.connect_io_queue(connect.qid) {
                Ok(()) => {}
                Err(QueueRefused::InvalidQueue) => return invalid(false, 42),
                Err(QueueRefused::NotReady) => {
                    return Outcome::status(cid, Status::COMMAND_SEQUENCE_ERROR);
                }
            }
            (controller, None)
        };
        let tenants = subsystem
            .and_then(|index| self.targets.subsystems.get(index))
            .and_then(|found| found.tenants_for(&connect_data.host_nqn))
            .unwrap_or_default();
        let cntlid = controller.cntlid;
        tracing::debug!(cntlid, qid = connect.qid, host = %connect_data.host_nqn,
            subsystem = %connect_data.subsystem_nqn, "NVMe/TCP: queue connected");
        self.transfers = (0..usize::from(entries as u16) + 1).map(|_| None).collect();
        self.phase = Phase::Queue(Box::new(Queue {
            qid: connect.qid,
            entries: entries as u16,
            head: 1,
            flow_control: connect.cattr & CATTR_DISABLE_SQ_FLOW_CONTROL == 0,
            controller,
            tenants,
            admin,
        }));
        Outcome::success(cid, u32::from(cntlid))
    }

    /// The controller state that gates I/O: `Some(status)` refuses it.
    fn io_refusal(&self, queue: &Queue) -> Option<Status> {
        if self.shutting_down {
            return Some(Status::NAMESPACE_NOT_READY);
        }
        match queue.controller.state() {
            ControllerState::Ready => None,
            ControllerState::Disabled => Some(Status::COMMAND_SEQUENCE_ERROR),
            ControllerState::ShuttingDown | ControllerState::Gone => {
                Some(Status::NAMESPACE_NOT_READY)
            }
        }
    }

    fn io_capsule(&mut self, command: Command, decoded: &pdu::Decoded, input: &[u8]) -> Decoded {
        let cid = command.cid();
        let header_bytes = decoded.header_bytes;
        let skip = (decoded.total_bytes - header_bytes) as u64;
        let refuse = |this: &mut Self, status: Status| {
            this.respond(Outcome::status(cid, status), header_bytes, skip)
        };
        let Phase::Queue(queue) = &self.phase else {
            unreachable!("io_capsule on a connected queue");
        };
        let opcode = command.opcode();
        if opcode == io_opcode::FABRICS {
            let status = match command.fctype() {
                fctype::CONNECT => Status::COMMAND_SEQUENCE_ERROR,
                _ => Status::INVALID_OPCODE,
            };
            return refuse(self, status);
        }
        if !matches!(
            opcode,
            io_opcode::READ
                | io_opcode::WRITE
                | io_opcode::FLUSH
                | io_opcode::WRITE_ZEROES
                | io_opcode::DATASET_MANAGEMENT
        ) {
            return refuse(self, Status::INVALID_OPCODE);
        }
        if let Some(status) = self.io_refusal(queue) {
            return refuse(self, status);
        }
        let subsystem_index = queue.controller.subsystem;
        let Some((position, namespace)) = subsystem_index
            .and_then(|index| self.targets.subsystems.get(index))
            .and_then(|subsystem| subsystem.namespace(command.nsid()))
        else {
            return refuse(self, Status::INVALID_NAMESPACE);
        };
        let namespace = *namespace;
        let tenant = queue
            .tenants
            .get(position)
            .copied()
            .unwrap_or(TenantRef::NONE);
        let block_bytes = u64::from(namespace.block_size);
        let size_blocks = namespace.size_bytes / block_bytes;
        let writes = matches!(
            opcode,
            io_opcode::WRITE | io_opcode::WRITE_ZEROES | io_opcode::DATASET_MANAGEMENT
        );
        if writes && namespace.read_only {
            return refuse(self, Status::NAMESPACE_WRITE_PROTECTED);
        }
        let io = |kind: IoKind, offset_bytes: u64, length_bytes: u32| IoRequest {
            kind,
            namespace_index: namespace.namespace_index,
            offset_bytes,
            length_bytes,
            tenant,
        };
        let io_tag = Tag::NvmeTcp(NvmeTag::Io { cid, opcode });
        match opcode {
            io_opcode::FLUSH => Decoded::Request {
                header_bytes,
                payload_bytes: skip,
                tag: io_tag,
                action: Action::Io(io(IoKind::Flush, 0, 0)),
            },
            io_opcode::DATASET_MANAGEMENT => {
                let deallocate = command.cdw11() & (1 << 2) != 0;
                if !deallocate {
                    // Only hints (integral read or write): nothing to do.
                    return self.respond(Outcome::status(cid, Status::SUCCESS), header_bytes, skip);
                }
                let ranges = (command.cdw10() & 0xFF) as usize + 1;
                let descriptor = command.sgl();
                let needed = (ranges * DSM_RANGE_SIZE) as u32;
                let length = decoded.data.map_or(descriptor.length, |span| span.length);
                if length < needed {
                    return refuse(self, Status::SGL_DATA_LENGTH_INVALID);
                }
                self.with_command_data(command, decoded, input)
            }
            _ => {
                let blocks = u64::from(command.block_count());
                let in_range = command
                    .slba()
                    .checked_add(blocks)
                    .is_some_and(|end| end <= size_blocks);
                let length = blocks * block_bytes;
                let offset_bytes = command.slba().wrapping_mul(block_bytes);
                if opcode == io_opcode::WRITE_ZEROES {
                    if !in_range {
                        return refuse(self, Status::LBA_OUT_OF_RANGE);
                    }
                    let kind = IoKind::WriteZeroes {
                        fua: command.fua(),
                        no_hole: !command.deallocate(),
                        fast: false,
                    };
                    return Decoded::Request {
                        header_bytes,
                        payload_bytes: skip,
                        tag: io_tag,
                        action: Action::Io(io(kind, offset_bytes, length as u32)),
                    };
                }
                if length > u64::from(TRANSFER_BYTES_MAX) {
                    return refuse(self, Status::INVALID_FIELD);
                }
                if !in_range {
                    return refuse(self, Status::LBA_OUT_OF_RANGE);
                }
                let length = length as u32;
                let descriptor = command.sgl();
                if opcode == io_opcode::READ {
                    if descriptor.identifier != sgl::TRANSPORT_DATA_BLOCK || decoded.data.is_some()
                    {
                        return refuse(self, Status::SGL_TYPE_INVALID);
                    }
                    if descriptor.length != length {
                        return refuse(self, Status::SGL_DATA_LENGTH_INVALID);
                    }
                    return Decoded::Request {
                        header_bytes,
                        payload_bytes: 0,
                        tag: io_tag,
                        action: Action::Io(io(IoKind::Read, offset_bytes, length)),
                    };
                }
                let write = io(IoKind::Write { fua: command.fua() }, offset_bytes, length);
                if descriptor.length != length {
                    return refuse(self, Status::SGL_DATA_LENGTH_INVALID);
                }
                match decoded.data {
                    Some(span) => self.in_capsule_write(cid, write, span, decoded, input),
                    None if descriptor.identifier == sgl::TRANSPORT_DATA_BLOCK => self
                        .request_data(
                            cid,
                            TransferKind::DeviceWrite { io: write },
                            length,
                            header_bytes,
                        ),
                    None => refuse(self, Status::SGL_TYPE_INVALID),
                }
            }
        }
    }

    /// A write whose data is in the capsule: received into the run by the dataplane (after
    /// the digest check, with data digests on).
    fn in_capsule_write(
        &mut self,
        cid: u16,
        write: IoRequest,
        span: DataSpan,
        decoded: &pdu::Decoded,
        input: &[u8],
    ) -> Decoded {
        let tag = Tag::NvmeTcp(NvmeTag::Io {
            cid,
            opcode: io_opcode::WRITE,
        });
        if span.digest {
            match self.gathered_data(span, decoded.total_bytes, input) {
                Gathered::NeedMore => return Decoded::NeedMore,
                Gathered::BadDigest => {
                    return self.respond(
                        Outcome::status(cid, Status::TRANSIENT_TRANSPORT_ERROR),
                        decoded.total_bytes,
                        0,
                    );
                }
                Gathered::Data(_) => self.digest_skip = pdu::DIGEST_SIZE,
            }
        }
        Decoded::Request {
            header_bytes: span.offset,
            payload_bytes: u64::from(span.length),
            tag,
            action: Action::Io(write),
        }
    }

    /// Dataset Management with its ranges: each range's trim, answered once.
    fn dataset_management(&mut self, command: Command, data: &[u8]) -> Outcome {
        let cid = command.cid();
        let Phase::Queue(queue) = &self.phase else {
            return Outcome::status(cid, Status::COMMAND_SEQUENCE_ERROR);
        };
        let Some((position, namespace)) = queue
            .controller
            .subsystem
            .and_then(|index| self.targets.subsystems.get(index))
            .and_then(|subsystem| subsystem.namespace(command.nsid()))
        else {
            return Outcome::status(cid, Status::INVALID_NAMESPACE);
        };
        let namespace = *namespace;
        let tenant = queue
            .tenants
            .get(position)
            .copied()
            .unwrap_or(TenantRef::NONE);
        let count = (command.cdw10() & 0xFF) as usize + 1;
        let block_bytes = u64::from(namespace.block_size);
        let size_blocks = namespace.size_bytes / block_bytes;
        let mut trims = Vec::with_capacity(count);
        for chunk in data.chunks_exact(DSM_RANGE_SIZE).take(count) {
            let Some(bytes) = chunk.first_chunk::<DSM_RANGE_SIZE>() else {
                break;
            };
            let range = DsmRange::decode(bytes);
            if range.block_count == 0 {
                continue;
            }
            let end = range.slba.checked_add(u64::from(range.block_count));
            if end.is_none_or(|end| end > size_blocks) {
                return Outcome::status(cid, Status::LBA_OUT_OF_RANGE);
            }
            trims.push((
                range.slba * block_bytes,
                (range.slba + u64::from(range.block_count)) * block_bytes,
            ));
        }
        if trims.is_empty() {
            return Outcome::status(cid, Status::SUCCESS);
        }
        let Some((slot, generation)) = self.take_slot(cid, TransferKind::Trims, 0) else {
            return Outcome::status(cid, Status::COMMAND_SEQUENCE_ERROR);
        };
        if let Some(Some(transfer)) = self.transfers.get_mut(usize::from(slot)) {
            transfer.complete = false;
        }
        for (offset_bytes, end_bytes) in trims {
            self.internal.push_back(Internal {
                slot,
                generation,
                namespace_index: namespace.namespace_index,
                tenant,
                kind: InternalKind::Trim {
                    offset_bytes,
                    end_bytes,
                },
            });
        }
        Outcome::Nothing
    }

    /// Queues one flush per namespace of the subsystem for a shutdown notification; false
    /// when there is nothing to flush (the shutdown is complete at once).
    pub(super) fn queue_shutdown_flushes(&mut self, cid: u16) -> bool {
        let Phase::Queue(queue) = &self.phase else {
            return false;
        };
        let Some(subsystem) = queue
            .controller
            .subsystem
            .and_then(|index| self.targets.subsystems.get(index))
        else {
            return false;
        };
        let namespaces: Vec<(u16, TenantRef)> = subsystem
            .namespaces
            .iter()
            .enumerate()
            .map(|(position, namespace)| {
                let tenant = queue
                    .tenants
                    .get(position)
                    .copied()
                    .unwrap_or(TenantRef::NONE);
                (namespace.namespace_index, tenant)
            })
            .collect();
        if namespaces.is_empty() {
            return false;
        }
        let Some((slot, generation)) = self.take_slot(cid, TransferKind::ShutdownFlush, 0) else {
            return false;
        };
        if let Some(Some(transfer)) = self.transfers.get_mut(usize::from(slot)) {
            transfer.complete = false;
        }
        for (namespace_index, tenant) in namespaces {
            self.internal.push_back(Internal {
                slot,
                generation,
                namespace_index,
                tenant,
                kind: InternalKind::Flush,
            });
        }
        true
    }

    /// The next request the frontend makes itself (a trim piece, a shutdown flush).
    fn next_internal(&mut self) -> Option<Decoded> {
        let work = self.internal.pop_front()?;
        let slot = usize::from(work.slot);
        let (kind, offset_bytes, length_bytes, last_piece) = match work.kind {
            InternalKind::Flush => (IoKind::Flush, 0, 0, true),
            InternalKind::Trim {
                offset_bytes,
                end_bytes,
            } => {
                // Pieces of at most 1 GiB: a request's length is a u32.
                let piece = (end_bytes - offset_bytes).min(1 << 30);
                if offset_bytes + piece < end_bytes {
                    self.internal.push_front(Internal {
                        kind: InternalKind::Trim {
                            offset_bytes: offset_bytes + piece,
                            end_bytes,
                        },
                        ..work
                    });
                }
                (
                    IoKind::Trim {
                        fua: false,
                        hint: true,
                    },
                    offset_bytes,
                    piece as u32,
                    offset_bytes + piece == end_bytes,
                )
            }
        };
        let more_of_slot = self
            .internal
            .iter()
            .any(|other| other.slot == work.slot && other.generation == work.generation);
        if let Some(Some(transfer)) = self.transfers.get_mut(slot) {
            transfer.outstanding += 1;
            if last_piece && !more_of_slot {
                transfer.complete = true;
            }
        }
        Some(Decoded::Request {
            header_bytes: 0,
            payload_bytes: 0,
            tag: Tag::NvmeTcp(NvmeTag::Part {
                slot: work.slot,
                generation: work.generation,
            }),
            action: Action::Io(IoRequest {
                kind,
                namespace_index: work.namespace_index,
                offset_bytes,
                length_bytes,
                tenant: work.tenant,
            }),
        })
    }

    fn h2c_data(&mut self, header: DataHeader, decoded: &pdu::Decoded, input: &[u8]) -> Decoded {
        let Some(span) = decoded.data else {
            return self.fatal(
                PduError::new(FatalError::InvalidHeaderField, 3, "H2CData without data"),
                input,
            );
        };
        let maxh2cdata = self.maxh2cdata;
        let slot = usize::from(header.ttag);
        let check = match self.transfers.get(slot).and_then(Option::as_ref) {
            None => Err(PduError::new(
                FatalError::InvalidHeaderField,
                10,
                "H2CData for an unknown transfer tag",
            )),
            Some(transfer) if transfer.cid != header.cccid => Err(PduError::new(
                FatalError::InvalidHeaderField,
                8,
                "H2CData CCCID does not match its R2T",
            )),
            Some(transfer) if !transfer.awaiting || !transfer.r2t_sent => Err(PduError::new(
                FatalError::PduSequence,
                0,
                "H2CData without an R2T asking for it",
            )),
            Some(transfer) if header.offset != transfer.received => Err(PduError::new(
                FatalError::DataTransferOutOfRange,
                12,
                "H2CData DATAO out of order",
            )),
            Some(_) if header.length > maxh2cdata => Err(PduError::new(
                FatalError::DataTransferLimitExceeded,
                16,
                "H2CData longer than MAXH2CDATA",
            )),
            Some(transfer)
                if u64::from(transfer.received) + u64::from(header.length)
                    > u64::from(transfer.length) =>
            {
                Err(PduError::new(
                    FatalError::DataTransferOutOfRange,
                    16,
                    "H2CData beyond the R2T",
                ))
            }
            Some(_) => Ok(()),
        };
        if let Err(error) = check {
            return self.fatal(error, input);
        }
        let gathered = if span.digest || self.is_command_data(slot) {
            match self.gathered_data(span, decoded.total_bytes, input) {
                Gathered::NeedMore => return Decoded::NeedMore,
                Gathered::BadDigest => None,
                Gathered::Data(data) => Some(data.to_vec()),
            }
        } else {
            Some(Vec::new())
        };
        let Some(Some(transfer)) = self.transfers.get_mut(slot) else {
            unreachable!("checked above");
        };
        transfer.received += header.length;
        transfer.awaiting_since = None;
        let last = transfer.received == transfer.length;
        if last {
            transfer.awaiting = false;
        }
        let generation = transfer.generation;
        let cid = transfer.cid;
        let part_tag = Tag::NvmeTcp(NvmeTag::Part {
            slot: header.ttag,
            generation,
        });
        match &mut transfer.kind {
            TransferKind::DeviceWrite { io } => {
                let io = IoRequest {
                    offset_bytes: io.offset_bytes + u64::from(header.offset),
                    length_bytes: header.length,
                    ..*io
                };
                transfer.outstanding += 1;
                transfer.complete = last;
                if gathered.is_none() {
                    transfer.status = Status::TRANSIENT_TRANSPORT_ERROR;
                    return Decoded::Request {
                        header_bytes: span.offset,
                        payload_bytes: (decoded.total_bytes - span.offset) as u64,
                        tag: part_tag,
                        action: Action::Reply(Answer::Ok),
                    };
                }
                if span.digest {
                    self.digest_skip = pdu::DIGEST_SIZE;
                }
                Decoded::Request {
                    header_bytes: span.offset,
                    payload_bytes: u64::from(header.length),
                    tag: part_tag,
                    action: Action::Io(io),
                }
            }
            TransferKind::CommandData { command, data } => {
                let Some(chunk) = gathered else {
                    self.transfers[slot] = None;
                    return self.respond(
                        Outcome::status(cid, Status::TRANSIENT_TRANSPORT_ERROR),
                        decoded.total_bytes,
                        0,
                    );
                };
                data.extend_from_slice(&chunk);
                if !last {
                    return Decoded::Consumed(decoded.total_bytes);
                }
                let command = *command;
                let data = std::mem::take(data);
                self.transfers[slot] = None;
                let outcome = self.execute_with_data(command, &data);
                self.respond(outcome, decoded.total_bytes, 0)
            }
            TransferKind::Trims | TransferKind::ShutdownFlush => {
                unreachable!("no R2T for internal transfers")
            }
        }
    }

    fn is_command_data(&self, slot: usize) -> bool {
        matches!(
            self.transfers.get(slot).and_then(Option::as_ref),
            Some(Transfer {
                kind: TransferKind::CommandData { .. },
                ..
            })
        )
    }

    // ----------------------------------------------------------------------------------------
    // Answers

    /// The completion of `cid` with the queue's SQ head and id.
    pub(super) fn completion(&self, cid: u16, status: Status, dw0: u32, dw1: u32) -> Completion {
        let (sqhd, sqid) = match &self.phase {
            Phase::Queue(queue) if queue.flow_control => (queue.head, queue.qid),
            Phase::Queue(queue) => (0xFFFF, queue.qid),
            _ => (0, 0),
        };
        Completion {
            dw0,
            dw1,
            sqhd,
            sqid,
            cid,
            status,
        }
    }

    fn put_capsule_resp(&self, completion: Completion, out: &mut [u8]) -> usize {
        let header = self.framing.capsule_resp(&completion.to_bytes());
        out[..header.len()].copy_from_slice(header.as_bytes());
        header.len()
    }

    /// Appends data and its completion to the output: a C2HData PDU (the data, its digest)
    /// and a CapsuleResp.
    pub(super) fn output_data(&mut self, cid: u16, data: &[u8], status: Status, dw0: u32) {
        if !data.is_empty() {
            let header = self.framing.data_pdu(
                PduType::C2hData,
                flags::LAST_PDU,
                DataHeader {
                    cccid: cid,
                    ttag: 0,
                    offset: 0,
                    length: data.len() as u32,
                },
            );
            self.output.extend_from_slice(header.as_bytes());
            self.output.extend_from_slice(data);
            if self.framing.digests.data {
                self.output
                    .extend_from_slice(&pdu::crc32c(data).to_le_bytes());
            }
        }
        let response = self
            .framing
            .capsule_resp(&self.completion(cid, status, dw0, 0).to_bytes());
        self.output.extend_from_slice(response.as_bytes());
    }

    /// The header (and trailer) of an answer.
    pub(super) fn encode_answer(
        &mut self,
        tag: &NvmeTag,
        answer: Answer,
        header: &mut [u8; RESPONSE_HEADER_SIZE_MAX],
    ) -> Option<usize> {
        match *tag {
            NvmeTag::Completion {
                cid,
                status,
                dw0,
                dw1,
            } => {
                let status = if answer.is_ok() {
                    status
                } else {
                    status_for(answer, 0)
                };
                Some(self.put_capsule_resp(self.completion(cid, status, dw0, dw1), header))
            }
            NvmeTag::Io { cid, opcode } => {
                let status = status_for(answer, opcode);
                Some(self.put_capsule_resp(self.completion(cid, status, 0, 0), header))
            }
            NvmeTag::R2t { cid, ttag, length } => {
                if let Some(Some(transfer)) = self.transfers.get_mut(usize::from(ttag)) {
                    transfer.r2t_sent = true;
                }
                let r2t = self.framing.data_pdu(
                    PduType::R2t,
                    0,
                    DataHeader {
                        cccid: cid,
                        ttag,
                        offset: 0,
                        length,
                    },
                );
                header[..r2t.len()].copy_from_slice(r2t.as_bytes());
                Some(r2t.len())
            }
            NvmeTag::Part { slot, generation } => {
                Some(self.part_answered(slot, generation, answer, header))
            }
        }
    }

    /// A part of a command is answered; the last one writes the command's CapsuleResp.
    fn part_answered(
        &mut self,
        slot: u16,
        generation: u16,
        answer: Answer,
        header: &mut [u8; RESPONSE_HEADER_SIZE_MAX],
    ) -> usize {
        let index = usize::from(slot);
        let Some(Some(transfer)) = self.transfers.get_mut(index) else {
            return 0;
        };
        if transfer.generation != generation {
            return 0;
        }
        assert!(transfer.outstanding > 0, "a part answered twice");
        transfer.outstanding -= 1;
        if !answer.is_ok() && transfer.status.is_success() {
            let opcode = match transfer.kind {
                TransferKind::DeviceWrite { .. } => io_opcode::WRITE,
                TransferKind::Trims => io_opcode::DATASET_MANAGEMENT,
                _ => io_opcode::FLUSH,
            };
            transfer.status = status_for(answer, opcode);
        }
        if transfer.outstanding > 0 || !transfer.complete || transfer.awaiting {
            return 0;
        }
        let (cid, status) = (transfer.cid, transfer.status);
        let shutdown = matches!(transfer.kind, TransferKind::ShutdownFlush);
        self.transfers[index] = None;
        if shutdown {
            self.shutdown_flushed();
            return 0;
        }
        self.put_capsule_resp(self.completion(cid, status, 0, 0), header)
    }

    /// The header and trailer of a read's data: C2HData before it; its digest and the
    /// CapsuleResp after it (no CapsuleResp with the SUCCESS flag).
    pub(super) fn encode_read(
        &mut self,
        tag: &NvmeTag,
        piece: ReadPiece,
        data: &[u8],
        header: &mut [u8; RESPONSE_HEADER_SIZE_MAX],
        trailer: &mut [u8; RESPONSE_TRAILER_SIZE_MAX],
    ) -> Option<(usize, usize)> {
        let NvmeTag::Io { cid, .. } = *tag else {
            return None;
        };
        if !(piece.first && piece.last) {
            return None; // MDTS keeps every read in one run.
        }
        let flow_control = match &self.phase {
            Phase::Queue(queue) => queue.flow_control,
            _ => true,
        };
        let mut data_flags = flags::LAST_PDU;
        if !flow_control {
            data_flags |= flags::SUCCESS;
        }
        let c2h = self.framing.data_pdu(
            PduType::C2hData,
            data_flags,
            DataHeader {
                cccid: cid,
                ttag: 0,
                offset: 0,
                length: piece.length_bytes,
            },
        );
        header[..c2h.len()].copy_from_slice(c2h.as_bytes());
        let mut trailer_len = 0;
        if self.framing.digests.data {
            trailer[..pdu::DIGEST_SIZE].copy_from_slice(&pdu::crc32c(data).to_le_bytes());
            trailer_len = pdu::DIGEST_SIZE;
        }
        if flow_control {
            trailer_len += self.put_capsule_resp(
                self.completion(cid, Status::SUCCESS, 0, 0),
                &mut trailer[trailer_len..],
            );
        }
        Some((c2h.len(), trailer_len))
    }

    /// Bytes of output waiting.
    pub(super) fn pending_output_bytes(&self) -> usize {
        self.output.len()
    }

    pub(super) fn write_output(&mut self, out: &mut [u8]) -> usize {
        let length = self.output.len().min(out.len());
        out[..length].copy_from_slice(&self.output[..length]);
        self.output.drain(..length);
        length
    }

    /// The protocol's timers at a housekeeping sweep: `Some(reason)` closes the connection.
    pub(super) fn expired(&mut self, now: Nanos) -> Option<&'static str> {
        let r2t_timeout = self.targets.options.r2t_timeout;
        for transfer in self.transfers.iter_mut().flatten() {
            if !(transfer.awaiting && transfer.r2t_sent) {
                continue;
            }
            match transfer.awaiting_since {
                None => transfer.awaiting_since = Some(now),
                Some(since) if now.saturating_since(since) >= r2t_timeout => {
                    return Some("NVMe/TCP: the host did not send the data an R2T asked for");
                }
                Some(_) => {}
            }
        }
        let Phase::Queue(queue) = &mut self.phase else {
            return None;
        };
        match &mut queue.admin {
            Some(admin) => {
                let keep_alive = admin.keep_alive?;
                if std::mem::take(&mut admin.alive_noted) || admin.alive_at.is_none() {
                    admin.alive_at = Some(now);
                    return None;
                }
                let since = admin.alive_at.unwrap_or(now);
                (now.saturating_since(since) > keep_alive).then_some("NVMe/TCP: keep-alive timeout")
            }
            None => (queue.controller.state() == ControllerState::Gone)
                .then_some("NVMe/TCP: the queue's controller is gone"),
        }
    }
}

impl Drop for NvmeTcpFrontend {
    fn drop(&mut self) {
        if let Phase::Queue(queue) = &self.phase {
            if queue.admin.is_some() {
                tracing::debug!(
                    cntlid = queue.controller.cntlid,
                    "NVMe/TCP: controller gone"
                );
                self.targets.detach(&queue.controller);
            } else {
                queue.controller.release_io_queue(queue.qid);
            }
        }
    }
}

enum Gathered<'a> {
    NeedMore,
    BadDigest,
    Data(&'a [u8]),
}

fn output_request(header_bytes: usize) -> Decoded {
    Decoded::Request {
        header_bytes,
        payload_bytes: 0,
        tag: Tag::None,
        action: Action::Output,
    }
}

/// The NVMe status for a request's outcome (`opcode`: what failed, for device errors).
pub fn status_for(answer: Answer, opcode: u8) -> Status {
    match answer {
        Answer::Ok => Status::SUCCESS,
        Answer::Permission | Answer::Native(native::Status::Permission) => Status::ACCESS_DENIED,
        Answer::Native(native::Status::OutOfRange) => Status::LBA_OUT_OF_RANGE,
        Answer::Native(native::Status::NoSuchNamespace) => Status::INVALID_NAMESPACE,
        Answer::Native(native::Status::Busy)
        | Answer::Nbd(Errno::Shutdown)
        | Answer::ShuttingDown => Status::NAMESPACE_NOT_READY,
        Answer::Native(native::Status::NoSpace)
        | Answer::DeviceError {
            errno: libc::ENOSPC | libc::EDQUOT,
        } => Status::CAPACITY_EXCEEDED,
        Answer::Native(_) | Answer::Nbd(_) | Answer::Kv(_) => Status::INVALID_FIELD,
        Answer::Unsupported => Status::INVALID_OPCODE,
        Answer::DeviceError { .. } => match opcode {
            io_opcode::READ => Status::UNRECOVERED_READ_ERROR,
            io_opcode::WRITE | io_opcode::WRITE_ZEROES => Status::WRITE_FAULT,
            _ => Status::INTERNAL_ERROR,
        },
    }
}
