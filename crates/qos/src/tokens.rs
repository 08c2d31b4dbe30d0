//! Tokens and token rates as exact integers.
//!
//! A token is the device time of one 4 KiB random read under mixed load (paper §3.2.1). The
//! scheduler keeps every balance in *millitokens* (`i64`) so that sums are exact and the
//! conservation of tokens (generated + claimed = spent + donated + held) can be asserted after
//! every round instead of drifting with floating-point error.
//!
//! Rates are millitokens per second (`u64`). For accrual the scheduler converts a rate once into
//! millitokens per nanosecond in Q32 fixed point ([`TokenRate::q32`]) and keeps the fractional
//! millitoken of each accumulator (`frac`), so accrual over many short rounds adds up to exactly
//! the same total as accrual over one long interval.

use std::fmt;
use std::ops::{Add, AddAssign, Neg, Sub, SubAssign};

/// Millitokens per token.
pub const MILLITOKENS_PER_TOKEN: i64 = 1_000;

/// A token amount in millitokens; negative for a deficit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tokens(pub i64);

impl Tokens {
    pub const ZERO: Tokens = Tokens(0);
    pub const ONE: Tokens = Tokens(MILLITOKENS_PER_TOKEN);

    pub const fn from_tokens(tokens: i64) -> Tokens {
        Tokens(tokens * MILLITOKENS_PER_TOKEN)
    }

    /// Rounds to the nearest millitoken.
    pub fn from_tokens_f64(tokens: f64) -> Tokens {
        assert!(tokens.is_finite(), "token amount must be finite: {tokens}");
        Tokens((tokens * MILLITOKENS_PER_TOKEN as f64).round() as i64)
    }

    pub const fn millitokens(self) -> i64 {
        self.0
    }

    pub fn as_tokens_f64(self) -> f64 {
        self.0 as f64 / MILLITOKENS_PER_TOKEN as f64
    }
}

impl Add for Tokens {
    type Output = Tokens;
    fn add(self, rhs: Tokens) -> Tokens {
        Tokens(self.0 + rhs.0)
    }
}

impl AddAssign for Tokens {
    fn add_assign(&mut self, rhs: Tokens) {
        self.0 += rhs.0;
    }
}

impl Sub for Tokens {
    type Output = Tokens;
    fn sub(self, rhs: Tokens) -> Tokens {
        Tokens(self.0 - rhs.0)
    }
}

impl SubAssign for Tokens {
    fn sub_assign(&mut self, rhs: Tokens) {
        self.0 -= rhs.0;
    }
}

impl Neg for Tokens {
    type Output = Tokens;
    fn neg(self) -> Tokens {
        Tokens(-self.0)
    }
}

impl fmt::Display for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3} tokens", self.as_tokens_f64())
    }
}

/// A token rate in millitokens per second.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TokenRate(pub u64);

impl TokenRate {
    pub const ZERO: TokenRate = TokenRate(0);

    pub const fn from_tokens_per_sec(tokens_per_sec: u64) -> TokenRate {
        TokenRate(tokens_per_sec * MILLITOKENS_PER_TOKEN as u64)
    }

    /// Rounds down to a whole millitoken per second (rates of the device are capacities, so
    /// rounding down is the safe direction).
    pub fn from_tokens_per_sec_f64(tokens_per_sec: f64) -> TokenRate {
        assert!(
            tokens_per_sec.is_finite() && tokens_per_sec >= 0.0,
            "token rate must be finite and non-negative: {tokens_per_sec}"
        );
        TokenRate((tokens_per_sec * MILLITOKENS_PER_TOKEN as f64).floor() as u64)
    }

    pub const fn millitokens_per_sec(self) -> u64 {
        self.0
    }

    pub fn as_tokens_per_sec_f64(self) -> f64 {
        self.0 as f64 / MILLITOKENS_PER_TOKEN as f64
    }

    /// Millitokens per nanosecond in Q32 fixed point, rounded down. The error is below
    /// 2^-32 millitokens per nanosecond (0.24 millitokens per second).
    pub fn q32(self) -> u64 {
        let q = (u128::from(self.0) << 32) / 1_000_000_000;
        u64::try_from(q).unwrap_or(u64::MAX)
    }

    /// The share `numerator / denominator` of this rate, rounded down.
    pub fn share(self, numerator: u64, denominator: u64) -> TokenRate {
        assert!(denominator > 0, "share of zero parts");
        assert!(numerator <= denominator, "share larger than the whole");
        let part = u128::from(self.0) * u128::from(numerator) / u128::from(denominator);
        TokenRate(part as u64)
    }
}

impl Add for TokenRate {
    type Output = TokenRate;
    fn add(self, rhs: TokenRate) -> TokenRate {
        TokenRate(self.0 + rhs.0)
    }
}

impl fmt::Display for TokenRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", HumanRate(self.as_tokens_per_sec_f64()))
    }
}

/// Formats a tokens-per-second figure the way the paper writes them: `196K tokens/s`.
pub struct HumanRate(pub f64);

impl fmt::Display for HumanRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let value = self.0;
        if value.abs() >= 10_000_000.0 {
            write!(f, "{:.0}M tokens/s", value / 1e6)
        } else if value.abs() >= 1_000_000.0 {
            write!(f, "{:.2}M tokens/s", value / 1e6)
        } else if value.abs() >= 1_000.0 {
            write!(f, "{:.0}K tokens/s", value / 1e3)
        } else {
            write!(f, "{value:.0} tokens/s")
        }
    }
}

/// Adds `rate_q32 × elapsed_ns` to an accumulator whose fractional millitoken is `frac`, and
/// returns the whole millitokens earned. Exact: accrual split over many intervals sums to the
/// accrual over their union.
#[inline]
pub(crate) fn accrue(rate_q32: u64, elapsed_ns: u64, frac: &mut u32) -> i64 {
    let total = u128::from(rate_q32) * u128::from(elapsed_ns) + u128::from(*frac);
    *frac = total as u32;
    i64::try_from(total >> 32).unwrap_or(i64::MAX)
}

/// Nanoseconds until an accumulator at `rate_q32` with fractional part `frac` has earned
/// `need` more millitokens; `None` at rate zero.
#[inline]
pub(crate) fn time_to_earn(rate_q32: u64, need: i64, frac: u32) -> Option<u64> {
    if need <= 0 {
        return Some(0);
    }
    if rate_q32 == 0 {
        return None;
    }
    let target = (u128::from(need.unsigned_abs()) << 32).saturating_sub(u128::from(frac));
    let ns = target.div_ceil(u128::from(rate_q32));
    Some(u64::try_from(ns).unwrap_or(u64::MAX))
}

/// `rate_q32 × span_ns` without keeping a fraction (used for limits, not balances).
#[inline]
pub(crate) fn amount_over(rate_q32: u64, span_ns: u64) -> i64 {
    let total = u128::from(rate_q32) * u128::from(span_ns);
    i64::try_from(total >> 32).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accrual_is_exact_over_split_intervals() {
        let rate = TokenRate::from_tokens_per_sec(120_000);
        let q = rate.q32();
        let mut frac_split = 0u32;
        let mut split = 0i64;
        for step in 1..=10_000u64 {
            split += accrue(q, 97 + step % 13, &mut frac_split);
        }
        let total_ns: u64 = (1..=10_000u64).map(|step| 97 + step % 13).sum();
        let mut frac_once = 0u32;
        let once = accrue(q, total_ns, &mut frac_once);
        assert_eq!(split, once);
        assert_eq!(frac_split, frac_once);
        // 120K tokens/s for ~1.03 ms is ~124 tokens; the Q32 rounding loses far below 1 mt.
        let expected = 120_000.0 * total_ns as f64 / 1e9 * 1000.0;
        assert!((once as f64 - expected).abs() < 1.0, "{once} vs {expected}");
    }

    #[test]
    fn time_to_earn_inverts_accrue() {
        let q = TokenRate::from_tokens_per_sec(52_000).q32();
        for need in [1i64, 999, 1000, 10_000, 123_457] {
            for frac in [0u32, 1 << 31, u32::MAX] {
                let ns = time_to_earn(q, need, frac).unwrap();
                let mut f = frac;
                assert!(accrue(q, ns, &mut f) >= need, "need {need} frac {frac}");
                let mut f = frac;
                assert!(accrue(q, ns - 1, &mut f) < need, "need {need} frac {frac}");
            }
        }
        assert_eq!(time_to_earn(0, 5, 0), None);
        assert_eq!(time_to_earn(q, 0, 0), Some(0));
    }

    #[test]
    fn formats_like_the_paper() {
        assert_eq!(
            TokenRate::from_tokens_per_sec(196_000).to_string(),
            "196K tokens/s"
        );
        assert_eq!(HumanRate(82_400.0).to_string(), "82K tokens/s");
        assert_eq!(HumanRate(1_500_000.0).to_string(), "1.50M tokens/s");
        assert_eq!(Tokens::from_tokens(-50).to_string(), "-50.000 tokens");
    }

    #[test]
    fn share_splits_exactly_with_remainder_rounded_down() {
        let rate = TokenRate(1_000_001);
        assert_eq!(rate.share(1, 3).0, 333_333);
        assert_eq!(rate.share(3, 3), rate);
    }
}
