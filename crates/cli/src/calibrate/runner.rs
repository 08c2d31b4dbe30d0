//! [`RealTimeRunner`]: the calibration load runner for real devices — a local file or block
//! device (io_uring, O_DIRECT) or a namespace of a ReFlex server (native protocol) — on the
//! real clock, through the bench engine.
//!
//! Why the bench engine: it already issues open-loop Poisson load at the intended send times
//! (an arrival that finds no free slot waits, and the wait counts in its latency, so a slow
//! device cannot hide its queueing), measures latency from the intended send time into
//! HdrHistograms per operation kind, and drains every request before it returns. A point is
//! therefore one engine run: 10 % of its duration warms up (as `EmuRunner` discards the first
//! 10 %), the rest is measured, and the device is idle again when `run_point` returns.
//!
//! When a point comes out slow, a *canary* (2000 reads/s for 250 ms) checks whether the device
//! is slow under light load too. If it is (its p95 over 1 ms and four times the best canary
//! seen), the slowness is not the point's load but something else on the machine (on this
//! project's VMs: episodes of ~15 ms disk stalls every 100 ms that last seconds to minutes):
//! the runner waits a second and measures the point again, up to five times and
//! `stall_wait_max` in all, and counts what it did for the profile's provenance.
//!
//! A point is split into `runs_per_point` back-to-back runs and reports the median of each
//! figure (every run's p95 is kept in the sweep JSON): on a shared machine another process's
//! burst of I/O can stall the disk for a good part of a second, and that stall is not a
//! property of the device under the calibrating load. One stall then spoils one run, not the
//! point, and the latency curves stay usable for the fit.
//!
//! Both kinds get the same in-flight limit ([`IN_FLIGHT_MAX`]) so that local and remote
//! profiles of one device differ only by what the network path adds. Writes are refused unless
//! the runner was built with `writes_allowed`: calibration with writes destroys the target's
//! data, and the command line asks for that decision explicitly (`--allow-writes`).

use std::time::{Duration, Instant};

use reflex_flash::calibrate::{
    CalibrateError, LoadRunner, PointResult, PreconditionPlan, check_point_arguments,
};
use reflex_qos::Nanos;

use super::device::{LocalDevice, RemoteDevice};
use crate::bench::point::{self, PointLoad, PointOutcome, PointSpec, PointTarget};

/// Requests in flight at most during a point, local or remote (arrivals beyond it wait).
pub const IN_FLIGHT_MAX: u32 = 256;
/// Most connections a remote point opens to reach [`IN_FLIGHT_MAX`] within the server window.
const REMOTE_CONNECTIONS_MAX: usize = 8;
/// Share of a run's duration that is load but not measured.
const WARMUP_FRACTION: f64 = 0.1;
/// Most runs per point.
pub const RUNS_PER_POINT_MAX: u32 = 15;
/// The canary: light read-only load that shows whether the device itself is slow right now.
const CANARY_RATE_PER_SEC: f64 = 2000.0;
const CANARY_SIZE_BYTES: u32 = 4096;
const CANARY_DURATION: Duration = Duration::from_millis(250);
/// A point this slow (p95, µs) or slower, and [`STALL_FACTOR`] times the best canary, gets a
/// canary check.
const CANARY_TRIGGER_MIN_US: f64 = 1000.0;
/// A canary this slow (p95, µs) or slower, and [`STALL_FACTOR`] times the best canary, means the
/// device is stalling.
const STALL_CANARY_MIN_US: f64 = 1000.0;
const STALL_FACTOR: f64 = 4.0;
/// Pause before measuring a point again after a stalling canary.
const STALL_WAIT: Duration = Duration::from_secs(1);
/// Most times one point is measured again because the device was stalling.
const STALL_RETRIES_MAX: u32 = 5;
/// Shortest run: below it the warm-up and the drain dominate.
const RUN_DURATION_MIN: Duration = Duration::from_millis(10);
/// The random phase of preconditioning writes this size.
const RANDOM_WRITE_BYTES: u32 = 4096;

/// What a runner may do, chosen on the command line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunnerSettings {
    /// `--allow-writes`: points with writes and preconditioning may overwrite the target.
    pub writes_allowed: bool,
    /// Longest preconditioning (both phases together).
    pub precondition_time_max: Duration,
    /// Seed of offsets and arrivals; each point uses the next one.
    pub seed: u64,
    /// Back-to-back runs a point is split into; the point reports their medians.
    pub runs_per_point: u32,
    /// Longest total wait for the device to stop stalling under light load (0: never check).
    pub stall_wait_max: Duration,
}

/// Open-loop load on a real device; see the module doc.
pub struct RealTimeRunner {
    target: PointTarget,
    /// "file /x (O_DIRECT, ext4)" or "reflex://127.0.0.1:7070 namespace 1".
    target_text: String,
    /// Requests use offsets in `0..range_length_bytes`.
    range_length_bytes: u64,
    /// Offsets and sizes must be multiples of this.
    alignment_bytes: u32,
    io_size_max_bytes: u32,
    channels: usize,
    queue_depth_per_channel: u32,
    settings: RunnerSettings,
    precondition_note: Option<String>,
    points_run: u64,
    stalls: StallCounts,
}

/// What the stall checks saw (see [`RealTimeRunner::device_stalling`]).
#[derive(Debug, Clone, Copy, Default)]
struct StallCounts {
    canaries: u64,
    stalls_seen: u64,
    retried_points: u64,
    waited: Duration,
    /// The lowest canary p95 so far: the device's light-load latency when nothing interferes.
    canary_us_min: Option<f64>,
}

impl RealTimeRunner {
    /// A runner on an opened local file or block device; `range_bytes` limits it to the first
    /// bytes (default: all of it).
    pub fn local(
        device: LocalDevice,
        range_bytes: Option<u64>,
        settings: RunnerSettings,
    ) -> Result<RealTimeRunner, CalibrateError> {
        let range_length_bytes = range(device.size_bytes, range_bytes, "the file")?;
        let kind = if device.block_device {
            "block device"
        } else {
            "file"
        };
        let mut details = vec![if device.direct_io {
            "O_DIRECT".to_string()
        } else {
            "buffered (forced)".to_string()
        }];
        if let Some(filesystem) = &device.filesystem {
            details.push(filesystem.clone());
        }
        details.push(format!("{} MiB", range_length_bytes >> 20));
        let target_text = format!("{kind} {} ({})", device.path.display(), details.join(", "));
        Ok(RealTimeRunner {
            target: PointTarget::Local {
                file: std::sync::Arc::new(device.file),
            },
            target_text,
            range_length_bytes,
            alignment_bytes: 512,
            io_size_max_bytes: 1 << 20,
            channels: 1,
            queue_depth_per_channel: IN_FLIGHT_MAX,
            settings,
            precondition_note: None,
            points_run: 0,
            stalls: StallCounts::default(),
        })
    }

    /// A runner on a checked remote namespace; `range_bytes` as for [`RealTimeRunner::local`].
    pub fn remote(
        device: RemoteDevice,
        range_bytes: Option<u64>,
        settings: RunnerSettings,
    ) -> Result<RealTimeRunner, CalibrateError> {
        let range_length_bytes = range(device.size_bytes, range_bytes, "the namespace")?;
        if device.window_requests == 0 || device.io_size_max_bytes < 512 {
            return Err(CalibrateError::Runner(format!(
                "server announces window {} and max I/O {} bytes: nothing can be sent",
                device.window_requests, device.io_size_max_bytes
            )));
        }
        let queue_depth_per_channel = device.window_requests.min(IN_FLIGHT_MAX);
        let channels = (IN_FLIGHT_MAX.div_ceil(queue_depth_per_channel) as usize)
            .clamp(1, REMOTE_CONNECTIONS_MAX);
        let target_text = format!(
            "reflex://{}/{} ({} MiB, {channels} connection(s) x {queue_depth_per_channel} in flight)",
            device.address,
            device.namespace,
            range_length_bytes >> 20
        );
        Ok(RealTimeRunner {
            target: PointTarget::Remote {
                address: device.address,
                namespace: device.namespace,
            },
            target_text,
            range_length_bytes,
            alignment_bytes: device.block_size_bytes.max(512),
            io_size_max_bytes: device.io_size_max_bytes,
            channels,
            queue_depth_per_channel,
            settings,
            precondition_note: None,
            points_run: 0,
            stalls: StallCounts::default(),
        })
    }

    fn refuse_writes(&self, what: &str) -> Result<(), CalibrateError> {
        if self.settings.writes_allowed {
            return Ok(());
        }
        Err(CalibrateError::Config(format!(
            "{what} would overwrite {} and --allow-writes was not given",
            self.target_text
        )))
    }

    fn next_seed(&mut self) -> u64 {
        self.points_run += 1;
        self.settings
            .seed
            .wrapping_add(self.points_run.wrapping_mul(0x9E37_79B9))
    }

    /// One closed-loop write phase of preconditioning. Returns the bytes written.
    fn write_phase(
        &mut self,
        block_bytes: u32,
        sequential: bool,
        count: u64,
        queue_depth: u32,
        time_max: Duration,
        progress: &mut dyn FnMut(u64),
    ) -> Result<u64, CalibrateError> {
        if count == 0 || time_max.is_zero() {
            return Ok(0);
        }
        let spec = PointSpec {
            target: self.target.clone(),
            load: PointLoad::Closed { queue_depth },
            read_ratio: 0.0,
            io_size_bytes: block_bytes,
            sequential,
            range_start_bytes: 0,
            range_length_bytes: self.range_length_bytes
                - self.range_length_bytes % u64::from(block_bytes),
            channels: 1,
            warmup: Duration::ZERO,
            duration: time_max,
            ops_max: Some(count),
            seed: self.next_seed(),
        };
        let outcome = point::run(&spec, progress).map_err(runner_error)?;
        check_errors(&outcome)?;
        Ok(outcome.measured_bytes)
    }
}

fn range(size_bytes: u64, range_bytes: Option<u64>, what: &str) -> Result<u64, CalibrateError> {
    let range = range_bytes.unwrap_or(size_bytes);
    if range > size_bytes {
        return Err(CalibrateError::Config(format!(
            "--size-bytes {range} is larger than {what} ({size_bytes} bytes)"
        )));
    }
    if range < 1 << 20 {
        return Err(CalibrateError::Config(format!(
            "{what} offers {range} bytes; calibration needs at least 1 MiB of random offsets"
        )));
    }
    Ok(range)
}

fn runner_error(error: anyhow::Error) -> CalibrateError {
    CalibrateError::Runner(format!("{error:#}"))
}

fn check_errors(outcome: &PointOutcome) -> Result<(), CalibrateError> {
    if outcome.errors == 0 {
        return Ok(());
    }
    Err(CalibrateError::Runner(format!(
        "{} requests failed; first: {}",
        outcome.errors,
        outcome.first_error.as_deref().unwrap_or("(no message)")
    )))
}

impl LoadRunner for RealTimeRunner {
    fn describe(&self) -> String {
        let mut text = format!("{} in real time", self.target_text);
        for note in [self.precondition_note.clone(), self.stall_summary()]
            .into_iter()
            .flatten()
        {
            text.push_str("; ");
            text.push_str(&note);
        }
        text
    }

    /// A sequential fill in `plan.sequential_block_bytes` writes, then random 4 KiB writes
    /// over `plan.random_write_capacity_multiple` of the range, both at `plan.queue_depth`,
    /// together bounded by `precondition_time_max` (the random phase gets what the fill left).
    fn precondition(
        &mut self,
        plan: &PreconditionPlan,
        progress: &mut dyn FnMut(f64),
    ) -> Result<(), CalibrateError> {
        self.refuse_writes("preconditioning")?;
        if !(plan.random_write_capacity_multiple >= 0.0
            && plan.random_write_capacity_multiple.is_finite())
        {
            return Err(CalibrateError::Config(
                "random_write_capacity_multiple must be finite and not negative".into(),
            ));
        }
        let started = Instant::now();
        let time_max = self.settings.precondition_time_max;
        let unit = self.alignment_bytes.max(4096);
        let block_bytes = plan
            .sequential_block_bytes
            .min(self.io_size_max_bytes)
            .max(unit);
        let block_bytes = block_bytes - block_bytes % unit;
        let queue_depth = plan.queue_depth.clamp(1, self.queue_depth_per_channel);
        let sequential_count = self.range_length_bytes / u64::from(block_bytes);
        let sequential_bytes = sequential_count * u64::from(block_bytes);
        let random_count = (self.range_length_bytes as f64 / f64::from(RANDOM_WRITE_BYTES)
            * plan.random_write_capacity_multiple) as u64;
        let total_bytes = (sequential_bytes + random_count * u64::from(RANDOM_WRITE_BYTES)).max(1);
        let written_sequential = self.write_phase(
            block_bytes,
            true,
            sequential_count,
            queue_depth,
            time_max,
            &mut |done| progress((done * u64::from(block_bytes)) as f64 / total_bytes as f64),
        )?;
        let time_left = time_max.saturating_sub(started.elapsed());
        let written_random = self.write_phase(
            RANDOM_WRITE_BYTES,
            false,
            random_count,
            queue_depth,
            time_left,
            &mut |done| {
                progress(
                    (written_sequential + done * u64::from(RANDOM_WRITE_BYTES)) as f64
                        / total_bytes as f64,
                )
            },
        )?;
        progress(((written_sequential + written_random) as f64 / total_bytes as f64).min(1.0));
        let complete = written_sequential == sequential_bytes
            && written_random == random_count * u64::from(RANDOM_WRITE_BYTES);
        self.precondition_note = Some(format!(
            "preconditioned in {:.0} s: {} of {} MiB written sequentially in {} KiB writes, then \
             {} MiB of random 4 KiB writes ({:.2}x the range){}",
            started.elapsed().as_secs_f64(),
            written_sequential >> 20,
            sequential_bytes >> 20,
            block_bytes >> 10,
            written_random >> 20,
            written_random as f64 / self.range_length_bytes as f64,
            if complete {
                String::new()
            } else {
                format!(", cut short by the {} s bound", time_max.as_secs())
            }
        ));
        Ok(())
    }

    fn run_point(
        &mut self,
        rate_per_sec: f64,
        read_ratio: f64,
        size_bytes: u32,
        duration: Nanos,
    ) -> Result<PointResult, CalibrateError> {
        check_point_arguments(
            rate_per_sec,
            read_ratio,
            size_bytes,
            duration,
            self.alignment_bytes,
            u64::from(self.io_size_max_bytes).min(self.range_length_bytes),
        )?;
        if read_ratio < 1.0 {
            self.refuse_writes("a point with writes")?;
        }
        let mut attempt = 0;
        loop {
            let point = self.measure(rate_per_sec, read_ratio, size_bytes, duration)?;
            if !self.worth_a_canary(&point) || attempt >= STALL_RETRIES_MAX {
                return Ok(point);
            }
            let waited = self.stalls.waited;
            if waited >= self.settings.stall_wait_max || !self.device_stalling()? {
                return Ok(point);
            }
            // The device is slow even under light load: someone else's doing. Wait it out and
            // measure the point again.
            self.stalls.retried_points += u64::from(attempt == 0);
            let wait = STALL_WAIT.min(self.settings.stall_wait_max - waited);
            // Shown on the progress line, which the next point overwrites.
            eprint!(
                "\r\x1b[Kthe device stalls under light load too: waiting {} ms, then measuring \
                 {rate_per_sec:.0}/s again ({:.0} s waited so far)",
                wait.as_millis(),
                waited.as_secs_f64()
            );
            std::thread::sleep(wait);
            self.stalls.waited += wait;
            attempt += 1;
        }
    }
}

impl RealTimeRunner {
    /// The point as `runs_per_point` back-to-back runs, merged by medians.
    fn measure(
        &mut self,
        rate_per_sec: f64,
        read_ratio: f64,
        size_bytes: u32,
        duration: Nanos,
    ) -> Result<PointResult, CalibrateError> {
        let runs = self.settings.runs_per_point.clamp(1, RUNS_PER_POINT_MAX);
        let per_run = Duration::from_nanos(duration.0 / u64::from(runs)).max(RUN_DURATION_MIN);
        let mut results = Vec::with_capacity(runs as usize);
        for _ in 0..runs {
            results.push(self.run_once(rate_per_sec, read_ratio, size_bytes, per_run)?);
        }
        Ok(median_of(results))
    }

    /// Whether a point is slow enough that the device's own state should be checked: its p95
    /// is above [`CANARY_TRIGGER_MIN_US`] and [`STALL_FACTOR`] times the best canary so far.
    fn worth_a_canary(&self, point: &PointResult) -> bool {
        if self.settings.stall_wait_max.is_zero() {
            return false;
        }
        let baseline = self.stalls.canary_us_min.unwrap_or(0.0);
        point.read_latency_us_p95 > CANARY_TRIGGER_MIN_US.max(STALL_FACTOR * baseline)
    }

    /// Runs the canary (light read-only load) and says whether the device is stalling: its
    /// p95 above [`STALL_CANARY_MIN_US`] and [`STALL_FACTOR`] times the best canary seen.
    fn device_stalling(&mut self) -> Result<bool, CalibrateError> {
        let canary = self.run_once(
            CANARY_RATE_PER_SEC,
            1.0,
            CANARY_SIZE_BYTES.max(self.alignment_bytes),
            CANARY_DURATION,
        )?;
        self.stalls.canaries += 1;
        let p95 = canary.read_latency_us_p95;
        let baseline = self.stalls.canary_us_min.map_or(p95, |best| best.min(p95));
        self.stalls.canary_us_min = Some(baseline);
        let stalling = p95 > STALL_CANARY_MIN_US.max(STALL_FACTOR * baseline);
        self.stalls.stalls_seen += u64::from(stalling);
        Ok(stalling)
    }

    /// What the stall checks found, for the profile's provenance.
    fn stall_summary(&self) -> Option<String> {
        if self.stalls.canaries == 0 {
            return None;
        }
        Some(format!(
            "{} canary checks found the device stalling under light load {} times; {} points \
             re-measured after waiting {:.0} s in all",
            self.stalls.canaries,
            self.stalls.stalls_seen,
            self.stalls.retried_points,
            self.stalls.waited.as_secs_f64()
        ))
    }

    /// One engine run at the point's load: warm-up, then measurement, then drain.
    fn run_once(
        &mut self,
        rate_per_sec: f64,
        read_ratio: f64,
        size_bytes: u32,
        total: Duration,
    ) -> Result<PointResult, CalibrateError> {
        let warmup = total.mul_f64(WARMUP_FRACTION);
        let measured = total.saturating_sub(warmup).max(Duration::from_micros(1));
        let spec = PointSpec {
            target: self.target.clone(),
            load: PointLoad::Open {
                rate_per_sec,
                queue_depth_max: self.queue_depth_per_channel,
            },
            read_ratio,
            io_size_bytes: size_bytes,
            sequential: false,
            range_start_bytes: 0,
            range_length_bytes: self.range_length_bytes
                - self.range_length_bytes % u64::from(size_bytes),
            channels: self.channels,
            warmup,
            duration: measured,
            ops_max: None,
            seed: self.next_seed(),
        };
        let outcome = point::run(&spec, &mut |_| {}).map_err(runner_error)?;
        check_errors(&outcome)?;
        Ok(point_result(rate_per_sec, read_ratio, size_bytes, &outcome))
    }
}

/// A point from several measurements of it: the median of each figure (the upper median for an even count,
/// the cautious side), request counts summed, every run's p95 kept.
pub(crate) fn median_of(mut runs: Vec<PointResult>) -> PointResult {
    assert!(!runs.is_empty());
    let median = |runs: &[PointResult], figure: fn(&PointResult) -> f64| -> f64 {
        let mut values: Vec<f64> = runs.iter().map(figure).collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let p95_runs: Vec<f64> = runs.iter().map(|r| r.read_latency_us_p95).collect();
    let point = PointResult {
        iops: median(&runs, |r| r.iops),
        reads: runs.iter().map(|r| r.reads).sum(),
        writes: runs.iter().map(|r| r.writes).sum(),
        read_latency_us_p50: median(&runs, |r| r.read_latency_us_p50),
        read_latency_us_p95: median(&runs, |r| r.read_latency_us_p95),
        read_latency_us_p99: median(&runs, |r| r.read_latency_us_p99),
        write_latency_us_p95: median(&runs, |r| r.write_latency_us_p95),
        refused: 0,
        unfinished: median(&runs, |r| r.unfinished as f64) as u64,
        read_latency_us_p95_runs: if runs.len() > 1 { p95_runs } else { Vec::new() },
        ..runs.swap_remove(0)
    };
    // The medians of ordered figures are ordered: each run has p50 <= p95 <= p99.
    debug_assert!(point.read_latency_us_p50 <= point.read_latency_us_p95);
    debug_assert!(point.read_latency_us_p95 <= point.read_latency_us_p99);
    point
}

/// Unissued arrivals a point may have without counting as overloaded: the larger of this and
/// [`UNISSUED_TOLERANCE_FRACTION`] of its arrivals.
const UNISSUED_TOLERANCE_MIN: u64 = 32;
const UNISSUED_TOLERANCE_FRACTION: f64 = 0.002;

/// The engine's outcome in the calibration's terms. Arrivals that never found a free slot
/// count as unfinished, which marks the point overloaded for the sweep, but only beyond a
/// small tolerance: the engine also leaves unissued the few arrivals due in the last moments
/// of the run, when its loop wakes after the end and stops before issuing them (a handful at
/// 100K requests/s, whatever the load), and a sweep must not end a curve on that.
fn point_result(
    rate_per_sec: f64,
    read_ratio: f64,
    size_bytes: u32,
    outcome: &PointOutcome,
) -> PointResult {
    let seconds = (outcome.measured_ns as f64 / 1e9).max(1e-9);
    let arrivals = rate_per_sec * seconds;
    let tolerance = (arrivals * UNISSUED_TOLERANCE_FRACTION).max(UNISSUED_TOLERANCE_MIN as f64);
    let unfinished = if outcome.unissued_ops as f64 > tolerance {
        outcome.unissued_ops
    } else {
        0
    };
    PointResult {
        rate_per_sec,
        read_ratio,
        size_bytes,
        iops: outcome.measured_ops as f64 / seconds,
        reads: outcome.read.count,
        writes: outcome.write.count,
        read_latency_us_p50: outcome.read.p50_us,
        read_latency_us_p95: outcome.read.p95_us,
        read_latency_us_p99: outcome.read.p99_us,
        write_latency_us_p95: outcome.write.p95_us,
        refused: 0,
        unfinished,
        read_latency_us_p95_runs: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use reflex_server::{Config, NamespaceConfig, Server, ServerHandle};

    use super::*;
    use crate::calibrate::device::tests::scratch_dir;
    use crate::calibrate::device::{LocalOptions, open_local, open_remote};

    const FILE_BYTES: u64 = 8 << 20;

    fn settings(writes_allowed: bool) -> RunnerSettings {
        RunnerSettings {
            writes_allowed,
            precondition_time_max: Duration::from_secs(60),
            seed: 7,
            runs_per_point: 2,
            stall_wait_max: Duration::from_secs(2),
        }
    }

    fn file_runner(path: &std::path::Path, writes_allowed: bool) -> RealTimeRunner {
        let device = open_local(
            path,
            LocalOptions {
                writable: writes_allowed,
                force: false,
                will_fill: true,
                create_size_bytes: Some(FILE_BYTES),
            },
        )
        .expect("open the scratch file");
        RealTimeRunner::local(device, None, settings(writes_allowed)).expect("runner")
    }

    fn start_server(backend: String) -> ServerHandle {
        let config = Config {
            window: 64,
            ..Config::loopback(vec![NamespaceConfig::new(1, backend).sized(FILE_BYTES)])
        };
        Server::start(config).expect("server start")
    }

    /// The checks every light point must pass: counts follow the mix, latencies are ordered.
    fn check_point(point: &PointResult, read_ratio: f64) {
        assert_eq!(point.size_bytes, 4096);
        assert_eq!(point.read_ratio, read_ratio);
        assert_eq!(point.refused, 0);
        assert!(point.reads > 0, "{point:?}");
        assert_eq!(point.writes > 0, read_ratio < 1.0, "{point:?}");
        assert!(point.iops > 0.0);
        assert!(point.read_latency_us_p50 > 0.0);
        assert!(point.read_latency_us_p50 <= point.read_latency_us_p95);
        assert!(point.read_latency_us_p95 <= point.read_latency_us_p99);
    }

    #[test]
    fn file_runner_preconditions_and_measures() {
        let dir = scratch_dir();
        let path = dir.path().join("calibrate.img");
        let mut runner = file_runner(&path, true);
        let mut fractions = Vec::new();
        runner
            .precondition(&PreconditionPlan::default(), &mut |f| fractions.push(f))
            .expect("precondition");
        assert_eq!(fractions.last().copied(), Some(1.0));
        assert!(fractions.windows(2).all(|w| w[0] <= w[1]), "{fractions:?}");
        let description = runner.describe();
        assert!(
            description.contains("8 of 8 MiB written sequentially"),
            "{description}"
        );
        assert!(!description.contains("cut short"), "{description}");
        // The fill really reached the file: nothing of it is still zero.
        let mut content = Vec::new();
        std::fs::File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut content))
            .expect("read back");
        assert_eq!(content.len() as u64, FILE_BYTES);
        assert!(
            content
                .chunks(4096)
                .all(|block| block.iter().any(|b| *b != 0))
        );
        for read_ratio in [1.0, 0.5] {
            let point = runner
                .run_point(2000.0, read_ratio, 4096, Nanos::from_millis(200))
                .expect("point");
            check_point(&point, read_ratio);
            assert_eq!(point.rate_per_sec, 2000.0);
        }
    }

    #[test]
    fn writes_are_refused_without_permission() {
        let dir = scratch_dir();
        let path = dir.path().join("keep.img");
        std::fs::write(&path, vec![0x5a; FILE_BYTES as usize]).expect("data file");
        let mut runner = file_runner(&path, false);
        let error = runner
            .run_point(1000.0, 0.9, 4096, Nanos::from_millis(50))
            .expect_err("writes refused");
        assert!(error.to_string().contains("--allow-writes"), "{error}");
        let error = runner
            .precondition(&PreconditionPlan::default(), &mut |_| {})
            .expect_err("preconditioning refused");
        assert!(error.to_string().contains("--allow-writes"), "{error}");
        let point = runner
            .run_point(1000.0, 1.0, 4096, Nanos::from_millis(100))
            .expect("reads are fine");
        check_point(&point, 1.0);
        let content = std::fs::read(&path).expect("read back");
        assert!(content.iter().all(|b| *b == 0x5a), "nothing was written");
    }

    #[test]
    fn bad_point_arguments_are_errors() {
        let dir = scratch_dir();
        let mut runner = file_runner(&dir.path().join("args.img"), true);
        let bad = [
            (0.0, 1.0, 4096),
            (f64::NAN, 1.0, 4096),
            (1000.0, 1.5, 4096),
            (1000.0, 1.0, 1000),
            (1000.0, 1.0, 0),
            (1000.0, 1.0, 16 << 20),
        ];
        for (rate, ratio, size) in bad {
            let result = runner.run_point(rate, ratio, size, Nanos::from_millis(10));
            assert!(
                matches!(result, Err(CalibrateError::Config(_))),
                "{rate} {ratio} {size}: {result:?}"
            );
        }
        let too_large = RealTimeRunner::local(
            open_local(
                &dir.path().join("args.img"),
                LocalOptions {
                    writable: false,
                    force: true,
                    will_fill: false,
                    create_size_bytes: None,
                },
            )
            .expect("open"),
            Some(FILE_BYTES * 2),
            settings(false),
        );
        assert!(matches!(too_large, Err(CalibrateError::Config(_))));
    }

    #[test]
    fn remote_runner_measures_a_namespace_of_a_real_server() {
        let server = start_server("mem:8M".to_string());
        let address = server.native_addr().to_string();
        let device = open_remote(&address, Some(1), true).expect("namespace 1");
        assert_eq!(device.size_bytes, FILE_BYTES);
        let mut runner = RealTimeRunner::remote(device, None, settings(true)).expect("runner");
        assert!(
            runner.describe().starts_with("reflex://"),
            "{}",
            runner.describe()
        );
        runner
            .precondition(
                &PreconditionPlan {
                    random_write_capacity_multiple: 0.25,
                    ..PreconditionPlan::default()
                },
                &mut |_| {},
            )
            .expect("precondition");
        assert!(
            runner.describe().contains("8 of 8 MiB"),
            "{}",
            runner.describe()
        );
        for read_ratio in [1.0, 0.75] {
            let point = runner
                .run_point(2000.0, read_ratio, 4096, Nanos::from_millis(200))
                .expect("point");
            check_point(&point, read_ratio);
        }
        let missing = open_remote(&address, Some(9), false).expect_err("no namespace 9");
        assert!(missing.to_string().contains("announces: 1"), "{missing}");
        server.shutdown().expect("shutdown");
    }
}
