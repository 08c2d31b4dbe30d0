//! A hash key-value table over a block namespace (issue 14 item 4; the OctoFAS paper's
//! hash-based engine): keys of 1 ..= 255 bytes, values of up to 64 KiB, PUT, GET, DELETE and
//! FLUSH, an index that survives a restart after FLUSH. The wire protocol is
//! `reflex_proto::kv`; `docs/KV.md` describes both and says what is not built yet.
//!
//! Layers, from pure to I/O:
//! - [`layout`]: the on-device format as pure functions over 4 KiB block images (superblock,
//!   bucket blocks of 15 fixed-size slots, the key hash, the probe sequence);
//! - [`alloc`]: the in-memory extent allocator for values, rebuilt from the index on open, with
//!   frees deferred to the next FLUSH;
//! - [`table`]: [`KvTable`], the state every operation of an open table shares (geometry,
//!   allocator, key count) and the bucket gate that orders operations over overlapping probe
//!   windows;
//! - [`op`]: [`KvOp`], one PUT, GET, DELETE or FLUSH as a sans-IO step machine (which block
//!   I/O next, given its result, until the answer): open addressing with linear probing over
//!   whole bucket blocks, a bounded probe window, tombstones, `TABLE_FULL` when the window or
//!   the value area is full;
//! - [`store`]: [`KvStore`], which formats and opens tables and runs each operation's machine
//!   to completion over any [`BlockStore`], synchronously;
//! - [`serve`]: [`serve::answer`], one decoded `reflex_proto::kv::Request` to its response;
//! - [`device`]: [`DeviceBlocks`], a synchronous [`BlockStore`] over a `reflex_flash` device
//!   (the only module with `unsafe`: one call, documented there).
//!
//! Architecture invariant: nothing here reads a clock or starts a thread (only
//! [`DeviceBlocks`] sleeps, bounded, while a file device's pool works); the table never panics
//! on what it reads from the device (a damaged block is a typed error).
#![deny(unsafe_code)]

pub mod alloc;
// The ring-less device queue's contract (`Device::queue_without_ring`).
#[allow(unsafe_code)]
pub mod device;
pub mod layout;
pub mod op;
pub mod serve;
pub mod store;
pub mod table;

pub use device::DeviceBlocks;
pub use layout::Geometry;
pub use op::{BlockIo, Buffer, Buffers, KvOp, OpKind, Poll, Reply};
pub use store::{BlockStore, KvError, KvStore, MemBlocks};
pub use table::KvTable;
