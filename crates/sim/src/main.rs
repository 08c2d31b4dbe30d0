//! `reflex-sim`: runs simulator scenarios and prints per-tenant IOPS, p95/p99 read latency,
//! tokens used and whether each LC tenant met its SLO.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use reflex_sim::{RunOptions, run_scenario, scenario};

#[derive(Parser)]
#[command(
    name = "reflex-sim",
    version,
    about = "Deterministic ReFlex QoS simulator"
)]
struct Args {
    /// Scenario files (see crates/sim/src/scenario.rs for the format).
    #[arg(required = true)]
    scenarios: Vec<PathBuf>,
    /// Replaces the scenario's seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Replaces the measured duration, in virtual milliseconds.
    #[arg(long)]
    duration_ms: Option<u64>,
    /// Replaces the warm-up, in virtual milliseconds.
    #[arg(long)]
    warmup_ms: Option<u64>,
    /// Runs with QoS off (FIFO passthrough) instead.
    #[arg(long, conflicts_with = "qos_on")]
    qos_off: bool,
    /// Runs with QoS on even if the scenario turns it off.
    #[arg(long)]
    qos_on: bool,
    /// Prints JSON instead of tables.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let options = RunOptions {
        seed: args.seed,
        duration_ms: args.duration_ms,
        warmup_ms: args.warmup_ms,
        qos: if args.qos_off {
            Some(false)
        } else if args.qos_on {
            Some(true)
        } else {
            None
        },
        sweep_values: None,
    };
    for path in &args.scenarios {
        let loaded = scenario::load(path).with_context(|| format!("loading {}", path.display()))?;
        let report = run_scenario(&loaded, &options)
            .with_context(|| format!("running {}", path.display()))?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            println!("{}", report.text());
        }
    }
    Ok(())
}
