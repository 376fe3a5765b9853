//! The pod's side of guest memory ballooning: the policy asks an idle
//! sandbox's guest to give memory back (`crate::policy::balloon_target`
//! decides how much) and gives it back to the guest once the sandbox is
//! active again. VMMs without a balloon (the probe guest, sandboxes booted
//! before it existed) answer `unsupported` and are asked once per idle
//! spell, like the others.

use std::collections::HashMap;
use std::sync::Mutex;

use torpor_vmm_api::control::Request;

use super::vmm;
use super::Service;
use crate::model::{Sandbox, SandboxId, Timestamp};
use crate::policy::balloon_target;

/// When each sandbox's guest was last asked to shrink.
#[derive(Default)]
pub struct Shrunk(Mutex<HashMap<SandboxId, Timestamp>>);

impl Shrunk {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Timestamp>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Service {
    /// [`crate::policy::PolicyDriver::shrink`] for the service: reads the
    /// balloon's statistics and sets its target, unless the sandbox is
    /// busy or was asked since its last activity.
    pub(super) fn policy_shrink(&self, s: &Sandbox) -> u64 {
        let Some(handle) = s.vmm.as_ref() else {
            return 0;
        };
        if self
            .shrunk
            .map()
            .get(&s.id)
            .is_some_and(|at| at.0 >= s.last_active_at.0)
        {
            return 0;
        }
        let Some(_guard) = self.locks.try_lock(&s.id) else {
            return 0;
        };
        if self.in_flight.contains(&s.id) {
            return 0;
        }
        self.shrunk.map().insert(s.id.clone(), Timestamp::now());
        let balloon = match vmm::call(handle, &Request::BalloonStats) {
            Ok(r) => r.balloon,
            Err(e) => {
                tracing::debug!(sandbox = %s.id, "no balloon to shrink: {e}");
                return 0;
            }
        };
        let Some((target_mib, expected)) = balloon.as_ref().and_then(balloon_target) else {
            return 0;
        };
        match vmm::call(handle, &Request::SetBalloon { target_mib }) {
            Ok(_) => {
                tracing::info!(
                    sandbox = %s.id,
                    target_mib,
                    expected_mib = expected >> 20,
                    "pod above its high watermark; asked an idle guest to shrink"
                );
                expected
            }
            Err(e) => {
                tracing::warn!(sandbox = %s.id, "cannot set the balloon target: {e}");
                0
            }
        }
    }

    /// A shrunk sandbox that was active since it was asked gets its memory
    /// back (balloon target 0); the record goes either way once answered.
    pub(super) fn regrow_if_active(&self, s: &Sandbox) {
        let asked = self.shrunk.map().get(&s.id).copied();
        let Some(at) = asked.filter(|at| at.0 < s.last_active_at.0) else {
            return;
        };
        let Some(handle) = s.vmm.as_ref() else {
            return;
        };
        match vmm::call(handle, &Request::SetBalloon { target_mib: 0 }) {
            Ok(_) => {
                tracing::info!(sandbox = %s.id, "active again; balloon deflated");
                self.forget_shrink(&s.id, at);
            }
            // Nothing to give back on a VMM without a balloon.
            Err(super::ServiceError::Vm(e)) if e.kind == torpor_vmm_api::ErrorKind::Unsupported => {
                self.forget_shrink(&s.id, at)
            }
            Err(e) => tracing::warn!(sandbox = %s.id, "cannot deflate the balloon: {e}"),
        }
    }

    fn forget_shrink(&self, id: &SandboxId, at: Timestamp) {
        let mut map = self.shrunk.map();
        if map.get(id).is_some_and(|t| t.0 == at.0) {
            map.remove(id);
        }
    }
}
