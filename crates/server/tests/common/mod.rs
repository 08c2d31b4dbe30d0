//! Shared helpers for the end-to-end tests: servers on loopback with port 0, a raw native
//! protocol connection for malformed traffic, and data patterns.
//!
//! Environment:
//! - `REFLEX_DRIVER` (`auto`, `uring`, `epoll`; unset or empty: `auto`): the I/O driver of
//!   every server the tests start, in process ([`config`]) or as a `reflexd` child
//!   ([`driver_args`]); `scripts/test.sh` runs the suite once with `epoll`.
//! - `REFLEX_TEST_RUNNER` (e.g. `qemu-aarch64 -L /usr/aarch64-linux-gnu`): the command that
//!   runs a binary of this workspace when the kernel cannot run it itself (a cross-compiled
//!   test run without binfmt_misc); see [`workspace_binary`].
#![allow(dead_code)]

use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::sync::mpsc::Receiver;
use std::time::Duration;

use reflex_proto::native::{self, RequestHeader, ResponseHeader};
use reflex_server::{
    Config, Driver, DriverChoice, NamespaceConfig, NbdConfig, NvmeTcpConfig, OriginalPortConfig,
    Server, ServerHandle,
};

/// The driver the tests' servers run on: `REFLEX_DRIVER`, or `auto` when it is unset.
pub fn driver() -> DriverChoice {
    match std::env::var("REFLEX_DRIVER") {
        Ok(text) if !text.trim().is_empty() => text
            .parse()
            .unwrap_or_else(|e| panic!("REFLEX_DRIVER: {e}")),
        _ => DriverChoice::Auto,
    }
}

/// io_uring for the tests that exist once per driver, unless the tests run under an emulator
/// (`REFLEX_TEST_RUNNER`: qemu-user implements no io_uring), where `auto` picks epoll.
pub fn io_uring_driver() -> DriverChoice {
    if std::env::var_os("REFLEX_TEST_RUNNER").is_some_and(|runner| !runner.is_empty()) {
        DriverChoice::Auto
    } else {
        DriverChoice::Uring
    }
}

/// `--driver NAME` for a `reflexd` child process (nothing when `REFLEX_DRIVER` is unset, so
/// the binary's own default applies).
pub fn driver_args() -> Vec<String> {
    match std::env::var("REFLEX_DRIVER") {
        Ok(text) if !text.trim().is_empty() => vec!["--driver".into(), driver().to_string()],
        _ => Vec::new(),
    }
}

/// How to run `program`, a binary this workspace built: `(program, leading arguments)`,
/// through `REFLEX_TEST_RUNNER` (split at whitespace) when that is set.
pub fn workspace_binary(program: &Path) -> (PathBuf, Vec<OsString>) {
    let runner = std::env::var("REFLEX_TEST_RUNNER").unwrap_or_default();
    let mut words = runner.split_whitespace();
    match words.next() {
        None => (program.to_path_buf(), Vec::new()),
        Some(runner_program) => {
            let mut args: Vec<OsString> = words.map(OsString::from).collect();
            args.push(program.as_os_str().to_os_string());
            (PathBuf::from(runner_program), args)
        }
    }
}

/// A [`Command`] for `reflexd` (through the runner, see [`workspace_binary`]); the caller
/// adds the flags, [`driver_args`] among them unless it picks a driver itself.
pub fn reflexd_command() -> Command {
    let (program, args) = workspace_binary(Path::new(env!("CARGO_BIN_EXE_reflexd")));
    let mut command = Command::new(program);
    command.args(args);
    // Tests run in parallel: the admin API's fixed default port would collide.
    command.arg("--no-admin");
    command
}

pub fn namespace(id: u32, backend: &str, size_bytes: Option<u64>) -> NamespaceConfig {
    NamespaceConfig {
        size_bytes,
        ..NamespaceConfig::new(id, backend)
    }
}

/// A small server: 2 threads, 8 MiB arena per thread, window 16, every port (NBD's too)
/// picked freely.
pub fn config(namespaces: Vec<NamespaceConfig>) -> Config {
    Config {
        listen: IpAddr::V4(Ipv4Addr::LOCALHOST),
        port: 0,
        original_ports: Some(vec![OriginalPortConfig::new(0, namespaces[0].id)]),
        nbd: NbdConfig {
            port: 0,
            ..NbdConfig::default()
        },
        nvme_tcp: NvmeTcpConfig {
            port: 0,
            ..NvmeTcpConfig::default()
        },
        threads: 2,
        window: 16,
        arena_bytes_per_thread: 8 << 20,
        connections_per_thread_max: 64,
        requests_per_thread_max: 256,
        namespaces,
        driver: driver(),
        admin: reflex_server::admin::AdminConfig::disabled(),
        ..Config::default()
    }
}

pub fn start(config: Config) -> ServerHandle {
    let choice = config.driver;
    let server = Server::start(config).unwrap_or_else(|e| panic!("server start: {e}"));
    check_driver(choice, &server);
    server
}

/// A server asked for a driver runs on it (so `REFLEX_DRIVER=epoll` cannot silently test
/// io_uring).
pub fn check_driver(choice: DriverChoice, server: &ServerHandle) {
    match choice {
        DriverChoice::Epoll => assert_eq!(server.driver(), Driver::Epoll),
        DriverChoice::Uring => assert_eq!(server.driver(), Driver::Uring),
        DriverChoice::Auto => {}
    }
}

pub fn mem_server() -> ServerHandle {
    start(config(vec![namespace(1, "mem:64M", None)]))
}

/// Bytes that depend on the seed and the position, so misplaced data is caught.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A native-protocol connection driven byte by byte, for requests a well-behaved client
/// would never send.
pub struct Raw {
    pub stream: TcpStream,
}

impl Raw {
    pub fn connect(addr: SocketAddr) -> Raw {
        let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect: {e}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap_or_else(|e| panic!("{e}"));
        stream.set_nodelay(true).unwrap_or_else(|e| panic!("{e}"));
        Raw { stream }
    }

    pub fn send(&mut self, header: &RequestHeader, payload: &[u8]) {
        self.send_bytes(&header.to_bytes());
        self.send_bytes(payload);
    }

    pub fn send_bytes(&mut self, bytes: &[u8]) {
        self.stream
            .write_all(bytes)
            .unwrap_or_else(|e| panic!("send: {e}"));
    }

    /// Reads one response header and its payload.
    pub fn receive(&mut self) -> (ResponseHeader, Vec<u8>) {
        let mut header_bytes = [0u8; native::RESPONSE_HEADER_SIZE];
        self.stream
            .read_exact(&mut header_bytes)
            .unwrap_or_else(|e| panic!("receive header: {e}"));
        let Ok(Some((header, _))) = ResponseHeader::decode(&header_bytes) else {
            panic!("malformed response header {header_bytes:?}");
        };
        let mut payload = vec![0u8; header.length_bytes as usize];
        self.stream
            .read_exact(&mut payload)
            .unwrap_or_else(|e| panic!("receive payload: {e}"));
        (header, payload)
    }

    /// Sends a request and returns its response, checking the id is echoed.
    pub fn call(&mut self, header: &RequestHeader, payload: &[u8]) -> (ResponseHeader, Vec<u8>) {
        self.send(header, payload);
        let (response, data) = self.receive();
        assert_eq!(response.request_id, header.request_id);
        assert_eq!(response.opcode_raw, header.opcode_raw);
        (response, data)
    }

    /// True when the server closed the connection (EOF or reset) rather than answering.
    pub fn is_closed_by_server(&mut self) -> bool {
        let mut bytes = [0u8; 64];
        loop {
            match self.stream.read(&mut bytes) {
                Ok(0) => return true,
                Ok(n) => {
                    eprintln!("expected a close, received {:?}", &bytes[..n]);
                    return false;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let closed = matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
                    );
                    if !closed {
                        eprintln!("expected a close, the read failed: {e} ({:?})", e.kind());
                    }
                    return closed;
                }
            }
        }
    }
}

/// `reflexd --config CONFIG` as a child process on the test's driver, logging at info level
/// (`admin`: with the admin API the configuration describes; otherwise `--no-admin`). Every
/// line of its standard error comes through the receiver as it is written; the receiver ends
/// when reflexd does.
pub fn spawn_reflexd(config: &Path, admin: bool) -> (Child, Receiver<String>) {
    let (program, args) = workspace_binary(Path::new(env!("CARGO_BIN_EXE_reflexd")));
    let mut command = Command::new(program);
    command.args(args);
    if !admin {
        command.arg("--no-admin");
    }
    command.arg("--config").arg(config);
    spawn_logged(command)
}

/// Starts `command` (a reflexd) on the test's driver, logging at info level, every line of
/// its standard error through the receiver as it is written.
fn spawn_logged(mut command: Command) -> (Child, Receiver<String>) {
    use std::io::BufRead;
    let mut child = command
        .args(driver_args())
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn reflexd: {e}"));
    let stderr = child.stderr.take().unwrap_or_else(|| panic!("no stderr"));
    let (lines_tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, lines)
}

/// The first line of `log` that contains `needle`; panics after a minute, or when reflexd
/// exits first (with what it logged).
pub fn wait_for_line(log: &Receiver<String>, needle: &str) -> String {
    let mut seen = Vec::new();
    loop {
        match log.recv_timeout(Duration::from_secs(60)) {
            Ok(line) if line.contains(needle) => return line,
            Ok(line) => seen.push(line),
            Err(e) => panic!(
                "reflexd never logged {needle:?} ({e}):\n{}",
                seen.join("\n")
            ),
        }
    }
}

/// The value of `key=` in a log line, parsed.
pub fn log_field<T: FromStr>(line: &str, key: &str) -> Option<T> {
    line.split(&format!("{key}="))
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A `reflexd` child process started with flags (on the test's driver, logging at info
/// level), known to serve once it logged `reflexd serving`; its log keeps draining so the
/// child never blocks on a full pipe.
pub struct Daemon {
    child: Child,
    /// The `reflexd serving` line: where each listener is (`field`).
    serving: String,
    /// Kept so the log keeps draining (the child never blocks on a full pipe).
    _log: Receiver<String>,
}

impl Daemon {
    pub fn spawn(flags: &[&str]) -> Daemon {
        let mut command = reflexd_command();
        command.args(flags);
        let (child, log) = spawn_logged(command);
        let serving = wait_for_line(&log, "reflexd serving");
        Daemon {
            child,
            serving,
            _log: log,
        }
    }

    /// The value of `key=` in the serving line (`native`, `nbd`, `kv`, ...).
    pub fn field<T: FromStr>(&self, key: &str) -> T {
        log_field(&self.serving, key).unwrap_or_else(|| panic!("no {key}= in {:?}", self.serving))
    }

    /// SIGKILL: no drain, no flush, no orderly close of anything.
    pub fn kill(mut self) {
        self.child.kill().unwrap_or_else(|e| panic!("kill -9: {e}"));
        self.child.wait().unwrap_or_else(|e| panic!("wait: {e}"));
    }

    /// SIGTERM, and a clean exit.
    pub fn terminate(mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap_or_else(|e| panic!("kill: {e}"));
        assert!(status.success());
        let exit = self.child.wait().unwrap_or_else(|e| panic!("wait: {e}"));
        assert!(exit.success(), "reflexd exited with {exit}");
    }
}
