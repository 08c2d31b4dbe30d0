//! Many operations in progress at once, their block I/O done in a seeded random order (as a
//! server with several connections and a device that completes out of order would), checked
//! against a `HashMap` model applied in arrival order: the bucket gate makes every execution
//! equivalent to that order. Then the table is reopened and compared with the model. Failure
//! messages name the seed.

use std::collections::HashMap;

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use reflex_kv::layout::{BLOCK_SIZE_BYTES, Block};
use reflex_kv::{
    BlockIo, BlockStore, Buffer, Buffers, Geometry, KvOp, KvStore, KvTable, MemBlocks, OpKind,
    Poll, Reply,
};
use reflex_proto::kv::VALUE_SIZE_MAX_BYTES;

const SEED: u64 = 0x6b76_0000_5eed_0014;
const IN_FLIGHT_MAX: usize = 12;
const KEYS: u64 = 24;

/// One operation in progress with its own buffers, as a dataplane request slot has.
struct Active {
    op: KvOp,
    bucket: Box<Block>,
    value: Vec<u8>,
    pending: Option<BlockIo>,
    expected: Result<Reply, ()>,
    expected_value: Option<Vec<u8>>,
    label: String,
}

fn do_io(
    blocks: &mut MemBlocks,
    active: &mut Active,
    io: BlockIo,
) -> Result<(), reflex_flash::FlashError> {
    match io {
        BlockIo::Read {
            block_index, into, ..
        } => {
            let buffer = match into {
                Buffer::Bucket => &mut active.bucket[..],
                Buffer::Value => &mut active.value[..io.length_bytes()],
            };
            blocks.read_blocks(block_index, buffer)
        }
        BlockIo::Write {
            block_index,
            from,
            fua,
            ..
        } => {
            let buffer = match from {
                Buffer::Bucket => &active.bucket[..],
                Buffer::Value => &active.value[..io.length_bytes()],
            };
            blocks.write_blocks(block_index, buffer, fua)
        }
        BlockIo::Flush => blocks.flush(),
    }
}

fn run(seed: u64, operations: usize) {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    // Few buckets and a short window, so many keys share buckets and windows overlap.
    let geometry = Geometry::new(4096, 16, 4).unwrap_or_else(|e| panic!("{e}"));
    let store =
        KvStore::format(MemBlocks::new(4096), geometry).unwrap_or_else(|e| panic!("format: {e}"));
    let (mut blocks, mut table): (MemBlocks, KvTable) = store.into_parts();
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    let mut active: Vec<Active> = Vec::new();
    let mut started = 0;
    let mut waits = 0u64;
    while started < operations || !active.is_empty() {
        if started < operations && active.len() < IN_FLIGHT_MAX && rng.random_range(0..3) == 0 {
            let key = format!("key-{}", rng.random_range(0..KEYS)).into_bytes();
            let mut value_area = vec![0u8; VALUE_SIZE_MAX_BYTES];
            let (kind, expected, expected_value) = match rng.random_range(0..10) {
                0..=3 => {
                    let length = rng.random_range(0..=3 * BLOCK_SIZE_BYTES);
                    let value: Vec<u8> = (0..length).map(|_| rng.random()).collect();
                    value_area[..length].copy_from_slice(&value);
                    model.insert(key.clone(), value);
                    let kind = OpKind::Put {
                        value_length_bytes: length as u32,
                    };
                    (kind, Ok(Reply::Stored), None)
                }
                4..=6 => match model.get(&key) {
                    Some(value) => (
                        OpKind::Get,
                        Ok(Reply::Value {
                            length_bytes: value.len() as u32,
                        }),
                        Some(value.clone()),
                    ),
                    None => (OpKind::Get, Ok(Reply::NotFound), None),
                },
                7..=8 => {
                    let reply = match model.remove(&key) {
                        Some(_) => Reply::Deleted,
                        None => Reply::NotFound,
                    };
                    (OpKind::Delete, Ok(reply), None)
                }
                _ => (OpKind::Flush, Ok(Reply::Flushed), None),
            };
            let key = if kind == OpKind::Flush {
                Vec::new()
            } else {
                key
            };
            let op = KvOp::new(kind, &key).unwrap_or_else(|e| panic!("seed {seed:#x}: {e}"));
            active.push(Active {
                op,
                bucket: Box::new([0u8; BLOCK_SIZE_BYTES]),
                value: value_area,
                pending: None,
                expected,
                expected_value,
                label: format!(
                    "operation {started} {kind:?} {}",
                    String::from_utf8_lossy(&key)
                ),
            });
            started += 1;
            // Its first poll is its arrival: it takes its place at the gate in this order,
            // as a server polls a request as soon as it is decoded.
            let last = active.len() - 1;
            step(seed, &mut table, &mut blocks, &mut active, last, &mut waits);
            continue;
        }
        if active.is_empty() {
            continue;
        }
        let pick = rng.random_range(0..active.len());
        step(seed, &mut table, &mut blocks, &mut active, pick, &mut waits);
    }
    assert!(
        waits > 0,
        "seed {seed:#x}: no operation ever waited at the gate"
    );
    assert_eq!(
        table.operations_listed(),
        0,
        "seed {seed:#x}: gate entries left"
    );
    assert_eq!(table.len(), model.len() as u64, "seed {seed:#x}: key count");
    blocks.flush().unwrap_or_else(|e| panic!("{e}"));
    let mut reopened =
        KvStore::open(blocks).unwrap_or_else(|e| panic!("seed {seed:#x}: reopen: {e}"));
    assert_eq!(reopened.len(), model.len() as u64, "seed {seed:#x}");
    for index in 0..KEYS {
        let key = format!("key-{index}").into_bytes();
        let found = reopened
            .get(&key)
            .unwrap_or_else(|e| panic!("seed {seed:#x}: get after reopen: {e}"));
        assert_eq!(
            found.as_ref(),
            model.get(&key),
            "seed {seed:#x}: key-{index}"
        );
    }
}

/// One move of operation `pick`: its pending I/O is done and completed, or it is polled (and
/// checked and removed when it answers).
fn step(
    seed: u64,
    table: &mut KvTable,
    blocks: &mut MemBlocks,
    active: &mut Vec<Active>,
    pick: usize,
    waits: &mut u64,
) {
    {
        let entry = &mut active[pick];
        if let Some(io) = entry.pending.take() {
            let result = do_io(blocks, entry, io);
            let buffers = Buffers {
                bucket: &mut entry.bucket,
                value: &mut entry.value,
            };
            entry.op.complete(table, buffers, result);
            return;
        }
        let buffers = Buffers {
            bucket: &mut entry.bucket,
            value: &mut entry.value,
        };
        match entry.op.poll(table, buffers) {
            Poll::Io(io) => entry.pending = Some(io),
            Poll::Wait => *waits += 1,
            Poll::Done(result) => {
                let entry = active.swap_remove(pick);
                let result = result.map_err(|e| panic!("seed {seed:#x}: {}: {e}", entry.label));
                assert_eq!(result, entry.expected, "seed {seed:#x}: {}", entry.label);
                if let (Ok(Reply::Value { length_bytes }), Some(value)) =
                    (result, &entry.expected_value)
                {
                    assert_eq!(
                        &entry.value[..length_bytes as usize],
                        &value[..],
                        "seed {seed:#x}: {}",
                        entry.label
                    );
                }
            }
        }
    }
}

#[test]
fn interleaved_operations_behave_as_in_arrival_order() {
    for round in 0..20 {
        run(SEED + round, 600);
    }
}
