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

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use crate::core::{Completion, ConnectionCore};
use crate::driver::{ClientOptions, StreamDriver};
use crate::error::{ClientError, SubmitError};
use crate::types::Capabilities;

/// A connection with many requests in flight.
pub struct PipelinedClient {
    driver: StreamDriver,
    capabilities: Capabilities,
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
        let (driver, capabilities) = StreamDriver::connect(addr, options)?;
        Ok(PipelinedClient::from_parts(driver, capabilities))
    }

    pub(crate) fn from_parts(driver: StreamDriver, capabilities: Capabilities) -> PipelinedClient {
        PipelinedClient {
            driver,
            capabilities,
        }
    }

    pub fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    /// Requests that may be outstanding at once.
    pub fn window(&self) -> u32 {
        self.driver.core.window()
    }

    pub fn outstanding_count(&self) -> usize {
        self.driver.core.outstanding_count()
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

    // ----- I/O and completions -----

    /// Sends what the socket takes and receives what has arrived, without blocking.
    /// Returns whether any byte moved. `Err(Closed)` on calls after the server closed;
    /// responses buffered before that can still be reaped.
    pub fn poll_io(&mut self) -> Result<bool, ClientError> {
        self.driver.pump()
    }

    /// The next buffered completion, without I/O; `None` when none is buffered.
    pub fn reap(&mut self) -> Result<Option<Completion<'_>>, ClientError> {
        Ok(self.driver.core.poll_completion()?)
    }

    /// Blocks until a completion is buffered (true) or `timeout` passes (false), sending
    /// and receiving meanwhile. `None` uses the connection's default limit.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<bool, ClientError> {
        let timeout = timeout.or(self.driver.timeout);
        self.driver
            .drive_for(timeout, |core| Ok(core.completion_ready()?))
    }

    /// Sends everything submitted, blocking until the socket took it (within the default
    /// limit); responses arriving meanwhile are buffered.
    pub fn flush_transmit(&mut self) -> Result<(), ClientError> {
        self.driver
            .drive(|core| Ok(core.transmit_pending_bytes() == 0))
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
