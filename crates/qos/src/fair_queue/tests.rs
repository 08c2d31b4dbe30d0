//! Decisions of the fairness stage on constructed loads, in virtual time.

use super::*;

const SPARSE: FlowId = FlowId(0);
const DENSE: FlowId = FlowId(1);

fn config(mode: FairMode, depth: u32, backwardings: Option<u32>) -> FairQueueConfig {
    FairQueueConfig {
        mode,
        be_device_depth_max: depth,
        held_max: 64,
        backwardings,
        monitor: FairnessConfig {
            window_us: 1_000,
            samples_min: 1,
            ..FairnessConfig::default()
        },
        adaptive_depth: AdaptiveDepthConfig::default(),
        migration: crate::migration::MigrationConfig::default(),
    }
}

fn stage(mode: FairMode, depth: u32, backwardings: Option<u32>) -> FairQueue {
    FairQueue::new(&config(mode, depth, backwardings), Nanos::ZERO).unwrap()
}

/// Releases everything the stage lets go at `now`: (flow, token) in release order.
fn release_all(stage: &mut FairQueue, now: Nanos) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    while let Some((flow, token)) = stage.poll_release(now) {
        out.push((flow.0, token));
    }
    stage.check();
    out
}

/// One monitor window in which `DENSE` completed 8 requests and `SPARSE` 2 (so the monitor
/// classes `DENSE` dense), ending at `end`.
fn classify(stage: &mut FairQueue, end: Nanos) {
    for (flow, count) in [(SPARSE, 2u64), (DENSE, 8)] {
        for i in 0..count {
            stage.hold(flow, 1_000 + i).unwrap();
        }
    }
    let mut released = Vec::new();
    loop {
        let batch = release_all(stage, end);
        if batch.is_empty() {
            break;
        }
        for (flow, _) in batch {
            released.push(flow);
            stage.completed(FlowId(flow), 100_000, end);
        }
    }
    assert_eq!(released.len(), 10);
    assert!(stage.handle_timeout(end));
}

#[test]
fn off_by_default_and_lc_never_held() {
    let defaults = FairQueueConfig::default();
    assert_eq!(defaults.mode, FairMode::Off);
    assert_eq!(defaults.validate(), Ok(()));
    let off = FairQueue::new(&defaults, Nanos::ZERO).unwrap();
    assert!(!off.holds(TenantClass::BestEffort));
    assert!(!off.holds(TenantClass::LatencyCritical));
    for mode in [
        FairMode::Fifo,
        FairMode::Backwarding,
        FairMode::FewestInFlight,
        FairMode::FairShare,
    ] {
        let on = stage(mode, 1, None);
        assert!(on.holds(TenantClass::BestEffort));
        assert!(!on.holds(TenantClass::LatencyCritical), "{mode:?} holds LC");
    }
    let parsed: FairQueueConfig =
        toml::from_str("mode = \"fewest_in_flight\"\nbe_device_depth_max = 6").unwrap();
    assert_eq!(parsed.mode, FairMode::FewestInFlight);
    assert_eq!(parsed.be_device_depth_max, 6);
    assert!(toml::from_str::<FairQueueConfig>("depth = 1").is_err());
    let zero = FairQueueConfig {
        be_device_depth_max: 0,
        ..defaults
    };
    assert_eq!(zero.validate().unwrap_err().field, "be_device_depth_max");
}

#[test]
fn fifo_caps_device_depth_and_keeps_arrival_order() {
    let mut stage = stage(FairMode::Fifo, 2, None);
    for token in 0..5 {
        let flow = if token % 2 == 0 { DENSE } else { SPARSE };
        stage.hold(flow, token).unwrap();
    }
    let now = Nanos::from_micros(1);
    assert_eq!(release_all(&mut stage, now), vec![(1, 0), (0, 1)]);
    assert_eq!(stage.in_flight(), 2);
    assert_eq!(stage.held(), 3);
    stage.completed(DENSE, 10_000, now);
    assert_eq!(release_all(&mut stage, now), vec![(1, 2)]);
    stage.completed(SPARSE, 10_000, now);
    stage.completed(DENSE, 10_000, now);
    assert_eq!(release_all(&mut stage, now), vec![(0, 3), (1, 4)]);
    assert_eq!(stage.held(), 0);
}

#[test]
fn full_stage_refuses_and_keeps_nothing() {
    let mut stage = FairQueue::new(
        &FairQueueConfig {
            held_max: 2,
            ..config(FairMode::Fifo, 1, None)
        },
        Nanos::ZERO,
    )
    .unwrap();
    stage.hold(DENSE, 1).unwrap();
    stage.hold(DENSE, 2).unwrap();
    assert_eq!(stage.hold(SPARSE, 3), Err(FairQueueFull { held_max: 2 }));
    assert!(!stage.has_room());
    assert_eq!(stage.held(), 2);
    stage.check();
}

#[test]
fn backwarding_moves_a_dense_head_back_b_places_behind_sparse_ones() {
    let mut stage = stage(FairMode::Backwarding, 1, Some(2));
    let end = Nanos::from_micros(1_000);
    classify(&mut stage, end);
    assert_eq!(stage.flow_class(DENSE), Some((true, 2)));
    assert_eq!(stage.flow_class(SPARSE), Some((false, 0)));
    // Dense 10, 11 arrive before sparse 20, 21, 22: each dense head lets two sparse go first.
    for (flow, token) in [
        (DENSE, 10),
        (DENSE, 11),
        (SPARSE, 20),
        (SPARSE, 21),
        (SPARSE, 22),
    ] {
        stage.hold(flow, token).unwrap();
    }
    let mut order = Vec::new();
    for _ in 0..5 {
        let released = release_all(&mut stage, end);
        assert_eq!(released.len(), 1, "depth 1 releases one at a time");
        let (flow, token) = released[0];
        order.push(token);
        stage.completed(FlowId(flow), 1_000, end);
    }
    assert_eq!(order, vec![20, 21, 10, 22, 11]);
    assert_eq!(stage.stats().backwarded_total, 3);
}

#[test]
fn backwarding_zero_is_fifo_and_dense_alone_is_not_delayed() {
    let mut zero = stage(FairMode::Backwarding, 1, Some(0));
    let end = Nanos::from_micros(1_000);
    classify(&mut zero, end);
    for (flow, token) in [(DENSE, 10), (SPARSE, 20)] {
        zero.hold(flow, token).unwrap();
    }
    assert_eq!(release_all(&mut zero, end), vec![(1, 10)]);

    // With B = 5 but no sparse request waiting, the dense head goes at once.
    let mut alone = stage(FairMode::Backwarding, 1, Some(5));
    classify(&mut alone, end);
    alone.hold(DENSE, 10).unwrap();
    assert_eq!(release_all(&mut alone, end), vec![(1, 10)]);
}

#[test]
fn backwarding_b_comes_from_the_monitor_when_not_fixed() {
    let mut stage = stage(FairMode::Backwarding, 1, None);
    // Both flows at the same latency: F = 1, fair, so the monitor gives B = 0.
    classify(&mut stage, Nanos::from_micros(1_000));
    assert_eq!(stage.flow_class(DENSE), Some((true, 0)));
    // Now the sparse flow is ten times slower than the lowest it saw, the dense one not:
    // unfair, and B = α × 8 / 2 = 4 for the dense flow (eq. 5).
    let end = Nanos::from_micros(2_000);
    for (flow, count, latency_ns) in [(SPARSE, 2u64, 1_000_000u64), (DENSE, 8, 100_000)] {
        for i in 0..count {
            stage.hold(flow, i).unwrap();
        }
        while let Some((released, _)) = stage.poll_release(end) {
            stage.completed(released, latency_ns, end);
        }
    }
    assert!(stage.handle_timeout(end));
    let report = stage.report().unwrap();
    assert!(report.unfair, "{report:?}");
    assert_eq!(stage.flow_class(DENSE), Some((true, 4)));
    assert!(!stage.handle_timeout(end), "no window closes twice");
}

#[test]
fn fewest_in_flight_serves_the_flow_with_fewer_requests_at_the_device() {
    let mut stage = stage(FairMode::FewestInFlight, 3, None);
    let now = Nanos::from_micros(1);
    for token in 0..4 {
        stage.hold(DENSE, token).unwrap();
    }
    // Only the dense flow waits: it may use every place at the device.
    assert_eq!(release_all(&mut stage, now), vec![(1, 0), (1, 1), (1, 2)]);
    stage.hold(SPARSE, 10).unwrap();
    stage.hold(SPARSE, 11).unwrap();
    stage.completed(DENSE, 1_000, now);
    // Dense has 2 at the device, sparse 0: sparse goes, although dense 3 is older.
    assert_eq!(release_all(&mut stage, now), vec![(0, 10)]);
    stage.completed(DENSE, 1_000, now);
    // Dense 1, sparse 1: a tie, the oldest head (dense 3) goes.
    assert_eq!(release_all(&mut stage, now), vec![(1, 3)]);
    stage.completed(DENSE, 1_000, now);
    assert_eq!(release_all(&mut stage, now), vec![(0, 11)]);
}

/// A small deterministic generator (xorshift) for the randomised test.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn no_request_is_lost_or_reordered_within_its_flow() {
    for mode in [
        FairMode::Fifo,
        FairMode::Backwarding,
        FairMode::FewestInFlight,
        FairMode::FairShare,
    ] {
        for seed in 1..20u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let mut stage = stage(mode, 1 + rng.below(4) as u32, Some(rng.below(6) as u32));
            let flows = 1 + rng.below(4);
            let mut next_token = vec![0u64; flows as usize];
            let mut expected = vec![0u64; flows as usize];
            let mut at_device: Vec<FlowId> = Vec::new();
            let mut now = Nanos::ZERO;
            let mut cancelled = 0;
            for step in 0..2_000 {
                now += Nanos::from_micros(rng.below(50));
                match rng.below(4) {
                    0 | 1 => {
                        let flow = rng.below(flows);
                        let token = (flow << 32) | next_token[flow as usize];
                        if stage.hold(FlowId(flow), token).is_ok() {
                            next_token[flow as usize] += 1;
                        }
                    }
                    2 => {
                        while let Some((flow, token)) = stage.poll_release(now) {
                            assert_eq!(token >> 32, flow.0, "token came back with another flow");
                            assert_eq!(
                                token & 0xFFFF_FFFF,
                                expected[flow.0 as usize],
                                "{mode:?} seed {seed}: flow {flow:?} out of order"
                            );
                            expected[flow.0 as usize] += 1;
                            at_device.push(flow);
                        }
                    }
                    _ => {
                        if !at_device.is_empty() {
                            let flow =
                                at_device.swap_remove(rng.below(at_device.len() as u64) as usize);
                            stage.completed(flow, rng.below(1_000_000), now);
                        }
                    }
                }
                stage.handle_timeout(now);
                if step % 97 == 0 {
                    stage.check();
                }
                assert!(stage.in_flight() <= stage.depth_max);
            }
            stage.cancel_held(&mut |flow, token| {
                assert_eq!(token & 0xFFFF_FFFF, expected[flow.0 as usize]);
                expected[flow.0 as usize] += 1;
                cancelled += 1;
            });
            assert_eq!(
                expected, next_token,
                "{mode:?} seed {seed}: a request was lost"
            );
            assert_eq!(stage.held(), 0);
            stage.check();
        }
    }
}

#[test]
fn fair_share_caps_each_present_flow_at_its_share() {
    let mut stage = stage(FairMode::FairShare, 6, None);
    let now = Nanos::from_micros(1);
    for token in 0..8 {
        stage.hold(DENSE, token).unwrap();
    }
    // Alone, the dense flow's share is the whole depth.
    assert_eq!(release_all(&mut stage, now).len(), 6);
    stage.hold(SPARSE, 10).unwrap();
    for _ in 0..3 {
        stage.completed(DENSE, 1_000, now);
    }
    // Two present flows: 3 places each. The sparse one takes one, the dense one has 3.
    assert_eq!(release_all(&mut stage, now), vec![(0, 10)]);
    assert_eq!(stage.in_flight(), 4);
    stage.completed(SPARSE, 1_000, now);
    // The sparse flow has nothing here now but completed in this window: it keeps its share.
    assert_eq!(release_all(&mut stage, now), vec![]);
    stage.completed(DENSE, 1_000, now);
    assert_eq!(release_all(&mut stage, now), vec![(1, 6)]);
}

/// One place at the device: both flows are at their share whenever it frees, and the turn
/// goes to the flow served least recently, not to the oldest head (nearly always the dense
/// flow's, which would make the stage first in, first out).
#[test]
fn with_one_place_the_flows_take_turns() {
    let mut stage = stage(FairMode::FairShare, 1, None);
    let now = Nanos::from_micros(1);
    for token in 0..4 {
        stage.hold(DENSE, token).unwrap();
    }
    assert_eq!(release_all(&mut stage, now), vec![(1, 0)]);
    stage.hold(SPARSE, 10).unwrap();
    stage.hold(SPARSE, 11).unwrap();
    let mut order = Vec::new();
    let mut at_device = DENSE;
    for _ in 0..5 {
        stage.completed(at_device, 1_000, now);
        let released = release_all(&mut stage, now);
        assert_eq!(released.len(), 1, "{released:?}");
        at_device = FlowId(released[0].0);
        order.push(released[0]);
    }
    // Dense 1, 2 and 3 are older than either sparse request.
    assert_eq!(order, vec![(0, 10), (1, 1), (0, 11), (1, 2), (1, 3)]);
}

#[test]
fn flows_lists_held_and_in_flight_per_flow_for_the_metrics() {
    let mut stage = stage(FairMode::FairShare, 2, None);
    assert_eq!(stage.flows().count(), 0);
    for token in 0..3 {
        stage.hold(DENSE, token).unwrap();
    }
    stage.hold(SPARSE, 10).unwrap();
    let released = release_all(&mut stage, Nanos(10));
    assert_eq!(released.len(), 2, "depth 2: {released:?}");
    let flows: Vec<(FlowId, u32, u32)> = stage.flows().collect();
    // One place each (share 1 of 2): two dense requests wait, the sparse one is out.
    assert_eq!(flows, [(SPARSE, 0, 1), (DENSE, 2, 1)]);
    let held: u32 = flows.iter().map(|(_, held, _)| held).sum();
    let in_flight: u32 = flows.iter().map(|(_, _, at)| at).sum();
    assert_eq!((held, in_flight), (stage.held(), stage.in_flight()));
    // A flow that completed stays listed (present) until its windows pass.
    stage.completed(SPARSE, 1_000, Nanos(20));
    assert!(stage.flows().any(|(flow, _, _)| flow == SPARSE));
    assert!(stage.handle_timeout(Nanos(1_000_000)));
    assert!(stage.handle_timeout(Nanos(2_000_000)));
    assert!(stage.flows().all(|(flow, _, _)| flow != SPARSE));
}
