//! Template builds through `/v1` over the fake backend whose `realbase`
//! template's sandboxes have a real torpor-agent (on this host, behind
//! the hybrid vsock stand-in): the executor's commands, COPY's unpack
//! and ready checks really run; the cache, failures, cancellation and
//! tenancy as the routes answer them. (The same builds in a Linux guest:
//! `tests/nested_builds.rs`.) Steps run as root in a scratch directory:
//! nothing of the host outside it is touched.

mod common;

use std::time::{Duration, Instant};

use common::{tenants_file, Reply, Server};
use serde_json::{json, Value};
use torpor_api::ApiConfig;

const ACME: &str = "acme-token-0123456789";
const OTHER: &str = "other-token-0123456789";

fn auth(token: &str) -> Vec<(&'static str, String)> {
    vec![
        ("Authorization", format!("Bearer {token}")),
        ("Content-Type", "application/json".into()),
    ]
}

async fn call(
    server: &Server,
    token: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Reply {
    let bytes = body.map(|b| b.to_string().into_bytes());
    server
        .request(method, path, &auth(token), bytes.as_deref())
        .await
}

/// Polls build `id` until it has finished; its record.
async fn finished(server: &Server, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = call(server, ACME, "GET", &format!("/v1/builds/{id}"), None).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        if ["ready", "error", "cancelled"].contains(&v["status"].as_str().unwrap()) {
            return v;
        }
        assert!(Instant::now() < deadline, "build {id} still {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn build(server: &Server, body: Value) -> Value {
    let r = call(server, ACME, "POST", "/v1/builds", Some(body)).await;
    assert_eq!(r.status, 202, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    finished(server, &id).await
}

fn logs(v: &Value) -> String {
    v["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["message"].as_str().unwrap().to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn builds_run_steps_cache_layers_and_report_failures() {
    let scratch = tempfile::tempdir().unwrap();
    let tenants = tenants_file(scratch.path(), &[("acme", ACME), ("other", OTHER)]);
    let server = Server::start_with(ApiConfig {
        tenants_file: Some(tenants),
        builds_dir: Some(scratch.path().join("builds")),
        ..Server::config()
    })
    .await;
    server.fake.add_real_template();
    let app = scratch.path().join("app");
    let app = app.to_str().unwrap();

    // The files a COPY copies, uploaded once by their hash.
    let context = scratch.path().join("context");
    std::fs::create_dir_all(&context).unwrap();
    std::fs::write(context.join("hello.txt"), "hello from the context\n").unwrap();
    let packed = torpor_build::context::pack(&context, "hello.txt").unwrap();
    let files = format!("/v1/build-files/{}", packed.sha256);
    let r = call(&server, ACME, "GET", &files, None).await;
    assert_eq!(r.json()["present"], false, "{}", r.text());
    // A body that does not say it is an archive: refused, nothing kept.
    for kind in [None, Some("application/json")] {
        let mut headers = vec![("Authorization", format!("Bearer {ACME}"))];
        headers.extend(kind.map(|k| ("Content-Type", k.to_string())));
        let r = server
            .request("PUT", &files, &headers, Some(&packed.archive))
            .await;
        r.assert_error(415, "unsupported_media_type");
    }
    let r = call(&server, ACME, "GET", &files, None).await;
    assert_eq!(r.json()["present"], false, "{}", r.text());
    let upload = [
        ("Authorization", format!("Bearer {ACME}")),
        ("Content-Type", "application/gzip".to_string()),
    ];
    let r = server
        .request("PUT", &files, &upload, Some(&packed.archive))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = call(&server, ACME, "GET", &files, None).await;
    assert_eq!(r.json()["present"], true, "{}", r.text());
    // Another tenant has not uploaded them.
    let r = call(&server, OTHER, "GET", &files, None).await;
    assert_eq!(r.json()["present"], false, "{}", r.text());

    let spec = |run: &str| {
        json!({
            "name": "web",
            "from": {"type": "template", "name": "realbase"},
            "steps": [
                {"type": "user", "name": "root"},
                {"type": "workdir", "path": app},
                {"type": "env", "vars": {"GREETING": "hi"}},
                {"type": "run", "cmd": run},
                {"type": "copy", "src": "hello.txt", "dest": "copied/", "files_hash": packed.sha256},
            ],
            "start": {"ready": {"type": "file", "path": format!("{app}/copied/hello.txt")}},
        })
    };
    let first = build(&server, spec("echo \"$GREETING from $(pwd)\" > out.txt")).await;
    assert_eq!(first["status"], "ready", "{first}\n{}", logs(&first));
    assert_eq!(
        std::fs::read_to_string(format!("{app}/out.txt")).unwrap(),
        format!("hi from {app}\n"),
        "the RUN ran in the WORKDIR with the ENV"
    );
    assert_eq!(
        std::fs::read_to_string(format!("{app}/copied/hello.txt")).unwrap(),
        "hello from the context\n"
    );
    assert_eq!(first["cached_steps"], 0, "{first}");
    assert_eq!(first["run_steps"], 6, "{first}");
    let made = first["template_id"].as_str().unwrap().to_string();
    let r = call(&server, ACME, "GET", "/v1/templates/web", None).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["id"], made.as_str());
    // The cache layers are the tenant's templates, left out of its list.
    let r = call(&server, ACME, "GET", "/v1/templates", None).await;
    let names: Vec<String> = r.json()["templates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect();
    assert!(names.contains(&"web".to_string()), "{names:?}");
    assert!(
        !names.iter().any(|n| n.starts_with("build-layer")),
        "{names:?}"
    );
    // The other tenant sees neither the build nor the template.
    let id = first["id"].as_str().unwrap();
    let r = call(&server, OTHER, "GET", &format!("/v1/builds/{id}"), None).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = call(&server, OTHER, "GET", "/v1/templates/web", None).await;
    assert_eq!(r.status, 404, "{}", r.text());

    // The same build again: every step from the cache, none run (the
    // RUN's file, removed, is not made again); the template replaced.
    std::fs::remove_file(format!("{app}/out.txt")).unwrap();
    let again = build(&server, spec("echo \"$GREETING from $(pwd)\" > out.txt")).await;
    assert_eq!(again["status"], "ready", "{again}\n{}", logs(&again));
    assert_eq!(again["cached_steps"], 6, "{again}");
    assert_eq!(again["run_steps"], 0, "{again}");
    assert!(logs(&again).contains("CACHED RUN echo"), "{}", logs(&again));
    assert!(!std::path::Path::new(&format!("{app}/out.txt")).exists());
    let r = call(&server, ACME, "GET", "/v1/templates/web", None).await;
    assert_eq!(r.json()["id"], again["template_id"], "{}", r.text());

    // A changed RUN runs again from that step on.
    let changed = build(&server, spec("echo changed > out.txt")).await;
    assert_eq!(changed["status"], "ready", "{changed}");
    assert_eq!(
        std::fs::read_to_string(format!("{app}/out.txt")).unwrap(),
        "changed\n"
    );
    assert_eq!(changed["run_steps"], 6, "{changed}");

    // A failing RUN: its step, instruction, exit code and output.
    let failed = build(&server, spec("echo about to fail; exit 7")).await;
    assert_eq!(failed["status"], "error", "{failed}");
    let f = &failed["failure"];
    assert_eq!(f["step"], 3, "{failed}");
    assert_eq!(f["exit_code"], 7, "{failed}");
    assert_eq!(
        f["message"], "failed to run command 'echo about to fail; exit 7': exit status 7",
        "{failed}"
    );
    assert!(f["instruction"]
        .as_str()
        .unwrap()
        .starts_with("RUN echo about"));
    assert!(f["output_tail"].as_str().unwrap().contains("about to fail"));
    // The build's sandboxes are gone, its template untouched.
    let r = call(&server, ACME, "GET", "/v1/templates/web", None).await;
    assert_eq!(r.json()["id"], changed["template_id"], "{}", r.text());

    // A guest lost in a step (its agent's connection closed, as when a
    // guest crashes): the build goes on in a new sandbox from the layers
    // cached so far, once; lost again, it fails with why.
    let lossy = |name: &str, marker: &str| {
        json!({
            "name": name,
            "from": {"type": "template", "name": "realbase"},
            "steps": [
                {"type": "user", "name": "root"},
                {"type": "workdir", "path": app},
                {"type": "run", "cmd": format!("echo first > first-{name}.txt")},
                {"type": "run", "cmd": format!("echo {marker} > {name}.txt")},
            ],
        })
    };
    server.fake.lose_guest("lost-once-marker", 1);
    let once = build(&server, lossy("lossy", "lost-once-marker")).await;
    assert_eq!(once["status"], "ready", "{once}\n{}", logs(&once));
    let said = logs(&once);
    assert!(
        said.contains(
            "closed the connection; the build goes on in a new sandbox from the \
             layers cached so far (attempt 2 of 2)"
        ),
        "{said}"
    );
    assert!(said.contains("CACHED RUN echo first"), "{said}");
    assert_eq!(
        std::fs::read_to_string(format!("{app}/lossy.txt")).unwrap(),
        "lost-once-marker\n"
    );
    server.fake.lose_guest("lost-twice-marker", 2);
    let twice = build(&server, lossy("lossier", "lost-twice-marker")).await;
    assert_eq!(twice["status"], "error", "{twice}");
    let f = &twice["failure"];
    assert!(
        f["message"]
            .as_str()
            .unwrap()
            .contains("the agent closed the connection"),
        "{twice}"
    );
    assert_eq!(f["step"], 3, "{twice}");
    assert_eq!(
        logs(&twice).matches("attempt 2 of 2").count(),
        1,
        "{}",
        logs(&twice)
    );
    let r = call(&server, ACME, "GET", "/v1/templates/lossier", None).await;
    assert_eq!(r.status, 404, "{}", r.text());

    // Cancelled while its step runs: the command is killed, no template.
    let mut slow = spec("sleep 30");
    slow["name"] = json!("slow");
    let r = call(&server, ACME, "POST", "/v1/builds", Some(slow)).await;
    assert_eq!(r.status, 202, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = call(&server, ACME, "GET", &format!("/v1/builds/{id}"), None)
            .await
            .json();
        if v["step"]["index"] == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    let r = call(
        &server,
        ACME,
        "POST",
        &format!("/v1/builds/{id}/cancel"),
        None,
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let cancelled = finished(&server, &id).await;
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the sleep was not killed"
    );
    let r = call(&server, ACME, "GET", "/v1/templates/slow", None).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = call(
        &server,
        ACME,
        "POST",
        &format!("/v1/builds/{id}/cancel"),
        None,
    )
    .await;
    assert_eq!(r.status, 409, "{}", r.text());

    // Bad input, no build: a body not of the schema's shape is 400
    // `invalid_request`; one of its shape with a value the build cannot
    // use is 422 `invalid_spec`; each names what is wrong.
    for (body, status, says) in [
        (
            json!({"from": {"type": "template", "name": "realbase"}}),
            400,
            "name",
        ),
        (
            json!({"name": "x", "from": {"type": "template", "name": "realbase"}, "steps": [{"type": "frobnicate"}]}),
            400,
            "frobnicate",
        ),
        (json!({"name": "x", "from": {"type": null}}), 400, "null"),
        (
            json!({"name": "x", "from": {"type": "template", "name": "realbase"}, "steps": [{"type": "run", "cmd": ""}]}),
            422,
            "cmd",
        ),
        (
            json!({"name": "build-layer-x", "from": {"type": "template", "name": "realbase"}}),
            422,
            "build-layer",
        ),
        (
            json!({"name": "x", "from": {"type": "template", "name": "realbase"}, "start": {}}),
            422,
            "start",
        ),
    ] {
        let r = call(&server, ACME, "POST", "/v1/builds", Some(body.clone())).await;
        assert_eq!(r.status, status, "{body}: {}", r.text());
        let code = if status == 400 {
            "invalid_request"
        } else {
            "invalid_spec"
        };
        assert_eq!(r.json()["error"]["code"], code, "{body}: {}", r.text());
        assert!(r.text().contains(says), "{body}: {}", r.text());
    }
    let r = call(
        &server,
        ACME,
        "POST",
        "/v1/builds",
        Some(json!({"name": "x", "from": {"type": "template", "name": "nope"}})),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());

    // The records outlive the server: a restart reads them back.
    let listed = call(&server, ACME, "GET", "/v1/builds", None).await.json();
    assert_eq!(listed["builds"].as_array().unwrap().len(), 7, "{listed}");
    let reopened = torpor_api::builds::Builds::open(Some(&scratch.path().join("builds"))).unwrap();
    assert_eq!(reopened.list(Some("acme")).len(), 7);
    server.shutdown().await.unwrap();
}
