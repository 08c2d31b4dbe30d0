//! The per-thread scheduling step: which queued device I/O is submitted next.
//!
//! Why a seam: the QoS work (issue 4) replaces the FIFO below with the ReFlex token scheduler
//! (per-tenant queues, LC reservations, BE round robin, a global bucket). The dataplane only
//! needs three things from any scheduler: accept a parsed, validated request
//! ([`Scheduler::enqueue`]), hand back the next one it may submit now
//! ([`Scheduler::dequeue`]), and say when it next wants to be asked
//! ([`Scheduler::next_deadline`], which bounds the thread's sleep in blocking mode). It sees
//! request indexes and costs, never buffers or sockets, so it stays sans-IO and can run in
//! the simulator. Completions are reported back ([`Scheduler::on_complete`]) so a scheduler
//! can track device load and the read ratio.

use std::collections::VecDeque;

use reflex_qos::Nanos;

/// Whom a request is charged to. 0 is the default (best-effort, unregistered) tenant: native
/// and original-protocol connections use it until they can BIND to registered tenants. An
/// NBD export bound to a tenant in the configuration (`tenant = "name"` on the namespace)
/// gives every request of its NBD connections that tenant's id, as listed by
/// [`crate::Config::tenant_ids`]; what the id earns (an SLO or a best-effort share) is the
/// scheduler's business.
pub type TenantId = u32;

/// What the scheduler needs to know about a request to order and charge it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuedIo {
    /// Index of the request in the thread's request table, returned by `dequeue`.
    pub request_index: u32,
    pub tenant: TenantId,
    /// Index of the namespace (device) in the server's namespace table.
    pub namespace_index: u16,
    /// The device operation this step submits (a multi-step request, such as an NBD
    /// WRITE_ZEROES that writes zeroes in chunks, is enqueued once per step).
    pub class: IoClass,
    pub size_bytes: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoClass {
    Read,
    Write,
    /// FLUSH, TRIM and discarding WRITE_ZEROES: not charged as data transfers.
    Other,
}

pub trait Scheduler {
    /// Takes a request; capacity is the thread's request table, so this never fails.
    fn enqueue(&mut self, io: QueuedIo, now: Nanos);
    /// The next request that may be submitted now, if any.
    fn dequeue(&mut self, now: Nanos) -> Option<QueuedIo>;
    /// A request submitted earlier finished (successfully or not).
    fn on_complete(&mut self, io: &QueuedIo, now: Nanos);
    /// Requests waiting in the scheduler.
    fn queued_count(&self) -> usize;
    /// When `dequeue` may return something it does not return now (e.g. tokens accrue).
    fn next_deadline(&self) -> Option<Nanos>;
}

/// First in, first out, no limits: the dataplane without QoS.
#[derive(Debug)]
pub struct FifoScheduler {
    queue: VecDeque<QueuedIo>,
    capacity: usize,
}

impl FifoScheduler {
    pub fn new(capacity: usize) -> FifoScheduler {
        FifoScheduler {
            queue: VecDeque::with_capacity(capacity),
            capacity,
        }
    }
}

impl Scheduler for FifoScheduler {
    fn enqueue(&mut self, io: QueuedIo, _now: Nanos) {
        assert!(
            self.queue.len() < self.capacity,
            "scheduler beyond the request table"
        );
        self.queue.push_back(io);
    }

    fn dequeue(&mut self, _now: Nanos) -> Option<QueuedIo> {
        self.queue.pop_front()
    }

    fn on_complete(&mut self, _io: &QueuedIo, _now: Nanos) {}

    fn queued_count(&self) -> usize {
        self.queue.len()
    }

    fn next_deadline(&self) -> Option<Nanos> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_keeps_order() {
        let mut fifo = FifoScheduler::new(4);
        for index in 0..3 {
            fifo.enqueue(
                QueuedIo {
                    request_index: index,
                    tenant: 0,
                    namespace_index: 0,
                    class: IoClass::Read,
                    size_bytes: 4096,
                },
                Nanos::ZERO,
            );
        }
        assert_eq!(fifo.queued_count(), 3);
        let order: Vec<u32> = std::iter::from_fn(|| fifo.dequeue(Nanos::ZERO))
            .map(|io| io.request_index)
            .collect();
        assert_eq!(order, vec![0, 1, 2]);
        assert_eq!(fifo.next_deadline(), None);
    }
}
