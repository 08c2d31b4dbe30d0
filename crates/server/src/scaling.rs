//! Thread scaling in reflexd (`docs/OPERATIONS.md`, "Thread scaling"): the
//! [`reflex_qos::ScalingPolicy`] decides, this module carries it out.
//!
//! - New connections are steered onto the active threads by a classic BPF program on each
//!   port's `SO_REUSEPORT` group (`sys::steer_reuseport`): a parked thread's
//!   listener stays open (closing a member of the group would reset the connections queued on
//!   it), it just gets no new ones; what was queued before is accepted and moved on.
//! - Each thread's driver looks at its request ([`ThreadScaling::apply`]) every iteration and
//!   parks or wakes its dataplane; connections move through one bounded queue per destination
//!   thread (socket plus [`MovedConnection`]); a full queue keeps them in the sender's
//!   backlog (back-pressure, never loss).
//! - Decisions come from the controller thread (automatic, when `[scaling] enabled`) every
//!   window from the threads' busy shares, or from an operator through the admin API
//!   ([`ScalingControl::force`]); either way one log line and one event per change.
//! - A wake rebalances: [`reflex_qos::plan_rebalance`] on the threads' open connections
//!   names how many each other active thread hands to the woken one; each donor's driver
//!   reads its request ([`ThreadScaling::apply`]) and its dataplane moves them, each once it is
//!   between requests, through the same queues as a park's.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam::queue::ArrayQueue;
use reflex_dataplane::control::ControlPlane;
use reflex_dataplane::{ConnectionId, Dataplane, MoveCause, MovedConnection};
use reflex_qos::{
    Nanos, REBALANCE_STEP_MAX, ScalingConfig, ScalingDecision, ScalingPolicy, ThreadBusy,
    ThreadConnections, plan_rebalance,
};

/// Connections in flight to one thread at once; beyond it senders keep theirs (a parked
/// thread's connections move over a few iterations).
pub const HANDOFF_QUEUE_CAPACITY: usize = 256;
/// Scaling events the admin API lists (the newest).
pub const EVENTS_KEPT_MAX: usize = 64;

/// A thread's request, as the driver reads it.
const ACTIVE: u32 = u32::MAX;

/// One change of the active threads.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ScalingEvent {
    /// Seconds since the server started.
    pub at_seconds: f64,
    /// `"park"` or `"wake"`.
    pub kind: &'static str,
    pub thread: u16,
    /// Where a parked thread's connections go.
    pub to: Option<u16>,
    pub active_after: u16,
    /// `"load"` (the policy) or `"admin"` (an operator).
    pub cause: &'static str,
    /// The active threads' mean busy share over the window that decided (load only).
    pub mean_busy_share: Option<f64>,
    /// A wake: connections the other active threads were asked to hand to the woken one
    /// (each moves once between requests; fewer if fewer can move). 0 on a park.
    pub rebalance_asked: u32,
}

/// What every thread and the controller share.
pub struct ScalingShared {
    /// Per thread: [`ACTIVE`], or the thread its connections go to.
    requested: Vec<AtomicU32>,
    inboxes: Vec<ArrayQueue<(TcpStream, MovedConnection)>>,
    wakers: Vec<Arc<File>>,
    moved: AtomicU64,
    /// Of `moved`, those a rebalancing onto a woken thread moved.
    rebalanced: AtomicU64,
    /// Of `moved`, those moved to spread their tenant's connections (`spread_tenants`).
    spread: AtomicU64,
    /// Per thread: its open connections, as its driver last saw them.
    connections: Vec<AtomicU32>,
    /// Per thread: a rebalancing request, `(to + 1) << 32 | count` (0: none), taken by its
    /// driver.
    shed: Vec<AtomicU64>,
}

/// The controller's side: the policy, the steering sockets and the event log.
pub struct ScalingControl {
    shared: Arc<ScalingShared>,
    policy: Mutex<ScalingPolicy>,
    /// One socket of each port's group (a duplicate of thread 0's listener).
    steering: Vec<TcpListener>,
    events: Mutex<VecDeque<ScalingEvent>>,
    parks: AtomicU64,
    wakes: AtomicU64,
    active: AtomicU32,
    clock_origin: Instant,
    config: ScalingConfig,
}

impl ScalingControl {
    /// Scaling over `wakers.len()` threads; `steering` holds one listener of each port that
    /// every thread listens on.
    pub fn new(
        config: ScalingConfig,
        wakers: &[Arc<File>],
        steering: Vec<TcpListener>,
        clock_origin: Instant,
    ) -> Arc<ScalingControl> {
        let threads = wakers.len();
        let shared = Arc::new(ScalingShared {
            requested: (0..threads).map(|_| AtomicU32::new(ACTIVE)).collect(),
            inboxes: (0..threads)
                .map(|_| ArrayQueue::new(HANDOFF_QUEUE_CAPACITY))
                .collect(),
            wakers: wakers.to_vec(),
            moved: AtomicU64::new(0),
            rebalanced: AtomicU64::new(0),
            spread: AtomicU64::new(0),
            connections: (0..threads).map(|_| AtomicU32::new(0)).collect(),
            shed: (0..threads).map(|_| AtomicU64::new(0)).collect(),
        });
        Arc::new(ScalingControl {
            shared,
            policy: Mutex::new(ScalingPolicy::new(config, threads as u16)),
            steering,
            events: Mutex::new(VecDeque::new()),
            parks: AtomicU64::new(0),
            wakes: AtomicU64::new(0),
            active: AtomicU32::new(threads as u32),
            clock_origin,
            config,
        })
    }

    /// The driver's end for thread `thread_index`.
    pub fn thread(&self, thread_index: usize) -> ThreadScaling {
        ThreadScaling {
            thread_index,
            shared: Arc::clone(&self.shared),
            applied: ACTIVE,
            spread_tenants: self.config.spread_tenants,
            backlog: VecDeque::new(),
        }
    }

    pub fn threads(&self) -> u16 {
        self.shared.requested.len() as u16
    }

    pub fn active(&self) -> u16 {
        self.active.load(Ordering::Relaxed) as u16
    }

    pub fn parks(&self) -> u64 {
        self.parks.load(Ordering::Relaxed)
    }

    pub fn wakes(&self) -> u64 {
        self.wakes.load(Ordering::Relaxed)
    }

    /// Connections adopted by another thread so far (a park's, a rebalancing's and
    /// spreading's).
    pub fn connections_moved(&self) -> u64 {
        self.shared.moved.load(Ordering::Relaxed)
    }

    /// Of [`Self::connections_moved`], those a rebalancing onto a woken thread moved.
    pub fn connections_rebalanced(&self) -> u64 {
        self.shared.rebalanced.load(Ordering::Relaxed)
    }

    /// Of [`Self::connections_moved`], those moved to spread their tenant's connections over
    /// the threads (`[scaling] spread_tenants`).
    pub fn connections_spread(&self) -> u64 {
        self.shared.spread.load(Ordering::Relaxed)
    }

    /// Per thread: its open connections (as of its last loop iteration).
    pub fn connections_per_thread(&self) -> Vec<u32> {
        self.shared
            .connections
            .iter()
            .map(|count| count.load(Ordering::Relaxed))
            .collect()
    }

    /// Per thread: whether it is active (takes new connections).
    pub fn active_per_thread(&self) -> Vec<bool> {
        self.shared
            .requested
            .iter()
            .map(|request| request.load(Ordering::Relaxed) == ACTIVE)
            .collect()
    }

    pub fn config(&self) -> &ScalingConfig {
        &self.config
    }

    pub fn events(&self) -> Vec<ScalingEvent> {
        self.lock_events().iter().cloned().collect()
    }

    fn lock_events(&self) -> std::sync::MutexGuard<'_, VecDeque<ScalingEvent>> {
        self.events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn now(&self) -> Nanos {
        Nanos(self.clock_origin.elapsed().as_nanos() as u64)
    }

    /// An operator asks for `active` threads (clamped to `active_min ..= threads`); carried
    /// out at once, step by step. Returns the active count.
    pub fn force(&self, active: u16) -> u16 {
        let mut policy = self.policy.lock().unwrap_or_else(|p| p.into_inner());
        let idle = vec![ThreadBusy::default(); usize::from(policy.threads())];
        while let Some(decision) = policy.force(self.now(), active, &idle) {
            self.carry_out(decision, policy.active(), "admin", None);
        }
        policy.active()
    }

    /// One window of the automatic policy.
    fn handle_window(&self, loads: &[ThreadBusy]) {
        let mut policy = self.policy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((decision, reason)) = policy.handle_window(self.now(), loads) {
            self.carry_out(
                decision,
                policy.active(),
                "load",
                Some(reason.mean_busy_share),
            );
        }
    }

    /// Steers new connections, tells the thread, logs and records the event.
    fn carry_out(
        &self,
        decision: ScalingDecision,
        active_after: u16,
        cause: &'static str,
        mean_busy_share: Option<f64>,
    ) {
        let threads = self.threads();
        let steer = (active_after < threads).then_some(u32::from(active_after));
        let mut rebalance_asked = 0;
        let (kind, thread, to) = match decision {
            // New connections stop first, then the connections move.
            ScalingDecision::Park { thread, to } => {
                self.steer(steer);
                self.shared.requested[usize::from(thread)].store(u32::from(to), Ordering::Release);
                self.parks.fetch_add(1, Ordering::Relaxed);
                ("park", thread, Some(to))
            }
            // The thread serves again before new connections reach it.
            ScalingDecision::Wake { thread } => {
                self.shared.requested[usize::from(thread)].store(ACTIVE, Ordering::Release);
                self.steer(steer);
                rebalance_asked = self.rebalance_onto(thread, active_after);
                self.wakes.fetch_add(1, Ordering::Relaxed);
                ("wake", thread, None)
            }
        };
        self.shared.wake(usize::from(thread));
        self.active
            .store(u32::from(active_after), Ordering::Relaxed);
        tracing::info!(
            event = kind,
            thread,
            to = ?to,
            active = active_after,
            cause,
            mean_busy_share = ?mean_busy_share,
            rebalance_asked,
            "thread scaling"
        );
        let mut events = self.lock_events();
        if events.len() == EVENTS_KEPT_MAX {
            events.pop_front();
        }
        events.push_back(ScalingEvent {
            at_seconds: self.clock_origin.elapsed().as_secs_f64(),
            kind,
            thread,
            to,
            active_after,
            cause,
            mean_busy_share,
            rebalance_asked,
        });
    }

    /// Asks the other active threads to hand connections to `woken` (the plan on the open
    /// counts the drivers last published; a donor marks only connections that can move).
    /// Returns how many were asked for.
    fn rebalance_onto(&self, woken: u16, active: u16) -> u32 {
        let loads: Vec<ThreadConnections> = self
            .connections_per_thread()
            .into_iter()
            .map(|open| ThreadConnections {
                open,
                movable: open,
            })
            .collect();
        let plan = plan_rebalance(&loads, active, woken, REBALANCE_STEP_MAX);
        let mut asked = 0;
        for step in &plan {
            let request = (u64::from(step.to) + 1) << 32 | u64::from(step.count);
            // Stored after the woken thread's request (above): a donor that sees this sees
            // that, so the woken thread adopts rather than hands back (see `receive`).
            self.shared.shed[usize::from(step.from)].store(request, Ordering::Release);
            self.shared.wake(usize::from(step.from));
            asked += step.count;
        }
        asked
    }

    fn steer(&self, active: Option<u32>) {
        for socket in &self.steering {
            if let Err(error) = crate::sys::steer_reuseport(socket, active) {
                tracing::warn!(%error, ?active, "cannot steer new connections (SO_ATTACH_REUSEPORT_CBPF)");
            }
        }
    }

    /// Starts the controller thread (automatic scaling): every window it reads the threads'
    /// published busy time and runs the policy, until `stop`.
    pub fn spawn_controller(
        self: &Arc<Self>,
        control: Arc<ControlPlane>,
        stop: Arc<AtomicBool>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let scaling = Arc::clone(self);
        std::thread::Builder::new()
            .name("reflex-scaling".into())
            .spawn(move || scaling.run_controller(&control, &stop))
    }

    fn run_controller(&self, control: &ControlPlane, stop: &AtomicBool) {
        let window = Duration::from_millis(self.config.window_ms);
        let threads = usize::from(self.threads());
        let mut previous: Vec<(u64, u64)> = vec![(0, 0); threads];
        let mut previous_at = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            // Short sleeps: shutdown does not wait a whole window.
            let slept_at = Instant::now();
            while slept_at.elapsed() < window && !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20).min(window));
            }
            let elapsed_ns = previous_at.elapsed().as_nanos().max(1) as f64;
            previous_at = Instant::now();
            let mut loads = vec![ThreadBusy::default(); threads];
            for snapshot in control.live().read() {
                let Some(before) = previous.get_mut(snapshot.thread_index) else {
                    continue;
                };
                let busy = snapshot.busy_ns.saturating_sub(before.0);
                let requests = snapshot.requests_answered.saturating_sub(before.1);
                *before = (snapshot.busy_ns, snapshot.requests_answered);
                loads[snapshot.thread_index] = ThreadBusy {
                    busy_share: (busy as f64 / elapsed_ns).clamp(0.0, 1.0),
                    requests,
                };
            }
            self.handle_window(&loads);
        }
    }
}

impl ScalingShared {
    /// The threads serving now, bit `t` for thread `t` (at most 64 threads, `THREADS_MAX`).
    fn active_mask(&self) -> u64 {
        self.requested
            .iter()
            .enumerate()
            .filter(|(_, request)| request.load(Ordering::Relaxed) == ACTIVE)
            .fold(0, |mask, (thread, _)| mask | 1u64 << thread)
    }

    fn wake(&self, thread: usize) {
        // An eventfd write fails only when its counter would overflow (already woken).
        let _ = (&*self.wakers[thread]).write(&1u64.to_ne_bytes());
    }
}

/// A driver's end of thread scaling.
pub struct ThreadScaling {
    thread_index: usize,
    shared: Arc<ScalingShared>,
    /// The request last applied to the dataplane.
    applied: u32,
    /// `[scaling] spread_tenants`: the dataplane learns the active threads every iteration.
    spread_tenants: bool,
    /// Connections handed off whose destination queue was full, oldest first.
    backlog: VecDeque<(u16, TcpStream, MovedConnection)>,
}

impl ThreadScaling {
    /// Parks or wakes the dataplane when its request changed, and hands connections to a
    /// woken thread when asked; returns whether anything changed.
    pub fn apply(&mut self, dataplane: &mut Dataplane) -> bool {
        self.shared.connections[self.thread_index]
            .store(dataplane.connections_open(), Ordering::Relaxed);
        if self.spread_tenants {
            dataplane.set_spread_threads(self.shared.active_mask());
        }
        let shed = self.shared.shed[self.thread_index].swap(0, Ordering::Acquire);
        let mut changed = false;
        if let Some(to) = (shed >> 32).checked_sub(1) {
            // Only `rebalance_onto` writes it: a thread index below the threads started.
            assert!(to < self.shared.requested.len() as u64);
            let (to, count) = (to as u16, shed as u32);
            if usize::from(to) != self.thread_index && count > 0 {
                dataplane.shed_connections(to, count);
                changed = true;
            }
        }
        changed | self.apply_request(dataplane)
    }

    fn apply_request(&mut self, dataplane: &mut Dataplane) -> bool {
        let requested = self.shared.requested[self.thread_index].load(Ordering::Acquire);
        if requested == self.applied {
            return false;
        }
        self.applied = requested;
        if requested == ACTIVE {
            dataplane.wake_thread();
        } else {
            dataplane.park_thread(requested as u16);
        }
        true
    }

    /// Connections handed to this thread: each is adopted (`register` gets its id and
    /// socket) or, refused, closed. Returns how many arrived.
    pub fn receive(
        &mut self,
        dataplane: &mut Dataplane,
        now: Nanos,
        mut register: impl FnMut(&mut Dataplane, ConnectionId, TcpStream),
    ) -> usize {
        let mut received = 0;
        while let Some((stream, moved)) = self.shared.inboxes[self.thread_index].pop() {
            if received == 0 {
                // A connection sent after this thread was woken: wake first, or it would be
                // handed back as if the thread were still parked.
                self.apply_request(dataplane);
            }
            received += 1;
            let cause = moved.cause();
            match dataplane.adopt(moved, now) {
                Ok(id) => {
                    match cause {
                        MoveCause::Park => {}
                        MoveCause::Rebalance => {
                            self.shared.rebalanced.fetch_add(1, Ordering::Relaxed);
                        }
                        MoveCause::Spread => {
                            self.shared.spread.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    self.shared.moved.fetch_add(1, Ordering::Relaxed);
                    register(dataplane, id, stream);
                }
                Err(_) => drop(stream),
            }
        }
        if received > 0 {
            self.shared.connections[self.thread_index]
                .store(dataplane.connections_open(), Ordering::Relaxed);
        }
        self.flush();
        received
    }

    /// Sends a handed-off connection to thread `to` (or keeps it until its queue has room);
    /// `connections_open` is this thread's count after it.
    pub fn send(
        &mut self,
        to: u16,
        stream: TcpStream,
        moved: MovedConnection,
        connections_open: u32,
    ) {
        self.shared.connections[self.thread_index].store(connections_open, Ordering::Relaxed);
        self.backlog.push_back((to, stream, moved));
        self.flush();
    }

    /// Whether handed-off connections wait for room (the driver must not sleep long then).
    pub fn has_backlog(&self) -> bool {
        !self.backlog.is_empty()
    }

    fn flush(&mut self) {
        while let Some((to, stream, moved)) = self.backlog.pop_front() {
            match self.shared.inboxes[usize::from(to)].push((stream, moved)) {
                Ok(()) => self.shared.wake(usize::from(to)),
                Err((stream, moved)) => {
                    self.backlog.push_front((to, stream, moved));
                    break;
                }
            }
        }
    }
}
