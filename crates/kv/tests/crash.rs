//! Crashes between FLUSHes: a block store with a volatile write cache (writes without FUA
//! reach the durable image only on FLUSH, or, at a crash, in any subset), random operations,
//! crashes at random points, reopen. After each crash every key must read as a value it had
//! since the last FLUSH (absent included, if it was absent at some point since), `open` must
//! succeed, and from then on the table must behave exactly like the model rebuilt from what
//! was read: nothing lost later, nothing resurrected.

use std::collections::HashMap;

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use reflex_flash::FlashError;
use reflex_kv::layout::BLOCK_SIZE_BYTES;
use reflex_kv::{BlockStore, Geometry, KvError, KvStore};
use reflex_proto::kv::Status;

const SEED: u64 = 0xc4a5_0000_0014_0004;

/// A device with a volatile write cache of whole 4 KiB blocks.
struct CrashBlocks {
    /// What reads see.
    current: Vec<u8>,
    /// What survives a crash for certain.
    durable: Vec<u8>,
    /// Block writes since the last FLUSH that did not use FUA, oldest first.
    pending: Vec<(u64, Vec<u8>)>,
    flush_count: u64,
}

impl CrashBlocks {
    fn new(block_count: u64) -> CrashBlocks {
        let bytes = vec![0u8; block_count as usize * BLOCK_SIZE_BYTES];
        CrashBlocks {
            current: bytes.clone(),
            durable: bytes,
            pending: Vec::new(),
            flush_count: 0,
        }
    }

    /// Power loss: the durable image plus a random subset of the pending writes (in order, so
    /// a block ends up as one of its written versions or its durable one).
    fn crash(self, rng: &mut Xoshiro256PlusPlus) -> CrashBlocks {
        let mut image = self.durable;
        for (block_index, data) in &self.pending {
            if rng.random_bool(0.5) {
                let at = *block_index as usize * BLOCK_SIZE_BYTES;
                image[at..at + BLOCK_SIZE_BYTES].copy_from_slice(data);
            }
        }
        CrashBlocks {
            current: image.clone(),
            durable: image,
            pending: Vec::new(),
            flush_count: self.flush_count,
        }
    }
}

impl BlockStore for CrashBlocks {
    fn block_count(&self) -> u64 {
        (self.current.len() / BLOCK_SIZE_BYTES) as u64
    }

    fn read_blocks(&mut self, block_index: u64, buf: &mut [u8]) -> Result<(), FlashError> {
        let at = block_index as usize * BLOCK_SIZE_BYTES;
        buf.copy_from_slice(&self.current[at..at + buf.len()]);
        Ok(())
    }

    fn write_blocks(&mut self, block_index: u64, buf: &[u8], fua: bool) -> Result<(), FlashError> {
        let at = block_index as usize * BLOCK_SIZE_BYTES;
        self.current[at..at + buf.len()].copy_from_slice(buf);
        for (index, block) in buf.chunks_exact(BLOCK_SIZE_BYTES).enumerate() {
            let block_index = block_index + index as u64;
            if fua {
                // Durable now; older cached writes of the block are superseded.
                self.pending.retain(|(pending, _)| *pending != block_index);
                let at = block_index as usize * BLOCK_SIZE_BYTES;
                self.durable[at..at + BLOCK_SIZE_BYTES].copy_from_slice(block);
            } else {
                self.pending.push((block_index, block.to_vec()));
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), FlashError> {
        self.durable.copy_from_slice(&self.current);
        self.pending.clear();
        self.flush_count += 1;
        Ok(())
    }
}

fn ok<T>(result: Result<T, KvError>, context: &str) -> T {
    result.unwrap_or_else(|e| panic!("{context}: {e}"))
}

type Value = Option<Vec<u8>>;

#[test]
fn every_key_survives_a_crash_as_a_value_it_had_since_the_last_flush() {
    let mut repaired = 0;
    for round in 0..12u64 {
        let seed = SEED + round;
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        // Eight buckets of 15 slots and 150 keys: probing, tombstones and TABLE_FULL happen.
        let bucket_count = 8;
        let device_blocks = 1 + bucket_count + 500;
        let geometry =
            Geometry::new(device_blocks, bucket_count, 8).unwrap_or_else(|e| panic!("{e}"));
        let mut store = ok(
            KvStore::format(CrashBlocks::new(device_blocks), geometry),
            "format",
        );
        let keys: Vec<Vec<u8>> = (0..150).map(|i| format!("key-{i}").into_bytes()).collect();
        let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
        // Per key touched since the last FLUSH: every state it had since then.
        let mut allowed: HashMap<Vec<u8>, Vec<Value>> = HashMap::new();
        for step in 0..3000u64 {
            let context = format!("seed {seed:#x} step {step}");
            let key = keys[rng.random_range(0..keys.len())].clone();
            let flushes_before = store.blocks().flush_count;
            let before: Value = model.get(&key).cloned();
            // FLUSH is rare (1 in 100), so crashes find long runs of cached bucket writes.
            let after: Value = match rng.random_range(0..100) {
                0..=44 => {
                    let length = rng.random_range(0..9000);
                    let value: Vec<u8> = (0..length).map(|i| (i as u64 ^ step) as u8).collect();
                    match store.put(&key, &value) {
                        Ok(()) => Some(value),
                        Err(error) => {
                            assert_eq!(error.status(), Status::TableFull, "{context}");
                            before.clone()
                        }
                    }
                }
                45..=69 => {
                    assert_eq!(
                        ok(store.delete(&key), &context),
                        before.is_some(),
                        "{context}"
                    );
                    None
                }
                70..=98 => {
                    assert_eq!(ok(store.get(&key), &context), before, "{context}");
                    before.clone()
                }
                _ => {
                    ok(store.flush(), &context);
                    before.clone()
                }
            };
            if store.blocks().flush_count != flushes_before {
                // A FLUSH (asked for, or one a PUT made to reuse freed blocks) happened before
                // this operation's own writes.
                allowed.clear();
            }
            allowed
                .entry(key.clone())
                .or_insert_with(|| vec![before.clone()])
                .push(after.clone());
            match after {
                Some(value) => model.insert(key, value),
                None => model.remove(&key),
            };

            if rng.random_range(0..100) == 0 {
                let blocks = store.into_blocks().crash(&mut rng);
                store = ok(
                    KvStore::open(blocks),
                    &format!("{context}: open after crash"),
                );
                repaired += store.repaired_slot_count();
                // What survived is what the model is from now on.
                for key in &keys {
                    let got = ok(store.get(key), &context);
                    let states = allowed
                        .get(key)
                        .cloned()
                        .unwrap_or_else(|| vec![model.get(key).cloned()]);
                    assert!(
                        states.contains(&got),
                        "{context}: key {:?} read {:?} bytes after the crash, allowed {:?}",
                        String::from_utf8_lossy(key),
                        got.as_ref().map(Vec::len),
                        states
                            .iter()
                            .map(|s| s.as_ref().map(Vec::len))
                            .collect::<Vec<_>>()
                    );
                    match got {
                        Some(value) => model.insert(key.clone(), value),
                        None => model.remove(key),
                    };
                }
                assert_eq!(store.len(), model.len() as u64, "{context}");
                allowed.clear();
            }
        }
        // A clean reopen after a FLUSH sees exactly the model and repairs nothing.
        ok(store.flush(), "flush");
        let mut store = ok(KvStore::open(store.into_blocks()), "reopen");
        assert_eq!(store.repaired_slot_count(), 0);
        for key in &keys {
            assert_eq!(
                ok(store.get(key), "final").as_ref(),
                model.get(key),
                "seed {seed:#x}"
            );
        }
    }
    // Across the seeds, crashes left stale slots that `open` repaired.
    assert!(
        repaired > 0,
        "no crash needed a repair: the test lost its teeth"
    );
}
