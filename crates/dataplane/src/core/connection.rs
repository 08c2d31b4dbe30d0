//! Connections and listeners: accepting (with the table's limits), and closing, gracefully
//! once nothing is outstanding or at once when a connection is aborted.
//!
//! A connection's read side is one [`ReadState`]; what is in flight on it is two flags
//! (`recv_in_flight`, `send_in_flight`), because the driver may have a receive and a send
//! outstanding at once. A connection slot is released only when neither is in flight and no
//! request refers to it ([`Dataplane::maybe_finish_close`]); then the driver closes the socket.

use std::collections::VecDeque;
use std::net::IpAddr;

use reflex_flash::emu::PriorityClass;
use reflex_qos::Nanos;

use super::ops::{AcceptRefused, ConnectionId, Op};
use super::request::{NONE, RequestState, next_generation};
use super::{Dataplane, Phase};
use crate::access::{Grant, ListenerAccess, RefusalLog};
use crate::control::{NoticeBody, TenantRef};
use crate::frontend::{Frontend, Protocol};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ConnectionState {
    Free,
    Open,
    /// Aborting: operations are cancelled, requests freed as they come back.
    Closing,
}

/// What the connection's read side does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReadState {
    /// Reading and serving requests.
    Open,
    /// Shutdown: reading on only to refuse new requests (NBD's ESHUTDOWN) until nothing is
    /// outstanding.
    DrainReading,
    /// Nothing more is read: the peer closed its side or ended the session, the server is
    /// draining, or the framing broke. What was received is answered, then the connection
    /// closes.
    Closed,
}

/// A native connection's BIND.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bound {
    pub(super) tenant: TenantRef,
    pub(super) namespace_index: u16,
    pub(super) read_only: bool,
    /// What the tenant's configuration grants it.
    pub(super) grant: Grant,
    /// The tenant was unregistered: its I/O is refused (PERMISSION) until the next BIND.
    pub(super) revoked: bool,
}

/// One tenant a connection is counted for in the control plane's registries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Charge {
    pub(super) namespace_index: u16,
    pub(super) tenant: TenantRef,
    /// What the tenant's configuration grants it (learnt when the connection was first
    /// charged to it).
    pub(super) grant: Grant,
}

pub(super) struct Connection {
    pub(super) state: ConnectionState,
    pub(super) generation: u32,
    pub(super) listener: u32,
    /// The peer's address, for the per-source limit (`None`: the driver does not know it).
    pub(super) source: Option<IpAddr>,
    pub(super) frontend: Frontend,
    pub(super) read: ReadState,
    pub(super) recv_buffer: Box<[u8]>,
    pub(super) recv_start: usize,
    pub(super) recv_end: usize,
    /// A read-side operation is in flight: a receive, or (when `parked`) a readiness wait.
    pub(super) recv_in_flight: bool,
    /// Idle: its receive buffer went back to the pool; a readiness wait takes the place of
    /// the receive, and the next bytes bring a buffer back.
    pub(super) parked: bool,
    /// The receive in flight is being cancelled to park the connection.
    pub(super) parking: bool,
    /// The request the next bytes of the stream belong to: a WRITE payload received straight
    /// into its run (`Receiving`), or, between the parts of a large WRITE, at the device
    /// (nothing is received then, and nothing after it is parsed).
    pub(super) payload: Option<u32>,
    /// Payload bytes of a refused request still to discard.
    pub(super) skip_bytes: u64,
    /// The request at the head of the stream waiting for a buffer run.
    pub(super) stalled: Option<u32>,
    /// Requests of this connection not yet freed; at most the window.
    pub(super) outstanding: u32,
    /// Arena pages its requests hold (the per-connection share of the arena).
    pub(super) run_pages: u32,
    pub(super) send_head: u32,
    pub(super) send_tail: u32,
    pub(super) send_in_flight: bool,
    /// Responses in the send in flight, and bytes of the head response sent before it.
    pub(super) sending_count: u32,
    pub(super) send_offset_bytes: usize,
    /// A large READ answered with a simple reply whose data is being sent part by part:
    /// nothing else may be sent until its last part ([`NONE`]: none).
    pub(super) stream_owner: u32,
    pub(super) in_parse_ready: bool,
    pub(super) in_send_ready: bool,
    pub(super) in_waiters: bool,
    /// The tenant a native BIND chose; `None`: defaults apply.
    pub(super) bound: Option<Bound>,
    /// It registered tenants that it owns (the control plane orphans them when it closes).
    pub(super) owns_tenants: bool,
    /// Tenants this connection is counted for (the bound one and the defaults its I/O was
    /// charged to). Allocated on a first charge, kept across the slot's reuse.
    pub(super) charged: Vec<Charge>,
    /// RENEGOTIATE notices waiting for a request slot, oldest first.
    pub(super) notices: VecDeque<NoticeBody>,
    /// Requests of this connection waiting for room in a tenant queue; while any do, the
    /// connection is not read (back-pressure).
    pub(super) blocked_count: u32,
    /// The device submission queue of this connection's I/O (its priority class, from the
    /// `ionice` class a native client declares in HELLO; medium otherwise).
    pub(super) device_queue: u16,
    /// When it was accepted, whether it has completed one request (its handshake), and when
    /// its receive and send side last made progress (the timeouts' clocks).
    pub(super) accepted_at: Nanos,
    pub(super) established: bool,
    pub(super) receive_progress_at: Nanos,
    pub(super) send_progress_at: Nanos,
    /// TLS between the socket and the plaintext stream (`tls`).
    pub(super) tls: Option<Box<super::tls::TlsLink>>,
    /// The protocol asked for TLS (NBD's STARTTLS): nothing is parsed or received until the
    /// answers before it have left; then TLS starts.
    pub(super) tls_starting: bool,
    /// Its thread is parked: it moves to another once between requests (`handoff`).
    pub(super) moving: bool,
    /// Moving to spread its tenant's connections (`[scaling] spread_tenants`).
    pub(super) spreading: bool,
    /// Its read side was cancelled for the move.
    pub(super) move_cancelled: bool,
}

/// Submission queue of connections that declared no I/O priority.
pub(super) const DEFAULT_DEVICE_QUEUE: u16 = PriorityClass::Medium.submission_queue();

impl Connection {
    pub(super) fn empty() -> Connection {
        Connection {
            state: ConnectionState::Free,
            generation: 0,
            listener: 0,
            source: None,
            frontend: Frontend::Native,
            read: ReadState::Open,
            recv_buffer: Box::new([]),
            recv_start: 0,
            recv_end: 0,
            recv_in_flight: false,
            parked: false,
            parking: false,
            payload: None,
            skip_bytes: 0,
            stalled: None,
            outstanding: 0,
            run_pages: 0,
            send_head: NONE,
            send_tail: NONE,
            send_in_flight: false,
            sending_count: 0,
            send_offset_bytes: 0,
            stream_owner: NONE,
            in_parse_ready: false,
            in_send_ready: false,
            in_waiters: false,
            bound: None,
            owns_tenants: false,
            charged: Vec::new(),
            notices: VecDeque::new(),
            blocked_count: 0,
            device_queue: DEFAULT_DEVICE_QUEUE,
            accepted_at: Nanos::ZERO,
            established: false,
            receive_progress_at: Nanos::ZERO,
            send_progress_at: Nanos::ZERO,
            tls: None,
            tls_starting: false,
            moving: false,
            spreading: false,
            move_cancelled: false,
        }
    }

    pub(super) fn is_open(&self) -> bool {
        self.state == ConnectionState::Open
    }

    pub(super) fn id(&self, index: u32) -> ConnectionId {
        ConnectionId {
            index,
            generation: self.generation,
        }
    }
}

pub(super) struct Listener {
    pub(super) protocol: Protocol,
    pub(super) accept_in_flight: bool,
    /// No more accepts: the server is draining (the socket closes when the accept in
    /// flight comes back).
    pub(super) closed: bool,
    /// Its open connections (for its share of the table).
    pub(super) connections: u32,
    /// Its name and allow-list.
    pub(super) access: ListenerAccess,
    /// Connections it refused, by [`AcceptRefused::index`].
    pub(super) refused: [u64; AcceptRefused::COUNT],
    /// Log lines about peers its allow-list refused (rate-limited).
    pub(super) refusal_log: RefusalLog,
    /// Its connections that had not completed a request when they arrived, oldest first: the
    /// candidates for eviction. Entries go stale as connections complete a request or close,
    /// and are dropped when they reach the front (or when stale ones pile up), so finding the
    /// oldest costs O(1) amortised, not a scan of the table per accept under a flood.
    pub(super) waiting_first_request: VecDeque<Waiting>,
}

/// A connection that had not completed a request, as [`Listener::waiting_first_request`]
/// remembers it: the slot and its generation, so an entry for a slot reused since is stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Waiting {
    pub(super) accepted_at: Nanos,
    pub(super) index: u32,
    pub(super) generation: u32,
}

impl Dataplane {
    /// A connection leaves this thread (closed, or handed to another): it no longer counts
    /// against the table, its listener's share or its source address's.
    pub(super) fn uncount_connection(&mut self, listener: u32, source: Option<IpAddr>) {
        assert!(self.open_connections > 0);
        self.open_connections -= 1;
        self.listeners[listener as usize].connections -= 1;
        if let Some(source) = source
            && let Some(count) = self.connections_by_source.get_mut(&source)
        {
            *count -= 1;
            if *count == 0 {
                self.connections_by_source.remove(&source);
            }
        }
    }

    pub(super) fn arm_accept(&mut self, listener_index: u32) {
        let listener = &mut self.listeners[listener_index as usize];
        if listener.closed || listener.accept_in_flight {
            return;
        }
        listener.accept_in_flight = true;
        self.ops.push_back(Op::Accept {
            listener: listener_index,
        });
    }

    /// An accept completed on `listener_index`: `Ok(peer)` is a new connection (the peer's
    /// address when the driver knows it), `Err(errno)` a failure or the cancellation of a
    /// closing listener. Returns the connection's id, or why it was refused (the driver then
    /// closes the socket).
    pub fn handle_accept(
        &mut self,
        listener_index: u32,
        result: Result<Option<IpAddr>, i32>,
        now: Nanos,
    ) -> Result<ConnectionId, AcceptRefused> {
        let listener = &mut self.listeners[listener_index as usize];
        assert!(
            listener.accept_in_flight,
            "accept completion without an accept"
        );
        listener.accept_in_flight = false;
        let protocol = listener.protocol;
        if self.phase != Phase::Running || listener.closed {
            listener.closed = true;
            return Err(AcceptRefused::ShuttingDown);
        }
        let source = match result {
            Ok(source) => source,
            Err(errno) => {
                if errno != libc::ECANCELED {
                    tracing::warn!(thread = self.thread_index, errno, "accept failed");
                }
                self.arm_accept(listener_index);
                return Err(AcceptRefused::ShuttingDown);
            }
        };
        self.arm_accept(listener_index);
        // Control messages waiting for this thread apply before the connection gets its front
        // end: a new NBD session must not be offered an export removed before it connected.
        if self.control.has_messages(self.thread_index) {
            self.apply_control_messages(now);
        }
        if let Err(refusal) = self.check_allowed(listener_index, source, now) {
            return Err(self.refuse_connection(listener_index, source, refusal));
        }
        if let Err(refusal) = self.admit_connection(listener_index, source) {
            return Err(self.refuse_connection(listener_index, source, refusal));
        }
        let Some(index) = self.free_connections.pop() else {
            panic!("admit_connection guarantees a free slot");
        };
        self.stats.connections_accepted += 1;
        self.listeners[listener_index as usize].connections += 1;
        self.open_connections += 1;
        let recv_buffer = self.take_recv_buffer();
        let connection = &mut self.connections[index as usize];
        assert_eq!(connection.state, ConnectionState::Free);
        assert_eq!(connection.outstanding, 0);
        assert!(
            connection.charged.is_empty(),
            "a free connection still counted for a tenant"
        );
        let generation = connection.generation;
        let charged = std::mem::take(&mut connection.charged);
        let mut notices = std::mem::take(&mut connection.notices);
        notices.clear();
        *connection = Connection::empty();
        connection.charged = charged;
        connection.notices = notices;
        connection.generation = generation;
        connection.recv_buffer = recv_buffer;
        connection.state = ConnectionState::Open;
        connection.listener = listener_index;
        connection.source = source;
        connection.frontend =
            Frontend::new(protocol, self.nbd_exports.as_ref(), self.nvme_tcp.as_ref());
        connection.accepted_at = now;
        connection.receive_progress_at = now;
        connection.send_progress_at = now;
        if let Some(source) = source {
            *self.connections_by_source.entry(source).or_insert(0) += 1;
        }
        self.note_waiting(index);
        tracing::debug!(
            thread = self.thread_index,
            connection = index,
            peer = ?source,
            ?protocol,
            "connection opened"
        );
        if self
            .tls
            .as_ref()
            .is_some_and(|tls| tls.listeners_tls.get(listener_index as usize) == Some(&true))
        {
            // A TLS port: TLS from the first byte.
            self.start_tls(index);
        }
        // Parsing first: a protocol may speak before it listens (the NBD greeting); the
        // others find nothing to parse and receive.
        self.mark_parse(index);
        // Accepted while parked (it was queued on the listener before the server steered
        // new connections away): it moves on.
        self.mark_moving(index);
        Ok(self.connections[index as usize].id(index))
    }

    /// Checks the listener's allow-list: a peer it does not name (or whose address the driver
    /// does not know) is refused, logged with its address and the listener (rate-limited).
    fn check_allowed(
        &mut self,
        listener_index: u32,
        source: Option<IpAddr>,
        now: Nanos,
    ) -> Result<(), AcceptRefused> {
        let listener = &mut self.listeners[listener_index as usize];
        let Some(allow) = &listener.access.allow else {
            return Ok(());
        };
        if source.is_some_and(|source| allow.allows(source)) {
            return Ok(());
        }
        if let Some(suppressed) = listener.refusal_log.admit(now) {
            tracing::warn!(
                thread = self.thread_index,
                listener = %listener.access.name,
                peer = ?source,
                refused_unlogged = suppressed,
                "connection refused: the peer's address is not on the listener's allow-list"
            );
        }
        Err(AcceptRefused::NotAllowed)
    }

    /// Counts a refused connection (per listener and reason) and returns the reason.
    fn refuse_connection(
        &mut self,
        listener_index: u32,
        source: Option<IpAddr>,
        refusal: AcceptRefused,
    ) -> AcceptRefused {
        self.stats.connections_refused += 1;
        self.listeners[listener_index as usize].refused[refusal.index()] += 1;
        tracing::debug!(thread = self.thread_index, ?source, %refusal, "connection refused");
        refusal
    }

    /// Checks the table's limits for a new connection on `listener_index` from `source`;
    /// when the table is full, makes room by closing the oldest connection that never
    /// completed a request (a flood of idle connections is rotated out, established clients
    /// stay).
    fn admit_connection(
        &mut self,
        listener_index: u32,
        source: Option<IpAddr>,
    ) -> Result<(), AcceptRefused> {
        let limits = &self.limits;
        if let (Some(source), Some(max)) = (source, limits.connections_per_source_max) {
            let count = self
                .connections_by_source
                .get(&source)
                .copied()
                .unwrap_or(0);
            if count >= max {
                return Err(AcceptRefused::SourceFull);
            }
        }
        let listener_max = self.listener_connections_max();
        if self.listeners[listener_index as usize].connections >= listener_max
            && !self.evict_unestablished(Some(listener_index))
        {
            return Err(AcceptRefused::ListenerFull);
        }
        if self.open_connections >= self.limits.connections_max && !self.evict_unestablished(None) {
            return Err(AcceptRefused::TableFull);
        }
        // The table has slack beyond `connections_max` for connections still closing.
        if self.free_connections.is_empty() {
            return Err(AcceptRefused::TableFull);
        }
        Ok(())
    }

    /// Closes the oldest open connection (of `listener`, if given) that never completed a
    /// request, to make room for a new one; false when there is none.
    fn evict_unestablished(&mut self, listener: Option<u32>) -> bool {
        let oldest = match listener {
            Some(listener) => self
                .oldest_waiting(listener)
                .map(|waiting| (listener, waiting)),
            None => (0..self.listeners.len() as u32)
                .filter_map(|listener| {
                    self.oldest_waiting(listener)
                        .map(|waiting| (listener, waiting))
                })
                .min_by_key(|(_, waiting)| waiting.accepted_at),
        };
        let Some((listener, waiting)) = oldest else {
            return false;
        };
        let victim = waiting.index;
        let front = self.listeners[listener as usize]
            .waiting_first_request
            .pop_front();
        assert_eq!(front, Some(waiting));
        self.stats.connections_evicted += 1;
        self.abort_connection(victim, "evicted for a new connection: no request yet");
        // Its listener and source counts drop when the slot is released (at once when
        // nothing was in flight); the listener's share counts open connections only.
        true
    }

    /// Whether `waiting` still names an open connection that has not completed a request.
    fn still_waiting(&self, waiting: &Waiting) -> bool {
        let connection = &self.connections[waiting.index as usize];
        connection.generation == waiting.generation
            && connection.is_open()
            && !connection.established
    }

    /// The oldest connection of `listener` still waiting for its first request, after
    /// dropping the stale entries in front of it.
    fn oldest_waiting(&mut self, listener: u32) -> Option<Waiting> {
        loop {
            let front = *self.listeners[listener as usize]
                .waiting_first_request
                .front()?;
            if self.still_waiting(&front) {
                return Some(front);
            }
            self.listeners[listener as usize]
                .waiting_first_request
                .pop_front();
        }
    }

    /// Remembers connection `index` as waiting for its first request (just accepted, or
    /// moved here from another thread, with its own `accepted_at`), in order of arrival.
    pub(super) fn note_waiting(&mut self, index: u32) {
        let connection = &self.connections[index as usize];
        if connection.established {
            return;
        }
        let (listener, waiting) = (
            connection.listener,
            Waiting {
                accepted_at: connection.accepted_at,
                index,
                generation: connection.generation,
            },
        );
        let queue = &mut self.listeners[listener as usize].waiting_first_request;
        // Accepts come in time order; a connection moved from another thread may be older.
        let at = queue.partition_point(|other| other.accepted_at <= waiting.accepted_at);
        queue.insert(at, waiting);
        // Stale entries behind a live front pile up (every accept adds one): when they reach
        // twice the table, keep the live ones only (amortised O(1) per accept).
        let bound = 2 * self.connections.len();
        if self.listeners[listener as usize]
            .waiting_first_request
            .len()
            > bound
        {
            let mut queue =
                std::mem::take(&mut self.listeners[listener as usize].waiting_first_request);
            queue.retain(|waiting| self.still_waiting(waiting));
            self.listeners[listener as usize].waiting_first_request = queue;
        }
    }

    /// Connections one listener may hold: the table less a reserve for each other listener,
    /// so a flood on one port cannot lock the others out.
    fn listener_connections_max(&self) -> u32 {
        let table = self.limits.connections_max;
        let others = self.listeners.len().saturating_sub(1) as u32;
        let reserve = self.limits.connections_reserved_per_listener * others;
        table.saturating_sub(reserve).max(1)
    }

    pub(super) fn mark_parse(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if !connection.in_parse_ready {
            connection.in_parse_ready = true;
            self.parse_ready.push_back(index);
        }
    }

    pub(super) fn mark_send(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if !connection.in_send_ready {
            connection.in_send_ready = true;
            self.send_ready.push_back(index);
        }
    }

    pub(super) fn add_waiter(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if !connection.in_waiters {
            connection.in_waiters = true;
            self.waiters.push_back(index);
        }
    }

    /// Closes a connection that has nothing left to do: read side closed, nothing outstanding
    /// and nothing in flight.
    pub(super) fn maybe_close_idle(&mut self, index: u32) {
        let connection = &self.connections[index as usize];
        if connection.is_open()
            && connection.read == ReadState::Closed
            && connection.outstanding == 0
            && !connection.recv_in_flight
            && !connection.send_in_flight
        {
            self.set_closing(index);
            self.maybe_finish_close(index);
        }
    }

    /// Open → Closing: the connection no longer counts against the table's, its listener's
    /// or its source address's limit.
    fn set_closing(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        assert!(connection.is_open());
        connection.state = ConnectionState::Closing;
        connection.read = ReadState::Closed;
        let (listener, source) = (connection.listener, connection.source);
        self.uncount_connection(listener, source);
    }

    /// Abandons a connection: cancels its operations and frees every request no operation
    /// uses; the rest are freed as their completions arrive.
    pub(super) fn abort_connection(&mut self, index: u32, reason: &str) {
        let connection = &mut self.connections[index as usize];
        if !connection.is_open() {
            return;
        }
        tracing::debug!(
            thread = self.thread_index,
            connection = index,
            source = ?connection.source,
            reason,
            "closing connection"
        );
        let id = connection.id(index);
        self.set_closing(index);
        let connection = &mut self.connections[index as usize];
        let (recv_in_flight, send_in_flight) =
            (connection.recv_in_flight, connection.send_in_flight);
        if recv_in_flight {
            self.cancel_read_side(index);
        } else if let Some(request) = self.connections[index as usize].payload.take()
            && self.requests[request as usize].state == RequestState::Receiving
        {
            // Between the parts of a large WRITE the request is elsewhere (device, gate,
            // scheduler) and is freed from there.
            self.free_request(request);
        }
        if send_in_flight && self.connections[index as usize].tls.is_some() {
            self.tls_cancel_send(index);
        } else if send_in_flight {
            self.ops.push_back(Op::CancelSend { connection: id });
        } else {
            self.drop_send_queue(index);
        }
        if let Some(request) = self.connections[index as usize].stalled.take() {
            self.free_request(request);
        }
        if self.connections[index as usize].blocked_count > 0 {
            for _ in 0..self.blocked.len() {
                let Some(request) = self.blocked.pop_front() else {
                    break;
                };
                if self.requests[request as usize].connection_index == index {
                    self.free_request(request);
                } else {
                    self.blocked.push_back(request);
                }
            }
            self.connections[index as usize].blocked_count = 0;
        }
        self.maybe_finish_close(index);
    }

    /// Frees the responses waiting to be sent (no send in flight).
    pub(super) fn drop_send_queue(&mut self, index: u32) {
        assert!(!self.connections[index as usize].send_in_flight);
        loop {
            let connection = &mut self.connections[index as usize];
            let head = connection.send_head;
            if head == NONE {
                connection.send_tail = NONE;
                connection.send_offset_bytes = 0;
                break;
            }
            connection.send_head = self.requests[head as usize].next;
            self.requests[head as usize].next = NONE;
            self.free_request(head);
        }
    }

    /// Releases the slot once no operation and no request refers to the connection, and asks
    /// the driver to close the socket; the slot is reused only after that.
    pub(super) fn maybe_finish_close(&mut self, index: u32) {
        let connection = &mut self.connections[index as usize];
        if connection.state != ConnectionState::Closing
            || connection.recv_in_flight
            || connection.send_in_flight
            || connection.outstanding > 0
        {
            return;
        }
        if self.tls_outer_busy(index) {
            return; // Its completion comes back here.
        }
        self.abandon_spread(index);
        let connection = &mut self.connections[index as usize];
        connection.tls = None;
        connection.tls_starting = false;
        connection.moving = false;
        connection.move_cancelled = false;
        assert!(connection.payload.is_none());
        assert!(connection.stalled.is_none());
        assert_eq!(connection.send_head, NONE);
        assert_eq!(connection.blocked_count, 0);
        assert_eq!(
            connection.run_pages, 0,
            "a closed connection still holds pages"
        );
        connection.bound = None;
        connection.notices.clear();
        connection.device_queue = DEFAULT_DEVICE_QUEUE;
        if !connection.charged.is_empty() {
            let charged = self.release_charges(index);
            self.connections[index as usize].charged = charged;
        }
        self.release_owned_tenants(index);
        let connection = &mut self.connections[index as usize];
        let id = connection.id(index);
        tracing::debug!(
            thread = self.thread_index,
            connection = index,
            peer = ?connection.source,
            "connection closed"
        );
        connection.source = None;
        connection.parked = false;
        let recv_buffer = std::mem::take(&mut connection.recv_buffer);
        self.return_recv_buffer(recv_buffer);
        let connection = &mut self.connections[index as usize];
        // Drops per-connection protocol state (an NBD handshake's buffers) now, not at reuse.
        connection.frontend = Frontend::Native;
        connection.state = ConnectionState::Free;
        connection.generation = next_generation(connection.generation);
        // The slot becomes free when the driver takes this operation (`poll_op`): a driver
        // that keys sockets by slot must close the old socket before a new one gets it.
        self.ops.push_back(Op::Close { connection: id });
    }

    /// Cancels the read-side operation in flight: the receive, or the readiness wait of a
    /// parked connection.
    pub(super) fn cancel_read_side(&mut self, index: u32) {
        let connection = &self.connections[index as usize];
        assert!(connection.recv_in_flight);
        if connection.tls.is_some() {
            self.tls_cancel_recv(index);
            return;
        }
        let id = connection.id(index);
        self.ops.push_back(if connection.parked {
            Op::CancelWait { connection: id }
        } else {
            Op::CancelRecv { connection: id }
        });
    }

    /// A receive buffer from the pool, or a new one.
    pub(super) fn take_recv_buffer(&mut self) -> Box<[u8]> {
        self.recv_buffers
            .pop()
            .unwrap_or_else(|| vec![0u8; self.limits.recv_buffer_bytes].into_boxed_slice())
    }

    /// Gives a receive buffer back to the pool (or frees it beyond the pool's bound).
    pub(super) fn return_recv_buffer(&mut self, buffer: Box<[u8]>) {
        if buffer.len() == self.limits.recv_buffer_bytes
            && self.recv_buffers.len() < super::limits::RECV_BUFFERS_SPARE_MAX
        {
            self.recv_buffers.push(buffer);
        }
    }

    /// The connection slot `id` names, checked against its generation (a report about an
    /// older connection in the same slot is a driver bug).
    pub(super) fn connection_index(&self, id: ConnectionId) -> u32 {
        let connection = &self.connections[id.index as usize];
        assert_eq!(
            connection.generation, id.generation,
            "report for a stale connection {id:?}"
        );
        id.index
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an idle (parked) connection costs besides its socket: its slot, whose size is
    /// stated in `docs/OPERATIONS.md`; a parked connection holds no receive buffer.
    #[test]
    fn a_connection_slot_stays_small() {
        let size = size_of::<Connection>();
        eprintln!("connection slot: {size} bytes");
        assert!(size <= 512, "a connection slot grew to {size} bytes");
    }
}
