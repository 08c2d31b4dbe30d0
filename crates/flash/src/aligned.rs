//! Page-aligned memory, and the few raw system calls the devices need: the only module of
//! `reflex-flash` with `unsafe` code.
//!
//! Why it exists: O_DIRECT I/O and io_uring registered buffers need memory aligned to the
//! device's logical block (we always give a whole page), and the memory device needs a region
//! that every dataplane thread may read and write at once without a Rust data race. Keeping
//! every raw pointer in this one module makes the unsafe surface small enough to audit:
//!
//! - [`AlignedBuf`] owns a zeroed, page-aligned allocation (the dataplane's buffer arena and
//!   test buffers). Alignment is asserted at creation and wherever a pointer is handed out.
//! - [`StripedRegion`] is an anonymous private mapping copied with `memcpy` under striped
//!   reader-writer locks, so `mem:` is shared by every thread without data races. Pages are
//!   mapped lazily by the kernel (`MAP_NORESERVE`), so a large `mem:` costs memory only for
//!   what is written.
//! - [`seek`] wraps `lseek(SEEK_DATA/SEEK_HOLE)`, which a file device uses to report the
//!   holes of a sparse file.
//! - `test_ring` (tests only) pushes a device's ring entry on a real io_uring and waits for
//!   its CQE, so file devices are tested through the kernel rather than a mock.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of every [`AlignedBuf`]: one page, enough for O_DIRECT on any block size we ship.
pub const PAGE_SIZE: usize = 4096;

const _: () = assert!(PAGE_SIZE.is_power_of_two());
const _: () = assert!(PAGE_SIZE.is_multiple_of(512));

/// A zero-initialised, page-aligned, heap-allocated byte buffer of fixed size.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation (like Box<[u8]>); moving it to another
// thread moves that ownership, and shared references only give out `&[u8]`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above: `&AlignedBuf` only allows reads through `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to [`PAGE_SIZE`]. `len` must be a non-zero
    /// multiple of the page size. Aborts on allocation failure, like `Vec`.
    pub fn new_zeroed(len: usize) -> AlignedBuf {
        assert!(len > 0, "empty aligned buffer");
        assert!(
            len.is_multiple_of(PAGE_SIZE),
            "aligned buffer length {len} not a page multiple"
        );
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (asserted above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout);
        };
        assert!((ptr.as_ptr() as usize).is_multiple_of(PAGE_SIZE));
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        match Layout::from_size_align(len, PAGE_SIZE) {
            Ok(layout) => layout,
            Err(_) => panic!("aligned buffer length {len} overflows a layout"),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes for as long as self lives,
        // and `&self` excludes writers through this type.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The start of the buffer, for code that hands parts of it to the kernel (the
    /// dataplane's registered arena). Whoever writes through it must ensure no reference
    /// obtained from [`as_slice`](Self::as_slice) overlaps the write.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated in new_zeroed with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

/// A shared memory region that any number of threads read and write at once, copied with
/// `memcpy`: every [`STRIPE_BYTES`] chunk is guarded by one of [`STRIPE_COUNT`] reader-writer
/// locks (chunk index modulo the count), and every access to a chunk's bytes happens under
/// its lock, so concurrent readers and writers never race; a write is atomic per chunk, more
/// than the 512-byte sector a device promises. Zero until written; memory is committed by
/// the kernel only where written (`MAP_NORESERVE`), in huge pages (2 MiB) where the kernel
/// grants them.
pub struct StripedRegion {
    ptr: NonNull<u8>,
    len: usize,
    stripes: Box<[std::sync::RwLock<()>]>,
}

/// Bytes guarded by one lock.
pub const STRIPE_BYTES: usize = 64 << 10;
/// A transparent huge page (x86-64 and aarch64 with 4 KiB base pages): regions at least
/// this large ask for them.
const HUGE_PAGE_BYTES: usize = 2 << 20;
/// Locks of a region (chunks share them round robin).
pub const STRIPE_COUNT: usize = 1024;

const _: () = assert!(STRIPE_BYTES.is_power_of_two());

// SAFETY: the mapping is owned by the region and every access to its bytes goes through
// `read`, `write` and `zero`, which hold the covering stripe's lock (shared for reading,
// exclusive for writing), so sharing the region between threads creates no data race.
unsafe impl Send for StripedRegion {}
// SAFETY: see Send.
unsafe impl Sync for StripedRegion {}

impl StripedRegion {
    /// Maps `size_bytes` (non-zero) of zeroed anonymous memory.
    pub fn new(size_bytes: u64) -> std::io::Result<StripedRegion> {
        assert!(size_bytes > 0);
        let Ok(len) = usize::try_from(size_bytes) else {
            return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
        };
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
        let Some(ptr) = NonNull::new(raw.cast::<u8>()) else {
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
        let stripes = (0..STRIPE_COUNT)
            .map(|_| std::sync::RwLock::new(()))
            .collect();
        Ok(StripedRegion { ptr, len, stripes })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn stripe(&self, offset: usize) -> &std::sync::RwLock<()> {
        &self.stripes[(offset / STRIPE_BYTES) % STRIPE_COUNT]
    }

    /// Calls `each(offset, length)` for the pieces of `[offset, offset + len)` that lie in
    /// one chunk each, in order.
    fn pieces(&self, offset: usize, len: usize, mut each: impl FnMut(usize, usize)) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range {offset}+{len} beyond the region of {}",
            self.len
        );
        let mut done = 0;
        while done < len {
            let at = offset + done;
            let piece = (STRIPE_BYTES - at % STRIPE_BYTES).min(len - done);
            each(at, piece);
            done += piece;
        }
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        let base = out.as_mut_ptr();
        self.pieces(offset, out.len(), |at, piece| {
            let _shared = self
                .stripe(at)
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // SAFETY: `at..at + piece` is inside the mapping (checked by `pieces`) and inside
            // `out` (pieces cover `offset..offset + out.len()` in order); no writer touches the
            // chunk while its lock is held shared, and `out` is exclusively borrowed.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr.as_ptr().add(at),
                    base.add(at - offset),
                    piece,
                )
            };
        });
    }

    /// Copies `data` to `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        let base = data.as_ptr();
        self.pieces(offset, data.len(), |at, piece| {
            let _exclusive = self
                .stripe(at)
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // SAFETY: in bounds of the mapping and of `data` (as in `read`); the chunk's lock
            // is held exclusively, so no other access to these bytes runs meanwhile.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    base.add(at - offset),
                    self.ptr.as_ptr().add(at),
                    piece,
                )
            };
        });
    }

    /// Zeroes `[offset, offset + len)`.
    pub fn zero(&self, offset: usize, len: usize) {
        self.pieces(offset, len, |at, piece| {
            let _exclusive = self
                .stripe(at)
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // SAFETY: in bounds of the mapping; the chunk's lock is held exclusively.
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(at), 0, piece) };
        });
    }
}

impl Drop for StripedRegion {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping created in new; no reference outlives self.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        debug_assert_eq!(rc, 0);
    }
}

impl std::fmt::Debug for StripedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripedRegion")
            .field("len", &self.len)
            .finish()
    }
}

/// What [`seek`] looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeekFor {
    /// `SEEK_DATA`: the first byte at or after the offset that holds data.
    Data,
    /// `SEEK_HOLE`: the first byte at or after the offset inside a hole (the end of the file
    /// counts as one).
    Hole,
}

/// `lseek(file, offset, SEEK_DATA or SEEK_HOLE)`: where the next data or hole begins;
/// `Ok(None)` when there is none at or after `offset` (ENXIO). The file's own position moves,
/// which no device relies on: all of their I/O names its offset.
pub fn seek(file: &std::fs::File, offset: u64, seek_for: SeekFor) -> std::io::Result<Option<u64>> {
    use std::os::fd::AsRawFd;
    let Ok(offset) = libc::off_t::try_from(offset) else {
        return Err(std::io::Error::from_raw_os_error(libc::EOVERFLOW));
    };
    let whence = match seek_for {
        SeekFor::Data => libc::SEEK_DATA,
        SeekFor::Hole => libc::SEEK_HOLE,
    };
    // SAFETY: lseek takes a descriptor and integers; the descriptor is open for as long as
    // `file` is borrowed, and no memory is passed.
    let position = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
    if position >= 0 {
        return Ok(Some(position as u64));
    }
    let error = std::io::Error::last_os_error();
    if error.raw_os_error() == Some(libc::ENXIO) {
        Ok(None)
    } else {
        Err(error)
    }
}

/// A real io_uring for tests that drive file devices one operation at a time.
#[cfg(all(test, feature = "uring"))]
pub(crate) mod test_ring {
    use io_uring::IoUring;
    use reflex_qos::Nanos;

    use crate::{DeviceOp, DeviceQueue, FlashError, Submit};

    /// How [`TestRing::submit_and_wait`] ended.
    #[derive(Debug, PartialEq, Eq)]
    pub(crate) enum Outcome {
        /// Complete: `Submit::Done`, or `complete_ring` returned `Some`.
        Done(Result<u32, FlashError>),
        /// `Submit::Pending`, or a CQE the queue deferred: `poll_completions` reports it.
        Deferred,
    }

    pub(crate) struct TestRing {
        ring: IoUring,
    }

    impl TestRing {
        pub(crate) fn new() -> TestRing {
            let ring = IoUring::new(8).unwrap_or_else(|e| panic!("io_uring: {e}"));
            TestRing { ring }
        }

        /// Submits `op` to `queue` at `submitted_at`; a ring entry is pushed, its CQE awaited
        /// and handed to `complete_ring` at `completed_at` before this returns.
        pub(crate) fn submit_and_wait(
            &mut self,
            queue: &mut dyn DeviceQueue,
            op: DeviceOp<'_>,
            submitted_at: Nanos,
            completed_at: Nanos,
        ) -> Outcome {
            let entry = match queue.submit(op, submitted_at) {
                Submit::Done(result) => return Outcome::Done(result),
                Submit::Pending => return Outcome::Deferred,
                Submit::Ring(entry) => entry,
            };
            let user_data = entry.get_user_data();
            // SAFETY: the entry points into the buffer `op` borrows, and that borrow outlives
            // this call (it is an argument); the CQE is awaited below before returning, so the
            // kernel is done with the buffer while it is still borrowed.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            assert!(pushed.is_ok(), "an empty ring has room for one entry");
            let waited = self.ring.submit_and_wait(1);
            assert!(waited.is_ok(), "io_uring_enter: {waited:?}");
            let Some(cqe) = self.ring.completion().next() else {
                panic!("submit_and_wait(1) returned without a CQE");
            };
            assert_eq!(cqe.user_data(), user_data);
            match queue.complete_ring(user_data, cqe.result(), completed_at) {
                Some(result) => Outcome::Done(result),
                None => Outcome::Deferred,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buffer_is_aligned_and_zeroed() {
        let mut buf = AlignedBuf::new_zeroed(3 * PAGE_SIZE);
        assert_eq!(buf.len(), 3 * PAGE_SIZE);
        assert_eq!(buf.as_mut_ptr() as usize % PAGE_SIZE, 0);
        assert!(buf.as_slice().iter().all(|&b| b == 0));
        buf.as_mut_slice()[5] = 7;
        assert_eq!(buf.as_slice()[5], 7);
    }

    #[test]
    fn striped_region_copies_across_chunks_from_many_threads() {
        let region = std::sync::Arc::new(
            StripedRegion::new(4 * STRIPE_BYTES as u64).unwrap_or_else(|e| panic!("{e}")),
        );
        let mut zeroes = vec![1u8; 100];
        region.read(STRIPE_BYTES - 50, &mut zeroes);
        assert!(zeroes.iter().all(|&b| b == 0));
        // Writers of whole, distinct patterns over a chunk boundary; readers see one
        // pattern per chunk, never a mix inside a chunk.
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let region = std::sync::Arc::clone(&region);
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
