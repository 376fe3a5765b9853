//! E2B's volumes (`Volume` in the SDKs): `/volumes` (create, list, get,
//! delete; the API key's tenant's only, another tenant's is 404) over
//! [`torpor_gate::volumes`], and `volumeMounts` on create, refused. The
//! content API (`/volumecontent/...`, the volume's token) is
//! [`super::volume_content`].

use axum::body::Bytes;
use axum::extract::{Extension, Path};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::E2bError;
use super::request::{body, permit};
use torpor_gate::auth::Principal;
use torpor_gate::backend::SandboxApi;
use torpor_gate::handlers::Api;
use torpor_gate::service::VolumeMountRequest;
use torpor_gate::volumes::{Volume, VolumeError};

type E2bResult<T> = Result<T, E2bError>;

impl From<VolumeError> for E2bError {
    fn from(e: VolumeError) -> Self {
        let status = match &e {
            VolumeError::BadName | VolumeError::TooMany(_) => StatusCode::BAD_REQUEST,
            VolumeError::Exists(_) => StatusCode::CONFLICT,
            VolumeError::NotFound(_) => StatusCode::NOT_FOUND,
            VolumeError::BadToken => StatusCode::UNAUTHORIZED,
            VolumeError::NoDirectory => StatusCode::SERVICE_UNAVAILABLE,
            VolumeError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        E2bError::new(status, e.to_string())
    }
}

/// `POST /volumes`'s body (E2B's `NewVolume`).
#[derive(Debug, Deserialize)]
struct NewVolume {
    name: String,
}

/// E2B's `Volume` (the list's items).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct VolumeInfo<'a> {
    #[serde(rename = "volumeID")]
    volume_id: &'a str,
    name: &'a str,
}

/// E2B's `VolumeAndToken` (create and get); no `domain`: the content API
/// is this server's.
#[derive(Debug, Serialize)]
struct VolumeAndToken<'a> {
    #[serde(rename = "volumeID")]
    volume_id: &'a str,
    name: &'a str,
    token: &'a str,
}

fn with_token(v: &Volume) -> VolumeAndToken<'_> {
    VolumeAndToken {
        volume_id: &v.record.id,
        name: &v.record.name,
        token: &v.record.token,
    }
}

/// `f` on a blocking thread (the filesystem work of a volume call), off
/// the async ones; a panic in it is `failed(why)`.
pub(super) async fn blocking<T: Send + 'static, E: Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
    failed: impl FnOnce(String) -> E,
) -> Result<T, E> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(failed(format!("the volume call failed: {e}"))),
    }
}

fn internal(why: String) -> E2bError {
    E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, why)
}

/// `POST /volumes`: 201 with the volume and its token; 400 for a name not
/// of `[a-zA-Z0-9_-]` or past the tenant's count, 409 for a name the
/// tenant has.
pub async fn create<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let _permit = permit(&state, &p)?;
    let req: NewVolume = body(&bytes)?;
    let volumes = state.tenancy.volumes.clone();
    let tenant = p.owner().tenant;
    let v = blocking(
        move || volumes.create(&tenant, &req.name).map_err(E2bError::from),
        internal,
    )
    .await?;
    Ok((StatusCode::CREATED, Json(with_token(&v))).into_response())
}

/// `GET /volumes`: the tenant's volumes, oldest first.
pub async fn list<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
) -> E2bResult<Response> {
    let all = state.tenancy.volumes.list(&p.owner().tenant);
    let items: Vec<_> = all
        .iter()
        .map(|v| VolumeInfo {
            volume_id: &v.record.id,
            name: &v.record.name,
        })
        .collect();
    Ok(Json(items).into_response())
}

/// `GET /volumes/{id}`: the volume and its token.
pub async fn get<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> E2bResult<Response> {
    let v = state.tenancy.volumes.get(&p.owner().tenant, &id)?;
    Ok(Json(with_token(&v)).into_response())
}

/// `DELETE /volumes/{id}`: 204, its files gone.
pub async fn delete<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> E2bResult<Response> {
    let _permit = permit(&state, &p)?;
    let volumes = state.tenancy.volumes.clone();
    let tenant = p.owner().tenant;
    blocking(
        move || volumes.delete(&tenant, &id).map_err(E2bError::from),
        internal,
    )
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `volumeMounts` on create (`[{"name", "path"}]`; null or empty: none),
/// as the gate resolves them (`torpor_gate::tenancy::admit_create`: a
/// volume the tenant does not have is 404, as E2B's).
pub fn mounts(mounts: Option<&Value>) -> E2bResult<Vec<VolumeMountRequest>> {
    let items = match mounts {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(E2bError::bad_request(
                "volumeMounts is a list of {name, path}",
            ))
        }
    };
    items
        .iter()
        .map(|m| {
            let field = |k: &str| m.get(k).and_then(Value::as_str).map(str::to_string);
            match (field("name"), field("path")) {
                (Some(name), Some(path)) => Ok(VolumeMountRequest {
                    name,
                    path,
                    id: None,
                }),
                _ => Err(E2bError::bad_request(
                    "each of volumeMounts has a `name` and a `path`",
                )),
            }
        })
        .collect()
}
