//! Operation scripts against the whole server: arbitrary bytes decode into a bounded list of
//! client actions ([`Step`]) that run against a [`VirtualServer`] (the real dataplane threads
//! and control plane over the in-memory network, with a memory device, a model device that
//! completes asynchronously and a read-only one), followed by a graceful shutdown; invariants
//! are checked along the way and at the end ([`run`]).
//!
//! Why a hand-written decoder and not `arbitrary`: every step has a fixed layout of raw
//! selector bytes that [`Script::encode`] writes back, so seeds and regression inputs can be
//! built as readable [`Step`] lists, and a crash input prints as one (`Script::decode` +
//! `Debug`). Structured steps emit valid protocol units (native, original and NBD request
//! headers, NBD handshake options) whose fields come from small tables of interesting values
//! and, for some selector values, raw bytes: the fuzzer gets past the headers at once and
//! still reaches the validation edges.
//!
//! Layout: five configuration bytes ([`Config`]), then steps, each a tag byte (`% 17`) and
//! that step's fixed number of bytes (a [`Step::Raw`] also its bytes). Missing bytes at the
//! end read as zero. At most [`STEPS_MAX`] steps are decoded.
//!
//! Two modes ([`Mode`]): `Any` runs the steps as written (the `dataplane` target);
//! `WellFormed` turns them into a well-formed client's actions and additionally checks that
//! every request is answered exactly once (the `dataplane_protocol` target).
//!
//! What a run checks (a violation panics, which is the finding):
//! - nothing in the server panics (the dataplane's own assertions included);
//! - after every step, each thread's requests per state add up to its request slots, and no
//!   thread waits with nothing to do and a deadline already passed (its driver would spin);
//! - every byte a native or original-protocol client receives parses as a stream of valid
//!   response headers and their payloads (a truncated tail is allowed: the server may abort a
//!   connection mid-send); every byte an NVMe/TCP host receives parses as controller PDUs
//!   (ICResp once, with the digests asked for; CapsuleResp, C2HData, R2T, C2HTermReq) with
//!   correct header and data digests, and nothing follows a C2HTermReq;
//! - no accepted connection gets a slot whose previous connection's close the driver has not
//!   taken yet (reflexd's io_uring driver asserts on it);
//! - after the script, a graceful shutdown (devices still stalled stay stalled) finishes
//!   within [`SHUTDOWN_TIME_MAX`] of virtual time, and no instant of it leaves a thread with
//!   nothing to do and a deadline already passed (a driver would spin); then every request
//!   slot is free, or orphaned on a stalled device, device operations were abandoned only on
//!   stalled devices, every socket is closed by the server with no receive or send in flight,
//!   and no tenant still counts a connection.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, OnceLock};

use reflex_dataplane::control::{ControlSetup, HandleKeys, NamespaceControl, TenantLimits};
use reflex_dataplane::{Limits, REQUEST_STATE_COUNT, RequestState};
use std::num::NonZeroU64;

use reflex_dataplane::frontend::nvme_tcp_targets::NvmeTcpOptions;
use reflex_flash::Device;
use reflex_flash::fault::{Delay, DelayPick, FaultControls, FaultDevice, FaultPlan, LbaRange};
use reflex_flash::mem::MemDevice;
use reflex_proto::nvme_tcp::command::{
    self as nvme_command, admin_opcode, cns, fctype, feature, io_opcode, log_page, property, sgl,
};
use reflex_proto::nvme_tcp::pdu::{self as nvme_pdu, DataHeader, Digests, Framing, Pdu, PduType};
use reflex_proto::nvme_tcp::{Command as NvmeCommand, Completion as NvmeCompletion};
use reflex_proto::{kv, native, nbd, original};
use reflex_qos::{DeviceProfile, Nanos, QosConfig, TenantSpec};
use reflex_sim::{
    EmuSimDevice, FixedDevice, ModelFlash, NetworkModel, NvmeTcpListener, SocketId, TlsServer,
    VirtualExport, VirtualListener, VirtualServer, VirtualServerError, VirtualServerSetup,
};

/// Steps decoded from one input at most.
pub const STEPS_MAX: usize = 256;
/// Client connections one script opens at most.
pub const SOCKETS_MAX: usize = 8;
/// Bytes of one request's payload a client actually sends (longer payloads are cut short, and
/// the request waits for the rest until it times out or the connection closes).
pub const PAYLOAD_BYTES_MAX: usize = 64 << 10;
/// Bytes all clients of one script send at most; sends beyond it are dropped.
pub const SEND_BYTES_MAX: usize = 512 << 10;
/// Instants one [`Step::Advance`] steps through before it jumps to its target time.
pub const INSTANTS_PER_ADVANCE_MAX: usize = 512;
/// Instants the whole script steps through; later advances only jump.
pub const INSTANTS_MAX: usize = 8_192;
/// How long the final graceful shutdown may take in virtual time: after [`DRAIN_TIMEOUT`] the
/// requests still waiting in a scheduler are refused and connections aborted, one drain
/// timeout later device operations are abandoned, and the flushes get one more.
pub const SHUTDOWN_TIME_MAX: Nanos = Nanos(3 * DRAIN_TIMEOUT.0);
/// Instants the final shutdown may take (a bound on a livelock at one virtual time).
pub const SHUTDOWN_INSTANTS_MAX: usize = 200_000;
/// The drain timeout of every run: short, so that aborting a drain is exercised.
pub const DRAIN_TIMEOUT: Nanos = Nanos(1_000_000_000);

/// The seed of the tenant handles: handle selector `n` names the `n`th tenant registered
/// ([`tenant_handle`]).
pub const HANDLE_SEED: u64 = 1;

/// The handle a selector names: 0 is "no tenant", `n` the `n`th tenant registered (the
/// configured ones first, then each namespace's default, then those registered over the wire).
pub fn tenant_handle(selector: u8) -> u64 {
    match selector {
        0 => 0,
        n => HandleKeys::seeded_candidate(HANDLE_SEED, u64::from(n)),
    }
}

/// Bytes of the configuration prefix.
pub const CONFIG_BYTES: usize = 5;

/// The namespaces every run serves, by index: a memory device with a QoS profile and two
/// configured tenants, a model device (emulated Flash or fixed latency) without a profile,
/// a small read-only memory device, and the key-value table's memory device, whose fault
/// wrapper delays every operation ([`KV_DELAY`]) so that it completes asynchronously (the
/// model device would too, but it keeps no data, and the table must read back what it wrote).
/// Id 5: the native requests' namespace selector names ids 1–3, 0, 4 and `u32::MAX`, so only
/// the KV port reaches the table.
pub const NAMESPACE_IDS: [u32; 4] = [1, 2, 3, 5];
const MEM_BYTES: u64 = 1 << 20;
const MODEL_BYTES: u64 = 8 << 20;
const READ_ONLY_BYTES: u64 = 256 << 10;
/// The key-value table's device: 256 blocks, 4 buckets of 15 slots and room for about 14
/// largest values, so that `TABLE_FULL` is reachable.
const KV_BYTES: u64 = 1 << 20;
/// The namespace index of the key-value table.
pub const KV_NAMESPACE_INDEX: u16 = 3;
/// The completion delay the KV device's fault wrapper starts with (a `Fault` step that clears
/// the plan makes it synchronous).
pub const KV_DELAY: Nanos = Nanos(20_000);

/// The composite namespace's id when the configuration asks for one (the native requests'
/// namespace selector 4 and NVMe/TCP NSID 4 name it; without it, nothing does), and its two
/// members' (each a memory device of [`MEMBER_BYTES`] behind its own fault wrapper).
pub const COMPOSITE_ID: u32 = 4;
pub const MEMBER_IDS: [u32; 2] = [6, 7];
const MEMBER_BYTES: u64 = 512 << 10;
/// The composite namespace's slot: after the four namespaces and the two members.
pub const COMPOSITE_INDEX: u16 = 6;

/// The NVMe/TCP listener's index and its subsystem, which serves namespaces 1, 2, 3 (read
/// only) and the composite namespace when there is one, by their ids as NSIDs.
pub const NVME_LISTENER: usize = 7;
pub const NVME_NQN: &str = "nqn.2026-01.io.reflex:fuzz";
/// Host NQNs by selector: allowed and charged to `lc` (namespace 1's tenant), allowed with
/// each namespace's default tenant, not allowed (the subsystem lists its hosts).
pub const NVME_HOSTS: [&str; 3] = [
    "nqn.2014-08.org.nvmexpress:uuid:fuzz-lc",
    "nqn.2014-08.org.nvmexpress:uuid:fuzz-be",
    "nqn.2014-08.org.nvmexpress:uuid:stranger",
];

/// The listeners of every thread, by index.
pub fn listeners(setup: &Setup) -> Vec<VirtualListener> {
    let mut nvme_namespaces = vec![0, 1, 2];
    if setup.composite.is_some() {
        nvme_namespaces.push(COMPOSITE_INDEX);
    }
    vec![
        VirtualListener::Native,
        VirtualListener::Original {
            namespace_index: 0,
            tenant: None,
        },
        VirtualListener::Nbd,
        VirtualListener::Original {
            namespace_index: 1,
            tenant: None,
        },
        VirtualListener::Original {
            namespace_index: 0,
            tenant: Some("be".into()),
        },
        VirtualListener::NativeTls(TlsServer(
            Arc::clone(&tls_configs().0),
            Some(Arc::clone(psk_keys())),
        )),
        // Thread 0 only, as in reflexd.
        VirtualListener::Kv {
            namespace_index: KV_NAMESPACE_INDEX,
            tenant: None,
        },
        VirtualListener::NvmeTcp(NvmeTcpListener {
            subsystem_nqn: NVME_NQN.into(),
            namespace_indices: nvme_namespaces,
            allow_any_host: false,
            hosts: vec![
                (NVME_HOSTS[0].into(), Some("lc".into())),
                (NVME_HOSTS[1].into(), None),
            ],
            options: setup.nvme_options.clone(),
        }),
    ]
}

/// The TLS listener's server configuration and its clients' (the simulator tests'
/// certificates, valid until 2126), made once per process.
fn tls_configs() -> &'static (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    static CONFIGS: OnceLock<(Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>)> =
        OnceLock::new();
    CONFIGS.get_or_init(|| {
        let pem = |bytes: &[u8]| CertificateDer::from_pem_slice(bytes).expect("test certificate");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![pem(include_bytes!(
                    "../../crates/sim/tests/data/tls-server-cert.pem"
                ))],
                PrivateKeyDer::from_pem_slice(include_bytes!(
                    "../../crates/sim/tests/data/tls-server-key.pem"
                ))
                .expect("test key"),
            )
            .expect("test certificate and key");
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(pem(include_bytes!(
                "../../crates/sim/tests/data/tls-ca.pem"
            )))
            .expect("test CA");
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        (Arc::new(server), Arc::new(client))
    })
}

/// The identity and key of the TLS listener's pre-shared-key clients.
const PSK_IDENTITY: &str = "psk-client";
const PSK_KEY: [u8; 32] = [0x42; 32];

/// The TLS listener's pre-shared keys, made once per process.
fn psk_keys() -> &'static Arc<reflex_dataplane::PskKeys> {
    static KEYS: OnceLock<Arc<reflex_dataplane::PskKeys>> = OnceLock::new();
    KEYS.get_or_init(|| {
        let keys = std::collections::HashMap::from([(PSK_IDENTITY.to_string(), PSK_KEY.to_vec())]);
        Arc::new(reflex_dataplane::PskKeys::new(keys).expect("PSK keys"))
    })
}

/// A client of the TLS listener: a certificate session (rustls), or with `psk` one with the
/// pre-shared key (OpenSSL over a memory pipe), which the server's other TLS stack serves.
fn tls_client(psk: bool) -> ClientTls {
    if psk {
        use openssl::ssl::{Ssl, SslContext, SslMethod, SslStream, SslVerifyMode, SslVersion};
        static CONTEXT: OnceLock<SslContext> = OnceLock::new();
        let context = CONTEXT.get_or_init(|| {
            let mut builder = SslContext::builder(SslMethod::tls_client()).expect("OpenSSL");
            builder
                .set_min_proto_version(Some(SslVersion::TLS1_3))
                .expect("TLS 1.3");
            builder.set_verify(SslVerifyMode::NONE);
            builder.set_psk_client_callback(|_, _, identity_out, key_out| {
                identity_out[..PSK_IDENTITY.len()].copy_from_slice(PSK_IDENTITY.as_bytes());
                identity_out[PSK_IDENTITY.len()] = 0;
                key_out[..PSK_KEY.len()].copy_from_slice(&PSK_KEY);
                Ok(PSK_KEY.len())
            });
            builder.build()
        });
        let mut ssl = Ssl::new(context).expect("OpenSSL session");
        ssl.set_connect_state();
        let stream = SslStream::new(ssl, reflex_proto::memory_pipe::MemoryPipe::default())
            .expect("OpenSSL stream");
        return ClientTls::Psk(Box::new(stream), Vec::new());
    }
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("server name");
    let mut session = rustls::ClientConnection::new(Arc::clone(&tls_configs().1), name)
        .expect("TLS client session");
    session.set_buffer_limit(None);
    ClientTls::Rustls(Box::new(session))
}

/// A TLS client's session.
enum ClientTls {
    Rustls(Box<rustls::ClientConnection>),
    /// With the plaintext written before the handshake finished (sent once it has, as rustls
    /// does on its own).
    Psk(
        Box<openssl::ssl::SslStream<reflex_proto::memory_pipe::MemoryPipe>>,
        Vec<u8>,
    ),
}

impl ClientTls {
    /// Encrypts `bytes` (none: just advance the handshake) and returns what goes to the
    /// socket.
    fn encrypt(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut ciphertext = Vec::new();
        match self {
            ClientTls::Rustls(tls) => {
                if !bytes.is_empty() {
                    std::io::Write::write_all(&mut tls.writer(), bytes).expect("TLS plaintext");
                }
                while tls.wants_write() {
                    if tls.write_tls(&mut ciphertext).is_err() {
                        break;
                    }
                }
            }
            ClientTls::Psk(tls, pending) => {
                pending.extend_from_slice(bytes);
                if !tls.ssl().is_init_finished() {
                    let _ = tls.do_handshake();
                }
                // Until the handshake is done the plaintext waits (and forever if the
                // session broke).
                while tls.ssl().is_init_finished() && !pending.is_empty() {
                    match tls.ssl_write(pending) {
                        Ok(n) => {
                            pending.drain(..n);
                        }
                        Err(_) => break,
                    }
                }
                tls.get_mut().take_output(&mut ciphertext);
            }
        }
        ciphertext
    }

    /// The plaintext inside `received` (a session the server broke yields nothing more).
    fn decrypt(&mut self, received: &[u8]) -> Vec<u8> {
        let mut plaintext = Vec::new();
        match self {
            ClientTls::Rustls(tls) => {
                let mut offered = received;
                while !offered.is_empty() {
                    if tls.read_tls(&mut offered).is_err() || tls.process_new_packets().is_err() {
                        break;
                    }
                    // Taken at once: rustls holds little decrypted data.
                    let _ = std::io::Read::read_to_end(&mut tls.reader(), &mut plaintext);
                }
            }
            ClientTls::Psk(tls, _) => {
                tls.get_mut().push_input(received);
                let mut space = [0u8; 16 * 1024];
                while let Ok(n) = tls.ssl_read(&mut space) {
                    plaintext.extend_from_slice(&space[..n]);
                }
            }
        }
        plaintext
    }
}

/// NBD export names, by selector (the last two do not exist; the empty name is the default).
const EXPORT_NAMES: [&str; 6] = ["ns1", "ns2", "ro", "ns1-ro", "", "nope"];

fn exports() -> Vec<VirtualExport> {
    let export =
        |name: &str, namespace_index: u16, read_only: bool, tenant: Option<&str>| VirtualExport {
            name: name.into(),
            namespace_index,
            read_only,
            tenant: tenant.map(String::from),
        };
    vec![
        export("ns1", 0, false, Some("lc")),
        export("ns2", 1, false, None),
        export("ro", 2, false, None),
        export("ns1-ro", 0, true, None),
    ]
}

// ---------------------------------------------------------------------------------------------
// Configuration.

/// The configuration bytes, raw; [`Config::decoded`] interprets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Config(pub [u8; CONFIG_BYTES]);

/// What the configuration bytes choose.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    pub threads: u16,
    pub network: NetworkModel,
    pub limits: Limits,
    pub qos_enabled: bool,
    pub tenant_queue_depth_max: u32,
    pub thread_queued_requests_max: u32,
    pub tenants_max: u32,
    /// The second namespace's model: the emulated Flash device, or fixed latency.
    pub emulated: bool,
    /// Operations the fixed-latency model holds; beyond them it refuses with EAGAIN (4 in
    /// [`Mode::Any`]: a device that reports being full; [`Mode::WellFormed`] raises it so
    /// that no error closes an original-protocol connection).
    pub model_queue_depth: usize,
    /// The fairness stage in front of the device (fair share, 2 best-effort requests at the
    /// device per thread, at most 8 held), so that requests wait in it.
    pub fairness: bool,
    /// A composite namespace ([`COMPOSITE_ID`]) over the two members: its spec text.
    pub composite: Option<&'static str>,
    /// Inter-core migration of reads between the two threads (the fairness stage in `fifo`
    /// with migration of every flow, no imbalance gate, 4 reads in transit per pair).
    pub migration: bool,
    /// The NVMe/TCP transport's settings (keep-alive minimum, R2T timeout).
    pub nvme_options: NvmeTcpOptions,
}

impl Config {
    /// Bits, from bit 0: byte 0: two threads, 20 µs network latency, 1 GB/s links, a
    /// fixed-latency model instead of the emulated device, at most two connections per source
    /// address, one connection reserved per other listener, connections per thread (2 bits: 3,
    /// 1, 2, 4). Byte 1: the handshake (500 ms), idle (700 ms), receive (300 ms), send
    /// (300 ms) and device (1 ms) timeouts, a 2 MiB arena instead of 1 MiB, the window (2
    /// bits: 4, 1, 2, 8). Byte 2: request slots beyond the window (2 bits: 0, 2, 8, 24), a
    /// connection's share of the arena (2 bits: 100, 50, 25, 10 %), device operations in
    /// flight per thread (2 bits: 1024, 1, 2, 8), QoS off, parking idle connections after
    /// 50 ms. Byte 3: the client's
    /// socket buffer (2 bits: 64 KiB, 4 KiB, 16 KiB, 1 MiB), the tenant queue depth (2 bits:
    /// 1024, 1, 2, 4), requests queued in a thread's schedulers (2 bits: 64, 2, 8, 32), tenants
    /// per namespace (16, 4), the fairness stage on. All zero is a plain single-thread server
    /// without timeouts. (The QoS tables are small so that a run starts quickly.) Byte 4:
    /// a composite namespace over the two members (2 bits: none, `stripe:4K`, `concat`,
    /// `stripe:64K`), inter-core migration (two threads whatever byte 0 says), NVMe/TCP's
    /// keep-alive minimum 100 ms instead of 1 s, its R2T timeout 300 ms instead of 30 s.
    pub fn decoded(&self) -> Setup {
        let [a, b, c, d, e] = self.0;
        let bit = |byte: u8, index: u8| byte >> index & 1 == 1;
        let two = |byte: u8, index: u8| usize::from(byte >> index & 3);
        let short = |on: bool, ms: u64| on.then_some(Nanos::from_millis(ms));
        let window = [4, 1, 2, 8][two(b, 6)];
        let arena_bytes = if bit(b, 5) { 2 << 20 } else { 1 << 20 };
        let connection_percent = [100, 50, 25, 10][two(c, 2)];
        let (connection_pages_max, arena_reserve_pages, connection_pages_share) =
            Limits::shares_for_arena(arena_bytes, connection_percent);
        let limits = Limits {
            window,
            requests_max: window + [0, 2, 8, 24][two(c, 0)],
            connections_max: [3, 1, 2, 4][two(a, 6)],
            connections_reserved_per_listener: u32::from(bit(a, 5)),
            connections_per_source_max: bit(a, 4).then_some(2),
            recv_buffer_bytes: 16 << 10,
            arena_bytes,
            connection_pages_max,
            arena_reserve_pages,
            connection_pages_share,
            handshake_timeout: short(bit(b, 0), 500),
            idle_timeout: short(bit(b, 1), 700),
            receive_timeout: short(bit(b, 2), 300),
            send_timeout: short(bit(b, 3), 300),
            device_timeout: short(bit(b, 4), 1),
            drain_timeout: DRAIN_TIMEOUT,
            device_in_flight_max: [1024, 1, 2, 8][two(c, 4)],
            park_after: short(bit(c, 7), 50),
        };
        let migration = bit(e, 2);
        Setup {
            threads: if bit(a, 0) || migration { 2 } else { 1 },
            network: NetworkModel {
                latency: if bit(a, 1) {
                    Nanos(20_000)
                } else {
                    Nanos::ZERO
                },
                bytes_per_sec: if bit(a, 2) { 1_000_000_000 } else { 0 },
                client_buffer_bytes: [64 << 10, 4 << 10, 16 << 10, 1 << 20][two(d, 0)],
            },
            limits,
            qos_enabled: !bit(c, 6),
            tenant_queue_depth_max: [1024, 1, 2, 4][two(d, 2)],
            thread_queued_requests_max: [64, 2, 8, 32][two(d, 4)],
            tenants_max: if bit(d, 6) { 4 } else { 16 },
            emulated: !bit(a, 3),
            model_queue_depth: 4,
            fairness: bit(d, 7),
            composite: [
                None,
                Some("stripe:4K:6,7"),
                Some("concat:6,7"),
                Some("stripe:64K:6,7"),
            ][two(e, 0)],
            migration,
            nvme_options: NvmeTcpOptions {
                keep_alive_timeout_min: Nanos::from_millis(if bit(e, 3) { 100 } else { 1_000 }),
                r2t_timeout: Nanos::from_millis(if bit(e, 4) { 300 } else { 30_000 }),
                ..NvmeTcpOptions::default()
            },
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Steps.

/// One client action. Fields are raw selector bytes, interpreted when the step runs (the
/// comments say how); `socket` picks among the connections opened so far (modulo their
/// count), `thread` and `listener` modulo theirs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Connect to `listener` of `thread` from a source address (`source % 4`: none, two IPv4
    /// addresses, ::1).
    Connect {
        thread: u8,
        listener: u8,
        source: u8,
    },
    /// Send these bytes (at most 255).
    Raw { socket: u8, bytes: Vec<u8> },
    /// A native request header: `opcode` (< 0xf0: HELLO, READ, WRITE, FLUSH, TRIM, REGISTER,
    /// UNREGISTER, BIND, RENEGOTIATE by `% 9`; 0xf0: REPORT; otherwise that raw unknown
    /// opcode), `flags`
    /// (bit 0 FUA, 1 an unknown flag, 2 a wrong version, bits 3–4 [`payload_mode`]),
    /// `namespace` (`% 6`: ids 1, 2, 3, 0, 4, u32::MAX), `offset` ([`offset_bytes`]),
    /// `length` ([`length_bytes`]; 0 gives a control request its proper body length), and
    /// `body`, the HELLO, REGISTER, handle or REPORT body's fields ([`native_body`]). Its payload
    /// follows as `flags` says.
    Native {
        socket: u8,
        opcode: u8,
        flags: u8,
        id: u8,
        namespace: u8,
        offset: u16,
        length: u8,
        body: [u8; 4],
    },
    /// An original-protocol header: `opcode % 4` READ, WRITE, an unknown opcode, a bad magic;
    /// `lba` in sectors; `count` ([`sector_count`]); a WRITE's payload as `payload` says.
    Original {
        socket: u8,
        opcode: u8,
        handle: u8,
        lba: u16,
        count: u8,
        payload: u8,
    },
    /// The NBD client flags (`% 4`: FIXED_NEWSTYLE | NO_ZEROES, FIXED_NEWSTYLE, none, all).
    NbdFlags { socket: u8, flags: u8 },
    /// One NBD option ([`nbd_option`]).
    NbdOption {
        socket: u8,
        option: u8,
        export: u8,
        info: u8,
        mode: u8,
    },
    /// A whole NBD handshake to transmission: client flags, optionally STRUCTURED_REPLY
    /// (`variant` bit 0), then GO with a BLOCK_SIZE request, or EXPORT_NAME (bit 1).
    NbdGo { socket: u8, export: u8, variant: u8 },
    /// An NBD request header: `command % 10` READ, WRITE, DISC, FLUSH, TRIM, CACHE,
    /// WRITE_ZEROES, BLOCK_STATUS, the raw type `command`, a bad magic; `flags` (bits 0–4 the
    /// protocol's FUA, NO_HOLE, DF, REQ_ONE, FAST_ZERO; bit 5 an unknown flag; bits 6–7
    /// [`payload_mode`]); a WRITE's payload follows.
    NbdRequest {
        socket: u8,
        command: u8,
        flags: u8,
        cookie: u8,
        offset: u16,
        length: u8,
    },
    /// Virtual time passes ([`advance`]).
    Advance { mode: u8 },
    /// The client reads what has arrived (`mode` even), or stops or resumes reading (odd).
    Read { socket: u8, mode: u8 },
    /// The client closes its sending side.
    Close { socket: u8 },
    /// The client resets the connection.
    Reset { socket: u8 },
    /// The accept armed on a listener fails (`errno % 3`: EMFILE, ECONNABORTED, ENOBUFS).
    FailAccept { thread: u8, listener: u8, errno: u8 },
    /// The server begins its graceful shutdown (SIGTERM); the script goes on.
    Shutdown,
    /// Changes the faults a namespace's device injects ([`fault`]).
    Fault {
        namespace: u8,
        kind: u8,
        a: u8,
        b: u8,
    },
    /// A key-value request ([`kv_request`]): `opcode` (PUT, GET, DELETE, FLUSH and a broken
    /// field), `key` and `value` (lengths up to the limits and beyond), `fill` (the value's
    /// bytes).
    Kv {
        socket: u8,
        opcode: u8,
        id: u8,
        key: u8,
        value: u8,
        fill: u8,
    },
    /// NVMe/TCP PDUs (`Run::nvme_pdus`): `op % 12` picks a whole connection setup, an ICReq, a
    /// Connect, a Property Get or Set, an Identify, another admin command, a Read, a Write
    /// with its data in the capsule or sent on R2T, a Flush, Write Zeroes or Dataset
    /// Management, an H2CData PDU of fuzzed fields, or a host TermReq or PDU of a raw type;
    /// `a`, `b` and `c` are its fields' selectors.
    Nvme {
        socket: u8,
        op: u8,
        a: u8,
        b: u8,
        c: u16,
    },
}

/// A whole input: configuration and steps.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Script {
    pub config: Config,
    pub steps: Vec<Step>,
}

/// Step tags: a tag byte is taken modulo this.
pub const STEP_TAGS: u8 = 17;

struct Reader<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl Reader<'_> {
    fn is_empty(&self) -> bool {
        self.position >= self.bytes.len()
    }

    fn u8(&mut self) -> u8 {
        let byte = self.bytes.get(self.position).copied().unwrap_or(0);
        self.position += 1;
        byte
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    fn bytes(&mut self, count: usize) -> Vec<u8> {
        let start = self.position.min(self.bytes.len());
        let end = (start + count).min(self.bytes.len());
        self.position += count;
        self.bytes[start..end].to_vec()
    }
}

impl Script {
    /// Decodes any bytes (never fails; missing bytes read as zero).
    pub fn decode(bytes: &[u8]) -> Script {
        let mut reader = Reader { bytes, position: 0 };
        let config = Config([
            reader.u8(),
            reader.u8(),
            reader.u8(),
            reader.u8(),
            reader.u8(),
        ]);
        let mut steps = Vec::new();
        while !reader.is_empty() && steps.len() < STEPS_MAX {
            steps.push(Step::decode(&mut reader));
        }
        Script { config, steps }
    }

    /// The bytes that decode to this script.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.config.0.to_vec();
        for step in &self.steps {
            step.encode(&mut out);
        }
        out
    }
}

impl Step {
    fn decode(r: &mut Reader<'_>) -> Step {
        match r.u8() % STEP_TAGS {
            0 => Step::Connect {
                thread: r.u8(),
                listener: r.u8(),
                source: r.u8(),
            },
            1 => {
                let socket = r.u8();
                let count = usize::from(r.u8());
                Step::Raw {
                    socket,
                    bytes: r.bytes(count),
                }
            }
            2 => Step::Native {
                socket: r.u8(),
                opcode: r.u8(),
                flags: r.u8(),
                id: r.u8(),
                namespace: r.u8(),
                offset: r.u16(),
                length: r.u8(),
                body: [r.u8(), r.u8(), r.u8(), r.u8()],
            },
            3 => Step::Original {
                socket: r.u8(),
                opcode: r.u8(),
                handle: r.u8(),
                lba: r.u16(),
                count: r.u8(),
                payload: r.u8(),
            },
            4 => Step::NbdFlags {
                socket: r.u8(),
                flags: r.u8(),
            },
            5 => Step::NbdOption {
                socket: r.u8(),
                option: r.u8(),
                export: r.u8(),
                info: r.u8(),
                mode: r.u8(),
            },
            6 => Step::NbdGo {
                socket: r.u8(),
                export: r.u8(),
                variant: r.u8(),
            },
            7 => Step::NbdRequest {
                socket: r.u8(),
                command: r.u8(),
                flags: r.u8(),
                cookie: r.u8(),
                offset: r.u16(),
                length: r.u8(),
            },
            8 => Step::Advance { mode: r.u8() },
            9 => Step::Read {
                socket: r.u8(),
                mode: r.u8(),
            },
            10 => Step::Close { socket: r.u8() },
            11 => Step::Reset { socket: r.u8() },
            12 => Step::FailAccept {
                thread: r.u8(),
                listener: r.u8(),
                errno: r.u8(),
            },
            14 => Step::Fault {
                namespace: r.u8(),
                kind: r.u8(),
                a: r.u8(),
                b: r.u8(),
            },
            15 => Step::Kv {
                socket: r.u8(),
                opcode: r.u8(),
                id: r.u8(),
                key: r.u8(),
                value: r.u8(),
                fill: r.u8(),
            },
            16 => Step::Nvme {
                socket: r.u8(),
                op: r.u8(),
                a: r.u8(),
                b: r.u8(),
                c: r.u16(),
            },
            _ => Step::Shutdown,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Step::Connect {
                thread,
                listener,
                source,
            } => out.extend([0, *thread, *listener, *source]),
            Step::Raw { socket, bytes } => {
                let count = bytes.len().min(255);
                out.extend([1, *socket, count as u8]);
                out.extend_from_slice(&bytes[..count]);
            }
            Step::Native {
                socket,
                opcode,
                flags,
                id,
                namespace,
                offset,
                length,
                body,
            } => {
                out.extend([2, *socket, *opcode, *flags, *id, *namespace]);
                out.extend(offset.to_le_bytes());
                out.push(*length);
                out.extend(body);
            }
            Step::Original {
                socket,
                opcode,
                handle,
                lba,
                count,
                payload,
            } => {
                out.extend([3, *socket, *opcode, *handle]);
                out.extend(lba.to_le_bytes());
                out.extend([*count, *payload]);
            }
            Step::NbdFlags { socket, flags } => out.extend([4, *socket, *flags]),
            Step::NbdOption {
                socket,
                option,
                export,
                info,
                mode,
            } => out.extend([5, *socket, *option, *export, *info, *mode]),
            Step::NbdGo {
                socket,
                export,
                variant,
            } => out.extend([6, *socket, *export, *variant]),
            Step::NbdRequest {
                socket,
                command,
                flags,
                cookie,
                offset,
                length,
            } => {
                out.extend([7, *socket, *command, *flags, *cookie]);
                out.extend(offset.to_le_bytes());
                out.push(*length);
            }
            Step::Advance { mode } => out.extend([8, *mode]),
            Step::Read { socket, mode } => out.extend([9, *socket, *mode]),
            Step::Close { socket } => out.extend([10, *socket]),
            Step::Reset { socket } => out.extend([11, *socket]),
            Step::FailAccept {
                thread,
                listener,
                errno,
            } => out.extend([12, *thread, *listener, *errno]),
            Step::Shutdown => out.push(13),
            Step::Fault {
                namespace,
                kind,
                a,
                b,
            } => out.extend([14, *namespace, *kind, *a, *b]),
            Step::Kv {
                socket,
                opcode,
                id,
                key,
                value,
                fill,
            } => out.extend([15, *socket, *opcode, *id, *key, *value, *fill]),
            Step::Nvme {
                socket,
                op,
                a,
                b,
                c,
            } => {
                out.extend([16, *socket, *op, *a, *b]);
                out.extend(c.to_le_bytes());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Field tables.

/// A request length: 16 interesting values for selectors below 16, else `(selector - 16)`
/// sectors of 512 bytes.
pub fn length_bytes(selector: u8) -> u32 {
    const TABLE: [u32; 16] = [
        0,
        1,
        512,
        4096,
        4096,
        8192,
        12288,
        16384,
        65536,
        131_072,
        1 << 20,
        (1 << 20) + 512,
        4095,
        511,
        0x8000_0000,
        u32::MAX,
    ];
    match TABLE.get(usize::from(selector)) {
        Some(&length) => length,
        None => u32::from(selector - 16) * 512,
    }
}

/// A request offset: `selector` sectors of 512 bytes, a small misaligned offset for selectors
/// from 0xff00, and the last sector of the 64-bit range for 0xffff.
pub fn offset_bytes(selector: u16) -> u64 {
    match selector {
        0xffff => !511,
        0xff00.. => u64::from(selector - 0xff00),
        _ => u64::from(selector) * 512,
    }
}

/// An original-protocol sector count: 8 interesting values, else the selector itself.
pub fn sector_count(selector: u8) -> u32 {
    const TABLE: [u32; 8] = [0, 1, 8, 9, 2048, 2049, u32::MAX, 4096];
    TABLE
        .get(usize::from(selector))
        .copied()
        .unwrap_or(u32::from(selector))
}

/// How much of a request's payload a client sends (two bits): all of it, none, half, or all
/// of it and 16 bytes of garbage after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadMode {
    Whole,
    Nothing,
    Half,
    WholeAndGarbage,
}

pub fn payload_mode(bits: u8) -> PayloadMode {
    match bits & 3 {
        0 => PayloadMode::Whole,
        1 => PayloadMode::Nothing,
        2 => PayloadMode::Half,
        _ => PayloadMode::WholeAndGarbage,
    }
}

/// The bytes of a payload of `length` (at most [`PAYLOAD_BYTES_MAX`] of it) filled with `fill`.
fn payload(length: u64, mode: PayloadMode, fill: u8) -> Vec<u8> {
    let whole = length.min(PAYLOAD_BYTES_MAX as u64) as usize;
    match mode {
        PayloadMode::Whole => vec![fill; whole],
        PayloadMode::Nothing => Vec::new(),
        PayloadMode::Half => vec![fill; whole / 2],
        PayloadMode::WholeAndGarbage => {
            let mut bytes = vec![fill; whole];
            bytes.extend([0xa5; 16]);
            bytes
        }
    }
}

const NATIVE_OPCODES: [native::Opcode; 9] = [
    native::Opcode::Hello,
    native::Opcode::Read,
    native::Opcode::Write,
    native::Opcode::Flush,
    native::Opcode::Trim,
    native::Opcode::Register,
    native::Opcode::Unregister,
    native::Opcode::Bind,
    native::Opcode::Renegotiate,
];
/// The script byte that sends a REPORT (added after the findings' inputs were recorded: the
/// other bytes keep the opcodes they had, so every recorded input replays as it was found).
const NATIVE_REPORT_BYTE: u8 = 0xf0;

/// A native control or HELLO body from four selector bytes.
/// - HELLO: `version_max` = `body[0]`, `io_priority` = `body[1] << 8 | body[2]`, non-zero
///   reserved bytes if `body[3]` bit 0, non-zero flags if bit 1.
/// - REGISTER: class `body[0] % 3` (LC, BE, the raw byte), read percentage `body[1]`,
///   latency and IOPS from `body[2]` (`% 6` and `/ 6 % 6` of small tables), read-only
///   `body[3]` bit 0, handle selector `body[3] >> 1 & 31` ([`tenant_handle`]), non-zero
///   reserved bytes if bit 7.
/// - UNREGISTER, BIND: handle selector `body[0]` ([`tenant_handle`]), or u64::MAX if
///   `body[1]` bit 0.
/// - REPORT: `reads` = `body[0]` (u32::MAX if 255), `read_p95_us` = `body[1..4]` as a
///   little-endian 24-bit number (u32::MAX if all three are 255).
pub fn native_body(opcode: u8, namespace_id: u32, body: [u8; 4]) -> Vec<u8> {
    match native::Opcode::from_u8(opcode) {
        Ok(native::Opcode::Hello) => {
            let mut bytes = vec![0u8; native::HELLO_BODY_SIZE];
            bytes[0..2].copy_from_slice(&u16::from(body[0]).to_le_bytes());
            bytes[2..4].copy_from_slice(&u16::from_be_bytes([body[1], body[2]]).to_le_bytes());
            if body[3] & 2 != 0 {
                bytes[4] = 1;
            }
            if body[3] & 1 != 0 {
                bytes[8] = 1;
            }
            bytes
        }
        Ok(native::Opcode::Register) => {
            const LATENCY_US: [u32; 6] = [0, 100, 500, 1000, 5000, u32::MAX];
            const IOPS: [u64; 6] = [0, 1, 1000, 10_000, 1_000_000, u64::MAX];
            let mut bytes = vec![0u8; native::REGISTER_BODY_SIZE];
            bytes[0] = match body[0] % 3 {
                0 => 1,
                1 => 2,
                _ => body[0],
            };
            bytes[1] = body[1];
            bytes[2..4].copy_from_slice(&u16::from(body[3] & 1).to_le_bytes());
            bytes[4..8].copy_from_slice(&namespace_id.to_le_bytes());
            let latency = LATENCY_US[usize::from(body[2] % 6)];
            let iops = IOPS[usize::from(body[2] / 6 % 6)];
            bytes[8..12].copy_from_slice(&latency.to_le_bytes());
            if body[3] & 0x80 != 0 {
                bytes[12] = 1;
            }
            bytes[16..24].copy_from_slice(&iops.to_le_bytes());
            let handle = tenant_handle(body[3] >> 1 & 31);
            bytes[24..32].copy_from_slice(&handle.to_le_bytes());
            bytes
        }
        Ok(native::Opcode::Unregister | native::Opcode::Bind) => {
            let handle = if body[1] & 1 != 0 {
                u64::MAX
            } else {
                tenant_handle(body[0])
            };
            native::encode_handle(handle).to_vec()
        }
        Ok(native::Opcode::Report) => {
            let reads = match body[0] {
                255 => u32::MAX,
                reads => u32::from(reads),
            };
            let read_p95_us = match u32::from_le_bytes([body[1], body[2], body[3], 0]) {
                0x00ff_ffff => u32::MAX,
                p95 => p95,
            };
            // The p95's middle byte also picks the backlog: none, some, the most.
            let backlog = match body[2] {
                255 => u32::MAX,
                byte => u32::from(byte) * 100,
            };
            native::ReportBody {
                reads,
                read_p95_us,
                backlog,
            }
            .to_bytes()
            .to_vec()
        }
        _ => Vec::new(),
    }
}

/// The bytes of a native request step.
#[allow(clippy::too_many_arguments)]
pub fn native_request(
    opcode: u8,
    flags: u8,
    id: u8,
    namespace: u8,
    offset: u16,
    length: u8,
    body: [u8; 4],
) -> Vec<u8> {
    const NAMESPACES: [u32; 6] = [1, 2, 3, 0, 4, u32::MAX];
    let opcode_raw = if opcode < 0xf0 {
        NATIVE_OPCODES[usize::from(opcode % 9)].as_u8()
    } else if opcode == NATIVE_REPORT_BYTE {
        native::Opcode::Report.as_u8()
    } else {
        opcode
    };
    let namespace_id = NAMESPACES[usize::from(namespace % 6)];
    let control_body = native_body(opcode_raw, namespace_id, body);
    let length_bytes = if length == 0 && !control_body.is_empty() {
        control_body.len() as u32
    } else {
        length_bytes(length)
    };
    let mut request_flags = 0u16;
    if flags & 1 != 0 {
        request_flags |= native::RequestFlags::FUA.bits();
    }
    if flags & 2 != 0 {
        request_flags |= 0x8000;
    }
    let header = native::RequestHeader {
        version: if flags & 4 != 0 { 2 } else { native::VERSION },
        opcode_raw,
        flags: native::RequestFlags::from_bits_retain(request_flags),
        request_id: u64::from(id),
        offset_bytes: offset_bytes(offset),
        length_bytes,
        namespace_id,
    };
    let mut bytes = header.to_bytes().to_vec();
    let payload_bytes = u64::from(header.payload_length_bytes());
    let mode = payload_mode(flags >> 3);
    if payload_bytes > 0 {
        let mut body = if control_body.is_empty() {
            payload(payload_bytes, PayloadMode::Whole, id)
        } else {
            control_body
        };
        // The body as the length says: cut or padded with the request id.
        body.resize(payload_bytes.min(PAYLOAD_BYTES_MAX as u64) as usize, id);
        match mode {
            PayloadMode::Whole => bytes.extend(body),
            PayloadMode::Nothing => {}
            PayloadMode::Half => bytes.extend(&body[..body.len() / 2]),
            PayloadMode::WholeAndGarbage => {
                bytes.extend(body);
                bytes.extend([0xa5; 16]);
            }
        }
    }
    bytes
}

/// The bytes of an original-protocol request step.
pub fn original_request(opcode: u8, handle: u8, lba: u16, count: u8, payload_bits: u8) -> Vec<u8> {
    let header = original::Header {
        opcode: if opcode % 4 == 1 {
            original::Opcode::Write
        } else {
            original::Opcode::Read
        },
        handle: [handle; 8],
        lba: u64::from(lba),
        lba_count: sector_count(count),
    };
    let mut bytes = header.to_bytes().to_vec();
    match opcode % 4 {
        2 => bytes[2..4].copy_from_slice(&7u16.to_le_bytes()),
        3 => bytes[0..2].copy_from_slice(&0x5a5au16.to_le_bytes()),
        _ => {}
    }
    let length = header.request_payload_length_bytes();
    bytes.extend(payload(length, payload_mode(payload_bits), handle));
    bytes
}

/// The NBD client flags of a step.
pub fn nbd_flags(selector: u8) -> Vec<u8> {
    let flags = match selector % 4 {
        0 => nbd::client_flags::FIXED_NEWSTYLE | nbd::client_flags::NO_ZEROES,
        1 => nbd::client_flags::FIXED_NEWSTYLE,
        2 => 0,
        _ => u32::MAX,
    };
    flags.to_be_bytes().to_vec()
}

fn option_bytes(code: u32, data: &[u8]) -> Vec<u8> {
    let mut bytes = nbd::IHAVEOPT.to_be_bytes().to_vec();
    bytes.extend(code.to_be_bytes());
    bytes.extend((data.len() as u32).to_be_bytes());
    bytes.extend_from_slice(data);
    bytes
}

/// The data of INFO and GO: the export name and information requests (`info` bits 0–3 ask for
/// EXPORT, NAME, DESCRIPTION, BLOCK_SIZE; bit 4 asks for an unknown one; bit 5 announces one
/// request more than it sends).
fn go_data(export: u8, info: u8) -> Vec<u8> {
    let name = export_name(export);
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend(name.as_bytes());
    let mut requests: Vec<u16> = (0..4).filter(|bit| info >> bit & 1 == 1).collect();
    if info & 0x10 != 0 {
        requests.push(0x7777);
    }
    let announced = requests.len() as u16 + u16::from(info >> 5 & 1);
    data.extend(announced.to_be_bytes());
    for request in requests {
        data.extend(request.to_be_bytes());
    }
    data
}

fn export_name(selector: u8) -> String {
    match EXPORT_NAMES.get(usize::from(selector)) {
        Some(name) => (*name).into(),
        None if selector == 0xff => "x".repeat(nbd::STRING_SIZE_MAX + 1),
        None => EXPORT_NAMES[usize::from(selector) % EXPORT_NAMES.len()].into(),
    }
}

/// One NBD option: `option % 14` EXPORT_NAME, ABORT, LIST, PEEK_EXPORT, STARTTLS, INFO, GO,
/// STRUCTURED_REPLY, LIST_META_CONTEXT, SET_META_CONTEXT, EXTENDED_HEADERS, an unknown option,
/// a bad option magic, a length beyond the option data limit; the export name and
/// information requests as [`go_data`] says; `mode` bit 0 adds 4 bytes of garbage to the
/// data, bit 1 sends only half of the option.
pub fn nbd_option(option: u8, export: u8, info: u8, mode: u8) -> Vec<u8> {
    use nbd::option as code;
    let codes = [
        code::EXPORT_NAME,
        code::ABORT,
        code::LIST,
        code::PEEK_EXPORT,
        code::STARTTLS,
        code::INFO,
        code::GO,
        code::STRUCTURED_REPLY,
        code::LIST_META_CONTEXT,
        code::SET_META_CONTEXT,
        code::EXTENDED_HEADERS,
        0x1234,
    ];
    let selector = usize::from(option % 14);
    let mut data = match codes.get(selector) {
        Some(&code::EXPORT_NAME) => export_name(export).into_bytes(),
        Some(&(code::INFO | code::GO)) => go_data(export, info),
        _ => Vec::new(),
    };
    if mode & 1 != 0 {
        data.extend([0xde, 0xad, 0xbe, 0xef]);
    }
    let mut bytes = match codes.get(selector) {
        Some(&code) => option_bytes(code, &data),
        None if selector == 12 => {
            let mut bytes = option_bytes(code::GO, &data);
            bytes[0] ^= 0xff;
            bytes
        }
        None => {
            let mut bytes = option_bytes(code::INFO, &data);
            bytes[12..16].copy_from_slice(&(nbd::OPTION_DATA_MAX_BYTES as u32 + 1).to_be_bytes());
            bytes
        }
    };
    if mode & 2 != 0 {
        bytes.truncate(bytes.len() / 2);
    }
    bytes
}

/// A whole handshake to transmission (see [`Step::NbdGo`]).
pub fn nbd_go(export: u8, variant: u8) -> Vec<u8> {
    let mut bytes = nbd_flags(0);
    if variant & 1 != 0 {
        bytes.extend(option_bytes(nbd::option::STRUCTURED_REPLY, &[]));
    }
    if variant & 2 != 0 {
        bytes.extend(option_bytes(
            nbd::option::EXPORT_NAME,
            export_name(export).as_bytes(),
        ));
    } else {
        bytes.extend(option_bytes(nbd::option::GO, &go_data(export, 1 << 3)));
    }
    bytes
}

/// An NBD request step's bytes (see [`Step::NbdRequest`]).
pub fn nbd_request(command: u8, flags: u8, cookie: u8, offset: u16, length: u8) -> Vec<u8> {
    let selector = command % 10;
    let command_type = match selector {
        0..=7 => u16::from(selector),
        _ => u16::from(command),
    };
    let mut request_flags = u16::from(flags & 0x1f);
    if flags & 0x20 != 0 {
        request_flags |= 0x4000;
    }
    let length_bytes = length_bytes(length);
    let mut bytes = Vec::with_capacity(nbd::REQUEST_HEADER_SIZE);
    let magic = if selector == 9 {
        0x1234_5678
    } else {
        nbd::REQUEST_MAGIC
    };
    bytes.extend(magic.to_be_bytes());
    bytes.extend(request_flags.to_be_bytes());
    bytes.extend(command_type.to_be_bytes());
    bytes.extend(u64::from(cookie).to_be_bytes());
    bytes.extend(offset_bytes(offset).to_be_bytes());
    bytes.extend(length_bytes.to_be_bytes());
    if command_type == 1 {
        bytes.extend(payload(
            u64::from(length_bytes),
            payload_mode(flags >> 6),
            cookie,
        ));
    }
    bytes
}

/// A key-value request's value length: `selector % 8` of 0, 1, 17, 4095, 4096, 4097,
/// 16 KiB and the largest (64 KiB).
pub fn kv_value_bytes(selector: u8) -> usize {
    const TABLE: [usize; 8] = [
        0,
        1,
        17,
        4095,
        4096,
        4097,
        16 << 10,
        kv::VALUE_SIZE_MAX_BYTES,
    ];
    TABLE[usize::from(selector % 8)]
}

/// A key: `selector >> 6` picks its length (1, 3, 16, the largest: 255 bytes), its first byte
/// is `first` and the rest `b'k'`: few distinct keys, so that requests meet on one.
pub fn kv_key(selector: u8, first: u8) -> Vec<u8> {
    const LENGTHS: [usize; 4] = [1, 3, 16, kv::KEY_SIZE_MAX_BYTES];
    let mut key = vec![b'k'; LENGTHS[usize::from(selector >> 6)]];
    key[0] = first;
    key
}

/// A value of `length` bytes from `fill`.
pub fn kv_value(length: usize, fill: u8) -> Vec<u8> {
    (0..length)
        .map(|index| fill.wrapping_add((index % 251) as u8))
        .collect()
}

/// A key-value request frame: `opcode % 4` PUT, GET, DELETE, FLUSH; with bit 2 set, one field
/// broken by `opcode >> 3 & 7`: version 2, an unknown opcode, a flag, the reserved field, a
/// key of 256 bytes, a value of 64 KiB + 1 (the server skips its payload), the key or value
/// presence the opcode forbids, a bad magic (the server closes the connection). The key is
/// [`kv_key`] (`key & 0x1f` its first byte), the value [`kv_value`] of [`kv_value_bytes`] (on
/// PUT only, unless broken).
pub fn kv_request(opcode: u8, id: u8, key: u8, value: u8, fill: u8) -> Vec<u8> {
    const OPCODES: [kv::Opcode; 4] = [
        kv::Opcode::Put,
        kv::Opcode::Get,
        kv::Opcode::Delete,
        kv::Opcode::Flush,
    ];
    let op = OPCODES[usize::from(opcode % 4)];
    let mut key_bytes = if op == kv::Opcode::Flush {
        Vec::new()
    } else {
        kv_key(key, key & 0x1f)
    };
    let mut value_bytes = if op == kv::Opcode::Put {
        kv_value(kv_value_bytes(value), fill)
    } else {
        Vec::new()
    };
    let mut header = kv::RequestHeader::new(op, u64::from(id), 0, 0);
    let mut bad_magic = false;
    if opcode & 4 != 0 {
        match opcode >> 3 & 7 {
            0 => header.version = 2,
            1 => header.opcode_raw = [0, 5, 0x80, 0xff][usize::from(fill % 4)],
            2 => header.flags = 1 << (fill % 16),
            3 => header.reserved = u16::from(fill) | 1,
            4 => key_bytes = vec![b'K'; kv::KEY_SIZE_MAX_BYTES + 1],
            5 => value_bytes = kv_value(kv::VALUE_SIZE_MAX_BYTES + 1, fill),
            6 => match op {
                kv::Opcode::Flush => key_bytes = vec![key],
                kv::Opcode::Put => key_bytes.clear(),
                _ => value_bytes = kv_value(kv_value_bytes(value).max(1), fill),
            },
            _ => bad_magic = true,
        }
    }
    header.key_length_bytes = key_bytes.len() as u16;
    header.value_length_bytes = value_bytes.len() as u32;
    let mut bytes = header.to_bytes().to_vec();
    if bad_magic {
        bytes[..4].copy_from_slice(b"RFXX");
    }
    bytes.extend_from_slice(&key_bytes);
    // A valid request's payload is sent whole (up to 255 + 64 KiB); only the oversize value
    // is cut short, and the server waits for the rest of what it skips.
    bytes.extend_from_slice(&value_bytes[..value_bytes.len().min(kv::VALUE_SIZE_MAX_BYTES)]);
    bytes
}

/// Changes a fault plan (`kind % 8`): 0 clears it; 1 stalls the device, 2 lifts the stall;
/// 3 fails a share of one kind of operation (`a % 4`: read, write, flush, trim; share
/// `b % 4`: all, half, a tenth, none; errno `b / 4 % 6`: EIO, ENOSPC, EDQUOT, ETIMEDOUT,
/// EAGAIN, EROFS); 4 fails every read, write or trim (`a % 3`) touching 8 blocks from block
/// `b * 8`; 5 delays completions by 100 µs, 1 ms, 10 ms or 200 ms (`a % 4`), every
/// `b % 4 + 1`th one (or a random half if `b` bit 7); 6 shortens all, half or a tenth of the
/// reads and writes (`a % 3`); 7 changes the seed to `a`.
pub fn fault(plan: &mut FaultPlan, kind: u8, a: u8, b: u8) {
    const SHARES: [f64; 4] = [1.0, 0.5, 0.1, 0.0];
    const ERRNOS: [i32; 6] = [
        libc::EIO,
        libc::ENOSPC,
        libc::EDQUOT,
        libc::ETIMEDOUT,
        libc::EAGAIN,
        libc::EROFS,
    ];
    match kind % 8 {
        0 => {
            *plan = FaultPlan {
                seed: plan.seed,
                ..FaultPlan::default()
            }
        }
        1 => plan.stall = true,
        2 => plan.stall = false,
        3 => {
            let faults = match a % 4 {
                0 => &mut plan.read,
                1 => &mut plan.write,
                2 => &mut plan.flush,
                _ => &mut plan.trim,
            };
            faults.error_rate = SHARES[usize::from(b % 4)];
            plan.errno = ERRNOS[usize::from(b / 4 % 6)];
        }
        4 => {
            let faults = match a % 3 {
                0 => &mut plan.read,
                1 => &mut plan.write,
                _ => &mut plan.trim,
            };
            let first = u64::from(b) * 8;
            faults.error_lba = Some(LbaRange {
                first,
                last: first + 7,
            });
        }
        5 => {
            const DELAY_NS: [u64; 4] = [100_000, 1_000_000, 10_000_000, 200_000_000];
            let pick = if b & 0x80 != 0 {
                DelayPick::Rate(0.5)
            } else {
                DelayPick::Every(NonZeroU64::MIN.saturating_add(u64::from(b % 4)))
            };
            plan.delay = Some(Delay {
                added: Nanos(DELAY_NS[usize::from(a % 4)]),
                pick,
            });
        }
        6 => plan.short_rate = SHARES[usize::from(a % 3)],
        _ => plan.seed = u64::from(a),
    }
}

// ---------------------------------------------------------------------------------------------
// NVMe/TCP.

/// NSIDs by selector (`% 7`): the subsystem's four (4: the composite namespace, unknown
/// without one), 0, the broadcast NSID, one no subsystem has.
pub const NVME_NSIDS: [u32; 7] = [1, 2, 3, 4, 0, u32::MAX, 9];

/// Blocks of an NVMe/TCP command: 8 interesting counts for selectors below 8 (one more than
/// a 1 MiB transfer of 512-byte blocks, the largest count), else the selector itself.
pub fn nvme_blocks(selector: u8) -> u32 {
    const BLOCKS: [u32; 8] = [1, 8, 2, 3, 256, 2048, 2049, 0x1_0000];
    BLOCKS
        .get(usize::from(selector))
        .copied()
        .unwrap_or(u32::from(selector))
}

/// The CC value that enables a controller (I/O queue entry sizes 64 and 16 bytes).
pub const NVME_CC_ENABLE: u32 =
    property::CC_EN | (6 << property::CC_IOSQES_SHIFT) | (4 << property::CC_IOCQES_SHIFT);

/// A CapsuleCmd PDU: `command` and its in-capsule `data`, with the host's framing.
pub fn nvme_capsule(framing: &Framing, command: &NvmeCommand, data: &[u8]) -> Vec<u8> {
    let header = framing.capsule_cmd(&command.0, data.len() as u32);
    let mut out = header.as_bytes().to_vec();
    if !data.is_empty() {
        out.extend_from_slice(data);
        if framing.digests.data {
            out.extend(nvme_pdu::crc32c(data).to_le_bytes());
        }
    }
    out
}

/// An H2CData PDU with `data`.
pub fn nvme_h2c_data(framing: &Framing, header: DataHeader, last: bool, data: &[u8]) -> Vec<u8> {
    let flags = if last { nvme_pdu::flags::LAST_PDU } else { 0 };
    let header_bytes = framing.data_pdu(PduType::H2cData, flags, header);
    let mut out = header_bytes.as_bytes().to_vec();
    if !data.is_empty() {
        out.extend_from_slice(data);
        if framing.digests.data {
            out.extend(nvme_pdu::crc32c(data).to_le_bytes());
        }
    }
    out
}

/// An ICReq: `digests` bits 0–1 (header, data), HPDA, and a PDU format version.
pub fn nvme_ic_req(digests: Digests, hpda: u8, pfv: u16, maxr2t: u32) -> Vec<u8> {
    nvme_pdu::encode_ic_req(&nvme_pdu::IcReq {
        pfv,
        hpda,
        digests,
        maxr2t,
    })
    .to_vec()
}

/// A Connect's fields: the queue, its size (0's based), CATTR, KATO, and its data's
/// controller id and NQNs.
pub struct NvmeConnect<'a> {
    pub qid: u16,
    pub sqsize: u16,
    pub cattr: u8,
    pub kato_ms: u32,
    pub cntlid: u16,
    pub subsystem_nqn: &'a str,
    pub host_nqn: &'a str,
}

/// A Connect and its 1024 bytes of data (in the capsule).
pub fn nvme_connect(framing: &Framing, cid: u16, connect: &NvmeConnect<'_>) -> Vec<u8> {
    let data = nvme_command::ConnectData {
        host_id: [0x5a; 16],
        cntlid: connect.cntlid,
        subsystem_nqn: connect.subsystem_nqn.into(),
        host_nqn: connect.host_nqn.into(),
    }
    .encode();
    let mut command = NvmeCommand::connect_command(
        cid,
        connect.qid,
        connect.sqsize,
        connect.cattr,
        connect.kato_ms,
    );
    command.set_sgl(nvme_command::SglDescriptor {
        address: 0,
        length: data.len() as u32,
        identifier: sgl::DATA_BLOCK_OFFSET,
    });
    nvme_capsule(framing, &command, &data)
}

/// A command whose data the controller sends (or asks for by R2T): a transport SGL of
/// `length` bytes.
fn nvme_transport_sgl(command: &mut NvmeCommand, length: u32) {
    command.set_sgl(nvme_command::SglDescriptor {
        address: 0,
        length,
        identifier: sgl::TRANSPORT_DATA_BLOCK,
    });
}

/// An admin command: `opcode`, `nsid`, CDW10 and CDW11, and a transport SGL of `length`.
fn nvme_admin(opcode: u8, cid: u16, nsid: u32, cdw10: u32, cdw11: u32, length: u32) -> NvmeCommand {
    let mut command = NvmeCommand::zeroed();
    command
        .set_opcode(opcode)
        .set_cid(cid)
        .set_nsid(nsid)
        .set_cdw(10, cdw10)
        .set_cdw(11, cdw11);
    if length > 0 {
        nvme_transport_sgl(&mut command, length);
    }
    command
}

/// What an NVMe/TCP command does to a well-formed host's private blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NvmeEffect {
    Read,
    /// Every block written with this byte (Write Zeroes: 0).
    Write(u8),
    /// Deallocated: unknown from now on.
    Unknown,
}

/// Blocks of a well-formed host's private region on the composite namespace, from
/// [`nvme_region`]: only this host's I/O queue writes them, so what it reads back must be
/// what it last wrote (zeroes before).
pub const NVME_REGION_BLOCKS: u64 = 128;

/// The first block of client `index`'s private region on the composite namespace (1 MiB,
/// 512-byte blocks): regions 240 blocks apart, so that client 4's crosses the middle (the
/// `concat` members' boundary) and every one crosses 4 KiB stripes, client 0's a 64 KiB one.
pub fn nvme_region(index: usize) -> u64 {
    32 + 240 * (index as u64 % 8)
}

/// A well-formed host's model of its private blocks (by block number).
#[derive(Default)]
struct NvmeData {
    /// The byte every byte of a written block holds; absent: never written (zeroes).
    fills: std::collections::HashMap<u64, u8>,
    unknown: std::collections::HashSet<u64>,
    /// Writes in flight: cid → first block, blocks, byte (`None`: unknown once answered).
    writes: BTreeMap<u16, (u64, u32, Option<u8>)>,
    /// Reads in flight: cid → first block, the byte each block must hold (`None`: not
    /// checked).
    reads: BTreeMap<u16, (u64, Vec<Option<u8>>)>,
    /// Blocks read back and compared.
    checked: u64,
}

impl NvmeData {
    fn track(&mut self, cid: u16, first: u64, blocks: u32, effect: NvmeEffect) {
        let range = first..first + u64::from(blocks);
        match effect {
            NvmeEffect::Read => {
                let expected = range
                    .map(|block| {
                        let written = self.writes.values().any(|&(start, count, _)| {
                            (start..start + u64::from(count)).contains(&block)
                        });
                        (!written && !self.unknown.contains(&block))
                            .then(|| self.fills.get(&block).copied().unwrap_or(0))
                    })
                    .collect();
                self.reads.insert(cid, (first, expected));
            }
            NvmeEffect::Write(_) | NvmeEffect::Unknown => {
                // Writes in flight together to the same blocks race: NVMe orders no two
                // commands, so whichever the device applies last wins, not the last to
                // complete; both writes' blocks are unknown once answered (more than the
                // blocks they share, never wrong; finding 15).
                let mut racing = false;
                for (start, count, fill) in self.writes.values_mut() {
                    if *start < range.end && range.start < *start + u64::from(*count) {
                        *fill = None;
                        racing = true;
                    }
                }
                // A read in flight races a write sent after it just the same: the device
                // may apply the write first (finding 16). Its blocks are not checked.
                for (start, expected) in self.reads.values_mut() {
                    for (block, byte) in (*start..).zip(expected.iter_mut()) {
                        if range.contains(&block) {
                            *byte = None;
                        }
                    }
                }
                let fill = match effect {
                    NvmeEffect::Write(fill) if !racing => Some(fill),
                    _ => None,
                };
                self.writes.insert(cid, (first, blocks, fill));
            }
        }
    }

    /// A read's data at `offset` bytes into it.
    fn check(&mut self, cid: u16, offset: usize, data: &[u8]) {
        let Some((_, expected)) = self.reads.get(&cid) else {
            return;
        };
        for (at, byte) in data.iter().enumerate() {
            let block = (offset + at) / 512;
            if let Some(Some(fill)) = expected.get(block) {
                assert_eq!(
                    byte,
                    fill,
                    "NVMe/TCP read {cid} of a private block returned another byte than its last \
                     write's at block {block} of the read (byte {})",
                    offset + at
                );
            }
        }
        self.checked += (data.len() / 512) as u64;
    }

    fn completed(&mut self, cid: u16, ok: bool) {
        self.reads.remove(&cid);
        if let Some((first, blocks, fill)) = self.writes.remove(&cid) {
            for block in first..first + u64::from(blocks) {
                match (ok, fill) {
                    (true, Some(fill)) => {
                        self.unknown.remove(&block);
                        self.fills.insert(block, fill);
                    }
                    _ => {
                        self.fills.remove(&block);
                        self.unknown.insert(block);
                    }
                }
            }
        }
    }
}

/// A client's NVMe/TCP connection: what it negotiated, the controller's PDUs parsed (every
/// one must decode, with correct digests, and be one a controller sends), R2Ts answered
/// with the data of their writes, and what its admin queue learned (the controller's id).
#[derive(Default)]
struct NvmeClient {
    /// The digests its first ICReq asked for (its PDUs use them from then on).
    digests: Option<Digests>,
    /// The controller's, once its ICResp arrived.
    controller_digests: Option<Digests>,
    maxh2cdata: u32,
    /// The start of a PDU not received whole.
    pending: Vec<u8>,
    /// A C2HTermReq arrived: the controller sends nothing more.
    terminated: bool,
    next_cid: u16,
    /// Writes whose data goes on R2T: cid → data.
    r2t_data: BTreeMap<u16, Vec<u8>>,
    /// The queue its Connect asked for (`None`: no Connect sent).
    qid: Option<u16>,
    /// Admin queue: its Connect, the Property Set enabling the controller and the Set
    /// Features asking for I/O queues, while in flight.
    connect_cid: Option<u16>,
    enable_cid: Option<u16>,
    queues_cid: Option<u16>,
    /// Admin queue: the controller's id once its Connect succeeded, whether it is enabled,
    /// the I/O queues granted and the next one to connect.
    cntlid: Option<u16>,
    enabled: bool,
    granted: u16,
    next_qid: u16,
    /// PDUs and completions received.
    pdus: u64,
    completions: u64,
    /// R2Ts answered with data.
    r2ts: u64,
    /// A well-formed host's private blocks on the composite namespace.
    data: NvmeData,
    /// A [`Mode::WellFormed`] host: only its own PDUs reach the controller.
    well_formed: bool,
}

impl NvmeClient {
    fn framing(&self) -> Framing {
        Framing {
            digests: self.digests.unwrap_or(Digests::NONE),
            data_alignment: 4,
        }
    }

    fn next_cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1);
        if self.next_cid == u16::MAX {
            self.next_cid = 1;
        }
        self.next_cid
    }

    /// Parses the controller's bytes: returns the H2CData PDUs answering its R2Ts, and puts
    /// each completion in `completions`. Panics on a PDU a controller must not send.
    fn feed(&mut self, input: &[u8], completions: &mut Vec<NvmeCompletion>) -> Vec<u8> {
        let mut out = Vec::new();
        if input.is_empty() {
            return out;
        }
        assert!(
            !self.terminated,
            "an NVMe/TCP controller sent {} bytes after its C2HTermReq",
            input.len()
        );
        self.pending.extend_from_slice(input);
        let mut start = 0;
        while !self.terminated {
            let rest = &self.pending[start..];
            let digests = self.controller_digests.unwrap_or(Digests::NONE);
            let decoded = match nvme_pdu::decode_header(rest, digests) {
                Ok(Some(decoded)) => decoded,
                Ok(None) => break,
                Err(e) => panic!(
                    "an NVMe/TCP client received a broken PDU: {e:?} in {:02x?}",
                    &rest[..rest.len().min(64)]
                ),
            };
            if rest.len() < decoded.total_bytes {
                break;
            }
            if let Some(span) = decoded.data
                && span.digest
            {
                let data = &rest[span.offset..span.offset + span.length as usize];
                let end = span.offset + span.length as usize;
                let sent =
                    u32::from_le_bytes([rest[end], rest[end + 1], rest[end + 2], rest[end + 3]]);
                assert_eq!(
                    nvme_pdu::crc32c(data),
                    sent,
                    "an NVMe/TCP controller's data digest is wrong: {:?}",
                    decoded.pdu
                );
            }
            self.pdus += 1;
            match decoded.pdu {
                Pdu::IcResp(response) => {
                    assert!(
                        self.controller_digests.is_none(),
                        "a second ICResp on one connection"
                    );
                    // Only a well-formed host's ICReq is surely the one answered (raw bytes
                    // may carry another).
                    if self.well_formed {
                        assert_eq!(
                            Some(response.digests),
                            self.digests,
                            "ICResp's digests are not the ICReq's"
                        );
                    }
                    self.controller_digests = Some(response.digests);
                    self.maxh2cdata = response.maxh2cdata;
                }
                Pdu::C2hTermReq(_) => self.terminated = true,
                Pdu::CapsuleResp(cqe) => {
                    self.completions += 1;
                    completions.push(NvmeCompletion::from_bytes(&cqe));
                }
                Pdu::C2hData(header) => {
                    if let Some(span) = decoded.data {
                        let data = &rest[span.offset..span.offset + span.length as usize];
                        self.data.check(header.cccid, header.offset as usize, data);
                    }
                    if decoded.flags & nvme_pdu::flags::SUCCESS != 0 {
                        assert!(
                            decoded.flags & nvme_pdu::flags::LAST_PDU != 0,
                            "C2HData with SUCCESS but not LAST_PDU"
                        );
                        self.completions += 1;
                        completions.push(NvmeCompletion::new(
                            header.cccid,
                            reflex_proto::nvme_tcp::Status::SUCCESS,
                        ));
                    }
                }
                Pdu::R2t(header) => {
                    let framing = self.framing();
                    if let Some(data) = self.r2t_data.get(&header.cccid) {
                        self.r2ts += 1;
                        let chunk_max = self.maxh2cdata.max(nvme_pdu::MAXH2CDATA_MIN) as usize;
                        let (start, end) = (
                            header.offset as usize,
                            (header.offset as usize).saturating_add(header.length as usize),
                        );
                        let mut at = start;
                        while at < end {
                            let next = (at + chunk_max).min(end);
                            let mut piece = data
                                .get(at.min(data.len())..next.min(data.len()))
                                .unwrap_or(&[])
                                .to_vec();
                            piece.resize(next - at, 0);
                            out.extend(nvme_h2c_data(
                                &framing,
                                DataHeader {
                                    cccid: header.cccid,
                                    ttag: header.ttag,
                                    offset: at as u32,
                                    length: piece.len() as u32,
                                },
                                next == end,
                                &piece,
                            ));
                            at = next;
                        }
                    }
                }
                other => panic!("an NVMe/TCP controller sent a host's PDU: {other:?}"),
            }
            start += decoded.total_bytes;
        }
        self.pending.drain(..start);
        for completion in completions.iter() {
            let cid = completion.cid;
            let ok = completion.status.is_success();
            self.r2t_data.remove(&cid);
            self.data.completed(cid, ok);
            if self.connect_cid == Some(cid) {
                self.connect_cid = None;
                if ok && self.qid == Some(0) {
                    self.cntlid = Some(completion.dw0 as u16);
                }
            }
            if self.enable_cid == Some(cid) {
                self.enable_cid = None;
                self.enabled = ok;
            }
            if self.queues_cid == Some(cid) {
                self.queues_cid = None;
                if ok {
                    let granted = (completion.dw0 & 0xffff).min(completion.dw0 >> 16) + 1;
                    self.granted = granted.min(u32::from(u16::MAX)) as u16;
                }
            }
        }
        out
    }
}

impl Run {
    /// The block size of the namespace an NSID names (512 when there is none).
    fn nvme_block_bytes(&self, nsid: u32) -> u32 {
        let namespaces = self.server.namespaces();
        namespaces
            .index_of(nsid)
            .map_or(512, |index| namespaces.info(index).block_size.max(512))
    }

    /// An admin queue that may take another I/O queue: its client and controller id
    /// (`selector` picks among them; with `ready`, only enabled controllers with a queue
    /// left, whose next queue is taken).
    fn nvme_controller(&mut self, selector: u8, ready: bool) -> Option<(u16, u16)> {
        let candidates: Vec<usize> = (0..self.clients.len())
            .filter(|&index| {
                let client = &self.clients[index];
                let Some(nvme) = client.nvme.as_ref() else {
                    return false;
                };
                nvme.cntlid.is_some()
                    && (!ready
                        || (nvme.enabled
                            && nvme.next_qid < nvme.granted
                            && !self.server.is_server_closed(client.socket)))
            })
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let index = candidates[usize::from(selector) % candidates.len()];
        let nvme = self.clients[index].nvme.as_mut()?;
        let qid = nvme.next_qid + 1;
        if ready {
            nvme.next_qid += 1;
        }
        Some((nvme.cntlid?, qid))
    }

    /// Sends an NVMe/TCP client's PDUs: as any client would in [`Mode::Any`], as a request
    /// answered by command `cid` in [`Mode::WellFormed`].
    fn nvme_send(&mut self, index: usize, bytes: Vec<u8>, cid: Option<u16>) {
        if self.clients[index].oracle.is_some() {
            match cid {
                Some(cid) => {
                    self.send_request(index, bytes, u64::from(cid), 0);
                }
                None => {
                    if self.within_budget(index, bytes.len()) {
                        self.outcome.bytes_sent += bytes.len();
                        self.transmit(index, &bytes);
                    }
                }
            }
        } else {
            self.send_index(index, &bytes);
        }
    }

    /// The first steps of an NVMe/TCP host: ICReq with `digests`, then an admin queue's
    /// Connect (KATO `kato_ms`, host [`NVME_HOSTS`]`[host]`), Property Set enabling the
    /// controller and Set Features asking for `queues` I/O queues; or, given a controller, an
    /// I/O queue's Connect.
    fn nvme_go(
        &mut self,
        index: usize,
        digests: Digests,
        io_queue: Option<(u16, u16)>,
        kato_ms: u32,
        host: usize,
        queues: u16,
    ) {
        let Some(nvme) = self.clients[index].nvme.as_mut() else {
            return;
        };
        if nvme.digests.is_none() {
            nvme.digests = Some(digests);
        }
        let ic = nvme_ic_req(digests, 0, 0, 0);
        self.nvme_send(index, ic, None);
        let Some(nvme) = self.clients[index].nvme.as_mut() else {
            return;
        };
        let framing = nvme.framing();
        let host_nqn = NVME_HOSTS[host % NVME_HOSTS.len()];
        let cid = nvme.next_cid();
        nvme.connect_cid = Some(cid);
        match io_queue {
            Some((cntlid, qid)) => {
                nvme.qid = Some(qid);
                let bytes = nvme_connect(
                    &framing,
                    cid,
                    &NvmeConnect {
                        qid,
                        sqsize: 31,
                        cattr: 0,
                        kato_ms: 0,
                        cntlid,
                        subsystem_nqn: NVME_NQN,
                        host_nqn,
                    },
                );
                self.nvme_send(index, bytes, Some(cid));
            }
            None => {
                nvme.qid = Some(0);
                let connect = nvme_connect(
                    &framing,
                    cid,
                    &NvmeConnect {
                        qid: 0,
                        sqsize: 31,
                        cattr: 0,
                        kato_ms,
                        cntlid: nvme_command::CNTLID_DYNAMIC,
                        subsystem_nqn: NVME_NQN,
                        host_nqn,
                    },
                );
                let enable_cid = nvme.next_cid();
                nvme.enable_cid = Some(enable_cid);
                let enable = nvme_capsule(
                    &framing,
                    &NvmeCommand::property(
                        enable_cid,
                        property::CC,
                        false,
                        Some(u64::from(NVME_CC_ENABLE)),
                    ),
                    &[],
                );
                let queues_cid = nvme.next_cid();
                nvme.queues_cid = Some(queues_cid);
                let count = u32::from(queues.max(1) - 1);
                let set_queues = nvme_capsule(
                    &framing,
                    &nvme_admin(
                        admin_opcode::SET_FEATURES,
                        queues_cid,
                        0,
                        u32::from(feature::NUMBER_OF_QUEUES),
                        count | (count << 16),
                        0,
                    ),
                    &[],
                );
                self.nvme_send(index, connect, Some(cid));
                self.nvme_send(index, enable, Some(enable_cid));
                self.nvme_send(index, set_queues, Some(queues_cid));
            }
        }
    }

    /// An NVMe/TCP step ([`Step::Nvme`]) on client `index`; `well_formed` keeps to what a
    /// correct host sends on its queue (admin commands on the admin queue, I/O on an I/O
    /// queue, valid framing and data) with commands it expects one answer to.
    fn nvme_pdus(&mut self, index: usize, op: u8, a: u8, b: u8, c: u16, well_formed: bool) {
        let Some(nvme) = self.clients[index].nvme.as_ref() else {
            return;
        };
        let qid = nvme.qid;
        let framing = nvme.framing();
        if well_formed {
            // Connected at once by connect_well_formed; a well-formed host keeps within its
            // queue's 32 entries.
            let in_flight = self.clients[index]
                .oracle
                .as_ref()
                .map_or(0, |oracle| oracle.outstanding.len());
            if qid.is_none() || in_flight >= 30 {
                return;
            }
        }
        let nsid = NVME_NSIDS[usize::from(b % if well_formed { 4 } else { 7 })];
        let block_bytes = self.nvme_block_bytes(nsid);
        let Some(nvme) = self.clients[index].nvme.as_mut() else {
            return;
        };
        let cid = nvme.next_cid();
        let op = if well_formed {
            // Admin queue: Identify, Property Get, Get Log Page, Get Features, Keep Alive.
            // I/O queue: Read, Write in the capsule or on R2T, Flush, Write Zeroes or DSM.
            if qid == Some(0) {
                [4, 3, 5, 5, 5][usize::from(op % 5)]
            } else {
                [6, 7, 8, 9, 9][usize::from(op % 5)]
            }
        } else {
            op % 12
        };
        let mut slba = offset_bytes(c) / u64::from(block_bytes);
        let mut blocks = nvme_blocks(a);
        // A well-formed host's I/O on the composite namespace stays in its private region
        // (at most 8 blocks at a time), where what it reads back is checked.
        let tracked = well_formed
            && qid != Some(0)
            && nsid == COMPOSITE_ID
            && self.setup.composite.is_some()
            && block_bytes == 512;
        if tracked {
            slba = nvme_region(index) + u64::from(c) % (NVME_REGION_BLOCKS - 8);
            blocks = blocks.clamp(1, 8);
        }
        let mut effect: Option<(u64, u32, NvmeEffect)> = None;
        let bytes = match op {
            0 => {
                // A whole setup: `a` bit 0 an I/O queue of a controller some admin queue
                // connected, bits 1–2 the digests; `b` the host and KATO.
                let digests = Digests::from_byte(a >> 1);
                let io_queue = if a & 1 == 1 {
                    self.nvme_controller(b, false)
                } else {
                    None
                };
                let kato_ms = [0, 500, 5_000, 100][usize::from(b >> 2 & 3)];
                self.nvme_go(
                    index,
                    digests,
                    io_queue,
                    kato_ms,
                    usize::from(b >> 4),
                    c % 8 + 1,
                );
                return;
            }
            1 => {
                // ICReq: `a` bits 0–1 digests, 2–6 HPDA, 7 a PDU format version of 1.
                let digests = Digests::from_byte(a);
                if nvme.digests.is_none() {
                    nvme.digests = Some(digests);
                }
                let bytes = nvme_ic_req(digests, (a >> 2) & 0x1f, u16::from(a >> 7), u32::from(b));
                self.nvme_send(index, bytes, None);
                return;
            }
            2 => {
                // Connect: `a` the queue (0, a learned controller's next, 1, 65535) and its
                // size; `b` the subsystem, host, KATO and flow control.
                let learned = self.nvme_controller(b, false);
                let Some(nvme) = self.clients[index].nvme.as_mut() else {
                    return;
                };
                let (cntlid, qid) = match a % 4 {
                    0 => (nvme_command::CNTLID_DYNAMIC, 0),
                    1 => learned.unwrap_or((1, 1)),
                    2 => (learned.map_or(c, |(cntlid, _)| cntlid), 1),
                    _ => (c, u16::MAX),
                };
                nvme.qid = Some(qid);
                nvme.connect_cid = Some(cid);
                let sqsize = [31, 0, 127, u16::MAX][usize::from(a >> 2 & 3)];
                let subsystem =
                    [NVME_NQN, nvme_command::DISCOVERY_NQN, "nqn.nope", ""][usize::from(b & 3)];
                let host = NVME_HOSTS[usize::from(b >> 2 & 3) % NVME_HOSTS.len()];
                let cattr = if b & 0x10 != 0 {
                    nvme_command::CATTR_DISABLE_SQ_FLOW_CONTROL
                } else {
                    0
                };
                let kato_ms = [0, 100, 5_000, 60_000][usize::from(b >> 5 & 3)];
                nvme_connect(
                    &framing,
                    cid,
                    &NvmeConnect {
                        qid,
                        sqsize,
                        cattr,
                        kato_ms,
                        cntlid,
                        subsystem_nqn: subsystem,
                        host_nqn: host,
                    },
                )
            }
            3 => {
                // Property Get or Set (`a` bit 3): CAP, VS, CC, CSTS, NSSR or a raw offset;
                // Set's value: enable, disable, shut down, raw.
                const OFFSETS: [u32; 6] = [
                    property::CAP,
                    property::VS,
                    property::CC,
                    property::CSTS,
                    property::NSSR,
                    0x30,
                ];
                let offset = if well_formed {
                    OFFSETS[usize::from(a % 4)]
                } else {
                    OFFSETS[usize::from(a % 6)]
                };
                let value = match (a >> 3 & 1 == 1 && !well_formed, a >> 4 & 3) {
                    (false, _) => None,
                    (true, 0) => Some(u64::from(NVME_CC_ENABLE)),
                    (true, 1) => Some(0),
                    (true, 2) => Some(u64::from(NVME_CC_ENABLE | (1 << property::CC_SHN_SHIFT))),
                    (true, _) => Some(u64::from(c)),
                };
                if value.is_some() && offset == property::CC {
                    nvme.enable_cid = Some(cid);
                }
                let eight = offset == property::CAP || a & 0x40 != 0;
                nvme_capsule(
                    &framing,
                    &NvmeCommand::property(cid, offset, eight, value),
                    &[],
                )
            }
            4 => {
                // Identify: the namespace, the controller, the active namespaces, the
                // namespace descriptors, or a raw CNS; the transfer 4096 bytes or raw.
                const CNS: [u8; 4] = [
                    cns::NAMESPACE,
                    cns::CONTROLLER,
                    cns::ACTIVE_NAMESPACES,
                    cns::NAMESPACE_DESCRIPTORS,
                ];
                let cns = if a < 0xf0 || well_formed {
                    CNS[usize::from(a % 4)]
                } else {
                    a & 0x1f
                };
                let length = if well_formed || c < 0xf000 {
                    4096
                } else {
                    u32::from(c & 0x1fff)
                };
                let command =
                    nvme_admin(admin_opcode::IDENTIFY, cid, nsid, u32::from(cns), 0, length);
                nvme_capsule(&framing, &command, &[])
            }
            5 => {
                // Other admin commands by `a % 8`: Get Log Page, Get Features, Keep Alive,
                // Set Features (Number of Queues, KATO), Async Event Request, Abort,
                // Disconnect (well-formed: the first three).
                const LOGS: [u8; 5] = [
                    log_page::SMART_HEALTH,
                    log_page::ERROR_INFORMATION,
                    log_page::FIRMWARE_SLOT,
                    log_page::CHANGED_NAMESPACES,
                    log_page::DISCOVERY,
                ];
                const FEATURES: [u8; 6] = [
                    feature::NUMBER_OF_QUEUES,
                    feature::VOLATILE_WRITE_CACHE,
                    feature::KEEP_ALIVE_TIMER,
                    feature::ARBITRATION,
                    feature::ASYNC_EVENT_CONFIGURATION,
                    0x80,
                ];
                let kind = if well_formed { a % 3 } else { a % 8 };
                let command = match kind {
                    0 => {
                        let dwords = u32::from(c % 1024) + 1;
                        let lid = LOGS[usize::from(b % if well_formed { 4 } else { 5 })];
                        nvme_admin(
                            admin_opcode::GET_LOG_PAGE,
                            cid,
                            u32::MAX,
                            u32::from(lid) | ((dwords - 1) << 16),
                            0,
                            dwords * 4,
                        )
                    }
                    1 => nvme_admin(
                        admin_opcode::GET_FEATURES,
                        cid,
                        0,
                        u32::from(FEATURES[usize::from(b % if well_formed { 4 } else { 6 })]),
                        0,
                        0,
                    ),
                    2 => nvme_admin(admin_opcode::KEEP_ALIVE, cid, 0, 0, 0, 0),
                    3 => {
                        nvme.queues_cid = Some(cid);
                        let count = u32::from(c);
                        nvme_admin(
                            admin_opcode::SET_FEATURES,
                            cid,
                            0,
                            u32::from(feature::NUMBER_OF_QUEUES),
                            count | (count << 16),
                            0,
                        )
                    }
                    4 => nvme_admin(
                        admin_opcode::SET_FEATURES,
                        cid,
                        0,
                        u32::from(FEATURES[usize::from(b % 6)]),
                        u32::from(c),
                        0,
                    ),
                    5 => nvme_admin(admin_opcode::ASYNC_EVENT_REQUEST, cid, 0, 0, 0, 0),
                    6 => nvme_admin(admin_opcode::ABORT, cid, 0, u32::from(c) << 16, 0, 0),
                    _ => {
                        let mut command = NvmeCommand::zeroed();
                        command
                            .set_opcode(admin_opcode::FABRICS)
                            .set_cid(cid)
                            .set_fctype(fctype::DISCONNECT);
                        command
                    }
                };
                nvme_capsule(&framing, &command, &[])
            }
            6 => {
                // Read of `a` blocks at `c` (an offset), SGL length right or (`b` bit 7) off
                // by a block.
                if well_formed {
                    blocks = blocks.min(2048);
                }
                effect = Some((slba, blocks, NvmeEffect::Read));
                let mut command = NvmeCommand::io(
                    io_opcode::READ,
                    cid,
                    nsid,
                    slba,
                    blocks.clamp(1, 0x1_0000),
                    false,
                );
                let mut length = blocks.saturating_mul(block_bytes);
                if b & 0x80 != 0 && !well_formed {
                    length = length.wrapping_add(block_bytes);
                }
                nvme_transport_sgl(&mut command, length);
                nvme_capsule(&framing, &command, &[])
            }
            7 | 8 => {
                // Write of `a` blocks at `c`, FUA by `b` bit 6: its data in the capsule (7),
                // or sent when the controller's R2T asks for it (8). The capsule carries at
                // most 64 KiB (a longer command's length stays in its fields); an R2T gets
                // what it asks for, zeroes past the 64 KiB kept.
                let in_capsule = op == 7;
                if well_formed {
                    let max_bytes = if in_capsule {
                        4096
                    } else {
                        PAYLOAD_BYTES_MAX as u32
                    };
                    blocks = blocks.clamp(1, (max_bytes / block_bytes).max(1));
                }
                let blocks = blocks.clamp(1, 0x1_0000);
                let length = blocks.saturating_mul(block_bytes);
                let fill = (cid as u8) | 1;
                effect = Some((slba, blocks, NvmeEffect::Write(fill)));
                let data = vec![fill; (length as usize).min(PAYLOAD_BYTES_MAX)];
                let mut command =
                    NvmeCommand::io(io_opcode::WRITE, cid, nsid, slba, blocks, b & 0x40 != 0);
                if in_capsule {
                    command.set_sgl(nvme_command::SglDescriptor {
                        address: 0,
                        length: data.len() as u32,
                        identifier: sgl::DATA_BLOCK_OFFSET,
                    });
                    nvme_capsule(&framing, &command, &data)
                } else {
                    if well_formed {
                        // The data goes out when the R2T arrives, whatever the budget is
                        // then: it counts now.
                        if self.outcome.bytes_sent + 128 + data.len() > SEND_BYTES_MAX {
                            return;
                        }
                        self.outcome.bytes_sent += data.len();
                    }
                    nvme_transport_sgl(&mut command, length);
                    nvme.r2t_data.insert(cid, data);
                    nvme_capsule(&framing, &command, &[])
                }
            }
            9 => {
                // `a % 3`: Flush, Write Zeroes (deallocate by `b` bit 5), Dataset Management
                // deallocating `c % 4 + 1` ranges.
                match a % 3 {
                    0 => {
                        let mut command = NvmeCommand::zeroed();
                        command
                            .set_opcode(io_opcode::FLUSH)
                            .set_cid(cid)
                            .set_nsid(nsid);
                        nvme_capsule(&framing, &command, &[])
                    }
                    1 => {
                        let blocks =
                            nvme_blocks(a >> 2).clamp(1, if tracked { 8 } else { 0x1_0000 });
                        effect = Some((slba, blocks, NvmeEffect::Write(0)));
                        let mut command = NvmeCommand::io(
                            io_opcode::WRITE_ZEROES,
                            cid,
                            nsid,
                            slba,
                            blocks,
                            false,
                        );
                        if b & 0x20 != 0 {
                            let cdw12 = command.cdw12() | (1 << 25);
                            command.set_cdw(12, cdw12);
                        }
                        nvme_capsule(&framing, &command, &[])
                    }
                    _ => {
                        // Tracked: two ranges of at most 4 blocks, 4 apart.
                        let (ranges, stride, count) = if tracked {
                            (2, 4, nvme_blocks(a >> 2).min(4))
                        } else {
                            (usize::from(c % 4) + 1, 16, nvme_blocks(a >> 2).min(2048))
                        };
                        effect = Some((
                            slba,
                            (ranges as u32 - 1) * stride + count,
                            NvmeEffect::Unknown,
                        ));
                        let mut data = Vec::with_capacity(ranges * nvme_command::DSM_RANGE_SIZE);
                        for range in 0..ranges {
                            data.extend(
                                nvme_command::DsmRange {
                                    attributes: 0,
                                    block_count: count,
                                    slba: slba + range as u64 * u64::from(stride),
                                }
                                .encode(),
                            );
                        }
                        let mut command = nvme_admin(
                            io_opcode::DATASET_MANAGEMENT,
                            cid,
                            nsid,
                            (ranges - 1) as u32,
                            1 << 2,
                            0,
                        );
                        command.set_sgl(nvme_command::SglDescriptor {
                            address: 0,
                            length: data.len() as u32,
                            identifier: sgl::DATA_BLOCK_OFFSET,
                        });
                        nvme_capsule(&framing, &command, &data)
                    }
                }
            }
            10 => {
                // An H2CData PDU of fuzzed fields: the last command's or a raw CCCID, a raw
                // TTAG, an offset and length from the tables, LAST_PDU by `b` bit 7.
                let cccid = if b & 0x40 != 0 {
                    c
                } else {
                    cid.wrapping_sub(1)
                };
                let length = (length_bytes(b & 0x3f) as usize).min(PAYLOAD_BYTES_MAX);
                let data = vec![a; length];
                nvme_h2c_data(
                    &framing,
                    DataHeader {
                        cccid,
                        ttag: u16::from(a),
                        offset: (offset_bytes(c) as u32) & 0xf_ffff,
                        length: length as u32,
                    },
                    b & 0x80 != 0,
                    &data,
                )
            }
            _ => {
                // A host TermReq (`a` bit 0), or a header of a raw PDU type with fuzzed HLEN,
                // PDO and PLEN (the bytes after it come from later steps).
                if a & 1 == 0 {
                    let error = nvme_pdu::PduError::new(
                        nvme_pdu::FatalError::InvalidHeaderField,
                        u32::from(b) as usize,
                        "fuzz",
                    );
                    let mut out = vec![0u8; nvme_pdu::TERM_HLEN + nvme_pdu::TERM_DATA_MAX];
                    let length = nvme_pdu::encode_term_req(false, &error, &[a; 8], &mut out);
                    out.truncate(length);
                    out
                } else {
                    let plen = u32::from(c);
                    let mut header = vec![a >> 1, b, b.wrapping_add(8), a >> 3];
                    header.extend(plen.to_le_bytes());
                    header.resize(usize::from(b.wrapping_add(8)).min(128), 0);
                    header
                }
            }
        };
        if tracked
            && let Some((first, count, effect)) = effect
            && let Some(nvme) = self.clients[index].nvme.as_mut()
        {
            nvme.data.track(cid, first, count, effect);
        }
        self.nvme_send(index, bytes, Some(cid));
    }
}

// ---------------------------------------------------------------------------------------------
// The run.

/// What a run did (for regression tests and the trace).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub connections: usize,
    pub connects_refused: usize,
    pub bytes_sent: usize,
    pub bytes_received: usize,
    /// Complete native and original response headers the clients parsed.
    pub responses: u64,
    /// Native answers with status BUSY among them (requests refused at a drain timeout).
    pub busy_answers: u64,
    /// Virtual time at which the shutdown finished.
    pub finished_at: Nanos,
    pub requests_answered: u64,
    pub connections_timed_out: u64,
    pub framing_errors: u64,
    /// [`Mode::WellFormed`]: requests the clients sent, each answered exactly once.
    pub requests_sent: u64,
    /// When the final shutdown began.
    pub shutdown_started_at: Nanos,
    /// Devices still stalled when the final shutdown began.
    pub stalled_devices: usize,
    /// Device operations the threads abandoned at shutdown (only on stalled devices).
    pub abandoned_device_operations: u32,
    /// [`Mode::WellFormed`]: GET answers of private keys checked against the client's model
    /// (value or NOT_FOUND).
    pub kv_gets_checked: u64,
    /// NVMe/TCP: connections, controller PDUs and completions the hosts parsed, R2Ts they
    /// answered.
    pub nvme_connections: u64,
    pub nvme_pdus: u64,
    pub nvme_completions: u64,
    pub nvme_r2ts: u64,
    /// [`Mode::WellFormed`]: blocks of the composite namespace NVMe/TCP hosts read back and
    /// compared with what they wrote.
    pub nvme_blocks_checked: u64,
    /// Inter-core migration: reads the threads served for each other.
    pub migrated_reads: u64,
}

/// What the clients of a run may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Anything the steps say: raw bytes, broken headers, closes, resets, shutdown midway.
    Any,
    /// Only well-formed clients ([`Run::well_formed_step`]): what is fuzzed is timing and
    /// ordering, and every request must get exactly one answer.
    WellFormed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Native,
    Original,
    Nbd,
    Kv,
    NvmeTcp,
}

struct Client {
    socket: SocketId,
    kind: Kind,
    /// The listener it connected to, by index.
    listener: usize,
    reading: bool,
    /// The client closed or reset its side: it sends nothing more.
    done_sending: bool,
    responses: ResponseStream,
    /// [`Mode::WellFormed`]: the requests in flight and the parser that matches answers.
    oracle: Option<Oracle>,
    /// On the TLS listener: the client's TLS session (what it sends is encrypted, what it
    /// reads decrypted; the protocol inside is the same).
    tls: Option<ClientTls>,
    /// On the NVMe/TCP listener: the host's connection state.
    nvme: Option<NvmeClient>,
}

/// A client's view of the server's bytes: complete response headers parsed, their payloads
/// skipped (never buffered).
#[derive(Default)]
struct ResponseStream {
    pending: Vec<u8>,
    skip_bytes: u64,
    headers: u64,
    /// Native answers with status BUSY.
    busy: u64,
}

impl ResponseStream {
    fn feed(&mut self, kind: Kind, mut input: &[u8]) {
        if matches!(kind, Kind::Nbd | Kind::NvmeTcp) {
            return;
        }
        loop {
            if self.skip_bytes > 0 {
                let skipped = (input.len() as u64).min(self.skip_bytes);
                self.skip_bytes -= skipped;
                input = &input[skipped as usize..];
                if self.skip_bytes > 0 {
                    return;
                }
            }
            let header_size = match kind {
                Kind::Native => native::RESPONSE_HEADER_SIZE,
                Kind::Kv => kv::RESPONSE_HEADER_SIZE,
                _ => original::HEADER_SIZE,
            };
            let wanted = header_size - self.pending.len();
            let taken = wanted.min(input.len());
            self.pending.extend_from_slice(&input[..taken]);
            input = &input[taken..];
            if self.pending.len() < header_size {
                return;
            }
            self.skip_bytes = match kind {
                Kind::Native => match native::decode_response(&self.pending) {
                    Ok(Some((header, _))) => {
                        match header.status() {
                            Ok(native::Status::Busy) => self.busy += 1,
                            Ok(_) => {}
                            Err(e) => panic!("the server sent an unknown status: {e}: {header:?}"),
                        }
                        u64::from(header.length_bytes)
                    }
                    other => panic!(
                        "a native client received broken framing: {other:?} from {:02x?}",
                        self.pending
                    ),
                },
                Kind::Kv => match kv::decode_response(&self.pending) {
                    Ok(Some((header, _))) => {
                        kv_check_answer(&header);
                        u64::from(header.value_length_bytes)
                    }
                    other => panic!(
                        "a KV client received broken framing: {other:?} from {:02x?}",
                        self.pending
                    ),
                },
                _ => match original::Header::decode(&self.pending) {
                    Ok(Some((header, _))) => header.response_payload_length_bytes(),
                    other => panic!(
                        "an original-protocol client received broken framing: {other:?} from {:02x?}",
                        self.pending
                    ),
                },
            };
            self.pending.clear();
            self.headers += 1;
        }
    }
}

/// What every KV answer must be: a known status, and a value only on a GET's `OK`.
fn kv_check_answer(header: &kv::ResponseHeader) {
    let status = match kv::Status::from_u16(header.status_raw) {
        Ok(status) => status,
        Err(e) => panic!("the server sent an unknown KV status: {e}: {header:?}"),
    };
    let carries_value = status == kv::Status::Ok && header.opcode_raw == kv::Opcode::Get.as_u8();
    assert!(
        carries_value || header.value_length_bytes == 0,
        "a KV answer other than a GET's OK carries a value: {header:?}"
    );
}

fn mem_profile() -> DeviceProfile {
    static PROFILE: OnceLock<DeviceProfile> = OnceLock::new();
    PROFILE
        .get_or_init(|| {
            match DeviceProfile::from_toml(include_str!("../../profiles/device-a-small.toml")) {
                Ok(profile) => profile,
                Err(e) => panic!("device-a-small profile: {e}"),
            }
        })
        .clone()
}

fn emu_profile() -> reflex_flash::emu::EmuProfile {
    static PROFILE: OnceLock<reflex_flash::emu::EmuProfile> = OnceLock::new();
    PROFILE
        .get_or_init(
            || match reflex_flash::emu::EmuProfile::lookup("device-a-small") {
                Ok(profile) => profile,
                Err(e) => panic!("emulated device-a-small: {e}"),
            },
        )
        .clone()
}

/// The virtual server a configuration describes, and the fault controls of its namespaces'
/// devices (every device is wrapped in a fault-injecting one, injecting nothing at first).
pub fn server(
    setup: &Setup,
) -> Result<(VirtualServer, Vec<Arc<FaultControls>>), VirtualServerError> {
    let mem = |bytes: u64| match MemDevice::new(bytes) {
        Ok(device) => device,
        Err(e) => panic!("memory device: {e}"),
    };
    let model: Arc<dyn Device> = if setup.emulated {
        let device = match reflex_flash::emu::EmuDevice::new(emu_profile(), MODEL_BYTES, 1) {
            Ok(device) => device,
            Err(e) => panic!("emulated device: {e}"),
        };
        Arc::new(ModelFlash::new(
            Box::new(EmuSimDevice::new(device)),
            "emulated device-a-small",
        ))
    } else {
        let mut device = FixedDevice::new(2, 50_000, 200_000, setup.model_queue_depth);
        device.set_capacity_bytes(MODEL_BYTES);
        Arc::new(ModelFlash::new(Box::new(device), "fixed latency"))
    };
    let qos_config = QosConfig {
        tenant_queue_depth_max: setup.tenant_queue_depth_max,
        thread_queued_requests_max: setup.thread_queued_requests_max,
        tenants_max: setup.tenants_max,
        fairness: if setup.migration {
            // As the migration simulator test's stress server: reads move whatever the load.
            reflex_qos::FairQueueConfig {
                mode: reflex_qos::FairMode::Fifo,
                be_device_depth_max: 2,
                monitor: reflex_qos::FairnessConfig {
                    window_us: 1_000,
                    samples_min: 1,
                    ..reflex_qos::FairnessConfig::default()
                },
                migration: reflex_qos::MigrationConfig {
                    enabled: true,
                    flows: reflex_qos::MigrationFlows::All,
                    requires_imbalance: false,
                    in_transit_per_pair_max: 4,
                    ..reflex_qos::MigrationConfig::default()
                },
                ..reflex_qos::FairQueueConfig::default()
            }
        } else if setup.fairness {
            reflex_qos::FairQueueConfig {
                mode: reflex_qos::FairMode::FairShare,
                be_device_depth_max: 2,
                held_max: 8,
                ..reflex_qos::FairQueueConfig::default()
            }
        } else {
            reflex_qos::FairQueueConfig::default()
        },
        ..QosConfig::default()
    };
    let namespace = |index: usize, profile: Option<DeviceProfile>, tenants| NamespaceControl {
        namespace_id: NAMESPACE_IDS[index],
        profile,
        tenants,
    };
    let mut devices: Vec<Arc<dyn Device>> = vec![
        Arc::new(mem(MEM_BYTES)),
        model,
        Arc::new(mem(READ_ONLY_BYTES)),
        Arc::new(mem(KV_BYTES)),
    ];
    if setup.composite.is_some() {
        devices.push(Arc::new(mem(MEMBER_BYTES)));
        devices.push(Arc::new(mem(MEMBER_BYTES)));
    }
    let mut controls = Vec::with_capacity(devices.len());
    let mut namespaces = Vec::with_capacity(devices.len());
    for (index, inner) in devices.into_iter().enumerate() {
        // The harness lifts stalls itself between instants: a stalled queue need not ask to
        // be polled every millisecond of virtual time to notice.
        let plan = if index == usize::from(KV_NAMESPACE_INDEX) {
            FaultPlan {
                delay: Some(Delay {
                    added: KV_DELAY,
                    pick: DelayPick::Every(NonZeroU64::MIN),
                }),
                ..FaultPlan::default()
            }
        } else {
            FaultPlan::default()
        };
        let device = match FaultDevice::new(inner, plan) {
            Ok(device) => device.without_stall_recheck(),
            Err(e) => panic!("fault device: {e}"),
        };
        controls.push(device.controls());
        let read_only = index == 2;
        let id = NAMESPACE_IDS
            .get(index)
            .copied()
            .unwrap_or_else(|| MEMBER_IDS[index - NAMESPACE_IDS.len()]);
        namespaces.push((id, Arc::new(device) as Arc<dyn Device>, read_only));
    }
    let mut composites = Vec::new();
    let mut controls_extra = Vec::new();
    if let Some(spec) = setup.composite {
        match reflex_dataplane::composite::CompositeSpec::parse(spec) {
            Ok(spec) => composites.push((COMPOSITE_ID, spec)),
            Err(e) => panic!("composite {spec}: {e}"),
        }
        for id in MEMBER_IDS.into_iter().chain([COMPOSITE_ID]) {
            controls_extra.push(NamespaceControl {
                namespace_id: id,
                profile: None,
                tenants: Vec::new(),
            });
        }
    }
    let server = VirtualServer::new(VirtualServerSetup {
        threads: setup.threads,
        namespaces,
        composites,
        control: ControlSetup {
            threads: setup.threads,
            handles: HandleKeys::Seeded(HANDLE_SEED),
            tenant_limits: TenantLimits::default(),
            qos_config: qos_config.clone(),
            qos_enabled: setup.qos_enabled,
            namespaces: vec![
                namespace(
                    0,
                    Some(mem_profile()),
                    vec![
                        (
                            "lc".into(),
                            TenantSpec::LatencyCritical {
                                latency_us_p95: 1000,
                                iops: 2000,
                                read_percent: 90,
                            },
                        ),
                        ("be".into(), TenantSpec::BestEffort),
                    ],
                ),
                namespace(1, None, Vec::new()),
                namespace(2, None, Vec::new()),
                namespace(3, None, Vec::new()),
            ]
            .into_iter()
            .chain(controls_extra)
            .collect(),
        },
        qos_config,
        limits: setup.limits.clone(),
        network: setup.network,
        listeners: listeners(setup),
        nbd_exports: exports(),
        nbd_default_export: Some("ns1".into()),
    })?;
    Ok((server, controls))
}

struct Run {
    server: VirtualServer,
    faults: Vec<Arc<FaultControls>>,
    setup: Setup,
    clients: Vec<Client>,
    readable: Vec<SocketId>,
    received: Vec<u8>,
    instants: usize,
    outcome: Outcome,
    trace: bool,
    /// After a well-formed script, clients read within an instant as bytes arrive
    /// (`VirtualServer::set_client_draining`), not only between instants.
    draining_answers: bool,
}

/// Runs a script; panics on any violated invariant. `trace` prints each step and what it did.
pub fn run(script: &Script, trace: bool) -> Outcome {
    run_mode(script, Mode::Any, trace)
}

/// Runs a script with the clients `mode` allows.
pub fn run_mode(script: &Script, mode: Mode, trace: bool) -> Outcome {
    run_with(script, mode, trace, true)
}

/// As [`run_mode`], but after a well-formed script the clients read their answers only
/// between instants, as the `dataplane_protocol` target's clients did up to finding 8 (a
/// 4 KiB client buffer then drains 4 KiB per event, a slow reader).
pub fn run_mode_slow_readers(script: &Script, mode: Mode, trace: bool) -> Outcome {
    run_with(script, mode, trace, false)
}

fn run_with(script: &Script, mode: Mode, trace: bool, draining_answers: bool) -> Outcome {
    let mut setup = script.config.decoded();
    if mode == Mode::WellFormed {
        // A timeout would close a client that is only slow, with its answers pending.
        let limits = &mut setup.limits;
        limits.handshake_timeout = None;
        limits.idle_timeout = None;
        limits.receive_timeout = None;
        limits.send_timeout = None;
        limits.device_timeout = None;
        setup.model_queue_depth = 1 << 16;
        // A host answers every R2T, but only when it reads.
        setup.nvme_options.r2t_timeout = Nanos::from_millis(3_600_000);
    }
    if trace {
        eprintln!("setup: {setup:?}");
    }
    let (server, faults) = match server(&setup) {
        Ok(started) => started,
        Err(e) => panic!("the virtual server did not start: {e}"),
    };
    let mut run = Run {
        server,
        faults,
        setup,
        clients: Vec::new(),
        readable: Vec::new(),
        received: Vec::new(),
        instants: 0,
        outcome: Outcome::default(),
        trace,
        draining_answers,
    };
    for step in &script.steps {
        if trace {
            eprintln!("[{:?}] {step:?}", run.server.now());
        }
        match mode {
            Mode::Any => run.step(step),
            Mode::WellFormed => run.well_formed_step(step),
        }
        run.settle();
        run.check_running();
    }
    if mode == Mode::WellFormed {
        run.await_answers();
    }
    run.shut_down();
    run.outcome
}

/// Decodes and runs fuzz input bytes (the `dataplane` target).
pub fn run_bytes(bytes: &[u8]) -> Outcome {
    run(&Script::decode(bytes), false)
}

/// Decodes fuzz input bytes and runs them with well-formed clients (the `dataplane_protocol`
/// target).
pub fn run_well_formed_bytes(bytes: &[u8]) -> Outcome {
    run_mode(&Script::decode(bytes), Mode::WellFormed, false)
}

impl Run {
    fn client(&self, socket: u8) -> Option<usize> {
        if self.clients.is_empty() {
            None
        } else {
            Some(usize::from(socket) % self.clients.len())
        }
    }

    fn send(&mut self, socket: u8, bytes: &[u8]) {
        let Some(index) = self.client(socket) else {
            return;
        };
        self.send_index(index, bytes);
    }

    /// Whether well-formed client `index` may send `length` more bytes: within the script's
    /// send budget, and nothing of it refused before (after a refusal it sends nothing more).
    fn within_budget(&mut self, index: usize, length: usize) -> bool {
        let fits = self.outcome.bytes_sent + length <= SEND_BYTES_MAX;
        match self.clients[index].oracle.as_mut() {
            Some(oracle) if oracle.out_of_budget => false,
            Some(oracle) if !fits => {
                oracle.out_of_budget = true;
                false
            }
            _ => fits,
        }
    }

    /// Client `index` sends `bytes` (within the script's send budget).
    fn send_index(&mut self, index: usize, bytes: &[u8]) {
        let client = &self.clients[index];
        if client.done_sending || bytes.is_empty() {
            return;
        }
        let room = SEND_BYTES_MAX - self.outcome.bytes_sent;
        let bytes = &bytes[..bytes.len().min(room)];
        if self.trace {
            eprintln!("  send {} bytes on {:?}", bytes.len(), client.socket);
        }
        self.outcome.bytes_sent += bytes.len();
        self.transmit(index, bytes);
    }

    /// Hands a client's bytes to its socket: as they are, or through its TLS session
    /// (with whatever the session has to send besides: the ClientHello, its Finished).
    fn transmit(&mut self, index: usize, bytes: &[u8]) {
        let client = &mut self.clients[index];
        let socket = client.socket;
        let Some(tls) = client.tls.as_mut() else {
            self.server.client_send(socket, bytes);
            return;
        };
        if client.done_sending {
            return;
        }
        let ciphertext = tls.encrypt(bytes);
        if !ciphertext.is_empty() {
            self.server.client_send(socket, &ciphertext);
        }
    }

    /// What a TLS client makes of the bytes it read: the plaintext inside (a session the
    /// server broke yields nothing more).
    fn decrypt(&mut self, index: usize, received: &mut Vec<u8>) {
        let Some(tls) = self.clients[index].tls.as_mut() else {
            return;
        };
        *received = tls.decrypt(received);
        // The handshake's last message, once the server's Finished arrived.
        self.transmit(index, &[]);
    }

    fn step(&mut self, step: &Step) {
        match *step {
            Step::Connect {
                thread,
                listener,
                source,
            } => self.connect(thread, listener, source),
            Step::Raw { socket, ref bytes } => self.send(socket, bytes),
            Step::Native {
                socket,
                opcode,
                flags,
                id,
                namespace,
                offset,
                length,
                body,
            } => {
                let bytes = native_request(opcode, flags, id, namespace, offset, length, body);
                self.send(socket, &bytes);
            }
            Step::Original {
                socket,
                opcode,
                handle,
                lba,
                count,
                payload,
            } => self.send(
                socket,
                &original_request(opcode, handle, lba, count, payload),
            ),
            Step::NbdFlags { socket, flags } => self.send(socket, &nbd_flags(flags)),
            Step::NbdOption {
                socket,
                option,
                export,
                info,
                mode,
            } => self.send(socket, &nbd_option(option, export, info, mode)),
            Step::NbdGo {
                socket,
                export,
                variant,
            } => self.send(socket, &nbd_go(export, variant)),
            Step::NbdRequest {
                socket,
                command,
                flags,
                cookie,
                offset,
                length,
            } => self.send(socket, &nbd_request(command, flags, cookie, offset, length)),
            Step::Advance { mode } => self.advance(mode),
            Step::Read { socket, mode } => {
                if let Some(index) = self.client(socket) {
                    if mode & 1 == 0 {
                        let socket = self.clients[index].socket;
                        self.read(index, socket);
                    } else {
                        let client = &mut self.clients[index];
                        client.reading = !client.reading;
                        if client.reading {
                            let socket = client.socket;
                            self.read(index, socket);
                        }
                    }
                }
            }
            Step::Close { socket } => {
                if let Some(index) = self.client(socket) {
                    let client = &mut self.clients[index];
                    if !client.done_sending {
                        client.done_sending = true;
                        self.server.client_close(client.socket);
                    }
                }
            }
            Step::Reset { socket } => {
                if let Some(index) = self.client(socket) {
                    let client = &mut self.clients[index];
                    client.done_sending = true;
                    self.server.client_reset(client.socket);
                }
            }
            Step::FailAccept {
                thread,
                listener,
                errno,
            } => {
                let thread = u16::from(thread) % self.setup.threads;
                let listener = u32::from(listener) % listeners(&self.setup).len() as u32;
                let errno =
                    [libc::EMFILE, libc::ECONNABORTED, libc::ENOBUFS][usize::from(errno % 3)];
                self.server.fail_accept(thread, listener, errno);
            }
            Step::Shutdown => self.server.begin_shutdown(),
            Step::Nvme {
                socket,
                op,
                a,
                b,
                c,
            } => {
                if let Some(index) = self.client_of_kind(socket, Kind::NvmeTcp) {
                    self.nvme_pdus(index, op, a, b, c, false);
                }
            }
            Step::Kv {
                socket,
                opcode,
                id,
                key,
                value,
                fill,
            } => self.send(socket, &kv_request(opcode, id, key, value, fill)),
            Step::Fault {
                namespace,
                kind,
                a,
                b,
            } => {
                let controls = &self.faults[usize::from(namespace) % self.faults.len()];
                let mut plan = controls.plan();
                fault(&mut plan, kind, a, b);
                if self.trace {
                    eprintln!("  plan {plan}");
                }
                if let Err(e) = controls.set_plan(plan) {
                    panic!("the script made an invalid fault plan: {e}");
                }
            }
        }
    }

    fn connect(&mut self, thread: u8, listener: u8, source: u8) {
        if self.clients.len() >= SOCKETS_MAX {
            return;
        }
        let listeners = listeners(&self.setup);
        let thread = u16::from(thread) % self.setup.threads;
        let listener_index = usize::from(listener) % listeners.len();
        let source_selector = source;
        let source = match source % 4 {
            0 => None,
            1 => Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))),
            2 => Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2))),
            _ => Some(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        };
        match self.server.connect(thread, listener_index as u32, source) {
            Ok(socket) => {
                // Finding 1: the dataplane handed out a slot whose previous connection's
                // close was still queued (reflexd's io_uring driver asserted and the thread
                // panicked).
                assert_eq!(
                    self.server.slot_reuses_before_close(),
                    0,
                    "{socket:?} got a connection slot whose previous connection's close the \
                     driver had not taken yet"
                );
                let kind = match listeners[listener_index] {
                    VirtualListener::Native | VirtualListener::NativeTls(_) => Kind::Native,
                    VirtualListener::Original { .. } => Kind::Original,
                    VirtualListener::Nbd => Kind::Nbd,
                    VirtualListener::Kv { .. } => Kind::Kv,
                    VirtualListener::NvmeTcp(_) => Kind::NvmeTcp,
                };
                if self.trace {
                    eprintln!("  connected {socket:?} ({kind:?})");
                }
                self.outcome.connections += 1;
                // Certificate or pre-shared key: the source selector's upper bits choose.
                let tls = matches!(listeners[listener_index], VirtualListener::NativeTls(_))
                    .then(|| tls_client((source_selector / 4) % 2 == 1));
                self.clients.push(Client {
                    socket,
                    kind,
                    listener: listener_index,
                    reading: true,
                    done_sending: false,
                    responses: ResponseStream::default(),
                    oracle: None,
                    tls,
                    nvme: (kind == Kind::NvmeTcp).then(NvmeClient::default),
                });
                if self
                    .clients
                    .last()
                    .is_some_and(|client| client.tls.is_some())
                {
                    // The ClientHello goes out at once.
                    self.transmit(self.clients.len() - 1, &[]);
                }
            }
            Err(VirtualServerError::NotAccepting { .. } | VirtualServerError::Refused(_)) => {
                if self.trace {
                    eprintln!("  not connected");
                }
                self.outcome.connects_refused += 1;
            }
            Err(e) => panic!("connect failed: {e}"),
        }
    }

    /// Virtual time passes: `mode % 16` 0–3 to the next event, 4–11 steps through events for
    /// 1 µs, 10 µs, 100 µs, 1 ms, 10 ms, 100 ms, 500 ms or 2 s, 12–15 jumps straight over
    /// 1 ms, 100 ms, 1 s or 5 s (a driver that woke up late).
    fn advance(&mut self, mode: u8) {
        const STEP_NS: [u64; 8] = [
            1_000,
            10_000,
            100_000,
            1_000_000,
            10_000_000,
            100_000_000,
            500_000_000,
            2_000_000_000,
        ];
        const JUMP_NS: [u64; 4] = [1_000_000, 100_000_000, 1_000_000_000, 5_000_000_000];
        let now = self.server.now();
        match mode % 16 {
            0..=3 => {
                if self.instants < INSTANTS_MAX
                    && let Some(next) = self.server.next_event()
                {
                    self.instant(next);
                }
            }
            selector @ 4..=11 => {
                let target = now + Nanos(STEP_NS[usize::from(selector - 4)]);
                for _ in 0..INSTANTS_PER_ADVANCE_MAX {
                    if self.instants >= INSTANTS_MAX {
                        break;
                    }
                    match self.server.next_event() {
                        Some(next) if next <= target => self.instant(next),
                        _ => break,
                    }
                }
                self.instant(target.max(self.server.now()));
            }
            selector => {
                let target = now + Nanos(JUMP_NS[usize::from(selector - 12)]);
                self.instant(target);
            }
        }
    }

    /// Runs one instant and lets the reading clients read.
    fn instant(&mut self, at: Nanos) {
        self.instants += 1;
        self.server.run_instant(at);
        self.read_clients();
    }

    /// Finishes the work due now.
    fn settle(&mut self) {
        let now = self.server.now();
        self.server.run_instant(now);
        self.read_clients();
    }

    fn read_clients(&mut self) {
        let mut readable = std::mem::take(&mut self.readable);
        self.server.take_readable(&mut readable);
        readable.sort_unstable();
        readable.dedup();
        for socket in readable.drain(..) {
            if let Some(index) = self.clients.iter().position(|c| c.socket == socket)
                && self.clients[index].reading
            {
                self.read(index, socket);
            }
        }
        self.readable = readable;
    }

    fn read(&mut self, index: usize, socket: SocketId) {
        let mut received = std::mem::take(&mut self.received);
        received.clear();
        self.server.client_read(socket, &mut received);
        self.outcome.bytes_received += received.len();
        self.decrypt(index, &mut received);
        let client = &mut self.clients[index];
        client.responses.feed(client.kind, &received);
        if client.nvme.is_some() {
            self.nvme_received(index, &received);
        } else if client.oracle.is_some() {
            self.answers(index, &received);
        }
        let client = &self.clients[index];
        if self.trace && !received.is_empty() {
            eprintln!(
                "  {socket:?} read {} bytes ({} response headers so far){}",
                received.len(),
                client.responses.headers,
                if self.server.is_server_closed(socket) {
                    ", closed by the server"
                } else {
                    ""
                }
            );
        }
        self.received = received;
    }

    /// What an NVMe/TCP client makes of the controller's bytes: its completions (each
    /// answers a request in flight, for a well-formed client), and the data of the writes
    /// whose R2Ts arrived (sent at once: a host answers an R2T).
    fn nvme_received(&mut self, index: usize, received: &[u8]) {
        let mut completions = Vec::new();
        let Some(nvme) = self.clients[index].nvme.as_mut() else {
            return;
        };
        let replies = nvme.feed(received, &mut completions);
        if self.trace {
            for completion in &completions {
                eprintln!(
                    "  {:?} completion cid {} status {:?} dw0 {:#x}",
                    self.clients[index].socket, completion.cid, completion.status, completion.dw0
                );
            }
            if !replies.is_empty() {
                eprintln!("  R2T data: {} bytes", replies.len());
            }
        }
        if let Some(oracle) = self.clients[index].oracle.as_mut() {
            for completion in &completions {
                oracle.answered(u64::from(completion.cid));
            }
            // The data was counted with its command.
            if !replies.is_empty() && !self.clients[index].done_sending {
                self.transmit(index, &replies);
            }
        } else if !replies.is_empty() {
            self.send_index(index, &replies);
        }
    }

    /// Checks that hold at any time.
    fn check_running(&self) {
        for thread in 0..self.setup.threads {
            let states = &self.server.dataplane(thread).stats().requests_per_state;
            let total: u64 = states.iter().map(|&count| u64::from(count)).sum();
            assert_eq!(
                total,
                u64::from(self.setup.limits.requests_max),
                "thread {thread}: requests per state {states:?} do not add up to the slots"
            );
        }
        assert!(
            !self.spinning(),
            "a thread has no work and a deadline that has passed (its driver would spin); per \
             thread: {}",
            self.thread_states()
        );
    }

    /// The graceful shutdown, run to its end, and the checks on what it left.
    fn shut_down(&mut self) {
        self.outcome.stalled_devices = self.faults.iter().filter(|c| c.is_stalled()).count();
        if self.trace {
            for tenant in self.server.control().tenants() {
                eprintln!(
                    "  tenant {:?} handle {:#x}: {:?}, connections {:?}",
                    tenant.name, tenant.handle, tenant.spec, tenant.connections_per_thread
                );
            }
        }
        if self.trace {
            for (thread, stats) in self.server.stats().iter().enumerate() {
                eprintln!(
                    "  thread {thread}: migrated sent {}, served {}, refused {}",
                    stats.migrated_sent, stats.migrated_served, stats.migrated_refused
                );
            }
        }
        self.server.begin_shutdown();
        self.settle();
        let started = self.server.now();
        self.outcome.shutdown_started_at = started;
        let mut instants = 0;
        while !self.server.is_finished() {
            let now = self.server.now();
            let next = self.server.next_event();
            assert!(
                instants < SHUTDOWN_INSTANTS_MAX,
                "shutdown still running after {instants} instants (virtual time {now:?}, next \
                 event {next:?}); per thread: {}",
                self.thread_states()
            );
            // Finding 4: a draining thread reported its passed drain deadline while waiting
            // for requests in a scheduler, and a driver woke up again and again.
            assert!(
                !self.spinning(),
                "shutdown spins at {now:?}: no thread has work and a deadline has passed; per \
                 thread: {}",
                self.thread_states()
            );
            let Some(next) = next else {
                panic!(
                    "shutdown stalled at {now:?}: nothing more happens and it has not finished; \
                     per thread: {}",
                    self.thread_states()
                );
            };
            assert!(
                next <= started + SHUTDOWN_TIME_MAX,
                "shutdown not finished {SHUTDOWN_TIME_MAX:?} after it began at {started:?} (next \
                 event {next:?}); per thread: {}",
                self.thread_states()
            );
            self.instant(next);
            instants += 1;
        }
        // Driver operations the dataplane asked for while finishing (closes) run now.
        self.settle();
        for client in &mut self.clients {
            client.reading = true;
        }
        let sockets: Vec<SocketId> = self.clients.iter().map(|c| c.socket).collect();
        for (index, socket) in sockets.into_iter().enumerate() {
            self.read(index, socket);
        }
        self.outcome.finished_at = self.server.now();
        self.check_finished();
    }

    /// A thread that has not finished waits with nothing to do and a deadline already passed:
    /// its driver would wake up at once, again and again.
    fn spinning(&self) -> bool {
        let now = self.server.now();
        (0..self.setup.threads).any(|thread| {
            let dataplane = self.server.dataplane(thread);
            !dataplane.is_finished()
                && !dataplane.has_pending_work()
                && dataplane.next_deadline().is_some_and(|at| at <= now)
        })
    }

    /// Each thread's shutdown state, deadline and requests per state (for failure messages).
    fn thread_states(&self) -> String {
        (0..self.setup.threads)
            .map(|thread| {
                let dataplane = self.server.dataplane(thread);
                format!(
                    "[thread {thread}: finished {}, next deadline {:?}, pending work {}, \
                     requests per state {:?}]",
                    dataplane.is_finished(),
                    dataplane.next_deadline(),
                    dataplane.has_pending_work(),
                    dataplane.stats().requests_per_state
                )
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn check_finished(&mut self) {
        let stalled = self.outcome.stalled_devices > 0;
        for thread in 0..self.setup.threads {
            let dataplane = self.server.dataplane(thread);
            let abandoned = dataplane.abandoned_device_operations();
            assert!(
                stalled || abandoned == 0,
                "thread {thread} abandoned {abandoned} device operations of devices that answer"
            );
            self.outcome.abandoned_device_operations += abandoned;
            // Requests whose device never answered stay orphaned (the device owns their
            // buffers), and key-value requests whose table step waits at the owner behind
            // one of those (at the bucket gate) stay forwarded (the owner may still use their
            // runs; `abandoned_device_operations` counts them); every other slot is free.
            let orphaned = dataplane.requests_in_state(RequestState::Orphaned);
            let forwarded = dataplane.requests_in_state(RequestState::Forwarded);
            assert!(
                orphaned + forwarded <= abandoned,
                "thread {thread}: {orphaned} orphaned and {forwarded} forwarded requests, \
                 {abandoned} abandoned operations"
            );
            for state in 0..REQUEST_STATE_COUNT {
                let state = request_state(state);
                let count = dataplane.requests_in_state(state);
                let expected = match state {
                    RequestState::Free => self.setup.limits.requests_max - orphaned - forwarded,
                    RequestState::Orphaned => orphaned,
                    RequestState::Forwarded => forwarded,
                    _ => 0,
                };
                assert_eq!(
                    count,
                    expected,
                    "thread {thread}: {count} requests {state:?} after shutdown; {}",
                    self.thread_states()
                );
            }
            let stats = dataplane.stats();
            self.outcome.requests_answered += stats.requests_answered;
            self.outcome.connections_timed_out += stats.connections_timed_out;
            self.outcome.framing_errors += stats.framing_errors;
            self.outcome.migrated_reads += stats.migrated_served;
        }
        for socket in 0..self.server.socket_count() {
            let socket = SocketId(socket as u32);
            assert!(
                self.server.is_server_closed(socket),
                "{socket:?} still open after shutdown"
            );
            assert!(
                !self.server.has_operations_in_flight(socket),
                "{socket:?} has a receive or send in flight after shutdown"
            );
        }
        for tenant in self.server.control().tenants() {
            assert!(
                tenant
                    .connections_per_thread
                    .iter()
                    .all(|&count| count == 0),
                "tenant {} still counts connections after shutdown: {:?}",
                tenant.name,
                tenant.connections_per_thread
            );
        }
        self.outcome.responses = self.clients.iter().map(|c| c.responses.headers).sum();
        self.outcome.busy_answers = self.clients.iter().map(|c| c.responses.busy).sum();
        for nvme in self.clients.iter().filter_map(|c| c.nvme.as_ref()) {
            self.outcome.nvme_connections += 1;
            self.outcome.nvme_pdus += nvme.pdus;
            self.outcome.nvme_completions += nvme.completions;
            self.outcome.nvme_r2ts += nvme.r2ts;
            self.outcome.nvme_blocks_checked += nvme.data.checked;
        }
        self.outcome.kv_gets_checked = self
            .clients
            .iter()
            .filter_map(|c| c.oracle.as_ref())
            .map(|oracle| oracle.kv.gets_checked)
            .sum();
    }
}

// ---------------------------------------------------------------------------------------------
// Well-formed clients.

/// The NBD exports a well-formed client asks for.
const WELL_FORMED_EXPORTS: [&str; 4] = ["ns1", "ns2", "ro", "ns1-ro"];
/// How long, in virtual time, the last answers may take once the script is over.
pub const ANSWERS_TIME_MAX: Nanos = Nanos(60_000_000_000);
/// The smallest reservation a well-formed client registers for a latency-critical tenant.
const WELL_FORMED_IOPS_MIN: u64 = 1_000;

/// Raises a latency-critical REGISTER body's reservation to [`WELL_FORMED_IOPS_MIN`]. A tenant
/// that reserved 1 IOPS earns one token a second and waits for its own tokens by contract: a
/// few 512 KiB reads (136 tokens each) put its answers minutes apart, past
/// [`ANSWERS_TIME_MAX`], though the server is keeping its promise (finding 22: answered after
/// 650 s of virtual time). At 1,000 IOPS the costliest request (a 1 MiB write) waits under
/// 3 s. The raw targets still register every reservation.
fn well_formed_reservation(body: &mut [u8]) {
    const CLASS_LATENCY_CRITICAL: u8 = 1;
    if body.len() != native::REGISTER_BODY_SIZE || body[0] != CLASS_LATENCY_CRITICAL {
        return;
    }
    let mut iops = [0u8; 8];
    iops.copy_from_slice(&body[16..24]);
    if (1..WELL_FORMED_IOPS_MIN).contains(&u64::from_le_bytes(iops)) {
        body[16..24].copy_from_slice(&WELL_FORMED_IOPS_MIN.to_le_bytes());
    }
}

/// A well-formed client's record of its requests and its parser of the answers.
struct Oracle {
    next_id: u64,
    /// Requests sent and not answered yet: id (request id, cookie or handle) → bytes of data a
    /// successful answer carries after its header (native answers say so themselves: 0).
    outstanding: BTreeMap<u64, u64>,
    /// An incomplete answer header.
    pending: Vec<u8>,
    skip_bytes: u64,
    /// NBD: the handshake (`None` once transmission began) and requests waiting for it.
    nbd: Option<(Option<nbd::ClientHandshake>, Vec<u8>)>,
    /// Original protocol: sectors of the listener's namespace.
    sectors: u64,
    /// Key-value: what the client knows of its private keys.
    kv: KvModel,
    /// A send of this client did not fit the script's send budget: it sends nothing more (a
    /// later, smaller message would follow one the server never saw: an NVMe/TCP Property
    /// Set without its ICReq and Connect is no well-formed host; finding 14).
    out_of_budget: bool,
}

/// A well-formed KV client's knowledge of its private keys (first byte `0x80 | client
/// index`: no other connection writes them), to check GET answers. Operations on one key take
/// effect in request order (`docs/KV.md` §3), so a GET sent when no write of its key is in
/// flight must see the outcome of the key's answered writes: the value of the last `OK` PUT,
/// or nothing after an `OK` or `NOT_FOUND` DELETE (a `TABLE_FULL` PUT changes nothing; any
/// other answer to a write makes the key unknown, unchecked from then on).
#[derive(Default)]
struct KvModel {
    /// Private keys with a value; a key in neither map is absent (the table starts empty).
    values: std::collections::HashMap<Vec<u8>, Vec<u8>>,
    unknown: std::collections::HashSet<Vec<u8>>,
    /// Writes of private keys in flight: id → key, and the value of a PUT (`None`: DELETE).
    writes: BTreeMap<u64, (Vec<u8>, Option<Vec<u8>>)>,
    /// GETs of private keys whose answer is known: id → the value (`None`: NOT_FOUND).
    gets: BTreeMap<u64, Option<Vec<u8>>>,
    /// A checked GET's value arriving: its id, the value expected, the bytes so far.
    capture: Option<(u64, Vec<u8>, Vec<u8>)>,
    /// GET answers checked so far.
    gets_checked: u64,
}

impl KvModel {
    /// Whether a GET of `key` sent now has a known answer, and which.
    fn expected(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        let written = self.writes.values().any(|(written, _)| written == key);
        (!written && !self.unknown.contains(key)).then(|| self.values.get(key).cloned())
    }

    /// The answer to request `id`; returns whether its value (the GET's) is to be captured.
    fn answered(&mut self, id: u64, status: kv::Status, value_bytes: u32) -> bool {
        if let Some((key, put)) = self.writes.remove(&id) {
            match (status, put) {
                (kv::Status::Ok, Some(value)) => {
                    self.unknown.remove(&key);
                    self.values.insert(key, value);
                }
                (kv::Status::Ok | kv::Status::NotFound, None) => {
                    self.unknown.remove(&key);
                    self.values.remove(&key);
                }
                (kv::Status::TableFull, Some(_)) => {}
                _ => {
                    self.values.remove(&key);
                    self.unknown.insert(key);
                }
            }
        }
        let Some(expected) = self.gets.remove(&id) else {
            return false;
        };
        self.gets_checked += 1;
        match (status, expected) {
            (kv::Status::Ok, Some(value)) => {
                assert_eq!(
                    value_bytes as usize,
                    value.len(),
                    "GET {id} of a private key: the value's length"
                );
                self.capture = Some((id, value, Vec::new()));
                true
            }
            (kv::Status::NotFound, None) => false,
            (status, expected) => panic!(
                "GET {id} of a private key answered {status:?}; expected {}",
                match expected {
                    Some(value) => format!("OK with {} bytes", value.len()),
                    None => "NOT_FOUND".into(),
                }
            ),
        }
    }
}

impl Oracle {
    /// Parses answers; panics on one that matches no request in flight.
    fn feed(&mut self, kind: Kind, mut input: &[u8]) {
        if kind == Kind::Kv {
            self.feed_kv(input);
            return;
        }
        loop {
            let skipped = (input.len() as u64).min(self.skip_bytes);
            self.skip_bytes -= skipped;
            input = &input[skipped as usize..];
            if self.skip_bytes > 0 || input.is_empty() {
                return;
            }
            let header_size = match kind {
                Kind::Native => native::RESPONSE_HEADER_SIZE,
                Kind::Original => original::HEADER_SIZE,
                Kind::Nbd => nbd::SIMPLE_REPLY_SIZE,
                Kind::Kv => unreachable!("KV answers go to feed_kv"),
                Kind::NvmeTcp => unreachable!("NVMe/TCP answers go to NvmeClient::feed"),
            };
            let taken = (header_size - self.pending.len()).min(input.len());
            self.pending.extend_from_slice(&input[..taken]);
            input = &input[taken..];
            if self.pending.len() < header_size {
                return;
            }
            self.skip_bytes = match kind {
                Kind::Native => match native::decode_response(&self.pending) {
                    Ok(Some((header, _))) => {
                        if header.request_id != native::NOTICE_REQUEST_ID {
                            self.answered(header.request_id);
                        }
                        u64::from(header.length_bytes)
                    }
                    other => panic!("a native client received broken framing: {other:?}"),
                },
                Kind::Original => match original::Header::decode(&self.pending) {
                    Ok(Some((header, _))) => {
                        let expected = self.answered(u64::from_le_bytes(header.handle));
                        let data = header.response_payload_length_bytes();
                        assert_eq!(data, expected, "original answer {header:?}: data length");
                        data
                    }
                    other => panic!("an original client received broken framing: {other:?}"),
                },
                Kind::Nbd => match nbd::decode_simple_reply(&self.pending) {
                    Ok(Some((reply, _))) => {
                        let expected = self.answered(reply.cookie);
                        if reply.error == 0 { expected } else { 0 }
                    }
                    other => panic!("an NBD client received a broken reply: {other:?}"),
                },
                Kind::Kv | Kind::NvmeTcp => unreachable!("parsed elsewhere"),
            };
            self.pending.clear();
        }
    }

    /// Parses KV answers: each must answer a request in flight, echo its opcode (kept as the
    /// request's data) and agree with [`KvModel`]; a checked GET's value is compared.
    fn feed_kv(&mut self, mut input: &[u8]) {
        loop {
            if let Some((id, expected, mut got)) = self.kv.capture.take() {
                let taken = (expected.len() - got.len()).min(input.len());
                got.extend_from_slice(&input[..taken]);
                input = &input[taken..];
                if got.len() < expected.len() {
                    self.kv.capture = Some((id, expected, got));
                    return;
                }
                assert!(
                    got == expected,
                    "GET {id} of a private key returned another value than its last PUT's"
                );
            }
            let skipped = (input.len() as u64).min(self.skip_bytes);
            self.skip_bytes -= skipped;
            input = &input[skipped as usize..];
            if self.skip_bytes > 0 || input.is_empty() {
                return;
            }
            let taken = (kv::RESPONSE_HEADER_SIZE - self.pending.len()).min(input.len());
            self.pending.extend_from_slice(&input[..taken]);
            input = &input[taken..];
            if self.pending.len() < kv::RESPONSE_HEADER_SIZE {
                return;
            }
            let header = match kv::decode_response(&self.pending) {
                Ok(Some((header, _))) => header,
                other => panic!("a KV client received broken framing: {other:?}"),
            };
            self.pending.clear();
            kv_check_answer(&header);
            let opcode = self.answered(header.request_id);
            assert_eq!(
                u64::from(header.opcode_raw),
                opcode,
                "KV answer {header:?}: the opcode echoed"
            );
            let status = match kv::Status::from_u16(header.status_raw) {
                Ok(status) => status,
                Err(e) => panic!("{e}"),
            };
            if !self
                .kv
                .answered(header.request_id, status, header.value_length_bytes)
            {
                self.skip_bytes = u64::from(header.value_length_bytes);
            }
        }
    }

    /// An answer to `id`: it must be in flight; returns the data it carries on success.
    fn answered(&mut self, id: u64) -> u64 {
        match self.outstanding.remove(&id) {
            Some(data) => data,
            None => panic!(
                "an answer to request {id}, which is not in flight (answered twice, or never \
                 sent); in flight: {:?}",
                self.outstanding.keys().collect::<Vec<_>>()
            ),
        }
    }
}

impl Run {
    /// The `selector`th client of `kind` (modulo their count).
    fn client_of_kind(&self, selector: u8, kind: Kind) -> Option<usize> {
        let count = self.clients.iter().filter(|c| c.kind == kind).count();
        if count == 0 {
            return None;
        }
        self.clients
            .iter()
            .enumerate()
            .filter(|(_, c)| c.kind == kind)
            .nth(usize::from(selector) % count)
            .map(|(index, _)| index)
    }

    /// A step as a well-formed client would take it: valid framing and whole payloads,
    /// request ids that are unique per connection, the NBD handshake done by the client
    /// codec, only timing faults; raw bytes, closes, resets, failed accepts and an early
    /// shutdown are left out. Requests may still be refused (bad range, unknown namespace,
    /// read-only): a refusal is an answer too.
    fn well_formed_step(&mut self, step: &Step) {
        match *step {
            Step::Connect {
                thread,
                listener,
                source,
            } => self.connect_well_formed(thread, listener, source),
            Step::Native {
                socket,
                opcode,
                flags,
                namespace,
                offset,
                length,
                body,
                ..
            } => {
                let Some(index) = self.client_of_kind(socket, Kind::Native) else {
                    return;
                };
                use native::Opcode::*;
                const OPCODES: [native::Opcode; 8] =
                    [Read, Write, Flush, Trim, Hello, Register, Bind, Unregister];
                // 9: none (the composite namespace, 4, is the NVMe/TCP hosts' private
                // regions in this mode).
                const NAMESPACES: [u32; 4] = [1, 2, 3, 9];
                // NATIVE_REPORT_BYTE: a REPORT (the other bytes as when the findings were
                // recorded).
                let opcode = if opcode == NATIVE_REPORT_BYTE {
                    Report
                } else {
                    OPCODES[usize::from(opcode % 8)]
                };
                let namespace_id = NAMESPACES[usize::from(namespace % 4)];
                let id = self.next_id(index);
                let mut control_body = native_body(opcode.as_u8(), namespace_id, body);
                if opcode == Register {
                    well_formed_reservation(&mut control_body);
                }
                let mut length = length_bytes(length);
                if !control_body.is_empty() {
                    length = control_body.len() as u32;
                } else if opcode == Write && length as usize > PAYLOAD_BYTES_MAX {
                    length = 4096;
                }
                let fua = flags & 1 != 0 && opcode == Write;
                let header = native::RequestHeader {
                    flags: if fua {
                        native::RequestFlags::FUA
                    } else {
                        native::RequestFlags::NONE
                    },
                    offset_bytes: offset_bytes(offset),
                    length_bytes: length,
                    namespace_id,
                    ..native::RequestHeader::new(opcode, id)
                };
                let mut bytes = header.to_bytes().to_vec();
                bytes.extend(control_body);
                if opcode == Write {
                    bytes.resize(bytes.len() + length as usize, id as u8);
                }
                self.send_request(index, bytes, id, 0);
            }
            Step::Original {
                socket,
                opcode,
                lba,
                count,
                ..
            } => {
                let Some(index) = self.client_of_kind(socket, Kind::Original) else {
                    return;
                };
                let count = [1u32, 8, 16, 128][usize::from(count % 4)];
                let sectors = self.clients[index].oracle.as_ref().map_or(0, |o| o.sectors);
                let lba = u64::from(lba) % (sectors - u64::from(count) + 1);
                let write = opcode % 2 == 1;
                let id = self.next_id(index);
                let header = original::Header {
                    opcode: if write {
                        original::Opcode::Write
                    } else {
                        original::Opcode::Read
                    },
                    handle: id.to_le_bytes(),
                    lba,
                    lba_count: count,
                };
                let mut bytes = header.to_bytes().to_vec();
                let data = u64::from(count) * u64::from(original::SECTOR_SIZE_BYTES);
                if write {
                    bytes.resize(bytes.len() + data as usize, id as u8);
                }
                self.send_request(index, bytes, id, if write { 0 } else { data });
            }
            Step::NbdRequest {
                socket,
                command,
                flags,
                offset,
                length,
                ..
            } => {
                let Some(index) = self.client_of_kind(socket, Kind::Nbd) else {
                    return;
                };
                // READ, WRITE, FLUSH, TRIM, WRITE_ZEROES, CACHE, BLOCK_STATUS.
                const COMMANDS: [u16; 7] = [0, 1, 3, 4, 6, 5, 7];
                let command = COMMANDS[usize::from(command % 7)];
                let mut length = length_bytes(length);
                if command == 1 && length as usize > PAYLOAD_BYTES_MAX {
                    length = 4096;
                }
                let id = self.next_id(index);
                let mut bytes = Vec::with_capacity(nbd::REQUEST_HEADER_SIZE);
                bytes.extend(nbd::REQUEST_MAGIC.to_be_bytes());
                bytes.extend(u16::from(flags & 3).to_be_bytes());
                bytes.extend(command.to_be_bytes());
                bytes.extend(id.to_be_bytes());
                bytes.extend(offset_bytes(offset).to_be_bytes());
                bytes.extend(length.to_be_bytes());
                if command == 1 {
                    bytes.resize(bytes.len() + length as usize, id as u8);
                }
                let data = if command == 0 { u64::from(length) } else { 0 };
                self.send_request(index, bytes, id, data);
            }
            Step::Kv {
                socket,
                opcode,
                key,
                value,
                fill,
                ..
            } => self.kv_well_formed(socket, opcode, key, value, fill),
            Step::Nvme {
                socket,
                op,
                a,
                b,
                c,
            } => {
                if let Some(index) = self.client_of_kind(socket, Kind::NvmeTcp) {
                    self.nvme_pdus(index, op, a, b, c, true);
                }
            }
            Step::Advance { .. } | Step::Read { .. } => self.step(step),
            // Timing faults only: clear, stall, lift, delay, seed.
            Step::Fault { kind, .. } if matches!(kind % 8, 0 | 1 | 2 | 5 | 7) => self.step(step),
            _ => {}
        }
    }

    /// A valid KV request: `opcode % 4` PUT, GET, DELETE, FLUSH; a private key (`key` bit 5:
    /// first byte `0x80 | client index`, see [`KvModel`]) or a shared one (`key & 0x1f`).
    fn kv_well_formed(&mut self, socket: u8, opcode: u8, key: u8, value: u8, fill: u8) {
        let Some(index) = self.client_of_kind(socket, Kind::Kv) else {
            return;
        };
        let private = key & 0x20 != 0;
        let first = if private {
            0x80 | index as u8
        } else {
            key & 0x1f
        };
        let key = kv_key(key, first);
        let value = kv_value(kv_value_bytes(value), fill);
        let request = match opcode % 4 {
            0 => kv::Request::Put {
                key: &key,
                value: &value,
            },
            1 => kv::Request::Get { key: &key },
            2 => kv::Request::Delete { key: &key },
            _ => kv::Request::Flush,
        };
        let id = self.next_id(index);
        let mut bytes = vec![0; request.encoded_length_bytes()];
        if let Err(e) = request.encode_into(id, &mut bytes) {
            panic!("KV request: {e}");
        }
        let expected = match (private, request) {
            (true, kv::Request::Get { .. }) => self.clients[index]
                .oracle
                .as_ref()
                .and_then(|oracle| oracle.kv.expected(&key)),
            _ => None,
        };
        let opcode = u64::from(request.opcode().as_u8());
        let write = match request {
            kv::Request::Put { value, .. } => Some(Some(value.to_vec())),
            kv::Request::Delete { .. } => Some(None),
            _ => None,
        };
        if !self.send_request(index, bytes, id, opcode) {
            return;
        }
        let Some(oracle) = self.clients[index].oracle.as_mut() else {
            return;
        };
        if let Some(expected) = expected {
            oracle.kv.gets.insert(id, expected);
        }
        if private && let Some(put) = write {
            oracle.kv.writes.insert(id, (key, put));
        }
    }

    fn next_id(&mut self, index: usize) -> u64 {
        let Some(oracle) = self.clients[index].oracle.as_mut() else {
            panic!("a well-formed client without its record");
        };
        oracle.next_id += 1;
        oracle.next_id
    }

    /// Connects unless the thread's table or the listener's share of it is full (the new
    /// connection would evict a client whose requests are not answered yet: that is the
    /// server's right, not a lost answer).
    fn connect_well_formed(&mut self, thread: u8, listener: u8, source: u8) {
        let thread_index = u16::from(thread) % self.setup.threads;
        let listener_index = usize::from(listener) % listeners(&self.setup).len();
        let on_thread = |same_listener: bool| {
            self.clients
                .iter()
                .filter(|c| self.server.socket_thread(c.socket) == thread_index)
                .filter(|c| !same_listener || c.listener == listener_index)
                .count()
        };
        let limits = &self.setup.limits;
        let others = listeners(&self.setup).len() as u32 - 1;
        let listener_max = limits
            .connections_max
            .saturating_sub(limits.connections_reserved_per_listener * others)
            .max(1);
        if on_thread(false) >= limits.connections_max as usize
            || on_thread(true) >= listener_max as usize
        {
            return;
        }
        let before = self.clients.len();
        self.connect(thread, listener, source);
        if self.clients.len() == before {
            return;
        }
        let (nbd, sectors) = match &listeners(&self.setup)[listener_index] {
            VirtualListener::Nbd => {
                let name = WELL_FORMED_EXPORTS[usize::from(source / 4) % WELL_FORMED_EXPORTS.len()];
                match nbd::ClientHandshake::new(name) {
                    Ok(handshake) => (Some((Some(handshake), Vec::new())), 0),
                    Err(e) => panic!("NBD client for {name:?}: {e}"),
                }
            }
            VirtualListener::Original {
                namespace_index, ..
            } => {
                let bytes = if *namespace_index == 1 {
                    MODEL_BYTES
                } else {
                    MEM_BYTES
                };
                (None, bytes / u64::from(original::SECTOR_SIZE_BYTES))
            }
            VirtualListener::Native
            | VirtualListener::NativeTls(_)
            | VirtualListener::Kv { .. }
            | VirtualListener::NvmeTcp(_) => (None, 0),
        };
        let index = self.clients.len() - 1;
        self.clients[index].oracle = Some(Oracle {
            next_id: 0,
            outstanding: BTreeMap::new(),
            pending: Vec::new(),
            skip_bytes: 0,
            nbd,
            sectors,
            kv: KvModel::default(),
            out_of_budget: false,
        });
        if listener_index == NVME_LISTENER {
            if let Some(nvme) = self.clients[index].nvme.as_mut() {
                nvme.well_formed = true;
            }
            // A host: an I/O queue of a controller that has one left (`source` bit 2), or
            // an admin queue; digests by bits 3–4, the host (both allowed) by bit 5.
            let io_queue = if source & 4 != 0 {
                self.nvme_controller(source >> 3, true)
            } else {
                None
            };
            let digests = Digests::from_byte(source >> 3);
            self.nvme_go(index, digests, io_queue, 0, usize::from(source >> 5 & 1), 4);
        }
        // The NBD greeting may have arrived already.
        let socket = self.clients[index].socket;
        self.read(index, socket);
    }

    /// Sends a request (an NBD client still in its handshake queues it) and records it;
    /// a request beyond the script's send budget is not sent at all (returns false).
    fn send_request(&mut self, index: usize, bytes: Vec<u8>, id: u64, data: u64) -> bool {
        if !self.within_budget(index, bytes.len()) {
            return false;
        }
        self.outcome.bytes_sent += bytes.len();
        self.outcome.requests_sent += 1;
        let socket = self.clients[index].socket;
        let Some(oracle) = self.clients[index].oracle.as_mut() else {
            panic!("a well-formed client without its record");
        };
        let previous = oracle.outstanding.insert(id, data);
        assert!(previous.is_none(), "request id {id} reused");
        if let Some((Some(_), queued)) = &mut oracle.nbd {
            queued.extend(bytes);
            return true;
        }
        if self.trace {
            eprintln!("  request {id} ({} bytes) on {socket:?}", bytes.len());
        }
        self.transmit(index, &bytes);
        true
    }

    /// Received bytes for a well-formed client: the NBD handshake first, then answers.
    fn answers(&mut self, index: usize, received: &[u8]) {
        let (socket, kind) = (self.clients[index].socket, self.clients[index].kind);
        let Some(oracle) = self.clients[index].oracle.as_mut() else {
            return;
        };
        let mut rest = received;
        let mut output = Vec::new();
        if let Some((handshake_slot, queued)) = &mut oracle.nbd
            && let Some(handshake) = handshake_slot
        {
            let consumed = match handshake.handle_bytes(rest) {
                Ok(consumed) => consumed,
                Err(e) => panic!("the NBD handshake failed on {socket:?}: {e}"),
            };
            rest = &rest[consumed..];
            output.extend_from_slice(handshake.pending_output());
            handshake.consume_output(output.len());
            if handshake.outcome().is_some() {
                *handshake_slot = None;
                output.append(queued);
            }
        }
        if !output.is_empty() {
            self.server.client_send(socket, &output);
        }
        if let Some(oracle) = self.clients[index].oracle.as_mut() {
            oracle.feed(kind, rest);
        }
    }

    /// After a well-formed script: every client reads and every device answers; every
    /// request must be answered, each within [`ANSWERS_TIME_MAX`] of virtual time of the
    /// answer before it (a server that keeps answering is slow, not stuck: a hundred PUTs of
    /// one bucket, three 200 ms device steps each, take longer than that in all; finding 18).
    fn await_answers(&mut self) {
        for controls in &self.faults {
            controls.set_stalled(false);
        }
        for index in 0..self.clients.len() {
            self.clients[index].reading = true;
            let socket = self.clients[index].socket;
            if self.draining_answers {
                // A client waiting for its answers reads as they arrive: an instant moves
                // all that the server can send, not one client buffer.
                self.server.set_client_draining(socket, true);
            }
            self.read(index, socket);
        }
        let mut deadline = self.server.now() + ANSWERS_TIME_MAX;
        let mut outstanding = usize::MAX;
        loop {
            let now_outstanding = self
                .clients
                .iter()
                .filter_map(|c| c.oracle.as_ref())
                .map(|oracle| oracle.outstanding.len())
                .sum::<usize>();
            if now_outstanding < outstanding {
                outstanding = now_outstanding;
                deadline = self.server.now() + ANSWERS_TIME_MAX;
            }
            let waiting: Vec<(SocketId, u64)> = self
                .clients
                .iter()
                .filter_map(|c| {
                    let oracle = c.oracle.as_ref()?;
                    oracle.outstanding.keys().next().map(|&id| (c.socket, id))
                })
                .collect();
            if waiting.is_empty() {
                break;
            }
            for &(socket, id) in &waiting {
                assert!(
                    !self.server.is_server_closed(socket),
                    "the server closed well-formed client {socket:?} with request {id} (and maybe \
                     more) unanswered"
                );
            }
            let next = self.server.next_event();
            match next {
                Some(next) if next <= deadline => self.instant(next),
                _ => panic!(
                    "requests never answered (first per socket: {waiting:?}) at {:?}, next \
                     event {next:?}\n{:#?}",
                    self.server.now(),
                    self.server.stats()
                ),
            }
        }
        for client in &self.clients {
            assert!(
                !self.server.is_server_closed(client.socket),
                "the server closed well-formed client {:?}",
                client.socket
            );
        }
    }
}

fn request_state(index: usize) -> RequestState {
    use RequestState::*;
    const STATES: [RequestState; REQUEST_STATE_COUNT] = [
        Free,
        NeedBuffer,
        Receiving,
        Queued,
        Submitted,
        Completed,
        Sending,
        Blocked,
        Orphaned,
        Overlapping,
        Forwarded,
    ];
    STATES[index]
}

// ---------------------------------------------------------------------------------------------
// Seeds.

/// The seed corpus (`fuzz/corpus/dataplane/<name>`): each a short, well-formed conversation
/// that reaches one area of the server, for the fuzzer to mutate. The regression test
/// `crates/sim/tests/dataplane_script.rs` checks that the files match (`UPDATE_SEEDS=1`
/// rewrites them).
pub fn seeds() -> Vec<(&'static str, Script)> {
    let connect = |thread: u8, listener: u8, source: u8| Step::Connect {
        thread,
        listener,
        source,
    };
    // Native opcode selectors: 0 HELLO, 1 READ, 2 WRITE, 3 FLUSH, 4 TRIM, 5 REGISTER,
    // 6 UNREGISTER, 7 BIND, 8 RENEGOTIATE. Namespace selectors: 0 id 1 (memory, QoS),
    // 1 id 2 (model device), 2 id 3 (read-only).
    let native =
        |socket: u8, opcode: u8, id: u8, namespace: u8, offset: u16, length: u8| Step::Native {
            socket,
            opcode,
            flags: 0,
            id,
            namespace,
            offset,
            length,
            body: [0; 4],
        };
    let control = |socket: u8, opcode: u8, id: u8, body: [u8; 4]| Step::Native {
        socket,
        opcode,
        flags: 0,
        id,
        namespace: 0,
        offset: 0,
        length: 0,
        body,
    };
    let nbd = |socket: u8, command: u8, flags: u8, cookie: u8, offset: u16, length: u8| {
        Step::NbdRequest {
            socket,
            command,
            flags,
            cookie,
            offset,
            length,
        }
    };
    let original = |socket: u8, opcode: u8, handle: u8, lba: u16, count: u8| Step::Original {
        socket,
        opcode,
        handle,
        lba,
        count,
        payload: 0,
    };
    let advance = |mode: u8| Step::Advance { mode };
    // NVMe/TCP steps: op 0 a setup (a bit 0: an I/O queue; bits 1–2 digests), 3 Property,
    // 4 Identify, 5 other admin, 6 Read, 7 Write in the capsule, 8 Write on R2T, 9 Flush,
    // Write Zeroes, DSM; `socket` counts NVMe/TCP clients only.
    const NVME: u8 = NVME_LISTENER as u8;
    let nvme = |socket: u8, op: u8, a: u8, b: u8, c: u16| Step::Nvme {
        socket,
        op,
        a,
        b,
        c,
    };
    let kv = |socket: u8, opcode: u8, id: u8, key: u8, value: u8, fill: u8| Step::Kv {
        socket,
        opcode,
        id,
        key,
        value,
        fill,
    };
    let fault = |namespace: u8, kind: u8, a: u8, b: u8| Step::Fault {
        namespace,
        kind,
        a,
        b,
    };
    const HELLO: [u8; 4] = [1, 0x40, 0x04, 0];
    // LC: 90 % reads, 1000 µs (latency index 3), 1000 IOPS (IOPS index 2).
    const REGISTER_LC: [u8; 4] = [0, 90, 3 + 2 * 6, 0];
    const REGISTER_BE: [u8; 4] = [1, 0, 0, 0];
    let bind = |handle: u8| [handle, 0, 0, 0];
    // Seeds from before the fifth configuration byte: no composite, no migration.
    let script = |[a, b, c, d]: [u8; 4], steps: Vec<Step>| Script {
        config: Config([a, b, c, d, 0]),
        steps,
    };
    let script5 = |config: [u8; CONFIG_BYTES], steps: Vec<Step>| Script {
        config: Config(config),
        steps,
    };
    vec![
        (
            "native-io",
            script(
                [0; 4],
                vec![
                    connect(0, 0, 0),
                    control(0, 0, 1, HELLO),
                    native(0, 2, 2, 0, 8, 3),
                    native(0, 1, 3, 0, 8, 3),
                    native(0, 2, 4, 1, 0, 5),
                    native(0, 1, 5, 1, 0, 5),
                    native(0, 3, 6, 0, 0, 0),
                    native(0, 4, 7, 0, 8, 3),
                    native(0, 1, 8, 2, 0, 3),
                    native(0, 2, 9, 2, 0, 3),
                    advance(9),
                ],
            ),
        ),
        (
            "native-tls",
            script(
                [0; 4],
                vec![
                    connect(0, 5, 0),
                    connect(0, 5, 1),
                    advance(4),
                    control(0, 0, 1, HELLO),
                    native(0, 2, 2, 0, 8, 3),
                    native(1, 2, 3, 1, 0, 7),
                    advance(5),
                    native(0, 1, 4, 0, 8, 3),
                    native(1, 1, 5, 1, 0, 7),
                    native(0, 4, 6, 0, 8, 3),
                    advance(9),
                ],
            ),
        ),
        (
            // As native-tls, with pre-shared keys (source selectors 4 and 5): OpenSSL on
            // both ends.
            "native-tls-psk",
            script(
                [0; 4],
                vec![
                    connect(0, 5, 4),
                    connect(0, 5, 5),
                    advance(4),
                    control(0, 0, 1, HELLO),
                    native(0, 2, 2, 0, 8, 3),
                    native(1, 2, 3, 1, 0, 7),
                    advance(5),
                    native(0, 1, 4, 0, 8, 3),
                    native(1, 1, 5, 1, 0, 7),
                    native(0, 4, 6, 0, 8, 3),
                    advance(9),
                ],
            ),
        ),
        (
            "native-tenants",
            script(
                [0; 4],
                vec![
                    connect(0, 0, 0),
                    connect(0, 0, 0),
                    control(0, 5, 1, REGISTER_LC),
                    control(0, 5, 2, REGISTER_BE),
                    advance(7),
                    control(1, 7, 3, bind(7)),
                    control(1, 7, 4, bind(8)),
                    native(1, 2, 5, 0, 16, 3),
                    native(1, 1, 6, 0, 16, 3),
                    control(0, 6, 7, bind(7)),
                    native(1, 1, 8, 0, 16, 3),
                    control(1, 7, 9, bind(0)),
                    native(0, 8, 10, 0, 0, 0),
                    advance(9),
                ],
            ),
        ),
        (
            "original",
            script(
                [0; 4],
                vec![
                    connect(0, 1, 0),
                    connect(0, 3, 0),
                    connect(0, 4, 0),
                    original(0, 1, 1, 8, 2),
                    original(0, 0, 2, 8, 2),
                    original(1, 1, 3, 0, 4),
                    original(1, 0, 4, 0, 4),
                    original(2, 0, 5, 0, 1),
                    advance(9),
                    original(0, 0, 6, 0xffff, 1),
                    advance(9),
                ],
            ),
        ),
        (
            "nbd-io",
            script(
                [0; 4],
                vec![
                    connect(0, 2, 0),
                    Step::NbdGo {
                        socket: 0,
                        export: 0,
                        variant: 1,
                    },
                    advance(7),
                    nbd(0, 1, 0, 1, 8, 3),
                    nbd(0, 0, 0, 2, 8, 3),
                    nbd(0, 1, 1, 3, 16, 5),
                    nbd(0, 3, 0, 4, 0, 0),
                    nbd(0, 4, 0, 5, 8, 3),
                    nbd(0, 6, 0, 6, 16, 3),
                    nbd(0, 6, 2, 7, 24, 3),
                    nbd(0, 7, 0, 8, 0, 3),
                    advance(9),
                    nbd(0, 2, 0, 9, 0, 0),
                    advance(9),
                ],
            ),
        ),
        (
            "nbd-handshake",
            script(
                [0; 4],
                vec![
                    connect(0, 2, 0),
                    Step::NbdFlags {
                        socket: 0,
                        flags: 0,
                    },
                    Step::NbdOption {
                        socket: 0,
                        option: 7,
                        export: 0,
                        info: 0,
                        mode: 0,
                    },
                    Step::NbdOption {
                        socket: 0,
                        option: 2,
                        export: 0,
                        info: 0,
                        mode: 0,
                    },
                    Step::NbdOption {
                        socket: 0,
                        option: 5,
                        export: 1,
                        info: 0x0f,
                        mode: 0,
                    },
                    Step::NbdOption {
                        socket: 0,
                        option: 6,
                        export: 5,
                        info: 0x08,
                        mode: 0,
                    },
                    Step::NbdOption {
                        socket: 0,
                        option: 6,
                        export: 1,
                        info: 0x08,
                        mode: 0,
                    },
                    advance(7),
                    nbd(0, 0, 0, 1, 0, 3),
                    nbd(0, 1, 0, 2, 0, 3),
                    advance(9),
                    connect(0, 2, 0),
                    Step::NbdGo {
                        socket: 1,
                        export: 2,
                        variant: 2,
                    },
                    nbd(1, 1, 0, 1, 0, 3),
                    nbd(1, 0, 0, 2, 0, 3),
                    advance(9),
                ],
            ),
        ),
        (
            "timeouts",
            // Every timeout on, two threads.
            script(
                [0x01, 0x1f, 0, 0],
                vec![
                    connect(0, 0, 1),
                    connect(1, 2, 1),
                    connect(0, 1, 2),
                    Step::Raw {
                        socket: 0,
                        bytes: native::RequestHeader::read(1, 1, 0, 4096).to_bytes()[..20].to_vec(),
                    },
                    Step::Native {
                        socket: 2,
                        opcode: 2,
                        flags: 2 << 3,
                        id: 1,
                        namespace: 0,
                        offset: 0,
                        length: 5,
                        body: [0; 4],
                    },
                    advance(10),
                    advance(10),
                    advance(11),
                ],
            ),
        ),
        (
            "back-pressure",
            // A 4 KiB client buffer, the send timeout, a window of 8 and 24 more slots.
            script(
                [0x00, 0xc8, 0x03, 0x01],
                vec![
                    connect(0, 0, 0),
                    native(0, 1, 1, 0, 0, 8),
                    native(0, 1, 2, 0, 0, 8),
                    native(0, 1, 3, 1, 0, 8),
                    native(0, 1, 4, 0, 0, 10),
                    Step::Read { socket: 0, mode: 1 },
                    advance(8),
                    advance(9),
                    Step::Read { socket: 0, mode: 1 },
                    advance(9),
                ],
            ),
        ),
        (
            "shutdown",
            // Two threads with NBD and native requests in flight on the model device when the
            // shutdown begins; NBD requests after it are answered ESHUTDOWN.
            script(
                [0x01, 0, 0, 0],
                vec![
                    connect(0, 2, 0),
                    connect(1, 0, 0),
                    Step::NbdGo {
                        socket: 0,
                        export: 1,
                        variant: 0,
                    },
                    advance(4),
                    nbd(0, 1, 0, 1, 0, 5),
                    native(1, 2, 1, 1, 0, 5),
                    native(1, 1, 2, 1, 0, 5),
                    Step::Shutdown,
                    nbd(0, 0, 0, 2, 0, 3),
                    native(1, 1, 3, 1, 0, 5),
                    advance(1),
                    connect(0, 0, 0),
                    advance(9),
                ],
            ),
        ),
        (
            "resets",
            script(
                [0x10, 0, 0, 0],
                vec![
                    connect(0, 0, 1),
                    connect(0, 0, 1),
                    connect(0, 0, 1),
                    Step::Native {
                        socket: 0,
                        opcode: 2,
                        flags: 2 << 3,
                        id: 1,
                        namespace: 1,
                        offset: 0,
                        length: 8,
                        body: [0; 4],
                    },
                    native(1, 1, 1, 1, 0, 8),
                    Step::Reset { socket: 0 },
                    Step::Reset { socket: 1 },
                    Step::Close { socket: 2 },
                    Step::FailAccept {
                        thread: 0,
                        listener: 0,
                        errno: 0,
                    },
                    advance(9),
                ],
            ),
        ),
        (
            "small-limits",
            // One device operation in flight, tenant queues of one, window 8, 10 % shares of
            // a 2 MiB arena.
            script(
                [0x00, 0xe0, 0x1f, 0x04],
                vec![
                    connect(0, 0, 0),
                    connect(0, 1, 0),
                    native(0, 1, 1, 0, 0, 8),
                    native(0, 1, 2, 1, 0, 8),
                    native(0, 2, 3, 0, 0, 8),
                    native(0, 1, 4, 0, 0, 10),
                    native(0, 2, 5, 1, 0, 10),
                    original(1, 1, 6, 0, 4),
                    original(1, 0, 7, 0, 4),
                    advance(8),
                    advance(9),
                ],
            ),
        ),
        (
            "faults",
            // The device timeout (1 ms) on; errors, ENOSPC, a delay past the device timeout,
            // short reads, a stall and its lift, over native and NBD.
            script(
                [0x00, 0x10, 0x00, 0x00],
                vec![
                    connect(0, 0, 0),
                    connect(0, 2, 0),
                    Step::NbdGo {
                        socket: 1,
                        export: 0,
                        variant: 1,
                    },
                    fault(0, 3, 0, 0),
                    native(0, 1, 1, 0, 0, 3),
                    fault(0, 3, 1, 4),
                    native(0, 2, 2, 0, 0, 3),
                    nbd(1, 1, 0, 1, 0, 3),
                    fault(1, 5, 2, 0),
                    native(0, 1, 3, 1, 0, 3),
                    advance(8),
                    fault(0, 0, 0, 0),
                    fault(0, 6, 0, 0),
                    native(0, 1, 4, 0, 0, 5),
                    nbd(1, 0, 0, 2, 0, 5),
                    fault(0, 3, 3, 0),
                    native(0, 4, 5, 0, 0, 3),
                    nbd(1, 6, 0, 3, 0, 3),
                    fault(1, 1, 0, 0),
                    native(0, 1, 6, 1, 0, 3),
                    advance(9),
                    fault(1, 2, 0, 0),
                    advance(9),
                ],
            ),
        ),
        (
            "kv",
            // The KV port (listener 6, thread 0): PUTs of every value size, GETs, a DELETE,
            // a FLUSH, on private keys (bit 5) and shared ones, pipelined, then timing.
            script(
                [0; 4],
                vec![
                    connect(0, 6, 0),
                    kv(0, 0, 1, 0x20, 2, 7),
                    kv(0, 1, 2, 0x20, 0, 0),
                    kv(0, 0, 3, 0x61, 7, 9),
                    kv(0, 0, 4, 0xe2, 3, 1),
                    advance(8),
                    kv(0, 1, 5, 0x61, 0, 0),
                    kv(0, 1, 6, 0xe2, 0, 0),
                    kv(0, 2, 7, 0x20, 0, 0),
                    kv(0, 1, 8, 0x20, 0, 0),
                    kv(0, 3, 9, 0, 0, 0),
                    kv(0, 0, 10, 0x01, 5, 3),
                    advance(8),
                    kv(0, 1, 11, 0x01, 0, 0),
                    kv(0, 1, 12, 0x20, 0, 0),
                    kv(0, 1, 13, 0xe2, 0, 0),
                    advance(9),
                ],
            ),
        ),
        (
            "kv-race",
            // Two KV connections on one key, PUTs and a DELETE racing GETs, a device delay.
            script(
                [0, 0, 0, 0],
                vec![
                    connect(0, 6, 0),
                    connect(0, 6, 1),
                    fault(3, 5, 1, 0),
                    kv(0, 0, 1, 0x45, 6, 1),
                    kv(1, 0, 2, 0x45, 4, 2),
                    kv(0, 1, 3, 0x45, 0, 0),
                    kv(1, 1, 4, 0x45, 0, 0),
                    advance(7),
                    kv(0, 2, 5, 0x45, 0, 0),
                    kv(1, 1, 6, 0x45, 0, 0),
                    kv(1, 3, 7, 0, 0, 0),
                    advance(9),
                ],
            ),
        ),
        (
            "kv-threads",
            // A KV connection on each thread (thread 1's table steps forwarded to thread 0,
            // which owns the table): private keys written on each and read back, a shared
            // key written through one thread and read, rewritten and deleted through the
            // other, a FLUSH from thread 1.
            script(
                [0; 4],
                vec![
                    connect(1, 6, 0),
                    connect(0, 6, 1),
                    kv(0, 0, 1, 0x20, 2, 7),
                    kv(1, 0, 2, 0x20, 5, 3),
                    kv(0, 0, 3, 0x45, 6, 1),
                    advance(8),
                    kv(0, 1, 4, 0x20, 0, 0),
                    kv(1, 1, 5, 0x20, 0, 0),
                    kv(1, 1, 6, 0x45, 0, 0),
                    kv(1, 0, 7, 0x45, 4, 2),
                    kv(0, 2, 8, 0x45, 0, 0),
                    kv(0, 3, 9, 0, 0, 0),
                    advance(9),
                ],
            ),
        ),
        (
            "kv-broken",
            // Every broken field (opcode bit 2, field by bits 3-5), an oversize key and value,
            // raw bytes, then a bad magic that closes the connection; a second connection
            // goes on.
            script(
                [0; 4],
                vec![
                    connect(0, 6, 0),
                    connect(0, 6, 0),
                    kv(0, 4, 1, 0x01, 1, 0),
                    kv(0, 4 | 1 << 3, 2, 0x01, 1, 1),
                    kv(0, 4 | 2 << 3, 3, 0x01, 1, 2),
                    kv(0, 4 | 3 << 3, 4, 0x01, 1, 3),
                    kv(0, 5 | 4 << 3, 5, 0x01, 1, 4),
                    kv(0, 7 | 6 << 3, 7, 0x01, 1, 6),
                    kv(0, 6 | 6 << 3, 8, 0x01, 1, 6),
                    kv(0, 1, 9, 0x01, 0, 0),
                    advance(8),
                    Step::Raw {
                        socket: 1,
                        bytes: b"RFXK\x01\x02\x00\x00".to_vec(),
                    },
                    kv(0, 4 | 7 << 3, 10, 0x01, 1, 7),
                    kv(1, 1, 11, 0x01, 0, 0),
                    // A value of 64 KiB + 1, cut short: the server skips what arrives.
                    kv(1, 4 | 5 << 3, 12, 0x01, 1, 5),
                    advance(9),
                ],
            ),
        ),
        (
            "garbage",
            script(
                [0; 4],
                vec![
                    connect(0, 0, 0),
                    connect(0, 1, 0),
                    connect(0, 2, 0),
                    Step::Raw {
                        socket: 0,
                        bytes: b"GET / HTTP/1.1\r\n\r\n".to_vec(),
                    },
                    Step::Raw {
                        socket: 1,
                        bytes: vec![0xff; 24],
                    },
                    Step::Raw {
                        socket: 2,
                        bytes: vec![0; 4],
                    },
                    advance(9),
                ],
            ),
        ),
        (
            // An NVMe/TCP host: an admin queue (ICReq, Connect, CC.EN, Number of Queues),
            // then an I/O queue of its controller on the other connection, and commands on
            // both. Well-formed, the connect selectors 0 and 4 make the same two queues.
            "nvme-io",
            script5(
                [0; CONFIG_BYTES],
                vec![
                    connect(0, NVME, 0),
                    nvme(0, 0, 0, 0, 3),
                    advance(4),
                    connect(0, NVME, 4),
                    nvme(1, 0, 1, 0, 0),
                    advance(4),
                    nvme(0, 4, 1, 0, 0),
                    nvme(0, 3, 0, 0, 0),
                    nvme(1, 7, 1, 0, 16),
                    nvme(1, 8, 4, 0, 64),
                    nvme(1, 6, 1, 0, 16),
                    nvme(1, 6, 4, 1, 0),
                    nvme(1, 9, 0, 0, 0),
                    nvme(1, 9, 1, 0, 8),
                    nvme(1, 9, 2, 0, 8),
                    advance(9),
                    nvme(0, 5, 0, 0, 3),
                    nvme(0, 5, 1, 0, 0),
                    nvme(0, 5, 2, 0, 0),
                    advance(9),
                ],
            ),
        ),
        (
            // As nvme-io with header and data digests on both queues (connect selectors
            // 24 and 28 for well-formed hosts), on two threads.
            "nvme-digests",
            script5(
                [0x01, 0, 0, 0, 0],
                vec![
                    connect(0, NVME, 24),
                    nvme(0, 0, 6, 0, 3),
                    advance(4),
                    connect(1, NVME, 28),
                    nvme(1, 0, 7, 0, 0),
                    advance(4),
                    nvme(1, 7, 1, 0, 16),
                    nvme(1, 8, 5, 0, 64),
                    nvme(1, 6, 5, 0, 64),
                    nvme(0, 4, 0, 0, 0),
                    advance(9),
                ],
            ),
        ),
        (
            // Broken NVMe/TCP: a PDU before ICReq, an ICReq of version 1, a Connect to an
            // unknown subsystem and the discovery one, an H2CData no R2T asked for, a
            // controller disabled and shut down, a keep-alive that expires (100 ms minimum),
            // an R2T never answered (300 ms), a host TermReq.
            "nvme-broken",
            script5(
                [0, 0, 0, 0, 0x18],
                vec![
                    connect(0, NVME, 0),
                    connect(0, NVME, 0),
                    connect(0, NVME, 0),
                    nvme(0, 6, 0, 0, 0),
                    nvme(1, 1, 0x80, 0, 0),
                    nvme(2, 1, 0, 0, 0),
                    nvme(2, 2, 0, 2, 0),
                    nvme(2, 2, 0, 1, 0),
                    nvme(2, 10, 3, 3, 0),
                    advance(4),
                    connect(0, NVME, 0),
                    nvme(2, 0, 0, 4, 4),
                    advance(4),
                    connect(0, NVME, 0),
                    nvme(3, 0, 1, 0, 0),
                    advance(4),
                    nvme(3, 8, 1, 0, 0),
                    nvme(2, 3, 0x18, 0, 0),
                    nvme(2, 3, 0x28, 0, 0),
                    advance(8),
                    nvme(3, 11, 0, 0, 0),
                    advance(10),
                ],
            ),
        ),
        (
            // A striped namespace (4 KiB stripes over namespaces 6 and 7): native writes and
            // reads across a stripe boundary (sector 8), and NVMe/TCP I/O on NSID 4.
            "composite-stripe",
            script5(
                [0, 0, 0, 0, 0x01],
                vec![
                    connect(0, 0, 0),
                    native(0, 2, 1, 4, 6, 3),
                    native(0, 1, 2, 4, 6, 3),
                    native(0, 2, 3, 4, 0, 8),
                    native(0, 1, 4, 4, 0, 8),
                    native(0, 4, 5, 4, 8, 5),
                    native(0, 3, 6, 4, 0, 0),
                    connect(0, NVME, 0),
                    nvme(0, 0, 0, 0, 3),
                    advance(4),
                    connect(0, NVME, 4),
                    nvme(1, 0, 1, 0, 0),
                    advance(4),
                    nvme(1, 8, 3, 3, 6),
                    nvme(1, 6, 3, 3, 6),
                    advance(9),
                ],
            ),
        ),
        (
            // NVMe/TCP on a concatenated namespace (two threads, 4 connections each): the I/O
            // queue is the fifth client (on thread 1), whose
            // private region (well-formed) crosses the members' boundary at block 1024;
            // writes in the capsule and on R2T, then reads of them (op 20: an R2T write in
            // `Mode::Any`, a read in `Mode::WellFormed`), checked against what was written.
            "nvme-composite",
            script5(
                [0xc1, 0, 0, 0, 0x02],
                vec![
                    connect(0, 0, 0),
                    connect(0, 0, 1),
                    connect(0, 2, 0),
                    connect(0, NVME, 0),
                    nvme(0, 0, 0, 0, 3),
                    advance(4),
                    connect(1, NVME, 4),
                    nvme(1, 0, 1, 0, 0),
                    advance(4),
                    nvme(1, 6, 1, 3, 28),
                    nvme(1, 7, 1, 3, 36),
                    advance(4),
                    nvme(1, 20, 1, 3, 28),
                    nvme(1, 20, 1, 3, 32),
                    nvme(1, 20, 4, 3, 0),
                    advance(9),
                ],
            ),
        ),
        (
            // Concatenated members (512 KiB each): I/O across the boundary at sector 1024,
            // with a member failing its writes.
            "composite-concat",
            script5(
                [0, 0, 0, 0, 0x02],
                vec![
                    connect(0, 0, 0),
                    native(0, 2, 1, 4, 1020, 5),
                    native(0, 1, 2, 4, 1020, 5),
                    fault(5, 3, 0, 0),
                    native(0, 2, 3, 4, 1020, 5),
                    native(0, 1, 4, 4, 1016, 8),
                    advance(9),
                ],
            ),
        ),
        (
            // Inter-core migration: reads of namespace 1, delayed 1 ms each, from two
            // connections on thread 0 while thread 1 idles, over several 1 ms monitor
            // windows, so thread 0 sends reads to thread 1; then a shutdown while some are
            // away.
            "migration",
            script5(
                [0, 0, 0, 0, 0x04],
                vec![
                    fault(0, 5, 1, 0),
                    connect(0, 0, 0),
                    connect(0, 0, 0),
                    connect(1, 0, 0),
                    native(0, 1, 1, 0, 0, 3),
                    native(1, 1, 2, 0, 8, 3),
                    native(0, 1, 3, 0, 16, 3),
                    native(1, 1, 4, 0, 24, 3),
                    native(0, 1, 5, 0, 0, 3),
                    native(1, 1, 6, 0, 8, 3),
                    native(0, 1, 7, 0, 16, 3),
                    native(1, 1, 8, 0, 24, 3),
                    advance(7),
                    native(0, 1, 9, 0, 0, 3),
                    native(1, 1, 10, 0, 8, 3),
                    native(0, 1, 11, 0, 16, 3),
                    native(1, 1, 12, 0, 24, 3),
                    native(0, 1, 13, 0, 0, 3),
                    native(1, 1, 14, 0, 8, 3),
                    native(0, 1, 15, 0, 16, 3),
                    native(1, 1, 16, 0, 24, 3),
                    advance(7),
                    native(0, 1, 17, 0, 0, 3),
                    native(1, 1, 18, 0, 8, 3),
                    native(0, 1, 19, 0, 16, 3),
                    native(1, 1, 20, 0, 24, 3),
                    native(0, 1, 21, 0, 0, 3),
                    native(1, 1, 22, 0, 8, 3),
                    native(0, 1, 23, 0, 16, 3),
                    native(1, 1, 24, 0, 24, 3),
                    native(2, 1, 30, 0, 0, 3),
                    advance(6),
                    Step::Shutdown,
                    advance(4),
                    advance(9),
                ],
            ),
        ),
    ]
}
