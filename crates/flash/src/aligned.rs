//! Page-aligned memory, and the few raw system calls the devices need (one of the few modules
//! of `reflex-flash` with `unsafe` code; `pages` and `pool` are the others).
//!
//! Why it exists: O_DIRECT I/O and io_uring registered buffers need memory aligned to the
//! device's logical block (we always give a whole page). Keeping these raw pointers in one
//! module makes the unsafe surface small enough to audit:
//!
//! - [`AlignedBuf`] owns a zeroed, page-aligned allocation (the dataplane's buffer arena and
//!   test buffers). Alignment is asserted at creation and wherever a pointer is handed out.
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
}
