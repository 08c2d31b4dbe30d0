//! The client against the real server, started in-process with `reflex_server::Server::start`
//! on loopback port 0: blocking round trips on memory and file namespaces, pipelining past
//! one request with every answer matched, and server refusals surfaced as typed errors while
//! the connection stays usable.

use reflex_client::{Client, ClientError, Opcode, PipelinedClient, Status, SubmitError};
use reflex_server::{Config, NamespaceConfig, Server, ServerHandle};

const MEM_NAMESPACE: u32 = 1;
const FILE_NAMESPACE: u32 = 2;
const READ_ONLY_NAMESPACE: u32 = 3;

fn namespace(
    id: u32,
    backend: String,
    size_bytes: Option<u64>,
    read_only: bool,
) -> NamespaceConfig {
    NamespaceConfig {
        id,
        backend,
        size_bytes,
        read_only,
        name: None,
        tenant: None,
        profile: None,
    }
}

/// A server with a memory, a file and a read-only namespace; 2 threads, window 16.
fn start(dir: &tempfile::TempDir) -> ServerHandle {
    let file = dir.path().join("ns2.img");
    let config = Config {
        threads: 2,
        window: 16,
        namespaces: vec![
            namespace(MEM_NAMESPACE, "mem:16M".to_string(), None, false),
            namespace(
                FILE_NAMESPACE,
                format!("file:{}", file.display()),
                Some(16 << 20),
                false,
            ),
            namespace(READ_ONLY_NAMESPACE, "mem:1M".to_string(), None, true),
        ],
        ..Config::loopback(Vec::new())
    };
    Server::start(config).unwrap_or_else(|error| panic!("server start: {error}"))
}

fn pattern(seed: u8, length: usize) -> Vec<u8> {
    (0..length)
        .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn capabilities_list_the_configured_namespaces() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&dir);
    let client = Client::connect(server.native_addr()).expect("connect");
    let capabilities = client.capabilities();
    assert_eq!(capabilities.window_requests, 16);
    assert_eq!(capabilities.io_size_max_bytes, 1 << 20);
    let ids: Vec<u32> = client.namespaces().iter().map(|ns| ns.id).collect();
    assert_eq!(
        ids,
        vec![MEM_NAMESPACE, FILE_NAMESPACE, READ_ONLY_NAMESPACE]
    );
    assert_eq!(
        capabilities
            .namespace(FILE_NAMESPACE)
            .map(|ns| ns.size_bytes),
        Some(16 << 20)
    );
    assert_eq!(
        capabilities
            .namespace(READ_ONLY_NAMESPACE)
            .map(|ns| ns.read_only),
        Some(true)
    );
    drop(client);
    server.shutdown().expect("shutdown");
}

#[test]
fn blocking_round_trips_on_memory_and_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&dir);
    let mut client = Client::connect(server.native_addr()).expect("connect");
    for namespace in [MEM_NAMESPACE, FILE_NAMESPACE] {
        // 3 MiB: three chunks of the server's 1 MiB max I/O size.
        let data = pattern(namespace as u8, 3 << 20);
        client.write(namespace, 1 << 20, &data).expect("write");
        client.flush(namespace).expect("flush");
        let mut back = vec![0u8; data.len()];
        client.read(namespace, 1 << 20, &mut back).expect("read");
        assert!(back == data, "namespace {namespace}: data differs");

        let block = pattern(7, 4096);
        client.write_fua(namespace, 0, &block).expect("fua write");
        let mut back = vec![0u8; 4096];
        client.read(namespace, 0, &mut back).expect("read");
        assert_eq!(back, block);

        client.trim(namespace, 0, 4096).expect("trim");
        client.read(namespace, 0, &mut back).expect("read");
        assert!(
            back.iter().all(|byte| *byte == 0),
            "trimmed range reads zero"
        );
    }
    drop(client);
    server.shutdown().expect("shutdown");
}

#[test]
fn refusals_are_typed_and_leave_the_connection_usable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&dir);
    let mut client = Client::connect(server.native_addr()).expect("connect");
    let mut buf = vec![0u8; 4096];
    let status_of = |result: Result<(), ClientError>| match result {
        Err(error) => error.status(),
        Ok(()) => None,
    };
    assert_eq!(
        status_of(client.read(MEM_NAMESPACE, 16 << 20, &mut buf)),
        Some(Status::OutOfRange)
    );
    assert_eq!(
        status_of(client.read(42, 0, &mut buf)),
        Some(Status::NoSuchNamespace)
    );
    assert_eq!(
        status_of(client.read(MEM_NAMESPACE, 100, &mut buf)),
        Some(Status::Invalid),
        "misaligned offset"
    );
    assert_eq!(
        status_of(client.write(READ_ONLY_NAMESPACE, 0, &buf)),
        Some(Status::Permission)
    );
    assert_eq!(
        status_of(client.read(MEM_NAMESPACE, 0, &mut [])),
        Some(Status::Invalid)
    );
    match client.write(MEM_NAMESPACE, 16 << 20, &buf) {
        Err(ClientError::Status {
            opcode: Opcode::Write,
            status: Status::OutOfRange,
            ..
        }) => {}
        other => panic!("unexpected {other:?}"),
    }
    // Still in step after every refusal.
    client
        .write(MEM_NAMESPACE, 0, &pattern(3, 4096))
        .expect("write");
    client.read(MEM_NAMESPACE, 0, &mut buf).expect("read");
    assert_eq!(buf, pattern(3, 4096));
    drop(client);
    server.shutdown().expect("shutdown");
}

#[test]
fn pipelined_requests_up_to_the_window_are_all_matched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&dir);
    let mut client = PipelinedClient::connect(server.native_addr()).expect("connect");
    let window = client.window() as u64;
    assert_eq!(window, 16);
    for namespace in [MEM_NAMESPACE, FILE_NAMESPACE] {
        // Writes of distinct blocks, a full window at once.
        for id in 0..window {
            client
                .submit_write(id, namespace, id * 8192, &pattern(id as u8, 8192), false)
                .expect("submit write");
        }
        assert!(matches!(
            client.submit_read(999, namespace, 0, 512),
            Err(SubmitError::WindowFull {
                window_requests: 16
            })
        ));
        let mut answered = vec![false; window as usize];
        while answered.iter().any(|a| !a) {
            assert!(client.wait(None).expect("wait"));
            while let Some(completion) = client.reap().expect("reap") {
                completion.result().expect("write ok");
                let index = completion.request_id as usize;
                assert!(!answered[index], "answered twice");
                answered[index] = true;
            }
        }
        // Reads of the same blocks, ids in reverse; each answer carries its own block.
        for id in 0..window {
            client
                .submit_read(1000 + id, namespace, (window - 1 - id) * 8192, 8192)
                .expect("submit read");
        }
        let mut seen = 0;
        while seen < window {
            client.wait(None).expect("wait");
            while let Some(completion) = client.reap().expect("reap") {
                let data = completion.result().expect("read ok");
                let block = window - 1 - (completion.request_id - 1000);
                assert_eq!(data, &pattern(block as u8, 8192)[..]);
                seen += 1;
            }
        }
        assert_eq!(client.outstanding_count(), 0);
    }
    drop(client);
    server.shutdown().expect("shutdown");
}

#[test]
fn many_connections_verify_disjoint_ranges_concurrently() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(&dir);
    let address = server.native_addr();
    std::thread::scope(|scope| {
        for worker in 0..8u64 {
            scope.spawn(move || {
                let mut client = Client::connect(address).expect("connect");
                let base = worker * (2 << 20);
                for step in 0..16u64 {
                    let data = pattern((worker * 16 + step) as u8, 64 * 1024);
                    let offset = base + step * 64 * 1024;
                    client.write(FILE_NAMESPACE, offset, &data).expect("write");
                    let mut back = vec![0u8; data.len()];
                    client
                        .read(FILE_NAMESPACE, offset, &mut back)
                        .expect("read");
                    assert!(back == data, "worker {worker} step {step}");
                }
            });
        }
    });
    server.shutdown().expect("shutdown");
}
