//! The request cost model (paper §3.2.1): cost = ⌈size / 4 KiB⌉ × C(type, r).
//!
//! C(read, r < 100 %) = 1 token, C(write) = the profile's `write_cost`, and while the device has
//! seen only reads for a recent window (r = 100 %) a read costs the profile's
//! `read_only_read_cost`. Requests of 4 KiB or less cost as much as 4 KiB: the devices work at
//! 4 KiB granularity.
//!
//! C depends on r only through "r = 100 % or not", so the load tracker ([`LoadMode`] from
//! [`crate::DeviceShared::load_mode`]) only has to know when the last write was submitted.
//!
//! Read-only accounting, without double counting: in read-only mode *every* rate and every cost
//! is expressed in read-only tokens. A read costs `read_only_read_cost`, and the device rate is
//! the profile's read-only column (4 KiB reads per second) × `read_only_read_cost`. So the
//! read-only column alone decides how many reads fit; `read_only_read_cost` only converts reads
//! into tokens so that balances carried across a mode switch keep roughly their value. LC
//! reservations are likewise restated per mode (see [`CostModel::reservation`]).

use serde::{Deserialize, Serialize};

use crate::profile::DeviceProfile;
use crate::tokens::{MILLITOKENS_PER_TOKEN, TokenRate, Tokens};

/// Bytes per cost unit: requests are charged per started 4 KiB.
pub const COST_UNIT_BYTES: u32 = 4096;

/// Largest request the cost model accepts (1 MiB, the protocol's limit): 256 units.
pub const REQUEST_BYTES_MAX: u32 = 1 << 20;

/// Units of a request of at most [`REQUEST_BYTES_MAX`] bytes fit comfortably in a `u32` sum.
const _: () = assert!(REQUEST_BYTES_MAX / COST_UNIT_BYTES == 256);

/// Read or write, as far as cost is concerned (flush and trim are charged as a 4 KiB write).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoKind {
    Read,
    Write,
}

/// Whether the device currently serves only reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoadMode {
    /// Writes were submitted recently: reads cost 1 token, rates are mixed-load rates.
    Mixed = 0,
    /// No write for a whole window: reads cost `read_only_read_cost`, rates are read-only rates.
    ReadOnly = 1,
}

impl LoadMode {
    pub const ALL: [LoadMode; 2] = [LoadMode::Mixed, LoadMode::ReadOnly];

    pub const fn index(self) -> usize {
        self as usize
    }
}

/// Costs per 4 KiB unit, in millitokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CostModel {
    pub read: Tokens,
    pub write: Tokens,
    pub read_read_only: Tokens,
}

impl CostModel {
    /// Costs from a validated profile: a mixed-load read is exactly one token.
    pub fn from_profile(profile: &DeviceProfile) -> CostModel {
        let model = CostModel {
            read: Tokens::ONE,
            write: Tokens::from_tokens_f64(profile.write_cost),
            read_read_only: Tokens::from_tokens_f64(profile.read_only_read_cost),
        };
        assert!(model.write.0 > 0, "validated profiles have positive costs");
        assert!(
            model.read_read_only.0 > 0,
            "validated profiles have positive costs"
        );
        model
    }

    /// Cost units of a request: ⌈size / 4 KiB⌉, at least 1.
    #[inline]
    pub fn units(size_bytes: u32) -> u32 {
        size_bytes.div_ceil(COST_UNIT_BYTES).max(1)
    }

    #[inline]
    pub fn unit_cost(&self, kind: IoKind, mode: LoadMode) -> Tokens {
        match (kind, mode) {
            (IoKind::Read, LoadMode::Mixed) => self.read,
            (IoKind::Read, LoadMode::ReadOnly) => self.read_read_only,
            (IoKind::Write, _) => self.write,
        }
    }

    #[inline]
    pub fn cost(&self, kind: IoKind, size_bytes: u32, mode: LoadMode) -> Tokens {
        let units = i64::from(Self::units(size_bytes));
        Tokens(self.unit_cost(kind, mode).0 * units)
    }

    /// The token rate that pays for `iops` 4 KiB requests per second at `read_percent` reads,
    /// in `mode`'s tokens, rounded up (a reservation is a promise, so round generously):
    /// mixed = IOPS × (r × C(read) + (1 − r) × C(write)), read-only = IOPS × C(read, 100 %).
    ///
    /// In read-only mode the tenant is by definition not writing, so all its IOPS are reads.
    pub fn reservation(&self, iops: u64, read_percent: u8, mode: LoadMode) -> TokenRate {
        assert!(read_percent <= 100, "read_percent {read_percent} > 100");
        let per_hundred_ios = match mode {
            LoadMode::Mixed => {
                u128::from(read_percent) * self.read.0 as u128
                    + u128::from(100 - read_percent) * self.write.0 as u128
            }
            LoadMode::ReadOnly => 100 * self.read_read_only.0 as u128,
        };
        let millitokens_per_sec = (u128::from(iops) * per_hundred_ios).div_ceil(100);
        TokenRate(u64::try_from(millitokens_per_sec).unwrap_or(u64::MAX))
    }

    /// Converts a read rate (4 KiB reads per second in read-only mode) into read-only tokens.
    pub fn read_only_rate(&self, reads_per_sec: f64) -> TokenRate {
        TokenRate::from_tokens_per_sec_f64(
            reads_per_sec * self.read_read_only.0 as f64 / MILLITOKENS_PER_TOKEN as f64,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::TokenLimit;

    fn model() -> CostModel {
        CostModel::from_profile(&DeviceProfile {
            name: "a".into(),
            write_cost: 10.0,
            read_only_read_cost: 0.5,
            token_limits: vec![TokenLimit {
                latency_us_p95: 500,
                tokens_per_sec: 420_000.0,
                reads_per_sec_read_only: 850_000.0,
            }],
        })
    }

    fn check(kind: IoKind, size: u32, mode: LoadMode, expected_tokens: f64) {
        assert_eq!(
            model().cost(kind, size, mode),
            Tokens::from_tokens_f64(expected_tokens),
            "{kind:?} {size} B {mode:?}"
        );
    }

    #[test]
    fn small_requests_cost_like_4k_and_large_ones_scale() {
        check(IoKind::Read, 512, LoadMode::Mixed, 1.0);
        check(IoKind::Read, 1024, LoadMode::Mixed, 1.0);
        check(IoKind::Read, 4096, LoadMode::Mixed, 1.0);
        check(IoKind::Read, 4097, LoadMode::Mixed, 2.0);
        check(IoKind::Read, 32 * 1024, LoadMode::Mixed, 8.0);
        check(IoKind::Write, 4096, LoadMode::Mixed, 10.0);
        check(IoKind::Write, 8192, LoadMode::ReadOnly, 20.0);
        check(IoKind::Read, 4096, LoadMode::ReadOnly, 0.5);
        check(IoKind::Read, 1 << 20, LoadMode::ReadOnly, 128.0);
        check(IoKind::Read, 0, LoadMode::Mixed, 1.0);
    }

    #[test]
    fn reservations_match_the_paper() {
        let m = model();
        // Tenant B of Figure 5: 70K IOPS at 80 % reads costs 196K tokens/s.
        assert_eq!(
            m.reservation(70_000, 80, LoadMode::Mixed),
            TokenRate::from_tokens_per_sec(196_000)
        );
        // §3.2.2: 100K IOPS at 80 % reads and write cost 10: 280K tokens/s.
        assert_eq!(
            m.reservation(100_000, 80, LoadMode::Mixed),
            TokenRate::from_tokens_per_sec(280_000)
        );
        assert_eq!(
            m.reservation(120_000, 100, LoadMode::ReadOnly),
            TokenRate::from_tokens_per_sec(60_000)
        );
        assert_eq!(
            m.read_only_rate(850_000.0),
            TokenRate::from_tokens_per_sec(425_000)
        );
    }
}
