//! The table owner's side of key-value requests from other threads (`core/kv.rs` says why
//! one thread owns the table): the messages between a request's home thread and the owner,
//! and the owner's *guest* slots, one per forwarded operation in progress.
//!
//! # The exchange
//! 1. Home: a KV request's payload is in its run; the request becomes `Forwarded` and
//!    [`KvMessage::Begin`] goes to the owner with the run's address ([`LentRun`]).
//! 2. Owner: takes a guest slot, makes the machine from the key in the run and polls it on
//!    the run. A wait at the bucket gate keeps it here (polled again when another operation
//!    of the table finishes, like a local one); otherwise [`KvMessage::Next`] goes home with
//!    the device operation the machine needs or its answer.
//! 3. Home: submits the device operation through its own scheduler (its tenant, its device
//!    queue); when it completes, the request is `Forwarded` again and
//!    [`KvMessage::Complete`] takes the result to the owner, which gives it to the machine
//!    and polls it (back to 2). On the answer the guest slot is freed and the home answers.
//! 4. A home whose connection closed (or that shuts down) between two steps sends
//!    [`KvMessage::Abandon`]: the machine leaves the gate and frees what no index names.
//!
//! # Rules
//! - The run belongs to the home's arena throughout. The owner touches it only while it
//!   handles a `Begin` or `Complete` or re-polls a waiting guest, that is while the home's
//!   request is `Forwarded`; the home does not touch or free a `Forwarded` request's run.
//! - Exactly one message per step in each direction: every `Begin` and `Complete` gets one
//!   `Next` (possibly after a wait at the gate); an `Abandon` gets none. A home has at most
//!   one message in flight per request, so a queue between two threads never holds more than
//!   both threads' request slots; a full queue leaves messages in the sender's outbox, in
//!   order (back-pressure, never loss).
//! - Order: a home's messages to the owner arrive in the order they were sent, so operations
//!   of one connection reach the gate in the order their payloads arrived, as on one thread.
//! - The owner needs no device for a guest, so a finished owner (shutting down, lingering
//!   until every thread finished) keeps stepping guests until their homes are done.

use reflex_flash::FlashError;
use reflex_kv::{BlockIo, KvError, KvOp, OpKind, Poll, Reply};

use super::Dataplane;
use super::kv::{KV_VALUE_START, Waiter, split_run};
use super::migration::MigrationMessage;
use crate::memory::LentRun;

/// A request of the home thread: its slot and that slot's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRequestRef {
    pub index: u32,
    pub generation: u32,
}

/// What the owner's machine needs next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvNext {
    /// This device operation, on the request's run.
    Io(BlockIo),
    /// The answer (a GET's value is in the run's value area).
    Done(Result<Reply, KvError>),
}

/// A message between a KV request's home thread and the table's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvMessage {
    /// Home → owner: a new operation; its key ends at `KV_VALUE_START` of the run.
    Begin {
        request: KvRequestRef,
        kind: OpKind,
        key_bytes: u8,
        run: LentRun,
    },
    /// Home → owner: the device operation of the last `Next` finished.
    Complete {
        request: KvRequestRef,
        guest: u32,
        result: Result<(), FlashError>,
    },
    /// Home → owner: the operation will not go on (no device operation of it in flight).
    Abandon { request: KvRequestRef, guest: u32 },
    /// Owner → home: the operation's next step.
    Next {
        request: KvRequestRef,
        guest: u32,
        next: KvNext,
    },
}

#[derive(Debug)]
struct Guest {
    home: u16,
    request: KvRequestRef,
    op: KvOp,
    run: LentRun,
    /// Counted in `gate_waits` already.
    waited: bool,
}

/// The owner's guest slots (grown on demand, bounded by the other threads' request slots:
/// each of their requests has at most one operation here).
#[derive(Debug, Default)]
pub(super) struct Guests {
    slots: Vec<Option<Guest>>,
    free: Vec<u32>,
    in_use: u32,
}

impl Guests {
    fn insert(&mut self, guest: Guest) -> u32 {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        assert!(self.slots[slot as usize].is_none(), "a guest slot in use");
        self.slots[slot as usize] = Some(guest);
        self.in_use += 1;
        slot
    }

    /// The guest in `slot`, checked against the request the home names.
    fn get_mut(&mut self, slot: u32, home: u16, request: KvRequestRef) -> &mut Guest {
        let Some(Some(guest)) = self.slots.get_mut(slot as usize) else {
            panic!("KV guest slot {slot} is free");
        };
        assert_eq!(guest.home, home, "a KV step from another home");
        assert_eq!(guest.request, request, "a KV step for another request");
        guest
    }

    fn remove(&mut self, slot: u32) -> Guest {
        let Some(guest) = self.slots.get_mut(slot as usize).and_then(Option::take) else {
            panic!("KV guest slot {slot} is free");
        };
        self.free.push(slot);
        assert!(self.in_use > 0);
        self.in_use -= 1;
        guest
    }

    /// Operations of other threads in progress here.
    pub(super) fn in_use(&self) -> u32 {
        self.in_use
    }
}

/// The run of a guest, as the machine sees it.
///
/// Only [`Dataplane::guest_advance`] and the `Complete` handler call this, while the home's
/// request is `Forwarded` to this thread (the module's rules), and the slice does not outlive
/// that call.
#[allow(unsafe_code)]
fn guest_run<'a>(run: LentRun) -> &'a mut [u8] {
    // SAFETY: the home made `run` with `Arena::lend` for a request it keeps `Forwarded` until
    // this thread sends its `Next`, which happens after the slice's last use; the home's
    // arena outlives every thread's use (threads are joined before any dataplane is dropped,
    // and a dataplane with a forwarded request is not finished).
    unsafe { run.bytes_mut() }
}

impl Dataplane {
    /// A KV message from thread `from`.
    pub(super) fn handle_kv_message(
        &mut self,
        from: u16,
        message: KvMessage,
        now: reflex_qos::Nanos,
    ) {
        match message {
            KvMessage::Begin {
                request,
                kind,
                key_bytes,
                run,
            } => self.guest_begin(from, request, kind, key_bytes, run),
            KvMessage::Complete {
                request,
                guest,
                result,
            } => {
                let Some(kv) = self.kv.as_mut() else {
                    panic!("a KV completion on a thread without the table");
                };
                let Some(table) = kv.table.as_mut() else {
                    panic!("a KV completion on a thread that does not own the table");
                };
                let entry = kv.guests.get_mut(guest, from, request);
                entry
                    .op
                    .complete(table, split_run(guest_run(entry.run)), result);
                self.guest_advance(guest);
            }
            KvMessage::Abandon { request, guest } => {
                let Some(kv) = self.kv.as_mut() else {
                    panic!("a KV abandon on a thread without the table");
                };
                let Some(table) = kv.table.as_mut() else {
                    panic!("a KV abandon on a thread that does not own the table");
                };
                kv.guests.get_mut(guest, from, request);
                let entry = kv.guests.remove(guest);
                entry.op.abandon(table);
                kv.released = true;
            }
            KvMessage::Next {
                request,
                guest,
                next,
            } => self.kv_next(request, guest, next, now),
        }
        // A finished owner runs no `process`: what waits at the gate is polled here.
        if self.kv_retry_ready() {
            self.kv_retry(now);
        }
    }

    /// Owner: another thread's operation arrives; its machine is made from the run's key.
    fn guest_begin(
        &mut self,
        home: u16,
        request: KvRequestRef,
        kind: OpKind,
        key_bytes: u8,
        run: LentRun,
    ) {
        let owns = self.kv.as_ref().is_some_and(|kv| kv.table.is_some());
        assert!(
            owns,
            "a KV operation forwarded to thread {}, which does not own the table",
            self.thread_index
        );
        assert!(
            run.size_bytes() >= KV_VALUE_START,
            "a lent KV run too small"
        );
        let bytes = guest_run(run);
        let key = &bytes[KV_VALUE_START - usize::from(key_bytes)..KV_VALUE_START];
        let op = match KvOp::new(kind, key) {
            Ok(op) => op,
            Err(error) => {
                // The home made the same check; answered without a slot.
                self.stats.kv_guests += 1;
                self.migration.outbox.push_back((
                    home,
                    MigrationMessage::Kv(KvMessage::Next {
                        request,
                        guest: u32::MAX,
                        next: KvNext::Done(Err(error)),
                    }),
                ));
                return;
            }
        };
        self.stats.kv_guests += 1;
        let slot = self.kv_engine().guests.insert(Guest {
            home,
            request,
            op,
            run,
            waited: false,
        });
        self.guest_advance(slot);
    }

    /// Owner: polls a guest's machine; a wait keeps it here, anything else goes home.
    pub(super) fn guest_advance(&mut self, slot: u32) {
        let Some(kv) = self.kv.as_mut() else {
            panic!("a KV guest on a thread without the table");
        };
        let Some(table) = kv.table.as_mut() else {
            panic!("a KV guest on a thread that does not own the table");
        };
        let Some(Some(guest)) = kv.guests.slots.get_mut(slot as usize) else {
            panic!("advancing free KV guest slot {slot}");
        };
        let (home, request) = (guest.home, guest.request);
        let next = match guest.op.poll(table, split_run(guest_run(guest.run))) {
            Poll::Io(io) => KvNext::Io(io),
            Poll::Wait => {
                kv.waiting.push_back(Waiter::Guest(slot));
                if !std::mem::replace(&mut guest.waited, true) {
                    self.stats.gate_waits += 1;
                }
                return;
            }
            Poll::Done(result) => {
                kv.guests.remove(slot);
                kv.released = true;
                KvNext::Done(result)
            }
        };
        self.migration.outbox.push_back((
            home,
            MigrationMessage::Kv(KvMessage::Next {
                request,
                guest: slot,
                next,
            }),
        ));
    }

    /// Other threads' KV operations in progress on this thread's table.
    pub fn kv_guests_in_use(&self) -> u32 {
        self.kv.as_ref().map_or(0, |kv| kv.guests.in_use())
    }
}
