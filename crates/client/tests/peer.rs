//! The std drivers against a real TCP peer built from `reflex-proto` alone: a small,
//! single-connection server that answers in memory, and can be told to misbehave in ways the
//! real `reflexd` never does (reorder answers, send garbage, hang up), which is what these
//! tests need. Tests against `reflexd` itself live in `server_e2e.rs`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use reflex_client::{
    Client, ClientError, ClientOptions, Opcode, PipelinedClient, ProtocolError, Status,
};
use reflex_proto::native::{
    Capabilities, HelloBody, Namespace, RequestHeader, ResponseHeader, ServerLimits,
    ValidatedRequest, validate_request,
};

const NAMESPACE_SIZE_BYTES: u64 = 4 << 20;
const WINDOW_REQUESTS: u32 = 16;
const IO_SIZE_MAX_BYTES: u32 = 64 * 1024;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    Correct,
    /// Answers each batch of requests in reverse order.
    Reverse,
    /// Answers the first request after HELLO with a bad magic.
    Garbage,
    /// Closes the connection after HELLO.
    HangUp,
}

struct Request {
    header: RequestHeader,
    payload: Vec<u8>,
}

fn read_request(stream: &mut TcpStream) -> Option<Request> {
    let mut header_bytes = [0u8; 32];
    stream.read_exact(&mut header_bytes).ok()?;
    let (header, _) = RequestHeader::decode(&header_bytes).ok()??;
    let mut payload = vec![0u8; header.payload_length_bytes() as usize];
    stream.read_exact(&mut payload).ok()?;
    Some(Request { header, payload })
}

fn answer(memory: &mut [u8], request: &Request, io_priority_seen: &mut Option<u16>) -> Vec<u8> {
    let namespaces = [Namespace {
        id: 1,
        size_bytes: NAMESPACE_SIZE_BYTES,
        read_only: false,
    }];
    let limits = ServerLimits::new(512, IO_SIZE_MAX_BYTES).expect("limits");
    let header = &request.header;
    let (status, payload) = match validate_request(header, &limits, &namespaces[..]) {
        Err(status) => (status, b"refused by test peer".to_vec()),
        Ok(ValidatedRequest::Hello) => {
            let hello = HelloBody::decode(&request.payload).expect("hello body");
            *io_priority_seen = Some(hello.io_priority);
            let fixed = Capabilities::from_limits(&limits, WINDOW_REQUESTS);
            let mut body = vec![0u8; Capabilities::encoded_size(1)];
            fixed.encode_into(&namespaces, &mut body).expect("sized");
            (Status::Ok, body)
        }
        Ok(ValidatedRequest::Control { .. }) => (Status::Invalid, Vec::new()),
        Ok(ValidatedRequest::Io(io)) => {
            let start = io.offset_bytes() as usize;
            let end = start + io.length_bytes() as usize;
            match io.op() {
                reflex_proto::native::IoOp::Read => (Status::Ok, memory[start..end].to_vec()),
                reflex_proto::native::IoOp::Write { .. } => {
                    memory[start..end].copy_from_slice(&request.payload);
                    (Status::Ok, Vec::new())
                }
                reflex_proto::native::IoOp::Trim => {
                    memory[start..end].fill(0);
                    (Status::Ok, Vec::new())
                }
                reflex_proto::native::IoOp::Flush => (Status::Ok, Vec::new()),
            }
        }
    };
    let mut bytes = ResponseHeader::for_request(header, status, payload.len() as u32)
        .to_bytes()
        .to_vec();
    bytes.extend_from_slice(&payload);
    bytes
}

/// Serves one connection; returns the address and a handle yielding the HELLO priority seen.
fn spawn_peer(behaviour: Behaviour) -> (String, thread::JoinHandle<Option<u16>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("addr").to_string();
    let handle = thread::spawn(move || {
        let (mut stream, _) = listener.accept().ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .ok()?;
        let mut memory = vec![0u8; NAMESPACE_SIZE_BYTES as usize];
        let mut io_priority_seen = None;
        let hello = read_request(&mut stream)?;
        stream
            .write_all(&answer(&mut memory, &hello, &mut io_priority_seen))
            .ok()?;
        if behaviour == Behaviour::HangUp {
            return io_priority_seen;
        }
        let mut batch = Vec::new();
        while let Some(request) = read_request(&mut stream) {
            if behaviour == Behaviour::Garbage {
                let mut bytes = answer(&mut memory, &request, &mut io_priority_seen);
                bytes[0] ^= 0xFF;
                let _ = stream.write_all(&bytes);
                return io_priority_seen;
            }
            batch.push(request);
            // Reverse mode answers in groups of four (the tests submit multiples of four).
            if behaviour == Behaviour::Reverse && batch.len() < 4 {
                continue;
            }
            if behaviour == Behaviour::Reverse {
                batch.reverse();
            }
            for request in batch.drain(..) {
                let bytes = answer(&mut memory, &request, &mut io_priority_seen);
                stream.write_all(&bytes).ok()?;
            }
        }
        io_priority_seen
    });
    (address, handle)
}

#[test]
fn blocking_round_trips_and_chunking() {
    let (address, peer) = spawn_peer(Behaviour::Correct);
    let options = ClientOptions {
        io_priority: Some((1 << 13) | 3),
        ..ClientOptions::default()
    };
    let mut client = Client::connect_with(&address, &options).expect("connect");
    assert_eq!(client.capabilities().window_requests, WINDOW_REQUESTS);
    assert_eq!(client.namespaces().len(), 1);
    assert_eq!(client.namespaces()[0].size_bytes, NAMESPACE_SIZE_BYTES);

    // 1 MiB is 16 chunks of the peer's 64 KiB max I/O size, pipelined in its window of 16.
    let data: Vec<u8> = (0..(1 << 20)).map(|i: u32| (i % 251) as u8).collect();
    client.write(1, 8192, &data).expect("write");
    client.flush(1).expect("flush");
    let mut back = vec![0u8; data.len()];
    client.read(1, 8192, &mut back).expect("read");
    assert!(back == data);

    client.write_fua(1, 0, &[7u8; 512]).expect("fua");
    client.trim(1, 8192, 4096).expect("trim");
    let mut small = vec![1u8; 4096 + 512];
    client.read(1, 8192 - 512, &mut small).expect("read");
    assert!(
        small[..512].iter().all(|b| *b == 0),
        "before the data: zero"
    );
    assert!(small[512..].iter().all(|b| *b == 0), "trimmed: zero");

    // Refusals are typed and leave the connection usable.
    let mut buf = vec![0u8; 4096];
    match client.read(1, NAMESPACE_SIZE_BYTES, &mut buf) {
        Err(ClientError::Status {
            opcode: Opcode::Read,
            status: Status::OutOfRange,
            reason,
        }) => assert_eq!(reason.as_deref(), Some("refused by test peer")),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(
        client.read(2, 0, &mut buf).map_err(|e| e.status()).err(),
        Some(Some(Status::NoSuchNamespace))
    );
    assert_eq!(
        client
            .write(1, 100, &[0u8; 512])
            .map_err(|e| e.status())
            .err(),
        Some(Some(Status::Invalid))
    );
    client.read(1, 0, &mut buf[..512]).expect("still usable");
    assert_eq!(&buf[..512], &[7u8; 512]);
    drop(client);
    assert_eq!(peer.join().expect("peer"), Some((1 << 13) | 3));
}

#[test]
fn default_hello_declares_the_process_io_priority() {
    let (address, peer) = spawn_peer(Behaviour::Correct);
    let client = Client::connect(&address).expect("connect");
    drop(client);
    assert_eq!(
        peer.join().expect("peer"),
        Some(reflex_client::io_priority_of_process())
    );
}

#[test]
fn pipelined_completions_arrive_out_of_order() {
    let (address, _peer) = spawn_peer(Behaviour::Reverse);
    let mut client = PipelinedClient::connect(&address).expect("connect");
    for id in 100..104u64 {
        let fill = [id as u8; 512];
        client
            .submit_write(id, 1, (id - 100) * 512, &fill, false)
            .expect("submit");
    }
    let mut order = Vec::new();
    while order.len() < 4 {
        assert!(client.wait(None).expect("wait"));
        while let Some(completion) = client.reap().expect("reap") {
            completion.result().expect("ok");
            order.push(completion.request_id);
        }
    }
    assert_eq!(order, vec![103, 102, 101, 100]);
    for id in 200..204u64 {
        client
            .submit_read(id, 1, (id - 200) * 512, 512)
            .expect("submit");
    }
    let mut seen = Vec::new();
    while seen.len() < 4 {
        client.wait(None).expect("wait");
        while let Some(completion) = client.reap().expect("reap") {
            let data = completion.result().expect("ok");
            assert!(
                data.iter()
                    .all(|b| u64::from(*b) == completion.request_id - 100)
            );
            seen.push(completion.request_id);
        }
    }
    assert_eq!(seen, vec![203, 202, 201, 200]);
}

#[test]
fn garbage_from_the_server_is_a_protocol_error() {
    let (address, _peer) = spawn_peer(Behaviour::Garbage);
    let mut client = Client::connect(&address).expect("connect");
    let mut buf = [0u8; 512];
    match client.read(1, 0, &mut buf) {
        Err(ClientError::Protocol(ProtocolError::Header(_))) => {}
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn a_hang_up_is_reported_as_closed() {
    let (address, peer) = spawn_peer(Behaviour::HangUp);
    let mut client = Client::connect(&address).expect("connect");
    peer.join().expect("peer");
    let mut buf = [0u8; 512];
    match client.read(1, 0, &mut buf) {
        Err(ClientError::Closed) | Err(ClientError::Io(_)) => {}
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn connect_to_nothing_fails_with_io_error() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("addr");
    drop(listener);
    assert!(matches!(Client::connect(address), Err(ClientError::Io(_))));
}
