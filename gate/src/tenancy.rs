//! Tenancy's means, which [`crate::gate`] applies: admission against a
//! tenant's quotas, what a tenant sees of an answer, and the per-token
//! limits on expensive routes.
//!
//! - [`redact`] removes host paths and process ids (`vmm`, `snapshot`,
//!   `snapshot_dir`, `kernel`, `rootfs`) from a tenant's JSON answers;
//!   admins see them (the `torpor` CLI shows them to operators).
//! - [`Limiter`]: per token, at most `concurrent` expensive requests at
//!   once and `per_second` of them on average (bursts of `burst`); past
//!   either, 429 `rate_limited` with `Retry-After`. Admin tokens are not
//!   limited.
//! - [`Traffic`]: what the guest-port proxy (`crate::ports`) counted per
//!   sandbox, on `/metrics`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{to_bytes, Body};
use axum::extract::Request;
use axum::http::header;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde_json::Value;
use torpor_scheduler::model::{MountedVolume, Sandbox, SandboxId, SandboxState};
use torpor_sync::Locked;

use crate::auth::{Auth, Principal};
use crate::backend::SandboxApi;
use crate::error::{code, ApiError};
use crate::quota::{Quotas, Ticket, Usage};
use crate::service::ServiceError;

/// Requests and bytes through the guest-port proxy (`crate::ports`), per
/// sandbox (kept for the life
/// of the API process).
#[derive(Debug, Default)]
pub struct Traffic {
    requests: Family<[(&'static str, String); 1], Counter>,
    /// Bytes sent to the guest's port (requests, upgraded streams).
    pub to_guest: Family<[(&'static str, String); 1], Counter>,
    /// Bytes the guest's port sent back.
    pub from_guest: Family<[(&'static str, String); 1], Counter>,
}

impl Traffic {
    pub fn label(id: &SandboxId) -> [(&'static str, String); 1] {
        [("sandbox", id.to_string())]
    }

    pub fn request(&self, id: &SandboxId) {
        self.requests.get_or_create(&Self::label(id)).inc();
    }

    /// The Prometheus text of the counters (appended to `/metrics`).
    pub fn encode(&self) -> String {
        let mut reg = prometheus_client::registry::Registry::default();
        for (name, help, family) in [
            (
                "torpor_sandbox_port_requests",
                "Requests proxied to a guest port, by sandbox",
                &self.requests,
            ),
            (
                "torpor_sandbox_port_rx_bytes",
                "Bytes proxied to a guest port (requests and upgraded streams), by sandbox",
                &self.to_guest,
            ),
            (
                "torpor_sandbox_port_tx_bytes",
                "Bytes a guest port answered through the proxy, by sandbox",
                &self.from_guest,
            ),
        ] {
            reg.register(name, help, family.clone());
        }
        let mut out = String::new();
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &reg);
        out
    }
}

/// Per-token limits on expensive routes (create, exec, checkpoint, fork,
/// template build).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// At most this many at once per token.
    pub concurrent: usize,
    /// Sustained rate per token.
    pub per_second: f64,
    /// Requests a token may make at once after being idle.
    pub burst: u32,
    /// Long requests (exec and envd streams) a tenant may hold open at
    /// once ([`crate::streams`]).
    pub streams_per_tenant: usize,
}

impl Default for RateLimit {
    fn default() -> Self {
        RateLimit {
            concurrent: 16,
            per_second: 10.0,
            burst: 40,
            streams_per_tenant: crate::streams::DEFAULT_PER_TENANT,
        }
    }
}

struct Bucket {
    tokens: f64,
    last: Instant,
    in_flight: usize,
}

/// The per-token limiter.
pub struct Limiter {
    limit: RateLimit,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The buckets are keyed by token: not printed.
        f.debug_struct("Limiter")
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

/// One admitted expensive request; its slot is freed on drop.
pub struct Permit {
    limiter: Arc<Limiter>,
    key: String,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is the caller's token: not printed.
        f.debug_struct("Permit").finish_non_exhaustive()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut b = self.limiter.buckets.locked();
        if let Some(bucket) = b.get_mut(&self.key) {
            bucket.in_flight = bucket.in_flight.saturating_sub(1);
        }
    }
}

impl Limiter {
    pub fn new(limit: RateLimit) -> Arc<Self> {
        Arc::new(Limiter {
            limit,
            buckets: Mutex::new(HashMap::new()),
        })
    }

    /// A slot for `principal`'s token, or how long to wait. Admins pass.
    pub fn acquire(self: &Arc<Self>, principal: &Principal) -> Result<Option<Permit>, Duration> {
        if principal.is_admin() {
            return Ok(None);
        }
        let now = Instant::now();
        let burst = f64::from(self.limit.burst.max(1));
        let mut buckets = self.buckets.locked();
        let b = buckets.entry(principal.token.clone()).or_insert(Bucket {
            tokens: burst,
            last: now,
            in_flight: 0,
        });
        let rate = self.limit.per_second.max(0.001);
        b.tokens = (b.tokens + now.duration_since(b.last).as_secs_f64() * rate).min(burst);
        b.last = now;
        if b.in_flight >= self.limit.concurrent.max(1) {
            return Err(Duration::from_secs(1));
        }
        if b.tokens < 1.0 {
            return Err(Duration::from_secs_f64((1.0 - b.tokens) / rate));
        }
        b.tokens -= 1.0;
        b.in_flight += 1;
        Ok(Some(Permit {
            limiter: Arc::clone(self),
            key: principal.token.clone(),
        }))
    }
}

/// A rate-limit refusal: 429 `rate_limited` with `Retry-After` (whole
/// seconds, at least 1).
#[derive(Debug)]
pub struct Limited(pub Duration);

impl From<Limited> for ApiError {
    fn from(l: Limited) -> Self {
        let secs = l.0.as_secs_f64().ceil().max(1.0) as u64;
        ApiError {
            retry_after: Some(secs),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                code::RATE_LIMITED,
                format!("too many expensive requests from this token; retry in {secs} s"),
            )
        }
    }
}

/// What [`crate::gate`] and the create handlers need.
#[derive(Debug)]
pub struct Tenancy<S> {
    pub service: Arc<S>,
    pub auth: Auth,
    pub quotas: Arc<Quotas>,
    pub limiter: Arc<Limiter>,
    /// Slots of long requests, per tenant.
    pub streams: Arc<crate::streams::Streams>,
    /// Requests and bytes through the guest-port proxy.
    pub traffic: Arc<Traffic>,
    /// Template builds and their uploaded files.
    pub builds: Arc<crate::build_registry::Builds>,
    /// E2B's volumes.
    pub volumes: Arc<crate::volumes::Volumes>,
    /// The domain of guest ports' host names (`ApiConfig::proxy_domain`,
    /// lowercase, no trailing dot).
    pub domain: Option<Arc<str>>,
}

impl<S> Clone for Tenancy<S> {
    fn clone(&self) -> Self {
        Tenancy {
            service: Arc::clone(&self.service),
            auth: self.auth.clone(),
            quotas: Arc::clone(&self.quotas),
            limiter: Arc::clone(&self.limiter),
            streams: Arc::clone(&self.streams),
            traffic: Arc::clone(&self.traffic),
            builds: Arc::clone(&self.builds),
            volumes: Arc::clone(&self.volumes),
            domain: self.domain.clone(),
        }
    }
}

/// Admits `asked` for `principal`'s tenant. Admins are counted too:
/// quotas are per tenant, whoever asks.
pub async fn admit<S: SandboxApi>(
    t: &Tenancy<S>,
    principal: &Principal,
    asked: Usage,
) -> Result<Option<Ticket>, ServiceError> {
    let quota = t.auth.quota(&principal.tenant);
    t.quotas
        .admit(&*t.service, &principal.tenant, &quota, asked)
        .await
}

/// Admits `req`, a create of a sandbox from a template (id or name), for
/// `principal`'s tenant: the volumes it mounts are resolved to the
/// tenant's (`req.volumes`, the only place they are set; a name the
/// tenant has no volume of is 404), and its memory is looked up only when
/// the tenant's memory is limited. The quota is not checked here when the
/// service admits its creates itself ([`SandboxApi::admits_creates`]).
pub async fn admit_create<S: SandboxApi>(
    t: &Tenancy<S>,
    principal: &Principal,
    service: &S,
    req: &mut crate::service::CreateSandbox,
) -> Result<Option<Ticket>, ServiceError> {
    torpor_scheduler::service::mounts::check_requests(&req.volume_mounts)?;
    if req.id.is_some() && !principal.is_admin() {
        return Err(ServiceError::Forbidden(
            "a sandbox's id is chosen by the server: giving one needs an admin token".into(),
        ));
    }
    // A mount with an id was resolved by the server in front of this pod,
    // which calls it with the pod's admin token (for the tenant, or for
    // itself): taken as it says. A tenant's token never gives ids.
    if req.volume_mounts.iter().any(|m| m.id.is_some()) && !principal.is_admin() {
        return Err(ServiceError::Forbidden(
            "a volume mount's id is set by the server in front of a pod: giving one needs \
             an admin token"
                .into(),
        ));
    }
    let by_name: Vec<_> = req
        .volume_mounts
        .iter()
        .filter(|m| m.id.is_none())
        .cloned()
        .collect();
    let mut resolved = t
        .volumes
        .resolve_mounts(&principal.owner().tenant, &by_name)
        .map_err(|e| match e {
            crate::volumes::VolumeError::NotFound(name) => ServiceError::NotFound {
                kind: "volume",
                id: name,
            },
            other => ServiceError::Invalid(other.to_string()),
        })?
        .into_iter();
    req.volumes = req
        .volume_mounts
        .iter()
        .filter_map(|m| match &m.id {
            Some(id) => Some(MountedVolume {
                id: id.clone(),
                name: m.name.clone(),
                path: m.path.clone(),
            }),
            None => resolved.next(),
        })
        .collect();
    if !req.volumes.is_empty() && !service.mounts_volumes() {
        return Err(ServiceError::Invalid(crate::volumes::NO_MOUNTS.into()));
    }
    let template = req.template.as_str();
    if service.admits_creates() {
        return Ok(None);
    }
    let limited = t.auth.quota(&principal.tenant).memory_mib.is_some();
    let mem = if limited {
        template_mem(service, principal, template).await
    } else {
        0
    };
    admit(t, principal, Usage::sandbox(mem)).await
}

/// Admits waking `sandbox` if it is hibernated; see [`wakes`].
pub async fn admit_wake<S: SandboxApi>(
    t: &Tenancy<S>,
    principal: &Principal,
    sandbox: &Sandbox,
) -> Result<Option<Ticket>, ServiceError> {
    if sandbox.state != SandboxState::Hibernated {
        return Ok(None);
    }
    admit(t, principal, Usage::wake(u64::from(sandbox.mem_mib))).await
}

/// Where the service admits wakes itself ([`SandboxApi::admits_wakes`]): a
/// guest call on `sandbox`, hibernated, of a tenant with a quota
/// (`limited`) wakes it first through the service (admitted there, 429
/// past the quota, and the sandbox stays hibernated). No ticket: the
/// service counts it.
pub async fn wake_first<S: SandboxApi>(
    service: &S,
    limited: bool,
    sandbox: &Sandbox,
) -> Result<Option<Ticket>, ServiceError> {
    if limited && sandbox.state == SandboxState::Hibernated {
        service
            .lifecycle(&sandbox.id, crate::backend::Lifecycle::Connect)
            .await?;
    }
    Ok(None)
}

/// Memory of the template `key` (id or name) names for `principal`; 0 if
/// none (the create then answers 404 itself).
async fn template_mem<S: SandboxApi>(s: &S, principal: &Principal, key: &str) -> u64 {
    s.resolve_template(&principal.owner(), key)
        .await
        .map_or(0, |t| u64::from(t.mem_mib))
}

/// Keys of host paths and processes in the API's JSON answers.
const HOST_KEYS: &[&str] = &["vmm", "snapshot", "snapshot_dir", "kernel", "rootfs"];

/// Largest JSON answer [`redact`] rewrites (lists are paginated well below).
const MAX_REDACTED: usize = 32 << 20;

fn strip(v: &mut Value) {
    match v {
        Value::Object(map) => {
            for k in HOST_KEYS {
                map.remove(*k);
            }
            // A sandbox's metadata is the client's own.
            map.iter_mut()
                .filter(|(k, _)| k.as_str() != "metadata")
                .for_each(|(_, v)| strip(v));
        }
        Value::Array(items) => items.iter_mut().for_each(strip),
        _ => {}
    }
}

/// Route layer inside [`crate::auth::require`]: a tenant's JSON answers
/// without host paths or pids (see the module documentation).
pub async fn redact(request: Request, next: Next) -> Response {
    let admin = request
        .extensions()
        .get::<Principal>()
        .is_none_or(Principal::is_admin);
    let response = next.run(request).await;
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/json"));
    if admin || !json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = match to_bytes(body, MAX_REDACTED).await {
        Ok(b) => b,
        Err(_) => return ApiError::internal("answer too large").into_response(),
    };
    let out = match serde_json::from_slice::<Value>(&bytes) {
        Ok(mut v) => {
            strip(&mut v);
            v.to_string().into_bytes()
        }
        Err(_) => bytes.to_vec(),
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(token: &str) -> Principal {
        Principal::new("t", crate::auth::Scope::Tenant, token)
    }

    #[test]
    fn limiter_bounds_concurrency_and_rate_per_token() {
        let l = Limiter::new(RateLimit {
            concurrent: 2,
            per_second: 0.5,
            burst: 3,
            ..RateLimit::default()
        });
        let a = tenant("a");
        let p1 = l.acquire(&a).unwrap();
        let _p2 = l.acquire(&a).unwrap();
        assert!(l.acquire(&a).is_err(), "third at once");
        // Another token has its own slots.
        let _b = l.acquire(&tenant("b")).unwrap();
        drop(p1);
        let _p3 = l.acquire(&a).unwrap();
        // Burst of 3 used: the next waits about 2 s (0.5/s).
        drop(_p3);
        let wait = l.acquire(&a).expect_err("rate");
        assert!(wait > Duration::from_millis(1500), "{wait:?}");
        let admin = Principal::new("admin", crate::auth::Scope::Admin, "a");
        assert!(l.acquire(&admin).unwrap().is_none());
    }

    #[test]
    fn strip_removes_host_keys_everywhere() {
        let mut v = serde_json::json!({"sandboxes": [{"id": "sbx_1", "vmm": {"pid": 5},
            "snapshot": "/data/x", "metadata": {"kernel": "k"}}], "kernel": "/boot/x"});
        strip(&mut v);
        assert_eq!(
            v,
            serde_json::json!({"sandboxes": [{"id": "sbx_1", "metadata": {"kernel": "k"}}]})
        );
    }
}
