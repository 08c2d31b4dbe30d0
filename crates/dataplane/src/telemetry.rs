//! What the dataplane measures for the control plane: read latencies in fixed-size
//! histograms, cheap to record on the data path and to merge across threads.
//!
//! Why not `hdrhistogram` here: recording happens once per read on the hot path, and the
//! control plane merges one histogram per thread and window; a flat array of counters with
//! log-linear buckets (exact below 64 µs, then 16 buckets per power of two: within 6.25 %)
//! records in a few instructions, never allocates after creation and merges by adding arrays.

/// Values below this are counted exactly (one bucket per microsecond).
const LINEAR_US: u64 = 64;
/// Sub-buckets per power of two above [`LINEAR_US`].
const SUB_BUCKETS: u64 = 16;
const SUB_BITS: u32 = SUB_BUCKETS.trailing_zeros();
/// Largest value kept apart: about 68 s (larger ones count in the last bucket).
const POWER_MAX: u32 = 36;
pub const BUCKETS: usize =
    LINEAR_US as usize + (POWER_MAX - LINEAR_US.trailing_zeros()) as usize * SUB_BUCKETS as usize;

const _: () = assert!(LINEAR_US.is_power_of_two() && SUB_BUCKETS.is_power_of_two());
const _: () = assert!(LINEAR_US >= SUB_BUCKETS);

/// Counts of latencies in microseconds.
#[derive(Clone, PartialEq, Eq)]
pub struct LatencyHistogram {
    counts: Box<[u32]>,
    total: u64,
}

impl std::fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("total", &self.total)
            .field("p50_us", &self.quantile_us(0.5))
            .field("p95_us", &self.quantile_us(0.95))
            .finish()
    }
}

impl Default for LatencyHistogram {
    fn default() -> LatencyHistogram {
        LatencyHistogram::new()
    }
}

fn bucket_of(value_us: u64) -> usize {
    if value_us < LINEAR_US {
        return value_us as usize;
    }
    let power = 63 - value_us.leading_zeros();
    if power >= POWER_MAX {
        return BUCKETS - 1;
    }
    let sub = (value_us >> (power - SUB_BITS)) & (SUB_BUCKETS - 1);
    LINEAR_US as usize
        + (power - LINEAR_US.trailing_zeros()) as usize * SUB_BUCKETS as usize
        + sub as usize
}

/// The largest value a bucket holds (its upper bound, so quantiles never understate).
fn bucket_upper_us(bucket: usize) -> u64 {
    if bucket < LINEAR_US as usize {
        return bucket as u64;
    }
    let above = (bucket - LINEAR_US as usize) as u64;
    let power = u64::from(LINEAR_US.trailing_zeros()) + above / SUB_BUCKETS;
    let sub = above % SUB_BUCKETS;
    let base = 1u64 << power;
    let width = base >> SUB_BITS;
    base + (sub + 1) * width - 1
}

impl LatencyHistogram {
    pub fn new() -> LatencyHistogram {
        LatencyHistogram {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            total: 0,
        }
    }

    pub fn record_us(&mut self, value_us: u64) {
        let bucket = bucket_of(value_us);
        self.counts[bucket] = self.counts[bucket].saturating_add(1);
        self.total += 1;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The value at quantile `q` (0..=1), rounded up to its bucket's upper bound; 0 when
    /// empty.
    pub fn quantile_us(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0u64;
        for (bucket, &count) in self.counts.iter().enumerate() {
            seen += u64::from(count);
            if seen >= rank {
                return bucket_upper_us(bucket);
            }
        }
        bucket_upper_us(BUCKETS - 1)
    }

    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (mine, theirs) in self.counts.iter_mut().zip(other.counts.iter()) {
            *mine = mine.saturating_add(*theirs);
        }
        self.total += other.total;
    }

    pub fn clear(&mut self) {
        if self.total > 0 {
            self.counts.fill(0);
            self.total = 0;
        }
    }

    /// Each non-empty bucket as (its upper bound in µs, its count), in increasing order (what
    /// a Prometheus histogram is made of).
    pub fn buckets(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, count)| **count > 0)
            .map(|(bucket, count)| (bucket_upper_us(bucket), u64::from(*count)))
    }

    /// What was recorded since `earlier`, an older copy of this histogram (a window from two
    /// cumulative snapshots; buckets that went down, as after a reset, count 0).
    pub fn since(&self, earlier: &LatencyHistogram) -> LatencyHistogram {
        let mut window = LatencyHistogram::new();
        for ((bucket, now), before) in window
            .counts
            .iter_mut()
            .zip(self.counts.iter())
            .zip(earlier.counts.iter())
        {
            *bucket = now.saturating_sub(*before);
            window.total += u64::from(*bucket);
        }
        window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_exact_below_64_us_and_within_a_sixteenth_above() {
        for value in 0..LINEAR_US {
            assert_eq!(bucket_upper_us(bucket_of(value)), value);
        }
        let mut previous = 0;
        for value in [64, 65, 100, 127, 128, 1000, 4095, 500_000, 59_999_999] {
            let bucket = bucket_of(value);
            assert!(bucket >= previous, "monotonic");
            previous = bucket;
            let upper = bucket_upper_us(bucket);
            assert!(upper >= value, "{value} above its bucket's bound {upper}");
            assert!(
                (upper - value) as f64 <= value as f64 / SUB_BUCKETS as f64,
                "{value}: bucket bound {upper} too coarse"
            );
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_merge_and_clear() {
        let mut a = LatencyHistogram::new();
        for value in 1..=100 {
            a.record_us(value * 10);
        }
        assert_eq!(a.count(), 100);
        let p95 = a.quantile_us(0.95);
        assert!((950..=1010).contains(&p95), "{p95}");
        let mut b = LatencyHistogram::new();
        for _ in 0..100 {
            b.record_us(5);
        }
        b.merge(&a);
        assert_eq!(b.count(), 200);
        assert_eq!(b.quantile_us(0.5), 5);
        let window = b.since(&a);
        assert_eq!(window.count(), 100);
        assert_eq!(window.quantile_us(0.95), 5);
        assert_eq!(a.buckets().map(|(_, count)| count).sum::<u64>(), 100);
        b.clear();
        assert!(b.is_empty());
        assert_eq!(b.quantile_us(0.95), 0);
    }
}
