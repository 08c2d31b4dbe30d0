//! TLS with external pre-shared keys (RFC 8446 §2.2 and RFC 4279), through OpenSSL: rustls
//! has none (rustls#174), and nbdkit, qemu and libnbd offer PSK as the light alternative to
//! certificates. A session is OpenSSL over a memory pipe: ciphertext in, ciphertext out, the
//! dataplane's socket operations unchanged (`mod.rs`).
//!
//! The keys come from the file `psktool` writes (`reflex_proto::psk_file`). The identity
//! names the tenant, as a certificate's common name does.
//!
//! TLS 1.3 uses OpenSSL's compatibility path for PSK callbacks (the key is taken as a
//! SHA-256 one, so TLS_AES_128_GCM_SHA256 or TLS_CHACHA20_POLY1305_SHA256 is negotiated);
//! TLS 1.2 uses the PSK cipher suites (with ECDHE where the client offers it).

use std::collections::HashMap;
use std::sync::OnceLock;

use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{ErrorCode, Ssl, SslContext, SslMethod, SslStream, SslVersion};
use reflex_proto::memory_pipe::MemoryPipe as Pipe;

/// Decrypted bytes held before more ciphertext is decrypted (the rustls path's bound).
const PLAINTEXT_HELD_MAX: usize = 16 * 1024;
/// One TLS record's plaintext at most.
const RECORD_PLAINTEXT_MAX: usize = 16 * 1024;

/// Why the PSK keys could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PskError {
    #[error("no key")]
    Empty,
    #[error("OpenSSL: {0}")]
    OpenSsl(#[from] ErrorStack),
}

/// The pre-shared keys new PSK sessions are checked against.
pub struct PskKeys {
    context: SslContext,
    identities: std::collections::HashSet<Vec<u8>>,
}

impl std::fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PskKeys")
            .field("identities", &self.identities.len())
            .finish_non_exhaustive()
    }
}

/// Where a session keeps the identity its key matched.
fn identity_index() -> Result<Index<Ssl, String>, ErrorStack> {
    static INDEX: OnceLock<Index<Ssl, String>> = OnceLock::new();
    if let Some(index) = INDEX.get() {
        return Ok(*index);
    }
    let index = Ssl::new_ex_index::<String>()?;
    Ok(*INDEX.get_or_init(|| index))
}

/// Which TLS a set of keys speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PskProfile {
    /// The native protocol and NBD: TLS 1.3 and 1.2, as GnuTLS clients (libnbd, qemu) offer.
    General,
    /// NVMe/TCP (TP 8011): TLS 1.3 only, TLS_AES_128_GCM_SHA256 (the suite of 32-byte keys;
    /// OpenSSL's PSK callback takes every key as a SHA-256 one).
    NvmeTcp,
}

impl PskKeys {
    pub fn new(keys: HashMap<String, Vec<u8>>) -> Result<PskKeys, PskError> {
        PskKeys::with_profile(keys, PskProfile::General)
    }

    /// The keys of NVMe/TCP hosts: identity `NVMe0R01 <host NQN> <subsystem NQN>`, key the
    /// TLS PSK derived for it (`reflex_proto::nvme_tcp::tls_key`).
    pub fn for_nvme_tcp(keys: HashMap<String, Vec<u8>>) -> Result<PskKeys, PskError> {
        PskKeys::with_profile(keys, PskProfile::NvmeTcp)
    }

    fn with_profile(
        keys: HashMap<String, Vec<u8>>,
        profile: PskProfile,
    ) -> Result<PskKeys, PskError> {
        if keys.is_empty() {
            return Err(PskError::Empty);
        }
        let index = identity_index()?;
        let identities = keys.keys().map(|name| name.as_bytes().to_vec()).collect();
        let mut builder = SslContext::builder(SslMethod::tls_server())?;
        match profile {
            PskProfile::General => {
                builder.set_min_proto_version(Some(SslVersion::TLS1_2))?;
                builder.set_cipher_list(
                    "ECDHE-PSK-CHACHA20-POLY1305:ECDHE-PSK-AES128-CBC-SHA256:\
                     PSK-AES128-GCM-SHA256:PSK-AES256-GCM-SHA384:PSK-CHACHA20-POLY1305",
                )?;
                builder.set_ciphersuites("TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256")?;
            }
            PskProfile::NvmeTcp => {
                builder.set_min_proto_version(Some(SslVersion::TLS1_3))?;
                builder.set_ciphersuites("TLS_AES_128_GCM_SHA256")?;
            }
        }
        // No tickets: a resumption would need a ticket key to rotate (as on the rustls path).
        builder.set_options(openssl::ssl::SslOptions::NO_TICKET);
        builder.set_num_tickets(0)?;
        builder.set_psk_server_callback(move |ssl, identity, key_out| {
            let Some(name) = identity.and_then(|bytes| std::str::from_utf8(bytes).ok()) else {
                return Ok(0);
            };
            let Some(key) = keys.get(name) else {
                return Ok(0); // Unknown identity: the handshake fails.
            };
            if key.len() > key_out.len() {
                return Ok(0);
            }
            key_out[..key.len()].copy_from_slice(key);
            ssl.set_ex_data(index, name.to_string());
            Ok(key.len())
        });
        Ok(PskKeys {
            context: builder.build(),
            identities,
        })
    }

    pub fn identity_count(&self) -> usize {
        self.identities.len()
    }

    /// Whether `identity` has a key here.
    pub fn knows(&self, identity: &[u8]) -> bool {
        self.identities.contains(identity)
    }
}

/// One PSK session.
pub struct PskSession {
    stream: SslStream<Pipe>,
    handshaking: bool,
    /// Decrypted bytes, `plaintext_start..plaintext_end` not read yet: room for
    /// [`PLAINTEXT_HELD_MAX`] plus one record, allocated once (never zeroed per record).
    plaintext: Box<[u8]>,
    plaintext_start: usize,
    plaintext_end: usize,
    peer_closed: bool,
    failed: bool,
}

impl PskSession {
    pub fn new(keys: &PskKeys) -> Result<PskSession, ErrorStack> {
        let ssl = Ssl::new(&keys.context)?;
        let stream = SslStream::new(ssl, Pipe::default())?;
        Ok(PskSession {
            stream,
            handshaking: true,
            plaintext: vec![0; PLAINTEXT_HELD_MAX + RECORD_PLAINTEXT_MAX].into_boxed_slice(),
            plaintext_start: 0,
            plaintext_end: 0,
            peer_closed: false,
            failed: false,
        })
    }

    /// Takes all of `input`, advances the handshake and decrypts what it can.
    pub fn feed(&mut self, input: &[u8]) -> Result<usize, String> {
        if self.failed {
            return Err("the session failed before".to_string());
        }
        self.stream.get_mut().push_input(input);
        self.advance()?;
        Ok(input.len())
    }

    fn advance(&mut self) -> Result<(), String> {
        if self.handshaking {
            match self.stream.accept() {
                Ok(()) => self.handshaking = false,
                Err(e) if matches!(e.code(), ErrorCode::WANT_READ | ErrorCode::WANT_WRITE) => {
                    return Ok(());
                }
                Err(e) => {
                    self.failed = true;
                    return Err(describe(&e));
                }
            }
        }
        while !self.peer_closed && self.plaintext_ready() <= PLAINTEXT_HELD_MAX {
            if self.plaintext.len() - self.plaintext_end < RECORD_PLAINTEXT_MAX {
                // At most PLAINTEXT_HELD_MAX is unread: moved to the front, a record fits.
                self.plaintext
                    .copy_within(self.plaintext_start..self.plaintext_end, 0);
                self.plaintext_end -= self.plaintext_start;
                self.plaintext_start = 0;
            }
            let end = self.plaintext_end;
            let result = self
                .stream
                .ssl_read(&mut self.plaintext[end..end + RECORD_PLAINTEXT_MAX]);
            match result {
                Ok(n) => self.plaintext_end += n,
                Err(e) => match e.code() {
                    ErrorCode::WANT_READ | ErrorCode::WANT_WRITE => break,
                    ErrorCode::ZERO_RETURN => self.peer_closed = true,
                    _ => {
                        self.failed = true;
                        return Err(describe(&e));
                    }
                },
            }
        }
        Ok(())
    }

    pub fn is_handshaking(&self) -> bool {
        self.handshaking
    }

    pub fn plaintext_ready(&self) -> usize {
        self.plaintext_end - self.plaintext_start
    }

    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// The identity whose key the client proved it holds (none before the handshake is
    /// done: the callback names an identity before its key is checked).
    pub fn peer_name(&self) -> Option<String> {
        if self.handshaking || self.failed {
            return None;
        }
        let index = identity_index().ok()?;
        self.stream.ssl().ex_data(index).cloned()
    }

    pub fn read_plaintext(&mut self, space: &mut [u8]) -> usize {
        let ready = &self.plaintext[self.plaintext_start..self.plaintext_end];
        let n = ready.len().min(space.len());
        space[..n].copy_from_slice(&ready[..n]);
        self.plaintext_start += n;
        if self.plaintext_start == self.plaintext_end {
            self.plaintext_start = 0;
            self.plaintext_end = 0;
            // Ciphertext may wait in the pipe while the plaintext was at its bound.
            if !self.failed && !self.handshaking && self.advance().is_err() {
                self.peer_closed = true;
            }
        }
        n
    }

    /// Encrypts `slices` (in records of up to 16 KiB); returns the plaintext bytes taken,
    /// all of them, or 0 once the session failed (nothing more can be sent then).
    pub fn write_plaintext(&mut self, slices: &[std::io::IoSlice<'_>]) -> usize {
        if self.failed || self.handshaking {
            return 0;
        }
        let mut record = Vec::with_capacity(RECORD_PLAINTEXT_MAX);
        let mut taken = 0;
        for slice in slices {
            for chunk in slice.chunks(RECORD_PLAINTEXT_MAX) {
                if record.len() + chunk.len() > RECORD_PLAINTEXT_MAX
                    && !self.write_record(&mut record)
                {
                    return 0;
                }
                record.extend_from_slice(chunk);
                taken += chunk.len();
            }
        }
        if !record.is_empty() && !self.write_record(&mut record) {
            return 0;
        }
        taken
    }

    fn write_record(&mut self, record: &mut Vec<u8>) -> bool {
        let ok = self
            .stream
            .ssl_write(record)
            .is_ok_and(|n| n == record.len());
        record.clear();
        if !ok {
            self.failed = true;
        }
        ok
    }

    /// Moves what OpenSSL has to send (handshake messages, records, alerts) to `out`.
    pub fn take_output(&mut self, out: &mut Vec<u8>) {
        self.stream.get_mut().take_output(out);
    }
}

/// OpenSSL's reason, without the error-stack noise when there is one reason.
fn describe(error: &openssl::ssl::Error) -> String {
    match error.ssl_error() {
        Some(stack) => stack
            .errors()
            .iter()
            .map(|e| e.reason().unwrap_or("unknown").to_string())
            .collect::<Vec<_>>()
            .join("; "),
        None => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openssl::ssl::{SslConnector, SslVerifyMode};

    const KEY: [u8; 32] = [0x5a; 32];

    fn keys() -> PskKeys {
        PskKeys::new(HashMap::from([("A".to_string(), KEY.to_vec())])).unwrap()
    }

    /// An OpenSSL client over a memory pipe offering `identity` with `key`.
    fn client(identity: &'static str, key: [u8; 32]) -> SslStream<Pipe> {
        let mut builder = SslConnector::builder(SslMethod::tls_client()).unwrap();
        builder.set_verify(SslVerifyMode::NONE);
        builder
            .set_min_proto_version(Some(SslVersion::TLS1_3))
            .unwrap();
        builder.set_psk_client_callback(move |_, _, identity_out, key_out| {
            identity_out[..identity.len()].copy_from_slice(identity.as_bytes());
            identity_out[identity.len()] = 0;
            key_out[..key.len()].copy_from_slice(&key);
            Ok(key.len())
        });
        let mut ssl = Ssl::new(&builder.build().into_context()).unwrap();
        ssl.set_connect_state();
        SslStream::new(ssl, Pipe::default()).unwrap()
    }

    /// Moves the client's output to the server in pieces of 1..=`chunk` bytes (a seeded
    /// sequence), and the server's back whole.
    fn exchange(
        client: &mut SslStream<Pipe>,
        server: &mut PskSession,
        chunk: usize,
        seed: &mut u64,
    ) {
        let mut output = Vec::new();
        client.get_mut().take_output(&mut output);
        let mut rest = &output[..];
        while !rest.is_empty() {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let n = ((*seed >> 33) as usize % chunk + 1).min(rest.len());
            server.feed(&rest[..n]).expect("server feed");
            rest = &rest[n..];
        }
        let mut answer = Vec::new();
        server.take_output(&mut answer);
        client.get_mut().push_input(&answer);
    }

    #[test]
    fn a_handshake_and_data_survive_any_fragmentation() {
        for (chunk, seed) in [(1, 1u64), (7, 2), (300, 3), (20_000, 4)] {
            let mut seed = seed;
            let keys = keys();
            let mut server = PskSession::new(&keys).unwrap();
            let mut client = client("A", KEY);
            // The client's first flight; then answer until the handshake is done.
            for _ in 0..4 {
                let _ = client.do_handshake();
                exchange(&mut client, &mut server, chunk, &mut seed);
            }
            assert!(
                !server.is_handshaking(),
                "chunk {chunk}: handshake not done"
            );
            assert_eq!(server.peer_name().as_deref(), Some("A"));
            // 100 KiB from the client: every byte arrives, in order, within the bound.
            let data: Vec<u8> = (0..100 * 1024).map(|i| (i % 251) as u8).collect();
            let mut written = 0;
            while written < data.len() {
                // SslConnector's contexts allow partial writes: one record at a time.
                written += client.ssl_write(&data[written..]).unwrap();
            }
            let mut received = Vec::new();
            let mut output = Vec::new();
            client.get_mut().take_output(&mut output);
            for piece in output.chunks(chunk.max(1)) {
                server.feed(piece).unwrap();
                assert!(server.plaintext_ready() <= PLAINTEXT_HELD_MAX + RECORD_PLAINTEXT_MAX);
                let mut space = [0u8; 5000];
                while server.plaintext_ready() > 0 {
                    let n = server.read_plaintext(&mut space);
                    received.extend_from_slice(&space[..n]);
                }
            }
            assert!(
                received == data,
                "chunk {chunk}: data differs: {} of {} bytes, first difference at {:?}",
                received.len(),
                data.len(),
                received.iter().zip(&data).position(|(a, b)| a != b)
            );
            // 100 KiB back, written as many small segments.
            let slices: Vec<std::io::IoSlice<'_>> =
                data.chunks(1000).map(std::io::IoSlice::new).collect();
            assert_eq!(server.write_plaintext(&slices), data.len());
            let mut answer = Vec::new();
            server.take_output(&mut answer);
            client.get_mut().push_input(&answer);
            let mut back = vec![0u8; data.len()];
            let mut filled = 0;
            while filled < back.len() {
                filled += client.ssl_read(&mut back[filled..]).unwrap();
            }
            assert!(back == data, "chunk {chunk}: data back differs");
            // close_notify ends the stream.
            let _ = client.shutdown();
            exchange(&mut client, &mut server, chunk, &mut seed);
            assert!(server.peer_closed());
        }
    }

    #[test]
    fn a_wrong_key_an_unknown_identity_and_garbage_fail_cleanly() {
        let keys = keys();
        for (identity, key) in [("A", [0x11; 32]), ("nobody", KEY)] {
            let mut server = PskSession::new(&keys).unwrap();
            let mut client = client(identity, key);
            let mut failed = false;
            for _ in 0..4 {
                let _ = client.do_handshake();
                let mut output = Vec::new();
                client.get_mut().take_output(&mut output);
                if server.feed(&output).is_err() {
                    failed = true;
                    break;
                }
                let mut answer = Vec::new();
                server.take_output(&mut answer);
                client.get_mut().push_input(&answer);
            }
            assert!(
                failed || server.is_handshaking(),
                "{identity} got a session"
            );
            assert!(server.peer_name().is_none());
            assert_eq!(server.write_plaintext(&[std::io::IoSlice::new(b"x")]), 0);
        }
        let mut server = PskSession::new(&keys).unwrap();
        assert!(server.feed(&[0x16, 3, 1, 0, 5, 1, 2, 3, 4, 5]).is_err());
        assert!(
            server.feed(b"more").is_err(),
            "a failed session took more input"
        );
    }

    #[test]
    fn key_files_build_contexts() {
        assert!(matches!(PskKeys::new(HashMap::new()), Err(PskError::Empty)));
        assert_eq!(keys().identity_count(), 1);
    }
}
