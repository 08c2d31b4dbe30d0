//! The epoll driver of one dataplane thread: it owns the epoll instance, the sockets and the
//! devices' ring-less queues, and runs the loop that moves bytes between them and the sans-IO
//! [`Dataplane`], under the same contract as the io_uring driver.
//!
//! A loop iteration: handle the up to [`BATCH_MAX`] events the last wait returned (each
//! marks its socket readable or writable and retries the operation waiting on it); poll the
//! devices' queues; `process`; issue every operation the dataplane asks for; sleep in one
//! `epoll_wait` (blocking mode, nothing pending) until an event, the earliest deadline or a
//! wake-up, or just collect what is ready (poll mode, or work pending).
//!
//! Readiness is edge-triggered: every socket is registered once, for input and output, when it
//! is accepted (listeners and the wake-up eventfd when the driver starts) and never modified.
//! The driver remembers per socket whether it may be readable or writable and clears that when
//! a call says `WouldBlock`, or moved fewer bytes than it offered (a `recv` that filled less
//! than its buffer emptied the socket, a `sendmsg` that sent less filled it; tokio's readiness
//! tracking relies on the same fact); the kernel reports an edge for every later arrival of
//! data or buffer space, so nothing is missed, no call is made only to learn `WouldBlock` in
//! the common case, and `epoll_ctl` is called only when a socket is accepted or closed, never
//! for a request. An operation the dataplane asks for runs at once when its socket may be ready
//! (one `recv`, `sendmsg` or `accept`) and is reported at once, like a device that finishes
//! synchronously (`process` then runs again); otherwise it waits for its edge. Cancelling a
//! waiting operation reports it with `ECANCELED`; a `Close` takes the socket out of the epoll
//! set and drops it (closing it).
//!
//! Devices: memory, null and emulated devices work as with the ring; file devices run on
//! their thread pool (`reflex_flash::pool`), whose completions come out of
//! `poll_completions` and wake this thread through the same eventfd the control plane and
//! shutdown use. Timeouts: `epoll_pwait2` gives nanosecond sleeps where the kernel has it
//! (5.11+); elsewhere (qemu-user) a sleep until a deadline is rounded up to a millisecond.
//!
//! Memory: receives and sends are synchronous system calls on the dataplane's receive space
//! and send segments; device buffers belong to the pool from `submit` until the completion
//! is reported, and the arena is leaked rather than freed if the loop ends with any
//! outstanding.

use std::fs::File;
use std::io::{self, ErrorKind, Read};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reflex_dataplane::namespaces::NamespaceSet;
use reflex_dataplane::{
    BATCH_MAX, ConnectionId, CoreStats, Dataplane, DeviceCommand, GENERATION_MASK, Op,
};
use reflex_flash::{Completion, DeviceQueue, Notify, Submit};
use reflex_qos::Nanos;

use super::sys::{self, Epoll, Timeout};
use crate::driver::{DriverSetup, EventfdWaker};

/// Passes of `process` and issuing per iteration while operations keep finishing at once.
const PASSES_PER_ITERATION_MAX: usize = 4;
/// Accept attempts per iteration, over all listeners: a flood of connections cannot keep
/// the thread from its other work; the rest waits for the next iteration.
const ACCEPTS_PER_ITERATION_MAX: u32 = 16;

const CONNECTION_EVENTS: u32 =
    (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32;
const LISTENER_EVENTS: u32 = (libc::EPOLLIN | libc::EPOLLET) as u32;
const WAKE_EVENTS: u32 = (libc::EPOLLIN | libc::EPOLLET) as u32;
/// Events after which a receive can make progress (data, end of stream or an error).
const READABLE_EVENTS: u32 =
    (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) as u32;
/// Events after which a send can make progress (room, or an error).
const WRITABLE_EVENTS: u32 = (libc::EPOLLOUT | libc::EPOLLHUP | libc::EPOLLERR) as u32;

/// An epoll event's and a device operation's `u64`: kind (4 bits) | generation (28 bits) |
/// index (32 bits).
mod token {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(u8)]
    pub enum Kind {
        Listener = 1,
        Connection = 2,
        Device = 4,
        Flush = 5,
        Migrated = 7,
        Wake = 0xC,
    }

    // Device operations' kinds are the shared ones (`crate::device_queues`).
    const _: () = assert!(Kind::Device as u8 == crate::device_queues::KIND_DEVICE);
    const _: () = assert!(Kind::Flush as u8 == crate::device_queues::KIND_FLUSH);
    const _: () = assert!(Kind::Migrated as u8 == crate::device_queues::KIND_MIGRATED);

    pub fn encode(kind: Kind, generation: u32, index: u32) -> u64 {
        crate::device_queues::pack(kind as u8, generation, index)
    }

    pub fn decode(value: u64) -> Option<(Kind, u32, u32)> {
        let (kind, generation, index) = crate::device_queues::unpack(value);
        let kind = match kind {
            1 => Kind::Listener,
            2 => Kind::Connection,
            4 => Kind::Device,
            5 => Kind::Flush,
            7 => Kind::Migrated,
            0xC => Kind::Wake,
            _ => return None,
        };
        Some((kind, generation, index))
    }
}
use token::Kind;

use crate::device_queues::{DeviceQueues, device_op_id, device_token};

struct ListenerSlot {
    /// `None` once the dataplane closed it.
    socket: Option<TcpListener>,
    /// The dataplane asked for an accept that has not been reported.
    accept_pending: bool,
    /// A connection may be waiting (cleared by `WouldBlock`).
    ready: bool,
}

struct ConnectionSlot {
    stream: TcpStream,
    generation: u32,
    /// Data, the end of the stream or an error may be waiting (cleared by `WouldBlock`).
    readable: bool,
    /// The socket buffer may have room (cleared by `WouldBlock`).
    writable: bool,
    recv_pending: bool,
    /// A parked connection waits to become readable (`Op::WaitReadable`).
    wait_pending: bool,
    send_pending: bool,
    /// The socket could not be set up (non-blocking mode or epoll registration): its first
    /// operation fails with this errno and the dataplane closes it.
    failed: Option<i32>,
}

pub struct EpollDriver {
    // Field order: the queues (whose pool may still use the arena) go before the dataplane.
    /// Per namespace slot: this thread's queue of its device (`None`: removed, not open).
    queues: DeviceQueues,
    dataplane: Dataplane,
    /// Wakes this thread when a device's pool completes (new queues need it).
    notify: Arc<dyn Notify>,
    epoll: Epoll,
    events: Box<[libc::epoll_event]>,
    /// Events the last wait returned, handled at the start of the next iteration.
    event_count: usize,
    listeners: Vec<ListenerSlot>,
    /// By connection index.
    connections: Vec<Option<ConnectionSlot>>,
    poll: bool,
    shutdown: Arc<AtomicBool>,
    shutdown_begun: bool,
    waker: Arc<File>,
    clock_origin: Instant,
    /// The queues to and from the other threads (inter-core migration).
    migration: Option<crate::migration::MigrationLinks>,
    /// Thread scaling: park and wake requests, connections moving between threads.
    scaling: Option<crate::scaling::ThreadScaling>,
    polled: Vec<Completion>,
    /// Results reported while issuing (then `process` runs again).
    finished_synchronously: bool,
    /// Results reported to the dataplane since the last count.
    reports: u64,
    /// Accept attempts left in this iteration.
    accepts_left: u32,
    /// An accept ran out of attempts and waits for the next iteration.
    accept_deferred: bool,
}

impl EpollDriver {
    pub fn new(dataplane: Dataplane, setup: DriverSetup) -> io::Result<EpollDriver> {
        let epoll = Epoll::new()?;
        epoll.add(
            setup.waker.as_raw_fd(),
            WAKE_EVENTS,
            token::encode(Kind::Wake, 0, 0),
        )?;
        let mut listeners = Vec::with_capacity(setup.listeners.len());
        for (index, socket) in setup.listeners.into_iter().enumerate() {
            socket.set_nonblocking(true)?;
            epoll.add(
                socket.as_raw_fd(),
                LISTENER_EVENTS,
                token::encode(Kind::Listener, 0, index as u32),
            )?;
            listeners.push(ListenerSlot {
                socket: Some(socket),
                accept_pending: false,
                ready: true,
            });
        }
        let notify: Arc<dyn Notify> = Arc::new(EventfdWaker(Arc::clone(&setup.waker)));
        let queues = open_queues(&setup.namespaces, &notify);
        let empty_event = libc::epoll_event { events: 0, u64: 0 };
        Ok(EpollDriver {
            queues,
            dataplane,
            notify,
            epoll,
            events: vec![empty_event; BATCH_MAX].into_boxed_slice(),
            event_count: 0,
            listeners,
            connections: Vec::new(),
            poll: setup.poll,
            shutdown: setup.shutdown,
            shutdown_begun: false,
            waker: setup.waker,
            clock_origin: setup.clock_origin,
            migration: setup.migration,
            scaling: setup.scaling,
            polled: Vec::new(),
            finished_synchronously: false,
            reports: 0,
            accepts_left: ACCEPTS_PER_ITERATION_MAX,
            accept_deferred: false,
        })
    }

    fn now(&self) -> Nanos {
        Nanos(self.clock_origin.elapsed().as_nanos() as u64)
    }

    /// Runs until shutdown has drained every connection and flushed every device.
    pub fn run(mut self) -> io::Result<CoreStats> {
        let result = self.run_loop();
        if let Some(links) = &self.migration
            && self.dataplane.is_finished()
        {
            links.linger(&mut self.dataplane, self.clock_origin);
        }
        if result.is_err() || self.dataplane.abandoned_device_operations() > 0 {
            // A device operation may still be outstanding (a wait failed, or a device never
            // answered): its pool thread may still write into the arena.
            self.dataplane.leak_arena_on_drop();
        }
        self.dataplane.log_ledgers();
        self.dataplane.set_driver_stats(false, 0);
        result.map(|()| self.dataplane.stats())
    }

    fn run_loop(&mut self) -> io::Result<()> {
        // Timed sleeps end at device completions and token deadlines; the default 50 µs of
        // slack would add up to that much to a request's latency.
        if let Err(e) = crate::sys::set_timer_slack_ns(1) {
            tracing::debug!(error = %e, "timer slack unchanged");
        }
        // When the loop last found nothing to do: the time from then to the next iteration
        // is idle (the complement of the thread's busy share in the live figures).
        let mut idle_since: Option<Nanos> = None;
        // Opened here, on the thread it measures.
        let mut run_delay = crate::run_delay::RunDelay::for_this_thread(self.now());
        loop {
            let now = self.now();
            if let Some(since) = idle_since.take() {
                self.dataplane.count_idle(now.saturating_since(since).0);
            }
            if let Some(waited) = run_delay.sample(now) {
                self.dataplane.count_run_delay(waited);
            }
            self.accepts_left = ACCEPTS_PER_ITERATION_MAX;
            for slot in 0..std::mem::take(&mut self.event_count) {
                let event = self.events[slot];
                self.handle_event(event, now);
            }
            if std::mem::take(&mut self.accept_deferred) {
                self.retry_accepts(now);
            }
            self.poll_devices(now);
            if let Some(links) = &self.migration {
                self.reports += links.receive(&mut self.dataplane, now) as u64;
            }
            self.receive_scaling(now);
            let reports = std::mem::take(&mut self.reports);
            self.dataplane.count_iteration(reports);
            if !self.shutdown_begun && self.shutdown.load(Ordering::Relaxed) {
                self.shutdown_begun = true;
                self.dataplane.begin_shutdown();
            }
            for _ in 0..PASSES_PER_ITERATION_MAX {
                self.finished_synchronously = false;
                self.dataplane.process_without_sends(now);
                self.issue_and_migrate(now);
                if !self.finished_synchronously {
                    break;
                }
            }
            // Every pass's answers in one gathered send per connection.
            self.dataplane.start_sends(now);
            self.issue_and_migrate(now);
            if self.dataplane.is_finished() {
                // Nothing of the driver's is in flight: every socket is closed, and
                // operations waiting for readiness were cancelled before that.
                return Ok(());
            }
            let device_due = self.device_deadline().is_some_and(|due| due <= now);
            let busy = self.dataplane.has_pending_work()
                || self.finished_synchronously
                || device_due
                || self.accept_deferred
                || self.scaling.as_ref().is_some_and(|s| s.has_backlog());
            if !busy {
                idle_since = Some(self.now());
            }
            let timeout = if self.poll || busy {
                Timeout::Zero
            } else {
                self.dataplane.will_sleep();
                self.sleep_bound(now)
            };
            self.event_count = self.epoll.wait(&mut self.events, timeout)?;
        }
    }

    fn device_deadline(&self) -> Option<Nanos> {
        self.queues.next_deadline()
    }

    /// The longest the thread may sleep: until the earliest dataplane or device deadline.
    fn sleep_bound(&self, now: Nanos) -> Timeout {
        let deadline = match (self.dataplane.next_deadline(), self.device_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        match deadline {
            None => Timeout::Forever,
            Some(due) => {
                Timeout::After(Duration::from_nanos(due.saturating_since(now).0.max(1_000)))
            }
        }
    }

    /// Thread scaling: applies a park or wake request and adopts the connections handed to
    /// this thread.
    fn receive_scaling(&mut self, now: Nanos) {
        let Some(scaling) = self.scaling.as_mut() else {
            return;
        };
        if scaling.apply(&mut self.dataplane) {
            self.reports += 1;
        }
        let mut adopted = Vec::new();
        self.reports += scaling.receive(&mut self.dataplane, now, |_, id, stream| {
            adopted.push((id, stream));
        }) as u64;
        for (id, stream) in adopted {
            self.adopt(id, stream);
        }
    }

    /// Counts one result reported to the dataplane.
    fn reported(&mut self) {
        self.reports += 1;
        self.finished_synchronously = true;
    }

    // ----- Readiness -------------------------------------------------------------------

    fn handle_event(&mut self, event: libc::epoll_event, now: Nanos) {
        let flags = event.events;
        let Some((kind, generation, index)) = token::decode(event.u64) else {
            panic!("epoll event with unknown token {:#x}", { event.u64 });
        };
        match kind {
            Kind::Wake => self.drain_waker(),
            Kind::Listener => {
                let slot = &mut self.listeners[index as usize];
                if slot.socket.is_none() {
                    // Closed since the wait (see `forget`): nothing to accept on.
                    return;
                }
                slot.ready = true;
                self.try_accept(index, now);
            }
            Kind::Connection => {
                let Some(slot) = self.connections[index as usize]
                    .as_mut()
                    .filter(|slot| slot.generation == generation)
                else {
                    // For a socket closed since (see `forget`): its slot is empty or reused.
                    return;
                };
                if flags & READABLE_EVENTS != 0 {
                    slot.readable = true;
                }
                if flags & WRITABLE_EVENTS != 0 {
                    slot.writable = true;
                }
                let id = ConnectionId { index, generation };
                self.try_wait(id, now);
                self.try_recv(id, now);
                self.try_send(id, now);
            }
            Kind::Device | Kind::Flush | Kind::Migrated => {
                panic!("a device token in an epoll event")
            }
        }
    }

    /// Resets the wake-up eventfd; what woke the thread (shutdown, control messages, device
    /// completions) is looked at by the rest of the iteration.
    fn drain_waker(&mut self) {
        let mut word = [0u8; 8];
        if let Err(e) = (&*self.waker).read(&mut word)
            && e.kind() != ErrorKind::WouldBlock
        {
            tracing::warn!(error = %e, "reading the wake-up eventfd failed");
        }
    }

    fn retry_accepts(&mut self, now: Nanos) {
        for listener in 0..self.listeners.len() as u32 {
            self.try_accept(listener, now);
        }
    }

    /// One accept, if one is pending and the listener may have a connection.
    fn try_accept(&mut self, listener: u32, now: Nanos) {
        let slot = &mut self.listeners[listener as usize];
        if !slot.accept_pending || !slot.ready {
            return;
        }
        if self.accepts_left == 0 {
            self.accept_deferred = true;
            return;
        }
        self.accepts_left -= 1;
        let Some(socket) = &slot.socket else {
            panic!("accept pending on closed listener {listener}");
        };
        let accepted = loop {
            match socket.accept() {
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        let report = match &accepted {
            Ok((_, peer)) => Ok(Some(peer.ip())),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                slot.ready = false;
                return;
            }
            Err(e) => Err(e.raw_os_error().unwrap_or(libc::EIO)),
        };
        slot.accept_pending = false;
        self.reported();
        match (
            self.dataplane.handle_accept(listener, report, now),
            accepted,
        ) {
            (Ok(id), Ok((stream, _))) => self.adopt(id, stream),
            (Ok(_), Err(_)) => panic!("the dataplane took a failed accept"),
            // Refused: dropping the stream closes it.
            (Err(_), _) => {}
        }
    }

    /// Takes an accepted connection into slot `id`: non-blocking, no Nagle, watched for
    /// input and output.
    fn adopt(&mut self, id: ConnectionId, stream: TcpStream) {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY refused");
        }
        let token = token::encode(Kind::Connection, id.generation, id.index);
        let failed = match stream
            .set_nonblocking(true)
            .and_then(|()| self.epoll.add(stream.as_raw_fd(), CONNECTION_EVENTS, token))
        {
            Ok(()) => None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot set up an accepted socket; closing it");
                Some(e.raw_os_error().unwrap_or(libc::EIO))
            }
        };
        let index = id.index as usize;
        if self.connections.len() <= index {
            self.connections.resize_with(index + 1, || None);
        }
        // The dataplane may hand out a slot whose previous connection it just closed (an
        // eviction): that Close is queued but not yet issued and nothing of the old socket is
        // pending. Replacing it closes it now; the queued Close then finds a newer generation
        // and leaves the new socket alone.
        if let Some(old) = self.connections[index].take() {
            assert_ne!(
                old.generation, id.generation,
                "connection slot still in use"
            );
            assert!(
                !old.recv_pending && !old.wait_pending && !old.send_pending,
                "a replaced socket had an operation pending"
            );
            forget(&self.epoll, old.stream.as_raw_fd());
        }
        self.connections[index] = Some(ConnectionSlot {
            stream,
            generation: id.generation,
            readable: true,
            writable: true,
            recv_pending: false,
            wait_pending: false,
            send_pending: false,
            failed,
        });
    }

    fn slot_mut(&mut self, id: ConnectionId) -> &mut ConnectionSlot {
        match self
            .connections
            .get_mut(id.index as usize)
            .and_then(Option::as_mut)
        {
            Some(slot) if slot.generation == id.generation => slot,
            _ => panic!("operation on connection {id:?} without a socket"),
        }
    }

    /// The pending receive on `id`, if its socket may be readable: one `recv` into the
    /// dataplane's receive space, reported unless it would block.
    fn try_recv(&mut self, id: ConnectionId, now: Nanos) {
        let Some(slot) = self.connections[id.index as usize].as_mut() else {
            panic!("receive on connection {id:?} without a socket");
        };
        if !slot.recv_pending || !slot.readable {
            return;
        }
        let result = match slot.failed {
            Some(errno) => Err(errno),
            None => {
                let space = self.dataplane.receive_space(id);
                let space_bytes = space.len();
                loop {
                    match (&slot.stream).read(space) {
                        Ok(received) => {
                            // Less than asked for: the socket was empty at that moment, so
                            // whatever arrives later raises a new edge (see the module doc).
                            // The end of the stream (0) stays readable: it reads 0 again.
                            if received > 0 && received < space_bytes {
                                slot.readable = false;
                            }
                            break Ok(received);
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            slot.readable = false;
                            return;
                        }
                        Err(e) => break Err(e.raw_os_error().unwrap_or(libc::EIO)),
                    }
                }
            }
        };
        slot.recv_pending = false;
        self.reported();
        self.dataplane.handle_recv(id, result, now);
    }

    /// The pending readiness wait on `id`, if its socket may be readable: a one-byte
    /// `MSG_PEEK` tells whether it really is (data, the end of the stream or an error), so
    /// that a parked connection takes a receive buffer only when bytes are there.
    fn try_wait(&mut self, id: ConnectionId, now: Nanos) {
        let Some(slot) = self.connections[id.index as usize].as_mut() else {
            panic!("readiness wait on connection {id:?} without a socket");
        };
        if !slot.wait_pending || !slot.readable {
            return;
        }
        if slot.failed.is_none() {
            let mut byte = [0u8; 1];
            loop {
                match slot.stream.peek(&mut byte) {
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        slot.readable = false;
                        return;
                    }
                    // Data, the end of the stream or an error: the receive will see it.
                    _ => break,
                }
            }
        }
        slot.wait_pending = false;
        self.reported();
        self.dataplane.handle_readable(id, Ok(()), now);
    }

    /// The pending send on `id`, if its socket may be writable: one gathered `sendmsg` of
    /// the dataplane's segments, reported (partial or not) unless it would block.
    fn try_send(&mut self, id: ConnectionId, now: Nanos) {
        let Some(slot) = self.connections[id.index as usize].as_mut() else {
            panic!("send on connection {id:?} without a socket");
        };
        if !slot.send_pending || !slot.writable {
            return;
        }
        let result = match slot.failed {
            Some(errno) => Err(errno),
            None => match sys::send_segments(&slot.stream, &self.dataplane, id) {
                Ok((sent, offered)) => {
                    // A partial send filled the socket buffer: room raises a new edge.
                    if sent < offered {
                        slot.writable = false;
                    }
                    Ok(sent)
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    slot.writable = false;
                    return;
                }
                Err(e) => Err(e.raw_os_error().unwrap_or(libc::EIO)),
            },
        };
        slot.send_pending = false;
        self.reported();
        self.dataplane.handle_sent(id, result, now);
    }

    fn poll_devices(&mut self, now: Nanos) {
        let mut polled = std::mem::take(&mut self.polled);
        for queue in self.queues.iter_mut() {
            queue.poll_completions(now, &mut polled);
        }
        for completion in polled.drain(..) {
            let Some((kind @ (Kind::Device | Kind::Flush | Kind::Migrated), generation, index)) =
                token::decode(completion.user_data)
            else {
                panic!(
                    "device reported an unknown completion {:#x}",
                    completion.user_data
                );
            };
            self.reports += 1;
            let id = device_op_id(kind as u8, generation, index);
            self.dataplane.handle_device(id, completion.result, now);
        }
        self.polled = polled;
    }

    // ----- Issuing the dataplane's operations ------------------------------------------

    /// Issues the dataplane's operations, then hands the reads it migrates to their threads.
    fn issue_and_migrate(&mut self, now: Nanos) {
        self.issue_ops(now);
        if let Some(links) = &self.migration {
            links.send(&mut self.dataplane);
        }
    }

    fn issue_ops(&mut self, now: Nanos) {
        self.queues
            .prefetch_lends(self.dataplane.queued_device_commands());
        while let Some(op) = self.dataplane.poll_op() {
            match op {
                Op::Accept { listener } => {
                    let slot = &mut self.listeners[listener as usize];
                    assert!(
                        slot.socket.is_some(),
                        "accept on closed listener {listener}"
                    );
                    assert!(!slot.accept_pending, "two accepts on listener {listener}");
                    slot.accept_pending = true;
                    self.try_accept(listener, now);
                }
                Op::CloseListener { listener } => {
                    let slot = &mut self.listeners[listener as usize];
                    if let Some(socket) = slot.socket.take() {
                        forget(&self.epoll, socket.as_raw_fd());
                    }
                    if std::mem::take(&mut slot.accept_pending) {
                        self.reported();
                        let refused =
                            self.dataplane
                                .handle_accept(listener, Err(libc::ECANCELED), now);
                        assert!(refused.is_err(), "a closed listener accepted");
                    }
                }
                Op::Recv { connection } => {
                    let slot = self.slot_mut(connection);
                    assert!(!slot.recv_pending, "two receives in flight");
                    slot.recv_pending = true;
                    self.try_recv(connection, now);
                }
                Op::WaitReadable { connection } => {
                    let slot = self.slot_mut(connection);
                    assert!(
                        !slot.recv_pending && !slot.wait_pending,
                        "two receives in flight"
                    );
                    slot.wait_pending = true;
                    self.try_wait(connection, now);
                }
                Op::Send { connection } => {
                    let slot = self.slot_mut(connection);
                    assert!(!slot.send_pending, "two sends in flight");
                    slot.send_pending = true;
                    self.try_send(connection, now);
                }
                Op::CancelRecv { connection } => {
                    // Not pending: it completed already, and that report stands.
                    if std::mem::take(&mut self.slot_mut(connection).recv_pending) {
                        self.reported();
                        self.dataplane
                            .handle_recv(connection, Err(libc::ECANCELED), now);
                    }
                }
                Op::CancelWait { connection } => {
                    if std::mem::take(&mut self.slot_mut(connection).wait_pending) {
                        self.reported();
                        self.dataplane
                            .handle_readable(connection, Err(libc::ECANCELED), now);
                    }
                }
                Op::CancelSend { connection } => {
                    if std::mem::take(&mut self.slot_mut(connection).send_pending) {
                        self.reported();
                        self.dataplane
                            .handle_sent(connection, Err(libc::ECANCELED), now);
                    }
                }
                Op::Close { connection } => {
                    // A slot already taken by a newer connection was closed at its accept.
                    let entry = &mut self.connections[connection.index as usize];
                    if entry
                        .as_ref()
                        .is_some_and(|slot| slot.generation == connection.generation)
                        && let Some(slot) = entry.take()
                    {
                        assert!(
                            !slot.recv_pending && !slot.wait_pending && !slot.send_pending,
                            "close with an operation pending"
                        );
                        forget(&self.epoll, slot.stream.as_raw_fd());
                        // Dropping the stream closes the socket.
                    }
                }
                Op::Handoff { connection, to } => {
                    let entry = &mut self.connections[connection.index as usize];
                    let slot = match entry.take() {
                        Some(slot) if slot.generation == connection.generation => slot,
                        _ => panic!("handoff of connection {connection:?} without a socket"),
                    };
                    assert!(
                        !slot.recv_pending && !slot.wait_pending && !slot.send_pending,
                        "handoff with an operation pending"
                    );
                    // The destination's epoll watches it from now on.
                    forget(&self.epoll, slot.stream.as_raw_fd());
                    let moved = self.dataplane.take_moved(connection);
                    let Some(scaling) = self.scaling.as_mut() else {
                        panic!("a handoff without thread scaling");
                    };
                    scaling.send(to, slot.stream, moved, self.dataplane.connections_open());
                }
                Op::Device(command) => self.submit_device(&command, now),
                Op::OpenDevice { namespace_index } => {
                    let namespaces = Arc::clone(self.dataplane.namespaces());
                    let notify = &self.notify;
                    self.queues.open(&namespaces, namespace_index, |device| {
                        open_queue(device, notify)
                    });
                }
                Op::CloseDevice { namespace_index } => self.queues.close(namespace_index),
                Op::SampleRtt { connection } => {
                    let rtt = match &self.connections[connection.index as usize] {
                        Some(slot) if slot.generation == connection.generation => {
                            crate::sys::tcp_rtt_us(&slot.stream)
                        }
                        _ => Err(libc::EBADF),
                    };
                    self.dataplane.handle_rtt(connection, rtt);
                }
            }
        }
    }

    fn submit_device(&mut self, command: &DeviceCommand, now: Nanos) {
        if let Some(lent) = self.queues.lend(command) {
            self.reported();
            self.dataplane.handle_device_lent(command.id, lent, now);
            return;
        }
        let user_data = device_token(command.id);
        let op = match crate::migration::migrated_device_op(&self.dataplane, command, user_data) {
            Some(op) => op,
            None => self.dataplane.device_op(command, user_data, None),
        };
        let namespace_index = usize::from(command.namespace_index);
        let Some(queue) = self.queues.get_mut(namespace_index) else {
            // Not reachable: the dataplane opens a slot's queue before its first operation
            // and closes it only when none is left.
            self.reported();
            self.dataplane.handle_device(
                command.id,
                Err(reflex_flash::FlashError::Io { errno: libc::ENXIO }),
                now,
            );
            return;
        };
        match queue.submit(op, now) {
            Submit::Done(result) => {
                self.reported();
                self.dataplane.handle_device(command.id, result, now);
            }
            Submit::Pending => {}
            Submit::Ring(_) => {
                panic!("namespace index {namespace_index}: a ring-less queue returned a ring entry")
            }
        }
    }
}

/// Takes a socket that is about to be closed out of the epoll set. Closing alone would do it
/// only once every copy of the descriptor is closed, and a `fork` in another thread of the
/// process (an embedding program, a test spawning a tool) holds copies for a moment; its
/// events would then keep coming, for a slot that is empty or reused.
fn forget(epoll: &Epoll, fd: std::os::fd::RawFd) {
    if let Err(e) = epoll.delete(fd) {
        tracing::debug!(error = %e, "epoll_ctl(DEL) failed");
    }
}

/// Each namespace's ring-less queue for this thread; completions from a device's own threads
/// wake it through `notify`.
fn open_queues(namespaces: &NamespaceSet, notify: &Arc<dyn Notify>) -> DeviceQueues {
    DeviceQueues::open_all(namespaces, |device| open_queue(device, notify))
}

/// One namespace's ring-less queue for this thread (opened at start, or on
/// `Op::OpenDevice` for a namespace added at run time; dropped on `Op::CloseDevice`, when none
/// of its operations is outstanding).
#[allow(unsafe_code)]
fn open_queue(
    device: &Arc<dyn reflex_flash::Device>,
    notify: &Arc<dyn Notify>,
) -> Box<dyn DeviceQueue> {
    // SAFETY: every buffer the driver submits to these queues is a run of the dataplane's
    // arena (a heap allocation that never moves), which the dataplane leaves untouched until
    // `handle_device` for that operation; the driver calls `handle_device` only for a result
    // out of `Submit::Done` or `poll_completions`, and leaks the arena instead of freeing it
    // when its loop ends with any device operation outstanding (`EpollDriver::run`).
    unsafe { device.queue_without_ring(Arc::clone(notify)) }
}

const _: () = assert!(GENERATION_MASK == (1 << 28) - 1);
// A queue's operations outstanding: at most the thread's device operations in flight, plus
// the flush of its namespace at shutdown.
const _: () = assert!(
    (reflex_dataplane::DEVICE_IN_FLIGHT_PER_THREAD_MAX as usize)
        < reflex_flash::pool::QUEUE_IN_FLIGHT_MAX
);
