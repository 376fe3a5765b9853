//! Checkpoint, restore and fork routes: decode, call the service on the
//! blocking pool, encode.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use torpor_scheduler::model::{Checkpoint, SandboxId};

use crate::backend::{on_pod, Needs, SandboxApi};
use crate::handlers::{call, created, Api, ApiResult};
use crate::service::{
    check_lifetimes, CreateCheckpoint, ForkSandbox, RestoreCheckpoint, TemplateFromSandbox,
};
use crate::wire::{ApiJson, OutcomeBody};

/// `GET /v1/sandboxes/{id}/checkpoints`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct CheckpointList {
    pub checkpoints: Vec<Checkpoint>,
}

pub async fn list<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<Json<CheckpointList>> {
    let id = SandboxId::new(id);
    let checkpoints = call(&st, move |s| {
        on_pod(s, Needs::Snapshots, |s| s.list_checkpoints(&id))
    })
    .await?;
    Ok(Json(CheckpointList { checkpoints }))
}

pub async fn create<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<CreateCheckpoint>,
) -> ApiResult<Response> {
    let id = SandboxId::new(id);
    let checkpoint = call(&st, move |s| {
        on_pod(s, Needs::Snapshots, |s| s.create_checkpoint(&id, body))
    })
    .await?;
    let location = format!(
        "/v1/sandboxes/{}/checkpoints/{}",
        checkpoint.sandbox, checkpoint.name
    );
    Ok(created(location, false, checkpoint))
}

pub async fn delete<S: SandboxApi>(
    State(st): Api<S>,
    Path((id, name)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let id = SandboxId::new(id);
    call(&st, move |s| {
        on_pod(s, Needs::Snapshots, |s| s.delete_checkpoint(&id, &name))
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn restore<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<RestoreCheckpoint>,
) -> ApiResult<Json<OutcomeBody>> {
    let id = SandboxId::new(id);
    Ok(Json(
        call(&st, move |s| {
            on_pod(s, Needs::Snapshots, |s| s.restore_checkpoint(&id, body))
        })
        .await?
        .into(),
    ))
}

pub async fn fork<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ForkSandbox>,
) -> ApiResult<Response> {
    check_lifetimes(body.keep_alive_ms, body.timeout_ms)?;
    let id = SandboxId::new(id);
    let sandbox = call(&st, move |s| s.fork_sandbox(&id, body)).await?;
    Ok(created(
        format!("/v1/sandboxes/{}", sandbox.id),
        false,
        sandbox,
    ))
}

/// `POST /v1/sandboxes/{id}/template`: snapshot-as-template.
pub async fn template<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<TemplateFromSandbox>,
) -> ApiResult<Response> {
    let id = SandboxId::new(id);
    let template = call(&st, move |s| s.template_from_sandbox(&id, body)).await?;
    Ok(created(
        format!("/v1/templates/{}", template.id),
        false,
        template,
    ))
}
