//! E2B's template builder routes, as the pinned SDKs call them
//! (docs/e2b-template-routes.md): request a build (`POST /v3/templates`),
//! the upload link of a COPY step's files and the upload itself (a URL on
//! this API carrying a one-time token: the SDK's PUT has no API key),
//! start it (`POST /v2/templates/{id}/builds/{buildID}`), its status and
//! logs, whether a name exists, and tags.
//!
//! A built template's E2B `templateID` is its name (`alias`): the same for
//! every rebuild, resolvable wherever a template id is (sandbox creation,
//! `DELETE /templates/{id}`). Tags name builds ([`torpor_gate::builds`]): `default`
//! (the build asked for no other) makes the template named `alias`, another
//! tag's first build the template `alias:tag`.

use std::collections::BTreeMap;

use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, RawQuery};
use axum::http::header::HOST;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;
use torpor_build::e2b::TemplateBuildStartV2;
use torpor_build::spec::Source;
use torpor_scheduler::model::{Template, TemplateState};

use super::error::E2bError;
use super::request::{body, page_query, permit, query_pairs};
use torpor_gate::auth::Principal;
use torpor_gate::backend::SandboxApi;
use torpor_gate::builds::surface::{scope, tenant_of};
use torpor_gate::builds::{Build, BuildRecord, BuildStatus, Level};
use torpor_gate::error::ApiError;
use torpor_gate::handlers::{call, Api};

type E2bResult<T> = Result<T, E2bError>;

/// A template id as E2B sees it: a built template's is its name.
pub(super) fn e2b_id(builds: &torpor_gate::builds::Builds, template_id: &str) -> String {
    builds
        .built_name(template_id)
        .unwrap_or_else(|| template_id.to_string())
}

/// The template a sandbox create names: `alias:tag` of a build the
/// caller tagged is that build's template; anything else as given.
pub(super) fn resolve_tagged(
    builds: &torpor_gate::builds::Builds,
    p: &Principal,
    key: &str,
) -> String {
    let Some((alias, tag)) = key
        .to_ascii_lowercase()
        .split_once(':')
        .map(|(a, t)| (a.to_string(), t.to_string()))
    else {
        return key.to_string();
    };
    builds
        .tagged(tenant_of(p).as_deref(), &alias, &tag)
        .and_then(|b| b.record().template_id)
        .unwrap_or_else(|| key.to_string())
}

/// Most log entries one status answer carries (E2B's cap).
const MAX_ENTRIES: usize = 100;

/// `[namespace/]alias[:tag]`, lowercased; a namespace must be the caller's
/// tenant.
fn parse_name(p: &Principal, text: &str) -> E2bResult<(String, Option<String>)> {
    let text = text.trim().to_ascii_lowercase();
    let (namespace, rest) = match text.split_once('/') {
        Some((ns, rest)) => (Some(ns.to_string()), rest.to_string()),
        None => (None, text),
    };
    if let Some(ns) = namespace {
        if ns != p.owner().tenant.to_ascii_lowercase() {
            return Err(E2bError::bad_request(format!(
                "namespace {ns:?} is not yours: leave it out"
            )));
        }
    }
    let (alias, tag) = match rest.split_once(':') {
        Some((a, t)) => (a.to_string(), Some(t.to_string())),
        None => (rest, None),
    };
    let ok = |s: &str, extra: &str| {
        !s.is_empty()
            && s.len() <= 128
            && s.chars().all(|c| {
                c.is_ascii_lowercase()
                    || c.is_ascii_digit()
                    || "-_".contains(c)
                    || extra.contains(c)
            })
    };
    if alias.is_empty() {
        return Err(E2bError::bad_request("Name is required"));
    }
    if !ok(&alias, "") || torpor_gate::builds::plan::is_layer(&alias) {
        return Err(E2bError::bad_request(format!(
            "Invalid template name {alias:?}: lowercase letters, digits, '-' and '_'"
        )));
    }
    if let Some(t) = &tag {
        check_tag(t)?;
    }
    Ok((alias, tag))
}

fn check_tag(tag: &str) -> E2bResult<()> {
    let uuid_like = tag.len() == 36 && tag.chars().filter(|&c| c == '-').count() == 4;
    let ok = !tag.is_empty()
        && tag.len() <= 128
        && tag
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c));
    if !ok || uuid_like {
        return Err(E2bError::bad_request(format!("Invalid tag: {tag:?}")));
    }
    Ok(())
}

/// `POST /v3/templates`'s body.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct BuildRequest {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u32>,
    #[serde(rename = "minFreeDiskMb")]
    _min_free_disk_mb: Option<u64>,
    #[serde(rename = "teamID")]
    _team_id: Option<String>,
}

/// `POST /v3/templates`: a build of `name`, waiting for its steps (202).
pub async fn request<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let req: BuildRequest = body(&bytes)?;
    // A build start is expensive: a slot of the token's rate limit, as
    // `/v1`'s.
    let _permit = permit(&state, &p)?;
    let name = req.name.or(req.alias).unwrap_or_default();
    let (alias, tag) = parse_name(&p, &name)?;
    let mut tags: Vec<String> = Vec::new();
    for t in tag
        .into_iter()
        .chain(req.tags.iter().map(|t| t.trim().to_ascii_lowercase()))
    {
        check_tag(&t)?;
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    if tags.is_empty() {
        tags.push("default".into());
    }
    let tenancy = state.tenancy.clone();
    let tenant = tenant_of(&p);
    torpor_gate::builds::start::admit_build(&tenancy, tenant.as_deref()).map_err(ApiError::from)?;
    let build = tenancy.builds.begin(tenant, &alias, tags.clone());
    build.update(|r| {
        r.cpu_count = req.cpu_count;
        r.memory_mib = req.memory_mb;
    });
    let answer = json!({
        "templateID": alias,
        "buildID": build.record().id,
        "public": false,
        "names": [alias],
        "tags": tags,
        "aliases": [alias],
    });
    Ok((StatusCode::ACCEPTED, Json(answer)).into_response())
}

/// The build `build_id` of template `template` the caller sees.
fn build_of<S>(
    state: &torpor_gate::handlers::AppState<S>,
    p: &Principal,
    template: &str,
    build_id: &str,
) -> E2bResult<std::sync::Arc<Build>> {
    let build = state
        .tenancy
        .builds
        .get(build_id, scope(p).as_deref())
        .map_err(|_| E2bError::not_found(format!("build {build_id} not found")))?;
    if !build.record().name.eq_ignore_ascii_case(template) {
        return Err(E2bError::not_found(format!(
            "build {build_id} is not of template {template}"
        )));
    }
    Ok(build)
}

/// Whether the caller has template `alias` (built, being built, or any
/// template of that name of its own).
async fn known<S: SandboxApi>(
    s: &S,
    state_builds: &torpor_gate::builds::Builds,
    p: &Principal,
    alias: &str,
) -> bool {
    let tenant = tenant_of(p);
    !state_builds.of_name(tenant.as_deref(), alias).is_empty()
        || s.resolve_template(&p.owner(), alias)
            .await
            .is_ok_and(|t| t.tenant == tenant)
}

/// `GET /templates/{id}/files/{hash}`: whether the files are uploaded,
/// and where to PUT them (201).
pub async fn file_link<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    Path((template, hash)): Path<(String, String)>,
    headers: HeaderMap,
) -> E2bResult<Response> {
    torpor_gate::builds::files::check_hash(&hash).map_err(ApiError::from)?;
    let builds = state.tenancy.builds.clone();
    let (p2, t2) = (p.clone(), template.clone());
    let found = call(&state, move |s| async move {
        let s = &*s;
        Ok(known(s, &builds, &p2, &t2).await)
    })
    .await?;
    if !found {
        return Err(E2bError::not_found(format!(
            "template {template} not found"
        )));
    }
    let tenant = tenant_of(&p);
    let files = &state.tenancy.builds.files;
    let present = files
        .present(tenant.as_deref(), &hash)
        .map_err(ApiError::from)?;
    let token = files
        .grant(tenant.as_deref(), &hash)
        .map_err(ApiError::from)?;
    let host = headers
        .get(HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
        .filter(|s| *s == "https")
        .unwrap_or("http");
    let url = format!(
        "{scheme}://{host}/templates/{}/files/{hash}?token={token}",
        percent_encoding::utf8_percent_encode(&template, percent_encoding::NON_ALPHANUMERIC)
    );
    Ok((
        StatusCode::CREATED,
        Json(json!({"present": present, "url": url})),
    )
        .into_response())
}

/// `PUT /templates/{id}/files/{hash}?token=...`: the upload, authorised
/// by the link's one-time token (no API key: the SDK sends none).
pub async fn upload<S: SandboxApi>(
    state: Api<S>,
    Path((_template, hash)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    body_stream: Body,
) -> E2bResult<Response> {
    let q = query_pairs(raw);
    let token = q.get("token").cloned().unwrap_or_default();
    let tenant = state
        .tenancy
        .builds
        .files
        .redeem(&token, &hash)
        .map_err(ApiError::from)?;
    torpor_gate::builds::surface::store(&state, tenant, hash, body_stream).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /v2/templates/{id}/builds/{buildID}`: the build's steps; it
/// starts (202, no body). A source that does not resolve fails the build
/// (step `base`), as E2B's does, rather than the request.
pub async fn start<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    Path((template, build_id)): Path<(String, String)>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let body = TemplateBuildStartV2::from_json(&bytes)
        .map_err(|e| E2bError::bad_request(format!("invalid request body: {e}")))?;
    let build = build_of(&state, &p, &template, &build_id)?;
    let record = build.record();
    if record.status != BuildStatus::Waiting {
        return Err(E2bError::bad_request("build is not in waiting state"));
    }
    let mut spec = body
        .into_spec(record.cpu_count, record.memory_mib)
        .map_err(|e| E2bError::bad_request(e.to_string()))?;
    if !build.claim() {
        return Err(E2bError::bad_request("build is not in waiting state"));
    }
    // E2B's base image is torpor's `base` template.
    if let Source::Image { reference, .. } = &spec.from {
        if matches!(reference.as_str(), "e2bdev/base" | "e2bdev/base:latest") {
            spec.from = Source::Template {
                name: "base".into(),
            };
        }
    }
    let tenancy = state.tenancy.clone();
    call(&state, move |_| async move {
        if let Err(e) = torpor_gate::builds::start::launch(&tenancy, &p, &build, spec).await {
            build.fail(&e.to_string());
        }
        Ok(())
    })
    .await?;
    Ok((
        StatusCode::ACCEPTED,
        [(axum::http::header::CONTENT_LENGTH, "0")],
    )
        .into_response())
}

/// A log entry as E2B's `BuildLogEntry`.
#[derive(Debug, Serialize)]
struct Entry {
    timestamp: String,
    level: &'static str,
    message: String,
}

fn level(l: Level) -> &'static str {
    match l {
        Level::Debug => "debug",
        Level::Info => "info",
        Level::Warn => "warn",
        Level::Error => "error",
    }
}

/// E2B's `reason.step` of a failed step: `"1"`..`"N"` for the body's
/// steps, `finalize` for the start command and the snapshot, `base`
/// before the steps.
fn e2b_step(record: &BuildRecord) -> Option<String> {
    let steps = record
        .spec
        .as_ref()
        .and_then(|s| s["steps"].as_array().map(Vec::len))
        .unwrap_or(0);
    let f = record.failure.as_ref()?;
    Some(match f.step {
        None => "base".into(),
        Some(i) if i < steps => (i + 1).to_string(),
        Some(_) => "finalize".into(),
    })
}

/// `GET /templates/{id}/builds/{buildID}/status?logsOffset=&limit=`.
pub async fn status<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    Path((template, build_id)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let q = query_pairs(raw);
    let number = |k: &str, default: usize| -> E2bResult<usize> {
        q.get(k).map_or(Ok(default), |v| {
            v.parse()
                .map_err(|_| E2bError::bad_request(format!("{k}: a whole number")))
        })
    };
    let offset = number("logsOffset", 0)?;
    let limit = number("limit", MAX_ENTRIES)?.min(MAX_ENTRIES);
    let record = build_of(&state, &p, &template, &build_id)?.record();
    let record = torpor_gate::builds::surface::with_logs_from(record, offset);
    let entries: Vec<Entry> = record
        .logs
        .iter()
        .take(limit)
        .map(|e| Entry {
            timestamp: super::time::format(e.at),
            level: level(e.level),
            message: e.message.clone(),
        })
        .collect();
    let status = match record.status {
        BuildStatus::Waiting => "waiting",
        BuildStatus::Building => "building",
        BuildStatus::Ready => "ready",
        BuildStatus::Error | BuildStatus::Cancelled => "error",
    };
    let mut answer = json!({
        "templateID": template,
        "buildID": build_id,
        "status": status,
        "logEntries": entries,
        "logs": [],
    });
    if let Some(f) = &record.failure {
        let mut message = f.message.clone();
        if !f.output_tail.is_empty() && f.exit_code.is_some() {
            let tail: Vec<&str> = f.output_tail.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            message.push_str(&format!("\n{}", tail.join("\n")));
        }
        let mut reason = json!({"message": message});
        if let Some(step) = e2b_step(&record) {
            reason["step"] = json!(step);
        }
        answer["reason"] = reason;
    }
    Ok(Json(answer).into_response())
}

/// `GET /templates/aliases/{alias}`: 200 when the caller has it (a tag, if
/// named, on a ready build), else 404 (another tenant's too).
pub async fn alias<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    Path(name): Path<String>,
) -> E2bResult<Response> {
    let (alias, tag) = parse_name(&p, &name)?;
    let builds = state.tenancy.builds.clone();
    let (p2, a2) = (p.clone(), alias.clone());
    let found = call(&state, move |s| async move {
        let s = &*s;
        Ok(known(s, &builds, &p2, &a2).await)
    })
    .await?;
    let tenant = tenant_of(&p);
    let tagged = tag.as_deref().is_none_or(|t| {
        state
            .tenancy
            .builds
            .tagged(tenant.as_deref(), &alias, t)
            .is_some()
    });
    if !found || !tagged {
        return Err(E2bError::not_found(format!("template '{name}' not found")));
    }
    Ok(Json(json!({"templateID": alias, "public": false})).into_response())
}

/// `POST /templates/tags`'s body.
#[derive(Debug, Deserialize)]
struct AssignTags {
    target: String,
    tags: Vec<String>,
}

/// `POST /templates/tags`: `tags` now name the build `target` names (201).
pub async fn assign_tags<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let req: AssignTags = body(&bytes)?;
    if req.tags.is_empty() {
        return Err(E2bError::bad_request("tags: at least one"));
    }
    let (alias, tag) = parse_name(&p, &req.target)?;
    let mut tags = Vec::new();
    for t in &req.tags {
        let t = t.trim().to_ascii_lowercase();
        check_tag(&t)?;
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    let tenant = tenant_of(&p);
    let builds = &state.tenancy.builds;
    let target = builds
        .tagged(
            tenant.as_deref(),
            &alias,
            tag.as_deref().unwrap_or("default"),
        )
        .ok_or_else(|| E2bError::not_found(format!("template '{}' not found", req.target)))?;
    let target_id = target.record().id;
    for b in builds.of_name(tenant.as_deref(), &alias) {
        let mine = b.record().id == target_id;
        b.update(|r| {
            if mine {
                for t in &tags {
                    if !r.tags.contains(t) {
                        r.tags.push(t.clone());
                    }
                }
            } else {
                r.tags.retain(|t| !tags.contains(t));
            }
        });
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({"tags": tags, "buildID": target_id})),
    )
        .into_response())
}

/// `DELETE /templates/tags`'s body.
#[derive(Debug, Deserialize)]
struct RemoveTags {
    name: String,
    tags: Vec<String>,
}

/// `DELETE /templates/tags`: the tags name no build of `name` (204);
/// `default` stays.
pub async fn remove_tags<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let req: RemoveTags = body(&bytes)?;
    let (alias, tag) = parse_name(&p, &req.name)?;
    if tag.is_some() {
        return Err(E2bError::bad_request(
            "Template name should not contain a tag, use the 'tags' field instead",
        ));
    }
    let tags: Vec<String> = req
        .tags
        .iter()
        .map(|t| t.trim().to_ascii_lowercase())
        .collect();
    if tags.iter().any(|t| t == "default") {
        return Err(E2bError::bad_request("the tag 'default' cannot be removed"));
    }
    let tenant = tenant_of(&p);
    let all = state.tenancy.builds.of_name(tenant.as_deref(), &alias);
    if all.is_empty() {
        return Err(E2bError::not_found(format!("template '{alias}' not found")));
    }
    for b in all {
        b.update(|r| r.tags.retain(|t| !tags.contains(t)));
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /templates/{id}/tags`: every tag of the template's ready builds.
pub async fn tags<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    Path(name): Path<String>,
) -> E2bResult<Response> {
    let (alias, _) = parse_name(&p, &name)?;
    let tenant = tenant_of(&p);
    let all = state.tenancy.builds.of_name(tenant.as_deref(), &alias);
    if all.is_empty() {
        return Err(E2bError::not_found(format!("template '{alias}' not found")));
    }
    let mut seen = BTreeMap::new();
    for b in all {
        let r = b.record();
        if r.status != BuildStatus::Ready {
            continue;
        }
        for t in &r.tags {
            seen.entry(t.clone()).or_insert_with(|| {
                json!({
                    "tag": t,
                    "buildID": r.id,
                    "createdAt": super::time::format(r.finished_at.unwrap_or(r.created_at)),
                })
            });
        }
    }
    Ok(Json(seen.into_values().collect::<Vec<_>>()).into_response())
}

/// E2B's `Template` of one of the caller's templates (its fields the
/// generated clients require).
fn template_item(builds: &torpor_gate::builds::Builds, t: &Template) -> serde_json::Value {
    let id = e2b_id(builds, t.id.as_str());
    let built = builds.built_name(t.id.as_str()).is_some();
    let alias = if built { id.clone() } else { t.name.clone() };
    let created = super::time::format(t.created_at);
    json!({
        "templateID": id,
        "buildID": t.id.to_string(),
        "cpuCount": t.vcpus,
        "memoryMB": t.mem_mib,
        "diskSizeMB": 0,
        "public": t.tenant.is_none(),
        "aliases": [alias],
        "names": [alias],
        "createdAt": created,
        "updatedAt": created,
        "createdBy": null,
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "buildCount": builds.of_name(t.tenant.as_deref(), &alias).len().max(1),
        "envdVersion": super::wire::ENVD_VERSION,
        "buildStatus": match t.state {
            TemplateState::Ready => "ready",
            TemplateState::Building => "building",
            _ => "error",
        },
    })
}

/// The caller's templates (its own and the shared ones), cache layers
/// and deleted ones left out, oldest first.
async fn visible_templates<S: SandboxApi>(
    s: &S,
    p: &Principal,
) -> Result<Vec<Template>, torpor_gate::service::ServiceError> {
    let owner = p.owner();
    Ok(s.template_entries()
        .await?
        .into_iter()
        .filter_map(|v| serde_json::from_value::<Template>(v).ok())
        .filter(|t| {
            t.state != TemplateState::Deleted
                && !torpor_gate::builds::plan::is_layer(&t.name)
                && torpor_scheduler::names::visible(t.tenant.as_deref(), Some(&owner))
        })
        .collect())
}

/// `GET /templates` (the CLI's list) and `GET /v2/templates?limit=&nextToken=`
/// (a page, the next one's token in `X-Next-Token`): the caller's
/// templates as E2B's `Template`s.
pub async fn list<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let q = query_pairs(raw);
    let (limit, after) = page_query(&q)?;
    let builds = state.tenancy.builds.clone();
    let (items, next) = call(&state, move |s| async move {
        let s = &*s;
        let all = visible_templates(s, &p).await?;
        let key = |t: &Template| super::wire::Cursor {
            created_at: t.created_at.0,
            id: t.id.to_string(),
        };
        let (page, next) = super::wire::page(all, key, false, after.as_ref(), limit);
        let items: Vec<serde_json::Value> =
            page.iter().map(|t| template_item(&builds, t)).collect();
        Ok((items, next))
    })
    .await?;
    let mut response = Json(items).into_response();
    if let Some(next) = next.and_then(|n| axum::http::HeaderValue::from_str(&n).ok()) {
        response.headers_mut().insert("x-next-token", next);
    }
    Ok(response)
}

/// `PATCH /v2/templates/{id}`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TemplatePatch {
    public: Option<bool>,
}

/// `PATCH /v2/templates/{id}` (the CLI's `template publish`): a tenant's
/// template stays its own (`public: true` is 403: shared templates are an
/// admin's); 200 with its names.
pub async fn update<S: SandboxApi>(
    state: Api<S>,
    Extension(p): Extension<Principal>,
    Path(key): Path<String>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let patch: TemplatePatch = if bytes.iter().all(u8::is_ascii_whitespace) {
        TemplatePatch { public: None }
    } else {
        body(&bytes)?
    };
    let builds = state.tenancy.builds.clone();
    let owner = p.owner();
    let key = resolve_tagged(&builds, &p, &key);
    let t = call(&state, move |s| async move {
        let s = &*s;
        s.resolve_template(&owner, &key).await
    })
    .await?;
    if patch.public == Some(true) && t.tenant.is_some() {
        return Err(E2bError::new(
            StatusCode::FORBIDDEN,
            "public templates are shared ones, made by an admin: this template stays yours",
        ));
    }
    let item = template_item(&builds, &t);
    Ok(Json(json!({"names": item["names"]})).into_response())
}
