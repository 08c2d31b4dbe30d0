//! The key-value front end (`docs/KV.md`) through the real dataplane in virtual time: KV
//! clients on the simulator's network, connected to both dataplane threads (thread 0 owns the
//! table, thread 1 forwards its requests' table steps there), the table formatted on a memory
//! device whose every completion is delayed by the fault-injecting wrapper (so each step
//! completes asynchronously), answers checked against a `HashMap` model, and the table on the
//! device reopened after the shutdown and compared with the model.

mod common;

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Arc;

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_dataplane::Limits;
use reflex_flash::Device;
use reflex_flash::fault::{Delay, DelayPick, FaultDevice, FaultPlan};
use reflex_proto::kv::{self, Request, Status};
use reflex_qos::Nanos;
use reflex_sim::{NetworkModel, SocketId, VirtualListener, VirtualServer};

/// Two threads, one namespace (4 MiB of memory, every operation delayed 30 µs), the KV
/// listener (index 0).
fn server() -> VirtualServer {
    server_on(memory_device())
}

fn memory_device() -> Arc<dyn Device> {
    Arc::new(reflex_flash::mem::MemDevice::new(4 << 20).unwrap_or_else(|e| panic!("{e}")))
}

/// [`server`] on `mem`, which the test keeps to reopen the table after the shutdown.
fn server_on(mem: Arc<dyn Device>) -> VirtualServer {
    let plan = FaultPlan {
        delay: Some(Delay {
            added: Nanos(30_000),
            pick: DelayPick::Every(NonZeroU64::MIN),
        }),
        ..FaultPlan::default()
    };
    let device = FaultDevice::new(mem, plan).unwrap_or_else(|e| panic!("{e}"));
    common::one_namespace_server_on(
        2,
        Arc::new(device),
        Limits::with_arena(8 << 20, 25),
        NetworkModel {
            latency: Nanos(10_000),
            ..NetworkModel::default()
        },
        vec![VirtualListener::Kv {
            namespace_index: 0,
            tenant: None,
        }],
    )
}

/// One KV client: its socket, the answers it parsed (by request id), the bytes not parsed yet.
struct Client {
    socket: SocketId,
    next_id: u64,
    answers: HashMap<u64, (u8, Status, Vec<u8>)>,
    received: Vec<u8>,
}

impl Client {
    /// A client of thread 0, which owns the table.
    fn connect(server: &mut VirtualServer) -> Client {
        Client::connect_to(server, 0)
    }

    /// A client of dataplane thread `thread`.
    fn connect_to(server: &mut VirtualServer, thread: u16) -> Client {
        let socket = server
            .connect(thread, 0, None)
            .unwrap_or_else(|e| panic!("connect: {e}"));
        assert_eq!(server.socket_thread(socket), thread);
        Client {
            socket,
            next_id: 0,
            answers: HashMap::new(),
            received: Vec::new(),
        }
    }

    /// Sends `request`; returns its id.
    fn send(&mut self, server: &mut VirtualServer, request: Request<'_>) -> u64 {
        self.next_id += 1;
        let mut frame = vec![0u8; request.encoded_length_bytes()];
        let length = request
            .encode_into(self.next_id, &mut frame)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(length, frame.len());
        server.client_send(self.socket, &frame);
        self.next_id
    }

    fn read(&mut self, server: &mut VirtualServer) {
        server.client_read(self.socket, &mut self.received);
        while let Some(frame) =
            kv::decode_response_frame(&self.received).unwrap_or_else(|e| panic!("{e}"))
        {
            let status = Status::from_u16(frame.header.status_raw)
                .unwrap_or_else(|e| panic!("unknown status: {e}"));
            let previous = self.answers.insert(
                frame.header.request_id,
                (frame.header.opcode_raw, status, frame.value.to_vec()),
            );
            assert!(
                previous.is_none(),
                "request {} answered twice",
                frame.header.request_id
            );
            let length = frame.length_bytes;
            self.received.drain(..length);
        }
    }
}

/// Runs the server until every listed request of every client is answered.
fn await_answers(server: &mut VirtualServer, clients: &mut [&mut Client], ids: &[(usize, u64)]) {
    for _ in 0..100_000 {
        for client in clients.iter_mut() {
            client.read(server);
        }
        if ids
            .iter()
            .all(|&(client, id)| clients[client].answers.contains_key(&id))
        {
            return;
        }
        let Some(next) = server.next_event() else {
            panic!("nothing more happens and requests {ids:?} are not all answered");
        };
        server.run_instant(next);
    }
    panic!("requests {ids:?} not answered after 100,000 instants");
}

/// One request on one client, run to its answer: `(status, value)`.
fn call(
    server: &mut VirtualServer,
    client: &mut Client,
    request: Request<'_>,
) -> (Status, Vec<u8>) {
    let opcode = request.opcode().as_u8();
    let id = client.send(server, request);
    await_answers(server, &mut [&mut *client], &[(0, id)]);
    let (echoed, status, value) = client.answers[&id].clone();
    assert_eq!(echoed, opcode, "request {id}: opcode echoed");
    (status, value)
}

/// A graceful shutdown, run to its end.
fn shut_down(server: &mut VirtualServer) {
    server.begin_shutdown();
    server.run_instant(server.now());
    while !server.is_finished() {
        let next = server
            .next_event()
            .unwrap_or_else(|| panic!("shutdown stalled"));
        server.run_instant(next);
    }
}

fn value_of(seed: u64, length: usize) -> Vec<u8> {
    (0..length)
        .map(|index| (seed.wrapping_mul(31).wrapping_add(index as u64 * 7) % 251) as u8)
        .collect()
}

/// Every key of `model` (and no other of `keys`) in the table on `device`, opened as a
/// restarted server would open it.
fn check_reopened(device: Arc<dyn Device>, model: &HashMap<Vec<u8>, Vec<u8>>, keys: &[Vec<u8>]) {
    let blocks = reflex_kv::DeviceBlocks::new(device).unwrap_or_else(|e| panic!("{e}"));
    let mut store = reflex_kv::KvStore::open(blocks).unwrap_or_else(|e| panic!("reopen: {e}"));
    assert_eq!(store.len(), model.len() as u64, "keys after reopening");
    for key in keys {
        let found = store
            .get(key)
            .unwrap_or_else(|e| panic!("GET after reopening: {e}"));
        assert_eq!(
            found.as_ref(),
            model.get(key),
            "key {key:?} after reopening"
        );
    }
}

/// Each thread's statistics: `(kv_forwarded, kv_guests)`.
fn forwarding(server: &VirtualServer) -> Vec<(u64, u64)> {
    server
        .stats()
        .iter()
        .map(|stats| (stats.kv_forwarded, stats.kv_guests))
        .collect()
}

#[test]
fn every_thread_accepts_and_a_key_crosses_threads_both_ways() {
    let mut server = server();
    assert!(server.is_accepting(0, 0));
    assert!(server.is_accepting(1, 0));
    assert_eq!(
        server.dataplane(0).kv_len(),
        Some(0),
        "thread 0 owns the table"
    );
    assert_eq!(server.dataplane(1).kv_len(), None);
    let mut owner = Client::connect_to(&mut server, 0);
    let mut other = Client::connect_to(&mut server, 1);
    // Written through thread 1 (forwarded to the owner), read through thread 0.
    let value = value_of(7, 20_000);
    let (status, _) = call(
        &mut server,
        &mut other,
        Request::Put {
            key: b"crossing",
            value: &value,
        },
    );
    assert_eq!(status, Status::Ok);
    let (status, seen) = call(&mut server, &mut owner, Request::Get { key: b"crossing" });
    assert_eq!(status, Status::Ok);
    assert!(seen == value, "thread 0 reads what thread 1 wrote");
    // And back: written through thread 0, read and deleted through thread 1.
    let newer = value_of(8, 3);
    let (status, _) = call(
        &mut server,
        &mut owner,
        Request::Put {
            key: b"crossing",
            value: &newer,
        },
    );
    assert_eq!(status, Status::Ok);
    let (status, seen) = call(&mut server, &mut other, Request::Get { key: b"crossing" });
    assert_eq!((status, seen), (Status::Ok, newer));
    let (status, _) = call(
        &mut server,
        &mut other,
        Request::Delete { key: b"crossing" },
    );
    assert_eq!(status, Status::Ok);
    let (status, _) = call(&mut server, &mut owner, Request::Get { key: b"crossing" });
    assert_eq!(status, Status::NotFound);
    let (status, _) = call(&mut server, &mut other, Request::Flush);
    assert_eq!(status, Status::Ok);
    assert_eq!(
        forwarding(&server),
        vec![(0, 4), (4, 0)],
        "thread 1's PUT, GET, DELETE and FLUSH were stepped on thread 0"
    );
    assert_eq!(server.dataplane(0).kv_guests_in_use(), 0);
    // Each request's device operations went through its own connection's thread's
    // scheduler, charged to the KV port's tenant there. Thread 1: PUT (bucket read, value
    // write, bucket write), GET (bucket, value), DELETE (bucket read and write), FLUSH;
    // thread 0: GET (bucket, value), PUT (3), GET of the deleted key (one bucket).
    let charged: Vec<u64> = server
        .stats()
        .iter()
        .map(|stats| stats.tenants.iter().map(|tenant| tenant.requests).sum())
        .collect();
    assert_eq!(charged, vec![6, 8], "device operations admitted per thread");
    shut_down(&mut server);
}

/// Seeded rounds of pipelined PUT, GET and DELETE from four connections, two on each
/// thread, against a model. In a round each key is used by one connection only, so the
/// model applied in each connection's order predicts every answer; a FLUSH ends some rounds.
/// After the shutdown the table is reopened from the device and must equal the model.
#[test]
fn random_operations_on_both_threads_match_a_model_and_the_reopened_table() {
    let seed = 0x5eed_0014;
    eprintln!("seed {seed:#x}");
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let device = memory_device();
    let mut server = server_on(Arc::clone(&device));
    let mut clients: Vec<Client> = (0..4u16)
        .map(|index| Client::connect_to(&mut server, index % 2))
        .collect();
    let keys: Vec<Vec<u8>> = (0..24)
        .map(|k| format!("model-key-{k}").into_bytes())
        .collect();
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    for round in 0..30u64 {
        // Each key belongs to one client this round.
        let owners: Vec<usize> = (0..keys.len())
            .map(|_| (rng.next_u64() % 4) as usize)
            .collect();
        let mut expected: Vec<(usize, u64, Status, Option<Vec<u8>>)> = Vec::new();
        for step in 0..16u64 {
            let key_index = (rng.next_u64() % keys.len() as u64) as usize;
            let key = &keys[key_index];
            let client = owners[key_index];
            let (request_id, status, value) = match rng.next_u64() % 3 {
                0 => {
                    let length = match rng.next_u64() % 4 {
                        0 => 0,
                        1 => (rng.next_u64() % 200) as usize,
                        2 => (rng.next_u64() % 20_000) as usize,
                        _ => kv::VALUE_SIZE_MAX_BYTES - (rng.next_u64() % 3) as usize,
                    };
                    let value = value_of(round * 1000 + step, length);
                    let id = clients[client].send(&mut server, Request::Put { key, value: &value });
                    model.insert(key.clone(), value);
                    (id, Status::Ok, None)
                }
                1 => {
                    let id = clients[client].send(&mut server, Request::Get { key });
                    match model.get(key) {
                        Some(value) => (id, Status::Ok, Some(value.clone())),
                        None => (id, Status::NotFound, Some(Vec::new())),
                    }
                }
                _ => {
                    let id = clients[client].send(&mut server, Request::Delete { key });
                    let status = if model.remove(key).is_some() {
                        Status::Ok
                    } else {
                        Status::NotFound
                    };
                    (id, status, None)
                }
            };
            expected.push((client, request_id, status, value));
        }
        if round % 5 == 4 {
            let client = (rng.next_u64() % 4) as usize;
            let id = clients[client].send(&mut server, Request::Flush);
            expected.push((client, id, Status::Ok, None));
        }
        let ids: Vec<(usize, u64)> = expected.iter().map(|e| (e.0, e.1)).collect();
        let mut refs: Vec<&mut Client> = clients.iter_mut().collect();
        await_answers(&mut server, &mut refs, &ids);
        for (client, id, status, value) in expected {
            let (_, seen_status, seen_value) = clients[client].answers[&id].clone();
            assert_eq!(
                seen_status, status,
                "seed {seed:#x} round {round} request {id}"
            );
            if let Some(value) = value {
                assert!(
                    seen_value == value,
                    "seed {seed:#x} round {round} request {id}: value"
                );
            }
        }
    }
    assert_eq!(server.dataplane(0).kv_len(), Some(model.len() as u64));
    let flows = forwarding(&server);
    assert!(flows[1].0 > 50, "thread 1 forwarded: {flows:?}");
    assert_eq!(
        flows[1].0, flows[0].1,
        "every forwarded request reached the owner"
    );
    shut_down(&mut server);
    check_reopened(device, &model, &keys);
}

#[test]
fn put_get_delete_flush_match_a_model() {
    let mut server = server();
    let mut client = Client::connect(&mut server);
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    // Eight keys, values from empty to the largest, overwritten, deleted and read again.
    let lengths = [
        0,
        1,
        100,
        4095,
        4096,
        4097,
        16 << 10,
        kv::VALUE_SIZE_MAX_BYTES,
    ];
    for round in 0..24u64 {
        let key = format!("key-{}", round % 8).into_bytes();
        let key = if round % 8 == 7 {
            vec![b'k'; kv::KEY_SIZE_MAX_BYTES]
        } else {
            key
        };
        match round % 4 {
            0 | 1 => {
                let value = value_of(round, lengths[(round as usize * 3) % lengths.len()]);
                let (status, _) = call(
                    &mut server,
                    &mut client,
                    Request::Put {
                        key: &key,
                        value: &value,
                    },
                );
                assert_eq!(status, Status::Ok, "PUT {round}");
                model.insert(key.clone(), value);
            }
            2 => {
                let (status, _) = call(&mut server, &mut client, Request::Delete { key: &key });
                let expected = if model.remove(&key).is_some() {
                    Status::Ok
                } else {
                    Status::NotFound
                };
                assert_eq!(status, expected, "DELETE {round}");
            }
            _ => {
                let (status, _) = call(&mut server, &mut client, Request::Flush);
                assert_eq!(status, Status::Ok, "FLUSH {round}");
            }
        }
        for index in 0..8 {
            let key = if index == 7 {
                vec![b'k'; kv::KEY_SIZE_MAX_BYTES]
            } else {
                format!("key-{index}").into_bytes()
            };
            let (status, value) = call(&mut server, &mut client, Request::Get { key: &key });
            match model.get(&key) {
                Some(expected) => {
                    assert_eq!(status, Status::Ok, "GET key {index} after round {round}");
                    assert!(
                        value == *expected,
                        "GET key {index} after round {round}: value"
                    );
                }
                None => {
                    assert_eq!(
                        status,
                        Status::NotFound,
                        "GET key {index} after round {round}"
                    );
                    assert!(value.is_empty());
                }
            }
        }
    }
    assert!(
        server.now() > Nanos::ZERO,
        "the device answered in virtual time"
    );
}

#[test]
fn pipelined_requests_on_one_key_take_effect_in_order() {
    let mut server = server();
    let mut client = Client::connect(&mut server);
    let key = b"pipelined";
    let first = value_of(1, 5000);
    let second = value_of(2, 300);
    let put_1 = client.send(&mut server, Request::Put { key, value: &first });
    let get_1 = client.send(&mut server, Request::Get { key });
    let put_2 = client.send(
        &mut server,
        Request::Put {
            key,
            value: &second,
        },
    );
    let delete = client.send(&mut server, Request::Delete { key });
    let get_2 = client.send(&mut server, Request::Get { key });
    let ids: Vec<(usize, u64)> = [put_1, get_1, put_2, delete, get_2]
        .iter()
        .map(|&id| (0, id))
        .collect();
    await_answers(&mut server, &mut [&mut client], &ids);
    let answer = |id: u64| client.answers[&id].clone();
    assert_eq!(answer(put_1).1, Status::Ok);
    assert_eq!(answer(get_1).1, Status::Ok);
    assert!(
        answer(get_1).2 == first,
        "the GET between the PUTs sees the first"
    );
    assert_eq!(answer(put_2).1, Status::Ok);
    assert_eq!(answer(delete).1, Status::Ok);
    assert_eq!(answer(get_2).1, Status::NotFound);
}

#[test]
fn two_connections_racing_on_one_key_agree_on_one_value() {
    let mut server = server();
    let mut a = Client::connect(&mut server);
    let mut b = Client::connect_to(&mut server, 1);
    let key = b"contended";
    for round in 0..8u64 {
        let value_a = value_of(2 * round, 1000 + round as usize * 3000);
        let value_b = value_of(2 * round + 1, 20_000 - round as usize * 2000);
        // Both PUTs leave their clients at the same instant.
        let put_a = a.send(
            &mut server,
            Request::Put {
                key,
                value: &value_a,
            },
        );
        let put_b = b.send(
            &mut server,
            Request::Put {
                key,
                value: &value_b,
            },
        );
        await_answers(
            &mut server,
            &mut [&mut a, &mut b],
            &[(0, put_a), (1, put_b)],
        );
        assert_eq!(a.answers[&put_a].1, Status::Ok, "round {round}: PUT on a");
        assert_eq!(b.answers[&put_b].1, Status::Ok, "round {round}: PUT on b");
        let get_a = a.send(&mut server, Request::Get { key });
        let get_b = b.send(&mut server, Request::Get { key });
        await_answers(
            &mut server,
            &mut [&mut a, &mut b],
            &[(0, get_a), (1, get_b)],
        );
        let (_, status_a, seen_a) = a.answers[&get_a].clone();
        let (_, status_b, seen_b) = b.answers[&get_b].clone();
        assert_eq!(
            (status_a, status_b),
            (Status::Ok, Status::Ok),
            "round {round}"
        );
        assert!(seen_a == seen_b, "round {round}: the connections disagree");
        assert!(
            seen_a == value_a || seen_a == value_b,
            "round {round}: a value neither PUT wrote"
        );
        // A DELETE on one connection racing a GET on the other: the GET sees the value or
        // nothing, and the key is gone afterwards.
        let delete = a.send(&mut server, Request::Delete { key });
        let get = b.send(&mut server, Request::Get { key });
        await_answers(&mut server, &mut [&mut a, &mut b], &[(0, delete), (1, get)]);
        assert_eq!(a.answers[&delete].1, Status::Ok, "round {round}: DELETE");
        let (_, status, seen) = b.answers[&get].clone();
        match status {
            Status::Ok => assert!(seen == seen_a, "round {round}: GET racing the DELETE"),
            Status::NotFound => assert!(seen.is_empty()),
            other => panic!("round {round}: GET racing the DELETE answered {other:?}"),
        }
        let (status, _) = call(&mut server, &mut b, Request::Get { key });
        assert_eq!(status, Status::NotFound, "round {round}: after the DELETE");
    }
    let flush = a.send(&mut server, Request::Flush);
    await_answers(&mut server, &mut [&mut a], &[(0, flush)]);
    assert_eq!(a.answers[&flush].1, Status::Ok);
    shut_down(&mut server);
    for socket in [a.socket, b.socket] {
        assert!(server.is_server_closed(socket));
    }
}

/// Two threads with inter-core migration of every flow's reads (no imbalance gate, 4 credits
/// per pair, 1 ms monitor windows, 2 device places per thread, a 100 µs memory device): the
/// KV table's bucket and value reads of a thread crowded with GETs go to the other thread's
/// device queue, and every value read back is the one written.
fn migration_server(device: Arc<dyn Device>) -> VirtualServer {
    use reflex_dataplane::control::{ControlSetup, HandleKeys, NamespaceControl, TenantLimits};
    use reflex_qos::{
        FairMode, FairQueueConfig, FairnessConfig, MigrationConfig, MigrationFlows, QosConfig,
    };
    let plan = FaultPlan::parse("delay=100us").unwrap_or_else(|e| panic!("{e}"));
    let device: Arc<dyn Device> =
        Arc::new(FaultDevice::new(device, plan).unwrap_or_else(|e| panic!("{e}")));
    let qos_config = QosConfig {
        fairness: FairQueueConfig {
            mode: FairMode::Fifo,
            be_device_depth_max: 2,
            monitor: FairnessConfig {
                window_us: 1_000,
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
        },
        ..QosConfig::default()
    };
    VirtualServer::new(reflex_sim::VirtualServerSetup {
        threads: 2,
        namespaces: vec![(common::NAMESPACE, device, false)],
        control: ControlSetup {
            threads: 2,
            handles: HandleKeys::Seeded(1),
            tenant_limits: TenantLimits::default(),
            qos_config: qos_config.clone(),
            qos_enabled: false,
            namespaces: vec![NamespaceControl {
                namespace_id: common::NAMESPACE,
                profile: None,
                tenants: Vec::new(),
            }],
        },
        qos_config,
        limits: Limits::with_arena(32 << 20, 25),
        network: NetworkModel::default(),
        listeners: vec![VirtualListener::Kv {
            namespace_index: 0,
            tenant: None,
        }],
        nbd_exports: Vec::new(),
        nbd_default_export: None,
        composites: Vec::new(),
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn kv_reads_migrate_between_threads_and_every_answer_is_right_once() {
    let seed = 0x6d69_6772;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut server = migration_server(memory_device());
    // Three connections crowd thread 0 with GETs; one on thread 1 reads little and rewrites
    // its own key, reading it back after each answered PUT.
    let mut clients: Vec<Client> = [0u16, 0, 0, 1]
        .iter()
        .map(|&thread| Client::connect_to(&mut server, thread))
        .collect();
    let keys: Vec<Vec<u8>> = (0..48)
        .map(|k| format!("shared-{k}").into_bytes())
        .collect();
    let values: Vec<Vec<u8>> = (0..keys.len())
        .map(|k| value_of(k as u64, 100 + (k * 997) % 20_000))
        .collect();
    for (chunk_keys, chunk_values) in keys.chunks(8).zip(values.chunks(8)) {
        let ids: Vec<(usize, u64)> = chunk_keys
            .iter()
            .zip(chunk_values)
            .map(|(key, value)| (0, clients[0].send(&mut server, Request::Put { key, value })))
            .collect();
        let mut refs: Vec<&mut Client> = clients.iter_mut().collect();
        await_answers(&mut server, &mut refs, &ids);
    }
    let own_key = b"light-own".to_vec();
    let mut own_value = Vec::new();
    let mut answered = 0u64;
    for round in 0..40u64 {
        let mut expected: Vec<(usize, u64, Vec<u8>)> = Vec::new();
        for (index, client) in clients.iter_mut().enumerate().take(3) {
            for _ in 0..12 {
                let k = (rng.next_u64() % keys.len() as u64) as usize;
                let id = client.send(&mut server, Request::Get { key: &keys[k] });
                expected.push((index, id, values[k].clone()));
            }
        }
        own_value = value_of(1_000 + round, 50 + (round as usize * 331) % 9_000);
        let put = clients[3].send(
            &mut server,
            Request::Put {
                key: &own_key,
                value: &own_value,
            },
        );
        {
            let mut refs: Vec<&mut Client> = clients.iter_mut().collect();
            await_answers(&mut server, &mut refs, &[(3, put)]);
        }
        assert_eq!(clients[3].answers[&put].1, Status::Ok, "round {round}: PUT");
        let get = clients[3].send(&mut server, Request::Get { key: &own_key });
        expected.push((3, get, own_value.clone()));
        let ids: Vec<(usize, u64)> = expected.iter().map(|e| (e.0, e.1)).collect();
        let mut refs: Vec<&mut Client> = clients.iter_mut().collect();
        await_answers(&mut server, &mut refs, &ids);
        for (client, id, value) in expected {
            let Some((_, status, seen)) = clients[client].answers.remove(&id) else {
                panic!("seed {seed:#x} round {round} request {id}: no answer");
            };
            assert_eq!(
                status,
                Status::Ok,
                "seed {seed:#x} round {round} request {id}"
            );
            assert!(
                seen == value,
                "seed {seed:#x} round {round} request {id}: value"
            );
            answered += 1;
        }
    }
    assert!(!own_value.is_empty());
    assert_eq!(answered, 40 * 37);
    let stats = server.stats();
    let report: Vec<_> = stats
        .iter()
        .map(|s| (s.migrated_sent, s.migrated_served, s.migrated_refused))
        .collect();
    let sent: u64 = stats.iter().map(|s| s.migrated_sent).sum();
    let served: u64 = stats.iter().map(|s| s.migrated_served).sum();
    eprintln!("per thread (sent, served, refused): {report:?}");
    assert!(sent > 100, "per thread (sent, served, refused): {report:?}");
    assert_eq!(sent, served, "{report:?}");
    assert!(stats.iter().all(|s| s.migrated_refused == 0), "{report:?}");
    shut_down(&mut server);
}

/// Two threads, QoS on with the small device profile and the FIFO fairness stage, two
/// best-effort tenants `sparse` and `dense` created at run time (as the admin API does).
fn two_tenant_server() -> (VirtualServer, u64, u64) {
    use reflex_dataplane::control::{ControlSetup, HandleKeys, NamespaceControl, TenantLimits};
    use reflex_qos::{DeviceProfile, FairMode, FairQueueConfig, QosConfig, TenantSpec};
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../profiles/device-a-small.toml"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let profile = DeviceProfile::from_toml(&text).unwrap_or_else(|e| panic!("{e}"));
    let qos_config = QosConfig {
        fairness: FairQueueConfig {
            mode: FairMode::Fifo,
            ..FairQueueConfig::default()
        },
        ..QosConfig::default()
    };
    let plan = FaultPlan::parse("delay=50us").unwrap_or_else(|e| panic!("{e}"));
    let device: Arc<dyn Device> =
        Arc::new(FaultDevice::new(memory_device(), plan).unwrap_or_else(|e| panic!("{e}")));
    let server = VirtualServer::new(reflex_sim::VirtualServerSetup {
        threads: 2,
        namespaces: vec![(common::NAMESPACE, device, false)],
        control: ControlSetup {
            threads: 2,
            handles: HandleKeys::Seeded(3),
            tenant_limits: TenantLimits::default(),
            qos_config: qos_config.clone(),
            qos_enabled: true,
            namespaces: vec![NamespaceControl {
                namespace_id: common::NAMESPACE,
                profile: Some(profile),
                tenants: Vec::new(),
            }],
        },
        qos_config,
        limits: Limits::with_arena(8 << 20, 25),
        network: NetworkModel::default(),
        listeners: vec![VirtualListener::Kv {
            namespace_index: 0,
            tenant: None,
        }],
        nbd_exports: Vec::new(),
        nbd_default_export: None,
        composites: Vec::new(),
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let create = |name: &str| {
        server
            .control()
            .admin_register(common::NAMESPACE, name, TenantSpec::BestEffort, false)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .tenant
            .handle
    };
    let (sparse, dense) = (create("sparse"), create("dense"));
    (server, sparse, dense)
}

#[test]
fn two_connections_bound_to_two_tenants_are_charged_to_their_own() {
    let (mut server, sparse, dense) = two_tenant_server();
    // One connection per thread: thread 1's table steps are forwarded to thread 0, its
    // device operations and their charge stay on thread 1.
    let mut first = Client::connect_to(&mut server, 0);
    let mut second = Client::connect_to(&mut server, 1);
    let sparse_key = sparse.to_le_bytes();
    let dense_key = dense.to_le_bytes();
    assert_eq!(
        call(&mut server, &mut first, Request::Bind { key: &sparse_key }).0,
        Status::Ok
    );
    assert_eq!(
        call(&mut server, &mut second, Request::Bind { key: &dense_key }).0,
        Status::Ok
    );
    let unknown = 0x0bad_0bad_0bad_0badu64.to_le_bytes();
    assert_eq!(
        call(&mut server, &mut first, Request::Bind { key: &unknown }).0,
        Status::NoTenant
    );
    // `sparse`: 2 PUTs; `dense`: 6 PUTs pipelined with a BIND to `sparse` and a GET after
    // it (the GET is `sparse`'s).
    let mut ids = Vec::new();
    for number in 0..2u8 {
        let key = [b's', number];
        ids.push((
            0,
            first.send(
                &mut server,
                Request::Put {
                    key: &key,
                    value: b"s",
                },
            ),
        ));
    }
    for number in 0..6u8 {
        let key = [b'd', number];
        ids.push((
            1,
            second.send(
                &mut server,
                Request::Put {
                    key: &key,
                    value: b"d",
                },
            ),
        ));
    }
    ids.push((
        1,
        second.send(&mut server, Request::Bind { key: &sparse_key }),
    ));
    ids.push((1, second.send(&mut server, Request::Get { key: b"d\x05" })));
    await_answers(&mut server, &mut [&mut first, &mut second], &ids);
    for &(client, id) in &ids {
        let answers = if client == 0 {
            &first.answers
        } else {
            &second.answers
        };
        assert_eq!(
            answers[&id].1,
            Status::Ok,
            "request {id} of client {client}"
        );
    }
    assert_eq!(second.answers[&ids[ids.len() - 1].1].2, b"d".to_vec());
    let stats = server.stats();
    let arrivals = |thread: usize, handle: u64| -> u64 {
        stats[thread]
            .tenants
            .iter()
            .filter(|tenant| tenant.handle == handle)
            .map(|tenant| tenant.arrivals)
            .sum()
    };
    let report = [
        (arrivals(0, sparse), arrivals(0, dense)),
        (arrivals(1, sparse), arrivals(1, dense)),
    ];
    eprintln!("arrivals per thread (sparse, dense): {report:?}");
    // Each tenant's requests arrived on its connection's thread, charged to it, and the
    // scheduler admitted device operations for both (two flows of the stage).
    assert_eq!(report, [(2, 0), (1, 6)]);
    let admitted = |thread: usize, handle: u64| -> u64 {
        stats[thread]
            .tenants
            .iter()
            .filter(|tenant| tenant.handle == handle)
            .map(|tenant| tenant.requests)
            .sum()
    };
    assert!(
        admitted(0, sparse) >= 2 * 2,
        "a PUT is at least two device steps"
    );
    assert!(
        admitted(1, dense) >= 6 * 2,
        "a PUT is at least two device steps"
    );
    assert!(admitted(1, sparse) >= 1, "the GET after the BIND");
    assert_eq!(admitted(0, dense), 0);
    shut_down(&mut server);
}
