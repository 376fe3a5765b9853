//! The E2B-compatible control plane of `torpor serve` on loopback with the
//! probe template (no guest agent needed): each route's fields and status
//! codes, E2B's error body, auth by `X-API-KEY`, paging, pause as
//! hibernation, timeouts, envd's health and errors, and `--e2b-listen`.
//! Snapshots, forks and metrics are in `e2b_snapshots_metrics.rs`.

mod common;

use common::e2b_http::{assert_e2b_error, id_of, E2b, KEY};
use common::http::{declared_only, request, request_with};
use common::serve::DataDir;
use serde_json::Value;

#[test]
fn create_get_timeout_kill() {
    let data = DataDir::new("e2b-lifecycle");
    let s = E2b::start(&data.0, &[]);

    let created =
        s.create(r#"{"templateID":"probe","timeout":120,"metadata":{"team":"a"},"envVars":{}}"#);
    let id = id_of(&created);
    assert!(id.starts_with("sbx_"), "{created}");
    assert!(
        created["templateID"].as_str().unwrap().starts_with("tpl_"),
        "{created}"
    );
    assert_eq!(created["alias"], "probe");
    assert_eq!(created["clientID"], torpor_scheduler::service::LOCAL_POD);
    assert_eq!(created["envdVersion"], torpor_api::e2b::wire::ENVD_VERSION);
    // `serve --proxy-domain`'s default: ports at `{port}-{id}.localhost`.
    assert_eq!(created["domain"], "localhost", "{created}");
    assert_eq!(
        created["trafficAccessToken"].as_str().map(str::len),
        Some(32)
    );

    // v1 create takes the same body.
    let v1 = s.expect(201, "POST", "/sandboxes", Some(r#"{"templateID":"probe"}"#));
    let v1_id = id_of(&v1);

    let info = s.expect(200, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(info["sandboxID"], id.as_str());
    assert_eq!(info["state"], "running");
    assert_eq!(info["metadata"]["team"], "a");
    assert_eq!(info["cpuCount"], 1);
    assert!(info["memoryMB"].as_u64().unwrap() > 0, "{info}");
    let started = torpor_api::e2b::time::parse(info["startedAt"].as_str().unwrap()).unwrap();
    let end = torpor_api::e2b::time::parse(info["endAt"].as_str().unwrap()).unwrap();
    let lifetime = end.0 - started.0;
    assert!((119_000..=121_000).contains(&lifetime), "{info}");

    // The timeout moves the end to `timeout` s from now (shorter too).
    s.expect(
        204,
        "POST",
        &format!("/sandboxes/{id}/timeout"),
        Some(r#"{"timeout":30}"#),
    );
    let info = s.expect(200, "GET", &format!("/sandboxes/{id}"), None);
    let end = torpor_api::e2b::time::parse(info["endAt"].as_str().unwrap()).unwrap();
    let left = end.0 - torpor_scheduler::model::Timestamp::now().0;
    assert!((20_000..=30_500).contains(&left), "{info}");
    // A refresh never shortens it.
    s.expect(
        204,
        "POST",
        &format!("/sandboxes/{id}/refreshes"),
        Some(r#"{"duration":1}"#),
    );
    let again = s.expect(200, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(again["endAt"], info["endAt"]);

    let metrics = s.expect(200, "GET", &format!("/sandboxes/{id}/metrics"), None);
    let m = &metrics[0];
    assert_eq!(m["cpuCount"], 1, "{metrics}");
    assert!(m["memUsed"].as_u64().unwrap() > 0, "{metrics}");
    assert_eq!(
        m["memTotal"].as_u64().unwrap(),
        info["memoryMB"].as_u64().unwrap() << 20
    );

    // The v1 list has both running sandboxes.
    let listed = s.expect(200, "GET", "/sandboxes", None);
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["sandboxID"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [v1_id.as_str(), id.as_str()], "newest first: {listed}");

    s.expect(204, "DELETE", &format!("/sandboxes/{id}"), None);
    for (method, path, body) in [
        ("GET", format!("/sandboxes/{id}"), None),
        ("DELETE", format!("/sandboxes/{id}"), None),
        ("POST", format!("/sandboxes/{id}/pause"), None),
        (
            "POST",
            format!("/sandboxes/{id}/timeout"),
            Some(r#"{"timeout":5}"#),
        ),
        (
            "POST",
            format!("/v2/sandboxes/{id}/connect"),
            Some(r#"{"timeout":5}"#),
        ),
        ("GET", format!("/sandboxes/{id}/metrics"), None),
        ("POST", format!("/sandboxes/{id}/fork"), None),
        ("POST", format!("/sandboxes/{id}/snapshots"), None),
    ] {
        assert_e2b_error(&s.call(method, &path, body), 404);
    }
    s.expect(204, "DELETE", &format!("/sandboxes/{v1_id}"), None);
}

#[test]
fn pause_is_hibernation_and_connect_wakes() {
    let data = DataDir::new("e2b-pause");
    let s = E2b::start(&data.0, &[]);
    let id = id_of(&s.create(r#"{"templateID":"probe","timeout":300}"#));

    // Connecting to a running sandbox: 200, nothing to wake.
    let c = s.expect(
        200,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        Some(r#"{"timeout":300}"#),
    );
    assert_eq!(c["sandboxID"], id.as_str());
    // Running: a read samples it (its history is not empty).
    let running = s.expect(200, "GET", &format!("/sandboxes/{id}/metrics"), None);
    assert!(!running.as_array().unwrap().is_empty(), "{running}");

    s.expect(
        204,
        "POST",
        &format!("/sandboxes/{id}/pause"),
        Some(r#"{"memory":true}"#),
    );
    assert_e2b_error(
        &s.call("POST", &format!("/sandboxes/{id}/pause"), None),
        409,
    );
    let info = s.expect(200, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(info["state"], "paused");
    // Under the E2B name, torpor's state: hibernated (no VMM).
    let native = request(
        &s.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(KEY),
        None,
    )
    .json();
    assert_eq!(native["state"], "hibernated", "{native}");
    assert!(native["vmm"].is_null(), "{native}");
    // Paused: its history from before (read above), nothing new.
    let paused_at = torpor_scheduler::model::Timestamp::now().0 / 1000;
    let history = s.expect(200, "GET", &format!("/sandboxes/{id}/metrics"), None);
    assert!(!history.as_array().unwrap().is_empty(), "{history}");
    std::thread::sleep(std::time::Duration::from_millis(600));
    let later = s.expect(200, "GET", &format!("/sandboxes/{id}/metrics"), None);
    assert_eq!(later, history, "no samples while paused");
    for m in history.as_array().unwrap() {
        assert!(m["timestampUnix"].as_i64().unwrap() <= paused_at, "{m}");
    }

    // Connect wakes it: 201, running again; the timeout is extended.
    let c = s.expect(
        201,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        Some(r#"{"timeout":600}"#),
    );
    assert_eq!(c["sandboxID"], id.as_str());
    let info = s.expect(200, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(info["state"], "running");
    let end = torpor_api::e2b::time::parse(info["endAt"].as_str().unwrap()).unwrap();
    assert!(
        end.0 - torpor_scheduler::model::Timestamp::now().0 > 500_000,
        "{info}"
    );

    // v1 connect and the deprecated resume: resume refuses a running one.
    s.expect(
        200,
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(r#"{"timeout":600}"#),
    );
    assert_e2b_error(
        &s.call("POST", &format!("/sandboxes/{id}/resume"), None),
        409,
    );
    s.expect(204, "POST", &format!("/sandboxes/{id}/pause"), None);
    s.expect(
        201,
        "POST",
        &format!("/sandboxes/{id}/resume"),
        Some(r#"{"timeout":600}"#),
    );
    assert_eq!(
        s.expect(200, "GET", &format!("/sandboxes/{id}"), None)["state"],
        "running"
    );
    s.expect(204, "DELETE", &format!("/sandboxes/{id}"), None);
}

#[test]
fn list_filters_and_pages() {
    let data = DataDir::new("e2b-list");
    let s = E2b::start(&data.0, &[]);
    let mut ours = Vec::new();
    for _ in 0..3 {
        ours.push(id_of(&s.create(
            r#"{"templateID":"probe","timeout":300,"metadata":{"team a":"x&y=z"}}"#,
        )));
    }
    let other =
        id_of(&s.create(r#"{"templateID":"probe","timeout":300,"metadata":{"team a":"b"}}"#));
    s.expect(204, "POST", &format!("/sandboxes/{}/pause", ours[2]), None);

    // The SDKs' encoding: urlencode({quote(k): quote(v)}), then the query's.
    let meta = "metadata=team%252520a%3Dx%252526y%25253Dz";
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut path = format!("/v2/sandboxes?{meta}&limit=2");
        if let Some(t) = &token {
            path.push_str(&format!("&nextToken={t}"));
        }
        let r = s.call("GET", &path, None);
        assert_eq!(r.status, 200, "{}", r.body);
        let page = r.json();
        assert!(page.as_array().unwrap().len() <= 2, "{page}");
        for x in page.as_array().unwrap() {
            assert_eq!(x["metadata"]["team a"], "x&y=z", "{x}");
            seen.push(x["sandboxID"].as_str().unwrap().to_string());
        }
        pages += 1;
        token = r.header("x-next-token").map(str::to_string);
        if token.is_none() {
            break;
        }
    }
    assert_eq!(pages, 2);
    let newest_first: Vec<String> = ours.iter().rev().cloned().collect();
    assert_eq!(
        seen, newest_first,
        "newest first, each once, only the filtered ones"
    );

    // order=asc: oldest first; its tokens are its own.
    let first = s.call(
        "GET",
        &format!("/v2/sandboxes?{meta}&limit=2&order=asc"),
        None,
    );
    assert_eq!(first.status, 200, "{}", first.body);
    let page: Vec<String> = first
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["sandboxID"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(page, ours[..2]);
    // Two running of ours match (the third is paused), on every page.
    assert_eq!(first.header("x-total-running"), Some("2"));
    let asc_token = first.header("x-next-token").unwrap().to_string();
    let second = s.expect(
        200,
        "GET",
        &format!("/v2/sandboxes?{meta}&limit=2&order=asc&nextToken={asc_token}"),
        None,
    );
    assert_eq!(second[0]["sandboxID"], ours[2].as_str(), "{second}");
    assert_eq!(second.as_array().unwrap().len(), 1, "{second}");
    // A token replayed with the other order is refused, as E2B does.
    for replay in [
        format!("/v2/sandboxes?{meta}&limit=2&nextToken={asc_token}"),
        format!("/v2/sandboxes?{meta}&limit=2&order=desc&nextToken={asc_token}"),
    ] {
        assert_e2b_error(&s.call("GET", &replay, None), 400);
    }
    // Paused only: no running count.
    let r = s.call("GET", &format!("/v2/sandboxes?{meta}&state=paused"), None);
    assert_eq!(r.header("x-total-running"), None, "{}", r.body);
    let r = s.call("GET", "/v2/sandboxes?template=nope", None);
    assert_eq!(r.header("x-total-running"), Some("0"), "{}", r.body);
    // E2B's metadata parsing: the whole value is unescaped before it is
    // split, so an encoded `=` separates; an empty key is a key no
    // sandbox has.
    let whole = s.expect(200, "GET", "/v2/sandboxes?metadata=team%2Ba%253Db", None);
    assert_eq!(whole[0]["sandboxID"], other.as_str(), "{whole}");
    let empty_key = s.expect(200, "GET", "/v2/sandboxes?metadata=%3Dv", None);
    assert_eq!(empty_key, serde_json::json!([]));

    let running = s.expect(
        200,
        "GET",
        &format!("/v2/sandboxes?{meta}&state=running"),
        None,
    );
    assert_eq!(running.as_array().unwrap().len(), 2, "{running}");
    let paused = s.expect(
        200,
        "GET",
        &format!("/v2/sandboxes?{meta}&state=paused"),
        None,
    );
    assert_eq!(paused[0]["sandboxID"], ours[2].as_str(), "{paused}");
    assert_eq!(paused[0]["state"], "paused");
    let desc = s.expect(200, "GET", "/v2/sandboxes?limit=1", None);
    assert_eq!(desc[0]["sandboxID"], other.as_str(), "{desc}");
    let asc = s.expect(200, "GET", "/v2/sandboxes?order=asc&limit=1", None);
    assert_eq!(asc[0]["sandboxID"], ours[0].as_str(), "{asc}");
    let by_name = s.expect(200, "GET", "/v2/sandboxes?template=probe", None);
    assert_eq!(by_name.as_array().unwrap().len(), 4, "{by_name}");
    let none = s.expect(200, "GET", "/v2/sandboxes?template=nope", None);
    assert_eq!(none, serde_json::json!([]));
    let later = s.expect(
        200,
        "GET",
        "/v2/sandboxes?startedAfter=2999-01-01T00:00:00Z",
        None,
    );
    assert_eq!(later, serde_json::json!([]));

    for bad in [
        "/v2/sandboxes?state=killed",
        "/v2/sandboxes?limit=0",
        "/v2/sandboxes?limit=101",
        "/v2/sandboxes?limit=x",
        "/v2/sandboxes?nextToken=garbage",
        "/v2/sandboxes?order=sideways",
        "/v2/sandboxes?startedAfter=yesterday",
        "/v2/sandboxes?metadata=k",
        "/v2/sandboxes?metadata=k%3Dv%3Dw",
        "/v2/sandboxes?metadata=k%3D%2525ZZ",
        "/sandboxes?metadata=k",
    ] {
        assert_e2b_error(&s.call("GET", bad, None), 400);
    }
}

#[test]
fn bad_input_and_auth() {
    let data = DataDir::new("e2b-bad");
    let s = E2b::start(&data.0, &[]);
    let id = id_of(&s.create(r#"{"templateID":"probe"}"#));

    // Missing and wrong keys: 401 on every route, E2B's body.
    for key in [None, Some("wrong-key"), Some("")] {
        for (method, path) in [
            ("POST", "/v2/sandboxes".to_string()),
            ("GET", "/v2/sandboxes".to_string()),
            ("GET", format!("/sandboxes/{id}")),
            ("DELETE", format!("/sandboxes/{id}")),
            ("GET", "/snapshots".to_string()),
        ] {
            let r = s.with_key(key, method, &path, Some(r#"{"templateID":"probe"}"#));
            assert_e2b_error(&r, 401);
        }
    }
    // torpor's bearer token is not an E2B key header.
    let r = request(&s.addr, "GET", "/v2/sandboxes", Some(KEY), None);
    assert_e2b_error(&r, 401);

    for body in [
        "{",
        "[]",
        r#"{"timeout":5}"#,
        r#"{"templateID":5}"#,
        r#"{"templateID":"probe","timeout":-1}"#,
        r#"{"templateID":"probe","metadata":{"a":1}}"#,
        r#"{"templateID":"probe","network":{"denyOut":["example.com"]}}"#,
        r#"{"templateID":"probe","network":{"egressProxy":{"address":"x"}}}"#,
        r#"{"templateID":"probe","timeout":2592001}"#,
    ] {
        assert_e2b_error(&s.call("POST", "/v2/sandboxes", Some(body)), 400);
    }
    // Egress rules on a pod without sandbox networking: refused, saying
    // so, rather than ignored (tests/net_ports_api.rs has them applied).
    let r = s.call(
        "POST",
        "/v2/sandboxes",
        Some(r#"{"templateID":"probe","network":{"denyOut":["0.0.0.0/0"]}}"#),
    );
    assert_e2b_error(&r, 422);
    assert!(r.body.contains("sandbox networking"), "{}", r.body);
    assert_e2b_error(
        &s.call(
            "PUT",
            &format!("/sandboxes/{id}/network"),
            Some(r#"{"allowOut":["10.0.0.0/8"]}"#),
        ),
        422,
    );
    assert_e2b_error(
        &s.call("POST", "/v2/sandboxes", Some(r#"{"templateID":"nope"}"#)),
        404,
    );
    for body in ["", "{", r#"{"timeout":"x"}"#] {
        assert_e2b_error(
            &s.call("POST", &format!("/sandboxes/{id}/timeout"), Some(body)),
            400,
        );
    }
    for body in [r#"{"count":0}"#, r#"{"count":21}"#] {
        assert_e2b_error(
            &s.call("POST", &format!("/sandboxes/{id}/fork"), Some(body)),
            400,
        );
    }
    for unknown in ["sbx_0000000000000000", "nope", "sbx_"] {
        assert_e2b_error(&s.call("GET", &format!("/sandboxes/{unknown}"), None), 404);
        assert_e2b_error(
            &s.call("DELETE", &format!("/sandboxes/{unknown}"), None),
            404,
        );
    }
    // Wrong method on an E2B route: 405 in E2B's shape.
    assert_e2b_error(&s.call("PUT", &format!("/sandboxes/{id}/pause"), None), 405);
    // A body past the API's limit: 413 in E2B's shape.
    let headers = [("X-API-KEY", KEY)];
    let big = declared_only(&s.addr, "POST", "/v2/sandboxes", &headers, 2 << 20);
    assert_e2b_error(&big, 413);
}

#[test]
fn e2b_listen_serves_only_e2b_routes() {
    let data = DataDir::new("e2b-listen");
    let mut s = E2b::start(&data.0, &["--e2b-listen", "127.0.0.1:0"]);
    let line = s
        .serve
        .banner
        .iter()
        .find_map(|l| l.split("E2B API on http://").nth(1))
        .unwrap_or_else(|| panic!("no E2B listener line in {:?}", s.serve.banner))
        .trim()
        .to_string();
    s.addr = line;
    let id = id_of(&s.create(r#"{"templateID":"probe"}"#));
    s.expect(200, "GET", &format!("/sandboxes/{id}"), None);
    // Not torpor's routes: 404 in E2B's shape.
    assert_e2b_error(&s.call("GET", "/v1/sandboxes", None), 404);
    s.expect(204, "DELETE", &format!("/sandboxes/{id}"), None);
}

/// Polls `GET /sandboxes/{id}` until `done` holds of (status, body).
fn wait_until(s: &E2b, id: &str, what: &str, done: impl Fn(u16, &Value) -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let r = s.call("GET", &format!("/sandboxes/{id}"), None);
        let v = if r.body.is_empty() {
            Value::Null
        } else {
            r.json()
        };
        if done(r.status, &v) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{id} never {what}: {} {v}",
            r.status
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn timeout_kills_or_with_auto_pause_hibernates() {
    let data = DataDir::new("e2b-timeout");
    let s = E2b::start(&data.0, &[]);
    let kill = id_of(&s.create(r#"{"templateID":"probe","timeout":1}"#));
    let pause = id_of(&s.create(r#"{"templateID":"probe","timeout":1,"autoPause":true}"#));
    let info = s.expect(200, "GET", &format!("/sandboxes/{pause}"), None);
    assert_eq!(info["lifecycle"]["onTimeout"], "pause", "{info}");
    assert_eq!(info["lifecycle"]["autoResume"], true, "{info}");
    let info = s.expect(200, "GET", &format!("/sandboxes/{kill}"), None);
    assert_eq!(info["lifecycle"]["onTimeout"], "kill", "{info}");

    wait_until(&s, &kill, "killed by its timeout", |status, _| {
        status == 404
    });
    wait_until(&s, &pause, "paused by its timeout", |_, v| {
        v["state"] == "paused"
    });
    // Paused to E2B from `hibernating` on; hibernated soon after.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let native = request(
            &s.addr,
            "GET",
            &format!("/v1/sandboxes/{pause}"),
            Some(KEY),
            None,
        )
        .json();
        if native["state"] == "hibernated" {
            break;
        }
        assert_eq!(native["state"], "hibernating", "{native}");
        assert!(std::time::Instant::now() < deadline, "{native}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // It stays paused past its deadline (not deleted by later rounds).
    std::thread::sleep(std::time::Duration::from_millis(600));
    assert_eq!(
        s.expect(200, "GET", &format!("/sandboxes/{pause}"), None)["state"],
        "paused"
    );

    // Connect wakes it with a new deadline (E2B's default when none given).
    s.expect(
        201,
        "POST",
        &format!("/v2/sandboxes/{pause}/connect"),
        Some("{}"),
    );
    let info = s.expect(200, "GET", &format!("/sandboxes/{pause}"), None);
    assert_eq!(info["state"], "running");
    let end = torpor_api::e2b::time::parse(info["endAt"].as_str().unwrap()).unwrap();
    let left = end.0 - torpor_scheduler::model::Timestamp::now().0;
    assert!((290_000..=300_500).contains(&left), "{info}");
    // Asking a running sandbox to reboot: it runs, 200, nothing happens.
    s.expect(
        200,
        "POST",
        &format!("/v2/sandboxes/{pause}/connect"),
        Some(r#"{"memory":false}"#),
    );
    s.expect(204, "DELETE", &format!("/sandboxes/{pause}"), None);

    // `autoPauseMemory: false`: the timeout's pause keeps the disk only.
    let fs = id_of(
        &s.create(r#"{"templateID":"probe","timeout":1,"autoPause":true,"autoPauseMemory":false}"#),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let native = native(&s, &fs);
        if native["state"] == "hibernated" {
            assert_eq!(native["disk_only"], true, "{native}");
            assert_eq!(native["timeout_hibernation"], "filesystem", "{native}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{native}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    s.expect(
        201,
        "POST",
        &format!("/v2/sandboxes/{fs}/connect"),
        Some("{}"),
    );
    assert_eq!(native(&s, &fs)["state"], "running");
    s.expect(204, "DELETE", &format!("/sandboxes/{fs}"), None);
}

/// torpor's own view of a sandbox (`GET /v1/sandboxes/{id}`).
fn native(s: &E2b, id: &str) -> Value {
    request(
        &s.addr,
        "GET",
        &format!("/v1/sandboxes/{id}"),
        Some(KEY),
        None,
    )
    .json()
}

/// `pause` with `memory: false` keeps the disk only (torpor: hibernated,
/// `disk_only`, no snapshot); the next connect boots it again (the probe
/// starts over from its first iteration). A memory pause woken with
/// `memory: false` reboots too. Probe guests have no agent, so nothing is
/// checked or marked (`requireHealthyGuest` pauses them as any).
#[test]
fn filesystem_pause_and_reboot_on_connect() {
    let data = DataDir::new("e2b-fspause");
    let s = E2b::start(&data.0, &[]);
    let id = id_of(&s.create(r#"{"templateID":"probe","timeout":300}"#));
    let console = data.0.join("sandboxes").join(&id).join("console.log");
    let booted = || {
        std::fs::read_to_string(&console)
            .unwrap_or_default()
            .contains("TORPOR-PROBE ITER n=1 ")
    };
    assert!(!booted(), "a create restores: no boot");

    s.expect(
        204,
        "POST",
        &format!("/sandboxes/{id}/pause"),
        Some(r#"{"memory":false}"#),
    );
    let paused = s.expect(200, "GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(paused["state"], "paused");
    assert!(paused.get("envdUnresponsiveAtPause").is_none(), "{paused}");
    let n = native(&s, &id);
    assert_eq!(
        (n["state"].as_str(), n["disk_only"].as_bool()),
        (Some("hibernated"), Some(true)),
        "{n}"
    );
    assert!(n["snapshot"].is_null() && n["vmm"].is_null(), "{n}");
    // Paused already: 409, as any pause of a paused sandbox.
    assert_e2b_error(
        &s.call(
            "POST",
            &format!("/sandboxes/{id}/pause"),
            Some(r#"{"memory":false}"#),
        ),
        409,
    );

    s.expect(
        201,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        Some("{}"),
    );
    let n = native(&s, &id);
    assert_eq!(n["state"], "running", "{n}");
    assert!(n.get("disk_only").is_none(), "{n}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !booted() {
        assert!(std::time::Instant::now() < deadline, "no new boot");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    // A memory pause (the SDK's strict one), resumed with a reboot.
    s.expect(
        204,
        "POST",
        &format!("/sandboxes/{id}/pause"),
        Some(r#"{"requireHealthyGuest":true}"#),
    );
    assert!(native(&s, &id)["snapshot"].is_string());
    std::fs::remove_file(&console).unwrap();
    s.expect(
        201,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        Some(r#"{"timeout":300,"memory":false}"#),
    );
    let n = native(&s, &id);
    assert_eq!(n["state"], "running", "{n}");
    assert!(n["snapshot"].is_null(), "its memory went: {n}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !booted() {
        assert!(std::time::Instant::now() < deadline, "no new boot");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // /v1: hibernate with `mode: filesystem`, connect with `mode: reboot`.
    let v1 = |path: &str, body: &str| {
        request(
            &s.addr,
            "POST",
            &format!("/v1/sandboxes/{id}/{path}"),
            Some(KEY),
            Some(body),
        )
    };
    let r = v1("hibernate", r#"{"mode":"filesystem"}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["sandbox"]["disk_only"], true, "{}", r.body);
    let r = v1("connect", r#"{"mode":"reboot"}"#);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["resumed"], true, "{}", r.body);
    let r = v1("hibernate", r#"{"mode":"disk"}"#);
    assert_eq!(r.status, 400, "{}", r.body);
    s.expect(204, "DELETE", &format!("/sandboxes/{id}"), None);
}

#[test]
fn envd_health_and_connect_errors() {
    use torpor_api::e2b::envd::envelope::Envelope;
    let data = DataDir::new("e2b-envd");
    let s = E2b::start(&data.0, &[]);
    let created = s.create(r#"{"templateID":"probe","timeout":300}"#);
    let id = id_of(&created);
    let token = created["envdAccessToken"].as_str().unwrap().to_string();
    // Health answers the sandbox's own callers (its envd token, as the
    // SDKs send it); to anyone else it is as unknown (502).
    let health = |sandbox: Option<&str>| {
        let mut headers: Vec<(&str, &str)> =
            sandbox.map(|v| ("E2b-Sandbox-Id", v)).into_iter().collect();
        headers.push(("X-Access-Token", &token));
        request_with(&s.addr, "GET", "/health", &headers, None)
    };
    assert_eq!(health(Some(&id)).status, 204);
    let anonymous = request_with(&s.addr, "GET", "/health", &[("E2b-Sandbox-Id", &id)], None);
    assert_e2b_error(&anonymous, 502);
    s.expect(204, "POST", &format!("/sandboxes/{id}/pause"), None);
    assert_e2b_error(&health(Some(&id)), 502);
    assert_eq!(
        s.expect(200, "GET", &format!("/sandboxes/{id}"), None)["state"],
        "paused",
        "health does not wake"
    );
    assert_e2b_error(&health(Some("sbx_0000000000000000")), 502);
    assert_e2b_error(&health(Some("nope")), 502);
    assert_e2b_error(&health(None), 400);
    // The SDKs read "was not found" in health's 502 as the sandbox gone
    // (what they say of a command broken off by a kill); any other words
    // as "state unknown".
    for sandbox in [id.as_str(), "sbx_0000000000000000"] {
        let message = health(Some(sandbox)).json()["message"].to_string();
        assert!(message.contains("was not found"), "{message}");
    }

    // A unary RPC without credentials: Connect's 401.
    let sandbox = [("E2b-Sandbox-Id", id.as_str())];
    let r = request_with(
        &s.addr,
        "POST",
        "/filesystem.Filesystem/Stat",
        &sandbox,
        Some(r#"{"path":"/"}"#),
    );
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["code"], "unauthenticated");
    // With the key, on a probe sandbox (no agent): Connect's error body,
    // and the sandbox is not woken for nothing.
    let keyed = [("E2b-Sandbox-Id", id.as_str()), ("X-API-KEY", KEY)];
    let r = request_with(
        &s.addr,
        "POST",
        "/filesystem.Filesystem/Stat",
        &keyed,
        Some(r#"{"path":"/"}"#),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let v = r.json();
    assert_eq!(v["code"], "failed_precondition", "{v}");
    assert!(v["message"].as_str().unwrap().contains("agent"), "{v}");
    let r = request_with(&s.addr, "POST", "/process.Process/Nope", &keyed, Some("{}"));
    assert_eq!(r.status, 501, "{}", r.body);
    assert_eq!(r.json()["code"], "unimplemented");

    // A streaming RPC: 200 and an end-of-stream envelope with the error.
    let req =
        String::from_utf8(Envelope::message(br#"{"process":{"cmd":"true"}}"#.to_vec()).encode())
            .unwrap();
    let headers = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("X-API-KEY", KEY),
        ("Content-Type", "application/connect+json"),
    ];
    let r = request_with(
        &s.addr,
        "POST",
        "/process.Process/Start",
        &headers,
        Some(&req),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("application/connect+json"));
    // One end-of-stream envelope carrying the error (this client reads
    // text, so the envelope's binary length is not checked here; the
    // envelopes are, in api/tests/http_e2b_rpc.rs).
    assert!(r.body.starts_with('\u{2}'), "{:?}", r.body);
    assert!(
        r.body.contains(r#"{"error":{"code":"failed_precondition""#),
        "{:?}",
        r.body
    );
    assert_eq!(
        s.expect(200, "GET", &format!("/sandboxes/{id}"), None)["state"],
        "paused",
        "an RPC to a probe sandbox does not wake it"
    );

    // Not an envd service: the API's 404.
    let r = request_with(&s.addr, "POST", "/nope.Service/Call", &sandbox, Some("{}"));
    assert_eq!(r.status, 404, "{}", r.body);
}
