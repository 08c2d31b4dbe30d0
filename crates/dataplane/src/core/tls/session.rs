//! One TLS session, whichever stack runs it: rustls (certificates) or OpenSSL (external
//! pre-shared keys, `psk.rs`). With PSK keys configured, a session starts undecided and the
//! client's first record picks the stack (`client_hello.rs`); without, it is rustls from
//! the first byte.

use std::io::Read;
use std::sync::Arc;

use super::TlsCurrent;
use super::client_hello::{Sniff, sniff};
use super::psk::PskSession;

/// Why a session failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsFailure {
    #[error(transparent)]
    Rustls(#[from] rustls::Error),
    #[error("TLS-PSK: {0}")]
    Psk(String),
    #[error("TLS input: {0}")]
    Input(String),
    #[error("the client offered no pre-shared key and this server has no certificate")]
    NoCertificate,
}

pub(super) enum Session {
    /// Waiting for the ClientHello to pick a stack.
    Undecided(TlsCurrent),
    Rustls {
        connection: Box<rustls::ServerConnection>,
        plaintext_ready: usize,
        peer_closed: bool,
    },
    Psk(Box<PskSession>),
}

impl Session {
    pub(super) fn new(current: TlsCurrent) -> Result<Session, TlsFailure> {
        match (&current.psk, &current.server_config) {
            (None, Some(config)) => Session::rustls(config),
            (None, None) => Err(TlsFailure::NoCertificate),
            (Some(_), _) => Ok(Session::Undecided(current)),
        }
    }

    fn rustls(config: &Arc<rustls::ServerConfig>) -> Result<Session, TlsFailure> {
        let mut connection = rustls::ServerConnection::new(Arc::clone(config))?;
        // The dataplane bounds what it asks to encrypt (`SEND_PLAINTEXT_MAX`) and drains the
        // output before encrypting more.
        connection.set_buffer_limit(None);
        Ok(Session::Rustls {
            connection: Box::new(connection),
            plaintext_ready: 0,
            peer_closed: false,
        })
    }

    pub(super) fn is_undecided(&self) -> bool {
        matches!(self, Session::Undecided(_))
    }

    /// Feeds ciphertext; returns how much was taken (0: an undecided session needs more,
    /// or rustls wants its plaintext read first). `buffer_full`: no more can arrive before
    /// some is taken.
    pub(super) fn feed(&mut self, input: &[u8], buffer_full: bool) -> Result<usize, TlsFailure> {
        if let Session::Undecided(current) = self {
            // The cipher suite of the first known identity's key (NVMe/TCP): OpenSSL picks
            // the suite before it looks at the PSK, so a client offering several suites
            // would otherwise get one whose hash does not fit its key.
            let cipher = std::cell::Cell::new(None);
            let known = |identity: &[u8]| {
                current.psk.as_ref().is_some_and(|keys| {
                    let known = keys.knows(identity);
                    if known && cipher.get().is_none() {
                        cipher.set(keys.cipher_for(identity));
                    }
                    known
                })
            };
            let chosen = match sniff(input, buffer_full, known) {
                Sniff::NeedMore => return Ok(0),
                Sniff::Psk => {
                    let Some(keys) = current.psk.as_ref() else {
                        unreachable!("undecided without PSK keys");
                    };
                    let session = PskSession::with_cipher(keys, cipher.get())
                        .map_err(|e| TlsFailure::Psk(e.to_string()))?;
                    Session::Psk(Box::new(session))
                }
                Sniff::Other => match &current.server_config {
                    Some(config) => Session::rustls(config)?,
                    None => return Err(TlsFailure::NoCertificate),
                },
            };
            *self = chosen;
        }
        match self {
            Session::Undecided(_) => unreachable!(),
            Session::Rustls {
                connection,
                plaintext_ready,
                peer_closed,
            } => {
                let mut pending = input;
                let read = connection
                    .read_tls(&mut pending)
                    .map_err(|e| TlsFailure::Input(e.to_string()))?;
                let state = connection.process_new_packets()?;
                *plaintext_ready = state.plaintext_bytes_to_read();
                *peer_closed |= state.peer_has_closed();
                Ok(read)
            }
            Session::Psk(session) => session.feed(input).map_err(TlsFailure::Psk),
        }
    }

    pub(super) fn is_handshaking(&self) -> bool {
        match self {
            Session::Undecided(_) => true,
            Session::Rustls { connection, .. } => connection.is_handshaking(),
            Session::Psk(session) => session.is_handshaking(),
        }
    }

    pub(super) fn plaintext_ready(&self) -> usize {
        match self {
            Session::Undecided(_) => 0,
            Session::Rustls {
                plaintext_ready, ..
            } => *plaintext_ready,
            Session::Psk(session) => session.plaintext_ready(),
        }
    }

    pub(super) fn peer_closed(&self) -> bool {
        match self {
            Session::Undecided(_) => false,
            Session::Rustls { peer_closed, .. } => *peer_closed,
            Session::Psk(session) => session.peer_closed(),
        }
    }

    /// The tenant the credentials name: a client certificate's subject common name, or the
    /// PSK identity.
    pub(super) fn peer_name(&self) -> Option<String> {
        match self {
            Session::Undecided(_) => None,
            Session::Rustls { connection, .. } => connection
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(|certificate| subject_common_name(certificate.as_ref())),
            Session::Psk(session) => session.peer_name(),
        }
    }

    /// Decrypted bytes into `space`; 0 when the stream ended.
    pub(super) fn read_plaintext(&mut self, space: &mut [u8]) -> usize {
        match self {
            Session::Undecided(_) => 0,
            Session::Rustls {
                connection,
                plaintext_ready,
                ..
            } => match connection.reader().read(space) {
                Ok(n) => {
                    *plaintext_ready -= n;
                    n
                }
                Err(_) => {
                    *plaintext_ready = 0;
                    0
                }
            },
            Session::Psk(session) => session.read_plaintext(space),
        }
    }

    /// Encrypts `slices`; returns the plaintext bytes taken (0: the session failed).
    pub(super) fn write_plaintext(&mut self, slices: &[std::io::IoSlice<'_>]) -> usize {
        match self {
            Session::Undecided(_) => 0,
            // All segments in one vectored write: rustls fills whole records across them
            // (one write per segment would make a record of each 16-byte header).
            Session::Rustls { connection, .. } => {
                std::io::Write::write_vectored(&mut connection.writer(), slices).unwrap_or(0)
            }
            Session::Psk(session) => session.write_plaintext(slices),
        }
    }

    /// Moves what the session has to send into `out`.
    pub(super) fn take_output(&mut self, out: &mut Vec<u8>) {
        match self {
            Session::Undecided(_) => {}
            Session::Rustls { connection, .. } => {
                while connection.wants_write() {
                    match connection.write_tls(out) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                }
            }
            Session::Psk(session) => session.take_output(out),
        }
    }
}

/// The common name of a DER certificate's subject.
fn subject_common_name(der: &[u8]) -> Option<String> {
    let (_, certificate) = x509_parser::parse_x509_certificate(der).ok()?;
    let name = certificate
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_owned();
    Some(name)
}
