//! The monitor's arithmetic on hand-built windows.

use super::*;

const MS: u64 = 1_000_000;

fn monitor(config: FairnessConfig) -> FairnessMonitor {
    FairnessMonitor::new(config, Nanos(0)).unwrap_or_else(|e| panic!("{e}"))
}

fn flow(id: u64, requests: u64, mean_latency_us: u64) -> FlowSample {
    FlowSample {
        flow: FlowId(id),
        requests,
        latency_sum_ns: requests * mean_latency_us * 1_000,
    }
}

fn cores(busy_ms: &[u64]) -> Vec<CoreSample> {
    busy_ms
        .iter()
        .map(|&ms| CoreSample { busy_ns: ms * MS })
        .collect()
}

fn report(monitor: &mut FairnessMonitor, end_ms: u64, window: FairnessWindow) -> FairnessReport {
    monitor
        .handle_window(Nanos(end_ms * MS), &window)
        .unwrap_or_else(|e| panic!("{e}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn slowdown_fairness_and_load_balance_follow_the_papers_equations() {
    let mut m = monitor(FairnessConfig::default());
    m.set_alone(FlowId(1), 100.0);
    m.set_alone(FlowId(2), 100.0);
    // 100 ms window: flow 1 (sparse) 1,000 requests at 190 µs, flow 2 (dense) 4,000 at
    // 100 µs; T_net 10 µs; core 0 busy 90 ms, core 1 45 ms.
    let r = report(
        &mut m,
        100,
        FairnessWindow {
            flows: vec![flow(1, 1_000, 190), flow(2, 4_000, 100)],
            cores: cores(&[90, 45]),
            network_rtt_ns: 10_000,
        },
    );
    let (f1, f2) = (&r.flows[0], &r.flows[1]);
    assert!(close(f1.rt_us, 200.0) && close(f2.rt_us, 110.0));
    assert!(close(f1.slowdown, 2.0) && close(f2.slowdown, 1.1));
    assert!(close(r.fairness, 0.55), "F = {}", r.fairness);
    assert!(close(f1.intensity, 10_000.0) && close(f2.intensity, 40_000.0));
    assert_eq!((f1.density, f2.density), (Density::Sparse, Density::Dense));
    assert!(close(r.utilisation[0], 0.9) && close(r.utilisation[1], 0.45));
    assert!(close(r.load_balance, 0.5));
    assert!(close(r.utilisation_mean, 0.675));
    assert_eq!(
        (r.high_cores.clone(), r.low_cores.clone()),
        (vec![0], vec![1])
    );
    assert!(r.unfair && r.imbalanced);
    assert_eq!(r.policy, FairnessPolicy::Hybrid);
    // B = α × 40,000 / 10,000 for the dense flow, none for the sparse one.
    assert_eq!((f1.backwardings, f2.backwardings), (0, 4));
}

#[test]
fn the_two_flags_pick_the_policy_as_algorithm_1_does() {
    let cases = [
        // (flow 2's mean latency, core 1 busy ms) -> policy
        (100, 90, FairnessPolicy::None),
        (100, 30, FairnessPolicy::Inter),
        (300, 90, FairnessPolicy::Intra),
        (300, 30, FairnessPolicy::Hybrid),
    ];
    for (latency, busy, policy) in cases {
        let mut m = monitor(FairnessConfig::default());
        m.set_alone(FlowId(1), 100.0);
        m.set_alone(FlowId(2), 100.0);
        let r = report(
            &mut m,
            100,
            FairnessWindow {
                flows: vec![flow(1, 1_000, 100), flow(2, 1_000, latency)],
                cores: cores(&[90, busy]),
                network_rtt_ns: 0,
            },
        );
        assert_eq!(r.policy, policy, "latency {latency}, busy {busy}");
        if policy == FairnessPolicy::None || policy == FairnessPolicy::Inter {
            assert!(r.flows.iter().all(|f| f.backwardings == 0));
        }
    }
}

#[test]
fn rt_alone_is_learned_from_low_contention_windows_only() {
    let mut m = monitor(FairnessConfig::default());
    // Busy window first: nothing learned, the lowest RT stands in (slowdown 1).
    let r = report(
        &mut m,
        100,
        FairnessWindow {
            flows: vec![flow(1, 1_000, 400), flow(2, 1_000, 300)],
            cores: cores(&[90, 90]),
            network_rtt_ns: 0,
        },
    );
    assert!(
        r.flows
            .iter()
            .all(|f| !f.alone_learned && close(f.slowdown, 1.0))
    );
    // A quiet window (both cores ≤ 30 %): learned.
    let r = report(
        &mut m,
        200,
        FairnessWindow {
            flows: vec![flow(1, 100, 100), flow(2, 100, 120)],
            cores: cores(&[20, 10]),
            network_rtt_ns: 0,
        },
    );
    assert!(r.flows.iter().all(|f| f.alone_learned));
    assert!(close(r.flows[0].rt_alone_us, 100.0) && close(r.flows[1].rt_alone_us, 120.0));
    // A busy window does not move it; the slowdowns are measured against it.
    let r = report(
        &mut m,
        300,
        FairnessWindow {
            flows: vec![flow(1, 1_000, 400), flow(2, 1_000, 240)],
            cores: cores(&[95, 95]),
            network_rtt_ns: 0,
        },
    );
    assert!(close(r.flows[0].rt_alone_us, 100.0));
    assert!(close(r.flows[0].slowdown, 4.0) && close(r.flows[1].slowdown, 2.0));
    assert!(close(r.fairness, 0.5));
    // A flow alone is uncontended whatever the load: the average moves by alone_weight.
    let r = report(
        &mut m,
        400,
        FairnessWindow {
            flows: vec![flow(1, 1_000, 200)],
            cores: cores(&[95, 95]),
            network_rtt_ns: 0,
        },
    );
    assert!(
        close(r.flows[0].rt_alone_us, 125.0),
        "{}",
        r.flows[0].rt_alone_us
    );
    assert!(close(r.fairness, 1.0) && !r.unfair);
}

#[test]
fn flows_with_too_few_requests_do_not_count() {
    let mut m = monitor(FairnessConfig::default());
    m.set_alone(FlowId(1), 100.0);
    m.set_alone(FlowId(2), 100.0);
    let r = report(
        &mut m,
        100,
        FairnessWindow {
            flows: vec![flow(1, 1_000, 100), flow(2, 19, 5_000)],
            cores: cores(&[50, 50]),
            network_rtt_ns: 0,
        },
    );
    assert_eq!(r.flows.len(), 1);
    assert!(close(r.fairness, 1.0) && !r.unfair);
}

#[test]
fn backwardings_are_capped() {
    let mut m = monitor(FairnessConfig {
        backwarding_alpha: 2.0,
        ..FairnessConfig::default()
    });
    m.set_alone(FlowId(1), 100.0);
    m.set_alone(FlowId(2), 100.0);
    let r = report(
        &mut m,
        100,
        FairnessWindow {
            flows: vec![flow(1, 100, 300), flow(2, 10_000, 100)],
            cores: cores(&[90, 90]),
            network_rtt_ns: 0,
        },
    );
    assert_eq!(r.flows[1].density, Density::Dense);
    assert_eq!(r.flows[1].backwardings, 20, "2 × 100 capped at 20");
}

#[test]
fn bad_windows_are_refused_and_change_nothing() {
    let mut m = monitor(FairnessConfig::default());
    report(&mut m, 100, FairnessWindow::default());
    assert_eq!(
        m.handle_window(Nanos(50 * MS), &FairnessWindow::default()),
        Err(FairnessWindowError::TimeWentBack {
            end: Nanos(50 * MS),
            previous: Nanos(100 * MS)
        })
    );
    let twice = FairnessWindow {
        flows: vec![flow(1, 100, 100), flow(1, 100, 100)],
        ..FairnessWindow::default()
    };
    assert_eq!(
        m.handle_window(Nanos(200 * MS), &twice),
        Err(FairnessWindowError::DuplicateFlow(FlowId(1)))
    );
    assert_eq!(
        m.next_deadline(),
        Nanos(200 * MS),
        "the window did not move"
    );
}

#[test]
fn knobs_out_of_range_are_refused_with_the_field() {
    for (config, field) in [
        (
            FairnessConfig {
                window_us: 0,
                ..FairnessConfig::default()
            },
            "window_us",
        ),
        (
            FairnessConfig {
                fairness_threshold: 1.5,
                ..FairnessConfig::default()
            },
            "fairness_threshold",
        ),
        (
            FairnessConfig {
                samples_min: 0,
                ..FairnessConfig::default()
            },
            "samples_min",
        ),
        (
            FairnessConfig {
                alone_weight: 0.0,
                ..FairnessConfig::default()
            },
            "alone_weight",
        ),
        (
            FairnessConfig {
                dense_ratio: 0.5,
                ..FairnessConfig::default()
            },
            "dense_ratio",
        ),
        (
            FairnessConfig {
                backwarding_alpha: f64::NAN,
                ..FairnessConfig::default()
            },
            "backwarding_alpha",
        ),
    ] {
        let error = FairnessMonitor::new(config, Nanos(0))
            .err()
            .unwrap_or_else(|| panic!("{field} accepted"));
        assert_eq!(error.field, field);
    }
    let parsed: FairnessConfig = toml::from_str("window_us = 50000\nbackwarding_alpha = 0.5")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(parsed.window_us, 50_000);
    assert!(toml::from_str::<FairnessConfig>("windw_us = 1").is_err());
}

#[test]
fn a_set_rt_alone_stands_until_cleared_and_outlives_the_flow() {
    let mut m = monitor(FairnessConfig::default());
    m.set_alone(FlowId(1), 50.0);
    // A quiet window would teach 100 µs; the set value stands and says so.
    let quiet = FairnessWindow {
        flows: vec![flow(1, 100, 100), flow(2, 100, 120)],
        cores: cores(&[20, 10]),
        network_rtt_ns: 0,
    };
    let r = report(&mut m, 100, quiet.clone());
    assert!(r.flows[0].alone_set && r.flows[0].alone_learned);
    assert!(close(r.flows[0].rt_alone_us, 50.0) && close(r.flows[0].slowdown, 2.0));
    assert!(!r.flows[1].alone_set && close(r.flows[1].rt_alone_us, 120.0));
    // The flow leaves and comes back: still set.
    m.remove(FlowId(1));
    let r = report(&mut m, 200, quiet.clone());
    assert!(r.flows[0].alone_set && close(r.flows[0].rt_alone_us, 50.0));
    // Cleared: learned from the windows again (the quiet window after its return).
    m.clear_alone(FlowId(1));
    let r = report(&mut m, 300, quiet);
    assert!(!r.flows[0].alone_set && r.flows[0].alone_learned);
    assert!(close(r.flows[0].rt_alone_us, 100.0), "{:?}", r.flows[0]);
}
