//! Rate-limited warnings for events a guest can trigger at will (malformed
//! descriptor chains, MMIO writes out of order, full queues): a guest that
//! repeats one in a loop must not fill the VMM's log. [`guest_warn!`] is
//! `tracing::warn!` behind a per-call-site [`RateLimit`]: at most
//! [`BURST`] lines per [`WINDOW`], then one line saying how many were
//! dropped when the next window opens.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use torpor_sync::Locked;

/// Lines one call site may log per window.
pub const BURST: u32 = 10;
/// The window.
pub const WINDOW: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Window {
    started: Option<Instant>,
    logged: u32,
    dropped: u64,
}

/// One call site's budget.
#[derive(Debug)]
pub struct RateLimit(Mutex<Window>);

impl RateLimit {
    pub const fn new() -> Self {
        RateLimit(Mutex::new(Window {
            started: None,
            logged: 0,
            dropped: 0,
        }))
    }

    /// Whether a line may be logged at `now`: `Some(dropped)` (lines
    /// dropped since the last one logged) or `None` (drop this one).
    pub fn admit(&self, now: Instant) -> Option<u64> {
        let mut w = self.0.locked();
        if w.started.is_none_or(|s| now.duration_since(s) >= WINDOW) {
            w.started = Some(now);
            w.logged = 0;
        }
        if w.logged >= BURST {
            w.dropped += 1;
            return None;
        }
        w.logged += 1;
        Some(std::mem::take(&mut w.dropped))
    }
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::new()
    }
}

/// `tracing::warn!` for guest-triggerable events, rate-limited per call
/// site (see the module docs).
#[macro_export]
macro_rules! guest_warn {
    ($($arg:tt)+) => {{
        static LIMIT: $crate::logging::RateLimit = $crate::logging::RateLimit::new();
        if let Some(dropped) = LIMIT.admit(::std::time::Instant::now()) {
            if dropped > 0 {
                ::tracing::warn!(dropped, "guest-triggered warnings dropped (rate limit)");
            }
            ::tracing::warn!($($arg)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_per_window_then_the_dropped_count() {
        let limit = RateLimit::new();
        let t0 = Instant::now();
        let admitted = (0..1000).filter(|_| limit.admit(t0).is_some()).count();
        assert_eq!(admitted, BURST as usize);
        assert_eq!(limit.admit(t0 + WINDOW / 2), None);
        // The next window reports what the last one dropped, once.
        assert_eq!(limit.admit(t0 + WINDOW), Some(1000 - BURST as u64 + 1));
        assert_eq!(limit.admit(t0 + WINDOW), Some(0));
    }

    #[test]
    fn the_macro_limits_each_call_site() {
        // Only checks that it expands and runs; the budget is `RateLimit`'s.
        for i in 0..100 {
            crate::guest_warn!(i, "a guest did something odd");
        }
    }
}
