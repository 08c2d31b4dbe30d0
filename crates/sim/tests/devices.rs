//! Several devices in one server (issue 11), through the real dataplane in virtual time: each
//! namespace's device has its own profile, token bucket, schedulers and admission, so a
//! tenant is judged against its own device and a flood on one device does not reach the
//! tenants of another. `scenarios/two-devices.toml` describes the load.

mod common;

use reflex_sim::{PointReport, RunOptions, run_scenario};

/// The scenario without the tenants named in `without`; with `f`, plus LC F: B's shape at 30K
/// IOPS (58K tokens/s: 16 % of the large device, more than the small one has left), asked of
/// namespace 1, registered last; and G, the same asked of namespace 2.
fn run(without: &[&str], f: bool, qos: bool) -> PointReport {
    let mut loaded = common::load("two-devices");
    if f {
        let mut tenant_f = loaded.scenario.tenants[1].clone();
        assert_eq!(tenant_f.name, "B");
        tenant_f.name = "F".into();
        tenant_f.namespace = 1;
        tenant_f.iops = Some(30_000);
        tenant_f.load.open_iops = Some(30_000);
        let mut tenant_g = tenant_f.clone();
        tenant_g.name = "G".into();
        tenant_g.namespace = 2;
        loaded.scenario.tenants.extend([tenant_f, tenant_g]);
    }
    loaded
        .scenario
        .tenants
        .retain(|tenant| !without.contains(&tenant.name.as_str()));
    let options = RunOptions {
        qos: Some(qos),
        ..RunOptions::default()
    };
    let report = run_scenario(&loaded, &options).unwrap_or_else(|e| panic!("{e}"));
    report.points[0].1.clone()
}

#[test]
fn each_device_admits_against_its_own_profile_and_both_lc_tenants_meet_their_slos() {
    let point = run(&[], true, true);
    println!("{}", point.table());
    // Namespace 1 is the small device, namespace 2 the ten times faster one.
    let rates = &point.namespace_tokens_per_sec;
    assert_eq!(rates.len(), 2);
    assert!(rates[1] > 5.0 * rates[0], "device rates {rates:?}");
    let tenant = |name: &str| point.tenant(name).unwrap();
    // The same reservation: refused by the small device, admitted by the large one.
    assert!(!tenant("F").admitted);
    assert!(tenant("G").admitted);
    assert!(
        point.refusals.iter().any(|r| r.starts_with("F: needs")),
        "{:?}",
        point.refusals
    );
    for name in ["A", "B", "G"] {
        assert_eq!(tenant(name).slo_met, Some(true), "{name} missed its SLO");
    }
    // Each device's best-effort tenants get that device's spare tokens: the flood on the
    // small device is held to what A leaves there, D on the large one gets its whole rate.
    assert!(tenant("C").iops > 1000.0, "C {}", tenant("C").iops);
    assert!(tenant("D").iops > 0.99 * 10_000.0, "D {}", tenant("D").iops);
    // Tokens are charged per device: what C spends stays under the small device's rate.
    assert!(tenant("A").tokens_per_sec + tenant("C").tokens_per_sec <= 1.02 * rates[0]);
}

#[test]
fn a_flood_on_one_device_does_not_move_the_other_devices_p95() {
    let flooded = run(&[], false, true);
    let quiet = run(&["C"], false, true);
    let b_flooded = flooded.tenant("B").unwrap();
    let b_quiet = quiet.tenant("B").unwrap();
    println!(
        "B p95 {:.0} µs with the flood on namespace 1, {:.0} µs without; IOPS {:.0} / {:.0}",
        b_flooded.read_p95_us, b_quiet.read_p95_us, b_flooded.iops, b_quiet.iops
    );
    assert!(
        (b_flooded.read_p95_us - b_quiet.read_p95_us).abs() <= 0.1 * b_quiet.read_p95_us,
        "B p95 {} with the flood, {} without",
        b_flooded.read_p95_us,
        b_quiet.read_p95_us
    );
    assert!((b_flooded.iops - b_quiet.iops).abs() <= 0.01 * b_quiet.iops);
    // The same flood does reach the LC tenant of its own device when that device schedules
    // first in, first out (Figure 5's lesson, per device): so the check above is not vacuous.
    let fifo = run(&[], false, false);
    let a_fifo = fifo.tenant("A").unwrap();
    assert!(
        a_fifo.read_p95_us > 2.0 * flooded.tenant("A").unwrap().read_p95_us,
        "A p95 {} µs first in, first out",
        a_fifo.read_p95_us
    );
    assert_eq!(fifo.tenant("B").unwrap().slo_met, Some(true));
}
