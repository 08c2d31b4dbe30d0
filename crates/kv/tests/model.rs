//! The table against a `HashMap` model: seeded random PUT/GET/DELETE/FLUSH sequences with
//! restarts, on `MemBlocks` and on real `reflex_flash` devices (memory, file, emulated); then
//! collisions, a full index, a full value area, oversize and empty keys and values, failed
//! writes, and damaged blocks. Every failure message names its seed.

use std::collections::HashMap;
use std::sync::Arc;

use rand::{RngExt, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use reflex_flash::Device;
use reflex_flash::file::FileDevice;
use reflex_flash::mem::MemDevice;
use reflex_kv::layout::{BLOCK_SIZE_BYTES, SLOTS_PER_BUCKET, key_hash};
use reflex_kv::{BlockStore, DeviceBlocks, Geometry, KvError, KvStore, MemBlocks};
use reflex_proto::kv::{KEY_SIZE_MAX_BYTES, Status, VALUE_SIZE_MAX_BYTES};

const SEED: u64 = 0x6b76_0000_5eed_0004;

fn geometry(device_blocks: u64, bucket_count: u64, probe: u32) -> Geometry {
    Geometry::new(device_blocks, bucket_count, probe).unwrap_or_else(|e| panic!("{e}"))
}

fn ok<T>(result: Result<T, KvError>, context: &str) -> T {
    result.unwrap_or_else(|e| panic!("{context}: {e}"))
}

/// A value whose bytes say which key and version wrote it.
fn value_for(rng: &mut Xoshiro256PlusPlus, key: &[u8], version: u64, length_max: usize) -> Vec<u8> {
    let length = match rng.random_range(0..10) {
        0 => 0,
        1 => length_max,
        2 => BLOCK_SIZE_BYTES,
        _ => rng.random_range(1..=length_max),
    };
    let seed = key_hash(key) ^ version;
    (0..length)
        .map(|index| (seed.wrapping_add(index as u64 * 0x9e37) >> 7) as u8)
        .collect()
}

/// Checks every key of the model, and a few absent ones, against the table.
fn check_all<B: BlockStore>(
    store: &mut KvStore<B>,
    model: &HashMap<Vec<u8>, Vec<u8>>,
    context: &str,
) {
    assert_eq!(store.len(), model.len() as u64, "{context}");
    for (key, value) in model {
        assert_eq!(
            ok(store.get(key), context).as_deref(),
            Some(&value[..]),
            "{context}: key {key:?}"
        );
    }
    for absent in [&b"absent"[..], b"\xff", &[b'z'; KEY_SIZE_MAX_BYTES]] {
        if !model.contains_key(absent) {
            assert_eq!(ok(store.get(absent), context), None, "{context}");
        }
    }
}

/// Runs `operations` random operations on `store` (keys from a pool of `key_pool`), checking
/// each answer against the model; every `restart_every` operations it flushes, restarts through
/// `reopen`, and checks the whole table. Returns the store, the model and how many PUTs were
/// refused as `TABLE_FULL`.
fn run<B: BlockStore>(
    mut store: KvStore<B>,
    seed: u64,
    operations: usize,
    key_pool: usize,
    value_length_max: usize,
    restart_every: usize,
    reopen: &dyn Fn(KvStore<B>) -> KvStore<B>,
) -> (KvStore<B>, HashMap<Vec<u8>, Vec<u8>>, usize) {
    let mut refused = 0;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    let keys: Vec<Vec<u8>> = (0..key_pool)
        .map(|index| {
            let length = rng.random_range(1..=KEY_SIZE_MAX_BYTES.min(24));
            let mut key = format!("k{index}-").into_bytes();
            key.resize(length.max(key.len()), b'.');
            key
        })
        .collect();
    for step in 0..operations {
        let context = format!("seed {seed:#x} step {step}");
        let key = &keys[rng.random_range(0..keys.len())];
        match rng.random_range(0..10) {
            0..=3 => {
                let value = value_for(&mut rng, key, step as u64, value_length_max);
                match store.put(key, &value) {
                    Ok(()) => {
                        model.insert(key.clone(), value);
                    }
                    Err(error) => {
                        // Only a full table may refuse, and then the key is unchanged.
                        assert_eq!(error.status(), Status::TableFull, "{context}: {error}");
                        refused += 1;
                        assert!(!model.contains_key(key) || !value.is_empty(), "{context}");
                    }
                }
            }
            4..=6 => assert_eq!(
                ok(store.get(key), &context).as_ref(),
                model.get(key),
                "{context}"
            ),
            7..=8 => assert_eq!(
                ok(store.delete(key), &context),
                model.remove(key).is_some(),
                "{context}"
            ),
            _ => ok(store.flush(), &context),
        }
        if (step + 1) % restart_every == 0 {
            ok(store.flush(), &context);
            store = reopen(store);
            check_all(&mut store, &model, &format!("{context} after restart"));
        }
    }
    (store, model, refused)
}

fn reopen_mem(store: KvStore<MemBlocks>) -> KvStore<MemBlocks> {
    ok(KvStore::open(store.into_blocks()), "reopen")
}

#[test]
fn random_sequences_match_a_hashmap_across_restarts() {
    // Few buckets and a small probe window, so collisions, probing, tombstones and
    // TABLE_FULL all happen; several seeds.
    for (round, (bucket_count, probe)) in [(1, 1), (4, 2), (8, 8), (64, 4)].into_iter().enumerate()
    {
        let seed = SEED + round as u64;
        let blocks = MemBlocks::new(1 + bucket_count + 600);
        let store = ok(
            KvStore::format(
                blocks,
                geometry(1 + bucket_count + 600, bucket_count, probe),
            ),
            "format",
        );
        let key_pool = (bucket_count as usize * SLOTS_PER_BUCKET * 3 / 2).max(20);
        let (mut store, model, refused) =
            run(store, seed, 4000, key_pool, 20_000, 500, &reopen_mem);
        check_all(&mut store, &model, &format!("seed {seed:#x} end"));
        // The key pool is half as large again as the slots: the table fills up.
        assert!(refused > 0, "seed {seed:#x}: no PUT was refused");
    }
}

#[test]
fn without_flush_every_answered_write_is_still_there_after_reopen() {
    // MemBlocks applies writes at once, so reopening without a FLUSH must see them all; the
    // deferred frees mean no value block was reused under the on-device index meanwhile.
    let blocks = MemBlocks::new(1 + 16 + 400);
    let store = ok(KvStore::format(blocks, geometry(417, 16, 4)), "format");
    let (store, model, _) = run(
        store,
        SEED ^ 0xabc,
        3000,
        200,
        8000,
        usize::MAX,
        &reopen_mem,
    );
    let mut reopened = ok(KvStore::open(store.into_blocks()), "reopen");
    check_all(&mut reopened, &model, "reopened without flush");
}

#[test]
fn collisions_fill_the_probe_window_then_table_full() {
    // One bucket: 15 keys fit, the 16th is TABLE_FULL and changes nothing; a delete makes room.
    let mut store = ok(
        KvStore::format(MemBlocks::new(100), geometry(100, 1, 1)),
        "format",
    );
    for index in 0..SLOTS_PER_BUCKET {
        ok(store.put(format!("key{index}").as_bytes(), b"v"), "fill");
    }
    let full = store.put(b"one-too-many", b"v");
    assert_eq!(
        full.as_ref().map_err(KvError::status),
        Err(Status::TableFull)
    );
    assert!(matches!(full, Err(KvError::TableFull { probe_buckets: 1 })));
    assert_eq!(ok(store.get(b"one-too-many"), "get"), None);
    // Replacing an existing key needs no new slot.
    ok(store.put(b"key3", b"replaced"), "replace");
    assert!(ok(store.delete(b"key7"), "delete"));
    ok(
        store.put(b"one-too-many", b"now fits"),
        "reuse the tombstone",
    );
    assert_eq!(
        ok(store.get(b"one-too-many"), "get"),
        Some(b"now fits".to_vec())
    );
    assert_eq!(ok(store.get(b"key3"), "get"), Some(b"replaced".to_vec()));
    assert_eq!(ok(store.get(b"key7"), "get"), None);
    assert_eq!(store.len(), SLOTS_PER_BUCKET as u64);

    // Many buckets, keys chosen to share one home bucket: they spill into the following
    // buckets of the probe window, all readable, until the window is full.
    let bucket_count = 16;
    let probe = 3;
    let mut store = ok(
        KvStore::format(MemBlocks::new(400), geometry(400, bucket_count, probe)),
        "format",
    );
    let colliding: Vec<Vec<u8>> = (0u32..)
        .map(|index| format!("c{index}").into_bytes())
        .filter(|key| key_hash(key) % bucket_count == 5)
        .take(SLOTS_PER_BUCKET * probe as usize + 1)
        .collect();
    let (fit, rest) = colliding.split_at(SLOTS_PER_BUCKET * probe as usize);
    for key in fit {
        ok(store.put(key, key), "spill");
    }
    assert!(matches!(
        store.put(&rest[0], b"x"),
        Err(KvError::TableFull { probe_buckets: 3 })
    ));
    for key in fit {
        assert_eq!(ok(store.get(key), "get").as_deref(), Some(&key[..]));
    }
    // Deleting from the home bucket leaves a tombstone, keys further on stay reachable, and
    // after a restart too.
    assert!(ok(store.delete(&fit[0]), "delete"));
    ok(store.flush(), "flush");
    let mut store = reopen_mem(store);
    for key in &fit[1..] {
        assert_eq!(ok(store.get(key), "get").as_deref(), Some(&key[..]));
    }
    ok(store.put(&rest[0], b"x"), "fits in the tombstone");
    // A key homed elsewhere is unaffected by the crowd.
    ok(store.put(b"elsewhere", b"y"), "other bucket");
}

#[test]
fn a_full_value_area_is_table_full_and_a_flush_makes_room() {
    // 40 value blocks: two 64 KiB values (16 blocks each) fit, a third does not.
    let mut store = ok(
        KvStore::format(MemBlocks::new(1 + 2 + 40), geometry(43, 2, 2)),
        "format",
    );
    let big = vec![7u8; VALUE_SIZE_MAX_BYTES];
    ok(store.put(b"a", &big), "a");
    ok(store.put(b"b", &big), "b");
    let full = store.put(b"c", &big);
    assert!(matches!(full, Err(KvError::NoSpace { blocks: 16 })));
    assert_eq!(full.map_err(|e| e.status()), Err(Status::TableFull));
    assert_eq!(ok(store.get(b"c"), "get"), None);
    // Small values still fit in what is left.
    ok(store.put(b"small", &[1u8; 100]), "small");
    // Replacing `a` needs 16 new blocks while `a`'s old ones wait for a FLUSH: the table
    // flushes by itself and retries rather than answer TABLE_FULL.
    assert!(ok(store.delete(b"b"), "delete"));
    ok(
        store.put(b"a", &vec![8u8; VALUE_SIZE_MAX_BYTES]),
        "replace a",
    );
    ok(store.put(b"c", &big), "c after the implicit flush");
    assert_eq!(store.used_value_blocks(), 33);
    let mut store = reopen_mem(store);
    assert_eq!(
        ok(store.get(b"a"), "a"),
        Some(vec![8u8; VALUE_SIZE_MAX_BYTES])
    );
    assert_eq!(ok(store.get(b"c"), "c"), Some(big));
    assert_eq!(store.used_value_blocks(), 33);
}

#[test]
fn bad_keys_and_values_are_refused_with_their_status() {
    let mut store = ok(
        KvStore::format(MemBlocks::new(100), geometry(100, 4, 4)),
        "format",
    );
    let long_key = [b'k'; KEY_SIZE_MAX_BYTES + 1];
    let cases: [(Result<(), KvError>, Status); 6] = [
        (store.put(&long_key, b"v"), Status::TooLarge),
        (
            store.put(b"k", &vec![0u8; VALUE_SIZE_MAX_BYTES + 1]),
            Status::TooLarge,
        ),
        (store.put(b"", b"v"), Status::Invalid),
        (store.get(&long_key).map(|_| ()), Status::TooLarge),
        (store.delete(b"").map(|_| ()), Status::Invalid),
        (store.get(b"").map(|_| ()), Status::Invalid),
    ];
    for (index, (result, status)) in cases.into_iter().enumerate() {
        assert_eq!(result.map_err(|e| e.status()), Err(status), "case {index}");
    }
    assert!(store.is_empty());
    // The limits themselves are fine.
    ok(
        store.put(
            &long_key[..KEY_SIZE_MAX_BYTES],
            &vec![3u8; VALUE_SIZE_MAX_BYTES],
        ),
        "max",
    );
    ok(store.put(b"empty value", b""), "empty value");
    assert!(!ok(store.delete(b"never stored"), "delete absent"));
    assert_eq!(ok(store.get(b"empty value"), "get"), Some(Vec::new()));
    // Values are written with forced unit access before the bucket that names them; an empty
    // value writes none.
    assert_eq!(store.into_blocks().fua_write_count, 1);
}

#[test]
fn failed_writes_change_nothing_that_was_answered() {
    let mut blocks = MemBlocks::new(200);
    blocks.fail_writes_after = None;
    let mut store = ok(KvStore::format(blocks, geometry(200, 4, 4)), "format");
    ok(store.put(b"stable", b"before"), "put");
    ok(store.flush(), "flush");
    let mut blocks = store.into_blocks();
    // The value write fails: nothing changes, the extent is not leaked.
    blocks.fail_writes_after = Some(blocks.write_count);
    let mut store = ok(KvStore::open(blocks), "open");
    let used = store.used_value_blocks();
    let error = store.put(b"stable", b"after").map_err(|e| e.status());
    assert_eq!(error, Err(Status::IoError));
    assert_eq!(store.used_value_blocks(), used);
    assert_eq!(ok(store.get(b"stable"), "get"), Some(b"before".to_vec()));
    // The value write succeeds, the bucket write fails: the old value is still what the
    // index names, and the new extent stays allocated (a leak, not a double use).
    let mut blocks = store.into_blocks();
    blocks.fail_writes_after = Some(blocks.write_count + 1);
    let mut store = ok(KvStore::open(blocks), "open");
    assert_eq!(
        store.put(b"stable", b"after").map_err(|e| e.status()),
        Err(Status::IoError)
    );
    assert_eq!(ok(store.get(b"stable"), "get"), Some(b"before".to_vec()));
    assert_eq!(store.used_value_blocks(), used + 1);
    // Reopening rebuilds the allocator from the index: the leak is gone.
    let mut blocks = store.into_blocks();
    blocks.fail_writes_after = None;
    let store = ok(KvStore::open(blocks), "open");
    assert_eq!(store.used_value_blocks(), used);
}

#[test]
fn damaged_blocks_are_reported_not_trusted() {
    let mut store = ok(
        KvStore::format(MemBlocks::new(100), geometry(100, 4, 4)),
        "format",
    );
    for index in 0..20u32 {
        ok(store.put(&index.to_le_bytes(), b"value"), "put");
    }
    ok(store.flush(), "flush");
    let clean = store.into_blocks();

    let mut blocks = clean.clone();
    blocks.block_mut(2)[300] ^= 0x40;
    let error = KvStore::open(blocks).map(|_| ()).map_err(|e| e.status());
    assert_eq!(error, Err(Status::IoError));

    let mut blocks = clean.clone();
    blocks.block_mut(0)[20] ^= 1;
    assert!(matches!(KvStore::open(blocks), Err(KvError::Corrupt(_))));

    let blocks = MemBlocks::new(100);
    assert!(matches!(KvStore::open(blocks), Err(KvError::Corrupt(_))));

    // A damaged value block is an error on GET, never someone else's bytes; the rest of the
    // table still answers.
    let store = ok(KvStore::open(clean.clone()), "open");
    let value_blocks_start = store.geometry().extent_start_block();
    let mut blocks = store.into_blocks();
    for block_index in value_blocks_start..value_blocks_start + 20 {
        blocks.block_mut(block_index)[0] ^= 0xff;
    }
    let mut store = ok(KvStore::open(blocks), "open");
    let error = store.get(&3u32.to_le_bytes()).map_err(|e| e.status());
    assert_eq!(error, Err(Status::IoError));
    assert!(matches!(
        store.get(&4u32.to_le_bytes()),
        Err(KvError::ValueChecksum { .. })
    ));
    ok(store.put(&4u32.to_le_bytes(), b"rewritten"), "rewrite");
    assert_eq!(
        ok(store.get(&4u32.to_le_bytes()), "get"),
        Some(b"rewritten".to_vec())
    );

    // A device too small for the geometry is refused before anything is written.
    let blocks = MemBlocks::new(10);
    assert!(matches!(
        KvStore::format(blocks, geometry(100, 4, 4)),
        Err(KvError::Geometry(_))
    ));
}

// ---------------------------------------------------------------------------------------------
// Real devices through DeviceBlocks.

fn device_blocks(device: Arc<dyn Device>) -> DeviceBlocks {
    DeviceBlocks::new(device).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_mem_device_matches_the_model() {
    let device: Arc<dyn Device> =
        Arc::new(MemDevice::new(4 << 20).unwrap_or_else(|e| panic!("{e}")));
    let blocks = device_blocks(Arc::clone(&device));
    let geometry = ok(
        Geometry::for_device(blocks.block_count()).map_err(KvError::from),
        "geometry",
    );
    let store = ok(KvStore::format(blocks, geometry), "format");
    let reopen = |store: KvStore<DeviceBlocks>| {
        let device = Arc::clone(store.into_blocks().device());
        ok(KvStore::open(device_blocks(device)), "reopen")
    };
    let (mut store, model, _) = run(store, SEED ^ 1, 2000, 300, 16 << 10, 400, &reopen);
    check_all(&mut store, &model, "mem end");
}

#[test]
fn a_file_device_keeps_every_flushed_key_across_a_restart() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let path = dir.path().join("kv-namespace");
    let open_device = |size: Option<u64>| -> Arc<dyn Device> {
        Arc::new(FileDevice::open(&path, size, false).unwrap_or_else(|e| panic!("{e}")))
    };
    let blocks = device_blocks(open_device(Some(8 << 20)));
    let geometry = ok(
        Geometry::for_device(blocks.block_count()).map_err(KvError::from),
        "geometry",
    );
    let store = ok(KvStore::format(blocks, geometry), "format");
    // Each restart closes the file (the store, its queue and the device are dropped) and opens
    // it again from the path, as a restarted server would.
    let reopen = |store: KvStore<DeviceBlocks>| {
        drop(store);
        ok(KvStore::open(device_blocks(open_device(None))), "reopen")
    };
    let (store, model, _) = run(store, SEED ^ 2, 1500, 200, 20_000, 300, &reopen);
    let mut store = reopen({
        let mut store = store;
        ok(store.flush(), "final flush");
        store
    });
    check_all(&mut store, &model, "file after the last restart");
    assert_eq!(*store.geometry(), geometry);
}

#[test]
fn an_emulated_device_completes_in_virtual_time() {
    let device = reflex_flash::emu::realtime::open("emu:device-a-small", 4 << 20)
        .unwrap_or_else(|e| panic!("{e}"));
    let blocks = device_blocks(device);
    let geometry = ok(
        Geometry::for_device(blocks.block_count()).map_err(KvError::from),
        "geometry",
    );
    let store = ok(KvStore::format(blocks, geometry), "format");
    let reopen = |store: KvStore<DeviceBlocks>| {
        let device = Arc::clone(store.into_blocks().device());
        ok(KvStore::open(device_blocks(device)), "reopen")
    };
    let (mut store, model, _) = run(store, SEED ^ 3, 600, 100, 16 << 10, 200, &reopen);
    check_all(&mut store, &model, "emu end");
}
