//! `reflex bench` and `reflex pingpong` as a user runs them: the real binary against a real
//! `reflexd` (started in-process on loopback port 0) or a real temporary file. Every run is
//! bounded by an operation count, so the assertions are exact counts, never timings.

use std::net::SocketAddr;
use std::process::{Command, Output};

use reflex_server::{Config, NamespaceConfig, Server, ServerHandle};
use serde_json::Value;

fn start_server(backend: String, size_bytes: Option<u64>) -> ServerHandle {
    let config = Config {
        window: 32,
        ..Config::loopback(vec![NamespaceConfig {
            size_bytes,
            ..NamespaceConfig::new(1, backend)
        }])
    };
    Server::start(config).unwrap_or_else(|error| panic!("server start: {error}"))
}

fn reflex(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reflex"))
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("running reflex: {error}"))
}

/// Runs `reflex bench ARGS --json -q`, expects success, returns the report.
fn bench_ok(args: &[&str]) -> Value {
    let mut all = vec!["bench", "--json", "-q"];
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

fn server_arg(address: SocketAddr) -> String {
    address.to_string()
}

/// The checks every successful verified row must pass.
fn assert_clean_row(row: &Value, ops: u64) {
    assert_eq!(row["ops"], ops, "row: {row}");
    let reads = row["read"]["count"].as_u64().unwrap_or(0);
    let writes = row["write"]["count"].as_u64().unwrap_or(0);
    assert_eq!(reads + writes, ops);
    assert_eq!(row["errors"], 0);
    if !row["verify"].is_null() {
        assert_eq!(row["verify"]["mismatches"], 0);
        assert!(row["verify"]["first_mismatch_offset_bytes"].is_null());
    }
}

#[test]
fn verify_on_memory_counts_every_operation() {
    let server = start_server("mem:32M".to_string(), None);
    let address = server_arg(server.native_addr());
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
    let server = start_server(format!("file:{}", file.display()), Some(16 << 20));
    let address = server_arg(server.native_addr());
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
    let server = start_server("mem:8M".to_string(), None);
    let address = server_arg(server.native_addr());
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
    let server = start_server("null:64M".to_string(), None);
    let address = server_arg(server.native_addr());
    let output = reflex(&[
        "bench",
        "-q",
        "-s",
        &address,
        "--verify",
        "--ops",
        "200",
        "--warmup",
        "0",
        "--duration",
        "60s",
        "--range",
        "4M",
    ]);
    assert!(
        !output.status.success(),
        "verify must fail on a null device"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("verify failed"), "stderr: {stderr}");
    assert!(stderr.contains("offset"), "stderr: {stderr}");
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
    let server = start_server("mem:8M".to_string(), None);
    let address = server_arg(server.native_addr());
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
