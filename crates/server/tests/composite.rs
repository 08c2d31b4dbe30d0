//! Composite namespaces on the real server over loopback TCP (issue 11): a namespace striped
//! over two files and one concatenated over two others, written and read back over the
//! native protocol and NBD across stripe and member boundaries, and the member files read
//! directly to check that every byte landed on the member and offset the layout names.
//! Bad composite configurations are refused with a reason, by the library and by `reflexd`.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use common::{config, namespace, pattern, reflexd_command, start};
use reflex_client::Client;
use reflex_proto::nbd::{self, CommandType, RequestHeader};
use reflex_server::{Config, NamespaceConfig, Server};

const K: u64 = 1024;
const STRIPE: u64 = 64 * K;
const STRIPE_MEMBER_BYTES: u64 = 1024 * K;
const CONCAT_FIRST_BYTES: u64 = 256 * K;
const CONCAT_SECOND_BYTES: u64 = 512 * K;

/// Namespaces 1 and 2 (files `a`, `b`) striped as 3; 4 and 5 (`c`, `d`) concatenated as 6.
fn composite_config(dir: &Path) -> Config {
    let file = |name: &str| format!("file:{}", dir.join(name).display());
    config(vec![
        namespace(1, &file("a"), Some(STRIPE_MEMBER_BYTES)),
        namespace(2, &file("b"), Some(STRIPE_MEMBER_BYTES)),
        NamespaceConfig::new(3, "stripe:64K:1,2"),
        namespace(4, &file("c"), Some(CONCAT_FIRST_BYTES)),
        namespace(5, &file("d"), Some(CONCAT_SECOND_BYTES)),
        NamespaceConfig::new(6, "concat:4,5"),
    ])
}

/// Where a byte of the striped namespace lives: the member file and offset (written out
/// here independently of `reflex_dataplane::composite`).
fn striped_home(offset: u64) -> (&'static str, u64) {
    let stripe = offset / STRIPE;
    let file = if stripe.is_multiple_of(2) { "a" } else { "b" };
    (file, (stripe / 2) * STRIPE + offset % STRIPE)
}

fn concat_home(offset: u64) -> (&'static str, u64) {
    if offset < CONCAT_FIRST_BYTES {
        ("c", offset)
    } else {
        ("d", offset - CONCAT_FIRST_BYTES)
    }
}

/// Checks that `data`, written at `offset` of a composite namespace, is in the member files
/// where `home` says each byte lives.
fn check_files(dir: &Path, home: fn(u64) -> (&'static str, u64), offset: u64, data: &[u8]) {
    let files: std::collections::HashMap<&str, Vec<u8>> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|name| {
            let bytes = std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, bytes)
        })
        .collect();
    for (index, byte) in data.iter().enumerate() {
        let (name, at) = home(offset + index as u64);
        assert_eq!(
            files[name][at as usize],
            *byte,
            "composite byte {} belongs at {name}[{at}]",
            offset + index as u64
        );
    }
}

/// A minimal NBD client: the EXPORT_NAME handshake, then simple replies.
struct Nbd {
    stream: TcpStream,
    cookie: u64,
}

impl Nbd {
    fn connect(addr: SocketAddr, export: &str) -> (Nbd, u64) {
        let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect: {e}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut greeting = vec![0u8; nbd::GREETING_SIZE];
        stream
            .read_exact(&mut greeting)
            .unwrap_or_else(|e| panic!("greeting: {e}"));
        assert_eq!(greeting[..8], nbd::NBD_MAGIC.to_be_bytes());
        let flags = nbd::client_flags::FIXED_NEWSTYLE | nbd::client_flags::NO_ZEROES;
        let mut bytes = flags.to_be_bytes().to_vec();
        bytes.extend_from_slice(&nbd::IHAVEOPT.to_be_bytes());
        bytes.extend_from_slice(&nbd::option::EXPORT_NAME.to_be_bytes());
        bytes.extend_from_slice(&(export.len() as u32).to_be_bytes());
        bytes.extend_from_slice(export.as_bytes());
        stream.write_all(&bytes).unwrap_or_else(|e| panic!("{e}"));
        let mut answer = [0u8; 10];
        stream
            .read_exact(&mut answer)
            .unwrap_or_else(|e| panic!("export {export}: {e}"));
        let size = u64::from_be_bytes(answer[..8].try_into().unwrap_or_default());
        (Nbd { stream, cookie: 1 }, size)
    }

    /// One request and its simple reply: the error, and the READ data.
    fn call(
        &mut self,
        command: CommandType,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> (u32, Vec<u8>) {
        self.cookie += 1;
        let header = RequestHeader {
            flags: 0,
            command_raw: command.as_u16(),
            cookie: self.cookie,
            offset_bytes: offset,
            length_bytes: length,
        };
        let mut bytes = header.to_bytes().to_vec();
        bytes.extend_from_slice(payload);
        self.stream
            .write_all(&bytes)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut reply = vec![0u8; nbd::SIMPLE_REPLY_SIZE];
        self.stream
            .read_exact(&mut reply)
            .unwrap_or_else(|e| panic!("reply: {e}"));
        assert_eq!(reply[..4], nbd::SIMPLE_REPLY_MAGIC.to_be_bytes());
        let error = u32::from_be_bytes(reply[4..8].try_into().unwrap_or_default());
        assert_eq!(
            u64::from_be_bytes(reply[8..16].try_into().unwrap_or_default()),
            self.cookie
        );
        let mut data = Vec::new();
        if command == CommandType::Read && error == 0 {
            data = vec![0u8; length as usize];
            self.stream
                .read_exact(&mut data)
                .unwrap_or_else(|e| panic!("read data: {e}"));
        }
        (error, data)
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (error, _) = self.call(CommandType::Write, offset, data.len() as u32, data);
        assert_eq!(error, 0, "NBD WRITE {offset}+{}", data.len());
    }

    fn read(&mut self, offset: u64, length: u32) -> Vec<u8> {
        let (error, data) = self.call(CommandType::Read, offset, length, &[]);
        assert_eq!(error, 0, "NBD READ {offset}+{length}");
        data
    }

    fn flush(&mut self) {
        let (error, _) = self.call(CommandType::Flush, 0, 0, &[]);
        assert_eq!(error, 0, "NBD FLUSH");
    }
}

#[test]
fn bytes_written_to_composite_namespaces_land_on_the_member_files_the_layout_names() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let server = start(composite_config(dir.path()));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let sizes: Vec<(u32, u64)> = client
        .namespaces()
        .iter()
        .map(|namespace| (namespace.id, namespace.size_bytes))
        .collect();
    assert!(sizes.contains(&(3, 2 * STRIPE_MEMBER_BYTES)), "{sizes:?}");
    assert!(
        sizes.contains(&(6, CONCAT_FIRST_BYTES + CONCAT_SECOND_BYTES)),
        "{sizes:?}"
    );

    // Native: 136 KiB from 60 KiB crosses the stripe boundaries at 64 and 128 KiB (pieces on
    // a, b, a, b); 8 KiB across the concatenation's member boundary.
    let striped = pattern(1, 136 * 1024);
    client
        .write(3, 60 * K, &striped)
        .unwrap_or_else(|e| panic!("native write: {e}"));
    let across = pattern(2, 8192);
    client
        .write(6, CONCAT_FIRST_BYTES - 4096, &across)
        .unwrap_or_else(|e| panic!("native write: {e}"));
    // The last stripe of the striped namespace and the concatenation's last block.
    let tail = pattern(3, 4096);
    client
        .write(3, 2 * STRIPE_MEMBER_BYTES - 4096, &tail)
        .unwrap_or_else(|e| panic!("native write: {e}"));
    client
        .write(
            6,
            CONCAT_FIRST_BYTES + CONCAT_SECOND_BYTES - 512,
            &tail[..512],
        )
        .unwrap_or_else(|e| panic!("native write: {e}"));
    client.flush(3).unwrap_or_else(|e| panic!("flush: {e}"));
    client.flush(6).unwrap_or_else(|e| panic!("flush: {e}"));
    let mut back = vec![0u8; striped.len()];
    client
        .read(3, 60 * K, &mut back)
        .unwrap_or_else(|e| panic!("native read: {e}"));
    assert!(back == striped, "the striped range reads back");
    let mut back = vec![0u8; across.len()];
    client
        .read(6, CONCAT_FIRST_BYTES - 4096, &mut back)
        .unwrap_or_else(|e| panic!("native read: {e}"));
    assert_eq!(back, across);
    // Past the end is refused, not split onto nothing.
    assert!(
        client
            .read(3, 2 * STRIPE_MEMBER_BYTES - 512, &mut [0u8; 1024])
            .is_err()
    );

    check_files(dir.path(), striped_home, 60 * K, &striped);
    check_files(
        dir.path(),
        striped_home,
        2 * STRIPE_MEMBER_BYTES - 4096,
        &tail,
    );
    check_files(dir.path(), concat_home, CONCAT_FIRST_BYTES - 4096, &across);
    check_files(
        dir.path(),
        concat_home,
        CONCAT_FIRST_BYTES + CONCAT_SECOND_BYTES - 512,
        &tail[..512],
    );

    // NBD: an unaligned write across the stripe boundary at 128 KiB (read-modify-write of
    // edge sectors on both members), and 12 KiB across the concatenation's boundary.
    let nbd_addr = server.nbd_addr().unwrap_or_else(|| panic!("NBD is on"));
    let (mut nbd, size) = Nbd::connect(nbd_addr, "ns3");
    assert_eq!(size, 2 * STRIPE_MEMBER_BYTES);
    let unaligned = pattern(4, 3000);
    nbd.write(128 * K - 1234, &unaligned);
    nbd.flush();
    assert_eq!(nbd.read(128 * K - 1234, 3000), unaligned);
    // What the native write put around it is untouched.
    let around = nbd.read(60 * K, 136 * 1024);
    let mut expected = striped.clone();
    let start = (128 * K - 1234 - 60 * K) as usize;
    expected[start..start + 3000].copy_from_slice(&unaligned);
    assert!(
        around == expected,
        "NBD reads the native write with the NBD write in it"
    );
    check_files(dir.path(), striped_home, 60 * K, &expected);

    let (mut nbd, size) = Nbd::connect(nbd_addr, "ns6");
    assert_eq!(size, CONCAT_FIRST_BYTES + CONCAT_SECOND_BYTES);
    let concat = pattern(5, 12 * 1024);
    nbd.write(CONCAT_FIRST_BYTES - 8192, &concat);
    nbd.flush();
    assert_eq!(nbd.read(CONCAT_FIRST_BYTES - 8192, 12 * 1024), concat);
    check_files(dir.path(), concat_home, CONCAT_FIRST_BYTES - 8192, &concat);
    // And the native client sees the NBD client's bytes.
    let mut back = vec![0u8; concat.len()];
    client
        .read(6, CONCAT_FIRST_BYTES - 8192, &mut back)
        .unwrap_or_else(|e| panic!("native read: {e}"));
    assert_eq!(back, concat);

    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let io_errors: u64 = stats.iter().map(|core| core.io_errors).sum();
    assert_eq!(io_errors, 0);
}

/// The reason a configuration is refused with.
fn refusal(namespaces: Vec<NamespaceConfig>) -> String {
    match Server::start(config(namespaces)) {
        Ok(_) => panic!("started"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn bad_composite_configurations_are_refused_with_a_reason() {
    let mem = |id| namespace(id, "mem:1M", None);
    let cases: Vec<(Vec<NamespaceConfig>, &str)> = vec![
        (
            vec![mem(1), NamespaceConfig::new(3, "stripe:64K:1,9")],
            "namespace 3: member 9 is not a namespace declared before it",
        ),
        (
            vec![mem(1), mem(2), NamespaceConfig::new(3, "stripe:64K:1,2,1")],
            "member 1 is named twice",
        ),
        (
            vec![mem(1), mem(2), NamespaceConfig::new(3, "stripe:1000:1,2")],
            "stripe of 1000 bytes is not a non-zero multiple of the members' block size (512 bytes)",
        ),
        (
            vec![mem(1), mem(2), NamespaceConfig::new(3, "stripe:2M:1,2")],
            "member 1 (1048576 bytes) is smaller than one stripe",
        ),
        (
            vec![NamespaceConfig::new(3, "concat:1,2"), mem(1), mem(2)],
            "member 1 is not a namespace declared before it",
        ),
        (
            vec![mem(1), mem(2), NamespaceConfig::new(3, "concat:1")],
            "needs at least 2 members, has 1",
        ),
        (
            vec![mem(1), mem(2), NamespaceConfig::new(3, "stripe:64K")],
            "is not `stripe:SIZE:ID,ID,...` or `concat:ID,ID,...`",
        ),
        (
            vec![mem(1), mem(2), NamespaceConfig::new(3, "stripe:64Q:1,2")],
            "stripe size: size \"64Q\" is not a number",
        ),
        (
            vec![
                mem(1),
                mem(2),
                NamespaceConfig::new(3, "concat:1,2"),
                NamespaceConfig::new(4, "concat:3,1"),
            ],
            "member 3 is itself composite",
        ),
        (
            vec![
                mem(1),
                mem(2),
                NamespaceConfig {
                    profile: Some("profiles/device-a-small.toml".into()),
                    ..NamespaceConfig::new(3, "concat:1,2")
                },
            ],
            "a composite namespace takes no profile",
        ),
    ];
    let gold = Config {
        tenants: vec![reflex_server::config::TenantConfig::best_effort("gold")],
        ..config(vec![
            mem(1),
            mem(2),
            NamespaceConfig {
                tenant: Some("gold".into()),
                ..NamespaceConfig::new(3, "concat:1,2")
            },
        ])
    };
    let reason = match Server::start(gold) {
        Ok(_) => panic!("started"),
        Err(error) => error.to_string(),
    };
    assert!(
        reason.contains("tenants are bound to it but not every member has a QoS profile"),
        "{reason}"
    );
    for (namespaces, expected) in cases {
        let reason = refusal(namespaces);
        assert!(
            reason.contains(expected),
            "{reason:?} does not say {expected:?}"
        );
    }
}

#[test]
fn reflexd_takes_composite_namespaces_on_the_command_line_and_refuses_bad_ones() {
    let flag = NamespaceConfig::from_flag("3=stripe:64K:1,2,tenant=gold,name=striped")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(flag.backend, "stripe:64K:1,2");
    assert_eq!(flag.tenant.as_deref(), Some("gold"));
    assert_eq!(flag.name.as_deref(), Some("striped"));
    let flag = NamespaceConfig::from_flag("6=concat:4,5").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(flag.backend, "concat:4,5");

    // The flag as written in the docs serves the striped namespace.
    // (`Daemon` adds the driver flag.)
    let mut flags = vec![
        "--port",
        "0",
        "--no-original",
        "--nbd-port",
        "0",
        "--no-nvme-tcp",
    ];
    flags.extend(["-n", "1=mem:1M", "-n", "2=mem:1M", "-n", "3=stripe:64K:1,2"]);
    let daemon = common::Daemon::spawn(&flags);
    let native: SocketAddr = daemon.field("native");
    let mut client = Client::connect(native).unwrap_or_else(|e| panic!("{e}"));
    let data = pattern(6, 8192);
    client
        .write(3, STRIPE - 4096, &data)
        .unwrap_or_else(|e| panic!("write: {e}"));
    let mut back = vec![0u8; 4096];
    client
        .read(2, 0, &mut back)
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert_eq!(
        back,
        data[4096..],
        "the second half is stripe 1: member 2's first bytes"
    );
    client
        .read(1, STRIPE - 4096, &mut back)
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert_eq!(back, data[..4096]);
    drop(client);
    daemon.terminate();

    // The binary says what is wrong and exits; no panic.
    let output = reflexd_command()
        .args(common::driver_args())
        .args([
            "--port",
            "0",
            "--no-original",
            "--nbd-port",
            "0",
            "--no-nvme-tcp",
        ])
        .args(["-n", "1=mem:1M", "-n", "2=mem:1M", "-n", "3=stripe:64K:1,7"])
        .output()
        .unwrap_or_else(|e| panic!("reflexd: {e}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("namespace 3: member 7 is not a namespace declared before it"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn the_shipped_striped_configuration_admits_its_tenant_on_both_members() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/reflexd-striped.toml");
    let mut config = Config::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
    config.port = 0;
    config.nvme_tcp.enabled = false;
    config.admin = reflex_server::admin::AdminConfig::disabled();
    config.driver = common::driver();
    let server = start(config);
    let client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let size = |id: u32| {
        client
            .namespaces()
            .iter()
            .find(|namespace| namespace.id == id)
            .map(|namespace| namespace.size_bytes)
    };
    assert_eq!(size(3), Some(2 << 30));
    assert_eq!(size(6), Some(512 << 20));
    let mut members: Vec<(u32, reflex_qos::TenantSpec)> = server
        .tenants()
        .into_iter()
        .filter(|tenant| tenant.name == "gold/ns3")
        .map(|tenant| (tenant.namespace_id, tenant.spec))
        .collect();
    members.sort_by_key(|(namespace_id, _)| *namespace_id);
    let half = reflex_qos::TenantSpec::LatencyCritical {
        latency_us_p95: 500,
        iops: 4000,
        read_percent: 100,
    };
    assert_eq!(members, vec![(1, half), (2, half)]);
    drop(client);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_failing_piece_fails_its_request_once_and_the_connection_goes_on() {
    // Member 2 fails every read and write of its first 4 KiB: stripe 1's first bytes.
    let server = start(config(vec![
        namespace(1, "mem:1M", None),
        namespace(
            2,
            "fault(read_error_lba=0-7;write_error_lba=0-7;seed=1):mem:1M",
            None,
        ),
        NamespaceConfig::new(3, "stripe:64K:1,2"),
    ]));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let status = |error: reflex_client::ClientError| error.status();
    // A write across the boundary: its piece on member 1 goes first, member 2's fails; the
    // request gets one answer, an I/O error.
    let data = pattern(7, 8192);
    let written = client.write(3, STRIPE - 4096, &data);
    assert_eq!(
        written.map_err(status),
        Err(Some(reflex_proto::native::Status::IoError))
    );
    let mut back = vec![0u8; 8192];
    let read = client.read(3, STRIPE - 4096, &mut back);
    assert_eq!(
        read.map_err(status),
        Err(Some(reflex_proto::native::Status::IoError))
    );
    // The same connection serves what does not touch the failing sectors, across the next
    // boundary too.
    let data = pattern(8, 8192);
    client
        .write(3, 2 * STRIPE - 4096, &data)
        .unwrap_or_else(|e| panic!("write: {e}"));
    let mut back = vec![0u8; 8192];
    client
        .read(3, 2 * STRIPE - 4096, &mut back)
        .unwrap_or_else(|e| panic!("read: {e}"));
    assert_eq!(back, data);
    drop(client);
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let io_errors: u64 = stats.iter().map(|core| core.io_errors).sum();
    assert_eq!(
        io_errors, 2,
        "one I/O error per failed request, not per piece"
    );
}
