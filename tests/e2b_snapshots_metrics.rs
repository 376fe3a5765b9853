//! The E2B-compatible control plane of `torpor serve` on loopback with the
//! probe template, what hangs off a sandbox: snapshots (templates of its
//! state) and forks, and its metrics history. The sandbox's own routes
//! (lifecycle, lists, auth, `--e2b-listen`, envd) are in `e2b_routes.rs`.

mod common;

use common::e2b_http::{assert_e2b_error, id_of, E2b, KEY};
use common::http::request;
use common::serve::DataDir;

/// E2B's metrics from the pod's history (sampled every 200 ms here),
/// with `start`/`end` in unix seconds; `/v1`'s with `from`/`to` in ms.
#[test]
fn metrics_history_over_a_range() {
    let data = DataDir::new("e2b-metrics");
    let s = E2b::start(&data.0, &["--history-interval-ms", "200"]);
    let before = torpor_scheduler::model::Timestamp::now().0 / 1000;
    let id = id_of(&s.create(r#"{"templateID":"probe","timeout":300}"#));
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let path = format!("/sandboxes/{id}/metrics");
    let all = s.expect(200, "GET", &path, None);
    let all = all.as_array().unwrap();
    assert!(all.len() >= 4, "sampled every 200 ms: {all:?}");
    let mut last = 0;
    for m in all {
        for field in [
            "cpuCount",
            "cpuUsedPct",
            "memUsed",
            "memTotal",
            "memCache",
            "diskUsed",
            "diskTotal",
            "timestampUnix",
        ] {
            assert!(m[field].is_number(), "{field}: {m}");
        }
        assert_eq!(m["cpuCount"], 1, "{m}");
        assert!(m["memUsed"].as_u64().unwrap() > 0, "{m}");
        let at = torpor_api::e2b::time::parse(m["timestamp"].as_str().unwrap()).unwrap();
        assert_eq!(at.0 / 1000, m["timestampUnix"].as_i64().unwrap(), "{m}");
        assert!(at.0 >= last, "oldest first: {all:?}");
        last = at.0;
        assert!(at.0 / 1000 >= before, "{m}");
    }
    // A range before the sandbox: nothing; one around now: some.
    let old = s.expect(
        200,
        "GET",
        &format!("{path}?start={}&end={}", before - 3600, before - 1800),
        None,
    );
    assert_eq!(old, serde_json::json!([]));
    let now = torpor_scheduler::model::Timestamp::now().0 / 1000;
    let recent = s.expect(
        200,
        "GET",
        &format!("{path}?start={before}&end={now}"),
        None,
    );
    assert!(!recent.as_array().unwrap().is_empty(), "{recent}");
    let later = format!("{path}?start={}&end={}", now + 3600, now + 7200);
    assert_eq!(s.expect(200, "GET", &later, None), serde_json::json!([]));
    for bad in [
        format!("{path}?start=10&end=5"),
        // Past `end`, which is now by default.
        format!("{path}?start={}", now + 3600),
        format!("{path}?start=-1"),
        format!("{path}?end=soon"),
    ] {
        assert_e2b_error(&s.call("GET", &bad, None), 400);
    }

    // /v1: the same history, ms.
    let v1 = |query: &str| {
        request(
            &s.addr,
            "GET",
            &format!("/v1/sandboxes/{id}/metrics{query}"),
            Some(KEY),
            None,
        )
    };
    let r = v1("");
    assert_eq!(r.status, 200, "{}", r.body);
    let samples = r.json()["samples"].as_array().unwrap().clone();
    assert!(samples.len() >= all.len(), "{samples:?}");
    let newest = samples.last().unwrap()["at"].as_i64().unwrap();
    assert_eq!(samples[0]["cpu_count"], 1, "{samples:?}");
    assert!(samples[0]["mem_total_bytes"].as_u64().unwrap() > 0);
    // Both ends are in the range: the newest sample (and any other taken
    // in the same millisecond: the history thread and a read can meet).
    let tail = v1(&format!("?from={newest}&to={newest}")).json();
    let tail = tail["samples"].as_array().unwrap();
    assert!(!tail.is_empty(), "{tail:?}");
    assert!(tail.iter().all(|t| t["at"] == newest), "{tail:?}");
    for bad in ["?from=x", "?start=1"] {
        assert_eq!(v1(bad).status, 400, "{bad}");
    }
    // `from` after `to` is an empty range.
    let empty = v1("?from=5&to=4");
    assert_eq!(empty.status, 200, "{}", empty.body);
    assert_eq!(empty.json()["samples"], serde_json::json!([]));
    s.expect(204, "DELETE", &format!("/sandboxes/{id}"), None);
    assert_e2b_error(&s.call("GET", &path, None), 404);
    assert_eq!(v1("").status, 404);
}

#[test]
fn snapshots_and_forks() {
    let data = DataDir::new("e2b-snap");
    let s = E2b::start(&data.0, &[]);
    let id = id_of(&s.create(r#"{"templateID":"probe","timeout":300,"metadata":{"k":"v"}}"#));

    // A snapshot is a template of the sandbox's state.
    let snap = s.expect(
        201,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        Some(r#"{"name":"first"}"#),
    );
    let first = snap["snapshotID"].as_str().unwrap().to_string();
    assert!(first.starts_with("tpl_"), "{snap}");
    assert_eq!(snap["names"], serde_json::json!(["first"]));
    let unnamed = s.expect(201, "POST", &format!("/sandboxes/{id}/snapshots"), None);
    let unnamed_id = unnamed["snapshotID"].as_str().unwrap().to_string();
    assert!(
        unnamed["names"][0]
            .as_str()
            .unwrap()
            .starts_with(&format!("{id}-")),
        "{unnamed}"
    );
    assert_e2b_error(
        &s.call(
            "POST",
            &format!("/sandboxes/{id}/snapshots"),
            Some(r#"{"name":"first"}"#),
        ),
        409,
    );
    // Native: the same templates, and no checkpoint left behind.
    let native = request(
        &s.addr,
        "GET",
        &format!("/v1/templates/{first}"),
        Some(KEY),
        None,
    )
    .json();
    assert_eq!(native["name"], "first", "{native}");
    assert_eq!(native["state"], "ready", "{native}");
    let ckpts = request(
        &s.addr,
        "GET",
        &format!("/v1/sandboxes/{id}/checkpoints"),
        Some(KEY),
        None,
    )
    .json();
    assert_eq!(ckpts["checkpoints"], serde_json::json!([]), "{ckpts}");

    let all = s.expect(200, "GET", &format!("/snapshots?sandboxID={id}"), None);
    assert_eq!(all.as_array().unwrap().len(), 2, "{all}");
    let r = s.call("GET", "/snapshots?limit=1", None);
    assert_eq!(r.json()[0]["snapshotID"], first.as_str());
    let token = r.header("x-next-token").expect("a second page").to_string();
    let second = s.expect(
        200,
        "GET",
        &format!("/snapshots?limit=1&nextToken={token}"),
        None,
    );
    assert_eq!(second[0]["snapshotID"], unnamed_id.as_str(), "{second}");
    let named = s.expect(200, "GET", "/snapshots?name=first", None);
    assert_eq!(named[0]["snapshotID"], first.as_str());
    assert_eq!(
        s.expect(
            200,
            "GET",
            "/snapshots?sandboxID=sbx_0000000000000000",
            None
        ),
        serde_json::json!([])
    );

    // Fork: `count` sandboxes, each with the source's metadata.
    let forks = s.expect(
        201,
        "POST",
        &format!("/sandboxes/{id}/fork"),
        Some(r#"{"count":2,"timeout":60}"#),
    );
    let forks = forks.as_array().unwrap();
    assert_eq!(forks.len(), 2);
    for f in forks {
        assert!(f["error"].is_null(), "{f}");
        let fid = id_of(&f["sandbox"]);
        assert_ne!(fid, id);
        let info = s.expect(200, "GET", &format!("/sandboxes/{fid}"), None);
        assert_eq!(info["state"], "running");
        assert_eq!(info["metadata"]["k"], "v");
        s.expect(204, "DELETE", &format!("/sandboxes/{fid}"), None);
    }

    // The snapshot outlives its sandbox: kill it, then create from it.
    s.expect(204, "DELETE", &format!("/sandboxes/{id}"), None);
    let source_dir = data.0.join("sandboxes").join(&id);
    assert!(source_dir.exists(), "the snapshots' layers stay");
    let from = s.create(&format!(r#"{{"templateID":"{first}","timeout":60}}"#));
    let from_id = id_of(&from);
    assert_eq!(from["templateID"], first.as_str());
    assert_eq!(from["alias"], "first");
    assert_eq!(
        s.expect(200, "GET", &format!("/sandboxes/{from_id}"), None)["state"],
        "running"
    );
    // It hibernates and wakes on the snapshot's layers.
    s.expect(204, "POST", &format!("/sandboxes/{from_id}/pause"), None);
    s.expect(
        201,
        "POST",
        &format!("/v2/sandboxes/{from_id}/connect"),
        None,
    );
    assert_eq!(
        s.expect(200, "GET", &format!("/snapshots?sandboxID={id}"), None)
            .as_array()
            .unwrap()
            .len(),
        2
    );

    // Deleting: refused while a sandbox uses it, then 204, then 404.
    assert_e2b_error(&s.call("DELETE", &format!("/templates/{first}"), None), 409);
    s.expect(204, "DELETE", &format!("/templates/{unnamed_id}"), None);
    assert_e2b_error(
        &s.call("DELETE", &format!("/templates/{unnamed_id}"), None),
        404,
    );
    s.expect(204, "DELETE", &format!("/sandboxes/{from_id}"), None);
    s.expect(204, "DELETE", "/templates/first", None);
    assert_e2b_error(&s.call("DELETE", "/templates/no-such-template", None), 404);
    assert_eq!(
        s.expect(200, "GET", "/snapshots", None),
        serde_json::json!([])
    );
    assert!(!source_dir.exists(), "the layers go with their last user");
    // The probe template is untouched.
    s.expect(
        201,
        "POST",
        "/v2/sandboxes",
        Some(r#"{"templateID":"probe"}"#),
    );
}
