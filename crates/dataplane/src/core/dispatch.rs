//! Step three and step two of run to completion: requests enter their namespace's QoS
//! scheduler, what a scheduling round admits goes to the device, and device results become
//! answers (or the next step of a multi-step request).
//!
//! Every namespace has a `reflex_qos::Scheduler` on every thread: the token scheduler of the
//! ReFlex paper where the namespace has a device profile and QoS is on, first in, first out
//! otherwise. A full tenant queue never drops a request: it waits in `blocked` and its
//! connection is not read until the scheduler reports room.
//!
//! A device operation that outlives `device_timeout` is answered with an error at once and its
//! request is orphaned: the slot and its buffer stay with the device until it returns them,
//! and the answer goes out in a fresh slot.

use reflex_flash::{DeviceOp, FlashError, Lent, OpKind};
use reflex_qos::{Admitted, EnqueueError, Nanos};

use reflex_proto::nbd::Errno;

use super::Dataplane;
use super::composite::Progress;
use super::ops::{DeviceCommand, DeviceOpId, DeviceOpKind, Op};
use super::request::{RequestState, Work};
use crate::frontend::{Action, Answer, IoKind, IoRequest};
use crate::steps::{self, IoStep, Layout, Next, Operation};

/// What the scheduler charges for a step: a transfer of `size_bytes`, or an operation that
/// moves no data (FLUSH, TRIM, a discarding WRITE_ZEROES), charged as one 4 KiB write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Charged {
    Read(u32),
    Write(u32),
    Other,
}

impl Dataplane {
    /// Queues the request's current step in its namespace's scheduler.
    pub(super) fn enqueue(&mut self, index: u32, now: Nanos) {
        match self.qos_enqueue(index, now) {
            Ok(()) => self.transition(index, RequestState::Queued),
            Err(EnqueueError::TenantQueueFull { .. } | EnqueueError::ThreadQueueFull { .. }) => {
                // Never dropped: it waits, and its connection is not read meanwhile.
                self.transition(index, RequestState::Blocked);
                self.blocked.push_back(index);
                self.stats.tenant_queue_full_waits += 1;
                let connection_index = self.requests[index as usize].connection_index;
                self.connections[connection_index as usize].blocked_count += 1;
            }
            Err(EnqueueError::UnknownTenant(_) | EnqueueError::TooLarge { .. }) => {
                // The tenant left this thread (unregistered) while the request was on its
                // way to the scheduler.
                self.answer_io(index, Answer::Permission);
            }
        }
    }

    /// The request slot a scheduler `token` names (`qos_enqueue` packs the slot's generation
    /// above its index); asserts that it is that request and that it is still queued.
    pub(super) fn queued_request(&self, token: u64) -> u32 {
        let index = token as u32;
        let generation = (token >> 32) as u32;
        let request = &self.requests[index as usize];
        assert_eq!(
            request.generation, generation,
            "stale request from a scheduler"
        );
        assert_eq!(request.state, RequestState::Queued);
        index
    }

    fn qos_enqueue(&mut self, index: u32, now: Nanos) -> Result<(), EnqueueError> {
        let request = &self.requests[index as usize];
        let io = request.io();
        let placed = self.placed(index);
        let (kind, size_bytes) = match charged(placed.operation) {
            Charged::Read(bytes) => (reflex_qos::IoKind::Read, bytes),
            Charged::Write(bytes) => (reflex_qos::IoKind::Write, bytes),
            // Not transfers: charged as one 4 KiB write (`docs/QOS.md` §1).
            Charged::Other => (reflex_qos::IoKind::Write, reflex_qos::COST_UNIT_BYTES),
        };
        // A composite namespace's piece is its member's to schedule, charged to the tenant's
        // member tenant there.
        let tenant_id =
            match placed.member {
                None => io.tenant.id,
                Some(member) => self.member_tenant(io.tenant.handle, member).ok_or(
                    EnqueueError::UnknownTenant(reflex_qos::TenantId(io.tenant.id)),
                )?,
            };
        let token = (u64::from(request.generation) << 32) | u64::from(index);
        let namespace = &mut self.qos[usize::from(placed.namespace_index)];
        namespace.scheduler.enqueue(
            reflex_qos::TenantId(tenant_id),
            reflex_qos::Request {
                token,
                size_bytes,
                kind,
            },
            now,
        )?;
        let request = &mut self.requests[index as usize];
        request.queued_at = now;
        request.piece_tenant = tenant_id;
        self.qos_queued += 1;
        self.qos_fresh = true;
        Ok(())
    }

    /// Gives blocked requests another try at their tenants' queues, oldest first.
    fn retry_blocked(&mut self, now: Nanos) {
        self.queue_room = false;
        for _ in 0..self.blocked.len() {
            let Some(index) = self.blocked.pop_front() else {
                break;
            };
            match self.qos_enqueue(index, now) {
                Ok(()) => {
                    self.transition(index, RequestState::Queued);
                    self.unblock(index);
                }
                Err(
                    EnqueueError::TenantQueueFull { .. } | EnqueueError::ThreadQueueFull { .. },
                ) => {
                    self.blocked.push_back(index);
                }
                Err(EnqueueError::UnknownTenant(_) | EnqueueError::TooLarge { .. }) => {
                    self.unblock(index);
                    self.answer_io(index, Answer::Permission);
                }
            }
        }
    }

    /// One blocked request of its connection left `blocked`; the last one lets it be read.
    pub(super) fn unblock(&mut self, index: u32) {
        let connection_index = self.requests[index as usize].connection_index;
        let connection = &mut self.connections[connection_index as usize];
        assert!(connection.blocked_count > 0);
        connection.blocked_count -= 1;
        if connection.blocked_count == 0 && connection.is_open() {
            self.mark_parse(connection_index);
        }
    }

    /// The device operation of the request's current step (computed when the step was set).
    pub(super) fn operation(&self, index: u32) -> Operation {
        let operation = self.requests[index as usize].operation;
        debug_assert_eq!(operation, self.compute_operation(index));
        operation
    }

    fn compute_operation(&self, index: u32) -> Operation {
        let Work::Io { io, run, step, .. } = self.requests[index as usize].work else {
            panic!("a device operation for a request without I/O");
        };
        if let IoKind::Kv { .. } = io.kind {
            return self.kv_operation(index);
        }
        let layout = &self.requests[index as usize].layout;
        let run_bytes = run.map_or(0, |run| zero_run_bytes(layout, io, run.size_bytes()));
        steps::operation(io.kind, layout, step, run_bytes)
    }

    /// Caches the device operation of the request's new step (its first piece next).
    pub(super) fn refresh_operation(&mut self, index: u32) {
        let operation = self.compute_operation(index);
        let request = &mut self.requests[index as usize];
        request.operation = operation;
        request.piece_done = 0;
    }

    /// Scheduling rounds on every namespace, after the blocked requests had their retry.
    pub(super) fn dispatch_step(&mut self, now: Nanos) {
        self.retry_gate(now);
        self.kv_retry(now);
        if self.queue_room {
            self.retry_blocked(now);
        }
        self.qos_fresh = false;
        for namespace_index in 0..self.qos.len() {
            self.dispatch_namespace(namespace_index, now);
        }
    }

    /// One scheduling round of a namespace: what it admits goes to the device, except the
    /// best-effort requests the fairness stage holds; then what the stage releases goes too.
    fn dispatch_namespace(&mut self, namespace_index: usize, now: Nanos) {
        let room = self
            .limits
            .device_in_flight_max
            .saturating_sub(self.device_in_flight) as usize;
        if self.qos[namespace_index].fair.handle_timeout(now) {
            self.plan_migration(namespace_index);
        }
        // Reads this thread sent away count in its device operations until they come back.
        // They may take all but one of them: a thread whose every place waits on reads at
        // other threads could not serve theirs, and two such threads would wait on each
        // other for ever (finding 17). The place left serves its own requests or, released
        // by the stage, another thread's reads, and its device always completes.
        let away_max = if self.qos[namespace_index].migrator.is_enabled() {
            (self.limits.device_in_flight_max as usize)
                .saturating_sub(1)
                .saturating_sub(self.migrated_away() as usize)
        } else {
            0
        };
        let namespace = &mut self.qos[namespace_index];
        let mut admitted = std::mem::take(&mut self.admitted);
        assert!(admitted.is_empty());
        let mut migrating = std::mem::take(&mut self.migrating);
        assert!(migrating.is_empty());
        let fair = &mut namespace.fair;
        let migrator = &mut namespace.migrator;
        let requests = &self.requests;
        // No new migration once shutting down: the other threads may be finishing.
        let migrating_allowed = migrator.is_enabled() && !self.shutdown_requested;
        let mut direct = 0usize;
        let summary = namespace.scheduler.schedule(now, &mut |request: Admitted| {
            if fair.holds(request.class) {
                let flow = reflex_qos::FlowId(u64::from(request.tenant.0));
                // Algorithm 4: an eligible flow's READ goes to another thread while the plan
                // gives this one credit there; otherwise it waits in the stage (backwarding).
                // A migrated read counts in this thread's device operations until it comes back.
                let destination = if migrating_allowed
                    && direct + migrating.len() < room
                    && migrating.len() < away_max
                    && Self::migratable_in(requests, request.token)
                {
                    migrator.pick_destination(Self::density(fair, flow))
                } else {
                    None
                };
                if let Some(destination) = destination {
                    migrating.push((request.token, destination as u16));
                } else if fair.hold(flow, request.token).is_err() {
                    return false; // The stage is full: the scheduler keeps the rest.
                }
            } else {
                if direct >= room {
                    return false; // The device takes no more from this thread now.
                }
                direct += 1;
            }
            admitted.push(request);
            true
        });
        self.telemetry[namespace_index].window.tokens_spent += summary.tokens_spent;
        for request in &admitted {
            if let Some(account) = namespace.accounts.get_mut(request.tenant.0 as usize) {
                let queued_at = self.requests[(request.token as u32) as usize].queued_at;
                account.admitted(request, now.saturating_since(queued_at).0);
            }
        }
        // Held requests stay `Queued` and counted in `qos_queued` until the stage releases them.
        let holds = namespace.fair.is_on();
        admitted.retain(|request| !(holds && request.class == reflex_qos::TenantClass::BestEffort));
        assert_eq!(admitted.len(), direct);
        let mut released = room - direct - migrating.len();
        let mut migrated_here = 0usize;
        while released > 0 {
            let Some((flow, token)) = namespace.fair.poll_release(now) else {
                break;
            };
            released -= 1;
            if token & super::MIGRATED_TOKEN != 0 {
                migrated_here += 1; // Another thread's: never in this thread's schedulers.
            }
            self.fair_released.push((flow.0 as u32, token));
        }
        let leaving = admitted.len() + migrating.len() + self.fair_released.len() - migrated_here;
        assert!(leaving <= self.qos_queued as usize);
        self.qos_queued -= leaving as u32;
        for request in &admitted {
            self.submit_admitted(request.token, None, now);
        }
        for &(token, destination) in &migrating {
            self.submit_migrated(token, destination, namespace_index, now);
        }
        migrating.clear();
        self.migrating = migrating;
        let mut fair_released = std::mem::take(&mut self.fair_released);
        for &(flow, token) in &fair_released {
            if token & super::MIGRATED_TOKEN != 0 {
                self.submit_migrated_here(token);
            } else if !self.submit_admitted(token, Some(flow), now) {
                self.qos[namespace_index]
                    .fair
                    .withdraw(reflex_qos::FlowId(u64::from(flow)), now);
            }
        }
        fair_released.clear();
        self.fair_released = fair_released;
        admitted.clear();
        self.admitted = admitted;
    }

    /// Sends an admitted request (the scheduler's `token`) to the device, unless its
    /// connection closed meanwhile (then it is freed; returns `false`). `fair_flow`: the
    /// fairness stage released it and counts its place at the device.
    fn submit_admitted(&mut self, token: u64, fair_flow: Option<u32>, now: Nanos) -> bool {
        let index = self.queued_request(token);
        let connection_index = self.requests[index as usize].connection_index;
        if !self.connections[connection_index as usize].is_open() {
            self.free_request(index);
            self.maybe_finish_close(connection_index);
            return false;
        }
        self.requests[index as usize].fair_flow = fair_flow;
        self.submit_io(index, now);
        true
    }

    fn submit_io(&mut self, index: u32, now: Nanos) {
        let command = self.begin_device_operation(index, now);
        self.ops.push_back(Op::Device(command));
    }

    /// The request's current step goes to a device (this thread's, or another's when it
    /// migrates): it is `Submitted` and counted in flight until its completion.
    pub(super) fn begin_device_operation(&mut self, index: u32, now: Nanos) -> DeviceCommand {
        self.transition(index, RequestState::Submitted);
        self.device_in_flight += 1;
        let placed = self.placed(index);
        let namespace_index = placed.namespace_index;
        self.requests[index as usize].submitted = placed;
        self.live.device_in_flight[usize::from(namespace_index)] += 1;
        let kind = match placed.operation {
            Operation::Read {
                offset_bytes,
                length_bytes,
                buffer_start,
            } => DeviceOpKind::Read {
                offset_bytes,
                length_bytes,
                lend: placed.member.is_none()
                    && buffer_start == 0
                    && self.answers_whole_read(index, length_bytes),
            },
            Operation::Write {
                offset_bytes,
                length_bytes,
                fua,
                ..
            } => DeviceOpKind::Write {
                offset_bytes,
                length_bytes,
                fua,
            },
            Operation::Flush => DeviceOpKind::Flush,
            Operation::Discard {
                offset_bytes,
                length_bytes,
            } => DeviceOpKind::Trim {
                offset_bytes,
                length_bytes,
            },
        };
        let request = &mut self.requests[index as usize];
        request.submitted_at = now;
        let connection_index = request.connection_index;
        let id = DeviceOpId::Request {
            index,
            generation: request.generation,
        };
        DeviceCommand {
            id,
            namespace_index,
            queue: {
                let connection = &self.connections[connection_index as usize];
                connection
                    .frontend
                    .device_queue()
                    .unwrap_or(connection.device_queue)
            },
            kind,
        }
    }

    /// Whether the request is a READ in one part whose device read of `length_bytes` is
    /// exactly its data: then the answer may carry the device's bytes as they are (lent).
    fn answers_whole_read(&self, index: u32, length_bytes: u32) -> bool {
        let request = &self.requests[index as usize];
        let Work::Io {
            io,
            step: IoStep::Transfer { part: 0 },
            ..
        } = request.work
        else {
            return false;
        };
        if io.kind != IoKind::Read || request.layout.part_count() != 1 {
            return false;
        }
        let part = request.layout.part(0);
        part.data_start == 0 && part.data_bytes == length_bytes
    }

    /// A READ whose command allowed lending was answered with the device's own bytes
    /// (`lent`, [`reflex_flash::DeviceQueue::lend`]) instead of being submitted: it completes
    /// as if read into its run, and its answer is sent from `lent`, which lives until the
    /// request is freed (after its send).
    pub fn handle_device_lent(&mut self, id: DeviceOpId, lent: Lent, now: Nanos) {
        let DeviceOpId::Request { index, generation } = id else {
            panic!("a loan for {id:?}, which never allows one");
        };
        let request = &self.requests[index as usize];
        assert_eq!(request.generation, generation, "stale device loan");
        assert_eq!(request.state, RequestState::Submitted);
        let Operation::Read { length_bytes, .. } = self.submitted_placed(index).operation else {
            panic!("a loan for a request that is not reading");
        };
        assert!(lent.bytes().len() >= length_bytes as usize, "a short loan");
        let slot = &mut self.lent[index as usize];
        assert!(slot.is_none(), "two loans for one request");
        *slot = Some(lent);
        self.stats.reads_lent += 1;
        self.complete_lent_read(index, length_bytes, now);
    }

    /// [`Self::complete_io`] of a lent READ, the common 4 KiB read of a `mem` namespace,
    /// without the step machine: a loan is only allowed for a READ in one part, not on a
    /// composite namespace, whose device read is exactly its data ([`Self::answers_whole_read`]),
    /// and a loan is a whole transfer, so the only outcome is its successful answer (or the
    /// free of a request whose connection closed).
    fn complete_lent_read(&mut self, index: u32, length_bytes: u32, now: Nanos) {
        self.device_done(index, now);
        let request = &self.requests[index as usize];
        assert!(
            matches!(
                request.work,
                Work::Io {
                    io: IoRequest {
                        kind: IoKind::Read,
                        ..
                    },
                    step: IoStep::Transfer { part: 0 },
                    ..
                }
            ) && request.layout.part_count() == 1,
            "a loan for a request that is not a one-part READ"
        );
        debug_assert_eq!(request.gate, super::request::GatePlace::Outside);
        let connection_index = request.connection_index;
        if !self.connections[connection_index as usize].is_open() {
            self.free_request(index);
            self.maybe_finish_close(connection_index);
            return;
        }
        self.stats.bytes_read += u64::from(length_bytes);
        self.respond_read(index, 0, true);
    }

    /// A device operation of the request is over: its place at the device is free and its
    /// time is counted (the device's, and the tenant's on that device).
    fn device_done(&mut self, index: u32, now: Nanos) {
        assert!(self.device_in_flight > 0);
        self.device_in_flight -= 1;
        let live_index = usize::from(self.requests[index as usize].submitted.namespace_index);
        self.live.device_in_flight[live_index] -= 1;
        if let Some(flow) = self.requests[index as usize].fair_flow.take() {
            // Its place at the device is free, even for an orphan (the device is done with it).
            let latency_ns = now
                .saturating_since(self.requests[index as usize].queued_at)
                .0;
            self.qos[live_index].fair.completed(
                reflex_qos::FlowId(u64::from(flow)),
                latency_ns,
                now,
            );
        }
        let request = &self.requests[index as usize];
        if request.state == RequestState::Orphaned {
            return; // Answered when it timed out: its time is not the device's answer.
        }
        let device_ns = now.saturating_since(request.submitted_at).0;
        self.live.device_operations[live_index] += 1;
        self.live.device_ns[live_index] += device_ns;
        // The device's time is the tenant's on that device (a composite's member tenant).
        let tenant_id = request.piece_tenant;
        if let Some(account) = self.qos[live_index].accounts.get_mut(tenant_id as usize) {
            account.stats.device_ns += device_ns;
        }
    }

    /// The device operation `command` names, with its memory, for the driver to submit:
    /// `user_data` is passed through, `buf_index` names the registered buffer (the arena)
    /// when the driver registered it.
    pub fn device_op(
        &mut self,
        command: &DeviceCommand,
        user_data: u64,
        buf_index: Option<u16>,
    ) -> DeviceOp<'_> {
        let kind = match (command.id, command.kind) {
            (_, DeviceOpKind::Flush) => OpKind::Flush,
            (
                _,
                DeviceOpKind::Trim {
                    offset_bytes,
                    length_bytes,
                },
            ) => OpKind::Trim {
                offset: offset_bytes,
                len: u64::from(length_bytes),
            },
            (
                DeviceOpId::Request { index, .. },
                DeviceOpKind::Read {
                    offset_bytes,
                    length_bytes,
                    ..
                },
            ) => {
                let (run, start) = self.submitted_buffer(index);
                let end = start + length_bytes as usize;
                OpKind::Read {
                    offset: offset_bytes,
                    buf: &mut self.arena.run_mut(run, end)[start..],
                }
            }
            (
                DeviceOpId::Request { index, .. },
                DeviceOpKind::Write {
                    offset_bytes,
                    length_bytes,
                    fua,
                },
            ) => {
                let (run, start) = self.submitted_buffer(index);
                let end = start + length_bytes as usize;
                OpKind::Write {
                    offset: offset_bytes,
                    buf: &self.arena.run(run, end)[start..],
                    fua,
                }
            }
            (DeviceOpId::ShutdownFlush { .. }, kind) => {
                panic!("a shutdown flush carries no data: {kind:?}")
            }
            (DeviceOpId::Migrated { .. }, kind) => {
                panic!("a migrated read's buffer is its home's ({kind:?}): see migrated_read")
            }
        };
        DeviceOp {
            user_data,
            kind,
            buf_index,
            queue: command.queue,
        }
    }

    /// The namespace slot whose device has a request's operation in flight (a composite
    /// namespace's member; `None`: no such operation).
    pub fn device_namespace(&self, id: DeviceOpId) -> Option<u16> {
        match id {
            DeviceOpId::ShutdownFlush { namespace_index } => Some(namespace_index),
            DeviceOpId::Migrated { .. } => self
                .migrated_read(id)
                .map(|(_, read)| read.command.namespace_index),
            DeviceOpId::Request { index, .. } => {
                let request = self.requests.get(index as usize)?;
                match request.work {
                    Work::Io { .. } => Some(request.submitted.namespace_index),
                    _ => None,
                }
            }
        }
    }

    /// The run of a submitted request and where its current step's data starts in it. A read
    /// that went to another thread may find its request orphaned by the home's device timeout
    /// by the time that thread issues it: the run stays lent until the read's answer comes back
    /// (`migrated_done`), so the read still lands in it.
    pub(super) fn submitted_buffer(&self, index: u32) -> (crate::buffers::PageRun, usize) {
        let request = &self.requests[index as usize];
        match request.state {
            RequestState::Submitted => {}
            RequestState::Orphaned => assert!(
                request.migrated_to.is_some(),
                "device data for an orphaned request that is not away"
            ),
            state => panic!("device data for a request in {state:?}"),
        }
        let Work::Io { run: Some(run), .. } = request.work else {
            panic!(
                "device data for a request without a run: {:?}",
                request.work
            );
        };
        let start = match self.submitted_placed(index).operation {
            Operation::Read { buffer_start, .. } | Operation::Write { buffer_start, .. } => {
                buffer_start
            }
            other => panic!("device data for {other:?}"),
        };
        (run, start as usize)
    }

    /// A device operation finished with `result` (bytes transferred, or the error).
    pub fn handle_device(&mut self, id: DeviceOpId, result: Result<u32, FlashError>, now: Nanos) {
        match id {
            DeviceOpId::Request { index, generation } => {
                let request = &self.requests[index as usize];
                assert_eq!(request.generation, generation, "stale device completion");
                self.complete_io(index, result, now);
            }
            DeviceOpId::ShutdownFlush { namespace_index } => {
                self.on_shutdown_flush(namespace_index, result)
            }
            DeviceOpId::Migrated { slot, generation } => {
                self.complete_migrated_here(slot, generation, result, now)
            }
        }
    }

    /// Step two: a device result becomes the next step or the answer.
    pub(super) fn complete_io(&mut self, index: u32, result: Result<u32, FlashError>, now: Nanos) {
        self.device_done(index, now);
        let state = self.requests[index as usize].state;
        if state == RequestState::Orphaned {
            // Answered with an error when it timed out; the device has given the buffer back.
            self.free_request(index);
            return;
        }
        assert_eq!(state, RequestState::Submitted);
        let request = &self.requests[index as usize];
        let Work::Io { io, run, step, .. } = request.work else {
            panic!("completing a request without I/O");
        };
        let connection_index = request.connection_index;
        if let IoKind::Kv { .. } = io.kind {
            self.kv_complete(index, result, now);
            return;
        }
        let placed = self.submitted_placed(index);
        let result = match self.piece_finished(index, placed, result) {
            Progress::Done(result) => result,
            Progress::Next => {
                if self.connections[connection_index as usize].is_open() {
                    self.enqueue(index, now);
                } else {
                    self.free_request(index);
                    self.maybe_finish_close(connection_index);
                }
                return;
            }
        };
        let discards = &mut self.discards[usize::from(io.namespace_index)];
        if steps::reveals_no_discard(io.kind, step, &result) {
            *discards = false;
        }
        let discards = *discards;
        let layout = &self.requests[index as usize].layout;
        let run_bytes = run.map_or(0, |run| zero_run_bytes(layout, io, run.size_bytes()));
        let next = steps::after_step(io.kind, layout, step, run_bytes, discards, &result);
        match (&next, &result) {
            (Next::Done(Answer::DeviceError { .. }), Ok(bytes)) => {
                self.stats.io_errors += 1;
                self.device_errors.record(
                    placed.namespace_index,
                    &format!("short transfer of {bytes} bytes"),
                    now,
                );
            }
            (Next::Done(answer), Err(e))
                if *answer != Answer::Ok
                    && *answer != Answer::Unsupported
                    && *answer != Answer::Nbd(Errno::NotSup) =>
            {
                self.stats.io_errors += 1;
                self.device_errors
                    .record(placed.namespace_index, &e.to_string(), now);
            }
            _ => {}
        }
        if !self.connections[connection_index as usize].is_open() {
            self.free_request(index);
            self.maybe_finish_close(connection_index);
            return;
        }
        if result.is_ok()
            && let IoStep::EdgeRead { edge } = step
        {
            self.edge_read(index, edge);
        }
        let answer = match next {
            Next::Continue(step) => {
                self.set_step(index, step);
                self.enqueue(index, now);
                return;
            }
            Next::Receive(step) => {
                self.receive_next_part(index, step, now);
                return;
            }
            Next::Send { part } => {
                self.respond_read(index, part, false);
                return;
            }
            Next::Done(answer) => answer,
        };
        if answer.is_ok() {
            match io.kind {
                IoKind::Read => self.stats.bytes_read += u64::from(io.length_bytes),
                IoKind::Write { .. } => self.stats.bytes_written += u64::from(io.length_bytes),
                _ => {}
            }
        }
        self.answer_io(index, answer);
    }

    /// Answers an I/O request: READ data goes with a successful answer. Its writes are over,
    /// so it leaves the write gate; a WRITE that ends before its last part has the rest of
    /// its payload skipped; a READ whose simple reply is already partly sent cannot report a
    /// failure, so its connection is closed (the NBD spec's hard disconnect).
    pub(super) fn answer_io(&mut self, index: u32, answer: Answer) {
        let Work::Io { io, run, .. } = self.requests[index as usize].work else {
            panic!("answering a request without I/O");
        };
        self.leave_gate(index);
        self.kv_forget(index);
        let connection_index = self.requests[index as usize].connection_index;
        let connection = &self.connections[connection_index as usize];
        if connection.payload == Some(index) {
            self.skip_rest_of_payload(index);
        }
        let connection = &self.connections[connection_index as usize];
        if !answer.is_ok() && connection.stream_owner == index {
            self.abort_connection(connection_index, "a READ failed after its reply began");
            self.free_request(index);
            self.maybe_finish_close(connection_index);
            return;
        }
        if answer.is_ok() && io.kind == IoKind::Read {
            let last = self.requests[index as usize].layout.part_count() - 1;
            self.respond_read(index, last, true);
        } else {
            self.respond(index, answer, run, 0);
        }
    }

    /// Moves a request to `step`; a zero fill starts by zeroing the request's run.
    pub(super) fn set_step(&mut self, index: u32, next: IoStep) {
        let Work::Io { run, step, .. } = &mut self.requests[index as usize].work else {
            panic!("a step for a request without I/O");
        };
        let starts_zero_fill = matches!(next, IoStep::ZeroFill { written_bytes: 0 })
            && !matches!(*step, IoStep::ZeroFill { .. });
        *step = next;
        if starts_zero_fill {
            let Some(run) = *run else {
                panic!("zero fill without a run");
            };
            self.arena.run_mut(run, run.size_bytes()).fill(0);
        }
        self.refresh_operation(index);
    }

    /// Requests whose device operation outlived the limit: each is answered with an error
    /// now (in a fresh slot) and orphaned until the device gives its buffer back.
    pub(super) fn time_out_device_operations(&mut self, now: Nanos) {
        let Some(limit) = self.limits.device_timeout else {
            return;
        };
        for index in 0..self.requests.len() as u32 {
            let request = &self.requests[index as usize];
            if request.state != RequestState::Submitted
                || now.saturating_since(request.submitted_at) < limit
            {
                continue;
            }
            if self.free_requests.is_empty() {
                return; // Next time: the answer needs a slot.
            }
            let connection_index = request.connection_index;
            let tag = request.tag;
            let io = request.io();
            let arrived_at = request.arrived_at;
            self.stats.device_timeouts += 1;
            self.device_errors.record(
                io.namespace_index,
                "device operation timed out; answered with an error",
                now,
            );
            if self.connections[connection_index as usize].stream_owner == index {
                // A simple reply already began: a failure can only close the connection.
                self.abort_connection(connection_index, "a READ timed out after its reply began");
            }
            if self.connections[connection_index as usize].payload == Some(index) {
                self.skip_rest_of_payload(index);
            }
            // The orphan leaves its connection: the connection's window place and pages go to
            // the answer, the buffer stays with the device.
            self.transition(index, RequestState::Orphaned);
            let run_pages = self.requests[index as usize]
                .work
                .run()
                .map_or(0, |run| run.page_count());
            let connection = &mut self.connections[connection_index as usize];
            connection.run_pages -= run_pages;
            connection.outstanding -= 1;
            if !connection.is_open() {
                self.maybe_finish_close(connection_index);
                continue;
            }
            let answer = self.allocate_request(
                connection_index,
                tag,
                Action::Reply(Answer::DeviceError {
                    errno: libc::ETIMEDOUT,
                }),
                arrived_at,
            );
            let started = self.try_start(answer, now);
            assert!(started, "an error answer needs no buffer");
        }
    }
}

/// What the scheduler sees of a device operation.
fn charged(operation: Operation) -> Charged {
    match operation {
        Operation::Read { length_bytes, .. } => Charged::Read(length_bytes),
        Operation::Write { length_bytes, .. } => Charged::Write(length_bytes),
        Operation::Flush | Operation::Discard { .. } => Charged::Other,
    }
}

/// Bytes of a WRITE_ZEROES zero source: its run, up to what the request needs.
fn zero_run_bytes(layout: &Layout, io: IoRequest, run_size_bytes: usize) -> usize {
    layout.run_bytes(io.kind).min(run_size_bytes)
}
