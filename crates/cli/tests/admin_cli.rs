//! `reflex admin` against a real reflexd (in this process, admin API on a free loopback port):
//! every tenant subcommand changes what the API then serves, refusals print the server's
//! message and exit non-zero, `stats --watch` refreshes a bounded number of times, `fairness`
//! shows the fairness stage, and a server that is not there is reported as unreachable.

use std::net::TcpListener;
use std::process::{Command, Output};
use std::time::Duration;

use reflex_server::admin::AdminConfig;
use reflex_server::{Config, NamespaceConfig, Server, ServerHandle, TenantConfig};
use serde_json::Value;

fn profile(name: &str) -> String {
    format!("{}/../../profiles/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn start() -> (ServerHandle, String) {
    let namespace = NamespaceConfig {
        profile: Some(profile("device-a-small.toml")),
        tenant: Some("gold".into()),
        ..NamespaceConfig::new(1, "emu:device-a-small").sized(64 << 20)
    };
    let config = Config {
        tenants: vec![TenantConfig::latency_critical("gold", 500, 10_000, 100)],
        admin: AdminConfig {
            stats_window: Duration::from_millis(100),
            ..AdminConfig::loopback()
        },
        ..Config::loopback(vec![namespace])
    };
    let server = Server::start(config).unwrap_or_else(|e| panic!("server start: {e}"));
    let addr = server
        .admin_addr()
        .unwrap_or_else(|| panic!("no admin listener"));
    (server, format!("http://{addr}"))
}

fn admin(api: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reflex"))
        .arg("admin")
        .arg("--api")
        .arg(api)
        .args(args)
        .env_remove("REFLEX_ADMIN")
        .output()
        .unwrap_or_else(|e| panic!("running reflex: {e}"))
}

fn ok(api: &str, args: &[&str]) -> String {
    let output = admin(api, args);
    assert!(
        output.status.success(),
        "reflex admin {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn ok_json(api: &str, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let text = ok(api, &all);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

fn failed(api: &str, args: &[&str]) -> String {
    let output = admin(api, args);
    assert!(!output.status.success(), "reflex admin {args:?} succeeded");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
    stderr
}

fn names(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|tenant| tenant["name"].as_str().unwrap_or("").to_string())
        .collect()
}

#[test]
fn tenants_add_set_list_show_rm_round_trip_through_the_api() {
    let (_server, api) = start();

    let table = ok(&api, &["tenants", "list"]);
    let header = table.lines().next().unwrap_or("");
    assert!(
        header.starts_with("ns") && header.contains("tenant"),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|line| line.contains("gold") && line.contains("config"))
    );

    let added = ok(
        &api,
        &[
            "tenants",
            "add",
            "silver",
            "--namespace",
            "1",
            "--class",
            "lc",
            "--latency-us-p95",
            "1000",
            "--iops",
            "5000",
            "--read-percent",
            "80",
        ],
    );
    assert!(added.starts_with("admitted: "), "{added}");
    assert!(added.contains("silver"), "{added}");
    ok(
        &api,
        &[
            "tenants",
            "add",
            "bronze",
            "--class",
            "be",
            "--rt-alone-us",
            "300",
        ],
    );
    let bronze = ok_json(&api, &["tenants", "show", "bronze"]);
    assert_eq!(bronze["rt_alone_us"], 300, "{bronze}");
    // RT_alone alone changes no SLO; --rt-alone-learned clears it.
    let changed = ok_json(&api, &["tenants", "set", "bronze", "--rt-alone-us", "250"]);
    assert_eq!(changed["tenant"]["rt_alone_us"], 250, "{changed}");
    assert_eq!(changed["tenant"]["class"], "be", "{changed}");
    let changed = ok_json(&api, &["tenants", "set", "bronze", "--rt-alone-learned"]);
    assert!(changed["tenant"]["rt_alone_us"].is_null(), "{changed}");

    let list = ok_json(&api, &["tenants", "list"]);
    for name in ["gold", "silver", "bronze"] {
        assert!(names(&list).contains(&name.to_string()), "{list}");
    }

    let changed = ok_json(&api, &["tenants", "set", "silver", "--iops", "6000"]);
    assert_eq!(changed["admission"]["admitted"], true, "{changed}");
    let silver = ok_json(&api, &["tenants", "show", "silver", "-n", "1"]);
    assert_eq!(silver["iops"], 6000, "{silver}");
    assert_eq!(silver["latency_us_p95"], 1000, "{silver}");
    assert_eq!(silver["read_percent"], 80, "{silver}");
    assert_eq!(silver["origin"], "admin", "{silver}");

    // An SLO the device cannot keep is refused with the server's reason; nothing changes.
    let refused = failed(&api, &["tenants", "set", "silver", "--iops", "100000000"]);
    assert!(refused.contains("409"), "{refused}");
    assert!(refused.contains("silver"), "{refused}");
    let silver = ok_json(&api, &["tenants", "show", "silver"]);
    assert_eq!(silver["iops"], 6000, "{silver}");

    // Duplicates, unknown tenants and empty changes name the problem.
    let duplicate = failed(&api, &["tenants", "add", "bronze", "--class", "be"]);
    assert!(duplicate.contains("bronze"), "{duplicate}");
    let missing = failed(&api, &["tenants", "show", "nobody"]);
    assert!(
        missing.contains("404") && missing.contains("nobody"),
        "{missing}"
    );
    let nothing = failed(&api, &["tenants", "set", "silver"]);
    assert!(nothing.contains("nothing to change"), "{nothing}");

    let removed = ok(&api, &["tenants", "rm", "bronze"]);
    assert!(removed.contains("removed tenant bronze"), "{removed}");
    let list = ok_json(&api, &["tenants", "list"]);
    assert!(!names(&list).contains(&"bronze".to_string()), "{list}");
    let gone = failed(&api, &["tenants", "rm", "bronze"]);
    assert!(gone.contains("404"), "{gone}");

    // Namespaces and the server.
    let namespaces = ok(&api, &["namespaces", "list"]);
    assert!(
        namespaces
            .lines()
            .any(|line| line.starts_with('1') && line.contains("silver")),
        "{namespaces}"
    );
    let namespace = ok_json(&api, &["namespaces", "show", "1"]);
    assert_eq!(namespace["namespace_id"], 1, "{namespace}");
    let server = ok_json(&api, &["server"]);
    assert_eq!(server["namespaces"], 1, "{server}");
}

#[test]
fn namespaces_add_and_rm_change_what_the_server_serves() {
    let (server, api) = start();
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let file = directory.path().join("ns4");
    let file_spec = format!("file:{}", file.display());
    let added = ok_json(
        &api,
        &[
            "namespaces",
            "add",
            "4",
            &file_spec,
            "--size",
            "4M",
            "--name",
            "four",
            "--profile",
            &profile("device-a-small.toml"),
        ],
    );
    assert_eq!(added["namespace_id"], 4, "{added}");
    assert_eq!(added["nbd_export"], "four", "{added}");
    assert_eq!(added["size_bytes"], 4 << 20, "{added}");
    assert_eq!(added["qos"], true, "{added}");
    assert!(file.exists());
    let table = ok(&api, &["namespaces", "list"]);
    assert!(table.lines().any(|line| line.contains("four")), "{table}");
    let mut client =
        reflex_client::Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let data = vec![0x44u8; 4096];
    client
        .write(4, 0, &data)
        .unwrap_or_else(|e| panic!("write: {e}"));

    // Refusals print the server's reason: a duplicate, a bad spec, a namespace in use.
    let duplicate = failed(&api, &["namespaces", "add", "4", "mem:1M"]);
    assert!(
        duplicate.contains("409") && duplicate.contains("namespace 4 exists"),
        "{duplicate}"
    );
    let bad = failed(&api, &["namespaces", "add", "5", "nosuchkind:x"]);
    assert!(
        bad.contains("409") && bad.contains("unknown backend kind"),
        "{bad}"
    );
    // A size that does not parse is the command line's error (clap's usage exit status).
    let bad_size = admin(&api, &["namespaces", "add", "5", "mem", "--size", "lots"]);
    assert!(!bad_size.status.success());
    let stderr = String::from_utf8_lossy(&bad_size.stderr);
    assert!(stderr.contains("--size"), "{stderr}");
    let busy = failed(&api, &["namespaces", "rm", "4"]);
    assert!(busy.contains("409") && busy.contains("in use"), "{busy}");

    let removed = ok(&api, &["namespaces", "rm", "4", "--force"]);
    assert!(removed.contains("removed namespace 4"), "{removed}");
    let gone = failed(&api, &["namespaces", "show", "4"]);
    assert!(gone.contains("404"), "{gone}");
    let list = ok_json(&api, &["namespaces", "list"]);
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    assert!(client.read(4, 0, &mut vec![0u8; 4096]).is_err());
}

#[test]
fn stats_prints_a_table_and_watch_refreshes_a_bounded_number_of_times() {
    let (_server, api) = start();
    let table = ok(&api, &["stats"]);
    assert!(table.starts_with("window "), "{table}");
    assert!(table.contains("slo_met"), "{table}");
    assert!(
        table
            .lines()
            .any(|line| line.contains("gold") && line.contains("lc")),
        "{table}"
    );
    assert!(table.contains("queue_depth"), "{table}");

    // Not a terminal: each refresh is a table of its own, no escape sequences.
    let watched = ok(&api, &["stats", "--watch", "0.1", "--count", "3"]);
    assert_eq!(watched.matches("window ").count(), 3, "{watched}");
    assert!(!watched.contains('\x1b'), "{watched}");

    let lines = ok(&api, &["--json", "stats", "--watch", "0.1", "--count", "2"]);
    let windows: Vec<u64> = lines
        .lines()
        .map(|line| {
            let value: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
            value["windows"]
                .as_u64()
                .unwrap_or_else(|| panic!("{line}"))
        })
        .collect();
    assert_eq!(windows.len(), 2, "{lines}");
}

#[test]
fn fairness_prints_the_stage_of_each_namespace() {
    let (_server, api) = start();
    let table = ok(&api, &["fairness"]);
    assert!(table.starts_with("ns  mode"), "{table}");
    let view = ok_json(&api, &["fairness"]);
    assert_eq!(view["namespaces"][0]["namespace_id"], 1, "{view}");
    assert_eq!(view["namespaces"][0]["mode"], "off", "{view}");
}

#[test]
fn an_unreachable_server_is_reported_with_its_address() {
    // A port nobody listens on: bind one, note it, close it.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|e| panic!("{e}"));
    let api = format!("http://127.0.0.1:{port}");
    let stderr = failed(&api, &["tenants", "list"]);
    assert!(stderr.contains("cannot reach"), "{stderr}");
    assert!(stderr.contains(&api), "{stderr}");
    assert!(stderr.contains("admin"), "{stderr}");
    // Bare host:port works too.
    let stderr = failed(&format!("127.0.0.1:{port}"), &["stats"]);
    assert!(stderr.contains("cannot reach"), "{stderr}");
}

/// `--token-file`: a server that asks every peer for its token (`token_exempt = []`) refuses
/// `reflex admin` without it (401, with the server's message) and serves it with it.
#[test]
fn the_token_file_authorizes_the_command_line() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let token_file = dir.path().join("admin.token");
    std::fs::write(&token_file, "cli-t0ken\n").unwrap_or_else(|e| panic!("{e}"));
    let config = Config {
        admin: AdminConfig {
            token_file: Some(token_file.display().to_string()),
            token_exempt: Vec::new(),
            ..AdminConfig::loopback()
        },
        ..Config::loopback(vec![NamespaceConfig::new(1, "mem:16M")])
    };
    let server = Server::start(config).unwrap_or_else(|e| panic!("server start: {e}"));
    let addr = server
        .admin_addr()
        .unwrap_or_else(|| panic!("no admin listener"));
    let api = format!("http://{addr}");
    let stderr = failed(&api, &["server"]);
    assert!(stderr.contains("401"), "{stderr}");
    assert!(stderr.contains("token"), "{stderr}");
    let wrong = dir.path().join("wrong.token");
    std::fs::write(&wrong, "not-the-token").unwrap_or_else(|e| panic!("{e}"));
    let stderr = failed(
        &api,
        &["--token-file", &wrong.display().to_string(), "server"],
    );
    assert!(stderr.contains("401"), "{stderr}");
    let server_json = ok_json(
        &api,
        &["--token-file", &token_file.display().to_string(), "server"],
    );
    assert!(server_json.get("version").is_some(), "{server_json}");
}
