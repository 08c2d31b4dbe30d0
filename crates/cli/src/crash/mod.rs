//! `reflex crash-test`: kill `reflexd` with SIGKILL while it takes writes over all three
//! protocols, restart it, and check that every acknowledged write that was made durable is
//! still there — never a torn, misplaced or garbage block anywhere.
//!
//! A run is `--cycles` cycles on one file namespace in `--dir`. Each cycle starts reflexd on
//! the same ports (waiting for its "reflexd serving" line), reads the whole namespace back and
//! checks it against the model of the previous cycle ([`verify`], [`model`]), FLUSHes, then
//! runs one writer per protocol and connection ([`writer`]: native and NBD with FLUSH and FUA,
//! the original ReFlex protocol, which has neither). Once `--blocks-per-cycle` blocks are
//! acknowledged, it waits a uniformly random time in `0..=--kill-window` and SIGKILLs reflexd
//! with writes in flight. After the last cycle a final start verifies it, and reflexd is
//! stopped with SIGTERM, which must exit 0.
//!
//! Every random choice comes from PRNGs seeded by `--seed` (printed at the start): the kill
//! delays, each writer's blocks, sizes, FUA and FLUSH choices, and the negative control's
//! block. Timing decides what is in flight when the kill lands, so a seed replays the choices,
//! not the interleaving.
//!
//! Negative control (hidden flags `--inject KIND --inject-cycle N`): after the kill of cycle
//! N, damage one block the model holds durable directly in the backing file (garbage, its
//! previous content, or another block's content); the next verification must report exactly
//! that block. The integration tests run it, so a checker that cannot fail would fail them.
//!
//! Bounds: cycles ≤ [`block::CYCLES_MAX`], writers ≤ 3 × [`CONNECTIONS_MAX`], each writer's
//! blocks per cycle, each cycle's time ([`CYCLE_TIMEOUT`]) and the whole run's
//! (`--time-limit`); a run that hits the time limit reports what it did and fails.

mod block;
mod daemon;
mod model;
mod original;
mod verify;
mod writer;

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use serde::Serialize;

use self::block::{BLOCK_SIZE_BYTES, BlockHeader, CYCLES_MAX, Protocol, WRITERS_MAX, encode};
use self::daemon::{Daemon, DaemonConfig, Ports};
use self::model::{Category, Content, Failure, Model, ProtocolTotals, Verification};
use self::writer::{Shared, WRITE_BLOCKS_MAX, WriterEnd, WriterPlan, below};
use crate::bench::units::{parse_duration, parse_size};

/// Connections per protocol.
pub const CONNECTIONS_MAX: usize = 16;
/// Requests in flight per connection.
pub const QUEUE_DEPTH_MAX: usize = 128;
/// Largest namespace (the model keeps a few bytes per block).
pub const DEVICE_SIZE_MAX_BYTES: u64 = 16 << 30;
/// Longest write phase of one cycle: the kill comes at the latest then.
pub const CYCLE_TIMEOUT: Duration = Duration::from_secs(120);
/// A writer sends at most this many times `--blocks-per-cycle` blocks, plus the slack; the
/// kill normally comes long before.
const WRITER_BLOCKS_FACTOR: u64 = 8;
const WRITER_BLOCKS_SLACK: u64 = 1 << 16;
/// Failures listed in the report (all are counted).
const FAILURES_LISTED_MAX: usize = 20;
const BACKING_FILE_NAME: &str = "ns1.img";
const LOG_FILE_NAME: &str = "reflexd.log";

const _: () = assert!(3 * CONNECTIONS_MAX <= WRITERS_MAX);

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The reflexd binary (default: `reflexd` next to this executable).
    #[arg(long, value_name = "PATH")]
    reflexd: Option<PathBuf>,
    /// Work directory: the backing file (ns1.img, recreated at the start) and reflexd.log.
    #[arg(long, default_value = "reflex-crash-test")]
    dir: PathBuf,
    /// Kill-and-restart cycles.
    #[arg(long, default_value_t = 10)]
    cycles: u64,
    /// Seed of every random choice (default: from the clock; printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// Blocks (4 KiB) acknowledged in a cycle before the kill window opens.
    #[arg(long, default_value_t = 2000)]
    blocks_per_cycle: u64,
    /// The kill comes uniformly at random within this long after --blocks-per-cycle.
    #[arg(long, value_parser = parse_duration, default_value = "100ms")]
    kill_window: Duration,
    /// Namespace size (a multiple of 4 KiB; each writer owns an equal share).
    #[arg(long, value_parser = parse_size, default_value = "64M")]
    device_size: u64,
    /// reflexd's dataplane threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Connections (writers) per protocol.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Requests in flight per connection.
    #[arg(long, default_value_t = 8)]
    queue_depth: usize,
    /// Chance that a native or NBD write carries FUA, in percent.
    #[arg(long, default_value_t = 25)]
    fua_percent: u32,
    /// Chance that a native or NBD request is a FLUSH instead of a write, in percent.
    #[arg(long, default_value_t = 5)]
    flush_percent: u32,
    /// Stop starting cycles after this long (the run then fails as incomplete).
    #[arg(long, value_parser = parse_duration, default_value = "60m")]
    time_limit: Duration,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// No progress output.
    #[arg(long, short = 'q')]
    quiet: bool,
    /// Negative control: damage one durable block in the backing file after a kill.
    #[arg(long, value_enum, hide = true)]
    inject: Option<Injection>,
    /// The cycle after whose kill --inject damages a block.
    #[arg(long, default_value_t = 1, hide = true)]
    inject_cycle: u64,
}

/// How the negative control damages a block the model holds durable.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Injection {
    /// Random bytes.
    Garbage,
    /// The block's content from before its durable write (a lost write).
    Stale,
    /// Another durable block's content (a misdirected write).
    Misplaced,
}

impl Injection {
    fn description(self) -> &'static str {
        match self {
            Injection::Garbage => "garbage",
            Injection::Stale => "its previous content",
            Injection::Misplaced => "another block's content",
        }
    }
}

/// What the negative control did.
#[derive(Debug, Clone, Serialize)]
struct Injected {
    kind: Injection,
    cycle: u64,
    block: u64,
}

/// One cycle's write phase and kill.
#[derive(Debug, Clone, Serialize)]
struct CycleReport {
    cycle: u64,
    /// From the writers' start to the SIGKILL.
    kill_after_ms: u64,
    /// Requests sent and not yet answered when the SIGKILL was sent.
    in_flight_at_kill: u64,
    blocks_written: u64,
    writes_durable: u64,
    /// Writers that ended other than by the server going away (they ran out of blocks or
    /// time before the kill).
    writers_finished_before_kill: u64,
    /// Requests the server answered with an error.
    errors: u64,
}

/// Counts of the verifications.
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct CheckTotals {
    /// Blocks whose latest durable write (FUA, or a FLUSH after its acknowledgement) was
    /// checked: that write or a later one must be there.
    blocks_verified: u64,
    /// Blocks written in a cycle with nothing durable: the old content or any write of the
    /// cycle (never anything else).
    blocks_unflushed_checked: u64,
    /// Blocks not written in the cycle: exactly their previous content.
    blocks_unchanged_checked: u64,
    /// Blocks that held something the model does not allow.
    lost_blocks: u64,
}

#[derive(Debug, Serialize)]
struct Summary {
    seed: u64,
    reflexd: String,
    dir: String,
    cycles_requested: u64,
    /// Cycles whose kill happened (each verified by the next start).
    cycles_completed: u64,
    /// All cycles ran and the final verification and clean shutdown happened.
    complete: bool,
    device_size_bytes: u64,
    blocks_per_cycle: u64,
    kill_window_ms: u64,
    threads: usize,
    connections_per_protocol: usize,
    queue_depth: usize,
    blocks_written: u64,
    writes: u64,
    writes_acknowledged: u64,
    writes_durable: u64,
    #[serde(flatten)]
    checks: CheckTotals,
    failure_kinds: BTreeMap<String, u64>,
    /// The first failures, in the order found.
    failures: Vec<FailureReport>,
    protocols: BTreeMap<&'static str, ProtocolTotals>,
    kills_with_requests_in_flight: u64,
    in_flight_at_kill_min: u64,
    in_flight_at_kill_max: u64,
    kill_after_ms_min: u64,
    kill_after_ms_max: u64,
    /// Writers that ran out of blocks or time before a kill (0 expected).
    writers_finished_before_kill: u64,
    /// Requests answered with an error (0 expected).
    request_errors: u64,
    /// Starts in which reflexd found a port still held by the killed process and waited for it.
    starts_that_waited_for_a_port: u64,
    /// The final SIGTERM ended reflexd with exit status 0.
    clean_shutdown: bool,
    injected: Option<Injected>,
    duration_secs: f64,
}

#[derive(Debug, Clone, Serialize)]
struct FailureReport {
    /// The cycle whose writes the verification checked.
    cycle: u64,
    #[serde(flatten)]
    failure: Failure,
}

/// Runs `reflex crash-test`.
pub fn run(args: Args) -> Result<()> {
    validate(&args)?;
    let seed = args.seed.unwrap_or_else(seed_from_clock);
    let reflexd = match &args.reflexd {
        Some(path) => path.clone(),
        None => daemon::default_reflexd()?,
    };
    if !reflexd.is_file() {
        bail!(
            "no reflexd at {} (build it with `cargo build --release --bin reflexd`, or pass --reflexd)",
            reflexd.display()
        );
    }
    eprintln!(
        "crash-test: seed {seed}, {} cycles, {} blocks per cycle, reflexd {}",
        args.cycles,
        args.blocks_per_cycle,
        reflexd.display()
    );
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let backing_file = args.dir.join(BACKING_FILE_NAME);
    let log_path = args.dir.join(LOG_FILE_NAME);
    daemon::create_backing_file(&backing_file, args.device_size)?;
    std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let config = DaemonConfig {
        reflexd: reflexd.clone(),
        backing_file: backing_file.clone(),
        size_bytes: args.device_size,
        threads: args.threads,
        log_path,
    };
    let mut run = Run {
        args: &args,
        seed,
        rng: Xoshiro256PlusPlus::seed_from_u64(seed),
        model: Model::new(splitmix(seed), args.device_size / BLOCK_SIZE_BYTES as u64),
        config,
        ports: Ports::pick()?,
        started: Instant::now(),
        checks: CheckTotals::default(),
        failures: Vec::new(),
        failure_kinds: BTreeMap::new(),
        protocols: BTreeMap::new(),
        cycles: Vec::new(),
        injected: None,
        starts_that_waited_for_a_port: 0,
        clean_shutdown: false,
        progress: Progress::new(args.quiet),
    };
    let complete = run.all_cycles()?;
    run.progress.finish();
    let summary = run.summary(complete, &reflexd);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_summary(&summary);
    }
    if summary.checks.lost_blocks > 0 {
        bail!(
            "{} blocks lost or damaged (seed {seed}; details above, reflexd's log in {})",
            summary.checks.lost_blocks,
            args.dir.display()
        );
    }
    if !complete {
        bail!(
            "incomplete: {} of {} cycles within the time limit {:?} (seed {seed})",
            summary.cycles_completed,
            args.cycles,
            args.time_limit
        );
    }
    if !summary.clean_shutdown {
        bail!("reflexd did not exit 0 after the final SIGTERM (seed {seed})");
    }
    Ok(())
}

fn validate(args: &Args) -> Result<()> {
    if args.cycles == 0 || args.cycles > CYCLES_MAX {
        bail!("--cycles must be 1..={CYCLES_MAX}");
    }
    if args.connections == 0 || args.connections > CONNECTIONS_MAX {
        bail!("--connections must be 1..={CONNECTIONS_MAX}");
    }
    if args.queue_depth == 0 || args.queue_depth > QUEUE_DEPTH_MAX {
        bail!("--queue-depth must be 1..={QUEUE_DEPTH_MAX}");
    }
    if args.threads == 0 || args.threads > 64 {
        bail!("--threads must be 1..=64");
    }
    if args.fua_percent > 100 || args.flush_percent > 100 {
        bail!("--fua-percent and --flush-percent are percentages");
    }
    if args.blocks_per_cycle == 0 {
        bail!("--blocks-per-cycle must be at least 1");
    }
    if !args.device_size.is_multiple_of(BLOCK_SIZE_BYTES as u64)
        || args.device_size > DEVICE_SIZE_MAX_BYTES
    {
        bail!("--device-size must be a multiple of 4 KiB, at most {DEVICE_SIZE_MAX_BYTES} bytes");
    }
    let writers = 3 * args.connections as u64;
    // Each writer's region must hold its queue of non-overlapping writes, with room to pick.
    let region_blocks_min = 4 * args.queue_depth as u64 * u64::from(WRITE_BLOCKS_MAX);
    if args.device_size / BLOCK_SIZE_BYTES as u64 / writers < region_blocks_min {
        bail!(
            "--device-size too small: each of the {writers} writers needs at least {region_blocks_min} blocks"
        );
    }
    if args.inject.is_some() && args.inject_cycle >= args.cycles {
        bail!("--inject-cycle must be below --cycles");
    }
    Ok(())
}

struct Run<'a> {
    args: &'a Args,
    seed: u64,
    /// Kill delays and the negative control's choices.
    rng: Xoshiro256PlusPlus,
    model: Model,
    config: DaemonConfig,
    ports: Ports,
    started: Instant,
    checks: CheckTotals,
    failures: Vec<FailureReport>,
    failure_kinds: BTreeMap<String, u64>,
    protocols: BTreeMap<&'static str, ProtocolTotals>,
    cycles: Vec<CycleReport>,
    injected: Option<Injected>,
    starts_that_waited_for_a_port: u64,
    clean_shutdown: bool,
    progress: Progress,
}

impl Run<'_> {
    /// All cycles, then the final verification and SIGTERM. Returns whether every cycle ran
    /// (false: time limit). Stops after the first verification that finds a failure.
    fn all_cycles(&mut self) -> Result<bool> {
        let deadline = self.started + self.args.time_limit;
        for cycle in 0..self.args.cycles {
            if Instant::now() >= deadline {
                return Ok(false);
            }
            let daemon = self.start(&format!("cycle {cycle}"))?;
            // Checks what the previous cycle left (cycle 0: the fresh, all-zero file).
            if !self.verify(&daemon, cycle.checked_sub(1))? {
                self.clean_shutdown = daemon.terminate()?.success();
                return Ok(true);
            }
            let report = self.write_and_kill(daemon, cycle)?;
            if self.args.inject.is_some() && cycle == self.args.inject_cycle {
                self.inject(cycle)?;
            }
            self.progress.cycle(&report, self.args.cycles, &self.checks);
            self.cycles.push(report);
        }
        let daemon = self.start("final verification")?;
        if self.verify(&daemon, Some(self.args.cycles - 1))? {
            self.clean_shutdown = daemon.terminate()?.success();
        }
        Ok(true)
    }

    fn start(&mut self, label: &str) -> Result<Daemon> {
        let daemon = Daemon::start(&self.config, self.ports, label)?;
        self.ports = daemon.ports;
        self.starts_that_waited_for_a_port += u64::from(daemon.waited_for_port);
        Ok(daemon)
    }

    /// Verifies the model through `daemon`; false when a block failed.
    fn verify(&mut self, daemon: &Daemon, checked_cycle: Option<u64>) -> Result<bool> {
        let address = Ports::address(daemon.ports.native);
        let verification: Verification = verify::verify_and_settle(address, &mut self.model)
            .with_context(|| format!("verifying after {}", describe_cycle(checked_cycle)))?;
        self.checks.blocks_verified += verification.checked(Category::Durable);
        self.checks.blocks_unflushed_checked += verification.checked(Category::Unflushed);
        self.checks.blocks_unchanged_checked += verification.checked(Category::Unchanged);
        self.checks.lost_blocks += verification.failures.len() as u64;
        for failure in &verification.failures {
            *self
                .failure_kinds
                .entry(failure.kind.name().to_string())
                .or_default() += 1;
        }
        let cycle = checked_cycle.unwrap_or(0);
        let room = FAILURES_LISTED_MAX.saturating_sub(self.failures.len());
        self.failures
            .extend(
                verification
                    .failures
                    .iter()
                    .take(room)
                    .map(|failure| FailureReport {
                        cycle,
                        failure: failure.clone(),
                    }),
            );
        Ok(verification.failures.is_empty())
    }

    /// Runs the writers of `cycle` against `daemon` and kills it mid-write.
    fn write_and_kill(&mut self, daemon: Daemon, cycle: u64) -> Result<CycleReport> {
        let args = self.args;
        let writers = 3 * args.connections;
        let region_blocks = self.model.block_count() / writers as u64;
        let kill_delay = Duration::from_micros(below(
            &mut self.rng,
            args.kill_window.as_micros() as u64 + 1,
        ));
        let writers_start = Instant::now();
        let plans: Vec<WriterPlan> = (0..writers)
            .map(|writer_index| {
                let protocol = Protocol::ALL[writer_index % 3];
                let port = match protocol {
                    Protocol::Native => daemon.ports.native,
                    Protocol::Original => daemon.ports.original,
                    Protocol::Nbd => daemon.ports.nbd,
                };
                WriterPlan {
                    writer_index,
                    protocol,
                    address: Ports::address(port),
                    cycle,
                    run_tag: self.model.run_tag(),
                    seed: self.seed,
                    first_block: writer_index as u64 * region_blocks,
                    region_blocks,
                    queue_depth: args.queue_depth,
                    blocks_max: WRITER_BLOCKS_FACTOR * args.blocks_per_cycle + WRITER_BLOCKS_SLACK,
                    fua_percent: args.fua_percent,
                    flush_percent: args.flush_percent,
                    deadline: writers_start + CYCLE_TIMEOUT,
                }
            })
            .collect();
        let shared = Shared::default();
        let (kill, reports) = std::thread::scope(|scope| {
            let handles: Vec<_> = plans
                .iter()
                .map(|plan| scope.spawn(|| writer::run(plan, &shared)))
                .collect();
            let threshold_deadline = writers_start + CYCLE_TIMEOUT;
            while shared.acknowledged_blocks.load(Ordering::SeqCst) < args.blocks_per_cycle
                && Instant::now() < threshold_deadline
                && !handles.iter().all(|handle| handle.is_finished())
            {
                std::thread::sleep(Duration::from_micros(500));
            }
            std::thread::sleep(kill_delay);
            let in_flight_at_kill = shared.in_flight.load(Ordering::SeqCst);
            let kill_after = writers_start.elapsed();
            let killed = daemon.kill();
            shared.stop.store(true, Ordering::SeqCst);
            let reports: Vec<_> = handles
                .into_iter()
                .map(|handle| match handle.join() {
                    Ok(report) => report,
                    Err(panic) => std::panic::resume_unwind(panic),
                })
                .collect();
            (killed.map(|()| (in_flight_at_kill, kill_after)), reports)
        });
        let (in_flight_at_kill, kill_after) =
            kill.with_context(|| format!("cycle {cycle}: killing reflexd"))?;
        let mut logs = Vec::with_capacity(reports.len());
        let mut writers_finished_before_kill = 0;
        let mut errors = 0;
        for (plan, report) in plans.iter().zip(reports) {
            let report = report.with_context(|| {
                format!(
                    "cycle {cycle}: writer {} ({})",
                    plan.writer_index,
                    plan.protocol.name()
                )
            })?;
            tracing::debug!(cycle, writer = plan.writer_index, protocol = plan.protocol.name(), end = ?report.end, "writer ended");
            if report.end == WriterEnd::Finished {
                writers_finished_before_kill += 1;
            }
            errors += report.errors;
            logs.push(report.log);
        }
        let outcomes = self.model.record_cycle(&logs);
        let mut report = CycleReport {
            cycle,
            kill_after_ms: kill_after.as_millis() as u64,
            in_flight_at_kill,
            blocks_written: 0,
            writes_durable: 0,
            writers_finished_before_kill,
            errors,
        };
        for (plan, outcome) in plans.iter().zip(&outcomes) {
            self.protocols
                .entry(plan.protocol.name())
                .or_default()
                .add(outcome);
            report.blocks_written += outcome.blocks_written;
            report.writes_durable += outcome.writes_durable;
        }
        Ok(report)
    }

    /// The negative control: damages one durable block in the backing file (reflexd is dead).
    fn inject(&mut self, cycle: u64) -> Result<()> {
        let Some(kind) = self.args.inject else {
            return Ok(());
        };
        let durable: Vec<_> = self.model.durable_blocks().collect();
        if durable.len() < 2 {
            bail!("negative control: cycle {cycle} left fewer than 2 durable blocks to damage");
        }
        // A stale block is most telling when its previous content is an older write.
        let overwritten: Vec<_> = durable
            .iter()
            .copied()
            .filter(|(block, _)| matches!(self.model.baseline(*block), Some(Content::Write(_))))
            .collect();
        let candidates = if kind == Injection::Stale && !overwritten.is_empty() {
            &overwritten
        } else {
            &durable
        };
        let (block, _) = candidates[below(&mut self.rng, candidates.len() as u64) as usize];
        let mut bytes = vec![0u8; BLOCK_SIZE_BYTES];
        let run_tag = self.model.run_tag();
        let content_of = |block: u64, content: Content, bytes: &mut [u8]| match content {
            Content::Zero => bytes.fill(0),
            Content::Write(write_id) => encode(
                &BlockHeader {
                    run_tag,
                    block,
                    write_id,
                    protocol: Protocol::ALL[write_id.writer_index() % 3],
                    fua: false,
                },
                bytes,
            ),
        };
        match kind {
            Injection::Garbage => self.rng.fill_bytes(&mut bytes),
            Injection::Stale => {
                let baseline = self
                    .model
                    .baseline(block)
                    .context("negative control: the block's previous content is unknown")?;
                content_of(block, baseline, &mut bytes);
            }
            Injection::Misplaced => {
                let (other, other_id) = durable
                    .iter()
                    .copied()
                    .find(|(other, _)| *other != block)
                    .context("a second durable block")?;
                content_of(other, Content::Write(other_id), &mut bytes);
            }
        }
        let file = std::fs::File::options()
            .write(true)
            .open(&self.config.backing_file)
            .with_context(|| format!("opening {}", self.config.backing_file.display()))?;
        file.write_all_at(&bytes, block * BLOCK_SIZE_BYTES as u64)?;
        file.sync_data()?;
        self.injected = Some(Injected { kind, cycle, block });
        Ok(())
    }

    fn summary(&self, complete: bool, reflexd: &std::path::Path) -> Summary {
        let totals =
            self.protocols
                .values()
                .fold(ProtocolTotals::default(), |mut sum, protocol| {
                    sum.writes += protocol.writes;
                    sum.blocks_written += protocol.blocks_written;
                    sum.writes_acknowledged += protocol.writes_acknowledged;
                    sum.writes_durable += protocol.writes_durable;
                    sum
                });
        let in_flight = self.cycles.iter().map(|cycle| cycle.in_flight_at_kill);
        let kill_after = self.cycles.iter().map(|cycle| cycle.kill_after_ms);
        Summary {
            seed: self.seed,
            reflexd: reflexd.display().to_string(),
            dir: self.args.dir.display().to_string(),
            cycles_requested: self.args.cycles,
            cycles_completed: self.cycles.len() as u64,
            complete: complete && self.cycles.len() as u64 == self.args.cycles,
            device_size_bytes: self.args.device_size,
            blocks_per_cycle: self.args.blocks_per_cycle,
            kill_window_ms: self.args.kill_window.as_millis() as u64,
            threads: self.args.threads,
            connections_per_protocol: self.args.connections,
            queue_depth: self.args.queue_depth,
            blocks_written: totals.blocks_written,
            writes: totals.writes,
            writes_acknowledged: totals.writes_acknowledged,
            writes_durable: totals.writes_durable,
            checks: self.checks,
            failure_kinds: self.failure_kinds.clone(),
            failures: self.failures.clone(),
            protocols: self.protocols.clone(),
            kills_with_requests_in_flight: self
                .cycles
                .iter()
                .filter(|cycle| cycle.in_flight_at_kill > 0)
                .count() as u64,
            in_flight_at_kill_min: in_flight.clone().min().unwrap_or(0),
            in_flight_at_kill_max: in_flight.max().unwrap_or(0),
            kill_after_ms_min: kill_after.clone().min().unwrap_or(0),
            kill_after_ms_max: kill_after.max().unwrap_or(0),
            writers_finished_before_kill: self
                .cycles
                .iter()
                .map(|cycle| cycle.writers_finished_before_kill)
                .sum(),
            request_errors: self.cycles.iter().map(|cycle| cycle.errors).sum(),
            starts_that_waited_for_a_port: self.starts_that_waited_for_a_port,
            clean_shutdown: self.clean_shutdown,
            injected: self.injected.clone(),
            duration_secs: self.started.elapsed().as_secs_f64(),
        }
    }
}

fn describe_cycle(cycle: Option<u64>) -> String {
    match cycle {
        Some(cycle) => format!("cycle {cycle}"),
        None => "creating the file".to_string(),
    }
}

fn print_summary(summary: &Summary) {
    let checks = &summary.checks;
    println!(
        "crash-test: seed {}, {} of {} cycles{}, {:.1} s",
        summary.seed,
        summary.cycles_completed,
        summary.cycles_requested,
        if summary.complete {
            ""
        } else {
            " (incomplete)"
        },
        summary.duration_secs
    );
    println!(
        "  written: {} blocks in {} writes ({} acknowledged, {} durable)",
        summary.blocks_written, summary.writes, summary.writes_acknowledged, summary.writes_durable
    );
    for (name, protocol) in &summary.protocols {
        println!(
            "    {name:>8}: {} writes, {} blocks, {} FUA, {} of {} FLUSHes completed, {} durable",
            protocol.writes,
            protocol.blocks_written,
            protocol.fua_writes,
            protocol.flushes_completed,
            protocol.flushes,
            protocol.writes_durable
        );
    }
    println!(
        "  kills: {} with requests in flight ({}..={} in flight), {}..={} ms after the writers started",
        summary.kills_with_requests_in_flight,
        summary.in_flight_at_kill_min,
        summary.in_flight_at_kill_max,
        summary.kill_after_ms_min,
        summary.kill_after_ms_max
    );
    println!(
        "  verified: {} durable blocks, {} unflushed blocks, {} unchanged blocks checked",
        checks.blocks_verified, checks.blocks_unflushed_checked, checks.blocks_unchanged_checked
    );
    println!("  lost: {}", checks.lost_blocks);
    for report in &summary.failures {
        let failure = &report.failure;
        println!(
            "    after cycle {}: block {} (offset {}): {}, in a {} block: expected {}, found {}",
            report.cycle,
            failure.block,
            failure.offset_bytes,
            failure.kind.name(),
            failure.category.name(),
            failure.expected,
            failure.found
        );
    }
    if let Some(injected) = &summary.injected {
        println!(
            "  negative control: {} written over block {} after cycle {}",
            injected.kind.description(),
            injected.block,
            injected.cycle
        );
    }
    println!(
        "  restarts: {} waited for a port the killed reflexd still held; clean shutdown at the end: {}",
        summary.starts_that_waited_for_a_port, summary.clean_shutdown
    );
}

/// Per-cycle progress on stderr: one rewritten line on a terminal, a line per cycle otherwise.
struct Progress {
    quiet: bool,
    terminal: bool,
    started: Instant,
}

impl Progress {
    fn new(quiet: bool) -> Progress {
        Progress {
            quiet,
            terminal: std::io::stderr().is_terminal(),
            started: Instant::now(),
        }
    }

    fn cycle(&self, report: &CycleReport, cycles: u64, checks: &CheckTotals) {
        if self.quiet {
            return;
        }
        let line = format!(
            "cycle {}/{cycles}: {} blocks written, {} writes durable, killed at {} ms with {} in flight; verified so far {} durable blocks, {} lost ({:.0} s)",
            report.cycle + 1,
            report.blocks_written,
            report.writes_durable,
            report.kill_after_ms,
            report.in_flight_at_kill,
            checks.blocks_verified,
            checks.lost_blocks,
            self.started.elapsed().as_secs_f64()
        );
        let mut stderr = std::io::stderr().lock();
        if self.terminal {
            let _ = write!(stderr, "\r\x1b[K{line}");
        } else {
            let _ = writeln!(stderr, "{line}");
        }
        let _ = stderr.flush();
    }

    fn finish(&self) {
        if self.terminal && !self.quiet {
            eprintln!();
        }
    }
}

fn seed_from_clock() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64);
    splitmix(nanos ^ u64::from(std::process::id()))
}

/// The run tag stored in every block, and the clock seed's mixer.
fn splitmix(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
