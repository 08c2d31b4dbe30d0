//! The memory of a `mem` device: one region that every dataplane thread reads and writes, and
//! that a read may *lend* to the socket that sends it instead of copying it
//! ([`RegionHandle::lend`]).
//!
//! Why: a `mem` read used to be copied into the dataplane's arena, then copied again by the
//! kernel into the socket. The first copy is what a real device's DMA does for free, and it
//! was the largest user-space cost of a 4 KiB read (`docs/BENCHMARKS.md`). Sending straight
//! from the device's memory is sound only if nothing changes those bytes until the send is
//! done, however long a slow client makes it wait. So a write never changes a block that is
//! lent: it copies the block out of the region into a block of its own ("moved"), changes
//! the copy, and every later access to that block goes to the copy. A block nobody borrows
//! is written in place; a moved block nobody borrows is changed in place too.
//!
//! Concurrency: every [`STRIPE_BYTES`] chunk is guarded by one of [`STRIPE_COUNT`]
//! reader-writer locks (chunk index modulo the count). Reads and lends hold it shared, writes
//! and trims exclusively, so concurrent readers and writers never race and a write is atomic
//! per chunk, more than the 512-byte sector a device promises. A lend counts itself in its
//! block's state under the shared lock; a writer, holding the exclusive lock, sees the count
//! and moves the block instead of writing it. A loan is given back (the count goes down)
//! without the lock: that only lets a later writer write in place.
//!
//! Memory: the region is an anonymous mapping that the kernel commits only where written
//! (`MAP_NORESERVE`), in huge pages where it grants them; block states exist per
//! [`DIRECTORY_BLOCKS`] blocks, from the first lend or move among them.

use std::cell::UnsafeCell;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

/// Bytes of one block: the unit of lending and of moving.
pub const BLOCK_BYTES: usize = 4096;
/// Bytes guarded by one lock.
pub const STRIPE_BYTES: usize = 64 << 10;
/// Locks of a region (chunks share them round robin).
pub const STRIPE_COUNT: usize = 1024;
/// Block states per directory (8 MiB of device).
pub const DIRECTORY_BLOCKS: usize = 2048;
/// A transparent huge page (x86-64 and aarch64 with 4 KiB base pages): regions at least this
/// large ask for them.
const HUGE_PAGE_BYTES: usize = 2 << 20;

const _: () = assert!(STRIPE_BYTES.is_multiple_of(BLOCK_BYTES));
const _: () = assert!(STRIPE_BYTES.is_power_of_two());

/// A block moved out of the region (written while lent): its bytes change only under the
/// chunk's exclusive lock, and only while the block's state holds the only reference.
struct Moved {
    bytes: UnsafeCell<[u8; BLOCK_BYTES]>,
}

// SAFETY: the bytes are written only by `LendingRegion` under the chunk's exclusive lock and
// only while the `Arc` is unique (no loan holds it); everyone else only reads them.
unsafe impl Sync for Moved {}

impl Moved {
    /// The bytes, to read.
    ///
    /// # Safety
    /// Nobody may write them while the slice lives: the caller holds the chunk's lock shared,
    /// or a reference that makes the block shared (so it is copied before any write).
    unsafe fn bytes(&self) -> &[u8; BLOCK_BYTES] {
        // SAFETY: the caller's contract rules out a concurrent write.
        unsafe { &*self.bytes.get() }
    }
}

/// What is known of one block beyond its bytes.
struct BlockState {
    /// Loans of the block's bytes in the region not yet given back.
    lends: AtomicU32,
    /// Null, or the block moved out of the region (from `Arc::into_raw`, owning one
    /// reference): then its bytes are there, not in the region.
    moved: AtomicPtr<Moved>,
}

/// A whole block's bytes lent to a send: they stay as they were when lent until this is
/// dropped, whatever is written meanwhile.
pub struct Lent {
    source: Source,
}

enum Source {
    /// In the region: the block's bytes and its state, kept alive by the queue's handle.
    Region {
        bytes: NonNull<u8>,
        state: NonNull<BlockState>,
        _keep: Arc<RegionHandle>,
    },
    Moved(Arc<Moved>),
}

// SAFETY: the pointers point into the region and its block states, which `_keep` keeps alive;
// the bytes do not change while the loan is counted (writers move the block instead), and the
// count is an atomic. A `Moved` block is immutable while shared.
unsafe impl Send for Lent {}
// SAFETY: see Send; `Lent` only reads.
unsafe impl Sync for Lent {}

impl Lent {
    /// The block's [`BLOCK_BYTES`] bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.source {
            // SAFETY: the region is alive (`_keep`) and holds BLOCK_BYTES bytes here (checked by
            // `lend`); the loan is counted, so no writer changes them while it lives.
            Source::Region { bytes, .. } => unsafe {
                std::slice::from_raw_parts(bytes.as_ptr(), BLOCK_BYTES)
            },
            // SAFETY: this loan holds a reference, so the block is shared and copied before
            // any write (the contract of `Moved::bytes`).
            Source::Moved(block) => unsafe { block.bytes() },
        }
    }

    /// Brings the line that giving the loan back changes into the cache. A server returns the
    /// loans of one send together: after a whole batch has gone through the socket the block
    /// states are cold, and each return is an atomic that waits for its line, so returning
    /// them one by one costs one memory round trip each (`docs/BENCHMARKS.md`); prefetching
    /// them all first overlaps those round trips.
    pub fn prefetch_return(&self) {
        if let Source::Region { state, .. } = &self.source {
            prefetch_line(state.as_ptr().cast());
        }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Source::Region { state, .. } = &self.source {
            // SAFETY: the state lives as long as the region, which `_keep` keeps alive.
            let lends = unsafe { &state.as_ref().lends };
            let before = lends.fetch_sub(1, Ordering::Release);
            debug_assert!(before > 0);
        }
    }
}

impl std::fmt::Debug for Lent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let moved = matches!(self.source, Source::Moved(_));
        f.debug_struct("Lent").field("moved", &moved).finish()
    }
}

/// One thread's handle on a region: loans keep it (and so the region) alive. Each device
/// queue has its own, so lending touches no reference count that other threads share.
pub struct RegionHandle {
    region: Arc<LendingRegion>,
}

impl RegionHandle {
    pub fn new(region: Arc<LendingRegion>) -> Arc<RegionHandle> {
        Arc::new(RegionHandle { region })
    }

    pub fn region(&self) -> &LendingRegion {
        &self.region
    }

    /// Brings what [`Self::lend`] of `offset` reads first into the cache: the chunk's lock and
    /// the block's state. A server that has several reads to lend prefetches them all first,
    /// so their cache misses overlap instead of each waiting in turn (the state table is a
    /// random access per read, and a lend's atomics wait for it). A hint: anything is fine.
    pub fn prefetch_lend(&self, offset: usize) {
        let region = &self.region;
        if offset >= region.len {
            return;
        }
        prefetch_line((region.lock(offset) as *const RwLock<()>).cast());
        if let Some(state) = region.state(offset) {
            prefetch_line((state as *const BlockState).cast());
        }
    }

    /// The block at `offset` (a multiple of [`BLOCK_BYTES`], the block inside the region),
    /// lent: its bytes as of now, for as long as the [`Lent`] lives.
    pub fn lend(self: &Arc<Self>, offset: usize) -> Lent {
        let region = &self.region;
        assert!(offset.is_multiple_of(BLOCK_BYTES));
        assert!(
            offset
                .checked_add(BLOCK_BYTES)
                .is_some_and(|end| end <= region.len),
            "a loan of {offset}+{BLOCK_BYTES} beyond the {} bytes of memory",
            region.len
        );
        let _shared = region
            .lock(offset)
            .read()
            .unwrap_or_else(|p| p.into_inner());
        let state = region.state_created(offset);
        let moved = state.moved.load(Ordering::Acquire);
        if !moved.is_null() {
            // SAFETY: a non-null `moved` owns a reference from `Arc::into_raw` and cannot
            // change while the chunk's lock is held, so the block is alive; the new reference
            // belongs to the loan.
            let block = unsafe {
                Arc::increment_strong_count(moved);
                Arc::from_raw(moved)
            };
            return Lent {
                source: Source::Moved(block),
            };
        }
        // Counted under the shared lock: a writer (exclusive) sees it and moves the block.
        state.lends.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `offset` is inside the mapping (asserted above).
        let bytes = unsafe { region.base.add(offset) };
        // Its bytes are not prefetched: the kernel's copy into the socket streams them, and
        // hinting the block's 64 lines here cost more than it saved (`docs/BENCHMARKS.md`).
        Lent {
            source: Source::Region {
                bytes,
                state: NonNull::from(state),
                _keep: Arc::clone(self),
            },
        }
    }
}

/// The memory of a device of a fixed size: zero until written.
pub struct LendingRegion {
    base: NonNull<u8>,
    len: usize,
    stripes: Box<[RwLock<()>]>,
    states: Box<[OnceLock<Box<[BlockState]>>]>,
}

// SAFETY: the mapping is owned by the region, and every access to its bytes goes through
// `read`, `write`, `zero` and loans: the first three hold the covering chunk's lock (shared
// for reading, exclusive for writing), and a loan's bytes are never written while it lives
// (writers move a lent block). So sharing the region between threads creates no data race.
unsafe impl Send for LendingRegion {}
// SAFETY: see Send.
unsafe impl Sync for LendingRegion {}

impl LendingRegion {
    /// Maps `len` (non-zero) bytes of zeroed anonymous memory.
    pub fn new(len: usize) -> std::io::Result<LendingRegion> {
        assert!(len > 0);
        // SAFETY: an anonymous private mapping at a kernel-chosen address touches no existing
        // memory; the result is checked against MAP_FAILED below.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let Some(base) = NonNull::new(raw.cast::<u8>()) else {
            return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
        };
        if len >= HUGE_PAGE_BYTES {
            // Reads land at random across the region, so with 4 KiB pages nearly every one
            // misses the TLB and walks the page tables: transparent huge pages gave `mem` 5-10 %
            // more replies per server core (docs/BENCHMARKS.md). Advice only: where the kernel
            // has them off, the region keeps 4 KiB pages and the result is ignored.
            // SAFETY: the range is the mapping just created, owned by this region.
            let _ = unsafe { libc::madvise(raw, len, libc::MADV_HUGEPAGE) };
        }
        let blocks = len.div_ceil(BLOCK_BYTES);
        Ok(LendingRegion {
            base,
            len,
            stripes: (0..STRIPE_COUNT).map(|_| RwLock::new(())).collect(),
            states: (0..blocks.div_ceil(DIRECTORY_BLOCKS))
                .map(|_| OnceLock::new())
                .collect(),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Loans made and not given back yet (a sum over every block's state: for tests and
    /// diagnostics, not the data path).
    pub fn loans_outstanding(&self) -> u64 {
        self.states
            .iter()
            .filter_map(OnceLock::get)
            .flat_map(|directory| directory.iter())
            .map(|state| u64::from(state.lends.load(Ordering::Acquire)))
            .sum()
    }

    fn lock(&self, offset: usize) -> &RwLock<()> {
        &self.stripes[(offset / STRIPE_BYTES) % STRIPE_COUNT]
    }

    /// The state of the block at `offset`, if its directory exists (no directory: never lent
    /// nor moved).
    fn state(&self, offset: usize) -> Option<&BlockState> {
        let block = offset / BLOCK_BYTES;
        let directory = self.states[block / DIRECTORY_BLOCKS].get()?;
        Some(&directory[block % DIRECTORY_BLOCKS])
    }

    /// The state of the block at `offset`, its directory created if need be.
    fn state_created(&self, offset: usize) -> &BlockState {
        let block = offset / BLOCK_BYTES;
        let directory = self.states[block / DIRECTORY_BLOCKS].get_or_init(|| {
            (0..DIRECTORY_BLOCKS)
                .map(|_| BlockState {
                    lends: AtomicU32::new(0),
                    moved: AtomicPtr::new(std::ptr::null_mut()),
                })
                .collect()
        });
        &directory[block % DIRECTORY_BLOCKS]
    }

    /// Calls `each(offset, length)` for the pieces of `[offset, offset + len)` that lie in one
    /// block each, in order, holding each chunk's lock (`exclusive` or shared) around its
    /// pieces.
    fn pieces(
        &self,
        offset: usize,
        len: usize,
        exclusive: bool,
        mut each: impl FnMut(usize, usize),
    ) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range {offset}+{len} beyond the {} bytes of memory",
            self.len
        );
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let chunk_end = ((at / STRIPE_BYTES + 1) * STRIPE_BYTES).min(end);
            let lock = self.lock(at);
            let _shared;
            let _exclusive;
            if exclusive {
                _exclusive = lock.write().unwrap_or_else(|p| p.into_inner());
            } else {
                _shared = lock.read().unwrap_or_else(|p| p.into_inner());
            }
            while at < chunk_end {
                let piece = (BLOCK_BYTES - at % BLOCK_BYTES).min(chunk_end - at);
                each(at, piece);
                at += piece;
            }
        }
    }

    /// Where the block at `at` has moved, if it has (the chunk's lock is held).
    fn moved(&self, at: usize) -> Option<NonNull<Moved>> {
        NonNull::new(self.state(at)?.moved.load(Ordering::Acquire))
    }

    /// Copies `[offset, offset + out.len())` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.pieces(offset, out.len(), false, |at, piece| {
            let target = &mut out[at - offset..at - offset + piece];
            match self.moved(at) {
                Some(moved) => {
                    let within = at % BLOCK_BYTES;
                    // SAFETY: the state owns a reference, so the block is alive while the
                    // chunk's lock (held shared) keeps the state; no write runs under it.
                    let bytes = unsafe { moved.as_ref().bytes() };
                    target.copy_from_slice(&bytes[within..within + piece]);
                }
                // SAFETY: `at..at + piece` is inside the mapping (checked by `pieces`); no
                // writer touches the chunk while its lock is held shared, and `target` is
                // exclusively borrowed.
                None => unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.base.as_ptr().add(at),
                        target.as_mut_ptr(),
                        piece,
                    )
                },
            }
        });
    }

    /// Copies `data` to `[offset, offset + data.len())`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.pieces(offset, data.len(), true, |at, piece| {
            let source = &data[at - offset..at - offset + piece];
            self.change(at, piece, |bytes| bytes.copy_from_slice(source));
        });
    }

    /// Zeroes `[offset, offset + len)`.
    pub fn zero(&self, offset: usize, len: usize) {
        self.pieces(offset, len, true, |at, piece| {
            self.change(at, piece, |bytes| bytes.fill(0));
        });
    }

    /// Applies `change` to the `piece` bytes at `at` (inside one block); the caller holds the
    /// chunk's lock exclusively. In place, unless the block is lent: then in a moved copy.
    fn change(&self, at: usize, piece: usize, change: impl FnOnce(&mut [u8])) {
        let within = at % BLOCK_BYTES;
        let block_start = at - within;
        let Some(state) = self.state(at) else {
            // Never lent nor moved.
            // SAFETY: inside the mapping (checked by `pieces`), under the exclusive lock.
            change(unsafe { self.region_bytes_mut(at, piece) });
            return;
        };
        if let Some(moved) = NonNull::new(state.moved.load(Ordering::Acquire)) {
            // SAFETY: the state owns a reference from `Arc::into_raw`, alive while the
            // exclusive lock keeps the state; `ManuallyDrop` leaves that reference in place.
            let owned = std::mem::ManuallyDrop::new(unsafe { Arc::from_raw(moved.as_ptr()) });
            if Arc::strong_count(&owned) == 1 {
                // SAFETY: the state holds the only reference and the lock is held
                // exclusively, so nobody sees the bytes change (loans are made under the lock).
                let bytes = unsafe { &mut *owned.bytes.get() };
                change(&mut bytes[within..within + piece]);
            } else {
                // SAFETY: shared, so nobody writes it (the contract of `Moved::bytes`).
                let copy = Self::moved_copy(unsafe { owned.bytes() }, within, piece, change);
                Self::replace_moved(state, copy);
            }
            return;
        }
        if state.lends.load(Ordering::Acquire) == 0 {
            // SAFETY: inside the mapping, under the exclusive lock, and nobody borrows it (a
            // new loan needs the lock).
            change(unsafe { self.region_bytes_mut(at, piece) });
            return;
        }
        // Lent: the block moves out of the region with the change applied; the loans keep
        // the region's bytes as they are, and nobody writes them again.
        // SAFETY: a whole block inside the mapping (a region's last block may be short:
        // `region_block` covers what exists), read under the exclusive lock.
        let current = unsafe { self.region_block(block_start) };
        let copy = Self::moved_copy(&current, within, piece, change);
        Self::replace_moved(state, copy);
    }

    /// A new moved block: `current` with `change` applied to `piece` bytes at `within`.
    fn moved_copy(
        current: &[u8; BLOCK_BYTES],
        within: usize,
        piece: usize,
        change: impl FnOnce(&mut [u8]),
    ) -> Arc<Moved> {
        let mut bytes = *current;
        change(&mut bytes[within..within + piece]);
        Arc::new(Moved {
            bytes: UnsafeCell::new(bytes),
        })
    }

    /// Puts `block` in the state (the exclusive lock is held) and drops the state's reference
    /// to the one it replaces.
    fn replace_moved(state: &BlockState, block: Arc<Moved>) {
        let old = state
            .moved
            .swap(Arc::into_raw(block).cast_mut(), Ordering::AcqRel);
        release(old);
    }

    /// `piece` bytes of the region at `at`, to change.
    ///
    /// # Safety
    /// The range is inside the mapping, the caller holds its chunk's lock exclusively, and the
    /// bytes are not lent.
    #[allow(clippy::mut_from_ref)]
    unsafe fn region_bytes_mut(&self, at: usize, piece: usize) -> &mut [u8] {
        // SAFETY: the caller's contract: in bounds, and nobody else reads or writes them.
        unsafe { std::slice::from_raw_parts_mut(self.base.as_ptr().add(at), piece) }
    }

    /// A copy of the block at `block_start` (zeroes beyond the region's end).
    ///
    /// # Safety
    /// The caller holds the block's chunk lock (so no write runs).
    unsafe fn region_block(&self, block_start: usize) -> [u8; BLOCK_BYTES] {
        let mut copy = [0u8; BLOCK_BYTES];
        let len = BLOCK_BYTES.min(self.len - block_start);
        // SAFETY: `block_start..block_start + len` is inside the mapping; the caller's lock
        // rules out a concurrent write.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.as_ptr().add(block_start),
                copy.as_mut_ptr(),
                len,
            )
        };
        copy
    }
}

/// Asks the CPU to bring the cache line at `address` into all its caches (a hint; nothing on
/// other architectures).
fn prefetch_line(address: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it reads nothing the program can observe, and it does not
    // fault, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(address.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

/// Drops the reference a block state held (nothing for null).
fn release(block: *mut Moved) {
    if !block.is_null() {
        // SAFETY: the pointer came from `Arc::into_raw` and the state that owned its reference
        // no longer holds it.
        drop(unsafe { Arc::from_raw(block) });
    }
}

impl Drop for LendingRegion {
    fn drop(&mut self) {
        for directory in self.states.iter_mut().filter_map(OnceLock::get_mut) {
            for state in directory.iter_mut() {
                // Loans hold the region alive through their handle, so none is left.
                debug_assert_eq!(*state.lends.get_mut(), 0);
                release(std::mem::replace(
                    state.moved.get_mut(),
                    std::ptr::null_mut(),
                ));
            }
        }
        // SAFETY: unmaps exactly the mapping created in `new`; no reference outlives self.
        let rc = unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
        debug_assert_eq!(rc, 0);
    }
}

impl std::fmt::Debug for LendingRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LendingRegion")
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    fn handle(len: usize) -> Arc<RegionHandle> {
        RegionHandle::new(Arc::new(
            LendingRegion::new(len).unwrap_or_else(|e| panic!("{e}")),
        ))
    }

    fn read(region: &LendingRegion, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0xA5; len];
        region.read(offset, &mut out);
        out
    }

    /// Two writer threads, each writing `rounds` whole blocks of one byte value (a different
    /// sequence per thread) to `blocks` round robin.
    fn spawn_writers(
        region: &Arc<LendingRegion>,
        blocks: [usize; 4],
        rounds: usize,
    ) -> Vec<std::thread::JoinHandle<()>> {
        (0..2u8)
            .map(|seed| {
                let region = Arc::clone(region);
                std::thread::spawn(move || {
                    for round in 0..rounds {
                        let value = seed.wrapping_mul(101).wrapping_add(round as u8);
                        region.write(blocks[round % blocks.len()], &[value; BLOCK_BYTES]);
                    }
                })
            })
            .collect()
    }

    /// Lends `blocks` round robin from `first` for `rounds` loans, holding the last 8 while
    /// writers may run: each loan must be whole when made and unchanged when given back.
    fn lend_and_check(handle: &Arc<RegionHandle>, blocks: &[usize], first: usize, rounds: usize) {
        let mut held = std::collections::VecDeque::new();
        for round in 0..rounds {
            let lent = handle.lend(blocks[(round + first) % blocks.len()]);
            let value = lent.bytes()[0];
            assert!(lent.bytes().iter().all(|&b| b == value), "a torn loan");
            held.push_back((value, lent));
            if held.len() > 8 {
                let (value, lent) = held.pop_front().unwrap_or_else(|| unreachable!());
                assert!(lent.bytes().iter().all(|&b| b == value), "a loan changed");
            }
        }
    }

    #[test]
    fn reads_back_what_was_written_across_blocks_and_chunks() {
        let handle = handle(4 << 20);
        let region = handle.region();
        let data = pattern(200_000, 7);
        region.write(STRIPE_BYTES - 1536, &data);
        let back = read(region, STRIPE_BYTES - 2048, data.len() + 1024);
        assert!(back[..512].iter().all(|&b| b == 0));
        assert_eq!(&back[512..512 + data.len()], &data[..]);
        assert!(back[512 + data.len()..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_loan_keeps_its_bytes_through_writes_and_trims() {
        let handle = handle(1 << 20);
        let region = handle.region();
        let first = pattern(BLOCK_BYTES, 1);
        region.write(8192, &first);
        let lent = handle.lend(8192);
        let never_written = handle.lend(0);
        // Both blocks move out of the region: the loans keep what they saw.
        region.write(8192 + 100, &[9; 50]);
        region.write(0, &pattern(BLOCK_BYTES, 2));
        assert_eq!(lent.bytes(), &first[..]);
        assert!(never_written.bytes().iter().all(|&b| b == 0));
        let now = read(region, 8192, BLOCK_BYTES);
        assert_eq!(&now[..100], &first[..100]);
        assert_eq!(&now[100..150], &[9; 50]);
        assert_eq!(&now[150..], &first[150..]);
        assert_eq!(read(region, 0, BLOCK_BYTES), pattern(BLOCK_BYTES, 2));
        // A loan of a moved block, then a trim of it: the trim copies again.
        let second = handle.lend(8192);
        region.zero(8192, BLOCK_BYTES);
        assert!(read(region, 8192, BLOCK_BYTES).iter().all(|&b| b == 0));
        assert_eq!(lent.bytes(), &first[..]);
        assert_eq!(&second.bytes()[100..150], &[9; 50]);
        drop((lent, second, never_written));
        // Nothing borrows the moved block any more: it is changed in place.
        region.write(8192, &first);
        assert_eq!(read(region, 8192, BLOCK_BYTES), first);
    }

    #[test]
    fn a_returned_loan_lets_writes_go_to_the_region_again() {
        let handle = handle(1 << 20);
        let region = handle.region();
        drop(handle.lend(4096));
        region.write(4096, &[3; BLOCK_BYTES]);
        assert!(region.moved(4096).is_none());
        assert_eq!(read(region, 4096, BLOCK_BYTES), vec![3; BLOCK_BYTES]);
    }

    #[test]
    fn prefetches_are_hints_anywhere_and_loans_are_counted_until_dropped() {
        let handle = handle(1 << 20);
        let region = handle.region();
        // Before any state exists, beyond the region, on an unaligned offset: nothing happens.
        handle.prefetch_lend(0);
        handle.prefetch_lend(1 << 20);
        handle.prefetch_lend(usize::MAX);
        handle.prefetch_lend(4097);
        let loans: Vec<Lent> = (0..4)
            .map(|block| handle.lend(block * BLOCK_BYTES))
            .collect();
        handle.prefetch_lend(BLOCK_BYTES);
        assert_eq!(region.loans_outstanding(), 4);
        for lent in &loans {
            lent.prefetch_return();
        }
        drop(loans);
        assert_eq!(region.loans_outstanding(), 0);
    }

    #[test]
    fn partial_trims_zero_only_their_bytes() {
        let handle = handle(1 << 20);
        let region = handle.region();
        let data = pattern(3 * BLOCK_BYTES, 3);
        region.write(0, &data);
        let lent = handle.lend(BLOCK_BYTES);
        region.zero(512, BLOCK_BYTES + 1024);
        let back = read(region, 0, data.len());
        assert_eq!(&back[..512], &data[..512]);
        assert!(back[512..BLOCK_BYTES + 1536].iter().all(|&b| b == 0));
        assert_eq!(&back[BLOCK_BYTES + 1536..], &data[BLOCK_BYTES + 1536..]);
        assert_eq!(lent.bytes(), &data[BLOCK_BYTES..2 * BLOCK_BYTES]);
    }

    #[test]
    fn a_short_last_block_moves_whole() {
        let handle = handle(2 * BLOCK_BYTES + 512);
        let region = handle.region();
        let lent = handle.lend(BLOCK_BYTES);
        region.write(2 * BLOCK_BYTES, &[5; 512]);
        region.write(BLOCK_BYTES, &[6; BLOCK_BYTES]);
        assert!(lent.bytes().iter().all(|&b| b == 0));
        assert_eq!(read(region, 2 * BLOCK_BYTES, 512), vec![5; 512]);
        assert_eq!(read(region, BLOCK_BYTES, BLOCK_BYTES), vec![6; BLOCK_BYTES]);
    }

    #[test]
    fn loans_outlive_the_device_handle_that_made_them() {
        let handle = handle(1 << 20);
        handle.region().write(0, &[8; BLOCK_BYTES]);
        let lent = handle.lend(0);
        drop(handle);
        assert_eq!(lent.bytes(), &[8; BLOCK_BYTES][..]);
    }

    #[test]
    fn threads_lending_and_writing_see_whole_blocks() {
        let handle = handle(64 << 10);
        let blocks = [0, BLOCK_BYTES, 2 * BLOCK_BYTES, 3 * BLOCK_BYTES];
        let writers = spawn_writers(&handle.region, blocks, 2000);
        lend_and_check(&handle, &blocks, 0, 4000);
        for writer in writers {
            writer
                .join()
                .unwrap_or_else(|_| panic!("a writer panicked"));
        }
    }

    #[test]
    fn lenders_and_writers_on_many_threads_never_see_a_loan_change() {
        // Two chunks (two stripes) of one state directory; lenders on two threads, each with
        // its own handle as device queues have, race writers of whole-block patterns.
        let region =
            Arc::new(LendingRegion::new(2 * STRIPE_BYTES).unwrap_or_else(|e| panic!("{e}")));
        let blocks = [0, BLOCK_BYTES, STRIPE_BYTES, STRIPE_BYTES + BLOCK_BYTES];
        let writers = spawn_writers(&region, blocks, 3000);
        let lenders: Vec<_> = (0..2usize)
            .map(|first| {
                let handle = RegionHandle::new(Arc::clone(&region));
                std::thread::spawn(move || lend_and_check(&handle, &blocks, first, 6000))
            })
            .collect();
        for thread in writers.into_iter().chain(lenders) {
            thread
                .join()
                .unwrap_or_else(|_| panic!("a thread panicked"));
        }
        assert_eq!(region.loans_outstanding(), 0);
        // What the writers left is what reads and new loans see.
        let handle = RegionHandle::new(Arc::clone(&region));
        for block in blocks {
            let lent = handle.lend(block);
            assert_eq!(lent.bytes(), read(&region, block, BLOCK_BYTES).as_slice());
        }
    }

    #[test]
    fn chunks_are_written_whole_under_many_threads() {
        let region =
            Arc::new(LendingRegion::new(4 * STRIPE_BYTES).unwrap_or_else(|e| panic!("{e}")));
        let mut zeroes = vec![1u8; 100];
        region.read(STRIPE_BYTES - 50, &mut zeroes);
        assert!(zeroes.iter().all(|&b| b == 0));
        // Writers of whole, distinct patterns over a chunk boundary; readers see one pattern
        // per chunk, never a mix inside a chunk.
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let region = Arc::clone(&region);
                std::thread::spawn(move || {
                    let data = vec![t + 1; 2 * STRIPE_BYTES];
                    let mut back = vec![0u8; 2 * STRIPE_BYTES];
                    for _ in 0..200 {
                        region.write(STRIPE_BYTES, &data);
                        region.read(STRIPE_BYTES, &mut back);
                        for chunk in back.chunks(STRIPE_BYTES) {
                            assert!(chunk.iter().all(|&b| b == chunk[0]));
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread
                .join()
                .unwrap_or_else(|_| panic!("a thread panicked"));
        }
        region.zero(STRIPE_BYTES + 10, 20);
        let mut back = vec![9u8; 40];
        region.read(STRIPE_BYTES, &mut back);
        assert!(back[10..30].iter().all(|&b| b == 0));
        assert_ne!(back[0], 0);
    }
}
