//! The federation: `torpor serve`'s [`SandboxApi`] over its local pod (the
//! in-process [`Service`]) and remote pods (`torpor pod serve`, reached
//! through their own REST API with their token).
//!
//! Each pod is an autonomous service deciding admission and hibernation for
//! its own memory; the federation only places sandboxes on pods and routes
//! requests to the owning pod:
//!
//! - placement (`create_sandbox`): among pods that have the template (or
//!   the one pinned with `pod`), by most free admission headroom; a pod's
//!   429 moves on to the next, 429 when every pod refuses;
//! - routing ([`routing`]): every sandbox route of a remote sandbox, and
//!   `PATCH /v1/pods/{id}` of a remote pod, is forwarded as it came and its
//!   answer passed back (a pod that does not answer: 502 `pod_unreachable`);
//! - lists merge the pods (templates with a `pod` field);
//! - crash safety ([`store`]): a forwarded create or fork is recorded as a
//!   pending placement first and tagged `torpor.placement` on the sandbox;
//!   the owner is recorded before the API answers; on start, pending
//!   placements are matched against what the pods hold and adopted or
//!   dropped.

mod coming;
mod remote;
pub mod store;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use torpor_scheduler::model::{PodId, Sandbox, SandboxId, Template, TemplateId, TemplateState};
use torpor_scheduler::service::LOCAL_POD;

use crate::backend::{Lifecycle, Registry, Relay, SandboxApi};
use crate::calls::{ExecMode, ExecReply, FileOp, FileReply, TemplateOp, TemplateReply};
use crate::client::{encode, ClientError};
use crate::pods::{self, RemotePod};
use crate::service::{
    AgentLink, Cancel, CreateSandbox, CreateTemplate, ExecRequest, ForkSandbox, GuestCall,
    GuestError, Outcome, PodView, SandboxFilter, ServiceError,
};
use crate::tls::Fingerprint;
pub use coming::{Starter, RETRY_AFTER_S};
use store::{FederationStore, StoredPod};

/// The metadata key a forwarded create or fork is tagged with.
pub const PLACEMENT_KEY: &str = "torpor.placement";
/// Test hook: sleep this many ms after a pod answered a create and before
/// the owner is recorded (the crash window the placement records cover).
pub const STALL_PLACEMENT_ENV: &str = "TORPOR_STALL_PLACEMENT_MS";

/// `POST /v1/pods`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddPod {
    /// `unix:/PATH`, `tls:HOST:PORT` or `tcp:LOOPBACK:PORT`.
    pub address: String,
    pub token: String,
    /// SHA-256 fingerprint of a `tls:` pod's certificate, which is the only
    /// certificate trusted for it.
    #[serde(default)]
    pub fingerprint: Option<String>,
}

/// The local pod and the remote pods.
#[derive(Debug)]
pub struct Federation<L: SandboxApi> {
    local: Arc<L>,
    store: FederationStore,
    pods: RwLock<BTreeMap<PodId, RemotePod>>,
    /// Remote sandboxes: their pod and tenant.
    owners: RwLock<HashMap<SandboxId, store::Owner>>,
    io_timeout: Duration,
    /// Templates a pod on its way up will have (the nested pod's `base`).
    coming: coming::Coming,
}

fn internal(e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Internal(e.to_string())
}

impl<L: SandboxApi> Federation<L> {
    /// Opens the federation's store in `data_dir`, loads the remote pods and
    /// settles placements a crash left pending. `io_timeout` bounds each
    /// call to a pod.
    pub fn open(
        local: Arc<L>,
        data_dir: &Path,
        io_timeout: Duration,
    ) -> Result<Arc<Self>, ServiceError> {
        let store = FederationStore::open(data_dir).map_err(internal)?;
        let mut pods = BTreeMap::new();
        for p in store.pods().map_err(internal)? {
            let pin = match p.fingerprint.as_deref().map(Fingerprint::parse).transpose() {
                Ok(pin) => pin,
                Err(e) => {
                    tracing::error!(pod = %p.id, error = %e, "a stored pod's fingerprint; skipped");
                    continue;
                }
            };
            match RemotePod::new(p.id.clone(), &p.address, &p.token, pin, io_timeout) {
                Ok(pod) => {
                    pods.insert(p.id, pod);
                }
                // A pod registered before plain TCP was limited to
                // loopback: it stays unused until registered again.
                Err(e) => tracing::error!(
                    pod = %p.id,
                    error = %e,
                    "a registered pod is no longer accepted; remove it and register it again"
                ),
            }
        }
        let owners = store.owners().map_err(internal)?.into_iter().collect();
        let fed = Arc::new(Federation {
            local,
            store,
            pods: RwLock::new(pods),
            owners: RwLock::new(owners),
            io_timeout,
            coming: coming::Coming::default(),
        });
        fed.settle_placements();
        Ok(fed)
    }

    fn pod(&self, id: &PodId) -> Option<RemotePod> {
        self.pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    /// The remote pod that owns sandbox `id`.
    fn remote_sandbox(&self, id: &SandboxId) -> Option<RemotePod> {
        self.owner(id).and_then(|(p, _)| self.pod(&p))
    }

    fn remote_pods(&self) -> Vec<RemotePod> {
        self.pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    fn owner(&self, id: &SandboxId) -> Option<store::Owner> {
        self.owners
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    /// Remote sandboxes of `pod` (of `tenant` only, if given).
    fn owned_by(&self, pod: &PodId, tenant: Option<&str>) -> Vec<SandboxId> {
        self.owners
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, (p, t))| p == pod && tenant.is_none_or(|want| t.as_deref() == Some(want)))
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// After a crash: a pending placement whose tagged sandbox is on its pod
    /// is adopted, one whose pod answers without it is dropped, one whose pod
    /// does not answer stays for the next start.
    fn settle_placements(&self) {
        let pending = match self.store.placements() {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "cannot read pending placements");
                return;
            }
        };
        for placement in pending {
            let Some(pod) = self.pod(&placement.pod) else {
                let _ = self.store.end_placement(&placement.id, None);
                continue;
            };
            let path = format!(
                "/v1/sandboxes?metadata.{}={}",
                encode(PLACEMENT_KEY),
                encode(&placement.id)
            );
            let found = match pod.look(&path) {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(placement = %placement.id, error = %e, "pending placement kept: pod unreachable");
                    continue;
                }
            };
            let made: Vec<SandboxId> = found["sandboxes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s["id"].as_str().map(SandboxId::new))
                .collect();
            let made: Vec<SandboxId> = made
                .into_iter()
                .filter(|id| self.claimable(id, &pod.id))
                .collect();
            let result = match made.first() {
                Some(sandbox) => {
                    tracing::info!(placement = %placement.id, %sandbox, pod = %pod.id, "adopted a sandbox placed before a restart");
                    self.record(&placement, Some((sandbox, &pod.id)))
                }
                None => {
                    tracing::info!(placement = %placement.id, pod = %pod.id, "dropped a placement the pod never made");
                    self.record(&placement, None)
                }
            };
            if let Err(e) = result {
                tracing::error!(placement = %placement.id, error = %e, "cannot settle a placement");
            }
        }
    }

    /// Ends a placement in the store and, for a made sandbox, in memory.
    fn record(
        &self,
        placement: &store::Placement,
        made: Option<(&SandboxId, &PodId)>,
    ) -> Result<(), ServiceError> {
        self.store
            .end_placement(&placement.id, made)
            .map_err(internal)?;
        if let Some((sandbox, pod)) = made {
            self.owners
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(sandbox.clone(), (pod.clone(), placement.tenant.clone()));
        }
        Ok(())
    }

    /// Whether `id`, which pod `pod` says it made, may become its: a
    /// well-formed sandbox id that no other pod (the local one included)
    /// and no earlier record owns.
    fn claimable(&self, id: &SandboxId, pod: &PodId) -> bool {
        SandboxId::is_well_formed(id.as_str())
            && self.owner(id).is_none_or(|(p, _)| p == *pod)
            && self.local.get_sandbox(id).is_err()
    }

    /// Marks template `name` as coming (`why`: not there yet, and why) or
    /// there (`None`): creating a sandbox from it answers 503 with `why`.
    pub fn template_coming(&self, name: &str, why: Option<String>) {
        self.coming.set(name, why);
    }

    /// Offers template `name` on demand: the first create that asks for it
    /// runs `start` (which returns at once and reports progress through
    /// [`Federation::template_coming`]) and answers 503 like the next ones.
    pub fn template_on_demand(&self, name: &str, why: String, start: coming::Starter) {
        self.coming.on_demand(name, why, start);
    }

    /// What is said about `name` while it is coming.
    pub fn template_progress(&self, name: &str) -> Option<String> {
        self.coming.why(name)
    }

    /// Registers a pod after checking it answers with `token`; idempotent
    /// for an address already registered with the same token.
    pub fn register(&self, req: AddPod) -> Result<Value, ServiceError> {
        pods::pod_address(&req.address)?;
        if let Some(known) = self
            .remote_pods()
            .into_iter()
            .find(|p| p.address == req.address)
        {
            let same = self
                .store
                .pods()
                .map_err(internal)?
                .iter()
                .any(|p| p.id == known.id && p.token == req.token);
            if same {
                return Ok(known.entry());
            }
            return Err(ServiceError::ResourceConflict(format!(
                "pod address {} is already registered as {}",
                req.address, known.id
            )));
        }
        let pin = req
            .fingerprint
            .as_deref()
            .map(Fingerprint::parse_exact)
            .transpose()
            .map_err(|e| ServiceError::Invalid(e.to_string()))?;
        let pod = RemotePod::new(
            PodId::generate(),
            &req.address,
            &req.token,
            pin,
            self.io_timeout,
        )?;
        // A certificate other than the pinned one is the registrant's
        // mistake (or an attack), not an unreachable pod.
        if let Err(ClientError::Tls { message, .. }) =
            pod.client.request("GET", "/healthz", None, None)
        {
            return Err(ServiceError::Invalid(format!(
                "the pod at {} failed TLS verification: {message}",
                req.address
            )));
        }
        let entry = match pod.load() {
            Ok(v) => v,
            Err(ServiceError::Pod { status: 401, .. }) => {
                return Err(ServiceError::Invalid(format!(
                    "the pod at {} refused the token (401)",
                    req.address
                )))
            }
            // No pod answers at the address given: the request names a pod
            // that is not there (404, the same code), not a failure of this
            // server.
            Err(ServiceError::Pod {
                status: 502,
                code,
                message,
            }) => {
                return Err(ServiceError::Pod {
                    status: 404,
                    code,
                    message,
                })
            }
            Err(e) => return Err(e),
        };
        self.store
            .add_pod(&StoredPod {
                id: pod.id.clone(),
                address: req.address.clone(),
                token: req.token,
                fingerprint: pin.map(|f| f.to_string()),
            })
            .map_err(internal)?;
        tracing::info!(pod = %pod.id, address = %req.address, "registered a remote pod");
        self.pods
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pod.id.clone(), pod);
        Ok(entry)
    }

    /// Unregisters a pod: refused while it holds live sandboxes of ours; a
    /// pod that does not answer can be removed (its sandboxes are forgotten).
    pub fn unregister(&self, id: &PodId) -> Result<(), ServiceError> {
        if id.as_str() == LOCAL_POD {
            return Err(ServiceError::ResourceConflict(
                "the local pod cannot be removed".into(),
            ));
        }
        let pod = self.pod(id).ok_or_else(|| ServiceError::NotFound {
            kind: "pod",
            id: id.to_string(),
        })?;
        let ours = self.owned_by(id, None);
        if !ours.is_empty() {
            match pod.look("/v1/sandboxes") {
                Ok(list) => {
                    let live = list["sandboxes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter(|s| ours.iter().any(|o| s["id"] == o.as_str()))
                        .count();
                    if live > 0 {
                        return Err(ServiceError::ResourceConflict(format!(
                            "pod {id} holds {live} live sandbox(es); delete them first"
                        )));
                    }
                }
                Err(e) => tracing::warn!(pod = %id, error = %e, "removing an unreachable pod"),
            }
        }
        self.store.remove_pod(id).map_err(internal)?;
        self.pods
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        self.owners
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, (p, _)| p != id);
        Ok(())
    }

    /// One agent call on remote sandbox `id` through the agent tunnel
    /// (E2B's `/files`, which reaches the federation's methods).
    fn remote_guest<T>(
        &self,
        id: &SandboxId,
        call: impl FnOnce(&AgentLink) -> Result<T, GuestError>,
    ) -> Result<GuestCall<T>, ServiceError> {
        let mut call = Some(call);
        let mut value = None;
        let outcome = self.with_guest(id, &mut |link| {
            if let Some(call) = call.take() {
                value = Some(call(link)?);
            }
            Ok(())
        })?;
        let value =
            value.ok_or_else(|| ServiceError::Internal("the agent call did not run".into()))?;
        Ok(GuestCall { outcome, value })
    }

    /// Sends a create or fork to a remote pod, tagged with a placement that
    /// is recorded first; the sandbox becomes the pod's before returning.
    fn place_remote(
        &self,
        pod: &RemotePod,
        method: &str,
        path: &str,
        mut body: Value,
        tenant: Option<&str>,
    ) -> Result<Value, ServiceError> {
        if !(body["metadata"].is_null() || body["metadata"].is_object()) {
            return Err(ServiceError::Invalid(
                "metadata must be an object of strings".into(),
            ));
        }
        let placement = self
            .store
            .begin_placement(&pod.id, tenant)
            .map_err(internal)?;
        body["metadata"][PLACEMENT_KEY] = json!(placement.id);
        let answer = pod.send(method, path, Some(&body));
        let made = match &answer {
            Ok(a) if a.is_success() => serde_json::from_slice::<Value>(&a.body)
                .ok()
                .and_then(|v| v["id"].as_str().map(SandboxId::new)),
            _ => None,
        };
        // A pod answers for its own new sandboxes only: an id that is
        // malformed or someone else's is refused, never recorded.
        if let Some(id) = made.as_ref().filter(|id| !self.claimable(id, &pod.id)) {
            tracing::warn!(pod = %pod.id, sandbox = %pods::sanitized(id.as_str()), "a pod answered with a sandbox id it does not own; refused");
            self.record(&placement, None)?;
            return Err(ServiceError::Pod {
                status: 502,
                code: crate::error::code::POD_UNREACHABLE.into(),
                message: format!(
                    "pod {} answered with a sandbox id that is malformed or not its own",
                    pod.id
                ),
            });
        }
        if let Ok(ms) = std::env::var(STALL_PLACEMENT_ENV) {
            std::thread::sleep(Duration::from_millis(ms.parse().unwrap_or(0)));
        }
        match (&answer, &made) {
            // No answer: the pod may still have made it; the placement stays
            // pending and is settled at the next start.
            (Err(_), _) => {}
            (Ok(_), made) => self.record(&placement, made.as_ref().map(|s| (s, &pod.id)))?,
        }
        let answer = answer?;
        if !answer.is_success() {
            return Err(pod.error(&answer));
        }
        let mut v: Value = serde_json::from_slice(&answer.body).map_err(internal)?;
        pods::rewrite_pod_ids(&mut v, &pod.id);
        Ok(v)
    }

    /// Pods that can take a sandbox of `template`, most free headroom first.
    fn candidates(&self, template: &str) -> Vec<(f64, Option<RemotePod>)> {
        let mut out = Vec::new();
        let has_local = self.local.get_template(&TemplateId::new(template)).is_ok()
            || self
                .local
                .list_templates()
                .is_ok_and(|ts| ts.iter().any(|t| t.name == template));
        let remote_pods = self.remote_pods();
        if has_local && remote_pods.is_empty() {
            // Nothing to rank it against: the local pod's headroom (a
            // list of every sandbox, the PSS of every VMM) is not needed.
            return vec![(0.0, None)];
        }
        if has_local {
            let headroom = self
                .local
                .pod_entries()
                .ok()
                .and_then(|p| p.into_iter().next())
                .map_or(0.0, |e| pods::headroom_mib(&e));
            out.push((headroom, None));
        }
        let remote: Vec<(f64, RemotePod)> = std::thread::scope(|scope| {
            let handles: Vec<_> = remote_pods
                .into_iter()
                .map(|pod| {
                    scope.spawn(move || {
                        let templates = pod.look("/v1/templates").ok()?;
                        let has = templates["templates"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .any(|t| t["id"] == template || t["name"] == template);
                        if !has {
                            return None;
                        }
                        let load = pod.load().ok()?;
                        Some((pods::headroom_mib(&load), pod))
                    })
                })
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
        let tenant = req.owner.as_ref().map(|o| o.tenant.clone());
        let body = serde_json::to_value(&req).map_err(internal)?;
        let v = self.place_remote(pod, "POST", "/v1/sandboxes", body, tenant.as_deref())?;
        let mut sandbox: Sandbox = serde_json::from_value(v).map_err(internal)?;
        // The pod keeps the envd token and the environment but never shows
        // them: kept here too, for the federation's envd.
        self.store
            .set_secrets(&sandbox.id, req.access_token.as_deref(), &req.env)
            .map_err(internal)?;
        sandbox.access_token = req.access_token.clone();
        sandbox.env = req.env.clone();
        Ok(sandbox)
    }

    /// Placement; see the module documentation.
    fn place(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError> {
        if let Some(pinned) = req.pod.clone() {
            if pinned.as_str() == LOCAL_POD {
                return self
                    .local
                    .create_sandbox(CreateSandbox { pod: None, ..req });
            }
            let pod = self.pod(&pinned).ok_or_else(|| ServiceError::NotFound {
                kind: "pod",
                id: pinned.to_string(),
            })?;
            return self.create_remote(&pod, req);
        }
        self.coming.check(&req.template)?;
        let candidates = self.candidates(&req.template);
        if candidates.is_empty() {
            // No pod has it: the local pod's answer (404) says so.
            return self.local.create_sandbox(req);
        }
        let mut refusals = Vec::new();
        for (_, pod) in candidates {
            let result = match &pod {
                None => self.local.create_sandbox(req.clone()),
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
        Ok(all.into_iter().filter(|s| ours.contains(&s.id)).collect())
    }
}

impl<L: SandboxApi> Registry for Federation<L> {
    fn add_pod(&self, req: AddPod) -> Result<Value, ServiceError> {
        self.register(req)
    }
    fn remove_pod(&self, id: &PodId) -> Result<(), ServiceError> {
        self.unregister(id)
    }
    fn forward_fork(
        &self,
        pod: &RemotePod,
        path: &str,
        body: Value,
    ) -> Result<Value, ServiceError> {
        // The fork is its source's tenant's.
        let source = SandboxId::new(path.split('/').nth(3).unwrap_or_default());
        let tenant = self.owner(&source).and_then(|(_, t)| t);
        self.place_remote(pod, "POST", path, body, tenant.as_deref())
    }
}

impl<L: SandboxApi> SandboxApi for Federation<L> {
    fn templates(&self, op: TemplateOp<'_>) -> Result<TemplateReply, ServiceError> {
        match op {
            TemplateOp::List => self.local.templates(op),
            TemplateOp::Get(id) => match self.local.get_template(id) {
                Err(ServiceError::NotFound { kind, id: missing }) => {
                    match self.remote_template("GET", id)? {
                        Some(v) => Ok(TemplateReply::one(
                            serde_json::from_value(v).map_err(internal)?,
                        )),
                        None => {
                            // A template still coming (started by this request
                            // if on demand: any request for it is a first use).
                            self.coming.check(id.as_str())?;
                            Err(ServiceError::NotFound { kind, id: missing })
                        }
                    }
                }
                other => other.map(TemplateReply::one),
            },
            TemplateOp::Create(req) => match req.pod.clone() {
                None => self.local.templates(TemplateOp::Create(req)),
                Some(p) if p.as_str() == LOCAL_POD => self
                    .local
                    .templates(TemplateOp::Create(CreateTemplate { pod: None, ..req })),
                Some(p) => {
                    let pod = self.pod(&p).ok_or_else(|| ServiceError::NotFound {
                        kind: "pod",
                        id: p.to_string(),
                    })?;
                    let body = serde_json::to_value(CreateTemplate { pod: None, ..req })
                        .map_err(internal)?;
                    let v = pod.call("POST", "/v1/templates", Some(&body))?;
                    Ok(TemplateReply::one(
                        serde_json::from_value(v).map_err(internal)?,
                    ))
                }
            },
            TemplateOp::Delete(id) => match self.local.templates(op) {
                Err(ServiceError::NotFound { kind, id: missing }) => {
                    match self.remote_template("DELETE", id)? {
                        Some(_) => Ok(TemplateReply::Deleted),
                        None => Err(ServiceError::NotFound { kind, id: missing }),
                    }
                }
                other => other,
            },
        }
    }
    fn template_entries(&self) -> Result<Vec<Value>, ServiceError> {
        self.templates_everywhere()
    }
    fn create_sandbox(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError> {
        self.place(req)
    }
    fn get_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        match self.remote_sandbox(id) {
            Some(pod) => self.with_secrets(remote::sandbox(&pod, "GET", id, "", None)?),
            None => self.local.get_sandbox(id),
        }
    }
    fn list_sandboxes(&self, filter: SandboxFilter) -> Result<Vec<Sandbox>, ServiceError> {
        let local_pod = filter.pod.as_ref().is_none_or(|p| p.as_str() == LOCAL_POD);
        let mut out = if local_pod {
            self.local.list_sandboxes(filter.clone())?
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
        out.sort_by_key(|s| s.created_at);
        Ok(out)
    }
    fn lifecycle(&self, id: &SandboxId, op: Lifecycle) -> Result<Outcome, ServiceError> {
        match self.remote_sandbox(id) {
            Some(pod) => self.outcome_with_secrets(remote::outcome(&pod, id, op)?),
            None => self.local.lifecycle(id, op),
        }
    }
    fn delete_sandbox(&self, id: &SandboxId) -> Result<(), ServiceError> {
        match self.remote_sandbox(id) {
            Some(pod) => remote::call(&pod, "DELETE", id, "", None).map(drop),
            None => self.local.delete_sandbox(id),
        }
    }
    fn set_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<Sandbox, ServiceError> {
        match self.remote_sandbox(id) {
            Some(pod) => {
                let body = serde_json::json!({
                    "keep_alive_ms": keep_alive_ms,
                    "timeout_ms": timeout_ms,
                });
                self.with_secrets(remote::sandbox(&pod, "PATCH", id, "", Some(&body))?)
            }
            None => self.local.set_timeout(id, keep_alive_ms, timeout_ms),
        }
    }
    fn pod_entries(&self) -> Result<Vec<Value>, ServiceError> {
        let mut out = self.local.pod_entries()?;
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
    }
    fn set_pod(
        &self,
        id: &PodId,
        ratio: Option<f64>,
        high_watermark: Option<f64>,
    ) -> Result<PodView, ServiceError> {
        self.local.set_pod(id, ratio, high_watermark)
    }
    fn registry(&self) -> Option<&dyn Registry> {
        Some(self)
    }
    fn relay(&self, to: Relay<'_>) -> Option<RemotePod> {
        match to {
            Relay::Sandbox { id, .. } => self.remote_sandbox(id),
            Relay::Pod(id) => self.pod(id),
        }
    }
    fn sandbox_tenant(&self, id: &SandboxId) -> Result<Option<String>, ServiceError> {
        match self.owner(id) {
            Some((_, tenant)) => Ok(tenant),
            None => self.local.sandbox_tenant(id),
        }
    }
    fn metrics(&self) -> String {
        self.local.metrics()
    }
    /// The local pod's (a remote sandbox's checkpoint, network and port
    /// routes are relayed to its pod at the HTTP layer).
    fn service(&self) -> Option<&crate::service::Service> {
        self.local.service()
    }
    fn fork_sandbox(&self, id: &SandboxId, req: ForkSandbox) -> Result<Sandbox, ServiceError> {
        match self.remote_sandbox(id) {
            Some(pod) => self.fork_remote(&pod, id, req),
            None => self.local.fork_sandbox(id, req),
        }
    }
    fn template_from_sandbox(
        &self,
        id: &SandboxId,
        req: crate::service::TemplateFromSandbox,
    ) -> Result<torpor_scheduler::model::Template, ServiceError> {
        let Some(pod) = self.remote_sandbox(id) else {
            return self.local.template_from_sandbox(id, req);
        };
        // The template lives on the sandbox's pod, beside its layers.
        remote::template(&pod, id, &req)
    }
    fn sandbox_templates(
        &self,
        source: Option<&SandboxId>,
    ) -> Result<Vec<(torpor_scheduler::model::Template, SandboxId)>, ServiceError> {
        let mut out = self.local.sandbox_templates(source)?;
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
    }
    fn execute(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        mode: ExecMode<'_>,
    ) -> Result<GuestCall<ExecReply>, ServiceError> {
        self.local.execute(id, req, cancel, mode)
    }
    fn files(&self, id: &SandboxId, op: FileOp<'_>) -> Result<GuestCall<FileReply>, ServiceError> {
        if self.remote_sandbox(id).is_none() {
            return self.local.files(id, op);
        }
        self.remote_guest(id, |link| op.run(link))
    }
    /// A remote sandbox's agent through its pod's agent tunnel.
    fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut dyn FnMut(&AgentLink) -> Result<(), GuestError>,
    ) -> Result<Outcome, ServiceError> {
        let Some(pod) = self.remote_sandbox(id) else {
            return self.local.with_guest(id, f);
        };
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ServiceError::Internal("the agent tunnel needs the API's runtime".into())
        })?;
        let dial = crate::agent_tunnel::dialer(runtime, pod.line.clone(), id.clone());
        let link = AgentLink::dialed(id.as_str(), format!("pod {}", pod.id), dial);
        f(&link).map_err(ServiceError::Guest)?;
        Ok(Outcome {
            sandbox: self.with_secrets(remote::sandbox(&pod, "GET", id, "", None)?)?,
            resumed: false,
            resume_ms: None,
        })
    }
}
