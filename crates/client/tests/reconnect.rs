//! Reconnecting against the real server, started in-process with `reflex_server::Server::start`
//! on a fixed loopback port (a free one learnt by binding port 0 first) so that a second
//! server can take over the same address with the same file. Where a test must decide exactly
//! when a connection breaks — a request swallowed, answers dropped — a small proxy built from
//! std threads sits between client and server. Assertions are on results only: which requests
//! are repeated, which are reported, what data comes back; never on how long anything took.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use reflex_client::{
    Client, ClientError, ClientOptions, Opcode, PipelinedClient, ReconnectPolicy, Status,
    SubmitError,
};
use reflex_proto::native::{REQUEST_HEADER_SIZE, RESPONSE_HEADER_SIZE, ResponseHeader};
use reflex_server::{Config, NamespaceConfig, Server, ServerHandle};

const NAMESPACE: u32 = 1;
const NAMESPACE_SIZE_BYTES: u64 = 16 << 20;
const MIB: usize = 1 << 20;

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    listener.local_addr().expect("local address").port()
}

/// Where a test's server keeps its data: one file, reopened by every server of the test.
struct Backend {
    _dir: tempfile::TempDir,
    spec: String,
}

fn file_backend() -> Backend {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = format!("file:{}", dir.path().join("ns1.img").display());
    Backend { _dir: dir, spec }
}

fn config_on(port: u16, namespace: NamespaceConfig) -> Config {
    Config {
        port,
        window: 16,
        namespaces: vec![namespace],
        ..Config::loopback(Vec::new())
    }
}

fn start_on(port: u16, backend: &Backend) -> ServerHandle {
    let namespace = NamespaceConfig {
        size_bytes: Some(NAMESPACE_SIZE_BYTES),
        ..NamespaceConfig::new(NAMESPACE, backend.spec.clone())
    };
    Server::start(config_on(port, namespace)).unwrap_or_else(|error| panic!("start: {error}"))
}

/// A namespace with a QoS profile, so that tenants can register.
fn start_qos_on(port: u16) -> ServerHandle {
    let profile = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../profiles/device-a-small.toml"
    );
    let namespace = NamespaceConfig {
        size_bytes: Some(NAMESPACE_SIZE_BYTES),
        profile: Some(profile.to_string()),
        ..NamespaceConfig::new(NAMESPACE, "mem:16M")
    };
    Server::start(config_on(port, namespace)).unwrap_or_else(|error| panic!("start: {error}"))
}

fn policy() -> ReconnectPolicy {
    ReconnectPolicy {
        attempts_max: 1000,
        backoff_initial: Duration::from_millis(10),
        backoff_max: Duration::from_millis(200),
        give_up_after: Duration::from_secs(30),
    }
}

fn reconnecting() -> ClientOptions {
    ClientOptions::default().with_reconnect(policy())
}

fn pattern(seed: u8, length: usize) -> Vec<u8> {
    (0..length)
        .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed) ^ (index >> 12) as u8)
        .collect()
}

/// What the proxy does to the connection it carries now; it goes back to forwarding
/// everything once the plan has broken the connection.
#[derive(Debug, Clone, Copy)]
struct BreakPlan {
    /// Server answers passed to the client; later ones are dropped.
    answers_forwarded_max: usize,
    /// Once this many answers came from the server, both sockets are shut down.
    break_after_answers: usize,
}

#[derive(Default)]
struct ProxyState {
    /// Client bytes read and thrown away instead of forwarded, while set.
    swallow_requests: AtomicBool,
    swallowed_bytes: AtomicUsize,
    plan: Mutex<Option<BreakPlan>>,
    answers_seen: AtomicUsize,
    /// Request ids of the answers forwarded while a plan was armed.
    forwarded_ids: Mutex<Vec<u64>>,
    /// Both sockets of every connection, to shut them down.
    sockets: Mutex<Vec<TcpStream>>,
    stopping: AtomicBool,
}

impl ProxyState {
    fn break_all(&self) {
        for socket in self.sockets.lock().expect("sockets").drain(..) {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

/// A TCP proxy in front of `upstream`, one pair of threads per connection.
struct Proxy {
    address: SocketAddr,
    state: Arc<ProxyState>,
}

impl Proxy {
    fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy bind");
        let address = listener.local_addr().expect("proxy address");
        let state = Arc::new(ProxyState::default());
        let accept_state = Arc::clone(&state);
        thread::spawn(move || {
            for client in listener.incoming() {
                if accept_state.stopping.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                // No server: the client sees its connection closed, as with no proxy.
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                serve(&accept_state, client, server);
            }
        });
        Proxy { address, state }
    }

    fn arm(&self, plan: BreakPlan) {
        self.state.answers_seen.store(0, Ordering::SeqCst);
        self.state.forwarded_ids.lock().expect("ids").clear();
        *self.state.plan.lock().expect("plan") = Some(plan);
    }

    fn forwarded_ids(&self) -> Vec<u64> {
        self.state.forwarded_ids.lock().expect("ids").clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stopping.store(true, Ordering::SeqCst);
        self.state.break_all();
        // Wakes the accept loop so it sees `stopping`.
        let _ = TcpStream::connect(self.address);
    }
}

fn serve(state: &Arc<ProxyState>, client: TcpStream, server: TcpStream) {
    let clones = [client.try_clone(), server.try_clone()];
    let [Ok(client_reader), Ok(server_writer)] = clones else {
        return;
    };
    {
        let mut sockets = state.sockets.lock().expect("sockets");
        for socket in [&client, &server] {
            if let Ok(clone) = socket.try_clone() {
                sockets.push(clone);
            }
        }
    }
    let requests_state = Arc::clone(state);
    thread::spawn(move || forward_requests(&requests_state, client_reader, server_writer));
    let answers_state = Arc::clone(state);
    thread::spawn(move || forward_answers(&answers_state, server, client));
}

fn forward_requests(state: &ProxyState, mut client: TcpStream, mut server: TcpStream) {
    let mut buffer = vec![0u8; 256 * 1024];
    loop {
        let received = match client.read(&mut buffer) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Ok(0) | Err(_) => break,
            Ok(received) => received,
        };
        if state.swallow_requests.load(Ordering::SeqCst) {
            state.swallowed_bytes.fetch_add(received, Ordering::SeqCst);
            continue;
        }
        if server.write_all(&buffer[..received]).is_err() {
            break;
        }
    }
    let _ = server.shutdown(Shutdown::Both);
    let _ = client.shutdown(Shutdown::Both);
}

/// Forwards whole answers, so that a plan can drop some and break between two of them.
fn forward_answers(state: &ProxyState, mut server: TcpStream, mut client: TcpStream) {
    let mut header_bytes = [0u8; RESPONSE_HEADER_SIZE];
    loop {
        if server.read_exact(&mut header_bytes).is_err() {
            break;
        }
        let Ok(Some((header, _))) = ResponseHeader::decode(&header_bytes) else {
            break;
        };
        let mut frame = header_bytes.to_vec();
        frame.resize(RESPONSE_HEADER_SIZE + header.length_bytes as usize, 0);
        if server
            .read_exact(&mut frame[RESPONSE_HEADER_SIZE..])
            .is_err()
        {
            break;
        }
        let mut plan = state.plan.lock().expect("plan");
        let Some(armed) = *plan else {
            drop(plan);
            if client.write_all(&frame).is_err() {
                break;
            }
            continue;
        };
        let seen = state.answers_seen.fetch_add(1, Ordering::SeqCst) + 1;
        if seen <= armed.answers_forwarded_max {
            if client.write_all(&frame).is_err() {
                break;
            }
            state
                .forwarded_ids
                .lock()
                .expect("ids")
                .push(header.request_id);
        }
        if seen >= armed.break_after_answers {
            *plan = None;
            drop(plan);
            state.break_all();
            break;
        }
    }
    let _ = client.shutdown(Shutdown::Both);
    let _ = server.shutdown(Shutdown::Both);
}

#[test]
fn a_read_after_a_restart_on_the_same_port_reconnects_and_returns_the_data() {
    let backend = file_backend();
    let port = free_port();
    let server = start_on(port, &backend);
    let mut client = Client::connect_with(("127.0.0.1", port), &reconnecting()).expect("connect");
    let data = pattern(1, 3 * MIB);
    client.write(NAMESPACE, MIB as u64, &data).expect("write");
    client.flush(NAMESPACE).expect("flush");
    server.shutdown().expect("shutdown");

    let server = start_on(port, &backend);
    // The client was idle through the restart: it notices the dead connection before
    // sending anything, so even a write goes through without an unknown outcome.
    let block = pattern(2, 4096);
    client
        .write(NAMESPACE, 0, &block)
        .expect("write after restart");
    assert_eq!(client.reconnect_count(), 1);
    let mut back = vec![0u8; data.len()];
    client.read(NAMESPACE, MIB as u64, &mut back).expect("read");
    assert!(back == data, "data written before the restart");
    let mut back = vec![0u8; block.len()];
    client.read(NAMESPACE, 0, &mut back).expect("read");
    assert_eq!(back, block);
    assert_eq!(client.reconnect_count(), 1);
    drop(client);
    server.shutdown().expect("shutdown");
}

#[test]
fn a_call_waits_for_a_server_that_comes_back() {
    let backend = file_backend();
    let port = free_port();
    let server = start_on(port, &backend);
    let mut client = Client::connect_with(("127.0.0.1", port), &reconnecting()).expect("connect");
    let data = pattern(3, 64 * 1024);
    client.write(NAMESPACE, 0, &data).expect("write");
    client.flush(NAMESPACE).expect("flush");
    server.shutdown().expect("shutdown");

    thread::scope(|scope| {
        // The server comes back while the read below is already retrying.
        let restarted = scope.spawn(|| {
            thread::sleep(Duration::from_millis(300));
            start_on(port, &backend)
        });
        let mut back = vec![0u8; data.len()];
        client.read(NAMESPACE, 0, &mut back).expect("read");
        assert!(back == data);
        assert_eq!(client.reconnect_count(), 1);
        let server = restarted.join().expect("restart thread");
        server.shutdown().expect("shutdown");
    });
}

#[test]
fn a_read_in_flight_across_a_restart_is_repeated_on_the_new_server() {
    let backend = file_backend();
    let port = free_port();
    let server = start_on(port, &backend);
    let proxy = Proxy::start(SocketAddr::from(([127, 0, 0, 1], port)));
    let mut client = Client::connect_with(proxy.address, &reconnecting()).expect("connect");
    let data = pattern(4, 2 * MIB);
    client.write(NAMESPACE, 0, &data).expect("write");
    client.flush(NAMESPACE).expect("flush");

    proxy.state.swallow_requests.store(true, Ordering::SeqCst);
    thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut back = vec![0u8; data.len()];
            client.read(NAMESPACE, 0, &mut back).map(|()| back)
        });
        // Both READ requests have left the client: the old server never sees them.
        while proxy.state.swallowed_bytes.load(Ordering::SeqCst) < 2 * REQUEST_HEADER_SIZE {
            thread::sleep(Duration::from_millis(5));
        }
        proxy.state.swallow_requests.store(false, Ordering::SeqCst);
        // The old server closes its connections; the proxy passes that on to the client.
        server.shutdown().expect("shutdown");
        let server = start_on(port, &backend);
        let back = reader.join().expect("reader").expect("read");
        assert!(back == data, "the repeated read returns the data");
        server.shutdown().expect("shutdown");
    });
    assert_eq!(client.reconnect_count(), 1);
}

#[test]
fn a_read_unanswered_within_the_timeout_is_repeated_on_a_new_connection() {
    let backend = file_backend();
    let port = free_port();
    let server = start_on(port, &backend);
    let proxy = Proxy::start(server.native_addr());
    let options = ClientOptions {
        timeout: Some(Duration::from_secs(2)),
        ..reconnecting()
    };
    let mut client = Client::connect_with(proxy.address, &options).expect("connect");
    let data = pattern(7, 8192);
    client.write(NAMESPACE, 0, &data).expect("write");

    // The server stays up and the connection open; only the answer never comes.
    proxy.state.swallow_requests.store(true, Ordering::SeqCst);
    thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut back = vec![0u8; data.len()];
            client.read(NAMESPACE, 0, &mut back).map(|()| back)
        });
        while proxy.state.swallowed_bytes.load(Ordering::SeqCst) < REQUEST_HEADER_SIZE {
            thread::sleep(Duration::from_millis(5));
        }
        proxy.state.swallow_requests.store(false, Ordering::SeqCst);
        let back = reader.join().expect("reader").expect("read");
        assert!(back == data);
    });
    assert_eq!(client.reconnect_count(), 1);
    drop(client);
    drop(proxy);
    server.shutdown().expect("shutdown");
}

#[test]
fn unacknowledged_writes_are_reported_and_acknowledged_ones_are_not() {
    let backend = file_backend();
    let port = free_port();
    let server = start_on(port, &backend);
    let proxy = Proxy::start(server.native_addr());
    let mut client = Client::connect_with(proxy.address, &reconnecting()).expect("connect");
    let before = pattern(5, 4096);
    client.write(NAMESPACE, 0, &before).expect("write");

    // Three 1 MiB chunks: the server performs all three, the client hears of one.
    proxy.arm(BreakPlan {
        answers_forwarded_max: 1,
        break_after_answers: 3,
    });
    let base = 4 * MIB as u64;
    let data = pattern(6, 3 * MIB);
    let requests = match client.write(NAMESPACE, base, &data) {
        Err(ClientError::OutcomeUnknown { requests }) => requests,
        other => panic!("expected an unknown outcome, got {other:?}"),
    };
    let forwarded = proxy.forwarded_ids();
    assert_eq!(forwarded.len(), 1);
    assert_eq!(requests.len(), 2, "{requests:?}");
    let mut offsets = BTreeSet::new();
    for request in &requests {
        assert_eq!(request.opcode, Opcode::Write);
        assert_eq!(request.namespace, NAMESPACE);
        assert_eq!(request.length_bytes as usize, MIB);
        assert!(!forwarded.contains(&request.request_id), "acknowledged");
        offsets.insert(request.offset_bytes);
    }
    // The unknown chunks and the acknowledged one are the three chunks of the call.
    let acknowledged_offset = (0..3u64)
        .map(|chunk| base + chunk * MIB as u64)
        .find(|offset| !offsets.contains(offset))
        .expect("one chunk acknowledged");
    assert_eq!(offsets.len(), 2);
    assert!(acknowledged_offset >= base);

    // The client is usable again; here the server did perform the unknown writes.
    let mut back = vec![0u8; data.len()];
    client.read(NAMESPACE, base, &mut back).expect("read");
    assert!(back == data);
    let mut back = vec![0u8; before.len()];
    client.read(NAMESPACE, 0, &mut back).expect("read");
    assert_eq!(back, before);
    assert_eq!(client.reconnect_count(), 1);
    drop(client);
    drop(proxy);
    server.shutdown().expect("shutdown");
}

#[test]
fn pipelined_reads_are_repeated_and_writes_reported_across_a_break() {
    let backend = file_backend();
    let port = free_port();
    let server = start_on(port, &backend);
    let read_offset = |id: u64| (8 << 20) + id * 65536;
    let write_offset = |id: u64| id * 65536;
    {
        let mut direct = Client::connect(server.native_addr()).expect("connect");
        for id in 5..=8u64 {
            direct
                .write(NAMESPACE, read_offset(id), &pattern(id as u8, 16384))
                .expect("prepare");
        }
    }
    let proxy = Proxy::start(server.native_addr());
    let mut client =
        PipelinedClient::connect_with(proxy.address, &reconnecting()).expect("connect");
    proxy.arm(BreakPlan {
        answers_forwarded_max: 2,
        break_after_answers: 8,
    });
    for id in 1..=4u64 {
        client
            .submit_write(
                id,
                NAMESPACE,
                write_offset(id),
                &pattern(100 + id as u8, 16384),
                false,
            )
            .expect("submit write");
    }
    for id in 5..=8u64 {
        client
            .submit_read(id, NAMESPACE, read_offset(id), 16384)
            .expect("submit read");
    }
    let mut answered = BTreeSet::new();
    let mut unknown = BTreeSet::new();
    while answered.len() + unknown.len() < 8 {
        assert!(client.wait(None).expect("wait"));
        loop {
            match client.reap() {
                Ok(None) => break,
                Ok(Some(completion)) => {
                    let data = completion.result().expect("ok");
                    let id = completion.request_id;
                    if completion.opcode == Opcode::Read {
                        assert_eq!(data, &pattern(id as u8, 16384)[..], "read {id}");
                    }
                    assert!(answered.insert(id), "{id} answered twice");
                }
                Err(ClientError::OutcomeUnknown { requests }) => {
                    for request in requests {
                        assert_eq!(request.opcode, Opcode::Write);
                        assert_eq!(request.offset_bytes, write_offset(request.request_id));
                        assert!(unknown.insert(request.request_id));
                    }
                }
                Err(error) => panic!("reap: {error}"),
            }
        }
    }
    let forwarded: BTreeSet<u64> = proxy.forwarded_ids().into_iter().collect();
    assert_eq!(forwarded.len(), 2);
    let writes: BTreeSet<u64> = (1..=4).collect();
    let reads: BTreeSet<u64> = (5..=8).collect();
    assert_eq!(
        unknown,
        &writes - &forwarded,
        "exactly the writes not acknowledged"
    );
    assert!(reads.is_subset(&answered), "every read answered");
    assert!(answered.is_disjoint(&unknown));
    assert_eq!(client.reconnect_count(), 1);
    assert_eq!(client.outstanding_count(), 0);
    drop(client);
    drop(proxy);
    server.shutdown().expect("shutdown");
}

#[test]
fn giving_up_is_a_typed_error_and_the_next_call_tries_again() {
    let backend = file_backend();
    let port = free_port();
    let server = start_on(port, &backend);
    let by_time = ReconnectPolicy {
        give_up_after: Duration::from_millis(200),
        ..policy()
    };
    let mut client = Client::connect_with(
        ("127.0.0.1", port),
        &ClientOptions::default().with_reconnect(by_time),
    )
    .expect("connect");
    let by_attempts = ReconnectPolicy {
        attempts_max: 3,
        ..policy()
    };
    let mut pipelined = PipelinedClient::connect_with(
        ("127.0.0.1", port),
        &ClientOptions::default().with_reconnect(by_attempts),
    )
    .expect("connect");
    server.shutdown().expect("shutdown");

    let mut buf = vec![0u8; 4096];
    match client.read(NAMESPACE, 0, &mut buf) {
        Err(ClientError::ReconnectGaveUp {
            attempts,
            last_error,
            interrupted,
            ..
        }) => {
            assert!(attempts >= 1);
            assert!(last_error.is_connection_lost(), "{last_error}");
            assert!(interrupted.is_empty(), "nothing was sent: {interrupted:?}");
        }
        other => panic!("expected to give up, got {other:?}"),
    }

    pipelined
        .submit_read(7, NAMESPACE, 0, 4096)
        .expect("submit read");
    match pipelined.wait(None) {
        Err(ClientError::ReconnectGaveUp {
            attempts,
            interrupted,
            ..
        }) => {
            assert_eq!(attempts, 3);
            let ids: Vec<u64> = interrupted.iter().map(|r| r.request_id).collect();
            assert_eq!(ids, vec![7], "the read will never be answered");
        }
        other => panic!("expected to give up, got {other:?}"),
    }
    assert_eq!(
        pipelined.submit_read(8, NAMESPACE, 0, 4096),
        Err(SubmitError::Disconnected)
    );

    // Once a server is back, the next call connects again with a fresh budget.
    let server = start_on(port, &backend);
    client.read(NAMESPACE, 0, &mut buf).expect("read");
    assert_eq!(client.reconnect_count(), 1);
    pipelined.poll_io().expect("poll_io connects again");
    assert_eq!(pipelined.reconnect_count(), 1);
    assert_eq!(
        pipelined.outstanding_count(),
        0,
        "the given-up read is not repeated"
    );
    pipelined
        .submit_read(8, NAMESPACE, 0, 4096)
        .expect("submit read");
    assert!(pipelined.wait(None).expect("wait"));
    let completion = pipelined.reap().expect("reap").expect("answer");
    assert_eq!(completion.request_id, 8);
    assert!(completion.is_ok());
    drop(client);
    drop(pipelined);
    server.shutdown().expect("shutdown");
}

#[test]
fn a_bound_tenant_is_bound_again_after_a_break() {
    let port = free_port();
    let server = start_qos_on(port);
    let proxy = Proxy::start(server.native_addr());
    let mut client = Client::connect_with(proxy.address, &reconnecting()).expect("connect");
    let handle = client.register_be(NAMESPACE).expect("register");
    client.bind(handle).expect("bind");
    assert_eq!(client.bound_handle(), handle);

    proxy.state.break_all();
    let mut buf = vec![0u8; 4096];
    client.read(NAMESPACE, 0, &mut buf).expect("read");
    assert_eq!(client.reconnect_count(), 1);
    assert_eq!(client.bound_handle(), handle);
    let tenant = server.tenant(handle).expect("still registered");
    assert_eq!(
        tenant.connections_per_thread.iter().sum::<u32>(),
        1,
        "the new connection is bound, the old one is gone"
    );
    drop(client);
    drop(proxy);
    server.shutdown().expect("shutdown");
}

#[test]
fn a_tenant_the_restarted_server_does_not_know_is_a_typed_error() {
    let port = free_port();
    let server = start_qos_on(port);
    let mut client = Client::connect_with(("127.0.0.1", port), &reconnecting()).expect("connect");
    let handle = client.register_be(NAMESPACE).expect("register");
    client.bind(handle).expect("bind");
    server.shutdown().expect("shutdown");

    let server = start_qos_on(port);
    assert!(
        server.tenant(handle).is_none(),
        "tenants registered over the wire are gone"
    );
    let mut buf = vec![0u8; 4096];
    match client.read(NAMESPACE, 0, &mut buf) {
        Err(ClientError::TenantLost {
            handle: lost,
            refusal,
            interrupted,
        }) => {
            assert_eq!(lost, handle);
            assert_eq!(refusal.status(), Some(Status::Invalid));
            assert!(interrupted.is_empty());
        }
        other => panic!("expected the tenant to be lost, got {other:?}"),
    }
    // The connection is up, charged to the namespace's default tenant.
    assert_eq!(client.bound_handle(), 0);
    client.read(NAMESPACE, 0, &mut buf).expect("read");
    drop(client);
    server.shutdown().expect("shutdown");
}

/// Handles are unguessable (a keyed hash with a key from the operating system, issue 9), so
/// a restarted server does not hand the old number to another tenant: the re-BIND after the
/// restart finds no tenant and reports `TenantLost`, never another tenant's.
#[test]
fn a_restarted_server_does_not_reuse_a_handle_for_another_tenant() {
    let port = free_port();
    let server = start_qos_on(port);
    let mut client = Client::connect_with(("127.0.0.1", port), &reconnecting()).expect("connect");
    let handle = client.register_be(NAMESPACE).expect("register");
    client.bind(handle).expect("bind");
    server.shutdown().expect("shutdown");

    let server = start_qos_on(port);
    let mut other = Client::connect(("127.0.0.1", port)).expect("connect");
    let other_handle = other.register_be(NAMESPACE).expect("register");
    assert_ne!(other_handle, handle, "the new server reused the old handle");
    let mut buf = vec![0u8; 4096];
    match client.read(NAMESPACE, 0, &mut buf) {
        Err(ClientError::TenantLost { handle: lost, .. }) => assert_eq!(lost, handle),
        other => panic!("expected the tenant to be lost, got {other:?}"),
    }
    let tenant = server
        .tenant(other_handle)
        .expect("the other client's tenant");
    assert_eq!(
        tenant.connections_per_thread.iter().sum::<u32>(),
        0,
        "the reconnected client was bound to another client's tenant"
    );
    drop(other);
    drop(client);
    server.shutdown().expect("shutdown");
}

#[test]
fn without_a_policy_a_restart_fails_the_call_as_before() {
    let backend = file_backend();
    let port = free_port();
    let server = start_on(port, &backend);
    let mut client = Client::connect(("127.0.0.1", port)).expect("connect");
    server.shutdown().expect("shutdown");
    let server = start_on(port, &backend);
    let mut buf = vec![0u8; 4096];
    let error = client
        .read(NAMESPACE, 0, &mut buf)
        .expect_err("the connection is gone");
    assert!(error.is_connection_lost(), "{error}");
    assert_eq!(client.reconnect_count(), 0);
    drop(client);
    server.shutdown().expect("shutdown");
}
