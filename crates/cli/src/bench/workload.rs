//! What the bench asks for and when, as pure generators: the operation stream of one
//! connection (read or write, offset), the `--verify` fill of a disjoint sub-range, and the
//! Poisson arrival times of open-loop load.
//!
//! Every generator is seeded from the run's seed and the stream's index, so a run is
//! reproducible and streams differ. Offsets are multiples of the I/O size inside the range
//! (as fio's default block alignment), so O_DIRECT alignment holds for every size ≥ 512.

use rand_xoshiro::Xoshiro256PlusPlus;
use rand_xoshiro::rand_core::{Rng, SeedableRng};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    Random,
    #[value(alias = "seq")]
    Sequential,
}

/// The operation mix of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkloadSpec {
    /// Fraction of reads, 0.0 ..= 1.0.
    pub read_ratio: f64,
    pub io_size_bytes: u32,
    pub access: Access,
    pub range_start_bytes: u64,
    /// A positive multiple of `io_size_bytes`.
    pub range_length_bytes: u64,
}

impl WorkloadSpec {
    pub fn block_count(&self) -> u64 {
        self.range_length_bytes / u64::from(self.io_size_bytes)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
}

/// One operation to issue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub kind: OpKind,
    pub offset_bytes: u64,
    pub length_bytes: u32,
}

/// A 64-bit stream seed from the run seed and a stream index (splitmix64 finaliser).
pub fn stream_seed(seed: u64, stream_index: u64) -> u64 {
    let mut z = seed ^ stream_index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The operations of one stream (connection or local queue).
pub struct OpGenerator {
    spec: WorkloadSpec,
    rng: Xoshiro256PlusPlus,
    /// `None`: every operation is a read. Otherwise a draw below this is a read.
    read_threshold: Option<u64>,
    block_count: u64,
    cursor_block: u64,
}

impl OpGenerator {
    pub fn new(spec: WorkloadSpec, seed: u64, stream_index: u64, stream_count: u64) -> Self {
        assert!(spec.io_size_bytes > 0);
        assert!((0.0..=1.0).contains(&spec.read_ratio));
        let block_count = spec.block_count();
        assert!(block_count > 0, "range smaller than one I/O");
        assert!(stream_count > 0);
        let read_threshold = if spec.read_ratio >= 1.0 {
            None
        } else {
            Some((spec.read_ratio * u64::MAX as f64) as u64)
        };
        OpGenerator {
            spec,
            rng: Xoshiro256PlusPlus::seed_from_u64(stream_seed(seed, stream_index)),
            read_threshold,
            block_count,
            // Sequential streams start spread over the range.
            cursor_block: (u128::from(block_count) * u128::from(stream_index)
                / u128::from(stream_count)) as u64,
        }
    }

    pub fn next_op(&mut self) -> Op {
        let kind = match self.read_threshold {
            None => OpKind::Read,
            Some(threshold) if self.rng.next_u64() < threshold => OpKind::Read,
            Some(_) => OpKind::Write,
        };
        let block = match self.spec.access {
            Access::Random => {
                // Lemire's multiply-shift: uniform over the blocks without a division.
                ((u128::from(self.rng.next_u64()) * u128::from(self.block_count)) >> 64) as u64
            }
            Access::Sequential => {
                let block = self.cursor_block;
                self.cursor_block = (self.cursor_block + 1) % self.block_count;
                block
            }
        };
        debug_assert!(block < self.block_count);
        Op {
            kind,
            offset_bytes: self.spec.range_start_bytes + block * u64::from(self.spec.io_size_bytes),
            length_bytes: self.spec.io_size_bytes,
        }
    }
}

/// The `--verify` fill of one stream: sequential writes covering its share of the range.
pub struct FillGenerator {
    next_offset_bytes: u64,
    end_offset_bytes: u64,
    chunk_bytes: u32,
}

impl FillGenerator {
    /// Stream `stream_index` of `stream_count` fills its contiguous share of the range (split
    /// at I/O-size boundaries) in chunks of up to `chunk_bytes`.
    pub fn new(
        spec: &WorkloadSpec,
        chunk_bytes: u32,
        stream_index: u64,
        stream_count: u64,
    ) -> Self {
        assert!(chunk_bytes >= spec.io_size_bytes);
        assert!(chunk_bytes.is_multiple_of(spec.io_size_bytes));
        let block_count = u128::from(spec.block_count());
        let io_size = u64::from(spec.io_size_bytes);
        let first = (block_count * u128::from(stream_index) / u128::from(stream_count)) as u64;
        let end = (block_count * u128::from(stream_index + 1) / u128::from(stream_count)) as u64;
        FillGenerator {
            next_offset_bytes: spec.range_start_bytes + first * io_size,
            end_offset_bytes: spec.range_start_bytes + end * io_size,
            chunk_bytes,
        }
    }

    pub fn next_op(&mut self) -> Option<Op> {
        if self.next_offset_bytes >= self.end_offset_bytes {
            return None;
        }
        let length =
            (self.end_offset_bytes - self.next_offset_bytes).min(u64::from(self.chunk_bytes));
        let op = Op {
            kind: OpKind::Write,
            offset_bytes: self.next_offset_bytes,
            length_bytes: length as u32,
        };
        self.next_offset_bytes += length;
        Some(op)
    }
}

/// Poisson arrivals: exponential gaps with mean 1 / rate, on the thread's nanosecond clock.
#[derive(Clone)]
pub struct Arrivals {
    rng: Xoshiro256PlusPlus,
    /// The mean gap at the full rate.
    base_gap_ns: f64,
    mean_gap_ns: f64,
    next_ns: u64,
}

impl Arrivals {
    pub fn new(rate_per_sec: f64, seed: u64, stream_index: u64, start_ns: u64) -> Self {
        assert!(rate_per_sec > 0.0);
        let mut arrivals = Arrivals {
            rng: Xoshiro256PlusPlus::seed_from_u64(stream_seed(seed ^ 0xA11C_E5ED, stream_index)),
            base_gap_ns: 1e9 / rate_per_sec,
            mean_gap_ns: 1e9 / rate_per_sec,
            next_ns: start_ns,
        };
        arrivals.advance();
        arrivals
    }

    /// The intended send time of the next request.
    pub fn next_ns(&self) -> u64 {
        self.next_ns
    }

    /// Requests due by `now_ns` and not yet taken (`advance`d past): the client's backlog
    /// behind a full window. Estimated from the oldest one's age at the current mean rate (the
    /// exact count would draw every gap).
    pub fn due_by(&self, now_ns: u64) -> u64 {
        match now_ns.checked_sub(self.next_ns) {
            Some(age_ns) => 1 + (age_ns as f64 / self.mean_gap_ns) as u64,
            None => 0,
        }
    }

    /// Sends at `factor` (0 < factor ≤ 1) of the rate given at the start, from the next gap on.
    pub fn set_rate_factor(&mut self, factor: f64) {
        assert!(factor > 0.0 && factor <= 1.0, "rate factor {factor}");
        self.mean_gap_ns = self.base_gap_ns / factor;
    }

    pub fn advance(&mut self) {
        // u in (0, 1]: 53 random bits, never zero, so ln(u) is finite.
        let u = ((self.rng.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64);
        let gap_ns = -u.ln() * self.mean_gap_ns;
        self.next_ns = self.next_ns.saturating_add(gap_ns as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_factor_stretches_the_gaps_from_the_next_arrival_on() {
        let mean_gap = |factor: f64| {
            let mut arrivals = Arrivals::new(10_000.0, 7, 0, 0);
            arrivals.set_rate_factor(factor);
            let start = arrivals.next_ns();
            for _ in 0..20_000 {
                arrivals.advance();
            }
            (arrivals.next_ns() - start) as f64 / 20_000.0
        };
        let full = mean_gap(1.0);
        let half = mean_gap(0.5);
        assert!((full / 100_000.0 - 1.0).abs() < 0.03, "{full}");
        assert!(
            (half / full - 2.0).abs() < 1e-4,
            "{half} vs {full}: same stream, twice the gaps"
        );
    }

    #[test]
    fn the_backlog_counts_what_is_due_and_not_yet_taken() {
        let arrivals = Arrivals::new(10_000.0, 7, 0, 0);
        assert_eq!(arrivals.due_by(arrivals.next_ns() - 1), 0);
        assert_eq!(arrivals.due_by(arrivals.next_ns()), 1);
        // 100 ms behind at 10K/s: about 1,000 due; the estimate against the exact count.
        let now_ns = arrivals.next_ns() + 100_000_000;
        let mut exact = arrivals.clone();
        let mut due = 0u64;
        while exact.next_ns() <= now_ns {
            exact.advance();
            due += 1;
        }
        let estimate = arrivals.due_by(now_ns);
        assert!(
            estimate.abs_diff(due) * 10 <= due,
            "estimated {estimate}, {due} due"
        );
    }

    fn spec(read_ratio: f64, access: Access) -> WorkloadSpec {
        WorkloadSpec {
            read_ratio,
            io_size_bytes: 4096,
            access,
            range_start_bytes: 1 << 20,
            range_length_bytes: 64 * 4096,
        }
    }

    #[test]
    fn random_ops_stay_aligned_in_range_and_follow_the_ratio() {
        let mut generator = OpGenerator::new(spec(0.7, Access::Random), 1, 0, 1);
        let mut reads = 0;
        for _ in 0..10_000 {
            let op = generator.next_op();
            assert!(op.offset_bytes >= 1 << 20);
            assert!(op.offset_bytes + 4096 <= (1 << 20) + 64 * 4096);
            assert_eq!(op.offset_bytes % 4096, 0);
            reads += usize::from(op.kind == OpKind::Read);
        }
        assert!((6_500..7_500).contains(&reads), "{reads} reads of 10000");
        let mut only_reads = OpGenerator::new(spec(1.0, Access::Random), 1, 0, 1);
        assert!((0..1000).all(|_| only_reads.next_op().kind == OpKind::Read));
        let mut only_writes = OpGenerator::new(spec(0.0, Access::Random), 1, 0, 1);
        assert!((0..1000).all(|_| only_writes.next_op().kind == OpKind::Write));
    }

    #[test]
    fn sequential_streams_start_apart_and_wrap() {
        let mut second = OpGenerator::new(spec(1.0, Access::Sequential), 1, 1, 2);
        assert_eq!(second.next_op().offset_bytes, (1 << 20) + 32 * 4096);
        for _ in 0..31 {
            second.next_op();
        }
        assert_eq!(second.next_op().offset_bytes, 1 << 20, "wrapped");
    }

    #[test]
    fn fill_streams_cover_the_range_exactly_once() {
        let spec = WorkloadSpec {
            range_length_bytes: 1000 * 4096,
            ..spec(1.0, Access::Random)
        };
        let mut covered = vec![0u8; 1000];
        for stream in 0..3 {
            let mut fill = FillGenerator::new(&spec, 128 * 1024, stream, 3);
            while let Some(op) = fill.next_op() {
                assert_eq!(op.kind, OpKind::Write);
                assert!(op.length_bytes <= 128 * 1024);
                let first = (op.offset_bytes - spec.range_start_bytes) / 4096;
                for block in first..first + u64::from(op.length_bytes) / 4096 {
                    covered[block as usize] += 1;
                }
            }
        }
        assert!(covered.iter().all(|count| *count == 1));
    }

    #[test]
    fn poisson_gaps_have_the_requested_mean() {
        let mut arrivals = Arrivals::new(100_000.0, 3, 0, 0);
        let first = arrivals.next_ns();
        for _ in 0..100_000 {
            arrivals.advance();
        }
        let mean_gap_ns = (arrivals.next_ns() - first) as f64 / 100_000.0;
        assert!((9_700.0..10_300.0).contains(&mean_gap_ns), "{mean_gap_ns}");
    }
}
