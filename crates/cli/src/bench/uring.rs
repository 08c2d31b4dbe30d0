//! The `reflex` tool's only unsafe code: one io_uring per bench thread (the [`Reactor`]) and
//! CPU pinning.
//!
//! Why the reactor owns what it lends: an io_uring operation holds a raw pointer into a
//! buffer from submission until its completion, so the buffer must neither move nor be freed
//! in between. The reactor therefore *owns* every lent buffer — the connection cores (native
//! or NBD, see `wire.rs`; their transmit and receive buffers do not move while lent: both
//! cores refuse to grow a lent buffer) and the aligned slot arena of local mode (callers pass a slot index, never a
//! pointer) — and its `Drop` cancels and reaps every operation still in flight before any of
//! them is freed. Completions update the lending state (`transmit_done`, `receive_done`, slot
//! release) inside the reactor, so a caller cannot forget to.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::wire::Wire;
use io_uring::{IoUring, opcode, squeue, types};

/// Alignment of slot buffers: enough for O_DIRECT on 4 KiB-sector devices.
pub const SLOT_ALIGNMENT_BYTES: usize = 4096;
/// How long `Drop` waits for cancelled operations before giving up on the process.
const CANCEL_WAIT_MAX: Duration = Duration::from_secs(10);

/// What an operation was, encoded in its `user_data`.
const KIND_SEND: u64 = 1;
const KIND_RECEIVE: u64 = 2;
const KIND_FILE: u64 = 3;
const KIND_CANCEL: u64 = 4;
const KIND_SHIFT: u32 = 56;
const INDEX_MASK: u64 = (1 << 32) - 1;

fn user_data(kind: u64, index: usize) -> u64 {
    assert!(index as u64 <= INDEX_MASK);
    (kind << KIND_SHIFT) | index as u64
}

/// One completed operation, after the reactor updated its lending state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A send on connection `connection` finished: bytes sent, or -errno.
    Sent { connection: usize, result: i32 },
    /// A receive finished: bytes received (0: the peer closed), or -errno.
    Received { connection: usize, result: i32 },
    /// A file read or write on slot `slot` finished: bytes moved, or -errno.
    File { slot: usize, result: i32 },
}

struct NetConnection {
    stream: TcpStream,
    core: Wire,
}

/// Page-aligned slot buffers carved from one allocation, for O_DIRECT file I/O.
struct SlotArena {
    memory: Vec<u8>,
    /// Offset of the first aligned byte in `memory`.
    start: usize,
    slot_bytes: usize,
    in_flight: Vec<bool>,
}

impl SlotArena {
    fn new(slot_count: usize, slot_bytes: usize) -> SlotArena {
        assert!(slot_bytes.is_multiple_of(512));
        let slot_bytes = slot_bytes.next_multiple_of(SLOT_ALIGNMENT_BYTES);
        let memory = vec![0u8; slot_count * slot_bytes + SLOT_ALIGNMENT_BYTES];
        let address = memory.as_ptr() as usize;
        let start = address.next_multiple_of(SLOT_ALIGNMENT_BYTES) - address;
        SlotArena {
            memory,
            start,
            slot_bytes,
            in_flight: vec![false; slot_count],
        }
    }

    fn range(&self, slot: usize) -> std::ops::Range<usize> {
        let start = self.start + slot * self.slot_bytes;
        start..start + self.slot_bytes
    }
}

/// One bench thread's ring and everything whose memory it lends to the kernel.
pub struct Reactor {
    ring: IoUring,
    connections: Vec<NetConnection>,
    file: Option<File>,
    arena: Option<SlotArena>,
    /// Data operations submitted and not yet completed (cancels not counted).
    in_flight: usize,
    /// Sends/receives in flight per connection, so a connection's buffers are lent once.
    send_in_flight: Vec<bool>,
    receive_in_flight: Vec<bool>,
}

impl Reactor {
    /// A ring with room for `entries` operations at once, owning `connections` (socket and
    /// core after HELLO or the NBD handshake) and, for local mode, `file` with `slot_count` buffers of
    /// `slot_bytes`.
    pub fn new(
        entries: u32,
        connections: Vec<(TcpStream, Wire)>,
        file: Option<(File, usize, usize)>,
    ) -> io::Result<Reactor> {
        let entries = entries.clamp(8, 32_768).next_power_of_two();
        let ring = IoUring::builder()
            .setup_coop_taskrun()
            .setup_single_issuer()
            .build(entries)
            .or_else(|_| IoUring::new(entries))?;
        let connection_count = connections.len();
        let (file, arena) = match file {
            Some((file, slot_count, slot_bytes)) => {
                (Some(file), Some(SlotArena::new(slot_count, slot_bytes)))
            }
            None => (None, None),
        };
        Ok(Reactor {
            ring,
            connections: connections
                .into_iter()
                .map(|(stream, core)| NetConnection { stream, core })
                .collect(),
            file,
            arena,
            in_flight: 0,
            send_in_flight: vec![false; connection_count],
            receive_in_flight: vec![false; connection_count],
        })
    }

    pub fn connection_count(&self) -> usize {
        self.connections.len()
    }

    /// The connection's core. Its own API keeps lent buffers in place; do not replace it.
    pub fn core(&mut self, connection: usize) -> &mut Wire {
        &mut self.connections[connection].core
    }

    /// A slot buffer of local mode (not in flight), `length` bytes from its aligned start.
    pub fn slot_buffer(&mut self, slot: usize, length: usize) -> &mut [u8] {
        let arena = self.arena.as_mut().expect("local mode has an arena");
        assert!(!arena.in_flight[slot], "slot {slot} is lent to the kernel");
        assert!(length <= arena.slot_bytes);
        let range = arena.range(slot);
        &mut arena.memory[range.start..range.start + length]
    }

    fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        // SAFETY: every entry built in this module points into memory the reactor owns and
        // keeps in place until the entry's completion is reaped (see the module doc and
        // `Drop`); the submission queue copies the entry itself.
        let pushed = unsafe { self.ring.submission().push(entry) };
        if pushed.is_err() {
            // Full: hand the queued entries to the kernel and retry once.
            self.ring.submit()?;
            // SAFETY: as above.
            unsafe { self.ring.submission().push(entry) }
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        Ok(())
    }

    /// Starts a send of the connection's unsent bytes unless one is in flight or nothing
    /// waits. Returns whether a send was queued.
    pub fn arm_send(&mut self, connection: usize) -> io::Result<bool> {
        if self.send_in_flight[connection] {
            return Ok(false);
        }
        let fd = self.connections[connection].stream.as_raw_fd();
        let Some(bytes) = self.connections[connection].core.transmit_start() else {
            return Ok(false);
        };
        let length = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
        let entry = opcode::Send::new(types::Fd(fd), bytes.as_ptr(), length)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(user_data(KIND_SEND, connection));
        if let Err(error) = self.push(&entry) {
            self.connections[connection].core.transmit_done(0);
            return Err(error);
        }
        self.send_in_flight[connection] = true;
        self.in_flight += 1;
        Ok(true)
    }

    /// Starts a receive into the connection's free receive space unless one is in flight or
    /// the buffer is full of unpolled responses. Returns whether a receive was queued.
    pub fn arm_receive(&mut self, connection: usize) -> io::Result<bool> {
        if self.receive_in_flight[connection] {
            return Ok(false);
        }
        let fd = self.connections[connection].stream.as_raw_fd();
        let Some(space) = self.connections[connection].core.receive_start() else {
            return Ok(false);
        };
        let length = u32::try_from(space.len()).unwrap_or(u32::MAX);
        let entry = opcode::Recv::new(types::Fd(fd), space.as_mut_ptr(), length)
            .build()
            .user_data(user_data(KIND_RECEIVE, connection));
        if let Err(error) = self.push(&entry) {
            self.connections[connection].core.receive_done(0);
            return Err(error);
        }
        self.receive_in_flight[connection] = true;
        self.in_flight += 1;
        Ok(true)
    }

    /// Starts a read (`write == false`) or write of `length` bytes at `offset` of the local
    /// file through slot `slot`'s buffer.
    pub fn submit_file(
        &mut self,
        slot: usize,
        write: bool,
        offset: u64,
        length: usize,
    ) -> io::Result<()> {
        let fd = self
            .file
            .as_ref()
            .expect("local mode has a file")
            .as_raw_fd();
        let arena = self.arena.as_mut().expect("local mode has an arena");
        assert!(!arena.in_flight[slot], "slot {slot} is already lent");
        assert!(length <= arena.slot_bytes);
        let range = arena.range(slot);
        let pointer = arena.memory[range].as_mut_ptr();
        let entry = if write {
            opcode::Write::new(types::Fd(fd), pointer, length as u32)
                .offset(offset)
                .build()
        } else {
            opcode::Read::new(types::Fd(fd), pointer, length as u32)
                .offset(offset)
                .build()
        }
        .user_data(user_data(KIND_FILE, slot));
        self.push(&entry)?;
        if let Some(arena) = self.arena.as_mut() {
            arena.in_flight[slot] = true;
        }
        self.in_flight += 1;
        Ok(())
    }

    /// Submits what was queued and waits for at least `want` completions, at most `timeout`
    /// (`None`: no limit). A timeout or signal is not an error.
    pub fn submit_and_wait(&mut self, want: usize, timeout: Option<Duration>) -> io::Result<()> {
        let result = match timeout {
            Some(timeout) if want > 0 => {
                let timespec = types::Timespec::from(timeout);
                let args = types::SubmitArgs::new().timespec(&timespec);
                self.ring.submitter().submit_with_args(want, &args)
            }
            _ => self.ring.submitter().submit_and_wait(want),
        };
        match result {
            Ok(_) => Ok(()),
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                ) =>
            {
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// Moves completions out of the ring into `events`, updating lending state first.
    pub fn reap(&mut self, events: &mut Vec<Event>) {
        let first = events.len();
        let mut completion = self.ring.completion();
        completion.sync();
        for cqe in &mut completion {
            let data = cqe.user_data();
            let result = cqe.result();
            let index = (data & INDEX_MASK) as usize;
            match data >> KIND_SHIFT {
                KIND_SEND => {
                    events.push(Event::Sent {
                        connection: index,
                        result,
                    });
                }
                KIND_RECEIVE => {
                    events.push(Event::Received {
                        connection: index,
                        result,
                    });
                }
                KIND_FILE => events.push(Event::File {
                    slot: index,
                    result,
                }),
                // Cancels, and nothing else: this module builds every user_data.
                _ => {}
            }
        }
        drop(completion);
        for event in &events[first..] {
            match *event {
                Event::Sent { connection, result } if self.send_in_flight[connection] => {
                    self.send_in_flight[connection] = false;
                    self.in_flight -= 1;
                    let sent = usize::try_from(result).unwrap_or(0);
                    self.connections[connection].core.transmit_done(sent);
                }
                Event::Received { connection, result } if self.receive_in_flight[connection] => {
                    self.receive_in_flight[connection] = false;
                    self.in_flight -= 1;
                    let received = usize::try_from(result).unwrap_or(0);
                    self.connections[connection].core.receive_done(received);
                }
                Event::File { slot, .. } => {
                    if let Some(arena) = self.arena.as_mut()
                        && arena.in_flight[slot]
                    {
                        arena.in_flight[slot] = false;
                        self.in_flight -= 1;
                    }
                }
                _ => {}
            }
        }
    }

    /// Shuts every socket down, so receives still waiting complete.
    pub fn shutdown_sockets(&mut self) {
        for connection in &self.connections {
            let _ = connection.stream.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        if self.in_flight == 0 {
            return;
        }
        // Buffers are still lent: cancel everything, then reap until the kernel has given
        // every one back. Only then may the fields (and the buffers) be dropped.
        self.shutdown_sockets();
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data(user_data(KIND_CANCEL, 0));
        let _ = self.push(&cancel);
        let deadline = Instant::now() + CANCEL_WAIT_MAX;
        let mut events = Vec::new();
        while self.in_flight > 0 {
            let now = Instant::now();
            if now >= deadline {
                eprintln!("reflex: io_uring operations did not finish after cancel; aborting");
                std::process::abort();
            }
            let _ = self.submit_and_wait(1, Some(deadline - now));
            events.clear();
            self.reap(&mut events);
        }
    }
}

/// Pins the calling thread to CPU `cpu`.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    // SAFETY: `cpu_set_t` is plain data for which all-zero bytes are a valid (empty) set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "CPU index too large",
        ));
    }
    // SAFETY: `cpu` is below CPU_SETSIZE (checked above), so the bit lies inside `set`.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t on our stack and the size passed is its size; pid 0
    // means the calling thread.
    let result =
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if result != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the calling thread's timed sleeps (the ring's wait timeout) precise to 1 ns instead
/// of the default 50 µs slack, so open-loop sends leave close to their intended times.
pub fn set_timer_slack_ns(slack_ns: u64) -> io::Result<()> {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and passes no memory.
    let result =
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, slack_ns as libc::c_ulong, 0, 0, 0) };
    if result != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
