//! The blocking API: one call, one answer. For tests, tools and applications that do one
//! thing at a time; `reflex bench` uses the core directly.
//!
//! A READ or WRITE larger than the server's `max_io_size` is split into chunks that are
//! pipelined up to the window, so callers may pass any length. When one chunk fails, the
//! others are still reaped (the connection stays in step) and the first error is returned.
//!
//! Tenants (`docs/QOS.md`): [`Client::register_lc`] / [`Client::register_be`] return a tenant
//! handle (or [`ClientError::Refused`] with admission control's reason), [`Client::bind`]
//! charges this connection's I/O to it, [`Client::unregister`] removes it. RENEGOTIATE notices
//! that arrive during any call are kept (the newest [`NOTICES_BUFFERED_MAX`]) for
//! [`Client::poll_notice`].
//!
//! Reconnecting ([`ClientOptions::reconnect`]): a call that finds the connection broken
//! (end of file, reset, any socket error, or no answer within the timeout) takes the answers
//! that did arrive, then connects again (HELLO, and BIND to the tenant the connection was
//! bound to) with the policy's backoff, and goes on: READ, FLUSH and BIND requests left
//! unanswered are submitted again; WRITE, TRIM, REGISTER and UNREGISTER ones are not, and the
//! call ends with [`ClientError::OutcomeUnknown`] naming exactly them once everything else is
//! done (later chunks of a large write are still written). The policy's attempts and time
//! bound each call. A call that starts on a connection that died while the client was idle
//! notices it before sending anything, so nothing of that call is ever of unknown outcome.

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use reflex_proto::native::{
    NO_TENANT_HANDLE, NOTICE_REQUEST_ID, RegisterBody, RenegotiateBody, ReportBody,
    TenantClassRequest,
};

use crate::call::{Call, Work};
use crate::core::{Completion, ConnectionCore, InterruptedRequest};
use crate::driver::{
    ClientOptions, HELLO_REQUEST_ID, Outage, ReconnectFailure, Reconnector, StreamDriver,
};
use crate::error::{ClientError, ProtocolError};
use crate::pipelined::PipelinedClient;
use reflex_proto::native::Namespace;

use crate::types::Capabilities;

/// RENEGOTIATE notices a [`Client`] keeps until [`Client::poll_notice`] takes them; older
/// ones are dropped beyond this.
pub const NOTICES_BUFFERED_MAX: usize = 64;

/// A connection to a ReFlex server with one blocking call per operation.
pub struct Client {
    driver: StreamDriver,
    capabilities: Capabilities,
    next_request_id: u64,
    notices_received: u64,
    notices: VecDeque<RenegotiateBody>,
    /// Present when reconnecting is on.
    reconnector: Option<Reconnector>,
    /// False once reconnecting gave up: the next call connects before anything else.
    connected: bool,
}

/// Keeps a notice for `poll_notice`, dropping the oldest beyond the bound.
fn keep_notice(
    notices: &mut VecDeque<RenegotiateBody>,
    received: &mut u64,
    completion: &Completion<'_>,
) {
    *received += 1;
    if let Some(body) = completion.notice() {
        if notices.len() >= NOTICES_BUFFERED_MAX {
            notices.pop_front();
        }
        notices.push_back(body);
    }
}

impl Client {
    /// Connects (TCP_NODELAY), sends HELLO declaring this process's I/O priority, and waits
    /// for the server's capabilities, with the default 30 s limit per call.
    pub fn connect(addr: impl ToSocketAddrs) -> Result<Client, ClientError> {
        Client::connect_with(addr, &ClientOptions::default())
    }

    /// Connects with `options`; with [`ClientOptions::reconnect`] set, calls repair a broken
    /// connection (module docs).
    pub fn connect_with(
        addr: impl ToSocketAddrs,
        options: &ClientOptions,
    ) -> Result<Client, ClientError> {
        let (driver, capabilities, reconnector) = StreamDriver::connect(addr, options)?;
        Ok(Client {
            driver,
            capabilities,
            next_request_id: HELLO_REQUEST_ID + 1,
            notices_received: 0,
            notices: VecDeque::new(),
            reconnector,
            connected: true,
        })
    }

    /// What the server announced in HELLO (on the current connection, after a reconnect).
    pub fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    pub fn namespaces(&self) -> &[Namespace] {
        &self.capabilities.namespaces
    }

    /// Connections made after the first one. A FLUSH answered after this changed covers
    /// what the server holds now: writes acknowledged by a server that then lost them (a
    /// machine crash, not a process restart) are not brought back by it.
    pub fn reconnect_count(&self) -> u64 {
        self.reconnector
            .as_ref()
            .map_or(0, |reconnector| reconnector.reconnects)
    }

    /// The tenant this client's connection is bound to (0: the namespace's default); a
    /// reconnect binds the new connection to it again.
    pub fn bound_handle(&self) -> u64 {
        self.driver.core.bound_handle()
    }

    /// RENEGOTIATE notices received so far.
    pub fn notices_received(&self) -> u64 {
        self.notices_received
    }

    /// The oldest RENEGOTIATE notice received and not taken yet. Notices arrive during other
    /// calls; [`Client::wait_notice`] waits for one.
    pub fn poll_notice(&mut self) -> Option<RenegotiateBody> {
        self.notices.pop_front()
    }

    /// Waits up to `timeout` for a RENEGOTIATE notice (reading responses meanwhile). With a
    /// reconnect policy, a connection lost meanwhile is repaired and the wait goes on.
    pub fn wait_notice(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<RenegotiateBody>, ClientError> {
        if let Some(notice) = self.notices.pop_front() {
            return Ok(Some(notice));
        }
        let deadline = Instant::now() + timeout;
        let mut call = Call::new(Work::Nothing, self.next_request_id, 1);
        let mut outage = None;
        loop {
            self.ensure_connected(&mut outage, &mut call)?;
            let remaining = deadline.saturating_duration_since(Instant::now());
            let notices = &mut self.notices;
            let received = &mut self.notices_received;
            let result = self.driver.drive_for(Some(remaining), |core| {
                take_answers(core, &mut call, notices, received)?;
                Ok(!notices.is_empty())
            });
            match result {
                Ok(_) => return Ok(self.notices.pop_front()),
                Err(error) => self.recover(error, &mut outage, &mut call)?,
            }
            if !self.notices.is_empty() || Instant::now() >= deadline {
                return Ok(self.notices.pop_front());
            }
        }
    }

    /// Registers a latency-critical tenant on `namespace`: `iops` 4 KiB I/Os per second at
    /// `read_percent` reads, p95 read latency at most `latency_us_p95`. Returns its handle, or
    /// [`ClientError::Refused`] with the reason when it does not fit.
    pub fn register_lc(
        &mut self,
        namespace: u32,
        latency_us_p95: u32,
        iops: u64,
        read_percent: u8,
    ) -> Result<u64, ClientError> {
        self.register(&RegisterBody {
            namespace_id: namespace,
            class: TenantClassRequest::LatencyCritical {
                latency_us_p95,
                iops,
                read_percent,
            },
            read_only: false,
            handle: NO_TENANT_HANDLE,
        })
    }

    /// Registers a best-effort tenant on `namespace`; returns its handle.
    pub fn register_be(&mut self, namespace: u32) -> Result<u64, ClientError> {
        self.register(&RegisterBody {
            namespace_id: namespace,
            class: TenantClassRequest::BestEffort,
            read_only: false,
            handle: NO_TENANT_HANDLE,
        })
    }

    /// REGISTER with every option: a read-only tenant, or (with `body.handle`) a new SLO for
    /// an existing tenant, which admission control checks again (on refusal the old SLO
    /// stays). Returns the handle.
    pub fn register(&mut self, body: &RegisterBody) -> Result<u64, ClientError> {
        let handle = self.call(Work::Register(body))?;
        Ok(handle.unwrap_or(NO_TENANT_HANDLE))
    }

    /// Removes tenant `handle`. Connections bound to it get PERMISSION for their I/O until
    /// they BIND again.
    pub fn unregister(&mut self, handle: u64) -> Result<(), ClientError> {
        self.call(Work::Unregister(handle)).map(|_| ())
    }

    /// Charges this connection's I/O to tenant `handle` from now on; `0` goes back to the
    /// namespace's default tenant. The handle is valid only for the namespace it was
    /// registered on (I/O elsewhere gets PERMISSION).
    pub fn bind(&mut self, handle: u64) -> Result<(), ClientError> {
        self.call(Work::Bind(handle)).map(|_| ())
    }

    /// Tells the server what this connection's latency-critical tenant measured over its last
    /// interval: reads answered, their p95 in µs end to end, and the requests due and not yet
    /// sent (`docs/PROTOCOL.md` §1.9). The server's self-calibration learns from it the share
    /// of the SLO spent outside the server, and whether the tenant slowed down when told; on a
    /// connection not bound to an LC tenant it is answered OK and ignored.
    pub fn report(&mut self, report: ReportBody) -> Result<(), ClientError> {
        self.call(Work::Report(report)).map(|_| ())
    }

    /// The server's address; after a reconnect, the one reached last.
    pub fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        self.driver.stream().peer_addr()
    }

    /// Reads `buf.len()` bytes at `offset` of namespace `namespace`.
    pub fn read(&mut self, namespace: u32, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        self.call(Work::Read {
            namespace,
            offset,
            buf,
        })
        .map(|_| ())
    }

    /// Writes `data` at `offset`; acknowledged writes are durable after [`Client::flush`].
    pub fn write(&mut self, namespace: u32, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        self.call(Work::Write {
            namespace,
            offset,
            data,
            fua: false,
        })
        .map(|_| ())
    }

    /// Writes `data` at `offset` with forced unit access: durable when this returns Ok.
    pub fn write_fua(
        &mut self,
        namespace: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ClientError> {
        self.call(Work::Write {
            namespace,
            offset,
            data,
            fua: true,
        })
        .map(|_| ())
    }

    /// Makes every write acknowledged so far durable.
    pub fn flush(&mut self, namespace: u32) -> Result<(), ClientError> {
        self.call(Work::Flush { namespace }).map(|_| ())
    }

    /// Discards `length_bytes` at `offset`; the range reads back as zeroes.
    pub fn trim(
        &mut self,
        namespace: u32,
        offset: u64,
        length_bytes: u32,
    ) -> Result<(), ClientError> {
        self.call(Work::Trim {
            namespace,
            offset,
            length_bytes,
        })
        .map(|_| ())
    }

    /// Turns this connection into a pipelined one (same socket, same capabilities, same
    /// reconnect policy).
    pub fn into_pipelined(self) -> PipelinedClient {
        PipelinedClient::from_parts(
            self.driver,
            self.capabilities,
            self.reconnector,
            self.connected,
        )
    }

    fn take_request_ids(&mut self, count: u64) -> u64 {
        if self
            .next_request_id
            .checked_add(count)
            .is_none_or(|end| end == NOTICE_REQUEST_ID)
        {
            self.next_request_id = HELLO_REQUEST_ID + 1;
        }
        let first = self.next_request_id;
        self.next_request_id += count;
        first
    }

    /// Runs one call to the end: submits its requests up to the window, takes their answers
    /// and, with a reconnect policy, repairs the connection as often as the policy allows.
    /// Returns REGISTER's handle.
    fn call(&mut self, work: Work<'_>) -> Result<Option<u64>, ClientError> {
        let chunk_bytes = self.driver.core.max_io_size().max(1) as usize;
        let request_count = Call::request_count(&work, chunk_bytes);
        let first_id = self.take_request_ids(request_count as u64);
        let mut call = Call::new(work, first_id, chunk_bytes);
        let mut outage = None;
        loop {
            self.ensure_connected(&mut outage, &mut call)?;
            let notices = &mut self.notices;
            let received = &mut self.notices_received;
            let result = self.driver.drive(|core| {
                take_answers(core, &mut call, notices, received)?;
                call.submit(core)?;
                Ok(call.is_done())
            });
            match result {
                Ok(()) => return call.finish(),
                Err(error) => self.recover(error, &mut outage, &mut call)?,
            }
            if call.is_done() {
                // Everything was answered (or is of unknown outcome) before the break: the
                // call is over, and the next one connects again.
                return call.finish();
            }
        }
    }

    /// After `error` stopped a call: without a policy, or for an error that is not a broken
    /// connection, returns it. Otherwise takes the answers that arrived before the break,
    /// hands the interrupted requests to `call`, and reconnects unless `call` is done.
    fn recover(
        &mut self,
        error: ClientError,
        outage: &mut Option<Outage>,
        call: &mut Call<'_>,
    ) -> Result<(), ClientError> {
        if self.reconnector.is_none() || !error.is_connection_lost() {
            return Err(error);
        }
        self.lose_connection(call)?;
        if let Some(reconnector) = &self.reconnector {
            reconnector.note_break(outage, error);
        }
        if call.is_done() {
            return Ok(());
        }
        self.reconnect(outage, call.unanswered())
    }

    /// Makes sure a call starts on a live connection: reconnects when an earlier call gave
    /// up, and notices a connection that died while the client was idle before anything is
    /// queued on it (so no request of the call can be of unknown outcome because of it).
    fn ensure_connected(
        &mut self,
        outage: &mut Option<Outage>,
        call: &mut Call<'_>,
    ) -> Result<(), ClientError> {
        if self.reconnector.is_none() {
            return Ok(());
        }
        if self.connected {
            let error = match self.driver.pump() {
                Ok(_) if !self.driver.is_closed() => return Ok(()),
                Ok(_) => ClientError::Closed,
                Err(error) if error.is_connection_lost() => error,
                Err(error) => return Err(error),
            };
            self.lose_connection(call)?;
            if let Some(reconnector) = &self.reconnector {
                reconnector.note_break(outage, error);
            }
        } else if outage.is_none()
            && let Some(reconnector) = &self.reconnector
        {
            // An earlier call gave up; this one starts its own outage.
            reconnector.note_break(outage, ClientError::Closed);
        }
        self.reconnect(outage, call.unanswered())
    }

    /// Takes every answer still buffered or still in the kernel, then ends the connection
    /// and hands its unanswered requests to `call`.
    fn lose_connection(&mut self, call: &mut Call<'_>) -> Result<(), ClientError> {
        if !self.driver.core.is_disconnected() {
            loop {
                take_answers(
                    &mut self.driver.core,
                    call,
                    &mut self.notices,
                    &mut self.notices_received,
                )?;
                if !self.driver.salvage_received() {
                    break;
                }
            }
            let interrupted = self.driver.core.handle_connection_lost();
            call.interrupt(interrupted);
        }
        self.connected = false;
        Ok(())
    }

    /// Connects again within `outage`; on failure the error names `unanswered`.
    fn reconnect(
        &mut self,
        outage: &mut Option<Outage>,
        unanswered: Vec<InterruptedRequest>,
    ) -> Result<(), ClientError> {
        let (Some(reconnector), Some(outage)) = (&mut self.reconnector, outage) else {
            return Ok(());
        };
        let bound_handle = self.driver.core.bound_handle();
        match reconnector.reconnect(outage, bound_handle) {
            Ok((driver, capabilities)) => {
                self.install(driver, capabilities);
                Ok(())
            }
            Err(ReconnectFailure::GaveUp {
                attempts,
                elapsed,
                last_error,
            }) => Err(ClientError::ReconnectGaveUp {
                attempts,
                elapsed,
                last_error: Box::new(last_error),
                interrupted: unanswered,
            }),
            Err(ReconnectFailure::TenantLost {
                driver,
                capabilities,
                handle,
                refusal,
            }) => {
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
}

/// Takes every buffered answer: notices are kept, answers go to `call`, anything else (the
/// answer to a request abandoned after a timeout) is dropped.
fn take_answers(
    core: &mut ConnectionCore,
    call: &mut Call<'_>,
    notices: &mut VecDeque<RenegotiateBody>,
    received: &mut u64,
) -> Result<(), ProtocolError> {
    while let Some(completion) = core.poll_completion()? {
        if completion.is_notice() {
            keep_notice(notices, received, &completion);
        } else {
            call.take_answer(&completion);
        }
    }
    Ok(())
}

impl AsRawFd for Client {
    fn as_raw_fd(&self) -> RawFd {
        self.driver.stream().as_raw_fd()
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("capabilities", &self.capabilities)
            .field("core", &self.driver.core)
            .finish()
    }
}
