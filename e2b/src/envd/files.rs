//! envd's file transfer: `GET /files?path=P[&username=U]` downloads a file,
//! `POST /files?path=P` uploads one or more (an `application/octet-stream`
//! body, or `multipart/form-data` `file` parts), through the guest agent's
//! read and write (a paused sandbox is woken first). A relative path is
//! under the user's home (`/home/<user>`, `/root` for root; `user` when no
//! username is given). As envd: downloads are gzip-compressed when
//! `Accept-Encoding` asks, gzip uploads (`Content-Encoding`) are
//! decompressed ([`super::encoding`]), and `X-Metadata-<key>: <value>`
//! headers become each uploaded file's user metadata (keys lowercased;
//! the whole set replaced, so an upload without them clears it), answered
//! back per file. The caller shows the sandbox's access token
//! (`X-Access-Token`) or an API key (`X-API-KEY`).

use axum::body::Bytes;
use axum::extract::RawQuery;
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use serde::Serialize;
use std::collections::BTreeMap;
use torpor_agent::ClientError;
use torpor_scheduler::model::{Sandbox, SandboxId};
use torpor_scheduler::service::guest::AgentLink;
use torpor_scheduler::service::GuestError;

use super::super::error::E2bError;
use super::super::wire::e2b_state;
use super::encoding::{self, Coding};
use super::sandbox_of;
use subtle::ConstantTimeEq;
use torpor_gate::auth::{Auth, Principal};
use torpor_gate::backend::SandboxApi;
use torpor_gate::handlers::{call, Api};
use torpor_gate::service::ServiceError;

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

/// Who a request is: an accepted API key (its tenant), or the access token
/// it shows.
pub(crate) struct Caller {
    key: Option<Principal>,
    token: Option<Vec<u8>>,
    /// A traffic access token (`E2B-Traffic-Access-Token`): read only for
    /// a guest port's traffic ([`Caller::for_ports`]), never for envd.
    traffic: Option<Vec<u8>>,
}

/// `a == b` in constant time (for equal lengths).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

impl Caller {
    /// A caller of a guest port: an API key, the sandbox's access token
    /// or its traffic token.
    pub(crate) fn for_ports(headers: &HeaderMap, auth: &Auth) -> Self {
        let mut caller = Caller::of(headers, auth);
        caller.traffic = headers
            .get(super::super::TRAFFIC_HEADER)
            .map(|v| v.as_bytes().trim_ascii().to_vec());
        caller
    }

    /// Whether the request shows any credential at all (a key that was
    /// not accepted counts: it is refused as another tenant's).
    pub(crate) fn shows_any(headers: &HeaderMap) -> bool {
        [
            super::super::API_KEY_HEADER,
            ACCESS_TOKEN_HEADER,
            super::super::TRAFFIC_HEADER,
        ]
        .iter()
        .any(|h| headers.contains_key(*h))
    }

    pub(super) fn of(headers: &HeaderMap, auth: &Auth) -> Self {
        let key = headers
            .get(super::super::API_KEY_HEADER)
            .and_then(|k| auth.principal(k.as_bytes().trim_ascii()));
        let token = headers
            .get(ACCESS_TOKEN_HEADER)
            .map(|v| v.as_bytes().trim_ascii().to_vec());
        Caller {
            key,
            token,
            traffic: None,
        }
    }

    /// An API key of the sandbox's tenant (or an admin's), or the
    /// sandbox's own access token (compared in constant time). Another
    /// tenant's key sees no such sandbox.
    fn may_use(&self, sandbox: &Sandbox) -> Result<(), Refused> {
        if let Some(p) = &self.key {
            return if p.is_admin() || p.sees(sandbox.tenant.as_deref()) {
                Ok(())
            } else {
                Err(Refused::Gone)
            };
        }
        let Some(issued) = &sandbox.access_token else {
            return Err(Refused::Unauthorized);
        };
        if self
            .token
            .as_ref()
            .is_some_and(|t| same(t, issued.as_bytes()))
        {
            return Ok(());
        }
        let traffic = super::super::traffic_token(issued);
        if self
            .traffic
            .as_ref()
            .is_some_and(|t| same(t, traffic.as_bytes()))
        {
            return Ok(());
        }
        Err(Refused::Unauthorized)
    }
}

/// The header of a sandbox's envd access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";

/// Why a request cannot reach a sandbox's files.
pub(crate) enum Refused {
    /// Unknown, failed or killed, or another tenant's: 502, as E2B's
    /// proxy answers.
    Gone,
    /// Neither the API key nor the sandbox's access token: 401.
    Unauthorized,
}

impl From<Refused> for E2bError {
    fn from(r: Refused) -> Self {
        match r {
            Refused::Gone => E2bError::new(StatusCode::BAD_GATEWAY, "the sandbox is not found"),
            Refused::Unauthorized => E2bError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong X-Access-Token (or X-API-KEY)",
            ),
        }
    }
}

/// The sandbox an envd request is for, if the caller may use it; the
/// service's error when it cannot tell (a cluster sandbox whose pod is
/// down: 503, as its other routes).
pub(crate) async fn target<S: SandboxApi>(
    s: &S,
    id: &str,
    caller: &Caller,
) -> Result<Result<SandboxId, Refused>, ServiceError> {
    Ok(target_sandbox(s, id, caller).await?.map(|s| s.id))
}

/// [`target`], the sandbox as it read.
pub(crate) async fn target_sandbox<S: SandboxApi>(
    s: &S,
    id: &str,
    caller: &Caller,
) -> Result<Result<Sandbox, Refused>, ServiceError> {
    if !SandboxId::is_well_formed(id) {
        return Ok(Err(Refused::Gone));
    }
    let sandbox = match s.get_sandbox(&SandboxId::new(id)).await {
        Ok(sandbox) => sandbox,
        Err(ServiceError::NotFound { .. }) => return Ok(Err(Refused::Gone)),
        Err(e) => return Err(e),
    };
    if e2b_state(sandbox.state).is_none() {
        return Ok(Err(Refused::Gone));
    }
    Ok(caller.may_use(&sandbox).map(|()| sandbox))
}

/// `GET /files`.
pub async fn download<S: SandboxApi>(
    state: Api<S>,
    Extension(auth): Extension<Auth>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> Result<Response, E2bError> {
    let id = sandbox_of(&headers)?;
    let caller = Caller::of(&headers, &auth);
    let (path, user) = query(raw);
    let path = resolve(path.as_deref().unwrap_or_default(), user.as_deref())?;
    let coding = encoding::accepted(&headers)?;
    let tenancy = state.tenancy.clone();
    let data = call(&state, move |s| async move {
        let s = &*s;
        match target(s, &id, &caller).await? {
            Ok(id) => {
                let _wake = super::wake_ticket(s, &tenancy, &id).await?;
                let data = s.read_file(&id, &path).await?.value;
                // Compressed in place (the worker hands its tasks on).
                Ok(Ok(match coding {
                    Coding::Gzip => torpor_gate::backend::blocking(|| encoding::gzip(&data)),
                    Coding::Identity => data,
                }))
            }
            Err(refused) => Ok(Err(refused)),
        }
    })
    .await??;
    let mut r = (StatusCode::OK, data).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    if coding == Coding::Gzip {
        h.insert(
            header::CONTENT_ENCODING,
            HeaderValue::from_static(Coding::Gzip.name()),
        );
    }
    Ok(r)
}

/// The prefix of the headers that carry an upload's metadata.
pub const METADATA_HEADER_PREFIX: &str = "x-metadata-";

/// An upload's metadata: every `X-Metadata-<key>` header (the first value
/// of each), keys lowercased (header names are); refused (400) as the
/// agent would refuse it.
pub fn metadata_of(headers: &HeaderMap) -> Result<BTreeMap<String, String>, E2bError> {
    let mut out = BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER_PREFIX) else {
            continue;
        };
        let value = value.to_str().map_err(|_| {
            E2bError::bad_request(format!("metadata {key:?}: printable ASCII only"))
        })?;
        out.entry(key.to_string())
            .or_insert_with(|| value.to_string());
    }
    torpor_agent::xattrs::validate(&out)
        .map_err(|e| E2bError::bad_request(format!("invalid metadata: {}", e.message)))?;
    Ok(out)
}

/// Gives the file at `path` exactly `metadata`, and answers what it now
/// holds. As envd, a filesystem without user xattrs keeps none (and the
/// answer says so); an agent older than protocol 1.2 has no metadata: an
/// empty set is then nothing to do, a non-empty one `unimplemented`. An
/// empty set clears what an earlier upload left, and is then all the file
/// holds: a file gone meanwhile has nothing to clear.
/// Writes an upload as envd does: the file, and the directories made for
/// it, belong to the request's user (`user` by default; when the guest has
/// no such default user, to the agent's own).
async fn write_owned<S: SandboxApi>(
    s: &S,
    id: &SandboxId,
    path: &str,
    data: &[u8],
    user: Option<&str>,
) -> Result<(), ServiceError> {
    let owner = user.unwrap_or(DEFAULT_USER);
    match s.write_file_as(id, path, data, None, Some(owner)).await {
        Err(ServiceError::Guest(GuestError::Agent { error, .. }))
            if user.is_none() && super::rpc::unknown_user(&error) =>
        {
            s.write_file(id, path, data, None).await.map(drop)
        }
        r => r.map(drop),
    }
}

fn store_metadata(
    link: &AgentLink,
    path: &str,
    metadata: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, GuestError> {
    let limit = Some(link.file_limit);
    let mut client = link.connect(limit)?;
    match client.set_metadata(path, metadata.clone()) {
        Ok(()) => {}
        Err(ClientError::Agent(e))
            if e.code == "EOPNOTSUPP"
                || (metadata.is_empty() && (e.code == "ENOSYS" || e.code == "ENOENT")) => {}
        Err(e) => return Err(link.error(e, limit)),
    }
    if metadata.is_empty() {
        return Ok(BTreeMap::new());
    }
    match client.stat(path, true) {
        Ok(st) => Ok(st.metadata),
        Err(e) => Err(link.error(e, limit)),
    }
}

/// An uploaded file, as envd answers (`EntryInfo`).
#[derive(Debug, Serialize)]
pub struct Written {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    /// The file's metadata after the upload; absent when it has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// The API's request body limit, which bounds a decompressed upload too.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

/// `POST /files` (octet-stream or multipart, either possibly gzipped).
pub async fn upload<S: SandboxApi>(
    state: Api<S>,
    Extension(auth): Extension<Auth>,
    Extension(BodyLimit(limit)): Extension<BodyLimit>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, E2bError> {
    let id = sandbox_of(&headers)?;
    let caller = Caller::of(&headers, &auth);
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let multipart = content_type.starts_with("multipart/form-data");
    if !multipart && !content_type.starts_with("application/octet-stream") {
        return Err(E2bError::bad_request(format!(
            "uploads as {content_type:?} are not offered: use multipart/form-data or \
             application/octet-stream"
        )));
    }
    let coding = encoding::content(&headers)?;
    let metadata = metadata_of(&headers)?;
    let body = match coding {
        Coding::Identity => body,
        Coding::Gzip => tokio::task::spawn_blocking(move || encoding::gunzip(&body, limit))
            .await
            .map_err(|e| {
                E2bError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("decompressing: {e}"),
                )
            })??
            .into(),
    };
    let (path, user) = query(raw);
    // What goes where: the body to `path`, or each multipart file to
    // `path` (one file) or to its own file name (several).
    let files: Vec<(String, Bytes)> = if multipart {
        let parts = multipart_files(content_type, body).await?;
        if parts.len() == 1 && path.is_some() {
            let data = parts.into_iter().next().map(|(_, d)| d).unwrap_or_default();
            vec![(
                resolve(path.as_deref().unwrap_or_default(), user.as_deref())?,
                data,
            )]
        } else {
            parts
                .into_iter()
                .map(|(name, data)| Ok((resolve(&name, user.as_deref())?, data)))
                .collect::<Result<_, E2bError>>()?
        }
    } else {
        vec![(
            resolve(path.as_deref().unwrap_or_default(), user.as_deref())?,
            body,
        )]
    };
    let tenancy = state.tenancy.clone();
    let written = call(&state, move |s| async move {
        let s = &*s;
        let id = match target(s, &id, &caller).await? {
            Ok(id) => id,
            Err(refused) => return Ok(Err(refused)),
        };
        let _wake = super::wake_ticket(s, &tenancy, &id).await?;
        let mut written = Vec::with_capacity(files.len());
        for (path, data) in files {
            write_owned(s, &id, &path, &data, user.as_deref()).await?;
            let mut kept = BTreeMap::new();
            s.with_guest(&id, &mut |link| {
                kept = store_metadata(link, &path, &metadata)?;
                Ok(())
            })
            .await?;
            let name = path.rsplit('/').next().unwrap_or_default().to_string();
            written.push(Written {
                name,
                kind: "file",
                path,
                metadata: (!kept.is_empty()).then_some(kept),
            });
        }
        Ok(Ok(written))
    })
    .await??;
    Ok(Json(written).into_response())
}

/// Most files one multipart upload may carry.
const MAX_PARTS: usize = 64;

/// The `file` parts of a multipart body (already bounded by the API's
/// body limit): each part's file name (the SDKs put the guest path there)
/// and its bytes.
async fn multipart_files(
    content_type: &str,
    body: Bytes,
) -> Result<Vec<(String, Bytes)>, E2bError> {
    let bad = |e: multer::Error| E2bError::bad_request(format!("malformed multipart body: {e}"));
    let boundary = multer::parse_boundary(content_type).map_err(bad)?;
    let mut form = multer::Multipart::with_reader(std::io::Cursor::new(body), boundary);
    let mut files = Vec::new();
    while let Some(field) = form.next_field().await.map_err(bad)? {
        if field.name() != Some("file") {
            continue;
        }
        if files.len() == MAX_PARTS {
            return Err(E2bError::bad_request(format!(
                "more than {MAX_PARTS} files in one upload"
            )));
        }
        let name = field
            .file_name()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| E2bError::bad_request("a multipart file without a file name"))?
            .to_string();
        files.push((name, field.bytes().await.map_err(bad)?));
    }
    if files.is_empty() {
        return Err(E2bError::bad_request(
            "no `file` part in the multipart body",
        ));
    }
    Ok(files)
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
