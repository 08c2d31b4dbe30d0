//! The on-device layout, as pure functions over 4 KiB block images: the superblock, bucket
//! blocks and their slots, the key hash and the probe sequence. Nothing here does I/O.
//!
//! ```text
//! block 0                      superblock (geometry, CRC)
//! blocks 1 ..= bucket_count    bucket blocks: a 16-byte header and 15 slots of 272 bytes
//! the rest                     extent area: values, each in ceil(length / 4 KiB) whole blocks
//! ```
//!
//! Invariants the decoders check, so a damaged device is reported and never trusted:
//! - a bucket block is either all zeroes (never written: every slot empty) or carries the bucket
//!   magic, its own bucket index and a CRC-32 of the whole block with the CRC field zero;
//! - a used slot has a key of 1 ..= 255 bytes, a value of at most 64 KiB, and an extent of
//!   exactly `ceil(value_length / 4096)` blocks inside the extent area (none for an empty value);
//! - slots go Empty → Used ⇄ Tombstone and never back to Empty, except a Used slot deleted while
//!   another slot of its bucket is still Empty (see [`BucketImage::delete_slot`]). That is what
//!   lets a lookup stop at the first bucket of its probe sequence that holds an Empty slot.

use reflex_proto::kv::{KEY_SIZE_MAX_BYTES, VALUE_SIZE_MAX_BYTES};

/// Every index and value block is this big; device offsets are multiples of it.
pub const BLOCK_SIZE_BYTES: usize = 4096;
pub const BUCKET_HEADER_SIZE: usize = 16;
pub const SLOT_SIZE: usize = 272;
pub const SLOTS_PER_BUCKET: usize = 15;
/// Blocks of the largest value.
pub const VALUE_BLOCKS_MAX: usize = VALUE_SIZE_MAX_BYTES.div_ceil(BLOCK_SIZE_BYTES);
/// `"RFLXKV01"` as a little-endian u64.
pub const SUPERBLOCK_MAGIC: u64 = u64::from_le_bytes(*b"RFLXKV01");
/// `"RKVB"` as a little-endian u32.
pub const BUCKET_MAGIC: u32 = u32::from_le_bytes(*b"RKVB");
pub const LAYOUT_VERSION: u32 = 1;
/// Blocks a table may span: slots hold 32-bit block indexes (16 TiB of 4 KiB blocks). A larger
/// device serves a table on its first 16 TiB.
pub const TABLE_BLOCKS_MAX: u64 = 1 << 32;
/// Probe window of a freshly formatted table, unless the caller picks one: a lookup reads at
/// most this many bucket blocks.
pub const PROBE_BUCKETS_MAX_DEFAULT: u32 = 16;

const _: () = assert!(BUCKET_HEADER_SIZE + SLOTS_PER_BUCKET * SLOT_SIZE == BLOCK_SIZE_BYTES);
const _: () = assert!(16 + KEY_SIZE_MAX_BYTES < SLOT_SIZE);
const _: () = assert!(VALUE_BLOCKS_MAX == 16);
const _: () = assert!(SUPERBLOCK_SIZE <= BLOCK_SIZE_BYTES);

/// One 4 KiB block image.
pub type Block = [u8; BLOCK_SIZE_BYTES];

/// Blocks a value of `value_length_bytes` occupies in the extent area.
pub const fn value_blocks(value_length_bytes: usize) -> usize {
    value_length_bytes.div_ceil(BLOCK_SIZE_BYTES)
}

/// Why a block image is not what the layout says it must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("no key-value table here (superblock magic {found:#018x})")]
    NotFormatted { found: u64 },
    #[error("superblock: {reason}")]
    BadSuperblock { reason: &'static str },
    #[error("bucket {bucket_index}: {reason}")]
    BadBucket {
        bucket_index: u64,
        reason: &'static str,
    },
    #[error("bucket {bucket_index} slot {slot_index}: {reason}")]
    BadSlot {
        bucket_index: u64,
        slot_index: usize,
        reason: &'static str,
    },
}

/// Why a geometry cannot be laid out on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("bucket count is 0")]
    NoBuckets,
    #[error("probe window {probe_buckets_max} is 0 or larger than the {bucket_count} buckets")]
    BadProbeWindow {
        probe_buckets_max: u32,
        bucket_count: u64,
    },
    #[error(
        "{device_blocks} blocks cannot hold a superblock, {bucket_count} buckets and one largest value"
    )]
    DeviceTooSmall {
        device_blocks: u64,
        bucket_count: u64,
    },
}

// ---------------------------------------------------------------------------------------------
// Geometry and superblock.

/// Where everything is, in blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    bucket_count: u64,
    extent_block_count: u64,
    probe_buckets_max: u32,
}

const SUPERBLOCK_SIZE: usize = 48;

impl Geometry {
    /// A table of `bucket_count` buckets on a device of `device_blocks` blocks; every block
    /// after the index is extent area, which must hold at least one largest value.
    pub fn new(
        device_blocks: u64,
        bucket_count: u64,
        probe_buckets_max: u32,
    ) -> Result<Geometry, GeometryError> {
        if bucket_count == 0 {
            return Err(GeometryError::NoBuckets);
        }
        if probe_buckets_max == 0 || u64::from(probe_buckets_max) > bucket_count {
            return Err(GeometryError::BadProbeWindow {
                probe_buckets_max,
                bucket_count,
            });
        }
        let extent_block_count = device_blocks
            .checked_sub(1)
            .and_then(|blocks| blocks.checked_sub(bucket_count))
            .filter(|&blocks| blocks >= VALUE_BLOCKS_MAX as u64)
            .ok_or(GeometryError::DeviceTooSmall {
                device_blocks,
                bucket_count,
            })?;
        // Slots name value blocks with 32 bits: a table covers at most the first 16 TiB.
        let extent_block_count =
            extent_block_count.min((TABLE_BLOCKS_MAX - 1).saturating_sub(bucket_count));
        if extent_block_count < VALUE_BLOCKS_MAX as u64 {
            return Err(GeometryError::DeviceTooSmall {
                device_blocks,
                bucket_count,
            });
        }
        Ok(Geometry {
            bucket_count,
            extent_block_count,
            probe_buckets_max,
        })
    }

    /// A default split of `device_blocks`: one bucket (15 slots) per 64 blocks of device, so
    /// 15 values of about 16 KiB (the paper's db_bench value) fill the extent area as fast as
    /// the index. The probe window is the default, or every bucket of a small table.
    pub fn for_device(device_blocks: u64) -> Result<Geometry, GeometryError> {
        let bucket_count = (device_blocks.min(TABLE_BLOCKS_MAX) / 64).max(1);
        let probe = u32::try_from(bucket_count)
            .unwrap_or(u32::MAX)
            .min(PROBE_BUCKETS_MAX_DEFAULT);
        Geometry::new(device_blocks, bucket_count, probe)
    }

    pub const fn bucket_count(&self) -> u64 {
        self.bucket_count
    }
    pub const fn probe_buckets_max(&self) -> u32 {
        self.probe_buckets_max
    }
    /// Block index of bucket `bucket_index`.
    pub const fn bucket_block(&self, bucket_index: u64) -> u64 {
        assert!(bucket_index < self.bucket_count);
        1 + bucket_index
    }
    /// First block of the extent area.
    pub const fn extent_start_block(&self) -> u64 {
        1 + self.bucket_count
    }
    pub const fn extent_block_count(&self) -> u64 {
        self.extent_block_count
    }
    /// Blocks the whole table occupies.
    pub const fn total_blocks(&self) -> u64 {
        self.extent_start_block() + self.extent_block_count
    }
    /// Keys the index can hold at most (fewer when the probe window fills first).
    pub const fn slot_count(&self) -> u64 {
        self.bucket_count * SLOTS_PER_BUCKET as u64
    }

    /// The buckets a key with `hash` may live in, in probe order.
    pub fn probe_sequence(&self, hash: u64) -> impl Iterator<Item = u64> + use<> {
        let bucket_count = self.bucket_count;
        let home = hash % bucket_count;
        (0..u64::from(self.probe_buckets_max)).map(move |step| (home + step) % bucket_count)
    }

    /// The superblock image. Layout (little-endian): magic u64 @0, version u32 @8, block size
    /// u32 @12, bucket count u64 @16, extent start u64 @24, extent blocks u64 @32, probe window
    /// u32 @40, CRC-32 of bytes 0..44 u32 @44; the rest zero.
    pub fn encode_superblock(&self) -> Block {
        let mut block = [0u8; BLOCK_SIZE_BYTES];
        block[0..8].copy_from_slice(&SUPERBLOCK_MAGIC.to_le_bytes());
        block[8..12].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
        block[12..16].copy_from_slice(&(BLOCK_SIZE_BYTES as u32).to_le_bytes());
        block[16..24].copy_from_slice(&self.bucket_count.to_le_bytes());
        block[24..32].copy_from_slice(&self.extent_start_block().to_le_bytes());
        block[32..40].copy_from_slice(&self.extent_block_count.to_le_bytes());
        block[40..44].copy_from_slice(&self.probe_buckets_max.to_le_bytes());
        let crc = crc32fast::hash(&block[..44]);
        block[44..48].copy_from_slice(&crc.to_le_bytes());
        block
    }

    /// Decodes a superblock and checks it against a device of `device_blocks` blocks.
    pub fn decode_superblock(block: &Block, device_blocks: u64) -> Result<Geometry, LayoutError> {
        let bad = |reason| LayoutError::BadSuperblock { reason };
        let magic = u64_at(block, 0);
        if magic != SUPERBLOCK_MAGIC {
            return Err(LayoutError::NotFormatted { found: magic });
        }
        if crc32fast::hash(&block[..44]) != u32_at(block, 44) {
            return Err(bad("CRC mismatch"));
        }
        if u32_at(block, 8) != LAYOUT_VERSION {
            return Err(bad("unknown layout version"));
        }
        if u32_at(block, 12) as usize != BLOCK_SIZE_BYTES {
            return Err(bad("block size is not 4096"));
        }
        let bucket_count = u64_at(block, 16);
        let geometry = Geometry::new(device_blocks, bucket_count, u32_at(block, 40))
            .map_err(|_| bad("geometry does not fit the device"))?;
        if u64_at(block, 24) != geometry.extent_start_block() {
            return Err(bad("extent area does not follow the index"));
        }
        let extent_block_count = u64_at(block, 32);
        if extent_block_count > geometry.extent_block_count {
            return Err(bad("extent area runs past the device end"));
        }
        if extent_block_count < VALUE_BLOCKS_MAX as u64 {
            return Err(bad("extent area cannot hold one largest value"));
        }
        Ok(Geometry {
            extent_block_count,
            ..geometry
        })
    }
}

fn u32_at(block: &[u8], at: usize) -> u32 {
    let mut bytes = [0u8; 4];
    bytes.copy_from_slice(&block[at..at + 4]);
    u32::from_le_bytes(bytes)
}

fn u64_at(block: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&block[at..at + 8]);
    u64::from_le_bytes(bytes)
}

/// The key's hash: FNV-1a over the bytes, then a SplitMix64 finaliser so the low bits (the
/// bucket) depend on every byte. Fixed forever: it is part of the on-device layout.
pub fn key_hash(key: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in key {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

// ---------------------------------------------------------------------------------------------
// Buckets and slots.

/// A slot's state byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SlotState {
    /// Never used since the bucket was formatted.
    Empty = 0,
    Used = 1,
    /// Deleted; a lookup must probe past it.
    Tombstone = 2,
}

/// Where a value lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ValueLocation {
    /// First block of the extent (absolute device block index, < 2^32); 0 for an empty value.
    pub extent_block: u64,
    pub value_length_bytes: u32,
    /// CRC-32 of the value's bytes, checked on every read, so a value block that was damaged
    /// or never written reads as an error, not as someone else's bytes.
    pub value_crc: u32,
}

impl ValueLocation {
    pub const fn blocks(&self) -> u64 {
        value_blocks(self.value_length_bytes as usize) as u64
    }
}

/// A used slot, borrowed from its bucket image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsedSlot<'a> {
    pub key: &'a [u8],
    pub location: ValueLocation,
}

/// A decoded slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot<'a> {
    Empty,
    Tombstone,
    Used(UsedSlot<'a>),
}

/// One bucket block, checked on decode. Slot layout (272 bytes): state u8 @0, key length u8 @1,
/// reserved u16 @2, value length u32 @4, extent block u32 @8, value CRC-32 u32 @12, key @16
/// (255 bytes), 1 byte pad.
/// Header (16 bytes): magic u32 @0, bucket index u32 @4 (low 32 bits), CRC-32 u32 @8,
/// reserved u32 @12.
#[derive(Clone, PartialEq, Eq)]
pub struct BucketImage {
    bucket_index: u64,
    block: Box<Block>,
}

impl std::fmt::Debug for BucketImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketImage")
            .field("bucket_index", &self.bucket_index)
            .finish_non_exhaustive()
    }
}

impl BucketImage {
    /// An empty bucket.
    pub fn empty(bucket_index: u64) -> BucketImage {
        BucketImage {
            bucket_index,
            block: Box::new([0u8; BLOCK_SIZE_BYTES]),
        }
    }

    /// Checks a block read from bucket `bucket_index`'s place and every slot in it against
    /// `geometry`. An all-zero block is an empty bucket.
    pub fn decode(
        bucket_index: u64,
        block: &Block,
        geometry: &Geometry,
    ) -> Result<BucketImage, LayoutError> {
        let image = BucketImage {
            bucket_index,
            block: Box::new(*block),
        };
        if block.iter().all(|&byte| byte == 0) {
            return Ok(image);
        }
        let bad = |reason| LayoutError::BadBucket {
            bucket_index,
            reason,
        };
        if u32_at(block, 0) != BUCKET_MAGIC {
            return Err(bad("bad magic"));
        }
        if u32_at(block, 4) != bucket_index as u32 {
            return Err(bad("holds another bucket's index"));
        }
        if u32_at(block, 8) != image.crc() {
            return Err(bad("CRC mismatch (torn or damaged write)"));
        }
        if u32_at(block, 12) != 0 {
            return Err(bad("reserved field not zero"));
        }
        for slot_index in 0..SLOTS_PER_BUCKET {
            image.check_slot(slot_index, geometry)?;
        }
        Ok(image)
    }

    fn crc(&self) -> u32 {
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&self.block[..8]);
        hasher.update(&[0u8; 4]);
        hasher.update(&self.block[12..]);
        hasher.finalize()
    }

    /// The block to write: header and CRC filled in.
    pub fn encode(&mut self) -> &Block {
        self.block[0..4].copy_from_slice(&BUCKET_MAGIC.to_le_bytes());
        self.block[4..8].copy_from_slice(&(self.bucket_index as u32).to_le_bytes());
        self.block[12..16].fill(0);
        let crc = self.crc();
        self.block[8..12].copy_from_slice(&crc.to_le_bytes());
        &self.block
    }

    pub const fn bucket_index(&self) -> u64 {
        self.bucket_index
    }

    fn slot_bytes(&self, slot_index: usize) -> &[u8] {
        let at = BUCKET_HEADER_SIZE + slot_index * SLOT_SIZE;
        &self.block[at..at + SLOT_SIZE]
    }

    fn slot_bytes_mut(&mut self, slot_index: usize) -> &mut [u8] {
        let at = BUCKET_HEADER_SIZE + slot_index * SLOT_SIZE;
        &mut self.block[at..at + SLOT_SIZE]
    }

    fn check_slot(&self, slot_index: usize, geometry: &Geometry) -> Result<(), LayoutError> {
        let bad = |reason| LayoutError::BadSlot {
            bucket_index: self.bucket_index,
            slot_index,
            reason,
        };
        let bytes = self.slot_bytes(slot_index);
        let state = bytes[0];
        if state > SlotState::Tombstone as u8 {
            return Err(bad("unknown state"));
        }
        if state != SlotState::Used as u8 {
            return Ok(());
        }
        let key_length = usize::from(bytes[1]);
        if key_length == 0 {
            return Err(bad("empty key"));
        }
        let value_length = u32_at(bytes, 4) as usize;
        if value_length > VALUE_SIZE_MAX_BYTES {
            return Err(bad("value longer than 64 KiB"));
        }
        let extent_block = u64::from(u32_at(bytes, 8));
        let blocks = value_blocks(value_length) as u64;
        let area = geometry.extent_start_block()
            ..geometry.extent_start_block() + geometry.extent_block_count();
        let inside = if blocks == 0 {
            extent_block == 0
        } else {
            area.contains(&extent_block) && extent_block + blocks <= area.end
        };
        if !inside {
            return Err(bad("extent outside the extent area"));
        }
        Ok(())
    }

    /// Slot `slot_index` (< [`SLOTS_PER_BUCKET`]). Only valid on images from
    /// [`decode`](Self::decode) or built by this type, whose slots were checked.
    pub fn slot(&self, slot_index: usize) -> Slot<'_> {
        let bytes = self.slot_bytes(slot_index);
        match bytes[0] {
            0 => Slot::Empty,
            2 => Slot::Tombstone,
            state => {
                assert_eq!(state, SlotState::Used as u8, "unchecked slot");
                let key_length = usize::from(bytes[1]);
                Slot::Used(UsedSlot {
                    key: &bytes[16..16 + key_length],
                    location: ValueLocation {
                        extent_block: u64::from(u32_at(bytes, 8)),
                        value_length_bytes: u32_at(bytes, 4),
                        value_crc: u32_at(bytes, 12),
                    },
                })
            }
        }
    }

    pub fn slots(&self) -> impl Iterator<Item = (usize, Slot<'_>)> {
        (0..SLOTS_PER_BUCKET).map(|slot_index| (slot_index, self.slot(slot_index)))
    }

    /// Whether any slot is Empty (never used): then no key whose probe passed this bucket
    /// was ever placed beyond it.
    pub fn has_empty_slot(&self) -> bool {
        self.slots().any(|(_, slot)| slot == Slot::Empty)
    }

    /// Stores `key` at `location` in slot `slot_index`.
    pub fn set_slot(&mut self, slot_index: usize, key: &[u8], location: ValueLocation) {
        assert!(!key.is_empty() && key.len() <= KEY_SIZE_MAX_BYTES);
        assert!(location.value_length_bytes as usize <= VALUE_SIZE_MAX_BYTES);
        assert_eq!(location.blocks() == 0, location.extent_block == 0);
        let extent_block = u32::try_from(location.extent_block).expect("block index over 32 bits");
        let bytes = self.slot_bytes_mut(slot_index);
        bytes.fill(0);
        bytes[0] = SlotState::Used as u8;
        bytes[1] = key.len() as u8;
        bytes[4..8].copy_from_slice(&location.value_length_bytes.to_le_bytes());
        bytes[8..12].copy_from_slice(&extent_block.to_le_bytes());
        bytes[12..16].copy_from_slice(&location.value_crc.to_le_bytes());
        bytes[16..16 + key.len()].copy_from_slice(key);
    }

    /// Deletes the used slot `slot_index`. It becomes Empty when another slot of the bucket is
    /// still Empty (nothing was ever probed past this bucket, so nothing needs the marker),
    /// a Tombstone otherwise.
    pub fn delete_slot(&mut self, slot_index: usize) -> SlotState {
        assert!(matches!(self.slot(slot_index), Slot::Used(_)));
        let state = if self.has_empty_slot() {
            SlotState::Empty
        } else {
            SlotState::Tombstone
        };
        let bytes = self.slot_bytes_mut(slot_index);
        bytes.fill(0);
        bytes[0] = state as u8;
        state
    }
}

impl BucketImage {
    /// Turns a used slot into a tombstone whatever the rest of the bucket holds (repairs on
    /// open: always safe, since lookups probe past tombstones).
    pub fn retire_slot(&mut self, slot_index: usize) {
        assert!(matches!(self.slot(slot_index), Slot::Used(_)));
        let bytes = self.slot_bytes_mut(slot_index);
        bytes.fill(0);
        bytes[0] = SlotState::Tombstone as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> Geometry {
        Geometry::new(1000, 10, 4).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn geometry_checks_its_arguments() {
        assert_eq!(Geometry::new(1000, 0, 1), Err(GeometryError::NoBuckets));
        assert!(Geometry::new(1000, 10, 11).is_err());
        assert!(Geometry::new(1000, 10, 0).is_err());
        assert!(Geometry::new(26, 10, 1).is_err());
        let tight = Geometry::new(27, 10, 1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(tight.extent_block_count(), 16);
        assert_eq!(tight.total_blocks(), 27);
        let g = geometry();
        assert_eq!(
            (
                g.extent_start_block(),
                g.extent_block_count(),
                g.slot_count()
            ),
            (11, 989, 150)
        );
        assert_eq!(g.probe_sequence(18).collect::<Vec<_>>(), [8, 9, 0, 1]);
        let default = Geometry::for_device(1 << 18).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(default.bucket_count(), 4096);
        assert_eq!(default.probe_buckets_max(), PROBE_BUCKETS_MAX_DEFAULT);
        // A 4 PiB device serves a 16 TiB table (32-bit block indexes in the slots).
        let huge = Geometry::for_device(1 << 40).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(huge.total_blocks(), TABLE_BLOCKS_MAX);
        assert_eq!(huge.bucket_count(), TABLE_BLOCKS_MAX / 64);
    }

    #[test]
    fn superblock_round_trips_and_refuses_damage() {
        let g = geometry();
        let block = g.encode_superblock();
        assert_eq!(Geometry::decode_superblock(&block, 1000), Ok(g));
        // A larger device later still opens the same table.
        assert_eq!(Geometry::decode_superblock(&block, 2000), Ok(g));
        assert!(Geometry::decode_superblock(&block, 999).is_err());
        let zero = [0u8; BLOCK_SIZE_BYTES];
        assert_eq!(
            Geometry::decode_superblock(&zero, 1000),
            Err(LayoutError::NotFormatted { found: 0 })
        );
        let mut damaged = block;
        damaged[17] ^= 1;
        assert!(matches!(
            Geometry::decode_superblock(&damaged, 1000),
            Err(LayoutError::BadSuperblock { .. })
        ));
    }

    #[test]
    fn buckets_round_trip_and_refuse_damage() {
        let g = geometry();
        let mut image = BucketImage::empty(3);
        assert!(image.has_empty_slot());
        let location = ValueLocation {
            extent_block: 11,
            value_length_bytes: 5000,
            value_crc: 0xdead_beef,
        };
        image.set_slot(2, b"key", location);
        let block = *image.encode();
        let decoded = BucketImage::decode(3, &block, &g).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            decoded.slot(2),
            Slot::Used(UsedSlot {
                key: b"key",
                location
            })
        );
        assert_eq!(decoded.slot(0), Slot::Empty);
        // Another bucket's block, a flipped bit, an extent out of the area.
        assert!(BucketImage::decode(4, &block, &g).is_err());
        let mut flipped = block;
        flipped[100] ^= 0x10;
        assert!(BucketImage::decode(3, &flipped, &g).is_err());
        let mut outside = BucketImage::empty(3);
        outside.set_slot(
            0,
            b"k",
            ValueLocation {
                extent_block: 999,
                value_length_bytes: 8192,
                value_crc: 0,
            },
        );
        let block = *outside.encode();
        assert!(matches!(
            BucketImage::decode(3, &block, &g),
            Err(LayoutError::BadSlot { .. })
        ));
        // All zeroes: a never-written bucket.
        let zero = BucketImage::decode(5, &[0u8; BLOCK_SIZE_BYTES], &g);
        assert!(zero.is_ok_and(|image| image.slots().all(|(_, s)| s == Slot::Empty)));
    }

    #[test]
    fn delete_leaves_a_tombstone_only_in_a_full_bucket() {
        let mut image = BucketImage::empty(0);
        let location = ValueLocation {
            extent_block: 0,
            value_length_bytes: 0,
            value_crc: 0,
        };
        image.set_slot(0, b"a", location);
        assert_eq!(image.delete_slot(0), SlotState::Empty);
        for slot_index in 0..SLOTS_PER_BUCKET {
            image.set_slot(slot_index, &[b'k', slot_index as u8], location);
        }
        assert!(!image.has_empty_slot());
        assert_eq!(image.delete_slot(4), SlotState::Tombstone);
        assert_eq!(image.slot(4), Slot::Tombstone);
        assert!(!image.has_empty_slot());
    }

    #[test]
    fn the_hash_is_stable() {
        // Part of the on-device format: these values must never change.
        assert_eq!(key_hash(b""), 0xf52a_15e9_a9b5_e89b);
        assert_eq!(key_hash(b"key"), 0x487e_b6f7_e0ea_7e7c);
        assert_eq!(key_hash(&[0, 0, 0, 1]), 0x6160_0e56_e10f_f2da);
    }
}
