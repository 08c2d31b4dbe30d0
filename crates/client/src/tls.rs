//! TLS under the std-socket driver: rustls with certificates, or OpenSSL with a pre-shared
//! key (rustls has no external PSK: rustls#174). Both sit between the non-blocking socket
//! and the plaintext the [`crate::core::ConnectionCore`] reads and writes; the driver sees
//! one [`ClientTls`].

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;

use openssl::ssl::{ErrorCode, Ssl, SslContext, SslMethod, SslStream, SslVerifyMode, SslVersion};
use reflex_proto::memory_pipe::MemoryPipe as Pipe;

use crate::error::ClientError;

/// Plaintext of one TLS record at most.
const RECORD_BYTES: usize = 16 * 1024;

/// How to speak TLS to the server.
#[derive(Clone)]
pub struct TlsOptions {
    credentials: Credentials,
}

#[derive(Clone)]
enum Credentials {
    /// Whom to trust, what name the server's certificate carries, and optionally this
    /// client's certificate (on a server with a client CA, it names the tenant).
    Certificates {
        config: Arc<rustls::ClientConfig>,
        server_name: rustls::pki_types::ServerName<'static>,
    },
    /// A pre-shared key; its identity names the tenant.
    PreSharedKey { context: SslContext },
}

impl std::fmt::Debug for TlsOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.credentials {
            Credentials::Certificates { server_name, .. } => f
                .debug_struct("TlsOptions::Certificates")
                .field("server_name", server_name)
                .finish_non_exhaustive(),
            // Never the key.
            Credentials::PreSharedKey { .. } => f
                .debug_struct("TlsOptions::PreSharedKey")
                .finish_non_exhaustive(),
        }
    }
}

fn invalid(what: String) -> ClientError {
    ClientError::Io(std::io::Error::new(ErrorKind::InvalidInput, what))
}

impl TlsOptions {
    /// From PEM files: `ca` signs the server's certificate; `identity` is this client's
    /// certificate chain and key; `server_name` is the DNS name or IP address the server's
    /// certificate must carry.
    pub fn from_pem_files(
        ca: &Path,
        identity: Option<(&Path, &Path)>,
        server_name: &str,
    ) -> Result<TlsOptions, ClientError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
        let mut roots = rustls::RootCertStore::empty();
        for certificate in CertificateDer::pem_file_iter(ca)
            .map_err(|e| invalid(format!("TLS CA {}: {e}", ca.display())))?
        {
            let certificate =
                certificate.map_err(|e| invalid(format!("TLS CA {}: {e}", ca.display())))?;
            roots
                .add(certificate)
                .map_err(|e| invalid(format!("TLS CA {}: {e}", ca.display())))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid(format!("TLS: {e}")))?
            .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((certificate, key)) => {
                let chain = CertificateDer::pem_file_iter(certificate)
                    .and_then(|chain| chain.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| {
                        invalid(format!("TLS certificate {}: {e}", certificate.display()))
                    })?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| invalid(format!("TLS key {}: {e}", key.display())))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| invalid(format!("TLS certificate and key: {e}")))?
            }
        };
        let server_name = ServerName::try_from(server_name.to_string())
            .map_err(|e| invalid(format!("TLS server name {server_name:?}: {e}")))?;
        Ok(TlsOptions {
            credentials: Credentials::Certificates {
                config: Arc::new(config),
                server_name,
            },
        })
    }

    /// TLS 1.3 with `identity`'s pre-shared `key` (the server must hold the same pair in
    /// its `tls.psk_file`). The server is authenticated by knowing the key.
    pub fn pre_shared_key(identity: &str, key: &[u8]) -> Result<TlsOptions, ClientError> {
        use reflex_proto::psk_file::{IDENTITY_BYTES_MAX, KEY_BYTES_MAX};
        if identity.is_empty() || identity.len() > IDENTITY_BYTES_MAX || identity.contains('\0') {
            return Err(invalid(format!(
                "TLS PSK identity {identity:?}: 1 to {IDENTITY_BYTES_MAX} bytes, no NUL"
            )));
        }
        if key.is_empty() || key.len() > KEY_BYTES_MAX {
            return Err(invalid(format!("TLS PSK key: 1 to {KEY_BYTES_MAX} bytes")));
        }
        let openssl_error = |e: openssl::error::ErrorStack| invalid(format!("TLS PSK: {e}"));
        let mut builder = SslContext::builder(SslMethod::tls_client()).map_err(openssl_error)?;
        builder
            .set_min_proto_version(Some(SslVersion::TLS1_3))
            .map_err(openssl_error)?;
        builder
            .set_ciphersuites("TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256")
            .map_err(openssl_error)?;
        builder.set_verify(SslVerifyMode::NONE);
        let identity = identity.as_bytes().to_vec();
        let key = key.to_vec();
        builder.set_psk_client_callback(move |_, _hint, identity_out, key_out| {
            if identity.len() >= identity_out.len() || key.len() > key_out.len() {
                return Ok(0);
            }
            identity_out[..identity.len()].copy_from_slice(&identity);
            identity_out[identity.len()] = 0;
            key_out[..key.len()].copy_from_slice(&key);
            Ok(key.len())
        });
        Ok(TlsOptions {
            credentials: Credentials::PreSharedKey {
                context: builder.build(),
            },
        })
    }

    /// [`TlsOptions::pre_shared_key`] with `identity`'s key from a `psktool` key file (one
    /// `identity:hexkey` per line), the file nbdkit, qemu and reflexd read.
    pub fn from_psk_file(path: &Path, identity: &str) -> Result<TlsOptions, ClientError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid(format!("TLS PSK file {}: {e}", path.display())))?;
        let keys = reflex_proto::psk_file::parse(&text)
            .map_err(|e| invalid(format!("TLS PSK file {}: {e}", path.display())))?;
        let key = keys.get(identity).ok_or_else(|| {
            invalid(format!(
                "TLS PSK file {}: no key for {identity:?}",
                path.display()
            ))
        })?;
        TlsOptions::pre_shared_key(identity, key)
    }

    /// A new session.
    pub(crate) fn session(&self) -> Result<ClientTls, std::io::Error> {
        match &self.credentials {
            Credentials::Certificates {
                config,
                server_name,
            } => {
                let connection =
                    rustls::ClientConnection::new(Arc::clone(config), server_name.clone())
                        .map_err(|e| std::io::Error::other(format!("TLS: {e}")))?;
                Ok(ClientTls::Rustls(Box::new(connection)))
            }
            Credentials::PreSharedKey { context } => {
                let other =
                    |e: openssl::error::ErrorStack| std::io::Error::other(format!("TLS PSK: {e}"));
                let mut ssl = Ssl::new(context).map_err(other)?;
                ssl.set_connect_state();
                let stream = SslStream::new(ssl, Pipe::default()).map_err(other)?;
                Ok(ClientTls::Psk(Box::new(stream)))
            }
        }
    }
}

/// One TLS session over the driver's socket.
#[derive(Debug)]
pub(crate) enum ClientTls {
    Rustls(Box<rustls::ClientConnection>),
    Psk(Box<SslStream<Pipe>>),
}

impl ClientTls {
    /// Whether ciphertext waits for the socket.
    pub(crate) fn wants_write(&self) -> bool {
        match self {
            ClientTls::Rustls(tls) => tls.wants_write(),
            ClientTls::Psk(tls) => !tls.get_ref().output().is_empty(),
        }
    }

    /// Sends what is ready, as far as the socket takes it.
    pub(crate) fn flush(&mut self, stream: &mut TcpStream) -> std::io::Result<()> {
        match self {
            ClientTls::Rustls(tls) => {
                while tls.wants_write() {
                    match tls.write_tls(stream) {
                        Ok(0) => return Err(ErrorKind::WriteZero.into()),
                        Ok(_) => {}
                        Err(error) if error.kind() == ErrorKind::WouldBlock => return Ok(()),
                        Err(error) => return Err(error),
                    }
                }
                Ok(())
            }
            ClientTls::Psk(tls) => {
                let pipe = tls.get_mut();
                while !pipe.output().is_empty() {
                    match stream.write(pipe.output()) {
                        Ok(0) => return Err(ErrorKind::WriteZero.into()),
                        Ok(n) => pipe.consume_output(n),
                        Err(error) if error.kind() == ErrorKind::WouldBlock => return Ok(()),
                        Err(error) => return Err(error),
                    }
                }
                Ok(())
            }
        }
    }

    /// Encrypts plaintext (never `Ok(0)`: `WouldBlock` while ciphertext waits for the socket
    /// or the handshake for the server).
    pub(crate) fn write(&mut self, stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<usize> {
        self.flush(stream)?;
        if self.wants_write() {
            // Ciphertext still waits for the socket: encrypt no more until it left.
            return Err(ErrorKind::WouldBlock.into());
        }
        let written = match self {
            ClientTls::Rustls(tls) => tls.writer().write(bytes)?,
            // One record at a time: ciphertext waits in memory only until the socket takes it.
            ClientTls::Psk(tls) => match tls.ssl_write(&bytes[..bytes.len().min(RECORD_BYTES)]) {
                Ok(n) => n,
                Err(e) if is_want(&e) => 0,
                Err(e) => return Err(tls_error(&e)),
            },
        };
        self.flush(stream)?;
        if written == 0 {
            return Err(ErrorKind::WouldBlock.into());
        }
        Ok(written)
    }

    /// Decrypted plaintext (`Ok(0)`: the end of the stream, `WouldBlock`: nothing yet).
    pub(crate) fn read(
        &mut self,
        stream: &mut TcpStream,
        space: &mut [u8],
    ) -> std::io::Result<usize> {
        loop {
            match self {
                ClientTls::Rustls(tls) => match tls.reader().read(space) {
                    Ok(read) => return Ok(read),
                    Err(error) if error.kind() == ErrorKind::WouldBlock => {
                        if tls.read_tls(stream)? == 0 {
                            return Ok(0);
                        }
                        tls.process_new_packets().map_err(|e| {
                            std::io::Error::new(ErrorKind::InvalidData, format!("TLS: {e}"))
                        })?;
                    }
                    Err(error) => return Err(error),
                },
                ClientTls::Psk(tls) => match tls.ssl_read(space) {
                    Ok(read) => return Ok(read),
                    Err(e) if e.code() == ErrorCode::ZERO_RETURN => return Ok(0),
                    Err(e) if is_want(&e) => {
                        let mut ciphertext = [0u8; 16 * 1024];
                        let n = stream.read(&mut ciphertext)?;
                        if n == 0 {
                            return Ok(0);
                        }
                        tls.get_mut().push_input(&ciphertext[..n]);
                    }
                    Err(e) => return Err(tls_error(&e)),
                },
            }
            // Handshake messages to answer.
            self.flush(stream)?;
        }
    }
}

fn is_want(error: &openssl::ssl::Error) -> bool {
    matches!(error.code(), ErrorCode::WANT_READ | ErrorCode::WANT_WRITE)
}

fn tls_error(error: &openssl::ssl::Error) -> std::io::Error {
    std::io::Error::new(ErrorKind::InvalidData, format!("TLS PSK: {error}"))
}
