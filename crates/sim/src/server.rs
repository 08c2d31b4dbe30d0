//! A reflexd in virtual time: the real [`Dataplane`] of every thread, the real control plane,
//! driven over a virtual network ([`crate::network`]) and virtual-time devices, the way the
//! io_uring driver drives them in the real server.
//!
//! What a simulation client sees is what a real one would: it sends protocol bytes on a
//! socket and reads the answers the dataplane encoded. Only the costs differ: the network
//! takes its configured latency, devices their model's time, and the dataplane's own work
//! takes no virtual time at all.
//!
//! Determinism: at each instant, device completions are polled and network arrivals delivered
//! in thread and socket order, then every thread processes in thread order until nothing
//! moves; the same inputs give the same run.

use std::net::IpAddr;
use std::sync::Arc;

use reflex_dataplane::control::{ControlPlane, ControlSetup, NamespaceQosSetup, Wake};
use reflex_dataplane::frontend::Protocol;
use reflex_dataplane::namespaces::NamespaceSet;
use reflex_dataplane::{
    ConnectionId, CoreStats, Dataplane, DataplaneSetup, DeviceOpId, Limits, Op, SetupError,
};
use reflex_flash::{Completion, Device, DeviceQueue, Submit};
use reflex_qos::{Nanos, QosConfig};

use crate::network::{NetworkModel, Pipe};

/// Passes over the threads at one instant before time must move on (a bound, not a knob: a
/// pass that changes nothing ends the instant).
const PASSES_PER_INSTANT_MAX: usize = 256;

/// A client's socket, by index in the server's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SocketId(pub u32);

/// Everything a virtual server needs.
pub struct VirtualServerSetup {
    pub threads: u16,
    /// `(namespace id, device, read-only)`.
    pub namespaces: Vec<(u32, Arc<dyn Device>, bool)>,
    pub control: ControlSetup,
    pub qos_config: QosConfig,
    pub limits: Limits,
    pub network: NetworkModel,
    /// The protocols each thread listens for (listener index = position).
    pub listeners: Vec<Protocol>,
}

#[derive(Debug, thiserror::Error)]
pub enum VirtualServerError {
    #[error("control plane: {0}")]
    Control(#[from] reflex_dataplane::control::ControlError),
    #[error("dataplane: {0}")]
    Setup(#[from] SetupError),
    #[error("thread {thread} does not accept on listener {listener} now")]
    NotAccepting { thread: u16, listener: u32 },
    #[error("connection refused: {0}")]
    Refused(reflex_dataplane::AcceptRefused),
}

struct Thread {
    dataplane: Dataplane,
    queues: Vec<Box<dyn DeviceQueue>>,
    accept_armed: Vec<bool>,
    /// Sockets of this thread by connection slot index.
    sockets_by_slot: Vec<Option<SocketId>>,
}

struct Socket {
    thread: u16,
    id: ConnectionId,
    to_server: Pipe,
    to_client: Pipe,
    /// The dataplane asked for a receive that has not completed.
    recv_pending: bool,
    /// A send that waits for room in the client's buffer.
    send_pending: bool,
    /// A readiness wait of a parked connection.
    wait_pending: bool,
    /// The client closed its sending side: once what it sent is read, receives return 0.
    client_closed: bool,
    /// The server closed the connection.
    server_closed: bool,
}

struct NoWake;

impl Wake for NoWake {
    fn wake(&self) {}
}

pub struct VirtualServer {
    now: Nanos,
    threads: Vec<Thread>,
    sockets: Vec<Socket>,
    control: Arc<ControlPlane>,
    namespaces: Arc<NamespaceSet>,
    qos: Vec<NamespaceQosSetup>,
    network: NetworkModel,
    /// Sockets where bytes arrived for the client since [`VirtualServer::take_readable`].
    readable: Vec<SocketId>,
    completions: Vec<Completion>,
    segments: Vec<u8>,
}

impl VirtualServer {
    pub fn new(setup: VirtualServerSetup) -> Result<VirtualServer, VirtualServerError> {
        let namespaces = Arc::new(NamespaceSet::new(setup.namespaces));
        let wakers: Vec<Arc<dyn Wake>> = (0..setup.threads)
            .map(|_| Arc::new(NoWake) as Arc<dyn Wake>)
            .collect();
        let (control, qos) = ControlPlane::start(&setup.control, &namespaces, wakers)?;
        let control = Arc::new(control);
        let mut threads = Vec::new();
        for thread_index in 0..usize::from(setup.threads) {
            let dataplane = Dataplane::new(DataplaneSetup {
                thread_index,
                listeners: setup.listeners.clone(),
                namespaces: Arc::clone(&namespaces),
                nvme_tcp: None,
                nbd_exports: None,
                limits: setup.limits.clone(),
                control: Arc::clone(&control),
                qos: qos.clone(),
                qos_config: setup.qos_config.clone(),
                now: Nanos::ZERO,
            })?;
            threads.push(Thread {
                dataplane,
                queues: (0..namespaces.len())
                    .map(|index| namespaces.device(index as u16).queue())
                    .collect(),
                accept_armed: vec![false; setup.listeners.len()],
                sockets_by_slot: Vec::new(),
            });
        }
        let mut server = VirtualServer {
            now: Nanos::ZERO,
            threads,
            sockets: Vec::new(),
            control,
            namespaces,
            qos,
            network: setup.network,
            readable: Vec::new(),
            completions: Vec::new(),
            segments: Vec::new(),
        };
        server.run_instant(Nanos::ZERO);
        Ok(server)
    }

    pub fn now(&self) -> Nanos {
        self.now
    }

    pub fn control(&self) -> &ControlPlane {
        &self.control
    }

    pub fn namespaces(&self) -> &NamespaceSet {
        &self.namespaces
    }

    /// Each namespace's scheduler setup (default tenant, configured tenants).
    pub fn qos(&self) -> &[NamespaceQosSetup] {
        &self.qos
    }

    /// A client connects to `listener` of `thread` now.
    pub fn connect(
        &mut self,
        thread: u16,
        listener: u32,
        source: Option<IpAddr>,
    ) -> Result<SocketId, VirtualServerError> {
        let now = self.now;
        let state = &mut self.threads[usize::from(thread)];
        if !state
            .accept_armed
            .get(listener as usize)
            .copied()
            .unwrap_or(false)
        {
            return Err(VirtualServerError::NotAccepting { thread, listener });
        }
        state.accept_armed[listener as usize] = false;
        let accepted = state.dataplane.handle_accept(listener, Ok(source), now);
        let id = match accepted {
            Ok(id) => id,
            Err(refusal) => {
                // The dataplane re-armed its accept: take that operation before returning.
                self.run_instant(now);
                return Err(VirtualServerError::Refused(refusal));
            }
        };
        let socket = SocketId(self.sockets.len() as u32);
        self.sockets.push(Socket {
            thread,
            id,
            to_server: Pipe::default(),
            to_client: Pipe::default(),
            recv_pending: false,
            send_pending: false,
            wait_pending: false,
            client_closed: false,
            server_closed: false,
        });
        let state = &mut self.threads[usize::from(thread)];
        let slot = id.index as usize;
        if state.sockets_by_slot.len() <= slot {
            state.sockets_by_slot.resize(slot + 1, None);
        }
        state.sockets_by_slot[slot] = Some(socket);
        // The connection's first operations (a receive) and the re-armed accept.
        self.run_instant(now);
        Ok(socket)
    }

    /// The client sends `bytes` on `socket` now.
    pub fn client_send(&mut self, socket: SocketId, bytes: &[u8]) {
        let now = self.now;
        let model = self.network;
        let socket = &mut self.sockets[socket.0 as usize];
        assert!(!socket.client_closed, "send after the client closed");
        socket.to_server.send(now, bytes, &model);
    }

    /// The client closes its sending side.
    pub fn client_close(&mut self, socket: SocketId) {
        self.sockets[socket.0 as usize].client_closed = true;
    }

    /// Moves the bytes that reached the client on `socket` into `out` (the client reads).
    pub fn client_read(&mut self, socket: SocketId, out: &mut Vec<u8>) {
        self.sockets[socket.0 as usize].to_client.read_all(out);
    }

    /// Whether the server closed `socket` and the client has read everything before that.
    pub fn is_closed_by_server(&self, socket: SocketId) -> bool {
        let socket = &self.sockets[socket.0 as usize];
        socket.server_closed && socket.to_client.is_empty()
    }

    /// Sockets where bytes arrived for the client since the last call.
    pub fn take_readable(&mut self, out: &mut Vec<SocketId>) {
        out.append(&mut self.readable);
    }

    /// Starts a graceful shutdown of every thread (SIGTERM).
    pub fn begin_shutdown(&mut self) {
        for thread in &mut self.threads {
            thread.dataplane.begin_shutdown();
        }
    }

    /// Whether every thread finished its shutdown.
    pub fn is_finished(&self) -> bool {
        self.threads.iter().all(|t| t.dataplane.is_finished())
    }

    /// Each thread's counters.
    pub fn stats(&self) -> Vec<CoreStats> {
        self.threads.iter().map(|t| t.dataplane.stats()).collect()
    }

    /// The dataplane of `thread` (for assertions on its state).
    pub fn dataplane(&self, thread: u16) -> &Dataplane {
        &self.threads[usize::from(thread)].dataplane
    }

    /// When something next happens without a client acting: an arrival on the network, a
    /// device completion, a dataplane deadline. Never earlier than one nanosecond from now
    /// (work due now was done by the last [`Self::run_instant`]).
    pub fn next_event(&self) -> Option<Nanos> {
        let mut next: Option<Nanos> = None;
        let mut consider = |at: Option<Nanos>| {
            if let Some(at) = at {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        };
        for socket in &self.sockets {
            consider(socket.to_server.next_arrival());
            consider(socket.to_client.next_arrival());
        }
        for thread in &self.threads {
            consider(thread.dataplane.next_deadline());
            for queue in &thread.queues {
                consider(queue.next_deadline());
            }
        }
        next.map(|at| at.max(self.now + Nanos(1)))
    }

    /// Runs everything due at `now`: device completions, network arrivals, and every
    /// thread's processing until nothing moves.
    pub fn run_instant(&mut self, now: Nanos) {
        assert!(now >= self.now, "virtual time went back");
        self.now = now;
        for pass in 0..PASSES_PER_INSTANT_MAX {
            let mut moved = false;
            moved |= self.poll_devices();
            moved |= self.deliver();
            for thread in 0..self.threads.len() {
                // A deadline that is due (a token refill, a timeout sweep) needs one process
                // at this instant, as the real driver's loop would give it.
                let due = pass == 0
                    && self.threads[thread]
                        .dataplane
                        .next_deadline()
                        .is_some_and(|at| at <= now);
                moved |= self.process_thread(thread, due);
            }
            if !moved {
                break;
            }
        }
        for thread in &mut self.threads {
            if !thread.dataplane.has_pending_work() {
                thread.dataplane.will_sleep();
            }
        }
    }

    fn poll_devices(&mut self) -> bool {
        let now = self.now;
        let mut moved = false;
        let mut completions = std::mem::take(&mut self.completions);
        for thread in &mut self.threads {
            for queue in &mut thread.queues {
                if queue.next_deadline().is_some_and(|due| due <= now) {
                    queue.poll_completions(now, &mut completions);
                }
            }
            for completion in completions.drain(..) {
                moved = true;
                let id = device_op_id(completion.user_data);
                thread.dataplane.handle_device(id, completion.result, now);
            }
        }
        self.completions = completions;
        moved
    }

    /// Network arrivals, pending receives that can complete, sends waiting for room.
    fn deliver(&mut self) -> bool {
        let now = self.now;
        let mut moved = false;
        for index in 0..self.sockets.len() {
            let socket = &mut self.sockets[index];
            socket.to_server.deliver(now);
            if socket.to_client.deliver(now) {
                self.readable.push(SocketId(index as u32));
            }
            moved |= self.complete_recv(index);
            moved |= self.complete_send(index);
            moved |= self.complete_wait(index);
        }
        moved
    }

    fn complete_recv(&mut self, index: usize) -> bool {
        let now = self.now;
        let socket = &mut self.sockets[index];
        if !socket.recv_pending {
            return false;
        }
        let available = socket.to_server.readable_bytes();
        if available == 0 && !(socket.client_closed && socket.to_server.is_empty()) {
            return false;
        }
        socket.recv_pending = false;
        let (id, thread) = (socket.id, usize::from(socket.thread));
        let dataplane = &mut self.threads[thread].dataplane;
        let space = dataplane.receive_space(id);
        let received = self.sockets[index].to_server.read(space);
        dataplane.handle_recv(id, Ok(received), now);
        true
    }

    fn complete_wait(&mut self, index: usize) -> bool {
        let now = self.now;
        let socket = &mut self.sockets[index];
        if !socket.wait_pending || (socket.to_server.readable_bytes() == 0 && !socket.client_closed)
        {
            return false;
        }
        socket.wait_pending = false;
        let (id, thread) = (socket.id, usize::from(socket.thread));
        self.threads[thread]
            .dataplane
            .handle_readable(id, Ok(()), now);
        true
    }

    fn complete_send(&mut self, index: usize) -> bool {
        let socket = &self.sockets[index];
        if !socket.send_pending {
            return false;
        }
        let room = self
            .network
            .client_buffer_bytes
            .saturating_sub(socket.to_client.unread_bytes());
        if room == 0 {
            return false;
        }
        self.sockets[index].send_pending = false;
        self.send_now(index);
        true
    }

    /// Sends as much of the dataplane's send as the client's buffer takes; the rest waits.
    fn send_now(&mut self, index: usize) {
        let now = self.now;
        let model = self.network;
        let socket = &mut self.sockets[index];
        let (id, thread) = (socket.id, usize::from(socket.thread));
        let room = model
            .client_buffer_bytes
            .saturating_sub(socket.to_client.unread_bytes());
        if room == 0 {
            socket.send_pending = true;
            return;
        }
        let mut segments = std::mem::take(&mut self.segments);
        segments.clear();
        let dataplane = &mut self.threads[thread].dataplane;
        dataplane.send_segments(id, |segment| segments.extend_from_slice(segment));
        let sent = segments.len().min(room);
        self.sockets[index]
            .to_client
            .send(now, &segments[..sent], &model);
        self.segments = segments;
        dataplane.handle_sent(id, Ok(sent), now);
    }

    /// One thread: process, then carry out its operations; returns whether anything moved.
    fn process_thread(&mut self, thread: usize, due: bool) -> bool {
        let now = self.now;
        if !due && !self.threads[thread].dataplane.has_pending_work() {
            return false;
        }
        self.threads[thread].dataplane.process(now);
        while let Some(op) = self.threads[thread].dataplane.poll_op() {
            self.issue(thread, op);
        }
        true
    }

    /// The socket of exactly this connection (slot and generation), even if its slot has
    /// been reused since.
    fn socket_of_generation(&self, thread: usize, connection: ConnectionId) -> usize {
        match self
            .sockets
            .iter()
            .rposition(|s| usize::from(s.thread) == thread && s.id == connection)
        {
            Some(index) => index,
            None => panic!("close of unknown connection {connection:?}"),
        }
    }

    fn socket_of(&self, thread: usize, connection: ConnectionId) -> usize {
        match self.threads[thread]
            .sockets_by_slot
            .get(connection.index as usize)
            .copied()
            .flatten()
        {
            Some(socket) if self.sockets[socket.0 as usize].id == connection => socket.0 as usize,
            _ => panic!("operation on unknown connection {connection:?}"),
        }
    }

    fn issue(&mut self, thread: usize, op: Op) {
        let now = self.now;
        match op {
            Op::Accept { listener } => self.threads[thread].accept_armed[listener as usize] = true,
            Op::CloseListener { listener } => {
                let state = &mut self.threads[thread];
                if std::mem::take(&mut state.accept_armed[listener as usize]) {
                    let refused =
                        state
                            .dataplane
                            .handle_accept(listener, Err(libc::ECANCELED), now);
                    assert!(refused.is_err());
                }
            }
            Op::Recv { connection } => {
                let index = self.socket_of(thread, connection);
                assert!(!self.sockets[index].recv_pending, "two receives in flight");
                self.sockets[index].recv_pending = true;
                self.complete_recv(index);
            }
            Op::Send { connection } => {
                let index = self.socket_of(thread, connection);
                self.send_now(index);
            }
            Op::WaitReadable { connection } => {
                let index = self.socket_of(thread, connection);
                self.sockets[index].wait_pending = true;
                self.complete_wait(index);
            }
            Op::CancelWait { connection } => {
                let index = self.socket_of(thread, connection);
                if std::mem::take(&mut self.sockets[index].wait_pending) {
                    self.threads[thread].dataplane.handle_readable(
                        connection,
                        Err(libc::ECANCELED),
                        now,
                    );
                }
            }
            Op::CancelRecv { connection } => {
                let index = self.socket_of(thread, connection);
                if std::mem::take(&mut self.sockets[index].recv_pending) {
                    self.threads[thread].dataplane.handle_recv(
                        connection,
                        Err(libc::ECANCELED),
                        now,
                    );
                }
            }
            Op::CancelSend { connection } => {
                let index = self.socket_of(thread, connection);
                if std::mem::take(&mut self.sockets[index].send_pending) {
                    self.threads[thread].dataplane.handle_sent(
                        connection,
                        Err(libc::ECANCELED),
                        now,
                    );
                }
            }
            Op::Close { connection } => {
                // The socket of that generation; a slot already given to a newer connection
                // (reused in the accept that evicted this one) keeps its new socket.
                let index = self.socket_of_generation(thread, connection);
                self.sockets[index].server_closed = true;
                let slot = &mut self.threads[thread].sockets_by_slot[connection.index as usize];
                if *slot == Some(SocketId(index as u32)) {
                    *slot = None;
                }
            }
            Op::Device(command) => {
                let state = &mut self.threads[thread];
                let user_data = device_user_data(command.id);
                let op = state.dataplane.device_op(&command, user_data, None);
                match state.queues[usize::from(command.namespace_index)].submit(op, now) {
                    Submit::Pending => {}
                    Submit::Done(result) => state.dataplane.handle_device(command.id, result, now),
                    // Only ring-driven devices (files) ask for a ring entry; the simulator
                    // has none (the variant exists when a workspace build turns `uring` on).
                    #[allow(unreachable_patterns)]
                    other => panic!("a simulated device asked for a ring: {other:?}"),
                }
            }
        }
    }
}

/// Device operation ids in a device's `user_data`: a request's slot and generation, or a
/// shutdown flush (top bit set).
fn device_user_data(id: DeviceOpId) -> u64 {
    match id {
        DeviceOpId::Request { index, generation } => {
            (u64::from(generation) << 32) | u64::from(index)
        }
        DeviceOpId::ShutdownFlush { namespace_index } => (1 << 63) | u64::from(namespace_index),
    }
}

fn device_op_id(user_data: u64) -> DeviceOpId {
    if user_data >> 63 == 1 {
        DeviceOpId::ShutdownFlush {
            namespace_index: user_data as u16,
        }
    } else {
        DeviceOpId::Request {
            index: user_data as u32,
            generation: (user_data >> 32) as u32,
        }
    }
}
