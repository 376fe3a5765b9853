//! E2B's error body, `{"code": <HTTP status>, "message": "..."}`, and the
//! middleware that gives every error answer of an E2B route that shape
//! (axum's own rejections, the shared limits' 413/504, torpor's JSON errors).

use axum::body::{to_bytes, Body};
use axum::extract::Request;
use axum::http::header::{self, HeaderValue};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use torpor_gate::error::ApiError;
use torpor_gate::service::ServiceError;

/// E2B's `error_code` for a resume that would restore memory kept while
/// the guest agent did not answer (the SDK's `GuestUnresponsiveException`,
/// 409): resume with `memory: false`.
pub const GUEST_UNRESPONSIVE_CODE: &str = "sandbox_snapshot_guest_agent_unresponsive";

/// An E2B error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct E2bError {
    /// The HTTP status, as a number (E2B's `code`).
    pub code: u16,
    pub message: String,
    /// E2B's machine-readable `error_code`, where one applies
    /// ([`GUEST_UNRESPONSIVE_CODE`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// `Retry-After` (seconds) of a rate-limit refusal: a header, not a
    /// field of E2B's body.
    #[serde(skip)]
    pub retry_after: Option<u64>,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        E2bError {
            code: status.as_u16(),
            message: message.into(),
            error_code: None,
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

/// torpor's status mapping (see the table in `lib.rs`), E2B's shape.
impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> Self {
        // E2B's SDKs cannot poll an operation: a command still running
        // past the wait is their timeout.
        let status = if e.operation.is_some() {
            StatusCode::GATEWAY_TIMEOUT
        } else if e.code == torpor_gate::error::code::INVALID_SPEC {
            // E2B's builder answers a build it cannot use 400.
            StatusCode::BAD_REQUEST
        } else {
            e.status
        };
        E2bError {
            code: status.as_u16(),
            message: e.message,
            error_code: (e.code == torpor_gate::error::code::GUEST_UNRESPONSIVE)
                .then(|| GUEST_UNRESPONSIVE_CODE.to_string()),
            retry_after: e.retry_after,
        }
    }
}

impl From<ServiceError> for E2bError {
    fn from(e: ServiceError) -> Self {
        ApiError::from(e).into()
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, axum::Json(&self)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("X-API-KEY"),
            );
        }
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// Largest error body read back when rewriting one.
const MAX_REWRITTEN: usize = 8 * 1024;

/// torpor's own error body, `{"error": {"code": "...", "message": "..."}}`.
#[derive(Deserialize)]
struct TorporEnvelope {
    error: TorporFields,
}

#[derive(Deserialize)]
struct TorporFields {
    message: String,
}

/// The message of an error body that is not E2B-shaped yet: torpor's
/// JSON error's message, or the text itself, or the status's reason.
fn message_of(status: StatusCode, body: &[u8]) -> String {
    if let Ok(e) = serde_json::from_slice::<TorporEnvelope>(body) {
        return e.error.message;
    }
    let text = String::from_utf8_lossy(body).trim().to_string();
    if text.is_empty() {
        status.canonical_reason().unwrap_or("request failed").into()
    } else {
        text
    }
}

/// Middleware: every 4xx/5xx answer not already `{"code", "message"}`
/// becomes one; headers (`Allow` on a 405, ...) are kept.
pub async fn normalize(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let bytes = to_bytes(body, MAX_REWRITTEN).await.unwrap_or_default();
    if serde_json::from_slice::<E2bError>(&bytes).is_ok() {
        return Response::from_parts(parts, Body::from(bytes));
    }
    let error = E2bError::new(status, message_of(status, &bytes));
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    let body = serde_json::to_vec(&error).unwrap_or_default();
    Response::from_parts(parts, Body::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limits_keep_their_retry_after() {
        let limited = ApiError::from(torpor_gate::tenancy::Limited(
            std::time::Duration::from_millis(2500),
        ));
        let response = E2bError::from(limited).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            response.headers().get(header::RETRY_AFTER).unwrap(),
            &HeaderValue::from_static("3")
        );
        let other = E2bError::not_found("x").into_response();
        assert!(other.headers().get(header::RETRY_AFTER).is_none());
    }

    #[test]
    fn messages_come_from_either_shape() {
        let torpor = br#"{"error":{"code":"timeout","message":"took too long"}}"#;
        assert_eq!(
            message_of(StatusCode::GATEWAY_TIMEOUT, torpor),
            "took too long"
        );
        assert_eq!(
            message_of(StatusCode::BAD_REQUEST, b" Failed to parse "),
            "Failed to parse"
        );
        assert_eq!(message_of(StatusCode::NOT_FOUND, b""), "Not Found");
        let e: E2bError = ServiceError::NotFound {
            kind: "sandbox",
            id: "sbx_1".into(),
        }
        .into();
        assert_eq!(e.code, 404);
        assert!(e.message.contains("sbx_1"), "{e:?}");
    }
}
