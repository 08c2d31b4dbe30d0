//! The emulated Flash device: a deterministic model of an NVMe SSD that behaves like Flash
//! under load, so QoS experiments mean something on machines without an NVMe drive.
//!
//! Why a model and not a fixed delay: ReFlex's scheduler exists because Flash tail latency
//! rises with load and because writes hurt concurrent reads far more than their share. The
//! model reproduces both from first principles: internal parallelism (channels × dies, each die
//! one FIFO server), writes acknowledged from a buffer while their program and garbage-collection
//! work later occupies die time in front of reads, faster reads while the load is read-only, a
//! bounded number of command slots, and NVMe submission-queue arbitration
//! ([`arbiter`]) deciding which waiting command is fetched when a slot frees up.
//!
//! # How one command flows
//! 1. `submit` appends it to its submission queue (bounded; full → refused).
//! 2. When a command slot is free, the arbiter picks the next command (RR, WRR or DRR).
//! 3. Read: each page (commands are split into `page_bytes` pages; pages map to dies by a hash
//!    of the page index) waits for its die, then takes `read_ns` (`read_only_read_ns` while
//!    the load is read-only). The command completes `controller_ns` after its last page.
//!    Write: if the buffer has room it is acknowledged `write_ack_ns` after fetch, and its
//!    pages' program + GC work is cut into slices of `background_slice_ns` that reach random
//!    dies at random moments within `flush_spread_ns` (a log-structured FTL spreads writes and
//!    GC over dies and time), each queueing FIFO in front of later reads; the buffer room comes
//!    back when the last slice is done. Without room the write waits, holding its slot. Flush and trim take
//!    `controller_ns` (the buffer is power-protected).
//! 4. The slot frees at completion and the arbiter fetches again.
//!
//! Because every die is FIFO and every service time is known when work is queued, a die is a
//! single `busy_until` number: the model needs one timer per command (plus one per background
//! slice of a write), not per page, which keeps it cheap enough for the dataplane
//! (see [`realtime`]).
//!
//! # API (sans-IO, explicit time)
//! - [`EmuDevice::new`]`(profile, capacity_bytes, seed)`: preconditioned (steady-state GC);
//!   [`EmuDevice::set_fresh`] models a new device whose GC starts once it has been filled.
//! - [`EmuDevice::submit`]`(now, EmuRequest)`: queue a command; `now` never goes back (an
//!   earlier `now` is treated as the latest time seen).
//! - [`EmuDevice::advance`]`(now, &mut out)`: every completion due at or before `now`, in
//!   completion order, each with its exact completion time.
//! - [`EmuDevice::next_event`]: when to call `advance` next (`None`: idle).
//! - Data: [`EmuDevice::write_data`], [`EmuDevice::read_data`], [`EmuDevice::trim_data`] act
//!   on the sparse page store at once; the timing model is separate, so load generators can
//!   drive timing without data and the real-clock device copies data at submit.
//!
//! # Drift ([`drift`])
//! A schedule ([`EmuDevice::set_schedule`], or `emu(slow=2x@10s;stall=40s-41s):NAME` in a
//! spec) and a shared run-time handle ([`EmuDevice::controls`]) slow the device down, speed it
//! up or stall it: a factor multiplies the service time of work that starts while it is in
//! force; while stalled, nothing starts. The exact rule is in [`drift`].
//!
//! Determinism: the only randomness (which die a background slice lands on) comes from the
//! seed, so the same seed and the same call sequence give the same completions.
//!
//! Invariant: `buffer_used_pages <= write_buffer_pages`; every occupied slot has exactly one
//! pending `Complete` event or sits in `waiting_writes`.

pub mod arbiter;
pub mod drift;
#[cfg(test)]
mod drift_tests;
pub mod profile;
pub mod realtime;
pub mod store;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_qos::Nanos;
use thiserror::Error;

pub use arbiter::{
    ArbiterError, ArbitrationConfig, ArbitrationPolicy, ClassWeights, IoprioError, PriorityClass,
    class_from_ioprio,
};
pub use drift::{
    DriftState, EmuControls, EmuSchedule, EmuScheduleError, ScheduleOrigin, SlowStep, Slowdown,
    StallWindow, split_spec,
};
pub use profile::{EmuProfile, EmuProfileError};
pub use realtime::{EMU_SIZE_DEFAULT_BYTES, EmuFlash, open};
pub use store::PageStore;

/// Offsets and lengths must be multiples of this.
pub const EMU_BLOCK_BYTES: u32 = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EmuOpKind {
    Read,
    Write,
    Flush,
    Trim,
}

/// One command for the model. `len` is ignored for flush.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmuRequest {
    /// Returned with the completion; the model does not interpret it.
    pub tag: u64,
    pub kind: EmuOpKind,
    pub offset: u64,
    pub len: u32,
    /// Submission queue index (`< profile.queue_count`).
    pub queue: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmuCompletion {
    pub tag: u64,
    pub kind: EmuOpKind,
    pub queue: u16,
    pub len: u32,
    pub submitted_at: Nanos,
    pub completed_at: Nanos,
}

impl EmuCompletion {
    pub fn latency(&self) -> Nanos {
        self.completed_at.saturating_since(self.submitted_at)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EmuError {
    #[error("{0}")]
    Profile(#[from] EmuProfileError),
    #[error("capacity {capacity_bytes} must be a non-zero multiple of {EMU_BLOCK_BYTES} bytes")]
    Capacity { capacity_bytes: u64 },
    #[error("range {offset}+{len} is not inside the device's {capacity_bytes} bytes")]
    OutOfRange {
        offset: u64,
        len: u64,
        capacity_bytes: u64,
    },
    #[error("offset {offset} and length {len} must be non-zero multiples of {EMU_BLOCK_BYTES}")]
    Misaligned { offset: u64, len: u64 },
    #[error("{0}")]
    Arbiter(#[from] ArbiterError),
    #[error("{0}")]
    Schedule(#[from] EmuScheduleError),
}

/// Counters since the device was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmuStats {
    pub commands_submitted: u64,
    pub commands_completed: u64,
    pub pages_read: u64,
    pub pages_read_read_only: u64,
    pub pages_written: u64,
    /// Die time spent on reads and on background (program + GC) work.
    pub die_read_ns: u64,
    pub die_background_ns: u64,
    /// Writes that had to wait for buffer room.
    pub writes_stalled: u64,
}

#[derive(Debug, Clone, Copy)]
struct Command {
    tag: u64,
    kind: EmuOpKind,
    offset: u64,
    len: u32,
    queue: u16,
    submitted_at: Nanos,
}

/// Timer kinds, ordered only to make heap ties deterministic (the sequence number decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Complete { slot: u32 },
    BufferFree { pages: u32 },
    Slice { work: u32, ns: u32 },
}

/// The drift state of a device: its schedule's timeline, the run-time handle, and the factor
/// and stall they set.
#[derive(Debug)]
struct DriftModel {
    /// Set by `set_schedule`; armed (its times made absolute) at the next call's `now`.
    pending: Option<EmuSchedule>,
    /// Absolute times, sorted; `timeline_next` is the next change to apply.
    timeline: Vec<(u64, drift::Change)>,
    timeline_next: usize,
    schedule_slowdown: Slowdown,
    schedule_stalled: bool,
    control_slowdown: Slowdown,
    control_stalled: bool,
    controls: Arc<EmuControls>,
    /// The handle's generation last applied.
    control_generation: u64,
    /// Schedule × handle, cached.
    factor: drift::Factor,
    /// Background slices that reached their die while stalled, as (work index, base ns), in
    /// arrival order. Bounded by the slices of the writes in the buffer.
    deferred_slices: Vec<(u32, u32)>,
}

impl DriftModel {
    fn new() -> DriftModel {
        DriftModel {
            pending: None,
            timeline: Vec::new(),
            timeline_next: 0,
            schedule_slowdown: Slowdown::NONE,
            schedule_stalled: false,
            control_slowdown: Slowdown::NONE,
            control_stalled: false,
            controls: Arc::new(EmuControls::default()),
            control_generation: 0,
            factor: drift::Factor::of(Slowdown::NONE, Slowdown::NONE),
            deferred_slices: Vec::new(),
        }
    }

    fn stalled(&self) -> bool {
        self.schedule_stalled || self.control_stalled
    }

    fn next_change_at(&self) -> Option<u64> {
        self.timeline.get(self.timeline_next).map(|&(at, _)| at)
    }
}

/// Background work of one admitted write, until its last slice is on a die.
#[derive(Debug, Clone, Copy)]
struct WriteWork {
    pages: u32,
    slices_left: u64,
    finish_latest: u64,
}

pub struct EmuDevice {
    profile: EmuProfile,
    capacity_bytes: u64,
    seed: u64,
    rng: Xoshiro256PlusPlus,
    arbiter: arbiter::Arbiter<Command>,
    slots: Vec<Option<Command>>,
    free_slots: Vec<u32>,
    die_busy_until: Vec<u64>,
    die_count: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    event_sequence: u64,
    /// Latest time the model has been advanced to.
    time: Nanos,
    ready: VecDeque<EmuCompletion>,
    buffer_used_pages: u64,
    waiting_writes: VecDeque<u32>,
    work: Vec<WriteWork>,
    free_work: Vec<u32>,
    last_write_fetch: Option<Nanos>,
    /// `None`: steady state (preconditioned); `Some(pages)`: fresh, pages written so far.
    fresh_pages_written: Option<u64>,
    store: PageStore,
    stats: EmuStats,
    drift: DriftModel,
}

impl std::fmt::Debug for EmuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmuDevice")
            .field("profile", &self.profile.name)
            .field("capacity_bytes", &self.capacity_bytes)
            .field("seed", &self.seed)
            .field("time", &self.time)
            .field("stats", &self.stats)
            .finish()
    }
}

impl EmuDevice {
    pub fn new(profile: EmuProfile, capacity_bytes: u64, seed: u64) -> Result<EmuDevice, EmuError> {
        profile.validate()?;
        if capacity_bytes == 0 || !capacity_bytes.is_multiple_of(u64::from(EMU_BLOCK_BYTES)) {
            return Err(EmuError::Capacity { capacity_bytes });
        }
        let arbiter = arbiter::Arbiter::new(
            &profile.arbitration,
            profile.queue_count,
            profile.queue_entries_max,
        )?;
        let slot_count = profile.queue_depth_max;
        let die_count = u64::from(profile.die_count());
        Ok(EmuDevice {
            capacity_bytes,
            seed,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            arbiter,
            slots: vec![None; slot_count as usize],
            free_slots: (0..slot_count).rev().collect(),
            die_busy_until: vec![0; die_count as usize],
            die_count,
            events: BinaryHeap::with_capacity(slot_count as usize * 2),
            event_sequence: 0,
            time: Nanos::ZERO,
            ready: VecDeque::with_capacity(slot_count as usize),
            buffer_used_pages: 0,
            waiting_writes: VecDeque::new(),
            work: Vec::new(),
            free_work: Vec::new(),
            last_write_fetch: None,
            fresh_pages_written: None,
            store: PageStore::new(),
            stats: EmuStats::default(),
            drift: DriftModel::new(),
            profile,
        })
    }

    /// Models a new, never-written device: garbage collection costs nothing at first and grows
    /// to its steady-state cost as the device fills (pages written / capacity).
    pub fn set_fresh(&mut self) {
        self.fresh_pages_written = Some(0);
    }

    pub fn profile(&self) -> &EmuProfile {
        &self.profile
    }

    /// Replaces the drift schedule. Its times count from the first `now` the device sees from
    /// here on (or from 0 with [`ScheduleOrigin::Zero`]); the schedule's factor and stall
    /// restart at 1x and not stalled at that moment. The run-time handle is not affected.
    pub fn set_schedule(&mut self, schedule: EmuSchedule) -> Result<(), EmuError> {
        let schedule = schedule.normalize()?;
        self.drift.pending = Some(schedule);
        Ok(())
    }

    /// The shared run-time handle: slow down, speed up or stall this device from any thread.
    pub fn controls(&self) -> Arc<EmuControls> {
        Arc::clone(&self.drift.controls)
    }

    /// The drift state in force: factor (schedule × handle) and stall.
    pub fn drift_state(&self) -> DriftState {
        self.drift.controls.state()
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn stats(&self) -> EmuStats {
        self.stats
    }

    /// The latest `now` the model has seen.
    pub fn now(&self) -> Nanos {
        self.time
    }

    /// Commands submitted and not yet handed out by `advance`.
    pub fn outstanding(&self) -> u64 {
        self.stats.commands_submitted - self.stats.commands_completed + self.ready.len() as u64
    }

    /// Nothing submitted is unfinished and no background work is pending (a drift schedule's
    /// future changes do not count: they change nothing until work arrives).
    pub fn is_idle(&self) -> bool {
        self.outstanding() == 0 && self.events.is_empty() && self.drift.deferred_slices.is_empty()
    }

    /// Pages of the write buffer holding data not yet programmed.
    pub fn buffer_used_pages(&self) -> u64 {
        self.buffer_used_pages
    }

    pub fn set_queue_class(&mut self, queue: u16, class: PriorityClass) -> Result<(), EmuError> {
        Ok(self.arbiter.set_queue_class(queue, class)?)
    }

    pub fn queue_class(&self, queue: u16) -> Option<PriorityClass> {
        self.arbiter.class_of(queue)
    }

    /// Commands waiting in submission queue `queue` (not yet fetched).
    pub fn waiting_in(&self, queue: u16) -> usize {
        self.arbiter.waiting_in(queue)
    }

    /// Queues a command at `now`.
    pub fn submit(&mut self, now: Nanos, request: EmuRequest) -> Result<(), EmuError> {
        let len = match request.kind {
            EmuOpKind::Flush => 0,
            _ => {
                self.check_range(request.offset, u64::from(request.len))?;
                request.len
            }
        };
        let now = self.observe(now);
        let command = Command {
            tag: request.tag,
            kind: request.kind,
            offset: request.offset,
            len,
            queue: request.queue,
            submitted_at: now,
        };
        self.arbiter.push(request.queue, command, len)?;
        self.stats.commands_submitted += 1;
        self.drift.controls.record_submission(request.queue);
        self.fetch(now);
        Ok(())
    }

    /// Moves the model to `now` and appends every completion due by then.
    pub fn advance(&mut self, now: Nanos, out: &mut Vec<EmuCompletion>) {
        self.observe(now);
        out.extend(self.ready.drain(..));
    }

    /// The earliest time at which `advance` has something to do: a completion or background
    /// event, the schedule's next change while work is waiting, or a periodic re-check while
    /// the handle stalls a device with work waiting (so a lift from another thread is seen).
    pub fn next_event(&self) -> Option<Nanos> {
        if let Some(done) = self.ready.front() {
            return Some(done.completed_at);
        }
        let event = self.events.peek().map(|Reverse((time, _, _))| *time);
        let waiting = self.outstanding() > 0 || !self.drift.deferred_slices.is_empty();
        let change = self.drift.next_change_at().filter(|_| waiting);
        let recheck = (waiting && self.drift.control_stalled)
            .then(|| self.time.0.saturating_add(drift::CONTROL_RECHECK.0));
        [event, change, recheck]
            .into_iter()
            .flatten()
            .min()
            .map(Nanos)
    }

    pub fn read_data(&self, offset: u64, buf: &mut [u8]) -> Result<(), EmuError> {
        self.check_range(offset, buf.len() as u64)?;
        self.store.read(offset, buf);
        Ok(())
    }

    pub fn write_data(&mut self, offset: u64, buf: &[u8]) -> Result<(), EmuError> {
        self.check_range(offset, buf.len() as u64)?;
        self.store.write(offset, buf);
        Ok(())
    }

    pub fn trim_data(&mut self, offset: u64, len: u64) -> Result<(), EmuError> {
        self.check_range(offset, len)?;
        self.store.trim(offset, len);
        Ok(())
    }

    /// Checks that a trim of `len` bytes at `offset` is aligned and inside the device.
    pub fn trim_data_check(&self, offset: u64, len: u64) -> Result<(), EmuError> {
        self.check_range(offset, len)
    }

    /// Pages of data held in memory.
    pub fn stored_pages(&self) -> usize {
        self.store.page_count()
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), EmuError> {
        let block = u64::from(EMU_BLOCK_BYTES);
        if len == 0 || !offset.is_multiple_of(block) || !len.is_multiple_of(block) {
            return Err(EmuError::Misaligned { offset, len });
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.capacity_bytes => Ok(()),
            _ => Err(EmuError::OutOfRange {
                offset,
                len,
                capacity_bytes: self.capacity_bytes,
            }),
        }
    }

    fn schedule(&mut self, at: u64, event: Event) {
        self.event_sequence += 1;
        self.events.push(Reverse((at, self.event_sequence, event)));
    }

    /// Brings the model to `now` (never back): arms a newly set schedule, runs every event
    /// and schedule change due, then applies a change made through the handle, at `now`.
    fn observe(&mut self, now: Nanos) -> Nanos {
        let now = now.max(self.time);
        if let Some(schedule) = self.drift.pending.take() {
            let origin = match schedule.origin {
                ScheduleOrigin::FirstNow => now,
                ScheduleOrigin::Zero => Nanos::ZERO,
            };
            self.drift.timeline = schedule.timeline(origin);
            self.drift.timeline_next = 0;
            self.change_drift(self.time, |drift| {
                drift.schedule_slowdown = Slowdown::NONE;
                drift.schedule_stalled = false;
            });
        }
        self.run_until(now);
        let generation = self.drift.controls.generation();
        if generation != self.drift.control_generation {
            self.drift.control_generation = generation;
            let (slowdown, stalled) = self.drift.controls.requested();
            self.change_drift(now, |drift| {
                drift.control_slowdown = slowdown;
                drift.control_stalled = stalled;
            });
        }
        now
    }

    fn run_until(&mut self, now: Nanos) {
        loop {
            let event_at = self.events.peek().map(|&Reverse((at, _, _))| at);
            // A schedule change applies before any event at the same time.
            if let Some(change_at) = self.drift.next_change_at()
                && change_at <= now.0
                && event_at.is_none_or(|at| change_at <= at)
            {
                let (_, change) = self.drift.timeline[self.drift.timeline_next];
                self.drift.timeline_next += 1;
                // A schedule armed late (origin zero) applies its past changes at once.
                self.time = self.time.max(Nanos(change_at));
                self.apply_change(change, self.time);
                continue;
            }
            let Some(at) = event_at.filter(|&at| at <= now.0) else {
                break;
            };
            let Some(Reverse((_, _, event))) = self.events.pop() else {
                break;
            };
            self.time = Nanos(at);
            match event {
                Event::Complete { slot } => self.complete(slot, Nanos(at)),
                Event::BufferFree { pages } => self.buffer_free(pages, Nanos(at)),
                Event::Slice { work, ns } => self.slice_arrives(work, ns, Nanos(at)),
            }
        }
        self.time = self.time.max(now);
    }

    fn apply_change(&mut self, change: drift::Change, at: Nanos) {
        self.change_drift(at, |drift| match change {
            drift::Change::Slow(slowdown) => drift.schedule_slowdown = slowdown,
            drift::Change::StallBegin => drift.schedule_stalled = true,
            drift::Change::StallEnd => drift.schedule_stalled = false,
        });
    }

    /// Changes the drift state at `at`; if that ends a stall, what waited starts now.
    fn change_drift(&mut self, at: Nanos, change: impl FnOnce(&mut DriftModel)) {
        let stalled_before = self.drift.stalled();
        let factor_before = self.drift.factor;
        change(&mut self.drift);
        let drift = &mut self.drift;
        drift.factor = drift::Factor::of(drift.schedule_slowdown, drift.control_slowdown);
        if drift.factor != factor_before || drift.stalled() != stalled_before {
            drift.controls.publish(drift.factor, drift.stalled());
        }
        if stalled_before && !self.drift.stalled() {
            self.resume(at);
        }
    }

    /// The end of a stall: slices that waited reach their dies, writes that waited are
    /// admitted, and the arbiter fetches, all at `at`.
    fn resume(&mut self, at: Nanos) {
        assert!(!self.drift.stalled(), "resume while stalled");
        let mut deferred = std::mem::take(&mut self.drift.deferred_slices);
        for &(work, ns) in &deferred {
            self.slice_arrives(work, ns, at);
        }
        assert!(
            self.drift.deferred_slices.is_empty(),
            "a slice was deferred while not stalled"
        );
        // Keep the vector's capacity for the next stall.
        deferred.clear();
        self.drift.deferred_slices = deferred;
        self.admit_waiting_writes(at);
        self.fetch(at);
    }

    fn complete(&mut self, slot: u32, at: Nanos) {
        let command = self.slots[slot as usize].take();
        assert!(command.is_some(), "completion for an empty slot {slot}");
        let Some(command) = command else { return };
        self.ready.push_back(EmuCompletion {
            tag: command.tag,
            kind: command.kind,
            queue: command.queue,
            len: command.len,
            submitted_at: command.submitted_at,
            completed_at: at,
        });
        self.stats.commands_completed += 1;
        self.free_slots.push(slot);
        self.fetch(at);
    }

    fn buffer_free(&mut self, pages: u32, at: Nanos) {
        assert!(
            self.buffer_used_pages >= u64::from(pages),
            "buffer accounting"
        );
        self.buffer_used_pages -= u64::from(pages);
        self.admit_waiting_writes(at);
    }

    /// Admits waiting writes, in order, while the buffer has room (not while stalled).
    fn admit_waiting_writes(&mut self, at: Nanos) {
        if self.drift.stalled() {
            return;
        }
        while let Some(&slot) = self.waiting_writes.front() {
            let Some(command) = self.slots[slot as usize] else {
                unreachable!("a waiting write holds its slot");
            };
            if !self.buffer_has_room(self.pages_of(&command)) {
                break;
            }
            self.waiting_writes.pop_front();
            self.admit_write(slot, command, at);
        }
    }

    fn fetch(&mut self, at: Nanos) {
        if self.drift.stalled() {
            return;
        }
        while let Some(&slot) = self.free_slots.last() {
            let Some((_, command)) = self.arbiter.pop() else {
                break;
            };
            self.free_slots.pop();
            self.start(slot, command, at);
        }
    }

    fn pages_of(&self, command: &Command) -> u64 {
        if command.len == 0 {
            return 0;
        }
        let page = u64::from(self.profile.page_bytes);
        let first = command.offset / page;
        let last = (command.offset + u64::from(command.len) - 1) / page;
        last - first + 1
    }

    fn buffer_has_room(&self, pages: u64) -> bool {
        self.buffer_used_pages + pages <= u64::from(self.profile.write_buffer_pages)
    }

    fn read_only(&self, at: Nanos) -> bool {
        self.buffer_used_pages == 0
            && self
                .last_write_fetch
                .is_none_or(|last| at.saturating_since(last).0 >= self.profile.read_only_window_ns)
    }

    fn die_of_page(&self, page: u64) -> usize {
        // Fibonacci hashing spreads any access pattern (sequential, strided) over the dies.
        ((page.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % self.die_count) as usize
    }

    fn start(&mut self, slot: u32, command: Command, at: Nanos) {
        assert!(
            self.slots[slot as usize].is_none(),
            "slot {slot} taken twice"
        );
        self.slots[slot as usize] = Some(command);
        match command.kind {
            EmuOpKind::Read => {
                let read_only = self.read_only(at);
                let read_ns = self.drift.factor.apply(if read_only {
                    self.profile.read_only_read_ns
                } else {
                    self.profile.read_ns
                });
                let page = u64::from(self.profile.page_bytes);
                let first = command.offset / page;
                let pages = self.pages_of(&command);
                let mut finish_max = at.0;
                for page_index in first..first + pages {
                    let die = self.die_of_page(page_index);
                    let finish = self.die_busy_until[die].max(at.0) + read_ns;
                    self.die_busy_until[die] = finish;
                    finish_max = finish_max.max(finish);
                }
                self.stats.pages_read += pages;
                if read_only {
                    self.stats.pages_read_read_only += pages;
                }
                self.stats.die_read_ns += pages * read_ns;
                self.schedule(
                    finish_max + self.drift.factor.apply(self.profile.controller_ns),
                    Event::Complete { slot },
                );
            }
            EmuOpKind::Write => {
                self.last_write_fetch = Some(at);
                if self.waiting_writes.is_empty() && self.buffer_has_room(self.pages_of(&command)) {
                    self.admit_write(slot, command, at);
                } else {
                    self.stats.writes_stalled += 1;
                    self.waiting_writes.push_back(slot);
                }
            }
            EmuOpKind::Flush | EmuOpKind::Trim => {
                let controller_ns = self.drift.factor.apply(self.profile.controller_ns);
                self.schedule(at.0 + controller_ns, Event::Complete { slot });
            }
        }
    }

    /// Takes buffer room for a write, acknowledges it and schedules its background work: each
    /// slice reaches a random die at a random moment within `flush_spread_ns`, as the flusher
    /// and garbage collector spread work over time and over the dies.
    fn admit_write(&mut self, slot: u32, command: Command, at: Nanos) {
        let pages = self.pages_of(&command);
        assert!(self.buffer_has_room(pages), "write admitted without room");
        self.buffer_used_pages += pages;
        let gc_ns = match self.fresh_pages_written.as_mut() {
            None => self.profile.gc_ns_per_page,
            Some(written) => {
                let capacity_pages =
                    (self.capacity_bytes / u64::from(self.profile.page_bytes)).max(1);
                let filled = (*written).min(capacity_pages);
                *written += pages;
                ((u128::from(self.profile.gc_ns_per_page) * u128::from(filled))
                    / u128::from(capacity_pages)) as u64
            }
        };
        let work_ns = self.profile.program_ns + gc_ns;
        let slice_ns = self.profile.background_slice_ns;
        let slices_per_page = work_ns.div_ceil(slice_ns);
        let slices = pages * slices_per_page;
        self.stats.pages_written += pages;
        let write_ack_ns = self.drift.factor.apply(self.profile.write_ack_ns);
        self.schedule(at.0 + write_ack_ns, Event::Complete { slot });
        if slices == 0 {
            self.schedule(
                at.0,
                Event::BufferFree {
                    pages: pages as u32,
                },
            );
            return;
        }
        let work = WriteWork {
            pages: pages as u32,
            slices_left: slices,
            finish_latest: at.0,
        };
        let index = match self.free_work.pop() {
            Some(index) => {
                self.work[index as usize] = work;
                index
            }
            None => {
                self.work.push(work);
                (self.work.len() - 1) as u32
            }
        };
        let spread = self.profile.flush_spread_ns.max(1);
        for _ in 0..pages {
            let mut remaining = work_ns;
            while remaining > 0 {
                let slice = remaining.min(slice_ns);
                remaining -= slice;
                let delay = self.rng.next_u64() % spread;
                self.schedule(
                    at.0 + delay,
                    Event::Slice {
                        work: index,
                        ns: slice as u32,
                    },
                );
            }
        }
    }

    /// A background slice reaches a die: it queues behind whatever the die has, for its base
    /// die time × the factor in force now. While stalled it waits for the end of the stall.
    fn slice_arrives(&mut self, work_index: u32, ns: u32, at: Nanos) {
        if self.drift.stalled() {
            self.drift.deferred_slices.push((work_index, ns));
            return;
        }
        let die = (self.rng.next_u64() % self.die_count) as usize;
        let slice_ns = self.drift.factor.apply(u64::from(ns));
        self.stats.die_background_ns += slice_ns;
        let finish = self.die_busy_until[die].max(at.0) + slice_ns;
        self.die_busy_until[die] = finish;
        let work = &mut self.work[work_index as usize];
        assert!(work.slices_left > 0, "slice of finished work");
        work.slices_left -= 1;
        work.finish_latest = work.finish_latest.max(finish);
        if work.slices_left == 0 {
            let (pages, finish_latest) = (work.pages, work.finish_latest);
            self.free_work.push(work_index);
            self.schedule(finish_latest, Event::BufferFree { pages });
        }
    }
}
