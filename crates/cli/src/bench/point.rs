//! One engine run as a plain function call, for tools that drive the bench engine point by
//! point (`reflex calibrate`) instead of through `reflex bench`'s rows and table.
//!
//! Why a separate entry point: calibration needs exactly what a bench row measures (open-loop
//! Poisson load, latency from the intended send time, HdrHistogram percentiles per operation
//! kind, local io_uring or remote native protocol) but hundreds of times, with its own
//! progress display and without printing anything. [`run`] hands the engine's once-per-second
//! progress to a callback on the calling thread and returns the merged outcome; nothing here
//! changes how the engine measures.

use std::fs::File;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};

use super::engine::{self, EngineConfig, Load, Phase, Target};
pub use super::stats::LatencySummary;
use super::workload::{Access, WorkloadSpec};

/// Largest in-flight limit per channel a point may ask for (the engine's own bound).
pub const QUEUE_DEPTH_MAX: u32 = engine::QUEUE_DEPTH_MAX;
/// Most channels (connections or local queues) one point may use.
pub const CHANNELS_MAX: usize = 64;

/// Where a point's load goes.
#[derive(Debug, Clone)]
pub enum PointTarget {
    /// A local file or block device, already opened (O_DIRECT or not) by the caller.
    Local { file: Arc<File> },
    /// A namespace of a ReFlex server, over the native protocol.
    Remote { address: SocketAddr, namespace: u32 },
}

/// How requests are paced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PointLoad {
    /// Poisson arrivals at `rate_per_sec` in total; at most `queue_depth_max` in flight per
    /// channel (later arrivals wait for a slot and the wait counts in their latency).
    Open {
        rate_per_sec: f64,
        queue_depth_max: u32,
    },
    /// `queue_depth` requests in flight per channel, always.
    Closed { queue_depth: u32 },
}

/// One point: a load on a range for a time.
#[derive(Debug, Clone)]
pub struct PointSpec {
    pub target: PointTarget,
    pub load: PointLoad,
    /// Fraction of reads, 0.0 ..= 1.0.
    pub read_ratio: f64,
    pub io_size_bytes: u32,
    /// Sequential offsets (each channel from its own start, wrapping) instead of uniform.
    pub sequential: bool,
    pub range_start_bytes: u64,
    /// A positive multiple of `io_size_bytes`.
    pub range_length_bytes: u64,
    /// Channels of the one bench thread: connections (remote) or queues (local).
    pub channels: usize,
    /// Load that is not measured, before the measurement.
    pub warmup: Duration,
    pub duration: Duration,
    /// Stop after this many measured operations (split over channels).
    pub ops_max: Option<u64>,
    pub seed: u64,
}

/// What a point measured. Latencies are from the intended send time to the answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PointOutcome {
    pub read: LatencySummary,
    pub write: LatencySummary,
    /// Measured operations answered OK (issued after the warm-up).
    pub measured_ops: u64,
    pub measured_bytes: u64,
    /// Length of the measurement: the duration, or less when `ops_max` ran out first.
    pub measured_ns: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    /// Open loop: arrivals due before the end that never found a free slot.
    pub unissued_ops: u64,
}

/// Runs one point on one bench thread. `progress` is called on the calling thread about once
/// a second with the operations completed so far (warm-up included).
pub fn run(spec: &PointSpec, progress: &mut dyn FnMut(u64)) -> Result<PointOutcome> {
    check(spec)?;
    let (load, queue_depth) = match spec.load {
        PointLoad::Open {
            rate_per_sec,
            queue_depth_max,
        } => (
            Load::Open {
                rate_per_sec,
                queue_depth_max,
            },
            queue_depth_max,
        ),
        PointLoad::Closed { queue_depth } => (Load::Closed { queue_depth }, queue_depth),
    };
    assert!((1..=QUEUE_DEPTH_MAX).contains(&queue_depth));
    let config = EngineConfig {
        target: match &spec.target {
            PointTarget::Local { file } => Target::Local { file: file.clone() },
            PointTarget::Remote { address, namespace } => Target::Remote {
                address: *address,
                namespace: *namespace,
            },
        },
        threads: 1,
        channels_per_thread: spec.channels,
        load,
        workload: WorkloadSpec {
            read_ratio: spec.read_ratio,
            io_size_bytes: spec.io_size_bytes,
            access: if spec.sequential {
                Access::Sequential
            } else {
                Access::Random
            },
            range_start_bytes: spec.range_start_bytes,
            range_length_bytes: spec.range_length_bytes,
        },
        phase: Phase::Measure,
        seed: spec.seed,
        verify_seed: None,
        warmup: spec.warmup,
        duration: spec.duration,
        ops_max: spec.ops_max,
        spin: false,
        cpus: Vec::new(),
        bind_handles: Vec::new(),
        server_pid: None,
        measure_hooks: Default::default(),
        follow_notices: false,
        timeline: None,
        report_interval: None,
    };
    let (sender, receiver) = mpsc::channel::<engine::Progress>();
    let outcome = std::thread::scope(|scope| {
        let handle = std::thread::Builder::new()
            .name("calibrate-point".into())
            .spawn_scoped(scope, || {
                let result = engine::run(&config, Some(&sender));
                drop(sender);
                result
            })
            .map_err(|error| anyhow!("cannot start the engine thread: {error}"))?;
        // The engine drops its sender when it returns, which ends this loop.
        while let Ok(report) = receiver.recv() {
            progress(report.completed_ops);
        }
        handle
            .join()
            .unwrap_or_else(|_| Err(anyhow!("engine thread panicked")))
    })?;
    Ok(PointOutcome {
        read: outcome.read.summary(),
        write: outcome.write.summary(),
        measured_ops: outcome.measured_ops,
        measured_bytes: outcome.measured_bytes,
        measured_ns: outcome.measured_ns,
        errors: outcome.errors,
        first_error: outcome.first_error,
        unissued_ops: outcome.unissued_ops,
    })
}

/// The engine asserts its preconditions; callers get them as errors instead.
fn check(spec: &PointSpec) -> Result<()> {
    if !(1..=CHANNELS_MAX).contains(&spec.channels) {
        bail!("channels must be between 1 and {CHANNELS_MAX}");
    }
    if !(0.0..=1.0).contains(&spec.read_ratio) {
        bail!("read ratio {} is not in 0..=1", spec.read_ratio);
    }
    if spec.io_size_bytes == 0 || !spec.io_size_bytes.is_multiple_of(512) {
        bail!(
            "I/O size {} is not a positive multiple of 512",
            spec.io_size_bytes
        );
    }
    if spec.range_length_bytes == 0
        || !spec
            .range_length_bytes
            .is_multiple_of(u64::from(spec.io_size_bytes))
    {
        bail!(
            "range of {} bytes is not a positive multiple of the I/O size {}",
            spec.range_length_bytes,
            spec.io_size_bytes
        );
    }
    if spec.duration.is_zero() {
        bail!("a point needs a positive duration");
    }
    let queue_depth = match spec.load {
        PointLoad::Open {
            rate_per_sec,
            queue_depth_max,
        } => {
            if !(rate_per_sec > 0.0 && rate_per_sec.is_finite()) {
                bail!("rate {rate_per_sec}/s must be positive and finite");
            }
            queue_depth_max
        }
        PointLoad::Closed { queue_depth } => queue_depth,
    };
    if !(1..=QUEUE_DEPTH_MAX).contains(&queue_depth) {
        bail!("queue depth {queue_depth} must be between 1 and {QUEUE_DEPTH_MAX}");
    }
    if spec.ops_max == Some(0) {
        bail!("ops_max must be positive");
    }
    Ok(())
}
