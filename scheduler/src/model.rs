//! The scheduler's plain data: ids, templates, sandboxes, pods, checkpoints.
//!
//! These are what the store keeps and what the API will show (serde, JSON).
//! They hold no behaviour beyond small helpers; the rules live in
//! [`crate::state`] and [`crate::store`].

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Also named here: the API and the cluster make their ids and tokens with them.
pub use crate::random::{random_bytes, random_hex};
pub use crate::state::SandboxState;

/// A stored or received word that names no variant of an enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} value {value:?}")]
pub struct UnknownValue {
    /// The enum's name.
    pub kind: &'static str,
    /// What was found.
    pub value: String,
}

/// Milliseconds since the Unix epoch (UTC). Stored as an integer.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(transparent)]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// The current wall-clock time.
    pub fn now() -> Self {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        Timestamp(i64::try_from(ms).unwrap_or(i64::MAX))
    }

    /// Milliseconds since the epoch.
    pub fn millis(self) -> i64 {
        self.0
    }
}

/// Number of random hex characters after an id's prefix.
pub const ID_HEX_LEN: usize = 16;

macro_rules! id_type {
    ($(#[$meta:meta])* $name:ident, $prefix:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, utoipa::ToSchema)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// What every generated id of this kind starts with.
            pub const PREFIX: &'static str = $prefix;

            /// A new random id: the prefix and 16 random hex characters.
            pub fn generate() -> Self {
                $name(format!("{}{}", $prefix, random_hex(ID_HEX_LEN / 2)))
            }

            /// An id from a string as given (read back from the store, or a
            /// fixed name such as the local pod's). No check is made; see
            /// [`Self::is_well_formed`] for input from clients.
            pub fn new(id: impl Into<String>) -> Self {
                $name(id.into())
            }

            /// True for what [`Self::generate`] makes: the prefix and 16
            /// lowercase hex characters.
            pub fn is_well_formed(id: &str) -> bool {
                id.strip_prefix($prefix).is_some_and(|hex| {
                    hex.len() == ID_HEX_LEN
                        && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                })
            }

            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

id_type!(
    /// A sandbox: `sbx_` and 16 hex characters.
    SandboxId,
    "sbx_"
);
id_type!(
    /// A template: `tpl_` and 16 hex characters.
    TemplateId,
    "tpl_"
);
id_type!(
    /// A pod: `pod_` and 16 hex characters (the local pod may use a fixed id).
    PodId,
    "pod_"
);
id_type!(
    /// A named checkpoint: `ckp_` and 16 hex characters.
    CheckpointId,
    "ckp_"
);
id_type!(
    /// An entry of the operations journal: `op_` and 16 hex characters.
    OperationId,
    "op_"
);

str_enum! {
    /// What a template boots.
    pub enum TemplateKind {
        /// The freestanding probe guest (runs natively, even on PVM hosts).
        Probe => "probe",
        /// A Linux kernel and rootfs with torpor-agent.
        Linux => "linux",
    }
}

str_enum! {
    /// What the policy does when a sandbox's timeout (`expires_at`) passes.
    #[derive(Default)]
    pub enum OnTimeout {
        /// Delete it (the default).
        #[default]
        Delete => "delete",
        /// Hibernate it (E2B's `autoPause`); it stays hibernated until it
        /// is woken and given a new timeout.
        Hibernate => "hibernate",
    }
}

str_enum! {
    /// What a hibernation keeps.
    #[derive(Default)]
    pub enum HibernationKind {
        /// Memory and disk (the default): a wake restores the sandbox
        /// where it was.
        #[default]
        Memory => "memory",
        /// The disk only (E2B's filesystem-only pause): a wake boots the
        /// sandbox again from its disk, a new boot.
        Filesystem => "filesystem",
    }
}

/// Where a template is in its life. Serialised as `{"state": "failed",
/// "reason": "..."}` (the reason only for `failed`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "state", content = "reason", rename_all = "snake_case")]
pub enum TemplateState {
    /// Booting once to take its snapshot.
    Building,
    /// Its snapshot exists; sandboxes can be created from it.
    Ready,
    /// The build failed, for this reason.
    Failed(String),
    /// Deleted (kept as a row so that old sandboxes still name it).
    Deleted,
}

impl TemplateState {
    /// The word stored in the `state` column.
    pub fn as_str(&self) -> &'static str {
        match self {
            TemplateState::Building => "building",
            TemplateState::Ready => "ready",
            TemplateState::Failed(_) => "failed",
            TemplateState::Deleted => "deleted",
        }
    }

    /// The failure reason, for `Failed`.
    pub fn reason(&self) -> Option<&str> {
        match self {
            TemplateState::Failed(reason) => Some(reason),
            _ => None,
        }
    }

    /// From the stored word and reason.
    pub fn from_parts(state: &str, reason: Option<String>) -> Result<Self, UnknownValue> {
        Ok(match state {
            "building" => TemplateState::Building,
            "ready" => TemplateState::Ready,
            "failed" => TemplateState::Failed(reason.unwrap_or_default()),
            "deleted" => TemplateState::Deleted,
            other => {
                return Err(UnknownValue {
                    kind: "TemplateState",
                    value: other.to_string(),
                })
            }
        })
    }
}

impl fmt::Display for TemplateState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateState::Failed(reason) => write!(f, "failed ({reason})"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// A snapshot of a booted, idle guest that sandboxes are restored from (or,
/// made from a sandbox keeping its disk only, booted from:
/// [`Template::boots_from_disk`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Template {
    pub id: TemplateId,
    /// Unique among templates that are not deleted.
    pub name: String,
    /// Kernel image path, or `builtin:probe`.
    // Left out of tenants' answers (a host path).
    #[schema(required = false)]
    pub kernel: String,
    /// Root filesystem image (Linux templates).
    #[schema(value_type = Option<String>)]
    pub rootfs: Option<PathBuf>,
    /// The snapshot directory, once built.
    #[schema(value_type = Option<String>)]
    pub snapshot_dir: Option<PathBuf>,
    pub mem_mib: u32,
    pub vcpus: u32,
    pub kind: TemplateKind,
    pub created_at: Timestamp,
    #[serde(flatten)]
    pub state: TemplateState,
    /// The tenant that built it; none for shared templates (the built-in
    /// probe, an admin's), which every tenant may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The installed image (`DATA_DIR/images/NAME`) a Linux template was
    /// built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The sandbox it was snapshotted from (`POST .../template`, E2B's
    /// snapshots), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<SandboxId>,
    /// The manifest its snapshot is stored as in the pod's object store
    /// (`serve --object-store`), from which a pod that lacks it fetches it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_snapshot: Option<String>,
}

impl Template {
    /// A filesystem-only snapshot of a sandbox (made from it, ready, with
    /// no snapshot): its sandboxes boot over a copy of the disk it keeps
    /// in its directory instead of restoring.
    pub fn boots_from_disk(&self) -> bool {
        self.state == TemplateState::Ready && self.snapshot_dir.is_none() && self.source.is_some()
    }
}

/// Who makes a sandbox or a template: the tenant it will belong to, and
/// whether that caller is an admin (who may use every template).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub tenant: String,
    pub admin: bool,
}

/// The VMM process that runs a sandbox now: its pid, and the process's
/// start time so that a recycled pid is never taken for it (signals go
/// through a pidfd checked against both; see `service::vmm::stop`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VmmHandle {
    pub pid: u32,
    /// `/proc/PID/stat` field 22 (clock ticks after boot) when recorded;
    /// `None` in rows written before it was.
    #[serde(default)]
    pub start_time: Option<u64>,
    #[schema(value_type = String)]
    pub control_socket: PathBuf,
}

/// A volume mounted in a sandbox's guest (E2B's `volumeMounts`): which of
/// its tenant's volumes (`id`, resolved from the name by the API's gate,
/// never taken from a request), the name the guest mounts it by (the NFS
/// export `/<name>`) and where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MountedVolume {
    pub id: String,
    pub name: String,
    pub path: String,
}

/// One microVM session, running or not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Sandbox {
    pub id: SandboxId,
    pub template: TemplateId,
    /// The pod it is placed on (none before placement).
    pub pod: Option<PodId>,
    pub mem_mib: u32,
    pub vcpus: u32,
    /// Idle time (no API activity, guest idle) after which it is hibernated.
    pub keep_alive_ms: u64,
    /// When it is deleted (or hibernated, see `on_timeout`) whatever its
    /// activity (the API's timeout).
    pub expires_at: Option<Timestamp>,
    /// What happens when `expires_at` passes.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// What a hibernation by `on_timeout` keeps (E2B's `autoPauseMemory`).
    #[serde(default)]
    pub timeout_hibernation: HibernationKind,
    /// Hibernated keeping only its disk: its next wake boots it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disk_only: bool,
    /// Hibernated with its memory while its guest agent did not answer
    /// (E2B's `envdUnresponsiveAtPause`): it wakes only by a reboot.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub guest_unresponsive_at_pause: bool,
    /// Its tenant's volumes mounted in its guest (E2B's `volumeMounts`),
    /// served by its pod over NFS while its VMM runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<MountedVolume>,
    pub metadata: BTreeMap<String, String>,
    /// Environment variables set for every command run in it (under the
    /// command's own). Never shown: they may hold secrets.
    #[serde(default, skip_serializing)]
    pub env: BTreeMap<String, String>,
    /// The token its in-sandbox API (E2B's envd) accepts in
    /// `X-Access-Token`, if one was issued. Never shown but to its creator.
    #[serde(default, skip_serializing)]
    pub access_token: Option<String>,
    /// The `Host` its guest ports are sent (E2B's `maskRequestHost`), its
    /// `${PORT}` the port's number, the caller's own `Host` then in
    /// `X-Forwarded-Host`; none: the caller's `Host` as it came. Never
    /// for envd's port. Checked by [`check_ingress_host`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress_host: Option<String>,
    pub state: SandboxState,
    /// Why it failed (kept when a failed sandbox is deleted).
    pub failure_reason: Option<String>,
    pub created_at: Timestamp,
    pub last_active_at: Timestamp,
    /// Its latest snapshot directory (hibernation or checkpoint), if any.
    #[schema(value_type = Option<String>)]
    pub snapshot: Option<PathBuf>,
    /// The manifest that snapshot is stored as in the pod's object store
    /// (`serve --object-store`), once a hibernation uploaded it: any pod
    /// of the store can wake it from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_snapshot: Option<String>,
    /// When `stored_snapshot` was stored. For a sandbox running from a
    /// durable checkpoint (`--checkpoint-interval-s`), the time of its
    /// last durable state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_at: Option<Timestamp>,
    /// A sandbox `lost` with its pod (a cluster's pod lost for good): the
    /// time of its own last state durable in the object store (its
    /// `stored_at`: a hibernation it was woken from since, which it ran
    /// past), none when it never had one (its template's is not its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_durable_at: Option<Timestamp>,
    /// Its VMM process, while one runs.
    pub vmm: Option<VmmHandle>,
    /// Incremented by the store on every state change, and when its
    /// latest snapshot is stored in the object store (`stored_snapshot`
    /// appears without a state change): a copy of the row never replaces
    /// one of a later generation.
    pub generation: u64,
    /// The tenant it belongs to (none: made before tenants existed, only
    /// an admin sees it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// How the VMM came up, in the answer to the create or wake that
    /// started it (not stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<RestoreReport>,
    /// How the hibernation went, in the answer to the hibernate that took
    /// it (not stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hibernation: Option<HibernateReport>,
    /// Its egress policy, exposed ports and traffic, on a pod with
    /// sandbox networking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<SandboxNetwork>,
    /// The CPU its VMM uses, in the answer to a get while one runs (not
    /// stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<SandboxUsage>,
    /// Its memory as the host measures it and its guest reports it, while
    /// its VMM runs (read when asked; not stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<SandboxMemory>,
}

/// A running sandbox's memory: its VMM's PSS on the host, and its guest's
/// own statistics and balloon (virtio-balloon; absent on guests without
/// one, such as the probe). Read from `/proc` and the VMM when asked.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SandboxMemory {
    /// Proportional set size of its VMM process now.
    pub pss_bytes: u64,
    /// What it holds resident now: its VMM's cgroup's memory usage less
    /// inactive page cache (the working set; cgroup v1 or v2), or its PSS
    /// when its VMM has no cgroup of its own (`serve --no-jail`). What the
    /// pod's pressure marks count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resident_bytes: Option<u64>,
    /// What the pod asked the guest to give back through the balloon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balloon_target_mib: Option<u64>,
    /// What the guest holds in the balloon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balloon_actual_mib: Option<u64>,
    /// Free memory the guest reported since its VMM started (discarded on
    /// the host: free page reporting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported_bytes: Option<u64>,
    /// The guest's own statistics (its balloon driver's), and their age.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_total_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_free_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_available_bytes: Option<u64>,
    /// Total less free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_used_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_stats_age_ms: Option<u64>,
    /// The PSS of its VMM when the pod last asked its guest to shrink
    /// (compare with `pss_bytes`: what the shrink gave back), and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink_pss_before_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrunk_at: Option<Timestamp>,
}

/// A sandbox's network: what is stored (policy, ports) and what is read
/// from the host when asked (address, counters).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SandboxNetwork {
    pub policy: crate::net::EgressPolicy,
    #[serde(default)]
    pub ports: Vec<ExposedPort>,
    /// Its own host-side address, while it has a network (its VMM runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub address: Option<std::net::Ipv4Addr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<crate::net::NetCounters>,
}

/// The CPU a sandbox's VMM uses: in the answer to a get of a sandbox whose
/// VMM runs (not stored; its memory is [`SandboxMemory`]). Measured by its
/// pod, so serve shows its nested pod's sandboxes' too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SandboxUsage {
    /// Its CPU time since it started ÷ its lifetime ÷ its vCPUs, percent.
    pub cpu_used_pct: f64,
}

/// A guest port reachable from the host: TCP to `address` is forwarded to
/// `guest_port` (waking the sandbox first if it is hibernated).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExposedPort {
    pub guest_port: u16,
    /// `IP:PORT` on the pod.
    pub address: String,
}

/// How a create or wake brought a sandbox's VM up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RestoreReport {
    /// `standby` (a pre-made shell took the snapshot) or `cold` (a new
    /// VMM process restored it).
    pub path: RestorePath,
    /// The memory backend (`file`, `uffd`, `uffd-shared`).
    pub backend: String,
    /// Service side: from the start of the restore step to the guest
    /// running, in ms.
    pub ms: f64,
    /// VMM side: the shell's request-to-running, or a cold VMM's spawn to
    /// ready, in ms.
    pub vmm_ms: f64,
    /// Where the request's time went, in ms, in order: `admit` (admission
    /// and the journal's start, one commit), `prepare` (store reads,
    /// directory, taking a shell), `jail` (a jailed shell only: mounting
    /// the sandbox's directory and layers into its jail), `vmm` (the
    /// restore request or cold spawn, round trip), `record` (the VMM's
    /// handle, one commit), `hook`
    /// (a Linux guest's post-restore hook), `commit` (the operation's end).
    #[serde(default)]
    pub phases: Vec<(String, f64)>,
}

impl RestoreReport {
    /// Adds phase `name` of `ms`.
    pub fn phase(&mut self, name: &str, ms: f64) {
        self.phases.push((name.to_string(), ms));
    }
}

/// How a hibernation went: where its time went, and what it wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HibernateReport {
    /// Service side: from the request's start to the answer, in ms.
    pub ms: f64,
    /// VMM side: its pause and snapshot, as it measured them, in ms.
    pub vmm_ms: f64,
    /// A diff on the snapshot the VM ran from (else a full snapshot).
    pub diff: bool,
    /// Bytes the snapshot's memory layer occupies on disk (the dirty
    /// pages of a diff).
    pub memory_bytes: u64,
    /// Where the time went, in ms, in order: `begin` (the journal's start,
    /// one commit), `vmm` (the request that pauses, snapshots and ends the
    /// VM, round trip), `stop` (the VMM process's exit handed to a thread
    /// the sandbox's next operation waits for; waited for in full when the
    /// policy hibernates to free memory), `record` (the
    /// layers checked and recorded), `commit` (the operation's end),
    /// `store` (the upload to the object store when acknowledged there;
    /// otherwise the local bookkeeping).
    #[serde(default)]
    pub phases: Vec<(String, f64)>,
}

impl HibernateReport {
    /// Adds phase `name` of `ms`.
    pub fn phase(&mut self, name: &str, ms: f64) {
        self.phases.push((name.to_string(), ms));
    }
}

/// Which way a VM came up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RestorePath {
    Standby,
    Cold,
}

impl RestorePath {
    pub fn as_str(self) -> &'static str {
        match self {
            RestorePath::Standby => "standby",
            RestorePath::Cold => "cold",
        }
    }
}

/// What an [`Sandbox::ingress_host`] writes for the guest port's number.
pub const INGRESS_PORT_PLACEHOLDER: &str = "${PORT}";

/// Longest [`Sandbox::ingress_host`].
pub const MAX_INGRESS_HOST: usize = 255;

/// Checks a `Host` to send a sandbox's guest ports (E2B's
/// `maskRequestHost`: `HOST[:PORT]`, `${PORT}` anywhere for the port's
/// number), in E2B's words when it is refused: ASCII letters, digits and
/// `.-_:[]` only (so it is a header's value and one name), not empty, at
/// most [`MAX_INGRESS_HOST`] characters.
pub fn check_ingress_host(host: &str) -> Result<(), String> {
    if !host.is_ascii() {
        return Err(format!(
            "mask request host '{host}' is not ASCII. Please use ASCII characters only."
        ));
    }
    let bare = host.replace(INGRESS_PORT_PLACEHOLDER, "1");
    let plain = bare
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || ".-_:[]".contains(c));
    if host.is_empty() || host.len() > MAX_INGRESS_HOST || !plain {
        return Err(format!("mask request host is not valid: {host}"));
    }
    Ok(())
}

/// The `Host` guest port `port` is sent by a sandbox whose
/// [`Sandbox::ingress_host`] is `mask`.
pub fn ingress_host_for(mask: &str, port: u16) -> String {
    mask.replace(INGRESS_PORT_PLACEHOLDER, &port.to_string())
}

impl Sandbox {
    /// A new sandbox in `creating`, not yet placed, active now.
    pub fn new(template: TemplateId, mem_mib: u32, vcpus: u32, keep_alive_ms: u64) -> Self {
        let now = Timestamp::now();
        Sandbox {
            id: SandboxId::generate(),
            template,
            pod: None,
            mem_mib,
            vcpus,
            keep_alive_ms,
            expires_at: None,
            on_timeout: OnTimeout::Delete,
            timeout_hibernation: HibernationKind::Memory,
            disk_only: false,
            guest_unresponsive_at_pause: false,
            volumes: Vec::new(),
            ingress_host: None,
            metadata: BTreeMap::new(),
            env: BTreeMap::new(),
            access_token: None,
            state: SandboxState::Creating,
            failure_reason: None,
            created_at: now,
            last_active_at: now,
            snapshot: None,
            stored_snapshot: None,
            stored_at: None,
            last_durable_at: None,
            vmm: None,
            generation: 0,
            restore: None,
            hibernation: None,
            tenant: None,
            network: None,
            usage: None,
            memory: None,
        }
    }
}

/// How the scheduler reaches a pod.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PodAddress {
    /// Inside the `torpor serve` process.
    Local,
    /// A `torpor pod` on this host.
    Unix {
        #[schema(value_type = String)]
        path: PathBuf,
    },
    /// A `torpor pod` on loopback (`host:port`), plain TCP, with a token.
    Tcp { addr: String },
    /// A remote `torpor pod` (`host:port`) over TLS, its certificate
    /// pinned, with a token.
    Tls { addr: String },
}

impl PodAddress {
    /// The stored form: `local`, `unix:PATH`, `tcp:HOST:PORT` or
    /// `tls:HOST:PORT`.
    pub fn to_text(&self) -> Option<String> {
        match self {
            PodAddress::Local => Some("local".to_string()),
            PodAddress::Unix { path } => path.to_str().map(|p| format!("unix:{p}")),
            PodAddress::Tcp { addr } => Some(format!("tcp:{addr}")),
            PodAddress::Tls { addr } => Some(format!("tls:{addr}")),
        }
    }

    /// Parses the stored form.
    pub fn from_text(text: &str) -> Result<Self, UnknownValue> {
        if text == "local" {
            Ok(PodAddress::Local)
        } else if let Some(path) = text.strip_prefix("unix:") {
            Ok(PodAddress::Unix { path: path.into() })
        } else if let Some(addr) = text.strip_prefix("tcp:") {
            Ok(PodAddress::Tcp { addr: addr.into() })
        } else if let Some(addr) = text.strip_prefix("tls:") {
            Ok(PodAddress::Tls { addr: addr.into() })
        } else {
            Err(UnknownValue {
                kind: "PodAddress",
                value: text.to_string(),
            })
        }
    }
}

/// Largest oversubscription ratio the store accepts.
pub const MAX_OVERSUBSCRIPTION_RATIO: f64 = 100.0;

/// One host's capacity, served by a `torpor pod`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = PodRecord)]
pub struct Pod {
    pub id: PodId,
    pub address: PodAddress,
    /// Hash of the token a remote pod presents; never shown by the API.
    #[serde(skip_serializing, default)]
    pub token_hash: Option<String>,
    /// Physical memory available to sandboxes.
    pub memory_bytes: u64,
    pub vcpus: u32,
    /// Disk for snapshots.
    pub disk_bytes: u64,
    /// Committed sandbox memory ÷ physical memory allowed (0 < r ≤ 100).
    pub oversubscription_ratio: f64,
    /// Fraction of physical memory in use (measured PSS) past which idle
    /// sandboxes are hibernated, least recently used first (0 < w ≤ 1).
    pub high_watermark: f64,
    pub created_at: Timestamp,
}

/// A named snapshot of a sandbox it can be restored or forked from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Checkpoint {
    pub id: CheckpointId,
    pub sandbox: SandboxId,
    /// Unique per sandbox.
    pub name: String,
    #[schema(value_type = String)]
    pub snapshot_dir: PathBuf,
    /// The checkpoint this one's diff layer sits on, if any.
    pub parent: Option<CheckpointId>,
    pub created_at: Timestamp,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_prefixed_random_hex() {
        let a = SandboxId::generate();
        let b = SandboxId::generate();
        assert_ne!(a, b);
        assert!(a.as_str().starts_with("sbx_"));
        assert!(SandboxId::is_well_formed(a.as_str()));
        assert!(TemplateId::is_well_formed(TemplateId::generate().as_str()));
        assert!(!SandboxId::is_well_formed("sbx_0123"));
        assert!(!SandboxId::is_well_formed("tpl_0123456789abcdef"));
        assert!(!SandboxId::is_well_formed("sbx_0123456789ABCDEF"));
        assert_eq!(serde_json::to_string(&a).unwrap(), format!("\"{a}\""));
    }

    #[test]
    fn template_state_json() {
        let mut t = Template {
            id: TemplateId::new("tpl_x"),
            name: "probe".into(),
            kernel: "builtin:probe".into(),
            rootfs: None,
            snapshot_dir: None,
            mem_mib: 64,
            vcpus: 1,
            kind: TemplateKind::Probe,
            created_at: Timestamp(5),
            state: TemplateState::Ready,
            tenant: None,
            image: None,
            source: None,
            stored_snapshot: None,
        };
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(v["state"], "ready");
        assert_eq!(v["kind"], "probe");
        t.state = TemplateState::Failed("no agent".into());
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(v["state"], "failed");
        assert_eq!(v["reason"], "no agent");
        let back: Template = serde_json::from_value(v).unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn pod_address_text_round_trips_and_token_stays_hidden() {
        for a in [
            PodAddress::Local,
            PodAddress::Unix {
                path: "/run/torpor/pod.sock".into(),
            },
            PodAddress::Tcp {
                addr: "127.0.0.1:7070".into(),
            },
        ] {
            assert_eq!(PodAddress::from_text(&a.to_text().unwrap()).unwrap(), a);
        }
        assert!(PodAddress::from_text("udp:x").is_err());
        let pod = Pod {
            id: PodId::new("pod_local"),
            address: PodAddress::Local,
            token_hash: Some("secret".into()),
            memory_bytes: 1,
            vcpus: 1,
            disk_bytes: 1,
            oversubscription_ratio: 1.5,
            high_watermark: 0.9,
            created_at: Timestamp(0),
        };
        let json = serde_json::to_string(&pod).unwrap();
        assert!(!json.contains("secret"), "{json}");
    }

    #[test]
    fn str_enums_parse_their_words() {
        for k in TemplateKind::ALL {
            assert_eq!(k.as_str().parse::<TemplateKind>().unwrap(), *k);
        }
        assert!("windows".parse::<TemplateKind>().is_err());
    }
}
