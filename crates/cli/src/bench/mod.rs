//! `reflex bench`: the load generator every ReFlex performance claim is measured with, in the
//! style of mutilate (the ReFlex paper's §5 load generator).
//!
//! A run is a list of rows: one per queue depth (closed loop, `--qd 1,8,32`) or one per
//! target rate (open loop with Poisson arrivals, `--rate 50k,100k` or `--rate 10k:200k:10k`).
//! Each row starts fresh connections, warms up, measures for `--duration` (or until `--ops`
//! measured operations), and reports IOPS, bandwidth and HdrHistogram percentiles for reads and
//! writes separately, plus the queue-depth-1 probe when `--probe-rate` is set. `--local PATH`
//! runs the very same engine with io_uring on a file or block device (O_DIRECT), the baseline
//! that remote access is judged against. `--verify` first writes a pattern over the range,
//! then patterned writes and checked reads; any mismatch fails the run. `--server
//! nbd://HOST[:PORT][/EXPORT]` runs the same engine over NBD instead of the native protocol
//! (`nbd.rs`), so that any NBD server can be loaded by a client that batches.
//!
//! Output: a table for people on stdout (or `--json` for scripts), a progress line on stderr
//! once per second, exit status non-zero on any error or mismatch.
//!
//! `--scenario FILE` runs several tenants at once instead (`scenario.rs`): each REGISTERs with
//! its SLO, BINDs its connections and sends its own load; the table is per tenant.
//!
//! For the scale benchmarks: `--bind-handles FILE` BINDs connection k to the k-th tenant handle
//! of the file (modulo their number; `reflex flood --register N --handles FILE` writes one),
//! and `--server-pid PID` reports the server's exact CPU time during each row's measurement
//! (`/proc/PID/task/*/schedstat`), per operation and in cores.

mod engine;
pub mod kv;
pub(crate) mod nbd;
pub(crate) mod nbd_core;
mod pattern;
pub mod pingpong;
pub mod point;
mod probe;
pub mod scenario;
mod stats;
pub mod units;
mod uring;
mod wire;
mod workload;

use std::fs::{File, OpenOptions};
use std::io::{IsTerminal, Seek, SeekFrom, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use reflex_client::Client;
use serde::Serialize;

use self::engine::{EngineConfig, Load, Outcome, Phase, Progress, Target};
use self::nbd::NbdUri;
use self::probe::{ProbeConfig, ProbeTarget};
use self::stats::{Latency, LatencySummary};
use self::units::{RateList, parse_duration, parse_rate_list, parse_size};
use self::workload::{Access, WorkloadSpec};

/// Most threads and connections per thread: bounds sockets, rings and memory.
const THREADS_MAX: usize = 64;
const CONNECTIONS_PER_THREAD_MAX: usize = 256;
/// Longest measurement and warm-up per row.
const DURATION_MAX: Duration = Duration::from_secs(3600);
const WARMUP_MAX: Duration = Duration::from_secs(600);
/// Largest write of the `--verify` fill.
const FILL_CHUNK_MAX_BYTES: u32 = 128 * 1024;
/// Queue depth of the `--verify` fill.
const FILL_QUEUE_DEPTH: u32 = 16;
/// Default open-loop in-flight limit per connection when the server's window is larger.
const OPEN_QUEUE_DEPTH_DEFAULT: u32 = 256;
/// Largest NBD request the bench sends, whatever the server allows: the spec's safe maximum.
const NBD_IO_SIZE_MAX_BYTES: u32 = 32 << 20;

// The doc comments are clap's help, in command-line syntax: `[,ro]` is an optional part, not
// a link.
#[allow(rustdoc::broken_intra_doc_links)]
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Server address (native protocol), or nbd://HOST[:PORT][/EXPORT] for an NBD server
    /// (default port 10809; no export name: the server's default export).
    #[arg(long, short = 's', default_value = "127.0.0.1:7070")]
    server: String,
    /// Run the workload with io_uring on this local file or block device instead of a server
    /// (O_DIRECT; buffered with a warning where O_DIRECT is refused).
    #[arg(long, value_name = "PATH")]
    local: Option<PathBuf>,
    /// Local mode: use buffered I/O instead of O_DIRECT.
    #[arg(long)]
    buffered: bool,
    /// Namespace id (default: the first the server announces).
    #[arg(long)]
    namespace: Option<u32>,
    /// Bench threads, each driving its connections from one io_uring.
    #[arg(long, short = 't', default_value_t = 1)]
    threads: usize,
    /// Connections per thread (local mode: independent queues per thread).
    #[arg(long, short = 'c', default_value_t = 1)]
    connections: usize,
    /// Closed loop: requests in flight per connection. A list (1,8,32) gives one row each.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    qd: Vec<u32>,
    /// Open loop: total target rate in operations per second, Poisson arrivals. A list
    /// (50k,100k) or a sweep start:stop:step (10k:100k:10k) gives one row per rate.
    #[arg(long, value_parser = parse_rate_list)]
    rate: Option<RateList>,
    /// Open loop: most requests in flight per connection (default: the server's window, at
    /// most 256). Later arrivals wait for a slot and their wait counts in their latency.
    #[arg(long)]
    qd_max: Option<u32>,
    /// Fraction of reads, 0.0 to 1.0.
    #[arg(long, default_value_t = 1.0)]
    read_ratio: f64,
    /// Bytes per request (4k, 64k, 1m).
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    io_size: u64,
    /// Offsets: random (uniform) or sequential.
    #[arg(long, value_enum, default_value_t = Access::Random)]
    pattern: Access,
    /// Start of the range used, in bytes.
    #[arg(long, default_value = "0", value_parser = parse_size)]
    offset: u64,
    /// Length of the range used (default: to the end of the namespace or file).
    #[arg(long, value_parser = parse_size)]
    range: Option<u64>,
    /// Warm-up before each row's measurement (not counted).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    warmup: Duration,
    /// Measurement time per row.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    duration: Duration,
    /// Stop each row after this many measured operations (split evenly over connections).
    #[arg(long)]
    ops: Option<u64>,
    /// Fill the range with a pattern first, then write the pattern and check every read.
    #[arg(long)]
    verify: bool,
    /// With --verify: skip the fill and check against the pattern an earlier --verify run
    /// with the same seed left (e.g. across a server restart).
    #[arg(long, requires = "verify")]
    no_fill: bool,
    /// Seed of offsets, arrivals and the verify pattern.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Rate of the separate queue-depth-1 latency probe (0: no probe).
    #[arg(long, default_value_t = 0.0)]
    probe_rate: f64,
    /// Busy-poll the ring instead of sleeping in it (lowest latency, burns the core).
    #[arg(long)]
    spin: bool,
    /// Pin bench thread i to CPU cpus[i % n].
    #[arg(long, value_delimiter = ',')]
    cpus: Vec<usize>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// No progress line.
    #[arg(long, short = 'q')]
    quiet: bool,
    /// Run a multi-tenant scenario file (the `reflex-sim` format, `scenarios/`): each tenant
    /// registers, binds its connections and sends its load at once; prints per tenant IOPS,
    /// mean response time, p95/p99 read latency, whether its SLO was met, and with RT_alone
    /// (file or --scenario-alone) its slowdown and the run's fairness F. Uses --server, --namespace, --spin,
    /// --cpus, --json, --quiet; the file gives the load and the durations.
    #[arg(long, value_name = "FILE")]
    scenario: Option<PathBuf>,
    /// With --scenario: measurement time instead of the file's duration_ms.
    #[arg(long, value_parser = parse_duration, requires = "scenario")]
    scenario_duration: Option<Duration>,
    /// With --scenario: warm-up instead of the file's warmup_ms.
    #[arg(long, value_parser = parse_duration, requires = "scenario")]
    scenario_warmup: Option<Duration>,
    /// With --scenario: seed instead of the file's.
    #[arg(long, requires = "scenario")]
    scenario_seed: Option<u64>,
    /// With --scenario: every latency-critical tenant REPORTs the p95 of its reads to the
    /// server this often (docs/PROTOCOL.md §1.9; the server's self-calibration learns from it
    /// what the network and this client add); 0s: never.
    #[arg(long, value_parser = parse_duration, default_value = "25ms", requires = "scenario")]
    report_interval: Duration,
    /// With --scenario: first run each tenant alone (same warm-up and duration) and take its
    /// mean response time as RT_alone (instead of the file's `rt_alone_us`), for slowdowns and F.
    #[arg(long, requires = "scenario")]
    scenario_alone: bool,
    /// Tenant handles, one per line (as `reflex flood --register N --handles FILE` writes
    /// them): connection k of the run BINDs to handle k modulo their number before the load.
    #[arg(long, value_name = "FILE")]
    bind_handles: Option<PathBuf>,
    /// The server's process id (it must run on this machine): each row reports the server's
    /// CPU time during the measurement, summed over its threads from
    /// /proc/PID/task/*/schedstat, and per operation.
    #[arg(long, value_name = "PID")]
    server_pid: Option<u32>,
    /// A shell command to run (and wait for) when each row's measurement starts, e.g.
    /// `callgrind_control -z PID` to count a server's instructions in the measurement only.
    #[arg(long, value_name = "COMMAND")]
    at_measure_start: Option<String>,
    /// A shell command to run (and wait for) when each row's measurement ends.
    #[arg(long, value_name = "COMMAND")]
    at_measure_end: Option<String>,
    /// Benchmark reflexd's key-value port at this address (default 127.0.0.1:7077) with
    /// db_bench's fillrandom/readrandom shapes (`kv.rs`); uses --threads (one connection
    /// each), the first --qd (requests in flight per connection), --seed and --json.
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:7077")]
    kv: Option<String>,
    /// With --kv: the workloads, in order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "fillrandom,readrandom",
        requires = "kv"
    )]
    kv_workload: Vec<kv::Workload>,
    /// With --kv: operations per thread and workload.
    #[arg(long, default_value_t = 10_000, requires = "kv")]
    kv_ops: u64,
    /// With --kv: each thread stops sending after this long (--kv-ops stays a bound), so
    /// flows started together are measured over the same window.
    #[arg(long, value_parser = parse_duration, requires = "kv")]
    kv_duration: Option<Duration>,
    /// With --kv: keys are drawn from 0 .. this (default: threads × kv_ops).
    #[arg(long, requires = "kv")]
    kv_keys: Option<u64>,
    /// With --kv: bytes per key (db_bench's default 16; OctoFAS uses 4).
    #[arg(long, default_value_t = 16, requires = "kv")]
    key_size: usize,
    /// With --kv: bytes per value (db_bench's default 100; OctoFAS uses 16k).
    #[arg(long, default_value = "100", value_parser = parse_size, requires = "kv")]
    value_size: u64,
    /// With --kv: BIND every connection to this tenant handle (hexadecimal, as the admin API
    /// shows it, `0x` optional) before its first request, so two runs are two flows.
    #[arg(long, value_parser = parse_handle, requires = "kv")]
    kv_tenant: Option<u64>,
}

/// A tenant handle: hexadecimal, as the admin API writes it (`0x` optional).
fn parse_handle(text: &str) -> std::result::Result<u64, String> {
    let hex = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    u64::from_str_radix(hex, 16).map_err(|e| format!("tenant handle {text:?}: {e}"))
}

/// What the run targets, resolved before any row.
enum Resolved {
    Remote {
        address: SocketAddr,
        namespace: u32,
    },
    Nbd {
        uri: NbdUri,
        address: SocketAddr,
    },
    Local {
        path: PathBuf,
        file: Arc<File>,
        direct: bool,
    },
}

#[derive(Serialize)]
struct Report {
    target: String,
    /// "native", "nbd" or "local".
    protocol: &'static str,
    /// NBD: the export name asked for (empty: the server's default).
    export: Option<String>,
    local: bool,
    direct_io: Option<bool>,
    namespace: Option<u32>,
    io_size_bytes: u32,
    read_ratio: f64,
    access: Access,
    range_start_bytes: u64,
    range_length_bytes: u64,
    threads: usize,
    connections_per_thread: usize,
    warmup_sec: f64,
    duration_sec: f64,
    ops_max: Option<u64>,
    verify: bool,
    seed: u64,
    fill: Option<FillReport>,
    rows: Vec<Row>,
}

#[derive(Serialize)]
struct FillReport {
    bytes: u64,
    seconds: f64,
}

#[derive(Serialize)]
struct Row {
    /// "closed" or "open".
    load: &'static str,
    /// Closed loop: the queue depth; open loop: the in-flight limit per connection.
    queue_depth: u32,
    rate_target_per_sec: Option<f64>,
    /// Open loop: arrivals due before the end that never found a free slot.
    unissued_ops: u64,
    ops: u64,
    iops: f64,
    bandwidth_mib_per_sec: f64,
    measured_sec: f64,
    read: LatencySummary,
    write: LatencySummary,
    probe: Option<ProbeRow>,
    errors: u64,
    first_error: Option<String>,
    verify: Option<VerifyRow>,
    /// With --server-pid: the server's CPU time during the measurement.
    server_cpu_ns: Option<u64>,
    /// With --server-pid: server CPU time per measured operation.
    server_cpu_per_op_ns: Option<f64>,
    /// With --server-pid: server CPU time / measured time.
    server_cores: Option<f64>,
}

#[derive(Serialize)]
struct ProbeRow {
    read: LatencySummary,
    write: LatencySummary,
    errors: u64,
}

#[derive(Serialize)]
struct VerifyRow {
    mismatches: u64,
    first_mismatch_offset_bytes: Option<u64>,
    expected_byte: Option<u8>,
    found_byte: Option<u8>,
}

/// The first address `HOST:PORT` resolves to.
pub(crate) fn resolve_server(server: &str) -> Result<SocketAddr> {
    server
        .to_socket_addrs()
        .with_context(|| format!("resolving {server}"))?
        .next()
        .with_context(|| format!("{server} resolves to no address"))
}

pub fn run(args: Args) -> Result<()> {
    if let Some(address) = &args.kv {
        let options = kv::KvOptions {
            address: resolve_server(address)?,
            workloads: args.kv_workload.clone(),
            threads: args.threads,
            queue_depth: args.qd.first().copied().unwrap_or(1),
            ops_per_thread: args.kv_ops,
            duration: args.kv_duration,
            keys: args.kv_keys.unwrap_or(args.threads as u64 * args.kv_ops),
            key_size_bytes: args.key_size,
            value_size_bytes: usize::try_from(args.value_size).unwrap_or(usize::MAX),
            seed: args.seed,
            json: args.json,
            tenant: args.kv_tenant,
        };
        return kv::run(&options);
    }
    if let Some(path) = &args.scenario {
        if args.local.is_some() {
            bail!("--scenario runs against a server, not --local");
        }
        if NbdUri::is_nbd(&args.server) {
            bail!("--scenario needs the native protocol (tenants), not an nbd:// server");
        }
        let address = resolve_server(&args.server)?;
        let options = scenario::ScenarioOptions {
            address,
            namespace: args.namespace,
            duration: args.scenario_duration,
            warmup: args.scenario_warmup,
            seed: args.scenario_seed,
            alone: args.scenario_alone,
            report_interval: (!args.report_interval.is_zero()).then_some(args.report_interval),
            spin: args.spin,
            cpus: args.cpus.clone(),
            json: args.json,
            quiet: args.quiet,
        };
        return scenario::run(path, &options);
    }
    check_args(&args)?;
    let io_size_bytes = args.io_size as u32;
    let resolved = resolve_target(&args)?;
    let (size_bytes, window, io_size_max) = match &resolved {
        Resolved::Remote { address, namespace } => {
            let client =
                Client::connect(address).with_context(|| format!("connecting to {address}"))?;
            let capabilities = client.capabilities();
            let Some(info) = capabilities.namespace(*namespace) else {
                bail!("the server has no namespace {namespace}");
            };
            let block_size = u64::from(capabilities.block_size_bytes);
            if block_size > 0 && !args.io_size.is_multiple_of(block_size) {
                bail!(
                    "--io-size {} is not a multiple of the server's block size {}",
                    args.io_size,
                    capabilities.block_size_bytes
                );
            }
            if info.read_only && (args.read_ratio < 1.0 || args.verify) {
                bail!("namespace {namespace} is read-only: use --read-ratio 1 without --verify");
            }
            (
                info.size_bytes,
                capabilities.window_requests,
                capabilities.io_size_max_bytes,
            )
        }
        Resolved::Nbd { uri, address } => {
            // One handshake up front: sizes and flags, and a clear error for a bad export.
            let (_, _, export) = nbd::connect(*address, &uri.export)?;
            let block_size = u64::from(export.minimum_block_bytes());
            if !args.io_size.is_multiple_of(block_size) || !args.offset.is_multiple_of(block_size) {
                bail!(
                    "--io-size and --offset must be multiples of the export's minimum block size {block_size}"
                );
            }
            if export.is_read_only() && (args.read_ratio < 1.0 || args.verify) {
                bail!(
                    "NBD export {:?} is read-only: use --read-ratio 1 without --verify",
                    uri.export
                );
            }
            let io_size_max = export.maximum_payload_bytes().min(NBD_IO_SIZE_MAX_BYTES);
            (export.size_bytes, engine::QUEUE_DEPTH_MAX, io_size_max)
        }
        Resolved::Local { file, .. } => {
            let mut handle = file.as_ref();
            let size = handle
                .seek(SeekFrom::End(0))
                .context("sizing the local file")?;
            (size, engine::QUEUE_DEPTH_MAX, 1 << 30)
        }
    };
    if io_size_bytes > io_size_max {
        bail!("--io-size {io_size_bytes} exceeds the server's max I/O size {io_size_max}");
    }
    if args.offset >= size_bytes {
        bail!(
            "--offset {} is beyond the end ({size_bytes} bytes)",
            args.offset
        );
    }
    let available = size_bytes - args.offset;
    let range = args.range.unwrap_or(available);
    if range > available {
        bail!("--offset + --range exceed the size ({size_bytes} bytes)");
    }
    let range = range - range % args.io_size;
    if range == 0 {
        bail!("the range holds no complete I/O of {} bytes", args.io_size);
    }
    let workload = WorkloadSpec {
        read_ratio: args.read_ratio,
        io_size_bytes,
        access: args.pattern,
        range_start_bytes: args.offset,
        range_length_bytes: range,
    };
    let loads: Vec<Load> = match &args.rate {
        None => args
            .qd
            .iter()
            .map(|&queue_depth| Load::Closed { queue_depth })
            .collect(),
        Some(RateList(rates)) => {
            let queue_depth_max = args.qd_max.unwrap_or(window.min(OPEN_QUEUE_DEPTH_DEFAULT));
            rates
                .iter()
                .map(|&rate_per_sec| Load::Open {
                    rate_per_sec,
                    queue_depth_max,
                })
                .collect()
        }
    };
    for load in &loads {
        let depth = load.queue_depth_max();
        if depth == 0 || depth > window.min(engine::QUEUE_DEPTH_MAX) {
            bail!(
                "queue depth {depth} must be between 1 and {} (the server's window)",
                window.min(engine::QUEUE_DEPTH_MAX)
            );
        }
    }

    let verify_seed = args.verify.then_some(args.seed);
    let target = match &resolved {
        Resolved::Remote { address, namespace } => Target::Remote {
            address: *address,
            namespace: *namespace,
        },
        Resolved::Nbd { uri, address } => Target::Nbd {
            address: *address,
            export: uri.export.clone(),
        },
        Resolved::Local { file, .. } => Target::Local { file: file.clone() },
    };
    let bind_handles = match &args.bind_handles {
        None => Vec::new(),
        Some(path) => read_handles(path)?,
    };
    if !bind_handles.is_empty() && !matches!(resolved, Resolved::Remote { .. }) {
        bail!("--bind-handles needs a native server");
    }
    let base = EngineConfig {
        target,
        threads: args.threads,
        channels_per_thread: args.connections,
        load: loads[0],
        workload,
        phase: Phase::Measure,
        seed: args.seed,
        verify_seed,
        warmup: args.warmup,
        duration: args.duration,
        ops_max: args.ops,
        spin: args.spin,
        cpus: args.cpus.clone(),
        bind_handles,
        server_pid: args.server_pid,
        measure_hooks: engine::MeasureHooks {
            start: args.at_measure_start.clone(),
            end: args.at_measure_end.clone(),
        },
        follow_notices: false,
        timeline: None,
        report_interval: None,
    };

    let fill = match verify_seed {
        Some(_) if !args.no_fill => Some(run_fill(&base, io_size_max, window, args.quiet)?),
        _ => None,
    };

    let mut rows = Vec::new();
    for load in &loads {
        let config = EngineConfig {
            load: *load,
            ..base.clone()
        };
        let probe = (args.probe_rate > 0.0).then(|| ProbeConfig {
            target: match &resolved {
                Resolved::Remote { address, namespace } => ProbeTarget::Remote {
                    address: *address,
                    namespace: *namespace,
                },
                Resolved::Nbd { uri, address } => ProbeTarget::Nbd {
                    address: *address,
                    export: uri.export.clone(),
                },
                Resolved::Local { file, .. } => ProbeTarget::Local { file: file.clone() },
            },
            workload,
            rate_per_sec: args.probe_rate,
            seed: args.seed ^ 0x9E0B,
            verify_seed,
            warmup: args.warmup,
            duration: args.duration,
        });
        let (outcome, probe_outcome) = run_row(&config, probe.as_ref(), args.quiet)?;
        rows.push(make_row(
            load,
            &outcome,
            probe_outcome.as_ref(),
            args.verify,
        ));
    }

    let (target_text, direct_io, namespace) = match &resolved {
        Resolved::Remote { address, namespace } => (address.to_string(), None, Some(*namespace)),
        Resolved::Nbd { .. } => (args.server.clone(), None, None),
        Resolved::Local { path, direct, .. } => (path.display().to_string(), Some(*direct), None),
    };
    let (protocol, export) = match &resolved {
        Resolved::Remote { .. } => ("native", None),
        Resolved::Nbd { uri, .. } => ("nbd", Some(uri.export.clone())),
        Resolved::Local { .. } => ("local", None),
    };
    let report = Report {
        target: target_text,
        protocol,
        export,
        local: matches!(resolved, Resolved::Local { .. }),
        direct_io,
        namespace,
        io_size_bytes,
        read_ratio: args.read_ratio,
        access: args.pattern,
        range_start_bytes: args.offset,
        range_length_bytes: range,
        threads: args.threads,
        connections_per_thread: args.connections,
        warmup_sec: args.warmup.as_secs_f64(),
        duration_sec: args.duration.as_secs_f64(),
        ops_max: args.ops,
        verify: args.verify,
        seed: args.seed,
        fill,
        rows,
    };
    let mut stdout = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut stdout, &report)?;
        writeln!(stdout)?;
    } else {
        print_table(&mut stdout, &report)?;
    }
    stdout.flush()?;
    drop(stdout);
    check_report(&report)
}

fn check_args(args: &Args) -> Result<()> {
    if !(1..=THREADS_MAX).contains(&args.threads) {
        bail!("--threads must be between 1 and {THREADS_MAX}");
    }
    if !(1..=CONNECTIONS_PER_THREAD_MAX).contains(&args.connections) {
        bail!("--connections must be between 1 and {CONNECTIONS_PER_THREAD_MAX}");
    }
    if !(0.0..=1.0).contains(&args.read_ratio) {
        bail!("--read-ratio must be between 0 and 1");
    }
    if args.io_size == 0 || !args.io_size.is_multiple_of(512) || args.io_size > u64::from(u32::MAX)
    {
        bail!("--io-size must be a positive multiple of 512");
    }
    if !args.offset.is_multiple_of(args.io_size.min(4096)) {
        bail!("--offset must be aligned to min(io size, 4 KiB)");
    }
    if args.duration.is_zero() || args.duration > DURATION_MAX {
        bail!(
            "--duration must be between 0 and {} s",
            DURATION_MAX.as_secs()
        );
    }
    if args.warmup > WARMUP_MAX {
        bail!("--warmup must be at most {} s", WARMUP_MAX.as_secs());
    }
    if args.qd.is_empty() || args.qd.len() > units::RATE_ROWS_MAX {
        bail!("--qd takes 1 to {} values", units::RATE_ROWS_MAX);
    }
    if args.ops == Some(0) {
        bail!("--ops must be positive");
    }
    if !(args.probe_rate >= 0.0 && args.probe_rate <= 100_000.0) {
        bail!("--probe-rate must be between 0 and 100000");
    }
    Ok(())
}

fn resolve_target(args: &Args) -> Result<Resolved> {
    match &args.local {
        Some(path) => {
            let writable = args.read_ratio < 1.0 || args.verify;
            let (file, direct) = open_local(path, writable, !args.buffered)?;
            Ok(Resolved::Local {
                path: path.clone(),
                file: Arc::new(file),
                direct,
            })
        }
        None if NbdUri::is_nbd(&args.server) => {
            if args.namespace.is_some() {
                bail!("--namespace is for the native protocol; name the NBD export in the URI");
            }
            let uri = NbdUri::parse(&args.server)?;
            let address = uri.resolve()?;
            Ok(Resolved::Nbd { uri, address })
        }
        None => {
            let address = resolve_server(&args.server)?;
            let namespace = match args.namespace {
                Some(namespace) => namespace,
                None => {
                    let client = Client::connect(address)
                        .with_context(|| format!("connecting to {address}"))?;
                    match client.namespaces().first() {
                        Some(namespace) => namespace.id,
                        None => bail!("the server at {address} announces no namespace"),
                    }
                }
            };
            Ok(Resolved::Remote { address, namespace })
        }
    }
}

/// Tenant handles from `path`, one per line (blank lines skipped), at least one.
fn read_handles(path: &PathBuf) -> Result<Vec<u64>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let handles = text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(|line| {
            line.parse::<u64>()
                .with_context(|| format!("{}: {line:?} is not a tenant handle", path.display()))
        })
        .collect::<Result<Vec<u64>>>()?;
    if handles.is_empty() {
        bail!("{} holds no tenant handle", path.display());
    }
    Ok(handles)
}

/// Opens the local target with O_DIRECT when asked and allowed; returns whether it is direct.
fn open_local(path: &PathBuf, writable: bool, direct: bool) -> Result<(File, bool)> {
    let open = |flags: i32| {
        OpenOptions::new()
            .read(true)
            .write(writable)
            .custom_flags(flags)
            .open(path)
    };
    if direct {
        match open(libc::O_DIRECT) {
            Ok(file) => return Ok((file, true)),
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                eprintln!(
                    "warning: {} refuses O_DIRECT (tmpfs?): falling back to buffered I/O, \
                     which measures the page cache, not the device",
                    path.display()
                );
            }
            Err(error) => return Err(error).with_context(|| format!("opening {}", path.display())),
        }
    }
    let file = open(0).with_context(|| format!("opening {}", path.display()))?;
    Ok((file, false))
}

/// The `--verify` fill: every byte of the range gets the pattern, in large sequential writes.
fn run_fill(base: &EngineConfig, io_size_max: u32, window: u32, quiet: bool) -> Result<FillReport> {
    let io_size = base.workload.io_size_bytes;
    let chunk_limit = FILL_CHUNK_MAX_BYTES.min(io_size_max).max(io_size);
    let chunk_bytes = chunk_limit - chunk_limit % io_size;
    let config = EngineConfig {
        load: Load::Closed {
            queue_depth: FILL_QUEUE_DEPTH.min(window),
        },
        phase: Phase::Fill { chunk_bytes },
        warmup: Duration::ZERO,
        ops_max: None,
        ..base.clone()
    };
    let started = Instant::now();
    let outcome = engine::run(&config, None).context("--verify fill")?;
    let seconds = started.elapsed().as_secs_f64();
    if outcome.errors > 0 {
        bail!(
            "--verify fill: {} writes failed, first: {}",
            outcome.errors,
            outcome.first_error.unwrap_or_default()
        );
    }
    if !quiet {
        eprintln!(
            "verify: wrote the pattern over {} MiB in {seconds:.1} s",
            outcome.measured_bytes >> 20
        );
    }
    Ok(FillReport {
        bytes: outcome.measured_bytes,
        seconds,
    })
}

/// One row: the engine (and the probe beside it) with a progress line on stderr.
fn run_row(
    config: &EngineConfig,
    probe: Option<&ProbeConfig>,
    quiet: bool,
) -> Result<(Outcome, Option<Outcome>)> {
    let (sender, receiver) = mpsc::channel::<Progress>();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let probe_handle = probe.map(|probe| scope.spawn(|| probe::run(probe, &stop)));
        let engine_handle = scope.spawn(move || {
            let result = engine::run(config, Some(&sender));
            drop(sender);
            result
        });
        report_progress(&receiver, config.threads, quiet);
        let outcome = engine_handle
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("engine panicked")));
        stop.store(true, Ordering::Relaxed);
        let probe_outcome = match probe_handle {
            None => None,
            Some(handle) => Some(
                handle
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("probe panicked")))?,
            ),
        };
        Ok((outcome?, probe_outcome))
    })
}

/// Prints elapsed time, IOPS of the last second and p99 so far, once per second, until the
/// engine drops its sender.
fn report_progress(receiver: &mpsc::Receiver<Progress>, threads: usize, quiet: bool) {
    let started = Instant::now();
    let terminal = std::io::stderr().is_terminal();
    let mut cumulative = Latency::new();
    let mut completed_by_thread = vec![0u64; threads];
    let mut completed_reported = 0u64;
    let mut reported_at = started;
    let mut printed = false;
    loop {
        match receiver.recv_timeout(Duration::from_millis(200)) {
            Ok(progress) => {
                cumulative.add(&progress.interval);
                if let Some(slot) = completed_by_thread.get_mut(progress.thread_index) {
                    *slot = progress.completed_ops;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        // Threads report about once a second each; print once per round of reports.
        let now = Instant::now();
        if quiet || now.duration_since(reported_at) < Duration::from_millis(900) {
            continue;
        }
        let completed: u64 = completed_by_thread.iter().sum();
        let seconds = now.duration_since(reported_at).as_secs_f64();
        let iops = completed.saturating_sub(completed_reported) as f64 / seconds;
        completed_reported = completed;
        reported_at = now;
        let line = format!(
            "[{:6.1} s] {:>10.0} IOPS   p99 {:>9.1} µs",
            now.duration_since(started).as_secs_f64(),
            iops,
            cumulative.quantile_us(0.99)
        );
        if terminal {
            eprint!("\r{line}");
        } else {
            eprintln!("{line}");
        }
        printed = true;
    }
    if printed && terminal {
        eprintln!();
    }
}

fn make_row(load: &Load, outcome: &Outcome, probe: Option<&Outcome>, verify: bool) -> Row {
    let measured_sec = (outcome.measured_ns as f64 / 1e9).max(1e-9);
    let (load_name, rate_target_per_sec) = match *load {
        Load::Closed { .. } => ("closed", None),
        Load::Open { rate_per_sec, .. } => ("open", Some(rate_per_sec)),
    };
    let mut errors = outcome.errors;
    let mut first_error = outcome.first_error.clone();
    let mut mismatches = outcome.mismatches;
    let mut first_mismatch = outcome.first_mismatch;
    if let Some(probe) = probe {
        errors += probe.errors;
        if first_error.is_none() {
            first_error.clone_from(&probe.first_error);
        }
        mismatches += probe.mismatches;
        first_mismatch = first_mismatch.or(probe.first_mismatch);
    }
    Row {
        load: load_name,
        queue_depth: load.queue_depth_max(),
        rate_target_per_sec,
        unissued_ops: outcome.unissued_ops,
        ops: outcome.measured_ops,
        iops: outcome.measured_ops as f64 / measured_sec,
        bandwidth_mib_per_sec: outcome.measured_bytes as f64 / measured_sec / (1 << 20) as f64,
        measured_sec,
        read: outcome.read.summary(),
        write: outcome.write.summary(),
        probe: probe.map(|probe| ProbeRow {
            read: probe.read.summary(),
            write: probe.write.summary(),
            errors: probe.errors,
        }),
        errors,
        first_error,
        verify: verify.then(|| VerifyRow {
            mismatches,
            first_mismatch_offset_bytes: first_mismatch.map(|m| m.offset_bytes),
            expected_byte: first_mismatch.map(|m| m.expected),
            found_byte: first_mismatch.map(|m| m.found),
        }),
        server_cpu_ns: outcome.server_cpu_ns,
        server_cpu_per_op_ns: outcome
            .server_cpu_ns
            .filter(|_| outcome.measured_ops > 0)
            .map(|cpu| cpu as f64 / outcome.measured_ops as f64),
        server_cores: outcome
            .server_cpu_ns
            .map(|cpu| cpu as f64 / (outcome.measured_ns.max(1)) as f64),
    }
}

fn print_table(out: &mut impl Write, report: &Report) -> std::io::Result<()> {
    let target = if report.local {
        format!(
            "local {} ({})",
            report.target,
            if report.direct_io == Some(true) {
                "O_DIRECT"
            } else {
                "buffered"
            }
        )
    } else if let Some(export) = &report.export {
        format!("NBD {} export {export:?}", report.target)
    } else {
        format!(
            "remote {} namespace {}",
            report.target,
            report.namespace.unwrap_or(0)
        )
    };
    writeln!(
        out,
        "# reflex bench: {target}; {} B {:?}, {:.0}% reads, range {} MiB at {}; {} thread(s) x {} connection(s)",
        report.io_size_bytes,
        report.access,
        report.read_ratio * 100.0,
        report.range_length_bytes >> 20,
        report.range_start_bytes,
        report.threads,
        report.connections_per_thread
    )?;
    writeln!(
        out,
        "{:<14} {:>11} {:>9}  {:<5} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "load", "IOPS", "MiB/s", "op", "count", "avg", "p50", "p90", "p95", "p99", "p99.9", "max"
    )?;
    for row in &report.rows {
        let load = match row.rate_target_per_sec {
            Some(rate) => format!("rate {:.0}", rate),
            None => format!("qd {}", row.queue_depth),
        };
        let mut lines: Vec<(&str, &LatencySummary)> = Vec::new();
        if row.read.count > 0 || row.write.count == 0 {
            lines.push(("read", &row.read));
        }
        if row.write.count > 0 {
            lines.push(("write", &row.write));
        }
        if let Some(probe) = &row.probe {
            if probe.read.count > 0 {
                lines.push(("probe", &probe.read));
            }
            if probe.write.count > 0 {
                lines.push(("probeW", &probe.write));
            }
        }
        for (index, (name, summary)) in lines.iter().enumerate() {
            let (load, iops, bandwidth) = if index == 0 {
                (
                    load.clone(),
                    format!("{:.0}", row.iops),
                    format!("{:.1}", row.bandwidth_mib_per_sec),
                )
            } else {
                (String::new(), String::new(), String::new())
            };
            writeln!(
                out,
                "{:<14} {:>11} {:>9}  {:<5} {:>10} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                load,
                iops,
                bandwidth,
                name,
                summary.count,
                summary.avg_us,
                summary.p50_us,
                summary.p90_us,
                summary.p95_us,
                summary.p99_us,
                summary.p999_us,
                summary.max_us
            )?;
        }
        if let (Some(per_op), Some(cores)) = (row.server_cpu_per_op_ns, row.server_cores) {
            writeln!(
                out,
                "  server CPU: {:.0} ns per operation, {:.2} cores",
                per_op, cores
            )?;
        }
        if row.unissued_ops > 0 {
            writeln!(
                out,
                "  {} arrivals never found a free slot before the end: the target rate was not reached",
                row.unissued_ops
            )?;
        }
        if row.errors > 0 {
            writeln!(
                out,
                "  errors: {} (first: {})",
                row.errors,
                row.first_error.as_deref().unwrap_or("")
            )?;
        }
        if let Some(verify) = &row.verify {
            match verify.first_mismatch_offset_bytes {
                None => writeln!(out, "  verify: all reads matched the pattern")?,
                Some(offset) => writeln!(
                    out,
                    "  verify: {} mismatching reads; first at byte offset {offset} (expected {:#04x}, found {:#04x})",
                    verify.mismatches,
                    verify.expected_byte.unwrap_or(0),
                    verify.found_byte.unwrap_or(0)
                )?,
            }
        }
    }
    writeln!(out, "(latencies in µs, from the intended send time)")?;
    Ok(())
}

/// Fails the run (non-zero exit) on any error or verify mismatch.
fn check_report(report: &Report) -> Result<()> {
    for row in &report.rows {
        let first_mismatch = row.verify.as_ref().and_then(|verify| {
            verify
                .first_mismatch_offset_bytes
                .map(|o| (verify.mismatches, o))
        });
        if let Some((mismatches, offset)) = first_mismatch {
            bail!(
                "verify failed: {mismatches} reads did not match the pattern; first mismatch at byte offset {offset}"
            );
        }
        if row.errors > 0 {
            bail!(
                "{} requests failed; first: {}",
                row.errors,
                row.first_error.as_deref().unwrap_or("")
            );
        }
    }
    Ok(())
}
