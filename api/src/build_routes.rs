//! `/v1`'s build routes: start a build (`POST /v1/templates` with a build
//! spec, or `POST /v1/builds`), read one with its current step and its log
//! from an offset, list, cancel; upload the files a COPY step copies.

use axum::body::Body;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use torpor_build::spec::BuildSpec;

use torpor_gate::auth::Principal;
use torpor_gate::backend::SandboxApi;
use torpor_gate::builds::surface::{scope, store, tenant_of, with_logs_from};
use torpor_gate::builds::{start, BuildRecord};
use torpor_gate::error::ApiError;
use torpor_gate::handlers::{call, created, Api, ApiResult};
use torpor_gate::tenancy::Limited;
use torpor_gate::wire::ApiJson;

/// `GET /v1/builds/{id}`'s query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildQuery {
    /// The first log entry to return (entries before it are left out).
    #[serde(default)]
    pub logs_offset: usize,
}

/// `GET /v1/builds/{id}`.
pub async fn get<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<BuildQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let build = st.tenancy.builds.get(&id, scope(&p).as_deref())?;
    Ok(Json(with_logs_from(build.record(), q.logs_offset)).into_response())
}

/// `GET /v1/builds`'s answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct BuildList {
    /// Newest first, without their logs.
    pub builds: Vec<BuildRecord>,
}

/// `GET /v1/builds`.
pub async fn list<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
) -> ApiResult<Response> {
    let mut builds = st.tenancy.builds.list(scope(&p).as_deref());
    for b in &mut builds {
        b.logs_dropped += b.logs.len();
        b.logs.clear();
    }
    Ok(Json(BuildList { builds }).into_response())
}

/// `POST /v1/builds/{id}/cancel`: the build stops before its next step
/// (the step running is killed in the guest); 409 once it has finished.
pub async fn cancel<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let build = st.tenancy.builds.get(&id, scope(&p).as_deref())?;
    if build.record().status.finished() {
        return Err(ApiError::from(
            crate::service::ServiceError::ResourceConflict(format!("build {id} has finished")),
        ));
    }
    build.cancel.cancel();
    Ok((StatusCode::ACCEPTED, Json(build.record())).into_response())
}

/// `GET /v1/build-files/{hash}`'s answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct FilesPresence {
    pub hash: String,
    pub present: bool,
}

/// `GET /v1/build-files/{hash}`: whether the caller has uploaded them.
pub async fn files_present<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path(hash): Path<String>,
) -> ApiResult<Response> {
    let present = st
        .tenancy
        .builds
        .files
        .present(tenant_of(&p).as_deref(), &hash)?;
    Ok(Json(FilesPresence { hash, present }).into_response())
}

/// `PUT /v1/build-files/{hash}`: a gzip'd tar of the files (at most the
/// API's upload limit), the caller's.
pub async fn upload<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path(hash): Path<String>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let kind = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        });
    if !kind.as_deref().is_some_and(|k| UPLOAD_TYPES.contains(&k)) {
        return Err(ApiError::new(
            axum::http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
            crate::error::code::UNSUPPORTED_MEDIA_TYPE,
            format!("expected a tar archive's body with `Content-Type:` one of {UPLOAD_TYPES:?}"),
        ));
    }
    store(&st, tenant_of(&p), hash, body).await
}

/// The media types of a build's files upload.
const UPLOAD_TYPES: [&str; 4] = [
    "application/octet-stream",
    "application/gzip",
    "application/x-gzip",
    "application/x-tar",
];

/// `POST /v1/templates`: built by steps when the body is a build spec (it
/// has `from`: [`create`]), else booted from an image
/// ([`crate::sandbox_routes::create_booted_template`]).
pub async fn create_template<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> ApiResult<Response> {
    if body.get("from").is_some() {
        return create_from(&st, p, body).await;
    }
    crate::sandbox_routes::create_booted_template(st, p, body).await
}

/// `POST /v1/builds`: `{"name": ..., <a build spec>}` (torpor-build's
/// `BuildSpec`: `from`, `steps`, `start`, `skip_cache`, `cpu_count`,
/// `memory_mib`): 202 with the build's record and `Location`.
pub async fn create<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> ApiResult<Response> {
    create_from(&st, p, body).await
}

/// A build of body `body` (see [`create`]) for `p`.
pub(crate) async fn create_from<S: SandboxApi>(
    st: &torpor_gate::handlers::AppState<S>,
    p: Principal,
    mut body: serde_json::Value,
) -> ApiResult<Response> {
    let invalid = |e: &dyn std::fmt::Display| {
        ApiError::invalid(format!(
            "Failed to deserialize the JSON body into the target type: {e}"
        ))
    };
    let object = body
        .as_object_mut()
        .ok_or_else(|| ApiError::invalid("the body must be a JSON object"))?;
    let name = match object.remove("name") {
        Some(serde_json::Value::String(n)) => n,
        Some(_) => return Err(invalid(&"name: a string")),
        None => return Err(invalid(&"missing field `name`")),
    };
    let spec: BuildSpec = serde_json::from_value(body).map_err(|e| invalid(&e))?;
    start::check_name(&name)?;
    let _permit = st.tenancy.limiter.acquire(&p).map_err(Limited)?;
    let tenancy = st.tenancy.clone();
    let record = call(st, move |_| async move {
        let tenant = tenant_of(&p);
        start::admit_build(&tenancy, tenant.as_deref())?;
        let prepared = start::prepare(&tenancy, &p, spec, &name, tenant.as_deref()).await?;
        let build = tenancy.builds.begin(tenant, &name, vec!["default".into()]);
        start::start(&tenancy, &p, &build, prepared);
        Ok(build.record())
    })
    .await?;
    Ok(created(format!("/v1/builds/{}", record.id), true, record))
}
