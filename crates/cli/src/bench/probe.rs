//! The latency probe: one extra connection (or local descriptor) at queue depth 1, issuing a
//! request after an exponentially distributed think time, beside the main load.
//!
//! Why separate (as mutilate's master client): the loaded connections measure latency *under*
//! their own queueing; the probe never queues behind itself, so it shows what one request
//! costs while the server carries the load — the unloaded latency of the ReFlex paper's
//! Table 2 when the load is light. It measures from the actual send, uses the blocking client
//! (the blocking NBD client for an NBD target, positioned reads and writes on a local file),
//! and follows the same read ratio,
//! range and `--verify` pattern as the load.

use std::fs::File;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use reflex_client::Client;

use super::engine::Outcome;
use super::nbd::BlockingNbd;
use super::pattern;
use super::uring::SLOT_ALIGNMENT_BYTES;
use super::workload::{Arrivals, OpGenerator, OpKind, WorkloadSpec};

/// The probe's stream index, apart from every load stream's.
const PROBE_STREAM_INDEX: u64 = u64::MAX / 2;

pub enum ProbeTarget {
    Remote { address: SocketAddr, namespace: u32 },
    Nbd { address: SocketAddr, export: String },
    Local { file: Arc<File> },
}

pub struct ProbeConfig {
    pub target: ProbeTarget,
    pub workload: WorkloadSpec,
    pub rate_per_sec: f64,
    pub seed: u64,
    pub verify_seed: Option<u64>,
    pub warmup: Duration,
    pub duration: Duration,
}

/// Runs the probe until its duration passes or `stop` is set.
pub fn run(config: &ProbeConfig, stop: &AtomicBool) -> Result<Outcome> {
    let mut client = match &config.target {
        ProbeTarget::Remote { address, .. } => {
            Some(Client::connect(address).context("connecting the probe")?)
        }
        ProbeTarget::Nbd { .. } | ProbeTarget::Local { .. } => None,
    };
    let mut nbd_client = match &config.target {
        ProbeTarget::Nbd { address, export } => Some(
            BlockingNbd::connect(*address, export, config.workload.io_size_bytes)
                .context("connecting the probe")?,
        ),
        _ => None,
    };
    let io_size = config.workload.io_size_bytes as usize;
    // An aligned buffer for O_DIRECT, carved from a larger allocation without unsafe.
    let mut memory = vec![0u8; io_size + SLOT_ALIGNMENT_BYTES];
    let skew = (memory.as_ptr() as usize).next_multiple_of(SLOT_ALIGNMENT_BYTES)
        - memory.as_ptr() as usize;
    let buffer = &mut memory[skew..skew + io_size];
    let mut generator = OpGenerator::new(config.workload, config.seed, PROBE_STREAM_INDEX, 1);
    let mut arrivals = Arrivals::new(config.rate_per_sec, config.seed, PROBE_STREAM_INDEX, 0);
    let start = Instant::now();
    let warmup_ns = config.warmup.as_nanos() as u64;
    let end_ns = warmup_ns + config.duration.as_nanos() as u64;
    let mut outcome = Outcome::default();
    let mut last_ns = 0u64;
    loop {
        let now_ns = start.elapsed().as_nanos() as u64;
        if now_ns >= end_ns || stop.load(Ordering::Relaxed) {
            break;
        }
        // Think: sleep until the next arrival, in slices so `stop` is seen promptly.
        if arrivals.next_ns() > now_ns {
            let wait_ns = (arrivals.next_ns() - now_ns).min(50_000_000);
            std::thread::sleep(Duration::from_nanos(wait_ns));
            continue;
        }
        // Arrivals that passed while the previous request ran are skipped, not queued: the
        // probe stays at queue depth 1.
        while arrivals.next_ns() <= now_ns {
            arrivals.advance();
        }
        let op = generator.next_op();
        if let (OpKind::Write, Some(seed)) = (op.kind, config.verify_seed) {
            pattern::fill(seed, op.offset_bytes, buffer);
        }
        let sent = Instant::now();
        let result = match (&config.target, client.as_mut(), op.kind) {
            (ProbeTarget::Remote { namespace, .. }, Some(client), OpKind::Read) => client
                .read(*namespace, op.offset_bytes, buffer)
                .map_err(|error| error.to_string()),
            (ProbeTarget::Remote { namespace, .. }, Some(client), OpKind::Write) => client
                .write(*namespace, op.offset_bytes, buffer)
                .map_err(|error| error.to_string()),
            (ProbeTarget::Local { file }, _, OpKind::Read) => file
                .read_exact_at(buffer, op.offset_bytes)
                .map_err(|error| error.to_string()),
            (ProbeTarget::Local { file }, _, OpKind::Write) => file
                .write_all_at(buffer, op.offset_bytes)
                .map_err(|error| error.to_string()),
            (ProbeTarget::Nbd { .. }, _, OpKind::Read) => match nbd_client.as_mut() {
                Some(nbd) => nbd
                    .read(op.offset_bytes, buffer)
                    .map_err(|error| format!("{error:#}")),
                None => Err("probe has no connection".to_string()),
            },
            (ProbeTarget::Nbd { .. }, _, OpKind::Write) => match nbd_client.as_mut() {
                Some(nbd) => nbd
                    .write(op.offset_bytes, buffer)
                    .map_err(|error| format!("{error:#}")),
                None => Err("probe has no connection".to_string()),
            },
            (ProbeTarget::Remote { .. }, None, _) => Err("probe has no connection".to_string()),
        };
        let latency_ns = sent.elapsed().as_nanos() as u64;
        let done_ns = start.elapsed().as_nanos() as u64;
        match result {
            Err(error) => {
                outcome.errors += 1;
                outcome.first_error.get_or_insert(format!(
                    "probe {:?} at {}: {error}",
                    op.kind, op.offset_bytes
                ));
            }
            Ok(()) => {
                let mismatch = match (op.kind, config.verify_seed) {
                    (OpKind::Read, Some(seed)) => pattern::check(seed, op.offset_bytes, buffer),
                    _ => None,
                };
                if let Some(mismatch) = mismatch {
                    outcome.mismatches += 1;
                    outcome.first_mismatch.get_or_insert(mismatch);
                }
                if u128::from(done_ns) >= u128::from(warmup_ns) + u128::from(latency_ns) {
                    outcome.measured_ops += 1;
                    outcome.measured_bytes += u64::from(op.length_bytes);
                    last_ns = done_ns;
                    match op.kind {
                        OpKind::Read => outcome.read.record(latency_ns),
                        OpKind::Write => outcome.write.record(latency_ns),
                    }
                }
            }
        }
    }
    outcome.measured_ns = last_ns.saturating_sub(warmup_ns);
    Ok(outcome)
}
