//! The fairness stage as the admin API and the metrics show it, on a real reflexd over
//! loopback: with `fair_share` on, a dense and a sparse best-effort tenant reading at once
//! appear in `GET /v1/fairness` with the stage's counters, the monitor's F and each flow's
//! slowdown and density, and in `/metrics` as `reflex_fairness_*`; with the stage off (the
//! default) the endpoint says `off` and the metrics have no fairness family. `promtool check
//! metrics` accepts the families, and both answers fit `docs/admin-openapi.json`.

mod admin_common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use admin_common::{Api, config, start};
use reflex_client::Client;
use reflex_qos::{FairMode, FairQueueConfig, FairnessConfig};
use serde_json::Value;

/// Connections of the dense tenant (each one request in flight); the sparse one has one.
const DENSE_CONNECTIONS: usize = 4;

fn be_tenant(api: &Api, name: &str) -> u64 {
    let created = api.post(
        "/v1/namespaces/1/tenants",
        &format!(r#"{{"name": "{name}", "class": "be"}}"#),
    );
    assert_eq!(created.status, 201, "{}", created.text);
    u64::from_str_radix(
        created.json()["tenant"]["handle"].as_str().unwrap_or(""),
        16,
    )
    .unwrap_or_else(|e| panic!("handle: {e}"))
}

/// Reads on `connections` connections bound to `handle` until `stop` is set.
fn readers(
    addr: std::net::SocketAddr,
    handle: u64,
    connections: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<u64>> {
    (0..connections)
        .map(|connection| {
            let stop = Arc::clone(stop);
            std::thread::spawn(move || {
                let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
                client.bind(handle).unwrap_or_else(|e| panic!("bind: {e}"));
                let mut buffer = vec![0u8; 4096];
                let mut reads = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let block = (reads * 7 + connection as u64 * 131) % 4096;
                    client
                        .read(1, block * 4096, &mut buffer)
                        .unwrap_or_else(|e| panic!("read: {e}"));
                    reads += 1;
                }
                reads
            })
        })
        .collect()
}

fn flow<'a>(thread: &'a Value, tenant: &str) -> Option<&'a Value> {
    thread["flows"]
        .as_array()?
        .iter()
        .find(|flow| flow["tenant"] == tenant)
}

#[test]
fn fair_share_shows_its_counters_f_and_each_flows_slowdown() {
    let mut config = config(None);
    fair_share(&mut config);
    let (server, api) = start(config);
    let dense = be_tenant(&api, "dense");
    let sparse = be_tenant(&api, "sparse");
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = readers(server.native_addr(), dense, DENSE_CONNECTIONS, &stop);
    workers.extend(readers(server.native_addr(), sparse, 1, &stop));

    // Both flows judged in one window of one thread, and the stage at work.
    let view = api.wait_for("/v1/fairness", |view| {
        let Some(namespace) = view["namespaces"].get(0) else {
            return false;
        };
        namespace["released_total"].as_u64() > Some(0)
            && namespace["threads"].as_array().is_some_and(|threads| {
                threads.iter().any(|thread| {
                    thread["fairness"].is_f64()
                        && ["dense", "sparse"].iter().all(|name| {
                            flow(thread, name).is_some_and(|flow| flow["slowdown"].is_f64())
                        })
                })
            })
    });
    let metrics = api.get("/metrics").text;
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = workers
        .into_iter()
        .map(|worker| worker.join().unwrap_or_else(|_| panic!("reader panicked")))
        .sum();
    assert!(reads > 0);

    conforms(&view, &schema("Fairness"), "fairness");
    let namespace = &view["namespaces"][0];
    assert_eq!(namespace["namespace_id"], 1);
    assert_eq!(namespace["mode"], "fair_share", "{namespace}");
    assert!(namespace["held_total"].as_u64() >= namespace["released_total"].as_u64());
    let fairness_min = namespace["fairness_min"].as_f64().unwrap_or(-1.0);
    assert!((0.0..=1.0).contains(&fairness_min), "{namespace}");
    let thread = namespace["threads"]
        .as_array()
        .and_then(|threads| threads.iter().find(|t| t["fairness"].is_f64()))
        .unwrap_or_else(|| panic!("{namespace}"));
    assert!(thread["device_in_flight"].as_u64() <= Some(2), "{thread}");
    // The adaptive depth is off: every place in use.
    assert_eq!(thread["device_depth"], 2, "{thread}");
    assert_eq!(thread["device_depth_max"], 2, "{thread}");
    assert_eq!(thread["depth_lowered_total"], 0, "{thread}");
    let utilisation = thread["utilisation"].as_f64().unwrap_or(-1.0);
    assert!((0.0..=1.0).contains(&utilisation), "{thread}");
    assert!(
        thread["window_age_seconds"].as_f64() >= Some(0.0),
        "{thread}"
    );
    for name in ["dense", "sparse"] {
        let flow = flow(thread, name).unwrap_or_else(|| panic!("{thread}"));
        assert!(flow["slowdown"].as_f64() > Some(0.0), "{flow}");
        assert!(flow["rt_us"].as_f64() > Some(0.0), "{flow}");
        assert!(flow["intensity_per_sec"].as_f64() > Some(0.0), "{flow}");
        assert!(
            flow["density"] == "dense" || flow["density"] == "sparse",
            "{flow}"
        );
        assert_eq!(flow["handle"].as_str().map(str::len), Some(16), "{flow}");
    }

    for family in [
        "reflex_fairness_held_requests{",
        "reflex_fairness_device_in_flight{",
        "reflex_fairness_device_depth{",
        "reflex_fairness_released_total{",
        "reflex_fairness_held_total{",
        "reflex_fairness_windows_total{",
        "reflex_fairness_index{",
        "reflex_fairness_device_utilisation_ratio{",
        "reflex_fairness_flow_slowdown{",
        "reflex_fairness_flow_dense{",
    ] {
        assert!(metrics.contains(family), "{family} missing:\n{metrics}");
    }
    assert!(
        metrics.contains("tenant=\"dense\"") && metrics.contains("tenant=\"sparse\""),
        "{metrics}"
    );
    admin_common::promtool_accepts(&metrics);
    drop(server);
}

/// The OpenAPI document's schema `name` (schemathesis checks the API against the document,
/// but its server has the stage off: this checks an answer with every figure present).
fn schema(name: &str) -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/admin-openapi.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let document: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    document["components"]["schemas"][name].clone()
}

/// Whether `value` has the type, required fields and enum values `schema` gives (the subset
/// of JSON Schema the fairness schemas use), recursively; panics naming the first mismatch.
fn conforms(value: &Value, schema: &Value, at: &str) {
    if let Some(reference) = schema["$ref"].as_str() {
        let name = reference.rsplit('/').next().unwrap_or("");
        return conforms(value, &self::schema(name), at);
    }
    let types: Vec<&str> = match &schema["type"] {
        Value::String(one) => vec![one.as_str()],
        Value::Array(many) => many.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let type_of = match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_u64() || n.is_i64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let fits = types
        .iter()
        .any(|t| *t == type_of || (*t == "number" && type_of == "integer"));
    assert!(types.is_empty() || fits, "{at}: {value} is not {types:?}");
    if let Some(allowed) = schema["enum"].as_array() {
        assert!(allowed.contains(value), "{at}: {value} not in {allowed:?}");
    }
    if let Some(required) = schema["required"].as_array() {
        for field in required.iter().filter_map(Value::as_str) {
            assert!(value.get(field).is_some(), "{at}: no {field} in {value}");
        }
    }
    if let (Some(properties), Some(object)) = (schema["properties"].as_object(), value.as_object())
    {
        for (field, inner) in object {
            let Some(property) = properties.get(field) else {
                panic!("{at}: {field} is not in the document");
            };
            conforms(inner, property, &format!("{at}.{field}"));
        }
    }
    if let (Some(items), Some(list)) = (schema.get("items"), value.as_array()) {
        for (index, item) in list.iter().enumerate() {
            conforms(item, items, &format!("{at}[{index}]"));
        }
    }
}

#[test]
fn with_the_stage_off_the_endpoint_says_so_and_metrics_have_no_fairness() {
    let (server, api) = start(config(None));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let mut buffer = vec![0u8; 4096];
    for block in 0..50 {
        client
            .read(1, block * 4096, &mut buffer)
            .unwrap_or_else(|e| panic!("read: {e}"));
    }
    let view = api.wait_for("/v1/fairness", |view| {
        view["namespaces"][0]["threads"]
            .as_array()
            .is_some_and(|threads| !threads.is_empty())
    });
    conforms(&view, &schema("Fairness"), "fairness");
    let namespace = &view["namespaces"][0];
    assert_eq!(namespace["mode"], "off", "{namespace}");
    assert_eq!(namespace["released_total"], 0, "{namespace}");
    assert!(namespace["fairness_min"].is_null(), "{namespace}");
    let metrics = api.get("/metrics").text;
    assert!(!metrics.contains("reflex_fairness_"), "{metrics}");
    drop(server);
}

/// The stage on in `fair_share` mode with two places, 50 ms windows.
fn fair_share(config: &mut reflex_server::Config) {
    config.qos_config.fairness = FairQueueConfig {
        mode: FairMode::FairShare,
        be_device_depth_max: 2,
        monitor: FairnessConfig {
            window_us: 50_000,
            samples_min: 5,
            ..FairnessConfig::default()
        },
        ..FairQueueConfig::default()
    };
}

/// Waits for a window of one thread in which `name`'s flow was judged and `done` holds for
/// it; returns the flow.
fn judged_flow(api: &Api, name: &str, done: impl Fn(&Value) -> bool) -> Value {
    let view = api.wait_for("/v1/fairness", |view| {
        view["namespaces"][0]["threads"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|thread| flow(thread, name))
            .any(|flow| flow["slowdown"].is_f64() && done(flow))
    });
    let flow = view["namespaces"][0]["threads"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|thread| flow(thread, name))
        .find(|flow| flow["slowdown"].is_f64() && done(flow))
        .cloned();
    conforms(&view, &schema("Fairness"), "fairness");
    flow.unwrap_or_else(|| panic!("{view}"))
}

#[test]
fn rt_alone_set_in_the_config_and_the_admin_api_stands_until_cleared() {
    let mut config = config(None);
    fair_share(&mut config);
    config.tenants[0].rt_alone_us = Some(700);
    let (server, api) = start(config);

    // From the configuration (gold is latency-critical: the stage holds best-effort flows
    // only, so its monitors never judge it; the value reaches them as the admin API's does).
    let gold = api.get("/v1/namespaces/1/tenants/gold").json();
    assert_eq!(gold["rt_alone_us"], 700, "{gold}");
    // From the admin API at creation; out-of-range values are refused and change nothing.
    for bad in [0u64, 60_000_001] {
        let refused = api.post(
            "/v1/namespaces/1/tenants",
            &format!(r#"{{"name": "bad", "class": "be", "rt_alone_us": {bad}}}"#),
        );
        assert_eq!(refused.status, 400, "{}", refused.text);
        assert!(refused.error().contains("rt_alone_us"), "{}", refused.text);
    }
    assert_eq!(api.get("/v1/namespaces/1/tenants/bad").status, 404);
    let created = api.post(
        "/v1/namespaces/1/tenants",
        r#"{"name": "dense", "class": "be", "rt_alone_us": 250}"#,
    );
    assert_eq!(created.status, 201, "{}", created.text);
    assert_eq!(created.json()["tenant"]["rt_alone_us"], 250);
    let dense = u64::from_str_radix(
        created.json()["tenant"]["handle"].as_str().unwrap_or(""),
        16,
    )
    .unwrap_or_else(|e| panic!("handle: {e}"));
    let sparse = be_tenant(&api, "sparse");

    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = readers(server.native_addr(), dense, DENSE_CONNECTIONS, &stop);
    workers.extend(readers(server.native_addr(), sparse, 1, &stop));

    // The set values stand in the monitors' windows; the unset one is learned.
    let flow = judged_flow(&api, "dense", |flow| flow["alone_set"] == true);
    assert_eq!(flow["rt_alone_us"].as_f64(), Some(250.0), "{flow}");
    judged_flow(&api, "sparse", |flow| flow["alone_set"] == false);

    // Set on the unset one, cleared on the set one: SLO untouched, no admission.
    let patched = api.patch("/v1/namespaces/1/tenants/sparse", r#"{"rt_alone_us": 123}"#);
    assert_eq!(patched.status, 200, "{}", patched.text);
    assert_eq!(patched.json()["tenant"]["rt_alone_us"], 123);
    assert_eq!(patched.json()["tenant"]["class"], "be");
    let patched = api.patch("/v1/namespaces/1/tenants/dense", r#"{"rt_alone_us": null}"#);
    assert_eq!(patched.status, 200, "{}", patched.text);
    assert!(patched.json()["tenant"]["rt_alone_us"].is_null());
    let refused = api.patch("/v1/namespaces/1/tenants/dense", r#"{"rt_alone_us": 0}"#);
    assert_eq!(refused.status, 400, "{}", refused.text);
    let flow = judged_flow(&api, "sparse", |flow| flow["alone_set"] == true);
    assert_eq!(flow["rt_alone_us"].as_f64(), Some(123.0), "{flow}");
    judged_flow(&api, "dense", |flow| flow["alone_set"] == false);
    // The namespace's default tenant (untenanted flows) takes one too.
    let patched = api.patch(
        "/v1/namespaces/1/tenants/(default)",
        r#"{"rt_alone_us": 90}"#,
    );
    assert_eq!(patched.status, 200, "{}", patched.text);

    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.join().unwrap_or_else(|_| panic!("reader panicked"));
    }
    drop(server);
}

#[test]
fn rt_alone_set_through_the_admin_api_survives_a_restart() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let state = directory.path().join("state.json").display().to_string();
    {
        let (server, api) = start(config(Some(state.clone())));
        let created = api.post(
            "/v1/namespaces/1/tenants",
            r#"{"name": "kept", "class": "be", "rt_alone_us": 400}"#,
        );
        assert_eq!(created.status, 201, "{}", created.text);
        let patched = api.patch("/v1/namespaces/1/tenants/gold", r#"{"rt_alone_us": 300}"#);
        assert_eq!(patched.status, 200, "{}", patched.text);
        server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }
    let (server, api) = start(config(Some(state)));
    let kept = api.get("/v1/namespaces/1/tenants/kept").json();
    assert_eq!(kept["rt_alone_us"], 400, "{kept}");
    let gold = api.get("/v1/namespaces/1/tenants/gold").json();
    assert_eq!(gold["rt_alone_us"], 300, "{gold}");
    assert_eq!(gold["latency_us_p95"], 500, "{gold}");
    drop(server);
}

/// A reload applies a configured tenant's `rt_alone_us` only where the file changed it: an
/// RT_alone the admin API set stands through a reload of the same file.
#[test]
fn a_reload_changes_rt_alone_only_where_the_file_changed_it() {
    let mut config = config(None);
    config.tenants[0].rt_alone_us = Some(700);
    let (server, api) = start(config.clone());
    let rt_alone =
        |api: &Api| api.get("/v1/namespaces/1/tenants/gold").json()["rt_alone_us"].clone();
    assert_eq!(rt_alone(&api), 700);
    let patched = api.patch("/v1/namespaces/1/tenants/gold", r#"{"rt_alone_us": 300}"#);
    assert_eq!(patched.status, 200, "{}", patched.text);
    let report = server.reload_tenants(&config);
    assert_eq!(report.rt_alone_changed, 0);
    assert_eq!(rt_alone(&api), 300);
    config.tenants[0].rt_alone_us = Some(800);
    assert_eq!(server.reload_tenants(&config).rt_alone_changed, 1);
    assert_eq!(rt_alone(&api), 800);
    config.tenants[0].rt_alone_us = None;
    assert_eq!(server.reload_tenants(&config).rt_alone_changed, 1);
    assert!(rt_alone(&api).is_null());
    drop(server);
}
