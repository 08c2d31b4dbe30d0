//! File I/O without io_uring: a small pool of threads per file device runs `pread`, `pwrite`
//! (`pwritev2` for FUA), `fdatasync` and `fallocate` for dataplane threads that have no ring
//! (the epoll driver), and hands the results back through the submitting queue's
//! [`DeviceQueue::poll_completions`].
//!
//! Why threads: epoll cannot make I/O on a regular file or a block device non-blocking (such
//! a descriptor is always "ready"), so without a ring the only way to keep the dataplane
//! thread serving sockets while the device works is to let other threads wait for it. The
//! pool owns no dataplane state: a job is a raw buffer address, a length, an offset and the
//! mailbox of the queue to report to. With `aligned`, this module holds the crate's `unsafe`
//! code (the system calls on raw buffers, and sending those to a worker); elsewhere only the
//! calls of the unsafe [`crate::Device::queue_without_ring`] pass its contract on.
//!
//! Bounds: [`POOL_THREADS`] workers per device, started with its first ring-less queue (a
//! server on io_uring never starts them); one job channel per device holding at most
//! [`JOBS_QUEUED_MAX`] jobs: a queue that finds it full keeps its jobs in a backlog, in order,
//! and retries whenever it is polled, asking to be polled again [`BACKLOG_RETRY`] later; each
//! queue has at most [`QUEUE_IN_FLIGHT_MAX`] operations outstanding (asserted; the dataplane
//! keeps far fewer in flight), which also bounds its backlog and its mailbox.
//!
//! Waking: a worker appends its completion to the queue's mailbox, and when the mailbox goes
//! from empty to non-empty it calls the queue's [`Notify`] (the dataplane thread's eventfd).
//! While the mailbox holds anything, [`DeviceQueue::next_deadline`] is [`Nanos::ZERO`] (due
//! now), so a thread that is awake does not go to sleep over it, and one that sleeps is woken.
//! That is at most one wake-up per drain of the mailbox, however many completions arrive.
//!
//! Memory: a job's buffer belongs to the pool from `submit` until its completion has been
//! drained ([`crate::Device::queue_without_ring`]'s safety contract, the same as a ring
//! entry's). On a buffered file (O_DIRECT refused), a read first tries `preadv2` with
//! `RWF_NOWAIT` on the calling thread: a page-cache hit completes at once, without a hand-off.
//!
//! Durability, as with the ring: FUA is `pwritev2(RWF_DSYNC)` (`pwrite` then `fdatasync`
//! where the kernel, or qemu-user, lacks `pwritev2`); FLUSH is `fdatasync`; TRIM is
//! `fallocate` with the device's mode.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crossbeam::channel::{self, Receiver, Sender, TrySendError};
use reflex_qos::Nanos;

use crate::file::{FileAccess, outcome};
use crate::{Completion, DeviceOp, DeviceQueue, FlashError, Notify, OpKind, Submit};

/// Worker threads of one device's pool.
pub const POOL_THREADS: usize = 4;
/// Jobs waiting for a worker, over all the queues of one device.
pub const JOBS_QUEUED_MAX: usize = 1024;
/// Operations one queue may have outstanding (queued, running or waiting in its mailbox):
/// more than a dataplane thread ever keeps in flight.
pub const QUEUE_IN_FLIGHT_MAX: usize = 4096;
/// How soon a queue whose jobs did not fit in the channel asks to be polled again.
pub const BACKLOG_RETRY: Nanos = Nanos::from_micros(50);

const _: () = assert!(JOBS_QUEUED_MAX >= POOL_THREADS);
const _: () = assert!(QUEUE_IN_FLIGHT_MAX >= JOBS_QUEUED_MAX);

/// The threads of one device and the channel that feeds them.
#[derive(Debug)]
pub(crate) struct Pool {
    jobs: Sender<Job>,
}

impl Pool {
    /// Starts [`POOL_THREADS`] workers on `file`; they end when the device and all its
    /// ring-less queues are gone (the last sender dropped).
    pub(crate) fn start(file: Arc<File>, trim_mode: i32) -> Pool {
        let (jobs, receiver) = channel::bounded(JOBS_QUEUED_MAX);
        let dsync_flag = Arc::new(AtomicBool::new(true));
        for index in 0..POOL_THREADS {
            let worker = Worker {
                file: Arc::clone(&file),
                trim_mode,
                dsync_flag: Arc::clone(&dsync_flag),
                jobs: receiver.clone(),
            };
            let spawned = std::thread::Builder::new()
                .name(format!("reflex-io-{index}"))
                .spawn(move || worker.run());
            if let Err(e) = spawned {
                // Only at start-up, when the first ring-less queue is created.
                panic!("cannot start file I/O thread {index}: {e}");
            }
        }
        Pool { jobs }
    }
}

/// One operation for a worker.
#[derive(Debug, Clone, Copy)]
enum Work {
    Read {
        address: *mut u8,
        length: usize,
        offset: u64,
    },
    Write {
        address: *const u8,
        length: usize,
        offset: u64,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u64,
    },
}

struct Job {
    user_data: u64,
    work: Work,
    mailbox: Arc<Mailbox>,
}

// SAFETY: the buffer a job points to is used by the one worker that takes the job, and the
// submitter keeps it allocated and untouched until the job's completion has been drained
// (`Device::queue_without_ring`'s contract), so the pointer may cross to that thread.
unsafe impl Send for Job {}

/// Where the workers leave one queue's completions.
struct Mailbox {
    completions: Mutex<Vec<Completion>>,
    /// The number of completions in the mailbox, readable without the lock.
    waiting: AtomicUsize,
    notify: Arc<dyn Notify>,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Vec<Completion>> {
        // A worker that panicked while holding the lock left a valid vector behind.
        self.completions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn post(&self, completion: Completion) {
        let first = {
            let mut completions = self.lock();
            completions.push(completion);
            self.waiting.store(completions.len(), Ordering::Release);
            completions.len() == 1
        };
        if first {
            self.notify.notify();
        }
    }

    /// Moves every completion to `out`; returns how many.
    fn drain(&self, out: &mut Vec<Completion>) -> usize {
        let mut completions = self.lock();
        let count = completions.len();
        out.append(&mut completions);
        self.waiting.store(0, Ordering::Release);
        count
    }
}

struct Worker {
    file: Arc<File>,
    trim_mode: i32,
    /// Whether `pwritev2(RWF_DSYNC)` works here (shared by the device's workers).
    dsync_flag: Arc<AtomicBool>,
    jobs: Receiver<Job>,
}

impl Worker {
    fn run(self) {
        while let Ok(job) = self.jobs.recv() {
            let result = self.execute(job.work);
            job.mailbox.post(Completion {
                user_data: job.user_data,
                result,
            });
        }
    }

    fn execute(&self, work: Work) -> Result<u32, FlashError> {
        let fd = self.file.as_raw_fd();
        let result = match work {
            Work::Read {
                address,
                length,
                offset,
            } => retrying(|| {
                // SAFETY: `address..address + length` is the job's buffer, which the submitter
                // keeps allocated and untouched until this completion is drained.
                unsafe { libc::pread64(fd, address.cast(), length, offset as libc::off64_t) }
            }),
            Work::Write {
                address,
                length,
                offset,
                fua,
            } => self.write(address, length, offset, fua),
            Work::Flush => flush(fd),
            Work::Trim { offset, length } => retrying(|| {
                // SAFETY: fallocate passes no memory.
                let rc = unsafe {
                    libc::fallocate64(
                        fd,
                        self.trim_mode,
                        offset as libc::off64_t,
                        length as libc::off64_t,
                    )
                };
                rc as isize
            }),
        };
        outcome(match result {
            Ok(bytes) => bytes as i64,
            Err(errno) => -i64::from(errno),
        })
    }

    fn write(
        &self,
        address: *const u8,
        length: usize,
        offset: u64,
        fua: bool,
    ) -> Result<usize, i32> {
        let fd = self.file.as_raw_fd();
        if fua && self.dsync_flag.load(Ordering::Relaxed) {
            let iovec = libc::iovec {
                iov_base: address.cast_mut().cast(),
                iov_len: length,
            };
            let written = retrying(|| {
                // SAFETY: the iovec names the job's buffer (kept alive and unchanged until
                // this completion is drained) and lives on this stack for the call.
                unsafe { libc::pwritev2(fd, &iovec, 1, offset as libc::off_t, libc::RWF_DSYNC) }
            });
            match written {
                Err(libc::ENOSYS | libc::EOPNOTSUPP) => {
                    if self.dsync_flag.swap(false, Ordering::Relaxed) {
                        tracing::info!(
                            "pwritev2(RWF_DSYNC) unavailable; FUA writes use pwrite and fdatasync"
                        );
                    }
                }
                other => return other,
            }
        }
        let written = retrying(|| {
            // SAFETY: as for the read: the job's buffer, alive and unchanged until drained.
            unsafe { libc::pwrite64(fd, address.cast(), length, offset as libc::off64_t) }
        })?;
        if fua {
            flush(fd)?;
        }
        Ok(written)
    }
}

fn flush(fd: i32) -> Result<usize, i32> {
    retrying(|| {
        // SAFETY: fdatasync passes no memory.
        unsafe { libc::fdatasync(fd) as isize }
    })
}

/// Runs a system call until it is not interrupted: `Ok(result)` or `Err(errno)`.
fn retrying(mut call: impl FnMut() -> isize) -> Result<usize, i32> {
    loop {
        let rc = call();
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if errno != libc::EINTR {
            return Err(errno);
        }
    }
}

/// One dataplane thread's ring-less queue on a file device.
pub(crate) struct PoolQueue {
    access: FileAccess,
    jobs: Sender<Job>,
    mailbox: Arc<Mailbox>,
    /// Jobs that found the channel full, oldest first.
    backlog: VecDeque<Job>,
    /// Operations submitted whose completion has not been drained.
    in_flight: usize,
    /// The latest `now` seen (for the backlog's retry deadline).
    now_latest: Nanos,
    /// Try reads on the calling thread with `RWF_NOWAIT` first (buffered files only, while
    /// the kernel supports it).
    nowait_reads: bool,
}

impl PoolQueue {
    /// # Safety
    /// [`crate::Device::queue_without_ring`]'s: every buffer passed to `submit` stays
    /// allocated and untouched until its completion has been drained from
    /// `poll_completions`, even after the queue is dropped.
    pub(crate) unsafe fn new(access: FileAccess, pool: &Pool, notify: Arc<dyn Notify>) -> Self {
        PoolQueue {
            nowait_reads: !access.direct_io,
            access,
            jobs: pool.jobs.clone(),
            mailbox: Arc::new(Mailbox {
                completions: Mutex::new(Vec::new()),
                waiting: AtomicUsize::new(0),
                notify,
            }),
            backlog: VecDeque::new(),
            in_flight: 0,
            now_latest: Nanos::ZERO,
        }
    }

    /// A read served from the page cache on the calling thread, or `None` when it would
    /// block (or only part of it is cached): the pool then does all of it.
    fn read_nowait(&mut self, buf: &mut [u8], offset: u64) -> Option<Result<u32, FlashError>> {
        let iovec = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let fd = self.access.file.as_raw_fd();
        let read = retrying(|| {
            // SAFETY: the iovec names `buf`, exclusively borrowed for the whole call.
            unsafe { libc::preadv2(fd, &iovec, 1, offset as libc::off_t, libc::RWF_NOWAIT) }
        });
        match read {
            Ok(bytes) if bytes == buf.len() => Some(outcome(bytes as i64)),
            Ok(_) | Err(libc::EAGAIN) => None,
            Err(libc::ENOSYS | libc::EOPNOTSUPP | libc::EINVAL) => {
                self.nowait_reads = false;
                None
            }
            Err(errno) => Some(outcome(-i64::from(errno))),
        }
    }

    fn enqueue(&mut self, job: Job) {
        if !self.backlog.is_empty() {
            self.backlog.push_back(job);
            return;
        }
        match self.jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(job)) => self.backlog.push_back(job),
            Err(TrySendError::Disconnected(job)) => fail_without_workers(job),
        }
    }

    fn flush_backlog(&mut self) {
        while let Some(job) = self.backlog.pop_front() {
            match self.jobs.try_send(job) {
                Ok(()) => {}
                Err(TrySendError::Full(job)) => {
                    self.backlog.push_front(job);
                    return;
                }
                Err(TrySendError::Disconnected(job)) => fail_without_workers(job),
            }
        }
    }
}

/// Every worker has gone (they only end by panicking while the device lives): the job fails
/// with EIO instead of waiting for ever.
fn fail_without_workers(job: Job) {
    tracing::error!("the file I/O threads have stopped; failing the operation");
    job.mailbox.post(Completion {
        user_data: job.user_data,
        result: Err(FlashError::Io { errno: libc::EIO }),
    });
}

impl DeviceQueue for PoolQueue {
    fn submit(&mut self, op: DeviceOp<'_>, now: Nanos) -> Submit {
        self.now_latest = self.now_latest.max(now);
        if self.access.refuses(&op.kind) {
            return Submit::Done(Err(FlashError::Io { errno: libc::EROFS }));
        }
        let work = match op.kind {
            OpKind::Read { offset, buf } => {
                self.access.check_range(offset, buf.len() as u64);
                self.access.check_buffer(buf.as_ptr() as usize);
                if self.nowait_reads
                    && let Some(result) = self.read_nowait(buf, offset)
                {
                    return Submit::Done(result);
                }
                Work::Read {
                    address: buf.as_mut_ptr(),
                    length: buf.len(),
                    offset,
                }
            }
            OpKind::Write { offset, buf, fua } => {
                self.access.check_range(offset, buf.len() as u64);
                self.access.check_buffer(buf.as_ptr() as usize);
                Work::Write {
                    address: buf.as_ptr(),
                    length: buf.len(),
                    offset,
                    fua,
                }
            }
            OpKind::Flush => Work::Flush,
            OpKind::Trim { offset, len } => {
                self.access.check_range(offset, len);
                Work::Trim {
                    offset,
                    length: len,
                }
            }
        };
        assert!(
            self.in_flight < QUEUE_IN_FLIGHT_MAX,
            "more than {QUEUE_IN_FLIGHT_MAX} file operations in flight on one queue"
        );
        self.in_flight += 1;
        let job = Job {
            user_data: op.user_data,
            work,
            mailbox: Arc::clone(&self.mailbox),
        };
        self.enqueue(job);
        Submit::Pending
    }

    fn poll_completions(&mut self, now: Nanos, out: &mut Vec<Completion>) {
        self.now_latest = self.now_latest.max(now);
        self.flush_backlog();
        let drained = self.mailbox.drain(out);
        assert!(
            drained <= self.in_flight,
            "more completions than operations"
        );
        self.in_flight -= drained;
    }

    fn next_deadline(&self) -> Option<Nanos> {
        if self.mailbox.waiting.load(Ordering::Acquire) > 0 {
            Some(Nanos::ZERO)
        } else if !self.backlog.is_empty() {
            Some(self.now_latest + BACKLOG_RETRY)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests;
