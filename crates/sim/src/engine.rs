//! The simulation engine: open- and closed-loop tenants, each a set of native-protocol clients
//! (the client library's sans-IO `ConnectionCore`), against a [`VirtualServer`]: the real
//! dataplane threads and control plane of reflexd over a virtual network and a virtual-time
//! device.
//!
//! A run: every tenant connects its connections to their threads, registers over the wire
//! (REGISTER: admission control decides, a refusal is reported and the tenant sends
//! nothing), BINDs every connection to its handle, and then sends its load. Latency is
//! measured at the client, from the moment a request was due (open loop: its Poisson arrival
//! time, even if the client window held it back) to the moment its answer arrived, so there is
//! no coordinated omission.
//!
//! Determinism: one event heap ordered by (time, sequence number); every random choice comes
//! from generators seeded from the scenario seed, so a seed replays a run exactly.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, VecDeque};
use std::sync::Arc;

use hdrhistogram::Histogram;
use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_client::{ConnectionCore, CoreOptions, REPORT_REQUEST_ID, SubmitError};
use reflex_dataplane::control::{ControlSetup, HandleKeys, NamespaceControl, TenantLimits};
use reflex_dataplane::{Limits, TenantStats};
use reflex_flash::Device;
use reflex_proto::native::{Opcode, RegisterBody, RenegotiateReason, TenantClassRequest};
use reflex_qos::{DeviceProfile, Nanos, Policy, QosConfig, TenantClass, TenantSpec};

use crate::network::NetworkModel;
use crate::report::{PointReport, TenantReport, TimelinePoint, TimelineTenant};
use crate::server::{
    SocketId, VirtualListener, VirtualServer, VirtualServerError, VirtualServerSetup,
};

/// Requests a client holds back beyond its window before it sheds arrivals (bounds memory when
/// a tenant offers far more than it gets: 8 MiB of due times at most, above what a
/// 20-second run at 50K IOPS can queue).
pub const CLIENT_BACKLOG_MAX: usize = 1 << 20;
/// A client that follows a notice sends this share of what it was granted: a Poisson source
/// at exactly its token rate would queue behind its own bursts.
pub const FOLLOW_MARGIN: f64 = 0.9;
/// The namespace of the first device (every tenant's unless it names another).
pub const NAMESPACE_ID: u32 = 1;
/// How long the setup (REGISTER and BIND over the network) may take in virtual time.
const SETUP_TIME_MAX: Nanos = Nanos(1_000_000_000);

/// How a simulated tenant's clients send.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Load {
    /// Poisson arrivals at `iops`; at most `window` requests in flight. `follow_notices`:
    /// the rate follows what RENEGOTIATE notices about the device grant.
    Open {
        iops: u64,
        window: u32,
        follow_notices: bool,
    },
    /// Always `depth` requests in flight.
    Closed { depth: u32 },
}

impl Load {
    fn window(self) -> u32 {
        match self {
            Load::Open { window, .. } => window,
            Load::Closed { depth } => depth,
        }
    }
}

/// A tenant of one simulation run.
#[derive(Clone, Debug, PartialEq)]
pub struct SimTenant {
    pub name: String,
    pub spec: TenantSpec,
    pub size_bytes: u32,
    /// Read share of the load.
    pub read_percent: u8,
    /// One connection per entry, on that thread.
    pub connections: Vec<u16>,
    pub load: Load,
    /// The namespace it registers on and sends to: device `namespace - 1` of the run.
    pub namespace: u32,
    /// When it starts sending, from the start of the run (the warm-up's start).
    pub start: Nanos,
    /// RT_alone for the server's fairness monitors (µs), set once it registered.
    pub rt_alone_us: Option<u32>,
}

/// Everything one run needs.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    pub threads: u16,
    pub policy: Policy,
    /// The profile of namespace 1's device.
    pub profile: DeviceProfile,
    /// The profiles of namespaces 2, 3, ...: one per further device.
    pub extra_profiles: Vec<DeviceProfile>,
    pub qos: QosConfig,
    pub warmup: Nanos,
    pub duration: Nanos,
    pub tenants: Vec<SimTenant>,
    pub network: NetworkModel,
    /// What the clients add to what they measure, and whether they report it.
    pub client: ClientModel,
    /// The threads' CPU (`None`: their work is free).
    pub cpu: Option<crate::CpuModel>,
    /// Report each tenant's IOPS and read p95 per interval of this length (measured time only).
    pub timeline: Option<Nanos>,
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("virtual server: {0}")]
    Server(#[from] VirtualServerError),
    #[error("client protocol: {0}")]
    Client(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival {
        tenant: u32,
    },
    /// A closed-loop tenant that starts later than the run fills its window.
    Start {
        tenant: u32,
    },
    WarmupEnd,
    /// The end of a timeline interval.
    Tick,
    /// A latency-critical tenant's client reports its last interval's read p95.
    Report {
        tenant: u32,
    },
}

/// The simulated clients' side of what a tenant sees.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientModel {
    /// Added to every answer's measured latency: the client's wake-up, which the server's
    /// TCP round-trip samples do not show.
    pub wakeup: Nanos,
    /// How often each latency-critical tenant's client sends a REPORT of its reads' p95 in
    /// the interval (`None`: never).
    pub report_interval: Option<Nanos>,
}

/// A request sent and not answered yet.
#[derive(Clone, Copy, Debug)]
struct Pending {
    tenant: u32,
    read: bool,
    due: Nanos,
}

struct Connection {
    socket: SocketId,
    tenant: u32,
    core: ConnectionCore,
}

struct TenantState {
    sim: SimTenant,
    handle: Option<u64>,
    rng: Xoshiro256PlusPlus,
    /// Indexes into `Sim::connections`.
    connections: Vec<usize>,
    next_connection: usize,
    in_flight: u32,
    backlog: VecDeque<Nanos>,
    shed: u64,
    read_latency_ns: Histogram<u64>,
    completed_in_window: u64,
    arrivals_in_window: u64,
    errors: u64,
    millitokens_at_warmup: i64,
    /// Deficit episodes announced by RENEGOTIATE notices.
    episodes: BTreeSet<u64>,
    /// Notices for other reasons (the device slower than its profile, or recovered).
    device_notices: u64,
    /// The share of its open-loop rate the tenant sends (below 1 while following a notice).
    rate_factor: f64,
    /// The current timeline interval: read latencies (by completion) and completions.
    interval_reads_ns: Histogram<u64>,
    interval_completed: u64,
    /// Read latencies since the tenant's last REPORT (every read, warm-up included: the
    /// server learns from the start).
    report_reads_ns: Histogram<u64>,
}

/// Runs one simulation against `device` (the namespace's storage) and reports per tenant.
pub fn run(config: &SimConfig, device: Arc<dyn Device>) -> Result<PointReport, SimError> {
    run_on(config, vec![device])
}

/// Runs one simulation with one namespace per device (`devices[i]` is namespace `i + 1`,
/// with `config.profile` for the first and `config.extra_profiles` for the rest): each its own
/// token bucket, schedulers and admission, as reflexd gives each profiled namespace.
pub fn run_on(config: &SimConfig, devices: Vec<Arc<dyn Device>>) -> Result<PointReport, SimError> {
    let mut sim = Sim::new(config, devices)?;
    sim.setup()?;
    sim.start();
    sim.run_until_end()?;
    Ok(sim.report())
}

struct Sim<'c> {
    config: &'c SimConfig,
    server: VirtualServer,
    warmup_end: Nanos,
    end: Nanos,
    tenants: Vec<TenantState>,
    connections: Vec<Connection>,
    /// By socket index.
    connection_of_socket: Vec<usize>,
    refusals: Vec<String>,
    /// By request id.
    pending: Vec<Option<Pending>>,
    free_ids: Vec<u64>,
    heap: BinaryHeap<Reverse<(Nanos, u64, Event)>>,
    sequence: u64,
    offsets: Xoshiro256PlusPlus,
    /// Per namespace (index = id - 1).
    capacity_bytes: Vec<u64>,
    readable: Vec<SocketId>,
    received: Vec<u8>,
    timeline: Vec<TimelinePoint>,
}

/// The dataplane limits of a simulated server: every tenant's window fits on one connection,
/// and the arena holds every request in flight.
fn limits_for(config: &SimConfig) -> Limits {
    let window_total: u64 = config
        .tenants
        .iter()
        .map(|t| u64::from(t.load.window()))
        .sum();
    let window = config
        .tenants
        .iter()
        .map(|t| t.load.window())
        .max()
        .unwrap_or(1)
        .clamp(128, 4096);
    let size_max = config
        .tenants
        .iter()
        .map(|t| u64::from(t.size_bytes))
        .max()
        .unwrap_or(4096)
        .max(4096);
    let arena_bytes = ((window_total + 64) * size_max * 5 / 4)
        .div_ceil(1 << 20)
        .max(16)
        << 20;
    let connections: u32 = config
        .tenants
        .iter()
        .map(|t| t.connections.len() as u32)
        .sum();
    Limits {
        window,
        requests_max: (window_total as u32 + 64).max(window),
        connections_max: connections.max(1) + 16,
        ..Limits::with_arena(arena_bytes as usize, 100)
    }
}

impl<'c> Sim<'c> {
    fn new(config: &'c SimConfig, devices: Vec<Arc<dyn Device>>) -> Result<Sim<'c>, SimError> {
        if config.threads == 0 {
            return Err(SimError::Config("no thread".into()));
        }
        if devices.len() != 1 + config.extra_profiles.len() {
            return Err(SimError::Config(format!(
                "{} devices for {} profiles",
                devices.len(),
                1 + config.extra_profiles.len()
            )));
        }
        let capacity_bytes = devices.iter().map(|d| d.info().size_bytes).collect();
        let profiles = std::iter::once(&config.profile).chain(&config.extra_profiles);
        let namespace_controls = profiles
            .enumerate()
            .map(|(index, profile)| NamespaceControl {
                namespace_id: NAMESPACE_ID + index as u32,
                profile: Some(profile.clone()),
                tenants: Vec::new(),
            })
            .collect();
        let namespaces = devices
            .into_iter()
            .enumerate()
            .map(|(index, device)| (NAMESPACE_ID + index as u32, device, false))
            .collect();
        let limits = limits_for(config);
        let mut server = VirtualServer::new(VirtualServerSetup {
            threads: config.threads,
            namespaces,
            composites: Vec::new(),
            control: ControlSetup {
                threads: config.threads,
                handles: HandleKeys::Seeded(config.seed),
                tenant_limits: TenantLimits::default(),
                qos_config: config.qos.clone(),
                qos_enabled: config.policy == Policy::Tokens,
                namespaces: namespace_controls,
            },
            qos_config: config.qos.clone(),
            limits: limits.clone(),
            network: config.network,
            listeners: vec![VirtualListener::Native],
            nbd_exports: Vec::new(),
            nbd_default_export: None,
        })?;
        if let Some(cpu) = config.cpu {
            server.set_cpu_model(cpu);
        }
        let mut tenants = Vec::with_capacity(config.tenants.len());
        for (index, sim) in config.tenants.iter().enumerate() {
            if sim.connections.is_empty() {
                return Err(SimError::Config(format!(
                    "tenant {} has no connection",
                    sim.name
                )));
            }
            if sim.namespace == 0 || sim.namespace as usize > 1 + config.extra_profiles.len() {
                return Err(SimError::Config(format!(
                    "tenant {}: namespace {} of {}",
                    sim.name,
                    sim.namespace,
                    1 + config.extra_profiles.len()
                )));
            }
            if let Some(&thread) = sim.connections.iter().find(|&&t| t >= config.threads) {
                return Err(SimError::Config(format!(
                    "tenant {}: thread {thread} of {}",
                    sim.name, config.threads
                )));
            }
            tenants.push(TenantState {
                sim: sim.clone(),
                handle: None,
                rng: Xoshiro256PlusPlus::seed_from_u64(
                    config.seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                ),
                connections: Vec::new(),
                next_connection: 0,
                in_flight: 0,
                backlog: VecDeque::new(),
                shed: 0,
                read_latency_ns: Histogram::new_with_bounds(1_000, 60_000_000_000, 3)
                    .map_err(|e| SimError::Config(e.to_string()))?,
                completed_in_window: 0,
                arrivals_in_window: 0,
                errors: 0,
                millitokens_at_warmup: 0,
                episodes: BTreeSet::new(),
                device_notices: 0,
                rate_factor: 1.0,
                interval_reads_ns: Histogram::new_with_bounds(1_000, 60_000_000_000, 2)
                    .map_err(|e| SimError::Config(e.to_string()))?,
                interval_completed: 0,
                report_reads_ns: Histogram::new_with_bounds(1_000, 60_000_000_000, 2)
                    .map_err(|e| SimError::Config(e.to_string()))?,
            });
        }
        Ok(Sim {
            config,
            server,
            warmup_end: Nanos::ZERO,
            end: Nanos::ZERO,
            tenants,
            connections: Vec::new(),
            connection_of_socket: Vec::new(),
            refusals: Vec::new(),
            pending: Vec::new(),
            free_ids: Vec::new(),
            heap: BinaryHeap::new(),
            sequence: 0,
            offsets: Xoshiro256PlusPlus::seed_from_u64(config.seed.wrapping_add(0x5EED)),
            capacity_bytes,
            readable: Vec::new(),
            received: Vec::new(),
            timeline: Vec::new(),
        })
    }

    // ----- Setup: connect, REGISTER, BIND ----------------------------------------------------

    fn setup(&mut self) -> Result<(), SimError> {
        let window = limits_for(self.config).window;
        for tenant in 0..self.tenants.len() {
            let threads = self.tenants[tenant].sim.connections.clone();
            for thread in threads {
                let socket = self.server.connect(thread, 0, None)?;
                let index = self.connections.len();
                self.connections.push(Connection {
                    socket,
                    tenant: tenant as u32,
                    core: ConnectionCore::new(CoreOptions {
                        window_assumed: window,
                    }),
                });
                let slot = socket.0 as usize;
                if self.connection_of_socket.len() <= slot {
                    self.connection_of_socket.resize(slot + 1, usize::MAX);
                }
                self.connection_of_socket[slot] = index;
                self.tenants[tenant].connections.push(index);
            }
        }
        // Tenants register one after the other, in the scenario's order: admission is first
        // come, first served.
        for tenant in 0..self.tenants.len() {
            let first = self.tenants[tenant].connections[0];
            let class = match self.tenants[tenant].sim.spec {
                TenantSpec::LatencyCritical {
                    latency_us_p95,
                    iops,
                    read_percent,
                } => TenantClassRequest::LatencyCritical {
                    latency_us_p95: u32::try_from(latency_us_p95).unwrap_or(u32::MAX),
                    iops,
                    read_percent,
                },
                TenantSpec::BestEffort => TenantClassRequest::BestEffort,
            };
            let body = RegisterBody {
                namespace_id: self.tenants[tenant].sim.namespace,
                class,
                read_only: false,
                handle: 0,
            };
            self.submit_control(first, |core, id| core.submit_register(id, &body))?;
            let answer = self.await_control(first)?;
            match answer {
                Ok(body) => {
                    let handle = reflex_proto::native::decode_handle(&body)
                        .map_err(|e| SimError::Client(e.to_string()))?;
                    self.tenants[tenant].handle = Some(handle);
                    // The scenario's RT_alone stands in the server's fairness monitors, as an
                    // operator's `rt_alone_us` does in reflexd.
                    if let Some(rt_alone_us) = self.tenants[tenant].sim.rt_alone_us {
                        self.server.control().set_alone(handle, Some(rt_alone_us));
                    }
                }
                Err(reason) => {
                    let name = &self.tenants[tenant].sim.name;
                    self.refusals.push(format!("{name}: {reason}"));
                }
            }
        }
        for tenant in 0..self.tenants.len() {
            let Some(handle) = self.tenants[tenant].handle else {
                continue;
            };
            for position in 0..self.tenants[tenant].connections.len() {
                let connection = self.tenants[tenant].connections[position];
                self.submit_control(connection, |core, id| core.submit_bind(id, handle))?;
                if let Err(reason) = self.await_control(connection)? {
                    return Err(SimError::Client(format!("BIND refused: {reason}")));
                }
            }
        }
        Ok(())
    }

    /// Sends one control request (id 0) on `connection`.
    fn submit_control(
        &mut self,
        connection: usize,
        submit: impl FnOnce(&mut ConnectionCore, u64) -> Result<(), SubmitError>,
    ) -> Result<(), SimError> {
        submit(&mut self.connections[connection].core, 0)
            .map_err(|e| SimError::Client(e.to_string()))?;
        self.transmit(connection);
        Ok(())
    }

    /// Runs virtual time until the control request of `connection` is answered: its body, or
    /// the refusal's reason.
    fn await_control(&mut self, connection: usize) -> Result<Result<Vec<u8>, String>, SimError> {
        let deadline = self.server.now() + SETUP_TIME_MAX;
        loop {
            let now = self.server.now();
            self.server.run_instant(now);
            let socket = self.connections[connection].socket;
            self.received.clear();
            self.server.client_read(socket, &mut self.received);
            let received = std::mem::take(&mut self.received);
            let core = &mut self.connections[connection].core;
            let mut offered = &received[..];
            while !offered.is_empty() {
                let taken = core.handle_received_bytes(offered);
                offered = &offered[taken..];
                if let Some(completion) = core
                    .poll_completion()
                    .map_err(|e| SimError::Client(e.to_string()))?
                {
                    if completion.is_notice() {
                        continue;
                    }
                    let answer = if completion.is_ok() {
                        Ok(completion.data.to_vec())
                    } else {
                        Err(completion
                            .reason()
                            .unwrap_or_else(|| format!("status {}", completion.status_raw)))
                    };
                    self.received = received;
                    return Ok(answer);
                }
                if taken == 0 {
                    break;
                }
            }
            self.received = received;
            let next = self
                .server
                .next_event()
                .ok_or_else(|| SimError::Client("setup stalled: nothing more happens".into()))?;
            if next > deadline {
                return Err(SimError::Client("setup took too long".into()));
            }
            self.server.run_instant(next);
        }
    }

    // ----- Load ------------------------------------------------------------------------------

    fn push(&mut self, at: Nanos, event: Event) {
        self.sequence += 1;
        self.heap.push(Reverse((at, self.sequence, event)));
    }

    fn start(&mut self) {
        let start = self.server.now();
        self.warmup_end = start + self.config.warmup;
        self.end = self.warmup_end + self.config.duration;
        self.push(self.warmup_end, Event::WarmupEnd);
        if let Some(interval) = self.config.timeline {
            assert!(interval > Nanos::ZERO, "timeline interval zero");
            self.push(self.warmup_end + interval, Event::Tick);
        }
        for index in 0..self.tenants.len() {
            if self.tenants[index].handle.is_none() {
                continue;
            }
            let tenant_start = start + self.tenants[index].sim.start;
            let latency_critical = matches!(
                self.tenants[index].sim.spec,
                TenantSpec::LatencyCritical { .. }
            );
            if let (true, Some(interval)) = (latency_critical, self.config.client.report_interval) {
                let tenant = index as u32;
                self.push(tenant_start + interval, Event::Report { tenant });
            }
            match self.tenants[index].sim.load {
                Load::Open { iops, .. } => {
                    let gap = exponential(&mut self.tenants[index].rng, iops as f64);
                    self.push(
                        tenant_start + Nanos(gap),
                        Event::Arrival {
                            tenant: index as u32,
                        },
                    );
                }
                Load::Closed { depth } if tenant_start == start => {
                    for _ in 0..depth {
                        self.send(index, start);
                    }
                }
                Load::Closed { .. } => self.push(
                    tenant_start,
                    Event::Start {
                        tenant: index as u32,
                    },
                ),
            }
        }
        self.server.run_instant(start);
    }

    fn run_until_end(&mut self) -> Result<(), SimError> {
        loop {
            self.read_clients()?;
            let next_event = self.heap.peek().map(|Reverse((at, _, _))| *at);
            let next = match (next_event, self.server.next_event()) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => break,
            };
            if next > self.end {
                break;
            }
            self.server.run_instant(next);
            while let Some(&Reverse((at, _, event))) = self.heap.peek() {
                if at > next {
                    break;
                }
                self.heap.pop();
                self.handle(event, next);
            }
            self.server.run_instant(next);
        }
        Ok(())
    }

    fn handle(&mut self, event: Event, now: Nanos) {
        match event {
            Event::Arrival { tenant } => {
                let index = tenant as usize;
                if let Load::Open { iops, .. } = self.tenants[index].sim.load {
                    let rate = iops as f64 * self.tenants[index].rate_factor;
                    let gap = exponential(&mut self.tenants[index].rng, rate);
                    self.push(now + Nanos(gap), Event::Arrival { tenant });
                }
                if now >= self.warmup_end {
                    self.tenants[index].arrivals_in_window += 1;
                }
                self.send(index, now);
            }
            Event::Start { tenant } => {
                let index = tenant as usize;
                for _ in 0..self.tenants[index].sim.load.window() {
                    self.send(index, now);
                }
            }
            Event::WarmupEnd => {
                let stats = self.tenant_stats();
                for tenant in &mut self.tenants {
                    tenant.millitokens_at_warmup = tenant
                        .handle
                        .and_then(|handle| stats.iter().find(|s| s.handle == handle))
                        .map_or(0, |s| s.millitokens);
                    tenant.interval_reads_ns.reset();
                    tenant.interval_completed = 0;
                }
            }
            Event::Tick => self.tick(now),
            Event::Report { tenant } => self.report_latency(tenant as usize, now),
        }
    }

    /// A latency-critical tenant's client sends a REPORT of the reads answered since its
    /// last one and of its backlog, on its first connection, and schedules the next.
    fn report_latency(&mut self, index: usize, now: Nanos) {
        if let Some(interval) = self.config.client.report_interval {
            self.push(
                now + interval,
                Event::Report {
                    tenant: index as u32,
                },
            );
        }
        let tenant = &mut self.tenants[index];
        let reads = &mut tenant.report_reads_ns;
        if reads.is_empty() {
            return;
        }
        let report = reflex_proto::native::ReportBody {
            reads: u32::try_from(reads.len()).unwrap_or(u32::MAX),
            read_p95_us: u32::try_from(reads.value_at_quantile(0.95) / 1_000).unwrap_or(u32::MAX),
            backlog: u32::try_from(tenant.backlog.len()).unwrap_or(u32::MAX),
        };
        let connection = tenant.connections[0];
        // A full window or the last REPORT still unanswered: the reads count in the next.
        if self.connections[connection]
            .core
            .submit_report(REPORT_REQUEST_ID, &report)
            .is_ok()
        {
            self.tenants[index].report_reads_ns.reset();
            self.transmit(connection);
        }
    }

    /// A client sends a request that was due at `due`, if its window allows.
    fn send(&mut self, index: usize, due: Nanos) {
        let tenant = &mut self.tenants[index];
        if tenant.in_flight >= tenant.sim.load.window() {
            if tenant.backlog.len() >= CLIENT_BACKLOG_MAX {
                tenant.shed += 1;
            } else {
                tenant.backlog.push_back(due);
            }
            return;
        }
        tenant.in_flight += 1;
        let connection = tenant.connections[tenant.next_connection % tenant.connections.len()];
        tenant.next_connection = tenant.next_connection.wrapping_add(1);
        let read = tenant.rng.next_u64() % 100 < u64::from(tenant.sim.read_percent);
        let size = tenant.sim.size_bytes;
        let namespace = tenant.sim.namespace;
        let capacity_bytes = self.capacity_bytes[namespace as usize - 1];
        let blocks = (capacity_bytes / u64::from(size)).max(1);
        let offset = (self.offsets.next_u64() % blocks) * u64::from(size);
        let pending = Pending {
            tenant: index as u32,
            read,
            due,
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.pending[id as usize] = Some(pending);
                id
            }
            None => {
                self.pending.push(Some(pending));
                self.pending.len() as u64 - 1
            }
        };
        let core = &mut self.connections[connection].core;
        let submitted = if read {
            core.submit_read(id, namespace, offset, size)
        } else {
            core.submit_write_with(id, namespace, offset, size, false, |_| {})
        };
        if let Err(error) = submitted {
            panic!("a simulated client's submit failed: {error}");
        }
        self.transmit(connection);
    }

    /// Sends what the connection's client has queued.
    fn transmit(&mut self, connection: usize) {
        let Connection { socket, core, .. } = &mut self.connections[connection];
        let Some(bytes) = core.transmit_start() else {
            return;
        };
        let length = bytes.len();
        self.server.client_send(*socket, bytes);
        core.transmit_done(length);
    }

    /// Every client reads what reached it and reacts to each answer.
    fn read_clients(&mut self) -> Result<(), SimError> {
        let now = self.server.now();
        let mut readable = std::mem::take(&mut self.readable);
        self.server.take_readable(&mut readable);
        for socket in readable.drain(..) {
            let connection = self.connection_of_socket[socket.0 as usize];
            let mut received = std::mem::take(&mut self.received);
            received.clear();
            self.server.client_read(socket, &mut received);
            let mut offered = &received[..];
            loop {
                let taken = self.connections[connection]
                    .core
                    .handle_received_bytes(offered);
                offered = &offered[taken..];
                while let Some(answer) = self.take_answer(connection)? {
                    self.answered(answer, now);
                }
                if offered.is_empty() || taken == 0 {
                    break;
                }
            }
            assert!(offered.is_empty(), "a client could not take its answers");
            self.received = received;
        }
        self.readable = readable;
        Ok(())
    }

    fn take_answer(&mut self, connection: usize) -> Result<Option<Answer>, SimError> {
        let tenant = self.connections[connection].tenant;
        let core = &mut self.connections[connection].core;
        let Some(completion) = core
            .poll_completion()
            .map_err(|e| SimError::Client(e.to_string()))?
        else {
            return Ok(None);
        };
        if let Some(notice) = completion.notice() {
            let granted = match notice.reason {
                RenegotiateReason::DeficitLimit => None,
                _ if notice.reserved_tokens_per_sec == 0 => Some(1.0),
                _ => Some(
                    (notice.granted_tokens_per_sec as f64 / notice.reserved_tokens_per_sec as f64)
                        .min(1.0),
                ),
            };
            return Ok(Some(Answer::Notice {
                tenant,
                episode: notice.episode,
                granted,
            }));
        }
        if completion.opcode == Opcode::Report {
            return Ok(Some(Answer::Report));
        }
        Ok(Some(Answer::Io {
            id: completion.request_id,
            ok: completion.is_ok() && completion.opcode != Opcode::Renegotiate,
        }))
    }

    fn answered(&mut self, answer: Answer, now: Nanos) {
        let (id, ok) = match answer {
            Answer::Notice {
                tenant,
                episode,
                granted,
            } => {
                let tenant = &mut self.tenants[tenant as usize];
                match granted {
                    None => {
                        tenant.episodes.insert(episode);
                    }
                    Some(share) => {
                        tenant.device_notices += 1;
                        if let Load::Open {
                            follow_notices: true,
                            ..
                        } = tenant.sim.load
                        {
                            // Every connection of the tenant gets the notice; the share is
                            // the same in each.
                            tenant.rate_factor = if share >= 1.0 {
                                1.0
                            } else {
                                (share * FOLLOW_MARGIN).max(0.01)
                            };
                        }
                    }
                }
                return;
            }
            Answer::Io { id, ok } => (id, ok),
            Answer::Report => return,
        };
        let Some(pending) = self.pending.get_mut(id as usize).and_then(Option::take) else {
            panic!("an answer to unknown request {id}");
        };
        self.free_ids.push(id);
        let index = pending.tenant as usize;
        let tenant = &mut self.tenants[index];
        tenant.in_flight -= 1;
        if !ok {
            tenant.errors += 1;
        }
        if now >= self.warmup_end && now <= self.end {
            tenant.completed_in_window += 1;
            tenant.interval_completed += 1;
        }
        if pending.read {
            let measured = now + self.config.client.wakeup;
            let latency = measured.saturating_since(pending.due).0.max(1_000);
            tenant.report_reads_ns.saturating_record(latency);
            if pending.due >= self.warmup_end {
                tenant.read_latency_ns.saturating_record(latency);
                tenant.interval_reads_ns.saturating_record(latency);
            }
        }
        match tenant.sim.load {
            Load::Closed { .. } => self.send(index, now),
            Load::Open { .. } => {
                if let Some(due) = tenant.backlog.pop_front() {
                    self.send(index, due);
                }
            }
        }
    }

    /// A timeline interval ended at `now`: each tenant's IOPS and read p95 in it, and the
    /// device's calibrated rate scale.
    fn tick(&mut self, now: Nanos) {
        let Some(interval) = self.config.timeline else {
            return;
        };
        let seconds = interval.as_secs_f64();
        let tenants = self
            .tenants
            .iter_mut()
            .map(|tenant| {
                let hist = &tenant.interval_reads_ns;
                let point = TimelineTenant {
                    iops: tenant.interval_completed as f64 / seconds,
                    read_p95_us: if hist.is_empty() {
                        0.0
                    } else {
                        hist.value_at_quantile(0.95) as f64 / 1e3
                    },
                };
                tenant.interval_reads_ns.reset();
                tenant.interval_completed = 0;
                point
            })
            .collect();
        let (rate_scale, spare_share) = self
            .server
            .control()
            .plan(0)
            .map_or((1.0, 1.0), |plan| (plan.rate_scale, plan.spare_share));
        self.timeline.push(TimelinePoint {
            end_ms: now.saturating_since(self.warmup_end).0 / 1_000_000,
            rate_scale,
            spare_share,
            tenants,
        });
        if now + interval <= self.end {
            self.push(now + interval, Event::Tick);
        }
    }

    /// The fairness monitor's last window on the tenant `handle` of `namespace`, from the
    /// first thread that judged it.
    fn fairness_window(&self, namespace: u32, handle: u64) -> Option<reflex_qos::FlowReport> {
        let now = self.server.now();
        (0..self.config.threads).find_map(|thread| {
            let snapshot = self.server.dataplane(thread).live_snapshot(now);
            snapshot
                .namespaces
                .get(namespace as usize - 1)?
                .fairness
                .flows
                .iter()
                .find(|flow| flow.handle == handle)
                .and_then(|flow| flow.last_window)
        })
    }

    /// Every tenant's figures summed over the server's threads.
    fn tenant_stats(&self) -> Vec<TenantStats> {
        let mut totals: Vec<TenantStats> = Vec::new();
        for thread in self.server.stats() {
            for stats in thread.tenants {
                match totals.iter_mut().find(|t| t.handle == stats.handle) {
                    Some(total) => total.add(&stats),
                    None => totals.push(stats),
                }
            }
        }
        totals
    }

    fn report(&self) -> PointReport {
        let seconds = self.config.duration.as_secs_f64();
        let plan = self.server.control().plan(0);
        let stats = self.tenant_stats();
        let mut tenants = Vec::new();
        let mut tokens_total = 0.0;
        for tenant in &self.tenants {
            let totals = tenant
                .handle
                .and_then(|handle| stats.iter().find(|s| s.handle == handle));
            let millitokens = totals.map_or(0, |t| t.millitokens) - tenant.millitokens_at_warmup;
            let tokens = millitokens as f64 / 1000.0;
            tokens_total += tokens;
            let (class, latency_us_p95, reserved_iops) = match tenant.sim.spec {
                TenantSpec::LatencyCritical {
                    latency_us_p95,
                    iops,
                    ..
                } => (
                    TenantClass::LatencyCritical,
                    Some(latency_us_p95),
                    Some(iops),
                ),
                TenantSpec::BestEffort => (TenantClass::BestEffort, None, None),
            };
            let offered_iops = match tenant.sim.load {
                Load::Open { iops, .. } => Some(iops as f64),
                Load::Closed { .. } => None,
            };
            let hist = &tenant.read_latency_ns;
            let reads = hist.len();
            let quantile_us = |q: f64| {
                if reads > 0 {
                    hist.value_at_quantile(q) as f64 / 1e3
                } else {
                    0.0
                }
            };
            let iops = tenant.completed_in_window as f64 / seconds;
            let arrived_iops = offered_iops.map(|_| tenant.arrivals_in_window as f64 / seconds);
            let p95 = quantile_us(0.95);
            let slo_met = latency_us_p95.map(|slo| {
                let latency_ok = reads == 0 || p95 <= slo as f64;
                // Against what actually arrived: a Poisson source's count over a short window
                // differs from its nominal rate by more than 1 %.
                let iops_ok = arrived_iops.is_none_or(|arrived| iops >= 0.99 * arrived);
                tenant.handle.is_some() && latency_ok && iops_ok && tenant.errors == 0
            });
            tenants.push(TenantReport {
                name: tenant.sim.name.clone(),
                namespace: tenant.sim.namespace,
                class,
                admitted: tenant.handle.is_some(),
                latency_us_p95,
                reserved_iops,
                offered_iops,
                arrived_iops,
                iops,
                reads,
                read_p95_us: p95,
                read_p99_us: quantile_us(0.99),
                scheduler_wait_us_mean: totals.map_or(0.0, |t| {
                    t.scheduler_wait_ns as f64 / 1e3 / t.requests.max(1) as f64
                }),
                tokens_per_sec: tokens / seconds,
                slo_met,
                notices: tenant.episodes.len() as u64,
                device_notices: tenant.device_notices,
                errors: tenant.errors,
                shed: tenant.shed,
                backlog: tenant.backlog.len() as u64,
                fairness_window: tenant
                    .handle
                    .and_then(|handle| self.fairness_window(tenant.sim.namespace, handle)),
            });
        }
        PointReport {
            threads: self.config.threads,
            qos: self.config.policy == Policy::Tokens,
            seed: self.config.seed,
            duration_ms: self.config.duration.0 / 1_000_000,
            latency_us_p95: plan.as_ref().and_then(|p| p.latency_us_p95),
            device_tokens_per_sec: plan
                .as_ref()
                .map_or(0.0, |p| p.device_tokens_per_sec[0].as_tokens_per_sec_f64()),
            namespace_tokens_per_sec: (0..self.capacity_bytes.len() as u16)
                .map(|index| {
                    self.server
                        .control()
                        .plan(index)
                        .map_or(0.0, |p| p.device_tokens_per_sec[0].as_tokens_per_sec_f64())
                })
                .collect(),
            tokens_used_per_sec: tokens_total / seconds,
            tenants,
            refusals: self.refusals.clone(),
            rate_scale: plan.as_ref().map_or(1.0, |p| p.rate_scale),
            timeline: self.timeline.clone(),
            migrated: (0..self.config.threads)
                .map(|thread| self.server.dataplane(thread).migration_stats(0))
                .collect(),
        }
    }
}

enum Answer {
    /// The OK to a REPORT (nothing to do).
    Report,
    Io {
        id: u64,
        ok: bool,
    },
    Notice {
        tenant: u32,
        episode: u64,
        /// A notice about the device: the share of the reservation granted now.
        granted: Option<f64>,
    },
}

/// An exponentially distributed gap in nanoseconds for a Poisson process at `rate_per_sec`.
fn exponential(rng: &mut Xoshiro256PlusPlus, rate_per_sec: f64) -> u64 {
    assert!(rate_per_sec > 0.0, "Poisson rate zero");
    // Uniform in (0, 1]: never ln(0).
    let uniform = ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
    let gap_ns = -uniform.ln() * 1e9 / rate_per_sec;
    (gap_ns.round() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_gaps_average_to_the_rate() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(7);
        let n = 200_000;
        let total: u64 = (0..n).map(|_| exponential(&mut rng, 100_000.0)).sum();
        let mean_ns = total as f64 / n as f64;
        assert!((mean_ns - 10_000.0).abs() < 100.0, "{mean_ns}");
    }
}
