//! Snapshot-as-template: a template made from a sandbox's current state
//! (`POST /v1/sandboxes/{id}/template`, E2B's snapshots), from which new
//! sandboxes restore that memory and disk, and which outlives the sandbox.
//!
//! The snapshot is taken as a checkpoint (its journaled write, layers and
//! recovery are the checkpoint's), the template row names the checkpoint's
//! layer, and then the checkpoint's name is dropped: templates are roots of
//! the layer collection (`store/layers.rs`), so the layer and everything
//! under it stay while the template is not deleted, whatever happens to
//! the sandbox. A crash between the checkpoint and the template leaves the
//! checkpoint (`template-<hex>`), visible and deletable.
//!
//! A filesystem-only one (`mode: filesystem`, E2B's `memory: false`) keeps
//! the disk only: a Linux guest `sync`s (as before a filesystem-only
//! hibernation), its VMM is paused while its overlay is copied into the
//! template's directory (holes kept), and the source goes on as it was; the
//! template has no snapshot. A sandbox made from it boots the kernel over a
//! copy of that disk, as the wake of a filesystem-only hibernation does
//! (`reboot.rs`): a new boot, the files, none of the processes.

use std::path::Path;

use serde::{Deserialize, Serialize};
use torpor_vmm_api::control::Request;

use super::linux::OVERLAY_FILE;
use super::vmm;
use super::{CreateCheckpoint, Service, ServiceError};
use crate::model::{
    HibernationKind, Sandbox, SandboxId, Template, TemplateId, TemplateKind, TemplateState,
    Timestamp, VmmHandle,
};
use crate::random::random_hex;
use crate::state::SandboxState;
use crate::store::LayerOwner;

/// `POST /v1/sandboxes/{id}/template` (the API's request body).
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplateFromSandbox {
    /// The template's name; `<sandbox id>-<8 hex>` when absent.
    #[serde(default)]
    pub name: Option<String>,
    /// What it keeps: `memory` (the default: memory and disk, its sandboxes
    /// restore the source's state) or `filesystem` (the disk only, its
    /// sandboxes boot from it).
    #[serde(default)]
    pub mode: HibernationKind,
}

impl Service {
    /// A ready template of the sandbox's current state (running, paused or
    /// hibernated; it stays in that state): its memory and disk, or its
    /// disk only (`req.mode`).
    pub fn template_from_sandbox(
        &self,
        id: &SandboxId,
        req: TemplateFromSandbox,
    ) -> Result<Template, ServiceError> {
        let source = self.store.get_sandbox(id)?;
        if !source.volumes.is_empty() {
            // Its guest has them mounted: a sandbox restored from the
            // template would hold mounts nothing serves.
            return Err(ServiceError::Conflict {
                id: id.to_string(),
                state: source.state,
                message: "a sandbox with volumes mounted cannot be made a template".into(),
            });
        }
        let base = self.store.get_template(&source.template)?;
        let name = req
            .name
            .unwrap_or_else(|| format!("{}-{}", id, random_hex(4)));
        super::check_template_name(&name)?;
        // Before the snapshot is taken; the insert checks again.
        if let Some((kind, id)) = self
            .store
            .template_name_conflict(source.tenant.as_deref(), &name)?
        {
            return Err(crate::store::StoreError::AlreadyExists { kind, id }.into());
        }
        let template = Template {
            id: TemplateId::generate(),
            name,
            kernel: base.kernel.clone(),
            rootfs: base.rootfs.clone(),
            snapshot_dir: None,
            mem_mib: source.mem_mib,
            vcpus: source.vcpus,
            kind: base.kind,
            created_at: Timestamp::now(),
            state: TemplateState::Ready,
            // A sandbox's template is its tenant's, built from its image.
            tenant: source.tenant.clone(),
            image: base.image.clone(),
            source: Some(id.clone()),
            stored_snapshot: None,
        };
        match req.mode {
            HibernationKind::Memory => self.memory_template(id, template),
            HibernationKind::Filesystem => self.disk_template(id, &base, template),
        }
    }

    /// `template` with the sandbox's memory and disk: a checkpoint's layer.
    fn memory_template(
        &self,
        id: &SandboxId,
        mut template: Template,
    ) -> Result<Template, ServiceError> {
        let checkpoint_name = format!(
            "template-{}",
            template.id.as_str().trim_start_matches(TemplateId::PREFIX)
        );
        let checkpoint = self.create_checkpoint(
            id,
            CreateCheckpoint {
                name: checkpoint_name.clone(),
            },
        )?;
        // Shared with every sandbox made from the template: sealed before
        // it is one (their starts and wakes seal nothing outside their own
        // directories).
        let sealed = self
            .checked_chain(&LayerOwner::Sandbox(id.clone()), &checkpoint.snapshot_dir)
            .and_then(|chain| {
                let layers: Vec<_> = chain.into_iter().map(|(dir, _)| dir).collect();
                self.seal_shared(&layers)
            });
        if let Err(e) = sealed {
            let _ = self.delete_checkpoint(id, &checkpoint_name);
            return Err(e);
        }
        template.snapshot_dir = Some(checkpoint.snapshot_dir);
        template.created_at = Timestamp::now();
        let inserted = self.store.insert_sandbox_template(&template, id);
        // The layer is the template's now (or, on failure, nobody's named
        // one): the checkpoint's name goes either way.
        if let Err(e) = self.delete_checkpoint(id, &checkpoint_name) {
            tracing::warn!(sandbox = %id, "cannot drop checkpoint {checkpoint_name}: {e}");
        }
        inserted?;
        Ok(self.store.get_template(&template.id)?)
    }

    /// `template` with the sandbox's disk only, in the template's own
    /// directory: the kernel command line `base` boots with and, for a
    /// Linux guest, a copy of its overlay. No snapshot.
    fn disk_template(
        &self,
        id: &SandboxId,
        base: &Template,
        mut template: Template,
    ) -> Result<Template, ServiceError> {
        let dir = self.template_dir(&template.id);
        let made = (|| {
            let _guard = self.lock_sandbox(id)?;
            let source = self.store.get_sandbox(id)?;
            std::fs::create_dir_all(&dir)
                .map_err(|e| ServiceError::Internal(format!("create {}: {e}", dir.display())))?;
            let cmdline = dir.join(super::template::CMDLINE_FILE);
            std::fs::write(&cmdline, self.template_cmdline(base))
                .map_err(|e| ServiceError::Internal(format!("write {}: {e}", cmdline.display())))?;
            if base.kind == TemplateKind::Linux {
                self.copy_disk(&source, &dir.join(OVERLAY_FILE))?;
            } else if !matches!(
                source.state,
                SandboxState::Running | SandboxState::Paused | SandboxState::Hibernated
            ) {
                return Err(disk_refused(
                    &source,
                    "it must be running, paused or hibernated",
                ));
            }
            template.created_at = Timestamp::now();
            self.store.insert_sandbox_template(&template, id)?;
            Ok(())
        })();
        if let Err(e) = made {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        tracing::info!(sandbox = %id, template = %template.id, "filesystem-only snapshot");
        Ok(self.store.get_template(&template.id)?)
    }

    /// Copies the disk of `source` (a Linux sandbox, lock held) to `dst`:
    /// a running or paused one `sync`s its guest (a paused one is resumed
    /// for it) and is paused while its overlay is copied, then left as it
    /// was; a filesystem-only hibernated one's kept overlay is copied as it
    /// is. One hibernated with its memory keeps its disk inside that
    /// snapshot: 409, to be woken first.
    fn copy_disk(&self, source: &Sandbox, dst: &Path) -> Result<(), ServiceError> {
        let overlay = self.sandbox_dir(&source.id).join(OVERLAY_FILE);
        match source.state {
            SandboxState::Running | SandboxState::Paused => {
                let handle = Self::running_handle(source)?;
                let paused = source.state == SandboxState::Paused;
                if !paused {
                    // As before a filesystem-only hibernation: a guest
                    // that does not answer cannot sync.
                    self.guest_answers(&source.id)
                        .map_err(|why| ServiceError::Unavailable {
                            message: format!(
                                "the guest agent of sandbox {} does not answer ({why}): no \
                                 filesystem-only snapshot of it",
                                source.id
                            ),
                            retry_after_s: 1,
                        })?;
                } else {
                    vmm::call(handle, &Request::Resume)?;
                }
                // Running from here until the pause below.
                let mut running = true;
                let copied = (|| {
                    self.sync_guest(&source.id)?;
                    vmm::call(handle, &Request::Pause)?;
                    running = false;
                    copy_overlay(&overlay, dst)
                })();
                let left = match (paused, running) {
                    (true, true) => vmm::call(handle, &Request::Pause).map(drop),
                    (false, false) => vmm::call(handle, &Request::Resume).map(drop),
                    _ => Ok(()),
                };
                copied?;
                left.map_err(|e| {
                    ServiceError::Internal(format!(
                        "sandbox {} could not be left {} after its disk was copied: {e}",
                        source.id, source.state
                    ))
                })
            }
            SandboxState::Hibernated if source.disk_only => copy_overlay(&overlay, dst),
            SandboxState::Hibernated => Err(disk_refused(
                source,
                "it was hibernated with its memory, which holds its disk: wake it first",
            )),
            _ => Err(disk_refused(
                source,
                "it must be running, paused or hibernated",
            )),
        }
    }

    /// Starts `sandbox` (being created from `template`, a filesystem-only
    /// one) by a boot over a copy of the template's disk: what a wake of
    /// a filesystem-only hibernation does ([`Service::boot_vmm`]).
    pub(super) fn boot_from_disk(
        &self,
        sandbox: &Sandbox,
        template: &Template,
    ) -> Result<VmmHandle, ServiceError> {
        if template.kind == TemplateKind::Linux {
            let dir = self.sandbox_dir(&sandbox.id);
            std::fs::create_dir_all(&dir)
                .map_err(|e| ServiceError::Internal(format!("create {}: {e}", dir.display())))?;
            let disk = self.template_dir(&template.id).join(OVERLAY_FILE);
            copy_overlay(&disk, &dir.join(OVERLAY_FILE))?;
        }
        self.boot_vmm(sandbox, template)
    }

    /// Templates snapshotted from sandboxes (from `source` only, if given),
    /// with their sources.
    pub fn sandbox_templates(
        &self,
        source: Option<&SandboxId>,
    ) -> Result<Vec<(Template, SandboxId)>, ServiceError> {
        Ok(self.store.sandbox_templates(source)?)
    }
}

/// A copy of the disk overlay `src` at `dst` with the same holes (the
/// chunks a kept overlay holds are its data extents: `CowDisk::open_kept`).
fn copy_overlay(src: &Path, dst: &Path) -> Result<(), ServiceError> {
    let io = |what: &str, path: &Path, e: std::io::Error| {
        ServiceError::Internal(format!("{what} {}: {e}", path.display()))
    };
    let from = std::fs::File::open(src).map_err(|e| io("open", src, e))?;
    let len = from.metadata().map_err(|e| io("stat", src, e))?.len();
    let mut to = std::fs::File::create(dst).map_err(|e| io("create", dst, e))?;
    torpor_vmm_api::sparse::copy_sparse(&from, &mut to, len)
        .and_then(|()| to.sync_all())
        .map_err(|e| io("copy the disk to", dst, e))
}

/// Why a filesystem-only snapshot of `sandbox` is refused (409).
fn disk_refused(sandbox: &Sandbox, why: &str) -> ServiceError {
    ServiceError::Conflict {
        id: sandbox.id.to_string(),
        state: sandbox.state,
        message: format!("no filesystem-only snapshot of it: {why}"),
    }
}
