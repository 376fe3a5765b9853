//! How long a sandbox lives: its keep-alive (idle time before the policy
//! hibernates it) and its timeout (time from now before the policy deletes
//! it). Both come from clients as `u64` milliseconds and are bounded, so
//! that deadlines are computed without overflow: a timeout near `u64::MAX`
//! once wrapped to a deadline in the past, and the next policy round
//! deleted the sandbox.

use super::ServiceError;
use crate::model::Timestamp;

/// Largest `timeout_ms` a sandbox may be given: 30 days.
pub const MAX_TIMEOUT_MS: u64 = 30 * 24 * 60 * 60 * 1000;
/// Largest `keep_alive_ms` a sandbox (or the service's default) may have:
/// 30 days.
pub const MAX_KEEP_ALIVE_MS: u64 = 30 * 24 * 60 * 60 * 1000;

/// Refuses (`Invalid`, 400) a keep-alive or a timeout past its maximum.
pub fn check_lifetimes(
    keep_alive_ms: Option<u64>,
    timeout_ms: Option<u64>,
) -> Result<(), ServiceError> {
    if let Some(k) = keep_alive_ms.filter(|&k| k > MAX_KEEP_ALIVE_MS) {
        return Err(ServiceError::Invalid(format!(
            "keep_alive_ms {k} is above the maximum of {MAX_KEEP_ALIVE_MS} (30 days)"
        )));
    }
    if let Some(t) = timeout_ms.filter(|&t| t > MAX_TIMEOUT_MS) {
        return Err(ServiceError::Invalid(format!(
            "timeout_ms {t} is above the maximum of {MAX_TIMEOUT_MS} (30 days)"
        )));
    }
    Ok(())
}

/// The deadline `timeout_ms` after `now`, refused past [`MAX_TIMEOUT_MS`].
pub(super) fn expiry(now: Timestamp, timeout_ms: u64) -> Result<Timestamp, ServiceError> {
    check_lifetimes(None, Some(timeout_ms))?;
    i64::try_from(timeout_ms)
        .ok()
        .and_then(|ms| now.0.checked_add(ms))
        .map(Timestamp)
        .ok_or_else(|| ServiceError::Invalid(format!("timeout_ms {timeout_ms} is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifetimes_are_bounded_and_deadlines_never_overflow() {
        check_lifetimes(Some(MAX_KEEP_ALIVE_MS), Some(MAX_TIMEOUT_MS)).unwrap();
        check_lifetimes(None, None).unwrap();
        for too_long in [MAX_TIMEOUT_MS + 1, i64::MAX as u64, u64::MAX] {
            for (k, t) in [(Some(too_long), None), (None, Some(too_long))] {
                assert!(
                    matches!(check_lifetimes(k, t), Err(ServiceError::Invalid(_))),
                    "{k:?} {t:?}"
                );
            }
            assert!(matches!(
                expiry(Timestamp(i64::MAX - 1), too_long),
                Err(ServiceError::Invalid(_))
            ));
        }
        let now = Timestamp::now();
        assert_eq!(
            expiry(now, MAX_TIMEOUT_MS).unwrap(),
            Timestamp(now.0 + MAX_TIMEOUT_MS as i64)
        );
        assert!(matches!(
            expiry(Timestamp(i64::MAX - 1), 2),
            Err(ServiceError::Invalid(_))
        ));
    }
}
