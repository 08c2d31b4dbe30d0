//! The raw system calls reflexd needs outside io_uring: listeners with `SO_REUSEPORT`,
//! adopting accepted descriptors, eventfds, timer slack, and socket addresses.

use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The socket's smoothed round-trip time in µs (`TCP_INFO`'s `tcpi_rtt`): the network share
/// of what a client sees, for self-calibration (`Op::SampleRtt`).
pub fn tcp_rtt_us(socket: &impl AsRawFd) -> Result<u32, i32> {
    // SAFETY: tcp_info is a plain C struct for which all-zero bytes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the option value points to a live tcp_info of the size given; the kernel writes
    // at most `len` bytes.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO));
    }
    Ok(info.tcpi_rtt)
}

/// Pins the calling thread to one CPU (`dataplane_cpus`); the errno when the kernel refuses
/// (a CPU that does not exist or is outside the process's cpuset: EINVAL).
pub fn pin_current_thread(cpu: usize) -> Result<(), i32> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(libc::EINVAL);
    }
    // SAFETY: cpu_set_t is a plain C bit set for which all-zero bytes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: cpu < CPU_SETSIZE (checked above), so the bit lies inside the set.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: the set is a live cpu_set_t of the size given; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL));
    }
    Ok(())
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

/// The IP address in a `sockaddr_storage` an accept filled in (`None` for another family).
pub fn peer_ip(storage: &libc::sockaddr_storage) -> Option<IpAddr> {
    match i32::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is large and
            // aligned enough for.
            let sin =
                unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                sin.sin_addr.s_addr,
            ))))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe {
                &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
        }
        _ => None,
    }
}

/// An all-zero `sockaddr_storage` (for an accept to fill in).
pub fn empty_sockaddr() -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
    unsafe { std::mem::zeroed() }
}

/// Steers new connections of the `SO_REUSEPORT` group `member` belongs to onto its first
/// `active` sockets (thread scaling: the group's sockets are in bind order, thread 0 first;
/// threads `active..` get none), by a classic BPF program picking one of them at random.
/// `None` detaches the program: the kernel's hash spreads connections over every socket again.
pub fn steer_reuseport(member: &impl AsRawFd, active: Option<u32>) -> io::Result<()> {
    let Some(active) = active else {
        let unused: libc::c_int = 0;
        // SAFETY: `unused` outlives the call, which reads `size_of::<c_int>()` bytes of it.
        let rc = unsafe {
            libc::setsockopt(
                member.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_DETACH_REUSEPORT_BPF,
                (&unused as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        let error = io::Error::last_os_error();
        // ENOENT: no program was attached.
        return if rc == 0 || error.raw_os_error() == Some(libc::ENOENT) {
            Ok(())
        } else {
            Err(error)
        };
    };
    assert!(active >= 1);
    const SKF_AD_OFF: i32 = -0x1000;
    const SKF_AD_RANDOM: i32 = 56;
    let mut program = [
        // A = a random 32-bit number.
        libc::sock_filter {
            code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
            jt: 0,
            jf: 0,
            k: (SKF_AD_OFF + SKF_AD_RANDOM) as u32,
        },
        // A = A % active.
        libc::sock_filter {
            code: (libc::BPF_ALU | libc::BPF_MOD | libc::BPF_K) as u16,
            jt: 0,
            jf: 0,
            k: active,
        },
        // The socket at index A.
        libc::sock_filter {
            code: (libc::BPF_RET | libc::BPF_A) as u16,
            jt: 0,
            jf: 0,
            k: 0,
        },
    ];
    let fprog = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_mut_ptr(),
    };
    // SAFETY: `fprog` and the program it points to outlive the call; the kernel copies them.
    let rc = unsafe {
        libc::setsockopt(
            member.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_REUSEPORT_CBPF,
            (&fprog as *const libc::sock_fprog).cast(),
            size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    #[test]
    fn a_loopback_connection_has_a_round_trip_and_a_file_has_none() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let mut byte = [0u8; 1];
        for _ in 0..10 {
            server.write_all(b"x").unwrap();
            client.read_exact(&mut byte).unwrap();
            client.write_all(b"y").unwrap();
            server.read_exact(&mut byte).unwrap();
        }
        let rtt_us = tcp_rtt_us(&server).unwrap();
        // Loopback: far below a second (qemu-user, which runs the aarch64 build's tests here,
        // does not translate TCP_INFO and answers 0).
        assert!(rtt_us < 1_000_000, "{rtt_us} µs");
        let file = File::open("/dev/null").unwrap();
        assert_eq!(tcp_rtt_us(&file), Err(libc::ENOTSOCK));
    }
}
