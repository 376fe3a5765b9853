//! E2B's secrets on a cluster (`scripts/cluster` on loopback, as
//! tests/cluster.rs): kept in PostgreSQL (`cluster/src/secrets.rs`), so a
//! secret made through one replica is read, updated and deleted through
//! the other, by its tenant only; the pinned Python SDK's whole script
//! (`tests/e2b/sdk_secrets.py`) passes against a replica; creates racing
//! on both replicas stay within the per-tenant limit; the value is in
//! PostgreSQL and in no answer. Needs postgres and nats-server
//! (tests/needs leaves it out without them).

use std::time::Duration;

use common::cluster::{tenant_token, Cluster};
use common::e2b::{python, run_script, Sdk};
use common::http::{request_with, HttpResponse};
use serde_json::{json, Value};

mod common;

fn e2b(
    c: &Cluster,
    n: u16,
    key: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> HttpResponse {
    let body = body.map(|b| b.to_string());
    request_with(
        &c.api(n),
        method,
        path,
        &[("X-API-KEY", key)],
        body.as_deref(),
    )
}

#[test]
fn cluster_secrets_are_shared_by_the_replicas_and_each_tenants_own() {
    assert!(
        python().exists(),
        "the e2b venv is missing ({}): run scripts/setup test",
        python().display()
    );
    let c = Cluster::up("secrets");
    let (acme, _) = tenant_token(&c, 1, "acme");
    let (evil, _) = tenant_token(&c, 2, "evil");
    const VALUE: &str = "cluster-secret-value-0xBADC0DE";

    // Made through replica 1, seen through replica 2 (no cache: the row).
    let r = e2b(
        &c,
        1,
        &acme,
        "POST",
        "/secrets",
        Some(json!({"name": "Shared", "value": VALUE})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["secretID"].as_str().unwrap().to_string();
    let mut answers = r.body.clone();
    let r = e2b(&c, 2, &acme, "GET", "/secrets/shared", None);
    assert_eq!(
        (r.status, r.json()["secretID"].as_str()),
        (200, Some(id.as_str()))
    );
    answers.push_str(&r.body);
    let r = e2b(
        &c,
        2,
        &acme,
        "POST",
        &format!("/secrets/{id}"),
        Some(json!({"value": VALUE, "metadata": {"k": "v"}})),
    );
    assert_eq!(
        (r.status, r.json()["currentVersion"].as_u64()),
        (200, Some(2))
    );
    answers.push_str(&r.body);
    let r = e2b(&c, 1, &acme, "GET", "/secrets", None);
    assert_eq!(r.json()[0]["metadata"], json!({"k": "v"}));
    answers.push_str(&r.body);
    let r = e2b(
        &c,
        1,
        &acme,
        "POST",
        "/secrets",
        Some(json!({"name": "SHARED", "value": "x"})),
    );
    assert_eq!(r.status, 409, "{}", r.body);
    answers.push_str(&r.body);
    // Another tenant, on either replica: 404 by id and name.
    for n in [1, 2] {
        for key in [id.as_str(), "shared"] {
            for (method, body) in [
                ("GET", None),
                ("POST", Some(json!({"value": "stolen"}))),
                ("DELETE", None),
            ] {
                let r = e2b(&c, n, &evil, method, &format!("/secrets/{key}"), body);
                assert_eq!(r.status, 404, "replica {n} {method} {key}: {}", r.body);
            }
        }
        let r = e2b(&c, n, &evil, "GET", "/secrets", None);
        assert_eq!(r.json(), json!([]));
    }
    assert!(!answers.contains(VALUE), "an answer carries the value");
    // Stored in PostgreSQL, at version 2, under acme.
    assert_eq!(
        c.sql(&format!(
            "SELECT tenant, version FROM secrets WHERE value = '{VALUE}'"
        ))
        .trim(),
        "acme|2"
    );

    // Creates racing on both replicas stop at the limit (1000).
    let mut made = 1;
    for i in 1..990 {
        let r = e2b(
            &c,
            1 + (i % 2) as u16,
            &acme,
            "POST",
            "/secrets",
            Some(json!({"name": format!("n{i}"), "value": "v"})),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        made += 1;
    }
    let racers: Vec<_> = (0..4u16)
        .map(|t| {
            let (api1, api2, key) = (c.api(1), c.api(2), acme.clone());
            std::thread::spawn(move || {
                let mut ok = 0;
                for i in 0..10 {
                    let addr = if (t + i) % 2 == 0 { &api1 } else { &api2 };
                    let body = json!({"name": format!("race-{t}-{i}"), "value": "v"}).to_string();
                    let r = request_with(
                        addr,
                        "POST",
                        "/secrets",
                        &[("X-API-KEY", key.as_str())],
                        Some(&body),
                    );
                    match r.status {
                        201 => ok += 1,
                        400 => assert!(r.body.contains("at most 1000"), "{}", r.body),
                        s => panic!("{s}: {}", r.body),
                    }
                }
                ok
            })
        })
        .collect();
    made += racers.into_iter().map(|t| t.join().unwrap()).sum::<usize>();
    assert_eq!(made, 1000, "created past the limit");
    assert_eq!(
        c.sql("SELECT count(*) FROM secrets WHERE tenant = 'acme'")
            .trim(),
        "1000"
    );
    let r = e2b(&c, 2, &acme, "DELETE", "/secrets/shared", None);
    assert_eq!(r.status, 204);
    let r = e2b(&c, 1, &acme, "GET", &format!("/secrets/{id}"), None);
    assert_eq!(r.status, 404);

    // The Python SDK's script, as evil (which has room) with a new tenant
    // beside it.
    let (other, _) = tenant_token(&c, 1, "other");
    run_script(
        Sdk::Python,
        "sdk_secrets.py",
        &[],
        &format!("http://{}", c.api(2)),
        &evil,
        &[("OTHER_E2B_API_KEY", other.as_str())],
        Duration::from_secs(300),
    );
}
