//! The E2B control-plane handlers: decode E2B's JSON, call the backend
//! ([`torpor_gate::handlers::call`]), answer with E2B's JSON and status
//! codes. What each route maps to is in `docs/e2b.md`.

use axum::body::Bytes;
use axum::extract::{Extension, Path, RawQuery};
use axum::http::header::HeaderValue;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use torpor_scheduler::model::{
    HibernationKind, OnTimeout, Sandbox, SandboxId, Template, TemplateId, TemplateState, Timestamp,
};

use super::error::E2bError;
use super::request::{body, page_query, permit, query_pairs};
use super::wire::{
    e2b_state, page, ConnectBody, CreatedSandbox, Cursor, ForkBody, ForkResult, NewSandbox,
    PauseBody, RefreshBody, SandboxDetail, SnapshotBody, SnapshotInfo, TimeoutBody,
    DEFAULT_TIMEOUT_S, MAX_FORK_COUNT,
};
use torpor_gate::auth::Principal;
use torpor_gate::backend::{on_pod, Lifecycle, Needs, SandboxApi};
use torpor_gate::builds::Builds;
use torpor_gate::handlers::{call, Api};
use torpor_gate::quota::Usage;
use torpor_gate::service::{CreateSandbox, ForkSandbox, ServiceError, TemplateFromSandbox};
use torpor_gate::tenancy::{admit, admit_create, admit_wake};

type E2bResult<T> = Result<T, E2bError>;

/// An optional JSON body: empty is the default.
fn optional_body<T: DeserializeOwned + Default>(bytes: &Bytes) -> E2bResult<T> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        Ok(T::default())
    } else {
        body(bytes)
    }
}

/// Seconds to ms, 400 past what fits.
fn seconds(s: u64, what: &str) -> Result<u64, ServiceError> {
    s.checked_mul(1000)
        .ok_or_else(|| ServiceError::Invalid(format!("{what} {s} s is too large")))
}

fn gone(id: &str) -> ServiceError {
    ServiceError::NotFound {
        kind: "sandbox",
        id: id.to_string(),
    }
}

/// The sandbox if E2B would show it: not failed, not deleted (404).
pub(super) async fn live<S: SandboxApi>(s: &S, id: &str) -> Result<Sandbox, ServiceError> {
    if !SandboxId::is_well_formed(id) {
        return Err(gone(id));
    }
    let sandbox = s.get_sandbox(&SandboxId::new(id)).await?;
    match e2b_state(sandbox.state) {
        Some(_) => Ok(sandbox),
        None => Err(gone(id)),
    }
}

/// The template's name, E2B's `alias`.
async fn alias<S: SandboxApi>(s: &S, id: &TemplateId) -> String {
    match s.get_template(id).await {
        Ok(t) => t.name,
        Err(_) => listed_name(s, id).await.unwrap_or_default(),
    }
}

/// The name of template `id` as the templates are listed: a backend that
/// cannot read one template (a cluster replica: each pod's, listed from
/// their heartbeats) still names it.
async fn listed_name<S: SandboxApi>(s: &S, id: &TemplateId) -> Option<String> {
    s.template_entries()
        .await
        .ok()?
        .into_iter()
        .find(|t| t["id"] == id.as_str())
        .and_then(|t| t["name"].as_str().map(str::to_string))
}

/// Root filesystem size in MiB (0 for the probe, which has none).
fn disk_mb(t: Option<&Template>) -> u64 {
    t.and_then(|t| t.rootfs.as_ref())
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| m.len() >> 20)
        .unwrap_or(0)
}

pub(super) async fn detail<S: SandboxApi>(
    s: &S,
    builds: &Builds,
    sandbox: &Sandbox,
) -> Option<SandboxDetail> {
    let template = s.get_template(&sandbox.template).await.ok();
    let name = match &template {
        Some(t) => t.name.clone(),
        None => listed_name(s, &sandbox.template).await.unwrap_or_default(),
    };
    let mut d = SandboxDetail::new(sandbox, name, disk_mb(template.as_ref()))?;
    d.template_id = super::templates::e2b_id(builds, &d.template_id);
    Some(d)
}

/// A created (woken, forked) sandbox as E2B answers it: a built
/// template's id is its name ([`super::templates`]).
async fn created_sandbox<S: SandboxApi>(
    s: &S,
    builds: &Builds,
    sandbox: &Sandbox,
) -> CreatedSandbox {
    let mut c = CreatedSandbox::new(sandbox, alias(s, &sandbox.template).await);
    c.template_id = super::templates::e2b_id(builds, &c.template_id);
    c
}

/// Moves the sandbox's timeout to `secs` from now, unless it already ends
/// later or never (E2B's connect never shortens a sandbox's life).
async fn extend<S: SandboxApi>(s: &S, id: &SandboxId, secs: u64) -> Result<(), ServiceError> {
    let ms = seconds(secs, "timeout")?;
    let current = s.get_sandbox(id).await?.expires_at;
    let wanted = Timestamp::now().0.saturating_add(ms as i64);
    if current.is_some_and(|c| c.0 < wanted) {
        s.set_timeout(id, None, Some(ms)).await?;
    }
    Ok(())
}

/// A new envd access token: 128 random bits as hex.
fn new_access_token() -> String {
    torpor_scheduler::model::random_hex(16)
}

fn created(status: StatusCode, body: impl serde::Serialize) -> Response {
    (status, Json(body)).into_response()
}

/// `POST /sandboxes`, `POST /v2/sandboxes`: a sandbox from a template (id
/// or name; a snapshot is a template).
pub async fn create<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let mut req: NewSandbox = body(&bytes)?;
    let volume_mounts = super::volumes::mounts(req.volume_mounts.as_ref())?;
    req.refuse_unoffered()?;
    req.template_id =
        super::templates::resolve_tagged(&state.tenancy.builds, &principal, &req.template_id);
    let ingress_host = req.ingress_host()?;
    let network = req.network_policy()?;
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    let on_timeout = if req.auto_pause == Some(true) {
        OnTimeout::Hibernate
    } else {
        OnTimeout::Delete
    };
    let timeout_hibernation = if req.auto_pause_memory == Some(false) {
        HibernationKind::Filesystem
    } else {
        HibernationKind::Memory
    };
    let _permit = permit(&state, &principal)?;
    let tenancy = state.tenancy.clone();
    let out = call(&state, move |s| async move {
        let s = &*s;
        let mut create = CreateSandbox {
            template: req.template_id,
            timeout_ms: Some(seconds(timeout, "timeout")?),
            metadata: req.metadata.unwrap_or_default(),
            env: req.env_vars.unwrap_or_default(),
            on_timeout,
            timeout_hibernation,
            access_token: Some(new_access_token()),
            owner: Some(principal.owner()),
            network,
            ingress_host,
            volume_mounts,
            ..CreateSandbox::default()
        };
        let _ticket = admit_create(&tenancy, &principal, s, &mut create).await?;
        let sandbox = s.create_sandbox(create).await?;
        Ok(created_sandbox(s, &tenancy.builds, &sandbox).await)
    })
    .await?;
    let out = out.in_domain(&state.tenancy);
    Ok(created(StatusCode::CREATED, out))
}

/// `PUT /sandboxes/{id}/network` (`update_network`): replaces the egress
/// policy, as E2B's does (what is left out is cleared); 204.
pub async fn update_network<S: SandboxApi>(
    state: Api<S>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> E2bResult<StatusCode> {
    let req: super::network::E2bNetwork = body(&bytes)?;
    let patch = req.policy(None)?;
    call(&state, move |s| async move {
        let s = &*s;
        let sandbox = live(s, &id).await?;
        on_pod(s, Needs::Network, move |p| {
            p.set_network_policy(&sandbox.id, &patch)
        })
        .await
        .map(drop)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /sandboxes/{id}`.
pub async fn get<S: SandboxApi>(state: Api<S>, Path(id): Path<String>) -> E2bResult<Response> {
    let builds = state.tenancy.builds.clone();
    let out = call(&state, move |s| async move {
        let s = &*s;
        let sandbox = live(s, &id).await?;
        detail(s, &builds, &sandbox).await.ok_or_else(|| gone(&id))
    })
    .await?;
    Ok(Json(out).into_response())
}

/// `DELETE /sandboxes/{id}`: 204, 404 when unknown or already killed.
pub async fn kill<S: SandboxApi>(state: Api<S>, Path(id): Path<String>) -> E2bResult<StatusCode> {
    call(&state, move |s| async move {
        let s = &*s;
        let sandbox = live(s, &id).await?;
        s.delete_sandbox(&sandbox.id).await
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/pause`: hibernation (memory and disk kept, VMM
/// gone; with `memory: false` the disk only); 409 when it is paused
/// already; 503 when the guest agent does not answer and the body asks
/// for a healthy guest (or the disk only).
pub async fn pause<S: SandboxApi>(
    state: Api<S>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> E2bResult<StatusCode> {
    let op = optional_body::<PauseBody>(&bytes)?.lifecycle();
    call(&state, move |s| async move {
        let s = &*s;
        let sandbox = live(s, &id).await?;
        if e2b_state(sandbox.state) == Some("paused") {
            return Err(ServiceError::Conflict {
                id: id.clone(),
                state: sandbox.state,
                message: "the sandbox is already paused".into(),
            });
        }
        s.lifecycle(&sandbox.id, op).await.map(|_| ())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/connect`, `POST /v2/sandboxes/{id}/connect`:
/// wakes a paused sandbox (201) or finds it running (200); `timeout`
/// extends its life.
pub async fn connect<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let mut req: ConnectBody = optional_body(&bytes)?;
    req.timeout.get_or_insert(DEFAULT_TIMEOUT_S);
    wake(state, principal, id, req, false).await
}

/// `POST /sandboxes/{id}/resume` (E2B's deprecated resume): like connect,
/// but 409 on a running sandbox and E2B's default timeout when none is
/// given.
pub async fn resume<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let mut req: ConnectBody = optional_body(&bytes)?;
    req.timeout.get_or_insert(DEFAULT_TIMEOUT_S);
    wake(state, principal, id, req, true).await
}

/// Wakes the sandbox (admitted against the tenant's quotas, as on `/v1`).
async fn wake<S: SandboxApi>(
    state: Api<S>,
    principal: Principal,
    id: String,
    req: ConnectBody,
    refuse_running: bool,
) -> E2bResult<Response> {
    let op = if req.memory == Some(false) {
        Lifecycle::Reboot
    } else {
        Lifecycle::Connect
    };
    let tenancy = state.tenancy.clone();
    let (resumed, out) = call(&state, move |s| async move {
        let s = &*s;
        let sandbox = live(s, &id).await?;
        let _ticket = admit_wake(&tenancy, &principal, &sandbox).await?;
        if refuse_running && e2b_state(sandbox.state) == Some("running") {
            return Err(ServiceError::Conflict {
                id: id.clone(),
                state: sandbox.state,
                message: "the sandbox is already running".into(),
            });
        }
        // The new deadline first: a sandbox woken past its old one would
        // meet the policy's timeout before it.
        if let Some(t) = req.timeout {
            extend(s, &sandbox.id, t).await?;
        }
        let outcome = s.lifecycle(&sandbox.id, op).await?;
        let resumed = outcome.resumed;
        Ok((
            resumed,
            created_sandbox(s, &tenancy.builds, &outcome.sandbox).await,
        ))
    })
    .await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(created(status, out.in_domain(&state.tenancy)))
}

/// `POST /sandboxes/{id}/timeout`: the sandbox ends `timeout` s from now.
pub async fn set_timeout<S: SandboxApi>(
    state: Api<S>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> E2bResult<StatusCode> {
    let req: TimeoutBody = body(&bytes)?;
    call(&state, move |s| async move {
        let s = &*s;
        let sandbox = live(s, &id).await?;
        let ms = seconds(req.timeout, "timeout")?;
        s.set_timeout(&sandbox.id, None, Some(ms)).await.map(|_| ())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/refreshes`: extends the life to `duration` s from
/// now (E2B's default when absent), never shortening it.
pub async fn refresh<S: SandboxApi>(
    state: Api<S>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> E2bResult<StatusCode> {
    let req: RefreshBody = optional_body(&bytes)?;
    call(&state, move |s| async move {
        let s = &*s;
        let sandbox = live(s, &id).await?;
        extend(s, &sandbox.id, req.duration.unwrap_or(DEFAULT_TIMEOUT_S)).await
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A page as JSON, with the next page's token in `x-next-token`.
pub(super) fn paged<T: serde::Serialize>(items: Vec<T>, next: Option<String>) -> Response {
    let mut response = Json(items).into_response();
    if let Some(token) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        response.headers_mut().insert("x-next-token", token);
    }
    response
}

/// `POST /sandboxes/{id}/fork`: `count` (1 by default, at most 20) new
/// sandboxes from a snapshot of this one's current state; 201 with one
/// entry per fork, the sandbox or its error.
pub async fn fork<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let req: ForkBody = optional_body(&bytes)?;
    let count = req.count.unwrap_or(1);
    if !(1..=MAX_FORK_COUNT).contains(&count) {
        return Err(E2bError::bad_request(format!(
            "count {count} is not from 1 to {MAX_FORK_COUNT}"
        )));
    }
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    let _permit = permit(&state, &principal)?;
    let tenancy = state.tenancy.clone();
    let out = call(&state, move |s| async move {
        let s = &*s;
        let source = live(s, &id).await?;
        let timeout_ms = Some(seconds(timeout, "timeout")?);
        let mut results = Vec::new();
        // Each fork is admitted against the tenant's quotas; the tickets
        // are held until every fork of the request is made.
        let mut tickets = Vec::new();
        for _ in 0..count {
            // A backend that admits its creates (a cluster replica, in
            // PostgreSQL) admits each fork itself, as on `/v1`.
            let admitted = if s.admits_creates() {
                Ok(None)
            } else {
                admit(
                    &tenancy,
                    &principal,
                    Usage::sandbox(u64::from(source.mem_mib)),
                )
                .await
            };
            let fork = match admitted {
                Ok(ticket) => {
                    tickets.push(ticket);
                    s.fork_sandbox(
                        &source.id,
                        ForkSandbox {
                            timeout_ms,
                            metadata: super::wire::user_metadata(&source.metadata),
                            access_token: Some(new_access_token()),
                            ..ForkSandbox::default()
                        },
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            results.push(match fork {
                Ok(f) => ForkResult {
                    sandbox: Some(created_sandbox(s, &tenancy.builds, &f).await),
                    error: None,
                },
                Err(e) => ForkResult {
                    sandbox: None,
                    error: Some(e.into()),
                },
            });
        }
        Ok(results)
    })
    .await?;
    let out: Vec<ForkResult> = out
        .into_iter()
        .map(|mut r| {
            r.sandbox = r.sandbox.map(|c| c.in_domain(&state.tenancy));
            r
        })
        .collect();
    Ok(created(StatusCode::CREATED, out))
}

/// `POST /sandboxes/{id}/snapshots`: a template of the sandbox's current
/// state (snapshot-as-template); `snapshotID` is its id, `templateID` of a
/// create takes it, it outlives the sandbox. `memory: false` (the SDKs'
/// `mode="filesystem"`) keeps its disk only: a create from it boots.
pub async fn create_snapshot<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let req: SnapshotBody = optional_body(&bytes)?;
    let mode = match req.memory {
        Some(false) => HibernationKind::Filesystem,
        None | Some(true) => HibernationKind::Memory,
    };
    let _permit = permit(&state, &principal)?;
    let tenancy = state.tenancy.clone();
    let out = call(&state, move |s| async move {
        let s = &*s;
        let sandbox = live(s, &id).await?;
        let _ticket = admit(
            &tenancy,
            &principal,
            Usage::snapshot(u64::from(sandbox.mem_mib)),
        )
        .await?;
        let t = s
            .template_from_sandbox(
                &sandbox.id,
                TemplateFromSandbox {
                    name: req.name,
                    mode,
                },
            )
            .await?;
        Ok(SnapshotInfo {
            snapshot_id: t.id.to_string(),
            names: vec![t.name],
        })
    })
    .await?;
    Ok(created(StatusCode::CREATED, out))
}

/// `GET /snapshots`: templates made from sandboxes; `sandboxID`, `name`,
/// `limit`, `nextToken`.
pub async fn list_snapshots<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let q = query_pairs(raw);
    let (limit, after) = page_query(&q)?;
    let (sandbox, name) = (q.get("sandboxID").cloned(), q.get("name").cloned());
    let (items, next) = call(&state, move |s| async move {
        let s = &*s;
        let source = sandbox.map(SandboxId::new);
        let all: Vec<Template> = s
            .sandbox_templates(source.as_ref())
            .await?
            .into_iter()
            .map(|(t, _)| t)
            // The caller's own only (a shared template is made by an
            // admin, not snapshotted from a tenant's sandbox).
            .filter(|t| {
                t.state != TemplateState::Deleted
                    && !torpor_gate::builds::plan::is_layer(&t.name)
                    && torpor_scheduler::names::visible(
                        t.tenant.as_deref(),
                        Some(&principal.owner()),
                    )
            })
            .filter(|t| principal.sees_all() || t.tenant.is_some())
            .filter(|t| name.as_ref().is_none_or(|n| *n == t.name))
            .collect();
        let key = |t: &Template| Cursor {
            created_at: t.created_at.0,
            id: t.id.to_string(),
        };
        let (page, next) = page(all, key, false, after.as_ref(), limit);
        let infos: Vec<SnapshotInfo> = page
            .into_iter()
            .map(|t| SnapshotInfo {
                snapshot_id: t.id.to_string(),
                names: vec![t.name],
            })
            .collect();
        Ok((infos, next))
    })
    .await?;
    Ok(paged(items, next))
}

/// `DELETE /templates/{id}`: a template by id or name (a snapshot is one:
/// the SDK's `delete_snapshot`) that the caller may delete (the service's
/// resolver, `torpor_scheduler::names`); 204, 404 when unknown or another
/// tenant's, 403 for a shared one.
pub async fn delete_template<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    // Resolved for the caller on whichever pod has it (a snapshot of a
    // sandbox on another pod too): another tenant's is 404.
    call(&state, move |s| async move {
        let s = &*s;
        s.delete_template(Some(&principal.owner()), &id).await
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
