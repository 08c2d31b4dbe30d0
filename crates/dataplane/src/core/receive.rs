//! Step one of run to completion: received bytes become requests.
//!
//! A connection is parsed when it received bytes, when its window or the arena opened, or when
//! something it waited for changed. Parsing stops at the first thing the connection must wait
//! for: bytes (a receive is issued), a window place, a request slot or a buffer run (the
//! connection waits in `waiters`), or room in a full tenant queue.
//!
//! WRITE payloads: bytes already in the receive buffer are copied into the request's run and
//! the missing remainder is received straight into the run (no second copy), except for small
//! writes (header and payload within half the receive buffer), which are first gathered whole
//! in the receive buffer so that many small pipelined writes arrive in one receive. A WRITE
//! larger than one run arrives part by part, each part written before the next is received
//! (`core/io.rs`).
//!
//! Buffer runs are shared fairly ([`Dataplane::allocate_run`]): a connection may hold at most
//! a quarter of the arena, and the last eighth is kept for connections that hold little, so
//! that a client that never reads its answers, or that sends large WRITE headers and then
//! stalls, cannot take what the others need. Connections waiting for a run (or a request
//! slot) are served in the order they began to wait ([`Dataplane::wake_waiters`]), so a
//! connection that keeps sending large requests cannot take every freed run from one that
//! waits.

use reflex_flash::emu::class_from_ioprio;
use reflex_qos::Nanos;

use super::Dataplane;
use super::connection::ReadState;
use super::ops::{ConnectionId, Op};
use super::request::{NONE, RequestState, Work};
use crate::buffers::{PageRun, RUN_SIZE_MAX, order_for};
use crate::frontend::{
    Action, Answer, CONTROL_ANSWER_BYTES_MAX, Decoded, Frontend, IoKind, NOTICE_BODY_BYTES, Tag,
};

impl Dataplane {
    pub(super) fn parse_step(&mut self, now: Nanos) {
        if self.resources_freed {
            self.resources_freed = false;
            self.wake_waiters(now);
        }
        loop {
            while let Some(index) = self.parse_ready.pop_front() {
                self.connections[index as usize].in_parse_ready = false;
                self.parse_connection(index, now);
            }
            if self.tls_deliveries.is_empty() {
                break;
            }
            // Receives that TLS plaintext already decrypted satisfies.
            self.tls_deliver(now);
        }
    }

    /// Something was freed: the waiting connections try again, before any other connection
    /// is parsed and in the order they began to wait. One that got what it waited for and then
    /// waits again (for its next request) goes behind those still waiting for theirs; one that
    /// still waits for the same thing keeps its place. Finding 8: without this, a connection
    /// pipelining large requests took every freed run ahead of one that had waited longer
    /// (it was woken first, started its request, stalled on the next one and queued again
    /// before the other connection was parsed), so one client could starve another for as long
    /// as it kept sending.
    fn wake_waiters(&mut self, now: Nanos) {
        let mut woken = std::mem::take(&mut self.waiters_woken);
        let mut behind = std::mem::take(&mut self.waiters_behind);
        debug_assert!(woken.is_empty() && behind.is_empty());
        std::mem::swap(&mut woken, &mut self.waiters);
        for index in woken.drain(..) {
            let connection = &mut self.connections[index as usize];
            connection.in_waiters = false;
            let before = (connection.stalled, connection.outstanding);
            self.parse_connection(index, now);
            let connection = &self.connections[index as usize];
            if connection.in_waiters && (connection.stalled, connection.outstanding) != before {
                // It made progress and queued again at the tail: behind the rest.
                let last = self.waiters.pop_back();
                debug_assert_eq!(last, Some(index));
                behind.push(index);
            }
        }
        self.waiters.extend(behind.drain(..));
        self.waiters_woken = woken;
        self.waiters_behind = behind;
    }

    /// Starts a request that no command of the current parse asked for (a notice, an
    /// NVMe/TCP event's output); false when the connection must wait for a request slot or
    /// (stalled on it) for a buffer.
    fn start_unasked(&mut self, index: u32, tag: Tag, action: Action, now: Nanos) -> bool {
        if self.free_requests.is_empty() {
            self.add_waiter(index);
            return false;
        }
        let request = self.allocate_request(index, tag, action, now);
        if !self.try_start(request, now) {
            self.transition(request, RequestState::NeedBuffer);
            self.connections[index as usize].stalled = Some(request);
            self.add_waiter(index);
            return false;
        }
        true
    }

    fn parse_connection(&mut self, index: u32, now: Nanos) {
        loop {
            let connection = &mut self.connections[index as usize];
            if !connection.is_open() || connection.tls_starting {
                return; // (TLS starts once the answer before it has left.)
            }
            if let Some(request) = connection.stalled {
                if !self.try_start(request, now) {
                    self.add_waiter(index);
                    return;
                }
                self.connections[index as usize].stalled = None;
                continue;
            }
            if connection.read == ReadState::Closed
                && connection.recv_start == connection.recv_end
                && connection.payload.is_none()
            {
                self.maybe_close_idle(index);
                return;
            }
            if !connection.notices.is_empty()
                && connection.outstanding < self.limits.window
                && connection.read == ReadState::Open
            {
                // A RENEGOTIATE notice takes a request slot (and a window place) like a
                // response, so it waits where a request would.
                if !self.start_unasked(index, Frontend::notice_tag(), Action::Notice, now) {
                    return;
                }
                continue;
            }
            let connection = &mut self.connections[index as usize];
            if let Frontend::NvmeTcp(nvme) = &connection.frontend
                && nvme.has_output()
                && connection.outstanding < self.limits.window
                && connection.read == ReadState::Open
            {
                // Output no command of this parse asked for (an NVMe/TCP asynchronous
                // event's completion) goes out like a notice, though a receive is in flight.
                if !self.start_unasked(index, Tag::None, Action::Output, now) {
                    return;
                }
                continue;
            }
            if connection.recv_in_flight {
                // Nothing to parse until that receive completes.
                self.stop_reading_if_drained(index);
                return;
            }
            if connection.payload.is_some() {
                break; // A payload is being received into its run.
            }
            if connection.skip_bytes > 0 {
                let available = (connection.recv_end - connection.recv_start) as u64;
                let skipped = available.min(connection.skip_bytes);
                connection.recv_start += skipped as usize;
                connection.skip_bytes -= skipped;
                if connection.skip_bytes > 0 {
                    break;
                }
            }
            if connection.moving && !frontend_mid_command(&connection.frontend) {
                return; // It moves to another thread, which parses the rest (`handoff`).
            }
            if connection.outstanding >= self.limits.window {
                return; // Back-pressure: read nothing more until responses go out.
            }
            if connection.blocked_count > 0 {
                return; // Back-pressure: a tenant queue is full; wait for room.
            }
            if self.free_requests.is_empty() {
                self.add_waiter(index);
                return;
            }
            let connection = &mut self.connections[index as usize];
            if let (Frontend::NvmeTcp(nvme), Some(link)) =
                (&mut connection.frontend, connection.tls.as_mut())
                && nvme.awaits_tls_identity()
                && link.peer_name.is_some()
            {
                // An NVMe/TCP identity names a host and a subsystem, which Connect checks;
                // it is no tenant's name, so the link keeps none.
                nvme.tls_established(link.peer_name.take());
            }
            let unparsed = &connection.recv_buffer[connection.recv_start..connection.recv_end];
            let unparsed_bytes = unparsed.len();
            let decoded = connection.frontend.decode(unparsed, &self.namespaces);
            if connection.frontend.in_session() {
                // An NBD session in transmission is past its handshake even while idle.
                connection.established = true;
            }
            match decoded {
                Decoded::NeedMore => break,
                Decoded::StartTls { consumed_bytes } => {
                    let connection = &mut self.connections[index as usize];
                    connection.recv_start += consumed_bytes;
                    connection.tls_starting = true;
                    if connection.send_head == NONE && !connection.send_in_flight {
                        self.start_tls(index);
                    }
                    return;
                }
                Decoded::Consumed(count) => {
                    self.connections[index as usize].recv_start += count;
                }
                Decoded::Finish { consumed_bytes } => {
                    let connection = &mut self.connections[index as usize];
                    connection.recv_start += consumed_bytes;
                    connection.read = ReadState::Closed;
                    // Nothing after the end of the session is parsed.
                    connection.recv_start = connection.recv_end;
                    self.maybe_close_idle(index);
                    return;
                }
                Decoded::Close(reason) => {
                    // Broken framing: nothing after it can be parsed, but the requests
                    // received before it are still answered; then the connection closes.
                    self.stats.framing_errors += 1;
                    tracing::info!(
                        thread = self.thread_index,
                        source = ?self.connections[index as usize].source,
                        %reason,
                        "closing connection after its answers: bad request framing"
                    );
                    self.stop_reading(index);
                    let connection = &mut self.connections[index as usize];
                    connection.recv_start = connection.recv_end;
                    self.maybe_close_idle(index);
                    return;
                }
                Decoded::Request {
                    header_bytes,
                    payload_bytes,
                    tag,
                    action,
                } => {
                    // A small WRITE is gathered whole in the receive buffer first.
                    if let Action::Io(io) = action
                        && let IoKind::Write { .. } = io.kind
                    {
                        assert_eq!(payload_bytes, u64::from(io.length_bytes));
                        let total = header_bytes + io.length_bytes as usize;
                        // Gathering decodes the header again once the rest arrived; an
                        // NVMe/TCP decode takes state (finding 12), so it is never repeated.
                        if total > unparsed_bytes
                            && total <= self.write_gather_bytes_max()
                            && self.connections[index as usize]
                                .frontend
                                .decode_is_repeatable()
                        {
                            break;
                        }
                    }
                    let connection = &mut self.connections[index as usize];
                    if let Action::KvBind { .. } = action
                        && connection.outstanding > 0
                    {
                        // A KV BIND waits until every earlier request of its connection is
                        // answered: rebinding releases the old tenant's place on this thread,
                        // which its requests still in the scheduler need. Freed requests
                        // wake the waiters, so it is parsed again.
                        self.add_waiter(index);
                        return;
                    }
                    connection.recv_start += header_bytes;
                    // Established: a request that is not handshake output.
                    if action != Action::Output {
                        connection.established = true;
                    }
                    let action = match action {
                        Action::Io(io) => match self.charge(index, io, now) {
                            Ok(io) => Action::Io(io),
                            Err(answer) => Action::Reply(answer),
                        },
                        // Applied here, in decode order: every later request of the
                        // connection is charged to the new tenant, every earlier one to the
                        // old.
                        Action::KvBind { handle } => {
                            Action::Reply(self.kv_bind(index, handle, now))
                        }
                        other => other,
                    };
                    let request = self.allocate_request(index, tag, action, now);
                    if let Action::Reply(_) = action {
                        self.connections[index as usize].skip_bytes = payload_bytes;
                    }
                    if !self.try_start(request, now) {
                        self.transition(request, RequestState::NeedBuffer);
                        self.connections[index as usize].stalled = Some(request);
                        self.add_waiter(index);
                        return;
                    }
                }
            }
        }
        // The parser needs more bytes (or a payload is being received).
        let connection = &self.connections[index as usize];
        if connection.read == ReadState::Closed {
            self.maybe_close_idle(index);
        } else if !self.stop_reading_if_drained(index) {
            self.issue_recv(index);
        }
    }

    /// A WRITE whose header and payload fit in this many bytes is gathered whole in the receive
    /// buffer; a larger one has its missing part received straight into its run.
    pub(super) fn write_gather_bytes_max(&self) -> usize {
        self.limits.recv_buffer_bytes / 2
    }

    /// Takes a run of at least `size_bytes` for a request of `connection_index`, within the
    /// connection's fair share of the arena; `None`: wait.
    pub(super) fn allocate_run(
        &mut self,
        connection_index: u32,
        size_bytes: usize,
    ) -> Option<PageRun> {
        let order = order_for(size_bytes);
        let pages = 1u32 << order;
        let held = self.connections[connection_index as usize].run_pages;
        let free = self.pages.free_pages();
        let within_connection_max = held + pages <= self.limits.connection_pages_max;
        let plenty_left = free >= pages + self.limits.arena_reserve_pages;
        let holds_little = held + pages <= self.limits.connection_pages_share;
        if !(within_connection_max && (plenty_left || holds_little)) {
            self.stats.buffer_waits += 1;
            return None;
        }
        let Some(run) = self.pages.allocate(order) else {
            self.stats.buffer_waits += 1;
            return None;
        };
        self.connections[connection_index as usize].run_pages += pages;
        Some(run)
    }

    /// Gives a run back; `orphaned`: its connection stopped counting it already.
    pub(super) fn release_run(&mut self, connection_index: u32, run: PageRun, orphaned: bool) {
        self.pages.free(run);
        if !orphaned {
            let connection = &mut self.connections[connection_index as usize];
            assert!(connection.run_pages >= run.page_count());
            connection.run_pages -= run.page_count();
        }
    }

    /// Gives the request what it needs to start and moves it on; false when it must wait
    /// for a buffer run.
    pub(super) fn try_start(&mut self, index: u32, now: Nanos) -> bool {
        let Work::Start(action) = self.requests[index as usize].work else {
            panic!("starting a request that started already");
        };
        let connection_index = self.requests[index as usize].connection_index;
        match action {
            Action::Reply(answer) => {
                self.respond(index, answer, None, 0);
                true
            }
            Action::Hello { io_priority } => {
                // An unknown class or level keeps the default: the priority is a hint.
                if let Ok(class) = class_from_ioprio(io_priority) {
                    self.connections[connection_index as usize].device_queue =
                        class.submission_queue();
                }
                let size = Frontend::hello_body_size_max(&self.namespaces);
                let Some(run) = self.allocate_run(connection_index, size) else {
                    return false;
                };
                let window = self.limits.window;
                let body = self.arena.run_mut(run, size);
                let length = Frontend::write_hello_body(&self.namespaces, window, body);
                self.respond(index, Answer::Ok, Some(run), length as u32);
                true
            }
            Action::Control(request) => {
                let Some(run) = self.allocate_run(connection_index, CONTROL_ANSWER_BYTES_MAX)
                else {
                    return false;
                };
                let answer = self.control_request(connection_index, request, now);
                let body = self.arena.run_mut(run, CONTROL_ANSWER_BYTES_MAX);
                let (answer, length) = Frontend::write_control_answer(&answer, body);
                self.respond(index, answer, Some(run), length as u32);
                true
            }
            Action::Notice => {
                let Some(run) = self.allocate_run(connection_index, NOTICE_BODY_BYTES) else {
                    return false;
                };
                let Some(notice) = self.connections[connection_index as usize]
                    .notices
                    .pop_front()
                else {
                    panic!("a notice request without a pending notice");
                };
                let length =
                    Frontend::write_notice(&notice, self.arena.run_mut(run, NOTICE_BODY_BYTES));
                self.stats.notices_sent += 1;
                self.respond(index, Answer::Ok, Some(run), length as u32);
                true
            }
            Action::Output => {
                let pending = self.connections[connection_index as usize]
                    .frontend
                    .pending_output_bytes();
                assert!(pending > 0, "an output request without output");
                let size = pending.min(RUN_SIZE_MAX);
                let Some(run) = self.allocate_run(connection_index, size) else {
                    return false;
                };
                let out = self.arena.run_mut(run, size);
                let written = self.connections[connection_index as usize]
                    .frontend
                    .write_output(out);
                assert_eq!(written, size);
                self.respond(index, Answer::Ok, Some(run), written as u32);
                true
            }
            Action::Io(io) => self.start_io(index, io, now),
            // Turned into its answer at decode (above); kept whole for a caller that did not.
            Action::KvBind { handle } => {
                let answer = self.kv_bind(connection_index, handle, now);
                self.respond(index, answer, None, 0);
                true
            }
        }
    }

    pub(super) fn issue_recv(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if !connection.is_open()
            || connection.read == ReadState::Closed
            || connection.recv_in_flight
        {
            return;
        }
        if let Some(request) = connection.payload
            && self.requests[request as usize].state != RequestState::Receiving
        {
            return; // A large WRITE's run is at the device: its next part comes after.
        }
        let connection = &mut self.connections[index as usize];
        if connection.payload.is_none() {
            if connection.recv_start > 0 {
                connection
                    .recv_buffer
                    .copy_within(connection.recv_start..connection.recv_end, 0);
                connection.recv_end -= connection.recv_start;
                connection.recv_start = 0;
            }
            // Every unit the parser waits for fits in half the buffer (asserted at setup).
            assert!(
                connection.recv_end < connection.recv_buffer.len(),
                "receive buffer full while the parser needs more"
            );
        }
        connection.recv_in_flight = true;
        let id = connection.id(index);
        self.stats.receives += 1;
        if connection.tls.is_some() {
            self.tls_want_recv(index);
        } else {
            self.ops.push_back(Op::Recv { connection: id });
        }
    }

    /// Whether a connection has nothing to do: nothing outstanding or half-received, and its
    /// read side open with a plain receive in flight.
    fn is_idle(&self, index: u32) -> bool {
        let connection = &self.connections[index as usize];
        connection.is_open()
            && connection.read == ReadState::Open
            && connection.recv_in_flight
            && connection.tls.is_none()
            && !connection.parked
            && !connection.parking
            && !connection.moving
            && connection.outstanding == 0
            && connection.payload.is_none()
            && connection.stalled.is_none()
            && connection.skip_bytes == 0
            && connection.recv_start == connection.recv_end
            && connection.notices.is_empty()
    }

    /// Idle connections past `park_after` start parking: their receive is cancelled, and
    /// once it comes back cancelled they give their buffer back ([`Self::park`]).
    pub(super) fn park_idle_connections(&mut self, now: Nanos) {
        let Some(park_after) = self.limits.park_after else {
            return;
        };
        for index in 0..self.connections.len() as u32 {
            if !self.is_idle(index) {
                continue;
            }
            let connection = &mut self.connections[index as usize];
            if now.saturating_since(connection.receive_progress_at) < park_after {
                continue;
            }
            connection.parking = true;
            let id = connection.id(index);
            self.ops.push_back(Op::CancelRecv { connection: id });
        }
    }

    /// The receive of a parking connection came back cancelled: if it is still idle, its
    /// buffer goes back to the pool and it waits for readiness. Returns whether it parked.
    fn park(&mut self, index: u32) -> bool {
        let connection = &mut self.connections[index as usize];
        // `is_idle` wants the receive in flight; it just came back.
        connection.recv_in_flight = true;
        let idle = self.is_idle(index);
        let connection = &mut self.connections[index as usize];
        connection.recv_in_flight = false;
        if !idle {
            return false;
        }
        let buffer = std::mem::take(&mut connection.recv_buffer);
        connection.recv_start = 0;
        connection.recv_end = 0;
        connection.parked = true;
        connection.recv_in_flight = true;
        let id = connection.id(index);
        self.return_recv_buffer(buffer);
        self.stats.connections_parked += 1;
        self.ops.push_back(Op::WaitReadable { connection: id });
        true
    }

    /// A readiness wait finished: `Ok(())` the connection has bytes (or an end of stream) to
    /// read, `Err(errno)` it failed or was cancelled.
    pub fn handle_readable(&mut self, id: ConnectionId, result: Result<(), i32>, now: Nanos) {
        let _ = now;
        let index = self.connection_index(id);
        let connection = &mut self.connections[index as usize];
        assert!(connection.recv_in_flight && connection.parked);
        connection.recv_in_flight = false;
        let buffer = self.take_recv_buffer();
        let connection = &mut self.connections[index as usize];
        connection.recv_buffer = buffer;
        connection.parked = false;
        let move_cancelled = std::mem::take(&mut connection.move_cancelled);
        if !connection.is_open() {
            self.maybe_finish_close(index);
            return;
        }
        match result {
            Ok(()) => self.mark_parse(index),
            // Cancelled so that the connection can move (`handoff`).
            Err(libc::ECANCELED) if move_cancelled => self.mark_parse(index),
            Err(errno) if connection.read == ReadState::Open => {
                tracing::debug!(thread = self.thread_index, errno, "readiness wait failed");
                self.abort_connection(index, "readiness wait failed");
            }
            // Stopped reading (shutdown, a framing error): close once idle.
            Err(_) => self.maybe_close_idle(index),
        }
    }

    /// Where the receive the dataplane asked for on `id` puts its bytes: the free end of the
    /// receive buffer, or the rest of a WRITE payload's run.
    pub fn receive_space(&mut self, id: ConnectionId) -> &mut [u8] {
        let index = self.connection_index(id);
        if self.connections[index as usize].tls.is_some() {
            return self.tls_receive_space(index);
        }
        self.plain_receive_space(index)
    }

    /// [`Self::receive_space`] of the plaintext stream.
    pub(super) fn plain_receive_space(&mut self, index: u32) -> &mut [u8] {
        let connection = &self.connections[index as usize];
        assert!(connection.recv_in_flight, "receive space without a receive");
        if let Some(request_index) = connection.payload {
            return self.payload_space(request_index);
        }
        let connection = &mut self.connections[index as usize];
        &mut connection.recv_buffer[connection.recv_end..]
    }

    /// A receive finished: `Ok(n)` bytes landed in [`Self::receive_space`] (0: the peer
    /// closed its side), `Err(errno)`: it failed or was cancelled.
    pub fn handle_recv(&mut self, id: ConnectionId, result: Result<usize, i32>, now: Nanos) {
        let index = self.connection_index(id);
        if self.connections[index as usize].tls.is_some() {
            self.tls_handle_recv(index, result, now);
        } else {
            self.plain_handle_recv(index, result, now);
        }
    }

    /// [`Self::handle_recv`] of the plaintext stream.
    pub(super) fn plain_handle_recv(&mut self, index: u32, result: Result<usize, i32>, now: Nanos) {
        let connection = &mut self.connections[index as usize];
        assert!(connection.recv_in_flight);
        assert!(
            !connection.parked,
            "a receive completion for a parked connection"
        );
        connection.recv_in_flight = false;
        let move_cancelled = std::mem::take(&mut connection.move_cancelled);
        if move_cancelled && result == Err(libc::ECANCELED) && connection.is_open() {
            // Cancelled so that the connection can move (`handoff`).
            self.mark_parse(index);
            return;
        }
        let connection = &mut self.connections[index as usize];
        if std::mem::take(&mut connection.parking)
            && result == Err(libc::ECANCELED)
            && connection.is_open()
            && connection.read == ReadState::Open
        {
            if !self.park(index) {
                // Something came up meanwhile: receive again instead.
                self.mark_parse(index);
            }
            return;
        }
        let connection = &mut self.connections[index as usize];
        if !connection.is_open() || connection.read == ReadState::Closed {
            // Aborted, or stopped reading: what arrived is not parsed.
            if let Some(request) = connection.payload.take() {
                self.free_request(request);
            }
            if self.connections[index as usize].is_open() {
                self.maybe_close_idle(index);
            } else {
                self.maybe_finish_close(index);
            }
            return;
        }
        let received = match result {
            Err(errno) => {
                if errno != libc::ECONNRESET {
                    tracing::debug!(thread = self.thread_index, errno, "receive failed");
                }
                self.abort_connection(index, "receive error");
                return;
            }
            Ok(0) => {
                if connection.payload.is_some() {
                    self.abort_connection(index, "peer closed in the middle of a write payload");
                    return;
                }
                // The peer will send nothing more; answer what it sent, then close.
                connection.read = ReadState::Closed;
                self.mark_parse(index);
                return;
            }
            Ok(received) => received,
        };
        connection.receive_progress_at = now;
        self.stats.bytes_received += received as u64;
        if let Some(request_index) = connection.payload {
            self.payload_received(request_index, received, now);
        } else {
            connection.recv_end += received;
            assert!(connection.recv_end <= connection.recv_buffer.len());
        }
        self.mark_parse(index);
    }
}

/// The front end has started something only more decoding finishes (an NVMe/TCP command's
/// data PDUs after an R2T, the pieces of a trim): a moving connection keeps being parsed
/// until it is between commands.
pub(super) fn frontend_mid_command(frontend: &Frontend) -> bool {
    match frontend {
        Frontend::NvmeTcp(nvme) => !nvme.is_between_commands(),
        _ => false,
    }
}
