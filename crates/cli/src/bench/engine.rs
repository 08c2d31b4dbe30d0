//! The load engine: bench threads, each driving its channels (connections to a server over
//! the native protocol or NBD, or queues on a local file) from one io_uring loop.
//!
//! Why one loop per thread and nothing shared: the bench must drive hundreds of thousands of
//! requests per second per core. A thread's loop reads the clock once per iteration, issues
//! every request that is due (closed loop: whenever a slot is free; open loop: when a Poisson
//! arrival's intended time has passed and a slot is free), arms one send and one receive per
//! connection, and enters the kernel once. Requests live in fixed slots allocated before the
//! run; payloads are written straight into the connection's transmit buffer; responses are
//! parsed in place. Threads share nothing but a channel for once-per-second progress.
//!
//! Latency is measured from the *intended* send time: in the open loop that is the arrival
//! time drawn from the Poisson process, even if the request had to wait for a free slot, so a
//! slow server cannot hide its queueing by slowing the client (no coordinated omission). In
//! the closed loop the intended time is when the slot became free.
//!
//! Bounds: every run stops issuing at `warmup + duration` (or when its operation quota is
//! met), then waits at most [`DRAIN_WAIT_MAX`] for answers; the `--verify` fill is bounded by
//! [`FILL_TIME_MAX`].

use std::fs::File;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Barrier, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_client::{ClientOptions, ConnectionCore, PipelinedClient, REPORT_REQUEST_ID};
use reflex_proto::native::ReportBody;

use super::nbd;
use super::pattern::{self, Mismatch};
use super::stats::Latency;
use super::uring::{self, Event, Reactor};
use super::wire::Wire;
use super::workload::{Arrivals, FillGenerator, Op, OpGenerator, OpKind, WorkloadSpec};

/// Longest wait for outstanding answers after issuing stopped.
pub const DRAIN_WAIT_MAX: Duration = Duration::from_secs(10);
/// Longest `--verify` fill.
pub const FILL_TIME_MAX: Duration = Duration::from_secs(600);
/// How often threads report progress.
const PROGRESS_INTERVAL_NS: u64 = 1_000_000_000;
/// Largest queue depth per channel (slot index must fit the request id and user_data).
pub const QUEUE_DEPTH_MAX: u32 = 4096;

/// Where the load goes.
#[derive(Debug, Clone)]
pub enum Target {
    Remote {
        address: SocketAddr,
        namespace: u32,
    },
    /// An NBD server's export (empty name: the server's default export).
    Nbd {
        address: SocketAddr,
        export: String,
    },
    Local {
        /// Opened once; each thread uses a clone of the descriptor.
        file: std::sync::Arc<File>,
    },
}

/// How requests are paced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// Keep `queue_depth` requests in flight per channel.
    Closed { queue_depth: u32 },
    /// Poisson arrivals at `rate_per_sec` in total, at most `queue_depth_max` in flight per
    /// channel (later arrivals wait, and their wait counts in their latency).
    Open {
        rate_per_sec: f64,
        queue_depth_max: u32,
    },
}

impl Load {
    pub fn queue_depth_max(&self) -> u32 {
        match *self {
            Load::Closed { queue_depth } => queue_depth,
            Load::Open {
                queue_depth_max, ..
            } => queue_depth_max,
        }
    }
}

/// Measuring, or writing the `--verify` pattern over the whole range first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Measure,
    Fill { chunk_bytes: u32 },
}

/// One engine run: one row of results (or the fill).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub target: Target,
    pub threads: usize,
    pub channels_per_thread: usize,
    pub load: Load,
    pub workload: WorkloadSpec,
    pub phase: Phase,
    pub seed: u64,
    /// `Some(seed)`: writes carry the pattern, reads are checked against it.
    pub verify_seed: Option<u64>,
    pub warmup: Duration,
    pub duration: Duration,
    /// Measured operations to issue in total (split over channels); `None`: no limit.
    pub ops_max: Option<u64>,
    /// Busy-poll the ring instead of sleeping in it.
    pub spin: bool,
    /// Pin bench thread `i` to `cpus[i % cpus.len()]`.
    pub cpus: Vec<usize>,
    /// Remote target: connection `k` (counted over all threads) BINDs to
    /// `bind_handles[k % len]` before the run; empty: no BIND.
    pub bind_handles: Vec<u64>,
    /// A server process on this machine whose CPU time (all its threads, from
    /// `/proc/PID/task/*/schedstat`) thread 0 reads at the start and end of the measurement.
    pub server_pid: Option<u32>,
    /// Shell commands thread 0 runs (and waits for) when the measurement starts and when it
    /// ends, e.g. zeroing and dumping a profiler's counters of the server.
    pub measure_hooks: MeasureHooks,
    /// Open loop: RENEGOTIATE device notices set the rate to `FOLLOW_MARGIN` × the granted
    /// share of `rate_per_sec` (and back to all of it when the device recovers).
    pub follow_notices: bool,
    /// Record the measured operations and read latencies per interval of this length.
    pub timeline: Option<Duration>,
    /// Native target, a latency-critical tenant: every this long, REPORT the p95 of the reads
    /// answered since the last report (warm-up included) on the first connection, so the
    /// server's self-calibration learns what the network and this client add.
    pub report_interval: Option<Duration>,
}

/// A client following a notice sends this share of its grant: a Poisson source at exactly its
/// token rate queues behind its own bursts (the simulator's `FOLLOW_MARGIN`).
pub const FOLLOW_MARGIN: f64 = reflex_sim::engine::FOLLOW_MARGIN;

/// One interval of the measurement (`EngineConfig::timeline`).
#[derive(Clone, Default)]
pub struct TimelineSample {
    /// End of the interval, from the start of the measurement.
    pub end_ns: u64,
    /// Measured operations answered OK in the interval.
    pub ops: u64,
    pub read: Latency,
}

/// Commands run at the edges of the measurement (`reflex bench --at-measure-start/-end`).
#[derive(Debug, Clone, Default)]
pub struct MeasureHooks {
    pub start: Option<String>,
    pub end: Option<String>,
}

/// Runs `command` with `sh -c` and waits for it; fails on a non-zero exit.
fn run_hook(command: &str) -> Result<()> {
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(())
}

/// Once-per-second report of one thread.
pub struct Progress {
    pub thread_index: usize,
    /// Operations completed since the thread started (warm-up included).
    pub completed_ops: u64,
    /// Latencies recorded since the previous report.
    pub interval: Latency,
}

/// What one thread (or, merged, the run) measured.
#[derive(Clone, Default)]
pub struct Outcome {
    pub read: Latency,
    pub write: Latency,
    /// Measured operations answered OK.
    pub measured_ops: u64,
    /// Bytes moved by those operations.
    pub measured_bytes: u64,
    /// From the end of warm-up to the end of the measurement (the duration, or the last
    /// answer when the operation quota ran out first).
    pub measured_ns: u64,
    /// Operations answered with an error or failed by the device.
    pub errors: u64,
    pub first_error: Option<String>,
    pub mismatches: u64,
    pub first_mismatch: Option<Mismatch>,
    /// Open loop: arrivals due before the end that never found a free slot (the server fell
    /// behind the target rate). They are not in the latency figures.
    pub unissued_ops: u64,
    /// RENEGOTIATE notices the server sent on the connections (not answers to requests).
    pub notices: u64,
    /// CPU time of `EngineConfig::server_pid` during the measurement, in ns.
    pub server_cpu_ns: Option<u64>,
    /// Per interval, when `EngineConfig::timeline` asks for it.
    pub timeline: Vec<TimelineSample>,
}

impl Outcome {
    pub fn merge(&mut self, other: &Outcome) {
        self.read.add(&other.read);
        self.write.add(&other.write);
        self.measured_ops += other.measured_ops;
        self.measured_bytes += other.measured_bytes;
        self.measured_ns = self.measured_ns.max(other.measured_ns);
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error.clone_from(&other.first_error);
        }
        self.mismatches += other.mismatches;
        if self.first_mismatch.is_none() {
            self.first_mismatch = other.first_mismatch;
        }
        self.unissued_ops += other.unissued_ops;
        self.notices += other.notices;
        self.server_cpu_ns = self.server_cpu_ns.or(other.server_cpu_ns);
        if self.timeline.len() < other.timeline.len() {
            self.timeline
                .resize(other.timeline.len(), TimelineSample::default());
        }
        for (mine, theirs) in self.timeline.iter_mut().zip(&other.timeline) {
            mine.end_ns = theirs.end_ns;
            mine.ops += theirs.ops;
            mine.read.add(&theirs.read);
        }
    }
}

/// Connects one pipelined connection for the bench and hands over its parts.
pub fn connect_channel(address: SocketAddr) -> Result<(TcpStream, ConnectionCore)> {
    let client = PipelinedClient::connect_with(address, &ClientOptions::default())
        .with_context(|| format!("connecting to {address}"))?;
    let (stream, core, _capabilities) = client.into_parts();
    Ok((stream, core))
}

/// Connects one pipelined connection, BINDs it to the tenant `handle` and hands over its parts.
pub fn connect_bound_channel(
    address: SocketAddr,
    handle: u64,
) -> Result<(TcpStream, ConnectionCore)> {
    let mut client = reflex_client::Client::connect_with(address, &ClientOptions::default())
        .with_context(|| format!("connecting to {address}"))?;
    client
        .bind(handle)
        .with_context(|| format!("BIND to tenant handle {handle}"))?;
    let (stream, core, _capabilities) = client.into_pipelined().into_parts();
    Ok((stream, core))
}

/// CPU time of process `pid` in ns: the sum over its live threads of the first field of
/// `/proc/PID/task/*/schedstat` (the scheduler's exact run time, steal excluded).
pub fn process_cpu_ns(pid: u32) -> Result<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("reading the threads of process {pid}"))?;
    let mut total = 0u64;
    for task in tasks {
        let path = task?.path().join("schedstat");
        // A thread may exit between the listing and the read: skip it.
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let field = text.split_whitespace().next().unwrap_or("0");
        total += field
            .parse::<u64>()
            .with_context(|| format!("parsing {}", path.display()))?;
    }
    Ok(total)
}

/// Runs the engine: all threads, then their merged outcome.
pub fn run(config: &EngineConfig, progress: Option<&mpsc::Sender<Progress>>) -> Result<Outcome> {
    // Connections are made before any thread starts, so a refused connection fails the run
    // before load begins.
    let mut per_thread_connections: Vec<Vec<(TcpStream, Wire)>> = Vec::new();
    for _ in 0..config.threads {
        let mut connections = Vec::new();
        for _ in 0..config.channels_per_thread {
            match &config.target {
                Target::Remote { address, namespace } => {
                    let connection_index = per_thread_connections.len()
                        * config.channels_per_thread
                        + connections.len();
                    let (stream, core) = match config.bind_handles.as_slice() {
                        [] => connect_channel(*address)?,
                        handles => connect_bound_channel(
                            *address,
                            handles[connection_index % handles.len()],
                        )?,
                    };
                    let namespace = *namespace;
                    connections.push((stream, Wire::Native { core, namespace }));
                }
                Target::Nbd { address, export } => {
                    let (stream, core, _) = nbd::connect(*address, export)?;
                    connections.push((stream, Wire::Nbd(core)));
                }
                Target::Local { .. } => break,
            }
        }
        per_thread_connections.push(connections);
    }
    run_with_wires(config, per_thread_connections, progress)
}

/// Runs the engine on native connections the caller made (`connections[thread]`, one per
/// channel), e.g. connections that REGISTERed and BOUND to a tenant first (`reflex bench
/// --scenario`). The target must be [`Target::Remote`].
pub fn run_with_connections(
    config: &EngineConfig,
    per_thread_connections: Vec<Vec<(TcpStream, ConnectionCore)>>,
    progress: Option<&mpsc::Sender<Progress>>,
) -> Result<Outcome> {
    let Target::Remote { namespace, .. } = config.target else {
        bail!("native connections need a native target");
    };
    let wires = per_thread_connections
        .into_iter()
        .map(|connections| {
            connections
                .into_iter()
                .map(|(stream, core)| (stream, Wire::Native { core, namespace }))
                .collect()
        })
        .collect();
    run_with_wires(config, wires, progress)
}

/// Runs the engine on connected channels (`connections[thread]`, one per channel; empty
/// lists for a local target).
fn run_with_wires(
    config: &EngineConfig,
    per_thread_connections: Vec<Vec<(TcpStream, Wire)>>,
    progress: Option<&mpsc::Sender<Progress>>,
) -> Result<Outcome> {
    assert!(config.threads >= 1);
    assert!(config.channels_per_thread >= 1);
    let queue_depth_max = config.load.queue_depth_max();
    assert!((1..=QUEUE_DEPTH_MAX).contains(&queue_depth_max));
    let stream_count = (config.threads * config.channels_per_thread) as u64;
    assert_eq!(per_thread_connections.len(), config.threads);
    if !matches!(config.target, Target::Local { .. }) {
        for connections in &per_thread_connections {
            assert_eq!(connections.len(), config.channels_per_thread);
        }
    }

    let barrier = Barrier::new(config.threads);
    let outcomes: Vec<Result<Outcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> = per_thread_connections
            .into_iter()
            .enumerate()
            .map(|(thread_index, connections)| {
                let barrier = &barrier;
                let progress = progress.cloned();
                std::thread::Builder::new()
                    .name(format!("bench-{thread_index}"))
                    .spawn_scoped(scope, move || {
                        let thread =
                            ThreadRun::new(config, thread_index, stream_count, connections);
                        // Every thread reaches the barrier, even one that failed to set up.
                        barrier.wait();
                        thread?.run(progress.as_ref())
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| match handle {
                Ok(handle) => handle
                    .join()
                    .unwrap_or_else(|_| Err(anyhow!("bench thread panicked"))),
                Err(error) => Err(anyhow!("cannot start bench thread: {error}")),
            })
            .collect()
    });
    let mut total = Outcome::default();
    for outcome in outcomes {
        total.merge(&outcome?);
    }
    Ok(total)
}

/// One in-flight request.
#[derive(Debug, Clone, Copy)]
struct Slot {
    op: Op,
    intended_ns: u64,
    measured: bool,
}

enum Source {
    Workload(OpGenerator),
    Fill(FillGenerator),
}

struct Channel {
    stream_index: u64,
    source: Source,
    arrivals: Option<Arrivals>,
    /// Free slot indices (within this channel).
    free_slots: Vec<u32>,
    slots: Vec<Slot>,
    in_flight: usize,
    queue_depth: usize,
    /// Measured operations this channel may still issue.
    quota_remaining: Option<u64>,
    /// Issues nothing more (quota met, fill done, or past the end).
    finished: bool,
    /// Finished because the quota ran out, not because time did.
    quota_met: bool,
}

struct ThreadRun<'a> {
    config: &'a EngineConfig,
    thread_index: usize,
    reactor: Reactor,
    channels: Vec<Channel>,
    /// Random payload for writes without `--verify`.
    payload: Vec<u8>,
    outcome: Outcome,
    interval: Latency,
    /// The timeline interval being filled.
    timeline_current: TimelineSample,
    completed_ops: u64,
    last_measured_ns: u64,
    events: Vec<Event>,
    remote: bool,
    /// Read latencies since the last REPORT.
    report_reads: Latency,
    /// When the next REPORT is due (`None`: the run does not report).
    next_report_ns: Option<u64>,
}

impl<'a> ThreadRun<'a> {
    fn new(
        config: &'a EngineConfig,
        thread_index: usize,
        stream_count: u64,
        mut connections: Vec<(TcpStream, Wire)>,
    ) -> Result<ThreadRun<'a>> {
        if let Some(cpu) = config
            .cpus
            .get(thread_index % config.cpus.len().max(1))
            .copied()
        {
            uring::pin_current_thread(cpu).with_context(|| format!("pinning to CPU {cpu}"))?;
        }
        let _ = uring::set_timer_slack_ns(1);
        let queue_depth = config.load.queue_depth_max() as usize;
        let io_size_max = match config.phase {
            Phase::Measure => config.workload.io_size_bytes,
            Phase::Fill { chunk_bytes } => chunk_bytes,
        };
        let channel_count = config.channels_per_thread;
        let (remote, file) = match &config.target {
            Target::Remote { .. } | Target::Nbd { .. } => (true, None),
            Target::Local { file } => {
                let file = file
                    .try_clone()
                    .context("duplicating the local file descriptor")?;
                (
                    false,
                    Some((file, channel_count * queue_depth, io_size_max as usize)),
                )
            }
        };
        // A REPORT is one request beyond the slots.
        let reserved = queue_depth + usize::from(config.report_interval.is_some());
        for (_, core) in &mut connections {
            core.reserve(reserved, io_size_max);
        }
        let entries = (channel_count * (queue_depth + 2) + 8) as u32;
        let mut reactor =
            Reactor::new(entries, connections, file).context("setting up io_uring")?;

        let mut payload = vec![0u8; io_size_max as usize];
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(config.seed ^ thread_index as u64);
        rng.fill_bytes(&mut payload);
        if !remote {
            // Local writes without --verify send whatever the slot holds: make it random.
            for slot in 0..channel_count * queue_depth {
                reactor
                    .slot_buffer(slot, payload.len())
                    .copy_from_slice(&payload);
            }
        }

        let channels = (0..channel_count)
            .map(|channel_index| {
                let stream_index = (thread_index * channel_count + channel_index) as u64;
                Channel::new(config, stream_index, stream_count, queue_depth)
            })
            .collect();
        Ok(ThreadRun {
            config,
            thread_index,
            reactor,
            channels,
            payload,
            outcome: Outcome::default(),
            interval: Latency::new(),
            timeline_current: TimelineSample::default(),
            completed_ops: 0,
            last_measured_ns: 0,
            events: Vec::with_capacity(entries as usize * 2),
            remote,
            report_reads: Latency::new(),
            next_report_ns: config
                .report_interval
                .map(|interval| interval.as_nanos() as u64),
        })
    }

    fn run(mut self, progress: Option<&mpsc::Sender<Progress>>) -> Result<Outcome> {
        let start = Instant::now();
        let now_ns = |start: Instant| start.elapsed().as_nanos() as u64;
        let (warmup_ns, end_ns, drain_deadline_ns) = match self.config.phase {
            Phase::Measure => {
                let warmup_ns = self.config.warmup.as_nanos() as u64;
                let end_ns = warmup_ns + self.config.duration.as_nanos() as u64;
                (warmup_ns, end_ns, end_ns + DRAIN_WAIT_MAX.as_nanos() as u64)
            }
            Phase::Fill { .. } => {
                let end_ns = FILL_TIME_MAX.as_nanos() as u64;
                (0, end_ns, end_ns)
            }
        };
        for channel in &mut self.channels {
            channel.start(self.config, 0);
        }
        let mut next_progress_ns = PROGRESS_INTERVAL_NS;
        let timeline_step_ns = self
            .config
            .timeline
            .map(|step| step.as_nanos().max(1) as u64);
        let mut next_timeline_ns = timeline_step_ns.map_or(u64::MAX, |step| warmup_ns + step);
        let mut now = now_ns(start);
        // Thread 0 reads the server's CPU time when the measurement starts and ends.
        let server_pid = self
            .config
            .server_pid
            .filter(|_| self.thread_index == 0 && self.config.phase == Phase::Measure);
        let mut server_cpu_start: Option<u64> = None;
        let hooks = (self.thread_index == 0 && self.config.phase == Phase::Measure)
            .then_some(&self.config.measure_hooks);
        let (mut hook_started, mut hook_ended) = (false, false);
        loop {
            if let Some(hooks) = hooks {
                if !hook_started && now >= warmup_ns {
                    hook_started = true;
                    if let Some(command) = &hooks.start {
                        run_hook(command)?;
                    }
                }
                if hook_started && !hook_ended && now >= end_ns {
                    hook_ended = true;
                    if let Some(command) = &hooks.end {
                        run_hook(command)?;
                    }
                }
            }
            if let Some(pid) = server_pid {
                if server_cpu_start.is_none() && now >= warmup_ns {
                    server_cpu_start = Some(process_cpu_ns(pid)?);
                }
                if let (Some(start_ns), None, true) =
                    (server_cpu_start, self.outcome.server_cpu_ns, now >= end_ns)
                {
                    self.outcome.server_cpu_ns =
                        Some(process_cpu_ns(pid)?.saturating_sub(start_ns));
                }
            }
            if now >= end_ns {
                for channel in &mut self.channels {
                    channel.finished = true;
                }
            }
            for channel_index in 0..self.channels.len() {
                self.issue_due(channel_index, now, warmup_ns, end_ns)?;
            }
            self.report_due(now);
            let outstanding: usize = self.channels.iter().map(|c| c.in_flight).sum();
            let all_finished = self.channels.iter().all(|c| c.finished);
            if all_finished && outstanding == 0 {
                break;
            }
            if now >= drain_deadline_ns {
                match self.config.phase {
                    Phase::Measure => bail!(
                        "{outstanding} requests still unanswered {} s after the run ended",
                        DRAIN_WAIT_MAX.as_secs()
                    ),
                    Phase::Fill { .. } => {
                        bail!(
                            "--verify fill did not finish within {} s",
                            FILL_TIME_MAX.as_secs()
                        )
                    }
                }
            }
            if self.remote {
                for connection in 0..self.reactor.connection_count() {
                    self.reactor.arm_send(connection)?;
                    if self.channels[connection].in_flight > 0 {
                        self.reactor.arm_receive(connection)?;
                    }
                }
            }
            // Sleep until an answer arrives, the next arrival is due, the run ends or
            // progress is due; spinning only submits.
            let mut wake_ns = next_progress_ns
                .min(if all_finished {
                    drain_deadline_ns
                } else {
                    end_ns
                })
                .min(self.next_report_ns.unwrap_or(u64::MAX));
            for channel in &self.channels {
                let waiting_for_arrival =
                    !channel.finished && channel.in_flight < channel.queue_depth;
                if let (true, Some(arrivals)) = (waiting_for_arrival, &channel.arrivals) {
                    wake_ns = wake_ns.min(arrivals.next_ns());
                }
            }
            let want = usize::from(!self.config.spin);
            let timeout = Duration::from_nanos(wake_ns.saturating_sub(now).max(1));
            self.reactor.submit_and_wait(want, Some(timeout))?;
            now = now_ns(start);
            self.events.clear();
            self.reactor.reap(&mut self.events);
            self.handle_events(now)?;
            while now >= next_timeline_ns && next_timeline_ns <= end_ns {
                let mut sample = std::mem::take(&mut self.timeline_current);
                sample.end_ns = next_timeline_ns - warmup_ns;
                self.outcome.timeline.push(sample);
                next_timeline_ns += timeline_step_ns.unwrap_or(u64::MAX);
            }
            if now >= next_progress_ns {
                next_progress_ns = now + PROGRESS_INTERVAL_NS;
                if let Some(progress) = progress {
                    let _ = progress.send(Progress {
                        thread_index: self.thread_index,
                        completed_ops: self.completed_ops,
                        interval: self.interval.clone(),
                    });
                }
                self.interval.reset();
            }
        }
        // A run that met its operation quota before the end: the measurement ended now.
        if let (Some(hooks), true, false) = (hooks, hook_started, hook_ended)
            && let Some(command) = &hooks.end
        {
            run_hook(command)?;
        }
        if let (Some(pid), Some(start_ns), None) =
            (server_pid, server_cpu_start, self.outcome.server_cpu_ns)
        {
            self.outcome.server_cpu_ns = Some(process_cpu_ns(pid)?.saturating_sub(start_ns));
        }
        for channel in &mut self.channels {
            if channel.quota_met {
                continue;
            }
            if let Some(arrivals) = channel.arrivals.as_mut() {
                // Bounded: at most rate x duration arrivals exist before the end.
                while arrivals.next_ns() < end_ns {
                    self.outcome.unissued_ops += 1;
                    arrivals.advance();
                }
            }
        }
        let quota_met = self.channels.iter().all(|c| c.quota_met);
        let measure_end_ns = if quota_met {
            self.last_measured_ns.min(end_ns)
        } else {
            end_ns
        };
        self.outcome.measured_ns = measure_end_ns.saturating_sub(warmup_ns);
        Ok(std::mem::take(&mut self.outcome))
    }

    /// Issues every request of `channel_index` that is due at `now`.
    fn issue_due(
        &mut self,
        channel_index: usize,
        now: u64,
        warmup_ns: u64,
        end_ns: u64,
    ) -> Result<()> {
        let queue_depth = self.channels[channel_index].queue_depth;
        loop {
            let channel = &mut self.channels[channel_index];
            if channel.finished || channel.in_flight >= channel.queue_depth {
                return Ok(());
            }
            let intended_ns = match &channel.arrivals {
                Some(arrivals) if arrivals.next_ns() > now => return Ok(()),
                Some(arrivals) => arrivals.next_ns(),
                None => now,
            };
            if intended_ns >= end_ns {
                channel.finished = true;
                return Ok(());
            }
            let measured = intended_ns >= warmup_ns;
            if let (true, Some(remaining)) = (measured, channel.quota_remaining.as_mut()) {
                if *remaining == 0 {
                    channel.finished = true;
                    channel.quota_met = true;
                    return Ok(());
                }
                *remaining -= 1;
            }
            let op = match &mut channel.source {
                Source::Workload(generator) => generator.next_op(),
                Source::Fill(fill) => match fill.next_op() {
                    Some(op) => op,
                    None => {
                        channel.finished = true;
                        channel.quota_met = true;
                        return Ok(());
                    }
                },
            };
            if let Some(arrivals) = channel.arrivals.as_mut() {
                arrivals.advance();
            }
            let Some(slot_index) = channel.free_slots.pop() else {
                unreachable!("in_flight < queue_depth leaves a free slot");
            };
            channel.slots[slot_index as usize] = Slot {
                op,
                intended_ns,
                measured,
            };
            channel.in_flight += 1;
            let verify_seed = self.config.verify_seed;
            if self.remote {
                let payload = &self.payload;
                let core = self.reactor.core(channel_index);
                match op.kind {
                    OpKind::Read => {
                        core.submit_read(u64::from(slot_index), op.offset_bytes, op.length_bytes)?
                    }
                    OpKind::Write => core.submit_write_with(
                        u64::from(slot_index),
                        op.offset_bytes,
                        op.length_bytes,
                        |buf| match verify_seed {
                            Some(seed) => pattern::fill(seed, op.offset_bytes, buf),
                            None => buf.copy_from_slice(&payload[..buf.len()]),
                        },
                    )?,
                }
            } else {
                let slot = channel_index * queue_depth + slot_index as usize;
                let length = op.length_bytes as usize;
                if let (OpKind::Write, Some(seed)) = (op.kind, verify_seed) {
                    pattern::fill(
                        seed,
                        op.offset_bytes,
                        self.reactor.slot_buffer(slot, length),
                    );
                }
                self.reactor.submit_file(
                    slot,
                    op.kind == OpKind::Write,
                    op.offset_bytes,
                    length,
                )?;
            }
        }
    }

    fn handle_events(&mut self, now: u64) -> Result<()> {
        for event_index in 0..self.events.len() {
            match self.events[event_index] {
                Event::Sent { connection, result } => {
                    if result < 0 {
                        bail!(
                            "sending on connection {connection}: {}",
                            std::io::Error::from_raw_os_error(-result)
                        );
                    }
                }
                Event::Received { connection, result } => {
                    if result == 0 {
                        bail!("the server closed connection {connection}");
                    }
                    if result < 0 {
                        bail!(
                            "receiving on connection {connection}: {}",
                            std::io::Error::from_raw_os_error(-result)
                        );
                    }
                    self.complete_remote(connection, now)?;
                }
                Event::File { slot, result } => {
                    self.complete_local(slot, result, now)?;
                }
            }
        }
        Ok(())
    }

    fn complete_remote(&mut self, channel_index: usize, now: u64) -> Result<()> {
        let verify_seed = self.config.verify_seed;
        let core = self.reactor.core(channel_index);
        let channel = &mut self.channels[channel_index];
        let mut rate_factor = None;
        while let Some(answer) = core
            .poll_answer()
            .with_context(|| format!("bad answer on connection {channel_index}; closing it"))?
        {
            if answer.notice {
                self.outcome.notices += 1;
                if self.config.follow_notices
                    && let Some(share) = answer.granted_share
                {
                    rate_factor = Some(if share >= 1.0 {
                        1.0
                    } else {
                        (share * FOLLOW_MARGIN).max(0.01)
                    });
                }
                continue;
            }
            if answer.request_id == REPORT_REQUEST_ID {
                continue;
            }
            let Some(slot) = usize::try_from(answer.request_id)
                .ok()
                .and_then(|index| channel.slots.get(index))
                .copied()
            else {
                bail!(
                    "answer for request id {} that the bench never used",
                    answer.request_id
                );
            };
            let mismatch = match (verify_seed, slot.op.kind, &answer.failure) {
                (Some(seed), OpKind::Read, None) => {
                    pattern::check(seed, slot.op.offset_bytes, answer.data)
                }
                _ => None,
            };
            let failure = answer.failure;
            if slot.op.kind == OpKind::Read && failure.is_none() {
                self.report_reads
                    .record(now.saturating_sub(slot.intended_ns));
            }
            channel.free_slots.push(answer.request_id as u32);
            channel.in_flight -= 1;
            let measured = record(
                &mut self.outcome,
                &mut self.interval,
                &mut self.last_measured_ns,
                slot,
                now,
                failure,
                mismatch,
            );
            add_to_timeline(&mut self.timeline_current, measured);
            self.completed_ops += 1;
        }
        // Every connection of the tenant gets the notice: each paces its own arrivals.
        if let (Some(factor), Some(arrivals)) = (rate_factor, channel.arrivals.as_mut()) {
            arrivals.set_rate_factor(factor);
        }
        Ok(())
    }

    /// Sends a REPORT when one is due and reads were answered since the last, with the
    /// requests due and not yet sent; one that cannot go now (full window) leaves its reads to
    /// the next.
    fn report_due(&mut self, now: u64) {
        let (Some(due_ns), Some(interval)) = (self.next_report_ns, self.config.report_interval)
        else {
            return;
        };
        if now < due_ns || !self.remote {
            return;
        }
        self.next_report_ns = Some(now + interval.as_nanos() as u64);
        let reads = self.report_reads.count();
        if reads == 0 {
            return;
        }
        let backlog: u64 = self
            .channels
            .iter()
            .filter_map(|channel| channel.arrivals.as_ref())
            .map(|arrivals| arrivals.due_by(now))
            .sum();
        let report = ReportBody {
            reads: u32::try_from(reads).unwrap_or(u32::MAX),
            read_p95_us: self.report_reads.quantile_us(0.95).round() as u32,
            backlog: u32::try_from(backlog).unwrap_or(u32::MAX),
        };
        if self.reactor.core(0).submit_report(&report) {
            self.report_reads.reset();
        }
    }

    fn complete_local(&mut self, slot_global: usize, result: i32, now: u64) -> Result<()> {
        let queue_depth = self.channels.first().map_or(1, |c| c.queue_depth);
        let channel_index = slot_global / queue_depth;
        let slot_index = slot_global % queue_depth;
        let Some(channel) = self.channels.get_mut(channel_index) else {
            bail!("completion for unknown slot {slot_global}");
        };
        let slot = channel.slots[slot_index];
        let length = slot.op.length_bytes as usize;
        let failure = if result < 0 {
            Some(format!(
                "{:?} at {}: {}",
                slot.op.kind,
                slot.op.offset_bytes,
                std::io::Error::from_raw_os_error(-result)
            ))
        } else if result as usize != length {
            Some(format!(
                "{:?} at {}: {result} of {length} bytes (beyond the end of the file?)",
                slot.op.kind, slot.op.offset_bytes
            ))
        } else {
            None
        };
        channel.free_slots.push(slot_index as u32);
        channel.in_flight -= 1;
        let mismatch = match (self.config.verify_seed, slot.op.kind, &failure) {
            (Some(seed), OpKind::Read, None) => pattern::check(
                seed,
                slot.op.offset_bytes,
                self.reactor.slot_buffer(slot_global, length),
            ),
            _ => None,
        };
        let measured = record(
            &mut self.outcome,
            &mut self.interval,
            &mut self.last_measured_ns,
            slot,
            now,
            failure,
            mismatch,
        );
        add_to_timeline(&mut self.timeline_current, measured);
        self.completed_ops += 1;
        Ok(())
    }
}

/// Accounts one answered request; a measured one answered OK is returned with its latency.
fn record(
    outcome: &mut Outcome,
    interval: &mut Latency,
    last_measured_ns: &mut u64,
    slot: Slot,
    now: u64,
    failure: Option<String>,
    mismatch: Option<Mismatch>,
) -> Option<(OpKind, u64)> {
    let latency_ns = now.saturating_sub(slot.intended_ns);
    interval.record(latency_ns);
    if let Some(mismatch) = mismatch {
        outcome.mismatches += 1;
        outcome.first_mismatch.get_or_insert(mismatch);
    }
    if let Some(failure) = failure {
        outcome.errors += 1;
        outcome.first_error.get_or_insert(failure);
        return None;
    }
    if !slot.measured {
        return None;
    }
    *last_measured_ns = (*last_measured_ns).max(now);
    outcome.measured_ops += 1;
    outcome.measured_bytes += u64::from(slot.op.length_bytes);
    match slot.op.kind {
        OpKind::Read => outcome.read.record(latency_ns),
        OpKind::Write => outcome.write.record(latency_ns),
    }
    Some((slot.op.kind, latency_ns))
}

/// Counts a measured answer in the timeline interval being filled.
fn add_to_timeline(current: &mut TimelineSample, measured: Option<(OpKind, u64)>) {
    if let Some((kind, latency_ns)) = measured {
        current.ops += 1;
        if kind == OpKind::Read {
            current.read.record(latency_ns);
        }
    }
}

impl Channel {
    fn new(
        config: &EngineConfig,
        stream_index: u64,
        stream_count: u64,
        queue_depth: usize,
    ) -> Channel {
        let source = match config.phase {
            Phase::Measure => Source::Workload(OpGenerator::new(
                config.workload,
                config.seed,
                stream_index,
                stream_count,
            )),
            Phase::Fill { chunk_bytes } => Source::Fill(FillGenerator::new(
                &config.workload,
                chunk_bytes,
                stream_index,
                stream_count,
            )),
        };
        let quota_remaining = match (config.phase, config.ops_max) {
            (Phase::Measure, Some(total)) => {
                // Split exactly: the first `total % streams` channels take one more.
                let base = total / stream_count;
                let extra = u64::from(stream_index < total % stream_count);
                Some(base + extra)
            }
            _ => None,
        };
        let empty = Slot {
            op: Op {
                kind: OpKind::Read,
                offset_bytes: 0,
                length_bytes: 0,
            },
            intended_ns: 0,
            measured: false,
        };
        Channel {
            stream_index,
            source,
            arrivals: None,
            free_slots: (0..queue_depth as u32).rev().collect(),
            slots: vec![empty; queue_depth],
            in_flight: 0,
            queue_depth,
            quota_remaining,
            finished: false,
            quota_met: false,
        }
    }

    /// Starts the arrival process (open loop) at `start_ns`: each channel gets an equal
    /// share of the total rate, from its own random stream.
    fn start(&mut self, config: &EngineConfig, start_ns: u64) {
        if let (Load::Open { rate_per_sec, .. }, Phase::Measure) = (config.load, config.phase) {
            let stream_count = (config.threads * config.channels_per_thread) as f64;
            self.arrivals = Some(Arrivals::new(
                rate_per_sec / stream_count,
                config.seed,
                self.stream_index,
                start_ns,
            ));
        }
    }
}
