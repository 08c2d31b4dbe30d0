//! One dataplane thread: its io_uring, its connections, its requests and its buffer arena,
//! driven by one loop (ReFlex paper §3.1, two-step run to completion).
//!
//! A loop iteration:
//! 1. reap up to [`BATCH_MAX`] completions (accepts, receives, sends, device I/O, wake-ups)
//!    and poll devices that complete on their own (the emulated device);
//! 2. step one: parse the connections that received bytes, validate through the `proto`
//!    codecs, take a request slot and a buffer run, and enqueue;
//! 3. scheduling: on each namespace with a QoS profile, this thread's ReFlex token scheduler
//!    (`reflex_qos::Scheduler`, one round per iteration at the iteration's `now`) admits
//!    requests from its tenants' queues; on the others the per-thread pull [`Scheduler`]
//!    (FIFO unless a custom one is plugged in) releases them; the devices prepare ring
//!    entries or finish synchronously;
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
//! `Free → (NeedBuffer →) [Receiving →] [Blocked →] Queued → Submitted → Completed ⇄ Sending →
//! Free`, where `Blocked` waits for room in a full tenant queue of the QoS scheduler;
//! immediate replies (errors, HELLO, NBD handshake output) go `Free/NeedBuffer → Completed`;
//! a request with several device operations (`steps`: NBD WRITE_ZEROES in chunks, a flush for
//! FUA) goes back `Submitted → Queued` between them. A request belonging to a closing
//! connection is freed as soon as no kernel operation uses it.
//!
//! Shutdown: listeners close; connections stop reading and close once their in-flight
//! requests are answered, except NBD sessions, which keep reading and answer new requests
//! ESHUTDOWN until then (`Connection::drain_reading`); then every device is flushed.
//!
//! QoS (`docs/QOS.md`, "In reflexd"): every I/O to a QoS namespace is charged to a tenant —
//! the one the connection BINDs to, else the NBD export's or original port's configured
//! tenant, else the namespace's default best-effort tenant. A connection is counted in the
//! control plane's registry for each tenant it charged (`Connection::charged`), so each
//! thread's share of a tenant follows its connections. A full tenant queue never drops a
//! request: the request waits in `blocked` and its connection is not read until the
//! scheduler reports room. Control messages (rate updates, revocations, RENEGOTIATE notices)
//! are applied at most [`crate::control::MESSAGES_PER_ITERATION_MAX`] per iteration, after one
//! atomic check; control requests and a connection's first I/O to a tenant take the control
//! plane's lock, off the I/O path.
//!
//! WRITE payloads: bytes already in the connection's receive buffer are copied into the
//! request's run and the missing remainder is received directly into the run (no second
//! copy), except for small writes (header and payload within [`WRITE_GATHER_BYTES_MAX`]),
//! which are first gathered whole in the receive buffer so that many small pipelined writes
//! arrive in one receive.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types};
use reflex_flash::emu::{PriorityClass, class_from_ioprio};
use reflex_flash::{DeviceOp, DeviceQueue, FlashError, OpKind, Submit};
use reflex_proto::native::{self as wire, Opcode, RENEGOTIATE_BODY_SIZE, RenegotiateBody, Status};
use reflex_qos::{Admitted, EnqueueError, Nanos, Policy, QosConfig, SchedulerEvent, TenantId};

use crate::buffers::{PageAllocator, PageRun, RUN_SIZE_MAX, order_for};
use crate::control::{
    ControlAnswer, ControlBody, ControlMessage, ControlPlane, MESSAGES_PER_ITERATION_MAX,
    NamespaceQosSetup, REASON_BYTES_MAX, TenantRef,
};
use crate::frontend::{
    Action, Answer, ControlRequest, Decoded, Frontend, IoKind, IoRequest, NbdExports, Protocol,
    RESPONSE_HEADER_SIZE_MAX, Tag,
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
/// RENEGOTIATE notices a connection holds while it cannot send them (window full); beyond
/// it the oldest is dropped (counted in [`CoreStats::notices_dropped`]).
pub const NOTICES_PENDING_MAX: usize = 4;
/// A control answer's body (a handle or a refusal reason) fits one arena page.
const CONTROL_ANSWER_BYTES_MAX: usize = crate::buffers::PAGE_SIZE;

const _: () = assert!(REASON_BYTES_MAX <= CONTROL_ANSWER_BYTES_MAX);
const _: () = assert!(RENEGOTIATE_BODY_SIZE <= CONTROL_ANSWER_BYTES_MAX);
const _: () = assert!(
    reflex_proto::native::REQUEST_HEADER_SIZE
        + reflex_proto::native::CONTROL_BODY_MAX_BYTES as usize
        <= RECV_BUFFER_SIZE / 2
);
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
    /// Waiting for room in its tenant's queue of the QoS scheduler.
    Blocked = 7,
}
const REQUEST_STATE_COUNT: usize = 8;

impl RequestState {
    /// Legal moves; freeing early is legal only when no kernel operation uses the request.
    fn can_become(self, to: RequestState) -> bool {
        use RequestState::*;
        matches!(
            (self, to),
            (Free, NeedBuffer | Receiving | Queued | Blocked | Completed)
                | (NeedBuffer, Receiving | Queued | Blocked | Completed | Free)
                | (Receiving, Queued | Blocked | Completed | Free)
                | (Blocked, Queued | Completed | Free)
                | (Queued, Submitted | Free)
                | (Submitted, Completed | Queued | Blocked | Free)
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
    /// When the current step entered a QoS scheduler, and when it went to the device
    /// (per-tenant wait and device time).
    queued_at: Nanos,
    submitted_at: Nanos,
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
            queued_at: Nanos::ZERO,
            submitted_at: Nanos::ZERO,
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
    /// The tenant a native BIND chose; `None`: defaults apply.
    bound: Option<Bound>,
    /// Tenants this connection is counted for in the control plane's registries (the bound
    /// one and the defaults its I/O was charged to). Allocated on a connection's first I/O
    /// to a tenant, kept across the slot's reuse.
    charged: Vec<Charge>,
    /// RENEGOTIATE notices waiting for a request slot, oldest first.
    notices: VecDeque<RenegotiateBody>,
    /// Requests of this connection waiting in `Core::blocked`; while any do, the connection
    /// is not read (back-pressure from a full tenant queue).
    blocked_count: u32,
    /// The device submission queue of this connection's I/O: its priority class for devices
    /// that arbitrate (the emulated device), chosen from the `ionice` class a native client
    /// declares in HELLO; medium otherwise, as Linux treats a process without a priority.
    device_queue: u16,
}

/// A native connection's BIND.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bound {
    tenant: TenantRef,
    namespace_index: u16,
    read_only: bool,
    /// The tenant was unregistered: its I/O is refused (PERMISSION) until the next BIND.
    revoked: bool,
}

/// One tenant a connection is counted for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Charge {
    namespace_index: u16,
    tenant: TenantRef,
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
            bound: None,
            charged: Vec::new(),
            notices: VecDeque::new(),
            blocked_count: 0,
            device_queue: DEFAULT_DEVICE_QUEUE,
        }
    }
}

/// Submission queue of connections that declared no I/O priority.
const DEFAULT_DEVICE_QUEUE: u16 = PriorityClass::Medium.submission_queue();

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
    /// Requests that found their tenant's queue full and waited (back-pressure).
    pub tenant_queue_full_waits: u64,
    /// Control messages applied (rate updates, revocations, notices).
    pub control_messages: u64,
    pub notices_sent: u64,
    pub notices_dropped: u64,
    /// What each tenant did on this thread (QoS namespaces only), by handle.
    pub tenants: Vec<TenantStats>,
}

/// One tenant's work on one dataplane thread.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantStats {
    pub handle: u64,
    pub namespace_id: u32,
    /// Device operations the scheduler admitted (a multi-step request counts each step).
    pub requests: u64,
    pub bytes: u64,
    /// Tokens charged, in millitokens.
    pub millitokens: i64,
    /// Deficit episodes that started on this thread.
    pub deficit_episodes: u64,
    /// Requests received for it (its demand).
    pub arrivals: u64,
    /// Time its admitted requests waited in the scheduler, summed, and the longest wait.
    pub scheduler_wait_ns: u64,
    pub scheduler_wait_ns_max: u64,
    /// Device time (submission to completion) of its requests, summed.
    pub device_ns: u64,
}

impl TenantStats {
    /// Adds `other`'s counts (the maximum wait: the larger one).
    pub(crate) fn add(&mut self, other: &TenantStats) {
        self.requests += other.requests;
        self.bytes += other.bytes;
        self.millitokens += other.millitokens;
        self.deficit_episodes += other.deficit_episodes;
        self.arrivals += other.arrivals;
        self.scheduler_wait_ns += other.scheduler_wait_ns;
        self.scheduler_wait_ns_max = self.scheduler_wait_ns_max.max(other.scheduler_wait_ns_max);
        self.device_ns += other.device_ns;
    }
}

/// This thread's accounting of one tenant id of a QoS namespace.
#[derive(Debug, Clone, Default)]
struct TenantAccount {
    stats: TenantStats,
    meter: DemandMeter,
}

/// The request rate a RENEGOTIATE notice reports: arrivals over the current and the previous
/// window of [`DEMAND_WINDOW`], measured over at least [`DEMAND_SPAN_MIN`].
#[derive(Debug, Clone, Copy, Default)]
struct DemandMeter {
    current_start: Nanos,
    current_arrivals: u64,
    previous_arrivals: u64,
    previous_ns: u64,
}

const DEMAND_WINDOW: Nanos = Nanos(1_000_000_000);
const DEMAND_SPAN_MIN: Nanos = Nanos(10_000_000);

impl DemandMeter {
    fn starting(now: Nanos) -> DemandMeter {
        DemandMeter {
            current_start: now,
            ..DemandMeter::default()
        }
    }

    fn arrival(&mut self, now: Nanos) {
        let elapsed = now.saturating_since(self.current_start);
        if elapsed >= DEMAND_WINDOW {
            self.previous_arrivals = self.current_arrivals;
            self.previous_ns = elapsed.0;
            self.current_start = now;
            self.current_arrivals = 0;
        }
        self.current_arrivals += 1;
    }

    fn iops(&self, now: Nanos) -> u64 {
        let span_ns =
            (self.previous_ns + now.saturating_since(self.current_start).0).max(DEMAND_SPAN_MIN.0);
        let arrivals = self.previous_arrivals + self.current_arrivals;
        (u128::from(arrivals) * 1_000_000_000 / u128::from(span_ns)) as u64
    }
}

/// One QoS namespace on this thread.
struct NamespaceQos {
    scheduler: reflex_qos::Scheduler,
    default_tenant: TenantRef,
    namespace_id: u32,
    /// By tenant id; grown when this thread first charges a tenant (control path).
    accounts: Vec<TenantAccount>,
}

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("io_uring setup failed: {0}")]
    RingSetup(std::io::Error),
    #[error("io_uring_enter failed: {0}")]
    Enter(std::io::Error),
    #[error("eventfd: {0}")]
    Eventfd(std::io::Error),
    #[error("QoS scheduler: {0}")]
    Qos(String),
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
    /// The thread's scheduler for namespaces without QoS; `None` is the FIFO passthrough.
    pub scheduler: Option<Box<dyn Scheduler + Send>>,
    pub control: Arc<ControlPlane>,
    /// Per namespace: its QoS setup, `None` for FIFO.
    pub qos: Vec<Option<NamespaceQosSetup>>,
    pub qos_config: QosConfig,
    /// `false`: QoS namespaces schedule first in, first out (`--no-qos`).
    pub qos_enabled: bool,
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
    control: Arc<ControlPlane>,
    /// Per namespace index.
    qos: Vec<Option<NamespaceQos>>,
    /// Requests waiting for room in a full tenant queue, oldest first.
    blocked: VecDeque<u32>,
    /// The scheduler reported room since the blocked requests were last retried.
    queue_room: bool,
    /// Requests inside the QoS schedulers.
    qos_queued: u32,
    /// Whether this thread takes part in the global buckets' round resets (it leaves while
    /// it sleeps idle).
    qos_participating: bool,
    /// A request entered a QoS scheduler since its last round (schedule again before
    /// sleeping).
    qos_fresh: bool,
    /// Scratch: what one scheduling round admitted.
    admitted: Vec<(u16, Admitted)>,
    /// Scratch: control messages being applied.
    messages: Vec<ControlMessage>,
    /// Accounts of tenant ids that were reused by another tenant on this thread, by handle.
    retired_accounts: BTreeMap<u64, TenantStats>,
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
            requests_per_state: [setup.requests_max, 0, 0, 0, 0, 0, 0, 0],
            ..CoreStats::default()
        };
        let now = Nanos(setup.clock_origin.elapsed().as_nanos() as u64);
        let policy = if setup.qos_enabled {
            Policy::Tokens
        } else {
            Policy::Fifo
        };
        let mut qos = Vec::with_capacity(setup.qos.len());
        for (index, namespace) in setup.qos.into_iter().enumerate() {
            let Some(namespace) = namespace else {
                qos.push(None);
                continue;
            };
            let scheduler = reflex_qos::Scheduler::new(
                namespace.shared,
                setup.thread_index as u16,
                &setup.qos_config,
                policy,
                now,
            )
            .map_err(|e| CoreError::Qos(e.to_string()))?;
            qos.push(Some(NamespaceQos {
                scheduler,
                default_tenant: namespace.default_tenant,
                namespace_id: setup.namespaces.id(index as u16),
                accounts: Vec::new(),
            }));
        }
        let mut core = Core {
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
            control: setup.control,
            qos,
            blocked: VecDeque::with_capacity(setup.requests_max as usize),
            queue_room: false,
            qos_queued: 0,
            qos_participating: true,
            qos_fresh: false,
            admitted: Vec::with_capacity(DEVICE_IN_FLIGHT_PER_THREAD_MAX as usize),
            messages: Vec::with_capacity(MESSAGES_PER_ITERATION_MAX),
            retired_accounts: BTreeMap::new(),
        };
        // The device rates the registries computed at startup.
        while core.control.has_messages(core.thread_index) {
            core.apply_control_messages(now);
        }
        Ok(core)
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
        for namespace in self.qos.iter().flatten() {
            let ledger = namespace.scheduler.ledger();
            tracing::info!(
                thread = self.thread_index,
                namespace = namespace.namespace_id,
                generated = ledger.generated.as_tokens_f64(),
                from_bucket = ledger.from_bucket.as_tokens_f64(),
                spent = ledger.spent.as_tokens_f64(),
                to_bucket = ledger.to_bucket.as_tokens_f64(),
                written_off = ledger.written_off.as_tokens_f64(),
                iterations = self.stats.iterations,
                "scheduler tokens"
            );
        }
        result.map(|()| {
            let mut stats = self.stats.clone();
            stats.sq_full_flushes = self.ring.full_flush_count();
            stats.tenants = self.tenant_stats();
            stats
        })
    }

    fn run_loop(&mut self) -> Result<(), CoreError> {
        // Timed sleeps end at device completions and token deadlines; the default 50 µs of
        // slack would add up to that much to a request's latency.
        if let Err(e) = uring::set_timer_slack_ns(1) {
            tracing::debug!(thread = self.thread_index, error = %e, "timer slack unchanged");
        }
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
            if self.control.has_messages(self.thread_index) {
                self.apply_control_messages(now);
            }
            self.set_qos_participating(true);
            self.advance_phase(now);
            if self.phase == Phase::Finished && self.ops_in_flight == 0 {
                return Ok(());
            }
            // 2. Step one: parse and enqueue.
            self.parse_step(now);
            // 3. Scheduling and device submission.
            self.dispatch_step(now);
            self.handle_scheduler_events(now);
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
                || self.queue_room
                || self.qos_fresh
                || self.control.has_messages(self.thread_index)
                || self.phase_ready()
                || self.ring.more_in_cq();
            let wait = !self.poll && !busy;
            let timeout = if wait { self.sleep_bound(now) } else { None };
            if wait && self.qos_queued == 0 && self.blocked.is_empty() {
                // Asleep, this thread finishes no scheduling rounds: let the others reset
                // the global buckets without it.
                self.set_qos_participating(false);
            }
            self.ring.enter(wait, timeout).map_err(CoreError::Enter)?;
        }
    }

    /// The longest the thread may sleep: until the earliest device or scheduler deadline.
    fn sleep_bound(&self, now: Nanos) -> Option<Duration> {
        let mut deadline = self.scheduler.next_deadline();
        for namespace in self.qos.iter().flatten() {
            if let Some(due) = namespace.scheduler.next_deadline() {
                deadline = Some(deadline.map_or(due, |d| d.min(due)));
            }
        }
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
                // None: the device deferred the outcome (fault injection); it will come out
                // of poll_completions and the request stays Submitted until then.
                if let Some(result) = self.queues[usize::from(io.namespace_index)].complete_ring(
                    cqe.user_data,
                    cqe.result,
                    now,
                ) {
                    self.complete_io(index, result, now);
                }
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
        let mut charged = std::mem::take(&mut connection.charged);
        let mut notices = std::mem::take(&mut connection.notices);
        assert!(
            charged.is_empty(),
            "a free connection still counted for a tenant"
        );
        charged.clear();
        notices.clear();
        *connection = Connection::empty();
        connection.charged = charged;
        connection.notices = notices;
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
            && self.qos_queued == 0
            && self.blocked.is_empty()
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
            Action::Hello { io_priority } => {
                let connection_index = self.requests[index as usize].connection_index;
                // An unknown class or level keeps the default: the priority is a hint.
                if let Ok(class) = class_from_ioprio(io_priority) {
                    self.connections[connection_index as usize].device_queue =
                        class.submission_queue();
                }
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
            Action::Control(request) => {
                let Some(run) = self.pages.allocate(order_for(CONTROL_ANSWER_BYTES_MAX)) else {
                    self.stats.buffer_waits += 1;
                    return false;
                };
                self.requests[index as usize].run = Some(run);
                let connection_index = self.requests[index as usize].connection_index;
                let answer = self.control_request(connection_index, request, now);
                let body = self.arena.run_mut(run, CONTROL_ANSWER_BYTES_MAX);
                let length = match &answer.body {
                    ControlBody::None => 0,
                    ControlBody::Handle(handle) => {
                        let bytes = wire::encode_handle(*handle);
                        body[..bytes.len()].copy_from_slice(&bytes);
                        bytes.len()
                    }
                    ControlBody::Reason(reason) => {
                        let bytes = reason.as_bytes();
                        assert!(bytes.len() <= REASON_BYTES_MAX);
                        body[..bytes.len()].copy_from_slice(bytes);
                        bytes.len()
                    }
                };
                let answer = match answer.status {
                    Status::Ok => Answer::Ok,
                    status => Answer::Native(status),
                };
                self.respond(index, answer, length as u32);
                true
            }
            Action::Notice => {
                let Some(run) = self.pages.allocate(order_for(RENEGOTIATE_BODY_SIZE)) else {
                    self.stats.buffer_waits += 1;
                    return false;
                };
                let connection_index = self.requests[index as usize].connection_index;
                let Some(notice) = self.connections[connection_index as usize]
                    .notices
                    .pop_front()
                else {
                    panic!("a notice request without a pending notice");
                };
                self.arena
                    .run_mut(run, RENEGOTIATE_BODY_SIZE)
                    .copy_from_slice(&notice.to_bytes());
                self.requests[index as usize].run = Some(run);
                self.stats.notices_sent += 1;
                self.respond(index, Answer::Ok, RENEGOTIATE_BODY_SIZE as u32);
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
        let io = self.queued_io(index);
        if self.qos[usize::from(io.namespace_index)].is_none() {
            self.transition(index, RequestState::Queued);
            self.scheduler.enqueue(io, now);
            return;
        }
        match self.qos_enqueue(index, &io, now) {
            Ok(()) => self.transition(index, RequestState::Queued),
            Err(EnqueueError::TenantQueueFull { .. } | EnqueueError::ThreadQueueFull { .. }) => {
                // Never dropped: it waits, and its connection is not read meanwhile.
                self.transition(index, RequestState::Blocked);
                self.blocked.push_back(index);
                self.stats.tenant_queue_full_waits += 1;
                let connection_index = self.requests[index as usize].connection_index;
                self.connections[connection_index as usize].blocked_count += 1;
            }
            Err(EnqueueError::UnknownTenant(_) | EnqueueError::TooLarge { .. }) => {
                // The tenant left this thread (unregistered) while the request was on its
                // way to the scheduler.
                self.respond(index, Answer::Native(Status::Permission), 0);
            }
        }
    }

    /// Queues a request in its tenant's queue of the namespace's QoS scheduler.
    fn qos_enqueue(&mut self, index: u32, io: &QueuedIo, now: Nanos) -> Result<(), EnqueueError> {
        let (kind, size_bytes) = match io.class {
            IoClass::Read => (reflex_qos::IoKind::Read, io.size_bytes),
            IoClass::Write => (reflex_qos::IoKind::Write, io.size_bytes),
            // Flush and trim are not transfers: charged as one 4 KiB write (`docs/QOS.md` §1).
            IoClass::Other => (reflex_qos::IoKind::Write, reflex_qos::COST_UNIT_BYTES),
        };
        let generation = self.requests[index as usize].generation;
        let request = reflex_qos::Request {
            token: (u64::from(generation) << 32) | u64::from(index),
            size_bytes,
            kind,
        };
        let Some(namespace) = self.qos[usize::from(io.namespace_index)].as_mut() else {
            panic!("QoS enqueue on a namespace without QoS");
        };
        namespace
            .scheduler
            .enqueue(TenantId(io.tenant), request, now)?;
        self.requests[index as usize].queued_at = now;
        self.qos_queued += 1;
        self.qos_fresh = true;
        Ok(())
    }

    /// Gives blocked requests another try at their tenants' queues, oldest first.
    fn retry_blocked(&mut self, now: Nanos) {
        self.queue_room = false;
        for _ in 0..self.blocked.len() {
            let Some(index) = self.blocked.pop_front() else {
                break;
            };
            let io = self.queued_io(index);
            match self.qos_enqueue(index, &io, now) {
                Ok(()) => {
                    self.transition(index, RequestState::Queued);
                    self.unblock(index);
                }
                Err(
                    EnqueueError::TenantQueueFull { .. } | EnqueueError::ThreadQueueFull { .. },
                ) => {
                    self.blocked.push_back(index);
                }
                Err(EnqueueError::UnknownTenant(_) | EnqueueError::TooLarge { .. }) => {
                    self.unblock(index);
                    self.respond(index, Answer::Native(Status::Permission), 0);
                }
            }
        }
    }

    /// One blocked request of its connection left `blocked`; the last one lets it be read.
    fn unblock(&mut self, index: u32) {
        let connection_index = self.requests[index as usize].connection_index;
        let connection = &mut self.connections[connection_index as usize];
        assert!(connection.blocked_count > 0);
        connection.blocked_count -= 1;
        if connection.blocked_count == 0 && connection.state == ConnectionState::Open {
            self.mark_parse(connection_index);
        }
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
            tenant: io.tenant.id,
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
            if !connection.notices.is_empty() && connection.outstanding < self.window {
                // A RENEGOTIATE notice takes a request slot (and a window place) like a
                // response, so it waits where a request would.
                if self.free_requests.is_empty() {
                    self.add_waiter(index);
                    return;
                }
                let tag = Tag::Native {
                    opcode_raw: Opcode::Renegotiate.as_u8(),
                    request_id: wire::NOTICE_REQUEST_ID,
                };
                let request = self.allocate_request(index, tag, Action::Notice);
                if !self.try_start(request, now) {
                    self.transition(request, RequestState::NeedBuffer);
                    self.connections[index as usize].stalled = Some(request);
                    self.add_waiter(index);
                    return;
                }
                continue;
            }
            let connection = &mut self.connections[index as usize];
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
            if connection.blocked_count > 0 {
                return; // Back-pressure: a tenant queue is full; wait for room.
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
                    let action = match action {
                        Action::Io(io) => match self.charge(index, io, now) {
                            Ok(io) => Action::Io(io),
                            Err(status) => Action::Reply(Answer::Native(status)),
                        },
                        other => other,
                    };
                    let request = self.allocate_request(index, tag, action);
                    match action {
                        Action::Reply(answer) => {
                            self.connections[index as usize].skip_bytes = payload_bytes;
                            self.respond(request, answer, 0);
                        }
                        Action::Hello { .. }
                        | Action::Output
                        | Action::Io(_)
                        | Action::Control(_)
                        | Action::Notice => {
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
        if self.queue_room {
            self.retry_blocked(now);
        }
        self.qos_fresh = false;
        for namespace_index in 0..self.qos.len() {
            self.dispatch_qos(namespace_index, now);
        }
    }

    /// One scheduling round of a QoS namespace: what it admits goes to the device.
    fn dispatch_qos(&mut self, namespace_index: usize, now: Nanos) {
        let room = (DEVICE_IN_FLIGHT_PER_THREAD_MAX - self.device_in_flight) as usize;
        let Some(namespace) = self.qos[namespace_index].as_mut() else {
            return;
        };
        let mut admitted = std::mem::take(&mut self.admitted);
        assert!(admitted.is_empty());
        namespace.scheduler.schedule(now, &mut |request: Admitted| {
            if admitted.len() >= room {
                return false; // The device takes no more from this thread now.
            }
            admitted.push((namespace_index as u16, request));
            true
        });
        for (_, request) in &admitted {
            if let Some(account) = namespace.accounts.get_mut(request.tenant.0 as usize) {
                let queued_at = self.requests[(request.token as u32) as usize].queued_at;
                let wait_ns = now.saturating_since(queued_at).0;
                account.stats.requests += 1;
                account.stats.bytes += u64::from(request.size_bytes);
                account.stats.millitokens += request.cost.0;
                account.stats.scheduler_wait_ns += wait_ns;
                account.stats.scheduler_wait_ns_max =
                    account.stats.scheduler_wait_ns_max.max(wait_ns);
            }
        }
        assert!(admitted.len() <= self.qos_queued as usize);
        self.qos_queued -= admitted.len() as u32;
        for &(_, request) in &admitted {
            let index = request.token as u32;
            let generation = (request.token >> 32) as u32;
            let slot = &self.requests[index as usize];
            assert_eq!(
                slot.generation, generation,
                "stale request from the scheduler"
            );
            assert_eq!(slot.state, RequestState::Queued);
            let connection_index = slot.connection_index;
            if self.connections[connection_index as usize].state == ConnectionState::Closing {
                self.free_request(index);
                self.maybe_finish_close(connection_index);
                continue;
            }
            self.submit_io(index, now);
        }
        admitted.clear();
        self.admitted = admitted;
    }

    /// Scheduler events: room in a full tenant queue (retry the blocked requests next
    /// iteration), and deficit episodes (to the control plane, which sends RENEGOTIATE).
    fn handle_scheduler_events(&mut self, now: Nanos) {
        for namespace_index in 0..self.qos.len() {
            while let Some(namespace) = self.qos[namespace_index].as_mut() {
                let Some(event) = namespace.scheduler.poll_event() else {
                    break;
                };
                let observed_iops = match event {
                    SchedulerEvent::QueueRoom { .. } => {
                        self.queue_room = true;
                        continue;
                    }
                    SchedulerEvent::DeficitLimitReached { tenant } => {
                        match namespace.accounts.get_mut(tenant.0 as usize) {
                            Some(account) => {
                                account.stats.deficit_episodes += 1;
                                account.meter.iops(now)
                            }
                            None => 0,
                        }
                    }
                    SchedulerEvent::DeficitRecovered { .. } => 0,
                };
                self.with_control(now, |control, thread, own| {
                    control.scheduler_event(
                        thread,
                        namespace_index as u16,
                        event,
                        observed_iops,
                        own,
                    );
                });
            }
        }
    }

    // ----- Tenants and the control plane ----------------------------------------------------

    /// Calls the control plane for this thread and applies the messages it returns for this
    /// thread, in order, before anything else happens here.
    fn with_control<R>(
        &mut self,
        now: Nanos,
        call: impl FnOnce(&ControlPlane, usize, &mut Vec<ControlMessage>) -> R,
    ) -> R {
        let mut messages = std::mem::take(&mut self.messages);
        messages.clear();
        let result = call(&self.control, self.thread_index, &mut messages);
        for message in messages.drain(..) {
            self.apply_message(message, now);
        }
        self.messages = messages;
        result
    }

    /// Applies up to [`MESSAGES_PER_ITERATION_MAX`] messages waiting in this thread's mailbox.
    fn apply_control_messages(&mut self, now: Nanos) {
        let mut messages = std::mem::take(&mut self.messages);
        messages.clear();
        self.control
            .take_messages(self.thread_index, MESSAGES_PER_ITERATION_MAX, &mut messages);
        for message in messages.drain(..) {
            self.apply_message(message, now);
        }
        self.messages = messages;
    }

    fn apply_message(&mut self, message: ControlMessage, now: Nanos) {
        self.stats.control_messages += 1;
        match message {
            ControlMessage::Rates {
                namespace_index,
                update,
            } => {
                if let Some(namespace) = self.qos[usize::from(namespace_index)].as_mut() {
                    tracing::debug!(
                        thread = self.thread_index,
                        namespace_index,
                        ?update,
                        "rate update"
                    );
                    namespace.scheduler.apply(update, now);
                }
            }
            ControlMessage::Revoke { handle } => {
                for connection in self.connections.iter_mut() {
                    if connection.state == ConnectionState::Free {
                        continue;
                    }
                    if let Some(bound) = connection.bound.as_mut()
                        && bound.tenant.handle == handle
                    {
                        bound.revoked = true;
                    }
                    // The registry forgot the tenant: nothing to disconnect later.
                    connection
                        .charged
                        .retain(|charge| charge.tenant.handle != handle);
                }
            }
            ControlMessage::Notice { body } => {
                for index in 0..self.connections.len() {
                    let connection = &mut self.connections[index];
                    let charged = connection
                        .charged
                        .iter()
                        .any(|charge| charge.tenant.handle == body.handle);
                    if connection.state != ConnectionState::Open
                        || connection.draining
                        || !matches!(connection.frontend, Frontend::Native)
                        || !charged
                    {
                        continue;
                    }
                    if connection.notices.len() >= NOTICES_PENDING_MAX {
                        connection.notices.pop_front();
                        self.stats.notices_dropped += 1;
                    }
                    connection.notices.push_back(body);
                    self.mark_parse(index as u32);
                }
            }
        }
    }

    fn set_qos_participating(&mut self, participating: bool) {
        if self.qos_participating == participating {
            return;
        }
        self.qos_participating = participating;
        for namespace in self.qos.iter_mut().flatten() {
            namespace.scheduler.set_participating(participating);
        }
    }

    /// Resolves the tenant of an I/O request and checks the connection may do it: a BIND
    /// limits the connection to its tenant's namespace (and to reads, for a read-only
    /// tenant). On a QoS namespace the tenant is the bound one, else the protocol's (NBD
    /// export, original port), else the namespace's default; the connection is counted for
    /// it the first time.
    fn charge(
        &mut self,
        connection_index: u32,
        mut io: IoRequest,
        now: Nanos,
    ) -> Result<IoRequest, Status> {
        let namespace_index = io.namespace_index;
        let connection = &self.connections[connection_index as usize];
        let writes = matches!(
            io.kind,
            IoKind::Write { .. } | IoKind::Trim { .. } | IoKind::WriteZeroes { .. }
        );
        if let Some(bound) = connection.bound
            && (bound.revoked
                || bound.namespace_index != namespace_index
                || (bound.read_only && writes))
        {
            return Err(Status::Permission);
        }
        let Some(namespace) = self.qos[usize::from(namespace_index)].as_ref() else {
            return Ok(io);
        };
        let tenant = match connection.bound {
            Some(bound) => bound.tenant,
            None if !io.tenant.is_none() => io.tenant,
            None => namespace.default_tenant,
        };
        let counted = connection
            .charged
            .iter()
            .any(|charge| charge.tenant.handle == tenant.handle);
        if !counted {
            let connected = self.with_control(now, |control, thread, own| {
                control.connect(thread, tenant.handle, own)
            });
            if !connected {
                return Err(Status::Permission);
            }
            self.connections[connection_index as usize]
                .charged
                .push(Charge {
                    namespace_index,
                    tenant,
                });
            self.ensure_account(namespace_index, tenant, now);
        }
        if let Some(account) = self.qos[usize::from(namespace_index)]
            .as_mut()
            .and_then(|namespace| namespace.accounts.get_mut(tenant.id as usize))
        {
            account.stats.arrivals += 1;
            account.meter.arrival(now);
        }
        io.tenant = tenant;
        Ok(io)
    }

    /// Makes sure this thread accounts for `tenant` (its id may have served another tenant
    /// before: that one's figures are kept by handle).
    fn ensure_account(&mut self, namespace_index: u16, tenant: TenantRef, now: Nanos) {
        let Some(namespace) = self.qos[usize::from(namespace_index)].as_mut() else {
            return;
        };
        let id = tenant.id as usize;
        if namespace.accounts.len() <= id {
            namespace.accounts.resize(id + 1, TenantAccount::default());
        }
        let account = &mut namespace.accounts[id];
        if account.stats.handle == tenant.handle {
            return;
        }
        if account.stats.handle != 0 {
            let retired = self
                .retired_accounts
                .entry(account.stats.handle)
                .or_insert_with(|| TenantStats {
                    handle: account.stats.handle,
                    namespace_id: account.stats.namespace_id,
                    ..TenantStats::default()
                });
            retired.add(&account.stats);
        }
        *account = TenantAccount {
            stats: TenantStats {
                handle: tenant.handle,
                namespace_id: namespace.namespace_id,
                ..TenantStats::default()
            },
            meter: DemandMeter::starting(now),
        };
    }

    /// A control request of a native connection (REGISTER, UNREGISTER, BIND).
    fn control_request(
        &mut self,
        connection_index: u32,
        request: ControlRequest,
        now: Nanos,
    ) -> ControlAnswer {
        match request {
            ControlRequest::Register(body) => {
                let namespace_index = self.namespaces.index_of(body.namespace_id);
                self.with_control(now, |control, thread, own| {
                    control.register(thread, namespace_index, &body, own)
                })
            }
            ControlRequest::Unregister { handle } => self
                .with_control(now, |control, thread, own| {
                    control.unregister(thread, handle, own)
                }),
            ControlRequest::Bind { handle } => {
                let status = self.bind(connection_index, handle, now);
                ControlAnswer {
                    status,
                    body: ControlBody::None,
                }
            }
        }
    }

    /// BIND: the connection's I/O is charged to `handle` from now on (0: back to the
    /// defaults). It stops counting for every other tenant it was charged to.
    fn bind(&mut self, connection_index: u32, handle: u64, now: Nanos) -> Status {
        let connection = &mut self.connections[connection_index as usize];
        if handle == wire::NO_TENANT_HANDLE {
            if let Some(bound) = connection.bound.take()
                && let Some(position) = connection
                    .charged
                    .iter()
                    .position(|charge| charge.tenant.handle == bound.tenant.handle)
            {
                connection.charged.swap_remove(position);
                self.with_control(now, |control, thread, own| {
                    control.disconnect(thread, std::iter::once(bound.tenant.handle), own);
                });
            }
            return Status::Ok;
        }
        if let Some(bound) = connection.bound
            && bound.tenant.handle == handle
            && !bound.revoked
        {
            return Status::Ok;
        }
        let Some(binding) = self.with_control(now, |control, thread, own| {
            control.bind(thread, handle, own)
        }) else {
            return Status::Invalid;
        };
        let mut charged = self.release_charges(connection_index, now);
        charged.push(Charge {
            namespace_index: binding.namespace_index,
            tenant: binding.tenant,
        });
        let connection = &mut self.connections[connection_index as usize];
        connection.charged = charged;
        connection.bound = Some(Bound {
            tenant: binding.tenant,
            namespace_index: binding.namespace_index,
            read_only: binding.read_only,
            revoked: false,
        });
        self.ensure_account(binding.namespace_index, binding.tenant, now);
        Status::Ok
    }

    /// What each tenant did on this thread.
    fn tenant_stats(&self) -> Vec<TenantStats> {
        let mut by_handle = self.retired_accounts.clone();
        for namespace in self.qos.iter().flatten() {
            for account in &namespace.accounts {
                if account.stats.handle == 0 {
                    continue;
                }
                by_handle
                    .entry(account.stats.handle)
                    .or_insert_with(|| TenantStats {
                        handle: account.stats.handle,
                        namespace_id: account.stats.namespace_id,
                        ..TenantStats::default()
                    })
                    .add(&account.stats);
            }
        }
        by_handle.into_values().collect()
    }

    fn submit_io(&mut self, index: u32, now: Nanos) {
        self.transition(index, RequestState::Submitted);
        self.device_in_flight += 1;
        self.requests[index as usize].submitted_at = now;
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
            queue: self.connections[request.connection_index as usize].device_queue,
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
        match self.qos[usize::from(queued.namespace_index)].as_mut() {
            None => self.scheduler.on_complete(&queued, now),
            Some(namespace) => {
                let device_ns = now
                    .saturating_since(self.requests[index as usize].submitted_at)
                    .0;
                if let Some(account) = namespace.accounts.get_mut(queued.tenant as usize) {
                    account.stats.device_ns += device_ns;
                }
            }
        }
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
        if self.connections[index as usize].blocked_count > 0 {
            for _ in 0..self.blocked.len() {
                let Some(request) = self.blocked.pop_front() else {
                    break;
                };
                if self.requests[request as usize].connection_index == index {
                    self.free_request(request);
                } else {
                    self.blocked.push_back(request);
                }
            }
            self.connections[index as usize].blocked_count = 0;
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

    /// Tells the control plane the connection no longer counts for the tenants it was charged
    /// to, and returns its (now empty) charge list, capacity kept for reuse.
    fn release_charges(&mut self, connection_index: u32, now: Nanos) -> Vec<Charge> {
        let mut charged = std::mem::take(&mut self.connections[connection_index as usize].charged);
        if !charged.is_empty() {
            self.with_control(now, |control, thread, own| {
                control.disconnect(
                    thread,
                    charged.iter().map(|charge| charge.tenant.handle),
                    own,
                );
            });
        }
        charged.clear();
        charged
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
        assert_eq!(connection.blocked_count, 0);
        connection.bound = None;
        connection.notices.clear();
        connection.device_queue = DEFAULT_DEVICE_QUEUE;
        if !connection.charged.is_empty() {
            let now = self.now();
            let charged = self.release_charges(index, now);
            self.connections[index as usize].charged = charged;
        }
        let connection = &mut self.connections[index as usize];
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
