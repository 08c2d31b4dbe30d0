//! The device the simulated dataplane threads submit to, as a small virtual-time trait, with a
//! simple deterministic model for the simulator's own tests and an adapter for the emulated
//! Flash device (`reflex_flash::emu::EmuDevice`) that the scenarios use.
//!
//! Why a trait of our own: the simulator needs only "submit at `now`, tell me what completed by
//! `now`, when is the next completion"; keeping that seam small lets the engine be tested with
//! a model whose latencies are known exactly.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use reflex_qos::{IoKind, Nanos};

/// One I/O as the simulated dataplane hands it to the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimIo {
    pub tag: u64,
    pub kind: IoKind,
    pub offset: u64,
    pub len: u32,
    /// Submission queue: the dataplane thread's index.
    pub queue: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimDone {
    pub tag: u64,
    pub completed_at: Nanos,
}

pub trait SimDevice {
    /// Queues an I/O at `now`; `false` if the device cannot take it now (the caller keeps it).
    fn submit(&mut self, now: Nanos, io: SimIo) -> bool;
    /// Appends every completion due at or before `now`, in completion order.
    fn advance(&mut self, now: Nanos, out: &mut Vec<SimDone>);
    /// When `advance` next has something to do.
    fn next_event(&self) -> Option<Nanos>;
    /// Bytes the device holds (for choosing offsets).
    fn capacity_bytes(&self) -> u64;
}

/// A device with `servers` identical FIFO servers and fixed service times: an M/D/c queue.
/// Deterministic and easy to reason about, for testing the simulator itself.
#[derive(Debug)]
pub struct FixedDevice {
    read_ns: u64,
    write_ns: u64,
    busy_until: Vec<u64>,
    queue_depth_max: usize,
    waiting: VecDeque<(SimIo, Nanos)>,
    in_service: BinaryHeap<Reverse<(Nanos, u64)>>,
    capacity_bytes: u64,
}

impl FixedDevice {
    pub fn new(servers: usize, read_ns: u64, write_ns: u64, queue_depth_max: usize) -> FixedDevice {
        assert!(servers > 0, "a device needs a server");
        FixedDevice {
            read_ns,
            write_ns,
            busy_until: vec![0; servers],
            queue_depth_max,
            waiting: VecDeque::new(),
            in_service: BinaryHeap::new(),
            capacity_bytes: 1 << 30,
        }
    }

    pub fn set_capacity_bytes(&mut self, capacity_bytes: u64) {
        self.capacity_bytes = capacity_bytes.max(4096);
    }

    fn start(&mut self, now: Nanos) {
        while let Some(&(io, _)) = self.waiting.front() {
            if self.in_service.len() >= self.busy_until.len() {
                break;
            }
            let (server, free_at) = self
                .busy_until
                .iter()
                .copied()
                .enumerate()
                .min_by_key(|&(_, t)| t)
                .unwrap_or((0, 0));
            self.waiting.pop_front();
            let units = u64::from(io.len.div_ceil(4096).max(1));
            let service = units
                * match io.kind {
                    IoKind::Read => self.read_ns,
                    IoKind::Write => self.write_ns,
                };
            let done = free_at.max(now.0) + service;
            self.busy_until[server] = done;
            self.in_service.push(Reverse((Nanos(done), io.tag)));
        }
    }
}

impl SimDevice for FixedDevice {
    fn submit(&mut self, now: Nanos, io: SimIo) -> bool {
        if self.waiting.len() + self.in_service.len() >= self.queue_depth_max {
            return false;
        }
        self.waiting.push_back((io, now));
        self.start(now);
        true
    }

    fn advance(&mut self, now: Nanos, out: &mut Vec<SimDone>) {
        while let Some(&Reverse((at, tag))) = self.in_service.peek() {
            if at > now {
                break;
            }
            self.in_service.pop();
            out.push(SimDone {
                tag,
                completed_at: at,
            });
            self.start(at);
        }
    }

    fn next_event(&self) -> Option<Nanos> {
        self.in_service.peek().map(|Reverse((at, _))| *at)
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }
}

/// The emulated Flash device (`reflex_flash::emu`) in virtual time.
pub struct EmuSimDevice {
    device: reflex_flash::emu::EmuDevice,
    completions: Vec<reflex_flash::emu::EmuCompletion>,
}

impl EmuSimDevice {
    pub fn new(device: reflex_flash::emu::EmuDevice) -> EmuSimDevice {
        EmuSimDevice {
            device,
            completions: Vec::new(),
        }
    }

    pub fn emu(&self) -> &reflex_flash::emu::EmuDevice {
        &self.device
    }
}

impl SimDevice for EmuSimDevice {
    fn submit(&mut self, now: Nanos, io: SimIo) -> bool {
        use reflex_flash::emu::{EmuOpKind, EmuRequest};
        let kind = match io.kind {
            IoKind::Read => EmuOpKind::Read,
            IoKind::Write => EmuOpKind::Write,
        };
        let request = EmuRequest {
            tag: io.tag,
            kind,
            offset: io.offset,
            len: io.len,
            queue: io.queue,
        };
        // The only refusal for a valid request is a full submission queue.
        self.device.submit(now, request).is_ok()
    }

    fn advance(&mut self, now: Nanos, out: &mut Vec<SimDone>) {
        self.completions.clear();
        self.device.advance(now, &mut self.completions);
        out.extend(self.completions.iter().map(|c| SimDone {
            tag: c.tag,
            completed_at: c.completed_at,
        }));
    }

    fn next_event(&self) -> Option<Nanos> {
        self.device.next_event()
    }

    fn capacity_bytes(&self) -> u64 {
        self.device.capacity_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_device_serves_in_parallel_then_queues() {
        let mut device = FixedDevice::new(2, 100, 1000, 8);
        for tag in 0..3 {
            let io = SimIo {
                tag,
                kind: IoKind::Read,
                offset: 0,
                len: 4096,
                queue: 0,
            };
            assert!(device.submit(Nanos(0), io));
        }
        let mut out = Vec::new();
        device.advance(Nanos(150), &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(device.next_event(), Some(Nanos(200)));
        device.advance(Nanos(200), &mut out);
        assert_eq!(out.iter().map(|d| d.tag).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(out[2].completed_at, Nanos(200));
    }
}
