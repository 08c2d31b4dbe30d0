//! `reflex bench --server nbd://…` as a user runs it: the real binary against a real
//! `reflexd` (in-process, NBD on a loopback port picked by the kernel, the native listener on
//! port 0 and the original protocol off) and, when it is installed, against `nbdkit memory`.
//! Every run is bounded by an operation count, so the assertions are exact counts, never
//! timings.

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reflex_server::{Config, NamespaceConfig, NbdConfig, ServerHandle};
use serde_json::Value;

use common::{assert_clean_row, assert_verify_fails, bench_ok, reflex};

/// Longest wait for nbdkit to listen.
const NBDKIT_START_TIMEOUT: Duration = Duration::from_secs(20);

/// A `reflexd` serving `namespace` as the NBD export `disk` on a free loopback port (the
/// native listener on port 0, the original protocol off).
fn start_reflexd(namespace: NamespaceConfig) -> ServerHandle {
    common::start_server(Config {
        window: 32,
        nbd: NbdConfig {
            enabled: true,
            port: 0,
            ..NbdConfig::default()
        },
        ..Config::loopback(vec![NamespaceConfig {
            name: Some("disk".to_string()),
            ..namespace
        }])
    })
}

fn nbd_uri(server: &ServerHandle, export: &str) -> String {
    let address = server.nbd_addr().expect("NBD is enabled");
    format!("nbd://{address}/{export}")
}

/// Verified reads and writes over several threads and connections, plus the probe.
fn verified_mixed_run(uri: &str, range: &str, ops: u64) -> Value {
    let ops_text = ops.to_string();
    let report = bench_ok(&[
        "-s",
        uri,
        "--verify",
        "--ops",
        &ops_text,
        "--read-ratio",
        "0.7",
        "--qd",
        "8",
        "--threads",
        "2",
        "--connections",
        "2",
        "--warmup",
        "0",
        "--duration",
        "60s",
        "--range",
        range,
        "--probe-rate",
        "200",
    ]);
    assert_eq!(report["protocol"], "nbd");
    assert_eq!(report["verify"], true);
    assert_eq!(report["connections_per_thread"], 2);
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_clean_row(row, ops);
    assert!(row["read"]["count"].as_u64().unwrap_or(0) > 0);
    assert!(row["write"]["count"].as_u64().unwrap_or(0) > 0);
    assert!(
        row["probe"].is_object(),
        "the probe reports beside the load"
    );
    assert_eq!(row["probe"]["errors"], 0);
    report
}

#[test]
fn nbd_verify_against_reflexd_with_reads_writes_and_several_connections() {
    let server = start_reflexd(NamespaceConfig::new(1, "mem:32M"));
    let uri = nbd_uri(&server, "disk");
    let report = verified_mixed_run(&uri, "8M", 4000);
    assert_eq!(report["export"], "disk");
    assert_eq!(
        report["fill"]["bytes"],
        8 << 20,
        "the fill covers the range"
    );

    // The default export (empty name), read-only load, two queue depths.
    let uri = nbd_uri(&server, "");
    let report = bench_ok(&[
        "-s",
        &uri,
        "--ops",
        "600",
        "--qd",
        "1,32",
        "--warmup",
        "0",
        "--duration",
        "60s",
    ]);
    assert_eq!(report["export"], "");
    assert_eq!(
        report["range_length_bytes"],
        32 << 20,
        "whole export by default"
    );
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2);
    for row in rows {
        assert_clean_row(row, 600);
        assert_eq!(row["write"]["count"], 0);
    }
    server.shutdown().expect("shutdown");
}

#[test]
fn nbd_verify_on_a_file_namespace_with_large_sequential_requests() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let file = dir.path().join("ns.img");
    let server =
        start_reflexd(NamespaceConfig::new(1, format!("file:{}", file.display())).sized(16 << 20));
    let uri = nbd_uri(&server, "disk");
    let report = bench_ok(&[
        "-s",
        &uri,
        "--verify",
        "--ops",
        "400",
        "--read-ratio",
        "0.5",
        "--qd",
        "4",
        "--io-size",
        "64k",
        "--pattern",
        "seq",
        "--connections",
        "3",
        "--warmup",
        "0",
        "--duration",
        "60s",
    ]);
    assert_eq!(report["fill"]["bytes"], 16 << 20);
    assert_clean_row(&report["rows"][0], 400);
    server.shutdown().expect("shutdown");
}

#[test]
fn nbd_unknown_export_fails_the_handshake_with_a_clear_error() {
    let server = start_reflexd(NamespaceConfig::new(1, "mem:8M"));
    let uri = nbd_uri(&server, "no-such-export");
    let output = reflex(&["bench", "-q", "-s", &uri, "--ops", "10", "--warmup", "0"]);
    assert!(!output.status.success(), "an unknown export must fail");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("NBD handshake"), "stderr: {stderr}");
    assert!(stderr.contains("\"no-such-export\""), "stderr: {stderr}");
    assert!(
        stderr.contains("unknown export (NBD_REP_ERR_UNKNOWN)"),
        "stderr: {stderr}"
    );
    // Native-only options are refused for an NBD target.
    let uri = nbd_uri(&server, "disk");
    for args in [
        vec!["bench", "-s", uri.as_str(), "--namespace", "1"],
        vec!["bench", "-s", uri.as_str(), "--io-size", "1000"],
        vec!["bench", "-s", "nbd:///disk"],
    ] {
        let output = reflex(&args);
        assert!(!output.status.success(), "{args:?} should fail");
    }
    server.shutdown().expect("shutdown");
}

/// An nbdkit process, stopped (by its own pid) when dropped.
struct Nbdkit {
    child: Child,
    address: SocketAddr,
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `nbdkit PLUGIN SIZE` (memory, null) on a free loopback port, or `None` when nbdkit
/// is not installed.
fn start_nbdkit(plugin: &str, size: &str) -> Option<Nbdkit> {
    let probe = Command::new("nbdkit")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|status| status.success()) {
        return None;
    }
    // The kernel picks a free port; nbdkit takes it over right after (a small race that a
    // retry loop would hide; a clash fails the test loudly instead).
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .expect("free port")
        .port();
    let child = Command::new("nbdkit")
        .args([
            "--foreground",
            "--exit-with-parent",
            "--ipaddr",
            "127.0.0.1",
        ])
        .args(["--port", &port.to_string(), plugin, size])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawning nbdkit");
    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut nbdkit = Nbdkit { child, address };
    let deadline = Instant::now() + NBDKIT_START_TIMEOUT;
    while TcpStream::connect(address).is_err() {
        if let Ok(Some(status)) = nbdkit.child.try_wait() {
            panic!("nbdkit exited before listening: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "nbdkit did not listen on {address}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(nbdkit)
}

#[test]
fn nbd_verify_against_nbdkit_memory() {
    let Some(nbdkit) = start_nbdkit("memory", "64M") else {
        skip_loudly("nbd_verify_against_nbdkit_memory");
        return;
    };
    let uri = format!("nbd://{}", nbdkit.address);
    let report = verified_mixed_run(&uri, "16M", 4000);
    assert_eq!(report["export"], "");
    assert_eq!(report["fill"]["bytes"], 16 << 20);
}

fn skip_loudly(test: &str) {
    eprintln!(
        "\n*** SKIPPED {test}: nbdkit is not installed \
         (scripts/test.sh installs it; in CI this test runs) ***\n"
    );
}

/// Negative control: `nbdkit null` discards writes and reads zeroes, so --verify must fail
/// over NBD too, naming the offset.
#[test]
fn nbd_verify_fails_against_a_server_that_discards_writes() {
    let Some(nbdkit) = start_nbdkit("null", "64M") else {
        skip_loudly("nbd_verify_fails_against_a_server_that_discards_writes");
        return;
    };
    let uri = format!("nbd://{}", nbdkit.address);
    assert_verify_fails(&uri);
}
