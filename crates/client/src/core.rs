//! The sans-IO connection core: one native-protocol connection as a plain data structure.
//!
//! Why sans-IO: the same core runs under the blocking and pipelined std drivers of this
//! crate, under the io_uring event loop of `reflex bench`, and in tests without a socket.
//! It owns two byte buffers and the table of outstanding requests; it never reads a clock
//! and never touches a socket.
//!
//! How to drive it (four families, in this order each round):
//! - **commands**: `submit_*` encode one request into the transmit buffer and record its id.
//!   All checks (window, duplicate id, size) run before anything changes, so a refused
//!   submit leaves no trace.
//! - **output**: [`ConnectionCore::transmit_start`] lends the unsent bytes to the driver,
//!   [`ConnectionCore::transmit_done`] says how many were sent.
//! - **input**: [`ConnectionCore::receive_start`] lends free receive space,
//!   [`ConnectionCore::receive_done`] says how many bytes arrived there.
//! - **events**: [`ConnectionCore::poll_completion`] returns responses (any order, matched by
//!   id, READ data borrowed from the receive buffer without a copy) until it returns `None`.
//!
//! Lending and moving: while a send or receive is in flight, its buffer is the kernel's, so
//! the core never reallocates or compacts a lent buffer ([`StreamBuffers`] keeps that contract). A submit that would need to grow a
//! lent buffer fails with [`SubmitError::BuffersBusy`]; [`ConnectionCore::reserve`] sizes the
//! buffers up front so an event loop never sees that.
//!
//! Invariants: every outstanding id is unique and not [`NOTICE_REQUEST_ID`]; outstanding
//! requests never exceed the window; a response is accepted only for an outstanding id with
//! the same opcode and the length the request implies; any violation breaks the connection
//! with a [`ProtocolError`] (never a panic), and the error is returned again on every call.
//!
//! A core lives as long as one byte stream. When the stream breaks (EOF, reset, timeout),
//! the driver polls what is buffered and then calls
//! [`ConnectionCore::handle_connection_lost`], which hands back every request still
//! unanswered as an [`InterruptedRequest`] (the core remembers enough of each — namespace,
//! range, tenant handle — to repeat a READ, FLUSH or BIND and to name a WRITE whose fate is
//! unknown) and leaves the core disconnected. A new stream gets a new core;
//! [`ConnectionCore::resubmit`] repeats there what is safe to repeat.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use reflex_proto::native::{
    BodyError, CAPABILITIES_SIZE_MAX, CONTROL_BODY_MAX_BYTES, HANDLE_BODY_SIZE, HELLO_BODY_SIZE,
    HelloBody, IO_SIZE_MAX_BYTES_DEFAULT, NOTICE_REQUEST_ID, Opcode, REQUEST_HEADER_SIZE,
    RESPONSE_HEADER_SIZE, RegisterBody, RenegotiateBody, ReportBody, RequestFlags, RequestHeader,
    ResponseHeader, Status, UnknownStatus, VERSION, decode_handle, encode_handle,
};

use crate::error::{ClientError, ProtocolError, SubmitError};
use crate::stream_buffers::StreamBuffers;
use crate::types::Capabilities;

/// Largest `max_io_size` the client accepts from a server: it bounds the receive buffer.
/// A request id for REPORTs (`submit_report`) that callers numbering their requests from 0,
/// as `reflex bench` and the simulator do, never reach; notices use `u64::MAX`.
pub const REPORT_REQUEST_ID: u64 = u64::MAX - 1;

pub const IO_SIZE_MAX_BYTES_LIMIT: u32 = 16 << 20;
/// Largest window the client accepts from a server: it bounds the outstanding table.
pub const WINDOW_REQUESTS_LIMIT: u32 = 65_536;
/// Payload bound of an error reason, a REGISTER answer or a notice.
const CONTROL_BODY_MAX: u32 = CONTROL_BODY_MAX_BYTES;
/// Transmit capacity of a new core: many 4 KiB writes before the first `reserve`.
const TRANSMIT_CAPACITY_BYTES_INITIAL: usize = 64 * 1024;
/// Smallest receive buffer: room for many 4 KiB responses per receive.
pub const RECEIVE_BUFFER_MIN: usize = 256 * 1024;
/// Below this much free space at the end, `receive_start` compacts the buffer first.
const RECEIVE_SPARE_MIN: usize = 64 * 1024;

const _: () = assert!(RECEIVE_SPARE_MIN < RECEIVE_BUFFER_MIN);
const _: () = assert!(RESPONSE_HEADER_SIZE + CONTROL_BODY_MAX as usize <= RECEIVE_SPARE_MIN);
const _: () = assert!(RESPONSE_HEADER_SIZE + CAPABILITIES_SIZE_MAX <= RECEIVE_SPARE_MIN);
const _: () = assert!(IO_SIZE_MAX_BYTES_DEFAULT <= IO_SIZE_MAX_BYTES_LIMIT);

/// Settings for a core before HELLO tells the real limits.
#[derive(Debug, Clone, Copy)]
pub struct CoreOptions {
    /// Window assumed until a HELLO response arrives. 1 is always safe.
    pub window_assumed: u32,
}

impl Default for CoreOptions {
    fn default() -> Self {
        CoreOptions { window_assumed: 1 }
    }
}

/// A response taken out of the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion<'a> {
    /// The request's id, or [`NOTICE_REQUEST_ID`] for an unsolicited notice.
    pub request_id: u64,
    /// The opcode of the request it answers (checked against the echoed one).
    pub opcode: Opcode,
    /// The status as sent; see [`Completion::status`].
    pub status_raw: u16,
    /// READ data when the status is OK, a control body, or the UTF-8 reason of an error.
    pub data: &'a [u8],
}

impl<'a> Completion<'a> {
    pub fn status(&self) -> Result<Status, UnknownStatus> {
        Status::from_u16(self.status_raw)
    }

    pub fn is_ok(&self) -> bool {
        self.status_raw == Status::Ok.as_u16()
    }

    /// An unsolicited server notice (RENEGOTIATE), not the answer to a request.
    pub fn is_notice(&self) -> bool {
        self.request_id == NOTICE_REQUEST_ID && self.opcode == Opcode::Renegotiate
    }

    /// The error reason the server gave, if it gave one.
    pub fn reason(&self) -> Option<String> {
        if self.is_ok() || self.data.is_empty() {
            None
        } else {
            Some(String::from_utf8_lossy(self.data).into_owned())
        }
    }

    /// The body of a RENEGOTIATE notice; `None` for anything else (or a malformed body).
    pub fn notice(&self) -> Option<RenegotiateBody> {
        if !self.is_notice() {
            return None;
        }
        RenegotiateBody::decode(self.data).ok()
    }

    /// The tenant handle of an accepted REGISTER, or its refusal as a typed error.
    pub fn tenant_handle(&self) -> Result<u64, ClientError> {
        let body = self.result()?;
        decode_handle(body).map_err(|error| ProtocolError::TenantBody(error).into())
    }

    /// The data on success, or the refusal as a typed error.
    pub fn result(&self) -> Result<&'a [u8], ClientError> {
        match self.status() {
            Ok(Status::Ok) => Ok(self.data),
            Ok(Status::Refused) => Err(ClientError::Refused {
                reason: self.reason().unwrap_or_default(),
            }),
            Ok(status) => Err(ClientError::Status {
                opcode: self.opcode,
                status,
                reason: self.reason(),
            }),
            Err(UnknownStatus(status_raw)) => Err(ClientError::UnknownStatus {
                opcode: self.opcode,
                status_raw,
                reason: self.reason(),
            }),
        }
    }
}

/// What the core remembers about one outstanding request: enough to check its answer, and,
/// should the connection break first, to repeat it or to say which range it addressed.
#[derive(Debug, Clone, Copy)]
struct Outstanding {
    opcode: Opcode,
    namespace: u32,
    offset_bytes: u64,
    /// READ: bytes requested (the exact payload of an OK response); WRITE and TRIM: bytes
    /// addressed; control requests: 0.
    length_bytes: u32,
    fua: bool,
    /// BIND and UNREGISTER: the handle in the body.
    handle: Option<u64>,
    /// Position in submission order, so interrupted requests are repeated in that order.
    sequence: u64,
}

/// A request the connection broke under: sent (or queued to be sent) and never answered.
/// Returned by [`ConnectionCore::handle_connection_lost`]; WRITE, TRIM, REGISTER and
/// UNREGISTER ones are reported to callers in [`ClientError::OutcomeUnknown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InterruptedRequest {
    pub request_id: u64,
    pub opcode: Opcode,
    /// READ, WRITE, FLUSH, TRIM: the namespace addressed; control requests: 0.
    pub namespace: u32,
    /// READ, WRITE, TRIM: the first byte addressed; otherwise 0.
    pub offset_bytes: u64,
    /// READ, WRITE, TRIM: the bytes addressed; otherwise 0.
    pub length_bytes: u32,
    /// A WRITE with forced unit access.
    pub fua: bool,
    /// BIND and UNREGISTER: the tenant handle.
    pub handle: Option<u64>,
}

impl InterruptedRequest {
    /// Whether repeating the request on a new connection gives the caller what one execution
    /// would: READ and FLUSH change nothing, and BIND (with its handle known) sets the same
    /// binding again. WRITE, TRIM, REGISTER and UNREGISTER change the server's state, and the
    /// caller may have reasons (a later write by someone else) not to repeat them blindly.
    pub fn is_safe_to_repeat(&self) -> bool {
        match self.opcode {
            Opcode::Read | Opcode::Flush => true,
            Opcode::Bind => self.handle.is_some(),
            Opcode::Write
            | Opcode::Trim
            | Opcode::Register
            | Opcode::Unregister
            | Opcode::Hello
            // A report is stale once interrupted: the next interval's replaces it.
            | Opcode::Report
            | Opcode::Renegotiate => false,
        }
    }
}

/// Multiply-shift hashing of client-chosen request ids: the table is private and bounded,
/// so the cost of SipHash buys nothing here.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0 ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = (value ^ (value >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap = HashMap<u64, Outstanding, BuildHasherDefault<IdHasher>>;

/// A validated, complete frame at the front of the receive buffer.
#[derive(Debug, Clone, Copy)]
struct Frame {
    header: ResponseHeader,
    opcode: Opcode,
}

fn is_ok(header: &ResponseHeader) -> bool {
    header.status_raw == Status::Ok.as_u16()
}

/// One native-protocol connection, without I/O. See the module doc for how to drive it.
pub struct ConnectionCore {
    /// Requests to send and responses received but not yet polled.
    buffers: StreamBuffers,
    outstanding: IdMap,
    window: u32,
    max_io_size: u32,
    capabilities: Option<Capabilities>,
    broken: Option<ProtocolError>,
    /// Set by `connection_lost`: the stream is gone and nothing more can be sent or received.
    disconnected: bool,
    /// Sequence number of the next submitted request.
    sequence_next: u64,
    /// The tenant handle of the last BIND answered OK (0: never bound, or bound to the
    /// default again).
    bound_handle: u64,
}

impl ConnectionCore {
    pub fn new(options: CoreOptions) -> ConnectionCore {
        assert!(options.window_assumed >= 1);
        let window = options.window_assumed.min(WINDOW_REQUESTS_LIMIT);
        let mut outstanding = IdMap::default();
        outstanding.reserve(window as usize);
        ConnectionCore {
            buffers: StreamBuffers::new(
                TRANSMIT_CAPACITY_BYTES_INITIAL,
                RECEIVE_BUFFER_MIN,
                RECEIVE_SPARE_MIN,
            ),
            outstanding,
            window,
            max_io_size: IO_SIZE_MAX_BYTES_DEFAULT,
            capabilities: None,
            broken: None,
            disconnected: false,
            sequence_next: 0,
            bound_handle: 0,
        }
    }

    // ----- getters -----

    /// Requests this connection may have outstanding (from HELLO, or the assumed value).
    pub fn window(&self) -> u32 {
        self.window
    }

    /// Largest READ/WRITE length (from HELLO, or the protocol's 1 MiB).
    pub fn max_io_size(&self) -> u32 {
        self.max_io_size
    }

    /// The server's capabilities once a HELLO response arrived.
    pub fn capabilities(&self) -> Option<&Capabilities> {
        self.capabilities.as_ref()
    }

    pub fn outstanding_count(&self) -> usize {
        self.outstanding.len()
    }

    pub fn is_outstanding(&self, request_id: u64) -> bool {
        self.outstanding.contains_key(&request_id)
    }

    pub fn broken(&self) -> Option<&ProtocolError> {
        self.broken.as_ref()
    }

    /// Whether [`ConnectionCore::handle_connection_lost`] ended this core.
    pub fn is_disconnected(&self) -> bool {
        self.disconnected
    }

    /// The tenant this connection's I/O is charged to, as far as answered BINDs tell: the
    /// handle of the last BIND answered OK, 0 for the namespace's default tenant.
    pub fn bound_handle(&self) -> u64 {
        self.bound_handle
    }

    /// Bytes submitted but not yet handed to `transmit_done`.
    pub fn transmit_pending_bytes(&self) -> usize {
        self.buffers.transmit_pending_bytes()
    }

    pub fn transmit_in_flight(&self) -> bool {
        self.buffers.transmit_in_flight()
    }

    pub fn receive_in_flight(&self) -> bool {
        self.buffers.receive_in_flight()
    }

    // ----- commands -----

    /// Grows the buffers, while nothing is lent, so that `requests` requests with up to
    /// `io_size_bytes` of payload each can be submitted and answered without growing again.
    /// Event loops call this once before lending buffers to the kernel.
    pub fn reserve(&mut self, requests: usize, io_size_bytes: u32) {
        let io_size_bytes = io_size_bytes.min(self.max_io_size) as usize;
        let frame_bytes = REQUEST_HEADER_SIZE + io_size_bytes;
        // Unsent frames of every outstanding request plus the same again of sent bytes not
        // yet compacted away (compaction waits for the lent range to come back).
        let transmit_bytes = 2 * requests * frame_bytes;
        let receive_bytes =
            (RESPONSE_HEADER_SIZE + io_size_bytes + RECEIVE_SPARE_MIN).max(RECEIVE_BUFFER_MIN);
        self.buffers.reserve(transmit_bytes, receive_bytes);
        self.outstanding
            .reserve(requests.saturating_sub(self.outstanding.len()));
    }

    /// Queues a HELLO announcing the client's I/O priority (`class << 13 | level`).
    pub fn submit_hello(&mut self, request_id: u64, io_priority: u16) -> Result<(), SubmitError> {
        let body = HelloBody {
            version_max: u16::from(VERSION),
            io_priority,
        }
        .to_bytes();
        let header = RequestHeader {
            length_bytes: HELLO_BODY_SIZE as u32,
            ..RequestHeader::new(Opcode::Hello, request_id)
        };
        self.admit(&header, 0)?;
        self.push_frame(Opcode::Hello, &header, None, |payload| {
            payload.copy_from_slice(&body)
        });
        Ok(())
    }

    /// Queues a READ of `length_bytes` at `offset` of namespace `namespace`.
    pub fn submit_read(
        &mut self,
        request_id: u64,
        namespace: u32,
        offset: u64,
        length_bytes: u32,
    ) -> Result<(), SubmitError> {
        self.check_io_size(length_bytes)?;
        let header = RequestHeader::read(request_id, namespace, offset, length_bytes);
        self.admit(&header, length_bytes)?;
        self.push_frame(Opcode::Read, &header, None, |_| {});
        Ok(())
    }

    /// Queues a WRITE of `data`; with `fua` it is durable when acknowledged.
    pub fn submit_write(
        &mut self,
        request_id: u64,
        namespace: u32,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> Result<(), SubmitError> {
        let length_bytes = u32::try_from(data.len()).map_err(|_| SubmitError::TooLarge {
            length_bytes: data.len() as u64,
            max_bytes: self.max_io_size,
        })?;
        self.submit_write_with(
            request_id,
            namespace,
            offset,
            length_bytes,
            fua,
            |payload| payload.copy_from_slice(data),
        )
    }

    /// Queues a WRITE whose `length_bytes` of payload `fill` writes in place, straight into
    /// the transmit buffer (no intermediate copy). `fill` is called only if the request is
    /// accepted, and must fill the whole slice it is given.
    pub fn submit_write_with(
        &mut self,
        request_id: u64,
        namespace: u32,
        offset: u64,
        length_bytes: u32,
        fua: bool,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), SubmitError> {
        self.check_io_size(length_bytes)?;
        let header = RequestHeader {
            flags: if fua {
                RequestFlags::FUA
            } else {
                RequestFlags::NONE
            },
            offset_bytes: offset,
            length_bytes,
            namespace_id: namespace,
            ..RequestHeader::new(Opcode::Write, request_id)
        };
        self.admit(&header, 0)?;
        self.push_frame(Opcode::Write, &header, None, fill);
        Ok(())
    }

    /// Queues a FLUSH of namespace `namespace`.
    pub fn submit_flush(&mut self, request_id: u64, namespace: u32) -> Result<(), SubmitError> {
        let header = RequestHeader {
            namespace_id: namespace,
            ..RequestHeader::new(Opcode::Flush, request_id)
        };
        self.admit(&header, 0)?;
        self.push_frame(Opcode::Flush, &header, None, |_| {});
        Ok(())
    }

    /// Queues a TRIM of `length_bytes` at `offset`.
    pub fn submit_trim(
        &mut self,
        request_id: u64,
        namespace: u32,
        offset: u64,
        length_bytes: u32,
    ) -> Result<(), SubmitError> {
        let header = RequestHeader {
            offset_bytes: offset,
            length_bytes,
            namespace_id: namespace,
            ..RequestHeader::new(Opcode::Trim, request_id)
        };
        self.admit(&header, 0)?;
        self.push_frame(Opcode::Trim, &header, None, |_| {});
        Ok(())
    }

    /// Queues a control request (REGISTER, UNREGISTER, BIND, REPORT) with its body.
    pub fn submit_control(
        &mut self,
        request_id: u64,
        opcode: Opcode,
        body: &[u8],
    ) -> Result<(), SubmitError> {
        assert!(matches!(
            opcode,
            Opcode::Register | Opcode::Unregister | Opcode::Bind | Opcode::Report
        ));
        let length = u32::try_from(body.len())
            .ok()
            .filter(|length| *length <= CONTROL_BODY_MAX)
            .ok_or(SubmitError::TooLarge {
                length_bytes: body.len() as u64,
                max_bytes: CONTROL_BODY_MAX,
            })?;
        let header = RequestHeader {
            length_bytes: length,
            ..RequestHeader::new(opcode, request_id)
        };
        self.admit(&header, 0)?;
        let handle = match opcode {
            Opcode::Bind | Opcode::Unregister => decode_handle(body).ok(),
            _ => None,
        };
        self.push_frame(opcode, &header, handle, |payload| {
            payload.copy_from_slice(body)
        });
        Ok(())
    }

    /// Queues a REGISTER (a new tenant, or with `body.handle` set a new SLO for one).
    pub fn submit_register(
        &mut self,
        request_id: u64,
        body: &RegisterBody,
    ) -> Result<(), SubmitError> {
        self.submit_control(request_id, Opcode::Register, &body.to_bytes())
    }

    /// Queues an UNREGISTER of tenant `handle`.
    pub fn submit_unregister(&mut self, request_id: u64, handle: u64) -> Result<(), SubmitError> {
        self.submit_control(request_id, Opcode::Unregister, &encode_handle(handle))
    }

    /// Queues a BIND: this connection's I/O is charged to tenant `handle` (0: the default).
    pub fn submit_bind(&mut self, request_id: u64, handle: u64) -> Result<(), SubmitError> {
        self.submit_control(request_id, Opcode::Bind, &encode_handle(handle))
    }

    /// Queues a REPORT: what this connection's latency-critical tenant measured over its last
    /// interval (`docs/PROTOCOL.md` §1.9; the server answers OK, and ignores it unless the
    /// connection is bound to an LC tenant).
    pub fn submit_report(
        &mut self,
        request_id: u64,
        report: &ReportBody,
    ) -> Result<(), SubmitError> {
        self.submit_control(request_id, Opcode::Report, &report.to_bytes())
    }

    /// Queues an interrupted request again, under the same id, on the new connection this
    /// core serves. Only for requests [`InterruptedRequest::is_safe_to_repeat`] (asserted):
    /// the others are the caller's to decide about.
    pub fn resubmit(&mut self, request: &InterruptedRequest) -> Result<(), SubmitError> {
        match (request.opcode, request.handle) {
            (Opcode::Read, _) => self.submit_read(
                request.request_id,
                request.namespace,
                request.offset_bytes,
                request.length_bytes,
            ),
            (Opcode::Flush, _) => self.submit_flush(request.request_id, request.namespace),
            (Opcode::Bind, Some(handle)) => self.submit_bind(request.request_id, handle),
            (opcode, _) => panic!("{opcode:?} is not safe to repeat"),
        }
    }

    fn check_io_size(&self, length_bytes: u32) -> Result<(), SubmitError> {
        if length_bytes > self.max_io_size {
            return Err(SubmitError::TooLarge {
                length_bytes: u64::from(length_bytes),
                max_bytes: self.max_io_size,
            });
        }
        Ok(())
    }

    /// Every check of a submit, before anything changes; makes room in the buffers.
    fn admit(&mut self, header: &RequestHeader, read_length_bytes: u32) -> Result<(), SubmitError> {
        if self.broken.is_some() {
            return Err(SubmitError::Broken);
        }
        if self.disconnected {
            return Err(SubmitError::Disconnected);
        }
        if header.request_id == NOTICE_REQUEST_ID {
            return Err(SubmitError::ReservedId(header.request_id));
        }
        if self.outstanding.len() >= self.window as usize {
            return Err(SubmitError::WindowFull {
                window_requests: self.window,
            });
        }
        if self.outstanding.contains_key(&header.request_id) {
            return Err(SubmitError::DuplicateId(header.request_id));
        }
        let payload_bytes = header.payload_length_bytes() as usize;
        let frame_bytes = REQUEST_HEADER_SIZE + payload_bytes;
        let receive_needed = RESPONSE_HEADER_SIZE + read_length_bytes as usize + RECEIVE_SPARE_MIN;
        self.buffers
            .make_room(frame_bytes, receive_needed)
            .map_err(|_| SubmitError::BuffersBusy)
    }

    fn push_frame(
        &mut self,
        opcode: Opcode,
        header: &RequestHeader,
        handle: Option<u64>,
        fill: impl FnOnce(&mut [u8]),
    ) {
        assert_eq!(header.opcode_raw, opcode.as_u8());
        assert!(!self.disconnected);
        let payload_bytes = header.payload_length_bytes() as usize;
        // Growth was settled by `admit`: a lent buffer must not move.
        self.buffers
            .push_frame(&header.to_bytes(), payload_bytes, fill);
        let addresses_data = matches!(opcode, Opcode::Read | Opcode::Write | Opcode::Trim);
        let previous = self.outstanding.insert(
            header.request_id,
            Outstanding {
                opcode,
                namespace: header.namespace_id,
                offset_bytes: header.offset_bytes,
                length_bytes: if addresses_data {
                    header.length_bytes
                } else {
                    0
                },
                fua: header.flags.fua(),
                handle,
                sequence: self.sequence_next,
            },
        );
        self.sequence_next += 1;
        assert!(previous.is_none());
        assert!(self.outstanding.len() <= self.window as usize);
    }

    // ----- output -----

    /// Lends the unsent bytes for one send; `None` when there are none or a send is already
    /// in flight. Must be followed by exactly one [`ConnectionCore::transmit_done`].
    pub fn transmit_start(&mut self) -> Option<&[u8]> {
        if self.disconnected {
            return None;
        }
        self.buffers.transmit_start()
    }

    /// `sent_bytes` of the lent bytes were sent (0 after a failed send).
    pub fn transmit_done(&mut self, sent_bytes: usize) {
        self.buffers.transmit_done(sent_bytes);
    }

    // ----- input -----

    /// Lends free receive space for one receive; `None` when a receive is in flight or the
    /// buffer is full of complete responses (poll them first). Must be followed by exactly
    /// one [`ConnectionCore::receive_done`].
    pub fn receive_start(&mut self) -> Option<&mut [u8]> {
        if self.disconnected {
            return None;
        }
        self.buffers.receive_start(front_frame_bytes)
    }

    /// `received_bytes` arrived in the lent space (0 after a failed receive).
    pub fn receive_done(&mut self, received_bytes: usize) {
        self.buffers.receive_done(received_bytes);
    }

    /// Copies bytes in (for drivers that own their buffers, and tests); returns how many
    /// were taken, which is fewer than offered only when the buffer is full.
    pub fn handle_received_bytes(&mut self, bytes: &[u8]) -> usize {
        self.buffers.receive_copy(bytes, front_frame_bytes)
    }

    // ----- events -----

    /// Whether a complete response is buffered (so [`ConnectionCore::poll_completion`] will
    /// return it). Errors as `poll_completion` does.
    pub fn completion_ready(&mut self) -> Result<bool, ProtocolError> {
        Ok(self.peek_frame()?.is_some())
    }

    /// The next buffered response, or `None` until more bytes arrive.
    pub fn poll_completion(&mut self) -> Result<Option<Completion<'_>>, ProtocolError> {
        let Some(frame) = self.peek_frame()? else {
            return Ok(None);
        };
        let frame_bytes = RESPONSE_HEADER_SIZE + frame.header.length_bytes as usize;
        if frame.header.request_id == NOTICE_REQUEST_ID && frame.opcode == Opcode::Renegotiate {
            // Notices are not in the outstanding table.
        } else {
            let removed = self.outstanding.remove(&frame.header.request_id);
            assert!(removed.is_some());
            if let Some(Outstanding {
                opcode: Opcode::Bind,
                handle: Some(handle),
                ..
            }) = removed
                && is_ok(&frame.header)
            {
                self.bound_handle = handle;
            }
        }
        if frame.opcode == Opcode::Hello && is_ok(&frame.header) {
            // `peek_frame` saw the whole frame buffered.
            let body = &self.buffers.received()[RESPONSE_HEADER_SIZE..frame_bytes];
            self.accept_capabilities(Capabilities::decode(body))?;
        }
        let frame_received = self.buffers.take_received(frame_bytes);
        Ok(Some(Completion {
            request_id: frame.header.request_id,
            opcode: frame.opcode,
            status_raw: frame.header.status_raw,
            data: &frame_received[RESPONSE_HEADER_SIZE..],
        }))
    }

    /// The byte stream under this core broke (EOF, reset, timeout): returns every request
    /// still unanswered, in the order it was submitted, and leaves the core disconnected
    /// (submits fail with [`SubmitError::Disconnected`], nothing more is lent or polled).
    ///
    /// Call it after [`ConnectionCore::poll_completion`] returned `None`, with nothing lent:
    /// an answer that arrived before the break is an answer, and must not be mistaken for an
    /// interruption (a WRITE acknowledged is never of unknown outcome).
    pub fn handle_connection_lost(&mut self) -> Vec<InterruptedRequest> {
        assert!(!self.transmit_in_flight());
        assert!(!self.receive_in_flight());
        if cfg!(debug_assertions) && !self.disconnected {
            let answer_buffered = matches!(self.peek_frame(), Ok(Some(_)));
            assert!(
                !answer_buffered,
                "answers must be polled before the connection is lost"
            );
        }
        self.disconnected = true;
        let mut interrupted: Vec<(u64, InterruptedRequest)> = self
            .outstanding
            .drain()
            .map(|(request_id, outstanding)| {
                (
                    outstanding.sequence,
                    InterruptedRequest {
                        request_id,
                        opcode: outstanding.opcode,
                        namespace: outstanding.namespace,
                        offset_bytes: outstanding.offset_bytes,
                        length_bytes: outstanding.length_bytes,
                        fua: outstanding.fua,
                        handle: outstanding.handle,
                    },
                )
            })
            .collect();
        interrupted.sort_unstable_by_key(|(sequence, _)| *sequence);
        assert!(self.outstanding.is_empty());
        interrupted
            .into_iter()
            .map(|(_, request)| request)
            .collect()
    }

    fn accept_capabilities(
        &mut self,
        decoded: Result<Capabilities, BodyError>,
    ) -> Result<(), ProtocolError> {
        let capabilities = match decoded {
            Ok(capabilities) => capabilities,
            Err(error) => return Err(self.break_with(ProtocolError::Capabilities(error))),
        };
        // proto's decoder refuses a zero window and a zero max I/O size.
        assert!(capabilities.window_requests >= 1);
        assert!(capabilities.io_size_max_bytes >= 1);
        self.window = capabilities.window_requests.min(WINDOW_REQUESTS_LIMIT);
        self.max_io_size = capabilities.io_size_max_bytes.min(IO_SIZE_MAX_BYTES_LIMIT);
        self.capabilities = Some(capabilities);
        Ok(())
    }

    fn break_with(&mut self, error: ProtocolError) -> ProtocolError {
        self.broken = Some(error.clone());
        error
    }

    /// Validates the header at the front of the receive buffer; `Some` once the whole frame
    /// has arrived.
    fn peek_frame(&mut self) -> Result<Option<Frame>, ProtocolError> {
        if let Some(error) = &self.broken {
            return Err(error.clone());
        }
        if self.disconnected {
            return Ok(None);
        }
        let buffered = self.buffers.received();
        let header = match ResponseHeader::decode(buffered) {
            Ok(None) => return Ok(None),
            Ok(Some((header, _))) => header,
            Err(error) => return Err(self.break_with(ProtocolError::Header(error))),
        };
        let opcode = match self.check_header(&header) {
            Ok(opcode) => opcode,
            Err(error) => return Err(self.break_with(error)),
        };
        let frame_bytes = RESPONSE_HEADER_SIZE + header.length_bytes as usize;
        if buffered.len() < frame_bytes {
            return Ok(None);
        }
        Ok(Some(Frame { header, opcode }))
    }

    /// The opcode of a response whose header agrees with the request it answers.
    fn check_header(&self, header: &ResponseHeader) -> Result<Opcode, ProtocolError> {
        if header.request_id == NOTICE_REQUEST_ID
            && header.opcode_raw == Opcode::Renegotiate.as_u8()
        {
            check_length(
                Opcode::Renegotiate,
                header.length_bytes,
                0,
                CONTROL_BODY_MAX,
            )?;
            return Ok(Opcode::Renegotiate);
        }
        let outstanding = self
            .outstanding
            .get(&header.request_id)
            .ok_or(ProtocolError::UnknownRequestId(header.request_id))?;
        if header.opcode_raw != outstanding.opcode.as_u8() {
            return Err(ProtocolError::OpcodeMismatch {
                expected: outstanding.opcode,
                got: header.opcode_raw,
            });
        }
        let opcode = outstanding.opcode;
        let length = header.length_bytes;
        if !is_ok(header) {
            check_length(opcode, length, 0, CONTROL_BODY_MAX)?;
            return Ok(opcode);
        }
        match opcode {
            Opcode::Read => check_length(
                opcode,
                length,
                outstanding.length_bytes,
                outstanding.length_bytes,
            )?,
            Opcode::Hello => check_length(opcode, length, 0, CAPABILITIES_SIZE_MAX as u32)?,
            Opcode::Register => check_length(
                opcode,
                length,
                HANDLE_BODY_SIZE as u32,
                HANDLE_BODY_SIZE as u32,
            )?,
            Opcode::Write
            | Opcode::Flush
            | Opcode::Trim
            | Opcode::Unregister
            | Opcode::Bind
            | Opcode::Report
            | Opcode::Renegotiate => check_length(opcode, length, 0, 0)?,
        }
        Ok(opcode)
    }
}

/// Length of the response at the front of `unread` once its header has arrived.
fn front_frame_bytes(unread: &[u8]) -> Option<usize> {
    let (header, _) = ResponseHeader::decode(unread).ok().flatten()?;
    Some(RESPONSE_HEADER_SIZE + header.length_bytes as usize)
}

fn check_length(opcode: Opcode, got: u32, min: u32, max: u32) -> Result<(), ProtocolError> {
    if got < min || got > max {
        return Err(ProtocolError::UnexpectedLength {
            opcode,
            expected: if min == max {
                min.to_string()
            } else {
                format!("{min}..={max}")
            },
            got,
        });
    }
    Ok(())
}

impl std::fmt::Debug for ConnectionCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionCore")
            .field("window", &self.window)
            .field("outstanding", &self.outstanding.len())
            .field("transmit_pending_bytes", &self.transmit_pending_bytes())
            .field("receive_buffered_bytes", &self.buffers.received().len())
            .field("broken", &self.broken)
            .finish()
    }
}
