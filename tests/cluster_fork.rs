//! Forks in the cluster (`scripts/cluster` on loopback, as
//! tests/cluster.rs): `POST /v1/sandboxes/{id}/fork` is an operation on the
//! source's pod, its forks recorded in PostgreSQL as that pod's and the
//! source's tenant's, admitted against the tenant's quota all at once.
//! Needs postgres and nats-server (tests/needs leaves it out without them).

use common::cluster::{as_token, finished, stored_sandboxes, tenant_token, Cluster};
use common::http::{request_with, HttpResponse};

mod common;

/// The ids of a fork's answer (`{"sandboxes": [...]}`), each checked to be
/// on `pod` and `tenant`'s.
fn fork_ids(r: &HttpResponse, pod: &str, tenant: &str) -> Vec<String> {
    assert_eq!(r.status, 201, "{}", r.body);
    let v = r.json();
    v["sandboxes"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|s| {
            assert_eq!(s["pod"], pod, "{s}");
            assert_eq!(s["tenant"], tenant, "{s}");
            assert_eq!(s["state"], "running", "{s}");
            s["id"].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn cluster_forks_run_on_the_source_pod_within_the_quota() {
    let c = Cluster::up("fork");
    let (token, _) = tenant_token(&c, 1, "forker");
    let (other, _) = tenant_token(&c, 2, "other");
    let r = as_token(
        &c,
        1,
        &token,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"template":"probe"}"#),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let source = r.json()["id"].as_str().unwrap().to_string();
    let pod = r.json()["pod"].as_str().unwrap().to_string();
    let fork_path = format!("/v1/sandboxes/{source}/fork");

    // Two forks through replica 1, one operation on the source's pod
    // (its snapshot is there), recorded as that pod's and the tenant's;
    // a retry with the Idempotency-Key through replica 2 is the first
    // answer, no more forks.
    let auth = format!("Bearer {token}");
    let headers = [
        ("Idempotency-Key", "fork-twice-1"),
        ("Authorization", auth.as_str()),
    ];
    let body = Some(r#"{"count":2,"metadata":{"from":"fork"}}"#);
    let first = request_with(&c.api(1), "POST", &fork_path, &headers, body);
    let forks = fork_ids(&first, &pod, "forker");
    assert_eq!(forks.len(), 2, "{}", first.body);
    assert_ne!(forks[0], forks[1]);
    let again = request_with(&c.api(2), "POST", &fork_path, &headers, body);
    assert_eq!(fork_ids(&again, &pod, "forker"), forks);
    assert_eq!(stored_sandboxes(&c, "forker"), "3");
    assert_eq!(
        c.sql(
            "SELECT kind, sandbox, status FROM operations WHERE idempotency_key = 'fork-twice-1'"
        ),
        format!("fork|{source}|done")
    );
    // Both read through replica 2, by their tenant only; the data plane
    // of a fork is relayed to its pod (a probe has no agent: 422 there,
    // where another pod would not know it, 404).
    for id in &forks {
        let path = format!("/v1/sandboxes/{id}");
        let r = as_token(&c, 2, &token, "GET", &path, None);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["pod"], pod.as_str());
        assert_eq!(r.json()["metadata"]["from"], "fork", "{}", r.body);
        assert_eq!(as_token(&c, 2, &other, "GET", &path, None).status, 404);
    }
    let listed = as_token(&c, 2, &token, "GET", "/v1/sandboxes", None).json();
    assert_eq!(listed["sandboxes"].as_array().unwrap().len(), 3, "{listed}");
    let exec = format!("/v1/sandboxes/{}/exec", forks[0]);
    let r = as_token(&c, 2, &token, "POST", &exec, Some(r#"{"argv":["true"]}"#));
    assert_eq!(r.status, 422, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "no_agent", "{}", r.body);

    // Another tenant's sandbox and an unknown one: 404 alike.
    let r = as_token(&c, 1, &other, "POST", &fork_path, Some("{}"));
    assert_eq!(r.status, 404, "{}", r.body);
    let r = c.call(2, "POST", "/v1/sandboxes/sbx_0000/fork", Some("{}"));
    assert_eq!(r.status, 404, "{}", r.body);
    let r = as_token(&c, 1, &token, "POST", &fork_path, Some(r#"{"count":0}"#));
    assert_eq!(r.status, 400, "{}", r.body);

    // The quota counts forks as creates, all of a count at once: 3 of 4
    // used, a fork of 2 is 429 and makes none; a single fork (201, the
    // sandbox itself) fills it; one more is refused.
    c.set_quota(2, "forker", r#"{"total_sandboxes":4}"#);
    for n in [1, 2] {
        let r = as_token(&c, n, &token, "POST", &fork_path, Some(r#"{"count":2}"#));
        assert_eq!(r.status, 429, "replica {n}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["code"], "quota_exceeded", "{}", r.body);
        assert_eq!(e["quota"], "total_sandboxes", "{}", r.body);
        assert_eq!(e["limit"], 4, "{}", r.body);
    }
    assert_eq!(stored_sandboxes(&c, "forker"), "3");
    let pod_n: u16 = pod.trim_start_matches("pod").parse().unwrap();
    assert_eq!(c.pod_sandboxes(pod_n).len(), 3, "the pod made none");
    let r = as_token(&c, 2, &token, "POST", &fork_path, Some("{}"));
    assert_eq!(r.status, 201, "{}", r.body);
    let single = r.json()["id"].as_str().unwrap().to_string();
    assert_eq!(
        r.header("location"),
        Some(format!("/v1/sandboxes/{single}").as_str())
    );
    assert_eq!(r.json()["pod"], pod.as_str());
    let r = as_token(&c, 1, &token, "POST", &fork_path, Some("{}"));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(stored_sandboxes(&c, "forker"), "4");

    // The forks deleted through either replica: gone from both.
    for (i, id) in forks.iter().chain([&single]).enumerate() {
        let path = format!("/v1/sandboxes/{id}");
        let r = as_token(&c, 1 + (i % 2) as u16, &token, "DELETE", &path, None);
        assert_eq!(r.status, 204, "{}", r.body);
        assert_eq!(
            as_token(&c, 2 - (i % 2) as u16, &token, "GET", &path, None).status,
            404
        );
    }
    assert_eq!(stored_sandboxes(&c, "forker"), "1");

    // A fork retried by its key after its source was deleted: the first
    // answer, not 404 (the deleted id stays its tenant's for that); for
    // another tenant, or without the key, 404.
    let r = as_token(
        &c,
        1,
        &token,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"template":"probe"}"#),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let gone = r.json()["id"].as_str().unwrap().to_string();
    let gone_pod = r.json()["pod"].as_str().unwrap().to_string();
    let gone_fork = format!("/v1/sandboxes/{gone}/fork");
    let keyed = [
        ("Idempotency-Key", "fork-gone-1"),
        ("Authorization", auth.as_str()),
    ];
    let first = request_with(&c.api(1), "POST", &gone_fork, &keyed, Some("{}"));
    assert_eq!(first.status, 201, "{}", first.body);
    let made = first.json()["id"].as_str().unwrap().to_string();
    let r = as_token(
        &c,
        2,
        &token,
        "DELETE",
        &format!("/v1/sandboxes/{gone}"),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let again = request_with(&c.api(2), "POST", &gone_fork, &keyed, Some("{}"));
    assert_eq!(again.status, 201, "{}", again.body);
    assert_eq!(again.json()["id"], made.as_str(), "{}", again.body);
    assert_eq!(again.json()["pod"], gone_pod.as_str(), "{}", again.body);
    let r = as_token(&c, 1, &token, "POST", &gone_fork, Some("{}"));
    assert_eq!(r.status, 404, "{}", r.body);
    let r = as_token(&c, 1, &token, "GET", &format!("/v1/sandboxes/{gone}"), None);
    assert_eq!(r.status, 404, "{}", r.body);
    let other_auth = format!("Bearer {other}");
    let theirs = [
        ("Idempotency-Key", "fork-gone-1"),
        ("Authorization", other_auth.as_str()),
    ];
    let r = request_with(&c.api(1), "POST", &gone_fork, &theirs, Some("{}"));
    assert_eq!(r.status, 404, "{}", r.body);
    let r = as_token(
        &c,
        1,
        &token,
        "DELETE",
        &format!("/v1/sandboxes/{made}"),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(stored_sandboxes(&c, "forker"), "1");

    checkpoints_are_commands_within_the_quota(&c, &token, &other, &source);

    // Past the replica's wait: 202 with the operation, whose outcome
    // lists the fork once the pod published it.
    c.kill("api2");
    c.start_api(
        "api2",
        &format!("{} --cluster-wait-ms 1", common::cluster::API_ARGS),
    );
    let r = as_token(&c, 2, &token, "POST", &fork_path, Some(r#"{"count":1}"#));
    assert_eq!(r.status, 202, "{}", r.body);
    assert_eq!(r.json()["kind"], "fork", "{}", r.body);
    assert_eq!(r.json()["sandbox"], source.as_str(), "{}", r.body);
    let done = finished(&c, 1, r.header("location").unwrap());
    assert_eq!(done["status"], "done", "{done}");
    let made = done["outcome"]["sandboxes"]["sandboxes"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{done}"))
        .to_string();
    let r = c.call(1, "GET", &format!("/v1/sandboxes/{made}"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["pod"], pod.as_str());

    // The source's pod down: 503 with the reason.
    c.kill(&pod);
    c.wait_status(1, &format!("/v1/sandboxes/{source}"), 503);
    let r = as_token(&c, 1, &token, "POST", &fork_path, Some("{}"));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "unavailable", "{}", r.body);
    assert!(r.body.contains(&format!("pod {pod} is down")), "{}", r.body);
}

/// Checkpoints through either replica: each one operation on the sandbox's
/// pod, recorded in PostgreSQL and counted there against the tenant's
/// snapshot disk (each as the sandbox's memory), so the quota holds across
/// replicas; listed on the pod (relayed); a delete frees its room.
fn checkpoints_are_commands_within_the_quota(c: &Cluster, token: &str, other: &str, source: &str) {
    let r = as_token(c, 1, token, "GET", &format!("/v1/sandboxes/{source}"), None);
    let mem = r.json()["mem_mib"]
        .as_u64()
        .unwrap_or_else(|| panic!("{}", r.body));
    // Room for two (a running sandbox holds no snapshot disk).
    let quota = format!(r#"{{"total_sandboxes":4,"snapshot_disk_mib":{}}}"#, 2 * mem);
    c.set_quota(1, "forker", &quota);
    let at = format!("/v1/sandboxes/{source}/checkpoints");
    let auth = format!("Bearer {token}");
    let take = |n: u16, key: &str, name: &str| {
        let headers = [("Idempotency-Key", key), ("Authorization", auth.as_str())];
        let body = format!(r#"{{"name":"{name}"}}"#);
        request_with(&c.api(n), "POST", &at, &headers, Some(&body))
    };
    let mut ids = Vec::new();
    for (n, name) in [(1, "one"), (2, "two")] {
        let r = take(n, &format!("ckpt-{name}"), name);
        assert_eq!(r.status, 201, "{}", r.body);
        assert_eq!(r.json()["name"], name, "{}", r.body);
        assert!(
            r.json().get("snapshot_dir").is_none(),
            "a host path: {}",
            r.body
        );
        ids.push(r.json()["id"].clone());
    }
    let names = || {
        c.sql(&format!(
            "SELECT coalesce(string_agg(name, ',' ORDER BY name), '') FROM checkpoints \
             WHERE sandbox = '{source}' AND tenant = 'forker'"
        ))
    };
    assert_eq!(names(), "one,two");
    assert_eq!(
        c.sql(
            "SELECT string_agg(kind || '|' || status, ',') FROM operations \
             WHERE idempotency_key LIKE 'ckpt-%'"
        ),
        "checkpoint|done,checkpoint|done"
    );
    // A retry by its key through the other replica: the first answer.
    let r = take(2, "ckpt-one", "one");
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["id"], ids[0], "{}", r.body);
    // Full: a third is 429 through either replica, none taken.
    for n in [1, 2] {
        let r = as_token(c, n, token, "POST", &at, Some(r#"{"name":"three"}"#));
        assert_eq!(r.status, 429, "replica {n}: {}", r.body);
        let e = &r.json()["error"];
        assert_eq!(e["quota"], "snapshot_disk_mib", "{}", r.body);
        assert_eq!(e["used"], 2 * mem, "{}", r.body);
    }
    // Listed on the pod through either replica; another tenant's: 404.
    let r = as_token(c, 2, token, "GET", &at, None);
    assert_eq!(r.status, 200, "{}", r.body);
    let listed: Vec<_> = r.json()["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(listed, ["one", "two"], "{}", r.body);
    let r = as_token(c, 1, other, "POST", &at, Some(r#"{"name":"x"}"#));
    assert_eq!(r.status, 404, "{}", r.body);
    // One deleted through replica 2: its row goes, and room for another.
    let r = as_token(c, 2, token, "DELETE", &format!("{at}/one"), None);
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(names(), "two");
    let r = as_token(c, 1, token, "DELETE", &format!("{at}/one"), None);
    assert_eq!(r.status, 404, "{}", r.body);
    let r = as_token(c, 1, token, "POST", &at, Some(r#"{"name":"three"}"#));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(names(), "three,two");
    c.set_quota(1, "forker", r#"{"total_sandboxes":4}"#);
}
