//! The simulation engine: virtual time, several dataplane threads running the real
//! `reflex_qos` structures (one `Scheduler` per thread sharing one `DeviceShared`, rates from a
//! real `TenantRegistry`), open- and closed-loop clients, and a device behind [`SimDevice`].
//!
//! Determinism: one event heap ordered by (time, sequence number); at each instant the device
//! completions are handled first, then due events (arrivals, timer wake-ups), then one
//! scheduling round for every thread that had something happen, in thread order. Every random
//! choice comes from generators seeded from the scenario seed, so a seed replays a run exactly.
//!
//! A thread runs a round when a request arrives on it, when one of its requests completes, or
//! when its scheduler's `next_deadline` passes, which is how the dataplane drives it.
//! Latency is measured from the moment a request was due at the client (open loop: its Poisson
//! arrival time, even if the client window held it back) to its device completion, so there is
//! no coordinated omission.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use hdrhistogram::Histogram;
use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_qos::{
    DeviceProfile, DeviceShared, EnqueueError, IoKind, Nanos, Notice, Policy, QosConfig, Request,
    Scheduler, SchedulerEvent, TenantClass, TenantId, TenantRegistry, TenantSpec, Tokens,
};

use crate::device::{SimDevice, SimDone, SimIo};
use crate::report::{PointReport, TenantReport};

/// Requests a client holds back beyond its window before it sheds arrivals (bounds memory when
/// a tenant offers far more than it gets).
pub const CLIENT_BACKLOG_MAX: usize = 1 << 16;

/// Rounds one instant may trigger on a thread (a round releases queue room, which lets the
/// thread read more requests, which may need another round); a bound, not a tuning knob.
const ROUNDS_PER_INSTANT_MAX: u32 = 64;

/// How a simulated tenant's clients send.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Load {
    /// Poisson arrivals at `iops`; at most `window` requests in flight.
    Open { iops: u64, window: u32 },
    /// Always `depth` requests in flight.
    Closed { depth: u32 },
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
}

/// Everything one run needs.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    pub threads: u16,
    pub policy: Policy,
    pub profile: DeviceProfile,
    pub qos: QosConfig,
    pub warmup: Nanos,
    pub duration: Nanos,
    pub tenants: Vec<SimTenant>,
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid configuration: {0}")]
    Config(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival { tenant: u32 },
    Wake { thread: u16 },
    WarmupEnd,
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    tenant: u32,
    thread: u16,
    kind: IoKind,
    offset: u64,
    due: Nanos,
    /// When the scheduler handed it to the device.
    submitted: Nanos,
}

struct ThreadState {
    scheduler: Scheduler,
    dirty: bool,
    wake_at: Option<Nanos>,
    /// Requests the scheduler refused (tenant queue full), per tenant index, oldest first:
    /// the connection stopped reading them.
    held: Vec<VecDeque<u64>>,
}

struct TenantState {
    sim: SimTenant,
    id: Option<TenantId>,
    rng: Xoshiro256PlusPlus,
    next_connection: usize,
    in_flight: u32,
    backlog: VecDeque<Nanos>,
    shed: u64,
    read_latency_ns: Histogram<u64>,
    /// Reads: from due to submission (client window, scheduler queue).
    read_wait_ns: Histogram<u64>,
    completed_in_window: u64,
    arrivals_in_window: u64,
    tokens_at_warmup: Tokens,
    notices: u64,
}

/// Runs one simulation and reports per tenant.
pub fn run(config: &SimConfig, device: Box<dyn SimDevice>) -> Result<PointReport, SimError> {
    let mut sim = Sim::new(config, device)?;
    sim.start();
    sim.run_until_end();
    Ok(sim.report())
}

struct Sim<'c> {
    config: &'c SimConfig,
    now: Nanos,
    warmup_end: Nanos,
    end: Nanos,
    device: Box<dyn SimDevice>,
    shared: Arc<DeviceShared>,
    registry: TenantRegistry,
    threads: Vec<ThreadState>,
    tenants: Vec<TenantState>,
    refusals: Vec<String>,
    in_flight: Vec<Option<InFlight>>,
    free_tags: Vec<u64>,
    heap: BinaryHeap<Reverse<(Nanos, u64, Event)>>,
    sequence: u64,
    offsets: Xoshiro256PlusPlus,
    done: Vec<SimDone>,
    tenant_by_id: Vec<Option<u32>>,
    tokens_total_at_warmup: Tokens,
}

impl<'c> Sim<'c> {
    fn new(config: &'c SimConfig, device: Box<dyn SimDevice>) -> Result<Sim<'c>, SimError> {
        let mut registry =
            TenantRegistry::new(config.profile.clone(), config.qos.clone(), config.threads)
                .map_err(|e| SimError::Config(e.to_string()))?;
        let shared = Arc::new(DeviceShared::new(config.qos.read_only_window()));
        let mut threads = Vec::with_capacity(usize::from(config.threads));
        for thread in 0..config.threads {
            let scheduler = Scheduler::new(
                shared.clone(),
                thread,
                &config.qos,
                config.policy,
                Nanos::ZERO,
            )
            .map_err(|e| SimError::Config(e.to_string()))?;
            threads.push(ThreadState {
                scheduler,
                dirty: false,
                wake_at: None,
                held: vec![VecDeque::new(); config.tenants.len()],
            });
        }
        let mut tenants = Vec::with_capacity(config.tenants.len());
        let mut refusals = Vec::new();
        let mut tenant_by_id = Vec::new();
        for (index, sim) in config.tenants.iter().enumerate() {
            if sim.connections.is_empty() {
                return Err(SimError::Config(format!(
                    "tenant {} has no connection",
                    sim.name
                )));
            }
            let id = match registry.register(sim.spec) {
                Ok(id) => {
                    for &thread in &sim.connections {
                        registry
                            .connect(id, thread)
                            .map_err(|e| SimError::Config(format!("{}: {e}", sim.name)))?;
                    }
                    if tenant_by_id.len() <= id.0 as usize {
                        tenant_by_id.resize(id.0 as usize + 1, None);
                    }
                    tenant_by_id[id.0 as usize] = Some(index as u32);
                    Some(id)
                }
                Err(refusal) => {
                    refusals.push(format!("{}: {refusal}", sim.name));
                    None
                }
            };
            tenants.push(TenantState {
                sim: sim.clone(),
                id,
                rng: Xoshiro256PlusPlus::seed_from_u64(
                    config.seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                ),
                next_connection: 0,
                in_flight: 0,
                backlog: VecDeque::new(),
                shed: 0,
                read_latency_ns: Histogram::new_with_bounds(1_000, 60_000_000_000, 3)
                    .map_err(|e| SimError::Config(e.to_string()))?,
                read_wait_ns: Histogram::new_with_bounds(1_000, 60_000_000_000, 3)
                    .map_err(|e| SimError::Config(e.to_string()))?,
                completed_in_window: 0,
                arrivals_in_window: 0,
                tokens_at_warmup: Tokens::ZERO,
                notices: 0,
            });
        }
        for (thread, update) in registry.take_updates() {
            threads[usize::from(thread)]
                .scheduler
                .apply(update, Nanos::ZERO);
        }
        Ok(Sim {
            config,
            now: Nanos::ZERO,
            warmup_end: config.warmup,
            end: config.warmup + config.duration,
            device,
            shared,
            registry,
            threads,
            tenants,
            refusals,
            in_flight: Vec::new(),
            free_tags: Vec::new(),
            heap: BinaryHeap::new(),
            sequence: 0,
            offsets: Xoshiro256PlusPlus::seed_from_u64(config.seed.wrapping_add(0x5EED)),
            done: Vec::new(),
            tenant_by_id,
            tokens_total_at_warmup: Tokens::ZERO,
        })
    }

    fn push(&mut self, at: Nanos, event: Event) {
        self.sequence += 1;
        self.heap.push(Reverse((at, self.sequence, event)));
    }

    fn start(&mut self) {
        self.push(self.warmup_end, Event::WarmupEnd);
        for index in 0..self.tenants.len() {
            if self.tenants[index].id.is_none() {
                continue;
            }
            match self.tenants[index].sim.load {
                Load::Open { iops, .. } => {
                    let gap = exponential(&mut self.tenants[index].rng, iops);
                    self.push(
                        Nanos(gap),
                        Event::Arrival {
                            tenant: index as u32,
                        },
                    );
                }
                Load::Closed { depth } => {
                    for _ in 0..depth {
                        self.send(index, Nanos::ZERO);
                    }
                }
            }
        }
        self.run_rounds();
    }

    fn run_until_end(&mut self) {
        loop {
            let next_event = self.heap.peek().map(|Reverse((at, _, _))| *at);
            let next = match (next_event, self.device.next_event()) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => break,
            };
            if next > self.end {
                break;
            }
            assert!(
                next >= self.now,
                "virtual time went back: {next:?} < {:?}",
                self.now
            );
            self.now = next;
            self.device_completions();
            while let Some(&Reverse((at, _, event))) = self.heap.peek() {
                if at > self.now {
                    break;
                }
                self.heap.pop();
                self.handle(event);
            }
            self.run_rounds();
        }
        self.now = self.end;
        for thread in &self.threads {
            thread.scheduler.check();
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Arrival { tenant } => {
                let index = tenant as usize;
                if let Load::Open { iops, .. } = self.tenants[index].sim.load {
                    let gap = exponential(&mut self.tenants[index].rng, iops);
                    self.push(self.now + Nanos(gap), Event::Arrival { tenant });
                }
                if self.now >= self.warmup_end {
                    self.tenants[index].arrivals_in_window += 1;
                }
                self.send(index, self.now);
            }
            Event::Wake { thread } => {
                let state = &mut self.threads[usize::from(thread)];
                if state.wake_at == Some(self.now) {
                    state.wake_at = None;
                    state.dirty = true;
                }
            }
            Event::WarmupEnd => {
                let mut total = Tokens::ZERO;
                for index in 0..self.tenants.len() {
                    let tokens = self.tokens_used(index);
                    self.tenants[index].tokens_at_warmup = tokens;
                    total += tokens;
                }
                self.tokens_total_at_warmup = total;
            }
        }
    }

    /// A client sends a request that was due at `due`, if its window allows.
    fn send(&mut self, index: usize, due: Nanos) {
        let tenant = &mut self.tenants[index];
        let window = match tenant.sim.load {
            Load::Open { window, .. } => window,
            Load::Closed { depth } => depth,
        };
        if tenant.in_flight >= window {
            if tenant.backlog.len() >= CLIENT_BACKLOG_MAX {
                tenant.shed += 1;
            } else {
                tenant.backlog.push_back(due);
            }
            return;
        }
        let Some(id) = tenant.id else {
            return;
        };
        tenant.in_flight += 1;
        let connection = tenant.next_connection % tenant.sim.connections.len();
        tenant.next_connection = tenant.next_connection.wrapping_add(1);
        let thread = tenant.sim.connections[connection];
        let kind = if tenant.rng.next_u64() % 100 < u64::from(tenant.sim.read_percent) {
            IoKind::Read
        } else {
            IoKind::Write
        };
        let size = tenant.sim.size_bytes;
        let blocks = (self.device.capacity_bytes() / u64::from(size)).max(1);
        let offset = (self.offsets.next_u64() % blocks) * u64::from(size);
        let flight = InFlight {
            tenant: index as u32,
            thread,
            kind,
            offset,
            due,
            submitted: Nanos::MAX,
        };
        let tag = match self.free_tags.pop() {
            Some(tag) => {
                self.in_flight[tag as usize] = Some(flight);
                tag
            }
            None => {
                self.in_flight.push(Some(flight));
                self.in_flight.len() as u64 - 1
            }
        };
        let state = &mut self.threads[usize::from(thread)];
        if !state.held[index].is_empty() {
            // The connection is not being read: the request waits behind the held ones.
            state.held[index].push_back(tag);
            return;
        }
        let request = Request {
            token: tag,
            size_bytes: size,
            kind,
        };
        match state.scheduler.enqueue(id, request, self.now) {
            Ok(()) => state.dirty = true,
            Err(EnqueueError::TenantQueueFull { .. } | EnqueueError::ThreadQueueFull { .. }) => {
                state.held[index].push_back(tag);
            }
            Err(error) => panic!("simulated dataplane sent an invalid request: {error}"),
        }
    }

    fn device_completions(&mut self) {
        let mut done = std::mem::take(&mut self.done);
        done.clear();
        self.device.advance(self.now, &mut done);
        for completion in &done {
            self.complete(*completion);
        }
        self.done = done;
    }

    fn complete(&mut self, done: SimDone) {
        let Some(flight) = self.in_flight[done.tag as usize].take() else {
            panic!("device completed unknown tag {}", done.tag);
        };
        self.free_tags.push(done.tag);
        self.threads[usize::from(flight.thread)].dirty = true;
        let index = flight.tenant as usize;
        let tenant = &mut self.tenants[index];
        tenant.in_flight -= 1;
        let in_window = done.completed_at >= self.warmup_end && done.completed_at <= self.end;
        if in_window {
            tenant.completed_in_window += 1;
        }
        if flight.kind == IoKind::Read && flight.due >= self.warmup_end {
            let latency = done.completed_at.saturating_since(flight.due).0.max(1_000);
            tenant.read_latency_ns.saturating_record(latency);
            let wait = flight.submitted.saturating_since(flight.due).0.max(1_000);
            tenant.read_wait_ns.saturating_record(wait);
        }
        match tenant.sim.load {
            Load::Closed { .. } => self.send(index, self.now),
            Load::Open { .. } => {
                if let Some(due) = tenant.backlog.pop_front() {
                    self.send(index, due);
                }
            }
        }
    }

    fn run_rounds(&mut self) {
        for _ in 0..ROUNDS_PER_INSTANT_MAX {
            let mut any = false;
            for thread in 0..self.threads.len() {
                if !self.threads[thread].dirty {
                    continue;
                }
                any = true;
                self.round(thread);
            }
            if !any {
                return;
            }
        }
    }

    fn round(&mut self, thread: usize) {
        let now = self.now;
        let state = &mut self.threads[thread];
        state.dirty = false;
        let device = &mut self.device;
        let in_flight = &mut self.in_flight;
        state.scheduler.schedule(now, &mut |admitted| {
            let Some(flight) = in_flight[admitted.token as usize].as_mut() else {
                panic!("scheduler admitted unknown token {}", admitted.token);
            };
            let accepted = device.submit(
                now,
                SimIo {
                    tag: admitted.token,
                    kind: admitted.kind,
                    offset: flight.offset,
                    len: admitted.size_bytes,
                    queue: thread as u16,
                },
            );
            if accepted {
                flight.submitted = now;
            }
            accepted
        });
        while let Some(event) = self.threads[thread].scheduler.poll_event() {
            match event {
                SchedulerEvent::QueueRoom { tenant } => self.resume(thread, tenant),
                SchedulerEvent::DeficitLimitReached { tenant }
                | SchedulerEvent::DeficitRecovered { tenant } => {
                    if let Some(Notice::Renegotiate { .. }) =
                        self.registry.handle_event(thread as u16, event)
                        && let Some(Some(index)) = self.tenant_by_id.get(tenant.0 as usize)
                    {
                        self.tenants[*index as usize].notices += 1;
                    }
                }
            }
        }
        let wake = self.threads[thread].scheduler.next_deadline();
        if let Some(at) = wake {
            let at = at.max(now);
            if self.threads[thread].wake_at != Some(at) {
                self.threads[thread].wake_at = Some(at);
                self.push(
                    at,
                    Event::Wake {
                        thread: thread as u16,
                    },
                );
            }
        }
    }

    /// The scheduler has room for `tenant` again: read its held requests.
    fn resume(&mut self, thread: usize, tenant: TenantId) {
        let Some(Some(index)) = self.tenant_by_id.get(tenant.0 as usize).copied() else {
            return;
        };
        let index = index as usize;
        let state = &mut self.threads[thread];
        while let Some(&tag) = state.held[index].front() {
            let Some(flight) = self.in_flight[tag as usize] else {
                panic!("held request {tag} is not in flight");
            };
            let request = Request {
                token: tag,
                size_bytes: self.tenants[index].sim.size_bytes,
                kind: flight.kind,
            };
            match state.scheduler.enqueue(tenant, request, self.now) {
                Ok(()) => {
                    state.held[index].pop_front();
                    state.dirty = true;
                }
                Err(_) => break,
            }
        }
    }

    fn tokens_used(&self, index: usize) -> Tokens {
        let Some(id) = self.tenants[index].id else {
            return Tokens::ZERO;
        };
        self.threads
            .iter()
            .filter_map(|thread| thread.scheduler.tenant_stats(id))
            .map(|stats| stats.submitted_tokens)
            .fold(Tokens::ZERO, |a, b| a + b)
    }

    fn report(&self) -> PointReport {
        let seconds = self.config.duration.as_secs_f64();
        let plan = self.registry.plan();
        let mut tenants = Vec::new();
        let mut tokens_total = Tokens::ZERO;
        for (index, tenant) in self.tenants.iter().enumerate() {
            let tokens = self.tokens_used(index) - tenant.tokens_at_warmup;
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
            let p95 = if reads > 0 {
                hist.value_at_quantile(0.95) as f64 / 1e3
            } else {
                0.0
            };
            let p99 = if reads > 0 {
                hist.value_at_quantile(0.99) as f64 / 1e3
            } else {
                0.0
            };
            let wait_p95 = if reads > 0 {
                tenant.read_wait_ns.value_at_quantile(0.95) as f64 / 1e3
            } else {
                0.0
            };
            let iops = tenant.completed_in_window as f64 / seconds;
            let arrived_iops = offered_iops.map(|_| tenant.arrivals_in_window as f64 / seconds);
            let slo_met = latency_us_p95.map(|slo| {
                let latency_ok = reads == 0 || p95 <= slo as f64;
                // Against what actually arrived: a Poisson source's count over a short window
                // differs from its nominal rate by more than 1 %.
                let iops_ok = arrived_iops.is_none_or(|arrived| iops >= 0.99 * arrived);
                tenant.id.is_some() && latency_ok && iops_ok
            });
            tenants.push(TenantReport {
                name: tenant.sim.name.clone(),
                class,
                admitted: tenant.id.is_some(),
                latency_us_p95,
                reserved_iops,
                offered_iops,
                arrived_iops,
                iops,
                reads,
                read_p95_us: p95,
                read_p99_us: p99,
                read_wait_p95_us: wait_p95,
                tokens_per_sec: tokens.as_tokens_f64() / seconds,
                slo_met,
                notices: tenant.notices,
                shed: tenant.shed,
                backlog: tenant.backlog.len() as u64,
            });
        }
        let bucket = self.shared.stats();
        let (to_bucket, from_bucket) =
            self.threads
                .iter()
                .fold((Tokens::ZERO, Tokens::ZERO), |(to, from), thread| {
                    let ledger = thread.scheduler.ledger();
                    (to + ledger.to_bucket, from + ledger.from_bucket)
                });
        assert_eq!(
            to_bucket - from_bucket - bucket.discarded,
            bucket.balance,
            "global bucket conservation"
        );
        PointReport {
            threads: self.config.threads,
            qos: self.config.policy == Policy::Tokens,
            seed: self.config.seed,
            duration_ms: self.config.duration.0 / 1_000_000,
            latency_us_p95: plan.latency_us_p95,
            device_tokens_per_sec: plan.device_tokens_per_sec[0].as_tokens_per_sec_f64(),
            tokens_used_per_sec: tokens_total.as_tokens_f64() / seconds,
            tenants,
            refusals: self.refusals.clone(),
        }
    }
}

/// An exponentially distributed gap in nanoseconds for a Poisson process at `rate_per_sec`.
fn exponential(rng: &mut Xoshiro256PlusPlus, rate_per_sec: u64) -> u64 {
    assert!(rate_per_sec > 0, "Poisson rate zero");
    // Uniform in (0, 1]: never ln(0).
    let uniform = ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
    let gap_ns = -uniform.ln() * 1e9 / rate_per_sec as f64;
    (gap_ns.round() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_gaps_average_to_the_rate() {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(7);
        let n = 200_000;
        let total: u64 = (0..n).map(|_| exponential(&mut rng, 100_000)).sum();
        let mean_ns = total as f64 / n as f64;
        assert!((mean_ns - 10_000.0).abs() < 100.0, "{mean_ns}");
    }
}
