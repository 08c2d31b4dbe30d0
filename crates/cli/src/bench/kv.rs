//! `reflex bench --kv`: db_bench's `fillrandom` and `readrandom` shapes against reflexd's
//! key-value port (`docs/KV.md`), as the OctoFAS paper loads its hash engine.
//!
//! Each workload runs `threads` client threads (one connection each, `qd` requests in flight,
//! pipelined), each doing `ops` operations (or, with a duration, sending until it is up and
//! then collecting the answers still due) on keys drawn uniformly from `0 .. keys`:
//! `fillrandom` PUTs a value of `value_size` bytes, `readrandom` GETs and checks the value it
//! finds (every value is derived from its key, so a wrong or torn value is a mismatch and
//! fails the run; a key never filled reads as not found and is counted). Keys are the key
//! number big-endian in the last bytes of `key_size` bytes (zero-padded), so 4-byte keys
//! (the paper's) give 2^32 of them. Latency is from send to answer, recorded in the bench's
//! HdrHistogram; the table reports operations per second and percentiles per workload.
//!
//! Plain blocking sockets and threads, not the io_uring engine: a KV request is one small
//! frame each way, and the bench's point is the server's per-operation cost and tail.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use reflex_client::kv::KvClient;
use reflex_proto::kv::{KEY_SIZE_MAX_BYTES, Request, Status, VALUE_SIZE_MAX_BYTES};
use serde::Serialize;

use super::stats::{Latency, LatencySummary};

/// Most threads and requests in flight per connection.
pub const THREADS_MAX: usize = 64;
pub const QUEUE_DEPTH_MAX: u32 = 128;

/// db_bench's two shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    Fillrandom,
    Readrandom,
}

/// What a KV run does.
#[derive(Debug, Clone)]
pub struct KvOptions {
    pub address: SocketAddr,
    pub workloads: Vec<Workload>,
    pub threads: usize,
    pub queue_depth: u32,
    pub ops_per_thread: u64,
    /// Stop sending after this long instead of after `ops_per_thread` (which stays a bound):
    /// two flows started together are then measured over the same window, neither finishing
    /// early and leaving the other alone for the rest of its run.
    pub duration: Option<Duration>,
    pub keys: u64,
    pub key_size_bytes: usize,
    pub value_size_bytes: usize,
    pub seed: u64,
    pub json: bool,
    /// Tenant handle each connection BINDs to first (`None`: the port's tenant).
    pub tenant: Option<u64>,
}

#[derive(Debug, Default, Serialize)]
struct Row {
    workload: Option<Workload>,
    threads: usize,
    queue_depth: u32,
    ops: u64,
    ops_per_sec: f64,
    seconds: f64,
    /// readrandom: GETs that found their key.
    found: u64,
    latency: LatencySummary,
}

/// Key number `number` as `size` bytes.
fn key_bytes(number: u64, size: usize) -> Vec<u8> {
    let mut key = vec![0u8; size];
    let bytes = number.to_be_bytes();
    let taken = size.min(8);
    key[size - taken..].copy_from_slice(&bytes[8 - taken..]);
    key
}

/// The value stored under key number `number` (what readrandom checks).
fn value_bytes(number: u64, size: usize) -> Vec<u8> {
    // The `--verify` pattern of key `number`, cut to the value's length.
    let mut value = vec![0; size.next_multiple_of(8)];
    super::pattern::fill(number, 0, &mut value);
    value.truncate(size);
    value
}

/// What one thread measured.
struct ThreadResult {
    latency: Latency,
    ops: u64,
    found: u64,
}

fn run_thread(options: &KvOptions, workload: Workload, thread: usize) -> Result<ThreadResult> {
    let mut client = KvClient::connect(options.address)
        .with_context(|| format!("connecting to {}", options.address))?;
    if let Some(handle) = options.tenant {
        client
            .bind(handle)
            .with_context(|| format!("binding to tenant {handle:#x}"))?;
    }
    let seed = options.seed ^ (thread as u64) << 32 ^ workload as u64;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut latency = Latency::new();
    let mut sent_at: HashMap<u64, (Instant, u64)> = HashMap::new();
    let (mut sent, mut answered, mut found) = (0u64, 0u64, 0u64);
    let deadline = options.duration.map(|duration| Instant::now() + duration);
    loop {
        let in_time = deadline.is_none_or(|deadline| Instant::now() < deadline);
        while in_time
            && sent < options.ops_per_thread
            && sent_at.len() < options.queue_depth as usize
        {
            // Uniform enough: the key space is far below 2^64.
            let number = rng.next_u64() % options.keys;
            let key = key_bytes(number, options.key_size_bytes);
            let request_id = match workload {
                Workload::Fillrandom => {
                    let value = value_bytes(number, options.value_size_bytes);
                    client.send(&Request::Put {
                        key: &key,
                        value: &value,
                    })?
                }
                Workload::Readrandom => client.send(&Request::Get { key: &key })?,
            };
            sent_at.insert(request_id, (Instant::now(), number));
            sent += 1;
        }
        // Nothing left to answer: the operations are all sent (or the time is up) and answered.
        if sent_at.is_empty() {
            break;
        }
        let response = client.receive()?;
        let Some((at, number)) = sent_at.remove(&response.request_id) else {
            bail!(
                "an answer to request {} that was not sent",
                response.request_id
            );
        };
        latency.record(at.elapsed().as_nanos() as u64);
        answered += 1;
        match (workload, response.status()) {
            (Workload::Fillrandom, Some(Status::Ok)) => {}
            (Workload::Readrandom, Some(Status::Ok)) => {
                if response.value != value_bytes(number, options.value_size_bytes) {
                    bail!("key {number}: the value read is not the value written");
                }
                found += 1;
            }
            (Workload::Readrandom, Some(Status::NotFound)) => {}
            (_, status) => bail!(
                "key {number}: the server answered {:?} (status {})",
                status,
                response.status_raw
            ),
        }
    }
    Ok(ThreadResult {
        latency,
        ops: answered,
        found,
    })
}

fn run_workload(options: &KvOptions, workload: Workload) -> Result<Row> {
    let started = Instant::now();
    let results: Vec<Result<ThreadResult>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..options.threads)
            .map(|thread| scope.spawn(move || run_thread(options, workload, thread)))
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a bench thread panicked")))
            })
            .collect()
    });
    let seconds = started.elapsed().max(Duration::from_nanos(1)).as_secs_f64();
    let mut latency = Latency::new();
    let mut row = Row {
        workload: Some(workload),
        threads: options.threads,
        queue_depth: options.queue_depth,
        seconds,
        ..Row::default()
    };
    for result in results {
        let result = result?;
        latency.add(&result.latency);
        row.ops += result.ops;
        row.found += result.found;
    }
    row.ops_per_sec = row.ops as f64 / seconds;
    row.latency = latency.summary();
    Ok(row)
}

pub fn run(options: &KvOptions) -> Result<()> {
    if options.threads == 0 || options.threads > THREADS_MAX {
        bail!("--threads must be between 1 and {THREADS_MAX}");
    }
    if options.queue_depth == 0 || options.queue_depth > QUEUE_DEPTH_MAX {
        bail!("--qd must be between 1 and {QUEUE_DEPTH_MAX} with --kv");
    }
    if options.key_size_bytes == 0 || options.key_size_bytes > KEY_SIZE_MAX_BYTES {
        bail!("--key-size must be between 1 and {KEY_SIZE_MAX_BYTES}");
    }
    if options.value_size_bytes > VALUE_SIZE_MAX_BYTES {
        bail!("--value-size must be at most {VALUE_SIZE_MAX_BYTES}");
    }
    if options.keys == 0 || options.ops_per_thread == 0 {
        bail!("--kv-keys and --kv-ops must be at least 1");
    }
    if options.duration.is_some_and(|duration| duration.is_zero()) {
        bail!("--kv-duration must be longer than zero");
    }
    if options.key_size_bytes < 8 && options.keys > 1 << (8 * options.key_size_bytes) {
        bail!(
            "{} keys do not fit in {}-byte keys",
            options.keys,
            options.key_size_bytes
        );
    }
    let mut rows = Vec::new();
    for &workload in &options.workloads {
        rows.push(run_workload(options, workload)?);
    }
    if options.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "# {} key {} B value {} B keys {} threads {} qd {}",
        options.address,
        options.key_size_bytes,
        options.value_size_bytes,
        options.keys,
        options.threads,
        options.queue_depth
    );
    println!(
        "{:<11} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "workload",
        "ops",
        "ops/s",
        "found",
        "avg_us",
        "p50_us",
        "p95_us",
        "p99_us",
        "p99.9_us",
        "max_us"
    );
    for row in &rows {
        let latency = &row.latency;
        let name = match row.workload {
            Some(Workload::Fillrandom) => "fillrandom",
            Some(Workload::Readrandom) => "readrandom",
            None => "-",
        };
        println!(
            "{:<11} {:>9} {:>10.0} {:>9} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            name,
            row.ops,
            row.ops_per_sec,
            row.found,
            latency.avg_us,
            latency.p50_us,
            latency.p95_us,
            latency.p99_us,
            latency.p999_us,
            latency.max_us
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_big_endian_numbers_in_their_size() {
        assert_eq!(key_bytes(0x0102, 4), vec![0, 0, 1, 2]);
        assert_eq!(key_bytes(0x0102, 10), vec![0, 0, 0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(key_bytes(0x0102, 1), vec![2]);
        assert_ne!(value_bytes(1, 64), value_bytes(2, 64));
        assert_eq!(value_bytes(7, 100), value_bytes(7, 100));
    }
}
