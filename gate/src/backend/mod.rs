//! What the API needs from the service: [`SandboxApi`], implemented here for
//! the real [`Service`], by `Nested` (serve with its nested pod), the cluster replica and, in
//! tests, by an in-memory fake. It holds only what differs between them:
//! operations only a pod serves are called on its [`Service`] through
//! [`on_pod`], and the typed calls of its per-resource requests
//! (`crate::calls`) are [`SandboxCalls`]' ([`typed`]), written once for
//! every backend, as the contract's operations' dispatch is ([`dispatch`]).
//!
//! Every method is synchronous and may block (store writes, VMM control
//! requests, snapshots); the handlers call them through
//! `tokio::task::spawn_blocking`.

pub mod dispatch;
pub mod typed;

use serde_json::{json, Value};
use torpor_scheduler::model::{HibernationKind, PodId, Sandbox, SandboxId, Template};
use torpor_scheduler::service::history::MetricSample;
use torpor_scheduler::service::{GuestCheck, Hibernation, LOCAL_POD};

use crate::calls::{
    map_call, ExecMode, ExecReply, FileOp, FileReply, ImageOp, ImageReply, TemplateOp,
    TemplateReply,
};
use crate::pods::RemotePod;
pub use torpor_sandbox_api::Lifecycle;
use torpor_sandbox_api::{Operation, Reply};
use typed::SandboxCalls;

use crate::service::{
    AgentLink, Cancel, CreateSandbox, ExecRequest, ForkSandbox, GuestCall, GuestError, Outcome,
    PodView, SandboxFilter, Service, ServiceError, TemplateFromSandbox,
};

fn no_checkpoints() -> ServiceError {
    Needs::Snapshots.unsupported()
}

/// What an operation served by the pod's own [`Service`] (see
/// [`SandboxApi::service`]) needs: a backend without one answers 501
/// `unsupported`, saying which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// Checkpoints and restore.
    Snapshots,
    /// Network policy and exposed ports.
    Network,
    /// Image uploads and listings.
    Images,
    /// Sandboxes' metrics histories.
    History,
}

impl Needs {
    pub fn unsupported(self) -> ServiceError {
        ServiceError::Unsupported(
            match self {
                Needs::Snapshots => "this backend keeps no checkpoints",
                Needs::Network => "this backend has no sandbox networking",
                Needs::Images => "this backend keeps no images",
                Needs::History => "this backend keeps no metrics history",
            }
            .into(),
        )
    }
}

/// `f` on the pod's own service, or 501 naming what it `needs`: the
/// routes of operations only a pod serves (checkpoints, network, images)
/// call the [`Service`] through this, with no method of their own on
/// [`SandboxApi`].
pub fn on_pod<S: SandboxApi + ?Sized, T>(
    s: &S,
    needs: Needs,
    f: impl FnOnce(&Service) -> Result<T, ServiceError>,
) -> Result<T, ServiceError> {
    f(s.service().ok_or_else(|| needs.unsupported())?)
}

fn no_remote_pods() -> ServiceError {
    ServiceError::Unsupported(
        "this server runs one pod and registers no others (`torpor pod serve`); \
         register pods with the `torpor serve` they should join"
            .into(),
    )
}

/// A request pinned to a pod other than this one.
fn not_here(pod: &Option<PodId>) -> Result<(), ServiceError> {
    match pod {
        Some(p) if p.as_str() != LOCAL_POD => Err(ServiceError::NotFound {
            kind: "pod",
            id: p.to_string(),
        }),
        _ => Ok(()),
    }
}

/// A pod's own entry in `GET /v1/pods`: its view, reachable.
pub fn pod_entry(view: PodView) -> Result<Value, ServiceError> {
    let mut e = serde_json::to_value(crate::wire::PodBody::from(view))
        .map_err(|e| ServiceError::Internal(e.to_string()))?;
    e["reachable"] = Value::Bool(true);
    Ok(e)
}

/// The sandbox service as the API sees it: what each backend does its own
/// way. Requests of one resource are one method taking the request
/// ([`Lifecycle`], [`TemplateOp`], [`ImageOp`], [`FileOp`],
/// [`ExecMode`]); the contract's operations are one [`Operation`]
/// ([`SandboxApi::operate`]).
pub trait SandboxApi: SandboxCalls + Send + Sync + 'static {
    /// A template call; the typed ones are [`SandboxCalls`]'
    /// (`list_templates`, `get_template`, ...).
    fn templates(&self, op: TemplateOp<'_>) -> Result<TemplateReply, ServiceError>;

    /// An operation of the contract ([`Operation`]) as its caller asked
    /// it: [`dispatch`](dispatch::dispatch) onto this backend's methods
    /// (a checkpoint's on the pod's own service), unless the backend takes
    /// some whole (a cluster replica sends a checkpoint to the sandbox's
    /// pod through its work queue, admitted in PostgreSQL). A cluster's pod worker
    /// runs each operation of its queue through this; the typed calls
    /// are [`SandboxCalls`]' (`checkpoint`, `delete_checkpoint`).
    fn operate(&self, op: Operation) -> Result<Reply, ServiceError> {
        dispatch::dispatch(self, op)
    }

    /// An images call: on the pod's own service (a pod other than this one
    /// named is 404), unless the backend reaches its pods' images itself
    /// (a cluster replica: its index in PostgreSQL, the pods' APIs).
    fn images(&self, op: ImageOp<'_>) -> Result<ImageReply, ServiceError> {
        on_pod(self, Needs::Images, |s| match op {
            ImageOp::List => Ok(ImageReply::List(s.images().list())),
            ImageOp::Install {
                name,
                part,
                body,
                limit,
                pod,
            } => {
                not_here(&pod.cloned())?;
                Ok(ImageReply::Installed(
                    s.images().install(name, part, body, limit)?,
                ))
            }
            ImageOp::Delete(name) => s.remove_image(name).map(|()| ImageReply::Deleted),
        })
    }

    fn create_sandbox(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError>;
    /// Whether [`SandboxApi::create_sandbox`],
    /// [`SandboxApi::fork_sandboxes`], a template's build and
    /// a checkpoint ([`SandboxApi::operate`]) admit what they make against the
    /// tenant's quota themselves (a cluster replica: in PostgreSQL,
    /// atomically across replicas); otherwise the API's
    /// [`crate::quota::Quotas`] do.
    fn admits_creates(&self) -> bool {
        false
    }
    /// Whether [`SandboxApi::lifecycle`] admits a wake (a resume or
    /// connect of a hibernated sandbox) against the tenant's quota itself,
    /// so that a guest route on a hibernated sandbox wakes it that way
    /// first (a cluster replica: in PostgreSQL, with the wake's operation);
    /// otherwise the API's [`crate::quota::Quotas`] do.
    fn admits_wakes(&self) -> bool {
        false
    }
    fn get_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError>;
    fn list_sandboxes(&self, filter: SandboxFilter) -> Result<Vec<Sandbox>, ServiceError>;
    fn lifecycle(&self, id: &SandboxId, op: Lifecycle) -> Result<Outcome, ServiceError>;
    fn delete_sandbox(&self, id: &SandboxId) -> Result<(), ServiceError>;
    fn set_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<Sandbox, ServiceError>;

    fn set_pod(
        &self,
        id: &PodId,
        ratio: Option<f64>,
        high_watermark: Option<f64>,
    ) -> Result<PodView, ServiceError>;

    /// Prometheus text exposition.
    fn metrics(&self) -> String;

    // Pods and templates as listed (`GET /v1/pods`, `GET /v1/templates`):
    // JSON objects, so that `Nested` can add its nested pods' entries
    // (`reachable`, `error`) and each template's `pod`.

    /// The pods (a pod's own: its [`pod_entry`]).
    fn pod_entries(&self) -> Result<Vec<Value>, ServiceError>;
    fn template_entries(&self) -> Result<Vec<Value>, ServiceError> {
        self.list_templates()?
            .into_iter()
            .map(|t| {
                let mut v =
                    serde_json::to_value(t).map_err(|e| ServiceError::Internal(e.to_string()))?;
                v["pod"] = json!(LOCAL_POD);
                Ok(v)
            })
            .collect()
    }

    /// The sandbox with its resource use (`usage`, `memory`) measured now
    /// by its pod (E2B's metrics). A backend whose reads are not the pod's
    /// (a cluster replica reads PostgreSQL) asks the pod.
    fn measured_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        self.get_sandbox(id)
    }

    /// Sandbox `id`'s resource use over `range`, oldest first: the
    /// samples its pod keeps (`service/history.rs`). A backend whose
    /// sandboxes run on other pods asks the pod
    /// ([`crate::pods::metrics_history`]).
    fn metrics_history(
        &self,
        id: &SandboxId,
        range: crate::wire::Range,
    ) -> Result<Vec<MetricSample>, ServiceError> {
        on_pod(self, Needs::History, |s| {
            Service::metrics_history(s, id, range.from, range.to)
        })
    }

    /// The tenant sandbox `id` belongs to (`None`: made before tenants);
    /// `NotFound` if there is no such sandbox. The API's ownership check.
    fn sandbox_tenant(&self, id: &SandboxId) -> Result<Option<String>, ServiceError> {
        self.get_sandbox(id).map(|s| s.tenant)
    }

    // Remote pods (the nested pod and the cluster). A single pod keeps
    // these defaults: nothing is remote.

    /// The pods this server places on itself (`torpor serve`'s nested
    /// pod); without them, relayed forks are refused (501).
    fn registry(&self) -> Option<&dyn Registry> {
        None
    }
    /// The remote pod a request is relayed to as it came (routing layer):
    /// the pod that owns the sandbox, the pod named; `None` serves it here.
    fn relay(&self, _to: Relay<'_>) -> Option<RemotePod> {
        None
    }
    /// A command's journal entry (`GET /v1/operations/{id}`), of `tenant`
    /// only if given: a cluster journals its commands; others have none.
    fn operation(&self, id: &str, _tenant: Option<&str>) -> Result<Value, ServiceError> {
        // Without a cluster no operation is journaled under this route.
        Err(ServiceError::NotFound {
            kind: "operation (operations are journaled by a cluster, torpor serve --cluster, only)",
            id: id.chars().take(64).collect(),
        })
    }

    /// The pod's own in-process service (`Service` itself; `Nested`'s
    /// local pod), if there is one. Operations on this pod's sandboxes and
    /// images that no other backend implements (checkpoints, network policy,
    /// ports, images) are called on it directly through [`on_pod`]; without
    /// one (a cluster replica, the API tests' fake) they answer 501. A
    /// `Nested` relays a nested sandbox's routes at the HTTP layer.
    fn service(&self) -> Option<&Service> {
        None
    }

    // Fork and snapshot-as-template need snapshots: a backend without them
    // (the API tests' in-memory fake) keeps these defaults, which answer
    // 501 `unsupported`.

    fn fork_sandbox(&self, _id: &SandboxId, _req: ForkSandbox) -> Result<Sandbox, ServiceError> {
        Err(no_checkpoints())
    }
    /// `count` forks of `id` (`req.count` is ignored), all or none: one
    /// [`SandboxApi::fork_sandbox`] after another, and those made deleted
    /// again if one fails (the cluster sends them to the source's pod as
    /// one operation instead). Quota admission is the caller's.
    fn fork_sandboxes(
        &self,
        id: &SandboxId,
        mut req: ForkSandbox,
        count: u32,
    ) -> Result<Vec<Sandbox>, ServiceError> {
        req.count = None;
        let mut made: Vec<Sandbox> = Vec::new();
        for _ in 0..count {
            match self.fork_sandbox(id, req.clone()) {
                Ok(fork) => made.push(fork),
                Err(e) => {
                    for fork in &made {
                        if let Err(undo) = self.delete_sandbox(&fork.id) {
                            tracing::warn!(fork = %fork.id, error = %undo, "a fork left after its request failed");
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(made)
    }
    /// Snapshot-as-template (`POST /v1/sandboxes/{id}/template`).
    fn template_from_sandbox(
        &self,
        _id: &SandboxId,
        _req: TemplateFromSandbox,
    ) -> Result<Template, ServiceError> {
        Err(no_checkpoints())
    }
    /// Templates made from sandboxes (from `source` only, if given), each
    /// with its source.
    fn sandbox_templates(
        &self,
        _source: Option<&SandboxId>,
    ) -> Result<Vec<(Template, SandboxId)>, ServiceError> {
        Ok(Vec::new())
    }
    // Guest access (exec and files), each waking a hibernated sandbox first.
    /// Runs a command (`cancel` ends it early: the command is killed in
    /// the guest), its output collected or streamed as `mode` says; the
    /// typed calls are [`SandboxCalls`]' `exec` and `exec_streaming`.
    fn execute(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        mode: ExecMode<'_>,
    ) -> Result<GuestCall<ExecReply>, ServiceError>;
    /// A file call on the sandbox's agent; the typed ones are
    /// [`SandboxCalls`]' (`read_file`, `write_file`, `list_dir`).
    fn files(&self, id: &SandboxId, op: FileOp<'_>) -> Result<GuestCall<FileReply>, ServiceError>;
    /// Wakes the sandbox if needed and hands `f` its agent (E2B's envd
    /// RPCs, which make their own connections to it).
    fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut dyn FnMut(&AgentLink) -> Result<(), GuestError>,
    ) -> Result<Outcome, ServiceError>;
}

/// A request the routing layer may relay to a remote pod:
/// [`SandboxApi::relay`].
#[derive(Debug, Clone, Copy)]
pub enum Relay<'a> {
    /// `method path`, a route of sandbox `id` (`Nested` relays every
    /// one of a remote sandbox; the cluster only its data plane, its
    /// commands go through the pods' work queues).
    Sandbox {
        id: &'a SandboxId,
        method: &'a str,
        path: &'a str,
    },
    /// `PATCH /v1/pods/{id}`.
    Pod(&'a PodId),
}

/// Pods this server places sandboxes on itself (`torpor serve`'s nested
/// pod), behind [`SandboxApi::registry`].
pub trait Registry: Send + Sync {
    /// Forwards a fork of a sandbox on `pod` (`path` on the pod, JSON
    /// `body`), recording the new sandbox as the pod's before answering.
    fn forward_fork(&self, pod: &RemotePod, path: &str, body: Value)
        -> Result<Value, ServiceError>;
}

/// The registry of `s`, or 501: this server places on no other pod.
pub fn registry<S: SandboxApi + ?Sized>(s: &S) -> Result<&dyn Registry, ServiceError> {
    s.registry().ok_or_else(no_remote_pods)
}

impl SandboxApi for Service {
    fn templates(&self, op: TemplateOp<'_>) -> Result<TemplateReply, ServiceError> {
        Ok(match op {
            TemplateOp::List => TemplateReply::List(Service::list_templates(self)?),
            TemplateOp::Get { key, owner } => {
                TemplateReply::one(Service::resolve_template(self, owner, key)?)
            }
            TemplateOp::Create(req) => {
                not_here(&req.pod)?;
                TemplateReply::one(Service::create_template(self, req)?)
            }
            TemplateOp::Delete { key, owner } => {
                Service::delete_template_as(self, owner, key)?;
                TemplateReply::Deleted
            }
            TemplateOp::Rename { key, owner, name } => {
                TemplateReply::one(Service::rename_template_as(self, owner, key, name)?)
            }
        })
    }
    fn create_sandbox(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError> {
        not_here(&req.pod)?;
        Service::create_sandbox(self, req)
    }
    fn get_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        Service::get_sandbox(self, id)
    }
    fn list_sandboxes(&self, filter: SandboxFilter) -> Result<Vec<Sandbox>, ServiceError> {
        Service::list_sandboxes(self, filter)
    }
    fn lifecycle(&self, id: &SandboxId, op: Lifecycle) -> Result<Outcome, ServiceError> {
        match op {
            Lifecycle::Pause => Service::pause(self, id),
            Lifecycle::Resume => Service::resume(self, id),
            Lifecycle::Connect => Service::connect(self, id),
            Lifecycle::Hibernate => Service::hibernate(self, id),
            Lifecycle::HibernateMarking => Service::hibernate_as(
                self,
                id,
                Hibernation {
                    kind: HibernationKind::Memory,
                    guest: GuestCheck::Mark,
                },
            ),
            Lifecycle::HibernateStrict => Service::hibernate_as(
                self,
                id,
                Hibernation {
                    kind: HibernationKind::Memory,
                    guest: GuestCheck::Require,
                },
            ),
            Lifecycle::HibernateFilesystem => {
                Service::hibernate_as(self, id, Hibernation::FILESYSTEM)
            }
            Lifecycle::Reboot => Service::reboot(self, id),
        }
    }
    fn delete_sandbox(&self, id: &SandboxId) -> Result<(), ServiceError> {
        Service::delete_sandbox(self, id)
    }
    fn set_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<Sandbox, ServiceError> {
        Service::set_timeout(self, id, keep_alive_ms, timeout_ms)
    }
    fn pod_entries(&self) -> Result<Vec<Value>, ServiceError> {
        Service::list_pods(self)?
            .into_iter()
            .map(pod_entry)
            .collect()
    }
    fn set_pod(
        &self,
        id: &PodId,
        ratio: Option<f64>,
        high_watermark: Option<f64>,
    ) -> Result<PodView, ServiceError> {
        Service::set_pod(self, id, ratio, high_watermark)
    }
    fn metrics(&self) -> String {
        Service::metrics(self)
    }
    fn fork_sandbox(&self, id: &SandboxId, req: ForkSandbox) -> Result<Sandbox, ServiceError> {
        Service::fork_sandbox(self, id, req)
    }
    fn template_from_sandbox(
        &self,
        id: &SandboxId,
        req: TemplateFromSandbox,
    ) -> Result<Template, ServiceError> {
        Service::template_from_sandbox(self, id, req)
    }
    fn sandbox_templates(
        &self,
        source: Option<&SandboxId>,
    ) -> Result<Vec<(Template, SandboxId)>, ServiceError> {
        Service::sandbox_templates(self, source)
    }
    fn execute(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        mode: ExecMode<'_>,
    ) -> Result<GuestCall<ExecReply>, ServiceError> {
        Ok(match mode {
            ExecMode::Collect => {
                map_call(Service::exec(self, id, req, cancel)?, ExecReply::Collected)
            }
            ExecMode::Stream {
                on_start,
                on_output,
            } => map_call(
                Service::exec_streaming(self, id, req, cancel, on_start, on_output)?,
                ExecReply::Streamed,
            ),
        })
    }
    fn files(&self, id: &SandboxId, op: FileOp<'_>) -> Result<GuestCall<FileReply>, ServiceError> {
        Ok(match op {
            FileOp::Read { path } => map_call(Service::read_file(self, id, path)?, FileReply::Read),
            FileOp::Write {
                path,
                data,
                mode,
                owner,
            } => map_call(
                Service::write_file_as(self, id, path, data, mode, owner)?,
                FileReply::Written,
            ),
            FileOp::List { path } => map_call(Service::list_dir(self, id, path)?, FileReply::List),
        })
    }
    fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut dyn FnMut(&AgentLink) -> Result<(), GuestError>,
    ) -> Result<Outcome, ServiceError> {
        Service::with_guest(self, id, f)
    }
    fn service(&self) -> Option<&Service> {
        Some(self)
    }
}
