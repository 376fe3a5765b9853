//! What the API needs from the service: [`SandboxApi`], implemented here for
//! the real [`Service`] and, in tests, by an in-memory fake.
//!
//! Every method is synchronous and may block (store writes, VMM control
//! requests, snapshots); the handlers call them through
//! `tokio::task::spawn_blocking`.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use torpor_scheduler::model::{
    Checkpoint, ExposedPort, PodId, Sandbox, SandboxId, Template, TemplateId,
};
use torpor_scheduler::net::PolicyPatch;
use torpor_scheduler::service::LOCAL_POD;

use crate::federation::{AddPod, RemotePod};
use torpor_scheduler::images::ImagePart;

use crate::service::{
    AgentLink, Cancel, CreateCheckpoint, CreateSandbox, CreateTemplate, DirListing, ExecOutput,
    ExecRequest, ExitReply, ForkSandbox, GuestCall, GuestError, Outcome, OutputKind, PodView,
    RestoreCheckpoint, SandboxFilter, Service, ServiceError, TemplateFromSandbox,
};

fn no_checkpoints() -> ServiceError {
    ServiceError::Unsupported("this backend keeps no checkpoints".into())
}

fn no_network() -> ServiceError {
    ServiceError::Unsupported("this backend has no sandbox networking".into())
}

fn no_images() -> ServiceError {
    ServiceError::Unsupported("this backend keeps no images".into())
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

/// A sandbox's lifecycle call: `POST /v1/sandboxes/{id}/<name>`, one
/// [`SandboxApi::lifecycle`] for all four.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifecycle {
    Pause,
    Resume,
    /// Resume or wake, and count as activity.
    Connect,
    Hibernate,
}

impl Lifecycle {
    pub const ALL: [Lifecycle; 4] = [
        Lifecycle::Pause,
        Lifecycle::Resume,
        Lifecycle::Connect,
        Lifecycle::Hibernate,
    ];

    /// Its route's suffix after `/v1/sandboxes/{id}` (what a federation
    /// forwards to the sandbox's pod).
    pub fn path(self) -> &'static str {
        match self {
            Lifecycle::Pause => "/pause",
            Lifecycle::Resume => "/resume",
            Lifecycle::Connect => "/connect",
            Lifecycle::Hibernate => "/hibernate",
        }
    }

    /// The last segment of its route (and its `kind` on the cluster's
    /// wire).
    pub fn name(self) -> &'static str {
        &self.path()[1..]
    }

    /// The call a route's last segment names.
    pub fn from_name(name: &str) -> Option<Lifecycle> {
        Lifecycle::ALL.into_iter().find(|op| op.name() == name)
    }
}

/// The sandbox service as the API sees it: `torpor_scheduler::service::Service`'s
/// calls, the four lifecycle ones as one [`SandboxApi::lifecycle`].
pub trait SandboxApi: Send + Sync + 'static {
    fn list_templates(&self) -> Result<Vec<Template>, ServiceError>;
    fn get_template(&self, id: &TemplateId) -> Result<Template, ServiceError>;
    fn create_template(&self, req: CreateTemplate) -> Result<Template, ServiceError>;
    fn delete_template(&self, id: &TemplateId) -> Result<(), ServiceError>;

    fn create_sandbox(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError>;
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

    fn list_pods(&self) -> Result<Vec<PodView>, ServiceError>;
    fn set_pod(
        &self,
        id: &PodId,
        ratio: Option<f64>,
        high_watermark: Option<f64>,
    ) -> Result<PodView, ServiceError>;

    /// Prometheus text exposition.
    fn metrics(&self) -> String;

    // Pods and templates as listed (`GET /v1/pods`, `GET /v1/templates`):
    // JSON objects, so that the federation can add remote pods' entries
    // (`reachable`, `error`) and each template's `pod`.

    fn pod_entries(&self) -> Result<Vec<Value>, ServiceError> {
        self.list_pods()?
            .into_iter()
            .map(|v| {
                let mut e = serde_json::to_value(crate::wire::PodBody::from(v))
                    .map_err(|e| ServiceError::Internal(e.to_string()))?;
                e["reachable"] = Value::Bool(true);
                Ok(e)
            })
            .collect()
    }
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

    /// The tenant sandbox `id` belongs to (`None`: made before tenants);
    /// `NotFound` if there is no such sandbox. The API's ownership check.
    fn sandbox_tenant(&self, id: &SandboxId) -> Result<Option<String>, ServiceError> {
        self.get_sandbox(id).map(|s| s.tenant)
    }

    // Images (Linux templates' kernels and root filesystems). A backend
    // without them (the API tests' fake) answers 501.

    /// Installed images' names.
    fn list_images(&self) -> Result<Vec<String>, ServiceError> {
        Err(no_images())
    }
    /// Installs one file of an image from `body` (at most `limit` bytes);
    /// its size.
    fn install_image(
        &self,
        _name: &str,
        _part: ImagePart,
        _body: &mut dyn std::io::Read,
        _limit: u64,
    ) -> Result<u64, ServiceError> {
        Err(no_images())
    }
    fn remove_image(&self, _name: &str) -> Result<(), ServiceError> {
        Err(no_images())
    }

    // Remote pods (the federation; see `crate::federation`). A single pod
    // keeps these defaults: nothing is remote, registration is refused.

    /// Registers a remote pod; its listing entry.
    fn add_pod(&self, _req: AddPod) -> Result<Value, ServiceError> {
        Err(no_remote_pods())
    }
    fn remove_pod(&self, _id: &PodId) -> Result<(), ServiceError> {
        Err(no_remote_pods())
    }
    /// The remote pod that owns this sandbox: its routes are forwarded there.
    fn remote_sandbox(&self, _id: &SandboxId) -> Option<RemotePod> {
        None
    }
    /// Whether `method path` of a remote sandbox is relayed to its pod as it
    /// came (the federation relays every sandbox route; the cluster only
    /// its data plane, its commands go through the pods' work queues).
    fn relays(&self, _method: &str, _path: &str) -> bool {
        true
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
    /// The remote pod with this id: `PATCH /v1/pods/{id}` is forwarded there.
    fn remote_pod(&self, _id: &PodId) -> Option<RemotePod> {
        None
    }
    /// Forwards a fork of a sandbox on `pod` (`path` on the pod, JSON
    /// `body`), recording the new sandbox as the pod's before answering.
    fn forward_fork(
        &self,
        _pod: &RemotePod,
        _path: &str,
        _body: Value,
    ) -> Result<Value, ServiceError> {
        Err(no_remote_pods())
    }

    // Checkpoints, restore and fork need snapshots: a backend without them
    // (the API tests' in-memory fake) keeps these defaults, which answer
    // 501 `unsupported`.

    fn list_checkpoints(&self, _id: &SandboxId) -> Result<Vec<Checkpoint>, ServiceError> {
        Err(no_checkpoints())
    }
    fn set_network_policy(
        &self,
        _id: &SandboxId,
        _patch: &PolicyPatch,
    ) -> Result<Sandbox, ServiceError> {
        Err(no_network())
    }
    fn list_ports(&self, _id: &SandboxId) -> Result<Vec<ExposedPort>, ServiceError> {
        Err(no_network())
    }
    fn expose_port(&self, _id: &SandboxId, _guest_port: u16) -> Result<ExposedPort, ServiceError> {
        Err(no_network())
    }
    fn unexpose_port(&self, _id: &SandboxId, _guest_port: u16) -> Result<(), ServiceError> {
        Err(no_network())
    }
    fn create_checkpoint(
        &self,
        _id: &SandboxId,
        _req: CreateCheckpoint,
    ) -> Result<Checkpoint, ServiceError> {
        Err(no_checkpoints())
    }
    fn delete_checkpoint(&self, _id: &SandboxId, _name: &str) -> Result<(), ServiceError> {
        Err(no_checkpoints())
    }
    fn restore_checkpoint(
        &self,
        _id: &SandboxId,
        _req: RestoreCheckpoint,
    ) -> Result<Outcome, ServiceError> {
        Err(no_checkpoints())
    }
    fn fork_sandbox(&self, _id: &SandboxId, _req: ForkSandbox) -> Result<Sandbox, ServiceError> {
        Err(no_checkpoints())
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
    /// `cancel` ends the exec early (its client went away): the command
    /// is killed in the guest.
    fn exec(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
    ) -> Result<GuestCall<ExecOutput>, ServiceError>;
    /// `on_start` runs once the sandbox runs, before any output.
    fn exec_streaming(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        on_start: &mut dyn FnMut(&Outcome),
        on_output: &mut dyn FnMut(OutputKind, &[u8]),
    ) -> Result<GuestCall<ExitReply>, ServiceError>;
    fn read_file(&self, id: &SandboxId, path: &str) -> Result<GuestCall<Vec<u8>>, ServiceError>;
    fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<GuestCall<u64>, ServiceError>;
    fn list_dir(&self, id: &SandboxId, path: &str) -> Result<GuestCall<DirListing>, ServiceError>;
    /// Wakes the sandbox if needed and hands `f` its agent (E2B's envd
    /// RPCs, which make their own connections to it).
    fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut dyn FnMut(&AgentLink) -> Result<(), GuestError>,
    ) -> Result<Outcome, ServiceError>;
}

impl SandboxApi for Service {
    fn list_templates(&self) -> Result<Vec<Template>, ServiceError> {
        Service::list_templates(self)
    }
    fn get_template(&self, id: &TemplateId) -> Result<Template, ServiceError> {
        Service::get_template(self, id)
    }
    fn create_template(&self, req: CreateTemplate) -> Result<Template, ServiceError> {
        not_here(&req.pod)?;
        Service::create_template(self, req)
    }
    fn delete_template(&self, id: &TemplateId) -> Result<(), ServiceError> {
        Service::delete_template(self, id)
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
    fn list_pods(&self) -> Result<Vec<PodView>, ServiceError> {
        Service::list_pods(self)
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
    fn list_checkpoints(&self, id: &SandboxId) -> Result<Vec<Checkpoint>, ServiceError> {
        Service::list_checkpoints(self, id)
    }
    fn set_network_policy(
        &self,
        id: &SandboxId,
        patch: &PolicyPatch,
    ) -> Result<Sandbox, ServiceError> {
        Service::set_network_policy(self, id, patch)
    }
    fn list_ports(&self, id: &SandboxId) -> Result<Vec<ExposedPort>, ServiceError> {
        Service::list_ports(self, id)
    }
    fn expose_port(&self, id: &SandboxId, guest_port: u16) -> Result<ExposedPort, ServiceError> {
        Service::expose_port(self, id, guest_port)
    }
    fn unexpose_port(&self, id: &SandboxId, guest_port: u16) -> Result<(), ServiceError> {
        Service::unexpose_port(self, id, guest_port)
    }
    fn create_checkpoint(
        &self,
        id: &SandboxId,
        req: CreateCheckpoint,
    ) -> Result<Checkpoint, ServiceError> {
        Service::create_checkpoint(self, id, req)
    }
    fn delete_checkpoint(&self, id: &SandboxId, name: &str) -> Result<(), ServiceError> {
        Service::delete_checkpoint(self, id, name)
    }
    fn restore_checkpoint(
        &self,
        id: &SandboxId,
        req: RestoreCheckpoint,
    ) -> Result<Outcome, ServiceError> {
        Service::restore_checkpoint(self, id, req)
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
    fn exec(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
    ) -> Result<GuestCall<ExecOutput>, ServiceError> {
        Service::exec(self, id, req, cancel)
    }
    fn exec_streaming(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        on_start: &mut dyn FnMut(&Outcome),
        on_output: &mut dyn FnMut(OutputKind, &[u8]),
    ) -> Result<GuestCall<ExitReply>, ServiceError> {
        Service::exec_streaming(self, id, req, cancel, on_start, on_output)
    }
    fn read_file(&self, id: &SandboxId, path: &str) -> Result<GuestCall<Vec<u8>>, ServiceError> {
        Service::read_file(self, id, path)
    }
    fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<GuestCall<u64>, ServiceError> {
        Service::write_file(self, id, path, data, mode)
    }
    fn list_dir(&self, id: &SandboxId, path: &str) -> Result<GuestCall<DirListing>, ServiceError> {
        Service::list_dir(self, id, path)
    }
    fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut dyn FnMut(&AgentLink) -> Result<(), GuestError>,
    ) -> Result<Outcome, ServiceError> {
        Service::with_guest(self, id, f)
    }
    fn list_images(&self) -> Result<Vec<String>, ServiceError> {
        Ok(self.images().list())
    }
    fn install_image(
        &self,
        name: &str,
        part: ImagePart,
        body: &mut dyn std::io::Read,
        limit: u64,
    ) -> Result<u64, ServiceError> {
        Ok(self.images().install(name, part, body, limit)?)
    }
    fn remove_image(&self, name: &str) -> Result<(), ServiceError> {
        Service::remove_image(self, name)
    }
}
