//! TLS through the real dataplane in virtual time (`core/tls.rs`): rustls clients speak the
//! native protocol to a TLS listener of a [`VirtualServer`], and every byte they send goes
//! in pieces of random size, so TLS records arrive split and merged every way; a client with
//! a small socket buffer makes the server's sends stall and resume mid-record. Exact and
//! deterministic (seeded), unlike a test over real sockets.
//!
//! The certificates in `tests/data` were made once with openssl (a CA and a certificate for
//! `localhost`, valid until 2126).

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::Arc;

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_client::{ConnectionCore, CoreOptions};
use reflex_dataplane::{Limits, RequestState};
use reflex_qos::Nanos;
use reflex_sim::{NetworkModel, SocketId, TlsServer, VirtualListener, VirtualServer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

const NAMESPACE: u32 = 1;
const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_config() -> Arc<rustls::ServerConfig> {
    let chain = vec![CertificateDer::from_pem_file(format!("{DATA}/tls-server-cert.pem")).unwrap()];
    let key = PrivateKeyDer::from_pem_file(format!("{DATA}/tls-server-key.pem")).unwrap();
    Arc::new(
        rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap(),
    )
}

fn client_config() -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(format!("{DATA}/tls-ca.pem")).unwrap())
        .unwrap();
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// One thread, one 64 MiB `mem` namespace, the native protocol in TLS on listener 0.
fn server(network: NetworkModel) -> VirtualServer {
    let device = Arc::new(reflex_flash::mem::MemDevice::new(64 << 20).unwrap());
    common::one_namespace_server(
        device,
        Limits::with_arena(32 << 20, 25),
        network,
        vec![VirtualListener::NativeTls(TlsServer(server_config(), None))],
    )
}

/// A native client over rustls on a virtual socket.
struct Client {
    socket: SocketId,
    tls: rustls::ClientConnection,
    core: ConnectionCore,
    /// Answers by request id: OK or not, and READ data.
    answers: BTreeMap<u64, (bool, Vec<u8>)>,
    rng: Xoshiro256PlusPlus,
    /// Ciphertext not yet handed to the socket.
    cipher_out: Vec<u8>,
}

impl Client {
    fn connect(server: &mut VirtualServer, seed: u64) -> Client {
        let socket = server.connect(0, 0, None).unwrap_or_else(|e| panic!("{e}"));
        let name = ServerName::try_from("localhost").unwrap();
        let mut tls = rustls::ClientConnection::new(client_config(), name).unwrap();
        // Whole pipelined requests are handed over at once (before the handshake is done).
        tls.set_buffer_limit(None);
        Client {
            socket,
            tls,
            core: ConnectionCore::new(CoreOptions {
                window_assumed: 128,
            }),
            answers: BTreeMap::new(),
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            cipher_out: Vec::new(),
        }
    }

    /// Moves bytes both ways once: plaintext into TLS, ciphertext to the server in pieces of
    /// 1 to 3,000 bytes, what the server sent into TLS, plaintext into the protocol core.
    fn pump(&mut self, server: &mut VirtualServer) {
        while let Some(bytes) = self.core.transmit_start() {
            let length = bytes.len();
            self.tls.writer().write_all(bytes).unwrap();
            self.core.transmit_done(length);
        }
        while self.tls.wants_write() {
            self.tls.write_tls(&mut self.cipher_out).unwrap();
        }
        while !self.cipher_out.is_empty() {
            let piece = (1 + self.rng.next_u32() as usize % 3000).min(self.cipher_out.len());
            server.client_send(self.socket, &self.cipher_out[..piece]);
            self.cipher_out.drain(..piece);
        }
        let mut received = Vec::new();
        server.client_read(self.socket, &mut received);
        let mut offered = &received[..];
        let mut plaintext = Vec::new();
        while !offered.is_empty() {
            self.tls.read_tls(&mut offered).unwrap();
            self.tls
                .process_new_packets()
                .unwrap_or_else(|e| panic!("TLS: {e}"));
            // Taken at once: rustls holds little decrypted data.
            match self.tls.reader().read_to_end(&mut plaintext) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("TLS read: {e}"),
            }
        }
        let mut offered = &plaintext[..];
        loop {
            let taken = self.core.handle_received_bytes(offered);
            offered = &offered[taken..];
            while let Some(completion) = self.core.poll_completion().unwrap() {
                self.answers.insert(
                    completion.request_id,
                    (completion.is_ok(), completion.data.to_vec()),
                );
            }
            if offered.is_empty() || taken == 0 {
                break;
            }
        }
    }
}

/// Bytes that depend on the seed and the position.
fn pattern(seed: u64, length: usize) -> Vec<u8> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut bytes = vec![0u8; length];
    rng.fill_bytes(&mut bytes);
    bytes
}

/// Pumps every client and runs virtual time until all of them have `count` answers (or
/// nothing moves for a virtual second).
fn run(server: &mut VirtualServer, clients: &mut [Client], count: usize) {
    let deadline = server.now() + Nanos(1_000_000_000);
    loop {
        for client in clients.iter_mut() {
            client.pump(server);
        }
        if clients.iter().all(|client| client.answers.len() >= count) {
            return;
        }
        let next = server.next_event().unwrap_or(server.now() + Nanos(1_000));
        assert!(next <= deadline, "the clients stopped getting answers");
        server.run_instant(next.max(server.now()));
    }
}

#[test]
fn tls_records_split_anywhere_carry_every_request_exactly() {
    // A 64 KiB client buffer: answers of 1 MiB stall the server's sends mid-record.
    let mut server = server(NetworkModel {
        latency: Nanos(20_000),
        bytes_per_sec: 2_000_000_000,
        client_buffer_bytes: 64 << 10,
    });
    let mut clients: Vec<Client> = (0..4)
        .map(|seed| Client::connect(&mut server, seed))
        .collect();
    // Each client owns a 4 MiB range: writes of sizes from 512 B to 1 MiB, pipelined.
    let sizes = [512usize, 4096, 65536, 1 << 20, 3 * 4096, 200 * 1024];
    let mut expected: Vec<Vec<(u64, Vec<u8>)>> = Vec::new();
    for (index, client) in clients.iter_mut().enumerate() {
        let base = index as u64 * (4 << 20);
        let mut offset = 0u64;
        let mut written = Vec::new();
        for (id, &size) in sizes.iter().enumerate() {
            let data = pattern(index as u64 * 100 + id as u64, size);
            client
                .core
                .submit_write(id as u64, NAMESPACE, base + offset, &data, false)
                .unwrap();
            written.push((base + offset, data));
            offset += size as u64;
        }
        expected.push(written);
    }
    run(&mut server, &mut clients, sizes.len());
    for client in &clients {
        assert!(client.answers.values().all(|(ok, _)| *ok), "a write failed");
    }
    for (client, written) in clients.iter_mut().zip(&expected) {
        for (id, (offset, data)) in written.iter().enumerate() {
            client
                .core
                .submit_read(100 + id as u64, NAMESPACE, *offset, data.len() as u32)
                .unwrap();
        }
    }
    run(&mut server, &mut clients, 2 * sizes.len());
    for (client, written) in clients.iter().zip(&expected) {
        for (id, (_, data)) in written.iter().enumerate() {
            let (ok, read) = &client.answers[&(100 + id as u64)];
            assert!(*ok, "read {id} failed");
            assert!(read == data, "read {id} differs from what was written");
        }
    }
    let dataplane = server.dataplane(0);
    assert_eq!(dataplane.stats().tls_sessions, 4);
    assert_eq!(dataplane.stats().tls_failures, 0);
}

#[test]
fn broken_and_abandoned_tls_sessions_close_and_free_everything() {
    let mut server = server(NetworkModel::default());
    // A good client, to show the others do not disturb it.
    let mut good = Client::connect(&mut server, 7);
    // Garbage instead of a ClientHello; a handshake cut in the middle (the client resets);
    // a client that sends a request and then closes without close_notify.
    let garbage = server.connect(0, 0, None).unwrap();
    server.client_send(
        garbage,
        &[0x16, 0x03, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5, 0xff, 0xff],
    );
    let mut cut = Client::connect(&mut server, 8);
    cut.pump(&mut server);
    server.client_reset(cut.socket);
    let mut closer = Client::connect(&mut server, 9);
    closer.core.submit_read(1, NAMESPACE, 0, 4096).unwrap();
    closer.pump(&mut server);
    server.client_close(closer.socket);

    let data = pattern(99, 8192);
    good.core
        .submit_write(1, NAMESPACE, 0, &data, false)
        .unwrap();
    run(&mut server, std::slice::from_mut(&mut good), 1);
    good.core.submit_read(2, NAMESPACE, 0, 8192).unwrap();
    run(&mut server, std::slice::from_mut(&mut good), 2);
    assert_eq!(good.answers[&2].1, data);
    // Let the rest finish.
    for _ in 0..1000 {
        let Some(next) = server.next_event() else {
            break;
        };
        server.run_instant(next.max(server.now()));
    }
    assert!(
        server.is_closed_by_server(garbage),
        "garbage was not closed"
    );
    assert!(
        server.is_server_closed(cut.socket),
        "the cut handshake was not closed"
    );
    assert!(
        server.is_server_closed(closer.socket),
        "the closed client was not closed"
    );
    let dataplane = server.dataplane(0);
    assert!(
        dataplane.stats().tls_failures >= 1,
        "garbage was not counted"
    );
    for state in [
        RequestState::Receiving,
        RequestState::Queued,
        RequestState::Completed,
        RequestState::Sending,
    ] {
        assert_eq!(dataplane.requests_in_state(state), 0, "{state:?}");
    }
}
