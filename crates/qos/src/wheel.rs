//! A two-level hashed timing wheel of tenant indices: when each refilling LC tenant is full.
//!
//! Why not a binary heap: every request of a low-rate tenant parks it once and usually unparks
//! it once, so this structure sits on the per-request path. The wheel inserts and removes in
//! O(1) through intrusive links (no stale entries), and each entry is touched at most twice
//! more: once when its coarse slot is cascaded into the fine level, once when released.
//!
//! Only ticks that have fully elapsed are processed, so an entry is released up to one tick
//! (16.4 µs) late. That only delays when a full tenant's surplus starts flowing to the global
//! bucket; nothing is lost, since the tenant earns until it is released and donates what
//! exceeds its limit then.

use crate::queue::NIL;
use crate::time::Nanos;

/// A fine tick is 2^14 ns = 16.4 µs.
const TICK_SHIFT: u32 = 14;
const SLOT_BITS: u32 = 10;
/// Slots per level: the fine level spans 16.8 ms (one coarse tick), the coarse one 17.2 s.
const SLOTS: usize = 1 << SLOT_BITS;
const SLOT_MASK: u64 = SLOTS as u64 - 1;

#[derive(Clone, Copy, Debug)]
struct Link {
    prev: u32,
    next: u32,
    /// Index into `heads` (fine slots first, then coarse), or NIL when not in the wheel.
    head: u32,
    due: Nanos,
}

const UNLINKED: Link = Link {
    prev: NIL,
    next: NIL,
    head: NIL,
    due: Nanos::ZERO,
};

#[derive(Debug)]
pub(crate) struct TimerWheel {
    /// `SLOTS` fine heads, then `SLOTS` coarse heads.
    heads: Vec<u32>,
    links: Vec<Link>,
    /// The first fine tick not yet processed.
    tick: u64,
    len: u32,
}

impl TimerWheel {
    pub(crate) fn new(now: Nanos) -> TimerWheel {
        TimerWheel {
            heads: vec![NIL; 2 * SLOTS],
            links: Vec::new(),
            tick: now.0 >> TICK_SHIFT,
            len: 0,
        }
    }

    /// Makes room for index `index` (control-plane path; may allocate).
    pub(crate) fn ensure(&mut self, index: usize) {
        if self.links.len() <= index {
            self.links.resize(index + 1, UNLINKED);
        }
    }

    #[inline]
    pub(crate) fn contains(&self, index: usize) -> bool {
        self.links.get(index).is_some_and(|link| link.head != NIL)
    }

    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    pub(crate) fn insert(&mut self, index: usize, due: Nanos) {
        assert!(!self.contains(index), "index {index} already in the wheel");
        // Past-due entries go into the next tick to be processed.
        let head = self.head_for(due);
        self.link(index, head, due);
        self.len += 1;
    }

    fn link(&mut self, index: usize, head: usize, due: Nanos) {
        let first = self.heads[head];
        self.links[index] = Link {
            prev: NIL,
            next: first,
            head: head as u32,
            due,
        };
        if first != NIL {
            self.links[first as usize].prev = index as u32;
        }
        self.heads[head] = index as u32;
    }

    fn unlink(&mut self, index: usize) {
        let link = self.links[index];
        if link.prev == NIL {
            assert_eq!(self.heads[link.head as usize], index as u32, "wheel head");
            self.heads[link.head as usize] = link.next;
        } else {
            self.links[link.prev as usize].next = link.next;
        }
        if link.next != NIL {
            self.links[link.next as usize].prev = link.prev;
        }
        self.links[index] = UNLINKED;
    }

    /// Removes `index` if it is in the wheel; returns whether it was.
    pub(crate) fn remove(&mut self, index: usize) -> bool {
        if !self.contains(index) {
            return false;
        }
        self.unlink(index);
        self.len -= 1;
        true
    }

    /// Removes every entry due in a fine tick that ended at or before `now` and appends its
    /// index to `expired`.
    pub(crate) fn expire(&mut self, now: Nanos, expired: &mut Vec<u32>) {
        let end = now.0 >> TICK_SHIFT;
        if end <= self.tick {
            return;
        }
        if self.len == 0 {
            self.tick = end;
            return;
        }
        if end - self.tick > SLOTS as u64 {
            self.expire_far(end, expired);
            return;
        }
        while self.tick < end {
            if self.tick & SLOT_MASK == 0 {
                self.cascade();
            }
            let head = (self.tick & SLOT_MASK) as usize;
            while self.heads[head] != NIL {
                let index = self.heads[head] as usize;
                self.unlink(index);
                self.len -= 1;
                expired.push(index as u32);
            }
            self.tick += 1;
        }
    }

    /// At the start of a coarse period, moves its coarse slot's entries into the fine level.
    /// (Entries of later turns of the coarse level stay.)
    fn cascade(&mut self) {
        let period = self.tick >> SLOT_BITS;
        let head = SLOTS + (period & SLOT_MASK) as usize;
        let mut cursor = self.heads[head];
        while cursor != NIL {
            let link = self.links[cursor as usize];
            let tick = link.due.0 >> TICK_SHIFT;
            if tick >> SLOT_BITS <= period {
                self.unlink(cursor as usize);
                let fine = (tick.max(self.tick) & SLOT_MASK) as usize;
                self.link(cursor as usize, fine, link.due);
            }
            cursor = link.next;
        }
    }

    /// Time jumped by more than a fine turn: release everything due, re-place the rest.
    fn expire_far(&mut self, end: u64, expired: &mut Vec<u32>) {
        self.tick = end;
        for head in 0..2 * SLOTS {
            let mut cursor = self.heads[head];
            while cursor != NIL {
                let link = self.links[cursor as usize];
                self.unlink(cursor as usize);
                if link.due.0 >> TICK_SHIFT < end {
                    self.len -= 1;
                    expired.push(cursor);
                } else {
                    // Re-placed relative to the new tick (possibly into a slot this loop
                    // visits later, which then just re-places it again).
                    let head = self.head_for(link.due);
                    self.link(cursor as usize, head, link.due);
                }
                cursor = link.next;
            }
        }
    }

    fn head_for(&self, due: Nanos) -> usize {
        let tick = (due.0 >> TICK_SHIFT).max(self.tick);
        if tick >> SLOT_BITS == self.tick >> SLOT_BITS {
            (tick & SLOT_MASK) as usize
        } else {
            SLOTS + ((tick >> SLOT_BITS) & SLOT_MASK) as usize
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expire(wheel: &mut TimerWheel, now_us: u64) -> Vec<u32> {
        let mut out = Vec::new();
        wheel.expire(Nanos::from_micros(now_us), &mut out);
        out.sort_unstable();
        out
    }

    /// A fine tick in µs, rounded up: entries come out once the tick they are due in ended.
    const TICK_US: u64 = 17;

    #[test]
    fn entries_come_out_once_after_their_tick_and_removed_ones_never() {
        let mut wheel = TimerWheel::new(Nanos::ZERO);
        wheel.ensure(10);
        wheel.insert(1, Nanos::from_micros(5));
        wheel.insert(2, Nanos::from_micros(200));
        wheel.insert(3, Nanos::from_micros(40_000)); // beyond the fine level
        wheel.insert(4, Nanos::from_micros(201));
        wheel.insert(5, Nanos::ZERO);
        wheel.insert(7, Nanos::from_secs(30)); // beyond the coarse level
        assert!(wheel.remove(4));
        assert!(!wheel.remove(4));
        assert_eq!(expire(&mut wheel, 4), Vec::<u32>::new());
        assert_eq!(expire(&mut wheel, TICK_US), vec![1, 5]);
        assert_eq!(expire(&mut wheel, 199), Vec::<u32>::new());
        assert_eq!(expire(&mut wheel, 200 + TICK_US), vec![2]);
        assert_eq!(expire(&mut wheel, 20_000), Vec::<u32>::new());
        assert_eq!(expire(&mut wheel, 39_999), Vec::<u32>::new());
        assert_eq!(expire(&mut wheel, 40_000 + TICK_US), vec![3]);
        assert_eq!(wheel.len(), 1);
        // A long jump releases what is due and keeps the rest.
        assert_eq!(expire(&mut wheel, 29_000_000), Vec::<u32>::new());
        assert_eq!(wheel.len(), 1);
        assert_eq!(expire(&mut wheel, 30_000_000 + TICK_US), vec![7]);
        assert_eq!(wheel.len(), 0);
        // Inserting in the past lands in the next tick to be processed.
        wheel.insert(6, Nanos::from_micros(1));
        assert_eq!(expire(&mut wheel, 30_000_000 + 2 * TICK_US), vec![6]);
    }

    #[test]
    fn every_entry_comes_out_within_a_tick_of_its_due_time() {
        let mut wheel = TimerWheel::new(Nanos::ZERO);
        wheel.ensure(2000);
        let mut state = 1u64;
        let mut due = vec![Nanos::ZERO; 2000];
        let mut out = Vec::new();
        let mut now = 0u64;
        let mut released = 0;
        for step in 0..200_000u64 {
            now += 7_000 + (step % 5) * 3_000;
            wheel.expire(Nanos(now), &mut out);
            for &index in &out {
                let late = now - due[index as usize].0;
                assert!(now >= due[index as usize].0, "early");
                // Within its tick's end plus the step between calls (at most 19 µs).
                assert!(late <= (1 << TICK_SHIFT) + 19_000, "late by {late} ns");
                released += 1;
            }
            out.clear();
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let index = (state >> 33) as usize % 2000;
            if wheel.contains(index) {
                wheel.remove(index);
            } else {
                let delay = (state >> 7) % 60_000_000;
                due[index] = Nanos(now + delay);
                wheel.insert(index, due[index]);
            }
        }
        assert!(released > 10_000, "{released}");
    }
}
