//! Shutdown in phases: listeners close; connections stop reading and close once their
//! in-flight requests are answered, except NBD sessions, which keep reading and answer new
//! requests ESHUTDOWN until then (the spec's graceful shutdown); then every device is flushed.
//!
//! Bounded: after `drain_timeout` the connections that still have answers pending are
//! aborted; whatever still waits one more `drain_timeout` later (operations a device never
//! answered, requests queued behind them) is abandoned, and a shutdown flush that a device
//! never answers is abandoned after `drain_timeout` too (logged; the driver must then keep
//! the arena alive rather than free it, and may exit with the device's operations in flight).

use reflex_flash::FlashError;
use reflex_qos::Nanos;

use super::Dataplane;
use super::connection::ReadState;
use super::ops::{DeviceCommand, DeviceOpId, DeviceOpKind, Op};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Running,
    Draining { deadline: Nanos, aborted: bool },
    Flushing { deadline: Nanos },
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

    /// Device operations given up on at shutdown (the device never answered them): the
    /// driver must not free memory they may still write.
    pub fn abandoned_device_operations(&self) -> u32 {
        if self.phase == Phase::Finished {
            self.device_in_flight + self.flushes_pending
        } else {
            0
        }
    }

    /// Moves through the shutdown phases as far as their conditions allow.
    pub(super) fn advance_phase(&mut self, now: Nanos) {
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
                    tracing::warn!(
                        thread = self.thread_index,
                        "drain timeout: closing connections that still have answers pending"
                    );
                    self.phase = Phase::Draining {
                        deadline: now + self.limits.drain_timeout,
                        aborted: true,
                    };
                    for index in 0..self.connections.len() as u32 {
                        if self.connections[index as usize].is_open() {
                            self.abort_connection(index, "drain timeout");
                        }
                    }
                } else if now >= deadline {
                    let closing = self.connections.len() - self.free_connections.len();
                    tracing::error!(
                        thread = self.thread_index,
                        device_operations = self.device_in_flight,
                        queued = self.qos_queued + self.blocked.len() as u32,
                        connections = closing,
                        "shutdown cannot finish: abandoning what devices never answered"
                    );
                    self.phase = Phase::Finished;
                }
            }
            Phase::Flushing { deadline } => {
                if self.flushes_pending == 0 {
                    self.phase = Phase::Finished;
                } else if now >= deadline {
                    tracing::error!(
                        thread = self.thread_index,
                        flushes = self.flushes_pending,
                        "a device never answered its shutdown flush: abandoning it"
                    );
                    self.phase = Phase::Finished;
                }
            }
            Phase::Finished => {}
        }
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
        if let Err(error) = result {
            self.stats.flush_errors += 1;
            tracing::error!(
                namespace = self.namespaces.id(namespace_index),
                %error,
                "shutdown flush failed"
            );
        }
    }
}
