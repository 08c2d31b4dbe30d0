//! Answers: a finished request's header is encoded by its front end and the request joins its
//! connection's send queue; one gathered send per connection carries many responses, header
//! bytes and data runs alike (no copy between a device buffer and the socket).
//!
//! A connection has at most one send in flight. A partial send leaves the unsent responses in
//! the queue with the offset into the first one; they go again in the next send.
//!
//! A large READ is answered in parts (`core/io.rs`): a part that is not the last is sent like
//! a response, and once it is out the request reads the next part instead of being freed.
//! When the parts form one NBD simple reply (`Work::Part { exclusive: true }`), a gathered send
//! ends after such a part, and from then on only the READ's next part may go
//! (`Connection::stream_owner`; it is queued at the head) until its last.

use reflex_qos::Nanos;

use super::Dataplane;
use super::ops::{ConnectionId, Op};
use super::request::{NONE, RequestState, Work};
use crate::buffers::PageRun;
use crate::frontend::{Answer, Tag};

/// Slices in one gathered send: 64 responses of a header and a body (the scheduler's batch),
/// fewer with trailers.
pub const SEND_SEGMENTS_MAX: usize = 129;
/// Segments one response may take: its header, its body and its trailer (NVMe/TCP: a read's
/// data digest and the response capsule after the data).
const SEGMENTS_PER_RESPONSE: usize = 3;

const _: () = assert!(SEND_SEGMENTS_MAX >= SEGMENTS_PER_RESPONSE);
const _: () = assert!(SEND_SEGMENTS_MAX.is_multiple_of(SEGMENTS_PER_RESPONSE));
const _: () = assert!(SEND_SEGMENTS_MAX <= 1024); // IOV_MAX

impl Dataplane {
    /// Encodes the response header for `answer` and queues the request for sending, with
    /// `body_bytes` of `run` after the header (the run is freed with the request).
    pub(super) fn respond(
        &mut self,
        index: u32,
        answer: Answer,
        run: Option<PageRun>,
        body_bytes: u32,
    ) {
        self.respond_from(index, answer, run, 0, body_bytes);
    }

    /// [`Self::respond`] with a body that starts `body_start` bytes into the run (a KV GET's
    /// value, after the bucket block and the key).
    pub(super) fn respond_from(
        &mut self,
        index: u32,
        answer: Answer,
        run: Option<PageRun>,
        body_start: u32,
        body_bytes: u32,
    ) {
        let connection_index = self.requests[index as usize].connection_index;
        let frontend = &mut self.connections[connection_index as usize].frontend;
        let request = &mut self.requests[index as usize];
        match run {
            Some(run) => assert!((body_start + body_bytes) as usize <= run.size_bytes()),
            None => assert_eq!(body_start + body_bytes, 0),
        }
        request.work = Work::Response {
            run,
            body_start,
            body_bytes,
        };
        let tag = request.tag;
        let Some((header_len, trailer_len)) = frontend.encode_answer(
            &tag,
            answer,
            body_bytes,
            &mut request.header,
            &mut request.trailer,
        ) else {
            tracing::warn!(
                thread = self.thread_index,
                ?answer,
                "request failed on a protocol without status; closing the connection"
            );
            self.transition(index, RequestState::Completed);
            self.free_request(index);
            self.abort_connection(connection_index, "failure the protocol cannot report");
            return;
        };
        request.header_len = header_len as u8;
        request.trailer_len = trailer_len as u8;
        self.transition(index, RequestState::Completed);
        self.stats.requests_answered += 1;
        if self.requests[index as usize].response_len() == 0 {
            // Nothing to send: a part of a request the protocol answers once for all its
            // parts (an NVMe/TCP command whose data came in several PDUs, or a range of a
            // Dataset Management command), answered by the last part to finish.
            self.free_request(index);
            return;
        }
        self.queue_response(index, false);
    }

    /// Puts a completed request on its connection's send queue: at the tail, or at the head
    /// (`front`: the next part of the simple reply being streamed, which nothing may precede).
    pub(super) fn queue_response(&mut self, index: u32, front: bool) {
        assert_eq!(self.requests[index as usize].state, RequestState::Completed);
        let connection_index = self.requests[index as usize].connection_index;
        if self.requests[index as usize].tag != Tag::None
            && self.connections[connection_index as usize]
                .frontend
                .answers_dropped()
        {
            // Finding 11: an answer finished after an NVMe/TCP C2HTermReq was queued would
            // follow it on the wire; it is dropped (the TermReq itself, protocol output
            // without a tag, is not).
            self.free_request(index);
            return;
        }
        let connection = &mut self.connections[connection_index as usize];
        if front {
            assert!(
                !connection.send_in_flight && connection.send_offset_bytes == 0,
                "a streamed reply's next part behind a send in progress"
            );
            self.requests[index as usize].next = connection.send_head;
            connection.send_head = index;
            if connection.send_tail == NONE {
                connection.send_tail = index;
            }
        } else {
            if connection.send_tail == NONE {
                connection.send_head = index;
            } else {
                self.requests[connection.send_tail as usize].next = index;
            }
            connection.send_tail = index;
        }
        self.mark_send(connection_index);
    }

    pub(super) fn send_step(&mut self, now: Nanos) {
        while let Some(index) = self.send_ready.pop_front() {
            self.connections[index as usize].in_send_ready = false;
            self.send_connection(index, now);
        }
    }

    /// Starts one gathered send of the queued responses (as many as fit in
    /// [`SEND_SEGMENTS_MAX`]).
    fn send_connection(&mut self, index: u32, now: Nanos) {
        let connection = &mut self.connections[index as usize];
        if !connection.is_open() || connection.send_in_flight || connection.send_head == NONE {
            return;
        }
        if connection.stream_owner != NONE && connection.send_head != connection.stream_owner {
            return; // A simple reply is being streamed: its next part goes first.
        }
        let mut segments = 0;
        let mut sending_count = 0;
        let mut cursor = connection.send_head;
        while cursor != NONE {
            let request = &mut self.requests[cursor as usize];
            assert_eq!(request.state, RequestState::Completed);
            let request_segments = request.response_segments();
            assert!((1..=SEGMENTS_PER_RESPONSE).contains(&request_segments));
            if segments + request_segments > SEND_SEGMENTS_MAX {
                break;
            }
            segments += request_segments;
            request.state = RequestState::Sending;
            self.stats.requests_per_state[RequestState::Completed as usize] -= 1;
            self.stats.requests_per_state[RequestState::Sending as usize] += 1;
            self.stats.transitions += 1;
            sending_count += 1;
            cursor = request.next;
            if let Work::Part {
                exclusive: true, ..
            } = request.work
            {
                // Nothing may follow a streamed part but the stream's next part.
                break;
            }
        }
        assert!(sending_count > 0);
        if connection.send_offset_bytes == 0 {
            // The send-progress clock restarts with each send that starts on a response
            // boundary; a send that resumes a partial one keeps the clock of the last progress.
            connection.send_progress_at = now;
        }
        connection.sending_count = sending_count;
        connection.send_in_flight = true;
        let id = connection.id(index);
        if connection.tls.is_some() {
            self.tls_inner_send(index, now);
        } else {
            self.stats.sends += 1;
            self.ops.push_back(Op::Send { connection: id });
        }
    }

    /// The bytes of the send the dataplane asked for on `id`, in order (at most
    /// [`SEND_SEGMENTS_MAX`] non-empty slices). They stay valid and unchanged until
    /// [`Self::handle_sent`].
    pub fn send_segments(&self, id: ConnectionId, segment: impl FnMut(&[u8])) {
        let index = self.connection_index(id);
        if self.connections[index as usize].tls.is_some() {
            self.tls_send_segments(index, segment);
        } else {
            self.plain_send_segments(index, segment);
        }
    }

    /// [`Self::send_segments`] of the plaintext stream.
    pub(super) fn plain_send_segments<'a>(&'a self, index: u32, mut segment: impl FnMut(&'a [u8])) {
        let connection = &self.connections[index as usize];
        assert!(connection.send_in_flight, "send segments without a send");
        let mut skip = connection.send_offset_bytes;
        let mut cursor = connection.send_head;
        for _ in 0..connection.sending_count {
            let request = &self.requests[cursor as usize];
            assert_eq!(request.state, RequestState::Sending);
            let header_len = usize::from(request.header_len);
            if skip < header_len {
                segment(&request.header[skip..header_len]);
                skip = 0;
            } else {
                skip -= header_len;
            }
            if let Some((run, body_start, body_bytes)) = request.work.body() {
                if skip < body_bytes as usize {
                    let end = (body_start + body_bytes) as usize;
                    let body = match &self.lent[cursor as usize] {
                        Some(lent) => &lent.bytes()[..end],
                        None => self.arena.run(run, end),
                    };
                    segment(&body[body_start as usize + skip..]);
                    skip = 0;
                } else {
                    skip -= body_bytes as usize;
                }
            }
            let trailer_len = usize::from(request.trailer_len);
            if trailer_len > 0 {
                assert!(skip < trailer_len);
                segment(&request.trailer[skip..trailer_len]);
            }
            skip = 0;
            cursor = request.next;
        }
    }

    /// A READ's answer has left: its latency, from its arrival off the socket to now, goes
    /// into its namespace's histograms; a latency-critical one's also from its submission.
    fn measure_sent(&mut self, index: u32, now: Nanos) {
        let request = &self.requests[index as usize];
        let Some((namespace_index, latency_critical)) = request.measured_read else {
            return;
        };
        let latency_us = now.saturating_since(request.arrived_at).0 / 1_000;
        let tenant = request.measured_tenant as usize;
        if let Some(account) = self.qos[usize::from(namespace_index)]
            .accounts
            .get_mut(tenant)
        {
            account.read_latency.record_us(latency_us);
        }
        let telemetry = &mut self.telemetry[usize::from(namespace_index)];
        telemetry.reads.record_us(latency_us);
        if latency_critical {
            telemetry.window.lc_reads.record_us(latency_us);
            let service_us = now.saturating_since(request.submitted_at).0 / 1_000;
            telemetry.window.lc_reads_service.record_us(service_us);
        }
        let connection_index = request.connection_index;
        self.note_read_answered(connection_index, namespace_index, latency_critical, now);
    }

    /// A send finished: `Ok(n)` bytes of [`Self::send_segments`] went out, `Err(errno)`: it
    /// failed or was cancelled.
    pub fn handle_sent(&mut self, id: ConnectionId, result: Result<usize, i32>, now: Nanos) {
        let index = self.connection_index(id);
        if self.connections[index as usize].tls.is_some() {
            self.tls_handle_sent(index, result, now);
        } else {
            self.plain_handle_sent(index, result, now);
        }
        self.return_loans();
    }

    /// [`Self::handle_sent`] of the plaintext stream.
    pub(super) fn plain_handle_sent(&mut self, index: u32, result: Result<usize, i32>, now: Nanos) {
        let connection = &mut self.connections[index as usize];
        assert!(connection.send_in_flight);
        connection.send_in_flight = false;
        let sent = *result.as_ref().unwrap_or(&0);
        if sent > 0 {
            connection.send_progress_at = now;
            self.stats.bytes_sent += sent as u64;
        }
        let mut progress = connection.send_offset_bytes + sent;
        let sending_count = std::mem::take(&mut connection.sending_count);
        connection.send_offset_bytes = 0;
        for _ in 0..sending_count {
            let connection = &mut self.connections[index as usize];
            let head = connection.send_head;
            assert_ne!(head, NONE);
            let total = self.requests[head as usize].response_len();
            if progress >= total {
                progress -= total;
                connection.send_head = self.requests[head as usize].next;
                if connection.send_head == NONE {
                    connection.send_tail = NONE;
                }
                self.requests[head as usize].next = NONE;
                if matches!(self.requests[head as usize].work, Work::Part { .. })
                    && self.connections[index as usize].is_open()
                {
                    // A part of a large READ is out: the request reads the next one.
                    self.part_sent(head, now);
                } else {
                    self.measure_sent(head, now);
                    self.free_request(head);
                }
            } else {
                // Partial progress: the rest of this response and those after it go again.
                self.connections[index as usize].send_offset_bytes = progress;
                progress = 0;
                let mut cursor = head;
                while cursor != NONE
                    && self.requests[cursor as usize].state == RequestState::Sending
                {
                    self.transition(cursor, RequestState::Completed);
                    cursor = self.requests[cursor as usize].next;
                }
                break;
            }
        }
        assert_eq!(
            progress, 0,
            "the driver reported more bytes sent than were queued"
        );
        if !self.connections[index as usize].is_open() {
            self.drop_send_queue(index);
            self.maybe_finish_close(index);
            return;
        }
        match result {
            Err(errno) => {
                if errno != libc::EPIPE && errno != libc::ECONNRESET {
                    tracing::debug!(thread = self.thread_index, errno, "send failed");
                }
                self.abort_connection(index, "send error");
                return;
            }
            Ok(0) => {
                self.abort_connection(index, "send made no progress");
                return;
            }
            Ok(_) => {}
        }
        let connection = &self.connections[index as usize];
        if connection.send_head != NONE {
            self.mark_send(index);
        } else if connection.tls_starting {
            // NBD's STARTTLS: its ACK left in plaintext; TLS from here on.
            self.start_tls(index);
        }
        self.maybe_close_idle(index);
    }
}
