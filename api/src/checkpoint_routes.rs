//! Checkpoint, restore and fork routes: decode, call the backend, encode.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use torpor_scheduler::model::{Checkpoint, Sandbox, SandboxId};

use crate::auth::Principal;
use crate::backend::{on_pod, Needs, SandboxApi};
use crate::error::ApiError;
use crate::handlers::{call, created, Api, ApiResult};
use crate::quota::Usage;
use crate::service::{
    check_lifetimes, CreateCheckpoint, ForkSandbox, RestoreCheckpoint, TemplateFromSandbox,
    MAX_FORK_COUNT,
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
    let checkpoints = call(&st, move |s| async move {
        let s = &*s;
        on_pod(s, Needs::Snapshots, move |s| s.list_checkpoints(&id)).await
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
    let checkpoint = call(&st, move |s| async move {
        let s = &*s;
        s.checkpoint(&id, body).await
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
    call(&st, move |s| async move {
        let s = &*s;
        s.delete_checkpoint(&id, &name).await
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
        call(&st, move |s| async move {
            let s = &*s;
            on_pod(s, Needs::Snapshots, move |s| {
                s.restore_checkpoint(&id, body)
            })
            .await
        })
        .await?
        .into(),
    ))
}

/// `POST /v1/sandboxes/{id}/fork` with `count`: the forks, all made.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ForkList {
    pub sandboxes: Vec<Sandbox>,
}

/// `POST /v1/sandboxes/{id}/fork`: one fork (201 with it), or with
/// `count` that many (201 with [`ForkList`]), all or none.
pub async fn fork<S: SandboxApi>(
    State(st): Api<S>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    ApiJson(mut body): ApiJson<ForkSandbox>,
) -> ApiResult<Response> {
    check_lifetimes(body.keep_alive_ms, body.timeout_ms)?;
    let id = SandboxId::new(id);
    let Some(count) = body.count.take() else {
        let sandbox = call(&st, move |s| async move {
            let s = &*s;
            s.fork_sandbox(&id, body).await
        })
        .await?;
        return Ok(created(
            format!("/v1/sandboxes/{}", sandbox.id),
            false,
            sandbox,
        ));
    };
    if !(1..=MAX_FORK_COUNT).contains(&count) {
        return Err(ApiError::invalid(format!(
            "count {count} is not from 1 to {MAX_FORK_COUNT}"
        )));
    }
    let tenancy = st.tenancy.clone();
    let sandboxes = call(&st, move |s| async move {
        let s = &*s;
        // The route's layer admitted one fork (`gate::sandbox`);
        // the others here, held until all are made. A backend admitting
        // its own (a cluster: all `count` at once, in PostgreSQL) has
        // neither.
        let _more = if s.admits_creates() || count == 1 {
            None
        } else {
            let mem = u64::from(s.get_sandbox(&id).await?.mem_mib);
            let mut more = Usage::default();
            for _ in 1..count {
                more.add(&Usage::sandbox(mem));
            }
            crate::tenancy::admit(&tenancy, &principal, more).await?
        };
        s.fork_sandboxes(&id, body, count).await
    })
    .await?;
    Ok((StatusCode::CREATED, Json(ForkList { sandboxes })).into_response())
}

/// `POST /v1/sandboxes/{id}/template`: snapshot-as-template.
pub async fn template<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<TemplateFromSandbox>,
) -> ApiResult<Response> {
    let id = SandboxId::new(id);
    let template = call(&st, move |s| async move {
        let s = &*s;
        s.template_from_sandbox(&id, body).await
    })
    .await?;
    Ok(created(
        format!("/v1/templates/{}", template.id),
        false,
        template,
    ))
}
