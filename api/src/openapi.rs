//! The OpenAPI 3.1 document served at `/v1/openapi.json` ([`get`]),
//! generated.
//!
//! - Paths: one operation per entry of [`crate::ROUTES`] (method, path,
//!   `operationId`, and `security: []` on public routes).
//! - Schemas: derived with `utoipa` from the request and response types
//!   (`#[derive(utoipa::ToSchema)]` on them, here and in the scheduler), so
//!   a field added to a type is in the document with no other edit.
//! - `api/openapi-written.json`, the words and what no Rust type says:
//!   `info`, `tags`, each operation's text, parameters and answers (by
//!   `operationId`), the shared error answers, the schemas of bodies built
//!   without a type (the agent's file listings, the exec stream's lines),
//!   and `refine`: rules a derived schema cannot state from its fields
//!   (patterns, bounds the service checks, "at least one field", "not
//!   both"), merged onto it. A `refine` entry may only tighten: it names
//!   no property the type does not have (checked below).
//! - `Error`'s `code` enum is [`crate::error::code::ALL`].

use std::sync::LazyLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};
use utoipa::OpenApi;

use crate::ROUTES;

/// Every type whose schema is in the document (what they refer to comes
/// with them).
#[derive(OpenApi)]
#[openapi(components(schemas(
    crate::wire::Health,
    crate::wire::SandboxPatch,
    crate::wire::PodPatch,
    crate::wire::SandboxList,
    crate::wire::OutcomeBody,
    crate::wire::HibernateBody,
    crate::wire::ConnectBody,
    crate::wire::PodBody,
    crate::guest_routes::ExecBody,
    crate::guest_routes::ExecAnswer,
    crate::guest_routes::WrittenAnswer,
    crate::admin_routes::CreateToken,
    crate::admin_routes::NewToken,
    crate::admin_routes::TokenList,
    crate::admin_routes::TenantBody,
    crate::admin_routes::ImageList,
    crate::network_routes::PortList,
    crate::builds::BuildRecord,
    crate::sandbox_routes::TemplatePatch,
    crate::build_routes::BuildList,
    crate::build_routes::FilesPresence,
    crate::wire::MetricHistory,
    torpor_scheduler::service::history::MetricSample,
    crate::network_routes::ExposePort,
    crate::checkpoint_routes::CheckpointList,
    crate::checkpoint_routes::ForkList,
    torpor_scheduler::model::Template,
    torpor_scheduler::model::Sandbox,
    torpor_scheduler::model::Checkpoint,
    torpor_scheduler::model::TemplateKind,
    torpor_scheduler::model::OnTimeout,
    torpor_scheduler::model::HibernationKind,
    torpor_scheduler::state::SandboxState,
    torpor_scheduler::service::CreateTemplate,
    torpor_scheduler::service::CreateSandbox,
    torpor_scheduler::service::VolumeMountRequest,
    torpor_scheduler::model::MountedVolume,
    torpor_scheduler::service::CreateCheckpoint,
    torpor_scheduler::service::RestoreCheckpoint,
    torpor_scheduler::service::ForkSandbox,
    torpor_scheduler::service::TemplateFromSandbox,
    torpor_scheduler::net::PolicyPatch,
)))]
struct Types;

/// The written part (see the module's docs).
const WRITTEN: &str = include_str!("../openapi-written.json");

static TEXT: LazyLock<String> =
    LazyLock::new(|| serde_json::to_string(&document()).expect("the document serialises"));

/// The document as served.
pub fn text() -> &'static str {
    &TEXT
}

/// `GET /v1/openapi.json`.
pub async fn get() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], text()).into_response()
}

/// The document.
pub fn document() -> Value {
    let written: Value = serde_json::from_str(WRITTEN).expect("openapi-written.json is JSON");
    let mut schemas = derived_schemas();
    for (name, schema) in object(&written["schemas"]) {
        let old = schemas.insert(name.clone(), schema.clone());
        assert!(old.is_none(), "schema {name} is both derived and written");
    }
    for (name, extra) in object(&written["refine"]) {
        let schema = schemas
            .get_mut(name)
            .unwrap_or_else(|| panic!("refine names unknown schema {name}"));
        merge(schema, extra);
    }
    schemas.insert("Error".into(), error_schema(&written["error"]));

    let operations = object(&written["operations"]);
    let mut paths = Map::new();
    for r in ROUTES {
        let mut op = Map::new();
        op.insert("operationId".into(), r.operation.into());
        let text = operations
            .get(r.operation)
            .unwrap_or_else(|| panic!("operation {} is not written", r.operation));
        op.extend(object(text).clone());
        if !r.auth {
            op.insert("security".into(), Value::Array(Vec::new()));
        }
        let item = paths
            .entry(r.path.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
        item[r.method.to_lowercase()] = Value::Object(op);
    }

    let mut info = written["info"].clone();
    info["version"] = env!("CARGO_PKG_VERSION").into();
    serde_json::json!({
        "openapi": "3.1.0",
        "info": info,
        "tags": written["tags"],
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "securitySchemes": written["securitySchemes"],
            "responses": written["responses"],
            "schemas": schemas,
        },
    })
}

/// The schemas `utoipa` derives from [`Types`], integer formats turned
/// into bounds (JSON Schema validators ignore `format`; a `u32` field is
/// 0..=4294967295).
fn derived_schemas() -> Map<String, Value> {
    let doc = serde_json::to_value(Types::openapi()).expect("utoipa's document serialises");
    let mut schemas = object(&doc["components"]["schemas"]).clone();
    for schema in schemas.values_mut() {
        integer_bounds(schema);
    }
    schemas
}

fn object(v: &Value) -> &Map<String, Value> {
    v.as_object()
        .unwrap_or_else(|| panic!("expected a JSON object, got {v}"))
}

fn integer_bounds(v: &mut Value) {
    match v {
        Value::Object(map) => {
            if let Some(Value::String(format)) = map.get("format") {
                let (min, max): (Option<Value>, Option<Value>) = match format.as_str() {
                    "u-int8" => (Some(0.into()), Some(u8::MAX.into())),
                    "u-int16" => (Some(0.into()), Some(u16::MAX.into())),
                    "u-int32" => (Some(0.into()), Some(u32::MAX.into())),
                    "u-int64" => (Some(0.into()), Some(u64::MAX.into())),
                    "int32" => (Some(i32::MIN.into()), Some(i32::MAX.into())),
                    "int64" => (Some(i64::MIN.into()), Some(i64::MAX.into())),
                    "double" | "float" => (None, None),
                    _ => {
                        for item in map.values_mut() {
                            integer_bounds(item);
                        }
                        return;
                    }
                };
                map.remove("format");
                if let Some(min) = min {
                    map.entry("minimum").or_insert(min);
                }
                if let Some(max) = max {
                    map.entry("maximum").or_insert(max);
                }
            }
            for item in map.values_mut() {
                integer_bounds(item);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integer_bounds),
        _ => {}
    }
}

/// `extra` merged onto `schema`: objects key by key, anything else
/// replaced.
fn merge(schema: &mut Value, extra: &Value) {
    match (schema, extra) {
        (Value::Object(to), Value::Object(from)) => {
            for (k, v) in from {
                match to.get_mut(k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        to.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (slot, v) => *slot = v.clone(),
    }
}

/// The error body: the written part with `code`'s enum from the codes.
fn error_schema(written: &Value) -> Value {
    let mut schema = written.clone();
    schema["properties"]["error"]["properties"]["code"]["enum"] = crate::error::code::ALL
        .iter()
        .map(|&c| Value::from(c))
        .collect::<Vec<_>>()
        .into();
    schema
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn doc() -> Value {
        serde_json::from_str(text()).expect("the document is valid JSON")
    }

    const METHODS: &[&str] = &["get", "put", "post", "delete", "options", "head", "patch"];

    #[test]
    fn is_openapi_3_1_with_info() {
        let d = doc();
        assert!(d["openapi"].as_str().unwrap().starts_with("3.1"));
        assert!(d["info"]["title"].is_string());
        assert_eq!(d["info"]["version"], env!("CARGO_PKG_VERSION"));
        assert!(d["components"]["securitySchemes"]["bearer"].is_object());
    }

    #[test]
    fn documents_exactly_the_routes_the_router_has() {
        let d = doc();
        let paths = d["paths"].as_object().unwrap();
        let mut documented = BTreeSet::new();
        for (path, item) in paths {
            for (key, op) in item.as_object().unwrap() {
                if !METHODS.contains(&key.as_str()) {
                    continue;
                }
                let id = op["operationId"].as_str().unwrap_or_else(|| {
                    panic!("{key} {path} has no operationId");
                });
                documented.insert((key.to_uppercase(), path.clone(), id.to_string()));
            }
        }
        let routed: BTreeSet<_> = ROUTES
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
        // No written operation without a route.
        let written: Value = serde_json::from_str(WRITTEN).unwrap();
        let written: BTreeSet<&str> = object(&written["operations"])
            .keys()
            .map(String::as_str)
            .collect();
        let routed: BTreeSet<&str> = ROUTES.iter().map(|r| r.operation).collect();
        assert_eq!(written, routed);
    }

    /// A route the gate admits something for (a wake, a rate-limit slot,
    /// snapshot disk) can answer 429: its document says so.
    #[test]
    fn every_admitted_route_documents_429() {
        let d = doc();
        for r in ROUTES {
            if matches!(
                r.gate,
                crate::gate::Gated::Sandbox(crate::gate::Admit::Plain)
            ) || r.gate == crate::gate::Gated::No
            {
                continue;
            }
            let op = &d["paths"][r.path][r.method.to_lowercase()];
            assert!(
                op["responses"]["429"].is_object(),
                "{} {} ({}) is admitted by the gate but documents no 429",
                r.method,
                r.path,
                r.operation
            );
        }
    }

    /// `refine` only tightens a derived schema: every property it names
    /// is one of the type's.
    #[test]
    fn refinements_name_only_fields_the_types_have() {
        let written: Value = serde_json::from_str(WRITTEN).unwrap();
        let derived = derived_schemas();
        for (name, extra) in object(&written["refine"]) {
            let mut fields = BTreeSet::new();
            fields_of(&derived, &derived[name], &mut fields);
            let props = extra["properties"].as_object();
            for field in props.into_iter().flat_map(|p| p.keys()) {
                assert!(
                    fields.contains(field),
                    "refine {name}.{field}: no such field"
                );
            }
            for field in extra["required"].as_array().into_iter().flatten() {
                let field = field.as_str().unwrap();
                assert!(
                    fields.contains(field),
                    "refine {name} requires {field}: no such field"
                );
            }
        }
    }

    /// The fields a derived schema has, through `allOf`/`oneOf` (flattened
    /// fields, tagged enums) and references.
    fn fields_of(all: &Map<String, Value>, schema: &Value, out: &mut BTreeSet<String>) {
        if let Some(target) = schema["$ref"].as_str() {
            let name = target.rsplit('/').next().unwrap();
            return fields_of(all, &all[name], out);
        }
        out.extend(
            schema["properties"]
                .as_object()
                .into_iter()
                .flat_map(|p| p.keys().cloned()),
        );
        for key in ["allOf", "oneOf", "anyOf"] {
            for part in schema[key].as_array().into_iter().flatten() {
                fields_of(all, part, out);
            }
        }
    }

    #[test]
    fn security_matches_each_routes_auth() {
        let d = doc();
        assert!(d["security"][0]["bearer"].is_array(), "bearer by default");
        for r in ROUTES {
            let op = &d["paths"][r.path][r.method.to_lowercase()];
            let public = op["security"].as_array().is_some_and(|s| s.is_empty());
            assert_eq!(public, !r.auth, "{} {}", r.method, r.path);
            if r.auth {
                assert!(
                    op["responses"]["401"].is_object(),
                    "{} {} documents 401",
                    r.method,
                    r.path
                );
            }
        }
    }

    /// Every `$ref` points at something that exists, and every operation
    /// documents at least one success answer and its error answers as the
    /// error body.
    #[test]
    fn references_resolve_and_errors_use_the_error_body() {
        let d = doc();
        let mut refs = Vec::new();
        collect_refs(&d, &mut refs);
        assert!(!refs.is_empty());
        for r in refs {
            let pointer = r.strip_prefix('#').expect("local $ref");
            assert!(d.pointer(pointer).is_some(), "dangling $ref {r}");
        }
        for r in ROUTES {
            let responses = d["paths"][r.path][r.method.to_lowercase()]["responses"]
                .as_object()
                .unwrap();
            assert!(
                // 101: the agent tunnel switches protocols instead.
                responses
                    .keys()
                    .any(|k| k.starts_with('2') || k == "501" || k == "101"),
                "{} {} has no 2xx",
                r.method,
                r.path
            );
            for (status, resp) in responses {
                if status.starts_with('4') || status.starts_with('5') {
                    let target = resp["$ref"].as_str().unwrap_or_default();
                    assert!(
                        target.starts_with("#/components/responses/"),
                        "{} {} {status} is not a shared error response",
                        r.method,
                        r.path
                    );
                }
            }
        }
        let error = &d["components"]["schemas"]["Error"];
        let codes = error["properties"]["error"]["properties"]["code"]["enum"]
            .as_array()
            .unwrap();
        for c in crate::error::code::ALL {
            assert!(codes.iter().any(|v| v == c), "error code {c} documented");
        }
        assert_eq!(codes.len(), crate::error::code::ALL.len(), "no other codes");
    }

    fn collect_refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    if k == "$ref" {
                        out.push(v.as_str().unwrap().to_string());
                    } else {
                        collect_refs(v, out);
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| collect_refs(v, out)),
            _ => {}
        }
    }

    /// The lifetimes' documented maxima are the service's.
    #[test]
    fn lifetime_maxima_match_the_service() {
        use crate::service::{MAX_KEEP_ALIVE_MS, MAX_TIMEOUT_MS};
        let d = doc();
        for schema in ["CreateSandbox", "SandboxPatch", "ForkSandbox"] {
            let props = &d["components"]["schemas"][schema]["properties"];
            assert_eq!(
                props["keep_alive_ms"]["maximum"], MAX_KEEP_ALIVE_MS,
                "{schema}"
            );
            assert_eq!(props["timeout_ms"]["maximum"], MAX_TIMEOUT_MS, "{schema}");
        }
        let count = &d["components"]["schemas"]["ForkSandbox"]["properties"]["count"];
        assert_eq!(count["maximum"], crate::service::MAX_FORK_COUNT, "{count}");
    }

    #[test]
    fn sandbox_states_match_the_state_machine() {
        let d = doc();
        let states: Vec<&str> = d["components"]["schemas"]["SandboxState"]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let real: Vec<&str> = torpor_scheduler::model::SandboxState::ALL
            .iter()
            .map(|s| s.as_str())
            .collect();
        assert_eq!(states, real);
    }
}
