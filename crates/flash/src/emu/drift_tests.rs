//! Tests of drift (slowdowns and stalls) on the model, in virtual time from fixed seeds.

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};

use super::*;

const SEED: u64 = 0x0d71_f7ed;

/// A device-a-small model drifting by the schedule of `spec` (`emu(...):device-a-small`).
fn device(spec: &str) -> EmuDevice {
    let (schedule, name) = split_spec(spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let profile = EmuProfile::lookup(name).unwrap_or_else(|e| panic!("{spec}: {e}"));
    let mut device = EmuDevice::new(profile, 1 << 30, SEED).unwrap_or_else(|e| panic!("{e}"));
    device
        .set_schedule(schedule)
        .unwrap_or_else(|e| panic!("{spec}: {e}"));
    device
}

/// A steady read load: Poisson arrivals of 4 KiB reads, `gap` apart on average, from 0 to
/// `end` (random offsets; all from the seed), driven like the simulator drives the model;
/// every completion, in completion order.
fn steady_reads(device: &mut EmuDevice, gap: Nanos, end: Nanos) -> Vec<EmuCompletion> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(SEED);
    let pages = device.capacity_bytes() / 4096;
    let mut out = Vec::new();
    let mut tag = 0;
    let mut at = Nanos::ZERO;
    while at < end {
        device.advance(at, &mut out);
        let request = EmuRequest {
            tag,
            kind: EmuOpKind::Read,
            offset: (rng.next_u64() % pages) * 4096,
            len: 4096,
            queue: 0,
        };
        device
            .submit(at, request)
            .unwrap_or_else(|e| panic!("seed {SEED}: {e}"));
        tag += 1;
        let uniform = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        at += Nanos((-(1.0 - uniform).ln() * gap.0 as f64).max(1.0) as u64);
    }
    while let Some(next) = device.next_event() {
        device.advance(next, &mut out);
    }
    assert_eq!(out.len() as u64, tag, "seed {SEED}: every read completes");
    out
}

/// Latencies (ns, sorted) of the reads submitted in `[from, to)`.
fn latencies(done: &[EmuCompletion], from: Nanos, to: Nanos) -> Vec<u64> {
    let mut latencies: Vec<u64> = done
        .iter()
        .filter(|c| c.submitted_at >= from && c.submitted_at < to)
        .map(|c| c.latency().0)
        .collect();
    latencies.sort_unstable();
    assert!(!latencies.is_empty(), "no reads in {from:?}..{to:?}");
    latencies
}

fn quantile(sorted: &[u64], q: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[test]
fn a_slowdown_doubles_read_latency_and_a_speed_up_restores_it() {
    let spec = "emu(slow=2x@1s;slow=1x@2s;origin=zero):device-a-small";
    let run = || {
        steady_reads(
            &mut device(spec),
            Nanos::from_micros(100),
            Nanos::from_secs(3),
        )
    };
    let done = run();
    assert_eq!(
        done,
        run(),
        "seed {SEED}: same seed, same schedule, same completions"
    );
    let ms = Nanos::from_millis;
    let before = latencies(&done, ms(200), ms(1000));
    let slow = latencies(&done, ms(1200), ms(2000));
    let after = latencies(&done, ms(2200), ms(3000));
    // 10K reads/s is read-only load: a read alone takes 40 µs of die time + 10 µs of
    // controller; at 2x exactly twice that.
    assert_eq!(before[0], 50_000, "seed {SEED}");
    assert_eq!(slow[0], 100_000, "seed {SEED}");
    assert_eq!(after[0], 50_000, "seed {SEED}");
    let ratio = |q: f64| quantile(&slow, q) as f64 / quantile(&before, q) as f64;
    assert!(
        (1.95..=2.05).contains(&ratio(0.5)),
        "seed {SEED}: median {} -> {} ns",
        quantile(&before, 0.5),
        quantile(&slow, 0.5)
    );
    // Queueing grows a little more than 2x (twice the utilisation), not much at 10 %.
    assert!(
        (2.0..=2.6).contains(&ratio(0.95)),
        "seed {SEED}: p95 {} -> {} ns",
        quantile(&before, 0.95),
        quantile(&slow, 0.95)
    );
    let recovered = quantile(&after, 0.95) as f64 / quantile(&before, 0.95) as f64;
    assert!(
        (0.9..=1.1).contains(&recovered),
        "seed {SEED}: p95 {} ns before, {} ns after the speed-up",
        quantile(&before, 0.95),
        quantile(&after, 0.95)
    );
}

#[test]
fn a_stall_holds_completions_until_it_ends() {
    let ms = Nanos::from_millis;
    let mut device = device("emu(stall=500ms-600ms;origin=zero):device-a-small");
    let done = steady_reads(&mut device, Nanos::from_micros(100), ms(1000));
    // Reads fetched before the stall finish in its first microseconds; then nothing completes.
    let during: Vec<&EmuCompletion> = done
        .iter()
        .filter(|c| c.completed_at > ms(500) && c.completed_at < ms(600))
        .collect();
    assert!(
        during
            .iter()
            .all(|c| c.submitted_at < ms(500) && c.completed_at < Nanos(500_200_000)),
        "seed {SEED}: completions during the stall {during:?}"
    );
    // The ~1,000 reads submitted during the stall all start at its end: none finishes before
    // one read's time after it, and they drain at the device's rate (4 dies, 40 µs each).
    let held: Vec<&EmuCompletion> = done
        .iter()
        .filter(|c| c.submitted_at >= ms(500) && c.submitted_at < ms(600))
        .collect();
    assert!(
        (900..1100).contains(&held.len()),
        "seed {SEED}: {} reads in 100 ms at 10K/s",
        held.len()
    );
    let first = held
        .iter()
        .map(|c| c.completed_at)
        .min()
        .unwrap_or(Nanos::MAX);
    let last = held
        .iter()
        .map(|c| c.completed_at)
        .max()
        .unwrap_or(Nanos::ZERO);
    assert_eq!(first, Nanos(600_050_000), "seed {SEED}");
    assert!(
        last < ms(620),
        "seed {SEED}: the backlog drained at {last:?}"
    );
    // Afterwards latency is what it was before.
    let before = latencies(&done, ms(100), ms(500));
    let after = latencies(&done, ms(700), ms(1000));
    assert_eq!(after[0], before[0], "seed {SEED}");
    assert!(
        quantile(&after, 0.95) <= quantile(&before, 0.95) * 11 / 10,
        "seed {SEED}: p95 {} ns before, {} ns after",
        quantile(&before, 0.95),
        quantile(&after, 0.95)
    );
    let state = device.drift_state();
    assert!(!state.stalled, "seed {SEED}: {state:?}");
    assert_eq!(state.changes, 2, "seed {SEED}: stall and lift: {state:?}");
}

/// One command on an idle device; its latency.
fn alone(device: &mut EmuDevice, at: Nanos, kind: EmuOpKind, tag: u64) -> Nanos {
    let mut out = Vec::new();
    let request = EmuRequest {
        tag,
        kind,
        offset: 0,
        len: 4096,
        queue: 0,
    };
    device.submit(at, request).unwrap_or_else(|e| panic!("{e}"));
    while out.is_empty() {
        let next = device
            .next_event()
            .unwrap_or_else(|| panic!("seed {SEED}: command {tag} never completes"));
        device.advance(next, &mut out);
    }
    assert_eq!(out.len(), 1, "seed {SEED}");
    out[0].latency()
}

#[test]
fn the_handle_slows_writes_and_flushes_at_run_time() {
    let mut device = device("device-a-small");
    let controls = device.controls();
    let us = Nanos::from_micros;
    assert_eq!(alone(&mut device, us(10), EmuOpKind::Write, 1), us(15));
    assert_eq!(alone(&mut device, us(100), EmuOpKind::Flush, 2), us(10));
    // 2.5x from the next call on: the write's acknowledgement and the controller time.
    controls.set_slowdown(Slowdown::from_factor(2.5).unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(
        alone(&mut device, us(200), EmuOpKind::Write, 3),
        Nanos(37_500)
    );
    assert_eq!(alone(&mut device, us(300), EmuOpKind::Flush, 4), us(25));
    assert_eq!(device.drift_state().slowdown_permille, 2_500);
    // A schedule's factor and the handle's multiply: 2x × 2.5x = 5x for work from 1 ms on.
    device
        .set_schedule(
            EmuSchedule::parse("slow=2x@1ms;origin=zero").unwrap_or_else(|e| panic!("{e}")),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(alone(&mut device, us(400), EmuOpKind::Flush, 5), us(25));
    assert_eq!(alone(&mut device, us(1500), EmuOpKind::Flush, 6), us(50));
    controls.set_slowdown(Slowdown::NONE);
    assert_eq!(alone(&mut device, us(2000), EmuOpKind::Flush, 7), us(20));
}

#[test]
fn the_handle_stalls_and_lifts_at_the_next_call() {
    let mut device = device("device-a-small");
    let controls = device.controls();
    controls.set_stalled(true);
    let mut out = Vec::new();
    let stalled_at = Nanos::from_millis(10);
    let flush = EmuRequest {
        tag: 1,
        kind: EmuOpKind::Flush,
        offset: 0,
        len: 0,
        queue: 0,
    };
    device
        .submit(stalled_at, flush)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(device.drift_state().stalled);
    // Nothing starts, and the device asks to be re-checked so a lift is seen.
    assert_eq!(
        device.next_event(),
        Some(stalled_at + drift::CONTROL_RECHECK)
    );
    device.advance(Nanos::from_millis(50), &mut out);
    assert!(
        out.is_empty(),
        "seed {SEED}: completed while stalled: {out:?}"
    );
    controls.set_stalled(false);
    // The lift applies at the next call's `now`: the flush starts then.
    let lifted_at = Nanos::from_millis(60);
    device.advance(lifted_at, &mut out);
    assert!(out.is_empty());
    let next = device
        .next_event()
        .unwrap_or_else(|| panic!("the flush is pending"));
    device.advance(next, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(
        out[0].completed_at,
        lifted_at + Nanos::from_micros(10),
        "seed {SEED}"
    );
    assert!(!controls.state().stalled);
    assert_eq!(device.next_event(), None, "idle: no re-checks");
}

#[test]
fn stalled_background_work_and_waiting_writes_start_at_the_end() {
    // Writes fill a small buffer; a stall then holds the background slices and the writes
    // that wait for room. Everything still completes, after the stall, and the buffer empties.
    let mut profile = EmuProfile::lookup("device-a-small").unwrap_or_else(|e| panic!("{e}"));
    profile.write_buffer_pages = 1024;
    let mut device = EmuDevice::new(profile, 1 << 30, SEED).unwrap_or_else(|e| panic!("{e}"));
    device
        .set_schedule(
            EmuSchedule::parse("stall=10ms-30ms;origin=zero").unwrap_or_else(|e| panic!("{e}")),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    let mut out = Vec::new();
    for index in 0..1500u64 {
        let at = Nanos::from_micros(index * 10);
        device.advance(at, &mut out);
        let write = EmuRequest {
            tag: index,
            kind: EmuOpKind::Write,
            offset: index * 4096,
            len: 4096,
            queue: 0,
        };
        device.submit(at, write).unwrap_or_else(|e| panic!("{e}"));
    }
    while let Some(next) = device.next_event() {
        device.advance(next, &mut out);
    }
    assert_eq!(out.len(), 1500, "seed {SEED}");
    let ms = Nanos::from_millis;
    assert!(
        out.iter()
            .all(|c| c.completed_at <= Nanos(10_015_000) || c.completed_at >= ms(30)),
        "seed {SEED}: a write was acknowledged during the stall"
    );
    let submitted_in_stall = out.iter().filter(|c| c.submitted_at >= ms(10)).count();
    assert_eq!(submitted_in_stall, 500, "seed {SEED}");
    assert!(
        out.iter()
            .filter(|c| c.submitted_at >= ms(10))
            .all(|c| c.completed_at >= ms(30)),
        "seed {SEED}"
    );
    assert!(
        device.stats().writes_stalled > 0,
        "seed {SEED}: the buffer filled"
    );
    assert!(device.is_idle(), "seed {SEED}");
    assert_eq!(device.buffer_used_pages(), 0, "seed {SEED}");
    let stats = device.stats();
    assert_eq!(
        stats.die_background_ns,
        1500 * device.profile().write_work_ns(),
        "seed {SEED}: all background work ran at 1x"
    );
}
