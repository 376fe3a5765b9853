//! What of a request a backend may need besides its body: its
//! `Idempotency-Key` (the cluster returns a retried command's first
//! outcome). [`scope`] (a layer of the cluster's router) keeps it for the
//! request's task, where the backend's calls run and [`idempotency_key`]
//! reads it. Without the layer (the embedded server) there is none.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// The longest `Idempotency-Key` taken.
pub const MAX_KEY_LEN: usize = 255;

tokio::task_local! {
    static KEY: Option<String>;
}

/// The layer: a well-formed `Idempotency-Key` (1-255 visible ASCII
/// characters) is kept for the request; a malformed one is 400.
pub async fn scope(request: Request, next: Next) -> Response {
    let key = match request.headers().get("idempotency-key") {
        None => None,
        Some(v) => match v.to_str() {
            Ok(k)
                if !k.is_empty()
                    && k.len() <= MAX_KEY_LEN
                    && k.bytes().all(|b| b.is_ascii_graphic()) =>
            {
                Some(k.to_string())
            }
            _ => {
                return ApiError::invalid(format!(
                    "Idempotency-Key: 1-{MAX_KEY_LEN} visible ASCII characters"
                ))
                .into_response()
            }
        },
    };
    KEY.scope(key, next.run(request)).await
}

/// `f` with the current request's context: run as a task of its own, it
/// still reads the request's key.
pub fn carried<F: std::future::Future>(f: F) -> impl std::future::Future<Output = F::Output> {
    KEY.scope(idempotency_key(), f)
}

/// The key of the request whose task this is (none outside [`scope`]).
pub fn idempotency_key() -> Option<String> {
    KEY.try_with(Clone::clone).ok().flatten()
}
