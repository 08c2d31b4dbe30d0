//! Key-value requests (`docs/KV.md`): each is a `reflex_kv::KvOp` step machine whose device
//! operations go through the namespace's QoS scheduler like any request's, charged to the
//! KV port's tenant.
//!
//! Why the table lives on one thread: an open table's state (allocator, key count, bucket
//! gate) is shared by every operation, and each step mutates it. reflexd binds the KV port on
//! dataplane thread 0 only, so every KV connection lands there and the table needs no lock;
//! the other threads serve the block protocols on the same namespace. A thread without the
//! table answers KV requests `IO_ERROR` (not reached in reflexd). Spreading KV connections
//! over threads would need the table behind a lock (its gate already orders operations).
//!
//! A request's run holds everything it needs, so nothing is allocated per request:
//!
//! ```text
//! 0 .. 4096            the bucket block being read or written
//! 8192 - key .. 8192   the key (received with the value, as one payload)
//! 8192 ..              the value: a PUT's, received from the client, or a GET's, read
//!                      from the device and sent from here (64 KiB for a GET)
//! ```
//!
//! Lifecycle: decoded → payload received into the run (`Receiving`) → the machine polled: a
//! device step (`Queued`, `Submitted`, and back), a wait at the bucket gate (`Overlapping`,
//! polled again when another KV operation finishes), or the answer (`Completed`). A request
//! freed early (its connection closed) abandons its machine, which leaves the gate and frees
//! a value extent no index names.

use std::collections::VecDeque;

use reflex_flash::FlashError;
use reflex_kv::layout::{BLOCK_SIZE_BYTES, Block};
use reflex_kv::{BlockIo, Buffer, Buffers, KvOp, KvTable, OpKind, Poll, Reply};
use reflex_proto::kv::{Opcode, Status, VALUE_SIZE_MAX_BYTES};
use reflex_qos::Nanos;

use super::Dataplane;
use super::request::{RequestState, Work};
use crate::buffers::PageRun;
use crate::frontend::{Answer, IoKind, IoRequest};
use crate::memory::Arena;
use crate::steps::{IoStep, Operation};

/// Where a KV request's key ends and its value begins in its run.
pub(super) const KV_VALUE_START: usize = 2 * BLOCK_SIZE_BYTES;

const _: () = assert!(reflex_proto::kv::KEY_SIZE_MAX_BYTES <= KV_VALUE_START - BLOCK_SIZE_BYTES);
const _: () = assert!(KV_VALUE_START + VALUE_SIZE_MAX_BYTES <= crate::buffers::RUN_SIZE_MAX);

/// The table a dataplane serves KV requests from.
pub struct KvSetup {
    pub namespace_index: u16,
    pub table: KvTable,
}

/// The open table and the operations in progress on it.
pub(super) struct KvEngine {
    namespace_index: u16,
    table: KvTable,
    /// Per request slot: its machine and the device operation it is at.
    ops: Vec<Option<(KvOp, Option<BlockIo>)>>,
    /// Requests waiting at the bucket gate, oldest first.
    waiting: VecDeque<u32>,
    /// An operation finished since the waiting ones were last polled.
    released: bool,
}

impl KvEngine {
    pub(super) fn new(setup: KvSetup, requests_max: u32) -> KvEngine {
        KvEngine {
            namespace_index: setup.namespace_index,
            table: setup.table,
            ops: (0..requests_max).map(|_| None).collect(),
            waiting: VecDeque::with_capacity(requests_max as usize),
            released: false,
        }
    }

    /// Keys in the table (tests and metrics).
    pub(super) fn len(&self) -> u64 {
        self.table.len()
    }
}

/// The op's view of the request's run.
fn buffers(arena: &mut Arena, run: PageRun) -> Buffers<'_> {
    let bytes = arena.run_mut(run, run.size_bytes());
    let (head, value) = bytes.split_at_mut(KV_VALUE_START);
    let bucket: &mut Block = match (&mut head[..BLOCK_SIZE_BYTES]).try_into() {
        Ok(block) => block,
        Err(_) => panic!("a KV run without its bucket block"),
    };
    Buffers { bucket, value }
}

/// Where in the run a device operation of the machine reads or writes.
fn buffer_start(buffer: Buffer) -> u32 {
    match buffer {
        Buffer::Bucket => 0,
        Buffer::Value => KV_VALUE_START as u32,
    }
}

/// The device operation of a machine's block I/O (byte offsets in the namespace).
fn operation(io: BlockIo) -> Operation {
    let block = BLOCK_SIZE_BYTES as u64;
    match io {
        BlockIo::Read {
            block_index, into, ..
        } => Operation::Read {
            offset_bytes: block_index * block,
            length_bytes: io.length_bytes() as u32,
            buffer_start: buffer_start(into),
        },
        BlockIo::Write {
            block_index,
            from,
            fua,
            ..
        } => Operation::Write {
            offset_bytes: block_index * block,
            length_bytes: io.length_bytes() as u32,
            buffer_start: buffer_start(from),
            fua,
        },
        BlockIo::Flush => Operation::Flush,
    }
}

impl Dataplane {
    /// Starts a KV request: its run, then its payload (key and value) or its first step.
    /// False when it must wait for a run.
    pub(super) fn start_kv(&mut self, index: u32, io: IoRequest, now: Nanos) -> bool {
        let IoKind::Kv { opcode, key_bytes } = io.kind else {
            panic!("start_kv for {:?}", io.kind);
        };
        let connection_index = self.requests[index as usize].connection_index;
        let served = self
            .kv
            .as_ref()
            .is_some_and(|kv| kv.namespace_index == io.namespace_index);
        if !served {
            // Not reached in reflexd (the KV port is only on the table's thread).
            self.connections[connection_index as usize].skip_bytes += u64::from(io.length_bytes);
            self.respond(index, Answer::Kv(Status::IoError), None, 0);
            return true;
        }
        let value_bytes = (io.length_bytes - u32::from(key_bytes)) as usize;
        let value_area = match opcode {
            Opcode::Get => VALUE_SIZE_MAX_BYTES,
            Opcode::Put => value_bytes.next_multiple_of(BLOCK_SIZE_BYTES),
            Opcode::Delete | Opcode::Flush => 0,
        };
        let Some(run) = self.allocate_run(connection_index, KV_VALUE_START + value_area) else {
            return false;
        };
        self.requests[index as usize].work = Work::Io {
            io,
            run: Some(run),
            step: IoStep::Primary,
            received_bytes: 0,
        };
        if io.length_bytes > 0 {
            self.take_payload(index, now);
        } else {
            self.kv_begin(index, now);
        }
        true
    }

    /// Where a KV request's payload goes in its run: `(first byte, bytes)`.
    pub(super) fn kv_payload_span(io: IoRequest) -> (u32, u32) {
        let IoKind::Kv { key_bytes, .. } = io.kind else {
            panic!("a KV payload for {:?}", io.kind);
        };
        (
            KV_VALUE_START as u32 - u32::from(key_bytes),
            io.length_bytes,
        )
    }

    /// The payload is in the run: the machine is made and polled for its first step.
    pub(super) fn kv_begin(&mut self, index: u32, now: Nanos) {
        let Work::Io {
            io, run: Some(run), ..
        } = self.requests[index as usize].work
        else {
            panic!("a KV request without its run");
        };
        let IoKind::Kv { opcode, key_bytes } = io.kind else {
            panic!("kv_begin for {:?}", io.kind);
        };
        let kind = match opcode {
            Opcode::Put => OpKind::Put {
                value_length_bytes: io.length_bytes - u32::from(key_bytes),
            },
            Opcode::Get => OpKind::Get,
            Opcode::Delete => OpKind::Delete,
            Opcode::Flush => OpKind::Flush,
        };
        let key_start = KV_VALUE_START - usize::from(key_bytes);
        let key = &self.arena.run(run, KV_VALUE_START)[key_start..];
        let op = match KvOp::new(kind, key) {
            Ok(op) => op,
            Err(error) => {
                // Validated at decode; the table's own check agrees.
                self.respond(index, Answer::Kv(error.status()), Some(run), 0);
                return;
            }
        };
        let Some(kv) = self.kv.as_mut() else {
            panic!("a KV request began on a thread without the table");
        };
        assert!(kv.ops[index as usize].is_none(), "a KV slot in use");
        kv.ops[index as usize] = Some((op, None));
        self.kv_advance(index, now);
    }

    /// Polls the request's machine: its next device step enters the scheduler, a wait at the
    /// gate parks it, an answer goes out.
    fn kv_advance(&mut self, index: u32, now: Nanos) {
        let Some(run) = self.requests[index as usize].work.run() else {
            panic!("a KV request without its run");
        };
        let poll = {
            let Some(kv) = self.kv.as_mut() else {
                panic!("a KV request on a thread without the table");
            };
            let Some((op, pending)) = kv.ops[index as usize].as_mut() else {
                panic!("advancing KV slot {index} without an operation");
            };
            assert!(
                pending.is_none(),
                "polled with a device operation in flight"
            );
            op.poll(&mut kv.table, buffers(&mut self.arena, run))
        };
        match poll {
            Poll::Io(io) => {
                if let Some((_, pending)) = self.kv_engine().ops[index as usize].as_mut() {
                    *pending = Some(io);
                }
                self.requests[index as usize].operation = operation(io);
                self.enqueue(index, now);
            }
            Poll::Wait => {
                if self.requests[index as usize].state != RequestState::Overlapping {
                    self.transition(index, RequestState::Overlapping);
                    self.stats.gate_waits += 1;
                }
                self.kv_engine().waiting.push_back(index);
            }
            Poll::Done(result) => {
                let kv = self.kv_engine();
                kv.ops[index as usize] = None;
                kv.released = true;
                self.kv_answer(index, run, result);
            }
        }
    }

    fn kv_engine(&mut self) -> &mut KvEngine {
        match self.kv.as_mut() {
            Some(kv) => kv,
            None => panic!("a KV request on a thread without the table"),
        }
    }

    fn kv_answer(&mut self, index: u32, run: PageRun, result: Result<Reply, reflex_kv::KvError>) {
        match result {
            Ok(Reply::Value { length_bytes }) => {
                self.respond_from(
                    index,
                    Answer::Ok,
                    Some(run),
                    KV_VALUE_START as u32,
                    length_bytes,
                );
            }
            Ok(reply) => {
                let answer = match reply.status() {
                    Status::Ok => Answer::Ok,
                    status => Answer::Kv(status),
                };
                self.respond(index, answer, Some(run), 0);
            }
            Err(error) => {
                if error.status() == Status::IoError {
                    let namespace_index = self.requests[index as usize].io().namespace_index;
                    self.device_errors.record(
                        namespace_index,
                        &format!("key-value table: {error}"),
                        self.last_now,
                    );
                }
                self.respond(index, Answer::Kv(error.status()), Some(run), 0);
            }
        }
    }

    /// The device operation of the request's current KV step.
    pub(super) fn kv_operation(&self, index: u32) -> Operation {
        let pending = self
            .kv
            .as_ref()
            .and_then(|kv| kv.ops[index as usize].as_ref())
            .and_then(|(_, pending)| *pending);
        match pending {
            Some(io) => operation(io),
            None => panic!("KV slot {index} has no device operation"),
        }
    }

    /// A KV step's device operation finished.
    pub(super) fn kv_complete(&mut self, index: u32, result: Result<u32, FlashError>, now: Nanos) {
        let Some(run) = self.requests[index as usize].work.run() else {
            panic!("a KV completion without its run");
        };
        let connection_index = self.requests[index as usize].connection_index;
        let namespace_index = self.requests[index as usize].io().namespace_index;
        let io = match self.kv_engine().ops[index as usize].as_mut() {
            Some((_, pending)) => pending.take(),
            None => panic!("a KV completion for slot {index} without an operation"),
        };
        let Some(io) = io else {
            panic!("a KV completion without a device operation");
        };
        let result = match result {
            Ok(bytes) if bytes as usize == io.length_bytes() || io == BlockIo::Flush => Ok(()),
            Ok(_) => Err(FlashError::Io { errno: libc::EIO }),
            Err(error) => Err(error),
        };
        if let Err(error) = &result {
            self.stats.io_errors += 1;
            self.device_errors
                .record(namespace_index, &error.to_string(), now);
        }
        let Some(kv) = self.kv.as_mut() else {
            panic!("a KV completion on a thread without the table");
        };
        if let Some((op, _)) = kv.ops[index as usize].as_mut() {
            op.complete(&mut kv.table, buffers(&mut self.arena, run), result);
        }
        if !self.connections[connection_index as usize].is_open() {
            self.free_request(index);
            self.maybe_finish_close(connection_index);
            return;
        }
        self.kv_advance(index, now);
    }

    /// The request will not go on: its machine (if any) leaves the gate and gives back what
    /// no index names. Called when a KV request is answered early or freed.
    pub(super) fn kv_forget(&mut self, index: u32) {
        let Some(kv) = self.kv.as_mut() else {
            return;
        };
        if let Some((op, _)) = kv.ops[index as usize].take() {
            op.abandon(&mut kv.table);
            kv.released = true;
        }
    }

    /// Whether KV requests wait at the gate and one finished since they were last polled.
    pub(super) fn kv_retry_ready(&self) -> bool {
        self.kv
            .as_ref()
            .is_some_and(|kv| kv.released && !kv.waiting.is_empty())
    }

    /// The requests waiting at the bucket gate are polled again, oldest first.
    pub(super) fn kv_retry(&mut self, now: Nanos) {
        let Some(kv) = self.kv.as_mut() else {
            return;
        };
        if !kv.released {
            return;
        }
        kv.released = false;
        let waiting_count = kv.waiting.len();
        for _ in 0..waiting_count {
            let Some(index) = self.kv.as_mut().and_then(|kv| kv.waiting.pop_front()) else {
                break;
            };
            assert_eq!(
                self.requests[index as usize].state,
                RequestState::Overlapping
            );
            let connection_index = self.requests[index as usize].connection_index;
            if !self.connections[connection_index as usize].is_open() {
                self.free_request(index);
                self.maybe_finish_close(connection_index);
                continue;
            }
            self.kv_advance(index, now);
        }
    }

    /// Takes the oldest request waiting at the bucket gate out of the queue (a shutdown
    /// refuses it).
    pub(super) fn take_kv_waiter(&mut self) -> Option<u32> {
        let index = self.kv.as_mut()?.waiting.pop_front()?;
        assert_eq!(
            self.requests[index as usize].state,
            RequestState::Overlapping
        );
        Some(index)
    }

    /// Keys in this thread's table (`None`: it has none).
    pub fn kv_len(&self) -> Option<u64> {
        self.kv.as_ref().map(KvEngine::len)
    }
}
