//! Publishing this thread's live figures to the control plane (`crate::live`): plain counters
//! kept on the data path, a snapshot built and swapped into the board at most every
//! [`PUBLISH_INTERVAL`] (from housekeeping, and once more when the thread goes idle).

use reflex_qos::{Nanos, TenantId};

use super::Dataplane;
use super::tenants::NamespaceQos;
use crate::live::{
    BATCH_BUCKETS, FairFlowSnapshot, FairWindowSnapshot, FairnessSnapshot, ListenerSnapshot,
    NamespaceSnapshot, PUBLISH_INTERVAL, TenantSnapshot, ThreadSnapshot, batch_bucket,
};

/// Counters only the live figures need.
#[derive(Debug, Clone)]
pub(super) struct LiveCounters {
    started_at: Nanos,
    next_publish: Nanos,
    /// What had happened at the last publication (answers, accepts): unchanged means the
    /// published snapshot is still true.
    published_mark: u64,
    batch_sizes: [u64; BATCH_BUCKETS],
    pub(super) idle_ns: u64,
    /// Time the thread was ready to run but waited for a CPU (the driver reads the kernel's
    /// schedstat; 0 where nobody measures it, as in the simulator).
    pub(super) run_delay_ns: u64,
    /// Whether a driver reports idle time and CPU waits at all (the simulator, which has no
    /// CPU, does not: its threads are never busy for calibration).
    pub(super) cpu_measured: bool,
    /// Per namespace index: device operations outstanding, completed, and their device time.
    pub(super) device_in_flight: Vec<u32>,
    pub(super) device_operations: Vec<u64>,
    pub(super) device_ns: Vec<u64>,
}

impl LiveCounters {
    /// A namespace slot added at run time.
    pub(super) fn add_namespace(&mut self) {
        self.device_in_flight.push(0);
        self.device_operations.push(0);
        self.device_ns.push(0);
    }

    pub(super) fn new(namespaces: usize, now: Nanos) -> LiveCounters {
        LiveCounters {
            started_at: now,
            next_publish: now,
            published_mark: u64::MAX,
            batch_sizes: [0; BATCH_BUCKETS],
            idle_ns: 0,
            run_delay_ns: 0,
            cpu_measured: false,
            device_in_flight: vec![0; namespaces],
            device_operations: vec![0; namespaces],
            device_ns: vec![0; namespaces],
        }
    }

    pub(super) fn count_batch(&mut self, completions: u64) {
        self.batch_sizes[batch_bucket(completions)] += 1;
    }
}

impl Dataplane {
    /// The driver found nothing to do for `idle_ns` (it slept, or spun on an empty ring):
    /// the complement of the thread's busy share.
    pub fn count_idle(&mut self, idle_ns: u64) {
        self.live.idle_ns += idle_ns;
        self.live.cpu_measured = true;
    }

    /// The thread waited `run_delay_ns` for a CPU (the kernel's schedstat, read by the
    /// driver): with the busy share, how much of the time the server itself was the limit.
    pub fn count_run_delay(&mut self, run_delay_ns: u64) {
        self.live.run_delay_ns += run_delay_ns;
        self.live.cpu_measured = true;
    }

    fn activity_mark(&self) -> u64 {
        self.stats
            .requests_answered
            .wrapping_add(self.stats.connections_accepted)
            .wrapping_add(self.stats.control_messages)
            .wrapping_add(self.stats.connections_refused)
    }

    /// Publishes a snapshot when one is due (housekeeping calls it every 100 ms while the
    /// thread has connections) or, with `idle`, when the thread is about to sleep with
    /// figures the board does not show yet.
    pub(super) fn publish_live(&mut self, now: Nanos, idle: bool) {
        let mark = self.activity_mark();
        if idle {
            if mark == self.live.published_mark {
                return;
            }
        } else if now < self.live.next_publish {
            return;
        }
        self.live.next_publish = now + PUBLISH_INTERVAL;
        self.live.published_mark = mark;
        let snapshot = self.live_snapshot(now);
        self.control.live().publish(self.thread_index, snapshot);
    }

    /// This thread's cumulative figures now.
    pub fn live_snapshot(&self, now: Nanos) -> ThreadSnapshot {
        let elapsed = now.saturating_since(self.live.started_at).0;
        let mut namespaces = Vec::with_capacity(self.qos.len());
        let mut tenants = Vec::new();
        for (index, namespace) in self.qos.iter().enumerate() {
            if !self.namespaces.is_live(index as u16) {
                continue;
            }
            namespaces.push(NamespaceSnapshot {
                namespace_id: namespace.namespace_id,
                device_in_flight: self.live.device_in_flight[index],
                device_operations: self.live.device_operations[index],
                device_ns: self.live.device_ns[index],
                read_latency: self.telemetry[index].reads.clone(),
                ledger: namespace.scheduler.ledger(),
                fairness: fairness_snapshot(namespace),
            });
            for (id, account) in namespace.accounts.iter().enumerate() {
                if account.stats.handle == 0 {
                    continue;
                }
                let tenant = TenantId(id as u32);
                let scheduler = namespace.scheduler.tenant_stats(tenant).unwrap_or_default();
                let open_deficit_ns = account
                    .deficit_since
                    .map_or(0, |since| now.saturating_since(since).0);
                tenants.push(TenantSnapshot {
                    handle: account.stats.handle,
                    namespace_id: namespace.namespace_id,
                    class: namespace.scheduler.tenant_class(tenant),
                    arrivals: account.stats.arrivals,
                    reads: account.reads,
                    read_bytes: account.read_bytes,
                    writes: account.writes,
                    write_bytes: account.write_bytes,
                    read_latency: account.read_latency.clone(),
                    millitokens_spent: account.stats.millitokens,
                    millitokens_earned: scheduler.generated_tokens.0,
                    millitokens_from_bucket: scheduler.bucket_tokens.0,
                    millitokens_donated: scheduler.donated_tokens.0,
                    deficit_episodes: account.stats.deficit_episodes,
                    deficit_ns: account.deficit_ns + open_deficit_ns,
                    queued: scheduler.queued_requests,
                    refusals: account.refusals,
                });
            }
        }
        ThreadSnapshot {
            thread_index: self.thread_index,
            at: now,
            iterations: self.stats.iterations,
            completions: self.stats.completions,
            batch_sizes: self.live.batch_sizes,
            idle_ns: self.live.idle_ns.min(elapsed),
            busy_ns: elapsed.saturating_sub(self.live.idle_ns),
            connections_open: self.open_connections,
            connections_accepted: self.stats.connections_accepted,
            requests_answered: self.stats.requests_answered,
            bytes_received: self.stats.bytes_received,
            bytes_sent: self.stats.bytes_sent,
            control_messages: self.stats.control_messages,
            notices_sent: self.stats.notices_sent,
            tls_sessions: self.stats.tls_sessions,
            tls_failures: self.stats.tls_failures,
            migrated_sent: self.stats.migrated_sent,
            migrated_served: self.stats.migrated_served,
            migrated_refused: self.stats.migrated_refused,
            namespaces,
            tenants,
            listeners: self
                .listeners
                .iter()
                .map(|listener| ListenerSnapshot {
                    name: listener.access.name.clone(),
                    refused: listener.refused,
                })
                .collect(),
        }
    }
}

/// The fairness stage of `namespace` as the control plane sees it: flows named by tenant
/// handle, since tenant ids mean nothing outside this thread's scheduler.
fn fairness_snapshot(namespace: &NamespaceQos) -> FairnessSnapshot {
    let fair = &namespace.fair;
    let handle_of = |flow: reflex_qos::FlowId| {
        usize::try_from(flow.0)
            .ok()
            .and_then(|id| namespace.accounts.get(id))
            .map_or(0, |account| account.stats.handle)
    };
    // With the stage off its monitor sees no requests: its windows say nothing.
    let report = fair.report().filter(|_| fair.is_on());
    let mut flows: Vec<FairFlowSnapshot> = fair
        .flows()
        .map(|(flow, held, device_in_flight)| FairFlowSnapshot {
            handle: handle_of(flow),
            held,
            device_in_flight,
            last_window: report.and_then(|r| r.flows.iter().find(|f| f.flow == flow).copied()),
        })
        .collect();
    // A flow judged in the last window but idle since still shows its figures.
    if let Some(report) = report {
        for judged in &report.flows {
            if !fair.flows().any(|(flow, _, _)| flow == judged.flow) {
                flows.push(FairFlowSnapshot {
                    handle: handle_of(judged.flow),
                    held: 0,
                    device_in_flight: 0,
                    last_window: Some(*judged),
                });
            }
        }
    }
    FairnessSnapshot {
        mode: fair.mode(),
        held: fair.held(),
        device_in_flight: fair.in_flight(),
        depth: fair.depth(),
        depth_max: fair.depth_max(),
        stats: fair.stats(),
        last_window: report.map(|r| FairWindowSnapshot {
            end: r.end,
            fairness: r.fairness,
            utilisation: r.utilisation.first().copied().unwrap_or(0.0),
            unfair: r.unfair,
            policy: r.policy,
        }),
        flows,
    }
}
