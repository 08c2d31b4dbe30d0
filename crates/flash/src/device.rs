//! The contract between storage devices and the dataplane.
//!
//! A [`Device`] is opened once per namespace and shared by all dataplane threads. Each thread
//! asks it for its own [`DeviceQueue`] and drives that queue from its loop: the queue *prepares*
//! I/O for the thread's io_uring (file and block devices), finishes it on the spot (memory,
//! null), or accepts it and later reports completions when polled with the current time (the
//! emulated Flash device). Devices never run a loop or a thread of their own on the data path.
//!
//! Buffers: the dataplane passes the request's slot buffer. For [`Submit::Ring`] the entry
//! points into that buffer; the dataplane keeps the slot alive until the CQE arrives (that is
//! the safety contract of pushing the entry). Synchronous and emulated devices copy data during
//! `submit` and keep no pointer.
//!
//! Without a ring (the epoll driver, where io_uring is unavailable) the thread asks for its
//! queue with [`Device::queue_without_ring`]: file devices then run their I/O on a small pool
//! of threads of their own and report it through [`DeviceQueue::poll_completions`], waking the
//! thread with the [`Notify`] it passed; every other device behaves as with a ring.
//!
//! Completion: every submitted operation completes exactly once, by one of three routes —
//! [`Submit::Done`] at once; [`DeviceQueue::complete_ring`] returning `Some` for the CQE of a
//! [`Submit::Ring`] entry; or a [`Completion`] out of [`DeviceQueue::poll_completions`], which
//! is where [`Submit::Pending`] operations end *and* ring operations whose CQE
//! `complete_ring` deferred (returned `None`, as the fault injector does to delay or stall
//! them). The buffer belongs to the device until the kernel's CQE (ring) or `submit`'s return
//! (anything else); a deferred report does not extend that.
//!
//! Allocation: [`Device::block_status`] says which parts of a range hold data and which are
//! holes (NBD's `base:allocation`), so clients copying an export can skip the holes. It is a
//! metadata query answered on the spot (for files, `lseek(SEEK_DATA/SEEK_HOLE)`), cheap enough
//! for the dataplane thread, and bounded by the number of extents the caller asks for.

use std::sync::Arc;

use reflex_qos::Nanos;

use crate::FlashError;
use crate::emu::EmuControls;
use crate::fault::FaultControls;
use crate::pages::Lent;

/// What one request asks of the device.
#[derive(Debug)]
pub enum OpKind<'a> {
    Read {
        offset: u64,
        buf: &'a mut [u8],
    },
    Write {
        offset: u64,
        buf: &'a [u8],
        /// Durable when complete (forced unit access).
        fua: bool,
    },
    /// Every write completed before this was submitted becomes durable.
    Flush,
    /// The range reads back as zeroes afterwards.
    Trim {
        offset: u64,
        len: u64,
    },
}

/// One operation handed to [`DeviceQueue::submit`].
#[derive(Debug)]
pub struct DeviceOp<'a> {
    /// Returned unchanged with the completion (and set as the SQE's user_data for ring I/O).
    pub user_data: u64,
    pub kind: OpKind<'a>,
    /// Index of the buffer in the thread's registered-buffer table, when `buf` lies inside it,
    /// so file devices can use the fixed-buffer opcodes.
    pub buf_index: Option<u16>,
    /// Submission queue (priority class / tenant queue) inside devices that arbitrate between
    /// queues, such as the emulated device. Others ignore it.
    pub queue: u16,
}

/// How a device took an operation.
#[derive(Debug)]
pub enum Submit {
    /// Push this entry on the thread's ring; its CQE (same user_data) completes the
    /// operation and is interpreted by [`DeviceQueue::complete_ring`].
    #[cfg(feature = "uring")]
    Ring(io_uring::squeue::Entry),
    /// Done already: bytes transferred, or the error.
    Done(Result<u32, FlashError>),
    /// Accepted; the completion will come out of [`DeviceQueue::poll_completions`].
    Pending,
}

/// A completion reported by [`DeviceQueue::poll_completions`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub user_data: u64,
    pub result: Result<u32, FlashError>,
}

/// Static facts about a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub size_bytes: u64,
    /// Offsets and lengths must be multiples of this (512 for every device we ship).
    pub block_size: u32,
    pub read_only: bool,
    /// Whether TRIM does anything.
    pub supports_trim: bool,
    /// Human-readable description for logs, e.g. `file:/data/ns0 (O_DIRECT)`.
    pub description: String,
}

/// What one stretch of a device holds, as far as the device can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// Allocated, or the device cannot tell: reads return what was written.
    Data,
    /// Not allocated: reads return zeroes, and writing there may need new space.
    Hole,
}

/// One extent of a [`Device::block_status`] answer; extents follow each other from the
/// offset asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Non-zero.
    pub length_bytes: u64,
    pub allocation: Allocation,
}

/// Tells a dataplane thread that device completions wait for its
/// [`DeviceQueue::poll_completions`] (it may be asleep). Called from other threads.
pub trait Notify: Send + Sync {
    fn notify(&self);
}

/// A storage device (one namespace), shared by the dataplane threads.
pub trait Device: Send + Sync {
    fn info(&self) -> &DeviceInfo;
    /// A queue for one dataplane thread.
    fn queue(&self) -> Box<dyn DeviceQueue>;

    /// A queue for a dataplane thread that has no io_uring: it never returns
    /// [`Submit::Ring`]. Devices that finish synchronously or in `poll_completions` return
    /// their usual queue (the default); file devices hand their I/O to a small thread pool
    /// that reports completions through `poll_completions` and calls `notify` when the
    /// first of them is waiting, so a sleeping thread wakes up.
    ///
    /// # Safety
    /// The returned queue may keep using an operation's buffer after `submit` returns, as
    /// the kernel does with a ring entry: the caller must keep every buffer it passes to
    /// `submit` allocated and untouched (not read, for a read; not written, for a write)
    /// until that operation's completion has come out of `poll_completions` (or
    /// `submit` returned `Submit::Done`), and must never free such a buffer while the
    /// operation is outstanding, even after dropping the queue.
    #[allow(unsafe_code)]
    unsafe fn queue_without_ring(&self, notify: Arc<dyn Notify>) -> Box<dyn DeviceQueue> {
        let _ = notify;
        self.queue()
    }

    /// The run-time switch of a fault-injecting device ([`crate::fault`]), so an admin
    /// interface holding only `Arc<dyn Device>` can change its faults; `None` for every device
    /// that injects none.
    fn fault_controls(&self) -> Option<Arc<FaultControls>> {
        None
    }

    /// The run-time drift switch of an emulated Flash device ([`crate::emu::drift`]: slow it
    /// down, speed it up, stall it), also through wrappers such as `fault:`; `None` for every
    /// other device.
    fn emu_controls(&self) -> Option<Arc<EmuControls>> {
        None
    }

    /// The allocation of `[offset, offset + length_bytes)` (inside the device, `length_bytes`
    /// non-zero; the caller checked): appends consecutive extents starting at `offset` to
    /// `out`, at least one and at most `extents_max` (≥ 1). They cover at least one byte and
    /// never pass the end of the range, but may stop short of it (the caller asks again from
    /// where they end). An error means the allocation is unknown, not that the data is bad.
    ///
    /// The default, for devices that do not track allocation: one `Data` extent over the
    /// whole range (always a truthful answer).
    fn block_status(
        &self,
        offset: u64,
        length_bytes: u64,
        extents_max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), FlashError> {
        let _ = offset;
        assert!(extents_max >= 1 && length_bytes > 0);
        out.push(Extent {
            length_bytes,
            allocation: Allocation::Data,
        });
        Ok(())
    }
}

/// Appends `extent` to `out`, merging it into the last extent when their allocation is the
/// same (for devices that find extents piece by piece).
pub fn push_extent(out: &mut Vec<Extent>, first: usize, extent: Extent) {
    assert!(extent.length_bytes > 0);
    if out.len() > first
        && let Some(last) = out.last_mut()
        && last.allocation == extent.allocation
    {
        last.length_bytes += extent.length_bytes;
        return;
    }
    out.push(extent);
}

/// One thread's access to a [`Device`]. Not shared between threads.
pub trait DeviceQueue {
    /// Start one operation. Offsets and lengths have been validated against
    /// [`DeviceInfo`] by the caller (asserted inside).
    fn submit(&mut self, op: DeviceOp<'_>, now: Nanos) -> Submit;

    /// A read of `[offset, offset + len)` answered by lending the device's own memory instead
    /// of copying it into a buffer: `Some` when this device can (the `mem` device, for one
    /// whole 4 KiB block). The bytes stay as they were when lent until the [`Lent`] is
    /// dropped, whatever is written meanwhile, so a send may go straight from them. The range
    /// was validated as for [`Self::submit`]. The default lends nothing; a device that wraps
    /// another (fault injection) lends nothing either, so every read goes through it.
    fn lend(&mut self, offset: u64, len: u32) -> Option<Lent> {
        let _ = (offset, len);
        None
    }

    /// A hint that [`Self::lend`] of this range comes soon: a device that lends may bring
    /// what lending reads into the cache, so that a batch's lends do not each wait for memory
    /// in turn. The default does nothing; so may any device, at any time.
    fn prefetch_lend(&self, offset: u64, len: u32) {
        let _ = (offset, len);
    }

    /// Turn the CQE of a [`Submit::Ring`] operation, arrived at `now`, into its outcome.
    ///
    /// `Some(result)`: the operation is complete. `None`: the device deferred the outcome
    /// (a fault injector delaying or stalling it); the operation is still in flight and its
    /// result will come out of [`poll_completions`](Self::poll_completions) under the same
    /// `user_data`, no earlier than [`next_deadline`](Self::next_deadline) says. The kernel is
    /// done with the buffer either way.
    fn complete_ring(
        &mut self,
        user_data: u64,
        cqe_result: i32,
        now: Nanos,
    ) -> Option<Result<u32, FlashError>> {
        let _ = (user_data, now);
        if cqe_result < 0 {
            Some(Err(FlashError::Io { errno: -cqe_result }))
        } else {
            Some(Ok(cqe_result as u32))
        }
    }

    /// Completions due at `now`: of [`Submit::Pending`] operations, and of ring operations
    /// whose [`complete_ring`](Self::complete_ring) returned `None`.
    fn poll_completions(&mut self, now: Nanos, out: &mut Vec<Completion>) {
        let _ = (now, out);
    }

    /// Earliest time at which `poll_completions` may have something; the dataplane bounds
    /// its sleep by it. `None` when nothing is pending.
    fn next_deadline(&self) -> Option<Nanos> {
        None
    }
}
