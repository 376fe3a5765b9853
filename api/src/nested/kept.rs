//! What serve keeps of its nested pods' sandboxes, in its own store
//! (`nested_sandboxes`, [`torpor_scheduler::store::NestedSandbox`]): the
//! owners map survives a restart of serve (kill -9 included), and a sandbox
//! whose nested host is gone stays listed, failed with why, instead of
//! disappearing: its routes answer 410 `vm_gone`, and DELETE forgets it.
//! Without a local service (the API tests' fake backend) the map is kept
//! in memory only.

use std::collections::HashMap;

use torpor_scheduler::model::{PodId, Sandbox, SandboxId};
use torpor_scheduler::state::SandboxState;
use torpor_scheduler::store::NestedSandbox;
use torpor_sync::RwLocked;

use super::{internal, Owned};
use crate::backend::SandboxApi;
use crate::error::code;
use crate::service::{SandboxFilter, ServiceError};

impl Owned {
    fn from_kept(s: NestedSandbox) -> (SandboxId, Owned) {
        (
            s.id,
            Owned {
                pod: s.pod,
                tenant: s.tenant,
                access_token: s.access_token,
                env: s.env,
                last_seen: s.last_seen,
                lost: s.lost,
                volumes: s.volumes,
            },
        )
    }

    fn to_kept(&self, id: &SandboxId) -> NestedSandbox {
        NestedSandbox {
            id: id.clone(),
            pod: self.pod.clone(),
            tenant: self.tenant.clone(),
            access_token: self.access_token.clone(),
            env: self.env.clone(),
            last_seen: self.last_seen.clone(),
            lost: self.lost.clone(),
            volumes: self.volumes.clone(),
        }
    }
}

/// The owners map as the store has it (empty without a local service).
pub(super) fn load<L: SandboxApi>(local: &L) -> Result<HashMap<SandboxId, Owned>, ServiceError> {
    let Some(service) = local.service() else {
        return Ok(HashMap::new());
    };
    let kept = service.store().nested_sandboxes().map_err(internal)?;
    Ok(kept.into_iter().map(Owned::from_kept).collect())
}

impl<L: SandboxApi> super::Nested<L> {
    /// Records `owned` as `id`'s, in memory and in the store.
    pub(super) fn keep(&self, id: SandboxId, owned: Owned) -> Result<(), ServiceError> {
        let stored = match self.local.service() {
            Some(service) => service.store().put_nested_sandbox(&owned.to_kept(&id)),
            None => Ok(()),
        };
        self.owners.write_locked().insert(id, owned);
        stored.map_err(|e| internal(format!("recording a nested sandbox: {e}")))
    }

    /// The volumes this server resolved for its nested sandbox `id`, while
    /// it is not lost (what its volume gateway serves it).
    pub fn volumes_of(
        &self,
        id: &SandboxId,
    ) -> Option<Vec<torpor_scheduler::model::MountedVolume>> {
        let owners = self.owners.read_locked();
        let owned = owners.get(id).filter(|o| o.lost.is_none())?;
        Some(owned.volumes.clone())
    }

    /// Forgets `id` (deleted).
    pub(super) fn forget(&self, id: &SandboxId) -> Result<(), ServiceError> {
        self.owners.write_locked().remove(id);
        match self.local.service() {
            Some(service) => service.store().remove_nested_sandbox(id).map_err(internal),
            None => Ok(()),
        }
    }

    /// Keeps the pod's latest answer about `sandbox` when its state
    /// changed (what a lost sandbox is shown as).
    pub(super) fn seen(&self, sandbox: &Sandbox) {
        let changed = {
            let mut owners = self.owners.write_locked();
            match owners.get_mut(&sandbox.id) {
                Some(o) if o.lost.is_none() => {
                    let changed = o.last_seen.as_ref().map(|s| s.state) != Some(sandbox.state);
                    o.last_seen = Some(sandbox.clone());
                    changed
                }
                _ => false,
            }
        };
        if let (true, Some(service)) = (changed, self.local.service()) {
            if let Err(e) = service.store().set_nested_last_seen(&sandbox.id, sandbox) {
                tracing::warn!(sandbox = %sandbox.id, error = %e, "the nested sandbox's state could not be recorded");
            }
        }
    }

    /// Marks every sandbox of a pod other than `keep` (none: of every
    /// pod) as lost, for `reason`; how many were.
    pub fn mark_lost(&self, keep: Option<&PodId>, reason: &str) -> Result<usize, ServiceError> {
        let mut n = 0;
        for (id, o) in self.owners.write_locked().iter_mut() {
            if o.lost.is_none() && keep.is_none_or(|k| *k != o.pod) {
                tracing::warn!(sandbox = %id, pod = %o.pod, %reason, "a nested sandbox is lost");
                o.lost = Some(reason.to_string());
                n += 1;
            }
        }
        if let Some(service) = self.local.service() {
            service
                .store()
                .mark_nested_lost(keep, reason)
                .map_err(internal)?;
        }
        Ok(n)
    }

    /// After pod `pod` was (re-)attached: its sandboxes recorded here that
    /// it no longer lists (it lost them, or they were deleted on it
    /// directly) are marked lost, not dropped; how many.
    pub fn reconcile(&self, pod: &PodId) -> Result<usize, ServiceError> {
        let remote = self.pod(pod).ok_or_else(|| ServiceError::NotFound {
            kind: "pod",
            id: pod.to_string(),
        })?;
        let mut listed = remote.look("/v1/sandboxes")?;
        let listed: Vec<Sandbox> =
            serde_json::from_value(listed["sandboxes"].take()).map_err(internal)?;
        let mut gone = 0;
        for id in self.owned_by(pod, None) {
            if listed
                .iter()
                .any(|s| s.id == id && s.state != SandboxState::Deleted)
            {
                continue;
            }
            let Some(mut owned) = self.owner(&id) else {
                continue;
            };
            let why = format!("its nested pod {pod} no longer knows it");
            tracing::warn!(sandbox = %id, %pod, "a nested sandbox is lost: {why}");
            owned.lost = Some(why);
            self.keep(id, owned)?;
            gone += 1;
        }
        Ok(gone)
    }

    /// The nested sandboxes' pods, lost ones' included (the pods a
    /// restarted serve looks for).
    pub fn kept_pods(&self) -> Vec<PodId> {
        let mut pods: Vec<PodId> = self
            .owners
            .read_locked()
            .values()
            .filter(|o| o.lost.is_none())
            .map(|o| o.pod.clone())
            .collect();
        pods.sort();
        pods.dedup();
        pods
    }

    /// 410 for a lost sandbox, saying why.
    pub(super) fn lost_error(&self, id: &SandboxId) -> Option<ServiceError> {
        let why = self.owner(id)?.lost?;
        Some(ServiceError::Pod {
            status: 410,
            code: code::VM_GONE.into(),
            message: format!("the sandbox's VM has ended: {why}"),
        })
    }

    /// A lost sandbox as listed: the pod's last answer, failed with why.
    pub(super) fn lost_sandbox(&self, id: &SandboxId) -> Option<Result<Sandbox, ServiceError>> {
        let o = self.owner(id)?;
        let why = o.lost?;
        Some(match o.last_seen {
            Some(mut s) => {
                s.state = SandboxState::Failed;
                s.failure_reason = Some(why);
                s.vmm = None;
                (s.access_token, s.env) = (o.access_token, o.env);
                Ok(s)
            }
            None => Err(self.lost_error(id).expect("lost")),
        })
    }

    /// Lost sandboxes `filter` lets through.
    pub(super) fn lost_listed(&self, filter: &SandboxFilter) -> Vec<Sandbox> {
        if !filter.states.is_empty() && !filter.states.contains(&SandboxState::Failed) {
            return Vec::new();
        }
        let ids: Vec<SandboxId> = self
            .owners
            .read_locked()
            .iter()
            .filter(|(_, o)| o.lost.is_some())
            .filter(|(_, o)| {
                filter
                    .tenant
                    .as_deref()
                    .is_none_or(|t| o.tenant.as_deref() == Some(t))
            })
            .map(|(id, _)| id.clone())
            .collect();
        ids.iter()
            .filter_map(|id| self.lost_sandbox(id)?.ok())
            .filter(|s| {
                filter
                    .pod
                    .as_ref()
                    .is_none_or(|p| s.pod.as_ref() == Some(p))
            })
            .filter(|s| filter.template.as_ref().is_none_or(|t| s.template == *t))
            .filter(|s| {
                filter
                    .metadata
                    .iter()
                    .all(|(k, v)| s.metadata.get(k) == Some(v))
            })
            .collect()
    }
}
