//! The cluster on loopback (`scripts/cluster`: PostgreSQL, nats-server, two
//! pods, two API replicas; probe templates): a sandbox's life through both
//! replicas, placement across both pods, and a pod killed with -9 (its
//! sandboxes answer 503 until it is back); tenants and tokens in PostgreSQL,
//! shared by both replicas. Needs postgres and nats-server (tests/needs
//! leaves it out without them).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::cluster::{
    as_token, finished, stored_sandboxes, tenant_token, wait_token_status, Cluster, SHARED_WITHIN,
};
use common::http::{request, request_with, HttpResponse};

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

    // A pod's settings go to the pod itself through any replica (and come
    // back as they were).
    let on_pod = format!("/v1/pods/{pod}");
    let ratio = |n: u16, r: f64| {
        let body = format!(r#"{{"oversubscription_ratio":{r}}}"#);
        c.call(n, "PATCH", &on_pod, Some(&body))
    };
    let pods = c.call(2, "GET", "/v1/pods", None).json();
    let listed = pods["pods"].as_array().unwrap().iter();
    let mut listed = listed.filter(|p| p["id"] == pod.as_str());
    let was = listed.next().unwrap()["oversubscription_ratio"].as_f64();
    let was = was.unwrap_or_else(|| panic!("no ratio in {pods}"));
    let r = ratio(1, was + 0.5);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["id"], pod.as_str(), "{}", r.body);
    assert_eq!(r.json()["oversubscription_ratio"], was + 0.5);
    let r = ratio(2, -1.0);
    assert_eq!(r.status, 400, "{}", r.body);
    let r = ratio(2, was);
    assert_eq!(r.json()["oversubscription_ratio"], was, "{}", r.body);
    let r = c.call(
        2,
        "PATCH",
        "/v1/pods/pod9",
        Some(r#"{"oversubscription_ratio":2}"#),
    );
    assert_eq!(r.status, 404, "{}", r.body);

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
    assert_eq!(
        c.sql("SELECT max(version) FROM schema_migrations"),
        latest_schema()
    );
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

#[test]
fn cluster_tenants_and_tokens_are_shared_through_postgresql() {
    let c = Cluster::up("tenants");

    // Both replicas were started with the same --token: seeded once, as
    // its SHA-256 (never the token), an admin token of tenant `admin`.
    assert_eq!(
        c.sql("SELECT max(version) FROM schema_migrations"),
        latest_schema()
    );
    let rows = c.sql("SELECT tenant, scope, sha256 FROM tenant_tokens");
    let digest = c.sql(&format!(
        "SELECT encode(sha256('{}'::bytea), 'hex')",
        c.token.trim()
    ));
    assert_eq!(rows, format!("admin|admin|{digest}"));
    let all = c.sql("SELECT string_agg(t::text, ' ') FROM tenant_tokens t");
    assert!(!all.contains(c.token.trim()), "{all}");

    // A tenant made through replica 1 authenticates at replica 2; its
    // sandbox, made through 2, is its own through 1; another tenant does
    // not see it; tenants are not admins at either replica.
    let (acme, acme_id) = tenant_token(&c, 1, "acme");
    let (other, _) = tenant_token(&c, 2, "other");
    assert_eq!(
        c.sql(&format!(
            "SELECT tenant, scope FROM tenant_tokens WHERE id = '{acme_id}'"
        )),
        "acme|tenant"
    );
    let all = c.sql("SELECT string_agg(t::text, ' ') FROM tenant_tokens t");
    assert!(!all.contains(&acme) && !all.contains(&other), "{all}");
    let r = as_token(
        &c,
        2,
        &acme,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"template":"probe"}"#),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let sandbox = r.json()["id"].as_str().unwrap().to_string();
    let path = format!("/v1/sandboxes/{sandbox}");
    assert_eq!(as_token(&c, 1, &acme, "GET", &path, None).status, 200);
    let listed = as_token(&c, 1, &acme, "GET", "/v1/sandboxes", None).json();
    assert_eq!(listed["sandboxes"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(as_token(&c, 1, &other, "GET", &path, None).status, 404);
    let listed = as_token(&c, 2, &other, "GET", "/v1/sandboxes", None).json();
    assert_eq!(listed["sandboxes"].as_array().unwrap().len(), 0, "{listed}");
    for n in [1, 2] {
        assert_eq!(
            as_token(&c, n, &acme, "GET", "/v1/tokens", None).status,
            403
        );
    }

    // A quota set through replica 2 is in PostgreSQL and read through 1.
    c.set_quota(2, "acme", r#"{"total_sandboxes":7}"#);
    assert_eq!(
        c.sql("SELECT quota->>'total_sandboxes' FROM tenant_quotas WHERE tenant = 'acme'"),
        "7"
    );
    let deadline = Instant::now() + SHARED_WITHIN;
    loop {
        let r = as_token(&c, 1, &acme, "GET", "/v1/tenants/acme", None);
        assert_eq!(r.status, 200, "{}", r.body);
        if r.json()["quota"]["total_sandboxes"] == 7 {
            break;
        }
        assert!(Instant::now() < deadline, "quota not shared: {}", r.body);
        std::thread::sleep(Duration::from_millis(100));
    }

    // Listed through either replica; bad input refused.
    for n in [1, 2] {
        let tokens = c.call(n, "GET", "/v1/tokens", None).json();
        let ids: Vec<&str> = tokens["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids.len(), 3, "{tokens}");
        assert!(ids.contains(&acme_id.as_str()), "{tokens}");
    }
    let r = c.call(1, "POST", "/v1/tokens", Some(r#"{"tenant":"../x"}"#));
    assert_eq!(r.status, 400, "{}", r.body);
    let long = format!("/v1/tokens/tok_{}", "0".repeat(200));
    assert_eq!(c.call(2, "DELETE", &long, None).status, 404);
    // The one admin token in PostgreSQL stays.
    let admin_id = c.sql("SELECT id FROM tenant_tokens WHERE scope = 'admin'");
    let r = c.call(1, "DELETE", &format!("/v1/tokens/{admin_id}"), None);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("last admin token"), "{}", r.body);

    // Revoked through replica 2: refused there at once, and at replica 1
    // within the refresh, for good; the other tenant's token still works.
    let r = c.call(2, "DELETE", &format!("/v1/tokens/{acme_id}"), None);
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(
        as_token(&c, 2, &acme, "GET", "/v1/sandboxes", None).status,
        401
    );
    wait_token_status(&c, 1, &acme, "/v1/sandboxes", 401);
    std::thread::sleep(Duration::from_millis(1500));
    for n in [1, 2] {
        let r = as_token(&c, n, &acme, "GET", &path, None);
        assert_eq!(r.status, 401, "replica {n}: {}", r.body);
        assert_eq!(
            as_token(&c, n, &other, "GET", "/v1/sandboxes", None).status,
            200
        );
    }
    assert_eq!(
        c.sql(&format!(
            "SELECT count(*) FROM tenant_tokens WHERE id = '{acme_id}'"
        )),
        "0"
    );
    assert_eq!(
        c.call(1, "DELETE", &format!("/v1/tokens/{acme_id}"), None)
            .status,
        404
    );

    // A replica restarted (its --token seeded again: still one row) knows
    // the tenants from PostgreSQL; a tenants file in its data directory is
    // seeded too (tokens and quotas), so the other replica knows them.
    let seeded = "seeded-token-0123456789";
    let digest = c.sql(&format!("SELECT encode(sha256('{seeded}'::bytea), 'hex')"));
    let file = serde_json::json!({
        "tokens": [{"id": "tok_5eed000000000001", "tenant": "seeded", "scope": "tenant",
                    "sha256": digest, "created_at": 0}],
        "quotas": {"seeded": {"running_sandboxes": 2}},
    });
    std::fs::write(c.dir.join("api1/tenants.json"), file.to_string()).unwrap();
    c.kill("api1");
    c.start("api1");
    assert_eq!(
        c.sql("SELECT count(*) FROM tenant_tokens WHERE scope = 'admin'"),
        "1"
    );
    wait_token_status(&c, 2, seeded, "/v1/sandboxes", 200);
    let r = as_token(&c, 2, seeded, "GET", "/v1/tenants/seeded", None);
    assert_eq!(r.json()["quota"]["running_sandboxes"], 2, "{}", r.body);
    // Seeded again on the next start: nothing doubled, and a quota set
    // since is not undone.
    c.set_quota(2, "seeded", r#"{"running_sandboxes":3}"#);
    c.kill("api1");
    c.start("api1");
    assert_eq!(
        c.sql("SELECT count(*) FROM tenant_tokens WHERE tenant = 'seeded'"),
        "1"
    );
    let r = as_token(&c, 1, seeded, "GET", "/v1/tenants/seeded", None);
    assert_eq!(r.json()["quota"]["running_sandboxes"], 3, "{}", r.body);
    assert_eq!(
        as_token(&c, 1, &other, "GET", "/v1/sandboxes", None).status,
        200
    );
    assert_eq!(
        as_token(&c, 1, &acme, "GET", "/v1/sandboxes", None).status,
        401
    );
    assert_eq!(c.call(1, "DELETE", &path, None).status, 204);

    // PostgreSQL down: the last read stays in force (a known token gets
    // past the auth layer to the 503 of the route, a revoked one is still
    // 401) and a change answers 503 `unavailable`, not 500; back, it works.
    c.stop("postgres");
    let r = c.call(1, "POST", "/v1/tokens", Some(r#"{"tenant":"late"}"#));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "unavailable", "{}", r.body);
    std::thread::sleep(Duration::from_millis(1500));
    for n in [1, 2] {
        let r = as_token(&c, n, &other, "GET", "/v1/sandboxes", None);
        assert_eq!(r.status, 503, "replica {n}: {}", r.body);
        assert_eq!(
            as_token(&c, n, &acme, "GET", "/v1/sandboxes", None).status,
            401
        );
    }
    c.start("postgres");
    let deadline = Instant::now() + Duration::from_secs(30);
    let late = loop {
        let r = c.call(2, "POST", "/v1/tokens", Some(r#"{"tenant":"late"}"#));
        if r.status == 201 {
            break r.json()["token"].as_str().unwrap().to_string();
        }
        assert!(Instant::now() < deadline, "{} {}", r.status, r.body);
        std::thread::sleep(Duration::from_millis(200));
    };
    wait_token_status(&c, 1, &late, "/v1/sandboxes", 200);
}

#[test]
fn cluster_quota_admits_creates_in_postgresql_across_replicas() {
    let c = Cluster::up("quota");
    let (token, _) = tenant_token(&c, 1, "quoted");
    c.set_quota(2, "quoted", r#"{"total_sandboxes":3}"#);

    // 12 creates at once, 6 through each replica: exactly 3 admitted (the
    // count and the journal in one transaction under the tenant's quota
    // row's lock), the others 429 `quota_exceeded` naming the quota.
    let body = Some(r#"{"template":"probe"}"#);
    let answers: Vec<HttpResponse> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..12u16)
            .map(|i| {
                let (c, token) = (&c, token.as_str());
                s.spawn(move || as_token(c, 1 + i % 2, token, "POST", "/v1/sandboxes", body))
            })
            .collect();
        calls.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut made = Vec::new();
    for r in &answers {
        match r.status {
            201 => made.push(r.json()["id"].as_str().unwrap().to_string()),
            429 => {
                let e = &r.json()["error"];
                assert_eq!(e["code"], "quota_exceeded", "{}", r.body);
                assert_eq!(
                    (e["quota"].as_str(), e["limit"].as_u64()),
                    (Some("total_sandboxes"), Some(3)),
                    "{}",
                    r.body
                );
            }
            _ => panic!("{} {}", r.status, r.body),
        }
    }
    assert_eq!(made.len(), 3, "admitted past the quota: {made:?}");
    assert_eq!(stored_sandboxes(&c, "quoted"), "3");
    // Another tenant (no quota) is not held by it.
    create(&c, 2);

    // Deleting one frees room for one more, through either replica; a
    // retry of that create (its Idempotency-Key) at the limit is its first
    // answer, not a refusal; a new one is refused.
    let r = as_token(
        &c,
        2,
        &token,
        "DELETE",
        &format!("/v1/sandboxes/{}", made[0]),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let auth = format!("Bearer {token}");
    let headers = [
        ("Idempotency-Key", "quoted-once"),
        ("Authorization", auth.as_str()),
    ];
    let first = request_with(&c.api(1), "POST", "/v1/sandboxes", &headers, body);
    assert_eq!(first.status, 201, "{}", first.body);
    let again = request_with(&c.api(2), "POST", "/v1/sandboxes", &headers, body);
    assert_eq!(again.status, 201, "{}", again.body);
    assert_eq!(again.json()["id"], first.json()["id"]);
    for n in [1, 2] {
        let r = as_token(&c, n, &token, "POST", "/v1/sandboxes", body);
        assert_eq!(r.status, 429, "replica {n}: {}", r.body);
    }
    assert_eq!(stored_sandboxes(&c, "quoted"), "3");
    // A failed create is not counted: the quota raised, an unknown
    // template refused, and the room still there.
    c.set_quota(1, "quoted", r#"{"total_sandboxes":4}"#);
    let r = as_token(
        &c,
        1,
        &token,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"template":"absent"}"#),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    let r = as_token(&c, 2, &token, "POST", "/v1/sandboxes", body);
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(
        as_token(&c, 1, &token, "POST", "/v1/sandboxes", body).status,
        429
    );

    // Memory: a create asks its template's (as its pod lists it), pending
    // or made; 6 at once against room for 2 probes: exactly 2.
    let (heavy, _) = tenant_token(&c, 2, "heavy");
    let templates = c.call(1, "GET", "/v1/templates", None).json();
    let mem = templates["templates"][0]["mem_mib"].as_u64().unwrap();
    assert!(mem > 0, "{templates}");
    let quota = format!(r#"{{"memory_mib":{}}}"#, 2 * mem + mem / 2);
    c.set_quota(1, "heavy", &quota);
    let answers: Vec<HttpResponse> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..6u16)
            .map(|i| {
                let (c, token) = (&c, heavy.as_str());
                s.spawn(move || as_token(c, 1 + i % 2, token, "POST", "/v1/sandboxes", body))
            })
            .collect();
        calls.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let admitted = answers.iter().filter(|r| r.status == 201).count();
    for r in answers.iter().filter(|r| r.status != 201) {
        assert_eq!(r.status, 429, "{}", r.body);
        assert_eq!(r.json()["error"]["quota"], "memory_mib", "{}", r.body);
    }
    assert_eq!(admitted, 2, "memory admitted past the quota");
    assert_eq!(stored_sandboxes(&c, "heavy"), "2");
}

/// `GET /v1/templates` through replica `n` with `token`: (name, pod) of
/// each entry, sorted.
fn template_names(c: &Cluster, n: u16, token: &str) -> Vec<(String, String)> {
    let r = as_token(c, n, token, "GET", "/v1/templates", None);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let mut out: Vec<(String, String)> = v["templates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            if token != c.token.trim() {
                assert!(t.get("snapshot_dir").is_none(), "{t}");
            }
            let name = t["name"].as_str().unwrap().to_string();
            (name, t["pod"].as_str().unwrap().to_string())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn cluster_templates_are_the_pods_tenant_filtered() {
    let c = Cluster::up("templates");
    let admin = c.token.trim().to_string();
    let (acme, _) = tenant_token(&c, 1, "acme");
    let (other, _) = tenant_token(&c, 2, "other");
    let probes = |pods: &[&str]| -> Vec<(String, String)> {
        pods.iter()
            .map(|p| ("probe".to_string(), p.to_string()))
            .collect()
    };
    assert_eq!(template_names(&c, 1, &other), probes(&["pod1", "pod2"]));

    // acme's own template on pod1: a pod takes no tenant's token, so it is
    // built by pod1's admin (shared), then made acme's in pod1's store
    // while pod1 is stopped (as a tenant's build on an embedded server
    // records it). Listed through either replica to the admin and acme,
    // once pod1's heartbeat carries it, never to another tenant.
    let r = request(
        &c.pod_api(1),
        "POST",
        "/v1/templates",
        Some(&c.pod_token(1)),
        Some(r#"{"name":"acme-tpl","kind":"probe","mem_mib":64}"#),
    );
    assert!(r.status == 201 || r.status == 202, "{}", r.body);
    let built = ("acme-tpl".to_string(), "pod1".to_string());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !template_names(&c, 1, &other).contains(&built) {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            template_names(&c, 1, &other)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    c.kill("pod1");
    let store = c.dir.join("pod1/data/torpor.db");
    let out = std::process::Command::new("sqlite3")
        .arg(&store)
        .arg("UPDATE templates SET tenant = 'acme' WHERE name = 'acme-tpl'")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    c.start("pod1");
    c.wait_pods(2);
    let mine = ("acme-tpl".to_string(), "pod1".to_string());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !template_names(&c, 2, &admin).contains(&mine) {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            template_names(&c, 2, &admin)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut with_mine = probes(&["pod1", "pod2"]);
    with_mine.insert(0, mine.clone());
    assert_eq!(template_names(&c, 1, &admin), with_mine);
    assert_eq!(template_names(&c, 2, &acme), with_mine);
    assert_eq!(template_names(&c, 1, &other), probes(&["pod1", "pod2"]));
    let r = as_token(&c, 1, &acme, "GET", "/v1/templates?limit=1", None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["templates"].as_array().unwrap().len(),
        1,
        "{}",
        r.body
    );

    // A pod down: its templates are left out.
    c.kill("pod1");
    let deadline = Instant::now() + Duration::from_secs(30);
    while template_names(&c, 1, &admin) != probes(&["pod2"]) {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            template_names(&c, 1, &admin)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(template_names(&c, 2, &acme), probes(&["pod2"]));
}

/// A create placed on a pod that died holds its tenant's quota only until
/// its deadlines (`cluster/src/expiry.rs`): then it reads failed (503
/// `unavailable`), the quota is free, and the pod, back, does not run it.
#[test]
fn cluster_create_on_a_dead_pod_frees_its_quota() {
    let c = Cluster::up("expiry");
    let (token, _) = tenant_token(&c, 1, "stuck");
    c.set_quota(1, "stuck", r#"{"total_sandboxes":1}"#);
    // Replica 1 counts a silent pod as up for 10 min (a create goes to a
    // dead pod), waits 1 s for an outcome, and gives a create 3 s to be
    // started and 4 s more.
    c.kill("api1");
    c.start_api(
        "api1",
        "--cluster-down-after-ms 600000 --cluster-wait-ms 1000 \
         --cluster-create-start-ms 3000 --cluster-create-grace-ms 4000",
    );
    c.kill("pod1");
    c.kill("pod2");
    let body = Some(r#"{"template":"probe"}"#);
    let auth = format!("Bearer {token}");
    let keyed = [
        ("Idempotency-Key", "stuck-1"),
        ("Authorization", auth.as_str()),
    ];
    let r = request_with(&c.api(1), "POST", "/v1/sandboxes", &keyed, body);
    assert_eq!(r.status, 202, "{}", r.body);
    let op = r.json();
    let (id, pod) = (op["id"].as_str().unwrap(), op["pod"].as_str().unwrap());
    let location = r.header("location").unwrap().to_string();
    // Pending, it is counted: the next create is refused.
    let r = as_token(&c, 1, &token, "POST", "/v1/sandboxes", body);
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "quota_exceeded", "{}", r.body);
    assert_eq!(
        c.call(2, "GET", &location, None).json()["status"],
        "pending"
    );

    // Past its deadlines a replica ended it: failed, with the typed error.
    let ended = finished(&c, 2, &location);
    assert_eq!(ended["status"], "failed", "{ended}");
    let error = &ended["outcome"]["failed"];
    assert_eq!(error["status"], 503, "{ended}");
    assert_eq!(error["code"], "unavailable", "{ended}");
    let message = error["message"].as_str().unwrap().to_string();
    assert!(
        message.contains(id) && message.contains(pod) && message.contains("start deadline"),
        "{message}"
    );
    // A retry with its key reads that failure (503), as for any operation
    // (through replica 1: 2 places nothing while no pod is up).
    let r = request_with(&c.api(1), "POST", "/v1/sandboxes", &keyed, body);
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "unavailable", "{}", r.body);

    // The quota is free: with the pods back, a create is admitted and made.
    c.start("pod1");
    c.start("pod2");
    // The pod it was placed on takes it again (its work queue) and does
    // not run it: past its start deadline.
    let log = c.dir.join(format!("{pod}.log"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("taken past its start deadline")
    {
        assert!(Instant::now() < deadline, "{pod} did not refuse {id}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = as_token(&c, 1, &token, "POST", "/v1/sandboxes", body);
    let made = match r.status {
        201 => r.json(),
        202 => {
            let done = finished(&c, 1, r.header("location").unwrap());
            assert_eq!(done["status"], "done", "{done}");
            done["outcome"]["sandbox"]["sandbox"].clone()
        }
        _ => panic!("{} {}", r.status, r.body),
    };
    let made = made["id"].as_str().unwrap().to_string();
    // The pod's refusal, published after the replica ended it, changed
    // nothing; and nothing else was made (heartbeats every second).
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(c.call(1, "GET", &location, None).json(), ended);
    assert_eq!(stored_sandboxes(&c, "stuck"), "1");
    let held: Vec<Value> = [1, 2]
        .into_iter()
        .flat_map(|n| c.pod_sandboxes(n))
        .collect();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0]["id"], made.as_str());
}

/// A wake (resume or connect of a hibernated sandbox, or a guest call that
/// would wake it) is admitted in PostgreSQL with its operation, atomically
/// across replicas, as a create: with room for one running sandbox, two
/// wakes at once through both replicas wake exactly one (each replica's
/// own count, read from PostgreSQL, admitted both before); a guest call on
/// the other is refused and leaves it hibernated; once there is room, a
/// guest call wakes it first.
#[test]
fn cluster_wakes_are_admitted_in_postgresql_across_replicas() {
    let c = Cluster::up("wakes");
    let (token, _) = tenant_token(&c, 1, "waker");
    let body = Some(r#"{"template":"probe"}"#);
    let ids: Vec<String> = (1..=2u16)
        .map(|n| {
            let r = as_token(&c, n, &token, "POST", "/v1/sandboxes", body);
            assert_eq!(r.status, 201, "{}", r.body);
            let id = r.json()["id"].as_str().unwrap().to_string();
            let r = as_token(
                &c,
                n,
                &token,
                "POST",
                &format!("/v1/sandboxes/{id}/hibernate"),
                None,
            );
            assert_eq!(r.status, 200, "{}", r.body);
            id
        })
        .collect();
    c.set_quota(1, "waker", r#"{"running_sandboxes":1}"#);
    // Replica 2 reads the tenants again within this (its guard wakes a
    // sandbox first only for a tenant with a quota).
    std::thread::sleep(SHARED_WITHIN);
    let state = |id: &str| {
        let r = as_token(&c, 2, &token, "GET", &format!("/v1/sandboxes/{id}"), None);
        r.json()["state"].as_str().unwrap_or_default().to_string()
    };

    let answers: Vec<HttpResponse> = std::thread::scope(|s| {
        let calls: Vec<_> = [(1u16, &ids[0], "resume"), (2, &ids[1], "connect")]
            .into_iter()
            .map(|(n, id, op)| {
                let (c, token) = (&c, token.as_str());
                let path = format!("/v1/sandboxes/{id}/{op}");
                s.spawn(move || as_token(c, n, token, "POST", &path, None))
            })
            .collect();
        calls.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let woken: Vec<usize> = (0..2).filter(|&i| answers[i].status == 200).collect();
    assert_eq!(woken.len(), 1, "{} / {}", answers[0].body, answers[1].body);
    let (up, down) = (woken[0], 1 - woken[0]);
    let refused = &answers[down];
    assert_eq!(refused.status, 429, "{}", refused.body);
    let e = &refused.json()["error"];
    assert_eq!(e["code"], "quota_exceeded", "{}", refused.body);
    assert_eq!(e["quota"], "running_sandboxes", "{}", refused.body);
    assert_eq!(state(&ids[up]), "running");
    assert_eq!(state(&ids[down]), "hibernated");

    // A guest call on the hibernated one would wake it: refused alike, and
    // it stays hibernated.
    let exec = format!("/v1/sandboxes/{}/exec", ids[down]);
    let argv = Some(r#"{"argv":["true"]}"#);
    let r = as_token(&c, 2, &token, "POST", &exec, argv);
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(state(&ids[down]), "hibernated");

    // Room again (the running one hibernated): the guest call wakes it
    // first, through the queue, then reaches its pod (a probe has no
    // agent: 422 there).
    let r = as_token(
        &c,
        1,
        &token,
        "POST",
        &format!("/v1/sandboxes/{}/hibernate", ids[up]),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = as_token(&c, 1, &token, "POST", &exec, argv);
    assert_eq!(r.status, 422, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "no_agent", "{}", r.body);
    assert_eq!(state(&ids[down]), "running");
    assert_eq!(
        c.sql("SELECT count(*) FROM operations WHERE status = 'pending'"),
        "0"
    );
}

/// The schema version a replica of this build migrates to.
fn latest_schema() -> String {
    let (version, _) = torpor_cluster::db::MIGRATIONS.last().unwrap();
    version.to_string()
}
