//! E2B's in-sandbox API ("envd"), which the SDKs reach at
//! `E2B_SANDBOX_URL` with the sandbox named by the `E2b-Sandbox-Id` header:
//! plain HTTP (`GET /health`, `/files`) and Connect-protocol RPCs
//! (`/process.Process/*`, `/filesystem.Filesystem/*`), translated to
//! torpor-agent. Served on the API's listener (its paths do not overlap
//! `/v1` or E2B's control plane) and on `--e2b-listen`.
//!
//! Done: `GET /health`, `GET /files` and `POST /files` ([`files`], gzip
//! both ways: [`encoding`]), the Connect envelope codec ([`envelope`]), and the RPCs
//! of `process.Process` ([`process`]) and `filesystem.Filesystem`
//! ([`filesystem`]) in Connect's JSON ([`json`]), unary and
//! server-streaming ([`rpc`]) and client-streaming (`StreamInput`:
//! [`client_stream`]), on the agent's protocol 1.2. Everything but
//! `/health` takes the sandbox's access token (`X-Access-Token`, issued at
//! create as `envdAccessToken`) or an API key of its tenant. See
//! `docs/e2b.md`.

use std::sync::Arc;

use axum::extract::{Extension, Path, Request};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Serialize;
use torpor_scheduler::model::SandboxId;

use super::error::E2bError;
use super::wire::e2b_state;
use torpor_gate::auth::Auth;
use torpor_gate::backend::{wait, SandboxApi};
use torpor_gate::handlers::{call, Api, AppState};
use torpor_gate::service::ServiceError;

pub mod client_stream;
pub mod encoding;
pub mod envelope;
pub mod files;
pub mod filesystem;
pub mod json;
pub mod process;
pub mod rpc;

/// The header naming the sandbox a request is for.
pub const SANDBOX_HEADER: &str = "e2b-sandbox-id";
/// Content type of Connect's streaming calls (enveloped JSON).
pub const CONNECT_STREAM_JSON: &str = "application/connect+json";

/// Connect's error codes, with the HTTP status a unary call answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    /// The HTTP status of a unary error (Connect's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A Connect error answer: for a unary call its status and
/// `{"code", "message"}`; for a streaming call 200 and an end-of-stream
/// envelope carrying it (Connect's rule for streams).
pub fn connect_error(streaming: bool, error: envelope::ConnectError) -> Response {
    if streaming {
        let body = envelope::end_stream(Some(&error)).encode();
        let mut r = (StatusCode::OK, body).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(CONNECT_STREAM_JSON),
        );
        r
    } else {
        (error.code.http_status(), axum::Json(&error)).into_response()
    }
}

/// The sandbox a request names, or why not (400 without the header).
fn sandbox_of(headers: &HeaderMap) -> Result<String, E2bError> {
    headers
        .get(SANDBOX_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
        .ok_or_else(|| E2bError::bad_request("missing E2b-Sandbox-Id header"))
}

/// What `/health` answers for a sandbox that does not run (E2B's proxy's
/// message for a sandbox it cannot route to).
const NOT_FOUND: &str = "The sandbox was not found";

/// `GET /health`: 204 when the sandbox runs and the caller may use it
/// (its access token or an API key of its tenant, as every envd route);
/// 502 (what E2B's proxy answers and the SDKs' `is_running` reads as
/// false) when it is paused, unknown, gone, or not the caller's to see:
/// health tells nobody else whether an id exists. It does not wake a
/// paused sandbox.
async fn health<S: SandboxApi>(
    state: Api<S>,
    Extension(auth): Extension<Auth>,
    headers: HeaderMap,
) -> Response {
    let id = match sandbox_of(&headers) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let caller = files::Caller::of(&headers, &auth);
    let running = call(&state, move |s| async move {
        let s = &*s;
        match files::target(s, &id, &caller).await? {
            Ok(id) => Ok(s
                .get_sandbox(&id)
                .await
                .ok()
                .is_some_and(|x| e2b_state(x.state) == Some("running") && x.vmm.is_some())),
            Err(_) => Ok(false),
        }
    })
    .await;
    match running {
        Ok(true) => StatusCode::NO_CONTENT.into_response(),
        // E2B's proxy's words for a sandbox it cannot route to: the SDKs
        // read "was not found" in a 502 as the sandbox gone (a command
        // broken off by a kill then says so), anything else as unknown.
        Ok(false) => E2bError::new(StatusCode::BAD_GATEWAY, NOT_FOUND).into_response(),
        Err(e) => E2bError::from(e).into_response(),
    }
}

/// The Connect services of envd.
pub const SERVICES: &[&str] = &["process.Process", "filesystem.Filesystem"];

/// An envd RPC: the caller must show the sandbox's access token (or an
/// API key of its tenant); the sandbox is woken if hibernated; the work is
/// [`rpc::handle`]'s.
async fn rpc<S: SandboxApi>(
    state: Api<S>,
    auth: Auth,
    service: &'static str,
    method: String,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    let headers = parts.headers;
    let streaming = rpc::is_streaming(&headers);
    let refuse = |code: Code, message: String| {
        connect_error(streaming, envelope::ConnectError { code, message })
    };
    let id = match sandbox_of(&headers) {
        Ok(id) => id,
        Err(e) => return refuse(Code::InvalidArgument, e.message),
    };
    let caller = files::Caller::of(&headers, &auth);
    let shown = id.clone();
    let tenancy = state.tenancy.clone();
    let found = call(&state, move |s| async move {
        let s = &*s;
        match files::target(s, &shown, &caller).await? {
            Ok(id) => {
                let sandbox = s.get_sandbox(&id).await?;
                let wake = wake_ticket(s, &tenancy, &id).await?;
                Ok(Ok((
                    id,
                    sandbox.env,
                    sandbox.tenant,
                    wake,
                    sandbox.template,
                )))
            }
            Err(refused) => Ok(Err(refused)),
        }
    })
    .await;
    let (sandbox, env, owner, wake, template) = match found {
        Ok(Ok(found)) => found,
        Ok(Err(files::Refused::Gone)) => {
            return refuse(Code::NotFound, format!("sandbox {id} was not found"))
        }
        Ok(Err(files::Refused::Unauthorized)) => {
            return refuse(
                Code::Unauthenticated,
                "missing or wrong X-Access-Token (or X-API-KEY)".into(),
            )
        }
        Err(e) => return refuse(code_of(e.status.as_u16()), e.message),
    };
    // A streaming call holds a slot of the sandbox's tenant for as long as
    // it streams, on a thread of its own (`torpor_gate::streams`).
    let slot = if rpc::method_kind(service, &method).is_some_and(|k| k != rpc::Kind::Unary) {
        let tenant = owner.as_deref().unwrap_or(torpor_gate::auth::ADMIN_TENANT);
        match state.tenancy.streams.take(tenant) {
            Ok(slot) => Some(slot),
            Err(e) => return refuse(Code::ResourceExhausted, e.message),
        }
    } else {
        None
    };
    let mut ctx = match rpc::CallContext::from_headers(id, &headers, env) {
        Ok(ctx) => ctx,
        Err(e) => return connect_error(streaming, e),
    };
    // A built template's sandboxes start where its build ended: its last
    // WORKDIR and USER are their processes' defaults, as on E2B.
    if let Some(last) = state.tenancy.builds.guest_defaults(template.as_str()) {
        ctx.workdir = last.workdir;
        ctx.default_user = Some(last.user.split(':').next().unwrap_or("user").to_string());
    }
    let service_arc = Arc::clone(&state.0.service);
    let (service_gone, gone_id) = (Arc::clone(&service_arc), sandbox.clone());
    // Both run on the call's blocking thread.
    ctx.gone = rpc::Gone::new(move || {
        wait(service_gone.get_sandbox(&gone_id)).map_or(true, |s| {
            matches!(
                s.state,
                torpor_scheduler::state::SandboxState::Deleted
                    | torpor_scheduler::state::SandboxState::Failed
                    | torpor_scheduler::state::SandboxState::Lost
            )
        })
    });
    // The wake's admission is held for as long as the call runs.
    let wake = std::sync::Mutex::new(wake);
    let runner: rpc::Runner = Arc::new(move |f| {
        let _held = &wake;
        wait(service_arc.with_guest(&sandbox, f))
            .map(drop)
            .map_err(service_error)
    });
    rpc::handle(runner, ctx, service, &method, &headers, body, slot).await
}

/// Admits waking sandbox `id` against its tenant's quotas if it is
/// hibernated (an envd call wakes it as `/v1` exec and files do): held
/// until the call is done; 429 `quota_exceeded` at the quota.
pub(crate) async fn wake_ticket<S: SandboxApi>(
    s: &S,
    tenancy: &torpor_gate::tenancy::Tenancy<S>,
    id: &SandboxId,
) -> Result<Option<torpor_gate::quota::Ticket>, ServiceError> {
    let Some(tenant) = s.sandbox_tenant(id).await? else {
        return Ok(None);
    };
    let sandbox = s.get_sandbox(id).await?;
    if s.admits_wakes() {
        let limited = tenancy.auth.quota(&tenant) != torpor_gate::quota::Quota::default();
        return torpor_gate::tenancy::wake_first(s, limited, &sandbox).await;
    }
    let principal =
        torpor_gate::auth::Principal::new(tenant, torpor_gate::auth::Scope::Tenant, "envd");
    torpor_gate::tenancy::admit_wake(tenancy, &principal, &sandbox).await
}

/// A service failure (unknown sandbox, failed wake, guest error) as
/// Connect's error.
fn service_error(e: ServiceError) -> envelope::ConnectError {
    if let ServiceError::Guest(g) = e {
        return rpc::guest_error(g);
    }
    let e2b = E2bError::from(e);
    envelope::ConnectError {
        code: code_of(e2b.code),
        message: e2b.message,
    }
}

/// Connect's code for an HTTP status of ours.
fn code_of(status: u16) -> Code {
    match status {
        400 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::NotFound,
        409 => Code::FailedPrecondition,
        413 | 429 => Code::ResourceExhausted,
        501 => Code::Unimplemented,
        502 | 503 => Code::Unavailable,
        504 => Code::DeadlineExceeded,
        _ => Code::Internal,
    }
}

/// The envd routes.
pub(crate) fn router<S: SandboxApi>(
    service: Arc<S>,
    tenancy: torpor_gate::tenancy::Tenancy<S>,
    limits: torpor_gate::Limits,
) -> Router {
    // `AppState` for `health`; the RPC routes need none.
    // Files need the sandbox's access token or the API key (see `files`).
    let files = get(files::download::<S>)
        .post(files::upload::<S>)
        .layer::<_, std::convert::Infallible>(axum::Extension(tenancy.auth.clone()))
        .layer(axum::Extension(files::BodyLimit(limits.max_body_bytes)));
    let mut app = Router::new()
        .route(
            "/health",
            get(health::<S>).layer(axum::Extension(tenancy.auth.clone())),
        )
        .route("/files", files);
    for &name in SERVICES {
        let auth = tenancy.auth.clone();
        app = app.route(
            &format!("/{name}/{{method}}"),
            post(
                move |state: Api<S>, Path(method): Path<String>, request: Request| {
                    rpc(state, auth.clone(), name, method, request)
                },
            ),
        );
    }
    app.with_state(AppState {
        service,
        tenancy,
        max_upload_bytes: limits.max_upload_bytes,
    })
}
