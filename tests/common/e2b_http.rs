//! E2B's control plane over raw HTTP, for the tests of its routes
//! (`tests/e2b_routes.rs`, `tests/e2b_snapshots_metrics.rs`): a `torpor
//! serve` on loopback started with an E2B key, calls with `X-API-KEY`, and
//! E2B's error body.

use std::path::Path;

use serde_json::Value;

use super::http::{request_with, HttpResponse};
use super::serve::ServeProcess;

/// The E2B key the server is started with.
pub const KEY: &str = "e2b-test-key-0123456789";

/// A `torpor serve` with the E2B key [`KEY`], and where its E2B routes are
/// asked.
pub struct E2b {
    pub serve: ServeProcess,
    /// Where the E2B routes are asked (the main listener or --e2b-listen).
    pub addr: String,
}

impl E2b {
    /// Starts serve on `data` with `extra` arguments (history sampled every
    /// 200 ms unless they say otherwise).
    pub fn start(data: &Path, extra: &[&str]) -> Self {
        let mut args = vec!["--token", KEY, "--policy-interval-ms", "200"];
        if !extra.contains(&"--history-interval-ms") {
            args.extend_from_slice(&["--history-interval-ms", "200"]);
        }
        args.extend_from_slice(extra);
        let serve = ServeProcess::start(data, &args);
        let addr = serve.addr.clone();
        E2b { serve, addr }
    }

    /// `METHOD path` with `key` in `X-API-KEY`, or no key.
    pub fn with_key(
        &self,
        key: Option<&str>,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> HttpResponse {
        let headers: Vec<(&str, &str)> = key.map(|k| ("X-API-KEY", k)).into_iter().collect();
        request_with(&self.addr, method, path, &headers, body)
    }

    /// `METHOD path` with [`KEY`].
    pub fn call(&self, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
        self.with_key(Some(KEY), method, path, body)
    }

    /// Asserts the status; the body as JSON (null when empty).
    pub fn expect(&self, status: u16, method: &str, path: &str, body: Option<&str>) -> Value {
        let r = self.call(method, path, body);
        assert_eq!(
            r.status, status,
            "{method} {path} -> {} {}",
            r.status, r.body
        );
        if r.body.is_empty() {
            Value::Null
        } else {
            r.json()
        }
    }

    /// `POST /v2/sandboxes` with `body`: 201.
    pub fn create(&self, body: &str) -> Value {
        self.expect(201, "POST", "/v2/sandboxes", Some(body))
    }
}

/// E2B's error body: the status as `code`, a message.
pub fn assert_e2b_error(r: &HttpResponse, status: u16) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert_eq!(v["code"], status, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(
        v.as_object().unwrap().len(),
        2,
        "only code and message: {v}"
    );
}

/// A sandbox's id in E2B's body.
pub fn id_of(v: &Value) -> String {
    v["sandboxID"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string()
}
