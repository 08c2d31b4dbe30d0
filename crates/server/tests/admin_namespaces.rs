//! Namespaces added and removed at run time through the admin API, end to end: a namespace
//! added by `POST /v1/namespaces` serves native and NBD clients (connections opened before
//! it included); its removal is refused while a tenant is bound, and a forced one refuses
//! further requests cleanly (native NO_SUCH_NAMESPACE, NBD EINVAL) and closes the device once
//! every thread drained it; bad input is a 4xx that changes nothing; runtime namespaces and
//! their tenants survive a restart through the state file.

mod admin_common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use admin_common::{Api, Nbd, profile, start, tenant};
use reflex_client::{Client, ClientError, PipelinedClient};
use reflex_proto::native::Status;
use reflex_server::NbdConfig;

/// The admin tests' server (namespace 1 on an emulated device with a profile, tenant gold)
/// with NBD on and two threads.
fn config(state_file: Option<String>) -> reflex_server::Config {
    reflex_server::Config {
        nbd: NbdConfig {
            enabled: true,
            port: 0,
            ..NbdConfig::default()
        },
        threads: 2,
        ..admin_common::config(state_file)
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn status_of(error: ClientError) -> Status {
    match error {
        ClientError::Status { status, .. } => status,
        other => panic!("expected an error status, got {other}"),
    }
}

/// Whether this process holds a descriptor of `path` (the device is open).
fn holds_open(path: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return false;
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| std::fs::read_link(entry.path()).ok())
        .any(|target| target == path)
}

/// Polls `condition` until it holds (bounded: 30 s).
fn eventually(what: &str, condition: impl Fn() -> bool) {
    let started = Instant::now();
    while !condition() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "never happened: {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn namespace_ids(api: &Api) -> Vec<u64> {
    api.get("/v1/namespaces")
        .json()
        .as_array()
        .unwrap_or_else(|| panic!("not a list"))
        .iter()
        .filter_map(|namespace| namespace["namespace_id"].as_u64())
        .collect()
}

#[test]
fn an_added_namespace_serves_native_and_nbd_and_a_forced_removal_refuses_cleanly() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let file = directory.path().join("ns7");
    let (server, api) = start(config(None));
    let nbd_addr = server.nbd_addr().unwrap_or_else(|| panic!("no NBD"));
    // Opened before the namespace exists: it may use it afterwards.
    let mut early = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let mut buffer = vec![0u8; 4096];
    assert_eq!(
        status_of(
            early
                .read(7, 0, &mut buffer)
                .expect_err("no namespace 7 yet")
        ),
        Status::NoSuchNamespace
    );

    let body = format!(
        r#"{{"namespace_id": 7, "backend": "file:{}", "size_bytes": 8388608, "profile": "{}"}}"#,
        file.display(),
        profile("device-a-small.toml")
    );
    let created = api.post("/v1/namespaces", &body);
    assert_eq!(created.status, 201, "{}", created.text);
    let view = created.json();
    assert_eq!(view["namespace_id"], 7);
    assert_eq!(view["nbd_export"], "ns7");
    assert_eq!(view["size_bytes"], 8 << 20);
    assert_eq!(view["qos"], true);
    assert_eq!(namespace_ids(&api), vec![1, 7]);
    assert!(holds_open(&file));

    // Native: the early connection and a new one; NBD: a new session on the new export.
    let data = pattern(7, 4096);
    early
        .write(7, 4096, &data)
        .unwrap_or_else(|e| panic!("write: {e}"));
    let mut fresh = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    fresh
        .read(7, 4096, &mut buffer)
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert_eq!(buffer, data);
    let mut session = Nbd::connect(nbd_addr, "ns7").unwrap_or_else(|e| panic!("NBD: {e}"));
    let mut read_back = vec![0u8; 4096];
    assert_eq!(session.read(4096, &mut read_back), 0);
    assert_eq!(read_back, data);
    let more = pattern(9, 8192);
    assert_eq!(session.write(16384, &more), 0);
    let mut eight = vec![0u8; 8192];
    fresh
        .read(7, 16384, &mut eight)
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert_eq!(eight, more);

    // A tenant bound to it: removal is refused and nothing changes.
    let tenant_created = api.post(
        "/v1/namespaces/7/tenants",
        r#"{"name": "seven", "class": "lc", "latency_us_p95": 1000, "iops": 1000}"#,
    );
    assert_eq!(tenant_created.status, 201, "{}", tenant_created.text);
    let refused = api.delete("/v1/namespaces/7");
    assert_eq!(refused.status, 409, "{}", refused.text);
    assert!(refused.error().contains("seven"), "{}", refused.text);
    assert_eq!(namespace_ids(&api), vec![1, 7]);
    fresh
        .read(7, 4096, &mut buffer)
        .unwrap_or_else(|e| panic!("read after a refused removal: {e}"));
    let bad_query = api.delete("/v1/namespaces/7?force=maybe");
    assert_eq!(bad_query.status, 400, "{}", bad_query.text);

    // Forced: the tenant goes, requests are refused as naming no namespace, the device closes.
    let removed = api.delete("/v1/namespaces/7?force=true");
    assert_eq!(removed.status, 204, "{}", removed.text);
    assert_eq!(namespace_ids(&api), vec![1]);
    assert_eq!(api.get("/v1/namespaces/7").status, 404);
    assert!(tenant(&api.get("/v1/tenants").json(), "seven").is_none());
    assert_eq!(
        status_of(fresh.read(7, 4096, &mut buffer).expect_err("removed")),
        Status::NoSuchNamespace
    );
    assert_eq!(
        status_of(early.write(7, 0, &data).expect_err("removed")),
        Status::NoSuchNamespace
    );
    assert_eq!(session.read(0, &mut read_back), libc::EINVAL as u32);
    assert_eq!(session.write(0, &data), libc::EINVAL as u32);
    assert!(Nbd::connect(nbd_addr, "ns7").is_err(), "the export is gone");
    eventually("every thread drains namespace 7", || {
        server.namespaces_removing() == 0
    });
    eventually("the device of namespace 7 is closed", || !holds_open(&file));
    // Namespace 1 and the connections are unharmed.
    fresh
        .read(1, 0, &mut buffer)
        .unwrap_or_else(|e| panic!("namespace 1: {e}"));
    let mut one = Nbd::connect(nbd_addr, "ns1").unwrap_or_else(|e| panic!("NBD: {e}"));
    assert_eq!(one.read(0, &mut read_back), 0);

    // The id may be used again, on the same file: its data is still there.
    let again = api.post("/v1/namespaces", &body);
    assert_eq!(again.status, 201, "{}", again.text);
    fresh
        .read(7, 16384, &mut eight)
        .unwrap_or_else(|e| panic!("read after re-adding: {e}"));
    assert_eq!(eight, more);
    // Shutdown flushes the live namespaces only (the removed slot's queue is closed).
    drop(early);
    let stats = server
        .shutdown()
        .unwrap_or_else(|e| panic!("shutdown: {e}"));
    assert!(stats.iter().all(|thread| thread.flush_errors == 0));
}

#[test]
fn an_unused_namespace_is_removed_without_force() {
    let (server, api) = start(config(None));
    let created = api.post(
        "/v1/namespaces",
        r#"{"namespace_id": 3, "backend": "mem:16M", "nbd_export": "scratch", "read_only": true}"#,
    );
    assert_eq!(created.status, 201, "{}", created.text);
    assert_eq!(created.json()["read_only"], true);
    assert_eq!(created.json()["qos"], false);
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let mut buffer = vec![0u8; 512];
    client
        .read(3, 0, &mut buffer)
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert_eq!(
        status_of(client.write(3, 0, &buffer).expect_err("read-only")),
        Status::Permission
    );
    // The connection counts on the namespace's default tenant: in use.
    let busy = api.delete("/v1/namespaces/3");
    assert_eq!(busy.status, 409, "{}", busy.text);
    assert!(busy.error().contains("connection"), "{}", busy.text);
    drop(client);
    eventually("the connection is gone", || {
        tenant(&api.get("/v1/tenants").json(), "(default)")
            .map(|_| {
                api.get("/v1/tenants")
                    .json()
                    .as_array()
                    .is_some_and(|list| {
                        list.iter()
                            .all(|t| t["namespace_id"] != 3 || t["connections"].as_u64() == Some(0))
                    })
            })
            .unwrap_or(false)
    });
    let removed = api.delete("/v1/namespaces/3");
    assert_eq!(removed.status, 204, "{}", removed.text);
    assert_eq!(namespace_ids(&api), vec![1]);
    drop(server);
}

#[test]
fn bad_namespaces_are_a_4xx_naming_the_problem_and_change_nothing() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (server, api) = start(config(None));
    let before = api.get("/v1/namespaces").text;
    let missing_profile = directory.path().join("none.toml");
    let not_a_profile = directory.path().join("bad.toml");
    std::fs::write(&not_a_profile, "this is not a profile").unwrap_or_else(|e| panic!("{e}"));
    let new_file = directory.path().join("never");
    let cases: Vec<(String, u16, &str)> = vec![
        (
            r#"{"namespace_id": 1, "backend": "mem:16M"}"#.into(),
            409,
            "namespace 1 exists",
        ),
        (
            r#"{"namespace_id": 0, "backend": "mem:16M"}"#.into(),
            400,
            "id 0",
        ),
        (
            r#"{"namespace_id": 4, "backend": "mem:16M", "nbd_export": "ns1"}"#.into(),
            409,
            "ns1",
        ),
        (
            r#"{"namespace_id": 4, "backend": "nosuchkind:x"}"#.into(),
            409,
            "unknown backend kind",
        ),
        (
            r#"{"namespace_id": 4, "backend": ""}"#.into(),
            400,
            "backend is empty",
        ),
        (
            format!(
                r#"{{"namespace_id": 4, "backend": "file:{}", "size_bytes": 1048576, "profile": "{}"}}"#,
                new_file.display(),
                missing_profile.display()
            ),
            409,
            "cannot read QoS profile",
        ),
        (
            format!(
                r#"{{"namespace_id": 4, "backend": "file:{}", "size_bytes": 1048576, "profile": "{}"}}"#,
                new_file.display(),
                not_a_profile.display()
            ),
            409,
            "cannot read QoS profile",
        ),
        // A file that does not exist, without a size to create it at.
        (
            format!(
                r#"{{"namespace_id": 4, "backend": "file:{}"}}"#,
                new_file.display()
            ),
            409,
            "namespace 4",
        ),
        // A folder is not a backing file.
        (
            format!(
                r#"{{"namespace_id": 4, "backend": "file:{}"}}"#,
                directory.path().display()
            ),
            409,
            "namespace 4",
        ),
        (
            r#"{"namespace_id": 4, "backend": "mem:16M", "tenant": "gold"}"#.into(),
            422,
            "unknown field",
        ),
        (r#"{"backend": "mem:16M"}"#.into(), 422, "namespace_id"),
        (
            r#"{"namespace_id": 4, "backend": "mem:16M", "profile": ""}"#.into(),
            400,
            "profile is empty",
        ),
        (
            format!(
                r#"{{"namespace_id": 4, "backend": "mem:16M", "nbd_export": "{}"}}"#,
                "x".repeat(65)
            ),
            400,
            "1 to 64 characters",
        ),
    ];
    for (body, status, message) in &cases {
        let reply = api.post("/v1/namespaces", body);
        assert_eq!(reply.status, *status, "{body}: {}", reply.text);
        assert!(
            reply.error().contains(message),
            "{body}: {:?} does not name {message:?}",
            reply.error()
        );
        assert_eq!(
            api.get("/v1/namespaces").text,
            before,
            "{body} changed something"
        );
    }
    assert!(!new_file.exists(), "a refused add created its backend file");
    assert_eq!(api.delete("/v1/namespaces/9").status, 404);
    assert_eq!(api.delete("/v1/namespaces/x").status, 400);
    drop(server);
}

#[test]
fn runtime_namespaces_and_their_tenants_survive_a_restart() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let state = directory.path().join("state.json");
    let file = directory.path().join("ns5");
    let state_text = Some(state.display().to_string());
    let data = pattern(5, 4096);
    {
        let (server, api) = start(config(state_text.clone()));
        let created = api.post(
            "/v1/namespaces",
            &format!(
                r#"{{"namespace_id": 5, "backend": "file:{}", "size_bytes": 4194304, "nbd_export": "five", "profile": "{}"}}"#,
                file.display(),
                profile("device-a-small.toml")
            ),
        );
        assert_eq!(created.status, 201, "{}", created.text);
        let tenant_created = api.post(
            "/v1/namespaces/5/tenants",
            r#"{"name": "fiver", "class": "be"}"#,
        );
        assert_eq!(tenant_created.status, 201, "{}", tenant_created.text);
        let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
        client
            .write(5, 8192, &data)
            .unwrap_or_else(|e| panic!("write: {e}"));
        drop(client);
        server
            .shutdown()
            .unwrap_or_else(|e| panic!("shutdown: {e}"));
    }
    {
        let (server, api) = start(config(state_text.clone()));
        assert_eq!(namespace_ids(&api), vec![1, 5]);
        let five = api.get("/v1/namespaces/5").json();
        assert_eq!(five["nbd_export"], "five");
        assert_eq!(five["qos"], true);
        let fiver = tenant(&api.get("/v1/tenants").json(), "fiver")
            .cloned()
            .unwrap_or_else(|| panic!("tenant fiver was not restored"));
        assert_eq!(fiver["namespace_id"], 5);
        let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
        let mut buffer = vec![0u8; 4096];
        client
            .read(5, 8192, &mut buffer)
            .unwrap_or_else(|e| panic!("read: {e}"));
        assert_eq!(buffer, data);
        let mut nbd = Nbd::connect(
            server.nbd_addr().unwrap_or_else(|| panic!("no NBD")),
            "five",
        )
        .unwrap_or_else(|e| panic!("NBD: {e}"));
        assert_eq!(nbd.read(8192, &mut buffer), 0);
        assert_eq!(buffer, data);
        drop(nbd);
        drop(client);
        let removed = api.delete("/v1/namespaces/5?force=true");
        assert_eq!(removed.status, 204, "{}", removed.text);
        server
            .shutdown()
            .unwrap_or_else(|e| panic!("shutdown: {e}"));
    }
    let (server, api) = start(config(state_text));
    assert_eq!(namespace_ids(&api), vec![1]);
    assert!(tenant(&api.get("/v1/tenants").json(), "fiver").is_none());
    drop(server);
}

/// Requests one load connection keeps in flight.
const IN_FLIGHT: u64 = 16;

/// Keeps `IN_FLIGHT` writes and reads going on namespace `namespace` until one is refused as
/// naming no namespace, then collects every answer still owed. Returns (OK answers, refused
/// answers); every request submitted is answered exactly once, with OK or NO_SUCH_NAMESPACE.
fn load_until_removed(
    addr: SocketAddr,
    namespace: u32,
    region: u64,
    done: &AtomicU64,
) -> (u64, u64) {
    let mut client = PipelinedClient::connect(addr).unwrap_or_else(|e| panic!("connect: {e}"));
    let (mut submitted, mut ok, mut refused) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    loop {
        while refused == 0 && submitted - (ok + refused) < IN_FLIGHT {
            let offset = region + (submitted % 64) * 8192;
            if submitted % 2 == 0 {
                client
                    .submit_write(
                        submitted,
                        namespace,
                        offset,
                        &pattern(submitted as u8, 8192),
                        false,
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
            } else {
                client
                    .submit_read(submitted, namespace, offset, 8192)
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            submitted += 1;
        }
        if ok + refused == submitted {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "answers still owed: {} of {submitted}",
            submitted - ok - refused
        );
        client
            .wait(Some(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("wait: {e}"));
        while let Some(completion) = client.reap().unwrap_or_else(|e| panic!("reap: {e}")) {
            match completion.status() {
                Ok(Status::Ok) => {
                    ok += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Status::NoSuchNamespace) => refused += 1,
                other => panic!("request {}: {other:?}", completion.request_id),
            }
        }
    }
    // The connection lives on: namespace 1 still answers.
    client
        .submit_read(u64::MAX - 1, 1, 0, 4096)
        .unwrap_or_else(|e| panic!("{e}"));
    loop {
        client
            .wait(Some(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("wait: {e}"));
        if let Some(completion) = client.reap().unwrap_or_else(|e| panic!("reap: {e}")) {
            assert!(completion.is_ok(), "namespace 1 after the removal");
            break;
        }
    }
    (ok, refused)
}

#[test]
fn a_forced_removal_under_load_answers_every_request_and_then_closes_the_device() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let file = directory.path().join("ns8");
    let (server, api) = start(config(None));
    let created = api.post(
        "/v1/namespaces",
        &format!(
            r#"{{"namespace_id": 8, "backend": "file:{}", "size_bytes": 16777216}}"#,
            file.display()
        ),
    );
    assert_eq!(created.status, 201, "{}", created.text);
    let done = Arc::new(AtomicU64::new(0));
    let addr = server.native_addr();
    let loads: Vec<_> = (0..3u64)
        .map(|connection| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || load_until_removed(addr, 8, connection << 20, &done))
        })
        .collect();
    eventually("the load is under way", || {
        done.load(Ordering::Relaxed) >= 300
    });
    let removed = api.delete("/v1/namespaces/8?force=true");
    assert_eq!(removed.status, 204, "{}", removed.text);
    for load in loads {
        let (ok, refused) = load
            .join()
            .unwrap_or_else(|_| panic!("a load thread failed"));
        assert!(ok > 0 && refused > 0, "ok {ok}, refused {refused}");
    }
    eventually("every thread drains namespace 8", || {
        server.namespaces_removing() == 0
    });
    eventually("the device of namespace 8 is closed", || !holds_open(&file));
    let stats = server
        .shutdown()
        .unwrap_or_else(|e| panic!("shutdown: {e}"));
    assert!(stats.iter().all(|thread| thread.flush_errors == 0));
}

#[test]
fn every_thread_flushes_a_removed_namespace_once_before_closing_it() {
    // Every flush of this device fails: each one shows in the threads' flush error counts.
    let (server, api) = start(config(None));
    let created = api.post(
        "/v1/namespaces",
        r#"{"namespace_id": 6, "backend": "fault(flush_error_rate=100%):mem:16M"}"#,
    );
    assert_eq!(created.status, 201, "{}", created.text);
    let removed = api.delete("/v1/namespaces/6");
    assert_eq!(removed.status, 204, "{}", removed.text);
    eventually("every thread drains namespace 6", || {
        server.namespaces_removing() == 0
    });
    let stats = server
        .shutdown()
        .unwrap_or_else(|e| panic!("shutdown: {e}"));
    // One removal flush per thread; the shutdown flushes namespace 1 only (it succeeds).
    let flush_errors: u64 = stats.iter().map(|thread| thread.flush_errors).sum();
    assert_eq!(flush_errors, stats.len() as u64, "{stats:?}");
}
