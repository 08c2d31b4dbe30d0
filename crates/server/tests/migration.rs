//! Inter-core migration on a real reflexd over loopback (`docs/FAIRNESS.md`): two dataplane
//! threads, one connection pipelining many reads and one reading little, so whichever way the
//! kernel places them one thread carries more load and sends reads to the other through the
//! bounded queues between threads; every answer is checked for identity (each request answered
//! once, none lost) and content (the bytes the blocks hold, a rewritten block's new bytes once
//! its write was answered).

mod admin_common;
mod checked;
mod common;

use checked::{BLOCK, Connection, NAMESPACE, WINDOW, block_bytes, pattern};
use common::{config, namespace, start};
use reflex_qos::{FairMode, FairQueueConfig, FairnessConfig, MigrationConfig, MigrationFlows};

const SHARED_BLOCKS: u64 = 256;
const OWNED_BLOCKS: u64 = 16;

#[test]
fn reads_migrate_between_two_threads_and_every_answer_is_right_once() {
    let mut server_config = config(vec![namespace(
        NAMESPACE,
        "fault(delay=300us):mem:16M",
        None,
    )]);
    server_config.qos_config.fairness = FairQueueConfig {
        mode: FairMode::Fifo,
        be_device_depth_max: 2,
        monitor: FairnessConfig {
            window_us: 5_000,
            samples_min: 1,
            ..FairnessConfig::default()
        },
        migration: MigrationConfig {
            enabled: true,
            flows: MigrationFlows::All,
            requires_imbalance: false,
            in_transit_per_pair_max: 4,
            ..MigrationConfig::default()
        },
        ..FairQueueConfig::default()
    };
    server_config.admin = reflex_server::admin::AdminConfig {
        stats_window: std::time::Duration::from_millis(100),
        ..reflex_server::admin::AdminConfig::loopback()
    };
    let server = start(server_config);
    let addr = server.native_addr();
    let api = admin_common::Api::new(
        server
            .admin_addr()
            .unwrap_or_else(|| panic!("no admin listener")),
    );

    let mut light = Connection::connect(addr);
    let mut heavy = Connection::connect(addr);
    // The initial content, in batches of the window.
    let total_blocks = SHARED_BLOCKS + OWNED_BLOCKS;
    for first in (0..total_blocks).step_by(WINDOW) {
        for block in first..(first + WINDOW as u64).min(total_blocks) {
            light.write(block, block, 0);
        }
        light.transmit();
        light.drain();
    }
    light.writes_done.clear();

    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = |bound: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % bound
    };
    let shared_read = |next: &mut dyn FnMut(u64) -> u64| {
        let blocks = 1 + next(4);
        let offset = next(SHARED_BLOCKS * 8 - blocks * 8) * 512;
        let expected: Vec<u8> = (0..blocks as usize * BLOCK)
            .map(|i| {
                let at = offset as usize + i;
                pattern((at / BLOCK) as u64, 0, at % BLOCK)
            })
            .collect();
        (offset, expected)
    };
    let mut next_id = 1u64 << 32;
    let heavy_reads = 3_000u64;
    let mut versions = vec![0u32; OWNED_BLOCKS as usize];
    for round in 0..heavy_reads {
        // The heavy connection keeps its window nearly full.
        while heavy.outstanding.len() < WINDOW - 2 {
            let (offset, expected) = shared_read(&mut next);
            heavy.read(next_id, offset, expected);
            next_id += 1;
        }
        heavy.transmit();
        heavy.receive();
        // The light one, every 20th round: rewrites one of its blocks, waits for the answer,
        // reads it back (it must see the new bytes wherever the read is served) and reads a
        // shared range.
        if round % 20 == 0 {
            let slot = next(OWNED_BLOCKS);
            let block = SHARED_BLOCKS + slot;
            versions[slot as usize] += 1;
            let version = versions[slot as usize];
            light.write(next_id, block, version);
            next_id += 1;
            light.transmit();
            light.drain();
            light.read(next_id, block * BLOCK as u64, block_bytes(block, version));
            next_id += 1;
            let (offset, expected) = shared_read(&mut next);
            light.read(next_id, offset, expected);
            next_id += 1;
            light.transmit();
            light.drain();
        }
    }
    heavy.drain();
    light.drain();
    assert!(heavy.answered >= heavy_reads);
    drop(heavy);
    drop(light);
    // Every read answered, so the counters are final: the admin API and the metrics show
    // what the threads report at exit once they have published.
    let sum = |view: &serde_json::Value, key: &str| -> u64 {
        view["migration"].as_array().map_or(0, |threads| {
            threads.iter().filter_map(|t| t[key].as_u64()).sum()
        })
    };
    let view = api.wait_for("/v1/fairness", |view| {
        // Snapshots that predate the last answers can agree too: wait for the idle stage.
        let idle = view["namespaces"].as_array().is_some_and(|namespaces| {
            namespaces
                .iter()
                .all(|n| n["held"] == 0 && n["device_in_flight"] == 0)
        });
        idle && view["migration"].as_array().map(Vec::len) == Some(2)
            && sum(view, "sent") > 0
            && sum(view, "sent") == sum(view, "served")
    });
    let metrics = api.get("/metrics").text;
    let stats = server.shutdown().unwrap_or_else(|e| panic!("{e}"));
    for thread in view["migration"].as_array().into_iter().flatten() {
        let index = thread["thread"].as_u64().unwrap_or(u64::MAX) as usize;
        let exit = &stats[index];
        assert_eq!(thread["sent"].as_u64(), Some(exit.migrated_sent), "{view}");
        assert_eq!(
            thread["served"].as_u64(),
            Some(exit.migrated_served),
            "{view}"
        );
        assert_eq!(
            thread["refused"].as_u64(),
            Some(exit.migrated_refused),
            "{view}"
        );
        for (outcome, count) in [
            ("sent", exit.migrated_sent),
            ("served", exit.migrated_served),
            ("refused", exit.migrated_refused),
        ] {
            let series = format!(
                "reflex_migration_reads_total{{thread=\"{index}\",outcome=\"{outcome}\"}} {count}.0\n"
            );
            assert!(metrics.contains(&series), "{series} missing:\n{metrics}");
        }
    }
    admin_common::promtool_accepts(&metrics);
    let sent: u64 = stats.iter().map(|s| s.migrated_sent).sum();
    let served: u64 = stats.iter().map(|s| s.migrated_served).sum();
    let report: Vec<_> = stats
        .iter()
        .map(|s| (s.migrated_sent, s.migrated_served, s.migrated_refused))
        .collect();
    eprintln!("per thread (sent, served, refused): {report:?}");
    assert!(sent > 100, "per thread (sent, served, refused): {report:?}");
    assert_eq!(sent, served, "{report:?}");
    assert!(stats.iter().all(|s| s.migrated_refused == 0), "{report:?}");
}
