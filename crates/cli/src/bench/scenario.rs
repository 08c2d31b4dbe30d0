//! `reflex bench --scenario FILE`: several tenants at once against `reflexd`, each with its own
//! SLO and load, as in the ReFlex paper's Figure 5 — the real-run counterpart of `reflex-sim`.
//!
//! Why the simulator's file format: the same scenario file runs in virtual time
//! (`reflex-sim FILE`) and against a real server (`reflex bench --scenario FILE`), so the two
//! tables compare like with like. The bench reads the tenants, the seed and the durations;
//! `[device]`, `threads`, `qos` and `[qos_config]` describe the server, which the operator
//! starts to match (they are printed, not enforced).
//!
//! Per tenant: one control connection REGISTERs it (LC: latency SLO, IOPS, read share; or BE)
//! and receives its handle; `len(threads)` load connections each BIND to that handle; then
//! every tenant's load runs at once, one bench thread per tenant (the engine of `reflex bench`,
//! unchanged): open-loop Poisson at `load.open_iops` with at most `load.window` in flight per
//! connection, or closed loop at `load.closed_depth`, with the tenant's read share and size.
//! Latency is from the intended send time. At the end the tenants are unregistered. The
//! table gives per tenant: sent and achieved IOPS, read p95/p99, whether an LC tenant met its
//! SLO (p95 within the SLO and at least 99 % of what it sent answered), and RENEGOTIATE
//! notices; its throughput and mean response time (reads and writes); and, when its RT_alone
//! is known (the file's `rt_alone_us`, or `--scenario-alone`, which first runs each tenant
//! alone), its slowdown S = RT / RT_alone and the run's fairness F = min S / max S (OctoFAS
//! eq. 1, 2: how evenly the tenants are slowed down); `--json` prints the same as JSON.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use reflex_client::{Client, ConnectionCore, NO_TENANT_HANDLE, RegisterBody, TenantClassRequest};
use serde::Serialize;

use super::engine::{self, EngineConfig, Load, Outcome, Phase, Target};
use super::stats::LatencySummary;
use super::workload::{Access, WorkloadSpec};

/// Most tenants one scenario may run (each is a bench thread and its connections).
pub const TENANTS_MAX: usize = 32;
/// Most load connections per tenant.
pub const CONNECTIONS_PER_TENANT_MAX: usize = 64;
/// Longest measurement a scenario may ask for.
const DURATION_MAX: Duration = Duration::from_secs(3600);
/// An LC tenant meets its SLO when at least this share of what it sent was answered.
const ANSWERED_SHARE_MIN: f64 = 0.99;

/// A scenario file: the simulator's own type and parser, so the two runners cannot drift.
pub use reflex_sim::scenario::{ClassToml as Class, Scenario as ScenarioFile, TenantSpecToml};

/// Reads and checks a scenario file: the simulator's rules, then what a real run needs.
pub fn load(path: &Path) -> Result<ScenarioFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text, &path.display().to_string())
}

fn parse(text: &str, origin: &str) -> Result<ScenarioFile> {
    let scenario = ScenarioFile::from_toml(text, origin)?;
    validate_for_real_run(&scenario)?;
    Ok(scenario)
}

/// What the simulator accepts but a real run cannot do.
fn validate_for_real_run(scenario: &ScenarioFile) -> Result<()> {
    if scenario.tenants.len() > TENANTS_MAX {
        bail!("scenario {}: at most {TENANTS_MAX} tenants", scenario.name);
    }
    if Duration::from_millis(scenario.duration_ms) > DURATION_MAX {
        bail!(
            "scenario {}: duration_ms must be at most 3600000",
            scenario.name
        );
    }
    if scenario.sweep.is_some() {
        bail!(
            "scenario {}: sweeps exist only in the simulator",
            scenario.name
        );
    }
    for tenant in &scenario.tenants {
        let name = &tenant.name;
        if tenant.per_thread {
            bail!("tenant {name}: per_thread tenants exist only in the simulator");
        }
        if tenant.start_ms != 0 {
            bail!("tenant {name}: start_ms exists only in the simulator");
        }
        if tenant.threads.is_empty() || tenant.threads.len() > CONNECTIONS_PER_TENANT_MAX {
            bail!("tenant {name}: 1 to {CONNECTIONS_PER_TENANT_MAX} connections (threads)");
        }
        if tenant
            .latency_us_p95
            .is_some_and(|l| l == 0 || l > u64::from(u32::MAX))
        {
            bail!("tenant {name}: latency_us_p95 out of range");
        }
    }
    Ok(())
}

/// What the caller (`reflex bench`) decides for a scenario run.
#[derive(Debug, Clone)]
pub struct ScenarioOptions {
    pub address: SocketAddr,
    /// `None`: the first namespace the server announces.
    pub namespace: Option<u32>,
    /// Override the file's durations.
    pub duration: Option<Duration>,
    pub warmup: Option<Duration>,
    pub seed: Option<u64>,
    /// Run each tenant alone first: its mean response time becomes its RT_alone.
    pub alone: bool,
    /// How often latency-critical tenants REPORT their reads' p95 (`None`: never).
    pub report_interval: Option<Duration>,
    pub spin: bool,
    pub cpus: Vec<usize>,
    pub json: bool,
    pub quiet: bool,
}

#[derive(Debug, Serialize)]
pub struct ScenarioReport {
    pub scenario: String,
    pub description: String,
    pub server: String,
    pub namespace: u32,
    pub seed: u64,
    pub warmup_sec: f64,
    pub duration_sec: f64,
    /// What the file assumes of the server (threads, QoS, device), for the record.
    pub assumed_threads: u16,
    pub assumed_qos: bool,
    pub assumed_device: String,
    pub assumed_qos_config: Option<String>,
    pub tenants: Vec<TenantRow>,
    /// Every tenant's throughput summed.
    pub iops_total: f64,
    /// F = min S / max S over the tenants with a slowdown (at least two), OctoFAS eq. 2.
    pub fairness: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct TenantRow {
    pub name: String,
    /// The server namespace it used.
    pub namespace: u32,
    pub class: Class,
    pub latency_us_p95: Option<u64>,
    pub iops_reserved: Option<u64>,
    pub handle: u64,
    pub connections: usize,
    /// Open loop: the target rate; closed loop: `None` (as many as it gets).
    pub rate_target_per_sec: Option<f64>,
    pub queue_depth: u32,
    /// Open loop: arrivals per second in the measurement (answered or never issued).
    pub sent_iops: Option<f64>,
    pub iops: f64,
    /// Mean response time of its reads and writes, µs (closed loop: depth / IOPS).
    pub rt_us: f64,
    /// Its mean response time alone, µs, and where it came from (`file`, `alone run`).
    pub rt_alone_us: Option<f64>,
    pub rt_alone_source: Option<&'static str>,
    /// S = RT / RT_alone (OctoFAS eq. 1).
    pub slowdown: Option<f64>,
    pub read: LatencySummary,
    pub write: LatencySummary,
    /// LC tenants: read p95 within the SLO and ≥ 99 % of what was sent answered.
    pub slo_met: Option<bool>,
    pub notices: u64,
    pub unissued_ops: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    /// Per `timeline_ms` interval of the measurement (empty without it).
    pub timeline: Vec<TimelinePoint>,
}

/// One tenant in one timeline interval.
#[derive(Debug, Clone, Serialize)]
pub struct TimelinePoint {
    pub end_ms: u64,
    pub iops: f64,
    /// 0 without reads in the interval.
    pub read_p95_us: f64,
}

/// A tenant ready to run: its handle and its bound load connections.
struct Prepared {
    handle: u64,
    connections: Vec<(TcpStream, ConnectionCore)>,
    config: EngineConfig,
}

/// Runs the scenario at `path`, prints the table (or JSON), and fails on request errors.
pub fn run(path: &Path, options: &ScenarioOptions) -> Result<()> {
    let mut scenario = load(path)?;
    if options.alone {
        measure_alone(&mut scenario, options)?;
    }
    let report = execute(&scenario, options)?;
    let mut stdout = std::io::stdout().lock();
    if options.json {
        serde_json::to_writer_pretty(&mut stdout, &report)?;
        writeln!(stdout)?;
    } else {
        print_table(&mut stdout, &report)?;
    }
    stdout.flush()?;
    for tenant in &report.tenants {
        if tenant.errors > 0 {
            bail!(
                "tenant {}: {} requests failed; first: {}",
                tenant.name,
                tenant.errors,
                tenant.first_error.as_deref().unwrap_or("")
            );
        }
    }
    Ok(())
}

/// Runs each tenant of `scenario` alone (its own load, the same durations) and sets its
/// `rt_alone_us` to the mean response time measured: the baseline of its slowdown.
pub fn measure_alone(scenario: &mut ScenarioFile, options: &ScenarioOptions) -> Result<()> {
    for index in 0..scenario.tenants.len() {
        let mut alone = scenario.clone();
        alone.tenants = vec![scenario.tenants[index].clone()];
        alone.tenants[0].rt_alone_us = None;
        let report = execute(&alone, options)
            .with_context(|| format!("tenant {} alone", scenario.tenants[index].name))?;
        let row = &report.tenants[0];
        if row.errors > 0 || row.rt_us <= 0.0 {
            bail!(
                "tenant {} alone: {} errors, mean response time {:.1} µs",
                row.name,
                row.errors,
                row.rt_us
            );
        }
        if !options.quiet {
            eprintln!(
                "tenant {} alone: {:.0} IOPS, mean response time {:.1} µs",
                row.name, row.iops, row.rt_us
            );
        }
        scenario.tenants[index].rt_alone_us = Some(row.rt_us);
    }
    Ok(())
}

/// F = min S / max S over the slowdowns given (`None` with fewer than two).
pub fn fairness(slowdowns: impl Iterator<Item = f64>) -> Option<f64> {
    let slowdowns: Vec<f64> = slowdowns.collect();
    if slowdowns.len() < 2 {
        return None;
    }
    let min = slowdowns.iter().copied().fold(f64::INFINITY, f64::min);
    let max = slowdowns.iter().copied().fold(0.0, f64::max);
    (max > 0.0).then(|| min / max)
}

/// Registers the tenants, runs them all at once, unregisters them, and reports.
pub fn execute(scenario: &ScenarioFile, options: &ScenarioOptions) -> Result<ScenarioReport> {
    let address = options.address;
    let mut control =
        Client::connect(address).with_context(|| format!("connecting to {address}"))?;
    let capabilities = control.capabilities().clone();
    let namespace = match options.namespace {
        Some(id) => id,
        None => match capabilities.namespaces.first() {
            Some(namespace) => namespace.id,
            None => bail!("the server at {address} announces no namespace"),
        },
    };
    // Each tenant's namespace on the server and its size: the scenario's namespace 1 is
    // `namespace`, its namespace k > 1 (a further device) is the server's namespace k.
    let mut targets = Vec::with_capacity(scenario.tenants.len());
    for tenant in &scenario.tenants {
        let id = server_namespace(namespace, tenant.namespace);
        let Some(info) = capabilities.namespace(id) else {
            bail!("tenant {}: the server has no namespace {id}", tenant.name);
        };
        targets.push((id, info.size_bytes));
    }
    let seed = options.seed.unwrap_or(scenario.seed);
    let warmup = options
        .warmup
        .unwrap_or(Duration::from_millis(scenario.warmup_ms));
    let duration = options
        .duration
        .unwrap_or(Duration::from_millis(scenario.duration_ms));

    // Admission first, for every tenant; a refusal undoes the registrations made so far.
    let mut handles = Vec::new();
    for (tenant, &(namespace, _)) in scenario.tenants.iter().zip(&targets) {
        let class = match tenant.class {
            Class::Lc => TenantClassRequest::LatencyCritical {
                latency_us_p95: tenant.latency_us_p95.unwrap_or(0) as u32,
                iops: tenant.iops.unwrap_or(0),
                read_percent: tenant.read_percent,
            },
            Class::Be => TenantClassRequest::BestEffort,
        };
        let body = RegisterBody {
            namespace_id: namespace,
            class,
            read_only: false,
            handle: NO_TENANT_HANDLE,
        };
        match control.register(&body) {
            Ok(handle) => handles.push(handle),
            Err(error) => {
                unregister_all(&mut control, &handles);
                return Err(error).with_context(|| format!("registering tenant {}", tenant.name));
            }
        }
    }
    let prepared = prepare(
        scenario, options, &targets, seed, warmup, duration, &handles,
    );
    let prepared = match prepared {
        Ok(prepared) => prepared,
        Err(error) => {
            unregister_all(&mut control, &handles);
            return Err(error);
        }
    };
    if !options.quiet {
        eprintln!(
            "scenario {}: {} tenants on {address} namespace {namespace}, {:.1} s warm-up + {:.1} s",
            scenario.name,
            scenario.tenants.len(),
            warmup.as_secs_f64(),
            duration.as_secs_f64()
        );
    }
    // What each tenant's engine may keep in flight (the server's window, less one for REPORTs).
    let queue_depths: Vec<u32> = prepared
        .iter()
        .map(|tenant| tenant.config.load.queue_depth_max())
        .collect();
    let outcomes: Vec<Result<Outcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = prepared
            .into_iter()
            .map(|tenant| {
                scope.spawn(move || {
                    engine::run_with_connections(&tenant.config, vec![tenant.connections], None)
                        .map(|outcome| (tenant.handle, outcome))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("tenant thread panicked")))
                    .map(|(_, outcome)| outcome)
            })
            .collect()
    });
    unregister_all(&mut control, &handles);
    let mut rows = Vec::new();
    for ((((tenant, handle), outcome), &(namespace, _)), &queue_depth) in scenario
        .tenants
        .iter()
        .zip(&handles)
        .zip(outcomes)
        .zip(&targets)
        .zip(&queue_depths)
    {
        let outcome = outcome.with_context(|| format!("tenant {}", tenant.name))?;
        let mut row = row(tenant, *handle, &outcome, queue_depth);
        row.namespace = namespace;
        if let Some(alone) = tenant.rt_alone_us {
            row.rt_alone_us = Some(alone);
            row.rt_alone_source = Some(if options.alone { "alone run" } else { "file" });
            row.slowdown = (row.rt_us > 0.0).then(|| row.rt_us / alone);
        }
        rows.push(row);
    }
    Ok(ScenarioReport {
        iops_total: rows.iter().map(|row| row.iops).sum(),
        fairness: fairness(rows.iter().filter_map(|row| row.slowdown)),
        scenario: scenario.name.clone(),
        description: scenario.description.clone(),
        server: address.to_string(),
        namespace,
        seed,
        warmup_sec: warmup.as_secs_f64(),
        duration_sec: duration.as_secs_f64(),
        assumed_threads: scenario.threads,
        assumed_qos: scenario.qos,
        assumed_device: device_text(&scenario.device),
        assumed_qos_config: scenario
            .qos_config
            .as_ref()
            .map(|config| format!("{config:?}")),
        tenants: rows,
    })
}

/// The server namespace of a tenant on the scenario's namespace `scenario_namespace`, when the
/// scenario's namespace 1 is the server's `first`.
fn server_namespace(first: u32, scenario_namespace: u32) -> u32 {
    if scenario_namespace == 1 {
        first
    } else {
        scenario_namespace
    }
}

fn device_text(device: &reflex_sim::scenario::DeviceSpec) -> String {
    let model = match (&device.emulated, &device.fixed) {
        (Some(name), _) => format!("emu:{name}"),
        (None, Some(fixed)) => format!("{fixed:?}"),
        (None, None) => "unspecified".to_string(),
    };
    format!("{model}, profile {}", device.profile)
}

fn unregister_all(control: &mut Client, handles: &[u64]) {
    for &handle in handles {
        if let Err(error) = control.unregister(handle) {
            eprintln!("warning: unregistering tenant handle {handle}: {error}");
        }
    }
}

/// Opens and binds each tenant's load connections and builds its engine run.
#[allow(clippy::too_many_arguments)]
fn prepare(
    scenario: &ScenarioFile,
    options: &ScenarioOptions,
    targets: &[(u32, u64)],
    seed: u64,
    warmup: Duration,
    duration: Duration,
    handles: &[u64],
) -> Result<Vec<Prepared>> {
    let mut prepared = Vec::new();
    for (index, ((tenant, &handle), &(namespace, size_bytes))) in scenario
        .tenants
        .iter()
        .zip(handles)
        .zip(targets)
        .enumerate()
    {
        let mut connections = Vec::new();
        let mut window = u32::MAX;
        for _ in &tenant.threads {
            let mut client = Client::connect(options.address)
                .with_context(|| format!("tenant {}: connecting", tenant.name))?;
            client
                .bind(handle)
                .with_context(|| format!("tenant {}: BIND", tenant.name))?;
            window = window.min(client.capabilities().window_requests);
            let (stream, core, _) = client.into_pipelined().into_parts();
            connections.push((stream, core));
        }
        let io_size_bytes = tenant.size_bytes;
        let range_length_bytes = size_bytes - size_bytes % u64::from(io_size_bytes);
        if range_length_bytes == 0 {
            bail!("namespace {namespace} holds no I/O of {io_size_bytes} bytes");
        }
        let read_percent = tenant.load.read_percent.unwrap_or(tenant.read_percent);
        // A REPORT takes one request of the server's window: I/O gets the rest (with all of
        // it, a REPORT in flight left a due READ no room, and the run stopped). A window of
        // one has no room for both: no REPORT then.
        let report_interval = options
            .report_interval
            .filter(|_| tenant.class == Class::Lc && window >= 2);
        let window = (window - u32::from(report_interval.is_some())).min(engine::QUEUE_DEPTH_MAX);
        let load = match (tenant.load.open_iops, tenant.load.closed_depth) {
            (Some(rate), _) => Load::Open {
                rate_per_sec: rate as f64,
                queue_depth_max: tenant.load.window.min(window),
            },
            (None, Some(depth)) => Load::Closed {
                queue_depth: depth.min(window),
            },
            (None, None) => bail!("tenant {}: no load", tenant.name),
        };
        let config = EngineConfig {
            target: Target::Remote {
                address: options.address,
                namespace,
            },
            threads: 1,
            channels_per_thread: connections.len(),
            load,
            workload: WorkloadSpec {
                read_ratio: f64::from(read_percent) / 100.0,
                io_size_bytes,
                access: Access::Random,
                range_start_bytes: 0,
                range_length_bytes,
            },
            phase: Phase::Measure,
            seed: seed ^ ((index as u64 + 1) << 32),
            verify_seed: None,
            warmup,
            duration,
            ops_max: None,
            spin: options.spin,
            cpus: options.cpus.clone(),
            bind_handles: Vec::new(),
            server_pid: None,
            measure_hooks: Default::default(),
            follow_notices: tenant.load.follow_notices,
            timeline: scenario.timeline_ms.map(Duration::from_millis),
            report_interval,
        };
        prepared.push(Prepared {
            handle,
            connections,
            config,
        });
    }
    Ok(prepared)
}

fn row(tenant: &TenantSpecToml, handle: u64, outcome: &Outcome, queue_depth: u32) -> TenantRow {
    let measured_sec = (outcome.measured_ns as f64 / 1e9).max(1e-9);
    let read = outcome.read.summary();
    let write = outcome.write.summary();
    let answered = read.count + write.count;
    let rt_us = if answered > 0 {
        (read.avg_us * read.count as f64 + write.avg_us * write.count as f64) / answered as f64
    } else {
        0.0
    };
    let rate_target_per_sec = tenant.load.open_iops.map(|rate| rate as f64);
    let sent_ops = outcome.measured_ops + outcome.unissued_ops;
    let sent_iops = rate_target_per_sec.map(|_| sent_ops as f64 / measured_sec);
    let slo_met = match (tenant.class, tenant.latency_us_p95) {
        (Class::Lc, Some(latency_us_p95)) => {
            let answered_enough =
                outcome.measured_ops as f64 >= ANSWERED_SHARE_MIN * sent_ops as f64;
            Some(read.p95_us <= latency_us_p95 as f64 && answered_enough && outcome.errors == 0)
        }
        _ => None,
    };
    TenantRow {
        name: tenant.name.clone(),
        namespace: 1,
        class: tenant.class,
        latency_us_p95: tenant.latency_us_p95,
        iops_reserved: tenant.iops,
        handle,
        connections: tenant.threads.len(),
        rate_target_per_sec,
        queue_depth,
        sent_iops,
        iops: outcome.measured_ops as f64 / measured_sec,
        rt_us,
        rt_alone_us: None,
        rt_alone_source: None,
        slowdown: None,
        read,
        write,
        slo_met,
        notices: outcome.notices,
        unissued_ops: outcome.unissued_ops,
        errors: outcome.errors,
        first_error: outcome.first_error.clone(),
        timeline: timeline_points(&outcome.timeline),
    }
}

fn timeline_points(samples: &[engine::TimelineSample]) -> Vec<TimelinePoint> {
    let mut start_ns = 0;
    samples
        .iter()
        .map(|sample| {
            let seconds = (sample.end_ns.saturating_sub(start_ns) as f64 / 1e9).max(1e-9);
            start_ns = sample.end_ns;
            TimelinePoint {
                end_ms: sample.end_ns / 1_000_000,
                iops: sample.ops as f64 / seconds,
                read_p95_us: if sample.read.count() == 0 {
                    0.0
                } else {
                    sample.read.quantile_us(0.95)
                },
            }
        })
        .collect()
}

fn human(count: f64) -> String {
    if count >= 1e6 {
        format!("{:.2}M", count / 1e6)
    } else if count >= 1e3 {
        format!("{:.1}K", count / 1e3)
    } else {
        format!("{count:.0}")
    }
}

pub fn print_table(out: &mut impl Write, report: &ScenarioReport) -> std::io::Result<()> {
    writeln!(
        out,
        "# scenario {}: {} namespace {}, seed {}, {:.1} s measured after {:.1} s warm-up",
        report.scenario,
        report.server,
        report.namespace,
        report.seed,
        report.duration_sec,
        report.warmup_sec
    )?;
    writeln!(
        out,
        "# the file assumes: device {}; threads {}; QoS {}",
        report.assumed_device,
        report.assumed_threads,
        if report.assumed_qos { "on" } else { "off" }
    )?;
    if let Some(knobs) = &report.assumed_qos_config {
        writeln!(out, "# and QoS knobs: {knobs}")?;
    }
    writeln!(
        out,
        "| tenant | class | SLO | sent IOPS | IOPS | mean RT µs | RT alone µs | slowdown | read p95 µs | read p99 µs | write p95 µs | SLO met | notices |"
    )?;
    writeln!(
        out,
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"
    )?;
    let several_namespaces = report
        .tenants
        .iter()
        .any(|t| t.namespace != report.namespace);
    for tenant in &report.tenants {
        let name = if several_namespaces {
            format!("{} (ns {})", tenant.name, tenant.namespace)
        } else {
            tenant.name.clone()
        };
        let slo = match (tenant.latency_us_p95, tenant.iops_reserved) {
            (Some(latency), Some(iops)) => format!("{} @ {latency} µs", human(iops as f64)),
            _ => "-".to_string(),
        };
        let sent = match tenant.sent_iops {
            Some(sent) => human(sent),
            None => format!("qd {}", tenant.queue_depth),
        };
        let met = match tenant.slo_met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "-",
        };
        let write_p95 = if tenant.write.count > 0 {
            format!("{:.0}", tenant.write.p95_us)
        } else {
            "-".to_string()
        };
        let alone = tenant
            .rt_alone_us
            .map_or_else(|| "-".to_string(), |rt| format!("{rt:.1}"));
        let slowdown = tenant
            .slowdown
            .map_or_else(|| "-".to_string(), |s| format!("{s:.2}"));
        writeln!(
            out,
            "| {name} | {} | {slo} | {sent} | {} | {:.1} | {alone} | {slowdown} | {:.0} | {:.0} | {write_p95} | {met} | {} |",
            match tenant.class {
                Class::Lc => "LC",
                Class::Be => "BE",
            },
            human(tenant.iops),
            tenant.rt_us,
            tenant.read.p95_us,
            tenant.read.p99_us,
            tenant.notices
        )?;
    }
    writeln!(out, "(latencies from the intended send time)")?;
    let judged = report
        .tenants
        .iter()
        .filter(|t| t.slowdown.is_some())
        .count();
    match report.fairness {
        Some(f) => writeln!(
            out,
            "total {} IOPS; fairness F = {f:.2} (min S / max S over {judged} tenants)",
            human(report.iops_total)
        )?,
        None => writeln!(
            out,
            "total {} IOPS; fairness F needs RT_alone of two tenants (rt_alone_us, --scenario-alone)",
            human(report.iops_total)
        )?,
    }
    write_timeline(out, report)?;
    Ok(())
}

/// Each tenant's IOPS and read p95 per timeline interval, one row per interval.
fn write_timeline(out: &mut impl Write, report: &ScenarioReport) -> std::io::Result<()> {
    let intervals = report
        .tenants
        .iter()
        .map(|t| t.timeline.len())
        .max()
        .unwrap_or(0);
    if intervals == 0 {
        return Ok(());
    }
    writeln!(out)?;
    let mut header = "| t ms |".to_string();
    let mut rule = "|---:|".to_string();
    for tenant in &report.tenants {
        header.push_str(&format!(" {0} IOPS | {0} p95 µs |", tenant.name));
        rule.push_str("---:|---:|");
    }
    writeln!(out, "{header}")?;
    writeln!(out, "{rule}")?;
    for index in 0..intervals {
        let end_ms = report
            .tenants
            .iter()
            .find_map(|t| t.timeline.get(index))
            .map_or(0, |point| point.end_ms);
        let mut row = format!("| {end_ms} |");
        for tenant in &report.tenants {
            match tenant.timeline.get(index) {
                Some(point) => row.push_str(&format!(
                    " {} | {:.0} |",
                    human(point.iops),
                    point.read_p95_us
                )),
                None => row.push_str(" - | - |"),
            }
        }
        writeln!(out, "{row}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> Result<ScenarioFile> {
        parse(text, "test")
    }

    #[test]
    fn reads_the_simulators_scenarios() {
        for name in [
            "fig5-scenario1.toml",
            "fig5-scenario2.toml",
            "fig5-scenario1-qos-off.toml",
            "fig5-small-scenario1.toml",
            "fig5-small-scenario2.toml",
            "fig5-small-scenario1-qos-off.toml",
            "fig5-small-scenario2-qos-off.toml",
            "two-devices.toml",
        ] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../scenarios")
                .join(name);
            let scenario = load(&path).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert_eq!(scenario.tenants.len(), 4);
            assert_eq!(scenario.tenants[0].class, Class::Lc);
            assert_eq!(scenario.tenants[2].load.closed_depth, Some(32));
        }
    }

    /// A real server with the small device's profile on a memory namespace.
    fn server(qos: bool) -> reflex_server::ServerHandle {
        let profile = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../profiles/device-a-small.toml")
            .display()
            .to_string();
        let namespace = reflex_server::NamespaceConfig {
            profile: Some(profile),
            ..reflex_server::NamespaceConfig::new(1, "mem:64M").sized(64 << 20)
        };
        let config = reflex_server::Config {
            window: 32,
            qos,
            ..reflex_server::Config::loopback(vec![namespace])
        };
        reflex_server::Server::start(config).unwrap_or_else(|e| panic!("server: {e}"))
    }

    fn options(server: &reflex_server::ServerHandle) -> ScenarioOptions {
        ScenarioOptions {
            address: server.native_addr(),
            namespace: None,
            duration: None,
            warmup: None,
            seed: None,
            alone: false,
            // The LC tenants report (answered OK and ignored: calibration is off here).
            report_interval: Some(Duration::from_millis(25)),
            spin: false,
            cpus: Vec::new(),
            json: true,
            quiet: true,
        }
    }

    const TWO_TENANTS: &str = r#"
        name = "two"
        duration_ms = 300
        warmup_ms = 50
        [device]
        emulated = "device-a-small"
        profile = "../profiles/device-a-small.toml"
        [[tenant]]
        name = "A"
        class = "lc"
        latency_us_p95 = 2000
        iops = 2000
        read_percent = 100
        threads = [0, 0]
        load = { open_iops = 1000 }
        [[tenant]]
        name = "C"
        class = "be"
        read_percent = 50
        load = { closed_depth = 4 }
    "#;

    #[test]
    fn a_tenant_on_a_further_device_runs_on_that_namespace() {
        let profiles = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles");
        let namespace = |id: u32, profile: &str| reflex_server::NamespaceConfig {
            profile: Some(profiles.join(profile).display().to_string()),
            ..reflex_server::NamespaceConfig::new(id, "mem:64M").sized(64 << 20)
        };
        let config = reflex_server::Config {
            window: 32,
            ..reflex_server::Config::loopback(vec![
                namespace(1, "device-a-small.toml"),
                namespace(2, "device-a.toml"),
            ])
        };
        let server = reflex_server::Server::start(config).unwrap_or_else(|e| panic!("{e}"));
        let two_devices = TWO_TENANTS
            .replace("[[tenant]]\n        name = \"C\"", "[[tenant]]\n        name = \"C\"\n        namespace = 2")
            .replace("[[tenant]]", "[[extra_device]]\n        emulated = \"device-a\"\n        profile = \"p.toml\"\n        [[tenant]]");
        let scenario = check(&two_devices).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(scenario.tenants[1].namespace, 2);
        let report = execute(&scenario, &options(&server)).unwrap_or_else(|e| panic!("{e:#}"));
        let namespaces: Vec<u32> = report.tenants.iter().map(|t| t.namespace).collect();
        assert_eq!(namespaces, [1, 2]);
        for tenant in &report.tenants {
            assert_eq!(tenant.errors, 0, "{:?}", tenant.first_error);
            assert!(tenant.iops > 0.0);
        }
        // A namespace the server does not have: a clear error before any tenant registers.
        let mut missing = scenario.clone();
        missing.extra_devices.push(missing.extra_devices[0].clone());
        missing.tenants[1].namespace = 3;
        let error = execute(&missing, &options(&server)).unwrap_err();
        assert!(
            format!("{error:#}").contains("the server has no namespace 3"),
            "{error:#}"
        );
        assert_eq!(
            server.tenants().len(),
            2,
            "each namespace's default tenant only"
        );
        server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn tenants_register_bind_run_and_leave() {
        let server = server(true);
        let scenario = check(TWO_TENANTS).unwrap_or_else(|e| panic!("{e:#}"));
        let report = execute(&scenario, &options(&server)).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(report.tenants.len(), 2);
        let (a, c) = (&report.tenants[0], &report.tenants[1]);
        assert_eq!(
            (a.name.as_str(), a.class, a.connections),
            ("A", Class::Lc, 2)
        );
        assert_eq!(c.class, Class::Be);
        assert_ne!(a.handle, c.handle);
        for tenant in &report.tenants {
            assert_eq!(tenant.errors, 0, "{:?}", tenant.first_error);
            assert!(tenant.iops > 0.0);
            assert!(tenant.read.count > 0);
        }
        assert!(c.write.count > 0, "half of C's I/O writes");
        assert!(a.slo_met.is_some() && c.slo_met.is_none());
        assert_eq!(a.rate_target_per_sec, Some(1000.0));
        // Unregistered at the end: only the namespace's default tenant is left.
        let tenants = server.tenants();
        assert_eq!(tenants.len(), 1, "{tenants:?}");
        let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
        let totals = reflex_server::tenant_totals(&stats);
        // The server charged each tenant exactly what the bench saw answered (warm-up too).
        assert!(totals[&a.handle].requests >= a.read.count);
        assert!(totals[&c.handle].requests >= c.read.count + c.write.count);
    }

    #[test]
    fn a_timeline_gives_each_interval_of_the_measurement() {
        let server = server(true);
        let text = TWO_TENANTS.replace(
            "warmup_ms = 50",
            "warmup_ms = 50\n        timeline_ms = 100",
        );
        let scenario = check(&text).unwrap_or_else(|e| panic!("{e:#}"));
        let report = execute(&scenario, &options(&server)).unwrap_or_else(|e| panic!("{e:#}"));
        for tenant in &report.tenants {
            let ends: Vec<u64> = tenant.timeline.iter().map(|p| p.end_ms).collect();
            assert_eq!(ends, [100, 200, 300], "{}", tenant.name);
            let ops: f64 = tenant.timeline.iter().map(|p| p.iops * 0.1).sum();
            let measured = (tenant.read.count + tenant.write.count) as f64;
            assert!(ops > 0.0 && ops <= measured + 0.5, "{ops} of {measured}");
        }
        let mut table = Vec::new();
        print_table(&mut table, &report).unwrap_or_else(|e| panic!("{e}"));
        let table = String::from_utf8(table).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            table.contains("| t ms | A IOPS | A p95 µs | C IOPS | C p95 µs |"),
            "{table}"
        );
        assert!(table.contains("\n| 300 |"), "{table}");
        server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn fairness_is_the_lowest_slowdown_over_the_highest() {
        assert_eq!(fairness([2.0, 4.0, 3.0].into_iter()), Some(0.5));
        assert_eq!(fairness([1.5].into_iter()), None);
        assert_eq!(fairness(std::iter::empty()), None);
    }

    #[test]
    fn rt_alone_from_the_file_or_alone_runs_gives_slowdowns_and_f() {
        let server = server(false);
        let text = TWO_TENANTS
            .replace(
                "load = { open_iops = 1000 }",
                "load = { open_iops = 1000 }
        rt_alone_us = 10.0",
            )
            .replace(
                "load = { closed_depth = 4 }",
                "load = { closed_depth = 4 }
        rt_alone_us = 20.0",
            );
        let scenario = check(&text).unwrap_or_else(|e| panic!("{e:#}"));
        let report = execute(&scenario, &options(&server)).unwrap_or_else(|e| panic!("{e:#}"));
        for (tenant, alone) in report.tenants.iter().zip([10.0, 20.0]) {
            assert!(tenant.rt_us > 0.0, "{}", tenant.name);
            assert_eq!(tenant.rt_alone_us, Some(alone));
            assert_eq!(tenant.rt_alone_source, Some("file"));
            assert_eq!(tenant.slowdown, Some(tenant.rt_us / alone));
        }
        let (a, c) = (&report.tenants[0], &report.tenants[1]);
        let (low, high) = if a.slowdown < c.slowdown {
            (a, c)
        } else {
            (c, a)
        };
        assert_eq!(
            report.fairness,
            Some(low.slowdown.unwrap_or(0.0) / high.slowdown.unwrap_or(1.0))
        );
        assert!((report.iops_total - a.iops - c.iops).abs() < 1e-6);
        let mut table = Vec::new();
        print_table(&mut table, &report).unwrap_or_else(|e| panic!("{e}"));
        let table = String::from_utf8(table).unwrap_or_else(|e| panic!("{e}"));
        assert!(table.contains("fairness F = "), "{table}");

        // Alone runs replace the file's figures with measured ones.
        let mut scenario = scenario;
        let mut alone = options(&server);
        alone.alone = true;
        measure_alone(&mut scenario, &alone).unwrap_or_else(|e| panic!("{e:#}"));
        for tenant in &scenario.tenants {
            let rt = tenant.rt_alone_us.unwrap_or(0.0);
            assert!(
                rt > 0.0 && rt != 10.0 && rt != 20.0,
                "{}: {rt}",
                tenant.name
            );
        }
        let report = execute(&scenario, &alone).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(
            report
                .tenants
                .iter()
                .all(|t| t.rt_alone_source == Some("alone run"))
        );
        assert!(report.fairness.is_some_and(|f| f > 0.0 && f <= 1.0));
        assert_eq!(server.tenants().len(), 1, "alone runs unregister too");
        server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn a_refused_tenant_fails_the_run_and_leaves_nothing_registered() {
        let server = server(true);
        // A fits; B, registered after it, does not: A must be unregistered again.
        let too_big = format!(
            "{TWO_TENANTS}\n[[tenant]]\nname = \"B\"\nclass = \"lc\"\nlatency_us_p95 = 2000\niops = 500000\nload = {{ open_iops = 10 }}\n"
        );
        let scenario = check(&too_big).unwrap_or_else(|e| panic!("{e:#}"));
        let error = execute(&scenario, &options(&server)).err();
        let text = error.map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(
            text.starts_with("registering tenant B: registration refused: needs"),
            "{text}"
        );
        assert_eq!(server.tenants().len(), 1);
        server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }

    /// The head of a scenario file: name, duration and the device it assumes.
    const DEVICE: &str = "name = \"t\"\nduration_ms = 10\n[device]\nemulated = \"device-a-small\"\nprofile = \"p.toml\"\n";

    #[test]
    fn refuses_what_it_cannot_run() {
        let tenant =
            |extra: &str| format!("{DEVICE}[[tenant]]\nname = \"a\"\nclass = \"be\"\n{extra}");
        assert!(check(&tenant("load = { closed_depth = 4 }")).is_ok());
        assert!(check(&tenant("load = { open_iops = 4, closed_depth = 4 }")).is_err());
        assert!(check(&tenant("load = { closed_depth = 0 }")).is_err());
        assert!(check(&tenant("per_thread = true\nload = { closed_depth = 4 }")).is_err());
        assert!(check(&tenant("size_bytes = 1000\nload = { closed_depth = 4 }")).is_err());
        assert!(check(&tenant("threads = []\nload = { closed_depth = 4 }")).is_err());
        let lc_without_slo =
            format!("{DEVICE}[[tenant]]\nname = \"a\"\nclass = \"lc\"\nload = {{ open_iops = 4 }}");
        assert!(check(&lc_without_slo).is_err());
        assert!(check(&format!("{DEVICE}tenant = []")).is_err());
        let sweep = tenant("load = { closed_depth = 4 }\n[sweep]\nper_thread_tenants = [1]");
        assert!(check(&sweep).is_err(), "sweeps are simulator-only");
    }
}
