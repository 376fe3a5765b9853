//! torpor's REST API (`/v1`) and the server that assembles every surface.
//!
//! The crates, bottom up: the contract (torpor-sandbox-api), the gate
//! every surface reaches sandboxes through (torpor-gate: the backend as
//! the API holds it, tokens, tenants, quotas, rate limits, the tenancy
//! checks, errors, builds, the remote pods), E2B's API, envd and the
//! guest-port router (torpor-e2b), and this crate: `/v1`'s routes and
//! OpenAPI document, the nested pod ([`nested`]) and the assembly
//! ([`Api`]). The gate's modules are re-exported here under their names.
//!
//! [`router`] builds the app from [`ROUTES`] (the one list of routes, also
//! the paths of the OpenAPI document, [`openapi`], served at
//! `/v1/openapi.json`); [`serve`] runs it on a listener until a shutdown
//! future completes. The service is reached through [`SandboxApi`], async
//! (implemented for `torpor_scheduler::service::Service`, whose blocking
//! calls run on tokio's blocking pool: `torpor_gate::backend`).
//!
//! Its modules import each other one way (tests/layering.rs): the routes
//! (`*_routes`), then `openapi` and `nested`.
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
//! | `Unsupported` (the backend lacks the feature)      | 501 | `unsupported`     |
//! | `HostUnsupported` (a Linux template on a PVM host) | 422 | `host_unsupported` |
//! | `InvalidSpec` (a template build's value the build cannot use) | 422 | `invalid_spec` |
//! | agent unreachable (guest gone), other agent errors, failed post-restore hook | 502 | `agent_error` |
//! | another pod that does not answer (the nested pod, a cluster's) | 502 | `pod_unreachable` |
//! | a remote pod's own error answer            | its status | its code     |
//! | a template still coming (`serve --nested-pod` booting), a hibernation that needs a guest agent that does not answer | 503 | `unavailable` |
//! | `GuestUnresponsive` (a restoring wake of memory kept while the guest agent did not answer) | 409 | `guest_unresponsive` |
//! | request past `request_timeout`             | 504    | `timeout`                |
//! | `Accepted` (a cluster's command past `--cluster-wait-ms`) | 202 | the operation, `Location: /v1/operations/{id}` |

#![forbid(unsafe_code)]

use std::future::Future;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::serve::ListenerExt;
use axum::Router;

mod admin_routes;
pub mod agent_tunnel;
mod build_routes;
mod checkpoint_routes;
pub mod guest_routes;
pub mod history_routes;
pub mod nested;
mod network_routes;
pub mod openapi;
mod sandbox_routes;

// What every surface shares, the gate first (torpor-gate); the modules
// are named here as before the split, so `torpor_api::auth` and the
// routes' `crate::handlers` paths still hold.
pub use torpor_gate::{
    auth, backend, build_registry, builds, calls, error, gate, pagination, pods, quota, relay,
    request_context, service, streams, tenancy, tls, volumes, wire,
};
use torpor_gate::{body, handlers};
pub use torpor_gate::{
    builds_of, limits, method_filter, route, tenancy_of, too_large, ApiConfig, Limits, Route,
    DEFAULT_IMAGE_HEADROOM_MIB, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_REQUEST_TIMEOUT,
};
// E2B's API, envd and the guest-port router (torpor-e2b).
pub use torpor_e2b as e2b;
pub use torpor_e2b::ports;

pub use torpor_gate::dispatch;
pub use torpor_gate::ApiError;
pub use torpor_gate::SandboxCalls;
pub use torpor_gate::{ExecMode, ExecReply, FileOp, FileReply, TemplateOp, TemplateReply};
pub use torpor_gate::{Lifecycle, SandboxApi};

use handlers::AppState;

/// A route only admin tokens may use (403 `forbidden` for tenants).
const fn admin(method: &'static str, path: &'static str, operation: &'static str) -> Route {
    Route {
        method,
        path,
        operation,
        auth: true,
        admin: true,
        gate: gate::Gated::No,
    }
}

const fn public(method: &'static str, path: &'static str, operation: &'static str) -> Route {
    Route {
        method,
        path,
        operation,
        auth: false,
        admin: false,
        gate: gate::Gated::No,
    }
}

/// Every route the API serves. The router and the OpenAPI document's paths
/// are built from this list.
pub const ROUTES: &[Route] = &[
    public("GET", "/healthz", "health"),
    public("GET", "/v1/openapi.json", "openapi"),
    admin("GET", "/metrics", "metrics"),
    route("GET", "/v1/templates", "listTemplates"),
    route("POST", "/v1/templates", "createTemplate"),
    route("GET", "/v1/templates/{id}", "getTemplate"),
    route("PATCH", "/v1/templates/{id}", "renameTemplate"),
    route("GET", "/v1/builds", "listBuilds"),
    route("POST", "/v1/builds", "createBuild"),
    route("GET", "/v1/builds/{id}", "getBuild"),
    route("POST", "/v1/builds/{id}/cancel", "cancelBuild"),
    route("GET", "/v1/build-files/{hash}", "getBuildFiles"),
    route("PUT", "/v1/build-files/{hash}", "uploadBuildFiles"),
    route("DELETE", "/v1/templates/{id}", "deleteTemplate"),
    route("GET", "/v1/sandboxes", "listSandboxes"),
    route("POST", "/v1/sandboxes", "createSandbox"),
    route("GET", "/v1/sandboxes/{id}", "getSandbox").sandbox(gate::Admit::Plain),
    route("PATCH", "/v1/sandboxes/{id}", "updateSandbox").sandbox(gate::Admit::Plain),
    route("DELETE", "/v1/sandboxes/{id}", "deleteSandbox").sandbox(gate::Admit::Plain),
    route("POST", "/v1/sandboxes/{id}/pause", "pauseSandbox").sandbox(gate::Admit::Plain),
    route("POST", "/v1/sandboxes/{id}/resume", "resumeSandbox").sandbox(gate::Admit::Resume),
    route("POST", "/v1/sandboxes/{id}/connect", "connectSandbox").sandbox(gate::Admit::Resume),
    route("POST", "/v1/sandboxes/{id}/hibernate", "hibernateSandbox").sandbox(gate::Admit::Plain),
    route("GET", "/v1/sandboxes/{id}/checkpoints", "listCheckpoints").sandbox(gate::Admit::Plain),
    route("POST", "/v1/sandboxes/{id}/checkpoints", "createCheckpoint")
        .sandbox(gate::Admit::Snapshot),
    route(
        "DELETE",
        "/v1/sandboxes/{id}/checkpoints/{name}",
        "deleteCheckpoint",
    )
    .sandbox(gate::Admit::Plain),
    route("POST", "/v1/sandboxes/{id}/restore", "restoreSandbox").sandbox(gate::Admit::Wake),
    route("POST", "/v1/sandboxes/{id}/fork", "forkSandbox").sandbox(gate::Admit::Fork),
    route("POST", "/v1/sandboxes/{id}/template", "templateFromSandbox")
        .sandbox(gate::Admit::Template),
    route("POST", "/v1/sandboxes/{id}/exec", "execSandbox").sandbox(gate::Admit::Exec),
    route(
        "POST",
        "/v1/sandboxes/{id}/exec/stream",
        "execSandboxStream",
    )
    .sandbox(gate::Admit::Exec),
    route("GET", "/v1/sandboxes/{id}/files", "readFile").sandbox(gate::Admit::Wake),
    route("PUT", "/v1/sandboxes/{id}/files", "writeFile").sandbox(gate::Admit::Wake),
    route("GET", "/v1/sandboxes/{id}/files/list", "listFiles").sandbox(gate::Admit::Wake),
    route(
        "PATCH",
        "/v1/sandboxes/{id}/network",
        "updateSandboxNetwork",
    )
    .sandbox(gate::Admit::Plain),
    route("GET", "/v1/sandboxes/{id}/metrics", "sandboxMetrics").sandbox(gate::Admit::Plain),
    route("GET", "/v1/sandboxes/{id}/ports", "listPorts").sandbox(gate::Admit::Plain),
    route("POST", "/v1/sandboxes/{id}/ports", "exposePort").sandbox(gate::Admit::Plain),
    route(
        "DELETE",
        "/v1/sandboxes/{id}/ports/{guest_port}",
        "unexposePort",
    )
    .sandbox(gate::Admit::Plain),
    // The agent protocol through a pod, for the API server in front of it
    // (pod token).
    admin("POST", "/v1/sandboxes/{id}/agent", "agentTunnel").sandbox(gate::Admit::Plain),
    admin("GET", "/v1/pods", "listPods"),
    admin("GET", "/v1/pods/{id}", "getPod"),
    admin("PATCH", "/v1/pods/{id}", "updatePod"),
    route("GET", "/v1/images", "listImages"),
    // Admin only, checked in the handler: the body is streamed, and the
    // check must come before any of it is read.
    route("PUT", "/v1/images/{name}/{part}", "uploadImage"),
    admin("DELETE", "/v1/images/{name}", "deleteImage"),
    admin("GET", "/v1/tokens", "listTokens"),
    admin("POST", "/v1/tokens", "createToken"),
    admin("DELETE", "/v1/tokens/{id}", "deleteToken"),
    route("GET", "/v1/tenants/{tenant}", "getTenant"),
    route("GET", "/v1/operations/{id}", "getOperation"),
    admin("PUT", "/v1/tenants/{tenant}/quota", "setQuota"),
];

/// The handler of a lifecycle call, for the given method.
fn lifecycle<S: SandboxApi>(m: MethodFilter, op: Lifecycle) -> MethodRouter<AppState<S>> {
    on(
        m,
        move |st: handlers::Api<S>, id: axum::extract::Path<String>| {
            sandbox_routes::lifecycle_sandbox(st, id, op)
        },
    )
}

/// The handler of an operation, for the given method.
fn endpoint<S: SandboxApi>(operation: &str, m: MethodFilter) -> MethodRouter<AppState<S>> {
    use sandbox_routes::*;
    match operation {
        "health" => on(m, health),
        "openapi" => on(m, openapi::get),
        "metrics" => on(m, metrics::<S>),
        "listTemplates" => on(m, list_templates::<S>),
        "createTemplate" => on(m, build_routes::create_template::<S>),
        "getTemplate" => on(m, get_template::<S>),
        "deleteTemplate" => on(m, delete_template::<S>),
        "renameTemplate" => on(m, rename_template::<S>),
        "listBuilds" => on(m, build_routes::list::<S>),
        "createBuild" => on(m, build_routes::create::<S>),
        "getBuild" => on(m, build_routes::get::<S>),
        "cancelBuild" => on(m, build_routes::cancel::<S>),
        "getBuildFiles" => on(m, build_routes::files_present::<S>),
        "uploadBuildFiles" => on(m, build_routes::upload::<S>),
        "listSandboxes" => on(m, list_sandboxes::<S>),
        "createSandbox" => on(m, create_sandbox::<S>),
        "getSandbox" => on(m, get_sandbox::<S>),
        "updateSandbox" => on(m, update_sandbox::<S>),
        "deleteSandbox" => on(m, delete_sandbox::<S>),
        "pauseSandbox" => lifecycle(m, Lifecycle::Pause),
        "resumeSandbox" => lifecycle(m, Lifecycle::Resume),
        "connectSandbox" => on(m, sandbox_routes::connect_sandbox::<S>),
        "hibernateSandbox" => on(m, sandbox_routes::hibernate_sandbox::<S>),
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
        "updateSandboxNetwork" => on(m, network_routes::update_policy::<S>),
        "sandboxMetrics" => on(m, history_routes::get::<S>),
        "listPorts" => on(m, network_routes::list_ports::<S>),
        "exposePort" => on(m, network_routes::expose_port::<S>),
        "unexposePort" => on(m, network_routes::unexpose_port::<S>),
        "agentTunnel" => on(m, agent_tunnel::serve::<S>),
        "listPods" => on(m, list_pods::<S>),
        "getPod" => on(m, get_pod::<S>),
        "updatePod" => on(m, update_pod::<S>),
        "listImages" => on(m, admin_routes::list_images::<S>),
        "uploadImage" => on(m, admin_routes::upload_image::<S>),
        "deleteImage" => on(m, admin_routes::delete_image::<S>),
        "listTokens" => on(m, admin_routes::list_tokens::<S>),
        "createToken" => on(m, admin_routes::create_token::<S>),
        "deleteToken" => on(m, admin_routes::delete_token::<S>),
        "getTenant" => on(m, admin_routes::get_tenant::<S>),
        "getOperation" => on(m, get_operation::<S>),
        "setQuota" => on(m, admin_routes::set_quota::<S>),
        other => panic!("route table names unknown operation {other:?}"),
    }
}

/// The API of one service: its tokens, quotas and rate limits, built once
/// and shared by every listener of that service (`/v1` and E2B's routes on
/// the API's listener, and E2B's alone on `serve --e2b-listen`): a token
/// made, a quota set or a rate spent on one listener holds on every other.
#[derive(Debug)]
pub struct Api<S> {
    service: Arc<S>,
    config: ApiConfig,
    tenancy: tenancy::Tenancy<S>,
}

impl<S> Clone for Api<S> {
    fn clone(&self) -> Self {
        Api {
            service: Arc::clone(&self.service),
            config: self.config.clone(),
            tenancy: self.tenancy.clone(),
        }
    }
}

impl<S: SandboxApi> Api<S> {
    pub fn new(service: Arc<S>, config: ApiConfig) -> Self {
        let tenancy = tenancy_of(&service, &config);
        if let Some(pod) = service.service() {
            // Traffic to an exposed port wakes through the gate too.
            pod.set_wake_gate(Arc::new(gate::PortWakes {
                service: Arc::downgrade(&service),
                auth: tenancy.auth.clone(),
                quotas: Arc::clone(&tenancy.quotas),
            }));
        }
        Api {
            service,
            config,
            tenancy,
        }
    }

    /// Builds shared template `name` from `spec` as the service's operator
    /// (the command line's admin token), through the same checks, backend
    /// and admission as `POST /v1/builds` with an admin token, its ready
    /// check waited for up to `ready`: the service's own templates (the
    /// nested pod's `code-interpreter-v1`). The build, to follow.
    pub async fn build_shared(
        &self,
        name: &str,
        spec: torpor_build::spec::BuildSpec,
        ready: std::time::Duration,
    ) -> Result<Arc<build_registry::Build>, service::ServiceError> {
        use torpor_gate::builds::{run, start};
        start::check_name(name)?;
        let p = auth::Principal::new(auth::ADMIN_TENANT, auth::Scope::Admin, "command-line");
        let t = &self.tenancy;
        let prepared = start::prepare(t, &p, spec, name, None).await?;
        let build = t.builds.begin(None, name, vec!["default".into()]);
        let limits = run::Limits {
            ready,
            ..run::Limits::default()
        };
        start::start_within(t, &p, &build, prepared, limits);
        Ok(build)
    }

    /// The API as an axum router: `/v1` and E2B's routes.
    pub fn router(&self) -> Router {
        let (service, config, tenancy) = (Arc::clone(&self.service), &self.config, &self.tenancy);
        let auth = tenancy.auth.clone();
        let mut app: Router<AppState<S>> = Router::new();
        for r in ROUTES {
            let mut endpoint = endpoint::<S>(r.operation, method_filter(r.method));
            // Layers run outside in: auth, admin, redaction, the sandbox's
            // ownership (and quotas, limits), forwarding to a remote pod.
            if relay::forwards(r) {
                // Inside the auth layer: only authenticated requests are
                // forwarded (with the pod's own token).
                endpoint = endpoint.route_layer(middleware::from_fn_with_state(
                    (Arc::clone(&service), config.max_body_bytes),
                    relay::forward::<S>,
                ));
            }
            if let gate::Gated::Sandbox(cost) = r.gate {
                endpoint = endpoint.route_layer(middleware::from_fn_with_state(
                    (tenancy.clone(), cost),
                    gate::sandbox::<S>,
                ));
            }
            if r.auth {
                endpoint = endpoint.route_layer(middleware::from_fn(tenancy::redact));
                if r.admin {
                    endpoint = endpoint.route_layer(middleware::from_fn(auth::admin_only));
                }
                endpoint = endpoint
                    .route_layer(middleware::from_fn_with_state(auth.clone(), auth::require));
            }
            app = app.route(r.path, endpoint);
        }
        let limits_state = Limits::of(config);
        let e2b = e2b::router(Arc::clone(&service), tenancy.clone(), limits_state);
        let app = app
            .fallback(error::no_route)
            .layer(DefaultBodyLimit::max(config.max_body_bytes))
            .layer(middleware::from_fn_with_state(limits_state, limits))
            .layer(middleware::from_fn(error::normalize))
            .with_state(AppState {
                service,
                tenancy: tenancy.clone(),
                max_upload_bytes: config.max_upload_bytes,
            })
            .merge(e2b);
        self.with_ports(app)
    }

    /// `inner` behind the guest-port router ([`ports`]): a request for a
    /// guest port (by E2B's headers or host name) is proxied before any
    /// route of `inner` sees it.
    fn with_ports(&self, inner: Router) -> Router {
        let ports = ports::Ports {
            tenancy: self.tenancy.clone(),
        };
        Router::new()
            .fallback_service(inner)
            .layer(middleware::from_fn_with_state(ports, ports::route::<S>))
    }

    /// The guest-port router alone with envd and E2B's routes behind it
    /// (`torpor serve --proxy-listen`): `{port}-{id}.{domain}` is
    /// proxied, `49983-{id}.{domain}` is envd.
    pub fn proxy_router(&self) -> Router {
        self.e2b_router()
    }

    /// The E2B routes alone ([`e2b`]), for a listener of their own
    /// (`torpor serve --e2b-listen`): unknown paths are 404 in E2B's shape.
    pub fn e2b_router(&self) -> Router {
        let app = e2b::router(
            Arc::clone(&self.service),
            self.tenancy.clone(),
            Limits::of(&self.config),
        )
        .fallback(e2b::no_route);
        self.with_ports(app)
    }
}

/// The API of `service` as an axum router, with tokens, quotas and limits
/// of its own: a server with more than one listener uses one [`Api`].
pub fn router<S: SandboxApi>(service: Arc<S>, config: ApiConfig) -> Router {
    Api::new(service, config).router()
}

/// Serves `app` on `listener` until `shutdown` completes, then lets
/// requests in flight finish.
pub async fn serve_app<F>(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: F,
) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let listener = listener.tap_io(|stream| {
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, "TCP_NODELAY");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// [`serve_app`] over TLS with `identity`'s certificate.
pub async fn serve_tls_app<F>(
    listener: tokio::net::TcpListener,
    identity: &tls::Identity,
    app: Router,
    shutdown: F,
) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    serve_tls_offering(listener, identity, false, app, shutdown).await
}

/// [`serve_tls_app`] offering HTTP/2 by ALPN beside HTTP/1.1 (the
/// guest-port proxy's listener, `serve --proxy-listen --proxy-tls`: the
/// SDKs' httpx and browsers ask for it).
pub async fn serve_tls_app_h2<F>(
    listener: tokio::net::TcpListener,
    identity: &tls::Identity,
    app: Router,
    shutdown: F,
) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    serve_tls_offering(listener, identity, true, app, shutdown).await
}

/// `app` over TLS with `identity`'s certificate, offering `h2` by ALPN
/// when `h2` is set.
async fn serve_tls_offering<F>(
    listener: tokio::net::TcpListener,
    identity: &tls::Identity,
    h2: bool,
    app: Router,
    shutdown: F,
) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let mut server = identity
        .server_config()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    if h2 {
        let mut offering = (*server).clone();
        offering.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        server = Arc::new(offering);
    }
    let listener = tls::TlsListener::new(listener, server)?;
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
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
    serve_app(listener, router(service, config), shutdown).await
}

/// [`serve`] over TLS with `identity`'s certificate (a pod on a
/// non-loopback address, or the API with `--tls`).
pub async fn serve_tls<S, F>(
    listener: tokio::net::TcpListener,
    identity: &tls::Identity,
    service: Arc<S>,
    config: ApiConfig,
    shutdown: F,
) -> std::io::Result<()>
where
    S: SandboxApi,
    F: Future<Output = ()> + Send + 'static,
{
    serve_tls_app(listener, identity, router(service, config), shutdown).await
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
    fn e2b_routes_are_apart_from_ours() {
        for r in e2b::ROUTES {
            assert!(
                !ROUTES.iter().any(|o| o.path == r.path),
                "{} is also a torpor route",
                r.path
            );
        }
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
