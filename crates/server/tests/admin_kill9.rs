//! The state file under kill -9: a real `reflexd` receives a stream of tenant changes through
//! the admin API and is killed with SIGKILL at a random moment, [`CYCLES`] times. After each
//! kill the state file must parse and hold exactly the state after the changes the server
//! acknowledged, or after one more (the change in flight when it died): the old state or the
//! new one, never a torn or mixed one. The restarted server must then serve that state.
//! Namespaces added and removed through the API, and tenants on them, survive a kill too.

mod admin_common;
mod common;

use std::path::Path;
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use admin_common::Api;
use reflex_qos::TenantSpec;
use reflex_server::admin::state_file::{Origin, PersistedState, StateFile};

const CYCLES: u64 = 50;

/// The change number `index` (from 0): create `t<index>`, change gold's IOPS, remove the
/// tenant created two changes before. Each is one write of the state file.
fn change(api: &Api, index: u64) -> Option<u16> {
    match index % 3 {
        0 => api.try_status(
            "post",
            "/v1/namespaces/1/tenants",
            Some(&format!(r#"{{"name": "t{index}", "class": "be"}}"#)),
        ),
        1 => api.try_status(
            "patch",
            "/v1/namespaces/1/tenants/gold",
            Some(&format!(r#"{{"iops": {}}}"#, 1000 + index)),
        ),
        _ => api.try_status(
            "delete",
            &format!("/v1/namespaces/1/tenants/t{}", index - 2),
            None,
        ),
    }
}

/// What the state file must say after `count` changes: (gold's IOPS, the admin tenants).
fn model(count: u64) -> (Option<u64>, Vec<String>) {
    let mut gold = None;
    let mut tenants = Vec::new();
    for index in 0..count {
        match index % 3 {
            0 => tenants.push(format!("t{index}")),
            1 => gold = Some(1000 + index),
            _ => tenants.retain(|name| *name != format!("t{}", index - 2)),
        }
    }
    (gold, tenants)
}

fn summary(state: &PersistedState) -> (Option<u64>, Vec<String>) {
    let gold = state.find(1, "gold").map(|tenant| match tenant.spec {
        TenantSpec::LatencyCritical { iops, .. } => iops,
        TenantSpec::BestEffort => panic!("gold became best-effort"),
    });
    let tenants = state
        .tenants
        .iter()
        .filter(|tenant| tenant.origin == Origin::Admin)
        .map(|tenant| tenant.name.clone())
        .collect();
    (gold, tenants)
}

/// Starts reflexd with the admin API on a free port and returns it with the API's address.
fn spawn(config: &Path) -> (Child, Api) {
    let (child, log) = common::spawn_reflexd(config, true);
    let line = common::wait_for_line(&log, "admin API listening");
    let addr =
        common::log_field(&line, "addr").unwrap_or_else(|| panic!("no admin address in {line:?}"));
    // Keep reading its log, so reflexd never blocks on a full pipe.
    std::thread::spawn(move || log.into_iter().for_each(drop));
    (child, Api::new(addr))
}

#[test]
fn kill_9_during_updates_leaves_the_old_or_the_new_state() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let state_path = directory.path().join("state.json");
    let config_path = directory.path().join("reflexd.toml");
    let profile = admin_common::profile("device-a-small.toml");
    std::fs::write(
        &config_path,
        format!(
            r#"
port = 0
original_ports = []
arena_bytes_per_thread = "4M"
[nbd]
enabled = false
[nvme_tcp]
enabled = false
[admin]
listen = "127.0.0.1:0"
state_file = "{}"
[[tenant]]
name = "gold"
class = "lc"
latency_us_p95 = 500
iops = 1000
[[namespace]]
id = 1
backend = "mem:16M"
profile = "{profile}"
tenant = "gold"
"#,
            state_path.display()
        ),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let file = StateFile::new(&state_path);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut in_flight_kills = 0;
    for cycle in 0..CYCLES {
        let (mut child, api) = spawn(&config_path);
        // The restarted server serves what the file says.
        let before = file.load().unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
        let done = before.generation;
        let served = api.get("/v1/tenants").json();
        for name in model(done).1 {
            assert!(
                admin_common::tenant(&served, &name).is_some(),
                "cycle {cycle}: {name} not restored: {served}"
            );
        }
        // Changes on a thread, SIGKILL from here after a random delay.
        let acknowledged = Arc::new(AtomicU64::new(done));
        let stop = Arc::new(AtomicBool::new(false));
        let changer = {
            let acknowledged = Arc::clone(&acknowledged);
            let stop = Arc::clone(&stop);
            let addr = api.addr();
            std::thread::spawn(move || {
                let api = Api::new(addr);
                let mut index = done;
                while !stop.load(Ordering::Relaxed) {
                    match change(&api, index) {
                        Some(200..=299) => {
                            index += 1;
                            acknowledged.store(index, Ordering::SeqCst);
                        }
                        Some(other) => panic!("change {index} answered {other}"),
                        None => break, // The server died mid-request.
                    }
                }
            })
        };
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        // At least one change lands in every cycle, however slow the machine's fsync,
        // then the kill comes at a random point of the changes that follow.
        let waiting = Instant::now();
        while acknowledged.load(Ordering::SeqCst) == done && !changer.is_finished() {
            assert!(
                waiting.elapsed() < Duration::from_secs(60),
                "cycle {cycle}: no change acknowledged in 60 s"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        let delay = Duration::from_micros(seed % 40_000);
        let started = Instant::now();
        while started.elapsed() < delay {
            std::thread::sleep(Duration::from_micros(500));
        }
        let acknowledged_before_kill = acknowledged.load(Ordering::SeqCst);
        child.kill().unwrap_or_else(|e| panic!("kill: {e}"));
        let _ = child.wait();
        stop.store(true, Ordering::Relaxed);
        let _ = changer.join();
        let acknowledged_after = acknowledged.load(Ordering::SeqCst);
        let state = file
            .load()
            .unwrap_or_else(|e| panic!("cycle {cycle}: torn state file: {e}"));
        let generation = state.generation;
        assert!(
            generation == acknowledged_after || generation == acknowledged_after + 1,
            "cycle {cycle}: the file holds {generation} changes, the server acknowledged {acknowledged_after}"
        );
        assert!(generation >= acknowledged_before_kill);
        assert_eq!(
            summary(&state),
            model(generation),
            "cycle {cycle}: the file is not the state after {generation} changes"
        );
        if generation == acknowledged_after + 1 {
            in_flight_kills += 1;
        }
    }
    let total = file.load().unwrap_or_else(|e| panic!("{e}")).generation;
    assert!(total >= CYCLES, "only {total} changes in {CYCLES} cycles");
    eprintln!(
        "{CYCLES} kill -9 cycles, {total} changes; {in_flight_kills} kills landed after a change was durable but before its answer"
    );
}

/// A namespace added through the admin API, a tenant on it and a forced removal of another:
/// acknowledged before a SIGKILL, each is what the restarted server serves.
#[test]
fn namespaces_changed_before_a_kill_9_are_served_after_the_restart() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let state_path = directory.path().join("state.json");
    let config_path = directory.path().join("reflexd.toml");
    let profile = admin_common::profile("device-a-small.toml");
    std::fs::write(
        &config_path,
        format!(
            r#"
port = 0
original_ports = []
arena_bytes_per_thread = "4M"
[nbd]
enabled = false
[nvme_tcp]
enabled = false
[admin]
listen = "127.0.0.1:0"
state_file = "{}"
[[namespace]]
id = 1
backend = "mem:16M"
"#,
            state_path.display()
        ),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let file = directory.path().join("ns2");
    let (mut child, api) = spawn(&config_path);
    for body in [
        format!(
            r#"{{"namespace_id": 2, "backend": "file:{}", "size_bytes": 4194304, "profile": "{profile}"}}"#,
            file.display()
        ),
        r#"{"namespace_id": 3, "backend": "mem:8M"}"#.to_string(),
    ] {
        assert_eq!(
            api.try_status("post", "/v1/namespaces", Some(&body)),
            Some(201),
            "{body}"
        );
    }
    assert_eq!(
        api.try_status(
            "post",
            "/v1/namespaces/2/tenants",
            Some(r#"{"name": "two", "class": "lc", "latency_us_p95": 1000, "iops": 500}"#)
        ),
        Some(201)
    );
    assert_eq!(
        api.try_status("delete", "/v1/namespaces/3?force=true", None),
        Some(204)
    );
    child.kill().unwrap_or_else(|e| panic!("kill: {e}"));
    let _ = child.wait();

    let state = StateFile::new(&state_path)
        .load()
        .unwrap_or_else(|e| panic!("{e}"));
    let ids: Vec<u32> = state
        .namespaces
        .iter()
        .map(|namespace| namespace.namespace_id)
        .collect();
    assert_eq!(ids, vec![2]);
    let (mut child, api) = spawn(&config_path);
    let namespaces = api.get("/v1/namespaces").json();
    let served: Vec<u64> = namespaces
        .as_array()
        .unwrap_or_else(|| panic!("{namespaces}"))
        .iter()
        .filter_map(|namespace| namespace["namespace_id"].as_u64())
        .collect();
    assert_eq!(served, vec![1, 2]);
    assert_eq!(api.get("/v1/namespaces/2").json()["qos"], true);
    let two = admin_common::tenant(&api.get("/v1/tenants").json(), "two")
        .cloned()
        .unwrap_or_else(|| panic!("tenant two was not restored"));
    assert_eq!(two["namespace_id"], 2);
    assert_eq!(two["origin"], "admin");
    child.kill().unwrap_or_else(|e| panic!("kill: {e}"));
    let _ = child.wait();
}
