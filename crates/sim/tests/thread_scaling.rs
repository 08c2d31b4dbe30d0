//! Thread scaling in virtual time (`docs/OPERATIONS.md`, "Thread scaling"): the real
//! dataplanes of two threads, a parked thread handing its connections to the other while its
//! clients keep requests in flight and send requests in pieces, and on its wake the other
//! handing half of them back (rebalancing); native, key-value and TLS connections (one of them
//! still in its handshake when its thread parks), and three threads parked and woken at random
//! instants while connections are still moving; every answer checked for identity (each
//! request answered once) and content (a block read back after its rewrite was answered has
//! the new bytes; a GET sees the value its connection last PUT). Seeded: the seed is printed
//! on failure.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{NAMESPACE, one_namespace_server_on};
use reflex_client::ConnectionCore;
use reflex_dataplane::Limits;
use reflex_flash::Device;
use reflex_qos::Nanos;
use reflex_sim::{NetworkModel, SocketId, VirtualListener, VirtualServer};

const BLOCK: usize = 4096;
const BLOCKS_PER_CLIENT: u64 = 8;
const DEPTH: usize = 6;

fn block_bytes(block: u64, version: u32) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| {
            (block.wrapping_mul(31) as usize + version as usize * 7 + i) as u8 ^ (i >> 8) as u8
        })
        .collect()
}

enum Expect {
    Write { slot: usize, version: u32 },
    Read(Vec<u8>),
}

/// A native client whose sends may be cut in two (the rest sent at a later instant).
struct Client {
    socket: SocketId,
    core: ConnectionCore,
    outstanding: HashMap<u64, Expect>,
    received: Vec<u8>,
    /// Bytes the client still has to send of a request it cut.
    held: Vec<u8>,
    /// Per owned block: the version written and answered (what a read must see), and whether
    /// a rewrite is in flight (no read of the block meanwhile).
    versions: Vec<u32>,
    rewriting: Vec<bool>,
    first_block: u64,
    next_id: u64,
    answered: u64,
}

impl Client {
    /// Queues version 0 of every block the client owns (each client writes its own first).
    fn queue_version_zero(&mut self) {
        for slot in 0..BLOCKS_PER_CLIENT {
            let block = self.first_block + slot;
            let id = self.next_id;
            self.next_id += 1;
            self.core
                .submit_write(
                    id,
                    NAMESPACE,
                    block * BLOCK as u64,
                    &block_bytes(block, 0),
                    false,
                )
                .unwrap_or_else(|e| panic!("{e}"));
            self.outstanding.insert(
                id,
                Expect::Write {
                    slot: slot as usize,
                    version: 0,
                },
            );
        }
    }

    fn new(server: &mut VirtualServer, thread: u16, index: u64) -> Client {
        let (socket, core) = common::connect_native(server, thread);
        Client {
            socket,
            core,
            outstanding: HashMap::new(),
            received: Vec::new(),
            held: Vec::new(),
            versions: vec![0; BLOCKS_PER_CLIENT as usize],
            rewriting: vec![false; BLOCKS_PER_CLIENT as usize],
            first_block: index * BLOCKS_PER_CLIENT,
            next_id: index << 40,
            answered: 0,
        }
    }

    fn take_answers(&mut self, server: &mut VirtualServer) {
        let (outstanding, versions, rewriting, answered) = (
            &mut self.outstanding,
            &mut self.versions,
            &mut self.rewriting,
            &mut self.answered,
        );
        common::take_completions(
            server,
            self.socket,
            &mut self.core,
            &mut self.received,
            |c| {
                let id = c.request_id;
                let Some(expected) = outstanding.remove(&id) else {
                    panic!("answer for {id}, not outstanding (duplicate or unknown)");
                };
                assert!(c.is_ok(), "request {id} failed: {}", c.status_raw);
                match expected {
                    Expect::Read(bytes) => {
                        assert!(c.data == &bytes[..], "request {id}: wrong bytes")
                    }
                    Expect::Write { slot, version } => {
                        versions[slot] = version;
                        rewriting[slot] = false;
                    }
                }
                *answered += 1;
            },
        );
    }

    /// Tops the window up with rewrites and reads of settled blocks; sends, cutting the
    /// bytes in two at `cut` (then the rest waits for the next call).
    fn step(&mut self, server: &mut VirtualServer, next: &mut impl FnMut(u64) -> u64) {
        if !self.held.is_empty() {
            let rest = std::mem::take(&mut self.held);
            server.client_send(self.socket, &rest);
        }
        while self.outstanding.len() < DEPTH {
            let slot = next(BLOCKS_PER_CLIENT) as usize;
            if self.rewriting[slot] {
                break;
            }
            let block = self.first_block + slot as u64;
            let id = self.next_id;
            self.next_id += 1;
            if next(3) == 0 {
                let version = self.versions[slot] + 1;
                self.rewriting[slot] = true;
                self.core
                    .submit_write(
                        id,
                        NAMESPACE,
                        block * BLOCK as u64,
                        &block_bytes(block, version),
                        false,
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
                self.outstanding.insert(id, Expect::Write { slot, version });
            } else {
                let expected = block_bytes(block, self.versions[slot]);
                self.core
                    .submit_read(id, NAMESPACE, block * BLOCK as u64, BLOCK as u32)
                    .unwrap_or_else(|e| panic!("{e}"));
                self.outstanding.insert(id, Expect::Read(expected));
            }
        }
        while let Some(bytes) = self.core.transmit_start() {
            let length = bytes.len();
            let cut = if next(4) == 0 {
                next(length as u64) as usize
            } else {
                length
            };
            server.client_send(self.socket, &bytes[..cut]);
            self.held.extend_from_slice(&bytes[cut..]);
            self.core.transmit_done(length);
        }
    }
}

/// A memory device of `bytes` behind a fault plan (`delay=…`), so that requests are in flight
/// when a thread parks or wakes.
fn delayed_memory(bytes: u64, plan: &str) -> Arc<dyn Device> {
    let memory: Arc<dyn Device> =
        Arc::new(reflex_flash::mem::MemDevice::new(bytes).unwrap_or_else(|e| panic!("{e}")));
    let plan = reflex_flash::fault::FaultPlan::parse(plan).unwrap_or_else(|e| panic!("{e}"));
    Arc::new(reflex_flash::fault::FaultDevice::new(memory, plan).unwrap_or_else(|e| panic!("{e}")))
}

/// A seeded xorshift: `next(bound)` is a number below `bound` (0 for a bound of 0).
fn below(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = seed | 1;
    move |bound: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % bound.max(1)
    }
}

/// How many of `sockets` are on `thread`.
fn on_thread(
    server: &VirtualServer,
    sockets: impl IntoIterator<Item = SocketId>,
    thread: u16,
) -> usize {
    sockets
        .into_iter()
        .filter(|&socket| server.socket_thread(socket) == thread)
        .count()
}

/// Every one of `sockets` is on thread 0; thread 1 wakes, and the rebalance plans 3 moves.
fn wake_thread_1_with_all_on_thread_0(
    server: &mut VirtualServer,
    sockets: impl ExactSizeIterator<Item = SocketId> + Clone,
    seed: u64,
) {
    assert_eq!(
        on_thread(server, sockets.clone(), 0),
        sockets.len(),
        "seed {seed}"
    );
    let plan = server.wake_thread_rebalancing(1, 2);
    assert_eq!(plan.iter().map(|m| m.count).sum::<u32>(), 3, "seed {seed}");
}

fn run(seed: u64) {
    let device = delayed_memory(16 << 20, "delay=100us");
    let mut server = one_namespace_server_on(
        2,
        device,
        Limits::with_arena(16 << 20, 16),
        NetworkModel::default(),
        vec![VirtualListener::Native],
    );
    let mut next = below(seed);
    // Version 0 of every block first: each client writes its own.
    let mut clients: Vec<Client> = (0..6)
        .map(|index| Client::new(&mut server, (index % 2) as u16, index))
        .collect();
    let mut now = server.now();
    for client in &mut clients {
        client.queue_version_zero();
        while let Some(bytes) = client.core.transmit_start() {
            let length = bytes.len();
            server.client_send(client.socket, bytes);
            client.core.transmit_done(length);
        }
    }
    // Thread 1 parks at 20 ms and wakes at 60 ms (thread 0 hands three connections back,
    // with requests in flight); new connections open on thread 1 after the wake, and it
    // parks again at 100 ms.
    let mut parked_at = [false; 4];
    while now < Nanos::from_millis(140) {
        for client in &mut clients {
            client.take_answers(&mut server);
            client.step(&mut server, &mut next);
        }
        if now >= Nanos::from_millis(20) && !parked_at[0] {
            parked_at[0] = true;
            server.park_thread(1, 0);
        }
        if now >= Nanos::from_millis(60) && !parked_at[1] {
            parked_at[1] = true;
            // Every connection of thread 1 has moved by now.
            for client in &clients {
                assert_eq!(server.socket_thread(client.socket), 0, "seed {seed}");
            }
            let plan = server.wake_thread_rebalancing(1, 2);
            assert_eq!(
                plan,
                vec![reflex_qos::RebalanceMove {
                    from: 0,
                    to: 1,
                    count: 3
                }],
                "seed {seed}"
            );
            for index in 6..9 {
                clients.push(Client::new(&mut server, 1, index));
                let client = clients.last_mut().unwrap_or_else(|| unreachable!());
                client.queue_version_zero();
            }
        }
        if now >= Nanos::from_millis(95) && !parked_at[3] {
            parked_at[3] = true;
            // Three old connections moved back, beside the three new ones.
            let on_thread_1 = on_thread(&server, clients.iter().map(|c| c.socket), 1);
            assert_eq!(on_thread_1, 6, "seed {seed}");
            assert_eq!(
                on_thread(&server, clients[..6].iter().map(|c| c.socket), 1),
                3,
                "seed {seed}"
            );
        }
        if now >= Nanos::from_millis(100) && !parked_at[2] {
            parked_at[2] = true;
            server.park_thread(1, 0);
        }
        now += Nanos::from_micros(50);
        common::run_until(&mut server, now);
    }
    // Drain: everything sent and answered.
    for _ in 0..10_000 {
        for client in &mut clients {
            client.take_answers(&mut server);
            if !client.held.is_empty() {
                let rest = std::mem::take(&mut client.held);
                server.client_send(client.socket, &rest);
            }
        }
        if clients.iter().all(|c| c.outstanding.is_empty()) {
            break;
        }
        now += Nanos::from_micros(50);
        common::run_until(&mut server, now);
    }
    for client in &clients {
        assert!(
            client.outstanding.is_empty(),
            "seed {seed}: requests unanswered"
        );
        assert_eq!(server.socket_thread(client.socket), 0, "seed {seed}");
        assert!(!server.is_server_closed(client.socket), "seed {seed}");
    }
    let stats = server.stats();
    let moved: Vec<(u64, u64)> = stats
        .iter()
        .map(|s| (s.connections_moved_out, s.connections_moved_in))
        .collect();
    // Three connections moved at the first park, three back at the wake, six (the three
    // back and the three new) at the second park.
    assert_eq!(moved, vec![(3, 9), (9, 3)], "seed {seed}");
    let answered: u64 = clients.iter().map(|c| c.answered).sum();
    assert!(answered > 1_000, "seed {seed}: {answered}");
}

#[test]
fn connections_move_between_threads_and_every_answer_is_right_once() {
    for seed in [1u64, 0x2545_f491_4f6c_dd1d, 0x9e37_79b9_7f4a_7c15, 42] {
        run(seed);
    }
}

/// A key-value client: its keys (each used by this connection only), the value each GET
/// must see (the last PUT sent before it on the connection: one connection's operations on
/// a key take effect in order), the answers not taken yet.
struct KvClient {
    socket: SocketId,
    keys: Vec<Vec<u8>>,
    /// Per key: the version of the last PUT sent.
    sent_version: Vec<u32>,
    /// Per request id: `Some((key, version))` for a GET, `None` for a PUT.
    outstanding: HashMap<u64, Option<(usize, u32)>>,
    received: Vec<u8>,
    next_id: u64,
    answered: u64,
}

fn kv_value(client: usize, key: usize, version: u32) -> Vec<u8> {
    let length = 200 + (client * 37 + key * 11 + version as usize * 3) % 1500;
    (0..length)
        .map(|i| (client * 7 + key * 13 + version as usize * 5 + i) as u8)
        .collect()
}

impl KvClient {
    fn new(server: &mut VirtualServer, thread: u16, index: usize) -> KvClient {
        let socket = server
            .connect(thread, 0, None)
            .unwrap_or_else(|e| panic!("connect: {e}"));
        KvClient {
            socket,
            keys: (0..4)
                .map(|key| format!("client-{index}-key-{key}").into_bytes())
                .collect(),
            sent_version: vec![0; 4],
            outstanding: HashMap::new(),
            received: Vec::new(),
            next_id: 1,
            answered: 0,
        }
    }

    fn send(&mut self, server: &mut VirtualServer, request: reflex_proto::kv::Request<'_>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let mut frame = vec![0u8; request.encoded_length_bytes()];
        let length = request
            .encode_into(id, &mut frame)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(length, frame.len());
        server.client_send(self.socket, &frame);
        id
    }

    fn put(&mut self, server: &mut VirtualServer, index: usize, key: usize) {
        self.sent_version[key] += 1;
        let value = kv_value(index, key, self.sent_version[key]);
        let key_bytes = self.keys[key].clone();
        let id = self.send(
            server,
            reflex_proto::kv::Request::Put {
                key: &key_bytes,
                value: &value,
            },
        );
        self.outstanding.insert(id, None);
    }

    fn get(&mut self, server: &mut VirtualServer, key: usize) {
        let key_bytes = self.keys[key].clone();
        let id = self.send(server, reflex_proto::kv::Request::Get { key: &key_bytes });
        self.outstanding
            .insert(id, Some((key, self.sent_version[key])));
    }

    fn take_answers(&mut self, server: &mut VirtualServer, index: usize, seed: u64) {
        use reflex_proto::kv::{Status, decode_response_frame};
        server.client_read(self.socket, &mut self.received);
        while let Some(frame) =
            decode_response_frame(&self.received).unwrap_or_else(|e| panic!("{e}"))
        {
            let id = frame.header.request_id;
            let Some(expected) = self.outstanding.remove(&id) else {
                panic!("seed {seed}: KV answer for {id}, not outstanding (duplicate or unknown)");
            };
            assert_eq!(
                Status::from_u16(frame.header.status_raw).ok(),
                Some(Status::Ok),
                "seed {seed}: KV request {id}"
            );
            if let Some((key, version)) = expected {
                assert!(
                    frame.value == &kv_value(index, key, version)[..],
                    "seed {seed}: GET {id} of key {key}: not version {version}"
                );
            }
            self.answered += 1;
            let length = frame.length_bytes;
            self.received.drain(..length);
        }
    }
}

fn run_kv(seed: u64) {
    let device = delayed_memory(4 << 20, "delay=30us");
    let mut server = one_namespace_server_on(
        2,
        device,
        Limits::with_arena(8 << 20, 25),
        NetworkModel::default(),
        vec![VirtualListener::Kv {
            namespace_index: 0,
            tenant: None,
        }],
    );
    let mut next = below(seed);
    let mut clients: Vec<KvClient> = (0..6)
        .map(|index| KvClient::new(&mut server, (index % 2) as u16, index))
        .collect();
    // Every key stored once first, so that every GET finds a value.
    for (index, client) in clients.iter_mut().enumerate() {
        for key in 0..4 {
            client.put(&mut server, index, key);
        }
    }
    // Thread 1 parks at 10 ms (its KV connections move to thread 0 once none of their
    // requests exists, at thread 0's table or anywhere) and wakes at 40 ms, rebalancing.
    let mut now = server.now();
    let mut done = [false; 3];
    while now < Nanos::from_millis(90) {
        for (index, client) in clients.iter_mut().enumerate() {
            client.take_answers(&mut server, index, seed);
            while client.outstanding.len() < 4 {
                let key = next(4) as usize;
                if next(3) == 0 {
                    client.put(&mut server, index, key);
                } else {
                    client.get(&mut server, key);
                }
            }
        }
        if now >= Nanos::from_millis(10) && !done[0] {
            done[0] = true;
            server.park_thread(1, 0);
        }
        if now >= Nanos::from_millis(40) && !done[1] {
            done[1] = true;
            wake_thread_1_with_all_on_thread_0(&mut server, clients.iter().map(|c| c.socket), seed);
        }
        if now >= Nanos::from_millis(70) && !done[2] {
            done[2] = true;
            let on_thread_1 = on_thread(&server, clients.iter().map(|c| c.socket), 1);
            assert_eq!(on_thread_1, 3, "seed {seed}");
        }
        now += Nanos::from_micros(50);
        common::run_until(&mut server, now);
    }
    for _ in 0..10_000 {
        for (index, client) in clients.iter_mut().enumerate() {
            client.take_answers(&mut server, index, seed);
        }
        if clients.iter().all(|c| c.outstanding.is_empty()) {
            break;
        }
        now += Nanos::from_micros(50);
        common::run_until(&mut server, now);
    }
    for client in &clients {
        assert!(
            client.outstanding.is_empty(),
            "seed {seed}: KV requests unanswered"
        );
        assert!(!server.is_server_closed(client.socket), "seed {seed}");
    }
    let stats = server.stats();
    let moved: Vec<(u64, u64)> = stats
        .iter()
        .map(|s| (s.connections_moved_out, s.connections_moved_in))
        .collect();
    assert_eq!(moved, vec![(3, 3), (3, 3)], "seed {seed}");
    // Thread 1's connections forwarded table steps to thread 0 before the park and after
    // the wake.
    assert!(stats[1].kv_forwarded > 0, "seed {seed}");
    let answered: u64 = clients.iter().map(|c| c.answered).sum();
    assert!(answered > 500, "seed {seed}: {answered}");
}

#[test]
fn key_value_connections_move_on_park_and_back_on_wake_and_every_answer_is_right_once() {
    for seed in [1u64, 0x2545_f491_4f6c_dd1d, 7] {
        run_kv(seed);
    }
}

mod tls_clients {
    //! Native clients over rustls (as in `tests/tls.rs`), for TLS sessions that move.

    use std::collections::HashMap;
    use std::io::{Read, Write};
    use std::sync::Arc;

    use reflex_client::{ConnectionCore, CoreOptions};
    use reflex_sim::{SocketId, TlsServer, VirtualServer};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

    const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    pub fn server() -> TlsServer {
        let chain = vec![
            CertificateDer::from_pem_file(format!("{DATA}/tls-server-cert.pem"))
                .unwrap_or_else(|e| panic!("{e}")),
        ];
        let key = PrivateKeyDer::from_pem_file(format!("{DATA}/tls-server-key.pem"))
            .unwrap_or_else(|e| panic!("{e}"));
        TlsServer(
            Arc::new(
                rustls::ServerConfig::builder_with_provider(provider())
                    .with_safe_default_protocol_versions()
                    .unwrap_or_else(|e| panic!("{e}"))
                    .with_no_client_auth()
                    .with_single_cert(chain, key)
                    .unwrap_or_else(|e| panic!("{e}")),
            ),
            None,
        )
    }

    fn client_config() -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(
                CertificateDer::from_pem_file(format!("{DATA}/tls-ca.pem"))
                    .unwrap_or_else(|e| panic!("{e}")),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        Arc::new(
            rustls::ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap_or_else(|e| panic!("{e}"))
                .with_root_certificates(roots)
                .with_no_client_auth(),
        )
    }

    /// A native client over rustls; each answer checked once (a READ against the bytes the
    /// write before it on the connection put there).
    pub struct TlsClient {
        pub socket: SocketId,
        tls: rustls::ClientConnection,
        pub core: ConnectionCore,
        /// Per request id: the bytes a READ must return (`None`: a WRITE).
        pub outstanding: HashMap<u64, Option<Vec<u8>>>,
        pub answered: u64,
    }

    impl TlsClient {
        pub fn connect(server: &mut VirtualServer, thread: u16) -> TlsClient {
            let socket = server
                .connect(thread, 0, None)
                .unwrap_or_else(|e| panic!("{e}"));
            let name = ServerName::try_from("localhost").unwrap_or_else(|e| panic!("{e}"));
            let mut tls = rustls::ClientConnection::new(client_config(), name)
                .unwrap_or_else(|e| panic!("{e}"));
            tls.set_buffer_limit(None);
            TlsClient {
                socket,
                tls,
                core: ConnectionCore::new(CoreOptions {
                    window_assumed: 128,
                }),
                outstanding: HashMap::new(),
                answered: 0,
            }
        }

        /// Moves bytes both ways once and checks the answers that arrived.
        pub fn pump(&mut self, server: &mut VirtualServer, seed: u64) {
            while let Some(bytes) = self.core.transmit_start() {
                let length = bytes.len();
                self.tls
                    .writer()
                    .write_all(bytes)
                    .unwrap_or_else(|e| panic!("{e}"));
                self.core.transmit_done(length);
            }
            let mut cipher_out = Vec::new();
            while self.tls.wants_write() {
                self.tls
                    .write_tls(&mut cipher_out)
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            if !cipher_out.is_empty() {
                server.client_send(self.socket, &cipher_out);
            }
            let mut received = Vec::new();
            server.client_read(self.socket, &mut received);
            let mut offered = &received[..];
            let mut plaintext = Vec::new();
            while !offered.is_empty() {
                self.tls
                    .read_tls(&mut offered)
                    .unwrap_or_else(|e| panic!("{e}"));
                self.tls
                    .process_new_packets()
                    .unwrap_or_else(|e| panic!("seed {seed}: TLS: {e}"));
                match self.tls.reader().read_to_end(&mut plaintext) {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("TLS read: {e}"),
                }
            }
            let mut offered = &plaintext[..];
            loop {
                let taken = self.core.handle_received_bytes(offered);
                offered = &offered[taken..];
                while let Some(completion) = self.core.poll_completion().unwrap_or_else(|e| {
                    panic!("seed {seed}: {e}");
                }) {
                    let id = completion.request_id;
                    let Some(expected) = self.outstanding.remove(&id) else {
                        panic!("seed {seed}: TLS answer {id} not outstanding (twice or unknown)");
                    };
                    assert!(completion.is_ok(), "seed {seed}: TLS request {id} failed");
                    if let Some(bytes) = expected {
                        assert!(
                            completion.data == &bytes[..],
                            "seed {seed}: {id}: wrong bytes"
                        );
                    }
                    self.answered += 1;
                }
                if offered.is_empty() || taken == 0 {
                    break;
                }
            }
        }
    }
}

fn run_tls(seed: u64) {
    let device = delayed_memory(16 << 20, "delay=50us");
    let mut server = one_namespace_server_on(
        2,
        device,
        Limits::with_arena(16 << 20, 16),
        NetworkModel::default(),
        vec![VirtualListener::NativeTls(tls_clients::server())],
    );
    let mut clients: Vec<tls_clients::TlsClient> = (0..6)
        .map(|index| tls_clients::TlsClient::connect(&mut server, (index % 2) as u16))
        .collect();
    let mut versions = vec![0u32; 6 * BLOCKS_PER_CLIENT as usize];
    let mut next_id = 1u64;
    let mut next = below(seed);
    let mut now = server.now();
    let mut done = [false; 3];
    while now < Nanos::from_millis(170) {
        for (index, client) in clients.iter_mut().enumerate() {
            client.pump(&mut server, seed);
            // A rewrite and, behind it on the connection, a read that must see it.
            while client.outstanding.len() < 4 {
                let block = index as u64 * BLOCKS_PER_CLIENT + next(BLOCKS_PER_CLIENT);
                versions[block as usize] += 1;
                let bytes = block_bytes(block, versions[block as usize]);
                client
                    .core
                    .submit_write(next_id, NAMESPACE, block * BLOCK as u64, &bytes, false)
                    .unwrap_or_else(|e| panic!("{e}"));
                client.outstanding.insert(next_id, None);
                client
                    .core
                    .submit_read(next_id + 1, NAMESPACE, block * BLOCK as u64, BLOCK as u32)
                    .unwrap_or_else(|e| panic!("{e}"));
                client.outstanding.insert(next_id + 1, Some(bytes));
                next_id += 2;
            }
            client.pump(&mut server, seed);
        }
        if now >= Nanos::from_millis(20) && !done[0] {
            done[0] = true;
            server.park_thread(1, 0);
            // A connection that reached the parked thread before the steering changed: it
            // cannot move in its handshake, and moves at a housekeeping sweep after it.
            clients.push(tls_clients::TlsClient::connect(&mut server, 1));
            versions.extend(vec![0u32; BLOCKS_PER_CLIENT as usize]);
        }
        if now >= Nanos::from_millis(130) && !done[1] {
            done[1] = true;
            wake_thread_1_with_all_on_thread_0(&mut server, clients.iter().map(|c| c.socket), seed);
        }
        if now >= Nanos::from_millis(160) && !done[2] {
            done[2] = true;
            let on_thread_1 = on_thread(&server, clients.iter().map(|c| c.socket), 1);
            assert_eq!(on_thread_1, 3, "seed {seed}");
        }
        now += Nanos::from_micros(50);
        common::run_until(&mut server, now);
    }
    for _ in 0..10_000 {
        for client in &mut clients {
            client.pump(&mut server, seed);
        }
        if clients.iter().all(|c| c.outstanding.is_empty()) {
            break;
        }
        now += Nanos::from_micros(50);
        common::run_until(&mut server, now);
    }
    for client in &clients {
        assert!(
            client.outstanding.is_empty(),
            "seed {seed}: TLS requests unanswered"
        );
        assert!(!server.is_server_closed(client.socket), "seed {seed}");
    }
    let moved: Vec<(u64, u64)> = server
        .stats()
        .iter()
        .map(|s| (s.connections_moved_out, s.connections_moved_in))
        .collect();
    // Thread 1's three and the late one at the park, three back at the wake.
    assert_eq!(moved, vec![(3, 4), (4, 3)], "seed {seed}");
    let answered: u64 = clients.iter().map(|c| c.answered).sum();
    assert!(answered > 300, "seed {seed}: {answered}");
}

#[test]
fn tls_sessions_move_on_park_and_back_on_wake_and_every_answer_is_right_once() {
    // One seed: TLS in a debug build is slow, and the native tests cover the schedules.
    run_tls(0x2545_f491_4f6c_dd1d);
}

/// Three threads parked and woken at random instants (the last active one parks onto thread
/// 0; the first parked one wakes and the others rebalance onto it), so that connections are
/// still moving when the next change comes: handed to a thread that parks before adopting
/// them, shed by a thread that parks meanwhile. Native clients keep requests in flight
/// throughout, some cut in two; every answer checked once, nothing closed, and every
/// connection handed out adopted once.
fn run_random_changes(seed: u64) {
    let device = delayed_memory(16 << 20, "delay=100us");
    let mut server = one_namespace_server_on(
        3,
        device,
        Limits::with_arena(16 << 20, 16),
        NetworkModel::default(),
        vec![VirtualListener::Native],
    );
    let mut next = below(seed);
    let mut clients: Vec<Client> = Vec::new();
    let mut active = 3u16;
    let mut now = server.now();
    let mut change_at = Nanos::from_millis(5);
    let mut changes = 0;
    while now < Nanos::from_millis(200) {
        // A new connection now and then, on an active thread (as the steering does).
        if clients.len() < 12 && next(40) == 0 {
            let index = clients.len() as u64;
            let thread = next(u64::from(active)) as u16;
            let mut client = Client::new(&mut server, thread, index);
            for slot in 0..BLOCKS_PER_CLIENT {
                let block = client.first_block + slot;
                let id = client.next_id;
                client.next_id += 1;
                client
                    .core
                    .submit_write(
                        id,
                        NAMESPACE,
                        block * BLOCK as u64,
                        &block_bytes(block, 0),
                        false,
                    )
                    .unwrap_or_else(|e| panic!("{e}"));
                client.outstanding.insert(
                    id,
                    Expect::Write {
                        slot: slot as usize,
                        version: 0,
                    },
                );
            }
            clients.push(client);
        }
        for client in &mut clients {
            client.take_answers(&mut server);
            client.step(&mut server, &mut next);
        }
        if now >= change_at {
            changes += 1;
            let park = match active {
                1 => false,
                3 => true,
                _ => next(2) == 0,
            };
            if park {
                active -= 1;
                server.park_thread(active, 0);
            } else {
                server.wake_thread_rebalancing(active, active + 1);
                active += 1;
            }
            change_at = now + Nanos::from_micros(500 + next(15_000));
        }
        now += Nanos::from_micros(50);
        common::run_until(&mut server, now);
    }
    // Every thread active again (what was parked hands nothing more), then drain.
    while active < 3 {
        server.wake_thread_rebalancing(active, active + 1);
        active += 1;
    }
    for _ in 0..20_000 {
        for client in &mut clients {
            client.take_answers(&mut server);
            if !client.held.is_empty() {
                let rest = std::mem::take(&mut client.held);
                server.client_send(client.socket, &rest);
            }
        }
        if clients.iter().all(|c| c.outstanding.is_empty()) {
            break;
        }
        now += Nanos::from_micros(50);
        common::run_until(&mut server, now);
    }
    for client in &clients {
        assert!(
            client.outstanding.is_empty(),
            "seed {seed}: requests unanswered"
        );
        assert!(!server.is_server_closed(client.socket), "seed {seed}");
    }
    let stats = server.stats();
    let out: u64 = stats.iter().map(|s| s.connections_moved_out).sum();
    let adopted: u64 = stats.iter().map(|s| s.connections_moved_in).sum();
    assert_eq!(out, adopted, "seed {seed}");
    assert!(changes > 10, "seed {seed}: {changes}");
    assert!(out > 0, "seed {seed}");
    let answered: u64 = clients.iter().map(|c| c.answered).sum();
    eprintln!("seed {seed:#x}: {changes} changes, {out} moves, {answered} answers");
}

#[test]
fn random_parks_and_wakes_on_three_threads_lose_nothing() {
    for seed in [3u64, 0x9e37_79b9_7f4a_7c15, 0xdead_beef] {
        run_random_changes(seed);
    }
}
