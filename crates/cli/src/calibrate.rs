//! `reflex calibrate`: measure a device and write the QoS device profile the scheduler uses.
//!
//! The measuring and fitting live in `reflex_flash::calibrate`; this module picks the load
//! runner for `--device`, plans the time (`--budget` or `--duration-ms`), shows a live progress
//! line on stderr, writes the profile TOML, the raw sweep (JSON) and two SVG plots: p95 read
//! latency against IOPS per read ratio (ReFlex Figure 1) and against tokens/s under the fitted
//! cost model (Figure 3).
//!
//! Runners ([`runner_for`]): `emu:NAME` runs the emulated device in virtual time; a local file
//! or block device (`file:PATH` or `PATH`) and a remote namespace (`reflex://HOST:PORT/NS`) run
//! in real time through the bench engine ([`runner::RealTimeRunner`]). Real devices are only
//! written with `--allow-writes` (every read ratio below 100 % and `--precondition` write), and
//! targets whose measurement would describe memory rather than a device (tmpfs, no O_DIRECT, a
//! sparse file) are refused unless `--force`: see [`device`].

pub mod device;
pub mod outliers;
pub mod runner;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use reflex_flash::calibrate::{
    self, EmuRunner, Fit, LoadRunner, Phase, PreconditionPlan, Progress, Sweep, SweepConfig,
};
use reflex_flash::emu::EmuProfile;
use reflex_qos::Nanos;

use self::device::{DeviceSpec, LocalOptions, TargetError};
use self::runner::{RealTimeRunner, RunnerSettings};
use crate::bench::units::parse_size;

/// Per-point duration without `--budget` or `--duration-ms`.
const POINT_DURATION_MS_DEFAULT: u64 = 200;
/// Shortest point a budget may plan: below it p95 rests on too few reads.
const POINT_DURATION_MIN: Duration = Duration::from_millis(50);
/// Longest point a budget may plan (more adds little and delays progress).
const POINT_DURATION_MAX: Duration = Duration::from_secs(10);
/// What the rate-doubling search costs, in points: about ten steps (1K/s to 1M/s) at a
/// quarter of the point duration each (see `reflex_flash::calibrate::sweep`).
const BRACKET_POINTS: f64 = 10.0;
const BRACKET_POINT_EQUIVALENTS: f64 = BRACKET_POINTS / 4.0;
/// How far past the search's end a real device's curve reaches (see `SweepConfig`).
const CEILING_OVERSHOOT_REAL: f64 = 1.25;
/// Repetitions that confirm an overloaded bracketing point on a real device.
const BRACKET_CONFIRMATIONS_REAL: u32 = 1;
/// Fixed cost of one real-time point beyond its duration: thread, ring, connections, drain.
const POINT_OVERHEAD: Duration = Duration::from_millis(20);
/// Share of the sweep's part of `--budget` kept for measuring suspect points again.
const REMEASURE_BUDGET_SHARE: f64 = 0.25;
/// Share of `--budget` that preconditioning may take at most.
const PRECONDITION_BUDGET_SHARE: f64 = 1.0 / 3.0;
/// Longest `--budget`: one day.
const BUDGET_SECS_MAX: u64 = 86_400;

#[derive(clap::Args)]
pub struct Args {
    /// Device to calibrate: `file:PATH` or `PATH` (a file or block device, io_uring with
    /// O_DIRECT), `reflex://HOST:PORT[/NAMESPACE]` (a ReFlex server's namespace), or
    /// `emu:device-a`, `emu:device-a-small`, `emu:/path/profile.toml` (virtual time).
    #[arg(long, required_unless_present = "refit")]
    device: Option<String>,
    /// Bytes of the device to use (emulated: its size, default 1G; file, block device or
    /// namespace: the first SIZE bytes, default all; a missing file is created this large
    /// with --allow-writes --precondition).
    #[arg(long, value_parser = parse_size)]
    size_bytes: Option<u64>,
    /// Precondition first: sequential fill, then random 4 KiB writes over the range (a fresh
    /// emulated device; a real one is written, so this needs --allow-writes).
    #[arg(long)]
    precondition: bool,
    /// Real devices: let calibration write to the device. Read ratios below 100 % and
    /// --precondition overwrite data on it: everything stored there is lost.
    #[arg(long)]
    allow_writes: bool,
    /// Real devices: calibrate even what would measure memory rather than a device (a file on
    /// tmpfs, buffered I/O where O_DIRECT is refused, a sparse file) or a mounted block device.
    #[arg(long)]
    force: bool,
    /// Real devices: wall-clock seconds for the whole run; preconditioning takes at most a
    /// third (and at most --precondition-secs), the sweep's points share the rest.
    #[arg(long, conflicts_with = "duration_ms")]
    budget: Option<u64>,
    /// Real devices: longest preconditioning, in seconds.
    #[arg(long, default_value_t = 120)]
    precondition_secs: u64,
    /// Real devices: back-to-back runs per point (splitting its duration); the point reports
    /// their medians, so one burst of other I/O on a shared machine spoils a run, not a point.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Real devices: when a point is slow, a light read-only canary checks whether the device
    /// is slow even without load (another process's I/O, throttling by the host); if so the
    /// point is measured again after a pause. At most this many seconds of pauses in all
    /// (0: no checks).
    #[arg(long, default_value_t = 60)]
    stall_wait_secs: u64,
    /// Read ratios in percent.
    #[arg(long, default_value = "100,99,95,90,75,50")]
    ratios: String,
    /// Request sizes in bytes; the smallest is calibrated, larger ones are checked for scaling.
    #[arg(long, default_value = "4096")]
    sizes: String,
    /// Measurement time per load point (virtual time for the emulated device); default 200.
    #[arg(long)]
    duration_ms: Option<u64>,
    /// Load levels per curve.
    #[arg(long, default_value_t = 20)]
    points: u32,
    /// A curve stops once p95 passes this.
    #[arg(long, default_value_t = 4000.0)]
    latency_max_us: f64,
    /// First rate of each curve's doubling search, requests per second.
    #[arg(long, default_value_t = 1000.0)]
    start_rate: f64,
    /// p95 SLO rows of the profile, in µs.
    #[arg(long, default_value = "200,300,400,500,750,1000,1500,2000,2500,3000")]
    slos_us: String,
    /// Seed of the load (offsets, arrivals; the virtual-time runner's device).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Name written into the profile (default: the device spec).
    #[arg(long)]
    name: Option<String>,
    /// Where to write the profile TOML (default: stdout).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write PREFIX-iops.svg and PREFIX-tokens.svg.
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Write the raw sweep points as JSON (also when the fit fails).
    #[arg(long)]
    sweep_json: Option<PathBuf>,
    /// Measure nothing: fit the sweep a previous --sweep-json wrote (e.g. with other
    /// --slos-us) and write the profile and plots again.
    #[arg(long, value_name = "SWEEP_JSON", conflicts_with_all = ["device", "precondition", "budget"])]
    refit: Option<PathBuf>,
}

fn list<T: std::str::FromStr>(text: &str, what: &str) -> Result<Vec<T>> {
    text.split(',')
        .map(|v| v.trim().parse::<T>())
        .collect::<Result<Vec<T>, _>>()
        .map_err(|_| anyhow::anyhow!("{what}: cannot parse {text:?}"))
}

/// How the run's time is spent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimePlan {
    /// Length of one measured point (bracketing points take a quarter).
    pub point_duration: Duration,
    /// Longest preconditioning (real devices).
    pub precondition_time_max: Duration,
    /// Upper estimate of the sweep's wall time, for the progress line.
    pub sweep_estimate: Duration,
    /// The whole run's wall-clock bound (`--budget`), if any: re-measuring stops before it.
    pub budget: Option<Duration>,
}

/// Splits `budget` between preconditioning and `curves` curves of `points` points.
pub fn plan_budget(
    budget: Duration,
    precondition: bool,
    precondition_time_max: Duration,
    curves: usize,
    points: u32,
    runs: u32,
) -> Result<TimePlan> {
    assert!(curves > 0);
    let precondition_time_max = if precondition {
        precondition_time_max.min(budget.mul_f64(PRECONDITION_BUDGET_SHARE))
    } else {
        Duration::ZERO
    };
    let sweep_time = budget
        .saturating_sub(precondition_time_max)
        .mul_f64(1.0 - REMEASURE_BUDGET_SHARE);
    let per_curve = sweep_time.as_secs_f64() / curves as f64;
    let overhead = point_overhead_secs(points, runs);
    let point_secs = (per_curve - overhead) / (f64::from(points) + BRACKET_POINT_EQUIVALENTS);
    if point_secs < POINT_DURATION_MIN.as_secs_f64() {
        let needed = curves as f64
            * (overhead
                + (f64::from(points) + BRACKET_POINT_EQUIVALENTS)
                    * POINT_DURATION_MIN.as_secs_f64());
        bail!(
            "--budget {} s is too small for {curves} curve(s) of {points} points: the sweep alone \
             needs at least {needed:.0} s at {} ms per point; raise --budget or lower --points, \
             --ratios or --sizes",
            budget.as_secs(),
            POINT_DURATION_MIN.as_millis()
        );
    }
    let point_duration = Duration::from_secs_f64(point_secs).min(POINT_DURATION_MAX);
    Ok(TimePlan {
        point_duration,
        precondition_time_max,
        sweep_estimate: sweep_estimate(point_duration, curves, points, runs),
        budget: Some(budget),
    })
}

/// Fixed costs of one curve: every point and bracketing step, each run of them.
fn point_overhead_secs(points: u32, runs: u32) -> f64 {
    (f64::from(points) + BRACKET_POINTS) * f64::from(runs.max(1)) * POINT_OVERHEAD.as_secs_f64()
}

fn sweep_estimate(point_duration: Duration, curves: usize, points: u32, runs: u32) -> Duration {
    let per_curve = point_overhead_secs(points, runs)
        + (f64::from(points) + BRACKET_POINT_EQUIVALENTS) * point_duration.as_secs_f64();
    Duration::from_secs_f64(per_curve * curves as f64)
}

/// Why the configured calibration writes to the device, if it does.
fn writes_reason(precondition: bool, read_ratios: &[f64]) -> Option<String> {
    let mut reasons = Vec::new();
    if precondition {
        reasons.push("--precondition".to_string());
    }
    let mixed: Vec<String> = read_ratios
        .iter()
        .filter(|&&r| r < 1.0)
        .map(|r| format!("{:.0} %", r * 100.0))
        .collect();
    if !mixed.is_empty() {
        reasons.push(format!("read ratios {}", mixed.join(", ")));
    }
    (!reasons.is_empty()).then(|| reasons.join(" and "))
}

/// The load runner for `--device`: emulated (virtual time) or real (bench engine, real time),
/// with every check of [`device`] made before anything is written.
pub fn runner_for(
    args: &Args,
    plan: &TimePlan,
    read_ratios: &[f64],
) -> Result<Box<dyn LoadRunner>> {
    let device = device_text(args)?;
    let spec = DeviceSpec::parse(device)?;
    let writes = writes_reason(args.precondition, read_ratios);
    let settings = RunnerSettings {
        writes_allowed: args.allow_writes,
        precondition_time_max: plan.precondition_time_max,
        seed: args.seed,
        runs_per_point: args.runs,
        // Waiting for stalls to pass takes at most a quarter of a budget.
        stall_wait_max: Duration::from_secs(args.stall_wait_secs)
            .min(plan.budget.map_or(Duration::MAX, |budget| budget / 4)),
    };
    if !matches!(spec, DeviceSpec::Emulated { .. })
        && let (Some(why), false) = (&writes, args.allow_writes)
    {
        return Err(TargetError::WritesNotAllowed {
            target: device.to_string(),
            why: why.clone(),
        }
        .into());
    }
    match spec {
        DeviceSpec::Emulated { profile } => {
            let profile = EmuProfile::lookup(&profile)?;
            let size_bytes = args.size_bytes.unwrap_or(1 << 30);
            let runner = if args.precondition {
                EmuRunner::fresh(profile, size_bytes, args.seed)?
            } else {
                EmuRunner::new(profile, size_bytes, args.seed)?
            };
            Ok(Box::new(runner))
        }
        DeviceSpec::Local { path } => {
            let options = LocalOptions {
                writable: writes.is_some(),
                force: args.force,
                will_fill: args.precondition,
                create_size_bytes: args.size_bytes,
            };
            let device = device::open_local(&path, options)?;
            if device.created {
                eprintln!(
                    "created {} ({} MiB) for calibration",
                    path.display(),
                    device.size_bytes >> 20
                );
            }
            if !device.direct_io {
                eprintln!(
                    "warning: {} is measured with buffered I/O (--force): the profile \
                     describes the page cache, not the device",
                    path.display()
                );
            }
            let range = args.size_bytes.filter(|_| !device.created);
            Ok(Box::new(RealTimeRunner::local(device, range, settings)?))
        }
        DeviceSpec::Remote {
            host_port,
            namespace,
        } => {
            let device = device::open_remote(&host_port, namespace, writes.is_some())?;
            Ok(Box::new(RealTimeRunner::remote(
                device,
                args.size_bytes,
                settings,
            )?))
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    let slos_us: Vec<u64> = list(&args.slos_us, "--slos-us")?;
    let (sweep, notes) = match &args.refit {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let sweep: Sweep = serde_json::from_str(&text).with_context(|| {
                format!("{} is not a sweep written by --sweep-json", path.display())
            })?;
            eprintln!(
                "refitting {} points of {}",
                sweep.points.len(),
                sweep.runner
            );
            (sweep, vec![format!("Refitted from {}.", path.display())])
        }
        None => measure(&args)?,
    };
    publish(&args, &sweep, &notes, &slos_us)
}

/// Runs the calibration's measurements; returns the sweep and provenance lines for the profile.
fn measure(args: &Args) -> Result<(Sweep, Vec<String>)> {
    let read_ratios: Vec<f64> = list::<f64>(&args.ratios, "--ratios")?
        .into_iter()
        .map(|percent| percent / 100.0)
        .collect();
    let sizes: Vec<u32> = list(&args.sizes, "--sizes")?;
    let device = device_text(args)?;
    let spec = DeviceSpec::parse(device)?;
    let real_time = !matches!(spec, DeviceSpec::Emulated { .. });
    let curves = read_ratios.len() * sizes.len();
    if curves == 0 {
        bail!("--ratios and --sizes need at least one value each");
    }
    if !(1..=runner::RUNS_PER_POINT_MAX).contains(&args.runs) {
        bail!(
            "--runs must be between 1 and {}",
            runner::RUNS_PER_POINT_MAX
        );
    }
    let plan = match (args.budget, real_time) {
        (Some(_), false) => {
            bail!("--budget is for real devices: {device} runs in virtual time; use --duration-ms")
        }
        (Some(budget), true) => {
            if budget == 0 || budget > BUDGET_SECS_MAX {
                bail!("--budget must be between 1 and {BUDGET_SECS_MAX} s");
            }
            plan_budget(
                Duration::from_secs(budget),
                args.precondition,
                Duration::from_secs(args.precondition_secs),
                curves,
                args.points,
                args.runs,
            )?
        }
        (None, _) => {
            let point_duration =
                Duration::from_millis(args.duration_ms.unwrap_or(POINT_DURATION_MS_DEFAULT));
            if point_duration.is_zero() {
                bail!("--duration-ms must be positive");
            }
            TimePlan {
                point_duration,
                precondition_time_max: Duration::from_secs(args.precondition_secs),
                sweep_estimate: sweep_estimate(point_duration, curves, args.points, args.runs),
                budget: None,
            }
        }
    };
    let config = SweepConfig {
        read_ratios: read_ratios.clone(),
        sizes,
        duration_us: plan.point_duration.as_micros() as u64,
        points_per_curve: args.points,
        latency_us_max: args.latency_max_us,
        start_rate_per_sec: args.start_rate,
        // Virtual time is exact; real devices on a shared machine have spikes of their own.
        bracket_confirmations: if real_time {
            BRACKET_CONFIRMATIONS_REAL
        } else {
            0
        },
        interleave_curves: real_time,
        ceiling_overshoot: if real_time {
            CEILING_OVERSHOOT_REAL
        } else {
            1.0
        },
    };
    let mut runner = runner_for(args, &plan, &read_ratios)?;
    eprintln!("calibrating {}", runner.describe());
    let started = Instant::now();
    if args.precondition {
        let mut shown_permille = u64::MAX;
        runner.precondition(&PreconditionPlan::default(), &mut |done| {
            // Redraw only when the shown value changes: progress comes per completion.
            let permille = (done * 1000.0) as u64;
            if permille != shown_permille {
                shown_permille = permille;
                eprint!(
                    "\r\x1b[Kpreconditioning {:5.1} %  [{:.0} s]",
                    done * 100.0,
                    started.elapsed().as_secs_f64()
                );
                let _ = std::io::stderr().flush();
            }
        })?;
        eprintln!();
        eprintln!("{}", runner.describe());
    }
    if real_time {
        eprintln!(
            "sweep: {curves} curve(s) of up to {} points, {} ms per point: at most about {:.0} s",
            args.points,
            plan.point_duration.as_millis(),
            plan.sweep_estimate.as_secs_f64()
        );
    }
    let sweep_started = Instant::now();
    let mut sweep = calibrate::sweep(runner.as_mut(), &config, &mut |progress| {
        show_progress(progress, real_time.then_some(sweep_started))
    })?;
    eprintln!();
    let remeasured = if real_time {
        // Start no re-measurement that could not finish within the budget.
        let deadline = plan
            .budget
            .map(|budget| started + budget.saturating_sub(plan.point_duration * 3));
        let report = outliers::remeasure(
            runner.as_mut(),
            &mut sweep,
            Nanos::from_micros(config.duration_us),
            deadline,
            &mut |done, count, point| {
                eprint!(
                    "\r\x1b[Kre-measuring suspect {done}/{count} (slower than a point with more \
                     load and writes): read {:.0} % at {:.0}/s, p95 now {:.0} µs",
                    point.read_ratio * 100.0,
                    point.rate_per_sec,
                    point.read_latency_us_p95
                );
                let _ = std::io::stderr().flush();
            },
        )?;
        if report.remeasured + report.skipped > 0 {
            eprintln!();
            eprintln!(
                "re-measured {} point(s) whose p95 was over {}x that of a point with more load \
                 and writes ({} skipped for the budget); {} still are",
                report.remeasured,
                outliers::OUTLIER_FACTOR,
                report.skipped,
                report.still_suspect
            );
        }
        if report.still_suspect > 0 {
            eprintln!(
                "warning: {} point(s) still contradict points with more load and writes: the \
                 machine was noisy during the calibration and the fitted costs are doubtful; \
                 look at the plots, and calibrate again at a quieter time",
                report.still_suspect
            );
        }
        Some(report)
    } else {
        None
    };
    // Re-measuring and stall checks may have added to what the runner has to say.
    sweep.runner = runner.describe();
    let sweep_secs = sweep_started.elapsed().as_secs_f64();
    if let Some(path) = &args.sweep_json {
        std::fs::write(path, serde_json::to_string_pretty(&sweep)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    let mut notes = Vec::new();
    if let Some(report) = remeasured {
        notes.push(format!(
            "Sweep: {} points of {} ms ({} runs each, medians) in {:.0} s of wall time; {} \
             suspects re-measured ({} skipped for the budget), {} still suspect.",
            sweep.points.len(),
            plan.point_duration.as_millis(),
            args.runs,
            sweep_secs,
            report.remeasured,
            report.skipped,
            report.still_suspect
        ));
    }
    Ok((sweep, notes))
}

/// Fits `sweep` and writes the profile, the plots and (refitting) nothing else.
fn publish(args: &Args, sweep: &Sweep, notes: &[String], slos_us: &[u64]) -> Result<()> {
    if args.refit.is_some()
        && let Some(path) = &args.sweep_json
    {
        std::fs::write(path, serde_json::to_string_pretty(&sweep)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let fit = calibrate::fit(sweep, slos_us)?;
    let name = match &args.name {
        Some(name) => name.clone(),
        None => args.device.clone().unwrap_or_else(|| sweep.runner.clone()),
    };
    let profile = calibrate::profile_from_fit(&name, &fit);
    let mut text = format!(
        "# Calibrated by `reflex calibrate` from {}.\n# Fitted write cost {:.3}, read-only read cost {:.3}, curve spread {:.3}.\n",
        sweep.runner, fit.write_cost, fit.read_only_read_cost, fit.spread
    );
    for note in notes {
        text.push_str(&format!("# {note}\n"));
    }
    text.push_str(&profile.to_toml());
    match &args.out {
        Some(path) => {
            std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => print!("{text}"),
    }
    eprintln!(
        "write cost {:.3}, read-only read cost {:.3}, spread {:.3}",
        fit.write_cost, fit.read_only_read_cost, fit.spread
    );
    for size in &fit.size_costs {
        eprintln!(
            "{} B: {:.2} tokens per command (model charges {})",
            size.size_bytes, size.tokens_per_command, size.model_tokens_per_command
        );
    }
    if let Some(prefix) = &args.plots {
        let iops_path = with_suffix(prefix, "-iops.svg");
        let tokens_path = with_suffix(prefix, "-tokens.svg");
        plot(sweep, &fit, &iops_path, Axis::Iops)?;
        plot(sweep, &fit, &tokens_path, Axis::Tokens)?;
        eprintln!(
            "wrote {} and {}",
            iops_path.display(),
            tokens_path.display()
        );
    }
    Ok(())
}

fn device_text(args: &Args) -> Result<&str> {
    match &args.device {
        Some(device) => Ok(device),
        None => bail!("--device is required (or --refit SWEEP.json)"),
    }
}

fn show_progress(progress: Progress<'_>, started: Option<Instant>) {
    let point = progress.point;
    let phase = match progress.phase {
        Phase::Bracket => "search".to_string(),
        Phase::Curve { index, count } => format!("{:>2}/{count}", index + 1),
    };
    let clock = started.map_or(String::new(), |started| {
        format!("  [{:.0} s]", started.elapsed().as_secs_f64())
    });
    eprint!(
        "\r\x1b[Kcurve {}/{} read {:>3.0} % {} B  point {phase}  {:>9.0}/s offered {:>9.0} IOPS  p95 {:>8.0} µs{clock}",
        progress.curve_index + 1,
        progress.curve_count,
        point.read_ratio * 100.0,
        point.size_bytes,
        point.rate_per_sec,
        point.iops,
        point.read_latency_us_p95
    );
    let _ = std::io::stderr().flush();
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut text = prefix.as_os_str().to_os_string();
    text.push(suffix);
    PathBuf::from(text)
}

#[derive(Clone, Copy, PartialEq)]
enum Axis {
    /// Figure 1: total IOPS.
    Iops,
    /// Figure 3: tokens/s under the fitted costs.
    Tokens,
}

/// A p95 axis spanning more than this ratio is drawn logarithmic.
const LOG_AXIS_SPAN_MIN: f64 = 30.0;

const COLOURS: [RGBColor; 6] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
];

/// p95 read latency against load, one line per read ratio (the calibrated size only).
fn plot(sweep: &Sweep, fit: &Fit, path: &Path, axis: Axis) -> Result<()> {
    let latency_cap = sweep.config.latency_us_max;
    let curves: Vec<(f64, Vec<(f64, f64)>)> = sweep
        .config
        .read_ratios
        .iter()
        .map(|&ratio| {
            let points = sweep
                .curve(ratio, fit.size_bytes)
                .into_iter()
                .filter(|p| p.read_latency_us_p95 <= latency_cap)
                .map(|p| {
                    let x = match axis {
                        Axis::Iops => p.iops,
                        Axis::Tokens if ratio >= 1.0 => p.iops * fit.read_only_read_cost,
                        Axis::Tokens => p.tokens_per_sec(fit.write_cost),
                    };
                    (x / 1e3, p.read_latency_us_p95)
                })
                .collect();
            (ratio, points)
        })
        .collect();
    let x_max = curves
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .fold(1.0, f64::max)
        * 1.05;
    let (title, x_label) = match axis {
        Axis::Iops => (
            // The runner's description up to its first note (preconditioning, stalls).
            format!(
                "{}: p95 read latency vs IOPS",
                sweep.runner.split(';').next().unwrap_or_default()
            ),
            "Total IOPS (thousands)".to_string(),
        ),
        Axis::Tokens => (
            format!(
                "p95 vs weighted IOPS: write = {:.1} tokens, read-only read = {:.2}",
                fit.write_cost, fit.read_only_read_cost
            ),
            "Tokens/s (thousands)".to_string(),
        ),
    };
    // Real devices span microseconds to the overload's tens of milliseconds: a linear axis
    // would flatten everything below the knee, so wide spans get a logarithmic one.
    let latency_min = curves
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.1))
        .filter(|latency| *latency > 0.0)
        .fold(f64::INFINITY, f64::min);
    let logarithmic = latency_min.is_finite() && latency_cap / latency_min > LOG_AXIS_SPAN_MIN;
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let builder = &mut ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65);
    // The two axis kinds are different chart types, so the drawing is spelled out for both.
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart.map_err(plot_error)?;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc("p95 read latency (µs)")
                .draw()
                .map_err(plot_error)?;
            for (index, (ratio, points)) in curves.into_iter().enumerate() {
                let colour = COLOURS[index % COLOURS.len()];
                chart
                    .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
                    .map_err(plot_error)?
                    .label(format!("{:.0}% read", ratio * 100.0))
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                    });
                chart
                    .draw_series(
                        points
                            .into_iter()
                            .map(|p| Circle::new(p, 3, colour.filled())),
                    )
                    .map_err(plot_error)?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(plot_error)?;
        }};
    }
    if logarithmic {
        draw!(builder.build_cartesian_2d(0.0..x_max, (latency_min * 0.8..latency_cap).log_scale()));
    } else {
        draw!(builder.build_cartesian_2d(0.0..x_max, 0.0..latency_cap));
    }
    root.present().map_err(plot_error)?;
    Ok(())
}

fn plot_error<E: std::fmt::Display>(error: E) -> anyhow::Error {
    anyhow::anyhow!("plotting failed: {error}")
}
