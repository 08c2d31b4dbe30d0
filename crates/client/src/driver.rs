//! The std-socket driver under [`crate::Client`] and [`crate::PipelinedClient`]: moves bytes
//! between a non-blocking `TcpStream` and a [`ConnectionCore`].
//!
//! Why non-blocking even for the blocking API: a client that blocks in `send` while the
//! server blocks sending responses the client is not reading would deadlock once both
//! socket buffers fill. The driver always sends and receives in the same pass and waits with
//! `poll(2)` for either direction, so the blocking API only *looks* blocking.
//!
//! Reconnecting ([`Reconnector`]) lives here too because it is connecting again: the same
//! addresses, HELLO with the same I/O priority, then BIND to the tenant the lost connection
//! was bound to, paced by a [`ReconnectSchedule`]. What to do with the requests the break
//! interrupted is the clients' business; this module only hands them a working connection or
//! says why there is none.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::core::{ConnectionCore, CoreOptions};
use crate::error::{ClientError, ProtocolError};
use crate::reconnect::{Jitter, ReconnectPolicy, ReconnectSchedule};
use crate::sys;
use crate::tls::{ClientTls, TlsOptions};
use reflex_proto::native::Opcode;

use crate::types::Capabilities;

/// Request id of the HELLO sent when connecting; user ids start after it.
pub const HELLO_REQUEST_ID: u64 = 0;
/// Request id of the BIND that restores a tenant binding on a new connection (nothing else is
/// outstanding on it then).
const REBIND_REQUEST_ID: u64 = HELLO_REQUEST_ID + 1;
/// Shortest time a reconnection attempt gets to connect and exchange HELLO.
const ATTEMPT_TIMEOUT_MIN: Duration = Duration::from_millis(100);

/// How to connect.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Limit for connecting and for each blocking call; `None` waits forever.
    pub timeout: Option<Duration>,
    /// I/O priority declared in HELLO (`class << 13 | level`); `None` asks the kernel for the
    /// process's own with `ioprio_get` (see [`crate::io_priority_of_process`]).
    pub io_priority: Option<u16>,
    /// Reconnect after the connection breaks, repeating what is safe to repeat; `None` (the
    /// default) fails the call with [`ClientError::Closed`] or [`ClientError::Io`] as before.
    pub reconnect: Option<ReconnectPolicy>,
    /// TLS, for a server whose native port requires it (`docs/PROTOCOL.md` §1.10); `None`:
    /// plaintext.
    pub tls: Option<TlsOptions>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            timeout: Some(Duration::from_secs(30)),
            io_priority: None,
            reconnect: None,
            tls: None,
        }
    }
}

impl ClientOptions {
    /// These options with reconnecting on, by `policy`.
    pub fn with_reconnect(mut self, policy: ReconnectPolicy) -> ClientOptions {
        self.reconnect = Some(policy);
        self
    }
}

#[derive(Debug)]
pub(crate) struct StreamDriver {
    stream: TcpStream,
    /// TLS over `stream`, when the options ask for it.
    tls: Option<ClientTls>,
    pub(crate) core: ConnectionCore,
    pub(crate) timeout: Option<Duration>,
    closed: bool,
}

impl StreamDriver {
    /// Connects with TCP_NODELAY, sends HELLO and waits for the capabilities. With
    /// `options.reconnect`, also returns what it takes to connect the same way again.
    pub(crate) fn connect(
        addr: impl ToSocketAddrs,
        options: &ClientOptions,
    ) -> Result<(StreamDriver, Capabilities, Option<Reconnector>), ClientError> {
        let addresses: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
        let io_priority = options
            .io_priority
            .unwrap_or_else(sys::io_priority_of_process);
        let (driver, capabilities) = StreamDriver::connect_addresses(
            &addresses,
            options.timeout,
            io_priority,
            options.tls.as_ref(),
        )?;
        let reconnector = options.reconnect.map(|policy| Reconnector {
            policy,
            addresses,
            timeout: options.timeout,
            io_priority,
            tls: options.tls.clone(),
            jitter: Jitter::from_entropy(),
            reconnects: 0,
        });
        Ok((driver, capabilities, reconnector))
    }

    fn connect_addresses(
        addresses: &[SocketAddr],
        timeout: Option<Duration>,
        io_priority: u16,
        tls: Option<&TlsOptions>,
    ) -> Result<(StreamDriver, Capabilities), ClientError> {
        let stream = connect_any(addresses, timeout)?;
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        let tls = match tls {
            None => None,
            Some(tls) => Some(tls.session()?),
        };
        let mut driver = StreamDriver {
            stream,
            tls,
            core: ConnectionCore::new(CoreOptions::default()),
            timeout,
            closed: false,
        };
        driver.core.submit_hello(HELLO_REQUEST_ID, io_priority)?;
        let mut hello_error = None;
        let mut answered = false;
        driver.drive(|core| {
            while let Some(completion) = core.poll_completion()? {
                if completion.request_id == HELLO_REQUEST_ID && completion.opcode == Opcode::Hello {
                    answered = true;
                    if let Err(error) = completion.result() {
                        hello_error = Some(error);
                    }
                }
            }
            Ok(answered)
        })?;
        if let Some(error) = hello_error {
            return Err(error);
        }
        let Some(capabilities) = driver.core.capabilities().cloned() else {
            return Err(ProtocolError::NoCapabilities.into());
        };
        Ok((driver, capabilities))
    }

    /// # Panics
    /// On a TLS connection: its socket alone would lose the session.
    pub(crate) fn into_parts(self) -> (TcpStream, ConnectionCore) {
        assert!(
            self.tls.is_none(),
            "a TLS connection cannot be taken apart into its socket"
        );
        assert!(!self.core.transmit_in_flight());
        assert!(!self.core.receive_in_flight());
        (self.stream, self.core)
    }

    pub(crate) fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Whether the peer closed the connection (a read returned end of file).
    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    /// BINDs a connection nothing else uses yet to `handle`; the server's refusal comes back
    /// as its typed error. Stops at the answer, so a notice right behind it stays buffered.
    fn bind_fresh(&mut self, handle: u64) -> Result<(), ClientError> {
        assert_eq!(self.core.outstanding_count(), 0);
        self.core.submit_bind(REBIND_REQUEST_ID, handle)?;
        let mut outcome = None;
        self.drive(|core| {
            while outcome.is_none()
                && let Some(completion) = core.poll_completion()?
            {
                if completion.request_id == REBIND_REQUEST_ID && completion.opcode == Opcode::Bind {
                    outcome = Some(completion.result().map(|_| ()));
                }
            }
            Ok(outcome.is_some())
        })?;
        outcome.unwrap_or(Err(ClientError::Closed))
    }

    /// After the connection broke: one non-blocking read of whatever the kernel still holds
    /// (answers sent before a reset or a close), ignoring errors. Returns whether bytes
    /// arrived; the caller polls them and calls again until nothing more comes.
    pub(crate) fn salvage_received(&mut self) -> bool {
        let Some(space) = self.core.receive_start() else {
            return false;
        };
        match transport_read(&mut self.stream, self.tls.as_mut(), space) {
            Ok(received) => {
                self.core.receive_done(received);
                received > 0
            }
            Err(_) => {
                self.core.receive_done(0);
                false
            }
        }
    }

    /// One non-blocking pass: sends what the socket takes, then receives once. Returns
    /// whether any byte moved.
    pub(crate) fn pump(&mut self) -> Result<bool, ClientError> {
        if self.closed {
            return Err(ClientError::Closed);
        }
        let mut progress = false;
        while let Some(bytes) = self.core.transmit_start() {
            match transport_write(&mut self.stream, self.tls.as_mut(), bytes) {
                Ok(0) => {
                    self.core.transmit_done(0);
                    self.closed = true;
                    return Err(ClientError::Closed);
                }
                Ok(sent) => {
                    self.core.transmit_done(sent);
                    progress = true;
                }
                Err(error) if error.kind() == ErrorKind::WouldBlock => {
                    self.core.transmit_done(0);
                    break;
                }
                Err(error) if error.kind() == ErrorKind::Interrupted => {
                    self.core.transmit_done(0);
                }
                Err(error) => {
                    self.core.transmit_done(0);
                    return Err(error.into());
                }
            }
        }
        if self.closed {
            return Ok(progress);
        }
        if let Some(space) = self.core.receive_start() {
            match transport_read(&mut self.stream, self.tls.as_mut(), space) {
                Ok(0) => {
                    self.core.receive_done(0);
                    self.closed = true;
                }
                Ok(received) => {
                    self.core.receive_done(received);
                    progress = true;
                }
                Err(error)
                    if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) =>
                {
                    self.core.receive_done(0);
                }
                Err(error) => {
                    self.core.receive_done(0);
                    return Err(error.into());
                }
            }
        }
        Ok(progress)
    }

    /// Runs `step` (which consumes completions and may submit) and moves bytes until `step`
    /// returns true, within the driver's timeout.
    pub(crate) fn drive(
        &mut self,
        step: impl FnMut(&mut ConnectionCore) -> Result<bool, ClientError>,
    ) -> Result<(), ClientError> {
        self.drive_for(self.timeout, step).and_then(|done| {
            if done {
                Ok(())
            } else {
                Err(std::io::Error::from(ErrorKind::TimedOut).into())
            }
        })
    }

    /// As [`StreamDriver::drive`] with an explicit limit; returns false when it ran out.
    pub(crate) fn drive_for(
        &mut self,
        timeout: Option<Duration>,
        mut step: impl FnMut(&mut ConnectionCore) -> Result<bool, ClientError>,
    ) -> Result<bool, ClientError> {
        let deadline = timeout.map(|timeout| Instant::now() + timeout);
        loop {
            if step(&mut self.core)? {
                return Ok(true);
            }
            if self.closed {
                return Err(ClientError::Closed);
            }
            let progress = self.pump()?;
            if self.closed {
                // `step` has seen every byte received before the end of file, and must not
                // run again: it would queue requests on a dead connection.
                return Err(ClientError::Closed);
            }
            if progress {
                continue;
            }
            let remaining = match deadline {
                None => None,
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(false);
                    }
                    Some(deadline - now)
                }
            };
            let want_write = self.core.transmit_pending_bytes() > 0
                || self.tls.as_ref().is_some_and(|tls| tls.wants_write());
            sys::poll_socket(self.stream.as_raw_fd(), want_write, remaining)?;
        }
    }
}

/// A non-blocking write of plaintext: straight to the socket, or through TLS (never `Ok(0)`
/// for a full TLS buffer: `WouldBlock`, so the caller waits for the socket).
fn transport_write(
    stream: &mut TcpStream,
    tls: Option<&mut ClientTls>,
    bytes: &[u8],
) -> std::io::Result<usize> {
    match tls {
        None => stream.write(bytes),
        Some(tls) => tls.write(stream, bytes),
    }
}

/// A non-blocking read of plaintext: from the socket, or decrypted (`Ok(0)`: the end of the
/// stream, `WouldBlock`: nothing yet).
fn transport_read(
    stream: &mut TcpStream,
    tls: Option<&mut ClientTls>,
    space: &mut [u8],
) -> std::io::Result<usize> {
    match tls {
        None => stream.read(space),
        Some(tls) => tls.read(stream, space),
    }
}

fn connect_any(
    addresses: &[SocketAddr],
    timeout: Option<Duration>,
) -> Result<TcpStream, ClientError> {
    let mut last_error = None;
    for address in addresses {
        match connect_one(address, timeout) {
            Ok(stream) => return Ok(stream),
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error
        .unwrap_or_else(|| std::io::Error::new(ErrorKind::InvalidInput, "no address to connect to"))
        .into())
}

fn connect_one(address: &SocketAddr, timeout: Option<Duration>) -> std::io::Result<TcpStream> {
    match timeout {
        Some(timeout) => TcpStream::connect_timeout(address, timeout),
        None => TcpStream::connect(address),
    }
}

/// What a client needs to connect again the way it first connected, and how hard to try.
#[derive(Debug)]
pub(crate) struct Reconnector {
    policy: ReconnectPolicy,
    /// The addresses the first connection resolved (not resolved again).
    addresses: Vec<SocketAddr>,
    timeout: Option<Duration>,
    tls: Option<TlsOptions>,
    io_priority: u16,
    jitter: Jitter,
    /// Connections made after the first one.
    pub(crate) reconnects: u64,
}

/// One outage: from the break a call noticed until that call has a connection again or
/// gives up. A blocking call keeps one outage across several breaks, so that its attempts
/// and time are bounded in all.
#[derive(Debug)]
pub(crate) struct Outage {
    schedule: ReconnectSchedule,
    started: Instant,
    last_error: ClientError,
}

impl Outage {
    fn give_up(&mut self) -> ReconnectFailure {
        ReconnectFailure::GaveUp {
            attempts: self.schedule.attempts_made(),
            elapsed: self.started.elapsed(),
            last_error: std::mem::replace(&mut self.last_error, ClientError::Closed),
        }
    }
}

/// Why [`Reconnector::reconnect`] returned without a usable connection.
#[derive(Debug)]
pub(crate) enum ReconnectFailure {
    /// The policy's attempts or time ran out, or the server answered in a way retrying will
    /// not fix (a protocol error in HELLO).
    GaveUp {
        attempts: u32,
        elapsed: Duration,
        last_error: ClientError,
    },
    /// Connected, but the server refused to BIND `handle` again; the connection is usable
    /// and charged to the default tenant.
    TenantLost {
        driver: Box<StreamDriver>,
        capabilities: Capabilities,
        handle: u64,
        refusal: ClientError,
    },
}

impl Reconnector {
    /// Records the break `error` reports: it starts an outage, or, when the connection made
    /// for an outage broke again, continues it (one budget for both).
    pub(crate) fn note_break(&self, outage: &mut Option<Outage>, error: ClientError) {
        match outage {
            Some(outage) => outage.last_error = error,
            None => {
                *outage = Some(Outage {
                    schedule: ReconnectSchedule::new(self.policy),
                    started: Instant::now(),
                    last_error: error,
                })
            }
        }
    }

    /// Connects again within `outage`'s budget: waits as the schedule says, connects, HELLO,
    /// and BIND to `bound_handle` unless it is 0.
    pub(crate) fn reconnect(
        &mut self,
        outage: &mut Outage,
        bound_handle: u64,
    ) -> Result<(StreamDriver, Capabilities), ReconnectFailure> {
        let attempt_timeout = self
            .timeout
            .unwrap_or(self.policy.give_up_after)
            .max(ATTEMPT_TIMEOUT_MIN);
        loop {
            let elapsed = outage.started.elapsed();
            let Some(wait) = outage
                .schedule
                .next_attempt(elapsed, self.jitter.next_sample())
            else {
                return Err(outage.give_up());
            };
            std::thread::sleep(wait);
            let connected = StreamDriver::connect_addresses(
                &self.addresses,
                Some(attempt_timeout),
                self.io_priority,
                self.tls.as_ref(),
            );
            let (mut driver, capabilities) = match connected {
                Ok(connected) => connected,
                Err(error) => {
                    let retry = error.is_connection_lost();
                    outage.last_error = error;
                    if retry {
                        continue;
                    }
                    return Err(outage.give_up());
                }
            };
            if bound_handle != 0 {
                match driver.bind_fresh(bound_handle) {
                    Ok(()) => {}
                    Err(error) if error.is_connection_lost() => {
                        outage.last_error = error;
                        continue;
                    }
                    Err(
                        refusal @ (ClientError::Status { .. } | ClientError::UnknownStatus { .. }),
                    ) => {
                        driver.timeout = self.timeout;
                        self.reconnects += 1;
                        return Err(ReconnectFailure::TenantLost {
                            driver: Box::new(driver),
                            capabilities,
                            handle: bound_handle,
                            refusal,
                        });
                    }
                    Err(error) => {
                        outage.last_error = error;
                        return Err(outage.give_up());
                    }
                }
            }
            driver.timeout = self.timeout;
            self.reconnects += 1;
            return Ok((driver, capabilities));
        }
    }
}
