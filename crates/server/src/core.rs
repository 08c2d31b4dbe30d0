//! One dataplane thread: its io_uring, its connections, its requests and its buffer arena,
//! driven by one loop (ReFlex paper §3.1, two-step run to completion).
//!
//! A loop iteration:
//! 1. reap up to [`BATCH_MAX`] completions (accepts, receives, sends, device I/O, wake-ups)
//!    and poll devices that complete on their own (the emulated device);
//! 2. step one: parse the connections that received bytes, validate through the `proto`
//!    codecs, take a request slot and a buffer run, and enqueue;
//! 3. scheduling: the per-thread [`Scheduler`] (FIFO now, QoS later) releases requests to the
//!    devices, which prepare ring entries or finish synchronously;
//! 4. step two: completed device I/O becomes responses queued on their connections;
//! 5. one `sendmsg` per connection gathers many responses (header bytes and the data run
//!    itself: no copy between device buffer and socket);
//! 6. one `io_uring_enter` submits everything and, in blocking mode when idle, sleeps until
//!    a completion, a device deadline or an eventfd wake-up.
//!
//! Under low load each event is handled in the iteration it arrives; under load the batches
//! grow up to the cap. Everything is bounded: connections, request slots, the window per
//! connection, iovecs per send, device operations in flight, the arena. Running out of any of
//! them stalls the connection that needs it (backpressure) until something is freed; nothing
//! grows and no request is dropped.
//!
//! Request lifecycle ([`RequestState`], counted and asserted on every transition):
//! `Free → (NeedBuffer →) [Receiving →] Queued → Submitted → Completed ⇄ Sending → Free`;
//! immediate replies (errors, HELLO, NBD handshake output) go `Free/NeedBuffer → Completed`;
//! a request with several device operations (`steps`: NBD WRITE_ZEROES in chunks, a flush for
//! FUA) goes back `Submitted → Queued` between them. A request belonging to a closing
//! connection is freed as soon as no kernel operation uses it.
//!
//! Shutdown: listeners close; connections stop reading and close once their in-flight
//! requests are answered, except NBD sessions, which keep reading and answer new requests
//! ESHUTDOWN until then (`Connection::drain_reading`); then every device is flushed.
//!
//! WRITE payloads: bytes already in the connection's receive buffer are copied into the
//! request's run and the missing remainder is received directly into the run (no second
//! copy), except for small writes (header and payload within [`WRITE_GATHER_BYTES_MAX`]),
//! which are first gathered whole in the receive buffer so that many small pipelined writes
//! arrive in one receive.

use std::collections::VecDeque;
use std::fs::File;
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types};
use reflex_flash::{DeviceOp, DeviceQueue, FlashError, OpKind, Submit};
use reflex_qos::Nanos;

use crate::buffers::{PageAllocator, PageRun, RUN_SIZE_MAX, order_for};
use crate::frontend::{
    Action, Answer, Decoded, Frontend, IoKind, NbdExports, Protocol, RESPONSE_HEADER_SIZE_MAX, Tag,
};
use crate::namespaces::NamespaceSet;
use crate::sched::{FifoScheduler, IoClass, QueuedIo, Scheduler};
use crate::steps::{self, IoStep, Next, Start};
use crate::uring::{self, Arena, Cqe, Ring};

/// Completions handled per iteration (the paper's adaptive batching cap).
pub const BATCH_MAX: usize = 64;
pub const RING_SQ_ENTRIES: u32 = 1024;
pub const RING_CQ_ENTRIES: u32 = 8192;
/// Per-connection receive buffer: headers and small write payloads.
pub const RECV_BUFFER_SIZE: usize = 64 * 1024;
/// A WRITE whose header and payload fit in this many bytes is gathered whole in the receive
/// buffer; a larger one has its missing part received straight into its run.
pub const WRITE_GATHER_BYTES_MAX: usize = RECV_BUFFER_SIZE / 2;
/// iovecs in one `sendmsg` (two per response: header and data).
pub const SEND_IOVECS_MAX: usize = 128;
/// Device operations one thread keeps in flight.
pub const DEVICE_IN_FLIGHT_PER_THREAD_MAX: u32 = 1024;
/// How long a shutdown waits for clients to take their last responses.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

const _: () = assert!(BATCH_MAX <= RING_CQ_ENTRIES as usize);
const _: () = assert!(SEND_IOVECS_MAX >= 2 && SEND_IOVECS_MAX.is_multiple_of(2));
const _: () = assert!(SEND_IOVECS_MAX <= 1024); // IOV_MAX
const _: () = assert!(
    reflex_proto::native::REQUEST_HEADER_SIZE + reflex_proto::native::HELLO_BODY_SIZE
        < RECV_BUFFER_SIZE / 2
);

const NONE: u32 = u32::MAX;

/// `user_data`: kind (4 bits) | generation (28 bits) | index (32 bits). Kinds from
/// [`Kind::Wake`] up are the reserved band for internal operations.
mod token {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(u8)]
    pub enum Kind {
        Accept = 1,
        Recv = 2,
        Send = 3,
        Device = 4,
        Wake = 0xC,
        Cancel = 0xD,
        Flush = 0xE,
    }

    pub const GENERATION_MASK: u32 = (1 << 28) - 1;

    pub fn encode(kind: Kind, generation: u32, index: u32) -> u64 {
        ((kind as u64) << 60) | (u64::from(generation & GENERATION_MASK) << 32) | u64::from(index)
    }

    pub fn decode(user_data: u64) -> Option<(Kind, u32, u32)> {
        let kind = match user_data >> 60 {
            1 => Kind::Accept,
            2 => Kind::Recv,
            3 => Kind::Send,
            4 => Kind::Device,
            0xC => Kind::Wake,
            0xD => Kind::Cancel,
            0xE => Kind::Flush,
            _ => return None,
        };
        Some((
            kind,
            ((user_data >> 32) as u32) & GENERATION_MASK,
            user_data as u32,
        ))
    }

    pub fn next_generation(generation: u32) -> u32 {
        generation.wrapping_add(1) & GENERATION_MASK
    }
}
use token::Kind;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RequestState {
    Free = 0,
    NeedBuffer = 1,
    Receiving = 2,
    Queued = 3,
    Submitted = 4,
    Completed = 5,
    Sending = 6,
}
const REQUEST_STATE_COUNT: usize = 7;

impl RequestState {
    /// Legal moves; freeing early is legal only when no kernel operation uses the request.
    fn can_become(self, to: RequestState) -> bool {
        use RequestState::*;
        matches!(
            (self, to),
            (Free, NeedBuffer | Receiving | Queued | Completed)
                | (NeedBuffer, Receiving | Queued | Completed | Free)
                | (Receiving, Queued | Free)
                | (Queued, Submitted | Free)
                | (Submitted, Completed | Queued | Free)
                | (Completed, Sending | Free)
                | (Sending, Completed | Free)
        )
    }
}

struct Request {
    state: RequestState,
    generation: u32,
    connection_index: u32,
    tag: Tag,
    action: Action,
    /// The device operation the request is at (most requests have one step).
    step: IoStep,
    run: Option<PageRun>,
    /// WRITE payload bytes in the run so far.
    received_bytes: u32,
    header: [u8; RESPONSE_HEADER_SIZE_MAX],
    header_len: u8,
    /// Bytes of the run sent after the header (READ data, HELLO body).
    data_bytes: u32,
    /// Next request in the connection's send queue.
    next: u32,
}

impl Request {
    fn empty() -> Request {
        Request {
            state: RequestState::Free,
            generation: 0,
            connection_index: NONE,
            tag: Tag::None,
            action: Action::Reply(Answer::Ok),
            step: IoStep::Primary,
            run: None,
            received_bytes: 0,
            header: [0; RESPONSE_HEADER_SIZE_MAX],
            header_len: 0,
            data_bytes: 0,
            next: NONE,
        }
    }

    fn response_len(&self) -> usize {
        usize::from(self.header_len) + self.data_bytes as usize
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnectionState {
    Free,
    Open,
    /// Aborting: operations are cancelled, requests freed as they come back.
    Closing,
}

/// The kernel's view of one `sendmsg`: lives in a box owned by the connection slot.
struct SendStaging {
    msghdr: libc::msghdr,
    iovecs: [libc::iovec; SEND_IOVECS_MAX],
}

struct Connection {
    state: ConnectionState,
    generation: u32,
    stream: Option<std::net::TcpStream>,
    fd: i32,
    frontend: Frontend,
    recv_buffer: Box<[u8]>,
    recv_start: usize,
    recv_end: usize,
    recv_in_flight: bool,
    /// The request whose WRITE payload is being received straight into its run.
    recv_into: Option<u32>,
    /// No more receives: the peer closed its side, or the server is draining.
    read_closed: bool,
    /// Shutdown: answer what is in flight, then close.
    draining: bool,
    /// While draining, keep reading and answer new requests with a refusal (NBD's
    /// ESHUTDOWN) until nothing is outstanding; otherwise parse nothing new.
    drain_reading: bool,
    /// Payload bytes of a refused request still to discard.
    skip_bytes: u64,
    /// The request at the head of the stream waiting for a buffer run.
    stalled: Option<u32>,
    /// Requests of this connection not yet freed; at most the window.
    outstanding: u32,
    send_head: u32,
    send_tail: u32,
    send_in_flight: bool,
    sending_count: u32,
    /// Bytes of the head response already sent.
    send_offset_bytes: usize,
    staging: Option<Box<SendStaging>>,
    in_parse_ready: bool,
    in_send_ready: bool,
    in_waiters: bool,
}

impl Connection {
    fn empty() -> Connection {
        Connection {
            state: ConnectionState::Free,
            generation: 0,
            stream: None,
            fd: -1,
            frontend: Frontend::Native,
            recv_buffer: Box::new([]),
            recv_start: 0,
            recv_end: 0,
            recv_in_flight: false,
            recv_into: None,
            read_closed: false,
            draining: false,
            drain_reading: false,
            skip_bytes: 0,
            stalled: None,
            outstanding: 0,
            send_head: NONE,
            send_tail: NONE,
            send_in_flight: false,
            sending_count: 0,
            send_offset_bytes: 0,
            staging: None,
            in_parse_ready: false,
            in_send_ready: false,
            in_waiters: false,
        }
    }
}

struct Listener {
    socket: Option<TcpListener>,
    protocol: Protocol,
    accept_in_flight: bool,
    /// No free connection slot: re-armed when one frees.
    paused: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    Draining { deadline: Nanos, aborted: bool },
    Flushing,
    Finished,
}

/// Counters a thread reports when it exits (and, later, to metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CoreStats {
    pub iterations: u64,
    pub completions: u64,
    pub connections_accepted: u64,
    pub connections_refused_full: u64,
    pub requests_answered: u64,
    pub requests_per_state: [u32; REQUEST_STATE_COUNT],
    pub transitions: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub io_errors: u64,
    pub sends: u64,
    pub receives: u64,
    pub buffer_waits: u64,
    pub sq_full_flushes: u64,
    pub registered_buffers: bool,
    pub flush_errors: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("io_uring setup failed: {0}")]
    RingSetup(std::io::Error),
    #[error("io_uring_enter failed: {0}")]
    Enter(std::io::Error),
    #[error("eventfd: {0}")]
    Eventfd(std::io::Error),
}

/// What a thread needs to start.
pub struct CoreSetup {
    pub thread_index: usize,
    pub listeners: Vec<(TcpListener, Protocol)>,
    pub namespaces: Arc<NamespaceSet>,
    /// The NBD export table, when the server listens for NBD.
    pub nbd_exports: Option<Arc<NbdExports>>,
    pub poll: bool,
    pub window: u32,
    pub arena_bytes: usize,
    pub connections_max: u32,
    pub requests_max: u32,
    pub register_buffers: bool,
    pub shutdown: Arc<AtomicBool>,
    pub waker: Arc<File>,
    pub clock_origin: Instant,
    /// The thread's scheduler; `None` is the FIFO passthrough.
    pub scheduler: Option<Box<dyn Scheduler + Send>>,
}

pub struct Core {
    // Field order matters: the ring is dropped before the memory it may point into.
    ring: Ring,
    arena: Arena,
    pages: PageAllocator,
    registered: bool,
    requests: Box<[Request]>,
    free_requests: Vec<u32>,
    connections: Box<[Connection]>,
    free_connections: Vec<u32>,
    listeners: Vec<Listener>,
    namespaces: Arc<NamespaceSet>,
    nbd_exports: Option<Arc<NbdExports>>,
    queues: Vec<Box<dyn DeviceQueue>>,
    /// Per namespace: whether the device discards (it says so and has not refused one on
    /// this thread). NBD TRIM and WRITE_ZEROES skip the discard where it does not.
    discards: Vec<bool>,
    scheduler: Box<dyn Scheduler + Send>,
    parse_ready: VecDeque<u32>,
    send_ready: VecDeque<u32>,
    waiters: VecDeque<u32>,
    resources_freed: bool,
    /// Synchronous device completions, turned into responses in step two.
    done: Vec<(u32, Result<u32, FlashError>)>,
    polled: Vec<reflex_flash::Completion>,
    cqes: Box<[Cqe; BATCH_MAX]>,
    wake_word: Box<u64>,
    wake_in_flight: bool,
    waker: Arc<File>,
    shutdown: Arc<AtomicBool>,
    phase: Phase,
    flushes_pending: u32,
    ops_in_flight: u64,
    device_in_flight: u32,
    poll: bool,
    window: u32,
    clock_origin: Instant,
    thread_index: usize,
    stats: CoreStats,
}

impl Core {
    pub fn new(setup: CoreSetup) -> Result<Core, CoreError> {
        assert!(setup.window > 0);
        assert!(setup.requests_max >= setup.window);
        assert!(setup.arena_bytes >= crate::buffers::RUN_SIZE_MAX);
        let mut ring = Ring::new(RING_SQ_ENTRIES, RING_CQ_ENTRIES).map_err(CoreError::RingSetup)?;
        let arena = Arena::new(setup.arena_bytes);
        let registered = setup.register_buffers
            && match ring.register_arena(&arena) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(thread = setup.thread_index, error = %e,
                        "cannot register the buffer arena; using unregistered buffers");
                    false
                }
            };
        let page_count = (setup.arena_bytes / crate::buffers::PAGE_SIZE) as u32;
        let requests: Box<[Request]> = (0..setup.requests_max).map(|_| Request::empty()).collect();
        let connections: Box<[Connection]> = (0..setup.connections_max)
            .map(|_| Connection::empty())
            .collect();
        let queues = (0..setup.namespaces.len())
            .map(|index| setup.namespaces.device(index as u16).queue())
            .collect();
        let listeners = setup
            .listeners
            .into_iter()
            .map(|(socket, protocol)| Listener {
                socket: Some(socket),
                protocol,
                accept_in_flight: false,
                paused: false,
            })
            .collect();
        let stats = CoreStats {
            registered_buffers: registered,
            requests_per_state: [setup.requests_max, 0, 0, 0, 0, 0, 0],
            ..CoreStats::default()
        };
        Ok(Core {
            ring,
            arena,
            pages: PageAllocator::new(page_count),
            registered,
            free_requests: (0..setup.requests_max).rev().collect(),
            requests,
            free_connections: (0..setup.connections_max).rev().collect(),
            connections,
            listeners,
            discards: (0..setup.namespaces.len())
                .map(|index| setup.namespaces.info(index as u16).supports_trim)
                .collect(),
            namespaces: setup.namespaces,
            nbd_exports: setup.nbd_exports,
            queues,
            scheduler: match setup.scheduler {
                Some(scheduler) => scheduler,
                None => Box::new(FifoScheduler::new(setup.requests_max as usize)),
            },
            parse_ready: VecDeque::with_capacity(setup.connections_max as usize),
            send_ready: VecDeque::with_capacity(setup.connections_max as usize),
            waiters: VecDeque::with_capacity(setup.connections_max as usize),
            resources_freed: false,
            done: Vec::with_capacity(DEVICE_IN_FLIGHT_PER_THREAD_MAX as usize),
            polled: Vec::with_capacity(DEVICE_IN_FLIGHT_PER_THREAD_MAX as usize),
            cqes: Box::new([Cqe::default(); BATCH_MAX]),
            wake_word: Box::new(0),
            wake_in_flight: false,
            waker: setup.waker,
            shutdown: setup.shutdown,
            phase: Phase::Running,
            flushes_pending: 0,
            ops_in_flight: 0,
            device_in_flight: 0,
            poll: setup.poll,
            window: setup.window,
            clock_origin: setup.clock_origin,
            thread_index: setup.thread_index,
            stats,
        })
    }

    pub fn registered_buffers(&self) -> bool {
        self.registered
    }

    fn now(&self) -> Nanos {
        Nanos(self.clock_origin.elapsed().as_nanos() as u64)
    }

    /// Runs until shutdown has drained every connection and flushed every device.
    pub fn run(mut self) -> Result<CoreStats, CoreError> {
        let result = self.run_loop();
        if self.ops_in_flight > 0 {
            // Only reachable through an enter error: do not free memory the kernel may use.
            self.arena.leak_on_drop();
            for connection in self.connections.iter_mut() {
                std::mem::forget(connection.staging.take());
                std::mem::forget(std::mem::take(&mut connection.recv_buffer));
            }
        }
        result.map(|()| {
            let mut stats = self.stats.clone();
            stats.sq_full_flushes = self.ring.full_flush_count();
            stats
        })
    }

    fn run_loop(&mut self) -> Result<(), CoreError> {
        self.arm_wake();
        for index in 0..self.listeners.len() {
            self.arm_accept(index as u32);
        }
        loop {
            let now = self.now();
            self.stats.iterations += 1;
            // 1. Completions.
            let reaped = self.ring.reap(&mut self.cqes[..]);
            for slot in 0..reaped {
                let cqe = self.cqes[slot];
                self.handle_cqe(cqe, now);
            }
            self.poll_devices(now);
            self.advance_phase(now);
            if self.phase == Phase::Finished && self.ops_in_flight == 0 {
                return Ok(());
            }
            // 2. Step one: parse and enqueue.
            self.parse_step(now);
            // 3. Scheduling and device submission.
            self.dispatch_step(now);
            // 4. Step two: synchronous completions become responses.
            self.finish_done(now);
            // 5. Sends.
            self.send_step();
            // 6. One enter.
            let busy = !self.parse_ready.is_empty()
                || !self.send_ready.is_empty()
                || !self.done.is_empty()
                || (self.resources_freed && !self.waiters.is_empty())
                || (self.scheduler.queued_count() > 0
                    && self.device_in_flight < DEVICE_IN_FLIGHT_PER_THREAD_MAX)
                || self.phase_ready()
                || self.ring.more_in_cq();
            let wait = !self.poll && !busy;
            let timeout = if wait { self.sleep_bound(now) } else { None };
            self.ring.enter(wait, timeout).map_err(CoreError::Enter)?;
        }
    }

    /// The longest the thread may sleep: until the earliest device or scheduler deadline.
    fn sleep_bound(&self, now: Nanos) -> Option<Duration> {
        let mut deadline = self.scheduler.next_deadline();
        for queue in &self.queues {
            if let Some(due) = queue.next_deadline() {
                deadline = Some(deadline.map_or(due, |d| d.min(due)));
            }
        }
        if let Phase::Draining {
            deadline: drain, ..
        } = self.phase
        {
            deadline = Some(deadline.map_or(drain, |d| d.min(drain)));
        }
        deadline.map(|due| Duration::from_nanos(due.saturating_since(now).0.max(1_000)))
    }

    fn push_op(&mut self, entry: &squeue::Entry) {
        if let Err(e) = self.ring.push(entry) {
            // A failed flush of a full queue: the entry was not queued; report it like the
            // kernel would so the owner's state machine unwinds.
            panic!("submission queue flush failed: {e}");
        }
        self.ops_in_flight += 1;
    }

    fn handle_cqe(&mut self, cqe: Cqe, now: Nanos) {
        self.stats.completions += 1;
        assert!(self.ops_in_flight > 0, "completion with nothing in flight");
        self.ops_in_flight -= 1;
        let Some((kind, generation, index)) = token::decode(cqe.user_data) else {
            panic!("completion with unknown user_data {:#x}", cqe.user_data);
        };
        match kind {
            Kind::Accept => self.on_accept(index, cqe.result),
            Kind::Recv => self.on_recv(index, generation, cqe.result, now),
            Kind::Send => self.on_send(index, generation, cqe.result),
            Kind::Device => {
                let request = &self.requests[index as usize];
                assert_eq!(request.generation, generation, "stale device completion");
                assert_eq!(request.state, RequestState::Submitted);
                let Action::Io(io) = request.action else {
                    panic!("device completion for a request without I/O");
                };
                let result = self.queues[usize::from(io.namespace_index)]
                    .complete_ring(cqe.user_data, cqe.result);
                self.complete_io(index, result, now);
            }
            Kind::Wake => {
                self.wake_in_flight = false;
                if self.phase != Phase::Finished {
                    self.arm_wake();
                }
            }
            Kind::Cancel => {}
            Kind::Flush => self.on_shutdown_flush(index, cqe.result),
        }
    }

    fn poll_devices(&mut self, now: Nanos) {
        let mut polled = std::mem::take(&mut self.polled);
        for queue in self.queues.iter_mut() {
            queue.poll_completions(now, &mut polled);
        }
        for completion in polled.drain(..) {
            match token::decode(completion.user_data) {
                Some((Kind::Device, generation, index)) => {
                    assert_eq!(self.requests[index as usize].generation, generation);
                    self.complete_io(index, completion.result, now);
                }
                Some((Kind::Flush, _, index)) => {
                    let result = match completion.result {
                        Ok(_) => 0,
                        Err(_) => -libc::EIO,
                    };
                    self.on_shutdown_flush(index, result);
                }
                other => panic!("device reported an unknown completion {other:?}"),
            }
        }
        self.polled = polled;
    }

    // ----- Listeners and the wake-up eventfd -------------------------------------------------

    fn arm_wake(&mut self) {
        assert!(!self.wake_in_flight);
        let pointer: *mut u64 = &mut *self.wake_word;
        let entry = opcode::Read::new(types::Fd(self.waker.as_raw_fd()), pointer.cast(), 8)
            .build()
            .user_data(token::encode(Kind::Wake, 0, 0));
        self.push_op(&entry);
        self.wake_in_flight = true;
    }

    fn arm_accept(&mut self, listener_index: u32) {
        let listener = &mut self.listeners[listener_index as usize];
        let Some(socket) = &listener.socket else {
            return;
        };
        if listener.accept_in_flight {
            return;
        }
        if self.free_connections.is_empty() {
            listener.paused = true;
            return;
        }
        listener.paused = false;
        listener.accept_in_flight = true;
        let entry = opcode::Accept::new(
            types::Fd(socket.as_raw_fd()),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
        .flags(libc::SOCK_CLOEXEC)
        .build()
        .user_data(token::encode(Kind::Accept, 0, listener_index));
        self.push_op(&entry);
    }

    fn on_accept(&mut self, listener_index: u32, result: i32) {
        let running = self.phase == Phase::Running;
        let listener = &mut self.listeners[listener_index as usize];
        assert!(listener.accept_in_flight);
        listener.accept_in_flight = false;
        let protocol = listener.protocol;
        if !running {
            listener.socket = None;
            if result >= 0 {
                drop(uring::adopt_accepted(result));
            }
            return;
        }
        if result < 0 {
            if -result != libc::ECANCELED {
                tracing::warn!(thread = self.thread_index, errno = -result, "accept failed");
            }
            self.arm_accept(listener_index);
            return;
        }
        let stream = uring::adopt_accepted(result);
        let Some(index) = self.free_connections.pop() else {
            self.stats.connections_refused_full += 1;
            tracing::warn!(
                thread = self.thread_index,
                "connection table full; closing a new connection"
            );
            drop(stream);
            self.arm_accept(listener_index);
            return;
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY refused");
        }
        self.stats.connections_accepted += 1;
        let connection = &mut self.connections[index as usize];
        assert_eq!(connection.state, ConnectionState::Free);
        assert_eq!(connection.outstanding, 0);
        let generation = connection.generation;
        let recv_buffer = std::mem::take(&mut connection.recv_buffer);
        let staging = connection.staging.take();
        *connection = Connection::empty();
        connection.generation = generation;
        connection.recv_buffer = if recv_buffer.is_empty() {
            vec![0u8; RECV_BUFFER_SIZE].into_boxed_slice()
        } else {
            recv_buffer
        };
        connection.staging = staging;
        connection.state = ConnectionState::Open;
        connection.fd = stream.as_raw_fd();
        connection.stream = Some(stream);
        connection.frontend = Frontend::new(protocol, self.nbd_exports.as_ref());
        // Parsing first: a protocol may speak before it listens (the NBD greeting); the
        // others find nothing to parse and receive.
        self.mark_parse(index);
        self.arm_accept(listener_index);
    }

    // ----- Shutdown --------------------------------------------------------------------------

    /// Moves through the shutdown phases as far as their conditions allow.
    fn advance_phase(&mut self, now: Nanos) {
        loop {
            let before = self.phase;
            self.advance_phase_once(now);
            if self.phase == before {
                return;
            }
        }
    }

    /// Whether [`advance_phase`](Self::advance_phase) would move on now (the loop must not
    /// sleep then).
    fn phase_ready(&self) -> bool {
        match self.phase {
            Phase::Running => self.shutdown.load(Ordering::Relaxed),
            Phase::Draining { .. } => self.drained(),
            Phase::Flushing => self.flushes_pending == 0,
            Phase::Finished => self.ops_in_flight == 0,
        }
    }

    fn drained(&self) -> bool {
        self.free_connections.len() == self.connections.len()
            && self.listeners.iter().all(|l| !l.accept_in_flight)
            && self.device_in_flight == 0
            && self.scheduler.queued_count() == 0
    }

    fn advance_phase_once(&mut self, now: Nanos) {
        match self.phase {
            Phase::Running => {
                if self.shutdown.load(Ordering::Relaxed) {
                    self.start_drain(now);
                }
            }
            Phase::Draining { deadline, aborted } => {
                if !aborted && now >= deadline {
                    tracing::warn!(
                        thread = self.thread_index,
                        "drain timeout: closing connections that still have responses pending"
                    );
                    self.phase = Phase::Draining {
                        deadline,
                        aborted: true,
                    };
                    for index in 0..self.connections.len() as u32 {
                        if self.connections[index as usize].state == ConnectionState::Open {
                            self.abort_connection(index, "drain timeout");
                        }
                    }
                }
                if self.drained() {
                    self.start_flush(now);
                }
            }
            Phase::Flushing => {
                if self.flushes_pending == 0 {
                    self.phase = Phase::Finished;
                    if self.wake_in_flight {
                        let entry = opcode::AsyncCancel::new(token::encode(Kind::Wake, 0, 0))
                            .build()
                            .user_data(token::encode(Kind::Cancel, 0, 0));
                        self.push_op(&entry);
                    }
                }
            }
            Phase::Finished => {}
        }
    }

    fn start_drain(&mut self, now: Nanos) {
        tracing::debug!(thread = self.thread_index, "draining");
        self.phase = Phase::Draining {
            deadline: now + Nanos(DRAIN_TIMEOUT.as_nanos() as u64),
            aborted: false,
        };
        for index in 0..self.listeners.len() {
            if self.listeners[index].accept_in_flight {
                let entry = opcode::AsyncCancel::new(token::encode(Kind::Accept, 0, index as u32))
                    .build()
                    .user_data(token::encode(Kind::Cancel, 0, 0));
                self.push_op(&entry);
            } else {
                self.listeners[index].socket = None;
            }
        }
        for index in 0..self.connections.len() as u32 {
            if self.connections[index as usize].state != ConnectionState::Open {
                continue;
            }
            let connection = &mut self.connections[index as usize];
            connection.draining = true;
            let keep_reading = connection.frontend.begin_shutdown();
            if keep_reading && connection.outstanding > 0 {
                // In-flight requests finish (a stalled one included); requests arriving
                // meanwhile are refused; the connection closes once nothing is outstanding
                // (`stop_reading_if_drained`).
                connection.drain_reading = true;
                continue;
            }
            self.stop_reading(index);
            if let Some(request) = self.connections[index as usize].stalled.take() {
                self.free_request(request);
            }
            self.maybe_close_idle(index);
        }
    }

    /// Reads nothing more on a connection: cancels its receive (the completion closes it
    /// once idle).
    fn stop_reading(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        connection.read_closed = true;
        connection.drain_reading = false;
        if connection.recv_in_flight {
            let target = token::encode(Kind::Recv, connection.generation, index);
            self.cancel(target);
        }
    }

    /// A draining connection that kept reading closes once everything it received is
    /// answered and sent. Returns whether it stopped.
    fn stop_reading_if_drained(&mut self, index: u32) -> bool {
        let connection = &self.connections[index as usize];
        if !(connection.drain_reading
            && connection.outstanding == 0
            && connection.stalled.is_none()
            && connection.recv_into.is_none())
        {
            return false;
        }
        self.stop_reading(index);
        self.maybe_close_idle(index);
        true
    }

    fn start_flush(&mut self, now: Nanos) {
        self.phase = Phase::Flushing;
        for index in 0..self.queues.len() {
            let op = DeviceOp {
                user_data: token::encode(Kind::Flush, 0, index as u32),
                kind: OpKind::Flush,
                buf_index: None,
                queue: 0,
            };
            match self.queues[index].submit(op, now) {
                Submit::Ring(entry) => {
                    self.push_op(&entry);
                    self.flushes_pending += 1;
                }
                Submit::Done(Ok(_)) => {}
                Submit::Done(Err(e)) => {
                    self.stats.flush_errors += 1;
                    tracing::error!(namespace = self.namespaces.id(index as u16), error = %e, "shutdown flush failed");
                }
                Submit::Pending => self.flushes_pending += 1,
            }
        }
    }

    fn on_shutdown_flush(&mut self, namespace_index: u32, result: i32) {
        assert!(self.flushes_pending > 0);
        self.flushes_pending -= 1;
        if result < 0 {
            self.stats.flush_errors += 1;
            tracing::error!(
                namespace = self.namespaces.id(namespace_index as u16),
                errno = -result,
                "shutdown flush failed"
            );
        }
    }

    fn cancel(&mut self, target_user_data: u64) {
        let entry = opcode::AsyncCancel::new(target_user_data)
            .build()
            .user_data(token::encode(Kind::Cancel, 0, 0));
        self.push_op(&entry);
    }

    // ----- Requests --------------------------------------------------------------------------

    fn transition(&mut self, index: u32, to: RequestState) {
        let request = &mut self.requests[index as usize];
        let from = request.state;
        assert!(
            from.can_become(to),
            "request {index}: illegal {from:?} -> {to:?}"
        );
        request.state = to;
        self.stats.requests_per_state[from as usize] -= 1;
        self.stats.requests_per_state[to as usize] += 1;
        self.stats.transitions += 1;
    }

    fn allocate_request(&mut self, connection_index: u32, tag: Tag, action: Action) -> u32 {
        let Some(index) = self.free_requests.pop() else {
            panic!("allocate_request without a free slot (caller checks)");
        };
        let request = &mut self.requests[index as usize];
        assert_eq!(request.state, RequestState::Free);
        assert!(request.run.is_none());
        request.connection_index = connection_index;
        request.tag = tag;
        request.action = action;
        request.step = IoStep::Primary;
        request.received_bytes = 0;
        request.header_len = 0;
        request.data_bytes = 0;
        request.next = NONE;
        let connection = &mut self.connections[connection_index as usize];
        connection.outstanding += 1;
        assert!(connection.outstanding <= self.window);
        index
    }

    fn free_request(&mut self, index: u32) {
        self.transition(index, RequestState::Free);
        let request = &mut self.requests[index as usize];
        request.generation = token::next_generation(request.generation);
        if let Some(run) = request.run.take() {
            self.pages.free(run);
        }
        let connection_index = request.connection_index;
        request.connection_index = NONE;
        self.free_requests.push(index);
        self.resources_freed = true;
        let connection = &mut self.connections[connection_index as usize];
        assert!(connection.outstanding > 0);
        connection.outstanding -= 1;
        if connection.state == ConnectionState::Open {
            // The window may have opened, or the connection may now be idle.
            self.mark_parse(connection_index);
        }
    }

    /// Gives the request its buffer run and moves it on; false when the arena is exhausted.
    fn try_start(&mut self, index: u32, now: Nanos) -> bool {
        let action = self.requests[index as usize].action;
        match action {
            Action::Reply(_) => panic!("replies need no start"),
            Action::Hello => {
                let size = Frontend::hello_body_size_max(&self.namespaces);
                let Some(run) = self.pages.allocate(order_for(size)) else {
                    self.stats.buffer_waits += 1;
                    return false;
                };
                let window = self.window;
                let body = self.arena.run_mut(run, size);
                let length = Frontend::write_hello_body(&self.namespaces, window, body);
                self.requests[index as usize].run = Some(run);
                self.respond(index, Answer::Ok, length as u32);
                true
            }
            Action::Output => {
                let connection_index = self.requests[index as usize].connection_index;
                let pending = self.connections[connection_index as usize]
                    .frontend
                    .pending_output_bytes();
                assert!(pending > 0, "an output request without output");
                let size = pending.min(RUN_SIZE_MAX);
                let Some(run) = self.pages.allocate(order_for(size)) else {
                    self.stats.buffer_waits += 1;
                    return false;
                };
                let out = self.arena.run_mut(run, size);
                let written = self.connections[connection_index as usize]
                    .frontend
                    .write_output(out);
                assert_eq!(written, size);
                self.requests[index as usize].run = Some(run);
                self.respond(index, Answer::Ok, written as u32);
                true
            }
            Action::Io(io) => {
                let run_bytes = steps::run_bytes(io.kind, io.length_bytes, RUN_SIZE_MAX);
                let first =
                    steps::first_step(io.kind, self.discards[usize::from(io.namespace_index)]);
                if let Start::Answer(answer) = first {
                    self.respond(index, answer, 0);
                    return true;
                }
                if run_bytes > 0 {
                    let Some(run) = self.pages.allocate(order_for(run_bytes)) else {
                        self.stats.buffer_waits += 1;
                        return false;
                    };
                    self.requests[index as usize].run = Some(run);
                }
                if let IoKind::Write { .. } = io.kind {
                    self.take_write_payload(index, now);
                } else {
                    if let Start::Submit(step) = first {
                        self.set_step(index, step);
                    }
                    self.enqueue(index, now);
                }
                true
            }
        }
    }

    /// Moves a request to `step`; a zero fill starts by zeroing the request's run.
    fn set_step(&mut self, index: u32, step: IoStep) {
        let request = &mut self.requests[index as usize];
        let starts_zero_fill = matches!(step, IoStep::ZeroFill { written_bytes: 0 })
            && !matches!(request.step, IoStep::ZeroFill { .. });
        request.step = step;
        if starts_zero_fill {
            let Some(run) = request.run else {
                panic!("zero fill without a run");
            };
            self.arena.run_mut(run, run.size_bytes()).fill(0);
        }
    }

    /// Copies the payload bytes already received into the run; receives the rest directly.
    fn take_write_payload(&mut self, index: u32, now: Nanos) {
        let request = &self.requests[index as usize];
        let Action::Io(io) = request.action else {
            panic!("payload for a request without I/O");
        };
        let Some(run) = request.run else {
            panic!("write without a run");
        };
        let connection_index = request.connection_index;
        let connection = &mut self.connections[connection_index as usize];
        let available = connection.recv_end - connection.recv_start;
        let length = io.length_bytes as usize;
        let copied = available.min(length);
        let target = self.arena.run_mut(run, length);
        target[..copied].copy_from_slice(
            &connection.recv_buffer[connection.recv_start..connection.recv_start + copied],
        );
        connection.recv_start += copied;
        self.requests[index as usize].received_bytes = copied as u32;
        if copied == length {
            self.enqueue(index, now);
        } else {
            self.transition(index, RequestState::Receiving);
            self.connections[connection_index as usize].recv_into = Some(index);
        }
    }

    fn enqueue(&mut self, index: u32, now: Nanos) {
        self.transition(index, RequestState::Queued);
        let io = self.queued_io(index);
        self.scheduler.enqueue(io, now);
    }

    /// What the scheduler sees of the request's current step: its tenant, and the class and
    /// size of the device operation the step submits.
    fn queued_io(&self, index: u32) -> QueuedIo {
        let request = &self.requests[index as usize];
        let Action::Io(io) = request.action else {
            panic!("queued request without I/O");
        };
        let (class, size_bytes) = match (request.step, io.kind) {
            (IoStep::Primary, IoKind::Read) => (IoClass::Read, io.length_bytes),
            (IoStep::Primary, IoKind::Write { .. }) => (IoClass::Write, io.length_bytes),
            (IoStep::ZeroFill { written_bytes }, _) => (
                IoClass::Write,
                steps::zero_chunk_bytes(io.length_bytes, written_bytes, self.run_bytes(request)),
            ),
            (IoStep::FlushAfter, _) => (IoClass::Other, 0),
            (IoStep::Primary, _) => (IoClass::Other, io.length_bytes),
        };
        QueuedIo {
            request_index: index,
            tenant: io.tenant,
            namespace_index: io.namespace_index,
            class,
            size_bytes,
        }
    }

    /// Bytes of the request's run that hold data (or zeroes).
    fn run_bytes(&self, request: &Request) -> usize {
        let Action::Io(io) = request.action else {
            return 0;
        };
        steps::run_bytes(io.kind, io.length_bytes, RUN_SIZE_MAX)
    }

    /// Encodes the response header and queues the request for sending.
    fn respond(&mut self, index: u32, answer: Answer, data_bytes: u32) {
        let connection_index = self.requests[index as usize].connection_index;
        let frontend = &self.connections[connection_index as usize].frontend;
        let request = &mut self.requests[index as usize];
        let tag = request.tag;
        let Some(header_len) =
            frontend.encode_response(&tag, answer, data_bytes, &mut request.header)
        else {
            tracing::warn!(
                thread = self.thread_index,
                ?answer,
                "request failed on a protocol without status; closing the connection"
            );
            self.transition(index, RequestState::Completed);
            self.free_request(index);
            self.abort_connection(connection_index, "failure the protocol cannot report");
            return;
        };
        request.header_len = header_len as u8;
        request.data_bytes = data_bytes;
        if let Some(run) = request.run {
            assert!(data_bytes as usize <= run.size_bytes());
        } else {
            assert_eq!(data_bytes, 0);
        }
        self.transition(index, RequestState::Completed);
        self.stats.requests_answered += 1;
        let connection = &mut self.connections[connection_index as usize];
        if connection.send_tail == NONE {
            connection.send_head = index;
        } else {
            self.requests[connection.send_tail as usize].next = index;
        }
        connection.send_tail = index;
        self.mark_send(connection_index);
    }

    // ----- Step one: parsing -----------------------------------------------------------------

    fn mark_parse(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if !connection.in_parse_ready {
            connection.in_parse_ready = true;
            self.parse_ready.push_back(index);
        }
    }

    fn mark_send(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if !connection.in_send_ready {
            connection.in_send_ready = true;
            self.send_ready.push_back(index);
        }
    }

    fn add_waiter(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if !connection.in_waiters {
            connection.in_waiters = true;
            self.waiters.push_back(index);
        }
    }

    fn parse_step(&mut self, now: Nanos) {
        if self.resources_freed {
            self.resources_freed = false;
            while let Some(index) = self.waiters.pop_front() {
                self.connections[index as usize].in_waiters = false;
                self.mark_parse(index);
            }
        }
        while let Some(index) = self.parse_ready.pop_front() {
            self.connections[index as usize].in_parse_ready = false;
            self.parse_connection(index, now);
        }
    }

    fn parse_connection(&mut self, index: u32, now: Nanos) {
        loop {
            let connection = &mut self.connections[index as usize];
            if connection.state != ConnectionState::Open {
                return;
            }
            if connection.draining && !connection.drain_reading {
                self.maybe_close_idle(index);
                return;
            }
            if let Some(request) = connection.stalled {
                if !self.try_start(request, now) {
                    self.add_waiter(index);
                    return;
                }
                self.connections[index as usize].stalled = None;
                continue;
            }
            if connection.recv_in_flight {
                // Nothing to parse until that receive completes.
                self.stop_reading_if_drained(index);
                return;
            }
            if connection.recv_into.is_some() {
                break; // A payload is being received into its run.
            }
            if connection.skip_bytes > 0 {
                let available = (connection.recv_end - connection.recv_start) as u64;
                let skipped = available.min(connection.skip_bytes);
                connection.recv_start += skipped as usize;
                connection.skip_bytes -= skipped;
                if connection.skip_bytes > 0 {
                    break;
                }
            }
            if connection.outstanding >= self.window {
                return; // Back-pressure: read nothing more until responses go out.
            }
            if self.free_requests.is_empty() {
                self.add_waiter(index);
                return;
            }
            let connection = &mut self.connections[index as usize];
            let unparsed = &connection.recv_buffer[connection.recv_start..connection.recv_end];
            let unparsed_bytes = unparsed.len();
            let decoded = connection.frontend.decode(unparsed, &self.namespaces);
            match decoded {
                Decoded::NeedMore => break,
                Decoded::Consumed(count) => {
                    self.connections[index as usize].recv_start += count;
                }
                Decoded::Finish { consumed_bytes } => {
                    let connection = &mut self.connections[index as usize];
                    connection.recv_start += consumed_bytes;
                    connection.read_closed = true;
                    connection.drain_reading = false;
                    self.maybe_close_idle(index);
                    return;
                }
                Decoded::Close(reason) => {
                    tracing::info!(thread = self.thread_index, %reason, "closing connection: bad request framing");
                    self.abort_connection(index, "bad framing");
                    return;
                }
                Decoded::Request {
                    header_bytes,
                    payload_bytes,
                    tag,
                    action,
                } => {
                    // A small WRITE is gathered whole in the receive buffer first.
                    if let Action::Io(io) = action
                        && let IoKind::Write { .. } = io.kind
                    {
                        assert_eq!(payload_bytes, u64::from(io.length_bytes));
                        let total = header_bytes + io.length_bytes as usize;
                        if total > unparsed_bytes && total <= WRITE_GATHER_BYTES_MAX {
                            break;
                        }
                    }
                    self.connections[index as usize].recv_start += header_bytes;
                    let request = self.allocate_request(index, tag, action);
                    match action {
                        Action::Reply(answer) => {
                            self.connections[index as usize].skip_bytes = payload_bytes;
                            self.respond(request, answer, 0);
                        }
                        Action::Hello | Action::Output | Action::Io(_) => {
                            if !self.try_start(request, now) {
                                self.transition(request, RequestState::NeedBuffer);
                                self.connections[index as usize].stalled = Some(request);
                                self.add_waiter(index);
                                return;
                            }
                        }
                    }
                }
            }
        }
        // The parser needs more bytes (or a payload is being received).
        let connection = &self.connections[index as usize];
        if connection.read_closed {
            self.maybe_close_idle(index);
        } else if !self.stop_reading_if_drained(index) {
            self.issue_recv(index);
        }
    }

    fn issue_recv(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if connection.state != ConnectionState::Open
            || connection.read_closed
            || connection.recv_in_flight
        {
            return;
        }
        let entry = if let Some(request_index) = connection.recv_into {
            let request = &self.requests[request_index as usize];
            assert_eq!(request.state, RequestState::Receiving);
            let Action::Io(io) = request.action else {
                panic!("receiving request without I/O");
            };
            let Some(run) = request.run else {
                panic!("receiving request without a run");
            };
            let remaining = io.length_bytes - request.received_bytes;
            assert!(remaining > 0);
            let pointer = self
                .arena
                .run_ptr(run)
                .wrapping_add(request.received_bytes as usize);
            opcode::Recv::new(types::Fd(connection.fd), pointer, remaining).build()
        } else {
            if connection.recv_start > 0 {
                connection
                    .recv_buffer
                    .copy_within(connection.recv_start..connection.recv_end, 0);
                connection.recv_end -= connection.recv_start;
                connection.recv_start = 0;
            }
            let free = connection.recv_buffer.len() - connection.recv_end;
            // Every unit the parser waits for fits in half the buffer (const-asserted).
            assert!(free > 0, "receive buffer full while the parser needs more");
            let pointer = connection.recv_buffer[connection.recv_end..].as_mut_ptr();
            opcode::Recv::new(types::Fd(connection.fd), pointer, free as u32).build()
        };
        connection.recv_in_flight = true;
        let user_data = token::encode(Kind::Recv, connection.generation, index);
        self.stats.receives += 1;
        self.push_op(&entry.user_data(user_data));
    }

    fn on_recv(&mut self, index: u32, generation: u32, result: i32, now: Nanos) {
        let connection = &mut self.connections[index as usize];
        assert_eq!(
            connection.generation, generation,
            "stale receive completion"
        );
        assert!(connection.recv_in_flight);
        connection.recv_in_flight = false;
        if connection.state == ConnectionState::Closing
            || (connection.draining && !connection.drain_reading)
        {
            if let Some(request) = connection.recv_into.take() {
                self.free_request(request);
            }
            if self.connections[index as usize].state == ConnectionState::Closing {
                self.maybe_finish_close(index);
            } else {
                self.maybe_close_idle(index);
            }
            return;
        }
        if result < 0 {
            let errno = -result;
            if errno != libc::ECONNRESET {
                tracing::debug!(thread = self.thread_index, errno, "receive failed");
            }
            self.abort_connection(index, "receive error");
            return;
        }
        if result == 0 {
            if connection.recv_into.is_some() {
                self.abort_connection(index, "peer closed in the middle of a write payload");
                return;
            }
            // The peer will send nothing more; answer what it sent, then close.
            connection.read_closed = true;
            self.mark_parse(index);
            return;
        }
        let received = result as usize;
        if let Some(request_index) = connection.recv_into {
            let request = &mut self.requests[request_index as usize];
            request.received_bytes += received as u32;
            let Action::Io(io) = request.action else {
                panic!("receiving request without I/O");
            };
            assert!(request.received_bytes <= io.length_bytes);
            if request.received_bytes == io.length_bytes {
                self.connections[index as usize].recv_into = None;
                self.enqueue(request_index, now);
            }
        } else {
            connection.recv_end += received;
            assert!(connection.recv_end <= connection.recv_buffer.len());
        }
        self.mark_parse(index);
    }

    // ----- Step three: scheduling and device submission -------------------------------------

    fn dispatch_step(&mut self, now: Nanos) {
        while self.device_in_flight < DEVICE_IN_FLIGHT_PER_THREAD_MAX {
            let Some(queued) = self.scheduler.dequeue(now) else {
                break;
            };
            let index = queued.request_index;
            let request = &self.requests[index as usize];
            assert_eq!(request.state, RequestState::Queued);
            let connection_index = request.connection_index;
            if self.connections[connection_index as usize].state == ConnectionState::Closing {
                self.free_request(index);
                self.maybe_finish_close(connection_index);
                continue;
            }
            self.submit_io(index, now);
        }
    }

    fn submit_io(&mut self, index: u32, now: Nanos) {
        self.transition(index, RequestState::Submitted);
        self.device_in_flight += 1;
        let request = &self.requests[index as usize];
        let Action::Io(io) = request.action else {
            panic!("submitting a request without I/O");
        };
        let user_data = token::encode(Kind::Device, request.generation, index);
        let length = io.length_bytes as usize;
        let run = request.run;
        let kind = match (request.step, io.kind) {
            (IoStep::Primary, IoKind::Read) => {
                let Some(run) = run else {
                    panic!("read without a run")
                };
                OpKind::Read {
                    offset: io.offset_bytes,
                    buf: self.arena.run_mut(run, length),
                }
            }
            (IoStep::Primary, IoKind::Write { fua }) => {
                let Some(run) = run else {
                    panic!("write without a run")
                };
                OpKind::Write {
                    offset: io.offset_bytes,
                    buf: self.arena.run(run, length),
                    fua,
                }
            }
            (IoStep::Primary, IoKind::Flush) | (IoStep::FlushAfter, _) => OpKind::Flush,
            (IoStep::Primary, IoKind::Trim { .. } | IoKind::WriteZeroes { .. }) => OpKind::Trim {
                offset: io.offset_bytes,
                len: u64::from(io.length_bytes),
            },
            (IoStep::ZeroFill { written_bytes }, _) => {
                let Some(run) = run else {
                    panic!("zero fill without a run")
                };
                let chunk = steps::zero_chunk_bytes(
                    io.length_bytes,
                    written_bytes,
                    self.run_bytes(request),
                );
                OpKind::Write {
                    offset: io.offset_bytes + u64::from(written_bytes),
                    buf: self.arena.run(run, chunk as usize),
                    fua: false,
                }
            }
        };
        let op = DeviceOp {
            user_data,
            kind,
            buf_index: if self.registered { Some(0) } else { None },
            queue: 0,
        };
        match self.queues[usize::from(io.namespace_index)].submit(op, now) {
            Submit::Ring(entry) => {
                assert_eq!(entry.get_user_data(), user_data, "device changed user_data");
                self.push_op(&entry);
            }
            Submit::Done(result) => self.done.push((index, result)),
            Submit::Pending => {}
        }
    }

    fn finish_done(&mut self, now: Nanos) {
        let mut done = std::mem::take(&mut self.done);
        for (index, result) in done.drain(..) {
            self.complete_io(index, result, now);
        }
        self.done = done;
    }

    /// Step two: a device result becomes a response.
    fn complete_io(&mut self, index: u32, result: Result<u32, FlashError>, now: Nanos) {
        assert_eq!(self.requests[index as usize].state, RequestState::Submitted);
        assert!(self.device_in_flight > 0);
        self.device_in_flight -= 1;
        let queued = self.queued_io(index);
        self.scheduler.on_complete(&queued, now);
        let request = &self.requests[index as usize];
        let Action::Io(io) = request.action else {
            panic!("completing a request without I/O");
        };
        let connection_index = request.connection_index;
        let step = request.step;
        if steps::reveals_no_discard(io.kind, step, &result) {
            self.discards[usize::from(io.namespace_index)] = false;
        }
        let next = steps::after_step(
            io.kind,
            step,
            io.length_bytes,
            self.run_bytes(request),
            &result,
        );
        match (&next, &result) {
            (Next::Done(Answer::DeviceError { .. }), Ok(bytes)) => {
                self.stats.io_errors += 1;
                tracing::warn!(
                    thread = self.thread_index,
                    bytes,
                    ?step,
                    "short device transfer; answering I/O error"
                );
            }
            (Next::Done(answer), Err(e))
                if *answer != Answer::Ok && *answer != Answer::Unsupported =>
            {
                self.stats.io_errors += 1;
                tracing::warn!(thread = self.thread_index, error = %e, "device I/O failed");
            }
            _ => {}
        }
        if self.connections[connection_index as usize].state == ConnectionState::Closing {
            self.free_request(index);
            self.maybe_finish_close(connection_index);
            return;
        }
        let answer = match next {
            Next::Continue(step) => {
                self.set_step(index, step);
                self.enqueue(index, now);
                return;
            }
            Next::Done(answer) => answer,
        };
        if answer.is_ok() {
            match io.kind {
                IoKind::Read => self.stats.bytes_read += u64::from(io.length_bytes),
                IoKind::Write { .. } => self.stats.bytes_written += u64::from(io.length_bytes),
                _ => {}
            }
        }
        let data_bytes = if answer.is_ok() && io.kind == IoKind::Read {
            io.length_bytes
        } else {
            0
        };
        self.respond(index, answer, data_bytes);
    }

    // ----- Step five: sending ----------------------------------------------------------------

    fn send_step(&mut self) {
        while let Some(index) = self.send_ready.pop_front() {
            self.connections[index as usize].in_send_ready = false;
            self.send_connection(index);
        }
    }

    fn send_connection(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if connection.state != ConnectionState::Open
            || connection.send_in_flight
            || connection.send_head == NONE
        {
            return;
        }
        let staging = connection.staging.get_or_insert_with(|| {
            Box::new(SendStaging {
                msghdr: uring::empty_msghdr(),
                iovecs: [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; SEND_IOVECS_MAX],
            })
        });
        let mut iovec_count = 0;
        let mut sending_count = 0;
        let mut skip = connection.send_offset_bytes;
        let mut cursor = connection.send_head;
        while cursor != NONE && iovec_count + 2 <= SEND_IOVECS_MAX {
            let request = &mut self.requests[cursor as usize];
            assert_eq!(request.state, RequestState::Completed);
            let header_len = usize::from(request.header_len);
            if skip < header_len {
                staging.iovecs[iovec_count] = libc::iovec {
                    iov_base: request.header[skip..].as_mut_ptr().cast(),
                    iov_len: header_len - skip,
                };
                iovec_count += 1;
                skip = 0;
            } else {
                skip -= header_len;
            }
            if request.data_bytes > 0 {
                let Some(run) = request.run else {
                    panic!("response data without a run");
                };
                assert!(skip < request.data_bytes as usize);
                staging.iovecs[iovec_count] = libc::iovec {
                    iov_base: self.arena.run_ptr(run).wrapping_add(skip).cast(),
                    iov_len: request.data_bytes as usize - skip,
                };
                iovec_count += 1;
            }
            skip = 0;
            debug_assert!(RequestState::Completed.can_become(RequestState::Sending));
            request.state = RequestState::Sending;
            self.stats.requests_per_state[RequestState::Completed as usize] -= 1;
            self.stats.requests_per_state[RequestState::Sending as usize] += 1;
            self.stats.transitions += 1;
            sending_count += 1;
            cursor = request.next;
        }
        assert!(sending_count > 0);
        staging.msghdr.msg_iov = staging.iovecs.as_mut_ptr();
        staging.msghdr.msg_iovlen = iovec_count as _;
        let msghdr: *const libc::msghdr = &staging.msghdr;
        connection.sending_count = sending_count;
        connection.send_in_flight = true;
        let entry = opcode::SendMsg::new(types::Fd(connection.fd), msghdr)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(token::encode(Kind::Send, connection.generation, index));
        self.stats.sends += 1;
        self.push_op(&entry);
    }

    fn on_send(&mut self, index: u32, generation: u32, result: i32) {
        let connection = &mut self.connections[index as usize];
        assert_eq!(connection.generation, generation, "stale send completion");
        assert!(connection.send_in_flight);
        connection.send_in_flight = false;
        let sent = if result > 0 { result as usize } else { 0 };
        let mut progress = connection.send_offset_bytes + sent;
        let sending_count = std::mem::take(&mut connection.sending_count);
        connection.send_offset_bytes = 0;
        for _ in 0..sending_count {
            let connection = &mut self.connections[index as usize];
            let head = connection.send_head;
            assert_ne!(head, NONE);
            let total = self.requests[head as usize].response_len();
            if progress >= total {
                progress -= total;
                connection.send_head = self.requests[head as usize].next;
                if connection.send_head == NONE {
                    connection.send_tail = NONE;
                }
                self.requests[head as usize].next = NONE;
                self.free_request(head);
            } else {
                // Partial progress: the rest of this response and those after it go again.
                self.connections[index as usize].send_offset_bytes = progress;
                progress = 0;
                let mut cursor = head;
                while cursor != NONE
                    && self.requests[cursor as usize].state == RequestState::Sending
                {
                    self.transition(cursor, RequestState::Completed);
                    cursor = self.requests[cursor as usize].next;
                }
                break;
            }
        }
        assert_eq!(
            progress, 0,
            "kernel reported more bytes sent than were queued"
        );
        let state = self.connections[index as usize].state;
        if state == ConnectionState::Closing {
            self.drop_send_queue(index);
            self.maybe_finish_close(index);
            return;
        }
        if result <= 0 {
            if result < 0 && -result != libc::EPIPE && -result != libc::ECONNRESET {
                tracing::debug!(thread = self.thread_index, errno = -result, "send failed");
            }
            self.abort_connection(index, "send error");
            return;
        }
        if self.connections[index as usize].send_head != NONE {
            self.mark_send(index);
        }
        self.maybe_close_idle(index);
    }

    // ----- Closing ---------------------------------------------------------------------------

    /// Closes a connection that has nothing left to do: read side closed, nothing outstanding.
    fn maybe_close_idle(&mut self, index: u32) {
        let connection = &self.connections[index as usize];
        if connection.state == ConnectionState::Open
            && connection.read_closed
            && connection.outstanding == 0
            && !connection.recv_in_flight
            && !connection.send_in_flight
        {
            self.connections[index as usize].state = ConnectionState::Closing;
            self.maybe_finish_close(index);
        }
    }

    /// Abandons a connection: cancels its operations and frees every request no operation
    /// uses; the rest are freed as their completions arrive.
    fn abort_connection(&mut self, index: u32, reason: &str) {
        let connection = &mut self.connections[index as usize];
        if connection.state != ConnectionState::Open {
            return;
        }
        tracing::debug!(
            thread = self.thread_index,
            connection = index,
            reason,
            "closing connection"
        );
        connection.state = ConnectionState::Closing;
        let generation = connection.generation;
        let (recv_in_flight, send_in_flight) =
            (connection.recv_in_flight, connection.send_in_flight);
        if recv_in_flight {
            self.cancel(token::encode(Kind::Recv, generation, index));
        } else if let Some(request) = self.connections[index as usize].recv_into.take() {
            self.free_request(request);
        }
        if send_in_flight {
            self.cancel(token::encode(Kind::Send, generation, index));
        } else {
            self.drop_send_queue(index);
        }
        if let Some(request) = self.connections[index as usize].stalled.take() {
            self.free_request(request);
        }
        self.maybe_finish_close(index);
    }

    /// Frees the responses waiting to be sent (no send in flight).
    fn drop_send_queue(&mut self, index: u32) {
        assert!(!self.connections[index as usize].send_in_flight);
        loop {
            let connection = &mut self.connections[index as usize];
            let head = connection.send_head;
            if head == NONE {
                connection.send_tail = NONE;
                connection.send_offset_bytes = 0;
                break;
            }
            connection.send_head = self.requests[head as usize].next;
            self.requests[head as usize].next = NONE;
            self.free_request(head);
        }
    }

    /// Releases the slot once no operation and no request refers to the connection.
    fn maybe_finish_close(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if connection.state != ConnectionState::Closing
            || connection.recv_in_flight
            || connection.send_in_flight
            || connection.outstanding > 0
        {
            return;
        }
        assert!(connection.recv_into.is_none());
        assert!(connection.stalled.is_none());
        assert_eq!(connection.send_head, NONE);
        connection.stream = None; // Closes the socket.
        connection.fd = -1;
        // Drops per-connection protocol state (an NBD handshake's buffers) now, not at reuse.
        connection.frontend = Frontend::Native;
        connection.state = ConnectionState::Free;
        connection.generation = token::next_generation(connection.generation);
        self.free_connections.push(index);
        for listener in 0..self.listeners.len() {
            if self.listeners[listener].paused && self.phase == Phase::Running {
                self.arm_accept(listener as u32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip() {
        for kind in [
            Kind::Accept,
            Kind::Recv,
            Kind::Send,
            Kind::Device,
            Kind::Wake,
            Kind::Cancel,
            Kind::Flush,
        ] {
            let user_data = token::encode(kind, 0x0abc_def1, 0xffff_fffe);
            assert_eq!(
                token::decode(user_data),
                Some((kind, 0x0abc_def1, 0xffff_fffe))
            );
        }
        assert_eq!(token::decode(0), None);
        assert_eq!(token::next_generation(token::GENERATION_MASK), 0);
    }

    #[test]
    fn request_transitions() {
        use RequestState::*;
        assert!(Free.can_become(Queued));
        assert!(Queued.can_become(Submitted));
        assert!(!Submitted.can_become(Sending));
        assert!(!Free.can_become(Free));
        assert!(!Free.can_become(Submitted));
    }
}
