//! The ReFlex token scheduler (paper §3.2.2, Algorithm 1): one instance per dataplane thread
//! per device.
//!
//! How the dataplane drives it, once per loop iteration:
//! 1. [`Scheduler::apply`] any [`RateUpdate`]s the control plane sent;
//! 2. [`Scheduler::enqueue`] each parsed request into its tenant's queue; on
//!    [`EnqueueError::TenantQueueFull`] stop reading that connection until a
//!    [`SchedulerEvent::QueueRoom`] for the tenant comes out of [`Scheduler::poll_event`];
//! 3. [`Scheduler::schedule`] with the current time and a closure that submits one admitted
//!    request to the device and returns `false` if the device cannot take it now;
//! 4. drain [`Scheduler::poll_event`] (deficit-limit notices go to the control plane);
//! 5. when blocking, sleep no longer than [`Scheduler::next_deadline`].
//!
//! A round costs O(tenants with queued requests + refills due), not O(tenants): LC tenants
//! that are idle and full, and BE tenants that are idle, are folded into one aggregate rate
//! whose tokens are donated to the global bucket each round, as Algorithm 1 would have donated
//! them one tenant at a time; LC tenants that went idle below `POS_LIMIT` wait on a timing
//! wheel (`wheel.rs`) until they are full, costing nothing per round meanwhile.
//!
//! Per round, in order:
//! * the idle aggregate's tokens since the last round go to the global bucket;
//! * refilling LC tenants that are full by now keep `POS_LIMIT`, donate the rest, and idle;
//! * **LC subround** (from a rotating start): each listed LC tenant earns reservation ×
//!   elapsed time; requests are submitted while its balance is above its deficit limit; at
//!   the limit the tenant is
//!   rate-limited and reported once per episode ([`SchedulerEvent::DeficitLimitReached`]);
//!   while lending is on it may borrow the exact cost of its next request from the global
//!   bucket (which may go down to `-loan_max`). With an empty queue the tenant refills up to
//!   `POS_LIMIT` (its rate × the span of this thread's last `surplus_rounds` rounds) and then
//!   idles, donating everything beyond; with a non-empty queue and a balance above
//!   `POS_LIMIT`, `donate_percent` of the balance is donated (the paper's rule). A tenant may
//!   borrow at most `loan_percent` of what it earns (an allowance capped at its deficit limit);
//! * **BE subround**, round robin from a start that rotates every round: each listed BE tenant
//!   earns its share × elapsed time, first repays any loan, claims from the bucket what its
//!   queue needs beyond its balance, submits each request it can pay for, keeps the remainder
//!   while it still has queued requests, and donates it and idles when its queue is empty;
//! * this thread marks its round done; the last participant since the previous reset resets
//!   the bucket ([`DeviceShared`]).
//!
//! Invariant (asserted in debug builds after every round, and by [`Scheduler::check`]):
//! tokens generated + taken from the bucket = spent + given to the bucket + withheld + written
//! off + held.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::config::{ConfigError, QosConfig, ROUND_HISTORY_MAX};
use crate::cost::{CostModel, IoKind, LoadMode, REQUEST_BYTES_MAX};
use crate::queue::{List, Node, Pool};
use crate::rates::{
    DeviceRates, RatePerMode, RateUpdate, SPARE_SHARE_ALL, TenantClass, TenantId, TenantRates,
    effective_rates,
};
use crate::shared::DeviceShared;
use crate::time::Nanos;
use crate::tokens::{TokenRate, Tokens, accrue, amount_over, time_to_earn};
use crate::wheel::TimerWheel;

/// Whether the scheduler enforces QoS or passes requests through in arrival order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Algorithm 1.
    Tokens,
    /// QoS off: one FIFO per thread over all tenants, submitted as fast as the device takes
    /// them (the original's `scheduler="off"`), kept for comparison. Costs are still counted.
    Fifo,
}

/// A request as the dataplane hands it over: an opaque token (e.g. a slot index with a
/// generation) that comes back in [`Admitted`], plus what the cost model needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub token: u64,
    pub size_bytes: u32,
    pub kind: IoKind,
}

/// A request the scheduler has paid for and hands to the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub tenant: TenantId,
    /// The tenant's class: a fairness stage in front of the device holds only best-effort
    /// requests.
    pub class: TenantClass,
    pub token: u64,
    pub size_bytes: u32,
    pub kind: IoKind,
    pub cost: Tokens,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnqueueError {
    #[error("{0} is not served by this thread")]
    UnknownTenant(TenantId),
    #[error(
        "{tenant} has {depth_max} requests queued on this thread; stop reading its connections until it has room"
    )]
    TenantQueueFull { tenant: TenantId, depth_max: u32 },
    #[error("this thread has {queued_max} requests queued; stop reading until there is room")]
    ThreadQueueFull { tenant: TenantId, queued_max: u32 },
    #[error("request of {size_bytes} bytes is larger than {REQUEST_BYTES_MAX}")]
    TooLarge { size_bytes: u32 },
}

/// Things the dataplane must pass on (to the control plane, or to its own read loop).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulerEvent {
    /// An LC tenant with queued requests reached its deficit limit on this thread: the first
    /// time in an episode. The episode ends with [`SchedulerEvent::DeficitRecovered`].
    DeficitLimitReached { tenant: TenantId },
    /// The tenant's balance on this thread is back at zero or above.
    DeficitRecovered { tenant: TenantId },
    /// The tenant's queue was reported full and has room again: resume reading.
    QueueRoom { tenant: TenantId },
}

/// What one round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoundSummary {
    pub submitted: u32,
    pub tokens_spent: Tokens,
    /// The device refused a request; the round stopped early. Schedule again when the device
    /// completes something.
    pub device_full: bool,
}

/// Counters for one tenant on one thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantStats {
    pub submitted_requests: u64,
    pub submitted_tokens: Tokens,
    /// Tokens its own rate produced.
    pub generated_tokens: Tokens,
    /// Tokens taken from the global bucket (BE claims, LC loans).
    pub bucket_tokens: Tokens,
    /// Tokens given to the global bucket (surplus, leftovers, loan repayments).
    pub donated_tokens: Tokens,
    pub deficit_episodes: u64,
    pub balance: Tokens,
    pub queued_requests: u32,
}

/// This thread's token accounts; see the module doc for the identity they satisfy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ledger {
    pub generated: Tokens,
    pub from_bucket: Tokens,
    pub spent: Tokens,
    pub to_bucket: Tokens,
    /// Donations kept out of the bucket ([`DeviceRates::spare_share_ppm`]): unused, not spare.
    pub withheld: Tokens,
    /// Balances of tenants that left the thread or turned best effort, and debt beyond a
    /// deficit limit that a cut reservation shrank.
    pub written_off: Tokens,
    /// Tenant balances plus donations not yet handed to the bucket.
    pub held: Tokens,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Vacant,
    Active,
    /// Removed while requests were queued: served until empty, then vacated.
    Retiring,
}

const EVENT_LIMIT: u8 = 1;
const EVENT_RECOVERED: u8 = 2;
const EVENT_ROOM: u8 = 4;

#[derive(Clone, Debug)]
struct Slot {
    state: SlotState,
    class: TenantClass,
    /// What the control plane sent; the rate below is derived from it and the device rates.
    terms: TenantRates,
    rate: [TokenRate; 2],
    rate_q32: [u64; 2],
    /// Negative millitokens: the balance may not fall below it by paying from itself.
    deficit_floor: i64,
    /// LC: what the tenant may still borrow from the bucket (millitokens); grows with its
    /// earnings at `loan_percent`, up to `-deficit_floor`.
    loan_allowance: i64,
    balance: i64,
    stamp: Nanos,
    frac: u32,
    queue: List,
    /// Queued requests (in either policy).
    queued: u32,
    /// Queued 4 KiB units: reads, writes (for BE demand).
    queued_units: [u64; 2],
    /// In `lc_list` or `be_list`.
    listed: bool,
    /// An LC tenant with an empty queue refilling to `park_limit`, waiting in `refills`.
    /// Neither listed nor parked (and Active): in the idle aggregate.
    parked: bool,
    park_limit: i64,
    in_episode: bool,
    /// Enqueue reported full; a QueueRoom event is owed.
    blocked: bool,
    events: u8,
    stats: TenantStats,
}

impl Slot {
    const VACANT: Slot = Slot {
        state: SlotState::Vacant,
        class: TenantClass::BestEffort,
        terms: TenantRates {
            tenant: TenantId(0),
            class: TenantClass::BestEffort,
            reserved_tokens_per_sec: [TokenRate::ZERO; 2],
            connections_here: 0,
            connections_total: 0,
            deficit_limit: Tokens::ZERO,
        },
        rate: [TokenRate::ZERO; 2],
        rate_q32: [0; 2],
        deficit_floor: 0,
        loan_allowance: 0,
        balance: 0,
        stamp: Nanos::ZERO,
        frac: 0,
        queue: List::EMPTY,
        queued: 0,
        queued_units: [0; 2],
        listed: false,
        parked: false,
        park_limit: 0,
        in_episode: false,
        blocked: false,
        events: 0,
        stats: TenantStats {
            submitted_requests: 0,
            submitted_tokens: Tokens::ZERO,
            generated_tokens: Tokens::ZERO,
            bucket_tokens: Tokens::ZERO,
            donated_tokens: Tokens::ZERO,
            deficit_episodes: 0,
            balance: Tokens::ZERO,
            queued_requests: 0,
        },
    };

    fn demand(&self, costs: &CostModel, mode: LoadMode) -> i64 {
        let read = costs.unit_cost(IoKind::Read, mode).0;
        let write = costs.unit_cost(IoKind::Write, mode).0;
        (self.queued_units[0] as i64) * read + (self.queued_units[1] as i64) * write
    }
}

/// Per-round context.
struct Round {
    now: Nanos,
    mode: LoadMode,
    /// Span of the last `surplus_rounds` rounds, for POS_LIMIT.
    surplus_span_ns: u64,
    device_full: bool,
    summary: RoundSummary,
    deadline: Option<Nanos>,
}

impl Round {
    fn wake_at(&mut self, at: Nanos) {
        self.deadline = Some(self.deadline.map_or(at, |d| d.min(at)));
    }
}

/// One thread's scheduler for one device. See the module documentation.
#[derive(Debug)]
pub struct Scheduler {
    shared: Arc<DeviceShared>,
    thread_index: u16,
    participating: bool,
    policy: Policy,
    tenant_queue_depth_max: u32,
    tenants_max: u32,
    donate_percent: i64,
    surplus_rounds: usize,
    costs: CostModel,
    lending: bool,
    loan_percent: i64,
    device_rates: Option<DeviceRates>,
    slots: Vec<Slot>,
    pool: Pool,
    /// QoS off: every queued request in arrival order.
    fifo: List,
    lc_list: Vec<u32>,
    be_list: Vec<u32>,
    /// Parked LC tenants by the time they are full.
    refills: TimerWheel,
    /// Scratch for tenants the wheel releases in a round.
    expired: Vec<u32>,
    scratch: Vec<u32>,
    lc_cursor: usize,
    be_cursor: usize,
    /// Σ rate of Active, unlisted tenants + unbound donations, per mode, Q32 per ns.
    idle_rate_q32: [u64; 2],
    unbound_rate_q32: [u64; 2],
    idle_stamp: Nanos,
    idle_frac: u32,
    pending_donation: i64,
    /// [`DeviceRates::spare_share_ppm`] in force.
    spare_share_ppm: u32,
    /// [`DeviceRates::be_floor_ppm`] in force.
    be_floor_ppm: u32,
    last_round: Nanos,
    round_times: [Nanos; ROUND_HISTORY_MAX],
    rounds_recorded: usize,
    deadline: Option<Nanos>,
    events: VecDeque<u32>,
    blocked: Vec<u32>,
    ledger: Ledger,
}

impl Scheduler {
    /// A scheduler for thread `thread_index` (< [`crate::config::THREADS_MAX`]) of the device
    /// whose shared state is `shared`. It joins the device's round-reset set at once. Allocates
    /// everything it will ever need here (node pool, lists), nothing per round.
    pub fn new(
        shared: Arc<DeviceShared>,
        thread_index: u16,
        config: &QosConfig,
        policy: Policy,
        now: Nanos,
    ) -> Result<Scheduler, ConfigError> {
        config.validate()?;
        let tenants_max = config.tenants_max;
        shared.join(thread_index);
        Ok(Scheduler {
            shared,
            thread_index,
            participating: true,
            policy,
            tenant_queue_depth_max: config.tenant_queue_depth_max,
            tenants_max,
            donate_percent: i64::from(config.donate_percent),
            surplus_rounds: usize::from(config.surplus_rounds),
            costs: CostModel {
                read: Tokens::ONE,
                write: Tokens::ONE,
                read_read_only: Tokens::ONE,
            },
            lending: false,
            loan_percent: i64::from(config.loan_percent),
            device_rates: None,
            slots: Vec::new(),
            pool: Pool::new(config.thread_queued_requests_max),
            fifo: List::EMPTY,
            lc_list: Vec::with_capacity(tenants_max as usize),
            refills: TimerWheel::new(now),
            expired: Vec::with_capacity(tenants_max as usize),
            be_list: Vec::with_capacity(tenants_max as usize),
            scratch: Vec::with_capacity(tenants_max as usize),
            lc_cursor: 0,
            be_cursor: 0,
            idle_rate_q32: [0; 2],
            unbound_rate_q32: [0; 2],
            idle_stamp: now,
            idle_frac: 0,
            pending_donation: 0,
            spare_share_ppm: SPARE_SHARE_ALL,
            be_floor_ppm: 0,
            last_round: now,
            round_times: [now; ROUND_HISTORY_MAX],
            rounds_recorded: 0,
            deadline: None,
            events: VecDeque::with_capacity(tenants_max as usize),
            blocked: Vec::with_capacity(tenants_max as usize),
            ledger: Ledger::default(),
        })
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    pub fn thread_index(&self) -> u16 {
        self.thread_index
    }

    pub fn device_rates(&self) -> Option<&DeviceRates> {
        self.device_rates.as_ref()
    }

    /// Applies one control message. Not on the hot path: it may touch every tenant of the
    /// thread (when the device rates change) and may grow the tenant table.
    pub fn apply(&mut self, update: RateUpdate, now: Nanos) {
        match update {
            RateUpdate::Device(rates) => self.apply_device(rates, now),
            RateUpdate::Tenant(rates) => self.apply_tenant(rates, now),
            RateUpdate::Remove(tenant) => self.remove_tenant(tenant, now),
        }
    }

    fn apply_device(&mut self, rates: DeviceRates, now: Nanos) {
        self.settle_idle(now);
        self.costs = rates.costs;
        self.lending = rates.loan_max.0 > 0;
        self.shared.set_limits(rates.bucket_max, rates.loan_max);
        assert!(
            rates.spare_share_ppm <= SPARE_SHARE_ALL,
            "spare share {} ppm",
            rates.spare_share_ppm
        );
        self.spare_share_ppm = rates.spare_share_ppm;
        assert!(
            rates.be_floor_ppm <= SPARE_SHARE_ALL,
            "best-effort floor {} ppm",
            rates.be_floor_ppm
        );
        self.be_floor_ppm = rates.be_floor_ppm;
        let unbound = [
            rates.unbound_tokens_per_sec[0].q32(),
            rates.unbound_tokens_per_sec[1].q32(),
        ];
        sub_rates(&mut self.idle_rate_q32, self.unbound_rate_q32);
        add_rates(&mut self.idle_rate_q32, unbound);
        self.unbound_rate_q32 = unbound;
        let previous = self.device_rates.replace(rates);
        if previous.is_some_and(|previous| same_tenant_terms(&previous, &rates)) {
            // Only the unbound donations or the bucket limits moved (a BIND, a close):
            // no tenant's effective rate changed, and a thread with thousands of tenants
            // need not walk them all.
            return;
        }
        // Every tenant's effective rate may have changed (O(tenants of this thread)). Retiring
        // tenants keep their last rate until their queue is empty.
        for index in 0..self.slots.len() {
            if self.slots[index].state == SlotState::Active {
                let terms = self.slots[index].terms;
                self.set_rates(index, effective_rates(&rates, &terms), now);
            }
        }
    }

    fn apply_tenant(&mut self, rates: TenantRates, now: Nanos) {
        let index = rates.tenant.0 as usize;
        assert!(
            rates.tenant.0 < self.tenants_max,
            "{} beyond tenants_max {}",
            rates.tenant,
            self.tenants_max
        );
        if self.slots.len() <= index {
            self.slots.resize(index + 1, Slot::VACANT);
            self.refills.ensure(index);
        }
        self.settle_idle(now);
        let slot = &mut self.slots[index];
        let new_tenant = slot.state == SlotState::Vacant;
        if new_tenant {
            // Starts at rate zero; `set_rates` below gives it its rate.
            *slot = Slot {
                state: SlotState::Active,
                class: rates.class,
                stamp: now,
                ..Slot::VACANT
            };
            if self.policy == Policy::Tokens && rates.class == TenantClass::LatencyCritical {
                // A new LC tenant starts empty and refills to POS_LIMIT in the list.
                slot.listed = true;
                self.lc_list.push(index as u32);
            }
        } else {
            // A class change moves the tenant between lists in the next round.
            slot.state = SlotState::Active;
            if slot.class != rates.class
                && rates.class == TenantClass::BestEffort
                && slot.balance < 0
            {
                // A best-effort tenant is never in deficit: the debt it ran up as a
                // latency-critical one is written off (its episode ends).
                self.ledger.written_off += Tokens(slot.balance);
                slot.balance = 0;
                if slot.in_episode {
                    slot.in_episode = false;
                    push_event(&mut self.events, slot, index, EVENT_RECOVERED);
                }
            }
            slot.class = rates.class;
        }
        slot.terms = rates;
        let floor_before = slot.deficit_floor;
        slot.deficit_floor = -rates.deficit_limit.0.max(0);
        if slot.deficit_floor > floor_before && slot.balance < slot.deficit_floor {
            // Burst room is time (`deficit_limit_us` of the tenant's own reservation): when a
            // cut shrinks the reservation, a debt run up at the old rate would hold the tenant
            // far longer than its room at the new one (seconds, after the slowdown of
            // docs/QOS.md §11). The part beyond the new limit is written off.
            self.ledger.written_off += Tokens(slot.balance - slot.deficit_floor);
            slot.balance = slot.deficit_floor;
        }
        if new_tenant {
            // A new tenant may borrow its full allowance at once.
            slot.loan_allowance = -slot.deficit_floor;
        }
        slot.loan_allowance = slot.loan_allowance.min(-slot.deficit_floor);
        let effective = self.device_rates.map_or([TokenRate::ZERO; 2], |device| {
            effective_rates(&device, &rates)
        });
        self.set_rates(index, effective, now);
    }

    /// Changes a tenant's rates at `now` (the idle aggregate must be settled up to `now`).
    fn set_rates(&mut self, index: usize, rates: RatePerMode, now: Nanos) {
        let new_q32 = [rates[0].q32(), rates[1].q32()];
        let mode = self.shared.load_mode(now);
        let slot = &mut self.slots[index];
        slot.rate = rates;
        if slot.rate_q32 == new_q32 {
            return;
        }
        if slot.listed || slot.parked {
            // Earn at the old rate up to now.
            let earned = accrue(
                slot.rate_q32[mode.index()],
                now.saturating_since(slot.stamp).0,
                &mut slot.frac,
            );
            slot.balance += earned;
            slot.stats.generated_tokens += Tokens(earned);
            self.ledger.generated += Tokens(earned);
            slot.stamp = now;
            if slot.parked {
                // Its refill time changes with its rate: let the next round re-park it.
                slot.parked = false;
                slot.listed = true;
                let removed = self.refills.remove(index);
                assert!(removed, "parked tenant {index} not in the wheel");
                self.lc_list.push(index as u32);
            }
        } else {
            sub_rates(&mut self.idle_rate_q32, slot.rate_q32);
            add_rates(&mut self.idle_rate_q32, new_q32);
        }
        self.slots[index].rate_q32 = new_q32;
    }

    fn remove_tenant(&mut self, tenant: TenantId, now: Nanos) {
        let Some(slot) = self.slots.get_mut(tenant.0 as usize) else {
            return;
        };
        if slot.state != SlotState::Active {
            return;
        }
        if slot.queued > 0 || slot.listed {
            // Served until its queue is empty; the round loops vacate it.
            slot.state = SlotState::Retiring;
            return;
        }
        self.settle_idle(now);
        self.vacate(tenant.0 as usize);
    }

    /// Frees a slot that is not listed and has nothing queued.
    fn vacate(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        assert_eq!(slot.queued, 0, "vacating a tenant with queued requests");
        assert!(!slot.listed, "vacating a listed tenant");
        if !slot.parked {
            sub_rates(&mut self.idle_rate_q32, slot.rate_q32);
        }
        self.ledger.written_off += Tokens(slot.balance);
        let events = slot.events;
        if slot.parked {
            self.refills.remove(index);
        }
        *slot = Slot::VACANT;
        // Pending events for a vacated tenant are dropped with it.
        if events != 0 {
            self.events.retain(|&t| t as usize != index);
        }
        self.blocked.retain(|&t| t as usize != index);
    }

    /// Donates the idle aggregate's tokens up to `now` (called before its rate changes).
    fn settle_idle(&mut self, now: Nanos) {
        if now <= self.idle_stamp {
            return;
        }
        if self.policy == Policy::Tokens {
            let mode = self.shared.load_mode(now);
            let earned = accrue(
                self.idle_rate_q32[mode.index()],
                now.0 - self.idle_stamp.0,
                &mut self.idle_frac,
            );
            self.ledger.generated += Tokens(earned);
            self.pending_donation += earned;
        }
        self.idle_stamp = now;
    }

    /// Queues a request for `tenant`. Never drops: when the tenant's queue (or the thread's
    /// pool) is full the request is refused and the caller keeps it, stops reading that
    /// connection, and resumes on [`SchedulerEvent::QueueRoom`].
    pub fn enqueue(
        &mut self,
        tenant: TenantId,
        request: Request,
        now: Nanos,
    ) -> Result<(), EnqueueError> {
        if request.size_bytes > REQUEST_BYTES_MAX {
            return Err(EnqueueError::TooLarge {
                size_bytes: request.size_bytes,
            });
        }
        let index = tenant.0 as usize;
        let active = self
            .slots
            .get(index)
            .is_some_and(|slot| slot.state == SlotState::Active);
        if !active {
            return Err(EnqueueError::UnknownTenant(tenant));
        }
        let full = if self.slots[index].queued >= self.tenant_queue_depth_max {
            Some(EnqueueError::TenantQueueFull {
                tenant,
                depth_max: self.tenant_queue_depth_max,
            })
        } else if self.pool.free_count() == 0 {
            Some(EnqueueError::ThreadQueueFull {
                tenant,
                queued_max: self.pool.capacity(),
            })
        } else {
            None
        };
        if let Some(error) = full {
            let slot = &mut self.slots[index];
            if !slot.blocked {
                slot.blocked = true;
                self.blocked.push(index as u32);
            }
            return Err(error);
        }
        let pushed = match self.policy {
            Policy::Tokens => {
                let slot = &mut self.slots[index];
                if slot.parked {
                    // Still refilling: it keeps its balance and accrual stamp.
                    slot.parked = false;
                    slot.listed = true;
                    let removed = self.refills.remove(index);
                    assert!(removed, "parked tenant {index} not in the wheel");
                    self.lc_list.push(index as u32);
                } else if !slot.listed {
                    self.settle_idle(now);
                    let slot = &mut self.slots[index];
                    sub_rates(&mut self.idle_rate_q32, slot.rate_q32);
                    slot.listed = true;
                    slot.stamp = now;
                    slot.frac = 0;
                    // Idle and full since it left the list: its allowance has refilled too.
                    slot.loan_allowance = -slot.deficit_floor;
                    match slot.class {
                        TenantClass::LatencyCritical => self.lc_list.push(index as u32),
                        TenantClass::BestEffort => self.be_list.push(index as u32),
                    }
                }
                let slot = &mut self.slots[index];
                self.pool.push_back(
                    &mut slot.queue,
                    request.token,
                    request.size_bytes,
                    request.kind,
                    tenant.0,
                )
            }
            Policy::Fifo => self.pool.push_back(
                &mut self.fifo,
                request.token,
                request.size_bytes,
                request.kind,
                tenant.0,
            ),
        };
        assert!(pushed, "pool had a free node a moment ago");
        let slot = &mut self.slots[index];
        slot.queued += 1;
        slot.queued_units[request.kind as usize] += u64::from(CostModel::units(request.size_bytes));
        Ok(())
    }

    /// One scheduling round at `now`: submits every admissible request through `submit`, which
    /// returns `false` when the device cannot take the request (it is put back and the round
    /// ends). Allocates nothing.
    pub fn schedule<F>(&mut self, now: Nanos, submit: &mut F) -> RoundSummary
    where
        F: FnMut(Admitted) -> bool,
    {
        let now = now.max(self.last_round).max(self.idle_stamp);
        let summary = match self.policy {
            Policy::Tokens => self.schedule_tokens(now, submit),
            Policy::Fifo => self.schedule_fifo(now, submit),
        };
        if !self.blocked.is_empty() {
            self.release_blocked();
        }
        summary
    }

    fn schedule_fifo<F>(&mut self, now: Nanos, submit: &mut F) -> RoundSummary
    where
        F: FnMut(Admitted) -> bool,
    {
        let mut summary = RoundSummary::default();
        let mut mode = self.shared.load_mode(now);
        while let Some(node) = self.pool.pop_front(&mut self.fifo) {
            let cost = self.costs.cost(node.kind, node.size_bytes, mode);
            let admitted = admitted(&node, cost, self.slots[node.tenant as usize].class);
            if !submit(admitted) {
                let ok = self.pool.push_front(&mut self.fifo, node);
                assert!(ok, "a node was freed a moment ago");
                summary.device_full = true;
                break;
            }
            if node.kind == IoKind::Write {
                self.shared.note_write(now);
                mode = LoadMode::Mixed;
            }
            let slot = &mut self.slots[node.tenant as usize];
            dequeued(slot, &node);
            slot.stats.submitted_requests += 1;
            slot.stats.submitted_tokens += cost;
            summary.submitted += 1;
            summary.tokens_spent += cost;
            if slot.state == SlotState::Retiring && slot.queued == 0 {
                self.vacate_retired(node.tenant as usize);
            }
        }
        self.last_round = now;
        self.deadline = None;
        summary
    }

    /// Takes every queued request out without admitting or charging it, handing each token to
    /// `cancelled` (per tenant, oldest first): the dataplane answers them with an error when a
    /// shutdown's drain times out. Balances are untouched; tenants left with empty queues
    /// leave the lists in the next round, and tenants refused for a full queue get their
    /// [`SchedulerEvent::QueueRoom`].
    pub fn cancel_queued(&mut self, cancelled: &mut impl FnMut(TenantId, u64)) {
        match self.policy {
            Policy::Tokens => {
                for index in 0..self.slots.len() {
                    let slot = &mut self.slots[index];
                    while let Some(node) = self.pool.pop_front(&mut slot.queue) {
                        dequeued(slot, &node);
                        cancelled(TenantId(node.tenant), node.request);
                    }
                }
            }
            Policy::Fifo => {
                while let Some(node) = self.pool.pop_front(&mut self.fifo) {
                    let index = node.tenant as usize;
                    dequeued(&mut self.slots[index], &node);
                    cancelled(TenantId(node.tenant), node.request);
                    let slot = &self.slots[index];
                    if slot.state == SlotState::Retiring && slot.queued == 0 {
                        self.vacate_retired(index);
                    }
                }
            }
        }
        // Nothing waits for tokens any more.
        self.deadline = None;
        if !self.blocked.is_empty() {
            self.release_blocked();
        }
    }

    fn vacate_retired(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        if slot.listed {
            // Listed tenants are vacated by the round loops that own the lists.
            return;
        }
        self.vacate(index);
    }

    fn schedule_tokens<F>(&mut self, now: Nanos, submit: &mut F) -> RoundSummary
    where
        F: FnMut(Admitted) -> bool,
    {
        let mode = self.shared.load_mode(now);
        self.settle_idle(now);
        let surplus_span_ns = self.surplus_span(now);
        let mut round = Round {
            now,
            mode,
            surplus_span_ns,
            device_full: false,
            summary: RoundSummary::default(),
            deadline: None,
        };

        self.release_refills(&mut round);

        // LC subround.
        self.subround(TenantClass::LatencyCritical, &mut round, submit);
        // LC surplus becomes visible to BE tenants on every thread.
        self.flush_donations();
        // BE subround.
        self.subround(TenantClass::BestEffort, &mut round, submit);

        self.flush_donations();
        if self.participating {
            self.shared.finish_round(self.thread_index);
        }
        self.record_round(now);
        self.last_round = now;
        self.deadline = round.deadline;
        round.summary.device_full = round.device_full;
        #[cfg(debug_assertions)]
        self.check();
        round.summary
    }

    /// Serves every listed tenant of `class` once, round robin from a start that rotates
    /// every round; the tenants that stay listed form the list for the next round.
    #[inline(always)]
    fn subround<F>(&mut self, class: TenantClass, round: &mut Round, submit: &mut F)
    where
        F: FnMut(Admitted) -> bool,
    {
        let latency_critical = class == TenantClass::LatencyCritical;
        let (list, cursor) = if latency_critical {
            (&mut self.lc_list, self.lc_cursor)
        } else {
            (&mut self.be_list, self.be_cursor)
        };
        if list.is_empty() {
            return;
        }
        let list = std::mem::take(list);
        let start = cursor % list.len();
        let mut keep = std::mem::take(&mut self.scratch);
        keep.clear();
        for &index in list[start..].iter().chain(list[..start].iter()) {
            let stays = if latency_critical {
                self.serve_lc(index as usize, round, submit)
            } else {
                self.serve_be(index as usize, round, submit)
            };
            if stays {
                keep.push(index);
            }
        }
        self.scratch = list;
        if latency_critical {
            self.lc_list = keep;
            self.lc_cursor = self.lc_cursor.wrapping_add(1);
        } else {
            self.be_list = keep;
            self.be_cursor = self.be_cursor.wrapping_add(1);
        }
    }

    /// Serves one listed LC tenant; returns whether it stays listed.
    fn serve_lc<F>(&mut self, index: usize, round: &mut Round, submit: &mut F) -> bool
    where
        F: FnMut(Admitted) -> bool,
    {
        let slot = &mut self.slots[index];
        if slot.class != TenantClass::LatencyCritical {
            // The tenant changed class: it moves to the other list.
            self.be_list.push(index as u32);
            return false;
        }
        let earned = accrue(
            slot.rate_q32[round.mode.index()],
            round.now.saturating_since(slot.stamp).0,
            &mut slot.frac,
        );
        slot.stamp = round.now;
        slot.balance += earned;
        slot.loan_allowance =
            (slot.loan_allowance + earned * self.loan_percent / 100).min(-slot.deficit_floor);
        slot.stats.generated_tokens += Tokens(earned);
        self.ledger.generated += Tokens(earned);
        if slot.in_episode && slot.balance >= 0 {
            slot.in_episode = false;
            push_event(&mut self.events, slot, index, EVENT_RECOVERED);
        }

        while !round.device_full {
            let slot = &mut self.slots[index];
            let Some(head) = self.pool.front(&slot.queue) else {
                break;
            };
            let cost = self.costs.cost(head.kind, head.size_bytes, round.mode).0;
            let from_balance = slot.balance > slot.deficit_floor;
            if !from_balance {
                if !slot.in_episode {
                    slot.in_episode = true;
                    slot.stats.deficit_episodes += 1;
                    push_event(&mut self.events, slot, index, EVENT_LIMIT);
                }
                let lent = self.lending && self.lend(index, cost);
                if !lent {
                    let slot = &self.slots[index];
                    let need = slot.deficit_floor - slot.balance + 1;
                    if let Some(ns) =
                        time_to_earn(slot.rate_q32[round.mode.index()], need, slot.frac)
                    {
                        round.wake_at(Nanos(round.now.0.saturating_add(ns)));
                    }
                    break;
                }
            }
            let slot = &mut self.slots[index];
            let Some(node) = self.pool.pop_front(&mut slot.queue) else {
                break;
            };
            if from_balance {
                slot.balance -= cost;
            }
            if !submit(admitted(&node, Tokens(cost), TenantClass::LatencyCritical)) {
                let slot = &mut self.slots[index];
                let ok = self.pool.push_front(&mut slot.queue, node);
                assert!(ok, "a node was freed a moment ago");
                if from_balance {
                    slot.balance += cost;
                } else {
                    // Give the loan back where it came from.
                    self.pending_donation += cost;
                    slot.stats.donated_tokens += Tokens(cost);
                }
                round.device_full = true;
                break;
            }
            self.submitted(index, &node, cost, round);
        }

        let slot = &mut self.slots[index];
        let surplus_limit = amount_over(slot.rate_q32[round.mode.index()], round.surplus_span_ns);
        if slot.queued == 0 {
            if slot.state == SlotState::Retiring {
                slot.listed = false;
                self.idle_add(index);
                self.vacate(index);
                return false;
            }
            if slot.balance >= surplus_limit {
                // Idle and full: keep POS_LIMIT, everything beyond goes to the bucket from now on.
                let overflow = slot.balance - surplus_limit;
                slot.balance = surplus_limit;
                slot.stats.donated_tokens += Tokens(overflow);
                self.pending_donation += overflow;
                self.unlist(index, round.now);
                return false;
            }
            // Idle and refilling: wait in the heap until full, costing nothing per round.
            let rate_q32 = slot.rate_q32[round.mode.index()];
            let due = time_to_earn(rate_q32, surplus_limit - slot.balance, slot.frac)
                .map_or(Nanos::MAX, |ns| Nanos(round.now.0.saturating_add(ns)));
            slot.listed = false;
            slot.parked = true;
            slot.park_limit = surplus_limit;
            self.refills.insert(index, due);
            return false;
        } else if slot.balance > surplus_limit {
            let gift = slot.balance * self.donate_percent / 100;
            slot.balance -= gift;
            slot.stats.donated_tokens += Tokens(gift);
            self.pending_donation += gift;
        }
        true
    }

    /// Moves parked LC tenants that are full by `now` into the idle aggregate, donating what
    /// they earned beyond their POS_LIMIT since they became full.
    fn release_refills(&mut self, round: &mut Round) {
        if self.refills.len() == 0 {
            return;
        }
        let mut expired = std::mem::take(&mut self.expired);
        expired.clear();
        self.refills.expire(round.now, &mut expired);
        for &index in &expired {
            let index = index as usize;
            let slot = &mut self.slots[index];
            assert!(slot.parked, "wheel released unparked tenant {index}");
            let earned = accrue(
                slot.rate_q32[round.mode.index()],
                round.now.saturating_since(slot.stamp).0,
                &mut slot.frac,
            );
            slot.stamp = round.now;
            slot.balance += earned;
            slot.loan_allowance =
                (slot.loan_allowance + earned * self.loan_percent / 100).min(-slot.deficit_floor);
            slot.stats.generated_tokens += Tokens(earned);
            self.ledger.generated += Tokens(earned);
            if slot.in_episode && slot.balance >= 0 {
                slot.in_episode = false;
                push_event(&mut self.events, slot, index, EVENT_RECOVERED);
            }
            let slot = &mut self.slots[index];
            if slot.balance < slot.park_limit {
                // The load mode changed its rate meanwhile: wait a little longer.
                let due = time_to_earn(
                    slot.rate_q32[round.mode.index()],
                    slot.park_limit - slot.balance,
                    slot.frac,
                )
                .map_or(Nanos::MAX, |ns| Nanos(round.now.0.saturating_add(ns)));
                self.refills.insert(index, due);
                continue;
            }
            let overflow = slot.balance - slot.park_limit;
            slot.balance = slot.park_limit;
            slot.stats.donated_tokens += Tokens(overflow);
            self.pending_donation += overflow;
            slot.parked = false;
            self.idle_add(index);
            if self.slots[index].state == SlotState::Retiring {
                self.vacate(index);
            }
        }
        self.expired = expired;
    }

    /// Lends `cost` to an LC tenant at its deficit limit: first from donations this thread has
    /// not handed to the bucket yet, then from the global bucket (which may go into debt).
    fn lend(&mut self, index: usize, cost: i64) -> bool {
        if self.slots[index].loan_allowance < cost {
            return false;
        }
        let lent = if self.pending_donation >= cost {
            self.pending_donation -= cost;
            true
        } else if self.shared.borrow(Tokens(cost)) {
            self.ledger.from_bucket += Tokens(cost);
            true
        } else {
            false
        };
        if lent {
            let slot = &mut self.slots[index];
            slot.loan_allowance -= cost;
            slot.stats.bucket_tokens += Tokens(cost);
        }
        lent
    }

    /// Serves one listed BE tenant; returns whether it stays listed.
    fn serve_be<F>(&mut self, index: usize, round: &mut Round, submit: &mut F) -> bool
    where
        F: FnMut(Admitted) -> bool,
    {
        let slot = &mut self.slots[index];
        if slot.class != TenantClass::BestEffort {
            self.lc_list.push(index as u32);
            return false;
        }
        let mut earned = accrue(
            slot.rate_q32[round.mode.index()],
            round.now.saturating_since(slot.stamp).0,
            &mut slot.frac,
        );
        slot.stamp = round.now;
        slot.stats.generated_tokens += Tokens(earned);
        self.ledger.generated += Tokens(earned);
        // Loans to LC tenants are repaid from BE tenants' fresh tokens first, except the
        // best-effort floor's part of them.
        let debt = self.shared.debt().0;
        let owed = earned - parts_per_million(earned, self.be_floor_ppm);
        if debt > 0 && owed > 0 {
            let repay = debt.min(owed);
            self.shared.deposit(Tokens(repay));
            self.ledger.to_bucket += Tokens(repay);
            slot.stats.donated_tokens += Tokens(repay);
            earned -= repay;
        }
        slot.balance += earned;
        let shortfall = slot.demand(&self.costs, round.mode) - slot.balance;
        if shortfall > 0 && !round.device_full {
            let got = self.shared.claim(Tokens(shortfall)).0;
            slot.balance += got;
            slot.stats.bucket_tokens += Tokens(got);
            self.ledger.from_bucket += Tokens(got);
        }

        while !round.device_full {
            let slot = &mut self.slots[index];
            let Some(head) = self.pool.front(&slot.queue) else {
                break;
            };
            let cost = self.costs.cost(head.kind, head.size_bytes, round.mode).0;
            if cost > slot.balance {
                let need = cost - slot.balance;
                if let Some(ns) = time_to_earn(slot.rate_q32[round.mode.index()], need, slot.frac) {
                    round.wake_at(Nanos(round.now.0.saturating_add(ns)));
                }
                break;
            }
            let Some(node) = self.pool.pop_front(&mut slot.queue) else {
                break;
            };
            slot.balance -= cost;
            if !submit(admitted(&node, Tokens(cost), TenantClass::BestEffort)) {
                let slot = &mut self.slots[index];
                let ok = self.pool.push_front(&mut slot.queue, node);
                assert!(ok, "a node was freed a moment ago");
                slot.balance += cost;
                round.device_full = true;
                break;
            }
            self.submitted(index, &node, cost, round);
        }

        let slot = &mut self.slots[index];
        assert!(slot.balance >= 0, "BE tenant {index} in deficit");
        if slot.queued == 0 {
            // No accumulation while idle: leftovers go to the bucket.
            let leftover = slot.balance;
            slot.balance = 0;
            slot.stats.donated_tokens += Tokens(leftover);
            self.pending_donation += leftover;
            if slot.state == SlotState::Retiring {
                slot.listed = false;
                self.idle_add(index);
                self.vacate(index);
            } else {
                self.unlist(index, round.now);
            }
            return false;
        }
        true
    }

    fn submitted(&mut self, index: usize, node: &Node, cost: i64, round: &mut Round) {
        let slot = &mut self.slots[index];
        dequeued(slot, node);
        slot.stats.submitted_requests += 1;
        slot.stats.submitted_tokens += Tokens(cost);
        self.ledger.spent += Tokens(cost);
        round.summary.submitted += 1;
        round.summary.tokens_spent += Tokens(cost);
        if node.kind == IoKind::Write && round.mode == LoadMode::ReadOnly {
            // The rest of the round is charged as mixed load.
            round.mode = LoadMode::Mixed;
        }
        if node.kind == IoKind::Write {
            self.shared.note_write(round.now);
        }
    }

    /// Moves a listed tenant into the idle aggregate.
    fn unlist(&mut self, index: usize, now: Nanos) {
        // The aggregate has been settled up to this round's `now` at the round's start.
        debug_assert_eq!(self.idle_stamp, now);
        self.slots[index].listed = false;
        self.idle_add(index);
    }

    fn idle_add(&mut self, index: usize) {
        let slot = &self.slots[index];
        assert!(!slot.listed, "adding a listed tenant to the idle aggregate");
        assert!(!slot.parked, "adding a parked tenant to the idle aggregate");
        add_rates(&mut self.idle_rate_q32, slot.rate_q32);
    }

    /// Hands this round's donations to the bucket: what repays its loans in full, the rest at
    /// the spare share (the remainder is withheld: nobody spends it).
    fn flush_donations(&mut self) {
        if self.pending_donation > 0 {
            let amount = self.pending_donation;
            let kept = if self.spare_share_ppm == SPARE_SHARE_ALL {
                amount
            } else {
                let repay = self.shared.debt().0.min(amount);
                repay + parts_per_million(amount - repay, self.spare_share_ppm)
            };
            debug_assert!((0..=amount).contains(&kept));
            if kept > 0 {
                self.shared.deposit(Tokens(kept));
            }
            self.ledger.to_bucket += Tokens(kept);
            self.ledger.withheld += Tokens(amount - kept);
            self.pending_donation = 0;
        }
    }

    fn surplus_span(&self, now: Nanos) -> u64 {
        let oldest = if self.rounds_recorded >= self.surplus_rounds {
            self.round_times[(self.rounds_recorded - self.surplus_rounds) % ROUND_HISTORY_MAX]
        } else {
            self.round_times[0]
        };
        now.saturating_since(oldest).0
    }

    fn record_round(&mut self, now: Nanos) {
        let latest = if self.rounds_recorded == 0 {
            None
        } else {
            Some(self.round_times[(self.rounds_recorded - 1) % ROUND_HISTORY_MAX])
        };
        // Rounds at the same instant do not widen the surplus window.
        if latest != Some(now) {
            self.round_times[self.rounds_recorded % ROUND_HISTORY_MAX] = now;
            self.rounds_recorded += 1;
        }
    }

    fn release_blocked(&mut self) {
        let pool_room = self.pool.free_count() > 0;
        let depth_max = self.tenant_queue_depth_max;
        let mut i = 0;
        while i < self.blocked.len() {
            let index = self.blocked[i] as usize;
            let slot = &mut self.slots[index];
            if pool_room && slot.queued < depth_max {
                slot.blocked = false;
                push_event(&mut self.events, slot, index, EVENT_ROOM);
                self.blocked.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// The next event for the dataplane, if any. Events of one tenant that the dataplane has not
    /// polled yet are merged: a new deficit episode that starts before the previous one's
    /// recovery was polled continues that episode, so the control plane sees one notice.
    pub fn poll_event(&mut self) -> Option<SchedulerEvent> {
        loop {
            let &index = self.events.front()?;
            let slot = &mut self.slots[index as usize];
            let tenant = TenantId(index);
            let event = if slot.events & EVENT_LIMIT != 0 {
                slot.events &= !EVENT_LIMIT;
                Some(SchedulerEvent::DeficitLimitReached { tenant })
            } else if slot.events & EVENT_RECOVERED != 0 {
                slot.events &= !EVENT_RECOVERED;
                Some(SchedulerEvent::DeficitRecovered { tenant })
            } else if slot.events & EVENT_ROOM != 0 {
                slot.events &= !EVENT_ROOM;
                Some(SchedulerEvent::QueueRoom { tenant })
            } else {
                None
            };
            if slot.events == 0 {
                self.events.pop_front();
            }
            if event.is_some() {
                return event;
            }
        }
    }

    /// When a tenant waiting for tokens will be able to pay (the earliest), so a blocking loop
    /// knows when to wake; `None` if nothing waits on tokens (only on arrivals, completions, or
    /// the device). Calling [`Scheduler::schedule`] early is harmless.
    pub fn next_deadline(&self) -> Option<Nanos> {
        self.deadline
    }

    /// Leaves (or rejoins) the device's round-reset set, e.g. while the thread sleeps in its
    /// ring for a long time, so the global bucket keeps being reset by the others.
    pub fn set_participating(&mut self, participating: bool) {
        if participating == self.participating {
            return;
        }
        self.participating = participating;
        if participating {
            self.shared.join(self.thread_index);
        } else {
            self.shared.leave(self.thread_index);
        }
    }

    /// Requests this thread holds for the tenants of `class` (self-calibration's view of
    /// whether squeezed LC tenants slowed down).
    pub fn queued_in_class(&self, class: TenantClass) -> u64 {
        self.slots
            .iter()
            .filter(|slot| slot.class == class)
            .map(|slot| u64::from(slot.queued))
            .sum()
    }

    /// Requests this thread holds for `tenant`.
    pub fn queued(&self, tenant: TenantId) -> u32 {
        self.slots
            .get(tenant.0 as usize)
            .map_or(0, |slot| slot.queued)
    }

    /// The class this thread knows `tenant` by (`None`: not registered here).
    pub fn tenant_class(&self, tenant: TenantId) -> Option<TenantClass> {
        let slot = self.slots.get(tenant.0 as usize)?;
        (slot.state != SlotState::Vacant).then_some(slot.class)
    }

    pub fn tenant_stats(&self, tenant: TenantId) -> Option<TenantStats> {
        let slot = self.slots.get(tenant.0 as usize)?;
        (slot.state != SlotState::Vacant).then_some(TenantStats {
            balance: Tokens(slot.balance),
            queued_requests: slot.queued,
            ..slot.stats
        })
    }

    pub fn ledger(&self) -> Ledger {
        let held: i64 = self
            .slots
            .iter()
            .filter(|slot| slot.state != SlotState::Vacant)
            .map(|slot| slot.balance)
            .sum();
        Ledger {
            held: Tokens(held + self.pending_donation),
            ..self.ledger
        }
    }

    /// Checks the scheduler's invariants in O(tenants): token conservation, the idle
    /// aggregate's rate, list membership and queue counts. Panics with the broken invariant.
    pub fn check(&self) {
        let ledger = self.ledger();
        assert_eq!(
            ledger.generated + ledger.from_bucket,
            ledger.spent + ledger.to_bucket + ledger.withheld + ledger.written_off + ledger.held,
            "token conservation broken: {ledger:?}"
        );
        let mut idle = self.unbound_rate_q32;
        let mut queued_total = 0u32;
        for (index, slot) in self.slots.iter().enumerate() {
            if slot.state == SlotState::Vacant {
                continue;
            }
            queued_total += slot.queued;
            if slot.class == TenantClass::BestEffort && slot.listed {
                assert!(slot.balance >= 0, "BE tenant {index} in deficit");
            }
            let in_lists = self.lc_list.contains(&(index as u32)) as u32
                + self.be_list.contains(&(index as u32)) as u32;
            if self.policy == Policy::Tokens {
                assert_eq!(
                    in_lists,
                    u32::from(slot.listed),
                    "tenant {index} list membership"
                );
                assert_eq!(slot.queue.len(), slot.queued, "tenant {index} queue count");
                assert!(
                    !(slot.listed && slot.parked),
                    "tenant {index} listed and parked"
                );
                if !slot.listed {
                    assert_eq!(slot.queued, 0, "idle tenant {index} has queued requests");
                }
                assert_eq!(
                    slot.parked,
                    self.refills.contains(index),
                    "tenant {index} parking"
                );
                if slot.parked {
                    assert_eq!(
                        slot.class,
                        TenantClass::LatencyCritical,
                        "parked BE tenant {index}"
                    );
                } else if !slot.listed {
                    add_rates(&mut idle, slot.rate_q32);
                }
            }
        }
        if self.policy == Policy::Tokens {
            assert_eq!(idle, self.idle_rate_q32, "idle aggregate rate");
        } else {
            assert_eq!(self.fifo.len(), queued_total, "FIFO count");
        }
        assert_eq!(
            self.pool.capacity() - self.pool.free_count(),
            queued_total,
            "pool nodes in use"
        );
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        if self.participating {
            self.shared.leave(self.thread_index);
        }
    }
}

/// Adds per-mode Q32 rates (the idle aggregate is such a sum).
/// `ppm` parts per million of `tokens` (0 to [`SPARE_SHARE_ALL`]), rounded down.
fn parts_per_million(tokens: i64, ppm: u32) -> i64 {
    debug_assert!(ppm <= SPARE_SHARE_ALL);
    (i128::from(tokens) * i128::from(ppm) / i128::from(SPARE_SHARE_ALL)) as i64
}

fn add_rates(sum: &mut [u64; 2], rates: [u64; 2]) {
    for (total, rate) in sum.iter_mut().zip(rates) {
        *total += rate;
    }
}

fn sub_rates(sum: &mut [u64; 2], rates: [u64; 2]) {
    for (total, rate) in sum.iter_mut().zip(rates) {
        assert!(*total >= rate, "idle aggregate rate below a member's rate");
        *total -= rate;
    }
}

fn admitted(node: &Node, cost: Tokens, class: TenantClass) -> Admitted {
    Admitted {
        tenant: TenantId(node.tenant),
        class,
        token: node.request,
        size_bytes: node.size_bytes,
        kind: node.kind,
        cost,
    }
}

fn dequeued(slot: &mut Slot, node: &Node) {
    assert!(slot.queued > 0, "dequeued from an empty tenant");
    slot.queued -= 1;
    let units = u64::from(CostModel::units(node.size_bytes));
    let kind = node.kind as usize;
    assert!(slot.queued_units[kind] >= units, "queued units out of step");
    slot.queued_units[kind] -= units;
}

fn push_event(events: &mut VecDeque<u32>, slot: &mut Slot, index: usize, event: u8) {
    let before = slot.events;
    match event {
        EVENT_LIMIT if before & EVENT_RECOVERED != 0 => {
            // The recovery was not polled yet: the episode just continues.
            slot.events &= !EVENT_RECOVERED;
        }
        _ => slot.events |= event,
    }
    if before == 0 && slot.events != 0 {
        events.push_back(index as u32);
    }
}

/// Whether `a` and `b` give every tenant the same effective rate: `effective_rates` reads only
/// these fields.
fn same_tenant_terms(a: &DeviceRates, b: &DeviceRates) -> bool {
    a.device_tokens_per_sec == b.device_tokens_per_sec
        && a.lc_reserved_tokens_per_sec == b.lc_reserved_tokens_per_sec
        && a.be_tokens_per_sec_each == b.be_tokens_per_sec_each
        && a.lc_boost_tokens_per_sec_each == b.lc_boost_tokens_per_sec_each
}
