//! What every surface's handlers share: the state ([`AppState`]), the
//! call into the backend ([`call`]) and the answer of a made
//! resource ([`created`]). The routes themselves are the surfaces'
//! (torpor-api's `/v1`, torpor-e2b's).

use std::future::Future;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header::{self, HeaderValue};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::backend::SandboxApi;
use crate::error::ApiError;
use crate::service::ServiceError;
use crate::tenancy::Tenancy;

/// The service, shared by every handler, with the tenancy state.
#[derive(Debug)]
pub struct AppState<S> {
    pub service: Arc<S>,
    pub tenancy: Tenancy<S>,
    /// Largest image upload.
    pub max_upload_bytes: u64,
}

impl<S> Clone for AppState<S> {
    fn clone(&self) -> Self {
        AppState {
            service: Arc::clone(&self.service),
            tenancy: self.tenancy.clone(),
            max_upload_bytes: self.max_upload_bytes,
        }
    }
}

pub type Api<S> = State<AppState<S>>;
pub type ApiResult<T> = Result<T, ApiError>;

/// The backend call `f` makes, answered as the API answers it: its
/// error as an [`ApiError`], a panic in it a 500. It runs as a task of its
/// own (with the request's context), so a request that times out (504)
/// or goes away leaves the call running to its end: no operation is cut
/// in the middle. `f` gets the shared backend.
pub async fn call<S, T, F, Fut>(state: &AppState<S>, f: F) -> ApiResult<T>
where
    S: SandboxApi,
    T: Send + 'static,
    F: FnOnce(Arc<S>) -> Fut,
    Fut: Future<Output = Result<T, ServiceError>> + Send + 'static,
{
    let task = crate::request_context::carried(f(Arc::clone(&state.service)));
    // Its own task: the pod's service runs in place on it (`detached`).
    let task = crate::backend::own_task(task);
    match tokio::spawn(task).await {
        Ok(result) => result.map_err(ApiError::from),
        Err(join) => {
            tracing::error!(error = %join, "service call panicked");
            Err(ApiError::internal(
                "the service failed while handling the request",
            ))
        }
    }
}

/// 201 with `Location`, or 202 while the resource is still being built.
pub fn created(location: String, building: bool, body: impl serde::Serialize) -> Response {
    let status = if building {
        StatusCode::ACCEPTED
    } else {
        StatusCode::CREATED
    };
    let mut response = (status, Json(body)).into_response();
    if let Ok(value) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    response
}
