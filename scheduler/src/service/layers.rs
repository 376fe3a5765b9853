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

use super::layer_gate::{check_chain, real_dir, Scope};
use super::vmm;
use super::{Service, ServiceError};
use crate::model::{Checkpoint, CheckpointId, Sandbox, SandboxId, TemplateId, Timestamp};
use crate::state::SandboxState;
use crate::store::{LayerOwner, OperationKind, OperationRecord, OperationStatus, StateChange, Tx};

/// A layer chain as the store records it: `(dir, parent)`, base first.
pub(super) type LayerChain = Vec<(PathBuf, Option<PathBuf>)>;

/// The lineage `top`'s VMM wrote, unchecked: only for what cannot widen a
/// jail (a chain's depth). Everything else goes through
/// [`Service::checked_chain`].
fn read_lineage(top: &Path) -> Result<Lineage, ServiceError> {
    Lineage::read(top).map_err(|e| {
        ServiceError::Vm(
            VmError::new(
                ErrorKind::BadSnapshot,
                format!("snapshot {}: {e}", top.display()),
            )
            .with_layer(top),
        )
    })
}

/// Whether a new snapshot on top of `base` may be a diff: the chain under
/// it stays shorter than `MAX_DIFF_DEPTH` (else a full one starts afresh).
pub(super) fn diff_allowed(base: Option<&Path>) -> bool {
    base.map(|s| {
        read_lineage(s).map_or(super::ops::MAX_DIFF_DEPTH, |l| l.depth())
            < super::ops::MAX_DIFF_DEPTH
    })
    .unwrap_or(false)
}

impl Service {
    /// The chain of the snapshot in `top`, base first, as its VMM recorded
    /// it and once the gate (`layer_gate.rs`) has checked every layer
    /// against `owner`'s own directory and the layers the store knows for
    /// it: what the service records, mounts and seals.
    pub(super) fn checked_chain(
        &self,
        owner: &LayerOwner,
        top: &Path,
    ) -> Result<LayerChain, ServiceError> {
        let own_dir = match owner {
            LayerOwner::Sandbox(id) => self.sandbox_dir(id),
            LayerOwner::Template(id) => self.template_dir(id),
        };
        let known = self.store.known_layers(owner)?;
        let scope = Scope::new(&self.config.data_dir, &own_dir, known);
        // The record is read only from a real directory the gate accepts.
        real_dir(&scope.data_dir, top).map_err(|e| e.into_error(top))?;
        let lineage = read_lineage(top)?;
        check_chain(top, &lineage.layers, &scope).map_err(|e| e.into_error(top))
    }

    /// Seals `paths` (layers of a checked chain, an image's files) as they
    /// become shared with another sandbox or a template: root's, 0755/0644
    /// (`Jails::seal_shared`). A start only ever seals inside its VMM's own
    /// directory and checks what is outside it, so whatever a chain reaches
    /// in another's directory is sealed here first. An unjailed pod seals
    /// nothing (its VMMs run as the service).
    pub(super) fn seal_shared(&self, paths: &[PathBuf]) -> Result<(), ServiceError> {
        match &self.jails {
            Some(jails) => jails.seal_shared(paths),
            None => Ok(()),
        }
    }

    /// The layers of `chain` (checked for `owner`) that are shared: all of
    /// a template's, and those of a sandbox's that are outside its own
    /// directory.
    fn shared_layers(&self, owner: &LayerOwner, chain: &LayerChain) -> Vec<PathBuf> {
        let own = match owner {
            LayerOwner::Sandbox(id) => Some(self.sandbox_dir(id)),
            LayerOwner::Template(_) => None,
        };
        chain
            .iter()
            .map(|(dir, _)| dir.clone())
            .filter(|dir| own.as_ref().is_none_or(|own| !dir.starts_with(own)))
            .collect()
    }

    /// Whose layer `dir` is by where it is: a sandbox's or a template's
    /// directory (start-up recovery knows roots only by path).
    fn owner_of(&self, dir: &Path) -> Option<LayerOwner> {
        let rel = dir.strip_prefix(&self.config.data_dir).ok()?;
        let mut parts = rel.components().map(|c| c.as_os_str().to_string_lossy());
        let (kind, name) = (parts.next()?, parts.next()?);
        match kind.as_ref() {
            "sandboxes" => Some(LayerOwner::Sandbox(SandboxId::new(name))),
            "templates" => Some(LayerOwner::Template(TemplateId::new(name))),
            _ => None,
        }
    }

    /// Points the sandbox at `snapshot` (what its VMM runs from or it wakes
    /// from) and records the snapshot's layers, in one transaction: a layer
    /// recorded but not yet referenced could be collected by a concurrent
    /// delete, and one referenced but not recorded would hide its parents.
    pub(super) fn set_snapshot_and_layers(
        &self,
        id: &SandboxId,
        snapshot: &Path,
    ) -> Result<(), ServiceError> {
        let chain = self.checked_chain(&LayerOwner::Sandbox(id.clone()), snapshot)?;
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
        // And their manifests in the object store, if this pod stored them.
        self.drop_dead_manifests();
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
            // Gone already: another delete's collection removed the
            // same dead layer after this listing.
            match removed {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!("cannot remove {}: {e}", path.display());
                }
                _ => {}
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
            let Some(owner) = self.owner_of(&root) else {
                tracing::warn!("{} is outside the sandboxes and templates", root.display());
                continue;
            };
            match self.checked_chain(&owner, &root) {
                Ok(chain) => {
                    self.store.register_layers(&chain)?;
                    // Layers shared before sharing sealed them.
                    if let Err(e) = self.seal_shared(&self.shared_layers(&owner, &chain)) {
                        tracing::warn!("cannot seal the chain of {}: {e}", root.display());
                    }
                }
                Err(e) => tracing::warn!("cannot read the chain of {}: {e}", root.display()),
            }
        }
        // And the images templates read.
        for t in self.store.list_templates(false)? {
            if let Err(e) = self.seal_shared(&template_files(&t)) {
                tracing::warn!(template = %t.id, "cannot seal its image: {e}");
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
            OperationKind::Checkpoint | OperationKind::Fork | OperationKind::Durable => {
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
                    let change = StateChange::failed(
                        SandboxState::Resuming,
                        format!(
                            "restore from a checkpoint interrupted and not finished: {}",
                            failure.unwrap_or_default()
                        ),
                    );
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
        let chain = self.checked_chain(&LayerOwner::Sandbox(sandbox.id.clone()), snapshot)?;
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

/// The files of its image a template's VMMs read: its rootfs and (a Linux
/// build's) kernel, which an image shares with every template built from it.
pub(super) fn template_files(template: &crate::model::Template) -> Vec<PathBuf> {
    let kernel = Path::new(&template.kernel);
    template
        .rootfs
        .iter()
        .cloned()
        .chain(kernel.is_absolute().then(|| kernel.to_path_buf()))
        .collect()
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
