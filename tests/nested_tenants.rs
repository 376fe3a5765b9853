//! Attack 7 of issue 24 (its templates): the tenant travels to the nested
//! pod. `torpor serve`'s API in process (a `Nested` over a local probe
//! service, as `torpor serve` builds it) with a real `torpor pod serve`
//! process attached as its nested pod is (on a unix socket, no QEMU). A
//! tenant's create, fork and snapshot-as-template run on the pod for that
//! tenant (`X-Torpor-On-Behalf-Of`, honoured for the pod's admin token
//! only): the pod records the tenant and resolves template names in its
//! namespace, so another tenant cannot start a sandbox from the first
//! one's snapshot there, through serve or on the pod itself.

mod common;

use serde_json::{json, Value};
use torpor_api::SandboxApi;
use torpor_client::HttpClient;
use torpor_scheduler::model::SandboxId;

use common::http::{request, request_with, HttpResponse};
use common::nested_pod::NestedRig;

const ADMIN: &str = "nested-tenants-admin-0123456789";

/// The pod's own API with its token, for `tenant` if given.
fn on_pod(
    client: &HttpClient,
    tenant: Option<&str>,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let client = match tenant {
        Some(t) => client
            .clone()
            .with_headers(&[(torpor_api::pods::ON_BEHALF_OF, t)]),
        None => client.clone(),
    };
    let text = body.map(|b| b.to_string());
    let body = text.as_deref().map(|t| ("application/json", t.as_bytes()));
    let answer = client.request(method, path, body, None).unwrap();
    let v = serde_json::from_slice(&answer.body).unwrap_or(Value::Null);
    (answer.status, v)
}

#[test]
fn the_tenant_travels_to_the_attached_pod() {
    let rig = NestedRig::start("nested-tenants", ADMIN);
    let (api, pod) = (&rig.api, &rig.pod);
    let call = |token: &str, method: &str, path: &str, body: Option<Value>| -> HttpResponse {
        let body = body.map(|b| b.to_string());
        request(&api.addr, method, path, Some(token), body.as_deref())
    };
    let e2b = |key: &str, method: &str, path: &str, body: Value| -> HttpResponse {
        let body = body.to_string();
        request_with(&api.addr, method, path, &[("X-API-KEY", key)], Some(&body))
    };
    let tenant = |name: &str| {
        let v = call(ADMIN, "POST", "/v1/tokens", Some(json!({ "tenant": name })))
            .ok_json("POST", "/v1/tokens");
        v["token"].as_str().unwrap().to_string()
    };
    let (acme, bravo) = (tenant("acme"), tenant("bravo"));
    // Creates go to the nested pod: the local one is full.
    rig.fill_local_pod();

    // acme's sandbox is acme's on the pod.
    let made = call(
        &acme,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "probe"})),
    )
    .ok_json("POST", "/v1/sandboxes");
    assert_ne!(made["pod"], "pod_local", "{made}");
    let id = made["id"].as_str().unwrap().to_string();
    let (status, there) = on_pod(pod, None, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(
        (status, there["tenant"].as_str()),
        (200, Some("acme")),
        "{there}"
    );

    // Its snapshots (relayed `/v1`, E2B's typed call) and its fork too.
    let path = format!("/v1/sandboxes/{id}/template");
    let snap =
        call(&acme, "POST", &path, Some(json!({"name": "acme-snap"}))).ok_json("POST", &path);
    let snap_id = snap["id"].as_str().unwrap().to_string();
    let r = e2b(
        &acme,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        json!({"name": "acme-snap-2"}),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let snap2_id = r.json()["snapshotID"].as_str().unwrap().to_string();
    for t in [&snap_id, &snap2_id] {
        let (status, v) = on_pod(pod, None, "GET", &format!("/v1/templates/{t}"), None);
        assert_eq!((status, v["tenant"].as_str()), (200, Some("acme")), "{v}");
    }
    let path = format!("/v1/sandboxes/{id}/fork");
    let fork = call(&acme, "POST", &path, Some(json!({}))).ok_json("POST", &path);
    let fork_id = fork["id"].as_str().unwrap();
    let (status, v) = on_pod(pod, None, "GET", &format!("/v1/sandboxes/{fork_id}"), None);
    assert_eq!((status, v["tenant"].as_str()), (200, Some("acme")), "{v}");

    // acme starts from its snapshot by name; bravo from it neither by
    // name nor by id, through serve (`/v1`, E2B) or on the pod itself.
    let from = call(
        &acme,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "acme-snap"})),
    )
    .ok_json("POST", "/v1/sandboxes");
    assert_eq!(from["template"], snap_id.as_str(), "{from}");
    for key in [&snap_id, "acme-snap"] {
        let r = call(
            &bravo,
            "POST",
            "/v1/sandboxes",
            Some(json!({ "template": key })),
        );
        assert_eq!(r.status, 404, "{key}: {}", r.body);
        let r = e2b(
            &bravo,
            "POST",
            "/v2/sandboxes",
            json!({ "templateID": key }),
        );
        assert_eq!(r.status, 404, "{key}: {}", r.body);
        let r = call(&bravo, "GET", &format!("/v1/templates/{key}"), None);
        assert_eq!(r.status, 404, "{key}: {}", r.body);
        let (status, v) = on_pod(
            pod,
            Some("bravo"),
            "POST",
            "/v1/sandboxes",
            Some(json!({ "template": key })),
        );
        assert_eq!(status, 404, "{key} on the pod for bravo: {v}");
    }
    let (status, _) = on_pod(
        pod,
        Some("bravo"),
        "GET",
        &format!("/v1/sandboxes/{id}"),
        None,
    );
    assert_eq!(status, 404, "acme's sandbox on the pod, for bravo");
    let (status, _) = on_pod(
        pod,
        Some("bravo"),
        "POST",
        &format!("/v1/sandboxes/{id}/fork"),
        Some(json!({})),
    );
    assert_eq!(
        status, 404,
        "a fork of acme's sandbox on the pod, for bravo"
    );
    let (status, v) = on_pod(
        pod,
        Some("acme"),
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "acme-snap"})),
    );
    assert_eq!((status, v["tenant"].as_str()), (201, Some("acme")), "{v}");
    // The header is an admin's: a tenant's token with it is refused.
    let r = request_with(
        &api.addr,
        "GET",
        "/v1/sandboxes",
        &[
            ("Authorization", &format!("Bearer {acme}")),
            ("X-Torpor-On-Behalf-Of", "bravo"),
        ],
        None,
    );
    assert_eq!(r.status, 403, "{}", r.body);
}

/// Every snapshot `state` file under `dir`.
fn state_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(state_files(&path));
        } else if path.file_name().is_some_and(|n| n == "state") {
            found.push(path);
        }
    }
    found
}

/// Issue 26: a create that fails on the nested pod after the pod recorded
/// the sandbox used to stay invisible to serve, and only the pod's own
/// token could delete it. Now serve records it with its tenant: the
/// tenant lists it (failed) and deletes it through serve.
#[test]
fn a_failed_create_on_the_attached_pod_is_listed_and_deleted_through_serve() {
    let rig = NestedRig::start("nested-failed-create", ADMIN);
    let api = &rig.api;
    let call = |token: &str, method: &str, path: &str, body: Option<Value>| -> HttpResponse {
        let body = body.map(|b| b.to_string());
        request(&api.addr, method, path, Some(token), body.as_deref())
    };
    let v = call(
        ADMIN,
        "POST",
        "/v1/tokens",
        Some(json!({ "tenant": "acme" })),
    )
    .ok_json("POST", "/v1/tokens");
    let acme = v["token"].as_str().unwrap().to_string();
    rig.fill_local_pod();
    // The pod's probe snapshot made unreadable: its restores fail.
    let states = state_files(&rig.pod_data().join("templates"));
    assert!(!states.is_empty(), "no template snapshot on the pod");
    for state in &states {
        std::fs::write(state, b"not a snapshot").unwrap();
    }
    let r = call(
        &acme,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "probe"})),
    );
    assert!(
        r.status >= 500,
        "the create should fail: {} {}",
        r.status,
        r.body
    );
    // The pod recorded it, failed.
    let (_, on_pod_list) = on_pod(&rig.pod, None, "GET", "/v1/sandboxes", None);
    let failed: Vec<&Value> = on_pod_list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["state"] == "failed")
        .collect();
    assert_eq!(failed.len(), 1, "{on_pod_list}");
    let id = failed[0]["id"].as_str().unwrap().to_string();
    // serve lists it for acme, and acme deletes it through serve.
    let listed = call(&acme, "GET", "/v1/sandboxes", None).ok_json("GET", "/v1/sandboxes");
    let seen = listed["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["id"] == id.as_str() && s["state"] == "failed");
    assert!(
        seen,
        "serve does not list the failed sandbox {id}: {listed}"
    );
    let path = format!("/v1/sandboxes/{id}");
    let r = call(&acme, "DELETE", &path, None);
    assert!(
        r.status == 204 || r.status == 200,
        "{} {}",
        r.status,
        r.body
    );
    let (status, there) = on_pod(&rig.pod, None, "GET", &path, None);
    assert_eq!(
        (status, there["state"].as_str()),
        (200, Some("deleted")),
        "{there}"
    );
}

/// A restart of serve keeps what it knows of its nested pod's sandboxes
/// (its store, `nested_sandboxes`): after serve is stopped and opened
/// again on the same data directory, with the pod re-attached under the
/// same id, a tenant's running and hibernated sandboxes answer with their
/// tenant (another tenant gets 404), envd token and environment. When
/// their nested host is gone, they stay listed, failed with why (also
/// after the next restart), their routes answer 410, and DELETE forgets
/// them.
#[test]
fn a_restart_of_serve_keeps_the_nested_pods_sandboxes_and_a_lost_host_fails_them() {
    let rig = NestedRig::start("nested-restart", ADMIN);
    let tenant = |rig: &NestedRig, name: &str| {
        let r = request(
            &rig.api.addr,
            "POST",
            "/v1/tokens",
            Some(ADMIN),
            Some(&json!({ "tenant": name }).to_string()),
        );
        r.ok_json("POST", "/v1/tokens")["token"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (acme, bravo) = (tenant(&rig, "acme"), tenant(&rig, "bravo"));
    rig.fill_local_pod();
    let mut made = Vec::new();
    for _ in 0..2 {
        let body = json!({"templateID": "probe", "secure": true, "envVars": {"GREETING": "hello"}});
        let r = request_with(
            &rig.api.addr,
            "POST",
            "/sandboxes",
            &[("X-API-KEY", &acme)],
            Some(&body.to_string()),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        let v = r.json();
        let id = v["sandboxID"].as_str().unwrap().to_string();
        let envd = v["envdAccessToken"].as_str().unwrap().to_string();
        made.push((id, envd));
    }
    let hibernated = &made[1].0;
    let r = request(
        &rig.api.addr,
        "POST",
        &format!("/v1/sandboxes/{hibernated}/hibernate"),
        Some(ADMIN),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // A third one deleted on the pod directly (with the pod's own token):
    // the restarted serve finds it gone, and says so.
    let r = request_with(
        &rig.api.addr,
        "POST",
        "/sandboxes",
        &[("X-API-KEY", &acme)],
        Some(r#"{"templateID": "probe"}"#),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let vanished = r.json()["sandboxID"].as_str().unwrap().to_string();
    let (status, _) = on_pod(
        &rig.pod,
        None,
        "DELETE",
        &format!("/v1/sandboxes/{vanished}"),
        None,
    );
    assert!(status == 204 || status == 200, "{status}");

    let rig = rig.restart_serve();
    let get = |rig: &NestedRig, key: &str, id: &str| {
        request(
            &rig.api.addr,
            "GET",
            &format!("/v1/sandboxes/{id}"),
            Some(key),
            None,
        )
    };
    for (n, (id, envd)) in made.iter().enumerate() {
        let mine = get(&rig, &acme, id);
        assert_eq!(mine.status, 200, "{}", mine.body);
        let v = mine.json();
        assert_eq!(v["tenant"], "acme", "{v}");
        let want = if n == 0 { "running" } else { "hibernated" };
        assert_eq!(v["state"], want, "{v}");
        assert_eq!(get(&rig, &bravo, id).status, 404);
        // What the pod never shows, from serve's store.
        let kept = torpor_api::backend::wait(rig.nested.get_sandbox(&SandboxId::new(id.as_str())))
            .unwrap();
        assert_eq!(kept.access_token.as_deref(), Some(envd.as_str()));
        assert_eq!(kept.env.get("GREETING").map(String::as_str), Some("hello"));
        // envd takes the same token (health: the running one runs).
        let health = |token: &str| {
            request_with(
                &rig.api.addr,
                "GET",
                "/health",
                &[("E2b-Sandbox-Id", id), ("X-Access-Token", token)],
                None,
            )
            .status
        };
        assert_eq!(health("not-the-token"), 502);
        assert_eq!(health(envd), if n == 0 { 204 } else { 502 });
    }

    let v = get(&rig, &acme, &vanished).ok_json("GET", "a vanished sandbox");
    assert_eq!(v["state"], "failed", "{v}");
    let why = v["failure_reason"].as_str().unwrap();
    assert!(why.contains("no longer knows it"), "{v}");

    // The nested host is gone: its sandboxes are lost, not dropped.
    rig.nested.detach(&rig.pod_id);
    let lost = rig
        .nested
        .mark_lost(None, "its nested host stopped (test)")
        .unwrap();
    assert_eq!(lost, 2);
    let rig = rig.restart_serve();
    for (id, _) in &made {
        let v = get(&rig, &acme, id).ok_json("GET", "a lost sandbox");
        assert_eq!(v["state"], "failed", "{v}");
        assert!(
            v["failure_reason"]
                .as_str()
                .unwrap()
                .contains("its nested host stopped (test)"),
            "{v}"
        );
        assert_eq!(get(&rig, &bravo, id).status, 404);
        let r = request(
            &rig.api.addr,
            "POST",
            &format!("/v1/sandboxes/{id}/pause"),
            Some(&acme),
            None,
        );
        assert_eq!(r.status, 410, "{}", r.body);
    }
    let listed = request(
        &rig.api.addr,
        "GET",
        "/v1/sandboxes?state=failed",
        Some(&acme),
        None,
    )
    .ok_json("GET", "/v1/sandboxes");
    let failed = listed["sandboxes"].as_array().unwrap().len();
    assert_eq!(failed, 3, "{listed}");
    let (id, _) = &made[0];
    let r = request(
        &rig.api.addr,
        "DELETE",
        &format!("/v1/sandboxes/{id}"),
        Some(&acme),
        None,
    );
    assert!(
        r.status == 204 || r.status == 200,
        "{} {}",
        r.status,
        r.body
    );
    assert_eq!(get(&rig, &acme, id).status, 404);
}
