//! Inter-core migration (OctoFAS Algorithm 2; with backwarding, the hybrid of Algorithm 4):
//! a best-effort READ admitted on an overloaded thread (its *home*) is served by the device
//! queue of an underloaded thread (its *server*). `reflex_qos::migration` decides who moves
//! and where; this module moves requests between the threads' dataplanes.
//!
//! # The exchange
//! 1. Home: the scheduler admits a READ of an eligible flow and the thread's
//!    [`reflex_qos::Migrator`] names a destination with a free credit. The request becomes
//!    `Submitted` exactly as for its own device (so timeouts, closes and shutdown treat it the
//!    same way) and a [`MigrationMessage::Serve`] goes to the outbox: the home's device
//!    command, the flow, and the address of the request's buffer in the home's arena.
//! 2. The driver takes it with [`Dataplane::poll_migration`] and pushes it on the bounded
//!    queue from the home to the server; the server's driver pops it and calls
//!    [`Dataplane::handle_migration`].
//! 3. Server: the read waits in its fairness stage like its own requests (token with
//!    [`MIGRATED_TOKEN`]; backwarding applies to it), then goes to its device as
//!    [`DeviceOpId::Migrated`]; the driver builds the device operation on the home's buffer
//!    ([`Dataplane::migrated_read`]) and reports the completion with `handle_device`.
//! 4. Server: the result goes back as [`MigrationMessage::Done`] (the home's id); home:
//!    [`Dataplane::handle_migration`] completes the request as its own device completion
//!    would, and the answer leaves through the home's socket.
//!
//! # Rules
//! - Only device reads migrate: a READ request's (each of a large read's may) and a
//!   key-value operation's bucket and value reads (`core/kv.rs`). A read changes nothing on
//!   the device, so a connection's writes keep their order and the write gate's
//!   read-modify-writes never span threads; a key-value read is admitted only once its
//!   operation holds its probe window at the table's bucket gate, so no write of those
//!   buckets runs meanwhile, wherever the read is served. A read migrates only once the home's scheduler
//!   admitted it, where it would otherwise go to the home's device, so whatever ordering the
//!   home enforced before admission (the write gate) holds.
//! - The buffer belongs to the home's arena throughout: the home does not touch a
//!   `Submitted` request's buffer until its completion comes back, as for its own device.
//! - Bounded: a home has at most `in_transit_per_pair_max` requests at each other thread
//!   (per namespace), and a server holds at most that many of each home's; messages wait in
//!   the outbox while the driver's queue is full (back-pressure), never dropped.
//! - Exactly one answer: the server sends exactly one `Done` per `Serve` (its device's
//!   result, or an error if it cannot serve: namespace gone, shutting down).

use std::collections::VecDeque;

use reflex_flash::FlashError;
use reflex_qos::{Density, FlowId, Nanos};

use super::Dataplane;
use super::kv_owner::KvMessage;
use super::ops::{DeviceCommand, DeviceOpId, DeviceOpKind, Op};
use super::request::{RequestState, Work};
use crate::frontend::IoKind;
use crate::steps::Operation;

/// Scheduler and stage tokens of reads served for another thread carry this bit (a home
/// request's token is its generation, 28 bits, above its index).
pub const MIGRATED_TOKEN: u64 = 1 << 63;

/// A READ of another thread, to be served on this thread's device queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigratedRead {
    /// The home's device command: its id names the home's request, its kind is a read.
    pub command: DeviceCommand,
    /// The flow (tenant id in the namespace) the stage and monitor count it under.
    pub flow: u32,
    /// Where the data goes: `buffer_len` bytes at this address in the home's arena.
    pub buffer_address: usize,
    pub buffer_len: u32,
}

/// A message between two dataplane threads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigrationMessage {
    /// Serve this read of the sender's.
    Serve(MigratedRead),
    /// A read the receiver sent finished: its id (the receiver's) and the device's result.
    Done {
        id: DeviceOpId,
        result: Result<u32, FlashError>,
    },
    /// A key-value request's table step, to or from the table's owner (`core/kv_owner.rs`).
    Kv(KvMessage),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// In the fairness stage.
    Held,
    /// At this thread's device.
    Submitted,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    state: SlotState,
    generation: u32,
    home: u16,
    read: MigratedRead,
    arrived_at: Nanos,
}

/// This thread's side of migration: reads served for others, and messages to send.
#[derive(Debug, Default)]
pub(super) struct Migration {
    slots: Vec<Slot>,
    free: Vec<u32>,
    in_use: u32,
    /// Messages waiting for room on their queue, in order per destination (migrated reads'
    /// and key-value steps').
    pub(super) outbox: VecDeque<(u16, MigrationMessage)>,
}

impl Migration {
    pub(super) fn in_use(&self) -> u32 {
        self.in_use
    }

    pub(super) fn has_outgoing(&self) -> bool {
        !self.outbox.is_empty()
    }
}

/// The capacity of the queue from one thread to another: every migrated read the credits
/// allow (`in_transit_per_pair_max` each way per namespace) and, with a key-value table, one
/// step message per request slot of either thread (each request has at most one in flight).
pub fn exchange_queue_capacity(
    in_transit_per_pair_max: u32,
    namespace_count: usize,
    requests_max: u32,
    kv: bool,
) -> usize {
    let migration = 2 * in_transit_per_pair_max as usize * namespace_count.max(1);
    let kv_steps = if kv { 2 * requests_max as usize } else { 0 };
    migration + kv_steps
}

impl Dataplane {
    /// The next message for another thread whose queue has room (`has_room(thread)`), in
    /// order per destination; messages for a full queue wait here.
    pub fn poll_migration(
        &mut self,
        mut has_room: impl FnMut(u16) -> bool,
    ) -> Option<(u16, MigrationMessage)> {
        let outbox = &mut self.migration.outbox;
        let mut full: u64 = 0;
        let position = outbox.iter().position(|(to, _)| {
            let bit = 1u64 << (u32::from(*to) % 64);
            if full & bit != 0 {
                return false; // Its queue is full: keep this destination's order.
            }
            if has_room(*to) {
                true
            } else {
                full |= bit;
                false
            }
        })?;
        outbox.remove(position)
    }

    /// The capacity a driver gives the queue from this thread to each other thread: every
    /// message the credits allow, so a queue of this size is never full (a full one is still
    /// handled: the message waits in the outbox).
    pub fn migration_queue_capacity(&self) -> usize {
        exchange_queue_capacity(
            self.qos_config.fairness.migration.in_transit_per_pair_max,
            self.qos.len(),
            self.limits.requests_max,
            self.kv.is_some(),
        )
    }

    /// Whether migration is on (the driver must then carry [`Self::poll_migration`]'s
    /// messages; so must it when [`Self::kv_forwards`]).
    pub fn migration_enabled(&self) -> bool {
        self.qos_config.fairness.migration.enabled
    }

    /// Whether this thread serves KV connections for a table another thread owns, or owns
    /// one (the driver must then carry [`Self::poll_migration`]'s messages).
    pub fn kv_forwards(&self) -> bool {
        self.kv.is_some()
    }

    /// This thread's migration counters for a namespace.
    pub fn migration_stats(&self, namespace_index: u16) -> reflex_qos::MigratorStats {
        self.qos[usize::from(namespace_index)].migrator.stats()
    }

    /// The home thread and read of a [`DeviceOpId::Migrated`] operation this thread issued:
    /// the driver builds the device operation on the home's buffer (the home's
    /// `device_op(&read.command, ..)` where the driver can reach it, or the address).
    pub fn migrated_read(&self, id: DeviceOpId) -> Option<(u16, MigratedRead)> {
        let DeviceOpId::Migrated { slot, generation } = id else {
            return None;
        };
        let entry = self.migration.slots.get(slot as usize)?;
        (entry.generation == generation && entry.state == SlotState::Submitted)
            .then_some((entry.home, entry.read))
    }

    /// A message from thread `from`.
    pub fn handle_migration(&mut self, from: u16, message: MigrationMessage, now: Nanos) {
        assert_ne!(
            usize::from(from),
            self.thread_index,
            "a message from itself"
        );
        match message {
            MigrationMessage::Serve(read) => self.serve_migrated(from, read, now),
            MigrationMessage::Done { id, result } => self.migrated_done(from, id, result, now),
            MigrationMessage::Kv(message) => self.handle_kv_message(from, message, now),
        }
    }

    /// Reads this thread sent to other threads that have not come back (every namespace).
    pub(super) fn migrated_away(&self) -> u32 {
        self.qos
            .iter()
            .map(|namespace| namespace.migrator.in_transit_total())
            .sum()
    }

    /// Whether the admitted request `token` may be served by another thread: a READ, or a
    /// key-value operation's device read (a bucket or a value), see the module's rules.
    pub(super) fn migratable_in(requests: &[super::request::Request], token: u64) -> bool {
        let request = &requests[(token as u32) as usize];
        matches!(
            request.work,
            Work::Io { io, .. } if matches!(io.kind, IoKind::Read | IoKind::Kv { .. })
        ) && matches!(request.operation, Operation::Read { .. })
    }

    /// The density the stage's monitor gave `flow` in its last window.
    pub(super) fn density(fair: &reflex_qos::FairQueue, flow: FlowId) -> Density {
        match fair.flow_class(flow) {
            Some((true, _)) => Density::Dense,
            _ => Density::Sparse,
        }
    }

    /// Home: the admitted READ `token` goes to thread `destination` (its credit is taken).
    pub(super) fn submit_migrated(
        &mut self,
        token: u64,
        destination: u16,
        namespace_index: usize,
        now: Nanos,
    ) {
        let index = self.queued_request(token);
        let connection_index = self.requests[index as usize].connection_index;
        if !self.connections[connection_index as usize].is_open() {
            self.qos[namespace_index]
                .migrator
                .returned(usize::from(destination));
            self.free_request(index);
            self.maybe_finish_close(connection_index);
            return;
        }
        let flow = self.requests[index as usize].io().tenant.id;
        self.requests[index as usize].fair_flow = None;
        self.requests[index as usize].migrated_to = Some(destination);
        let command = self.begin_device_operation(index, now);
        let DeviceOpKind::Read { length_bytes, .. } = command.kind else {
            panic!("migrating a request that is not a read: {command:?}");
        };
        let (run, start) = self.submitted_buffer(index);
        let end = start + length_bytes as usize;
        let buffer_address = self.arena.run_mut(run, end)[start..].as_mut_ptr() as usize;
        self.stats.migrated_sent += 1;
        self.migration.outbox.push_back((
            destination,
            MigrationMessage::Serve(MigratedRead {
                command,
                flow,
                buffer_address,
                buffer_len: length_bytes,
            }),
        ));
    }

    /// Home: a read served by thread `from` finished.
    fn migrated_done(
        &mut self,
        from: u16,
        id: DeviceOpId,
        result: Result<u32, FlashError>,
        now: Nanos,
    ) {
        let DeviceOpId::Request { index, generation } = id else {
            panic!("a migrated completion for {id:?}");
        };
        let request = &mut self.requests[index as usize];
        assert_eq!(request.generation, generation, "stale migrated completion");
        assert!(
            matches!(
                request.state,
                RequestState::Submitted | RequestState::Orphaned
            ),
            "a migrated completion for a request in {:?}",
            request.state
        );
        assert_eq!(
            request.migrated_to.take(),
            Some(from),
            "a completion from a thread the request was not sent to"
        );
        let namespace_index = usize::from(request.submitted.namespace_index);
        let latency_ns = now.saturating_since(request.queued_at).0;
        let flow = FlowId(u64::from(request.io().tenant.id));
        let namespace = &mut self.qos[namespace_index];
        namespace.migrator.returned(usize::from(from));
        namespace.fair.completed_elsewhere(flow, latency_ns);
        self.complete_io(index, result, now);
    }

    /// Server: a read of thread `home` arrived; it waits in the stage like a local request.
    fn serve_migrated(&mut self, home: u16, read: MigratedRead, now: Nanos) {
        let namespace_index = usize::from(read.command.namespace_index);
        let servable = self.phase_accepts_migrated()
            && namespace_index < self.qos.len()
            && self
                .queues_open
                .get(namespace_index)
                .copied()
                .unwrap_or(false)
            && self.qos[namespace_index].fair.is_on()
            && matches!(read.command.kind, DeviceOpKind::Read { .. });
        if !servable {
            // Answered at once: the home completes the request with an error.
            self.stats.migrated_refused += 1;
            self.migration.outbox.push_back((
                home,
                MigrationMessage::Done {
                    id: read.command.id,
                    result: Err(FlashError::Io {
                        errno: libc::ECANCELED,
                    }),
                },
            ));
            return;
        }
        let slot = match self.migration.free.pop() {
            Some(slot) => slot,
            None => {
                self.migration.slots.push(Slot {
                    state: SlotState::Free,
                    generation: 0,
                    home,
                    read,
                    arrived_at: now,
                });
                (self.migration.slots.len() - 1) as u32
            }
        };
        let entry = &mut self.migration.slots[slot as usize];
        assert_eq!(entry.state, SlotState::Free);
        entry.state = SlotState::Held;
        entry.home = home;
        entry.read = read;
        entry.arrived_at = now;
        let token = MIGRATED_TOKEN | (u64::from(entry.generation) << 32) | u64::from(slot);
        self.migration.in_use += 1;
        self.stats.migrated_served += 1;
        let namespace = &mut self.qos[namespace_index];
        namespace.migrator.arrived(usize::from(home));
        namespace
            .fair
            .hold_migrated(FlowId(u64::from(read.flow)), token);
        self.qos_fresh = true;
    }

    fn migrated_slot(&self, token: u64, state: SlotState) -> u32 {
        assert_ne!(token & MIGRATED_TOKEN, 0);
        let slot = token as u32;
        let generation = ((token & !MIGRATED_TOKEN) >> 32) as u32;
        let entry = &self.migration.slots[slot as usize];
        assert_eq!(entry.generation, generation, "stale migrated token");
        assert_eq!(entry.state, state);
        slot
    }

    /// Server: the stage released a migrated read: it goes to this thread's device.
    pub(super) fn submit_migrated_here(&mut self, token: u64) {
        let slot = self.migrated_slot(token, SlotState::Held);
        let entry = &mut self.migration.slots[slot as usize];
        entry.state = SlotState::Submitted;
        let command = DeviceCommand {
            id: DeviceOpId::Migrated {
                slot,
                generation: entry.generation,
            },
            ..entry.read.command
        };
        self.device_in_flight += 1;
        self.live.device_in_flight[usize::from(command.namespace_index)] += 1;
        self.ops.push_back(Op::Device(command));
    }

    /// Server: a migrated read finished at this thread's device: its result goes home.
    pub(super) fn complete_migrated_here(
        &mut self,
        slot: u32,
        generation: u32,
        result: Result<u32, FlashError>,
        now: Nanos,
    ) {
        let entry = self.migration.slots[slot as usize];
        assert_eq!(entry.generation, generation, "stale migrated completion");
        assert_eq!(entry.state, SlotState::Submitted);
        assert!(self.device_in_flight > 0);
        self.device_in_flight -= 1;
        let namespace_index = usize::from(entry.read.command.namespace_index);
        self.live.device_in_flight[namespace_index] -= 1;
        let latency_ns = now.saturating_since(entry.arrived_at).0;
        let namespace = &mut self.qos[namespace_index];
        namespace
            .fair
            .completed_migrated_here(FlowId(u64::from(entry.read.flow)), latency_ns, now);
        self.free_migrated_slot(slot, result);
    }

    /// Server: a held migrated read will not be served (shutdown): it goes home with an error.
    pub(super) fn cancel_migrated_here(&mut self, token: u64) {
        let slot = self.migrated_slot(token, SlotState::Held);
        self.free_migrated_slot(
            slot,
            Err(FlashError::Io {
                errno: libc::ECANCELED,
            }),
        );
    }

    fn free_migrated_slot(&mut self, slot: u32, result: Result<u32, FlashError>) {
        let entry = &mut self.migration.slots[slot as usize];
        let (home, id, namespace_index) = (
            entry.home,
            entry.read.command.id,
            usize::from(entry.read.command.namespace_index),
        );
        entry.state = SlotState::Free;
        entry.generation = super::request::next_generation(entry.generation);
        self.migration.free.push(slot);
        assert!(self.migration.in_use > 0);
        self.migration.in_use -= 1;
        self.qos[namespace_index]
            .migrator
            .served_done(usize::from(home));
        self.migration
            .outbox
            .push_back((home, MigrationMessage::Done { id, result }));
    }

    /// Closes a monitor window's migration side: publishes this thread's load and takes its
    /// row of the plan every thread makes from the board.
    pub(super) fn plan_migration(&mut self, namespace_index: usize) {
        let thread_index = self.thread_index;
        let shutting_down = self.shutdown_requested;
        let namespace = &mut self.qos[namespace_index];
        if !namespace.migrator.is_enabled() {
            return;
        }
        let board = namespace.shared.migration_board();
        board.publish(thread_index, namespace.fair.load());
        board.loads(&mut namespace.loads);
        let plan = if shutting_down {
            reflex_qos::MigrationPlan::none(namespace.loads.len())
        } else {
            reflex_qos::migration::plan(
                namespace.migrator.config(),
                namespace.fair.monitor_config().load_balance_threshold,
                &namespace.loads,
            )
        };
        namespace.migrator.set_plan(&plan);
    }
}
