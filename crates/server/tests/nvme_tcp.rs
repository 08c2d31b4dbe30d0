//! NVMe/TCP end to end over loopback TCP against a real reflexd, through the client crate's
//! initiator (`reflex_client::nvme_tcp`): attach (ICReq, Connect, the enable handshake),
//! Identify, verified I/O with and without digests (in-capsule writes, R2T/H2CData writes,
//! C2HData reads), flush, write zeroes, deallocate, the shutdown handshake, tenant selection
//! by host NQN, the keep-alive timeout, and bad input: each either gets the spec's status or
//! closes only its own connection, while other queues go on; TLS with pre-shared keys (TP
//! 8011): verified I/O over TLS, and the refusals that keep a key to its host and subsystem,
//! the discovery subsystem included; the Namespace Attribute Changed event of a namespace
//! removed through the admin API, and its changed namespace list. Assertions only; no timing
//! (timeouts are upper bounds for a wait, never a pass condition).

mod admin_common;
mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::{config, namespace, start};
use reflex_client::nvme_tcp::{
    NvmeTcpController, NvmeTcpError, NvmeTcpOptions, NvmeTcpQueue, Transfer,
};
use reflex_proto::nvme_tcp::admin::ControllerType;
use reflex_proto::nvme_tcp::command::{CNTLID_DYNAMIC, ConnectData, io_opcode};
use reflex_proto::nvme_tcp::pdu::{self, DataHeader, Digests, Framing, IcReq, Pdu, PduType};
use reflex_proto::nvme_tcp::tls_key::{ConfiguredPsk, IdentityForm, PskHash};
use reflex_proto::nvme_tcp::{Command, Status};
use reflex_server::config::TlsMode;
use reflex_server::{
    Config, NamespaceConfig, NvmeHostConfig, NvmeSubsystemConfig, ServerHandle, TenantConfig,
    TenantStats, tenant_totals,
};

const NQN: &str = "nqn.2026-01.io.reflex:test";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:host-a";
/// Longest wait for the server to close a connection it should close.
const CLOSE_WAIT: Duration = Duration::from_secs(20);

fn nvme_config(namespaces: Vec<NamespaceConfig>) -> Config {
    let mut server_config = config(namespaces);
    server_config.nvme_tcp.subsystems = vec![NvmeSubsystemConfig {
        nqn: NQN.to_string(),
        namespaces: Vec::new(),
        allow_any_host: true,
        hosts: Vec::new(),
        secure_channel: false,
    }];
    server_config.nvme_tcp.r2t_timeout = Duration::from_millis(500);
    server_config.nvme_tcp.keep_alive_timeout_min = Duration::from_millis(200);
    server_config
}

fn nvme_server() -> ServerHandle {
    start(nvme_config(vec![
        namespace(1, "mem:64M", None),
        namespace(2, "mem:16M", None),
    ]))
}

fn address(server: &ServerHandle) -> SocketAddr {
    server
        .nvme_tcp_addr()
        .unwrap_or_else(|| panic!("NVMe/TCP is off"))
}

fn attach(server: &ServerHandle, options: NvmeTcpOptions, io_queues: u16) -> NvmeTcpController {
    NvmeTcpController::attach(address(server), options, io_queues)
        .unwrap_or_else(|e| panic!("attach: {e}"))
}

fn status_of<T>(result: Result<T, NvmeTcpError>) -> Status {
    match result {
        Ok(_) => Status::SUCCESS,
        Err(NvmeTcpError::Status { status, .. }) => status,
        Err(other) => panic!("expected a status, got {other}"),
    }
}

/// A recognisable pattern for `length` bytes written at `slba` by `seed`.
fn pattern(seed: u8, slba: u64, length: usize) -> Vec<u8> {
    (0..length)
        .map(|index| (index as u64 * 31 + slba * 7 + u64::from(seed)) as u8)
        .collect()
}

/// Writes and reads back, on two queues, transfers from one block to 1 MiB (in-capsule and
/// R2T), then flush, write zeroes, deallocate and the error statuses of bad commands.
fn check_io(digests: Digests) {
    let server = nvme_server();
    let options = NvmeTcpOptions::new(HOST, NQN).with_digests(digests);
    let mut controller = attach(&server, options, 4);
    let identify = controller.identify().clone();
    assert_eq!(identify.subsystem_nqn, NQN);
    assert_eq!(identify.controller_type, ControllerType::Io);
    assert_eq!(identify.cntlid, controller.cntlid());
    assert_eq!(identify.nn, 2);
    assert!(identify.mdts > 0);
    assert!(identify.ioccsz * 16 >= 64 + 4096, "4 KiB in-capsule data");
    assert_eq!(controller.io_queues_granted(), 4);
    assert_eq!(
        controller
            .active_namespaces()
            .unwrap_or_else(|e| panic!("{e}")),
        vec![1, 2]
    );
    let info = controller.namespace(1).unwrap_or_else(|e| panic!("{e}"));
    let block_bytes = info.block_bytes;
    assert!(block_bytes == 512 || block_bytes == 4096, "{block_bytes}");
    assert_eq!(info.size_blocks * u64::from(block_bytes), 64 << 20);
    assert_eq!(
        controller
            .namespace(2)
            .map(|ns| ns.size_blocks * u64::from(ns.block_bytes))
            .unwrap_or_else(|e| panic!("{e}")),
        16 << 20
    );
    let descriptors = controller
        .namespace_descriptors(1)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        descriptors
            .iter()
            .any(|(kind, value)| *kind == 2 && value[..] == info.identify.nguid[..]),
        "the NGUID descriptor matches Identify Namespace"
    );
    assert_eq!(
        status_of(controller.namespace(9)),
        Status::INVALID_NAMESPACE
    );

    let mut first = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    let mut second = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.digests(), digests);
    if digests.data {
        assert_eq!(first.maxh2cdata(), 4096);
    }
    let block = block_bytes as usize;
    let mut slba = 0u64;
    for (seed, length) in [
        (1u8, block),
        (2, 4096),
        (3, 8192),
        (4, 64 << 10),
        (5, 1 << 20),
    ] {
        let data = pattern(seed, slba, length);
        first
            .write(1, slba, &data, block_bytes, seed % 2 == 0)
            .unwrap_or_else(|e| panic!("write {length} bytes: {e}"));
        let read = second
            .read(1, slba, (length / block) as u32, block_bytes)
            .unwrap_or_else(|e| panic!("read {length} bytes: {e}"));
        assert!(read == data, "{length} bytes at {slba} read back differ");
        slba += (length / block) as u64;
    }
    // Namespace 2 is another device: its blocks are its own.
    let other = pattern(9, 0, 4096);
    second
        .write(2, 0, &other, block_bytes, false)
        .unwrap_or_else(|e| panic!("{e}"));
    let first_of_1 = first
        .read(1, 0, (4096 / block) as u32, block_bytes)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first_of_1[..block], pattern(1, 0, block)[..]);
    first.flush(1).unwrap_or_else(|e| panic!("flush: {e}"));

    // Write Zeroes and deallocate read back as zeroes.
    let blocks_8k = (8192 / block) as u32;
    first
        .write_zeroes(1, 0, blocks_8k)
        .unwrap_or_else(|e| panic!("write zeroes: {e}"));
    let zeroes = first
        .read(1, 0, blocks_8k, block_bytes)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(zeroes.iter().all(|&b| b == 0), "write zeroes");
    let start = (64 << 10) as u64 / u64::from(block_bytes);
    first
        .deallocate(1, &[(start, blocks_8k), (start + 64, blocks_8k)])
        .unwrap_or_else(|e| panic!("deallocate: {e}"));

    // Bad commands get the spec's status and the queue goes on.
    let size_blocks = info.size_blocks;
    assert_eq!(
        status_of(first.read(1, size_blocks - 1, 2, block_bytes)),
        Status::LBA_OUT_OF_RANGE
    );
    assert_eq!(
        status_of(first.write(1, size_blocks, &pattern(0, 0, block), block_bytes, false)),
        Status::LBA_OUT_OF_RANGE
    );
    assert_eq!(
        status_of(first.read(7, 0, 1, block_bytes)),
        Status::INVALID_NAMESPACE
    );
    // Oversize: more blocks than MDTS allows (the initiator would refuse to move the data,
    // so the command goes out with no data descriptor length).
    let oversize = Command::io(io_opcode::READ, 0, 1, 0, 0x1_0000, false);
    assert_eq!(
        status_of(first.execute(oversize, Transfer::None)),
        Status::INVALID_FIELD
    );
    let mut unknown = Command::zeroed();
    unknown.set_opcode(0x55).set_nsid(1);
    assert_eq!(
        status_of(first.execute(unknown, Transfer::None)),
        Status::INVALID_OPCODE
    );
    let again = first
        .read(1, slba - 1, 1, block_bytes)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again.len(), block);

    controller
        .keep_alive()
        .unwrap_or_else(|e| panic!("keep alive: {e}"));
    controller
        .shutdown()
        .unwrap_or_else(|e| panic!("shutdown: {e}"));
    assert_eq!(
        status_of(first.read(1, 0, 1, block_bytes)),
        Status::NAMESPACE_NOT_READY
    );
    drop((first, second, controller));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn attach_identify_and_verified_io_without_digests() {
    check_io(Digests::NONE);
}

#[test]
fn attach_identify_and_verified_io_with_digests() {
    check_io(Digests::BOTH);
}

#[test]
fn header_digest_only_and_data_digest_only() {
    for digests in [
        Digests {
            header: true,
            data: false,
        },
        Digests {
            header: false,
            data: true,
        },
    ] {
        let server = nvme_server();
        let mut controller = attach(
            &server,
            NvmeTcpOptions::new(HOST, NQN).with_digests(digests),
            1,
        );
        let mut queue = controller
            .connect_io_queue()
            .unwrap_or_else(|e| panic!("{e}"));
        let data = pattern(3, 5, 128 << 10);
        queue
            .write(1, 40, &data, 512, false)
            .unwrap_or_else(|e| panic!("{digests:?}: {e}"));
        let read = queue
            .read(1, 40, (data.len() / 512) as u32, 512)
            .unwrap_or_else(|e| panic!("{digests:?}: {e}"));
        assert!(read == data, "{digests:?}");
    }
}

fn qos_namespace(id: u32) -> NamespaceConfig {
    NamespaceConfig {
        profile: Some(
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../profiles/device-a-small.toml"
            )
            .to_string(),
        ),
        ..namespace(id, "mem:16M", None)
    }
}

#[test]
fn the_host_nqn_selects_the_tenant() {
    let mut server_config = nvme_config(vec![qos_namespace(1)]);
    server_config.threads = 1;
    server_config.tenants = vec![
        TenantConfig::latency_critical("gold", 500, 5_000, 100),
        TenantConfig::best_effort("bulk"),
    ];
    server_config.nvme_tcp.subsystems = vec![NvmeSubsystemConfig {
        nqn: NQN.to_string(),
        namespaces: vec![1],
        allow_any_host: false,
        hosts: vec![
            NvmeHostConfig {
                nqn: "nqn.2026-01.io.reflex:host-gold".into(),
                tenant: Some("gold".into()),
                psk: None,
                psk_file: None,
            },
            NvmeHostConfig {
                nqn: "nqn.2026-01.io.reflex:host-bulk".into(),
                tenant: Some("bulk".into()),
                psk: None,
                psk_file: None,
            },
        ],
        secure_channel: false,
    }];
    let server = start(server_config);
    let gold = server
        .tenant_handle(1, "gold")
        .unwrap_or_else(|| panic!("gold not admitted"));
    let bulk = server
        .tenant_handle(1, "bulk")
        .unwrap_or_else(|| panic!("bulk not admitted"));

    // A host not listed may not connect.
    let stranger = NvmeTcpController::attach(
        address(&server),
        NvmeTcpOptions::new("nqn.2026-01.io.reflex:stranger", NQN),
        1,
    );
    assert_eq!(status_of(stranger), Status::CONNECT_INVALID_HOST);

    for (host, reads) in [("host-gold", 7u64), ("host-bulk", 4)] {
        let options = NvmeTcpOptions::new(&format!("nqn.2026-01.io.reflex:{host}"), NQN);
        let mut controller = attach(&server, options, 1);
        let mut queue = controller
            .connect_io_queue()
            .unwrap_or_else(|e| panic!("{e}"));
        for index in 0..reads {
            queue
                .read(1, index * 8, 8, 512)
                .unwrap_or_else(|e| panic!("{host}: {e}"));
        }
    }
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let totals: BTreeMap<u64, TenantStats> = tenant_totals(&stats);
    assert_eq!(totals[&gold].requests, 7);
    assert_eq!(totals[&bulk].requests, 4);
}

#[test]
fn the_keep_alive_timeout_ends_the_controller_and_its_queues() {
    let server = nvme_server();
    let mut options = NvmeTcpOptions::new(HOST, NQN);
    options.keep_alive_ms = 200;
    let mut controller = attach(&server, options.clone(), 2);
    let mut queue = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    queue.read(1, 0, 1, 512).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(server.nvme_tcp_controllers(), 1);
    // No keep-alive from here on: the admin queue closes, then its I/O queue.
    assert!(
        controller.admin().closed_within(CLOSE_WAIT),
        "admin queue still open"
    );
    assert!(queue.closed_within(CLOSE_WAIT), "I/O queue still open");
    assert_eq!(server.nvme_tcp_controllers(), 0);
    // Without a keep-alive timeout, a controller stays (checked by still working after the
    // first one was closed).
    let mut steady = attach(&server, NvmeTcpOptions::new(HOST, NQN), 1);
    steady.keep_alive().unwrap_or_else(|e| panic!("{e}"));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

/// A raw connection after ICReq/ICResp (no digests), for sending broken input.
fn raw_queue(server: &ServerHandle, digests: Digests) -> NvmeTcpQueue {
    NvmeTcpQueue::open(address(server), digests, Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("ICReq: {e}"))
}

/// The next PDU is a C2HTermReq and then the connection closes.
fn expect_terminated(queue: &mut NvmeTcpQueue, what: &str) {
    match queue.receive_pdu() {
        Ok(received) => assert!(
            matches!(received.pdu, Pdu::C2hTermReq(_)),
            "{what}: expected a C2HTermReq, got {:?}",
            received.pdu
        ),
        Err(NvmeTcpError::Closed) => {}
        Err(error) => panic!("{what}: {error}"),
    }
    assert!(queue.closed_within(CLOSE_WAIT), "{what}: still open");
}

fn connect_data(cntlid: u16) -> Vec<u8> {
    ConnectData {
        host_id: NvmeTcpOptions::new(HOST, NQN).host_id,
        cntlid,
        subsystem_nqn: NQN.into(),
        host_nqn: HOST.into(),
    }
    .encode()
    .to_vec()
}

#[test]
fn bad_input_gets_an_error_status_or_closes_only_its_connection() {
    let server = nvme_server();
    // A healthy controller whose queue must be unaffected by everything below.
    let mut healthy = attach(&server, NvmeTcpOptions::new(HOST, NQN), 8);
    let mut healthy_queue = healthy.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    let reference = pattern(42, 100, 64 << 10);
    healthy_queue
        .write(1, 100, &reference, 512, false)
        .unwrap_or_else(|e| panic!("{e}"));
    let check_healthy = |queue: &mut NvmeTcpQueue, after: &str| {
        let read = queue
            .read(1, 100, 128, 512)
            .unwrap_or_else(|e| panic!("healthy queue after {after}: {e}"));
        assert!(read == reference, "healthy queue after {after}");
    };

    // Garbage instead of ICReq: an unknown PDU type.
    {
        let mut stream =
            std::net::TcpStream::connect(address(&server)).unwrap_or_else(|e| panic!("{e}"));
        use std::io::{Read, Write};
        stream
            .set_read_timeout(Some(CLOSE_WAIT))
            .unwrap_or_else(|e| panic!("{e}"));
        stream
            .write_all(&[0xEE; 128])
            .unwrap_or_else(|e| panic!("{e}"));
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        assert_eq!(answer.first(), Some(&(PduType::C2hTermReq as u8)));
    }
    check_healthy(&mut healthy_queue, "garbage");

    // A capsule before ICReq.
    {
        let mut stream =
            std::net::TcpStream::connect(address(&server)).unwrap_or_else(|e| panic!("{e}"));
        use std::io::{Read, Write};
        stream
            .set_read_timeout(Some(CLOSE_WAIT))
            .unwrap_or_else(|e| panic!("{e}"));
        let command = Command::io(io_opcode::READ, 1, 1, 0, 1, false);
        let header = Framing::PLAIN.capsule_cmd(&command.0, 0);
        stream
            .write_all(header.as_bytes())
            .unwrap_or_else(|e| panic!("{e}"));
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        assert_eq!(answer.first(), Some(&(PduType::C2hTermReq as u8)));
    }

    // A second ICReq.
    let mut queue = raw_queue(&server, Digests::NONE);
    queue
        .send_raw(&pdu::encode_ic_req(&IcReq {
            pfv: 0,
            hpda: 0,
            digests: Digests::NONE,
            maxr2t: 0,
        }))
        .unwrap_or_else(|e| panic!("{e}"));
    expect_terminated(&mut queue, "second ICReq");

    // An I/O command before Connect: Command Sequence Error, and the queue goes on to
    // connect.
    let mut queue = raw_queue(&server, Digests::NONE);
    let read = Command::io(io_opcode::READ, 0, 1, 0, 1, false);
    assert_eq!(
        status_of(queue.execute(read, Transfer::FromTarget(512))),
        Status::COMMAND_SEQUENCE_ERROR
    );
    let cntlid = queue
        .connect(&NvmeTcpOptions::new(HOST, NQN), 0, CNTLID_DYNAMIC)
        .unwrap_or_else(|e| panic!("Connect after the error: {e}"));
    assert!(cntlid > 0);
    // An admin command before the controller is enabled.
    let mut identify = Command::zeroed();
    identify
        .set_opcode(reflex_proto::nvme_tcp::command::admin_opcode::IDENTIFY)
        .set_cdw(10, 1);
    assert_eq!(
        status_of(queue.execute(identify, Transfer::FromTarget(4096))),
        Status::COMMAND_SEQUENCE_ERROR
    );
    drop(queue);

    // Connect for queues that do not exist: a qid above the granted count, a controller
    // that does not exist, a subsystem that does not exist.
    let options = NvmeTcpOptions::new(HOST, NQN);
    let mut queue = raw_queue(&server, Digests::NONE);
    assert_eq!(
        status_of(queue.connect(&options, 40, healthy.cntlid())),
        Status::CONNECT_INVALID_PARAMETERS
    );
    assert_eq!(
        status_of(queue.connect(&options, 2, 999)),
        Status::CONNECT_INVALID_PARAMETERS
    );
    assert_eq!(
        status_of(queue.connect(
            &NvmeTcpOptions::new(HOST, "nqn.2026-01.io.reflex:none"),
            0,
            CNTLID_DYNAMIC
        )),
        Status::CONNECT_INVALID_PARAMETERS
    );
    // Another host's NQN for an existing controller.
    assert_eq!(
        status_of(queue.connect(
            &NvmeTcpOptions::new("nqn.2026-01.io.reflex:intruder", NQN),
            3,
            healthy.cntlid()
        )),
        Status::CONNECT_INVALID_PARAMETERS
    );
    // The queue id of the healthy queue, taken already.
    assert_eq!(
        status_of(queue.connect(&options, healthy_queue.qid(), healthy.cntlid())),
        Status::CONNECT_INVALID_PARAMETERS
    );
    // A Connect whose data is too short for Connect data.
    let mut short = Command::connect_command(0, 0, 31, 0, 0);
    short.set_cid(9);
    assert_ne!(
        status_of(queue.execute(
            short,
            Transfer::ToTarget(&connect_data(CNTLID_DYNAMIC)[..512])
        )),
        Status::SUCCESS
    );
    drop(queue);
    check_healthy(&mut healthy_queue, "bad Connects");

    // A wrong header digest: fatal.
    let mut queue = raw_queue(&server, Digests::BOTH);
    let command = Command::io(io_opcode::READ, 1, 1, 0, 1, false);
    let framing = Framing::new(Digests::BOTH, 0).unwrap_or(Framing::PLAIN);
    let mut bytes = framing.capsule_cmd(&command.0, 0).as_bytes().to_vec();
    let digest_at = pdu::CAPSULE_CMD_HLEN;
    bytes[digest_at] ^= 0xFF;
    queue.send_raw(&bytes).unwrap_or_else(|e| panic!("{e}"));
    expect_terminated(&mut queue, "wrong header digest");

    // A wrong data digest on an in-capsule write: Transient Transport Error, the
    // connection goes on.
    let mut io_queue = healthy.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    drop(io_queue);
    let mut digest_controller = attach(
        &server,
        NvmeTcpOptions::new("nqn.2026-01.io.reflex:digests", NQN).with_digests(Digests::BOTH),
        2,
    );
    io_queue = digest_controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    let data = pattern(7, 0, 4096);
    let mut write = Command::io(io_opcode::WRITE, 77, 1, 2000, 8, false);
    write.set_sgl(reflex_proto::nvme_tcp::command::SglDescriptor {
        address: 0,
        length: 4096,
        identifier: reflex_proto::nvme_tcp::command::sgl::DATA_BLOCK_OFFSET,
    });
    let mut bytes = framing.capsule_cmd(&write.0, 4096).as_bytes().to_vec();
    bytes.extend_from_slice(&data);
    bytes.extend_from_slice(&(pdu::crc32c(&data) ^ 1).to_le_bytes());
    io_queue.send_raw(&bytes).unwrap_or_else(|e| panic!("{e}"));
    let received = io_queue.receive_pdu().unwrap_or_else(|e| panic!("{e}"));
    let Pdu::CapsuleResp(cqe) = received.pdu else {
        panic!("expected a CapsuleResp, got {:?}", received.pdu);
    };
    let completion = reflex_proto::nvme_tcp::Completion::from_bytes(&cqe);
    assert_eq!(completion.cid, 77);
    assert_eq!(completion.status, Status::TRANSIENT_TRANSPORT_ERROR);
    io_queue
        .write(1, 2000, &data, 512, false)
        .unwrap_or_else(|e| panic!("the queue goes on: {e}"));

    // H2CData without an R2T: fatal.
    let h2c = Framing::PLAIN.data_pdu(
        PduType::H2cData,
        pdu::flags::LAST_PDU,
        DataHeader {
            cccid: 5,
            ttag: 3,
            offset: 0,
            length: 512,
        },
    );
    let mut queue = healthy.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    let mut bytes = h2c.as_bytes().to_vec();
    bytes.extend_from_slice(&[0u8; 512]);
    queue.send_raw(&bytes).unwrap_or_else(|e| panic!("{e}"));
    expect_terminated(&mut queue, "H2CData without R2T");

    // H2CData longer than the R2T asked for: fatal.
    let mut queue = healthy.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    let mut write = Command::io(io_opcode::WRITE, 12, 1, 0, 16, false);
    write.set_sgl(reflex_proto::nvme_tcp::command::SglDescriptor {
        address: 0,
        length: 8192,
        identifier: reflex_proto::nvme_tcp::command::sgl::TRANSPORT_DATA_BLOCK,
    });
    queue
        .send_raw(Framing::PLAIN.capsule_cmd(&write.0, 0).as_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    let received = queue.receive_pdu().unwrap_or_else(|e| panic!("{e}"));
    let Pdu::R2t(r2t) = received.pdu else {
        panic!("expected an R2T, got {:?}", received.pdu);
    };
    assert_eq!((r2t.cccid, r2t.offset, r2t.length), (12, 0, 8192));
    let too_long = Framing::PLAIN.data_pdu(
        PduType::H2cData,
        pdu::flags::LAST_PDU,
        DataHeader {
            cccid: 12,
            ttag: r2t.ttag,
            offset: 0,
            length: 16384,
        },
    );
    let mut bytes = too_long.as_bytes().to_vec();
    bytes.extend_from_slice(&[0u8; 16384]);
    queue.send_raw(&bytes).unwrap_or_else(|e| panic!("{e}"));
    expect_terminated(&mut queue, "H2CData beyond the R2T");

    // A host that never answers an R2T loses that connection (r2t_timeout is 500 ms).
    let mut queue = healthy.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    write.set_cid(13);
    queue
        .send_raw(Framing::PLAIN.capsule_cmd(&write.0, 0).as_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    let received = queue.receive_pdu().unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(received.pdu, Pdu::R2t(_)), "{:?}", received.pdu);
    assert!(
        queue.closed_within(CLOSE_WAIT),
        "R2T never answered: still open"
    );

    // A PDU only a controller sends (CapsuleResp from the host): fatal.
    let mut queue = healthy.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    let response = Framing::PLAIN.capsule_resp(&[0u8; 16]);
    queue
        .send_raw(response.as_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    expect_terminated(&mut queue, "CapsuleResp from the host");

    // Malformed lengths: PLEN shorter than the header.
    let mut queue = healthy.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    let mut bytes = Framing::PLAIN
        .capsule_cmd(&Command::io(io_opcode::READ, 1, 1, 0, 1, false).0, 0)
        .as_bytes()
        .to_vec();
    bytes[4..8].copy_from_slice(&10u32.to_le_bytes());
    queue.send_raw(&bytes).unwrap_or_else(|e| panic!("{e}"));
    expect_terminated(&mut queue, "PLEN shorter than the header");

    // A command larger than the in-capsule limit in the capsule: SGL Data Length Invalid.
    let mut queue = healthy.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    let mut big = Command::io(io_opcode::WRITE, 21, 1, 0, 16, false);
    big.set_sgl(reflex_proto::nvme_tcp::command::SglDescriptor {
        address: 0,
        length: 8192,
        identifier: reflex_proto::nvme_tcp::command::sgl::DATA_BLOCK_OFFSET,
    });
    let mut bytes = Framing::PLAIN.capsule_cmd(&big.0, 8192).as_bytes().to_vec();
    bytes.extend_from_slice(&[0u8; 8192]);
    queue.send_raw(&bytes).unwrap_or_else(|e| panic!("{e}"));
    let received = queue.receive_pdu().unwrap_or_else(|e| panic!("{e}"));
    let Pdu::CapsuleResp(cqe) = received.pdu else {
        panic!("expected a CapsuleResp, got {:?}", received.pdu);
    };
    assert_eq!(
        reflex_proto::nvme_tcp::Completion::from_bytes(&cqe).status,
        Status::SGL_DATA_LENGTH_INVALID
    );
    queue
        .read(1, 0, 1, 512)
        .unwrap_or_else(|e| panic!("the queue goes on: {e}"));

    check_healthy(&mut healthy_queue, "all bad input");
    healthy.keep_alive().unwrap_or_else(|e| panic!("{e}"));
    drop((healthy_queue, healthy, digest_controller, io_queue, queue));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_discovery_controller_lists_the_subsystems() {
    use reflex_proto::nvme_tcp::admin::{decode_discovery_log, discovery_log_size};
    use reflex_proto::nvme_tcp::command::{DISCOVERY_NQN, admin_opcode, log_page};
    let server = nvme_server();
    let mut controller = attach(&server, NvmeTcpOptions::new(HOST, DISCOVERY_NQN), 0);
    assert_eq!(
        controller.identify().controller_type,
        ControllerType::Discovery
    );
    let length = discovery_log_size(1);
    let mut command = Command::zeroed();
    let dwords = (length / 4 - 1) as u32;
    command
        .set_opcode(admin_opcode::GET_LOG_PAGE)
        .set_cdw(
            10,
            u32::from(log_page::DISCOVERY) | ((dwords & 0xFFFF) << 16),
        )
        .set_cdw(11, dwords >> 16);
    let (_, data) = controller
        .admin()
        .execute(command, Transfer::FromTarget(length))
        .unwrap_or_else(|e| panic!("discovery log: {e}"));
    let entries = decode_discovery_log(&data);
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].subsystem_nqn, NQN);
    assert_eq!(entries[0].service_id, address(&server).port().to_string());
    // A listener without TLS: no secure channel, no security type.
    assert_eq!(
        entries[0].transport_requirements,
        reflex_proto::nvme_tcp::admin::discovery::TREQ_NOT_REQUIRED
    );
    assert_eq!(
        entries[0].tcp_security_type,
        reflex_proto::nvme_tcp::admin::discovery::SECTYPE_NONE
    );
}

/// The discovery log of `host_nqn` (asked in plaintext, `entries_max` entries at most).
fn discovery_log(
    server: &ServerHandle,
    host_nqn: &str,
    entries_max: usize,
) -> Vec<reflex_proto::nvme_tcp::admin::DiscoveryEntry> {
    use reflex_proto::nvme_tcp::command::DISCOVERY_NQN;
    let mut controller = attach(server, NvmeTcpOptions::new(host_nqn, DISCOVERY_NQN), 0);
    read_discovery_log(&mut controller, entries_max)
}

#[test]
fn the_temperature_thresholds_start_at_the_warning_temperature_and_keep_what_is_set() {
    use reflex_client::nvme_tcp::{get_features, set_features};
    use reflex_proto::nvme_tcp::admin::WARNING_TEMPERATURE_KELVIN;
    use reflex_proto::nvme_tcp::command::feature;
    let server = nvme_server();
    let mut controller = attach(&server, NvmeTcpOptions::new(HOST, NQN), 1);
    let mut execute = |command: fn(u8, u32) -> reflex_proto::nvme_tcp::Command, dword11: u32| {
        controller
            .admin()
            .execute(
                command(feature::TEMPERATURE_THRESHOLD, dword11),
                Transfer::None,
            )
            .map(|(completion, _)| completion.dw0)
    };
    const UNDER: u32 = 1 << 20;
    const SENSOR_1: u32 = 1 << 16;
    const EVERY_SENSOR: u32 = 0xF << 16;
    // Composite sensor, over-temperature: the warning temperature (WCTEMP), so a controller
    // at room temperature is below its threshold; under-temperature: 0 K.
    let get = get_features;
    assert_eq!(
        execute(get, 0).unwrap_or_else(|e| panic!("{e}")),
        u32::from(WARNING_TEMPERATURE_KELVIN)
    );
    assert_eq!(execute(get, UNDER).unwrap_or_else(|e| panic!("{e}")), UNDER);
    let set = set_features;
    execute(set, 350).unwrap_or_else(|e| panic!("{e}"));
    execute(set, UNDER | 270).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(execute(get, 0).unwrap_or_else(|e| panic!("{e}")), 350);
    assert_eq!(
        execute(get, UNDER).unwrap_or_else(|e| panic!("{e}")),
        UNDER | 270
    );
    // "Every sensor" is the composite one here; a sensor that does not exist and a reserved
    // threshold type are invalid fields.
    execute(set, EVERY_SENSOR | 345).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(execute(get, 0).unwrap_or_else(|e| panic!("{e}")), 345);
    assert_eq!(status_of(execute(get, SENSOR_1)), Status::INVALID_FIELD);
    assert_eq!(
        status_of(execute(set, SENSOR_1 | 300)),
        Status::INVALID_FIELD
    );
    assert_eq!(status_of(execute(get, 2 << 20)), Status::INVALID_FIELD);
    assert_eq!(status_of(execute(get, EVERY_SENSOR)), Status::INVALID_FIELD);
    drop(controller);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn an_io_queue_connects_with_a_fresh_host_identifier() {
    // The TrueNAS Python initiator sends a new host identifier on each Connect; the
    // controller is found by its id, subsystem and host NQN, as the Linux target does.
    let server = nvme_server();
    let options = NvmeTcpOptions::new(HOST, NQN);
    let mut controller = attach(&server, options.clone(), 2);
    let mut queue = raw_queue(&server, Digests::NONE);
    let mut fresh = options;
    fresh.host_id = [0x5A; 16];
    fresh.queue_entries = 16; // The test configuration's window.
    queue
        .connect(&fresh, 1, controller.cntlid())
        .unwrap_or_else(|e| panic!("I/O queue Connect with another host id: {e}"));
    queue.set_in_capsule_bytes(4096);
    let data = pattern(11, 3, 4096);
    queue
        .write(1, 3, &data, 512, false)
        .unwrap_or_else(|e| panic!("{e}"));
    let read = queue.read(1, 3, 8, 512).unwrap_or_else(|e| panic!("{e}"));
    assert!(read == data);
    controller.keep_alive().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_namespace_removed_at_run_time_leaves_the_active_list_and_its_io_is_refused() {
    let server = nvme_server();
    let mut controller = attach(&server, NvmeTcpOptions::new(HOST, NQN), 1);
    let mut queue = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    let block_bytes = controller
        .namespace(2)
        .unwrap_or_else(|e| panic!("{e}"))
        .block_bytes;
    let data = pattern(3, 0, 4096);
    queue
        .write(2, 0, &data, block_bytes, false)
        .unwrap_or_else(|e| panic!("{e}"));
    // A namespace added at run time is in no subsystem: the host does not see it.
    let added = server
        .namespace_manager()
        .add(&namespace(7, "mem:16M", None), true)
        .unwrap_or_else(|e| panic!("add: {e}"));
    assert_eq!(added, 2);
    server
        .namespace_manager()
        .remove(2, true)
        .unwrap_or_else(|e| panic!("remove: {e}"));
    assert_eq!(
        controller
            .active_namespaces()
            .unwrap_or_else(|e| panic!("{e}")),
        vec![1]
    );
    // Inactive: Identify Namespace answers zeroes, descriptors are refused.
    let gone = controller.namespace(2).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(gone.size_blocks, 0);
    assert_eq!(
        status_of(controller.namespace_descriptors(2)),
        Status::INVALID_NAMESPACE
    );
    let blocks = 4096 / block_bytes;
    assert_eq!(
        status_of(queue.read(2, 0, blocks, block_bytes)),
        Status::INVALID_NAMESPACE
    );
    assert_eq!(
        status_of(queue.write(2, 0, &data, block_bytes, false)),
        Status::INVALID_NAMESPACE
    );
    // Namespace 1 is unharmed.
    queue
        .write(1, 0, &data, block_bytes, false)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        queue
            .read(1, 0, blocks, block_bytes)
            .unwrap_or_else(|e| panic!("{e}")),
        data
    );
}

// ---- TLS (TP 8011) ----

const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:host-b";
const HOST_C: &str = "nqn.2014-08.org.nvmexpress:uuid:host-c";
const NQN_OPEN: &str = "nqn.2026-01.io.reflex:open";
const NQN_SECURE: &str = "nqn.2026-01.io.reflex:secure";

/// A configured PSK (SHA-256 retained-key hash) of 32 bytes of `seed`.
fn tls_key(seed: u8) -> ConfiguredPsk {
    let bytes: Vec<u8> = (0..32u8).map(|index| index.wrapping_mul(seed)).collect();
    ConfiguredPsk::new(PskHash::Sha256, &bytes).unwrap_or_else(|e| panic!("{e}"))
}

fn host(nqn: &str, psk: Option<&ConfiguredPsk>, psk_file: Option<String>) -> NvmeHostConfig {
    NvmeHostConfig {
        nqn: nqn.to_string(),
        tenant: None,
        psk: psk.map(ConfiguredPsk::to_interchange),
        psk_file,
    }
}

/// Subsystems for the TLS tests: `NQN` with host A (key inline) and host B (key in
/// `key_file`), open to any other host over plaintext; `NQN_OPEN` open to anyone, no keys;
/// `NQN_SECURE` TLS only, host A with its own key.
fn tls_config(mode: TlsMode, key_file: &std::path::Path) -> Config {
    let mut server_config = nvme_config(vec![namespace(1, "mem:16M", None)]);
    server_config.nvme_tcp.tls = mode;
    let subsystem =
        |nqn: &str, hosts: Vec<NvmeHostConfig>, secure_channel: bool| NvmeSubsystemConfig {
            nqn: nqn.to_string(),
            namespaces: vec![1],
            allow_any_host: true,
            hosts,
            secure_channel,
        };
    server_config.nvme_tcp.subsystems = vec![
        subsystem(
            NQN,
            vec![
                host(HOST, Some(&tls_key(3)), None),
                host(HOST_B, None, Some(key_file.display().to_string())),
            ],
            false,
        ),
        subsystem(NQN_OPEN, Vec::new(), false),
        subsystem(NQN_SECURE, vec![host(HOST, Some(&tls_key(5)), None)], true),
    ];
    server_config
}

fn key_file(psk: &ConfiguredPsk) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().unwrap_or_else(|e| panic!("{e}"));
    std::io::Write::write_all(&mut file, format!("{}\n", psk.to_interchange()).as_bytes())
        .unwrap_or_else(|e| panic!("{e}"));
    file
}

/// Writes and reads back 4 KiB (in capsule), 64 KiB and 1 MiB (R2T) at distinct places.
fn verified_io(queue: &mut NvmeTcpQueue, seed: u8) {
    let block_bytes = 512u32;
    for (slba, length) in [(8u64, 4096usize), (64, 64 << 10), (1024, 1 << 20)] {
        let data = pattern(seed, slba, length);
        queue
            .write(1, slba, &data, block_bytes, false)
            .unwrap_or_else(|e| panic!("write {length} at {slba}: {e}"));
        let back = queue
            .read(1, slba, (length / block_bytes as usize) as u32, block_bytes)
            .unwrap_or_else(|e| panic!("read {length} at {slba}: {e}"));
        assert!(back == data, "{length} bytes at {slba} read back differ");
    }
}

/// The attach failed in the TLS handshake or by the target closing the connection.
fn assert_tls_refused<T>(result: Result<T, NvmeTcpError>, what: &str) {
    match result {
        Err(NvmeTcpError::Tls(_) | NvmeTcpError::Closed | NvmeTcpError::Io(_)) => {}
        Err(other) => panic!("{what}: expected a refused handshake, got {other}"),
        Ok(_) => panic!("{what}: attached"),
    }
}

#[test]
fn tls_attach_and_verified_io_with_digests_off_and_on() {
    let file = key_file(&tls_key(7));
    let server = start(tls_config(TlsMode::Optional, file.path()));
    for (digests, options) in [
        (
            Digests::NONE,
            NvmeTcpOptions::new(HOST, NQN).with_tls_psk(tls_key(3)),
        ),
        (
            Digests::BOTH,
            NvmeTcpOptions::new(HOST, NQN).with_tls_psk(tls_key(3)),
        ),
        // Host B's key comes from its key file.
        (
            Digests::BOTH,
            NvmeTcpOptions::new(HOST_B, NQN).with_tls_psk(tls_key(7)),
        ),
    ] {
        let host_nqn = options.host_nqn.clone();
        let mut controller = attach(&server, options.with_digests(digests), 2);
        assert_eq!(controller.identify().subsystem_nqn, NQN);
        let mut queue = controller
            .connect_io_queue()
            .unwrap_or_else(|e| panic!("{host_nqn}: {e}"));
        assert_eq!(queue.digests(), digests);
        assert_eq!(
            queue.tls_session(),
            Some(("TLSv1.3", "TLS_AES_128_GCM_SHA256".to_string())),
            "TP 8011: TLS 1.3, the suite of a 32-byte key"
        );
        verified_io(&mut queue, digests.data as u8 + 1);
        controller
            .shutdown()
            .unwrap_or_else(|e| panic!("shutdown: {e}"));
    }
    // Plaintext still works on the optional listener for a host without a key.
    let mut plain = attach(&server, NvmeTcpOptions::new(HOST_C, NQN), 1);
    let mut queue = plain.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(queue.tls_session(), None);
    verified_io(&mut queue, 9);
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    // Three controllers over TLS, each an admin and an I/O queue.
    let sessions: u64 = stats.iter().map(|core| core.tls_sessions).sum();
    assert_eq!(sessions, 6);
}

#[test]
fn tls_keys_stay_with_their_host_and_subsystem() {
    let file = key_file(&tls_key(7));
    let server = start(tls_config(TlsMode::Optional, file.path()));
    // A queue that works throughout: the refusals below close only their own connections.
    let mut controller = attach(
        &server,
        NvmeTcpOptions::new(HOST, NQN).with_tls_psk(tls_key(3)),
        1,
    );
    let mut queue = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    verified_io(&mut queue, 1);

    // A wrong key for a known identity: the handshake fails.
    assert_tls_refused(
        NvmeTcpController::attach(
            address(&server),
            NvmeTcpOptions::new(HOST, NQN).with_tls_psk(tls_key(4)),
            1,
        ),
        "wrong key",
    );
    // An identity the target has no key for (host C has none).
    assert_tls_refused(
        NvmeTcpController::attach(
            address(&server),
            NvmeTcpOptions::new(HOST_C, NQN).with_tls_psk(tls_key(3)),
            1,
        ),
        "unknown identity",
    );
    // Host A's identity and key, Connect as host B: refused, though the handshake is good.
    let mut as_b = NvmeTcpOptions::new(HOST_B, NQN).with_tls_psk(tls_key(3));
    if let Some(tls) = as_b.tls.as_mut() {
        tls.host_nqn = HOST.to_string();
    }
    assert_eq!(
        status_of(NvmeTcpController::attach(address(&server), as_b, 1)),
        Status::CONNECT_INVALID_HOST
    );
    // Host A's identity for subsystem NQN, Connect to NQN_OPEN (which any host may reach in
    // plaintext) and to NQN_SECURE (where host A has another key): refused.
    for other in [NQN_OPEN, NQN_SECURE] {
        let mut elsewhere = NvmeTcpOptions::new(HOST, other).with_tls_psk(tls_key(3));
        if let Some(tls) = elsewhere.tls.as_mut() {
            tls.subsystem_nqn = NQN.to_string();
        }
        assert_eq!(
            status_of(NvmeTcpController::attach(address(&server), elsewhere, 1)),
            Status::CONNECT_INVALID_HOST,
            "{other}"
        );
    }
    // An I/O queue of host A's controller connected with a mismatched identity: refused.
    let mut io_options = NvmeTcpOptions::new(HOST, NQN).with_tls_psk(tls_key(5));
    io_options.queue_entries = 8; // Within the server's window (what attach learns from CAP).
    if let Some(tls) = io_options.tls.as_mut() {
        tls.subsystem_nqn = NQN_SECURE.to_string();
    }
    let mut stray = NvmeTcpQueue::open_with(
        address(&server),
        Digests::NONE,
        Duration::from_secs(20),
        io_options.tls.as_ref(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        status_of(stray.connect(&io_options, 1, controller.cntlid())),
        Status::CONNECT_INVALID_HOST
    );
    // Host A has a key: over plaintext it is refused, on every subsystem that lists it; the
    // secure-channel subsystem refuses every plaintext host.
    for (host_nqn, subsystem) in [(HOST, NQN), (HOST_B, NQN), (HOST_C, NQN_SECURE)] {
        assert_eq!(
            status_of(NvmeTcpController::attach(
                address(&server),
                NvmeTcpOptions::new(host_nqn, subsystem),
                1
            )),
            Status::CONNECT_INVALID_HOST,
            "{host_nqn} in plaintext to {subsystem}"
        );
    }
    // Host A over TLS with its own key for the secure subsystem: served.
    let mut secure = attach(
        &server,
        NvmeTcpOptions::new(HOST, NQN_SECURE).with_tls_psk(tls_key(5)),
        1,
    );
    let mut secure_queue = secure.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    verified_io(&mut secure_queue, 2);

    // The first queue was not disturbed.
    verified_io(&mut queue, 3);
    controller
        .keep_alive()
        .unwrap_or_else(|e| panic!("keep alive: {e}"));
    drop((queue, controller, secure_queue, secure, stray));
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    // The wrong key and the unknown identity; the Connect refusals had good handshakes.
    let failures: u64 = stats.iter().map(|core| core.tls_failures).sum();
    assert_eq!(failures, 2);
}

#[test]
fn a_listener_that_requires_tls_closes_a_plaintext_host() {
    let file = key_file(&tls_key(7));
    let server = start(tls_config(TlsMode::Require, file.path()));
    let mut plain = NvmeTcpQueue::open_with(
        address(&server),
        Digests::NONE,
        Duration::from_secs(20),
        None,
    );
    // The ICReq gets no ICResp: the connection closes.
    match &mut plain {
        Err(NvmeTcpError::Closed | NvmeTcpError::Io(_)) => {}
        Err(other) => panic!("plaintext ICReq: {other}"),
        Ok(queue) => assert!(queue.closed_within(CLOSE_WAIT), "plaintext host served"),
    }
    let mut controller = attach(
        &server,
        NvmeTcpOptions::new(HOST, NQN).with_tls_psk(tls_key(3)),
        1,
    );
    let mut queue = controller
        .connect_io_queue()
        .unwrap_or_else(|e| panic!("{e}"));
    verified_io(&mut queue, 4);
    drop((queue, controller));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn tls_keys_reload_from_their_files() {
    let file = key_file(&tls_key(7));
    let server_config = tls_config(TlsMode::Optional, file.path());
    let server = start(server_config.clone());
    let mut before = attach(
        &server,
        NvmeTcpOptions::new(HOST_B, NQN).with_tls_psk(tls_key(7)),
        1,
    );
    let mut before_queue = before.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(file.path(), tls_key(11).to_interchange()).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        server
            .reload_tls(&server_config)
            .unwrap_or_else(|e| panic!("reload: {e}"))
    );
    assert_tls_refused(
        NvmeTcpController::attach(
            address(&server),
            NvmeTcpOptions::new(HOST_B, NQN).with_tls_psk(tls_key(7)),
            1,
        ),
        "the replaced key",
    );
    let mut after = attach(
        &server,
        NvmeTcpOptions::new(HOST_B, NQN).with_tls_psk(tls_key(11)),
        1,
    );
    let mut after_queue = after.connect_io_queue().unwrap_or_else(|e| panic!("{e}"));
    verified_io(&mut after_queue, 5);
    // The session that started with the old key goes on.
    verified_io(&mut before_queue, 6);
    // A key file that does not parse changes nothing.
    std::fs::write(file.path(), "NVMeTLSkey-1:01:garbage:").unwrap_or_else(|e| panic!("{e}"));
    assert!(server.reload_tls(&server_config).is_err());
    let mut again = attach(
        &server,
        NvmeTcpOptions::new(HOST_B, NQN).with_tls_psk(tls_key(11)),
        1,
    );
    verified_io(
        &mut again.connect_io_queue().unwrap_or_else(|e| panic!("{e}")),
        7,
    );
    drop((before_queue, before, after_queue, after, again));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

/// A configured PSK (SHA-384 retained-key hash) of 48 bytes of `seed`.
fn tls_key_48(seed: u8) -> ConfiguredPsk {
    let bytes: Vec<u8> = (0..48u8).map(|index| index.wrapping_mul(seed)).collect();
    ConfiguredPsk::new(PskHash::Sha384, &bytes).unwrap_or_else(|e| panic!("{e}"))
}

const NQN_384: &str = "nqn.2026-01.io.reflex:sha384";

#[test]
fn tls_48_byte_keys_get_aes_256_and_both_identity_forms_are_served() {
    let file = key_file(&tls_key(7));
    let mut server_config = tls_config(TlsMode::Optional, file.path());
    // Host A with a 48-byte key for its own subsystem (TLS_AES_256_GCM_SHA384).
    server_config.nvme_tcp.subsystems.push(NvmeSubsystemConfig {
        nqn: NQN_384.to_string(),
        namespaces: vec![1],
        allow_any_host: false,
        hosts: vec![host(HOST, Some(&tls_key_48(3)), None)],
        secure_channel: true,
    });
    let server = start(server_config);
    let cases = [
        // (subsystem, key, identity form, digests, cipher suite)
        (
            NQN_384,
            tls_key_48(3),
            IdentityForm::Version0,
            Digests::BOTH,
            "TLS_AES_256_GCM_SHA384",
        ),
        (
            NQN_384,
            tls_key_48(3),
            IdentityForm::Version1,
            Digests::NONE,
            "TLS_AES_256_GCM_SHA384",
        ),
        // A 32-byte key through the same callback still gets AES-128, in either form.
        (
            NQN,
            tls_key(3),
            IdentityForm::Version0,
            Digests::NONE,
            "TLS_AES_128_GCM_SHA256",
        ),
        (
            NQN,
            tls_key(3),
            IdentityForm::Version1,
            Digests::BOTH,
            "TLS_AES_128_GCM_SHA256",
        ),
    ];
    for (seed, (subsystem, key, form, digests, cipher)) in cases.into_iter().enumerate() {
        let what = format!("{subsystem} {form:?} {digests:?}");
        let options = NvmeTcpOptions::new(HOST, subsystem)
            .with_tls_psk(key)
            .with_tls_identity_form(form)
            .with_digests(digests);
        let mut controller = attach(&server, options, 1);
        assert_eq!(controller.identify().subsystem_nqn, subsystem, "{what}");
        let mut queue = controller
            .connect_io_queue()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(
            queue.tls_session(),
            Some(("TLSv1.3", cipher.to_string())),
            "{what}"
        );
        verified_io(&mut queue, seed as u8 + 20);
        controller
            .shutdown()
            .unwrap_or_else(|e| panic!("{what}: shutdown: {e}"));
    }
    // Refused in the handshake: a wrong 48-byte key (either form), and a 32-byte key offered
    // for the host and subsystem whose key is 48 bytes (identity NVMe0R01: the wrong hash).
    for (key, form, what) in [
        (tls_key_48(4), IdentityForm::Version0, "wrong 48-byte key"),
        (
            tls_key_48(4),
            IdentityForm::Version1,
            "wrong 48-byte key, TP 8018 identity (digest differs)",
        ),
        (
            tls_key(3),
            IdentityForm::Version0,
            "a 32-byte key for a 48-byte host",
        ),
    ] {
        assert_tls_refused(
            NvmeTcpController::attach(
                address(&server),
                NvmeTcpOptions::new(HOST, NQN_384)
                    .with_tls_psk(key)
                    .with_tls_identity_form(form),
                1,
            ),
            what,
        );
    }
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let sessions: u64 = stats.iter().map(|core| core.tls_sessions).sum();
    let failures: u64 = stats.iter().map(|core| core.tls_failures).sum();
    // Sessions started: four controllers of an admin and an I/O queue each, and the three
    // refused handshakes, which are the failures.
    assert_eq!((sessions, failures), (8 + 3, 3));
}

#[test]
fn tls_discovery_entries_say_where_tls_is_required() {
    use reflex_proto::nvme_tcp::admin::discovery::{
        SECTYPE_NONE, SECTYPE_TLS13, TREQ_NOT_REQUIRED, TREQ_REQUIRED,
    };
    let file = key_file(&tls_key(7));
    let server = start(tls_config(TlsMode::Optional, file.path()));
    let required = (TREQ_REQUIRED, SECTYPE_TLS13);
    let optional = (TREQ_NOT_REQUIRED, SECTYPE_NONE);
    // Host A has keys for NQN and NQN_SECURE; host C has none, and NQN_SECURE is TLS only.
    for (host_nqn, expected) in [
        (
            HOST,
            [
                (NQN, required),
                (NQN_OPEN, optional),
                (NQN_SECURE, required),
            ],
        ),
        (
            HOST_C,
            [
                (NQN, optional),
                (NQN_OPEN, optional),
                (NQN_SECURE, required),
            ],
        ),
    ] {
        let entries = discovery_log(&server, host_nqn, 4);
        let got: Vec<(String, (u8, u8))> = entries
            .iter()
            .map(|entry| {
                (
                    entry.subsystem_nqn.clone(),
                    (entry.transport_requirements, entry.tcp_security_type),
                )
            })
            .collect();
        let expected: Vec<(String, (u8, u8))> = expected
            .iter()
            .map(|(nqn, pair)| (nqn.to_string(), *pair))
            .collect();
        assert_eq!(got, expected, "{host_nqn}");
    }
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

/// The discovery log over `controller` (a discovery controller), `entries_max` at most.
fn read_discovery_log(
    controller: &mut NvmeTcpController,
    entries_max: usize,
) -> Vec<reflex_proto::nvme_tcp::admin::DiscoveryEntry> {
    use reflex_proto::nvme_tcp::admin::{decode_discovery_log, discovery_log_size};
    use reflex_proto::nvme_tcp::command::log_page;
    let data = controller
        .log_page(log_page::DISCOVERY, discovery_log_size(entries_max), false)
        .unwrap_or_else(|e| panic!("discovery log: {e}"));
    decode_discovery_log(&data)
}

#[test]
fn tls_on_the_discovery_subsystem() {
    use reflex_proto::nvme_tcp::command::DISCOVERY_NQN;
    let file = key_file(&tls_key(7));
    // Host A has a discovery key (inline), host B one in a file; host C has none.
    let discovery_file = key_file(&tls_key(13));
    let mut server_config = tls_config(TlsMode::Optional, file.path());
    server_config.nvme_tcp.discovery.hosts = vec![
        host(DISCOVERY_HOST_A, Some(&tls_key(11)), None),
        host(
            HOST_B,
            None,
            Some(discovery_file.path().display().to_string()),
        ),
    ];
    let server = start(server_config);
    for (host_nqn, key) in [(DISCOVERY_HOST_A, 11), (HOST_B, 13)] {
        for digests in [Digests::NONE, Digests::BOTH] {
            let options = NvmeTcpOptions::new(host_nqn, DISCOVERY_NQN)
                .with_tls_psk(tls_key(key))
                .with_digests(digests);
            let mut controller = attach(&server, options, 0);
            assert_eq!(
                controller.identify().controller_type,
                ControllerType::Discovery
            );
            assert_eq!(
                controller.admin().tls_session(),
                Some(("TLSv1.3", "TLS_AES_128_GCM_SHA256".to_string()))
            );
            let entries = read_discovery_log(&mut controller, 4);
            let names: Vec<&str> = entries.iter().map(|e| e.subsystem_nqn.as_str()).collect();
            assert_eq!(names, vec![NQN, NQN_OPEN, NQN_SECURE], "{host_nqn}");
        }
    }
    // The newer identity form reaches discovery too.
    let mut version1 = attach(
        &server,
        NvmeTcpOptions::new(DISCOVERY_HOST_A, DISCOVERY_NQN)
            .with_tls_psk(tls_key(11))
            .with_tls_identity_form(IdentityForm::Version1),
        0,
    );
    assert_eq!(read_discovery_log(&mut version1, 4).len(), 3);
    // A keyed host in plaintext is refused at Connect; a host without a key is served.
    assert_eq!(
        status_of(NvmeTcpController::attach(
            address(&server),
            NvmeTcpOptions::new(DISCOVERY_HOST_A, DISCOVERY_NQN),
            0
        )),
        Status::CONNECT_INVALID_HOST
    );
    let mut plain = attach(&server, NvmeTcpOptions::new(HOST_C, DISCOVERY_NQN), 0);
    assert_eq!(plain.admin().tls_session(), None);
    assert_eq!(read_discovery_log(&mut plain, 4).len(), 3);
    // A wrong key, and a host without a discovery key: the handshake fails.
    assert_tls_refused(
        NvmeTcpController::attach(
            address(&server),
            NvmeTcpOptions::new(DISCOVERY_HOST_A, DISCOVERY_NQN).with_tls_psk(tls_key(12)),
            0,
        ),
        "wrong discovery key",
    );
    assert_tls_refused(
        NvmeTcpController::attach(
            address(&server),
            NvmeTcpOptions::new(HOST_C, DISCOVERY_NQN).with_tls_psk(tls_key(11)),
            0,
        ),
        "no discovery key",
    );
    // Host A's subsystem key (for NQN) does not open discovery: the identity names NQN.
    let mut subsystem_identity = NvmeTcpOptions::new(HOST, DISCOVERY_NQN).with_tls_psk(tls_key(3));
    if let Some(tls) = subsystem_identity.tls.as_mut() {
        tls.subsystem_nqn = NQN.to_string();
    }
    assert_eq!(
        status_of(NvmeTcpController::attach(
            address(&server),
            subsystem_identity,
            0
        )),
        Status::CONNECT_INVALID_HOST
    );
    drop((version1, plain));
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    let failures: u64 = stats.iter().map(|core| core.tls_failures).sum();
    assert_eq!(failures, 2);
}

#[test]
fn a_discovery_secure_channel_refuses_every_plaintext_host() {
    use reflex_proto::nvme_tcp::command::DISCOVERY_NQN;
    let file = key_file(&tls_key(7));
    let mut server_config = tls_config(TlsMode::Optional, file.path());
    server_config.nvme_tcp.discovery.secure_channel = true;
    server_config.nvme_tcp.discovery.hosts = vec![host(HOST_C, Some(&tls_key(17)), None)];
    let server = start(server_config);
    for host_nqn in [HOST, HOST_C] {
        assert_eq!(
            status_of(NvmeTcpController::attach(
                address(&server),
                NvmeTcpOptions::new(host_nqn, DISCOVERY_NQN),
                0
            )),
            Status::CONNECT_INVALID_HOST,
            "{host_nqn} in plaintext"
        );
    }
    let mut controller = attach(
        &server,
        NvmeTcpOptions::new(HOST_C, DISCOVERY_NQN).with_tls_psk(tls_key(17)),
        0,
    );
    // Host C has no subsystem key: its entries name no security, except the secure subsystem.
    let entries = read_discovery_log(&mut controller, 4);
    assert_eq!(entries.len(), 3);
    // Plaintext I/O subsystems are not affected by discovery's secure channel.
    let mut io = attach(&server, NvmeTcpOptions::new(HOST_C, NQN_OPEN), 1);
    io.keep_alive().unwrap_or_else(|e| panic!("{e}"));
    drop((controller, io));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

// ---- Asynchronous events ----

/// A host of its own, so that the discovery tests' keys stay apart from the TLS tests'.
const DISCOVERY_HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:discovery-host-a";
const NQN_ONE: &str = "nqn.2026-01.io.reflex:one";

/// Sends an Asynchronous Event Request and waits until the target holds it: commands of a
/// queue are taken in order, so the Keep Alive's completion means the request was seen.
fn hold_async_event_request(controller: &mut NvmeTcpController) -> u16 {
    let cid = controller
        .async_event_request()
        .unwrap_or_else(|e| panic!("{e}"));
    controller
        .keep_alive()
        .unwrap_or_else(|e| panic!("keep alive after the request: {e}"));
    cid
}

/// Enables namespace attribute notices (Asynchronous Event Configuration bit 8).
fn enable_namespace_notices(controller: &mut NvmeTcpController) {
    use reflex_proto::nvme_tcp::command::feature;
    controller
        .admin()
        .execute(
            reflex_client::nvme_tcp::set_features(feature::ASYNC_EVENT_CONFIGURATION, 1 << 8),
            Transfer::None,
        )
        .unwrap_or_else(|e| panic!("set async event configuration: {e}"));
}

#[test]
fn a_removed_namespace_raises_the_namespace_attribute_changed_event() {
    /// Notice (2h), Namespace Attribute Changed (00h), log page 04h.
    const EVENT_DW0: u32 = 0x0004_0002;
    let mut server_config = nvme_config(vec![
        namespace(1, "mem:16M", None),
        namespace(2, "mem:16M", None),
        namespace(3, "mem:16M", None),
    ]);
    let subsystem = |nqn: &str, namespaces: Vec<u32>| NvmeSubsystemConfig {
        nqn: nqn.to_string(),
        namespaces,
        allow_any_host: true,
        hosts: Vec::new(),
        secure_channel: false,
    };
    server_config.nvme_tcp.subsystems =
        vec![subsystem(NQN, vec![1, 2, 3]), subsystem(NQN_ONE, vec![1])];
    server_config.admin = reflex_server::admin::AdminConfig::loopback();
    let server = start(server_config);
    let api = admin_common::Api::new(
        server
            .admin_addr()
            .unwrap_or_else(|| panic!("no admin listener")),
    );
    let options = NvmeTcpOptions::new(HOST, NQN);
    // A: notices on, a request outstanding. B: notices on, no request yet. C: notices off,
    // a request outstanding. D: another subsystem, without namespace 2.
    let mut a = attach(&server, options.clone(), 1);
    let mut b = attach(&server, NvmeTcpOptions::new(HOST_B, NQN), 1);
    let mut c = attach(&server, NvmeTcpOptions::new(HOST_C, NQN), 1);
    let mut d = attach(&server, NvmeTcpOptions::new(HOST, NQN_ONE), 1);
    assert_eq!(
        a.identify().oaes & (1 << 8),
        1 << 8,
        "OAES: notices supported"
    );
    for controller in [&mut a, &mut b, &mut d] {
        enable_namespace_notices(controller);
    }
    let a_cid = hold_async_event_request(&mut a);
    let c_cid = hold_async_event_request(&mut c);
    let d_cid = hold_async_event_request(&mut d);

    // Removed through the admin API, as an operator would.
    let removed = api.delete("/v1/namespaces/2?force=true");
    assert_eq!(removed.status, 204, "{}", removed.text);
    let event = a
        .admin()
        .wait_completion(a_cid)
        .unwrap_or_else(|e| panic!("A's event: {e}"));
    assert_eq!(event.dw0, EVENT_DW0);
    assert_eq!(
        a.changed_namespaces().unwrap_or_else(|e| panic!("{e}")),
        vec![2]
    );
    assert_eq!(
        a.changed_namespaces().unwrap_or_else(|e| panic!("{e}")),
        Vec::<u32>::new(),
        "cleared on read"
    );
    assert_eq!(
        a.active_namespaces().unwrap_or_else(|e| panic!("{e}")),
        vec![1, 3]
    );
    // B's event waited for its request.
    let b_cid = b.async_event_request().unwrap_or_else(|e| panic!("{e}"));
    let event = b
        .admin()
        .wait_completion(b_cid)
        .unwrap_or_else(|e| panic!("B's event: {e}"));
    assert_eq!(event.dw0, EVENT_DW0);
    // C has notices off: the list is kept, but no event went out (it would have come before
    // the log page's data, on the same connection, and broken this read).
    assert_eq!(
        c.changed_namespaces().unwrap_or_else(|e| panic!("{e}")),
        vec![2]
    );
    // D's subsystem never exposed namespace 2.
    assert_eq!(
        d.changed_namespaces().unwrap_or_else(|e| panic!("{e}")),
        Vec::<u32>::new()
    );
    d.keep_alive().unwrap_or_else(|e| panic!("{e}"));

    // A read the log (RAE clear), so the next removal raises the event again; B did not,
    // so its event stays masked: B's list grows without an event.
    let a_cid = hold_async_event_request(&mut a);
    let b_cid = hold_async_event_request(&mut b);
    server
        .namespace_manager()
        .remove(3, true)
        .unwrap_or_else(|e| panic!("remove: {e}"));
    let event = a
        .admin()
        .wait_completion(a_cid)
        .unwrap_or_else(|e| panic!("A's second event: {e}"));
    assert_eq!(event.dw0, EVENT_DW0);
    assert_eq!(
        a.changed_namespaces().unwrap_or_else(|e| panic!("{e}")),
        vec![3]
    );
    assert_eq!(
        b.changed_namespaces().unwrap_or_else(|e| panic!("{e}")),
        vec![2, 3]
    );
    // Held requests still count: C and D each hold one, B one more; the limit is 4.
    let _ = (b_cid, c_cid, d_cid);
    b.keep_alive().unwrap_or_else(|e| panic!("{e}"));
    c.keep_alive().unwrap_or_else(|e| panic!("{e}"));
    drop((a, b, c, d));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_namespace_event_reaches_a_controller_over_tls() {
    let file = key_file(&tls_key(7));
    let server = start(tls_config(TlsMode::Optional, file.path()));
    let mut controller = attach(
        &server,
        NvmeTcpOptions::new(HOST, NQN)
            .with_tls_psk(tls_key(3))
            .with_digests(Digests::BOTH),
        1,
    );
    enable_namespace_notices(&mut controller);
    let cid = hold_async_event_request(&mut controller);
    server
        .namespace_manager()
        .remove(1, true)
        .unwrap_or_else(|e| panic!("remove: {e}"));
    let event = controller
        .admin()
        .wait_completion(cid)
        .unwrap_or_else(|e| panic!("event over TLS: {e}"));
    assert_eq!(event.dw0, 0x0004_0002);
    assert_eq!(
        controller
            .changed_namespaces()
            .unwrap_or_else(|e| panic!("{e}")),
        vec![1]
    );
    assert_eq!(
        controller
            .active_namespaces()
            .unwrap_or_else(|e| panic!("{e}")),
        Vec::<u32>::new()
    );
    drop(controller);
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn discovery_keys_reload_from_their_files() {
    use reflex_proto::nvme_tcp::command::DISCOVERY_NQN;
    let file = key_file(&tls_key(7));
    let discovery_file = key_file(&tls_key(13));
    let mut server_config = tls_config(TlsMode::Optional, file.path());
    server_config.nvme_tcp.discovery.hosts = vec![host(
        HOST_C,
        None,
        Some(discovery_file.path().display().to_string()),
    )];
    let server = start(server_config.clone());
    let options = |key: u8| NvmeTcpOptions::new(HOST_C, DISCOVERY_NQN).with_tls_psk(tls_key(key));
    let mut before = attach(&server, options(13), 0);
    std::fs::write(discovery_file.path(), tls_key(19).to_interchange())
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        server
            .reload_tls(&server_config)
            .unwrap_or_else(|e| panic!("reload: {e}"))
    );
    assert_tls_refused(
        NvmeTcpController::attach(address(&server), options(13), 0),
        "the replaced discovery key",
    );
    let mut after = attach(&server, options(19), 0);
    assert_eq!(read_discovery_log(&mut after, 4).len(), 3);
    // The session that started with the old key goes on.
    assert_eq!(read_discovery_log(&mut before, 4).len(), 3);
    drop((before, after));
    server.shutdown().unwrap_or_else(|e| panic!("{e}"));
}
