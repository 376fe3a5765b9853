//! Route handlers: decode, call the service on the blocking pool, encode.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::header::{self, HeaderValue};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use torpor_scheduler::model::{PodId, SandboxId, SandboxState, TemplateId, TemplateState};

use crate::backend::SandboxApi;
use crate::error::ApiError;
use crate::service::ServiceError;
use crate::service::{check_lifetimes, CreateSandbox, CreateTemplate};
use crate::wire::{
    sandbox_filter, ApiJson, Health, OutcomeBody, PodBody, PodList, PodPatch, SandboxList,
    SandboxPatch, TemplateList,
};

/// The service, shared by every handler.
pub struct AppState<S> {
    pub service: Arc<S>,
}

impl<S> Clone for AppState<S> {
    fn clone(&self) -> Self {
        AppState {
            service: Arc::clone(&self.service),
        }
    }
}

pub(crate) type Api<S> = State<AppState<S>>;
pub(crate) type ApiResult<T> = Result<T, ApiError>;

/// Runs `f` on the service on tokio's blocking pool (service calls block on
/// the store, VMM sockets and snapshot files).
pub(crate) async fn call<S, T, F>(state: &AppState<S>, f: F) -> ApiResult<T>
where
    S: SandboxApi,
    T: Send + 'static,
    F: FnOnce(&S) -> Result<T, ServiceError> + Send + 'static,
{
    let service = Arc::clone(&state.service);
    match tokio::task::spawn_blocking(move || f(&service)).await {
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
pub(crate) fn created(location: String, building: bool, body: impl serde::Serialize) -> Response {
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

pub async fn health() -> Json<Health> {
    Json(Health {
        status: "ok",
        version: env!("CARGO_PKG_VERSION"),
    })
}

pub async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::DOCUMENT,
    )
        .into_response()
}

pub async fn metrics<S: SandboxApi>(State(st): Api<S>) -> ApiResult<Response> {
    let text = call(&st, |s| Ok(s.metrics())).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

// Templates.

pub async fn list_templates<S: SandboxApi>(State(st): Api<S>) -> ApiResult<Json<TemplateList>> {
    let templates = call(&st, |s| s.template_entries()).await?;
    Ok(Json(TemplateList { templates }))
}

pub async fn create_template<S: SandboxApi>(
    State(st): Api<S>,
    ApiJson(body): ApiJson<CreateTemplate>,
) -> ApiResult<Response> {
    let template = call(&st, move |s| s.create_template(body)).await?;
    let building = template.state == TemplateState::Building;
    Ok(created(
        format!("/v1/templates/{}", template.id),
        building,
        template,
    ))
}

pub async fn get_template<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let id = TemplateId::new(id);
    let template = call(&st, move |s| s.get_template(&id)).await?;
    Ok(Json(template).into_response())
}

pub async fn delete_template<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let id = TemplateId::new(id);
    call(&st, move |s| s.delete_template(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

// Sandboxes.

pub async fn list_sandboxes<S: SandboxApi>(
    State(st): Api<S>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> ApiResult<Json<SandboxList>> {
    let Query(pairs) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let filter = sandbox_filter(pairs)?;
    let sandboxes = call(&st, move |s| s.list_sandboxes(filter)).await?;
    Ok(Json(SandboxList { sandboxes }))
}

pub async fn create_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    ApiJson(body): ApiJson<CreateSandbox>,
) -> ApiResult<Response> {
    // Here too, not only in the service: a federation forwards the body.
    check_lifetimes(body.keep_alive_ms, body.timeout_ms)?;
    let sandbox = call(&st, move |s| s.create_sandbox(body)).await?;
    let building = sandbox.state == SandboxState::Creating;
    Ok(created(
        format!("/v1/sandboxes/{}", sandbox.id),
        building,
        sandbox,
    ))
}

pub async fn get_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let id = SandboxId::new(id);
    let sandbox = call(&st, move |s| s.get_sandbox(&id)).await?;
    Ok(Json(sandbox).into_response())
}

pub async fn delete_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let id = SandboxId::new(id);
    call(&st, move |s| s.delete_sandbox(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn update_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    ApiJson(patch): ApiJson<SandboxPatch>,
) -> ApiResult<Response> {
    if patch.keep_alive_ms.is_none() && patch.timeout_ms.is_none() {
        return Err(ApiError::invalid(
            "nothing to change: give keep_alive_ms and/or timeout_ms",
        ));
    }
    check_lifetimes(patch.keep_alive_ms, patch.timeout_ms)?;
    let id = SandboxId::new(id);
    let sandbox = call(&st, move |s| {
        s.set_timeout(&id, patch.keep_alive_ms, patch.timeout_ms)
    })
    .await?;
    Ok(Json(sandbox).into_response())
}

pub async fn pause_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<Json<OutcomeBody>> {
    let id = SandboxId::new(id);
    Ok(Json(call(&st, move |s| s.pause(&id)).await?.into()))
}

pub async fn resume_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<Json<OutcomeBody>> {
    let id = SandboxId::new(id);
    Ok(Json(call(&st, move |s| s.resume(&id)).await?.into()))
}

pub async fn connect_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<Json<OutcomeBody>> {
    let id = SandboxId::new(id);
    Ok(Json(call(&st, move |s| s.connect(&id)).await?.into()))
}

pub async fn hibernate_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<Json<OutcomeBody>> {
    let id = SandboxId::new(id);
    Ok(Json(call(&st, move |s| s.hibernate(&id)).await?.into()))
}

// Pods.

pub async fn list_pods<S: SandboxApi>(State(st): Api<S>) -> ApiResult<Json<PodList>> {
    let pods = call(&st, |s| s.pod_entries()).await?;
    Ok(Json(PodList { pods }))
}

pub async fn add_pod<S: SandboxApi>(
    State(st): Api<S>,
    ApiJson(body): ApiJson<crate::federation::AddPod>,
) -> ApiResult<Response> {
    let entry = call(&st, move |s| s.add_pod(body)).await?;
    let location = format!("/v1/pods/{}", entry["id"].as_str().unwrap_or_default());
    Ok(created(location, false, entry))
}

pub async fn remove_pod<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let id = PodId::new(id);
    call(&st, move |s| s.remove_pod(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn update_pod<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    ApiJson(patch): ApiJson<PodPatch>,
) -> ApiResult<Json<PodBody>> {
    if patch.oversubscription_ratio.is_none() && patch.high_watermark.is_none() {
        return Err(ApiError::invalid(
            "nothing to change: give oversubscription_ratio and/or high_watermark",
        ));
    }
    let id = PodId::new(id);
    let view = call(&st, move |s| {
        s.set_pod(&id, patch.oversubscription_ratio, patch.high_watermark)
    })
    .await?;
    Ok(Json(view.into()))
}
