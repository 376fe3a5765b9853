//! torpor's REST API: axum routes over the sandbox service.
//!
//! [`router`] builds the app from [`ROUTES`] (the one list of routes, also
//! checked against the OpenAPI document in `api/openapi.json`, served at
//! `/v1/openapi.json`); [`serve`] runs it on a listener until a shutdown
//! future completes. The service is reached through [`SandboxApi`]
//! (implemented for `torpor_scheduler::service::Service`), on tokio's
//! blocking pool.
//!
//! Every route but `/healthz` and `/v1/openapi.json` needs
//! `Authorization: Bearer <token>` ([`auth`]). Every error, the service's
//! and axum's own, is one JSON body ([`error`]):
//! `{"error": {"code": "...", "message": "...", "state": "..."}}`.
//!
//! | cause                                      | status | code                     |
//! |--------------------------------------------|--------|--------------------------|
//! | bad JSON (syntax, types, unknown fields), bad query, `Invalid`, bad exec body (empty argv, bad base64), relative file path, agent `EINVAL`/`EISDIR`/`ENOTDIR`/`ENAMETOOLONG`/`ELOOP` | 400 | `invalid_request` |
//! | missing or wrong bearer token              | 401    | `unauthorized`           |
//! | agent `EACCES`/`EPERM`/`EROFS`             | 403    | `forbidden`              |
//! | `NotFound`, unknown route, agent `ENOENT`  | 404    | `not_found`              |
//! | wrong method on a known route              | 405    | `method_not_allowed`     |
//! | `Conflict` (illegal transition; `state`), agent `EEXIST`/`ENOTEMPTY`/`EBUSY`/`ETXTBSY` | 409 | `conflict` |
//! | `ResourceConflict` (template in use, name taken) | 409 | `conflict`         |
//! | body over `max_body_bytes`, file over the read limit, agent `EFBIG` | 413 | `payload_too_large` |
//! | JSON body without `application/json`       | 415    | `unsupported_media_type` |
//! | exec or files on a sandbox without an agent (probe) | 422 | `no_agent`        |
//! | `Admission` (pod past its ratio)           | 429    | `admission_refused`      |
//! | `Internal`, a panicking service call       | 500    | `internal`               |
//! | `Unsupported` (e.g. a Linux template on a PVM host) | 501 | `unsupported`     |
//! | agent unreachable (guest gone), other agent errors, failed post-restore hook | 502 | `agent_error` |
//! | a remote pod that does not answer (the federation) | 502 | `pod_unreachable` |
//! | a remote pod's own error answer            | its status | its code     |
//! | a template still coming (`serve --nested-pod` booting) | 503 | `unavailable` |
//! | request past `request_timeout`             | 504    | `timeout`                |

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::serve::ListenerExt;
use axum::Router;

pub mod auth;
pub mod backend;
mod checkpoint_routes;
pub mod client;
pub mod e2b;
pub mod error;
pub mod federation;
pub mod guest_routes;
mod handlers;
pub mod openapi;
pub mod service;
pub mod wire;

pub use backend::SandboxApi;
pub use error::ApiError;

use handlers::AppState;

/// How the API runs. `Debug` shows how many tokens there are, not them.
#[derive(Clone)]
pub struct ApiConfig {
    /// Bearer tokens accepted on every authenticated route. Empty: every
    /// authenticated route answers 401 (fail closed).
    pub tokens: Vec<String>,
    /// Largest request body; bigger is 413 (checked on `Content-Length`
    /// before reading, and while reading).
    pub max_body_bytes: usize,
    /// Longest a request may take, body and service call included; past it
    /// the answer is 504. The service call itself runs on to its end (its
    /// result is in the store): read the resource to see it.
    pub request_timeout: Duration,
}

/// Default [`ApiConfig::max_body_bytes`]: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;
/// Default [`ApiConfig::request_timeout`]: long enough for a template build.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

impl std::fmt::Debug for ApiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiConfig")
            .field("tokens", &format_args!("[{} redacted]", self.tokens.len()))
            .field("max_body_bytes", &self.max_body_bytes)
            .field("request_timeout", &self.request_timeout)
            .finish()
    }
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            tokens: Vec::new(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }
}

/// One route: method, path (axum syntax, as in the OpenAPI document), the
/// OpenAPI `operationId`, and whether it needs a bearer token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub operation: &'static str,
    pub auth: bool,
}

const fn route(method: &'static str, path: &'static str, operation: &'static str) -> Route {
    Route {
        method,
        path,
        operation,
        auth: true,
    }
}

const fn public(method: &'static str, path: &'static str, operation: &'static str) -> Route {
    Route {
        method,
        path,
        operation,
        auth: false,
    }
}

/// Every route the API serves. The router is built from this list and the
/// OpenAPI document is checked against it.
pub const ROUTES: &[Route] = &[
    public("GET", "/healthz", "health"),
    public("GET", "/v1/openapi.json", "openapi"),
    route("GET", "/metrics", "metrics"),
    route("GET", "/v1/templates", "listTemplates"),
    route("POST", "/v1/templates", "createTemplate"),
    route("GET", "/v1/templates/{id}", "getTemplate"),
    route("DELETE", "/v1/templates/{id}", "deleteTemplate"),
    route("GET", "/v1/sandboxes", "listSandboxes"),
    route("POST", "/v1/sandboxes", "createSandbox"),
    route("GET", "/v1/sandboxes/{id}", "getSandbox"),
    route("PATCH", "/v1/sandboxes/{id}", "updateSandbox"),
    route("DELETE", "/v1/sandboxes/{id}", "deleteSandbox"),
    route("POST", "/v1/sandboxes/{id}/pause", "pauseSandbox"),
    route("POST", "/v1/sandboxes/{id}/resume", "resumeSandbox"),
    route("POST", "/v1/sandboxes/{id}/connect", "connectSandbox"),
    route("POST", "/v1/sandboxes/{id}/hibernate", "hibernateSandbox"),
    route("GET", "/v1/sandboxes/{id}/checkpoints", "listCheckpoints"),
    route("POST", "/v1/sandboxes/{id}/checkpoints", "createCheckpoint"),
    route(
        "DELETE",
        "/v1/sandboxes/{id}/checkpoints/{name}",
        "deleteCheckpoint",
    ),
    route("POST", "/v1/sandboxes/{id}/restore", "restoreSandbox"),
    route("POST", "/v1/sandboxes/{id}/fork", "forkSandbox"),
    route("POST", "/v1/sandboxes/{id}/template", "templateFromSandbox"),
    route("POST", "/v1/sandboxes/{id}/exec", "execSandbox"),
    route(
        "POST",
        "/v1/sandboxes/{id}/exec/stream",
        "execSandboxStream",
    ),
    route("GET", "/v1/sandboxes/{id}/files", "readFile"),
    route("PUT", "/v1/sandboxes/{id}/files", "writeFile"),
    route("GET", "/v1/sandboxes/{id}/files/list", "listFiles"),
    route("GET", "/v1/pods", "listPods"),
    route("POST", "/v1/pods", "addPod"),
    route("PATCH", "/v1/pods/{id}", "updatePod"),
    route("DELETE", "/v1/pods/{id}", "removePod"),
];

/// The handler of an operation, for the given method.
fn endpoint<S: SandboxApi>(operation: &str, m: MethodFilter) -> MethodRouter<AppState<S>> {
    use handlers::*;
    match operation {
        "health" => on(m, health),
        "openapi" => on(m, openapi),
        "metrics" => on(m, metrics::<S>),
        "listTemplates" => on(m, list_templates::<S>),
        "createTemplate" => on(m, create_template::<S>),
        "getTemplate" => on(m, get_template::<S>),
        "deleteTemplate" => on(m, delete_template::<S>),
        "listSandboxes" => on(m, list_sandboxes::<S>),
        "createSandbox" => on(m, create_sandbox::<S>),
        "getSandbox" => on(m, get_sandbox::<S>),
        "updateSandbox" => on(m, update_sandbox::<S>),
        "deleteSandbox" => on(m, delete_sandbox::<S>),
        "pauseSandbox" => on(m, pause_sandbox::<S>),
        "resumeSandbox" => on(m, resume_sandbox::<S>),
        "connectSandbox" => on(m, connect_sandbox::<S>),
        "hibernateSandbox" => on(m, hibernate_sandbox::<S>),
        "listCheckpoints" => on(m, checkpoint_routes::list::<S>),
        "createCheckpoint" => on(m, checkpoint_routes::create::<S>),
        "deleteCheckpoint" => on(m, checkpoint_routes::delete::<S>),
        "restoreSandbox" => on(m, checkpoint_routes::restore::<S>),
        "forkSandbox" => on(m, checkpoint_routes::fork::<S>),
        "templateFromSandbox" => on(m, checkpoint_routes::template::<S>),
        "execSandbox" => on(m, guest_routes::exec::<S>),
        "execSandboxStream" => on(m, guest_routes::exec_stream::<S>),
        "readFile" => on(m, guest_routes::read_file::<S>),
        "writeFile" => on(m, guest_routes::write_file::<S>),
        "listFiles" => on(m, guest_routes::list_files::<S>),
        "listPods" => on(m, list_pods::<S>),
        "updatePod" => on(m, update_pod::<S>),
        "addPod" => on(m, add_pod::<S>),
        "removePod" => on(m, remove_pod::<S>),
        other => panic!("route table names unknown operation {other:?}"),
    }
}

pub(crate) fn method_filter(method: &str) -> MethodFilter {
    match method {
        "GET" => MethodFilter::GET,
        "POST" => MethodFilter::POST,
        "PUT" => MethodFilter::PUT,
        "PATCH" => MethodFilter::PATCH,
        "DELETE" => MethodFilter::DELETE,
        other => panic!("route table names unknown method {other:?}"),
    }
}

/// Limits every request shares: `max_body_bytes` and `request_timeout`.
#[derive(Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_body_bytes: usize,
    pub(crate) request_timeout: Duration,
}

impl Limits {
    fn of(config: &ApiConfig) -> Self {
        Limits {
            max_body_bytes: config.max_body_bytes,
            request_timeout: config.request_timeout,
        }
    }
}

pub(crate) async fn limits(State(limits): State<Limits>, request: Request, next: Next) -> Response {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        return ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            error::code::PAYLOAD_TOO_LARGE,
            format!(
                "request body is larger than the limit of {} bytes",
                limits.max_body_bytes
            ),
        )
        .into_response();
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

/// The API as an axum router.
pub fn router<S: SandboxApi>(service: Arc<S>, config: ApiConfig) -> Router {
    let tokens = auth::Tokens::new(&config.tokens);
    if tokens.is_empty() {
        tracing::warn!("no API tokens configured: every authenticated route answers 401");
    }
    let mut app: Router<AppState<S>> = Router::new();
    for r in ROUTES {
        let mut endpoint = endpoint::<S>(r.operation, method_filter(r.method));
        if federation::routing::forwards(r) {
            // Inside the auth layer: only authenticated requests are
            // forwarded (with the pod's own token).
            endpoint = endpoint.route_layer(middleware::from_fn_with_state(
                Arc::clone(&service),
                federation::routing::forward::<S>,
            ));
        }
        if r.auth {
            endpoint = endpoint.route_layer(middleware::from_fn_with_state(
                tokens.clone(),
                auth::require,
            ));
        }
        app = app.route(r.path, endpoint);
    }
    let limits_state = Limits::of(&config);
    let e2b = e2b::router(Arc::clone(&service), tokens, limits_state);
    app.fallback(error::no_route)
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .layer(middleware::from_fn_with_state(limits_state, limits))
        .layer(middleware::from_fn(error::normalize))
        .with_state(AppState { service })
        .merge(e2b)
}

/// The E2B routes alone ([`e2b`]), for a listener of their own
/// (`torpor serve --e2b-listen`): unknown paths are 404 in E2B's shape.
pub fn e2b_router<S: SandboxApi>(service: Arc<S>, config: ApiConfig) -> Router {
    let tokens = auth::Tokens::new(&config.tokens);
    e2b::router(service, tokens, Limits::of(&config)).fallback(e2b::no_route)
}

/// Serves the API on `listener` until `shutdown` completes, then lets
/// requests in flight finish.
pub async fn serve<S, F>(
    listener: tokio::net::TcpListener,
    service: Arc<S>,
    config: ApiConfig,
    shutdown: F,
) -> std::io::Result<()>
where
    S: SandboxApi,
    F: Future<Output = ()> + Send + 'static,
{
    let app = router(service, config);
    let listener = listener.tap_io(|stream| {
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, "TCP_NODELAY");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Serves [`e2b_router`] on `listener` until `shutdown` completes.
pub async fn serve_e2b<S, F>(
    listener: tokio::net::TcpListener,
    service: Arc<S>,
    config: ApiConfig,
    shutdown: F,
) -> std::io::Result<()>
where
    S: SandboxApi,
    F: Future<Output = ()> + Send + 'static,
{
    axum::serve(listener, e2b_router(service, config))
        .with_graceful_shutdown(shutdown)
        .await
}

/// [`serve`] on a unix socket (a `torpor pod` reached by a `torpor serve`
/// on the same host). Access is the bearer token, as over TCP; the socket
/// file's mode is the umask's.
pub async fn serve_unix<S, F>(
    listener: tokio::net::UnixListener,
    service: Arc<S>,
    config: ApiConfig,
    shutdown: F,
) -> std::io::Result<()>
where
    S: SandboxApi,
    F: Future<Output = ()> + Send + 'static,
{
    axum::serve(listener, router(service, config))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_table_is_well_formed() {
        let mut seen = std::collections::BTreeSet::new();
        for r in ROUTES {
            assert!(
                seen.insert((r.method, r.path)),
                "{} {} twice",
                r.method,
                r.path
            );
            assert!(r.path.starts_with("/v1/") || !r.auth || r.path == "/metrics");
            method_filter(r.method);
        }
        let public: Vec<_> = ROUTES.iter().filter(|r| !r.auth).map(|r| r.path).collect();
        assert_eq!(public, ["/healthz", "/v1/openapi.json"]);
    }

    #[test]
    fn config_debug_hides_tokens() {
        let config = ApiConfig {
            tokens: vec!["s3cret".into()],
            ..ApiConfig::default()
        };
        let text = format!("{config:?}");
        assert!(!text.contains("s3cret"), "{text}");
        assert!(text.contains("1 redacted"), "{text}");
    }
}
