//! The cluster on loopback (`scripts/cluster`: PostgreSQL, nats-server, two
//! pods, two API replicas; probe templates): a sandbox's life through both
//! replicas, placement across both pods, and a pod killed with -9 (its
//! sandboxes answer 503 until it is back). Needs postgres and nats-server
//! (tests/needs leaves it out without them).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::cluster::Cluster;

fn create(c: &Cluster, n: u16) -> Value {
    let r = c.call(n, "POST", "/v1/sandboxes", Some(r#"{"template":"probe"}"#));
    assert_eq!(r.status, 201, "{}", r.body);
    r.json()
}

#[test]
fn cluster_sandbox_life_placement_and_pod_failure() {
    let c = Cluster::up("life");

    // Made through replica 1, read and hibernated through replica 2, woken
    // through 1, deleted through 2.
    let s = create(&c, 1);
    let id = s["id"].as_str().unwrap().to_string();
    let path = format!("/v1/sandboxes/{id}");
    assert_eq!(s["state"], "running");
    let pod = s["pod"].as_str().unwrap().to_string();
    assert!(pod == "pod1" || pod == "pod2", "{s}");
    let r = c.call(2, "GET", &path, None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["id"], id.as_str());
    assert_eq!(r.json()["pod"], pod.as_str());
    let r = c.call(2, "POST", &format!("{path}/hibernate"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["sandbox"]["state"], "hibernated");
    assert_eq!(c.call(1, "GET", &path, None).json()["state"], "hibernated");
    let r = c.call(1, "POST", &format!("{path}/connect"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["sandbox"]["state"], "running");
    assert_eq!(r.json()["resumed"], true);
    // Paused through 2, resumed through 1.
    let r = c.call(2, "POST", &format!("{path}/pause"), None);
    assert_eq!(r.json()["sandbox"]["state"], "paused", "{}", r.body);
    let r = c.call(1, "POST", &format!("{path}/resume"), None);
    assert_eq!(r.json()["sandbox"]["state"], "running", "{}", r.body);
    assert_eq!(
        c.call(1, "POST", "/v1/sandboxes/sbx_0000/hibernate", None)
            .status,
        404
    );
    // The data plane goes straight to the pod (a probe has no agent).
    let r = c.call(
        2,
        "POST",
        &format!("{path}/exec"),
        Some(r#"{"argv":["true"]}"#),
    );
    assert_eq!(r.status, 422, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "no_agent");
    assert_eq!(c.call(2, "DELETE", &path, None).status, 204);
    assert_eq!(c.call(1, "GET", &path, None).status, 404);
    assert_eq!(c.call(1, "DELETE", &path, None).status, 404);

    // Idempotency-Key: a retry through the other replica returns the
    // first outcome (one sandbox); the key on another command is 409.
    let key = [("Idempotency-Key", "create-once-1")];
    let body = Some(r#"{"template":"probe"}"#);
    let first = c.call_with(1, "POST", "/v1/sandboxes", &key, body);
    assert_eq!(first.status, 201, "{}", first.body);
    let again = c.call_with(2, "POST", "/v1/sandboxes", &key, body);
    assert_eq!(again.status, 201, "{}", again.body);
    assert_eq!(again.json()["id"], first.json()["id"]);
    let once = first.json()["id"].as_str().unwrap().to_string();
    let r = c.call_with(
        2,
        "POST",
        &format!("/v1/sandboxes/{once}/hibernate"),
        &key,
        None,
    );
    assert_eq!(r.status, 409, "{}", r.body);
    let bad = [("Idempotency-Key", "")];
    assert_eq!(
        c.call_with(1, "POST", "/v1/sandboxes", &bad, body).status,
        400
    );
    // Its operation, journaled in PostgreSQL, read through either replica.
    let op = c.sql("SELECT id FROM operations WHERE idempotency_key = 'create-once-1'");
    assert!(op.starts_with("op_"), "{op}");
    let r = c.call(2, "GET", &format!("/v1/operations/{op}"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["kind"], "create");
    assert_eq!(v["status"], "done");
    assert_eq!(v["sandbox"], once.as_str());
    assert_eq!(
        v["outcome"]["sandbox"]["sandbox"]["id"],
        once.as_str(),
        "{v}"
    );
    assert_eq!(c.call(1, "GET", "/v1/operations/op_none", None).status, 404);
    assert_eq!(c.sql("SELECT max(version) FROM schema_migrations"), "2");
    assert_eq!(
        c.call(1, "DELETE", &format!("/v1/sandboxes/{once}"), None)
            .status,
        204
    );

    // Placement spreads: 16 creates through both replicas land on both
    // pods (a random pick among the two best; all on one: 2^-15).
    let mut on: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in 0..16 {
        let s = create(&c, 1 + i % 2);
        on.entry(s["pod"].as_str().unwrap().to_string())
            .or_default()
            .push(s["id"].as_str().unwrap().to_string());
    }
    assert_eq!(on.len(), 2, "all on one pod: {on:?}");
    let listed = c.call(2, "GET", "/v1/sandboxes", None).json();
    assert_eq!(
        listed["sandboxes"].as_array().unwrap().len(),
        16,
        "{listed}"
    );

    // pod1 killed with -9: marked down, its sandboxes answer 503 with the
    // reason, pod2's still answer, creates go to pod2.
    let victim = on["pod1"][0].clone();
    let survivor = on["pod2"][0].clone();
    c.kill("pod1");
    let r = c.wait_status(2, &format!("/v1/sandboxes/{victim}"), 503);
    assert_eq!(r.json()["error"]["code"], "unavailable", "{}", r.body);
    assert!(r.body.contains("pod pod1 is down"), "{}", r.body);
    let r = c.call(
        1,
        "POST",
        &format!("/v1/sandboxes/{victim}/hibernate"),
        None,
    );
    assert_eq!(r.status, 503, "{}", r.body);
    let pods = c.pods();
    let p1 = pods.iter().find(|p| p["id"] == "pod1").unwrap();
    assert_eq!(p1["reachable"], false, "{p1}");
    assert_eq!(
        c.call(1, "GET", &format!("/v1/sandboxes/{survivor}"), None)
            .status,
        200
    );
    for _ in 0..3 {
        assert_eq!(create(&c, 2)["pod"], "pod2");
    }

    // Back after a restart: its sandbox answers again and takes commands.
    c.start("pod1");
    c.wait_pods(2);
    let r = c.wait_status(1, &format!("/v1/sandboxes/{victim}"), 200);
    assert_eq!(r.json()["pod"], "pod1");
    let r = c.call(
        2,
        "POST",
        &format!("/v1/sandboxes/{victim}/hibernate"),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["sandbox"]["state"], "hibernated");

    // Everything deleted through either replica; nothing is left listed.
    let all = c.call(1, "GET", "/v1/sandboxes", None).json();
    for (i, s) in all["sandboxes"].as_array().unwrap().iter().enumerate() {
        let path = format!("/v1/sandboxes/{}", s["id"].as_str().unwrap());
        let r = c.call(1 + (i % 2) as u16, "DELETE", &path, None);
        assert_eq!(r.status, 204, "{}", r.body);
    }
    let left = c.call(2, "GET", "/v1/sandboxes", None).json();
    assert_eq!(left["sandboxes"].as_array().unwrap().len(), 0, "{left}");

    accepted_past_the_wait(&c);
}

/// Polls `GET location` on replica `n` until the operation is no longer
/// pending (30 s); the operation.
fn finished(c: &Cluster, n: u16, location: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = c.call(n, "GET", location, None);
        assert_eq!(r.status, 200, "{}", r.body);
        let op = r.json();
        if op["status"] != "pending" {
            return op;
        }
        assert!(Instant::now() < deadline, "{location} still pending: {op}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A command past the replica's wait answers 202 with its operation at
/// `Location`, which gives the outcome once the pod published it.
fn accepted_past_the_wait(c: &Cluster) {
    // Replica 2 waits 1 ms: a create (a restore on the pod, its result
    // through NATS and PostgreSQL) takes longer.
    c.kill("api2");
    c.start_api(
        "api2",
        &format!("{} --cluster-wait-ms 1", common::cluster::API_ARGS),
    );
    let key = [("Idempotency-Key", "slow-create-1")];
    let body = Some(r#"{"template":"probe"}"#);
    let r = c.call_with(2, "POST", "/v1/sandboxes", &key, body);
    assert_eq!(r.status, 202, "{}", r.body);
    let op = r.json();
    assert!(op["id"].as_str().unwrap().starts_with("op_"), "{op}");
    assert_eq!(op["kind"], "create");
    assert_eq!(op["status"], "pending");
    let location = r.header("location").unwrap().to_string();
    assert_eq!(
        location,
        format!("/v1/operations/{}", op["id"].as_str().unwrap())
    );
    // The outcome, read through the other replica.
    let done = finished(c, 1, &location);
    assert_eq!(done["status"], "done", "{done}");
    let id = done["sandbox"].as_str().unwrap().to_string();
    assert_eq!(
        done["outcome"]["sandbox"]["sandbox"]["id"],
        id.as_str(),
        "{done}"
    );
    let path = format!("/v1/sandboxes/{id}");
    let r = c.call(1, "GET", &path, None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["state"], "running");
    // A retry with the key through replica 1 (its wait is 20 s): the
    // first outcome, no second sandbox.
    let again = c.call_with(1, "POST", "/v1/sandboxes", &key, body);
    assert_eq!(again.status, 201, "{}", again.body);
    assert_eq!(again.json()["id"], id.as_str());
    assert_eq!(
        c.call(1, "GET", "/v1/sandboxes", None).json()["sandboxes"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    // A hibernate (a snapshot written) the same way.
    let r = c.call(2, "POST", &format!("{path}/hibernate"), None);
    assert_eq!(r.status, 202, "{}", r.body);
    assert_eq!(r.json()["kind"], "hibernate");
    assert_eq!(r.json()["sandbox"], id.as_str());
    let done = finished(c, 2, r.header("location").unwrap());
    assert_eq!(done["status"], "done", "{done}");
    assert_eq!(c.call(2, "GET", &path, None).json()["state"], "hibernated");
    // A delete: 202 or, if the pod was that quick, 204; gone either way.
    let r = c.call(2, "DELETE", &path, None);
    match r.status {
        202 => assert_eq!(
            finished(c, 1, r.header("location").unwrap())["status"],
            "done"
        ),
        204 => {}
        other => panic!("DELETE {path}: {other} {}", r.body),
    }
    assert_eq!(c.call(1, "GET", &path, None).status, 404);
}
