//! The extent allocator: one bit per block of the extent area, in memory only. It is rebuilt
//! from the index when a table is opened (every used slot names its extent), so it is never
//! written to the device and cannot disagree with the index after a restart.
//!
//! Freed extents are *deferred*: a value replaced or deleted since the last FLUSH may still be
//! what the on-device index names after a crash, so its blocks are not reused until a FLUSH has
//! made the change durable ([`ExtentAllocator::release_deferred`]). Memory is bounded by the
//! area: one bit per block, and at most one deferred entry per allocated extent.
//!
//! Deferred frees are numbered: with operations in flight a FLUSH covers only the frees that
//! existed when it was submitted (their bucket writes had completed), so it releases the
//! entries below the mark taken then ([`ExtentAllocator::deferred_mark`]), never a free whose
//! bucket write may still be in the device's volatile cache.

/// Bit map of the extent area, first fit from a rotating cursor.
#[derive(Clone, Debug)]
pub struct ExtentAllocator {
    /// Absolute block index of the area's first block.
    start_block: u64,
    block_count: u64,
    /// Bit set: the block holds a live value or one freed since the last FLUSH.
    used: Vec<u64>,
    used_block_count: u64,
    /// Where the next search starts (relative), so allocations spread over the area.
    cursor: u64,
    /// Extents freed since the last FLUSH: (sequence number, absolute start, blocks), in
    /// sequence order.
    deferred: std::collections::VecDeque<(u64, u64, u64)>,
    /// The sequence number of the next deferred free.
    deferred_next: u64,
}

/// An extent named by the index overlaps another or leaves the area.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("extent of {blocks} blocks at block {start_block} overlaps another or leaves the area")]
pub struct ExtentConflict {
    pub start_block: u64,
    pub blocks: u64,
}

impl ExtentAllocator {
    pub fn new(start_block: u64, block_count: u64) -> ExtentAllocator {
        let words = usize::try_from(block_count.div_ceil(64)).unwrap_or(usize::MAX);
        ExtentAllocator {
            start_block,
            block_count,
            used: vec![0; words],
            used_block_count: 0,
            cursor: 0,
            deferred: std::collections::VecDeque::new(),
            deferred_next: 0,
        }
    }

    pub const fn used_block_count(&self) -> u64 {
        self.used_block_count
    }

    pub const fn block_count(&self) -> u64 {
        self.block_count
    }

    /// Blocks freed since the last FLUSH, not yet reusable.
    pub fn deferred_block_count(&self) -> u64 {
        self.deferred.iter().map(|&(_, _, blocks)| blocks).sum()
    }

    fn is_used(&self, relative: u64) -> bool {
        self.used[(relative / 64) as usize] & (1 << (relative % 64)) != 0
    }

    fn set(&mut self, relative: u64, blocks: u64, used: bool) {
        for block in relative..relative + blocks {
            let word = &mut self.used[(block / 64) as usize];
            let bit = 1u64 << (block % 64);
            assert_eq!(
                *word & bit != 0,
                !used,
                "block {block} already in that state"
            );
            *word ^= bit;
        }
        if used {
            self.used_block_count += blocks;
        } else {
            self.used_block_count -= blocks;
        }
    }

    /// Marks an extent found in the index as used (opening a table).
    pub fn mark_used(&mut self, start_block: u64, blocks: u64) -> Result<(), ExtentConflict> {
        let conflict = ExtentConflict {
            start_block,
            blocks,
        };
        let relative = start_block.checked_sub(self.start_block).ok_or(conflict)?;
        if relative
            .checked_add(blocks)
            .is_none_or(|end| end > self.block_count)
            || (relative..relative + blocks).any(|block| self.is_used(block))
        {
            return Err(conflict);
        }
        self.set(relative, blocks, true);
        Ok(())
    }

    /// `blocks` (1 ..= 16) consecutive free blocks, marked used; `None` when no run that long
    /// is free. Returns the absolute first block.
    pub fn allocate(&mut self, blocks: u64) -> Option<u64> {
        assert!(blocks > 0);
        if blocks > self.block_count - self.used_block_count {
            return None;
        }
        // Scan the area once, starting at the cursor; a run may not wrap past the end.
        let mut run_start = self.cursor;
        let mut run_length = 0;
        for step in 0..self.block_count + blocks {
            let block = (self.cursor + step) % self.block_count;
            if block == 0 && run_length > 0 {
                run_length = 0;
            }
            if self.is_used(block) {
                run_length = 0;
                continue;
            }
            if run_length == 0 {
                run_start = block;
            }
            run_length += 1;
            if run_length == blocks {
                self.set(run_start, blocks, true);
                self.cursor = (run_start + blocks) % self.block_count;
                return Some(self.start_block + run_start);
            }
        }
        None
    }

    /// Frees an extent at once: it was never named by the on-device index (its value write
    /// failed).
    pub fn free_now(&mut self, start_block: u64, blocks: u64) {
        let relative = start_block - self.start_block;
        self.set(relative, blocks, false);
    }

    /// Frees an extent once the next FLUSH completes.
    pub fn free_deferred(&mut self, start_block: u64, blocks: u64) {
        assert!(start_block >= self.start_block);
        assert!(blocks > 0);
        self.deferred
            .push_back((self.deferred_next, start_block, blocks));
        self.deferred_next += 1;
    }

    /// The mark a FLUSH takes when it is submitted: the frees deferred so far.
    pub const fn deferred_mark(&self) -> u64 {
        self.deferred_next
    }

    /// A FLUSH submitted at `mark` completed: the extents deferred before it become free.
    pub fn release_deferred_until(&mut self, mark: u64) {
        assert!(mark <= self.deferred_next, "a mark from the future");
        while let Some(&(sequence, start_block, blocks)) = self.deferred.front() {
            if sequence >= mark {
                break;
            }
            self.deferred.pop_front();
            self.free_now(start_block, blocks);
        }
    }

    /// A FLUSH completed with nothing else in flight: every deferred extent becomes free.
    pub fn release_deferred(&mut self) {
        self.release_deferred_until(self.deferred_next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_runs_and_reuses_only_after_release() {
        let mut allocator = ExtentAllocator::new(100, 10);
        assert_eq!(allocator.allocate(4), Some(100));
        assert_eq!(allocator.allocate(4), Some(104));
        assert_eq!(allocator.allocate(4), None);
        assert_eq!(allocator.allocate(2), Some(108));
        assert_eq!(allocator.allocate(1), None);
        allocator.free_deferred(104, 4);
        assert_eq!(allocator.allocate(1), None);
        assert_eq!(allocator.deferred_block_count(), 4);
        allocator.release_deferred();
        assert_eq!(allocator.used_block_count(), 6);
        assert_eq!(allocator.allocate(3), Some(104));
        allocator.free_now(100, 4);
        // A run does not wrap around the end of the area.
        assert_eq!(allocator.allocate(5), None);
        assert_eq!(allocator.allocate(4), Some(100));
    }

    #[test]
    fn a_flush_releases_only_what_was_deferred_before_its_mark() {
        let mut allocator = ExtentAllocator::new(0, 8);
        assert_eq!(allocator.allocate(4), Some(0));
        assert_eq!(allocator.allocate(4), Some(4));
        allocator.free_deferred(0, 4);
        let mark = allocator.deferred_mark();
        allocator.free_deferred(4, 4);
        allocator.release_deferred_until(mark);
        assert_eq!(allocator.used_block_count(), 4);
        assert_eq!(allocator.deferred_block_count(), 4);
        allocator.release_deferred_until(mark);
        assert_eq!(allocator.used_block_count(), 4);
        allocator.release_deferred();
        assert_eq!(allocator.used_block_count(), 0);
    }

    #[test]
    fn mark_used_refuses_overlaps_and_strays() {
        let mut allocator = ExtentAllocator::new(10, 100);
        assert_eq!(allocator.mark_used(10, 16), Ok(()));
        assert!(allocator.mark_used(25, 2).is_err());
        assert!(allocator.mark_used(9, 1).is_err());
        assert!(allocator.mark_used(100, 11).is_err());
        assert_eq!(allocator.mark_used(26, 84), Ok(()));
        assert_eq!(allocator.allocate(1), None);
    }
}
