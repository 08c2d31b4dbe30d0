//! limit-server and limit-client on real loopback TCP. Every run is bounded by a request
//! count (never by time), and the assertions are on counts and bytes, never on speed.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

use reflex_limit::client::{self, Bound, ClientConfig, ClientError, ConfigError};
use reflex_limit::server::{Server, ServerConfig, ServerStats, data_region};
use reflex_limit::uring::Stop;
use reflex_limit::wire::request;
use reflex_proto::original::{HEADER_SIZE, Opcode};

/// A timeout for socket reads, so a broken server fails the test instead of hanging it.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

struct Running {
    address: SocketAddr,
    stop: Stop,
    thread: JoinHandle<ServerStats>,
}

impl Running {
    fn start(config: ServerConfig) -> Running {
        let server = Server::bind("127.0.0.1:0".parse().unwrap(), config).unwrap();
        let address = server.local_addr().unwrap();
        let stop = server.stop_handle();
        let thread = std::thread::spawn(move || server.run().unwrap());
        Running {
            address,
            stop,
            thread,
        }
    }

    fn stop(self) -> ServerStats {
        self.stop.stop();
        self.thread.join().unwrap()
    }
}

fn count_bounded(
    address: SocketAddr,
    connections: usize,
    depth: usize,
    requests: u64,
) -> ClientConfig {
    ClientConfig {
        connections,
        depth,
        bound: Bound::Requests(requests),
        timeout: Duration::from_secs(30),
        ..ClientConfig::new(address)
    }
}

fn connect(address: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(address).unwrap();
    stream.set_nodelay(true).unwrap();
    stream.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
    stream
}

/// Reads until the server closes the connection.
fn read_to_eof(stream: &mut TcpStream) -> Vec<u8> {
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes).unwrap();
    bytes
}

fn check_count_bounded_run(poll: bool) {
    let server = Running::start(ServerConfig {
        poll,
        ..ServerConfig::default()
    });
    // The client checks every reply's handle, opcode, lba and length against its request, in
    // order per connection, and fails the run on the first mismatch.
    let report = client::run(&count_bounded(server.address, 4, 8, 20_000)).unwrap();
    assert_eq!(report.replies_total, 20_000);
    assert_eq!(report.replies, 20_000);
    let stats = server.stop();
    assert_eq!(stats.responses_sent, 20_000);
    assert_eq!(stats.connections_refused_framing, 0);
    assert_eq!(stats.connections_failed, 0);
}

#[test]
fn a_count_bounded_run_gets_every_reply_blocking() {
    check_count_bounded_run(false);
}

#[test]
fn a_count_bounded_run_gets_every_reply_polling() {
    check_count_bounded_run(true);
}

#[test]
fn requests_split_byte_by_byte_are_answered_in_order_and_eof_drains() {
    let server = Running::start(ServerConfig::default());
    let mut stream = connect(server.address);
    let mut input = Vec::new();
    let mut expected = Vec::new();
    for (handle, lba_count) in [(1u64, 8u32), (2, 1), (3, 2048), (4, 8)] {
        let header = request(Opcode::Read, handle, handle * 8, lba_count);
        input.extend_from_slice(&header);
        expected.extend_from_slice(&header);
        expected.extend_from_slice(&data_region()[..lba_count as usize * 512]);
    }
    // A write: its payload is discarded and it is answered with lba_count 0.
    input.extend_from_slice(&request(Opcode::Write, 5, 0, 3));
    input.extend_from_slice(&[0xee; 1536]);
    expected.extend_from_slice(&request(Opcode::Write, 5, 0, 0));
    let header = request(Opcode::Read, 6, 0, 8);
    input.extend_from_slice(&header);
    expected.extend_from_slice(&header);
    expected.extend_from_slice(&data_region()[..4096]);
    // The first two headers one byte per write, the rest in one go.
    for byte in &input[..2 * HEADER_SIZE] {
        stream.write_all(std::slice::from_ref(byte)).unwrap();
    }
    stream.write_all(&input[2 * HEADER_SIZE..]).unwrap();
    // EOF from the client: the server answers everything owed, then closes.
    stream.shutdown(Shutdown::Write).unwrap();
    let received = read_to_eof(&mut stream);
    assert_eq!(received.len(), expected.len());
    assert!(
        received == expected,
        "replies differ from the expected bytes"
    );
    let stats = server.stop();
    assert_eq!(stats.responses_sent, 6);
}

#[test]
fn bad_framing_closes_only_that_connection() {
    let server = Running::start(ServerConfig::default());
    let mut good = connect(server.address);
    let mut bad = connect(server.address);
    let mut header = request(Opcode::Read, 1, 0, 8);
    header[0] = 99; // bad magic
    bad.write_all(&header).unwrap();
    assert!(read_to_eof(&mut bad).is_empty());
    let mut zero_length = connect(server.address);
    zero_length
        .write_all(&request(Opcode::Read, 1, 0, 0))
        .unwrap();
    assert!(read_to_eof(&mut zero_length).is_empty());
    good.write_all(&request(Opcode::Read, 7, 0, 8)).unwrap();
    let mut reply = vec![0; HEADER_SIZE + 4096];
    good.read_exact(&mut reply).unwrap();
    assert_eq!(reply[..HEADER_SIZE], request(Opcode::Read, 7, 0, 8));
    let stats = server.stop();
    assert_eq!(stats.connections_refused_framing, 2);
    assert_eq!(stats.responses_sent, 1);
}

#[test]
fn connections_beyond_the_maximum_are_closed_at_once() {
    let server = Running::start(ServerConfig {
        connections_max: 1,
        ..ServerConfig::default()
    });
    let mut first = connect(server.address);
    first.write_all(&request(Opcode::Read, 1, 0, 1)).unwrap();
    let mut reply = vec![0; HEADER_SIZE + 512];
    first.read_exact(&mut reply).unwrap();
    let mut second = connect(server.address);
    assert!(read_to_eof(&mut second).is_empty());
    let stats = server.stop();
    assert!(stats.connections_refused >= 1);
    assert_eq!(stats.responses_sent, 1);
}

/// A one-connection fake server: reads one request and answers it with `reply(request)`.
fn fake_server(reply: fn([u8; HEADER_SIZE]) -> Vec<u8>) -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    let thread = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
        let mut header = [0; HEADER_SIZE];
        if stream.read_exact(&mut header).is_ok() {
            let _ = stream.write_all(&reply(header));
        }
        // Give the client time to read before the close.
        std::thread::sleep(Duration::from_millis(100));
    });
    (address, thread)
}

#[test]
fn the_client_refuses_a_reply_with_the_wrong_handle() {
    let (address, thread) = fake_server(|mut header| {
        header[4] ^= 1;
        let mut reply = header.to_vec();
        reply.extend_from_slice(&[0; 4096]);
        reply
    });
    let result = client::run(&count_bounded(address, 1, 1, 1));
    assert!(
        matches!(result, Err(ClientError::BadReply { connection: 0, .. })),
        "{result:?}"
    );
    thread.join().unwrap();
}

#[test]
fn the_client_reports_a_server_that_closes_early() {
    let (address, thread) = fake_server(|_| Vec::new());
    let result = client::run(&count_bounded(address, 1, 1, 1));
    assert!(
        matches!(
            result,
            Err(ClientError::Closed {
                connection: 0,
                outstanding: 1
            })
        ),
        "{result:?}"
    );
    thread.join().unwrap();
}

#[test]
fn the_client_refuses_bad_configurations() {
    let address: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let check = |config: ClientConfig, expected: ConfigError| {
        assert_eq!(config.validate(), Err(expected.clone()));
        assert!(
            matches!(client::run(&config), Err(ClientError::Config(error)) if error == expected)
        );
    };
    check(
        ClientConfig {
            depth: 0,
            ..ClientConfig::new(address)
        },
        ConfigError::Depth { max: 512 },
    );
    check(
        ClientConfig {
            size_bytes: 1000,
            ..ClientConfig::new(address)
        },
        ConfigError::Size { max: 1 << 20 },
    );
    check(
        ClientConfig {
            bound: Bound::Requests(0),
            ..ClientConfig::new(address)
        },
        ConfigError::Requests { max: 1 << 40 },
    );
}
