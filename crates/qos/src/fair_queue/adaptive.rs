//! Adaptive device depth for the fairness stage: the stage's places at the device chosen
//! from the monitor's F instead of configured.
//!
//! Why: on a device whose throughput grows with its depth, a lower `be_device_depth_max` is
//! fairer (a sparse flow's latency is the device's at that depth) and slower. The best depth
//! depends on the flows present and the device, so an operator's fixed choice is right for
//! one load only. The controller looks for the deepest depth at which the monitor's F stays
//! at `fairness_target`:
//! - the controller remembers the F it saw at each depth (an average of the windows there,
//!   forgotten after `memory_windows`), because F is not monotonic in the depth: with too
//!   few places a flow's share rounds badly and F falls again;
//! - a window judged unfair (F below the target) moves to the deepest depth remembered fair;
//!   with none, one place down if that depth is unexplored (not below `depth_min`), else to
//!   the depth with the best F remembered. It doubles the wait before the next step up (up
//!   to `backoff_max` times `raise_after_windows`), so a depth found unfair is not retried
//!   at once;
//! - `raise_after_windows`-times-the-backoff fair windows in a row give one place back (not
//!   above `be_device_depth_max`); after a step up that held, the wait halves again;
//! - a window with fewer than two judged flows is fair (nobody to be unfair to), so a flow
//!   alone gets the whole depth back step by step;
//! - a window whose flows' RT_alone is only the lowest RT seen (nothing learned or set)
//!   changes nothing: its F says little.
//!
//! Sans-IO and exact: the stage calls [`AdaptiveDepth::on_window`] with each report.

use serde::{Deserialize, Serialize};

use crate::fairness::{FairnessConfigError, FairnessReport};

/// `[qos_config.fairness.adaptive_depth]`: off by default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptiveDepthConfig {
    pub enabled: bool,
    /// The fewest places the controller leaves the stage.
    pub depth_min: u32,
    /// F the controller keeps (a window below it takes a place away).
    pub fairness_target: f64,
    /// Fair windows in a row before a place is given back.
    pub raise_after_windows: u32,
    /// How far repeated unfair windows stretch that wait: at most this many times.
    pub backoff_max: u32,
    /// Windows after which the F seen at a depth is forgotten (the flows may have changed).
    pub memory_windows: u32,
}

impl Default for AdaptiveDepthConfig {
    fn default() -> AdaptiveDepthConfig {
        AdaptiveDepthConfig {
            enabled: false,
            depth_min: 2,
            fairness_target: 0.9,
            raise_after_windows: 5,
            backoff_max: 8,
            memory_windows: 200,
        }
    }
}

impl AdaptiveDepthConfig {
    pub fn validate(&self, depth_max: u32) -> Result<(), FairnessConfigError> {
        let invalid = |field, reason| Err(FairnessConfigError { field, reason });
        if self.depth_min == 0 || self.depth_min > depth_max {
            return invalid(
                "adaptive_depth.depth_min",
                "must be between 1 and be_device_depth_max",
            );
        }
        if !(self.fairness_target.is_finite() && self.fairness_target > 0.0)
            || self.fairness_target > 1.0
        {
            return invalid(
                "adaptive_depth.fairness_target",
                "must be above 0 and at most 1",
            );
        }
        if self.raise_after_windows == 0 || self.raise_after_windows > 10_000 {
            return invalid(
                "adaptive_depth.raise_after_windows",
                "must be between 1 and 10000",
            );
        }
        if self.backoff_max == 0 || self.backoff_max > 1_024 {
            return invalid("adaptive_depth.backoff_max", "must be between 1 and 1024");
        }
        if self.memory_windows == 0 || self.memory_windows > 1_000_000 {
            return invalid(
                "adaptive_depth.memory_windows",
                "must be between 1 and 1000000",
            );
        }
        Ok(())
    }
}

/// What a window did to the depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DepthStep {
    Held,
    Lowered,
    Raised,
}

/// The controller's state for one stage.
#[derive(Clone, Debug)]
pub struct AdaptiveDepth {
    config: AdaptiveDepthConfig,
    depth_max: u32,
    depth: u32,
    /// Fair windows in a row at the present depth.
    fair_in_a_row: u32,
    /// The present wait multiplier (1 up to `backoff_max`).
    backoff: u32,
    /// Per depth (index = depth): the average F seen there and the window it was last seen.
    seen: Vec<Option<Seen>>,
    /// Judged windows so far (the clock of `seen`).
    windows: u64,
}

#[derive(Clone, Copy, Debug)]
struct Seen {
    fairness: f64,
    window: u64,
}

/// Weight of one window in a depth's remembered F.
const SEEN_WEIGHT: f64 = 0.5;

impl AdaptiveDepth {
    /// Starts at `depth_max`: the throughput of a fixed stage until a window says otherwise.
    pub fn new(config: AdaptiveDepthConfig, depth_max: u32) -> AdaptiveDepth {
        assert!(config.depth_min >= 1 && config.depth_min <= depth_max);
        AdaptiveDepth {
            config,
            depth_max,
            depth: depth_max,
            fair_in_a_row: 0,
            backoff: 1,
            seen: vec![None; depth_max as usize + 1],
            windows: 0,
        }
    }

    /// The places the stage may use now.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// One closed monitor window.
    pub fn on_window(&mut self, report: &FairnessReport) -> DepthStep {
        let step = self.decide(report);
        assert!(self.depth >= self.config.depth_min && self.depth <= self.depth_max);
        assert!(self.backoff >= 1 && self.backoff <= self.config.backoff_max);
        step
    }

    fn decide(&mut self, report: &FairnessReport) -> DepthStep {
        let judged = report.flows.len() >= 2;
        if judged && !report.flows.iter().all(|flow| flow.alone_learned) {
            return DepthStep::Held;
        }
        if judged {
            self.remember(report.fairness);
        }
        if judged && report.fairness < self.config.fairness_target {
            self.fair_in_a_row = 0;
            self.backoff = (self.backoff * 2).min(self.config.backoff_max);
            let next = self.after_unfair();
            let step = match next.cmp(&self.depth) {
                std::cmp::Ordering::Less => DepthStep::Lowered,
                std::cmp::Ordering::Equal => DepthStep::Held,
                std::cmp::Ordering::Greater => DepthStep::Raised,
            };
            self.depth = next;
            return step;
        }
        self.fair_in_a_row += 1;
        if self.fair_in_a_row < self.config.raise_after_windows * self.backoff {
            return DepthStep::Held;
        }
        self.fair_in_a_row = 0;
        // The present depth held for the whole wait: the next probe may come sooner.
        self.backoff = (self.backoff / 2).max(1);
        if self.depth < self.depth_max {
            self.depth += 1;
            return DepthStep::Raised;
        }
        DepthStep::Held
    }

    fn remember(&mut self, fairness: f64) {
        self.windows += 1;
        let slot = &mut self.seen[self.depth as usize];
        let average = match slot {
            Some(seen) => seen.fairness + SEEN_WEIGHT * (fairness - seen.fairness),
            None => fairness,
        };
        *slot = Some(Seen {
            fairness: average,
            window: self.windows,
        });
    }

    /// The F remembered at `depth`, unless forgotten.
    fn seen_at(&self, depth: u32) -> Option<f64> {
        let seen = self.seen[depth as usize]?;
        (self.windows - seen.window < u64::from(self.config.memory_windows))
            .then_some(seen.fairness)
    }

    /// Where to go after an unfair window: the deepest depth remembered fair; else one down
    /// into the unexplored; else the best remembered (deeper on ties).
    fn after_unfair(&self) -> u32 {
        let depths = self.config.depth_min..=self.depth_max;
        let target = self.config.fairness_target;
        if let Some(fair) = depths
            .clone()
            .rev()
            .find(|&depth| self.seen_at(depth).is_some_and(|f| f >= target))
        {
            return fair;
        }
        if self.depth > self.config.depth_min && self.seen_at(self.depth - 1).is_none() {
            return self.depth - 1;
        }
        let mut best: Option<(u32, f64)> = None;
        for depth in depths.rev() {
            if let Some(f) = self.seen_at(depth)
                && best.is_none_or(|(_, b)| f > b)
            {
                best = Some((depth, f));
            }
        }
        best.map_or(self.depth, |(depth, _)| depth)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fairness::{Density, FlowId, FlowReport};
    use crate::time::Nanos;

    fn report(flows: usize, fairness: f64, learned: bool) -> FairnessReport {
        FairnessReport {
            end: Nanos(0),
            flows: (0..flows)
                .map(|flow| FlowReport {
                    flow: FlowId(flow as u64),
                    intensity: 1_000.0,
                    rt_us: 100.0,
                    rt_alone_us: 100.0,
                    alone_learned: learned,
                    alone_set: false,
                    slowdown: 1.0,
                    density: Density::Sparse,
                    backwardings: 0,
                })
                .collect(),
            fairness,
            utilisation: vec![0.5],
            utilisation_mean: 0.5,
            load_balance: 1.0,
            high_cores: Vec::new(),
            low_cores: Vec::new(),
            unfair: false,
            imbalanced: false,
            policy: crate::fairness::FairnessPolicy::None,
        }
    }

    fn controller(depth_max: u32) -> AdaptiveDepth {
        AdaptiveDepth::new(
            AdaptiveDepthConfig {
                enabled: true,
                depth_min: 2,
                fairness_target: 0.9,
                raise_after_windows: 3,
                backoff_max: 4,
                memory_windows: 1_000,
            },
            depth_max,
        )
    }

    #[test]
    fn unfair_windows_explore_downwards_then_settle_on_the_best_depth_seen() {
        let mut depth = controller(5);
        assert_eq!(depth.depth(), 5);
        // Equally unfair everywhere: down to the minimum, then back to the deepest (the
        // same F for the most throughput).
        for expected in [4, 3, 2, 5, 5] {
            depth.on_window(&report(2, 0.5, true));
            assert_eq!(depth.depth(), expected);
        }
        // F not monotonic: best at 3, worse above and below it.
        let mut depth = controller(5);
        for (fairness, expected) in [(0.5, 4), (0.6, 3), (0.8, 2), (0.4, 3), (0.8, 3)] {
            depth.on_window(&report(2, fairness, true));
            assert_eq!(depth.depth(), expected, "after F {fairness}");
        }
        // A depth remembered fair is where an unfair window sends it.
        let mut depth = controller(5);
        depth.on_window(&report(2, 0.5, true));
        depth.on_window(&report(2, 0.95, true));
        assert_eq!(depth.depth(), 4);
        for _ in 0..6 {
            depth.on_window(&report(2, 0.95, true));
        }
        assert_eq!(depth.depth(), 5, "probed one place up");
        depth.on_window(&report(2, 0.5, true));
        assert_eq!(depth.depth(), 4, "back to the depth remembered fair");
    }

    #[test]
    fn what_was_seen_at_a_depth_is_forgotten_after_memory_windows() {
        let mut depth = AdaptiveDepth::new(
            AdaptiveDepthConfig {
                enabled: true,
                memory_windows: 1,
                ..AdaptiveDepthConfig::default()
            },
            3,
        );
        depth.on_window(&report(2, 0.5, true));
        assert_eq!(depth.depth(), 2);
        // 3 was seen a window ago, forgotten with a memory of one window: 2 stays (with a
        // longer memory the better F seen at 3 would take it back there).
        depth.on_window(&report(2, 0.4, true));
        assert_eq!(depth.depth(), 2);
    }

    #[test]
    fn fair_windows_give_places_back_after_a_wait_that_grows_with_each_lowering() {
        let mut depth = controller(8);
        // Two lowerings: backoff 4 (the cap), so 3 × 4 fair windows per step up.
        depth.on_window(&report(2, 0.5, true));
        depth.on_window(&report(2, 0.5, true));
        assert_eq!(depth.depth(), 6);
        for _ in 0..11 {
            assert_eq!(depth.on_window(&report(2, 0.95, true)), DepthStep::Held);
        }
        assert_eq!(depth.on_window(&report(2, 0.95, true)), DepthStep::Raised);
        assert_eq!(depth.depth(), 7);
        // That step held: the wait halves (3 × 2).
        for _ in 0..5 {
            assert_eq!(depth.on_window(&report(2, 0.95, true)), DepthStep::Held);
        }
        assert_eq!(depth.on_window(&report(2, 0.95, true)), DepthStep::Raised);
        assert_eq!(depth.depth(), 8);
        // At the top it stays.
        for _ in 0..20 {
            depth.on_window(&report(2, 0.95, true));
        }
        assert_eq!(depth.depth(), 8);
    }

    #[test]
    fn a_flow_alone_counts_as_fair_and_unlearned_windows_change_nothing() {
        let mut depth = controller(4);
        depth.on_window(&report(2, 0.2, true));
        assert_eq!(depth.depth(), 3);
        // F from stand-ins: nothing, however low.
        for _ in 0..10 {
            assert_eq!(depth.on_window(&report(2, 0.1, false)), DepthStep::Held);
        }
        assert_eq!(depth.depth(), 3);
        // One flow (F is 1 by definition, learned or not): fair, so the depth comes back.
        for _ in 0..6 {
            depth.on_window(&report(1, 1.0, false));
        }
        assert_eq!(depth.depth(), 4);
    }

    #[test]
    fn the_config_is_checked_against_the_maximum_depth() {
        let config = AdaptiveDepthConfig::default();
        assert!(config.validate(8).is_ok());
        assert!(config.validate(1).is_err());
        for bad in [
            AdaptiveDepthConfig {
                fairness_target: 0.0,
                ..AdaptiveDepthConfig::default()
            },
            AdaptiveDepthConfig {
                raise_after_windows: 0,
                ..AdaptiveDepthConfig::default()
            },
            AdaptiveDepthConfig {
                backoff_max: 0,
                ..AdaptiveDepthConfig::default()
            },
        ] {
            assert!(bad.validate(8).is_err(), "{bad:?}");
        }
    }
}
