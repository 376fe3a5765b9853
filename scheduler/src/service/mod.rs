//! The sandbox service: lifecycle operations on sandboxes and templates,
//! run on the local pod, with every state change journaled in the store
//! before it is acknowledged.
//!
//! Blocking by design (store calls, control sockets, process spawns): the
//! async API calls it through `spawn_blocking`. Operations on one sandbox
//! are serialised by a per-sandbox lock; different sandboxes proceed
//! concurrently.

mod balloon;
pub mod cancel;
mod checkpoint;
mod conclude;
pub mod durable;
pub mod guest;
pub mod held;
mod hibernate;
pub mod history;
mod inject;
pub mod jail;
mod layer_gate;
mod layers;
mod lazy;
mod lifetime;
mod linux;
mod locks;
mod metrics;
pub mod mounts;
mod network;
pub mod objects;
mod ops;
mod policy;
pub mod pool;
mod ports;
mod reboot;
mod recovery;
pub mod resident;
mod sandbox_template;
mod stored_images;
mod template;
pub mod vmm;
pub mod vmm_process;
pub mod volume_gateway;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::model::{Pod, PodAddress, PodId, SandboxId, TemplateKind, Timestamp};
use crate::state::{IllegalTransition, SandboxState};
use crate::store::{Store, StoreError};

pub use crate::model::Owner;
pub use cancel::Cancel;
pub use checkpoint::{
    validate_checkpoint_name, CreateCheckpoint, ForkSandbox, RestoreCheckpoint,
    MAX_CHECKPOINT_NAME, MAX_FORK_COUNT, STALL_ENV,
};
pub use guest::{AgentLink, Dialer, GuestCall, GuestError};
pub use lifetime::{check_lifetimes, MAX_KEEP_ALIVE_MS, MAX_TIMEOUT_MS};
pub use linux::{HostGuests, LINUX_CMDLINE};
pub use metrics::Metrics;
pub use ops::may_delete;
pub use ports::WakeGate;
pub use reboot::{GuestCheck, Hibernation};
pub use sandbox_template::TemplateFromSandbox;

/// The local pod's id.
pub const LOCAL_POD: &str = "pod_local";
/// The built-in probe template's name.
pub const PROBE_TEMPLATE: &str = "probe";

/// Standby shells per shape kept when idle unless configured (the pool
/// grows past it with bursts, `pool::PoolConfig`; a shell is a KVM VM
/// with untouched memory: it costs page tables, not guest RAM).
pub const DEFAULT_STANDBY_POOL: usize = 4;

/// How long a deleted sandbox's row is kept (to read why it ended): 7 days.
pub const DEFAULT_DELETED_RETENTION_MS: u64 = 7 * 24 * 3600 * 1000;

/// Default (and largest) exec timeout: 10 minutes.
pub const DEFAULT_EXEC_TIMEOUT_MS: u64 = 10 * 60 * 1000;

/// Default bound of a pod's chunk cache (`--chunk-cache-mib`): 1 GiB.
pub const DEFAULT_CHUNK_CACHE_MIB: u64 = 1024;

/// How the service runs.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    pub data_dir: PathBuf,
    /// The `torpor-vmm` executable that runs each sandbox (one process per
    /// VM, started from a `LaunchSpec` on its stdin).
    pub vmm_exe: PathBuf,
    /// Which guests this host runs.
    pub host: HostGuests,
    /// Default keep-alive before an idle sandbox is hibernated (at most
    /// [`MAX_KEEP_ALIVE_MS`]).
    pub default_keep_alive_ms: u64,
    /// Oversubscription ratio of the local pod when it is first created.
    pub default_ratio: f64,
    /// Run the idle-hibernation and watermark policy every this many ms
    /// (0 disables it).
    pub policy_interval_ms: u64,
    /// How restored guest memory is mapped (`file` by default: pages shared
    /// through the page cache, the fastest restore and the smallest clone
    /// here; see docs/service.md, "Memory backend").
    pub memory_backend: torpor_vmm_api::MemoryBackend,
    /// Standby shells kept per (memory, vCPUs) shape of the templates
    /// when idle; 0 turns the pool off.
    pub standby_pool: usize,
    /// Most standby shells per shape a burst grows the pool to.
    pub standby_pool_max: usize,
    /// How long after a burst the pool keeps room for one as large before
    /// it shrinks back to `standby_pool`, in ms.
    pub standby_pool_idle_ms: u64,
    /// Standby shells made at once (0: one per core).
    pub standby_refill_threads: usize,
    /// Where every VMM's diff snapshots take dirty pages from.
    pub dirty_tracking: torpor_vmm_api::DirtyTracking,
    /// Timeout of an exec that names none, and the longest one may name
    /// (so no exec holds a blocking thread for ever).
    pub exec_timeout_ms: u64,
    /// Every VMM runs jailed as its own uid from this range (None: no
    /// jail, `serve --no-jail`, development machines only).
    pub jail: Option<jail::JailConfig>,
    /// Deleted sandboxes' rows are pruned this long after their deletion.
    pub deleted_retention_ms: u64,
    /// Where images (`NAME/vmlinux`, `NAME/rootfs.ext4`) are installed;
    /// `DATA_DIR/images` unless the operator names another.
    pub images_dir: Option<PathBuf>,
    /// Networking for Linux sandboxes (a namespace, tap and NAT each);
    /// `None`: they have no network device.
    pub net: Option<SandboxNetworking>,
    /// Where live traffic is recorded as an activity trace for
    /// `torpor plan` (`serve --record-trace`), if anywhere.
    pub record_trace: Option<PathBuf>,
    /// Sample every running sandbox's resource use into its history every
    /// this many ms (0 turns the thread off; a read still samples).
    pub history_interval_ms: u64,
    /// The object store hibernations and templates are uploaded to
    /// (`--object-store`: a directory or `s3://bucket/prefix`); None keeps
    /// snapshots on this pod's disk only.
    pub object_store: Option<String>,
    /// With an object store: how often every running or paused sandbox's
    /// state is checkpointed there (`--checkpoint-interval-s`,
    /// `durable.rs`); None: never.
    pub checkpoint_interval: Option<std::time::Duration>,
    /// With an object store: when a hibernation is answered
    /// (`--hibernate-ack`): once its snapshot is durable in the store (the
    /// default), or once it is durable on this pod's disk, the upload
    /// following in the background ([`objects::HibernateAck`]).
    pub hibernate_ack: objects::HibernateAck,
    /// A cold wake (snapshot only in the object store) restores once the
    /// layer's small files and its working set are here and lets the
    /// memory file arrive while the guest runs, its restore on the `uffd`
    /// backend (`serve --lazy-wake`; off by default): docs/storage.md,
    /// "The wake path".
    pub lazy_wake: bool,
    /// With an object store: the bound of the pod's chunk cache
    /// (`--chunk-cache-mib`, in [`ServiceConfig::chunk_cache_dir`]), which
    /// every layer fetched on this pod reads its chunks through, so that
    /// chunks its sandboxes share (those of one template) are fetched
    /// once; least recently used first out. 0: no cache.
    pub chunk_cache_mib: u64,
    /// Where the tenants' volumes are (`ROOT/ID/content/`, the API's
    /// `torpor_gate::volumes`), for the sandboxes that mount them
    /// ([`mounts`]); `None`: this pod mounts none.
    pub volumes_dir: Option<PathBuf>,
    /// A nested pod's: where its sandboxes' volume connections go instead
    /// (the volume gateway of the server in front of it, which has the
    /// volumes; [`crate::volumes::RelayHandle`]). Used when
    /// `volumes_dir` is `None`.
    pub volumes_relay: Option<crate::volumes::VolumesRelay>,
    /// The most bytes a volume's files may hold (`--volume-max-mib`): what
    /// guests write through their mounts counts, with what the content
    /// API writes, against it ([`crate::volumes::usage`]).
    pub volume_max_bytes: u64,
}

/// How Linux sandboxes are networked (see `crate::net`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxNetworking {
    /// Names and the address pool on the host.
    pub names: crate::net::NetConfig,
    /// The egress policy of sandboxes created without one (open by
    /// default; `serve --no-internet`, `--allow-out`, `--deny-out`).
    pub egress: crate::net::EgressPolicy,
    /// The pod's DNS forwarder (`NetConfig::dns_port` must name its
    /// port); `None`: guests' DNS queries go nowhere and domain entries
    /// in policies never match.
    pub dns: Option<crate::net::dns::DnsConfig>,
    /// Exposed ports listen on this address (loopback by default).
    pub ports_ip: std::net::IpAddr,
}

impl Default for SandboxNetworking {
    fn default() -> Self {
        Self {
            names: Default::default(),
            egress: Default::default(),
            dns: None,
            ports_ip: std::net::Ipv4Addr::LOCALHOST.into(),
        }
    }
}

impl ServiceConfig {
    /// Where the pod's chunk cache is ([`ServiceConfig::chunk_cache_mib`]).
    pub fn chunk_cache_dir(&self) -> PathBuf {
        self.data_dir.join("chunk-cache")
    }

    pub fn new(data_dir: PathBuf, vmm_exe: PathBuf) -> Self {
        Self {
            data_dir,
            vmm_exe,
            host: HostGuests::probe_only("not probed"),
            memory_backend: torpor_vmm_api::MemoryBackend::File,
            standby_pool: DEFAULT_STANDBY_POOL,
            standby_pool_max: pool::DEFAULT_MAX,
            standby_pool_idle_ms: pool::DEFAULT_IDLE_MS,
            standby_refill_threads: 0,
            dirty_tracking: torpor_vmm_api::DirtyTracking::Kvm,
            default_keep_alive_ms: 5 * 60 * 1000,
            default_ratio: 4.0,
            policy_interval_ms: 1000,
            exec_timeout_ms: DEFAULT_EXEC_TIMEOUT_MS,
            jail: Some(jail::JailConfig::default()),
            images_dir: None,
            deleted_retention_ms: DEFAULT_DELETED_RETENTION_MS,
            net: None,
            record_trace: None,
            history_interval_ms: history::SAMPLE_INTERVAL_MS,
            object_store: None,
            checkpoint_interval: None,
            lazy_wake: false,
            hibernate_ack: objects::HibernateAck::Stored,
            chunk_cache_mib: DEFAULT_CHUNK_CACHE_MIB,
            volumes_dir: None,
            volumes_relay: None,
            volume_max_bytes: crate::volumes::usage::DEFAULT_LIMIT,
        }
    }
}

/// Most characters of a template's name.
pub const MAX_TEMPLATE_NAME_CHARS: usize = 128;

/// A template's name: 1 to [`MAX_TEMPLATE_NAME_CHARS`] characters, none a
/// control character (what a template made from a sandbox, a rename and a
/// build's name all check; the API's schema states the same).
pub fn check_template_name(name: &str) -> Result<(), ServiceError> {
    let chars = name.chars().count();
    if chars == 0 || chars > MAX_TEMPLATE_NAME_CHARS || name.chars().any(char::is_control) {
        return Err(ServiceError::Invalid(format!(
            "template name {:?}: 1 to {MAX_TEMPLATE_NAME_CHARS} characters, no control characters",
            name.chars()
                .take(MAX_TEMPLATE_NAME_CHARS + 2)
                .collect::<String>()
        )));
    }
    Ok(())
}

/// Errors the API maps to HTTP statuses.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("{kind} {id} not found")]
    NotFound { kind: &'static str, id: String },
    #[error("sandbox {id} is {state}: {message}")]
    Conflict {
        id: String,
        state: SandboxState,
        message: String,
    },
    #[error("{message}")]
    Admission { message: String },
    /// A conflict with another resource rather than with the sandbox's
    /// state: a template still in use, a name already taken.
    #[error("{0}")]
    ResourceConflict(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A template build whose body has the schema's shape but a value the
    /// build cannot use (an empty command, a path leaving the context, a
    /// name reserved for layers, an unparsable image reference): 422
    /// `invalid_spec`, naming the field and step.
    #[error("invalid build: {0}")]
    InvalidSpec(String),
    /// The caller may see it but not do this (a tenant deleting a shared
    /// template): 403 `forbidden`.
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    Unsupported(String),
    /// This host cannot do it (a Linux template where the host lacks
    /// hardware virtualization, e.g. PVM): the request is well formed and
    /// another host could serve it; or a schema-valid setting the guest
    /// cannot run (a probe whose workload does not fit its memory).
    /// 422 `host_unsupported`.
    #[error("{0}")]
    HostUnsupported(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// A snapshot layer could not be stored in or fetched from the object
    /// store (the error names the layer, and a bad chunk its manifest,
    /// file and index).
    #[error(transparent)]
    ObjectStore(Box<objects::ObjectStoreError>),
    /// Exec and files: the guest agent could not do it (see [`GuestError`]).
    #[error(transparent)]
    Guest(#[from] GuestError),
    /// A VMM's classified failure (full disk, wrong state, bad snapshot...).
    #[error("{0}")]
    Vm(torpor_vmm_api::VmError),
    /// A remote pod's own error answer, passed through by the API server in front
    /// (`torpor serve` with remote pods); `pod_unreachable` (502) when the
    /// pod does not answer.
    #[error("{message}")]
    Pod {
        status: u16,
        code: String,
        message: String,
    },
    /// Not there yet but coming (a template whose pod is still starting
    /// or building it): 503 `unavailable` with `Retry-After`.
    #[error("{message}")]
    Unavailable {
        message: String,
        /// Seconds after which asking again is worth it.
        retry_after_s: u64,
    },
    /// The pod's resident memory and what the sandbox is expected to hold
    /// would pass its hard mark: a create or wake waits until reclaim
    /// brings it down. 429 `rate_limited` with `Retry-After`.
    #[error(
        "the pod is under memory pressure: {resident_mib} MiB resident and {asked_mib} MiB for \
         this sandbox would pass its hard mark of {hard_mib} MiB; retry in {retry_after_s} s"
    )]
    Pressure {
        resident_mib: u64,
        asked_mib: u64,
        hard_mib: u64,
        /// Seconds after which asking again is worth it (a policy round).
        retry_after_s: u64,
    },
    /// Accepted, not finished yet: a cluster's command whose pod has not
    /// answered within the replica's wait. It goes on; its operation
    /// (`GET /v1/operations/{operation}`) gives the outcome. 202 with
    /// `Location`.
    #[error("operation {operation} ({kind} on pod {pod}) is still running: GET /v1/operations/{operation}")]
    Accepted {
        operation: String,
        kind: String,
        sandbox: Option<String>,
        pod: String,
    },
    /// A wake that would restore memory kept while the guest agent did not
    /// answer (E2B's `envdUnresponsiveAtPause`): only a reboot wakes it.
    /// 409 `guest_unresponsive`.
    #[error(
        "sandbox {id} was hibernated with its memory while its guest agent did not answer: \
         restoring that memory would bring the unresponsive agent back; wake it by a reboot \
         from its disk instead (`mode: reboot`; E2B: `memory: false`)"
    )]
    GuestUnresponsive { id: String },
    /// A body or upload over its limit (413).
    #[error("{0}")]
    TooLarge(String),
    /// A tenant's quota would be exceeded (429, `quota_exceeded`).
    #[error("tenant {tenant} is at its {quota} quota: {used} used of {limit}, {asked} more asked")]
    Quota {
        tenant: String,
        quota: &'static str,
        limit: u64,
        used: u64,
        asked: u64,
    },
}

impl From<crate::images::ImageError> for ServiceError {
    fn from(e: crate::images::ImageError) -> Self {
        use crate::images::ImageError as E;
        match e {
            E::BadName | E::BadPart(_) | E::Empty(_) => ServiceError::Invalid(e.to_string()),
            // Missing, not a regular file or behind a symlink: one answer,
            // as for a name that is not there at all.
            E::Unusable { name, .. } => ServiceError::NotFound {
                kind: "image",
                id: name,
            },
            E::TooLarge { .. } => ServiceError::TooLarge(e.to_string()),
            E::InUse { .. } => ServiceError::ResourceConflict(e.to_string()),
            E::NotFound(id) => ServiceError::NotFound { kind: "image", id },
            E::Io(_) => ServiceError::Internal(e.to_string()),
        }
    }
}

impl From<StoreError> for ServiceError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound { kind, id } => ServiceError::NotFound { kind, id },
            StoreError::Conflict { id, current, .. } => ServiceError::Conflict {
                id: id.to_string(),
                state: current,
                message: "the sandbox changed state meanwhile".into(),
            },
            StoreError::InUse { kind, id, users } => ServiceError::ResourceConflict(format!(
                "{kind} {id} is in use by {users}; delete them first"
            )),
            StoreError::AlreadyExists { .. } => ServiceError::ResourceConflict(e.to_string()),
            StoreError::TemplateConflict { .. } => ServiceError::Invalid(e.to_string()),
            StoreError::Full { .. } => ServiceError::Admission {
                message: e.to_string(),
            },
            StoreError::InvalidRatio(_) | StoreError::Invalid { .. } => {
                ServiceError::Invalid(e.to_string())
            }
            other => ServiceError::Internal(other.to_string()),
        }
    }
}

impl ServiceError {
    fn illegal(id: &SandboxId, e: IllegalTransition, op: &str) -> Self {
        ServiceError::Conflict {
            id: id.to_string(),
            state: e.from,
            message: format!("cannot {op} a sandbox that is {}", e.from),
        }
    }
}

/// Creating a template (also the API's request body: unknown fields are
/// refused).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTemplate {
    pub name: String,
    pub kind: TemplateKind,
    /// A Linux template's image: the name of a directory in the images
    /// directory holding `vmlinux` and `rootfs.ext4` (never a host path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default = "default_mem")]
    pub mem_mib: u32,
    #[serde(default = "default_vcpus")]
    pub vcpus: u32,
    #[serde(default)]
    pub cmdline: Option<String>,
    /// The pod to build it on (`torpor serve` with remote pods); the local
    /// pod when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodId>,
    /// Who asks (set by the API from the token, never from the body): a
    /// tenant's template is that tenant's; an admin's, or one without an
    /// owner, is shared.
    #[serde(skip)]
    pub owner: Option<Owner>,
}

impl CreateTemplate {
    /// A shared probe template of 64 MiB and one vCPU named `name`.
    pub fn probe(name: &str) -> Self {
        CreateTemplate {
            name: name.into(),
            kind: TemplateKind::Probe,
            image: None,
            mem_mib: 64,
            vcpus: 1,
            cmdline: None,
            pod: None,
            owner: None,
        }
    }
}

fn default_mem() -> u32 {
    64
}
fn default_vcpus() -> u32 {
    1
}

/// Creating a sandbox (also the API's request body: unknown fields are
/// refused). Memory and vCPUs are the template's.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// Template id or name.
    pub template: String,
    /// The new sandbox's id, chosen by the server in front of this pod
    /// (with an admin token: the nested pod's server, which must know it
    /// before the guest mounts its volumes); generated when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub id: Option<crate::model::SandboxId>,
    /// Idle time before it is hibernated; at most [`MAX_KEEP_ALIVE_MS`].
    #[serde(default)]
    pub keep_alive_ms: Option<u64>,
    /// Deleted this long after creation; at most [`MAX_TIMEOUT_MS`].
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Environment variables for every command run in it.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// What its timeout does: delete (the default) or hibernate.
    #[serde(default)]
    pub on_timeout: crate::model::OnTimeout,
    /// What a hibernation by its timeout keeps: memory and disk (the
    /// default) or the disk only (its wake then boots it).
    #[serde(default)]
    pub timeout_hibernation: crate::model::HibernationKind,
    /// Its in-sandbox API token (E2B's `envdAccessToken`); not part of
    /// the API's body.
    #[serde(skip)]
    pub access_token: Option<String>,
    /// Wait (up to 30 s) for capacity instead of refusing at once.
    #[serde(default)]
    pub queue: bool,
    /// Pin it to this pod (`torpor serve` with remote pods) instead of
    /// letting placement choose.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodId>,
    /// Its egress policy: what is given replaces the pod's default, what
    /// is left out is the default's (pods with sandbox networking only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::net::PolicyPatch>,
    /// The `Host` its guest ports are sent through the port router
    /// (E2B's `maskRequestHost`; `${PORT}` the port): [`crate::model::Sandbox::ingress_host`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress_host: Option<String>,
    /// Volumes of its tenant to mount in its guest, by name (E2B's
    /// `volumeMounts`; Linux templates only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMountRequest>,
    /// `volume_mounts` resolved by the API's gate to the owner's volumes
    /// (never from the body: a create whose `volume_mounts` are not all
    /// resolved here is refused).
    #[serde(skip)]
    pub volumes: Vec<crate::model::MountedVolume>,
    /// Who asks (set by the API from the token, never from the body); the
    /// sandbox is `owner.tenant`'s.
    #[serde(skip)]
    pub owner: Option<Owner>,
}

/// A volume to mount, as a create names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VolumeMountRequest {
    /// The volume's name (its tenant's).
    pub name: String,
    /// Absolute path in the guest.
    pub path: String,
    /// The volume's id, as the server in front of this pod resolved it
    /// (with an admin token: the nested pod's server); refused from a
    /// tenant's token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

impl CreateSandbox {
    /// The volumes to mount: `volumes` when it resolves every one of
    /// `volume_mounts` (same names and paths, in order), else why not.
    pub fn resolved_volumes(&self) -> Result<Vec<crate::model::MountedVolume>, ServiceError> {
        let same = self.volumes.len() == self.volume_mounts.len()
            && self
                .volumes
                .iter()
                .zip(&self.volume_mounts)
                .all(|(v, m)| v.name == m.name && v.path == m.path && !v.id.is_empty());
        if !same {
            return Err(ServiceError::Invalid(
                "volume mounts were not resolved to the tenant's volumes".into(),
            ));
        }
        Ok(self.volumes.clone())
    }
}

/// The result of an operation, and whether it had to wake the sandbox.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Outcome {
    pub sandbox: crate::model::Sandbox,
    pub resumed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_ms: Option<f64>,
}

/// A pod with its load.
#[derive(Debug, Clone, Serialize)]
pub struct PodView {
    #[serde(flatten)]
    pub pod: Pod,
    /// Memory of sandboxes holding a VMM (not hibernated), MiB.
    pub committed_mib: u64,
    /// Measured PSS of all its VMM processes, MiB.
    pub pss_mib: f64,
    /// Resident memory of its sandboxes, MiB: the sum of each one's
    /// (`resident::resident_bytes`), what the pressure marks count.
    pub resident_mib: f64,
    pub sandboxes: BTreeMap<String, u64>,
}

/// The service.
#[derive(Debug)]
pub struct Service {
    /// Itself, shared: what a caller that holds only `&Service` hands to
    /// another thread ([`Service::shared`]).
    me: std::sync::Weak<Service>,
    config: ServiceConfig,
    store: Store,
    /// Per-sandbox operation locks (only held ones are kept).
    locks: locks::SandboxLocks,
    /// VMM processes this service started (others were re-attached).
    children: Mutex<HashMap<SandboxId, vmm_process::VmmChild>>,
    /// Waits for the exits of VMMs a hibernation told to exit.
    reaper: vmm_process::Reaper,
    /// The volumes its sandboxes mount, served while their VMMs run.
    mounts: Arc<mounts::Mounts>,
    metrics: Metrics,
    /// Each running sandbox's resource use over time.
    history: history::History,
    /// Sandboxes with guest requests in flight (the policy leaves them).
    in_flight: policy::InFlight,
    /// Idle sandboxes whose guests the policy asked to shrink.
    shrunk: balloon::Shrunk,
    /// The pod's resident memory as the pressure gate last measured it.
    last_resident: resident::LastMeasure,
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// Standby VMM shells for creates and wakes.
    pool: Arc<pool::StandbyPool>,
    /// Uids and jails of VMMs (None: VMMs run unjailed).
    jails: Option<Arc<jail::Jails>>,
    /// The images Linux templates are built from.
    images: crate::images::Images,
    /// Memory (MiB) of template builds booting now: counted by admission
    /// with the sandboxes' (a build boots a VM too).
    building_mib: Mutex<u64>,
    /// Sandbox networks, when `config.net` is set.
    net: Option<Arc<crate::net::NetManager>>,
    nets: Mutex<HashMap<SandboxId, crate::net::SandboxNet>>,
    /// The activity trace recorder (`serve --record-trace`).
    recorder: Option<crate::trace::record::Recorder>,
    /// Exposed ports, with `config.net`.
    ports: Option<crate::net::ports::PortProxy>,
    /// The pod's DNS forwarder, with `config.net.dns`.
    dns: Mutex<Option<crate::net::dns::Forwarder>>,
    /// Admission of the wakes no API request carries (traffic to an
    /// exposed port), installed by the API's gate.
    wake_gate: std::sync::OnceLock<Arc<dyn ports::WakeGate>>,
    /// The object store snapshots are uploaded to, with `--object-store`.
    objects: Option<objects::ObjectStore>,
    /// Memory files still arriving after a lazy cold wake, by sandbox.
    lazy: lazy::Arrivals,
}

impl Service {
    /// Opens the store, recovers from an unclean stop, makes sure the local
    /// pod and the built-in probe template exist, and starts the policy.
    pub fn open(mut config: ServiceConfig) -> Result<Arc<Self>, ServiceError> {
        check_lifetimes(Some(config.default_keep_alive_ms), None)?;
        // Only the service reads its data: sandboxes' files, the store, the
        // API token.
        for sub in ["", "sandboxes", "templates"] {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(config.data_dir.join(sub))
                .map_err(|e| ServiceError::Internal(format!("create data dir: {e}")))?;
        }
        // Snapshot layers are compared by path, and the VMM records diff
        // parents canonicalised: every path the service makes must be too.
        config.data_dir = std::fs::canonicalize(&config.data_dir)
            .map_err(|e| ServiceError::Internal(format!("resolve data dir: {e}")))?;
        let store = Store::open(&config.data_dir)?;
        let jails = config
            .jail
            .map(|c| jail::Jails::new(&config.data_dir, c).map(Arc::new))
            .transpose()?;
        let images = crate::images::Images::open(
            config
                .images_dir
                .clone()
                .unwrap_or_else(|| config.data_dir.join("images")),
        )
        .map_err(|e| ServiceError::Internal(e.to_string()))?;
        let pool = pool::StandbyPool::new(
            config.data_dir.join("pool"),
            config.vmm_exe.clone(),
            pool::PoolConfig {
                min: config.standby_pool,
                max: config.standby_pool_max,
                idle: std::time::Duration::from_millis(config.standby_pool_idle_ms),
                refill_threads: config.standby_refill_threads,
            },
            config.dirty_tracking,
            jails.clone().map(|j| (j, config.memory_backend)),
        )?;
        let net = match &config.net {
            Some(n) => Some(Arc::new(
                crate::net::NetManager::new(n.names.clone())
                    .map_err(|e| ServiceError::Internal(format!("sandbox network: {e}")))?,
            )),
            None => None,
        };
        let recorder = match &config.record_trace {
            Some(p) => Some(crate::trace::record::Recorder::start(p).map_err(|e| {
                ServiceError::Internal(format!("cannot record a trace to {}: {e}", p.display()))
            })?),
            None => None,
        };
        let objects = config
            .object_store
            .as_deref()
            .map(|url| {
                let cache = config.chunk_cache_dir();
                let limit = config.chunk_cache_mib.saturating_mul(1 << 20);
                let cache = (limit > 0).then_some((cache.as_path(), limit));
                objects::ObjectStore::open(url, config.hibernate_ack, cache)
            })
            .transpose()?;
        let ports_ip = config.net.as_ref().map(|n| n.ports_ip);
        let mounts = Arc::new(mounts::Mounts::new(
            config.volumes_dir.clone(),
            config.volumes_relay.clone(),
            config.volume_max_bytes,
        ));
        let service = Arc::new_cyclic(|me: &std::sync::Weak<Self>| Self {
            recorder,
            ports: net.as_ref().zip(ports_ip).map(|(m, ip)| {
                crate::net::ports::PortProxy::new(
                    Arc::clone(m),
                    ip,
                    Arc::new(ports::Waker(me.clone())),
                )
            }),
            net,
            nets: Mutex::new(HashMap::new()),
            dns: Mutex::new(None),
            wake_gate: std::sync::OnceLock::new(),
            me: me.clone(),
            objects,
            lazy: lazy::Arrivals::default(),
            config,
            store,
            locks: locks::SandboxLocks::default(),
            children: Mutex::new(HashMap::new()),
            reaper: vmm_process::Reaper::default(),
            mounts,
            metrics: Metrics::default(),
            history: history::History::default(),
            in_flight: policy::InFlight::default(),
            shrunk: balloon::Shrunk::default(),
            last_resident: resident::LastMeasure::default(),
            stop: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            pool,
            jails,
            images,
            building_mib: Mutex::new(0),
        });
        service.ensure_local_pod()?;
        service.recover()?;
        service.adopt_networks()?;
        service.start_dns()?;
        service.restore_ports()?;
        service.ensure_probe_template()?;
        for t in service.store.list_templates(false)? {
            if t.state == crate::model::TemplateState::Ready {
                service.pool.want((t.mem_mib, t.vcpus));
            }
        }
        let me = Arc::downgrade(&service);
        service.pool.set_room(Box::new(move |shape| {
            me.upgrade().map_or(0, |s| s.standby_room(shape))
        }));
        service.pool.start();
        if service.config.policy_interval_ms > 0 {
            policy::start(&service);
        }
        if service.config.history_interval_ms > 0 {
            history::start(&service);
        }
        if service.objects.is_some() {
            objects::start_upkeep(&service);
            if let Some(every) = service.config.checkpoint_interval {
                durable::start(&service, every);
            }
        }
        Ok(service)
    }

    /// Stops the policy thread; VMMs keep running (a restarted service
    /// re-attaches to them).
    pub fn close(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.pool.stop();
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The images directory.
    pub fn images(&self) -> &crate::images::Images {
        &self.images
    }

    fn ensure_local_pod(&self) -> Result<(), ServiceError> {
        let id = PodId::new(LOCAL_POD);
        if self.store.get_pod(&id).is_ok() {
            return Ok(());
        }
        let memory_bytes = torpor_vmm_api::host::memory_bytes()
            .map_err(|e| ServiceError::Internal(format!("host memory: {e}")))?;
        let vcpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        self.store.insert_pod(&Pod {
            id,
            address: PodAddress::Local,
            token_hash: None,
            memory_bytes,
            vcpus,
            disk_bytes: 0,
            oversubscription_ratio: self.config.default_ratio,
            high_watermark: 0.9,
            created_at: Timestamp::now(),
        })?;
        Ok(())
    }

    /// Records activity on `id` in the trace, when one is recorded.
    fn record(
        &self,
        at: std::time::Instant,
        id: &SandboxId,
        kind: crate::trace::EventKind,
        duration_ms: u64,
        mem_mib: u32,
    ) {
        if let Some(r) = &self.recorder {
            r.record(at, id.as_str(), kind, duration_ms, mem_mib);
        }
    }

    /// Takes the lock serialising operations on sandbox `id`, waiting for
    /// the operation that holds it. An id that is not a sandbox id (`sbx_`
    /// and 16 hex characters) names no sandbox: not found, and no lock.
    fn lock_sandbox(&self, id: &SandboxId) -> Result<locks::SandboxGuard<'_>, ServiceError> {
        if !SandboxId::is_well_formed(id.as_str()) {
            return Err(ServiceError::NotFound {
                kind: "sandbox",
                id: id.to_string(),
            });
        }
        Ok(self.locks.lock(id))
    }

    /// How many per-sandbox locks the service keeps (those held).
    #[cfg(test)]
    pub(crate) fn lock_entries(&self) -> usize {
        self.locks.len()
    }

    fn sandbox_dir(&self, id: &SandboxId) -> PathBuf {
        self.config.data_dir.join("sandboxes").join(id.as_str())
    }

    /// This service, shared (every `Service` is made shared by
    /// [`Service::new`]; `None` only while it is being dropped).
    pub fn shared(&self) -> Option<Arc<Service>> {
        self.me.upgrade()
    }

    pub fn metrics_registry(&self) -> &Metrics {
        &self.metrics
    }
}

#[cfg(test)]
mod lifecycle_tests;
#[cfg(test)]
mod network_tests;
#[cfg(test)]
mod reboot_tests;
#[cfg(test)]
mod recovery_tests;
