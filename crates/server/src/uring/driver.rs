//! The io_uring driver of one dataplane thread: it owns the ring, the sockets, the devices'
//! queues and every raw pointer handed to the kernel, and runs the loop that moves bytes
//! between them and the sans-IO [`Dataplane`].
//!
//! A loop iteration: reap up to [`BATCH_MAX`] completions and report each to the dataplane;
//! poll the devices that complete on their own (the emulated device); `process`; issue every
//! operation the dataplane asks for (a device that finishes synchronously is reported at once,
//! and `process` runs again so its answer goes out in this iteration); one `io_uring_enter`,
//! which in blocking mode sleeps until a completion, the earliest deadline or a wake-up.
//!
//! Memory: receives land in [`Dataplane::receive_space`], sends gather
//! [`Dataplane::send_segments`] through a per-connection `msghdr` the driver keeps until the
//! send completes, device I/O uses [`Dataplane::device_op`]'s buffers. The dataplane keeps
//! each of those regions unchanged until the operation is reported back; the driver keeps its
//! own (`msghdr`s, accept addresses, the wake-up word) until the completion is reaped, and
//! never drops the dataplane with an operation in flight (it leaks the arena instead).

use std::fs::File;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types};
use reflex_dataplane::{
    BATCH_MAX, ConnectionId, CoreStats, Dataplane, DeviceCommand, DeviceOpId, GENERATION_MASK, Op,
    SEND_SEGMENTS_MAX,
};
use reflex_flash::{Completion, Submit};
use reflex_qos::Nanos;

use super::ring::{Cqe, Ring};
use crate::driver::DriverSetup;
use crate::sys;

pub const RING_SQ_ENTRIES: u32 = 1024;
/// Completions the ring holds: at most one receive and one send per connection, one accept
/// per listener, the device operations in flight, cancellations and the wake-up read.
pub const RING_CQ_ENTRIES_MIN: u32 = 8192;

/// Passes of `process` and issuing per iteration while synchronous devices keep finishing.
const PASSES_PER_ITERATION_MAX: usize = 4;

/// How one loop iteration waits.
enum Sleep {
    /// Do not sleep: enter without waiting (polling mode, or spinning to a near deadline).
    Poll,
    /// Sleep until a completion, or at most this long.
    Until(Option<Duration>),
}

/// How late timed sleeps end, lately: a decaying maximum of how far past the requested
/// time the thread woke, so that the thread wakes early enough for its deadlines.
#[derive(Debug, Clone, Copy)]
struct WakeCost {
    late_ns: u64,
    max: Nanos,
}

impl WakeCost {
    fn new(max: Nanos) -> WakeCost {
        WakeCost { late_ns: 0, max }
    }

    /// A timed sleep of `timeout` returned after `slept` (measured with the clock reads the
    /// loop makes anyway).
    fn observe(&mut self, slept: Duration, timeout: Duration) {
        if slept < timeout {
            return; // Woken by a completion: says nothing about timer precision.
        }
        let late_ns = (slept - timeout).as_nanos() as u64;
        // Rise at once, decay by 1/16 per sample.
        self.late_ns = late_ns.max(self.late_ns - self.late_ns / 16);
    }

    /// How long before a deadline to stop sleeping and spin.
    fn guard(&self) -> Nanos {
        Nanos(self.late_ns.saturating_mul(2).min(self.max.0))
    }
}

/// `user_data`: kind (4 bits) | generation (28 bits) | index (32 bits). Kinds from
/// [`Kind::Wake`] up are the driver's own operations.
mod token {
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(u8)]
    pub enum Kind {
        Accept = 1,
        Recv = 2,
        Send = 3,
        Device = 4,
        Flush = 5,
        Poll = 6,
        Migrated = 7,
        Wake = 0xC,
        Cancel = 0xD,
    }

    // Device operations' kinds are the shared ones (`crate::device_queues`).
    const _: () = assert!(Kind::Device as u8 == crate::device_queues::KIND_DEVICE);
    const _: () = assert!(Kind::Flush as u8 == crate::device_queues::KIND_FLUSH);
    const _: () = assert!(Kind::Migrated as u8 == crate::device_queues::KIND_MIGRATED);

    pub fn encode(kind: Kind, generation: u32, index: u32) -> u64 {
        crate::device_queues::pack(kind as u8, generation, index)
    }

    pub fn decode(user_data: u64) -> Option<(Kind, u32, u32)> {
        let (kind, generation, index) = crate::device_queues::unpack(user_data);
        let kind = match kind {
            1 => Kind::Accept,
            2 => Kind::Recv,
            3 => Kind::Send,
            4 => Kind::Device,
            5 => Kind::Flush,
            7 => Kind::Migrated,
            6 => Kind::Poll,
            0xC => Kind::Wake,
            0xD => Kind::Cancel,
            _ => return None,
        };
        Some((kind, generation, index))
    }
}
use token::Kind;

use crate::device_queues::{DeviceQueues, device_op_id, device_token};

/// The kernel's view of one `sendmsg`: boxed, owned by the driver from push to completion.
struct SendStaging {
    msghdr: libc::msghdr,
    iovecs: [libc::iovec; SEND_SEGMENTS_MAX],
}

/// One listening socket and the address buffer its accept in flight fills.
struct ListenerSlot {
    socket: Option<TcpListener>,
    accept_in_flight: bool,
    /// The dataplane closed it: drop the socket when the accept in flight comes back.
    closing: bool,
    address: Box<(libc::sockaddr_storage, libc::socklen_t)>,
}

pub struct UringDriver {
    // Field order: the ring is dropped before the memory it may point into.
    ring: Ring,
    dataplane: Dataplane,
    listeners: Vec<ListenerSlot>,
    /// By connection index: the socket and the generation of the connection it belongs to.
    sockets: Vec<Option<(u32, TcpStream)>>,
    /// By connection index: the staging of the send in flight.
    staging: Vec<Option<Box<SendStaging>>>,
    /// Boxed: a staging's address is the kernel's from push to completion, so it must not move
    /// when the pool grows.
    #[allow(clippy::vec_box)]
    spare_staging: Vec<Box<SendStaging>>,
    /// Per namespace slot: this thread's queue of its device (`None`: removed, not open).
    queues: DeviceQueues,
    registered: bool,
    poll: bool,
    shutdown: Arc<AtomicBool>,
    shutdown_begun: bool,
    waker: Arc<File>,
    wake_word: Box<u64>,
    wake_in_flight: bool,
    wake_cancelled: bool,
    clock_origin: Instant,
    /// The queues to and from the other threads (inter-core migration).
    migration: Option<crate::migration::MigrationLinks>,
    /// Thread scaling: park and wake requests, connections moving between threads.
    scaling: Option<crate::scaling::ThreadScaling>,
    wake_cost: WakeCost,
    /// Operations pushed whose completion has not been reaped, and how many of them are
    /// device operations (a shutdown may abandon those).
    in_flight: u64,
    device_in_flight: u64,
    cqes: Box<[Cqe; BATCH_MAX]>,
    polled: Vec<Completion>,
    /// Synchronous device results reported while issuing (then `process` runs again).
    finished_synchronously: bool,
    /// Receives the dataplane asked for in this iteration, pushed after its sends (see
    /// [`Self::push_deferred_recvs`]).
    deferred_recvs: Vec<ConnectionId>,
}

impl UringDriver {
    pub fn new(dataplane: Dataplane, setup: DriverSetup) -> std::io::Result<UringDriver> {
        let mut ring = Ring::new(RING_SQ_ENTRIES, setup.cq_entries)?;
        let (base, size_bytes) = dataplane.arena_region();
        let registered = setup.register_buffers
            // SAFETY: the arena lives in the dataplane, which the driver owns and drops after
            // the ring (field order), and it is never moved (a heap allocation).
            && match unsafe { ring.register_region(base, size_bytes) } {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(thread = dataplane.thread_index(), error = %e,
                        "cannot register the buffer arena; using unregistered buffers");
                    false
                }
            };
        let listeners = setup
            .listeners
            .into_iter()
            .map(|socket| ListenerSlot {
                socket: Some(socket),
                accept_in_flight: false,
                closing: false,
                address: Box::new((sys::empty_sockaddr(), 0)),
            })
            .collect();
        Ok(UringDriver {
            ring,
            dataplane,
            listeners,
            sockets: Vec::new(),
            staging: Vec::new(),
            spare_staging: Vec::new(),
            queues: DeviceQueues::open_all(&setup.namespaces, |device| device.queue()),
            registered,
            poll: setup.poll,
            shutdown: setup.shutdown,
            shutdown_begun: false,
            waker: setup.waker,
            wake_word: Box::new(0),
            wake_in_flight: false,
            wake_cancelled: false,
            clock_origin: setup.clock_origin,
            migration: setup.migration,
            scaling: setup.scaling,
            wake_cost: WakeCost::new(setup.spin_before_deadline_max),
            in_flight: 0,
            device_in_flight: 0,
            cqes: Box::new([Cqe::default(); BATCH_MAX]),
            polled: Vec::new(),
            finished_synchronously: false,
            deferred_recvs: Vec::new(),
        })
    }

    pub fn registered_buffers(&self) -> bool {
        self.registered
    }

    fn now(&self) -> Nanos {
        Nanos(self.clock_origin.elapsed().as_nanos() as u64)
    }

    /// Runs until shutdown has drained every connection and flushed every device.
    pub fn run(mut self) -> std::io::Result<CoreStats> {
        let result = self.run_loop();
        if let Some(links) = &self.migration
            && self.dataplane.is_finished()
        {
            links.linger(&mut self.dataplane, self.clock_origin);
        }
        if self.in_flight > 0 || self.dataplane.abandoned_device_operations() > 0 {
            // Only after an enter error or a device that never answered: never free memory
            // the kernel may still use.
            self.dataplane.leak_arena_on_drop();
            for staging in self.staging.iter_mut() {
                std::mem::forget(staging.take());
            }
            std::mem::forget(std::mem::take(&mut self.wake_word));
        }
        self.dataplane.log_ledgers();
        self.dataplane
            .set_driver_stats(self.registered, self.ring.full_flush_count());
        result.map(|()| self.dataplane.stats())
    }

    fn run_loop(&mut self) -> std::io::Result<()> {
        // Timed sleeps end at device completions and token deadlines; the default 50 µs of
        // slack would add up to that much to a request's latency.
        if let Err(e) = sys::set_timer_slack_ns(1) {
            tracing::debug!(error = %e, "timer slack unchanged");
        }
        self.arm_wake();
        // When the loop last found nothing to do: the time from then to the next iteration
        // is idle (the complement of the thread's busy share in the live figures).
        let mut idle_since: Option<Nanos> = None;
        // Opened here, on the thread it measures.
        let mut run_delay = crate::run_delay::RunDelay::for_this_thread(self.now());
        // A timed sleep that has just returned: when it began and how long it asked for.
        let mut timed_sleep: Option<(Nanos, Duration)> = None;
        loop {
            let now = self.now();
            if let Some(since) = idle_since.take() {
                self.dataplane.count_idle(now.saturating_since(since).0);
            }
            if let Some(waited) = run_delay.sample(now) {
                self.dataplane.count_run_delay(waited);
            }
            if let Some((slept_at, timeout)) = timed_sleep.take() {
                let slept = Duration::from_nanos(now.saturating_since(slept_at).0);
                self.wake_cost.observe(slept, timeout);
            }
            let reaped = self.ring.reap(&mut self.cqes[..]);
            for slot in 0..reaped {
                let cqe = self.cqes[slot];
                self.handle_cqe(cqe, now);
            }
            let device_completions = self.poll_devices(now);
            let migrated = self
                .migration
                .as_ref()
                .map_or(0, |links| links.receive(&mut self.dataplane, now));
            let scaled = self.receive_scaling(now);
            self.dataplane.count_iteration(reaped as u64);
            if !self.shutdown_begun && self.shutdown.load(Ordering::Relaxed) {
                self.shutdown_begun = true;
                self.dataplane.begin_shutdown();
            }
            // An iteration that brought nothing (a polling loop spinning, mostly) skips the
            // dataplane: with no completion, no pending work and no deadline passed, `process`
            // would find nothing to do, which is what lets the blocking loop sleep.
            let nothing_new = reaped == 0
                && device_completions == 0
                && migrated == 0
                && scaled == 0
                && !self.finished_synchronously
                && !self.dataplane.has_pending_work()
                && self.next_deadline().is_none_or(|due| due > now);
            if !nothing_new {
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
            }
            self.push_deferred_recvs();
            if self.dataplane.is_finished() {
                if self.wake_in_flight && !self.wake_cancelled {
                    self.wake_cancelled = true;
                    self.push_cancel(token::encode(Kind::Wake, 0, 0));
                }
                let abandoned = self.dataplane.abandoned_device_operations() > 0;
                if self.in_flight == 0 || (abandoned && self.in_flight == self.device_in_flight) {
                    // With abandoned device operations still in the kernel, `run` leaks the
                    // memory they point into instead of freeing it.
                    return Ok(());
                }
            }
            // After a skipped iteration nothing but the completion queue can have changed:
            // pending work and deadlines were just checked.
            let busy = if nothing_new {
                self.ring.more_in_cq()
            } else {
                self.dataplane.has_pending_work()
                    || self.scaling.as_ref().is_some_and(|s| s.has_backlog())
                    || self.finished_synchronously
                    || self.device_deadline().is_some_and(|due| due <= now)
                    || self.ring.more_in_cq()
            };
            // An iteration that skipped the dataplane took no time worth a clock read.
            let idle_at = (!busy).then(|| if nothing_new { now } else { self.now() });
            idle_since = idle_at;
            let wait = !self.poll && !busy;
            let sleep = if wait {
                self.plan_sleep(now)
            } else {
                Sleep::Poll
            };
            match sleep {
                Sleep::Poll => self.ring.enter(false, None)?,
                Sleep::Until(timeout) => {
                    self.dataplane.will_sleep();
                    if let (Some(timeout), Some(slept_at)) = (timeout, idle_at) {
                        timed_sleep = Some((slept_at, timeout));
                    }
                    self.ring.enter(true, timeout)?;
                }
            }
        }
    }

    /// How to wait for the next deadline: sleep until shortly before it (by the wake-up cost
    /// measured lately), then spin the last stretch; a deadline nearer than that is spun for
    /// at once. Waking from a timed sleep costs tens to hundreds of microseconds on a VM,
    /// which a device deadline 50 µs away cannot afford (hybrid polling).
    fn plan_sleep(&self, now: Nanos) -> Sleep {
        let Some(deadline) = self.next_deadline() else {
            return Sleep::Until(None);
        };
        let remaining = deadline.saturating_since(now);
        let guard = self.wake_cost.guard();
        if remaining <= guard {
            Sleep::Poll
        } else {
            let sleep = Nanos(remaining.0 - guard.0);
            Sleep::Until(Some(Duration::from_nanos(sleep.0.max(1_000))))
        }
    }

    fn device_deadline(&self) -> Option<Nanos> {
        self.queues.next_deadline()
    }

    /// The earliest dataplane or device deadline.
    fn next_deadline(&self) -> Option<Nanos> {
        match (self.dataplane.next_deadline(), self.device_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Thread scaling: applies a park or wake request and adopts the connections handed to
    /// this thread. Returns how many things happened.
    fn receive_scaling(&mut self, now: Nanos) -> usize {
        let Some(scaling) = self.scaling.as_mut() else {
            return 0;
        };
        let applied = usize::from(scaling.apply(&mut self.dataplane));
        let (sockets, staging) = (&mut self.sockets, &mut self.staging);
        applied
            + scaling.receive(&mut self.dataplane, now, |_, id, stream| {
                let index = id.index as usize;
                if sockets.len() <= index {
                    sockets.resize_with(index + 1, || None);
                    staging.resize_with(index + 1, || None);
                }
                if let Some((generation, _)) = &sockets[index] {
                    assert_ne!(*generation, id.generation, "connection slot still in use");
                }
                sockets[index] = Some((id.generation, stream));
            })
    }

    fn handle_cqe(&mut self, cqe: Cqe, now: Nanos) {
        assert!(self.in_flight > 0, "completion with nothing in flight");
        self.in_flight -= 1;
        let Some((kind, generation, index)) = token::decode(cqe.user_data) else {
            panic!("completion with unknown user_data {:#x}", cqe.user_data);
        };
        let result = if cqe.result < 0 {
            Err(-cqe.result)
        } else {
            Ok(cqe.result as usize)
        };
        match kind {
            Kind::Accept => self.on_accept(index, cqe.result, now),
            Kind::Recv => {
                let id = ConnectionId { index, generation };
                self.dataplane.handle_recv(id, result, now);
            }
            Kind::Poll => {
                let id = ConnectionId { index, generation };
                let ready = if cqe.result < 0 {
                    Err(-cqe.result)
                } else {
                    Ok(())
                };
                self.dataplane.handle_readable(id, ready, now);
            }
            Kind::Send => {
                let id = ConnectionId { index, generation };
                if let Some(staging) = self.staging[index as usize].take() {
                    self.spare_staging.push(staging);
                }
                self.dataplane.handle_sent(id, result, now);
            }
            Kind::Device | Kind::Flush | Kind::Migrated => {
                self.device_in_flight -= 1;
                let id = device_op_id(kind as u8, generation, index);
                let namespace_index = self.device_namespace(id);
                // None: the device deferred the outcome (fault injection); it comes out of
                // poll_completions later and the operation stays in flight until then.
                match self.queues.get_mut(namespace_index) {
                    Some(queue) => {
                        if let Some(result) = queue.complete_ring(cqe.user_data, cqe.result, now) {
                            self.dataplane.handle_device(id, result, now);
                        }
                    }
                    // Not reachable: a queue closes only when nothing of its slot is in
                    // flight. Fail the operation rather than lose it.
                    None => self.dataplane.handle_device(
                        id,
                        Err(reflex_flash::FlashError::Io { errno: libc::ENXIO }),
                        now,
                    ),
                }
            }
            Kind::Wake => {
                self.wake_in_flight = false;
                if !self.dataplane.is_finished() {
                    self.arm_wake();
                }
            }
            Kind::Cancel => {}
        }
    }

    /// The namespace a device operation belongs to (the ring result goes to its queue).
    fn device_namespace(&self, id: DeviceOpId) -> usize {
        match id {
            DeviceOpId::ShutdownFlush { namespace_index } => usize::from(namespace_index),
            DeviceOpId::Request { .. } | DeviceOpId::Migrated { .. } => {
                match self.dataplane.device_namespace(id) {
                    Some(namespace_index) => usize::from(namespace_index),
                    None => panic!("device completion for a request without I/O: {id:?}"),
                }
            }
        }
    }

    fn on_accept(&mut self, listener_index: u32, result: i32, now: Nanos) {
        let slot = &mut self.listeners[listener_index as usize];
        assert!(slot.accept_in_flight);
        slot.accept_in_flight = false;
        let accepted = if result >= 0 {
            Some(sys::adopt_accepted(result))
        } else {
            None
        };
        if slot.closing {
            slot.socket = None;
        }
        let peer = sys::peer_ip(&slot.address.0);
        let report = match &accepted {
            Some(_) => Ok(peer),
            None => Err(-result),
        };
        match (
            self.dataplane.handle_accept(listener_index, report, now),
            accepted,
        ) {
            (Ok(id), Some(stream)) => {
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY refused");
                }
                let index = id.index as usize;
                if self.sockets.len() <= index {
                    self.sockets.resize_with(index + 1, || None);
                    self.staging.resize_with(index + 1, || None);
                }
                // A slot freed during this accept (its previous connection evicted) may still
                // hold that connection's socket: its Close is queued but not yet issued, and
                // nothing of it is in flight. Replacing it closes it now; the queued Close
                // then finds a newer generation and leaves the new socket alone.
                if let Some((generation, _)) = &self.sockets[index] {
                    assert_ne!(*generation, id.generation, "connection slot still in use");
                }
                self.sockets[index] = Some((id.generation, stream));
            }
            (Ok(_), None) => panic!("the dataplane took a failed accept"),
            // Refused: dropping the stream closes it.
            (Err(_), _) => {}
        }
    }

    /// Hands the devices' completions to the dataplane; returns how many there were.
    fn poll_devices(&mut self, now: Nanos) -> usize {
        let mut polled = std::mem::take(&mut self.polled);
        for queue in self.queues.iter_mut() {
            queue.poll_completions(now, &mut polled);
        }
        let count = polled.len();
        for completion in polled.drain(..) {
            let Some((kind @ (Kind::Device | Kind::Flush | Kind::Migrated), generation, index)) =
                token::decode(completion.user_data)
            else {
                panic!(
                    "device reported an unknown completion {:#x}",
                    completion.user_data
                );
            };
            let id = device_op_id(kind as u8, generation, index);
            self.dataplane.handle_device(id, completion.result, now);
        }
        self.polled = polled;
        count
    }

    // ----- Issuing the dataplane's operations ----------------------------------------------

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
            if !matches!(op, Op::Recv { .. } | Op::Send { .. } | Op::Device(_)) {
                // It may close or cancel what a deferred receive names: those go first, in
                // the order the dataplane asked.
                self.push_deferred_recvs();
            }
            match op {
                Op::Accept { listener } => self.push_accept(listener),
                Op::CloseListener { listener } => {
                    let slot = &mut self.listeners[listener as usize];
                    slot.closing = true;
                    if slot.accept_in_flight {
                        self.push_cancel(token::encode(Kind::Accept, 0, listener));
                    } else {
                        slot.socket = None;
                    }
                }
                Op::Recv { connection } => self.deferred_recvs.push(connection),
                Op::Send { connection } => self.push_send(connection),
                Op::WaitReadable { connection } => {
                    let fd = self.fd(connection);
                    let entry = opcode::PollAdd::new(fd, libc::POLLIN as u32)
                        .build()
                        .user_data(token::encode(
                            Kind::Poll,
                            connection.generation,
                            connection.index,
                        ));
                    self.push(entry);
                }
                Op::CancelRecv { connection } => self.push_cancel(token::encode(
                    Kind::Recv,
                    connection.generation,
                    connection.index,
                )),
                Op::CancelWait { connection } => self.push_cancel(token::encode(
                    Kind::Poll,
                    connection.generation,
                    connection.index,
                )),
                Op::CancelSend { connection } => self.push_cancel(token::encode(
                    Kind::Send,
                    connection.generation,
                    connection.index,
                )),
                Op::Close { connection } => {
                    // Dropping the stream closes the socket; nothing uses it any more. A slot
                    // already taken by a newer connection was closed at its accept.
                    let slot = &mut self.sockets[connection.index as usize];
                    if slot
                        .as_ref()
                        .is_some_and(|(generation, _)| *generation == connection.generation)
                    {
                        *slot = None;
                    }
                }
                Op::Handoff { connection, to } => {
                    let slot = &mut self.sockets[connection.index as usize];
                    let stream = match slot.take() {
                        Some((generation, stream)) if generation == connection.generation => stream,
                        _ => panic!("handoff of connection {connection:?} without a socket"),
                    };
                    let moved = self.dataplane.take_moved(connection);
                    let Some(scaling) = self.scaling.as_mut() else {
                        panic!("a handoff without thread scaling");
                    };
                    scaling.send(to, stream, moved, self.dataplane.connections_open());
                }
                Op::Device(command) => self.submit_device(&command, now),
                Op::OpenDevice { namespace_index } => {
                    let namespaces = Arc::clone(self.dataplane.namespaces());
                    self.queues
                        .open(&namespaces, namespace_index, |device| device.queue());
                }
                Op::CloseDevice { namespace_index } => self.queues.close(namespace_index),
                Op::SampleRtt { connection } => {
                    let rtt = match &self.sockets[connection.index as usize] {
                        Some((generation, stream)) if *generation == connection.generation => {
                            crate::sys::tcp_rtt_us(stream)
                        }
                        _ => Err(libc::EBADF),
                    };
                    self.dataplane.handle_rtt(connection, rtt);
                }
            }
        }
    }

    /// Pushes the receives deferred in this iteration. The kernel runs a submission's entries
    /// in order, and a receive on a drained socket tries it and arms a poll: behind the
    /// answers' sends it no longer delays them (a queue-depth-1 client waits for exactly that
    /// send).
    fn push_deferred_recvs(&mut self) {
        let mut deferred = std::mem::take(&mut self.deferred_recvs);
        for connection in deferred.drain(..) {
            self.push_recv(connection);
        }
        self.deferred_recvs = deferred;
    }

    fn fd(&self, connection: ConnectionId) -> types::Fd {
        match &self.sockets[connection.index as usize] {
            Some((generation, stream)) if *generation == connection.generation => {
                types::Fd(stream.as_raw_fd())
            }
            _ => panic!("operation on connection {connection:?} without a socket"),
        }
    }

    fn push(&mut self, entry: squeue::Entry) {
        // SAFETY: every entry built in this module points into memory that stays alive and
        // untouched until its completion: the dataplane's receive space, send segments and
        // device buffers (the dataplane's contract until the matching `handle_*`), the send
        // staging and accept addresses (kept in `self` until the completion is reaped), and
        // the wake-up word (boxed, leaked if the loop ends with it in flight).
        if let Err(e) = unsafe { self.ring.push(&entry) } {
            // A failed flush of a full queue: nothing can be submitted; the loop's next enter
            // reports the error and the thread stops.
            tracing::error!(error = %e, "submission queue flush failed");
        }
        self.in_flight += 1;
    }

    fn push_cancel(&mut self, target: u64) {
        let entry = opcode::AsyncCancel::new(target)
            .build()
            .user_data(token::encode(Kind::Cancel, 0, 0));
        self.push(entry);
    }

    fn arm_wake(&mut self) {
        assert!(!self.wake_in_flight);
        let pointer: *mut u64 = &mut *self.wake_word;
        let entry = opcode::Read::new(types::Fd(self.waker.as_raw_fd()), pointer.cast(), 8)
            .build()
            .user_data(token::encode(Kind::Wake, 0, 0));
        self.push(entry);
        self.wake_in_flight = true;
    }

    fn push_accept(&mut self, listener: u32) {
        let slot = &mut self.listeners[listener as usize];
        let Some(socket) = &slot.socket else {
            panic!("accept on a closed listener {listener}");
        };
        assert!(!slot.accept_in_flight);
        slot.accept_in_flight = true;
        slot.address.0 = sys::empty_sockaddr();
        slot.address.1 = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        let (storage, length) = &mut *slot.address;
        let entry = opcode::Accept::new(
            types::Fd(socket.as_raw_fd()),
            (storage as *mut libc::sockaddr_storage).cast(),
            length,
        )
        .flags(libc::SOCK_CLOEXEC)
        .build()
        .user_data(token::encode(Kind::Accept, 0, listener));
        self.push(entry);
    }

    fn push_recv(&mut self, connection: ConnectionId) {
        let fd = self.fd(connection);
        let space = self.dataplane.receive_space(connection);
        let entry = opcode::Recv::new(fd, space.as_mut_ptr(), space.len() as u32)
            .build()
            .user_data(token::encode(
                Kind::Recv,
                connection.generation,
                connection.index,
            ));
        self.push(entry);
    }

    fn push_send(&mut self, connection: ConnectionId) {
        let fd = self.fd(connection);
        let mut staging = self.spare_staging.pop().unwrap_or_else(|| {
            Box::new(SendStaging {
                msghdr: sys::empty_msghdr(),
                iovecs: [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; SEND_SEGMENTS_MAX],
            })
        });
        let mut count = 0;
        self.dataplane.send_segments(connection, |segment| {
            staging.iovecs[count] = libc::iovec {
                iov_base: segment.as_ptr().cast_mut().cast(),
                iov_len: segment.len(),
            };
            count += 1;
        });
        assert!(count > 0);
        staging.msghdr.msg_iov = staging.iovecs.as_mut_ptr();
        staging.msghdr.msg_iovlen = count as _;
        let msghdr: *const libc::msghdr = &staging.msghdr;
        let index = connection.index as usize;
        assert!(self.staging[index].is_none(), "two sends in flight");
        self.staging[index] = Some(staging);
        let entry = opcode::SendMsg::new(fd, msghdr)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(token::encode(
                Kind::Send,
                connection.generation,
                connection.index,
            ));
        self.push(entry);
    }

    fn submit_device(&mut self, command: &DeviceCommand, now: Nanos) {
        if let Some(lent) = self.queues.lend(command) {
            self.finished_synchronously = true;
            self.dataplane.handle_device_lent(command.id, lent, now);
            return;
        }
        let user_data = device_token(command.id);
        let buf_index = if self.registered { Some(0) } else { None };
        let op = match crate::migration::migrated_device_op(&self.dataplane, command, user_data) {
            Some(op) => op,
            None => self.dataplane.device_op(command, user_data, buf_index),
        };
        let Some(queue) = self.queues.get_mut(usize::from(command.namespace_index)) else {
            // Not reachable: the dataplane opens a slot's queue before its first operation
            // and closes it only when none is left.
            self.finished_synchronously = true;
            self.dataplane.handle_device(
                command.id,
                Err(reflex_flash::FlashError::Io { errno: libc::ENXIO }),
                now,
            );
            return;
        };
        match queue.submit(op, now) {
            Submit::Ring(entry) => {
                assert_eq!(entry.get_user_data(), user_data, "device changed user_data");
                self.push(entry);
                self.device_in_flight += 1;
            }
            Submit::Done(result) => {
                self.finished_synchronously = true;
                self.dataplane.handle_device(command.id, result, now);
            }
            Submit::Pending => {}
        }
    }
}

const _: () = assert!(GENERATION_MASK == (1 << 28) - 1);
