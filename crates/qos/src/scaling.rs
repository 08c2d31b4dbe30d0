//! Thread scaling (ReFlex §4.3, the control plane's "adjusting the number of dataplane
//! threads"): from each thread's busy share over a window, whether to park an active thread
//! (its connections move to the others and it takes no new ones) or wake a parked one.
//!
//! Pure: the integrator passes every window's loads with the window's `now`
//! ([`ScalingPolicy::handle_window`]) and carries the decision out. Active threads are always
//! the lowest indices `0..active`: the last active thread is the one parked, the first parked
//! one is the one woken. Thread 0 therefore never parks (it owns the key-value table).
//!
//! Hysteresis, so a load near a threshold does not make threads come and go:
//! - a park needs the active threads' mean busy share below `park_below` for `park_windows`
//!   windows in a row, and the share the rest would carry (mean × n / (n − 1)) below
//!   `wake_above`, so the park itself cannot call for a wake;
//! - a wake needs the mean above `wake_above` for one window (adding capacity is urgent);
//! - after any change nothing changes for `dwell_ms`;
//! - the active count stays within `active_min ..= active_max` (and the threads started).

use serde::{Deserialize, Serialize};

use crate::Nanos;
use crate::config::THREADS_MAX;

/// `[scaling]`: thread scaling's knobs (`docs/OPERATIONS.md`, "Thread scaling").
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScalingConfig {
    /// Off by default: every thread started serves.
    pub enabled: bool,
    /// How often the loads are looked at.
    pub window_ms: u64,
    /// The active threads' mean busy share (0..1) below which one of them parks.
    pub park_below: f64,
    /// Windows in a row the mean must stay below `park_below` before a park.
    pub park_windows: u32,
    /// The active threads' mean busy share above which a parked thread wakes.
    pub wake_above: f64,
    /// Minimum time between two changes.
    pub dwell_ms: u64,
    /// Threads that always stay active (at least 1).
    pub active_min: u16,
    /// Threads that may be active at once; 0: every thread started (`--threads`).
    pub active_max: u16,
    /// A connection that BINDs to a tenant moves to the active thread holding the fewest of
    /// that tenant's connections when its own holds two more
    /// ([`crate::rebalance::spread_target`]): each flow gets every thread's share, whatever
    /// the kernel's hash did. Works with `enabled` off too.
    pub spread_tenants: bool,
}

impl Default for ScalingConfig {
    fn default() -> ScalingConfig {
        ScalingConfig {
            enabled: false,
            window_ms: 500,
            park_below: 0.15,
            park_windows: 6,
            wake_above: 0.6,
            dwell_ms: 5_000,
            active_min: 1,
            active_max: 0,
            spread_tenants: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScalingConfigError {
    #[error("scaling.{field} = {value}: {reason}")]
    Invalid {
        field: &'static str,
        value: String,
        reason: &'static str,
    },
}

impl ScalingConfig {
    /// Checks the knobs against each other and against `threads` started.
    pub fn validate(&self, threads: usize) -> Result<(), ScalingConfigError> {
        let invalid = |field, value: String, reason| {
            Err(ScalingConfigError::Invalid {
                field,
                value,
                reason,
            })
        };
        if self.window_ms == 0 {
            return invalid("window_ms", "0".into(), "must be positive");
        }
        if !(0.0..1.0).contains(&self.park_below) {
            return invalid("park_below", self.park_below.to_string(), "not in 0..1");
        }
        if !(self.park_below < self.wake_above && self.wake_above <= 1.0) {
            return invalid(
                "wake_above",
                self.wake_above.to_string(),
                "must be above park_below and at most 1",
            );
        }
        if self.park_windows == 0 {
            return invalid("park_windows", "0".into(), "must be positive");
        }
        if self.active_min == 0 {
            return invalid(
                "active_min",
                "0".into(),
                "thread 0 always serves: at least 1",
            );
        }
        if usize::from(self.active_min) > threads.min(THREADS_MAX) {
            return invalid(
                "active_min",
                self.active_min.to_string(),
                "more than the threads started",
            );
        }
        if self.active_max != 0 && self.active_max < self.active_min {
            return invalid(
                "active_max",
                self.active_max.to_string(),
                "below active_min",
            );
        }
        Ok(())
    }

    pub fn window(&self) -> Nanos {
        Nanos(self.window_ms.saturating_mul(1_000_000))
    }

    pub fn dwell(&self) -> Nanos {
        Nanos(self.dwell_ms.saturating_mul(1_000_000))
    }
}

/// One thread's load over the last window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ThreadBusy {
    /// Share of the window the thread worked (0..1).
    pub busy_share: f64,
    /// Requests it answered in the window (for logs; the decision uses the busy share).
    pub requests: u64,
}

/// What the integrator carries out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScalingDecision {
    /// `thread` stops taking connections and hands its connections to `to`.
    Park { thread: u16, to: u16 },
    /// `thread` takes connections again.
    Wake { thread: u16 },
}

/// Why a decision was made (logs, the admin API).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalingReason {
    pub mean_busy_share: f64,
    pub active_before: u16,
}

/// The policy's state: how many threads are active and what the recent windows looked like.
#[derive(Debug, Clone)]
pub struct ScalingPolicy {
    config: ScalingConfig,
    threads: u16,
    active: u16,
    /// Low windows in a row.
    low_windows: u32,
    /// When the active count last changed (`None`: never).
    changed_at: Option<Nanos>,
}

impl ScalingPolicy {
    /// A policy over `threads` started, all active. `config` must have passed
    /// [`ScalingConfig::validate`].
    pub fn new(config: ScalingConfig, threads: u16) -> ScalingPolicy {
        assert!(threads >= 1);
        assert!(config.active_min >= 1 && config.active_min <= threads);
        ScalingPolicy {
            config,
            threads,
            active: threads,
            low_windows: 0,
            changed_at: None,
        }
    }

    pub fn active(&self) -> u16 {
        self.active
    }

    pub fn threads(&self) -> u16 {
        self.threads
    }

    pub fn is_active(&self, thread: u16) -> bool {
        thread < self.active
    }

    fn active_max(&self) -> u16 {
        match self.config.active_max {
            0 => self.threads,
            max => max.min(self.threads),
        }
    }

    /// Looks at one window's loads (`loads[i]` is thread `i`'s; parked threads' loads are
    /// ignored). Returns a decision, already applied to the policy's count.
    pub fn handle_window(
        &mut self,
        now: Nanos,
        loads: &[ThreadBusy],
    ) -> Option<(ScalingDecision, ScalingReason)> {
        assert_eq!(loads.len(), usize::from(self.threads));
        let active = usize::from(self.active);
        let mean = loads[..active].iter().map(|l| l.busy_share).sum::<f64>() / active as f64;
        let reason = ScalingReason {
            mean_busy_share: mean,
            active_before: self.active,
        };
        if mean < self.config.park_below {
            self.low_windows = self.low_windows.saturating_add(1);
        } else {
            self.low_windows = 0;
        }
        if self
            .changed_at
            .is_some_and(|at| now.saturating_since(at) < self.config.dwell())
        {
            return None;
        }
        // Above the maximum (a lowered configuration): park down to it first.
        if self.active > self.active_max() {
            return Some((self.park(now, loads), reason));
        }
        if mean > self.config.wake_above && self.active < self.active_max() {
            return Some((self.wake(now), reason));
        }
        let projected = if active > 1 {
            mean * active as f64 / (active - 1) as f64
        } else {
            f64::INFINITY
        };
        if self.low_windows >= self.config.park_windows
            && self.active > self.config.active_min
            && projected < self.config.wake_above
        {
            return Some((self.park(now, loads), reason));
        }
        None
    }

    /// An operator's request for `active` threads (clamped to `active_min ..= threads`;
    /// `active_max` does not bind an operator): the first step towards it, if any. Call again
    /// for the next. Dwell time does not apply.
    pub fn force(
        &mut self,
        now: Nanos,
        active: u16,
        loads: &[ThreadBusy],
    ) -> Option<ScalingDecision> {
        assert_eq!(loads.len(), usize::from(self.threads));
        let target = active.clamp(self.config.active_min, self.threads);
        if target < self.active {
            Some(self.park(now, loads))
        } else if target > self.active {
            Some(self.wake(now))
        } else {
            None
        }
    }

    /// Parks the last active thread; its connections go to the least busy other active one.
    fn park(&mut self, now: Nanos, loads: &[ThreadBusy]) -> ScalingDecision {
        assert!(self.active >= 2, "thread 0 never parks");
        let thread = self.active - 1;
        let mut to = 0u16;
        for candidate in 1..thread {
            if loads[usize::from(candidate)].busy_share < loads[usize::from(to)].busy_share {
                to = candidate;
            }
        }
        assert!(to < thread);
        self.active -= 1;
        self.low_windows = 0;
        self.changed_at = Some(now);
        ScalingDecision::Park { thread, to }
    }

    fn wake(&mut self, now: Nanos) -> ScalingDecision {
        assert!(self.active < self.threads);
        let thread = self.active;
        self.active += 1;
        self.low_windows = 0;
        self.changed_at = Some(now);
        ScalingDecision::Wake { thread }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn config() -> ScalingConfig {
        ScalingConfig {
            enabled: true,
            window_ms: 100,
            park_below: 0.2,
            park_windows: 3,
            wake_above: 0.6,
            dwell_ms: 1_000,
            active_min: 1,
            active_max: 0,
            spread_tenants: false,
        }
    }

    fn loads(shares: &[f64]) -> Vec<ThreadBusy> {
        shares
            .iter()
            .map(|&busy_share| ThreadBusy {
                busy_share,
                requests: 0,
            })
            .collect()
    }

    /// Feeds `windows` windows of `shares` starting at `start_ms`, 100 ms apart; returns
    /// the decisions with the window index each came in.
    fn run(
        policy: &mut ScalingPolicy,
        start_ms: u64,
        windows: u64,
        shares: &[f64],
    ) -> Vec<(u64, ScalingDecision)> {
        let loads = loads(shares);
        (0..windows)
            .filter_map(|window| {
                let now = Nanos((start_ms + 100 * window) * MS);
                policy
                    .handle_window(now, &loads)
                    .map(|(decision, _)| (window, decision))
            })
            .collect()
    }

    #[test]
    fn a_low_load_parks_the_last_thread_after_park_windows() {
        let mut policy = ScalingPolicy::new(config(), 4);
        let decisions = run(&mut policy, 0, 3, &[0.1, 0.05, 0.1, 0.0]);
        // Mean 0.0625 × 4/3 = 0.083 < 0.6: the third low window parks thread 3 onto the
        // least busy other active thread, 1.
        assert_eq!(
            decisions,
            vec![(2, ScalingDecision::Park { thread: 3, to: 1 })]
        );
        assert_eq!(policy.active(), 3);
        assert!(!policy.is_active(3));
    }

    #[test]
    fn dwell_time_separates_changes() {
        let mut policy = ScalingPolicy::new(config(), 4);
        // 20 windows = 2 s of idle: a park at window 2 (200 ms), the next no earlier than
        // 1 s later (window 12), the third at window 22 would be past the run.
        let decisions = run(&mut policy, 0, 20, &[0.0; 4]);
        assert_eq!(
            decisions,
            vec![
                (2, ScalingDecision::Park { thread: 3, to: 0 }),
                (12, ScalingDecision::Park { thread: 2, to: 0 }),
            ]
        );
    }

    #[test]
    fn never_below_active_min_and_never_thread_0() {
        let mut policy = ScalingPolicy::new(
            ScalingConfig {
                active_min: 2,
                dwell_ms: 0,
                ..config()
            },
            3,
        );
        let decisions = run(&mut policy, 0, 50, &[0.0; 3]);
        assert_eq!(
            decisions,
            vec![(2, ScalingDecision::Park { thread: 2, to: 0 })]
        );
        let mut single = ScalingPolicy::new(
            ScalingConfig {
                dwell_ms: 0,
                ..config()
            },
            1,
        );
        assert!(run(&mut single, 0, 50, &[0.0]).is_empty());
    }

    #[test]
    fn a_park_the_rest_could_not_carry_does_not_happen() {
        let mut policy = ScalingPolicy::new(
            ScalingConfig {
                park_below: 0.35,
                wake_above: 0.6,
                ..config()
            },
            2,
        );
        // Mean 0.32 < 0.35, but one thread would carry 0.64 > 0.6: parking would call for
        // a wake at once.
        assert!(run(&mut policy, 0, 10, &[0.34, 0.30]).is_empty());
        // Mean 0.25 (0.5 on one thread) parks at once: the low windows were in a row.
        let decisions = run(&mut policy, 1_000, 3, &[0.25, 0.25]);
        assert_eq!(
            decisions,
            vec![(0, ScalingDecision::Park { thread: 1, to: 0 })]
        );
    }

    #[test]
    fn a_high_load_wakes_the_first_parked_thread_after_dwell() {
        let mut policy = ScalingPolicy::new(config(), 3);
        run(&mut policy, 0, 3, &[0.0; 3]);
        assert_eq!(policy.active(), 2);
        // High at once, but within the dwell time of the park (at 200 ms): nothing until 1.2 s.
        let decisions = run(&mut policy, 300, 12, &[0.9, 0.8, 0.0]);
        assert_eq!(decisions, vec![(9, ScalingDecision::Wake { thread: 2 })]);
        assert_eq!(policy.active(), 3);
        // All active: nothing more to wake.
        assert!(run(&mut policy, 5_000, 5, &[1.0; 3]).is_empty());
    }

    #[test]
    fn a_load_between_the_thresholds_changes_nothing() {
        let mut policy = ScalingPolicy::new(config(), 2);
        assert!(run(&mut policy, 0, 100, &[0.4, 0.3]).is_empty());
        assert_eq!(policy.active(), 2);
    }

    #[test]
    fn low_windows_must_be_consecutive() {
        let mut policy = ScalingPolicy::new(config(), 2);
        let mut decisions = Vec::new();
        for (window, share) in [0.0, 0.0, 0.5, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0]
            .into_iter()
            .enumerate()
        {
            let now = Nanos(100 * window as u64 * MS);
            if let Some((decision, _)) = policy.handle_window(now, &loads(&[share, share])) {
                decisions.push((window, decision));
            }
        }
        assert_eq!(
            decisions,
            vec![(8, ScalingDecision::Park { thread: 1, to: 0 })]
        );
    }

    #[test]
    fn active_max_parks_down_to_it() {
        let mut policy = ScalingPolicy::new(
            ScalingConfig {
                active_max: 2,
                dwell_ms: 0,
                ..config()
            },
            4,
        );
        // Busy, but above the maximum: parks 3 then 2, then wakes nothing.
        let decisions = run(&mut policy, 0, 5, &[0.9; 4]);
        assert_eq!(
            decisions,
            vec![
                (0, ScalingDecision::Park { thread: 3, to: 0 }),
                (1, ScalingDecision::Park { thread: 2, to: 0 }),
            ]
        );
    }

    #[test]
    fn force_steps_towards_the_operators_count() {
        let mut policy = ScalingPolicy::new(config(), 3);
        let idle = loads(&[0.0; 3]);
        assert_eq!(
            policy.force(Nanos(0), 1, &idle),
            Some(ScalingDecision::Park { thread: 2, to: 0 })
        );
        assert_eq!(
            policy.force(Nanos(0), 1, &idle),
            Some(ScalingDecision::Park { thread: 1, to: 0 })
        );
        assert_eq!(
            policy.force(Nanos(0), 0, &idle),
            None,
            "clamped to active_min"
        );
        assert_eq!(
            policy.force(Nanos(0), 9, &idle),
            Some(ScalingDecision::Wake { thread: 1 })
        );
        assert_eq!(policy.active(), 2);
    }

    #[test]
    fn validate_refuses_inconsistent_knobs() {
        assert!(config().validate(2).is_ok());
        assert!(ScalingConfig::default().validate(1).is_ok());
        for bad in [
            ScalingConfig {
                park_below: 0.7,
                ..config()
            },
            ScalingConfig {
                wake_above: 1.5,
                ..config()
            },
            ScalingConfig {
                active_min: 0,
                ..config()
            },
            ScalingConfig {
                active_min: 3,
                ..config()
            },
            ScalingConfig {
                active_max: 1,
                active_min: 2,
                ..config()
            },
            ScalingConfig {
                window_ms: 0,
                ..config()
            },
            ScalingConfig {
                park_windows: 0,
                ..config()
            },
        ] {
            assert!(bad.validate(2).is_err(), "{bad:?}");
        }
    }
}
