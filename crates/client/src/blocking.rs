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

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};

use reflex_proto::native::{
    NO_TENANT_HANDLE, NOTICE_REQUEST_ID, RegisterBody, RenegotiateBody, TenantClassRequest,
};

use crate::core::{Completion, ConnectionCore};
use crate::driver::{ClientOptions, HELLO_REQUEST_ID, StreamDriver};
use crate::error::ClientError;
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

/// Which transfer a chunked call makes.
enum Transfer<'a> {
    Read(&'a mut [u8]),
    Write { data: &'a [u8], fua: bool },
}

impl Client {
    /// Connects (TCP_NODELAY), sends HELLO declaring this process's I/O priority, and waits
    /// for the server's capabilities, with the default 30 s limit per call.
    pub fn connect(addr: impl ToSocketAddrs) -> Result<Client, ClientError> {
        Client::connect_with(addr, &ClientOptions::default())
    }

    pub fn connect_with(
        addr: impl ToSocketAddrs,
        options: &ClientOptions,
    ) -> Result<Client, ClientError> {
        let (driver, capabilities) = StreamDriver::connect(addr, options)?;
        Ok(Client {
            driver,
            capabilities,
            next_request_id: HELLO_REQUEST_ID + 1,
            notices_received: 0,
            notices: VecDeque::new(),
        })
    }

    /// What the server announced in HELLO.
    pub fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    pub fn namespaces(&self) -> &[Namespace] {
        &self.capabilities.namespaces
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

    /// Waits up to `timeout` for a RENEGOTIATE notice (reading responses meanwhile).
    pub fn wait_notice(
        &mut self,
        timeout: std::time::Duration,
    ) -> Result<Option<RenegotiateBody>, ClientError> {
        if let Some(notice) = self.notices.pop_front() {
            return Ok(Some(notice));
        }
        let notices = &mut self.notices;
        let received = &mut self.notices_received;
        self.driver.drive_for(Some(timeout), |core| {
            while let Some(completion) = core.poll_completion()? {
                if completion.is_notice() {
                    keep_notice(notices, received, &completion);
                }
            }
            Ok(!notices.is_empty())
        })?;
        Ok(self.notices.pop_front())
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
        let request_id = self.take_request_ids(1);
        self.driver.core.submit_register(request_id, body)?;
        self.wait_for(request_id, |completion| completion.tenant_handle())
    }

    /// Removes tenant `handle`. Connections bound to it get PERMISSION for their I/O until
    /// they BIND again.
    pub fn unregister(&mut self, handle: u64) -> Result<(), ClientError> {
        let request_id = self.take_request_ids(1);
        self.driver.core.submit_unregister(request_id, handle)?;
        self.wait_single(request_id)
    }

    /// Charges this connection's I/O to tenant `handle` from now on; `0` goes back to the
    /// namespace's default tenant. The handle is valid only for the namespace it was
    /// registered on (I/O elsewhere gets PERMISSION).
    pub fn bind(&mut self, handle: u64) -> Result<(), ClientError> {
        let request_id = self.take_request_ids(1);
        self.driver.core.submit_bind(request_id, handle)?;
        self.wait_single(request_id)
    }

    pub fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        self.driver.stream().peer_addr()
    }

    /// Reads `buf.len()` bytes at `offset` of namespace `namespace`.
    pub fn read(&mut self, namespace: u32, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        self.transfer(namespace, offset, Transfer::Read(buf))
    }

    /// Writes `data` at `offset`; acknowledged writes are durable after [`Client::flush`].
    pub fn write(&mut self, namespace: u32, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        self.transfer(namespace, offset, Transfer::Write { data, fua: false })
    }

    /// Writes `data` at `offset` with forced unit access: durable when this returns Ok.
    pub fn write_fua(
        &mut self,
        namespace: u32,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ClientError> {
        self.transfer(namespace, offset, Transfer::Write { data, fua: true })
    }

    /// Makes every write acknowledged so far durable.
    pub fn flush(&mut self, namespace: u32) -> Result<(), ClientError> {
        let request_id = self.take_request_ids(1);
        self.driver.core.submit_flush(request_id, namespace)?;
        self.wait_single(request_id)
    }

    /// Discards `length_bytes` at `offset`; the range reads back as zeroes.
    pub fn trim(
        &mut self,
        namespace: u32,
        offset: u64,
        length_bytes: u32,
    ) -> Result<(), ClientError> {
        let request_id = self.take_request_ids(1);
        self.driver
            .core
            .submit_trim(request_id, namespace, offset, length_bytes)?;
        self.wait_single(request_id)
    }

    /// Turns this connection into a pipelined one (same socket, same capabilities).
    pub fn into_pipelined(self) -> PipelinedClient {
        PipelinedClient::from_parts(self.driver, self.capabilities)
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

    fn wait_single(&mut self, request_id: u64) -> Result<(), ClientError> {
        self.wait_for(request_id, |completion| completion.result().map(|_| ()))
    }

    /// Waits for the answer to `request_id` and maps it.
    fn wait_for<T>(
        &mut self,
        request_id: u64,
        mut map: impl FnMut(&Completion<'_>) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        let mut outcome = None;
        let notices = &mut self.notices;
        let received = &mut self.notices_received;
        self.driver.drive(|core| {
            while let Some(completion) = core.poll_completion()? {
                if completion.is_notice() {
                    keep_notice(notices, received, &completion);
                } else if completion.request_id == request_id {
                    outcome = Some(map(&completion));
                }
                // Anything else answers a request abandoned after a timeout: dropped.
            }
            Ok(outcome.is_some())
        })?;
        match outcome {
            Some(result) => result,
            None => Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into()),
        }
    }

    fn transfer(
        &mut self,
        namespace: u32,
        offset: u64,
        mut transfer: Transfer<'_>,
    ) -> Result<(), ClientError> {
        let total_bytes = match &transfer {
            Transfer::Read(buf) => buf.len(),
            Transfer::Write { data, .. } => data.len(),
        };
        let chunk_bytes = self.driver.core.max_io_size().max(1) as usize;
        // A zero-length request is still sent: the server answers it (INVALID).
        let chunk_count = total_bytes.div_ceil(chunk_bytes).max(1);
        let first_id = self.take_request_ids(chunk_count as u64);
        let mut submitted = 0usize;
        let mut answered = 0usize;
        let mut first_error: Option<ClientError> = None;
        let notices = &mut self.notices;
        let received = &mut self.notices_received;
        self.driver.drive(|core: &mut ConnectionCore| {
            while let Some(completion) = core.poll_completion()? {
                if completion.is_notice() {
                    keep_notice(notices, received, &completion);
                    continue;
                }
                let Some(index) = completion
                    .request_id
                    .checked_sub(first_id)
                    .filter(|index| *index < chunk_count as u64)
                else {
                    continue;
                };
                answered += 1;
                if let Err(error) = completion.result() {
                    first_error.get_or_insert(error);
                    continue;
                }
                if let Transfer::Read(buf) = &mut transfer {
                    let start = index as usize * chunk_bytes;
                    // The core checked that an OK READ carries exactly the bytes requested.
                    let end = start + completion.data.len();
                    if let Some(destination) = buf.get_mut(start..end) {
                        destination.copy_from_slice(completion.data);
                    }
                }
            }
            while submitted < chunk_count && core.outstanding_count() < core.window() as usize {
                let start = submitted * chunk_bytes;
                let end = (start + chunk_bytes).min(total_bytes);
                let request_id = first_id + submitted as u64;
                let chunk_offset = offset.saturating_add(start as u64);
                match &transfer {
                    Transfer::Read(_) => {
                        core.submit_read(request_id, namespace, chunk_offset, (end - start) as u32)?
                    }
                    Transfer::Write { data, fua } => core.submit_write(
                        request_id,
                        namespace,
                        chunk_offset,
                        &data[start..end],
                        *fua,
                    )?,
                }
                submitted += 1;
            }
            Ok(answered == chunk_count)
        })?;
        match first_error {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
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
