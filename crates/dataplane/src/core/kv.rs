//! Key-value requests (`docs/KV.md`): each is a `reflex_kv::KvOp` step machine whose device
//! operations go through the namespace's QoS scheduler like any request's, charged to the
//! KV port's tenant, on the thread whose connection sent it.
//!
//! Threads: reflexd accepts KV connections on every dataplane thread, but an open table's
//! state (allocator, key count, bucket gate) is mutated by every step of every operation, so
//! exactly one thread, the table's *owner*, holds it and runs every step of every machine
//! (`poll` and `complete`, a few microseconds of CPU). A request of the owner's own
//! connections is stepped here, as on one thread; a request of another thread's connection
//! (its *home*) is `Forwarded`: its table step goes to the owner through the bounded queues
//! between threads with the address of its run, the owner steps it on that run and sends back
//! the device operation it needs next or its answer (`core/kv_owner.rs`). The device
//! operation itself, its QoS charge and the answer stay on the home thread, so the device
//! load and the tenant's tokens are spread like the connections. No lock: the table is only
//! ever touched by its owner, and a run only by the thread its request is at.
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
//! Lifecycle: decoded → payload received into the run (`Receiving`) → the machine polled
//! (here, or `Forwarded` to the owner): a device step (`Queued`, `Submitted`, and back), a
//! wait at the bucket gate (`Overlapping` here; at the owner a forwarded request just stays
//! `Forwarded`), or the answer (`Completed`). A request freed early (its connection closed)
//! abandons its machine, which leaves the gate and frees a value extent no index names; a
//! forwarded request is never freed before the owner has answered its step.

use std::collections::VecDeque;

use reflex_flash::FlashError;
use reflex_kv::layout::{BLOCK_SIZE_BYTES, Block};
use reflex_kv::{BlockIo, Buffer, Buffers, KvOp, KvTable, OpKind, Poll, Reply};
use reflex_proto::kv::{Opcode, Status, VALUE_SIZE_MAX_BYTES};
use reflex_qos::Nanos;

use super::Dataplane;
use super::kv_owner::{Guests, KvMessage, KvNext, KvRequestRef};
use super::migration::MigrationMessage;
use super::request::{RequestState, Work};
use crate::buffers::PageRun;
use crate::frontend::{Answer, IoKind, IoRequest};
use crate::steps::{IoStep, Operation};

/// Where a KV request's key ends and its value begins in its run.
pub(super) const KV_VALUE_START: usize = 2 * BLOCK_SIZE_BYTES;

const _: () = assert!(reflex_proto::kv::KEY_SIZE_MAX_BYTES <= KV_VALUE_START - BLOCK_SIZE_BYTES);
const _: () = assert!(KV_VALUE_START + VALUE_SIZE_MAX_BYTES <= crate::buffers::RUN_SIZE_MAX);

/// The table a dataplane serves KV requests from.
pub struct KvSetup {
    pub namespace_index: u16,
    /// The table's state, on its owner thread only; the other threads forward their
    /// requests' table steps to `owner_thread` (see the module doc).
    pub table: Option<KvTable>,
    pub owner_thread: u16,
}

/// A request slot's machine.
// One per request slot, allocated when the thread starts: boxing the machine would allocate
// per request instead.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum KvSlot {
    Idle,
    /// Stepped on this thread (the owner's own request), at this device operation.
    Local {
        op: KvOp,
        pending: Option<BlockIo>,
    },
    /// Stepped on the owner: its slot there (known once the owner first answered), the
    /// device operation it asked for, and whether the owner has the step (and the run) now.
    Remote {
        guest: Option<u32>,
        pending: Option<BlockIo>,
        at_owner: bool,
    },
}

/// Who waits at the owner's bucket gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waiter {
    /// One of this thread's requests.
    Local(u32),
    /// A guest slot (another thread's request).
    Guest(u32),
}

/// The open table (on the owner) and the operations in progress on it.
pub(super) struct KvEngine {
    pub(super) namespace_index: u16,
    pub(super) owner_thread: u16,
    pub(super) table: Option<KvTable>,
    /// Per request slot: its machine and the device operation it is at.
    pub(super) ops: Vec<KvSlot>,
    /// Operations waiting at the bucket gate, oldest first (owner only).
    pub(super) waiting: VecDeque<Waiter>,
    /// An operation finished since the waiting ones were last polled.
    pub(super) released: bool,
    /// Other threads' operations in progress on this thread's table (owner only).
    pub(super) guests: Guests,
}

impl KvEngine {
    pub(super) fn new(setup: KvSetup, requests_max: u32) -> KvEngine {
        KvEngine {
            namespace_index: setup.namespace_index,
            owner_thread: setup.owner_thread,
            table: setup.table,
            ops: (0..requests_max).map(|_| KvSlot::Idle).collect(),
            waiting: VecDeque::with_capacity(requests_max as usize),
            released: false,
            guests: Guests::default(),
        }
    }

    /// Keys in the table (tests and metrics; `None` on a thread that does not own it).
    pub(super) fn len(&self) -> Option<u64> {
        self.table.as_ref().map(KvTable::len)
    }
}

/// The op's view of a request's run: the bucket block, and the value area after the key.
pub(super) fn split_run(bytes: &mut [u8]) -> Buffers<'_> {
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
        // A BIND is answered at decode (`Action::KvBind`) and never becomes an I/O request.
        if !served || opcode == Opcode::Bind {
            // Not reached in reflexd (every thread with the KV listener has the table's setup).
            self.connections[connection_index as usize].skip_bytes += u64::from(io.length_bytes);
            let status = if served {
                Status::Invalid
            } else {
                Status::IoError
            };
            self.respond(index, Answer::Kv(status), None, 0);
            return true;
        }
        let value_bytes = (io.length_bytes - u32::from(key_bytes)) as usize;
        let value_area = match opcode {
            Opcode::Get => VALUE_SIZE_MAX_BYTES,
            Opcode::Put => value_bytes.next_multiple_of(BLOCK_SIZE_BYTES),
            Opcode::Delete | Opcode::Flush | Opcode::Bind => 0,
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

    /// The payload is in the run: the machine is made and polled for its first step, here
    /// or on the table's owner.
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
            Opcode::Bind => {
                // Refused in `start_kv`; never stepped.
                self.respond(index, Answer::Kv(Status::Invalid), Some(run), 0);
                return;
            }
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
        let kv = self.kv_engine();
        assert!(
            matches!(kv.ops[index as usize], KvSlot::Idle),
            "a KV slot in use"
        );
        if kv.table.is_some() {
            kv.ops[index as usize] = KvSlot::Local { op, pending: None };
            self.kv_advance(index, now);
            return;
        }
        // The machine is made again on the owner, from the run (the key is there).
        drop(op);
        let owner = kv.owner_thread;
        kv.ops[index as usize] = KvSlot::Remote {
            guest: None,
            pending: None,
            at_owner: true,
        };
        self.transition(index, RequestState::Forwarded);
        self.stats.kv_forwarded += 1;
        let request = KvRequestRef {
            index,
            generation: self.requests[index as usize].generation,
        };
        let lent = self.arena.lend(run);
        self.migration.outbox.push_back((
            owner,
            MigrationMessage::Kv(KvMessage::Begin {
                request,
                kind,
                key_bytes,
                run: lent,
            }),
        ));
    }

    /// Polls a local request's machine: its next device step enters the scheduler, a wait at
    /// the gate parks it, an answer goes out.
    fn kv_advance(&mut self, index: u32, now: Nanos) {
        let Some(run) = self.requests[index as usize].work.run() else {
            panic!("a KV request without its run");
        };
        let poll = {
            let Some(kv) = self.kv.as_mut() else {
                panic!("a KV request on a thread without the table");
            };
            let Some(table) = kv.table.as_mut() else {
                panic!("stepping a KV request on a thread without the table");
            };
            let KvSlot::Local { op, pending } = &mut kv.ops[index as usize] else {
                panic!("advancing KV slot {index} without a local operation");
            };
            assert!(
                pending.is_none(),
                "polled with a device operation in flight"
            );
            op.poll(table, split_run(self.arena.run_mut(run, run.size_bytes())))
        };
        match poll {
            Poll::Io(io) => {
                if let KvSlot::Local { pending, .. } = &mut self.kv_engine().ops[index as usize] {
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
                self.kv_engine().waiting.push_back(Waiter::Local(index));
            }
            Poll::Done(result) => {
                let kv = self.kv_engine();
                kv.ops[index as usize] = KvSlot::Idle;
                kv.released = true;
                self.kv_answer(index, run, result);
            }
        }
    }

    pub(super) fn kv_engine(&mut self) -> &mut KvEngine {
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

    /// Home: the owner stepped forwarded request `request` (its guest slot `guest`): the
    /// device operation it needs next enters this thread's scheduler, or the answer goes out.
    pub(super) fn kv_next(&mut self, request: KvRequestRef, guest: u32, next: KvNext, now: Nanos) {
        let index = request.index;
        assert_eq!(
            self.requests[index as usize].generation, request.generation,
            "a KV step answer for a reused request"
        );
        let state = self.requests[index as usize].state;
        assert!(
            matches!(state, RequestState::Forwarded | RequestState::Orphaned),
            "a KV step answer for a request that is not forwarded ({state:?})"
        );
        let Some(run) = self.requests[index as usize].work.run() else {
            panic!("a forwarded KV request without its run");
        };
        let connection_index = self.requests[index as usize].connection_index;
        // Orphaned at shutdown while the owner had it: its connection let it go already.
        let orphaned = state == RequestState::Orphaned;
        let open = !orphaned && self.connections[connection_index as usize].is_open();
        if orphaned {
            assert!(self.kv_orphaned_at_owner > 0);
            self.kv_orphaned_at_owner -= 1;
        }
        let kv = self.kv_engine();
        let KvSlot::Remote {
            guest: known,
            at_owner,
            ..
        } = &mut kv.ops[index as usize]
        else {
            panic!("a KV step answer for slot {index}, which is not forwarded");
        };
        assert!(
            *at_owner,
            "a KV step answer for a request the owner does not have"
        );
        assert!(known.is_none_or(|known| known == guest), "guest slot moved");
        *known = Some(guest);
        *at_owner = false;
        match next {
            KvNext::Io(io) if open => {
                if let KvSlot::Remote { pending, .. } = &mut kv.ops[index as usize] {
                    *pending = Some(io);
                }
                self.requests[index as usize].operation = operation(io);
                self.enqueue(index, now);
            }
            KvNext::Io(_) => {
                // Its connection closed: the owner's machine, which waits for this device
                // operation and uses the run no more, is abandoned.
                kv.ops[index as usize] = KvSlot::Idle;
                let owner = kv.owner_thread;
                self.migration.outbox.push_back((
                    owner,
                    MigrationMessage::Kv(KvMessage::Abandon { request, guest }),
                ));
                self.free_request(index);
                if !orphaned {
                    self.maybe_finish_close(connection_index);
                }
            }
            KvNext::Done(result) => {
                kv.ops[index as usize] = KvSlot::Idle;
                if open {
                    self.kv_answer(index, run, result);
                } else {
                    self.free_request(index);
                    if !orphaned {
                        self.maybe_finish_close(connection_index);
                    }
                }
            }
        }
    }

    /// The device operation of the request's current KV step.
    pub(super) fn kv_operation(&self, index: u32) -> Operation {
        let pending = self
            .kv
            .as_ref()
            .and_then(|kv| match &kv.ops[index as usize] {
                KvSlot::Local { pending, .. } | KvSlot::Remote { pending, .. } => *pending,
                KvSlot::Idle => None,
            });
        match pending {
            Some(io) => operation(io),
            None => panic!("KV slot {index} has no device operation"),
        }
    }

    /// A KV step's device operation finished: its machine is given the result, here or on
    /// the owner.
    pub(super) fn kv_complete(&mut self, index: u32, result: Result<u32, FlashError>, now: Nanos) {
        let Some(run) = self.requests[index as usize].work.run() else {
            panic!("a KV completion without its run");
        };
        let connection_index = self.requests[index as usize].connection_index;
        let namespace_index = self.requests[index as usize].io().namespace_index;
        let (io, guest) = match &mut self.kv_engine().ops[index as usize] {
            KvSlot::Local { pending, .. } => (pending.take(), None),
            KvSlot::Remote {
                pending,
                guest,
                at_owner,
            } => {
                assert!(!*at_owner, "a device completion for a step the owner has");
                *at_owner = guest.is_some();
                (pending.take(), *guest)
            }
            KvSlot::Idle => panic!("a KV completion for slot {index} without an operation"),
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
        if let Some(guest) = guest {
            // The owner learns the result even if the connection closed: the machine's
            // allocator bookkeeping depends on it. Its answer comes back through `kv_next`.
            let owner = self.kv_engine().owner_thread;
            self.transition(index, RequestState::Forwarded);
            let request = KvRequestRef {
                index,
                generation: self.requests[index as usize].generation,
            };
            self.migration.outbox.push_back((
                owner,
                MigrationMessage::Kv(KvMessage::Complete {
                    request,
                    guest,
                    result,
                }),
            ));
            return;
        }
        let Some(kv) = self.kv.as_mut() else {
            panic!("a KV completion on a thread without the table");
        };
        let Some(table) = kv.table.as_mut() else {
            panic!("a local KV completion on a thread without the table");
        };
        if let KvSlot::Local { op, .. } = &mut kv.ops[index as usize] {
            op.complete(
                table,
                split_run(self.arena.run_mut(run, run.size_bytes())),
                result,
            );
        }
        if !self.connections[connection_index as usize].is_open() {
            self.free_request(index);
            self.maybe_finish_close(connection_index);
            return;
        }
        self.kv_advance(index, now);
    }

    /// The request will not go on: its machine (if any) leaves the gate and gives back what
    /// no index names (on the owner, for a forwarded one). Called when a KV request is
    /// answered early or freed; never while it is `Forwarded` (the owner is using its run).
    /// Inlined: a thread without a key-value table pays one comparison.
    #[inline]
    pub(super) fn kv_forget(&mut self, index: u32) {
        if self.kv.is_some() {
            self.kv_forget_slot(index);
        }
    }

    /// [`Self::kv_forget`] on a thread that serves a key-value table.
    fn kv_forget_slot(&mut self, index: u32) {
        let state = self.requests[index as usize].state;
        let generation = self.requests[index as usize].generation;
        let Some(kv) = self.kv.as_mut() else {
            return;
        };
        match std::mem::replace(&mut kv.ops[index as usize], KvSlot::Idle) {
            KvSlot::Idle => {}
            KvSlot::Local { op, .. } => {
                if let Some(table) = kv.table.as_mut() {
                    op.abandon(table);
                }
                kv.released = true;
            }
            KvSlot::Remote {
                guest, at_owner, ..
            } => {
                assert!(
                    !at_owner,
                    "forgetting a KV request its owner is stepping ({state:?})"
                );
                let Some(guest) = guest else {
                    panic!("a forwarded KV request the owner never answered");
                };
                let owner = kv.owner_thread;
                self.migration.outbox.push_back((
                    owner,
                    MigrationMessage::Kv(KvMessage::Abandon {
                        request: KvRequestRef { index, generation },
                        guest,
                    }),
                ));
            }
        }
    }

    /// Whether KV requests wait at the gate and one finished since they were last polled.
    pub(super) fn kv_retry_ready(&self) -> bool {
        self.kv
            .as_ref()
            .is_some_and(|kv| kv.released && !kv.waiting.is_empty())
    }

    /// The operations waiting at the bucket gate are polled again, oldest first.
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
            let Some(waiter) = self.kv.as_mut().and_then(|kv| kv.waiting.pop_front()) else {
                break;
            };
            let index = match waiter {
                Waiter::Local(index) => index,
                Waiter::Guest(slot) => {
                    self.guest_advance(slot);
                    continue;
                }
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

    /// Takes the oldest of this thread's requests waiting at the bucket gate out of the
    /// queue (a shutdown refuses it). Other threads' operations stay: they finish, as their
    /// homes' shutdowns wait for them.
    pub(super) fn take_kv_waiter(&mut self) -> Option<u32> {
        let kv = self.kv.as_mut()?;
        let position = kv
            .waiting
            .iter()
            .position(|waiter| matches!(waiter, Waiter::Local(_)))?;
        let Some(Waiter::Local(index)) = kv.waiting.remove(position) else {
            panic!("the waiter found is not local");
        };
        assert_eq!(
            self.requests[index as usize].state,
            RequestState::Overlapping
        );
        Some(index)
    }

    /// Keys in this thread's table (`None`: it does not own it).
    pub fn kv_len(&self) -> Option<u64> {
        self.kv.as_ref().and_then(KvEngine::len)
    }
}
