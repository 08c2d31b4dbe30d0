//! The intra-core fairness stage (OctoFAS §4.4.3, Algorithm 3; issue 14): a queue in front of
//! the device for best-effort and untenanted requests that the token scheduler has admitted.
//!
//! Why it exists: a device's internal queues are FIFO across flows, so once every request is
//! at the device nothing can reorder them, and a flow with k requests in flight gets about
//! k / (k + others) of the device whatever the other flows' needs. The stage keeps at most
//! `be_device_depth_max` of its requests at the device; the rest wait here, and the mode picks
//! which flow's request goes next when one completes:
//! - `fifo`: arrival order (the stage only caps depth);
//! - `backwarding`: Algorithm 3: the head request of a dense flow (the monitor's class) lets up
//!   to B requests of sparse flows go before it, B fixed (`backwardings`) or the monitor's
//!   eq. 5 figure;
//! - `fewest_in_flight`: the flow with the fewest requests at the device goes next (ties: the
//!   oldest request), so backlogged flows share the device's slots equally and a sparse flow
//!   rarely waits behind a dense one; needs no monitor and no warm-up;
//! - `fair_share`: as `fewest_in_flight`, but each present flow (one with requests here or
//!   at the device, or that completed one in this or the last monitor window) may have at
//!   most its share, ⌈`be_device_depth_max` / present flows⌉, at the device: a flow below its
//!   share finds a place free when its next request comes, at the price of places a light
//!   flow leaves unused.
//!
//! Latency-critical requests never enter the stage (the integrator sends them to the device at
//! once), so the stage cannot touch an SLO. Each flow is a FIFO and only heads are picked: a
//! connection's requests leave in the order they came. Sans-IO: time comes in as `now`.
//!
//! # API (one stage per dataplane thread per device)
//! - [`FairQueue::new`]`(&FairQueueConfig, now)`;
//! - [`FairQueue::hold`]`(flow, token)` for an admitted BE request; `Err(FairQueueFull)`:
//!   stop admitting (the token scheduler keeps the request);
//! - [`FairQueue::poll_release`] until `None`: each returned token goes to the device;
//! - [`FairQueue::completed`]`(flow, latency_ns, now)` when a released request's device
//!   operation finishes (this frees its place at the device and feeds the monitor);
//! - [`FairQueue::withdraw`]`(flow, now)` for a released request that was not sent after all;
//! - [`FairQueue::handle_timeout`]`(now)`: closes the monitor's window when due;
//! - [`FairQueue::cancel_held`] hands back every held token (shutdown).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::fairness::{
    CoreSample, Density, FairnessConfig, FairnessConfigError, FairnessMonitor, FairnessReport,
    FairnessWindow, FlowId, FlowSample,
};
use crate::migration::MigrationConfig;

mod adaptive;
use crate::rates::TenantClass;
use crate::time::Nanos;
pub use adaptive::{AdaptiveDepth, AdaptiveDepthConfig, DepthStep};

/// Most flows one stage tracks (tenant ids beyond are refused, like the scheduler's).
pub const FAIR_FLOWS_MAX: u32 = 1 << 16;

/// How the stage picks the next request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FairMode {
    /// No stage: admitted requests go to the device at once (ReFlex's behaviour).
    #[default]
    Off,
    /// Depth cap only; arrival order.
    Fifo,
    /// OctoFAS Algorithm 3: dense flows' heads are moved back B places behind sparse ones.
    Backwarding,
    /// The flow with the fewest requests at the device first.
    FewestInFlight,
    /// Fewest in flight first, each flow capped at its share of the device depth.
    FairShare,
}

/// `[qos_config.fairness]`: the stage's knobs; off by default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FairQueueConfig {
    pub mode: FairMode,
    /// Best-effort requests this thread keeps at the device; more wait in the stage. Lower is
    /// fairer (a sparse flow's latency is the device's at this depth) and slower (the device
    /// is less parallel): the trade-off `docs/FAIRNESS.md` measures.
    pub be_device_depth_max: u32,
    /// Requests the stage may hold on one thread (beyond: the scheduler keeps them).
    pub held_max: u32,
    /// Backwarding: B for every dense flow; absent, B is the monitor's (eq. 5).
    pub backwardings: Option<u32>,
    /// The monitor that classifies flows dense or sparse (and gives B when not fixed).
    pub monitor: FairnessConfig,
    /// The places at the device chosen from the monitor's F, up to `be_device_depth_max`
    /// (`adaptive`).
    pub adaptive_depth: AdaptiveDepthConfig,
    /// Inter-core migration between this device's threads (`crate::migration`); with
    /// `mode = "backwarding"` it is OctoFAS's hybrid (Algorithm 4).
    pub migration: MigrationConfig,
}

impl Default for FairQueueConfig {
    fn default() -> FairQueueConfig {
        FairQueueConfig {
            mode: FairMode::Off,
            be_device_depth_max: 8,
            held_max: 4096,
            backwardings: None,
            monitor: FairnessConfig::default(),
            adaptive_depth: AdaptiveDepthConfig::default(),
            migration: MigrationConfig::default(),
        }
    }
}

impl FairQueueConfig {
    pub fn validate(&self) -> Result<(), FairnessConfigError> {
        let invalid = |field, reason| Err(FairnessConfigError { field, reason });
        if self.be_device_depth_max == 0 {
            return invalid("be_device_depth_max", "must be at least 1");
        }
        if self.held_max == 0 || self.held_max > 1 << 20 {
            return invalid("held_max", "must be between 1 and 1048576");
        }
        if self.backwardings.is_some_and(|b| b > 1_000) {
            return invalid("backwardings", "must be at most 1000");
        }
        if self.migration.enabled && self.mode == FairMode::Off {
            return invalid(
                "migration.enabled",
                "needs the stage on (a mode other than off): migration moves what it holds",
            );
        }
        if self.adaptive_depth.enabled {
            self.adaptive_depth.validate(self.be_device_depth_max)?;
        }
        self.migration.validate()?;
        self.monitor.validate()
    }
}

/// The stage holds `held_max` requests: the caller keeps this one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the fairness stage holds {held_max} requests")]
pub struct FairQueueFull {
    pub held_max: u32,
}

#[derive(Clone, Copy, Debug)]
struct Held {
    token: u64,
    /// Arrival order over all flows.
    sequence: u64,
    /// Sparse requests that went before it while it was its flow's head (backwarding).
    passed: u32,
}

#[derive(Clone, Debug, Default)]
struct Flow {
    queue: VecDeque<Held>,
    in_flight: u32,
    dense: bool,
    /// Backwardings for this flow's heads (0: never moved back).
    backwardings: u32,
    /// The monitor's window: completions and their latency sum.
    completed: u64,
    latency_sum_ns: u64,
    /// It completed a request in the previous window (it counts as present).
    recent: bool,
    /// The stage's release count when it last released one of this flow's requests (0:
    /// never): ties in the fewest-in-flight modes go to the flow served least recently.
    last_released: u64,
}

impl Flow {
    fn present(&self) -> bool {
        !self.queue.is_empty() || self.in_flight > 0 || self.completed > 0 || self.recent
    }
}

/// Counters for tests and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FairQueueStats {
    pub held_total: u64,
    pub released_total: u64,
    /// Releases that went before an older dense head (backwarding at work).
    pub backwarded_total: u64,
    pub reports: u64,
    /// Adaptive depth: places taken away and given back.
    pub depth_lowered: u64,
    pub depth_raised: u64,
}

/// The stage. See the module documentation.
#[derive(Debug)]
pub struct FairQueue {
    mode: FairMode,
    depth_max: u32,
    /// Chooses the places in use below `depth_max` (`None`: all of them).
    adaptive: Option<AdaptiveDepth>,
    held_max: u32,
    fixed_backwardings: Option<u32>,
    flows: Vec<Flow>,
    /// Flows with held requests (unordered).
    active: Vec<u32>,
    held: u32,
    in_flight: u32,
    sequence: u64,
    monitor: FairnessMonitor,
    /// When the stage last went from nothing at the device to something (device busy time).
    busy_since: Option<Nanos>,
    busy_ns: u64,
    /// The latest sampled network round trip ([`FairQueue::set_network_rtt`]).
    network_rtt: Nanos,
    report: Option<FairnessReport>,
    stats: FairQueueStats,
    /// Latencies of the requests homed on this thread that completed in the load window,
    /// served here or migrated (not those of other threads served here): the load.
    home_latency_ns: u64,
    load_window_start: Nanos,
    /// The last window's load: time-averaged requests homed here (Little's law).
    load: f64,
}

impl FairQueue {
    pub fn new(config: &FairQueueConfig, now: Nanos) -> Result<FairQueue, FairnessConfigError> {
        config.validate()?;
        Ok(FairQueue {
            mode: config.mode,
            depth_max: config.be_device_depth_max,
            adaptive: config.adaptive_depth.enabled.then(|| {
                AdaptiveDepth::new(config.adaptive_depth.clone(), config.be_device_depth_max)
            }),
            held_max: config.held_max,
            fixed_backwardings: config.backwardings,
            flows: Vec::new(),
            active: Vec::new(),
            held: 0,
            in_flight: 0,
            sequence: 0,
            monitor: FairnessMonitor::new(config.monitor.clone(), now)?,
            busy_since: None,
            busy_ns: 0,
            network_rtt: Nanos::ZERO,
            report: None,
            stats: FairQueueStats::default(),
            home_latency_ns: 0,
            load_window_start: now,
            load: 0.0,
        })
    }

    /// The last closed window's load: the best-effort requests homed on this thread (admitted
    /// and not yet completed, wherever they were served), averaged over the window: the sum of
    /// their latencies over the window's length (Little's law). `crate::migration` plans
    /// from it.
    pub fn load(&self) -> f64 {
        self.load
    }

    /// The stage's places at the device (`be_device_depth_max`): its capacity for migration.
    pub fn depth_max(&self) -> u32 {
        self.depth_max
    }

    /// The places in use now: `depth_max`, or the adaptive controller's choice.
    pub fn depth(&self) -> u32 {
        self.adaptive
            .as_ref()
            .map_or(self.depth_max, AdaptiveDepth::depth)
    }

    /// The monitor's knobs (its `load_balance_threshold` gates migration).
    pub fn monitor_config(&self) -> &FairnessConfig {
        self.monitor.config()
    }

    pub fn mode(&self) -> FairMode {
        self.mode
    }

    /// Whether requests go through the stage at all.
    pub fn is_on(&self) -> bool {
        self.mode != FairMode::Off
    }

    pub fn held(&self) -> u32 {
        self.held
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Whether a request of a tenant of `class` goes through the stage: latency-critical
    /// requests never do, so the stage cannot delay what an SLO covers.
    pub fn holds(&self, class: TenantClass) -> bool {
        self.is_on() && class == TenantClass::BestEffort
    }

    pub fn has_room(&self) -> bool {
        self.held < self.held_max
    }

    pub fn stats(&self) -> FairQueueStats {
        self.stats
    }

    /// The monitor's last report (`None` before the first window closed).
    pub fn report(&self) -> Option<&FairnessReport> {
        self.report.as_ref()
    }

    /// Whether the monitor classed `flow` dense in its last window, and its B.
    pub fn flow_class(&self, flow: FlowId) -> Option<(bool, u32)> {
        let flow = self.flows.get(usize::try_from(flow.0).ok()?)?;
        Some((flow.dense, flow.backwardings))
    }

    /// Every flow the stage has seen, with its requests held here and at the device now:
    /// what the metrics show per tenant (flows are bounded by [`FAIR_FLOWS_MAX`]).
    pub fn flows(&self) -> impl Iterator<Item = (FlowId, u32, u32)> + '_ {
        self.flows
            .iter()
            .enumerate()
            .filter(|(_, flow)| flow.present())
            .map(|(index, flow)| {
                (
                    FlowId(index as u64),
                    flow.queue.len() as u32,
                    flow.in_flight,
                )
            })
    }

    /// Holds an admitted best-effort request of `flow` until [`FairQueue::poll_release`]
    /// gives it back.
    pub fn hold(&mut self, flow: FlowId, token: u64) -> Result<(), FairQueueFull> {
        if self.held >= self.held_max {
            return Err(FairQueueFull {
                held_max: self.held_max,
            });
        }
        self.hold_unchecked(flow, token);
        Ok(())
    }

    /// Holds a request another thread migrated here (`crate::migration`): never refused, as
    /// the request has nowhere else to wait; the migration credits bound how many there are
    /// (at most `in_transit_per_pair_max` per other thread), so `held` may pass `held_max` by
    /// that much. It joins its flow's FIFO like a local one (the hybrid's backwarding applies
    /// to it: OctoFAS Algorithm 4).
    pub fn hold_migrated(&mut self, flow: FlowId, token: u64) {
        self.hold_unchecked(flow, token);
    }

    fn hold_unchecked(&mut self, flow: FlowId, token: u64) {
        assert!(self.is_on(), "holding a request with the stage off");
        assert!(
            flow.0 < u64::from(FAIR_FLOWS_MAX),
            "flow {flow:?} beyond the limit"
        );
        let index = flow.0 as usize;
        if self.flows.len() <= index {
            self.flows.resize_with(index + 1, Flow::default);
        }
        let entry = &mut self.flows[index];
        if entry.queue.is_empty() {
            self.active.push(index as u32);
        }
        entry.queue.push_back(Held {
            token,
            sequence: self.sequence,
            passed: 0,
        });
        self.sequence += 1;
        self.held += 1;
        self.stats.held_total += 1;
    }

    /// The next request to send to the device, if the stage has one and the device has fewer
    /// than `be_device_depth_max` of the stage's requests; the caller must send it and report
    /// its end with [`FairQueue::completed`].
    pub fn poll_release(&mut self, now: Nanos) -> Option<(FlowId, u64)> {
        let depth = self.depth();
        if self.in_flight >= depth || self.active.is_empty() {
            return None;
        }
        let position = match self.mode {
            FairMode::Off => unreachable_off(),
            FairMode::Fifo => self.oldest_head(|_| true),
            FairMode::Backwarding => self.pick_backwarding(),
            FairMode::FewestInFlight => self.pick_fewest_in_flight(u32::MAX)?,
            FairMode::FairShare => {
                let present = self.flows.iter().filter(|f| f.present()).count() as u32;
                assert!(present > 0, "a flow with held requests is present");
                self.pick_fewest_in_flight(depth.div_ceil(present))?
            }
        };
        let index = self.active[position] as usize;
        let Some(held) = self.flows[index].queue.pop_front() else {
            panic!("active flow {index} has no held request");
        };
        if self.mode == FairMode::Backwarding {
            // Every dense head that was older was moved back one place.
            for &other in &self.active {
                let flow = &mut self.flows[other as usize];
                if other as usize != index
                    && flow.dense
                    && let Some(head) = flow.queue.front_mut()
                    && head.sequence < held.sequence
                {
                    head.passed += 1;
                    self.stats.backwarded_total += 1;
                }
            }
        }
        let flow = &mut self.flows[index];
        if flow.queue.is_empty() {
            self.active.swap_remove(position);
        }
        flow.in_flight += 1;
        flow.last_released = self.stats.released_total + 1;
        assert!(self.held > 0);
        self.held -= 1;
        if self.in_flight == 0 {
            self.busy_since = Some(now);
        }
        self.in_flight += 1;
        self.stats.released_total += 1;
        Some((FlowId(index as u64), held.token))
    }

    /// A released request of `flow` finished at the device; `latency_ns` is its server-side
    /// latency (for the monitor's response time).
    pub fn completed(&mut self, flow: FlowId, latency_ns: u64, now: Nanos) {
        self.home_latency_ns = self.home_latency_ns.saturating_add(latency_ns);
        self.completed_here(flow, latency_ns, now);
    }

    /// A request another thread migrated here finished at the device: its place is free and
    /// the monitor counts it (OctoFAS's hybrid counts migrated requests in the destination's
    /// flows), but it is not this thread's load.
    pub fn completed_migrated_here(&mut self, flow: FlowId, latency_ns: u64, now: Nanos) {
        self.completed_here(flow, latency_ns, now);
    }

    /// A request of this thread that another thread served came back: the monitor and the
    /// load count it; nothing of this stage's device places changes.
    pub fn completed_elsewhere(&mut self, flow: FlowId, latency_ns: u64) {
        assert!(
            flow.0 < u64::from(FAIR_FLOWS_MAX),
            "flow {flow:?} beyond the limit"
        );
        let index = flow.0 as usize;
        if self.flows.len() <= index {
            self.flows.resize_with(index + 1, Flow::default);
        }
        let entry = &mut self.flows[index];
        entry.completed += 1;
        entry.latency_sum_ns = entry.latency_sum_ns.saturating_add(latency_ns);
        self.home_latency_ns = self.home_latency_ns.saturating_add(latency_ns);
    }

    fn completed_here(&mut self, flow: FlowId, latency_ns: u64, now: Nanos) {
        let Some(entry) = usize::try_from(flow.0)
            .ok()
            .and_then(|index| self.flows.get_mut(index))
        else {
            panic!("completion of unknown flow {flow:?}");
        };
        assert!(
            entry.in_flight > 0,
            "completion of {flow:?} with nothing in flight"
        );
        entry.in_flight -= 1;
        entry.completed += 1;
        entry.latency_sum_ns = entry.latency_sum_ns.saturating_add(latency_ns);
        assert!(self.in_flight > 0);
        self.in_flight -= 1;
        if self.in_flight == 0
            && let Some(since) = self.busy_since.take()
        {
            self.busy_ns += now.saturating_since(since).0;
        }
    }

    /// A released request of `flow` never reached the device (its connection closed in
    /// between): its place is free again and the monitor does not count it.
    pub fn withdraw(&mut self, flow: FlowId, now: Nanos) {
        self.completed(flow, 0, now);
        let entry = &mut self.flows[flow.0 as usize];
        entry.completed -= 1;
    }

    /// The latest network round trip of this stage's flows (the dataplane samples it): the
    /// monitor adds it to every flow's response time (RT = T_net + server time).
    pub fn set_network_rtt(&mut self, rtt: Nanos) {
        self.network_rtt = rtt;
    }

    /// RT_alone of `flow` set from outside (µs; `None` goes back to learning it), for the
    /// monitor's slowdowns from its next window on.
    pub fn set_alone(&mut self, flow: FlowId, rt_alone_us: Option<f64>) {
        match rt_alone_us {
            Some(rt_alone_us) => self.monitor.set_alone(flow, rt_alone_us),
            None => self.monitor.clear_alone(flow),
        }
    }

    /// When the monitor's window ends.
    pub fn next_deadline(&self) -> Nanos {
        self.monitor.next_deadline()
    }

    /// Closes the monitor's window if it is due: flows are classed dense or sparse again and
    /// each dense flow's B is set. Returns whether a window closed.
    pub fn handle_timeout(&mut self, now: Nanos) -> bool {
        if now < self.monitor.next_deadline() {
            return false;
        }
        let mut window = FairnessWindow {
            network_rtt_ns: self.network_rtt.0,
            ..FairnessWindow::default()
        };
        for (index, flow) in self.flows.iter_mut().enumerate() {
            if flow.completed > 0 {
                window.flows.push(FlowSample {
                    flow: FlowId(index as u64),
                    requests: flow.completed,
                    latency_sum_ns: flow.latency_sum_ns,
                });
            }
            flow.recent = flow.completed > 0;
            flow.completed = 0;
            flow.latency_sum_ns = 0;
        }
        let mut busy_ns = std::mem::take(&mut self.busy_ns);
        if let Some(since) = self.busy_since.as_mut() {
            busy_ns += now.saturating_since(*since).0;
            *since = now;
        }
        // The device's busy time stands for the core's: the stage is what one core sends.
        window.cores.push(CoreSample { busy_ns });
        let report = match self.monitor.handle_window(now, &window) {
            Ok(report) => report,
            Err(error) => panic!("the stage built an invalid window: {error}"),
        };
        for flow in &mut self.flows {
            flow.dense = false;
            flow.backwardings = 0;
        }
        for flow in &report.flows {
            let entry = &mut self.flows[flow.flow.0 as usize];
            entry.dense = flow.density == Density::Dense;
            if entry.dense {
                entry.backwardings = self.fixed_backwardings.unwrap_or(flow.backwardings);
            }
        }
        if let Some(adaptive) = self.adaptive.as_mut() {
            match adaptive.on_window(&report) {
                DepthStep::Lowered => self.stats.depth_lowered += 1,
                DepthStep::Raised => self.stats.depth_raised += 1,
                DepthStep::Held => {}
            }
        }
        self.report = Some(report);
        self.stats.reports += 1;
        let length_ns = now.saturating_since(self.load_window_start).0.max(1);
        self.load = std::mem::take(&mut self.home_latency_ns) as f64 / length_ns as f64;
        self.load_window_start = now;
        true
    }

    /// Hands every held request back (flow, token), oldest first within each flow: the
    /// integrator answers them when a shutdown's drain times out.
    pub fn cancel_held(&mut self, cancelled: &mut impl FnMut(FlowId, u64)) {
        for index in std::mem::take(&mut self.active) {
            let flow = &mut self.flows[index as usize];
            while let Some(held) = flow.queue.pop_front() {
                cancelled(FlowId(u64::from(index)), held.token);
                self.held -= 1;
            }
        }
        assert_eq!(self.held, 0, "held requests outside the active flows");
    }

    /// Position in `active` of the oldest head among the flows `eligible` accepts.
    fn oldest_head(&self, eligible: impl Fn(&Flow) -> bool) -> usize {
        let mut best: Option<(u64, usize)> = None;
        for (position, &index) in self.active.iter().enumerate() {
            let flow = &self.flows[index as usize];
            let Some(head) = flow.queue.front() else {
                panic!("active flow {index} has no held request");
            };
            if eligible(flow) && best.is_none_or(|(sequence, _)| head.sequence < sequence) {
                best = Some((head.sequence, position));
            }
        }
        match best {
            Some((_, position)) => position,
            None => panic!("no eligible flow among {} active", self.active.len()),
        }
    }

    /// Algorithm 3: the oldest head, unless it belongs to a dense flow that has been moved back
    /// fewer than B places and a sparse flow waits: then the oldest sparse head.
    fn pick_backwarding(&self) -> usize {
        let oldest = self.oldest_head(|_| true);
        let flow = &self.flows[self.active[oldest] as usize];
        let deferring = |flow: &Flow| {
            flow.dense
                && flow
                    .queue
                    .front()
                    .is_some_and(|h| h.passed < flow.backwardings)
        };
        if !deferring(flow) {
            return oldest;
        }
        let sparse_waits = self
            .active
            .iter()
            .any(|&index| !self.flows[index as usize].dense);
        if !sparse_waits {
            return oldest;
        }
        self.oldest_head(|flow| !flow.dense)
    }

    /// The oldest head among the flows with the fewest requests at the device, if that is
    /// below `share`.
    fn pick_fewest_in_flight(&self, share: u32) -> Option<usize> {
        let fewest = self
            .active
            .iter()
            .map(|&index| self.flows[index as usize].in_flight)
            .min()?;
        if fewest >= share {
            return None;
        }
        // Among the flows with the fewest in flight, the one served least recently, then the
        // oldest head: with one place, the flows take turns instead of the oldest head (nearly
        // always a dense flow's) taking every place. (An active flow always has a head.)
        (0..self.active.len())
            .filter(|&position| self.flows[self.active[position] as usize].in_flight == fewest)
            .min_by_key(|&position| {
                let flow = &self.flows[self.active[position] as usize];
                (
                    flow.last_released,
                    flow.queue.front().map(|head| head.sequence),
                )
            })
    }

    /// Checks the counts in O(flows + held). Panics with the broken invariant.
    pub fn check(&self) {
        let held: usize = self.flows.iter().map(|f| f.queue.len()).sum();
        assert_eq!(held, self.held as usize, "held count");
        let in_flight: u32 = self.flows.iter().map(|f| f.in_flight).sum();
        assert_eq!(in_flight, self.in_flight, "in-flight count");
        for (index, flow) in self.flows.iter().enumerate() {
            let listed = self.active.contains(&(index as u32));
            assert_eq!(listed, !flow.queue.is_empty(), "flow {index} active");
            assert!(
                flow.queue
                    .iter()
                    .zip(flow.queue.iter().skip(1))
                    .all(|(a, b)| a.sequence < b.sequence),
                "flow {index} out of order"
            );
        }
    }
}

fn unreachable_off() -> usize {
    panic!("the stage is off: nothing is held")
}

#[cfg(test)]
mod tests;
