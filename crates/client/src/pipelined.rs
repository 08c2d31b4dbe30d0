//! The pipelined API: submit many requests under ids of the caller's choosing, then reap
//! completions in whatever order the server finishes them.
//!
//! It suits an event loop: [`PipelinedClient::poll_io`] never blocks (it sends what the socket
//! takes and receives what has arrived), the file descriptor can be registered with epoll
//! (readable always, writable while [`PipelinedClient::wants_write`]), and
//! [`PipelinedClient::reap`] hands out buffered completions without I/O. For simple callers
//! [`PipelinedClient::wait`] blocks until at least one completion is buffered. RENEGOTIATE
//! notices come out of `reap` like completions ([`Completion::is_notice`],
//! [`Completion::notice`]).
//!
//! Reconnecting ([`ClientOptions::reconnect`]): the I/O calls (`poll_io`, `wait`,
//! `flush_transmit`, and [`PipelinedClient::reconnect`] on the caller's own deadline) repair
//! a connection that ended or failed, blocking for as long as the policy allows. Answers that
//! arrived before the break are kept and reaped first; READ, FLUSH and BIND requests left
//! unanswered are submitted again under the same ids (as the new window allows); then `reap`
//! returns [`ClientError::OutcomeUnknown`] once, naming the WRITE, TRIM, REGISTER and
//! UNREGISTER requests left unanswered, and goes on with the new connection's answers. When
//! reconnecting fails, the I/O call returns [`ClientError::ReconnectGaveUp`] or
//! [`ClientError::TenantLost`] naming every request that will not be answered; submits fail
//! with [`SubmitError::Disconnected`] until an I/O call connects again. The socket changes
//! with each reconnect ([`PipelinedClient::reconnect_count`]): an epoll loop registers the
//! new descriptor. A server timeout is not a break here (the caller owns its deadlines).

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use reflex_proto::native::Opcode;

use crate::core::{Completion, ConnectionCore, InterruptedRequest};
use crate::driver::{ClientOptions, Outage, ReconnectFailure, Reconnector, StreamDriver};
use crate::error::{ClientError, SubmitError};
use crate::types::Capabilities;

/// A connection with many requests in flight.
pub struct PipelinedClient {
    driver: StreamDriver,
    capabilities: Capabilities,
    /// Present when reconnecting is on.
    reconnector: Option<Reconnector>,
    /// False once reconnecting gave up: the next I/O call connects first.
    connected: bool,
    /// Answers and reports from before a reconnect, which `reap` hands out before anything
    /// of the current connection.
    carried: VecDeque<Carried>,
    /// The carried answer `reap` lent last.
    lent: Option<OwnedCompletion>,
    /// Interrupted requests to repeat once the new connection's window has room, in the
    /// order they were first submitted.
    repeat_backlog: VecDeque<InterruptedRequest>,
}

/// What a reconnect leaves for `reap`.
#[derive(Debug)]
enum Carried {
    Answer(OwnedCompletion),
    OutcomeUnknown(Vec<InterruptedRequest>),
}

/// A [`Completion`] copied out of a core that is going away.
#[derive(Debug)]
struct OwnedCompletion {
    request_id: u64,
    opcode: Opcode,
    status_raw: u16,
    data: Vec<u8>,
}

impl OwnedCompletion {
    fn of(completion: &Completion<'_>) -> OwnedCompletion {
        OwnedCompletion {
            request_id: completion.request_id,
            opcode: completion.opcode,
            status_raw: completion.status_raw,
            data: completion.data.to_vec(),
        }
    }

    fn as_completion(&self) -> Completion<'_> {
        Completion {
            request_id: self.request_id,
            opcode: self.opcode,
            status_raw: self.status_raw,
            data: &self.data,
        }
    }
}

impl PipelinedClient {
    /// Connects and performs HELLO, exactly as [`crate::Client::connect`].
    pub fn connect(addr: impl ToSocketAddrs) -> Result<PipelinedClient, ClientError> {
        PipelinedClient::connect_with(addr, &ClientOptions::default())
    }

    pub fn connect_with(
        addr: impl ToSocketAddrs,
        options: &ClientOptions,
    ) -> Result<PipelinedClient, ClientError> {
        let (driver, capabilities, reconnector) = StreamDriver::connect(addr, options)?;
        Ok(PipelinedClient::from_parts(
            driver,
            capabilities,
            reconnector,
            true,
        ))
    }

    pub(crate) fn from_parts(
        driver: StreamDriver,
        capabilities: Capabilities,
        reconnector: Option<Reconnector>,
        connected: bool,
    ) -> PipelinedClient {
        PipelinedClient {
            driver,
            capabilities,
            reconnector,
            connected,
            carried: VecDeque::new(),
            lent: None,
            repeat_backlog: VecDeque::new(),
        }
    }

    pub fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    /// Requests that may be outstanding at once.
    pub fn window(&self) -> u32 {
        self.driver.core.window()
    }

    /// Requests submitted and not answered yet, counting those waiting to be repeated after
    /// a reconnect.
    pub fn outstanding_count(&self) -> usize {
        self.driver.core.outstanding_count() + self.repeat_backlog.len()
    }

    /// Connections made after the first one; each has its own socket.
    pub fn reconnect_count(&self) -> u64 {
        self.reconnector
            .as_ref()
            .map_or(0, |reconnector| reconnector.reconnects)
    }

    /// Whether submitted bytes still wait for the socket (register for writability).
    pub fn wants_write(&self) -> bool {
        self.driver.core.transmit_pending_bytes() > 0
    }

    pub fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        self.driver.stream().peer_addr()
    }

    /// The connection core, for inspection.
    pub fn core(&self) -> &ConnectionCore {
        &self.driver.core
    }

    /// The connected socket (non-blocking, TCP_NODELAY) and its core after HELLO, for event
    /// loops that drive the core with their own I/O (io_uring in `reflex bench`). Nothing is
    /// lent at this point, so the caller may start with `transmit_start`/`receive_start`.
    pub fn into_parts(self) -> (TcpStream, ConnectionCore, Capabilities) {
        assert!(
            self.carried.is_empty() && self.repeat_backlog.is_empty(),
            "reap what a reconnect left before taking the connection apart"
        );
        let (stream, core) = self.driver.into_parts();
        (stream, core, self.capabilities)
    }

    // ----- submit: queue only; bytes move in poll_io / wait -----

    pub fn submit_read(
        &mut self,
        request_id: u64,
        namespace: u32,
        offset: u64,
        length_bytes: u32,
    ) -> Result<(), SubmitError> {
        self.driver
            .core
            .submit_read(request_id, namespace, offset, length_bytes)
    }

    pub fn submit_write(
        &mut self,
        request_id: u64,
        namespace: u32,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> Result<(), SubmitError> {
        self.driver
            .core
            .submit_write(request_id, namespace, offset, data, fua)
    }

    /// A WRITE whose payload `fill` writes in place (see
    /// [`ConnectionCore::submit_write_with`]).
    pub fn submit_write_with(
        &mut self,
        request_id: u64,
        namespace: u32,
        offset: u64,
        length_bytes: u32,
        fua: bool,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<(), SubmitError> {
        self.driver
            .core
            .submit_write_with(request_id, namespace, offset, length_bytes, fua, fill)
    }

    pub fn submit_flush(&mut self, request_id: u64, namespace: u32) -> Result<(), SubmitError> {
        self.driver.core.submit_flush(request_id, namespace)
    }

    pub fn submit_trim(
        &mut self,
        request_id: u64,
        namespace: u32,
        offset: u64,
        length_bytes: u32,
    ) -> Result<(), SubmitError> {
        self.driver
            .core
            .submit_trim(request_id, namespace, offset, length_bytes)
    }

    /// A REGISTER; its completion's [`Completion::tenant_handle`] is the handle.
    pub fn submit_register(
        &mut self,
        request_id: u64,
        body: &reflex_proto::native::RegisterBody,
    ) -> Result<(), SubmitError> {
        self.driver.core.submit_register(request_id, body)
    }

    pub fn submit_unregister(&mut self, request_id: u64, handle: u64) -> Result<(), SubmitError> {
        self.driver.core.submit_unregister(request_id, handle)
    }

    /// A BIND: requests submitted after it are charged to `handle` (0: the default tenant).
    pub fn submit_bind(&mut self, request_id: u64, handle: u64) -> Result<(), SubmitError> {
        self.driver.core.submit_bind(request_id, handle)
    }

    /// A REPORT of what this connection's latency-critical tenant measured (answered OK).
    pub fn submit_report(
        &mut self,
        request_id: u64,
        report: &reflex_proto::native::ReportBody,
    ) -> Result<(), SubmitError> {
        self.driver.core.submit_report(request_id, report)
    }

    // ----- I/O and completions -----

    /// Sends what the socket takes and receives what has arrived, without blocking (except
    /// to reconnect, with a policy). Returns whether any byte moved. Without a policy,
    /// `Err(Closed)` on calls after the server closed; responses buffered before that can
    /// still be reaped.
    pub fn poll_io(&mut self) -> Result<bool, ClientError> {
        if self.reconnector.is_none() {
            return self.driver.pump();
        }
        let mut outage = None;
        self.ensure_connected(&mut outage)?;
        match self.driver.pump() {
            Ok(progress) if !self.driver.is_closed() => Ok(progress),
            Ok(_) => self
                .recover(ClientError::Closed, &mut outage)
                .map(|()| true),
            Err(error) => self.recover(error, &mut outage).map(|()| true),
        }
    }

    /// The next completion, without I/O; `None` when none is buffered. After a reconnect:
    /// first the answers that arrived before the break, then, once,
    /// `Err(ClientError::OutcomeUnknown)` naming the requests not repeated (the client stays
    /// usable: keep reaping), then the new connection's answers.
    pub fn reap(&mut self) -> Result<Option<Completion<'_>>, ClientError> {
        if let Some(carried) = self.carried.pop_front() {
            return match carried {
                Carried::Answer(answer) => Ok(Some(self.lent.insert(answer).as_completion())),
                Carried::OutcomeUnknown(requests) => Err(ClientError::OutcomeUnknown { requests }),
            };
        }
        Ok(self.driver.core.poll_completion()?)
    }

    /// Blocks until a completion is buffered (true) or `timeout` passes (false), sending
    /// and receiving meanwhile. `None` uses the connection's default limit.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<bool, ClientError> {
        let timeout = timeout.or(self.driver.timeout);
        if self.reconnector.is_none() {
            return self
                .driver
                .drive_for(timeout, |core| Ok(core.completion_ready()?));
        }
        let deadline = timeout.map(|timeout| Instant::now() + timeout);
        let mut outage = None;
        loop {
            if !self.carried.is_empty() {
                return Ok(true);
            }
            self.ensure_connected(&mut outage)?;
            let remaining =
                deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
            match self
                .driver
                .drive_for(remaining, |core| Ok(core.completion_ready()?))
            {
                Ok(ready) => return Ok(ready),
                Err(error) => self.recover(error, &mut outage)?,
            }
        }
    }

    /// Sends everything submitted, blocking until the socket took it (within the default
    /// limit, whose expiry is returned as `ErrorKind::TimedOut` and does not reconnect);
    /// responses arriving meanwhile are buffered.
    pub fn flush_transmit(&mut self) -> Result<(), ClientError> {
        if self.reconnector.is_none() {
            return self
                .driver
                .drive(|core| Ok(core.transmit_pending_bytes() == 0));
        }
        let mut outage = None;
        loop {
            self.ensure_connected(&mut outage)?;
            match self
                .driver
                .drive(|core| Ok(core.transmit_pending_bytes() == 0))
            {
                Ok(()) => return Ok(()),
                // The caller's deadline, not a break (the module docs): `reconnect` if the
                // caller decides the server is gone.
                Err(ClientError::Io(error)) if error.kind() == std::io::ErrorKind::TimedOut => {
                    return Err(error.into());
                }
                Err(error) => self.recover(error, &mut outage)?,
            }
        }
    }

    /// Treats the connection as broken and reconnects, exactly as after a reset: for a
    /// caller whose own deadline found the server unresponsive. Needs a reconnect policy
    /// (otherwise `ErrorKind::Unsupported`).
    pub fn reconnect(&mut self) -> Result<(), ClientError> {
        if self.reconnector.is_none() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "no reconnect policy in the client options",
            )
            .into());
        }
        let mut outage = None;
        if !self.connected {
            return self.ensure_connected(&mut outage);
        }
        self.recover(
            std::io::Error::from(std::io::ErrorKind::TimedOut).into(),
            &mut outage,
        )
    }

    /// With a policy: connects again if an earlier call gave up, then submits what waits to
    /// be repeated.
    fn ensure_connected(&mut self, outage: &mut Option<Outage>) -> Result<(), ClientError> {
        if !self.connected {
            if outage.is_none()
                && let Some(reconnector) = &self.reconnector
            {
                // An earlier call gave up; this one starts its own outage.
                reconnector.note_break(outage, ClientError::Closed);
            }
            self.reconnect_within(outage, Vec::new(), Vec::new())?;
        }
        self.submit_repeats();
        Ok(())
    }

    /// After `error` stopped an I/O call: a broken connection is repaired (the module docs
    /// say how); any other error is returned.
    fn recover(
        &mut self,
        error: ClientError,
        outage: &mut Option<Outage>,
    ) -> Result<(), ClientError> {
        if self.reconnector.is_none() || !error.is_connection_lost() {
            return Err(error);
        }
        // Answers that arrived before the break are answers: keep them for `reap`.
        loop {
            while let Some(completion) = self.driver.core.poll_completion()? {
                self.carried
                    .push_back(Carried::Answer(OwnedCompletion::of(&completion)));
            }
            if !self.driver.salvage_received() {
                break;
            }
        }
        let (repeat, unknown): (Vec<_>, Vec<_>) = self
            .driver
            .core
            .handle_connection_lost()
            .into_iter()
            .partition(InterruptedRequest::is_safe_to_repeat);
        self.connected = false;
        if let Some(reconnector) = &self.reconnector {
            reconnector.note_break(outage, error);
        }
        self.reconnect_within(outage, repeat, unknown)
    }

    /// Connects again within `outage`. On success `repeat` waits to be submitted again and
    /// `unknown` is reported by `reap`; on failure the error names them and everything else
    /// still waiting to be repeated.
    fn reconnect_within(
        &mut self,
        outage: &mut Option<Outage>,
        repeat: Vec<InterruptedRequest>,
        unknown: Vec<InterruptedRequest>,
    ) -> Result<(), ClientError> {
        let (Some(reconnector), Some(outage)) = (&mut self.reconnector, outage) else {
            return Ok(());
        };
        let bound_handle = self.driver.core.bound_handle();
        let failure = match reconnector.reconnect(outage, bound_handle) {
            Ok((driver, capabilities)) => {
                self.install(driver, capabilities);
                self.repeat_backlog.extend(repeat);
                if !unknown.is_empty() {
                    self.carried.push_back(Carried::OutcomeUnknown(unknown));
                }
                self.submit_repeats();
                return Ok(());
            }
            Err(failure) => failure,
        };
        let mut unanswered: Vec<InterruptedRequest> = self
            .repeat_backlog
            .drain(..)
            .chain(repeat)
            .chain(unknown)
            .collect();
        unanswered.sort_unstable_by_key(|request| request.request_id);
        match failure {
            ReconnectFailure::GaveUp {
                attempts,
                elapsed,
                last_error,
            } => Err(ClientError::ReconnectGaveUp {
                attempts,
                elapsed,
                last_error: Box::new(last_error),
                interrupted: unanswered,
            }),
            ReconnectFailure::TenantLost {
                driver,
                capabilities,
                handle,
                refusal,
            } => {
                self.install(*driver, capabilities);
                Err(ClientError::TenantLost {
                    handle,
                    refusal: Box::new(refusal),
                    interrupted: unanswered,
                })
            }
        }
    }

    fn install(&mut self, driver: StreamDriver, capabilities: Capabilities) {
        assert_eq!(driver.core.outstanding_count(), 0);
        self.driver = driver;
        self.capabilities = capabilities;
        self.connected = true;
    }

    /// Submits interrupted requests again as the window allows; one the new server cannot
    /// take at all (a smaller maximum I/O size) is reported as not repeated.
    fn submit_repeats(&mut self) {
        while let Some(request) = self.repeat_backlog.front() {
            match self.driver.core.resubmit(request) {
                Ok(()) => {}
                Err(SubmitError::WindowFull { .. } | SubmitError::BuffersBusy) => break,
                Err(_) => self
                    .carried
                    .push_back(Carried::OutcomeUnknown(vec![*request])),
            }
            self.repeat_backlog.pop_front();
        }
    }
}

impl AsRawFd for PipelinedClient {
    fn as_raw_fd(&self) -> RawFd {
        self.driver.stream().as_raw_fd()
    }
}

impl std::fmt::Debug for PipelinedClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelinedClient")
            .field("capabilities", &self.capabilities)
            .field("core", &self.driver.core)
            .finish()
    }
}
