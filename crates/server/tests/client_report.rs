//! REPORT (`docs/PROTOCOL.md` §1.9) on a real server: what a latency-critical tenant's client
//! measured reaches the device's self-calibration as the share of the SLO spent outside the
//! server; from anyone else it is answered OK and changes nothing.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{config, namespace, start};
use reflex_client::Client;
use reflex_proto::native::ReportBody;
use reflex_qos::WindowObservation;
use reflex_server::ServerHandle;

const SLO_US: u32 = 500;
/// A report far over the SLO, of enough reads to count.
const SLOW: ReportBody = ReportBody {
    reads: 1_000,
    read_p95_us: 4_000,
    backlog: 0,
};

/// One thread, `emu:device-a-small` with its profile, self-calibration on with 20 ms windows
/// that count from 10 reads, round trips not learned (a connection just opened on loopback
/// may report a round trip of half the SLO): only reports can move the share.
fn calibrated_server() -> ServerHandle {
    let profile = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../profiles/device-a-small.toml");
    let mut device = namespace(1, "emu:device-a-small", Some(64 << 20));
    device.profile = Some(profile.to_string_lossy().into_owned());
    let mut server_config = config(vec![device]);
    server_config.threads = 1;
    server_config.qos = true;
    let calibration = &mut server_config.qos_config.calibration;
    calibration.enabled = true;
    calibration.window_us = 20_000;
    calibration.samples_min = 10;
    calibration.learn_network_rtt = false;
    start(server_config)
}

fn connect(server: &ServerHandle) -> Client {
    Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("connect: {e}"))
}

/// A client bound to a new latency-critical tenant (2,000 IOPS of reads at the SLO).
fn lc_client(server: &ServerHandle) -> Client {
    let mut client = connect(server);
    let handle = client
        .register_lc(1, SLO_US, 2_000, 100)
        .expect("register LC");
    client.bind(handle).expect("bind");
    client
}

/// Reads and REPORTs `report` on `client` until the calibrator's last window satisfies
/// `done`, or 10 s pass; returns the last window seen.
fn report_until(
    server: &ServerHandle,
    client: &mut Client,
    report: ReportBody,
    done: impl Fn(&WindowObservation) -> bool,
) -> Option<WindowObservation> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = vec![0u8; 4096];
    let mut seen = None;
    while Instant::now() < deadline {
        for block in 0..40u64 {
            client.read(1, block * 4096, &mut buf).expect("read");
        }
        client.report(report).expect("REPORT is answered OK");
        seen = server.calibration(1).and_then(|info| info.last);
        if seen.as_ref().is_some_and(&done) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    seen
}

#[test]
fn an_lc_clients_report_becomes_the_share_outside_the_server() {
    let server = calibrated_server();
    let mut client = lc_client(&server);
    // A p95 of 4 ms at the client: whatever the server's own p95, the learned share is
    // capped at network_share_max (half the SLO).
    let capped = u64::from(SLO_US) / 2;
    let report = ReportBody {
        reads: 40,
        read_p95_us: 4_000,
        backlog: 0,
    };
    let seen = report_until(&server, &mut client, report, |last| {
        last.client_share_us == capped
    });
    assert_eq!(seen.map(|last| last.client_share_us), Some(capped));
    drop(client);
    server.shutdown().expect("shutdown");
}

/// The backlog an LC client REPORTs (requests due and not yet sent) reaches the calibrator as
/// LC requests waiting, beside those at the scheduler: the evidence that tenants kept sending
/// after a squeeze when their window is full and the server's queue cannot grow.
#[test]
fn an_lc_clients_reported_backlog_counts_as_waiting_requests() {
    const BACKLOG: u32 = 5_000;
    let server = calibrated_server();
    let mut client = lc_client(&server);
    let report = ReportBody {
        reads: 40,
        read_p95_us: 300,
        backlog: BACKLOG,
    };
    let seen = report_until(&server, &mut client, report, |last| {
        last.lc_queued_requests >= Some(u64::from(BACKLOG))
    });
    // Nothing waits at the scheduler of an idle device: all of it is the client's.
    assert_eq!(
        seen.and_then(|last| last.lc_queued_requests),
        Some(u64::from(BACKLOG))
    );
    drop(client);
    server.shutdown().expect("shutdown");
}

#[test]
fn reports_from_anyone_but_an_lc_client_are_answered_and_ignored() {
    let server = calibrated_server();
    // Unbound, then bound to a best-effort tenant; a report of too few reads from an LC one.
    let mut unbound = connect(&server);
    unbound.report(SLOW).expect("OK when unbound");
    let mut best_effort = connect(&server);
    let be = best_effort.register_be(1).expect("register BE");
    best_effort.bind(be).expect("bind");
    let mut lc = lc_client(&server);
    let mut buf = vec![0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut windows = 0;
    while Instant::now() < deadline && windows < 20 {
        for block in 0..40u64 {
            lc.read(1, block * 4096, &mut buf).expect("read");
        }
        best_effort.report(SLOW).expect("OK from best effort");
        lc.report(ReportBody { reads: 19, ..SLOW })
            .expect("OK below the reads a p95 needs");
        if let Some(last) = server.calibration(1).and_then(|info| info.last) {
            windows += 1;
            assert_eq!(
                last.client_share_us, 0,
                "an ignored report moved the share: {last:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(windows > 0, "no calibration window closed in 10 s");
    drop((unbound, best_effort, lc));
    server.shutdown().expect("shutdown");
}
