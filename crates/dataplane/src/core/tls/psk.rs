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
//!
//! NVMe/TCP (TP 8011) is TLS 1.3 only and its 48-byte keys need TLS_AES_256_GCM_SHA384:
//! its keys are served through OpenSSL's session callback (`psk_session.rs`), which gives
//! each key the cipher suite of its hash.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{ErrorCode, Ssl, SslContext, SslMethod, SslStream, SslVersion};
use reflex_proto::memory_pipe::MemoryPipe as Pipe;
use reflex_proto::nvme_tcp::tls_key::{TlsCipher, TlsKeyTable};

use super::psk_session::{SessionKey, set_session_finder};

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
    known: Known,
}

/// Which identities have a key.
enum Known {
    /// The native protocol and NBD: by exact identity.
    Identities(std::collections::HashSet<Vec<u8>>),
    /// NVMe/TCP: by the host and subsystem an identity of either form names.
    Nvme(Arc<TlsKeyTable>),
}

impl std::fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PskKeys")
            .field("identities", &self.identity_count())
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

impl PskKeys {
    /// The keys of the native protocol and NBD, by identity: TLS 1.3 and 1.2, as GnuTLS
    /// clients (libnbd, qemu) offer.
    pub fn new(keys: HashMap<String, Vec<u8>>) -> Result<PskKeys, PskError> {
        if keys.is_empty() {
            return Err(PskError::Empty);
        }
        let index = identity_index()?;
        let identities = keys.keys().map(|name| name.as_bytes().to_vec()).collect();
        let mut builder = SslContext::builder(SslMethod::tls_server())?;
        builder.set_min_proto_version(Some(SslVersion::TLS1_2))?;
        builder.set_cipher_list(
            "ECDHE-PSK-CHACHA20-POLY1305:ECDHE-PSK-AES128-CBC-SHA256:\
             PSK-AES128-GCM-SHA256:PSK-AES256-GCM-SHA384:PSK-CHACHA20-POLY1305",
        )?;
        builder.set_ciphersuites("TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256")?;
        no_tickets(&mut builder)?;
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
            known: Known::Identities(identities),
        })
    }

    /// The keys of NVMe/TCP hosts (TP 8011): TLS 1.3 only, each key with the cipher suite
    /// of its length (TLS_AES_128_GCM_SHA256 for 32 bytes, TLS_AES_256_GCM_SHA384 for 48),
    /// identities of TP 8011's form and TP 8018's (with a PSK digest, checked).
    pub fn for_nvme_tcp(table: TlsKeyTable) -> Result<PskKeys, PskError> {
        if table.is_empty() {
            return Err(PskError::Empty);
        }
        let table = Arc::new(table);
        let mut builder = SslContext::builder(SslMethod::tls_server())?;
        builder.set_min_proto_version(Some(SslVersion::TLS1_3))?;
        builder.set_ciphersuites("TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384")?;
        no_tickets(&mut builder)?;
        let lookup = Arc::clone(&table);
        set_session_finder(
            &mut builder,
            Box::new(move |identity| {
                let name = std::str::from_utf8(identity).ok()?;
                let (cipher, key) = lookup.tls_psk(name).ok()?;
                Some(SessionKey {
                    cipher,
                    key,
                    name: name.to_string(),
                })
            }),
            identity_index()?,
        )?;
        Ok(PskKeys {
            context: builder.build(),
            known: Known::Nvme(table),
        })
    }

    pub fn identity_count(&self) -> usize {
        match &self.known {
            Known::Identities(identities) => identities.len(),
            Known::Nvme(table) => table.len(),
        }
    }

    /// Whether `identity` has a key here (for NVMe/TCP: whether its host and subsystem have
    /// one; the digest of TP 8018's form is checked in the handshake).
    pub fn knows(&self, identity: &[u8]) -> bool {
        match &self.known {
            Known::Identities(identities) => identities.contains(identity),
            Known::Nvme(table) => {
                std::str::from_utf8(identity).is_ok_and(|identity| table.knows(identity))
            }
        }
    }
}

impl PskKeys {
    /// The cipher suite of `identity`'s key (NVMe/TCP keys; `None` for others, whose
    /// context decides).
    pub fn cipher_for(&self, identity: &[u8]) -> Option<TlsCipher> {
        match &self.known {
            Known::Identities(_) => None,
            Known::Nvme(table) => std::str::from_utf8(identity)
                .ok()
                .and_then(|identity| table.cipher_for(identity)),
        }
    }
}

/// No tickets: a resumption would need a ticket key to rotate (as on the rustls path).
fn no_tickets(builder: &mut openssl::ssl::SslContextBuilder) -> Result<(), ErrorStack> {
    builder.set_options(openssl::ssl::SslOptions::NO_TICKET);
    builder.set_num_tickets(0)
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
    /// A session; limited to `cipher` when given (the suite of the key the client's
    /// identity selects; `None`: the context's suites).
    pub fn with_cipher(
        keys: &PskKeys,
        cipher: Option<TlsCipher>,
    ) -> Result<PskSession, ErrorStack> {
        let mut ssl = Ssl::new(&keys.context)?;
        if let Some(cipher) = cipher {
            ssl.set_ciphersuites(cipher.name())?;
        }
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
    fn client(identity: &str, key: [u8; 32]) -> SslStream<Pipe> {
        let identity = identity.to_string();
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
            let mut server = PskSession::with_cipher(&keys, None).unwrap();
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
            let mut server = PskSession::with_cipher(&keys, None).unwrap();
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
        let mut server = PskSession::with_cipher(&keys, None).unwrap();
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

    /// NVMe/TCP keys through the session callback: an OpenSSL client with the pre-TLS-1.3
    /// PSK callback (a SHA-256 key, as a 32-byte NVMe key is) gets a session and
    /// TLS_AES_128_GCM_SHA256 under either identity form; a changed digest, a 32-byte key
    /// offered for a 48-byte host, and an unknown host get none.
    #[test]
    fn nvme_keys_serve_both_identity_forms_through_the_session_callback() {
        use reflex_proto::nvme_tcp::tls_key::{ConfiguredPsk, IdentityForm, PskHash};
        let key_32 = ConfiguredPsk::new(PskHash::Sha256, &[7; 32]).unwrap();
        let key_48 = ConfiguredPsk::new(PskHash::Sha384, &[9; 48]).unwrap();
        let mut table = TlsKeyTable::default();
        table.insert("nqn.h", "nqn.s", key_32.clone()).unwrap();
        table.insert("nqn.h", "nqn.s384", key_48.clone()).unwrap();
        let keys = PskKeys::for_nvme_tcp(table).unwrap();
        assert_eq!(keys.identity_count(), 2);
        let offer = |form, psk: &ConfiguredPsk, subsystem: &str| {
            let (identity, key) = psk.session_key_in(form, "nqn.h", subsystem).unwrap();
            let key: [u8; 32] = key.try_into().unwrap_or([0; 32]);
            (identity, key)
        };
        let handshake = |identity: String, key: [u8; 32]| -> Option<String> {
            // As `session.rs` starts it: limited to the suite of the identity's key (this
            // client offers all three TLS 1.3 suites, AES-256 first).
            let cipher = keys.cipher_for(identity.as_bytes());
            let mut server = PskSession::with_cipher(&keys, cipher).unwrap();
            let mut client = client(&identity, key);
            for _ in 0..4 {
                let _ = client.do_handshake();
                let mut output = Vec::new();
                client.get_mut().take_output(&mut output);
                if server.feed(&output).is_err() {
                    return None;
                }
                let mut answer = Vec::new();
                server.take_output(&mut answer);
                client.get_mut().push_input(&answer);
            }
            let cipher = client.ssl().current_cipher().map(|c| c.name().to_string());
            server.peer_name().and(cipher)
        };
        for form in [IdentityForm::Version0, IdentityForm::Version1] {
            let (identity, key) = offer(form, &key_32, "nqn.s");
            assert!(keys.knows(identity.as_bytes()));
            assert_eq!(
                handshake(identity, key).as_deref(),
                Some("TLS_AES_128_GCM_SHA256"),
                "{form:?}"
            );
        }
        let (identity, key) = offer(IdentityForm::Version1, &key_32, "nqn.s");
        let changed = format!("{}A=", &identity[..identity.len() - 2]);
        let changed = if changed == identity {
            format!("{}B=", &identity[..identity.len() - 2])
        } else {
            changed
        };
        assert_eq!(handshake(changed, key), None, "changed digest");
        // The 48-byte host's subsystem, offered a 32-byte key under the SHA-256 identity.
        let (_, key) = offer(IdentityForm::Version0, &key_32, "nqn.s");
        assert_eq!(
            handshake("NVMe0R01 nqn.h nqn.s384".to_string(), key),
            None,
            "hash mismatch"
        );
        assert!(!keys.knows(b"NVMe0R01 nqn.other nqn.s"));
        assert_eq!(
            handshake("NVMe0R01 nqn.other nqn.s".to_string(), key),
            None,
            "unknown host"
        );
    }
}
