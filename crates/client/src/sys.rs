//! The crate's only unsafe code: two Linux system calls std does not wrap.
//!
//! - `ioprio_get(IOPRIO_WHO_PROCESS, 0)`: the calling process's I/O priority, which HELLO
//!   declares so the server can map `ionice` classes to its queues without the application
//!   changing (the NVMe QoS paper's idea). The value is `class << 13 | data`
//!   (`IOPRIO_PRIO_VALUE` in linux/ioprio.h): class 1 real-time, 2 best-effort, 3 idle; a
//!   process never given a priority reports class 0 ("none", the kernel derives it from the
//!   nice value) or, on newer kernels, the best-effort default it derives.
//! - `poll(2)` on one socket, so the std drivers can wait for "readable or writable" at once
//!   and never block on a send while the server waits for us to read.
#![allow(unsafe_code)]

use std::os::fd::RawFd;
use std::time::Duration;

/// `IOPRIO_WHO_PROCESS` from linux/ioprio.h.
const IOPRIO_WHO_PROCESS: libc::c_long = 1;

/// The calling process's I/O priority as HELLO carries it, or 0 when the call fails or the
/// value does not fit the 16-bit field.
pub fn io_priority_of_process() -> u16 {
    // SAFETY: ioprio_get takes two integers and returns an integer; no memory is passed.
    let value =
        unsafe { libc::syscall(libc::SYS_ioprio_get, IOPRIO_WHO_PROCESS, 0 as libc::c_long) };
    u16::try_from(value).unwrap_or(0)
}

/// Readiness reported by [`poll_socket`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Readiness {
    pub readable: bool,
    pub writable: bool,
}

/// Waits until `fd` is readable (or, with `want_write`, writable) or `timeout` passes
/// (`None`: no limit). Errors, hang-ups and EINTR count as readable: the next read reports
/// them.
pub fn poll_socket(
    fd: RawFd,
    want_write: bool,
    timeout: Option<Duration>,
) -> std::io::Result<Readiness> {
    let mut entry = libc::pollfd {
        fd,
        events: libc::POLLIN | if want_write { libc::POLLOUT } else { 0 },
        revents: 0,
    };
    let timeout_ms: libc::c_int = match timeout {
        None => -1,
        Some(duration) => {
            // Round up so a short positive timeout does not become a busy loop.
            let ms = duration.as_nanos().div_ceil(1_000_000);
            libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
        }
    };
    // SAFETY: `entry` is a valid pollfd on our stack for the duration of the call and the
    // count passed is 1.
    let result = unsafe { libc::poll(&mut entry, 1, timeout_ms) };
    if result < 0 {
        let error = std::io::Error::last_os_error();
        if error.kind() == std::io::ErrorKind::Interrupted {
            return Ok(Readiness {
                readable: false,
                writable: false,
            });
        }
        return Err(error);
    }
    let failed = entry.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
    Ok(Readiness {
        readable: failed || entry.revents & libc::POLLIN != 0,
        writable: entry.revents & libc::POLLOUT != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_priority_is_a_valid_ioprio_value() {
        let priority = io_priority_of_process();
        let class = priority >> 13;
        assert!(class <= 3, "class {class} out of range");
    }
}
