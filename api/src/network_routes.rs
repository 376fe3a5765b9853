//! Sandbox network routes: the egress policy at run time and exposed
//! ports (pods with `serve --sandbox-network`). Tenant scoping is the
//! `/v1/sandboxes/{id}` guard's (another tenant's sandbox answers 404).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use torpor_scheduler::model::{ExposedPort, SandboxId};
use torpor_scheduler::net::PolicyPatch;

use crate::backend::{on_pod, Needs, SandboxApi};
use crate::error::ApiError;
use crate::handlers::{call, created, Api, ApiResult};
use crate::wire::ApiJson;

/// `GET /v1/sandboxes/{id}/ports`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PortList {
    pub ports: Vec<ExposedPort>,
}

/// `POST /v1/sandboxes/{id}/ports`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExposePort {
    pub guest_port: u16,
}

/// `PATCH /v1/sandboxes/{id}/network`: what is given replaces that part
/// of the policy, and the result is narrowed to the pod's policy (a
/// ceiling: a tenant never widens it; the answer shows what holds).
pub async fn update_policy<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    ApiJson(patch): ApiJson<PolicyPatch>,
) -> ApiResult<Response> {
    if patch.is_empty() {
        return Err(ApiError::invalid(
            "nothing to change: give allow_internet, allow_out and/or deny_out",
        ));
    }
    let id = SandboxId::new(id);
    let sandbox = call(&st, move |s| async move {
        let s = &*s;
        on_pod(s, Needs::Network, move |s| {
            s.set_network_policy(&id, &patch)
        })
        .await
    })
    .await?;
    Ok(Json(sandbox).into_response())
}

pub async fn list_ports<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<Json<PortList>> {
    let id = SandboxId::new(id);
    let ports = call(&st, move |s| async move {
        let s = &*s;
        on_pod(s, Needs::Network, move |s| s.list_ports(&id)).await
    })
    .await?;
    Ok(Json(PortList { ports }))
}

pub async fn expose_port<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    ApiJson(body): ApiJson<ExposePort>,
) -> ApiResult<Response> {
    if body.guest_port == 0 {
        return Err(ApiError::invalid("guest_port must be 1 to 65535"));
    }
    let location = format!("/v1/sandboxes/{id}/ports/{}", body.guest_port);
    let id = SandboxId::new(id);
    let port = call(&st, move |s| async move {
        let s = &*s;
        on_pod(s, Needs::Network, move |s| {
            s.expose_port(&id, body.guest_port)
        })
        .await
    })
    .await?;
    Ok(created(location, false, port))
}

pub async fn unexpose_port<S: SandboxApi>(
    State(st): Api<S>,
    Path((id, guest_port)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let Ok(guest_port) = guest_port.parse::<u16>() else {
        return Err(ApiError::invalid(
            "the guest port must be a number, 1 to 65535",
        ));
    };
    let id = SandboxId::new(id);
    call(&st, move |s| async move {
        let s = &*s;
        on_pod(s, Needs::Network, move |s| s.unexpose_port(&id, guest_port)).await
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
