//! E2B's template builder routes as the pinned SDKs call them
//! (docs/e2b-template-routes.md; the shapes recorded in
//! tests/e2b/fixtures/template-build-*.json), over the fake backend whose
//! `realbase` template's sandboxes have a real torpor-agent on this host:
//! request a build, the upload link and the key-less upload, start it,
//! poll its status and log pages, `exists`, a sandbox of the name (its
//! `templateID` the name), tags, a failing step's `reason.step`, another
//! tenant's view. The SDKs themselves against Linux guests:
//! tests/nested_builds.rs. Steps run as root in a scratch directory.

mod common;

use std::time::{Duration, Instant};

use common::{tenants_file, Reply, Server};
use serde_json::{json, Value};
use torpor_api::ApiConfig;

const ACME: &str = "acme-token-0123456789";
const OTHER: &str = "other-token-0123456789";

async fn e2b(server: &Server, key: &str, method: &str, path: &str, body: Option<Value>) -> Reply {
    let headers = vec![
        ("X-API-KEY", key.to_string()),
        ("Content-Type", "application/json".to_string()),
    ];
    let bytes = body.map(|b| b.to_string().into_bytes());
    server
        .request(method, path, &headers, bytes.as_deref())
        .await
}

/// Polls the build as the SDKs do (offsets of what they have read) until
/// it ends; its last answer and every log entry read.
async fn follow(server: &Server, template: &str, build: &str) -> (Value, Vec<Value>) {
    let mut entries = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let path = format!(
            "/templates/{template}/builds/{build}/status?logsOffset={}&limit=100",
            entries.len()
        );
        let r = e2b(server, ACME, "GET", &path, None).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        for key in ["templateID", "buildID", "status", "logEntries", "logs"] {
            assert!(v.get(key).is_some(), "no {key} in {v}");
        }
        let got = v["logEntries"].as_array().unwrap().clone();
        for e in &got {
            assert!(["debug", "info", "warn", "error"].contains(&e["level"].as_str().unwrap()));
            assert!(e["timestamp"].as_str().unwrap().ends_with('Z'), "{e}");
        }
        let done = ["ready", "error"].contains(&v["status"].as_str().unwrap());
        let empty = got.is_empty();
        entries.extend(got);
        if done && empty {
            return (v, entries);
        }
        assert!(Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_e2b_builder_routes_build_cache_tag_and_report_as_the_sdks_expect() {
    let scratch = tempfile::tempdir().unwrap();
    let tenants = tenants_file(scratch.path(), &[("acme", ACME), ("other", OTHER)]);
    let server = Server::start_with(ApiConfig {
        tenants_file: Some(tenants),
        ..Server::config()
    })
    .await;
    server.fake.add_real_template();
    let app = scratch.path().join("app");
    let app = app.to_str().unwrap().to_string();

    // POST /v3/templates: 202 with the six fields the SDK requires.
    let r = e2b(
        &server,
        ACME,
        "POST",
        "/v3/templates",
        Some(json!({"name": "Tpl-Test", "cpuCount": 1, "memoryMB": 256})),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let req = r.json();
    assert_eq!(req["templateID"], "tpl-test", "{req}");
    assert_eq!(req["tags"], json!(["default"]), "{req}");
    for key in ["buildID", "public", "names", "aliases"] {
        assert!(req.get(key).is_some(), "{req}");
    }
    let build = req["buildID"].as_str().unwrap().to_string();
    assert_eq!(build.len(), 36, "a UUID: {build}");
    // The name is claimed at once: exists.
    let r = e2b(&server, ACME, "GET", "/templates/aliases/tpl-test", None).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["templateID"], "tpl-test");
    let r = e2b(&server, OTHER, "GET", "/templates/aliases/tpl-test", None).await;
    assert_eq!(
        r.status,
        404,
        "another tenant's is a missing one: {}",
        r.text()
    );
    let r = e2b(
        &server,
        ACME,
        "GET",
        "/templates/aliases/nothing-here",
        None,
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(r.json()["code"] == 404 && r.json()["message"].is_string());

    // A COPY's files: the link (201), the upload without a key, once.
    let context = scratch.path().join("context");
    std::fs::create_dir_all(&context).unwrap();
    std::fs::write(context.join("hello.txt"), "hi from the sdk\n").unwrap();
    let packed = torpor_build::context::pack(&context, "hello.txt").unwrap();
    let hash = "5a".repeat(32);
    let link = format!("/templates/tpl-test/files/{hash}");
    let r = e2b(&server, ACME, "GET", &link, None).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["present"], false);
    let url = r.json()["url"].as_str().unwrap().to_string();
    let path = url
        .split_once(&server.addr.to_string())
        .unwrap()
        .1
        .to_string();
    let put = server
        .request("PUT", &path, &[], Some(&packed.archive))
        .await;
    assert_eq!(put.status, 204, "{}", put.text());
    let again = server
        .request("PUT", &path, &[], Some(&packed.archive))
        .await;
    assert_eq!(again.status, 403, "a used upload URL: {}", again.text());
    let r = e2b(&server, ACME, "GET", &link, None).await;
    assert_eq!(r.json()["present"], true, "{}", r.text());
    let r = e2b(&server, OTHER, "GET", &link, None).await;
    assert_eq!(r.status, 404, "{}", r.text());

    // The trigger: 202 without a body; steps as the SDK sends them.
    let body = |run: &str| {
        json!({
            "fromTemplate": "realbase",
            "force": false,
            "steps": [
                {"type": "USER", "args": ["root"], "force": false},
                {"type": "WORKDIR", "args": [app], "force": false},
                {"type": "ENV", "args": ["TORPOR_TPL_VAR", "from-env"], "force": false},
                {"type": "RUN", "args": [run], "force": false},
                {"type": "COPY", "args": ["hello.txt", "copied/", "", ""], "filesHash": hash, "force": false},
            ],
            "startCmd": "",
            "readyCmd": format!("[ -f {app}/copied/hello.txt ]"),
        })
    };
    let trigger = format!("/v2/templates/tpl-test/builds/{build}");
    let r = e2b(
        &server,
        ACME,
        "POST",
        &trigger,
        Some(body("echo \"$TORPOR_TPL_VAR\" > env.txt")),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    assert!(r.body.is_empty());
    let r = e2b(&server, ACME, "POST", &trigger, Some(body("true"))).await;
    assert_eq!(r.status, 400, "a build starts once: {}", r.text());
    let (done, entries) = follow(&server, "tpl-test", &build).await;
    assert_eq!(done["status"], "ready", "{done} {entries:?}");
    assert!(!entries.is_empty());
    assert_eq!(
        std::fs::read_to_string(format!("{app}/env.txt")).unwrap(),
        "from-env\n"
    );
    assert_eq!(
        std::fs::read_to_string(format!("{app}/copied/hello.txt")).unwrap(),
        "hi from the sdk\n"
    );
    // Another tenant cannot read it.
    let status = format!("/templates/tpl-test/builds/{build}/status");
    let r = e2b(&server, OTHER, "GET", &status, None).await;
    assert_eq!(r.status, 404, "{}", r.text());

    // A sandbox of the name: its templateID is the name, as the build's.
    let r = e2b(
        &server,
        ACME,
        "POST",
        "/sandboxes",
        Some(json!({"templateID": "tpl-test"})),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["templateID"], "tpl-test", "{}", r.text());
    let sbx = r.json()["sandboxID"].as_str().unwrap().to_string();
    let r = e2b(&server, ACME, "GET", &format!("/sandboxes/{sbx}"), None).await;
    assert_eq!(r.json()["templateID"], "tpl-test", "{}", r.text());

    // Rebuilt unchanged, tagged v1: the same templateID, every step cached.
    let r = e2b(
        &server,
        ACME,
        "POST",
        "/v3/templates",
        Some(json!({"name": "tpl-test:v1"})),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(r.json()["templateID"], "tpl-test");
    assert_eq!(r.json()["tags"], json!(["v1"]));
    let build2 = r.json()["buildID"].as_str().unwrap().to_string();
    std::fs::remove_file(format!("{app}/env.txt")).unwrap();
    let trigger2 = format!("/v2/templates/tpl-test/builds/{build2}");
    let r = e2b(
        &server,
        ACME,
        "POST",
        &trigger2,
        Some(body("echo \"$TORPOR_TPL_VAR\" > env.txt")),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let (done2, entries2) = follow(&server, "tpl-test", &build2).await;
    assert_eq!(done2["status"], "ready", "{done2}");
    let text: Vec<&str> = entries2
        .iter()
        .map(|e| e["message"].as_str().unwrap())
        .collect();
    assert!(text.iter().any(|m| m.contains("CACHED RUN")), "{text:?}");
    assert!(
        !std::path::Path::new(&format!("{app}/env.txt")).exists(),
        "the RUN ran again"
    );
    let r = e2b(&server, ACME, "GET", "/templates/aliases/tpl-test:v1", None).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = e2b(&server, ACME, "GET", "/templates/aliases/tpl-test:v9", None).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = e2b(
        &server,
        ACME,
        "POST",
        "/sandboxes",
        Some(json!({"templateID": "tpl-test:v1"})),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());

    // Tags: assign, list, remove (never `default`).
    let r = e2b(
        &server,
        ACME,
        "POST",
        "/templates/tags",
        Some(json!({"target": "tpl-test:v1", "tags": ["stable"]})),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["buildID"], build2.as_str());
    let r = e2b(&server, ACME, "GET", "/templates/tpl-test/tags", None).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let tags: Vec<String> = r
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tag"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(tags, ["default", "stable", "v1"], "{}", r.text());
    let r = e2b(
        &server,
        ACME,
        "DELETE",
        "/templates/tags",
        Some(json!({"name": "tpl-test", "tags": ["stable"]})),
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = e2b(
        &server,
        ACME,
        "DELETE",
        "/templates/tags",
        Some(json!({"name": "tpl-test", "tags": ["default"]})),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());

    // A failing RUN: `error`, reason.step the 1-based step, E2B's words.
    let r = e2b(
        &server,
        ACME,
        "POST",
        "/v3/templates",
        Some(json!({"name": "broken"})),
    )
    .await;
    let build3 = r.json()["buildID"].as_str().unwrap().to_string();
    let r = e2b(
        &server,
        ACME,
        "POST",
        &format!("/v2/templates/broken/builds/{build3}"),
        Some(body("exit 7")),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let (failed, _) = follow(&server, "broken", &build3).await;
    assert_eq!(failed["status"], "error", "{failed}");
    assert_eq!(failed["reason"]["step"], "4", "{failed}");
    assert!(
        failed["reason"]["message"]
            .as_str()
            .unwrap()
            .starts_with("failed to run command 'exit 7': exit status 7"),
        "{failed}"
    );
    // An unknown source fails the build at `base`, not the request.
    let r = e2b(
        &server,
        ACME,
        "POST",
        "/v3/templates",
        Some(json!({"name": "orphan"})),
    )
    .await;
    let build4 = r.json()["buildID"].as_str().unwrap().to_string();
    let r = e2b(
        &server,
        ACME,
        "POST",
        &format!("/v2/templates/orphan/builds/{build4}"),
        Some(json!({"fromTemplate": "nope", "steps": [], "force": false})),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let (orphan, _) = follow(&server, "orphan", &build4).await;
    assert_eq!(orphan["reason"]["step"], "base", "{orphan}");

    // The template lists: the built name as its templateID, no layers;
    // another tenant sees none of them.
    for path in ["/templates", "/v2/templates?limit=100"] {
        let r = e2b(&server, ACME, "GET", path, None).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let list = r.json();
        let ids: Vec<&str> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["templateID"].as_str().unwrap())
            .collect();
        assert!(ids.contains(&"tpl-test"), "{list}");
        assert!(!ids.iter().any(|i| i.starts_with("build-layer")), "{list}");
        for t in list.as_array().unwrap() {
            for key in [
                "buildID",
                "cpuCount",
                "memoryMB",
                "names",
                "createdAt",
                "buildStatus",
            ] {
                assert!(t.get(key).is_some(), "{key} missing in {t}");
            }
        }
        let r = e2b(&server, OTHER, "GET", path, None).await;
        assert!(!r.text().contains("tpl-test"), "{}", r.text());
    }
    let r = e2b(
        &server,
        ACME,
        "PATCH",
        "/v2/templates/tpl-test",
        Some(json!({"public": true})),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.text());
    let r = e2b(
        &server,
        ACME,
        "PATCH",
        "/v2/templates/tpl-test",
        Some(json!({"public": false})),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["names"], json!(["tpl-test"]));

    // Bad input: E2B's 400s.
    for name in ["", "Bad Name!", "ok:00000000-0000-0000-0000-000000000000"] {
        let r = e2b(
            &server,
            ACME,
            "POST",
            "/v3/templates",
            Some(json!({"name": name})),
        )
        .await;
        assert_eq!(r.status, 400, "{name}: {}", r.text());
    }
    server.shutdown().await.unwrap();
}

/// `POST /v3/templates` starts expensive work: like `/v1`'s build start it
/// takes a slot of the token's rate limit (429 `Retry-After` past it),
/// and another tenant's token has its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_e2b_build_request_takes_a_slot_of_the_tokens_rate_limit() {
    let scratch = tempfile::tempdir().unwrap();
    let tenants = tenants_file(scratch.path(), &[("acme", ACME), ("other", OTHER)]);
    let mut config = ApiConfig {
        tenants_file: Some(tenants),
        ..Server::config()
    };
    config.rate_limit.burst = 2;
    config.rate_limit.per_second = 0.01;
    let server = Server::start_with(config).await;
    let request = |key: &'static str, n: usize| {
        let server = &server;
        async move {
            e2b(
                server,
                key,
                "POST",
                "/v3/templates",
                Some(json!({"name": format!("limited-{n}"), "cpuCount": 1, "memoryMB": 512})),
            )
            .await
        }
    };
    for n in 0..2 {
        let r = request(ACME, n).await;
        assert_eq!(r.status, 202, "{}", r.text());
    }
    let r = request(ACME, 2).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.header("retry-after").is_some(), "{}", r.text());
    assert_eq!(r.json()["code"], 429, "E2B's error shape: {}", r.text());
    let r = request(OTHER, 3).await;
    assert_eq!(r.status, 202, "another token's own slots: {}", r.text());
    server.shutdown().await.unwrap();
}
