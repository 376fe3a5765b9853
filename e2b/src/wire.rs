//! E2B's JSON, with E2B's field names (`sandboxID`, `templateID`,
//! `envVars`, ...), as the `e2b` SDKs' generated clients read and write it,
//! and the conversions from torpor's model.
//!
//! Request bodies ignore fields they do not know (E2B adds fields often and
//! the SDKs send what they have); fields that ask for something torpor does
//! not offer (volume mounts, MCP, IAM, some network settings) are refused with 400
//! when they are set, rather than ignored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use torpor_scheduler::model::{OnTimeout, Sandbox, SandboxState, Timestamp};

use super::error::E2bError;
use super::time;

/// The envd version the create answer names. The SDKs gate features on it
/// (`0.1.0` at least to create at all; file metadata from `0.6.2`, watch
/// events with entries from `0.6.3`, `allowNetworkMounts` on watches from
/// `0.6.4`, the newest gate of the pinned SDKs); see `docs/e2b.md`.
pub const ENVD_VERSION: &str = "0.6.4";
/// E2B's default `timeout` (seconds) when a create or connect leaves it
/// out: 300 in the current E2B API (`NewSandbox.timeout`, `@default 300`);
/// the SDKs send none unless asked (an older spec said 15, which killed
/// SDK-default sandboxes after 15 s).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// Largest page of a list.
pub const MAX_LIMIT: usize = 100;
/// Largest `count` of a fork (the SDK's `MAX_FORK_COUNT`).
pub use torpor_gate::service::MAX_FORK_COUNT;

/// `POST /sandboxes` (v1, `NewSandbox`) and `POST /v2/sandboxes`
/// (`NewSandboxV2`): the same fields here.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Seconds until the sandbox's timeout ([`DEFAULT_TIMEOUT_S`]).
    #[serde(default)]
    pub timeout: Option<u64>,
    /// On timeout: hibernate (`true`) or delete (`false`, the default).
    #[serde(default)]
    pub auto_pause: Option<bool>,
    /// What the timeout's pause keeps: memory and disk (`true`, the
    /// default) or the disk only (`false`: its resume reboots).
    #[serde(default)]
    pub auto_pause_memory: Option<bool>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub env_vars: Option<BTreeMap<String, String>>,
    /// Egress rules ([`super::network`]).
    #[serde(default)]
    pub network: Option<super::network::E2bNetwork>,
    /// `false`: no traffic out but `network.allowOut`'s (snake case in
    /// E2B's API too).
    #[serde(default, rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    /// E2B's secured envd (an access token): torpor's envd always asks
    /// for one; `false` only refuses `network.allowPublicTraffic: false`,
    /// as E2B does.
    #[serde(default)]
    pub secure: Option<bool>,
    /// Volumes to mount (`crate::volumes::mounts`).
    #[serde(default)]
    pub volume_mounts: Option<Value>,
    // Asked for but not offered: refused when set (see `refuse_unoffered`).
    #[serde(default)]
    pub mcp: Option<Value>,
    #[serde(default)]
    pub iam: Option<Value>,
}

impl NewSandbox {
    /// 400 for a field that asks for something torpor does not offer.
    pub fn refuse_unoffered(&self) -> Result<(), E2bError> {
        for (name, value) in [("mcp", &self.mcp), ("iam", &self.iam)] {
            if value.as_ref().is_some_and(super::network::is_set) {
                return Err(E2bError::bad_request(format!(
                    "`{name}` is not offered by torpor (see docs/e2b.md)"
                )));
            }
        }
        Ok(())
    }

    /// The `Host` its guest ports are to be sent (`network.maskRequestHost`),
    /// checked; 400 in E2B's words for one that is not a host, and for
    /// `allowPublicTraffic: false` with `secure: false`.
    pub fn ingress_host(&self) -> Result<Option<String>, E2bError> {
        let Some(network) = &self.network else {
            return Ok(None);
        };
        if network.allow_public_traffic == Some(false) && self.secure == Some(false) {
            return Err(E2bError::bad_request(
                "You cannot create a sandbox without public access unless you enable secure \
                 envd access via 'secure' flag.",
            ));
        }
        network.ingress_host()
    }

    /// The egress policy asked for; `None` when neither `network` nor
    /// `allow_internet_access` is given (the pod's default then).
    pub fn network_policy(&self) -> Result<Option<torpor_scheduler::net::PolicyPatch>, E2bError> {
        // Its ports' part is read apart (`ingress_host`).
        let network = self
            .network
            .as_ref()
            .map(super::network::E2bNetwork::egress);
        if !network
            .as_ref()
            .is_some_and(super::network::E2bNetwork::asks_egress)
            && self.allow_internet_access.is_none()
        {
            return Ok(None);
        }
        network
            .unwrap_or_default()
            .policy(self.allow_internet_access)
            .map(Some)
    }
}

/// `POST /sandboxes/{id}/connect`, `/v2/.../connect`, `/resume`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectBody {
    /// Seconds from now; E2B's default ([`DEFAULT_TIMEOUT_S`]) when absent.
    #[serde(default)]
    pub timeout: Option<u64>,
    /// `false`: reboot from disk instead of restoring memory (E2B's
    /// `on_resume="reboot"`).
    #[serde(default)]
    pub memory: Option<bool>,
}

/// `POST /sandboxes/{id}/pause` (`SandboxPauseRequest`), optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PauseBody {
    /// `false`: keep only the filesystem; the resume reboots.
    #[serde(default)]
    pub memory: Option<bool>,
    /// Refuse (503) while the guest agent does not answer, instead of
    /// pausing and marking the sandbox `envdUnresponsiveAtPause`.
    #[serde(default)]
    pub require_healthy_guest: Option<bool>,
}

impl PauseBody {
    /// The lifecycle call it asks for.
    pub fn lifecycle(&self) -> torpor_gate::backend::Lifecycle {
        use torpor_gate::backend::Lifecycle as L;
        match (self.memory, self.require_healthy_guest) {
            (Some(false), _) => L::HibernateFilesystem,
            (_, Some(true)) => L::HibernateStrict,
            _ => L::HibernateMarking,
        }
    }
}

/// `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Deserialize)]
pub struct TimeoutBody {
    pub timeout: u64,
}

/// `POST /sandboxes/{id}/refreshes`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RefreshBody {
    #[serde(default)]
    pub duration: Option<u64>,
}

/// `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SnapshotBody {
    #[serde(default)]
    pub name: Option<String>,
    /// `false`: a filesystem-only snapshot (the SDKs' `mode="filesystem"`):
    /// the disk only, a create from it boots. Absent or `true`: memory and
    /// disk. Anything else is 400 naming the field.
    #[serde(default, deserialize_with = "snapshot_memory")]
    pub memory: Option<bool>,
}

/// `memory` of a snapshot: a boolean or null; the error says which values
/// mean what (the SDKs' two modes).
fn snapshot_memory<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(b)),
        Some(other) => Err(serde::de::Error::custom(format!(
            "`memory` is true (memory and disk: the SDKs' mode=\"full\") or false (the disk \
             only: mode=\"filesystem\"), not {other}"
        ))),
    }
}

/// `POST /sandboxes/{id}/fork`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ForkBody {
    #[serde(default)]
    pub timeout: Option<u64>,
    #[serde(default)]
    pub count: Option<u32>,
}

/// What create, connect, resume and fork answer (E2B's `Sandbox`).
#[derive(Debug, Clone, Serialize)]
pub struct CreatedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// The template's name.
    pub alias: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: &'static str,
    /// The domain of the sandbox's ports' host names
    /// (`{port}-{id}.{domain}`, `serve --proxy-domain`); null without one
    /// (the SDKs then reach ports through `E2B_SANDBOX_URL`'s headers).
    pub domain: Option<String>,
    /// The token the in-sandbox API (envd) takes in `X-Access-Token`.
    #[serde(rename = "envdAccessToken", skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    /// The token the sandbox's guest ports take in
    /// `E2B-Traffic-Access-Token` (see `crate::ports`).
    #[serde(rename = "trafficAccessToken", skip_serializing_if = "Option::is_none")]
    pub traffic_access_token: Option<String>,
}

/// `GET /sandboxes/{id}` (`SandboxDetail`) and list entries
/// (`ListedSandbox`; `domain` is ignored there).
#[derive(Debug, Clone, Serialize)]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub alias: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    #[serde(rename = "startedAt")]
    pub started_at: String,
    #[serde(rename = "endAt")]
    pub end_at: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: &'static str,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: &'static str,
    pub metadata: BTreeMap<String, String>,
    pub domain: Option<String>,
    pub lifecycle: Lifecycle,
    /// Paused with its memory while its guest agent did not answer: it
    /// resumes only with `memory: false` (a reboot). Absent otherwise.
    #[serde(
        rename = "envdUnresponsiveAtPause",
        skip_serializing_if = "Option::is_none"
    )]
    pub envd_unresponsive_at_pause: Option<bool>,
    /// Its ports' side of `SandboxNetworkConfig`.
    pub network: DetailNetwork,
}

/// What `SandboxDetail.network` tells of a sandbox's ports: never public
/// (a credential is always asked: `crate::ports`), and the `Host` they
/// are sent, if the create masked it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DetailNetwork {
    pub allow_public_traffic: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
}

/// What the sandbox's timeout does (`SandboxLifecycle`).
#[derive(Debug, Clone, Serialize)]
pub struct Lifecycle {
    /// Traffic to a paused sandbox's ports resumes it (`crate::ports`),
    /// as do envd's calls.
    #[serde(rename = "autoResume")]
    pub auto_resume: bool,
    /// `kill` or `pause` (torpor: delete or hibernate).
    #[serde(rename = "onTimeout")]
    pub on_timeout: &'static str,
}

impl Lifecycle {
    fn of(s: &Sandbox) -> Self {
        Lifecycle {
            auto_resume: true,
            on_timeout: match s.on_timeout {
                OnTimeout::Delete => "kill",
                OnTimeout::Hibernate => "pause",
            },
        }
    }
}

/// `GET /sandboxes/{id}/metrics` entries (`SandboxMetric`).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMetric {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// `POST /sandboxes/{id}/snapshots` and `GET /snapshots` entries.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
}

/// One entry of a fork's answer: the sandbox, or why that one failed.
#[derive(Debug, Clone, Serialize)]
pub struct ForkResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<CreatedSandbox>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<E2bError>,
}

/// E2B's two states: `running` (running, being created or resumed) and
/// `paused` (paused, hibernating, hibernated). Failed, lost (with its pod)
/// and deleted sandboxes have none: E2B shows them as gone (404, not
/// listed), as E2B's own do when their node dies.
pub fn e2b_state(state: SandboxState) -> Option<&'static str> {
    match state {
        SandboxState::Creating | SandboxState::Running | SandboxState::Resuming => Some("running"),
        SandboxState::Paused | SandboxState::Hibernating | SandboxState::Hibernated => {
            Some("paused")
        }
        SandboxState::Failed | SandboxState::Lost | SandboxState::Deleted => None,
    }
}

/// The torpor states an E2B state stands for.
pub fn torpor_states(e2b: &str) -> Option<&'static [SandboxState]> {
    match e2b {
        "running" => Some(&[
            SandboxState::Creating,
            SandboxState::Running,
            SandboxState::Resuming,
        ]),
        "paused" => Some(&[
            SandboxState::Paused,
            SandboxState::Hibernating,
            SandboxState::Hibernated,
        ]),
        _ => None,
    }
}

/// A sandbox without a timeout never ends: `endAt` is the last instant
/// RFC 3339 can write.
const NEVER: Timestamp = Timestamp(253_402_300_799_999);

/// `clientID`: the pod the sandbox is on (E2B's legacy client id).
fn client_id(s: &Sandbox) -> String {
    s.pod
        .as_ref()
        .map(|p| p.to_string())
        .unwrap_or_else(|| torpor_scheduler::service::LOCAL_POD.to_string())
}

impl CreatedSandbox {
    pub fn new(s: &Sandbox, alias: String) -> Self {
        CreatedSandbox {
            template_id: s.template.to_string(),
            sandbox_id: s.id.to_string(),
            alias,
            client_id: client_id(s),
            envd_version: ENVD_VERSION,
            domain: None,
            envd_access_token: s.access_token.clone(),
            traffic_access_token: s.access_token.as_deref().map(crate::traffic_token),
        }
    }

    /// With the API's ports domain, if it has one.
    pub fn in_domain<S>(mut self, tenancy: &torpor_gate::tenancy::Tenancy<S>) -> Self {
        self.domain = tenancy.domain.as_deref().map(str::to_string);
        self
    }
}

impl SandboxDetail {
    /// `None` for a failed or deleted sandbox (gone, to E2B).
    pub fn new(s: &Sandbox, alias: String, disk_size_mb: u64) -> Option<Self> {
        Some(SandboxDetail {
            template_id: s.template.to_string(),
            alias,
            sandbox_id: s.id.to_string(),
            client_id: client_id(s),
            started_at: time::format(s.created_at),
            end_at: time::format(s.expires_at.unwrap_or(NEVER)),
            envd_version: ENVD_VERSION,
            cpu_count: s.vcpus,
            memory_mb: s.mem_mib,
            disk_size_mb,
            state: e2b_state(s.state)?,
            metadata: user_metadata(&s.metadata),
            domain: None,
            lifecycle: Lifecycle::of(s),
            envd_unresponsive_at_pause: s.guest_unresponsive_at_pause.then_some(true),
            network: DetailNetwork {
                allow_public_traffic: false,
                mask_request_host: s.ingress_host.clone(),
            },
        })
    }
}

/// A sandbox's metadata as its user set it: without torpor's own keys
/// (`torpor.*`, reserved: sandboxes placed by an earlier torpor carry
/// `torpor.placement`), which the E2B
/// SDKs would otherwise hand back to agents comparing what they set.
pub fn user_metadata(metadata: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    metadata
        .iter()
        .filter(|(k, _)| !k.starts_with("torpor."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// A list's page cursor (`nextToken`, `x-next-token`): the creation time
/// and id of the last entry given; the next page starts after it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cursor {
    pub created_at: i64,
    pub id: String,
}

impl Cursor {
    pub fn encode(&self) -> String {
        format!("{}.{}", self.created_at, self.id)
    }

    pub fn decode(token: &str) -> Result<Self, E2bError> {
        let bad = || E2bError::bad_request(format!("nextToken {token:?} is not a token we gave"));
        let (at, id) = token.split_once('.').ok_or_else(bad)?;
        let created_at = at.parse().map_err(|_| bad())?;
        if id.is_empty() {
            return Err(bad());
        }
        Ok(Cursor {
            created_at,
            id: id.to_string(),
        })
    }
}

/// The page of `items` (sorted in the list's order, keyed by `key`) after
/// `after`, at most `limit` long, and the token of the next page if there
/// is one.
pub fn page<T>(
    items: Vec<T>,
    key: impl Fn(&T) -> Cursor,
    descending: bool,
    after: Option<&Cursor>,
    limit: usize,
) -> (Vec<T>, Option<String>) {
    let mut rest: Vec<T> = items
        .into_iter()
        .filter(|t| match after {
            None => true,
            Some(c) if descending => key(t) < *c,
            Some(c) => key(t) > *c,
        })
        .collect();
    let more = rest.len() > limit;
    rest.truncate(limit);
    let next = if more {
        rest.last().map(|t| key(t).encode())
    } else {
        None
    };
    (rest, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torpors_own_metadata_keys_are_not_shown() {
        let m: BTreeMap<String, String> = [("torpor.placement", "plc_1"), ("run", "x")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let shown = user_metadata(&m);
        assert_eq!(shown.len(), 1);
        assert_eq!(shown["run"], "x");
    }

    #[test]
    fn pages_follow_the_cursor() {
        let items: Vec<(i64, &str)> = vec![(1, "a"), (2, "b"), (2, "c"), (3, "d")];
        let key = |t: &(i64, &str)| Cursor {
            created_at: t.0,
            id: t.1.to_string(),
        };
        let (p1, next) = page(items.clone(), key, false, None, 2);
        assert_eq!(p1, [(1, "a"), (2, "b")]);
        let c = Cursor::decode(&next.unwrap()).unwrap();
        let (p2, next) = page(items.clone(), key, false, Some(&c), 2);
        assert_eq!(p2, [(2, "c"), (3, "d")]);
        assert_eq!(next, None);
        let mut desc = items.clone();
        desc.reverse();
        let (p1, next) = page(desc.clone(), key, true, None, 3);
        assert_eq!(p1, [(3, "d"), (2, "c"), (2, "b")]);
        let c = Cursor::decode(&next.unwrap()).unwrap();
        assert_eq!(page(desc, key, true, Some(&c), 3).0, [(1, "a")]);
        for bad in ["", "x", "12", "12.", "a.b"] {
            assert!(Cursor::decode(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn states_map_both_ways() {
        for s in SandboxState::ALL {
            match e2b_state(*s) {
                Some(e) => assert!(torpor_states(e).unwrap().contains(s)),
                None => assert!(matches!(
                    s,
                    SandboxState::Failed | SandboxState::Lost | SandboxState::Deleted
                )),
            }
        }
        assert!(torpor_states("killed").is_none());
    }

    #[test]
    fn unoffered_fields_are_refused_when_set() {
        let body: NewSandbox = serde_json::from_str(
            r#"{"templateID":"probe","network":null,"mcp":{},"volumeMounts":[],"secure":true}"#,
        )
        .unwrap();
        body.refuse_unoffered().unwrap();
        let body: NewSandbox =
            serde_json::from_str(r#"{"templateID":"probe","mcp":{"server":{}}}"#).unwrap();
        assert_eq!(body.refuse_unoffered().unwrap_err().code, 400);
    }
}
