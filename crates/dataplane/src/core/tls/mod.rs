//! TLS on a connection: rustls (certificates) or OpenSSL (pre-shared keys, `psk.rs`) between
//! the socket and the rest of the dataplane (`session.rs` picks and hides which).
//!
//! Why at the driver boundary: the drivers (io_uring, epoll, the simulator's network) keep
//! moving bytes and know nothing of TLS, and the rest of the dataplane keeps parsing and
//! answering plaintext. A TLS connection has two sides:
//! - **outer**: the socket operations the driver runs ([`Op::Recv`] into [`TlsLink`]'s
//!   ciphertext buffer, [`Op::Send`] of its encrypted output);
//! - **inner**: the plaintext receive and send the rest of the dataplane asked for
//!   (`recv_in_flight`, `send_in_flight` of the connection).
//!
//! An inner receive is satisfied from plaintext rustls already decrypted (through
//! `tls_deliveries`, in the same `process`), or by an outer receive. An inner send is
//! encrypted at once (at most [`SEND_PLAINTEXT_MAX`] bytes) and completes when its last
//! ciphertext byte has left. So the inner state machine is the same for TLS and plain
//! connections, and its invariants (one receive and one send at a time, every answer once)
//! hold unchanged. What TLS costs is the copy of every byte through encryption.
//!
//! Failures (a bad certificate, an unknown PSK identity, garbage instead of a handshake, a
//! record that does not decrypt) are answered with the TLS stack's alert, logged with the peer, counted, and end the
//! connection's read side like an end of stream: requests received before still get their
//! answers, and nothing after the failure is parsed.

mod client_hello;
pub mod psk;
mod psk_session;
mod session;

use std::sync::Arc;

use reflex_qos::Nanos;

use super::Dataplane;
use super::ops::Op;
use session::{Session, TlsFailure};

/// Plaintext one inner send encrypts at most (a send of more completes partially and the
/// rest goes in the next one).
pub const SEND_PLAINTEXT_MAX: usize = 256 * 1024;

/// Ciphertext one outer receive takes at most: a little more than one TLS record.
const CIPHER_IN_BYTES: usize = 18 * 1024;

/// Decrypted bytes a session may hold before more ciphertext is fed to it (rustls' own limit
/// for received plaintext, which it enforces with an error).
const PLAINTEXT_HELD_MAX: usize = 16 * 1024;

/// Ciphertext buffer capacity kept across sends (a larger one is freed once drained).
const CIPHER_OUT_KEEP_BYTES: usize = 2 * SEND_PLAINTEXT_MAX;

/// How a dataplane thread speaks TLS. (NVMe/TCP starts TLS when a host's first byte is a
/// TLS record, `nvme_tcp_frontend.rs`.)
#[derive(Clone)]
pub struct TlsSetup {
    /// What new sessions start with (shared by every thread; SIGHUP replaces it).
    pub keys: Arc<TlsKeys>,
    /// Per listener index: whether it speaks TLS from the first byte (the native protocol's
    /// TLS port). NBD begins TLS in the handshake (`NBD_OPT_STARTTLS`).
    pub listeners_tls: Vec<bool>,
}

impl std::fmt::Debug for TlsSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSetup")
            .field("listeners_tls", &self.listeners_tls)
            .finish_non_exhaustive()
    }
}

/// The certificates, keys and identities new TLS sessions use. A reload replaces them at
/// once for every thread; sessions already running keep what they started with.
pub struct TlsKeys {
    current: std::sync::Mutex<TlsCurrent>,
}

/// One generation of [`TlsKeys`].
#[derive(Clone)]
pub struct TlsCurrent {
    /// Certificate sessions (`None`: PSK only).
    pub server_config: Option<Arc<rustls::ServerConfig>>,
    /// Pre-shared-key sessions (`None`: certificates only).
    pub psk: Option<Arc<psk::PskKeys>>,
    /// NVMe/TCP hosts' keys (TP 8011), by PSK identity (`None`: no NVMe/TCP TLS). Kept apart
    /// from `psk`: an NVMe/TCP identity names a host and a subsystem, not a tenant, and an
    /// NVMe/TCP port offers no other credentials.
    pub nvme_psk: Option<Arc<psk::PskKeys>>,
    /// Per certificate name (a tenant's name): the namespace ids the configuration binds
    /// that tenant to, for namespaces without QoS (which keep no tenant registry). Where a
    /// namespace has QoS, the control plane's configured tenant of that name decides.
    pub identities: Arc<std::collections::HashMap<String, Vec<u32>>>,
}

impl TlsCurrent {
    /// What an NVMe/TCP session uses: its hosts' keys only.
    fn for_nvme_tcp(&self) -> TlsCurrent {
        TlsCurrent {
            server_config: None,
            psk: self.nvme_psk.clone(),
            nvme_psk: None,
            identities: Arc::default(),
        }
    }
}

impl TlsKeys {
    pub fn new(current: TlsCurrent) -> TlsKeys {
        TlsKeys {
            current: std::sync::Mutex::new(current),
        }
    }

    /// What a session starting now uses (a lock per new session or identity lookup, never
    /// per request).
    pub fn current(&self) -> TlsCurrent {
        self.current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    pub fn replace(&self, current: TlsCurrent) {
        *self
            .current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = current;
    }
}

/// An inner send encrypted into `cipher_out`: it completes when `cipher_end` was sent.
#[derive(Debug, Clone, Copy)]
struct InnerSend {
    plaintext_bytes: usize,
    cipher_end: usize,
}

pub(super) struct TlsLink {
    session: Session,
    /// Received ciphertext; `cipher_in_start..cipher_in_end` is not yet fed to the session
    /// (it waits while the session holds [`PLAINTEXT_HELD_MAX`] decrypted bytes, or while
    /// an undecided session waits for the rest of the ClientHello).
    cipher_in: Box<[u8]>,
    cipher_in_start: usize,
    cipher_in_end: usize,
    cipher_out: Vec<u8>,
    cipher_out_sent: usize,
    /// An outer receive (into `cipher_in`) is in flight.
    outer_recv: bool,
    /// Its cancellation was asked for.
    outer_recv_cancelled: bool,
    outer_send: bool,
    inner_send: Option<InnerSend>,
    /// Decrypted bytes the session holds for the inner side.
    plaintext_ready: usize,
    /// The session failed: nothing more is fed to it or delivered from it.
    failed: bool,
    /// The peer sent close_notify, closed its socket, or broke the protocol: after the
    /// plaintext that is ready, the inner side sees an end of stream.
    ended: bool,
    /// The inner receive was cancelled while no outer receive was in flight.
    cancelled: bool,
    /// The certificate's subject or the PSK identity, once the handshake completed.
    pub(super) peer_name: Option<String>,
    /// The tenant `peer_name` is on each namespace slot asked so far (`core/tenants.rs`).
    pub(super) identity_tenants: Vec<(u16, Option<crate::control::TenantRef>)>,
}

impl TlsLink {
    fn new(current: TlsCurrent) -> Result<TlsLink, TlsFailure> {
        Ok(TlsLink {
            session: Session::new(current)?,
            cipher_in: vec![0; CIPHER_IN_BYTES].into_boxed_slice(),
            cipher_in_start: 0,
            cipher_in_end: 0,
            cipher_out: Vec::new(),
            cipher_out_sent: 0,
            outer_recv: false,
            outer_recv_cancelled: false,
            outer_send: false,
            inner_send: None,
            plaintext_ready: 0,
            failed: false,
            ended: false,
            cancelled: false,
            peer_name: None,
            identity_tenants: Vec::new(),
        })
    }

    /// Whether a socket operation of this link is in flight (the socket may not close yet).
    pub(super) fn outer_busy(&self) -> bool {
        self.outer_recv || self.outer_send
    }

    /// The session is established and healthy (thread scaling may move it, `handoff`).
    pub(super) fn is_established(&self) -> bool {
        !self.session.is_undecided() && !self.session.is_handshaking() && !self.failed
    }

    /// Nothing of the link is in flight or half-done: no socket operation, no inner send,
    /// no ciphertext waiting to leave, no cancellation or end to deliver. What it holds then
    /// (the session, ciphertext not fed yet, plaintext not read yet) is its own memory and
    /// carries on on any thread.
    pub(super) fn is_quiescent(&self) -> bool {
        self.is_established()
            && !self.outer_busy()
            && self.inner_send.is_none()
            && self.cipher_out_sent == self.cipher_out.len()
            && !self.cancelled
            && !self.ended
    }

    /// Feeds the received ciphertext to the session while it holds little plaintext; `Err`
    /// when the peer broke the protocol (the session queued an alert for it, if it can).
    fn absorb(&mut self) -> Result<(), TlsFailure> {
        if self.failed {
            return Ok(());
        }
        let was_handshaking = self.session.is_handshaking();
        while self.cipher_in_start < self.cipher_in_end
            && self.plaintext_ready <= PLAINTEXT_HELD_MAX
        {
            let full = self.cipher_in_end == self.cipher_in.len();
            let pending = &self.cipher_in[self.cipher_in_start..self.cipher_in_end];
            let fed = self.session.feed(pending, full);
            if fed.is_err() {
                self.failed = true;
            }
            let read = fed?;
            self.cipher_in_start += read;
            self.plaintext_ready = self.session.plaintext_ready();
            if self.session.peer_closed() {
                self.ended = true;
            }
            if read == 0 {
                break;
            }
        }
        if self.cipher_in_start == self.cipher_in_end {
            self.cipher_in_start = 0;
            self.cipher_in_end = 0;
        }
        if was_handshaking && !self.session.is_handshaking() {
            self.peer_name = self.session.peer_name();
        }
        Ok(())
    }

    /// Moves what the session has to send into `cipher_out`.
    fn collect_output(&mut self) {
        self.session.take_output(&mut self.cipher_out);
    }
}

impl Dataplane {
    /// Starts TLS on a connection (its first byte, or NBD's STARTTLS once the ACK left):
    /// bytes already received and not parsed are the start of the handshake.
    pub(super) fn start_tls(&mut self, index: u32) {
        let Some(setup) = self.tls.as_ref() else {
            // A setup error (a protocol told to take TLS on a server without TLS keys): the
            // peer's bytes must not panic the thread, so only this connection ends.
            tracing::error!(
                thread = self.thread_index,
                "TLS asked for without a TLS setup"
            );
            self.abort_connection(index, "TLS without a TLS setup");
            return;
        };
        let mut current = setup.keys.current();
        if matches!(
            self.connections[index as usize].frontend,
            crate::frontend::Frontend::NvmeTcp(_)
        ) {
            current = current.for_nvme_tcp();
        }
        let mut link = match TlsLink::new(current) {
            Ok(link) => Box::new(link),
            Err(e) => {
                tracing::warn!(thread = self.thread_index, error = %e, "TLS session refused");
                self.abort_connection(index, "TLS session could not start");
                return;
            }
        };
        let connection = &mut self.connections[index as usize];
        // Parsing stops at STARTTLS (and nothing was parsed before a TLS port's first byte),
        // and a receive is issued only by parsing.
        assert!(
            !connection.recv_in_flight,
            "TLS starts with a receive in flight"
        );
        connection.tls_starting = false;
        let early = &connection.recv_buffer[connection.recv_start..connection.recv_end];
        let absorbed = if early.len() <= link.cipher_in.len() {
            link.cipher_in[..early.len()].copy_from_slice(early);
            link.cipher_in_end = early.len();
            link.absorb()
        } else {
            Err(TlsFailure::Input(
                "more bytes before the handshake than a handshake has".to_string(),
            ))
        };
        connection.recv_start = 0;
        connection.recv_end = 0;
        connection.tls = Some(link);
        self.stats.tls_sessions += 1;
        if let Err(e) = absorbed {
            self.tls_failed(index, &e);
        }
        self.tls_flush(index);
        self.mark_parse(index);
    }

    /// The inner side wants bytes (its `recv_in_flight` is set): deliver decrypted ones, or
    /// receive ciphertext.
    pub(super) fn tls_want_recv(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        let id = connection.id(index);
        let Some(link) = connection.tls.as_mut() else {
            unreachable!("tls_want_recv on a plain connection");
        };
        if link.plaintext_ready == 0
            && let Err(e) = link.absorb()
        {
            self.tls_failed(index, &e);
            self.tls_flush(index);
            self.tls_deliveries.push_back(index);
            return;
        }
        let connection = &mut self.connections[index as usize];
        let Some(link) = connection.tls.as_mut() else {
            unreachable!();
        };
        if link.plaintext_ready > 0 || link.ended || link.cancelled {
            self.tls_deliveries.push_back(index);
        } else if !link.outer_recv {
            debug_assert!(
                link.cipher_in_end == 0 || link.session.is_undecided(),
                "ciphertext left while receiving more"
            );
            link.outer_recv = true;
            self.ops.push_back(Op::Recv { connection: id });
        }
    }

    /// Completes the inner receives that decrypted bytes (or an end) can satisfy.
    pub(super) fn tls_deliver(&mut self, now: Nanos) {
        while let Some(index) = self.tls_deliveries.pop_front() {
            let connection = &mut self.connections[index as usize];
            if !connection.recv_in_flight {
                continue; // Already satisfied.
            }
            let Some(mut link) = connection.tls.take() else {
                continue;
            };
            let result = if std::mem::take(&mut link.cancelled) {
                Some(Err(libc::ECANCELED))
            } else if link.plaintext_ready > 0 {
                let space = self.plain_receive_space(index);
                // A receive is issued only with room (`issue_recv`): 0 read means close_notify.
                assert!(!space.is_empty(), "a TLS delivery into no space");
                let n = link.session.read_plaintext(space);
                link.plaintext_ready = if n == 0 {
                    0
                } else {
                    link.session.plaintext_ready()
                };
                Some(Ok(n))
            } else if link.ended {
                Some(Ok(0))
            } else {
                None
            };
            self.connections[index as usize].tls = Some(link);
            match result {
                Some(result) => self.plain_handle_recv(index, result, now),
                None => self.tls_want_recv(index),
            }
        }
    }

    /// The inner side cancels its receive.
    pub(super) fn tls_cancel_recv(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        let id = connection.id(index);
        let Some(link) = connection.tls.as_mut() else {
            unreachable!("tls_cancel_recv on a plain connection");
        };
        if !link.outer_recv {
            link.cancelled = true;
            self.tls_deliveries.push_back(index);
        } else if !link.outer_recv_cancelled {
            link.outer_recv_cancelled = true;
            self.ops.push_back(Op::CancelRecv { connection: id });
        }
    }

    /// A closing connection's socket operations must end before its socket closes: its
    /// outer receive (which the inner side may no longer wait for) is cancelled. Returns
    /// whether one is still in flight.
    pub(super) fn tls_outer_busy(&mut self, index: u32) -> bool {
        let connection = &mut self.connections[index as usize];
        let id = connection.id(index);
        let Some(link) = connection.tls.as_mut() else {
            return false;
        };
        if link.outer_recv && !link.outer_recv_cancelled {
            link.outer_recv_cancelled = true;
            self.ops.push_back(Op::CancelRecv { connection: id });
        }
        link.outer_busy()
    }

    /// The inner side cancels its send: the outer one in flight is cancelled and its
    /// completion fails the inner one.
    pub(super) fn tls_cancel_send(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        let id = connection.id(index);
        let Some(link) = connection.tls.as_ref() else {
            unreachable!("tls_cancel_send on a plain connection");
        };
        assert!(link.outer_send, "an inner send without an outer one");
        self.ops.push_back(Op::CancelSend { connection: id });
    }

    /// Where the outer receive puts its bytes.
    pub(super) fn tls_receive_space(&mut self, index: u32) -> &mut [u8] {
        let connection = &mut self.connections[index as usize];
        let Some(link) = connection.tls.as_mut() else {
            unreachable!("tls_receive_space on a plain connection");
        };
        assert!(link.outer_recv, "receive space without a receive");
        &mut link.cipher_in[link.cipher_in_end..]
    }

    /// The outer receive finished.
    pub(super) fn tls_handle_recv(&mut self, index: u32, result: Result<usize, i32>, now: Nanos) {
        let connection = &mut self.connections[index as usize];
        let Some(mut link) = connection.tls.take() else {
            unreachable!("tls_handle_recv on a plain connection");
        };
        assert!(link.outer_recv, "a receive completion without a receive");
        link.outer_recv = false;
        link.outer_recv_cancelled = false;
        let mut failure = None;
        match result {
            Ok(0) => link.ended = true,
            Ok(n) => {
                connection.receive_progress_at = now;
                self.stats.bytes_received += n as u64;
                link.cipher_in_end += n;
                if let Err(e) = link.absorb() {
                    failure = Some(e);
                }
            }
            Err(errno) => {
                connection.tls = Some(link);
                if connection.recv_in_flight {
                    self.plain_handle_recv(index, Err(errno), now);
                } else if connection.is_open() {
                    self.abort_connection(index, "receive error");
                } else {
                    self.maybe_finish_close(index);
                }
                return;
            }
        }
        connection.tls = Some(link);
        if let Some(e) = failure {
            self.tls_failed(index, &e);
        }
        self.tls_flush(index);
        let connection = &self.connections[index as usize];
        if !connection.is_open() {
            if connection.recv_in_flight {
                self.plain_handle_recv(index, Ok(0), now);
            } else {
                self.maybe_finish_close(index);
            }
        } else if connection.recv_in_flight {
            self.tls_want_recv(index);
            self.tls_deliver(now);
        }
    }

    /// The peer broke TLS: log, count, send the alert the session queued, and end the stream.
    fn tls_failed(&mut self, index: u32, error: &TlsFailure) {
        self.stats.tls_failures += 1;
        let connection = &mut self.connections[index as usize];
        tracing::info!(
            thread = self.thread_index,
            source = ?connection.source,
            %error,
            "TLS refused"
        );
        if let Some(link) = connection.tls.as_mut() {
            link.ended = true;
            link.failed = true;
            link.plaintext_ready = 0;
        }
    }

    /// The inner side starts a send (its `send_in_flight` and `sending_count` are set):
    /// encrypt its bytes and send them.
    pub(super) fn tls_inner_send(&mut self, index: u32, now: Nanos) {
        let connection = &mut self.connections[index as usize];
        let Some(mut link) = connection.tls.take() else {
            unreachable!("tls_inner_send on a plain connection");
        };
        assert!(link.inner_send.is_none());
        let mut slices: Vec<std::io::IoSlice<'_>> = Vec::with_capacity(super::SEND_SEGMENTS_MAX);
        let mut room = SEND_PLAINTEXT_MAX;
        self.plain_send_segments(index, |segment| {
            let take = segment.len().min(room);
            if take > 0 {
                slices.push(std::io::IoSlice::new(&segment[..take]));
                room -= take;
            }
        });
        let plaintext_bytes = if link.failed {
            0
        } else {
            link.session.write_plaintext(&slices)
        };
        drop(slices);
        if plaintext_bytes == 0 {
            // The session failed (`tls_failed`): nothing can be encrypted any more, and the
            // inner send fails as a send to a broken socket would.
            self.connections[index as usize].tls = Some(link);
            self.plain_handle_sent(index, Err(libc::EPIPE), now);
            return;
        }
        link.collect_output();
        link.inner_send = Some(InnerSend {
            plaintext_bytes,
            cipher_end: link.cipher_out.len(),
        });
        self.connections[index as usize].tls = Some(link);
        self.tls_pump(index);
    }

    /// Collects what the session has to send (handshake messages, alerts) and sends it.
    fn tls_flush(&mut self, index: u32) {
        if let Some(link) = self.connections[index as usize].tls.as_mut() {
            link.collect_output();
        }
        self.tls_pump(index);
    }

    /// Issues the outer send when ciphertext waits and none is in flight.
    fn tls_pump(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        let id = connection.id(index);
        if connection.state == super::connection::ConnectionState::Free {
            return;
        }
        let Some(link) = connection.tls.as_mut() else {
            return;
        };
        if !link.outer_send && link.cipher_out_sent < link.cipher_out.len() {
            link.outer_send = true;
            self.stats.sends += 1;
            self.ops.push_back(Op::Send { connection: id });
        }
    }

    /// The bytes of the outer send in flight.
    pub(super) fn tls_send_segments(&self, index: u32, mut segment: impl FnMut(&[u8])) {
        let Some(link) = self.connections[index as usize].tls.as_ref() else {
            unreachable!("tls_send_segments on a plain connection");
        };
        assert!(link.outer_send, "send segments without a send");
        segment(&link.cipher_out[link.cipher_out_sent..]);
    }

    /// The outer send finished.
    pub(super) fn tls_handle_sent(&mut self, index: u32, result: Result<usize, i32>, now: Nanos) {
        let connection = &mut self.connections[index as usize];
        let Some(link) = connection.tls.as_mut() else {
            unreachable!("tls_handle_sent on a plain connection");
        };
        assert!(link.outer_send, "a send completion without a send");
        link.outer_send = false;
        if let Ok(sent) = result
            && sent > 0
        {
            connection.send_progress_at = now;
            self.stats.bytes_sent += sent as u64;
        }
        // A failed send, or one that completed after its connection was aborted (its
        // cancellation came too late): nothing more goes out, and the inner send ends as a
        // failed or cancelled one would.
        let cut = match result {
            Ok(sent) if sent > 0 && connection.is_open() => None,
            Ok(0) => Some(libc::EPIPE),
            Ok(_) => Some(libc::ECANCELED),
            Err(errno) => Some(errno),
        };
        let Some(link) = connection.tls.as_mut() else {
            unreachable!();
        };
        if let Some(errno) = cut {
            link.cipher_out.clear();
            link.cipher_out_sent = 0;
            if link.inner_send.take().is_some() {
                self.plain_handle_sent(index, Err(errno), now);
            } else if self.connections[index as usize].is_open() {
                self.abort_connection(index, "send error");
            } else {
                self.maybe_finish_close(index);
            }
            return;
        }
        let sent = result.unwrap_or(0);
        link.cipher_out_sent += sent;
        assert!(link.cipher_out_sent <= link.cipher_out.len());
        let inner_done = link
            .inner_send
            .is_some_and(|inner| link.cipher_out_sent >= inner.cipher_end);
        let inner = if inner_done {
            link.inner_send.take()
        } else {
            None
        };
        if link.cipher_out_sent == link.cipher_out.len() {
            link.cipher_out.clear();
            link.cipher_out_sent = 0;
            if link.cipher_out.capacity() > CIPHER_OUT_KEEP_BYTES {
                link.cipher_out = Vec::new();
            }
        }
        if let Some(inner) = inner {
            // Later ciphertext starts earlier once the buffer was reset: nothing else waits
            // on an end offset (one inner send at a time).
            self.plain_handle_sent(index, Ok(inner.plaintext_bytes), now);
        }
        let connection = &self.connections[index as usize];
        if connection.state == super::connection::ConnectionState::Free {
            return;
        }
        if connection.is_open() {
            self.tls_pump(index);
        } else {
            self.maybe_finish_close(index);
        }
    }
}
