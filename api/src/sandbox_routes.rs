//! `/v1`'s sandbox, template and pod routes: decode, call the backend
//! ([`call`]), encode.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, Path, Query, State};
use axum::http::header::{self};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use torpor_scheduler::model::{PodId, SandboxId, SandboxState, TemplateState};

use torpor_gate::auth::{forbidden, Principal};
use torpor_gate::backend::{Lifecycle, SandboxApi};
use torpor_gate::error::ApiError;
use torpor_gate::pagination::{page, Page};
use torpor_gate::quota::Usage;
use torpor_gate::service::ServiceError;
use torpor_gate::service::{check_lifetimes, CreateSandbox, CreateTemplate};
use torpor_gate::tenancy::Limited;
use torpor_gate::wire::{
    sandbox_filter, ApiJson, Health, OutcomeBody, PodBody, PodList, PodPatch, SandboxList,
    SandboxPatch, TemplateList,
};

use torpor_gate::handlers::{call, created, Api, ApiResult, AppState};

pub async fn health() -> Json<Health> {
    Json(Health {
        status: "ok",
        version: env!("CARGO_PKG_VERSION"),
    })
}

pub async fn metrics<S: SandboxApi>(State(st): Api<S>) -> ApiResult<Response> {
    let mut text = call(&st, |s| async move { Ok(s.metrics().await) }).await?;
    text.push_str(&st.tenancy.traffic.encode());
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

/// Whether `p` sees a template entry: shared ones (no `tenant`) and its
/// tenant's; an admin every one ([`torpor_scheduler::names::visible`]).
/// Whether `p` sees template `entry` in a list: its own and shared ones,
/// but no build's cache layer ([`crate::build_registry::is_layer`]) unless
/// it is an admin acting for itself (the server in front of a pod finds
/// layers in its pods' lists).
fn sees_template(p: &Principal, entry: &serde_json::Value) -> bool {
    let layer = entry["name"]
        .as_str()
        .is_some_and(crate::build_registry::is_layer);
    torpor_scheduler::names::visible(entry["tenant"].as_str(), Some(&p.owner()))
        && (!layer || p.owner().admin)
}

pub async fn list_templates<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> ApiResult<Response> {
    let Query(pairs) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let (_, paging) = Page::split(pairs)?;
    let mut templates = call(&st, |s| async move { s.template_entries().await }).await?;
    templates.retain(|t| sees_template(&p, t));
    let (templates, next) = page(templates, &paging);
    Ok(Page::respond(
        TemplateList {
            templates,
            next: next.clone(),
        },
        next,
    ))
}

/// `POST /v1/templates` of a template booted from an image
/// ([`CreateTemplate`]; a build spec's goes to the builds:
/// `crate::build_routes::create_template`).
pub(crate) async fn create_booted_template<S: SandboxApi>(
    st: AppState<S>,
    p: Principal,
    body: serde_json::Value,
) -> ApiResult<Response> {
    let mut body: CreateTemplate = serde_json::from_value(body).map_err(|e| {
        ApiError::invalid(format!(
            "Failed to deserialize the JSON body into the target type: {e}"
        ))
    })?;
    if body.pod.is_some() && !p.is_admin() {
        return Err(forbidden(
            "building a template on a chosen pod needs an admin token",
        ));
    }
    let _permit = st.tenancy.limiter.acquire(&p).map_err(Limited)?;
    body.owner = Some(p.owner());
    let tenancy = st.tenancy.clone();
    let template = call(&st, move |s| async move {
        let s = &*s;
        // A build boots a VM: admitted against the tenant's quotas too,
        // here, or by a service that admits its creates itself (a cluster
        // replica, in PostgreSQL with the build's operation).
        let _ticket = if s.admits_creates() {
            None
        } else {
            crate::tenancy::admit(&tenancy, &p, Usage::build(u64::from(body.mem_mib))).await?
        };
        s.create_template(body).await
    })
    .await?;
    let building = template.state == TemplateState::Building;
    Ok(created(
        format!("/v1/templates/{}", template.id),
        building,
        template,
    ))
}

/// `GET /v1/templates/{id}`: the template the id (or name) names for the
/// caller: its own or a shared one; another tenant's, or a deleted one,
/// is not found (the service's resolution, one place for every backend).
pub async fn get_template<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path(key): Path<String>,
) -> ApiResult<Response> {
    let template = call(&st, move |s| async move {
        let s = &*s;
        s.resolve_template(&p.owner(), &key).await
    })
    .await?;
    Ok(Json(template).into_response())
}

/// `DELETE /v1/templates/{id}`: a tenant deletes its own (a shared one is
/// 403, another tenant's 404, as a missing one); an admin any.
pub async fn delete_template<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path(key): Path<String>,
) -> ApiResult<StatusCode> {
    call(&st, move |s| async move {
        let s = &*s;
        s.delete_template(Some(&p.owner()), &key).await
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `PATCH /v1/templates/{id}`'s body.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplatePatch {
    /// Its new name.
    pub name: String,
}

/// `PATCH /v1/templates/{id}`: renames it (who may delete it may rename
/// it); a name its tenant sees taken already is 409.
pub async fn rename_template<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path(key): Path<String>,
    ApiJson(body): ApiJson<TemplatePatch>,
) -> ApiResult<Response> {
    let t = call(&st, move |s| async move {
        let s = &*s;
        s.rename_template(Some(&p.owner()), &key, &body.name).await
    })
    .await?;
    Ok(Json(t).into_response())
}

// Sandboxes.

pub async fn list_sandboxes<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> ApiResult<Response> {
    let Query(pairs) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let (pairs, paging) = Page::split(pairs)?;
    let mut filter = sandbox_filter(pairs)?;
    if !p.sees_all() {
        filter.tenant = Some(p.owner().tenant);
    }
    let sandboxes = call(&st, move |s| async move {
        let s = &*s;
        s.list_sandboxes(filter).await
    })
    .await?;
    let (sandboxes, next) = page(sandboxes, &paging);
    Ok(Page::respond(
        SandboxList {
            sandboxes,
            next: next.clone(),
        },
        next,
    ))
}

pub async fn create_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    ApiJson(mut body): ApiJson<CreateSandbox>,
) -> ApiResult<Response> {
    // Here too, not only in the service: a relay to another pod forwards the body.
    check_lifetimes(body.keep_alive_ms, body.timeout_ms)?;
    if body.pod.is_some() && !p.is_admin() {
        return Err(forbidden(
            "placing a sandbox on a chosen pod needs an admin token",
        ));
    }
    let _permit = st.tenancy.limiter.acquire(&p).map_err(Limited)?;
    body.owner = Some(p.owner());
    let tenancy = st.tenancy.clone();
    let sandbox = call(&st, move |s| async move {
        let s = &*s;
        let mut body = body;
        let _ticket = crate::tenancy::admit_create(&tenancy, &p, s, &mut body).await?;
        s.create_sandbox(body).await
    })
    .await?;
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
    let sandbox = call(&st, move |s| async move {
        let s = &*s;
        s.get_sandbox(&id).await
    })
    .await?;
    Ok(Json(sandbox).into_response())
}

pub async fn delete_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let id = SandboxId::new(id);
    call(&st, move |s| async move {
        let s = &*s;
        s.delete_sandbox(&id).await
    })
    .await?;
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
    let sandbox = call(&st, move |s| async move {
        let s = &*s;
        s.set_timeout(&id, patch.keep_alive_ms, patch.timeout_ms)
            .await
    })
    .await?;
    Ok(Json(sandbox).into_response())
}

/// `POST /v1/sandboxes/{id}/<op>`: pause, resume, connect or hibernate.
pub async fn lifecycle_sandbox<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    op: Lifecycle,
) -> ApiResult<Json<OutcomeBody>> {
    let id = SandboxId::new(id);
    Ok(Json(
        call(&st, move |s| async move {
            let s = &*s;
            s.lifecycle(&id, op).await
        })
        .await?
        .into(),
    ))
}

/// `POST /v1/sandboxes/{id}/hibernate`: with an optional
/// [`crate::wire::HibernateBody`] (what it keeps, the guest's check).
pub async fn hibernate_sandbox<S: SandboxApi>(
    st: Api<S>,
    id: Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<Json<OutcomeBody>> {
    let op = crate::wire::optional_body::<crate::wire::HibernateBody>(&body)?.lifecycle();
    lifecycle_sandbox(st, id, op).await
}

/// `POST /v1/sandboxes/{id}/connect`: with an optional
/// [`crate::wire::ConnectBody`] (how a hibernated sandbox wakes).
pub async fn connect_sandbox<S: SandboxApi>(
    st: Api<S>,
    id: Path<String>,
    body: axum::body::Bytes,
) -> ApiResult<Json<OutcomeBody>> {
    let op = crate::wire::optional_body::<crate::wire::ConnectBody>(&body)?.lifecycle();
    lifecycle_sandbox(st, id, op).await
}

/// `GET /v1/operations/{id}`: a command's journal entry (a cluster's);
/// a tenant sees only its own.
pub async fn get_operation<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let tenant = (!p.is_admin()).then(|| p.tenant.clone());
    Ok(Json(
        call(&st, move |s| async move {
            let s = &*s;
            s.operation(&id, tenant.as_deref()).await
        })
        .await?,
    ))
}

// Pods.

pub async fn list_pods<S: SandboxApi>(State(st): Api<S>) -> ApiResult<Json<PodList>> {
    let pods = call(&st, |s| async move { s.pod_entries().await }).await?;
    Ok(Json(PodList { pods }))
}

/// `GET /v1/pods/{id}`: one entry of `GET /v1/pods` (a remote pod that
/// does not answer is `reachable: false` with the error).
pub async fn get_pod<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let pods = call(&st, |s| async move { s.pod_entries().await }).await?;
    pods.into_iter()
        .find(|p| p["id"] == id.as_str())
        .map(Json)
        .ok_or_else(|| ApiError::from(ServiceError::NotFound { kind: "pod", id }))
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
    let view = call(&st, move |s| async move {
        let s = &*s;
        s.set_pod(&id, patch.oversubscription_ratio, patch.high_watermark)
            .await
    })
    .await?;
    Ok(Json(view.into()))
}
