//! Drift: an emulated device that changes speed or stalls, by a schedule in its spec or at run
//! time through a shared handle, so the QoS stack can be tested against a device that stops
//! matching its profile (garbage collection, wear, temperature, a neighbour's writes).
//!
//! # Spec
//!
//! ```text
//! emu:NAME                                   the profile's speed, always
//! emu(KEY=VALUE;...):NAME                    with a schedule, e.g.
//! emu(slow=2x@10s;slow=1x@30s;stall=40s-41s):device-a-small
//! emu(slow=0.5x@0s;origin=zero):/path/x.toml
//! ```
//!
//! The form follows `fault(KEY=VALUE;...):INNER` ([`crate::fault`]): parameters separated by
//! `;` (a `,` is accepted too, but `reflexd -n` splits its own options at commas). Unlike
//! `fault`, `slow` and `stall` may be given several times: each is one step of the schedule.
//!
//! | key | value | effect |
//! |---|---|---|
//! | `slow` | `FACTOR@TIME`, e.g. `2x@10s`, `1x@30s`, `0.5x@1500ms` (`x` optional; 0.1 to 100, at most 3 decimals) | from `TIME` on, every service time is `FACTOR` × the profile's (1x: the profile's speed) |
//! | `stall` | `FROM-TO`, e.g. `40s-41s` | nothing starts in `[FROM, TO)` |
//! | `origin` | `first` (default) or `zero` | what `TIME` is counted from: the first `now` the device sees, or `now` = 0 |
//!
//! Times are a number with a unit, `ns`, `us`, `ms` or `s` (`1.5s` is allowed), at most 24 h.
//! Two `slow` steps at the same time, overlapping or touching stalls, more than
//! [`SCHEDULE_STEPS_MAX`] steps, unknown keys and malformed values are refused with an
//! [`EmuScheduleError`].
//!
//! # What "slower" and "stalled" mean (the exact rule)
//!
//! A slowdown factor multiplies the service time of each piece of work that *starts* while it
//! is in force; work already started keeps its time. A piece of work starts when it is handed
//! to a die or to the controller:
//! - a read when the arbiter fetches its command: each page's die time and the controller time;
//! - a write when it is admitted to the write buffer: its acknowledgement time; each slice of
//!   its background (program + GC) work when that slice reaches its die;
//! - a flush or trim when fetched: the controller time.
//!
//! While stalled, nothing starts: the arbiter fetches no command, writes waiting for buffer
//! room are not admitted, and background slices that reach their die wait. Work started before
//! the stall finishes and completes during it (a read fetched before the stall was already
//! queued on its dies). When the stall ends, the waiting slices reach their dies, waiting writes
//! are admitted and the arbiter fetches, all at that moment and with the factor then in force.
//!
//! Two sources set the state, and they combine: the **schedule** (from the spec, or
//! [`super::EmuDevice::set_schedule`]) and the **run-time handle** ([`EmuControls`]). The
//! factor in force is the schedule's × the handle's; the device is stalled while either says
//! so. A schedule step at time `t` applies before any other event at `t`. A change through the
//! handle applies at the `now` of the device's next call (submit, advance, poll), after the
//! model has been brought to that `now`: in virtual time that is exact and deterministic; in
//! reflexd it is the next loop iteration of any thread using the device.
//!
//! Everything here is deterministic: no clock, no randomness of its own.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use reflex_qos::Nanos;
use thiserror::Error;

/// Slowdowns are kept in thousandths, so service times are scaled in integers.
pub const SLOWDOWN_PERMILLE_ONE: u32 = 1_000;
/// The fastest a slowdown may make the device: 0.1x (ten times faster than the profile).
pub const SLOWDOWN_PERMILLE_MIN: u32 = 100;
/// The slowest: 100x.
pub const SLOWDOWN_PERMILLE_MAX: u32 = 100_000;
/// The latest time a schedule step may name.
pub const SCHEDULE_TIME_MAX: Nanos = Nanos::from_secs(24 * 3600);
/// Most steps in one schedule (`slow` steps plus `stall` windows).
pub const SCHEDULE_STEPS_MAX: usize = 64;
/// How often a device stalled through its handle, with work waiting, asks to be advanced, so
/// a lift made by another thread is seen without unrelated I/O.
pub const CONTROL_RECHECK: Nanos = Nanos::from_millis(1);

/// The keys of `emu(...)`, for the error that refuses an unknown one.
pub const SCHEDULE_KEYS: [&str; 3] = ["slow", "stall", "origin"];

// Service times are at most ~1 s and the combined factor at most 10,000x: far from overflow.
const _: () = assert!(SLOWDOWN_PERMILLE_MIN < SLOWDOWN_PERMILLE_ONE);
const _: () = assert!(SLOWDOWN_PERMILLE_ONE < SLOWDOWN_PERMILLE_MAX);

/// A multiplier on service times, in thousandths: 2000 is twice as slow as the profile, 500
/// twice as fast.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Slowdown(u32);

impl Slowdown {
    /// The profile's speed.
    pub const NONE: Slowdown = Slowdown(SLOWDOWN_PERMILLE_ONE);

    pub fn from_permille(permille: u32) -> Result<Slowdown, EmuScheduleError> {
        if !(SLOWDOWN_PERMILLE_MIN..=SLOWDOWN_PERMILLE_MAX).contains(&permille) {
            return Err(EmuScheduleError::SlowdownRange {
                value: format!("{}x", format_permille(permille)),
            });
        }
        Ok(Slowdown(permille))
    }

    /// `factor` rounded to thousandths; 0.1 to 100.
    pub fn from_factor(factor: f64) -> Result<Slowdown, EmuScheduleError> {
        if !factor.is_finite() {
            return Err(EmuScheduleError::SlowdownRange {
                value: factor.to_string(),
            });
        }
        let permille = (factor * f64::from(SLOWDOWN_PERMILLE_ONE)).round();
        if !(f64::from(SLOWDOWN_PERMILLE_MIN)..=f64::from(SLOWDOWN_PERMILLE_MAX))
            .contains(&permille)
        {
            return Err(EmuScheduleError::SlowdownRange {
                value: factor.to_string(),
            });
        }
        Ok(Slowdown(permille as u32))
    }

    pub fn permille(self) -> u32 {
        self.0
    }

    pub fn factor(self) -> f64 {
        f64::from(self.0) / f64::from(SLOWDOWN_PERMILLE_ONE)
    }
}

impl fmt::Display for Slowdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x", format_permille(self.0))
    }
}

/// The combined factor of the schedule and the handle, in thousandths (up to 10,000x).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Factor(u64);

impl Factor {
    pub(super) fn of(schedule: Slowdown, control: Slowdown) -> Factor {
        Factor(u64::from(schedule.0) * u64::from(control.0) / u64::from(SLOWDOWN_PERMILLE_ONE))
    }

    /// `ns` scaled by the factor (exact at 1x).
    pub(super) fn apply(self, ns: u64) -> u64 {
        if self.0 == u64::from(SLOWDOWN_PERMILLE_ONE) {
            return ns;
        }
        let scaled = u128::from(ns) * u128::from(self.0) / u128::from(SLOWDOWN_PERMILLE_ONE);
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }

    pub(super) fn permille(self) -> u64 {
        self.0
    }
}

/// What schedule times are counted from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ScheduleOrigin {
    /// The first `now` the device sees after the schedule is set (for a spec: the first `now`
    /// it ever sees, i.e. its first I/O or poll).
    #[default]
    FirstNow,
    /// `now` = 0: the simulator's start, the dataplane's clock epoch.
    Zero,
}

/// From `at` on, service times are `slowdown` × the profile's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlowStep {
    pub at: Nanos,
    pub slowdown: Slowdown,
}

/// Nothing starts in `[from, to)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallWindow {
    pub from: Nanos,
    pub to: Nanos,
}

/// A device's schedule of speed changes and stalls. The default changes nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EmuSchedule {
    pub origin: ScheduleOrigin,
    /// Sorted by time, no two at the same time.
    pub slow: Vec<SlowStep>,
    /// Sorted, neither overlapping nor touching, each non-empty.
    pub stalls: Vec<StallWindow>,
}

impl EmuSchedule {
    pub fn is_empty(&self) -> bool {
        self.slow.is_empty() && self.stalls.is_empty()
    }

    /// Sorts the steps and checks what the types cannot.
    pub fn normalize(mut self) -> Result<EmuSchedule, EmuScheduleError> {
        self.slow.sort_by_key(|step| step.at);
        self.stalls.sort_by_key(|window| (window.from, window.to));
        self.validate()?;
        Ok(self)
    }

    /// Checks a sorted schedule: bounded, times in range, no ambiguity.
    pub fn validate(&self) -> Result<(), EmuScheduleError> {
        let steps = self.slow.len() + self.stalls.len();
        if steps > SCHEDULE_STEPS_MAX {
            return Err(EmuScheduleError::TooManySteps { steps });
        }
        for step in &self.slow {
            Slowdown::from_permille(step.slowdown.0)?;
            if step.at > SCHEDULE_TIME_MAX {
                return Err(bad("slow", &format_nanos(step.at), EXPECTED_TIME));
            }
        }
        for pair in self.slow.windows(2) {
            if pair[0].at >= pair[1].at {
                return Err(EmuScheduleError::SameTime {
                    at: format_nanos(pair[1].at),
                });
            }
        }
        for window in &self.stalls {
            if window.from >= window.to || window.to > SCHEDULE_TIME_MAX {
                return Err(bad(
                    "stall",
                    &format!("{}-{}", format_nanos(window.from), format_nanos(window.to)),
                    EXPECTED_STALL,
                ));
            }
        }
        for pair in self.stalls.windows(2) {
            if pair[1].from <= pair[0].to {
                return Err(EmuScheduleError::StallsOverlap {
                    first: format!(
                        "{}-{}",
                        format_nanos(pair[0].from),
                        format_nanos(pair[0].to)
                    ),
                    second: format!(
                        "{}-{}",
                        format_nanos(pair[1].from),
                        format_nanos(pair[1].to)
                    ),
                });
            }
        }
        Ok(())
    }

    /// Parses the parameters between `emu(` and `)` (the module documentation lists them).
    /// An empty text is the empty schedule.
    pub fn parse(text: &str) -> Result<EmuSchedule, EmuScheduleError> {
        let mut schedule = EmuSchedule::default();
        let mut origin_seen = false;
        for item in text.split([';', ',']).map(str::trim) {
            if item.is_empty() {
                if text.trim().is_empty() {
                    continue;
                }
                return Err(EmuScheduleError::EmptyParameter);
            }
            let (key, value) = match item.split_once('=') {
                Some((key, value)) => (key.trim(), value.trim()),
                None => (item, ""),
            };
            let Some(&key) = SCHEDULE_KEYS.iter().find(|known| **known == key) else {
                return Err(EmuScheduleError::UnknownKey {
                    key: key.to_string(),
                });
            };
            if value.is_empty() {
                return Err(EmuScheduleError::MissingValue { key });
            }
            match key {
                "slow" => {
                    let Some((factor, at)) = value.split_once('@') else {
                        return Err(bad(key, value, EXPECTED_SLOW));
                    };
                    let slowdown = parse_factor(factor.trim())
                        .ok_or_else(|| bad(key, value, EXPECTED_SLOW))
                        .and_then(Slowdown::from_permille)?;
                    let at = parse_time(at.trim()).ok_or_else(|| bad(key, value, EXPECTED_SLOW))?;
                    schedule.slow.push(SlowStep { at, slowdown });
                }
                "stall" => {
                    let parsed = value.split_once('-').and_then(|(from, to)| {
                        Some(StallWindow {
                            from: parse_time(from.trim())?,
                            to: parse_time(to.trim())?,
                        })
                    });
                    let window = parsed.ok_or_else(|| bad(key, value, EXPECTED_STALL))?;
                    if window.from >= window.to {
                        return Err(bad(key, value, EXPECTED_STALL));
                    }
                    schedule.stalls.push(window);
                }
                "origin" => {
                    if origin_seen {
                        return Err(EmuScheduleError::Duplicate { key });
                    }
                    origin_seen = true;
                    schedule.origin = match value {
                        "first" => ScheduleOrigin::FirstNow,
                        "zero" => ScheduleOrigin::Zero,
                        other => return Err(bad(key, other, "first or zero")),
                    };
                }
                _ => unreachable!("key {key} is in SCHEDULE_KEYS but not parsed"),
            }
        }
        schedule.normalize()
    }

    /// The state changes of the schedule in time order, with times counted from `origin`:
    /// at equal times a speed change comes first, then a stall's end, then a stall's start.
    pub(super) fn timeline(&self, origin: Nanos) -> Vec<(u64, Change)> {
        let at = |time: Nanos| origin.0.saturating_add(time.0);
        let mut timeline: Vec<(u64, Change)> = self
            .slow
            .iter()
            .map(|step| (at(step.at), Change::Slow(step.slowdown)))
            .chain(self.stalls.iter().flat_map(|window| {
                [
                    (at(window.from), Change::StallBegin),
                    (at(window.to), Change::StallEnd),
                ]
            }))
            .collect();
        timeline.sort_by_key(|&(time, change)| (time, change.order()));
        timeline
    }
}

/// The canonical parameter text: [`EmuSchedule::parse`] of it gives the schedule back.
impl fmt::Display for EmuSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        for step in &self.slow {
            parts.push(format!("slow={}@{}", step.slowdown, format_nanos(step.at)));
        }
        for window in &self.stalls {
            parts.push(format!(
                "stall={}-{}",
                format_nanos(window.from),
                format_nanos(window.to)
            ));
        }
        if self.origin == ScheduleOrigin::Zero {
            parts.push("origin=zero".to_string());
        }
        f.write_str(&parts.join(";"))
    }
}

/// One state change of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    Slow(Slowdown),
    StallEnd,
    StallBegin,
}

impl Change {
    fn order(self) -> u8 {
        match self {
            Change::Slow(_) => 0,
            Change::StallEnd => 1,
            Change::StallBegin => 2,
        }
    }
}

/// Splits `emu(PARAMS):NAME` into its schedule and `NAME`; `emu:NAME` and a bare `NAME` have
/// the empty schedule.
pub fn split_spec(spec: &str) -> Result<(EmuSchedule, &str), EmuScheduleError> {
    let spec = spec.trim();
    let (schedule, name) = if let Some(rest) = spec.strip_prefix("emu(") {
        let Some((params, after)) = rest.split_once(')') else {
            return Err(EmuScheduleError::Unclosed);
        };
        let Some(name) = after.strip_prefix(':') else {
            return Err(EmuScheduleError::MissingColon);
        };
        (EmuSchedule::parse(params)?, name.trim())
    } else {
        (
            EmuSchedule::default(),
            spec.strip_prefix("emu:").unwrap_or(spec).trim(),
        )
    };
    if name.is_empty() {
        return Err(EmuScheduleError::MissingName);
    }
    Ok((schedule, name))
}

/// Why an `emu(...)` schedule was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EmuScheduleError {
    #[error("emu( has no closing ')'")]
    Unclosed,
    #[error(
        "emu(...) must be followed by ':' and the profile, e.g. emu(slow=2x@10s):device-a-small"
    )]
    MissingColon,
    #[error("emu needs a profile name: emu:NAME or emu(KEY=VALUE;...):NAME")]
    MissingName,
    #[error("unknown emu parameter {key:?}; known: {}", SCHEDULE_KEYS.join(", "))]
    UnknownKey { key: String },
    #[error("emu parameter {key} needs a value ({key}=...)")]
    MissingValue { key: &'static str },
    #[error("emu parameter {key} given twice")]
    Duplicate { key: &'static str },
    #[error("empty emu parameter (two separators in a row?)")]
    EmptyParameter,
    #[error("emu parameter {key}={value:?}: expected {expected}")]
    BadValue {
        key: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("slowdown {value} is outside 0.1x to 100x")]
    SlowdownRange { value: String },
    #[error("two slow steps at {at}: give one")]
    SameTime { at: String },
    #[error("stalls {first} and {second} overlap or touch: write one window")]
    StallsOverlap { first: String, second: String },
    #[error("{steps} schedule steps; at most {SCHEDULE_STEPS_MAX}")]
    TooManySteps { steps: usize },
}

const EXPECTED_SLOW: &str = "FACTOR@TIME such as 2x@10s (factor 0.1 to 100, at most 3 decimals; time with a unit ns, us, ms or s, at most 24 h)";
const EXPECTED_STALL: &str =
    "FROM-TO such as 40s-41s (FROM before TO; times with a unit ns, us, ms or s, at most 24 h)";
const EXPECTED_TIME: &str = "a time of at most 24 h";

fn bad(key: &'static str, value: &str, expected: &'static str) -> EmuScheduleError {
    EmuScheduleError::BadValue {
        key,
        value: value.to_string(),
        expected,
    }
}

/// `2x`, `2`, `0.5x`, `1.125x` in thousandths; `None` when malformed or finer than 0.001.
fn parse_factor(text: &str) -> Option<u32> {
    let number = text.strip_suffix(['x', 'X']).unwrap_or(text).trim();
    parse_fixed(number, 3).and_then(|value| u32::try_from(value).ok())
}

/// `10s`, `1.5s`, `250ms`, `100us`, `5ns`; `None` when malformed or beyond 24 h.
fn parse_time(text: &str) -> Option<Nanos> {
    let unit_start = text.find(|c: char| !c.is_ascii_digit() && c != '.')?;
    let (number, unit) = text.split_at(unit_start);
    // The unit says how many decimals of a second-fraction the number may carry in ns.
    let decimals = match unit.trim() {
        "ns" => 0,
        "us" | "µs" => 3,
        "ms" => 6,
        "s" => 9,
        _ => return None,
    };
    let nanos = parse_fixed(number, decimals)?;
    (Nanos(nanos) <= SCHEDULE_TIME_MAX).then_some(Nanos(nanos))
}

/// A decimal number as an integer count of 10^-`decimals` (`parse_fixed("1.5", 3)` = 1500);
/// `None` for anything else, including more decimals than that.
fn parse_fixed(text: &str, decimals: u32) -> Option<u64> {
    let (whole, fraction) = match text.split_once('.') {
        Some((whole, fraction)) => (whole, fraction),
        None => (text, ""),
    };
    if whole.is_empty() || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !fraction.bytes().all(|b| b.is_ascii_digit()) || fraction.len() > decimals as usize {
        return None;
    }
    if text.contains('.') && fraction.is_empty() {
        return None;
    }
    let scale = 10u64.checked_pow(decimals)?;
    let whole: u64 = whole.parse().ok()?;
    let fraction_value: u64 = if fraction.is_empty() {
        0
    } else {
        fraction.parse::<u64>().ok()? * 10u64.pow(decimals - fraction.len() as u32)
    };
    whole.checked_mul(scale)?.checked_add(fraction_value)
}

fn format_permille(permille: u32) -> String {
    let whole = permille / SLOWDOWN_PERMILLE_ONE;
    let fraction = permille % SLOWDOWN_PERMILLE_ONE;
    if fraction == 0 {
        return whole.to_string();
    }
    let digits = format!("{fraction:03}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

fn format_nanos(time: Nanos) -> String {
    let nanos = time.0;
    if nanos == 0 {
        "0s".to_string()
    } else if nanos.is_multiple_of(1_000_000_000) {
        format!("{}s", nanos / 1_000_000_000)
    } else if nanos.is_multiple_of(1_000_000) {
        format!("{}ms", nanos / 1_000_000)
    } else if nanos.is_multiple_of(1_000) {
        format!("{}us", nanos / 1_000)
    } else {
        format!("{nanos}ns")
    }
}

// ----- The run-time handle -------------------------------------------------------------------

/// What the device is doing now, as its last call left it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DriftState {
    /// The factor in force (schedule × handle), in thousandths.
    pub slowdown_permille: u64,
    pub stalled: bool,
    /// Changes of state (factor or stall) so far, from the schedule and the handle.
    pub changes: u64,
}

/// The shared run-time switch of an emulated device: slow it down, speed it up or stall it from
/// any thread (an admin interface, a test). Reachable from an `Arc<dyn Device>` as
/// [`crate::Device::emu_controls`]. The device picks a change up at its next call, at that
/// call's `now` (module documentation).
#[derive(Debug)]
pub struct EmuControls {
    slowdown_permille: AtomicU32,
    stalled: AtomicBool,
    /// Bumped after every change, so the device reads the values only then.
    generation: AtomicU64,
    /// Published by the device after each change of its state.
    state_slowdown_permille: AtomicU64,
    state_stalled: AtomicBool,
    state_changes: AtomicU64,
    /// Commands accepted per submission queue (the last counts every queue from it on): which
    /// priority class a tenant's I/O reached, for operators and end-to-end tests.
    commands_by_queue: [AtomicU64; QUEUES_COUNTED],
}

/// Submission queues [`EmuControls`] counts one by one: the four priority classes' queues.
pub const QUEUES_COUNTED: usize = 4;

impl Default for EmuControls {
    fn default() -> EmuControls {
        EmuControls {
            slowdown_permille: AtomicU32::new(SLOWDOWN_PERMILLE_ONE),
            stalled: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            state_slowdown_permille: AtomicU64::new(u64::from(SLOWDOWN_PERMILLE_ONE)),
            state_stalled: AtomicBool::new(false),
            state_changes: AtomicU64::new(0),
            commands_by_queue: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl EmuControls {
    /// Counts a command the device accepted on submission queue `queue`.
    pub fn record_submission(&self, queue: u16) {
        let index = usize::from(queue).min(QUEUES_COUNTED - 1);
        self.commands_by_queue[index].fetch_add(1, Ordering::Relaxed);
    }

    /// Commands accepted on submission queue `queue` so far (the last counted queue sums
    /// every queue from it on).
    pub fn commands_submitted_in(&self, queue: u16) -> u64 {
        let index = usize::from(queue).min(QUEUES_COUNTED - 1);
        self.commands_by_queue[index].load(Ordering::Relaxed)
    }

    /// Multiplies every service time by `slowdown` (on top of the schedule's factor) for work
    /// that starts from the device's next call on; [`Slowdown::NONE`] undoes it.
    pub fn set_slowdown(&self, slowdown: Slowdown) {
        self.slowdown_permille
            .store(slowdown.permille(), Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Stalls the device (`true`: nothing starts) or lifts this handle's stall (`false`; a
    /// stall of the schedule still holds until it ends).
    pub fn set_stalled(&self, stalled: bool) {
        self.stalled.store(stalled, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The handle's own factor (not the schedule's).
    pub fn slowdown(&self) -> Slowdown {
        Slowdown(self.slowdown_permille.load(Ordering::Acquire))
    }

    /// The handle's own stall (not the schedule's).
    pub fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Acquire)
    }

    /// The device's state as of its last call: schedule and handle combined.
    pub fn state(&self) -> DriftState {
        DriftState {
            slowdown_permille: self.state_slowdown_permille.load(Ordering::Acquire),
            stalled: self.state_stalled.load(Ordering::Acquire),
            changes: self.state_changes.load(Ordering::Acquire),
        }
    }

    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The handle's values, read after `generation` (they are at least that new).
    pub(super) fn requested(&self) -> (Slowdown, bool) {
        (self.slowdown(), self.is_stalled())
    }

    pub(super) fn publish(&self, factor: Factor, stalled: bool) {
        self.state_slowdown_permille
            .store(factor.permille(), Ordering::Release);
        self.state_stalled.store(stalled, Ordering::Release);
        self.state_changes.fetch_add(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expected: &str) {
        match EmuSchedule::parse(text) {
            Ok(schedule) => {
                assert_eq!(schedule.to_string(), expected, "{text}");
                assert_eq!(EmuSchedule::parse(&schedule.to_string()), Ok(schedule));
            }
            Err(error) => assert_eq!(format!("error: {error}"), expected, "{text}"),
        }
    }

    #[test]
    fn schedules_parse_to_their_canonical_text() {
        check("", "");
        check("slow=2x@10s", "slow=2x@10s");
        check(
            "stall=40s-41s; slow=1x@30s, slow=2@10s",
            "slow=2x@10s;slow=1x@30s;stall=40s-41s",
        );
        check("slow=0.5x@1.5s", "slow=0.5x@1500ms");
        check(
            "slow=1.125X@250us;origin=zero",
            "slow=1.125x@250us;origin=zero",
        );
        check("slow=100x@0s;origin=first", "slow=100x@0s");
        check("stall=0ns-1ns", "stall=0s-1ns");
        check(
            "slow=0.1x@24000s;stall=100ms-86400s",
            "slow=0.1x@24000s;stall=100ms-86400s",
        );
    }

    #[test]
    fn bad_schedules_are_refused_with_the_reason() {
        let slow = "FACTOR@TIME such as 2x@10s (factor 0.1 to 100, at most 3 decimals; time \
                    with a unit ns, us, ms or s, at most 24 h)";
        check(
            "fast=2x@1s",
            "error: unknown emu parameter \"fast\"; known: slow, stall, origin",
        );
        check("slow", "error: emu parameter slow needs a value (slow=...)");
        check(
            "slow=2x",
            &format!("error: emu parameter slow=\"2x\": expected {slow}"),
        );
        check(
            "slow=2x@10",
            &format!("error: emu parameter slow=\"2x@10\": expected {slow}"),
        );
        check(
            "slow=2x@25h",
            &format!("error: emu parameter slow=\"2x@25h\": expected {slow}"),
        );
        check(
            "slow=1.0005x@1s",
            &format!("error: emu parameter slow=\"1.0005x@1s\": expected {slow}"),
        );
        check(
            "slow=abcx@1s",
            &format!("error: emu parameter slow=\"abcx@1s\": expected {slow}"),
        );
        check(
            "slow=200x@1s",
            "error: slowdown 200x is outside 0.1x to 100x",
        );
        check(
            "slow=0.05x@1s",
            "error: slowdown 0.05x is outside 0.1x to 100x",
        );
        check(
            "slow=2x@1s;slow=3x@1000ms",
            "error: two slow steps at 1s: give one",
        );
        check(
            "stall=2s-1s",
            "error: emu parameter stall=\"2s-1s\": expected FROM-TO such as 40s-41s (FROM \
             before TO; times with a unit ns, us, ms or s, at most 24 h)",
        );
        check(
            "stall=1s-2s;stall=2s-3s",
            "error: stalls 1s-2s and 2s-3s overlap or touch: write one window",
        );
        check(
            "origin=zero;origin=first",
            "error: emu parameter origin given twice",
        );
        check(
            "origin=later",
            "error: emu parameter origin=\"later\": expected first or zero",
        );
        check(
            "slow=2x@1s;;stall=2s-3s",
            "error: empty emu parameter (two separators in a row?)",
        );
        let many = (0..=SCHEDULE_STEPS_MAX)
            .map(|i| format!("slow=2x@{i}s"))
            .collect::<Vec<_>>()
            .join(";");
        check(&many, "error: 65 schedule steps; at most 64");
    }

    #[test]
    fn specs_split_into_schedule_and_profile() {
        let (schedule, name) = split_spec("emu(slow=2x@10s):device-a-small").unwrap();
        assert_eq!(name, "device-a-small");
        assert_eq!(
            schedule.slow,
            vec![SlowStep {
                at: Nanos::from_secs(10),
                slowdown: Slowdown::from_factor(2.0).unwrap()
            }]
        );
        let (schedule, name) = split_spec("emu:device-a").unwrap();
        assert!(schedule.is_empty());
        assert_eq!(name, "device-a");
        assert_eq!(split_spec("device-a").map(|(_, n)| n), Ok("device-a"));
        assert_eq!(
            split_spec("emu(slow=2x@1s):/p/x.toml").map(|(_, n)| n),
            Ok("/p/x.toml")
        );
        assert_eq!(
            split_spec("emu(slow=2x@1s"),
            Err(EmuScheduleError::Unclosed)
        );
        assert_eq!(
            split_spec("emu(slow=2x@1s)device-a"),
            Err(EmuScheduleError::MissingColon)
        );
        assert_eq!(
            split_spec("emu(slow=2x@1s):"),
            Err(EmuScheduleError::MissingName)
        );
        assert_eq!(split_spec("emu:"), Err(EmuScheduleError::MissingName));
    }

    #[test]
    fn the_timeline_orders_changes_at_equal_times() {
        let schedule = EmuSchedule::parse("stall=1s-2s;stall=3s-4s;slow=2x@2s").unwrap();
        let timeline = schedule.timeline(Nanos::from_secs(100));
        let two = Slowdown::from_factor(2.0).unwrap();
        assert_eq!(
            timeline,
            vec![
                (101_000_000_000, Change::StallBegin),
                (102_000_000_000, Change::Slow(two)),
                (102_000_000_000, Change::StallEnd),
                (103_000_000_000, Change::StallBegin),
                (104_000_000_000, Change::StallEnd),
            ]
        );
    }

    #[test]
    fn factors_combine_and_scale_exactly() {
        let two = Slowdown::from_factor(2.0).unwrap();
        let half = Slowdown::from_factor(0.5).unwrap();
        assert_eq!(Factor::of(two, half).apply(80_000), 80_000);
        assert_eq!(Factor::of(two, Slowdown::NONE).apply(80_000), 160_000);
        assert_eq!(Factor::of(Slowdown::NONE, Slowdown::NONE).apply(7), 7);
        assert_eq!(Slowdown::from_factor(1.25).unwrap().to_string(), "1.25x");
        assert!(Slowdown::from_factor(f64::NAN).is_err());
        assert!(Slowdown::from_permille(99).is_err());
    }
}
