//! The tenant registry and admission control: control-plane state, never on the data path.
//!
//! Admission (paper §3.2.2, §4.3): the device's token rate is the profile's rate at the
//! strictest LC latency SLO (linear interpolation between rows; outside the table the nearest
//! row is used and a warning logged). An LC tenant is admitted only if the sum of LC
//! reservations, IOPS × (r × C(read) + (1 − r) × C(write)), fits in that rate. When every LC
//! tenant is read-only and no BE tenant is registered, the read-only column applies instead
//! (IOPS × C(read, 100 %) against reads/s × C(read, 100 %)); a BE tenant that would end that
//! state while the LC reservations do not fit the mixed rate is refused rather than silently
//! overcommitting the device (the original code's caveat).
//!
//! Every change (register, re-register with a new SLO, unregister, a connection bound, closed
//! or moved) recomputes the plan from running totals (O(log tenants)) and queues
//! [`RateUpdate`]s: one [`DeviceRates`] per thread when device-level values moved (device rate,
//! Σ LC, each BE tenant's share, the LC boost), and [`TenantRates`] only for the tenant that
//! changed. Each scheduler derives every tenant's effective rate from the two
//! ([`crate::rates::effective_rates`]), so a new BE tenant is not one message per BE tenant.
//! [`TenantRegistry::take_updates`] hands the messages to the dataplane. A refused change
//! leaves no state behind.
//!
//! A tenant may have connections on several threads; its reservation is counted once, and each
//! thread gets the share of its rate (and of its deficit limit) proportional to the tenant's
//! connections there, rebalanced whenever a connection comes, goes, or moves. Shares are split
//! with the remainder on the thread with most connections, so they sum to the rate exactly.
//!
//! Deficit notices: each thread reports when the tenant reaches its deficit limit there and
//! when it recovers; a tenant is "in an episode" while any thread says so, and the registry
//! returns one [`Notice::Renegotiate`] per episode.
//!
//! Rate scale (online calibration, [`crate::calibrator`]): [`TenantRegistry::set_rate_scale`]
//! makes the device rate the profile's rate at the strictest SLO × the scale, for admission and
//! for the rates alike. A scale-down may leave Σ LC reservations above the device rate: the
//! plan is then *overcommitted*. Reservations are kept (nobody is unregistered); BE tenants get
//! nothing (they share what LC leaves); the LC tenants that no longer fit are named so the
//! control plane can ask them to renegotiate: replaying admission in the order tenants were
//! admitted against the scaled rate, the first that does not fit and every one after it. The
//! tenants that fit keep their whole reservation (their promise still holds); the ones over
//! share what is left, in proportion to their reservations. While overcommitted, a registration or re-registration is admitted only if it
//! keeps the admission mode, does not lower the device rate and does not grow the excess, so
//! it never puts another tenant over; unregistering and connection changes are always allowed.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::config::{ConfigError, QosConfig, THREADS_MAX};
use crate::cost::{CostModel, LoadMode};
use crate::profile::{Clamp, DeviceProfile};
use crate::rates::{
    DeviceRates, RatePerMode, RateUpdate, SPARE_SHARE_ALL, TenantClass, TenantId, TenantRates,
};
use crate::scheduler::SchedulerEvent;
use crate::tokens::{HumanRate, TokenRate, Tokens};

/// What a tenant asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TenantSpec {
    /// `iops` 4 KiB requests per second at `read_percent` reads, with p95 read latency at most
    /// `latency_us_p95`.
    LatencyCritical {
        latency_us_p95: u64,
        iops: u64,
        read_percent: u8,
    },
    BestEffort,
}

impl TenantSpec {
    pub fn class(&self) -> TenantClass {
        match self {
            TenantSpec::LatencyCritical { .. } => TenantClass::LatencyCritical,
            TenantSpec::BestEffort => TenantClass::BestEffort,
        }
    }

    fn validate(&self) -> Result<(), AdmissionError> {
        if let TenantSpec::LatencyCritical {
            latency_us_p95,
            iops,
            read_percent,
        } = *self
        {
            let reason = if latency_us_p95 == 0 {
                Some("latency SLO must be above 0 µs")
            } else if latency_us_p95 > LATENCY_SLO_US_MAX {
                Some("latency SLO above 60 s is not a latency objective (register best-effort)")
            } else if iops == 0 {
                Some("IOPS must be above 0")
            } else if iops > IOPS_MAX {
                Some("IOPS above 1,000,000,000")
            } else if read_percent > 100 {
                Some("read percentage above 100")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(AdmissionError::InvalidSpec { reason });
            }
        }
        Ok(())
    }
}

/// Loosest latency SLO a tenant can ask for: 60 s.
pub const LATENCY_SLO_US_MAX: u64 = 60_000_000;

/// Largest IOPS a tenant can ask for (keeps reservations far from overflow).
pub const IOPS_MAX: u64 = 1_000_000_000;

/// Largest device rate scale: four times the profile (a calibrator's ceiling is at most 2).
pub const RATE_SCALE_MAX: f64 = 4.0;

/// "needs X tokens/s, Y left", rounded as people read rates, except when the two round to the
/// same figure (a near miss): then exact, so the refusal never reads "needs 20K, 20K left".
struct NeedsLeft(f64, f64);

impl fmt::Display for NeedsLeft {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (needed, left) = (
            HumanRate(self.0).to_string(),
            HumanCount(self.1).to_string(),
        );
        if needed.trim_end_matches(" tokens/s") == left {
            write!(f, "needs {:.0} tokens/s, {:.0} left", self.0, self.1)
        } else {
            write!(f, "needs {needed}, {left} left")
        }
    }
}

/// A refused registration or an invalid control request. `Display` gives the reason a client
/// sees (e.g. "needs 196K tokens/s, 82K left at 500 µs").
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AdmissionError {
    #[error("{} at {latency_us_p95} µs{}", NeedsLeft(*needed_tokens_per_sec, *left_tokens_per_sec), if *read_only { " (read-only load)" } else { "" })]
    Insufficient {
        needed_tokens_per_sec: f64,
        left_tokens_per_sec: f64,
        latency_us_p95: u64,
        read_only: bool,
    },
    #[error("a best-effort tenant would end read-only admission, but the LC reservations need {} under mixed load and only {} fit at {latency_us_p95} µs", HumanRate(*reserved_tokens_per_sec), HumanRate(*mixed_tokens_per_sec))]
    WouldEndReadOnly {
        reserved_tokens_per_sec: f64,
        mixed_tokens_per_sec: f64,
        latency_us_p95: u64,
    },
    #[error("invalid SLO: {reason}")]
    InvalidSpec { reason: &'static str },
    #[error("a p95 of {latency_us_p95} µs is tighter than the device profile can judge: its tightest measured point is {tightest_us} µs{}", if *headroom_us > 0 { format!(" (after {headroom_us} µs of headroom the device would have to answer in {device_latency_us} µs)") } else { String::new() })]
    TighterThanProfile {
        latency_us_p95: u64,
        device_latency_us: u64,
        headroom_us: u64,
        tightest_us: u64,
    },
    #[error("tenant table full ({tenants_max} tenants)")]
    TooManyTenants { tenants_max: u32 },
    #[error("{0} is not registered")]
    UnknownTenant(TenantId),
    #[error("thread {thread} out of range (the device has {threads} threads)")]
    NoSuchThread { thread: u16, threads: u16 },
    #[error("{tenant} has no connection on thread {thread}")]
    NoConnection { tenant: TenantId, thread: u16 },
}

/// `82K` without a unit.
struct HumanCount(f64);

impl fmt::Display for HumanCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = HumanRate(self.0).to_string();
        write!(f, "{}", text.trim_end_matches(" tokens/s"))
    }
}

/// What the control plane tells a tenant's connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notice {
    /// The tenant keeps exceeding its reservation (it reached its deficit limit); it should
    /// renegotiate its SLO. `episode` counts this tenant's episodes from 1.
    Renegotiate { tenant: TenantId, episode: u64 },
}

/// The current allocation, for operators and tests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Plan {
    /// The strictest LC latency SLO, which sets the device rate; `None` without LC tenants
    /// (then the profile's loosest row applies).
    pub latency_us_p95: Option<u64>,
    pub clamp: Option<Clamp>,
    /// Admission used the read-only column (all LC tenants read-only, no BE tenant).
    pub read_only_admission: bool,
    pub device_tokens_per_sec: RatePerMode,
    /// Σ LC reservations (what admission checks).
    pub lc_reserved_tokens_per_sec: RatePerMode,
    /// What each BE tenant earns; zero without BE tenants.
    pub be_tokens_per_sec_each: RatePerMode,
    /// Spare capacity each LC tenant earns on top of its reservation when there are no BE
    /// tenants with connections.
    pub lc_boost_tokens_per_sec_each: RatePerMode,
    pub lc_tenants: u32,
    /// BE tenants with at least one connection (N_BE).
    pub be_tenants_bound: u32,
    /// The device rate's share of the profile's rate ([`TenantRegistry::set_rate_scale`]).
    pub rate_scale: f64,
    /// The share of donated tokens best-effort tenants may spend
    /// ([`TenantRegistry::set_spare_share`]; 1.0: all, as in the paper).
    pub spare_share: f64,
    /// What LC reservations may take of the device rate, per mode: all of it, or with
    /// self-calibration on, all but the best-effort floor
    /// ([`crate::calibrator::CalibratorConfig::best_effort_floor`]).
    pub lc_budget_tokens_per_sec: [TokenRate; 2],
    /// Σ LC reservations exceed the device rate in the admission mode (only after a
    /// scale-down); the schedulers scale LC reservations down to fit.
    pub overcommitted: bool,
    /// LC tenants that no longer fit ([`TenantRegistry::lc_tenants_over`]).
    pub lc_tenants_over: u32,
}

impl Plan {
    /// The load mode admission judged the plan in: read-only when only reading LC tenants
    /// exist, else mixed.
    pub fn admission_mode(&self) -> LoadMode {
        if self.read_only_admission {
            LoadMode::ReadOnly
        } else {
            LoadMode::Mixed
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    spec: TenantSpec,
    /// Order of admission (kept across re-registrations): who goes over first when the
    /// device rate falls.
    admitted: u64,
    /// Connections per thread.
    connections: Vec<u32>,
    /// Threads that report this tenant at its deficit limit.
    episode_threads: u64,
    episodes: u64,
}

impl Entry {
    fn connections_total(&self) -> u32 {
        self.connections.iter().sum()
    }
}

/// Sums over the registered tenants that admission and the rates depend on, kept up to date
/// with every change so that a change costs O(log tenants), not O(tenants).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Totals {
    lc_reserved: [u64; 2],
    lc_count: u32,
    /// LC tenants that write (read_percent < 100).
    lc_writers: u32,
    be_count: u32,
    /// BE tenants with at least one connection (N_BE).
    be_bound: u32,
    /// LC tenants without a connection, and their reservations.
    lc_unbound: u32,
    lc_unbound_reserved: [u64; 2],
}

impl Totals {
    fn plus(self, other: Totals) -> Totals {
        self.combine(other, |a, b| a + b)
    }

    fn minus(self, other: Totals) -> Totals {
        self.combine(other, |a, b| {
            assert!(a >= b, "tenant totals out of step");
            a - b
        })
    }

    fn combine(self, o: Totals, f: impl Fn(u64, u64) -> u64) -> Totals {
        let g = |a: u32, b: u32| f(u64::from(a), u64::from(b)) as u32;
        Totals {
            lc_reserved: [
                f(self.lc_reserved[0], o.lc_reserved[0]),
                f(self.lc_reserved[1], o.lc_reserved[1]),
            ],
            lc_count: g(self.lc_count, o.lc_count),
            lc_writers: g(self.lc_writers, o.lc_writers),
            be_count: g(self.be_count, o.be_count),
            be_bound: g(self.be_bound, o.be_bound),
            lc_unbound: g(self.lc_unbound, o.lc_unbound),
            lc_unbound_reserved: [
                f(self.lc_unbound_reserved[0], o.lc_unbound_reserved[0]),
                f(self.lc_unbound_reserved[1], o.lc_unbound_reserved[1]),
            ],
        }
    }
}

/// Tenants, admission control and rate computation for one device.
#[derive(Debug)]
pub struct TenantRegistry {
    profile: DeviceProfile,
    costs: CostModel,
    config: QosConfig,
    threads: u16,
    tenants: BTreeMap<TenantId, Entry>,
    totals: Totals,
    /// How many LC tenants have each latency SLO (the first key is the strictest).
    lc_latencies: BTreeMap<u64, u32>,
    free_ids: BTreeSet<u32>,
    next_id: u32,
    /// Admissions so far (the next tenant's `admitted`).
    admissions: u64,
    /// The device rate's share of the profile's rate.
    rate_scale: f64,
    /// [`DeviceRates::spare_share_ppm`] for every thread.
    spare_share_ppm: u32,
    /// LC tenants that no longer fit the scaled rate (empty unless overcommitted).
    over: BTreeSet<TenantId>,
    /// Per mode: Σ of the reservations of the tenants `over`, and the part of it the
    /// schedulers grant them (what the tenants that fit leave of the device rate).
    over_reserved: [u64; 2],
    over_granted: [u64; 2],
    plan: Plan,
    sent_device: Vec<Option<DeviceRates>>,
    sent_tenants: Vec<BTreeMap<TenantId, TenantRates>>,
    outbox: Vec<(u16, RateUpdate)>,
}

impl TenantRegistry {
    /// A registry for a device described by a validated `profile`, served by `threads`
    /// dataplane threads (1 ..= [`THREADS_MAX`]).
    pub fn new(
        profile: DeviceProfile,
        config: QosConfig,
        threads: u16,
    ) -> Result<TenantRegistry, ConfigError> {
        config.validate()?;
        if threads == 0 || usize::from(threads) > THREADS_MAX {
            return Err(ConfigError::Invalid {
                field: "threads",
                reason: "must be between 1 and 64",
            });
        }
        if profile.validate().is_err() {
            return Err(ConfigError::Invalid {
                field: "profile",
                reason: "is not a valid device profile",
            });
        }
        let costs = CostModel::from_profile(&profile);
        let mut registry = TenantRegistry {
            profile,
            costs,
            config,
            threads,
            tenants: BTreeMap::new(),
            totals: Totals::default(),
            lc_latencies: BTreeMap::new(),
            free_ids: BTreeSet::new(),
            next_id: 0,
            admissions: 0,
            rate_scale: 1.0,
            spare_share_ppm: SPARE_SHARE_ALL,
            over: BTreeSet::new(),
            over_reserved: [0; 2],
            over_granted: [0; 2],
            plan: Plan {
                latency_us_p95: None,
                clamp: None,
                read_only_admission: false,
                device_tokens_per_sec: [TokenRate::ZERO; 2],
                lc_reserved_tokens_per_sec: [TokenRate::ZERO; 2],
                be_tokens_per_sec_each: [TokenRate::ZERO; 2],
                lc_boost_tokens_per_sec_each: [TokenRate::ZERO; 2],
                lc_tenants: 0,
                be_tenants_bound: 0,
                rate_scale: 1.0,
                spare_share: 1.0,
                lc_budget_tokens_per_sec: [TokenRate::ZERO; 2],
                overcommitted: false,
                lc_tenants_over: 0,
            },
            sent_device: vec![None; usize::from(threads)],
            sent_tenants: vec![BTreeMap::new(); usize::from(threads)],
            outbox: Vec::new(),
        };
        let plan = registry
            .plan_for(Totals::default(), None, None)
            .map_err(|_| ConfigError::Invalid {
                field: "profile",
                reason: "yields no plan without tenants",
            })?;
        registry.commit(plan, None);
        Ok(registry)
    }

    pub fn costs(&self) -> &CostModel {
        &self.costs
    }

    pub fn profile(&self) -> &DeviceProfile {
        &self.profile
    }

    pub fn config(&self) -> &QosConfig {
        &self.config
    }

    pub fn threads(&self) -> u16 {
        self.threads
    }

    pub fn plan(&self) -> Plan {
        self.plan
    }

    pub fn spec(&self, tenant: TenantId) -> Option<TenantSpec> {
        self.tenants.get(&tenant).map(|entry| entry.spec)
    }

    pub fn tenant_count(&self) -> usize {
        self.tenants.len()
    }

    /// Admits a new tenant or refuses it (leaving nothing behind).
    pub fn register(&mut self, spec: TenantSpec) -> Result<TenantId, AdmissionError> {
        spec.validate()?;
        self.check_judgeable(&spec)?;
        if self.tenants.len() >= self.config.tenants_max as usize {
            return Err(AdmissionError::TooManyTenants {
                tenants_max: self.config.tenants_max,
            });
        }
        let id = TenantId(match self.free_ids.first() {
            Some(&id) => id,
            None => self.next_id,
        });
        assert!(id.0 < self.config.tenants_max, "tenant ids are dense");
        let added = self.contribution(&spec, false);
        let totals = self.totals.plus(added);
        let plan = self.plan_for(totals, Some(&spec), lc_latency(&spec))?;
        if !self.free_ids.remove(&id.0) {
            assert_eq!(id.0, self.next_id, "new ids come from the end");
            self.next_id += 1;
        }
        self.tenants.insert(
            id,
            Entry {
                spec,
                admitted: self.admissions,
                connections: vec![0; usize::from(self.threads)],
                episode_threads: 0,
                episodes: 0,
            },
        );
        self.admissions += 1;
        self.totals = totals;
        latency_add(&mut self.lc_latencies, lc_latency(&spec));
        self.commit(plan, Some(id));
        Ok(id)
    }

    /// Sets the device rate to the profile's rate at the strictest SLO × `scale` (0 < scale ≤
    /// [`RATE_SCALE_MAX`]; 1.0 is the profile), recomputes the plan and queues the rate updates
    /// like any other change. Returns the LC tenants that no longer fit and did before (to be
    /// asked to renegotiate): see the module documentation for who they are and what the
    /// schedulers do meanwhile. A scale-up returns none and may bring tenants back.
    pub fn set_rate_scale(&mut self, scale: f64) -> Result<Vec<TenantId>, ConfigError> {
        if !(scale.is_finite() && scale > 0.0 && scale <= RATE_SCALE_MAX) {
            return Err(ConfigError::Invalid {
                field: "rate_scale",
                reason: "must be above 0 and at most 4",
            });
        }
        let over_before = self.over.clone();
        self.rate_scale = scale;
        self.replan(None);
        assert!(
            (self.plan.rate_scale - scale).abs() < f64::EPSILON,
            "the plan carries the scale"
        );
        Ok(self.over.difference(&over_before).copied().collect())
    }

    /// The device rate's share of the profile's rate.
    pub fn rate_scale(&self) -> f64 {
        self.rate_scale
    }

    /// Sets the share (0 ..= 1) of donated tokens (what LC tenants leave unused, and
    /// reservations nobody serves yet) that reaches the global bucket, where best-effort
    /// tenants spend it; the rest is withheld. Self-calibration lowers it when LC tenants
    /// miss their target at the rate where their reservations just fit
    /// ([`crate::calibrator`]). Admission and every tenant's own rate are unchanged.
    pub fn set_spare_share(&mut self, share: f64) -> Result<(), ConfigError> {
        if !(share.is_finite() && (0.0..=1.0).contains(&share)) {
            return Err(ConfigError::Invalid {
                field: "spare_share",
                reason: "must be between 0 and 1",
            });
        }
        self.spare_share_ppm = (share * f64::from(SPARE_SHARE_ALL)).round() as u32;
        self.replan(None);
        Ok(())
    }

    /// The share of donated tokens best-effort tenants may spend.
    pub fn spare_share(&self) -> f64 {
        self.plan.spare_share
    }

    /// The share of the device rate kept from LC reservations for best-effort tenants: the
    /// calibrator's floor while self-calibration has cut the rate below the profile's, else
    /// none (at the profile's rate, admission promised LC tenants all of it, and best-effort
    /// tenants share what they leave, as in the paper).
    pub fn best_effort_floor(&self) -> f64 {
        if self.config.calibration.enabled && self.rate_scale < 1.0 {
            self.config.calibration.best_effort_floor
        } else {
            0.0
        }
    }

    /// The LC tenants that no longer fit the scaled device rate, in admission order (empty
    /// unless the plan is overcommitted).
    pub fn lc_tenants_over(&self) -> Vec<TenantId> {
        let mut over: Vec<TenantId> = self.over.iter().copied().collect();
        over.sort_by_key(|tenant| self.tenants.get(tenant).map(|entry| entry.admitted));
        over
    }

    /// An LC SLO tighter than the profile's first row cannot be promised: nothing measured
    /// says the device answers that fast at any rate. (A looser one than the last row is met
    /// at the last row's rate, which admission then uses.)
    fn check_judgeable(&self, spec: &TenantSpec) -> Result<(), AdmissionError> {
        let Some(latency_us_p95) = lc_latency(spec) else {
            return Ok(());
        };
        let device_latency_us = self.config.device_latency_us(latency_us_p95);
        let tightest_us = self
            .profile
            .token_limits
            .first()
            .map_or(0, |row| row.latency_us_p95);
        if device_latency_us < tightest_us {
            return Err(AdmissionError::TighterThanProfile {
                latency_us_p95,
                device_latency_us,
                headroom_us: self.config.slo_headroom_us,
                tightest_us,
            });
        }
        Ok(())
    }

    /// Changes a tenant's SLO. Goes through admission again; on refusal the old SLO stays.
    pub fn reregister(&mut self, tenant: TenantId, spec: TenantSpec) -> Result<(), AdmissionError> {
        spec.validate()?;
        self.check_judgeable(&spec)?;
        let entry = self
            .tenants
            .get(&tenant)
            .ok_or(AdmissionError::UnknownTenant(tenant))?;
        let bound = entry.connections_total() > 0;
        let old = entry.spec;
        let totals = self
            .totals
            .minus(self.contribution(&old, bound))
            .plus(self.contribution(&spec, bound));
        let strictest = self.strictest_after(lc_latency(&old), lc_latency(&spec));
        let plan = self.plan_for_latency(totals, Some(&spec), strictest)?;
        if let Some(entry) = self.tenants.get_mut(&tenant) {
            entry.spec = spec;
        }
        self.totals = totals;
        latency_remove(&mut self.lc_latencies, lc_latency(&old));
        latency_add(&mut self.lc_latencies, lc_latency(&spec));
        self.commit(plan, Some(tenant));
        Ok(())
    }

    /// Removes a tenant; its connections on every thread are dropped from the plan.
    pub fn unregister(&mut self, tenant: TenantId) -> Result<(), AdmissionError> {
        let entry = self
            .tenants
            .get(&tenant)
            .ok_or(AdmissionError::UnknownTenant(tenant))?;
        let old = entry.spec;
        let totals = self
            .totals
            .minus(self.contribution(&old, entry.connections_total() > 0));
        let strictest = self.strictest_after(lc_latency(&old), None);
        let plan = self.plan_for_latency(totals, None, strictest)?;
        self.tenants.remove(&tenant);
        self.free_ids.insert(tenant.0);
        self.totals = totals;
        latency_remove(&mut self.lc_latencies, lc_latency(&old));
        self.commit(plan, Some(tenant));
        Ok(())
    }

    /// A connection of `tenant` is now served by `thread`.
    pub fn connect(&mut self, tenant: TenantId, thread: u16) -> Result<(), AdmissionError> {
        self.check_thread(thread)?;
        self.change_connections(tenant, |entry| {
            entry.connections[usize::from(thread)] += 1;
            Ok(())
        })
    }

    /// A connection of `tenant` on `thread` closed.
    pub fn disconnect(&mut self, tenant: TenantId, thread: u16) -> Result<(), AdmissionError> {
        self.check_thread(thread)?;
        self.change_connections(tenant, |entry| {
            let count = &mut entry.connections[usize::from(thread)];
            if *count == 0 {
                return Err(AdmissionError::NoConnection { tenant, thread });
            }
            *count -= 1;
            if *count == 0 {
                entry.episode_threads &= !(1u64 << thread);
            }
            Ok(())
        })
    }

    /// A connection of `tenant` moved from one thread to another (load balancing).
    pub fn move_connection(
        &mut self,
        tenant: TenantId,
        from: u16,
        to: u16,
    ) -> Result<(), AdmissionError> {
        self.check_thread(from)?;
        self.check_thread(to)?;
        self.change_connections(tenant, |entry| {
            let count = &mut entry.connections[usize::from(from)];
            if *count == 0 {
                return Err(AdmissionError::NoConnection {
                    tenant,
                    thread: from,
                });
            }
            *count -= 1;
            if *count == 0 {
                entry.episode_threads &= !(1u64 << from);
            }
            entry.connections[usize::from(to)] += 1;
            Ok(())
        })
    }

    /// Applies a change of `tenant`'s connections; admission is unaffected (a tenant's
    /// reservation counts whether or not it is connected), only shares and N_BE move.
    fn change_connections(
        &mut self,
        tenant: TenantId,
        change: impl FnOnce(&mut Entry) -> Result<(), AdmissionError>,
    ) -> Result<(), AdmissionError> {
        let entry = self
            .tenants
            .get_mut(&tenant)
            .ok_or(AdmissionError::UnknownTenant(tenant))?;
        let bound_before = entry.connections_total() > 0;
        change(entry)?;
        let spec = entry.spec;
        let bound_after = entry.connections_total() > 0;
        if bound_before != bound_after {
            let totals = self
                .totals
                .minus(self.contribution(&spec, bound_before))
                .plus(self.contribution(&spec, bound_after));
            self.totals = totals;
        }
        self.replan(Some(tenant));
        Ok(())
    }

    /// Deficit episodes of `tenant` so far (each brought one [`Notice::Renegotiate`]) and
    /// whether one is going on (some thread reports the tenant at its deficit limit).
    pub fn deficit_episodes(&self, tenant: TenantId) -> Option<(u64, bool)> {
        self.tenants
            .get(&tenant)
            .map(|entry| (entry.episodes, entry.episode_threads != 0))
    }

    /// Connections of `tenant` per thread.
    pub fn connections(&self, tenant: TenantId) -> Option<&[u32]> {
        self.tenants
            .get(&tenant)
            .map(|entry| entry.connections.as_slice())
    }

    /// Rate updates produced since the last call, in the order they must be applied, each
    /// addressed to a thread.
    pub fn take_updates(&mut self) -> Vec<(u16, RateUpdate)> {
        std::mem::take(&mut self.outbox)
    }

    /// Turns a thread's scheduler event into at most one notice per tenant episode.
    pub fn handle_event(&mut self, thread: u16, event: SchedulerEvent) -> Option<Notice> {
        let bit = 1u64 << (u32::from(thread) % 64);
        match event {
            SchedulerEvent::DeficitLimitReached { tenant } => {
                let entry = self.tenants.get_mut(&tenant)?;
                let started = entry.episode_threads == 0;
                entry.episode_threads |= bit;
                if started {
                    entry.episodes += 1;
                    return Some(Notice::Renegotiate {
                        tenant,
                        episode: entry.episodes,
                    });
                }
                None
            }
            SchedulerEvent::DeficitRecovered { tenant } => {
                if let Some(entry) = self.tenants.get_mut(&tenant) {
                    entry.episode_threads &= !bit;
                }
                None
            }
            SchedulerEvent::QueueRoom { .. } => None,
        }
    }

    fn check_thread(&self, thread: u16) -> Result<(), AdmissionError> {
        if thread >= self.threads {
            return Err(AdmissionError::NoSuchThread {
                thread,
                threads: self.threads,
            });
        }
        Ok(())
    }

    /// What one tenant adds to the totals.
    fn contribution(&self, spec: &TenantSpec, bound: bool) -> Totals {
        match *spec {
            TenantSpec::LatencyCritical {
                iops, read_percent, ..
            } => {
                let reserved = [
                    self.costs
                        .reservation(iops, read_percent, LoadMode::Mixed)
                        .0,
                    self.costs
                        .reservation(iops, read_percent, LoadMode::ReadOnly)
                        .0,
                ];
                Totals {
                    lc_reserved: reserved,
                    lc_count: 1,
                    lc_writers: u32::from(read_percent < 100),
                    lc_unbound: u32::from(!bound),
                    lc_unbound_reserved: if bound { [0; 2] } else { reserved },
                    ..Totals::default()
                }
            }
            TenantSpec::BestEffort => Totals {
                be_count: 1,
                be_bound: u32::from(bound),
                ..Totals::default()
            },
        }
    }

    /// The strictest LC SLO after removing one SLO and adding another.
    fn strictest_after(&self, removed: Option<u64>, added: Option<u64>) -> Option<u64> {
        let mut remaining = self.lc_latencies.iter().filter_map(|(&latency, &count)| {
            let count = count - u32::from(removed == Some(latency));
            (count > 0).then_some(latency)
        });
        let first = remaining.next();
        match (first, added) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The plan with `totals` after adding a tenant whose LC SLO is `added_latency`.
    fn plan_for(
        &self,
        totals: Totals,
        candidate: Option<&TenantSpec>,
        added_latency: Option<u64>,
    ) -> Result<Plan, AdmissionError> {
        let strictest = self.strictest_after(None, added_latency);
        self.plan_for_latency(totals, candidate, strictest)
    }

    /// The plan for `totals` at the strictest SLO `strictest`, or the refusal of `candidate`.
    fn plan_for_latency(
        &self,
        totals: Totals,
        candidate: Option<&TenantSpec>,
        strictest: Option<u64>,
    ) -> Result<Plan, AdmissionError> {
        let (rate, clamp) = match strictest {
            Some(latency) => {
                let rate = self.profile.rate_at(self.config.device_latency_us(latency));
                (rate, rate.clamped)
            }
            None => (self.profile.rate_at(u64::MAX), None),
        };
        let device = [
            TokenRate::from_tokens_per_sec_f64(rate.tokens_per_sec * self.rate_scale),
            self.costs
                .read_only_rate(rate.reads_per_sec_read_only * self.rate_scale),
        ];
        let reserved = [
            TokenRate(totals.lc_reserved[0]),
            TokenRate(totals.lc_reserved[1]),
        ];
        // Once self-calibration has cut the rate, best-effort tenants keep a floor of it that
        // LC reservations never take, so that a cut to what LC needs cannot starve them (nor
        // a newcomer, who is best effort until it registers).
        let floor_share = self.best_effort_floor();
        let lc_budget = device.map(|rate| {
            TokenRate(rate.0 - (rate.0 as f64 * floor_share).round().min(rate.0 as f64) as u64)
        });
        let read_only_admission =
            totals.lc_count > 0 && totals.lc_writers == 0 && totals.be_count == 0;
        let admission_mode = if read_only_admission {
            LoadMode::ReadOnly
        } else {
            LoadMode::Mixed
        };
        let m = admission_mode.index();
        let excess = reserved[m].0.saturating_sub(lc_budget[m].0);
        // Overcommitted already (after a scale-down): a change that keeps the mode, does not
        // lower the device rate and does not grow the excess puts nobody new over.
        let current = &self.plan;
        let current_excess = plan_excess(current);
        let keeps_overcommit = current_excess > 0
            && current.read_only_admission == read_only_admission
            && lc_budget[m] >= current.lc_budget_tokens_per_sec[m]
            && excess <= current_excess;
        if excess > 0
            && let Some(candidate) = candidate
            && !keeps_overcommit
        {
            let latency_us_p95 = strictest.unwrap_or(0);
            return Err(match *candidate {
                TenantSpec::BestEffort => AdmissionError::WouldEndReadOnly {
                    reserved_tokens_per_sec: reserved[m].as_tokens_per_sec_f64(),
                    mixed_tokens_per_sec: lc_budget[m].as_tokens_per_sec_f64(),
                    latency_us_p95,
                },
                TenantSpec::LatencyCritical {
                    iops, read_percent, ..
                } => {
                    let needed = self.costs.reservation(iops, read_percent, admission_mode);
                    let others = reserved[m].0.saturating_sub(needed.0);
                    AdmissionError::Insufficient {
                        needed_tokens_per_sec: needed.as_tokens_per_sec_f64(),
                        left_tokens_per_sec: lc_budget[m].0.saturating_sub(others) as f64 / 1e3,
                        latency_us_p95,
                        read_only: read_only_admission,
                    }
                }
            });
        }
        let mut be_each = [TokenRate::ZERO; 2];
        let mut lc_boost = [TokenRate::ZERO; 2];
        for mode in LoadMode::ALL {
            let m = mode.index();
            // LC tenants over the budget share it; the rest (at least the floor) is spare.
            let spare = device[m].0 - reserved[m].0.min(lc_budget[m].0);
            if totals.be_bound > 0 {
                be_each[m] = TokenRate(spare / u64::from(totals.be_bound));
            } else if totals.lc_count > 0 {
                lc_boost[m] = TokenRate(spare / u64::from(totals.lc_count));
            }
        }
        Ok(Plan {
            latency_us_p95: strictest,
            clamp,
            read_only_admission,
            device_tokens_per_sec: device,
            lc_reserved_tokens_per_sec: reserved,
            be_tokens_per_sec_each: be_each,
            lc_boost_tokens_per_sec_each: lc_boost,
            lc_tenants: totals.lc_count,
            be_tenants_bound: totals.be_bound,
            rate_scale: self.rate_scale,
            spare_share: f64::from(self.spare_share_ppm) / f64::from(SPARE_SHARE_ALL),
            lc_budget_tokens_per_sec: lc_budget,
            overcommitted: excess > 0,
            lc_tenants_over: 0,
        })
    }

    /// The LC tenants over the device rate under `plan`: replaying admission in admission
    /// order, the first that does not fit and every one after it. O(LC tenants) only when
    /// overcommitted.
    fn tenants_over(&self, plan: &Plan) -> BTreeSet<TenantId> {
        if !plan.overcommitted {
            return BTreeSet::new();
        }
        let mode = plan.admission_mode();
        let budget = plan.lc_budget_tokens_per_sec[mode.index()].0;
        let mut lc: Vec<(u64, TenantId, u64)> = self
            .tenants
            .iter()
            .filter_map(|(&id, entry)| match entry.spec {
                TenantSpec::LatencyCritical {
                    iops, read_percent, ..
                } => Some((
                    entry.admitted,
                    id,
                    self.costs.reservation(iops, read_percent, mode).0,
                )),
                TenantSpec::BestEffort => None,
            })
            .collect();
        lc.sort_unstable();
        let mut sum = 0u64;
        let mut over = BTreeSet::new();
        for (_, id, reserved) in lc {
            sum = sum.saturating_add(reserved);
            if sum > budget || !over.is_empty() {
                over.insert(id);
            }
        }
        assert!(!over.is_empty(), "an overcommitted plan has a tenant over");
        over
    }

    /// What the tenants `over` are granted under `plan`, per mode: the device rate the
    /// tenants that fit leave, split in proportion to their reservations (never more than
    /// them). The tenants that fit keep their whole reservation.
    fn grant_over(&mut self, plan: &Plan) {
        let mut reserved = [0u64; 2];
        for tenant in &self.over {
            if let Some(entry) = self.tenants.get(tenant) {
                let own = self.contribution(&entry.spec, true).lc_reserved;
                reserved[0] += own[0];
                reserved[1] += own[1];
            }
        }
        self.over_reserved = reserved;
        self.over_granted = [0, 1].map(|m| {
            let fitting = plan.lc_reserved_tokens_per_sec[m].0 - reserved[m];
            plan.lc_budget_tokens_per_sec[m]
                .0
                .saturating_sub(fitting)
                .min(reserved[m])
        });
    }

    /// The part of the tenants over the device rate's reservations they are granted now,
    /// per mode (1.0 when none is over).
    pub fn over_granted_share(&self) -> [f64; 2] {
        [0, 1].map(|m| {
            if self.over_reserved[m] == 0 {
                1.0
            } else {
                self.over_granted[m] as f64 / self.over_reserved[m] as f64
            }
        })
    }

    /// Recomputes the plan for the registered tenants as they stand (a scale, a spare share or
    /// a tenant's connections changed) and commits it.
    fn replan(&mut self, changed: Option<TenantId>) {
        let strictest = self.lc_latencies.keys().next().copied();
        match self.plan_for_latency(self.totals, None, strictest) {
            Ok(plan) => self.commit(plan, changed),
            Err(error) => unreachable_plan(&error),
        }
    }

    /// Adopts `plan` and queues the updates: device rates where they changed (one message per
    /// thread) and the rates of `changed` (the only tenant whose own terms can have moved).
    fn commit(&mut self, plan: Plan, changed: Option<TenantId>) {
        if let (Some(clamp), Some(latency)) = (plan.clamp, plan.latency_us_p95)
            && (self.plan.clamp != plan.clamp || self.plan.latency_us_p95 != plan.latency_us_p95)
        {
            tracing::warn!(
                latency_us_p95 = latency,
                ?clamp,
                "latency SLO outside the device profile's table; using the nearest row"
            );
        }
        let mut plan = plan;
        let over_before = (self.over.clone(), self.over_reserved, self.over_granted);
        if plan.overcommitted || !self.over.is_empty() {
            self.over = self.tenants_over(&plan);
        }
        self.grant_over(&plan);
        plan.lc_tenants_over = self.over.len() as u32;
        if plan.overcommitted && !self.plan.overcommitted {
            tracing::warn!(
                rate_scale = plan.rate_scale,
                lc_tenants_over = plan.lc_tenants_over,
                "LC reservations exceed the scaled device rate"
            );
        }
        self.plan = plan;
        // The tenant's own messages first: a tenant that leaves a thread is retired there
        // before the device rates that no longer count it arrive, and keeps its last rate
        // while its queue drains.
        if let Some(tenant) = changed {
            self.send_tenant(tenant);
        }
        // Tenants that went over, came back, or whose granted share moved get their terms.
        if over_before != (self.over.clone(), self.over_reserved, self.over_granted) {
            let touched: BTreeSet<TenantId> = over_before.0.union(&self.over).copied().collect();
            for tenant in touched {
                if Some(tenant) != changed {
                    self.send_tenant(tenant);
                }
            }
        }
        let granted_total = [0, 1].map(|m| {
            plan.lc_reserved_tokens_per_sec[m].0 - self.over_reserved[m] + self.over_granted[m]
        });
        let threads = usize::from(self.threads);
        // Reservations nobody serves yet (and their share of spare capacity) are donated, by
        // every thread evenly.
        let mut unbound = [0u64; 2];
        for mode in LoadMode::ALL {
            let m = mode.index();
            let sum = TokenRate(granted_total[m]);
            let available = plan.device_tokens_per_sec[m];
            let reserved = TokenRate(self.totals.lc_unbound_reserved[m]);
            let scaled = if sum > available {
                reserved.share(available.0.min(sum.0), sum.0)
            } else {
                reserved
            };
            unbound[m] = scaled.0
                + plan.lc_boost_tokens_per_sec_each[m].0 * u64::from(self.totals.lc_unbound);
        }
        let even = vec![1u32; threads];
        let unbound_shares = [split(unbound[0], &even), split(unbound[1], &even)];
        let max_rate = plan.device_tokens_per_sec[0].max(plan.device_tokens_per_sec[1]);
        let window_ns = u128::from(self.config.bucket_window().0);
        let bucket_max = Tokens((u128::from(max_rate.0) * window_ns / 1_000_000_000) as i64);
        let be_floor_ppm = be_floor_ppm(&plan, self.best_effort_floor(), granted_total);
        let per_thread = unbound_shares[0].iter().zip(&unbound_shares[1]).enumerate();
        for (thread, (&unbound_mixed, &unbound_read_only)) in per_thread {
            let device = DeviceRates {
                costs: self.costs,
                device_tokens_per_sec: plan.device_tokens_per_sec,
                lc_reserved_tokens_per_sec: granted_total.map(TokenRate),
                be_tokens_per_sec_each: plan.be_tokens_per_sec_each,
                lc_boost_tokens_per_sec_each: plan.lc_boost_tokens_per_sec_each,
                unbound_tokens_per_sec: [TokenRate(unbound_mixed), TokenRate(unbound_read_only)],
                bucket_max,
                loan_max: self.config.loan_max(),
                spare_share_ppm: self.spare_share_ppm,
                be_floor_ppm,
            };
            if self.sent_device[thread] != Some(device) {
                self.sent_device[thread] = Some(device);
                self.outbox
                    .push((thread as u16, RateUpdate::Device(device)));
            }
        }
    }

    /// Queues `tenant`'s per-thread terms where they changed, and removals where it left.
    fn send_tenant(&mut self, tenant: TenantId) {
        let threads = usize::from(self.threads);
        let mut wanted: Vec<Option<TenantRates>> = vec![None; threads];
        if let Some(entry) = self.tenants.get(&tenant) {
            let total = entry.connections_total();
            if total > 0 {
                let mut reserved = self.contribution(&entry.spec, true).lc_reserved;
                if self.over.contains(&tenant) {
                    for (m, value) in reserved.iter_mut().enumerate() {
                        *value = share_of(*value, self.over_granted[m], self.over_reserved[m]);
                    }
                }
                let shares = [
                    split(reserved[0], &entry.connections),
                    split(reserved[1], &entry.connections),
                ];
                let reserved_max = TokenRate(reserved[0].max(reserved[1]));
                let limits = split(
                    self.config.deficit_limit_for(reserved_max).0.max(0) as u64,
                    &entry.connections,
                );
                for (thread, &here) in entry.connections.iter().enumerate() {
                    if here > 0 {
                        wanted[thread] = Some(TenantRates {
                            tenant,
                            class: entry.spec.class(),
                            reserved_tokens_per_sec: [
                                TokenRate(shares[0][thread]),
                                TokenRate(shares[1][thread]),
                            ],
                            connections_here: here,
                            connections_total: total,
                            deficit_limit: Tokens(limits[thread] as i64),
                        });
                    }
                }
            }
        }
        for (thread, wanted) in wanted.into_iter().enumerate() {
            let sent = &mut self.sent_tenants[thread];
            match wanted {
                Some(rates) => {
                    if sent.get(&tenant) != Some(&rates) {
                        sent.insert(tenant, rates);
                        self.outbox.push((thread as u16, RateUpdate::Tenant(rates)));
                    }
                }
                None => {
                    if sent.remove(&tenant).is_some() {
                        self.outbox
                            .push((thread as u16, RateUpdate::Remove(tenant)));
                    }
                }
            }
        }
    }
}

/// `value × part / whole` without overflow (`value` when `whole` is 0).
fn share_of(value: u64, part: u64, whole: u64) -> u64 {
    if whole == 0 {
        return value;
    }
    (u128::from(value) * u128::from(part) / u128::from(whole)) as u64
}

/// The best-effort floor's part of what best-effort tenants earn (the device rate less what
/// LC tenants are granted), in parts per million for [`DeviceRates::be_floor_ppm`], while LC
/// reservations are cut (the plan overcommitted): then the LC tenants over send beyond their
/// grant and borrow whenever the bucket lets them, for good, and repaying them from the floor
/// would starve best effort. Otherwise none: LC tenants whose reservations fit borrow for a
/// burst and repay it, and lending them best effort's tokens for it is the paper's priority
/// (Figure 5 scenario 1's B, sending exactly its reservation, needs those loans at the line).
fn be_floor_ppm(plan: &Plan, floor_share: f64, lc_granted: [u64; 2]) -> u32 {
    if floor_share <= 0.0 || !plan.overcommitted {
        return 0;
    }
    let m = plan.admission_mode().index();
    let device = plan.device_tokens_per_sec[m].0 as f64;
    let best_effort = device - lc_granted[m] as f64;
    if best_effort <= 0.0 {
        return SPARE_SHARE_ALL;
    }
    let share = (device * floor_share / best_effort).min(1.0);
    (share * f64::from(SPARE_SHARE_ALL)).round() as u32
}

/// How far Σ LC reservations exceed the device rate in `plan`'s admission mode (0: they fit).
fn plan_excess(plan: &Plan) -> u64 {
    let m = plan.admission_mode().index();
    plan.lc_reserved_tokens_per_sec[m]
        .0
        .saturating_sub(plan.lc_budget_tokens_per_sec[m].0)
}

fn lc_latency(spec: &TenantSpec) -> Option<u64> {
    match *spec {
        TenantSpec::LatencyCritical { latency_us_p95, .. } => Some(latency_us_p95),
        TenantSpec::BestEffort => None,
    }
}

fn latency_add(latencies: &mut BTreeMap<u64, u32>, latency: Option<u64>) {
    if let Some(latency) = latency {
        *latencies.entry(latency).or_insert(0) += 1;
    }
}

fn latency_remove(latencies: &mut BTreeMap<u64, u32>, latency: Option<u64>) {
    if let Some(latency) = latency {
        let count = latencies.get_mut(&latency);
        assert!(count.is_some(), "removing an SLO that is not registered");
        if let Some(count) = count {
            *count -= 1;
            if *count == 0 {
                latencies.remove(&latency);
            }
        }
    }
}

/// Splits `amount` in proportion to `weights`, rounding down, with the remainder on the
/// largest weight (the first of equals), so the parts sum to `amount` exactly.
fn split(amount: u64, weights: &[u32]) -> Vec<u64> {
    let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    if total == 0 {
        return vec![0; weights.len()];
    }
    let mut parts: Vec<u64> = weights
        .iter()
        .map(|&w| (u128::from(amount) * u128::from(w) / u128::from(total)) as u64)
        .collect();
    let given: u64 = parts.iter().sum();
    let largest = weights
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))
        .map_or(0, |(index, _)| index);
    parts[largest] += amount - given;
    parts
}

fn unreachable_plan(error: &AdmissionError) {
    // Without a candidate a plan is never refused: connections only move shares, and a scale
    // change may overcommit the device but is not admission.
    panic!("a change without a candidate was refused: {error}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::TokenLimit;

    /// Device A of the paper: 420K tokens/s at 500 µs, 570K at 2 ms; ~1M read-only IOPS.
    pub(crate) fn device_a() -> DeviceProfile {
        DeviceProfile {
            name: "paper-device-a".into(),
            write_cost: 10.0,
            read_only_read_cost: 0.5,
            token_limits: vec![
                TokenLimit {
                    latency_us_p95: 500,
                    tokens_per_sec: 420_000.0,
                    reads_per_sec_read_only: 850_000.0,
                },
                TokenLimit {
                    latency_us_p95: 1000,
                    tokens_per_sec: 500_000.0,
                    reads_per_sec_read_only: 950_000.0,
                },
                TokenLimit {
                    latency_us_p95: 2000,
                    tokens_per_sec: 570_000.0,
                    reads_per_sec_read_only: 1_000_000.0,
                },
            ],
        }
    }

    fn registry(threads: u16) -> TenantRegistry {
        TenantRegistry::new(device_a(), QosConfig::default(), threads).unwrap()
    }

    fn lc(latency_us_p95: u64, iops: u64, read_percent: u8) -> TenantSpec {
        TenantSpec::LatencyCritical {
            latency_us_p95,
            iops,
            read_percent,
        }
    }

    #[test]
    fn admits_what_fits_and_refuses_with_the_numbers() {
        let mut r = registry(1);
        let a = r.register(lc(500, 120_000, 100)).unwrap();
        let c = r.register(TenantSpec::BestEffort).unwrap();
        assert_eq!(
            r.plan().lc_reserved_tokens_per_sec[0],
            TokenRate::from_tokens_per_sec(120_000)
        );
        // B (196K) fits: 120K + 196K = 316K <= 420K.
        let b = r.register(lc(500, 70_000, 80)).unwrap();
        assert_ne!(a, b);
        assert_ne!(b, c);
        // Another B does not: 104K left.
        let before = r.plan();
        let updates_before = r.take_updates().len();
        assert!(updates_before > 0);
        let error = r.register(lc(500, 70_000, 80)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "needs 196K tokens/s, 104K left at 500 µs"
        );
        // Nothing left behind: same plan, no updates, the id is reused by the next tenant.
        assert_eq!(r.plan(), before);
        assert!(r.take_updates().is_empty());
        assert_eq!(r.tenant_count(), 3);
        let d = r.register(TenantSpec::BestEffort).unwrap();
        assert_eq!(d, TenantId(3));
    }

    #[test]
    fn the_strictest_slo_sets_the_rate_and_removal_relaxes_it() {
        let mut r = registry(1);
        let loose = r.register(lc(2000, 20_000, 90)).unwrap();
        assert_eq!(
            r.plan().device_tokens_per_sec[0],
            TokenRate::from_tokens_per_sec(570_000)
        );
        let strict = r.register(lc(750, 10_000, 100)).unwrap();
        // Interpolated half way between 500 µs (420K) and 1 ms (500K).
        assert_eq!(
            r.plan().device_tokens_per_sec[0],
            TokenRate::from_tokens_per_sec(460_000)
        );
        assert_eq!(r.plan().clamp, None);
        r.unregister(strict).unwrap();
        assert_eq!(
            r.plan().device_tokens_per_sec[0],
            TokenRate::from_tokens_per_sec(570_000)
        );
        // Stricter than the table: nothing measured says the device can; refused, with the
        // numbers, and nothing changes (issue 9 item 5).
        let before = r.plan();
        let error = r.register(lc(100, 1_000, 100)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "a p95 of 100 µs is tighter than the device profile can judge: its tightest measured point is 500 µs"
        );
        assert_eq!(r.plan(), before);
        assert!(matches!(
            r.register(lc(1, 1_000, 100)),
            Err(AdmissionError::TighterThanProfile { .. })
        ));
        // Absurdly loose: not a latency objective.
        assert!(matches!(
            r.register(lc(u64::from(u32::MAX), 1_000, 100)),
            Err(AdmissionError::InvalidSpec { .. })
        ));
        r.unregister(loose).unwrap();
        assert!(r.unregister(loose).is_err());
    }

    #[test]
    fn reregistering_goes_through_admission_again() {
        let mut r = registry(1);
        let a = r.register(lc(2000, 100_000, 100)).unwrap();
        let b = r.register(lc(2000, 20_000, 90)).unwrap();
        // Tightening B's SLO to 500 µs lowers the rate to 420K; 100K + 38K fits.
        r.reregister(b, lc(500, 20_000, 90)).unwrap();
        assert_eq!(r.plan().latency_us_p95, Some(500));
        // Asking A for 400K IOPS at 500 µs does not fit (438K > 420K); A keeps its old SLO.
        let error = r.reregister(a, lc(500, 400_000, 100)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "needs 400K tokens/s, 382K left at 500 µs"
        );
        assert!(
            matches!(error, AdmissionError::Insufficient { .. }),
            "{error}"
        );
        assert_eq!(r.spec(a), Some(lc(2000, 100_000, 100)));
    }

    #[test]
    fn read_only_tenants_use_the_read_only_column_until_a_best_effort_tenant_comes() {
        let mut r = registry(1);
        // 600K read-only IOPS at 500 µs: 300K read-only tokens of 425K; would not fit mixed.
        let a = r.register(lc(500, 600_000, 100)).unwrap();
        assert!(r.plan().read_only_admission);
        let error = r.register(TenantSpec::BestEffort).unwrap_err();
        assert!(
            matches!(error, AdmissionError::WouldEndReadOnly { .. }),
            "{error}"
        );
        let error = r.register(lc(500, 1_000, 99)).unwrap_err();
        assert!(
            matches!(error, AdmissionError::Insufficient { .. }),
            "{error}"
        );
        r.reregister(a, lc(500, 300_000, 100)).unwrap();
        r.register(TenantSpec::BestEffort).unwrap();
        assert!(!r.plan().read_only_admission);
    }

    /// What the threads know after applying every update so far, like the schedulers do.
    #[derive(Default)]
    struct View {
        device: BTreeMap<u16, DeviceRates>,
        tenants: BTreeMap<(u16, TenantId), TenantRates>,
    }

    impl View {
        fn apply(&mut self, updates: Vec<(u16, RateUpdate)>) {
            for (thread, update) in updates {
                match update {
                    RateUpdate::Device(device) => {
                        self.device.insert(thread, device);
                    }
                    RateUpdate::Tenant(rates) => {
                        self.tenants.insert((thread, rates.tenant), rates);
                    }
                    RateUpdate::Remove(id) => {
                        self.tenants.remove(&(thread, id));
                    }
                }
            }
        }

        /// The tenant's mixed-load rate on `thread`, in millitokens per second (0 if absent).
        fn rate(&self, thread: u16, tenant: TenantId) -> u64 {
            self.tenants.get(&(thread, tenant)).map_or(0, |rates| {
                crate::rates::effective_rates(&self.device[&thread], rates)[0].0
            })
        }

        fn has(&self, thread: u16, tenant: TenantId) -> bool {
            self.tenants.contains_key(&(thread, tenant))
        }
    }

    #[test]
    fn a_tenant_on_several_threads_is_charged_once() {
        let mut r = registry(3);
        let mut view = View::default();
        let a = r.register(lc(500, 70_000, 80)).unwrap();
        let c = r.register(TenantSpec::BestEffort).unwrap();
        for thread in [0, 1, 1, 2] {
            r.connect(a, thread).unwrap();
        }
        r.connect(c, 2).unwrap();
        view.apply(r.take_updates());
        let share = |view: &View, thread: u16| view.rate(thread, a);
        assert_eq!(
            share(&view, 0) + share(&view, 1) + share(&view, 2),
            196_000_000
        );
        assert_eq!(share(&view, 1), 98_000_000);
        // BE gets everything else once: 420K - 196K.
        assert_eq!(view.rate(2, c), 224_000_000);
        // The deficit limit is split the same way.
        let limits: i64 = (0..3).map(|t| view.tenants[&(t, a)].deficit_limit.0).sum();
        assert_eq!(limits, Tokens::from_tokens(50).0);
        // Admission counted 196K once: 224K is left, so a 220K tenant fits.
        r.register(lc(500, 220_000, 100)).unwrap();
        // Moving a connection rebalances; closing all on a thread removes the tenant there.
        r.move_connection(a, 0, 1).unwrap();
        view.apply(r.take_updates());
        assert!(!view.has(0, a));
        assert_eq!(share(&view, 1) + share(&view, 2), 196_000_000);
        assert_eq!(r.connections(a), Some(&[0, 3, 1][..]));
        assert!(r.disconnect(a, 0).is_err());
        assert!(r.connect(a, 3).is_err());
        assert!(r.move_connection(a, 0, 1).is_err());
        // Unregistering removes it everywhere.
        r.unregister(a).unwrap();
        view.apply(r.take_updates());
        assert!(!view.has(1, a) && !view.has(2, a));
    }

    #[test]
    fn without_best_effort_tenants_spare_capacity_goes_to_lc() {
        let mut r = registry(1);
        let mut view = View::default();
        let a = r.register(lc(500, 120_000, 100)).unwrap();
        let b = r.register(lc(500, 70_000, 80)).unwrap();
        r.connect(a, 0).unwrap();
        r.connect(b, 0).unwrap();
        view.apply(r.take_updates());
        // Spare 104K split evenly: 52K each.
        assert_eq!(view.rate(0, a), 172_000_000);
        assert_eq!(view.rate(0, b), 248_000_000);
        // A BE tenant with a connection takes the spare capacity over; only the device
        // message and the new tenant's need to be sent for that.
        let c = r.register(TenantSpec::BestEffort).unwrap();
        r.connect(c, 0).unwrap();
        let updates = r.take_updates();
        assert!(
            updates.len() <= 3,
            "{} updates for one BE tenant: {updates:?}",
            updates.len()
        );
        view.apply(updates);
        assert_eq!(view.rate(0, a), 120_000_000);
        assert_eq!(view.rate(0, c), 104_000_000);
    }

    #[test]
    fn unbound_reservations_are_donated_by_the_threads() {
        let mut r = registry(2);
        let mut view = View::default();
        let a = r.register(lc(500, 100_000, 100)).unwrap();
        let c = r.register(TenantSpec::BestEffort).unwrap();
        r.connect(c, 0).unwrap();
        view.apply(r.take_updates());
        let unbound: u64 = (0..2)
            .map(|t| view.device[&t].unbound_tokens_per_sec[0].0)
            .sum();
        assert_eq!(unbound, 100_000_000);
        r.connect(a, 1).unwrap();
        view.apply(r.take_updates());
        assert_eq!(view.device[&0].unbound_tokens_per_sec[0].0, 0);
        assert_eq!(view.rate(1, a), 100_000_000);
    }

    #[test]
    fn one_notice_per_episode_across_threads() {
        let mut r = registry(2);
        let a = r.register(lc(500, 1_000, 100)).unwrap();
        r.connect(a, 0).unwrap();
        r.connect(a, 1).unwrap();
        let hit = SchedulerEvent::DeficitLimitReached { tenant: a };
        let ok = SchedulerEvent::DeficitRecovered { tenant: a };
        assert_eq!(
            r.handle_event(0, hit),
            Some(Notice::Renegotiate {
                tenant: a,
                episode: 1
            })
        );
        assert_eq!(r.handle_event(1, hit), None);
        assert_eq!(r.handle_event(0, ok), None);
        assert_eq!(
            r.handle_event(0, hit),
            None,
            "thread 1 still in the episode"
        );
        assert_eq!(r.handle_event(0, ok), None);
        assert_eq!(r.handle_event(1, ok), None);
        assert_eq!(
            r.handle_event(1, hit),
            Some(Notice::Renegotiate {
                tenant: a,
                episode: 2
            })
        );
    }

    #[test]
    fn the_slo_headroom_reads_the_profile_at_a_stricter_device_latency() {
        let config = QosConfig {
            slo_headroom_us: 250,
            ..QosConfig::default()
        };
        let mut r = TenantRegistry::new(device_a(), config, 1).unwrap();
        // A 1 ms SLO at the client leaves 750 µs for the device: half way between the
        // 500 µs (420K) and 1 ms (500K) rows, as a 750 µs SLO without headroom.
        r.register(lc(1000, 10_000, 100)).unwrap();
        assert_eq!(
            r.plan().device_tokens_per_sec[0],
            TokenRate::from_tokens_per_sec(460_000)
        );
        assert_eq!(
            r.plan().latency_us_p95,
            Some(1000),
            "the plan keeps the client SLO"
        );
    }

    #[test]
    fn invalid_specs_and_full_tables_are_refused() {
        let config = QosConfig {
            tenants_max: 2,
            ..QosConfig::default()
        };
        let mut r = TenantRegistry::new(device_a(), config, 1).unwrap();
        assert!(matches!(
            r.register(lc(500, 0, 100)),
            Err(AdmissionError::InvalidSpec { .. })
        ));
        assert!(matches!(
            r.register(lc(500, 10, 101)),
            Err(AdmissionError::InvalidSpec { .. })
        ));
        r.register(TenantSpec::BestEffort).unwrap();
        r.register(TenantSpec::BestEffort).unwrap();
        assert_eq!(
            r.register(TenantSpec::BestEffort),
            Err(AdmissionError::TooManyTenants { tenants_max: 2 })
        );
    }

    /// With self-calibration on, once a cut has taken the rate below the profile's,
    /// best-effort tenants keep a floor of it: LC admission leaves it, and a cut into LC
    /// reservations still leaves it to them (the LC tenants over share the rest). At the
    /// profile's rate LC tenants may reserve all of it, as without calibration.
    #[test]
    fn with_calibration_on_best_effort_keeps_its_floor_through_a_cut() {
        let mut config = QosConfig::default();
        config.calibration.enabled = true;
        config.calibration.best_effort_floor = 0.1;
        let mut r = TenantRegistry::new(device_a(), config, 1).unwrap();
        let mut view = View::default();
        assert_eq!(r.best_effort_floor(), 0.0, "no floor at the profile's rate");
        // 420K at 500 µs, all of it for LC: A and B take it.
        let c = r.register(TenantSpec::BestEffort).unwrap();
        let a = r.register(lc(500, 120_000, 100)).unwrap();
        let b = r.register(lc(500, 300_000, 100)).unwrap();
        for tenant in [a, b, c] {
            r.connect(tenant, 0).unwrap();
        }
        view.apply(r.take_updates());
        assert!(!r.plan().overcommitted);
        assert_eq!(view.rate(0, c), 0, "nothing is left");
        assert_eq!(
            view.device[&0].be_floor_ppm, 0,
            "no floor: loans repaid as in the paper"
        );
        // 90 % (378K): LC may take 340.2K of it, C keeps 37.8K; B is over and gets what A
        // leaves of the budget.
        assert_eq!(r.set_rate_scale(0.9), Ok(vec![b]));
        assert_eq!(r.best_effort_floor(), 0.1);
        view.apply(r.take_updates());
        let plan = r.plan();
        assert!(plan.overcommitted);
        assert_eq!(
            plan.lc_budget_tokens_per_sec[0],
            TokenRate::from_tokens_per_sec(340_200)
        );
        assert_eq!(view.rate(0, c), 37_800_000);
        assert_eq!(view.rate(0, b), 220_200_000);
        // C earns the floor and nothing more: none of it repays LC tenants' loans.
        assert_eq!(view.device[&0].be_floor_ppm, 1_000_000);
        // While cut, admission leaves the floor too.
        r.reregister(b, lc(500, 200_000, 100)).unwrap();
        // A and B now reserve 320K of 378K and fit: C earns 58K, and the loans of bursts
        // are repaid from all of it again.
        view.apply(r.take_updates());
        assert!(!r.plan().overcommitted);
        assert_eq!(view.device[&0].be_floor_ppm, 0);
        let error = r.register(lc(500, 30_000, 100)).unwrap_err();
        assert_eq!(error.to_string(), "needs 30K tokens/s, 20K left at 500 µs");
        // A near miss reads exactly.
        let error = r.register(lc(500, 20_500, 100)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "needs 20500 tokens/s, 20200 left at 500 µs"
        );
        // Half the rate (210K): B is over again and gets what A leaves of the 189K budget;
        // C keeps its 21K floor.
        assert_eq!(r.set_rate_scale(0.5), Ok(vec![b]));
        view.apply(r.take_updates());
        assert!(r.plan().overcommitted);
        assert_eq!(view.rate(0, c), 21_000_000);
        assert_eq!(view.rate(0, a), 120_000_000);
        assert_eq!(view.rate(0, b), 69_000_000);
        assert_eq!(view.device[&0].be_floor_ppm, 1_000_000);
        // A newcomer, best effort, is still admitted while the plan is overcommitted.
        let d = r.register(TenantSpec::BestEffort).unwrap();
        r.connect(d, 0).unwrap();
        view.apply(r.take_updates());
        assert_eq!(view.rate(0, d), 10_500_000);
        // Without calibration there is no floor.
        let r = registry(1);
        assert_eq!(r.best_effort_floor(), 0.0);
    }

    /// Issue 11 item 2: the calibrator's scale reaches the plan and the threads, BE tenants
    /// lose their share first, and the LC tenants that no longer fit are named, latest
    /// admitted first, once each.
    #[test]
    fn a_scale_down_lowers_the_device_rate_and_names_the_lc_tenants_that_no_longer_fit() {
        // Calibration off: no best-effort floor (set_rate_scale from elsewhere, as the paper's
        // control plane would).
        let mut config = QosConfig::default();
        config.calibration.enabled = false;
        let mut r = TenantRegistry::new(device_a(), config, 2).unwrap();
        let mut view = View::default();
        let a = r.register(lc(500, 120_000, 100)).unwrap();
        let b = r.register(lc(500, 70_000, 80)).unwrap();
        let c = r.register(TenantSpec::BestEffort).unwrap();
        r.connect(a, 0).unwrap();
        r.connect(b, 1).unwrap();
        r.connect(c, 0).unwrap();
        view.apply(r.take_updates());
        assert_eq!(view.rate(0, c), 104_000_000);

        // 90 %: 378K still holds A and B (316K); BE gets the rest. One message per thread.
        assert_eq!(r.set_rate_scale(0.9), Ok(vec![]));
        let updates = r.take_updates();
        assert_eq!(updates.len(), 2, "{updates:?}");
        assert!(
            updates
                .iter()
                .all(|(_, update)| matches!(update, RateUpdate::Device(_)))
        );
        view.apply(updates);
        let plan = r.plan();
        assert_eq!(plan.rate_scale, 0.9);
        assert_eq!(
            plan.device_tokens_per_sec[0],
            TokenRate::from_tokens_per_sec(378_000)
        );
        assert!(!plan.overcommitted);
        assert_eq!(view.rate(0, c), 62_000_000);
        assert_eq!(view.rate(0, a), 120_000_000);

        // 50 %: 210K. A (admitted first) fits, B does not: B is named once. BE gets nothing;
        // A keeps its whole reservation and B gets what A leaves (90K of its 196K).
        assert_eq!(r.set_rate_scale(0.5), Ok(vec![b]));
        view.apply(r.take_updates());
        let plan = r.plan();
        assert!(plan.overcommitted);
        assert_eq!(plan.lc_tenants_over, 1);
        assert_eq!(r.lc_tenants_over(), vec![b]);
        assert_eq!(view.rate(0, c), 0);
        assert_eq!(view.rate(0, a), 120_000_000);
        assert_eq!(view.rate(1, b), 90_000_000);
        assert_eq!(r.over_granted_share()[0], 90.0 / 196.0);
        assert_eq!(r.set_rate_scale(0.5), Ok(vec![]), "named once");
        assert_eq!(
            r.spec(b),
            Some(lc(500, 70_000, 80)),
            "the reservation is kept"
        );

        // Meanwhile admission uses the scaled rate: no new LC tenant; BE tenants still come.
        let error = r.register(lc(500, 1_000, 100)).unwrap_err();
        assert_eq!(error.to_string(), "needs 1K tokens/s, 0 left at 500 µs");
        let d = r.register(TenantSpec::BestEffort).unwrap();
        r.connect(d, 1).unwrap();
        r.disconnect(d, 1).unwrap();
        // B renegotiates to what fits (84K: 204K of 210K) and is no longer over.
        r.reregister(b, lc(500, 30_000, 80)).unwrap();
        assert!(!r.plan().overcommitted);
        assert_eq!(r.lc_tenants_over(), vec![]);

        // Down to 40 % (168K): B over again; 25 % (105K): A too; the list is in admission order.
        assert_eq!(r.set_rate_scale(0.4), Ok(vec![b]));
        assert_eq!(r.set_rate_scale(0.25), Ok(vec![a]));
        assert_eq!(r.lc_tenants_over(), vec![a, b]);
        // Back to the profile: everyone fits and BE gets its share again.
        assert_eq!(r.set_rate_scale(1.0), Ok(vec![]));
        view.apply(r.take_updates());
        assert_eq!(r.lc_tenants_over(), vec![]);
        assert_eq!(
            view.rate(0, c),
            420_000_000 - 204_000_000,
            "D has no connection"
        );

        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 4.5] {
            assert!(
                matches!(
                    r.set_rate_scale(bad),
                    Err(ConfigError::Invalid {
                        field: "rate_scale",
                        ..
                    })
                ),
                "{bad}"
            );
        }
        assert_eq!(r.rate_scale(), 1.0);
    }

    #[test]
    fn while_overcommitted_a_change_may_not_lower_the_rate_or_grow_the_excess() {
        let mut r = registry(1);
        let a = r.register(lc(1000, 200_000, 100)).unwrap();
        let b = r.register(lc(1000, 200_000, 100)).unwrap();
        r.register(TenantSpec::BestEffort).unwrap();
        // 60 % of 500K at 1 ms = 300K for 400K of reservations.
        assert_eq!(r.set_rate_scale(0.6), Ok(vec![b]));
        // B asks for less but at a tighter SLO: 150K at 500 µs lowers the device rate to
        // 252K; refused although the excess would shrink by 2K (it could put A over).
        let error = r.reregister(b, lc(500, 150_000, 100)).unwrap_err();
        assert!(
            matches!(error, AdmissionError::Insufficient { .. }),
            "{error}"
        );
        assert_eq!(r.spec(b), Some(lc(1000, 200_000, 100)));
        // Less at the same SLO is fine, and so are connections and unregistering.
        r.reregister(b, lc(1000, 150_000, 100)).unwrap();
        assert_eq!(r.lc_tenants_over(), vec![b]);
        r.connect(a, 0).unwrap();
        r.connect(b, 0).unwrap();
        r.disconnect(b, 0).unwrap();
        r.unregister(b).unwrap();
        assert!(!r.plan().overcommitted);
        assert_eq!(r.lc_tenants_over(), vec![]);
    }

    #[test]
    fn the_scale_applies_to_the_read_only_column_too() {
        let mut r = registry(1);
        r.register(lc(500, 600_000, 100)).unwrap();
        assert!(r.plan().read_only_admission);
        let read_only_before = r.plan().device_tokens_per_sec[1];
        // Read-only column: 850K reads/s × 0.5 = 425K for 600K reads × 0.5 = 300K. At 80 %
        // (340K) the tenant still fits; at 60 % (255K) it does not.
        assert_eq!(r.set_rate_scale(0.8), Ok(vec![]));
        assert_eq!(
            r.plan().device_tokens_per_sec[1].0,
            read_only_before.0 * 8 / 10
        );
        assert_eq!(r.set_rate_scale(0.6).map(|over| over.len()), Ok(1));
        assert!(r.plan().read_only_admission);
    }

    #[test]
    fn split_sums_exactly() {
        assert_eq!(split(10, &[1, 1, 1]), vec![4, 3, 3]);
        assert_eq!(split(10, &[0, 2, 1]), vec![0, 7, 3]);
        assert_eq!(split(10, &[0, 0]), vec![0, 0]);
    }
}
