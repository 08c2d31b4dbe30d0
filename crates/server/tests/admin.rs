//! The admin API end to end, in process: every resource created, read, updated and deleted;
//! admission refusals and bad input answered with a 4xx that names the problem and changes
//! nothing; a remote SLO change applied and visible in the metrics; live statistics after
//! real I/O; state restored after a restart; the route table checked against the OpenAPI
//! document.

mod admin_common;

use std::collections::BTreeSet;

use admin_common::{config, start, tenant};
use reflex_client::Client;

#[test]
fn the_routes_are_the_openapi_documents() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/admin-openapi.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let document: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut documented = BTreeSet::new();
    for (route, item) in document["paths"]
        .as_object()
        .unwrap_or_else(|| panic!("no paths"))
    {
        for method in item.as_object().unwrap_or_else(|| panic!("{route}")).keys() {
            documented.insert((method.clone(), route.clone()));
        }
    }
    let served: BTreeSet<(String, String)> = reflex_server::admin::api::ROUTES
        .iter()
        .map(|(method, route)| (method.to_string(), route.to_string()))
        .collect();
    assert_eq!(
        documented, served,
        "docs/admin-openapi.json and api::ROUTES differ"
    );

    // And the router serves each of them (the fallback answers "no such resource").
    let (server, api) = start(config(None));
    for (method, route) in &served {
        let concrete = route
            .replace("{namespace_id}", "1")
            .replace("{name}", "gold");
        let reply = match method.as_str() {
            "get" => api.get(&concrete),
            "delete" => api.delete(&concrete),
            "post" => api.post(&concrete, "{}"),
            "patch" => api.patch(&concrete, "{}"),
            other => panic!("method {other}"),
        };
        assert!(
            reply.status != 405 && !reply.text.contains("no such resource"),
            "{method} {concrete}: {} {}",
            reply.status,
            reply.text
        );
    }
    drop(server);
}

#[test]
fn tenants_are_created_read_updated_and_deleted() {
    let (server, api) = start(config(None));
    let list = api.get("/v1/tenants").json();
    let gold = tenant(&list, "gold").unwrap_or_else(|| panic!("{list}"));
    assert_eq!(gold["origin"], "config");
    assert_eq!(gold["latency_us_p95"], 500);
    assert!(tenant(&list, "(default)").is_some());

    // Create: LC and BE, each with the admission's decision.
    let created = api.post(
        "/v1/namespaces/1/tenants",
        r#"{"name": "silver", "class": "lc", "latency_us_p95": 1000, "iops": 5000, "read_percent": 90}"#,
    );
    assert_eq!(created.status, 201, "{}", created.text);
    let body = created.json();
    assert_eq!(body["admission"]["admitted"], true);
    assert!(
        body["admission"]["reason"]
            .as_str()
            .is_some_and(|reason| reason.contains("reserved")),
        "{body}"
    );
    assert_eq!(body["tenant"]["origin"], "admin");
    assert_eq!(body["tenant"]["read_percent"], 90);
    let reserved_after_silver = body["plan"]["lc_reserved_tokens_per_sec"]
        .as_f64()
        .unwrap_or_default();
    let batch = api.post(
        "/v1/namespaces/1/tenants",
        r#"{"name": "batch", "class": "be"}"#,
    );
    assert_eq!(batch.status, 201, "{}", batch.text);

    // Read.
    let silver = api.get("/v1/namespaces/1/tenants/silver");
    assert_eq!(silver.status, 200);
    assert_eq!(silver.json()["iops"], 5000);
    assert_eq!(
        api.get("/v1/tenants").json().as_array().map(Vec::len),
        Some(4)
    );
    let namespace = api.get("/v1/namespaces/1").json();
    assert_eq!(namespace["qos"], true);
    assert!(
        namespace["tenants"]
            .as_array()
            .is_some_and(|names| names.len() == 4)
    );

    // Update: admission re-run; the plan moves, the metrics show the new SLO.
    let updated = api.patch(
        "/v1/namespaces/1/tenants/silver",
        r#"{"iops": 8000, "latency_us_p95": 2000}"#,
    );
    assert_eq!(updated.status, 200, "{}", updated.text);
    let body = updated.json();
    assert_eq!(body["tenant"]["iops"], 8000);
    assert_eq!(body["tenant"]["read_percent"], 90, "unchanged fields stay");
    assert!(
        body["plan"]["lc_reserved_tokens_per_sec"]
            .as_f64()
            .unwrap_or_default()
            > reserved_after_silver
    );
    let metrics = api.get("/metrics").text;
    assert!(
        metrics
            .contains(r#"reflex_tenant_slo_latency_seconds{tenant="silver",namespace="1"} 0.002"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"reflex_tenant_reserved_iops{tenant="silver",namespace="1"} 8000"#));
    // A configured tenant's SLO changes too.
    let gold = api.patch("/v1/namespaces/1/tenants/gold", r#"{"iops": 11000}"#);
    assert_eq!(gold.status, 200, "{}", gold.text);
    assert_eq!(
        server
            .tenant(server.tenant_handle(1, "gold").unwrap_or(0))
            .map(|t| t.spec),
        Some(reflex_qos::TenantSpec::LatencyCritical {
            latency_us_p95: 500,
            iops: 11_000,
            read_percent: 100
        })
    );

    // Delete: admin tenants go, configured ones stay.
    assert_eq!(api.delete("/v1/namespaces/1/tenants/batch").status, 204);
    assert_eq!(api.get("/v1/namespaces/1/tenants/batch").status, 404);
    let refused = api.delete("/v1/namespaces/1/tenants/gold");
    assert_eq!(refused.status, 409);
    assert!(
        refused.error().contains("configuration"),
        "{}",
        refused.text
    );
    assert_eq!(api.delete("/v1/namespaces/1/tenants/batch").status, 404);
    drop(server);
}

#[test]
fn bad_input_is_a_4xx_naming_the_problem_and_changes_nothing() {
    let (server, api) = start(config(None));
    let before = api.get("/v1/tenants").text;
    let plan_before = api.get("/v1/namespaces/1").json()["plan"].clone();
    let cases: &[(&str, &str, u16, &str)] = &[
        ("/v1/namespaces/1/tenants", "{not json", 400, "JSON"),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "x", "class": "be", "color": 1}"#,
            422,
            "unknown field",
        ),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "x", "class": "gold"}"#,
            422,
            "class",
        ),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "x", "class": "lc", "iops": 5}"#,
            400,
            "latency_us_p95",
        ),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "x", "class": "be", "iops": 5}"#,
            400,
            "best-effort",
        ),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "x", "class": "lc", "latency_us_p95": 0, "iops": 5}"#,
            400,
            "latency_us_p95",
        ),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "x", "class": "lc", "latency_us_p95": 500, "iops": 5, "read_percent": 101}"#,
            400,
            "read_percent",
        ),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "", "class": "be"}"#,
            400,
            "name",
        ),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "gold", "class": "be"}"#,
            409,
            "already has",
        ),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "x", "class": "lc", "latency_us_p95": 1, "iops": 5}"#,
            409,
            "tighter than the device profile",
        ),
        (
            "/v1/namespaces/1/tenants",
            r#"{"name": "x", "class": "lc", "latency_us_p95": 500, "iops": 900000000}"#,
            409,
            "left at 500",
        ),
        (
            "/v1/namespaces/9/tenants",
            r#"{"name": "x", "class": "be"}"#,
            404,
            "no namespace 9",
        ),
        (
            "/v1/namespaces/abc/tenants",
            r#"{"name": "x", "class": "be"}"#,
            400,
            "abc",
        ),
    ];
    for (path, body, status, needle) in cases {
        let reply = api.post(path, body);
        assert_eq!(reply.status, *status, "{body}: {}", reply.text);
        assert!(reply.error().contains(needle), "{body}: {}", reply.text);
    }
    // An SLO change admission refuses keeps the old SLO.
    let refused = api.patch("/v1/namespaces/1/tenants/gold", r#"{"iops": 900000000}"#);
    assert_eq!(refused.status, 409, "{}", refused.text);
    assert!(refused.error().contains("refused by admission control"));
    let default = api.patch(
        "/v1/namespaces/1/tenants/(default)",
        r#"{"class": "lc", "latency_us_p95": 900, "iops": 5}"#,
    );
    assert_eq!(default.status, 409, "{}", default.text);
    // Too large a body, and a body that is not JSON.
    let huge = format!(r#"{{"name": "{}", "class": "be"}}"#, "x".repeat(100 << 10));
    assert_eq!(api.post("/v1/namespaces/1/tenants", &huge).status, 413);
    let reply = api.post_as("/v1/namespaces/1/tenants", "text/plain", "name=x");
    assert_eq!(reply.status, 415, "{}", reply.text);
    assert_eq!(api.get("/v1/nothing").status, 404);
    assert_eq!(
        api.get("/v1/tenants").text,
        before,
        "a refusal changed the tenants"
    );
    assert_eq!(api.get("/v1/namespaces/1").json()["plan"], plan_before);
    drop(server);
}

#[test]
fn live_stats_and_metrics_follow_real_io_and_a_deleted_tenants_connections_are_refused() {
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
    for block in 0..200u64 {
        client
            .read(1, (block % 64) * 4096, &mut buffer)
            .unwrap_or_else(|e| panic!("read: {e}"));
    }
    client
        .write(1, 0, &buffer)
        .unwrap_or_else(|e| panic!("write: {e}"));

    let stats = api.wait_for("/v1/stats", |stats| {
        tenant(&stats["tenants"], "reader")
            .is_some_and(|reader| reader["totals"]["reads"].as_u64() >= Some(200))
    });
    let reader = tenant(&stats["tenants"], "reader").unwrap_or_else(|| panic!("{stats}"));
    assert!(reader["totals"]["writes"].as_u64() >= Some(1), "{reader}");
    assert!(
        reader["totals"]["read_bytes"].as_u64() >= Some(200 * 4096),
        "{reader}"
    );
    assert!(
        reader["totals"]["read_latency_us"]["p95"].as_u64() > Some(0),
        "{reader}"
    );
    assert!(
        reader["totals"]["tokens_spent"].as_f64() > Some(0.0),
        "{reader}"
    );
    assert_eq!(reader["totals"]["connections"], 1);
    assert_eq!(reader["slo_latency_us_p95"], 2000);
    // Where its one connection is: one count per dataplane thread.
    let tenants = api.get("/v1/tenants").json();
    let listed = tenant(&tenants, "reader").unwrap_or_else(|| panic!("{tenants}"));
    let per_thread = listed["connections_per_thread"]
        .as_array()
        .unwrap_or_else(|| panic!("{listed}"));
    assert_eq!(
        Some(per_thread.len()),
        stats["threads"].as_array().map(Vec::len),
        "{listed}"
    );
    assert_eq!(
        per_thread.iter().filter_map(|n| n.as_u64()).sum::<u64>(),
        1,
        "{listed}"
    );
    assert!(
        stats["threads"]
            .as_array()
            .is_some_and(|threads| !threads.is_empty())
    );
    let namespace = &stats["namespaces"][0];
    assert!(
        namespace["device_tokens_per_sec"].as_f64() > Some(0.0),
        "{namespace}"
    );
    // SLO attainment: windows with enough reads are judged.
    let metrics = api.get("/metrics").text;
    assert!(
        metrics.contains(r#"reflex_tenant_read_latency_seconds_bucket{tenant="reader",namespace="1",le="+Inf"} 200"#)
            || metrics.contains(r#"reflex_tenant_read_latency_seconds_count{tenant="reader",namespace="1"} 20"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"reflex_tenant_operations_total{tenant="reader",namespace="1",kind="read"}"#
        )
    );
    assert!(metrics.contains("reflex_thread_busy_seconds_total{thread=\"0\"}"));
    assert!(
        metrics
            .contains("reflex_device_queue_depth{namespace=\"1\",device=\"emu:device-a-small\"} 0")
    );
    assert!(metrics.contains("reflex_device_tokens_per_second{namespace=\"1\""));

    // Deleting the tenant revokes it: the bound connection's next I/O is refused.
    assert_eq!(api.delete("/v1/namespaces/1/tenants/reader").status, 204);
    let refused = client.read(1, 0, &mut buffer);
    assert!(
        matches!(
            refused,
            Err(reflex_client::ClientError::Status {
                status: reflex_proto::native::Status::Permission,
                ..
            })
        ),
        "{refused:?}"
    );
    drop(server);
}

#[test]
fn state_survives_a_restart() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let state = directory.path().join("state.json").display().to_string();
    {
        let (server, api) = start(config(Some(state.clone())));
        assert_eq!(
            api.post("/v1/namespaces/1/tenants", r#"{"name": "kept", "class": "lc", "latency_us_p95": 800, "iops": 3000, "read_only": true}"#).status,
            201
        );
        assert_eq!(
            api.post(
                "/v1/namespaces/1/tenants",
                r#"{"name": "gone", "class": "be"}"#
            )
            .status,
            201
        );
        assert_eq!(api.delete("/v1/namespaces/1/tenants/gone").status, 204);
        assert_eq!(
            api.patch(
                "/v1/namespaces/1/tenants/gold",
                r#"{"latency_us_p95": 700}"#
            )
            .status,
            200
        );
        server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }
    let (server, api) = start(config(Some(state)));
    let kept = api.get("/v1/namespaces/1/tenants/kept");
    assert_eq!(kept.status, 200, "{}", kept.text);
    let kept = kept.json();
    assert_eq!(
        (kept["latency_us_p95"].as_u64(), kept["iops"].as_u64()),
        (Some(800), Some(3000))
    );
    assert_eq!(kept["read_only"], true);
    assert_eq!(kept["origin"], "admin");
    assert_eq!(api.get("/v1/namespaces/1/tenants/gone").status, 404);
    assert_eq!(
        api.get("/v1/namespaces/1/tenants/gold").json()["latency_us_p95"],
        700
    );
    drop(server);
}

#[test]
fn the_admin_api_refuses_a_port_in_use_at_start() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let mut config = config(None);
    config.admin.listen = holder.local_addr().unwrap_or_else(|e| panic!("{e}"));
    let error = Server::start_error(config);
    assert!(error.contains("admin API: cannot listen"), "{error}");
}

struct Server;

impl Server {
    fn start_error(config: reflex_server::Config) -> String {
        match reflex_server::Server::start(config) {
            Ok(_) => panic!("started on a port in use"),
            Err(error) => error.to_string(),
        }
    }
}

#[test]
fn bodies_must_be_objects_integers_may_be_spelled_as_floats_and_state_conflicts_are_409() {
    let (_server, api) = start(config(None));
    // Found by schemathesis: a JSON array used to fill the fields in order, and null left a
    // field unchanged although the document says it is a number or a string.
    for body in [
        "[null, null]",
        "[]",
        "5",
        r#"{"class": null}"#,
        r#"{"iops": null}"#,
    ] {
        let reply = api.patch("/v1/namespaces/1/tenants/gold", body);
        assert_eq!(reply.status, 422, "{body}: {}", reply.text);
    }
    let reply = api.patch("/v1/namespaces/1/tenants/gold", r#"{"iops": 1.5}"#);
    assert_eq!(reply.status, 422, "{}", reply.text);
    assert!(reply.error().contains("iops"), "{}", reply.text);
    // 70.0 is the integer 70, as JSON Schema has it.
    let reply = api.patch(
        "/v1/namespaces/1/tenants/gold",
        r#"{"iops": 2000.0, "read_percent": 70.0}"#,
    );
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.json()["tenant"]["iops"], 2000);
    assert_eq!(reply.json()["tenant"]["read_percent"], 70);
    // SLO fields for a best-effort tenant, or too few to become LC: a conflict with its state.
    assert_eq!(
        api.post(
            "/v1/namespaces/1/tenants",
            r#"{"name": "b", "class": "be"}"#
        )
        .status,
        201
    );
    for body in [
        r#"{"iops": 5}"#,
        r#"{"class": "lc", "iops": 5}"#,
        r#"{"class": "lc"}"#,
    ] {
        let reply = api.patch("/v1/namespaces/1/tenants/b", body);
        assert_eq!(reply.status, 409, "{body}: {}", reply.text);
        assert!(reply.error().contains("best-effort"), "{}", reply.text);
    }
    let long = "é".repeat(65);
    let reply = api.post(
        "/v1/namespaces/1/tenants",
        &format!(r#"{{"name": "{long}", "class": "be"}}"#),
    );
    assert_eq!(reply.status, 400, "{}", reply.text);
    assert!(reply.error().contains("64 characters"), "{}", reply.text);
    let b = api.get("/v1/namespaces/1/tenants/b").json();
    assert_eq!(b["class"], "be", "{b}");
}
