//! Wireshark's NVMe/TCP dissector as an independent judge of what reflexd puts on the wire:
//! `tshark` captures loopback traffic of the client's initiator against a real reflexd
//! (digests off and on; in-capsule writes, R2T/H2CData writes, C2HData reads, admin
//! commands), then decodes it with header and data digest checking on. The test asserts that
//! no PDU is malformed, that every digest present is marked good, and, as a negative
//! control, that the one PDU the test corrupts on purpose is marked bad, so the check can
//! fail. tshark comes from Debian (`scripts/test.sh` installs it); a missing tshark fails
//! the test.

mod common;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{config, namespace, start};
use reflex_client::nvme_tcp::{NvmeTcpController, NvmeTcpOptions, NvmeTcpQueue};
use reflex_proto::nvme_tcp::Command as NvmeCommand;
use reflex_proto::nvme_tcp::command::io_opcode;
use reflex_proto::nvme_tcp::pdu::{self, Digests, Framing, Pdu};
use reflex_server::NvmeSubsystemConfig;

const NQN: &str = "nqn.2026-01.io.reflex:tshark";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:tshark-host";
/// Longest wait for tshark to start capturing.
const CAPTURE_START_TIMEOUT: Duration = Duration::from_secs(60);
/// tshark stops by itself after this long, whatever happens to the test.
const CAPTURE_DURATION_MAX_SECONDS: u32 = 300;

fn tshark() -> &'static str {
    let path = "/usr/bin/tshark";
    assert!(
        Path::new(path).exists(),
        "tshark is missing: `apt-get install tshark` (scripts/test.sh installs it)"
    );
    path
}

/// A running capture: tshark writing `port` and a probe port to a file, and printing the
/// ports of every packet it captured, so the test knows when the capture is live and when it
/// has seen everything.
struct Capture {
    child: Child,
    /// The ports of captured packets, one line each.
    lines: mpsc::Receiver<String>,
    probe: TcpListener,
}

impl Capture {
    /// Starts tshark and returns once it captured a probe connection.
    fn start(port: u16, file: &Path) -> Capture {
        let probe = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let probe_port = probe.local_addr().unwrap_or_else(|e| panic!("{e}")).port();
        let mut child = Command::new(tshark())
            .args(["-i", "lo", "-B", "64", "-q", "-P", "-l"])
            .args(["-T", "fields", "-e", "tcp.srcport", "-e", "tcp.dstport"])
            .args(["-f", &format!("tcp port {port} or tcp port {probe_port}")])
            .args(["-a", &format!("duration:{CAPTURE_DURATION_MAX_SECONDS}")])
            .arg("-w")
            .arg(file)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting tshark: {e}"));
        let Some(stdout) = child.stdout.take() else {
            panic!("tshark without stdout");
        };
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            // Drained to the end: a closed pipe would end tshark at its next packet.
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = sender.send(line);
            }
        });
        let mut capture = Capture {
            child,
            lines,
            probe,
        };
        if !capture.probe_seen(CAPTURE_START_TIMEOUT) {
            let _ = capture.child.kill();
            panic!("tshark did not start capturing within {CAPTURE_START_TIMEOUT:?}");
        }
        capture
    }

    /// Connects to the probe port until tshark reports a packet of that connection (its own
    /// client port: everything sent before it is then captured too).
    fn probe_seen(&mut self, timeout: Duration) -> bool {
        let Ok(probe_address) = self.probe.local_addr() else {
            return false;
        };
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let Ok(connection) = TcpStream::connect(probe_address) else {
                continue;
            };
            let _accepted = self.probe.accept();
            let Ok(client) = connection.local_addr() else {
                continue;
            };
            let client_port = client.port().to_string();
            let wait_until = Instant::now() + Duration::from_millis(500);
            while let Ok(line) = self
                .lines
                .recv_timeout(wait_until.saturating_duration_since(Instant::now()))
            {
                if line.split('\t').any(|field| field == client_port) {
                    return true;
                }
            }
        }
        false
    }

    /// Waits until tshark has seen everything so far, then stops it.
    fn stop(mut self) {
        assert!(
            self.probe_seen(CAPTURE_START_TIMEOUT),
            "tshark stopped capturing"
        );
        let status = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status()
            .unwrap_or_else(|e| panic!("kill: {e}"));
        assert!(status.success());
        let status = self.child.wait().unwrap_or_else(|e| panic!("tshark: {e}"));
        assert!(
            status.success() || status.code().is_none(),
            "tshark: {status}"
        );
    }
}

/// Rows of `fields` of the PDUs matching `filter` in the capture.
fn decode(file: &Path, port: u16, filter: &str, fields: &[&str]) -> Vec<Vec<String>> {
    let mut command = Command::new(tshark());
    command
        .arg("-r")
        .arg(file)
        .args(["-d", &format!("tcp.port=={port},nvme-tcp")])
        .args(["-o", "nvme-tcp.check_hdgst:TRUE"])
        .args(["-o", "nvme-tcp.check_ddgst:TRUE"])
        .args(["-Y", filter, "-T", "fields", "-E", "separator=/t"]);
    for field in fields {
        command.args(["-e", field]);
    }
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("tshark -r: {e}"));
    assert!(
        output.status.success(),
        "tshark -r: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| line.split('\t').map(str::to_string).collect())
        .collect()
}

/// The traffic: a controller with `digests`, two I/O queues, writes of 4 KiB (in the
/// capsule), 64 KiB and 256 KiB (R2T) and their reads, flush, write zeroes, deallocate.
fn traffic(address: SocketAddr, digests: Digests) {
    let options = NvmeTcpOptions::new(HOST, NQN).with_digests(digests);
    let mut controller =
        NvmeTcpController::attach(address, options, 2).unwrap_or_else(|e| panic!("attach: {e}"));
    let _ = controller
        .active_namespaces()
        .unwrap_or_else(|e| panic!("{e}"));
    let info = controller.namespace(1).unwrap_or_else(|e| panic!("{e}"));
    let mut queue = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    let block_bytes = info.block_bytes;
    let mut slba = 0u64;
    for length in [4096usize, 64 << 10, 256 << 10] {
        let data: Vec<u8> = (0..length).map(|i| (i as u64 + slba) as u8).collect();
        queue
            .write(1, slba, &data, block_bytes, false)
            .unwrap_or_else(|e| panic!("write: {e}"));
        let read = queue
            .read(1, slba, (length / block_bytes as usize) as u32, block_bytes)
            .unwrap_or_else(|e| panic!("read: {e}"));
        assert!(read == data);
        slba += (length / block_bytes as usize) as u64;
    }
    queue.flush(1).unwrap_or_else(|e| panic!("{e}"));
    queue
        .write_zeroes(1, 0, 8)
        .unwrap_or_else(|e| panic!("{e}"));
    queue
        .deallocate(1, &[(0, 8)])
        .unwrap_or_else(|e| panic!("{e}"));
    controller.keep_alive().unwrap_or_else(|e| panic!("{e}"));
    controller.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn tshark_finds_no_malformed_pdu_and_every_digest_good() {
    let mut server_config = config(vec![namespace(1, "mem:16M", None)]);
    server_config.nvme_tcp.subsystems = vec![NvmeSubsystemConfig {
        nqn: NQN.to_string(),
        namespaces: Vec::new(),
        allow_any_host: true,
        hosts: Vec::new(),
        secure_channel: false,
    }];
    let server = start(server_config);
    let address = server
        .nvme_tcp_addr()
        .unwrap_or_else(|| panic!("NVMe/TCP is off"));
    let port = address.port();
    let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let file = directory.path().join("nvme-tcp.pcap");
    let capture = Capture::start(port, &file);

    traffic(address, Digests::NONE);
    traffic(address, Digests::BOTH);
    // The negative control: one capsule with a corrupted header digest (reflexd answers it
    // with a C2HTermReq; tshark must mark its digest bad).
    let mut queue = NvmeTcpQueue::open(address, Digests::BOTH, Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("{e}"));
    let command = NvmeCommand::io(io_opcode::READ, 1, 1, 0, 1, false);
    let framing = Framing::new(Digests::BOTH, 0).unwrap_or(Framing::PLAIN);
    let mut bytes = framing.capsule_cmd(&command.0, 0).as_bytes().to_vec();
    bytes[pdu::CAPSULE_CMD_HLEN] ^= 0xFF;
    queue.send_raw(&bytes).unwrap_or_else(|e| panic!("{e}"));
    let answer = queue.receive_pdu().unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(answer.pdu, Pdu::C2hTermReq(_)), "{:?}", answer.pdu);
    assert!(queue.closed_within(Duration::from_secs(20)));
    drop(queue);
    capture.stop();
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));

    let malformed = decode(&file, port, "_ws.malformed", &["frame.number"]);
    assert!(malformed.is_empty(), "malformed frames: {malformed:?}");

    // Every kind of PDU the traffic has was decoded: ICReq 0, ICResp 1, CapsuleCmd 4,
    // CapsuleResp 5, H2CData 6, C2HData 7, R2T 9, C2HTermReq 3.
    let types = decode(&file, port, "nvme-tcp", &["nvme-tcp.type"]);
    let mut seen = std::collections::BTreeSet::new();
    for row in &types {
        for value in row.iter().flat_map(|cell| cell.split(',')) {
            if let Ok(pdu_type) = value.trim().parse::<u8>() {
                seen.insert(pdu_type);
            }
        }
    }
    for pdu_type in [0u8, 1, 3, 4, 5, 6, 7, 9] {
        assert!(
            seen.contains(&pdu_type),
            "no PDU of type {pdu_type}: {seen:?}"
        );
    }

    // Digest statuses: 1 good, 0 bad (Wireshark's checksum status). Exactly one bad header
    // digest (the control); every data digest good; and there are many of each.
    let header = statuses(&file, port, "nvme-tcp.hdgst.status");
    let data = statuses(&file, port, "nvme-tcp.ddgst.status");
    assert_eq!(
        header.get(&0),
        Some(&1),
        "header digest statuses {header:?}"
    );
    assert!(header.get(&1).is_some_and(|&good| good > 20), "{header:?}");
    assert!(
        header.keys().all(|&status| status <= 1),
        "unverified header digests: {header:?}"
    );
    assert_eq!(data.get(&0), None, "bad data digests: {data:?}");
    assert!(data.get(&1).is_some_and(|&good| good > 5), "{data:?}");
    assert!(
        data.keys().all(|&status| status == 1),
        "unverified data digests: {data:?}"
    );
}

/// How many PDUs have each value of a digest status field.
fn statuses(file: &Path, port: u16, field: &str) -> std::collections::BTreeMap<u32, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for row in decode(file, port, field, &[field]) {
        for value in row.iter().flat_map(|cell| cell.split(',')) {
            if let Ok(status) = value.trim().parse::<u32>() {
                *counts.entry(status).or_insert(0) += 1;
            }
        }
    }
    counts
}
