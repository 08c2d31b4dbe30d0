//! Durability across restarts: in process (`ServerHandle::shutdown`) and the real `reflexd`
//! binary stopped with SIGTERM; and the file backend on tmpfs.

mod common;

use std::net::SocketAddr;

use common::{Daemon, config, namespace, pattern, start};
use reflex_client::Client;

#[test]
fn flushed_data_survives_an_in_process_restart() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let backend = format!("file:{}", dir.path().join("ns1").display());
    let data = pattern(42, 512 << 10);
    {
        let server = start(config(vec![namespace(1, &backend, Some(16 << 20))]));
        let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
        client
            .write(1, 5 << 20, &data)
            .unwrap_or_else(|e| panic!("{e}"));
        client.flush(1).unwrap_or_else(|e| panic!("{e}"));
        server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }
    // The second server opens the existing file at its own size.
    let server = start(config(vec![namespace(1, &backend, None)]));
    let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(client.namespaces()[0].size_bytes, 16 << 20);
    let mut back = vec![0u8; 512 << 10];
    client
        .read(1, 5 << 20, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(back == data);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn file_on_tmpfs_works_with_or_without_o_direct() {
    let Ok(dir) = tempfile::tempdir_in("/dev/shm") else {
        // No tmpfs here: the plain file tests cover the rest.
        return;
    };
    let backend = format!("file:{}", dir.path().join("ns").display());
    let data = pattern(8, 64 << 10);
    for _ in 0..2 {
        let server = start(config(vec![namespace(1, &backend, Some(4 << 20))]));
        let mut client = Client::connect(server.native_addr()).unwrap_or_else(|e| panic!("{e}"));
        client.write(1, 0, &data).unwrap_or_else(|e| panic!("{e}"));
        client.flush(1).unwrap_or_else(|e| panic!("{e}"));
        let mut back = vec![0u8; 64 << 10];
        client
            .read(1, 0, &mut back)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(back == data);
        server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A `reflexd` child process and the native address it logged.
/// `reflexd` with two threads and a 4 MiB arena on namespace `namespace_flag`, on the given
/// native and NBD ports (0: any free port).
fn spawn_on(namespace_flag: &str, port: u16, nbd_port: u16) -> (Daemon, SocketAddr) {
    let (port, nbd_port) = (port.to_string(), nbd_port.to_string());
    let daemon = Daemon::spawn(&[
        "--port",
        &port,
        "--no-original",
        "--no-nvme-tcp",
        "--nbd-port",
        &nbd_port,
        "--threads",
        "2",
        "--arena-size",
        "4M",
        "--namespace",
        namespace_flag,
    ]);
    let addr = daemon.field("native");
    (daemon, addr)
}

fn spawn(namespace_flag: &str) -> (Daemon, SocketAddr) {
    spawn_on(namespace_flag, 0, 0)
}

#[test]
fn the_binary_flushes_on_sigterm_and_serves_the_data_again() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let flag = format!("1=file:{},size=8M", dir.path().join("ns1").display());
    let data = pattern(77, 256 << 10);
    let (daemon, addr) = spawn(&flag);
    {
        let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
        client
            .write(1, 1 << 20, &data)
            .unwrap_or_else(|e| panic!("{e}"));
        client.flush(1).unwrap_or_else(|e| panic!("{e}"));
        // Acknowledged but not flushed by the client: the shutdown flush covers it. (Read back
        // by the same kernel, this checks the path, not durability across power loss.)
        client
            .write(1, 4 << 20, &data)
            .unwrap_or_else(|e| panic!("{e}"));
        // The client stays connected while the server shuts down.
        daemon.terminate();
    }
    let (daemon, addr) = spawn(&flag);
    let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
    for offset in [1 << 20, 4 << 20] {
        let mut back = vec![0u8; 256 << 10];
        client
            .read(1, offset, &mut back)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(back == data, "offset {offset}");
    }
    drop(client);
    daemon.terminate();
}

/// A free TCP port on loopback (free when this returns; the caller binds it soon after).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    listener
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .port()
}

/// Issue 9, item 6: a reflexd killed with SIGKILL keeps its listening sockets until the
/// kernel has torn down its io_uring; a restart at once on the same ports must wait for them
/// instead of failing with "Address already in use".
#[test]
fn a_restart_right_after_sigkill_binds_the_same_ports() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let flag = format!("1=file:{},size=4M", dir.path().join("ns1").display());
    let (port, nbd_port) = (free_port(), free_port());
    let data = pattern(6, 4096);
    for cycle in 0..5 {
        let (daemon, addr) = spawn_on(&flag, port, nbd_port);
        assert_eq!(addr.port(), port, "cycle {cycle}");
        let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
        client
            .write(1, 4096 * cycle, &data)
            .unwrap_or_else(|e| panic!("{e}"));
        // The connection stays open across the kill, as a real client's would.
        daemon.kill();
        drop(client);
    }
    let (daemon, addr) = spawn_on(&flag, port, nbd_port);
    let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
    let mut back = vec![0u8; 4096];
    client
        .read(1, 0, &mut back)
        .unwrap_or_else(|e| panic!("{e}"));
    drop(client);
    daemon.terminate();
}

/// Issue 9, item 7: a port conflict stops start-up before the backing file (or its
/// directory) is created.
#[test]
fn a_port_conflict_creates_no_backing_file() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let port = taken.local_addr().unwrap_or_else(|e| panic!("{e}")).port();
    let backing = dir.path().join("sub").join("ns1");
    let output = common::reflexd_command()
        .args(common::driver_args())
        .args([
            "--port",
            &port.to_string(),
            "--no-original",
            "--no-nbd",
            "--no-nvme-tcp",
        ])
        .args([
            "--namespace",
            &format!("1=file:{},size=1M", backing.display()),
        ])
        .env("RUST_LOG", "error")
        .output()
        .unwrap_or_else(|e| panic!("spawn reflexd: {e}"));
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("in use"), "stderr: {stderr}");
    assert!(!backing.exists());
    assert!(!dir.path().join("sub").exists());
}
