//! Fitting the cost model to a sweep.
//!
//! For a candidate write cost `w`, each mixed curve maps p95 latency to a token rate
//! `iops × (r + (1 − r)·w)`. The fitted `w` minimises, over a grid of latency levels that every
//! mixed curve reaches, the variance of the log token rates across curves, so the curves
//! coincide as well as one number allows (ReFlex §3.2.1; the original devmodel's step 2). Only
//! the token factor depends on `w`, so each evaluation is cheap and the search is a dense grid
//! followed by golden-section refinement.

use reflex_qos::{DeviceProfile, TokenLimit};
use serde::{Deserialize, Serialize};

use super::{CalibrateError, PointResult, Sweep, same_ratio};

/// Latency levels used to compare curves.
const LEVEL_COUNT: usize = 24;
/// Search range of the write cost.
const WRITE_COST_MIN: f64 = 0.25;
const WRITE_COST_MAX: f64 = 200.0;

/// Tokens one command of a size costs, measured against 4 KiB reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SizeCost {
    pub size_bytes: u32,
    /// Measured: 4 KiB read-only IOPS over this size's read-only IOPS at equal p95.
    pub tokens_per_command: f64,
    /// What the cost model charges: ceil(size / 4 KiB).
    pub model_tokens_per_command: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fit {
    pub write_cost: f64,
    pub read_only_read_cost: f64,
    /// Root-mean-square relative spread of the mixed curves' token rates at the fitted cost
    /// (0 = they coincide exactly).
    pub spread: f64,
    /// The calibrated size (the smallest swept, normally 4 KiB).
    pub size_bytes: u32,
    pub size_costs: Vec<SizeCost>,
    pub profile: DeviceProfile,
}

/// A curve reduced to monotone (iops, p95) pairs.
struct Curve {
    read_ratio: f64,
    /// (iops, p95 µs), by increasing offered rate, p95 made non-decreasing.
    points: Vec<(f64, f64)>,
}

fn curve_of(points: &[&PointResult], read_ratio: f64) -> Curve {
    let mut monotone = Vec::with_capacity(points.len());
    let mut p95_max: f64 = 0.0;
    let mut iops_max: f64 = 0.0;
    for point in points {
        p95_max = p95_max.max(point.read_latency_us_p95);
        iops_max = iops_max.max(point.iops);
        monotone.push((iops_max, p95_max));
    }
    Curve {
        read_ratio,
        points: monotone,
    }
}

/// The request rate at which a curve's p95 reaches `latency_us`: `None` if even its lightest
/// point is slower; the heaviest point's rate (flagged `true`) if it never gets there.
pub fn read_iops_at_latency(points: &[(f64, f64)], latency_us: f64) -> Option<(f64, bool)> {
    let first = points.first()?;
    if first.1 > latency_us {
        return None;
    }
    for pair in points.windows(2) {
        let (low, high) = (pair[0], pair[1]);
        if high.1 >= latency_us {
            if high.1 <= low.1 {
                return Some((low.0, false));
            }
            let fraction = (latency_us - low.1) / (high.1 - low.1);
            return Some((low.0 + (high.0 - low.0) * fraction, false));
        }
    }
    points.last().map(|last| (last.0, true))
}

impl Curve {
    fn iops_at(&self, latency_us: f64) -> Option<f64> {
        match read_iops_at_latency(&self.points, latency_us) {
            Some((iops, false)) => Some(iops),
            _ => None,
        }
    }
    fn iops_at_clamped(&self, latency_us: f64) -> Option<f64> {
        read_iops_at_latency(&self.points, latency_us).map(|(iops, _)| iops)
    }
    fn latency_min(&self) -> f64 {
        self.points.first().map_or(f64::INFINITY, |p| p.1)
    }
    fn latency_max(&self) -> f64 {
        self.points.last().map_or(0.0, |p| p.1)
    }
}

fn token_factor(read_ratio: f64, write_cost: f64) -> f64 {
    read_ratio + (1.0 - read_ratio) * write_cost
}

fn log_levels(low: f64, high: f64) -> Vec<f64> {
    (0..LEVEL_COUNT)
        .map(|i| low * (high / low).powf(i as f64 / (LEVEL_COUNT - 1) as f64))
        .collect()
}

/// Fits the cost model and the SLO table to `sweep`. `slos_us` are the table's rows.
pub fn fit(sweep: &Sweep, slos_us: &[u64]) -> Result<Fit, CalibrateError> {
    let insufficient = |why: String| CalibrateError::Insufficient(why);
    let size_bytes = sweep
        .config
        .sizes
        .iter()
        .copied()
        .min()
        .ok_or_else(|| insufficient("no sizes".into()))?;
    let read_only = curve_of(&sweep.curve(1.0, size_bytes), 1.0);
    if read_only.points.is_empty() {
        return Err(insufficient("no read-only (100 %) curve".into()));
    }
    let mixed: Vec<Curve> = sweep
        .config
        .read_ratios
        .iter()
        .filter(|&&r| !same_ratio(r, 1.0))
        .map(|&r| curve_of(&sweep.curve(r, size_bytes), r))
        .filter(|c| !c.points.is_empty())
        .collect();
    if mixed.len() < 2 {
        return Err(insufficient("need at least two mixed read ratios".into()));
    }
    // Latency levels every mixed curve crosses, above the unloaded latency.
    let low = mixed.iter().map(Curve::latency_min).fold(0.0, f64::max) * 1.2;
    let high = mixed
        .iter()
        .map(Curve::latency_max)
        .fold(f64::INFINITY, f64::min)
        * 0.95;
    if !(low > 0.0 && high > low) {
        return Err(insufficient(format!(
            "mixed curves share no latency range (from {low:.0} to {high:.0} µs)"
        )));
    }
    let levels = log_levels(low, high);
    // ln(iops) per level per curve.
    let log_iops: Vec<Vec<(f64, f64)>> = levels
        .iter()
        .map(|&level| {
            mixed
                .iter()
                .filter_map(|c| c.iops_at(level).map(|iops| (c.read_ratio, iops.ln())))
                .collect()
        })
        .filter(|row: &Vec<(f64, f64)>| row.len() >= 2)
        .collect();
    if log_iops.is_empty() {
        return Err(insufficient(
            "no latency level crossed by two mixed curves".into(),
        ));
    }
    let objective = |write_cost: f64| -> f64 {
        let mut total = 0.0;
        for row in &log_iops {
            let values: Vec<f64> = row
                .iter()
                .map(|(r, ln_iops)| ln_iops + token_factor(*r, write_cost).ln())
                .collect();
            let mean = values.iter().sum::<f64>() / values.len() as f64;
            total += values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64;
        }
        total / log_iops.len() as f64
    };
    let write_cost = minimise_log(objective, WRITE_COST_MIN, WRITE_COST_MAX);
    let spread = objective(write_cost).sqrt();

    // Read-only cost: mixed tokens over read-only reads at equal latency, median over levels.
    let mut ratios: Vec<f64> = levels
        .iter()
        .filter_map(|&level| {
            let reads = read_only.iops_at(level)?;
            let tokens: Vec<f64> = mixed
                .iter()
                .filter_map(|c| {
                    c.iops_at(level)
                        .map(|i| i * token_factor(c.read_ratio, write_cost))
                })
                .collect();
            if tokens.is_empty() {
                return None;
            }
            Some(tokens.iter().sum::<f64>() / tokens.len() as f64 / reads)
        })
        .collect();
    let read_only_read_cost = median(&mut ratios).ok_or_else(|| {
        insufficient("the read-only curve shares no latency range with the mixed ones".into())
    })?;

    // The SLO table: the most conservative mixed curve and the read-only curve at each SLO.
    let mut token_limits: Vec<TokenLimit> = Vec::new();
    for &slo in slos_us {
        let level = slo as f64;
        let tokens: Option<Vec<f64>> = mixed
            .iter()
            .map(|c| {
                c.iops_at_clamped(level)
                    .map(|i| i * token_factor(c.read_ratio, write_cost))
            })
            .collect();
        let (Some(tokens), Some(reads)) = (tokens, read_only.iops_at_clamped(level)) else {
            continue;
        };
        let tokens_per_sec = tokens.iter().copied().fold(f64::INFINITY, f64::min);
        let previous = token_limits.last().copied();
        token_limits.push(TokenLimit {
            latency_us_p95: slo,
            tokens_per_sec: previous
                .map_or(tokens_per_sec, |p| p.tokens_per_sec.max(tokens_per_sec))
                .round(),
            reads_per_sec_read_only: previous
                .map_or(reads, |p| p.reads_per_sec_read_only.max(reads))
                .round(),
        });
    }
    if token_limits.is_empty() {
        return Err(insufficient(
            "no SLO row is reachable: every SLO is below the unloaded latency".into(),
        ));
    }

    // Larger sizes: read-only IOPS of 4 KiB over those of the size, at equal latency.
    let mut size_costs = Vec::new();
    for &size in &sweep.config.sizes {
        if size == size_bytes {
            continue;
        }
        let curve = curve_of(&sweep.curve(1.0, size), 1.0);
        let mut costs: Vec<f64> = levels
            .iter()
            .filter_map(|&level| Some(read_only.iops_at(level)? / curve.iops_at(level)?))
            .collect();
        if let Some(cost) = median(&mut costs) {
            size_costs.push(SizeCost {
                size_bytes: size,
                tokens_per_command: cost * f64::from(size_bytes.div_ceil(4096).max(1)),
                model_tokens_per_command: f64::from(size.div_ceil(4096).max(1)),
            });
        }
    }

    let profile = DeviceProfile {
        name: sweep.runner.clone(),
        write_cost: round_to(write_cost, 2),
        read_only_read_cost: round_to(read_only_read_cost, 3),
        token_limits,
    };
    profile
        .validate()
        .map_err(|e| insufficient(format!("fitted profile is invalid: {e}")))?;
    Ok(Fit {
        write_cost,
        read_only_read_cost,
        spread,
        size_bytes,
        size_costs,
        profile,
    })
}

fn round_to(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    Some(if values.len().is_multiple_of(2) {
        (values[middle - 1] + values[middle]) / 2.0
    } else {
        values[middle]
    })
}

/// Minimum of `f` on [low, high], searched on a log scale: a grid, then golden sections.
fn minimise_log(f: impl Fn(f64) -> f64, low: f64, high: f64) -> f64 {
    const GRID: usize = 400;
    let (ln_low, ln_high) = (low.ln(), high.ln());
    let at = |i: usize| ln_low + (ln_high - ln_low) * i as f64 / GRID as f64;
    let best = (0..=GRID)
        .min_by(|&a, &b| f(at(a).exp()).total_cmp(&f(at(b).exp())))
        .unwrap_or(0);
    let (mut a, mut b) = (at(best.saturating_sub(1)), at((best + 1).min(GRID)));
    let ratio = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..60 {
        let c = b - ratio * (b - a);
        let d = a + ratio * (b - a);
        if f(c.exp()) <= f(d.exp()) {
            b = d;
        } else {
            a = c;
        }
    }
    ((a + b) / 2.0).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_interpolates_and_flags() {
        let points = [(100.0, 100.0), (200.0, 200.0), (300.0, 600.0)];
        assert_eq!(read_iops_at_latency(&points, 150.0), Some((150.0, false)));
        assert_eq!(read_iops_at_latency(&points, 400.0), Some((250.0, false)));
        assert_eq!(read_iops_at_latency(&points, 50.0), None);
        assert_eq!(read_iops_at_latency(&points, 900.0), Some((300.0, true)));
    }

    #[test]
    fn minimiser_finds_the_valley() {
        let found = minimise_log(|w| (w.ln() - 7f64.ln()).powi(2), 0.25, 200.0);
        assert!((found - 7.0).abs() < 1e-6, "{found}");
    }
}
