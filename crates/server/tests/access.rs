//! Access control (issue 13, part 3 and 4) against a real server over loopback TCP: each
//! listener's source-address allow-list (a peer from 127.0.0.2 is refused at accept, one from
//! 127.0.0.1 is served, on the native, original, NBD, NVMe/TCP and admin listeners), tenants'
//! grants (read-only, a byte range, their own namespace) on every protocol with real clients
//! (nbdsh, nbdcopy and nbdinfo from libnbd, the native and NVMe/TCP clients of this workspace,
//! the original protocol by hand), the data read back unchanged after every refusal, the
//! refusals counted in the Prometheus metrics, and the admin API's bearer token.
//!
//! Linux routes all of 127.0.0.0/8 to the loopback interface, so a client socket bound to
//! 127.0.0.2 before it connects is a second peer address on the same machine.

mod admin_common;
mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use admin_common::{Api, profile};
use common::pattern;
use reflex_client::nvme_tcp::{NvmeTcpController, NvmeTcpError, NvmeTcpOptions};
use reflex_client::{Client, ClientError};
use reflex_proto::native;
use reflex_proto::nvme_tcp::Status as NvmeStatus;
use reflex_proto::nvme_tcp::pdu;
use reflex_proto::original::{Header, Opcode};
use reflex_server::admin::AdminConfig;
use reflex_server::{
    AccessConfig, Config, NamespaceConfig, NbdExportConfig, NvmeHostConfig, NvmeSubsystemConfig,
    OriginalPortConfig, Server, ServerHandle, TenantConfig,
};

const SERVED: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const OTHER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const NQN: &str = "nqn.2026-01.io.reflex:access";
const HOST_READER: &str = "nqn.2014-08.org.nvmexpress:uuid:reader";
const HOST_RANGED: &str = "nqn.2014-08.org.nvmexpress:uuid:ranged";
/// Bytes of namespace 1 the tests write first and check afterwards.
const SEEDED_BYTES: usize = 4 << 20;
/// The range tenant `ranged` is granted: [1 MiB, 2 MiB).
const RANGE_OFFSET: u64 = 1 << 20;
const RANGE_SIZE: u64 = 1 << 20;
/// Longest wait for a metric to show what happened (the statistics window is 200 ms).
const METRICS_WAIT: Duration = Duration::from_secs(20);
/// What libnbd reports for the server's NBD_EPERM.
const EPERM: &str = "EPERM";

// ---------------------------------------------------------------------------------------------
// Helpers

/// A TCP connection to `addr` from source address `source`.
fn connect_from(source: Ipv4Addr, addr: SocketAddr) -> TcpStream {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
        .unwrap_or_else(|e| panic!("socket: {e}"));
    socket
        .bind(&SocketAddr::new(IpAddr::V4(source), 0).into())
        .unwrap_or_else(|e| panic!("bind {source}: {e}"));
    socket
        .connect(&addr.into())
        .unwrap_or_else(|e| panic!("connect {addr} from {source}: {e}"));
    let stream: TcpStream = socket.into();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap_or_else(|e| panic!("{e}"));
    stream
}

/// Whether the server closed `stream` without sending a byte (`first`: bytes the client sends
/// first, for protocols where the client speaks first). A served connection either answers
/// or stays open until the read times out.
fn closed_without_a_byte(mut stream: TcpStream, first: &[u8]) -> bool {
    // A refused connection may be reset before the write: that is a refusal too.
    if let Err(error) = stream.write_all(first) {
        eprintln!("write: {error}");
        return matches!(
            error.kind(),
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe
        );
    }
    let mut bytes = [0u8; 64];
    // A signal may interrupt the wait (the in-process server's threads share the process):
    // that says nothing about the connection, so wait again.
    let read = loop {
        match stream.read(&mut bytes) {
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            other => break other,
        }
    };
    match read {
        Ok(0) => true,
        Ok(count) => {
            eprintln!("served: received {count} bytes");
            false
        }
        Err(error) if error.kind() == ErrorKind::ConnectionReset => true,
        Err(error) => {
            eprintln!("no close: {error}");
            false
        }
    }
}

/// A raw HTTP/1.1 GET from `source`: (status, headers, body).
fn http_get(
    source: Ipv4Addr,
    addr: SocketAddr,
    path: &str,
    authorization: Option<&str>,
) -> (u16, String, String) {
    let mut stream = connect_from(source, addr);
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(value) = authorization {
        request.push_str(&format!("Authorization: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream
        .write_all(request.as_bytes())
        .unwrap_or_else(|e| panic!("send: {e}"));
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .unwrap_or_else(|e| panic!("receive: {e}"));
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no header end: {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status: {head:?}"));
    (status, head.to_string(), body.to_string())
}

/// The value of the sample of `name` whose labels include every `key="value"` of `labels`.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .find(|line| {
            labels
                .iter()
                .all(|(key, value)| line.contains(&format!("{key}=\"{value}\"")))
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

/// Waits until the metric reaches `at_least`, and returns its value then.
fn wait_for_metric(api: &Api, name: &str, labels: &[(&str, &str)], at_least: f64) -> f64 {
    let deadline = Instant::now() + METRICS_WAIT;
    loop {
        let text = api.get("/metrics").text;
        if let Some(value) = metric(&text, name, labels)
            && value >= at_least
        {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "{name}{labels:?} never reached {at_least}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A tool from the distribution (nbdsh runs the first `python3` on PATH, which must be the
/// system's, with python3-libnbd).
fn tool(name: &str) -> Command {
    let path = PathBuf::from("/usr/bin").join(name);
    assert!(
        path.is_file(),
        "{name} is not installed (libnbd-bin, installed by scripts/test.sh)"
    );
    let mut command = Command::new(path);
    let rest = std::env::var("PATH").unwrap_or_default();
    command.env("PATH", format!("/usr/bin:/bin:{rest}"));
    command
}

/// Runs `operations` (Python over libnbd handle `h`, connected to `uri` without client-side
/// checks) through nbdsh; returns the JSON object the script prints: per operation, 0 or
/// the errno the server answered.
fn nbdsh(uri: &str, operations: &[(&str, &str)]) -> serde_json::Value {
    let mut script = format!(
        "import json\nh = nbd.NBD()\nh.set_strict_mode(0)\nh.connect_uri({uri:?})\nresults = {{}}\n"
    );
    for (name, call) in operations {
        script.push_str(&format!(
            "try:\n    {call}\n    results[{name:?}] = 0\nexcept nbd.Error as e:\n    results[{name:?}] = e.errno\n"
        ));
    }
    script.push_str("h.shutdown()\nprint(json.dumps(results))\n");
    let output = tool("nbdsh")
        .args(["-n", "-c", &script])
        .output()
        .unwrap_or_else(|e| panic!("nbdsh: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "nbdsh failed: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn nbd_uri(server: &ServerHandle, export: &str) -> String {
    let addr = server.nbd_addr().unwrap_or_else(|| panic!("NBD is off"));
    format!("nbd://{addr}/{export}")
}

/// The status a native call ended with.
fn native_status<T>(result: Result<T, ClientError>) -> native::Status {
    match result {
        Ok(_) => native::Status::Ok,
        Err(ClientError::Status { status, .. }) => status,
        Err(other) => panic!("expected a status, got {other}"),
    }
}

fn nvme_status<T>(result: Result<T, NvmeTcpError>) -> NvmeStatus {
    match result {
        Ok(_) => NvmeStatus::SUCCESS,
        Err(NvmeTcpError::Status { status, .. }) => status,
        Err(other) => panic!("expected a status, got {other}"),
    }
}

/// An original-protocol request: the header and, for a WRITE, its data.
fn original_request(opcode: Opcode, offset: u64, data: &[u8]) -> Vec<u8> {
    let header = Header {
        opcode,
        handle: 7u64.to_le_bytes(),
        lba: offset / 512,
        lba_count: (data.len() / 512) as u32,
    };
    let mut bytes = header.to_bytes().to_vec();
    if opcode == Opcode::Write {
        bytes.extend_from_slice(data);
    }
    bytes
}

/// Sends one original-protocol request and returns the data answered, or `None` when the
/// server closed the connection instead (its way of refusing).
fn original_call(addr: SocketAddr, opcode: Opcode, offset: u64, data: &[u8]) -> Option<Vec<u8>> {
    let mut stream = connect_from(SERVED, addr);
    stream
        .write_all(&original_request(opcode, offset, data))
        .ok()?;
    let mut header = [0u8; 24];
    stream.read_exact(&mut header).ok()?;
    let mut answer = vec![
        0u8;
        if opcode == Opcode::Read {
            data.len()
        } else {
            0
        }
    ];
    stream.read_exact(&mut answer).ok()?;
    Some(answer)
}

// ---------------------------------------------------------------------------------------------
// Tenants' grants

/// Namespace 1 (16 MiB, QoS profile) served to four tenants: `reader` (read-only), `ranged`
/// (bytes [1 MiB, 2 MiB) only), both through an NBD export, an original port and an NVMe/TCP
/// host of their own; the namespace's default tenant through its own export `ns1` and the
/// native protocol. Namespace 2 belongs to tenant `other`.
fn grants_config() -> Config {
    let with_profile = |id: u32, tenant: Option<&str>| NamespaceConfig {
        profile: Some(profile("device-a-small.toml")),
        tenant: tenant.map(str::to_string),
        ..NamespaceConfig::new(id, "mem:16M")
    };
    let mut config = common::config(vec![with_profile(1, None), with_profile(2, Some("other"))]);
    // Five listeners: room for more than one connection each per thread.
    config.connections_per_thread_max = 256;
    config.tenants = vec![
        TenantConfig {
            access: AccessConfig::ReadOnly,
            ..TenantConfig::best_effort("reader")
        },
        TenantConfig {
            range_offset: Some(RANGE_OFFSET),
            range_size: Some(RANGE_SIZE),
            ..TenantConfig::best_effort("ranged")
        },
        TenantConfig::best_effort("other"),
    ];
    config.nbd.exports = ["reader", "ranged"]
        .iter()
        .map(|tenant| NbdExportConfig {
            name: format!("{tenant}-export"),
            namespace: 1,
            tenant: Some((*tenant).to_string()),
        })
        .collect();
    config.original_ports = Some(
        ["reader", "ranged"]
            .iter()
            .map(|tenant| OriginalPortConfig {
                tenant: Some((*tenant).to_string()),
                ..OriginalPortConfig::new(0, 1)
            })
            .collect(),
    );
    config.nvme_tcp.subsystems = vec![NvmeSubsystemConfig {
        nqn: NQN.to_string(),
        namespaces: vec![1],
        allow_any_host: false,
        hosts: [(HOST_READER, "reader"), (HOST_RANGED, "ranged")]
            .iter()
            .map(|(nqn, tenant)| NvmeHostConfig {
                nqn: (*nqn).to_string(),
                tenant: Some((*tenant).to_string()),
                psk: None,
                psk_file: None,
            })
            .collect(),
        secure_channel: false,
    }];
    config.admin = AdminConfig {
        stats_window: Duration::from_millis(200),
        ..AdminConfig::loopback()
    };
    config
}

/// Starts the grants server and writes [`SEEDED_BYTES`] of pattern 1 at the start of
/// namespace 1 as the default tenant (allowed everything).
fn start_seeded() -> (ServerHandle, Api, Vec<u8>) {
    let server = common::start(grants_config());
    let api = Api::new(
        server
            .admin_addr()
            .unwrap_or_else(|| panic!("no admin API")),
    );
    let seed = pattern(1, SEEDED_BYTES);
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    for (index, chunk) in seed.chunks(1 << 20).enumerate() {
        client
            .write(1, (index as u64) << 20, chunk)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    (server, api, seed)
}

/// Namespace 1's first [`SEEDED_BYTES`], read by the default tenant.
fn read_back(server: &ServerHandle) -> Vec<u8> {
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let mut data = vec![0u8; SEEDED_BYTES];
    for (index, chunk) in data.chunks_mut(1 << 20).enumerate() {
        client
            .read(1, (index as u64) << 20, chunk)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    data
}

fn handle_of(server: &ServerHandle, namespace_id: u32, tenant: &str) -> u64 {
    server
        .tenant_handle(namespace_id, tenant)
        .unwrap_or_else(|| panic!("no tenant {tenant} on namespace {namespace_id}"))
}

fn nvme_controller(server: &ServerHandle, host: &str) -> (NvmeTcpController, u32) {
    let addr = server
        .nvme_tcp_addr()
        .unwrap_or_else(|| panic!("NVMe/TCP is off"));
    let mut controller = NvmeTcpController::attach(addr, NvmeTcpOptions::new(host, NQN), 1)
        .unwrap_or_else(|e| panic!("attach: {e}"));
    let block_bytes = controller
        .namespace(1)
        .unwrap_or_else(|e| panic!("{e}"))
        .block_bytes;
    (controller, block_bytes)
}

#[test]
fn a_read_only_grant_refuses_write_trim_and_write_zeroes_on_every_protocol() {
    let (server, api, seed) = start_seeded();
    let offset = 64 << 10;
    let mut refused = 0.0;

    // NBD, with libnbd: writes, trims and zeroes answered EPERM; reads served.
    let uri = nbd_uri(&server, "reader-export");
    let results = nbdsh(
        &uri,
        &[
            ("pwrite", &format!("h.pwrite(b'\\xee' * 4096, {offset})")),
            ("trim", &format!("h.trim(4096, {offset})")),
            ("zero", &format!("h.zero(4096, {offset})")),
            (
                "pread",
                &format!(
                    "assert h.pread(4096, {offset}) == bytes({:?})",
                    &seed[offset..offset + 4096]
                ),
            ),
        ],
    );
    assert_eq!(results["pwrite"], EPERM, "{results}");
    assert_eq!(results["trim"], EPERM, "{results}");
    assert_eq!(results["zero"], EPERM, "{results}");
    assert_eq!(results["pread"], 0, "{results}");
    refused += 3.0;
    // nbdcopy into the read-only export fails (its first write is refused).
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let source = dir.path().join("source");
    std::fs::write(&source, vec![0x5au8; 1 << 20]).unwrap_or_else(|e| panic!("{e}"));
    let copy = tool("nbdcopy")
        .args(["--synchronous", "--destination-is-zero"])
        .arg(&source)
        .arg(&uri)
        .stderr(Stdio::piped())
        .output()
        .unwrap_or_else(|e| panic!("nbdcopy: {e}"));
    assert!(!copy.status.success(), "nbdcopy wrote to a read-only grant");
    eprintln!("nbdcopy: {}", String::from_utf8_lossy(&copy.stderr));
    refused += 1.0;
    // nbdinfo sees the export (it is served, only writes are refused).
    let info = tool("nbdinfo")
        .arg(&uri)
        .output()
        .unwrap_or_else(|e| panic!("nbdinfo: {e}"));
    assert!(info.status.success());

    // Native, BOUND to the configured tenant.
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    client
        .bind(handle_of(&server, 1, "reader"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        native_status(client.write(1, offset as u64, &[0xee; 4096])),
        native::Status::Permission
    );
    assert_eq!(
        native_status(client.trim(1, offset as u64, 4096)),
        native::Status::Permission
    );
    refused += 2.0;
    let mut data = vec![0u8; 4096];
    client
        .read(1, offset as u64, &mut data)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(data[..] == seed[offset..offset + 4096]);

    // The original protocol: a write closes the connection; a read is served.
    let reader_port = server.original_addrs()[0].1;
    assert_eq!(
        original_call(reader_port, Opcode::Write, offset as u64, &[0xee; 4096]),
        None,
        "a refused original-protocol write closes its connection"
    );
    refused += 1.0;
    let read = original_call(reader_port, Opcode::Read, offset as u64, &[0; 4096]);
    assert_eq!(read.as_deref(), Some(&seed[offset..offset + 4096]));

    // NVMe/TCP: Access Denied for Write, Write Zeroes and Dataset Management (deallocate).
    let (mut controller, block_bytes) = nvme_controller(&server, HOST_READER);
    let mut queue = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    let slba = offset as u64 / u64::from(block_bytes);
    let blocks = 4096 / block_bytes;
    assert_eq!(
        nvme_status(queue.write(1, slba, &[0xee; 4096], block_bytes, false)),
        NvmeStatus::ACCESS_DENIED
    );
    assert_eq!(
        nvme_status(queue.write_zeroes(1, slba, blocks)),
        NvmeStatus::ACCESS_DENIED
    );
    assert_eq!(
        nvme_status(queue.deallocate(1, &[(slba, blocks)])),
        NvmeStatus::ACCESS_DENIED
    );
    refused += 3.0;
    let data = queue
        .read(1, slba, blocks, block_bytes)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(data[..] == seed[offset..offset + 4096]);

    // Nothing was written, trimmed or zeroed.
    assert!(read_back(&server) == seed, "a refused request changed data");
    let counted = wait_for_metric(
        &api,
        "reflex_refusals_total",
        &[("tenant", "reader"), ("reason", "read_only")],
        refused,
    );
    eprintln!("refusals counted: {counted} (at least {refused})");
    let text = api.get("/metrics").text;
    assert!(
        text.contains("# TYPE reflex_refusals_total counter"),
        "{text}"
    );
    admin_common::promtool_accepts(&text);
}

#[test]
fn a_range_grant_refuses_requests_outside_it_on_every_protocol() {
    let (server, api, mut expected) = start_seeded();
    let inside = RANGE_OFFSET as usize + (64 << 10);
    let straddling = (RANGE_OFFSET + RANGE_SIZE) as usize - 2048;
    let mut refused = 0.0;

    // NBD: inside served, before the range and across its end refused (EPERM), reads too.
    let uri = nbd_uri(&server, "ranged-export");
    let results = nbdsh(
        &uri,
        &[
            (
                "write_inside",
                &format!("h.pwrite(b'\\x11' * 4096, {inside})"),
            ),
            ("read_before", "h.pread(4096, 0)"),
            ("write_before", "h.pwrite(b'\\x22' * 4096, 0)"),
            (
                "write_across",
                &format!("h.pwrite(b'\\x22' * 4096, {straddling})"),
            ),
            (
                "zero_after",
                &format!("h.zero(4096, {})", RANGE_OFFSET + RANGE_SIZE),
            ),
        ],
    );
    assert_eq!(results["write_inside"], 0, "{results}");
    expected[inside..inside + 4096].fill(0x11);
    for refused_operation in ["read_before", "write_before", "write_across", "zero_after"] {
        assert_eq!(
            results[refused_operation], EPERM,
            "{refused_operation}: {results}"
        );
    }
    refused += 4.0;

    // Native, bound to the tenant.
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    client
        .bind(handle_of(&server, 1, "ranged"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut data = vec![0u8; 4096];
    assert_eq!(
        native_status(client.read(1, 0, &mut data)),
        native::Status::Permission
    );
    assert_eq!(
        native_status(client.write(1, straddling as u64, &[0x33; 4096])),
        native::Status::Permission
    );
    refused += 2.0;
    client
        .write(1, inside as u64 + 4096, &[0x44; 4096])
        .unwrap_or_else(|e| panic!("{e}"));
    expected[inside + 4096..inside + 8192].fill(0x44);

    // The original protocol: outside closes the connection, inside is served.
    let ranged_port = server.original_addrs()[1].1;
    assert_eq!(
        original_call(ranged_port, Opcode::Read, 0, &[0; 4096]),
        None
    );
    assert_eq!(
        original_call(ranged_port, Opcode::Write, 2 << 20, &[0x55; 4096]),
        None
    );
    refused += 2.0;
    let read = original_call(ranged_port, Opcode::Read, inside as u64, &[0; 4096]);
    assert_eq!(read.as_deref(), Some(&expected[inside..inside + 4096]));

    // NVMe/TCP: Access Denied outside.
    let (mut controller, block_bytes) = nvme_controller(&server, HOST_RANGED);
    let mut queue = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    let blocks = 4096 / block_bytes;
    assert_eq!(
        nvme_status(queue.read(1, 0, blocks, block_bytes)),
        NvmeStatus::ACCESS_DENIED
    );
    assert_eq!(
        nvme_status(queue.write(
            1,
            (2 << 20) / u64::from(block_bytes),
            &[0x66; 4096],
            block_bytes,
            false
        )),
        NvmeStatus::ACCESS_DENIED
    );
    refused += 2.0;
    let slba = (inside as u64 + 8192) / u64::from(block_bytes);
    queue
        .write(1, slba, &[0x77; 4096], block_bytes, false)
        .unwrap_or_else(|e| panic!("{e}"));
    expected[inside + 8192..inside + 12288].fill(0x77);

    assert!(
        read_back(&server) == expected,
        "only the writes inside the range changed data"
    );
    wait_for_metric(
        &api,
        "reflex_refusals_total",
        &[("tenant", "ranged"), ("reason", "out_of_range")],
        refused,
    );
}

#[test]
fn a_tenant_cannot_use_another_tenants_namespace() {
    let (server, api, seed) = start_seeded();
    // Bound to tenant `other` (namespace 2), a native connection may not touch namespace 1.
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    client
        .bind(handle_of(&server, 2, "other"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut data = vec![0u8; 4096];
    assert_eq!(
        native_status(client.read(1, 0, &mut data)),
        native::Status::Permission
    );
    assert_eq!(
        native_status(client.write(1, 0, &[0x99; 4096])),
        native::Status::Permission
    );
    client
        .write(2, 0, &[0x99; 4096])
        .unwrap_or_else(|e| panic!("its own namespace: {e}"));
    // Bound to `reader` (namespace 1), it may not touch namespace 2.
    client
        .bind(handle_of(&server, 1, "reader"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        native_status(client.read(2, 0, &mut data)),
        native::Status::Permission
    );
    // NVMe/TCP: the reader host's subsystem has only namespace 1; namespace 2 is not there.
    let (mut controller, block_bytes) = nvme_controller(&server, HOST_READER);
    let mut queue = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        nvme_status(queue.read(2, 0, 1, block_bytes)),
        NvmeStatus::INVALID_NAMESPACE
    );
    assert!(read_back(&server) == seed);
    wait_for_metric(
        &api,
        "reflex_refusals_total",
        &[("tenant", "other"), ("reason", "namespace")],
        2.0,
    );
    wait_for_metric(
        &api,
        "reflex_refusals_total",
        &[("tenant", "reader"), ("reason", "namespace")],
        1.0,
    );
}

/// A reload (what SIGHUP does) that changes a grant is in force for connections already
/// charged to the tenant: the same native connection is refused, allowed, refused again.
#[test]
fn a_reloaded_grant_applies_to_connections_already_open() {
    let (server, _api, mut expected) = start_seeded();
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    client
        .bind(handle_of(&server, 1, "reader"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        native_status(client.write(1, 0, &[0xc1; 4096])),
        native::Status::Permission
    );

    let mut config = grants_config();
    config.tenants[0].access = AccessConfig::ReadWrite;
    let report = server.reload_tenants(&config);
    assert_eq!(report.grants_changed, 1, "{report:?}");
    client
        .write(1, 0, &[0xc2; 4096])
        .unwrap_or_else(|e| panic!("read-write after the reload: {e}"));
    expected[..4096].fill(0xc2);

    let report = server.reload_tenants(&grants_config());
    assert_eq!(report.grants_changed, 1, "{report:?}");
    assert_eq!(
        native_status(client.write(1, 0, &[0xc3; 4096])),
        native::Status::Permission
    );
    assert!(read_back(&server) == expected);
}

#[test]
fn a_grant_on_a_namespace_without_qos_is_refused_at_start() {
    let mut config = grants_config();
    config.namespaces[0].profile = None;
    config.admin = AdminConfig::disabled();
    let error = Server::start(config)
        .err()
        .unwrap_or_else(|| panic!("a grant that would not be enforced was accepted"));
    assert!(error.to_string().contains("no QoS"), "{error}");
}

// ---------------------------------------------------------------------------------------------
// Listeners' allow-lists

fn allow_loopback_one() -> Option<Vec<ipnet::IpNet>> {
    Some(vec![
        "127.0.0.1/32".parse().unwrap_or_else(|e| panic!("{e}")),
    ])
}

#[test]
fn allow_lists_refuse_peers_from_other_addresses_on_every_listener() {
    let mut config = common::config(vec![common::namespace(1, "mem:16M", None)]);
    config.connections_per_thread_max = 256;
    config.allow = allow_loopback_one();
    config.nbd.allow = allow_loopback_one();
    config.nvme_tcp.allow = allow_loopback_one();
    config.original_ports = Some(vec![OriginalPortConfig {
        allow: allow_loopback_one(),
        ..OriginalPortConfig::new(0, 1)
    }]);
    config.admin = AdminConfig {
        stats_window: Duration::from_millis(200),
        allow: allow_loopback_one(),
        ..AdminConfig::loopback()
    };
    let server = common::start(config);
    let native_addr = server.native_addr();
    let original_addr = server.original_addrs()[0].1;
    let nbd_addr = server.nbd_addr().unwrap_or_else(|| panic!("NBD is off"));
    let nvme_addr = server
        .nvme_tcp_addr()
        .unwrap_or_else(|| panic!("NVMe/TCP is off"));
    let admin_addr = server
        .admin_addr()
        .unwrap_or_else(|| panic!("no admin API"));

    // From 127.0.0.2: every listener closes the connection at accept, before a byte (NBD
    // and NVMe/TCP: a served connection would get the NBD greeting or the ICResp).
    let hello = native::RequestHeader::read(1, 1, 0, 4096).to_bytes();
    let ic_req = pdu::encode_ic_req(&pdu::IcReq {
        pfv: 0,
        hpda: 0,
        digests: pdu::Digests::NONE,
        maxr2t: 0,
    });
    let original_read = original_request(Opcode::Read, 0, &[0; 512]);
    let (admin_status, _, admin_body) = http_get(OTHER, admin_addr, "/v1/server", None);
    let outcomes = [
        (
            "native",
            closed_without_a_byte(connect_from(OTHER, native_addr), &hello),
        ),
        (
            "original",
            closed_without_a_byte(connect_from(OTHER, original_addr), &original_read),
        ),
        (
            "NBD",
            closed_without_a_byte(connect_from(OTHER, nbd_addr), &[]),
        ),
        (
            "NVMe/TCP",
            closed_without_a_byte(connect_from(OTHER, nvme_addr), &ic_req),
        ),
        (
            "admin",
            admin_status == 403 && admin_body.contains("allow-list"),
        ),
    ];
    let let_in: Vec<&str> = outcomes
        .iter()
        .filter(|(_, refused)| !refused)
        .map(|(name, _)| *name)
        .collect();
    assert!(let_in.is_empty(), "127.0.0.2 was served by {let_in:?}");

    // From 127.0.0.1: served, by the real clients.
    let mut client = Client::connect(native_addr).unwrap_or_else(|e| panic!("native: {e}"));
    client
        .write(1, 0, &[0xab; 4096])
        .unwrap_or_else(|e| panic!("{e}"));
    let read = original_call(original_addr, Opcode::Read, 0, &[0; 4096]);
    assert_eq!(read.as_deref(), Some(&[0xab; 4096][..]));
    let info = tool("nbdinfo")
        .arg(format!("nbd://{nbd_addr}/ns1"))
        .output()
        .unwrap_or_else(|e| panic!("nbdinfo: {e}"));
    assert!(
        info.status.success(),
        "nbdinfo: {}",
        String::from_utf8_lossy(&info.stderr)
    );
    NvmeTcpController::attach(
        nvme_addr,
        NvmeTcpOptions::new(HOST_READER, reflex_server::config::NVME_TCP_DEFAULT_NQN),
        1,
    )
    .unwrap_or_else(|e| panic!("NVMe/TCP attach: {e}"));
    let (status, _, body) = http_get(SERVED, admin_addr, "/v1/server", None);
    assert_eq!(status, 200, "{body}");

    // Each refusal counted once, per listener, with its reason.
    let api = Api::new(admin_addr);
    for listener in [
        format!("native:{}", native_addr.port()),
        format!("original:{}", original_addr.port()),
        format!("nbd:{}", nbd_addr.port()),
        format!("nvme_tcp:{}", nvme_addr.port()),
        "admin".to_string(),
    ] {
        let labels = [("listener", listener.as_str()), ("reason", "not_allowed")];
        let value = wait_for_metric(&api, "reflex_connections_refused_total", &labels, 1.0);
        assert_eq!(value, 1.0, "{listener}");
    }
    let text = api.get("/metrics").text;
    assert!(
        text.contains("# TYPE reflex_connections_refused_total counter"),
        "{text}"
    );
    admin_common::promtool_accepts(&text);
}

// ---------------------------------------------------------------------------------------------
// The admin API's token

const TOKEN: &str = "s3cret-t0ken-for-the-admin-api";

fn token_config(dir: &std::path::Path) -> Config {
    let token_file = dir.join("admin.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap_or_else(|e| panic!("{e}"));
    let mut config = common::config(vec![common::namespace(1, "mem:16M", None)]);
    config.admin = AdminConfig {
        stats_window: Duration::from_millis(200),
        token_file: Some(token_file.display().to_string()),
        // Only 127.0.0.1 goes without the token here, so 127.0.0.2 stands for a peer that
        // must present it.
        token_exempt: allow_loopback_one().unwrap_or_default(),
        ..AdminConfig::loopback()
    };
    config
}

#[test]
fn the_admin_api_asks_for_its_token_from_peers_outside_the_exempt_list() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let server = common::start(token_config(dir.path()));
    let admin = server
        .admin_addr()
        .unwrap_or_else(|| panic!("no admin API"));

    let (status, _, body) = http_get(SERVED, admin, "/v1/server", None);
    assert_eq!(status, 200, "exempt peer: {body}");
    for authorization in [
        None,
        Some("Bearer wrong".to_string()),
        Some(format!("Bearer {TOKEN}x")),
        Some(format!("Basic {TOKEN}")),
        Some(format!("bearer{TOKEN}")),
    ] {
        let (status, head, body) = http_get(OTHER, admin, "/v1/tenants", authorization.as_deref());
        assert_eq!(status, 401, "{authorization:?}: {body}");
        let error: serde_json::Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert!(
            error["error"]
                .as_str()
                .is_some_and(|text| text.contains("token")),
            "{body}"
        );
        assert!(
            head.to_ascii_lowercase()
                .contains("www-authenticate: bearer"),
            "{head}"
        );
    }
    let bearer = format!("Bearer {TOKEN}");
    let (status, _, body) = http_get(OTHER, admin, "/v1/server", Some(&bearer));
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = http_get(OTHER, admin, "/metrics", Some(&bearer));
    assert_eq!(status, 200, "{body}");

    let api = Api::new(admin);
    let labels = [("listener", "admin"), ("reason", "unauthorized")];
    assert_eq!(
        wait_for_metric(&api, "reflex_connections_refused_total", &labels, 5.0),
        5.0
    );
}

#[test]
fn a_remote_admin_api_without_a_token_is_refused_at_start() {
    let mut config = common::config(vec![common::namespace(1, "mem:16M", None)]);
    config.admin = AdminConfig {
        allow_remote: true,
        ..AdminConfig::loopback()
    };
    let error = Server::start(config)
        .err()
        .unwrap_or_else(|| panic!("allow_remote without a token was accepted"));
    assert!(error.to_string().contains("token_file"), "{error}");
}

// ---------------------------------------------------------------------------------------------
// The binary, configured from a file

/// `reflexd --config FILE` with the access keys in TOML: the native port's allow-list and a
/// read-only tenant on an NBD export, checked with a peer from 127.0.0.2 and with nbdsh.
#[test]
fn the_binary_reads_the_access_keys_from_its_configuration_file() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let config = format!(
        r#"
port = 0
allow = ["127.0.0.1/32", "::1/128"]
threads = 2
arena_bytes_per_thread = "8M"

[nbd]
port = 0
allow = ["127.0.0.0/8"]

[[nbd.export]]
name = "viewer"
namespace = 1
tenant = "viewer"

[nvme_tcp]
enabled = false

[[original_ports]]
port = 0
namespace = 1
allow = ["10.0.0.0/8"]

[admin]
enabled = false

[[namespace]]
id = 1
backend = "mem:16M"
profile = "{profile}"

[[tenant]]
name = "viewer"
class = "be"
access = "read-only"
range_offset = "1M"
range_size = "1M"
"#,
        profile = profile("device-a-small.toml")
    );
    let path = dir.path().join("reflexd.toml");
    std::fs::write(&path, config).unwrap_or_else(|e| panic!("{e}"));
    let (mut child, lines) = common::spawn_reflexd(&path, false);
    let serving = common::wait_for_line(&lines, "reflexd serving");
    let address = |key: &str| -> SocketAddr {
        common::log_field(&serving, key).unwrap_or_else(|| panic!("no {key} in {serving:?}"))
    };
    let (native_addr, nbd_addr) = (address("native"), address("nbd"));
    let log = std::thread::spawn(move || lines.into_iter().collect::<Vec<String>>());

    let hello = native::RequestHeader::read(1, 1, 0, 4096).to_bytes();
    let refused = closed_without_a_byte(connect_from(OTHER, native_addr), &hello);
    let served = Client::connect(native_addr).is_ok();
    let results = nbdsh(
        &format!("nbd://{nbd_addr}/viewer"),
        &[
            (
                "write",
                &format!("h.pwrite(b'\\x01' * 4096, {RANGE_OFFSET})"),
            ),
            ("read_outside", "h.pread(4096, 0)"),
            ("read_inside", &format!("h.pread(4096, {RANGE_OFFSET})")),
        ],
    );
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let exit = child.wait().unwrap_or_else(|e| panic!("wait: {e}"));
    let log = log.join().unwrap_or_default();
    assert!(refused, "the native allow-list let 127.0.0.2 in");
    assert!(served, "the native allow-list refused 127.0.0.1");
    assert_eq!(results["write"], EPERM, "{results}");
    assert_eq!(results["read_outside"], EPERM, "{results}");
    assert_eq!(results["read_inside"], 0, "{results}");
    assert!(exit.success(), "reflexd exited with {exit}");
    assert!(
        log.iter().any(|line| line.contains("connection refused")
            && line.contains("127.0.0.2")
            && line.contains("native:")),
        "the refusal is logged with the peer and the listener:\n{}",
        log.join("\n")
    );
    assert!(
        log.iter().any(|line| line.contains("request refused")
            && line.contains("viewer")
            && line.contains("127.0.0.1")),
        "the refused request is logged with the peer and the tenant:\n{}",
        log.join("\n")
    );
}
