//! Tests of the emulated device: latency behaviour, calibration, arbitration scenarios
//! (Gugnani et al. §V-D and Figure 7), and data integrity through the real-clock device.
//! All run in virtual time from fixed seeds, printed in every assertion message.

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};

use super::*;
use crate::calibrate::{EmuRunner, LoadRunner, PreconditionPlan, SweepConfig, fit, sweep};
use crate::queueing;

const SEED: u64 = 0x00c0_ffee;

/// A device for arbitration tests: reads only, so the bottleneck is the command slots.
fn arbitration_profile(policy: ArbitrationPolicy, burst: u32) -> EmuProfile {
    let mut profile = EmuProfile::lookup("device-a-small").unwrap();
    profile.name = "arbitration-test".into();
    profile.channels = 4;
    profile.dies_per_channel = 4;
    profile.queue_depth_max = 16;
    profile.queue_count = 8;
    profile.queue_entries_max = 1024;
    profile.arbitration = ArbitrationConfig {
        policy,
        burst,
        queue_classes: Vec::new(),
        default_class: PriorityClass::Medium,
    };
    profile
}

/// One job: a submission queue in a class, cycling through request sizes; closed loop with
/// `depth` outstanding, or open loop (Poisson) at `rate_per_sec`.
#[derive(Debug, Clone)]
struct Job {
    queue: u16,
    class: PriorityClass,
    sizes: Vec<u32>,
    depth: u32,
    rate_per_sec: Option<f64>,
}

impl Job {
    fn closed(queue: u16, class: PriorityClass, sizes: &[u32], depth: u32) -> Job {
        Job {
            queue,
            class,
            sizes: sizes.to_vec(),
            depth,
            rate_per_sec: None,
        }
    }
    fn open(queue: u16, class: PriorityClass, size: u32, rate_per_sec: f64) -> Job {
        Job {
            queue,
            class,
            sizes: vec![size],
            depth: 0,
            rate_per_sec: Some(rate_per_sec),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct JobResult {
    bytes: u64,
    commands: u64,
    latency_sum_ns: u128,
    latency_count: u64,
    latency_max_ns: u64,
    submitted_in_window: u64,
}

impl JobResult {
    fn iops(&self, window: Nanos) -> f64 {
        self.commands as f64 / window.as_secs_f64()
    }
    fn latency_us_mean(&self) -> f64 {
        self.latency_sum_ns as f64 / self.latency_count.max(1) as f64 / 1e3
    }
}

/// Runs the jobs on `device` for `warmup + window` of virtual time (reads only) and reports
/// what completed inside the window.
fn run_jobs(
    device: &mut EmuDevice,
    jobs: &[Job],
    warmup: Nanos,
    window: Nanos,
    seed: u64,
) -> Vec<JobResult> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for job in jobs {
        device.set_queue_class(job.queue, job.class).unwrap();
    }
    let start = device.now();
    let window_start = start + warmup;
    let end = window_start + window;
    let capacity = device.capacity_bytes();
    let mut results = vec![JobResult::default(); jobs.len()];
    let mut sequence = vec![0u64; jobs.len()];
    let mut next_open: Vec<Option<Nanos>> =
        jobs.iter().map(|j| j.rate_per_sec.map(|_| start)).collect();
    let submit = |device: &mut EmuDevice,
                  job_index: usize,
                  at: Nanos,
                  sequence: &mut [u64],
                  rng: &mut Xoshiro256PlusPlus| {
        let job = &jobs[job_index];
        let size = job.sizes[(sequence[job_index] % job.sizes.len() as u64) as usize];
        let slots = capacity / u64::from(size);
        let offset = (rng.next_u64() % slots) * u64::from(size);
        let tag = ((job_index as u64) << 48) | sequence[job_index];
        sequence[job_index] += 1;
        device
            .submit(
                at,
                EmuRequest {
                    tag,
                    kind: EmuOpKind::Read,
                    offset,
                    len: size,
                    queue: job.queue,
                },
            )
            .unwrap();
    };
    for (index, job) in jobs.iter().enumerate() {
        for _ in 0..job.depth {
            submit(device, index, start, &mut sequence, &mut rng);
        }
    }
    let mut out = Vec::new();
    loop {
        let open_due = next_open
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.map(|t| (t, i)))
            .min();
        let event = device.next_event();
        let time = match (open_due, event) {
            (Some((t, _)), Some(e)) => t.min(e),
            (Some((t, _)), None) => t,
            (None, Some(e)) => e,
            (None, None) => break,
        };
        if time > end {
            break;
        }
        if let Some((t, index)) = open_due.filter(|&(t, _)| t == time) {
            if t >= window_start {
                results[index].submitted_in_window += 1;
            }
            submit(device, index, t, &mut sequence, &mut rng);
            let rate = jobs[index].rate_per_sec.unwrap_or(1.0);
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            let gap = (-(1.0 - u).ln() / rate * 1e9).max(1.0) as u64;
            next_open[index] = Some(t + Nanos(gap));
            continue;
        }
        out.clear();
        device.advance(time, &mut out);
        for done in &out {
            let index = (done.tag >> 48) as usize;
            if done.completed_at >= window_start {
                let result = &mut results[index];
                result.bytes += u64::from(done.len);
                result.commands += 1;
                if done.submitted_at >= window_start {
                    let latency = done.latency().0;
                    result.latency_sum_ns += u128::from(latency);
                    result.latency_count += 1;
                    result.latency_max_ns = result.latency_max_ns.max(latency);
                }
            }
            if jobs[index].rate_per_sec.is_none() {
                submit(device, index, done.completed_at, &mut sequence, &mut rng);
            }
        }
    }
    results
}

fn p95_at(runner: &mut EmuRunner, rate: f64, read_ratio: f64) -> f64 {
    runner
        .run_point(rate, read_ratio, 4096, Nanos::from_millis(400))
        .unwrap()
        .read_latency_us_p95
}

#[test]
fn p95_grows_with_load_and_with_write_share() {
    let profile = EmuProfile::lookup("device-a-small").unwrap();
    let mut runner = EmuRunner::new(profile, 1 << 30, SEED).unwrap();
    let by_load: Vec<f64> = [10_000.0, 40_000.0, 70_000.0, 90_000.0]
        .iter()
        .map(|&rate| p95_at(&mut runner, rate, 1.0))
        .collect();
    assert!(
        by_load.windows(2).all(|w| w[0] < w[1]),
        "seed {SEED}: read-only p95 by load {by_load:?}"
    );
    let by_mix: Vec<f64> = [1.0, 0.95, 0.75, 0.5]
        .iter()
        .map(|&ratio| p95_at(&mut runner, 8_000.0, ratio))
        .collect();
    assert!(
        by_mix.windows(2).all(|w| w[0] < w[1]),
        "seed {SEED}: p95 at 8K IOPS by read ratio 100/95/75/50 % {by_mix:?}"
    );
    // Unloaded reads cost about one die read plus the controller.
    assert!(by_load[0] < 120.0, "seed {SEED}: {by_load:?}");
}

#[test]
fn calibration_recovers_the_write_cost_and_a_monotone_table() {
    // device-a-small's timings on 8 dies, background spread scaled as for the shipped profiles.
    let mut profile = EmuProfile::lookup("device-a-small").unwrap();
    profile.channels = 4;
    profile.dies_per_channel = 2;
    profile.flush_spread_ns = 20_000_000;
    let expected = profile.write_cost();
    let mut runner = EmuRunner::new(profile, 1 << 30, SEED).unwrap();
    let config = SweepConfig {
        duration_us: 400_000,
        points_per_curve: 16,
        start_rate_per_sec: 2000.0,
        ..SweepConfig::default()
    };
    let measured = sweep(&mut runner, &config, &mut |_| {}).unwrap();
    let fitted = fit(&measured, &crate::calibrate::SLOS_US_DEFAULT).unwrap();
    let error = (fitted.write_cost - expected).abs() / expected;
    assert!(
        error < 0.10,
        "seed {SEED}: fitted write cost {} vs configured {expected}",
        fitted.write_cost
    );
    assert!(
        (0.35..0.6).contains(&fitted.read_only_read_cost),
        "seed {SEED}: read-only cost {}",
        fitted.read_only_read_cost
    );
    let rows = &fitted.profile.token_limits;
    assert!(rows.len() >= 5, "seed {SEED}: {rows:?}");
    for pair in rows.windows(2) {
        assert!(
            pair[0].latency_us_p95 < pair[1].latency_us_p95,
            "seed {SEED}: {rows:?}"
        );
        assert!(
            pair[0].tokens_per_sec <= pair[1].tokens_per_sec,
            "seed {SEED}: {rows:?}"
        );
        assert!(
            pair[0].reads_per_sec_read_only <= pair[1].reads_per_sec_read_only,
            "seed {SEED}: {rows:?}"
        );
    }
    assert!(fitted.profile.validate().is_ok());
}

#[test]
fn preconditioning_brings_a_fresh_device_to_steady_state() {
    let profile = EmuProfile::lookup("device-a-small").unwrap();
    let capacity = 8 << 20;
    let mut runner = EmuRunner::fresh(profile.clone(), capacity, SEED).unwrap();
    let mut last = 0.0;
    runner
        .precondition(&PreconditionPlan::default(), &mut |done| last = done)
        .unwrap();
    assert!(
        (last - 1.0).abs() < 1e-9,
        "seed {SEED}: progress ended at {last}"
    );
    let stats = runner.device().stats();
    let pages = (capacity / 4096) * 2;
    assert_eq!(stats.pages_written, pages, "seed {SEED}");
    // GC ramps up during the sequential fill and is at full cost for the random writes.
    let full = pages * profile.write_work_ns();
    assert!(stats.die_background_ns < full, "seed {SEED}: {stats:?}");
    assert!(
        stats.die_background_ns > full * 7 / 10,
        "seed {SEED}: {stats:?}"
    );
}

#[test]
fn same_seed_same_completions() {
    let run = |seed: u64| {
        let mut device =
            EmuDevice::new(EmuProfile::lookup("device-a-small").unwrap(), 1 << 30, seed).unwrap();
        let mut out = Vec::new();
        for i in 0..200u64 {
            let kind = if i % 3 == 0 {
                EmuOpKind::Write
            } else {
                EmuOpKind::Read
            };
            let request = EmuRequest {
                tag: i,
                kind,
                offset: (i * 7919 % 1000) * 4096,
                len: 4096,
                queue: 0,
            };
            device.submit(Nanos::from_micros(i * 20), request).unwrap();
        }
        device.advance(Nanos::from_secs(1), &mut out);
        out
    };
    let first = run(SEED);
    assert_eq!(first.len(), 200);
    assert_eq!(first, run(SEED), "seed {SEED}");
}

/// A job's class and the request sizes it cycles through.
type JobSpec<'a> = (PriorityClass, &'a [u32]);
/// Name, job A, job B, bandwidth ratio A/B the weights ask for, ratio WRR gives by commands.
type Scenario<'a> = (&'a str, JobSpec<'a>, JobSpec<'a>, f64, f64);

/// Gugnani et al. §V-D: two jobs submitting back to back; bandwidth ratio job A / job B.
fn two_jobs(
    policy: ArbitrationPolicy,
    a: (PriorityClass, &[u32]),
    b: (PriorityClass, &[u32]),
) -> f64 {
    let profile = arbitration_profile(policy, 8);
    let mut device = EmuDevice::new(profile, 1 << 30, SEED).unwrap();
    let jobs = [Job::closed(0, a.0, a.1, 128), Job::closed(1, b.0, b.1, 128)];
    let results = run_jobs(
        &mut device,
        &jobs,
        Nanos::from_millis(20),
        Nanos::from_millis(400),
        SEED,
    );
    results[0].bytes as f64 / results[1].bytes as f64
}

#[test]
fn wrr_follows_weights_in_commands_and_drr_in_bytes() {
    use PriorityClass::{High, Low, Medium};
    let wrr = ArbitrationPolicy::WeightedRoundRobin {
        weights: ClassWeights {
            high: 32,
            medium: 16,
            low: 8,
        },
    };
    let drr = ArbitrationPolicy::DeficitRoundRobin {
        quantum_bytes: ClassWeights {
            high: 128 << 10,
            medium: 64 << 10,
            low: 32 << 10,
        },
    };
    // (scenario, job A, job B, ratio the weights ask for, ratio WRR gives by command counts)
    let scenarios: [Scenario<'_>; 5] = [
        (
            "1: high 4k / medium 8k",
            (High, &[4096]),
            (Medium, &[8192]),
            2.0,
            1.0,
        ),
        (
            "2: high 4k / high 4k",
            (High, &[4096]),
            (High, &[4096]),
            1.0,
            1.0,
        ),
        (
            "3: high 4k / low 8k",
            (High, &[4096]),
            (Low, &[8192]),
            4.0,
            2.0,
        ),
        (
            "4: low 4k / high 8k",
            (Low, &[4096]),
            (High, &[8192]),
            0.25,
            0.125,
        ),
        (
            "5: high 4k+8k / high 8k+16k",
            (High, &[4096, 8192]),
            (High, &[8192, 16384]),
            1.0,
            0.5,
        ),
    ];
    for (name, a, b, expected, wrr_expected) in scenarios {
        let ratio_drr = two_jobs(drr.clone(), a, b);
        assert!(
            (ratio_drr / expected - 1.0).abs() < 0.05,
            "seed {SEED}: scenario {name}: DRR ratio {ratio_drr:.3}, expected {expected}"
        );
        let ratio_wrr = two_jobs(wrr.clone(), a, b);
        assert!(
            (ratio_wrr / wrr_expected - 1.0).abs() < 0.05,
            "seed {SEED}: scenario {name}: WRR ratio {ratio_wrr:.3}, by commands {wrr_expected}"
        );
        if expected != wrr_expected {
            // WRR skews toward the job with larger requests.
            let larger_is_a = a.1.iter().sum::<u32>() > b.1.iter().sum::<u32>();
            assert_eq!(
                ratio_wrr > expected,
                larger_is_a,
                "seed {SEED}: scenario {name}"
            );
        }
    }
}

#[test]
fn queueing_model_predicts_the_high_class() {
    use PriorityClass::{High, Low, Medium};
    let weights_bytes = [128u32 << 10, 64 << 10, 32 << 10];
    let policy = ArbitrationPolicy::DeficitRoundRobin {
        quantum_bytes: ClassWeights {
            high: weights_bytes[0],
            medium: weights_bytes[1],
            low: weights_bytes[2],
        },
    };
    let size = 32 << 10;
    let queue_depth = 32;
    let warmup = Nanos::from_millis(50);
    let window = Nanos::from_millis(1000);
    // γ: the device's throughput with one backlogged job.
    let mut device = EmuDevice::new(arbitration_profile(policy.clone(), 8), 1 << 30, SEED).unwrap();
    let alone = run_jobs(
        &mut device,
        &[Job::closed(0, High, &[size], 128)],
        warmup,
        window,
        SEED,
    );
    let gamma = alone[0].iops(window);
    let weights = weights_bytes.map(f64::from);
    for rho_low in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let mut jobs = vec![
            Job::closed(0, High, &[size], queue_depth),
            Job::closed(1, Medium, &[size], 128),
        ];
        if rho_low >= 1.0 {
            jobs.push(Job::closed(2, Low, &[size], 128));
        } else if rho_low > 0.0 {
            let round = weights[0] + weights[1] + rho_low * weights[2];
            jobs.push(Job::open(
                2,
                Low,
                size,
                rho_low * weights[2] / round * gamma,
            ));
        }
        let mut device =
            EmuDevice::new(arbitration_profile(policy.clone(), 8), 1 << 30, SEED).unwrap();
        let results = run_jobs(&mut device, &jobs, warmup, window, SEED);
        let utilisations = [1.0, 1.0, rho_low];
        let predicted_iops =
            queueing::expected_throughput(&weights, &utilisations, High, f64::INFINITY, gamma)
                .unwrap();
        let predicted_latency_us = queueing::worst_latency_us(
            &weights,
            &utilisations,
            High,
            f64::from(queue_depth),
            1.0,
            1e6 / gamma,
        )
        .unwrap();
        let iops = results[0].iops(window);
        let latency_us = results[0].latency_us_mean();
        assert!(
            (iops / predicted_iops - 1.0).abs() < 0.05,
            "seed {SEED}: ρ_l {rho_low}: high IOPS {iops:.0}, model {predicted_iops:.0} (γ {gamma:.0})"
        );
        assert!(
            (latency_us / predicted_latency_us - 1.0).abs() < 0.05,
            "seed {SEED}: ρ_l {rho_low}: high latency {latency_us:.0} µs, model {predicted_latency_us:.0} µs"
        );
    }
}

#[test]
fn urgent_class_is_never_starved() {
    use PriorityClass::{High, Low, Medium, Urgent};
    let weights = ClassWeights {
        high: 32,
        medium: 16,
        low: 8,
    };
    for policy in [
        ArbitrationPolicy::WeightedRoundRobin { weights },
        ArbitrationPolicy::DeficitRoundRobin {
            quantum_bytes: ClassWeights {
                high: 128 << 10,
                medium: 64 << 10,
                low: 32 << 10,
            },
        },
    ] {
        let run = |urgent_class: PriorityClass| {
            let mut device =
                EmuDevice::new(arbitration_profile(policy.clone(), 8), 1 << 30, SEED).unwrap();
            let jobs = [
                Job::closed(0, High, &[16384], 256),
                Job::closed(1, Medium, &[16384], 256),
                Job::closed(2, Low, &[16384], 256),
                Job::open(3, urgent_class, 4096, 2000.0),
            ];
            run_jobs(
                &mut device,
                &jobs,
                Nanos::from_millis(20),
                Nanos::from_millis(500),
                SEED,
            )[3]
        };
        let urgent = run(Urgent);
        let as_low = run(Low);
        // Every urgent request submitted in the window completed, and quickly: it waits for at
        // most one slot to free (a 16 KiB read on busy dies), never behind the backlog.
        assert!(
            urgent.commands + 2 >= urgent.submitted_in_window,
            "seed {SEED}: {policy:?}: urgent {urgent:?}"
        );
        // Urgent is served before every other class; under WRR a low queue waits for the
        // whole round, under DRR a light queue is served within its round anyway.
        let factor = if matches!(policy, ArbitrationPolicy::WeightedRoundRobin { .. }) {
            3.0
        } else {
            1.0
        };
        assert!(
            urgent.latency_us_mean() * factor < as_low.latency_us_mean(),
            "seed {SEED}: {policy:?}: urgent mean {} µs vs the same load as low {} µs",
            urgent.latency_us_mean(),
            as_low.latency_us_mean()
        );
        assert!(
            urgent.latency_max_ns < as_low.latency_max_ns,
            "seed {SEED}: {policy:?}: urgent max {} ns vs the same load as low {} ns",
            urgent.latency_max_ns,
            as_low.latency_max_ns
        );
    }
}

#[test]
fn real_clock_device_keeps_data_and_routes_completions() {
    use crate::{Completion, DeviceOp, OpKind, Submit};
    let device = open("emu:device-a-small", 64 << 20).unwrap();
    assert_eq!(device.info().size_bytes, 64 << 20);
    let mut thread_a = device.queue();
    let mut thread_b = device.queue();
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 251) as u8).collect();
    let now = Nanos::from_millis(1);
    let submitted = thread_a.submit(
        DeviceOp {
            user_data: 1,
            kind: OpKind::Write {
                offset: 4096,
                buf: &pattern,
                fua: false,
            },
            buf_index: None,
            queue: 0,
        },
        now,
    );
    assert!(matches!(submitted, Submit::Pending));
    let deadline = thread_a.next_deadline().unwrap();
    assert!(deadline > now);
    // Thread B polls first: A's completion must wait for A.
    let mut b_out = Vec::new();
    thread_b.poll_completions(deadline, &mut b_out);
    assert!(b_out.is_empty());
    assert_eq!(thread_a.next_deadline(), Some(Nanos::ZERO));
    let mut a_out = Vec::new();
    thread_a.poll_completions(deadline, &mut a_out);
    assert_eq!(
        a_out,
        vec![Completion {
            user_data: 1,
            result: Ok(8192)
        }]
    );

    let mut read_back = vec![0u8; 8192];
    let submitted = thread_b.submit(
        DeviceOp {
            user_data: 2,
            kind: OpKind::Read {
                offset: 4096,
                buf: &mut read_back,
            },
            buf_index: None,
            queue: 0,
        },
        deadline,
    );
    assert!(matches!(submitted, Submit::Pending));
    assert_eq!(read_back, pattern);
    thread_b.submit(
        DeviceOp {
            user_data: 3,
            kind: OpKind::Trim {
                offset: 4096,
                len: 4096,
            },
            buf_index: None,
            queue: 0,
        },
        deadline,
    );
    let mut done = Vec::new();
    thread_b.poll_completions(Nanos::from_secs(1), &mut done);
    done.sort_by_key(|c| c.user_data);
    assert_eq!(
        done,
        vec![
            Completion {
                user_data: 2,
                result: Ok(8192)
            },
            Completion {
                user_data: 3,
                result: Ok(0)
            }
        ]
    );
    thread_b.submit(
        DeviceOp {
            user_data: 4,
            kind: OpKind::Read {
                offset: 4096,
                buf: &mut read_back,
            },
            buf_index: None,
            queue: 0,
        },
        Nanos::from_secs(1),
    );
    assert!(
        read_back[..4096].iter().all(|&b| b == 0),
        "trimmed page reads zeroes"
    );
    assert_eq!(read_back[4096..], pattern[4096..]);
    // Out of range and unknown queues are refused at once.
    let refused = thread_a.submit(
        DeviceOp {
            user_data: 5,
            kind: OpKind::Read {
                offset: 64 << 20,
                buf: &mut read_back,
            },
            buf_index: None,
            queue: 0,
        },
        Nanos::from_secs(1),
    );
    assert!(matches!(refused, Submit::Done(Err(FlashError::Io { .. }))));
    let refused = thread_a.submit(
        DeviceOp {
            user_data: 6,
            kind: OpKind::Flush,
            buf_index: None,
            queue: 999,
        },
        Nanos::from_secs(1),
    );
    assert!(matches!(refused, Submit::Done(Err(FlashError::Io { .. }))));
    // A refused write changes no data.
    let refused = thread_a.submit(
        DeviceOp {
            user_data: 7,
            kind: OpKind::Write {
                offset: 8192,
                buf: &[0xee; 4096],
                fua: false,
            },
            buf_index: None,
            queue: 999,
        },
        Nanos::from_secs(1),
    );
    assert!(matches!(refused, Submit::Done(Err(FlashError::Io { .. }))));
    let mut page = vec![0u8; 4096];
    thread_a.submit(
        DeviceOp {
            user_data: 8,
            kind: OpKind::Read {
                offset: 8192,
                buf: &mut page,
            },
            buf_index: None,
            queue: 0,
        },
        Nanos::from_secs(1),
    );
    assert_eq!(page, pattern[4096..]);
}

use crate::FlashError;
