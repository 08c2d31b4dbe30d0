//! A reflexd in virtual time: the real [`Dataplane`] of every thread, the real control plane,
//! driven over a virtual network ([`crate::network`]) and virtual-time devices, the way the
//! io_uring driver drives them in the real server.
//!
//! What a simulation client sees is what a real one would: it sends protocol bytes on a
//! socket and reads the answers the dataplane encoded. Only the costs differ: the network
//! takes its configured latency, devices their model's time, and the dataplane's own work
//! takes no virtual time at all.
//!
//! Determinism: at each instant, device completions are polled and network arrivals delivered
//! in thread and socket order, then every thread processes in thread order until nothing
//! moves; the same inputs give the same run.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;

use reflex_dataplane::control::{ControlPlane, ControlSetup, NamespaceQosSetup, TenantRef, Wake};
use reflex_dataplane::frontend::{ExportBinding, NbdExports, Protocol};
use reflex_dataplane::namespaces::NamespaceSet;
use reflex_dataplane::{
    ConnectionId, CoreStats, Dataplane, DataplaneSetup, DeviceOpId, Limits, MigrationMessage, Op,
    SetupError,
};
use reflex_flash::{Completion, Device, DeviceQueue, Submit};
use reflex_qos::{Nanos, QosConfig};

use crate::network::{NetworkModel, Pipe};

/// Passes over the threads at one instant before time must move on (a bound, not a knob: a
/// pass that changes nothing ends the instant).
const PASSES_PER_INSTANT_MAX: usize = 256;

/// A client's socket, by index in the server's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SocketId(pub u32);

/// Everything a virtual server needs.
pub struct VirtualServerSetup {
    pub threads: u16,
    /// `(namespace id, device, read-only)`.
    pub namespaces: Vec<(u32, Arc<dyn Device>, bool)>,
    /// Composite namespaces over those (`reflex_dataplane::composite`), after them in slot
    /// order: `(namespace id, spec)`.
    pub composites: Vec<(u32, reflex_dataplane::composite::CompositeSpec)>,
    pub control: ControlSetup,
    pub qos_config: QosConfig,
    pub limits: Limits,
    pub network: NetworkModel,
    /// The protocols each thread listens for (listener index = position).
    pub listeners: Vec<VirtualListener>,
    /// The NBD exports (needed when a listener speaks NBD), in the order clients list them.
    pub nbd_exports: Vec<VirtualExport>,
    /// The export a client gets for the empty name.
    pub nbd_default_export: Option<String>,
}

/// What a listener speaks. Tenants are named as in reflexd's configuration: the virtual server
/// resolves each name among its namespace's configured tenants once the control plane has
/// admitted them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VirtualListener {
    Native,
    /// The native protocol in TLS from the first byte, with this server configuration.
    NativeTls(TlsServer),
    /// The original ReFlex protocol on one namespace, charged to a configured tenant (`None`:
    /// the namespace's default tenant).
    Original {
        namespace_index: u16,
        tenant: Option<String>,
    },
    Nbd,
    /// The key-value protocol (`docs/KV.md`) on a table formatted on one namespace when the
    /// server starts, charged to a configured tenant (`None`: the namespace's default tenant).
    /// As in reflexd, every thread accepts on it; thread 0 owns the table and the other
    /// threads forward their requests' table steps to it over the queues between threads.
    Kv {
        namespace_index: u16,
        tenant: Option<String>,
    },
    /// NVMe/TCP (`docs/NVME-TCP.md`): one subsystem over some namespaces. Every NVMe/TCP
    /// listener of a server serves the same targets (those of the first one), as reflexd's
    /// single `[nvme_tcp]` port does.
    NvmeTcp(NvmeTcpListener),
}

/// What an NVMe/TCP listener serves: one subsystem, its namespaces (by index; the NSID is
/// the namespace's id) and hosts, and the transport's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeTcpListener {
    pub subsystem_nqn: String,
    pub namespace_indices: Vec<u16>,
    /// Any host may connect (those not listed get each namespace's default tenant).
    pub allow_any_host: bool,
    /// Hosts by NQN and the configured tenant (by name, in every namespace of the subsystem
    /// that has it; `None` or a namespace without it: the namespace's default tenant) their
    /// I/O is charged to.
    pub hosts: Vec<(String, Option<String>)>,
    pub options: reflex_dataplane::frontend::nvme_tcp_targets::NvmeTcpOptions,
}

/// A TLS listener's rustls server configuration (certificates) and optional pre-shared keys
/// (equal when they are the same ones).
#[derive(Debug, Clone)]
pub struct TlsServer(
    pub Arc<rustls::ServerConfig>,
    pub Option<Arc<reflex_dataplane::PskKeys>>,
);

impl PartialEq for TlsServer {
    fn eq(&self, other: &TlsServer) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            && match (&self.1, &other.1) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

impl Eq for TlsServer {}

/// One NBD export: a namespace under a name, optionally read-only and bound to a configured
/// tenant of that namespace. Its size is the namespace's, rounded down to 512 bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualExport {
    pub name: String,
    pub namespace_index: u16,
    pub read_only: bool,
    pub tenant: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum VirtualServerError {
    #[error("control plane: {0}")]
    Control(#[from] reflex_dataplane::control::ControlError),
    #[error("dataplane: {0}")]
    Setup(#[from] SetupError),
    #[error("thread {thread} does not accept on listener {listener} now")]
    NotAccepting { thread: u16, listener: u32 },
    #[error("connection refused: {0}")]
    Refused(reflex_dataplane::AcceptRefused),
    #[error("invalid setup: {0}")]
    Config(String),
}

/// A model of the dataplane threads' CPU: each thread's work takes virtual time, so a thread
/// with more connections' requests than it can process makes them wait, as a core does
/// (OctoFAS's contended resource). Without it the dataplane's work is free and only devices
/// and the network take time.
///
/// A thread that processes at `t` and does work `w` (its answers, and the device completions
/// it handled, each at its cost) is busy until `t + w`: it is not processed again before,
/// so what arrives meanwhile waits for it. The batch's own operations leave at `t` (the work
/// is paid after, not before: the model bounds each thread's rate and makes its requests
/// queue, which is what fairness between flows on shared threads depends on).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuModel {
    /// Per answered request: receiving, parsing, dispatching and sending, on its home thread.
    pub per_answer: Nanos,
    /// Per device completion handled, on the thread whose device queue served it (a migrated
    /// read's device work is the serving thread's).
    pub per_device_completion: Nanos,
}

/// One thread's account under the CPU model.
#[derive(Debug, Clone, Copy, Default)]
struct CpuAccount {
    /// Not processed before this.
    busy_until: Nanos,
    /// Device completions' cost not yet paid.
    owed_ns: u64,
    /// Answers counted so far.
    answered: u64,
}

struct Thread {
    dataplane: Dataplane,
    /// Per namespace slot: this thread's queue of its device (`None`: removed).
    queues: Vec<Option<Box<dyn DeviceQueue>>>,
    accept_armed: Vec<bool>,
    /// Per listener: whether this thread accepts on it (every listener today; an accept the
    /// dataplane arms on a listener a thread does not serve waits until the listener closes).
    serves: Vec<bool>,
    /// Sockets of this thread by connection (slot index and generation): the dataplane may
    /// hand a slot to a new connection before the driver has taken the old one's `Close`.
    sockets_by_connection: HashMap<(u32, u32), SocketId>,
    /// A device operation it issued finished at once: like reflexd's drivers
    /// (`finished_synchronously`), the thread gets another pass even with no pending work
    /// (a migrated read answered at once frees a place its stage may fill; finding 19).
    finished_synchronously: bool,
}

struct Socket {
    thread: u16,
    id: ConnectionId,
    to_server: Pipe,
    to_client: Pipe,
    /// The dataplane asked for a receive that has not completed.
    recv_pending: bool,
    /// A send that waits for room in the client's buffer.
    send_pending: bool,
    /// A readiness wait of a parked connection.
    wait_pending: bool,
    /// The client closed its sending side: once what it sent is read, receives return 0.
    client_closed: bool,
    /// The server closed the connection.
    server_closed: bool,
    /// The client reset the connection: receives fail with ECONNRESET, sends with EPIPE.
    reset: bool,
    /// The client reads as soon as bytes arrive, within an instant
    /// ([`VirtualServer::set_client_draining`]): what arrived moves to `drained`.
    draining: bool,
    /// Bytes read by a draining client and not yet taken by [`VirtualServer::client_read`].
    drained: Vec<u8>,
}

struct NoWake;

impl Wake for NoWake {
    fn wake(&self) {}
}

pub struct VirtualServer {
    now: Nanos,
    threads: Vec<Thread>,
    sockets: Vec<Socket>,
    control: Arc<ControlPlane>,
    namespaces: Arc<NamespaceSet>,
    qos: Vec<NamespaceQosSetup>,
    network: NetworkModel,
    /// Sockets where bytes arrived for the client since [`VirtualServer::take_readable`].
    readable: Vec<SocketId>,
    completions: Vec<Completion>,
    segments: Vec<u8>,
    /// Accepts whose slot still belonged to a connection whose `Close` the driver had not
    /// taken yet ([`Self::slot_reuses_before_close`]).
    slot_reuses_before_close: u64,
    /// Inter-core migration: the bounded queue from each thread to each other (row-major
    /// (from, to)), as reflexd's single-producer single-consumer rings, and their capacity.
    migration_queues: Vec<VecDeque<MigrationMessage>>,
    migration_queue_capacity: usize,
    /// Messages that found their queue full (they waited in the sender's outbox).
    migration_queue_full: u64,
    /// The CPU model and each thread's account ([`Self::set_cpu_model`]); `None`: free work.
    cpu: Option<(CpuModel, Vec<CpuAccount>)>,
}

impl VirtualServer {
    pub fn new(setup: VirtualServerSetup) -> Result<VirtualServer, VirtualServerError> {
        let mut namespaces = NamespaceSet::new(setup.namespaces);
        for (id, spec) in &setup.composites {
            namespaces = namespaces
                .with_composite(*id, spec, false)
                .map_err(|e| VirtualServerError::Config(e.to_string()))?;
        }
        let namespaces = Arc::new(namespaces);
        let wakers: Vec<Arc<dyn Wake>> = (0..setup.threads)
            .map(|_| Arc::new(NoWake) as Arc<dyn Wake>)
            .collect();
        let (control, qos) = ControlPlane::start(&setup.control, &namespaces, wakers)?;
        let control = Arc::new(control);
        let listeners = setup
            .listeners
            .iter()
            .map(|listener| listener_protocol(listener, &namespaces, &qos))
            .collect::<Result<Vec<Protocol>, VirtualServerError>>()?;
        let nbd_exports = nbd_exports(
            &setup.listeners,
            &setup.nbd_exports,
            setup.nbd_default_export.as_deref(),
            &namespaces,
            &qos,
        )?;
        control.set_catalog(reflex_dataplane::control::Catalog {
            namespaces: Arc::clone(&namespaces),
            nbd_exports: nbd_exports.clone(),
        });
        let tls = tls_setup(&setup.listeners);
        let nvme_tcp = nvme_tcp_setup(&setup.listeners, &namespaces, &qos)?;
        let mut kv = kv_setup(&setup.listeners, &namespaces)?;
        let mut threads = Vec::new();
        for thread_index in 0..usize::from(setup.threads) {
            let dataplane = Dataplane::new(DataplaneSetup {
                // Thread 0 owns the table, as in reflexd; every thread serves the listener.
                kv: kv
                    .as_mut()
                    .map(|(namespace_index, table)| reflex_dataplane::KvSetup {
                        namespace_index: *namespace_index,
                        table: if thread_index == 0 {
                            table.take()
                        } else {
                            None
                        },
                        owner_thread: 0,
                    }),
                tls: tls.clone(),
                thread_index,
                listeners: listeners.clone(),
                listener_access: Vec::new(),
                namespaces: Arc::clone(&namespaces),
                nvme_tcp: nvme_tcp.clone(),
                nbd_exports: nbd_exports.clone(),
                limits: setup.limits.clone(),
                control: Arc::clone(&control),
                qos: qos.clone(),
                qos_config: setup.qos_config.clone(),
                now: Nanos::ZERO,
            })?;
            threads.push(Thread {
                dataplane,
                queues: (0..namespaces.len())
                    .map(|index| namespaces.device(index as u16).map(|device| device.queue()))
                    .collect(),
                accept_armed: vec![false; setup.listeners.len()],
                serves: vec![true; setup.listeners.len()],
                sockets_by_connection: HashMap::new(),
                finished_synchronously: false,
            });
        }
        let thread_count = threads.len();
        let migration_queue_capacity = threads
            .first()
            .map_or(0, |thread| thread.dataplane.migration_queue_capacity());
        let mut server = VirtualServer {
            migration_queues: (0..thread_count * thread_count)
                .map(|_| VecDeque::with_capacity(migration_queue_capacity))
                .collect(),
            migration_queue_capacity,
            migration_queue_full: 0,
            cpu: None,
            now: Nanos::ZERO,
            threads,
            sockets: Vec::new(),
            control,
            namespaces,
            qos,
            network: setup.network,
            readable: Vec::new(),
            completions: Vec::new(),
            segments: Vec::new(),
            slot_reuses_before_close: 0,
        };
        server.run_instant(Nanos::ZERO);
        Ok(server)
    }

    /// Gives the threads' work virtual time from now on ([`CpuModel`]).
    pub fn set_cpu_model(&mut self, model: CpuModel) {
        self.cpu = Some((model, vec![CpuAccount::default(); self.threads.len()]));
    }

    /// Charges `thread` the cost of one device completion it handled.
    fn charge_device_completion(&mut self, thread: usize) {
        if let Some((model, accounts)) = self.cpu.as_mut() {
            accounts[thread].owed_ns += model.per_device_completion.0;
        }
    }

    /// Whether `thread` is still busy with its last batch at `now` (the CPU model).
    fn cpu_busy_at(&self, thread: usize, now: Nanos) -> bool {
        self.cpu
            .as_ref()
            .is_some_and(|(_, accounts)| accounts[thread].busy_until > now)
    }

    pub fn now(&self) -> Nanos {
        self.now
    }

    pub fn control(&self) -> &ControlPlane {
        &self.control
    }

    pub fn namespaces(&self) -> &NamespaceSet {
        &self.namespaces
    }

    /// Each namespace's scheduler setup (default tenant, configured tenants).
    pub fn qos(&self) -> &[NamespaceQosSetup] {
        &self.qos
    }

    /// A client connects to `listener` of `thread` now.
    pub fn connect(
        &mut self,
        thread: u16,
        listener: u32,
        source: Option<IpAddr>,
    ) -> Result<SocketId, VirtualServerError> {
        let now = self.now;
        if !self.is_accepting(thread, listener) {
            return Err(VirtualServerError::NotAccepting { thread, listener });
        }
        let state = &mut self.threads[usize::from(thread)];
        state.accept_armed[listener as usize] = false;
        let accepted = state.dataplane.handle_accept(listener, Ok(source), now);
        let id = match accepted {
            Ok(id) => id,
            Err(refusal) => {
                // The dataplane re-armed its accept: take that operation before returning.
                self.run_instant(now);
                return Err(VirtualServerError::Refused(refusal));
            }
        };
        let socket = SocketId(self.sockets.len() as u32);
        self.sockets.push(Socket {
            thread,
            id,
            to_server: Pipe::default(),
            to_client: Pipe::default(),
            recv_pending: false,
            send_pending: false,
            wait_pending: false,
            client_closed: false,
            server_closed: false,
            reset: false,
            draining: false,
            drained: Vec::new(),
        });
        let state = &mut self.threads[usize::from(thread)];
        if state
            .sockets_by_connection
            .keys()
            .any(|&(index, _)| index == id.index)
        {
            // reflexd's io_uring driver asserts that an accepted connection's slot has no
            // socket: count what it would trip over.
            self.slot_reuses_before_close += 1;
        }
        state
            .sockets_by_connection
            .insert((id.index, id.generation), socket);
        // The connection's first operations (a receive) and the re-armed accept.
        self.run_instant(now);
        Ok(socket)
    }

    /// The client sends `bytes` on `socket` now.
    pub fn client_send(&mut self, socket: SocketId, bytes: &[u8]) {
        let now = self.now;
        let model = self.network;
        let socket = &mut self.sockets[socket.0 as usize];
        assert!(!socket.client_closed, "send after the client closed");
        socket.to_server.send(now, bytes, &model);
    }

    /// The client closes its sending side.
    pub fn client_close(&mut self, socket: SocketId) {
        self.sockets[socket.0 as usize].client_closed = true;
    }

    /// The client resets the connection (RST): what it sent and the server has not read is
    /// lost, the receive in flight fails with ECONNRESET and every send from now on with EPIPE.
    /// The client sends nothing more; what already reached it stays readable.
    pub fn client_reset(&mut self, socket: SocketId) {
        let socket = &mut self.sockets[socket.0 as usize];
        socket.reset = true;
        socket.client_closed = true;
        socket.to_server = Pipe::default();
    }

    /// Whether `thread` has an accept armed on `listener`: [`Self::connect`] would reach the
    /// dataplane now.
    pub fn is_accepting(&self, thread: u16, listener: u32) -> bool {
        let state = &self.threads[usize::from(thread)];
        let index = listener as usize;
        state.accept_armed.get(index).copied().unwrap_or(false)
            && state.serves.get(index).copied().unwrap_or(false)
    }

    /// The accept armed on `listener` of `thread` fails with `errno` (EMFILE, ECONNABORTED);
    /// returns whether one was armed.
    pub fn fail_accept(&mut self, thread: u16, listener: u32, errno: i32) -> bool {
        if !self.is_accepting(thread, listener) {
            return false;
        }
        let now = self.now;
        let state = &mut self.threads[usize::from(thread)];
        state.accept_armed[listener as usize] = false;
        let refused = state.dataplane.handle_accept(listener, Err(errno), now);
        assert!(refused.is_err(), "a failed accept made a connection");
        self.run_instant(now);
        true
    }

    /// Connections the dataplane accepted into a slot whose previous connection's `Op::Close`
    /// was still queued (issued after the accept returned). The simulator tells the two apart
    /// by generation; a driver that keeps one socket per slot cannot.
    pub fn slot_reuses_before_close(&self) -> u64 {
        self.slot_reuses_before_close
    }

    /// Sockets connected so far (closed ones included): `SocketId(0..count)`.
    pub fn socket_count(&self) -> usize {
        self.sockets.len()
    }

    /// The dataplane thread `socket` is connected to.
    pub fn socket_thread(&self, socket: SocketId) -> u16 {
        self.sockets[socket.0 as usize].thread
    }

    /// Whether the server closed `socket` (what it sent before may still be unread).
    pub fn is_server_closed(&self, socket: SocketId) -> bool {
        self.sockets[socket.0 as usize].server_closed
    }

    /// Whether the dataplane has a receive or a send in flight on `socket` (the driver's
    /// operations; none may remain once the server closed the socket).
    pub fn has_operations_in_flight(&self, socket: SocketId) -> bool {
        let socket = &self.sockets[socket.0 as usize];
        socket.recv_pending || socket.send_pending
    }

    /// Moves the bytes that reached the client on `socket` into `out` (the client reads).
    pub fn client_read(&mut self, socket: SocketId, out: &mut Vec<u8>) {
        let socket = &mut self.sockets[socket.0 as usize];
        out.append(&mut socket.drained);
        socket.to_client.read_all(out);
    }

    /// Whether the client of `socket` reads every byte as soon as it arrives, inside an
    /// instant, as a client blocked in `read` would (the bytes wait for [`Self::client_read`]
    /// outside the socket's buffer). Otherwise it reads only when [`Self::client_read`] is
    /// called, between instants, so an instant moves at most one client buffer.
    pub fn set_client_draining(&mut self, socket: SocketId, draining: bool) {
        self.set_client_draining_inner(socket, draining);
    }

    /// Thread scaling: parks `thread`, whose connections move to thread `to` once between
    /// requests (`reflex_dataplane` `core/handoff.rs`); new connections keep arriving where
    /// the test connects them.
    pub fn park_thread(&mut self, thread: u16, to: u16) {
        self.threads[usize::from(thread)].dataplane.park_thread(to);
    }

    /// `[scaling] spread_tenants` on every thread, over all of them (`on` false: off), as
    /// reflexd's drivers set it.
    pub fn set_spread_tenants(&mut self, on: bool) {
        let threads = self.threads.len();
        let all = if threads >= 64 {
            u64::MAX
        } else {
            (1u64 << threads) - 1
        };
        for thread in &mut self.threads {
            thread
                .dataplane
                .set_spread_threads(if on { all } else { 0 });
        }
    }

    /// Wakes a parked thread.
    pub fn wake_thread(&mut self, thread: u16) {
        self.threads[usize::from(thread)].dataplane.wake_thread();
    }

    /// Wakes a parked thread and rebalances onto it, as reflexd does on a wake: the plan
    /// ([`reflex_qos::plan_rebalance`], over the threads `0..active`) names how many
    /// connections each other active thread hands over, once each is between requests.
    /// Returns the plan.
    pub fn wake_thread_rebalancing(
        &mut self,
        thread: u16,
        active: u16,
    ) -> Vec<reflex_qos::RebalanceMove> {
        self.wake_thread(thread);
        let loads: Vec<reflex_qos::ThreadConnections> = self
            .threads
            .iter()
            .map(|t| reflex_qos::ThreadConnections {
                open: t.dataplane.connections_open(),
                movable: t.dataplane.connections_movable(),
            })
            .collect();
        let plan =
            reflex_qos::plan_rebalance(&loads, active, thread, reflex_qos::REBALANCE_STEP_MAX);
        for step in &plan {
            self.threads[usize::from(step.from)]
                .dataplane
                .shed_connections(step.to, step.count);
        }
        plan
    }

    fn set_client_draining_inner(&mut self, socket: SocketId, draining: bool) {
        self.sockets[socket.0 as usize].draining = draining;
    }

    /// Whether the server closed `socket` and the client has read everything before that.
    pub fn is_closed_by_server(&self, socket: SocketId) -> bool {
        let socket = &self.sockets[socket.0 as usize];
        socket.server_closed && socket.to_client.is_empty() && socket.drained.is_empty()
    }

    /// Sockets where bytes arrived for the client since the last call.
    pub fn take_readable(&mut self, out: &mut Vec<SocketId>) {
        out.append(&mut self.readable);
    }

    /// Starts a graceful shutdown of every thread (SIGTERM).
    pub fn begin_shutdown(&mut self) {
        for thread in &mut self.threads {
            thread.dataplane.begin_shutdown();
        }
    }

    /// Whether every thread finished its shutdown.
    pub fn is_finished(&self) -> bool {
        self.threads.iter().all(|t| t.dataplane.is_finished())
    }

    /// Each thread's counters.
    pub fn stats(&self) -> Vec<CoreStats> {
        self.threads.iter().map(|t| t.dataplane.stats()).collect()
    }

    /// The dataplane of `thread` (for assertions on its state).
    pub fn dataplane(&self, thread: u16) -> &Dataplane {
        &self.threads[usize::from(thread)].dataplane
    }

    /// When something next happens without a client acting: an arrival on the network, a
    /// device completion, a dataplane deadline. Never earlier than one nanosecond from now
    /// (work due now was done by the last [`Self::run_instant`]).
    pub fn next_event(&self) -> Option<Nanos> {
        let mut next: Option<Nanos> = None;
        let mut consider = |at: Option<Nanos>| {
            if let Some(at) = at {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        };
        for socket in &self.sockets {
            consider(socket.to_server.next_arrival());
            consider(socket.to_client.next_arrival());
        }
        for (index, thread) in self.threads.iter().enumerate() {
            match &self.cpu {
                // A busy thread does nothing before it is free: its deadlines and the work
                // that waits for it are due then.
                Some((_, accounts)) if accounts[index].busy_until > self.now => {
                    let free = accounts[index].busy_until;
                    if thread.dataplane.has_pending_work() || accounts[index].owed_ns > 0 {
                        consider(Some(free));
                    }
                    consider(thread.dataplane.next_deadline().map(|at| at.max(free)));
                }
                _ => consider(thread.dataplane.next_deadline()),
            }
            for queue in thread.queues.iter().flatten() {
                consider(queue.next_deadline());
            }
        }
        next.map(|at| at.max(self.now + Nanos(1)))
    }

    /// When the next network arrival or device completion is due (the dataplanes' own
    /// deadlines left out), unclamped: for a driver that must not trust a deadline in the past.
    pub fn next_external_event(&self) -> Option<Nanos> {
        let sockets = self.sockets.iter().flat_map(|socket| {
            [
                socket.to_server.next_arrival(),
                socket.to_client.next_arrival(),
            ]
        });
        let queues = self.threads.iter().flat_map(|thread| {
            thread
                .queues
                .iter()
                .flatten()
                .map(|queue| queue.next_deadline())
        });
        sockets.chain(queues).flatten().min()
    }

    /// Runs everything due at `now`: device completions, network arrivals, and every
    /// thread's processing until nothing moves.
    pub fn run_instant(&mut self, now: Nanos) {
        assert!(now >= self.now, "virtual time went back");
        self.now = now;
        for pass in 0..PASSES_PER_INSTANT_MAX {
            let mut moved = false;
            moved |= self.poll_devices();
            moved |= self.deliver();
            moved |= self.deliver_migrations();
            for thread in 0..self.threads.len() {
                // A deadline that is due (a token refill, a timeout sweep) needs one process
                // at this instant, as the real driver's loop would give it.
                let due = pass == 0
                    && self.threads[thread]
                        .dataplane
                        .next_deadline()
                        .is_some_and(|at| at <= now);
                moved |= self.process_thread(thread, due);
            }
            if !moved {
                break;
            }
        }
        for thread in &mut self.threads {
            if !thread.dataplane.has_pending_work() {
                thread.dataplane.will_sleep();
            }
        }
    }

    fn poll_devices(&mut self) -> bool {
        let now = self.now;
        let mut moved = false;
        let mut completions = std::mem::take(&mut self.completions);
        for (index, thread) in self.threads.iter_mut().enumerate() {
            for queue in thread.queues.iter_mut().flatten() {
                if queue.next_deadline().is_some_and(|due| due <= now) {
                    queue.poll_completions(now, &mut completions);
                }
            }
            for completion in completions.drain(..) {
                moved = true;
                let id = device_op_id(completion.user_data);
                thread.dataplane.handle_device(id, completion.result, now);
                if let Some((model, accounts)) = self.cpu.as_mut() {
                    accounts[index].owed_ns += model.per_device_completion.0;
                }
            }
        }
        self.completions = completions;
        moved
    }

    /// Network arrivals, pending receives that can complete, sends waiting for room.
    fn deliver(&mut self) -> bool {
        let now = self.now;
        let mut moved = false;
        for index in 0..self.sockets.len() {
            let socket = &mut self.sockets[index];
            socket.to_server.deliver(now);
            if socket.to_client.deliver(now) {
                self.readable.push(SocketId(index as u32));
                if socket.draining {
                    socket.to_client.read_all(&mut socket.drained);
                }
            }
            moved |= self.complete_recv(index);
            moved |= self.complete_send(index);
            moved |= self.complete_wait(index);
        }
        moved
    }

    fn complete_recv(&mut self, index: usize) -> bool {
        let now = self.now;
        let socket = &mut self.sockets[index];
        if !socket.recv_pending {
            return false;
        }
        let available = socket.to_server.readable_bytes();
        if available == 0 && !socket.reset && !(socket.client_closed && socket.to_server.is_empty())
        {
            return false;
        }
        socket.recv_pending = false;
        let (id, thread) = (socket.id, usize::from(socket.thread));
        let dataplane = &mut self.threads[thread].dataplane;
        if socket.reset {
            dataplane.handle_recv(id, Err(libc::ECONNRESET), now);
            return true;
        }
        let space = dataplane.receive_space(id);
        let received = self.sockets[index].to_server.read(space);
        dataplane.handle_recv(id, Ok(received), now);
        true
    }

    fn complete_wait(&mut self, index: usize) -> bool {
        let now = self.now;
        let socket = &mut self.sockets[index];
        if !socket.wait_pending || (socket.to_server.readable_bytes() == 0 && !socket.client_closed)
        {
            return false;
        }
        socket.wait_pending = false;
        let (id, thread) = (socket.id, usize::from(socket.thread));
        self.threads[thread]
            .dataplane
            .handle_readable(id, Ok(()), now);
        true
    }

    fn complete_send(&mut self, index: usize) -> bool {
        let socket = &self.sockets[index];
        if !socket.send_pending {
            return false;
        }
        let room = self
            .network
            .client_buffer_bytes
            .saturating_sub(socket.to_client.unread_bytes());
        if room == 0 && !socket.reset {
            return false;
        }
        self.sockets[index].send_pending = false;
        self.send_now(index);
        true
    }

    /// Sends as much of the dataplane's send as the client's buffer takes; the rest waits.
    fn send_now(&mut self, index: usize) {
        let now = self.now;
        let model = self.network;
        let socket = &mut self.sockets[index];
        let (id, thread) = (socket.id, usize::from(socket.thread));
        if socket.reset {
            self.threads[thread]
                .dataplane
                .handle_sent(id, Err(libc::EPIPE), now);
            return;
        }
        let room = model
            .client_buffer_bytes
            .saturating_sub(socket.to_client.unread_bytes());
        if room == 0 {
            socket.send_pending = true;
            return;
        }
        let mut segments = std::mem::take(&mut self.segments);
        segments.clear();
        let dataplane = &mut self.threads[thread].dataplane;
        // Copy only what the client's buffer takes: a large reply facing a small window is
        // otherwise copied whole for every few bytes it moves.
        dataplane.send_segments(id, |segment| {
            let take = segment.len().min(room - segments.len());
            segments.extend_from_slice(&segment[..take]);
        });
        let sent = segments.len();
        self.sockets[index]
            .to_client
            .send(now, &segments[..sent], &model);
        self.segments = segments;
        dataplane.handle_sent(id, Ok(sent), now);
    }

    /// One thread: process, then carry out its operations; returns whether anything moved.
    fn process_thread(&mut self, thread: usize, due: bool) -> bool {
        let now = self.now;
        if self.cpu_busy_at(thread, now) {
            return false;
        }
        let owed = self
            .cpu
            .as_ref()
            .is_some_and(|(_, accounts)| accounts[thread].owed_ns > 0);
        let again = std::mem::take(&mut self.threads[thread].finished_synchronously);
        if !due && !owed && !again && !self.threads[thread].dataplane.has_pending_work() {
            return false;
        }
        self.threads[thread].dataplane.process(now);
        if let Some((model, accounts)) = self.cpu.as_mut() {
            let account = &mut accounts[thread];
            let answered = self.threads[thread].dataplane.requests_answered();
            let work = std::mem::take(&mut account.owed_ns)
                + (answered - account.answered) * model.per_answer.0;
            account.answered = answered;
            account.busy_until = now + Nanos(work);
        }
        while let Some(op) = self.threads[thread].dataplane.poll_op() {
            self.issue(thread, op);
        }
        self.take_migrations(thread);
        true
    }

    /// Moves `thread`'s messages for other threads onto the queues that have room.
    fn take_migrations(&mut self, thread: usize) {
        let count = self.threads.len();
        let capacity = self.migration_queue_capacity;
        let queues = &mut self.migration_queues;
        let mut full = 0u64;
        while let Some((to, message)) = self.threads[thread].dataplane.poll_migration(|to| {
            let room = queues[thread * count + usize::from(to)].len() < capacity;
            if !room {
                full += 1;
            }
            room
        }) {
            assert!(
                usize::from(to) < count,
                "a message for thread {to} of {count}"
            );
            queues[thread * count + usize::from(to)].push_back(message);
        }
        self.migration_queue_full += full;
    }

    /// Every message on the queues between threads reaches its destination (in order per
    /// queue); returns whether any moved.
    fn deliver_migrations(&mut self) -> bool {
        let now = self.now;
        let count = self.threads.len();
        let mut moved = false;
        for from in 0..count {
            for to in 0..count {
                while let Some(message) = self.migration_queues[from * count + to].pop_front() {
                    moved = true;
                    self.threads[to]
                        .dataplane
                        .handle_migration(from as u16, message, now);
                }
            }
        }
        moved
    }

    /// Messages between threads that waited in an outbox because their queue was full.
    pub fn migration_queue_full(&self) -> u64 {
        self.migration_queue_full
    }

    fn socket_of(&self, thread: usize, connection: ConnectionId) -> usize {
        match self.threads[thread]
            .sockets_by_connection
            .get(&(connection.index, connection.generation))
            .copied()
        {
            Some(socket) if self.sockets[socket.0 as usize].id == connection => socket.0 as usize,
            _ => panic!("operation on unknown connection {connection:?}"),
        }
    }

    fn issue(&mut self, thread: usize, op: Op) {
        let now = self.now;
        match op {
            Op::Accept { listener } => self.threads[thread].accept_armed[listener as usize] = true,
            Op::CloseListener { listener } => {
                let state = &mut self.threads[thread];
                if std::mem::take(&mut state.accept_armed[listener as usize]) {
                    let refused =
                        state
                            .dataplane
                            .handle_accept(listener, Err(libc::ECANCELED), now);
                    assert!(refused.is_err());
                }
            }
            Op::Recv { connection } => {
                let index = self.socket_of(thread, connection);
                assert!(!self.sockets[index].recv_pending, "two receives in flight");
                self.sockets[index].recv_pending = true;
                self.complete_recv(index);
            }
            Op::Send { connection } => {
                let index = self.socket_of(thread, connection);
                self.send_now(index);
            }
            Op::WaitReadable { connection } => {
                let index = self.socket_of(thread, connection);
                self.sockets[index].wait_pending = true;
                self.complete_wait(index);
            }
            Op::CancelWait { connection } => {
                let index = self.socket_of(thread, connection);
                if std::mem::take(&mut self.sockets[index].wait_pending) {
                    self.threads[thread].dataplane.handle_readable(
                        connection,
                        Err(libc::ECANCELED),
                        now,
                    );
                }
            }
            Op::CancelRecv { connection } => {
                let index = self.socket_of(thread, connection);
                if std::mem::take(&mut self.sockets[index].recv_pending) {
                    self.threads[thread].dataplane.handle_recv(
                        connection,
                        Err(libc::ECANCELED),
                        now,
                    );
                }
            }
            Op::CancelSend { connection } => {
                let index = self.socket_of(thread, connection);
                if std::mem::take(&mut self.sockets[index].send_pending) {
                    self.threads[thread].dataplane.handle_sent(
                        connection,
                        Err(libc::ECANCELED),
                        now,
                    );
                }
            }
            Op::Close { connection } => {
                // Sockets are keyed by slot and generation: a slot already given to a newer
                // connection (a dataplane bug the harness counts) keeps its new socket.
                let index = self.socket_of(thread, connection);
                self.sockets[index].server_closed = true;
                self.threads[thread]
                    .sockets_by_connection
                    .remove(&(connection.index, connection.generation));
            }
            Op::Device(command) if matches!(command.id, DeviceOpId::Migrated { .. }) => {
                self.issue_migrated(thread, command);
            }
            Op::Device(command) => {
                let state = &mut self.threads[thread];
                if let Some(lent) = lend_device_memory(&mut state.queues, &command) {
                    state.finished_synchronously = true;
                    state.dataplane.handle_device_lent(command.id, lent, now);
                    self.charge_device_completion(thread);
                    return;
                }
                let user_data = device_user_data(command.id);
                let op = state.dataplane.device_op(&command, user_data, None);
                if let Some(result) = submit_device_op(&mut state.queues, &command, op, now) {
                    state.finished_synchronously = true;
                    state.dataplane.handle_device(command.id, result, now);
                    self.charge_device_completion(thread);
                }
            }
            Op::OpenDevice { namespace_index } => {
                let state = &mut self.threads[thread];
                let index = usize::from(namespace_index);
                if state.queues.len() <= index {
                    state.queues.resize_with(index + 1, || None);
                }
                state.queues[index] = state
                    .dataplane
                    .namespaces()
                    .device(namespace_index)
                    .map(|device| device.queue());
            }
            Op::CloseDevice { namespace_index } => {
                if let Some(queue) = self.threads[thread]
                    .queues
                    .get_mut(usize::from(namespace_index))
                {
                    *queue = None;
                }
            }
            Op::Handoff { connection, to } => {
                // The socket follows its connection to the other thread, as reflexd's
                // drivers carry it through a queue.
                let socket = self.socket_of(thread, connection);
                self.threads[thread]
                    .sockets_by_connection
                    .remove(&(connection.index, connection.generation));
                let moved = self.threads[thread].dataplane.take_moved(connection);
                let to = usize::from(to);
                match self.threads[to].dataplane.adopt(moved, now) {
                    Ok(id) => {
                        let entry = &mut self.sockets[socket];
                        assert!(!entry.recv_pending && !entry.send_pending && !entry.wait_pending);
                        entry.thread = to as u16;
                        entry.id = id;
                        self.threads[to]
                            .sockets_by_connection
                            .insert((id.index, id.generation), SocketId(socket as u32));
                    }
                    Err(_) => self.sockets[socket].server_closed = true,
                }
            }
            Op::SampleRtt { connection } => {
                // The model's round trip: one latency each way (serialising a small segment
                // adds nothing measurable).
                let rtt_us = (2 * self.network.latency.0 / 1_000).min(u64::from(u32::MAX)) as u32;
                self.threads[thread]
                    .dataplane
                    .handle_rtt(connection, Ok(rtt_us));
            }
        }
    }
}

impl VirtualServer {
    /// A read another thread migrated to `thread`: its memory is the home's (the home's
    /// dataplane builds the operation on its request's buffer), its device queue this
    /// thread's.
    fn issue_migrated(&mut self, thread: usize, command: reflex_dataplane::DeviceCommand) {
        let now = self.now;
        let Some((home, read)) = self.threads[thread].dataplane.migrated_read(command.id) else {
            panic!("a migrated operation without its read: {command:?}");
        };
        let home = usize::from(home);
        assert_ne!(home, thread, "a read migrated to its home");
        let user_data = device_user_data(command.id);
        let (home_state, server_state) = if home < thread {
            let (low, high) = self.threads.split_at_mut(thread);
            (&mut low[home], &mut high[0])
        } else {
            let (low, high) = self.threads.split_at_mut(home);
            (&mut high[0], &mut low[thread])
        };
        let op = home_state
            .dataplane
            .device_op(&read.command, user_data, None);
        if let Some(result) = submit_device_op(&mut server_state.queues, &command, op, now) {
            server_state.finished_synchronously = true;
            server_state
                .dataplane
                .handle_device(command.id, result, now);
            self.charge_device_completion(thread);
        }
    }
}

/// A loan of device memory that answers `command` (a READ that allows one), when the
/// namespace's device lends (the `mem` device does).
fn lend_device_memory(
    queues: &mut [Option<Box<dyn DeviceQueue>>],
    command: &reflex_dataplane::DeviceCommand,
) -> Option<reflex_flash::Lent> {
    let (offset_bytes, length_bytes) = command.lendable_read()?;
    queues
        .get_mut(usize::from(command.namespace_index))?
        .as_mut()?
        .lend(offset_bytes, length_bytes)
}

/// Submits `op` (the operation of `command`) on a thread's queue of its namespace's device;
/// `Some`: the result the thread's dataplane is to handle now.
fn submit_device_op(
    queues: &mut [Option<Box<dyn DeviceQueue>>],
    command: &reflex_dataplane::DeviceCommand,
    op: reflex_flash::DeviceOp,
    now: Nanos,
) -> Option<Result<u32, reflex_flash::FlashError>> {
    let Some(queue) = queues
        .get_mut(usize::from(command.namespace_index))
        .and_then(Option::as_mut)
    else {
        // Not reachable: the dataplane opens a slot's queue before its first operation and
        // closes it only when none is left.
        return Some(Err(reflex_flash::FlashError::Io { errno: 6 }));
    };
    match queue.submit(op, now) {
        Submit::Pending => None,
        Submit::Done(result) => Some(result),
        // Only ring-driven devices (files) ask for a ring entry; the simulator has none (the
        // variant exists when a workspace build turns `uring` on).
        #[allow(unreachable_patterns)]
        other => panic!("a simulated device asked for a ring: {other:?}"),
    }
}

/// The dataplane's protocol for a listener, its tenant resolved by name.
/// The dataplane's TLS setup when a listener speaks TLS (one server configuration for all).
fn tls_setup(listeners: &[VirtualListener]) -> Option<reflex_dataplane::TlsSetup> {
    let (server_config, psk) = listeners.iter().find_map(|listener| match listener {
        VirtualListener::NativeTls(tls) => Some((Arc::clone(&tls.0), tls.1.clone())),
        _ => None,
    })?;
    Some(reflex_dataplane::TlsSetup {
        keys: Arc::new(reflex_dataplane::TlsKeys::new(
            reflex_dataplane::TlsCurrent {
                server_config: Some(server_config),
                psk,
                nvme_psk: None,
                identities: Arc::new(std::collections::HashMap::new()),
            },
        )),
        listeners_tls: listeners
            .iter()
            .map(|listener| matches!(listener, VirtualListener::NativeTls(_)))
            .collect(),
    })
}

/// The NVMe/TCP targets of the first NVMe/TCP listener, as reflexd builds them from its
/// `[nvme_tcp]` configuration.
fn nvme_tcp_setup(
    listeners: &[VirtualListener],
    namespaces: &NamespaceSet,
    qos: &[NamespaceQosSetup],
) -> Result<Option<Arc<reflex_dataplane::frontend::NvmeTcpTargets>>, VirtualServerError> {
    use reflex_dataplane::frontend::nvme_tcp_targets::{HostAccess, Subsystem, SubsystemNamespace};
    let Some(listener) = listeners.iter().find_map(|listener| match listener {
        VirtualListener::NvmeTcp(nvme) => Some(nvme),
        _ => None,
    }) else {
        return Ok(None);
    };
    let mut members = Vec::with_capacity(listener.namespace_indices.len());
    for &namespace_index in &listener.namespace_indices {
        if usize::from(namespace_index) >= namespaces.len() {
            return Err(VirtualServerError::Config(format!(
                "NVMe/TCP namespace index {namespace_index} of {}",
                namespaces.len()
            )));
        }
        let id = namespaces.id(namespace_index);
        let info = namespaces.info(namespace_index);
        let block_size = info.block_size.max(512);
        let mut nguid = [0u8; 16];
        nguid[..6].copy_from_slice(b"REFLEX");
        nguid[12..].copy_from_slice(&id.to_be_bytes());
        members.push(SubsystemNamespace {
            nsid: id,
            namespace_index,
            read_only: namespaces.is_read_only(namespace_index),
            size_bytes: namespaces.size_bytes(namespace_index) / u64::from(block_size)
                * u64::from(block_size),
            block_size,
            discards: info.supports_trim,
            nguid,
        });
    }
    // A tenant name resolves in each namespace that configures it; elsewhere (and for
    // `None`) the namespace's default tenant.
    let tenant_in = |namespace_index: u16, name: Option<&str>| {
        configured_tenant(qos, namespace_index, name).unwrap_or(TenantRef::NONE)
    };
    let subsystem = Subsystem {
        nqn: listener.subsystem_nqn.clone(),
        allow_any_host: listener.allow_any_host,
        hosts: listener
            .hosts
            .iter()
            .map(|(nqn, tenant)| HostAccess {
                nqn: nqn.clone(),
                tenants: members
                    .iter()
                    .map(|member| tenant_in(member.namespace_index, tenant.as_deref()))
                    .collect(),
                tls_key: false,
            })
            .collect(),
        default_tenants: members.iter().map(|_| TenantRef::NONE).collect(),
        namespaces: members,
        secure_channel: false,
    };
    // Not a socket: the address the discovery log reports (never a well-known port).
    let listen = std::net::SocketAddr::from(([127, 0, 0, 1], 14_420));
    Ok(Some(Arc::new(
        reflex_dataplane::frontend::NvmeTcpTargets::new(
            listener.options.clone(),
            vec![subsystem],
            listen,
        ),
    )))
}

/// The key-value table of the KV listener (at most one), formatted on its namespace's device
/// as reflexd's `[kv] format = true` does, synchronously before the threads start.
fn kv_setup(
    listeners: &[VirtualListener],
    namespaces: &NamespaceSet,
) -> Result<Option<(u16, Option<reflex_kv::KvTable>)>, VirtualServerError> {
    let mut kv_listeners = listeners.iter().filter_map(|listener| match listener {
        VirtualListener::Kv {
            namespace_index, ..
        } => Some(*namespace_index),
        _ => None,
    });
    let Some(namespace_index) = kv_listeners.next() else {
        return Ok(None);
    };
    if kv_listeners.any(|other| other != namespace_index) {
        return Err(VirtualServerError::Config(
            "KV listeners on two namespaces (one table per server)".into(),
        ));
    }
    let invalid = |reason: String| {
        VirtualServerError::Config(format!(
            "KV table on namespace index {namespace_index}: {reason}"
        ))
    };
    let Some(device) = namespaces.device(namespace_index) else {
        return Err(invalid("no such namespace".into()));
    };
    if namespaces.is_read_only(namespace_index) {
        return Err(invalid("read-only".into()));
    }
    let blocks =
        reflex_kv::DeviceBlocks::new(Arc::clone(device)).map_err(|e| invalid(e.to_string()))?;
    let geometry = {
        use reflex_kv::BlockStore;
        reflex_kv::Geometry::for_device(blocks.block_count()).map_err(|e| invalid(e.to_string()))?
    };
    let store = reflex_kv::KvStore::format(blocks, geometry).map_err(|e| invalid(e.to_string()))?;
    let (_, table) = store.into_parts();
    Ok(Some((namespace_index, Some(table))))
}

fn listener_protocol(
    listener: &VirtualListener,
    namespaces: &NamespaceSet,
    qos: &[NamespaceQosSetup],
) -> Result<Protocol, VirtualServerError> {
    Ok(match listener {
        VirtualListener::Native | VirtualListener::NativeTls(_) => Protocol::Native,
        VirtualListener::Nbd => Protocol::Nbd,
        VirtualListener::NvmeTcp(_) => Protocol::NvmeTcp,
        VirtualListener::Kv {
            namespace_index,
            tenant,
        } => Protocol::Kv {
            namespace_index: *namespace_index,
            tenant: configured_tenant(qos, *namespace_index, tenant.as_deref())?,
        },
        VirtualListener::Original {
            namespace_index,
            tenant,
        } => {
            if usize::from(*namespace_index) >= namespaces.len() {
                return Err(VirtualServerError::Config(format!(
                    "original listener on namespace index {namespace_index} of {}",
                    namespaces.len()
                )));
            }
            Protocol::Original {
                namespace_index: *namespace_index,
                tenant: configured_tenant(qos, *namespace_index, tenant.as_deref())?,
                device_queue: None,
            }
        }
    })
}

/// A configured tenant of a namespace by name; `None`: the namespace's default tenant.
fn configured_tenant(
    qos: &[NamespaceQosSetup],
    namespace_index: u16,
    name: Option<&str>,
) -> Result<TenantRef, VirtualServerError> {
    let Some(name) = name else {
        return Ok(TenantRef::NONE);
    };
    qos[usize::from(namespace_index)]
        .tenants
        .iter()
        .find(|(configured, _)| configured == name)
        .map(|(_, tenant)| *tenant)
        .ok_or_else(|| {
            VirtualServerError::Config(format!(
                "no tenant {name:?} configured on namespace index {namespace_index}"
            ))
        })
}

/// The export table of the NBD listeners, as reflexd builds it from its configuration.
fn nbd_exports(
    listeners: &[VirtualListener],
    configured: &[VirtualExport],
    default_name: Option<&str>,
    namespaces: &NamespaceSet,
    qos: &[NamespaceQosSetup],
) -> Result<Option<Arc<NbdExports>>, VirtualServerError> {
    if !listeners.contains(&VirtualListener::Nbd) && configured.is_empty() {
        return Ok(None);
    }
    let minimum_bytes = u64::from(reflex_proto::nbd::BlockSizes::default().minimum_bytes);
    let mut exports = Vec::with_capacity(configured.len());
    for export in configured {
        let namespace_index = export.namespace_index;
        if usize::from(namespace_index) >= namespaces.len() {
            return Err(VirtualServerError::Config(format!(
                "export {:?} on namespace index {namespace_index} of {}",
                export.name,
                namespaces.len()
            )));
        }
        let size_bytes = namespaces.size_bytes(namespace_index) / minimum_bytes * minimum_bytes;
        let mut table_entry = reflex_proto::nbd::Export::new(export.name.clone(), size_bytes);
        if export.read_only || namespaces.native_table()[usize::from(namespace_index)].read_only {
            table_entry = table_entry.read_only();
        }
        let binding = ExportBinding {
            namespace_index,
            tenant: configured_tenant(qos, namespace_index, export.tenant.as_deref())?,
            device_queue: None,
        };
        exports.push((table_entry, binding));
    }
    let exports = NbdExports::new(exports, default_name)
        .map_err(|e| VirtualServerError::Config(format!("NBD exports: {e}")))?;
    Ok(Some(Arc::new(exports)))
}

/// Device operation ids in a device's `user_data`: a request's slot and generation, a read
/// migrated here (bit 62 set), or a shutdown flush (top bit set).
fn device_user_data(id: DeviceOpId) -> u64 {
    match id {
        DeviceOpId::Request { index, generation } => {
            (u64::from(generation) << 32) | u64::from(index)
        }
        DeviceOpId::Migrated { slot, generation } => {
            (1 << 62) | (u64::from(generation) << 32) | u64::from(slot)
        }
        DeviceOpId::ShutdownFlush { namespace_index } => (1 << 63) | u64::from(namespace_index),
    }
}

fn device_op_id(user_data: u64) -> DeviceOpId {
    if user_data >> 63 == 1 {
        DeviceOpId::ShutdownFlush {
            namespace_index: user_data as u16,
        }
    } else if user_data >> 62 == 1 {
        DeviceOpId::Migrated {
            slot: user_data as u32,
            generation: ((user_data >> 32) as u32) & reflex_dataplane::GENERATION_MASK,
        }
    } else {
        DeviceOpId::Request {
            index: user_data as u32,
            generation: (user_data >> 32) as u32,
        }
    }
}
