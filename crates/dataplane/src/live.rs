//! Live figures for the control plane: each dataplane thread publishes a snapshot of its
//! cumulative counters at most every [`PUBLISH_INTERVAL`], and the control plane (the admin
//! API's thread) turns successive snapshots into windows (rates, quantiles, SLO attainment).
//!
//! Why snapshots swapped under a lock rather than shared atomics: the figures a window needs
//! (per-tenant latency histograms, token ledgers, batch sizes) are too many to keep as atomics
//! on the data path, and the control plane needs a consistent view of one thread. So the
//! thread keeps plain counters, and at housekeeping rate (every 100 ms while it has
//! connections, and once more before it goes idle) builds a [`ThreadSnapshot`] and swaps it
//! into its slot of the [`LiveBoard`]: one uncontended lock per thread per 100 ms, never per
//! request. Everything in a snapshot is cumulative since the thread started (counters only
//! grow; a reader subtracts two snapshots for a window), so a missed publication loses no
//! event, and a thread that sleeps idle needs to publish nothing.

use std::sync::{Arc, Mutex};

use reflex_qos::{
    FairMode, FairQueueStats, FairnessPolicy, FlowReport, Ledger, Nanos, TenantClass,
};

use crate::telemetry::LatencyHistogram;

/// How often a thread with connections publishes its snapshot.
pub const PUBLISH_INTERVAL: Nanos = Nanos(100_000_000);

/// Buckets of the batch-size histogram: completions per loop iteration of 0, 1, 2–3, 4–7,
/// …, 64 and more.
pub const BATCH_BUCKETS: usize = 8;

const _: () = assert!(1usize << (BATCH_BUCKETS - 2) == crate::core::BATCH_MAX);

/// The bucket of a batch of `completions`.
pub fn batch_bucket(completions: u64) -> usize {
    if completions == 0 {
        return 0;
    }
    let bits = 64 - completions.leading_zeros() as usize;
    bits.min(BATCH_BUCKETS - 1)
}

/// The smallest batch a bucket counts (its label).
pub fn batch_bucket_floor(bucket: usize) -> u64 {
    if bucket == 0 { 0 } else { 1u64 << (bucket - 1) }
}

/// One tenant's cumulative figures on one thread.
#[derive(Debug, Clone, Default)]
pub struct TenantSnapshot {
    pub handle: u64,
    pub namespace_id: u32,
    /// `None` when the thread's scheduler does not know the tenant (any more).
    pub class: Option<TenantClass>,
    /// Requests received for it.
    pub arrivals: u64,
    /// Device operations the scheduler admitted for it, by kind, and their bytes (a request
    /// of several parts counts each; FLUSH and TRIM count as writes, as the cost model does).
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    /// Read latency, arrival off the socket to the answer leaving.
    pub read_latency: LatencyHistogram,
    /// Tokens, in millitokens: charged for its requests, earned from its own rate, taken from
    /// the global bucket, and given to it.
    pub millitokens_spent: i64,
    pub millitokens_earned: i64,
    pub millitokens_from_bucket: i64,
    pub millitokens_donated: i64,
    /// Deficit episodes that started here, and the time spent in them (an open episode
    /// counts up to the snapshot).
    pub deficit_episodes: u64,
    pub deficit_ns: u64,
    /// Requests waiting in the scheduler now.
    pub queued: u32,
    /// Requests refused by access control, by [`crate::access::Refusal::index`].
    pub refusals: [u64; crate::access::Refusal::COUNT],
}

/// One listener on one thread: the connections it refused, by
/// [`crate::core::AcceptRefused::index`] (listener `i` is the same port on every thread).
#[derive(Debug, Clone, Default)]
pub struct ListenerSnapshot {
    pub name: String,
    pub refused: [u64; crate::core::AcceptRefused::COUNT],
}

/// One flow (a tenant) of a fairness stage: its requests waiting in the stage and at the
/// device now, and the monitor's figures for it in the last window (`None` when it had too
/// few requests there to be judged).
#[derive(Debug, Clone)]
pub struct FairFlowSnapshot {
    /// The tenant's handle (0: the namespace's default tenant, or one this thread no longer
    /// knows).
    pub handle: u64,
    pub held: u32,
    pub device_in_flight: u32,
    pub last_window: Option<FlowReport>,
}

/// The monitor's last window on one thread's stage.
#[derive(Debug, Clone, Copy)]
pub struct FairWindowSnapshot {
    /// When it closed (the dataplane's clock; compare with [`ThreadSnapshot::at`]).
    pub end: Nanos,
    /// F = min S / max S over the flows judged.
    pub fairness: f64,
    /// Share of the window the device had at least one of the stage's requests.
    pub utilisation: f64,
    pub unfair: bool,
    pub policy: FairnessPolicy,
}

/// One namespace's fairness stage on one thread (`reflex_qos::fair_queue`): what it holds
/// now, its counters since the thread started, and its monitor's last window. Published even
/// when the stage is off (mode `Off`, everything zero), so readers need no special case.
#[derive(Debug, Clone, Default)]
pub struct FairnessSnapshot {
    pub mode: FairMode,
    pub held: u32,
    pub device_in_flight: u32,
    /// The places the stage uses at the device now (adaptive depth), and its maximum.
    pub depth: u32,
    pub depth_max: u32,
    pub stats: FairQueueStats,
    pub last_window: Option<FairWindowSnapshot>,
    /// Bounded by the namespace's tenants on this thread.
    pub flows: Vec<FairFlowSnapshot>,
}

/// One namespace on one thread.
#[derive(Debug, Clone, Default)]
pub struct NamespaceSnapshot {
    pub namespace_id: u32,
    /// Device operations of this thread outstanding on the namespace's device now.
    pub device_in_flight: u32,
    /// Device operations completed, and their device time (submission to completion).
    pub device_operations: u64,
    pub device_ns: u64,
    /// Read latency of every tenant.
    pub read_latency: LatencyHistogram,
    /// The thread's token ledger for the namespace's scheduler.
    pub ledger: Ledger,
    pub fairness: FairnessSnapshot,
}

/// Everything one thread publishes.
#[derive(Debug, Clone, Default)]
pub struct ThreadSnapshot {
    pub thread_index: usize,
    /// The dataplane's clock at publication.
    pub at: Nanos,
    pub iterations: u64,
    pub completions: u64,
    /// Loop iterations by completions handled ([`batch_bucket`]).
    pub batch_sizes: [u64; BATCH_BUCKETS],
    /// Time the driver slept or found nothing to do, and time it worked (cumulative).
    pub idle_ns: u64,
    pub busy_ns: u64,
    pub connections_open: u32,
    pub connections_accepted: u64,
    pub requests_answered: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub control_messages: u64,
    pub notices_sent: u64,
    /// TLS sessions started, and those refused or broken (`core/tls.rs`).
    pub tls_sessions: u64,
    pub tls_failures: u64,
    /// Inter-core migration (`core/migration.rs`): reads this thread handed to others, reads
    /// of others it served, and reads of others it answered with an error.
    pub migrated_sent: u64,
    pub migrated_served: u64,
    pub migrated_refused: u64,
    pub namespaces: Vec<NamespaceSnapshot>,
    pub tenants: Vec<TenantSnapshot>,
    pub listeners: Vec<ListenerSnapshot>,
}

/// The slots threads publish into; shared by the control plane and every thread.
pub struct LiveBoard {
    slots: Box<[Mutex<Option<Arc<ThreadSnapshot>>>]>,
}

impl std::fmt::Debug for LiveBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveBoard")
            .field("threads", &self.slots.len())
            .finish()
    }
}

impl LiveBoard {
    pub fn new(threads: usize) -> LiveBoard {
        LiveBoard {
            slots: (0..threads).map(|_| Mutex::new(None)).collect(),
        }
    }

    pub fn threads(&self) -> usize {
        self.slots.len()
    }

    /// Replaces `thread`'s snapshot (the old one is dropped by whoever holds it last).
    pub fn publish(&self, thread: usize, snapshot: ThreadSnapshot) {
        let snapshot = Arc::new(snapshot);
        let mut slot = self.slots[thread]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *slot = Some(snapshot);
    }

    /// The latest snapshot of every thread that published one.
    pub fn read(&self) -> Vec<Arc<ThreadSnapshot>> {
        self.slots
            .iter()
            .filter_map(|slot| {
                slot.lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .clone()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_buckets_are_powers_of_two() {
        assert_eq!(batch_bucket(0), 0);
        assert_eq!(batch_bucket(1), 1);
        assert_eq!(batch_bucket(2), 2);
        assert_eq!(batch_bucket(3), 2);
        assert_eq!(batch_bucket(4), 3);
        assert_eq!(batch_bucket(63), 6);
        assert_eq!(batch_bucket(64), 7);
        assert_eq!(batch_bucket(1000), 7);
        for bucket in 1..BATCH_BUCKETS {
            assert_eq!(batch_bucket(batch_bucket_floor(bucket)), bucket);
        }
    }

    #[test]
    fn the_board_keeps_the_latest_snapshot_per_thread() {
        let board = LiveBoard::new(2);
        assert!(board.read().is_empty());
        board.publish(
            1,
            ThreadSnapshot {
                thread_index: 1,
                iterations: 5,
                ..ThreadSnapshot::default()
            },
        );
        board.publish(
            1,
            ThreadSnapshot {
                thread_index: 1,
                iterations: 7,
                ..ThreadSnapshot::default()
            },
        );
        let read = board.read();
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].iterations, 7);
    }
}
