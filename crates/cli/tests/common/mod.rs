//! Helpers shared by the `reflex bench` integration tests (`bench.rs`, `bench_nbd.rs`): run
//! the real binary, parse its JSON report, check the rows every clean run must produce, and
//! start an in-process `reflexd`. They live here so that both test files check reports the
//! same way; each test file compiles its own copy and uses only part of it.
#![allow(dead_code)]

use std::process::{Command, Output};

use reflex_server::{Config, Server, ServerHandle};
use serde_json::Value;

/// Starts an in-process `reflexd` (build the configuration from `Config::loopback`), on the
/// I/O driver `REFLEX_DRIVER` names (`auto`, `uring`, `epoll`) when it is set.
pub fn start_server(config: Config) -> ServerHandle {
    Server::start(with_test_driver(config)).unwrap_or_else(|error| panic!("server start: {error}"))
}

/// `config` with the driver `REFLEX_DRIVER` names, when it is set.
pub fn with_test_driver(mut config: Config) -> Config {
    if let Ok(text) = std::env::var("REFLEX_DRIVER")
        && !text.trim().is_empty()
    {
        config.driver = text
            .parse()
            .unwrap_or_else(|error| panic!("REFLEX_DRIVER: {error}"));
    }
    config
}

/// Runs the `reflex` binary with `args` and waits for it.
pub fn reflex(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reflex"))
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("running reflex: {error}"))
}

/// Runs `reflex bench ARGS --json -q`, expects success, returns the report.
pub fn bench_ok(args: &[&str]) -> Value {
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

/// The checks every successful (and, with `--verify`, verified) row must pass.
pub fn assert_clean_row(row: &Value, ops: u64) {
    assert_eq!(row["ops"], ops, "row: {row}");
    let reads = row["read"]["count"].as_u64().unwrap_or(0);
    let writes = row["write"]["count"].as_u64().unwrap_or(0);
    assert_eq!(reads + writes, ops, "row: {row}");
    assert_eq!(row["errors"], 0, "row: {row}");
    assert!(row["iops"].as_f64().unwrap_or(0.0) > 0.0, "row: {row}");
    if !row["verify"].is_null() {
        assert_eq!(row["verify"]["mismatches"], 0, "row: {row}");
        assert!(
            row["verify"]["first_mismatch_offset_bytes"].is_null(),
            "row: {row}"
        );
    }
}

/// Runs a small `--verify` bench against `server` (a native address or an `nbd://` URI), which
/// discards writes, and checks that it fails naming an offset. Returns the run's output.
pub fn assert_verify_fails(server: &str) -> Output {
    let output = reflex(&[
        "bench",
        "-q",
        "-s",
        server,
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
        "verify must fail against {server}, which discards writes"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("verify failed"), "stderr: {stderr}");
    assert!(stderr.contains("offset"), "stderr: {stderr}");
    output
}
