//! End to end over loopback TCP: the native protocol against real files, memory and null.

mod common;

use common::{Raw, config, mem_server, namespace, pattern, start};
use reflex_client::{Client, ClientError};
use reflex_proto::native::{RequestHeader, Status};

fn status_of(error: ClientError) -> Status {
    match error.status() {
        Some(status) => status,
        None => panic!("expected an error status, got {error}"),
    }
}

#[test]
fn hello_lists_namespaces_and_window() {
    let server = start(config(vec![
        namespace(1, "mem:16M", None),
        namespace(9, "null:1G", None),
    ]));
    let client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let namespaces = client.namespaces();
    assert_eq!(namespaces.len(), 2);
    assert_eq!((namespaces[0].id, namespaces[0].size_bytes), (1, 16 << 20));
    assert_eq!((namespaces[1].id, namespaces[1].size_bytes), (9, 1 << 30));
    assert_eq!(client.capabilities().window_requests, 16);
    assert_eq!(client.capabilities().io_size_max_bytes, 1 << 20);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn many_connections_write_and_verify_disjoint_ranges() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("ns1");
    let backend = format!("file:{}", path.display());
    let server = start(config(vec![namespace(1, &backend, Some(64 << 20))]));
    let addr = server.native_addr();
    let workers: Vec<_> = (0..8u64)
        .map(|worker| {
            std::thread::spawn(move || {
                let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
                let base = worker * (4 << 20);
                for block in 0..32u64 {
                    let size = 4096 * (1 + (block as usize % 4));
                    let data = pattern(worker * 1000 + block, size);
                    client
                        .write(1, base + block * 65536, &data)
                        .unwrap_or_else(|e| panic!("write: {e}"));
                }
                for block in 0..32u64 {
                    let size = 4096 * (1 + (block as usize % 4));
                    let mut back = vec![0u8; size];
                    client
                        .read(1, base + block * 65536, &mut back)
                        .unwrap_or_else(|e| panic!("read: {e}"));
                    assert!(
                        back == pattern(worker * 1000 + block, size),
                        "worker {worker} block {block}"
                    );
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap_or_else(|_| panic!("worker panicked"));
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn one_mebibyte_io_on_file_and_memory() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let backend = format!("file:{}", dir.path().join("big").display());
    let server = start(config(vec![
        namespace(1, &backend, Some(16 << 20)),
        namespace(2, "mem:16M", None),
    ]));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    for ns in [1, 2] {
        let data = pattern(ns.into(), 1 << 20);
        client
            .write(ns, 3 << 20, &data)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut back = vec![0u8; 1 << 20];
        client
            .read(ns, 3 << 20, &mut back)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(back == data, "namespace {ns}");
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn bad_requests_get_an_error_and_the_connection_stays_usable() {
    let server = start(config(vec![namespace(1, "mem:1M", None)]));
    let mut raw = Raw::connect(server.native_addr());
    let cases = [
        (RequestHeader::read(1, 1, 1 << 20, 4096), Status::OutOfRange),
        (
            RequestHeader::read(2, 1, (1 << 20) - 512, 1024),
            Status::OutOfRange,
        ),
        (
            RequestHeader::read(3, 1, u64::MAX - 511, 512),
            Status::OutOfRange,
        ),
        (RequestHeader::read(4, 1, 100, 512), Status::Invalid),
        (RequestHeader::read(5, 1, 0, 100), Status::Invalid),
        (RequestHeader::read(6, 1, 0, 0), Status::Invalid),
        (
            RequestHeader::read(7, 1, 0, (1 << 20) + 512),
            Status::TooLarge,
        ),
        (RequestHeader::read(8, 2, 0, 512), Status::NoSuchNamespace),
        (RequestHeader::trim(9, 1, 512, 0), Status::Invalid),
    ];
    for (header, expected) in cases {
        let (response, data) = raw.call(&header, &[]);
        assert_eq!(response.status(), Ok(expected), "{header:?}");
        assert!(data.is_empty());
    }
    let (response, data) = raw.call(&RequestHeader::read(10, 1, 0, 512), &[]);
    assert_eq!(response.status(), Ok(Status::Ok));
    assert_eq!(data.len(), 512);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn refused_write_payloads_are_skipped_and_the_stream_stays_in_step() {
    let server = start(config(vec![namespace(1, "mem:4M", None)]));
    let mut raw = Raw::connect(server.native_addr());
    // Too large: 2 MiB of payload follows and must be skipped.
    let big = vec![0xEEu8; 2 << 20];
    let (response, _) = raw.call(
        &RequestHeader::write(1, 1, 0, big.len() as u32, false),
        &big,
    );
    assert_eq!(response.status(), Ok(Status::TooLarge));
    // Out of range with a payload; misaligned with a payload.
    let small = pattern(5, 4096);
    let (response, _) = raw.call(&RequestHeader::write(2, 1, 4 << 20, 4096, false), &small);
    assert_eq!(response.status(), Ok(Status::OutOfRange));
    let (response, _) = raw.call(&RequestHeader::write(3, 1, 7, 4096, false), &small);
    assert_eq!(response.status(), Ok(Status::Invalid));
    // A payload-carrying write with a bad flag bit, then a good write and read.
    let mut flagged = RequestHeader::write(4, 1, 0, 4096, false);
    flagged.flags = reflex_proto::native::RequestFlags::from_bits_retain(0x8000);
    let (response, _) = raw.call(&flagged, &small);
    assert_eq!(response.status(), Ok(Status::Invalid));
    let (response, _) = raw.call(&RequestHeader::write(5, 1, 8192, 4096, false), &small);
    assert_eq!(response.status(), Ok(Status::Ok));
    let (response, data) = raw.call(&RequestHeader::read(6, 1, 8192, 4096), &[]);
    assert_eq!(response.status(), Ok(Status::Ok));
    assert!(data == small);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn unknown_opcode_version_and_control_requests_are_answered() {
    let server = mem_server();
    let mut raw = Raw::connect(server.native_addr());
    let mut unknown = RequestHeader::read(1, 1, 0, 512);
    unknown.opcode_raw = 0x7f;
    let (response, _) = raw.call(&unknown, &[]);
    assert_eq!(response.status(), Ok(Status::Invalid));
    let mut version = RequestHeader::read(2, 1, 0, 512);
    version.version = 2;
    let (response, _) = raw.call(&version, &[]);
    assert_eq!(response.status(), Ok(Status::UnsupportedVersion));
    // REGISTER is answered INVALID until tenants exist; its body is skipped.
    let mut register = RequestHeader::new(reflex_proto::native::Opcode::Register, 3);
    register.length_bytes = 40;
    let (response, _) = raw.call(&register, &[0u8; 40]);
    assert_eq!(response.status(), Ok(Status::Invalid));
    let (response, data) = raw.call(&RequestHeader::read(4, 1, 0, 512), &[]);
    assert_eq!(response.status(), Ok(Status::Ok));
    assert_eq!(data, vec![0u8; 512]);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn bad_magic_closes_only_that_connection() {
    let server = mem_server();
    let mut good = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    good.write(1, 0, &pattern(1, 4096))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut bad = Raw::connect(server.native_addr());
    let mut bytes = RequestHeader::read(1, 1, 0, 512).to_bytes();
    bytes[..4].copy_from_slice(b"JUNK");
    bad.send_bytes(&bytes);
    assert!(bad.is_closed_by_server());
    let mut back = vec![0u8; 4096];
    good.read(1, 0, &mut back).unwrap_or_else(|e| panic!("{e}"));
    assert!(back == pattern(1, 4096));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn flush_fua_and_trim() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let backend = format!("file:{}", dir.path().join("ns").display());
    let server = start(config(vec![
        namespace(1, &backend, Some(8 << 20)),
        namespace(2, "mem:8M", None),
    ]));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    for ns in [1, 2] {
        let data = pattern(7, 64 << 10);
        client.write(ns, 0, &data).unwrap_or_else(|e| panic!("{e}"));
        client.flush(ns).unwrap_or_else(|e| panic!("{e}"));
        client
            .write_fua(ns, 1 << 20, &data)
            .unwrap_or_else(|e| panic!("{e}"));
        client
            .trim(ns, 4096, 8192)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut back = vec![0u8; 64 << 10];
        client
            .read(ns, 0, &mut back)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(back[..4096] == data[..4096]);
        assert!(
            back[4096..12288].iter().all(|&b| b == 0),
            "namespace {ns}: trimmed range not zero"
        );
        assert!(back[12288..] == data[12288..]);
        client
            .read(ns, 1 << 20, &mut back)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(back == data);
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn read_only_namespace_refuses_writes() {
    let mut ro = namespace(1, "mem:1M", None);
    ro.read_only = true;
    let server = start(config(vec![ro]));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    assert!(client.namespaces()[0].read_only);
    let error = client
        .write(1, 0, &[1u8; 512])
        .err()
        .unwrap_or_else(|| panic!("write accepted"));
    assert_eq!(status_of(error), Status::Permission);
    let mut back = [0u8; 512];
    client
        .read(1, 0, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn memory_and_null_backends() {
    let server = start(config(vec![
        namespace(1, "mem:8M", None),
        namespace(2, "null", None),
    ]));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let data = pattern(3, 128 << 10);
    client
        .write(1, 4096, &data)
        .unwrap_or_else(|e| panic!("{e}"));
    client
        .write(2, 4096, &data)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 128 << 10];
    client
        .read(1, 4096, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(back == data);
    // null never stores, and a reused buffer never leaks what the previous request held.
    client
        .read(2, 4096, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(back.iter().all(|&b| b == 0));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn window_backpressure_answers_everything() {
    let server = mem_server();
    let mut raw = Raw::connect(server.native_addr());
    let data = pattern(11, 4096);
    let (response, _) = raw.call(&RequestHeader::write(0, 1, 0, 4096, false), &data);
    assert_eq!(response.status(), Ok(Status::Ok));
    // Four windows' worth of reads and writes, sent before reading any response.
    let count = 64u64;
    for id in 1..=count {
        if id.is_multiple_of(2) {
            raw.send(&RequestHeader::read(id, 1, 0, 4096), &[]);
        } else {
            raw.send(&RequestHeader::write(id, 1, id * 4096, 4096, false), &data);
        }
    }
    let mut seen = vec![false; count as usize + 1];
    for _ in 1..=count {
        let (response, payload) = raw.receive();
        assert_eq!(response.status(), Ok(Status::Ok));
        let id = response.request_id as usize;
        assert!(!seen[id], "response {id} twice");
        seen[id] = true;
        if id.is_multiple_of(2) {
            assert!(payload == data);
        }
    }
    assert!(seen[1..].iter().all(|&s| s));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn unregistered_buffers_work_too() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let backend = format!("file:{}", dir.path().join("ns").display());
    let mut config = config(vec![namespace(1, &backend, Some(4 << 20))]);
    config.register_buffers = false;
    let server = start(config);
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let data = pattern(21, 256 << 10);
    client.write(1, 0, &data).unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 256 << 10];
    client
        .read(1, 0, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(back == data);
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    assert!(stats.iter().all(|s| !s.registered_buffers));
}

#[test]
fn emulated_device_completes_on_its_own_clock() {
    // Completions come from poll_completions at the model's due time: the blocking loop must
    // wake for them by itself (its sleep is bounded by next_deadline).
    let server = start(config(vec![namespace(
        1,
        "emu:device-a-small",
        Some(64 << 20),
    )]));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let data = pattern(5, 16 << 10);
    for block in 0..8u64 {
        client
            .write(1, block * (16 << 10), &data)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    client.flush(1).unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 16 << 10];
    for block in 0..8u64 {
        client
            .read(1, block * (16 << 10), &mut back)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(back == data, "block {block}");
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn large_pipelined_reads_survive_partial_sends() {
    // 16 MiB of responses queued at once cannot fit the socket buffers, so the server's
    // gathered sendmsg completes short and resumes mid-response.
    let server = start(config(vec![namespace(1, "mem:8M", None)]));
    let mut raw = Raw::connect(server.native_addr());
    let blocks: Vec<Vec<u8>> = (0..4u64).map(|seed| pattern(seed + 100, 1 << 20)).collect();
    for (index, block) in blocks.iter().enumerate() {
        let header = RequestHeader::write(index as u64, 1, (index as u64) << 20, 1 << 20, false);
        let (response, _) = raw.call(&header, block);
        assert_eq!(response.status(), Ok(Status::Ok));
    }
    for id in 0..16u64 {
        raw.send(
            &RequestHeader::read(100 + id, 1, (id % 4) << 20, 1 << 20),
            &[],
        );
    }
    let mut seen = [false; 16];
    for _ in 0..16 {
        let (response, data) = raw.receive();
        assert_eq!(response.status(), Ok(Status::Ok));
        let id = (response.request_id - 100) as usize;
        assert!(!seen[id]);
        seen[id] = true;
        assert!(data == blocks[id % 4], "read {id}");
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn an_exhausted_arena_makes_requests_wait_not_fail() {
    // One thread with a 2 MiB arena. Phase 1: three connections each pipeline eight 1 MiB
    // writes and read them back. Phase 2 forces exhaustion whatever the timing: one
    // connection pipelines sixteen 1 MiB reads and does not read the answers until the
    // socket buffers are full, so answers stuck in sends hold both arena halves and the
    // later reads must wait for a buffer. Every request is answered, none fails.
    let mut config = config(vec![namespace(1, "mem:32M", None)]);
    config.threads = 1;
    config.arena_bytes_per_thread = 2 << 20;
    let server = start(config);
    let addr = server.native_addr();
    let workers: Vec<_> = (0..3u64)
        .map(|worker| {
            std::thread::spawn(move || {
                let mut raw = Raw::connect(addr);
                let data = pattern(worker, 1 << 20);
                let writer = {
                    let mut stream = raw.stream.try_clone().unwrap_or_else(|e| panic!("{e}"));
                    let data = data.clone();
                    std::thread::spawn(move || {
                        use std::io::Write;
                        for block in 0..8u64 {
                            let offset = (worker * 8 + block) << 20;
                            let header = RequestHeader::write(block, 1, offset, 1 << 20, false);
                            stream
                                .write_all(&header.to_bytes())
                                .unwrap_or_else(|e| panic!("{e}"));
                            stream.write_all(&data).unwrap_or_else(|e| panic!("{e}"));
                        }
                    })
                };
                for _ in 0..8 {
                    let (response, _) = raw.receive();
                    assert_eq!(response.status(), Ok(Status::Ok));
                }
                writer.join().unwrap_or_else(|_| panic!("writer panicked"));
                for block in 0..8u64 {
                    let offset = (worker * 8 + block) << 20;
                    let (response, back) =
                        raw.call(&RequestHeader::read(50 + block, 1, offset, 1 << 20), &[]);
                    assert_eq!(response.status(), Ok(Status::Ok));
                    assert!(back == data, "worker {worker} block {block}");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap_or_else(|_| panic!("worker panicked"));
    }

    let mut stalled = Raw::connect(addr);
    for block in 0..16u64 {
        stalled.send(
            &RequestHeader::read(100 + block, 1, block << 20, 1 << 20),
            &[],
        );
    }
    wait_until_receive_queue_stops_growing(&stalled.stream);
    for _ in 0..16 {
        let (response, back) = stalled.receive();
        assert_eq!(response.status(), Ok(Status::Ok));
        let block = response.request_id - 100;
        let expected = pattern(block / 8, 1 << 20);
        assert!(back == expected, "stalled read of block {block}");
    }

    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        stats[0].buffer_waits > 0,
        "the arena never ran out: {stats:?}"
    );
    assert_eq!(
        stats[0].requests_per_state[0], 256,
        "every request slot is free again"
    );
}

/// Polls the bytes queued on `stream` (FIONREAD) until they stop growing for a while: the
/// sender is then blocked on a full socket. Bounded: gives up after 30 s.
fn wait_until_receive_queue_stops_growing(stream: &std::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let queued = || {
        let mut bytes: libc::c_int = 0;
        // SAFETY: FIONREAD writes one c_int through the pointer, which is live.
        let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::FIONREAD, &mut bytes) };
        assert_eq!(rc, 0, "FIONREAD: {}", std::io::Error::last_os_error());
        bytes
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let (mut last, mut unchanged_polls) = (queued(), 0);
    while unchanged_polls < 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
        let now = queued();
        unchanged_polls = if now == last && now > 0 {
            unchanged_polls + 1
        } else {
            0
        };
        last = now;
    }
}

#[test]
fn a_namespace_without_a_profile_goes_through_the_fifo_scheduler() {
    // One scheduler path: every device operation of a namespace without a profile passes
    // through its thread's scheduler (first in, first out) and is charged to the namespace's
    // default tenant.
    let server = reflex_server::Server::start(config(vec![namespace(1, "mem:1M", None)]))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let mut back = [0u8; 4096];
    for _ in 0..10 {
        client.write(1, 0, &back).unwrap_or_else(|e| panic!("{e}"));
        client
            .read(1, 0, &mut back)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    client.flush(1).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(server.qos_plan(1), None, "no profile, no QoS plan");
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let totals = reflex_server::tenant_totals(&stats);
    assert_eq!(totals.len(), 1, "{totals:?}");
    let default = totals
        .values()
        .next()
        .unwrap_or_else(|| panic!("no tenant"));
    assert_eq!(default.requests, 21);
    assert_eq!(default.arrivals, 21);
    assert_eq!(default.bytes, 20 * 4096 + 4096);
}

#[test]
fn a_port_held_by_another_server_is_refused_not_shared() {
    let first = common::mem_server();
    let mut second = common::config(vec![common::namespace(1, "mem:1M", None)]);
    second.port = first.native_addr().port();
    match reflex_server::Server::start(second) {
        Err(reflex_server::ServerError::Bind { addr, source }) => {
            assert_eq!(addr.port(), first.native_addr().port());
            assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
        }
        Err(other) => panic!("expected a bind refusal, got {other}"),
        Ok(_) => panic!("a second server shared port {}", first.native_addr().port()),
    }
}
