//! `reflex bench` and `reflex pingpong` as a user runs them: the real binary against a real
//! `reflexd` (started in-process on loopback port 0) or a real temporary file. Every run is
//! bounded by an operation count, so the assertions are exact counts, never timings.

mod common;

use reflex_server::{Config, NamespaceConfig, ServerHandle};
use serde_json::Value;

use common::{assert_clean_row, assert_verify_fails, bench_ok, reflex};

/// A native-only `reflexd` serving `namespace`; its window of 32 is the deepest queue the
/// bench may ask for.
fn start_server(namespace: NamespaceConfig) -> ServerHandle {
    common::start_server(Config {
        window: 32,
        ..Config::loopback(vec![namespace])
    })
}

#[test]
fn verify_on_memory_counts_every_operation() {
    let server = start_server(NamespaceConfig::new(1, "mem:32M"));
    let address = server.native_addr().to_string();
    let report = bench_ok(&[
        "-s",
        &address,
        "--verify",
        "--ops",
        "3000",
        "--read-ratio",
        "0.7",
        "--qd",
        "4",
        "--threads",
        "2",
        "--connections",
        "2",
        "--warmup",
        "0",
        "--duration",
        "60s",
        "--range",
        "8M",
    ]);
    assert_eq!(report["verify"], true);
    assert_eq!(
        report["fill"]["bytes"],
        8 << 20,
        "the fill covers the range"
    );
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 1);
    assert_clean_row(&rows[0], 3000);
    assert!(rows[0]["read"]["count"].as_u64().unwrap_or(0) > 0);
    assert!(rows[0]["write"]["count"].as_u64().unwrap_or(0) > 0);
    server.shutdown().expect("shutdown");
}

#[test]
fn verify_on_a_file_namespace_with_several_queue_depths() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("ns.img");
    let server =
        start_server(NamespaceConfig::new(1, format!("file:{}", file.display())).sized(16 << 20));
    let address = server.native_addr().to_string();
    let report = bench_ok(&[
        "-s",
        &address,
        "--verify",
        "--ops",
        "500",
        "--read-ratio",
        "0.5",
        "--qd",
        "1,16",
        "--io-size",
        "8k",
        "--pattern",
        "seq",
        "--warmup",
        "0",
        "--duration",
        "60s",
    ]);
    assert_eq!(
        report["range_length_bytes"],
        16 << 20,
        "whole namespace by default"
    );
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["queue_depth"], 1);
    assert_eq!(rows[1]["queue_depth"], 16);
    for row in rows {
        assert_clean_row(row, 500);
    }
    server.shutdown().expect("shutdown");
}

#[test]
fn open_loop_rate_list_gives_one_row_per_rate_and_a_probe() {
    let server = start_server(NamespaceConfig::new(1, "mem:8M"));
    let address = server.native_addr().to_string();
    let report = bench_ok(&[
        "-s",
        &address,
        "--rate",
        "2000,4k",
        "--ops",
        "300",
        "--warmup",
        "0",
        "--duration",
        "60s",
        "--read-ratio",
        "0.9",
        "--probe-rate",
        "100",
    ]);
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["load"], "open");
    assert_eq!(rows[0]["rate_target_per_sec"], 2000.0);
    assert_eq!(rows[1]["rate_target_per_sec"], 4000.0);
    for row in rows {
        assert_clean_row(row, 300);
        assert!(
            row["probe"].is_object(),
            "the probe reports beside the load"
        );
        assert_eq!(row["probe"]["errors"], 0);
    }
    server.shutdown().expect("shutdown");
}

#[test]
fn verify_fails_against_a_server_that_discards_writes() {
    let server = start_server(NamespaceConfig::new(1, "null:64M"));
    let address = server.native_addr().to_string();
    let output = assert_verify_fails(&address);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("mismatching reads"), "stdout: {stdout}");
    server.shutdown().expect("shutdown");
}

#[test]
fn local_mode_runs_the_same_workload_on_a_file() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("local.img");
    std::fs::File::create(&path)
        .and_then(|file| file.set_len(8 << 20))
        .expect("create file");
    let path_text = path.display().to_string();
    let report = bench_ok(&[
        "--local",
        &path_text,
        "--verify",
        "--ops",
        "1000",
        "--read-ratio",
        "0.6",
        "--qd",
        "8",
        "--threads",
        "2",
        "--warmup",
        "0",
        "--duration",
        "60s",
        "--probe-rate",
        "100",
    ]);
    assert_eq!(report["local"], true);
    assert!(report["direct_io"].is_boolean());
    assert_eq!(report["fill"]["bytes"], 8 << 20);
    assert_clean_row(&report["rows"][0], 1000);

    // A read-only run without --verify over the same file.
    let report = bench_ok(&[
        "--local",
        &path_text,
        "--ops",
        "400",
        "--qd",
        "4",
        "--warmup",
        "0",
        "--duration",
        "60s",
    ]);
    assert_clean_row(&report["rows"][0], 400);
    assert_eq!(report["rows"][0]["write"]["count"], 0);
}

#[test]
fn verify_without_fill_finds_a_damaged_block_on_a_local_file() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("local.img");
    std::fs::File::create(&path)
        .and_then(|file| file.set_len(1 << 20))
        .expect("create file");
    let path_text = path.display().to_string();
    // Fill with seed 5 (and a few checked reads).
    bench_ok(&[
        "--local", &path_text, "--verify", "--seed", "5", "--ops", "10", "--warmup", "0",
    ]);
    // Sequential reads of all 256 blocks, checked without refilling: clean.
    let check = [
        "bench",
        "-q",
        "--local",
        path_text.as_str(),
        "--verify",
        "--no-fill",
        "--seed",
        "5",
        "--read-ratio",
        "1",
        "--pattern",
        "seq",
        "--ops",
        "256",
        "--warmup",
        "0",
    ];
    let output = reflex(&check);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Damage one block in the middle: the same check must fail and name its offset.
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    file.write_all_at(&[0u8; 512], 100 * 4096 + 1024)
        .expect("damage");
    drop(file);
    let output = reflex(&check);
    assert!(!output.status.success(), "damage must be found");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("offset {}", 100 * 4096 + 1024)),
        "stderr: {stderr}"
    );
}

#[test]
fn bad_arguments_are_refused() {
    let server = start_server(NamespaceConfig::new(1, "mem:8M"));
    let address = server.native_addr().to_string();
    for args in [
        vec!["bench", "-s", address.as_str(), "--qd", "0"],
        vec!["bench", "-s", address.as_str(), "--qd", "33"],
        vec!["bench", "-s", address.as_str(), "--io-size", "1000"],
        vec!["bench", "-s", address.as_str(), "--namespace", "9"],
        vec!["bench", "-s", address.as_str(), "--read-ratio", "1.5"],
        vec!["bench", "-s", address.as_str(), "--rate", "1:1000000:1"],
    ] {
        let output = reflex(&args);
        assert!(!output.status.success(), "{args:?} should fail");
    }
    server.shutdown().expect("shutdown");
}

#[test]
fn pingpong_reports_every_size() {
    let output = reflex(&[
        "pingpong",
        "--sizes",
        "32,4k",
        "--count",
        "50",
        "--warmup-count",
        "5",
        "--json",
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Value = serde_json::from_slice(&output.stdout).expect("json");
    let rows = rows.as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["size_bytes"], 32);
    assert_eq!(rows[1]["size_bytes"], 4096);
    for row in rows {
        assert_eq!(row["round_trips"], 50);
        assert_eq!(row["round_trip"]["count"], 50);
    }
}

/// A server with a KV port on a `mem` namespace, and that port's address.
fn kv_server() -> (ServerHandle, String) {
    let server = common::start_server(Config {
        kv: reflex_server::config::KvConfig {
            enabled: true,
            port: 0,
            ..reflex_server::config::KvConfig::default()
        },
        ..Config::loopback(vec![NamespaceConfig::new(1, "mem:64M")])
    });
    let address = server
        .kv_addr()
        .unwrap_or_else(|| panic!("no KV listener"))
        .to_string();
    (server, address)
}

/// `reflex bench --kv`: fillrandom then readrandom against a real KV port; every operation
/// is counted, every value readrandom finds is checked by the bench (a mismatch fails it),
/// and it finds keys that fillrandom stored.
#[test]
fn kv_fillrandom_then_readrandom_counts_every_operation() {
    let (server, address) = kv_server();
    let report = bench_ok(&[
        "--kv",
        &address,
        "--threads",
        "2",
        "--qd",
        "4",
        "--kv-ops",
        "400",
        "--key-size",
        "4",
        "--value-size",
        "6k",
    ]);
    let rows = report
        .as_array()
        .unwrap_or_else(|| panic!("rows: {report}"));
    assert_eq!(rows.len(), 2, "{report}");
    assert_eq!(rows[0]["workload"], "fillrandom");
    assert_eq!(rows[1]["workload"], "readrandom");
    for row in rows {
        assert_eq!(row["ops"], 800, "{row}");
        assert_eq!(row["latency"]["count"], 800, "{row}");
    }
    assert_eq!(rows[0]["found"], 0);
    let found = rows[1]["found"].as_u64().unwrap_or(0);
    assert!(found > 0 && found <= 800, "{report}");
    server.shutdown().expect("shutdown");
}

/// `reflex bench --kv --kv-duration`: each thread stops sending when the duration is up,
/// long before its operation bound, and every operation it sent is answered and counted.
#[test]
fn kv_duration_ends_each_workload_at_its_deadline() {
    let (server, address) = kv_server();
    let report = bench_ok(&[
        "--kv",
        &address,
        "--threads",
        "2",
        "--qd",
        "2",
        "--kv-ops",
        "1000000000",
        "--kv-keys",
        "500",
        "--kv-duration",
        "300ms",
        "--key-size",
        "4",
        "--value-size",
        "1k",
    ]);
    let rows = report
        .as_array()
        .unwrap_or_else(|| panic!("rows: {report}"));
    assert_eq!(rows.len(), 2, "{report}");
    for row in rows {
        let ops = row["ops"].as_u64().unwrap_or(0);
        assert!(ops > 0 && ops < 2_000_000_000, "{row}");
        assert_eq!(row["latency"]["count"], ops, "{row}");
        let seconds = row["seconds"].as_f64().unwrap_or(0.0);
        assert!(seconds >= 0.3, "{row}");
    }
    server.shutdown().expect("shutdown");
}

/// `reflex bench --scenario` with an LC tenant that REPORTs: a REPORT takes one request of
/// the server's window, so the tenant's I/O gets the rest. (With all of it, a due READ found
/// the window full behind a REPORT in flight and the run stopped: "window full: 128 requests
/// outstanding", 2026-11-29, when a VM stall backed A up to its window.) Without reports the
/// tenant has the whole window.
#[test]
fn a_reporting_lc_tenant_leaves_the_report_room_in_the_window() {
    let profile =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/device-a-small.toml");
    let mut namespace = NamespaceConfig::new(1, "mem:16M");
    namespace.profile = Some(profile.to_string_lossy().into_owned());
    let server = common::start_server(Config {
        window: 2,
        qos: true,
        ..Config::loopback(vec![namespace])
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let scenario = dir.path().join("reporting.toml");
    let scenario_text = format!(
        r#"
name = "reporting"
threads = 1
qos = true
warmup_ms = 0
duration_ms = 300

[device]
emulated = "device-a-small"
profile = {profile:?}

[[tenant]]
name = "A"
class = "lc"
latency_us_p95 = 2000
iops = 1000
read_percent = 100
load = {{ open_iops = 1000 }}
"#,
        profile = profile.to_string_lossy()
    );
    std::fs::write(&scenario, scenario_text).expect("scenario");
    let address = server.native_addr().to_string();
    for (interval, queue_depth) in [("1ms", 1), ("0s", 2)] {
        let report = bench_ok(&[
            "-s",
            &address,
            "--scenario",
            scenario.to_str().expect("utf-8 path"),
            "--report-interval",
            interval,
        ]);
        let tenant = &report["tenants"][0];
        assert_eq!(tenant["name"], "A", "{report}");
        assert_eq!(tenant["errors"], 0, "{report}");
        assert!(tenant["iops"].as_f64().unwrap_or(0.0) > 0.0, "{report}");
        assert_eq!(
            tenant["queue_depth"], queue_depth,
            "reports every {interval}"
        );
    }
    server.shutdown().expect("shutdown");
}
