//! E2B's volume content API (`spec/openapi-volumecontent.yml`; the SDKs'
//! `Volume.list`, `make_dir`, `get_info`, `exists`, `update_metadata`,
//! `read_file`, `write_file`, `remove`): `/volumecontent/{volumeID}/dir`,
//! `/file` and `/path`, the path in the query. Authorised by the volume's
//! token (`Authorization: Bearer <token>`, what `POST /volumes` and `GET
//! /volumes/{id}` answer), not the API key; on the API's listener, which
//! the SDKs reach as `E2B_VOLUME_API_URL` (default `https://api.<domain>`,
//! the API's own host). Errors are this API's `{"code": "<status>",
//! "message"}` (a string code). Files stream both ways; every path is
//! resolved beneath the volume ([`torpor_gate::volumes::fs`]).

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Path};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::request::query_pairs;
use torpor_gate::backend::SandboxApi;
use torpor_gate::handlers::{Api, AppState};
use torpor_gate::service::ServiceError;
use torpor_gate::volumes::fs::{EntryStat, FsError, Meta, VolumePath};
use torpor_gate::volumes::Volume;

/// Bytes read from a file per chunk of a download.
const CHUNK: usize = 256 * 1024;

/// An error of the volume content API: its status and message, answered
/// as `{"code": "<status>", "message"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContentError {
    pub status: StatusCode,
    pub message: String,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: String,
    message: &'a str,
}

impl ContentError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ContentError {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<FsError> for ContentError {
    fn from(e: FsError) -> Self {
        if let FsError::Io { .. } = &e {
            tracing::warn!(error = %e, "volume content call failed");
        }
        let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        ContentError::new(status, e.to_string())
    }
}

impl IntoResponse for ContentError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            code: self.status.as_u16().to_string(),
            message: &self.message,
        };
        let mut r = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

type ContentResult<T> = Result<T, ContentError>;

/// What every content call names: the volume (its bearer token checked:
/// 401 alike for a missing or wrong token and an unknown volume, before
/// anything else is read), the query's `path` (required) and its other
/// pairs.
pub struct Target {
    volume: Arc<Volume>,
    path: VolumePath,
    query: BTreeMap<String, String>,
}

impl<S: SandboxApi> FromRequestParts<AppState<S>> for Target {
    type Rejection = ContentError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState<S>,
    ) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| ContentError::bad_request(e.body_text()))?;
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                ContentError::new(
                    StatusCode::UNAUTHORIZED,
                    "missing `Authorization: Bearer <volume token>`",
                )
            })?;
        let volume = state
            .tenancy
            .volumes
            .authorize(&id, token)
            .map_err(|e| ContentError::new(StatusCode::UNAUTHORIZED, e.to_string()))?;
        let query = query_pairs(parts.uri.query().map(str::to_string));
        let path = query
            .get("path")
            .ok_or_else(|| ContentError::bad_request("the query's `path` is required"))?;
        Ok(Target {
            volume,
            path: VolumePath::parse(path)?,
            query,
        })
    }
}

impl Target {
    /// The filesystem call `f` on the volume and path, on a blocking
    /// thread.
    async fn run<T: Send + 'static>(
        self,
        f: impl FnOnce(&Volume, &VolumePath) -> Result<T, FsError> + Send + 'static,
    ) -> ContentResult<T> {
        let (v, path) = (self.volume, self.path);
        super::volumes::blocking(
            move || f(&v, &path).map_err(ContentError::from),
            |m| ContentError::new(StatusCode::INTERNAL_SERVER_ERROR, m),
        )
        .await
    }
}

fn number(q: &BTreeMap<String, String>, key: &str) -> ContentResult<Option<u32>> {
    q.get(key)
        .map(|v| {
            v.parse::<u32>().map_err(|_| {
                ContentError::bad_request(format!(
                    "`{key}` {v:?} is not a number from 0 to 4294967295"
                ))
            })
        })
        .transpose()
}

fn flag(q: &BTreeMap<String, String>, key: &str) -> ContentResult<bool> {
    match q.get(key).map(String::as_str) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(v) => Err(ContentError::bad_request(format!(
            "`{key}` {v:?} is neither true nor false"
        ))),
    }
}

fn meta_of(q: &BTreeMap<String, String>) -> ContentResult<Meta> {
    Ok(Meta {
        uid: number(q, "uid")?,
        gid: number(q, "gid")?,
        mode: number(q, "mode")?,
    })
}

/// E2B's `VolumeEntryStat`.
#[derive(Debug, Serialize)]
struct StatBody {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    size: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    atime: String,
    mtime: String,
    ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<String>,
}

fn stat_body(e: EntryStat) -> StatBody {
    StatBody {
        name: e.name,
        kind: e.kind.as_str(),
        path: e.path,
        size: e.size,
        mode: e.mode,
        uid: e.uid,
        gid: e.gid,
        atime: super::time::format(e.atime),
        mtime: super::time::format(e.mtime),
        ctime: super::time::format(e.ctime),
        target: e.target,
    }
}

/// `GET /volumecontent/{id}/dir?path&depth`: the directory's entries
/// (`depth` levels, 1 by default).
pub async fn list_dir(t: Target) -> ContentResult<Response> {
    let depth = number(&t.query, "depth")?.unwrap_or(1);
    let entries = t.run(move |v, path| v.content.list(path, depth)).await?;
    let body: Vec<StatBody> = entries.into_iter().map(stat_body).collect();
    Ok(Json(body).into_response())
}

/// `POST /volumecontent/{id}/dir?path&uid&gid&mode&force`: 201 with the
/// directory made.
pub async fn make_dir(t: Target) -> ContentResult<Response> {
    let (meta, force) = (meta_of(&t.query)?, flag(&t.query, "force")?);
    let made = t
        .run(move |v, path| v.content.make_dir(path, &meta, force))
        .await?;
    Ok((StatusCode::CREATED, Json(stat_body(made))).into_response())
}

/// `GET /volumecontent/{id}/path?path`: the entry's metadata.
pub async fn get_path(t: Target) -> ContentResult<Response> {
    let st = t.run(|v, path| v.content.stat(path)).await?;
    Ok(Json(stat_body(st)).into_response())
}

/// `PATCH /volumecontent/{id}/path?path`'s body.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchBody {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

/// `PATCH /volumecontent/{id}/path?path` `{uid, gid, mode}`: the entry
/// with its new owner and mode.
pub async fn patch_path(t: Target, bytes: Bytes) -> ContentResult<Response> {
    let body: PatchBody = serde_json::from_slice(&bytes)
        .map_err(|e| ContentError::bad_request(format!("invalid metadata: {e}")))?;
    let meta = Meta {
        uid: body.uid,
        gid: body.gid,
        mode: body.mode,
    };
    let st = t
        .run(move |v, path| v.content.set_meta(path, &meta))
        .await?;
    Ok(Json(stat_body(st)).into_response())
}

/// `DELETE /volumecontent/{id}/path?path`: 204, a directory with all in it.
pub async fn delete_path(t: Target) -> ContentResult<Response> {
    t.run(|v, path| v.content.remove(path)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /volumecontent/{id}/file?path`: the file's bytes, streamed
/// (`application/octet-stream`, its length).
pub async fn read_file(t: Target) -> ContentResult<Response> {
    let (mut file, size) = t.run(|v, path| v.content.open_file(path)).await?;
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    // A client gone away drops the receiver: stop reading.
                    if tx.blocking_send(Bytes::copy_from_slice(&buf[..n])).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    // The body ends short of its length: the client sees
                    // a failed transfer, not a shorter file.
                    tracing::warn!(error = %e, "volume file read failed");
                    return;
                }
            }
        }
    });
    let mut r = (
        StatusCode::OK,
        Body::from_stream(torpor_gate::relay::Chunks(rx)),
    )
        .into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
    Ok(r)
}

/// `PUT /volumecontent/{id}/file?path&uid&gid&mode&force`: the body
/// streamed into the file (replacing one only with `force`), 201 with
/// the file's metadata; 413 past the volume's size.
pub async fn write_file<S: SandboxApi>(
    state: Api<S>,
    t: Target,
    headers: HeaderMap,
    body: Body,
) -> ContentResult<Response> {
    let (meta, force) = (meta_of(&t.query)?, flag(&t.query, "force")?);
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let (v, path) = (t.volume, t.path);
    let limit = v.content.limit();
    if declared.is_some_and(|n| n > limit) {
        return Err(FsError::TooLarge { limit }.into());
    }
    let written = torpor_gate::body::with_body(&state, body, move |_, mut reader| async move {
        tokio::task::spawn_blocking(move || v.content.write_file(&path, &mut reader, &meta, force))
            .await
            .map_err(|e| ServiceError::Internal(format!("the volume write failed: {e}")))
    })
    .await
    .map_err(|e| ContentError::new(e.status, e.message))??;
    Ok((StatusCode::CREATED, Json(stat_body(written))).into_response())
}
