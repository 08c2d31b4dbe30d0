//! `limit-server`'s loop: the least work one thread can do to answer the original ReFlex
//! protocol with io_uring, as a yardstick for `reflexd`.
//!
//! Per connection: one receive in flight into a 4 KiB buffer; each receive's bytes go through
//! [`RequestParser`] (the 24-byte header and nothing more: no range check, the lba is ignored)
//! into a bounded queue of owed responses; one `sendmsg` at a time carries up to
//! [`BATCH_RESPONSES_MAX`] responses as iovecs — each header, then the data straight from one
//! static region (no copy in user space). Everything queued in an iteration goes to the kernel
//! in the iteration's single `io_uring_enter`, which sleeps (blocking) or returns at once
//! (`--poll`, spinning on the completion queue).
//!
//! Correctness it keeps: responses leave in request order; partial receives (the parser keeps
//! unfinished headers) and partial sends (the reactor keeps the unsent remainder) are handled;
//! a write's payload is discarded and the write answered with `lba_count` 0; a peer's EOF is
//! answered by sending everything owed, then closing; bad framing (bad magic, unknown opcode,
//! zero length, more than 1 MiB) closes that connection only, as the protocol has no status.
//! Back-pressure instead of growth: a connection's next receive is armed only while its queue
//! has room for everything one receive can bring.

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;

use reflex_proto::original::HEADER_SIZE;

use crate::uring::{Event, Reactor, ReactorConfig, STREAMS_MAX, Stop, TRANSMIT_HEADERS_MAX, Wait};
use crate::wire::{IO_SIZE_MAX_BYTES, RequestParser, Response};

/// Bytes one receive may bring.
pub const RECEIVE_BYTES: usize = 4096;
/// Responses in one `sendmsg`.
pub const BATCH_RESPONSES_MAX: usize = 64;
/// Requests one receive can complete: its bytes plus at most 23 of an unfinished header from
/// before, over 24 bytes a request, is ⌊(4096 + 23) / 24⌋ = ⌈4096 / 24⌉.
pub const RESPONSES_PER_RECEIVE_MAX: usize = RECEIVE_BYTES.div_ceil(HEADER_SIZE);
/// Owed responses per connection: two receives' worth, so a receive is armed while the
/// previous one's responses are still being sent.
pub const PENDING_MAX: usize = 2 * RESPONSES_PER_RECEIVE_MAX;
/// The `--connections-max` default.
pub const CONNECTIONS_MAX_DEFAULT: usize = 1024;
/// The largest `--connections-max`.
pub const CONNECTIONS_MAX_LIMIT: usize = STREAMS_MAX;

const _: () = assert!(BATCH_RESPONSES_MAX <= TRANSMIT_HEADERS_MAX);
const _: () = assert!(RESPONSES_PER_RECEIVE_MAX <= PENDING_MAX);

/// The static region every read's data comes from: 1 MiB of a byte pattern (`i mod 251`),
/// allocated once per process and never freed, so lending it to the kernel needs no care.
pub fn data_region() -> &'static [u8] {
    static DATA: OnceLock<Box<[u8]>> = OnceLock::new();
    DATA.get_or_init(|| {
        (0..IO_SIZE_MAX_BYTES as usize)
            .map(|index| (index % 251) as u8)
            .collect()
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerConfig {
    /// Open connections at most; more are accepted and closed at once.
    pub connections_max: usize,
    /// Spin on the completion queue instead of sleeping in `io_uring_enter`.
    pub poll: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            connections_max: CONNECTIONS_MAX_DEFAULT,
            poll: false,
        }
    }
}

/// Counters of one run, printed when the server stops.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ServerStats {
    pub connections_accepted: u64,
    /// Accepted beyond `connections_max` and closed at once.
    pub connections_refused: u64,
    /// Closed for bad framing.
    pub connections_refused_framing: u64,
    /// Closed on a socket error.
    pub connections_failed: u64,
    /// Accepts that failed (the first is logged).
    pub accept_errors: u64,
    /// Responses whose last byte was sent.
    pub responses_sent: u64,
    pub loop_iterations: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Open,
    /// The peer closed its side: send what is owed, then close.
    Draining,
    /// Shut down after bad framing or a socket error: close once nothing is in flight.
    Broken,
}

struct Connection {
    state: State,
    parser: RequestParser,
    pending: VecDeque<Response>,
    /// A receive was not armed for lack of room in `pending`.
    receive_deferred: bool,
}

impl Connection {
    fn new() -> Connection {
        Connection {
            state: State::Free,
            parser: RequestParser::default(),
            pending: VecDeque::with_capacity(PENDING_MAX),
            receive_deferred: false,
        }
    }

    fn reset(&mut self, state: State) {
        self.state = state;
        self.parser = RequestParser::default();
        self.pending.clear();
        self.receive_deferred = false;
    }

    fn has_room_for_a_receive(&self) -> bool {
        self.pending.len() + RESPONSES_PER_RECEIVE_MAX <= PENDING_MAX
    }
}

pub struct Server {
    listener: TcpListener,
    config: ServerConfig,
    stop: Stop,
}

impl Server {
    pub fn bind(address: SocketAddr, config: ServerConfig) -> io::Result<Server> {
        if !(1..=CONNECTIONS_MAX_LIMIT).contains(&config.connections_max) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("connections-max must be 1..={CONNECTIONS_MAX_LIMIT}"),
            ));
        }
        Ok(Server {
            listener: TcpListener::bind(address)?,
            config,
            stop: Stop::new()?,
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// What ends [`Server::run`] from another thread (limit-server's signal thread, a test).
    pub fn stop_handle(&self) -> Stop {
        self.stop.clone()
    }

    /// Serves until stopped; then closes everything and returns the counters.
    pub fn run(self) -> io::Result<ServerStats> {
        let reactor = Reactor::new(ReactorConfig {
            streams_max: self.config.connections_max,
            receive_bytes: RECEIVE_BYTES,
            transmit_headers_max: BATCH_RESPONSES_MAX,
            data: data_region(),
        })?;
        let mut core = Core {
            reactor,
            connections: (0..self.config.connections_max)
                .map(|_| Connection::new())
                .collect(),
            stats: ServerStats::default(),
        };
        core.run(&self.listener, &self.stop, self.config.poll)?;
        Ok(core.stats)
    }
}

struct Core {
    reactor: Reactor,
    connections: Vec<Connection>,
    stats: ServerStats,
}

impl Core {
    fn run(&mut self, listener: &TcpListener, stop: &Stop, poll: bool) -> io::Result<()> {
        let wait = if poll { Wait::Poll } else { Wait::Sleep(None) };
        let mut completions = Vec::with_capacity(self.reactor.completion_capacity());
        self.reactor.arm_accept(listener)?;
        self.reactor.arm_wake(stop)?;
        while !stop.is_stopped() {
            self.stats.loop_iterations += 1;
            self.reactor.enter(wait)?;
            self.reactor.reap(&mut completions);
            for completion in completions.drain(..) {
                let Some(event) = self.reactor.complete(completion) else {
                    continue;
                };
                match event {
                    // The loop condition sees the flag.
                    Event::Woken => {}
                    Event::Accepted(accepted) => {
                        self.reactor.arm_accept(listener)?;
                        match accepted {
                            Ok(socket) => self.open(socket)?,
                            Err(error) => {
                                // Logged once: out of descriptors, every retry fails alike.
                                if self.stats.accept_errors == 0 {
                                    eprintln!("limit-server: accept failed: {error}");
                                }
                                self.stats.accept_errors += 1;
                            }
                        }
                    }
                    Event::Received { stream, result } => self.received(stream, result)?,
                    Event::Sent {
                        stream,
                        result,
                        headers_completed,
                    } => self.sent(stream, result, headers_completed)?,
                }
            }
        }
        Ok(())
    }

    fn open(&mut self, socket: TcpStream) -> io::Result<()> {
        let _ = socket.set_nodelay(true);
        match self.reactor.insert(socket) {
            Ok(index) => {
                self.stats.connections_accepted += 1;
                let connection = &mut self.connections[index];
                assert_eq!(connection.state, State::Free);
                connection.reset(State::Open);
                self.reactor.arm_receive(index)
            }
            Err(socket) => {
                self.stats.connections_refused += 1;
                drop(socket);
                Ok(())
            }
        }
    }

    fn received(&mut self, index: usize, result: i32) -> io::Result<()> {
        let connection = &mut self.connections[index];
        match connection.state {
            State::Open if result > 0 => {
                let pending = &mut connection.pending;
                let parsed = connection
                    .parser
                    .handle_bytes(self.reactor.received(index), &mut |response| {
                        pending.push_back(response)
                    });
                debug_assert!(connection.pending.len() <= PENDING_MAX);
                if let Err(error) = parsed {
                    eprintln!("limit-server: closing a connection: {error}");
                    self.stats.connections_refused_framing += 1;
                    self.break_connection(index);
                } else {
                    if connection.has_room_for_a_receive() {
                        self.reactor.arm_receive(index)?;
                    } else {
                        connection.receive_deferred = true;
                    }
                    self.transmit(index)?;
                }
            }
            State::Open if result == 0 => {
                connection.state = State::Draining;
                self.transmit(index)?;
            }
            State::Open => {
                self.stats.connections_failed += 1;
                self.break_connection(index);
            }
            // The receive that a shutdown ended.
            State::Broken => {}
            State::Draining | State::Free => {
                unreachable!("receive completion on a {:?} connection", connection.state)
            }
        }
        self.close_if_done(index);
        Ok(())
    }

    fn sent(&mut self, index: usize, result: i32, headers_completed: usize) -> io::Result<()> {
        let connection = &mut self.connections[index];
        assert_ne!(connection.state, State::Free);
        self.stats.responses_sent += headers_completed as u64;
        match connection.state {
            // Owed responses were dropped; nothing more goes out.
            State::Broken => {}
            // A send of a non-empty transmit that returns 0 would repeat forever: an error too.
            _ if result <= 0 => {
                self.stats.connections_failed += 1;
                self.break_connection(index);
            }
            _ => {
                if connection.receive_deferred
                    && connection.state == State::Open
                    && connection.has_room_for_a_receive()
                {
                    connection.receive_deferred = false;
                    self.reactor.arm_receive(index)?;
                }
                self.transmit(index)?;
            }
        }
        self.close_if_done(index);
        Ok(())
    }

    /// Unless a send is in flight: appends owed responses to the transmit (after the unsent
    /// rest of a partial send, if any) and starts sending it.
    fn transmit(&mut self, index: usize) -> io::Result<()> {
        if self.reactor.send_in_flight(index) {
            return Ok(());
        }
        let connection = &mut self.connections[index];
        let transmit = self.reactor.transmit(index);
        while let Some(response) = connection.pending.front() {
            if !transmit.push(response.header, response.data_length_bytes as usize) {
                break;
            }
            connection.pending.pop_front();
        }
        if !transmit.is_empty() {
            self.reactor.arm_send(index)?;
        }
        Ok(())
    }

    fn break_connection(&mut self, index: usize) {
        let connection = &mut self.connections[index];
        connection.state = State::Broken;
        connection.pending.clear();
        self.reactor.shutdown(index);
    }

    fn close_if_done(&mut self, index: usize) {
        let connection = &mut self.connections[index];
        let done = self.reactor.is_idle(index)
            && match connection.state {
                State::Draining => {
                    connection.pending.is_empty() && self.reactor.transmit_is_empty(index)
                }
                State::Broken => true,
                State::Open | State::Free => false,
            };
        if done {
            self.reactor.close(index);
            connection.reset(State::Free);
        }
    }
}
