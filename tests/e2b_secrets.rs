//! E2B's secrets (`/secrets`, `e2b/src/secrets.rs`) on `torpor serve`:
//! through the real, pinned SDKs' `Secret` (`tests/e2b/sdk_secrets.py`
//! and `tests/e2b/sdk_secrets.mjs`: create, get_info by id and name, list
//! over three pages, update to versions 2 and 3, duplicate and invalid
//! names, delete, another tenant's key), and with raw HTTP: each tenant's
//! own (another's is 404 by id and name, and cannot be changed or
//! deleted), the per-tenant limit, and no value in any answer, in
//! serve's debug log or in `/metrics`, while the store keeps it across a
//! restart. The store itself: `scheduler/src/store/tests/secrets.rs`;
//! on a cluster (PostgreSQL): `tests/cluster_secrets.rs`.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::e2b::{node_modules, python, run_script, Sdk};
use common::http::{request, request_with, HttpResponse};
use common::serve::{DataDir, ServeProcess};
use serde_json::{json, Value};

/// A new tenant's token, made through `/v1/tokens` with `admin`.
fn tenant(addr: &str, admin: &str, name: &str) -> String {
    let body = json!({ "tenant": name }).to_string();
    request(addr, "POST", "/v1/tokens", Some(admin), Some(&body)).ok_json("POST", "/v1/tokens")
        ["token"]
        .as_str()
        .unwrap()
        .to_string()
}

fn e2b(addr: &str, key: &str, method: &str, path: &str, body: Option<&Value>) -> HttpResponse {
    let body = body.map(Value::to_string);
    request_with(addr, method, path, &[("X-API-KEY", key)], body.as_deref())
}

/// Runs `script` with `sdk` against a fresh serve, as tenant `acme` with
/// tenant `evil`'s key beside.
fn run_sdk(name: &str, sdk: Sdk, script: &str) {
    let data = DataDir::new(name);
    let serve = ServeProcess::start(&data.0, &[]);
    let admin = serve.first_admin_token();
    let acme = tenant(&serve.addr, &admin, "acme");
    let evil = tenant(&serve.addr, &admin, "evil");
    run_script(
        sdk,
        script,
        &[],
        &serve.url(),
        &acme,
        &[("OTHER_E2B_API_KEY", evil.as_str())],
        Duration::from_secs(300),
    );
}

#[test]
fn python_sdk_secrets() {
    assert!(
        python().exists(),
        "the e2b venv is missing ({}): run scripts/setup test",
        python().display()
    );
    run_sdk("e2b-secrets-py", Sdk::Python, "sdk_secrets.py");
}

#[test]
fn js_sdk_secrets() {
    assert!(
        node_modules().join("e2b/package.json").exists(),
        "npm e2b is missing ({}): run scripts/setup test",
        node_modules().display()
    );
    run_sdk("e2b-secrets-js", Sdk::Js, "sdk_secrets.mjs");
}

/// serve with its debug log written to `log` (stderr); its address.
fn serve_logged(data: &std::path::Path, log: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(common::TORPOR)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .env("TORPOR_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("spawn torpor serve");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut banner = Vec::new();
    let addr = loop {
        let line = lines.next().expect("serve exited").unwrap();
        let addr = line
            .split("listening on http://")
            .nth(1)
            .map(|r| r.trim().to_string());
        banner.push(line);
        if let Some(addr) = addr {
            break addr;
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let admin = banner
        .iter()
        .find_map(|l| l.split("admin token: ").nth(1))
        .map(|t| t.trim().to_string());
    (child, format!("{addr} {}", admin.unwrap_or_default()))
}

#[test]
fn secrets_are_each_tenants_own_and_their_values_never_shown() {
    let scratch = DataDir::new("e2b-secrets-http");
    let data = scratch.0.join("data");
    let (log, log2) = (scratch.0.join("serve.log"), scratch.0.join("serve2.log"));
    let (mut child, started) = serve_logged(&data, &log);
    let (addr, admin) = started.split_once(' ').unwrap();
    let (addr, admin) = (addr.to_string(), admin.to_string());
    let acme = tenant(&addr, &admin, "acme");
    let evil = tenant(&addr, &admin, "evil");
    const VALUE: &str = "hunter2-value-never-shown-0xC0FFEE";
    let mut answers = String::new();
    let mut call = |key: &str, method: &str, path: &str, body: Option<Value>| {
        let r = e2b(&addr, key, method, path, body.as_ref());
        answers.push_str(&format!("{}\n{}\n{}\n", r.status, r.head, r.body));
        r
    };

    let made = call(
        &acme,
        "POST",
        "/secrets",
        Some(json!({"name": "Db-Password", "value": VALUE, "metadata": {"env": "prod"}})),
    );
    assert_eq!(made.status, 201, "{}", made.body);
    let s = made.json();
    let id = s["secretID"].as_str().unwrap().to_string();
    assert!(id.starts_with("sec_"), "{s}");
    assert_eq!(s["name"], "db-password");
    assert_eq!(s["currentVersion"], 1);
    assert_eq!(s["metadata"], json!({"env": "prod"}));
    assert_eq!(s["createdAt"], s["updatedAt"]);
    assert_eq!(s.as_object().unwrap().len(), 6, "{s}");

    // acme's, by id and by name in any case.
    for key in [id.as_str(), "db-password", "DB-PASSWORD"] {
        let r = call(&acme, "GET", &format!("/secrets/{key}"), None);
        assert_eq!(
            (r.status, r.json()["secretID"].as_str()),
            (200, Some(id.as_str()))
        );
    }
    // evil's view: nothing, by id or name, and nothing it does changes it;
    // the same name is its own to take.
    for key in [id.as_str(), "db-password"] {
        let path = format!("/secrets/{key}");
        for (method, body) in [
            ("GET", None),
            ("POST", Some(json!({"value": "stolen"}))),
            ("DELETE", None),
        ] {
            let r = call(&evil, method, &path, body);
            assert_eq!(r.status, 404, "evil {method} {path}: {}", r.body);
            assert_eq!(r.json()["code"], 404);
        }
    }
    let r = call(&evil, "GET", "/secrets", None);
    assert_eq!((r.status, r.json()), (200, json!([])));
    let theirs = call(
        &evil,
        "POST",
        "/secrets",
        Some(json!({"name": "db-password", "value": "theirs"})),
    );
    assert_eq!(theirs.status, 201, "{}", theirs.body);
    assert_ne!(theirs.json()["secretID"], id.as_str());
    let r = call(&acme, "GET", "/secrets/db-password", None);
    assert_eq!(
        (
            r.json()["secretID"].as_str(),
            r.json()["currentVersion"].as_u64()
        ),
        (Some(id.as_str()), Some(1))
    );

    // Updates: the next version, metadata replaced only when given.
    let r = call(
        &acme,
        "POST",
        &format!("/secrets/{id}"),
        Some(json!({"value": VALUE})),
    );
    assert_eq!(
        (r.status, r.json()["currentVersion"].as_u64()),
        (200, Some(2))
    );
    assert_eq!(r.json()["metadata"], json!({"env": "prod"}));
    let r = call(
        &acme,
        "POST",
        "/secrets/db-password",
        Some(json!({"value": VALUE, "metadata": {}})),
    );
    assert_eq!(
        (r.json()["currentVersion"].as_u64(), &r.json()["metadata"]),
        (Some(3), &json!({}))
    );

    // Refusals: 409 on a taken name, 400 naming what is wrong, no value
    // quoted.
    let r = call(
        &acme,
        "POST",
        "/secrets",
        Some(json!({"name": "DB-password", "value": VALUE})),
    );
    assert_eq!(r.status, 409, "{}", r.body);
    for (body, what) in [
        (json!({"name": "a{b}", "value": VALUE}), "name"),
        (json!({"name": "sec_x", "value": VALUE}), "name"),
        (json!({"name": "x".repeat(129), "value": VALUE}), "name"),
        (json!({"name": "ok", "value": 42}), "value"),
        (json!({"name": "ok"}), "value"),
        (
            json!({"name": "ok", "value": format!("{VALUE}{}", "x".repeat(65536))}),
            "value",
        ),
        (
            json!({"name": "ok", "value": VALUE, "metadata": {"k": 7}}),
            "metadata",
        ),
        (
            json!({"name": "ok", "value": VALUE, "metadata": {"k": "v".repeat(1025)}}),
            "metadata",
        ),
    ] {
        let r = call(&acme, "POST", "/secrets", Some(body));
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(
            r.json()["message"].as_str().unwrap().starts_with(what),
            "{}",
            r.body
        );
    }
    let r = call(
        &acme,
        "POST",
        &format!("/secrets/{id}"),
        Some(json!({"value": [VALUE]})),
    );
    assert_eq!(r.status, 400, "{}", r.body);

    // The store keeps the value across a restart (the data directory's
    // SQLite; the rows, not an answer).
    let _ = child.kill();
    let _ = child.wait();
    let (mut child, started) = serve_logged(&data, &log2);
    let addr = started.split_once(' ').unwrap().0.to_string();
    let r = e2b(&addr, &acme, "GET", "/secrets/db-password", None);
    assert_eq!(
        (r.status, r.json()["currentVersion"].as_u64()),
        (200, Some(3))
    );
    let db = std::fs::read(data.join("torpor.db")).unwrap_or_default();
    let wal = std::fs::read(data.join("torpor.db-wal")).unwrap_or_default();
    let stored = [db, wal].concat();
    assert!(
        stored.windows(VALUE.len()).any(|w| w == VALUE.as_bytes()),
        "the value is stored in the data directory's database"
    );

    // The limit per tenant: 1000 (the gate's MAX_SECRETS_PER_TENANT).
    for i in 1..1000 {
        let r = e2b(
            &addr,
            &acme,
            "POST",
            "/secrets",
            Some(&json!({"name": format!("n{i}"), "value": "v"})),
        );
        assert_eq!(r.status, 201, "{i}: {}", r.body);
    }
    let r = e2b(
        &addr,
        &acme,
        "POST",
        "/secrets",
        Some(&json!({"name": "one-more", "value": "v"})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("at most 1000"), "{}", r.body);
    // evil is not counted with acme.
    let r = e2b(
        &addr,
        &evil,
        "POST",
        "/secrets",
        Some(&json!({"name": "two", "value": "v"})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    // Ten pages of acme's 1000, none repeated.
    let mut seen = std::collections::BTreeSet::new();
    let mut path = "/secrets".to_string();
    loop {
        let r = e2b(&addr, &acme, "GET", &path, None);
        assert_eq!(r.status, 200, "{}", r.body);
        answers.push_str(&r.body);
        for s in r.json().as_array().unwrap() {
            assert!(seen.insert(s["secretID"].as_str().unwrap().to_string()));
        }
        match r.header("x-next-token") {
            Some(t) => path = format!("/secrets?nextToken={t}"),
            None => break,
        }
    }
    assert_eq!(seen.len(), 1000);

    let r = e2b(&addr, &acme, "DELETE", &format!("/secrets/{id}"), None);
    assert_eq!(r.status, 204);
    let r = e2b(&addr, &acme, "GET", &format!("/secrets/{id}"), None);
    assert_eq!(r.status, 404);
    let metrics = request(&addr, "GET", "/metrics", Some(&admin), None);
    answers.push_str(&metrics.body);
    let _ = child.kill();
    let _ = child.wait();

    let logs = [
        std::fs::read_to_string(&log).unwrap(),
        std::fs::read_to_string(&log2).unwrap(),
    ]
    .concat();
    assert!(
        logs.contains("DEBUG"),
        "a debug log was written: {logs:.300}"
    );
    for (what, text) in [("an answer", &answers), ("serve's log", &logs)] {
        assert!(!text.contains(VALUE), "{what} carries the value");
        assert!(
            !text.contains("stolen") && !text.contains("theirs"),
            "{what} carries a value"
        );
    }
}
