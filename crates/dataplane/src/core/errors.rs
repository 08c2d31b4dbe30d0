//! Device failures in the log without flooding it: the first failure of a burst is logged
//! at once, the rest are counted and summed up when the burst ends (no failure for
//! [`BURST_QUIET`]) or every [`SUMMARY_EVERY`] while it lasts.

use reflex_qos::Nanos;

/// A burst ends after this long without a failure.
pub const BURST_QUIET: Nanos = Nanos(1_000_000_000);
/// A long burst is summed up this often.
pub const SUMMARY_EVERY: Nanos = Nanos(10_000_000_000);

#[derive(Debug, Clone, Default)]
struct Burst {
    active: bool,
    last_at: Nanos,
    summary_at: Nanos,
    /// Failures since the last line about this burst.
    unlogged: u64,
    total: u64,
}

/// One burst state per namespace.
#[derive(Debug, Clone)]
pub(super) struct DeviceErrorLog {
    thread_index: usize,
    namespace_ids: Vec<u32>,
    bursts: Vec<Burst>,
}

impl DeviceErrorLog {
    pub(super) fn new(thread_index: usize, namespace_ids: Vec<u32>) -> DeviceErrorLog {
        let bursts = vec![Burst::default(); namespace_ids.len()];
        DeviceErrorLog {
            thread_index,
            namespace_ids,
            bursts,
        }
    }

    /// A namespace slot added at run time.
    pub(super) fn add_namespace(&mut self, namespace_id: u32) {
        self.namespace_ids.push(namespace_id);
        self.bursts.push(Burst::default());
    }

    pub(super) fn record(&mut self, namespace_index: u16, reason: &str, now: Nanos) {
        let namespace = self.namespace_ids[usize::from(namespace_index)];
        let burst = &mut self.bursts[usize::from(namespace_index)];
        burst.last_at = now;
        burst.total += 1;
        if !burst.active {
            *burst = Burst {
                active: true,
                last_at: now,
                summary_at: now,
                unlogged: 0,
                total: 1,
            };
            tracing::warn!(
                thread = self.thread_index,
                namespace,
                %reason,
                "device I/O failed (further failures of this burst are counted)"
            );
            return;
        }
        burst.unlogged += 1;
        if now.saturating_since(burst.summary_at) >= SUMMARY_EVERY {
            tracing::warn!(
                thread = self.thread_index,
                namespace,
                failures = burst.unlogged,
                burst_failures = burst.total,
                last_reason = %reason,
                "device I/O keeps failing"
            );
            burst.unlogged = 0;
            burst.summary_at = now;
        }
    }

    /// Ends the bursts that have been quiet long enough.
    pub(super) fn tick(&mut self, now: Nanos) {
        for (index, burst) in self.bursts.iter_mut().enumerate() {
            if burst.active && now.saturating_since(burst.last_at) >= BURST_QUIET {
                burst.active = false;
                if burst.unlogged > 0 || burst.total > 1 {
                    tracing::warn!(
                        thread = self.thread_index,
                        namespace = self.namespace_ids[index],
                        failures = burst.unlogged,
                        burst_failures = burst.total,
                        "device I/O failures ended"
                    );
                }
            }
        }
    }

    /// Whether a burst is open (its end needs a tick).
    pub(super) fn any_active(&self) -> bool {
        self.bursts.iter().any(|burst| burst.active)
    }

    /// Failures counted so far on a namespace (tests and metrics).
    pub(super) fn total(&self, namespace_index: u16) -> u64 {
        self.bursts[usize::from(namespace_index)].total
    }
}
