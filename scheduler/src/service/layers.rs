//! Snapshot layers on disk: recording a new layer's chain in the store in
//! the same transaction as the reference that keeps it, removing the files
//! of layers nothing reaches any more, and what start-up recovery does for
//! checkpoints, restores and forks. The reference counting itself is the
//! store's (`store/layers.rs`).

use std::path::{Path, PathBuf};

use serde_json::Value;
use torpor_vmm_api::control::Request;
use torpor_vmm_api::lineage::Lineage;
use torpor_vmm_api::{ErrorKind, VmError};

use super::vmm;
use super::{Service, ServiceError};
use crate::model::{Checkpoint, CheckpointId, Sandbox, SandboxId, Timestamp};
use crate::state::SandboxState;
use crate::store::{OperationKind, OperationRecord, OperationStatus, StateChange, Tx};

/// A layer chain as the store records it: `(dir, parent)`, base first.
pub(super) type LayerChain = Vec<(PathBuf, Option<PathBuf>)>;

/// The chain of the snapshot in `top`, base first, every path canonical
/// (the VMM records parents canonicalised; the service's own paths are
/// under the canonical data directory).
pub(super) fn layer_chain(top: &Path) -> Result<LayerChain, ServiceError> {
    let lineage = Lineage::read(top).map_err(|e| {
        ServiceError::Vm(
            VmError::new(
                ErrorKind::BadSnapshot,
                format!("snapshot {}: {e}", top.display()),
            )
            .with_layer(top),
        )
    })?;
    let dirs: Vec<PathBuf> = lineage
        .layers
        .iter()
        .map(|l| std::fs::canonicalize(l).unwrap_or_else(|_| l.clone()))
        .collect();
    // `layers` is base first; each layer's parent is the one before it.
    Ok(dirs
        .iter()
        .enumerate()
        .map(|(i, d)| (d.clone(), i.checked_sub(1).map(|p| dirs[p].clone())))
        .collect())
}

/// Whether a new snapshot on top of `base` may be a diff: the chain under
/// it stays shorter than `MAX_DIFF_DEPTH` (else a full one starts afresh).
pub(super) fn diff_allowed(base: Option<&Path>) -> bool {
    base.map(|s| {
        Lineage::read(s).map_or(super::ops::MAX_DIFF_DEPTH, |l| l.depth())
            < super::ops::MAX_DIFF_DEPTH
    })
    .unwrap_or(false)
}

impl Service {
    /// Points the sandbox at `snapshot` (what its VMM runs from or it wakes
    /// from) and records the snapshot's layers, in one transaction: a layer
    /// recorded but not yet referenced could be collected by a concurrent
    /// delete, and one referenced but not recorded would hide its parents.
    pub(super) fn set_snapshot_and_layers(
        &self,
        id: &SandboxId,
        snapshot: &Path,
    ) -> Result<(), ServiceError> {
        let chain = layer_chain(snapshot)?;
        self.store.write(|tx| {
            tx.register_layers(&chain)?;
            tx.set_sandbox_snapshot(id, Some(snapshot))
        })?;
        Ok(())
    }

    /// Forgets the layers nothing reaches and removes their files; a
    /// deleted sandbox's directory goes with its last layer.
    pub(super) fn remove_dead_layers(&self) {
        let dead = match self.store.collect_dead_layers() {
            Ok(dead) => dead,
            Err(e) => {
                tracing::warn!("cannot collect snapshot layers: {e}");
                return;
            }
        };
        for dir in dead {
            tracing::info!(layer = %dir.display(), "removing a snapshot layer nothing uses");
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!("cannot remove {}: {e}", dir.display());
                }
            }
            if let Some(parent) = dir.parent() {
                let owner = parent
                    .file_name()
                    .map(|n| SandboxId::new(n.to_string_lossy()));
                let deleted = owner.is_some_and(|o| {
                    self.store
                        .get_sandbox(&o)
                        .is_ok_and(|s| s.state == SandboxState::Deleted)
                });
                if deleted {
                    // Fails, as it should, while other layers are in it.
                    let _ = std::fs::remove_dir(parent);
                }
            }
        }
    }

    /// A deleted sandbox's files: its checkpoints' names go, then every
    /// layer nothing else needs, then everything else in its directory but
    /// the layers forks and other chains still sit on.
    pub(super) fn remove_sandbox_files(&self, id: &SandboxId) {
        if let Err(e) = self.store.remove_checkpoints_of_deleted() {
            tracing::warn!("cannot remove the checkpoints of {id}: {e}");
        }
        self.remove_dead_layers();
        let dir = self.sandbox_dir(id);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            if is_dir && self.store.layer_registered(&path).unwrap_or(true) {
                continue;
            }
            let removed = if is_dir {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            if let Err(e) = removed {
                tracing::warn!("cannot remove {}: {e}", path.display());
            }
        }
        let _ = std::fs::remove_dir(&dir);
    }

    /// Start-up: checkpoints of deleted sandboxes go, every referenced
    /// chain is recorded (layers written before the store knew layers, or
    /// by an operation a crash interrupted), and dead layers are removed.
    pub(super) fn recover_layers(&self) -> Result<(), ServiceError> {
        self.store.remove_checkpoints_of_deleted()?;
        for root in self.store.referenced_paths()? {
            match layer_chain(&root) {
                Ok(chain) => self.store.register_layers(&chain)?,
                Err(e) => tracing::warn!("cannot read the chain of {}: {e}", root.display()),
            }
        }
        self.remove_dead_layers();
        Ok(())
    }

    /// Finishes or rolls back an interrupted checkpoint, restore or fork
    /// snapshot; false for other operations (the caller handles them).
    pub(super) fn recover_snapshot_op(
        &self,
        op: &OperationRecord,
        sandbox: &Sandbox,
    ) -> Result<bool, ServiceError> {
        let text = |k: &str| op.detail.get(k).and_then(Value::as_str).map(String::from);
        let from = text("from").and_then(|s| s.parse::<SandboxState>().ok());
        let snapshot = text("snapshot").map(PathBuf::from);
        match op.kind {
            OperationKind::Checkpoint | OperationKind::Fork => {
                let Some(snapshot) = snapshot else {
                    self.store
                        .finish_operation(&op.id, OperationStatus::RolledBack, None, None)?;
                    return Ok(true);
                };
                let written = snapshot.join(torpor_vmm_api::lineage::STATE_FILE).exists();
                // Written means the VMM now diffs against it: keep it.
                let kept = written && self.finish_snapshot_op(op, sandbox, &snapshot).is_ok();
                if !kept {
                    let _ = std::fs::remove_dir_all(&snapshot);
                    self.store
                        .finish_operation(&op.id, OperationStatus::RolledBack, None, None)?;
                }
                tracing::warn!(op = %op.id, kind = %op.kind, sandbox = %sandbox.id, kept, "finished an interrupted snapshot");
                // The operation paused a running VMM; it runs again.
                if from == Some(SandboxState::Running) && sandbox.state == SandboxState::Running {
                    if let Some(handle) = &sandbox.vmm {
                        let _ = vmm::call(handle, &Request::Resume);
                    }
                }
                Ok(true)
            }
            OperationKind::Restore if sandbox.state == SandboxState::Resuming => {
                // The restore was asked for and its checkpoint is intact:
                // finish it, whichever VMM (old, new, none) the crash left.
                let status = sandbox.vmm.as_ref().and_then(vmm::status);
                let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or(p.to_path_buf());
                let mut restored = match (&status, &snapshot) {
                    (Some(st), Some(want)) => st
                        .base_snapshot
                        .as_deref()
                        .is_some_and(|b| canonical(b) == canonical(want)),
                    _ => false,
                };
                let mut failure = None;
                if !restored {
                    if let Some(handle) = &sandbox.vmm {
                        vmm::stop(handle, None);
                        self.store.set_sandbox_vmm(&sandbox.id, None)?;
                    }
                    match &snapshot {
                        Some(snapshot) => match self.start_vmm(&sandbox.id, snapshot) {
                            Ok(_) => restored = true,
                            Err(e) => failure = Some(e.to_string()),
                        },
                        None => failure = Some("the journal names no snapshot".into()),
                    }
                }
                let (outcome, change) = if restored {
                    if let Some(snapshot) = &snapshot {
                        self.set_snapshot_and_layers(&sandbox.id, snapshot)?;
                    }
                    let change = StateChange::new(SandboxState::Resuming, SandboxState::Running);
                    (OperationStatus::Done, change)
                } else if from == Some(SandboxState::Hibernated) {
                    let change = StateChange::new(SandboxState::Resuming, SandboxState::Hibernated);
                    (OperationStatus::RolledBack, change)
                } else {
                    let change = StateChange {
                        from: SandboxState::Resuming,
                        to: SandboxState::Failed,
                        reason: Some(format!(
                            "restore from a checkpoint interrupted and not finished: {}",
                            failure.unwrap_or_default()
                        )),
                    };
                    (OperationStatus::RolledBack, change)
                };
                tracing::warn!(op = %op.id, sandbox = %sandbox.id, %outcome, "finished an interrupted restore");
                self.store
                    .finish_operation(&op.id, outcome, None, Some(&change))?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Rolls an interrupted checkpoint (or fork snapshot) forward: its
    /// layers recorded, the source pointed at it, the checkpoint listed.
    fn finish_snapshot_op(
        &self,
        op: &OperationRecord,
        sandbox: &Sandbox,
        snapshot: &Path,
    ) -> Result<(), ServiceError> {
        let chain = layer_chain(snapshot)?;
        let checkpoint = match op.kind {
            OperationKind::Checkpoint => Some(Checkpoint {
                id: CheckpointId::new(
                    op.detail
                        .get("checkpoint")
                        .and_then(Value::as_str)
                        .unwrap_or_default(),
                ),
                sandbox: sandbox.id.clone(),
                name: op
                    .detail
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                snapshot_dir: snapshot.to_path_buf(),
                parent: None,
                created_at: Timestamp::now(),
            }),
            _ => None,
        };
        self.store.write(|tx| {
            commit_layer(tx, &sandbox.id, snapshot, &chain, checkpoint.as_ref())?;
            tx.finish_operation(&op.id, OperationStatus::Done, None, None)
        })?;
        Ok(())
    }
}

/// In one transaction with the end of the operation that wrote it: a new
/// layer of a live sandbox is recorded, becomes what its VMM diffs against,
/// and (for a checkpoint) is listed under its name. A sandbox deleted
/// meanwhile keeps no checkpoint.
pub(super) fn commit_layer(
    tx: &Tx<'_>,
    sandbox: &SandboxId,
    snapshot: &Path,
    chain: &LayerChain,
    checkpoint: Option<&Checkpoint>,
) -> crate::store::Result<()> {
    tx.register_layers(chain)?;
    if tx.sandbox_state(sandbox)? == SandboxState::Deleted {
        return Ok(());
    }
    tx.set_sandbox_snapshot(sandbox, Some(snapshot))?;
    if let Some(c) = checkpoint {
        let mut c = c.clone();
        c.parent = parent_checkpoint(tx, sandbox, chain)?;
        tx.insert_checkpoint(&c)?;
    }
    Ok(())
}

/// The sandbox's checkpoint whose layer this chain's top sits on, if any.
pub(super) fn parent_checkpoint(
    tx: &Tx<'_>,
    sandbox: &SandboxId,
    chain: &LayerChain,
) -> crate::store::Result<Option<CheckpointId>> {
    let Some((_, Some(parent))) = chain.last() else {
        return Ok(None);
    };
    Ok(tx
        .list_checkpoints(sandbox)?
        .into_iter()
        .find(|c| &c.snapshot_dir == parent)
        .map(|c| c.id))
}
