//! `reflex calibrate`: measure a device and write the QoS device profile the scheduler uses.
//!
//! The measuring and fitting live in `reflex_flash::calibrate`; this module picks the load
//! runner for `--device`, shows a live progress line on stderr, writes the profile TOML, the
//! raw sweep (JSON) and two SVG plots: p95 read latency against IOPS per read ratio (ReFlex
//! Figure 1) and against tokens/s under the fitted cost model (Figure 3).
//!
//! Runners: `emu:NAME` runs the emulated device in virtual time. Real-time runners (a local
//! file through io_uring, a remote namespace) plug in through [`runner_for`] by implementing
//! `reflex_flash::calibrate::LoadRunner`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use reflex_flash::calibrate::{
    self, EmuRunner, Fit, LoadRunner, Phase, PreconditionPlan, Progress, Sweep, SweepConfig,
};
use reflex_flash::emu::EmuProfile;

#[derive(clap::Args)]
pub struct Args {
    /// Device to calibrate: `emu:device-a`, `emu:device-a-small`, `emu:/path/profile.toml`.
    #[arg(long)]
    device: String,
    /// Namespace size in bytes for devices that need one (the emulated device).
    #[arg(long, default_value_t = 1 << 30)]
    size_bytes: u64,
    /// Start from a fresh device and precondition it (sequential fill, then random writes).
    #[arg(long)]
    precondition: bool,
    /// Read ratios in percent.
    #[arg(long, default_value = "100,99,95,90,75,50")]
    ratios: String,
    /// Request sizes in bytes; the smallest is calibrated, larger ones are checked for scaling.
    #[arg(long, default_value = "4096")]
    sizes: String,
    /// Measurement time per load point (virtual time for the emulated device).
    #[arg(long, default_value_t = 200)]
    duration_ms: u64,
    /// Load levels per curve.
    #[arg(long, default_value_t = 20)]
    points: u32,
    /// A curve stops once p95 passes this.
    #[arg(long, default_value_t = 4000.0)]
    latency_max_us: f64,
    /// p95 SLO rows of the profile, in µs.
    #[arg(long, default_value = "200,300,400,500,750,1000,1500,2000,2500,3000")]
    slos_us: String,
    /// Seed of the virtual-time runner.
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
    /// Write the raw sweep points as JSON.
    #[arg(long)]
    sweep_json: Option<PathBuf>,
}

fn list<T: std::str::FromStr>(text: &str, what: &str) -> Result<Vec<T>> {
    text.split(',')
        .map(|v| v.trim().parse::<T>())
        .collect::<Result<Vec<T>, _>>()
        .map_err(|_| anyhow::anyhow!("{what}: cannot parse {text:?}"))
}

/// The load runner for a device spec. Real-time runners plug in here.
pub fn runner_for(args: &Args) -> Result<Box<dyn LoadRunner>> {
    if let Some(name) = args.device.strip_prefix("emu:") {
        let profile = EmuProfile::lookup(name)?;
        let runner = if args.precondition {
            EmuRunner::fresh(profile, args.size_bytes, args.seed)?
        } else {
            EmuRunner::new(profile, args.size_bytes, args.seed)?
        };
        return Ok(Box::new(runner));
    }
    bail!(
        "no load runner for {:?} yet: only emulated devices (emu:NAME) can be calibrated so far",
        args.device
    )
}

pub fn run(args: Args) -> Result<()> {
    let read_ratios: Vec<f64> = list::<f64>(&args.ratios, "--ratios")?
        .into_iter()
        .map(|percent| percent / 100.0)
        .collect();
    let sizes: Vec<u32> = list(&args.sizes, "--sizes")?;
    let slos_us: Vec<u64> = list(&args.slos_us, "--slos-us")?;
    let config = SweepConfig {
        read_ratios,
        sizes,
        duration_us: args.duration_ms * 1000,
        points_per_curve: args.points,
        latency_us_max: args.latency_max_us,
        ..SweepConfig::default()
    };
    let mut runner = runner_for(&args)?;
    eprintln!("calibrating {}", runner.describe());
    if args.precondition {
        let mut shown_permille = u64::MAX;
        runner.precondition(&PreconditionPlan::default(), &mut |done| {
            // Redraw only when the shown value changes: progress comes per completion.
            let permille = (done * 1000.0) as u64;
            if permille != shown_permille {
                shown_permille = permille;
                eprint!("\rpreconditioning {:5.1} %", done * 100.0);
                let _ = std::io::stderr().flush();
            }
        })?;
        eprintln!();
    }
    let sweep = calibrate::sweep(runner.as_mut(), &config, &mut show_progress)?;
    eprintln!();
    let fit = calibrate::fit(&sweep, &slos_us)?;
    let name = args.name.clone().unwrap_or_else(|| args.device.clone());
    let profile = calibrate::profile_from_fit(&name, &fit);
    let mut text = format!(
        "# Calibrated by `reflex calibrate` from {}.\n# Fitted write cost {:.3}, read-only read cost {:.3}, curve spread {:.3}.\n",
        sweep.runner, fit.write_cost, fit.read_only_read_cost, fit.spread
    );
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
    if let Some(path) = &args.sweep_json {
        std::fs::write(path, serde_json::to_string_pretty(&sweep)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(prefix) = &args.plots {
        let iops_path = with_suffix(prefix, "-iops.svg");
        let tokens_path = with_suffix(prefix, "-tokens.svg");
        plot(&sweep, &fit, &iops_path, Axis::Iops)?;
        plot(&sweep, &fit, &tokens_path, Axis::Tokens)?;
        eprintln!(
            "wrote {} and {}",
            iops_path.display(),
            tokens_path.display()
        );
    }
    Ok(())
}

fn show_progress(progress: Progress<'_>) {
    let point = progress.point;
    let phase = match progress.phase {
        Phase::Bracket => "search".to_string(),
        Phase::Curve { index, count } => format!("{:>2}/{count}", index + 1),
    };
    eprint!(
        "\r\x1b[Kcurve {}/{} read {:>3.0} % {} B  point {phase}  {:>9.0} IOPS  p95 {:>8.0} µs",
        progress.curve_index + 1,
        progress.curve_count,
        point.read_ratio * 100.0,
        point.size_bytes,
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
            format!("{}: p95 read latency vs IOPS", sweep.runner),
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
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(0.0..x_max, 0.0..latency_cap)
        .map_err(plot_error)?;
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
    root.present().map_err(plot_error)?;
    Ok(())
}

fn plot_error<E: std::fmt::Display>(error: E) -> anyhow::Error {
    anyhow::anyhow!("plotting failed: {error}")
}
