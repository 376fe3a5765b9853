//! What the API needs from the service: [`SandboxApi`], implemented here for
//! the real [`Service`], by `Nested` (serve with its nested pod), the cluster replica and, in
//! tests, by an in-memory fake. It holds only what differs between them:
//! operations only a pod serves are called on its [`Service`] through
//! [`on_pod`], and the typed calls of its per-resource requests
//! (`crate::calls`) are [`SandboxCalls`]' ([`typed`]), written once for
//! every backend, as the contract's operations' dispatch is ([`dispatch`]).
//!
//! Every call is async: a backend whose work is async (a cluster replica's
//! PostgreSQL, NATS and its pods' APIs) runs it on the caller's task; the
//! pod's own [`Service`] blocks (store writes, VMM control requests,
//! snapshots): each call runs [`detached`] on tokio's blocking pool, and
//! those that hand it callbacks in place ([`blocking`]). A thread that is
//! no runtime worker waits for a call with [`wait`]. The handlers run each
//! call as a task of its own (`crate::handlers::call`), so a request that
//! times out or goes away cuts no operation in the middle.

pub mod dispatch;
mod secrets;
pub mod typed;

use std::future::Future;

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
    AgentLink, Cancel, CreateSandbox, CreateTemplate, ExecRequest, ForkSandbox, GuestCall,
    GuestError, Outcome, Owner, PodView, SandboxFilter, Service, ServiceError, TemplateFromSandbox,
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

/// `f` on the pod's own service ([`detached`]), or 501 naming what it
/// `needs`: the routes of operations only a pod serves (checkpoints,
/// network, ports) call the [`Service`] through this, with no method of
/// their own on [`SandboxApi`].
pub async fn on_pod<S, T, F>(s: &S, needs: Needs, f: F) -> Result<T, ServiceError>
where
    S: SandboxApi + ?Sized,
    T: Send + 'static,
    F: FnOnce(&Service) -> Result<T, ServiceError> + Send + 'static,
{
    detached(s.service().ok_or_else(|| needs.unsupported())?, f).await
}

/// [`on_pod`] for a call that borrows what it is given (an image's body
/// being read): run in place ([`blocking`]).
pub fn in_pod<S: SandboxApi + ?Sized, T>(
    s: &S,
    needs: Needs,
    f: impl FnOnce(&Service) -> Result<T, ServiceError>,
) -> Result<T, ServiceError> {
    let service = s.service().ok_or_else(|| needs.unsupported())?;
    blocking(|| f(service))
}

tokio::task_local! {
    /// Set on a request's own call task ([`own_task`]): a call already
    /// detached from its request.
    static OWN_TASK: ();
}

/// `f` as a request's own call task (`crate::handlers::call` spawns it):
/// [`detached`] runs the service in place there, the task being detached
/// from the request already.
pub fn own_task<F: Future>(f: F) -> impl Future<Output = F::Output> {
    OWN_TASK.scope((), f)
}

/// Runs `f` on the pod's service detached from the request that asked: a
/// request that times out (504) or goes away leaves it running to its
/// end, and its answer is dropped. On a request's own call task
/// ([`own_task`], already detached) it runs in place on that task's
/// thread ([`blocking`]: no hand-off to the blocking pool's thread and
/// back, each a wake-up on a busy host); elsewhere (a middleware, a pod
/// worker) on tokio's blocking pool. Outside a runtime `f` just runs. A
/// panic in `f` is a 500, the pod lives on.
pub async fn detached<T, F>(service: &Service, f: F) -> Result<T, ServiceError>
where
    T: Send + 'static,
    F: FnOnce(&Service) -> Result<T, ServiceError> + Send + 'static,
{
    let Some(shared) = service.shared() else {
        return Err(ServiceError::Internal("the service is stopping".into()));
    };
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return f(&shared);
    };
    let in_place = OWN_TASK.try_with(|()| ()).is_ok()
        && runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread;
    if in_place {
        let run = std::panic::AssertUnwindSafe(move || f(&shared));
        return match blocking(|| std::panic::catch_unwind(run)) {
            Ok(result) => result,
            Err(_) => {
                tracing::error!("service call panicked");
                Err(service_panicked())
            }
        };
    }
    match tokio::task::spawn_blocking(move || f(&shared)).await {
        Ok(result) => result,
        Err(join) => {
            tracing::error!(error = %join, "service call panicked");
            Err(service_panicked())
        }
    }
}

fn service_panicked() -> ServiceError {
    ServiceError::Internal("the service failed while handling the request".into())
}

/// Waits for `f`, a backend call, from a thread that may block and is no
/// runtime's worker (a template build's thread, an envd stream's or a
/// guest port's blocking thread), polling it on this thread. The thread
/// stays outside the runtime (unlike `Handle::block_on`), so what `f`
/// calls back may block in turn (a stream's `blocking_send`); its I/O and
/// timers are the runtime's the thread has entered, driven by that
/// runtime's workers. Never from async code (use `.await`).
pub fn wait<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        // A wake before the park leaves its token: no wake is lost.
        std::thread::park();
    }
}

/// Runs `f`, which blocks (the pod's [`Service`]: its store, VMM control
/// sockets, snapshot files), from async code: on a worker of a
/// multi-thread runtime the worker becomes a blocking thread for it
/// (`tokio::task::block_in_place`: its other tasks move to another
/// worker); elsewhere (a plain or blocking thread, a current-thread
/// runtime's tests) `f` just runs.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
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
    fn templates(
        &self,
        op: TemplateOp<'_>,
    ) -> impl Future<Output = Result<TemplateReply, ServiceError>> + Send;

    /// An operation of the contract ([`Operation`]) as its caller asked
    /// it: [`dispatch`](dispatch::dispatch) onto this backend's methods
    /// (a checkpoint's on the pod's own service), unless the backend takes
    /// some whole (a cluster replica sends a checkpoint to the sandbox's
    /// pod through its work queue, admitted in PostgreSQL). A cluster's pod worker
    /// runs each operation of its queue through this; the typed calls
    /// are [`SandboxCalls`]' (`checkpoint`, `delete_checkpoint`).
    fn operate(&self, op: Operation) -> impl Future<Output = Result<Reply, ServiceError>> + Send {
        dispatch::dispatch(self, op)
    }

    /// An images call: on the pod's own service (a pod other than this one
    /// named is 404), unless the backend reaches its pods' images itself
    /// (a cluster replica: its index in PostgreSQL, the pods' APIs).
    fn images(
        &self,
        op: ImageOp<'_>,
    ) -> impl Future<Output = Result<ImageReply, ServiceError>> + Send {
        async move {
            in_pod(self, Needs::Images, |s| match op {
                ImageOp::List => Ok(ImageReply::List(s.image_names())),
                ImageOp::Install {
                    name,
                    part,
                    body,
                    limit,
                    pod,
                } => {
                    not_here(&pod.cloned())?;
                    Ok(ImageReply::Installed(
                        s.install_image(name, part, body, limit)?,
                    ))
                }
                ImageOp::Delete(name) => s.remove_image(name).map(|()| ImageReply::Deleted),
            })
        }
    }

    fn create_sandbox(
        &self,
        req: CreateSandbox,
    ) -> impl Future<Output = Result<Sandbox, ServiceError>> + Send;
    /// Whether [`SandboxApi::create_sandbox`],
    /// [`SandboxApi::fork_sandboxes`], a template's build and
    /// a checkpoint ([`SandboxApi::operate`]) admit what they make against the
    /// tenant's quota themselves (a cluster replica: in PostgreSQL,
    /// atomically across replicas); otherwise the API's
    /// [`crate::quota::Quotas`] do.
    fn admits_creates(&self) -> bool {
        false
    }
    /// Whether its sandboxes can mount their tenant's volumes
    /// ([`CreateSandbox::volumes`]); a create naming volumes is refused
    /// otherwise.
    fn mounts_volumes(&self) -> bool {
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
    fn get_sandbox(
        &self,
        id: &SandboxId,
    ) -> impl Future<Output = Result<Sandbox, ServiceError>> + Send;
    fn list_sandboxes(
        &self,
        filter: SandboxFilter,
    ) -> impl Future<Output = Result<Vec<Sandbox>, ServiceError>> + Send;
    fn lifecycle(
        &self,
        id: &SandboxId,
        op: Lifecycle,
    ) -> impl Future<Output = Result<Outcome, ServiceError>> + Send;
    fn delete_sandbox(
        &self,
        id: &SandboxId,
    ) -> impl Future<Output = Result<(), ServiceError>> + Send;
    fn set_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> impl Future<Output = Result<Sandbox, ServiceError>> + Send;

    fn set_pod(
        &self,
        id: &PodId,
        ratio: Option<f64>,
        high_watermark: Option<f64>,
    ) -> impl Future<Output = Result<PodView, ServiceError>> + Send;

    /// Prometheus text exposition.
    fn metrics(&self) -> impl Future<Output = String> + Send;

    // Pods and templates as listed (`GET /v1/pods`, `GET /v1/templates`):
    // JSON objects, so that `Nested` can add its nested pods' entries
    // (`reachable`, `error`) and each template's `pod`.

    /// The pods (a pod's own: its [`pod_entry`]).
    fn pod_entries(&self) -> impl Future<Output = Result<Vec<Value>, ServiceError>> + Send;
    fn template_entries(&self) -> impl Future<Output = Result<Vec<Value>, ServiceError>> + Send {
        async move {
            self.list_templates()
                .await?
                .into_iter()
                .map(|t| {
                    let mut v = serde_json::to_value(t)
                        .map_err(|e| ServiceError::Internal(e.to_string()))?;
                    v["pod"] = json!(LOCAL_POD);
                    Ok(v)
                })
                .collect()
        }
    }

    /// The sandbox with its resource use (`usage`, `memory`) measured now
    /// by its pod (E2B's metrics). A backend whose reads are not the pod's
    /// (a cluster replica reads PostgreSQL) asks the pod.
    fn measured_sandbox(
        &self,
        id: &SandboxId,
    ) -> impl Future<Output = Result<Sandbox, ServiceError>> + Send {
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
    ) -> impl Future<Output = Result<Vec<MetricSample>, ServiceError>> + Send {
        let id = id.clone();
        async move {
            on_pod(self, Needs::History, move |s| {
                Service::metrics_history(s, &id, range.from, range.to)
            })
            .await
        }
    }

    /// The tenant sandbox `id` belongs to (`None`: made before tenants);
    /// `NotFound` if there is no such sandbox. The API's ownership check.
    fn sandbox_tenant(
        &self,
        id: &SandboxId,
    ) -> impl Future<Output = Result<Option<String>, ServiceError>> + Send {
        async move { self.get_sandbox(id).await.map(|s| s.tenant) }
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
    fn relay(&self, _to: Relay<'_>) -> impl Future<Output = Option<RemotePod>> + Send {
        async { None }
    }
    /// A command's journal entry (`GET /v1/operations/{id}`), of `tenant`
    /// only if given: a cluster journals its commands; others have none.
    fn operation(
        &self,
        id: &str,
        _tenant: Option<&str>,
    ) -> impl Future<Output = Result<Value, ServiceError>> + Send {
        // Without a cluster no operation is journaled under this route.
        let e = ServiceError::NotFound {
            kind: "operation (operations are journaled by a cluster, torpor serve --cluster, only)",
            id: id.chars().take(64).collect(),
        };
        async { Err(e) }
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

    /// Where the tenants' secrets are kept (E2B's `/secrets`): the pod's
    /// own store, unless the backend keeps them elsewhere (a cluster
    /// replica: PostgreSQL); none, 501.
    fn secret_store(&self) -> Option<&dyn crate::secrets::SecretStore> {
        self.service()
            .map(|s| s as &dyn crate::secrets::SecretStore)
    }

    // Fork and snapshot-as-template need snapshots: a backend without them
    // (the API tests' in-memory fake) keeps these defaults, which answer
    // 501 `unsupported`.

    fn fork_sandbox(
        &self,
        _id: &SandboxId,
        _req: ForkSandbox,
    ) -> impl Future<Output = Result<Sandbox, ServiceError>> + Send {
        async { Err(no_checkpoints()) }
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
    ) -> impl Future<Output = Result<Vec<Sandbox>, ServiceError>> + Send {
        async move {
            req.count = None;
            let mut made: Vec<Sandbox> = Vec::new();
            for _ in 0..count {
                match self.fork_sandbox(id, req.clone()).await {
                    Ok(fork) => made.push(fork),
                    Err(e) => {
                        for fork in &made {
                            if let Err(undo) = self.delete_sandbox(&fork.id).await {
                                tracing::warn!(fork = %fork.id, error = %undo, "a fork left after its request failed");
                            }
                        }
                        return Err(e);
                    }
                }
            }
            Ok(made)
        }
    }
    /// Snapshot-as-template (`POST /v1/sandboxes/{id}/template`).
    fn template_from_sandbox(
        &self,
        _id: &SandboxId,
        _req: TemplateFromSandbox,
    ) -> impl Future<Output = Result<Template, ServiceError>> + Send {
        async { Err(no_checkpoints()) }
    }
    /// Templates made from sandboxes (from `source` only, if given), each
    /// with its source.
    fn sandbox_templates(
        &self,
        _source: Option<&SandboxId>,
    ) -> impl Future<Output = Result<Vec<(Template, SandboxId)>, ServiceError>> + Send {
        async { Ok(Vec::new()) }
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
    ) -> impl Future<Output = Result<GuestCall<ExecReply>, ServiceError>> + Send;
    /// A file call on the sandbox's agent; the typed ones are
    /// [`SandboxCalls`]' (`read_file`, `write_file`, `list_dir`).
    fn files(
        &self,
        id: &SandboxId,
        op: FileOp<'_>,
    ) -> impl Future<Output = Result<GuestCall<FileReply>, ServiceError>> + Send;
    /// Wakes the sandbox if needed and hands `f` its agent (E2B's envd
    /// RPCs, which make their own connections to it).
    fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut (dyn FnMut(&AgentLink) -> Result<(), GuestError> + Send),
    ) -> impl Future<Output = Result<Outcome, ServiceError>> + Send;
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

/// The pod's own service: each call [`detached`] on the blocking pool
/// with what it needs owned; the calls that hand it callbacks (a streamed
/// exec, [`SandboxApi::with_guest`]), made from threads that may block,
/// run in place ([`blocking`]).
impl SandboxApi for Service {
    fn mounts_volumes(&self) -> bool {
        Service::mounts_volumes(self)
    }
    async fn templates(&self, op: TemplateOp<'_>) -> Result<TemplateReply, ServiceError> {
        enum Owned {
            List,
            Get(String, Option<Owner>),
            Create(Box<CreateTemplate>),
            Delete(String, Option<Owner>),
            Rename(String, Option<Owner>, String),
        }
        let op = match op {
            TemplateOp::List => Owned::List,
            TemplateOp::Get { key, owner } => Owned::Get(key.into(), owner.cloned()),
            TemplateOp::Create(req) => Owned::Create(Box::new(req)),
            TemplateOp::Delete { key, owner } => Owned::Delete(key.into(), owner.cloned()),
            TemplateOp::Rename { key, owner, name } => {
                Owned::Rename(key.into(), owner.cloned(), name.into())
            }
        };
        detached(self, move |s| {
            Ok(match op {
                Owned::List => TemplateReply::List(Service::list_templates(s)?),
                Owned::Get(key, owner) => {
                    TemplateReply::one(Service::resolve_template(s, owner.as_ref(), &key)?)
                }
                Owned::Create(req) => {
                    not_here(&req.pod)?;
                    TemplateReply::one(Service::create_template(s, *req)?)
                }
                Owned::Delete(key, owner) => {
                    Service::delete_template_as(s, owner.as_ref(), &key)?;
                    TemplateReply::Deleted
                }
                Owned::Rename(key, owner, name) => {
                    TemplateReply::one(Service::rename_template_as(s, owner.as_ref(), &key, &name)?)
                }
            })
        })
        .await
    }
    async fn create_sandbox(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError> {
        detached(self, move |s| {
            not_here(&req.pod)?;
            Service::create_sandbox(s, req)
        })
        .await
    }
    async fn get_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        let id = id.clone();
        detached(self, move |s| Service::get_sandbox(s, &id)).await
    }
    async fn list_sandboxes(&self, filter: SandboxFilter) -> Result<Vec<Sandbox>, ServiceError> {
        detached(self, move |s| Service::list_sandboxes(s, filter)).await
    }
    async fn lifecycle(&self, id: &SandboxId, op: Lifecycle) -> Result<Outcome, ServiceError> {
        let id = id.clone();
        detached(self, move |s| {
            let id = &id;
            match op {
                Lifecycle::Pause => Service::pause(s, id),
                Lifecycle::Resume => Service::resume(s, id),
                Lifecycle::Connect => Service::connect(s, id),
                Lifecycle::Hibernate => Service::hibernate(s, id),
                Lifecycle::HibernateMarking => Service::hibernate_as(
                    s,
                    id,
                    Hibernation {
                        kind: HibernationKind::Memory,
                        guest: GuestCheck::Mark,
                    },
                ),
                Lifecycle::HibernateStrict => Service::hibernate_as(
                    s,
                    id,
                    Hibernation {
                        kind: HibernationKind::Memory,
                        guest: GuestCheck::Require,
                    },
                ),
                Lifecycle::HibernateFilesystem => {
                    Service::hibernate_as(s, id, Hibernation::FILESYSTEM)
                }
                Lifecycle::Reboot => Service::reboot(s, id),
            }
        })
        .await
    }
    async fn delete_sandbox(&self, id: &SandboxId) -> Result<(), ServiceError> {
        let id = id.clone();
        detached(self, move |s| Service::delete_sandbox(s, &id)).await
    }
    async fn set_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<Sandbox, ServiceError> {
        let id = id.clone();
        detached(self, move |s| {
            Service::set_timeout(s, &id, keep_alive_ms, timeout_ms)
        })
        .await
    }
    async fn pod_entries(&self) -> Result<Vec<Value>, ServiceError> {
        detached(self, |s| {
            Service::list_pods(s)?.into_iter().map(pod_entry).collect()
        })
        .await
    }
    async fn set_pod(
        &self,
        id: &PodId,
        ratio: Option<f64>,
        high_watermark: Option<f64>,
    ) -> Result<PodView, ServiceError> {
        let id = id.clone();
        detached(self, move |s| {
            Service::set_pod(s, &id, ratio, high_watermark)
        })
        .await
    }
    async fn metrics(&self) -> String {
        detached(self, |s| Ok(Service::metrics(s)))
            .await
            .unwrap_or_default()
    }
    async fn fork_sandbox(
        &self,
        id: &SandboxId,
        req: ForkSandbox,
    ) -> Result<Sandbox, ServiceError> {
        let id = id.clone();
        detached(self, move |s| Service::fork_sandbox(s, &id, req)).await
    }
    async fn template_from_sandbox(
        &self,
        id: &SandboxId,
        req: TemplateFromSandbox,
    ) -> Result<Template, ServiceError> {
        let id = id.clone();
        detached(self, move |s| Service::template_from_sandbox(s, &id, req)).await
    }
    async fn sandbox_templates(
        &self,
        source: Option<&SandboxId>,
    ) -> Result<Vec<(Template, SandboxId)>, ServiceError> {
        let source = source.cloned();
        detached(self, move |s| {
            Service::sandbox_templates(s, source.as_ref())
        })
        .await
    }
    async fn execute(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        mode: ExecMode<'_>,
    ) -> Result<GuestCall<ExecReply>, ServiceError> {
        match mode {
            ExecMode::Collect => {
                let (id, cancel) = (id.clone(), cancel.clone());
                detached(self, move |s| {
                    Ok(map_call(
                        Service::exec(s, &id, req, &cancel)?,
                        ExecReply::Collected,
                    ))
                })
                .await
            }
            ExecMode::Stream {
                on_start,
                on_output,
            } => blocking(|| {
                Ok(map_call(
                    Service::exec_streaming(self, id, req, cancel, on_start, on_output)?,
                    ExecReply::Streamed,
                ))
            }),
        }
    }
    async fn files(
        &self,
        id: &SandboxId,
        op: FileOp<'_>,
    ) -> Result<GuestCall<FileReply>, ServiceError> {
        let id = id.clone();
        match op {
            FileOp::Read { path } => {
                let path = path.to_string();
                detached(self, move |s| {
                    Ok(map_call(
                        Service::read_file(s, &id, &path)?,
                        FileReply::Read,
                    ))
                })
                .await
            }
            FileOp::Write {
                path,
                data,
                mode,
                owner,
            } => {
                let (path, data) = (path.to_string(), data.to_vec());
                let owner = owner.map(str::to_string);
                detached(self, move |s| {
                    Ok(map_call(
                        Service::write_file_as(s, &id, &path, &data, mode, owner.as_deref())?,
                        FileReply::Written,
                    ))
                })
                .await
            }
            FileOp::List { path } => {
                let path = path.to_string();
                detached(self, move |s| {
                    Ok(map_call(Service::list_dir(s, &id, &path)?, FileReply::List))
                })
                .await
            }
        }
    }
    async fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut (dyn FnMut(&AgentLink) -> Result<(), GuestError> + Send),
    ) -> Result<Outcome, ServiceError> {
        blocking(|| Service::with_guest(self, id, f))
    }
    fn service(&self) -> Option<&Service> {
        Some(self)
    }
}
