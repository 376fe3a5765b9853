//! A nested pod's sandbox operations as typed calls: what this server's
//! own callers (the E2B routes, envd) need of a sandbox a nested pod runs.
//! (`/v1` requests for such a sandbox are relayed whole at the HTTP layer
//! instead, [`crate::relay`].) The pod's answers are checked like any pod
//! answer: JSON of the expected shape, the pod's own id renamed to its id
//! here, errors as the pod's status and code.

use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use torpor_scheduler::service::{ForkSandbox, LOCAL_POD};

use super::{acting_tenant, internal};
use torpor_client::encode;
use torpor_scheduler::model::{PodId, Sandbox, SandboxId, Template};
use torpor_scheduler::service::{CreateTemplate, Owner};
use torpor_scheduler::service::{Outcome, ServiceError};

use crate::backend::{wait, Lifecycle};
use crate::error::code;
use crate::pods::{rewrite_pod_ids, RemotePod};

/// `METHOD /v1/sandboxes/{id}{suffix}` on `pod`; its JSON answer.
pub(super) fn call(
    pod: &RemotePod,
    method: &str,
    id: &SandboxId,
    suffix: &str,
    body: Option<&Value>,
) -> Result<Value, ServiceError> {
    let path = format!("/v1/sandboxes/{}{suffix}", id.as_str());
    let mut value = pod.call(method, &path, body)?;
    rewrite_pod_ids(&mut value, &pod.id);
    Ok(value)
}

fn typed<T: DeserializeOwned>(
    pod: &RemotePod,
    what: &str,
    value: Value,
) -> Result<T, ServiceError> {
    serde_json::from_value(value).map_err(|e| ServiceError::Pod {
        status: 502,
        code: code::POD_UNREACHABLE.into(),
        message: format!("pod {}: its answer is not {what} ({e})", pod.id),
    })
}

/// A call answered with a sandbox.
pub(super) fn sandbox(
    pod: &RemotePod,
    method: &str,
    id: &SandboxId,
    suffix: &str,
    body: Option<&Value>,
) -> Result<Sandbox, ServiceError> {
    let value = call(pod, method, id, suffix, body)?;
    typed(pod, "a sandbox", value)
}

/// `POST .../{op}`, answered with an outcome.
pub(super) fn outcome(
    pod: &RemotePod,
    id: &SandboxId,
    op: Lifecycle,
) -> Result<Outcome, ServiceError> {
    let value = call(pod, "POST", id, op.path(), op.body().as_ref())?;
    typed(pod, "an outcome", value)
}

/// `POST .../template`: a template of the sandbox's state, on its pod.
pub(super) fn template(
    pod: &RemotePod,
    id: &SandboxId,
    req: &torpor_scheduler::service::TemplateFromSandbox,
) -> Result<torpor_scheduler::model::Template, ServiceError> {
    let body = serde_json::to_value(req).map_err(|e| ServiceError::Internal(e.to_string()))?;
    let value = call(pod, "POST", id, "/template", Some(&body))?;
    typed(pod, "a template", value)
}

/// This server's side of nested sandboxes and templates: what it adds to
/// a pod's answers, and the calls that span its pods.
impl<L: crate::backend::SandboxApi> super::Nested<L> {
    /// A nested sandbox as its pod shows it, with what the pod keeps but
    /// never shows (the envd token, the environment) from here.
    pub(super) fn with_secrets(&self, mut sandbox: Sandbox) -> Result<Sandbox, ServiceError> {
        if let Some(o) = self.owner(&sandbox.id) {
            self.seen(&sandbox);
            (sandbox.access_token, sandbox.env) = (o.access_token, o.env);
        }
        Ok(sandbox)
    }

    pub(super) fn outcome_with_secrets(
        &self,
        mut outcome: Outcome,
    ) -> Result<Outcome, ServiceError> {
        outcome.sandbox = self.with_secrets(outcome.sandbox)?;
        Ok(outcome)
    }

    /// A fork of nested sandbox `id`, made on its pod.
    pub(super) fn fork_remote(
        &self,
        pod: &RemotePod,
        id: &SandboxId,
        req: ForkSandbox,
    ) -> Result<Sandbox, ServiceError> {
        let body = serde_json::to_value(&req).map_err(internal)?;
        let path = format!("/v1/sandboxes/{}/fork", encode(id.as_str()));
        let v = self.place_fork(pod, id, &path, body, req)?;
        self.with_secrets(serde_json::from_value(v).map_err(internal)?)
    }

    /// Sends fork `req` of `source` (`body` at `path` on its pod) and
    /// records it like a create: its source's tenant, its envd token, and
    /// its source's environment under the request's.
    pub(super) fn place_fork(
        &self,
        pod: &RemotePod,
        source: &SandboxId,
        path: &str,
        body: Value,
        req: ForkSandbox,
    ) -> Result<Value, ServiceError> {
        let owner = self.owner(source);
        let tenant = owner.as_ref().and_then(|o| o.tenant.clone());
        // A fork's guest has its source's volumes mounted.
        let volumes = owner
            .as_ref()
            .map(|o| o.volumes.clone())
            .unwrap_or_default();
        let mut env = owner.map(|o| o.env).unwrap_or_default();
        env.extend(req.env);
        // For the source's tenant on the pod too: the pod checks that the
        // source is that tenant's, and the fork is.
        let pod = pod.acting_for(tenant.as_deref());
        self.place_remote(
            &pod,
            path,
            body,
            tenant.as_deref(),
            (req.access_token, env, volumes),
        )
    }

    /// Templates of every pod that answers, each with its `pod`.
    pub(super) fn templates_everywhere(&self) -> Result<Vec<Value>, ServiceError> {
        let mut out = Vec::new();
        for t in wait(self.local.list_templates())? {
            let mut v = serde_json::to_value(t).map_err(internal)?;
            v["pod"] = json!(LOCAL_POD);
            out.push(v);
        }
        for pod in self.remote_pods() {
            match pod.look("/v1/templates") {
                Ok(mut list) => {
                    for mut t in list["templates"]
                        .as_array_mut()
                        .map(std::mem::take)
                        .unwrap_or_default()
                    {
                        t["pod"] = json!(pod.id);
                        out.push(t);
                    }
                }
                Err(e) => {
                    tracing::warn!(pod = %pod.id, error = %e, "templates of an unreachable pod left out")
                }
            }
        }
        Ok(out)
    }

    /// The templates `key` names for `owner` on every pod that answers, at
    /// the best [`torpor_scheduler::names::rank`] across them all (the
    /// caller's own on any pod before a shared one), oldest first, each
    /// with its pod (none: the local one).
    pub(super) fn resolve_everywhere(
        &self,
        owner: Option<&Owner>,
        key: &str,
    ) -> Result<Vec<(Template, Option<RemotePod>)>, ServiceError> {
        let mut found: Vec<(u8, Template, Option<RemotePod>)> = Vec::new();
        for v in self.templates_everywhere()? {
            let pod = match v["pod"].as_str() {
                Some(LOCAL_POD) => None,
                Some(p) => match self.pod(&PodId::new(p)) {
                    Some(pod) => Some(pod),
                    None => continue,
                },
                None => continue,
            };
            let Ok(t) = serde_json::from_value::<Template>(v) else {
                continue;
            };
            if let Some(rank) = torpor_scheduler::names::rank(&t, owner, key) {
                found.push((rank, t, pod));
            }
        }
        let Some(best) = found.iter().map(|(r, ..)| *r).min() else {
            return Ok(Vec::new());
        };
        found.retain(|(r, ..)| *r == best);
        found.sort_by(|(_, a, _), (_, b, _)| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        Ok(found.into_iter().map(|(_, t, pod)| (t, pod)).collect())
    }

    /// Refuses a tenant's new template whose name is its own elsewhere or
    /// a shared template's on any pod, or one still coming
    /// ([`torpor_scheduler::names::name_conflict`]; each pod checks its
    /// own again). An admin's shared one may take any name.
    pub(super) fn check_new_name(&self, req: &CreateTemplate) -> Result<(), ServiceError> {
        let Some(tenant) = acting_tenant(req.owner.as_ref()) else {
            return Ok(());
        };
        let listed = self.templates_everywhere()?;
        let coming = self.coming.why(&req.name).map(|_| None);
        let tenants = listed
            .iter()
            .filter(|v| v["name"] == req.name.as_str() && v["state"] != "deleted")
            .map(|v| v["tenant"].as_str())
            .chain(coming);
        match torpor_scheduler::names::name_conflict(Some(tenant), &req.name, tenants) {
            Some((kind, name)) => Err(ServiceError::ResourceConflict(format!(
                "{kind} {name} already exists"
            ))),
            None => Ok(()),
        }
    }
}
