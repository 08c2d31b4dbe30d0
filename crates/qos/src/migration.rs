//! Inter-core migration (OctoFAS §4.3.1, Algorithm 2; the hybrid of §4.3.3, Algorithm 4):
//! best-effort requests of an overloaded dataplane thread are served by the device queue of
//! an underloaded one, round robin, until both sit at the mean load U_avg.
//!
//! Why: each thread has its own fairness stage ([`crate::FairQueue`]) and its own share of the
//! device (`be_device_depth_max` places). Flows whose connections landed on one thread compete
//! for that thread's places while another thread's places stand empty; no order inside one
//! stage can fix that (`docs/FAIRNESS.md`, "Two dataplane threads").
//!
//! # Load and utilisation
//! The load of a thread is the time-averaged number of best-effort requests **homed** there
//! (its connections' requests) between admission and device completion, wherever they are
//! served: by Little's law, the sum of their latencies in a window over the window's length.
//! Its utilisation U = load / capacity, capacity being the thread's `be_device_depth_max`.
//! Unlike OctoFAS's CPU utilisation U may exceed 1: requests wait in the stage. Counting
//! requests where they are homed, not where they are served, keeps the plan steady: migrating
//! does not change the loads the next plan is made from (migrating would otherwise flatten
//! the loads, stop itself and restart one window later).
//!
//! # The plan (Algorithm 2 on numbers)
//! [`plan`] takes every thread's load and capacity; LB = min U / max U, U_avg the mean. Unless
//! `requires_imbalance` is set and LB ≥ T_LB (`load_balance_threshold`, Algorithm 1's flag),
//! it moves load one request at a time: sources (U > U_avg + margin) in thread order, each to
//! the next destination (U < U_avg − margin) in round-robin order from where it left off; a
//! destination is skipped once one more request would take it above U_avg, a source stops once
//! one more would take it below U_avg, and no pair gets more than `in_transit_per_pair_max`.
//! The result is a quota per (source, destination): how many of the source's requests may be
//! at the destination at once. Every thread computes the same plan from the same loads.
//!
//! # One thread's side ([`Migrator`])
//! A source migrates a request of an eligible flow (`flows`: dense only, sparse only, or all,
//! by the monitor's class: OctoFAS Figure 7) to the next destination round robin that is below
//! its quota; each completion handed back frees that place. A request that finds no place
//! stays home (back-pressure, never loss). The quota is also the credit that bounds the
//! queues between two threads: at most `in_transit_per_pair_max` requests of a pair are ever
//! in its queues, so a queue of that capacity is never full.
//!
//! Sans-IO: loads come in as numbers; nothing here reads a clock or touches another thread,
//! except [`MigrationBoard`], where threads publish their loads (atomics).

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::config::THREADS_MAX;
use crate::fairness::{Density, FairnessConfigError};

/// Which flows' requests may migrate (OctoFAS Figure 7: Inter(dense), Inter(sparse), All).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationFlows {
    /// The flows the monitor classes dense (the paper's choice for fairness).
    #[default]
    Dense,
    /// The flows the monitor classes sparse.
    Sparse,
    /// Every best-effort flow (the most throughput in the paper).
    All,
}

/// `[qos_config.fairness.migration]`: inter-core migration; off by default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MigrationConfig {
    pub enabled: bool,
    /// Whose requests move.
    pub flows: MigrationFlows,
    /// Algorithm 1: plan moves only while the load balance LB is below the monitor's
    /// `load_balance_threshold`; false: whenever a thread is above U_avg + `utilisation_margin`.
    pub requires_imbalance: bool,
    /// A thread is a source above U_avg + margin and a destination below U_avg − margin.
    pub utilisation_margin: f64,
    /// Most requests of one (source, destination) pair at the destination at once: the credit
    /// that bounds the queues between two threads (their capacity).
    pub in_transit_per_pair_max: u32,
}

/// Largest `in_transit_per_pair_max` (the queues between threads are allocated at start).
pub const IN_TRANSIT_PER_PAIR_LIMIT: u32 = 4096;

impl Default for MigrationConfig {
    fn default() -> MigrationConfig {
        MigrationConfig {
            enabled: false,
            flows: MigrationFlows::Dense,
            requires_imbalance: true,
            utilisation_margin: 0.0,
            in_transit_per_pair_max: 64,
        }
    }
}

impl MigrationConfig {
    pub fn validate(&self) -> Result<(), FairnessConfigError> {
        let invalid = |field, reason| Err(FairnessConfigError { field, reason });
        if !(self.utilisation_margin.is_finite() && self.utilisation_margin >= 0.0) {
            return invalid("migration.utilisation_margin", "must be 0 or more");
        }
        if self.in_transit_per_pair_max == 0
            || self.in_transit_per_pair_max > IN_TRANSIT_PER_PAIR_LIMIT
        {
            return invalid(
                "migration.in_transit_per_pair_max",
                "must be between 1 and 4096",
            );
        }
        Ok(())
    }

    /// Whether a request of a flow of `density` may migrate.
    pub fn eligible(&self, density: Density) -> bool {
        match self.flows {
            MigrationFlows::Dense => density == Density::Dense,
            MigrationFlows::Sparse => density == Density::Sparse,
            MigrationFlows::All => true,
        }
    }
}

/// One thread's load over the last window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThreadLoad {
    /// Time-averaged best-effort requests homed on the thread (admitted, not yet completed).
    pub load: f64,
    /// Its places at the device (`be_device_depth_max`).
    pub capacity: u32,
}

/// The moves Algorithm 2 plans from one set of loads.
#[derive(Clone, Debug, PartialEq)]
pub struct MigrationPlan {
    threads: usize,
    /// Row-major (source, destination): requests of the source that may be at the
    /// destination at once.
    quota: Vec<u32>,
    pub utilisation: Vec<f64>,
    pub utilisation_mean: f64,
    /// LB = min U / max U (1.0 with fewer than two threads or all idle).
    pub load_balance: f64,
    pub imbalanced: bool,
}

impl MigrationPlan {
    /// A plan that moves nothing.
    pub fn none(threads: usize) -> MigrationPlan {
        MigrationPlan {
            threads,
            quota: vec![0; threads * threads],
            utilisation: vec![0.0; threads],
            utilisation_mean: 0.0,
            load_balance: 1.0,
            imbalanced: false,
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn quota(&self, source: usize, destination: usize) -> u32 {
        self.quota[source * self.threads + destination]
    }

    /// Requests planned away from `source`, over all destinations.
    pub fn moved_from(&self, source: usize) -> u32 {
        (0..self.threads).map(|d| self.quota(source, d)).sum()
    }

    /// Requests planned onto `destination`, over all sources.
    pub fn moved_to(&self, destination: usize) -> u32 {
        (0..self.threads).map(|s| self.quota(s, destination)).sum()
    }
}

/// Tolerance of the float comparisons with U_avg (a thread landing exactly on it counts as
/// there).
const EPSILON: f64 = 1e-9;

/// Algorithm 2 on the loads of every thread (index = thread). See the module documentation.
pub fn plan(
    config: &MigrationConfig,
    load_balance_threshold: f64,
    loads: &[ThreadLoad],
) -> MigrationPlan {
    let threads = loads.len();
    let mut plan = MigrationPlan::none(threads);
    let utilisation: Vec<f64> = loads
        .iter()
        .map(|t| {
            assert!(t.capacity > 0, "a thread without places at the device");
            assert!(t.load.is_finite() && t.load >= 0.0, "load {}", t.load);
            t.load / f64::from(t.capacity)
        })
        .collect();
    if threads == 0 {
        return plan;
    }
    let mean = utilisation.iter().sum::<f64>() / threads as f64;
    let (low, high) = utilisation
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &u| {
            (lo.min(u), hi.max(u))
        });
    let load_balance = if threads < 2 || high <= 0.0 {
        1.0
    } else {
        low / high
    };
    plan.utilisation_mean = mean;
    plan.load_balance = load_balance;
    plan.imbalanced = threads >= 2 && load_balance < load_balance_threshold;
    plan.utilisation = utilisation.clone();
    if !config.enabled || threads < 2 || (config.requires_imbalance && !plan.imbalanced) {
        return plan;
    }
    let margin = config.utilisation_margin;
    let sources: Vec<usize> = (0..threads)
        .filter(|&t| utilisation[t] > mean + margin + EPSILON)
        .collect();
    let destinations: Vec<usize> = (0..threads)
        .filter(|&t| utilisation[t] < mean - margin - EPSILON)
        .collect();
    if sources.is_empty() || destinations.is_empty() {
        return plan;
    }
    let step = |t: usize| 1.0 / f64::from(loads[t].capacity);
    let mut estimate = utilisation;
    // Each source's Core_temp: where its round robin over the destinations goes on.
    let mut cursor = vec![0usize; threads];
    loop {
        let mut moved = false;
        for &source in &sources {
            if estimate[source] - step(source) < mean - EPSILON {
                continue; // One more would take it below U_avg: paused.
            }
            let count = destinations.len();
            let found = (0..count)
                .map(|offset| (cursor[source] + offset) % count)
                .find(|&position| {
                    let destination = destinations[position];
                    estimate[destination] + step(destination) <= mean + EPSILON
                        && plan.quota(source, destination) < config.in_transit_per_pair_max
                });
            let Some(position) = found else {
                continue; // Every destination is at U_avg (or this pair at its credit).
            };
            let destination = destinations[position];
            plan.quota[source * threads + destination] += 1;
            estimate[source] -= step(source);
            estimate[destination] += step(destination);
            cursor[source] = (position + 1) % count;
            moved = true;
        }
        if !moved {
            break;
        }
    }
    plan
}

/// One thread's side of migration: the quota of its row of the plan, the requests it has at
/// each destination, and the round robin. Pure; the dataplane asks it for a destination when
/// a best-effort request is admitted and tells it when one comes back.
#[derive(Clone, Debug)]
pub struct Migrator {
    config: MigrationConfig,
    thread_index: usize,
    /// Per destination: requests this thread may have there, and has there.
    quota: Vec<u32>,
    in_transit: Vec<u32>,
    /// Per source: requests of that thread being served here (for checks and metrics).
    served: Vec<u32>,
    cursor: usize,
    stats: MigratorStats,
}

/// Counters for tests and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MigratorStats {
    /// Requests sent to another thread.
    pub migrated_total: u64,
    /// Requests that came back (completed) from another thread.
    pub returned_total: u64,
    /// Eligible requests that stayed home because every destination was at its quota.
    pub stayed_home_total: u64,
    /// Requests of other threads served here.
    pub served_total: u64,
    pub plans: u64,
}

impl Migrator {
    /// Thread `thread_index`'s side; sized for [`THREADS_MAX`] threads, as the device's
    /// threads are known only once each has joined the [`MigrationBoard`].
    pub fn new(config: &MigrationConfig, thread_index: usize) -> Migrator {
        assert!(thread_index < THREADS_MAX, "thread {thread_index}");
        let threads = THREADS_MAX;
        Migrator {
            config: config.clone(),
            thread_index,
            quota: vec![0; threads],
            in_transit: vec![0; threads],
            served: vec![0; threads],
            cursor: 0,
            stats: MigratorStats::default(),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.config.enabled
    }

    pub fn config(&self) -> &MigrationConfig {
        &self.config
    }

    pub fn stats(&self) -> MigratorStats {
        self.stats
    }

    /// This thread's requests at each destination now.
    pub fn in_transit(&self, destination: usize) -> u32 {
        self.in_transit[destination]
    }

    /// This thread's requests at other threads, in all.
    pub fn in_transit_total(&self) -> u32 {
        self.in_transit.iter().sum()
    }

    /// Requests of `source` served here now.
    pub fn served(&self, source: usize) -> u32 {
        self.served[source]
    }

    pub fn quota(&self, destination: usize) -> u32 {
        self.quota[destination]
    }

    /// Takes this thread's row of a new plan. A destination whose quota fell keeps what it
    /// has until those requests come back; it gets no more meanwhile.
    pub fn set_plan(&mut self, plan: &MigrationPlan) {
        assert!(
            plan.threads() <= self.quota.len(),
            "a plan for other threads"
        );
        let planned = self.thread_index < plan.threads();
        for (destination, quota) in self.quota.iter_mut().enumerate() {
            *quota = if planned && destination < plan.threads() {
                plan.quota(self.thread_index, destination)
            } else {
                0
            };
        }
        assert_eq!(
            self.quota[self.thread_index], 0,
            "a plan to migrate to itself"
        );
        self.stats.plans += 1;
    }

    /// Where an admitted request of a flow of `density` goes: `Some(destination)` (its place
    /// there is taken now; report its return with [`Migrator::returned`]) or `None` (it stays
    /// home: not eligible, or every destination is at its quota).
    pub fn pick_destination(&mut self, density: Density) -> Option<usize> {
        if !self.config.enabled || !self.config.eligible(density) {
            return None;
        }
        let threads = self.quota.len();
        let found = (0..threads)
            .map(|offset| (self.cursor + offset) % threads)
            .find(|&d| self.in_transit[d] < self.quota[d]);
        let Some(destination) = found else {
            if self.quota.iter().any(|&q| q > 0) {
                self.stats.stayed_home_total += 1;
            }
            return None;
        };
        assert_ne!(destination, self.thread_index);
        assert!(self.in_transit[destination] < self.config.in_transit_per_pair_max);
        self.in_transit[destination] += 1;
        self.cursor = (destination + 1) % threads;
        self.stats.migrated_total += 1;
        Some(destination)
    }

    /// A request this thread sent to `destination` came back (completed there).
    pub fn returned(&mut self, destination: usize) {
        assert!(
            self.in_transit[destination] > 0,
            "a return from thread {destination} with nothing there"
        );
        self.in_transit[destination] -= 1;
        self.stats.returned_total += 1;
    }

    /// A request of thread `source` arrived to be served here.
    pub fn arrived(&mut self, source: usize) {
        assert_ne!(source, self.thread_index, "a request migrated to its home");
        assert!(
            self.served[source] < self.config.in_transit_per_pair_max,
            "thread {source} sent more than its credit"
        );
        self.served[source] += 1;
        self.stats.served_total += 1;
    }

    /// A request of `source` served here completed and goes back.
    pub fn served_done(&mut self, source: usize) {
        assert!(self.served[source] > 0, "a completion for thread {source}");
        self.served[source] -= 1;
    }
}

/// Where the threads of one device publish their loads for each other's plans: one slot per
/// thread (f64 bits), and which threads take part. Atomics only.
#[derive(Debug)]
pub struct MigrationBoard {
    loads: Box<[AtomicU64]>,
    capacities: Box<[AtomicU64]>,
    /// Bit t: thread t publishes here.
    members: AtomicU64,
}

const _: () = assert!(THREADS_MAX <= 64, "members is a 64-bit mask");

impl Default for MigrationBoard {
    fn default() -> MigrationBoard {
        MigrationBoard {
            loads: (0..THREADS_MAX).map(|_| AtomicU64::new(0)).collect(),
            capacities: (0..THREADS_MAX).map(|_| AtomicU64::new(0)).collect(),
            members: AtomicU64::new(0),
        }
    }
}

impl MigrationBoard {
    /// Thread `thread` takes part with `capacity` places (load 0 until it publishes).
    pub fn join(&self, thread: usize, capacity: u32) {
        assert!(thread < THREADS_MAX);
        assert!(capacity > 0);
        self.capacities[thread].store(u64::from(capacity), Ordering::Relaxed);
        self.loads[thread].store(0f64.to_bits(), Ordering::Relaxed);
        self.members.fetch_or(1 << thread, Ordering::Release);
    }

    pub fn publish(&self, thread: usize, load: f64) {
        assert!(load.is_finite() && load >= 0.0);
        self.loads[thread].store(load.to_bits(), Ordering::Relaxed);
    }

    /// Threads 0..n that take part (n: one above the highest member; the members must be
    /// 0..n, as dataplane threads are).
    pub fn threads(&self) -> usize {
        let members = self.members.load(Ordering::Acquire);
        (64 - members.leading_zeros()) as usize
    }

    /// Every member's last load (a thread that has not joined counts as idle, capacity 1).
    pub fn loads(&self, out: &mut Vec<ThreadLoad>) {
        out.clear();
        for thread in 0..self.threads() {
            out.push(ThreadLoad {
                load: f64::from_bits(self.loads[thread].load(Ordering::Relaxed)),
                capacity: (self.capacities[thread].load(Ordering::Relaxed) as u32).max(1),
            });
        }
    }
}

#[cfg(test)]
mod tests;
