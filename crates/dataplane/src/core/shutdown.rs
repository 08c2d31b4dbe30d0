//! Shutdown in phases: listeners close; connections stop reading and close once their
//! in-flight requests are answered, except NBD sessions, which keep reading and answer new
//! requests ESHUTDOWN until then (the spec's graceful shutdown); then every device is flushed.
//!
//! Bounded, one `drain_timeout` per stage, so a shutdown takes at most three:
//! 1. at the drain deadline, requests still waiting in a QoS scheduler (a tenant in token
//!    debt, a device that takes no more), for room in a full tenant queue or at the write
//!    gate (behind an overlapping write) or the key-value table's bucket gate are answered
//!    [`Answer::ShuttingDown`] (native BUSY, NBD ESHUTDOWN; the original protocol, which has
//!    no status, closes), the answers are handed to the driver, and every connection that is
//!    still open is aborted;
//! 2. if a device still holds operations one drain timeout later, they are abandoned (logged;
//!    their requests stay orphaned, the driver must keep the arena alive rather than free it
//!    and may exit with those operations in flight), which releases the connections they
//!    held;
//! 3. every device is flushed; a flush not answered within one more drain timeout is given up
//!    (logged) and the shutdown finishes.
//!
//! Every phase that waits has a deadline in the future: [`Dataplane::next_deadline`] never
//! reports a passed one, so a driver never spins while nothing can happen.

use reflex_flash::FlashError;
use reflex_qos::Nanos;

use super::Dataplane;
use super::connection::ReadState;
use super::ops::{DeviceCommand, DeviceOpId, DeviceOpKind, Op};
use super::request::RequestState;
use crate::frontend::Answer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Running,
    /// Connections finish their requests; at `deadline` the next stage begins (`aborted`:
    /// waiting requests were refused and connections aborted; then devices are abandoned).
    Draining {
        deadline: Nanos,
        aborted: bool,
    },
    /// Every namespace's flush is in flight; at `deadline` they are given up.
    Flushing {
        deadline: Nanos,
    },
    Finished,
}

impl Dataplane {
    /// Starts the graceful shutdown (SIGTERM); [`Self::is_finished`] says when it is done.
    pub fn begin_shutdown(&mut self) {
        self.shutdown_requested = true;
    }

    /// Whether shutdown has drained every connection and flushed every device. The driver
    /// still waits for its own operations in flight (cancellations, closes) before it exits.
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    /// Device operations given up on at shutdown (the device never answered them: request
    /// operations and shutdown flushes): the driver must not free memory they may still
    /// write, nor wait for their completions.
    pub fn abandoned_device_operations(&self) -> u32 {
        if self.phase == Phase::Finished {
            // A key-value request still forwarded to the table's owner (which never answered)
            // lends its run to that thread: the arena must outlive it too.
            let forwarded = self.stats.requests_per_state[RequestState::Forwarded as usize];
            self.device_in_flight + self.flushes_pending + forwarded + self.kv_orphaned_at_owner
        } else {
            0
        }
    }

    /// Moves through the shutdown phases as far as their conditions allow.
    pub(super) fn advance_phase(&mut self, now: Nanos) {
        if matches!(self.phase, Phase::Running) && !self.shutdown_requested {
            return; // The common case, twice per `process`.
        }
        loop {
            let before = self.phase;
            self.advance_phase_once(now);
            if self.phase == before {
                return;
            }
        }
    }

    /// Whether [`Self::advance_phase`] would move on now (the driver must not sleep then).
    pub(super) fn phase_ready(&self) -> bool {
        match self.phase {
            Phase::Running => self.shutdown_requested,
            Phase::Draining { .. } => self.drained(),
            Phase::Flushing { .. } => self.flushes_pending == 0,
            Phase::Finished => false,
        }
    }

    fn drained(&self) -> bool {
        self.free_connections.len() == self.connections.len()
            && self.listeners.iter().all(|l| !l.accept_in_flight)
            && self.device_in_flight == 0
            && self.qos_queued == 0
            && self.blocked.is_empty()
            && self.migration.in_use() == 0
    }

    /// Whether reads of other threads may still be served here: while running or draining
    /// (the drain waits for them), not once waiting requests were refused, devices are being
    /// flushed or the thread finished (nothing would serve them then).
    pub(super) fn phase_accepts_migrated(&self) -> bool {
        matches!(
            self.phase,
            Phase::Running | Phase::Draining { aborted: false, .. }
        )
    }

    /// The deadline of the phase, when it waits for one: always after the `now` the phase
    /// was last advanced at (a passed deadline is acted on in that same call).
    pub(super) fn phase_deadline(&self) -> Option<Nanos> {
        match self.phase {
            Phase::Draining { deadline, .. } | Phase::Flushing { deadline } => Some(deadline),
            Phase::Running | Phase::Finished => None,
        }
    }

    fn advance_phase_once(&mut self, now: Nanos) {
        match self.phase {
            Phase::Running => {
                if self.shutdown_requested {
                    self.start_drain(now);
                }
            }
            Phase::Draining { deadline, aborted } => {
                if self.drained() {
                    self.start_flush(now);
                } else if now >= deadline && !aborted {
                    self.phase = Phase::Draining {
                        deadline: now + self.limits.drain_timeout,
                        aborted: true,
                    };
                    let refused = self.refuse_waiting_requests(now);
                    tracing::warn!(
                        thread = self.thread_index,
                        refused_requests = refused,
                        "drain timeout: requests still waiting for the device are refused \
                         (shutting down), connections that still have answers pending close"
                    );
                    // Answers the sockets take at once still reach their clients.
                    self.send_step(now);
                    for index in 0..self.connections.len() as u32 {
                        if self.connections[index as usize].is_open() {
                            self.abort_connection(index, "drain timeout");
                        }
                    }
                } else if now >= deadline {
                    let forwarded = self.stats.requests_per_state[RequestState::Forwarded as usize];
                    if self.device_in_flight > 0 || forwarded > 0 {
                        self.abandon_device_operations();
                    }
                    self.start_flush(now);
                }
            }
            Phase::Flushing { deadline } => {
                if self.flushes_pending == 0 {
                    self.phase = Phase::Finished;
                } else if now >= deadline {
                    tracing::error!(
                        thread = self.thread_index,
                        flushes = self.flushes_pending,
                        "devices never answered the shutdown flush; giving up"
                    );
                    self.phase = Phase::Finished;
                }
            }
            Phase::Finished => {}
        }
    }

    /// Answers [`Answer::ShuttingDown`] to every request that waits in a scheduler, for room
    /// in a full tenant queue or at the write gate (those of closing connections are freed).
    /// Returns how many were answered.
    fn refuse_waiting_requests(&mut self, now: Nanos) -> u32 {
        let mut tokens = Vec::new();
        let mut migrated = Vec::new();
        for namespace in &mut self.qos {
            namespace
                .scheduler
                .cancel_queued(&mut |_, token| tokens.push(token));
            namespace.fair.cancel_held(&mut |_, token| {
                if token & super::MIGRATED_TOKEN != 0 {
                    migrated.push(token);
                } else {
                    tokens.push(token);
                }
            });
        }
        // Reads of other threads go home with an error; their homes answer them.
        for token in migrated {
            self.cancel_migrated_here(token);
        }
        assert_eq!(
            tokens.len(),
            self.qos_queued as usize,
            "the schedulers held other requests than the dataplane queued"
        );
        self.qos_queued = 0;
        let mut refused = 0;
        for token in tokens {
            let index = self.queued_request(token);
            refused += self.refuse_waiting(index);
        }
        while let Some(index) = self.blocked.pop_front() {
            self.unblock(index);
            refused += self.refuse_waiting(index);
        }
        while let Some(index) = self.take_gate_waiter() {
            refused += self.refuse_waiting(index);
        }
        while let Some(index) = self.take_kv_waiter() {
            refused += self.refuse_waiting(index);
        }
        // The schedulers' room events have nothing left to retry.
        self.handle_scheduler_events(now);
        self.queue_room = false;
        refused
    }

    fn refuse_waiting(&mut self, index: u32) -> u32 {
        let connection_index = self.requests[index as usize].connection_index;
        if self.connections[connection_index as usize].is_open() {
            self.answer_io(index, Answer::ShuttingDown);
            1
        } else {
            self.free_request(index);
            self.maybe_finish_close(connection_index);
            0
        }
    }

    /// Gives up on the request operations the devices still hold (every connection was
    /// aborted one drain timeout ago): each request is orphaned, which releases its
    /// connection; a late completion frees it. So is a key-value request whose table step
    /// waits at the owner (behind an operation of a device that does not answer): its run
    /// stays lent to the owner until the owner's late answer frees it (`kv_next`).
    fn abandon_device_operations(&mut self) {
        let mut abandoned = 0u32;
        for index in 0..self.requests.len() as u32 {
            match self.requests[index as usize].state {
                RequestState::Submitted => {}
                RequestState::Forwarded => self.kv_orphaned_at_owner += 1,
                _ => continue,
            }
            abandoned += 1;
            self.transition(index, RequestState::Orphaned);
            let run_pages = self.requests[index as usize]
                .work
                .run()
                .map_or(0, |run| run.page_count());
            let connection_index = self.requests[index as usize].connection_index;
            let connection = &mut self.connections[connection_index as usize];
            assert!(
                !connection.is_open(),
                "a connection still open after the drain timeout"
            );
            connection.run_pages -= run_pages;
            connection.outstanding -= 1;
            self.maybe_finish_close(connection_index);
        }
        tracing::error!(
            thread = self.thread_index,
            device_operations = self.device_in_flight,
            requests = abandoned,
            "devices never answered; abandoning their operations"
        );
    }

    fn start_drain(&mut self, now: Nanos) {
        tracing::debug!(thread = self.thread_index, "draining");
        self.phase = Phase::Draining {
            deadline: now + self.limits.drain_timeout,
            aborted: false,
        };
        for index in 0..self.listeners.len() {
            let listener = &mut self.listeners[index];
            if !listener.closed {
                listener.closed = true;
                self.ops.push_back(Op::CloseListener {
                    listener: index as u32,
                });
            }
        }
        for index in 0..self.connections.len() as u32 {
            if !self.connections[index as usize].is_open() {
                continue;
            }
            let connection = &mut self.connections[index as usize];
            let keep_reading = connection.frontend.begin_shutdown();
            if keep_reading && connection.outstanding > 0 {
                // In-flight requests finish (a stalled one included); requests arriving
                // meanwhile are refused; the connection closes once nothing is outstanding
                // (`stop_reading_if_drained`).
                connection.read = ReadState::DrainReading;
                continue;
            }
            self.stop_reading(index);
            if let Some(request) = self.connections[index as usize].stalled.take() {
                self.free_request(request);
            }
            self.maybe_close_idle(index);
        }
    }

    /// Reads nothing more on a connection: cancels its receive (its completion closes the
    /// connection once idle) and forgets what was received but not parsed.
    pub(super) fn stop_reading(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        connection.read = ReadState::Closed;
        connection.recv_start = connection.recv_end;
        if connection.recv_in_flight {
            self.cancel_read_side(index);
        }
    }

    /// A draining connection that kept reading closes once everything it received is
    /// answered and sent. Returns whether it stopped.
    pub(super) fn stop_reading_if_drained(&mut self, index: u32) -> bool {
        let connection = &self.connections[index as usize];
        if !(connection.read == ReadState::DrainReading
            && connection.outstanding == 0
            && connection.stalled.is_none()
            && connection.payload.is_none())
        {
            return false;
        }
        self.stop_reading(index);
        self.maybe_close_idle(index);
        true
    }

    fn start_flush(&mut self, now: Nanos) {
        self.phase = Phase::Flushing {
            deadline: now + self.limits.drain_timeout,
        };
        for namespace_index in 0..self.namespaces.len() as u16 {
            if !self
                .queues_open
                .get(usize::from(namespace_index))
                .copied()
                .unwrap_or(false)
                || self.removal_flush_in_flight(namespace_index)
            {
                // Closed, or its removal's flush is in flight (and counted) already.
                continue;
            }
            self.flushes_pending += 1;
            self.ops.push_back(Op::Device(DeviceCommand {
                id: DeviceOpId::ShutdownFlush { namespace_index },
                namespace_index,
                queue: 0,
                kind: DeviceOpKind::Flush,
            }));
        }
    }

    pub(super) fn on_shutdown_flush(
        &mut self,
        namespace_index: u16,
        result: Result<u32, FlashError>,
    ) {
        assert!(self.flushes_pending > 0);
        self.flushes_pending -= 1;
        let removal = self.on_removal_flush(namespace_index);
        if let Err(error) = result {
            self.stats.flush_errors += 1;
            tracing::error!(
                namespace = self.namespaces.id(namespace_index),
                %error,
                "{} flush failed",
                if removal { "removed namespace's" } else { "shutdown" }
            );
        }
    }
}
