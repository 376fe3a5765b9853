//! `torpor serve`'s [`SandboxApi`] over its local pod (the in-process
//! [`Service`]) and the nested pods it runs as children on the same host
//! (README's `base` on a PVM host: `torpor pod serve` inside a QEMU VM that
//! outlives serve). Past one machine, torpor runs as a cluster
//! (`--cluster`, [`crate::cluster`]); this only joins one host's pods.
//!
//! A nested pod is attached in memory ([`Nested::attach`], or
//! [`Nested::attach_as`] when serve re-attaches to it after a restart);
//! its sandboxes' owners are kept in serve's store too ([`kept`]), so that
//! they survive a restart of serve, and a sandbox whose nested host is
//! gone is listed as failed (410 on its routes) instead of disappearing.
//!
//! - placement (`create_sandbox`): among pods that have the template (or
//!   the one pinned with `pod`), by most free admission headroom; a pod's
//!   429 moves on to the next, 429 when every pod refuses;
//! - routing ([`crate::relay`]): every sandbox route of a nested
//!   sandbox, and `PATCH /v1/pods/{id}` of a nested pod, is relayed as it
//!   came and its answer passed back (a pod that does not answer: 502
//!   `pod_unreachable`);
//! - lists merge the pods (templates with a `pod` field).

mod coming;
mod kept;
mod remote;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde_json::Value;
use torpor_scheduler::model::{MountedVolume, PodId, Sandbox, SandboxId, Template, TemplateState};
use torpor_scheduler::service::LOCAL_POD;
use torpor_scheduler::state::SandboxState;
use torpor_sync::RwLocked;

use crate::backend::{blocking, wait, Lifecycle, Registry, Relay, SandboxApi};
use crate::calls::{
    ExecMode, ExecReply, FileOp, FileReply, ImageOp, ImageReply, TemplateOp, TemplateReply,
};
use crate::pods::{self, RemotePod};
use crate::service::{
    AgentLink, Cancel, CreateSandbox, CreateTemplate, ExecRequest, ForkSandbox, GuestCall,
    GuestError, Outcome, Owner, PodView, SandboxFilter, ServiceError,
};
pub use coming::{Starter, RETRY_AFTER_S};
use torpor_client::pin::Fingerprint;
use torpor_client::{encode, ClientError};

/// Longest exec of a remote sandbox through its agent tunnel when the
/// request names none (the service's default exec limit).
const REMOTE_EXEC_LIMIT_MS: u64 = 600_000;

/// A nested pod's sandbox as kept here.
#[derive(Debug, Clone)]
struct Owned {
    pod: PodId,
    tenant: Option<String>,
    /// What the pod keeps but never shows: the envd token and the
    /// environment, for this server's envd and E2B routes.
    access_token: Option<String>,
    env: BTreeMap<String, String>,
    /// The pod's latest answer about it (shown once it is lost).
    last_seen: Option<Sandbox>,
    /// Why it is gone (its nested host stopped), once it is.
    lost: Option<String>,
    /// The volumes it mounts, as this server resolved them: what its
    /// volume gateway serves it ([`volumes`]).
    volumes: Vec<MountedVolume>,
}

/// The local pod and the nested pods.
#[derive(Debug)]
pub struct Nested<L: SandboxApi> {
    local: Arc<L>,
    pods: RwLock<BTreeMap<PodId, RemotePod>>,
    /// The nested pods' sandboxes.
    owners: RwLock<HashMap<SandboxId, Owned>>,
    io_timeout: Duration,
    /// Templates a pod on its way up will have (the nested pod's `base`).
    coming: coming::Coming,
}

fn internal(e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Internal(e.to_string())
}

fn template_not_found(key: &str) -> ServiceError {
    ServiceError::NotFound {
        kind: "template",
        id: key.to_string(),
    }
}

/// The tenant a call to a pod is made for: a tenant's (an admin acts as
/// itself, with the pod's token).
fn acting_tenant(owner: Option<&Owner>) -> Option<&str> {
    owner.filter(|o| !o.admin).map(|o| o.tenant.as_str())
}

impl<L: SandboxApi> Nested<L> {
    /// The local pod alone, until a nested pod is attached, with the
    /// nested sandboxes its store keeps (none without a local service, or
    /// if they cannot be read: said in the log). `io_timeout` bounds each
    /// call to a nested pod.
    pub fn new(local: Arc<L>, io_timeout: Duration) -> Arc<Self> {
        let owners = kept::load(local.as_ref()).unwrap_or_else(|e| {
            tracing::error!(error = %e, "the nested pods' sandboxes could not be read from the store");
            HashMap::new()
        });
        Arc::new(Nested {
            local,
            pods: RwLock::new(BTreeMap::new()),
            owners: RwLock::new(owners),
            io_timeout,
            coming: coming::Coming::default(),
        })
    }

    fn pod(&self, id: &PodId) -> Option<RemotePod> {
        self.pods.read_locked().get(id).cloned()
    }

    /// The nested pod that owns sandbox `id` (none once it is lost).
    fn remote_sandbox(&self, id: &SandboxId) -> Option<RemotePod> {
        self.owner(id)
            .filter(|o| o.lost.is_none())
            .and_then(|o| self.pod(&o.pod))
    }

    fn remote_pods(&self) -> Vec<RemotePod> {
        self.pods.read_locked().values().cloned().collect()
    }

    fn owner(&self, id: &SandboxId) -> Option<Owned> {
        self.owners.read_locked().get(id).cloned()
    }

    /// Sandboxes of `pod` (of `tenant` only, if given).
    fn owned_by(&self, pod: &PodId, tenant: Option<&str>) -> Vec<SandboxId> {
        self.owners
            .read_locked()
            .iter()
            .filter(|(_, o)| {
                o.pod == *pod
                    && o.lost.is_none()
                    && tenant.is_none_or(|want| o.tenant.as_deref() == Some(want))
            })
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// Whether `id`, which pod `pod` says it made, may become its: a
    /// well-formed sandbox id that no other pod (the local one included)
    /// owns.
    fn claimable(&self, id: &SandboxId, pod: &PodId) -> bool {
        SandboxId::is_well_formed(id.as_str())
            && self.owner(id).is_none_or(|o| o.pod == *pod)
            && wait(self.local.get_sandbox(id)).is_err()
    }

    /// Marks template `name` as coming (`why`: not there yet, and why) or
    /// there (`None`): creating a sandbox from it answers 503 with `why`.
    pub fn template_coming(&self, name: &str, why: Option<String>) {
        self.coming.set(name, why);
    }

    /// Offers template `name` on demand: the first create that asks for it
    /// runs `start` (which returns at once and reports progress through
    /// [`Nested::template_coming`]) and answers 503 like the next ones.
    pub fn template_on_demand(&self, name: &str, why: String, start: coming::Starter) {
        self.coming.on_demand(name, why, start);
    }

    /// What is said about `name` while it is coming.
    pub fn template_progress(&self, name: &str) -> Option<String> {
        self.coming.why(name)
    }

    /// Attaches the pod at `address` (`tls:HOST:PORT`, or `unix:` and
    /// loopback `tcp:` ones) after checking it answers with `token` (and,
    /// if `pin` is given, with that certificate); its listing entry.
    /// Nothing is stored: a nested pod lives as long as this process.
    pub fn attach(
        &self,
        address: &str,
        token: &str,
        pin: Option<Fingerprint>,
    ) -> Result<Value, ServiceError> {
        self.attach_as(PodId::generate(), address, token, pin)
    }

    /// [`Nested::attach`] under the id `id` (the one a restarted serve
    /// recorded for it, so that its sandboxes are found again).
    pub fn attach_as(
        &self,
        id: PodId,
        address: &str,
        token: &str,
        pin: Option<Fingerprint>,
    ) -> Result<Value, ServiceError> {
        pods::pod_address(address)?;
        if self.pod(&id).is_some() {
            return Err(ServiceError::ResourceConflict(format!(
                "pod {id} is already attached"
            )));
        }
        if let Some(known) = self
            .remote_pods()
            .into_iter()
            .find(|p| p.address == address)
        {
            return Err(ServiceError::ResourceConflict(format!(
                "pod address {address} is already attached as {}",
                known.id
            )));
        }
        let pod = RemotePod::new(id, address, token, pin, self.io_timeout)?;
        // A certificate other than the pinned one is not an unreachable pod.
        if let Err(ClientError::Tls { message, .. }) =
            pod.client.request("GET", "/healthz", None, None)
        {
            return Err(ServiceError::Invalid(format!(
                "the pod at {address} failed TLS verification: {message}"
            )));
        }
        let entry = match pod.load() {
            Ok(v) => v,
            Err(ServiceError::Pod { status: 401, .. }) => {
                return Err(ServiceError::Invalid(format!(
                    "the pod at {address} refused the token (401)"
                )))
            }
            Err(e) => return Err(e),
        };
        tracing::info!(pod = %pod.id, %address, "attached a nested pod");
        self.pods.write_locked().insert(pod.id.clone(), pod);
        Ok(entry)
    }

    /// Detaches pod `id` (its nested host is gone); its sandboxes stay
    /// recorded ([`Nested::mark_lost`] says why they are gone).
    pub fn detach(&self, id: &PodId) {
        if self.pods.write_locked().remove(id).is_some() {
            tracing::info!(pod = %id, "detached a nested pod");
        }
    }

    /// Whether pod `id` is alive: its server answers `GET /healthz` now
    /// (the nested host's supervisor asks). Not its load (`GET
    /// /v1/pods`), which reads the pod's store and measures its VMMs: a
    /// pod busy with a template's snapshot under TCG answers that late,
    /// and a busy host is not a dead one.
    pub fn pod_answers(&self, id: &PodId) -> Result<(), ServiceError> {
        let pod = self.pod(id).ok_or_else(|| ServiceError::NotFound {
            kind: "pod",
            id: id.to_string(),
        })?;
        pod.look("/healthz").map(drop)
    }

    /// Sends a create or fork to a nested pod; the sandbox it answers with
    /// becomes the pod's (with `secrets`, the envd token and environment
    /// the pod never shows) before returning its answer.
    fn place_remote(
        &self,
        pod: &RemotePod,
        path: &str,
        body: Value,
        tenant: Option<&str>,
        (access_token, env, volumes): Kept,
    ) -> Result<Value, ServiceError> {
        let answer = pod.send("POST", path, Some(&body))?;
        if !answer.is_success() {
            return Err(pod.error(&answer));
        }
        let mut v: Value = serde_json::from_slice(&answer.body).map_err(internal)?;
        // A pod answers for its own new sandboxes only: an id that is
        // malformed or someone else's is refused, never recorded.
        let made = v["id"].as_str().map(SandboxId::new);
        let Some(id) = made.filter(|id| self.claimable(id, &pod.id)) else {
            let said = pods::sanitized(v["id"].as_str().unwrap_or_default());
            tracing::warn!(pod = %pod.id, sandbox = %said, "a pod answered with a sandbox id it does not own; refused");
            return Err(ServiceError::Pod {
                status: 502,
                code: crate::error::code::POD_UNREACHABLE.into(),
                message: format!(
                    "pod {} answered with a sandbox id that is malformed or not its own",
                    pod.id
                ),
            });
        };
        pods::rewrite_pod_ids(&mut v, &pod.id);
        let owned = Owned {
            pod: pod.id.clone(),
            tenant: tenant.map(str::to_string),
            access_token,
            env,
            last_seen: serde_json::from_value(v.clone()).ok(),
            lost: None,
            volumes,
        };
        self.keep(id, owned)?;
        Ok(v)
    }

    /// Pods that can take a sandbox of the template `req` names for its
    /// owner (on every pod with it at the best rank: its own anywhere
    /// before shared ones), most free headroom first.
    fn candidates(&self, req: &CreateSandbox) -> Vec<(f64, Option<RemotePod>)> {
        let found = self
            .resolve_everywhere(req.owner.as_ref(), &req.template)
            .unwrap_or_default();
        let has_local = found.iter().any(|(_, pod)| pod.is_none());
        let mut remote_pods: Vec<RemotePod> = Vec::new();
        for pod in found.into_iter().filter_map(|(_, pod)| pod) {
            if !remote_pods.iter().any(|p| p.id == pod.id) {
                remote_pods.push(pod);
            }
        }
        if has_local && remote_pods.is_empty() {
            // Nothing to rank it against: the local pod's headroom (a
            // list of every sandbox, the PSS of every VMM) is not needed.
            return vec![(0.0, None)];
        }
        let mut out = Vec::new();
        if has_local {
            let headroom = wait(self.local.pod_entries())
                .ok()
                .and_then(|p| p.into_iter().next())
                .map_or(0.0, |e| pods::headroom_mib(&e));
            out.push((headroom, None));
        }
        let remote: Vec<(f64, RemotePod)> = std::thread::scope(|scope| {
            let handles: Vec<_> = remote_pods
                .into_iter()
                .map(|pod| scope.spawn(move || Some((pods::headroom_mib(&pod.load().ok()?), pod))))
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().ok().flatten())
                .collect()
        });
        out.extend(remote.into_iter().map(|(h, p)| (h, Some(p))));
        out.sort_by(|a, b| b.0.total_cmp(&a.0));
        out
    }

    fn create_remote(
        &self,
        pod: &RemotePod,
        mut req: CreateSandbox,
    ) -> Result<Sandbox, ServiceError> {
        req.pod = None;
        // The pod takes the volumes as this server resolved them (its
        // gate trusts ids only from the server in front of it), and this
        // server's volume gateway serves them.
        for (m, v) in req.volume_mounts.iter_mut().zip(&req.volumes) {
            m.id = Some(v.id.clone());
        }
        let tenant = req.owner.as_ref().map(|o| o.tenant.clone());
        // The guest mounts its volumes during the create, through this
        // server's gateway, which must know them by then: the id is chosen
        // here and the sandbox recorded before the pod is asked.
        let early = if req.volumes.is_empty() {
            None
        } else {
            let id = SandboxId::generate();
            req.id = Some(id.clone());
            let owned = Owned {
                pod: pod.id.clone(),
                tenant: tenant.clone(),
                access_token: req.access_token.clone(),
                env: req.env.clone(),
                last_seen: None,
                lost: None,
                volumes: req.volumes.clone(),
            };
            self.keep(id.clone(), owned)?;
            Some(id)
        };
        let body = serde_json::to_value(&req).map_err(internal)?;
        let secrets = (
            req.access_token.clone(),
            req.env.clone(),
            req.volumes.clone(),
        );
        // A tenant's create is that tenant's on the pod too, from a
        // template of its namespace there.
        let acting = pod.acting_for(acting_tenant(req.owner.as_ref()));
        let v = match self.place_remote(&acting, "/v1/sandboxes", body, tenant.as_deref(), secrets)
        {
            Ok(v) => v,
            // Refused before anything was made: nothing to look for.
            Err(e @ (ServiceError::Admission { .. } | ServiceError::Invalid(_))) => {
                return Err(self.unrecord(early, e))
            }
            Err(e @ ServiceError::Pod { status, .. }) if status < 500 => {
                return Err(self.unrecord(early, e))
            }
            Err(e) => {
                // Recorded early: it stays, as reclaim would record it.
                self.reclaim(pod);
                return Err(e);
            }
        };
        self.with_secrets(serde_json::from_value(v).map_err(internal)?)
    }

    /// Forgets a sandbox recorded before its create, which the pod refused
    /// (nothing was made); `e`.
    fn unrecord(&self, early: Option<SandboxId>, e: ServiceError) -> ServiceError {
        if let Some(id) = early {
            if let Err(forgot) = self.forget(&id) {
                tracing::warn!(sandbox = %id, error = %forgot, "a refused create's record stays");
            }
        }
        e
    }

    /// After a create the pod did not answer with a sandbox (it failed
    /// there after recording it, or its answer was lost): every sandbox
    /// the pod has that this server does not record becomes this server's,
    /// with the tenant the pod records, so that it is listed, and can be
    /// deleted, here like any other. The nested pod is this server's
    /// alone: nothing else makes sandboxes on it.
    fn reclaim(&self, pod: &RemotePod) {
        let listed = pod.look("/v1/sandboxes").and_then(|mut v| {
            serde_json::from_value::<Vec<Sandbox>>(v["sandboxes"].take()).map_err(internal)
        });
        let all = match listed {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!(pod = %pod.id, error = %e, "the pod's sandboxes could not be listed after a failed create");
                return;
            }
        };
        let unrecorded: Vec<Sandbox> = all
            .into_iter()
            .filter(|s| s.state != SandboxState::Deleted)
            .filter(|s| self.owner(&s.id).is_none() && self.claimable(&s.id, &pod.id))
            .collect();
        for mut s in unrecorded {
            tracing::info!(pod = %pod.id, sandbox = %s.id, state = %s.state, "a sandbox of a failed create is recorded");
            s.pod = Some(pod.id.clone());
            let owned = Owned {
                pod: pod.id.clone(),
                tenant: s.tenant.clone(),
                access_token: None,
                env: BTreeMap::new(),
                last_seen: Some(s.clone()),
                lost: None,
                // Not known: a create that failed mounts nothing.
                volumes: Vec::new(),
            };
            if let Err(e) = self.keep(s.id, owned) {
                tracing::warn!(pod = %pod.id, error = %e, "a sandbox of a failed create is not in the store");
            }
        }
    }

    /// Placement; see the module documentation.
    fn place(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError> {
        if let Some(pinned) = req.pod.clone() {
            if pinned.as_str() == LOCAL_POD {
                return wait(
                    self.local
                        .create_sandbox(CreateSandbox { pod: None, ..req }),
                );
            }
            let pod = self.pod(&pinned).ok_or_else(|| ServiceError::NotFound {
                kind: "pod",
                id: pinned.to_string(),
            })?;
            return self.create_remote(&pod, req);
        }
        self.coming.check(&req.template)?;
        let candidates = self.candidates(&req);
        if candidates.is_empty() {
            // No pod has it: the local pod's answer (404) says so.
            return wait(self.local.create_sandbox(req));
        }
        let mut refusals = Vec::new();
        for (_, pod) in candidates {
            let result = match &pod {
                None => wait(self.local.create_sandbox(req.clone())),
                Some(pod) => self.create_remote(pod, req.clone()),
            };
            match result {
                Err(ServiceError::Admission { message }) => refusals.push(message),
                Err(ServiceError::Pod {
                    status: 429,
                    message,
                    ..
                }) => refusals.push(message),
                other => return other,
            }
        }
        Err(ServiceError::Admission {
            message: format!("every pod refused the sandbox: {}", refusals.join("; ")),
        })
    }

    /// Remote sandboxes of ours matching `filter` (`pod` already applied).
    fn list_remote(
        &self,
        pod: &RemotePod,
        filter: &SandboxFilter,
    ) -> Result<Vec<Sandbox>, ServiceError> {
        let mut query: Vec<String> = Vec::new();
        if !filter.states.is_empty() {
            let states: Vec<&str> = filter.states.iter().map(|s| s.as_str()).collect();
            query.push(format!("state={}", states.join(",")));
        }
        if let Some(t) = &filter.template {
            query.push(format!("template={}", encode(t.as_str())));
        }
        for (k, v) in &filter.metadata {
            query.push(format!("metadata.{}={}", encode(k), encode(v)));
        }
        let path = if query.is_empty() {
            "/v1/sandboxes".to_string()
        } else {
            format!("/v1/sandboxes?{}", query.join("&"))
        };
        let mut v = pod.look(&path)?;
        pods::rewrite_pod_ids(&mut v, &pod.id);
        let all: Vec<Sandbox> = serde_json::from_value(v["sandboxes"].take()).map_err(internal)?;
        let ours = self.owned_by(&pod.id, filter.tenant.as_deref());
        let ours: Vec<Sandbox> = all.into_iter().filter(|s| ours.contains(&s.id)).collect();
        for s in &ours {
            self.seen(s);
        }
        Ok(ours)
    }
}

impl<L: SandboxApi> Registry for Nested<L> {
    fn forward_fork(
        &self,
        pod: &RemotePod,
        path: &str,
        body: Value,
    ) -> Result<Value, ServiceError> {
        let source = SandboxId::new(path.split('/').nth(3).unwrap_or_default());
        let req: ForkSandbox = serde_json::from_value(body.clone())
            .map_err(|e| ServiceError::Invalid(format!("the fork body: {e}")))?;
        self.place_fork(pod, &source, path, body, req)
    }
}

/// A body read to at most `left` bytes: more is an error, not a cut.
struct Limited<'a> {
    inner: &'a mut dyn std::io::Read,
    left: u64,
}

impl std::io::Read for Limited<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(out)?;
        self.left = self
            .left
            .checked_sub(n as u64)
            .ok_or_else(|| std::io::Error::other("the image is larger than the upload limit"))?;
        Ok(n)
    }
}

/// What a remote sandbox's record keeps that its pod never shows: its
/// envd token, its environment, its volumes.
type Kept = (Option<String>, BTreeMap<String, String>, Vec<MountedVolume>);

impl<L: SandboxApi> SandboxApi for Nested<L> {
    fn mounts_volumes(&self) -> bool {
        self.local.mounts_volumes()
    }
    async fn templates(&self, op: TemplateOp<'_>) -> Result<TemplateReply, ServiceError> {
        blocking(|| {
            match op {
                TemplateOp::List => wait(self.local.templates(op)),
                TemplateOp::Get { key, owner } => {
                    // An id the local pod has for this caller: no pod asked.
                    if let Ok(t) = wait(self.local.template_get(owner, key)) {
                        if t.id.as_str() == key {
                            return Ok(TemplateReply::one(t));
                        }
                    }
                    match self.resolve_everywhere(owner, key)?.into_iter().next() {
                        Some((t, _)) => Ok(TemplateReply::one(t)),
                        None => {
                            // A template still coming (started by this request
                            // if on demand: any request for it is a first use).
                            self.coming.check(key)?;
                            Err(template_not_found(key))
                        }
                    }
                }
                TemplateOp::Create(req) => {
                    self.check_new_name(&req)?;
                    match req.pod.clone() {
                        None => wait(self.local.templates(TemplateOp::Create(req))),
                        Some(p) if p.as_str() == LOCAL_POD => wait(
                            self.local
                                .templates(TemplateOp::Create(CreateTemplate { pod: None, ..req })),
                        ),
                        Some(p) => {
                            let pod = self.pod(&p).ok_or_else(|| ServiceError::NotFound {
                                kind: "pod",
                                id: p.to_string(),
                            })?;
                            // A tenant's template is the tenant's there too.
                            let pod = pod.acting_for(acting_tenant(req.owner.as_ref()));
                            let body = serde_json::to_value(CreateTemplate { pod: None, ..req })
                                .map_err(internal)?;
                            let v = pod.call("POST", "/v1/templates", Some(&body))?;
                            Ok(TemplateReply::one(
                                serde_json::from_value(v).map_err(internal)?,
                            ))
                        }
                    }
                }
                TemplateOp::Delete { key, owner } => {
                    let Some((t, pod)) = self.resolve_everywhere(owner, key)?.into_iter().next()
                    else {
                        return Err(template_not_found(key));
                    };
                    let Some(pod) = pod else {
                        let id = t.id.to_string();
                        return wait(self.local.templates(TemplateOp::Delete { key: &id, owner }));
                    };
                    torpor_scheduler::service::may_delete(owner, &t)?;
                    let path = format!("/v1/templates/{}", encode(t.id.as_str()));
                    pod.acting_for(acting_tenant(owner))
                        .call("DELETE", &path, None)?;
                    Ok(TemplateReply::Deleted)
                }
                TemplateOp::Rename { key, owner, name } => {
                    let Some((t, pod)) = self.resolve_everywhere(owner, key)?.into_iter().next()
                    else {
                        return Err(template_not_found(key));
                    };
                    let Some(pod) = pod else {
                        let id = t.id.to_string();
                        return wait(self.local.templates(TemplateOp::Rename {
                            key: &id,
                            owner,
                            name,
                        }));
                    };
                    torpor_scheduler::service::may_delete(owner, &t)?;
                    let path = format!("/v1/templates/{}", encode(t.id.as_str()));
                    let body = serde_json::json!({ "name": name });
                    let v =
                        pod.acting_for(acting_tenant(owner))
                            .call("PATCH", &path, Some(&body))?;
                    Ok(TemplateReply::one(
                        serde_json::from_value(v).map_err(internal)?,
                    ))
                }
            }
        })
    }
    async fn template_entries(&self) -> Result<Vec<Value>, ServiceError> {
        blocking(|| self.templates_everywhere())
    }
    /// The local pod's images; an install on a nested pod (a build from an
    /// OCI image installs its image where `base` runs) is streamed to it.
    async fn images(&self, op: ImageOp<'_>) -> Result<ImageReply, ServiceError> {
        blocking(|| match op {
            ImageOp::Install {
                name,
                part,
                body,
                limit,
                pod: Some(p),
            } if p.as_str() != LOCAL_POD => {
                let pod = self.pod(p).ok_or_else(|| ServiceError::NotFound {
                    kind: "pod",
                    id: p.to_string(),
                })?;
                let path = format!("/v1/images/{}/{}", encode(name), part.as_str());
                let mut limited = Limited {
                    inner: body,
                    left: limit,
                };
                let answer = pod.upload(&path, &mut limited)?;
                let bytes = answer["bytes"].as_u64().ok_or_else(|| {
                    internal(format!("pod {p}: an image upload's answer: {answer}"))
                })?;
                Ok(ImageReply::Installed(bytes))
            }
            op => wait(self.local.images(op)),
        })
    }
    async fn create_sandbox(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError> {
        blocking(|| self.place(req))
    }
    async fn get_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        blocking(|| {
            if let Some(lost) = self.lost_sandbox(id) {
                return lost;
            }
            match self.remote_sandbox(id) {
                Some(pod) => self.with_secrets(remote::sandbox(&pod, "GET", id, "", None)?),
                None => wait(self.local.get_sandbox(id)),
            }
        })
    }
    async fn list_sandboxes(&self, filter: SandboxFilter) -> Result<Vec<Sandbox>, ServiceError> {
        blocking(|| {
            let local_pod = filter.pod.as_ref().is_none_or(|p| p.as_str() == LOCAL_POD);
            let mut out = if local_pod {
                wait(self.local.list_sandboxes(filter.clone()))?
            } else {
                Vec::new()
            };
            let pods: Vec<RemotePod> = self
                .remote_pods()
                .into_iter()
                .filter(|pod| filter.pod.as_ref().is_none_or(|p| *p == pod.id))
                .collect();
            let filter = &filter;
            let lists = std::thread::scope(|scope| {
                let handles: Vec<_> = pods
                    .iter()
                    .map(|pod| scope.spawn(move || (pod, self.list_remote(pod, filter))))
                    .collect();
                handles
                    .into_iter()
                    .filter_map(|h| h.join().ok())
                    .collect::<Vec<_>>()
            });
            for (pod, list) in lists {
                match list {
                    Ok(list) => out.extend(list),
                    Err(e) => tracing::warn!(
                        pod = %pod.id,
                        error = %e,
                        "sandboxes of an unreachable pod left out"
                    ),
                }
            }
            out.extend(self.lost_listed(filter));
            out.sort_by_key(|s| s.created_at);
            Ok(out)
        })
    }
    async fn lifecycle(&self, id: &SandboxId, op: Lifecycle) -> Result<Outcome, ServiceError> {
        blocking(|| {
            if let Some(e) = self.lost_error(id) {
                return Err(e);
            }
            match self.remote_sandbox(id) {
                Some(pod) => self.outcome_with_secrets(remote::outcome(&pod, id, op)?),
                None => wait(self.local.lifecycle(id, op)),
            }
        })
    }
    async fn delete_sandbox(&self, id: &SandboxId) -> Result<(), ServiceError> {
        blocking(|| {
            if self.lost_error(id).is_some() {
                // Its VM is gone with its nested host: nothing left but ours.
                return self.forget(id);
            }
            match self.remote_sandbox(id) {
                Some(pod) => {
                    remote::call(&pod, "DELETE", id, "", None)?;
                    self.forget(id)
                }
                None => wait(self.local.delete_sandbox(id)),
            }
        })
    }
    async fn set_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<Sandbox, ServiceError> {
        blocking(|| {
            if let Some(e) = self.lost_error(id) {
                return Err(e);
            }
            match self.remote_sandbox(id) {
                Some(pod) => {
                    let body = serde_json::json!({
                        "keep_alive_ms": keep_alive_ms,
                        "timeout_ms": timeout_ms,
                    });
                    self.with_secrets(remote::sandbox(&pod, "PATCH", id, "", Some(&body))?)
                }
                None => wait(self.local.set_timeout(id, keep_alive_ms, timeout_ms)),
            }
        })
    }
    async fn pod_entries(&self) -> Result<Vec<Value>, ServiceError> {
        blocking(|| {
            let mut out = wait(self.local.pod_entries())?;
            let remote: Vec<Value> = std::thread::scope(|scope| {
                let handles: Vec<_> = self
                    .remote_pods()
                    .into_iter()
                    .map(|pod| scope.spawn(move || pod.entry()))
                    .collect();
                handles.into_iter().filter_map(|h| h.join().ok()).collect()
            });
            out.extend(remote);
            Ok(out)
        })
    }
    async fn set_pod(
        &self,
        id: &PodId,
        ratio: Option<f64>,
        high_watermark: Option<f64>,
    ) -> Result<PodView, ServiceError> {
        blocking(|| wait(self.local.set_pod(id, ratio, high_watermark)))
    }
    fn registry(&self) -> Option<&dyn Registry> {
        Some(self)
    }
    async fn relay(&self, to: Relay<'_>) -> Option<RemotePod> {
        blocking(|| match to {
            Relay::Sandbox { id, .. } => self.remote_sandbox(id),
            Relay::Pod(id) => self.pod(id),
        })
    }
    async fn sandbox_tenant(&self, id: &SandboxId) -> Result<Option<String>, ServiceError> {
        blocking(|| match self.owner(id) {
            Some(o) => Ok(o.tenant),
            None => wait(self.local.sandbox_tenant(id)),
        })
    }
    async fn metrics(&self) -> String {
        blocking(|| wait(self.local.metrics()))
    }
    /// The local pod's (a remote sandbox's checkpoint, network and port
    /// routes are relayed to its pod at the HTTP layer).
    fn service(&self) -> Option<&crate::service::Service> {
        self.local.service()
    }
    async fn metrics_history(
        &self,
        id: &SandboxId,
        range: crate::wire::Range,
    ) -> Result<Vec<torpor_scheduler::service::history::MetricSample>, ServiceError> {
        blocking(|| {
            if let Some(e) = self.lost_error(id) {
                return Err(e);
            }
            match self.remote_sandbox(id) {
                Some(pod) => wait(crate::pods::metrics_history(&pod, id, range)),
                None => wait(self.local.metrics_history(id, range)),
            }
        })
    }
    async fn fork_sandbox(
        &self,
        id: &SandboxId,
        req: ForkSandbox,
    ) -> Result<Sandbox, ServiceError> {
        blocking(|| {
            if let Some(e) = self.lost_error(id) {
                return Err(e);
            }
            match self.remote_sandbox(id) {
                Some(pod) => self.fork_remote(&pod, id, req),
                None => wait(self.local.fork_sandbox(id, req)),
            }
        })
    }
    async fn template_from_sandbox(
        &self,
        id: &SandboxId,
        req: crate::service::TemplateFromSandbox,
    ) -> Result<torpor_scheduler::model::Template, ServiceError> {
        blocking(|| {
            if let Some(e) = self.lost_error(id) {
                return Err(e);
            }
            let Some(pod) = self.remote_sandbox(id) else {
                return wait(self.local.template_from_sandbox(id, req));
            };
            // The template lives on the sandbox's pod, beside its layers, and
            // is the sandbox's tenant's there (its name in that namespace).
            let tenant = self.owner(id).and_then(|o| o.tenant);
            remote::template(&pod.acting_for(tenant.as_deref()), id, &req)
        })
    }
    async fn sandbox_templates(
        &self,
        source: Option<&SandboxId>,
    ) -> Result<Vec<(torpor_scheduler::model::Template, SandboxId)>, ServiceError> {
        blocking(|| {
            let mut out = wait(self.local.sandbox_templates(source))?;
            // Remote ones name their source sandbox; only ours are shown.
            for v in self.templates_everywhere()? {
                if v["pod"] == LOCAL_POD {
                    continue;
                }
                let Ok(t) = serde_json::from_value::<Template>(v) else {
                    continue;
                };
                let Some(from) = t.source.clone() else {
                    continue;
                };
                let ours = self.owner(&from).is_some();
                if ours && source.is_none_or(|s| *s == from) && t.state != TemplateState::Deleted {
                    out.push((t, from));
                }
            }
            Ok(out)
        })
    }
    async fn execute(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        mode: ExecMode<'_>,
    ) -> Result<GuestCall<ExecReply>, ServiceError> {
        blocking(|| {
            if let Some(e) = self.lost_error(id) {
                return Err(e);
            }
            if self.remote_sandbox(id).is_none() {
                return wait(self.local.execute(id, req, cancel, mode));
            }
            // A remote sandbox's exec (the routes relay theirs to the pod; a
            // template build runs its steps here) through its agent tunnel,
            // bounded as the pod bounds its own.
            let mut req = req;
            req.timeout_ms.get_or_insert(REMOTE_EXEC_LIMIT_MS);
            match mode {
                ExecMode::Collect => crate::calls::through_tunnel(
                    |f| wait(self.with_guest(id, f)),
                    |link| link.exec(req, cancel).map(ExecReply::Collected),
                ),
                ExecMode::Stream {
                    on_start,
                    on_output,
                } => {
                    on_start(&Outcome {
                        sandbox: wait(self.get_sandbox(id))?,
                        resumed: false,
                        resume_ms: None,
                    });
                    crate::calls::through_tunnel(
                        |f| wait(self.with_guest(id, f)),
                        |link| {
                            link.exec_streaming(req, cancel, on_output)
                                .map(ExecReply::Streamed)
                        },
                    )
                }
            }
        })
    }
    async fn files(
        &self,
        id: &SandboxId,
        op: FileOp<'_>,
    ) -> Result<GuestCall<FileReply>, ServiceError> {
        blocking(|| {
            if let Some(e) = self.lost_error(id) {
                return Err(e);
            }
            if self.remote_sandbox(id).is_none() {
                return wait(self.local.files(id, op));
            }
            crate::calls::through_tunnel(|f| wait(self.with_guest(id, f)), |link| op.run(link))
        })
    }
    /// A remote sandbox's agent through its pod's agent tunnel.
    async fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut (dyn FnMut(&AgentLink) -> Result<(), GuestError> + Send),
    ) -> Result<Outcome, ServiceError> {
        blocking(|| {
            if let Some(e) = self.lost_error(id) {
                return Err(e);
            }
            let Some(pod) = self.remote_sandbox(id) else {
                return wait(self.local.with_guest(id, f));
            };
            let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
                ServiceError::Internal("the agent tunnel needs the API's runtime".into())
            })?;
            let dial = crate::pods::tunnel::dialer(runtime, pod.line.clone(), id.clone());
            let link = AgentLink::dialed(id.as_str(), format!("pod {}", pod.id), dial);
            f(&link).map_err(ServiceError::Guest)?;
            Ok(Outcome {
                sandbox: self.with_secrets(remote::sandbox(&pod, "GET", id, "", None)?)?,
                resumed: false,
                resume_ms: None,
            })
        })
    }
}
