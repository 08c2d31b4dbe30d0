//! The in-memory state of an open table that every operation shares: its geometry, the
//! extent allocator, the key count, and the bucket gate that orders operations touching the
//! same buckets.
//!
//! Why a gate: an operation reads buckets, decides, and writes one back (read-modify-write of
//! a whole 4 KiB block). Two operations whose probe windows overlap must not interleave those
//! steps, or one's bucket write would undo the other's. Each PUT, GET and DELETE therefore
//! takes its key's probe window at the gate before its first read and keeps it until its
//! answer: PUT and DELETE exclusively, GET shared with other GETs. Operations are granted in
//! the order they arrived (tickets), so a waiting PUT is not starved by a stream of GETs. A
//! FLUSH is a barrier: it waits for every operation that arrived before it (so it covers every
//! PUT and DELETE received before it), and holds back nothing that arrives after it.
//!
//! Invariants: a granted window never overlaps another granted window unless both are shared;
//! an entry is released exactly once; the gate holds at most one entry per operation in
//! progress (the caller bounds those).

use std::collections::VecDeque;

use crate::alloc::ExtentAllocator;
use crate::layout::Geometry;

/// What an operation holds at the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Span {
    /// The probe window starting at bucket `home`; `exclusive` for writers.
    Window { home: u64, exclusive: bool },
    /// A FLUSH: waits for every earlier entry.
    Barrier,
}

/// A place at the gate, given back to [`BucketGate::retry`] and [`BucketGate::release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket(u64);

#[derive(Debug)]
struct Entry {
    ticket: u64,
    span: Span,
    granted: bool,
}

/// Orders operations over overlapping probe windows (see the module doc).
#[derive(Debug)]
pub struct BucketGate {
    bucket_count: u64,
    probe_buckets: u64,
    /// In arrival order (tickets grow).
    entries: VecDeque<Entry>,
    next_ticket: u64,
}

impl BucketGate {
    pub fn new(geometry: &Geometry) -> BucketGate {
        BucketGate {
            bucket_count: geometry.bucket_count(),
            probe_buckets: u64::from(geometry.probe_buckets_max()),
            entries: VecDeque::new(),
            next_ticket: 0,
        }
    }

    /// Whether an `earlier` entry keeps `later` waiting.
    fn blocks(&self, earlier: Span, later: Span) -> bool {
        match (earlier, later) {
            (_, Span::Barrier) => true,
            (Span::Barrier, Span::Window { .. }) => false,
            (
                Span::Window {
                    home: a,
                    exclusive: a_exclusive,
                },
                Span::Window {
                    home: b,
                    exclusive: b_exclusive,
                },
            ) => {
                if !a_exclusive && !b_exclusive {
                    return false;
                }
                // Windows of `probe_buckets` consecutive buckets (mod the count) overlap when
                // their starts are closer than a window in either direction.
                let forward = (b + self.bucket_count - a) % self.bucket_count;
                let backward = (a + self.bucket_count - b) % self.bucket_count;
                forward < self.probe_buckets || backward < self.probe_buckets
            }
        }
    }

    /// Lists an operation; returns its ticket and whether it may go now.
    pub fn acquire(&mut self, span: Span) -> (Ticket, bool) {
        if let Span::Window { home, .. } = span {
            assert!(home < self.bucket_count, "home bucket out of range");
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.entries.push_back(Entry {
            ticket,
            span,
            granted: false,
        });
        let granted = self.retry(Ticket(ticket));
        (Ticket(ticket), granted)
    }

    /// Asks again for a listed ticket; true: it may go (and stays granted until released).
    pub fn retry(&mut self, ticket: Ticket) -> bool {
        let Some(position) = self.entries.iter().position(|e| e.ticket == ticket.0) else {
            panic!("bucket gate ticket {} is not listed", ticket.0);
        };
        if self.entries[position].granted {
            return true;
        }
        let span = self.entries[position].span;
        let blocked = self
            .entries
            .iter()
            .take(position)
            .any(|earlier| self.blocks(earlier.span, span));
        if blocked {
            return false;
        }
        self.entries[position].granted = true;
        true
    }

    /// The operation is over (or abandoned): its place goes.
    pub fn release(&mut self, ticket: Ticket) {
        let Some(position) = self.entries.iter().position(|e| e.ticket == ticket.0) else {
            panic!(
                "release of bucket gate ticket {}, which is not listed",
                ticket.0
            );
        };
        self.entries.remove(position);
    }

    /// Operations listed (waiting or granted).
    pub fn listed(&self) -> usize {
        self.entries.len()
    }
}

/// The shared state of an open table (see the module doc). Operations ([`crate::op::KvOp`])
/// borrow it mutably at each step; nothing in it is on the device.
#[derive(Debug)]
pub struct KvTable {
    pub(crate) geometry: Geometry,
    pub(crate) allocator: ExtentAllocator,
    pub(crate) entry_count: u64,
    pub(crate) repaired_slot_count: u64,
    pub(crate) gate: BucketGate,
}

impl KvTable {
    /// An empty table's state (nothing allocated, nobody at the gate).
    pub fn new(geometry: Geometry) -> KvTable {
        KvTable {
            allocator: ExtentAllocator::new(
                geometry.extent_start_block(),
                geometry.extent_block_count(),
            ),
            gate: BucketGate::new(&geometry),
            geometry,
            entry_count: 0,
            repaired_slot_count: 0,
        }
    }

    pub const fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Keys stored, as the answered operations tell: a PUT or DELETE whose bucket write
    /// failed may still have landed, which the count learns only at the next open.
    pub const fn len(&self) -> u64 {
        self.entry_count
    }

    pub const fn is_empty(&self) -> bool {
        self.entry_count == 0
    }

    /// Blocks of the value area in use, including those freed since the last FLUSH.
    pub const fn used_value_blocks(&self) -> u64 {
        self.allocator.used_block_count()
    }

    /// Stale slots opening turned into tombstones.
    pub const fn repaired_slot_count(&self) -> u64 {
        self.repaired_slot_count
    }

    /// Operations at the gate (waiting or in progress).
    pub fn operations_listed(&self) -> usize {
        self.gate.listed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(bucket_count: u64, probe: u32) -> BucketGate {
        let geometry = Geometry::new(bucket_count * 64, bucket_count, probe)
            .unwrap_or_else(|e| panic!("geometry: {e}"));
        BucketGate::new(&geometry)
    }

    fn window(home: u64, exclusive: bool) -> Span {
        Span::Window { home, exclusive }
    }

    #[test]
    fn overlapping_writers_go_one_at_a_time_in_order() {
        let mut gate = gate(64, 4);
        let (a, a_go) = gate.acquire(window(10, true));
        let (b, b_go) = gate.acquire(window(13, true));
        let (c, c_go) = gate.acquire(window(14, true));
        let (d, d_go) = gate.acquire(window(20, true));
        assert!(a_go);
        assert!(!b_go, "13 is inside 10's window");
        assert!(
            !c_go,
            "14 .. 17 misses 10 .. 13 but overlaps b, which came earlier"
        );
        assert!(d_go, "20 is independent");
        gate.release(a);
        assert!(!gate.retry(c), "c still waits behind b");
        assert!(gate.retry(b));
        assert!(!gate.retry(c));
        gate.release(b);
        assert!(gate.retry(c));
        gate.release(c);
        gate.release(d);
        assert_eq!(gate.listed(), 0);
    }

    #[test]
    fn readers_share_writers_wait_windows_wrap() {
        let mut gate = gate(16, 4);
        let (r1, go1) = gate.acquire(window(14, false));
        let (r2, go2) = gate.acquire(window(15, false));
        assert!(go1 && go2);
        // 14 .. 17 wraps to 14, 15, 0, 1: a writer at 1 overlaps.
        let (w, w_go) = gate.acquire(window(1, true));
        assert!(!w_go);
        // A reader after the waiting writer waits too (arrival order).
        let (r3, go3) = gate.acquire(window(0, false));
        assert!(!go3);
        gate.release(r1);
        gate.release(r2);
        assert!(gate.retry(w));
        assert!(!gate.retry(r3));
        gate.release(w);
        assert!(gate.retry(r3));
        gate.release(r3);
    }

    #[test]
    fn a_barrier_waits_for_earlier_entries_only() {
        let mut gate = gate(64, 4);
        let (a, _) = gate.acquire(window(0, false));
        let (flush, flush_go) = gate.acquire(Span::Barrier);
        assert!(!flush_go);
        let (b, b_go) = gate.acquire(window(0, true));
        assert!(!b_go, "overlaps a");
        let (c, c_go) = gate.acquire(window(30, true));
        assert!(c_go, "a barrier holds back nothing after it");
        gate.release(a);
        assert!(gate.retry(flush));
        assert!(gate.retry(b));
        gate.release(flush);
        gate.release(b);
        gate.release(c);
    }
}
