//! `reflex crash-test` as CI runs it: the real binary against the real `reflexd` (SIGKILLed
//! mid-write and restarted five times), and its negative controls — one durable block damaged
//! in the backing file between a kill and the next verification — which must each be reported
//! as exactly that block, with the right kind, and fail the run.
//!
//! `reflexd` belongs to another package, so cargo gives no `CARGO_BIN_EXE_reflexd` here: the
//! tests take `$REFLEXD`, else the `reflexd` next to the `reflex` binary under test (cargo
//! builds both into one directory: `cargo build --release --workspace` before
//! `cargo test --release --workspace`, as scripts/test.sh does, or any `cargo test --workspace`).

mod common;

use std::path::PathBuf;
use std::process::Output;

use serde_json::Value;

use common::reflex;

fn reflexd_path() -> PathBuf {
    if let Some(path) = std::env::var_os("REFLEXD") {
        return PathBuf::from(path);
    }
    let path = PathBuf::from(env!("CARGO_BIN_EXE_reflex")).with_file_name("reflexd");
    assert!(
        path.is_file(),
        "no reflexd at {}: build it first (`cargo build --release --workspace`, or \
         `cargo build -p reflex-server --bin reflexd` with the profile of this test), \
         or set REFLEXD",
        path.display()
    );
    path
}

/// Runs `reflex crash-test --json -q` with `args` in a fresh directory; returns the output and
/// the parsed summary.
fn crash_test(args: &[&str]) -> (Output, Value) {
    let dir = tempfile::tempdir().unwrap_or_else(|error| panic!("tempdir: {error}"));
    let reflexd = reflexd_path();
    let dir_text = dir.path().display().to_string();
    let reflexd_text = reflexd.display().to_string();
    let mut all = vec![
        "crash-test",
        "--json",
        "-q",
        "--reflexd",
        &reflexd_text,
        "--dir",
        &dir_text,
        "--device-size",
        "16M",
        "--time-limit",
        "10m",
    ];
    all.extend_from_slice(args);
    let output = reflex(&all);
    let summary: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "no JSON summary ({error}); stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output, summary)
}

#[test]
fn five_kills_over_three_protocols_lose_no_durable_write() {
    let (output, summary) = crash_test(&[
        "--cycles",
        "5",
        "--blocks-per-cycle",
        "800",
        "--seed",
        "9",
        "--threads",
        "2",
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "summary: {summary:#}\nstderr: {stderr}"
    );
    assert!(stderr.contains("seed 9"), "the seed is printed: {stderr}");
    assert_eq!(summary["seed"], 9);
    assert_eq!(summary["lost_blocks"], 0, "{summary:#}");
    assert_eq!(summary["failures"].as_array().map(Vec::len), Some(0));
    assert_eq!(summary["cycles_completed"], 5);
    assert_eq!(summary["complete"], true);
    assert_eq!(summary["clean_shutdown"], true);
    assert_eq!(summary["request_errors"], 0);
    assert_eq!(summary["writers_finished_before_kill"], 0);
    assert_eq!(
        summary["kills_with_requests_in_flight"], 5,
        "every kill lands mid-write"
    );
    let verified = summary["blocks_verified"].as_u64().unwrap_or(0);
    assert!(
        verified >= 2000,
        "a few thousand durable blocks: {summary:#}"
    );
    // 5 cycles × 800 acknowledged blocks at least, every one a block of a known write.
    assert!(summary["blocks_written"].as_u64().unwrap_or(0) >= 4000);
    for protocol in ["native", "original", "nbd"] {
        let totals = &summary["protocols"][protocol];
        assert!(
            totals["writes_durable"].as_u64().unwrap_or(0) > 0,
            "{protocol}: {totals}"
        );
    }
    for protocol in ["native", "nbd"] {
        let totals = &summary["protocols"][protocol];
        assert!(
            totals["fua_writes"].as_u64().unwrap_or(0) > 0,
            "{protocol}: {totals}"
        );
        assert!(
            totals["flushes_completed"].as_u64().unwrap_or(0) > 0,
            "{protocol}: {totals}"
        );
    }
    // The original protocol has neither: its writes are durable through the others' FLUSHes.
    assert_eq!(summary["protocols"]["original"]["fua_writes"], 0);
    assert_eq!(summary["protocols"]["original"]["flushes"], 0);
}

/// Damages one durable block after the kill of cycle 1 and expects the run to report exactly
/// that block as `kind`.
fn check_negative_control(injection: &str, kind: &str) {
    let (output, summary) = crash_test(&[
        "--cycles",
        "3",
        "--blocks-per-cycle",
        "500",
        "--seed",
        "11",
        "--inject",
        injection,
        "--inject-cycle",
        "1",
    ]);
    assert!(
        !output.status.success(),
        "{injection}: the run must fail: {summary:#}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("1 blocks lost"), "{injection}: {stderr}");
    assert_eq!(summary["lost_blocks"], 1, "{injection}: {summary:#}");
    assert_eq!(summary["injected"]["cycle"], 1);
    let failures = summary["failures"].as_array().cloned().unwrap_or_default();
    assert_eq!(failures.len(), 1, "{injection}: {summary:#}");
    let failure = &failures[0];
    assert_eq!(failure["block"], summary["injected"]["block"], "{failure}");
    assert_eq!(failure["cycle"], 1, "{failure}");
    assert_eq!(failure["kind"], kind, "{failure}");
    assert_eq!(failure["category"], "durable", "{failure}");
    assert_eq!(summary["failure_kinds"][kind], 1);
    // The run stops after the verification that found it.
    assert_eq!(summary["cycles_completed"], 2);
    assert_eq!(summary["complete"], false);
}

#[test]
fn negative_control_garbage_in_a_durable_block_is_reported() {
    check_negative_control("garbage", "garbage");
}

#[test]
fn negative_control_a_lost_write_is_reported_as_stale() {
    check_negative_control("stale", "stale");
}

#[test]
fn negative_control_a_misdirected_write_is_reported_as_misplaced() {
    check_negative_control("misplaced", "misplaced");
}
