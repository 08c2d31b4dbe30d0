//! Thread scaling (`docs/OPERATIONS.md`, "Thread scaling"): a parked thread hands its
//! connections to an active one, which adopts them and carries on.
//!
//! A connection moves only between requests: once the thread is parked
//! ([`Dataplane::park_thread`]), or asked to hand some of its connections to a thread just
//! woken ([`Dataplane::shed_connections`], rebalancing: `reflex_qos::plan_rebalance` decides how
//! many), a movable connection is marked `moving`; from then on nothing new is
//! parsed on it, but what it started finishes (a WRITE payload still arrives, requests at the
//! device complete, answers leave), and its receive (or readiness wait) is cancelled. Bytes
//! that arrived meanwhile stay unparsed in its receive buffer. When nothing of it is in flight
//! or outstanding, the slot is released without closing the socket, and [`Op::Handoff`] asks
//! the driver to take the socket and the connection's state ([`Dataplane::take_moved`]) to
//! the destination thread, whose driver calls [`Dataplane::adopt`]: the unparsed bytes are
//! parsed there first, so no request is lost, repeated or reordered on the connection.
//!
//! What moves: the front end's protocol state (native, original, NBD in any phase, key-value,
//! an NVMe/TCP I/O queue), the unparsed bytes, the BIND and the tenants the
//! connection is counted for (the control plane moves each tenant's count from one thread to
//! the other: its reservation is counted once, its rate share follows), the tenants it
//! registered (re-keyed), its device queue. A key-value connection moves once none of its
//! requests exists (so none has a step at the table's owner, `core/kv_owner.rs`, whose
//! messages name the home thread's request slots); an NVMe/TCP I/O queue once no command,
//! data transfer or output of it is open (its controller lives in the table every thread
//! shares, `frontend/nvme_tcp_targets.rs`). A TLS connection (native TLS port, NBD after
//! STARTTLS) moves with its session once the handshake is done and the link is quiescent: no
//! outer receive or send in flight, no inner send, no ciphertext left to send; the session
//! (rustls or OpenSSL, both `Send`), the ciphertext not fed to it yet and the plaintext it
//! decrypted and nobody read yet are the link's own memory and go with it. What does not
//! move, and keeps its thread serving it until it closes: NVMe/TCP admin queues (an
//! Asynchronous Event Request stays unanswered for the controller's life, so the queue is
//! never between requests; the keep-alive timer is theirs) and failed TLS sessions. A TLS
//! connection still in its handshake, or an NVMe/TCP connection that has not connected a
//! queue yet (it may become an admin queue), stays until it can move: a parked thread looks
//! again at every housekeeping sweep.

use std::net::IpAddr;

use reflex_qos::Nanos;

use super::Dataplane;
use super::connection::{Bound, Charge, ConnectionState, ReadState};
use super::ops::{AcceptRefused, ConnectionId, Op};
use super::request::{NONE, next_generation};
use crate::control::ConnectionKey;
use crate::frontend::Frontend;

/// A connection between two threads: everything of it but the socket, which the driver
/// carries beside it.
pub struct MovedConnection {
    from_thread: u16,
    key: ConnectionKey,
    listener: u32,
    source: Option<IpAddr>,
    frontend: Frontend,
    /// Received and not parsed yet (parsed first on the new thread).
    unparsed: Vec<u8>,
    bound: Option<Bound>,
    owns_tenants: bool,
    charged: Vec<Charge>,
    device_queue: u16,
    accepted_at: Nanos,
    established: bool,
    /// Why it moved (for the counters).
    cause: MoveCause,
    /// Its TLS session with the link's buffers (nothing of it in flight).
    tls: Option<Box<super::tls::TlsLink>>,
}

impl std::fmt::Debug for MovedConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MovedConnection")
            .field("from_thread", &self.from_thread)
            .field("key", &self.key)
            .field("unparsed_bytes", &self.unparsed.len())
            .field("tenants", &self.charged.len())
            .finish()
    }
}

impl MovedConnection {
    pub fn from_thread(&self) -> u16 {
        self.from_thread
    }

    pub fn unparsed_bytes(&self) -> usize {
        self.unparsed.len()
    }

    /// Why it moved.
    pub fn cause(&self) -> MoveCause {
        self.cause
    }
}

/// Why a connection moved to another thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveCause {
    /// Its thread parked.
    Park,
    /// A rebalancing onto a woken thread.
    Rebalance,
    /// Spreading its tenant's connections over the threads after its BIND.
    Spread,
}

// The state crosses threads in the driver's queues.
const _: () = {
    const fn sendable<T: Send>() {}
    sendable::<MovedConnection>();
};

/// This thread's part in thread scaling.
#[derive(Debug, Default)]
pub(super) struct Handoff {
    /// Parked: the thread its connections go to.
    parked_to: Option<u16>,
    /// Connections marked `moving`, by slot, with the thread each goes to.
    moving: Vec<(u32, u16)>,
    /// Released slots whose state waits for the driver ([`Dataplane::take_moved`]).
    released: Vec<(ConnectionId, MovedConnection)>,
    /// Spreading tenants' connections (`[scaling] spread_tenants`): the threads a connection
    /// may move to after its BIND, bit `t` for thread `t` (0: off).
    spread_threads: u64,
}

impl Dataplane {
    /// Parks this thread: its movable connections go to thread `to` as soon as each is between
    /// requests, and so does every connection it accepts from now on (the server steers new
    /// connections elsewhere; what was already queued on its listeners still arrives here).
    pub fn park_thread(&mut self, to: u16) {
        assert_ne!(
            usize::from(to),
            self.thread_index,
            "a thread parks onto another"
        );
        self.handoff.parked_to = Some(to);
        for index in 0..self.connections.len() as u32 {
            self.mark_moving_to(index, to);
        }
        tracing::info!(
            thread = self.thread_index,
            to,
            moving = self.handoff.moving.len(),
            staying = self.connections_staying(),
            "thread parking: moving its connections (NVMe/TCP admin queues and TLS handshakes stay)"
        );
    }

    /// Wakes this thread: it keeps the connections it has not handed over yet and serves them
    /// again (those a rebalancing asked it to hand to another thread still go).
    pub fn wake_thread(&mut self) {
        tracing::info!(thread = self.thread_index, "thread woken");
        let Some(parked_to) = self.handoff.parked_to.take() else {
            return;
        };
        let moving = std::mem::take(&mut self.handoff.moving);
        for (index, to) in moving {
            if to != parked_to || self.connections[index as usize].spreading {
                // A rebalancing's or a spreading's move still goes.
                self.handoff.moving.push((index, to));
                continue;
            }
            self.connections[index as usize].moving = false;
            self.mark_parse(index);
        }
    }

    /// Rebalancing onto a thread just woken: marks up to `count` of this thread's movable
    /// connections (the idle ones first: they move at once) for moving to `to`, each once it
    /// is between requests. Returns how many it marked.
    pub fn shed_connections(&mut self, to: u16, count: u32) -> u32 {
        assert_ne!(
            usize::from(to),
            self.thread_index,
            "a thread sheds onto another"
        );
        let mut marked = 0;
        for idle_first in [true, false] {
            for index in 0..self.connections.len() as u32 {
                if marked == count {
                    break;
                }
                let connection = &self.connections[index as usize];
                if connection.moving || (idle_first && connection.outstanding > 0) {
                    continue;
                }
                if self.mark_moving_to(index, to) {
                    marked += 1;
                }
            }
        }
        tracing::info!(
            thread = self.thread_index,
            to,
            asked = count,
            marked,
            "rebalancing: handing connections to a woken thread"
        );
        marked
    }

    /// Spreads tenants' connections over the threads in `active` (bit `t` for thread `t`; 0
    /// turns it off): from now on a connection that BINDs to a tenant moves, once between
    /// requests, to the thread `reflex_qos::spread_target` names.
    pub fn set_spread_threads(&mut self, active: u64) {
        self.handoff.spread_threads = active;
    }

    /// After a BIND to `handle`: marks the connection for moving to another thread if its
    /// tenant's connections are unevenly spread (`ControlPlane::spread_target`; a parked
    /// thread moves it anyway).
    pub(super) fn spread_bound(&mut self, index: u32, handle: u64) {
        let active = self.handoff.spread_threads;
        if active == 0 || self.handoff.parked_to.is_some() || !self.can_move(index) {
            return;
        }
        if self.connections[index as usize].moving {
            return;
        }
        let key = self.requester(index).connection;
        let Some(to) = self.control.spread_target(key, handle, active) else {
            return;
        };
        let marked = self.mark_moving_to(index, to);
        assert!(marked, "a movable connection not moving yet is marked");
        self.connections[index as usize].spreading = true;
        tracing::debug!(
            thread = self.thread_index,
            connection = index,
            to,
            "spreading a tenant's connections: moving one"
        );
    }

    /// A connection marked for a spreading move stays where it is after all (it closes, or
    /// its peer ended): the control plane stops counting it where it was going.
    pub(super) fn abandon_spread(&mut self, index: u32) {
        if std::mem::take(&mut self.connections[index as usize].spreading) {
            self.control
                .spread_abandoned(self.requester(index).connection);
        }
    }

    /// Open connections that could move now and are not moving yet (what a rebalancing may
    /// ask this thread for).
    pub fn connections_movable(&self) -> u32 {
        (0..self.connections.len() as u32)
            .filter(|&index| self.can_move(index) && !self.connections[index as usize].moving)
            .count() as u32
    }

    /// Open connections (the table's limit counts these).
    pub fn connections_open(&self) -> u32 {
        self.open_connections
    }

    pub fn is_thread_parked(&self) -> bool {
        self.handoff.parked_to.is_some()
    }

    /// Open connections that cannot move (TLS handshakes, NVMe/TCP admin queues and queues
    /// not connected yet): a parked thread keeps serving them.
    pub fn connections_staying(&self) -> u32 {
        (0..self.connections.len() as u32)
            .filter(|&index| self.connections[index as usize].is_open() && !self.can_move(index))
            .count() as u32
    }

    /// Whether a connection's state can move to another thread.
    fn can_move(&self, index: u32) -> bool {
        let connection = &self.connections[index as usize];
        connection.is_open()
            && connection.read == ReadState::Open
            && connection
                .tls
                .as_ref()
                .is_none_or(|link| link.is_established())
            && !connection.tls_starting
            && match &connection.frontend {
                Frontend::Native | Frontend::Original { .. } | Frontend::Nbd(_) => true,
                Frontend::Kv { .. } => true,
                Frontend::NvmeTcp(nvme) => nvme.is_movable_io_queue(),
            }
    }

    /// A parked thread's connections that could not move when it parked (a TLS handshake, an
    /// NVMe/TCP queue still connecting) move once they can: looked at every housekeeping
    /// sweep (a scan of the table every 100 ms, on a parked thread only).
    pub(super) fn mark_late_movers(&mut self) {
        if self.handoff.parked_to.is_none() {
            return;
        }
        for index in 0..self.connections.len() as u32 {
            self.mark_moving(index);
        }
    }

    /// Marks a connection of a parked thread for moving (a connection accepted while parked
    /// too).
    pub(super) fn mark_moving(&mut self, index: u32) {
        if let Some(to) = self.handoff.parked_to {
            self.mark_moving_to(index, to);
        }
    }

    /// Marks a connection for moving to `to` if it can move and is not moving yet; returns
    /// whether it marked it.
    fn mark_moving_to(&mut self, index: u32, to: u16) -> bool {
        assert_ne!(usize::from(to), self.thread_index);
        if !self.can_move(index) {
            return false;
        }
        let connection = &mut self.connections[index as usize];
        if connection.moving {
            return false;
        }
        connection.moving = true;
        self.handoff.moving.push((index, to));
        true
    }

    /// Advances every moving connection: cancels its receive once no payload is due, and
    /// releases it once nothing of it is in flight or outstanding (in `process`, after sends).
    pub(super) fn advance_handoffs(&mut self, now: Nanos) {
        let mut position = 0;
        while position < self.handoff.moving.len() {
            let (index, to) = self.handoff.moving[position];
            if !self.can_move(index) {
                // Closing, or its peer ended: it finishes here.
                self.abandon_spread(index);
                self.connections[index as usize].moving = false;
                self.handoff.moving.swap_remove(position);
                continue;
            }
            let connection = &self.connections[index as usize];
            if connection.recv_in_flight
                && connection.payload.is_none()
                && connection.skip_bytes == 0
                && !connection.move_cancelled
                && !connection.parking
                && !super::receive::frontend_mid_command(&connection.frontend)
            {
                self.connections[index as usize].move_cancelled = true;
                self.cancel_read_side(index);
            }
            if self.ready_to_move(index) {
                self.handoff.moving.swap_remove(position);
                self.release_moved(index, to, now);
                continue;
            }
            position += 1;
        }
    }

    /// Nothing of the connection is in flight, outstanding or half-done (a key-value
    /// connection with no request has no step at the table's owner either).
    fn ready_to_move(&self, index: u32) -> bool {
        let connection = &self.connections[index as usize];
        let frontend_idle = match &connection.frontend {
            Frontend::NvmeTcp(nvme) => nvme.is_between_commands(),
            _ => true,
        };
        let tls_idle = connection
            .tls
            .as_ref()
            .is_none_or(|link| link.is_quiescent());
        frontend_idle
            && tls_idle
            && connection.moving
            && !connection.recv_in_flight
            && !connection.send_in_flight
            && connection.outstanding == 0
            && connection.payload.is_none()
            && connection.stalled.is_none()
            && connection.skip_bytes == 0
            && connection.blocked_count == 0
            && connection.send_head == NONE
            && connection.stream_owner == NONE
            && connection.notices.is_empty()
            && connection.run_pages == 0
    }

    /// Releases the slot of a connection ready to move, keeping its state for the driver.
    fn release_moved(&mut self, index: u32, to: u16, now: Nanos) {
        let key = self.requester(index).connection;
        let connection = &mut self.connections[index as usize];
        assert!(connection.is_open());
        assert_eq!(connection.outstanding, 0);
        assert!(!connection.recv_in_flight && !connection.send_in_flight);
        let id = connection.id(index);
        let spread = std::mem::take(&mut connection.spreading);
        let unparsed = connection.recv_buffer[connection.recv_start..connection.recv_end].to_vec();
        let moved = MovedConnection {
            from_thread: self.thread_index as u16,
            key,
            listener: connection.listener,
            source: connection.source,
            frontend: std::mem::replace(&mut connection.frontend, Frontend::Native),
            unparsed,
            bound: connection.bound.take(),
            owns_tenants: std::mem::take(&mut connection.owns_tenants),
            charged: std::mem::take(&mut connection.charged),
            device_queue: connection.device_queue,
            accepted_at: connection.accepted_at,
            established: connection.established,
            cause: if spread {
                MoveCause::Spread
            } else if self.handoff.parked_to == Some(to) {
                MoveCause::Park
            } else {
                MoveCause::Rebalance
            },
            tls: connection.tls.take(),
        };
        let (listener, source) = (connection.listener, connection.source);
        connection.state = ConnectionState::Free;
        connection.moving = false;
        connection.move_cancelled = false;
        connection.parked = false;
        connection.source = None;
        connection.notices.clear();
        connection.generation = next_generation(connection.generation);
        let recv_buffer = std::mem::take(&mut connection.recv_buffer);
        self.return_recv_buffer(recv_buffer);
        self.uncount_connection(listener, source);
        self.stats.connections_moved_out += 1;
        if spread {
            self.stats.connections_spread += 1;
        }
        tracing::debug!(
            thread = self.thread_index,
            connection = index,
            to,
            unparsed_bytes = moved.unparsed.len(),
            "connection handed off"
        );
        let _ = now;
        self.handoff.released.push((id, moved));
        self.ops.push_back(Op::Handoff { connection: id, to });
    }

    /// The state of the connection an [`Op::Handoff`] names (the driver sends it along with the
    /// socket).
    pub fn take_moved(&mut self, id: ConnectionId) -> MovedConnection {
        let Some(position) = self.handoff.released.iter().position(|(of, _)| *of == id) else {
            panic!("no handed-off connection {id:?}");
        };
        self.handoff.released.swap_remove(position).1
    }

    /// A handed-over connection this thread cannot take (shutting down, or no slot at all):
    /// the tenants stop counting it and its registered tenants become orphans, as when a
    /// connection closes; the driver closes the socket (nothing of it was outstanding).
    fn refuse_moved(&mut self, moved: MovedConnection, now: Nanos) {
        self.stats.connections_refused += 1;
        tracing::warn!(
            thread = self.thread_index,
            from = moved.from_thread,
            "no slot for a connection handed over: closing it"
        );
        let handles: Vec<u64> = moved.charged.iter().map(|c| c.tenant.handle).collect();
        let (key, from, owns) = (
            moved.key,
            usize::from(moved.from_thread),
            moved.owns_tenants,
        );
        self.with_control(now, |control, thread, own| {
            control.connection_moved(thread, from, (key, key), handles.iter().copied(), own);
            control.disconnect(thread, handles.iter().copied(), own);
            if owns {
                control.connection_closed(thread, key, now, own);
            }
        });
    }

    /// A connection another thread handed over: it takes a slot here and carries on, its
    /// unparsed bytes first. Refused only when no slot is free at all (the driver then closes
    /// the socket: the connection had nothing outstanding).
    pub fn adopt(
        &mut self,
        moved: MovedConnection,
        now: Nanos,
    ) -> Result<ConnectionId, AcceptRefused> {
        if usize::try_from(moved.listener).is_ok_and(|listener| listener >= self.listeners.len())
            || moved.unparsed.len() >= self.limits.recv_buffer_bytes
        {
            // Not reachable: movable connections come from listeners every thread has, and
            // never hold more unparsed bytes than a receive buffer.
            return Err(AcceptRefused::TableFull);
        }
        if self.phase != super::Phase::Running || self.free_connections.is_empty() {
            self.refuse_moved(moved, now);
            return Err(AcceptRefused::TableFull);
        }
        let Some(index) = self.free_connections.pop() else {
            unreachable!("checked above");
        };
        let mut recv_buffer = self.take_recv_buffer();
        recv_buffer[..moved.unparsed.len()].copy_from_slice(&moved.unparsed);
        self.open_connections += 1;
        self.listeners[moved.listener as usize].connections += 1;
        if let Some(source) = moved.source {
            *self.connections_by_source.entry(source).or_insert(0) += 1;
        }
        let connection = &mut self.connections[index as usize];
        assert_eq!(connection.state, ConnectionState::Free);
        assert_eq!(connection.outstanding, 0);
        assert!(connection.charged.is_empty());
        let generation = connection.generation;
        let mut notices = std::mem::take(&mut connection.notices);
        notices.clear();
        *connection = super::connection::Connection::empty();
        connection.notices = notices;
        connection.generation = generation;
        connection.state = ConnectionState::Open;
        connection.listener = moved.listener;
        connection.source = moved.source;
        connection.frontend = moved.frontend;
        connection.recv_end = moved.unparsed.len();
        connection.recv_buffer = recv_buffer;
        connection.bound = moved.bound;
        connection.owns_tenants = moved.owns_tenants;
        connection.device_queue = moved.device_queue;
        connection.accepted_at = moved.accepted_at;
        connection.established = moved.established;
        connection.tls = moved.tls;
        connection.receive_progress_at = now;
        connection.send_progress_at = now;
        self.note_waiting(index);
        let new_key = self.requester(index).connection;
        let from = usize::from(moved.from_thread);
        let handles: Vec<u64> = moved.charged.iter().map(|c| c.tenant.handle).collect();
        let gone = self.with_control(now, |control, thread, own| {
            control.connection_moved(thread, from, (moved.key, new_key), handles.into_iter(), own)
        });
        let mut charged = moved.charged;
        charged.retain(|charge| !gone.contains(&charge.tenant.handle));
        for charge in &charged {
            self.ensure_account(charge.namespace_index, charge.tenant, now);
            if self.namespaces.composite(charge.namespace_index).is_some() {
                self.learn_member_tenants(charge.namespace_index, charge.tenant.handle, now);
            }
        }
        let connection = &mut self.connections[index as usize];
        if let Some(bound) = connection.bound.as_mut()
            && gone.contains(&bound.tenant.handle)
        {
            // Unregistered on the way: refused until the next BIND, as where it was.
            bound.revoked = true;
        }
        connection.charged = charged;
        self.stats.connections_moved_in += 1;
        tracing::debug!(
            thread = self.thread_index,
            connection = index,
            from,
            "connection adopted"
        );
        self.mark_parse(index);
        // A connection this thread cannot keep (it is parked too) moves on.
        self.mark_moving(index);
        Ok(self.connections[index as usize].id(index))
    }
}
