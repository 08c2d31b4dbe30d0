//! State one device shares between its dataplane threads: the global token bucket, the
//! "every thread has finished a round" reset rule, and the time of the last write (the load
//! tracker that decides read-only mode). Everything is a `std::sync::atomic`, so the scheduler
//! stays pure (no locks, no clock, no I/O) and the simulator can drive several threads'
//! schedulers deterministically from one OS thread.
//!
//! The bucket is a signed balance in millitokens:
//! * LC tenants donate surplus into it and best-effort tenants donate what they cannot use;
//! * best-effort tenants claim from its positive part when their own tokens fall short;
//! * LC tenants at their deficit limit may *borrow*: take it below zero, down to `-loan_max`;
//!   any later deposit (a best-effort tenant's fresh tokens first repay it) fills the hole.
//!
//! The reset rule (paper §4.1): each participating thread sets its bit after a round; the
//! thread that completes the set clears the bits and discards the bucket's positive balance
//! (a debt is never forgiven, or lending would mint tokens). So donated tokens live for about
//! one round of the slowest thread, which bounds best-effort bursts. Positive deposits are also
//! capped at `bucket_max`, so a thread that stops taking part (say, blocked in its ring) cannot
//! let the bucket grow without bound before it leaves the reset set.
//!
//! Accounting: the bucket counts only what it throws away (`discarded`, a relaxed atomic that
//! is touched only when something is thrown away); what goes in and out is on each thread's
//! [`crate::Ledger`], so `Σ to_bucket − Σ from_bucket − discarded == balance` checks that no
//! token is created or lost without adding atomics to every deposit.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use crate::config::THREADS_MAX;
use crate::cost::LoadMode;
use crate::migration::MigrationBoard;
use crate::time::Nanos;
use crate::tokens::Tokens;

/// Shared per-device scheduler state. Create one per device and hand an `Arc` to each
/// thread's [`crate::Scheduler`].
#[derive(Debug)]
pub struct DeviceShared {
    bucket: AtomicI64,
    bucket_max: AtomicI64,
    loan_max: AtomicI64,
    read_only_window_ns: AtomicU64,
    /// Nanos of the last write submission plus one; 0 = no write yet.
    last_write_plus_one: AtomicU64,
    participants: AtomicU64,
    rounds_done: AtomicU64,
    resets: AtomicU64,
    discarded: AtomicI64,
    /// The threads' loads for inter-core migration (`crate::migration`).
    migration: MigrationBoard,
}

/// A snapshot of the bucket's accounting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketStats {
    pub balance: Tokens,
    /// Thrown away by resets and by the cap.
    pub discarded: Tokens,
    pub resets: u64,
}

impl DeviceShared {
    /// `loan_max` and `bucket_max` start at zero until the first [`crate::DeviceRates`] sets them.
    pub fn new(read_only_window: Nanos) -> DeviceShared {
        DeviceShared {
            bucket: AtomicI64::new(0),
            bucket_max: AtomicI64::new(0),
            loan_max: AtomicI64::new(0),
            read_only_window_ns: AtomicU64::new(read_only_window.0),
            last_write_plus_one: AtomicU64::new(0),
            participants: AtomicU64::new(0),
            rounds_done: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            discarded: AtomicI64::new(0),
            migration: MigrationBoard::default(),
        }
    }

    /// Where this device's threads publish their loads for inter-core migration.
    pub fn migration_board(&self) -> &MigrationBoard {
        &self.migration
    }

    pub(crate) fn set_limits(&self, bucket_max: Tokens, loan_max: Tokens) {
        assert!(bucket_max.0 >= 0, "bucket cap is negative");
        assert!(loan_max.0 >= 0, "loan cap is negative");
        self.bucket_max.store(bucket_max.0, Ordering::Relaxed);
        self.loan_max.store(loan_max.0, Ordering::Relaxed);
    }

    /// Read-only mode: no write submitted within the window before `now`.
    #[inline]
    pub fn load_mode(&self, now: Nanos) -> LoadMode {
        let last = self.last_write_plus_one.load(Ordering::Relaxed);
        if last == 0 {
            return LoadMode::ReadOnly;
        }
        let window = self.read_only_window_ns.load(Ordering::Relaxed);
        if now.0.saturating_sub(last - 1) > window {
            LoadMode::ReadOnly
        } else {
            LoadMode::Mixed
        }
    }

    #[inline]
    pub(crate) fn note_write(&self, now: Nanos) {
        self.last_write_plus_one
            .fetch_max(now.0.saturating_add(1), Ordering::Relaxed);
    }

    /// Adds to the bucket (repaying any debt first), capped at `bucket_max`; returns the
    /// amount kept.
    pub(crate) fn deposit(&self, amount: Tokens) -> Tokens {
        assert!(amount.0 >= 0, "negative deposit {amount}");
        if amount.0 == 0 {
            return Tokens::ZERO;
        }
        let cap = self.bucket_max.load(Ordering::Relaxed);
        let mut kept = 0;
        let _ = self
            .bucket
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |balance| {
                let next = balance.saturating_add(amount.0).min(cap.max(balance));
                kept = next - balance;
                Some(next)
            });
        if kept < amount.0 {
            self.discarded.fetch_add(amount.0 - kept, Ordering::Relaxed);
        }
        Tokens(kept)
    }

    /// Takes up to `want` from the positive balance; returns what was taken.
    pub(crate) fn claim(&self, want: Tokens) -> Tokens {
        if want.0 <= 0 || self.bucket.load(Ordering::Acquire) <= 0 {
            return Tokens::ZERO;
        }
        let mut got = 0;
        let _ = self
            .bucket
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |balance| {
                got = want.0.min(balance.max(0));
                (got > 0).then_some(balance - got)
            });
        Tokens(got)
    }

    /// Takes exactly `want`, letting the balance fall to `-loan_max` at most; all or nothing.
    pub(crate) fn borrow(&self, want: Tokens) -> bool {
        assert!(want.0 > 0, "borrowing nothing");
        let floor = -self.loan_max.load(Ordering::Relaxed);
        self.bucket
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |balance| {
                let next = balance - want.0;
                (next >= floor).then_some(next)
            })
            .is_ok()
    }

    /// Outstanding loans (the bucket's negative part).
    #[inline]
    pub(crate) fn debt(&self) -> Tokens {
        Tokens((-self.bucket.load(Ordering::Acquire)).max(0))
    }

    pub(crate) fn join(&self, thread_index: u16) {
        self.participants
            .fetch_or(thread_bit(thread_index), Ordering::AcqRel);
    }

    pub(crate) fn leave(&self, thread_index: u16) {
        let bit = thread_bit(thread_index);
        self.participants.fetch_and(!bit, Ordering::AcqRel);
        // The set may now be complete without this thread.
        self.finish_round_bits(0);
    }

    /// Marks `thread_index` as having finished a round; resets the bucket when it was the last
    /// participant to do so since the previous reset. Returns whether this call reset it.
    pub(crate) fn finish_round(&self, thread_index: u16) -> bool {
        self.finish_round_bits(thread_bit(thread_index))
    }

    fn finish_round_bits(&self, bit: u64) -> bool {
        let participants = self.participants.load(Ordering::Acquire);
        if participants == 0 {
            return false;
        }
        if participants != bit {
            let done = self.rounds_done.fetch_or(bit, Ordering::AcqRel) | bit;
            if done & participants != participants {
                return false;
            }
            if self
                .rounds_done
                .compare_exchange(done, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // Another thread changed the set meanwhile; whoever completes it next resets.
                return false;
            }
        }
        // (A lone participant completes the set with every round: no bits to keep.)
        self.reset_bucket();
        true
    }

    fn reset_bucket(&self) {
        self.resets.fetch_add(1, Ordering::Relaxed);
        if self.bucket.load(Ordering::Acquire) <= 0 {
            return;
        }
        let mut thrown = 0;
        let _ = self
            .bucket
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |balance| {
                thrown = balance.max(0);
                Some(balance.min(0))
            });
        if thrown > 0 {
            self.discarded.fetch_add(thrown, Ordering::Relaxed);
        }
    }

    pub fn stats(&self) -> BucketStats {
        BucketStats {
            balance: Tokens(self.bucket.load(Ordering::Acquire)),
            discarded: Tokens(self.discarded.load(Ordering::Relaxed)),
            resets: self.resets.load(Ordering::Relaxed),
        }
    }
}

fn thread_bit(thread_index: u16) -> u64 {
    assert!(
        usize::from(thread_index) < THREADS_MAX,
        "thread index {thread_index} beyond {THREADS_MAX}"
    );
    1u64 << thread_index
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> DeviceShared {
        let shared = DeviceShared::new(Nanos::from_millis(1));
        shared.set_limits(Tokens::from_tokens(100), Tokens::from_tokens(50));
        shared
    }

    /// Tracks what the tests put in and took out, like the threads' ledgers do.
    #[derive(Default)]
    struct Book {
        deposited: i64,
        taken: i64,
    }

    impl Book {
        fn deposit(&mut self, b: &DeviceShared, tokens: i64) -> Tokens {
            self.deposited += Tokens::from_tokens(tokens).0;
            b.deposit(Tokens::from_tokens(tokens))
        }
        fn claim(&mut self, b: &DeviceShared, tokens: i64) -> Tokens {
            let got = b.claim(Tokens::from_tokens(tokens));
            self.taken += got.0;
            got
        }
        fn borrow(&mut self, b: &DeviceShared, tokens: i64) -> bool {
            let ok = b.borrow(Tokens::from_tokens(tokens));
            if ok {
                self.taken += Tokens::from_tokens(tokens).0;
            }
            ok
        }
        fn check(&self, b: &DeviceShared) {
            let s = b.stats();
            assert_eq!(
                Tokens(self.deposited - self.taken) - s.discarded,
                s.balance,
                "{s:?}"
            );
        }
    }

    #[test]
    fn deposits_are_capped_and_claims_take_only_the_positive_part() {
        let b = shared();
        let mut book = Book::default();
        assert_eq!(book.deposit(&b, 70), Tokens::from_tokens(70));
        assert_eq!(book.deposit(&b, 70), Tokens::from_tokens(30));
        assert_eq!(book.claim(&b, 150), Tokens::from_tokens(100));
        assert_eq!(book.claim(&b, 1), Tokens::ZERO);
        book.check(&b);
    }

    #[test]
    fn loans_stop_at_the_floor_and_deposits_repay_them() {
        let b = shared();
        let mut book = Book::default();
        assert!(book.borrow(&b, 30));
        assert!(!book.borrow(&b, 30));
        assert!(book.borrow(&b, 20));
        assert_eq!(b.debt(), Tokens::from_tokens(50));
        assert_eq!(book.claim(&b, 1), Tokens::ZERO);
        book.deposit(&b, 60);
        assert_eq!(b.debt(), Tokens::ZERO);
        assert_eq!(b.stats().balance, Tokens::from_tokens(10));
        book.check(&b);
    }

    #[test]
    fn bucket_resets_once_every_participant_finished_a_round() {
        let b = shared();
        let mut book = Book::default();
        b.join(0);
        b.join(3);
        book.deposit(&b, 10);
        assert!(!b.finish_round(0));
        assert!(!b.finish_round(0));
        assert_eq!(b.stats().balance, Tokens::from_tokens(10));
        assert!(b.finish_round(3));
        assert_eq!(b.stats().balance, Tokens::ZERO);
        assert_eq!(b.stats().resets, 1);
        // Debt survives a reset.
        assert!(book.borrow(&b, 5));
        b.finish_round(0);
        assert!(b.finish_round(3));
        assert_eq!(b.stats().balance, Tokens::from_tokens(-5));
        // A thread leaving completes the set for the others.
        b.finish_round(0);
        book.deposit(&b, 25);
        b.leave(3);
        assert_eq!(b.stats().balance, Tokens::ZERO);
        book.check(&b);
        // Alone, every round resets.
        book.deposit(&b, 7);
        assert!(b.finish_round(0));
        assert_eq!(b.stats().balance, Tokens::ZERO);
        book.check(&b);
    }

    #[test]
    fn read_only_until_a_write_then_for_a_window_after_it() {
        let b = shared();
        assert_eq!(b.load_mode(Nanos::ZERO), LoadMode::ReadOnly);
        b.note_write(Nanos::from_micros(10));
        assert_eq!(b.load_mode(Nanos::from_micros(10)), LoadMode::Mixed);
        assert_eq!(b.load_mode(Nanos::from_micros(1010)), LoadMode::Mixed);
        assert_eq!(b.load_mode(Nanos::from_micros(1011)), LoadMode::ReadOnly);
        // An older write reported late does not move the mark back.
        b.note_write(Nanos::from_micros(5));
        assert_eq!(b.load_mode(Nanos::from_micros(1011)), LoadMode::ReadOnly);
    }
}
