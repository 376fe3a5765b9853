//! Admission: whether a pod has room for a sandbox's memory. The check reads
//! what is committed and must land in the same transaction as what makes
//! the new memory count (inserting a sandbox, moving one to `resuming`):
//! checked in one transaction and counted in another, parallel requests
//! could all pass the check before any of them counts.

use super::{Result, StoreError, Tx};
use crate::model::PodId;
use crate::state::SandboxState;

/// States whose sandboxes hold a VMM (or are about to), so their memory
/// counts against the pod's admission.
pub const HOLDING_VMM: &[SandboxState] = &[
    SandboxState::Creating,
    SandboxState::Running,
    SandboxState::Paused,
    SandboxState::Hibernating,
    SandboxState::Resuming,
];

impl Tx<'_> {
    /// Memory (MiB) of the sandboxes that hold a VMM ([`HOLDING_VMM`]).
    pub fn committed_mib(&self) -> Result<u64> {
        let states: Vec<String> = HOLDING_VMM
            .iter()
            .map(|s| format!("'{}'", s.as_str()))
            .collect();
        let sum: i64 = self
            .conn
            .prepare_cached(&format!(
                "SELECT COALESCE(SUM(mem_mib), 0) FROM sandboxes WHERE state IN ({})",
                states.join(", ")
            ))?
            .query_row([], |r| r.get(0))?;
        u64::try_from(sum).map_err(|_| StoreError::Corrupt(format!("committed memory {sum} MiB")))
    }

    /// Ok if `mem_mib` more fits in `pod`'s memory times its
    /// oversubscription ratio with what is committed; `Full` otherwise.
    /// Make the sandbox count (insert it, or change its state) in the same
    /// transaction.
    pub fn admit(&self, pod: &PodId, mem_mib: u32) -> Result<()> {
        let pod = self.get_pod(pod)?;
        let memory_mib = pod.memory_bytes >> 20;
        let committed_mib = self.committed_mib()?;
        crate::policy::admit(
            memory_mib,
            pod.oversubscription_ratio,
            committed_mib,
            mem_mib,
        )
        .map_err(|r| StoreError::Full {
            pod: pod.id,
            committed_mib: r.committed_mib,
            asked_mib: r.asked_mib,
            limit_mib: r.limit_mib,
            ratio: pod.oversubscription_ratio,
            memory_mib,
        })
    }
}
