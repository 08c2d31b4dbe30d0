//! The crate's only `unsafe` code: one io_uring and every byte of memory it lends the kernel,
//! and the [`Stop`] eventfd that ends a wait in it.
//!
//! Why the reactor owns what it lends: an io_uring operation holds raw pointers (a receive
//! buffer, a `msghdr`, its iovecs and the headers they point at) from submission until its
//! completion is reaped, so that memory must neither move nor be freed nor be written in
//! between. The [`Reactor`] therefore owns all of it: each stream slot's receive buffer,
//! transmit headers, iovecs and `msghdr` are boxed when the reactor is built, never resized,
//! and reused by the next connection in the slot. Data pieces point into a `&'static` region.
//! Callers pass slot indices, never pointers; a slot's receive buffer is readable and its
//! transmit writable only while no operation on it is in flight (asserted), and a slot is
//! closed only when idle (asserted). `Drop` shuts every socket down, cancels what is in
//! flight and reaps until the kernel has given everything back before any of it is freed.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, squeue, types};
use reflex_proto::original::HEADER_SIZE;

/// Streams one reactor holds at most.
pub const STREAMS_MAX: usize = 4096;
/// Iovecs in one `sendmsg`: the kernel's `IOV_MAX`.
pub const TRANSMIT_IOVECS_MAX: usize = 1024;
/// Headers in one transmit: each may be followed by one data piece.
pub const TRANSMIT_HEADERS_MAX: usize = TRANSMIT_IOVECS_MAX / 2;
/// How long `Drop` waits for cancelled operations before giving up on the process.
const CANCEL_WAIT_MAX: Duration = Duration::from_secs(10);

/// What an operation was, in the top byte of its `user_data`; the slot index is below.
const KIND_ACCEPT: u64 = 1;
const KIND_RECEIVE: u64 = 2;
const KIND_SEND: u64 = 3;
const KIND_CANCEL: u64 = 4;
const KIND_WAKE: u64 = 5;
const KIND_SHIFT: u32 = 56;
const INDEX_MASK: u64 = (1 << 32) - 1;

const _: () = assert!(STREAMS_MAX as u64 <= INDEX_MASK);
const _: () = assert!(2 * TRANSMIT_HEADERS_MAX <= TRANSMIT_IOVECS_MAX);

#[inline]
fn user_data(kind: u64, index: usize) -> u64 {
    debug_assert!(index as u64 <= INDEX_MASK);
    (kind << KIND_SHIFT) | index as u64
}

/// How [`Reactor::enter`] waits for completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Never sleep: submit if anything is queued (or the kernel has task work for us), then
    /// return. A loop calling this spins on the completion queue.
    Poll,
    /// Submit and sleep in `io_uring_enter` until a completion arrives, at most this long.
    Sleep(Option<Duration>),
}

/// One completion, after the reactor updated its lending state.
#[derive(Debug)]
pub enum Event {
    Accepted(io::Result<TcpStream>),
    /// The [`Stop`]'s eventfd was written (the read is not re-armed).
    Woken,
    /// A receive into the stream's buffer finished: bytes received (0: the peer closed), or
    /// -errno. The bytes are in [`Reactor::received`].
    Received {
        stream: usize,
        result: i32,
    },
    /// A send finished: bytes sent, or -errno. The transmit has been advanced past the bytes
    /// sent; if it is not empty the send was partial. `headers_completed`: the headers (each
    /// with its data) whose last byte this send took, when it emptied the transmit, else 0.
    Sent {
        stream: usize,
        result: i32,
        headers_completed: usize,
    },
}

/// A completion copied out of the ring, not yet applied (see [`Reactor::complete`]).
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    user_data: u64,
    result: i32,
}

/// What the reactor is built for.
#[derive(Debug, Clone, Copy)]
pub struct ReactorConfig {
    pub streams_max: usize,
    pub receive_bytes: usize,
    pub transmit_headers_max: usize,
    /// The memory data pieces are taken from.
    pub data: &'static [u8],
}

/// A message of headers (owned here) and data pieces (from the static region), sent with one
/// `sendmsg`. Partly sent messages keep their unsent remainder.
pub struct Transmit {
    headers: Box<[[u8; HEADER_SIZE]]>,
    iovecs: Box<[libc::iovec]>,
    header_count: usize,
    iovec_count: usize,
    /// The first iovec not completely sent.
    iovec_first: usize,
    data: &'static [u8],
}

impl Transmit {
    fn new(headers_max: usize, data: &'static [u8]) -> Transmit {
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        Transmit {
            headers: vec![[0; HEADER_SIZE]; headers_max].into_boxed_slice(),
            iovecs: vec![empty; 2 * headers_max].into_boxed_slice(),
            header_count: 0,
            iovec_count: 0,
            iovec_first: 0,
            data,
        }
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.iovec_first == self.iovec_count
    }

    /// Headers that can still be appended.
    #[inline]
    pub fn headers_free(&self) -> usize {
        self.headers.len() - self.header_count
    }

    /// Appends `header` followed by the first `data_length_bytes` of the data region. Returns
    /// false, appending nothing, when the transmit is full or the region too short.
    #[inline]
    pub fn push(&mut self, header: [u8; HEADER_SIZE], data_length_bytes: usize) -> bool {
        if self.header_count == self.headers.len() || data_length_bytes > self.data.len() {
            return false;
        }
        debug_assert!(self.iovec_count + 2 <= self.iovecs.len());
        let slot = &mut self.headers[self.header_count];
        *slot = header;
        self.iovecs[self.iovec_count] = libc::iovec {
            iov_base: slot.as_mut_ptr().cast(),
            iov_len: HEADER_SIZE,
        };
        self.header_count += 1;
        self.iovec_count += 1;
        if data_length_bytes > 0 {
            self.iovecs[self.iovec_count] = libc::iovec {
                iov_base: self.data.as_ptr().cast_mut().cast(),
                iov_len: data_length_bytes,
            };
            self.iovec_count += 1;
        }
        true
    }

    /// Unsent bytes.
    pub fn pending_bytes(&self) -> usize {
        self.iovecs[self.iovec_first..self.iovec_count]
            .iter()
            .map(|iovec| iovec.iov_len)
            .sum()
    }

    /// Moves past `sent` bytes; an emptied transmit starts over at its first slot.
    fn advance(&mut self, mut sent: usize) {
        while sent > 0 && self.iovec_first < self.iovec_count {
            let iovec = &mut self.iovecs[self.iovec_first];
            if sent >= iovec.iov_len {
                sent -= iovec.iov_len;
                self.iovec_first += 1;
            } else {
                iovec.iov_base = iovec.iov_base.cast::<u8>().wrapping_add(sent).cast();
                iovec.iov_len -= sent;
                sent = 0;
            }
        }
        assert_eq!(sent, 0, "the kernel reports more bytes sent than were lent");
        if self.is_empty() {
            self.clear();
        }
    }

    fn clear(&mut self) {
        self.header_count = 0;
        self.iovec_count = 0;
        self.iovec_first = 0;
    }
}

/// One slot: a connection's socket (when open) and the memory lent for it.
struct Slot {
    socket: Option<TcpStream>,
    receive: Box<[u8]>,
    received_length: usize,
    receive_in_flight: bool,
    transmit: Transmit,
    message: Box<libc::msghdr>,
    send_in_flight: bool,
}

/// One thread's ring and everything whose memory it lends to the kernel.
pub struct Reactor {
    ring: IoUring,
    slots: Vec<Slot>,
    /// Closed slots, reused last-in first-out.
    free: Vec<usize>,
    /// Operations submitted (or queued) and not yet reaped; cancels not counted.
    in_flight: usize,
    accept_in_flight: bool,
    /// Where the eventfd read of [`Reactor::arm_wake`] lands.
    wake_word: Box<u64>,
    wake_in_flight: bool,
    /// Entries pushed since the last enter.
    pushed: usize,
}

impl Reactor {
    pub fn new(config: ReactorConfig) -> io::Result<Reactor> {
        assert!((1..=STREAMS_MAX).contains(&config.streams_max));
        assert!(config.receive_bytes > 0);
        assert!((1..=TRANSMIT_HEADERS_MAX).contains(&config.transmit_headers_max));
        // At most one receive and one send per slot, one accept, one wake read and one cancel
        // are ever in flight, so neither queue can fill between two enters, nor the completion queue
        // overflow.
        let entries = (2 * config.streams_max + 3).next_power_of_two().max(8) as u32;
        let ring = IoUring::builder()
            .setup_cqsize(2 * entries)
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .build(entries)
            .or_else(|_| IoUring::builder().setup_cqsize(2 * entries).build(entries))?;
        let slots = (0..config.streams_max)
            .map(|_| Slot {
                socket: None,
                receive: vec![0; config.receive_bytes].into_boxed_slice(),
                received_length: 0,
                receive_in_flight: false,
                transmit: Transmit::new(config.transmit_headers_max, config.data),
                // SAFETY: `msghdr` is plain data for which all-zero bytes are valid (null
                // pointers, zero lengths, no flags).
                message: Box::new(unsafe { std::mem::zeroed() }),
                send_in_flight: false,
            })
            .collect();
        Ok(Reactor {
            ring,
            slots,
            free: (0..config.streams_max).rev().collect(),
            in_flight: 0,
            accept_in_flight: false,
            wake_word: Box::new(0),
            wake_in_flight: false,
            pushed: 0,
        })
    }

    /// Completions the ring holds at most: the capacity to give [`Reactor::reap`]'s vector.
    pub fn completion_capacity(&mut self) -> usize {
        self.ring.completion().capacity()
    }

    /// Takes `socket` into a free slot; gives it back when every slot is taken.
    pub fn insert(&mut self, socket: TcpStream) -> Result<usize, TcpStream> {
        let Some(index) = self.free.pop() else {
            return Err(socket);
        };
        let slot = &mut self.slots[index];
        assert!(slot.socket.is_none());
        assert!(!slot.receive_in_flight && !slot.send_in_flight);
        slot.socket = Some(socket);
        slot.received_length = 0;
        slot.transmit.clear();
        Ok(index)
    }

    /// Whether the slot has nothing left to send (only while no send is in flight).
    #[inline]
    pub fn transmit_is_empty(&self, index: usize) -> bool {
        let slot = &self.slots[index];
        assert!(!slot.send_in_flight, "slot {index}'s transmit is lent");
        slot.transmit.is_empty()
    }

    /// Closes an idle slot's socket and frees the slot.
    pub fn close(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        assert!(
            !slot.receive_in_flight,
            "closing slot {index} with a receive in flight"
        );
        assert!(
            !slot.send_in_flight,
            "closing slot {index} with a send in flight"
        );
        assert!(slot.socket.take().is_some(), "closing free slot {index}");
        self.free.push(index);
    }

    /// Shuts the socket down both ways, so a receive in flight completes.
    pub fn shutdown(&mut self, index: usize) {
        if let Some(socket) = &self.slots[index].socket {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }

    #[inline]
    pub fn is_idle(&self, index: usize) -> bool {
        let slot = &self.slots[index];
        !slot.receive_in_flight && !slot.send_in_flight
    }

    #[inline]
    pub fn send_in_flight(&self, index: usize) -> bool {
        self.slots[index].send_in_flight
    }

    #[inline]
    pub fn receive_in_flight(&self, index: usize) -> bool {
        self.slots[index].receive_in_flight
    }

    /// The bytes the slot's last receive brought.
    #[inline]
    pub fn received(&self, index: usize) -> &[u8] {
        let slot = &self.slots[index];
        assert!(!slot.receive_in_flight, "slot {index}'s buffer is lent");
        &slot.receive[..slot.received_length]
    }

    /// The slot's transmit, to append to; only while no send is in flight.
    #[inline]
    pub fn transmit(&mut self, index: usize) -> &mut Transmit {
        let slot = &mut self.slots[index];
        assert!(!slot.send_in_flight, "slot {index}'s transmit is lent");
        &mut slot.transmit
    }

    /// Queues an entry for the next enter.
    fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: every entry built in this module points only into memory the reactor
            // owns and keeps in place, unwritten, until the entry's completion is reaped
            // (module doc; `Drop` reaps before freeing). The queue copies the entry itself.
            let pushed = unsafe { self.ring.submission().push(entry) };
            if pushed.is_ok() {
                self.pushed += 1;
                return Ok(());
            }
            // Sized so this cannot happen (see `new`); flush rather than fail if it does.
            self.ring.submit()?;
            self.pushed = 0;
        }
    }

    /// Starts accepting one connection on `listener` unless an accept is in flight.
    pub fn arm_accept(&mut self, listener: &TcpListener) -> io::Result<()> {
        if self.accept_in_flight {
            return Ok(());
        }
        let entry = opcode::Accept::new(
            types::Fd(listener.as_raw_fd()),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
        .flags(libc::SOCK_CLOEXEC)
        .build()
        .user_data(user_data(KIND_ACCEPT, 0));
        self.push(&entry)?;
        self.accept_in_flight = true;
        self.in_flight += 1;
        Ok(())
    }

    /// Starts reading `stop`'s eventfd unless a read is in flight: a [`Stop::stop`] then ends
    /// the current or next sleep in [`Reactor::enter`] with [`Event::Woken`].
    pub fn arm_wake(&mut self, stop: &Stop) -> io::Result<()> {
        if self.wake_in_flight {
            return Ok(());
        }
        let entry = opcode::Read::new(
            types::Fd(stop.eventfd.as_raw_fd()),
            std::ptr::from_mut::<u64>(&mut self.wake_word).cast::<u8>(),
            8,
        )
        .build()
        .user_data(user_data(KIND_WAKE, 0));
        self.push(&entry)?;
        self.wake_in_flight = true;
        self.in_flight += 1;
        Ok(())
    }

    /// Starts a receive into the slot's whole buffer unless one is in flight.
    pub fn arm_receive(&mut self, index: usize) -> io::Result<()> {
        let slot = &mut self.slots[index];
        if slot.receive_in_flight {
            return Ok(());
        }
        let Some(socket) = &slot.socket else {
            panic!("receive on free slot {index}");
        };
        let length = u32::try_from(slot.receive.len()).unwrap_or(u32::MAX);
        let entry = opcode::Recv::new(
            types::Fd(socket.as_raw_fd()),
            slot.receive.as_mut_ptr(),
            length,
        )
        .build()
        .user_data(user_data(KIND_RECEIVE, index));
        self.push(&entry)?;
        self.slots[index].receive_in_flight = true;
        self.in_flight += 1;
        Ok(())
    }

    /// Starts sending the slot's transmit (it must not be empty) unless a send is in flight.
    pub fn arm_send(&mut self, index: usize) -> io::Result<()> {
        let slot = &mut self.slots[index];
        if slot.send_in_flight {
            return Ok(());
        }
        assert!(!slot.transmit.is_empty(), "sending an empty transmit");
        let Some(socket) = &slot.socket else {
            panic!("send on free slot {index}");
        };
        let transmit = &mut slot.transmit;
        let message = &mut *slot.message;
        message.msg_iov = transmit.iovecs[transmit.iovec_first..].as_mut_ptr();
        message.msg_iovlen = (transmit.iovec_count - transmit.iovec_first) as _;
        let entry = opcode::SendMsg::new(types::Fd(socket.as_raw_fd()), message)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(user_data(KIND_SEND, index));
        self.push(&entry)?;
        self.slots[index].send_in_flight = true;
        self.in_flight += 1;
        Ok(())
    }

    /// One `io_uring_enter` at most: submits what was queued and waits as `wait` says.
    pub fn enter(&mut self, wait: Wait) -> io::Result<()> {
        let result = match wait {
            Wait::Poll => {
                // With cooperative task running, socket completions are posted when the
                // thread enters the kernel; the TASKRUN flag says one is due.
                let kernel_wants_entry = {
                    let submission = self.ring.submission();
                    submission.taskrun() || submission.cq_overflow()
                };
                if self.pushed == 0 && !kernel_wants_entry {
                    return Ok(());
                }
                self.ring.submit()
            }
            Wait::Sleep(Some(timeout)) => {
                let timespec = types::Timespec::from(timeout);
                let args = types::SubmitArgs::new().timespec(&timespec);
                self.ring.submitter().submit_with_args(1, &args)
            }
            Wait::Sleep(None) => self.ring.submit_and_wait(1),
        };
        self.pushed = 0;
        match result {
            Ok(_) => Ok(()),
            // A timeout, a signal or a full completion queue end the wait: normal wake-ups.
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::ETIME | libc::EINTR | libc::EBUSY)
                ) =>
            {
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// Copies completions out of the ring into `completions` (at most their spare capacity),
    /// touching no state: each is applied by [`Reactor::complete`] when its turn comes, so a
    /// handler never sees the effect of a completion it has not handled yet.
    pub fn reap(&mut self, completions: &mut Vec<Completion>) {
        let room = (completions.capacity() - completions.len()).max(1);
        let completion = self.ring.completion();
        completions.extend(completion.take(room).map(|cqe| Completion {
            user_data: cqe.user_data(),
            result: cqe.result(),
        }));
    }

    /// Applies one reaped completion to the lending state and says what it was. Cancels give
    /// `None`.
    pub fn complete(&mut self, completion: Completion) -> Option<Event> {
        let Completion { user_data, result } = completion;
        let index = (user_data & INDEX_MASK) as usize;
        match user_data >> KIND_SHIFT {
            KIND_ACCEPT => {
                assert!(self.accept_in_flight, "stale accept completion");
                self.accept_in_flight = false;
                self.in_flight -= 1;
                let accepted = if result >= 0 {
                    // SAFETY: a successful accept returns a new descriptor that nothing else
                    // owns; it is adopted exactly once, here.
                    let fd = unsafe { OwnedFd::from_raw_fd(result) };
                    Ok(TcpStream::from(fd))
                } else {
                    Err(io::Error::from_raw_os_error(-result))
                };
                Some(Event::Accepted(accepted))
            }
            KIND_WAKE => {
                assert!(self.wake_in_flight, "stale wake completion");
                self.wake_in_flight = false;
                self.in_flight -= 1;
                Some(Event::Woken)
            }
            KIND_RECEIVE => {
                let slot = &mut self.slots[index];
                assert!(slot.receive_in_flight, "stale receive completion");
                slot.receive_in_flight = false;
                slot.received_length = usize::try_from(result).unwrap_or(0);
                assert!(slot.received_length <= slot.receive.len());
                self.in_flight -= 1;
                Some(Event::Received {
                    stream: index,
                    result,
                })
            }
            KIND_SEND => {
                let slot = &mut self.slots[index];
                assert!(slot.send_in_flight, "stale send completion");
                slot.send_in_flight = false;
                let headers_before = slot.transmit.header_count;
                if let Ok(sent) = usize::try_from(result) {
                    slot.transmit.advance(sent);
                }
                let headers_completed = if slot.transmit.is_empty() {
                    headers_before
                } else {
                    0
                };
                self.in_flight -= 1;
                Some(Event::Sent {
                    stream: index,
                    result,
                    headers_completed,
                })
            }
            // Cancels, and nothing else: this module builds every user_data.
            _ => None,
        }
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        if self.in_flight == 0 {
            return;
        }
        // Memory is still lent: shut every socket down, cancel everything, then reap until
        // the kernel has given all of it back. Only then may the slots be freed.
        for index in 0..self.slots.len() {
            self.shutdown(index);
        }
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data(user_data(KIND_CANCEL, 0));
        let _ = self.push(&cancel);
        let deadline = Instant::now() + CANCEL_WAIT_MAX;
        let mut completions = Vec::with_capacity(self.completion_capacity());
        while self.in_flight > 0 {
            let now = Instant::now();
            if now >= deadline {
                eprintln!("io_uring operations did not finish after cancel; aborting");
                std::process::abort();
            }
            let _ = self.enter(Wait::Sleep(Some(deadline - now)));
            self.reap(&mut completions);
            for completion in completions.drain(..) {
                // Accepted sockets are closed as the event drops.
                drop(self.complete(completion));
            }
        }
    }
}

/// Stops a loop from another thread: sets a flag the loop checks every iteration and writes
/// an eventfd whose read the loop keeps armed ([`Reactor::arm_wake`]), so a loop asleep in
/// `io_uring_enter` wakes at once. (A signal to the loop's own thread is not enough: valgrind,
/// for one, never delivers a signal to a thread sleeping in `io_uring_enter`.)
#[derive(Debug, Clone)]
pub struct Stop {
    flag: Arc<AtomicBool>,
    eventfd: Arc<File>,
}

impl Stop {
    pub fn new() -> io::Result<Stop> {
        // SAFETY: eventfd takes two integers and passes no memory.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor that nothing else owns; adopted once, here.
        let eventfd = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(Stop {
            flag: Arc::new(AtomicBool::new(false)),
            eventfd: Arc::new(eventfd),
        })
    }

    #[inline]
    pub fn is_stopped(&self) -> bool {
        self.flag.load(Ordering::Relaxed)
    }

    pub fn stop(&self) {
        self.flag.store(true, Ordering::Relaxed);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live stack array to a descriptor this Stop owns. A
        // failure (the counter is saturated) still leaves a wake-up pending, so it is ignored.
        let _ = unsafe { libc::write(self.eventfd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}
