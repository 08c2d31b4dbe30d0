//! `limit-client`: a closed-loop load generator for any original-protocol server, one thread,
//! one io_uring.
//!
//! Each of `connections` connections keeps `depth` reads of `size_bytes` in flight at random
//! aligned offsets below `range_bytes`; every reply is checked (in order per connection: the
//! handle, the opcode, the lba and the length must be the request's) and answered with the
//! next request, all requests a connection has ready leaving in one `sendmsg`. The thread
//! sleeps in `io_uring_enter` whenever it waits (it never spins), and reads the clock once per
//! loop iteration: a request's latency runs from the iteration that queued it to the one that
//! reaped its last byte. A run is bounded either by time (stop sending at the deadline, then
//! collect what is in flight) or by a request count, and always by `timeout`.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use reflex_proto::original::{Header, Opcode, SECTOR_SIZE_BYTES};

use crate::uring::{Event, Reactor, ReactorConfig, STREAMS_MAX, TRANSMIT_HEADERS_MAX, Wait};
use crate::wire::{IO_SIZE_MAX_BYTES, ReplyError, ReplyParser, request};

/// Connections × depth at most (requests in flight).
pub const IN_FLIGHT_MAX: usize = 65_536;
/// Longest run.
pub const DURATION_MAX: Duration = Duration::from_secs(3600);
/// Most requests in count mode.
pub const REQUESTS_MAX: u64 = 1 << 40;
/// How long a run may take beyond its duration to collect the replies in flight.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest sleep in the kernel, so deadlines are noticed.
const SLEEP_MAX: Duration = Duration::from_millis(100);
/// Largest receive per connection.
const RECEIVE_BYTES_MAX: usize = 256 << 10;
/// Latencies above this are recorded as this.
const LATENCY_NS_MAX: u64 = 60_000_000_000;

/// When a run stops sending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Send for this long (after the warm-up), then collect the replies in flight.
    Duration(Duration),
    /// Send exactly this many requests in all and collect every reply.
    Requests(u64),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    pub address: SocketAddr,
    pub connections: usize,
    /// Requests in flight per connection.
    pub depth: usize,
    pub size_bytes: u32,
    /// Reads fall at random `size_bytes`-aligned offsets in `[0, range_bytes)`.
    pub range_bytes: u64,
    pub bound: Bound,
    /// Replies in this first stretch are neither timed nor counted in `replies`.
    pub warmup: Duration,
    pub seed: u64,
    /// The whole run (connecting included) fails beyond this.
    pub timeout: Duration,
}

impl ClientConfig {
    /// A config with the defaults: 1 connection at depth 1, 4 KiB reads over 1 GiB, 5 s.
    pub fn new(address: SocketAddr) -> ClientConfig {
        ClientConfig {
            address,
            connections: 1,
            depth: 1,
            size_bytes: 4096,
            range_bytes: 1 << 30,
            bound: Bound::Duration(Duration::from_secs(5)),
            warmup: Duration::ZERO,
            seed: 1,
            timeout: Duration::from_secs(5) + DRAIN_TIMEOUT,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=STREAMS_MAX).contains(&self.connections) {
            return Err(ConfigError::Connections { max: STREAMS_MAX });
        }
        if !(1..=TRANSMIT_HEADERS_MAX).contains(&self.depth) {
            return Err(ConfigError::Depth {
                max: TRANSMIT_HEADERS_MAX,
            });
        }
        if self.connections * self.depth > IN_FLIGHT_MAX {
            return Err(ConfigError::InFlight { max: IN_FLIGHT_MAX });
        }
        if self.size_bytes == 0
            || !self.size_bytes.is_multiple_of(SECTOR_SIZE_BYTES)
            || self.size_bytes > IO_SIZE_MAX_BYTES
        {
            return Err(ConfigError::Size {
                max: IO_SIZE_MAX_BYTES,
            });
        }
        if self.range_bytes < u64::from(self.size_bytes)
            || !self
                .range_bytes
                .is_multiple_of(u64::from(SECTOR_SIZE_BYTES))
        {
            return Err(ConfigError::Range);
        }
        match self.bound {
            Bound::Duration(duration) if duration.is_zero() || duration > DURATION_MAX => {
                return Err(ConfigError::Duration { max: DURATION_MAX });
            }
            Bound::Requests(count) if count == 0 || count > REQUESTS_MAX => {
                return Err(ConfigError::Requests { max: REQUESTS_MAX });
            }
            _ => {}
        }
        if self.warmup > DURATION_MAX {
            return Err(ConfigError::Duration { max: DURATION_MAX });
        }
        if self.timeout.is_zero() || self.timeout > 2 * DURATION_MAX {
            return Err(ConfigError::Timeout);
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("connections must be 1..={max}")]
    Connections { max: usize },
    #[error("depth must be 1..={max}")]
    Depth { max: usize },
    #[error("connections × depth must be at most {max}")]
    InFlight { max: usize },
    #[error("size must be a non-zero multiple of 512 bytes, at most {max}")]
    Size { max: u32 },
    #[error("the lba range must be a multiple of 512 bytes and at least the size")]
    Range,
    #[error("durations must be non-zero and at most {max:?}")]
    Duration { max: Duration },
    #[error("requests must be 1..={max}")]
    Requests { max: u64 },
    #[error("the timeout must be non-zero and at most two hours")]
    Timeout,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot connect to {address}: {source}")]
    Connect {
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("io_uring: {0}")]
    Ring(#[from] std::io::Error),
    #[error("connection {connection}: {source}")]
    Socket {
        connection: usize,
        source: std::io::Error,
    },
    #[error("connection {connection}: the server closed it with {outstanding} requests unanswered")]
    Closed {
        connection: usize,
        outstanding: usize,
    },
    #[error("connection {connection}: {source}")]
    Framing {
        connection: usize,
        source: ReplyError,
    },
    #[error("connection {connection}: {reason}")]
    BadReply { connection: usize, reason: String },
    #[error(
        "timed out after {timeout:?} with {outstanding} requests unanswered ({replies} replies)"
    )]
    Timeout {
        timeout: Duration,
        outstanding: usize,
        replies: u64,
    },
}

/// Latency percentiles of the timed replies, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Latency {
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    pub address: String,
    pub connections: usize,
    pub depth: usize,
    pub size_bytes: u32,
    pub range_bytes: u64,
    pub warmup_s: f64,
    /// From the end of the warm-up to the last reply.
    pub elapsed_s: f64,
    /// Replies after the warm-up.
    pub replies: u64,
    /// Every reply, warm-up included: what the server sent while the client ran.
    pub replies_total: u64,
    pub replies_per_sec: f64,
    pub latency: Latency,
    /// CPU time the client's thread used over the whole run (connecting included), from
    /// `/proc/thread-self/schedstat`; `None` where that file is missing. Over `elapsed_s` it
    /// says whether the client, not the server, set the pace.
    pub client_cpu_s: Option<f64>,
}

/// A request on the wire, for checking its reply.
#[derive(Debug, Clone, Copy)]
struct Outstanding {
    handle: u64,
    lba: u64,
    sent_at: Instant,
}

struct Connection {
    parser: ReplyParser,
    outstanding: VecDeque<Outstanding>,
    /// Requests to send as soon as the transmit is free.
    ready: usize,
    /// Next handle: the connection index in the top 16 bits, a sequence number below.
    next_handle: u64,
    /// Listed in `touched` this iteration.
    touched: bool,
}

/// SplitMix64: enough randomness for offsets, no dependency.
struct SplitMix64(u64);

impl SplitMix64 {
    #[inline]
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Runs the load described by `config` and reports it.
pub fn run(config: &ClientConfig) -> Result<Report, ClientError> {
    config.validate()?;
    let cpu_ns_before = thread_cpu_ns();
    let started = Instant::now();
    let hard_deadline = started + config.timeout;
    let mut sockets = Vec::with_capacity(config.connections);
    for _ in 0..config.connections {
        let socket =
            TcpStream::connect_timeout(&config.address, CONNECT_TIMEOUT).map_err(|source| {
                ClientError::Connect {
                    address: config.address,
                    source,
                }
            })?;
        let _ = socket.set_nodelay(true);
        sockets.push(socket);
    }
    let reply_bytes = 24 + config.size_bytes as usize;
    let receive_bytes = (config.depth * reply_bytes).clamp(4096, RECEIVE_BYTES_MAX);
    let mut reactor = Reactor::new(ReactorConfig {
        streams_max: config.connections,
        receive_bytes,
        transmit_headers_max: config.depth,
        data: &[],
    })?;
    let mut connections = Vec::with_capacity(config.connections);
    for (index, socket) in sockets.into_iter().enumerate() {
        let slot = reactor
            .insert(socket)
            .map_err(|_| std::io::Error::other("reactor full"))?;
        assert_eq!(slot, index);
        connections.push(Connection {
            parser: ReplyParser::default(),
            outstanding: VecDeque::with_capacity(config.depth),
            ready: 0,
            next_handle: (index as u64) << 48,
            touched: false,
        });
    }

    let lba_count = config.size_bytes / SECTOR_SIZE_BYTES;
    let slots_in_range = config.range_bytes / u64::from(config.size_bytes);
    let mut random = SplitMix64(config.seed);
    let mut histogram = Histogram::<u64>::new_with_bounds(1, LATENCY_NS_MAX, 3)
        .map_err(|error| std::io::Error::other(error.to_string()))?;

    // The request budget: `None` while sending is bounded by time.
    let mut budget = match config.bound {
        Bound::Requests(count) => Some(count),
        Bound::Duration(_) => None,
    };
    let start = Instant::now();
    let warmup_end = start + config.warmup;
    let send_deadline = match config.bound {
        Bound::Duration(duration) => Some(warmup_end + duration),
        Bound::Requests(_) => None,
    };
    let mut touched = Vec::with_capacity(config.connections);
    for (index, connection) in connections.iter_mut().enumerate() {
        let mut initial = config.depth as u64;
        if let Some(left) = budget.as_mut() {
            initial = initial.min(*left);
            *left -= initial;
        }
        connection.ready = initial as usize;
        connection.touched = true;
        touched.push(index);
        reactor.arm_receive(index)?;
    }
    let mut sending = true;
    let mut outstanding_total = 0usize;
    let mut replies_total = 0u64;
    let mut replies = 0u64;
    let mut last_reply_at = start;
    let mut completions = Vec::with_capacity(reactor.completion_capacity());
    let mut now = start;
    loop {
        // Send what became ready, one message per connection.
        for index in touched.drain(..) {
            let connection = &mut connections[index];
            connection.touched = false;
            if connection.ready == 0 || reactor.send_in_flight(index) {
                continue;
            }
            let transmit = reactor.transmit(index);
            while connection.ready > 0 && transmit.headers_free() > 0 {
                let lba = random.next() % slots_in_range * u64::from(lba_count);
                let handle = connection.next_handle;
                connection.next_handle += 1;
                let queued = transmit.push(request(Opcode::Read, handle, lba, lba_count), 0);
                debug_assert!(queued);
                connection.outstanding.push_back(Outstanding {
                    handle,
                    lba,
                    sent_at: now,
                });
                connection.ready -= 1;
                outstanding_total += 1;
            }
            reactor.arm_send(index)?;
        }
        if sending && send_deadline.is_some_and(|deadline| now >= deadline) {
            sending = false;
        }
        let all_sent = match budget {
            Some(left) => left == 0,
            None => !sending,
        };
        if all_sent && outstanding_total == 0 {
            break;
        }
        if now >= hard_deadline {
            return Err(ClientError::Timeout {
                timeout: config.timeout,
                outstanding: outstanding_total,
                replies: replies_total,
            });
        }
        let mut sleep = SLEEP_MAX.min(hard_deadline - now);
        if let Some(deadline) = send_deadline.filter(|_| sending) {
            sleep = sleep.min(deadline.saturating_duration_since(now));
        }
        reactor.enter(Wait::Sleep(Some(sleep.max(Duration::from_micros(1)))))?;
        now = Instant::now();
        reactor.reap(&mut completions);
        for completion in completions.drain(..) {
            let Some(event) = reactor.complete(completion) else {
                continue;
            };
            match event {
                Event::Received {
                    stream: index,
                    result,
                } => {
                    let connection = &mut connections[index];
                    if result == 0 {
                        return Err(ClientError::Closed {
                            connection: index,
                            outstanding: connection.outstanding.len(),
                        });
                    }
                    if result < 0 {
                        return Err(ClientError::Socket {
                            connection: index,
                            source: std::io::Error::from_raw_os_error(-result),
                        });
                    }
                    let mut completed = 0usize;
                    let handled = connection.parser.handle_bytes(
                        reactor.received(index),
                        &mut |header: Header| -> Result<(), ClientError> {
                            let expected = connection.outstanding.pop_front().ok_or_else(|| {
                                ClientError::BadReply {
                                    connection: index,
                                    reason: "a reply to no request".into(),
                                }
                            })?;
                            check_reply(index, &header, &expected, lba_count)?;
                            completed += 1;
                            if now >= warmup_end {
                                let latency_ns = now.duration_since(expected.sent_at).as_nanos();
                                histogram.saturating_record(
                                    u64::try_from(latency_ns).unwrap_or(u64::MAX).max(1),
                                );
                                replies += 1;
                            }
                            Ok(())
                        },
                    );
                    handled.map_err(|error| match error {
                        ClientError::Framing { source, .. } => ClientError::Framing {
                            connection: index,
                            source,
                        },
                        other => other,
                    })?;
                    outstanding_total -= completed;
                    replies_total += completed as u64;
                    if completed > 0 {
                        last_reply_at = now;
                    }
                    // Closed loop: each reply frees a place for the next request.
                    let mut next = if sending { completed as u64 } else { 0 };
                    if let Some(left) = budget.as_mut() {
                        next = next.min(*left);
                        *left -= next;
                    }
                    connection.ready += next as usize;
                    if connection.ready > 0 && !connection.touched {
                        connection.touched = true;
                        touched.push(index);
                    }
                    reactor.arm_receive(index)?;
                }
                Event::Sent {
                    stream: index,
                    result,
                    ..
                } => {
                    if result < 0 {
                        return Err(ClientError::Socket {
                            connection: index,
                            source: std::io::Error::from_raw_os_error(-result),
                        });
                    }
                    if !reactor.transmit(index).is_empty() {
                        reactor.arm_send(index)?;
                    } else if connections[index].ready > 0 && !connections[index].touched {
                        connections[index].touched = true;
                        touched.push(index);
                    }
                }
                Event::Accepted(_) | Event::Woken => {}
            }
        }
    }
    let elapsed = last_reply_at.saturating_duration_since(warmup_end);
    let elapsed_s = elapsed.as_secs_f64();
    let us = |ns: u64| ns as f64 / 1e3;
    let latency = if histogram.is_empty() {
        Latency {
            p50_us: 0.0,
            p90_us: 0.0,
            p99_us: 0.0,
            p999_us: 0.0,
            max_us: 0.0,
            mean_us: 0.0,
        }
    } else {
        Latency {
            p50_us: us(histogram.value_at_quantile(0.50)),
            p90_us: us(histogram.value_at_quantile(0.90)),
            p99_us: us(histogram.value_at_quantile(0.99)),
            p999_us: us(histogram.value_at_quantile(0.999)),
            max_us: us(histogram.max()),
            mean_us: histogram.mean() / 1e3,
        }
    };
    Ok(Report {
        address: config.address.to_string(),
        connections: config.connections,
        depth: config.depth,
        size_bytes: config.size_bytes,
        range_bytes: config.range_bytes,
        warmup_s: config.warmup.as_secs_f64(),
        elapsed_s,
        replies,
        replies_total,
        replies_per_sec: if elapsed_s > 0.0 {
            replies as f64 / elapsed_s
        } else {
            0.0
        },
        latency,
        client_cpu_s: thread_cpu_ns()
            .zip(cpu_ns_before)
            .map(|(after, before)| after.saturating_sub(before) as f64 / 1e9),
    })
}

/// CPU time of the calling thread in nanoseconds: the first field of its schedstat, which
/// the scheduler keeps exactly (no tick sampling).
fn thread_cpu_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

impl From<ReplyError> for ClientError {
    fn from(source: ReplyError) -> Self {
        // `run` replaces the placeholder with the connection the bytes came from.
        ClientError::Framing {
            connection: usize::MAX,
            source,
        }
    }
}

/// A reply must echo its request: opcode read, the handle, the lba and the length.
fn check_reply(
    connection: usize,
    header: &Header,
    expected: &Outstanding,
    lba_count: u32,
) -> Result<(), ClientError> {
    let handle = u64::from_le_bytes(header.handle);
    let reason = if header.opcode != Opcode::Read {
        format!("reply with opcode {:?} to a read", header.opcode)
    } else if handle != expected.handle {
        format!(
            "reply with handle {handle:#x} where {:#x} was due (replies out of order)",
            expected.handle
        )
    } else if header.lba != expected.lba {
        format!(
            "reply to handle {handle:#x} echoes lba {} instead of {}",
            header.lba, expected.lba
        )
    } else if header.lba_count != lba_count {
        format!(
            "reply to handle {handle:#x} carries {} sectors instead of {lba_count}",
            header.lba_count
        )
    } else {
        return Ok(());
    };
    Err(ClientError::BadReply { connection, reason })
}
