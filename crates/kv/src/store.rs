//! The hash table: PUT, GET, DELETE and FLUSH over a [`BlockStore`], synchronous, one operation
//! at a time. The layout decisions live in [`crate::layout`] (pure) and each operation's
//! sequence of block reads and writes in [`crate::op`] (a sans-IO step machine, the same one
//! the dataplane drives); this module runs those machines to completion on a [`BlockStore`],
//! and formats and opens tables (start-up work, synchronous everywhere).
//!
//! Lookup: hash the key, read the buckets of its probe sequence in order, stop at the bucket
//! that holds the key or at the first one with an Empty slot (nothing was ever placed past it);
//! after the probe window, the key is absent.
//!
//! Write ordering, so that every key reads back whole after a crash (its old or its new value,
//! never a mix or another key's bytes):
//! 1. the value goes to a freshly allocated extent (never one the on-device index names);
//! 2. then the bucket block is rewritten (one 4 KiB write, CRC-checked on open);
//! 3. the replaced extent is freed only after the next FLUSH ([`crate::alloc`]).
//!
//! Durability: a FLUSH makes every earlier answered PUT and DELETE survive a restart. Without
//! one, writes may or may not survive, each whole.
//!
//! Errors never leave the table inconsistent in memory: a PUT that fails before its bucket
//! write changes nothing (the new extent is freed); a failed bucket write keeps both extents
//! allocated (a leak until the next open, never a block in use twice). A failed bucket write
//! may still have landed (a short completion): the key is then as asked, and [`KvStore::len`]
//! may be off by the keys so affected until the next open. Buckets are always read from the
//! device, never cached, so later operations see whichever version landed.

use reflex_flash::FlashError;
use reflex_proto::kv::{KEY_SIZE_MAX_BYTES, Status, VALUE_SIZE_MAX_BYTES};

use crate::alloc::ExtentConflict;
use crate::layout::{
    BLOCK_SIZE_BYTES, Block, BucketImage, Geometry, GeometryError, LayoutError, Slot,
    VALUE_BLOCKS_MAX, ValueLocation, key_hash,
};
use crate::op::{BlockIo, Buffer, Buffers, KvOp, OpKind, Poll, Reply};
use crate::table::KvTable;

/// Blocks written at once while formatting (zeroing the index).
const FORMAT_BATCH_BLOCKS: usize = 16;

/// Synchronous 4 KiB block I/O: what the table needs of a device. Buffers are whole blocks.
pub trait BlockStore {
    /// Device size in 4 KiB blocks.
    fn block_count(&self) -> u64;
    /// Reads `buf.len() / 4096` blocks starting at `block_index`.
    fn read_blocks(&mut self, block_index: u64, buf: &mut [u8]) -> Result<(), FlashError>;
    /// Writes `buf.len() / 4096` blocks starting at `block_index`; with `fua`, durable when
    /// this returns (forced unit access).
    fn write_blocks(&mut self, block_index: u64, buf: &[u8], fua: bool) -> Result<(), FlashError>;
    /// Makes every completed write durable.
    fn flush(&mut self) -> Result<(), FlashError>;
}

/// Why an operation failed. [`KvError::status`] is the wire answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("empty key")]
    EmptyKey,
    #[error("key of {length_bytes} bytes, at most {KEY_SIZE_MAX_BYTES} allowed")]
    KeyTooLong { length_bytes: usize },
    #[error("value of {length_bytes} bytes, at most {VALUE_SIZE_MAX_BYTES} allowed")]
    ValueTooLarge { length_bytes: usize },
    #[error("every slot of the key's {probe_buckets} probe buckets is in use")]
    TableFull { probe_buckets: u32 },
    #[error("no run of {blocks} free blocks left in the value area")]
    NoSpace { blocks: u64 },
    #[error("device: {0}")]
    Io(#[from] FlashError),
    #[error("the value at block {extent_block} does not match its checksum")]
    ValueChecksum { extent_block: u64 },
    #[error("damaged table: {0}")]
    Corrupt(#[from] LayoutError),
    #[error("damaged table: {0}")]
    ExtentConflict(#[from] ExtentConflict),
    #[error("cannot lay out the table: {0}")]
    Geometry(#[from] GeometryError),
}

impl KvError {
    /// The status a server answers with.
    pub const fn status(&self) -> Status {
        match self {
            KvError::EmptyKey => Status::Invalid,
            KvError::KeyTooLong { .. } | KvError::ValueTooLarge { .. } => Status::TooLarge,
            KvError::TableFull { .. } | KvError::NoSpace { .. } => Status::TableFull,
            KvError::Io(_)
            | KvError::ValueChecksum { .. }
            | KvError::Corrupt(_)
            | KvError::ExtentConflict(_)
            | KvError::Geometry(_) => Status::IoError,
        }
    }
}

/// A used slot seen while opening.
#[derive(Clone, Copy)]
struct UsedEntry {
    hash: u64,
    /// Buckets from the key's home bucket to this one.
    distance: u64,
    bucket_index: u64,
    slot_index: usize,
    location: ValueLocation,
}

/// A key-value table on a block store.
pub struct KvStore<B: BlockStore> {
    blocks: B,
    table: KvTable,
    /// One block image for bucket reads.
    block: Box<Block>,
    /// Staging for one value's blocks.
    value_buf: Vec<u8>,
}

impl<B: BlockStore> std::fmt::Debug for KvStore<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvStore")
            .field("geometry", &self.table.geometry)
            .field("entry_count", &self.table.entry_count)
            .finish_non_exhaustive()
    }
}

impl<B: BlockStore> KvStore<B> {
    fn with_geometry(blocks: B, geometry: Geometry) -> KvStore<B> {
        KvStore {
            blocks,
            table: KvTable::new(geometry),
            block: Box::new([0u8; BLOCK_SIZE_BYTES]),
            value_buf: vec![0u8; VALUE_BLOCKS_MAX * BLOCK_SIZE_BYTES],
        }
    }

    /// Creates an empty table with `geometry` (see [`Geometry::for_device`]): zeroes the index,
    /// writes the superblock last, flushes. Whatever the device held is lost.
    pub fn format(mut blocks: B, geometry: Geometry) -> Result<KvStore<B>, KvError> {
        if geometry.total_blocks() > blocks.block_count() {
            return Err(GeometryError::DeviceTooSmall {
                device_blocks: blocks.block_count(),
                bucket_count: geometry.bucket_count(),
            }
            .into());
        }
        // Invalidate an older table first, so a crash mid-format leaves no superblock that
        // names a half-zeroed index.
        blocks.write_blocks(0, &[0u8; BLOCK_SIZE_BYTES], false)?;
        let zeroes = vec![0u8; FORMAT_BATCH_BLOCKS * BLOCK_SIZE_BYTES];
        let mut bucket_index = 0;
        while bucket_index < geometry.bucket_count() {
            let batch = (geometry.bucket_count() - bucket_index).min(FORMAT_BATCH_BLOCKS as u64);
            let length = batch as usize * BLOCK_SIZE_BYTES;
            blocks.write_blocks(
                geometry.bucket_block(bucket_index),
                &zeroes[..length],
                false,
            )?;
            bucket_index += batch;
        }
        blocks.flush()?;
        blocks.write_blocks(0, &geometry.encode_superblock(), false)?;
        blocks.flush()?;
        Ok(KvStore::with_geometry(blocks, geometry))
    }

    /// Opens the table on `blocks`: checks the superblock and every bucket, repairs what a
    /// crash between FLUSHes can leave (below), and rebuilds the extent allocator and the entry
    /// count from the index. A damaged block is an error, never silently skipped.
    ///
    /// Repair: bucket writes between two FLUSHes may reach the device in any subset, so a
    /// bucket can be older than its neighbours. That leaves two kinds of stale slot, both
    /// invisible to lookups, which would resurface later if kept: a slot past a bucket of its
    /// probe sequence that has a never-used slot again (the write that filled it was lost), and
    /// a second copy of a key further along its probe sequence (the write that deleted it was
    /// lost; a key's newest copy is always its first in probe order, because a PUT takes the
    /// first free slot and the old copy's slot was free). Stale slots become tombstones and the
    /// repair is flushed before `open` returns.
    pub fn open(mut blocks: B) -> Result<KvStore<B>, KvError> {
        let mut superblock = [0u8; BLOCK_SIZE_BYTES];
        blocks.read_blocks(0, &mut superblock)?;
        let geometry = Geometry::decode_superblock(&superblock, blocks.block_count())?;
        let mut store = KvStore::with_geometry(blocks, geometry);
        let bucket_count = geometry.bucket_count();
        // Pass 1: which buckets hold a never-used slot, and every used slot.
        let mut has_empty = vec![false; usize::try_from(bucket_count).unwrap_or(usize::MAX)];
        let mut used_slots: Vec<UsedEntry> = Vec::new();
        for bucket_index in 0..bucket_count {
            let image = store.read_bucket(bucket_index)?;
            has_empty[bucket_index as usize] = image.has_empty_slot();
            for (slot_index, slot) in image.slots() {
                if let Slot::Used(used) = slot {
                    used_slots.push(UsedEntry {
                        hash: key_hash(used.key),
                        distance: 0,
                        bucket_index,
                        slot_index,
                        location: used.location,
                    });
                }
            }
        }
        // Pass 2: find the stale slots.
        let mut stale: Vec<(u64, usize)> = Vec::new();
        let mut live: Vec<UsedEntry> = Vec::with_capacity(used_slots.len());
        for mut entry in used_slots {
            let home = entry.hash % bucket_count;
            entry.distance = (entry.bucket_index + bucket_count - home) % bucket_count;
            if entry.distance >= u64::from(geometry.probe_buckets_max()) {
                return Err(LayoutError::BadSlot {
                    bucket_index: entry.bucket_index,
                    slot_index: entry.slot_index,
                    reason: "key outside its probe window",
                }
                .into());
            }
            let hidden =
                (0..entry.distance).any(|step| has_empty[((home + step) % bucket_count) as usize]);
            if hidden {
                stale.push((entry.bucket_index, entry.slot_index));
            } else {
                live.push(entry);
            }
        }
        // Copies of one key share its hash: sort by hash, then probe order, and compare the
        // keys of equal hashes (rare: a few reads).
        live.sort_unstable_by_key(|entry| (entry.hash, entry.distance, entry.slot_index));
        let mut kept: Vec<UsedEntry> = Vec::with_capacity(live.len());
        for group in live.chunk_by(|a, b| a.hash == b.hash) {
            if let [single] = group {
                kept.push(*single);
                continue;
            }
            let group_start = kept.len();
            for entry in group {
                let key = store.read_key(entry.bucket_index, entry.slot_index)?;
                let mut duplicate = false;
                for earlier in kept[group_start..].iter().copied() {
                    if store.read_key(earlier.bucket_index, earlier.slot_index)? == key {
                        duplicate = true;
                        break;
                    }
                }
                if duplicate {
                    stale.push((entry.bucket_index, entry.slot_index));
                } else {
                    kept.push(*entry);
                }
            }
        }
        // Pass 3: rebuild the allocator and the count; rewrite the buckets with stale slots.
        for entry in &kept {
            store.table.entry_count += 1;
            if entry.location.blocks() > 0 {
                store
                    .table
                    .allocator
                    .mark_used(entry.location.extent_block, entry.location.blocks())?;
            }
        }
        stale.sort_unstable();
        store.table.repaired_slot_count = stale.len() as u64;
        for bucket_stale in stale.chunk_by(|a, b| a.0 == b.0) {
            let mut image = store.read_bucket(bucket_stale[0].0)?;
            for &(_, slot_index) in bucket_stale {
                image.retire_slot(slot_index);
            }
            store.write_bucket(&mut image)?;
        }
        if !stale.is_empty() {
            store.blocks.flush()?;
        }
        Ok(store)
    }

    /// The key in a slot that pass 1 of [`open`](Self::open) found used.
    fn read_key(&mut self, bucket_index: u64, slot_index: usize) -> Result<Vec<u8>, KvError> {
        let image = self.read_bucket(bucket_index)?;
        match image.slot(slot_index) {
            Slot::Used(used) => Ok(used.key.to_vec()),
            Slot::Empty | Slot::Tombstone => Err(LayoutError::BadBucket {
                bucket_index,
                reason: "changed while opening",
            }
            .into()),
        }
    }

    /// Stale slots [`open`](Self::open) turned into tombstones (0 after a clean shutdown or a
    /// FLUSH).
    pub const fn repaired_slot_count(&self) -> u64 {
        self.table.repaired_slot_count
    }

    pub const fn geometry(&self) -> &Geometry {
        &self.table.geometry
    }

    /// Keys stored, as the answered operations tell: a PUT or DELETE whose bucket write
    /// failed may still have landed, which the count learns only at the next open.
    pub const fn len(&self) -> u64 {
        self.table.entry_count
    }

    pub const fn is_empty(&self) -> bool {
        self.table.entry_count == 0
    }

    /// Blocks of the value area in use, including those freed since the last FLUSH.
    pub const fn used_value_blocks(&self) -> u64 {
        self.table.allocator.used_block_count()
    }

    /// The open table's shared state and the block store, for a server that drives the
    /// operations itself (the dataplane) after opening the table here.
    pub fn into_parts(self) -> (B, KvTable) {
        (self.blocks, self.table)
    }

    pub const fn blocks(&self) -> &B {
        &self.blocks
    }

    /// The block store, e.g. to reopen the same device in a test.
    pub fn into_blocks(self) -> B {
        self.blocks
    }

    fn read_bucket(&mut self, bucket_index: u64) -> Result<BucketImage, KvError> {
        self.blocks.read_blocks(
            self.table.geometry.bucket_block(bucket_index),
            &mut self.block[..],
        )?;
        Ok(BucketImage::decode(
            bucket_index,
            &self.block,
            &self.table.geometry,
        )?)
    }

    fn write_bucket(&mut self, image: &mut BucketImage) -> Result<(), KvError> {
        let block_index = self.table.geometry.bucket_block(image.bucket_index());
        self.blocks
            .write_blocks(block_index, image.encode(), false)?;
        Ok(())
    }

    /// Runs `op` to its answer over the block store (the value, for PUT, already in the
    /// front of the staging buffer; for GET, left there).
    fn run(&mut self, mut op: KvOp) -> Result<Reply, KvError> {
        loop {
            let buffers = Buffers {
                bucket: &mut self.block,
                value: &mut self.value_buf,
            };
            let io = match op.poll(&mut self.table, buffers) {
                Poll::Io(io) => io,
                Poll::Done(result) => return result,
                // One operation at a time: nothing else holds the gate.
                Poll::Wait => panic!("a synchronous operation waiting at the gate"),
            };
            let result = match io {
                BlockIo::Read {
                    block_index, into, ..
                } => {
                    let buffer = match into {
                        Buffer::Bucket => &mut self.block[..],
                        Buffer::Value => &mut self.value_buf[..io.length_bytes()],
                    };
                    self.blocks.read_blocks(block_index, buffer)
                }
                BlockIo::Write {
                    block_index,
                    from,
                    fua,
                    ..
                } => {
                    let buffer = match from {
                        Buffer::Bucket => &self.block[..],
                        Buffer::Value => &self.value_buf[..io.length_bytes()],
                    };
                    self.blocks.write_blocks(block_index, buffer, fua)
                }
                BlockIo::Flush => self.blocks.flush(),
            };
            let buffers = Buffers {
                bucket: &mut self.block,
                value: &mut self.value_buf,
            };
            op.complete(&mut self.table, buffers, result);
        }
    }

    /// Stores `value` under `key`, replacing an earlier value. `TableFull`/`NoSpace` change
    /// nothing.
    pub fn put(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        let op = KvOp::new(
            OpKind::Put {
                // Checked against 64 KiB by `KvOp::new`.
                value_length_bytes: u32::try_from(value.len()).unwrap_or(u32::MAX),
            },
            key,
        )?;
        self.value_buf[..value.len()].copy_from_slice(value);
        match self.run(op)? {
            Reply::Stored => Ok(()),
            other => panic!("a PUT answered {other:?}"),
        }
    }

    /// The value of `key` written into the front of `out` (at least 64 KiB, or at least the
    /// value's length); `None` when the key is absent.
    pub fn get_into(&mut self, key: &[u8], out: &mut [u8]) -> Result<Option<usize>, KvError> {
        let op = KvOp::new(OpKind::Get, key)?;
        match self.run(op)? {
            Reply::Value { length_bytes } => {
                let length = length_bytes as usize;
                assert!(out.len() >= length, "value buffer smaller than the value");
                out[..length].copy_from_slice(&self.value_buf[..length]);
                Ok(Some(length))
            }
            Reply::NotFound => Ok(None),
            other => panic!("a GET answered {other:?}"),
        }
    }

    /// The value of `key`, or `None`.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        let mut out = vec![0u8; VALUE_SIZE_MAX_BYTES];
        let length = self.get_into(key, &mut out)?;
        Ok(length.map(|length| {
            out.truncate(length);
            out
        }))
    }

    /// Removes `key`; `false` when it was absent.
    pub fn delete(&mut self, key: &[u8]) -> Result<bool, KvError> {
        let op = KvOp::new(OpKind::Delete, key)?;
        match self.run(op)? {
            Reply::Deleted => Ok(true),
            Reply::NotFound => Ok(false),
            other => panic!("a DELETE answered {other:?}"),
        }
    }

    /// Makes every earlier PUT and DELETE durable, then lets the value blocks they released be
    /// reused.
    pub fn flush(&mut self) -> Result<(), KvError> {
        let op = KvOp::new(OpKind::Flush, &[])?;
        match self.run(op)? {
            Reply::Flushed => Ok(()),
            other => panic!("a FLUSH answered {other:?}"),
        }
    }
}

/// A [`BlockStore`] in a `Vec`, for unit tests of the table logic and for the simulator. It
/// can fail chosen operations, and it counts reads and writes.
#[derive(Clone, Debug, Default)]
pub struct MemBlocks {
    data: Vec<u8>,
    /// Fail every write (value or bucket) from this many writes on; `None`: never.
    pub fail_writes_after: Option<u64>,
    pub write_count: u64,
    /// Writes with forced unit access (value writes).
    pub fua_write_count: u64,
    pub read_count: u64,
    pub flush_count: u64,
}

impl MemBlocks {
    pub fn new(block_count: u64) -> MemBlocks {
        MemBlocks {
            data: vec![0u8; usize::try_from(block_count).unwrap_or(usize::MAX) * BLOCK_SIZE_BYTES],
            ..MemBlocks::default()
        }
    }

    /// One block's bytes, to damage them in a test.
    pub fn block_mut(&mut self, block_index: u64) -> &mut [u8] {
        let range = self.range(block_index, BLOCK_SIZE_BYTES);
        &mut self.data[range]
    }

    fn range(&self, block_index: u64, length: usize) -> std::ops::Range<usize> {
        assert!(length.is_multiple_of(BLOCK_SIZE_BYTES));
        let start = usize::try_from(block_index).unwrap_or(usize::MAX) * BLOCK_SIZE_BYTES;
        assert!(start + length <= self.data.len(), "block out of range");
        start..start + length
    }
}

impl BlockStore for MemBlocks {
    fn block_count(&self) -> u64 {
        (self.data.len() / BLOCK_SIZE_BYTES) as u64
    }

    fn read_blocks(&mut self, block_index: u64, buf: &mut [u8]) -> Result<(), FlashError> {
        self.read_count += 1;
        let range = self.range(block_index, buf.len());
        buf.copy_from_slice(&self.data[range]);
        Ok(())
    }

    fn write_blocks(&mut self, block_index: u64, buf: &[u8], fua: bool) -> Result<(), FlashError> {
        if self
            .fail_writes_after
            .is_some_and(|after| self.write_count >= after)
        {
            return Err(FlashError::Io { errno: 5 });
        }
        self.write_count += 1;
        if fua {
            self.fua_write_count += 1;
        }
        let range = self.range(block_index, buf.len());
        self.data[range].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), FlashError> {
        self.flush_count += 1;
        Ok(())
    }
}
