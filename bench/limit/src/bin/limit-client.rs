//! `limit-client`: closed-loop random-read load for any original-protocol server, one io_uring
//! thread that sleeps in the kernel while it waits (see `reflex_limit::client`).

use std::io::Write;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use reflex_limit::client::{self, Bound, ClientConfig, DRAIN_TIMEOUT, Report};
use reflex_limit::units::{parse_duration, parse_size};

#[derive(Parser, Debug)]
#[command(
    name = "limit-client",
    about = "Closed-loop load generator for any original-ReFlex-protocol server: random reads, \
             replies/s and latency percentiles"
)]
struct Args {
    /// Server address, HOST:PORT.
    #[arg(long, default_value = "127.0.0.1:1234")]
    addr: String,
    /// Connections (default 1).
    #[arg(long)]
    connections: Option<usize>,
    /// Requests in flight per connection (default 1).
    #[arg(long)]
    depth: Option<usize>,
    /// How long to send (after the warm-up), e.g. 5s, 500ms.
    #[arg(long, value_parser = parse_duration, conflicts_with = "requests")]
    duration: Option<Duration>,
    /// Send exactly N requests in all, then stop (count-bounded run).
    #[arg(long)]
    requests: Option<u64>,
    /// Read size in bytes (a multiple of 512, at most 1M).
    #[arg(long, default_value = "4096", value_parser = parse_size)]
    size: u64,
    /// Reads fall at random size-aligned offsets below this many bytes, e.g. 1G.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    lba_range: u64,
    /// Replies in this first stretch are neither timed nor counted in `replies`.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    warmup: Duration,
    /// Seed of the random offsets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Fail if the run takes longer (default: warm-up + duration + 10 s, or 60 s with --requests).
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Latency mode: one connection at depth 1; the client sleeps in the kernel between replies.
    #[arg(long)]
    qd1_sleep: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn config(args: &Args) -> anyhow::Result<ClientConfig> {
    let address: SocketAddr = args
        .addr
        .to_socket_addrs()
        .with_context(|| format!("resolving {}", args.addr))?
        .next()
        .with_context(|| format!("{} resolves to no address", args.addr))?;
    if args.qd1_sleep && (args.connections.unwrap_or(1) != 1 || args.depth.unwrap_or(1) != 1) {
        bail!("--qd1-sleep runs one connection at depth 1; drop --connections and --depth");
    }
    let bound = match (args.duration, args.requests) {
        (_, Some(requests)) => Bound::Requests(requests),
        (Some(duration), None) => Bound::Duration(duration),
        (None, None) => Bound::Duration(Duration::from_secs(5)),
    };
    let timeout = args.timeout.unwrap_or(match bound {
        Bound::Duration(duration) => args.warmup + duration + DRAIN_TIMEOUT,
        Bound::Requests(_) => Duration::from_secs(60),
    });
    let config = ClientConfig {
        address,
        connections: args.connections.unwrap_or(1),
        depth: args.depth.unwrap_or(1),
        size_bytes: u32::try_from(args.size).context("--size is too large")?,
        range_bytes: args.lba_range,
        bound,
        warmup: args.warmup,
        seed: args.seed,
        timeout,
    };
    config.validate()?;
    Ok(config)
}

/// Writes the report as text; a closed stdout is an error, not a panic.
fn print_text(out: &mut impl Write, report: &Report, qd1_sleep: bool) -> std::io::Result<()> {
    writeln!(
        out,
        "limit-client: {}, {} connection(s) × depth {}, {} B random reads over {} B",
        report.address, report.connections, report.depth, report.size_bytes, report.range_bytes
    )?;
    writeln!(
        out,
        "replies: {} in {:.3} s ({} in all): {:.0} replies/s",
        report.replies, report.elapsed_s, report.replies_total, report.replies_per_sec
    )?;
    if let Some(cpu_s) = report.client_cpu_s {
        writeln!(
            out,
            "client CPU: {cpu_s:.3} s ({:.0} % of one core)",
            100.0 * cpu_s / report.elapsed_s.max(1e-9)
        )?;
    }
    let latency = &report.latency;
    if qd1_sleep {
        writeln!(
            out,
            "QD1 latency (sleeping client): p50 {:.1} µs, p99 {:.1} µs",
            latency.p50_us, latency.p99_us
        )?;
    }
    writeln!(
        out,
        "latency µs: p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
        latency.p50_us,
        latency.p90_us,
        latency.p99_us,
        latency.p999_us,
        latency.max_us,
        latency.mean_us
    )
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = config(&args)?;
    let report = client::run(&config)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)
    } else {
        print_text(&mut out, &report, args.qd1_sleep)
    }
    .context("writing the report")
}
