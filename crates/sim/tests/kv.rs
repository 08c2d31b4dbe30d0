//! The key-value front end (`docs/KV.md`) through the real dataplane in virtual time: KV
//! clients on the simulator's network, the table formatted on a memory device whose every
//! completion is delayed by the fault-injecting wrapper (so each step completes
//! asynchronously), answers checked against a `HashMap` model.

mod common;

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Arc;

use reflex_dataplane::Limits;
use reflex_flash::fault::{Delay, DelayPick, FaultDevice, FaultPlan};
use reflex_proto::kv::{self, Request, Status};
use reflex_qos::Nanos;
use reflex_sim::{NetworkModel, SocketId, VirtualListener, VirtualServer, VirtualServerError};

/// Two threads, one namespace (4 MiB of memory, every operation delayed 30 µs), the KV
/// listener (index 0).
fn server() -> VirtualServer {
    let mem = reflex_flash::mem::MemDevice::new(4 << 20).unwrap_or_else(|e| panic!("{e}"));
    let plan = FaultPlan {
        delay: Some(Delay {
            added: Nanos(30_000),
            pick: DelayPick::Every(NonZeroU64::MIN),
        }),
        ..FaultPlan::default()
    };
    let device = FaultDevice::new(Arc::new(mem), plan).unwrap_or_else(|e| panic!("{e}"));
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
    fn connect(server: &mut VirtualServer) -> Client {
        let socket = server
            .connect(0, 0, None)
            .unwrap_or_else(|e| panic!("connect: {e}"));
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

#[test]
fn the_kv_listener_is_served_by_thread_0_only() {
    let mut server = server();
    assert!(server.is_accepting(0, 0));
    assert!(!server.is_accepting(1, 0));
    assert!(matches!(
        server.connect(1, 0, None),
        Err(VirtualServerError::NotAccepting { .. })
    ));
    shut_down(&mut server);
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
    let mut b = Client::connect(&mut server);
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
