//! One error body everywhere: `{"error": {"code", "message", "state"?}}`.
//!
//! [`ApiError`] is what handlers return; [`From<ServiceError>`] is the
//! service-to-HTTP mapping (the table in the crate docs), and
//! [`normalize`] is a last-line middleware that rewrites any error response
//! axum produced on its own (405, a path that did not decode, ...) into the
//! same body, so a client never has to parse two error shapes.

use axum::body::{to_bytes, Body};
use axum::extract::Request;
use axum::http::header::{self, HeaderValue};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use torpor_scheduler::model::SandboxState;

use crate::service::{GuestError, ServiceError};

/// Error codes: the `code` field of every error body (the contract's).
pub use torpor_sandbox_api::code;

/// A VMM's classified failure as an answer. The VMM's message (host
/// paths in it) goes to the log; the client gets the kind and, for a bad
/// snapshot, the layer's name.
fn vm_error(e: &torpor_vmm_api::VmError) -> ApiError {
    use torpor_vmm_api::ErrorKind as K;
    tracing::warn!(kind = %e.kind, layer = ?e.layer, "VMM failure: {}", e.message);
    let layer = e
        .layer
        .as_deref()
        .and_then(|l| l.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "?".into());
    let (status, code, message) = match e.kind {
        K::InvalidRequest => (
            StatusCode::BAD_REQUEST,
            code::INVALID_REQUEST,
            "the VMM refused the request as invalid".to_string(),
        ),
        K::NotPaused | K::WrongState => (
            StatusCode::CONFLICT,
            code::CONFLICT,
            format!("the VM is in the wrong state for this ({})", e.kind),
        ),
        K::NoSpace => (
            StatusCode::INSUFFICIENT_STORAGE,
            code::INSUFFICIENT_STORAGE,
            "the pod's disk is full: the snapshot could not be written".to_string(),
        ),
        K::BadSnapshot => (
            StatusCode::INTERNAL_SERVER_ERROR,
            code::BAD_SNAPSHOT,
            format!("snapshot layer `{layer}` is corrupt or unreadable"),
        ),
        K::GuestGone => (
            StatusCode::GONE,
            code::VM_GONE,
            "the sandbox's VM has ended".to_string(),
        ),
        K::Unsupported => (
            StatusCode::NOT_IMPLEMENTED,
            code::UNSUPPORTED,
            "this pod's host cannot do that".to_string(),
        ),
        K::Io | K::Internal => (
            StatusCode::INTERNAL_SERVER_ERROR,
            code::INTERNAL,
            format!("the VMM failed ({})", e.kind),
        ),
    };
    ApiError::new(status, code, message)
}

/// An error answer: status, code, message and, for conflicts, the
/// sandbox's current state.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub state: Option<SandboxState>,
    /// A `quota_exceeded` answer's quota and its use.
    pub quota: Option<QuotaInfo>,
    /// `Retry-After` (seconds) of a `rate_limited` answer.
    pub retry_after: Option<u64>,
    /// A 202 (an accepted command still running, [`ServiceError::Accepted`]):
    /// the body is this operation, at `Location: /v1/operations/{id}`.
    /// (Boxed: every handler's `Result` carries an `ApiError`.)
    pub operation: Option<Box<serde_json::Value>>,
}

/// Which quota a 429 `quota_exceeded` hit, its limit and the current use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct QuotaInfo {
    pub quota: &'static str,
    pub limit: u64,
    pub used: u64,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: ErrorFields<'a>,
}

#[derive(Serialize)]
struct ErrorFields<'a> {
    code: &'a str,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    state: Option<SandboxState>,
    #[serde(skip_serializing_if = "Option::is_none", flatten)]
    quota: Option<QuotaInfo>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            state: None,
            quota: None,
            retry_after: None,
            operation: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code::INVALID_REQUEST, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, code::INTERNAL, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, code::UNAUTHORIZED, message)
    }

    /// An error for an HTTP status that axum (or a layer) chose, with the
    /// code that status stands for.
    pub fn from_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, code_for_status(status), message)
    }

    /// The JSON text of the body.
    pub fn body_json(&self) -> String {
        let envelope = Envelope {
            error: ErrorFields {
                code: self.code,
                message: &self.message,
                state: self.state,
                quota: self.quota,
            },
        };
        serde_json::to_string(&envelope).unwrap_or_else(|_| {
            r#"{"error":{"code":"internal","message":"error body"}}"#.to_string()
        })
    }
}

/// The code an HTTP status stands for when nothing more specific is known.
pub fn code_for_status(status: StatusCode) -> &'static str {
    match status {
        StatusCode::UNAUTHORIZED => code::UNAUTHORIZED,
        StatusCode::FORBIDDEN => code::FORBIDDEN,
        StatusCode::NOT_FOUND => code::NOT_FOUND,
        StatusCode::METHOD_NOT_ALLOWED => code::METHOD_NOT_ALLOWED,
        StatusCode::CONFLICT => code::CONFLICT,
        StatusCode::PAYLOAD_TOO_LARGE => code::PAYLOAD_TOO_LARGE,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => code::UNSUPPORTED_MEDIA_TYPE,
        StatusCode::TOO_MANY_REQUESTS => code::ADMISSION_REFUSED,
        StatusCode::NOT_IMPLEMENTED => code::NOT_IMPLEMENTED,
        StatusCode::REQUEST_TIMEOUT | StatusCode::GATEWAY_TIMEOUT => code::TIMEOUT,
        StatusCode::SERVICE_UNAVAILABLE => code::UNAVAILABLE,
        StatusCode::INSUFFICIENT_STORAGE => code::INSUFFICIENT_STORAGE,
        StatusCode::GONE => code::VM_GONE,
        s if s.is_client_error() => code::INVALID_REQUEST,
        _ => code::INTERNAL,
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

/// An operation's failure as another process is told it (a cluster's pod
/// to its replicas): the status, code and message of this answer.
impl From<ApiError> for torpor_sandbox_api::OpError {
    fn from(e: ApiError) -> Self {
        torpor_sandbox_api::OpError {
            status: e.status.as_u16(),
            code: e.code.to_string(),
            message: e.message,
        }
    }
}

impl From<ServiceError> for ApiError {
    fn from(err: ServiceError) -> Self {
        let message = err.to_string();
        match err {
            ServiceError::NotFound { .. } => {
                ApiError::new(StatusCode::NOT_FOUND, code::NOT_FOUND, message)
            }
            ServiceError::Conflict { state, .. } => ApiError {
                state: Some(state),
                ..ApiError::new(StatusCode::CONFLICT, code::CONFLICT, message)
            },
            ServiceError::Admission { .. } => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                code::ADMISSION_REFUSED,
                message,
            ),
            // Memory pressure: a wait, as a rate limit's.
            ServiceError::Pressure { retry_after_s, .. } => ApiError {
                retry_after: Some(retry_after_s),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, code::RATE_LIMITED, message)
            },
            ServiceError::ResourceConflict(_) => {
                ApiError::new(StatusCode::CONFLICT, code::CONFLICT, message)
            }
            ServiceError::Invalid(_) => ApiError::invalid(message),
            ServiceError::InvalidSpec(_) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                code::INVALID_SPEC,
                message,
            ),
            ServiceError::Forbidden(_) => {
                ApiError::new(StatusCode::FORBIDDEN, code::FORBIDDEN, message)
            }
            ServiceError::Unsupported(_) => {
                ApiError::new(StatusCode::NOT_IMPLEMENTED, code::UNSUPPORTED, message)
            }
            ServiceError::HostUnsupported(_) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                code::HOST_UNSUPPORTED,
                message,
            ),
            ServiceError::Internal(_) => {
                // The detail names host paths and processes: the log has it.
                tracing::error!(error = %message, "internal error");
                ApiError::internal("internal error (the server's log has the details)")
            }
            ServiceError::Unavailable { retry_after_s, .. } => ApiError {
                retry_after: Some(retry_after_s),
                ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code::UNAVAILABLE, message)
            },
            ServiceError::Accepted {
                operation,
                kind,
                sandbox,
                pod,
            } => ApiError {
                operation: Some(Box::new(serde_json::json!({
                    "id": operation,
                    "kind": kind,
                    "sandbox": sandbox,
                    "pod": pod,
                    "status": "pending",
                    "outcome": null,
                }))),
                ..ApiError::new(StatusCode::ACCEPTED, code::TIMEOUT, message)
            },
            ServiceError::GuestUnresponsive { .. } => {
                ApiError::new(StatusCode::CONFLICT, code::GUEST_UNRESPONSIVE, message)
            }
            ServiceError::TooLarge(_) => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                code::PAYLOAD_TOO_LARGE,
                message,
            ),
            ServiceError::Quota {
                quota, limit, used, ..
            } => ApiError {
                quota: Some(QuotaInfo { quota, limit, used }),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, code::QUOTA_EXCEEDED, message)
            },
            // A corrupt or missing chunk: the layer (and chunk) named.
            ServiceError::ObjectStore(e) if e.is_bad_layer() => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                code::BAD_SNAPSHOT,
                message,
            ),
            // The store unreachable or refusing: its detail names the
            // store and may name host paths (the log has it).
            ServiceError::ObjectStore(_) => {
                tracing::warn!(error = %message, "object store");
                ApiError {
                    retry_after: Some(1),
                    ..ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        code::UNAVAILABLE,
                        "the object store is unavailable (the server's log has the details)",
                    )
                }
            }
            ServiceError::Guest(g) => guest_error(&g, message),
            ServiceError::Vm(e) => vm_error(&e),
            ServiceError::Pod { status, code, .. } => {
                let status = StatusCode::from_u16(status)
                    .ok()
                    .filter(|s| s.is_client_error() || s.is_server_error())
                    .unwrap_or(StatusCode::BAD_GATEWAY);
                let code = code::ALL
                    .iter()
                    .copied()
                    .find(|c| *c == code)
                    .unwrap_or_else(|| code_for_status(status));
                // A remote pod's rate limit (its memory pressure) keeps a
                // Retry-After: a policy round, the pod's own value is not
                // carried.
                ApiError {
                    retry_after: (code == code::RATE_LIMITED).then_some(1),
                    ..ApiError::new(status, code, message)
                }
            }
        }
    }
}

/// Guest (exec and files) errors: the agent's errno picks the status.
fn guest_error(err: &GuestError, message: String) -> ApiError {
    let (status, code) = match err {
        GuestError::NoAgent { .. } => (StatusCode::UNPROCESSABLE_ENTITY, code::NO_AGENT),
        GuestError::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, code::PAYLOAD_TOO_LARGE),
        GuestError::Agent { error, .. } => match error.code.as_str() {
            "ENOENT" => (StatusCode::NOT_FOUND, code::NOT_FOUND),
            "EACCES" | "EPERM" | "EROFS" => (StatusCode::FORBIDDEN, code::FORBIDDEN),
            "EEXIST" | "ENOTEMPTY" | "EBUSY" | "ETXTBSY" => (StatusCode::CONFLICT, code::CONFLICT),
            "EINVAL" | "EISDIR" | "ENOTDIR" | "ENAMETOOLONG" | "ELOOP" | "E2BIG" | "ENOEXEC" => {
                (StatusCode::BAD_REQUEST, code::INVALID_REQUEST)
            }
            "EFBIG" => (StatusCode::PAYLOAD_TOO_LARGE, code::PAYLOAD_TOO_LARGE),
            _ => (StatusCode::BAD_GATEWAY, code::AGENT_ERROR),
        },
        GuestError::Deadline { .. } => (StatusCode::GATEWAY_TIMEOUT, code::TIMEOUT),
        GuestError::Unreachable { .. }
        | GuestError::ResumeHook { .. }
        | GuestError::Misbehaved { .. } => {
            tracing::warn!(error = %message, "guest agent");
            (StatusCode::BAD_GATEWAY, code::AGENT_ERROR)
        }
    };
    ApiError::new(status, code, message)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Some(op) = self.operation {
            let id = op.get("id").and_then(|v| v.as_str()).unwrap_or_default();
            let location = format!("/v1/operations/{id}");
            let mut response = (StatusCode::ACCEPTED, axum::Json(op)).into_response();
            if let Ok(v) = HeaderValue::from_str(&location) {
                response.headers_mut().insert(header::LOCATION, v);
            }
            return response;
        }
        let mut response = (self.status, self.body_json()).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(v) = self
            .retry_after
            .and_then(|s| HeaderValue::from_str(&s.to_string()).ok())
        {
            headers.insert(header::RETRY_AFTER, v);
        }
        response
    }
}

/// Largest original body kept as the message when an error is rewritten.
const MAX_REWRITTEN_MESSAGE: usize = 1024;

/// Middleware: an error response (4xx/5xx) that is not JSON yet is rewritten
/// into the error body; its headers (`Allow` on a 405, ...) are kept, and
/// its text, if any, becomes the message.
pub async fn normalize(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) || is_json(&response) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = match to_bytes(body, MAX_REWRITTEN_MESSAGE * 4).await {
        Ok(bytes) => String::from_utf8_lossy(&bytes).trim().to_string(),
        Err(_) => String::new(),
    };
    let mut message = if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_string()
    } else {
        text
    };
    if message.len() > MAX_REWRITTEN_MESSAGE {
        let mut end = MAX_REWRITTEN_MESSAGE;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    let error = ApiError::from_status(status, message);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(error.body_json()))
}

fn is_json(response: &Response) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"))
}

/// The fallback for paths no route matches.
pub async fn no_route(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        code::NOT_FOUND,
        format!("no route for {} {}", request.method(), request.uri().path()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(code: &str) -> ServiceError {
        ServiceError::Guest(GuestError::Agent {
            id: "sbx_1".into(),
            error: torpor_scheduler::service::guest::ErrorReply {
                code: code.into(),
                errno: None,
                message: "x".into(),
            },
        })
    }

    #[test]
    fn service_errors_map_to_statuses_and_codes() {
        let cases = [
            (
                ServiceError::NotFound {
                    kind: "sandbox",
                    id: "sbx_1".into(),
                },
                404,
                "not_found",
            ),
            (
                ServiceError::Conflict {
                    id: "sbx_1".into(),
                    state: SandboxState::Hibernated,
                    message: "cannot pause".into(),
                },
                409,
                "conflict",
            ),
            (
                ServiceError::Admission {
                    message: "full".into(),
                },
                429,
                "admission_refused",
            ),
            (
                ServiceError::ResourceConflict("template tpl_1 is in use".into()),
                409,
                "conflict",
            ),
            (ServiceError::Invalid("bad".into()), 400, "invalid_request"),
            (
                ServiceError::Unsupported("probe".into()),
                501,
                "unsupported",
            ),
            (
                ServiceError::HostUnsupported("no VMX/SVM".into()),
                422,
                "host_unsupported",
            ),
            (ServiceError::Internal("disk".into()), 500, "internal"),
            (
                ServiceError::Vm(torpor_vmm_api::VmError::new(
                    torpor_vmm_api::ErrorKind::NoSpace,
                    "write /data/x: No space left on device",
                )),
                507,
                "insufficient_storage",
            ),
            (
                ServiceError::Vm(torpor_vmm_api::VmError::new(
                    torpor_vmm_api::ErrorKind::NotPaused,
                    "run",
                )),
                409,
                "conflict",
            ),
            (
                ServiceError::Vm(
                    torpor_vmm_api::VmError::new(torpor_vmm_api::ErrorKind::BadSnapshot, "crc")
                        .with_layer("/var/lib/torpor/sandboxes/sb_1/snap-3"),
                ),
                500,
                "bad_snapshot",
            ),
            (
                ServiceError::Guest(GuestError::NoAgent {
                    id: "sbx_1".into(),
                    kind: torpor_scheduler::model::TemplateKind::Probe,
                }),
                422,
                "no_agent",
            ),
            (agent("ENOENT"), 404, "not_found"),
            (agent("EACCES"), 403, "forbidden"),
            (agent("EISDIR"), 400, "invalid_request"),
            (agent("EEXIST"), 409, "conflict"),
            (agent("EIO"), 502, "agent_error"),
            (
                ServiceError::Guest(GuestError::Unreachable {
                    id: "sbx_1".into(),
                    reason: "gone".into(),
                }),
                502,
                "agent_error",
            ),
            (
                ServiceError::Pod {
                    status: 503,
                    code: "unavailable".into(),
                    message: "template linux is not available yet".into(),
                },
                503,
                "unavailable",
            ),
        ];
        for (err, status, code) in cases {
            let api = ApiError::from(err);
            assert_eq!(api.status.as_u16(), status, "{api}");
            assert_eq!(api.code, code);
        }
    }

    #[test]
    fn something_coming_is_a_503_with_retry_after() {
        let api = ApiError::from(ServiceError::Unavailable {
            message: "template base is not available yet: booting".into(),
            retry_after_s: 20,
        });
        assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.code, "unavailable");
        let response = api.into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "20");
    }

    #[test]
    fn memory_pressure_is_a_429_rate_limit_with_retry_after() {
        let api = ApiError::from(ServiceError::Pressure {
            resident_mib: 700,
            asked_mib: 64,
            hard_mib: 650,
            retry_after_s: 1,
        });
        assert_eq!(api.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(api.code, code::RATE_LIMITED);
        assert!(api.message.contains("700 MiB resident"), "{api}");
        let response = api.into_response();
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        // Through a front server, from a remote pod, too.
        let api = ApiError::from(ServiceError::Pod {
            status: 429,
            code: code::RATE_LIMITED.into(),
            message: "the pod is under memory pressure".into(),
        });
        assert_eq!((api.status.as_u16(), api.retry_after), (429, Some(1)));
    }

    #[test]
    fn an_accepted_command_is_a_202_with_its_operation() {
        let api = ApiError::from(ServiceError::Accepted {
            operation: "op_1".into(),
            kind: "create".into(),
            sandbox: None,
            pod: "pod1".into(),
        });
        assert_eq!(api.status, StatusCode::ACCEPTED);
        let op = *api.operation.clone().unwrap();
        assert_eq!(
            (op["id"].as_str(), op["status"].as_str()),
            (Some("op_1"), Some("pending"))
        );
        let response = api.into_response();
        assert_eq!(response.status(), StatusCode::ACCEPTED);
        assert_eq!(response.headers()[header::LOCATION], "/v1/operations/op_1");
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
    }

    #[test]
    fn body_carries_state_only_for_conflicts() {
        let api = ApiError::from(ServiceError::Conflict {
            id: "sbx_1".into(),
            state: SandboxState::Paused,
            message: "sandbox is paused".into(),
        });
        let v: serde_json::Value = serde_json::from_str(&api.body_json()).unwrap();
        assert_eq!(v["error"]["state"], "paused");
        assert_eq!(v["error"]["code"], "conflict");
        let v: serde_json::Value =
            serde_json::from_str(&ApiError::invalid("x").body_json()).unwrap();
        assert!(v["error"].get("state").is_none());
        assert_eq!(v["error"]["message"], "x");
    }

    #[test]
    fn statuses_have_codes() {
        assert_eq!(
            code_for_status(StatusCode::UNPROCESSABLE_ENTITY),
            "invalid_request"
        );
        assert_eq!(code_for_status(StatusCode::BAD_GATEWAY), "internal");
        assert_eq!(
            code_for_status(StatusCode::PAYLOAD_TOO_LARGE),
            "payload_too_large"
        );
    }
}
