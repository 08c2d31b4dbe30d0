//! The std-socket driver under [`crate::Client`] and [`crate::PipelinedClient`]: moves bytes
//! between a non-blocking `TcpStream` and a [`ConnectionCore`].
//!
//! Why non-blocking even for the blocking API: a client that blocks in `send` while the
//! server blocks sending responses the client is not reading would deadlock once both
//! socket buffers fill. The driver always sends and receives in the same pass and waits with
//! `poll(2)` for either direction, so the blocking API only *looks* blocking.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::core::{ConnectionCore, CoreOptions};
use crate::error::{ClientError, ProtocolError};
use crate::sys;
use reflex_proto::native::Opcode;

use crate::types::Capabilities;

/// Request id of the HELLO sent when connecting; user ids start after it.
pub const HELLO_REQUEST_ID: u64 = 0;

/// How to connect.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Limit for connecting and for each blocking call; `None` waits forever.
    pub timeout: Option<Duration>,
    /// I/O priority declared in HELLO (`class << 13 | level`); `None` asks the kernel for the
    /// process's own with `ioprio_get` (see [`crate::io_priority_of_process`]).
    pub io_priority: Option<u16>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            timeout: Some(Duration::from_secs(30)),
            io_priority: None,
        }
    }
}

pub(crate) struct StreamDriver {
    stream: TcpStream,
    pub(crate) core: ConnectionCore,
    pub(crate) timeout: Option<Duration>,
    closed: bool,
}

impl StreamDriver {
    /// Connects with TCP_NODELAY, sends HELLO and waits for the capabilities.
    pub(crate) fn connect(
        addr: impl ToSocketAddrs,
        options: &ClientOptions,
    ) -> Result<(StreamDriver, Capabilities), ClientError> {
        let stream = connect_any(addr, options.timeout)?;
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        let mut driver = StreamDriver {
            stream,
            core: ConnectionCore::new(CoreOptions::default()),
            timeout: options.timeout,
            closed: false,
        };
        let io_priority = options
            .io_priority
            .unwrap_or_else(sys::io_priority_of_process);
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

    pub(crate) fn into_parts(self) -> (TcpStream, ConnectionCore) {
        assert!(!self.core.transmit_in_flight());
        assert!(!self.core.receive_in_flight());
        (self.stream, self.core)
    }

    pub(crate) fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// One non-blocking pass: sends what the socket takes, then receives once. Returns
    /// whether any byte moved.
    pub(crate) fn pump(&mut self) -> Result<bool, ClientError> {
        if self.closed {
            return Err(ClientError::Closed);
        }
        let mut progress = false;
        while let Some(bytes) = self.core.transmit_start() {
            match self.stream.write(bytes) {
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
            match self.stream.read(space) {
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
            if self.pump()? {
                continue;
            }
            if self.closed {
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
            let want_write = self.core.transmit_pending_bytes() > 0;
            sys::poll_socket(self.stream.as_raw_fd(), want_write, remaining)?;
        }
    }
}

fn connect_any(
    addr: impl ToSocketAddrs,
    timeout: Option<Duration>,
) -> Result<TcpStream, ClientError> {
    let mut last_error = None;
    for address in addr.to_socket_addrs()? {
        match connect_one(&address, timeout) {
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
