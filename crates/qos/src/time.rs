//! Time as a value. `qos`, `proto` and the emulated device never read a clock: callers pass
//! `now`, so the simulator can mint virtual time and the dataplane reads the real clock once
//! per loop iteration.

use std::ops::{Add, AddAssign, Sub};

/// Nanoseconds since an arbitrary epoch fixed by whoever drives the structure
/// (process start for the dataplane, zero for the simulator).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct Nanos(pub u64);

impl Nanos {
    pub const ZERO: Nanos = Nanos(0);
    pub const MAX: Nanos = Nanos(u64::MAX);

    pub const fn from_micros(us: u64) -> Nanos {
        Nanos(us * 1_000)
    }
    pub const fn from_millis(ms: u64) -> Nanos {
        Nanos(ms * 1_000_000)
    }
    pub const fn from_secs(s: u64) -> Nanos {
        Nanos(s * 1_000_000_000)
    }
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }
    pub fn as_micros_f64(self) -> f64 {
        self.0 as f64 / 1e3
    }
    /// `self - earlier`, or zero when `earlier` is later (clocks handed in never go back,
    /// but a stale timestamp must not underflow).
    pub fn saturating_since(self, earlier: Nanos) -> Nanos {
        Nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add for Nanos {
    type Output = Nanos;
    fn add(self, rhs: Nanos) -> Nanos {
        Nanos(self.0 + rhs.0)
    }
}

impl AddAssign for Nanos {
    fn add_assign(&mut self, rhs: Nanos) {
        self.0 += rhs.0;
    }
}

impl Sub for Nanos {
    type Output = Nanos;
    fn sub(self, rhs: Nanos) -> Nanos {
        assert!(
            self.0 >= rhs.0,
            "time went backwards: {} - {}",
            self.0,
            rhs.0
        );
        Nanos(self.0 - rhs.0)
    }
}
