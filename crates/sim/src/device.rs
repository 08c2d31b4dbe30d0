//! The devices of the simulated server: timing models behind a small virtual-time trait
//! ([`SimDevice`]: a deterministic fixed-latency model, and the emulated Flash device
//! `reflex_flash::emu::EmuDevice`), and [`ModelFlash`], which puts any model behind the
//! `reflex_flash::Device` contract that the real dataplane's driver uses.
//!
//! Why models keep no data: a simulation measures time; the bytes of a READ are whatever its
//! buffer held (the dataplane answers with them) and a WRITE's bytes are dropped, so a long
//! run costs no memory for data. Integrity is tested on the real server.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use reflex_flash::{
    Completion, Device, DeviceInfo, DeviceOp, DeviceQueue, FlashError, OpKind, Submit,
};
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

pub trait SimDevice: Send {
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

/// A timing model as a `reflex_flash::Device`: every dataplane thread's queue submits to the
/// one model (interference is device-wide) and each completion goes back to the queue that
/// submitted it.
pub struct ModelFlash {
    info: DeviceInfo,
    shared: Arc<Mutex<ModelShared>>,
}

struct ModelShared {
    model: Box<dyn SimDevice>,
    /// By model tag: (queue index, user_data, bytes the operation moves); `None` when free.
    owners: Vec<Option<(u32, u64, u32)>>,
    free_tags: Vec<u64>,
    /// Completions found by one queue's poll for another queue, until that one polls.
    outboxes: Vec<Vec<Completion>>,
    scratch: Vec<SimDone>,
}

impl ModelFlash {
    pub fn new(model: Box<dyn SimDevice>, description: &str) -> ModelFlash {
        let size_bytes = model.capacity_bytes();
        ModelFlash {
            info: DeviceInfo {
                size_bytes,
                block_size: 512,
                read_only: false,
                supports_trim: true,
                description: format!("{description} (simulated, no data)"),
            },
            shared: Arc::new(Mutex::new(ModelShared {
                model,
                owners: Vec::new(),
                free_tags: Vec::new(),
                outboxes: Vec::new(),
                scratch: Vec::new(),
            })),
        }
    }
}

fn lock(shared: &Mutex<ModelShared>) -> MutexGuard<'_, ModelShared> {
    shared
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Device for ModelFlash {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn queue(&self) -> Box<dyn DeviceQueue> {
        let mut shared = lock(&self.shared);
        let queue_index = shared.outboxes.len() as u32;
        shared.outboxes.push(Vec::new());
        Box::new(ModelQueue {
            shared: Arc::clone(&self.shared),
            queue_index,
        })
    }
}

struct ModelQueue {
    shared: Arc<Mutex<ModelShared>>,
    queue_index: u32,
}

impl DeviceQueue for ModelQueue {
    fn submit(&mut self, op: DeviceOp<'_>, now: Nanos) -> Submit {
        let (kind, offset, len, moved) = match &op.kind {
            OpKind::Read { offset, buf } => {
                (IoKind::Read, *offset, buf.len() as u32, buf.len() as u32)
            }
            OpKind::Write { offset, buf, .. } => {
                (IoKind::Write, *offset, buf.len() as u32, buf.len() as u32)
            }
            // Flushes and trims cost the model one small write.
            OpKind::Flush => (IoKind::Write, 0, 4096, 0),
            OpKind::Trim { offset, .. } => (IoKind::Write, *offset, 4096, 0),
        };
        let mut guard = lock(&self.shared);
        let shared = &mut *guard;
        let tag = match shared.free_tags.pop() {
            Some(tag) => tag,
            None => {
                shared.owners.push(None);
                shared.owners.len() as u64 - 1
            }
        };
        let io = SimIo {
            tag,
            kind,
            offset,
            len,
            queue: op.queue,
        };
        if !shared.model.submit(now, io) {
            shared.free_tags.push(tag);
            return Submit::Done(Err(FlashError::Io {
                errno: libc::EAGAIN,
            }));
        }
        shared.owners[tag as usize] = Some((self.queue_index, op.user_data, moved));
        Submit::Pending
    }

    fn poll_completions(&mut self, now: Nanos, out: &mut Vec<Completion>) {
        let mut guard = lock(&self.shared);
        let shared = &mut *guard;
        out.append(&mut shared.outboxes[self.queue_index as usize]);
        let mut scratch = std::mem::take(&mut shared.scratch);
        shared.model.advance(now, &mut scratch);
        for done in scratch.drain(..) {
            let Some((queue_index, user_data, moved)) = shared.owners[done.tag as usize].take()
            else {
                panic!("the model completed unknown tag {}", done.tag);
            };
            shared.free_tags.push(done.tag);
            let completion = Completion {
                user_data,
                result: Ok(moved),
            };
            if queue_index == self.queue_index {
                out.push(completion);
            } else {
                shared.outboxes[queue_index as usize].push(completion);
            }
        }
        shared.scratch = scratch;
    }

    fn next_deadline(&self) -> Option<Nanos> {
        let shared = lock(&self.shared);
        if !shared.outboxes[self.queue_index as usize].is_empty() {
            return Some(Nanos::ZERO);
        }
        shared.model.next_event()
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
