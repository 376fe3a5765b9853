//! The policy thread: hibernate sandboxes idle past their keep-alive, then,
//! once the pod's resident memory (`super::resident`) is above its high
//! mark, shrink idle guests and hibernate the least recently used running
//! sandboxes, several at once on a pod of four cores or more, until it is
//! below its low mark; delete
//! sandboxes past their timeout; notice VMMs that died. The policy never hibernates a sandbox
//! with an operation or a guest request (exec, files) in flight.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use torpor_sync::Locked;

use super::vmm;
use super::{Outcome, Service, ServiceError, LOCAL_POD};
use crate::model::{Pod, PodId, Sandbox, SandboxId, Timestamp};
use crate::policy::{idle_past_keep_alive, PolicyDriver, PolicyReason};
use crate::state::SandboxState;
use crate::store::SandboxFilter;

/// Sandboxes with a guest request in flight, with how many.
#[derive(Default, Debug)]
pub struct InFlight(Mutex<HashMap<SandboxId, usize>>);

/// Marks one request in flight until dropped.
pub struct InFlightGuard<'a> {
    set: &'a InFlight,
    id: SandboxId,
}

impl InFlight {
    pub fn enter(&self, id: &SandboxId) -> InFlightGuard<'_> {
        *self.0.locked().entry(id.clone()).or_default() += 1;
        InFlightGuard {
            set: self,
            id: id.clone(),
        }
    }

    pub fn contains(&self, id: &SandboxId) -> bool {
        self.0.locked().contains_key(id)
    }
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        let mut map = self.set.0.locked();
        if let Some(n) = map.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.id);
            }
        }
    }
}

impl Service {
    /// Whether sandbox `id` has a guest request in flight.
    pub fn has_request_in_flight(&self, id: &SandboxId) -> bool {
        self.in_flight.contains(id)
    }

    /// Hibernates `id` for the policy, unless an operation holds it (its
    /// lock is taken) or a guest request is in flight, or, for idleness,
    /// it was used meanwhile. `None` when it was left alone. The in-flight
    /// check runs under the sandbox's lock, and guest requests mark
    /// themselves before they take it, so one cannot slip in between.
    fn policy_hibernate(
        &self,
        id: &SandboxId,
        reason: PolicyReason,
    ) -> Option<Result<Outcome, ServiceError>> {
        let _guard = self.locks.try_lock(id)?;
        if self.in_flight.contains(id) {
            tracing::debug!(sandbox = %id, "a guest request is in flight; not hibernating");
            return None;
        }
        if reason == PolicyReason::Idle {
            let s = self.store.get_sandbox(id).ok()?;
            if !idle_past_keep_alive(&s, Timestamp::now()) {
                return None;
            }
        }
        tracing::info!(sandbox = %id, ?reason, "hibernating by policy");
        let filesystem = reason == PolicyReason::Timeout
            && self.store.get_sandbox(id).ok()?.timeout_hibernation
                == crate::model::HibernationKind::Filesystem;
        if !filesystem {
            return Some(self.hibernate_locked(id, super::hibernate::Exit::Waited));
        }
        // A timeout that keeps only the disk; while the guest agent does
        // not answer (no sync possible) it keeps the memory instead, marked.
        Some(
            match self.hibernate_as_locked(id, super::reboot::Hibernation::FILESYSTEM) {
                Err(ServiceError::Unavailable { message, .. }) => {
                    tracing::warn!(sandbox = %id, "{message}; hibernating with its memory");
                    let marked = super::reboot::Hibernation {
                        kind: crate::model::HibernationKind::Memory,
                        guest: super::reboot::GuestCheck::Mark,
                    };
                    self.hibernate_as_locked(id, marked)
                }
                other => other,
            },
        )
    }

    /// One policy round: the rules of [`crate::policy::run_round`] on the
    /// local pod, with the wall clock and the sandboxes' measured resident
    /// memory.
    pub fn run_policy(&self) {
        let now = Timestamp::now();
        crate::policy::run_round(&mut ServiceDriver(self));
        self.prune_deleted(now);
    }

    /// Removes the rows of sandboxes deleted more than the retention ago.
    fn prune_deleted(&self, now: Timestamp) {
        let retention = i64::try_from(self.config.deleted_retention_ms).unwrap_or(i64::MAX);
        let cutoff = Timestamp(now.0.saturating_sub(retention));
        let Ok(old) = self.store.deleted_before(cutoff) else {
            return;
        };
        for id in old.into_iter().take(256) {
            match self.store.purge_sandbox(&id) {
                Ok(()) => tracing::debug!(sandbox = %id, "pruned a deleted sandbox's row"),
                // Checkpoints of other sandboxes still chain to it: kept.
                Err(e) => tracing::debug!(sandbox = %id, "deleted sandbox kept: {e}"),
            }
        }
    }

    /// A VMM that exited without being asked marks only its sandbox failed.
    fn check_vmm_alive(&self, s: &crate::model::Sandbox) {
        let exited = {
            let mut children = self.children.locked();
            match children.get_mut(&s.id) {
                Some(c) => c.try_wait().ok().flatten(),
                None => None,
            }
        };
        let gone = exited.is_some() || s.vmm.as_ref().is_some_and(|h| !vmm::alive(h));
        // A VMM whose memory file stopped arriving: its sandbox goes back
        // to its hibernation (`lazy.rs`), not to failed.
        if !gone || self.lazy.failing(&s.id) {
            return;
        }
        let _guard = self.locks.lock(&s.id);
        let Ok(current) = self.store.get_sandbox(&s.id) else {
            return;
        };
        if current.state != s.state || current.vmm != s.vmm {
            return; // an operation changed it meanwhile
        }
        self.children.locked().remove(&s.id);
        let files = vmm::VmmFiles::in_dir(&self.sandbox_dir(&s.id));
        let reason = match exited {
            Some(status) if status.code() == Some(torpor_vmm_api::launch::EXIT_OOM) => format!(
                "its VMM was killed by the OOM killer: the sandbox went over its memory limit \
                 (guest memory + {} MiB of VMM overhead)",
                torpor_vmm_api::jail::VMM_OVERHEAD_MIB
            ),
            Some(status) => vmm::exit_reason(status),
            // No status (a VMM this process did not reap, such as a standby
            // shell's): its signal handlers may still have said why.
            None => vmm::exit_reason_from_log(&vmm::log_tail(&files.log))
                .unwrap_or_else(|| "its VMM process disappeared".into()),
        };
        // For operators: how the VMM said it ended, and the guest's last
        // console lines (a kernel panic). The sandbox's reason stays short.
        tracing::warn!(
            sandbox = %s.id,
            "{reason}; VMM log: {}; console: {}",
            vmm::log_tail(&files.log),
            vmm::log_tail(&files.console)
        );
        let _ = self.store.set_sandbox_vmm(&s.id, None);
        self.drop_sandbox_net(&s.id);
        let _ =
            self.store
                .update_sandbox_state(&s.id, s.state, SandboxState::Failed, Some(&reason));
    }
}

/// The service as the policy's driver: the store's sandboxes and pod,
/// the wall clock, real hibernations and the sandboxes' measured resident
/// memory.
struct ServiceDriver<'a>(&'a Service);

impl PolicyDriver for ServiceDriver<'_> {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }

    fn pod(&self) -> Option<Pod> {
        self.0.store.get_pod(&PodId::new(LOCAL_POD)).ok()
    }

    fn sandboxes(&self, states: &[SandboxState]) -> Vec<Sandbox> {
        let filter = SandboxFilter {
            states: states.to_vec(),
            ..Default::default()
        };
        self.0.store.list_sandboxes(&filter).unwrap_or_default()
    }

    fn delete(&mut self, s: &Sandbox) {
        tracing::info!(sandbox = %s.id, "timeout reached; deleting");
        let _ = self.0.delete_sandbox(&s.id);
    }

    fn hibernate(&mut self, s: &Sandbox, reason: PolicyReason) -> Option<bool> {
        match self.0.policy_hibernate(&s.id, reason)? {
            Ok(_) => {
                if reason == PolicyReason::Watermark {
                    tracing::info!(sandbox = %s.id, "pod above its high mark; hibernated one of the least recently used");
                }
                Some(true)
            }
            Err(e) => {
                tracing::warn!(sandbox = %s.id, ?reason, "policy hibernation failed: {e}");
                Some(false)
            }
        }
    }

    fn hibernate_batch(&mut self, batch: &[Sandbox]) -> Vec<Option<bool>> {
        let service = self.0;
        std::thread::scope(|scope| {
            let running: Vec<_> = batch
                .iter()
                .map(|s| {
                    scope
                        .spawn(move || ServiceDriver(service).hibernate(s, PolicyReason::Watermark))
                })
                .collect();
            running
                .into_iter()
                .map(|h| h.join().unwrap_or(Some(false)))
                .collect()
        })
    }

    fn tend(&mut self, s: &Sandbox) {
        self.0.check_vmm_alive(s);
        self.0.regrow_if_active(s);
        let log = vmm::VmmFiles::in_dir(&self.0.sandbox_dir(&s.id)).log;
        if let Err(e) = vmm::cap_log(&log, vmm::MAX_LOG_BYTES) {
            tracing::warn!(sandbox = %s.id, "cannot rotate {}: {e}", log.display());
        }
    }

    fn shrink(&mut self, s: &Sandbox) -> u64 {
        self.0.policy_shrink(s)
    }

    fn memory_bytes(&self, s: &Sandbox) -> u64 {
        s.vmm
            .as_ref()
            .and_then(super::resident::resident_bytes)
            .unwrap_or(0)
    }
}

/// Starts the policy thread; it ends when the service is dropped or closed.
pub(super) fn start(service: &Arc<Service>) {
    let weak: Weak<Service> = Arc::downgrade(service);
    let interval = Duration::from_millis(service.config.policy_interval_ms);
    let stop = service.stop.clone();
    let spawned = std::thread::Builder::new()
        .name("policy".into())
        .spawn(move || loop {
            std::thread::sleep(interval);
            if stop.load(Ordering::SeqCst) {
                return;
            }
            match weak.upgrade() {
                Some(s) => s.run_policy(),
                None => return,
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the policy thread: {e}");
    }
}
