//! `fault:` — a device that wraps any other and injects failures, so the server's error
//! paths, timeouts and back-pressure can be exercised against real storage, on demand.
//!
//! Why a wrapper and not a mock: the faults land on the real path (file through io_uring,
//! memory, emulated Flash) and everything the wrapper does not inject is the inner device's
//! own behaviour. nbdkit's `error` and `delay` filters are the model.
//!
//! # Spec
//!
//! ```text
//! fault:INNER                      no faults yet; change them at run time
//! fault(KEY=VALUE;...):INNER       the initial plan, e.g.
//! fault(read_error_rate=1%;seed=7):mem:16M
//! fault(write_error_lba=0-2047;errno=ENOSPC):file:/data/ns1
//! fault(delay=5ms;delay_every=100;short_rate=0.001):emu:device-a-small
//! ```
//!
//! Parameters are separated by `;` (a `,` is accepted too, but `reflexd -n` splits its own
//! options at commas, so `;` is the one that works everywhere). `INNER` is any backend spec,
//! another `fault` included. In a shell, quote the whole argument: `(` and `;` are special.
//!
//! | key | value | effect |
//! |---|---|---|
//! | `read_error_rate`, `write_error_rate`, `flush_error_rate`, `trim_error_rate` | rate: `0.01` or `1%` | that fraction of such operations fails with `errno` |
//! | `read_error_lba`, `write_error_lba`, `trim_error_lba` | `FIRST-LAST` or `LBA` (inclusive, in blocks of the device's block size, 512 bytes) | every such operation touching the range fails |
//! | `errno` | `EIO` (default), `ENOSPC`, `EDQUOT`, `EROFS`, `ENODEV`, `ETIMEDOUT`, `EBUSY`, `EAGAIN`, `EBADF` or a number | the error injected |
//! | `delay` | duration: `250us`, `5ms`, `1s` (units `ns`, `us`, `ms`, `s`; at most 1 h) | added to the completion of the operations picked by `delay_every` or `delay_rate` |
//! | `delay_every` | N ≥ 1 (default 1: every operation) | every Nth operation of a queue is delayed |
//! | `delay_rate` | rate | that fraction of operations is delayed (instead of `delay_every`) |
//! | `short_rate` | rate | that fraction of reads and writes reports half its bytes, rounded down to a block (0 for a one-block transfer) |
//! | `stall` | `stall` or `stall=true` | start stalled: nothing completes until the stall is lifted |
//! | `seed` | u64 (default 0) | the random stream that picks the operations |
//!
//! A key may appear once; unknown keys, malformed values and `delay_every`/`delay_rate`
//! without `delay` are refused with a [`FaultSpecError`].
//!
//! # Run time
//!
//! [`FaultDevice::controls`] (also reachable as [`Device::fault_controls`] from an
//! `Arc<dyn Device>`) is a shared [`FaultControls`]: [`FaultControls::set_plan`] replaces the
//! plan, [`FaultControls::clear`] removes every fault, [`FaultControls::set_stalled`] stalls
//! or lifts. Each queue picks the new plan up at its next operation.
//!
//! # How faults are applied
//!
//! Every decision is taken at `submit`, from the plan in force and the queue's random stream
//! (queue `i`, in the order the dataplane threads asked for queues, uses the seed's `i`th
//! jump-ahead stream; the stream restarts at every plan change, so a plan and a sequence of
//! operations always give the same faults). Each operation draws three numbers — error,
//! delay, short — whatever the plan, so changing one rate does not move the others.
//!
//! - An injected **error** is decided before the inner device sees the operation, which never
//!   reaches it: a refused write does not land. It completes at once with `Submit::Done`,
//!   unless a delay or stall applies, in which case it is held like any other completion.
//! - **Delays, stalls and short completions** alter the inner device's completion, never its
//!   work: a result from inner `Submit::Done`, inner `poll_completions` or the inner CQE
//!   (via [`DeviceQueue::complete_ring`], which then returns `None`) is held in the wrapper
//!   and reported by its `poll_completions(now)` once due (`now` when learnt + `delay`) and
//!   not stalled. [`DeviceQueue::next_deadline`] reports the earliest due time; while stalled
//!   with something held it asks to be polled every [`STALL_RECHECK`] so a lift made by
//!   another thread is seen. A stall is checked when a completion arrives and when it would
//!   be released: lifting it releases everything held, and nothing is ever dropped while the
//!   queue lives.
//!
//! The wrapper runs no thread, reads no clock and does not touch io_uring (ring entries pass
//! through unchanged), so the simulator can use it; only opening file devices from a spec
//! (`crate::spec`) needs the `uring` feature. Without a ring
//! ([`Device::queue_without_ring`]) it wraps the inner device's ring-less queue the same way:
//! a file's pool completions come out of the inner `poll_completions` like any other.

use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::{BinaryHeap, HashMap};
use std::fmt;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_qos::Nanos;
use thiserror::Error;

use crate::{
    Completion, Device, DeviceInfo, DeviceOp, DeviceQueue, Extent, FlashError, Notify, OpKind,
    Submit,
};

/// How often a stalled queue with held completions asks to be polled, so that a stall lifted
/// from another thread releases them without waiting for unrelated I/O.
pub const STALL_RECHECK: Nanos = Nanos::from_millis(1);

/// The longest delay a plan may add (longer is a typo, not a test).
pub const DELAY_MAX: Nanos = Nanos::from_secs(3600);

/// Errno names the spec accepts, with their values.
const ERRNO_NAMES: [(&str, i32); 9] = [
    ("EIO", libc::EIO),
    ("ENOSPC", libc::ENOSPC),
    ("EDQUOT", libc::EDQUOT),
    ("EROFS", libc::EROFS),
    ("ENODEV", libc::ENODEV),
    ("ETIMEDOUT", libc::ETIMEDOUT),
    ("EBUSY", libc::EBUSY),
    ("EAGAIN", libc::EAGAIN),
    ("EBADF", libc::EBADF),
];

/// Keys of `fault(...)`, for the error that refuses an unknown one.
pub const FAULT_KEYS: [&str; 14] = [
    "read_error_rate",
    "write_error_rate",
    "flush_error_rate",
    "trim_error_rate",
    "read_error_lba",
    "write_error_lba",
    "trim_error_lba",
    "errno",
    "delay",
    "delay_every",
    "delay_rate",
    "short_rate",
    "stall",
    "seed",
];

// ----- The plan ------------------------------------------------------------------------------

/// An inclusive range of logical blocks (`first..=last`, in the device's block size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LbaRange {
    pub first: u64,
    pub last: u64,
}

impl LbaRange {
    /// Whether the byte range `offset..offset + len` touches a block of this range.
    fn overlaps(&self, offset: u64, len: u64, block_bytes: u64) -> bool {
        let range_start = u128::from(self.first) * u128::from(block_bytes);
        let range_end = (u128::from(self.last) + 1) * u128::from(block_bytes);
        let op_start = u128::from(offset);
        let op_end = op_start + u128::from(len.max(1));
        op_start < range_end && range_start < op_end
    }
}

/// Faults for one kind of operation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpFaults {
    /// Fraction (0 to 1) of these operations that fail.
    pub error_rate: f64,
    /// Every operation touching these blocks fails (not for flush, which has no range).
    pub error_lba: Option<LbaRange>,
}

/// Which operations a [`Delay`] applies to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DelayPick {
    /// The Nth, 2Nth, ... operation of each queue since the plan took effect.
    Every(NonZeroU64),
    /// This fraction (0 to 1) of operations, at random.
    Rate(f64),
}

/// A latency spike: `added` on top of the inner device's completion time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Delay {
    pub added: Nanos,
    pub pick: DelayPick,
}

/// Everything a [`FaultDevice`] injects. The default injects nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultPlan {
    /// Seed of the random streams that pick operations.
    pub seed: u64,
    /// The errno of injected errors (positive, e.g. `libc::EIO`).
    pub errno: i32,
    pub read: OpFaults,
    pub write: OpFaults,
    pub flush: OpFaults,
    pub trim: OpFaults,
    pub delay: Option<Delay>,
    /// Fraction (0 to 1) of reads and writes that report fewer bytes than they moved.
    pub short_rate: f64,
    /// Nothing completes while set.
    pub stall: bool,
}

impl Default for FaultPlan {
    fn default() -> FaultPlan {
        FaultPlan {
            seed: 0,
            errno: libc::EIO,
            read: OpFaults::default(),
            write: OpFaults::default(),
            flush: OpFaults::default(),
            trim: OpFaults::default(),
            delay: None,
            short_rate: 0.0,
            stall: false,
        }
    }
}

impl FaultPlan {
    /// Checks what the types cannot: rates within 0..=1, a positive errno, a bounded delay.
    pub fn validate(&self) -> Result<(), FaultSpecError> {
        let rate = |key: &'static str, value: f64| {
            if (0.0..=1.0).contains(&value) {
                Ok(())
            } else {
                Err(FaultSpecError::BadValue {
                    key,
                    value: value.to_string(),
                    expected: "a rate between 0 and 1",
                })
            }
        };
        rate("read_error_rate", self.read.error_rate)?;
        rate("write_error_rate", self.write.error_rate)?;
        rate("flush_error_rate", self.flush.error_rate)?;
        rate("trim_error_rate", self.trim.error_rate)?;
        rate("short_rate", self.short_rate)?;
        if self.flush.error_lba.is_some() {
            return Err(FaultSpecError::FlushHasNoLba);
        }
        for (key, faults) in [
            ("read_error_lba", &self.read),
            ("write_error_lba", &self.write),
            ("trim_error_lba", &self.trim),
        ] {
            if let Some(range) = faults.error_lba
                && range.first > range.last
            {
                return Err(FaultSpecError::BadValue {
                    key,
                    value: format!("{}-{}", range.first, range.last),
                    expected: "FIRST-LAST with FIRST <= LAST",
                });
            }
        }
        if self.errno <= 0 || self.errno > 4095 {
            return Err(FaultSpecError::BadValue {
                key: "errno",
                value: self.errno.to_string(),
                expected: "a positive errno",
            });
        }
        if let Some(delay) = &self.delay {
            if delay.added > DELAY_MAX {
                return Err(FaultSpecError::BadValue {
                    key: "delay",
                    value: format!("{}ns", delay.added.0),
                    expected: "a duration of at most 1 h",
                });
            }
            if let DelayPick::Rate(value) = delay.pick {
                rate("delay_rate", value)?;
            }
        }
        Ok(())
    }

    /// Whether the plan injects anything at all.
    pub fn is_empty(&self) -> bool {
        let clean = |faults: &OpFaults| faults.error_rate == 0.0 && faults.error_lba.is_none();
        clean(&self.read)
            && clean(&self.write)
            && clean(&self.flush)
            && clean(&self.trim)
            && self.delay.is_none()
            && self.short_rate == 0.0
            && !self.stall
    }

    /// Parses the parameters between `fault(` and `)`: `KEY=VALUE` pairs separated by `;` or
    /// `,` (the module documentation lists them). An empty text is the empty plan.
    pub fn parse(text: &str) -> Result<FaultPlan, FaultSpecError> {
        let mut plan = FaultPlan::default();
        let mut seen: Vec<&str> = Vec::new();
        let mut delay_added: Option<Nanos> = None;
        let mut delay_pick: Option<DelayPick> = None;
        for item in text.split([';', ',']).map(str::trim) {
            if item.is_empty() {
                if text.trim().is_empty() {
                    continue;
                }
                return Err(FaultSpecError::EmptyParameter);
            }
            let (key, value) = match item.split_once('=') {
                Some((key, value)) => (key.trim(), Some(value.trim())),
                None => (item, None),
            };
            if key == "flush_error_lba" {
                return Err(FaultSpecError::FlushHasNoLba);
            }
            let Some(&key) = FAULT_KEYS.iter().find(|known| **known == key) else {
                return Err(FaultSpecError::UnknownKey {
                    key: key.to_string(),
                });
            };
            if seen.contains(&key) {
                return Err(FaultSpecError::Duplicate { key });
            }
            seen.push(key);
            if key == "stall" {
                plan.stall = match value {
                    None | Some("true") | Some("on") | Some("1") => true,
                    Some("false") | Some("off") | Some("0") => false,
                    Some(other) => return Err(bad(key, other, "true or false")),
                };
                continue;
            }
            let Some(value) = value else {
                return Err(FaultSpecError::MissingValue { key });
            };
            match key {
                "read_error_rate" => plan.read.error_rate = parse_rate(key, value)?,
                "write_error_rate" => plan.write.error_rate = parse_rate(key, value)?,
                "flush_error_rate" => plan.flush.error_rate = parse_rate(key, value)?,
                "trim_error_rate" => plan.trim.error_rate = parse_rate(key, value)?,
                "read_error_lba" => plan.read.error_lba = Some(parse_lba_range(key, value)?),
                "write_error_lba" => plan.write.error_lba = Some(parse_lba_range(key, value)?),
                "trim_error_lba" => plan.trim.error_lba = Some(parse_lba_range(key, value)?),
                "errno" => plan.errno = parse_errno(value)?,
                "delay" => delay_added = Some(parse_duration(key, value)?),
                "delay_every" => {
                    let every = value
                        .parse::<NonZeroU64>()
                        .map_err(|_| bad(key, value, "a whole number of at least 1"))?;
                    delay_pick = Some(DelayPick::Every(every));
                }
                "delay_rate" => delay_pick = Some(DelayPick::Rate(parse_rate(key, value)?)),
                "short_rate" => plan.short_rate = parse_rate(key, value)?,
                "seed" => {
                    plan.seed = value
                        .parse()
                        .map_err(|_| bad(key, value, "an unsigned 64-bit number"))?;
                }
                _ => unreachable!("key {key} is in FAULT_KEYS but not parsed"),
            }
        }
        if seen.contains(&"delay_every") && seen.contains(&"delay_rate") {
            return Err(FaultSpecError::Conflict(
                "delay_every and delay_rate are alternatives: give one",
            ));
        }
        plan.delay = match (delay_added, delay_pick) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(FaultSpecError::Conflict(
                    "delay_every or delay_rate needs delay=DURATION",
                ));
            }
            (Some(added), pick) => Some(Delay {
                added,
                pick: pick.unwrap_or(DelayPick::Every(NonZeroU64::MIN)),
            }),
        };
        plan.validate()?;
        Ok(plan)
    }
}

/// The canonical parameter text: [`FaultPlan::parse`] of it gives the plan back.
impl fmt::Display for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        for (name, faults) in [
            ("read", &self.read),
            ("write", &self.write),
            ("flush", &self.flush),
            ("trim", &self.trim),
        ] {
            if faults.error_rate != 0.0 {
                parts.push(format!("{name}_error_rate={}", faults.error_rate));
            }
            if let Some(range) = faults.error_lba {
                parts.push(format!("{name}_error_lba={}-{}", range.first, range.last));
            }
        }
        if self.errno != libc::EIO {
            match ERRNO_NAMES.iter().find(|(_, value)| *value == self.errno) {
                Some((name, _)) => parts.push(format!("errno={name}")),
                None => parts.push(format!("errno={}", self.errno)),
            }
        }
        if let Some(delay) = &self.delay {
            parts.push(format!("delay={}", format_duration(delay.added)));
            match delay.pick {
                DelayPick::Every(every) if every.get() == 1 => {}
                DelayPick::Every(every) => parts.push(format!("delay_every={every}")),
                DelayPick::Rate(rate) => parts.push(format!("delay_rate={rate}")),
            }
        }
        if self.short_rate != 0.0 {
            parts.push(format!("short_rate={}", self.short_rate));
        }
        if self.stall {
            parts.push("stall".to_string());
        }
        if self.seed != 0 {
            parts.push(format!("seed={}", self.seed));
        }
        f.write_str(&parts.join(";"))
    }
}

/// Why a `fault` spec or plan was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FaultSpecError {
    #[error(
        "fault needs an inner backend: fault:INNER or fault(KEY=VALUE;...):INNER, e.g. fault(read_error_rate=1%):mem:16M"
    )]
    MissingInner,
    #[error("fault( has no closing ')'")]
    Unclosed,
    #[error("fault(...) must be followed by ':' and the inner backend, e.g. fault(stall):mem:1M")]
    MissingColon,
    #[error("unknown fault parameter {key:?}; known: {}", FAULT_KEYS.join(", "))]
    UnknownKey { key: String },
    #[error("fault parameter {key} given twice")]
    Duplicate { key: &'static str },
    #[error("fault parameter {key} needs a value ({key}=...)")]
    MissingValue { key: &'static str },
    #[error("empty fault parameter (two separators in a row?)")]
    EmptyParameter,
    #[error("fault parameter {key}={value:?}: expected {expected}")]
    BadValue {
        key: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("flush has no block range: use flush_error_rate")]
    FlushHasNoLba,
    #[error("{0}")]
    Conflict(&'static str),
}

fn bad(key: &'static str, value: &str, expected: &'static str) -> FaultSpecError {
    FaultSpecError::BadValue {
        key,
        value: value.to_string(),
        expected,
    }
}

/// Splits `fault:INNER` or `fault(PARAMS):INNER` into the initial plan and the inner spec.
/// `spec` must start with `fault:` or `fault(` (the caller dispatched on that).
pub fn split_spec(spec: &str) -> Result<(FaultPlan, &str), FaultSpecError> {
    let spec = spec.trim();
    let (plan, inner) = if let Some(inner) = spec.strip_prefix("fault:") {
        (FaultPlan::default(), inner)
    } else if let Some(rest) = spec.strip_prefix("fault(") {
        let Some((params, after)) = rest.split_once(')') else {
            return Err(FaultSpecError::Unclosed);
        };
        let Some(inner) = after.strip_prefix(':') else {
            return Err(FaultSpecError::MissingColon);
        };
        (FaultPlan::parse(params)?, inner)
    } else {
        return Err(FaultSpecError::MissingInner);
    };
    if inner.trim().is_empty() {
        return Err(FaultSpecError::MissingInner);
    }
    Ok((plan, inner.trim()))
}

/// `0.01`, `1%`, `0`, `1`.
fn parse_rate(key: &'static str, value: &str) -> Result<f64, FaultSpecError> {
    let expected = "a rate between 0 and 1, e.g. 0.01 or 1%";
    let rate = match value.strip_suffix('%') {
        Some(percent) => percent.trim().parse::<f64>().map(|p| p / 100.0),
        None => value.parse::<f64>(),
    }
    .map_err(|_| bad(key, value, expected))?;
    if !(0.0..=1.0).contains(&rate) {
        return Err(bad(key, value, expected));
    }
    Ok(rate)
}

/// `FIRST-LAST` or a single `LBA`.
fn parse_lba_range(key: &'static str, value: &str) -> Result<LbaRange, FaultSpecError> {
    let expected = "FIRST-LAST or LBA (blocks, inclusive, FIRST <= LAST)";
    let number = |text: &str| {
        text.trim()
            .parse::<u64>()
            .map_err(|_| bad(key, value, expected))
    };
    let range = match value.split_once('-') {
        Some((first, last)) => LbaRange {
            first: number(first)?,
            last: number(last)?,
        },
        None => {
            let lba = number(value)?;
            LbaRange {
                first: lba,
                last: lba,
            }
        }
    };
    if range.first > range.last {
        return Err(bad(key, value, expected));
    }
    Ok(range)
}

fn parse_errno(value: &str) -> Result<i32, FaultSpecError> {
    if let Some((_, errno)) = ERRNO_NAMES
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(value))
    {
        return Ok(*errno);
    }
    match value.parse::<i32>() {
        Ok(errno) if (1..=4095).contains(&errno) => Ok(errno),
        _ => Err(bad(
            "errno",
            value,
            "EIO, ENOSPC, EDQUOT, EROFS, ENODEV, ETIMEDOUT, EBUSY, EAGAIN, EBADF or a number 1-4095",
        )),
    }
}

/// `250ns`, `100us`, `5ms`, `1s` (a unit is required; at most [`DELAY_MAX`]).
fn parse_duration(key: &'static str, value: &str) -> Result<Nanos, FaultSpecError> {
    let expected = "a duration such as 250us, 5ms or 1s (units ns, us, ms, s; at most 1 h)";
    let digits_end = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (digits, unit) = value.split_at(digits_end);
    let number: u64 = digits.parse().map_err(|_| bad(key, value, expected))?;
    let scale: u64 = match unit.trim() {
        "ns" => 1,
        "us" | "µs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        _ => return Err(bad(key, value, expected)),
    };
    match number.checked_mul(scale) {
        Some(nanos) if Nanos(nanos) <= DELAY_MAX => Ok(Nanos(nanos)),
        _ => Err(bad(key, value, expected)),
    }
}

fn format_duration(duration: Nanos) -> String {
    let nanos = duration.0;
    if nanos != 0 && nanos.is_multiple_of(1_000_000_000) {
        format!("{}s", nanos / 1_000_000_000)
    } else if nanos != 0 && nanos.is_multiple_of(1_000_000) {
        format!("{}ms", nanos / 1_000_000)
    } else if nanos != 0 && nanos.is_multiple_of(1_000) {
        format!("{}us", nanos / 1_000)
    } else {
        format!("{nanos}ns")
    }
}

// ----- The run-time handle -------------------------------------------------------------------

/// Counts of what a [`FaultDevice`] injected, over all its queues.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub errors_injected: u64,
    pub completions_delayed: u64,
    pub completions_shortened: u64,
    /// Completions that arrived while stalled and were held for the lift.
    pub completions_stalled: u64,
}

/// The shared switch of a [`FaultDevice`]: replace its plan or stall it from any thread.
#[derive(Debug)]
pub struct FaultControls {
    plan: Mutex<FaultPlan>,
    /// Bumped (under the plan lock) at every change, so queues re-read the plan only then.
    generation: AtomicU64,
    /// Mirrors `plan.stall`, read without the lock on every completion.
    stalled: AtomicBool,
    errors_injected: AtomicU64,
    completions_delayed: AtomicU64,
    completions_shortened: AtomicU64,
    completions_stalled: AtomicU64,
}

impl FaultControls {
    /// Controls starting with `plan`, which [`FaultDevice::new`] validated.
    fn new(plan: FaultPlan) -> FaultControls {
        assert!(
            plan.validate().is_ok(),
            "invalid initial fault plan {plan:?}"
        );
        FaultControls {
            stalled: AtomicBool::new(plan.stall),
            plan: Mutex::new(plan),
            generation: AtomicU64::new(0),
            errors_injected: AtomicU64::new(0),
            completions_delayed: AtomicU64::new(0),
            completions_shortened: AtomicU64::new(0),
            completions_stalled: AtomicU64::new(0),
        }
    }

    /// The plan in force.
    pub fn plan(&self) -> FaultPlan {
        self.lock().clone()
    }

    /// Replaces the plan; each queue uses it from its next operation on. Lifting the stall
    /// (a plan without `stall`) releases every held completion that is due.
    pub fn set_plan(&self, plan: FaultPlan) -> Result<(), FaultSpecError> {
        plan.validate()?;
        let mut guard = self.lock();
        self.stalled.store(plan.stall, Ordering::Release);
        *guard = plan;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Removes every fault (and lifts a stall); the seed is kept.
    pub fn clear(&self) {
        let seed = self.lock().seed;
        let cleared = FaultPlan {
            seed,
            ..FaultPlan::default()
        };
        // The default plan is valid by construction.
        let result = self.set_plan(cleared);
        assert!(result.is_ok(), "the empty plan is valid");
    }

    /// Stalls (`true`) or lifts the stall (`false`), keeping the rest of the plan.
    pub fn set_stalled(&self, stalled: bool) {
        let mut guard = self.lock();
        guard.stall = stalled;
        self.stalled.store(stalled, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    pub fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Acquire)
    }

    pub fn counts(&self) -> FaultCounts {
        FaultCounts {
            errors_injected: self.errors_injected.load(Ordering::Relaxed),
            completions_delayed: self.completions_delayed.load(Ordering::Relaxed),
            completions_shortened: self.completions_shortened.load(Ordering::Relaxed),
            completions_stalled: self.completions_stalled.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FaultPlan> {
        // A panic while holding the lock cannot leave a half-written plan (it is replaced
        // whole), so a poisoned lock is still usable.
        self.plan
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The plan with the generation it belongs to.
    fn snapshot(&self) -> (FaultPlan, u64) {
        let guard = self.lock();
        (guard.clone(), self.generation.load(Ordering::Acquire))
    }
}

// ----- The device ----------------------------------------------------------------------------

/// A device that injects the faults of its [`FaultControls`] into another device.
pub struct FaultDevice {
    inner: Arc<dyn Device>,
    info: DeviceInfo,
    controls: Arc<FaultControls>,
    /// Queues handed out so far; the next queue's index picks its random stream.
    queues_created: AtomicU32,
    /// How often a stalled queue with held completions asks to be polled (`None`: never).
    stall_recheck: Option<Nanos>,
}

impl fmt::Debug for FaultDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultDevice")
            .field("info", &self.info)
            .field("plan", &self.controls.plan())
            .finish()
    }
}

impl FaultDevice {
    /// A queue injecting faults into `inner`, a queue of the inner device.
    fn wrap(&self, inner: Box<dyn DeviceQueue>) -> Box<dyn DeviceQueue> {
        let queue_index = self.queues_created.fetch_add(1, Ordering::Relaxed);
        let (plan, generation) = self.controls.snapshot();
        let mut queue = FaultQueue {
            inner,
            controls: Arc::clone(&self.controls),
            queue_index,
            block_bytes: u64::from(self.info.block_size),
            rng: Xoshiro256PlusPlus::seed_from_u64(0),
            plan,
            generation,
            operations_seen: 0,
            altered: HashMap::new(),
            held: BinaryHeap::new(),
            held_sequence: 0,
            now_latest: Nanos::ZERO,
            scratch: Vec::new(),
            stall_recheck: self.stall_recheck,
        };
        queue.restart_stream();
        Box::new(queue)
    }

    /// Wraps `inner` with `plan` as the initial faults; an invalid plan is refused.
    pub fn new(inner: Arc<dyn Device>, plan: FaultPlan) -> Result<FaultDevice, FaultSpecError> {
        plan.validate()?;
        let inner_info = inner.info().clone();
        let description = format!(
            "fault-injecting (initial plan: {}) over {}",
            if plan.is_empty() {
                "none".to_string()
            } else {
                plan.to_string()
            },
            inner_info.description
        );
        Ok(FaultDevice {
            info: DeviceInfo {
                description,
                ..inner_info
            },
            inner,
            controls: Arc::new(FaultControls::new(plan)),
            queues_created: AtomicU32::new(0),
            stall_recheck: Some(STALL_RECHECK),
        })
    }

    /// Its queues do not ask to be polled while stalled (no [`STALL_RECHECK`]): for a
    /// single-threaded driver that lifts stalls itself between polls (the simulator), where
    /// a lift is seen at the next poll anyway and the rechecks would only fill idle time.
    /// Queues handed out before keep rechecking.
    pub fn without_stall_recheck(mut self) -> FaultDevice {
        self.stall_recheck = None;
        self
    }

    /// The shared run-time switch.
    pub fn controls(&self) -> Arc<FaultControls> {
        Arc::clone(&self.controls)
    }
}

impl Device for FaultDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn queue(&self) -> Box<dyn DeviceQueue> {
        self.wrap(self.inner.queue())
    }

    #[allow(unsafe_code)]
    unsafe fn queue_without_ring(&self, notify: Arc<dyn Notify>) -> Box<dyn DeviceQueue> {
        // SAFETY: the wrapper hands the buffers of our caller's operations to the inner queue
        // unchanged and keeps none itself, so our caller's guarantee is the inner one's.
        let inner = unsafe { self.inner.queue_without_ring(notify) };
        self.wrap(inner)
    }

    fn fault_controls(&self) -> Option<Arc<FaultControls>> {
        Some(self.controls())
    }

    /// The inner device's drift switch: faults are injected on top of its timing.
    fn emu_controls(&self) -> Option<Arc<crate::emu::EmuControls>> {
        self.inner.emu_controls()
    }

    /// The inner device's allocation: faults are injected into I/O, not metadata.
    fn block_status(
        &self,
        offset: u64,
        length_bytes: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), FlashError> {
        self.inner
            .block_status(offset, length_bytes, extents_max, out)
    }
}

/// What the plan decided for one operation's completion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Alteration {
    delay: Nanos,
    short: bool,
}

impl Alteration {
    fn is_none(&self) -> bool {
        self.delay == Nanos::ZERO && !self.short
    }
}

/// A completion waiting for its due time or for the stall to be lifted.
#[derive(Debug)]
struct Held {
    due: Nanos,
    /// Arrival order: ties in `due` come out first in, first out.
    sequence: u64,
    completion: Completion,
}

impl PartialEq for Held {
    fn eq(&self, other: &Held) -> bool {
        (self.due, self.sequence) == (other.due, other.sequence)
    }
}

impl Eq for Held {}

impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Held) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

impl Ord for Held {
    fn cmp(&self, other: &Held) -> CmpOrdering {
        (self.due, self.sequence).cmp(&(other.due, other.sequence))
    }
}

struct FaultQueue {
    inner: Box<dyn DeviceQueue>,
    controls: Arc<FaultControls>,
    queue_index: u32,
    block_bytes: u64,
    rng: Xoshiro256PlusPlus,
    /// The plan in force for this queue, and the controls' generation it came from.
    plan: FaultPlan,
    generation: u64,
    /// Operations submitted since `plan` took effect (for `delay_every`).
    operations_seen: u64,
    /// Alterations of operations the inner device has not finished (ring entries and
    /// pending operations), by user_data; trivial ones are not stored. At most one entry per
    /// operation in flight, so bounded by the caller's queue depth.
    altered: HashMap<u64, Alteration>,
    held: BinaryHeap<Reverse<Held>>,
    held_sequence: u64,
    /// The latest `now` handed in (time never goes back here).
    now_latest: Nanos,
    scratch: Vec<Completion>,
    /// See [`FaultDevice::without_stall_recheck`].
    stall_recheck: Option<Nanos>,
}

/// What [`FaultQueue::decide`] picked for one operation.
#[derive(Debug, Clone, Copy)]
struct Decision {
    errno: Option<i32>,
    alteration: Alteration,
}

impl FaultQueue {
    /// Seeds the random stream of this queue for the current plan.
    fn restart_stream(&mut self) {
        self.rng = Xoshiro256PlusPlus::seed_from_u64(self.plan.seed);
        for _ in 0..self.queue_index {
            self.rng.jump();
        }
        self.operations_seen = 0;
    }

    /// Picks up a plan replaced through the controls.
    fn refresh_plan(&mut self) {
        if self.controls.generation.load(Ordering::Acquire) == self.generation {
            return;
        }
        let (plan, generation) = self.controls.snapshot();
        self.plan = plan;
        self.generation = generation;
        self.restart_stream();
    }

    fn observe(&mut self, now: Nanos) {
        self.now_latest = self.now_latest.max(now);
    }

    /// A uniform draw in `[0, 1)`.
    fn draw(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    fn decide(&mut self, kind: &OpKind<'_>) -> Decision {
        let error_draw = self.draw();
        let delay_draw = self.draw();
        let short_draw = self.draw();
        self.operations_seen += 1;
        let (faults, range, moves_bytes) = match kind {
            OpKind::Read { offset, buf } => {
                (&self.plan.read, Some((*offset, buf.len() as u64)), true)
            }
            OpKind::Write { offset, buf, .. } => {
                (&self.plan.write, Some((*offset, buf.len() as u64)), true)
            }
            OpKind::Flush => (&self.plan.flush, None, false),
            OpKind::Trim { offset, len } => (&self.plan.trim, Some((*offset, *len)), false),
        };
        let lba_hit = match (faults.error_lba, range) {
            (Some(lba), Some((offset, len))) => lba.overlaps(offset, len, self.block_bytes),
            _ => false,
        };
        let error = lba_hit || error_draw < faults.error_rate;
        let delay = match self.plan.delay {
            None => Nanos::ZERO,
            Some(Delay {
                added,
                pick: DelayPick::Every(every),
            }) => {
                if self.operations_seen.is_multiple_of(every.get()) {
                    added
                } else {
                    Nanos::ZERO
                }
            }
            Some(Delay {
                added,
                pick: DelayPick::Rate(rate),
            }) => {
                if delay_draw < rate {
                    added
                } else {
                    Nanos::ZERO
                }
            }
        };
        Decision {
            errno: error.then_some(self.plan.errno),
            alteration: Alteration {
                delay,
                short: moves_bytes && !error && short_draw < self.plan.short_rate,
            },
        }
    }

    /// Applies `alteration` to a result the inner device produced (or an injected error) at
    /// `now`: `Some` to report it at once, `None` when it is held for `poll_completions`.
    fn finish(
        &mut self,
        user_data: u64,
        result: Result<u32, FlashError>,
        alteration: Alteration,
        now: Nanos,
    ) -> Option<Result<u32, FlashError>> {
        let result = match result {
            Ok(bytes) if alteration.short && bytes > 0 => {
                self.controls
                    .completions_shortened
                    .fetch_add(1, Ordering::Relaxed);
                let block = u32::try_from(self.block_bytes).unwrap_or(u32::MAX);
                let short = bytes / 2 / block * block;
                assert!(short < bytes, "a short completion must report fewer bytes");
                Ok(short)
            }
            other => other,
        };
        if alteration.delay > Nanos::ZERO {
            self.controls
                .completions_delayed
                .fetch_add(1, Ordering::Relaxed);
        }
        let stalled = self.controls.is_stalled();
        if alteration.delay == Nanos::ZERO && !stalled {
            return Some(result);
        }
        if stalled {
            self.controls
                .completions_stalled
                .fetch_add(1, Ordering::Relaxed);
        }
        self.held_sequence += 1;
        self.held.push(Reverse(Held {
            due: Nanos(now.0.saturating_add(alteration.delay.0)),
            sequence: self.held_sequence,
            completion: Completion { user_data, result },
        }));
        None
    }

    /// Remembers the alteration of an operation the inner device finishes later.
    fn remember(&mut self, user_data: u64, alteration: Alteration) {
        if alteration.is_none() {
            return;
        }
        let previous = self.altered.insert(user_data, alteration);
        assert!(
            previous.is_none(),
            "user_data {user_data:#x} submitted twice while in flight"
        );
    }
}

impl DeviceQueue for FaultQueue {
    fn submit(&mut self, op: DeviceOp<'_>, now: Nanos) -> Submit {
        self.observe(now);
        self.refresh_plan();
        let decision = self.decide(&op.kind);
        let user_data = op.user_data;
        if let Some(errno) = decision.errno {
            // Refused before the inner device sees it: a failed write never lands.
            self.controls
                .errors_injected
                .fetch_add(1, Ordering::Relaxed);
            let result = Err(FlashError::Io { errno });
            return match self.finish(user_data, result, decision.alteration, now) {
                Some(result) => Submit::Done(result),
                None => Submit::Pending,
            };
        }
        match self.inner.submit(op, now) {
            Submit::Done(result) => {
                match self.finish(user_data, result, decision.alteration, now) {
                    Some(result) => Submit::Done(result),
                    None => Submit::Pending,
                }
            }
            Submit::Pending => {
                self.remember(user_data, decision.alteration);
                Submit::Pending
            }
            #[cfg(feature = "uring")]
            Submit::Ring(entry) => {
                self.remember(user_data, decision.alteration);
                Submit::Ring(entry)
            }
        }
    }

    fn complete_ring(
        &mut self,
        user_data: u64,
        cqe_result: i32,
        now: Nanos,
    ) -> Option<Result<u32, FlashError>> {
        self.observe(now);
        // The inner device may defer too (a wrapped wrapper): then its poll reports it and
        // the alteration stays remembered until then.
        let result = self.inner.complete_ring(user_data, cqe_result, now)?;
        let alteration = self.altered.remove(&user_data).unwrap_or_default();
        self.finish(user_data, result, alteration, now)
    }

    fn poll_completions(&mut self, now: Nanos, out: &mut Vec<Completion>) {
        self.observe(now);
        let now = self.now_latest;
        // A delay counts from when the inner device completed, not from when it was polled:
        // a driver that polls late (a thread that slept past the completion) must not add
        // its own lateness to the delay. The inner device's earliest deadline is when the
        // first of these completions happened (the others are no earlier).
        let completed_at = self.inner.next_deadline().map_or(now, |due| due.min(now));
        let mut scratch = std::mem::take(&mut self.scratch);
        self.inner.poll_completions(now, &mut scratch);
        for completion in scratch.drain(..) {
            let alteration = self
                .altered
                .remove(&completion.user_data)
                .unwrap_or_default();
            if let Some(result) = self.finish(
                completion.user_data,
                completion.result,
                alteration,
                completed_at,
            ) {
                out.push(Completion {
                    user_data: completion.user_data,
                    result,
                });
            }
        }
        self.scratch = scratch;
        // Then what is due of the held ones, those just held included.
        if !self.controls.is_stalled() {
            while let Some(Reverse(next)) = self.held.peek() {
                if next.due > now {
                    break;
                }
                let Some(Reverse(held)) = self.held.pop() else {
                    break;
                };
                out.push(held.completion);
            }
        }
    }

    fn next_deadline(&self) -> Option<Nanos> {
        let own = match self.held.peek() {
            None => None,
            Some(_) if self.controls.is_stalled() => self
                .stall_recheck
                .map(|recheck| Nanos(self.now_latest.0.saturating_add(recheck.0))),
            Some(Reverse(next)) => Some(next.due),
        };
        match (own, self.inner.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests;
