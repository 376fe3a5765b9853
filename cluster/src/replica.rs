//! An API replica: the [`SandboxApi`] over PostgreSQL and the pods' work
//! queues. It keeps no state of its own; any replica answers any request.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use serde_json::{json, Value};
use torpor_scheduler::model::{random_bytes, PodId, Sandbox, SandboxId};
use torpor_scheduler::service::LOCAL_POD;
use torpor_scheduler::state::SandboxState;

use super::db::{Db, PodRow};
use super::finished::Finished;
use super::placement;
use super::wire::{self, OpOutcome, Operation, Reply};
use super::{ClusterConfig, ClusterError};
use torpor_client::pin::Fingerprint;
use torpor_gate::backend::{Lifecycle, SandboxApi};
use torpor_gate::error::code;
use torpor_gate::pods::RemotePod;
use torpor_gate::quota::Usage;
use torpor_gate::service::{
    AgentLink, Cancel, CreateSandbox, ExecRequest, ForkSandbox, GuestCall, GuestError, Outcome,
    PodView, SandboxFilter, ServiceError,
};

/// Placement picks at random among this many of the pods ranked first
/// (`placement.rs`), so that replicas placing at once do not all pick the
/// same (the default of `ClusterConfig::placement_choices`).
pub const PLACEMENT_CHOICES: usize = 2;

/// The replica.
#[derive(Debug)]
pub struct Cluster {
    pub(super) rt: tokio::runtime::Handle,
    pub(super) db: Arc<Db>,
    pub(super) js: jetstream::Context,
    pub(super) config: ClusterConfig,
    /// Wakes [`Cluster::wait`] when its operation's outcome is written.
    pub(super) finished: Arc<Finished>,
}

/// Where a placement goes: of the pods up with `template` and headroom,
/// those holding the most bytes of its layers, by headroom (most first:
/// `placement.rs`); then at random among the first `choices` of them.
pub fn place<'a>(
    pods: &'a [PodRow],
    template: &str,
    down_after: Duration,
    choices: usize,
    random: u64,
) -> Option<&'a PodRow> {
    let fit: Vec<&PodRow> = pods
        .iter()
        .filter(|p| p.silent_s < down_after.as_secs_f64())
        .filter(|p| p.templates.iter().any(|t| t == template))
        .filter(|p| p.headroom_mib > 0.0)
        .collect();
    let whole = placement::template_bytes(pods, template);
    let (ranked, top) = placement::ranked(
        fit,
        |p| placement::template_held(p, template, whole),
        |_| false,
    );
    let n = top.min(choices.max(1));
    if n == 0 {
        return None;
    }
    Some(ranked[(random % n as u64) as usize])
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    random_bytes(&mut b).map_or(0, |_| u64::from_le_bytes(b))
}

impl Cluster {
    /// Connects to PostgreSQL (migrating the schema) and NATS, makes the
    /// streams, and starts consuming the pods' events.
    pub async fn connect(config: ClusterConfig) -> Result<Arc<Self>, ClusterError> {
        let db = Arc::new(Db::open(&config.urls.postgres).await?);
        let nats = super::connect_nats(&config.urls.nats).await?;
        let js = jetstream::new(nats);
        wire::ensure_streams(&js).await?;
        tokio::spawn(super::events::run(js.clone(), db.clone()));
        let sweep = super::expiry::sweep_period(config.create_grace);
        tokio::spawn(super::expiry::run(db.clone(), sweep, config.lost_after));
        let finished = Arc::new(Finished::default());
        tokio::spawn(super::finished::listen(
            config.urls.postgres.clone(),
            finished.clone(),
        ));
        Ok(Arc::new(Cluster {
            rt: tokio::runtime::Handle::current(),
            db,
            js,
            config,
            finished,
        }))
    }

    /// The shared state in PostgreSQL (the tenants' tokens and quotas are
    /// read from it too: `torpor_gate::auth::Auth::shared`).
    pub fn db(&self) -> Arc<Db> {
        self.db.clone()
    }

    pub(super) fn down(pod: &PodRow, why: &str) -> ServiceError {
        ServiceError::Pod {
            status: 503,
            code: code::UNAVAILABLE.into(),
            message: format!(
                "pod {} is down (no heartbeat for {:.0} s): {why}",
                pod.id, pod.silent_s
            ),
        }
    }

    /// The pod a request names (an admin's choice): 404 if unknown, 503
    /// saying `why` if down.
    pub(super) fn named_pod<'p>(
        &self,
        pods: &'p [PodRow],
        want: &PodId,
        why: &str,
    ) -> Result<&'p PodRow, ServiceError> {
        let pod = pods
            .iter()
            .find(|p| &p.id == want)
            .ok_or_else(|| ServiceError::NotFound {
                kind: "pod",
                id: want.to_string(),
            })?;
        if !self.is_up(pod) {
            return Err(Self::down(pod, why));
        }
        Ok(pod)
    }

    pub(super) fn is_up(&self, pod: &PodRow) -> bool {
        pod.silent_s < self.config.down_after.as_secs_f64()
    }

    /// A sandbox, its pod, and whether that pod is up.
    pub(super) async fn owned(&self, id: &SandboxId) -> Result<(Sandbox, PodRow), ServiceError> {
        let (sandbox, pod, row) =
            self.db
                .sandbox_and_pod(id)
                .await?
                .ok_or_else(|| ServiceError::NotFound {
                    kind: "sandbox",
                    id: id.to_string(),
                })?;
        let row = row.ok_or_else(|| {
            ServiceError::Internal(format!("sandbox {id} names unknown pod {pod}"))
        })?;
        Ok((sandbox, row))
    }

    pub(super) async fn owned_up(&self, id: &SandboxId) -> Result<(Sandbox, PodRow), ServiceError> {
        let (sandbox, pod) = self.owned(id).await?;
        if !self.is_up(&pod) {
            return Err(Self::down(
                &pod,
                &format!("sandbox {id} is unavailable until it is back"),
            ));
        }
        Ok((sandbox, pod))
    }

    fn sandbox_of(outcome: OpOutcome) -> Result<(Sandbox, bool), ServiceError> {
        Self::sandbox_in(outcome.reply()?)
    }

    /// A create's or a lifecycle call's sandbox.
    fn sandbox_in(reply: Reply) -> Result<(Sandbox, bool), ServiceError> {
        match reply {
            Reply::Sandbox { sandbox, resumed } => Ok((*sandbox, resumed)),
            Reply::Deleted { sandbox } => Err(ServiceError::NotFound {
                kind: "sandbox",
                id: sandbox.to_string(),
            }),
            other => Err(ServiceError::Internal(format!(
                "a sandbox's command answered {other:?}"
            ))),
        }
    }

    /// The sandboxes a fork of `id` made.
    fn forks_of(outcome: OpOutcome, id: &SandboxId) -> Result<Vec<Sandbox>, ServiceError> {
        match outcome.reply()? {
            Reply::Sandboxes { sandboxes } => Ok(sandboxes),
            other => Err(ServiceError::Internal(format!(
                "a fork of {id} answered {other:?}"
            ))),
        }
    }

    /// An operation on an existing sandbox (a lifecycle call, a delete, a
    /// checkpoint's take or delete: any but a fork, whose forks' secrets
    /// and count are its own) as a command to the sandbox's pod, admitted
    /// against its tenant's quota for what it [`asks`] of the sandbox.
    pub(super) async fn command(&self, command: Operation) -> Result<Reply, ServiceError> {
        let id = command
            .sandbox()
            .cloned()
            .ok_or_else(|| ServiceError::Internal(format!("a {} of no sandbox", command.kind())))?;
        let asks = asks(&command);
        let wakes = matches!(&command, Operation::Lifecycle(call) if call.op.wakes());
        let owned = self.owned_up(&id).await;
        // Its pod lost for good with the sandbox's state: a delete is
        // done here (`moved.rs`).
        if owned.is_err() && matches!(command, Operation::Delete { .. }) {
            if let Some(reply) = self.delete_lost(&id).await? {
                return Ok(reply);
            }
        }
        let (sandbox, pod) = match owned {
            Ok(owned) => owned,
            // Its pod down: moved to one up if its snapshot is in the
            // object store (`moved.rs`).
            Err(e) => match self.moved(&id, e).await {
                Ok(owned) => owned,
                Err(e) => return self.retried(e, command.kind(), &id).await?.reply(),
            },
        };
        // A wake its pod has no room for goes where there is (`moved.rs`).
        let (sandbox, pod) = if wakes {
            self.roomier(sandbox, pod).await?
        } else {
            (sandbox, pod)
        };
        let tenant = sandbox.tenant.clone().unwrap_or_default();
        let asked = asks(&sandbox);
        let reply = self
            .run(&pod.id, &tenant, command.clone(), asked.as_ref())
            .await?
            .reply();
        match reply {
            // A wake its pod refused for room goes where there is
            // (`moved.rs`), once.
            Err(refusal) if wakes && Self::refused_for_room(&refusal) => {
                self.woken_elsewhere(&id, &pod.id, command, asked, refusal)
                    .await
            }
            reply => reply,
        }
    }

    /// A command on sandbox `id` that failed with `e` before it was sent
    /// (the sandbox is gone, or its pod down or lost): if it is a retry
    /// (by its `Idempotency-Key`) of one sent before, that one's outcome
    /// once it has one (a retried delete's, a fork's whose source was
    /// deleted since, or the failure the sweep gave an operation of a pod
    /// lost since: `expiry.rs`), waited for only when the sandbox is gone;
    /// else `e`.
    async fn retried(
        &self,
        e: ServiceError,
        kind: &str,
        id: &SandboxId,
    ) -> Result<OpOutcome, ServiceError> {
        let Some(key) = torpor_gate::request_context::idempotency_key() else {
            return Err(e);
        };
        let gone = matches!(e, ServiceError::NotFound { .. });
        match self.db.operation_by_key(&key, kind, id).await? {
            Some(op) if gone || op.outcome.is_some() => self.wait(op).await,
            _ => Err(e),
        }
    }

    pub(super) fn remote(&self, pod: &PodRow) -> Option<RemotePod> {
        let pin = match pod
            .fingerprint
            .as_deref()
            .map(Fingerprint::parse)
            .transpose()
        {
            Ok(pin) => pin,
            Err(e) => {
                tracing::warn!(pod = %pod.id, error = %e, "a pod's fingerprint");
                return None;
            }
        };
        RemotePod::new(
            pod.id.clone(),
            &pod.address,
            &pod.token,
            pin,
            self.config.io_timeout,
        )
        .map_err(|e| tracing::warn!(pod = %pod.id, error = %e, "a pod's address"))
        .ok()
    }
}

/// What `op` asks of its sandbox's tenant's quota: a wake (a resume or
/// connect of a sandbox hibernated as PostgreSQL has it) its room, counted
/// while it is pending, then as the running sandbox; a checkpoint's take
/// a snapshot of the sandbox's memory (the quota's upper bound), counted
/// while pending, then as the checkpoint's row.
fn asks(op: &Operation) -> impl FnOnce(&Sandbox) -> Option<Usage> {
    let wakes = matches!(op, Operation::Lifecycle(call) if call.op.wakes());
    let takes = matches!(op, Operation::Checkpoint { .. });
    move |s| {
        let mem = u64::from(s.mem_mib);
        if wakes && s.state == SandboxState::Hibernated {
            Some(Usage::wake(mem))
        } else if takes {
            Some(Usage::snapshot(mem))
        } else {
            None
        }
    }
}

/// Commands the replica sends through the work queues rather than relays.
fn is_command(method: &str, path: &str) -> bool {
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    match (method, segments.len()) {
        ("GET" | "DELETE", 4) => true,
        ("POST", 5) => {
            Lifecycle::is_route(segments[4])
                || segments[4] == "fork"
                || segments[4] == "checkpoints"
        }
        ("DELETE", 6) => segments[4] == "checkpoints",
        _ => false,
    }
}

impl SandboxApi for Cluster {
    /// Creates are admitted in PostgreSQL, atomically across replicas
    /// (`admission.rs`).
    fn admits_creates(&self) -> bool {
        true
    }

    /// In PostgreSQL, shared by every replica (`secrets.rs`).
    fn secret_store(&self) -> Option<&dyn torpor_gate::secrets::SecretStore> {
        Some(&*self.db)
    }

    /// Built and deleted on the pods through their work queues, read from
    /// their catalogs in PostgreSQL (`templates.rs`).
    async fn templates(
        &self,
        op: torpor_gate::calls::TemplateOp<'_>,
    ) -> Result<torpor_gate::calls::TemplateReply, ServiceError> {
        self.template_call(op).await
    }

    /// The pods' images, indexed in PostgreSQL (`images.rs`).
    async fn images(
        &self,
        op: torpor_gate::calls::ImageOp<'_>,
    ) -> Result<torpor_gate::calls::ImageReply, ServiceError> {
        self.image_call(op).await
    }

    /// An operation on an existing sandbox is a command to its pod as it
    /// came ([`Cluster::command`]; a checkpoint's take admitted in
    /// PostgreSQL against its tenant's snapshot disk: `checkpoints.rs`);
    /// those that place (a create, a template's build), fork or name a
    /// template go through the one dispatch to the methods below.
    async fn operate(&self, op: Operation) -> Result<Reply, ServiceError> {
        match op {
            Operation::Create { .. }
            | Operation::Fork { .. }
            | Operation::TemplateBuild { .. }
            | Operation::TemplateDelete { .. } => torpor_gate::dispatch(self, op).await,
            Operation::Lifecycle(_)
            | Operation::Delete { .. }
            | Operation::Checkpoint { .. }
            | Operation::CheckpointDelete { .. } => self.command(op).await,
            // Only a replica sends them, to a pod (`moved.rs`).
            Operation::Adopt { .. }
            | Operation::Release { .. }
            | Operation::TemplateAdopt { .. } => Err(ServiceError::Unsupported(format!(
                "{} is sent by a replica to a pod, not asked of one",
                op.kind()
            ))),
        }
    }

    async fn create_sandbox(&self, mut req: CreateSandbox) -> Result<Sandbox, ServiceError> {
        let owner = req
            .owner
            .take()
            .ok_or_else(|| ServiceError::Internal("a create without its owner".into()))?;
        async {
            let pods = self.db.pods().await?;
            // A template no pod up lists, stored in the object store: the
            // pod that fetches it (`moved.rs`).
            let up_lists = pods
                .iter()
                .any(|p| self.is_up(p) && p.templates.contains(&req.template));
            let fetched = match (&req.pod, up_lists) {
                (None, false) => {
                    self.template_elsewhere(&pods, &req.template, &owner.tenant)
                        .await?
                }
                _ => None,
            };
            let pod = match (req.pod.take(), fetched.as_ref()) {
                (Some(want), _) => self.named_pod(&pods, &want, "nothing is placed on it")?,
                (None, Some(p)) => p,
                (None, None) => match place(
                    &pods,
                    &req.template,
                    self.config.down_after,
                    self.config.placement_choices,
                    random_u64(),
                ) {
                    Some(p) => p,
                    None if pods.iter().any(|p| p.templates.contains(&req.template)) => {
                        return Err(ServiceError::Admission {
                            message: format!(
                                "no pod up with template {} has admission headroom",
                                req.template
                            ),
                        })
                    }
                    None => {
                        return Err(ServiceError::NotFound {
                            kind: "template",
                            id: req.template.clone(),
                        })
                    }
                },
            };
            // Its memory is its template's on that pod (0 if the pod has
            // not listed it: the pod answers 404).
            let mem = self.db.template_mem(&pod.id, &req.template).await?;
            let asked = Usage::sandbox(mem.unwrap_or(0));
            // Kept in PostgreSQL once it is made (`guest.rs`): the token
            // never goes to the pod, the environment does.
            let token = req.access_token.take();
            let env = req.env.clone();
            let command = Operation::Create {
                request: Box::new(req),
                tenant: owner.tenant.clone(),
                admin: owner.admin,
            };
            let outcome = self
                .run(&pod.id, &owner.tenant, command, Some(&asked))
                .await?;
            let (mut sandbox, _) = Self::sandbox_of(outcome)?;
            self.keep_secrets(&mut sandbox, token.as_deref(), &env)
                .await?;
            Ok(sandbox)
        }
        .await
    }

    /// With its secrets (`guest.rs`): envd checks its token, and gives
    /// its processes its environment.
    /// A sandbox of a pod lost for good reads as its list shows it
    /// (`moved.rs`): lost if it cannot move, else as its row has it (a
    /// command moves it); of a pod only down, 503.
    async fn get_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        async {
            let sandbox = match self.owned_up(id).await {
                Ok((sandbox, _)) => sandbox,
                Err(e) => {
                    let (sandbox, pod) = self.owned(id).await?;
                    if !self.is_lost(&pod) {
                        return Err(e);
                    }
                    self.lost_view(sandbox, &pod)
                }
            };
            self.with_secrets(sandbox).await
        }
        .await
    }

    async fn fork_sandbox(
        &self,
        id: &SandboxId,
        req: ForkSandbox,
    ) -> Result<Sandbox, ServiceError> {
        let mut forks = self.fork_sandboxes(id, req, 1).await?;
        forks
            .pop()
            .ok_or_else(|| ServiceError::Internal(format!("a fork of {id} made no sandbox")))
    }

    /// One operation on the source's pod (its snapshots are there),
    /// admitted for all `count` forks at once against the source's
    /// tenant's quota, as a create is.
    async fn fork_sandboxes(
        &self,
        id: &SandboxId,
        mut req: ForkSandbox,
        count: u32,
    ) -> Result<Vec<Sandbox>, ServiceError> {
        async {
            let (source, pod) = match self.owned_up(id).await {
                Ok(owned) => owned,
                Err(e) => {
                    // A retry after the source's delete: the first
                    // answer, its forks' secrets as kept then.
                    let forks = Self::forks_of(self.retried(e, "fork", id).await?, id)?;
                    let mut shown = Vec::with_capacity(forks.len());
                    for fork in forks {
                        shown.push(self.with_secrets(fork).await?);
                    }
                    return Ok(shown);
                }
            };
            let tenant = source.tenant.clone().unwrap_or_default();
            // A fork's secrets: the request's token, the source's
            // environment under the request's (as the pod keeps it).
            let token = req.access_token.take();
            let mut env = self.with_secrets(source.clone()).await?.env;
            env.extend(req.env.clone());
            let mut asked = Usage::default();
            for _ in 0..count {
                asked.add(&Usage::sandbox(u64::from(source.mem_mib)));
            }
            req.count = Some(count);
            let command = Operation::Fork {
                sandbox: id.clone(),
                request: Box::new(req),
            };
            let mut sandboxes =
                Self::forks_of(self.run(&pod.id, &tenant, command, Some(&asked)).await?, id)?;
            for fork in &mut sandboxes {
                self.keep_secrets(fork, token.as_deref(), &env).await?;
            }
            Ok(sandboxes)
        }
        .await
    }

    /// On the sandbox's pod (`guest.rs`).
    async fn template_from_sandbox(
        &self,
        id: &SandboxId,
        req: torpor_gate::service::TemplateFromSandbox,
    ) -> Result<torpor_scheduler::model::Template, ServiceError> {
        self.snapshot_on_pod(id, &req).await
    }

    async fn sandbox_templates(
        &self,
        source: Option<&SandboxId>,
    ) -> Result<Vec<(torpor_scheduler::model::Template, SandboxId)>, ServiceError> {
        self.snapshots(source).await
    }

    async fn list_sandboxes(&self, filter: SandboxFilter) -> Result<Vec<Sandbox>, ServiceError> {
        let all = self.db.sandboxes(filter.tenant.as_deref()).await?;
        let pods = self.db.pods().await?;
        // Those of a pod lost for good as they read (`moved.rs`).
        let all =
            all.into_iter().map(
                |s| match pods.iter().find(|p| s.pod.as_ref() == Some(&p.id)) {
                    Some(pod) => self.lost_view(s, pod),
                    None => s,
                },
            );
        Ok(all
            .filter(|s| filter.states.is_empty() || filter.states.contains(&s.state))
            .filter(|s| filter.template.as_ref().is_none_or(|t| &s.template == t))
            .filter(|s| {
                filter
                    .pod
                    .as_ref()
                    .is_none_or(|p| s.pod.as_ref() == Some(p))
            })
            .filter(|s| {
                filter
                    .metadata
                    .iter()
                    .all(|(k, v)| s.metadata.get(k) == Some(v))
            })
            .collect())
    }

    /// A wake (a resume or connect of a sandbox hibernated as PostgreSQL
    /// has it) is admitted there with its operation, as a create is: its
    /// room counts while it is pending, then as the running sandbox. With
    /// the sandbox's secrets (E2B's connect shows its envd token).
    async fn lifecycle(&self, id: &SandboxId, op: Lifecycle) -> Result<Outcome, ServiceError> {
        // Its secrets read while the command runs (a lifecycle call
        // changes neither).
        let (reply, secrets) = tokio::join!(
            self.command(Operation::lifecycle(id.clone(), op)),
            self.db.secrets(id)
        );
        let (mut sandbox, resumed) = Self::sandbox_in(reply?)?;
        (sandbox.access_token, sandbox.env) = secrets?;
        Ok(Outcome {
            sandbox,
            resumed,
            resume_ms: None,
        })
    }
    fn admits_wakes(&self) -> bool {
        true
    }
    async fn delete_sandbox(&self, id: &SandboxId) -> Result<(), ServiceError> {
        self.command(Operation::Delete {
            sandbox: id.clone(),
        })
        .await
        .map(drop)
    }
    /// On the sandbox's pod (`/v1` relays its `PATCH` there; E2B's
    /// timeout routes call this).
    async fn set_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<Sandbox, ServiceError> {
        self.timeout_on_pod(id, keep_alive_ms, timeout_ms).await
    }

    async fn set_pod(
        &self,
        id: &PodId,
        _ratio: Option<f64>,
        _high_watermark: Option<f64>,
    ) -> Result<PodView, ServiceError> {
        let pod = self.db.pod(id.as_str()).await?;
        match pod {
            Some(p) if !self.is_up(&p) => Err(Self::down(&p, "its settings cannot change now")),
            Some(_) => Err(ServiceError::Internal(format!("pod {id} was not relayed"))),
            None => Err(ServiceError::NotFound {
                kind: "pod",
                id: id.to_string(),
            }),
        }
    }

    async fn metrics(&self) -> String {
        let pods = self.db.pods().await.unwrap_or_default();
        let up = pods.iter().filter(|p| self.is_up(p)).count();
        format!(
            "# HELP torpor_cluster_pods Pods known to the cluster, by whether they are up.\n\
             # TYPE torpor_cluster_pods gauge\n\
             torpor_cluster_pods{{state=\"up\"}} {up}\n\
             torpor_cluster_pods{{state=\"down\"}} {}\n\
             # HELP torpor_cluster_outcome_listening Whether this replica hears operations' outcomes as they are written (else its waits poll).\n\
             # TYPE torpor_cluster_outcome_listening gauge\n\
             torpor_cluster_outcome_listening {}\n\
             # HELP torpor_cluster_outcome_wakeups_total Waits of this replica woken by their operation's outcome notification.\n\
             # TYPE torpor_cluster_outcome_wakeups_total counter\n\
             torpor_cluster_outcome_wakeups_total {}\n",
            pods.len() - up,
            u8::from(self.finished.listening()),
            self.finished.woke(),
        )
    }

    async fn pod_entries(&self) -> Result<Vec<Value>, ServiceError> {
        let pods = self.db.pods().await?;
        Ok(pods
            .into_iter()
            .map(|p| {
                let up = self.is_up(&p);
                let mut entry = if p.load.is_object() {
                    p.load.clone()
                } else {
                    json!({})
                };
                entry["id"] = json!(p.id);
                entry["address"] = json!(torpor_gate::pods::pod_address(&p.address).ok());
                entry["reachable"] = json!(up);
                entry["templates"] = json!(p.templates);
                entry["images"] = json!(p.images);
                entry["headroom_mib"] = json!(p.headroom_mib);
                entry["last_heartbeat_s"] = json!(p.silent_s);
                if !up {
                    entry["error"] = json!(format!("down: no heartbeat for {:.0} s", p.silent_s));
                }
                entry
            })
            .collect())
    }

    async fn template_entries(&self) -> Result<Vec<Value>, ServiceError> {
        Ok(self.db.templates(self.config.down_after).await?)
    }

    /// As its pod measures it now (`guest.rs`).
    async fn measured_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        self.measured_on_pod(id).await
    }

    /// As its pod keeps it (`guest.rs`).
    async fn metrics_history(
        &self,
        id: &SandboxId,
        range: torpor_gate::wire::Range,
    ) -> Result<Vec<torpor_scheduler::service::history::MetricSample>, ServiceError> {
        self.history_on_pod(id, range).await
    }

    /// A deleted sandbox's id stays its tenant's (so it may retry, by key,
    /// what it sent before the delete: `retried`); the routes answer 404
    /// for it all the same.
    async fn sandbox_tenant(&self, id: &SandboxId) -> Result<Option<String>, ServiceError> {
        match self.db.sandbox_tenant(id).await? {
            Some(tenant) => Ok(tenant),
            None => match self.db.deleted_tenant(id).await? {
                Some(tenant) => Ok(Some(tenant)),
                None => Err(torpor_gate::gate::sandbox_not_found(id.as_str())),
            },
        }
    }

    async fn operation(&self, id: &str, tenant: Option<&str>) -> Result<Value, ServiceError> {
        let op = self.db.operation(id).await?;
        let op = op
            .filter(|o| tenant.is_none_or(|t| t == o.tenant))
            .ok_or_else(|| ServiceError::NotFound {
                kind: "operation",
                id: id.to_string(),
            })?;
        Ok(json!({
            "id": op.id,
            "kind": op.kind,
            "sandbox": op.sandbox,
            "template": op.template,
            "pod": op.pod,
            "status": op.status,
            "outcome": op.outcome,
        }))
    }

    async fn relay(&self, to: torpor_gate::backend::Relay<'_>) -> Option<RemotePod> {
        let pod = match to {
            torpor_gate::backend::Relay::Sandbox { method, path, .. }
                if is_command(method, path) =>
            {
                return None
            }
            torpor_gate::backend::Relay::Sandbox { id, .. } => self.owned(id).await.ok()?.1,
            torpor_gate::backend::Relay::Pod(id) => {
                let pod = self.db.pod(id.as_str()).await.ok()??;
                if id.as_str() == LOCAL_POD {
                    return None;
                }
                pod
            }
        };
        if !self.is_up(&pod) {
            return None;
        }
        self.remote(&pod)
    }

    // The guest through the owning pod's agent tunnel (`guest.rs`): E2B's
    // envd and /files; `/v1`'s exec and files are relayed to the pod whole
    // (a pod down: 503 either way).
    async fn execute(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        mode: torpor_gate::calls::ExecMode<'_>,
    ) -> Result<GuestCall<torpor_gate::calls::ExecReply>, ServiceError> {
        self.exec_through_tunnel(id, req, cancel, mode).await
    }
    async fn files(
        &self,
        id: &SandboxId,
        op: torpor_gate::calls::FileOp<'_>,
    ) -> Result<GuestCall<torpor_gate::calls::FileReply>, ServiceError> {
        self.guest_call(id, |link| op.run(link)).await
    }
    async fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut (dyn FnMut(&AgentLink) -> Result<(), GuestError> + Send),
    ) -> Result<Outcome, ServiceError> {
        self.tunnel(id, f).await
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::test_pods::pod;

    #[test]
    fn placement_takes_pods_up_with_the_template_and_headroom() {
        let down = Duration::from_secs(4);
        let pods = [
            pod("a", 100.0, 0.5, &["probe"]),
            pod("b", 900.0, 9.0, &["probe"]),
            pod("c", 500.0, 0.1, &["other"]),
            pod("d", 0.0, 0.1, &["probe"]),
            pod("e", 300.0, 0.2, &["probe"]),
        ];
        let picks: std::collections::BTreeSet<String> = (0..8)
            .map(|r| place(&pods, "probe", down, 2, r).unwrap().id.to_string())
            .collect();
        // b is down, c lacks the template, d is full: a and e, both picked.
        assert_eq!(picks, ["a", "e"].map(String::from).into());
        assert_eq!(place(&pods, "probe", down, 1, 7).unwrap().id.as_str(), "e");
        assert!(place(&pods, "linux", down, 2, 0).is_none());
    }

    #[test]
    fn placement_prefers_the_pod_holding_the_templates_chunks() {
        use crate::test_pods::holding;
        const MIB: u64 = 1 << 20;
        let down = Duration::from_secs(4);
        let picks = |pods: &[PodRow]| -> std::collections::BTreeSet<String> {
            (0..8)
                .map(|r| place(pods, "probe", down, 2, r).unwrap().id.to_string())
                .collect()
        };
        // `warm` holds most of the template's layer (in its cache: still
        // arriving), `cold` and `roomy` little or none of it, with far
        // more room. (A pod listing the template but reporting none of its
        // layers is taken to hold it whole: `placement.rs`.)
        let warm = holding(
            pod("warm", 100.0, 0.1, &["probe"]),
            "m1",
            "probe",
            256 * MIB,
            240 * MIB,
        );
        let cold = holding(
            pod("cold", 900.0, 0.1, &["probe"]),
            "m1",
            "probe",
            256 * MIB,
            16 * MIB,
        );
        let roomy = holding(
            pod("roomy", 4000.0, 0.1, &["probe"]),
            "m1",
            "probe",
            256 * MIB,
            0,
        );
        assert_eq!(
            picks(&[warm.clone(), cold.clone(), roomy.clone()]),
            ["warm".to_string()].into()
        );
        // Close ties (within an eighth) fall back to headroom: the best
        // two by headroom, at random.
        let near = holding(
            pod("near", 500.0, 0.1, &["probe"]),
            "m1",
            "probe",
            256 * MIB,
            230 * MIB,
        );
        let warm2 = holding(
            pod("warm2", 50.0, 0.1, &["probe"]),
            "m1",
            "probe",
            256 * MIB,
            256 * MIB,
        );
        assert_eq!(
            picks(&[warm.clone(), near, warm2, cold.clone()]),
            ["near", "warm"].map(String::from).into()
        );
        // A down pod never wins, however much it holds.
        let mut gone = warm.clone();
        gone.silent_s = 9.0;
        assert_eq!(picks(&[gone, cold, roomy]), ["cold".to_string()].into());
    }

    #[test]
    fn commands_are_queued_and_the_data_plane_relayed() {
        assert!(is_command("GET", "/v1/sandboxes/sb_1"));
        assert!(is_command("DELETE", "/v1/sandboxes/sb_1"));
        assert!(is_command("POST", "/v1/sandboxes/sb_1/hibernate"));
        assert!(is_command("POST", "/v1/sandboxes/sb_1/connect"));
        assert!(is_command("POST", "/v1/sandboxes/sb_1/fork"));
        assert!(is_command("POST", "/v1/sandboxes/sb_1/checkpoints"));
        assert!(is_command("DELETE", "/v1/sandboxes/sb_1/checkpoints/one"));
        assert!(!is_command("GET", "/v1/sandboxes/sb_1/checkpoints"));
        assert!(!is_command("POST", "/v1/sandboxes/sb_1/restore"));
        assert!(!is_command("PATCH", "/v1/sandboxes/sb_1"));
        assert!(!is_command("POST", "/v1/sandboxes/sb_1/exec"));
        assert!(!is_command("GET", "/v1/sandboxes/sb_1/files"));
        assert!(!is_command("DELETE", "/v1/sandboxes/sb_1/ports/80"));
    }
}
