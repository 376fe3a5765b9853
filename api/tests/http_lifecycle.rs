//! Templates, sandboxes and pods through the API: status codes, bodies,
//! illegal transitions, admission, filters passed to the service.

mod common;

use common::{Server, POD_ID, TEMPLATE_ID};
use serde_json::{json, Value};
use torpor_api::service::{SandboxFilter, MAX_KEEP_ALIVE_MS, MAX_TIMEOUT_MS};
use torpor_scheduler::model::{PodId, SandboxState, TemplateId};

async fn create(server: &Server, body: Value) -> Value {
    let r = server.call("POST", "/v1/sandboxes", Some(body)).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let sandbox = r.json();
    let id = sandbox["id"].as_str().unwrap();
    assert_eq!(
        r.header("location"),
        Some(format!("/v1/sandboxes/{id}").as_str())
    );
    sandbox
}

#[tokio::test]
async fn templates_list_get_create_delete() {
    let server = Server::start().await;
    let r = server.call("GET", "/v1/templates", None).await;
    assert_eq!(r.status, 200);
    let list = r.json();
    assert_eq!(list["templates"][0]["id"], TEMPLATE_ID);
    assert_eq!(list["templates"][0]["state"], "ready");

    let r = server
        .call("GET", &format!("/v1/templates/{TEMPLATE_ID}"), None)
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["name"], "probe");

    // What the service cannot do in this build is 501 `unsupported`.
    let body = json!({"name": "py", "kind": "linux", "image": "debian",
                      "mem_mib": 512, "vcpus": 2, "cmdline": "quiet"});
    let r = server.call("POST", "/v1/templates", Some(body)).await;
    r.assert_error(501, "unsupported");

    // Memory and vCPUs default to 64 MiB and 1.
    let body = json!({"name": "small", "kind": "probe"});
    let r = server.call("POST", "/v1/templates", Some(body)).await;
    assert_eq!(
        r.status,
        202,
        "a building template is accepted: {}",
        r.text()
    );
    let t = r.json();
    assert_eq!(t["state"], "building");
    assert_eq!(t["kind"], "probe");
    assert_eq!(
        (t["mem_mib"].as_u64(), t["vcpus"].as_u64()),
        (Some(64), Some(1))
    );
    let id = t["id"].as_str().unwrap().to_string();
    assert_eq!(
        r.header("location"),
        Some(format!("/v1/templates/{id}").as_str())
    );

    let body = json!({"name": "", "kind": "probe", "mem_mib": 64, "vcpus": 1});
    let r = server.call("POST", "/v1/templates", Some(body)).await;
    r.assert_error(400, "invalid_request");
    let body = json!({"name": "x", "kind": "windows", "mem_mib": 64, "vcpus": 1});
    let r = server.call("POST", "/v1/templates", Some(body)).await;
    r.assert_error(400, "invalid_request");

    let r = server
        .call("DELETE", &format!("/v1/templates/{id}"), None)
        .await;
    assert_eq!(r.status, 204);
    assert!(r.body.is_empty());
    let r = server
        .call("GET", &format!("/v1/templates/{id}"), None)
        .await;
    r.assert_error(404, "not_found");
    let r = server
        .call("DELETE", &format!("/v1/templates/{id}"), None)
        .await;
    r.assert_error(404, "not_found");
}

#[tokio::test]
async fn unknown_ids_are_404() {
    let server = Server::start().await;
    let missing = "sbx_ffffffffffffffff";
    for (method, path) in [
        ("GET", format!("/v1/sandboxes/{missing}")),
        ("DELETE", format!("/v1/sandboxes/{missing}")),
        ("POST", format!("/v1/sandboxes/{missing}/pause")),
        ("POST", format!("/v1/sandboxes/{missing}/resume")),
        ("POST", format!("/v1/sandboxes/{missing}/hibernate")),
        ("GET", "/v1/templates/tpl_ffffffffffffffff".to_string()),
        ("GET", "/v1/sandboxes/not%20an%20id".to_string()),
    ] {
        let r = server.call(method, &path, None).await;
        let e = r.assert_error(404, "not_found");
        assert!(e.get("state").is_none());
    }
    let r = server
        .call(
            "PATCH",
            &format!("/v1/sandboxes/{missing}"),
            Some(json!({"keep_alive_ms": 5})),
        )
        .await;
    r.assert_error(404, "not_found");
    let r = server
        .call(
            "PATCH",
            "/v1/pods/pod_nowhere",
            Some(json!({"high_watermark": 0.5})),
        )
        .await;
    r.assert_error(404, "not_found");
    let r = server
        .call(
            "POST",
            "/v1/sandboxes",
            Some(json!({"template": "no-such-template"})),
        )
        .await;
    r.assert_error(404, "not_found");
}

#[tokio::test]
async fn sandbox_lifecycle_and_illegal_transitions() {
    let server = Server::start().await;
    let sandbox = create(
        &server,
        json!({"template": TEMPLATE_ID, "keep_alive_ms": 5000,
               "metadata": {"team": "ml"}}),
    )
    .await;
    assert_eq!(sandbox["state"], "running");
    assert_eq!(sandbox["mem_mib"], 256);
    assert_eq!(sandbox["keep_alive_ms"], 5000);
    assert_eq!(sandbox["metadata"]["team"], "ml");
    let id = sandbox["id"].as_str().unwrap().to_string();
    let at = |op: &str| format!("/v1/sandboxes/{id}/{op}");

    let r = server
        .call("GET", &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["id"], id.as_str());

    // Resume of a running sandbox is illegal: 409 with its state.
    let r = server.call("POST", &at("resume"), None).await;
    let e = r.assert_error(409, "conflict");
    assert_eq!(e["state"], "running");

    let r = server.call("POST", &at("pause"), None).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let out = r.json();
    assert_eq!(out["sandbox"]["state"], "paused");
    assert_eq!(out["resumed"], false);
    assert_eq!(out["resume_ms"], Value::Null);

    let r = server.call("POST", &at("pause"), None).await;
    assert_eq!(r.assert_error(409, "conflict")["state"], "paused");

    let r = server.call("POST", &at("hibernate"), None).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["sandbox"]["state"], "hibernated");
    let r = server.call("POST", &at("hibernate"), None).await;
    assert_eq!(r.assert_error(409, "conflict")["state"], "hibernated");
    let r = server.call("POST", &at("pause"), None).await;
    assert_eq!(r.assert_error(409, "conflict")["state"], "hibernated");

    // Waking from hibernation says so, and how long it took.
    let r = server.call("POST", &at("resume"), None).await;
    assert_eq!(r.status, 200);
    let out = r.json();
    assert_eq!(out["sandbox"]["state"], "running");
    assert_eq!(out["resumed"], true);
    assert_eq!(out["resume_ms"], 3.5);

    let r = server
        .call(
            "PATCH",
            &format!("/v1/sandboxes/{id}"),
            Some(json!({"keep_alive_ms": 1234, "timeout_ms": 60000})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["keep_alive_ms"], 1234);
    assert!(r.json()["expires_at"].is_i64());
    let last = server
        .fake
        .state
        .lock()
        .unwrap()
        .last_timeout
        .clone()
        .unwrap();
    assert_eq!(last.0.as_str(), id);
    assert_eq!((last.1, last.2), (Some(1234), Some(60000)));

    // Its template cannot go while it lives: 409, no sandbox state.
    let r = server
        .call("DELETE", &format!("/v1/templates/{TEMPLATE_ID}"), None)
        .await;
    let e = r.assert_error(409, "conflict");
    assert!(e["message"].as_str().unwrap().contains("in use"), "{e}");
    assert!(e.get("state").is_none_or(Value::is_null), "{e}");

    let r = server
        .call("DELETE", &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(r.status, 204);
    let r = server
        .call("DELETE", &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(r.assert_error(409, "conflict")["state"], "deleted");
    let r = server.call("POST", &at("resume"), None).await;
    assert_eq!(r.assert_error(409, "conflict")["state"], "deleted");
}

#[tokio::test]
async fn admission_past_the_ratio_is_429_and_ratio_changes_apply() {
    let server = Server::start().await;
    // The pod has 1024 MiB at ratio 1.0: four 256 MiB sandboxes fit.
    for _ in 0..4 {
        create(&server, json!({"template": "probe"})).await;
    }
    let r = server
        .call("POST", "/v1/sandboxes", Some(json!({"template": "probe"})))
        .await;
    let e = r.assert_error(429, "admission_refused");
    assert!(e["message"].as_str().unwrap().contains("full"), "{e}");

    // Queued instead: accepted, still creating.
    let r = server
        .call(
            "POST",
            "/v1/sandboxes",
            Some(json!({"template": "probe", "queue": true})),
        )
        .await;
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(r.json()["state"], "creating");

    let r = server.call("GET", "/v1/pods", None).await;
    assert_eq!(r.status, 200);
    let pod = r.json()["pods"][0].clone();
    assert_eq!(pod["id"], POD_ID);
    assert_eq!(pod["oversubscription_ratio"], 1.0);
    assert_eq!(pod["committed_mib"], 1024);
    assert_eq!(pod["sandboxes"]["running"], 4);
    assert_eq!(pod["sandboxes"]["creating"], 1);
    assert_eq!(pod["address"]["kind"], "local");
    assert!(pod.get("token_hash").is_none());
    assert_eq!(pod["resident_mib"], 10.0);
    // One pod by its id: the same entry; another id is 404.
    let r = server
        .call("GET", &format!("/v1/pods/{POD_ID}"), None)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json(), pod);
    let r = server.call("GET", "/v1/pods/pod_nowhere", None).await;
    r.assert_error(404, "not_found");

    let r = server
        .call(
            "PATCH",
            &format!("/v1/pods/{POD_ID}"),
            Some(json!({"oversubscription_ratio": 2.0, "high_watermark": 0.8})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["oversubscription_ratio"], 2.0);
    assert_eq!(r.json()["high_watermark"], 0.8);
    create(&server, json!({"template": "probe"})).await;

    let r = server
        .call(
            "PATCH",
            &format!("/v1/pods/{POD_ID}"),
            Some(json!({"oversubscription_ratio": 0.0})),
        )
        .await;
    r.assert_error(400, "invalid_request");
}

#[tokio::test]
async fn list_filters_reach_the_service() {
    let server = Server::start().await;
    let a = create(
        &server,
        json!({"template": "probe", "metadata": {"team": "ml", "user": "ada"}}),
    )
    .await;
    let b = create(
        &server,
        json!({"template": "probe", "metadata": {"team": "web"}}),
    )
    .await;
    let b_id = b["id"].as_str().unwrap();
    let r = server
        .call("POST", &format!("/v1/sandboxes/{b_id}/pause"), None)
        .await;
    assert_eq!(r.status, 200);

    let r = server
        .call(
            "GET",
            &format!(
                "/v1/sandboxes?state=running,paused&state=hibernated&template={TEMPLATE_ID}\
                 &pod={POD_ID}&metadata.team=ml&metadata.user=ada"
            ),
            None,
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let list = r.json()["sandboxes"].as_array().unwrap().clone();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["id"], a["id"]);
    let filter = server
        .fake
        .state
        .lock()
        .unwrap()
        .last_filter
        .clone()
        .unwrap();
    assert_eq!(
        filter,
        SandboxFilter {
            states: vec![
                SandboxState::Running,
                SandboxState::Paused,
                SandboxState::Hibernated
            ],
            template: Some(TemplateId::new(TEMPLATE_ID)),
            pod: Some(PodId::new(POD_ID)),
            metadata: [
                ("team".to_string(), "ml".to_string()),
                ("user".to_string(), "ada".to_string())
            ]
            .into(),
            tenant: None,
        }
    );

    // Percent-encoded keys and values are decoded.
    let r = server
        .call(
            "GET",
            "/v1/sandboxes?state=paused&metadata.team=w%65b",
            None,
        )
        .await;
    assert_eq!(r.status, 200);
    let list = r.json()["sandboxes"].as_array().unwrap().clone();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["id"], b_id);

    // No filter: the default (every state but deleted).
    let r = server.call("GET", "/v1/sandboxes", None).await;
    assert_eq!(r.json()["sandboxes"].as_array().unwrap().len(), 2);
    let filter = server
        .fake
        .state
        .lock()
        .unwrap()
        .last_filter
        .clone()
        .unwrap();
    assert_eq!(filter, SandboxFilter::default());
}

#[tokio::test]
async fn lifetimes_past_their_maximum_are_400_before_the_service() {
    let server = Server::start().await;
    let sandbox = create(&server, json!({"template": "probe"})).await;
    let id = sandbox["id"].as_str().unwrap();
    let path = format!("/v1/sandboxes/{id}");
    for (field, max) in [
        ("timeout_ms", MAX_TIMEOUT_MS),
        ("keep_alive_ms", MAX_KEEP_ALIVE_MS),
    ] {
        for ms in [u64::MAX, i64::MAX as u64, max + 1] {
            let r = server
                .call("PATCH", &path, Some(json!({ field: ms })))
                .await;
            let e = r.assert_error(400, "invalid_request");
            assert!(e["message"].as_str().unwrap().contains(field), "{e}");
            let body = json!({"template": "probe", field: ms});
            let r = server.call("POST", "/v1/sandboxes", Some(body)).await;
            r.assert_error(400, "invalid_request");
            let fork = format!("{path}/fork");
            let r = server.call("POST", &fork, Some(json!({ field: ms }))).await;
            r.assert_error(400, "invalid_request");
        }
    }
    // The service was never asked; the sandbox is as it was.
    assert!(server.fake.state.lock().unwrap().last_timeout.is_none());
    let r = server.call("GET", &path, None).await;
    assert_eq!(r.json(), sandbox);
    let r = server.call("GET", "/v1/sandboxes", None).await;
    assert_eq!(r.json()["sandboxes"].as_array().unwrap().len(), 1);

    // The maxima themselves are taken.
    let body = json!({"timeout_ms": MAX_TIMEOUT_MS, "keep_alive_ms": MAX_KEEP_ALIVE_MS});
    let r = server.call("PATCH", &path, Some(body)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["keep_alive_ms"], MAX_KEEP_ALIVE_MS);
}

/// The hibernation bodies reach the service as their lifecycle calls, and
/// memory kept while the guest agent did not answer wakes only by a
/// reboot: `/v1` answers 409 `guest_unresponsive`, E2B 409 with E2B's
/// `error_code` (the SDK's `GuestUnresponsiveException`), and shows
/// `envdUnresponsiveAtPause`; a reboot (`mode: reboot`, E2B's
/// `memory: false`) wakes it.
#[tokio::test]
async fn hibernation_modes_and_a_guest_unresponsive_at_pause() {
    let server = Server::start().await;
    let sandbox = create(&server, json!({"template": TEMPLATE_ID})).await;
    let id = sandbox["id"].as_str().unwrap().to_string();
    let at = |op: &str| format!("/v1/sandboxes/{id}/{op}");

    let r = server
        .call(
            "POST",
            &at("hibernate"),
            Some(json!({"mode": "filesystem"})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sandbox"]["disk_only"], true);
    let r = server
        .call("POST", &at("connect"), Some(json!({"mode": "reboot"})))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["resumed"], true);
    assert!(r.json()["sandbox"].get("disk_only").is_none());
    for bad in [
        json!({"mode": "disk"}),
        json!({"guest_check": "maybe"}),
        json!([1]),
    ] {
        let r = server.call("POST", &at("hibernate"), Some(bad)).await;
        r.assert_error(400, "invalid_request");
    }
    let r = server
        .call("POST", &at("connect"), Some(json!({"mode": "later"})))
        .await;
    r.assert_error(400, "invalid_request");

    // Hibernated with its memory while its agent did not answer.
    let r = server
        .call(
            "POST",
            &at("hibernate"),
            Some(json!({"guest_check": "mark"})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    {
        let mut st = server.fake.state.lock().unwrap();
        let s = st
            .sandboxes
            .get_mut(&torpor_scheduler::model::SandboxId::new(&id))
            .unwrap();
        s.guest_unresponsive_at_pause = true;
    }
    let r = server.call("POST", &at("connect"), None).await;
    let e = r.assert_error(409, "guest_unresponsive");
    assert!(e["message"].as_str().unwrap().contains("reboot"), "{e}");

    let key = [("X-API-KEY", common::TOKEN.to_string())];
    let r = server
        .request("GET", &format!("/sandboxes/{id}"), &key, None)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["envdUnresponsiveAtPause"], true, "{}", r.text());
    let r = server
        .request(
            "POST",
            &format!("/sandboxes/{id}/connect"),
            &key,
            Some(b"{}"),
        )
        .await;
    assert_eq!(r.status, 409, "{}", r.text());
    let v = r.json();
    assert_eq!(v["code"], 409);
    assert_eq!(
        v["error_code"], "sandbox_snapshot_guest_agent_unresponsive",
        "{v}"
    );
    let r = server
        .request(
            "POST",
            &format!("/sandboxes/{id}/connect"),
            &key,
            Some(br#"{"memory":false}"#),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = server
        .request("GET", &format!("/sandboxes/{id}"), &key, None)
        .await;
    assert!(
        r.json().get("envdUnresponsiveAtPause").is_none(),
        "{}",
        r.text()
    );

    // E2B's pause bodies: filesystem only, and the strict one.
    let r = server
        .request(
            "POST",
            &format!("/sandboxes/{id}/pause"),
            &key,
            Some(br#"{"memory":false}"#),
        )
        .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = server
        .call("GET", &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(r.json()["disk_only"], true, "{}", r.text());
}
