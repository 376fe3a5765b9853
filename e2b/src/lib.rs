//! E2B-compatible control plane: the REST routes the `e2b` SDKs (PyPI and
//! npm `e2b`, pinned in `tests/e2b/`) call, with E2B's JSON field names and
//! status codes, over the same [`SandboxApi`] as torpor's own `/v1` routes.
//!
//! Served beside `/v1` on the API's listener (E2B's paths do not overlap
//! ours) and, with `torpor serve --e2b-listen ADDR`, alone on a listener of
//! its own. Every route needs `X-API-KEY: <key>`, checked by
//! the API's tokens (a key is a tenant's or an admin's); every route naming
//! a sandbox goes through [`torpor_gate::gate`] (another tenant's is 404). Every error answer is E2B's
//! `{"code": <status>, "message": "..."}` ([`error`]), with torpor's
//! status mapping (the table in `lib.rs`). What each route and field maps
//! to, and what is not offered, is in `docs/e2b.md`; the routes are
//! described in `e2b/e2b-openapi.json`.
//!
//! A crate of its own above the gate (torpor-gate), beside `/v1`
//! (torpor-api, which assembles the server): the E2B routes, envd
//! ([`envd`]) and the guest-port router ([`ports`]) reach sandboxes only
//! through the gate's checks.

#![forbid(unsafe_code)]

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodRouter};
use axum::Router;
use sha2::{Digest, Sha256};

use torpor_gate::backend::SandboxApi;
use torpor_gate::gate::{Admit, Gated};
use torpor_gate::handlers::AppState;
use torpor_gate::tenancy::Tenancy;
use torpor_gate::{method_filter, route, Limits, Route};

pub mod envd;
pub mod error;
mod list;
mod metrics;
mod network;
pub mod ports;
mod request;
mod routes;
mod secrets;
mod templates;
pub mod time;
mod volume_content;
mod volumes;
pub mod wire;

pub use error::E2bError;

/// The OpenAPI document of the E2B routes (`e2b/e2b-openapi.json`), apart
/// from torpor's own: another auth scheme, another error body.
pub const OPENAPI: &str = include_str!("../e2b-openapi.json");

/// The header E2B's SDKs carry the API key in.
pub const API_KEY_HEADER: &str = "x-api-key";
/// The header carrying a sandbox's traffic token ([`traffic_token`],
/// `trafficAccessToken` in the create answer), which opens its guest
/// ports (`crate::ports`).
pub const TRAFFIC_HEADER: &str = "e2b-traffic-access-token";

/// A sandbox's traffic token: derived from its envd access token (one
/// way, so a traffic token handed to a browser does not open envd), 128
/// bits as hex.
pub fn traffic_token(access_token: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"torpor traffic access token\n")
        .chain_update(access_token.as_bytes())
        .finalize();
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// Every E2B route served (paths in axum syntax, operation ids as in
/// `e2b/e2b-openapi.json`).
pub const ROUTES: &[Route] = &[
    route("POST", "/sandboxes", "e2bCreateSandbox"),
    route("GET", "/sandboxes", "e2bListSandboxes"),
    route("POST", "/v2/sandboxes", "e2bCreateSandboxV2"),
    route("GET", "/v2/sandboxes", "e2bListSandboxesV2"),
    route("GET", "/sandboxes/{id}", "e2bGetSandbox").sandbox(Admit::Plain),
    route("DELETE", "/sandboxes/{id}", "e2bKillSandbox").sandbox(Admit::Plain),
    route("POST", "/sandboxes/{id}/pause", "e2bPauseSandbox").sandbox(Admit::Plain),
    route("POST", "/sandboxes/{id}/resume", "e2bResumeSandbox").sandbox(Admit::Plain),
    route("POST", "/sandboxes/{id}/connect", "e2bConnectSandbox").sandbox(Admit::Plain),
    route("POST", "/v2/sandboxes/{id}/connect", "e2bConnectSandboxV2").sandbox(Admit::Plain),
    route("POST", "/sandboxes/{id}/timeout", "e2bSetTimeout").sandbox(Admit::Plain),
    route("POST", "/sandboxes/{id}/refreshes", "e2bRefreshSandbox").sandbox(Admit::Plain),
    route("GET", "/sandboxes/{id}/metrics", "e2bSandboxMetrics").sandbox(Admit::Plain),
    route("POST", "/sandboxes/{id}/fork", "e2bForkSandbox").sandbox(Admit::Plain),
    route("PUT", "/sandboxes/{id}/network", "e2bUpdateNetwork").sandbox(Admit::Plain),
    route("POST", "/sandboxes/{id}/snapshots", "e2bCreateSnapshot").sandbox(Admit::Plain),
    route("GET", "/snapshots", "e2bListSnapshots"),
    route("DELETE", "/templates/{id}", "e2bDeleteTemplate"),
    route("POST", "/v3/templates", "e2bRequestBuild"),
    route("GET", "/templates/{id}/files/{hash}", "e2bBuildFileLink"),
    // The upload link's PUT: no API key (the SDKs send none), its one-time
    // token in the query instead.
    public_route("PUT", "/templates/{id}/files/{hash}", "e2bBuildFileUpload"),
    route(
        "POST",
        "/v2/templates/{id}/builds/{build_id}",
        "e2bStartBuild",
    ),
    route(
        "GET",
        "/templates/{id}/builds/{build_id}/status",
        "e2bBuildStatus",
    ),
    route("GET", "/templates/aliases/{alias}", "e2bTemplateAlias"),
    route("POST", "/templates/tags", "e2bAssignTags"),
    route("DELETE", "/templates/tags", "e2bRemoveTags"),
    route("GET", "/templates/{id}/tags", "e2bTemplateTags"),
    route("GET", "/templates", "e2bListTemplates"),
    route("GET", "/v2/templates", "e2bListTemplatesV2"),
    route("PATCH", "/v2/templates/{id}", "e2bUpdateTemplate"),
    route("POST", "/volumes", "e2bCreateVolume"),
    route("GET", "/volumes", "e2bListVolumes"),
    route("GET", "/volumes/{id}", "e2bGetVolume"),
    route("DELETE", "/volumes/{id}", "e2bDeleteVolume"),
    // The volume content API: the volume's token (`Authorization:
    // Bearer`), not the API key, checked by each handler.
    public_route("GET", "/volumecontent/{id}/dir", "e2bVolumeContentListDir"),
    public_route("POST", "/volumecontent/{id}/dir", "e2bVolumeContentMakeDir"),
    public_route(
        "GET",
        "/volumecontent/{id}/file",
        "e2bVolumeContentReadFile",
    ),
    public_route(
        "PUT",
        "/volumecontent/{id}/file",
        "e2bVolumeContentWriteFile",
    ),
    public_route("GET", "/volumecontent/{id}/path", "e2bVolumeContentGetPath"),
    public_route(
        "PATCH",
        "/volumecontent/{id}/path",
        "e2bVolumeContentPatchPath",
    ),
    public_route(
        "DELETE",
        "/volumecontent/{id}/path",
        "e2bVolumeContentDeletePath",
    ),
    // Secrets: the caller's tenant's only ({id} is a secret's id or name).
    route("POST", "/secrets", "e2bCreateSecret"),
    route("GET", "/secrets", "e2bListSecrets"),
    route("GET", "/secrets/{id}", "e2bGetSecret"),
    route("POST", "/secrets/{id}", "e2bUpdateSecret"),
    route("DELETE", "/secrets/{id}", "e2bDeleteSecret"),
];

/// An E2B route without the API key: what authorises it is its own.
const fn public_route(method: &'static str, path: &'static str, operation: &'static str) -> Route {
    Route {
        auth: false,
        ..route(method, path, operation)
    }
}

fn endpoint<S: SandboxApi>(r: &Route) -> MethodRouter<AppState<S>> {
    let m = method_filter(r.method);
    match r.operation {
        "e2bCreateSandbox" | "e2bCreateSandboxV2" => on(m, routes::create::<S>),
        "e2bListSandboxes" => on(m, list::list_v1::<S>),
        "e2bListSandboxesV2" => on(m, list::list_v2::<S>),
        "e2bGetSandbox" => on(m, routes::get::<S>),
        "e2bKillSandbox" => on(m, routes::kill::<S>),
        "e2bPauseSandbox" => on(m, routes::pause::<S>),
        "e2bResumeSandbox" => on(m, routes::resume::<S>),
        "e2bConnectSandbox" | "e2bConnectSandboxV2" => on(m, routes::connect::<S>),
        "e2bSetTimeout" => on(m, routes::set_timeout::<S>),
        "e2bRefreshSandbox" => on(m, routes::refresh::<S>),
        "e2bSandboxMetrics" => on(m, metrics::get::<S>),
        "e2bForkSandbox" => on(m, routes::fork::<S>),
        "e2bUpdateNetwork" => on(m, routes::update_network::<S>),
        "e2bCreateSnapshot" => on(m, routes::create_snapshot::<S>),
        "e2bListSnapshots" => on(m, routes::list_snapshots::<S>),
        "e2bDeleteTemplate" => on(m, routes::delete_template::<S>),
        "e2bRequestBuild" => on(m, templates::request::<S>),
        "e2bBuildFileLink" => on(m, templates::file_link::<S>),
        "e2bBuildFileUpload" => on(m, templates::upload::<S>),
        "e2bStartBuild" => on(m, templates::start::<S>),
        "e2bBuildStatus" => on(m, templates::status::<S>),
        "e2bTemplateAlias" => on(m, templates::alias::<S>),
        "e2bAssignTags" => on(m, templates::assign_tags::<S>),
        "e2bRemoveTags" => on(m, templates::remove_tags::<S>),
        "e2bTemplateTags" => on(m, templates::tags::<S>),
        "e2bListTemplates" | "e2bListTemplatesV2" => on(m, templates::list::<S>),
        "e2bUpdateTemplate" => on(m, templates::update::<S>),
        "e2bCreateVolume" => on(m, volumes::create::<S>),
        "e2bListVolumes" => on(m, volumes::list::<S>),
        "e2bGetVolume" => on(m, volumes::get::<S>),
        "e2bDeleteVolume" => on(m, volumes::delete::<S>),
        "e2bVolumeContentListDir" => on(m, volume_content::list_dir),
        "e2bVolumeContentMakeDir" => on(m, volume_content::make_dir),
        "e2bVolumeContentReadFile" => on(m, volume_content::read_file),
        "e2bVolumeContentWriteFile" => on(m, volume_content::write_file::<S>),
        "e2bVolumeContentGetPath" => on(m, volume_content::get_path),
        "e2bVolumeContentPatchPath" => on(m, volume_content::patch_path),
        "e2bVolumeContentDeletePath" => on(m, volume_content::delete_path),
        "e2bCreateSecret" => on(m, secrets::create::<S>),
        "e2bListSecrets" => on(m, secrets::list::<S>),
        "e2bGetSecret" => on(m, secrets::get::<S>),
        "e2bUpdateSecret" => on(m, secrets::update::<S>),
        "e2bDeleteSecret" => on(m, secrets::delete::<S>),
        other => panic!("E2B route table names unknown operation {other:?}"),
    }
}

/// Route middleware: 401 unless `X-API-KEY` carries a key the API's
/// tokens accept; the key's [`Principal`] (tenant and scope) goes into the
/// request, as with the bearer token on `/v1`.
async fn require_key<S: SandboxApi>(
    State(t): State<Tenancy<S>>,
    mut request: Request,
    next: Next,
) -> Response {
    let principal = match request.headers().get(API_KEY_HEADER) {
        Some(key) => match t.auth.principal(key.as_bytes().trim_ascii()) {
            Some(p) => p,
            None => {
                return E2bError::new(axum::http::StatusCode::UNAUTHORIZED, "Invalid API key")
                    .into_response()
            }
        },
        None => {
            return E2bError::new(
                axum::http::StatusCode::UNAUTHORIZED,
                "missing X-API-KEY header",
            )
            .into_response()
        }
    };
    request.extensions_mut().insert(principal);
    next.run(request).await
}

/// The fallback of `torpor_api::Api::e2b_router`: 404 in E2B's shape.
pub async fn no_route(request: Request) -> E2bError {
    E2bError::not_found(format!(
        "no route for {} {}",
        request.method(),
        request.uri().path()
    ))
}

/// The E2B routes, with their auth, the API's limits and E2B's error shape.
/// No fallback: merged into the API's router, unknown paths are the API's.
pub fn router<S: SandboxApi>(service: Arc<S>, tenancy: Tenancy<S>, limits: Limits) -> Router {
    let mut app: Router<AppState<S>> = Router::new();
    // The volume content API answers errors of its own shape: no `normalize`.
    let mut content: Router<AppState<S>> = Router::new();
    for r in ROUTES {
        let mut endpoint = endpoint::<S>(r);
        if let Gated::Sandbox(cost) = r.gate {
            endpoint = endpoint.route_layer(middleware::from_fn_with_state(
                (tenancy.clone(), cost),
                torpor_gate::gate::sandbox::<S>,
            ));
        }
        if r.auth {
            endpoint = endpoint.route_layer(middleware::from_fn_with_state(
                tenancy.clone(),
                require_key::<S>,
            ));
        }
        if r.operation.starts_with("e2bVolumeContent") {
            content = content.route(r.path, endpoint);
        } else {
            app = app.route(r.path, endpoint);
        }
    }
    let with_limits = |r: Router| {
        r.layer(axum::extract::DefaultBodyLimit::max(limits.max_body_bytes))
            .layer(middleware::from_fn_with_state(limits, torpor_gate::limits))
    };
    let state = AppState {
        service: Arc::clone(&service),
        tenancy: tenancy.clone(),
        max_upload_bytes: limits.max_upload_bytes,
    };
    let control = with_limits(app.with_state(state.clone()))
        .layer(middleware::from_fn(error::normalize))
        .merge(with_limits(content.with_state(state)));
    // envd's answers are Connect's, not E2B's error body: no `normalize`.
    control.merge(with_limits(envd::router(service, tenancy, limits)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_table_is_well_formed_and_apart_from_ours() {
        let mut seen = std::collections::BTreeSet::new();
        for r in ROUTES {
            assert!(seen.insert((r.method, r.path)), "{} {}", r.method, r.path);
            // Only the upload link's PUT and the volume content API (the
            // volume's token) go without the API key.
            assert_eq!(
                r.auth,
                r.operation != "e2bBuildFileUpload" && !r.operation.starts_with("e2bVolumeContent"),
                "{}",
                r.operation
            );
            assert!(!r.path.starts_with("/v1/"), "{}", r.path);
            method_filter(r.method);
        }
    }

    #[test]
    fn openapi_documents_exactly_these_routes_with_e2b_errors() {
        let d: serde_json::Value = serde_json::from_str(OPENAPI).unwrap();
        assert_eq!(d["info"]["version"], env!("CARGO_PKG_VERSION"));
        let mut documented = std::collections::BTreeSet::new();
        for (path, item) in d["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let id = op["operationId"].as_str().unwrap().to_string();
                documented.insert((method.to_uppercase(), path.clone(), id));
                let responses = op["responses"].as_object().unwrap();
                assert!(
                    responses.contains_key("401"),
                    "{method} {path} documents 401"
                );
                assert!(
                    responses.keys().any(|k| k.starts_with('2')),
                    "{method} {path}"
                );
                for (status, r) in responses {
                    if !status.starts_with('2') {
                        let target = r["$ref"].as_str().unwrap();
                        let pointer = target.strip_prefix('#').unwrap();
                        let schema = &d.pointer(pointer).unwrap()["content"]["application/json"];
                        // The volume content API's errors carry the status as a string.
                        let error = if path.starts_with("/volumecontent/") {
                            "#/components/schemas/VolumeContentError"
                        } else {
                            "#/components/schemas/Error"
                        };
                        assert_eq!(schema["schema"]["$ref"], error, "{method} {path}");
                    }
                }
            }
        }
        let routed: std::collections::BTreeSet<_> = ROUTES
            .iter()
            .map(|r| {
                (
                    r.method.to_string(),
                    r.path.to_string(),
                    r.operation.to_string(),
                )
            })
            .collect();
        assert_eq!(documented, routed);
        // Every $ref resolves.
        let text = OPENAPI;
        for piece in text.split("\"$ref\": \"").skip(1) {
            let target = &piece[..piece.find('"').unwrap()];
            assert!(d.pointer(&target[1..]).is_some(), "dangling {target}");
        }
    }

    #[test]
    fn the_traffic_token_is_derived_one_way() {
        let t = traffic_token("abc");
        assert_eq!(t.len(), 32);
        assert_ne!(t, traffic_token("abd"));
        assert!(!t.contains("abc"));
    }
}
