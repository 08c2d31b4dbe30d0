//! SIGHUP with a real `reflexd`: the configuration file gains a namespace and moves namespace
//! 1's binding from tenant `gold` to tenant `silver`; after the signal the new namespace serves
//! (native and NBD), `silver` is bound and serves, namespace 1's NBD export charges new sessions
//! to `silver`, `gold`'s connections are refused (PERMISSION, NBD EPERM, as after the admin
//! API's tenant delete), and every connection opened before stays open.

mod admin_common;
mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Child;

use admin_common::{Api, Nbd, tenant};
use reflex_client::{Client, ClientError};
use reflex_proto::native::Status;

/// Starts reflexd; returns it with its admin API, native and NBD addresses.
fn spawn(config: &Path) -> (Child, Api, SocketAddr, SocketAddr) {
    let (child, log) = common::spawn_reflexd(config, true);
    let admin_line = common::wait_for_line(&log, "admin API listening");
    let serving = common::wait_for_line(&log, "reflexd serving");
    let field = |line: &str, key: &str| -> SocketAddr {
        common::log_field(line, key).unwrap_or_else(|| panic!("no {key} in {line:?}"))
    };
    let addresses = (
        field(&admin_line, "addr"),
        field(&serving, "native"),
        field(&serving, "nbd"),
    );
    std::thread::spawn(move || log.into_iter().for_each(drop));
    (child, Api::new(addresses.0), addresses.1, addresses.2)
}

fn write_config(path: &Path, namespace_1_tenant: &str, namespace_2: bool) {
    let profile = admin_common::profile("device-a-small.toml");
    let mut text = format!(
        r#"
port = 0
original_ports = []
arena_bytes_per_thread = "4M"
threads = 2
[nbd]
port = 0
[nvme_tcp]
enabled = false
[admin]
listen = "127.0.0.1:0"
[[tenant]]
name = "gold"
class = "lc"
latency_us_p95 = 500
iops = 1000
[[tenant]]
name = "silver"
class = "lc"
latency_us_p95 = 1000
iops = 2000
[[namespace]]
id = 1
backend = "mem:16M"
profile = "{profile}"
tenant = "{namespace_1_tenant}"
"#
    );
    if namespace_2 {
        text.push_str("[[namespace]]\nid = 2\nbackend = \"mem:16M\"\nname = \"two\"\n");
    }
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{e}"));
}

/// Sends signal `name` to the child (through kill(1): no unsafe code in tests).
fn signal(child: &Child, name: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(child.id().to_string())
        .status()
        .unwrap_or_else(|e| panic!("kill: {e}"));
    assert!(status.success(), "kill -{name} failed");
}

fn handle_of(api: &Api, name: &str) -> u64 {
    let list = api.get("/v1/tenants").json();
    let entry = tenant(&list, name).unwrap_or_else(|| panic!("no tenant {name}: {list}"));
    u64::from_str_radix(entry["handle"].as_str().unwrap_or(""), 16)
        .unwrap_or_else(|e| panic!("handle: {e}"))
}

#[test]
fn sighup_adds_namespaces_and_moves_bindings_without_dropping_a_connection() {
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = directory.path().join("reflexd.toml");
    write_config(&config, "gold", false);
    let (mut child, api, native, nbd_addr) = spawn(&config);

    let mut plain = Client::connect(native).unwrap_or_else(|e| panic!("{e}"));
    let mut buffer = vec![0u8; 4096];
    plain
        .read(1, 0, &mut buffer)
        .unwrap_or_else(|e| panic!("read: {e}"));
    let mut golden = Client::connect(native).unwrap_or_else(|e| panic!("{e}"));
    golden
        .bind(handle_of(&api, "gold"))
        .unwrap_or_else(|e| panic!("bind: {e}"));
    golden
        .read(1, 0, &mut buffer)
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert!(tenant(&api.get("/v1/tenants").json(), "silver").is_none());
    // NBD sessions of namespace 1's export are gold's.
    let mut gold_session = Nbd::connect(nbd_addr, "ns1").unwrap_or_else(|e| panic!("NBD: {e}"));
    assert_eq!(gold_session.read(0, &mut buffer), 0);

    write_config(&config, "silver", true);
    signal(&child, "HUP");
    api.wait_for("/v1/tenants", |list| {
        tenant(list, "silver").is_some() && tenant(list, "gold").is_none()
    });
    let namespaces = api.wait_for("/v1/namespaces", |list| {
        list.as_array().is_some_and(|list| list.len() == 2)
    });
    assert_eq!(namespaces[1]["namespace_id"], 2);
    assert_eq!(
        tenant(&api.get("/v1/tenants").json(), "silver").map(|silver| silver["origin"].clone()),
        Some(serde_json::json!("config"))
    );

    // The connection opened before the signal uses both namespaces.
    let data = vec![0x5au8; 4096];
    plain
        .write(2, 4096, &data)
        .unwrap_or_else(|e| panic!("write to the new namespace: {e}"));
    plain
        .read(2, 4096, &mut buffer)
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert_eq!(buffer, data);
    plain
        .read(1, 0, &mut buffer)
        .unwrap_or_else(|e| panic!("read: {e}"));
    // gold's binding left the file: its connection is refused, and stays open.
    match golden.read(1, 0, &mut buffer) {
        Err(ClientError::Status { status, .. }) => assert_eq!(status, Status::Permission),
        other => panic!("gold's connection after the reload: {other:?}"),
    }
    match golden.read(1, 0, &mut buffer) {
        Err(ClientError::Status { status, .. }) => assert_eq!(status, Status::Permission),
        other => panic!("gold's connection after the reload: {other:?}"),
    }
    assert_eq!(gold_session.read(0, &mut buffer), libc::EPERM as u32);
    // The export charges new sessions to silver; the new namespace has its export.
    let mut silver_session = Nbd::connect(nbd_addr, "ns1").unwrap_or_else(|e| panic!("NBD: {e}"));
    assert_eq!(silver_session.read(0, &mut buffer), 0);
    let mut two = Nbd::connect(nbd_addr, "two").unwrap_or_else(|e| panic!("NBD: {e}"));
    assert_eq!(two.read(4096, &mut buffer), 0);
    assert_eq!(buffer, data);
    let silver_connections = api.wait_for("/v1/tenants", |list| {
        tenant(list, "silver").is_some_and(|silver| silver["connections"].as_u64() >= Some(1))
    });
    assert!(tenant(&silver_connections, "silver").is_some());
    // silver is bound and serves.
    let mut silver = Client::connect(native).unwrap_or_else(|e| panic!("{e}"));
    silver
        .bind(handle_of(&api, "silver"))
        .unwrap_or_else(|e| panic!("bind silver: {e}"));
    silver
        .read(1, 0, &mut buffer)
        .unwrap_or_else(|e| panic!("read as silver: {e}"));

    // A second SIGHUP with nothing changed changes nothing.
    signal(&child, "HUP");
    plain
        .read(2, 4096, &mut buffer)
        .unwrap_or_else(|e| panic!("read: {e}"));
    silver
        .read(1, 0, &mut buffer)
        .unwrap_or_else(|e| panic!("read as silver: {e}"));

    signal(&child, "TERM");
    let status = child.wait().unwrap_or_else(|e| panic!("wait: {e}"));
    assert!(status.success(), "reflexd exited with {status}");
}
