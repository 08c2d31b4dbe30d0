//! One thread's io_uring: setup and feature probing, pushing entries, entering, reaping.
//!
//! Safety contract of [`Ring::push`]: an entry carries raw pointers (buffers, `msghdr`s) that
//! the kernel uses until the operation's completion is reaped, so whoever pushes it must keep
//! that memory alive and untouched until then. Only the driver (`super::driver`) pushes.

use std::io;
use std::time::Duration;

use io_uring::{IoUring, opcode, squeue, types};

/// What a CQE says, copied out of the completion queue so handlers run after the queue is
/// released (no re-entrancy, bounded stack).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cqe {
    pub user_data: u64,
    pub result: i32,
}

/// A ring feature the dataplane cannot run without.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MissingFeature {
    #[error("io_uring is unavailable: {0} (is /proc/sys/kernel/io_uring_disabled 0?)")]
    Setup(String),
    #[error("the kernel's io_uring lacks opcode {0}; reflexd needs Linux 5.19 or newer")]
    Opcode(&'static str),
    #[error("the kernel's io_uring lacks feature {0}; reflexd needs Linux 5.19 or newer")]
    Feature(&'static str),
}

pub struct Ring {
    ring: IoUring,
    /// Entries pushed since the last enter, i.e. what the next enter submits.
    pushed_count: u32,
    /// Enters forced by a full submission queue (a sign the SQ is undersized).
    full_flush_count: u64,
}

impl Ring {
    pub fn new(sq_entries: u32, cq_entries: u32) -> io::Result<Ring> {
        // Deferred task running (6.1+): completions of socket operations are posted only when
        // this thread enters the kernel asking for events, never by interrupting it; the
        // TASKRUN flag still says when some are due. Cooperative task running is the fallback.
        let ring = IoUring::builder()
            .setup_cqsize(cq_entries)
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_taskrun_flag()
            .build(sq_entries)
            .or_else(|_| {
                IoUring::builder()
                    .setup_cqsize(cq_entries)
                    .setup_single_issuer()
                    .setup_coop_taskrun()
                    .setup_taskrun_flag()
                    .build(sq_entries)
            })
            .or_else(|_| {
                IoUring::builder()
                    .setup_cqsize(cq_entries)
                    .build(sq_entries)
            })?;
        Ok(Ring {
            ring,
            pushed_count: 0,
            full_flush_count: 0,
        })
    }

    /// Checks every opcode and feature the dataplane uses; the error names the first missing.
    pub fn probe() -> Result<(), MissingFeature> {
        let ring = IoUring::new(8).map_err(|e| MissingFeature::Setup(e.to_string()))?;
        let params = ring.params();
        if !params.is_feature_nodrop() {
            return Err(MissingFeature::Feature("IORING_FEAT_NODROP"));
        }
        if !params.is_feature_ext_arg() {
            return Err(MissingFeature::Feature("IORING_FEAT_EXT_ARG"));
        }
        if !params.is_feature_fast_poll() {
            return Err(MissingFeature::Feature("IORING_FEAT_FAST_POLL"));
        }
        let mut probe = io_uring::Probe::new();
        ring.submitter()
            .register_probe(&mut probe)
            .map_err(|e| MissingFeature::Setup(format!("probe: {e}")))?;
        let needed: [(u8, &'static str); 12] = [
            (opcode::Read::CODE, "READ"),
            (opcode::Write::CODE, "WRITE"),
            (opcode::ReadFixed::CODE, "READ_FIXED"),
            (opcode::WriteFixed::CODE, "WRITE_FIXED"),
            (opcode::Fsync::CODE, "FSYNC"),
            (opcode::Fallocate::CODE, "FALLOCATE"),
            (opcode::Recv::CODE, "RECV"),
            (opcode::SendMsg::CODE, "SENDMSG"),
            (opcode::Accept::CODE, "ACCEPT"),
            (opcode::AsyncCancel::CODE, "ASYNC_CANCEL"),
            (opcode::Nop::CODE, "NOP"),
            (opcode::PollAdd::CODE, "POLL_ADD"),
        ];
        for (code, name) in needed {
            if !probe.is_supported(code) {
                return Err(MissingFeature::Opcode(name));
            }
        }
        Ok(())
    }

    /// Queues an entry for the next enter. A full submission queue is flushed to the kernel
    /// first (submitted entries are the kernel's from then on).
    ///
    /// # Safety
    /// Every pointer in `entry` must stay valid, and the memory it points to must not be
    /// written (for a send) or read or written (for a receive or a read) by anyone but the
    /// kernel, until the entry's completion has been reaped.
    pub(super) unsafe fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the caller keeps the entry's memory alive and untouched until its
            // completion (this function's contract).
            let pushed = unsafe { self.ring.submission().push(entry) };
            match pushed {
                Ok(()) => {
                    self.pushed_count += 1;
                    return Ok(());
                }
                Err(_) => {
                    self.full_flush_count += 1;
                    self.ring.submit()?;
                    self.pushed_count = 0;
                }
            }
        }
    }

    pub fn full_flush_count(&self) -> u64 {
        self.full_flush_count
    }

    /// One `io_uring_enter`: submits what was pushed and, when `wait` is set, sleeps until a
    /// completion arrives or `timeout` passes. Without `wait` and with nothing pushed this
    /// makes no system call at all (poll mode spinning on the completion queue).
    pub fn enter(&mut self, wait: bool, timeout: Option<Duration>) -> io::Result<()> {
        let result = if !wait {
            // With cooperative task running, completions of socket operations are only
            // posted when the thread enters the kernel; the TASKRUN flag says one is due.
            let kernel_wants_entry = {
                let submission = self.ring.submission();
                submission.taskrun() || submission.cq_overflow()
            };
            if self.pushed_count == 0 && !kernel_wants_entry {
                return Ok(());
            }
            self.ring.submit()
        } else if let Some(timeout) = timeout {
            let timespec = types::Timespec::from(timeout);
            let args = types::SubmitArgs::new().timespec(&timespec);
            self.ring.submitter().submit_with_args(1, &args)
        } else {
            self.ring.submit_and_wait(1)
        };
        self.pushed_count = 0;
        match result {
            Ok(_) => Ok(()),
            // A timeout or a signal ends the wait early; both are normal wake-ups.
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => Ok(()),
            // The completion queue is full: the caller reaps and enters again.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Copies up to `out.len()` completions out of the queue; returns how many.
    pub fn reap(&mut self, out: &mut [Cqe]) -> usize {
        let mut completion = self.ring.completion();
        let mut count = 0;
        for slot in out.iter_mut() {
            let Some(entry) = completion.next() else {
                break;
            };
            *slot = Cqe {
                user_data: entry.user_data(),
                result: entry.result(),
            };
            count += 1;
        }
        count
    }

    /// Registers `region` as fixed buffer 0 so device I/O can use `ReadFixed`/`WriteFixed`.
    ///
    /// # Safety
    /// The region must stay allocated, unmoved, for as long as the ring exists.
    pub(super) unsafe fn register_region(
        &mut self,
        base: *mut u8,
        size_bytes: usize,
    ) -> io::Result<()> {
        let iovec = libc::iovec {
            iov_base: base.cast(),
            iov_len: size_bytes,
        };
        // SAFETY: the region outlives the ring (this function's contract).
        unsafe { self.ring.submitter().register_buffers(&[iovec]) }
    }

    pub fn more_in_cq(&mut self) -> bool {
        !self.ring.completion().is_empty()
    }
}
