//! The `reflexd` child process of the crash test: start it on fixed ports with one file
//! namespace, wait for its "reflexd serving" line, SIGKILL it, or stop it with SIGTERM.
//!
//! Why fixed ports, picked once: a restart on the same ports right after a SIGKILL is the case
//! operators meet (the killed process's listeners linger while the kernel tears down its
//! io_uring; reflexd retries a port in use for 5 s). The harness still never trusts timing: it
//! waits for the serving line with a bounded timeout, and a start that fails (the process exits
//! first) is retried on fresh ports a bounded number of times. Everything reflexd logs is
//! appended to one log file in the work directory, each start headed by a marker line.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Longest wait for the "reflexd serving" line (it binds with retries for 5 s).
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a process to exit after SIGKILL or SIGTERM (SIGTERM drains for ≤ 10 s).
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(30);
/// Starts tried (on fresh ports after the first failure) before giving up.
pub const START_ATTEMPTS_MAX: u32 = 3;
const SERVING_MARKER: &str = "reflexd serving";
/// reflexd's warning while it retries a port the killed process still holds.
const PORT_IN_USE_MARKER: &str = "address in use";

/// The three ports reflexd serves on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    pub native: u16,
    pub original: u16,
    pub nbd: u16,
}

impl Ports {
    /// Three distinct free loopback ports: bound together (so the kernel gives three different
    /// ones), then released for reflexd.
    pub fn pick() -> Result<Ports> {
        let bind = || TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("picking a free port");
        let listeners = [bind()?, bind()?, bind()?];
        let port = |index: usize| -> Result<u16> { Ok(listeners[index].local_addr()?.port()) };
        Ok(Ports {
            native: port(0)?,
            original: port(1)?,
            nbd: port(2)?,
        })
    }

    pub fn address(port: u16) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, port))
    }
}

/// How to run reflexd.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub reflexd: PathBuf,
    pub backing_file: PathBuf,
    pub size_bytes: u64,
    pub threads: usize,
    pub log_path: PathBuf,
}

/// A running reflexd.
pub struct Daemon {
    child: Child,
    pub ports: Ports,
    /// It logged that a port was still in use and waited for it before serving.
    pub waited_for_port: bool,
    /// Ends when reflexd's stderr closes.
    log_thread: Option<std::thread::JoinHandle<()>>,
}

enum LogEvent {
    PortInUse,
    Serving(String),
    Closed,
}

impl Daemon {
    /// Starts reflexd on `ports` (or fresh ones after a failed start) and waits until it
    /// serves. `label` heads its lines in the log file.
    pub fn start(config: &DaemonConfig, ports: Ports, label: &str) -> Result<Daemon> {
        let mut ports = ports;
        let mut attempt = 1;
        loop {
            match Daemon::start_once(config, ports, label) {
                Ok(daemon) => return Ok(daemon),
                Err(error) if attempt < START_ATTEMPTS_MAX => {
                    tracing::warn!(attempt, ports = ?ports, "reflexd did not start: {error:#}; retrying on fresh ports");
                    ports = Ports::pick()?;
                    attempt += 1;
                }
                Err(error) => {
                    return Err(error).with_context(|| {
                        format!(
                            "reflexd did not start in {START_ATTEMPTS_MAX} attempts (log: {})",
                            config.log_path.display()
                        )
                    });
                }
            }
        }
    }

    fn start_once(config: &DaemonConfig, ports: Ports, label: &str) -> Result<Daemon> {
        let mut log = File::options()
            .create(true)
            .append(true)
            .open(&config.log_path)
            .with_context(|| format!("opening {}", config.log_path.display()))?;
        writeln!(log, "===== {label}: reflexd on ports {ports:?} =====")?;
        let namespace = format!(
            "1=file:{},size={}",
            config.backing_file.display(),
            config.size_bytes
        );
        let mut child = Command::new(&config.reflexd)
            .args(["--listen", "127.0.0.1"])
            .args(["--port", &ports.native.to_string()])
            .args(["--original-port", &format!("{}=1", ports.original)])
            .args(["--nbd-port", &ports.nbd.to_string()])
            .arg("--no-nvme-tcp")
            .args(["--threads", &config.threads.to_string()])
            .args(["--namespace", &namespace])
            .arg("--no-admin")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", config.reflexd.display()))?;
        let stderr = child.stderr.take().context("reflexd's stderr")?;
        let (events, serving) = mpsc::channel();
        let log_thread = std::thread::spawn(move || copy_log(stderr, log, &events));
        let mut daemon = Daemon {
            child,
            ports,
            waited_for_port: false,
            log_thread: Some(log_thread),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match serving.recv_timeout(remaining) {
                Ok(LogEvent::PortInUse) => daemon.waited_for_port = true,
                Ok(LogEvent::Serving(line)) => {
                    let expected = format!("native={}", Ports::address(ports.native));
                    if !line.contains(&expected) {
                        daemon.kill()?;
                        bail!("reflexd serves elsewhere than asked ({expected}): {line}");
                    }
                    return Ok(daemon);
                }
                Ok(LogEvent::Closed) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = daemon.wait_exit()?;
                    bail!("reflexd exited before serving ({status})");
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    daemon.kill()?;
                    bail!("reflexd did not log {SERVING_MARKER:?} within {START_TIMEOUT:?}");
                }
            }
        }
    }

    /// SIGKILL and wait for the exit; fails unless SIGKILL is what ended it (a reflexd that
    /// had already exited on its own crashed, which the caller must hear about).
    pub fn kill(mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("reflexd had already exited on its own ({status})");
        }
        self.child.kill().context("SIGKILL reflexd")?;
        let status = self.wait_exit()?;
        if status.signal() != Some(libc::SIGKILL) {
            bail!("reflexd ended with {status}, not by the SIGKILL");
        }
        Ok(())
    }

    /// SIGTERM (the clean shutdown: drain, flush, exit 0) and wait.
    pub fn terminate(mut self) -> Result<ExitStatus> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .context("running kill -TERM")?;
        if !status.success() {
            bail!("kill -TERM {} failed ({status})", self.child.id());
        }
        self.wait_exit()
    }

    /// Waits at most [`EXIT_TIMEOUT`] for the process to exit (SIGKILL after that), then for
    /// its log to be copied.
    fn wait_exit(&mut self) -> Result<ExitStatus> {
        let deadline = Instant::now() + EXIT_TIMEOUT;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() >= deadline {
                self.child.kill()?;
                let status = self.child.wait()?;
                bail!("reflexd did not exit within {EXIT_TIMEOUT:?} ({status} after SIGKILL)");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        if let Some(thread) = self.log_thread.take() {
            // The pipe is closed with the process, so the copy ends.
            let _ = thread.join();
        }
        Ok(status)
    }
}

impl Drop for Daemon {
    /// A daemon dropped on an error path is killed, never left running.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Copies reflexd's stderr into the log file and reports the serving line and the end.
fn copy_log(stderr: impl std::io::Read, mut log: File, events: &mpsc::Sender<LogEvent>) {
    for line in BufReader::new(stderr).lines() {
        let Ok(line) = line else { break };
        let _ = writeln!(log, "{line}");
        if line.contains(SERVING_MARKER) {
            let _ = events.send(LogEvent::Serving(line));
        } else if line.contains(PORT_IN_USE_MARKER) {
            let _ = events.send(LogEvent::PortInUse);
        }
    }
    let _ = events.send(LogEvent::Closed);
}

/// The reflexd next to the running executable (where cargo puts both).
pub fn default_reflexd() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the current executable")?;
    Ok(exe.with_file_name("reflexd"))
}

/// Creates `path` as an empty sparse file of `size_bytes` (all zeroes), replacing any file.
pub fn create_backing_file(path: &Path, size_bytes: u64) -> Result<()> {
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    file.set_len(size_bytes)
        .with_context(|| format!("sizing {}", path.display()))?;
    file.sync_all()?;
    Ok(())
}
