//! `reflex`: the ReFlex command-line tool. Each subcommand lives in its own module.

#![deny(unsafe_code)]

use anyhow::Result;
use clap::{Parser, Subcommand};

mod admin;
mod bench;
mod calibrate;
mod crash;
mod flood;
mod kv;
mod model;

#[derive(Parser)]
#[command(
    name = "reflex",
    version,
    about = "ReFlex tools: admin API client, load generator, calibration, models, crash test"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The admin API of a running reflexd: tenants, namespaces, live statistics.
    Admin(admin::Args),
    /// Open- or closed-loop load generator against a ReFlex server or a local file.
    Bench(Box<bench::Args>),
    /// Raw TCP ping-pong on loopback: the latency floor of remote access.
    Pingpong(bench::pingpong::Args),
    /// Measure a device and write its QoS profile.
    Calibrate(calibrate::Args),
    /// Queueing model of NVMe arbitration: per-class throughput and worst-case latency.
    Model(model::Args),
    /// Kill reflexd with SIGKILL mid-write over native, original and NBD, restart it, and
    /// check every acknowledged write that was made durable.
    CrashTest(crash::Args),
    /// Crowds and hostile clients for scale and overload benchmarks: idle, slowloris and
    /// non-reading connections, thousands of tenants, and fresh clients timing their first
    /// answer.
    Flood(flood::Args),
    /// One key-value request to reflexd's KV port: put, get, delete, flush.
    Kv(kv::Args),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Admin(args) => {
            // The server's message is the whole story: no backtrace, exit status 1.
            if let Err(error) = admin::run(args) {
                eprintln!("reflex admin: {error:#}");
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Bench(args) => bench::run(*args),
        Command::Pingpong(args) => bench::pingpong::run(args),
        Command::Calibrate(args) => calibrate::run(args),
        Command::Model(args) => model::run(args),
        Command::CrashTest(args) => crash::run(args),
        Command::Flood(args) => flood::run(args),
        Command::Kv(args) => kv::run(args),
    }
}
