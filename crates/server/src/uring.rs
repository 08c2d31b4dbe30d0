//! The io_uring of one dataplane thread, its registered buffer arena, and the raw socket
//! calls the dataplane needs: the only module of `reflex-server` with `unsafe` code.
//!
//! Memory contract of [`Ring::push`]: an entry carries raw pointers (buffers, `msghdr`s) that
//! the kernel uses until the operation's CQE is reaped. Every pointer the dataplane puts in
//! an entry points into memory the thread's `Core` owns for its whole life and never moves:
//! the [`Arena`] (request data), per-connection receive buffers and send staging (boxed,
//! reused, freed only after the connection's last operation completed), request headers (a
//! fixed boxed table) and the wake-up word. The core's request and connection state machines
//! guarantee that nothing touches a region while an operation on it is in flight (asserted on
//! every transition), and the core drains every operation before dropping that memory; if it
//! cannot (a panic unwinding with operations in flight), the arena is leaked rather than
//! freed under the kernel's feet.

use std::fs::File;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use io_uring::{IoUring, opcode, squeue, types};
use reflex_flash::aligned::AlignedBuf;

use crate::buffers::{PAGE_SIZE, PageRun};

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
        let ring = IoUring::builder()
            .setup_cqsize(cq_entries)
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .build(sq_entries)
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
        let needed: [(u8, &'static str); 11] = [
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
        ];
        for (code, name) in needed {
            if !probe.is_supported(code) {
                return Err(MissingFeature::Opcode(name));
            }
        }
        Ok(())
    }

    /// Queues an entry for the next enter. See the module doc for the memory contract every
    /// caller in this crate keeps. A full submission queue is flushed to the kernel first.
    pub fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the entry's pointers reference core-owned memory that stays valid and
            // untouched until its CQE is reaped (module doc: the core's state machines
            // assert this on every transition, and the core drains before freeing).
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

    /// Registers the arena as fixed buffer 0 so device I/O can use `ReadFixed`/`WriteFixed`.
    pub fn register_arena(&mut self, arena: &Arena) -> io::Result<()> {
        let iovec = libc::iovec {
            iov_base: arena.base.cast(),
            iov_len: arena.size_bytes,
        };
        // SAFETY: the iovec covers exactly the arena's allocation, which outlives the ring
        // (the core drops the ring first; see Arena's Drop) and is never moved.
        unsafe { self.ring.submitter().register_buffers(&[iovec]) }
    }

    pub fn more_in_cq(&mut self) -> bool {
        !self.ring.completion().is_empty()
    }
}

/// The thread's page-aligned data buffers: one allocation, registered once, carved into
/// [`PageRun`]s by `buffers::PageAllocator`.
pub struct Arena {
    memory: Option<AlignedBuf>,
    base: *mut u8,
    size_bytes: usize,
    /// Set when the core could not drain the kernel's operations: leak instead of freeing.
    leak_on_drop: bool,
}

impl Arena {
    pub fn new(size_bytes: usize) -> Arena {
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

    fn check(&self, run: PageRun, len: usize) {
        assert!(len <= run.size_bytes(), "length {len} beyond {run:?}");
        assert!(
            run.offset_bytes() + run.size_bytes() <= self.size_bytes,
            "{run:?} beyond the arena"
        );
    }

    /// Address of the first `len` bytes of a run, for an io_uring entry or an iovec.
    pub fn run_ptr(&self, run: PageRun) -> *mut u8 {
        self.check(run, 0);
        self.base.wrapping_add(run.offset_bytes())
    }

    /// The first `len` bytes of a run that the caller owns and no operation is using.
    pub fn run_mut(&mut self, run: PageRun, len: usize) -> &mut [u8] {
        self.check(run, len);
        // SAFETY: in bounds (checked), the arena outlives the borrow, and the run is owned by
        // one request with no kernel operation on it (the caller's state asserts this); the
        // slice covers only this run, so other runs in flight are not aliased.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(run.offset_bytes()), len) }
    }

    pub fn run(&self, run: PageRun, len: usize) -> &[u8] {
        self.check(run, len);
        // SAFETY: as in run_mut, for a shared view of a run no operation is writing.
        unsafe { std::slice::from_raw_parts(self.base.add(run.offset_bytes()), len) }
    }

    /// Called when operations may still be in flight at teardown.
    pub fn leak_on_drop(&mut self) {
        self.leak_on_drop = true;
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.leak_on_drop {
            std::mem::forget(self.memory.take());
        }
    }
}

/// An all-zero `msghdr` (its layout has private padding on some targets).
pub fn empty_msghdr() -> libc::msghdr {
    // SAFETY: msghdr is a plain C struct for which all-zero bytes is a valid value (null
    // pointers, zero lengths).
    unsafe { std::mem::zeroed() }
}

/// A listening TCP socket with `SO_REUSEPORT`, so every dataplane thread has its own
/// listener on the same port and the kernel spreads connections between them.
pub fn bind_reuseport_listener(addr: SocketAddr, backlog: i32) -> io::Result<TcpListener> {
    let domain = match addr {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: plain socket(2); the result is checked before use.
    let raw = unsafe { libc::socket(domain, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let one: libc::c_int = 1;
    for option in [libc::SO_REUSEADDR, libc::SO_REUSEPORT] {
        // SAFETY: the option value points to a live c_int of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&one as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    let (storage, len) = socket_address(addr);
    // SAFETY: storage holds a valid sockaddr of `len` bytes for the socket's family.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&storage as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen(2) on a bound socket we own.
    let rc = unsafe { libc::listen(fd.as_raw_fd(), backlog) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TcpListener::from(fd))
}

fn socket_address(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            (storage, size_of::<libc::sockaddr_in>() as libc::socklen_t)
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            (storage, size_of::<libc::sockaddr_in6>() as libc::socklen_t)
        }
    }
}

/// Takes ownership of a descriptor returned by an `Accept` completion.
pub fn adopt_accepted(raw_fd: i32) -> TcpStream {
    assert!(raw_fd >= 0);
    // SAFETY: a non-negative Accept result is a new descriptor owned by nobody else.
    TcpStream::from(unsafe { OwnedFd::from_raw_fd(raw_fd) })
}

/// An eventfd used to wake a sleeping dataplane thread (shutdown, control messages).
pub fn eventfd() -> io::Result<File> {
    // SAFETY: plain eventfd(2); the result is checked before use.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh descriptor that nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(raw) }))
}

/// Sets the calling thread's timer slack: how late the kernel may end a timed sleep to batch
/// wake-ups (50 µs by default). The dataplane sleeps until device and token deadlines that
/// are tens of microseconds apart, so it asks for 1 ns.
pub fn set_timer_slack_ns(slack_ns: u64) -> io::Result<()> {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and passes no memory.
    let result =
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, slack_ns as libc::c_ulong, 0, 0, 0) };
    if result != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
