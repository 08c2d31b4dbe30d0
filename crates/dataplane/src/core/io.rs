//! I/O requests from their start to their answer where they are more than one device
//! operation (the decisions are `crate::steps`'; this module moves the bytes): the run a
//! request needs, the payload of a WRITE part by part, edge sectors merged into a
//! read-modify-write, the parts of a large READ sent one after the other, and the write gate.
//!
//! Large WRITEs: the connection's `payload` stays on the request from its header to the end of
//! its last part, so nothing after it is parsed; while a part is at the device nothing is
//! received (the run is busy), and the next part's bytes are taken from the receive buffer
//! first, then received straight into the run, as for any WRITE. A WRITE that fails before its
//! last part has the rest of its payload skipped, so the stream stays in step.
//!
//! Large READs: a part that is not the last is sent from the run (`Work::Part`), and once it is
//! out the request reads the next part into the same run. With a simple reply the data of
//! all parts forms one reply, so from the first part on the connection sends nothing else
//! until the last part (`Connection::stream_owner`; the next part goes to the head of the send
//! queue); a failure after the first part can then only be reported by closing the connection,
//! as the NBD spec requires. Structured replies need none of this: each part is an
//! `OFFSET_DATA` chunk, and other replies may come between them.
//!
//! BLOCK_STATUS: answered when it starts, from [`reflex_flash::Device::block_status`] (a
//! metadata query, no device I/O, no scheduler turn), at most
//! [`BLOCK_STATUS_EXTENTS_MAX`] extents; a device that cannot tell reports data.
//!
//! The write gate: a WRITE, TRIM or WRITE_ZEROES takes its place at its namespace's
//! [`crate::gate::WriteGate`] before its first device step and keeps it until its answer (or
//! until it is freed, for one whose device operation outlived the connection or the timeout).
//! A request that must wait goes `Overlapping` and into [`GateWaits`]; the waiting ones ask
//! again when a write of this thread leaves the gate, and every [`GATE_RETRY_INTERVAL`] for
//! writes of other threads.

use std::collections::VecDeque;

use reflex_flash::{Allocation, Extent};
use reflex_qos::Nanos;

use super::Dataplane;
use super::connection::ReadState;
use super::request::{GatePlace, RequestState, Work};
use crate::buffers::RUN_SIZE_MAX;
use crate::frontend::{
    Answer, BLOCK_STATUS_BODY_BYTES_MAX, BLOCK_STATUS_EXTENTS_MAX, IoKind, IoRequest, ReadPiece,
};
use crate::gate::{Acquired, GATE_RETRY_INTERVAL, WriteRange};
use crate::steps::{self, Edge, IoStep, Layout, Start};

/// Requests waiting at the write gate on this thread.
#[derive(Debug)]
pub(super) struct GateWaits {
    /// Requests in `Overlapping`, oldest first.
    waiting: VecDeque<u32>,
    /// A write of this thread left the gate since the waiting ones last asked.
    released: bool,
    /// When the waiting ones ask again anyway (for writes of other threads).
    retry_at: Nanos,
}

impl GateWaits {
    pub(super) fn new(requests_max: u32) -> GateWaits {
        GateWaits {
            waiting: VecDeque::with_capacity(requests_max as usize),
            released: false,
            retry_at: Nanos::ZERO,
        }
    }
}

impl Dataplane {
    /// How a request lies on its namespace's sectors, cut into parts of one run.
    pub(super) fn layout(&self, io: IoRequest) -> Layout {
        let sector_bytes = self.namespaces.info(io.namespace_index).block_size;
        Layout::new(
            io.kind,
            io.offset_bytes,
            io.length_bytes,
            sector_bytes,
            RUN_SIZE_MAX as u32,
        )
    }

    /// Starts an I/O request: its run, then its first step (for a WRITE: its first part's
    /// payload). False when it must wait for a buffer run.
    pub(super) fn start_io(&mut self, index: u32, io: IoRequest, now: Nanos) -> bool {
        if let IoKind::BlockStatus { req_one } = io.kind {
            return self.answer_block_status(index, io, req_one);
        }
        if let IoKind::Kv { .. } = io.kind {
            return self.start_kv(index, io, now);
        }
        let connection_index = self.requests[index as usize].connection_index;
        let layout = self.layout(io);
        let discards = self.discards[usize::from(io.namespace_index)];
        let (step, receive) = match steps::first_step(io.kind, &layout, discards) {
            Start::Answer(answer) => {
                self.respond(index, answer, None, 0);
                return true;
            }
            Start::Submit(step) => (step, false),
            Start::Receive(step) => (step, true),
        };
        let run_bytes = layout.run_bytes(io.kind);
        let run = if run_bytes > 0 {
            let Some(run) = self.allocate_run(connection_index, run_bytes) else {
                return false;
            };
            Some(run)
        } else {
            None
        };
        let request = &mut self.requests[index as usize];
        request.layout = layout;
        request.work = Work::Io {
            io,
            run,
            step: IoStep::Primary,
            received_bytes: 0,
        };
        self.set_step(index, step);
        if receive {
            self.take_payload(index, now);
        } else {
            self.begin_step(index, now);
        }
        true
    }

    /// The request's current step is ready for the device: it takes its place at the write
    /// gate first (once), then enters the scheduler.
    pub(super) fn begin_step(&mut self, index: u32, now: Nanos) {
        let request = &self.requests[index as usize];
        if let IoKind::Kv { .. } = request.io().kind {
            // Its payload is in: the table's machine decides its steps.
            self.kv_begin(index, now);
            return;
        }
        if request.gate == GatePlace::Outside
            && let Some(range) = self.write_range(request.io(), &request.layout)
        {
            let gate = self.namespaces.write_gate(request.io().namespace_index);
            let place = match gate.acquire(range) {
                Acquired::Granted(hold) => GatePlace::Holding(hold),
                Acquired::Waiting(hold) => GatePlace::Waiting(Some(hold)),
                Acquired::Full => GatePlace::Waiting(None),
            };
            self.requests[index as usize].gate = place;
            if let GatePlace::Waiting(_) = place {
                self.transition(index, RequestState::Overlapping);
                if self.gate_waits.waiting.is_empty() {
                    self.gate_waits.retry_at = now + GATE_RETRY_INTERVAL;
                }
                self.gate_waits.waiting.push_back(index);
                self.stats.gate_waits += 1;
                return;
            }
        }
        self.enqueue(index, now);
    }

    /// The sectors a request writes, with its edge sectors if it reads them first; `None`
    /// for requests that write nothing.
    #[inline]
    fn write_range(&self, io: IoRequest, layout: &Layout) -> Option<WriteRange> {
        if let IoKind::Read = io.kind {
            return None; // (The common case, answered inline, before any layout arithmetic.)
        }
        self.write_range_of_non_read(io, layout)
    }

    /// [`Self::write_range`] of a request that is not a READ.
    #[inline(never)]
    fn write_range_of_non_read(&self, io: IoRequest, layout: &Layout) -> Option<WriteRange> {
        let sector_bytes = self.namespaces.info(io.namespace_index).block_size;
        let edges = [Edge::Head, Edge::Tail].map(|edge| {
            layout
                .has_edge(edge)
                .then(|| layout.edge(edge).sector_offset_bytes)
        });
        let (start_bytes, end_bytes) = match io.kind {
            IoKind::Write { .. } | IoKind::WriteZeroes { .. } => {
                (layout.aligned_start(), layout.aligned_end())
            }
            IoKind::Trim { .. } if layout.inner_bytes() > 0 => {
                let start = layout.inner_start();
                (start, start + u64::from(layout.inner_bytes()))
            }
            // KV requests are ordered by the table's bucket gate instead (`core/kv.rs`).
            IoKind::Read
            | IoKind::Flush
            | IoKind::Trim { .. }
            | IoKind::BlockStatus { .. }
            | IoKind::Kv { .. } => {
                return None;
            }
        };
        let edges = match io.kind {
            IoKind::Trim { .. } => [None, None],
            _ => edges,
        };
        Some(WriteRange {
            start_bytes,
            end_bytes,
            edges,
            sector_bytes,
        })
    }

    /// Gives up the request's place at the gate (after its last write, or when it is freed).
    /// Inlined: most requests (every read) never take a place, and pay one comparison.
    #[inline]
    pub(super) fn leave_gate(&mut self, index: u32) {
        if self.requests[index as usize].gate != GatePlace::Outside {
            self.release_gate_place(index);
        }
    }

    /// [`Self::leave_gate`] for a request that has a place (or waits for one). Kept out of
    /// line (not cold: every WRITE calls it) so that `leave_gate` stays one comparison where
    /// it is inlined.
    #[inline(never)]
    fn release_gate_place(&mut self, index: u32) {
        let request = &mut self.requests[index as usize];
        let place = std::mem::replace(&mut request.gate, GatePlace::Outside);
        let hold = match place {
            GatePlace::Outside | GatePlace::Waiting(None) => return,
            GatePlace::Waiting(Some(hold)) | GatePlace::Holding(hold) => hold,
        };
        let io = request.io();
        let layout = request.layout;
        let Some(range) = self.write_range(io, &layout) else {
            panic!("a gate place for a request that writes nothing");
        };
        self.namespaces
            .write_gate(io.namespace_index)
            .release(hold, range);
        self.gate_waits.released = true;
    }

    /// Takes the oldest request waiting at the gate out of the queue (a shutdown refuses it).
    pub(super) fn take_gate_waiter(&mut self) -> Option<u32> {
        let index = self.gate_waits.waiting.pop_front()?;
        assert_eq!(
            self.requests[index as usize].state,
            RequestState::Overlapping
        );
        Some(index)
    }

    /// Whether requests wait at the gate and one of this thread's writes left it (the
    /// driver must not sleep then).
    pub(super) fn gate_retry_ready(&self) -> bool {
        self.gate_waits.released && !self.gate_waits.waiting.is_empty()
    }

    /// When the requests waiting at the gate ask again for other threads' releases.
    pub(super) fn gate_deadline(&self) -> Option<Nanos> {
        (!self.gate_waits.waiting.is_empty()).then_some(self.gate_waits.retry_at)
    }

    /// The waiting requests ask again, oldest first; those now allowed enter the scheduler.
    pub(super) fn retry_gate(&mut self, now: Nanos) {
        if self.gate_waits.waiting.is_empty()
            || !(self.gate_waits.released || now >= self.gate_waits.retry_at)
        {
            return;
        }
        self.gate_waits.released = false;
        self.gate_waits.retry_at = now + GATE_RETRY_INTERVAL;
        for _ in 0..self.gate_waits.waiting.len() {
            let Some(index) = self.gate_waits.waiting.pop_front() else {
                break;
            };
            let request = &self.requests[index as usize];
            assert_eq!(request.state, RequestState::Overlapping);
            let connection_index = request.connection_index;
            if !self.connections[connection_index as usize].is_open() {
                self.free_request(index);
                self.maybe_finish_close(connection_index);
                continue;
            }
            let io = request.io();
            let gate = self.namespaces.write_gate(io.namespace_index);
            let place = match request.gate {
                GatePlace::Waiting(Some(hold)) if gate.retry(hold) => GatePlace::Holding(hold),
                GatePlace::Waiting(Some(hold)) => GatePlace::Waiting(Some(hold)),
                GatePlace::Waiting(None) => {
                    let Some(range) = self.write_range(io, &request.layout) else {
                        panic!("waiting at the gate without writing");
                    };
                    match gate.acquire(range) {
                        Acquired::Granted(hold) => GatePlace::Holding(hold),
                        Acquired::Waiting(hold) => GatePlace::Waiting(Some(hold)),
                        Acquired::Full => GatePlace::Waiting(None),
                    }
                }
                other => panic!("a request waiting at the gate in {other:?}"),
            };
            self.requests[index as usize].gate = place;
            if let GatePlace::Holding(_) = place {
                self.enqueue(index, now);
            } else {
                self.gate_waits.waiting.push_back(index);
            }
        }
    }

    /// Takes the payload of the WRITE part the request is receiving: what the receive buffer
    /// holds is copied into the run, the rest is received straight into it. Once the part is
    /// whole, its first step begins.
    pub(super) fn take_payload(&mut self, index: u32, now: Nanos) {
        let request = &self.requests[index as usize];
        let Work::Io {
            io: _,
            run: Some(run),
            step,
            received_bytes,
        } = request.work
        else {
            panic!("payload for a request without a run");
        };
        let connection_index = request.connection_index;
        let (data_start, data_bytes, _) = self.receiving_span(index, step);
        let connection = &mut self.connections[connection_index as usize];
        let available = connection.recv_end - connection.recv_start;
        let wanted = (data_bytes - received_bytes) as usize;
        let copied = available.min(wanted);
        let start = (data_start + received_bytes) as usize;
        let target = &mut self.arena.run_mut(run, start + copied)[start..];
        target.copy_from_slice(
            &connection.recv_buffer[connection.recv_start..connection.recv_start + copied],
        );
        connection.recv_start += copied;
        if copied == wanted {
            self.set_received_bytes(index, data_bytes);
            self.part_payload_complete(index, now);
            return;
        }
        self.set_received_bytes(index, received_bytes + copied as u32);
        self.transition(index, RequestState::Receiving);
        let connection = &mut self.connections[connection_index as usize];
        connection.payload = Some(index);
        // The receive clock restarts: the client may have waited for the previous part.
        connection.receive_progress_at = now;
        if connection.read == ReadState::Closed {
            // Nothing more will arrive (a part after the first on a connection that stopped
            // reading): the request cannot finish.
            self.abort_connection(connection_index, "a WRITE payload cut short");
        } else {
            self.mark_parse(connection_index);
        }
    }

    /// A large WRITE's part is written: the next part's payload comes, then `step`.
    pub(super) fn receive_next_part(&mut self, index: u32, step: IoStep, now: Nanos) {
        self.set_step(index, step);
        self.set_received_bytes(index, 0);
        self.take_payload(index, now);
    }

    /// Where the payload being received lies in the request's run: `(first byte, bytes,
    /// whether it is the request's last part)`. A KV request's payload (key, then value) is
    /// one part placed so that its value starts on a block (`core/kv.rs`).
    fn receiving_span(&self, index: u32, step: IoStep) -> (u32, u32, bool) {
        let request = &self.requests[index as usize];
        let io = request.io();
        if let IoKind::Kv { .. } = io.kind {
            let (start, bytes) = Self::kv_payload_span(io);
            return (start, bytes, true);
        }
        let layout = request.layout;
        let part_index = layout.receiving_part(step);
        let part = layout.part(part_index);
        (
            part.data_start,
            part.data_bytes,
            part_index + 1 == layout.part_count(),
        )
    }

    fn set_received_bytes(&mut self, index: u32, bytes: u32) {
        match &mut self.requests[index as usize].work {
            Work::Io { received_bytes, .. } => *received_bytes = bytes,
            other => panic!("payload for a request without I/O: {other:?}"),
        }
    }

    /// Where the next payload bytes of a receiving WRITE go: the rest of its part in the run.
    pub(super) fn payload_space(&mut self, index: u32) -> &mut [u8] {
        let request = &self.requests[index as usize];
        assert_eq!(request.state, RequestState::Receiving);
        let Work::Io {
            io: _,
            run: Some(run),
            step,
            received_bytes,
        } = request.work
        else {
            panic!("receiving a payload without a run");
        };
        let (data_start, data_bytes, _) = self.receiving_span(index, step);
        assert!(received_bytes < data_bytes);
        let end = (data_start + data_bytes) as usize;
        let start = (data_start + received_bytes) as usize;
        &mut self.arena.run_mut(run, end)[start..]
    }

    /// `bytes` of payload landed in [`Self::payload_space`].
    pub(super) fn payload_received(&mut self, index: u32, bytes: usize, now: Nanos) {
        let request = &mut self.requests[index as usize];
        let Work::Io {
            io: _,
            step,
            received_bytes,
            ..
        } = request.work
        else {
            panic!("receiving a payload without I/O");
        };
        let (_, data_bytes, _) = self.receiving_span(index, step);
        let received_bytes = received_bytes + bytes as u32;
        assert!(received_bytes <= data_bytes);
        self.set_received_bytes(index, received_bytes);
        if received_bytes == data_bytes {
            self.part_payload_complete(index, now);
        }
    }

    /// A WRITE part's payload is whole: the stream moves on after the last part; the part
    /// goes to the device.
    fn part_payload_complete(&mut self, index: u32, now: Nanos) {
        let request = &self.requests[index as usize];
        let Work::Io { io: _, step, .. } = request.work else {
            panic!("a payload for a request without I/O");
        };
        let (_, _, last) = self.receiving_span(index, step);
        let request = &self.requests[index as usize];
        let connection = &mut self.connections[request.connection_index as usize];
        connection.payload = if last { None } else { Some(index) };
        self.begin_step(index, now);
    }

    /// A WRITE ends before its last part (an error): the payload still to come is skipped.
    pub(super) fn skip_rest_of_payload(&mut self, index: u32) {
        let request = &self.requests[index as usize];
        let Work::Io {
            io,
            step,
            received_bytes,
            ..
        } = request.work
        else {
            panic!("skipping the payload of a request without I/O");
        };
        let consumed = if let IoKind::Kv { .. } = io.kind {
            u64::from(received_bytes)
        } else {
            let layout = self.requests[index as usize].layout;
            let part = layout.part(layout.receiving_part(step));
            part.data_offset_bytes - io.offset_bytes + u64::from(received_bytes)
        };
        let remaining = u64::from(io.length_bytes) - consumed;
        let connection_index = request.connection_index;
        let connection = &mut self.connections[connection_index as usize];
        assert_eq!(connection.payload, Some(index));
        connection.payload = None;
        connection.skip_bytes += remaining;
        self.mark_parse(connection_index);
    }

    /// An edge sector was read: a WRITE merges the bytes it does not own around its payload,
    /// a WRITE_ZEROES zeroes the bytes it owns.
    pub(super) fn edge_read(&mut self, index: u32, edge: Edge) {
        let Work::Io {
            io, run: Some(run), ..
        } = self.requests[index as usize].work
        else {
            panic!("an edge read without a run");
        };
        let layout = self.requests[index as usize].layout;
        let bytes = self.arena.run_mut(run, run.size_bytes());
        match io.kind {
            IoKind::Write { .. } => steps::merge_edge(&layout, edge, bytes),
            IoKind::WriteZeroes { .. } => steps::zero_edge(&layout, edge, bytes),
            other => panic!("an edge read for {other:?}"),
        }
    }

    /// Sends part `part` of a READ from the run: the last part is its answer; an earlier one
    /// is sent and the request goes on with the next.
    pub(super) fn respond_read(&mut self, index: u32, part: u32, last: bool) {
        let request = &self.requests[index as usize];
        let Work::Io {
            io, run: Some(run), ..
        } = request.work
        else {
            panic!("READ data without a run");
        };
        let connection_index = request.connection_index;
        let data = request.layout.part(part);
        let piece = ReadPiece {
            offset_bytes: data.data_offset_bytes,
            length_bytes: data.data_bytes,
            first: part == 0,
            last,
        };
        let frontend = &mut self.connections[connection_index as usize].frontend;
        let exclusive = frontend.read_pieces_exclusive();
        let request = &mut self.requests[index as usize];
        let data_end = (data.data_start + data.data_bytes) as usize;
        let body = match &self.lent[index as usize] {
            Some(lent) => &lent.bytes()[data.data_start as usize..data_end],
            None => &self.arena.run(run, data_end)[data.data_start as usize..],
        };
        let Some((header_len, trailer_len)) = frontend.encode_read_answer(
            &request.tag,
            piece,
            body,
            &mut request.header,
            &mut request.trailer,
        ) else {
            self.transition(index, RequestState::Completed);
            self.free_request(index);
            self.abort_connection(connection_index, "a READ piece the protocol cannot carry");
            return;
        };
        request.header_len = header_len as u8;
        request.trailer_len = trailer_len as u8;
        request.work = if last {
            Work::Response {
                run: Some(run),
                body_start: data.data_start,
                body_bytes: data.data_bytes,
            }
        } else {
            Work::Part {
                io,
                run,
                part,
                body_start: data.data_start,
                body_bytes: data.data_bytes,
                exclusive,
            }
        };
        if last {
            // A composite namespace's read is measured on the member device its last piece
            // ran on, as its member tenant's: that device's calibration and figures see it.
            let (namespace_index, tenant_id) =
                if self.namespaces.composite(io.namespace_index).is_some() {
                    let request = &self.requests[index as usize];
                    (request.submitted.namespace_index, request.piece_tenant)
                } else {
                    (io.namespace_index, io.tenant.id)
                };
            let latency_critical = self.qos[usize::from(namespace_index)]
                .scheduler
                .tenant_class(reflex_qos::TenantId(tenant_id))
                == Some(reflex_qos::TenantClass::LatencyCritical);
            self.requests[index as usize].measured_read = Some((namespace_index, latency_critical));
            self.requests[index as usize].measured_tenant = tenant_id;
        }
        self.transition(index, RequestState::Completed);
        if last {
            self.stats.requests_answered += 1;
        }
        // A simple reply's later parts go before anything queued behind its first.
        let front = self.connections[connection_index as usize].stream_owner == index;
        self.queue_response(index, front);
    }

    /// A READ part (not the last) is out: with a simple reply, the connection now sends only
    /// this READ until its last part; the request reads the next part.
    pub(super) fn part_sent(&mut self, index: u32, now: Nanos) {
        let Work::Part {
            io,
            run,
            part,
            exclusive,
            ..
        } = self.requests[index as usize].work
        else {
            panic!("a part sent for a request that is not sending one");
        };
        let connection_index = self.requests[index as usize].connection_index;
        if exclusive {
            self.connections[connection_index as usize].stream_owner = index;
        }
        self.requests[index as usize].work = Work::Io {
            io,
            run: Some(run),
            step: IoStep::Transfer { part: part + 1 },
            received_bytes: 0,
        };
        self.refresh_operation(index);
        self.begin_step(index, now);
    }

    /// NBD BLOCK_STATUS: the device's allocation of the range, answered at once (a metadata
    /// query, not device I/O: it takes no scheduler turn). False when it must wait for a run.
    fn answer_block_status(&mut self, index: u32, io: IoRequest, req_one: bool) -> bool {
        let connection_index = self.requests[index as usize].connection_index;
        let Some(run) = self.allocate_run(connection_index, BLOCK_STATUS_BODY_BYTES_MAX) else {
            return false;
        };
        let extents_max = if req_one { 1 } else { BLOCK_STATUS_EXTENTS_MAX };
        let mut extents = std::mem::take(&mut self.extents);
        extents.clear();
        let length_bytes = u64::from(io.length_bytes);
        let known = match self.namespaces.device(io.namespace_index) {
            Some(device) => {
                device.block_status(io.offset_bytes, length_bytes, extents_max, &mut extents)
            }
            None => Err(reflex_flash::FlashError::Unsupported),
        };
        let covered: u64 = extents.iter().map(|extent| extent.length_bytes).sum();
        let valid = !extents.is_empty()
            && extents.len() <= extents_max
            && covered <= length_bytes
            && extents.iter().all(|extent| extent.length_bytes > 0);
        if known.is_err() || !valid {
            // Unknown allocation is reported as data, which is always true.
            extents.clear();
            extents.push(Extent {
                length_bytes,
                allocation: Allocation::Data,
            });
        }
        let frontend = &self.connections[connection_index as usize].frontend;
        let body = self.arena.run_mut(run, BLOCK_STATUS_BODY_BYTES_MAX);
        let body_bytes = frontend.write_block_status(&extents, body);
        self.extents = extents;
        self.respond(index, Answer::Ok, Some(run), body_bytes as u32);
        true
    }
}
