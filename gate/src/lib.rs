//! The one gate every surface of torpor's API reaches sandboxes through,
//! and what those surfaces share: the backend contract as the API holds it
//! ([`SandboxApi`], its typed calls and the one dispatch of operations),
//! tokens and tenants ([`auth`]), quotas ([`quota`]), rate and stream
//! limits and the tenancy checks ([`tenancy`], [`gate`]), the JSON errors
//! ([`error`]), the handlers' plumbing ([`handlers`]: the state, the
//! blocking call), the remote pods and the relay ([`pods`], [`relay`]),
//! template builds ([`builds`]) and the limits every request shares
//! ([`limits`]).
//!
//! The surfaces are crates above this one: `/v1` (torpor-api, which also
//! assembles the server) and E2B's API, envd and the guest-port router
//! (torpor-e2b). A route of either reaches a sandbox only through
//! [`gate::sandbox`] or the [`tenancy`] checks it wraps.
//!
//! Its modules import each other one way (tests/layering.rs): `service`,
//! `error`, `calls` and `volumes` (E2B's volumes) at the bottom, then `wire`, `pods`, `pagination`,
//! `streams` and `request_context`, `backend`, `quota`, `auth`, `tenancy`,
//! `gate` and `handlers`, then `builds` and `relay`.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::MethodFilter;

pub mod auth;
pub mod backend;
pub mod body;
pub mod build_registry;
pub mod builds;
pub mod calls;
pub mod error;
pub mod gate;
pub mod handlers;
pub mod pagination;
pub mod pods;
pub mod quota;
pub mod relay;
pub mod request_context;
pub mod secrets;
pub mod service;
pub mod streams;
pub mod tenancy;
pub mod tls;
pub mod volumes;
pub mod wire;

pub use backend::dispatch::dispatch;
pub use backend::typed::SandboxCalls;
pub use backend::{Lifecycle, SandboxApi};
pub use calls::{ExecMode, ExecReply, FileOp, FileReply, TemplateOp, TemplateReply};
pub use error::ApiError;
pub use handlers::AppState;

/// How the API runs. `Debug` shows how many tokens there are, not them.
#[derive(Clone)]
pub struct ApiConfig {
    /// Admin bearer tokens (tenant `admin`) from the command line or a
    /// pod's token file. With no tokens file either, every authenticated
    /// route answers 401 (fail closed).
    pub tokens: Vec<String>,
    /// The tokens file (`DATA_DIR/tenants.json`): tenants' and admins'
    /// tokens, stored hashed, and the tenants' quotas.
    pub tenants_file: Option<std::path::PathBuf>,
    /// The tokens and quotas, made already (a cluster replica's, in
    /// PostgreSQL: [`auth::Auth::shared`]); then `tokens` and
    /// `tenants_file` are not read.
    pub auth: Option<auth::Auth>,
    /// Largest image upload (`PUT /v1/images/{name}/{part}`).
    pub max_upload_bytes: u64,
    /// Per-token limits on expensive routes.
    pub rate_limit: tenancy::RateLimit,
    /// Largest request body; bigger is 413 (checked on `Content-Length`
    /// before reading, and while reading).
    pub max_body_bytes: usize,
    /// Longest a request may take, body and service call included; past it
    /// the answer is 504. The service call itself runs on to its end (its
    /// result is in the store): read the resource to see it.
    pub request_timeout: Duration,
    /// The domain of guest ports' host names, `{port}-{id}.{domain}`
    /// ([`ports`]): what E2B's create and connect answers carry as
    /// `domain`. `None`: ports by E2B's headers only, `domain` null.
    pub proxy_domain: Option<String>,
    /// Where template builds keep their records and uploaded files
    /// (`DATA_DIR/builds`); `None`: in memory, files in a temporary
    /// directory.
    pub builds_dir: Option<std::path::PathBuf>,
    /// The guest kernel (`vmlinux`) templates built from OCI images boot
    /// (`torpor serve`: its built-in Linux template's). Without it, and
    /// [`ApiConfig::guest_agent`], a build from an image is 501.
    pub guest_kernel: Option<std::path::PathBuf>,
    /// The static torpor-agent put into templates built from OCI images.
    pub guest_agent: Option<std::path::PathBuf>,
    /// An extra CA (PEM) the registries builds pull from are checked
    /// against, besides the system's roots (a private registry's).
    pub registry_ca: Option<std::path::PathBuf>,
    /// Registries (`host` or `host:port`, as image references name them)
    /// builds may pull from although they resolve to addresses that are
    /// not global (loopback, a private network): every other such
    /// registry is refused, so that a tenant cannot make the server reach
    /// what only it reaches.
    pub private_registries: Vec<String>,
    /// Free space (MiB) a template built from an OCI image has in its root
    /// filesystem, past its content and 30% of it: room for its build's
    /// steps.
    pub image_headroom_mib: u64,
    /// Where E2B's volumes are kept (`DATA_DIR/volumes`,
    /// [`volumes::Volumes`]); `None`: no volume is made.
    pub volumes_dir: Option<std::path::PathBuf>,
    /// How many volumes a tenant has and how big each is.
    pub volume_limits: volumes::Limits,
}

/// Default [`ApiConfig::image_headroom_mib`]: 512 MiB.
pub const DEFAULT_IMAGE_HEADROOM_MIB: u64 = 512;

/// Default [`ApiConfig::max_upload_bytes`]: 8 GiB.
pub const DEFAULT_MAX_UPLOAD_BYTES: u64 = 8 << 30;
/// Default [`ApiConfig::max_body_bytes`]: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;
/// Default [`ApiConfig::request_timeout`]: long enough for a template build.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

impl std::fmt::Debug for ApiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiConfig")
            .field("tokens", &format_args!("[{} redacted]", self.tokens.len()))
            .field("tenants_file", &self.tenants_file)
            .field("auth", &self.auth)
            .field("max_upload_bytes", &self.max_upload_bytes)
            .field("rate_limit", &self.rate_limit)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("request_timeout", &self.request_timeout)
            .field("proxy_domain", &self.proxy_domain)
            .field("builds_dir", &self.builds_dir)
            .field("guest_kernel", &self.guest_kernel)
            .field("guest_agent", &self.guest_agent)
            .field("registry_ca", &self.registry_ca)
            .field("private_registries", &self.private_registries)
            .field("image_headroom_mib", &self.image_headroom_mib)
            .field("volumes_dir", &self.volumes_dir)
            .field("volume_limits", &self.volume_limits)
            .finish()
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            tokens: Vec::new(),
            tenants_file: None,
            auth: None,
            max_upload_bytes: DEFAULT_MAX_UPLOAD_BYTES,
            rate_limit: tenancy::RateLimit::default(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            proxy_domain: None,
            builds_dir: None,
            guest_kernel: None,
            guest_agent: None,
            registry_ca: None,
            private_registries: Vec::new(),
            image_headroom_mib: DEFAULT_IMAGE_HEADROOM_MIB,
            volumes_dir: None,
            volume_limits: volumes::Limits::default(),
        }
    }
}

/// One route: method, path (axum syntax, as in the OpenAPI document), the
/// OpenAPI `operationId`, whether it needs a bearer token, and whether
/// that token must be an admin's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub operation: &'static str,
    pub auth: bool,
    pub admin: bool,
    /// What the gate checks and admits before the handler ([`gate`]).
    pub gate: gate::Gated,
}

impl Route {
    /// The route's `{id}` is a sandbox, reached through the gate, which
    /// admits `cost`.
    pub const fn sandbox(mut self, cost: gate::Admit) -> Route {
        self.gate = gate::Gated::Sandbox(cost);
        self
    }
}

pub const fn route(method: &'static str, path: &'static str, operation: &'static str) -> Route {
    Route {
        method,
        path,
        operation,
        auth: true,
        admin: false,
        gate: gate::Gated::No,
    }
}

pub fn method_filter(method: &str) -> MethodFilter {
    match method {
        "GET" => MethodFilter::GET,
        "POST" => MethodFilter::POST,
        "PUT" => MethodFilter::PUT,
        "PATCH" => MethodFilter::PATCH,
        "DELETE" => MethodFilter::DELETE,
        other => panic!("route table names unknown method {other:?}"),
    }
}

/// Limits every request shares: `max_body_bytes` (image uploads:
/// `max_upload_bytes`) and `request_timeout`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_body_bytes: usize,
    pub max_upload_bytes: u64,
    pub request_timeout: Duration,
}

impl Limits {
    pub fn of(config: &ApiConfig) -> Self {
        Limits {
            max_body_bytes: config.max_body_bytes,
            max_upload_bytes: config.max_upload_bytes,
            request_timeout: config.request_timeout,
        }
    }
}

/// Whether `path` is an upload (its own size limit, no timeout): an
/// image's, or a file of an E2B volume's (whose size its volume bounds).
pub fn is_upload(method: &Method, path: &str) -> bool {
    method == Method::PUT
        && (path.starts_with("/v1/images/") || path.starts_with("/volumecontent/"))
}

/// 413 `payload_too_large` for a body over `limit` bytes.
pub fn too_large(limit: u64) -> Response {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        error::code::PAYLOAD_TOO_LARGE,
        format!("request body is larger than the limit of {limit} bytes"),
    )
    .into_response()
}

pub async fn limits(State(limits): State<Limits>, request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let upload = is_upload(request.method(), request.uri().path());
    let limit = if upload {
        limits.max_upload_bytes
    } else {
        limits.max_body_bytes as u64
    };
    if declared.is_some_and(|n| n > limit) {
        return too_large(limit);
    }
    if upload {
        // Streamed to disk at its own pace, capped by size.
        return next.run(request).await;
    }
    let method: Method = request.method().clone();
    let path = request.uri().path().to_string();
    match tokio::time::timeout(limits.request_timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            tracing::warn!(%method, %path, "request timed out");
            ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                error::code::TIMEOUT,
                format!(
                    "the request took longer than {:?}; an operation it started may still \
                     complete: read the resource to see its state",
                    limits.request_timeout
                ),
            )
            .into_response()
        }
    }
}

/// The builds of `config`'s directory; in memory if it cannot be opened
/// (logged). Templates from OCI images get `config`'s kernel and agent.
pub fn builds_of(config: &ApiConfig) -> builds::Builds {
    let builds = builds::Builds::open(config.builds_dir.as_deref()).unwrap_or_else(|e| {
        tracing::error!(error = %e, "the builds directory cannot be opened: builds kept in memory");
        builds::Builds::open(None).expect("a temporary directory for build files")
    });
    builds.with_guest(builds::image::Guest {
        kernel: config.guest_kernel.clone(),
        agent: config.guest_agent.clone(),
        registry_ca: config.registry_ca.clone(),
        private_registries: config.private_registries.clone(),
        headroom_mib: config.image_headroom_mib,
    })
}

/// The volumes of `config`'s directory; none if it cannot be opened
/// (logged).
pub fn volumes_of(config: &ApiConfig) -> volumes::Volumes {
    match &config.volumes_dir {
        None => volumes::Volumes::none(),
        Some(dir) => volumes::Volumes::open(dir.clone(), config.volume_limits).unwrap_or_else(|e| {
            tracing::error!(error = %e, dir = %dir.display(), "the volumes directory cannot be opened: no volumes");
            volumes::Volumes::none()
        }),
    }
}

/// The tokens (command line and tokens file), quotas and rate limits the
/// routes share.
pub fn tenancy_of<S: SandboxApi>(service: &Arc<S>, config: &ApiConfig) -> tenancy::Tenancy<S> {
    let auth = match config.auth.clone().map_or_else(
        || auth::Auth::new(&config.tokens, config.tenants_file.clone()),
        Ok,
    ) {
        Ok(a) => a,
        Err(e) => {
            // Fail closed: an unreadable tokens file accepts no token of it.
            tracing::error!(error = %e, "the tokens file cannot be read: only command-line tokens are accepted");
            auth::Auth::new(&config.tokens, None).expect("no file to read")
        }
    };
    if auth.is_empty() {
        tracing::warn!("no API tokens configured: every authenticated route answers 401");
    }
    tenancy::Tenancy {
        service: Arc::clone(service),
        auth: auth.clone(),
        quotas: Arc::new(quota::Quotas::default()),
        limiter: tenancy::Limiter::new(config.rate_limit),
        streams: streams::Streams::new(
            config.rate_limit.streams_per_tenant,
            streams::DEFAULT_TOTAL,
        ),
        traffic: Arc::default(),
        builds: Arc::new(builds_of(config)),
        volumes: Arc::new(volumes_of(config)),
        domain: config
            .proxy_domain
            .as_deref()
            .map(|d| Arc::from(d.trim_end_matches('.').to_ascii_lowercase())),
    }
}
