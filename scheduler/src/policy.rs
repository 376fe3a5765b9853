//! The pod's policy decisions, free of the store, the clock and the VMMs:
//! admission (does a sandbox's memory fit the pod's memory times its
//! oversubscription ratio) and one policy round (delete or hibernate
//! sandboxes past their timeout, hibernate those idle past their
//! keep-alive, then hibernate the least recently used while the pod's
//! memory is above its high watermark).
//!
//! One home for these rules, two drivers: `torpor serve` drives them with
//! the store, the wall clock and real VMMs (`service/policy.rs`,
//! `store/admission.rs`); `torpor plan` drives them with a simulated clock
//! and a simulated pod (`crate::plan`). Neither re-implements them.

use crate::model::{OnTimeout, Pod, Sandbox, Timestamp};
use crate::state::SandboxState;

/// Why the policy hibernates a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyReason {
    /// Idle past its keep-alive.
    Idle,
    /// The pod is above its high watermark; least recently used first.
    Watermark,
    /// The timeout of a sandbox whose `on_timeout` is hibernate.
    Timeout,
}

/// A refused admission: what was committed, asked and allowed, in MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refusal {
    pub committed_mib: u64,
    pub asked_mib: u32,
    pub limit_mib: f64,
}

/// Whether `asked_mib` more fits on a pod of `memory_mib` physical MiB
/// with oversubscription `ratio` when `committed_mib` is committed (the
/// memory of its sandboxes that hold a VMM).
pub fn admit(
    memory_mib: u64,
    ratio: f64,
    committed_mib: u64,
    asked_mib: u32,
) -> Result<(), Refusal> {
    let limit_mib = memory_mib as f64 * ratio;
    if (committed_mib.saturating_add(u64::from(asked_mib))) as f64 <= limit_mib {
        return Ok(());
    }
    Err(Refusal {
        committed_mib,
        asked_mib,
        limit_mib,
    })
}

/// Whether `sandbox` has been idle at least its keep-alive at `now`
/// (saturating: a stored keep-alive past `i64::MAX` never elapses).
pub fn idle_past_keep_alive(sandbox: &Sandbox, now: Timestamp) -> bool {
    let idle = now.0.saturating_sub(sandbox.last_active_at.0);
    idle >= i64::try_from(sandbox.keep_alive_ms).unwrap_or(i64::MAX)
}

/// What a policy round acts through: the service (store, VMMs, wall
/// clock) or the planner's simulated pod.
pub trait PolicyDriver {
    /// The clock.
    fn now(&self) -> Timestamp;
    /// The pod the round enforces (its memory and high watermark).
    fn pod(&self) -> Option<Pod>;
    /// The pod's sandboxes in `states`.
    fn sandboxes(&self, states: &[SandboxState]) -> Vec<Sandbox>;
    /// Deletes `s` (its timeout passed).
    fn delete(&mut self, s: &Sandbox);
    /// Hibernates `s` unless it is busy (an operation or a request in
    /// flight) or, for [`PolicyReason::Idle`], was used meanwhile: `None`
    /// when it was left alone, `Some(true)` hibernated, `Some(false)` the
    /// hibernation failed.
    fn hibernate(&mut self, s: &Sandbox, reason: PolicyReason) -> Option<bool>;
    /// Housekeeping of a sandbox the round leaves running (is its VMM
    /// alive, its log rotated).
    fn tend(&mut self, s: &Sandbox);
    /// The memory `s` uses now, in bytes (measured PSS for the service).
    fn memory_bytes(&self, s: &Sandbox) -> u64;
}

/// One policy round: timeouts and keep-alives, then the watermark.
pub fn run_round(d: &mut impl PolicyDriver) {
    let now = d.now();
    let sandboxes = d.sandboxes(&[
        SandboxState::Running,
        SandboxState::Paused,
        SandboxState::Hibernated,
    ]);
    for s in &sandboxes {
        if s.expires_at.is_some_and(|t| t.0 <= now.0) {
            match s.on_timeout {
                OnTimeout::Delete => d.delete(s),
                // Hibernated it stays, past its deadline, until woken and
                // given a new one.
                OnTimeout::Hibernate if s.state == SandboxState::Hibernated => {}
                OnTimeout::Hibernate => {
                    d.hibernate(s, PolicyReason::Timeout);
                }
            }
        } else if s.state == SandboxState::Running && idle_past_keep_alive(s, now) {
            d.hibernate(s, PolicyReason::Idle);
        } else if s.state != SandboxState::Hibernated {
            d.tend(s);
        }
    }
    enforce_watermark(d);
}

/// Hibernates least recently used running sandboxes while the pod's
/// memory is above its high watermark.
pub fn enforce_watermark(d: &mut impl PolicyDriver) {
    let Some(pod) = d.pod() else {
        return;
    };
    let limit = pod.memory_bytes as f64 * pod.high_watermark;
    let mut live: Vec<(Sandbox, u64)> = d
        .sandboxes(&[SandboxState::Running, SandboxState::Paused])
        .into_iter()
        .map(|s| {
            let m = d.memory_bytes(&s);
            (s, m)
        })
        .collect();
    let mut total: u64 = live.iter().map(|(_, m)| m).sum();
    live.sort_by_key(|(s, _)| s.last_active_at.0);
    for (s, freed) in live {
        if (total as f64) <= limit {
            break;
        }
        if let Some(true) = d.hibernate(&s, PolicyReason::Watermark) {
            total = total.saturating_sub(freed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TemplateId;

    #[test]
    fn admission_counts_the_ratio() {
        assert!(admit(1024, 2.0, 1024, 1024).is_ok());
        let r = admit(1024, 2.0, 1024, 1025).unwrap_err();
        assert_eq!(r.committed_mib, 1024);
        assert_eq!(r.limit_mib, 2048.0);
        assert!(admit(1024, 1.0, u64::MAX, 1).is_err());
    }

    #[test]
    fn keep_alive_elapses_without_overflow() {
        let mut s = Sandbox::new(TemplateId::generate(), 64, 1, 1000);
        s.last_active_at = Timestamp(10_000);
        assert!(!idle_past_keep_alive(&s, Timestamp(10_999)));
        assert!(idle_past_keep_alive(&s, Timestamp(11_000)));
        // A clock before the last activity is not idle.
        assert!(!idle_past_keep_alive(&s, Timestamp(0)));
        s.keep_alive_ms = u64::MAX;
        assert!(!idle_past_keep_alive(&s, Timestamp(i64::MAX)));
        s.last_active_at = Timestamp(i64::MIN);
        s.keep_alive_ms = 5;
        assert!(idle_past_keep_alive(&s, Timestamp(i64::MAX)));
    }
}
