//! The OctoFAS monitor (Park et al., Electronics 2024, §4.2; paper 001 in `../shared/papers/`):
//! per-flow slowdown and system fairness, per-core utilisation and load balance, and the
//! scheduling policy they call for (its Algorithm 1), for best-effort tenants and untenanted
//! flows. ReFlex's tokens give LC tenants their SLO; this is what the others get among
//! themselves.
//!
//! Sans-IO: the integrator closes a window every `window_us` of its `now`, passes what it
//! measured ([`FairnessWindow`]) to [`FairnessMonitor::handle_window`] and gets a
//! [`FairnessReport`]. Nothing here reads a clock.
//!
//! # Definitions (the paper's equations)
//! - response time of flow i: RT_i = T_net + mean server-side latency of its requests in the
//!   window (T_net: the network round trip the integrator measured, added as the paper does so
//!   that a large network share does not hide unfairness);
//! - slowdown S_i = RT_i(shared) / RT_i(alone) (eq. 1); fairness F = min S / max S (eq. 2);
//! - utilisation U_c = busy time / window of core c; load balance LB = min U / max U (eq. 3);
//!   the cores above the mean U_avg form the high group, the others the low group;
//! - intensity of a flow: its requests per second; a flow is dense when its intensity exceeds
//!   `dense_ratio` × the mean intensity of the active flows, sparse otherwise;
//! - backwardings B of a dense flow = α × intensity(dense) / mean intensity(sparse) (eq. 5).
//!
//! # RT_alone: learned online
//! A flow's alone response time is learned from **low-contention windows**: windows in which
//! it is the only active flow, or in which every core's utilisation is at most
//! `alone_utilisation_max` (requests then rarely wait for one another). Each such window with
//! at least `samples_min` requests moves RT_alone towards the window's RT by an exponential
//! average (weight `alone_weight`). Until a flow has had one, its lowest RT so far stands in
//! (a lower bound of RT_alone's sense: its slowdown is then ≥ 1 and errs towards "fair").
//! [`FairnessMonitor::set_alone`] sets it from outside instead (a calibration phase, the
//! operator's `rt_alone_us` of a tenant): a set RT_alone stands until cleared, whatever the
//! windows show, and outlives the flow's leaving.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Nanos;

/// A flow: a tenant, or a connection group when no tenant is named (the integrator decides).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct FlowId(pub u64);

/// The monitor's knobs (`[fairness]` in a config; every field optional).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FairnessConfig {
    /// One monitoring window W.
    pub window_us: u64,
    /// F at or below this raises the unfairness flag (the paper: 0.9).
    pub fairness_threshold: f64,
    /// LB below this raises the load-imbalance flag (T_LB).
    pub load_balance_threshold: f64,
    /// Fewest requests a flow needs in a window to count (its mean is noise below it).
    pub samples_min: u64,
    /// A window counts as low-contention for RT_alone when every core is at most this busy.
    pub alone_utilisation_max: f64,
    /// Weight of one low-contention window in RT_alone's exponential average.
    pub alone_weight: f64,
    /// Dense: intensity above this × the mean intensity of the active flows.
    pub dense_ratio: f64,
    /// α of eq. 5.
    pub backwarding_alpha: f64,
    /// B is capped here (the paper explores 0 to 20).
    pub backwardings_max: u32,
}

impl Default for FairnessConfig {
    fn default() -> FairnessConfig {
        FairnessConfig {
            window_us: 100_000,
            fairness_threshold: 0.9,
            load_balance_threshold: 0.8,
            samples_min: 20,
            alone_utilisation_max: 0.3,
            alone_weight: 0.25,
            dense_ratio: 1.0,
            backwarding_alpha: 1.0,
            backwardings_max: 20,
        }
    }
}

/// A knob out of range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("fairness.{field}: {reason}")]
pub struct FairnessConfigError {
    pub field: &'static str,
    pub reason: &'static str,
}

impl FairnessConfig {
    pub fn validate(&self) -> Result<(), FairnessConfigError> {
        let invalid = |field, reason| Err(FairnessConfigError { field, reason });
        let fraction = |v: f64| v.is_finite() && (0.0..=1.0).contains(&v);
        if self.window_us == 0 || self.window_us > 60_000_000 {
            return invalid("window_us", "must be between 1 µs and 60 s");
        }
        if !fraction(self.fairness_threshold) {
            return invalid("fairness_threshold", "must be between 0 and 1");
        }
        if !fraction(self.load_balance_threshold) {
            return invalid("load_balance_threshold", "must be between 0 and 1");
        }
        if self.samples_min == 0 {
            return invalid("samples_min", "must be at least 1");
        }
        if !fraction(self.alone_utilisation_max) {
            return invalid("alone_utilisation_max", "must be between 0 and 1");
        }
        if !(self.alone_weight.is_finite() && self.alone_weight > 0.0 && self.alone_weight <= 1.0) {
            return invalid("alone_weight", "must be above 0 and at most 1");
        }
        if !(self.dense_ratio.is_finite() && self.dense_ratio >= 1.0) {
            return invalid("dense_ratio", "must be at least 1");
        }
        if !(self.backwarding_alpha.is_finite() && self.backwarding_alpha >= 0.0) {
            return invalid("backwarding_alpha", "must be 0 or more");
        }
        Ok(())
    }

    pub fn window(&self) -> Nanos {
        Nanos::from_micros(self.window_us)
    }
}

/// What one flow did in a window, on all cores together.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlowSample {
    pub flow: FlowId,
    /// Requests that completed in the window.
    pub requests: u64,
    /// Sum of their server-side latencies (arrival to reply sent).
    pub latency_sum_ns: u64,
}

/// One core in a window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CoreSample {
    /// Time the core spent working (not waiting) in the window.
    pub busy_ns: u64,
}

/// What the integrator measured in one window.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FairnessWindow {
    pub flows: Vec<FlowSample>,
    pub cores: Vec<CoreSample>,
    /// The network round trip T_net added to every flow's response time.
    pub network_rtt_ns: u64,
}

/// A flow's density class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Density {
    Dense,
    Sparse,
}

/// The scheduling Algorithm 1 picks from the two flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum FairnessPolicy {
    /// Fair and balanced: nothing to do.
    None,
    /// Imbalanced only: inter-core migration (Algorithm 2).
    Inter,
    /// Unfair only: intra-core backwarding (Algorithm 3).
    Intra,
    /// Both: migration and backwarding (Algorithm 4).
    Hybrid,
}

/// One flow's figures for the window.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct FlowReport {
    pub flow: FlowId,
    /// Requests per second.
    pub intensity: f64,
    /// RT in the window (T_net + mean server latency), µs.
    pub rt_us: f64,
    /// RT_alone in force, µs.
    pub rt_alone_us: f64,
    /// Whether RT_alone came from low-contention windows or was set (false: the lowest RT
    /// seen stands in).
    pub alone_learned: bool,
    /// Whether RT_alone was set from outside ([`FairnessMonitor::set_alone`]).
    pub alone_set: bool,
    pub slowdown: f64,
    pub density: Density,
    /// Backwardings for a dense flow's requests (0 for sparse flows or without unfairness).
    pub backwardings: u32,
}

/// The monitor's answer for one window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FairnessReport {
    pub end: Nanos,
    /// Flows with at least `samples_min` requests, by flow id.
    pub flows: Vec<FlowReport>,
    /// F = min S / max S over those flows (1.0 with fewer than two).
    pub fairness: f64,
    pub utilisation: Vec<f64>,
    pub utilisation_mean: f64,
    /// LB = min U / max U (1.0 with fewer than two cores or all idle).
    pub load_balance: f64,
    /// Cores above U_avg (migration sources) and the others (destinations).
    pub high_cores: Vec<usize>,
    pub low_cores: Vec<usize>,
    pub unfair: bool,
    pub imbalanced: bool,
    pub policy: FairnessPolicy,
}

/// An observation the monitor cannot use; nothing changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FairnessWindowError {
    #[error("window ends at {end:?}, before the previous one ({previous:?})")]
    TimeWentBack { end: Nanos, previous: Nanos },
    #[error("flow {0:?} appears twice in one window")]
    DuplicateFlow(FlowId),
}

#[derive(Clone, Copy, Debug)]
struct FlowState {
    /// RT_alone in µs, learned or set.
    alone_us: Option<f64>,
    /// Lowest RT seen, µs (the stand-in).
    lowest_us: f64,
}

/// Per-flow slowdown, fairness and load balance, window by window.
#[derive(Debug)]
pub struct FairnessMonitor {
    config: FairnessConfig,
    flows: BTreeMap<FlowId, FlowState>,
    /// RT_alone set from outside, µs: kept when the flow leaves, never moved by a window.
    alone_set: BTreeMap<FlowId, f64>,
    window_start: Nanos,
    last_end: Option<Nanos>,
}

impl FairnessMonitor {
    pub fn new(config: FairnessConfig, now: Nanos) -> Result<FairnessMonitor, FairnessConfigError> {
        config.validate()?;
        Ok(FairnessMonitor {
            config,
            flows: BTreeMap::new(),
            alone_set: BTreeMap::new(),
            window_start: now,
            last_end: None,
        })
    }

    pub fn config(&self) -> &FairnessConfig {
        &self.config
    }

    /// When the current window ends.
    pub fn next_deadline(&self) -> Nanos {
        self.window_start + self.config.window()
    }

    /// Sets RT_alone of `flow` (µs) from outside: it stands instead of what windows teach
    /// until [`Self::clear_alone`].
    pub fn set_alone(&mut self, flow: FlowId, rt_alone_us: f64) {
        assert!(rt_alone_us.is_finite() && rt_alone_us > 0.0);
        self.alone_set.insert(flow, rt_alone_us);
    }

    /// Goes back to learning `flow`'s RT_alone from its windows (what was learned meanwhile
    /// stands at once).
    pub fn clear_alone(&mut self, flow: FlowId) {
        self.alone_set.remove(&flow);
    }

    /// Forgets a flow that left.
    pub fn remove(&mut self, flow: FlowId) {
        self.flows.remove(&flow);
    }

    /// Closes the window that ends at `now` with what was measured in it.
    pub fn handle_window(
        &mut self,
        now: Nanos,
        window: &FairnessWindow,
    ) -> Result<FairnessReport, FairnessWindowError> {
        if let Some(previous) = self.last_end
            && now < previous
        {
            return Err(FairnessWindowError::TimeWentBack { end: now, previous });
        }
        let mut seen = std::collections::BTreeSet::new();
        for sample in &window.flows {
            if !seen.insert(sample.flow) {
                return Err(FairnessWindowError::DuplicateFlow(sample.flow));
            }
        }
        let length_ns = now.saturating_since(self.window_start).0.max(1);
        self.window_start = now;
        self.last_end = Some(now);

        let utilisation: Vec<f64> = window
            .cores
            .iter()
            .map(|core| (core.busy_ns as f64 / length_ns as f64).min(1.0))
            .collect();
        let utilisation_mean = mean(&utilisation).unwrap_or(0.0);
        let (u_min, u_max) = min_max(&utilisation);
        let load_balance = if utilisation.len() < 2 || u_max <= 0.0 {
            1.0
        } else {
            u_min / u_max
        };
        let (high_cores, low_cores): (Vec<usize>, Vec<usize>) =
            (0..utilisation.len()).partition(|&c| utilisation[c] > utilisation_mean);
        let active: Vec<&FlowSample> = window
            .flows
            .iter()
            .filter(|sample| sample.requests >= self.config.samples_min)
            .collect();
        let low_contention = active.len() == 1
            || utilisation
                .iter()
                .all(|&u| u <= self.config.alone_utilisation_max);
        let seconds = length_ns as f64 / 1e9;

        let mut flows = Vec::with_capacity(active.len());
        for sample in &active {
            let rt_us = (window.network_rtt_ns as f64
                + sample.latency_sum_ns as f64 / sample.requests as f64)
                / 1e3;
            let state = self.flows.entry(sample.flow).or_insert(FlowState {
                alone_us: None,
                lowest_us: rt_us,
            });
            state.lowest_us = state.lowest_us.min(rt_us);
            if low_contention {
                let weight = self.config.alone_weight;
                state.alone_us = Some(match state.alone_us {
                    Some(alone) => alone + weight * (rt_us - alone),
                    None => rt_us,
                });
            }
            let set = self.alone_set.get(&sample.flow).copied();
            let (rt_alone_us, alone_learned) = match (set, state.alone_us) {
                (Some(alone), _) | (None, Some(alone)) => (alone, true),
                (None, None) => (state.lowest_us, false),
            };
            flows.push(FlowReport {
                flow: sample.flow,
                intensity: sample.requests as f64 / seconds,
                rt_us,
                rt_alone_us,
                alone_learned,
                alone_set: set.is_some(),
                slowdown: rt_us / rt_alone_us.max(f64::MIN_POSITIVE),
                density: Density::Sparse,
                backwardings: 0,
            });
        }
        let slowdowns: Vec<f64> = flows.iter().map(|f| f.slowdown).collect();
        let (s_min, s_max) = min_max(&slowdowns);
        let fairness = if flows.len() < 2 || s_max <= 0.0 {
            1.0
        } else {
            s_min / s_max
        };
        let unfair = flows.len() >= 2 && fairness <= self.config.fairness_threshold;
        let imbalanced =
            utilisation.len() >= 2 && load_balance < self.config.load_balance_threshold;

        let intensities: Vec<f64> = flows.iter().map(|f| f.intensity).collect();
        let intensity_mean = mean(&intensities).unwrap_or(0.0);
        for flow in &mut flows {
            if flows_dense(flow.intensity, intensity_mean, self.config.dense_ratio) {
                flow.density = Density::Dense;
            }
        }
        let sparse_mean = mean(
            &flows
                .iter()
                .filter(|f| f.density == Density::Sparse)
                .map(|f| f.intensity)
                .collect::<Vec<_>>(),
        );
        if unfair && let Some(sparse_mean) = sparse_mean.filter(|&m| m > 0.0) {
            for flow in flows.iter_mut().filter(|f| f.density == Density::Dense) {
                let b = self.config.backwarding_alpha * flow.intensity / sparse_mean;
                flow.backwardings =
                    (b.round() as u64).min(u64::from(self.config.backwardings_max)) as u32;
            }
        }
        let policy = match (unfair, imbalanced) {
            (false, false) => FairnessPolicy::None,
            (false, true) => FairnessPolicy::Inter,
            (true, false) => FairnessPolicy::Intra,
            (true, true) => FairnessPolicy::Hybrid,
        };
        Ok(FairnessReport {
            end: now,
            flows,
            fairness,
            utilisation,
            utilisation_mean,
            load_balance,
            high_cores,
            low_cores,
            unfair,
            imbalanced,
            policy,
        })
    }
}

fn flows_dense(intensity: f64, mean: f64, ratio: f64) -> bool {
    intensity > mean * ratio
}

fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

fn min_max(values: &[f64]) -> (f64, f64) {
    values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

#[cfg(test)]
mod tests;
