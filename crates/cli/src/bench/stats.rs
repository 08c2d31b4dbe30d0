//! Latency statistics: an HdrHistogram per operation kind, recorded in nanoseconds with three
//! significant digits, summarised as avg, p50, p90, p95, p99, p99.9 and max in microseconds.
//!
//! Why HdrHistogram: recording is a constant-time increment with no allocation, so it can run
//! on the hot path of every bench thread; histograms of threads add up exactly, so percentiles
//! of the whole run are true percentiles, not averages of per-thread percentiles.

use hdrhistogram::Histogram;
use serde::Serialize;

/// Largest latency recorded without saturating: one hour.
const LATENCY_NS_MAX: u64 = 3_600 * 1_000_000_000;
const SIGNIFICANT_DIGITS: u8 = 3;

/// Latencies of one kind of operation.
#[derive(Clone)]
pub struct Latency {
    histogram: Histogram<u64>,
}

impl Default for Latency {
    fn default() -> Self {
        Latency::new()
    }
}

impl Latency {
    pub fn new() -> Latency {
        let histogram = Histogram::new_with_bounds(1, LATENCY_NS_MAX, SIGNIFICANT_DIGITS);
        // The bounds are constants that HdrHistogram accepts.
        Latency {
            histogram: histogram.unwrap_or_else(|_| unreachable!("valid histogram bounds")),
        }
    }

    #[inline]
    pub fn record(&mut self, latency_ns: u64) {
        self.histogram.saturating_record(latency_ns.max(1));
    }

    pub fn add(&mut self, other: &Latency) {
        // Same bounds on both sides, so adding cannot fail.
        let _ = self.histogram.add(&other.histogram);
    }

    pub fn reset(&mut self) {
        self.histogram.reset();
    }

    pub fn count(&self) -> u64 {
        self.histogram.len()
    }

    pub fn quantile_us(&self, quantile: f64) -> f64 {
        self.histogram.value_at_quantile(quantile) as f64 / 1e3
    }

    pub fn summary(&self) -> LatencySummary {
        let h = &self.histogram;
        let us = |ns: u64| ns as f64 / 1e3;
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            avg_us: h.mean() / 1e3,
            p50_us: us(h.value_at_quantile(0.50)),
            p90_us: us(h.value_at_quantile(0.90)),
            p95_us: us(h.value_at_quantile(0.95)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        }
    }
}

/// Percentiles of one kind of operation, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub avg_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p95_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_known_distribution() {
        let mut latency = Latency::new();
        for us in 1..=1000u64 {
            latency.record(us * 1000);
        }
        let summary = latency.summary();
        assert_eq!(summary.count, 1000);
        assert!((summary.p50_us - 500.0).abs() <= 1.0);
        assert!((summary.p99_us - 990.0).abs() <= 1.0);
        assert!((summary.max_us - 1000.0).abs() <= 1.0);
        assert!((summary.avg_us - 500.5).abs() <= 1.0);
        let mut total = Latency::new();
        total.add(&latency);
        total.add(&latency);
        assert_eq!(total.count(), 2000);
        assert_eq!(Latency::new().summary(), LatencySummary::default());
    }
}
