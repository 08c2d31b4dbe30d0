//! The NVMe/TCP initiator's transport: a plain TCP stream, or TLS 1.3 with the host's
//! pre-shared key (TP 8011) started right after the TCP connect, before the ICReq. OpenSSL
//! runs the session (rustls has no external PSK: rustls#174), on the blocking socket itself.
//!
//! The key offered is the TLS PSK derived from the configured key for the identity
//! `NVMe0R0x <host NQN> <subsystem NQN>` (what SPDK v24.01 sends), or on request TP 8018's
//! `NVMe1R0x <host NQN> <subsystem NQN> <PSK digest>` (`reflex_proto::nvme_tcp::tls_key`),
//! under the cipher suite of the key's length: TLS_AES_128_GCM_SHA256 for 32 bytes,
//! TLS_AES_256_GCM_SHA384 for 48 (offered as a session, `nvme_tcp_psk_session.rs`). Which host and
//! subsystem the identity names is part of [`NvmeTls`], apart from the Connect data, so that
//! tests can check that a target refuses a Connect that does not match its identity.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use openssl::ssl::{Ssl, SslContext, SslMethod, SslStream, SslVerifyMode, SslVersion};
use reflex_proto::nvme_tcp::tls_key::{ConfiguredPsk, IdentityForm};

use super::nvme_tcp::NvmeTcpError;
use super::nvme_tcp_psk_session::offer_session_psk;

/// The host's TLS key and the identity it is offered under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeTls {
    /// The configured PSK (interchange format `NVMeTLSkey-1:01:...:`).
    pub psk: ConfiguredPsk,
    /// The host NQN the identity names (normally the one Connect sends).
    pub host_nqn: String,
    /// The subsystem NQN the identity names (normally the one Connect sends).
    pub subsystem_nqn: String,
    /// Which identity form to offer (TP 8011's, as SPDK v24.01, unless asked).
    pub identity_form: IdentityForm,
}

/// One queue's byte stream.
#[derive(Debug)]
pub(crate) enum Link {
    Plain(TcpStream),
    Tls(Box<SslStream<Retrying>>),
}

impl Link {
    /// Connects `stream`'s TLS session when `tls` is given (the handshake waits at most
    /// `timeout` for each answer).
    pub(crate) fn start(
        stream: TcpStream,
        tls: Option<&NvmeTls>,
        timeout: Duration,
    ) -> Result<Link, NvmeTcpError> {
        let Some(tls) = tls else {
            return Ok(Link::Plain(stream));
        };
        let tls_error = |reason: String| NvmeTcpError::Tls(reason);
        let cipher = tls.psk.cipher();
        let (identity, key) = tls
            .psk
            .session_key_in(tls.identity_form, &tls.host_nqn, &tls.subsystem_nqn)
            .map_err(|e| tls_error(e.to_string()))?;
        let openssl = |e: openssl::error::ErrorStack| tls_error(e.to_string());
        let mut builder = SslContext::builder(SslMethod::tls_client()).map_err(openssl)?;
        builder
            .set_min_proto_version(Some(SslVersion::TLS1_3))
            .map_err(openssl)?;
        builder.set_ciphersuites(cipher.name()).map_err(openssl)?;
        // The target proves itself by knowing the key: no certificate.
        builder.set_verify(SslVerifyMode::NONE);
        offer_session_psk(&mut builder, identity.into_bytes(), key, cipher).map_err(openssl)?;
        let ssl = Ssl::new(&builder.build()).map_err(openssl)?;
        stream.set_read_timeout(Some(timeout))?;
        let stream = ssl
            .connect(Retrying(stream))
            .map_err(|e| tls_error(format!("handshake: {e}")))?;
        Ok(Link::Tls(Box::new(stream)))
    }

    /// The TLS version and cipher suite of the session (`None`: plaintext).
    pub(crate) fn tls_session(&self) -> Option<(&'static str, String)> {
        match self {
            Link::Plain(_) => None,
            Link::Tls(stream) => {
                let ssl = stream.ssl();
                let cipher = ssl
                    .current_cipher()
                    .map_or_else(String::new, |cipher| cipher.name().to_string());
                Some((ssl.version_str(), cipher))
            }
        }
    }

    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Link::Plain(stream) => stream,
            Link::Tls(stream) => &stream.get_ref().0,
        }
    }
}

/// The socket under OpenSSL, reading and writing again when a signal interrupts a call:
/// OpenSSL takes an interrupted call as a broken connection (only "would block" is retried),
/// and the threads of a server in the same process (tests) deliver signals.
#[derive(Debug)]
pub(crate) struct Retrying(TcpStream);

impl Read for Retrying {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match self.0.read(buffer) {
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                result => return result,
            }
        }
    }
}

impl Write for Retrying {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        loop {
            match self.0.write(bytes) {
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                result => return result,
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

impl Read for Link {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Plain(stream) => stream.read(buffer),
            Link::Tls(stream) => stream.read(buffer),
        }
    }
}

impl Write for Link {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        match self {
            Link::Plain(stream) => stream.write(bytes),
            Link::Tls(stream) => stream.write(bytes),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Link::Plain(stream) => stream.flush(),
            Link::Tls(stream) => stream.flush(),
        }
    }
}
