//! What E2B's routes and envd need of a cluster sandbox beyond the
//! commands of the work queues: its secrets, its guest agent, its
//! snapshots, its timeouts and its metrics, on any replica.
//!
//! - Secrets (schema version 8, `sandbox_secrets`): what the pod keeps but
//!   never shows (the API's answers and the pods' results and heartbeats
//!   skip them), E2B's envd access token and the sandbox's environment,
//!   written by the replica that made the sandbox (create, fork) once its
//!   row is there, and read back with the sandbox by every replica, so
//!   that any of them checks `X-Access-Token` and gives envd's processes
//!   their environment. The token is kept as issued, not as a digest:
//!   E2B's connect answers it again (`envdAccessToken`, which the SDKs'
//!   `Sandbox.connect` then uses), as the embedded mode does from its
//!   store; PostgreSQL already holds the pods' own tokens. A retry of a
//!   create (its `Idempotency-Key`) keeps the first request's. The row
//!   goes with its sandbox's (`ON DELETE CASCADE`).
//! - The guest agent: through the owning pod's agent tunnel
//!   ([`torpor_gate::pods::tunnel::dialer`], as serve reaches its nested
//!   pod's sandbox), the pod waking the sandbox if it is hibernated. A pod
//!   down is 503 `unavailable`, as on `/v1`.
//! - Snapshots (E2B's snapshot-as-template): made on the sandbox's pod
//!   (`POST /v1/sandboxes/{id}/template`, beside its layers), answered once
//!   the pod's heartbeat lists it (within [`LISTED_WITHIN`]), so that a
//!   create from it right after is placed there; listed from the pods'
//!   catalogs.
//! - Timeouts: `PATCH /v1/sandboxes/{id}` on the pod (what `/v1` relays
//!   there), its answer written to the sandbox's row at once (a heartbeat
//!   would a little later), so that a read through any replica sees the
//!   new deadline.
//! - Metrics: the sandbox as its pod measures it at the request (`GET
//!   /v1/sandboxes/{id}` there); the rows keep no usage.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use torpor_scheduler::model::{
    PodId, Sandbox, SandboxId, Template, TemplateId, TemplateKind, TemplateState,
};

use super::db::{pg, Db};
use super::replica::Cluster;
use super::ClusterError;
use torpor_client::encode;
use torpor_gate::backend::blocking;
use torpor_gate::calls::{map_call, ExecMode, ExecReply};
use torpor_gate::error::code;
use torpor_gate::pods::RemotePod;
use torpor_gate::service::{
    AgentLink, Cancel, ExecRequest, GuestCall, GuestError, Outcome, ServiceError,
    TemplateFromSandbox,
};

/// How long a snapshot's answer waits for its pod's heartbeat to list it.
const LISTED_WITHIN: Duration = Duration::from_secs(10);

/// A sandbox's envd access token and environment.
pub type Secrets = (Option<String>, BTreeMap<String, String>);

impl Db {
    /// Sandbox `id`'s secrets (none kept: no token, no variables).
    pub async fn secrets(&self, id: &SandboxId) -> Result<Secrets, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt_prepared(
                "SELECT access_token, env FROM sandbox_secrets WHERE sandbox = $1",
                &[&id.as_str()],
            )
            .await?;
        let Some(row) = row else {
            return Ok((None, BTreeMap::new()));
        };
        let env = serde_json::from_value(row.get::<_, Value>(1))
            .map_err(|e| ClusterError::Schema(format!("sandbox {id}'s environment: {e}")))?;
        Ok((row.get(0), env))
    }

    /// Keeps sandbox `id`'s secrets, unless it has some already (a retry
    /// of the request that made it): those kept.
    pub async fn keep_secrets(
        &self,
        id: &SandboxId,
        token: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Result<Secrets, ClusterError> {
        let c = self.client().await?;
        let env = serde_json::to_value(env)
            .map_err(|e| ClusterError::Schema(format!("an environment: {e}")))?;
        c.execute(
            "INSERT INTO sandbox_secrets (sandbox, access_token, env)
             SELECT $1::text, $2::text, $3::jsonb
             WHERE EXISTS (SELECT 1 FROM sandboxes WHERE id = $1)
             ON CONFLICT (sandbox) DO NOTHING",
            &[&id.as_str(), &token, &env],
        )
        .await
        .map_err(pg)?;
        self.secrets(id).await
    }

    /// The kind of template `id` on `pod`, as its heartbeat listed it.
    pub async fn template_kind(
        &self,
        pod: &PodId,
        id: &TemplateId,
    ) -> Result<Option<TemplateKind>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT t->>'kind' FROM pods, jsonb_array_elements(catalog) t
                 WHERE pods.id = $1 AND t->>'id' = $2 LIMIT 1",
                &[&pod.as_str(), &id.as_str()],
            )
            .await
            .map_err(pg)?;
        Ok(row
            .and_then(|r| r.get::<_, Option<String>>(0))
            .and_then(|k| k.parse().ok()))
    }
}

impl Cluster {
    /// `sandbox` with its secrets.
    pub(super) async fn with_secrets(&self, mut sandbox: Sandbox) -> Result<Sandbox, ServiceError> {
        (sandbox.access_token, sandbox.env) = self.db.secrets(&sandbox.id).await?;
        Ok(sandbox)
    }

    /// After a create or a fork made `sandbox`: its `token` and `env` kept
    /// (if it has either), and shown on it as kept.
    pub(super) async fn keep_secrets(
        &self,
        sandbox: &mut Sandbox,
        token: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Result<(), ServiceError> {
        if token.is_none() && env.is_empty() {
            return Ok(());
        }
        (sandbox.access_token, sandbox.env) = self.db.keep_secrets(&sandbox.id, token, env).await?;
        Ok(())
    }

    /// Sandbox `id` (with its secrets) and its pod to call directly: 503
    /// when the pod is down.
    async fn pod_of(&self, id: &SandboxId) -> Result<(Sandbox, RemotePod), ServiceError> {
        let (sandbox, row) = self.owned_up(id).await?;
        let pod = self.remote(&row).ok_or_else(|| {
            ServiceError::Internal(format!(
                "pod {} has an address or fingerprint this replica cannot use",
                row.id
            ))
        })?;
        let sandbox = self.with_secrets(sandbox).await?;
        Ok((sandbox, pod))
    }

    /// A sandbox as `pod` answered it, written to its row (only over an
    /// older or equal generation of the same pod's, never bringing back
    /// a deleted one: as a heartbeat), with its secrets.
    async fn pod_answer(&self, pod: &RemotePod, value: Value) -> Result<Sandbox, ServiceError> {
        let sandbox = Self::sandbox_from(pod, value)?;
        let c = self.db.client().await?;
        self.db.upsert_sandbox(&c, &pod.id, &sandbox, true).await?;
        self.with_secrets(sandbox).await
    }

    /// The sandbox as its pod measures it now (its `usage` and `memory`,
    /// which the rows do not keep fresh): not written to its row.
    pub(super) async fn measured_on_pod(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        let (_, pod) = self.pod_of(id).await?;
        let value = pod.fetch("GET", &Self::sandbox_path(id), None).await?;
        self.with_secrets(Self::sandbox_from(&pod, value)?).await
    }

    /// The sandbox as its pod has it now, written to its row (as a
    /// heartbeat would: over an older or equal generation of that pod's
    /// only), with its secrets.
    pub(super) async fn refreshed_on_pod(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        let (_, pod) = self.pod_of(id).await?;
        let value = pod.fetch("GET", &Self::sandbox_path(id), None).await?;
        self.pod_answer(&pod, value).await
    }

    /// The sandbox's metrics history, as its pod keeps it.
    pub(super) async fn history_on_pod(
        &self,
        id: &SandboxId,
        range: torpor_gate::wire::Range,
    ) -> Result<Vec<torpor_scheduler::service::history::MetricSample>, ServiceError> {
        let (_, pod) = self.pod_of(id).await?;
        torpor_gate::pods::metrics_history(&pod, id, range).await
    }

    fn sandbox_from(pod: &RemotePod, value: Value) -> Result<Sandbox, ServiceError> {
        let mut sandbox: Sandbox =
            serde_json::from_value(value).map_err(|e| ServiceError::Pod {
                status: 502,
                code: code::POD_UNREACHABLE.into(),
                message: format!("pod {}: its answer is not a sandbox ({e})", pod.id),
            })?;
        sandbox.pod = Some(pod.id.clone());
        Ok(sandbox)
    }

    fn sandbox_path(id: &SandboxId) -> String {
        format!("/v1/sandboxes/{}", encode(id.as_str()))
    }

    /// The sandbox's timeouts set on its pod.
    pub(super) async fn timeout_on_pod(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<Sandbox, ServiceError> {
        let (_, pod) = self.pod_of(id).await?;
        let body = json!({"keep_alive_ms": keep_alive_ms, "timeout_ms": timeout_ms});
        let value = pod
            .fetch("PATCH", &Self::sandbox_path(id), Some(&body))
            .await?;
        self.pod_answer(&pod, value).await
    }

    /// Hands `f` the sandbox's agent through its pod's agent tunnel (the
    /// pod wakes it first if it is hibernated); then the sandbox as its
    /// pod has it. A sandbox whose template its pod lists without an agent
    /// (the probe) is refused here, as the embedded service refuses it,
    /// before any wake.
    pub(super) async fn tunnel(
        &self,
        id: &SandboxId,
        f: &mut (dyn FnMut(&AgentLink) -> Result<(), GuestError> + Send),
    ) -> Result<Outcome, ServiceError> {
        let (sandbox, pod) = self.pod_of(id).await?;
        let kind = self.db.template_kind(&pod.id, &sandbox.template).await?;
        if let Some(kind) = kind.filter(|k| *k != TemplateKind::Linux) {
            return Err(GuestError::NoAgent {
                id: id.to_string(),
                kind,
            }
            .into());
        }
        let dial = torpor_gate::pods::tunnel::dialer(self.rt.clone(), pod.line.clone(), id.clone());
        let link = AgentLink::dialed(id.as_str(), format!("pod {}", pod.id), dial);
        // The agent's calls block (the tunnel's connection is dialed on
        // the runtime).
        blocking(|| f(&link)).map_err(ServiceError::Guest)?;
        let value = pod.fetch("GET", &Self::sandbox_path(id), None).await?;
        Ok(Outcome {
            sandbox: self.pod_answer(&pod, value).await?,
            resumed: false,
            resume_ms: None,
        })
    }

    /// One call on the sandbox's agent through the tunnel.
    pub(super) async fn guest_call<T: Send>(
        &self,
        id: &SandboxId,
        call: impl FnOnce(&AgentLink) -> Result<T, GuestError> + Send,
    ) -> Result<GuestCall<T>, ServiceError> {
        let mut one = torpor_gate::calls::OneCall::new(call);
        let outcome = self.tunnel(id, &mut |link| one.run(link)).await?;
        one.finish(outcome)
    }

    /// A command run through the tunnel (`/v1` exec is relayed to the pod
    /// whole; this serves the other callers): the sandbox's environment
    /// under the request's, and the replica's request timeout when the
    /// request names none.
    pub(super) async fn exec_through_tunnel(
        &self,
        id: &SandboxId,
        mut req: ExecRequest,
        cancel: &Cancel,
        mode: ExecMode<'_>,
    ) -> Result<GuestCall<ExecReply>, ServiceError> {
        let (sandbox, _) = self.pod_of(id).await?;
        let mut env = sandbox.env.clone();
        env.append(&mut req.env);
        req.env = env;
        if req.timeout_ms.is_none_or(|t| t == 0) {
            req.timeout_ms =
                Some(u64::try_from(self.config.io_timeout.as_millis()).unwrap_or(u64::MAX));
        }
        Ok(match mode {
            ExecMode::Collect => map_call(
                self.guest_call(id, |link| link.exec(req, cancel)).await?,
                ExecReply::Collected,
            ),
            ExecMode::Stream {
                on_start,
                on_output,
            } => {
                let started = Outcome {
                    sandbox,
                    resumed: false,
                    resume_ms: None,
                };
                let call = self
                    .guest_call(id, |link| {
                        on_start(&started);
                        link.exec_streaming(req, cancel, on_output)
                    })
                    .await?;
                map_call(call, ExecReply::Streamed)
            }
        })
    }

    /// A template of the sandbox's state, on its pod.
    pub(super) async fn snapshot_on_pod(
        &self,
        id: &SandboxId,
        req: &TemplateFromSandbox,
    ) -> Result<Template, ServiceError> {
        let (_, pod) = self.pod_of(id).await?;
        let body = serde_json::to_value(req).map_err(|e| ServiceError::Internal(e.to_string()))?;
        let path = format!("{}/template", Self::sandbox_path(id));
        let value = pod.fetch("POST", &path, Some(&body)).await?;
        let template: Template = serde_json::from_value(value).map_err(|e| ServiceError::Pod {
            status: 502,
            code: code::POD_UNREACHABLE.into(),
            message: format!("pod {}: its answer is not a template ({e})", pod.id),
        })?;
        let deadline = Instant::now() + LISTED_WITHIN;
        while self
            .db
            .template_kind(&pod.id, &template.id)
            .await?
            .is_none()
        {
            if Instant::now() >= deadline {
                tracing::warn!(pod = %pod.id, template = %template.id, "a snapshot not listed yet");
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(template)
    }

    /// Templates made from sandboxes (from `source` only, if given), as
    /// the pods up list them.
    pub(super) async fn snapshots(
        &self,
        source: Option<&SandboxId>,
    ) -> Result<Vec<(Template, SandboxId)>, ServiceError> {
        let listed = self.db.templates(self.config.down_after).await?;
        Ok(listed
            .into_iter()
            .filter_map(|v| serde_json::from_value::<Template>(v).ok())
            .filter(|t| t.state != TemplateState::Deleted)
            .filter_map(|t| t.source.clone().map(|from| (t, from)))
            .filter(|(_, from)| source.is_none_or(|s| s == from))
            .collect())
    }
}
