//! `reflex model`: the queueing model of NVMe weighted arbitration (Gugnani et al. eqs. 1–3)
//! as a provisioning calculator. Give the class weights, how busy each class is (or what rate
//! it offers), and the device's throughput, parallelism and service time (or an emulated
//! profile to take them from); get each class's minimum and expected throughput and its
//! worst-case latency. `--sweep-low N` prints the high class across low-class utilisations,
//! the shape of the paper's Figure 7.

use anyhow::{Context, Result, bail};
use reflex_flash::emu::EmuProfile;
use reflex_flash::queueing::{self, ModelInput};
use serde::Serialize;

#[derive(clap::Args)]
pub struct Args {
    /// High, medium, low weights (commands per round for WRR, bytes for DRR).
    #[arg(long, default_value = "32,16,8")]
    weights: String,
    /// High, medium, low utilisations ρ (share of each class's quota it fills), 0..1.
    #[arg(long, default_value = "1,1,1")]
    util: String,
    /// Offered rates per class instead of --util, `-` for a backlogged class: `-,-,5000`.
    #[arg(long)]
    rates: Option<String>,
    /// γ: device throughput when saturated (commands/s).
    #[arg(long)]
    throughput: Option<f64>,
    /// Take γ, p and a from an emulated profile (`emu:device-a`), for reads of --io-bytes.
    #[arg(long)]
    profile: Option<String>,
    /// Request size when deriving from --profile.
    #[arg(long, default_value_t = 4096)]
    io_bytes: u32,
    /// q: commands each class keeps outstanding.
    #[arg(long, default_value_t = 64.0)]
    queue_depth: f64,
    /// p: commands served in parallel (default 1, with a = 1/γ).
    #[arg(long)]
    parallelism: Option<f64>,
    /// a: mean service time of one command in µs (default p/γ).
    #[arg(long)]
    service_us: Option<f64>,
    /// Print the high class for N+1 low-class utilisations from 0 to 1 (Figure 7).
    #[arg(long)]
    sweep_low: Option<u32>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn triple(text: &str, what: &str) -> Result<[f64; 3]> {
    let values: Vec<f64> = text
        .split(',')
        .map(|v| v.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("{what} must be three numbers, e.g. 32,16,8"))?;
    match values.as_slice() {
        [h, m, l] => Ok([*h, *m, *l]),
        _ => bail!("{what} must be three comma-separated numbers, got {text:?}"),
    }
}

fn rates(text: &str) -> Result<[Option<f64>; 3]> {
    let values: Vec<Option<f64>> = text
        .split(',')
        .map(|v| match v.trim() {
            "-" => Ok(None),
            number => number.parse::<f64>().map(Some),
        })
        .collect::<Result<_, _>>()
        .context("--rates must be three numbers or `-`")?;
    match values.as_slice() {
        [h, m, l] => Ok([*h, *m, *l]),
        _ => bail!("--rates must have three entries, got {text:?}"),
    }
}

#[derive(Serialize)]
struct SweepRow {
    utilisation_low: f64,
    high_throughput: f64,
    high_latency_us_max: f64,
}

pub fn run(args: Args) -> Result<()> {
    let weights = triple(&args.weights, "--weights")?;
    if weights.iter().any(|w| w.is_nan() || *w <= 0.0) {
        bail!("weights must be positive");
    }
    let (mut throughput, mut parallelism, mut service_us) =
        (args.throughput, args.parallelism, args.service_us);
    if let Some(spec) = &args.profile {
        let profile = EmuProfile::lookup(spec)?;
        let pages = f64::from(args.io_bytes.div_ceil(profile.page_bytes).max(1));
        let dies = f64::from(profile.die_count());
        throughput.get_or_insert(profile.mixed_pages_per_sec_max() / pages);
        parallelism.get_or_insert(dies);
        service_us.get_or_insert(profile.read_ns as f64 / 1e3 * pages);
    }
    let Some(throughput) = throughput.filter(|t| *t > 0.0) else {
        bail!("give the device throughput (--throughput) or an emulated profile (--profile)");
    };
    let parallelism = parallelism.unwrap_or(1.0);
    let service_us = service_us.unwrap_or(parallelism / throughput * 1e6);
    let utilisations = match &args.rates {
        Some(text) => queueing::utilisations_from_rates(&weights, &rates(text)?, throughput),
        None => triple(&args.util, "--util")?,
    };
    let input = ModelInput {
        weights,
        utilisations,
        device_throughput: throughput,
        queue_depth: args.queue_depth,
        parallelism,
        service_us,
    };
    if let Some(steps) = args.sweep_low {
        let steps = steps.clamp(1, 1000);
        let rows: Vec<SweepRow> = (0..=steps)
            .map(|i| {
                let rho = f64::from(i) / f64::from(steps);
                let mut sweep_input = input;
                sweep_input.utilisations[2] = rho;
                let high = queueing::predict(&sweep_input)[0];
                SweepRow {
                    utilisation_low: rho,
                    high_throughput: high.throughput_expected,
                    high_latency_us_max: high.latency_us_max,
                }
            })
            .collect();
        if args.json {
            println!("{}", serde_json::to_string_pretty(&rows)?);
        } else {
            println!(
                "{:>8} {:>16} {:>18}",
                "rho_low", "high_throughput", "high_latency_us_max"
            );
            for row in rows {
                println!(
                    "{:>8.2} {:>16.0} {:>18.1}",
                    row.utilisation_low, row.high_throughput, row.high_latency_us_max
                );
            }
        }
        return Ok(());
    }
    let predictions = queueing::predict(&input);
    if args.json {
        #[derive(Serialize)]
        struct Output<'a> {
            input: &'a ModelInput,
            classes: &'a [queueing::ClassPrediction],
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&Output {
                input: &input,
                classes: &predictions
            })?
        );
        return Ok(());
    }
    println!(
        "device: γ = {throughput:.0}/s, p = {parallelism}, a = {service_us:.1} µs, q = {}",
        args.queue_depth
    );
    println!(
        "{:<7} {:>8} {:>6} {:>14} {:>14} {:>16}",
        "class", "weight", "rho", "min_per_sec", "expected/s", "latency_us_max"
    );
    for p in predictions {
        println!(
            "{:<7} {:>8} {:>6.2} {:>14.0} {:>14.0} {:>16.1}",
            p.class.name(),
            p.weight,
            p.utilisation,
            p.throughput_min,
            p.throughput_expected,
            p.latency_us_max
        );
    }
    Ok(())
}
