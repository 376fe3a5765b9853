//! Templates through a replica: built and deleted on the pods through their
//! work queues, as the sandboxes' commands are, and read from the pods'
//! catalogs in PostgreSQL (`catalog.rs`).
//!
//! - A build (`POST /v1/templates`) goes to the pod it names (`pod`, an
//!   admin's choice) or to the pod up with the most admission headroom
//!   (among those with its image, for a Linux template: `images.rs`): one
//!   operation of kind `template_build` ([`Operation::TemplateBuild`]), the
//!   template the caller's tenant's (an admin's shared), as embedded. Its
//!   result changes that pod's catalog with the operation, so that a create
//!   right after the 201 is placed there; past `--cluster-wait-ms` the
//!   answer is 202 with the operation. It is admitted in PostgreSQL
//!   against its tenant's quota as a create is (a sandbox of its
//!   `mem_mib`, counted while its operation is pending: a build runs
//!   within its command), so builds and creates through different
//!   replicas at once cannot pass a quota together. A build taken past its
//!   start deadline is not run; one that ends past its expiry stays built
//!   (it holds no quota once ended) and its operation reads failed.
//! - A read (`GET /v1/templates/{id}`) is the template as a pod up lists
//!   it; 404 if none does. The API keeps a tenant to its own and the
//!   shared ones and leaves host paths out, as for every template.
//! - A delete (`DELETE /v1/templates/{id}`) is a `template_delete` on every
//!   pod that lists it (ids are made at random by the pod that built it:
//!   one pod, unless a pod's data was copied); a pod refuses it (409) while
//!   its sandboxes use the template, as embedded. Any of those pods down:
//!   503, nothing deleted. Each pod's operation carries the request's
//!   `Idempotency-Key` followed by a space and the pod's id (a key has no
//!   spaces, so none is another request's), so that a retry finds each
//!   pod's first outcome; a retry once the template is gone answers the
//!   first outcome (204) from the journal.

use torpor_scheduler::model::{PodId, Template, TemplateId};
use torpor_scheduler::service::{CreateTemplate, Owner};

use super::db::PodRow;
use super::replica::Cluster;
use super::wire::{OpOutcome, Operation, Reply};
use torpor_gate::calls::{TemplateOp, TemplateReply};
use torpor_gate::quota::Usage;
use torpor_gate::service::ServiceError;

fn template_not_found(id: &TemplateId) -> ServiceError {
    ServiceError::NotFound {
        kind: "template",
        id: id.to_string(),
    }
}

/// The pod a build goes to when the request names none: the pod up with
/// the most admission headroom (some left).
pub fn build_pod(pods: &[PodRow], up: impl Fn(&PodRow) -> bool) -> Option<&PodRow> {
    pods.iter()
        .filter(|p| up(p) && p.headroom_mib > 0.0)
        .max_by(|a, b| a.headroom_mib.total_cmp(&b.headroom_mib))
}

/// The key of one pod's delete of a template: the request's, then a
/// space and the pod's id.
pub fn delete_key(key: &str, pod: &PodId) -> String {
    format!("{key} {pod}")
}

impl Cluster {
    pub(super) async fn template_call(
        &self,
        op: TemplateOp<'_>,
    ) -> Result<TemplateReply, ServiceError> {
        match op {
            TemplateOp::List => self.listed().await.map(TemplateReply::List),
            TemplateOp::Get { key, owner } => {
                self.template_for(owner, key).await.map(TemplateReply::one)
            }
            TemplateOp::Create(req) => self.build(req).await.map(TemplateReply::one),
            TemplateOp::Delete { key, owner } => {
                let id = match self.template_for(owner, key).await {
                    Ok(t) => {
                        torpor_scheduler::service::may_delete(owner, &t)?;
                        t.id
                    }
                    // An admin's delete by id goes on: a retry once it is
                    // gone answers its first outcome (the journal's).
                    Err(ServiceError::NotFound { .. }) if owner.is_none_or(|o| o.admin) => {
                        TemplateId::new(key)
                    }
                    // A tenant's retry (its idempotency key) of a delete
                    // that removed it: that first outcome, its own only.
                    Err(e @ ServiceError::NotFound { .. }) => {
                        let tenant = owner.map(|o| o.tenant.as_str());
                        return match self.retried_delete(&TemplateId::new(key), tenant).await? {
                            Some(()) => Ok(TemplateReply::Deleted),
                            None => Err(e),
                        };
                    }
                    Err(e) => return Err(e),
                };
                self.delete_template(&id)
                    .await
                    .map(|()| TemplateReply::Deleted)
            }
            TemplateOp::Rename { .. } => Err(ServiceError::Unsupported(
                "renaming a template is not served by a cluster yet (a rebuild of a template \
                 in use needs it)"
                    .into(),
            )),
        }
    }

    /// The templates of the pods up, as their catalogs list them.
    async fn listed(&self) -> Result<Vec<Template>, ServiceError> {
        let entries = self.db.templates(self.config.down_after).await?;
        entries
            .into_iter()
            .map(|mut t| {
                // The entry's `pod` is the list's, not the template's.
                if let Some(entry) = t.as_object_mut() {
                    entry.remove("pod");
                }
                serde_json::from_value(t)
            })
            .collect::<Result<Vec<Template>, _>>()
            .map_err(|e| ServiceError::Internal(format!("a pod's template: {e}")))
    }

    async fn build(&self, mut req: CreateTemplate) -> Result<Template, ServiceError> {
        let owner = req
            .owner
            .take()
            .ok_or_else(|| ServiceError::Internal("a template's build without its owner".into()))?;
        let pods = self.db.pods().await?;
        let pod = match req.pod.take() {
            Some(want) => self.named_pod(&pods, &want, "no template is built on it")?,
            // A Linux template's image is on some pods only (`images.rs`).
            None => match &req.image {
                Some(image)
                    if !pods
                        .iter()
                        .any(|p| self.is_up(p) && p.images.contains(image)) =>
                {
                    return Err(ServiceError::Invalid(format!(
                        "no pod up has image {image} installed (GET /v1/images)"
                    )))
                }
                image => build_pod(&pods, |p| {
                    self.is_up(p) && image.as_ref().is_none_or(|i| p.images.contains(i))
                })
                .ok_or_else(|| ServiceError::Admission {
                    message: "no pod up has admission headroom to build a template".into(),
                })?,
            },
        };
        // The build's VM, admitted against its tenant's quota as a create
        // is: counted while its operation is pending, on every replica.
        let asked = Usage::sandbox(u64::from(req.mem_mib));
        let command = Operation::TemplateBuild {
            request: Box::new(req),
            tenant: owner.tenant.clone(),
            admin: owner.admin,
        };
        match self
            .run(&pod.id, &owner.tenant, command, Some(&asked))
            .await?
            .reply()?
        {
            Reply::Template { template } => Ok(*template),
            other => Err(ServiceError::Internal(format!(
                "a template's build answered {other:?}"
            ))),
        }
    }

    /// The template as the first pod up (by id) lists it. Missing, and the
    /// request a retry of its delete (its `Idempotency-Key`): the template
    /// as that delete left it (`deleted`), so that the API's check of its
    /// tenant passes and the retry answers the first outcome.
    /// The template `key` (id or name) names for `owner`
    /// ([`torpor_scheduler::names`]): by id as the first pod up lists it,
    /// else by name over the pods' catalogs; another tenant's is not
    /// found.
    async fn template_for(
        &self,
        owner: Option<&Owner>,
        key: &str,
    ) -> Result<Template, ServiceError> {
        let id = TemplateId::new(key);
        match self.template(&id).await {
            Ok(t) => match torpor_scheduler::names::rank(&t, owner, key) {
                Some(_) => Ok(t),
                None => Err(template_not_found(&id)),
            },
            Err(ServiceError::NotFound { .. }) => {
                let listed = self.listed().await?;
                torpor_scheduler::names::resolve(&listed, owner, key)
                    .cloned()
                    .ok_or_else(|| template_not_found(&id))
            }
            Err(e) => Err(e),
        }
    }

    async fn template(&self, id: &TemplateId) -> Result<Template, ServiceError> {
        let listed = self.db.listing(id, self.config.down_after).await?;
        if let Some(l) = listed.into_iter().find(|l| l.up) {
            return Ok(l.template);
        }
        if let Some(key) = torpor_gate::request_context::idempotency_key() {
            if let Some(op) = self.db.template_delete_by_key(&key, id, None).await? {
                if let Some(OpOutcome::Done(Reply::TemplateDeleted { template })) = op.outcome {
                    return Ok(*template);
                }
            }
        }
        Err(template_not_found(id))
    }

    /// The first outcome of a delete of `id` made with this request's
    /// idempotency key (of `tenant`'s operations only, if given): `None`
    /// if there is none.
    async fn retried_delete(
        &self,
        id: &TemplateId,
        tenant: Option<&str>,
    ) -> Result<Option<()>, ServiceError> {
        let Some(key) = torpor_gate::request_context::idempotency_key() else {
            return Ok(None);
        };
        let Some(op) = self.db.template_delete_by_key(&key, id, tenant).await? else {
            return Ok(None);
        };
        match self.wait(op).await?.reply()? {
            Reply::TemplateDeleted { .. } => Ok(Some(())),
            other => Err(ServiceError::Internal(format!(
                "a template's delete answered {other:?}"
            ))),
        }
    }

    async fn delete_template(&self, id: &TemplateId) -> Result<(), ServiceError> {
        let key = torpor_gate::request_context::idempotency_key();
        let listed = self.db.listing(id, self.config.down_after).await?;
        if listed.is_empty() {
            // A retry of a delete that removed it: its first outcome.
            return self
                .retried_delete(id, None)
                .await?
                .ok_or_else(|| template_not_found(id));
        }
        if let Some(down) = listed.iter().find(|l| !l.up) {
            let pod = self.db.pod(down.pod.as_str()).await?.ok_or_else(|| {
                ServiceError::Internal(format!("template {id} names unknown pod {}", down.pod))
            })?;
            return Err(Self::down(
                &pod,
                &format!("template {id} cannot be deleted until it is back"),
            ));
        }
        if let (Some(key), Some(first)) = (&key, listed.first()) {
            // The key is the request's: no other command may have it.
            let tenant = first.template.tenant.as_deref().unwrap_or_default();
            if let Some(op) = self.db.operation_by_tenant_key(tenant, key).await? {
                return Err(ServiceError::ResourceConflict(format!(
                    "Idempotency-Key was used for another request: operation {} ({})",
                    op.id, op.kind
                )));
            }
        }
        let mut failed = None;
        for l in &listed {
            let tenant = l.template.tenant.clone().unwrap_or_default();
            let command = Operation::TemplateDelete {
                template: id.clone(),
            };
            let key = key.as_deref().map(|k| delete_key(k, &l.pod));
            match self.run_keyed(&l.pod, &tenant, command, None, key).await? {
                OpOutcome::Done(Reply::TemplateDeleted { .. }) => {}
                OpOutcome::Failed(e) => {
                    failed.get_or_insert(e);
                }
                other => {
                    return Err(ServiceError::Internal(format!(
                        "a template's delete answered {other:?}"
                    )))
                }
            }
        }
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_pods::pod;

    #[test]
    fn a_build_goes_to_the_pod_up_with_the_most_headroom() {
        let pods = [
            pod("a", 100.0, 0.5, &[]),
            pod("b", 900.0, 9.0, &[]),
            pod("c", 500.0, 0.1, &[]),
            pod("d", 0.0, 0.1, &[]),
        ];
        let up = |p: &PodRow| p.silent_s < 4.0;
        // b has the most but is down.
        assert_eq!(build_pod(&pods, up).unwrap().id.as_str(), "c");
        assert!(build_pod(&pods[3..], up).is_none());
        assert!(build_pod(&pods[1..2], up).is_none());
    }

    #[test]
    fn each_pods_delete_has_its_own_key() {
        let (a, b) = (PodId::new("pod1"), PodId::new("pod2"));
        assert_eq!(delete_key("k-1", &a), "k-1 pod1");
        assert_ne!(delete_key("k-1", &a), delete_key("k-1", &b));
        // No request's key has a space (`request_context::scope`).
        assert!(!delete_key("k", &a).bytes().all(|b| b.is_ascii_graphic()));
    }
}
