//! The OpenAPI 3.1 document (`api/openapi.json`, hand-written), served as is
//! at `/v1/openapi.json`.

/// The document's text.
pub const DOCUMENT: &str = include_str!("../openapi.json");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ROUTES;
    use serde_json::Value;
    use std::collections::BTreeSet;

    fn doc() -> Value {
        serde_json::from_str(DOCUMENT).expect("openapi.json is valid JSON")
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
