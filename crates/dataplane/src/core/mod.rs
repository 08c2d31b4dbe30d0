//! One dataplane thread as a sans-IO state machine (ReFlex paper §3.1, two-step run to
//! completion): its connections, requests, buffer arena and per-namespace QoS schedulers.
//!
//! The dataplane never touches a socket, a device or a clock. A driver (io_uring or epoll in
//! reflexd, a virtual network and the emulated device in the simulator) moves bytes and calls,
//! in each iteration of its loop:
//! 1. `handle_*` for every completion it reaped (at most [`BATCH_MAX`] per iteration):
//!    [`Dataplane::handle_accept`], [`Dataplane::handle_recv`], [`Dataplane::handle_sent`],
//!    [`Dataplane::handle_device`];
//! 2. [`Dataplane::process`] with the iteration's `now`: control messages, shutdown phases,
//!    timeouts, then step one (parse and validate received bytes, charge tenants, enqueue),
//!    the scheduling round of every namespace, and sends;
//! 3. [`Dataplane::poll_op`] until it returns `None`, issuing each [`Op`] (a device that
//!    finishes synchronously is reported at once through `handle_device`, after which the
//!    driver calls `process` again so the answers go out in the same iteration; reflexd's
//!    drivers split each pass into [`Dataplane::process_without_sends`] and, after the last,
//!    [`Dataplane::start_sends`], so every pass's answers leave in one send per connection);
//! 4. it sleeps (blocking mode) no longer than [`Dataplane::next_deadline`] and only when
//!    [`Dataplane::has_pending_work`] is false, after [`Dataplane::will_sleep`].
//!
//! Code map: `ops` (what the driver is asked to do), `request` (slots, work, states),
//! `connection` (accept, limits, close), `receive` (step one), `dispatch` (schedulers and
//! device operations, step two), `io` (requests of several device operations: WRITE payloads
//! part by part, read-modify-write edges, READ parts, the write gate), `send` (answers), `tenants` (charging, BIND, control
//! messages), `shutdown` (phases), `timeouts` (housekeeping), `errors` (device failure log),
//! `limits`, `stats`, `kv` (key-value requests: the table's step machines driven through
//! the schedulers).
//!
//! Invariants: every request gets exactly one answer; bad input gets an error status, and only
//! broken framing closes a connection (after answering what came before it); everything is
//! bounded (connections, request slots, the window per connection, the arena and each
//! connection's share of it, segments per send, device operations in flight) and running out
//! of any of it is back-pressure on the connection that needs it, never growth or loss.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;

use reflex_qos::{Admitted, Nanos, Policy, QosConfig};

use crate::access::{ListenerAccess, RefusalLog};
use crate::buffers::{PAGE_SIZE, PageAllocator};
use crate::control::{ControlMessage, ControlPlane, MESSAGES_PER_ITERATION_MAX, NamespaceQosSetup};
use crate::frontend::{NbdExports, NvmeTcpTargets, Protocol};
use crate::memory::Arena;
use crate::namespaces::NamespaceSet;
use crate::telemetry::LatencyHistogram;

mod calibration;
mod catalog;
mod composite;
mod connection;
mod dispatch;
mod errors;
mod handoff;
mod io;
mod kv;
mod kv_owner;
mod limits;
mod migration;
mod ops;
mod publish;
mod receive;
mod request;
mod rtt;
mod send;
mod shutdown;
mod stats;
mod tenants;
mod timeouts;
mod tls;

use connection::{Connection, Listener};
use errors::DeviceErrorLog;
pub use handoff::{MoveCause, MovedConnection};
use io::GateWaits;
pub use kv::KvSetup;
pub use kv_owner::{KvMessage, KvNext, KvRequestRef};
pub use limits::{
    CONNECTION_SLACK, DEVICE_IN_FLIGHT_PER_THREAD_MAX, DRAIN_TIMEOUT_DEFAULT, Limits,
    RECV_BUFFERS_SPARE_MAX,
};
pub use migration::{MIGRATED_TOKEN, MigratedRead, MigrationMessage, exchange_queue_capacity};
pub use ops::{AcceptRefused, ConnectionId, DeviceCommand, DeviceOpId, DeviceOpKind, Op};
pub use request::{GENERATION_MASK, REQUEST_STATE_COUNT, RequestState};
pub use send::SEND_SEGMENTS_MAX;
use shutdown::Phase;
pub use stats::CoreStats;
use tenants::NamespaceQos;
pub use tenants::{NOTICES_PENDING_MAX, TenantStats};
pub use timeouts::HOUSEKEEPING_INTERVAL;
pub use tls::psk::{PskError, PskKeys};
pub use tls::{TlsCurrent, TlsKeys, TlsSetup};

/// One namespace's read latencies on this thread, from arrival off the socket to the answer's
/// last byte leaving, since start; and what the current calibration window collected.
#[derive(Debug, Clone, Default)]
pub struct NamespaceTelemetry {
    pub reads: LatencyHistogram,
    pub window: TelemetryWindow,
}

/// What one thread saw of a namespace since it last published to the control plane (online
/// self-calibration, `docs/QOS.md` §11).
#[derive(Debug, Clone, Default)]
pub struct TelemetryWindow {
    /// Latency-critical tenants' reads, from arrival off the socket to the answer leaving.
    pub lc_reads: LatencyHistogram,
    /// The same reads from their submission to the device to the answer leaving: what the
    /// device and the server's own timing add, without the time a tenant's requests waited
    /// for its own tokens (the calibration signal).
    pub lc_reads_service: LatencyHistogram,
    /// Tokens the namespace's scheduler charged (all tenants): how hard the device was driven.
    pub tokens_spent: reflex_qos::Tokens,
    /// Smoothed TCP round-trip times of connections carrying LC reads (`core/rtt.rs`): the
    /// network's share of what LC tenants see.
    pub network_rtt: LatencyHistogram,
    /// The largest excess of a latency-critical tenant's client-reported p95 over its SLO
    /// (µs; negative: under it) among the window's REPORTs; `None`: no report.
    pub client_excess_us: Option<i64>,
    /// The largest backlog a latency-critical tenant's client reported in the window: requests
    /// due and not yet sent, waiting in the client behind its full window; `None`: no report.
    pub client_backlog: Option<u64>,
    /// The share of the interval the publishing thread spent working or waiting for a CPU
    /// (merged: the busiest thread's). Near 1, the server's CPU, not the device, is slow.
    pub server_busy: f64,
    /// Latency-critical tenants' requests waiting at the scheduler for tokens when the thread
    /// published (merged: the largest); `None` before the first publication. Self-calibration
    /// sees from it whether tenants slowed down when a squeeze told them to.
    pub lc_queued_requests: Option<u64>,
}

impl TelemetryWindow {
    pub fn is_empty(&self) -> bool {
        self.lc_reads.is_empty() && self.tokens_spent == reflex_qos::Tokens::ZERO
    }

    pub fn merge(&mut self, other: &TelemetryWindow) {
        self.lc_reads.merge(&other.lc_reads);
        self.lc_reads_service.merge(&other.lc_reads_service);
        self.tokens_spent += other.tokens_spent;
        self.network_rtt.merge(&other.network_rtt);
        if let Some(excess_us) = other.client_excess_us {
            self.note_client_excess(excess_us);
        }
        self.client_backlog = self.client_backlog.max(other.client_backlog);
        self.server_busy = self.server_busy.max(other.server_busy);
        // `None` orders below every `Some`.
        self.lc_queued_requests = self.lc_queued_requests.max(other.lc_queued_requests);
    }

    /// A client reported a p95 `excess_us` over its tenant's SLO.
    pub fn note_client_excess(&mut self, excess_us: i64) {
        self.client_excess_us = Some(
            self.client_excess_us
                .map_or(excess_us, |e| e.max(excess_us)),
        );
    }

    /// A client reported `backlog` requests due and not yet sent.
    pub fn note_client_backlog(&mut self, backlog: u64) {
        // `None` orders below every `Some`, as in `merge`.
        self.client_backlog = self.client_backlog.max(Some(backlog));
    }

    pub fn clear(&mut self) {
        self.lc_reads.clear();
        self.lc_reads_service.clear();
        self.tokens_spent = reflex_qos::Tokens::ZERO;
        self.network_rtt.clear();
        self.client_excess_us = None;
        self.client_backlog = None;
        self.server_busy = 0.0;
        self.lc_queued_requests = None;
    }
}

/// Completions a driver handles per iteration (the paper's adaptive batching cap).
pub const BATCH_MAX: usize = 64;

/// Loans of freed requests given back in one go at most ([`Dataplane::return_loans`]): a
/// send's worth, so their cache lines fit in the cache together.
const LOANS_RETURNED_TOGETHER_MAX: usize = 2 * BATCH_MAX;

/// What a dataplane needs to start.
pub struct DataplaneSetup {
    pub thread_index: usize,
    /// The protocol of each of the driver's listeners, by listener index.
    pub listeners: Vec<Protocol>,
    /// Each listener's name and allow-list, by listener index; a listener without an entry
    /// serves every peer.
    pub listener_access: Vec<ListenerAccess>,
    pub namespaces: Arc<NamespaceSet>,
    /// The NBD export table, when a listener speaks NBD.
    pub nbd_exports: Option<Arc<NbdExports>>,
    /// The NVMe/TCP subsystems and controllers, when a listener speaks NVMe/TCP.
    pub nvme_tcp: Option<Arc<NvmeTcpTargets>>,
    pub limits: Limits,
    pub control: Arc<ControlPlane>,
    /// Per namespace: its scheduler setup.
    pub qos: Vec<NamespaceQosSetup>,
    pub qos_config: QosConfig,
    /// TLS keys and which listeners speak TLS (`None`: no TLS anywhere).
    pub tls: Option<TlsSetup>,
    /// The driver's clock when the dataplane starts.
    pub now: Nanos,
    /// The key-value table this thread serves (`core/kv.rs`), if any.
    pub kv: Option<KvSetup>,
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("limits: {0}")]
    Limits(String),
    #[error("QoS scheduler: {0}")]
    Qos(String),
}

pub struct Dataplane {
    arena: Arena,
    pages: PageAllocator,
    requests: Box<[request::Request]>,
    /// Per request: the device memory its READ answer is sent from, when the device lent it
    /// instead of reading into the run ([`Self::handle_device_lent`]); dropped when the
    /// request is freed, after its send.
    lent: Box<[Option<reflex_flash::Lent>]>,
    /// Loans of freed requests, given back together by [`Self::return_loans`] (at the end of
    /// each input and before it grows past [`LOANS_RETURNED_TOGETHER_MAX`]): each return is an
    /// atomic on a cold line, and prefetching a batch's lines first overlaps their misses.
    loans_to_return: Vec<reflex_flash::Lent>,
    free_requests: Vec<u32>,
    connections: Box<[Connection]>,
    /// Slots free for a new connection: a closed one's slot joins when the driver takes its
    /// [`Op::Close`].
    free_connections: Vec<u32>,
    /// Connections in the `Open` state (the table's limit counts these).
    open_connections: u32,
    connections_by_source: HashMap<IpAddr, u32>,
    /// Spare receive buffers (parked and closed connections give theirs back).
    recv_buffers: Vec<Box<[u8]>>,
    listeners: Vec<Listener>,
    namespaces: Arc<NamespaceSet>,
    nbd_exports: Option<Arc<NbdExports>>,
    nvme_tcp: Option<Arc<NvmeTcpTargets>>,
    limits: Limits,
    /// Per namespace: whether the device discards (it says so and has not refused one on
    /// this thread). NBD TRIM and WRITE_ZEROES skip the discard where it does not.
    discards: Vec<bool>,
    parse_ready: VecDeque<u32>,
    send_ready: VecDeque<u32>,
    /// Connections waiting for a request slot or a buffer run.
    waiters: VecDeque<u32>,
    /// Scratch for [`Self::wake_waiters`]: the waiters being woken, and those that go behind.
    waiters_woken: VecDeque<u32>,
    waiters_behind: Vec<u32>,
    resources_freed: bool,
    /// Operations for the driver, in order.
    ops: VecDeque<Op>,
    phase: Phase,
    shutdown_requested: bool,
    flushes_pending: u32,
    /// Key-value requests orphaned at shutdown while their table step was at the owner (its
    /// answer never came): the owner may still use their runs (`shutdown.rs`).
    kv_orphaned_at_owner: u32,
    device_in_flight: u32,
    thread_index: usize,
    stats: CoreStats,
    control: Arc<ControlPlane>,
    /// Per namespace index.
    qos: Vec<NamespaceQos>,
    /// Requests waiting for room in a full tenant queue, oldest first.
    blocked: VecDeque<u32>,
    /// The scheduler reported room since the blocked requests were last retried.
    queue_room: bool,
    /// Requests inside the schedulers.
    qos_queued: u32,
    /// Whether this thread takes part in the global buckets' round resets (it leaves while
    /// it sleeps idle).
    qos_participating: bool,
    /// A request entered a scheduler since its last round (schedule again before sleeping).
    qos_fresh: bool,
    /// Scratch: what one scheduling round admitted.
    admitted: Vec<Admitted>,
    /// Scratch: what a fairness stage released in one round (tenant id, scheduler token).
    fair_released: Vec<(u32, u64)>,
    /// Scratch: admitted reads going to other threads in one round (token, destination).
    migrating: Vec<(u64, u16)>,
    /// Scratch: control messages being applied.
    messages: Vec<ControlMessage>,
    /// Accounts of tenant ids that were reused by another tenant on this thread, by handle.
    retired_accounts: BTreeMap<u64, TenantStats>,
    /// Per tenant of a composite namespace (by handle): its tenant id on each member, in
    /// member order (`composite`). Learnt when a connection first charges the tenant,
    /// forgotten when it is revoked; bounded by the tenants of composite namespaces.
    member_tenants: HashMap<u64, Box<[u32]>>,
    device_errors: DeviceErrorLog,
    /// Per namespace: read latencies measured as answers leave.
    telemetry: Vec<NamespaceTelemetry>,
    rtt: rtt::RttSampler,
    /// Per namespace slot: whether the driver holds this thread's queue of its device.
    queues_open: Vec<bool>,
    /// Slots being removed that this thread has not drained yet (`catalog`), then those whose
    /// flush is in flight, then those flushed (their queue closes at the next `process`).
    draining: Vec<u16>,
    flushing: Vec<u16>,
    flushed: Vec<u16>,
    qos_config: QosConfig,
    /// Requests waiting at the write gate (`io`).
    gate_waits: GateWaits,
    /// Scratch: the extents of one block status.
    extents: Vec<reflex_flash::Extent>,
    housekeeping_at: Nanos,
    /// Publication of the telemetry windows (`None`: self-calibration off).
    telemetry_interval: Option<Nanos>,
    telemetry_publish_at: Nanos,
    /// The thread's idle and run-delay counters at the last publication (`calibration`).
    telemetry_cpu_mark: calibration::CpuMark,
    /// The `now` of the last `process` (for work done outside it, such as a close).
    last_now: Nanos,
    /// Counters only the live figures need (`publish`).
    live: publish::LiveCounters,
    tls: Option<TlsSetup>,
    /// TLS connections whose inner receive decrypted bytes can satisfy (`tls`).
    tls_deliveries: VecDeque<u32>,
    /// Log lines about refused requests (rate-limited; every refusal is counted).
    refusal_log: RefusalLog,
    /// The key-value table and its operations in progress (`kv`).
    kv: Option<kv::KvEngine>,
    /// Reads served for other threads and messages to them (`migration`).
    migration: migration::Migration,
    /// Thread scaling: whether this thread is parked, and its connections on the move.
    handoff: handoff::Handoff,
}

impl Dataplane {
    pub fn new(setup: DataplaneSetup) -> Result<Dataplane, SetupError> {
        setup.limits.check().map_err(SetupError::Limits)?;
        assert_eq!(setup.qos.len(), setup.namespaces.len());
        let limits = setup.limits;
        let arena = Arena::new(limits.arena_bytes);
        let page_count = (limits.arena_bytes / PAGE_SIZE) as u32;
        let requests: Box<[request::Request]> = (0..limits.requests_max)
            .map(|_| request::Request::empty())
            .collect();
        let table_size = limits.connections_max + CONNECTION_SLACK;
        let connections: Box<[Connection]> = (0..table_size).map(|_| Connection::empty()).collect();
        let mut access = setup.listener_access.into_iter();
        let listeners = setup
            .listeners
            .into_iter()
            .enumerate()
            .map(|(index, protocol)| Listener {
                protocol,
                accept_in_flight: false,
                closed: false,
                connections: 0,
                access: access
                    .next()
                    .unwrap_or_else(|| ListenerAccess::open(format!("listener {index}"))),
                refused: [0; AcceptRefused::COUNT],
                refusal_log: RefusalLog::new(),
                waiting_first_request: VecDeque::new(),
            })
            .collect();
        let mut stats = CoreStats::default();
        stats.requests_per_state[RequestState::Free as usize] = limits.requests_max;
        let mut qos = Vec::with_capacity(setup.qos.len());
        for (index, namespace) in setup.qos.into_iter().enumerate() {
            let shared = std::sync::Arc::clone(&namespace.shared);
            let scheduler = reflex_qos::Scheduler::new(
                namespace.shared,
                setup.thread_index as u16,
                &setup.qos_config,
                namespace.policy,
                setup.now,
            )
            .map_err(|e| SetupError::Qos(e.to_string()))?;
            let fair = reflex_qos::FairQueue::new(&setup.qos_config.fairness, setup.now)
                .map_err(|e| SetupError::Qos(e.to_string()))?;
            let migrator =
                reflex_qos::Migrator::new(&setup.qos_config.fairness.migration, setup.thread_index);
            if migrator.is_enabled() {
                shared
                    .migration_board()
                    .join(setup.thread_index, fair.depth_max());
            }
            qos.push(NamespaceQos {
                scheduler,
                fair,
                migrator,
                shared,
                loads: Vec::new(),
                default_tenant: namespace.default_tenant,
                namespace_id: setup.namespaces.id(index as u16),
                accounts: Vec::new(),
            });
        }
        let qos_count = setup.namespaces.len();
        // A composite namespace has no device of its own: its members' queues serve it.
        let queues_open: Vec<bool> = (0..qos_count)
            .map(|index| setup.namespaces.composite(index as u16).is_none())
            .collect();
        let namespace_ids = (0..setup.namespaces.len())
            .map(|index| setup.namespaces.id(index as u16))
            .collect();
        let mut dataplane = Dataplane {
            arena,
            pages: PageAllocator::new(page_count),
            free_requests: (0..limits.requests_max).rev().collect(),
            lent: (0..requests.len()).map(|_| None).collect(),
            loans_to_return: Vec::with_capacity(LOANS_RETURNED_TOGETHER_MAX),
            requests,
            free_connections: (0..table_size).rev().collect(),
            connections,
            open_connections: 0,
            connections_by_source: HashMap::new(),
            recv_buffers: Vec::new(),
            listeners,
            discards: (0..setup.namespaces.len())
                .map(|index| setup.namespaces.info(index as u16).supports_trim)
                .collect(),
            namespaces: setup.namespaces,
            nbd_exports: setup.nbd_exports,
            nvme_tcp: setup.nvme_tcp,
            parse_ready: VecDeque::with_capacity(table_size as usize),
            send_ready: VecDeque::with_capacity(table_size as usize),
            waiters: VecDeque::with_capacity(table_size as usize),
            waiters_woken: VecDeque::with_capacity(table_size as usize),
            waiters_behind: Vec::with_capacity(table_size as usize),
            resources_freed: false,
            ops: VecDeque::with_capacity(2 * BATCH_MAX),
            phase: Phase::Running,
            shutdown_requested: false,
            flushes_pending: 0,
            kv_orphaned_at_owner: 0,
            device_in_flight: 0,
            thread_index: setup.thread_index,
            stats,
            control: setup.control,
            qos,
            blocked: VecDeque::with_capacity(limits.requests_max as usize),
            queue_room: false,
            qos_queued: 0,
            qos_participating: true,
            qos_fresh: false,
            admitted: Vec::with_capacity(limits.device_in_flight_max as usize),
            fair_released: Vec::with_capacity(limits.device_in_flight_max as usize),
            migrating: Vec::with_capacity(limits.device_in_flight_max as usize),
            messages: Vec::with_capacity(MESSAGES_PER_ITERATION_MAX),
            retired_accounts: BTreeMap::new(),
            member_tenants: HashMap::new(),
            device_errors: DeviceErrorLog::new(setup.thread_index, namespace_ids),
            telemetry: vec![NamespaceTelemetry::default(); qos_count],
            rtt: rtt::RttSampler::default(),
            queues_open,
            draining: Vec::new(),
            flushing: Vec::new(),
            flushed: Vec::new(),
            qos_config: setup.qos_config.clone(),
            gate_waits: GateWaits::new(limits.requests_max),
            extents: Vec::with_capacity(crate::frontend::BLOCK_STATUS_EXTENTS_MAX),
            housekeeping_at: setup.now,
            telemetry_interval: calibration::publish_interval(
                setup.qos_config.calibration.enabled,
                setup.qos_config.calibration.window(),
            ),
            telemetry_publish_at: setup.now,
            telemetry_cpu_mark: calibration::CpuMark::new(setup.now),
            last_now: setup.now,
            live: publish::LiveCounters::new(qos_count, setup.now),
            tls: setup.tls,
            tls_deliveries: VecDeque::new(),
            refusal_log: RefusalLog::new(),
            kv: setup
                .kv
                .map(|kv| kv::KvEngine::new(kv, limits.requests_max)),
            migration: migration::Migration::default(),
            handoff: handoff::Handoff::default(),
            limits,
        };
        // The device rates the registries computed at startup.
        while dataplane.control.has_messages(dataplane.thread_index) {
            dataplane.apply_control_messages(setup.now);
        }
        for listener in 0..dataplane.listeners.len() {
            dataplane.arm_accept(listener as u32);
        }
        Ok(dataplane)
    }

    /// One pass of the iteration's work at `now`: control messages, shutdown phases,
    /// timeouts, step one (parse), scheduling rounds, and sends. Its operations come out of
    /// [`Self::poll_op`].
    pub fn process(&mut self, now: Nanos) {
        self.process_without_sends(now);
        self.start_sends(now);
    }

    /// [`Self::process`] up to the sends: answers queue on their connections. A driver whose
    /// device answered during this pass runs another at once, and the answers of every pass
    /// leave in one gathered send per connection (a send started after the first pass would
    /// still be in flight, so the later answers would wait for the next iteration). The
    /// driver calls [`Self::start_sends`] after its last pass.
    pub fn process_without_sends(&mut self, now: Nanos) {
        self.last_now = now;
        if self.control.has_messages(self.thread_index) {
            self.apply_control_messages(now);
        }
        self.set_qos_participating(true);
        self.advance_phase(now);
        self.housekeeping(now);
        self.publish_telemetry(now);
        self.parse_step(now);
        self.dispatch_step(now);
        self.handle_scheduler_events(now);
        self.return_loans();
    }

    /// The rest of [`Self::process`]: sends of the queued answers, connection handoffs, and
    /// the shutdown checks that wait for them.
    pub fn start_sends(&mut self, now: Nanos) {
        self.last_now = now;
        self.send_step(now);
        self.advance_handoffs(now);
        self.check_drained(now);
        self.advance_phase(now);
        self.return_loans();
    }

    /// The next operation for the driver.
    pub fn poll_op(&mut self) -> Option<Op> {
        let op = self.ops.pop_front()?;
        if let Op::Close { connection } | Op::Handoff { connection, .. } = op {
            // Its slot may be reused from now on, never before the driver saw the Close.
            self.free_connections.push(connection.index);
        }
        Some(op)
    }

    /// The device commands among the operations [`Self::poll_op`] will return, in order: a
    /// driver may look ahead at them (to prefetch what lending the reads touches).
    pub fn queued_device_commands(&self) -> impl Iterator<Item = &DeviceCommand> {
        self.ops.iter().filter_map(|op| match op {
            Op::Device(command) => Some(command),
            _ => None,
        })
    }

    /// Whether `process` has work to do without any new completion (the driver must not
    /// sleep then).
    pub fn has_pending_work(&self) -> bool {
        !self.ops.is_empty()
            || !self.parse_ready.is_empty()
            || !self.send_ready.is_empty()
            || !self.tls_deliveries.is_empty()
            || (self.resources_freed && !self.waiters.is_empty())
            || self.queue_room
            || self.qos_fresh
            || self.control.has_messages(self.thread_index)
            || !self.flushed.is_empty()
            || self.phase_ready()
            || self.gate_retry_ready()
            || self.kv_retry_ready()
            || self.migration.has_outgoing()
    }

    /// The driver is about to sleep: a thread with nothing queued leaves the global buckets'
    /// round resets so the others need not wait for it.
    pub fn will_sleep(&mut self) {
        if self.qos_queued == 0 && self.blocked.is_empty() {
            self.set_qos_participating(false);
        }
        if !self.housekeeping_needed() {
            self.publish_live(self.last_now, true);
        }
    }

    /// The earliest time `process` has something to do without a new completion: a
    /// scheduler refill, a shutdown phase's deadline, the next timeout sweep. Never a time
    /// before the last `process` unless that call left work for now (then
    /// [`Self::has_pending_work`] is true).
    pub fn next_deadline(&self) -> Option<Nanos> {
        let mut deadline: Option<Nanos> = None;
        let mut consider = |due: Nanos| deadline = Some(deadline.map_or(due, |d| d.min(due)));
        for namespace in &self.qos {
            if let Some(due) = namespace.scheduler.next_deadline() {
                consider(due);
            }
        }
        if let Some(due) = self.phase_deadline() {
            consider(due);
        }
        if self.housekeeping_needed() {
            consider(self.housekeeping_at);
        }
        if let Some(due) = self.gate_deadline() {
            consider(due);
        }
        if let Some(due) = self.telemetry_deadline() {
            consider(due);
        }
        deadline
    }

    /// The arena's address and size, for a driver that registers it with the kernel.
    pub fn arena_region(&self) -> (*mut u8, usize) {
        (self.arena.base_ptr(), self.arena.size_bytes())
    }

    /// Operations may still use the arena when the dataplane is dropped: never free it.
    pub fn leak_arena_on_drop(&mut self) {
        self.arena.leak_on_drop();
        // Lent device memory may be in a send too (the loans of freed requests are not).
        std::mem::forget(std::mem::take(&mut self.lent));
        self.return_loans();
    }

    pub fn thread_index(&self) -> usize {
        self.thread_index
    }

    /// Connections parked without a receive buffer, and receive buffers allocated (in use and
    /// spare): what idle connections cost.
    pub fn recv_buffer_usage(&self) -> (u32, usize) {
        let parked = self.connections.iter().filter(|c| c.parked).count() as u32;
        let allocated = self
            .connections
            .iter()
            .filter(|c| !c.recv_buffer.is_empty())
            .count()
            + self.recv_buffers.len();
        (parked, allocated)
    }

    /// Counters, per-tenant figures included.
    /// Requests answered so far (a cheap read of one counter of [`Self::stats`]).
    pub fn requests_answered(&self) -> u64 {
        self.stats.requests_answered
    }

    pub fn stats(&self) -> CoreStats {
        let mut stats = self.stats.clone();
        stats.tenants = self.tenant_stats();
        stats
    }

    /// Counts the driver's iterations and completions into the stats.
    pub fn count_iteration(&mut self, completions: u64) {
        self.stats.iterations += 1;
        self.stats.completions += completions;
        self.live.count_batch(completions);
    }

    /// The driver's facts for the stats: registered buffers, full submission queue flushes.
    pub fn set_driver_stats(&mut self, registered_buffers: bool, sq_full_flushes: u64) {
        self.stats.registered_buffers = registered_buffers;
        self.stats.sq_full_flushes = sq_full_flushes;
    }

    /// Read latencies of a namespace measured on this thread.
    pub fn namespace_telemetry(&self, namespace_index: u16) -> &NamespaceTelemetry {
        &self.telemetry[usize::from(namespace_index)]
    }

    /// Device failures counted on a namespace so far.
    pub fn device_failures(&self, namespace_index: u16) -> u64 {
        self.device_errors.total(namespace_index)
    }

    /// Logs each scheduler's token ledger (at exit).
    pub fn log_ledgers(&self) {
        for namespace in &self.qos {
            let ledger = namespace.scheduler.ledger();
            tracing::info!(
                thread = self.thread_index,
                namespace = namespace.namespace_id,
                policy = ?namespace.scheduler.policy(),
                generated = ledger.generated.as_tokens_f64(),
                from_bucket = ledger.from_bucket.as_tokens_f64(),
                spent = ledger.spent.as_tokens_f64(),
                to_bucket = ledger.to_bucket.as_tokens_f64(),
                withheld = ledger.withheld.as_tokens_f64(),
                written_off = ledger.written_off.as_tokens_f64(),
                iterations = self.stats.iterations,
                "scheduler tokens"
            );
        }
    }
}

/// The scheduling policy of a namespace: tokens where it has a profile and QoS is on.
pub fn policy_for(has_profile: bool, qos_enabled: bool) -> Policy {
    if has_profile && qos_enabled {
        Policy::Tokens
    } else {
        Policy::Fifo
    }
}
