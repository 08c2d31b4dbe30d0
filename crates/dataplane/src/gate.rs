//! Write ordering for read-modify-write, per namespace and shared by every dataplane thread.
//!
//! Why: a read-modify-write (an NBD WRITE or WRITE_ZEROES that starts or ends inside a
//! sector) reads an *edge* sector, merges its own bytes and writes the whole sector back. If
//! another write lands on that sector between the read and the write-back, its bytes are
//! overwritten with the old ones and lost, even when the two requests touch different bytes.
//! So while a read-modify-write is in progress, nothing else may write its edge sectors:
//!
//! - a read-modify-write waits for every earlier write (plain or read-modify-write) that
//!   covers one of its edge sectors, and for writes whose range it does not know (below);
//! - a plain write (or discard, or zero fill) waits for every earlier read-modify-write whose
//!   edge sectors it covers;
//! - plain writes never wait for each other: overlapping plain writes are the client's
//!   business, as they are on any block device.
//!
//! "Earlier" is the order of arrival at the gate ([`WriteGate::acquire`]), so a request waits
//! only for requests that arrived before it: no cycles, and no starvation. A holder releases
//! when its last write completed ([`WriteGate::release`]).
//!
//! The common case costs two atomic operations: while no read-modify-write is registered on
//! the namespace, a plain write only counts itself in `unlisted` and goes on, without the
//! lock or an entry ([`Hold::Unlisted`]). A read-modify-write first announces itself in
//! `rmw_listed` (from then on plain writes list their ranges), then waits until `unlisted`
//! drains to zero: both sides use sequentially consistent operations, so at least one of
//! them sees the other (a plain write that saw no read-modify-write is counted before the
//! read-modify-write looks at the count).
//!
//! Bounded: at most [`GATE_ENTRIES_MAX`] listed writes per namespace; a write that finds the
//! table full waits (without a place in line) and asks again. Waiting is the caller's: the
//! dataplane keeps waiting requests in a list and asks again when one of its own writes
//! releases, or after [`GATE_RETRY_INTERVAL`] for releases by other threads.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use reflex_qos::Nanos;

/// Listed writes one namespace's gate holds.
pub const GATE_ENTRIES_MAX: usize = 1024;
/// How soon a thread asks again for writes waiting on another thread's writes.
pub const GATE_RETRY_INTERVAL: Nanos = Nanos(50_000);

/// The sectors a write covers, and its edge sectors if it is a read-modify-write (byte
/// offsets of whole sectors: `[start, end)` and up to two sector starts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteRange {
    pub start_bytes: u64,
    pub end_bytes: u64,
    /// The edge sectors a read-modify-write reads and writes back; none for a plain write.
    pub edges: [Option<u64>; 2],
    pub sector_bytes: u32,
}

impl WriteRange {
    pub fn is_read_modify_write(&self) -> bool {
        self.edges.iter().any(Option::is_some)
    }

    fn covers(&self, sector_start: u64) -> bool {
        self.start_bytes <= sector_start && sector_start < self.end_bytes
    }

    /// Whether one of `self`'s edge sectors is written by `other`.
    fn edges_written_by(&self, other: &WriteRange) -> bool {
        self.edges.iter().flatten().any(|&edge| other.covers(edge))
    }

    /// Whether the two may not be in progress together.
    fn conflicts_with(&self, other: &WriteRange) -> bool {
        self.edges_written_by(other) || other.edges_written_by(self)
    }
}

/// A write's place at the gate: passed back to [`WriteGate::retry`] and
/// [`WriteGate::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// A plain write that found no read-modify-write registered: only counted.
    Unlisted,
    /// An entry in the table.
    Listed { ticket: u64 },
}

/// What [`WriteGate::acquire`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// Go ahead; release the hold when the last write completed.
    Granted(Hold),
    /// Listed, not yet allowed: [`WriteGate::retry`] later with this hold.
    Waiting(Hold),
    /// The table is full: `acquire` again later.
    Full,
}

#[derive(Debug)]
struct Entry {
    ticket: u64,
    range: WriteRange,
    granted: bool,
}

#[derive(Debug, Default)]
struct Table {
    /// In order of arrival (tickets grow).
    entries: Vec<Entry>,
    next_ticket: u64,
}

/// One namespace's write ordering.
#[derive(Debug)]
pub struct WriteGate {
    table: Mutex<Table>,
    /// Read-modify-writes listed (waiting or granted): while any are, plain writes list too.
    rmw_listed: AtomicU32,
    /// Plain writes in progress that are not listed.
    unlisted: AtomicU32,
}

impl Default for WriteGate {
    fn default() -> Self {
        WriteGate::new()
    }
}

impl WriteGate {
    pub fn new() -> WriteGate {
        WriteGate {
            table: Mutex::new(Table {
                entries: Vec::with_capacity(GATE_ENTRIES_MAX),
                next_ticket: 0,
            }),
            rmw_listed: AtomicU32::new(0),
            unlisted: AtomicU32::new(0),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        // A panic while holding the lock is a dataplane bug that already ends the process;
        // the table itself stays consistent (every change is one push or remove).
        self.table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A write to `range` wants to start.
    pub fn acquire(&self, range: WriteRange) -> Acquired {
        assert!(range.start_bytes < range.end_bytes, "an empty write range");
        if !range.is_read_modify_write() {
            self.unlisted.fetch_add(1, Ordering::SeqCst);
            if self.rmw_listed.load(Ordering::SeqCst) == 0 {
                return Acquired::Granted(Hold::Unlisted);
            }
            // A read-modify-write is listed: list this write instead.
            self.unlisted.fetch_sub(1, Ordering::SeqCst);
        }
        let mut table = self.table();
        if table.entries.len() >= GATE_ENTRIES_MAX {
            return Acquired::Full;
        }
        if range.is_read_modify_write() {
            self.rmw_listed.fetch_add(1, Ordering::SeqCst);
        }
        let ticket = table.next_ticket;
        table.next_ticket += 1;
        table.entries.push(Entry {
            ticket,
            range,
            granted: false,
        });
        let hold = Hold::Listed { ticket };
        if self.try_grant(&mut table, ticket) {
            Acquired::Granted(hold)
        } else {
            Acquired::Waiting(hold)
        }
    }

    /// Asks again for a waiting hold; true: granted.
    pub fn retry(&self, hold: Hold) -> bool {
        let Hold::Listed { ticket } = hold else {
            panic!("retry of an unlisted hold (it never waits)");
        };
        let mut table = self.table();
        self.try_grant(&mut table, ticket)
    }

    /// Grants `ticket` if nothing before it conflicts (and, for a read-modify-write, no
    /// unlisted write is in progress).
    fn try_grant(&self, table: &mut Table, ticket: u64) -> bool {
        let Some(position) = table.entries.iter().position(|e| e.ticket == ticket) else {
            panic!("gate ticket {ticket} is not listed");
        };
        let range = table.entries[position].range;
        if table.entries[position].granted {
            return true;
        }
        let blocked = table.entries[..position]
            .iter()
            .any(|earlier| earlier.range.conflicts_with(&range));
        if blocked || (range.is_read_modify_write() && self.unlisted.load(Ordering::SeqCst) > 0) {
            return false;
        }
        table.entries[position].granted = true;
        true
    }

    /// The write is over (or abandoned while waiting): its place goes.
    pub fn release(&self, hold: Hold, range: WriteRange) {
        match hold {
            Hold::Unlisted => {
                let before = self.unlisted.fetch_sub(1, Ordering::SeqCst);
                assert!(before > 0, "unlisted write count underflow");
            }
            Hold::Listed { ticket } => {
                let mut table = self.table();
                let Some(position) = table.entries.iter().position(|e| e.ticket == ticket) else {
                    panic!("release of gate ticket {ticket}, which is not listed");
                };
                let entry = table.entries.remove(position);
                assert_eq!(entry.range, range, "released with another range");
                if range.is_read_modify_write() {
                    let before = self.rmw_listed.fetch_sub(1, Ordering::SeqCst);
                    assert!(before > 0, "read-modify-write count underflow");
                }
            }
        }
    }

    /// Listed writes (tests and metrics).
    pub fn listed(&self) -> usize {
        self.table().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECTOR: u64 = 512;

    fn plain(start: u64, end: u64) -> WriteRange {
        WriteRange {
            start_bytes: start,
            end_bytes: end,
            edges: [None, None],
            sector_bytes: SECTOR as u32,
        }
    }

    fn rmw(start: u64, end: u64, head: Option<u64>, tail: Option<u64>) -> WriteRange {
        WriteRange {
            start_bytes: start,
            end_bytes: end,
            edges: [head, tail],
            sector_bytes: SECTOR as u32,
        }
    }

    #[test]
    fn plain_writes_pass_unlisted_until_a_read_modify_write_comes() {
        let gate = WriteGate::new();
        let a = gate.acquire(plain(0, 4096));
        let b = gate.acquire(plain(0, 4096));
        assert_eq!(a, Acquired::Granted(Hold::Unlisted));
        assert_eq!(b, Acquired::Granted(Hold::Unlisted));
        assert_eq!(gate.listed(), 0);
        // A read-modify-write of sector 512 must wait for the unlisted writes, whose ranges
        // the gate does not know.
        let edge = rmw(512, 1024, Some(512), None);
        let Acquired::Waiting(waiting) = gate.acquire(edge) else {
            panic!("granted with unlisted writes in progress");
        };
        // Plain writes now list themselves; one over the edge waits behind it, one elsewhere
        // goes.
        let over = gate.acquire(plain(0, 8192));
        assert!(matches!(over, Acquired::Waiting(Hold::Listed { .. })));
        let elsewhere = gate.acquire(plain(8192, 16384));
        assert!(matches!(elsewhere, Acquired::Granted(Hold::Listed { .. })));
        gate.release(Hold::Unlisted, plain(0, 4096));
        assert!(!gate.retry(waiting));
        gate.release(Hold::Unlisted, plain(0, 4096));
        assert!(gate.retry(waiting));
        let (Acquired::Waiting(over), Acquired::Granted(elsewhere)) = (over, elsewhere) else {
            panic!();
        };
        assert!(
            !gate.retry(over),
            "overlaps a read-modify-write in progress"
        );
        gate.release(waiting, edge);
        assert!(gate.retry(over));
        gate.release(over, plain(0, 8192));
        gate.release(elsewhere, plain(8192, 16384));
        assert_eq!(gate.listed(), 0);
        // Back to the fast path.
        assert_eq!(
            gate.acquire(plain(0, 512)),
            Acquired::Granted(Hold::Unlisted)
        );
    }

    #[test]
    fn read_modify_writes_of_one_sector_go_one_at_a_time_in_order() {
        let gate = WriteGate::new();
        let ranges = [
            rmw(0, 512, Some(0), None),
            rmw(0, 1024, Some(0), Some(512)),
            rmw(512, 1024, None, Some(512)),
            rmw(4096, 4608, Some(4096), None),
        ];
        let holds: Vec<Acquired> = ranges.iter().map(|range| gate.acquire(*range)).collect();
        assert!(matches!(holds[0], Acquired::Granted(_)));
        assert!(matches!(holds[1], Acquired::Waiting(_)));
        // Sector 512 is not the first's, but the second (earlier) waits on it.
        assert!(matches!(holds[2], Acquired::Waiting(_)));
        assert!(
            matches!(holds[3], Acquired::Granted(_)),
            "another sector goes"
        );
        let hold = |index: usize| match holds[index] {
            Acquired::Granted(hold) | Acquired::Waiting(hold) => hold,
            Acquired::Full => panic!("full"),
        };
        assert!(!gate.retry(hold(2)));
        gate.release(hold(0), ranges[0]);
        assert!(!gate.retry(hold(2)), "the second is still before the third");
        assert!(gate.retry(hold(1)));
        gate.release(hold(1), ranges[1]);
        assert!(gate.retry(hold(2)));
        gate.release(hold(2), ranges[2]);
        gate.release(hold(3), ranges[3]);
        assert_eq!(gate.listed(), 0);
        assert_eq!(gate.rmw_listed.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_full_table_makes_writes_wait() {
        let gate = WriteGate::new();
        let mut holds = Vec::new();
        for index in 0..GATE_ENTRIES_MAX as u64 {
            let at = index * SECTOR * 2;
            let range = rmw(at, at + SECTOR, Some(at), None);
            let Acquired::Granted(hold) = gate.acquire(range) else {
                panic!("disjoint sectors conflict");
            };
            holds.push((hold, range));
        }
        let extra = rmw(1 << 30, (1 << 30) + SECTOR, Some(1 << 30), None);
        assert_eq!(gate.acquire(extra), Acquired::Full);
        assert_eq!(
            gate.acquire(plain(1 << 31, (1 << 31) + 4096)),
            Acquired::Full
        );
        let (hold, range) = holds.pop().unwrap_or_else(|| panic!("holds"));
        gate.release(hold, range);
        assert!(matches!(gate.acquire(extra), Acquired::Granted(_)));
    }

    /// Threads doing read-modify-writes of bytes in the same sectors through the gate never
    /// lose a byte; without the gate (the negative control) they do.
    #[test]
    fn concurrent_read_modify_writes_keep_every_byte() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicU8;
        fn run(gated: bool) -> usize {
            const SECTORS: u64 = 4;
            const THREADS: u64 = 4;
            let disk: Arc<Vec<AtomicU8>> =
                Arc::new((0..SECTORS * SECTOR).map(|_| AtomicU8::new(0)).collect());
            let gate = Arc::new(WriteGate::new());
            let threads: Vec<_> = (0..THREADS)
                .map(|thread| {
                    let (disk, gate) = (Arc::clone(&disk), Arc::clone(&gate));
                    std::thread::spawn(move || {
                        // Each thread owns every THREADS-th byte and sets it, one
                        // read-modify-write of its sector at a time.
                        for byte in (thread..SECTORS * SECTOR).step_by(THREADS as usize) {
                            let sector = byte / SECTOR * SECTOR;
                            let range = rmw(sector, sector + SECTOR, Some(sector), None);
                            let hold = if gated {
                                loop {
                                    match gate.acquire(range) {
                                        Acquired::Granted(hold) => break Some(hold),
                                        Acquired::Waiting(hold) => {
                                            while !gate.retry(hold) {
                                                std::thread::yield_now();
                                            }
                                            break Some(hold);
                                        }
                                        Acquired::Full => std::thread::yield_now(),
                                    }
                                }
                            } else {
                                None
                            };
                            let mut copy: Vec<u8> = (sector..sector + SECTOR)
                                .map(|at| disk[at as usize].load(Ordering::Relaxed))
                                .collect();
                            copy[(byte - sector) as usize] = 1;
                            std::thread::yield_now();
                            for (at, value) in (sector..).zip(copy) {
                                disk[at as usize].store(value, Ordering::Relaxed);
                            }
                            if let Some(hold) = hold {
                                gate.release(hold, range);
                            }
                        }
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap_or_else(|_| panic!("thread panicked"));
            }
            disk.iter()
                .filter(|b| b.load(Ordering::Relaxed) == 0)
                .count()
        }
        assert_eq!(run(true), 0, "bytes lost through the gate");
        // Without the gate some bytes are lost (repeat: a run may get lucky).
        assert!(
            (0..20).any(|_| run(false) > 0),
            "negative control: ungated read-modify-writes lost nothing"
        );
    }
}
