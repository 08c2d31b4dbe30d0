//! NVMe submission-queue arbitration: which waiting command the controller fetches next when a
//! command slot frees up.
//!
//! Three policies, as in the NVMe base specification and Gugnani et al.:
//! - **Round robin**: every submission queue takes turns, up to `burst` commands per turn,
//!   whatever its class.
//! - **Weighted round robin**: the urgent class is served strictly first; the high, medium and
//!   low classes then share the device in rounds, each class fetching at most its weight in
//!   *commands* per round (a class with fewer waiting commands leaves the rest of the round to
//!   the others, so the scheme is work conserving). Inside a class, queues take turns with up to
//!   `burst` commands each.
//! - **Deficit round robin**: urgent first, then the other queues take turns; on its turn a
//!   queue earns its class's quantum of *bytes* and fetches commands while they fit, so
//!   bandwidth (not command count) follows the weights when request sizes differ.
//!
//! The arbiter owns the submission queues (bounded FIFOs) and is pure: no time, no I/O.
//! Invariant: `pending[class]` equals the number of commands in that class's queues.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// NVMe priority classes for weighted arbitration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PriorityClass {
    Urgent,
    High,
    Medium,
    Low,
}

impl PriorityClass {
    pub const ALL: [PriorityClass; 4] = [
        PriorityClass::Urgent,
        PriorityClass::High,
        PriorityClass::Medium,
        PriorityClass::Low,
    ];

    fn index(self) -> usize {
        match self {
            PriorityClass::Urgent => 0,
            PriorityClass::High => 1,
            PriorityClass::Medium => 2,
            PriorityClass::Low => 3,
        }
    }

    /// The submission queue a dataplane uses for requests of this class: [`crate::emu::EmuFlash`]
    /// puts queues 0–3 in the four classes, so a connection's class (from its tenant or the
    /// client's `ionice`) reaches the arbiter as a queue number.
    pub const fn submission_queue(self) -> u16 {
        match self {
            PriorityClass::Urgent => 0,
            PriorityClass::High => 1,
            PriorityClass::Medium => 2,
            PriorityClass::Low => 3,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PriorityClass::Urgent => "urgent",
            PriorityClass::High => "high",
            PriorityClass::Medium => "medium",
            PriorityClass::Low => "low",
        }
    }
}

/// Linux I/O priority classes (`ioprio_get(2)`, the value `ionice` sets).
pub const IOPRIO_CLASS_NONE: u16 = 0;
pub const IOPRIO_CLASS_RT: u16 = 1;
pub const IOPRIO_CLASS_BE: u16 = 2;
pub const IOPRIO_CLASS_IDLE: u16 = 3;
/// The class sits above this many bits of level data.
pub const IOPRIO_CLASS_SHIFT: u16 = 13;
/// Levels 0 (most important) to 7 in the RT and BE classes.
pub const IOPRIO_LEVEL_MAX: u16 = 7;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum IoprioError {
    #[error("I/O priority class {class} is not one of none/rt/be/idle (0-3)")]
    UnknownClass { class: u16 },
    #[error("I/O priority level {level} is above 7")]
    LevelTooHigh { level: u16 },
}

/// Maps a Linux I/O priority value (`class << 13 | level`) to an NVMe priority class, so a
/// client's `ionice` setting chooses its class without application changes (Gugnani et al. §V):
/// RT → urgent; BE levels 0–2 → high, 3–5 → medium, 6–7 → low; IDLE → low. NONE (no explicit
/// priority) behaves like the kernel's default BE level 4 → medium.
pub fn class_from_ioprio(ioprio: u16) -> Result<PriorityClass, IoprioError> {
    let class = ioprio >> IOPRIO_CLASS_SHIFT;
    let level = ioprio & ((1 << IOPRIO_CLASS_SHIFT) - 1);
    if level > IOPRIO_LEVEL_MAX {
        return Err(IoprioError::LevelTooHigh { level });
    }
    match class {
        IOPRIO_CLASS_NONE => Ok(PriorityClass::Medium),
        IOPRIO_CLASS_RT => Ok(PriorityClass::Urgent),
        IOPRIO_CLASS_BE => Ok(match level {
            0..=2 => PriorityClass::High,
            3..=5 => PriorityClass::Medium,
            _ => PriorityClass::Low,
        }),
        IOPRIO_CLASS_IDLE => Ok(PriorityClass::Low),
        _ => Err(IoprioError::UnknownClass { class }),
    }
}

/// Per-class weights of the high, medium and low classes (commands for WRR, bytes for DRR).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassWeights {
    pub high: u32,
    pub medium: u32,
    pub low: u32,
}

impl ClassWeights {
    fn get(&self, class_index: usize) -> u64 {
        match class_index {
            1 => u64::from(self.high),
            2 => u64::from(self.medium),
            _ => u64::from(self.low),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
pub enum ArbitrationPolicy {
    RoundRobin,
    WeightedRoundRobin {
        /// Commands per round.
        weights: ClassWeights,
    },
    DeficitRoundRobin {
        /// Bytes per round.
        quantum_bytes: ClassWeights,
    },
}

/// How the device arbitrates and which class each submission queue belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArbitrationConfig {
    #[serde(flatten)]
    pub policy: ArbitrationPolicy,
    /// Commands fetched from one queue per turn (NVMe "arbitration burst").
    pub burst: u32,
    /// Class of queue `i`; queues beyond the list get `default_class`.
    #[serde(default)]
    pub queue_classes: Vec<PriorityClass>,
    #[serde(default = "default_class")]
    pub default_class: PriorityClass,
}

fn default_class() -> PriorityClass {
    PriorityClass::Medium
}

impl Default for ArbitrationConfig {
    fn default() -> Self {
        ArbitrationConfig {
            policy: ArbitrationPolicy::RoundRobin,
            burst: 8,
            queue_classes: Vec::new(),
            default_class: default_class(),
        }
    }
}

/// Largest command the arbiter accepts (bounds the DRR catch-up loop).
pub const COMMAND_BYTES_MAX: u32 = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ArbiterError {
    #[error("submission queue {queue} does not exist (the device has {queue_count})")]
    NoSuchQueue { queue: u16, queue_count: u16 },
    #[error("submission queue {queue} is full ({entries_max} entries)")]
    QueueFull { queue: u16, entries_max: u32 },
    #[error("command of {bytes} bytes is larger than {COMMAND_BYTES_MAX}")]
    CommandTooLarge { bytes: u32 },
    #[error("invalid arbitration configuration: {0}")]
    Config(String),
}

/// A ring of queue indexes served in turn, with the arbitration burst.
#[derive(Debug, Default)]
struct Ring {
    members: Vec<u16>,
    cursor: usize,
    burst_left: u32,
}

/// Submission queues plus the arbitration state.
#[derive(Debug)]
pub struct Arbiter<T> {
    policy: ArbitrationPolicy,
    burst: u32,
    entries_max: u32,
    queues: Vec<VecDeque<(T, u32)>>,
    class_of: Vec<PriorityClass>,
    /// Rings per class (urgent, high, medium, low); round robin uses `all`.
    rings: [Ring; 4],
    all: Ring,
    pending: [u64; 4],
    /// WRR: commands left this round per class.
    allowance: [u64; 4],
    /// Class (1..=3) whose turn it is in WRR.
    current: usize,
    /// DRR: whether the queue whose turn it is already received its quantum.
    turn_started: bool,
    /// DRR: the non-urgent queues in turn order, and each queue's deficit in bytes.
    weighted: Ring,
    deficit: Vec<u64>,
    /// DRR: how many rounds the catch-up loop may run before every head fits.
    drr_rounds_max: u64,
}

impl<T> Arbiter<T> {
    pub fn new(
        config: &ArbitrationConfig,
        queue_count: u16,
        entries_max: u32,
    ) -> Result<Arbiter<T>, ArbiterError> {
        if config.burst == 0 {
            return Err(ArbiterError::Config("burst must be at least 1".into()));
        }
        if queue_count == 0 || entries_max == 0 {
            return Err(ArbiterError::Config(
                "queue_count and queue_entries_max must be at least 1".into(),
            ));
        }
        let mut drr_rounds_max = 0;
        match &config.policy {
            ArbitrationPolicy::RoundRobin => {}
            ArbitrationPolicy::WeightedRoundRobin { weights } => {
                if weights.high == 0 || weights.medium == 0 || weights.low == 0 {
                    return Err(ArbiterError::Config(
                        "WRR weights must be at least 1".into(),
                    ));
                }
            }
            ArbitrationPolicy::DeficitRoundRobin { quantum_bytes } => {
                let smallest = quantum_bytes
                    .high
                    .min(quantum_bytes.medium)
                    .min(quantum_bytes.low);
                if smallest == 0 {
                    return Err(ArbiterError::Config("DRR quanta must be at least 1".into()));
                }
                drr_rounds_max = u64::from(COMMAND_BYTES_MAX).div_ceil(u64::from(smallest)) + 1;
            }
        }
        if config.queue_classes.len() > usize::from(queue_count) {
            return Err(ArbiterError::Config(format!(
                "queue_classes lists {} queues but the device has {queue_count}",
                config.queue_classes.len()
            )));
        }
        let mut arbiter = Arbiter {
            policy: config.policy.clone(),
            burst: config.burst,
            entries_max,
            queues: (0..queue_count).map(|_| VecDeque::new()).collect(),
            class_of: Vec::with_capacity(usize::from(queue_count)),
            rings: Default::default(),
            all: Ring::default(),
            pending: [0; 4],
            allowance: [0; 4],
            current: 1,
            turn_started: false,
            weighted: Ring::default(),
            deficit: vec![0; usize::from(queue_count)],
            drr_rounds_max,
        };
        for queue in 0..queue_count {
            let class = config
                .queue_classes
                .get(usize::from(queue))
                .copied()
                .unwrap_or(config.default_class);
            arbiter.class_of.push(class);
            arbiter.rings[class.index()].members.push(queue);
            arbiter.all.members.push(queue);
        }
        arbiter.rebuild_weighted_ring();
        arbiter.refill_round();
        Ok(arbiter)
    }

    pub fn queue_count(&self) -> u16 {
        self.queues.len() as u16
    }

    pub fn class_of(&self, queue: u16) -> Option<PriorityClass> {
        self.class_of.get(usize::from(queue)).copied()
    }

    /// Moves a queue to another class. Commands already waiting in it move along.
    pub fn set_queue_class(
        &mut self,
        queue: u16,
        class: PriorityClass,
    ) -> Result<(), ArbiterError> {
        let Some(&old) = self.class_of.get(usize::from(queue)) else {
            return Err(self.no_such_queue(queue));
        };
        if old == class {
            return Ok(());
        }
        let waiting = self.queues[usize::from(queue)].len() as u64;
        let old_ring = &mut self.rings[old.index()];
        old_ring.members.retain(|&q| q != queue);
        old_ring.cursor = 0;
        old_ring.burst_left = 0;
        self.rings[class.index()].members.push(queue);
        self.pending[old.index()] -= waiting;
        self.pending[class.index()] += waiting;
        self.class_of[usize::from(queue)] = class;
        self.rebuild_weighted_ring();
        Ok(())
    }

    fn rebuild_weighted_ring(&mut self) {
        self.weighted.members = (0..self.queue_count())
            .filter(|&q| self.class_of[usize::from(q)] != PriorityClass::Urgent)
            .collect();
        self.weighted.cursor = 0;
        self.turn_started = false;
    }

    /// Commands waiting in all queues.
    pub fn waiting(&self) -> u64 {
        self.pending.iter().sum()
    }

    pub fn waiting_in(&self, queue: u16) -> usize {
        self.queues.get(usize::from(queue)).map_or(0, VecDeque::len)
    }

    /// Appends a command of `bytes` to submission queue `queue`.
    pub fn push(&mut self, queue: u16, item: T, bytes: u32) -> Result<(), ArbiterError> {
        if bytes > COMMAND_BYTES_MAX {
            return Err(ArbiterError::CommandTooLarge { bytes });
        }
        let entries_max = self.entries_max;
        let Some(sq) = self.queues.get_mut(usize::from(queue)) else {
            return Err(self.no_such_queue(queue));
        };
        if sq.len() >= entries_max as usize {
            return Err(ArbiterError::QueueFull { queue, entries_max });
        }
        sq.push_back((item, bytes));
        self.pending[self.class_of[usize::from(queue)].index()] += 1;
        Ok(())
    }

    /// The command the controller fetches next, with its queue, or `None` when all are empty.
    pub fn pop(&mut self) -> Option<(u16, T)> {
        if self.waiting() == 0 {
            return None;
        }
        let queue = match self.policy {
            ArbitrationPolicy::RoundRobin => {
                let waiting = self.waiting();
                take_turn(&mut self.all, &self.queues, self.burst, waiting)
            }
            _ if self.pending[0] > 0 => take_turn(
                &mut self.rings[0],
                &self.queues,
                self.burst,
                self.pending[0],
            ),
            ArbitrationPolicy::WeightedRoundRobin { .. } => self.pick_weighted(),
            ArbitrationPolicy::DeficitRoundRobin { .. } => self.pick_deficit(),
        };
        let queue = queue?;
        let (item, _) = self.queues[usize::from(queue)].pop_front()?;
        let class = self.class_of[usize::from(queue)].index();
        assert!(self.pending[class] > 0, "pending count out of step");
        self.pending[class] -= 1;
        Some((queue, item))
    }

    fn no_such_queue(&self, queue: u16) -> ArbiterError {
        ArbiterError::NoSuchQueue {
            queue,
            queue_count: self.queue_count(),
        }
    }

    fn refill_round(&mut self) {
        if let ArbitrationPolicy::WeightedRoundRobin { weights } = &self.policy {
            for class in 1..4 {
                self.allowance[class] = weights.get(class);
            }
        }
    }

    fn advance_class(&mut self) {
        self.current += 1;
        if self.current > 3 {
            self.current = 1;
            self.refill_round();
        }
    }

    fn pick_weighted(&mut self) -> Option<u16> {
        // Two full rounds always suffice: after a refill some class with work has credit.
        for _ in 0..8 {
            let class = self.current;
            if self.allowance[class] > 0 && self.pending[class] > 0 {
                self.allowance[class] -= 1;
                let pending = self.pending[class];
                return take_turn(&mut self.rings[class], &self.queues, self.burst, pending);
            }
            self.advance_class();
        }
        None
    }

    /// Deficit round robin over the non-urgent queues: on its turn a queue's deficit grows by
    /// its class's quantum and it sends head commands while they fit; an empty queue's deficit
    /// resets (Shreedhar & Varghese). Per-queue deficits make two queues of one class share
    /// bytes equally whatever their request sizes.
    fn pick_deficit(&mut self) -> Option<u16> {
        let ArbitrationPolicy::DeficitRoundRobin { quantum_bytes } = self.policy else {
            return None;
        };
        let count = self.weighted.members.len();
        if count == 0 {
            return None;
        }
        let iterations_max = count as u64 * (self.drr_rounds_max + 1) + 1;
        for _ in 0..iterations_max {
            let queue = self.weighted.members[self.weighted.cursor % count];
            let q = usize::from(queue);
            let Some(&(_, head_bytes)) = self.queues[q].front() else {
                self.deficit[q] = 0;
                self.next_weighted_turn();
                continue;
            };
            if !self.turn_started {
                self.deficit[q] += quantum_bytes.get(self.class_of[q].index());
                self.turn_started = true;
            }
            if u64::from(head_bytes) <= self.deficit[q] {
                self.deficit[q] -= u64::from(head_bytes);
                return Some(queue);
            }
            self.next_weighted_turn();
        }
        None
    }

    fn next_weighted_turn(&mut self) {
        self.weighted.cursor = (self.weighted.cursor + 1) % self.weighted.members.len().max(1);
        self.turn_started = false;
    }
}

/// Round robin over the ring's non-empty queues, staying on one queue for up to `burst`
/// commands. `ring_pending` (commands waiting in the ring's queues) lets the common case of a
/// single busy queue skip the scan over empty ones.
fn take_turn<T>(
    ring: &mut Ring,
    queues: &[VecDeque<(T, u32)>],
    burst: u32,
    ring_pending: u64,
) -> Option<u16> {
    let count = ring.members.len();
    if count == 0 {
        return None;
    }
    let current = ring.members[ring.cursor % count];
    let current_waiting = queues[usize::from(current)].len() as u64;
    if current_waiting > 0 && ring.burst_left > 0 {
        ring.burst_left -= 1;
        return Some(current);
    }
    if current_waiting > 0 && current_waiting == ring_pending {
        // The only queue with work: a new turn for it.
        ring.burst_left = burst - 1;
        return Some(current);
    }
    for step in 1..=count {
        let index = (ring.cursor + step) % count;
        let queue = ring.members[index];
        if !queues[usize::from(queue)].is_empty() {
            ring.cursor = index;
            ring.burst_left = burst - 1;
            return Some(queue);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(policy: ArbitrationPolicy, classes: &[PriorityClass]) -> ArbitrationConfig {
        ArbitrationConfig {
            policy,
            burst: 1,
            queue_classes: classes.to_vec(),
            default_class: PriorityClass::Medium,
        }
    }

    /// Keeps every queue backlogged with commands of the given sizes and counts what each gets.
    fn check(config: ArbitrationConfig, sizes: &[u32], fetches: usize) -> Vec<(usize, u64)> {
        let queue_count = sizes.len() as u16;
        let mut arbiter: Arbiter<()> = Arbiter::new(&config, queue_count, 64).unwrap();
        for (queue, &size) in sizes.iter().enumerate() {
            for _ in 0..64 {
                arbiter.push(queue as u16, (), size).unwrap();
            }
        }
        let mut served = vec![(0usize, 0u64); sizes.len()];
        for _ in 0..fetches {
            let (queue, ()) = arbiter.pop().unwrap();
            let q = usize::from(queue);
            served[q].0 += 1;
            served[q].1 += u64::from(sizes[q]);
            arbiter.push(queue, (), sizes[q]).unwrap();
        }
        served
    }

    #[test]
    fn round_robin_alternates() {
        let served = check(
            config(ArbitrationPolicy::RoundRobin, &[]),
            &[4096, 8192, 512],
            300,
        );
        assert_eq!(
            served.iter().map(|s| s.0).collect::<Vec<_>>(),
            vec![100, 100, 100]
        );
    }

    #[test]
    fn weighted_round_robin_counts_commands() {
        use PriorityClass::*;
        let weights = ClassWeights {
            high: 4,
            medium: 2,
            low: 1,
        };
        let served = check(
            config(
                ArbitrationPolicy::WeightedRoundRobin { weights },
                &[High, Medium, Low],
            ),
            &[4096, 8192, 4096],
            700,
        );
        assert_eq!(
            served.iter().map(|s| s.0).collect::<Vec<_>>(),
            vec![400, 200, 100]
        );
    }

    #[test]
    fn deficit_round_robin_counts_bytes() {
        use PriorityClass::*;
        let quantum_bytes = ClassWeights {
            high: 16384,
            medium: 8192,
            low: 4096,
        };
        let served = check(
            config(
                ArbitrationPolicy::DeficitRoundRobin { quantum_bytes },
                &[High, Medium, Low],
            ),
            &[4096, 8192, 16384],
            7 * 100,
        );
        // Per round: high 4 x 4 KiB, medium 1 x 8 KiB, low one 16 KiB command every 4 rounds.
        let bytes: Vec<u64> = served.iter().map(|s| s.1).collect();
        assert!(
            (bytes[0] as f64 / bytes[1] as f64 - 2.0).abs() < 0.02,
            "{served:?}"
        );
        assert!(
            (bytes[1] as f64 / bytes[2] as f64 - 2.0).abs() < 0.1,
            "{served:?}"
        );
    }

    #[test]
    fn urgent_goes_first_and_burst_holds() {
        use PriorityClass::*;
        let weights = ClassWeights {
            high: 8,
            medium: 8,
            low: 8,
        };
        let mut cfg = config(
            ArbitrationPolicy::WeightedRoundRobin { weights },
            &[High, Urgent],
        );
        cfg.burst = 4;
        let mut arbiter: Arbiter<u32> = Arbiter::new(&cfg, 3, 16).unwrap();
        for i in 0..8 {
            arbiter.push(0, i, 4096).unwrap();
        }
        arbiter.push(1, 100, 4096).unwrap();
        assert_eq!(arbiter.pop(), Some((1, 100)));
        assert_eq!(arbiter.pop(), Some((0, 0)));
        assert_eq!(arbiter.waiting(), 7);
        assert_eq!(
            arbiter.push(5, 0, 4096),
            Err(ArbiterError::NoSuchQueue {
                queue: 5,
                queue_count: 3
            })
        );
    }

    #[test]
    fn ioprio_mapping() {
        let value = |class: u16, level: u16| (class << IOPRIO_CLASS_SHIFT) | level;
        assert_eq!(class_from_ioprio(value(1, 0)), Ok(PriorityClass::Urgent));
        assert_eq!(class_from_ioprio(value(2, 0)), Ok(PriorityClass::High));
        assert_eq!(class_from_ioprio(value(2, 4)), Ok(PriorityClass::Medium));
        assert_eq!(class_from_ioprio(value(2, 7)), Ok(PriorityClass::Low));
        assert_eq!(class_from_ioprio(value(3, 0)), Ok(PriorityClass::Low));
        assert_eq!(class_from_ioprio(0), Ok(PriorityClass::Medium));
        assert_eq!(
            class_from_ioprio(value(2, 9)),
            Err(IoprioError::LevelTooHigh { level: 9 })
        );
        assert_eq!(
            class_from_ioprio(value(5, 0)),
            Err(IoprioError::UnknownClass { class: 5 })
        );
    }
}
