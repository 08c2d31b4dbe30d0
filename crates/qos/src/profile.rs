//! Device profiles: what calibration measured about a device and what the scheduler and
//! admission control are configured from.
//!
//! Tokens are counted in units of one 4 KiB read under mixed load: a 4 KiB read costs 1 token,
//! a 4 KiB write costs `write_cost` tokens, and while the device serves only reads a 4 KiB read
//! costs `read_only_read_cost` (< 1: Flash serves reads faster when no writes interfere).
//! `token_limits` gives, for each p95 read-latency SLO, the token rate the device sustains
//! while meeting it, under mixed load and under read-only load.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// One row of a profile: the token rate that keeps p95 read latency at or below the SLO.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TokenLimit {
    pub latency_us_p95: u64,
    /// Mixed read/write load, in tokens per second.
    pub tokens_per_sec: f64,
    /// Read-only load, in 4 KiB reads per second (each costing 1 token under mixed load).
    pub reads_per_sec_read_only: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    pub name: String,
    /// Tokens per 4 KiB write (a 4 KiB read under mixed load costs 1).
    pub write_cost: f64,
    /// Tokens per 4 KiB read while the device serves only reads.
    pub read_only_read_cost: f64,
    /// Sorted by `latency_us_p95`, strictly increasing; rates non-decreasing.
    pub token_limits: Vec<TokenLimit>,
}

#[derive(Debug, Error, PartialEq)]
pub enum ProfileError {
    #[error("profile is not valid TOML: {0}")]
    Parse(String),
    #[error("profile has no token_limits rows")]
    Empty,
    #[error("profile field {field} must be positive and finite, got {value}")]
    NotPositive { field: &'static str, value: f64 },
    #[error("token_limits must have strictly increasing latency_us_p95 (row {row})")]
    Unsorted { row: usize },
}

/// Result of looking up the rate for a latency SLO.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateAtSlo {
    pub tokens_per_sec: f64,
    pub reads_per_sec_read_only: f64,
    /// Set when the SLO lies outside the table and the nearest row was used.
    pub clamped: Option<Clamp>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clamp {
    /// The SLO is stricter than the first row; the first row's rate was used (and the SLO may
    /// not be met).
    StricterThanTable { first_latency_us: u64 },
    /// The SLO is looser than the last row; the last row's rate was used.
    LooserThanTable { last_latency_us: u64 },
}

impl DeviceProfile {
    pub fn from_toml(text: &str) -> Result<DeviceProfile, ProfileError> {
        let profile: DeviceProfile =
            toml::from_str(text).map_err(|e| ProfileError::Parse(e.to_string()))?;
        profile.validate()?;
        Ok(profile)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a profile always serialises")
    }

    pub fn validate(&self) -> Result<(), ProfileError> {
        positive("write_cost", self.write_cost)?;
        positive("read_only_read_cost", self.read_only_read_cost)?;
        if self.token_limits.is_empty() {
            return Err(ProfileError::Empty);
        }
        for (row, limit) in self.token_limits.iter().enumerate() {
            positive("tokens_per_sec", limit.tokens_per_sec)?;
            positive("reads_per_sec_read_only", limit.reads_per_sec_read_only)?;
            if row > 0 && limit.latency_us_p95 <= self.token_limits[row - 1].latency_us_p95 {
                return Err(ProfileError::Unsorted { row });
            }
        }
        Ok(())
    }

    /// Token rates at a p95 latency SLO: linear interpolation between the rows around it,
    /// clamped (and flagged) outside the table.
    pub fn rate_at(&self, latency_us_p95: u64) -> RateAtSlo {
        let rows = &self.token_limits;
        assert!(!rows.is_empty(), "validated profiles have rows");
        let first = rows[0];
        let last = rows[rows.len() - 1];
        if latency_us_p95 < first.latency_us_p95 {
            return RateAtSlo {
                tokens_per_sec: first.tokens_per_sec,
                reads_per_sec_read_only: first.reads_per_sec_read_only,
                clamped: Some(Clamp::StricterThanTable {
                    first_latency_us: first.latency_us_p95,
                }),
            };
        }
        if latency_us_p95 >= last.latency_us_p95 {
            let clamped =
                (latency_us_p95 > last.latency_us_p95).then_some(Clamp::LooserThanTable {
                    last_latency_us: last.latency_us_p95,
                });
            return RateAtSlo {
                tokens_per_sec: last.tokens_per_sec,
                reads_per_sec_read_only: last.reads_per_sec_read_only,
                clamped,
            };
        }
        let upper = rows
            .iter()
            .position(|row| row.latency_us_p95 > latency_us_p95)
            .expect("latency is below the last row");
        let (low, high) = (rows[upper - 1], rows[upper]);
        let fraction = (latency_us_p95 - low.latency_us_p95) as f64
            / (high.latency_us_p95 - low.latency_us_p95) as f64;
        let lerp = |a: f64, b: f64| a + (b - a) * fraction;
        RateAtSlo {
            tokens_per_sec: lerp(low.tokens_per_sec, high.tokens_per_sec),
            reads_per_sec_read_only: lerp(
                low.reads_per_sec_read_only,
                high.reads_per_sec_read_only,
            ),
            clamped: None,
        }
    }
}

impl DeviceProfile {
    /// The p95 read latency the profile predicts for a device driven at `tokens_per_sec`
    /// (mixed load, or read-only load in read-only tokens: reads × `read_only_read_cost`):
    /// the inverse of [`DeviceProfile::rate_at`], linear between rows. Below the first row's
    /// rate the first row's latency (the profile knows nothing faster), beyond the last row's
    /// the last row's (the device is driven past what was measured). Self-calibration compares
    /// it with what the device really did to tell a slower device from a tight target.
    pub fn latency_at(&self, tokens_per_sec: f64, read_only: bool) -> u64 {
        let rows = &self.token_limits;
        assert!(!rows.is_empty(), "validated profiles have rows");
        let rate = |row: &TokenLimit| {
            if read_only {
                row.reads_per_sec_read_only * self.read_only_read_cost
            } else {
                row.tokens_per_sec
            }
        };
        let Some(upper) = rows.iter().position(|row| rate(row) >= tokens_per_sec) else {
            return rows[rows.len() - 1].latency_us_p95;
        };
        if upper == 0 {
            return rows[0].latency_us_p95;
        }
        let (low, high) = (rows[upper - 1], rows[upper]);
        let span = rate(&high) - rate(&low);
        if span <= 0.0 {
            return high.latency_us_p95;
        }
        let fraction = (tokens_per_sec - rate(&low)) / span;
        let latency = low.latency_us_p95 as f64
            + fraction * (high.latency_us_p95 - low.latency_us_p95) as f64;
        latency.round() as u64
    }
}

fn positive(field: &'static str, value: f64) -> Result<(), ProfileError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ProfileError::NotPositive { field, value })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> DeviceProfile {
        DeviceProfile::from_toml(
            r#"
            name = "test"
            write_cost = 10.0
            read_only_read_cost = 0.5
            [[token_limits]]
            latency_us_p95 = 500
            tokens_per_sec = 360000.0
            reads_per_sec_read_only = 850000.0
            [[token_limits]]
            latency_us_p95 = 1000
            tokens_per_sec = 500000.0
            reads_per_sec_read_only = 950000.0
            "#,
        )
        .unwrap()
    }

    #[test]
    fn interpolates_between_rows() {
        let rate = profile().rate_at(750);
        assert_eq!(rate.tokens_per_sec, 430000.0);
        assert_eq!(rate.reads_per_sec_read_only, 900000.0);
        assert_eq!(rate.clamped, None);
    }

    #[test]
    fn clamps_outside_the_table() {
        let p = profile();
        assert_eq!(p.rate_at(500).clamped, None);
        assert_eq!(p.rate_at(1000).clamped, None);
        assert_eq!(
            p.rate_at(100).clamped,
            Some(Clamp::StricterThanTable {
                first_latency_us: 500
            })
        );
        assert_eq!(p.rate_at(100).tokens_per_sec, 360000.0);
        assert_eq!(
            p.rate_at(5000).clamped,
            Some(Clamp::LooserThanTable {
                last_latency_us: 1000
            })
        );
    }

    #[test]
    fn latency_at_inverts_rate_at() {
        let p = profile();
        assert_eq!(p.latency_at(430_000.0, false), 750);
        assert_eq!(p.latency_at(p.rate_at(600).tokens_per_sec, false), 600);
        // Read-only tokens: 900K reads at 0.5 tokens each.
        assert_eq!(p.latency_at(450_000.0, true), 750);
        // Outside the table: the nearest row.
        assert_eq!(p.latency_at(1.0, false), 500);
        assert_eq!(p.latency_at(1e9, false), 1000);
    }

    #[test]
    fn rejects_bad_profiles() {
        let mut p = profile();
        p.token_limits.swap(0, 1);
        assert_eq!(p.validate(), Err(ProfileError::Unsorted { row: 1 }));
        let mut p = profile();
        p.write_cost = -1.0;
        assert!(matches!(
            p.validate(),
            Err(ProfileError::NotPositive { .. })
        ));
        assert!(matches!(
            DeviceProfile::from_toml("name = 3"),
            Err(ProfileError::Parse(_))
        ));
    }

    #[test]
    fn round_trips_through_toml() {
        let p = profile();
        assert_eq!(DeviceProfile::from_toml(&p.to_toml()).unwrap(), p);
    }
}
