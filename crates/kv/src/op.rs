//! One PUT, GET, DELETE or FLUSH as a sans-IO step machine: it says which block I/O it needs
//! next ([`KvOp::poll`]), is given the result ([`KvOp::complete`]), and repeats until it
//! yields its answer. The synchronous [`crate::KvStore`] drives it over a [`crate::BlockStore`];
//! the dataplane drives the same machine through its QoS scheduler and device queues, so
//! the logic the model, crash and fault tests prove is the logic the server runs.
//!
//! Why a machine: a KV operation is several dependent device operations (probe reads, a
//! value write with forced unit access, a bucket write, a flush when the value area is full
//! only of blocks waiting for a FLUSH). A server cannot block a thread on each; it needs to
//! submit one, serve others, and resume when it completes.
//!
//! Memory: the machine owns at most two bucket images (the bucket it works on and, for a PUT,
//! the first one with a free slot) and its key; the caller owns the I/O buffers
//! ([`Buffers`]): one bucket block and one value area of up to 64 KiB. A PUT's value must be
//! in the value area before its first poll; a GET's value is there when it answers.
//!
//! Order of steps, and why (the write-ordering argument is in [`crate::store`]):
//! 1. take the key's probe window at the table's gate ([`crate::table`]); FLUSH waits for
//!    every operation that arrived before it;
//! 2. read the probe buckets in order until the key, or a bucket with a never-used slot;
//! 3. GET: read the value's blocks and check its CRC. DELETE: write the bucket back without
//!    the slot. PUT: allocate an extent, write the value with FUA, then write the bucket;
//! 4. update the table (key count, deferred frees), release the gate, answer.
//!
//! Invariants: at most one I/O in flight per operation; `poll` is never called while one is,
//! `complete` only when one is; the gate place is released exactly once (on the answer or by
//! [`KvOp::abandon`]); the table's allocator never loses or doubles a block.

use reflex_flash::FlashError;
use reflex_proto::kv::{KEY_SIZE_MAX_BYTES, Status, VALUE_SIZE_MAX_BYTES};

use crate::layout::{
    BLOCK_SIZE_BYTES, Block, BucketImage, Slot, ValueLocation, key_hash, value_blocks,
};
use crate::store::KvError;
use crate::table::{KvTable, Span, Ticket};

/// Which operation, with what it needs to know up front.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Put { value_length_bytes: u32 },
    Get,
    Delete,
    Flush,
}

/// Which of the caller's buffers an I/O uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffer {
    /// The one-block bucket buffer.
    Bucket,
    /// The value area, from its start.
    Value,
}

/// The block I/O an operation needs next. Block indexes and counts are in 4 KiB blocks of the
/// table's namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockIo {
    Read {
        block_index: u64,
        block_count: u32,
        into: Buffer,
    },
    Write {
        block_index: u64,
        block_count: u32,
        from: Buffer,
        /// Forced unit access: durable when it completes (value writes).
        fua: bool,
    },
    Flush,
}

impl BlockIo {
    /// Bytes transferred (0 for a flush).
    pub const fn length_bytes(&self) -> usize {
        match *self {
            BlockIo::Read { block_count, .. } | BlockIo::Write { block_count, .. } => {
                block_count as usize * BLOCK_SIZE_BYTES
            }
            BlockIo::Flush => 0,
        }
    }

    /// The buffer it reads into or writes from.
    pub const fn buffer(&self) -> Option<Buffer> {
        match *self {
            BlockIo::Read { into, .. } => Some(into),
            BlockIo::Write { from, .. } => Some(from),
            BlockIo::Flush => None,
        }
    }
}

/// A successful answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Stored,
    /// GET: the value is the first `length_bytes` of the value area.
    Value {
        length_bytes: u32,
    },
    Deleted,
    /// GET or DELETE of an absent key.
    NotFound,
    Flushed,
}

impl Reply {
    pub const fn status(&self) -> Status {
        match self {
            Reply::NotFound => Status::NotFound,
            _ => Status::Ok,
        }
    }

    /// Bytes of value the answer carries.
    pub const fn value_length_bytes(&self) -> u32 {
        match *self {
            Reply::Value { length_bytes } => length_bytes,
            _ => 0,
        }
    }
}

/// What the operation needs now.
#[derive(Debug, PartialEq, Eq)]
pub enum Poll {
    /// Submit this and call [`KvOp::complete`] with its result.
    Io(BlockIo),
    /// Waiting at the gate for an earlier operation over the same buckets: poll again once
    /// another operation of the table has finished.
    Wait,
    /// The answer (returned once; the operation is over and holds nothing).
    Done(Result<Reply, KvError>),
}

/// The caller's I/O buffers (see the module doc).
pub struct Buffers<'a> {
    pub bucket: &'a mut Block,
    /// At least the value's blocks (64 KiB for a GET).
    pub value: &'a mut [u8],
}

/// The bucket an operation will write back, and what it found there.
#[derive(Debug)]
struct Target {
    image: BucketImage,
    slot_index: usize,
    /// The key's value before the operation (`None`: the key was absent).
    old: Option<ValueLocation>,
}

#[derive(Debug)]
enum State {
    Start,
    Waiting,
    Probe {
        step: u32,
    },
    ReadingBucket {
        step: u32,
    },
    ReadValue {
        location: ValueLocation,
    },
    ReadingValue {
        location: ValueLocation,
    },
    Allocate {
        target: Target,
        flushed: bool,
    },
    FlushingForSpace {
        target: Target,
        mark: u64,
    },
    WritingValue {
        target: Target,
        location: ValueLocation,
    },
    WriteBucket {
        target: Target,
        new: Option<ValueLocation>,
    },
    WritingBucket {
        target: Target,
        new: Option<ValueLocation>,
    },
    Flush,
    Flushing {
        mark: u64,
    },
    Done(Option<Result<Reply, KvError>>),
    /// Between two states (never seen outside a method).
    Moving,
}

/// One operation in progress (see the module doc).
#[derive(Debug)]
pub struct KvOp {
    kind: OpKind,
    key: [u8; KEY_SIZE_MAX_BYTES],
    key_length: u8,
    state: State,
    ticket: Option<Ticket>,
    /// PUT: the first free slot seen while probing.
    free: Option<(BucketImage, usize)>,
}

impl KvOp {
    /// A new operation on `key` (empty for FLUSH). Checks the sizes: an oversize or empty
    /// key or an oversize value is refused before anything happens.
    pub fn new(kind: OpKind, key: &[u8]) -> Result<KvOp, KvError> {
        if kind == OpKind::Flush {
            assert!(key.is_empty(), "a FLUSH with a key");
        } else if key.is_empty() {
            return Err(KvError::EmptyKey);
        } else if key.len() > KEY_SIZE_MAX_BYTES {
            return Err(KvError::KeyTooLong {
                length_bytes: key.len(),
            });
        }
        if let OpKind::Put { value_length_bytes } = kind
            && value_length_bytes as usize > VALUE_SIZE_MAX_BYTES
        {
            return Err(KvError::ValueTooLarge {
                length_bytes: value_length_bytes as usize,
            });
        }
        let mut stored = [0u8; KEY_SIZE_MAX_BYTES];
        stored[..key.len()].copy_from_slice(key);
        Ok(KvOp {
            kind,
            key: stored,
            key_length: key.len() as u8,
            state: State::Start,
            ticket: None,
            free: None,
        })
    }

    pub const fn kind(&self) -> OpKind {
        self.kind
    }

    /// The bucket write that stores `location` for this key in `target`'s slot.
    fn bucket_write_with(&self, mut target: Target, location: ValueLocation) -> State {
        target
            .image
            .set_slot(target.slot_index, self.key(), location);
        State::WriteBucket {
            target,
            new: Some(location),
        }
    }

    fn key(&self) -> &[u8] {
        &self.key[..usize::from(self.key_length)]
    }

    /// Whether a device operation of this operation is in flight.
    pub fn in_flight(&self) -> bool {
        matches!(
            self.state,
            State::ReadingBucket { .. }
                | State::ReadingValue { .. }
                | State::FlushingForSpace { .. }
                | State::WritingValue { .. }
                | State::WritingBucket { .. }
                | State::Flushing { .. }
        )
    }

    fn span(&self, table: &KvTable) -> Span {
        match self.kind {
            OpKind::Flush => Span::Barrier,
            kind => Span::Window {
                home: key_hash(self.key()) % table.geometry.bucket_count(),
                exclusive: kind != OpKind::Get,
            },
        }
    }

    /// The state after the gate granted the operation.
    fn first_state(&self) -> State {
        match self.kind {
            OpKind::Flush => State::Flush,
            _ => State::Probe { step: 0 },
        }
    }

    fn finish(&mut self, table: &mut KvTable, result: Result<Reply, KvError>) {
        if let Some(ticket) = self.ticket.take() {
            table.gate.release(ticket);
        }
        self.free = None;
        self.state = State::Done(Some(result));
    }

    /// Advances the operation to its next I/O, a wait at the gate, or its answer.
    pub fn poll(&mut self, table: &mut KvTable, buffers: Buffers<'_>) -> Poll {
        loop {
            match std::mem::replace(&mut self.state, State::Moving) {
                State::Start => {
                    let (ticket, granted) = table.gate.acquire(self.span(table));
                    self.ticket = Some(ticket);
                    if !granted {
                        self.state = State::Waiting;
                        return Poll::Wait;
                    }
                    self.state = self.first_state();
                }
                State::Waiting => {
                    let Some(ticket) = self.ticket else {
                        panic!("waiting at the gate without a ticket");
                    };
                    if !table.gate.retry(ticket) {
                        self.state = State::Waiting;
                        return Poll::Wait;
                    }
                    self.state = self.first_state();
                }
                State::Probe { step } => {
                    let geometry = &table.geometry;
                    let home = key_hash(self.key()) % geometry.bucket_count();
                    let bucket_index = (home + u64::from(step)) % geometry.bucket_count();
                    self.state = State::ReadingBucket { step };
                    return Poll::Io(BlockIo::Read {
                        block_index: geometry.bucket_block(bucket_index),
                        block_count: 1,
                        into: Buffer::Bucket,
                    });
                }
                State::ReadValue { location } => {
                    self.state = State::ReadingValue { location };
                    return Poll::Io(BlockIo::Read {
                        block_index: location.extent_block,
                        block_count: location.blocks() as u32,
                        into: Buffer::Value,
                    });
                }
                State::Allocate { target, flushed } => {
                    let OpKind::Put { value_length_bytes } = self.kind else {
                        panic!("allocating for {:?}", self.kind);
                    };
                    let length = value_length_bytes as usize;
                    let blocks = value_blocks(length);
                    if blocks == 0 {
                        let location = ValueLocation {
                            extent_block: 0,
                            value_length_bytes: 0,
                            value_crc: crc32fast::hash(&[]),
                        };
                        self.state = self.bucket_write_with(target, location);
                        continue;
                    }
                    let blocks_u64 = blocks as u64;
                    match table.allocator.allocate(blocks_u64) {
                        Some(extent_block) => {
                            let staged = &mut buffers.value[..blocks * BLOCK_SIZE_BYTES];
                            staged[length..].fill(0);
                            let location = ValueLocation {
                                extent_block,
                                value_length_bytes,
                                value_crc: crc32fast::hash(&staged[..length]),
                            };
                            self.state = State::WritingValue { target, location };
                            // Durable before the bucket block that names it is written: after
                            // a crash the index never names a value that did not reach the
                            // device.
                            return Poll::Io(BlockIo::Write {
                                block_index: extent_block,
                                block_count: blocks as u32,
                                from: Buffer::Value,
                                fua: true,
                            });
                        }
                        None if !flushed && table.allocator.deferred_block_count() > 0 => {
                            // Space freed since the last FLUSH becomes usable once a FLUSH
                            // makes the index that no longer names it durable.
                            let mark = table.allocator.deferred_mark();
                            self.state = State::FlushingForSpace { target, mark };
                            return Poll::Io(BlockIo::Flush);
                        }
                        None => self.finish(table, Err(KvError::NoSpace { blocks: blocks_u64 })),
                    }
                }
                State::WriteBucket { mut target, new } => {
                    buffers.bucket.copy_from_slice(target.image.encode());
                    let block_index = table.geometry.bucket_block(target.image.bucket_index());
                    self.state = State::WritingBucket { target, new };
                    return Poll::Io(BlockIo::Write {
                        block_index,
                        block_count: 1,
                        from: Buffer::Bucket,
                        fua: false,
                    });
                }
                State::Flush => {
                    let mark = table.allocator.deferred_mark();
                    self.state = State::Flushing { mark };
                    return Poll::Io(BlockIo::Flush);
                }
                State::Done(result) => {
                    let Some(result) = result else {
                        panic!("polled after its answer");
                    };
                    self.state = State::Done(None);
                    return Poll::Done(result);
                }
                other => panic!("polled with I/O in flight: {other:?}"),
            }
        }
    }

    /// The I/O [`poll`](Self::poll) asked for finished with `result` (its data, for a read, in
    /// `buffers`).
    pub fn complete(
        &mut self,
        table: &mut KvTable,
        buffers: Buffers<'_>,
        result: Result<(), FlashError>,
    ) {
        let state = std::mem::replace(&mut self.state, State::Moving);
        if let Err(error) = result {
            match state {
                State::WritingValue { location, .. } => {
                    // Never named by the index: free at once.
                    table
                        .allocator
                        .free_now(location.extent_block, location.blocks());
                }
                State::WritingBucket { .. } => {
                    // Both extents stay allocated: the write may have landed (a leak until the
                    // next open, never a block in use twice). The entry count stays as it
                    // was, so it may be off by this operation until the next open.
                }
                State::ReadingBucket { .. }
                | State::ReadingValue { .. }
                | State::FlushingForSpace { .. }
                | State::Flushing { .. } => {}
                other => panic!("a completion without I/O in flight: {other:?}"),
            }
            self.finish(table, Err(error.into()));
            return;
        }
        match state {
            State::ReadingBucket { step } => self.bucket_read(table, buffers.bucket, step),
            State::ReadingValue { location } => {
                let length = location.value_length_bytes as usize;
                let result = if crc32fast::hash(&buffers.value[..length]) == location.value_crc {
                    Ok(Reply::Value {
                        length_bytes: location.value_length_bytes,
                    })
                } else {
                    Err(KvError::ValueChecksum {
                        extent_block: location.extent_block,
                    })
                };
                self.finish(table, result);
            }
            State::FlushingForSpace { target, mark } => {
                table.allocator.release_deferred_until(mark);
                self.state = State::Allocate {
                    target,
                    flushed: true,
                };
            }
            State::WritingValue { target, location } => {
                self.state = self.bucket_write_with(target, location);
            }
            State::WritingBucket { target, new } => {
                match (target.old, new) {
                    (Some(old), _) if old.blocks() > 0 => {
                        table
                            .allocator
                            .free_deferred(old.extent_block, old.blocks());
                    }
                    _ => {}
                }
                let reply = match (target.old, new) {
                    (None, Some(_)) => {
                        table.entry_count += 1;
                        Reply::Stored
                    }
                    (Some(_), Some(_)) => Reply::Stored,
                    (Some(_), None) => {
                        // Not an invariant: a bucket write that failed may have landed (an
                        // error or a short completion says nothing of what reached the
                        // device), so the count can be behind the buckets until the next
                        // open recounts them. Never below zero.
                        table.entry_count = table.entry_count.saturating_sub(1);
                        Reply::Deleted
                    }
                    (None, None) => panic!("a bucket write that changes nothing"),
                };
                self.finish(table, Ok(reply));
            }
            State::Flushing { mark } => {
                table.allocator.release_deferred_until(mark);
                self.finish(table, Ok(Reply::Flushed));
            }
            other => panic!("a completion without I/O in flight: {other:?}"),
        }
    }

    /// Probe step `step`'s bucket is in `block`: the key is there, or the probe goes on, or
    /// the key is absent.
    fn bucket_read(&mut self, table: &mut KvTable, block: &Block, step: u32) {
        let geometry = table.geometry;
        let home = key_hash(self.key()) % geometry.bucket_count();
        let bucket_index = (home + u64::from(step)) % geometry.bucket_count();
        let image = match BucketImage::decode(bucket_index, block, &geometry) {
            Ok(image) => image,
            Err(error) => return self.finish(table, Err(error.into())),
        };
        let mut found = None;
        let mut free_here = None;
        for (slot_index, slot) in image.slots() {
            match slot {
                Slot::Used(used) if used.key == self.key() => {
                    found = Some((slot_index, used.location));
                    break;
                }
                Slot::Used(_) => {}
                Slot::Empty | Slot::Tombstone => free_here = free_here.or(Some(slot_index)),
            }
        }
        if let Some((slot_index, location)) = found {
            return self.found(table, image, slot_index, location);
        }
        let last = image.has_empty_slot() || step + 1 >= geometry.probe_buckets_max();
        if matches!(self.kind, OpKind::Put { .. })
            && self.free.is_none()
            && let Some(slot_index) = free_here
        {
            self.free = Some((image, slot_index));
        }
        if !last {
            self.state = State::Probe { step: step + 1 };
            return;
        }
        match self.kind {
            OpKind::Get | OpKind::Delete => self.finish(table, Ok(Reply::NotFound)),
            OpKind::Put { .. } => match self.free.take() {
                Some((image, slot_index)) => {
                    self.state = State::Allocate {
                        target: Target {
                            image,
                            slot_index,
                            old: None,
                        },
                        flushed: false,
                    };
                }
                None => {
                    let probe_buckets = geometry.probe_buckets_max();
                    self.finish(table, Err(KvError::TableFull { probe_buckets }));
                }
            },
            OpKind::Flush => panic!("a FLUSH probing"),
        }
    }

    fn found(
        &mut self,
        table: &mut KvTable,
        mut image: BucketImage,
        slot_index: usize,
        location: ValueLocation,
    ) {
        match self.kind {
            OpKind::Get if location.blocks() == 0 => {
                let result = if crc32fast::hash(&[]) == location.value_crc {
                    Ok(Reply::Value { length_bytes: 0 })
                } else {
                    Err(KvError::ValueChecksum { extent_block: 0 })
                };
                self.finish(table, result);
            }
            OpKind::Get => self.state = State::ReadValue { location },
            OpKind::Delete => {
                image.delete_slot(slot_index);
                self.state = State::WriteBucket {
                    target: Target {
                        image,
                        slot_index,
                        old: Some(location),
                    },
                    new: None,
                };
            }
            OpKind::Put { .. } => {
                self.free = None;
                self.state = State::Allocate {
                    target: Target {
                        image,
                        slot_index,
                        old: Some(location),
                    },
                    flushed: false,
                };
            }
            OpKind::Flush => panic!("a FLUSH found a key"),
        }
    }

    /// The operation will not go on (its connection closed, or its device operation was
    /// given up): it leaves the gate, and a value extent it allocated but no index names is
    /// freed. Call only when no I/O of it is in flight any more; an operation whose bucket
    /// write was in flight keeps both extents allocated (it may have landed).
    pub fn abandon(mut self, table: &mut KvTable) {
        match std::mem::replace(&mut self.state, State::Moving) {
            State::WritingValue { location, .. }
            | State::WriteBucket {
                new: Some(location),
                ..
            } if location.blocks() > 0 => {
                table
                    .allocator
                    .free_now(location.extent_block, location.blocks());
            }
            _ => {}
        }
        if let Some(ticket) = self.ticket.take() {
            table.gate.release(ticket);
        }
    }
}
