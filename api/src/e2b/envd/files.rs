//! envd's file transfer: `GET /files?path=P[&username=U]` downloads a file,
//! `POST /files?path=P` with an `application/octet-stream` body uploads
//! one (the SDKs' octet-stream upload, envd ≥ 0.5.7), through the guest
//! agent's read and write (a paused sandbox is woken first). A relative
//! path is under the user's home (`/home/<user>`, `/root` for root; `user`
//! when no username is given). Not offered yet: `multipart/form-data`
//! uploads (the SDKs' default for in-memory data) and gzip bodies, both
//! refused with 400 rather than misread.

use axum::body::Bytes;
use axum::extract::RawQuery;
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use torpor_scheduler::model::SandboxId;

use super::super::error::E2bError;
use super::super::wire::e2b_state;
use super::sandbox_of;
use crate::backend::SandboxApi;
use crate::handlers::{call, Api};

/// The user envd runs as when a request names none.
pub const DEFAULT_USER: &str = "user";

/// The absolute path `path` names for `user`.
pub fn resolve(path: &str, user: Option<&str>) -> Result<String, E2bError> {
    if path.is_empty() {
        return Err(E2bError::bad_request("missing `path`"));
    }
    if path.starts_with('/') {
        return Ok(path.to_string());
    }
    let user = user.filter(|u| !u.is_empty()).unwrap_or(DEFAULT_USER);
    if user.contains('/') || user == "." || user == ".." {
        return Err(E2bError::bad_request(format!("bad username {user:?}")));
    }
    let home = if user == "root" {
        "/root".to_string()
    } else {
        format!("/home/{user}")
    };
    let rest = path.strip_prefix("~/").unwrap_or(path);
    Ok(format!("{home}/{rest}"))
}

fn query(raw: Option<String>) -> (Option<String>, Option<String>) {
    let mut path = None;
    let mut user = None;
    for (k, v) in form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "path" => path = Some(v.into_owned()),
            "username" => user = Some(v.into_owned()),
            _ => {}
        }
    }
    (path, user)
}

/// The sandbox an envd request is for, `None` when it is unknown, failed or
/// killed (E2B's proxy answers those 502: [`gone`]).
fn target<S: SandboxApi>(s: &S, id: &str) -> Option<SandboxId> {
    if !SandboxId::is_well_formed(id) {
        return None;
    }
    let sandbox = s.get_sandbox(&SandboxId::new(id)).ok()?;
    e2b_state(sandbox.state).map(|_| sandbox.id)
}

fn gone() -> E2bError {
    E2bError::new(StatusCode::BAD_GATEWAY, "the sandbox is not found")
}

/// `GET /files`.
pub async fn download<S: SandboxApi>(
    state: Api<S>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Result<Response, E2bError> {
    let id = sandbox_of(&headers)?;
    let (path, user) = query(raw);
    let path = resolve(path.as_deref().unwrap_or_default(), user.as_deref())?;
    let data = call(&state, move |s| match target(s, &id) {
        Some(id) => Ok(Some(s.read_file(&id, &path)?.value)),
        None => Ok(None),
    })
    .await?
    .ok_or_else(gone)?;
    let mut r = (StatusCode::OK, data).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    Ok(r)
}

/// An uploaded file, as envd answers (`EntryInfo`).
#[derive(Debug, Serialize)]
pub struct Written {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
}

/// `POST /files` (octet-stream).
pub async fn upload<S: SandboxApi>(
    state: Api<S>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, E2bError> {
    let id = sandbox_of(&headers)?;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !content_type.starts_with("application/octet-stream") {
        return Err(E2bError::bad_request(format!(
            "uploads as {content_type:?} are not offered yet: use application/octet-stream \
             (the SDKs' `use_octet_stream=True`)"
        )));
    }
    if headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() != b"identity")
    {
        return Err(E2bError::bad_request(
            "compressed uploads (Content-Encoding) are not offered yet",
        ));
    }
    let (path, user) = query(raw);
    let path = resolve(path.as_deref().unwrap_or_default(), user.as_deref())?;
    let written = call(&state, move |s| {
        let Some(id) = target(s, &id) else {
            return Ok(None);
        };
        s.write_file(&id, &path, &body, None)?;
        let name = path.rsplit('/').next().unwrap_or_default().to_string();
        Ok(Some(vec![Written {
            name,
            kind: "file",
            path,
        }]))
    })
    .await?
    .ok_or_else(gone)?;
    Ok(Json(written).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_are_under_the_users_home() {
        assert_eq!(resolve("/etc/hostname", None).unwrap(), "/etc/hostname");
        assert_eq!(resolve("a.txt", None).unwrap(), "/home/user/a.txt");
        assert_eq!(resolve("~/a.txt", Some("bob")).unwrap(), "/home/bob/a.txt");
        assert_eq!(resolve("a/b", Some("root")).unwrap(), "/root/a/b");
        assert!(resolve("", None).is_err());
        assert!(resolve("a", Some("../etc")).is_err());
        assert!(resolve("a", Some("..")).is_err());
    }
}
