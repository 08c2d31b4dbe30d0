//! Choosing the I/O driver, as an operator sees it: `reflexd` with io_uring switched off
//! (the test switch `REFLEX_TEST_NO_IO_URING`, so this runs on machines that have io_uring)
//! falls back to epoll under `driver = "auto"` with one warning naming the reason, and
//! refuses to start under `driver = "uring"` with an error that says what to do. These
//! tests pick the driver themselves (`REFLEX_DRIVER` does not apply).

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reflex_client::Client;
use reflex_server::NO_IO_URING_ENV;

/// How long `reflexd` may take to refuse or to start (qemu-user is slow).
const START_MAX: Duration = Duration::from_secs(60);

/// `reflexd` on a small memory namespace, free ports, io_uring switched off.
fn reflexd_without_io_uring(extra: &[&str]) -> Command {
    let mut command = common::reflexd_command();
    command
        .args(["--port", "0", "--no-original", "--no-nbd", "--threads", "2"])
        .args(["--arena-size", "4M", "--namespace", "1=mem:16M"])
        .args(extra)
        .env(NO_IO_URING_ENV, "1")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}

/// Waits (bounded) for `child` to exit; returns its status and its standard error.
fn finish(mut child: Child) -> (std::process::ExitStatus, String) {
    let stderr = child.stderr.take().map(|mut pipe| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
            text
        })
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap_or_else(|e| panic!("{e}")) {
            break status;
        }
        if started.elapsed() > START_MAX {
            let _ = child.kill();
            let _ = child.wait();
            panic!("reflexd did not exit within {START_MAX:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = stderr
        .and_then(|reader| reader.join().ok())
        .unwrap_or_default();
    (status, text)
}

fn assert_refused_clearly(status: std::process::ExitStatus, stderr: &str) {
    assert!(!status.success(), "reflexd started; stderr:\n{stderr}");
    let expected = format!(
        "driver = \"uring\" was asked for, but io_uring is unavailable: switched off by the \
         test switch {NO_IO_URING_ENV}"
    );
    assert!(stderr.contains(&expected), "stderr:\n{stderr}");
    assert!(
        stderr.contains("driver = \"auto\" or \"epoll\" runs on epoll instead"),
        "the error says what to do instead; stderr:\n{stderr}"
    );
    assert!(!stderr.contains("reflexd serving"), "stderr:\n{stderr}");
}

#[test]
fn forcing_uring_without_io_uring_is_a_clear_start_up_error() {
    let child = reflexd_without_io_uring(&["--driver", "uring"])
        .spawn()
        .unwrap_or_else(|e| panic!("spawn reflexd: {e}"));
    let (status, stderr) = finish(child);
    assert_refused_clearly(status, &stderr);
}

#[test]
fn forcing_uring_in_the_config_file_is_refused_the_same_way() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("reflexd.toml");
    std::fs::write(&path, "driver = \"uring\"\n").unwrap_or_else(|e| panic!("{e}"));
    let config = path.display().to_string();
    let child = reflexd_without_io_uring(&["--config", &config])
        .spawn()
        .unwrap_or_else(|e| panic!("spawn reflexd: {e}"));
    let (status, stderr) = finish(child);
    assert_refused_clearly(status, &stderr);
}

#[test]
fn auto_falls_back_to_epoll_with_one_warning_and_serves() {
    for extra in [&[][..], &["--driver", "auto"][..]] {
        let mut child = reflexd_without_io_uring(extra)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn reflexd: {e}"));
        let Some(stderr) = child.stderr.take() else {
            panic!("no stderr");
        };
        let mut lines = BufReader::new(stderr).lines();
        let mut log = Vec::new();
        let addr: SocketAddr = loop {
            let Some(Ok(line)) = lines.next() else {
                let _ = child.kill();
                panic!("reflexd exited before serving:\n{}", log.join("\n"));
            };
            log.push(line.clone());
            if line.contains("reflexd serving") {
                assert!(line.contains("driver=\"epoll\""), "{line}");
                let text = line
                    .split("native=")
                    .nth(1)
                    .and_then(|rest| rest.split_whitespace().next())
                    .unwrap_or_default();
                break text
                    .parse()
                    .unwrap_or_else(|e| panic!("address {text:?}: {e}"));
            }
        };
        let warnings: Vec<&String> = log
            .iter()
            .filter(|line| line.contains("io_uring is unavailable"))
            .collect();
        assert_eq!(warnings.len(), 1, "one line says why:\n{}", log.join("\n"));
        assert!(warnings[0].contains("WARN"), "{}", warnings[0]);
        assert!(
            warnings[0].contains("using the epoll driver instead of io_uring")
                && warnings[0].contains(&format!(
                    "reason=io_uring is unavailable: switched off by the test switch \
                     {NO_IO_URING_ENV}"
                )),
            "{}",
            warnings[0]
        );
        // Keep draining the log so the child never blocks on a full pipe.
        let drain = std::thread::spawn(move || lines.count());

        let mut client = Client::connect(addr).unwrap_or_else(|e| panic!("{e}"));
        let data = common::pattern(11, 64 << 10);
        client
            .write(1, 4096, &data)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut back = vec![0u8; data.len()];
        client
            .read(1, 4096, &mut back)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(back == data);
        drop(client);

        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap_or_else(|e| panic!("kill: {e}"));
        assert!(status.success());
        let (status, _) = finish(child);
        assert!(status.success(), "reflexd exited with {status}");
        let _ = drain.join();
    }
}
