//! Algorithm 2's plan and one thread's migrator on constructed loads.

use super::*;
use crate::fairness::{
    CoreSample, FairnessConfig, FairnessMonitor, FairnessWindow, FlowId, FlowSample,
};
use crate::time::Nanos;

fn config(flows: MigrationFlows) -> MigrationConfig {
    MigrationConfig {
        enabled: true,
        flows,
        ..MigrationConfig::default()
    }
}

fn loads(values: &[(f64, u32)]) -> Vec<ThreadLoad> {
    values
        .iter()
        .map(|&(load, capacity)| ThreadLoad { load, capacity })
        .collect()
}

/// The plan's quotas as rows, and checks what every plan must satisfy: no thread moves to
/// itself, no pair beyond its credit, no source planned below U_avg, no destination above it.
fn check(config: &MigrationConfig, threshold: f64, values: &[(f64, u32)]) -> Vec<Vec<u32>> {
    let loads = loads(values);
    let plan = plan(config, threshold, &loads);
    let n = loads.len();
    let mean = plan.utilisation_mean;
    for (t, thread) in loads.iter().enumerate() {
        assert_eq!(plan.quota(t, t), 0, "thread {t} migrates to itself");
        let capacity = f64::from(thread.capacity);
        let after =
            (thread.load - f64::from(plan.moved_from(t)) + f64::from(plan.moved_to(t))) / capacity;
        assert!(
            plan.moved_from(t) == 0 || after >= mean - 1e-6,
            "source {t} planned below U_avg: {after} < {mean}"
        );
        assert!(
            plan.moved_to(t) == 0 || after <= mean + 1e-6,
            "destination {t} planned above U_avg: {after} > {mean}"
        );
        assert!(
            plan.moved_from(t) == 0 || plan.moved_to(t) == 0,
            "thread {t} both gives and takes"
        );
        for d in 0..n {
            assert!(plan.quota(t, d) <= config.in_transit_per_pair_max);
        }
    }
    (0..n)
        .map(|s| (0..n).map(|d| plan.quota(s, d)).collect())
        .collect()
}

#[test]
fn two_threads_move_until_both_reach_the_mean() {
    // Thread 0: a sparse flow of 2 and a dense one of 6 at 4 places; thread 1: 2 of the dense
    // flow. U = 2.0 and 0.5, U_avg = 1.25: three requests make both 1.25.
    let rows = check(&config(MigrationFlows::Dense), 0.8, &[(8.0, 4), (2.0, 4)]);
    assert_eq!(rows, vec![vec![0, 3], vec![0, 0]]);
    let plan = plan(
        &config(MigrationFlows::Dense),
        0.8,
        &loads(&[(8.0, 4), (2.0, 4)]),
    );
    assert!(plan.imbalanced);
    assert_eq!(plan.load_balance, 0.25);
    assert_eq!(plan.utilisation_mean, 1.25);
}

#[test]
fn balanced_threads_move_nothing_unless_told_to() {
    // LB = 0.9 ≥ T_LB 0.8: Algorithm 1 says no inter-core scheduling.
    let values = [(10.0, 4), (9.0, 4)];
    assert_eq!(
        check(&config(MigrationFlows::All), 0.8, &values),
        vec![vec![0, 0], vec![0, 0]]
    );
    // Without the gate, the half-request difference still moves nothing: one request would
    // take the source below U_avg.
    let ungated = MigrationConfig {
        requires_imbalance: false,
        ..config(MigrationFlows::All)
    };
    assert_eq!(check(&ungated, 0.8, &values), vec![vec![0, 0], vec![0, 0]]);
    // A gap of two requests moves one without the gate.
    assert_eq!(
        check(&ungated, 0.8, &[(10.0, 4), (8.0, 4)]),
        vec![vec![0, 1], vec![0, 0]]
    );
    // The margin widens the band around U_avg in which a thread is neither source nor
    // destination.
    let wide = MigrationConfig {
        utilisation_margin: 0.3,
        ..ungated
    };
    assert_eq!(
        check(&wide, 0.8, &[(10.0, 4), (8.0, 4)]),
        vec![vec![0, 0], vec![0, 0]]
    );
}

#[test]
fn disabled_or_single_thread_plans_nothing() {
    let off = MigrationConfig::default();
    assert!(!off.enabled);
    assert_eq!(
        check(&off, 0.8, &[(8.0, 4), (0.0, 4)]),
        vec![vec![0, 0], vec![0, 0]]
    );
    assert_eq!(
        check(&config(MigrationFlows::All), 0.8, &[(8.0, 4)]),
        vec![vec![0]]
    );
    let idle = plan(
        &config(MigrationFlows::All),
        0.8,
        &loads(&[(0.0, 4), (0.0, 4)]),
    );
    assert_eq!(idle.load_balance, 1.0);
    assert!(!idle.imbalanced);
}

#[test]
fn one_source_spreads_round_robin_and_skips_full_destinations() {
    // U: 3.0, 0.0, 0.5, 1.0 (mean 1.125). Round robin over 1, 2, 3: thread 3 takes none
    // (1.0 + 0.25 > 1.125), thread 2 two (0.5 → 1.0), thread 1 four (0 → 1.0); the source
    // could give 7 (3.0 → 1.25) but the destinations are full after 6.
    let rows = check(
        &config(MigrationFlows::All),
        0.8,
        &[(12.0, 4), (0.0, 4), (2.0, 4), (4.0, 4)],
    );
    assert_eq!(rows[0], vec![0, 4, 2, 0]);
    assert!(rows[1..].iter().all(|row| row.iter().all(|&q| q == 0)));
}

#[test]
fn two_sources_share_one_destination_in_turn() {
    // U: 2.0, 2.0, 0.0 (mean 4/3): the destination could take 5 (0 → 1.25), but each source
    // stops after 2 (2.0 → 1.5; a third would leave it at 1.25 < 4/3), taken in turn.
    let rows = check(
        &config(MigrationFlows::All),
        0.8,
        &[(8.0, 4), (8.0, 4), (0.0, 4)],
    );
    assert_eq!(rows[0], vec![0, 0, 2]);
    assert_eq!(rows[1], vec![0, 0, 2]);
}

#[test]
fn capacities_weigh_one_request() {
    // Thread 1 has twice the places: one request moves its U half as far.
    // U: 2.0 and 0.0 (mean 1.0); source steps 0.25, destination 0.125: 4 moves.
    let rows = check(&config(MigrationFlows::All), 0.8, &[(8.0, 4), (0.0, 8)]);
    assert_eq!(rows[0], vec![0, 4]);
}

#[test]
fn a_pair_never_gets_more_than_its_credit() {
    let tight = MigrationConfig {
        in_transit_per_pair_max: 2,
        ..config(MigrationFlows::All)
    };
    let rows = check(&tight, 0.8, &[(40.0, 4), (0.0, 4), (0.0, 4)]);
    assert_eq!(rows[0], vec![0, 2, 2]);
}

#[test]
fn random_loads_keep_every_plan_within_the_mean() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |bound: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % bound
    };
    for _ in 0..2_000 {
        let threads = 1 + next(8) as usize;
        let values: Vec<(f64, u32)> = (0..threads)
            .map(|_| (next(400) as f64 / 10.0, 1 + next(16) as u32))
            .collect();
        let config = MigrationConfig {
            requires_imbalance: next(2) == 0,
            utilisation_margin: next(3) as f64 / 10.0,
            in_transit_per_pair_max: 1 + next(8) as u32,
            ..config(MigrationFlows::All)
        };
        check(&config, 0.8, &values);
    }
}

#[test]
fn the_migrator_picks_destinations_round_robin_within_its_quota() {
    let config = config(MigrationFlows::Dense);
    let plan = plan(
        &config,
        0.8,
        &loads(&[(12.0, 4), (0.0, 4), (2.0, 4), (4.0, 4)]),
    );
    let mut migrator = Migrator::new(&config, 0);
    migrator.set_plan(&plan);
    assert_eq!((migrator.quota(1), migrator.quota(2)), (4, 2));
    // Sparse flows stay home; dense requests go 1, 2, 1, 2, 1, 1, then no place is left.
    assert_eq!(migrator.pick_destination(Density::Sparse), None);
    let picked: Vec<Option<usize>> = (0..7)
        .map(|_| migrator.pick_destination(Density::Dense))
        .collect();
    assert_eq!(
        picked,
        vec![Some(1), Some(2), Some(1), Some(2), Some(1), Some(1), None]
    );
    assert_eq!(migrator.stats().stayed_home_total, 1);
    assert_eq!(migrator.in_transit_total(), 6);
    // A return frees that destination's place, and only that one.
    migrator.returned(2);
    assert_eq!(migrator.pick_destination(Density::Dense), Some(2));
    assert_eq!(migrator.pick_destination(Density::Dense), None);
    // A new plan with a lower quota keeps what is there and sends no more.
    let calmer = super::plan(
        &config,
        0.8,
        &loads(&[(6.0, 4), (0.0, 4), (4.0, 4), (4.0, 4)]),
    );
    migrator.set_plan(&calmer);
    assert_eq!(migrator.quota(1), 2);
    assert_eq!(migrator.quota(2), 0);
    assert_eq!(migrator.pick_destination(Density::Dense), None);
    for _ in 0..2 {
        migrator.returned(1);
    }
    assert_eq!(migrator.pick_destination(Density::Dense), None);
    migrator.returned(1);
    assert_eq!(migrator.pick_destination(Density::Dense), Some(1));
    let stats = migrator.stats();
    assert_eq!(stats.migrated_total, 8);
    assert_eq!(stats.returned_total, 4);
    assert_eq!(stats.plans, 2);
}

#[test]
fn which_flows_move_is_the_configuration_s_choice() {
    let destination = |flows, density| {
        let config = config(flows);
        let plan = plan(&config, 0.8, &loads(&[(8.0, 4), (0.0, 4)]));
        let mut migrator = Migrator::new(&config, 0);
        migrator.set_plan(&plan);
        migrator.pick_destination(density)
    };
    use MigrationFlows::*;
    assert_eq!(destination(Dense, Density::Dense), Some(1));
    assert_eq!(destination(Dense, Density::Sparse), None);
    assert_eq!(destination(Sparse, Density::Dense), None);
    assert_eq!(destination(Sparse, Density::Sparse), Some(1));
    assert_eq!(destination(All, Density::Dense), Some(1));
    assert_eq!(destination(All, Density::Sparse), Some(1));
    // A destination has no quota of its own: it never migrates.
    let config = config(All);
    let plan = plan(&config, 0.8, &loads(&[(8.0, 4), (0.0, 4)]));
    let mut destination_side = Migrator::new(&config, 1);
    destination_side.set_plan(&plan);
    assert_eq!(destination_side.pick_destination(Density::Dense), None);
    destination_side.arrived(0);
    assert_eq!(destination_side.served(0), 1);
    destination_side.served_done(0);
    assert_eq!(destination_side.served(0), 0);
}

#[test]
fn the_monitor_s_classes_decide_whose_requests_move() {
    // A window on thread 0: flow 1 completed 80 requests, flow 2 only 20 (dense_ratio 1:
    // dense above the mean of 50 per window). Thread 1 idle.
    let mut monitor = FairnessMonitor::new(
        FairnessConfig {
            window_us: 1_000,
            samples_min: 1,
            ..FairnessConfig::default()
        },
        Nanos::ZERO,
    )
    .unwrap();
    let window = FairnessWindow {
        flows: vec![
            FlowSample {
                flow: FlowId(1),
                requests: 80,
                latency_sum_ns: 80 * 50_000,
            },
            FlowSample {
                flow: FlowId(2),
                requests: 20,
                latency_sum_ns: 20 * 100_000,
            },
        ],
        cores: vec![CoreSample { busy_ns: 1_000_000 }],
        network_rtt_ns: 0,
    };
    let report = monitor
        .handle_window(Nanos::from_micros(1_000), &window)
        .unwrap();
    // Little's law: 80 × 50 µs + 20 × 100 µs over 1 ms is 6 requests in the system on average.
    let load: f64 = window
        .flows
        .iter()
        .map(|f| f.latency_sum_ns as f64)
        .sum::<f64>()
        / 1_000_000.0;
    assert_eq!(load, 6.0);
    let config = config(MigrationFlows::Dense);
    let plan = plan(&config, 0.8, &loads(&[(load, 4), (0.0, 4)]));
    // U 1.5 and 0 (mean 0.75): three requests' worth moves.
    assert_eq!(plan.quota(0, 1), 3);
    let mut migrator = Migrator::new(&config, 0);
    migrator.set_plan(&plan);
    let density = |flow: u64| {
        report
            .flows
            .iter()
            .find(|f| f.flow == FlowId(flow))
            .unwrap()
            .density
    };
    assert_eq!(density(1), Density::Dense);
    assert_eq!(density(2), Density::Sparse);
    let mut moved = Vec::new();
    for flow in [2, 1, 2, 1, 1, 1, 2] {
        if migrator.pick_destination(density(flow)).is_some() {
            moved.push(flow);
        }
    }
    assert_eq!(moved, vec![1, 1, 1]);
}

#[test]
fn the_board_gives_every_member_s_last_load() {
    let board = MigrationBoard::default();
    assert_eq!(board.threads(), 0);
    board.join(0, 4);
    board.join(1, 8);
    board.publish(1, 3.5);
    let mut out = Vec::new();
    board.loads(&mut out);
    assert_eq!(
        out,
        vec![
            ThreadLoad {
                load: 0.0,
                capacity: 4
            },
            ThreadLoad {
                load: 3.5,
                capacity: 8
            }
        ]
    );
}

#[test]
fn configuration_fields_are_named_and_checked() {
    let parsed: MigrationConfig = toml::from_str(
        r#"
        enabled = true
        flows = "all"
        requires_imbalance = false
        utilisation_margin = 0.1
        in_transit_per_pair_max = 16
        "#,
    )
    .unwrap();
    assert_eq!(
        parsed,
        MigrationConfig {
            enabled: true,
            flows: MigrationFlows::All,
            requires_imbalance: false,
            utilisation_margin: 0.1,
            in_transit_per_pair_max: 16,
        }
    );
    assert!(toml::from_str::<MigrationConfig>("flow = \"dense\"").is_err());
    assert!(toml::from_str::<MigrationConfig>("flows = \"heavy\"").is_err());
    let zero = MigrationConfig {
        in_transit_per_pair_max: 0,
        ..MigrationConfig::default()
    };
    assert_eq!(
        zero.validate().unwrap_err().field,
        "migration.in_transit_per_pair_max"
    );
    let negative = MigrationConfig {
        utilisation_margin: -0.1,
        ..MigrationConfig::default()
    };
    assert!(negative.validate().is_err());
}
