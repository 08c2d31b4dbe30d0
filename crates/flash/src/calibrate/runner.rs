//! [`EmuRunner`]: open-loop load on the emulated device in virtual time.
//!
//! Arrivals are Poisson from a seeded generator and the device is advanced event by event, so
//! a point is exact, reproducible from its seed and takes milliseconds of CPU instead of its
//! nominal duration. The device keeps its state (write buffer, GC condition, clock) across
//! points, like a real device does; each point ends by draining it.

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_qos::Nanos;

use super::{CalibrateError, LoadRunner, PointResult, PreconditionPlan};
use crate::emu::{EmuCompletion, EmuDevice, EmuOpKind, EmuProfile, EmuRequest};

/// Share of a point's duration discarded as warm-up.
const WARMUP_FRACTION: f64 = 0.1;
/// After the arrivals stop, requests still open after this long count as unfinished.
const DRAIN_MAX: Nanos = Nanos::from_secs(2);

pub struct EmuRunner {
    device: EmuDevice,
    rng: Xoshiro256PlusPlus,
    seed: u64,
    next_tag: u64,
}

impl EmuRunner {
    /// A steady-state (preconditioned) device; see [`EmuRunner::fresh`].
    pub fn new(
        profile: EmuProfile,
        capacity_bytes: u64,
        seed: u64,
    ) -> Result<EmuRunner, CalibrateError> {
        let device = EmuDevice::new(profile, capacity_bytes, seed)?;
        Ok(EmuRunner {
            device,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x0a11_0ad5),
            seed,
            next_tag: 0,
        })
    }

    /// A never-written device: garbage collection costs nothing until it has been filled, so
    /// calibrating it without preconditioning underestimates the write cost.
    pub fn fresh(
        profile: EmuProfile,
        capacity_bytes: u64,
        seed: u64,
    ) -> Result<EmuRunner, CalibrateError> {
        let mut runner = EmuRunner::new(profile, capacity_bytes, seed)?;
        runner.device.set_fresh();
        Ok(runner)
    }

    pub fn device(&self) -> &EmuDevice {
        &self.device
    }

    fn uniform(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn exponential_ns(&mut self, rate_per_sec: f64) -> u64 {
        let u = self.uniform();
        ((-(1.0 - u).ln()) / rate_per_sec * 1e9).max(1.0) as u64
    }

    fn random_offset(&mut self, size_bytes: u32) -> u64 {
        let slots = (self.device.capacity_bytes() / u64::from(size_bytes)).max(1);
        (self.rng.next_u64() % slots) * u64::from(size_bytes)
    }

    /// Closed-loop writes (for preconditioning): keeps `depth` in flight until `count` are done.
    fn closed_loop_writes(
        &mut self,
        count: u64,
        depth: u32,
        mut offset_of: impl FnMut(&mut Self, u64) -> u64,
        size_bytes: u32,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), CalibrateError> {
        let mut submitted = 0u64;
        let mut completed = 0u64;
        let mut out = Vec::new();
        let mut now = self.device.now();
        while completed < count {
            while submitted < count && submitted - completed < u64::from(depth) {
                let offset = offset_of(self, submitted);
                self.device.submit(
                    now,
                    EmuRequest {
                        tag: submitted,
                        kind: EmuOpKind::Write,
                        offset,
                        len: size_bytes,
                        queue: 0,
                    },
                )?;
                submitted += 1;
            }
            let Some(next) = self.device.next_event() else {
                return Err(CalibrateError::Runner(
                    "device idle with writes open".into(),
                ));
            };
            now = next;
            out.clear();
            self.device.advance(now, &mut out);
            completed += out.len() as u64;
            progress(completed);
        }
        self.drain(Nanos::MAX, &mut |_| {});
        Ok(())
    }

    /// Runs the device until idle or `limit`, handing each completion to `sink`.
    fn drain(&mut self, limit: Nanos, sink: &mut dyn FnMut(&EmuCompletion)) {
        let mut out = Vec::new();
        while let Some(next) = self.device.next_event() {
            if next > limit {
                break;
            }
            out.clear();
            self.device.advance(next, &mut out);
            out.iter().for_each(&mut *sink);
        }
    }
}

impl LoadRunner for EmuRunner {
    fn describe(&self) -> String {
        format!(
            "{} in virtual time (seed {})",
            self.device.profile().name,
            self.seed
        )
    }

    fn precondition(
        &mut self,
        plan: &PreconditionPlan,
        progress: &mut dyn FnMut(f64),
    ) -> Result<(), CalibrateError> {
        let capacity = self.device.capacity_bytes();
        let block = plan.sequential_block_bytes.max(4096);
        let sequential = capacity / u64::from(block);
        let random = (capacity as f64 / 4096.0 * plan.random_write_capacity_multiple) as u64;
        let total = (sequential + random).max(1) as f64;
        self.closed_loop_writes(
            sequential,
            plan.queue_depth.max(1),
            |_, index| index * u64::from(block),
            block,
            &mut |done| progress(done as f64 / total),
        )?;
        self.closed_loop_writes(
            random,
            plan.queue_depth.max(1),
            |runner, _| runner.random_offset(4096),
            4096,
            &mut |done| progress((sequential + done) as f64 / total),
        )?;
        Ok(())
    }

    fn run_point(
        &mut self,
        rate_per_sec: f64,
        read_ratio: f64,
        size_bytes: u32,
        duration: Nanos,
    ) -> Result<PointResult, CalibrateError> {
        super::check_point_arguments(
            rate_per_sec,
            read_ratio,
            size_bytes,
            duration,
            512,
            self.device.capacity_bytes(),
        )?;
        // Start from an idle device at a whole millisecond, so points do not overlap.
        self.drain(Nanos::MAX, &mut |_| {});
        let start = Nanos(self.device.now().0.div_ceil(1_000_000) * 1_000_000);
        let end = start + duration;
        let window_start = start + Nanos((duration.0 as f64 * WARMUP_FRACTION) as u64);
        let first_tag = self.next_tag;
        // Submit time and kind of each request of this point, indexed by tag - first_tag.
        let mut requests: Vec<(Nanos, bool, bool)> = Vec::new();
        let mut read_latencies_ns = Vec::new();
        let mut write_latencies_ns = Vec::new();
        let mut completed_in_window = 0u64;
        let mut refused = 0u64;
        let mut record = |done: &EmuCompletion, requests: &mut Vec<(Nanos, bool, bool)>| {
            let index = (done.tag - first_tag) as usize;
            let (submitted, is_read, finished) = &mut requests[index];
            *finished = true;
            if done.completed_at >= window_start && done.completed_at <= end {
                completed_in_window += 1;
            }
            if *submitted >= window_start {
                let latency = done.completed_at.saturating_since(*submitted).0;
                if *is_read {
                    read_latencies_ns.push(latency);
                } else {
                    write_latencies_ns.push(latency);
                }
            }
        };
        let mut next_arrival = start + Nanos(self.exponential_ns(rate_per_sec));
        let mut out = Vec::new();
        loop {
            let next_event = self.device.next_event();
            let arrival_due = next_arrival < end && next_event.is_none_or(|e| next_arrival <= e);
            if arrival_due {
                let is_read = self.uniform() < read_ratio;
                let offset = self.random_offset(size_bytes);
                let tag = self.next_tag;
                self.next_tag += 1;
                requests.push((next_arrival, is_read, false));
                let request = EmuRequest {
                    tag,
                    kind: if is_read {
                        EmuOpKind::Read
                    } else {
                        EmuOpKind::Write
                    },
                    offset,
                    len: size_bytes,
                    queue: 0,
                };
                if self.device.submit(next_arrival, request).is_err() {
                    refused += 1;
                    if let Some(entry) = requests.last_mut() {
                        entry.2 = true;
                    }
                }
                next_arrival += Nanos(self.exponential_ns(rate_per_sec));
                continue;
            }
            let Some(at) = next_event else { break };
            if at > end + DRAIN_MAX {
                break;
            }
            out.clear();
            self.device.advance(at, &mut out);
            for done in &out {
                record(done, &mut requests);
            }
        }
        // Requests still open after the drain limit count with the time they have waited.
        let give_up = self.device.now().max(end);
        let mut unfinished = 0;
        for (submitted, is_read, finished) in &requests {
            if !finished {
                unfinished += 1;
                if *submitted >= window_start {
                    let waited = give_up.saturating_since(*submitted).0;
                    if *is_read {
                        read_latencies_ns.push(waited);
                    } else {
                        write_latencies_ns.push(waited);
                    }
                }
            }
        }
        if unfinished > 0 {
            // Let the device finish so the next point starts clean; these no longer count.
            let base = first_tag;
            let count = requests.len() as u64;
            self.drain(Nanos::MAX, &mut |done| {
                debug_assert!(done.tag >= base && done.tag < base + count);
            });
        }
        let window_secs = end.saturating_since(window_start).as_secs_f64();
        let measured_reads = read_latencies_ns.len() as u64;
        let measured_writes = write_latencies_ns.len() as u64;
        Ok(PointResult {
            rate_per_sec,
            read_ratio,
            size_bytes,
            iops: completed_in_window as f64 / window_secs,
            reads: measured_reads,
            writes: measured_writes,
            read_latency_us_p50: percentile_us(&mut read_latencies_ns, 0.50),
            read_latency_us_p95: percentile_us(&mut read_latencies_ns, 0.95),
            read_latency_us_p99: percentile_us(&mut read_latencies_ns, 0.99),
            write_latency_us_p95: percentile_us(&mut write_latencies_ns, 0.95),
            refused,
            unfinished,
            read_latency_us_p95_runs: Vec::new(),
        })
    }
}

/// The `quantile` of `values` (nanoseconds) in µs, nearest-rank; 0 when empty.
pub(crate) fn percentile_us(values: &mut [u64], quantile: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let rank = ((quantile * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1;
    let (_, value, _) = values.select_nth_unstable(rank);
    *value as f64 / 1e3
}
