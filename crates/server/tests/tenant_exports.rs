//! Tenants for standard clients: several NBD exports (`[[nbd.export]]`) name one namespace,
//! each charged to its own tenant, so that fio (nbd engine, one job per export) is two LC and
//! two BE tenants at once, Figure 5 scenario 2's four; and the same through the original
//! protocol, one port per tenant. The test checks that the exports, the tenants and their
//! metrics exist and that every request is charged to the tenant its export or port names
//! (counts, not timing); `bench/fig5-exports.sh` is the benchmark.

mod admin_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use admin_common::{Api, profile, start, tenant};
use reflex_proto::original::{Header, Opcode};
use reflex_server::admin::AdminConfig;
use reflex_server::{
    Config, NamespaceConfig, NbdConfig, NbdExportConfig, OriginalPortConfig, TenantConfig,
};
use serde_json::Value;

const TENANTS: [&str; 4] = ["A", "B", "C", "D"];
/// Requests each fio job makes.
const FIO_IOS_PER_JOB: u64 = 300;
/// Reads sent through each original-protocol port.
const ORIGINAL_READS_PER_PORT: u64 = 40;

/// Figure 5 scenario 2's tenants (at 1/10 scale) on the small emulated device, an NBD export
/// `fig5-X` and an original-protocol port per tenant, the admin API on a free port.
fn config() -> Config {
    let namespace = NamespaceConfig {
        profile: Some(profile("device-a-small.toml")),
        ..NamespaceConfig::new(1, "emu:device-a-small").sized(64 << 20)
    };
    Config {
        tenants: vec![
            TenantConfig::latency_critical("A", 500, 12_000, 100),
            TenantConfig::latency_critical("B", 500, 7_000, 80),
            TenantConfig::best_effort("C"),
            TenantConfig::best_effort("D"),
        ],
        nbd: NbdConfig {
            enabled: true,
            port: 0,
            exports: TENANTS
                .iter()
                .map(|name| NbdExportConfig {
                    name: format!("fig5-{name}"),
                    namespace: 1,
                    tenant: Some((*name).to_string()),
                })
                .collect(),
            ..NbdConfig::default()
        },
        original_ports: Some(
            TENANTS
                .iter()
                .map(|name| OriginalPortConfig {
                    tenant: Some((*name).to_string()),
                    ..OriginalPortConfig::new(0, 1)
                })
                .collect(),
        ),
        admin: AdminConfig {
            stats_window: Duration::from_millis(200),
            ..AdminConfig::loopback()
        },
        driver: admin_common::driver(),
        ..Config::loopback(vec![namespace])
    }
}

fn totals(api: &Api, name: &str) -> (u64, u64) {
    let stats = api.get("/v1/stats").json();
    let found = tenant(&stats["tenants"], name).unwrap_or_else(|| panic!("no {name}: {stats}"));
    (
        found["totals"]["reads"].as_u64().unwrap_or(0),
        found["totals"]["writes"].as_u64().unwrap_or(0),
    )
}

/// Waits until the live figures show `count` requests for every tenant.
fn wait_for_requests(api: &Api, expected: &[(String, u64)]) -> Value {
    api.wait_for("/v1/stats", |stats| {
        expected.iter().all(|(name, count)| {
            tenant(&stats["tenants"], name).is_some_and(|found| {
                found["totals"]["reads"].as_u64().unwrap_or(0)
                    + found["totals"]["writes"].as_u64().unwrap_or(0)
                    >= *count
            })
        })
    })
}

#[test]
fn four_nbd_exports_of_one_namespace_are_four_tenants_for_fio() {
    let (server, api) = start(config());
    let nbd = server
        .nbd_addr()
        .unwrap_or_else(|| panic!("no NBD listener"));

    // The namespace lists all four tenants.
    let namespace = api.get("/v1/namespaces/1").json();
    for name in TENANTS {
        assert!(
            namespace["tenants"]
                .as_array()
                .is_some_and(|tenants| tenants.iter().any(|t| t == name)),
            "{namespace}"
        );
    }

    // Scenario 2's mixes: A reads, B 80 % reads, C 95 %, D 25 %.
    let mixes = [("A", 100), ("B", 80), ("C", 95), ("D", 25)];
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let output = directory.path().join("fio.json");
    let mut fio = Command::new("fio");
    fio.arg(format!("--output={}", output.display()))
        .arg("--output-format=json");
    for (name, read_percent) in mixes {
        fio.arg(format!("--name={name}"))
            .arg("--ioengine=nbd")
            .arg(format!("--uri=nbd://{nbd}/fig5-{name}"))
            .arg("--rw=randrw")
            .arg(format!("--rwmixread={read_percent}"))
            .arg("--bs=4k")
            .arg("--size=16M")
            .arg("--iodepth=8")
            .arg(format!("--number_ios={FIO_IOS_PER_JOB}"))
            .arg("--time_based=0");
    }
    let status = fio
        .status()
        .unwrap_or_else(|e| panic!("fio (scripts/test.sh installs it): {e}"));
    assert!(status.success(), "fio failed: {status}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&output).unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("fio JSON: {e}"));
    let jobs = report["jobs"]
        .as_array()
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(jobs.len(), 4, "{report}");
    let mut expected = Vec::new();
    for job in jobs {
        let name = job["jobname"].as_str().unwrap_or_else(|| panic!("{job}"));
        assert_eq!(job["error"], 0, "{job}");
        let reads = job["read"]["total_ios"].as_u64().unwrap_or(0);
        let writes = job["write"]["total_ios"].as_u64().unwrap_or(0);
        assert_eq!(reads + writes, FIO_IOS_PER_JOB, "{name}: {job}");
        expected.push((name.to_string(), reads, writes));
    }
    let wanted: Vec<(String, u64)> = expected
        .iter()
        .map(|(name, reads, writes)| (name.clone(), reads + writes))
        .collect();
    wait_for_requests(&api, &wanted);
    // Every request of job X was charged to tenant X, and to no one else.
    for (name, reads, writes) in &expected {
        assert_eq!(totals(&api, name), (*reads, *writes), "tenant {name}");
    }
    let metrics = api.get("/metrics").text;
    for name in TENANTS {
        for kind in ["read", "write"] {
            let series = format!(
                r#"reflex_tenant_operations_total{{tenant="{name}",namespace="1",kind="{kind}"}}"#
            );
            assert!(metrics.contains(&series), "{series} missing");
        }
        let latency = format!(r#"reflex_tenant_read_latency_seconds_count{{tenant="{name}""#);
        assert!(metrics.contains(&latency), "{latency} missing");
    }
    assert!(
        metrics.contains(r#"reflex_tenant_slo_latency_seconds{tenant="A",namespace="1"} 0.0005"#)
    );
}

#[test]
fn one_original_protocol_port_per_tenant() {
    let (server, api) = start(config());
    let ports = server.original_addrs().to_vec();
    assert_eq!(ports.len(), TENANTS.len());
    for (index, (namespace_id, addr)) in ports.iter().enumerate() {
        assert_eq!(*namespace_id, 1);
        let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("{e}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("{e}"));
        for read in 0..ORIGINAL_READS_PER_PORT {
            let header = Header {
                opcode: Opcode::Read,
                handle: read.to_le_bytes(),
                lba: read * 8,
                lba_count: 8,
            };
            stream
                .write_all(&header.to_bytes())
                .unwrap_or_else(|e| panic!("{e}"));
            let mut answer = [0u8; 24 + 4096];
            stream
                .read_exact(&mut answer)
                .unwrap_or_else(|e| panic!("port {index}: {e}"));
        }
    }
    let wanted: Vec<(String, u64)> = TENANTS
        .iter()
        .map(|name| ((*name).to_string(), ORIGINAL_READS_PER_PORT))
        .collect();
    wait_for_requests(&api, &wanted);
    // The ports are in configuration order: port i charges tenant i.
    for name in TENANTS {
        assert_eq!(
            totals(&api, name),
            (ORIGINAL_READS_PER_PORT, 0),
            "tenant {name}"
        );
    }
}

#[test]
fn exports_are_validated() {
    let mut bad = config();
    bad.nbd.exports.push(NbdExportConfig {
        name: "fig5-A".to_string(),
        namespace: 1,
        tenant: None,
    });
    let error = bad
        .validate()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        error.contains("fig5-A") && error.contains("taken"),
        "{error}"
    );
    let mut bad = config();
    bad.nbd.exports[0].namespace = 9;
    let error = bad
        .validate()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(error.contains("no namespace 9"), "{error}");
    let mut toml_config = Config::from_toml(
        r#"
[nbd]
default_export = "gold-view"
[[nbd.export]]
name = "gold-view"
namespace = 1
tenant = "gold"
[[namespace]]
id = 1
backend = "mem:1M"
"#,
        "test",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    toml_config.original_ports = Some(Vec::new());
    toml_config.validate().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(toml_config.tenants_bound_to(1), ["gold"]);
}

/// Sends `count` 4 KiB reads through an original-protocol port and waits for each answer.
fn original_reads(addr: std::net::SocketAddr, count: u64) {
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("{e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap_or_else(|e| panic!("{e}"));
    for read in 0..count {
        let header = Header {
            opcode: Opcode::Read,
            handle: read.to_le_bytes(),
            lba: read * 8,
            lba_count: 8,
        };
        stream
            .write_all(&header.to_bytes())
            .unwrap_or_else(|e| panic!("{e}"));
        let mut answer = [0u8; 24 + 4096];
        stream
            .read_exact(&mut answer)
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn a_tenants_configured_priority_class_picks_the_device_queue_its_requests_reach() {
    use reflex_server::PriorityConfig;
    let mut config = config();
    // A urgent, C low, B and D without a class (the default queue).
    config.tenants[0].priority = Some(PriorityConfig::Urgent);
    config.tenants[2].priority = Some(PriorityConfig::Low);
    let (server, api) = start(config);
    let queue = |class: PriorityConfig| {
        server
            .emu_commands_in_queue(1, class.submission_queue())
            .unwrap_or_else(|| panic!("namespace 1 is an emulated device"))
    };
    let before: Vec<u64> = [
        PriorityConfig::Urgent,
        PriorityConfig::High,
        PriorityConfig::Medium,
        PriorityConfig::Low,
    ]
    .into_iter()
    .map(queue)
    .collect();
    let ports = server.original_addrs().to_vec();
    original_reads(ports[0].1, 30); // A: urgent
    original_reads(ports[2].1, 20); // C: low
    assert_eq!(queue(PriorityConfig::Urgent) - before[0], 30);
    assert_eq!(queue(PriorityConfig::Low) - before[3], 20);
    // B has no class: its reads go where a connection's go by default, not to A's or C's.
    original_reads(ports[1].1, 10);
    assert_eq!(queue(PriorityConfig::Urgent) - before[0], 30);
    assert_eq!(queue(PriorityConfig::Low) - before[3], 20);
    let default_queues =
        (queue(PriorityConfig::High) - before[1]) + (queue(PriorityConfig::Medium) - before[2]);
    assert_eq!(default_queues, 10);

    // Through NBD: export fig5-A is A's, so urgent too.
    let nbd = server
        .nbd_addr()
        .unwrap_or_else(|| panic!("no NBD listener"));
    let output = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 0 64k"])
        .arg(format!("nbd://{nbd}/fig5-A"))
        .output()
        .unwrap_or_else(|e| panic!("qemu-io (scripts/test.sh installs qemu-utils): {e}"));
    assert!(output.status.success(), "{output:?}");
    assert!(queue(PriorityConfig::Urgent) - before[0] > 30);
    assert_eq!(queue(PriorityConfig::Low) - before[3], 20);
    drop(api);
}
