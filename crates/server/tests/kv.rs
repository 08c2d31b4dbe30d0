//! The key-value port of a real reflexd over loopback TCP (`docs/KV.md`): seeded random
//! PUT/GET/DELETE sequences against a `HashMap` model, pipelined, across a restart after
//! FLUSH; malformed frames answered with their statuses and their payloads skipped; a wrong
//! magic closing only its connection; oversize values and unknown keys; two connections
//! racing on the same keys; sixteen connections spread over both dataplane threads (thread 1
//! forwarding its requests' table steps to thread 0, which owns the table) running
//! concurrently against a model, every key read through every connection, across a restart,
//! on io_uring and on epoll. Failure messages name the seed.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;

use common::{Daemon, config, namespace, start};
use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use reflex_client::kv::{KvClient, KvClientError};
use reflex_proto::kv::{Opcode, Request, RequestHeader, Status, VALUE_SIZE_MAX_BYTES};
use reflex_server::DriverChoice;
use reflex_server::config::{Config, KvConfig, NvmeTcpConfig};

const SEED: u64 = 0x6b76_0000_5eed_0d00;

fn kv_config(backend: &str, size_bytes: Option<u64>) -> Config {
    Config {
        kv: KvConfig {
            enabled: true,
            port: 0,
            ..KvConfig::default()
        },
        nvme_tcp: NvmeTcpConfig {
            enabled: false,
            port: 0,
            ..NvmeTcpConfig::default()
        },
        ..config(vec![namespace(1, backend, size_bytes)])
    }
}

fn kv_addr(server: &reflex_server::ServerHandle) -> SocketAddr {
    server.kv_addr().unwrap_or_else(|| panic!("no KV listener"))
}

/// A client whose calls fail instead of hanging when the server never answers.
fn connect(addr: SocketAddr) -> KvClient {
    let mut client = KvClient::connect(addr).unwrap_or_else(|e| panic!("connect: {e}"));
    ok(
        client.set_timeout(Some(std::time::Duration::from_secs(60))),
        "timeout",
    );
    client
}

fn ok<T>(result: Result<T, KvClientError>, context: &str) -> T {
    result.unwrap_or_else(|e| panic!("{context}: {e}"))
}

/// A value that names its key and version, of a length the seed picks.
fn value_for(rng: &mut Xoshiro256PlusPlus, key: &[u8], version: u64) -> Vec<u8> {
    let length = match rng.random_range(0..8) {
        0 => 0,
        1 => VALUE_SIZE_MAX_BYTES,
        _ => rng.random_range(1..20_000),
    };
    let seed = key
        .iter()
        .fold(version, |acc, &b| acc.wrapping_mul(31) ^ u64::from(b));
    (0..length)
        .map(|index| (seed.wrapping_add(index as u64 * 0x9e37) >> 5) as u8)
        .collect()
}

/// `rounds` of up to 16 pipelined requests on `keys` keys, each answer checked against the
/// model (applied in request order, as the server answers).
fn random_rounds(
    seed: u64,
    client: &mut KvClient,
    model: &mut HashMap<Vec<u8>, Vec<u8>>,
    rounds: usize,
    keys: u64,
) {
    random_rounds_on(seed, client, model, rounds, "key", keys);
}

/// [`random_rounds`] on the keys `{prefix}-0 .. {prefix}-{keys - 1}`.
fn random_rounds_on(
    seed: u64,
    client: &mut KvClient,
    model: &mut HashMap<Vec<u8>, Vec<u8>>,
    rounds: usize,
    prefix: &str,
    keys: u64,
) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for round in 0..rounds {
        let mut expected: HashMap<u64, (Status, Option<Vec<u8>>, String)> = HashMap::new();
        for _ in 0..rng.random_range(1..=16) {
            let key = format!("{prefix}-{}", rng.random_range(0..keys)).into_bytes();
            let label = format!(
                "seed {seed:#x} round {round}: {}",
                String::from_utf8_lossy(&key)
            );
            let (request_id, answer) = match rng.random_range(0..10) {
                0..=3 => {
                    let value = value_for(&mut rng, &key, round as u64);
                    let request = Request::Put {
                        key: &key,
                        value: &value,
                    };
                    let request_id = ok(client.send(&request), &label);
                    model.insert(key, value);
                    (request_id, (Status::Ok, None, format!("{label} PUT")))
                }
                4..=7 => {
                    let request_id = ok(client.send(&Request::Get { key: &key }), &label);
                    let (status, value) = match model.get(&key) {
                        Some(value) => (Status::Ok, Some(value.clone())),
                        None => (Status::NotFound, None),
                    };
                    (request_id, (status, value, format!("{label} GET")))
                }
                _ => {
                    let request_id = ok(client.send(&Request::Delete { key: &key }), &label);
                    let status = match model.remove(&key) {
                        Some(_) => Status::Ok,
                        None => Status::NotFound,
                    };
                    (request_id, (status, None, format!("{label} DELETE")))
                }
            };
            expected.insert(request_id, answer);
        }
        // Answers come as requests finish; operations on one key took effect in request
        // order, the order the model was applied in.
        while !expected.is_empty() {
            let response = ok(client.receive(), &format!("seed {seed:#x} round {round}"));
            let Some((status, value, label)) = expected.remove(&response.request_id) else {
                panic!("seed {seed:#x}: an answer to {} twice", response.request_id);
            };
            assert_eq!(response.status(), Some(status), "{label}");
            if let Some(value) = value {
                assert!(
                    response.value == value,
                    "{label}: wrong value ({} bytes)",
                    response.value.len()
                );
            }
        }
    }
}

fn check_model(seed: u64, client: &mut KvClient, model: &HashMap<Vec<u8>, Vec<u8>>, keys: u64) {
    for index in 0..keys {
        let key = format!("key-{index}").into_bytes();
        let found = ok(client.get(&key), "get");
        assert_eq!(
            found.as_ref(),
            model.get(&key),
            "seed {seed:#x}: key-{index}"
        );
    }
}

#[test]
fn random_operations_match_a_model_across_a_restart() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let backend = format!("file:{}", dir.path().join("kv").display());
    let mut model = HashMap::new();
    {
        let server = start(kv_config(&backend, Some(64 << 20)));
        let mut client = connect(kv_addr(&server));
        random_rounds(SEED, &mut client, &mut model, 60, 48);
        check_model(SEED, &mut client, &model, 48);
        ok(client.flush(), "flush");
        server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }
    // The second server opens the table it finds (no format).
    let server = start(kv_config(&backend, None));
    let mut client = connect(kv_addr(&server));
    check_model(SEED, &mut client, &model, 48);
    random_rounds(SEED + 1, &mut client, &mut model, 30, 48);
    check_model(SEED + 1, &mut client, &model, 48);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

/// Connections of the multi-thread test: with the kernel spreading them over the two
/// threads' `SO_REUSEPORT` sockets, all sixteen on one thread has odds of 2^-15.
const CONNECTIONS: usize = 16;
/// Keys each connection owns in the multi-thread test.
const KEYS_PER_CONNECTION: u64 = 6;

/// Every connection runs seeded pipelined rounds on its own keys at the same time (one OS
/// thread each), so requests of connections on both dataplane threads are in progress
/// together; returns the merged model.
fn concurrent_rounds(
    seed: u64,
    clients: &mut [KvClient],
    models: &mut [HashMap<Vec<u8>, Vec<u8>>],
    rounds: usize,
) {
    std::thread::scope(|scope| {
        for (index, (client, model)) in clients.iter_mut().zip(models.iter_mut()).enumerate() {
            scope.spawn(move || {
                let prefix = format!("c{index}");
                random_rounds_on(
                    seed + index as u64,
                    client,
                    model,
                    rounds,
                    &prefix,
                    KEYS_PER_CONNECTION,
                );
            });
        }
    });
}

/// Every key of every connection read through every connection: keys written through one
/// dataplane thread are read through the other.
fn check_everywhere(seed: u64, clients: &mut [KvClient], models: &[HashMap<Vec<u8>, Vec<u8>>]) {
    for (reader_index, reader) in clients.iter_mut().enumerate() {
        for (writer, model) in models.iter().enumerate() {
            for key_index in 0..KEYS_PER_CONNECTION {
                let key = format!("c{writer}-{key_index}").into_bytes();
                let found = ok(reader.get(&key), "get");
                assert!(
                    found.as_ref() == model.get(&key),
                    "seed {seed:#x}: c{writer}-{key_index} read through connection \
                     {reader_index}: {:?} bytes, model {:?} bytes",
                    found.as_ref().map(Vec::len),
                    model.get(&key).map(Vec::len)
                );
            }
        }
    }
}

/// Both threads had connections, thread 1 forwarded its requests' table steps and thread 0
/// stepped exactly those.
fn check_forwarding(stats: &[reflex_server::CoreStats]) {
    let report: Vec<_> = stats
        .iter()
        .map(|s| (s.connections_accepted, s.kv_forwarded, s.kv_guests))
        .collect();
    eprintln!("per thread (connections, forwarded, guests): {report:?}");
    assert_eq!(stats.len(), 2);
    assert!(stats[0].connections_accepted > 0, "{report:?}");
    assert!(stats[1].connections_accepted > 0, "{report:?}");
    assert_eq!(
        stats[0].kv_forwarded, 0,
        "thread 0 owns the table: {report:?}"
    );
    assert!(stats[1].kv_forwarded > 0, "{report:?}");
    assert_eq!(stats[0].kv_guests, stats[1].kv_forwarded, "{report:?}");
    assert_eq!(stats[1].kv_guests, 0, "{report:?}");
}

/// The multi-thread model test on one driver: sixteen connections spread over both threads
/// run seeded rounds concurrently, every key is read through every connection, FLUSH,
/// shutdown; a new server on the same file finds every key through every connection, more
/// rounds, every key again.
fn connections_on_both_threads(driver: DriverChoice) {
    let seed = SEED ^ 0x7468_7265_6164;
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let backend = format!("file:{}", dir.path().join("kv").display());
    let server_config = |size_bytes| Config {
        driver,
        ..kv_config(&backend, size_bytes)
    };
    let mut models: Vec<HashMap<Vec<u8>, Vec<u8>>> = vec![HashMap::new(); CONNECTIONS];
    {
        let server = start(server_config(Some(64 << 20)));
        let addr = kv_addr(&server);
        let mut clients: Vec<KvClient> = (0..CONNECTIONS).map(|_| connect(addr)).collect();
        concurrent_rounds(seed, &mut clients, &mut models, 12);
        check_everywhere(seed, &mut clients, &models);
        // A FLUSH through each connection, all at once.
        for client in &mut clients {
            ok(client.send(&Request::Flush), "flush");
        }
        for client in &mut clients {
            let response = ok(client.receive(), "flush");
            assert_eq!(response.status(), Some(Status::Ok), "FLUSH");
        }
        drop(clients);
        check_forwarding(&server.shutdown().unwrap_or_else(|e| panic!("{e}")));
    }
    let server = start(server_config(None));
    let addr = kv_addr(&server);
    let mut clients: Vec<KvClient> = (0..CONNECTIONS).map(|_| connect(addr)).collect();
    check_everywhere(seed, &mut clients, &models);
    concurrent_rounds(seed + 100, &mut clients, &mut models, 8);
    check_everywhere(seed + 100, &mut clients, &models);
    drop(clients);
    check_forwarding(&server.shutdown().unwrap_or_else(|e| panic!("{e}")));
}

#[test]
fn connections_on_both_threads_match_a_model_across_a_restart_io_uring() {
    connections_on_both_threads(common::io_uring_driver());
}

#[test]
fn connections_on_both_threads_match_a_model_across_a_restart_epoll() {
    connections_on_both_threads(DriverChoice::Epoll);
}

/// Inter-core migration on (every flow, no imbalance gate, 2 device places per thread, a
/// 300 µs memory device): sixteen connections over both threads run concurrent rounds, every
/// key is read through every connection; the KV tables' bucket and value reads that moved to
/// the other thread's device queue were all served and none refused, and every answer
/// matched the model.
#[test]
fn kv_reads_migrate_between_threads_and_every_answer_matches_the_model() {
    use reflex_qos::{FairMode, FairQueueConfig, FairnessConfig, MigrationConfig, MigrationFlows};
    let seed = SEED ^ 0x6d69_6772;
    let mut server_config = kv_config("fault(delay=300us):mem:64M", None);
    server_config.qos_config.fairness = FairQueueConfig {
        mode: FairMode::Fifo,
        be_device_depth_max: 2,
        monitor: FairnessConfig {
            window_us: 5_000,
            samples_min: 1,
            ..FairnessConfig::default()
        },
        migration: MigrationConfig {
            enabled: true,
            flows: MigrationFlows::All,
            requires_imbalance: false,
            in_transit_per_pair_max: 4,
            ..MigrationConfig::default()
        },
        ..FairQueueConfig::default()
    };
    let server = start(server_config);
    let addr = kv_addr(&server);
    let mut clients: Vec<KvClient> = (0..CONNECTIONS).map(|_| connect(addr)).collect();
    let mut models: Vec<HashMap<Vec<u8>, Vec<u8>>> = vec![HashMap::new(); CONNECTIONS];
    concurrent_rounds(seed, &mut clients, &mut models, 10);
    check_everywhere(seed, &mut clients, &models);
    drop(clients);
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let report: Vec<_> = stats
        .iter()
        .map(|s| (s.migrated_sent, s.migrated_served, s.migrated_refused))
        .collect();
    eprintln!("per thread (sent, served, refused): {report:?}");
    let sent: u64 = stats.iter().map(|s| s.migrated_sent).sum();
    let served: u64 = stats.iter().map(|s| s.migrated_served).sum();
    assert!(sent > 0, "no KV read migrated: {report:?}");
    assert_eq!(sent, served, "{report:?}");
    assert!(stats.iter().all(|s| s.migrated_refused == 0), "{report:?}");
    check_forwarding(&stats);
}

/// Sends `header` and `payload_bytes` bytes of payload; returns the answer's status.
fn raw_status(client: &mut KvClient, header: RequestHeader, payload_bytes: usize) -> Status {
    ok(client.send_raw(&header.to_bytes()), "send header");
    ok(client.send_raw(&vec![0x5a; payload_bytes]), "send payload");
    let response = ok(client.receive_any(), "answer");
    assert_eq!(response.request_id, header.request_id);
    assert_eq!(response.opcode_raw, header.opcode_raw);
    assert!(response.value.is_empty());
    response
        .status()
        .unwrap_or_else(|| panic!("unknown status {}", response.status_raw))
}

#[test]
fn malformed_frames_get_statuses_and_only_a_bad_magic_closes() {
    let server = start(kv_config("mem:32M", None));
    let addr = kv_addr(&server);
    let mut client = connect(addr);
    let header = |opcode: Opcode, key: u16, value: u32| RequestHeader::new(opcode, 77, key, value);
    let cases = [
        (
            RequestHeader {
                version: 2,
                ..header(Opcode::Get, 3, 0)
            },
            Status::Invalid,
        ),
        (
            RequestHeader {
                opcode_raw: 9,
                ..header(Opcode::Get, 3, 0)
            },
            Status::Invalid,
        ),
        (
            RequestHeader {
                flags: 1,
                ..header(Opcode::Get, 3, 0)
            },
            Status::Invalid,
        ),
        (
            RequestHeader {
                reserved: 1,
                ..header(Opcode::Put, 3, 5)
            },
            Status::Invalid,
        ),
        (header(Opcode::Get, 300, 0), Status::TooLarge),
        (
            header(Opcode::Put, 4, VALUE_SIZE_MAX_BYTES as u32 + 1),
            Status::TooLarge,
        ),
        (header(Opcode::Get, 0, 0), Status::Invalid),
        (header(Opcode::Get, 3, 10), Status::Invalid),
        (header(Opcode::Flush, 3, 0), Status::Invalid),
    ];
    for (header, status) in cases {
        let payload = header.payload_length_bytes() as usize;
        assert_eq!(
            raw_status(&mut client, header, payload),
            status,
            "{header:?}"
        );
    }
    // The stream stayed in step: real requests work on the same connection.
    ok(client.put(b"alive", b"yes"), "put after malformed frames");
    assert_eq!(ok(client.get(b"alive"), "get"), Some(b"yes".to_vec()));
    // Unknown keys.
    assert_eq!(ok(client.get(b"never-stored"), "get unknown"), None);
    assert!(!ok(client.delete(b"never-stored"), "delete unknown"));
    // An oversize value, sent whole: refused with TOO_LARGE, its payload skipped, nothing
    // stored.
    let oversize = vec![1u8; VALUE_SIZE_MAX_BYTES + 1];
    let request = Request::Put {
        key: b"big",
        value: &oversize,
    };
    ok(client.send(&request), "send oversize");
    let refused = ok(client.receive(), "oversize answer");
    assert_eq!(refused.status(), Some(Status::TooLarge));
    assert_eq!(ok(client.get(b"big"), "get refused key"), None);
    // The largest value round-trips.
    let largest = vec![7u8; VALUE_SIZE_MAX_BYTES];
    ok(client.put(b"big", &largest), "put 64 KiB");
    assert!(ok(client.get(b"big"), "get 64 KiB") == Some(largest));

    // A wrong magic closes that connection, and only that one.
    let mut broken = connect(addr);
    ok(broken.send_raw(&[0u8; 24]), "send garbage");
    assert!(matches!(
        broken.receive_any(),
        Err(KvClientError::Closed) | Err(KvClientError::Io(_))
    ));
    assert_eq!(
        ok(client.get(b"alive"), "get after another connection broke"),
        Some(b"yes".to_vec())
    );
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn two_connections_racing_on_the_same_keys_see_whole_values() {
    let server = start(kv_config("mem:32M", None));
    let addr = kv_addr(&server);
    const KEYS: usize = 4;
    const ROUNDS: u64 = 150;
    // Each value is 8-byte words, all equal to (writer << 32 | version): a torn or mixed
    // value shows as unequal words.
    fn value(writer: u64, version: u64, length_words: usize) -> Vec<u8> {
        let word = (writer << 32 | version).to_le_bytes();
        word.iter()
            .copied()
            .cycle()
            .take(length_words * 8)
            .collect()
    }
    let writers: Vec<_> = (0..2u64)
        .map(|writer| {
            std::thread::spawn(move || {
                let mut client = connect(addr);
                let mut rng = Xoshiro256PlusPlus::seed_from_u64(SEED ^ writer);
                let mut last = [None; KEYS];
                for version in 1..=ROUNDS {
                    let key_index = rng.random_range(0..KEYS);
                    let key = format!("race-{key_index}").into_bytes();
                    let words = rng.random_range(1..2048);
                    let written = value(writer, version, words);
                    // Pipelined: PUT then GET of the same key; the GET takes effect after the
                    // PUT (same key, same connection) whichever answer comes first.
                    let put_id = ok(
                        client.send(&Request::Put {
                            key: &key,
                            value: &written,
                        }),
                        "put",
                    );
                    let get_id = ok(client.send(&Request::Get { key: &key }), "get");
                    let first = ok(client.receive(), "first answer");
                    let second = ok(client.receive(), "second answer");
                    let (put, got) = if first.request_id == put_id {
                        (first, second)
                    } else {
                        (second, first)
                    };
                    assert_eq!((put.request_id, got.request_id), (put_id, get_id));
                    assert_eq!(put.status(), Some(Status::Ok));
                    assert_eq!(got.status(), Some(Status::Ok));
                    let words_seen: Vec<&[u8]> = got.value.chunks(8).collect();
                    assert!(
                        !words_seen.is_empty() && words_seen.iter().all(|w| *w == words_seen[0]),
                        "a torn value"
                    );
                    let word = u64::from_le_bytes(words_seen[0].try_into().unwrap_or([0; 8]));
                    if word >> 32 == writer {
                        // Our own: the one just written (nothing of ours came after it).
                        assert_eq!(
                            got.value, written,
                            "writer {writer} read an older value of its own"
                        );
                    }
                    last[key_index] = Some(version);
                }
                last
            })
        })
        .collect();
    let lasts: Vec<[Option<u64>; KEYS]> = writers
        .into_iter()
        .map(|thread| {
            thread
                .join()
                .unwrap_or_else(|_| panic!("a writer panicked"))
        })
        .collect();
    let mut client = connect(addr);
    for key_index in 0..KEYS {
        let key = format!("race-{key_index}").into_bytes();
        let Some(found) = ok(client.get(&key), "final get") else {
            assert!(lasts.iter().all(|last| last[key_index].is_none()));
            continue;
        };
        let word = u64::from_le_bytes(found[..8].try_into().unwrap_or([0; 8]));
        let (writer, version) = (word >> 32, word & 0xffff_ffff);
        assert_eq!(
            lasts[writer as usize][key_index],
            Some(version),
            "race-{key_index} holds a value that was not its writer's last"
        );
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

/// `reflexd` with two threads, a 4 MiB arena and its KV port on namespace `namespace_flag`.
fn spawn_kv(namespace_flag: &str) -> (Daemon, SocketAddr) {
    let daemon = Daemon::spawn(&[
        "--port",
        "0",
        "--no-original",
        "--no-nvme-tcp",
        "--no-nbd",
        "--kv-port",
        "0",
        "--threads",
        "2",
        "--arena-size",
        "4M",
        "--namespace",
        namespace_flag,
    ]);
    let kv_addr = daemon.field("kv");
    (daemon, kv_addr)
}

/// The real binary (`--kv-port`): keys FLUSHed survive a SIGKILL; keys answered after the
/// FLUSH read back whole or absent, never as other bytes, and the table opens (repairing what
/// it must); after a SIGTERM (whose shutdown flushes) every answered key is there.
#[test]
fn the_binary_keeps_flushed_keys_across_sigkill_and_every_key_across_sigterm() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let flag = format!("1=file:{},size=16M", dir.path().join("kv").display());
    let value = |index: u64, round: u64| -> Vec<u8> {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(SEED ^ index << 8 ^ round);
        let length = rng.random_range(0..12_000);
        (0..length).map(|_| rng.random()).collect()
    };
    let key = |index: u64| format!("crash-{index}").into_bytes();
    let (daemon, kv_addr) = spawn_kv(&flag);
    let mut client = connect(kv_addr);
    for index in 0..60 {
        ok(client.put(&key(index), &value(index, 0)), "put");
    }
    ok(client.flush(), "flush");
    // Answered, not flushed: may or may not survive a SIGKILL, but only whole.
    for index in 30..90 {
        ok(client.put(&key(index), &value(index, 1)), "put after flush");
    }
    daemon.kill();
    drop(client);

    let (daemon, kv_addr) = spawn_kv(&flag);
    let mut client = connect(kv_addr);
    for index in 0..90 {
        let found = ok(client.get(&key(index)), "get after SIGKILL");
        let allowed: Vec<Option<Vec<u8>>> = match index {
            0..30 => vec![Some(value(index, 0))],
            30..60 => vec![Some(value(index, 0)), Some(value(index, 1))],
            _ => vec![None, Some(value(index, 1))],
        };
        assert!(allowed.contains(&found), "crash-{index} after SIGKILL");
    }
    // Now every answered PUT survives a SIGTERM: its shutdown flushes the namespace.
    for index in 0..90 {
        ok(
            client.put(&key(index), &value(index, 2)),
            "put before SIGTERM",
        );
    }
    ok(client.delete(&key(7)).map(|found| assert!(found)), "delete");
    daemon.terminate();
    drop(client);

    let (daemon, kv_addr) = spawn_kv(&flag);
    let mut client = connect(kv_addr);
    for index in 0..90 {
        let expected = (index != 7).then(|| value(index, 2));
        assert_eq!(
            ok(client.get(&key(index)), "get after SIGTERM"),
            expected,
            "crash-{index}"
        );
    }
    drop(client);
    daemon.terminate();
}

/// Connections that vanish with KV requests in progress (payloads half sent, answers never
/// read) leave nothing behind: the keys they touched are served to the next connection (no
/// gate place leaked), every value read back is whole, and after a restart the table opens
/// with the same keys.
///
/// A vanished client's requests still in its socket are the server's to serve whenever it
/// reads them, after a later client's too (nothing was answered, so any order is right): on
/// the epoll driver under disk load, a round's PUT of `k0` landed after the last client's PUT
/// of `k0` (3 of 630 runs). So the last client checks that it reads its own writes on keys
/// no vanished client wrote (`n0`..`n3`), and only that the old keys take a PUT and read
/// back whole.
#[test]
fn connections_closing_mid_operation_leave_the_table_consistent() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let backend = format!("file:{}", dir.path().join("kv").display());
    let server = start(kv_config(&backend, Some(32 << 20)));
    let addr = kv_addr(&server);
    // Each value is one byte repeated: a mixed value shows.
    let whole = |value: &[u8]| value.iter().all(|&b| b == value[0]);
    for round in 0..6u8 {
        let mut client = connect(addr);
        for index in 0..24u8 {
            let key = [b'k', index % 4];
            let value = vec![round * 32 + index; 40_000];
            ok(
                client.send(&Request::Put {
                    key: &key,
                    value: &value,
                }),
                "put",
            );
        }
        // Half a PUT: header, key and part of the value, then gone.
        let header = RequestHeader::new(Opcode::Put, 999, 2, 30_000);
        ok(client.send_raw(&header.to_bytes()), "header");
        ok(client.send_raw(b"k\x01"), "key");
        ok(client.send_raw(&[0xee; 10_000]), "part of the value");
        drop(client);
    }
    let mut client = connect(addr);
    for index in 0..4u8 {
        let key = [b'k', index];
        if let Some(value) = ok(client.get(&key), "get after the closes") {
            assert!(
                !value.is_empty() && whole(&value),
                "k{index}: a mixed value"
            );
        }
        ok(client.put(&key, &[index; 5000]), "put after the closes");
        let value = ok(client.get(&key), "get");
        assert!(
            value.is_some_and(|value| !value.is_empty() && whole(&value)),
            "k{index}: a mixed or missing value"
        );
        let new_key = [b'n', index];
        ok(client.put(&new_key, &[index; 5000]), "put of a new key");
        assert_eq!(ok(client.get(&new_key), "get"), Some(vec![index; 5000]));
    }
    ok(client.flush(), "flush");
    drop(client);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let server = start(kv_config(&backend, None));
    let mut client = connect(kv_addr(&server));
    for index in 0..4u8 {
        assert_eq!(
            ok(client.get(&[b'n', index]), "get after restart"),
            Some(vec![index; 5000])
        );
        let value = ok(client.get(&[b'k', index]), "get after restart");
        assert!(
            value.is_some_and(|value| !value.is_empty() && whole(&value)),
            "k{index} after restart: a mixed or missing value"
        );
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

/// Seeded hostile input: headers with the right magic and random fields (versions, opcodes,
/// flags, key and value lengths up to the maximum and beyond) with random payloads, and
/// random bytes, over several connections. Every well-framed request is answered with a
/// status, the server keeps serving, and it shuts down cleanly (a panicking dataplane thread
/// would fail the shutdown).
#[test]
fn random_frames_never_hurt_the_server() {
    let server = start(kv_config("mem:32M", None));
    let addr = kv_addr(&server);
    for connection in 0..8u64 {
        let seed = SEED ^ 0xbad ^ connection;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut client = connect(addr);
        let mut answers_due = 0;
        for _ in 0..40 {
            let mut header = RequestHeader::new(Opcode::Get, rng.random(), 1, 0);
            header.version = if rng.random_range(0..4) == 0 {
                rng.random()
            } else {
                1
            };
            header.opcode_raw = rng.random_range(0..6);
            header.flags = if rng.random_range(0..8) == 0 {
                rng.random()
            } else {
                0
            };
            header.reserved = if rng.random_range(0..8) == 0 {
                rng.random()
            } else {
                0
            };
            header.key_length_bytes = rng.random_range(0..300);
            header.value_length_bytes = match rng.random_range(0..4) {
                0 => 0,
                1 => rng.random_range(0..70_000),
                _ => rng.random_range(0..5_000),
            };
            let payload: Vec<u8> = (0..header.payload_length_bytes())
                .map(|_| rng.random())
                .collect();
            ok(client.send_raw(&header.to_bytes()), "header");
            ok(client.send_raw(&payload), "payload");
            answers_due += 1;
        }
        for _ in 0..answers_due {
            let response = ok(client.receive_any(), &format!("seed {seed:#x}"));
            assert!(
                response.status().is_some(),
                "seed {seed:#x}: unknown status"
            );
        }
        if connection % 2 == 1 {
            // Then garbage: broken framing closes this connection only.
            let garbage: Vec<u8> = (0..100).map(|_| rng.random()).collect();
            ok(client.send_raw(&garbage), "garbage");
        }
    }
    let mut client = connect(addr);
    ok(client.put(b"still", b"here"), "put after the hostile input");
    assert_eq!(ok(client.get(b"still"), "get"), Some(b"here".to_vec()));
    drop(client);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[path = "admin_common/mod.rs"]
mod admin_common;

/// Creates best-effort tenant `name` on `namespace_id` through the admin API; its handle.
fn create_tenant(api: &admin_common::Api, namespace_id: u32, name: &str) -> u64 {
    let created = api.post(
        &format!("/v1/namespaces/{namespace_id}/tenants"),
        &format!(r#"{{"name": "{name}", "class": "be"}}"#),
    );
    assert_eq!(created.status, 201, "{}", created.text);
    let handle = created.json()["tenant"]["handle"]
        .as_str()
        .map(|text| u64::from_str_radix(text, 16));
    match handle {
        Some(Ok(handle)) => handle,
        _ => panic!("no handle: {}", created.text),
    }
}

/// The raw status of a failed call (`None`: it succeeded).
fn refused_status<T: std::fmt::Debug>(result: Result<T, KvClientError>) -> Option<Status> {
    match result {
        Ok(_) => None,
        Err(KvClientError::Status { status_raw }) => Status::from_u16(status_raw).ok(),
        Err(e) => panic!("not a status answer: {e}"),
    }
}

/// KV BIND on one driver: two connections bound to two tenants of the table's namespace are
/// charged to their own tenants; a handle of another namespace or of no tenant is refused
/// `NO_TENANT` and the old binding stays; a BIND pipelined between requests applies in
/// order; a tenant deleted through the admin API makes its connection's next request
/// `PERMISSION`; BIND 0 goes back to the port's tenant.
fn bind_charges_the_bound_tenant(driver: DriverChoice) {
    let mut server_config = kv_config("mem:32M", None);
    server_config.namespaces.push(namespace(2, "mem:32M", None));
    // Tenants can be added only where a device profile gives the scheduler its costs.
    for namespace in &mut server_config.namespaces {
        namespace.profile = Some(admin_common::profile("device-a-small.toml"));
    }
    server_config.driver = driver;
    server_config.admin = reflex_server::admin::AdminConfig::loopback();
    let server = start(server_config);
    let api = admin_common::Api::new(server.admin_addr().unwrap_or_else(|| panic!("no admin")));
    let sparse = create_tenant(&api, 1, "kv-sparse");
    let dense = create_tenant(&api, 1, "kv-dense");
    let elsewhere = create_tenant(&api, 2, "kv-elsewhere");
    let addr = kv_addr(&server);
    let mut first = connect(addr);
    let mut second = connect(addr);
    ok(first.bind(sparse), "bind sparse");
    ok(second.bind(dense), "bind dense");
    // Refused: another namespace's tenant, and no tenant at all; the binding stays.
    assert_eq!(
        refused_status(first.bind(elsewhere)),
        Some(Status::NoTenant)
    );
    assert_eq!(
        refused_status(first.bind(0x5eed_0000_dead_beef)),
        Some(Status::NoTenant)
    );
    // A BIND whose key is not 8 bytes is malformed.
    let bad = RequestHeader::new(Opcode::Bind, 1, 7, 0);
    assert_eq!(raw_status(&mut first, bad, 7), Status::Invalid);
    const FIRST_PUTS: u64 = 5;
    const SECOND_PUTS: u64 = 11;
    for number in 0..FIRST_PUTS {
        ok(first.put(format!("s{number}").as_bytes(), b"sparse"), "put");
    }
    for number in 0..SECOND_PUTS {
        ok(second.put(format!("d{number}").as_bytes(), b"dense"), "put");
    }
    // Pipelined: a PUT, a BIND to the other tenant, a GET, all in flight at once; each
    // answered, in the order the connection gives them.
    let key = sparse.to_le_bytes();
    let ids = [
        ok(
            second.send(&Request::Put {
                key: b"d-pipe",
                value: b"x",
            }),
            "send",
        ),
        ok(second.send(&Request::Bind { key: &key }), "send"),
        ok(second.send(&Request::Get { key: b"d-pipe" }), "send"),
    ];
    let mut statuses = HashMap::new();
    for _ in ids {
        let response = ok(second.receive(), "receive");
        statuses.insert(response.request_id, response.status());
    }
    for id in ids {
        assert_eq!(statuses.get(&id), Some(&Some(Status::Ok)), "{statuses:?}");
    }
    ok(second.bind(dense), "bind dense again");
    // Deleting the tenant revokes it: the next request of its connection is refused.
    assert_eq!(api.delete("/v1/namespaces/1/tenants/kv-dense").status, 204);
    assert_eq!(
        refused_status(second.put(b"d-late", b"x")),
        Some(Status::Permission)
    );
    assert_eq!(refused_status(second.get(b"d0")), Some(Status::Permission));
    // Back to the port's tenant: served again.
    ok(second.bind(0), "unbind");
    assert_eq!(ok(second.get(b"d0"), "get"), Some(b"dense".to_vec()));
    assert_eq!(ok(first.get(b"s0"), "get"), Some(b"sparse".to_vec()));
    drop((first, second));
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let charged = |handle: u64| -> u64 {
        stats
            .iter()
            .flat_map(|core| core.tenants.iter())
            .filter(|tenant| tenant.handle == handle)
            .map(|tenant| tenant.arrivals)
            .sum()
    };
    // Arrivals per tenant: `sparse` its 5 PUTs, 1 GET, and `second`'s pipelined GET;
    // `dense` its 11 PUTs and the pipelined PUT. Nothing reached the other namespace's.
    eprintln!(
        "arrivals: sparse {} dense {} elsewhere {}",
        charged(sparse),
        charged(dense),
        charged(elsewhere)
    );
    assert_eq!(charged(sparse), FIRST_PUTS + 2);
    assert_eq!(charged(dense), SECOND_PUTS + 1);
    assert_eq!(charged(elsewhere), 0);
}

#[test]
fn bind_charges_the_bound_tenant_io_uring() {
    bind_charges_the_bound_tenant(common::io_uring_driver());
}

#[test]
fn bind_charges_the_bound_tenant_epoll() {
    bind_charges_the_bound_tenant(DriverChoice::Epoll);
}
