//! Calibration: measure how a device's p95 read latency responds to load and read/write mix,
//! and turn the measurements into the [`DeviceProfile`] the QoS scheduler runs on.
//!
//! Why: the scheduler only works if its cost model (a 4 KiB read = 1 token, a write =
//! `write_cost` tokens, a read while the load is read-only = `read_only_read_cost`) makes the
//! latency-versus-load curves of every mix coincide, and if it knows the token rate each
//! latency SLO allows. Both are properties of one device model, so they are measured, as
//! ReFlex §3.2.1 and the original code's device-model comments describe:
//! 1. optionally precondition (sequential fill, then random writes to steady state);
//! 2. [`sweep`]: for each read ratio (100, 99, 95, 90, 75, 50 %) and size, run open-loop
//!    Poisson load at rising rates and record p95 read latency per point;
//! 3. [`fit()`]: choose `write_cost` so the p95-versus-(reads + w·writes) curves of the mixed
//!    ratios coincide, `read_only_read_cost` so the read-only curve lands on them too, and the
//!    table {p95 SLO → max mixed token rate, max read-only read rate}, made monotone.
//!
//! Load comes from a [`LoadRunner`]: [`EmuRunner`] drives the emulated device in virtual time
//! (exact, fast, deterministic); real-time runners (a local file via io_uring, a remote
//! namespace) implement the same trait in `reflex-cli`.

mod fit;
mod runner;

use reflex_qos::{DeviceProfile, Nanos};
use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use fit::{Fit, SizeCost, fit, read_iops_at_latency};
pub use runner::EmuRunner;

/// The read ratios ReFlex calibrates with (Figure 1).
pub const READ_RATIOS_DEFAULT: [f64; 6] = [1.0, 0.99, 0.95, 0.90, 0.75, 0.50];
/// SLO rows of the generated profile, in µs.
pub const SLOS_US_DEFAULT: [u64; 10] = [200, 300, 400, 500, 750, 1000, 1500, 2000, 2500, 3000];
/// Safety bound on the rate-doubling search.
pub const BRACKET_STEPS_MAX: u32 = 40;

/// One load level's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointResult {
    /// Offered (open-loop) request rate.
    pub rate_per_sec: f64,
    /// Fraction of requests that are reads (1.0 = read-only).
    pub read_ratio: f64,
    pub size_bytes: u32,
    /// Requests completed per second during the measurement window.
    pub iops: f64,
    /// Requests measured (submitted in the measurement window).
    pub reads: u64,
    pub writes: u64,
    pub read_latency_us_p50: f64,
    pub read_latency_us_p95: f64,
    pub read_latency_us_p99: f64,
    pub write_latency_us_p95: f64,
    /// Requests the device refused (queue full) or that never completed; the latter count
    /// with the time they had waited when the run gave up on them.
    pub refused: u64,
    pub unfinished: u64,
    /// Real-time runners measure a point as several back-to-back runs and report the median
    /// of each figure, so that one burst of someone else's I/O does not become the point's
    /// p95; this keeps every run's p95 read latency (µs) to show the spread. Empty when the
    /// point is a single run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub read_latency_us_p95_runs: Vec<f64>,
}

impl PointResult {
    /// Token rate under the cost model: reads cost 1, writes `write_cost`, per 4 KiB.
    pub fn tokens_per_sec(&self, write_cost: f64) -> f64 {
        let pages = f64::from(self.size_bytes.div_ceil(4096).max(1));
        self.iops * pages * (self.read_ratio + (1.0 - self.read_ratio) * write_cost)
    }
}

/// Preconditioning: bring a device to steady state before measuring (ReFlex's README: a full
/// sequential write, then random 4 KiB writes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreconditionPlan {
    pub sequential_block_bytes: u32,
    /// Random 4 KiB writes, as a multiple of the capacity.
    pub random_write_capacity_multiple: f64,
    /// Requests in flight while preconditioning.
    pub queue_depth: u32,
}

impl Default for PreconditionPlan {
    fn default() -> Self {
        PreconditionPlan {
            sequential_block_bytes: 128 * 1024,
            random_write_capacity_multiple: 1.0,
            queue_depth: 32,
        }
    }
}

#[derive(Debug, Error)]
pub enum CalibrateError {
    #[error("load runner failed: {0}")]
    Runner(String),
    #[error("emulated device: {0}")]
    Emu(#[from] crate::emu::EmuError),
    #[error("calibration data insufficient: {0}")]
    Insufficient(String),
    #[error("invalid calibration settings: {0}")]
    Config(String),
}

/// Something that can put open-loop load on a device and measure read latency.
///
/// Implementations: [`EmuRunner`] (virtual time); real-time runners live in `reflex-cli`.
pub trait LoadRunner {
    /// For logs and the profile's provenance, e.g. `emu:device-a (virtual time)`.
    fn describe(&self) -> String;

    /// Writes the device to steady state; `progress` gets the fraction done (0..=1).
    fn precondition(
        &mut self,
        plan: &PreconditionPlan,
        progress: &mut dyn FnMut(f64),
    ) -> Result<(), CalibrateError>;

    /// Offers `rate_per_sec` requests per second (Poisson arrivals, `read_ratio` of them reads,
    /// each `size_bytes` at a uniformly random aligned offset) for `duration`, and reports the
    /// latencies. The device should be idle again when it returns.
    fn run_point(
        &mut self,
        rate_per_sec: f64,
        read_ratio: f64,
        size_bytes: u32,
        duration: Nanos,
    ) -> Result<PointResult, CalibrateError>;
}

/// Checks the arguments of [`LoadRunner::run_point`], the same for every runner: a positive
/// finite rate and duration, a read ratio in 0..=1, and a size that is a positive multiple of
/// `alignment_bytes` no larger than `size_max_bytes`.
pub fn check_point_arguments(
    rate_per_sec: f64,
    read_ratio: f64,
    size_bytes: u32,
    duration: Nanos,
    alignment_bytes: u32,
    size_max_bytes: u64,
) -> Result<(), CalibrateError> {
    assert!(alignment_bytes > 0);
    if !(rate_per_sec > 0.0 && rate_per_sec.is_finite()) || duration.0 == 0 {
        return Err(CalibrateError::Config(format!(
            "rate {rate_per_sec}/s and duration {duration:?} must be positive"
        )));
    }
    if !(0.0..=1.0).contains(&read_ratio) {
        return Err(CalibrateError::Config(format!(
            "read ratio {read_ratio} is not in 0..=1"
        )));
    }
    if size_bytes == 0
        || !size_bytes.is_multiple_of(alignment_bytes)
        || u64::from(size_bytes) > size_max_bytes
    {
        return Err(CalibrateError::Config(format!(
            "request size {size_bytes} must be a positive multiple of {alignment_bytes} up to {size_max_bytes}"
        )));
    }
    Ok(())
}

/// What to sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepConfig {
    pub read_ratios: Vec<f64>,
    pub sizes: Vec<u32>,
    /// Measurement length of one point, in µs.
    pub duration_us: u64,
    /// Load levels per curve, spread evenly up to the bracketing rate.
    pub points_per_curve: u32,
    /// A curve ends once p95 exceeds this (the loosest SLO of interest, with margin).
    pub latency_us_max: f64,
    /// First rate of the doubling search that brackets each curve's knee.
    pub start_rate_per_sec: f64,
    /// Times an overloaded bracketing point is measured again before the search believes it:
    /// the search ends only if every repetition is overloaded too. 0 for the exact emulated
    /// device; real devices on a shared machine see latency spikes that do not come from the
    /// load, and one spike must not end a curve at a fraction of its knee.
    #[serde(default)]
    pub bracket_confirmations: u32,
    /// Search every curve's end first, then measure load level 1 of every curve, then level
    /// 2, and so on, instead of one curve after another. A real device's conditions drift
    /// (other work on the machine, throttling by the host); interleaved, a bad minute spoils a
    /// few load levels across all curves, which then stand out against their neighbours,
    /// instead of a whole curve that looks plausible and skews the write cost. The emulated
    /// device keeps the curve-by-curve order.
    #[serde(default)]
    pub interleave_curves: bool,
    /// The curve's points spread up to the search's end rate times this (at least 1). On a
    /// real device the search judges overload from short, noisy points; reaching past it makes
    /// sure each curve's heaviest points are overloaded when measured in full, which the fit
    /// needs (the curves must share a latency range). 1 for the emulated device.
    #[serde(default = "ceiling_overshoot_default")]
    pub ceiling_overshoot: f64,
}

fn ceiling_overshoot_default() -> f64 {
    1.0
}

impl Default for SweepConfig {
    fn default() -> Self {
        SweepConfig {
            read_ratios: READ_RATIOS_DEFAULT.to_vec(),
            sizes: vec![4096],
            duration_us: 200_000,
            points_per_curve: 20,
            latency_us_max: 4000.0,
            start_rate_per_sec: 1000.0,
            bracket_confirmations: 0,
            interleave_curves: false,
            ceiling_overshoot: 1.0,
        }
    }
}

/// All points of a sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sweep {
    pub runner: String,
    pub config: SweepConfig,
    pub points: Vec<PointResult>,
}

impl Sweep {
    /// Points of one curve, by increasing offered rate.
    pub fn curve(&self, read_ratio: f64, size_bytes: u32) -> Vec<&PointResult> {
        let mut points: Vec<&PointResult> = self
            .points
            .iter()
            .filter(|p| same_ratio(p.read_ratio, read_ratio) && p.size_bytes == size_bytes)
            .collect();
        points.sort_by(|a, b| a.rate_per_sec.total_cmp(&b.rate_per_sec));
        points
    }
}

pub(crate) fn same_ratio(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// Where a sweep is, for the progress line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Phase {
    /// Doubling the rate to find where the curve ends.
    Bracket,
    /// Measuring point `index` (0-based) of `count`.
    Curve { index: u32, count: u32 },
}

#[derive(Debug, Clone, Copy)]
pub struct Progress<'a> {
    pub curve_index: usize,
    pub curve_count: usize,
    pub phase: Phase,
    pub point: &'a PointResult,
}

/// Measures every (read ratio, size) curve. Each curve first doubles the rate (short points)
/// until p95 passes `latency_us_max` or throughput stops following the offered load (and
/// stays so for `bracket_confirmations` repetitions), then
/// measures `points_per_curve` evenly spaced rates up to there, stopping after two points past
/// `latency_us_max`.
pub fn sweep(
    runner: &mut dyn LoadRunner,
    config: &SweepConfig,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Sweep, CalibrateError> {
    if config.read_ratios.is_empty() || config.sizes.is_empty() {
        return Err(CalibrateError::Config(
            "need at least one read ratio and one size".into(),
        ));
    }
    if config.read_ratios.iter().any(|r| !(0.0..=1.0).contains(r)) {
        return Err(CalibrateError::Config(
            "read ratios must lie in 0..=1".into(),
        ));
    }
    if !(config.ceiling_overshoot >= 1.0 && config.ceiling_overshoot <= 16.0) {
        return Err(CalibrateError::Config(
            "ceiling_overshoot must lie in 1..=16".into(),
        ));
    }
    if config.points_per_curve < 2 || config.start_rate_per_sec <= 0.0 {
        return Err(CalibrateError::Config(
            "points_per_curve must be at least 2 and start_rate_per_sec positive".into(),
        ));
    }
    let curves: Vec<(u32, f64)> = config
        .sizes
        .iter()
        .flat_map(|&size| config.read_ratios.iter().map(move |&ratio| (size, ratio)))
        .collect();
    let curve_count = curves.len();
    let mut points = Vec::new();
    if !config.interleave_curves {
        for (curve_index, &(size_bytes, read_ratio)) in curves.iter().enumerate() {
            let ceiling = bracket(
                runner,
                config,
                curve_index,
                curve_count,
                read_ratio,
                size_bytes,
                progress,
            )?;
            let mut past_max = 0;
            for index in 0..config.points_per_curve {
                let point = curve_point(
                    runner,
                    config,
                    (curve_index, curve_count),
                    (read_ratio, size_bytes),
                    ceiling,
                    index,
                    progress,
                )?;
                let over = point.read_latency_us_p95 > config.latency_us_max;
                points.push(point);
                if over {
                    past_max += 1;
                    if past_max >= 2 {
                        break;
                    }
                }
            }
        }
    } else {
        let mut ceilings = Vec::with_capacity(curve_count);
        for (curve_index, &(size_bytes, read_ratio)) in curves.iter().enumerate() {
            ceilings.push(bracket(
                runner,
                config,
                curve_index,
                curve_count,
                read_ratio,
                size_bytes,
                progress,
            )?);
        }
        let mut past_max = vec![0u32; curve_count];
        for index in 0..config.points_per_curve {
            for (curve_index, &(size_bytes, read_ratio)) in curves.iter().enumerate() {
                if past_max[curve_index] >= 2 {
                    continue;
                }
                let point = curve_point(
                    runner,
                    config,
                    (curve_index, curve_count),
                    (read_ratio, size_bytes),
                    ceilings[curve_index],
                    index,
                    progress,
                )?;
                if point.read_latency_us_p95 > config.latency_us_max {
                    past_max[curve_index] += 1;
                }
                points.push(point);
            }
        }
    }
    debug_assert!(points.len() <= curve_count * config.points_per_curve as usize);
    Ok(Sweep {
        runner: runner.describe(),
        config: config.clone(),
        points,
    })
}

/// The doubling search of one curve: the first rate found overloaded (and confirmed), times
/// the overshoot.
fn bracket(
    runner: &mut dyn LoadRunner,
    config: &SweepConfig,
    curve_index: usize,
    curve_count: usize,
    read_ratio: f64,
    size_bytes: u32,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<f64, CalibrateError> {
    let bracket_duration = Nanos((Nanos::from_micros(config.duration_us).0 / 4).max(1));
    let mut rate = config.start_rate_per_sec;
    for _ in 0..BRACKET_STEPS_MAX {
        let point = runner.run_point(rate, read_ratio, size_bytes, bracket_duration)?;
        progress(Progress {
            curve_index,
            curve_count,
            phase: Phase::Bracket,
            point: &point,
        });
        let mut confirmed = overloaded(&point, config.latency_us_max, bracket_duration);
        for _ in 0..config.bracket_confirmations {
            if !confirmed {
                break;
            }
            let again = runner.run_point(rate, read_ratio, size_bytes, bracket_duration)?;
            progress(Progress {
                curve_index,
                curve_count,
                phase: Phase::Bracket,
                point: &again,
            });
            confirmed = overloaded(&again, config.latency_us_max, bracket_duration);
        }
        if confirmed {
            return Ok(rate * config.ceiling_overshoot);
        }
        rate *= 2.0;
    }
    Err(CalibrateError::Insufficient(format!(
        "read ratio {read_ratio}, size {size_bytes}: latency stayed below {} µs up to {rate} requests/s",
        config.latency_us_max
    )))
}

/// Point `index` of a curve whose search ended at `ceiling`: `ceiling × (index + 1) / count`.
fn curve_point(
    runner: &mut dyn LoadRunner,
    config: &SweepConfig,
    (curve_index, curve_count): (usize, usize),
    (read_ratio, size_bytes): (f64, u32),
    ceiling: f64,
    index: u32,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<PointResult, CalibrateError> {
    let rate = ceiling * f64::from(index + 1) / f64::from(config.points_per_curve);
    let duration = Nanos::from_micros(config.duration_us);
    let point = runner.run_point(rate, read_ratio, size_bytes, duration)?;
    progress(Progress {
        curve_index,
        curve_count,
        phase: Phase::Curve {
            index,
            count: config.points_per_curve,
        },
        point: &point,
    });
    Ok(point)
}

/// Whether a bracketing point is past the end of the curve: p95 above the limit, requests
/// refused or left unfinished, or throughput clearly below the offered load (judged only when
/// the point had enough requests for the shortfall to be more than noise).
fn overloaded(point: &PointResult, latency_us_max: f64, duration: Nanos) -> bool {
    let expected = point.rate_per_sec * duration.as_secs_f64();
    point.read_latency_us_p95 > latency_us_max
        || point.refused > 0
        || point.unfinished > 0
        || (expected >= 1000.0 && point.iops < 0.85 * point.rate_per_sec)
}

/// Rounds and names a fitted profile (what `reflex calibrate` writes).
pub fn profile_from_fit(name: &str, fit: &Fit) -> DeviceProfile {
    let mut profile = fit.profile.clone();
    profile.name = name.to_string();
    profile
}
