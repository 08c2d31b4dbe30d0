//! The metrics as Prometheus sees them: a real Prometheus server (Debian's `prometheus`,
//! installed by `scripts/test.sh`) scrapes a running reflexd, and a PromQL query through its
//! HTTP API returns a tenant's read p95, in the same histogram bucket as the server's own
//! figure; `promtool check metrics` accepts the exposition. Both tools are required: a missing
//! one fails the test.

mod admin_common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use admin_common::{Api, config, start, tenant};
use reflex_client::Client;
use reflex_server::metrics::LATENCY_BOUNDS_US;
use serde_json::Value;

/// Reads the tenant makes: enough for a p95, few enough to be quick.
const READS: u64 = 400;
/// How long Prometheus may take to start and scrape (it scrapes every second).
const PROMETHEUS_WAIT: Duration = Duration::from_secs(90);

/// Kills the process it holds when dropped (a failing test leaves no Prometheus behind).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Index of the histogram bucket (`le` bound) a latency in µs falls in.
fn bucket_of(latency_us: f64) -> usize {
    LATENCY_BOUNDS_US
        .iter()
        .position(|bound| latency_us <= *bound as f64)
        .unwrap_or(LATENCY_BOUNDS_US.len())
}

/// A reflexd whose tenant `reader` (LC, 2 ms) has made [`READS`] reads.
fn server_with_reads() -> (reflex_server::ServerHandle, Api) {
    let (server, api) = start(config(None));
    let created = api.post(
        "/v1/namespaces/1/tenants",
        r#"{"name": "reader", "class": "lc", "latency_us_p95": 2000, "iops": 2000}"#,
    );
    assert_eq!(created.status, 201, "{}", created.text);
    let handle = u64::from_str_radix(
        created.json()["tenant"]["handle"].as_str().unwrap_or(""),
        16,
    )
    .unwrap_or_else(|e| panic!("handle: {e}"));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    client.bind(handle).unwrap_or_else(|e| panic!("bind: {e}"));
    let mut buffer = vec![0u8; 4096];
    for block in 0..READS {
        client
            .read(1, (block % 64) * 4096, &mut buffer)
            .unwrap_or_else(|e| panic!("read: {e}"));
    }
    api.wait_for("/v1/stats", |stats| {
        tenant(&stats["tenants"], "reader")
            .is_some_and(|reader| reader["totals"]["reads"].as_u64() >= Some(READS))
    });
    (server, api)
}

#[test]
fn promtool_accepts_the_exposition_and_openmetrics_is_served_on_request() {
    let (_server, api) = server_with_reads();
    let text = api.get("/metrics").text;
    assert!(!text.contains("# EOF"), "{text}");
    assert!(
        text.contains("# TYPE reflex_tenant_operations_total counter"),
        "{text}"
    );
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/prometheus.yml");
    let checked = Command::new("promtool")
        .args(["check", "config", example])
        .output()
        .unwrap_or_else(|e| panic!("promtool: {e}"));
    assert!(
        checked.status.success(),
        "promtool check config {example}: {}",
        String::from_utf8_lossy(&checked.stdout)
    );
    admin_common::promtool_accepts(&text);

    let open_metrics =
        api.get_with_accept("/metrics", "application/openmetrics-text; version=1.0.0");
    assert!(
        open_metrics.text.ends_with("# EOF\n"),
        "{}",
        open_metrics.text
    );
    assert!(
        open_metrics
            .text
            .contains("# TYPE reflex_tenant_operations counter"),
        "{}",
        open_metrics.text
    );
}

#[test]
fn prometheus_scrapes_reflexd_and_promql_returns_the_tenants_p95() {
    let (_server, api) = server_with_reads();
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let port = free_port();
    let configuration = directory.path().join("prometheus.yml");
    std::fs::write(
        &configuration,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: reflexd\n    static_configs:\n      - targets: ['{}']\n",
            api.addr()
        ),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", configuration.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            directory.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .arg("--log.level=warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("prometheus (Debian's prometheus package; scripts/test.sh installs it): {e}")
        });
    let _prometheus = Reaped(child);
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    let query = |promql: &str| -> Option<Value> {
        let mut response = agent
            .get(format!("http://127.0.0.1:{port}/api/v1/query"))
            .query("query", promql)
            .call()
            .ok()?;
        let text = response.body_mut().read_to_string().ok()?;
        let value: Value = serde_json::from_str(&text).ok()?;
        (value["status"] == "success").then(|| value["data"]["result"].clone())
    };
    let promql = r#"histogram_quantile(0.95, sum by (le) (reflex_tenant_read_latency_seconds_bucket{job="reflexd",tenant="reader",namespace="1"}))"#;
    let started = Instant::now();
    let result = loop {
        if let Some(result) = query(promql)
            && result.as_array().is_some_and(|rows| !rows.is_empty())
        {
            break result;
        }
        assert!(
            started.elapsed() < PROMETHEUS_WAIT,
            "Prometheus did not scrape reflexd at {} in {PROMETHEUS_WAIT:?}; up: {:?}",
            api.addr(),
            query("up")
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let text = result[0]["value"][1]
        .as_str()
        .unwrap_or_else(|| panic!("{result}"));
    let p95_seconds: f64 = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
    assert!(p95_seconds.is_finite() && p95_seconds > 0.0, "{result}");

    // The server's own p95 over the same reads lies in the same bucket (Prometheus
    // interpolates inside it).
    let stats = api.get("/v1/stats").json();
    let reader = tenant(&stats["tenants"], "reader").unwrap_or_else(|| panic!("{stats}"));
    let server_p95_us = reader["totals"]["read_latency_us"]["p95"]
        .as_u64()
        .unwrap_or_else(|| panic!("{reader}"));
    assert_eq!(
        bucket_of(p95_seconds * 1e6),
        bucket_of(server_p95_us as f64),
        "Prometheus says p95 = {p95_seconds} s, the server {server_p95_us} µs"
    );

    // The SLO is there to compare against (the dashboard's other line), and Prometheus saw
    // every read.
    let slo = query(r#"reflex_tenant_slo_latency_seconds{tenant="reader"}"#)
        .unwrap_or_else(|| panic!("no SLO series"));
    assert_eq!(slo[0]["value"][1], "0.002", "{slo}");
    let reads = query(r#"reflex_tenant_operations_total{tenant="reader",kind="read"}"#)
        .unwrap_or_else(|| panic!("no operations series"));
    let reads: f64 = reads[0]["value"][1]
        .as_str()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| panic!("{reads}"));
    assert!(reads >= READS as f64, "{reads}");

    // Every query of the Grafana dashboard is valid PromQL for this Prometheus, and every
    // series it names is one reflexd exports.
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana/reflex-dashboard.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let dashboard: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    let exported = api.get("/metrics").text;
    let mut expressions = 0;
    for panel in dashboard["panels"]
        .as_array()
        .unwrap_or_else(|| panic!("no panels"))
    {
        for target in panel["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("{panel}"))
        {
            let expression = target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("{target}"));
            let promql = expression
                .replace("$job", ".*")
                .replace("$tenant", "reader")
                .replace("$__rate_interval", "5s");
            assert!(
                query(&promql).is_some(),
                "the dashboard's {promql} is refused"
            );
            for name in promql.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if name.starts_with("reflex_") {
                    assert!(
                        exported.contains(&format!("\n{name}")),
                        "the dashboard reads {name}, which reflexd does not export"
                    );
                }
            }
            expressions += 1;
        }
    }
    assert!(expressions >= 8, "{expressions}");

    eprintln!(
        "Prometheus: reader p95 = {:.0} µs (server: {server_p95_us} µs) over {reads} reads",
        p95_seconds * 1e6
    );
}
