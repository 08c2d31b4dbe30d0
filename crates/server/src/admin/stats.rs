//! Live statistics: the control-plane thread reads every dataplane thread's latest snapshot
//! (`reflex_dataplane::live`) once per window, sums them per tenant, namespace and thread,
//! and subtracts the previous sum: the window's rates and latency quantiles. SLO attainment
//! is counted here: a window in which a latency-critical tenant completed at least
//! [`SLO_READS_MIN`] reads is judged, and met when its read p95 is within the SLO.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reflex_dataplane::control::{ControlPlane, TenantInfo};
use reflex_dataplane::live::{BATCH_BUCKETS, FairnessSnapshot, ThreadSnapshot};
use reflex_dataplane::namespaces::NamespaceSet;
use reflex_dataplane::telemetry::LatencyHistogram;
use reflex_qos::{Ledger, TenantSpec};
use serde::Serialize;

/// Reads a window needs before its p95 says anything about an SLO.
pub const SLO_READS_MIN: u64 = 20;

/// One tenant's cumulative figures, summed over threads.
#[derive(Debug, Clone, Default)]
pub struct TenantTotals {
    pub namespace_id: u32,
    pub arrivals: u64,
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub read_latency: LatencyHistogram,
    pub millitokens_spent: i64,
    pub millitokens_earned: i64,
    pub millitokens_from_bucket: i64,
    pub millitokens_donated: i64,
    pub deficit_episodes: u64,
    pub deficit_ns: u64,
    pub queued: u64,
    /// Requests refused by access control, by `reflex_dataplane::access::Refusal::index`.
    pub refusals: [u64; reflex_dataplane::access::Refusal::COUNT],
}

impl TenantTotals {
    fn add(&mut self, tenant: &reflex_dataplane::live::TenantSnapshot) {
        self.namespace_id = tenant.namespace_id;
        self.arrivals += tenant.arrivals;
        self.reads += tenant.reads;
        self.read_bytes += tenant.read_bytes;
        self.writes += tenant.writes;
        self.write_bytes += tenant.write_bytes;
        self.read_latency.merge(&tenant.read_latency);
        self.millitokens_spent += tenant.millitokens_spent;
        self.millitokens_earned += tenant.millitokens_earned;
        self.millitokens_from_bucket += tenant.millitokens_from_bucket;
        self.millitokens_donated += tenant.millitokens_donated;
        self.deficit_episodes += tenant.deficit_episodes;
        self.deficit_ns += tenant.deficit_ns;
        self.queued += u64::from(tenant.queued);
        for (total, count) in self.refusals.iter_mut().zip(tenant.refusals) {
            *total += count;
        }
    }
}

/// One namespace's cumulative figures, summed over threads.
#[derive(Debug, Clone, Default)]
pub struct NamespaceTotals {
    pub device_in_flight: u64,
    pub device_operations: u64,
    pub device_ns: u64,
    pub read_latency: LatencyHistogram,
    pub ledger: Ledger,
    /// Each thread's fairness stage on the namespace: (thread index, the thread's clock at
    /// publication, the stage). Stages are per thread, so they are listed, not summed.
    pub fairness: Vec<(usize, reflex_qos::Nanos, FairnessSnapshot)>,
}

/// Everything summed at one instant.
#[derive(Debug, Clone)]
pub struct Totals {
    pub at: Instant,
    pub tenants: BTreeMap<u64, TenantTotals>,
    pub namespaces: BTreeMap<u32, NamespaceTotals>,
    pub threads: Vec<Arc<ThreadSnapshot>>,
}

impl Totals {
    pub fn read(board: &reflex_dataplane::live::LiveBoard) -> Totals {
        let threads = board.read();
        let mut tenants: BTreeMap<u64, TenantTotals> = BTreeMap::new();
        let mut namespaces: BTreeMap<u32, NamespaceTotals> = BTreeMap::new();
        for thread in &threads {
            for tenant in &thread.tenants {
                tenants.entry(tenant.handle).or_default().add(tenant);
            }
            for namespace in &thread.namespaces {
                let total = namespaces.entry(namespace.namespace_id).or_default();
                total.device_in_flight += u64::from(namespace.device_in_flight);
                total.device_operations += namespace.device_operations;
                total.device_ns += namespace.device_ns;
                total.read_latency.merge(&namespace.read_latency);
                let ledger = &namespace.ledger;
                total.ledger.generated.0 += ledger.generated.0;
                total.ledger.from_bucket.0 += ledger.from_bucket.0;
                total.ledger.spent.0 += ledger.spent.0;
                total.ledger.to_bucket.0 += ledger.to_bucket.0;
                total.ledger.withheld.0 += ledger.withheld.0;
                total.ledger.written_off.0 += ledger.written_off.0;
                total.ledger.held.0 += ledger.held.0;
                total
                    .fairness
                    .push((thread.thread_index, thread.at, namespace.fairness.clone()));
            }
        }
        Totals {
            at: Instant::now(),
            tenants,
            namespaces,
            threads,
        }
    }
}

/// Latency quantiles of a window, in µs (0 without reads).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Quantiles {
    pub p50: u64,
    pub p95: u64,
    pub p99: u64,
}

impl Quantiles {
    pub fn of(histogram: &LatencyHistogram) -> Quantiles {
        Quantiles {
            p50: histogram.quantile_us(0.50),
            p95: histogram.quantile_us(0.95),
            p99: histogram.quantile_us(0.99),
        }
    }
}

/// One tenant's last window.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TenantWindow {
    pub arrivals_per_sec: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_sec: f64,
    pub write_bytes_per_sec: f64,
    pub reads: u64,
    pub read_latency_us: Quantiles,
    pub tokens_spent_per_sec: f64,
    pub tokens_earned_per_sec: f64,
    pub tokens_claimed_per_sec: f64,
    pub tokens_donated_per_sec: f64,
    /// Share of the window spent in a deficit episode (summed over threads, so up to the
    /// number of threads).
    pub deficit_share: f64,
    pub queued: u64,
}

/// How often a tenant's SLO held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SloAttainment {
    /// Windows with enough reads to judge.
    pub windows_judged: u64,
    pub windows_met: u64,
    /// `windows_met / windows_judged`; `None` before the first judged window.
    pub attainment: Option<f64>,
    /// Whether the last judged window met the SLO.
    pub last_met: Option<bool>,
}

impl SloAttainment {
    fn judge(&mut self, met: bool) {
        self.windows_judged += 1;
        self.windows_met += u64::from(met);
        self.attainment = Some(self.windows_met as f64 / self.windows_judged as f64);
        self.last_met = Some(met);
    }
}

/// One tenant as `GET /v1/stats` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct TenantStatsView {
    pub name: String,
    pub namespace_id: u32,
    pub handle: String,
    pub class: &'static str,
    pub slo_latency_us_p95: Option<u64>,
    pub reserved_iops: Option<u64>,
    pub window: TenantWindow,
    pub totals: TenantTotalsView,
    pub slo: SloAttainment,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct TenantTotalsView {
    pub arrivals: u64,
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_latency_us: Quantiles,
    pub tokens_spent: f64,
    pub tokens_earned: f64,
    pub tokens_claimed: f64,
    pub tokens_donated: f64,
    pub deficit_seconds: f64,
    /// Deficit episodes, each of which sent a RENEGOTIATE notice.
    pub renegotiation_notices: u64,
    pub in_deficit_episode: bool,
    pub connections: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct ThreadStatsView {
    pub thread: usize,
    /// Share of the window the thread worked (did not sleep or find nothing to do).
    pub busy_share: f64,
    pub iterations_per_sec: f64,
    /// Completions handled per loop iteration, on average over the window.
    pub batch_mean: f64,
    /// Iterations of the window by completions handled: 0, 1, 2–3, 4–7, …, 64 and more.
    pub batch_sizes: [u64; BATCH_BUCKETS],
    pub connections: u32,
    pub requests_per_sec: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct NamespaceStatsView {
    pub namespace_id: u32,
    pub device: String,
    pub device_queue_depth: u64,
    pub device_operations_per_sec: f64,
    pub device_latency_us_mean: f64,
    pub read_latency_us: Quantiles,
    /// The token rate the schedulers hand out (the profile's at the strictest SLO × the
    /// rate scale); `None` without QoS.
    pub device_tokens_per_sec: Option<f64>,
    pub lc_reserved_tokens_per_sec: Option<f64>,
    pub rate_scale: Option<f64>,
    pub tokens_spent_per_sec: f64,
}

/// One flow (tenant) of a thread's fairness stage, as `GET /v1/fairness` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct FairFlowView {
    /// The tenant's name; `None` for the namespace's default tenant (untenanted requests).
    pub tenant: Option<String>,
    pub handle: String,
    pub held: u32,
    pub device_in_flight: u32,
    /// The monitor's last window (all `None` when the flow had too few requests in it).
    pub intensity_per_sec: Option<f64>,
    pub rt_us: Option<f64>,
    pub rt_alone_us: Option<f64>,
    pub alone_learned: Option<bool>,
    /// RT_alone was set from outside (the tenant's `rt_alone_us`), not learned.
    pub alone_set: Option<bool>,
    pub slowdown: Option<f64>,
    pub density: Option<&'static str>,
    pub backwardings: Option<u32>,
}

/// One thread's fairness stage on a namespace.
#[derive(Debug, Clone, Serialize)]
pub struct FairThreadView {
    pub thread: usize,
    pub held: u32,
    pub device_in_flight: u32,
    pub held_total: u64,
    pub released_total: u64,
    pub backwarded_total: u64,
    pub windows: u64,
    /// The places at the device the stage uses now (below `be_device_depth_max` when the
    /// adaptive depth took some away), and how often it took one away and gave one back.
    pub device_depth: u32,
    pub device_depth_max: u32,
    pub depth_lowered_total: u64,
    pub depth_raised_total: u64,
    /// The monitor's last window: F, the device's busy share, the verdict, and how long ago
    /// it closed (the monitor closes windows only while requests flow).
    pub fairness: Option<f64>,
    pub utilisation: Option<f64>,
    pub unfair: Option<bool>,
    pub policy: Option<&'static str>,
    pub window_age_seconds: Option<f64>,
    pub flows: Vec<FairFlowView>,
}

/// One namespace's fairness stages, as `GET /v1/fairness` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct FairNamespaceView {
    pub namespace_id: u32,
    pub mode: reflex_qos::FairMode,
    pub held: u64,
    pub device_in_flight: u64,
    pub held_total: u64,
    pub released_total: u64,
    pub backwarded_total: u64,
    /// The lowest F over threads with a window (each thread's monitor judges its own flows).
    pub fairness_min: Option<f64>,
    /// LB = min U / max U over the threads' device utilisations (OctoFAS eq. 3); `None`
    /// with fewer than two threads with a window.
    pub load_balance: Option<f64>,
    pub threads: Vec<FairThreadView>,
}

/// One thread's inter-core migration counters since start (`core/migration.rs`), over all
/// namespaces: migration hands reads between threads, not between namespaces.
#[derive(Debug, Clone, Serialize)]
pub struct MigrationThreadView {
    pub thread: usize,
    /// Reads this thread handed to another thread.
    pub sent: u64,
    /// Reads of other threads this thread served.
    pub served: u64,
    /// Reads of other threads this thread could not serve (answered with an error).
    pub refused: u64,
}

/// `GET /v1/fairness`.
#[derive(Debug, Clone, Serialize)]
pub struct FairnessView {
    pub namespaces: Vec<FairNamespaceView>,
    /// Per thread, in thread order (threads that have not published yet are absent).
    pub migration: Vec<MigrationThreadView>,
}

/// LB = min / max of `utilisations` (`None` with fewer than two, 1 when all are idle).
pub fn load_balance(utilisations: &[f64]) -> Option<f64> {
    if utilisations.len() < 2 {
        return None;
    }
    let max = utilisations.iter().copied().fold(0.0, f64::max);
    let min = utilisations.iter().copied().fold(f64::INFINITY, f64::min);
    Some(if max > 0.0 { min / max } else { 1.0 })
}

fn density_label(density: reflex_qos::Density) -> &'static str {
    match density {
        reflex_qos::Density::Dense => "dense",
        reflex_qos::Density::Sparse => "sparse",
    }
}

/// The label of Algorithm 1's verdict.
pub fn policy_label(policy: reflex_qos::FairnessPolicy) -> &'static str {
    match policy {
        reflex_qos::FairnessPolicy::None => "none",
        reflex_qos::FairnessPolicy::Inter => "inter",
        reflex_qos::FairnessPolicy::Intra => "intra",
        reflex_qos::FairnessPolicy::Hybrid => "hybrid",
    }
}

/// `GET /v1/stats`.
#[derive(Debug, Clone, Serialize)]
pub struct StatsView {
    pub window_seconds: f64,
    /// Windows closed since the server started.
    pub windows: u64,
    pub tenants: Vec<TenantStatsView>,
    pub threads: Vec<ThreadStatsView>,
    pub namespaces: Vec<NamespaceStatsView>,
}

/// The sampler's state: the last two sums, the last window per tenant, SLO attainment.
pub struct Sampler {
    control: Arc<ControlPlane>,
    manager: Arc<crate::namespaces::NamespaceManager>,
    previous: Totals,
    latest: Totals,
    windows: u64,
    tenant_windows: BTreeMap<u64, TenantWindow>,
    attainment: BTreeMap<u64, SloAttainment>,
    thread_views: Vec<ThreadStatsView>,
    /// Per namespace id: device operations/s, mean device latency (µs), read quantiles,
    /// tokens spent/s.
    namespace_windows: BTreeMap<u32, (f64, f64, Quantiles, f64)>,
    window_seconds: f64,
    /// Requests the admin API refused, by [`AdminRefusal::index`] (counted by its
    /// middleware, read by `/metrics`).
    pub admin_refused: Arc<AdminRefusals>,
    /// Thread scaling (several threads only): active threads and scaling events.
    pub scaling: Option<Arc<crate::scaling::ScalingControl>>,
}

/// Why the admin API refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminRefusal {
    /// The peer is not on `[admin] allow`.
    NotAllowed,
    /// The peer is not on this machine and `allow_remote` is off.
    Remote,
    /// No token, or a wrong one.
    Unauthorized,
}

impl AdminRefusal {
    pub const ALL: [AdminRefusal; 3] = [
        AdminRefusal::NotAllowed,
        AdminRefusal::Remote,
        AdminRefusal::Unauthorized,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn label(self) -> &'static str {
        match self {
            AdminRefusal::NotAllowed => "not_allowed",
            AdminRefusal::Remote => "remote",
            AdminRefusal::Unauthorized => "unauthorized",
        }
    }
}

/// Counters of the admin API's refusals.
#[derive(Debug, Default)]
pub struct AdminRefusals {
    counts: [std::sync::atomic::AtomicU64; AdminRefusal::ALL.len()],
}

impl AdminRefusals {
    pub fn add(&self, refusal: AdminRefusal) {
        self.counts[refusal.index()].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn get(&self, refusal: AdminRefusal) -> u64 {
        self.counts[refusal.index()].load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn per_sec(delta: f64, seconds: f64) -> f64 {
    if seconds > 0.0 { delta / seconds } else { 0.0 }
}

fn delta_u(now: u64, before: u64) -> f64 {
    now.saturating_sub(before) as f64
}

fn delta_tokens(now: i64, before: i64) -> f64 {
    (now - before).max(0) as f64 / 1000.0
}

impl Sampler {
    pub fn new(
        control: Arc<ControlPlane>,
        manager: Arc<crate::namespaces::NamespaceManager>,
    ) -> Sampler {
        let totals = Totals::read(control.live());
        Sampler {
            control,
            manager,
            previous: totals.clone(),
            latest: totals,
            windows: 0,
            tenant_windows: BTreeMap::new(),
            attainment: BTreeMap::new(),
            thread_views: Vec::new(),
            namespace_windows: BTreeMap::new(),
            window_seconds: 0.0,
            admin_refused: Arc::new(AdminRefusals::default()),
            scaling: None,
        }
    }

    pub fn control(&self) -> &Arc<ControlPlane> {
        &self.control
    }

    /// The namespaces served now.
    pub fn namespaces(&self) -> Arc<NamespaceSet> {
        self.manager
            .namespaces()
            .unwrap_or_else(|| Arc::new(NamespaceSet::new(Vec::new())))
    }

    /// The device label of namespace index `index`.
    pub fn device(&self, index: usize) -> String {
        self.manager
            .meta(index as u16)
            .map(|meta| meta.device)
            .unwrap_or_default()
    }

    /// The latest sums (what `/metrics` shows: counters since start).
    pub fn latest(&self) -> &Totals {
        &self.latest
    }

    /// SLO attainment of a tenant so far.
    pub fn attainment(&self, handle: u64) -> SloAttainment {
        self.attainment.get(&handle).copied().unwrap_or_default()
    }

    /// The last window of a tenant.
    pub fn tenant_window(&self, handle: u64) -> Option<&TenantWindow> {
        self.tenant_windows.get(&handle)
    }

    /// Closes a window: reads the board, computes rates since the previous window and judges
    /// each latency-critical tenant's SLO.
    pub fn close_window(&mut self) {
        let totals = Totals::read(self.control.live());
        let seconds = totals
            .at
            .saturating_duration_since(self.latest.at)
            .max(Duration::from_millis(1))
            .as_secs_f64();
        self.previous = std::mem::replace(&mut self.latest, totals);
        self.windows += 1;
        let infos: BTreeMap<u64, TenantInfo> = self
            .control
            .tenants()
            .into_iter()
            .map(|info| (info.handle, info))
            .collect();
        let empty = TenantTotals::default();
        let mut windows = BTreeMap::new();
        for (handle, now) in &self.latest.tenants {
            let before = self.previous.tenants.get(handle).unwrap_or(&empty);
            let latency = now.read_latency.since(&before.read_latency);
            let window = TenantWindow {
                arrivals_per_sec: per_sec(delta_u(now.arrivals, before.arrivals), seconds),
                read_iops: per_sec(delta_u(now.reads, before.reads), seconds),
                write_iops: per_sec(delta_u(now.writes, before.writes), seconds),
                read_bytes_per_sec: per_sec(delta_u(now.read_bytes, before.read_bytes), seconds),
                write_bytes_per_sec: per_sec(delta_u(now.write_bytes, before.write_bytes), seconds),
                reads: latency.count(),
                read_latency_us: Quantiles::of(&latency),
                tokens_spent_per_sec: per_sec(
                    delta_tokens(now.millitokens_spent, before.millitokens_spent),
                    seconds,
                ),
                tokens_earned_per_sec: per_sec(
                    delta_tokens(now.millitokens_earned, before.millitokens_earned),
                    seconds,
                ),
                tokens_claimed_per_sec: per_sec(
                    delta_tokens(now.millitokens_from_bucket, before.millitokens_from_bucket),
                    seconds,
                ),
                tokens_donated_per_sec: per_sec(
                    delta_tokens(now.millitokens_donated, before.millitokens_donated),
                    seconds,
                ),
                deficit_share: per_sec(delta_u(now.deficit_ns, before.deficit_ns) / 1e9, seconds),
                queued: now.queued,
            };
            if let Some(TenantSpec::LatencyCritical { latency_us_p95, .. }) =
                infos.get(handle).map(|info| info.spec)
                && latency.count() >= SLO_READS_MIN
            {
                self.attainment
                    .entry(*handle)
                    .or_default()
                    .judge(window.read_latency_us.p95 <= latency_us_p95);
            }
            windows.insert(*handle, window);
        }
        self.attainment
            .retain(|handle, _| infos.contains_key(handle));
        self.tenant_windows = windows;

        let previous_threads: BTreeMap<usize, &Arc<ThreadSnapshot>> = self
            .previous
            .threads
            .iter()
            .map(|thread| (thread.thread_index, thread))
            .collect();
        self.thread_views = self
            .latest
            .threads
            .iter()
            .map(|now| {
                let before = previous_threads.get(&now.thread_index);
                let field = |get: fn(&ThreadSnapshot) -> u64| {
                    delta_u(get(now), before.map_or(0, |before| get(before)))
                };
                let busy = field(|t| t.busy_ns);
                let iterations = field(|t| t.iterations);
                let mut batch_sizes = now.batch_sizes;
                if let Some(before) = before {
                    for (bucket, earlier) in batch_sizes.iter_mut().zip(before.batch_sizes) {
                        *bucket = bucket.saturating_sub(earlier);
                    }
                }
                ThreadStatsView {
                    thread: now.thread_index,
                    // A thread that slept through the window published nothing: busy 0.
                    busy_share: (busy / 1e9 / seconds).clamp(0.0, 1.0),
                    iterations_per_sec: per_sec(iterations, seconds),
                    batch_mean: if iterations > 0.0 {
                        field(|t| t.completions) / iterations
                    } else {
                        0.0
                    },
                    batch_sizes,
                    connections: now.connections_open,
                    requests_per_sec: per_sec(field(|t| t.requests_answered), seconds),
                }
            })
            .collect();

        let empty = NamespaceTotals::default();
        self.namespace_windows = self
            .latest
            .namespaces
            .iter()
            .map(|(id, now)| {
                let before = self.previous.namespaces.get(id).unwrap_or(&empty);
                let operations = delta_u(now.device_operations, before.device_operations);
                let device_ns = delta_u(now.device_ns, before.device_ns);
                let latency = now.read_latency.since(&before.read_latency);
                let spent = delta_tokens(now.ledger.spent.0, before.ledger.spent.0);
                (
                    *id,
                    (
                        per_sec(operations, seconds),
                        if operations > 0.0 {
                            device_ns / operations / 1e3
                        } else {
                            0.0
                        },
                        Quantiles::of(&latency),
                        per_sec(spent, seconds),
                    ),
                )
            })
            .collect();
        self.window_seconds = seconds;
    }

    /// What `GET /v1/fairness` shows: every live namespace's stages, from the latest sums.
    pub fn fairness_view(&self) -> FairnessView {
        let names: BTreeMap<u64, String> = self
            .control
            .tenants()
            .into_iter()
            .map(|info| (info.handle, info.name))
            .collect();
        let current = self.namespaces();
        let mut namespaces = Vec::new();
        for namespace_index in current.live_indices() {
            let id = current.id(namespace_index);
            let stages = self
                .latest
                .namespaces
                .get(&id)
                .map_or(&[][..], |totals| &totals.fairness[..]);
            let threads: Vec<FairThreadView> = stages
                .iter()
                .map(|(thread, at, stage)| fair_thread_view(*thread, *at, stage, &names))
                .collect();
            let utilisations: Vec<f64> = threads.iter().filter_map(|t| t.utilisation).collect();
            namespaces.push(FairNamespaceView {
                namespace_id: id,
                mode: stages
                    .first()
                    .map_or(reflex_qos::FairMode::Off, |(_, _, stage)| stage.mode),
                held: threads.iter().map(|t| u64::from(t.held)).sum(),
                device_in_flight: threads.iter().map(|t| u64::from(t.device_in_flight)).sum(),
                held_total: threads.iter().map(|t| t.held_total).sum(),
                released_total: threads.iter().map(|t| t.released_total).sum(),
                backwarded_total: threads.iter().map(|t| t.backwarded_total).sum(),
                fairness_min: threads.iter().filter_map(|t| t.fairness).reduce(f64::min),
                load_balance: load_balance(&utilisations),
                threads,
            });
        }
        let mut migration: Vec<MigrationThreadView> = self
            .latest
            .threads
            .iter()
            .map(|thread| MigrationThreadView {
                thread: thread.thread_index,
                sent: thread.migrated_sent,
                served: thread.migrated_served,
                refused: thread.migrated_refused,
            })
            .collect();
        migration.sort_by_key(|view| view.thread);
        FairnessView {
            namespaces,
            migration,
        }
    }

    /// What `GET /v1/stats` shows: the last window, totals since start, SLO attainment.
    pub fn view(&self) -> StatsView {
        let mut tenants = Vec::new();
        for info in self.control.tenants() {
            let totals = self.latest.tenants.get(&info.handle);
            let (slo, reserved_iops, class) = match info.spec {
                TenantSpec::LatencyCritical {
                    latency_us_p95,
                    iops,
                    ..
                } => (Some(latency_us_p95), Some(iops), "lc"),
                TenantSpec::BestEffort => (None, None, "be"),
            };
            let totals_view = match totals {
                Some(t) => TenantTotalsView {
                    arrivals: t.arrivals,
                    reads: t.reads,
                    writes: t.writes,
                    read_bytes: t.read_bytes,
                    write_bytes: t.write_bytes,
                    read_latency_us: Quantiles::of(&t.read_latency),
                    tokens_spent: t.millitokens_spent as f64 / 1000.0,
                    tokens_earned: t.millitokens_earned as f64 / 1000.0,
                    tokens_claimed: t.millitokens_from_bucket as f64 / 1000.0,
                    tokens_donated: t.millitokens_donated as f64 / 1000.0,
                    deficit_seconds: t.deficit_ns as f64 / 1e9,
                    renegotiation_notices: info.deficit_episodes,
                    in_deficit_episode: info.in_deficit_episode,
                    connections: info.connections_per_thread.iter().sum(),
                },
                None => TenantTotalsView {
                    renegotiation_notices: info.deficit_episodes,
                    in_deficit_episode: info.in_deficit_episode,
                    connections: info.connections_per_thread.iter().sum(),
                    ..TenantTotalsView::default()
                },
            };
            tenants.push(TenantStatsView {
                name: info.name.clone(),
                namespace_id: info.namespace_id,
                handle: format!("{:016x}", info.handle),
                class,
                slo_latency_us_p95: slo,
                reserved_iops,
                window: self
                    .tenant_windows
                    .get(&info.handle)
                    .cloned()
                    .unwrap_or_default(),
                totals: totals_view,
                slo: self.attainment(info.handle),
            });
        }
        let mut namespaces = Vec::new();
        let current = self.namespaces();
        for namespace_index in current.live_indices() {
            let index = usize::from(namespace_index);
            let id = current.id(namespace_index);
            let plan = self.control.plan(namespace_index);
            let (operations, latency_mean, quantiles, spent) =
                self.namespace_windows.get(&id).copied().unwrap_or_default();
            namespaces.push(NamespaceStatsView {
                namespace_id: id,
                device: self.device(index),
                device_queue_depth: self
                    .latest
                    .namespaces
                    .get(&id)
                    .map_or(0, |n| n.device_in_flight),
                device_operations_per_sec: operations,
                device_latency_us_mean: latency_mean,
                read_latency_us: quantiles,
                device_tokens_per_sec: plan
                    .map(|plan| plan.device_tokens_per_sec[0].as_tokens_per_sec_f64()),
                lc_reserved_tokens_per_sec: plan
                    .map(|plan| plan.lc_reserved_tokens_per_sec[0].as_tokens_per_sec_f64()),
                rate_scale: plan.map(|plan| plan.rate_scale),
                tokens_spent_per_sec: spent,
            });
        }
        StatsView {
            window_seconds: self.window_seconds,
            windows: self.windows,
            tenants,
            threads: self.thread_views.clone(),
            namespaces,
        }
    }
}

fn fair_thread_view(
    thread: usize,
    at: reflex_qos::Nanos,
    stage: &FairnessSnapshot,
    names: &BTreeMap<u64, String>,
) -> FairThreadView {
    let window = stage.last_window;
    FairThreadView {
        thread,
        held: stage.held,
        device_in_flight: stage.device_in_flight,
        held_total: stage.stats.held_total,
        released_total: stage.stats.released_total,
        backwarded_total: stage.stats.backwarded_total,
        windows: stage.stats.reports,
        device_depth: stage.depth,
        device_depth_max: stage.depth_max,
        depth_lowered_total: stage.stats.depth_lowered,
        depth_raised_total: stage.stats.depth_raised,
        fairness: window.map(|w| w.fairness),
        utilisation: window.map(|w| w.utilisation),
        unfair: window.map(|w| w.unfair),
        policy: window.map(|w| policy_label(w.policy)),
        window_age_seconds: window.map(|w| at.saturating_since(w.end).0 as f64 / 1e9),
        flows: stage
            .flows
            .iter()
            .map(|flow| {
                let judged = flow.last_window;
                FairFlowView {
                    tenant: names.get(&flow.handle).cloned(),
                    handle: format!("{:016x}", flow.handle),
                    held: flow.held,
                    device_in_flight: flow.device_in_flight,
                    intensity_per_sec: judged.map(|f| f.intensity),
                    rt_us: judged.map(|f| f.rt_us),
                    rt_alone_us: judged.map(|f| f.rt_alone_us),
                    alone_learned: judged.map(|f| f.alone_learned),
                    alone_set: judged.map(|f| f.alone_set),
                    slowdown: judged.map(|f| f.slowdown),
                    density: judged.map(|f| density_label(f.density)),
                    backwardings: judged.map(|f| f.backwardings),
                }
            })
            .collect(),
    }
}
