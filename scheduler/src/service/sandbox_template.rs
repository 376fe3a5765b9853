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

use serde::{Deserialize, Serialize};

use super::{CreateCheckpoint, Service, ServiceError};
use crate::model::{SandboxId, Template, TemplateId, TemplateState, Timestamp};
use crate::random::random_hex;
use crate::store::LayerOwner;

/// `POST /v1/sandboxes/{id}/template` (the API's request body).
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplateFromSandbox {
    /// The template's name; `<sandbox id>-<8 hex>` when absent.
    #[serde(default)]
    pub name: Option<String>,
}

impl Service {
    /// A ready template of the sandbox's current state (running, paused or
    /// hibernated; it stays in that state).
    pub fn template_from_sandbox(
        &self,
        id: &SandboxId,
        req: TemplateFromSandbox,
    ) -> Result<Template, ServiceError> {
        let source = self.store.get_sandbox(id)?;
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
        let template_id = TemplateId::generate();
        let checkpoint_name = format!(
            "template-{}",
            template_id.as_str().trim_start_matches(TemplateId::PREFIX)
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
        let template = Template {
            id: template_id,
            name,
            kernel: base.kernel,
            rootfs: base.rootfs,
            snapshot_dir: Some(checkpoint.snapshot_dir),
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
        let inserted = self.store.insert_sandbox_template(&template, id);
        // The layer is the template's now (or, on failure, nobody's named
        // one): the checkpoint's name goes either way.
        if let Err(e) = self.delete_checkpoint(id, &checkpoint_name) {
            tracing::warn!(sandbox = %id, "cannot drop checkpoint {checkpoint_name}: {e}");
        }
        inserted?;
        Ok(self.store.get_template(&template.id)?)
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
