//! Sandboxes and templates that move to another pod through the object
//! store (issue 29; pods with `--object-store`): a pod silent past
//! `lost_after` is lost for good, and a command on one of its hibernated
//! sandboxes whose snapshot is stored first has a pod up adopt it
//! ([`Operation::Adopt`]: its snapshot, and its template if that pod
//! lacks it, fetched whole into the pod's disk), then moves its row to
//! that pod and runs there; a create from a template no pod up lists has
//! a pod up fetch it ([`Operation::TemplateAdopt`]) and is placed there.
//!
//! A lost pod that comes back is asked to release what moved
//! (`events.rs`'s `release_strays`).
//!
//! Placement of a move: the pods up with admission headroom, those that
//! list the sandbox's template first (its chunks are in their cache),
//! then by headroom.

use torpor_scheduler::model::{Sandbox, SandboxId, Template, TemplateId};
use torpor_scheduler::state::SandboxState;

use super::db::PodRow;
use super::replica::Cluster;
use super::wire::{Operation, Reply};
use torpor_gate::service::ServiceError;

impl Cluster {
    /// Whether `pod` has been silent long enough to be lost for good.
    fn is_lost(&self, pod: &PodRow) -> bool {
        pod.silent_s >= self.config.lost_after.as_secs_f64()
    }

    /// Sandbox `id`, whose pod failed the command with `e` (down): moved
    /// to a pod up when its pod is lost and its snapshot is stored, with
    /// that pod; else `e`.
    pub(super) async fn moved(
        &self,
        id: &SandboxId,
        e: ServiceError,
    ) -> Result<(Sandbox, PodRow), ServiceError> {
        let Ok((sandbox, from)) = self.owned(id).await else {
            return Err(e);
        };
        if self.is_up(&from) || !self.is_lost(&from) {
            return Err(e);
        }
        if sandbox.state != SandboxState::Hibernated || sandbox.stored_snapshot.is_none() {
            return Err(Self::down(
                &from,
                &format!(
                    "sandbox {id} is {} and its snapshot is not in the object store: \
                     it is lost with its pod",
                    sandbox.state
                ),
            ));
        }
        let template = self
            .stored_template(&sandbox.template)
            .await?
            .ok_or_else(|| {
                Self::down(
                    &from,
                    &format!(
                        "sandbox {id}'s template {} is not in the object store",
                        sandbox.template
                    ),
                )
            })?;
        let pods = self.db.pods().await?;
        let key = sandbox.template.to_string();
        let mut fit: Vec<&PodRow> = pods
            .iter()
            .filter(|p| p.id != from.id && self.is_up(p) && p.headroom_mib > 0.0)
            .collect();
        fit.sort_by(|a, b| {
            let has = |p: &PodRow| p.templates.contains(&key);
            has(b)
                .cmp(&has(a))
                .then(b.headroom_mib.total_cmp(&a.headroom_mib))
        });
        let to = fit
            .first()
            .copied()
            .cloned()
            .ok_or_else(|| ServiceError::Admission {
                message: format!(
                    "no pod up has admission headroom to take sandbox {id} from lost pod {}",
                    from.id
                ),
            })?;
        tracing::warn!(sandbox = %id, from = %from.id, to = %to.id, "moving a hibernated sandbox of a lost pod");
        let tenant = sandbox.tenant.clone().unwrap_or_default();
        let (_, env) = self.db.secrets(id).await?;
        let adopt = Operation::Adopt {
            sandbox: Box::new(sandbox),
            template: Box::new(template),
            env,
        };
        let adopted = match self
            .run_keyed(&to.id, &tenant, adopt, None, None)
            .await?
            .reply()?
        {
            Reply::Sandbox { sandbox, .. } => *sandbox,
            other => {
                return Err(ServiceError::Internal(format!(
                    "an adopt of {id} answered {other:?}"
                )))
            }
        };
        // Its row is the adopting pod's from now on (only if still the
        // lost pod's: another replica may have moved it meanwhile).
        self.db.move_sandbox(&adopted, &from.id, &to.id).await?;
        let (sandbox, pod) = self.owned(id).await?;
        Ok((sandbox, pod))
    }

    /// Template `id` as a pod (up or not) lists it with its snapshot in the
    /// object store, if one does.
    async fn stored_template(&self, id: &TemplateId) -> Result<Option<Template>, ServiceError> {
        Ok(self
            .db
            .listing(id, self.config.down_after)
            .await?
            .into_iter()
            .map(|l| l.template)
            .find(|t| t.stored_snapshot.is_some()))
    }

    /// A create's template `key` (its id) that no pod up lists but whose
    /// snapshot is stored: fetched by the pod up with the most headroom,
    /// which is then where the create goes. None if there is no such
    /// template or no pod up with headroom.
    pub(super) async fn template_elsewhere(
        &self,
        pods: &[PodRow],
        key: &str,
        tenant: &str,
    ) -> Result<Option<PodRow>, ServiceError> {
        let Some(template) = self.stored_template(&TemplateId::new(key)).await? else {
            return Ok(None);
        };
        let Some(to) = pods
            .iter()
            .filter(|p| self.is_up(p) && p.headroom_mib > 0.0)
            .max_by(|a, b| a.headroom_mib.total_cmp(&b.headroom_mib))
            .cloned()
        else {
            return Ok(None);
        };
        tracing::info!(template = key, to = %to.id, "fetching a template no pod up lists");
        let adopt = Operation::TemplateAdopt {
            template: Box::new(template),
        };
        match self
            .run_keyed(&to.id, tenant, adopt, None, None)
            .await?
            .reply()?
        {
            Reply::Template { .. } => Ok(Some(to)),
            other => Err(ServiceError::Internal(format!(
                "an adopt of template {key} answered {other:?}"
            ))),
        }
    }
}
