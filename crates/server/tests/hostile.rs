//! Issue 9, "hard to break": regression tests for what one hostile or broken client could do
//! to reflexd before, each checked against a real server on loopback.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::{Raw, config, namespace, pattern, start};
use reflex_client::{Client, ClientError, RegisterBody, Status, TenantClassRequest};
use reflex_proto::native::{self, RequestHeader};
use reflex_proto::nbd;
use reflex_proto::original;
use reflex_server::{Config, OriginalPortConfig};

const MIB: u32 = 1 << 20;

fn profile_path() -> String {
    format!(
        "{}/../../profiles/device-a-small.toml",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// A connection whose receive buffer is as small as the kernel allows.
fn tiny_receive_buffer(stream: &TcpStream) {
    let size: libc::c_int = 4096;
    // SAFETY: setsockopt with a pointer to a live c_int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
}

/// A fresh native client does real I/O: the server still serves newcomers.
fn fresh_native_client_is_served(addr: SocketAddr) {
    let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("fresh client: {e}"));
    let data = pattern(3, 4096);
    client
        .write(1, 64 << 20, &data)
        .unwrap_or_else(|e| panic!("fresh write: {e}"));
    let mut back = vec![0u8; 4096];
    client
        .read(1, 64 << 20, &mut back)
        .unwrap_or_else(|e| panic!("fresh read: {e}"));
    assert!(back == data);
}

/// A minimal blocking NBD client over the proto crate's sans-IO handshake.
struct NbdClient {
    stream: TcpStream,
}

impl NbdClient {
    fn open(addr: SocketAddr, export: &str) -> NbdClient {
        let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("nbd connect: {e}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut handshake = nbd::ClientHandshake::new(export).unwrap_or_else(|e| panic!("{e:?}"));
        let mut buffer = vec![0u8; 64 << 10];
        let mut unparsed: Vec<u8> = Vec::new();
        while handshake.outcome().is_none() {
            let output = handshake.pending_output().to_vec();
            if !output.is_empty() {
                stream.write_all(&output).unwrap_or_else(|e| panic!("{e}"));
                handshake.consume_output(output.len());
                continue;
            }
            let n = match stream.read(&mut buffer) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => panic!("nbd handshake read: {e}"),
            };
            assert!(
                n > 0,
                "server closed during the handshake after {} bytes",
                unparsed.len()
            );
            unparsed.extend_from_slice(&buffer[..n]);
            let used = handshake
                .handle_bytes(&unparsed)
                .unwrap_or_else(|e| panic!("{e:?}"));
            unparsed.drain(..used);
        }
        NbdClient { stream }
    }

    fn send_read(&mut self, cookie: u64, offset: u64, length: u32) {
        let request = nbd::read_request(cookie, offset, length);
        self.stream
            .write_all(&request)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// One simple reply: its cookie, error and (for a successful READ of `length`) its data.
    fn reply(&mut self, length: u32) -> (u64, u32, Vec<u8>) {
        let mut header = [0u8; nbd::SIMPLE_REPLY_SIZE];
        self.stream
            .read_exact(&mut header)
            .unwrap_or_else(|e| panic!("nbd reply: {e}"));
        let Ok(Some((reply, _))) = nbd::decode_simple_reply(&header) else {
            panic!("malformed NBD reply {header:?}");
        };
        let mut data = Vec::new();
        if reply.error == 0 {
            data = vec![0u8; length as usize];
            self.stream
                .read_exact(&mut data)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        (reply.cookie, reply.error, data)
    }
}

fn nbd_addr(server: &reflex_server::ServerHandle) -> SocketAddr {
    server
        .nbd_addr()
        .unwrap_or_else(|| panic!("NBD is enabled in the test config"))
}

// ----- Item 1: read-only on the original-protocol port --------------------------------------

fn original_write(stream: &mut TcpStream, lba: u64, data: &[u8]) {
    let header = original::Header {
        opcode: original::Opcode::Write,
        handle: [7; 8],
        lba,
        lba_count: (data.len() / 512) as u32,
    };
    stream
        .write_all(&header.to_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    let _ = stream.write_all(data);
}

fn closed_by_server(stream: &mut TcpStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut byte = [0u8; 64];
    loop {
        match stream.read(&mut byte) {
            Ok(0) => return true,
            Ok(n) => {
                eprintln!("expected a close, received {n} bytes");
                return false;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                let closed = matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
                );
                if !closed {
                    eprintln!("expected a close, the read failed: {e}");
                }
                return closed;
            }
        }
    }
}

#[test]
fn original_protocol_writes_to_a_read_only_namespace_are_refused_unwritten() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("ro");
    let original_bytes = pattern(1, 1 << 20);
    std::fs::write(&path, &original_bytes).unwrap_or_else(|e| panic!("{e}"));
    let mut ro_mem = namespace(3, "mem:16M", None);
    ro_mem.read_only = true;
    let mut ro_file = namespace(4, &format!("file:{}", path.display()), None);
    ro_file.read_only = true;
    let server = start(Config {
        original_ports: Some(vec![
            OriginalPortConfig::new(0, 3),
            OriginalPortConfig::new(0, 4),
        ]),
        ..config(vec![ro_mem, ro_file])
    });
    for &(namespace_id, addr) in server.original_addrs() {
        let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("{e}"));
        original_write(&mut stream, 8, &pattern(2, 4096));
        assert!(
            closed_by_server(&mut stream),
            "namespace {namespace_id}: a write to a read-only namespace must not be acknowledged"
        );
    }
    // Nothing changed: the memory namespace still reads zeroes, the file its old bytes.
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 4096];
    client
        .read(3, 8 * 512, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(back.iter().all(|&b| b == 0));
    drop(client);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let after = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(after == original_bytes, "the read-only file changed");
}

// ----- Item 2: a client that does not read its answers --------------------------------------

/// The hostile client's server: one thread, the default 32 MiB arena and window 128, so
/// one connection's pipelined 1 MiB READs could take the whole arena without fair shares.
fn hog_config() -> Config {
    Config {
        threads: 1,
        window: 128,
        arena_bytes_per_thread: 32 << 20,
        connections_per_thread_max: 256,
        requests_per_thread_max: 4096,
        ..config(vec![namespace(1, "mem:128M", None)])
    }
}

#[test]
fn a_native_client_that_never_reads_cannot_starve_the_others() {
    let server = start(hog_config());
    let mut hog = TcpStream::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    tiny_receive_buffer(&hog);
    let mut bytes = Vec::new();
    for id in 0..128u64 {
        bytes.extend_from_slice(&RequestHeader::read(id, 1, 0, MIB).to_bytes());
    }
    hog.write_all(&bytes).unwrap_or_else(|e| panic!("{e}"));
    // Let the server take them in and fill what it lets this connection hold.
    std::thread::sleep(Duration::from_millis(300));
    fresh_native_client_is_served(server.native_addr());
    let mut session = NbdClient::open(nbd_addr(&server), "ns1");
    session.send_read(1, 4096, 4096);
    let (cookie, error, _) = session.reply(4096);
    assert_eq!((cookie, error), (1, 0));
    drop(hog);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn an_nbd_client_that_never_reads_cannot_starve_the_others() {
    let server = start(hog_config());
    let mut hog = NbdClient::open(nbd_addr(&server), "ns1");
    tiny_receive_buffer(&hog.stream);
    for cookie in 0..40 {
        hog.send_read(cookie, 0, MIB);
    }
    std::thread::sleep(Duration::from_millis(300));
    fresh_native_client_is_served(server.native_addr());
    let mut session = NbdClient::open(nbd_addr(&server), "ns1");
    session.send_read(9, 0, 4096);
    assert_eq!(session.reply(4096).1, 0);
    drop(hog);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn stalled_large_writes_cannot_take_every_buffer() {
    let server = start(hog_config());
    // 40 connections each send a 1 MiB WRITE header and 40,000 bytes of its payload, then
    // stop: 40 MiB of runs would exceed the 32 MiB arena.
    let mut writers = Vec::new();
    for id in 0..40u64 {
        let mut stream = TcpStream::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
        let header = RequestHeader::write(id, 1, id * u64::from(MIB), MIB, false);
        stream
            .write_all(&header.to_bytes())
            .unwrap_or_else(|e| panic!("{e}"));
        stream
            .write_all(&vec![0xAB; 40_000])
            .unwrap_or_else(|e| panic!("{e}"));
        writers.push(stream);
    }
    std::thread::sleep(Duration::from_millis(300));
    fresh_native_client_is_served(server.native_addr());
    let mut session = NbdClient::open(nbd_addr(&server), "ns1");
    session.send_read(2, 0, 4096);
    assert_eq!(session.reply(4096).1, 0);
    drop(writers);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_client_that_stops_reading_is_closed_after_the_send_timeout() {
    let mut config = hog_config();
    config.timeouts.send = Duration::from_millis(500);
    let server = start(config);
    let mut hog = TcpStream::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    tiny_receive_buffer(&hog);
    let mut bytes = Vec::new();
    for id in 0..64u64 {
        bytes.extend_from_slice(&RequestHeader::read(id, 1, 0, MIB).to_bytes());
    }
    hog.write_all(&bytes).unwrap_or_else(|e| panic!("{e}"));
    // The server gives up on it within the timeout (the sweep runs every 100 ms).
    std::thread::sleep(Duration::from_secs(2));
    drop(hog);
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let timed_out: u64 = stats.iter().map(|s| s.connections_timed_out).sum();
    assert_eq!(
        timed_out, 1,
        "the send timeout did not close the connection"
    );
}

// ----- Item 3: idle connections ----------------------------------------------------------------

#[test]
fn idle_connections_cannot_lock_out_new_clients() {
    let server = start(Config {
        threads: 1,
        connections_per_thread_max: 64,
        ..config(vec![namespace(1, "mem:128M", None)])
    });
    // Twice the table of connections that send two bytes and wait, on every port.
    let mut idle = Vec::new();
    for round in 0..128 {
        let addr = match round % 3 {
            0 => server.native_addr(),
            1 => nbd_addr(&server),
            _ => server.original_addrs()[0].1,
        };
        if let Ok(mut stream) = TcpStream::connect(addr) {
            let _ = stream.write_all(&[0x52, 0x46]);
            idle.push(stream);
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    fresh_native_client_is_served(server.native_addr());
    let mut session = NbdClient::open(nbd_addr(&server), "ns1");
    session.send_read(3, 0, 4096);
    assert_eq!(session.reply(4096).1, 0);
    drop(idle);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_connection_that_sends_no_request_is_closed_after_the_handshake_timeout() {
    let mut config = config(vec![namespace(1, "mem:16M", None)]);
    config.timeouts.handshake = Duration::from_millis(300);
    let server = start(config);
    let mut idle = TcpStream::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    idle.write_all(&[0x52, 0x46])
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(closed_by_server(&mut idle));
    // A connection that completed a request is not subject to it.
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(Duration::from_millis(800));
    let mut back = vec![0u8; 4096];
    client
        .read(1, 0, &mut back)
        .unwrap_or_else(|e| panic!("an established client was closed: {e}"));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn an_idle_nbd_session_is_not_closed_by_the_handshake_timeout() {
    let mut config = config(vec![namespace(1, "mem:16M", None)]);
    config.timeouts.handshake = Duration::from_millis(300);
    let server = start(config);
    let mut session = NbdClient::open(nbd_addr(&server), "ns1");
    std::thread::sleep(Duration::from_millis(800));
    session.send_read(4, 0, 4096);
    assert_eq!(session.reply(4096).1, 0);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

// ----- Item 4: tenants -------------------------------------------------------------------------

fn qos_config() -> Config {
    let mut namespace = namespace(1, "mem:64M", None);
    namespace.profile = Some(profile_path());
    Config {
        tenant_orphan_grace: Duration::from_millis(300),
        ..config(vec![namespace])
    }
}

fn be(namespace_id: u32) -> RegisterBody {
    RegisterBody {
        namespace_id,
        class: TenantClassRequest::BestEffort,
        read_only: false,
        handle: 0,
    }
}

#[test]
fn tenant_handles_are_unguessable_and_only_their_owner_unregisters() {
    let server = start(qos_config());
    let mut owner = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let first = owner.register(&be(1)).unwrap_or_else(|e| panic!("{e}"));
    let second = owner.register(&be(1)).unwrap_or_else(|e| panic!("{e}"));
    // Not small sequential numbers: a handle says nothing about the next one.
    assert!(first > 1 << 20 && second > 1 << 20, "{first} {second}");
    assert!(second.abs_diff(first) > 1 << 20, "{first} {second}");
    let mut other = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    match other.unregister(first) {
        Err(ClientError::Status {
            status: Status::Permission,
            ..
        }) => {}
        result => panic!("another connection unregistered the tenant: {result:?}"),
    }
    // Knowing the handle is the capability to use it.
    other.bind(first).unwrap_or_else(|e| panic!("{e}"));
    assert!(server.tenant(first).is_some());
    owner.unregister(first).unwrap_or_else(|e| panic!("{e}"));
    assert!(server.tenant(first).is_none());
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn one_connection_cannot_exhaust_the_tenant_table() {
    let server = start(qos_config());
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..16 {
        client.register(&be(1)).unwrap_or_else(|e| panic!("{e}"));
    }
    match client.register(&be(1)) {
        Err(ClientError::Refused { reason }) => assert!(reason.contains("owns 16"), "{reason}"),
        result => panic!("a 17th tenant from one connection: {result:?}"),
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn tenants_of_a_closed_connection_are_unregistered_after_the_grace_period() {
    let server = start(qos_config());
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let kept = client.register(&be(1)).unwrap_or_else(|e| panic!("{e}"));
    let dropped = client.register(&be(1)).unwrap_or_else(|e| panic!("{e}"));
    // Another connection uses `kept`: it outlives its owner.
    let mut user = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    user.bind(kept).unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 4096];
    user.read(1, 0, &mut back).unwrap_or_else(|e| panic!("{e}"));
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(20);
    while server.tenant(dropped).is_some() {
        assert!(
            Instant::now() < deadline,
            "the orphan was never unregistered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        server.tenant(kept).is_some(),
        "a tenant in use was unregistered"
    );
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

// ----- Item 5: admission -----------------------------------------------------------------------

#[test]
fn admission_refuses_slos_the_profile_cannot_judge() {
    let server = start(qos_config());
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let lc = |latency_us_p95| RegisterBody {
        namespace_id: 1,
        class: TenantClassRequest::LatencyCritical {
            latency_us_p95,
            iops: 1000,
            read_percent: 100,
        },
        read_only: false,
        handle: 0,
    };
    match client.register(&lc(1)) {
        Err(ClientError::Refused { reason }) => {
            assert!(
                reason.contains("tighter than the device profile"),
                "{reason}"
            )
        }
        result => panic!("a 1 µs SLO was admitted: {result:?}"),
    }
    match client.register(&lc(u32::MAX)) {
        Err(ClientError::Refused { reason }) => assert!(reason.contains("60 s"), "{reason}"),
        result => panic!("an SLO of 2^32-1 µs was admitted: {result:?}"),
    }
    let plan = server
        .qos_plan(1)
        .unwrap_or_else(|| panic!("a QoS namespace"));
    assert_eq!(plan.lc_tenants, 0, "nothing was budgeted");
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

// ----- Item 7: framing errors, device failures -------------------------------------------------

#[test]
fn a_framing_error_answers_what_came_before_it() {
    let server = start(config(vec![namespace(1, "mem:16M", None)]));
    let mut raw = Raw::connect(server.native_addr());
    let mut bytes = RequestHeader::read(5, 1, 0, 4096).to_bytes().to_vec();
    bytes.extend_from_slice(b"XXXX not a native request header, long enough to decode");
    raw.send_bytes(&bytes);
    let (response, data) = raw.receive();
    assert_eq!(response.request_id, 5);
    assert_eq!(response.status().ok(), Some(native::Status::Ok));
    assert_eq!(data.len(), 4096);
    assert!(raw.is_closed_by_server());
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn device_errors_reach_every_protocol_and_spare_other_namespaces() {
    let failing = namespace(1, "fault(read_error_rate=100%):mem:16M", None);
    let healthy = namespace(2, "mem:16M", None);
    let server = start(config(vec![failing, healthy]));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 4096];
    match client.read(1, 0, &mut back) {
        Err(ClientError::Status {
            status: Status::IoError,
            ..
        }) => {}
        result => panic!("native read of a failing device: {result:?}"),
    }
    client
        .read(2, 0, &mut back)
        .unwrap_or_else(|e| panic!("the healthy namespace failed too: {e}"));
    client
        .write(1, 0, &pattern(4, 4096))
        .unwrap_or_else(|e| panic!("writes do not fail on this plan: {e}"));
    let mut session = NbdClient::open(nbd_addr(&server), "ns1");
    session.send_read(11, 0, 4096);
    assert_eq!(session.reply(4096).1, nbd::Errno::Io as u32);
    let mut healthy_session = NbdClient::open(nbd_addr(&server), "ns2");
    healthy_session.send_read(12, 0, 4096);
    assert_eq!(healthy_session.reply(4096).1, 0);
    // The original protocol has no status: the connection closes.
    let addr = server.original_addrs()[0].1;
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("{e}"));
    let header = original::Header {
        opcode: original::Opcode::Read,
        handle: [1; 8],
        lba: 0,
        lba_count: 8,
    };
    stream
        .write_all(&header.to_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(closed_by_server(&mut stream));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_stalled_device_answers_with_an_error_after_the_device_timeout() {
    let mut config = config(vec![
        namespace(1, "fault(stall):mem:16M", None),
        namespace(2, "mem:16M", None),
    ]);
    config.timeouts.device = Duration::from_millis(300);
    let server = start(config);
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 4096];
    match client.read(1, 0, &mut back) {
        Err(ClientError::Status {
            status: Status::IoError,
            ..
        }) => {}
        result => panic!("a read of a stalled device: {result:?}"),
    }
    // Meanwhile the other namespace serves.
    client
        .read(2, 0, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    // The stall ends: the orphaned operation completes and shutdown is clean.
    let controls = server
        .fault_controls(1)
        .unwrap_or_else(|| panic!("namespace 1 is a fault device"));
    controls.set_stalled(false);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

// ----- Idle connections give their receive buffers back (issue 10) ----------------------------

#[test]
fn an_idle_connection_parks_without_its_buffer_and_wakes_on_the_next_request() {
    let mut config = config(vec![namespace(1, "mem:16M", None)]);
    config.recv_buffer_park_after = Duration::from_millis(100);
    let server = start(config);
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let data = pattern(12, 8192);
    client.write(1, 0, &data).unwrap_or_else(|e| panic!("{e}"));
    for _ in 0..3 {
        // Idle long enough to park (the sweep runs every 100 ms), then a request wakes it.
        std::thread::sleep(Duration::from_millis(400));
        let mut back = vec![0u8; 8192];
        client
            .read(1, 0, &mut back)
            .unwrap_or_else(|e| panic!("a parked connection did not wake: {e}"));
        assert!(back == data);
    }
    drop(client);
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let parked: u64 = stats.iter().map(|s| s.connections_parked).sum();
    assert!(parked >= 3, "parked {parked} times");
}

/// A failing device is logged once per burst with a count, not once per request (issue 9
/// item 7): the real binary's log, read back.
#[test]
fn a_failing_device_is_logged_once_per_burst() {
    use std::io::BufRead;
    use std::process::Stdio;
    let mut child = common::reflexd_command()
        .args(["--port", "0", "--no-original", "--no-nbd", "--threads", "1"])
        .args(["--namespace", "1=fault(read_error_rate=100%):mem:16M"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn reflexd: {e}"));
    let Some(stderr) = child.stderr.take() else {
        panic!("no stderr");
    };
    let (lines_tx, lines_rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines_tx.send(line);
        }
    });
    let mut log = Vec::new();
    let addr: SocketAddr = loop {
        let line = lines_rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("reflexd did not start: {e}"));
        let found = line.split("native=").nth(1).map(|rest| {
            let text = rest.split_whitespace().next().unwrap_or_default();
            text.parse()
                .unwrap_or_else(|e| panic!("address {text:?}: {e}"))
        });
        log.push(line);
        if let Some(addr) = found {
            break addr;
        }
    };
    let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 4096];
    for _ in 0..200 {
        assert!(client.read(1, 0, &mut back).is_err());
    }
    // The burst ends after a second without failures; its summary line follows.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !log.iter().any(|l| l.contains("device I/O failures ended")) {
        let remaining = deadline.saturating_duration_since(Instant::now());
        match lines_rx.recv_timeout(remaining) {
            Ok(line) => log.push(line),
            Err(_) => panic!("no end-of-burst line:\n{}", log.join("\n")),
        }
    }
    drop(client);
    let _ = child.kill();
    let _ = child.wait();
    let failed = log
        .iter()
        .filter(|l| l.contains("device I/O failed"))
        .count();
    assert_eq!(failed, 1, "one line for the burst:\n{}", log.join("\n"));
    let summary = log
        .iter()
        .find(|l| l.contains("device I/O failures ended"))
        .unwrap_or_else(|| panic!("no summary"));
    assert!(
        summary.contains("burst_failures=200"),
        "the summary counts every failure: {summary}"
    );
}
