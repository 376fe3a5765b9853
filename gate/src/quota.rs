//! Tenants' quotas: running sandboxes, sandboxes in all, memory committed
//! and disk for snapshots and checkpoints. A create, fork or template build
//! is admitted against its tenant's quotas by [`Quotas::admit`], which
//! counts the tenant's use (its sandboxes, from the service) plus what is
//! admitted and not finished yet, under the tenant's own lock: parallel
//! requests cannot all pass the check before any of them counts. Refusals
//! are 429 `quota_exceeded` naming the quota, its limit and the use. A
//! cluster replica admits its creates in PostgreSQL instead, atomically
//! across replicas (`cluster/admission.rs`), with [`usage_of`] and
//! [`check`].
//!
//! Snapshot disk is counted as an upper bound: every hibernated sandbox,
//! every checkpoint and every template of the tenant's (built, or made
//! from a sandbox) as its memory size (a snapshot holds at most the
//! guest's memory; diff layers hold less).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use torpor_scheduler::model::{Sandbox, SandboxState, Template, TemplateState};
use torpor_scheduler::store::admission::HOLDING_VMM;
use torpor_sync::Locked;

use crate::backend::{on_pod, Needs, SandboxApi};
use crate::service::{SandboxFilter, ServiceError};

/// A tenant's limits; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Sandboxes holding a VM (creating, running, paused, hibernating,
    /// resuming), template builds included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_sandboxes: Option<u64>,
    /// Sandboxes that are not deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_sandboxes: Option<u64>,
    /// Memory of the sandboxes holding a VM, MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Snapshot and checkpoint disk (upper bound, see the module), MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_disk_mib: Option<u64>,
}

/// What a tenant uses now (and, in a cluster, what a pending create
/// asked: stored with its operation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    pub running_sandboxes: u64,
    pub total_sandboxes: u64,
    pub memory_mib: u64,
    pub snapshot_disk_mib: u64,
}

impl Usage {
    pub fn add(&mut self, other: &Usage) {
        self.running_sandboxes += other.running_sandboxes;
        self.total_sandboxes += other.total_sandboxes;
        self.memory_mib += other.memory_mib;
        self.snapshot_disk_mib += other.snapshot_disk_mib;
    }

    fn sub(&mut self, other: &Usage) {
        self.running_sandboxes = self
            .running_sandboxes
            .saturating_sub(other.running_sandboxes);
        self.total_sandboxes = self.total_sandboxes.saturating_sub(other.total_sandboxes);
        self.memory_mib = self.memory_mib.saturating_sub(other.memory_mib);
        self.snapshot_disk_mib = self
            .snapshot_disk_mib
            .saturating_sub(other.snapshot_disk_mib);
    }

    /// What one more sandbox (or template build) of `mem_mib` adds.
    pub fn sandbox(mem_mib: u64) -> Usage {
        Usage {
            running_sandboxes: 1,
            total_sandboxes: 1,
            memory_mib: mem_mib,
            snapshot_disk_mib: 0,
        }
    }

    /// What waking a hibernated sandbox of `mem_mib` adds: a VM again,
    /// not another sandbox.
    pub fn wake(mem_mib: u64) -> Usage {
        Usage {
            running_sandboxes: 1,
            memory_mib: mem_mib,
            ..Usage::default()
        }
    }

    /// What a template build of `mem_mib` adds: a VM while it boots, and
    /// the template's snapshot after.
    pub fn build(mem_mib: u64) -> Usage {
        Usage {
            snapshot_disk_mib: mem_mib,
            ..Usage::sandbox(mem_mib)
        }
    }

    /// What one more snapshot of `mem_mib` adds.
    pub fn snapshot(mem_mib: u64) -> Usage {
        Usage {
            snapshot_disk_mib: mem_mib,
            ..Usage::default()
        }
    }
}

/// A tenant's use from its sandboxes (checkpoints counted by the caller).
pub fn usage_of(sandboxes: &[Sandbox]) -> Usage {
    let mut u = Usage::default();
    for s in sandboxes {
        if s.state == SandboxState::Deleted {
            continue;
        }
        u.total_sandboxes += 1;
        if HOLDING_VMM.contains(&s.state) {
            u.running_sandboxes += 1;
            u.memory_mib += u64::from(s.mem_mib);
        }
        if s.state == SandboxState::Hibernated {
            u.snapshot_disk_mib += u64::from(s.mem_mib);
        }
    }
    u
}

/// Snapshot disk of `tenant`'s templates (built, or made from its
/// sandboxes: E2B's snapshots), each as its memory size (the same upper
/// bound as a hibernated sandbox's).
pub fn templates_disk(templates: &[Template], tenant: &str) -> u64 {
    templates
        .iter()
        .filter(|t| t.state != TemplateState::Deleted && t.tenant.as_deref() == Some(tenant))
        .map(|t| u64::from(t.mem_mib))
        .sum()
}

/// A quota `used + asked` would exceed: 429 `quota_exceeded` naming it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tenant {tenant} is at its {quota} quota: {used} used of {limit}, {asked} more asked")]
pub struct QuotaExceeded {
    pub tenant: String,
    pub quota: &'static str,
    pub limit: u64,
    pub used: u64,
    pub asked: u64,
}

impl From<QuotaExceeded> for ServiceError {
    fn from(e: QuotaExceeded) -> Self {
        ServiceError::Quota {
            tenant: e.tenant,
            quota: e.quota,
            limit: e.limit,
            used: e.used,
            asked: e.asked,
        }
    }
}

/// The first quota `used + asked` exceeds.
pub fn check(
    tenant: &str,
    quota: &Quota,
    used: &Usage,
    asked: &Usage,
) -> Result<(), QuotaExceeded> {
    let rows: [(&'static str, Option<u64>, u64, u64); 4] = [
        (
            "running_sandboxes",
            quota.running_sandboxes,
            used.running_sandboxes,
            asked.running_sandboxes,
        ),
        (
            "total_sandboxes",
            quota.total_sandboxes,
            used.total_sandboxes,
            asked.total_sandboxes,
        ),
        (
            "memory_mib",
            quota.memory_mib,
            used.memory_mib,
            asked.memory_mib,
        ),
        (
            "snapshot_disk_mib",
            quota.snapshot_disk_mib,
            used.snapshot_disk_mib,
            asked.snapshot_disk_mib,
        ),
    ];
    for (name, limit, used, asked) in rows {
        if let Some(limit) = limit {
            if asked > 0 && used.saturating_add(asked) > limit {
                return Err(QuotaExceeded {
                    tenant: tenant.to_string(),
                    quota: name,
                    limit,
                    used,
                    asked,
                });
            }
        }
    }
    Ok(())
}

#[derive(Default, Debug)]
struct TenantState {
    /// One admission at a time: its count of the tenant's use and its
    /// reservation are one step (held across the backend's listing).
    admitting: tokio::sync::Mutex<()>,
    /// Admitted and not finished.
    pending: Mutex<Usage>,
}

/// Admission against quotas, per tenant.
#[derive(Default, Debug)]
pub struct Quotas {
    tenants: Mutex<HashMap<String, Arc<TenantState>>>,
}

/// Admitted use, counted until dropped (the request has ended: what it
/// made is in the service's own records by then).
#[derive(Debug)]
pub struct Ticket {
    state: Arc<TenantState>,
    asked: Usage,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.state.pending.locked().sub(&self.asked);
    }
}

impl Quotas {
    fn tenant(&self, tenant: &str) -> Arc<TenantState> {
        let mut map = self.tenants.locked();
        Arc::clone(map.entry(tenant.to_string()).or_default())
    }

    /// The tenant's current use (lists its sandboxes; with
    /// `checkpoints`, lists each one's checkpoints too).
    pub async fn usage<S: SandboxApi>(
        service: &S,
        tenant: &str,
        checkpoints: bool,
    ) -> Result<Usage, ServiceError> {
        let sandboxes = service
            .list_sandboxes(SandboxFilter {
                tenant: Some(tenant.to_string()),
                ..Default::default()
            })
            .await?;
        let mut u = usage_of(&sandboxes);
        if checkpoints {
            for s in &sandboxes {
                let id = s.id.clone();
                let listed = on_pod(service, Needs::Snapshots, move |p| p.list_checkpoints(&id));
                if let Ok(list) = listed.await {
                    u.snapshot_disk_mib += list.len() as u64 * u64::from(s.mem_mib);
                }
            }
            u.snapshot_disk_mib += templates_disk(&service.list_templates().await?, tenant);
        }
        Ok(u)
    }

    /// Admits `asked` more for `tenant` under `quota`. Without any limit
    /// set, nothing is counted or listed.
    pub async fn admit<S: SandboxApi>(
        &self,
        service: &S,
        tenant: &str,
        quota: &Quota,
        asked: Usage,
    ) -> Result<Option<Ticket>, ServiceError> {
        if *quota == Quota::default() {
            return Ok(None);
        }
        let state = self.tenant(tenant);
        let turn = state.admitting.lock().await;
        let mut used = Self::usage(
            service,
            tenant,
            quota.snapshot_disk_mib.is_some() && asked.snapshot_disk_mib > 0,
        )
        .await?;
        let mut pending = state.pending.locked();
        used.add(&pending);
        check(tenant, quota, &used, &asked)?;
        pending.add(&asked);
        drop(pending);
        drop(turn);
        Ok(Some(Ticket { state, asked }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_scheduler::model::TemplateId;

    #[test]
    fn usage_counts_states_and_check_names_the_quota() {
        let mk = |state: SandboxState| {
            let mut s = Sandbox::new(TemplateId::new("tpl_x"), 128, 1, 1000);
            s.state = state;
            s
        };
        let u = usage_of(&[
            mk(SandboxState::Running),
            mk(SandboxState::Paused),
            mk(SandboxState::Hibernated),
            mk(SandboxState::Deleted),
        ]);
        assert_eq!(
            u,
            Usage {
                running_sandboxes: 2,
                total_sandboxes: 3,
                memory_mib: 256,
                snapshot_disk_mib: 128
            }
        );
        let q = Quota {
            running_sandboxes: Some(3),
            memory_mib: Some(300),
            ..Quota::default()
        };
        check("t", &q, &u, &Usage::sandbox(32)).unwrap();
        let e = check("t", &q, &u, &Usage::sandbox(64)).unwrap_err();
        assert_eq!((e.quota, e.limit, e.used), ("memory_mib", 300, 256));
        let two = Usage {
            running_sandboxes: 2,
            ..Usage::default()
        };
        assert!(check("t", &q, &u, &two).is_err());
        // A snapshot asks no sandbox: only the disk quota applies.
        check("t", &q, &u, &Usage::snapshot(1 << 20)).unwrap();
    }
}
