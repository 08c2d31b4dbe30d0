//! When to try connecting again after a connection broke: the policy a caller opts into, and
//! the schedule of attempts it implies, without I/O and without a clock.
//!
//! Why a schedule of its own: every client that reconnects needs the same three answers — how
//! long to wait before the next attempt, when to stop, and how to keep a crowd of clients
//! that lost the same server from knocking on it in step. Keeping them a pure function of
//! (attempts made, time since the break, a jitter sample) lets tests check the exact
//! sequence and lets the drivers stay thin: they sleep for what [`ReconnectSchedule`] says and
//! count the attempt.
//!
//! The delay before attempt `k` (0-based) is 0 for the first attempt (a connection reset by a
//! middlebox comes back at once), then `d_k = min(backoff_max, backoff_initial · 2^(k-1))`,
//! of which the jitter keeps a uniformly drawn part of the upper half: the wait is in
//! `[d_k / 2, d_k)` ("equal jitter": never a thundering herd, never a busy loop). No attempt
//! starts more than `give_up_after` after the break, and at most `attempts_max` are made.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// How a client that lost its connection tries again. Off unless set in
/// [`crate::ClientOptions::reconnect`]: with it, a broken connection is repaired inside the
/// call that noticed it (see the crate docs for what is repeated and what is reported).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Connection attempts per outage (per blocking call, or per pipelined I/O call) before
    /// giving up; 0 gives up at once.
    pub attempts_max: u32,
    /// The nominal wait before the second attempt; doubles per attempt.
    pub backoff_initial: Duration,
    /// Cap of the nominal wait.
    pub backoff_max: Duration,
    /// No attempt starts later than this after the break was noticed; each attempt itself is
    /// bounded by the client's timeout.
    pub give_up_after: Duration,
}

impl Default for ReconnectPolicy {
    /// Rides out a `reflexd` restart (which may wait up to 5 s for its port): waits of about
    /// 50 ms, 100 ms, … up to 5 s, for at most 30 s or 32 attempts.
    fn default() -> Self {
        ReconnectPolicy {
            attempts_max: 32,
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            give_up_after: Duration::from_secs(30),
        }
    }
}

/// A jitter sample: a fraction `jitter / 2^32` of the upper half of the nominal wait.
pub type JitterSample = u32;

impl ReconnectPolicy {
    /// The wait before attempt `attempt_index` (0: the first attempt after the break, made at
    /// once) for the given jitter sample. Pure: the same arguments give the same wait.
    pub fn backoff(&self, attempt_index: u32, jitter: JitterSample) -> Duration {
        if attempt_index == 0 {
            return Duration::ZERO;
        }
        let doublings = (attempt_index - 1).min(64);
        let nominal_ns = self
            .backoff_initial
            .as_nanos()
            .saturating_mul(1u128 << doublings)
            .min(self.backoff_max.as_nanos());
        let floor_ns = nominal_ns / 2;
        let spread_ns = nominal_ns - floor_ns;
        let wait_ns = floor_ns + ((spread_ns * u128::from(jitter)) >> 32);
        assert!(wait_ns <= nominal_ns);
        assert!(wait_ns >= floor_ns);
        duration_from_nanos(wait_ns)
    }
}

fn duration_from_nanos(nanos: u128) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    let secs = u64::try_from(nanos / NANOS_PER_SEC).unwrap_or(u64::MAX);
    Duration::new(secs, (nanos % NANOS_PER_SEC) as u32)
}

/// The attempts of one outage: how many were made and when the next may start.
#[derive(Debug, Clone)]
pub struct ReconnectSchedule {
    policy: ReconnectPolicy,
    attempts_made: u32,
}

impl ReconnectSchedule {
    pub fn new(policy: ReconnectPolicy) -> ReconnectSchedule {
        ReconnectSchedule {
            policy,
            attempts_made: 0,
        }
    }

    pub fn attempts_made(&self) -> u32 {
        self.attempts_made
    }

    /// The wait before the next attempt, `elapsed` after the break, counting that attempt; or
    /// `None`: give up (attempts used up, or `give_up_after` passed). The wait is shortened so
    /// the attempt starts no later than `give_up_after`.
    pub fn next_attempt(&mut self, elapsed: Duration, jitter: JitterSample) -> Option<Duration> {
        if self.attempts_made >= self.policy.attempts_max {
            return None;
        }
        let remaining = self.policy.give_up_after.checked_sub(elapsed)?;
        if remaining.is_zero() && self.attempts_made > 0 {
            return None;
        }
        let wait = self
            .policy
            .backoff(self.attempts_made, jitter)
            .min(remaining);
        self.attempts_made += 1;
        Some(wait)
    }
}

/// The jitter the drivers use: xorshift64*, seeded per client from std's randomly keyed
/// hasher so that clients started together spread out. Tests pass samples directly to
/// [`ReconnectPolicy::backoff`] and [`ReconnectSchedule::next_attempt`] instead.
#[derive(Debug, Clone)]
pub(crate) struct Jitter {
    state: u64,
}

impl Jitter {
    pub(crate) fn from_entropy() -> Jitter {
        let seed = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        Jitter::from_seed(seed)
    }

    pub(crate) fn from_seed(seed: u64) -> Jitter {
        // xorshift has one fixed point, 0.
        Jitter { state: seed | 1 }
    }

    pub(crate) fn next_sample(&mut self) -> JitterSample {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        (self.state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn policy(attempts_max: u32, give_up_after: Duration) -> ReconnectPolicy {
        ReconnectPolicy {
            attempts_max,
            backoff_initial: 100 * MS,
            backoff_max: 1000 * MS,
            give_up_after,
        }
    }

    /// Waits of a whole schedule, `elapsed` advancing by exactly each wait (attempts taking
    /// no time), with one jitter sample for all.
    fn check(policy: ReconnectPolicy, jitter: JitterSample, expected: &[Duration]) {
        let mut schedule = ReconnectSchedule::new(policy);
        let mut elapsed = Duration::ZERO;
        let mut waits = Vec::new();
        while let Some(wait) = schedule.next_attempt(elapsed, jitter) {
            waits.push(wait);
            elapsed += wait;
            assert!(waits.len() <= 100, "schedule does not end");
        }
        assert_eq!(waits, expected);
        assert_eq!(schedule.attempts_made() as usize, expected.len());
    }

    #[test]
    fn without_jitter_waits_are_half_the_nominal_doubling_up_to_the_cap() {
        check(
            policy(7, Duration::from_secs(60)),
            0,
            &[
                Duration::ZERO,
                50 * MS,
                100 * MS,
                200 * MS,
                400 * MS,
                500 * MS,
                500 * MS,
            ],
        );
    }

    #[test]
    fn full_jitter_sample_stays_below_the_nominal_wait() {
        let policy = policy(10, Duration::from_secs(60));
        assert_eq!(
            policy.backoff(1, u32::MAX),
            Duration::from_nanos(99_999_999)
        );
        assert_eq!(policy.backoff(3, 1 << 31), 300 * MS);
        assert_eq!(
            policy.backoff(20, u32::MAX),
            Duration::from_nanos(999_999_999)
        );
        assert_eq!(policy.backoff(u32::MAX, 0), 500 * MS);
    }

    #[test]
    fn the_last_attempt_starts_at_give_up_after_then_the_schedule_ends() {
        // 0, 50, 100, 200 → 350 ms elapsed; the 400 ms wait is cut to the 150 ms left.
        check(
            policy(100, 500 * MS),
            0,
            &[Duration::ZERO, 50 * MS, 100 * MS, 200 * MS, 150 * MS],
        );
    }

    #[test]
    fn zero_attempts_or_zero_time_still_decide_deterministically() {
        check(policy(0, Duration::from_secs(60)), 0, &[]);
        // With no time at all, one immediate attempt is still made.
        check(policy(5, Duration::ZERO), 0, &[Duration::ZERO]);
        let mut schedule = ReconnectSchedule::new(policy(5, 100 * MS));
        assert_eq!(schedule.next_attempt(200 * MS, 0), None, "already past");
    }

    #[test]
    fn huge_settings_saturate_instead_of_overflowing() {
        let policy = ReconnectPolicy {
            attempts_max: u32::MAX,
            backoff_initial: Duration::MAX,
            backoff_max: Duration::MAX,
            give_up_after: Duration::MAX,
        };
        let wait = policy.backoff(40, u32::MAX);
        assert!(wait >= Duration::MAX / 2);
        assert!(wait < Duration::MAX);
    }

    #[test]
    fn seeded_jitter_is_reproducible_and_spreads() {
        let samples = |seed| {
            let mut jitter = Jitter::from_seed(seed);
            (0..64).map(|_| jitter.next_sample()).collect::<Vec<_>>()
        };
        assert_eq!(samples(7), samples(7));
        assert_ne!(samples(7), samples(8));
        let spread = samples(7);
        assert!(spread.iter().any(|sample| *sample < u32::MAX / 4));
        assert!(spread.iter().any(|sample| *sample > u32::MAX / 4 * 3));
    }
}
