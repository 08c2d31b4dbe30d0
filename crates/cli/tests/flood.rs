//! `reflex flood` and `reflex bench --bind-handles/--server-pid` as the scale and overload
//! scripts run them: the real binary against an in-process `reflexd` on loopback port 0.
//! Counts are asserted exactly; the only timings are the server's timeouts, which the runs
//! outlast by a wide margin.

mod common;

use std::time::Duration;

use reflex_server::{Config, NamespaceConfig, ServerHandle, TimeoutsConfig};
use serde_json::Value;

use common::{bench_ok, reflex};

/// A `mem` namespace with the unlimited QoS profile, so tenants can register.
fn qos_namespace() -> NamespaceConfig {
    NamespaceConfig {
        profile: Some(format!(
            "{}/../../profiles/mem-unlimited.toml",
            env!("CARGO_MANIFEST_DIR")
        )),
        ..NamespaceConfig::new(1, "mem:64M")
    }
}

fn start_server(config: Config) -> ServerHandle {
    common::start_server(config)
}

/// The tests of this file run one at a time: one of them reads this process's CPU time as the
/// server's, summed over its threads, and a server of a parallel test shutting down takes its
/// threads' time out of that sum (the difference then comes out as 0).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs `reflex flood ARGS --json -q`, expects success, returns the report.
fn flood_ok(args: &[&str]) -> Value {
    let mut all = vec!["flood", "--json", "-q"];
    all.extend_from_slice(args);
    let output = reflex(&all);
    assert!(
        output.status.success(),
        "reflex {all:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "bad JSON ({error}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

#[test]
fn every_kind_of_flood_is_set_up_held_and_counted() {
    let _serial = serial();
    let server = start_server(Config::loopback(vec![qos_namespace()]));
    let address = server.native_addr().to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let handles = dir.path().join("handles");
    let ready = dir.path().join("ready");
    let report = flood_ok(&[
        "-s",
        &address,
        "--idle",
        "50",
        "--slowloris",
        "20",
        "--non-reader",
        "1",
        "--register",
        "40",
        "--tenants-per-connection",
        "16",
        "--handles",
        handles.to_str().expect("path"),
        "--ready-file",
        ready.to_str().expect("path"),
        "--fresh-interval",
        "50ms",
        "--duration",
        "1s",
    ]);
    assert_eq!(report["idle_established"], 50, "{report}");
    assert_eq!(report["idle_refused"], 0, "{report}");
    assert_eq!(report["idle_closed_by_server"], 0, "{report}");
    // The handshake timeout (10 s) is far beyond the hold: nothing was closed.
    assert_eq!(report["slowloris_connects"], 20, "{report}");
    assert_eq!(report["slowloris_open_at_end"], 20, "{report}");
    assert_eq!(report["non_readers"], 1, "{report}");
    assert_eq!(
        report["non_reader_bytes_requested"],
        128u64 << 20,
        "{report}"
    );
    assert_eq!(report["tenants_registered"], 40, "{report}");
    assert_eq!(
        report["tenant_connections"], 3,
        "40 tenants at 16 per connection"
    );
    assert!(ready.exists(), "the ready file marks the end of set-up");
    let text = std::fs::read_to_string(&handles).expect("handles file");
    let mut lines: Vec<u64> = text
        .lines()
        .map(|line| line.parse().expect("a handle per line"))
        .collect();
    assert_eq!(lines.len(), 40);
    lines.sort_unstable();
    lines.dedup();
    assert_eq!(lines.len(), 40, "handles are distinct");
    let fresh = &report["fresh"];
    assert_eq!(fresh["failures"], 0, "{report}");
    let attempts = fresh["attempts"].as_u64().unwrap_or(0);
    assert!(attempts >= 1, "{report}");
    assert_eq!(fresh["first_read_us"]["count"], attempts, "{report}");
    server.shutdown().expect("shutdown");
}

#[test]
fn slowloris_connections_are_closed_by_the_handshake_timeout_and_replaced() {
    let _serial = serial();
    let server = start_server(Config {
        timeouts: TimeoutsConfig {
            handshake: Duration::from_millis(200),
            ..TimeoutsConfig::default()
        },
        ..Config::loopback(vec![NamespaceConfig::new(1, "mem:16M")])
    });
    let address = server.native_addr().to_string();
    let report = flood_ok(&[
        "-s",
        &address,
        "--slowloris",
        "10",
        "--reconnect",
        "--check-interval",
        "50ms",
        "--duration",
        "2s",
    ]);
    // Each of the 10 first connections outlives the 200 ms timeout within the 2 s hold
    // (timeouts are checked every 100 ms) and is replaced.
    let closed = report["slowloris_closed_by_server"].as_u64().unwrap_or(0);
    let connects = report["slowloris_connects"].as_u64().unwrap_or(0);
    assert!(closed >= 10, "{report}");
    assert!(connects > 10, "{report}");
    assert!(
        connects <= 10 + closed,
        "a replacement per close at most: {report}"
    );
    server.shutdown().expect("shutdown");
}

#[test]
fn bench_binds_its_connections_to_the_handles_given_and_reads_the_server_cpu() {
    let _serial = serial();
    let server = start_server(Config {
        window: 32,
        ..Config::loopback(vec![qos_namespace()])
    });
    let address = server.native_addr();
    let dir = tempfile::tempdir().expect("tempdir");
    let handles = dir.path().join("handles");
    let mut owner = reflex_client::Client::connect(address).expect("connect");
    let mut text = String::new();
    for _ in 0..3 {
        let handle = owner.register_be(1).expect("register");
        text.push_str(&format!("{handle}\n"));
    }
    std::fs::write(&handles, text).expect("write handles");
    // The server runs in this process: its CPU is ours.
    let pid = std::process::id().to_string();
    let address = address.to_string();
    let report = bench_ok(&[
        "-s",
        &address,
        "--bind-handles",
        handles.to_str().expect("path"),
        "--server-pid",
        &pid,
        "--connections",
        "4",
        "--qd",
        "2",
        "--ops",
        "400",
        "--warmup",
        "0",
        "--duration",
        "60s",
    ]);
    let row = &report["rows"][0];
    common::assert_clean_row(row, 400);
    assert!(row["server_cpu_ns"].as_u64().unwrap_or(0) > 0, "{row}");
    assert!(
        row["server_cpu_per_op_ns"].as_f64().unwrap_or(0.0) > 0.0,
        "{row}"
    );

    // A handle the server never gave fails the run at its BIND.
    std::fs::write(&handles, "12345\n").expect("write handles");
    let output = reflex(&[
        "bench",
        "-q",
        "-s",
        &address,
        "--bind-handles",
        handles.to_str().expect("path"),
        "--ops",
        "10",
        "--warmup",
        "0",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("BIND"), "stderr: {stderr}");
    drop(owner);
    server.shutdown().expect("shutdown");
}

#[test]
fn a_stop_file_ends_the_hold_before_its_duration() {
    let _serial = serial();
    let server = start_server(Config::loopback(vec![NamespaceConfig::new(1, "mem:16M")]));
    let address = server.native_addr().to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let stop = dir.path().join("stop");
    std::fs::write(&stop, b"").expect("write the stop file");
    let report = flood_ok(&[
        "-s",
        &address,
        "--idle",
        "5",
        "--stop-file",
        stop.to_str().expect("path"),
        "--duration",
        "600s",
    ]);
    assert_eq!(report["idle_established"], 5, "{report}");
    // Without the stop file the hold would last the whole 600 s.
    let hold_sec = report["hold_sec"].as_f64().expect("hold_sec");
    assert!(hold_sec < 600.0, "{report}");
    server.shutdown().expect("shutdown");
}

#[test]
fn bench_runs_the_measure_hooks_once_each_and_fails_with_a_failing_hook() {
    let _serial = serial();
    let server = start_server(Config::loopback(vec![NamespaceConfig::new(1, "mem:16M")]));
    let address = server.native_addr().to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let marks = dir.path().join("marks");
    let marks = marks.to_str().expect("path");
    let start = format!("echo start >> '{marks}'");
    let end = format!("echo end >> '{marks}'");
    // A run that ends on its operation quota, then one that ends on its duration.
    for limit in [["--ops", "200"], ["--duration", "300ms"]] {
        std::fs::write(marks, b"").expect("clear the marks");
        let report = bench_ok(&[
            "-s",
            &address,
            "--threads",
            "2",
            "--connections",
            "2",
            "--warmup",
            "100ms",
            limit[0],
            limit[1],
            "--at-measure-start",
            &start,
            "--at-measure-end",
            &end,
        ]);
        assert_eq!(report["rows"][0]["errors"], 0, "{report}");
        let text = std::fs::read_to_string(marks).expect("marks");
        assert_eq!(text, "start\nend\n", "{limit:?}");
    }

    let output = reflex(&[
        "bench",
        "-q",
        "-s",
        &address,
        "--ops",
        "10",
        "--warmup",
        "0",
        "--at-measure-start",
        "exit 3",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("exit 3"), "stderr: {stderr}");
    server.shutdown().expect("shutdown");
}
