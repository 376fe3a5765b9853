//! Token-bucket rate limiting for device I/O: one bucket for bytes and one
//! for operations (packets), either optional. A bucket holds at most
//! `burst` tokens and gains `per_sec` tokens a second; an operation of `n`
//! bytes takes `n` byte tokens and one operation token, and waits while
//! either bucket is short. Time comes from a [`Clock`], so tests count
//! tokens on a clock they move by hand instead of measuring wall time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub use torpor_vmm_api::launch::{RateLimit, TokenRate};

const NS_PER_SEC: u128 = 1_000_000_000;

/// Monotonic nanoseconds.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ns(&self) -> u64;
}

/// The host's monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock(Instant);

impl Default for MonotonicClock {
    fn default() -> Self {
        Self(Instant::now())
    }
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        self.0.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64
    }
}

/// A clock that moves only when told (tests).
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn advance_ns(&self, ns: u64) {
        self.0.fetch_add(ns, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// One bucket.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    per_sec: u64,
    capacity: u64,
    tokens: u64,
    /// Fraction of a token earned so far, in token-nanoseconds.
    partial: u128,
    last_ns: u64,
}

impl TokenBucket {
    /// A full bucket. `rate.burst` defaults to one second's worth; a zero
    /// rate or burst is refused by `RateLimit::check` and taken as 1 here.
    pub fn new(rate: &TokenRate, now_ns: u64) -> Self {
        let per_sec = rate.per_sec.max(1);
        let capacity = rate.burst.unwrap_or(per_sec).max(1);
        Self {
            per_sec,
            capacity,
            tokens: capacity,
            partial: 0,
            last_ns: now_ns,
        }
    }

    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    fn refill(&mut self, now_ns: u64) {
        let elapsed = now_ns.saturating_sub(self.last_ns);
        self.last_ns = self.last_ns.max(now_ns);
        if self.tokens >= self.capacity {
            self.partial = 0;
            return;
        }
        let earned = u128::from(elapsed) * u128::from(self.per_sec) + self.partial;
        let whole = earned / NS_PER_SEC;
        self.partial = earned % NS_PER_SEC;
        let room = u128::from(self.capacity - self.tokens);
        if whole >= room {
            self.tokens = self.capacity;
            self.partial = 0;
        } else {
            self.tokens += whole as u64;
        }
    }

    /// Tokens `n` needs to be present: an operation larger than the bucket
    /// waits for a full bucket and empties it.
    fn needed(&self, n: u64) -> u64 {
        n.min(self.capacity)
    }

    /// Nanoseconds until `n` tokens are there (0: now). Call after refill.
    fn wait_ns(&self, n: u64) -> u64 {
        let need = self.needed(n);
        if self.tokens >= need {
            return 0;
        }
        let missing = u128::from(need - self.tokens) * NS_PER_SEC - self.partial;
        missing
            .div_ceil(u128::from(self.per_sec))
            .min(u128::from(u64::MAX)) as u64
    }

    fn take(&mut self, n: u64) {
        self.tokens = self.tokens.saturating_sub(n);
    }
}

/// A byte bucket and an operation bucket, either absent (unlimited).
#[derive(Clone)]
pub struct RateLimiter {
    bytes: Option<TokenBucket>,
    ops: Option<TokenBucket>,
    clock: Arc<dyn Clock>,
    /// Times an operation had to wait.
    throttled: u64,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter")
            .field("bytes", &self.bytes)
            .field("ops", &self.ops)
            .field("throttled", &self.throttled)
            .finish()
    }
}

impl RateLimiter {
    pub fn new(limit: &RateLimit, clock: Arc<dyn Clock>) -> Self {
        let now = clock.now_ns();
        Self {
            bytes: limit.bytes.as_ref().map(|r| TokenBucket::new(r, now)),
            ops: limit.packets.as_ref().map(|r| TokenBucket::new(r, now)),
            clock,
            throttled: 0,
        }
    }

    pub fn is_unlimited(&self) -> bool {
        self.bytes.is_none() && self.ops.is_none()
    }

    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// `Ok` if an operation of `bytes` may go now (it takes nothing: call
    /// [`consume`](Self::consume) once it went); else how many
    /// nanoseconds to wait.
    pub fn check(&mut self, bytes: u64) -> Result<(), u64> {
        if self.is_unlimited() {
            return Ok(());
        }
        let now = self.clock.now_ns();
        let mut wait = 0;
        if let Some(b) = &mut self.bytes {
            b.refill(now);
            wait = wait.max(b.wait_ns(bytes));
        }
        if let Some(o) = &mut self.ops {
            o.refill(now);
            wait = wait.max(o.wait_ns(1));
        }
        if wait == 0 {
            Ok(())
        } else {
            self.throttled += 1;
            Err(wait)
        }
    }

    /// Takes the tokens of an operation of `bytes` that went.
    pub fn consume(&mut self, bytes: u64) {
        if let Some(b) = &mut self.bytes {
            b.take(bytes);
        }
        if let Some(o) = &mut self.ops {
            o.take(1);
        }
    }

    /// Tokens left in the byte and operation buckets (None: unlimited).
    pub fn tokens(&self) -> (Option<u64>, Option<u64>) {
        (
            self.bytes.as_ref().map(TokenBucket::tokens),
            self.ops.as_ref().map(TokenBucket::tokens),
        )
    }

    /// How many times an operation had to wait.
    pub fn throttled(&self) -> u64 {
        self.throttled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(
        bytes: Option<(u64, Option<u64>)>,
        packets: Option<u64>,
    ) -> (RateLimiter, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::default());
        let limit = RateLimit {
            bytes: bytes.map(|(per_sec, burst)| TokenRate { per_sec, burst }),
            packets: packets.map(|per_sec| TokenRate {
                per_sec,
                burst: None,
            }),
        };
        (RateLimiter::new(&limit, clock.clone()), clock)
    }

    #[test]
    fn unlimited_never_waits() {
        let (mut l, _) = limiter(None, None);
        for _ in 0..1000 {
            assert_eq!(l.check(1 << 20), Ok(()));
            l.consume(1 << 20);
        }
        assert_eq!(l.throttled(), 0);
    }

    #[test]
    fn bytes_refill_at_the_rate_and_cap_at_the_burst() {
        // 1000 bytes/s, bucket of 500.
        let (mut l, clock) = limiter(Some((1000, Some(500))), None);
        assert_eq!(l.tokens().0, Some(500));
        assert_eq!(l.check(400), Ok(()));
        l.consume(400);
        assert_eq!(l.tokens().0, Some(100));
        // 300 more bytes need 200 tokens: 200 ms.
        assert_eq!(l.check(300), Err(200_000_000));
        clock.advance_ns(100_000_000);
        assert_eq!(l.check(300), Err(100_000_000));
        assert_eq!(l.tokens().0, Some(200));
        // Fractions of a token are kept, not lost to rounding.
        for _ in 0..10 {
            clock.advance_ns(10_000_000 - 1);
            let _ = l.check(300);
        }
        assert_eq!(l.tokens().0, Some(299));
        clock.advance_ns(10);
        assert_eq!(l.check(300), Ok(()));
        l.consume(300);
        assert_eq!(l.tokens().0, Some(0));
        // A long idle time fills the bucket only up to its size.
        clock.advance_ns(3_600 * 1_000_000_000);
        assert_eq!(l.check(1), Ok(()));
        assert_eq!(l.tokens().0, Some(500));
        assert_eq!(l.throttled(), 12);
    }

    #[test]
    fn an_operation_larger_than_the_bucket_waits_for_a_full_bucket() {
        let (mut l, clock) = limiter(Some((100, Some(100))), None);
        l.consume(50);
        assert_eq!(l.check(1500), Err(500_000_000));
        clock.advance_ns(500_000_000);
        assert_eq!(l.check(1500), Ok(()));
        l.consume(1500);
        assert_eq!(l.tokens().0, Some(0));
    }

    #[test]
    fn packets_are_counted_apart_from_bytes() {
        // 10 packets/s (burst 10), bytes unlimited.
        let (mut l, clock) = limiter(None, Some(10));
        for _ in 0..10 {
            assert_eq!(l.check(60_000), Ok(()));
            l.consume(60_000);
        }
        assert_eq!(l.check(1), Err(100_000_000));
        clock.advance_ns(250_000_000);
        // Two packets' worth came back.
        assert_eq!(l.tokens(), (None, Some(0)));
        assert_eq!(l.check(1), Ok(()));
        assert_eq!(l.tokens(), (None, Some(2)));
    }

    #[test]
    fn both_buckets_must_agree() {
        let (mut l, clock) = limiter(Some((1000, None)), Some(1));
        assert_eq!(l.check(100), Ok(()));
        l.consume(100);
        // Plenty of bytes, no packet token for a second.
        assert_eq!(l.check(100), Err(1_000_000_000));
        clock.advance_ns(1_000_000_000);
        assert_eq!(l.check(100), Ok(()));
    }
}
