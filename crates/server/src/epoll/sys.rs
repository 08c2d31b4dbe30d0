//! The raw system calls of the epoll driver: the epoll instance (create, register, wait) and
//! the gathered, non-blocking `sendmsg`. The only code of the driver that may use `unsafe`.

#![allow(unsafe_code)]

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reflex_dataplane::{ConnectionId, Dataplane, SEND_SEGMENTS_MAX};

/// How long [`Epoll::wait`] may sleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timeout {
    /// Do not sleep: report what is ready now (poll mode, or work is pending).
    Zero,
    /// Until an event arrives.
    Forever,
    /// Until an event arrives or this much time has passed.
    After(Duration),
}

/// Whether the missing `epoll_pwait2` was logged (once per process, not per thread).
static PWAIT2_MISSING_LOGGED: AtomicBool = AtomicBool::new(false);

pub struct Epoll {
    fd: OwnedFd,
    /// Whether `epoll_pwait2` (nanosecond timeouts, Linux 5.11) works here; cleared at its
    /// first `ENOSYS` (older kernels, qemu-user), after which timeouts round up to whole
    /// milliseconds.
    pwait2: bool,
}

impl Epoll {
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: plain epoll_create1(2); the result is checked before use.
        let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: raw is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Epoll { fd, pwait2: true })
    }

    /// Watches `fd` for `events`; its events carry `token`.
    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut event = libc::epoll_event { events, u64: token };
        // SAFETY: the event is a live local the kernel only reads during the call.
        let rc =
            unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Stops watching `fd` (before it is closed: a copy of the descriptor that a `fork` in
    /// another thread holds for a moment would otherwise keep its events coming).
    pub fn delete(&self, fd: RawFd) -> io::Result<()> {
        let mut event = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: the event is a live local (ignored by EPOLL_CTL_DEL, required non-null by
        // old kernels).
        let rc =
            unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut event) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits for events as `timeout` allows and copies up to `events.len()` of them; returns
    /// how many. A signal ends the wait early with none.
    pub fn wait(
        &mut self,
        events: &mut [libc::epoll_event],
        timeout: Timeout,
    ) -> io::Result<usize> {
        let max_events = i32::try_from(events.len()).unwrap_or(i32::MAX);
        let rc = match timeout {
            Timeout::After(duration) if self.pwait2 => {
                let timespec = libc::timespec {
                    tv_sec: duration.as_secs().min(i64::MAX as u64) as libc::time_t,
                    tv_nsec: duration.subsec_nanos() as libc::c_long,
                };
                // SAFETY: the events buffer is valid for `max_events` entries and the
                // timespec lives on this stack for the call; no signal mask is passed.
                let rc = unsafe {
                    libc::syscall(
                        libc::SYS_epoll_pwait2,
                        self.fd.as_raw_fd(),
                        events.as_mut_ptr(),
                        max_events,
                        &timespec as *const libc::timespec,
                        std::ptr::null::<libc::sigset_t>(),
                        0usize,
                    )
                };
                if rc < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                    if !PWAIT2_MISSING_LOGGED.swap(true, Ordering::Relaxed) {
                        tracing::info!(
                            "epoll_pwait2 unavailable: sleeps until a deadline round up to \
                             whole milliseconds"
                        );
                    }
                    self.pwait2 = false;
                    return self.wait(events, timeout);
                }
                rc as i64
            }
            _ => {
                let milliseconds = match timeout {
                    Timeout::Zero => 0,
                    Timeout::Forever => -1,
                    // Rounded up: waking before the deadline would only spin.
                    Timeout::After(duration) => {
                        i32::try_from(duration.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX)
                    }
                };
                // SAFETY: the events buffer is valid for `max_events` entries.
                let rc = unsafe {
                    libc::epoll_wait(
                        self.fd.as_raw_fd(),
                        events.as_mut_ptr(),
                        max_events,
                        milliseconds,
                    )
                };
                i64::from(rc)
            }
        };
        if rc < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(error);
        }
        Ok(rc as usize)
    }
}

/// One non-blocking `sendmsg` of the segments the dataplane lends for the send in flight on
/// `id` (gathered, `MSG_NOSIGNAL`): `(bytes sent, bytes offered)`, or the error (`WouldBlock`
/// when the socket buffer is full).
pub fn send_segments(
    socket: &TcpStream,
    dataplane: &Dataplane,
    id: ConnectionId,
) -> io::Result<(usize, usize)> {
    let mut iovecs = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; SEND_SEGMENTS_MAX];
    let mut count = 0;
    let mut offered = 0;
    dataplane.send_segments(id, |segment| {
        assert!(
            count < SEND_SEGMENTS_MAX,
            "more send segments than promised"
        );
        iovecs[count] = libc::iovec {
            iov_base: segment.as_ptr().cast_mut().cast(),
            iov_len: segment.len(),
        };
        count += 1;
        offered += segment.len();
    });
    assert!(count > 0, "a send without bytes");
    let mut msghdr = crate::sys::empty_msghdr();
    msghdr.msg_iov = iovecs.as_mut_ptr();
    msghdr.msg_iovlen = count as _;
    loop {
        // SAFETY: the iovecs point into segments `dataplane` lent; it stays borrowed (shared)
        // for this whole function, so they are alive and unchanged; the msghdr and iovecs
        // live on this stack; the kernel only reads them during the call.
        let rc = unsafe { libc::sendmsg(socket.as_raw_fd(), &msghdr, libc::MSG_NOSIGNAL) };
        if rc >= 0 {
            return Ok((rc as usize, offered));
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}
