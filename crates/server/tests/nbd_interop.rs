//! Interop with the standard NBD clients: nbdinfo, nbdcopy, nbdsh (libnbd), qemu-img, qemu-io,
//! fio's `nbd` engine, and the legacy path nbdfuse → loop device → ext4 → mount; also what
//! clients that never negotiated block sizes need (32 MiB requests, any byte range, buffered
//! writes through nbdfuse), CACHE, FAST_ZERO, and block status (`nbdinfo --map`, `qemu-img
//! map`).
//!
//! Why real clients: a server that agrees with its own codec can still disagree with the
//! world. These are the programs users point at an NBD server, so each check drives one of them
//! over loopback TCP and asserts what it reports or reads back.
//!
//! The server under test is chosen by `REFLEX_NBD_SERVER` (`reflexd`, `nbdkit`, `qemu-nbd`;
//! default [`DEFAULT_SERVER_UNDER_TEST`]), so every check was first validated against the
//! established servers and then applies unchanged to `reflexd`. Expectations that differ
//! between servers (advertised block sizes, the errno for a write to a read-only export) live
//! in [`Expect`]; reflexd's come from docs/NBD.md.
//!
//! A check that cannot fail proves nothing, so each one also runs as a negative control that
//! must fail: against `nbdkit null` (which discards writes), with libnbd's strict mode left on
//! (libnbd then refuses bad requests itself), against a damaged block, against fake servers
//! that break the option negotiation, a remount on an empty export, against nbdkit enforcing
//! 512-byte alignment and 1 MiB on every client (the unaligned and 32 MiB requests must really
//! be sent), and against nbdkit reporting no holes. See the team's shared
//! TOOLS.md for the traps these controls guard against.
//!
//! Missing tools fail the tests (scripts/test.sh installs them); nothing is skipped. Every
//! external command has a timeout; servers, nbdfuse, loop devices and mounts are released by
//! guards whose `Drop` runs even when an assertion fails.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

mod common;

/// The server the checks run against when `REFLEX_NBD_SERVER` is not set.
const DEFAULT_SERVER_UNDER_TEST: ServerKind = ServerKind::Reflexd;
/// Size of every export the checks create.
const EXPORT_SIZE_BYTES: u64 = 64 << 20;
/// Upper bound for any one external command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a server or nbdfuse may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a stopped process may take to exit after SIGTERM before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Attempts to start a server on a fresh free port (another process may take the port between
/// our probe and the server's bind).
const LAUNCH_ATTEMPTS: usize = 3;
/// Directories searched for tools, the distribution's first: nbdsh runs the `python3` first on
/// PATH, and a developer's (pyenv, /usr/local) may lack the `nbd` module from python3-libnbd.
const SYSTEM_DIRS: [&str; 6] = [
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
    "/usr/local/sbin",
    "/usr/local/bin",
];
const EDGE_CASES_SCRIPT: &str = include_str!("nbd/edge_cases.py");
const COMPLETENESS_SCRIPT: &str = include_str!("nbd/completeness.py");

// ---------------------------------------------------------------------------------------------
// Tools and commands

/// The Debian package that provides each tool, for the error message when one is missing.
const TOOLS: [(&str, &str); 17] = [
    ("nbdinfo", "libnbd-bin"),
    ("nbdcopy", "libnbd-bin"),
    ("nbdsh", "libnbd-bin"),
    ("nbdfuse", "libnbd-bin"),
    ("fusermount3", "fuse3"),
    ("nbdkit", "nbdkit"),
    ("qemu-img", "qemu-utils"),
    ("qemu-io", "qemu-utils"),
    ("qemu-nbd", "qemu-utils"),
    ("fio", "fio"),
    ("losetup", "util-linux"),
    ("mount", "mount"),
    ("umount", "mount"),
    ("mkfs.ext4", "e2fsprogs"),
    ("e2fsck", "e2fsprogs"),
    ("kill", "procps"),
    ("python3", "python3 (and python3-libnbd)"),
];

/// The absolute path of a tool; panics (never skips) when it is not installed.
fn tool(name: &str) -> PathBuf {
    for dir in SYSTEM_DIRS {
        let path = Path::new(dir).join(name);
        if path.is_file() {
            return path;
        }
    }
    let package = TOOLS
        .iter()
        .find(|(tool, _)| *tool == name)
        .map_or("?", |(_, package)| *package);
    panic!(
        "{name} is not installed; the NBD interop tests need it (Debian package {package}, installed by scripts/test.sh)"
    );
}

/// PATH for every child: system directories first (see [`SYSTEM_DIRS`]).
fn child_path() -> OsString {
    let mut path = OsString::from(SYSTEM_DIRS.join(":"));
    if let Some(rest) = std::env::var_os("PATH") {
        path.push(":");
        path.push(rest);
    }
    path
}

/// A finished external command.
struct Finished {
    line: String,
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Finished {
    fn describe(&self) -> String {
        format!(
            "`{}` exited with {}\n--- stdout\n{}\n--- stderr\n{}",
            self.line,
            self.status,
            tail(&self.stdout, 4000),
            tail(&self.stderr, 4000)
        )
    }
}

fn tail(text: &str, max_chars: usize) -> &str {
    let count = text.chars().count();
    if count <= max_chars {
        return text;
    }
    let skip = count - max_chars;
    match text.char_indices().nth(skip) {
        Some((index, _)) => &text[index..],
        None => text,
    }
}

/// An external command with a deadline.
struct Run {
    program: PathBuf,
    args: Vec<OsString>,
    envs: Vec<(String, OsString)>,
    timeout: Duration,
}

fn cmd(name: &str) -> Run {
    Run {
        program: tool(name),
        args: Vec::new(),
        envs: Vec::new(),
        timeout: COMMAND_TIMEOUT,
    }
}

impl Run {
    fn arg(mut self, arg: impl AsRef<OsStr>) -> Run {
        self.args.push(arg.as_ref().to_os_string());
        self
    }

    fn args<I, S>(mut self, args: I) -> Run
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        self
    }

    fn env(mut self, key: &str, value: impl AsRef<OsStr>) -> Run {
        self.envs
            .push((key.to_string(), value.as_ref().to_os_string()));
        self
    }

    fn line(&self) -> String {
        let mut line = self.program.display().to_string();
        for arg in &self.args {
            line.push(' ');
            let arg = arg.to_string_lossy();
            if arg.len() > 200 {
                line.push_str("<long argument>");
            } else {
                line.push_str(&arg);
            }
        }
        line
    }

    /// Runs to completion; panics if it outlives its timeout (after killing it).
    fn output(self) -> Finished {
        let line = self.line();
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .env("PATH", child_path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (key, value) in &self.envs {
            command.env(key, value);
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run `{line}`: {e}"));
        let stdout = child.stdout.take().map(drain);
        let stderr = child.stderr.take().map(drain);
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) => {}
                Err(e) => panic!("waiting for `{line}`: {e}"),
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("`{line}` ran longer than {:?} and was killed", self.timeout);
            }
            thread::sleep(Duration::from_millis(5));
        };
        let collect = |reader: Option<thread::JoinHandle<Vec<u8>>>| {
            reader
                .and_then(|r| r.join().ok())
                .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
                .unwrap_or_default()
        };
        Finished {
            line,
            status,
            stdout: collect(stdout),
            stderr: collect(stderr),
        }
    }

    /// Runs and asserts exit status 0.
    fn success(self) -> Finished {
        let finished = self.output();
        assert!(finished.status.success(), "{}", finished.describe());
        finished
    }

    /// Runs and asserts a non-zero exit: for negative controls.
    fn failure(self, why: &str) -> Finished {
        let finished = self.output();
        assert!(
            !finished.status.success(),
            "negative control passed but must fail ({why}): {}",
            finished.describe()
        );
        finished
    }
}

fn drain<R: Read + Send + 'static>(mut reader: R) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = reader.read_to_end(&mut bytes);
        bytes
    })
}

/// A background process (server or nbdfuse), stopped with SIGTERM then SIGKILL on drop.
struct Daemon {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    fn spawn(name: &str, program: &Path, args: &[OsString], log: PathBuf) -> Daemon {
        let out = File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let err = out
            .try_clone()
            .unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let child = Command::new(program)
            .args(args)
            .env("PATH", child_path())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({}): {e}", program.display()));
        Daemon {
            name: name.to_string(),
            child: Some(child),
            log,
        }
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn is_running(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(Ok(Some(_)) | Err(_)) | None => false,
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        format!("--- {} log\n{}", self.name, tail(&text, 3000))
    }

    /// Waits up to `timeout` for the process to exit by itself.
    fn wait_exit(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !self.is_running() {
                return true;
            }
            thread::sleep(Duration::from_millis(10));
        }
        !self.is_running()
    }

    /// SIGTERM (a graceful stop: reflexd drains and flushes), then SIGKILL after
    /// [`STOP_TIMEOUT`]. Never panics: it runs in `Drop`.
    fn stop(&mut self) {
        let Some(pid) = self.pid() else { return };
        if self.is_running() {
            let _ = Command::new(tool_path_quiet("kill"))
                .args(["-TERM", &pid.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if !self.wait_exit(STOP_TIMEOUT) {
                eprintln!("{} (pid {pid}) ignored SIGTERM; killing it", self.name);
            }
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Like [`tool`] but never panics (for `Drop`): falls back to the bare name.
fn tool_path_quiet(name: &str) -> PathBuf {
    SYSTEM_DIRS
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap_or_else(|e| panic!("cannot bind a probe socket: {e}"));
    listener
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .port()
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
}

// ---------------------------------------------------------------------------------------------
// Servers under test

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServerKind {
    /// `reflexd` from this workspace.
    Reflexd,
    /// nbdkit's `memory` and `file` plugins, with the export name and block sizes reflexd uses.
    Nbdkit,
    /// qemu-nbd, raw format; `cache=none` and io_uring for file exports.
    QemuNbd,
    /// `nbdkit null`: discards writes, reads zeroes. Only for negative controls.
    NbdkitNull,
    /// `nbdkit memory` whose extents call the whole disk a hole (extentlist filter, empty
    /// list): a client that trusts extents reads zeroes. Only for negative controls.
    NbdkitHoles,
    /// nbdkit whose extents call everything data (noextents filter): no holes to map. Only for
    /// negative controls.
    NbdkitNoExtents,
    /// nbdkit enforcing what reflexd advertised before it served unaligned and large
    /// requests (512 / 4096 / 1 MiB, refusing anything else with EINVAL, even for clients
    /// that did not agree to it). Only for negative controls.
    NbdkitStrict,
}

fn server_under_test() -> ServerKind {
    match std::env::var("REFLEX_NBD_SERVER").as_deref() {
        Err(_) | Ok("") => DEFAULT_SERVER_UNDER_TEST,
        Ok("reflexd") => ServerKind::Reflexd,
        Ok("nbdkit") => ServerKind::Nbdkit,
        Ok("qemu-nbd") => ServerKind::QemuNbd,
        Ok(other) => panic!("REFLEX_NBD_SERVER={other:?}: expected reflexd, nbdkit or qemu-nbd"),
    }
}

/// What a server should report and answer; where servers legitimately differ.
#[derive(Debug, Clone, Copy)]
struct Expect {
    block_size_minimum: u64,
    block_size_preferred: u64,
    block_size_maximum: u64,
    can_multi_conn: bool,
    /// Whether SEND_FUA is advertised on read-only exports too.
    can_fua_read_only: bool,
    /// errno name for WRITE/WRITE_ZEROES/TRIM on a read-only export.
    errno_read_only: &'static str,
    /// errno name for a WRITE that crosses the end of the export.
    errno_write_past_end: &'static str,
    /// Whether a FAST_ZERO that needs writes (NO_HOLE, unaligned edges) must fail with
    /// ENOTSUP; servers that can zero such ranges quickly may succeed instead.
    fast_zero_writes_refused: bool,
}

impl ServerKind {
    fn expect(self) -> Expect {
        match self {
            // docs/NBD.md: 1/4096/32 MiB (the spec's defaults: unaligned requests by
            // read-modify-write, large ones in parts), CAN_MULTI_CONN always, EPERM then
            // ENOSPC. nbdkit is configured to match, but drops SEND_FUA on read-only exports.
            ServerKind::NbdkitStrict => Expect {
                block_size_minimum: 512,
                block_size_preferred: 4096,
                block_size_maximum: 1 << 20,
                can_multi_conn: true,
                can_fua_read_only: false,
                errno_read_only: "EPERM",
                errno_write_past_end: "ENOSPC",
                fast_zero_writes_refused: self == ServerKind::Reflexd,
            },
            ServerKind::Reflexd
            | ServerKind::Nbdkit
            | ServerKind::NbdkitNull
            | ServerKind::NbdkitHoles
            | ServerKind::NbdkitNoExtents => Expect {
                block_size_minimum: 1,
                block_size_preferred: 4096,
                block_size_maximum: 32 << 20,
                can_multi_conn: true,
                can_fua_read_only: self == ServerKind::Reflexd,
                errno_read_only: "EPERM",
                errno_write_past_end: "ENOSPC",
                fast_zero_writes_refused: self == ServerKind::Reflexd,
            },
            // Observed with qemu-nbd 7.2: it answers EINVAL where the spec suggests EPERM and
            // ENOSPC; with --shared > 1 it advertises multi-conn.
            ServerKind::QemuNbd => Expect {
                block_size_minimum: 1,
                block_size_preferred: 4096,
                block_size_maximum: 32 << 20,
                can_multi_conn: true,
                can_fua_read_only: true,
                errno_read_only: "EINVAL",
                errno_write_past_end: "EINVAL",
                fast_zero_writes_refused: false,
            },
        }
    }
}

#[derive(Debug, Clone)]
enum Backing {
    Memory,
    /// A regular file that outlives the server (created sparse if missing).
    File(PathBuf),
}

#[derive(Debug, Clone)]
struct ExportSpec {
    name: String,
    size_bytes: u64,
    backing: Backing,
    read_only: bool,
}

fn export(name: &str, backing: Backing, read_only: bool) -> ExportSpec {
    ExportSpec {
        name: name.to_string(),
        size_bytes: EXPORT_SIZE_BYTES,
        backing,
        read_only,
    }
}

/// One or more exports served on loopback; the processes stop when this is dropped.
struct NbdServer {
    kind: ServerKind,
    exports: Vec<ExportSpec>,
    ports: Vec<u16>,
    daemons: Vec<Daemon>,
    dir: PathBuf,
    starts: usize,
}

impl NbdServer {
    /// Starts `kind` serving `exports`; logs and memory-export files go to `dir`.
    fn launch(kind: ServerKind, exports: Vec<ExportSpec>, dir: &Path) -> NbdServer {
        assert!(!exports.is_empty());
        let mut server = NbdServer {
            kind,
            exports,
            ports: Vec::new(),
            daemons: Vec::new(),
            dir: dir.to_path_buf(),
            starts: 0,
        };
        server.start();
        server
    }

    fn start(&mut self) {
        assert!(self.daemons.is_empty());
        self.ports.clear();
        for spec in &self.exports {
            if let Backing::File(path) = &spec.backing {
                ensure_file(path, spec.size_bytes);
            }
        }
        match self.kind {
            ServerKind::Reflexd => {
                let (daemon, port) = self.start_one(&self.exports.clone());
                self.daemons.push(daemon);
                self.ports
                    .extend(std::iter::repeat_n(port, self.exports.len()));
            }
            _ => {
                for spec in self.exports.clone() {
                    let (daemon, port) = self.start_one(std::slice::from_ref(&spec));
                    self.daemons.push(daemon);
                    self.ports.push(port);
                }
            }
        }
    }

    /// Stops every process, then starts them again on the same exports (new ports).
    fn restart(&mut self) {
        self.stop();
        self.start();
    }

    fn stop(&mut self) {
        for daemon in &mut self.daemons {
            daemon.stop();
        }
        self.daemons.clear();
    }

    fn start_one(&mut self, exports: &[ExportSpec]) -> (Daemon, u16) {
        let mut failures = Vec::new();
        for _ in 0..LAUNCH_ATTEMPTS {
            self.starts += 1;
            let port = free_port();
            let log = self.dir.join(format!("server-{}.log", self.starts));
            let (name, program, args) = self.command(exports, port);
            let mut daemon = Daemon::spawn(&name, &program, &args, log);
            match wait_listening(&mut daemon, port) {
                Ok(()) => return (daemon, port),
                Err(why) => failures.push(format!("{why}\n{}", daemon.log_tail())),
            }
        }
        panic!(
            "{:?} did not start in {LAUNCH_ATTEMPTS} attempts:\n{}",
            self.kind,
            failures.join("\n")
        );
    }

    fn command(&self, exports: &[ExportSpec], port: u16) -> (String, PathBuf, Vec<OsString>) {
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |arg: &dyn AsRef<OsStr>| args.push(arg.as_ref().to_os_string());
        match self.kind {
            ServerKind::Reflexd => {
                // Every export is a namespace of one reflexd, exported under its name; only
                // the NBD listener is of interest here.
                for arg in [
                    "--listen",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--no-original",
                    "--no-nvme-tcp",
                    "--no-admin",
                    "--nbd-port",
                    &port.to_string(),
                    "--threads",
                    "2",
                    "--arena-size",
                    "8M",
                ] {
                    push(&arg);
                }
                for (index, spec) in exports.iter().enumerate() {
                    let mut namespace = OsString::from(format!("{}=", index + 1));
                    match &spec.backing {
                        Backing::Memory => namespace.push(format!("mem:{}", spec.size_bytes)),
                        Backing::File(path) => {
                            namespace.push("file:");
                            namespace.push(path);
                        }
                    }
                    namespace.push(format!(",size={},name={}", spec.size_bytes, spec.name));
                    if spec.read_only {
                        namespace.push(",ro");
                    }
                    push(&"--namespace");
                    push(&namespace);
                }
                // Through the test runner when there is one (a cross-compiled run), on the
                // driver REFLEX_DRIVER names.
                let (program, mut command_args) =
                    common::workspace_binary(Path::new(env!("CARGO_BIN_EXE_reflexd")));
                command_args.extend(common::driver_args().into_iter().map(OsString::from));
                command_args.extend(args);
                ("reflexd".into(), program, command_args)
            }
            ServerKind::Nbdkit
            | ServerKind::NbdkitNull
            | ServerKind::NbdkitHoles
            | ServerKind::NbdkitNoExtents
            | ServerKind::NbdkitStrict => {
                let [spec] = exports else {
                    panic!("one export per nbdkit")
                };
                for arg in [
                    "--foreground",
                    "--exit-with-parent",
                    "--ipaddr",
                    "127.0.0.1",
                    "--port",
                    &port.to_string(),
                    "--filter=exportname",
                    "--filter=blocksize-policy",
                ] {
                    push(&arg);
                }
                if spec.read_only {
                    push(&"--readonly");
                }
                // Filter parameters go after the plugin name, with the plugin's.
                let mut filter_parameters = Vec::new();
                if self.kind == ServerKind::NbdkitHoles {
                    let list = self.dir.join("no-extents.txt");
                    write_file(&list, b"");
                    let mut parameter = OsString::from("extentlist=");
                    parameter.push(&list);
                    push(&"--filter=extentlist");
                    filter_parameters.push(parameter);
                }
                if self.kind == ServerKind::NbdkitNoExtents {
                    push(&"--filter=noextents");
                }
                if self.kind == ServerKind::NbdkitStrict {
                    filter_parameters.push(OsString::from("blocksize-error-policy=error"));
                }
                match (&spec.backing, self.kind) {
                    (_, ServerKind::NbdkitNull) => {
                        push(&"null");
                        push(&format!("size={}", spec.size_bytes));
                    }
                    (Backing::Memory, _) => {
                        push(&"memory");
                        push(&format!("size={}", spec.size_bytes));
                    }
                    (Backing::File(path), _) => {
                        push(&"file");
                        let mut file = OsString::from("file=");
                        file.push(path);
                        push(&file);
                    }
                }
                for parameter in &filter_parameters {
                    push(parameter);
                }
                let expect = self.kind.expect();
                push(&format!("exportname={}", spec.name));
                push(&"exportname-strict=true");
                push(&"exportname-list=explicit");
                push(&format!("blocksize-minimum={}", expect.block_size_minimum));
                push(&format!(
                    "blocksize-preferred={}",
                    expect.block_size_preferred
                ));
                push(&format!("blocksize-maximum={}", expect.block_size_maximum));
                ("nbdkit".into(), tool("nbdkit"), args)
            }
            ServerKind::QemuNbd => {
                let [spec] = exports else {
                    panic!("one export per qemu-nbd")
                };
                for arg in [
                    "--format=raw",
                    "--persistent",
                    "--shared=8",
                    "--bind=127.0.0.1",
                    &format!("--port={port}"),
                    &format!("--export-name={}", spec.name),
                ] {
                    push(&arg);
                }
                if spec.read_only {
                    push(&"--read-only");
                }
                let path = match &spec.backing {
                    Backing::Memory => {
                        // qemu-nbd has no memory backend: a page-cached file stands in.
                        let path = self.dir.join(format!("{}.mem.img", spec.name));
                        ensure_file(&path, spec.size_bytes);
                        path
                    }
                    Backing::File(path) => {
                        push(&"--cache=none");
                        push(&"--aio=io_uring");
                        path.clone()
                    }
                };
                push(&path);
                ("qemu-nbd".into(), tool("qemu-nbd"), args)
            }
        }
    }

    fn port(&self, index: usize) -> u16 {
        self.ports[index]
    }

    fn uri(&self, index: usize) -> String {
        format!(
            "nbd://127.0.0.1:{}/{}",
            self.ports[index], self.exports[index].name
        )
    }

    fn logs(&self) -> String {
        self.daemons
            .iter()
            .map(Daemon::log_tail)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Creates `path` as a sparse file of `size_bytes` if it does not exist.
fn ensure_file(path: &Path, size_bytes: u64) {
    if path.exists() {
        return;
    }
    let file = File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    file.set_len(size_bytes)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Waits until `port` accepts connections, or fails if the process exits first.
fn wait_listening(daemon: &mut Daemon, port: u16) -> Result<(), String> {
    let deadline = Instant::now() + READY_TIMEOUT;
    while Instant::now() < deadline {
        if !daemon.is_running() {
            return Err(format!("{} exited before listening on {port}", daemon.name));
        }
        if TcpStream::connect_timeout(&loopback(port), Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(20));
    }
    Err(format!(
        "{} did not listen on {port} within {READY_TIMEOUT:?}",
        daemon.name
    ))
}

// ---------------------------------------------------------------------------------------------
// Data

/// Deterministic pseudo-random bytes (xorshift64*), different per seed.
fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        bytes.extend_from_slice(&state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn read_file(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn write_file(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"))
}

fn json(text: &str, what: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{what} is not JSON ({e}):\n{text}"))
}

// ---------------------------------------------------------------------------------------------
// Checks

#[test]
fn every_tool_is_installed() {
    for (name, _) in TOOLS {
        tool(name);
    }
    cmd("nbdsh")
        .args(["-n", "-c", "import nbd; print(nbd.NBD().get_version())"])
        .success();
    let engines = cmd("fio").arg("--enghelp=nbd").success();
    assert!(engines.stdout.contains("uri"), "fio lacks the nbd engine");
    // Legacy path: FUSE and loop devices.
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing");
    cmd("losetup").arg("--find").success();
}

/// Reads `nbdinfo --json` for one export.
fn nbdinfo(uri: &str) -> serde_json::Value {
    let finished = cmd("nbdinfo").args(["--json", uri]).success();
    let value = json(&finished.stdout, "nbdinfo --json");
    let exports = value["exports"]
        .as_array()
        .unwrap_or_else(|| panic!("no exports in {value}"));
    assert_eq!(exports.len(), 1, "{value}");
    exports[0].clone()
}

#[test]
fn nbdinfo_reports_size_flags_and_block_sizes() {
    let kind = server_under_test();
    let expect = kind.expect();
    let dir = tempdir();
    let server = NbdServer::launch(
        kind,
        vec![
            export("disk", Backing::Memory, false),
            export("frozen", Backing::Memory, true),
        ],
        dir.path(),
    );
    for (index, read_only) in [(0, false), (1, true)] {
        let info = nbdinfo(&server.uri(index));
        let context = format!("{}: {info:#}\n{}", server.uri(index), server.logs());
        assert_eq!(info["export-size"], EXPORT_SIZE_BYTES, "{context}");
        assert_eq!(info["is_read_only"], read_only, "{context}");
        assert_eq!(info["can_multi_conn"], expect.can_multi_conn, "{context}");
        assert_eq!(info["can_flush"], true, "{context}");
        let fua = !read_only || expect.can_fua_read_only;
        assert_eq!(info["can_fua"], fua, "{context}");
        if !read_only {
            assert_eq!(info["can_trim"], true, "{context}");
            assert_eq!(info["can_zero"], true, "{context}");
        }
        assert_eq!(
            info["block_size_minimum"], expect.block_size_minimum,
            "{context}"
        );
        assert_eq!(
            info["block_size_preferred"], expect.block_size_preferred,
            "{context}"
        );
        assert_eq!(
            info["block_size_maximum"], expect.block_size_maximum,
            "{context}"
        );
    }
    // LIST names the export.
    let listed = cmd("nbdinfo")
        .args([
            "--list",
            "--json",
            &format!("nbd://127.0.0.1:{}", server.port(0)),
        ])
        .success();
    let listed = json(&listed.stdout, "nbdinfo --list --json");
    let names: Vec<&str> = listed["exports"]
        .as_array()
        .unwrap_or_else(|| panic!("{listed}"))
        .iter()
        .filter_map(|e| e["export-name"].as_str())
        .collect();
    assert!(names.contains(&"disk"), "LIST gave {names:?}");
    // Negative control: a name the server does not export must be refused, so the checks
    // above really looked at the export they named.
    cmd("nbdinfo")
        .arg(format!("nbd://127.0.0.1:{}/no-such-export", server.port(0)))
        .failure("an unknown export name");
}

/// Copies `input` into the export and back out; returns what came back. `extents: false`
/// (`--no-extents`) makes nbdcopy read every byte instead of skipping what the server calls
/// holes.
fn nbdcopy_round_trip(uri: &str, input: &Path, output: &Path, extents: bool) -> Vec<u8> {
    cmd("nbdcopy")
        .args([OsStr::new("--no-extents"), OsStr::new("--flush")])
        .arg(input)
        .arg(uri)
        .success();
    let _ = std::fs::remove_file(output);
    cmd("nbdcopy")
        .args(if extents { None } else { Some("--no-extents") })
        .arg(uri)
        .arg(output)
        .success();
    read_file(output)
}

fn qemu_img_compare(file: &Path, uri: &str) -> Run {
    cmd("qemu-img")
        .args(["compare", "-s", "-f", "raw", "-F", "raw"])
        .arg(file)
        .arg(uri)
}

#[test]
fn nbdcopy_round_trip_and_qemu_img_compare() {
    let dir = tempdir();
    let input = dir.path().join("input.bin");
    let output = dir.path().join("output.bin");
    let data = random_bytes(1, EXPORT_SIZE_BYTES as usize);
    write_file(&input, &data);
    let server = NbdServer::launch(
        server_under_test(),
        vec![export("disk", Backing::Memory, false)],
        dir.path(),
    );
    let uri = server.uri(0);
    let back = nbdcopy_round_trip(&uri, &input, &output, false);
    assert_eq!(
        first_difference(&back, &data),
        None,
        "nbdcopy read back other bytes\n{}",
        server.logs()
    );
    qemu_img_compare(&input, &uri).success();

    // Negative controls: one changed byte, and a server that discards writes.
    let mut changed = data.clone();
    changed[5 << 20] ^= 0x01;
    let changed_path = dir.path().join("changed.bin");
    write_file(&changed_path, &changed);
    qemu_img_compare(&changed_path, &uri).failure("one byte differs");
    drop(server);
    let null = NbdServer::launch(
        ServerKind::NbdkitNull,
        vec![export("disk", Backing::Memory, false)],
        dir.path(),
    );
    let back = nbdcopy_round_trip(&null.uri(0), &input, &output, false);
    assert!(
        first_difference(&back, &data).is_some(),
        "negative control: data read back from nbdkit null matched"
    );
    qemu_img_compare(&input, &null.uri(0)).failure("nbdkit null discards writes");
    drop(null);

    // The trap `--no-extents` avoids: against a server whose extents say "hole" everywhere,
    // nbdcopy trusting extents copies zeroes; reading every byte gets the data.
    let holes = NbdServer::launch(
        ServerKind::NbdkitHoles,
        vec![export("disk", Backing::Memory, false)],
        dir.path(),
    );
    let trusted = nbdcopy_round_trip(&holes.uri(0), &input, &output, true);
    assert!(
        first_difference(&trusted, &data).is_some(),
        "negative control: nbdcopy trusting extents read the data anyway"
    );
    let read_all = nbdcopy_round_trip(&holes.uri(0), &input, &output, false);
    assert_eq!(
        first_difference(&read_all, &data),
        None,
        "--no-extents missed data"
    );
}

/// Runs one check of `nbd/edge_cases.py` through nbdsh.
fn edge_case(check: &str, uri: &str, spec: &ExportSpec, expect: Expect, strict: bool) -> Run {
    cmd("nbdsh")
        .args(["-n", "-c", EDGE_CASES_SCRIPT])
        .env("NBD_CHECK", check)
        .env("NBD_URI", uri)
        .env("NBD_EXPORT", &spec.name)
        .env("NBD_SIZE", spec.size_bytes.to_string())
        .env("NBD_ERRNO_READ_ONLY", expect.errno_read_only)
        .env("NBD_ERRNO_WRITE_PAST_END", expect.errno_write_past_end)
        .env("NBD_STRICT", if strict { "1" } else { "0" })
}

#[test]
fn nbdsh_edge_cases_reach_the_server() {
    let kind = server_under_test();
    let expect = kind.expect();
    let dir = tempdir();
    let server = NbdServer::launch(
        kind,
        vec![
            export("disk", Backing::Memory, false),
            export("frozen", Backing::Memory, true),
        ],
        dir.path(),
    );
    let (rw, ro) = (&server.exports[0], &server.exports[1]);
    for (check, index, spec) in [
        ("read_past_end", 0, rw),
        ("write_read_only", 1, ro),
        ("opt_mode", 0, rw),
    ] {
        let finished = edge_case(check, &server.uri(index), spec, expect, false).output();
        assert!(
            finished.status.success()
                && finished.stdout.contains(&format!("EDGE-CASES-OK {check}")),
            "{}\n{}",
            finished.describe(),
            server.logs()
        );
    }

    // Negative controls. With strict mode on, libnbd refuses the requests itself: the script
    // must notice the errors did not come from the server.
    for (check, index, spec) in [("read_past_end", 0, rw), ("write_read_only", 1, ro)] {
        let finished = edge_case(check, &server.uri(index), spec, expect, true)
            .failure("libnbd strict mode answers instead of the server");
        assert!(
            finished.stderr.contains("came from libnbd"),
            "{}",
            finished.describe()
        );
    }
    // A writable export accepts the write the read-only check expects to be refused.
    let finished = edge_case("write_read_only", &server.uri(0), rw, expect, false)
        .failure("the export is writable");
    assert!(
        finished.stderr.contains("READ_ONLY"),
        "{}",
        finished.describe()
    );
    // Expecting the wrong errno must fail (the errno is really compared).
    let wrong = Expect {
        errno_write_past_end: "EIO",
        ..expect
    };
    edge_case("read_past_end", &server.uri(0), rw, wrong, false).failure("EIO is not the answer");
}

// --- Raw option negotiation (spec constants written out independently of reflex_proto) ---

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
const FLAG_NO_ZEROES: u16 = 1 << 1;
const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
const CLIENT_NO_ZEROES: u32 = 1 << 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_INFO: u32 = 6;
const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
const INFO_EXPORT: u16 = 0;
/// Option numbers no specification assigns.
const UNKNOWN_OPTIONS: [u32; 2] = [0x4242, 0x7fff_0001];
/// Largest option reply the raw client accepts.
const OPTION_REPLY_MAX_BYTES: u32 = 64 << 10;

struct OptionReply {
    option: u32,
    kind: u32,
    data: Vec<u8>,
}

struct RawNegotiation {
    stream: TcpStream,
}

impl RawNegotiation {
    fn connect(port: u16) -> Result<RawNegotiation, String> {
        let stream = TcpStream::connect_timeout(&loopback(port), Duration::from_secs(5))
            .map_err(|e| format!("connect: {e}"))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        let mut raw = RawNegotiation { stream };
        let greeting = raw.read_exact(18)?;
        let magic = u64::from_be_bytes(array(&greeting[0..8]));
        let ihaveopt = u64::from_be_bytes(array(&greeting[8..16]));
        let flags = u16::from_be_bytes(array(&greeting[16..18]));
        if magic != NBDMAGIC || ihaveopt != IHAVEOPT {
            return Err(format!("not a newstyle greeting: {greeting:02x?}"));
        }
        if flags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(format!("server is not fixed newstyle (flags {flags:#x})"));
        }
        let mut client = CLIENT_FIXED_NEWSTYLE;
        if flags & FLAG_NO_ZEROES != 0 {
            client |= CLIENT_NO_ZEROES;
        }
        raw.write(&client.to_be_bytes())?;
        Ok(raw)
    }

    fn read_exact(&mut self, len: usize) -> Result<Vec<u8>, String> {
        let mut bytes = vec![0u8; len];
        self.stream
            .read_exact(&mut bytes)
            .map_err(|e| format!("reading {len} bytes: {e}"))?;
        Ok(bytes)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.stream
            .write_all(bytes)
            .map_err(|e| format!("sending: {e}"))
    }

    fn send_option(&mut self, option: u32, data: &[u8]) -> Result<(), String> {
        let mut bytes = Vec::with_capacity(16 + data.len());
        bytes.extend_from_slice(&IHAVEOPT.to_be_bytes());
        bytes.extend_from_slice(&option.to_be_bytes());
        let len = u32::try_from(data.len()).map_err(|e| e.to_string())?;
        bytes.extend_from_slice(&len.to_be_bytes());
        bytes.extend_from_slice(data);
        self.write(&bytes)
    }

    fn reply(&mut self) -> Result<OptionReply, String> {
        let header = self.read_exact(20)?;
        let magic = u64::from_be_bytes(array(&header[0..8]));
        if magic != OPTION_REPLY_MAGIC {
            return Err(format!("bad option reply magic {magic:#x}"));
        }
        let option = u32::from_be_bytes(array(&header[8..12]));
        let kind = u32::from_be_bytes(array(&header[12..16]));
        let len = u32::from_be_bytes(array(&header[16..20]));
        if len > OPTION_REPLY_MAX_BYTES {
            return Err(format!("option reply of {len} bytes"));
        }
        let data = self.read_exact(len as usize)?;
        Ok(OptionReply { option, kind, data })
    }

    /// Sends `option` and reads replies up to and including the final one (an ACK or an
    /// error); `REP_SERVER`/`REP_INFO` replies before it are returned too.
    fn call(&mut self, option: u32, data: &[u8]) -> Result<Vec<OptionReply>, String> {
        self.send_option(option, data)?;
        let mut replies = Vec::new();
        loop {
            let reply = self.reply()?;
            if reply.option != option {
                return Err(format!(
                    "reply to option {} while {option} was asked",
                    reply.option
                ));
            }
            let last = reply.kind == REP_ACK || reply.kind & (1 << 31) != 0;
            replies.push(reply);
            if last {
                return Ok(replies);
            }
            if replies.len() > 1024 {
                return Err("more than 1024 replies to one option".into());
            }
        }
    }
}

fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[..N]);
    out
}

fn info_request(name: &str) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    data
}

/// Unknown options get ERR_UNSUP and the negotiation goes on: LIST, INFO (also for an unknown
/// export), then ABORT all still work on the same connection.
fn check_unknown_options(port: u16, export: &str, size_bytes: u64) -> Result<(), String> {
    let mut raw = RawNegotiation::connect(port)?;
    for (round, option) in UNKNOWN_OPTIONS.into_iter().enumerate() {
        let replies = raw.call(option, &b"reflex-unknown-option"[..round * 7])?;
        let [reply] = replies.as_slice() else {
            return Err(format!(
                "{} replies to unknown option {option:#x}",
                replies.len()
            ));
        };
        if reply.kind != REP_ERR_UNSUP {
            return Err(format!(
                "unknown option {option:#x} answered {:#x}, want ERR_UNSUP",
                reply.kind
            ));
        }
    }
    let listed = raw.call(OPT_LIST, &[])?;
    let names: Vec<String> = listed
        .iter()
        .filter(|r| r.kind == REP_SERVER && r.data.len() >= 4)
        .map(|r| {
            let len = u32::from_be_bytes(array(&r.data[0..4])) as usize;
            String::from_utf8_lossy(r.data.get(4..4 + len).unwrap_or_default()).into_owned()
        })
        .collect();
    if listed.last().map(|r| r.kind) != Some(REP_ACK) || !names.iter().any(|n| n == export) {
        return Err(format!("LIST after unknown options gave {names:?}"));
    }
    let unknown = raw.call(OPT_INFO, &info_request("no-such-export"))?;
    if unknown.last().map(|r| r.kind) != Some(REP_ERR_UNKNOWN) {
        return Err("INFO on an unknown export did not end in ERR_UNKNOWN".into());
    }
    let info = raw.call(OPT_INFO, &info_request(export))?;
    let export_info = info
        .iter()
        .find(|r| {
            r.kind == REP_INFO && r.data.len() == 12 && r.data[0..2] == INFO_EXPORT.to_be_bytes()
        })
        .ok_or("INFO gave no INFO_EXPORT")?;
    let size = u64::from_be_bytes(array(&export_info.data[2..10]));
    if size != size_bytes || info.last().map(|r| r.kind) != Some(REP_ACK) {
        return Err(format!(
            "INFO gave size {size}, want {size_bytes}, then no ACK"
        ));
    }
    raw.send_option(OPT_ABORT, &[])?;
    // The spec has the server ACK an ABORT, but a client must accept a plain close too.
    match raw.reply() {
        Ok(reply) if reply.kind == REP_ACK => Ok(()),
        Ok(reply) => Err(format!("ABORT answered {:#x}", reply.kind)),
        Err(_) => Ok(()),
    }
}

/// How a fake server misbehaves, for the negative controls of [`check_unknown_options`].
#[derive(Debug, Clone, Copy)]
enum Fake {
    /// Closes the connection on the first option.
    CloseOnUnknown,
    /// Answers the first option with ERR_UNSUP, then closes.
    CloseAfterOneError,
    /// Answers every option with ACK.
    AckEverything,
}

fn fake_server(fake: Fake) -> (u16, thread::JoinHandle<()>) {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap_or_else(|e| panic!("bind: {e}"));
    let port = listener
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .port();
    let handle = thread::spawn(move || {
        let Ok((mut stream, _)) = listener.accept() else {
            return;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let mut greeting = Vec::new();
        greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
        greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
        greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        if stream.write_all(&greeting).is_err() {
            return;
        }
        let mut flags = [0u8; 4];
        if stream.read_exact(&mut flags).is_err() {
            return;
        }
        for round in 0..16u32 {
            let mut header = [0u8; 16];
            if stream.read_exact(&mut header).is_err() {
                return;
            }
            let option = u32::from_be_bytes(array(&header[8..12]));
            let len = u32::from_be_bytes(array(&header[12..16]));
            let mut data = vec![0u8; len.min(OPTION_REPLY_MAX_BYTES) as usize];
            if stream.read_exact(&mut data).is_err() {
                return;
            }
            let kind = match (fake, round) {
                (Fake::CloseOnUnknown, _) | (Fake::CloseAfterOneError, 1..) => return,
                (Fake::CloseAfterOneError, 0) => REP_ERR_UNSUP,
                (Fake::AckEverything, _) => REP_ACK,
            };
            let mut reply = Vec::new();
            reply.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
            reply.extend_from_slice(&option.to_be_bytes());
            reply.extend_from_slice(&kind.to_be_bytes());
            reply.extend_from_slice(&0u32.to_be_bytes());
            if stream.write_all(&reply).is_err() {
                return;
            }
        }
    });
    (port, handle)
}

#[test]
fn unknown_options_get_err_unsup_and_negotiation_continues() {
    let dir = tempdir();
    let server = NbdServer::launch(
        server_under_test(),
        vec![export("disk", Backing::Memory, false)],
        dir.path(),
    );
    if let Err(why) = check_unknown_options(server.port(0), "disk", EXPORT_SIZE_BYTES) {
        panic!("{why}\n{}", server.logs());
    }
    // The transmission phase still works after such a negotiation.
    cmd("nbdinfo").arg(server.uri(0)).success();

    for fake in [
        Fake::CloseOnUnknown,
        Fake::CloseAfterOneError,
        Fake::AckEverything,
    ] {
        let (port, handle) = fake_server(fake);
        let result = check_unknown_options(port, "disk", EXPORT_SIZE_BYTES);
        assert!(result.is_err(), "negative control {fake:?} passed");
        drop(result);
        handle
            .join()
            .unwrap_or_else(|_| panic!("fake server {fake:?} panicked"));
    }
}

/// A fio job on the nbd engine; its JSON report goes to `report`.
fn fio(uri: &str, rw: &str, report: &Path, verify_size_bytes: u64) -> Run {
    let mut report_arg = OsString::from("--output=");
    report_arg.push(report);
    cmd("fio")
        .args([
            format!("--name={rw}"),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            format!("--rw={rw}"),
            "--bs=4k".into(),
            format!("--size={verify_size_bytes}"),
            "--iodepth=8".into(),
            "--verify=crc32c".into(),
            "--output-format=json".into(),
        ])
        .args(if rw == "randwrite" {
            &["--do_verify=0"][..]
        } else {
            &[][..]
        })
        .arg(report_arg)
}

/// `(error, bytes read, bytes written)` of the single job in a fio JSON report.
fn fio_result(report: &Path) -> (i64, u64, u64) {
    let text =
        std::fs::read_to_string(report).unwrap_or_else(|e| panic!("{}: {e}", report.display()));
    let value = json(&text, "fio --output-format=json");
    let job = &value["jobs"][0];
    let number = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("{v} in {job}"));
    (
        job["error"].as_i64().unwrap_or_else(|| panic!("{job}")),
        number(&job["read"]["io_bytes"]),
        number(&job["write"]["io_bytes"]),
    )
}

#[test]
fn fio_crc32c_verify_passes_and_catches_a_damaged_block() {
    const VERIFY_BYTES: u64 = 16 << 20;
    const DAMAGED_OFFSET_BYTES: u64 = 3 << 20;
    let dir = tempdir();
    let report = dir.path().join("fio.json");
    let server = NbdServer::launch(
        server_under_test(),
        vec![export("disk", Backing::Memory, false)],
        dir.path(),
    );
    let uri = server.uri(0);
    fio(&uri, "randwrite", &report, VERIFY_BYTES).success();
    assert_eq!(fio_result(&report), (0, 0, VERIFY_BYTES), "the write job");
    // A separate read job verifies every block (a verify_only run of the write job would
    // read nothing and pass).
    let verified = fio(&uri, "read", &report, VERIFY_BYTES).output();
    assert!(
        verified.status.success(),
        "{}\n{}",
        verified.describe(),
        server.logs()
    );
    assert_eq!(fio_result(&report), (0, VERIFY_BYTES, 0), "the verify job");

    // The check can fail: zero one block with qemu-io and the verify job must fail on it.
    let pattern_check = |pattern: &str| {
        cmd("qemu-io")
            .args(["-f", "raw", &uri, "-c"])
            .arg(format!("read -P {pattern} {DAMAGED_OFFSET_BYTES} 4k"))
    };
    pattern_check("0").failure("the block holds fio's data, not zeroes");
    cmd("qemu-io")
        .args(["-f", "raw", &uri, "-c"])
        .arg(format!("write -P 0 {DAMAGED_OFFSET_BYTES} 4k"))
        .success();
    pattern_check("0").success();
    let damaged = fio(&uri, "read", &report, VERIFY_BYTES).failure("one block was zeroed");
    assert!(
        damaged.stderr.contains("verify") || damaged.stdout.contains("verify"),
        "{}",
        damaged.describe()
    );
    let (error, _, _) = fio_result(&report);
    assert_ne!(error, 0, "fio reported no error for the damaged block");
    drop(server);

    // And against a server that discards writes.
    let null = NbdServer::launch(
        ServerKind::NbdkitNull,
        vec![export("disk", Backing::Memory, false)],
        dir.path(),
    );
    fio(&null.uri(0), "randwrite", &report, VERIFY_BYTES).success();
    fio(&null.uri(0), "read", &report, VERIFY_BYTES).failure("nbdkit null discards writes");
}

// ---------------------------------------------------------------------------------------------
// The legacy path: nbdfuse → loop device → ext4

/// An NBD export exposed as a file by nbdfuse; unmounted on drop.
struct FuseFile {
    daemon: Daemon,
    mountpoint: PathBuf,
    file: PathBuf,
    mounted: bool,
}

impl FuseFile {
    fn start(uri: &str, mountpoint: &Path, size_bytes: u64, log: PathBuf) -> FuseFile {
        std::fs::create_dir_all(mountpoint).unwrap_or_else(|e| panic!("{e}"));
        let pidfile = log.with_extension("pid");
        let _ = std::fs::remove_file(&pidfile);
        let file = mountpoint.join("disk");
        let mut target = mountpoint.as_os_str().to_os_string();
        target.push("/disk");
        let args = vec![
            OsString::from("-P"),
            pidfile.clone().into(),
            target,
            uri.into(),
        ];
        let mut fuse = FuseFile {
            daemon: Daemon::spawn("nbdfuse", &tool("nbdfuse"), &args, log),
            mountpoint: mountpoint.to_path_buf(),
            file,
            mounted: true,
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if pidfile.exists() {
                let size = std::fs::metadata(&fuse.file).map(|m| m.len());
                assert_eq!(size.ok(), Some(size_bytes), "nbdfuse file size");
                return fuse;
            }
            if !fuse.daemon.is_running() {
                fuse.mounted = false;
                panic!("nbdfuse exited\n{}", fuse.daemon.log_tail());
            }
            assert!(
                Instant::now() < deadline,
                "nbdfuse not ready\n{}",
                fuse.daemon.log_tail()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// `fusermount3 -u`, then nbdfuse exits by itself. The kernel sends the RELEASE of a file
    /// just closed asynchronously, so the mount may be busy for a moment: a few retries.
    fn unmount(mut self) {
        let unmount = || cmd("fusermount3").arg("-u").arg(&self.mountpoint).output();
        let mut finished = unmount();
        for _ in 0..40 {
            if finished.status.success() {
                break;
            }
            thread::sleep(Duration::from_millis(50));
            finished = unmount();
        }
        assert!(finished.status.success(), "{}", finished.describe());
        self.mounted = false;
        assert!(
            self.daemon.wait_exit(STOP_TIMEOUT),
            "nbdfuse did not exit after fusermount3 -u"
        );
    }
}

impl Drop for FuseFile {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new(tool_path_quiet("fusermount3"))
                .arg("-u")
                .arg(&self.mountpoint)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if !self.daemon.wait_exit(STOP_TIMEOUT) {
                let _ = Command::new(tool_path_quiet("fusermount3"))
                    .args(["-u", "-z"])
                    .arg(&self.mountpoint)
                    .status();
            }
        }
    }
}

/// A loop device over a file; detached on drop.
struct LoopDevice {
    device: String,
    attached: bool,
}

impl LoopDevice {
    fn attach(file: &Path) -> LoopDevice {
        let finished = cmd("losetup")
            .args(["--find", "--show"])
            .arg(file)
            .success();
        let device = finished.stdout.trim().to_string();
        assert!(
            device.starts_with("/dev/loop"),
            "losetup printed {device:?}"
        );
        LoopDevice {
            device,
            attached: true,
        }
    }

    fn detach(mut self) {
        cmd("losetup").args(["-d", &self.device]).success();
        self.attached = false;
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        if self.attached {
            let _ = Command::new(tool_path_quiet("losetup"))
                .args(["-d", &self.device])
                .status();
        }
    }
}

/// A mounted filesystem; unmounted (lazily if busy) on drop.
struct Mount {
    target: PathBuf,
    mounted: bool,
}

impl Mount {
    fn ext4(device: &str, target: &Path, read_only: bool) -> Mount {
        std::fs::create_dir_all(target).unwrap_or_else(|e| panic!("{e}"));
        cmd("mount")
            .args([
                "-t",
                "ext4",
                "-o",
                if read_only { "ro" } else { "rw" },
                device,
            ])
            .arg(target)
            .success();
        Mount {
            target: target.to_path_buf(),
            mounted: true,
        }
    }

    fn unmount(mut self) {
        cmd("umount").arg(&self.target).success();
        self.mounted = false;
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.mounted {
            let status = Command::new(tool_path_quiet("umount"))
                .arg(&self.target)
                .status();
            if !status.is_ok_and(|s| s.success()) {
                let _ = Command::new(tool_path_quiet("umount"))
                    .arg("-l")
                    .arg(&self.target)
                    .status();
            }
        }
    }
}

fn drop_caches() {
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .unwrap_or_else(|e| panic!("drop caches (needs root): {e}"));
}

/// Files the legacy test writes: name → content.
fn legacy_files() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = (0..16u64)
        .map(|i| {
            (
                format!("dir{}/file{i}.bin", i % 4),
                random_bytes(100 + i, 256 << 10),
            )
        })
        .collect();
    files.push(("big.bin".into(), random_bytes(99, 8 << 20)));
    files.push((
        "small.txt".into(),
        b"written through nbdfuse and a loop device\n".to_vec(),
    ));
    files
}

#[test]
fn legacy_ext4_over_nbdfuse_survives_a_server_restart() {
    let dir = tempdir();
    let backing = dir.path().join("export.img");
    let fuse_dir = dir.path().join("fuse");
    let mount_dir = dir.path().join("mnt");
    let mut server = NbdServer::launch(
        server_under_test(),
        vec![export("disk", Backing::File(backing.clone()), false)],
        dir.path(),
    );
    let files = legacy_files();

    // Make a filesystem and write files through nbdfuse and a loop device.
    {
        let fuse = FuseFile::start(
            &server.uri(0),
            &fuse_dir,
            EXPORT_SIZE_BYTES,
            dir.path().join("fuse1.log"),
        );
        let device = LoopDevice::attach(&fuse.file);
        cmd("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-E",
                "lazy_itable_init=0,lazy_journal_init=0",
                &device.device,
            ])
            .success();
        let mount = Mount::ext4(&device.device, &mount_dir, false);
        for (name, content) in &files {
            let path = mount.target.join(name);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{e}"));
            }
            let mut file =
                File::create(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            file.write_all(content).unwrap_or_else(|e| panic!("{e}"));
            file.sync_all().unwrap_or_else(|e| panic!("{e}"));
        }
        mount.unmount();
        device.detach();
        fuse.unmount();
    }
    // Nothing of it may survive in a cache: the data must come from the server.
    drop_caches();
    server.restart();

    {
        let fuse = FuseFile::start(
            &server.uri(0),
            &fuse_dir,
            EXPORT_SIZE_BYTES,
            dir.path().join("fuse2.log"),
        );
        let device = LoopDevice::attach(&fuse.file);
        cmd("e2fsck").args(["-f", "-n", &device.device]).success();
        let mount = Mount::ext4(&device.device, &mount_dir, true);
        for (name, content) in &files {
            let back = read_file(&mount.target.join(name));
            assert_eq!(
                first_difference(&back, content),
                None,
                "{name} differs after the restart\n{}",
                server.logs()
            );
        }
        mount.unmount();
        device.detach();
        fuse.unmount();
    }

    // Negative control: the same steps against a server restarted on an empty file find no
    // filesystem, so the mount above really read the server's data.
    drop(server);
    let empty = NbdServer::launch(
        server_under_test(),
        vec![export(
            "disk",
            Backing::File(dir.path().join("empty.img")),
            false,
        )],
        dir.path(),
    );
    let fuse = FuseFile::start(
        &empty.uri(0),
        &fuse_dir,
        EXPORT_SIZE_BYTES,
        dir.path().join("fuse3.log"),
    );
    let device = LoopDevice::attach(&fuse.file);
    let finished = cmd("mount")
        .args(["-t", "ext4", "-o", "ro", &device.device])
        .arg(&mount_dir)
        .output();
    if finished.status.success() {
        let _unmount = Mount {
            target: mount_dir.clone(),
            mounted: true,
        };
        panic!("negative control: an empty export mounted as ext4");
    }
    device.detach();
    fuse.unmount();
}

// ---------------------------------------------------------------------------------------------
// Large and unaligned requests, CACHE, FAST_ZERO, block status (issue 9)

/// Runs one check of `nbd/completeness.py` through nbdsh (libnbd without negotiated block
/// sizes).
fn completeness(check: &str, uri: &str, expect: Expect) -> Run {
    let fast_zero_writes = if expect.fast_zero_writes_refused {
        "refused"
    } else {
        "any"
    };
    cmd("nbdsh")
        .args(["-n", "-c", COMPLETENESS_SCRIPT])
        .env("NBD_CHECK", check)
        .env("NBD_URI", uri)
        .env("NBD_FAST_ZERO_WRITES", fast_zero_writes)
}

const COMPLETENESS_CHECKS: [&str; 3] = ["large", "unaligned", "cache_fast_zero"];

#[test]
fn libnbd_without_negotiated_block_sizes_gets_32_mib_any_byte_cache_and_fast_zero() {
    let dir = tempdir();
    let kind = server_under_test();
    let server = NbdServer::launch(
        kind,
        vec![
            export("memory", Backing::Memory, false),
            export("file", Backing::File(dir.path().join("file.img")), false),
        ],
        dir.path(),
    );
    for index in 0..2 {
        for check in COMPLETENESS_CHECKS {
            let finished = completeness(check, &server.uri(index), kind.expect()).output();
            assert!(
                finished.status.success()
                    && finished
                        .stdout
                        .contains(&format!("COMPLETENESS-OK {check}")),
                "{}\n{}",
                finished.describe(),
                server.logs()
            );
        }
    }
    drop(server);
    // Negative controls: a server that discards writes fails the data checks (and zeroes
    // "fast" where reflexd must refuse); one that enforces 512-byte alignment and 1 MiB on
    // every client, as reflexd did before, refuses the requests themselves.
    for kind in [ServerKind::NbdkitNull, ServerKind::NbdkitStrict] {
        let control = NbdServer::launch(
            kind,
            vec![export("memory", Backing::Memory, false)],
            dir.path(),
        );
        for check in COMPLETENESS_CHECKS {
            if kind == ServerKind::NbdkitStrict && check == "cache_fast_zero" {
                continue; // Its requests are aligned; only null makes it fail.
            }
            completeness(check, &control.uri(0), kind.expect())
                .failure(&format!("{kind:?} for {check}"));
        }
    }
}

/// One extent of a map: offset, length, and whether it holds data.
type MapExtent = (u64, u64, bool);

/// Merges neighbouring extents of the same kind (tools may split where the server did not).
fn merged(extents: impl IntoIterator<Item = MapExtent>) -> Vec<MapExtent> {
    let mut out: Vec<MapExtent> = Vec::new();
    for (offset, length, data) in extents {
        match out.last_mut() {
            Some(last) if last.2 == data && last.0 + last.1 == offset => last.1 += length,
            _ => out.push((offset, length, data)),
        }
    }
    out
}

/// `nbdinfo --map`: `base:allocation` as the server reports it (type bit 0: hole).
fn nbdinfo_map(uri: &str) -> Vec<MapExtent> {
    let finished = cmd("nbdinfo").args(["--map", "--json", uri]).success();
    let value = json(&finished.stdout, "nbdinfo --map --json");
    let entries = value
        .as_array()
        .unwrap_or_else(|| panic!("nbdinfo --map: not a list: {value}"));
    merged(entries.iter().map(|entry| {
        let field = |name: &str| {
            entry[name]
                .as_u64()
                .unwrap_or_else(|| panic!("nbdinfo --map: no {name} in {entry}"))
        };
        (field("offset"), field("length"), field("type") & 1 == 0)
    }))
}

/// `qemu-img map`: how qemu's NBD client sees the allocation.
fn qemu_img_map(uri: &str) -> Vec<MapExtent> {
    let finished = cmd("qemu-img")
        .args(["map", "--output=json", "-f", "raw", uri])
        .success();
    let value = json(&finished.stdout, "qemu-img map");
    let entries = value
        .as_array()
        .unwrap_or_else(|| panic!("qemu-img map: not a list: {value}"));
    merged(entries.iter().map(|entry| {
        let start = entry["start"].as_u64().unwrap_or_else(|| panic!("{entry}"));
        let length = entry["length"]
            .as_u64()
            .unwrap_or_else(|| panic!("{entry}"));
        let data = entry["data"].as_bool().unwrap_or_else(|| panic!("{entry}"));
        (start, length, data)
    }))
}

#[test]
fn nbdinfo_map_and_qemu_img_map_show_the_holes_of_a_sparse_file() {
    use std::os::unix::fs::FileExt;
    const MIB: u64 = 1 << 20;
    let dir = tempdir();
    let path = dir.path().join("sparse.img");
    {
        let file = File::create(&path).unwrap_or_else(|e| panic!("{e}"));
        file.set_len(EXPORT_SIZE_BYTES)
            .unwrap_or_else(|e| panic!("{e}"));
        file.write_all_at(&random_bytes(80, 64 << 10), MIB)
            .unwrap_or_else(|e| panic!("{e}"));
        file.write_all_at(&random_bytes(81, 4096), 8 * MIB)
            .unwrap_or_else(|e| panic!("{e}"));
        file.sync_all().unwrap_or_else(|e| panic!("{e}"));
    }
    let expected = vec![
        (0, MIB, false),
        (MIB, 64 << 10, true),
        (MIB + (64 << 10), 7 * MIB - (64 << 10), false),
        (8 * MIB, 4096, true),
        (8 * MIB + 4096, EXPORT_SIZE_BYTES - 8 * MIB - 4096, false),
    ];
    let server = NbdServer::launch(
        server_under_test(),
        vec![export("sparse", Backing::File(path.clone()), false)],
        dir.path(),
    );
    let uri = server.uri(0);
    assert_eq!(
        nbdinfo_map(&uri),
        expected,
        "nbdinfo --map\n{}",
        server.logs()
    );
    assert_eq!(
        qemu_img_map(&uri),
        expected,
        "qemu-img map\n{}",
        server.logs()
    );
    // The data is intact, and a copy that trusts the extents gets every byte.
    let output = dir.path().join("copy.img");
    cmd("nbdcopy").arg(&uri).arg(&output).success();
    assert_eq!(
        first_difference(&read_file(&output), &read_file(&path)),
        None,
        "nbdcopy with extents"
    );
    drop(server);
    // Negative control: the same file through a server that reports no holes.
    let control = NbdServer::launch(
        ServerKind::NbdkitNoExtents,
        vec![export("sparse", Backing::File(path), false)],
        dir.path(),
    );
    let all_data = vec![(0, EXPORT_SIZE_BYTES, true)];
    assert_eq!(nbdinfo_map(&control.uri(0)), all_data);
    assert_eq!(qemu_img_map(&control.uri(0)), all_data);
}

/// Writes through nbdfuse with buffered I/O (a plain file opened without O_DIRECT, so FUSE
/// passes each write's odd offset and length on) into the first `REGION` bytes of a fresh
/// export; returns what the region should hold, or the first write's error.
fn buffered_unaligned_writes(fuse: &FuseFile) -> Result<Vec<u8>, std::io::Error> {
    use std::os::unix::fs::FileExt;
    const REGION: usize = 1 << 20;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&fuse.file)?;
    let mut model = vec![0u8; REGION];
    let mut state = 0x0dd0_ff5e_u64;
    let mut next = |bound: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % bound
    };
    for round in 0..300u64 {
        let length = 1 + next(if round % 10 == 0 { 20_000 } else { 1500 }) as usize;
        let offset = (next((REGION - length) as u64) | 1) as usize;
        let data = random_bytes(1000 + round, length);
        file.write_all_at(&data, offset as u64)?;
        model[offset..offset + length].copy_from_slice(&data);
    }
    file.sync_all()?;
    Ok(model)
}

#[test]
fn buffered_unaligned_writes_through_nbdfuse_read_back_exactly() {
    let dir = tempdir();
    let fuse_dir = dir.path().join("fuse");
    let check = |kind: ServerKind, name: &str| -> Result<(), String> {
        let backing = dir.path().join(format!("{name}.img"));
        let mut server = NbdServer::launch(
            kind,
            vec![export("disk", Backing::File(backing), false)],
            dir.path(),
        );
        let fuse = FuseFile::start(
            &server.uri(0),
            &fuse_dir,
            EXPORT_SIZE_BYTES,
            dir.path().join(format!("{name}-1.log")),
        );
        let written = buffered_unaligned_writes(&fuse);
        fuse.unmount();
        let model = written.map_err(|e| format!("{kind:?}: a buffered write failed: {e}"))?;
        // Nothing may come from a cache: new mount, new connection, dropped caches, and the
        // server restarted.
        drop_caches();
        server.restart();
        let fuse = FuseFile::start(
            &server.uri(0),
            &fuse_dir,
            EXPORT_SIZE_BYTES,
            dir.path().join(format!("{name}-2.log")),
        );
        let mut back = vec![0u8; model.len()];
        let read = File::open(&fuse.file).and_then(|mut file| file.read_exact(&mut back));
        fuse.unmount();
        read.map_err(|e| format!("{kind:?}: reading back: {e}"))?;
        match first_difference(&back, &model) {
            None => Ok(()),
            Some(at) => Err(format!("{kind:?}: byte {at} differs after the remount")),
        }
    };
    check(server_under_test(), "served").unwrap_or_else(|e| panic!("{e}"));
    // Negative controls: writes that are discarded do not read back; a server that refuses
    // unaligned requests makes the very first buffered write fail (libnbd honours its
    // advertised 512-byte minimum), so the writes above really were unaligned.
    let null = check(ServerKind::NbdkitNull, "null");
    assert!(
        null.is_err(),
        "negative control: nbdkit null read back the writes"
    );
    let strict = check(ServerKind::NbdkitStrict, "strict");
    assert!(
        strict.as_ref().is_err_and(|e| e.contains("write failed")),
        "negative control: a 512-byte server took unaligned writes: {strict:?}"
    );
}
