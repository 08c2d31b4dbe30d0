//! Second looks at points that contradict their own curve.
//!
//! Why: on a real device, p95 read latency should not fall as the load rises, yet on a shared
//! machine a point now and then catches a burst of someone else's I/O (on this project's VMs,
//! stalls of ~15 ms every 100 ms for seconds at a time) and reports a p95 many times that of a
//! heavier point measured a moment later. The fit makes each curve monotone with a running
//! maximum, so one such point would flatten the rest of its curve. Instead of dropping it, the
//! point is measured again, later and twice, and replaced by the median of the three
//! measurements: a transient burst loses the vote, a real effect (such as higher latency at
//! very light load, when the device and the VM idle between requests) wins it.

use reflex_flash::calibrate::{CalibrateError, LoadRunner, PointResult, Sweep};
use std::time::Instant;

use reflex_qos::Nanos;

use super::runner::median_of;

/// A point is suspect when its p95 exceeds this multiple of a point's that carried at least
/// as much load with at least as large a share of writes.
pub const OUTLIER_FACTOR: f64 = 2.0;
/// Extra measurements of a suspect point.
pub const REMEASUREMENTS: usize = 2;
/// Rounds of looking for suspects again after re-measuring (a re-measured point can reveal
/// that a lighter one was inflated too).
pub const ROUNDS_MAX: usize = 3;

/// How suspect each point of `sweep` is: the largest ratio of its p95 to that of a point of
/// the same size with at least its offered rate and at most its read ratio (more load and
/// more writes should never be faster). Points over `factor`, most suspect first, as
/// (index into `sweep.points`, ratio).
pub fn suspects(sweep: &Sweep, factor: f64) -> Vec<(usize, f64)> {
    let points = &sweep.points;
    let mut found: Vec<(usize, f64)> = (0..points.len())
        .filter_map(|index| {
            let point = &points[index];
            let fastest_heavier = points
                .iter()
                .enumerate()
                .filter(|&(other_index, other)| {
                    other_index != index
                        && other.size_bytes == point.size_bytes
                        && other.rate_per_sec >= point.rate_per_sec
                        && other.read_ratio <= point.read_ratio + 1e-9
                        && other.read_latency_us_p95 > 0.0
                })
                .map(|(_, other)| other.read_latency_us_p95)
                .fold(f64::INFINITY, f64::min);
            let ratio = point.read_latency_us_p95 / fastest_heavier;
            (ratio > factor).then_some((index, ratio))
        })
        .collect();
    found.sort_by(|a, b| b.1.total_cmp(&a.1));
    found
}

/// What [`remeasure`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Remeasured {
    /// Points measured again (each [`REMEASUREMENTS`] times).
    pub remeasured: usize,
    /// Suspects left alone because the deadline came first.
    pub skipped: usize,
    /// Points still suspect at the end.
    pub still_suspect: usize,
}

/// Measures suspects of `sweep`, most suspect first, [`REMEASUREMENTS`] more times each at
/// its rate, mix and size for `duration`, replacing each with the median of its
/// measurements; repeats for new suspects, at most [`ROUNDS_MAX`] rounds, and starts no
/// point after `deadline`. `progress(done, count, point)` after each.
pub fn remeasure(
    runner: &mut dyn LoadRunner,
    sweep: &mut Sweep,
    duration: Nanos,
    deadline: Option<Instant>,
    progress: &mut dyn FnMut(usize, usize, &PointResult),
) -> Result<Remeasured, CalibrateError> {
    let mut report = Remeasured::default();
    let mut done: Vec<usize> = Vec::new();
    for _ in 0..ROUNDS_MAX {
        let todo: Vec<usize> = suspects(sweep, OUTLIER_FACTOR)
            .into_iter()
            .map(|(index, _)| index)
            .filter(|index| !done.contains(index))
            .collect();
        if todo.is_empty() {
            break;
        }
        for (position, &index) in todo.iter().enumerate() {
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                report.skipped += todo.len() - position;
                break;
            }
            let original = sweep.points[index].clone();
            let mut measurements = vec![original.clone()];
            for _ in 0..REMEASUREMENTS {
                measurements.push(runner.run_point(
                    original.rate_per_sec,
                    original.read_ratio,
                    original.size_bytes,
                    duration,
                )?);
            }
            let merged = median_of(measurements);
            progress(position + 1, todo.len(), &merged);
            sweep.points[index] = merged;
            done.push(index);
            report.remeasured += 1;
        }
        if report.skipped > 0 {
            break;
        }
    }
    report.still_suspect = suspects(sweep, OUTLIER_FACTOR).len();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use reflex_flash::calibrate::SweepConfig;

    use super::*;

    fn point(read_ratio: f64, rate_per_sec: f64, p95: f64) -> PointResult {
        PointResult {
            rate_per_sec,
            read_ratio,
            size_bytes: 4096,
            iops: rate_per_sec,
            reads: 100,
            writes: 0,
            read_latency_us_p50: p95 / 2.0,
            read_latency_us_p95: p95,
            read_latency_us_p99: p95 * 2.0,
            write_latency_us_p95: 0.0,
            refused: 0,
            unfinished: 0,
            read_latency_us_p95_runs: Vec::new(),
        }
    }

    /// Replays fixed p95 values, one per call, and counts the calls.
    struct Replay {
        p95s: Vec<f64>,
        calls: usize,
    }

    impl LoadRunner for Replay {
        fn describe(&self) -> String {
            "replay".into()
        }
        fn precondition(
            &mut self,
            _: &reflex_flash::calibrate::PreconditionPlan,
            _: &mut dyn FnMut(f64),
        ) -> Result<(), CalibrateError> {
            Ok(())
        }
        fn run_point(
            &mut self,
            rate: f64,
            ratio: f64,
            _: u32,
            _: Nanos,
        ) -> Result<PointResult, CalibrateError> {
            let p95 = self.p95s.get(self.calls).copied().unwrap_or(1.0);
            self.calls += 1;
            Ok(point(ratio, rate, p95))
        }
    }

    fn sweep(points: Vec<PointResult>) -> Sweep {
        Sweep {
            runner: "test".into(),
            config: SweepConfig::default(),
            points,
        }
    }

    #[test]
    fn suspects_are_points_slower_than_a_heavier_or_more_written_point() {
        let sweep = sweep(vec![
            point(1.0, 1000.0, 300.0), // 3x the 2000/s point: suspect
            point(1.0, 2000.0, 100.0),
            point(1.0, 3000.0, 5000.0), // slower than the 50 % curve at 3000/s: suspect
            point(1.0, 4000.0, 4000.0),
            point(0.5, 500.0, 150.0), // 1.5x the 1000/s point: not over 2x
            point(0.5, 1000.0, 100.0),
            point(0.5, 3000.0, 200.0),
        ]);
        let found = suspects(&sweep, 2.0);
        let indices: Vec<usize> = found.iter().map(|(index, _)| *index).collect();
        assert_eq!(indices, vec![2, 0], "most suspect first");
        assert_eq!(found[0].1, 25.0);
        assert_eq!(found[1].1, 3.0);
        let loose: Vec<usize> = suspects(&sweep, 1.2).iter().map(|(i, _)| *i).collect();
        assert!(loose.contains(&4));
        // A lighter point with more writes says nothing about a read-only point.
        let fine = super::tests::sweep(vec![point(1.0, 2000.0, 300.0), point(0.5, 1000.0, 50.0)]);
        assert!(suspects(&fine, 2.0).is_empty());
    }

    #[test]
    fn a_transient_spike_loses_the_vote_and_a_real_effect_keeps_it() {
        let mut transient = sweep(vec![point(1.0, 1000.0, 900.0), point(1.0, 2000.0, 100.0)]);
        let mut runner = Replay {
            p95s: vec![80.0, 90.0],
            calls: 0,
        };
        let mut seen = Vec::new();
        let report = remeasure(
            &mut runner,
            &mut transient,
            Nanos::from_millis(1),
            None,
            &mut |d, n, _| seen.push((d, n)),
        )
        .expect("remeasure");
        assert_eq!(runner.calls, REMEASUREMENTS);
        assert_eq!(seen, vec![(1, 1)]);
        assert_eq!(
            report,
            Remeasured {
                remeasured: 1,
                skipped: 0,
                still_suspect: 0
            }
        );
        assert_eq!(transient.points[0].read_latency_us_p95, 90.0);
        assert_eq!(
            transient.points[0].read_latency_us_p95_runs,
            vec![900.0, 80.0, 90.0]
        );
        assert_eq!(transient.points[0].reads, 300, "every measurement counts");

        let mut real = sweep(vec![point(1.0, 1000.0, 900.0), point(1.0, 2000.0, 100.0)]);
        let mut runner = Replay {
            p95s: vec![850.0, 950.0],
            calls: 0,
        };
        let report = remeasure(
            &mut runner,
            &mut real,
            Nanos::from_millis(1),
            None,
            &mut |_, _, _| {},
        )
        .expect("remeasure");
        assert_eq!(report.remeasured, 1);
        assert_eq!(report.still_suspect, 1);
        assert_eq!(runner.calls, REMEASUREMENTS, "a point is re-measured once");
        assert_eq!(real.points[0].read_latency_us_p95, 900.0);

        let mut late = sweep(vec![point(1.0, 1000.0, 900.0), point(1.0, 2000.0, 100.0)]);
        let mut runner = Replay {
            p95s: Vec::new(),
            calls: 0,
        };
        let report = remeasure(
            &mut runner,
            &mut late,
            Nanos::from_millis(1),
            Some(Instant::now()),
            &mut |_, _, _| {},
        )
        .expect("remeasure");
        assert_eq!(runner.calls, 0, "nothing starts after the deadline");
        assert_eq!(report.skipped, 1);
    }
}
