//! The buffer arena of one dataplane: the only module of `reflex-dataplane` with `unsafe`.
//!
//! Why raw pointers: request data lives in runs of one page-aligned allocation that is
//! registered once with the kernel (io_uring fixed buffer 0), and while the kernel writes a
//! READ into one run the dataplane copies a WRITE payload into another. A `&mut` to the whole
//! allocation would claim exclusive access to memory the kernel is writing, so the arena keeps
//! only its base pointer and hands out slices of single runs ([`Arena::run_mut`]) or the
//! base address the driver computes its operations' addresses from ([`Arena::base_ptr`]).
//!
//! Contract (kept by the request state machine in `core`, asserted on every transition): a
//! run belongs to exactly one request; while a driver operation (receive, send, device I/O) uses
//! it, the dataplane neither reads, writes nor frees it. A driver that cannot drain its
//! operations before dropping the dataplane calls [`Arena::leak_on_drop`] so the memory is
//! never freed under the kernel's feet.

use reflex_flash::aligned::AlignedBuf;

use crate::buffers::{PAGE_SIZE, PageRun};

pub struct Arena {
    memory: Option<AlignedBuf>,
    base: *mut u8,
    size_bytes: usize,
    leak_on_drop: bool,
}

// SAFETY: the arena owns its allocation like a `Box<[u8]>`; moving it to another thread moves
// that ownership. It is not `Sync`: only the owning thread hands out pointers.
unsafe impl Send for Arena {}

impl Arena {
    pub fn new(size_bytes: usize) -> Arena {
        assert!(size_bytes > 0);
        assert!(size_bytes.is_multiple_of(PAGE_SIZE));
        let mut memory = AlignedBuf::new_zeroed(size_bytes);
        let base = memory.as_mut_ptr();
        assert!((base as usize).is_multiple_of(PAGE_SIZE));
        Arena {
            memory: Some(memory),
            base,
            size_bytes,
            leak_on_drop: false,
        }
    }

    pub fn size_bytes(&self) -> usize {
        self.size_bytes
    }

    /// The whole arena's address, for registering it with the kernel.
    pub fn base_ptr(&self) -> *mut u8 {
        self.base
    }

    fn check(&self, run: PageRun, len: usize) {
        assert!(len <= run.size_bytes(), "length {len} beyond {run:?}");
        assert!(
            run.offset_bytes() + run.size_bytes() <= self.size_bytes,
            "{run:?} beyond the arena"
        );
    }

    /// The first `len` bytes of a run owned by the caller's request with no operation on it.
    pub fn run_mut(&mut self, run: PageRun, len: usize) -> &mut [u8] {
        self.check(run, len);
        // SAFETY: in bounds (checked); the allocation outlives the borrow; the run belongs to
        // one request and no operation uses it (module contract), and the slice covers only
        // this run, so no other run in use is aliased.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(run.offset_bytes()), len) }
    }

    /// A shared view of the first `len` bytes of a run nothing is writing.
    pub fn run(&self, run: PageRun, len: usize) -> &[u8] {
        self.check(run, len);
        // SAFETY: as in `run_mut`, for reading a run no operation writes.
        unsafe { std::slice::from_raw_parts(self.base.add(run.offset_bytes()), len) }
    }

    /// Operations may still use the arena at teardown: leak it instead of freeing it.
    pub fn leak_on_drop(&mut self) {
        self.leak_on_drop = true;
    }
}

/// A run lent to another dataplane thread: a key-value request's run, which the thread that
/// owns the table reads and writes while it runs one of the request's table steps
/// (`core/kv_owner.rs`). Only `Arena::lend` makes one, so it always names a whole run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LentRun {
    address: usize,
    size_bytes: usize,
}

impl Arena {
    /// The address of a run owned by the caller's request, for another thread to use while
    /// the request is `Forwarded` (the lender neither reads, writes nor frees it meanwhile).
    pub fn lend(&mut self, run: PageRun) -> LentRun {
        let bytes = self.run_mut(run, run.size_bytes());
        LentRun {
            address: bytes.as_mut_ptr() as usize,
            size_bytes: bytes.len(),
        }
    }
}

impl LentRun {
    pub fn size_bytes(self) -> usize {
        self.size_bytes
    }

    /// The lent run's bytes.
    ///
    /// # Safety
    /// The lender's request must be `Forwarded` to the caller's thread for as long as the
    /// slice lives (the lender does not touch the run and does not free it until the caller
    /// answers), and the lender's arena must outlive it (threads are joined before any
    /// dataplane is dropped, and a dataplane with a forwarded request is not finished).
    pub unsafe fn bytes_mut<'a>(self) -> &'a mut [u8] {
        assert_ne!(self.address, 0, "a lent run without an address");
        // SAFETY: the address and length are a whole run of a live arena (`Arena::lend`),
        // and the caller has exclusive use of it (this function's contract).
        unsafe { std::slice::from_raw_parts_mut(self.address as *mut u8, self.size_bytes) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.leak_on_drop {
            std::mem::forget(self.memory.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_disjoint_views() {
        let mut arena = Arena::new(4 * PAGE_SIZE);
        let first = PageRun {
            first_page: 0,
            order: 1,
        };
        let second = PageRun {
            first_page: 2,
            order: 1,
        };
        arena.run_mut(first, 8).fill(1);
        arena.run_mut(second, 8).fill(2);
        assert_eq!(arena.run(first, 8), &[1; 8]);
        assert_eq!(arena.run(second, 8), &[2; 8]);
        assert_eq!(
            arena.run(second, 1).as_ptr() as usize - arena.run(first, 1).as_ptr() as usize,
            2 * PAGE_SIZE
        );
    }
}
