//! Page allocation inside a dataplane thread's buffer arena: a binary buddy allocator over
//! page indexes.
//!
//! Why: every request's data lives in one contiguous run of the thread's registered arena, so
//! the device reads straight into it and the socket sends straight out of it (no copy), and
//! the whole arena is a single registered buffer (index 0) for `ReadFixed`/`WriteFixed`.
//! Requests range from 512 bytes to 1 MiB, so runs are powers of two pages from one page
//! (4 KiB) up to [`ORDER_MAX`] (256 pages, 1 MiB); buddies coalesce on free so large runs come
//! back. The allocator never grows: when no run fits, the caller waits (backpressure).
//!
//! This module knows nothing of memory: it hands out page numbers. `uring::Arena` turns them
//! into addresses. Free blocks form intrusive doubly-linked lists (one per order) threaded
//! through per-page arrays allocated once, so `allocate` and `free` are O([`ORDER_MAX`]).

/// One page: the unit of allocation and the alignment of every run (O_DIRECT safe).
pub const PAGE_SIZE: usize = 4096;
/// Largest run: 2^8 pages = 1 MiB, the protocol's `max_io_size`.
pub const ORDER_MAX: u8 = 8;
const ORDER_COUNT: usize = ORDER_MAX as usize + 1;
/// Bytes of the largest run.
pub const RUN_SIZE_MAX: usize = PAGE_SIZE << ORDER_MAX;

const _: () = assert!(RUN_SIZE_MAX == 1 << 20);
const _: () = assert!(PAGE_SIZE == reflex_flash::aligned::PAGE_SIZE);

const NONE: u32 = u32::MAX;
/// Page states: interior of a block (not a block head), or a block head, free or in use.
const STATE_INTERIOR: u8 = 0;
const STATE_FREE: u8 = 0x40;
const STATE_USED: u8 = 0x80;
/// A single free page parked in the allocator's cache (not in a free list, never merged).
const STATE_CACHED: u8 = 0x20;
/// Single pages kept out of the buddy lists, so the common 4 KiB request neither splits a
/// block on allocation nor merges up to the largest order on free.
pub const PAGE_CACHE_MAX: usize = 512;
const STATE_ORDER_MASK: u8 = 0x0f;

/// A run of `2^order` pages starting at `first_page`, owned by whoever allocated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRun {
    pub first_page: u32,
    pub order: u8,
}

impl PageRun {
    pub fn page_count(self) -> u32 {
        1 << self.order
    }

    pub fn size_bytes(self) -> usize {
        PAGE_SIZE << self.order
    }

    /// Byte offset of the run inside the arena.
    pub fn offset_bytes(self) -> usize {
        self.first_page as usize * PAGE_SIZE
    }
}

/// The order of the smallest run holding `size_bytes` (1 ..= [`RUN_SIZE_MAX`]).
pub fn order_for(size_bytes: usize) -> u8 {
    assert!(size_bytes > 0);
    assert!(size_bytes <= RUN_SIZE_MAX);
    let pages = size_bytes.div_ceil(PAGE_SIZE);
    pages.next_power_of_two().trailing_zeros() as u8
}

#[derive(Debug)]
pub struct PageAllocator {
    page_count: u32,
    free_pages: u32,
    free_heads: [u32; ORDER_COUNT],
    next: Box<[u32]>,
    prev: Box<[u32]>,
    state: Box<[u8]>,
    /// Free single pages outside the buddy lists, most recently freed last.
    cache: Vec<u32>,
}

impl PageAllocator {
    /// An allocator over `page_count` pages, a non-zero multiple of the largest run.
    pub fn new(page_count: u32) -> PageAllocator {
        let max_pages = 1u32 << ORDER_MAX;
        assert!(page_count > 0);
        assert!(
            page_count.is_multiple_of(max_pages),
            "{page_count} pages not a multiple of {max_pages}"
        );
        let len = page_count as usize;
        let mut allocator = PageAllocator {
            page_count,
            free_pages: 0,
            free_heads: [NONE; ORDER_COUNT],
            next: vec![NONE; len].into_boxed_slice(),
            prev: vec![NONE; len].into_boxed_slice(),
            state: vec![STATE_INTERIOR; len].into_boxed_slice(),
            cache: Vec::with_capacity(PAGE_CACHE_MAX),
        };
        // Push in reverse so the lowest addresses are handed out first.
        for block in (0..page_count / max_pages).rev() {
            allocator.push_free(block * max_pages, ORDER_MAX);
        }
        assert_eq!(allocator.free_pages, page_count);
        allocator
    }

    pub fn page_count(&self) -> u32 {
        self.page_count
    }

    /// Free pages, cached single pages included.
    pub fn free_pages(&self) -> u32 {
        self.free_pages + self.cache.len() as u32
    }

    /// A run of `2^order` pages, or `None` when no free block is large enough.
    pub fn allocate(&mut self, order: u8) -> Option<PageRun> {
        assert!(order <= ORDER_MAX);
        if order == 0
            && let Some(first_page) = self.cache.pop()
        {
            assert_eq!(self.state[first_page as usize], STATE_CACHED);
            self.state[first_page as usize] = STATE_USED;
            return Some(PageRun {
                first_page,
                order: 0,
            });
        }
        match self.allocate_from_lists(order) {
            Some(run) => Some(run),
            None if !self.cache.is_empty() => {
                // Cached pages may be what keeps a larger block from merging back.
                self.drain_cache();
                self.allocate_from_lists(order)
            }
            None => None,
        }
    }

    /// Gives every cached page back to the buddy lists (merging them).
    fn drain_cache(&mut self) {
        while let Some(first_page) = self.cache.pop() {
            assert_eq!(self.state[first_page as usize], STATE_CACHED);
            self.state[first_page as usize] = STATE_USED;
            self.free_to_lists(PageRun {
                first_page,
                order: 0,
            });
        }
    }

    fn allocate_from_lists(&mut self, order: u8) -> Option<PageRun> {
        let mut found = order;
        while self.free_heads[found as usize] == NONE {
            if found == ORDER_MAX {
                return None;
            }
            found += 1;
        }
        let first_page = self.free_heads[found as usize];
        self.remove_free(first_page, found);
        // Split, giving back the upper halves.
        while found > order {
            found -= 1;
            self.push_free(first_page + (1 << found), found);
        }
        self.state[first_page as usize] = STATE_USED | order;
        Some(PageRun { first_page, order })
    }

    /// Returns a run from [`allocate`](Self::allocate): a single page to the cache while it
    /// has room, anything else to the buddy lists, merging it with free buddies.
    pub fn free(&mut self, run: PageRun) {
        if run.order == 0 && self.cache.len() < PAGE_CACHE_MAX {
            assert!(run.first_page < self.page_count);
            assert_eq!(
                self.state[run.first_page as usize], STATE_USED,
                "free of a run that is not allocated: {run:?}"
            );
            self.state[run.first_page as usize] = STATE_CACHED;
            self.cache.push(run.first_page);
            return;
        }
        self.free_to_lists(run);
    }

    fn free_to_lists(&mut self, run: PageRun) {
        let PageRun {
            mut first_page,
            mut order,
        } = run;
        assert!(first_page < self.page_count);
        assert_eq!(
            self.state[first_page as usize],
            STATE_USED | order,
            "free of a run that is not allocated: {run:?}"
        );
        self.state[first_page as usize] = STATE_INTERIOR;
        // remove_free and push_free keep free_pages in step with the free lists.
        while order < ORDER_MAX {
            let buddy = first_page ^ (1 << order);
            if self.state[buddy as usize] != STATE_FREE | order {
                break;
            }
            self.remove_free(buddy, order);
            first_page = first_page.min(buddy);
            order += 1;
        }
        self.push_free(first_page, order);
        debug_assert!(self.free_pages <= self.page_count);
    }

    fn push_free(&mut self, first_page: u32, order: u8) {
        let index = first_page as usize;
        assert_eq!(first_page % (1 << order), 0, "misaligned block");
        let head = self.free_heads[order as usize];
        self.next[index] = head;
        self.prev[index] = NONE;
        if head != NONE {
            self.prev[head as usize] = first_page;
        }
        self.free_heads[order as usize] = first_page;
        self.state[index] = STATE_FREE | order;
        self.free_pages += 1 << order;
    }

    fn remove_free(&mut self, first_page: u32, order: u8) {
        let index = first_page as usize;
        assert_eq!(self.state[index], STATE_FREE | order);
        let (prev, next) = (self.prev[index], self.next[index]);
        if prev == NONE {
            self.free_heads[order as usize] = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next != NONE {
            self.prev[next as usize] = prev;
        }
        self.state[index] = STATE_INTERIOR;
        self.free_pages -= 1 << order;
    }

    /// O(pages) consistency check for tests: free lists and states agree with the count.
    pub fn check(&self) {
        let mut counted = 0u32;
        for order in 0..=ORDER_MAX {
            let mut page = self.free_heads[order as usize];
            while page != NONE {
                assert_eq!(self.state[page as usize] & !STATE_ORDER_MASK, STATE_FREE);
                assert_eq!(self.state[page as usize] & STATE_ORDER_MASK, order);
                counted += 1 << order;
                page = self.next[page as usize];
            }
        }
        assert_eq!(counted, self.free_pages);
        for &page in &self.cache {
            assert_eq!(self.state[page as usize], STATE_CACHED);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders() {
        assert_eq!(order_for(1), 0);
        assert_eq!(order_for(4096), 0);
        assert_eq!(order_for(4097), 1);
        assert_eq!(order_for(12 * 1024), 2);
        assert_eq!(order_for(1 << 20), ORDER_MAX);
    }

    #[test]
    fn allocate_everything_then_coalesce() {
        let mut allocator = PageAllocator::new(512);
        let mut runs = Vec::new();
        while let Some(run) = allocator.allocate(0) {
            runs.push(run);
        }
        assert_eq!(runs.len(), 512);
        assert_eq!(allocator.free_pages(), 0);
        assert!(allocator.allocate(0).is_none());
        let mut pages: Vec<u32> = runs.iter().map(|r| r.first_page).collect();
        pages.sort_unstable();
        pages.dedup();
        assert_eq!(pages.len(), 512, "runs overlap");
        // Free in an interleaved order; everything must merge back into 1 MiB blocks.
        for run in runs.iter().step_by(2).chain(runs.iter().skip(1).step_by(2)) {
            allocator.free(*run);
            allocator.check();
        }
        assert_eq!(allocator.free_pages(), 512);
        let a = allocator.allocate(ORDER_MAX);
        let b = allocator.allocate(ORDER_MAX);
        assert!(a.is_some() && b.is_some());
        assert!(allocator.allocate(0).is_none());
    }

    #[test]
    fn mixed_sizes_never_overlap() {
        let mut allocator = PageAllocator::new(1024);
        let mut owner = vec![usize::MAX; 1024];
        let mut live: Vec<PageRun> = Vec::new();
        let mut seed = 12345u64;
        for step in 0..20_000usize {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            if seed.is_multiple_of(3) && !live.is_empty() {
                let run = live.swap_remove((seed as usize / 3) % live.len());
                for page in run.first_page..run.first_page + run.page_count() {
                    owner[page as usize] = usize::MAX;
                }
                allocator.free(run);
            } else if let Some(run) = allocator.allocate((seed % 9) as u8) {
                for page in run.first_page..run.first_page + run.page_count() {
                    assert_eq!(owner[page as usize], usize::MAX, "page handed out twice");
                    owner[page as usize] = step;
                }
                live.push(run);
            }
            if step.is_multiple_of(1000) {
                allocator.check();
            }
        }
        for run in live.drain(..) {
            allocator.free(run);
        }
        allocator.check();
        assert_eq!(allocator.free_pages(), 1024);
    }
}
