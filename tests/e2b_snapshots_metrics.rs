//! The E2B-compatible control plane of `torpor serve` on loopback with the
//! probe template, what hangs off a sandbox: snapshots (templates of its
//! state, or of its disk only) and forks, and its metrics history. The sandbox's own routes
//! (lifecycle, lists, auth, `--e2b-listen`, envd) are in `e2b_routes.rs`.

mod common;

use std::time::{Duration, Instant};

use common::e2b_http::{assert_e2b_error, id_of, E2b, KEY};
use common::http::request;
use common::probe_iterations;
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

/// The probe's iterations in a sandbox's console (its current VMM's).
fn iterations(data: &DataDir, id: &str) -> Vec<u64> {
    let console = data.0.join("sandboxes").join(id).join("console.log");
    let text = std::fs::read_to_string(console).unwrap_or_default();
    probe_iterations(&text)
        .into_iter()
        .map(|(n, _)| n)
        .collect()
}

/// Waits until the sandbox's probe has run `at_least` iterations; them.
fn wait_iterations(data: &DataDir, id: &str, at_least: usize) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = iterations(data, id);
        if seen.len() >= at_least {
            return seen;
        }
        assert!(Instant::now() < deadline, "{id} ran {seen:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `memory: false` (the SDKs' `mode="filesystem"`): a snapshot of the disk
/// only. A sandbox made from it is a new boot (the probe counts from 1
/// again), one made from a full snapshot restores (it counts on), and the
/// source runs on untouched; listed and deleted as any snapshot, and kept
/// across a restart of the service.
#[test]
fn filesystem_only_snapshots() {
    let data = DataDir::new("e2b-fssnap");
    let s = E2b::start(&data.0, &[]);
    let id = id_of(&s.create(r#"{"templateID":"probe","timeout":300}"#));
    // Restored from the probe template: it counts on from the template's.
    let before = wait_iterations(&data, &id, 2);
    assert!(before[0] > 1, "{before:?}");

    let snapshots = format!("/sandboxes/{id}/snapshots");
    // An answer and its snapshot's id.
    let take = |body: &str| {
        let v = s.expect(201, "POST", &snapshots, Some(body));
        let id = v["snapshotID"].as_str().unwrap().to_string();
        assert!(id.starts_with("tpl_"), "{v}");
        (v, id)
    };
    let (disk, disk_id) = take(r#"{"name":"disk","memory":false}"#);
    assert_eq!(disk["names"], serde_json::json!(["disk"]));
    let (full, full_id) = take(r#"{"name":"full","memory":true}"#);
    // The same answer's shape either way (an unnamed one's name is made
    // as for a full one: `snapshots_and_forks`).
    assert_eq!(
        disk.as_object().unwrap().keys().collect::<Vec<_>>(),
        full.as_object().unwrap().keys().collect::<Vec<_>>()
    );
    let (_, unnamed_id) = take(r#"{"memory":false}"#);
    // Bad input: a 400 that says what is wrong, nothing taken.
    for bad in [r#"{"memory":"filesystem"}"#, r#"{"memory":0}"#, "[1]"] {
        let r = s.call("POST", &snapshots, Some(bad));
        assert_e2b_error(&r, 400);
        assert!(r.json()["message"].as_str().unwrap().contains("memory") || bad == "[1]");
    }
    // A taken name is taken whatever the mode.
    assert_e2b_error(
        &s.call(
            "POST",
            &snapshots,
            Some(r#"{"name":"full","memory":false}"#),
        ),
        409,
    );
    let listed = s.expect(200, "GET", &format!("/snapshots?sandboxID={id}"), None);
    let mut ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["snapshotID"].as_str().unwrap())
        .collect();
    ids.sort();
    let mut want = vec![disk_id.as_str(), full_id.as_str(), unnamed_id.as_str()];
    want.sort();
    assert_eq!(ids, want, "{listed}");
    let named = s.expect(200, "GET", "/snapshots?name=disk", None);
    assert_eq!(named, serde_json::json!([disk]));

    // The source ran on: the same boot, counting on.
    assert_eq!(
        s.expect(200, "GET", &format!("/sandboxes/{id}"), None)["state"],
        "running"
    );
    let taken = iterations(&data, &id).len();
    let after = wait_iterations(&data, &id, taken + 1);
    let expected: Vec<u64> = (before[0]..before[0] + after.len() as u64).collect();
    assert_eq!(after, expected, "the source restarted or skipped");

    // From the disk: a new boot, the probe's first iteration again.
    let booted = id_of(&s.create(&format!(r#"{{"templateID":"{disk_id}","timeout":60}}"#)));
    assert_eq!(
        s.expect(200, "GET", &format!("/sandboxes/{booted}"), None)["templateID"],
        disk_id.as_str()
    );
    let seq = wait_iterations(&data, &booted, 2);
    assert_eq!(&seq[..2], &[1, 2], "a boot counts from 1: {seq:?}");
    // From the full snapshot: a restore, counting on from the source's.
    let restored = id_of(&s.create(&format!(r#"{{"templateID":"{full_id}","timeout":60}}"#)));
    let seq = wait_iterations(&data, &restored, 2);
    assert!(seq[0] > before[1], "a restore counts on: {seq:?}");
    assert_eq!(seq[1], seq[0] + 1, "{seq:?}");

    // The booted sandbox lives as any other: a memory pause and a wake
    // restore it, counting on.
    s.expect(204, "POST", &format!("/sandboxes/{booted}/pause"), None);
    let paused_at = *iterations(&data, &booted).last().unwrap();
    s.expect(
        201,
        "POST",
        &format!("/v2/sandboxes/{booted}/connect"),
        None,
    );
    let seq = wait_iterations(&data, &booted, 1);
    assert!(seq[0] > paused_at, "woken by a restore: {seq:?}");

    // A restart keeps the snapshot (its directory is no orphan).
    let dir = data.0.join("templates").join(&disk_id);
    assert!(dir.join("cmdline").exists());
    s.serve.kill9();
    let s = E2b::start(&data.0, &[]);
    assert!(dir.join("cmdline").exists(), "the restart removed it");
    let again = id_of(&s.create(&format!(r#"{{"templateID":"{disk_id}","timeout":60}}"#)));
    assert_eq!(wait_iterations(&data, &again, 1)[0], 1);

    // Deleting: refused while sandboxes use it, then its directory goes.
    assert_e2b_error(
        &s.call("DELETE", &format!("/templates/{disk_id}"), None),
        409,
    );
    for sbx in [&booted, &again] {
        s.expect(204, "DELETE", &format!("/sandboxes/{sbx}"), None);
    }
    s.expect(204, "DELETE", &format!("/templates/{disk_id}"), None);
    assert!(!dir.exists(), "{} stays", dir.display());
    s.expect(204, "DELETE", &format!("/templates/{unnamed_id}"), None);
    let listed = s.expect(200, "GET", &format!("/snapshots?sandboxID={id}"), None);
    assert_eq!(listed, serde_json::json!([full]), "{listed}");
}
