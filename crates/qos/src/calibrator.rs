//! Online self-calibration: learns, from the read latency latency-critical tenants actually get,
//! how much of its profile's token rate a device can really sustain, and says so as a scale
//! factor (`device rate = profile rate at the strictest SLO × scale`,
//! [`crate::TenantRegistry::set_rate_scale`]).
//!
//! Why: the profile is measured once, but Flash drifts (garbage collection, wear, temperature,
//! a neighbour's writes). When the device is slower than its profile, the scheduler hands out
//! tokens the device cannot honour and every LC promise breaks at once (`docs/QOS.md` §10).
//! Gimbal (SIGCOMM'21) adapts its token rate online; this is the same idea with a deliberately
//! simple control law, documented in `docs/QOS.md` §11.
//!
//! Sans-IO: the integrator closes a window every `window_us` of its `now`
//! ([`Calibrator::next_deadline`]), summarises the LC reads that completed in it (count and
//! p95 device latency; no histogram type crosses the API), and calls
//! [`Calibrator::handle_window`]. The answer is the scale to apply. Nothing here reads a clock.
//!
//! # The control law (per window)
//!
//! With `p` the window's p95, `T` the target (strictest LC SLO − the client's share):
//! - fewer than `samples_min` LC reads, or no LC SLO: no evidence, hold (and restart the
//!   count of comfortable windows);
//! - `p > T`: multiplicative decrease proportional to the overshoot,
//!   `scale × (1 − min(decrease_step_max, decrease_gain × (p − T) / p))`, not below
//!   `scale_floor`; except while a previous cut is still taking effect (within
//!   `decrease_hold_windows` windows of it, with `p` lower than the window before: the backlog
//!   is draining), when it holds;
//! - `comfort_ratio × T ≤ p ≤ T`: the hysteresis band, hold;
//! - `p < comfort_ratio × T` in a window where the device was driven at least at
//!   `increase_load_min` of the rate in use: one more comfortable window; after
//!   `increase_windows` in a row, additive increase by `increase_step` (of the profile rate),
//!   not above `scale_ceiling`. A comfortable window at light load proves nothing about a higher
//!   rate and restarts the count.
//!
//! A cut into LC reservations (below the scale where they fit) also needs the server to have
//! had CPU to spare in the window: when its busiest dataplane thread was working or waiting
//! for a CPU at least `server_busy_max` of the time, the latency came from the server, which
//! a lower device rate does not cure, and the calibrator holds there (`Hold::ServerBusy`).
//!
//! And it needs the device to be slower than its profile: when its p95 is within
//! `device_slower_ratio` of what the profile predicts for the load it was driven at, the
//! device keeps the promise admission made against that profile, and LC reservations are
//! kept (`Hold::DeviceAsProfiled`); after a squeeze, windows within the tighter
//! `device_recovered_ratio` let the scale return to where LC reservations fit (hysteresis: a
//! device that sits near `device_slower_ratio`, such as one exactly twice as slow, must not
//! probe back towards the line on every lucky window).
//!
//! # Unused reservations at the line (`withhold_spare`)
//!
//! At the line where LC reservations just fit, the device rate is theirs, less the best-effort
//! floor; what an LC tenant leaves unused is donated, and best-effort tenants spend it (the
//! paper's work conservation), so the device is driven at the whole rate whatever LC tenants
//! send. When the target is still missed there, what they leave is not spare: every window
//! over the target at or below the line also cuts the *spare share* (the share of donations
//! best-effort tenants may spend, [`crate::TenantRegistry::set_spare_share`]) by the same
//! proportional law, to zero below [`SPARE_SHARE_SNAP`]. It comes back by `spare_release_step`
//! on the comfortable windows that would otherwise raise the scale (except those returning a
//! squeezed scale to the line, which come first), and all at once when no LC tenant is left.
//!
//! # A squeeze that does not help (`squeeze_futile_windows`, off by default)
//!
//! Cutting into LC reservations is worth it only if the device's latency follows its rate. On a
//! device that stalls whatever it is given (the VM disk of `docs/QOS.md` §10), a squeeze leaves
//! the p95 where it was and only queues LC requests, so QoS ends up worse than FIFO for them.
//! With the check on, once the last `squeeze_futile_windows` evidence windows below the line
//! (leaving out those still draining a cut, `decrease_hold_windows`) have a median p95 of at
//! least `squeeze_futile_ratio` × the (smoothed) p95 at or above the line, cutting buys
//! nothing here: the scale returns to the line where LC reservations fit, with the whole spare
//! share (`Action::Restored`), and no cut at all is made for `squeeze_futile_hold_windows`
//! evidence windows (`Hold::SqueezeFutile`). Best-effort tenants stay cut to the line, so LC
//! tenants get more of the device than FIFO would give them. Sooner still, each step into LC
//! reservations is judged when the next is due: a step that left the p95 within that ratio of
//! the line's (neither lower nor a growing backlog) in every window since gives the device
//! back the same way, and so does a step the tenants ignored (their queue, at the schedulers
//! and in their clients as they REPORT it, kept growing).
//!
//! For a fixed state, the new scale never increases with `p` (tested, with the futility check
//! off: on, a p95 that shows a squeeze futile gives the device back).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::time::Nanos;

/// Most recent windows kept for metrics.
pub const RECENT_WINDOWS_MAX: usize = 32;

/// The largest ceiling a configuration may set (twice the profile's rate).
pub const SCALE_CEILING_MAX: f64 = 2.0;

/// How near the line where LC reservations fit counts as on it, relative. The scale arrives at
/// the line by a clamp, and the line is derived from integer token rates, so it moves by about
/// 1e-8 from one window to the next: with a margin of 1e-9, reflexd "returned" to the line by
/// steps of 6e-9 every few windows (a log line and a rate update each, and no spare share given
/// back meanwhile).
const FIT_MARGIN: f64 = 1e-6;

/// Most windows the futility check may judge a squeeze over.
pub const SQUEEZE_FUTILE_WINDOWS_MAX: u32 = 100;

/// Weight of a window at or above the line in the smoothed p95 there (the futility check's
/// reference).
const LINE_P95_WEIGHT: f64 = 0.25;

/// Windows in a row after a step into LC reservations in which the LC tenants' queue stayed
/// grown and did not shrink before the step is judged ignored.
const STEP_IGNORED_WINDOWS: u32 = 2;

/// LC tenants' queue at the schedulers since the last step into their reservations.
#[derive(Clone, Copy, Debug)]
struct StepQueue {
    at_step: u64,
    last: u64,
    windows_not_shrinking: u32,
}

/// A spare share cut below this withholds everything (a multiplicative cut never reaches 0).
pub const SPARE_SHARE_SNAP: f64 = 0.05;

/// The calibrator's knobs; every field optional in TOML. Defaults in `docs/QOS.md` §11.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CalibratorConfig {
    /// Whether reflexd calibrates online at all (on namespaces with a profile, QoS on). Off by
    /// default: it throttles best-effort tenants first (down to `best_effort_floor`) and
    /// changes what admission promises, and on the real server it still cuts too deep at
    /// the profile's operating point (docs/QOS.md §11).
    pub enabled: bool,
    /// Once a cut has taken the rate below the profile's, the share of it that best-effort
    /// tenants keep however far the cut goes: LC admission and further cuts leave it to them
    /// (without it, a cut to what LC reservations need left newcomers, who are best effort,
    /// waiting up to 0.7 s in `bench/overload.sh`).
    pub best_effort_floor: f64,
    /// The part of an LC SLO that the server never measures (network, the client's own
    /// wake-ups), µs, on top of what it learns itself; the target is the SLO minus both.
    pub client_share_us: u64,
    /// Learn the network's share: add the window's p95 of the smoothed TCP round-trip times
    /// of connections carrying LC reads (sampled by the dataplane) to `client_share_us`.
    pub learn_network_rtt: bool,
    /// Learn the whole share outside the server from what latency-critical tenants' clients
    /// report (native REPORT, `docs/PROTOCOL.md` §1.9): a window's sample is a client's
    /// reported p95 less the server's own p95 of the same window (normalised to the strictest
    /// SLO). It includes what round trips cannot show (a client's wake-ups and its CPU's other
    /// work) and, where reports come, takes the place of the round-trip estimate.
    pub learn_client_reports: bool,
    /// The learned network share is at most this share of the SLO: a round trip longer than
    /// that is the client's or the network's trouble, which no device rate cures (connections
    /// just opened reported 495 µs on loopback, which left a 500 µs SLO a 5 µs target).
    pub network_share_max: f64,
    /// Which quantile of a window's sampled round trips is the network's share. The median,
    /// not the p95: the tenant's p95 is that of the sum of device and network time, which is
    /// about the device's p95 plus the network's typical time, while adding the two p95s
    /// overstates it (and a loopback round trip's tail is the client's delayed
    /// acknowledgements: p95 above 1 ms against a p50 near 200 µs here).
    pub network_share_quantile: f64,
    /// Weight of a window's sample in the smoothed share (1: no smoothing): one window's
    /// round trips must not swing the target, and with it the rate, from one window to the
    /// next.
    pub network_share_weight: f64,
    /// One observation window: the integrator closes one every this long.
    pub window_us: u64,
    /// Fewest LC reads a window needs to count as evidence (at 100 the p95 is the 5th-slowest
    /// read, not a single outlier).
    pub samples_min: u64,
    /// The scale never goes below this (a device 5x slower than its profile is broken, not
    /// drifting; the floor keeps a burst of bad windows from starving every tenant).
    pub scale_floor: f64,
    /// The scale never goes above this; 1.0 = never trust the device beyond its profile.
    pub scale_ceiling: f64,
    /// Decrease per window = `decrease_gain` × relative overshoot `(p95 − target) / p95`...
    pub decrease_gain: f64,
    /// ...at most this share of the scale in one window.
    pub decrease_step_max: f64,
    /// After a decrease, this many windows in which a still-too-high but falling p95 does not
    /// cut again (the last cut is still draining the backlog).
    pub decrease_hold_windows: u32,
    /// A cut stops at the scale where LC reservations still fit (best-effort tenants lose
    /// their share first); cutting below it, into LC reservations, takes this many windows
    /// over the target in a row there.
    pub lc_squeeze_windows: u32,
    /// ...or, from the second such window on, as soon as their p95s add up to this many
    /// targets: a device whose backlog grows (p95 many times the target) is cut into within
    /// two windows, while a short run of merely high windows (a busy host's hiccups: 1.5–2.5
    /// targets each on this VM) waits for `lc_squeeze_windows`.
    pub lc_squeeze_overshoot: f64,
    /// Increase per step, as a share of the profile's rate.
    pub increase_step: f64,
    /// Comfortable windows in a row before one increase step.
    pub increase_windows: u32,
    /// A window is comfortable when its p95 is below this share of the target; between it and
    /// the target lies the hysteresis band, where nothing changes.
    pub comfort_ratio: f64,
    /// The windows aim at this share of the target (1.0: the target itself). A tenant judges
    /// its SLO over longer intervals than one window, and a scale whose windows sit just
    /// under the target leaves those intervals over it now and then (the simulator's
    /// slowdown scenario: B over 500 µs in 1–3 intervals of 250 ms per run at 1.0, in none
    /// at 0.9).
    pub target_ratio: f64,
    /// A comfortable window counts only if the tokens spent in it were at least this share of
    /// what the rate in use allowed (a light load says nothing about a higher rate).
    pub increase_load_min: f64,
    /// A window in which the busiest dataplane thread was working or waiting for a CPU at
    /// least this share of the time says the server, not the device, was slow: no cut into
    /// LC reservations (a flood of connections raised the latency in `bench/overload.sh`
    /// while the device was as fast as ever). 1.0: never hold for this.
    pub server_busy_max: f64,
    /// A cut into LC reservations also needs the device to be slower than its profile: its
    /// p95 above this multiple of what the profile predicts for the load it was driven at.
    /// A device that answers as profiled at that load is not what breaks the target (the
    /// client's share is, or the server's time), and LC reservations were promised against
    /// that profile: best-effort tenants stay at their floor and LC reservations are kept
    /// (the real-server collapse of docs/QOS.md §11 was such squeezes, on noise).
    pub device_slower_ratio: f64,
    /// After a squeeze, the scale returns towards the line where LC reservations fit only on
    /// windows whose p95 is at most this multiple of the profile's prediction (and under the
    /// target). Tighter than `device_slower_ratio` (the smaller of the two is used), so the
    /// two thresholds make a hysteresis band: a device exactly twice as slow as its profile
    /// answers within 2× of it on some windows, and each such window used to start a probe
    /// back up that cost its LC tenants an interval or two over the SLO.
    pub device_recovered_ratio: f64,
    /// Over the target at the line where LC reservations fit, withhold what LC tenants leave
    /// unused from best-effort tenants (module documentation); off: they spend it all, as in
    /// the paper.
    pub withhold_spare: bool,
    /// How much of the donations a comfortable step gives back to best-effort tenants.
    pub spare_release_step: f64,
    /// Evidence windows below the line where LC reservations fit after which a squeeze that
    /// did not lower the p95 is given up (module documentation); 0: never (the default).
    pub squeeze_futile_windows: u32,
    /// A squeeze is futile when its windows' median p95 is at least this share of the smoothed
    /// p95 at or above the line.
    pub squeeze_futile_ratio: f64,
    /// After a futile squeeze, evidence windows in which no cut is made.
    pub squeeze_futile_hold_windows: u32,
}

impl Default for CalibratorConfig {
    fn default() -> CalibratorConfig {
        CalibratorConfig {
            enabled: false,
            best_effort_floor: 0.05,
            client_share_us: 0,
            learn_network_rtt: true,
            learn_client_reports: true,
            network_share_max: 0.5,
            network_share_quantile: 0.5,
            network_share_weight: 0.2,
            window_us: 100_000,
            samples_min: 100,
            scale_floor: 0.2,
            scale_ceiling: 1.0,
            decrease_gain: 1.0,
            decrease_step_max: 0.3,
            decrease_hold_windows: 3,
            lc_squeeze_windows: 2,
            lc_squeeze_overshoot: 10.0,
            increase_step: 0.05,
            increase_windows: 3,
            comfort_ratio: 0.8,
            target_ratio: 1.0,
            increase_load_min: 0.5,
            server_busy_max: 0.9,
            device_slower_ratio: 2.0,
            device_recovered_ratio: 1.5,
            withhold_spare: true,
            spare_release_step: 0.1,
            squeeze_futile_windows: 0,
            squeeze_futile_ratio: 0.8,
            squeeze_futile_hold_windows: 50,
        }
    }
}

/// Why a calibrator configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CalibratorConfigError {
    #[error("calibrator configuration field {field} {reason}")]
    Invalid {
        field: &'static str,
        reason: &'static str,
    },
}

impl CalibratorConfig {
    pub fn window(&self) -> Nanos {
        Nanos::from_micros(self.window_us)
    }

    /// Checks each knob's range and the relations between them.
    pub fn validate(&self) -> Result<(), CalibratorConfigError> {
        let invalid = |field, reason| Err(CalibratorConfigError::Invalid { field, reason });
        let fraction = |value: f64| value.is_finite() && value > 0.0 && value < 1.0;
        if self.window_us == 0 || self.window_us > 60_000_000 {
            return invalid("window_us", "must be between 1 µs and 60 s");
        }
        if self.samples_min == 0 {
            return invalid("samples_min", "must be at least 1");
        }
        if !(self.best_effort_floor.is_finite() && (0.0..0.5).contains(&self.best_effort_floor)) {
            return invalid("best_effort_floor", "must be at least 0 and below 0.5");
        }
        if !(self.scale_floor.is_finite() && self.scale_floor > 0.0) {
            return invalid("scale_floor", "must be positive");
        }
        if !(self.scale_ceiling.is_finite() && self.scale_ceiling <= SCALE_CEILING_MAX) {
            return invalid("scale_ceiling", "must be at most 2.0");
        }
        if self.scale_floor > self.scale_ceiling {
            return invalid("scale_floor", "must not exceed scale_ceiling");
        }
        if !(self.decrease_gain.is_finite() && self.decrease_gain > 0.0) {
            return invalid("decrease_gain", "must be positive");
        }
        if !fraction(self.decrease_step_max) {
            return invalid("decrease_step_max", "must be between 0 and 1 (exclusive)");
        }
        if !fraction(self.increase_step) {
            return invalid("increase_step", "must be between 0 and 1 (exclusive)");
        }
        if !(self.network_share_max.is_finite() && (0.0..1.0).contains(&self.network_share_max)) {
            return invalid("network_share_max", "must be at least 0 and below 1");
        }
        let share = |value: f64| value.is_finite() && value > 0.0 && value <= 1.0;
        if !share(self.network_share_quantile) {
            return invalid("network_share_quantile", "must be above 0 and at most 1");
        }
        if !share(self.network_share_weight) {
            return invalid("network_share_weight", "must be above 0 and at most 1");
        }
        if !(self.lc_squeeze_overshoot.is_finite() && self.lc_squeeze_overshoot >= 1.0) {
            return invalid("lc_squeeze_overshoot", "must be at least 1");
        }
        if self.lc_squeeze_windows == 0 {
            return invalid("lc_squeeze_windows", "must be at least 1");
        }
        if self.increase_windows == 0 {
            return invalid("increase_windows", "must be at least 1");
        }
        if !fraction(self.comfort_ratio) {
            return invalid("comfort_ratio", "must be between 0 and 1 (exclusive)");
        }
        if !share(self.target_ratio) {
            return invalid("target_ratio", "must be above 0 and at most 1");
        }
        if !(self.increase_load_min.is_finite() && (0.0..=1.0).contains(&self.increase_load_min)) {
            return invalid("increase_load_min", "must be between 0 and 1");
        }
        if !(self.server_busy_max.is_finite()
            && self.server_busy_max > 0.0
            && self.server_busy_max <= 1.0)
        {
            return invalid(
                "server_busy_max",
                "must be above 0 and at most 1 (1: never hold)",
            );
        }
        if !(self.device_slower_ratio.is_finite() && self.device_slower_ratio >= 1.0) {
            return invalid("device_slower_ratio", "must be at least 1");
        }
        if !(self.device_recovered_ratio.is_finite() && self.device_recovered_ratio >= 1.0) {
            return invalid("device_recovered_ratio", "must be at least 1");
        }
        if !share(self.spare_release_step) {
            return invalid("spare_release_step", "must be above 0 and at most 1");
        }
        if self.squeeze_futile_windows > SQUEEZE_FUTILE_WINDOWS_MAX {
            return invalid("squeeze_futile_windows", "must be at most 100");
        }
        if !(self.squeeze_futile_ratio.is_finite()
            && self.squeeze_futile_ratio > 0.0
            && self.squeeze_futile_ratio <= 2.0)
        {
            return invalid("squeeze_futile_ratio", "must be above 0 and at most 2");
        }
        Ok(())
    }
}

/// What the integrator measured in one window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowObservation {
    /// Latency-critical reads that completed in the window.
    pub lc_reads: u64,
    /// Their p95 latency at the device (from submission to the device to completion, µs):
    /// not the time queued at the scheduler, which reflects a tenant's own excess, not the
    /// device.
    pub lc_read_latency_us_p95: u64,
    /// The strictest LC p95 SLO on the device (µs); `None` without LC tenants.
    pub slo_latency_us_p95: Option<u64>,
    /// The part of that SLO the device never sees (network, client; µs); the target is the
    /// SLO minus this, at least 1 µs.
    pub client_share_us: u64,
    /// The device token rate the schedulers granted in the window (profile rate × scale).
    pub tokens_per_sec_in_use: f64,
    /// Tokens the schedulers charged in the window, all tenants: how hard the device was driven.
    pub tokens_spent: f64,
    /// The scale at which Σ LC reservations take the whole LC budget (the device rate less
    /// the best-effort floor; `None` without LC tenants): above it a cut only takes from
    /// best-effort tenants; below it, from LC reservations, which needs more evidence
    /// (`lc_squeeze_windows`).
    pub lc_fit_scale: Option<f64>,
    /// The largest share of the window any dataplane thread serving the device spent working
    /// or waiting for a CPU (0 where nobody measures it, as in the simulator).
    pub server_busy: f64,
    /// The p95 the device's profile predicts at the token rate the window actually drove
    /// (µs; `None` without a profile): LC reservations are cut only when the device is
    /// slower than this (`device_slower_ratio`).
    pub profile_p95_at_load_us: Option<u64>,
    /// Requests of latency-critical tenants waiting when the window ended: at the schedulers
    /// for tokens (the largest any thread reported) plus, in their clients, due and not yet
    /// sent (the largest backlog a REPORT gave); `None` where nobody counts them. After a step
    /// into LC reservations, a queue that keeps growing says the tenants over the new grant
    /// did not slow down when told.
    pub lc_queued_requests: Option<u64>,
}

impl WindowObservation {
    /// The device answered as its profile says at the load it was driven at.
    fn device_as_profiled(&self, p95_us: u64, ratio: f64) -> bool {
        self.profile_p95_at_load_us
            .is_some_and(|predicted| p95_us as f64 <= predicted as f64 * ratio)
    }

    /// The device-side p95 target, µs.
    pub fn target_us(&self) -> Option<u64> {
        self.slo_latency_us_p95
            .map(|slo| slo.saturating_sub(self.client_share_us).max(1))
    }
}

/// An observation the calibrator cannot use (an integrator's bug; nothing changes).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ObservationError {
    #[error("window ends at {now:?}, before the previous one ({previous:?})")]
    TimeWentBack { now: Nanos, previous: Nanos },
    #[error("observation field {field} must be finite and non-negative, got {value}")]
    InvalidNumber { field: &'static str, value: f64 },
}

/// Why a window changed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// No LC tenant: no latency target.
    NoTarget,
    /// Fewer than `samples_min` LC reads.
    TooFewSamples,
    /// p95 between `comfort_ratio × target` and the target.
    InBand,
    /// Over the target at the scale where LC reservations just fit: waiting for
    /// `lc_squeeze_windows` such windows before cutting into them.
    ProtectingLc { count: u32 },
    /// Above the target but falling, within `decrease_hold_windows` of the last cut.
    Settling,
    /// Below the band, `count` comfortable windows in a row so far.
    Comfortable { count: u32 },
    /// Below the band at a light load: no evidence for more.
    LightLoad,
    /// Over the target where LC reservations just fit, but the server's threads were busy
    /// (`server_busy_max`): the latency is the server's, not the device's.
    ServerBusy,
    /// Over the target where LC reservations just fit, but the device answered as its profile
    /// predicts for the load (`device_slower_ratio`): LC reservations are kept.
    DeviceAsProfiled,
    /// A cut was due, but the last squeeze into LC reservations did not lower the p95
    /// (`squeeze_futile_windows`): `remaining` more windows before one is tried again.
    SqueezeFutile { remaining: u32 },
    /// A decrease was due but the scale is at the floor.
    AtFloor,
    /// An increase was due but the scale is at the ceiling.
    AtCeiling,
}

/// What the calibrator did with a window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Action {
    /// Multiplicative decrease; `overshoot` = p95 / target.
    Decreased {
        from: f64,
        overshoot: f64,
    },
    /// Additive increase.
    Increased {
        from: f64,
    },
    /// Back up to the line where LC reservations fit from `from`, the spare share given back:
    /// a squeeze below that line did not lower the p95, or the tenants squeezed kept sending
    /// (`squeeze_futile_windows`).
    Restored {
        from: f64,
    },
    /// The scale held, and the spare share was raised from `from` (`spare_release_step`).
    Released {
        from: f64,
    },
    Held(Hold),
}

/// The answer to one window: the scale and the spare share to apply from now on, and why.
/// (A window over the target at the line cuts the spare share whatever its action says.)
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub scale: f64,
    /// The share of donated tokens best-effort tenants may spend (module documentation).
    pub spare_share: f64,
    pub action: Action,
}

/// One window, for metrics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WindowRecord {
    pub window_end: Nanos,
    pub lc_reads: u64,
    pub lc_read_latency_us_p95: u64,
    /// `None` without LC tenants.
    pub target_us: Option<u64>,
    pub action: Action,
    pub scale_after: f64,
    pub spare_share_after: f64,
}

/// Counters for metrics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CalibratorStats {
    pub scale: f64,
    pub windows: u64,
    /// Windows with a target and at least `samples_min` LC reads.
    pub windows_with_evidence: u64,
    /// Evidence windows whose p95 was above the target.
    pub windows_over_target: u64,
    pub decreases: u64,
    pub increases: u64,
    /// The lowest scale reached so far.
    pub scale_min: f64,
    /// The share of donations best-effort tenants may spend.
    pub spare_share: f64,
    /// Windows that lowered the spare share, and that raised it.
    pub spare_withholds: u64,
    pub spare_releases: u64,
    /// Squeezes given up as futile (`squeeze_futile_windows`).
    pub futile_squeezes: u64,
}

/// The online calibrator of one device (control-plane state, like the registry).
#[derive(Clone, Debug)]
pub struct Calibrator {
    config: CalibratorConfig,
    scale: f64,
    spare_share: f64,
    /// End of the previous window (start of the current one).
    window_start: Nanos,
    comfortable_windows: u32,
    /// Windows since the last decrease; `None` before the first.
    windows_since_decrease: Option<u32>,
    /// Windows over the target in a row at or below the LC-fit scale.
    squeeze_windows: u32,
    /// Σ p95 / target over those windows.
    squeeze_overshoot: f64,
    /// The p95 of the previous evidence window.
    p95_previous_us: Option<u64>,
    /// The smoothed p95 of evidence windows at or above the line where LC reservations fit.
    line_p95_us: Option<f64>,
    /// The p95s of the last `squeeze_futile_windows` evidence windows below that line that
    /// were not draining a cut (oldest first).
    squeezed_p95_us: VecDeque<u64>,
    /// Evidence windows left in which no cut is made (after a futile squeeze).
    futile_hold: u32,
    /// The lowest and highest p95 of the evidence windows since the last cut below the line
    /// where LC reservations fit (`None`: no such cut to judge): the next squeeze is made
    /// only if this one moved the p95 ([`Calibrator::last_squeeze_futile`]).
    since_squeeze_p95_us: Option<(u64, u64)>,
    /// LC tenants' queue after the last step into their reservations
    /// ([`Calibrator::lc_tenants_ignore_the_squeeze`]).
    step_lc_queued: Option<StepQueue>,
    stats: CalibratorStats,
    recent: VecDeque<WindowRecord>,
}

impl Calibrator {
    /// A calibrator starting at the ceiling (the profile is trusted until the device says
    /// otherwise), with its first window starting at `now`.
    pub fn new(config: CalibratorConfig, now: Nanos) -> Result<Calibrator, CalibratorConfigError> {
        config.validate()?;
        let scale = config.scale_ceiling;
        Ok(Calibrator {
            config,
            scale,
            spare_share: 1.0,
            window_start: now,
            comfortable_windows: 0,
            windows_since_decrease: None,
            squeeze_windows: 0,
            squeeze_overshoot: 0.0,
            p95_previous_us: None,
            line_p95_us: None,
            squeezed_p95_us: VecDeque::new(),
            futile_hold: 0,
            since_squeeze_p95_us: None,
            step_lc_queued: None,
            stats: CalibratorStats {
                scale,
                windows: 0,
                windows_with_evidence: 0,
                windows_over_target: 0,
                decreases: 0,
                increases: 0,
                scale_min: scale,
                spare_share: 1.0,
                spare_withholds: 0,
                spare_releases: 0,
                futile_squeezes: 0,
            },
            recent: VecDeque::with_capacity(RECENT_WINDOWS_MAX),
        })
    }

    pub fn config(&self) -> &CalibratorConfig {
        &self.config
    }

    /// The scale in force: the device rate is the profile's rate × this.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// The share of donated tokens best-effort tenants may spend.
    pub fn spare_share(&self) -> f64 {
        self.spare_share
    }

    /// When the current window started (the previous one's end).
    pub fn window_start(&self) -> Nanos {
        self.window_start
    }

    /// What a window's p95 is held to (µs): the observation's target (the SLO less the
    /// client's share) times `target_ratio`; `None` without an LC SLO.
    pub fn target_us(&self, observation: &WindowObservation) -> Option<u64> {
        observation
            .target_us()
            .map(|target| ((target as f64 * self.config.target_ratio) as u64).max(1))
    }

    /// When the current window should be closed.
    pub fn next_deadline(&self) -> Nanos {
        Nanos(self.window_start.0.saturating_add(self.config.window().0))
    }

    pub fn stats(&self) -> CalibratorStats {
        self.stats
    }

    /// The most recent windows (at most [`RECENT_WINDOWS_MAX`]), oldest first.
    pub fn recent(&self) -> impl Iterator<Item = &WindowRecord> {
        self.recent.iter()
    }

    /// Closes the window that ends at `now` with what was measured in it and returns the scale
    /// to apply. An invalid observation changes nothing.
    pub fn handle_window(
        &mut self,
        now: Nanos,
        observation: &WindowObservation,
    ) -> Result<Decision, ObservationError> {
        if now < self.window_start {
            return Err(ObservationError::TimeWentBack {
                now,
                previous: self.window_start,
            });
        }
        for (field, value) in [
            ("tokens_per_sec_in_use", observation.tokens_per_sec_in_use),
            ("tokens_spent", observation.tokens_spent),
            ("server_busy", observation.server_busy),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(ObservationError::InvalidNumber { field, value });
            }
        }
        let duration = now.saturating_since(self.window_start);
        self.window_start = now;
        self.stats.windows += 1;
        if let Some(windows) = self.windows_since_decrease.as_mut() {
            *windows = windows.saturating_add(1);
        }
        let before = self.scale;
        let spare_before = self.spare_share;
        let action = self.decide(duration, observation);
        assert!(
            (0.0..=1.0).contains(&self.spare_share),
            "spare share {}",
            self.spare_share
        );
        assert!(
            self.config.withhold_spare || self.spare_share == 1.0,
            "spare withheld while withholding is off"
        );
        assert!(
            self.scale >= self.config.scale_floor && self.scale <= self.config.scale_ceiling,
            "scale {} outside [{}, {}]",
            self.scale,
            self.config.scale_floor,
            self.config.scale_ceiling
        );
        match action {
            Action::Decreased { .. } => {
                assert!(self.scale < before, "a decrease lowers the scale");
                self.stats.decreases += 1;
            }
            Action::Increased { .. } => {
                assert!(self.scale > before, "an increase raises the scale");
                self.stats.increases += 1;
            }
            Action::Restored { from } => {
                assert!(
                    from == before && self.scale > before,
                    "a restore raises the scale"
                );
                self.stats.futile_squeezes += 1;
            }
            Action::Released { from } => {
                assert!(self.scale == before, "a release keeps the scale");
                assert!(
                    from == spare_before && self.spare_share > from,
                    "a release raises"
                );
            }
            Action::Held(_) => assert!(self.scale == before, "a hold keeps the scale"),
        }
        if self.spare_share < spare_before {
            self.stats.spare_withholds += 1;
        } else if self.spare_share > spare_before {
            self.stats.spare_releases += 1;
        }
        self.stats.spare_share = self.spare_share;
        self.stats.scale = self.scale;
        self.stats.scale_min = self.stats.scale_min.min(self.scale);
        if self.recent.len() == RECENT_WINDOWS_MAX {
            self.recent.pop_front();
        }
        self.recent.push_back(WindowRecord {
            window_end: now,
            lc_reads: observation.lc_reads,
            lc_read_latency_us_p95: observation.lc_read_latency_us_p95,
            target_us: self.target_us(observation),
            action,
            scale_after: self.scale,
            spare_share_after: self.spare_share,
        });
        Ok(Decision {
            scale: self.scale,
            spare_share: self.spare_share,
            action,
        })
    }

    /// Cuts the spare share by `cut` (a share of it), to zero below [`SPARE_SHARE_SNAP`]; a
    /// cut starts the settling hold like a decrease of the scale.
    fn withhold_spare(&mut self, cut: f64) {
        if !self.config.withhold_spare || self.spare_share == 0.0 {
            return;
        }
        let share = self.spare_share * (1.0 - cut);
        self.spare_share = if share < SPARE_SHARE_SNAP { 0.0 } else { share };
        self.windows_since_decrease = Some(0);
    }

    /// The futility check (module documentation): tracks the p95 at or above the line where
    /// LC reservations fit and below it, and gives the device back to that line (with the
    /// whole spare share) when a squeeze did not lower it or the tenants ignored it.
    fn give_up_futile_squeeze(
        &mut self,
        p95_us: u64,
        observation: &WindowObservation,
    ) -> Option<Action> {
        let windows = self.config.squeeze_futile_windows as usize;
        if windows == 0 {
            return None;
        }
        self.futile_hold = self.futile_hold.saturating_sub(1);
        let Some(fit) = observation.lc_fit_scale else {
            self.forget_squeeze_evidence();
            return None;
        };
        if !self.squeezed_below(fit) {
            // At the line or above it (where best-effort tenants pay): no squeeze to judge.
            let line = self.line_p95_us.get_or_insert(p95_us as f64);
            *line += LINE_P95_WEIGHT * (p95_us as f64 - *line);
            self.forget_squeeze_evidence();
            return None;
        }
        if self.lc_tenants_ignore_the_squeeze(observation) {
            return Some(self.restore(fit));
        }
        // A window still draining the backlog of the rate before a cut says nothing about the
        // rate after it.
        if self.within_decrease_hold() {
            return None;
        }
        if self.squeezed_p95_us.len() == windows {
            self.squeezed_p95_us.pop_front();
        }
        self.squeezed_p95_us.push_back(p95_us);
        let line = self.line_p95_us?;
        if self.squeezed_p95_us.len() < windows {
            return None;
        }
        // The median: one stall (or one quiet window) must not decide.
        let mut sorted: Vec<u64> = self.squeezed_p95_us.iter().copied().collect();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2] as f64;
        if median < self.config.squeeze_futile_ratio * line {
            return None;
        }
        Some(self.restore(fit))
    }

    /// Cutting into LC reservations buys nothing on this device: back to the line where they
    /// fit (`fit`, capped at the ceiling), what LC tenants leave is spare again, and no cut
    /// at all for the hold. Best-effort tenants stay cut to the line: they pay first, so LC
    /// tenants get more of the device than FIFO would give them (the whole device, as the
    /// first version gave back, let best effort take from them as under FIFO).
    fn restore(&mut self, fit: f64) -> Action {
        let from = self.scale;
        self.scale = fit.min(self.config.scale_ceiling);
        if self.config.withhold_spare {
            self.spare_share = 1.0;
        }
        self.futile_hold = self.config.squeeze_futile_hold_windows;
        self.comfortable_windows = 0;
        self.forget_squeeze_evidence();
        self.reset_squeeze();
        Action::Restored { from }
    }

    /// Whether the scale is below the line where LC reservations fit (`fit`, capped at the
    /// ceiling): LC tenants are squeezed.
    fn squeezed_below(&self, fit: f64) -> bool {
        self.scale < fit.min(self.config.scale_ceiling) * (1.0 - FIT_MARGIN)
    }

    /// Drops what the futility check gathered about the squeeze in force (there is none, or it
    /// ended).
    fn forget_squeeze_evidence(&mut self) {
        self.squeezed_p95_us.clear();
        self.since_squeeze_p95_us = None;
        self.step_lc_queued = None;
    }

    /// Whether the LC tenants over the grant of the last step into their reservations kept
    /// sending as before: for [`STEP_IGNORED_WINDOWS`] windows in a row, their queue (at the
    /// schedulers, and in their clients as they REPORT it) stood at least a tenth of the
    /// window's LC reads above where it was at the step and did not shrink. A squeeze is worth
    /// it only for tenants that slow down when told (RENEGOTIATE); for the others, a grant
    /// below their rate turns a saving at the device into a queue that grows without bound
    /// (the VM disk, docs/QOS.md §11: the disk's p95 fell to 130–250 µs while the tenants
    /// waited seconds), so the device is given back.
    fn lc_tenants_ignore_the_squeeze(&mut self, observation: &WindowObservation) -> bool {
        let (Some(step), Some(now)) =
            (self.step_lc_queued.as_mut(), observation.lc_queued_requests)
        else {
            return false;
        };
        // Grown by a tenth of the window's reads since the step and not shrinking: one window
        // may grow while the notices are on their way (tenants that follow them shrink it in
        // the next), and a queue at its limit stops growing without shrinking.
        let grown = now
            >= step
                .at_step
                .saturating_add((observation.lc_reads / 10).max(1));
        step.windows_not_shrinking = if grown && now >= step.last {
            step.windows_not_shrinking + 1
        } else {
            0
        };
        step.last = now;
        step.windows_not_shrinking >= STEP_IGNORED_WINDOWS
    }

    /// Whether the last squeeze step (a cut below the line) left the p95 where it was: in no
    /// window since below `squeeze_futile_ratio` × the line's, and in none above the line's
    /// divided by that ratio either (a p95 that kept growing is a backlog the step was too
    /// small to stop, as on a device that became much slower, and the next step is due). Then
    /// the next step would not help either. Judged when the next squeeze is due, so a device
    /// whose latency does not follow its rate is given back after one step into LC
    /// reservations, not after the squeeze has reached the floor (the median check, which
    /// needs windows not draining a cut, found none while every over-target window cut the
    /// spare share or the scale).
    fn last_squeeze_futile(&self) -> bool {
        if self.config.squeeze_futile_windows == 0 {
            return false;
        }
        let ratio = self.config.squeeze_futile_ratio;
        match (self.since_squeeze_p95_us, self.line_p95_us) {
            (Some((lowest, highest)), Some(line)) => {
                lowest as f64 >= ratio * line && highest as f64 <= line / ratio
            }
            _ => false,
        }
    }

    /// Whether the last cut (of the scale or the spare share) is at most
    /// `decrease_hold_windows` windows old: its backlog may still be draining.
    fn within_decrease_hold(&self) -> bool {
        self.windows_since_decrease
            .is_some_and(|windows| windows <= self.config.decrease_hold_windows)
    }

    fn reset_squeeze(&mut self) {
        self.squeeze_windows = 0;
        self.squeeze_overshoot = 0.0;
    }

    /// The control law (module documentation); changes `self.scale` and the streak state.
    fn decide(&mut self, duration: Nanos, observation: &WindowObservation) -> Action {
        let config = &self.config.clone();
        let Some(target_us) = self.target_us(observation) else {
            self.comfortable_windows = 0;
            // No LC tenant: nobody's unused reservation to keep back.
            self.spare_share = 1.0;
            return Action::Held(Hold::NoTarget);
        };
        if observation.lc_reads < config.samples_min {
            self.comfortable_windows = 0;
            return Action::Held(Hold::TooFewSamples);
        }
        self.stats.windows_with_evidence += 1;
        let p95_us = observation.lc_read_latency_us_p95;
        let p95_previous_us = self.p95_previous_us.replace(p95_us);
        if let Some((lowest, highest)) = self.since_squeeze_p95_us.as_mut() {
            *lowest = (*lowest).min(p95_us);
            *highest = (*highest).max(p95_us);
        }
        if let Some(action) = self.give_up_futile_squeeze(p95_us, observation) {
            return action;
        }
        if p95_us > target_us {
            self.stats.windows_over_target += 1;
            self.comfortable_windows = 0;
            let settling = self.within_decrease_hold()
                && p95_previous_us.is_some_and(|previous| p95_us < previous);
            if settling {
                return Action::Held(Hold::Settling);
            }
            if self.futile_hold > 0 {
                self.reset_squeeze();
                return Action::Held(Hold::SqueezeFutile {
                    remaining: self.futile_hold,
                });
            }
            let overshoot = (p95_us - target_us) as f64 / p95_us as f64;
            let cut = (config.decrease_gain * overshoot).min(config.decrease_step_max);
            let mut scale = (self.scale * (1.0 - cut)).max(config.scale_floor);
            if let Some(fit) = observation.lc_fit_scale {
                let at_or_below_fit = self.scale <= fit * (1.0 + FIT_MARGIN);
                if at_or_below_fit {
                    // What LC tenants leave unused is not spare while they miss the target
                    // (whatever happens to the scale below).
                    self.withhold_spare(cut);
                }
                if !at_or_below_fit {
                    // Best-effort tenants first: stop where LC reservations still fit.
                    scale = scale.max(fit.min(config.scale_ceiling));
                } else if config.server_busy_max < 1.0
                    && observation.server_busy >= config.server_busy_max
                {
                    self.reset_squeeze();
                    return Action::Held(Hold::ServerBusy);
                } else if observation.device_as_profiled(p95_us, config.device_slower_ratio) {
                    self.reset_squeeze();
                    return Action::Held(Hold::DeviceAsProfiled);
                } else {
                    self.squeeze_windows += 1;
                    self.squeeze_overshoot += p95_us as f64 / target_us as f64;
                    let persisted = self.squeeze_windows >= config.lc_squeeze_windows
                        || (self.squeeze_windows >= 2
                            && self.squeeze_overshoot >= config.lc_squeeze_overshoot);
                    if !persisted {
                        return Action::Held(Hold::ProtectingLc {
                            count: self.squeeze_windows,
                        });
                    }
                    if self.squeezed_below(fit) && self.last_squeeze_futile() {
                        return self.restore(fit);
                    }
                    if scale < self.scale {
                        // A step into LC reservations: the next one is judged by what it does,
                        // and the tenants by how they answer it.
                        self.since_squeeze_p95_us = Some((u64::MAX, 0));
                        self.step_lc_queued =
                            observation.lc_queued_requests.map(|queued| StepQueue {
                                at_step: queued,
                                last: queued,
                                windows_not_shrinking: 0,
                            });
                    }
                }
            }
            if scale >= self.scale {
                return Action::Held(Hold::AtFloor);
            }
            self.reset_squeeze();
            let from = self.scale;
            self.scale = scale;
            self.windows_since_decrease = Some(0);
            return Action::Decreased {
                from,
                overshoot: p95_us as f64 / target_us as f64,
            };
        }
        self.reset_squeeze();
        // Below the line where LC reservations fit (after a squeeze), a device back to its
        // profile may return to that line: the target is met and the profile vouches for the
        // load there, and the tenants cut are owed their reservations.
        let squeezed = observation
            .lc_fit_scale
            .is_some_and(|fit| self.squeezed_below(fit));
        let recovered_ratio = config
            .device_recovered_ratio
            .min(config.device_slower_ratio);
        let returning = squeezed && observation.device_as_profiled(p95_us, recovered_ratio);
        if !returning && p95_us as f64 >= config.comfort_ratio * target_us as f64 {
            self.comfortable_windows = 0;
            return Action::Held(Hold::InBand);
        }
        let allowed_tokens = observation.tokens_per_sec_in_use * duration.as_secs_f64();
        let load = if allowed_tokens > 0.0 {
            observation.tokens_spent / allowed_tokens
        } else {
            0.0
        };
        if load < config.increase_load_min {
            self.comfortable_windows = 0;
            return Action::Held(Hold::LightLoad);
        }
        self.comfortable_windows += 1;
        if self.comfortable_windows < config.increase_windows {
            return Action::Held(Hold::Comfortable {
                count: self.comfortable_windows,
            });
        }
        self.comfortable_windows = 0;
        if !returning && self.spare_share < 1.0 {
            // A device back to its profile returns to the line first; otherwise what LC
            // tenants leave comes back before any rise of the scale.
            let from = self.spare_share;
            let next = from + config.spare_release_step;
            // Ten steps of 0.1 add up to 0.999…: whole within rounding.
            self.spare_share = if next >= 1.0 - 1e-9 { 1.0 } else { next };
            return Action::Released { from };
        }
        let mut scale = (self.scale + config.increase_step).min(config.scale_ceiling);
        if returning && p95_us as f64 >= config.comfort_ratio * target_us as f64 {
            // Returning in the band: up to the line, not past it.
            let fit = observation.lc_fit_scale.expect("squeezed implies a line");
            scale = scale.min(fit.min(config.scale_ceiling));
        }
        if scale <= self.scale {
            return Action::Held(Hold::AtCeiling);
        }
        let from = self.scale;
        self.scale = scale;
        Action::Increased { from }
    }
}

#[cfg(test)]
mod tests;
