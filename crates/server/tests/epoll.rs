//! The epoll driver on a real file backend (O_DIRECT), whatever `REFLEX_DRIVER` says: every
//! request travels sockets driven by epoll and a device queue that runs on the file's thread
//! pool. Concurrent pipelined connections write (some with FUA), flush, trim and read back
//! their own regions; another connection then sees all of it; a restarted server serves it
//! again; and a client that stops reading its answers gets them all once it reads again
//! (sends that find the socket full wait for their edge).

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{namespace, pattern, start};
use reflex_client::{Client, PipelinedClient};
use reflex_server::{Config, Driver, DriverChoice};

const FILE_SIZE_BYTES: u64 = 64 << 20;
const CONNECTIONS: u64 = 8;
const REGION_BYTES: u64 = FILE_SIZE_BYTES / CONNECTIONS;
/// Requests each connection keeps in flight (the servers' window is 16).
const IN_FLIGHT: usize = 12;
/// Request sizes, cycled through: single blocks up to the largest a window allows at once.
const CHUNK_SIZES_BYTES: [u64; 5] = [4096, 65536, 512, 131072, 16384];
/// Bound on any one phase of a connection's work.
const PHASE_MAX: Duration = Duration::from_secs(60);

/// A two-thread epoll server on `backend` (small arenas, window 16, like every test server).
fn epoll_server_config(backend: &str, size_bytes: Option<u64>) -> Config {
    Config {
        driver: DriverChoice::Epoll,
        arena_bytes_per_thread: 16 << 20,
        ..common::config(vec![namespace(1, backend, size_bytes)])
    }
}

/// A directory on the file system the build lives on (not tmpfs), so O_DIRECT works.
fn file_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap_or_else(|e| panic!("{e}"))
}

/// The chunks of region `connection`: `(offset, length)` covering it exactly.
fn chunks(connection: u64) -> Vec<(u64, u64)> {
    let start = connection * REGION_BYTES;
    let end = start + REGION_BYTES;
    let mut chunks = Vec::new();
    let mut offset = start;
    let mut index = 0;
    while offset < end {
        let length = CHUNK_SIZES_BYTES[index % CHUNK_SIZES_BYTES.len()].min(end - offset);
        chunks.push((offset, length));
        offset += length;
        index += 1;
    }
    chunks
}

/// What the file holds at `offset..offset + length` after the writes (before any trim).
fn expected(offset: u64, length: u64) -> Vec<u8> {
    let data = pattern(offset, length as usize);
    assert_eq!(data.len() as u64, length);
    data
}

/// Whether this process has `path` open with O_DIRECT (the server runs in this process).
fn opened_with_o_direct(path: &Path) -> bool {
    let wanted = std::fs::canonicalize(path).unwrap_or_else(|e| panic!("{e}"));
    let entries = std::fs::read_dir("/proc/self/fd").unwrap_or_else(|e| panic!("{e}"));
    let mut found = false;
    for entry in entries.flatten() {
        if std::fs::read_link(entry.path()).ok() != Some(wanted.clone()) {
            continue;
        }
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: F_GETFL reads a descriptor's flags and passes no memory; a descriptor that
        // was closed meanwhile makes it fail with EBADF, which counts as "not found".
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            continue;
        }
        assert!(
            flags & libc::O_DIRECT != 0,
            "{} is open without O_DIRECT",
            path.display()
        );
        found = true;
    }
    found
}

/// One connection's work on its region: pipelined writes (every fifth with FUA), FLUSH,
/// pipelined reads compared with what was written, then a TRIM of one chunk read back as
/// zeroes (and the chunk written again).
fn exercise_region(addr: std::net::SocketAddr, connection: u64) {
    let mut client = PipelinedClient::connect(addr).unwrap_or_else(|e| panic!("connect: {e}"));
    let chunks = chunks(connection);
    let mut next = 0usize;
    let mut answered = 0usize;
    let started = Instant::now();
    while answered < chunks.len() {
        while next < chunks.len() && next - answered < IN_FLIGHT {
            let (offset, length) = chunks[next];
            let fua = next.is_multiple_of(5);
            client
                .submit_write(next as u64, 1, offset, &expected(offset, length), fua)
                .unwrap_or_else(|e| panic!("{e}"));
            next += 1;
        }
        answered += reap(&mut client, |_, _| {});
        assert!(
            started.elapsed() < PHASE_MAX,
            "writes of connection {connection}"
        );
    }
    client
        .submit_flush(u64::MAX - 1, 1)
        .unwrap_or_else(|e| panic!("{e}"));
    while reap(&mut client, |_, _| {}) == 0 {
        assert!(
            started.elapsed() < PHASE_MAX,
            "flush of connection {connection}"
        );
    }

    let (mut next, mut answered) = (0usize, 0usize);
    let started = Instant::now();
    while answered < chunks.len() {
        while next < chunks.len() && next - answered < IN_FLIGHT {
            let (offset, length) = chunks[next];
            client
                .submit_read(next as u64, 1, offset, length as u32)
                .unwrap_or_else(|e| panic!("{e}"));
            next += 1;
        }
        answered += reap(&mut client, |request_id, data| {
            let (offset, length) = chunks[request_id as usize];
            assert!(
                data == expected(offset, length).as_slice(),
                "connection {connection}: chunk at {offset} (+{length}) reads back wrong"
            );
        });
        assert!(
            started.elapsed() < PHASE_MAX,
            "reads of connection {connection}"
        );
    }

    // TRIM the second chunk: it reads back as zeroes; then it is written again.
    let (offset, length) = chunks[1];
    let mut blocking = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
    blocking
        .trim(1, offset, length as u32)
        .unwrap_or_else(|e| panic!("trim: {e}"));
    let mut back = vec![0xFFu8; length as usize];
    blocking
        .read(1, offset, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(back.iter().all(|&b| b == 0), "a trimmed range reads zeroes");
    blocking
        .write_fua(1, offset, &expected(offset, length))
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Moves bytes and hands each READ's data to `check`; returns how many answers arrived
/// (all must be OK).
fn reap(client: &mut PipelinedClient, mut check: impl FnMut(u64, &[u8])) -> usize {
    let mut count = 0;
    if !client
        .wait(Some(Duration::from_millis(100)))
        .unwrap_or_else(|e| panic!("{e}"))
    {
        return 0;
    }
    while let Some(completion) = client.reap().unwrap_or_else(|e| panic!("{e}")) {
        assert!(completion.is_ok(), "{:?}", completion.result());
        check(completion.request_id, completion.data);
        count += 1;
    }
    count
}

#[test]
fn concurrent_connections_write_flush_trim_and_read_back_through_the_file_pool() {
    let dir = file_dir();
    let path: PathBuf = dir.path().join("ns1");
    let backend = format!("file:{}", path.display());
    let server = start(epoll_server_config(&backend, Some(FILE_SIZE_BYTES)));
    assert_eq!(server.driver(), Driver::Epoll);
    assert!(
        opened_with_o_direct(&path),
        "the server has {} open",
        path.display()
    );
    let addr = server.native_addr();
    let workers: Vec<_> = (0..CONNECTIONS)
        .map(|connection| std::thread::spawn(move || exercise_region(addr, connection)))
        .collect();
    for worker in workers {
        if worker.join().is_err() {
            panic!("a connection's checks failed (see its panic above)");
        }
    }
    // Another connection sees every region, each written by a different one.
    let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
    for connection in 0..CONNECTIONS {
        for (offset, length) in chunks(connection).into_iter().take(3) {
            let mut back = vec![0u8; length as usize];
            client
                .read(1, offset, &mut back)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(
                back == expected(offset, length),
                "region {connection} at {offset}"
            );
        }
    }
    client.flush(1).unwrap_or_else(|e| panic!("{e}"));
    drop(client);
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats.iter().map(|s| s.io_errors).sum::<u64>(), 0);
    assert!(stats.iter().all(|s| !s.registered_buffers));
    let written: u64 = stats.iter().map(|s| s.bytes_written).sum();
    assert!(written >= FILE_SIZE_BYTES, "{written} bytes written");

    // The data is in the file: a new server (epoll again) on it, and the file itself.
    let server = start(epoll_server_config(&backend, None));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(client.namespaces()[0].size_bytes, FILE_SIZE_BYTES);
    for connection in 0..CONNECTIONS {
        let (offset, length) = chunks(connection)[1];
        let mut back = vec![0u8; length as usize];
        client
            .read(1, offset, &mut back)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            back == expected(offset, length),
            "region {connection} after restart"
        );
    }
    drop(client);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let file = std::fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
    for connection in [0, CONNECTIONS - 1] {
        let (offset, length) = chunks(connection)[0];
        let range = offset as usize..(offset + length) as usize;
        assert!(
            file[range] == expected(offset, length),
            "file region {connection}"
        );
    }
}

#[test]
fn answers_a_client_stopped_reading_wait_for_room_and_all_arrive() {
    let dir = file_dir();
    let path = dir.path().join("ns1");
    let backend = format!("file:{}", path.display());
    let server = start(epoll_server_config(&backend, Some(FILE_SIZE_BYTES)));
    let data = pattern(3, 1 << 20);
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    client.write(1, 0, &data).unwrap_or_else(|e| panic!("{e}"));
    drop(client);
    // 16 READs of 1 MiB in flight, more than the loopback socket buffers hold by default,
    // while the client does not read: the server's sends find the socket full.
    let mut client =
        PipelinedClient::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    let reads = 16u64;
    for id in 0..reads {
        client
            .submit_read(id, 1, 0, 1 << 20)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    client.flush_transmit().unwrap_or_else(|e| panic!("{e}"));
    std::thread::sleep(Duration::from_millis(300));
    let mut answered = 0;
    let started = Instant::now();
    while answered < reads {
        answered += reap(&mut client, |_, back| assert!(back == data.as_slice())) as u64;
        assert!(
            started.elapsed() < PHASE_MAX,
            "{answered} of {reads} answers"
        );
    }
    drop(client);
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats.iter().map(|s| s.io_errors).sum::<u64>(), 0);
}
