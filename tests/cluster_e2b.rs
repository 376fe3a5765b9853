//! E2B's API and envd in the cluster (`scripts/cluster` on loopback, as
//! tests/cluster.rs): both replicas serve `--e2b-listen`; a sandbox made
//! through one is read, measured, timed, paused, woken, forked, snapshotted (the
//! snapshot made and used on its pod) and killed through the other, by
//! its tenant only, admitted against the tenant's quota in
//! PostgreSQL; its envd access token, kept in PostgreSQL, is checked by
//! either replica and shown again by connect; envd reaches the guest
//! through the owning pod's agent tunnel (the probe has no agent: a real
//! torpor-agent behind the hybrid vsock stand-in takes its place, as in
//! api/tests/http_e2b_envd.rs); a pod down is 503. Needs postgres and
//! nats-server (tests/needs leaves it out without them) and sqlite3.

use std::time::{Duration, Instant};

use common::cluster::{tenant_token, Cluster, API_ARGS};
use common::http::{request_with, HttpResponse};
use serde_json::Value;

mod common;

/// Restarts replica `n` with `--e2b-listen` on a free port; its address.
fn with_e2b_listener(c: &Cluster, n: u16) -> String {
    let part = format!("api{n}");
    c.kill(&part);
    c.start_api(&part, &format!("{API_ARGS} --e2b-listen 127.0.0.1:0"));
    let log = std::fs::read_to_string(c.dir.join(format!("{part}.log"))).unwrap();
    log.lines()
        .find_map(|l| l.strip_prefix("torpor serve: E2B API on http://"))
        .unwrap_or_else(|| panic!("no E2B listener in {part}'s log:\n{log}"))
        .to_string()
}

/// `METHOD path` on an E2B listener with `X-API-KEY: key` and `headers`.
fn e2b(
    addr: &str,
    key: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    let mut all = vec![("X-API-KEY", key)];
    all.extend_from_slice(headers);
    request_with(addr, method, path, &all, body)
}

/// Asserts `r`'s status; its JSON (null when empty).
fn expect(r: HttpResponse, status: u16, what: &str) -> Value {
    assert_eq!(r.status, status, "{what}: {}", r.body);
    if r.body.is_empty() {
        Value::Null
    } else {
        r.json()
    }
}

/// envd's request headers for sandbox `id` with its access token.
fn envd_headers<'a>(id: &'a str, token: &'a str) -> [(&'a str, &'a str); 2] {
    [("E2b-Sandbox-Id", id), ("X-Access-Token", token)]
}

/// The pod number of a `podN` id.
fn pod_number(pod: &str) -> u16 {
    pod.trim_start_matches("pod").parse().unwrap()
}

/// `sql` on pod `n`'s own SQLite store (sqlite3, waiting out its writer).
fn pod_sql(c: &Cluster, n: u16, sql: &str) {
    let store = c.dir.join(format!("pod{n}/data/torpor.db"));
    let out = std::process::Command::new("sqlite3")
        .arg("-cmd")
        .arg(".timeout 5000")
        .arg(&store)
        .arg(sql)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// Sets the probe template's kind in pod `n`'s store, and waits until its
/// heartbeat carried it to PostgreSQL.
fn set_probe_kind(c: &Cluster, n: u16, kind: &str) {
    pod_sql(
        c,
        n,
        &format!("UPDATE templates SET kind = '{kind}' WHERE name = 'probe'"),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let query = format!(
        "SELECT t->>'kind' FROM pods, jsonb_array_elements(catalog) t
         WHERE pods.id = 'pod{n}' AND t->>'name' = 'probe'"
    );
    while c.sql(&query) != kind {
        assert!(
            Instant::now() < deadline,
            "pod{n}'s catalog still lists {}",
            c.sql(&query)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn cluster_serves_e2b_and_envd_on_any_replica() {
    let c = Cluster::up("e2b");
    let (one, two) = (with_e2b_listener(&c, 1), with_e2b_listener(&c, 2));
    let (key, _) = tenant_token(&c, 1, "e2b-a");
    let (other, _) = tenant_token(&c, 2, "e2b-b");

    // Created through replica 1's E2B listener: placed on a pod by the
    // work queue, its envd token issued.
    let body =
        r#"{"templateID":"probe","timeout":300,"metadata":{"run":"e2b"},"envVars":{"A":"b"}}"#;
    let created = expect(
        e2b(&one, &key, "POST", "/v2/sandboxes", &[], Some(body)),
        201,
        "create",
    );
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let token = created["envdAccessToken"].as_str().unwrap().to_string();
    let pod = created["clientID"].as_str().unwrap().to_string();
    assert!(pod.starts_with("pod"), "{created}");
    assert_eq!(created["alias"], "probe", "{created}");
    assert_eq!(
        c.sql(&format!(
            "SELECT kind, status, pod FROM operations WHERE sandbox = '{id}' AND kind = 'create'"
        )),
        format!("create|done|{pod}")
    );
    // Its secrets are in PostgreSQL, for every replica.
    assert_eq!(
        c.sql(&format!(
            "SELECT access_token, env->>'A' FROM sandbox_secrets WHERE sandbox = '{id}'"
        )),
        format!("{token}|b")
    );

    // Read through replica 2, by its tenant only.
    let path = format!("/sandboxes/{id}");
    let got = expect(e2b(&two, &key, "GET", &path, &[], None), 200, "get");
    assert_eq!(got["state"], "running", "{got}");
    assert_eq!(got["metadata"]["run"], "e2b", "{got}");
    assert_eq!(got["alias"], "probe", "{got}");
    assert!(got.get("envdAccessToken").is_none(), "{got}");
    expect(
        e2b(&two, &other, "GET", &path, &[], None),
        404,
        "another tenant",
    );
    let listed = expect(
        e2b(
            &two,
            &key,
            "GET",
            "/v2/sandboxes?metadata=run%3De2b",
            &[],
            None,
        ),
        200,
        "list",
    );
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["sandboxID"], id.as_str(), "{listed}");
    let theirs = expect(
        e2b(&one, &other, "GET", "/v2/sandboxes", &[], None),
        200,
        "list of another tenant",
    );
    assert_eq!(theirs, serde_json::json!([]));

    // The timeout, set through replica 1 on the pod, read through replica 2.
    let timeout = format!("{path}/timeout");
    expect(
        e2b(&one, &key, "POST", &timeout, &[], Some(r#"{"timeout":30}"#)),
        204,
        "timeout",
    );
    let end = expect(e2b(&two, &key, "GET", &path, &[], None), 200, "get");
    let end_at = torpor_api::e2b::time::parse(end["endAt"].as_str().unwrap()).unwrap();
    let left = end_at.0 - torpor_scheduler::model::Timestamp::now().0;
    assert!((20_000..=31_000).contains(&left), "{left} ms left: {end}");
    expect(
        e2b(
            &two,
            &key,
            "POST",
            &timeout,
            &[],
            Some(r#"{"timeout":300}"#),
        ),
        204,
        "timeout",
    );

    // Pause (hibernation, an operation on the pod) through replica 1; read
    // paused and refused again through replica 2; connect through replica
    // 2 wakes it and shows the envd token made through replica 1.
    expect(
        e2b(&one, &key, "POST", &format!("{path}/pause"), &[], None),
        204,
        "pause",
    );
    let got = expect(e2b(&two, &key, "GET", &path, &[], None), 200, "get");
    assert_eq!(got["state"], "paused", "{got}");
    expect(
        e2b(&two, &key, "POST", &format!("{path}/pause"), &[], None),
        409,
        "paused twice",
    );
    assert_eq!(
        c.sql(&format!(
            "SELECT status FROM operations WHERE sandbox = '{id}' AND kind = 'hibernate_marking'"
        )),
        "done"
    );
    let connect = format!("{path}/connect");
    let woken = expect(
        e2b(
            &two,
            &key,
            "POST",
            &connect,
            &[],
            Some(r#"{"timeout":300}"#),
        ),
        201,
        "connect",
    );
    assert_eq!(woken["envdAccessToken"], token.as_str(), "{woken}");
    let again = expect(
        e2b(
            &one,
            &key,
            "POST",
            &connect,
            &[],
            Some(r#"{"timeout":300}"#),
        ),
        200,
        "connect to a running sandbox",
    );
    assert_eq!(again["envdAccessToken"], token.as_str(), "{again}");
    expect(
        e2b(&one, &other, "POST", &connect, &[], Some("{}")),
        404,
        "another tenant",
    );
    // Its metrics, the history its pod keeps (PostgreSQL's row has none):
    // a read of the running sandbox samples it now if it had no sample
    // for a while.
    let metrics = expect(
        e2b(&one, &key, "GET", &format!("{path}/metrics"), &[], None),
        200,
        "metrics",
    );
    let newest = metrics.as_array().unwrap().last().unwrap();
    assert!(newest["memUsed"].as_u64().unwrap() > 0, "{metrics}");
    let ms = torpor_scheduler::model::Timestamp::now().0;
    let recent = expect(
        e2b(
            &one,
            &key,
            "GET",
            &format!(
                "{path}/metrics?start={}&end={}",
                ms / 1000 - 60,
                ms / 1000 + 1
            ),
            &[],
            None,
        ),
        200,
        "metrics over the last minute",
    );
    assert!(!recent.as_array().unwrap().is_empty(), "{recent}");
    expect(
        e2b(&one, &other, "GET", &format!("{path}/metrics"), &[], None),
        404,
        "another tenant's metrics",
    );

    // envd through replica 2 on the sandbox made through replica 1: its
    // token checked there; the probe has no agent (its pod's catalog
    // says), refused as embedded serve refuses it, without a wake.
    let health = request_with(&two, "GET", "/health", &envd_headers(&id, &token), None);
    assert_eq!(health.status, 204, "{}", health.body);
    let stat = "/filesystem.Filesystem/Stat";
    let json = ("Content-Type", "application/json");
    let [sbx, _] = envd_headers(&id, &token);
    let wrong = [sbx, ("X-Access-Token", "not-the-token"), json];
    let r = request_with(&two, "POST", stat, &wrong, Some(r#"{"path":"/"}"#));
    assert_eq!(r.status, 401, "{}", r.body);
    let [sbx, tok] = envd_headers(&id, &token);
    let r = request_with(
        &two,
        "POST",
        stat,
        &[sbx, tok, json],
        Some(r#"{"path":"/"}"#),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["code"], "failed_precondition", "{}", r.body);
    assert!(r.body.contains("agent"), "{}", r.body);
    let r = e2b(
        &two,
        &other,
        "POST",
        stat,
        &[sbx, json],
        Some(r#"{"path":"/"}"#),
    );
    assert_eq!(r.status, 404, "another tenant's key: {}", r.body);

    // A fork through replica 2 (on the source's pod), its own token.
    let forked = expect(
        e2b(
            &two,
            &key,
            "POST",
            &format!("{path}/fork"),
            &[],
            Some(r#"{"count":1}"#),
        ),
        201,
        "fork",
    );
    let fork = &forked[0]["sandbox"];
    let fork_id = fork["sandboxID"]
        .as_str()
        .unwrap_or_else(|| panic!("{forked}"));
    let fork_token = fork["envdAccessToken"].as_str().unwrap();
    assert_ne!(fork_token, token);
    assert_eq!(fork["clientID"], pod.as_str(), "{forked}");
    assert_eq!(
        c.sql(&format!(
            "SELECT env->>'A' FROM sandbox_secrets WHERE sandbox = '{fork_id}'"
        )),
        "b",
        "a fork keeps its source's environment"
    );

    // A snapshot through replica 2, made on the sandbox's pod: listed
    // through replica 1, a create from it placed there.
    let snap = expect(
        e2b(
            &two,
            &key,
            "POST",
            &format!("{path}/snapshots"),
            &[],
            Some("{}"),
        ),
        201,
        "snapshot",
    );
    let snap_id = snap["snapshotID"]
        .as_str()
        .unwrap_or_else(|| panic!("{snap}"));
    let listed = expect(
        e2b(
            &one,
            &key,
            "GET",
            &format!("/snapshots?sandboxID={id}"),
            &[],
            None,
        ),
        200,
        "snapshots",
    );
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["snapshotID"], snap_id, "{listed}");
    let body = format!(r#"{{"templateID":"{snap_id}","timeout":60}}"#);
    let restored = expect(
        e2b(&one, &key, "POST", "/v2/sandboxes", &[], Some(&body)),
        201,
        "a create from the snapshot",
    );
    assert_eq!(restored["clientID"], pod.as_str(), "{restored}");
    assert_eq!(restored["templateID"], snap_id, "{restored}");
    let restored_path = format!("/sandboxes/{}", restored["sandboxID"].as_str().unwrap());
    expect(
        e2b(&two, &key, "DELETE", &restored_path, &[], None),
        204,
        "kill",
    );

    // The real agent in the fork's place on its pod: the pod's store says
    // its template is Linux, the stand-in serves its vsock socket; envd
    // through replica 1 writes, stats, reads and runs there.
    let pod_n = pod_number(&pod);
    let standin = tempfile::tempdir().unwrap();
    let vsock = torpor_agent::standin::start(standin.path(), |_| {}).unwrap();
    let sandbox_dir = c.dir.join(format!("pod{pod_n}/data/sandboxes/{fork_id}"));
    std::fs::rename(&vsock, sandbox_dir.join("vsock.sock")).unwrap();
    set_probe_kind(&c, pod_n, "linux");
    let file = standin.path().join("written.txt");
    let file = file.to_str().unwrap();
    let [sbx, tok] = envd_headers(fork_id, fork_token);
    let octets = ("Content-Type", "application/octet-stream");
    let r = request_with(
        &one,
        "POST",
        &format!("/files?path={file}"),
        &[sbx, tok, octets],
        Some("through the tunnel"),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        std::fs::read_to_string(file).unwrap(),
        "through the tunnel",
        "written by the agent"
    );
    let r = request_with(
        &two,
        "GET",
        &format!("/files?path={file}"),
        &[sbx, tok],
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body, "through the tunnel");
    let body = format!(r#"{{"path":"{file}"}}"#);
    let r = request_with(&one, "POST", stat, &[sbx, tok, json], Some(&body));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["entry"]["name"], "written.txt", "{}", r.body);
    // The source's token is not the fork's.
    let [_, source_tok] = envd_headers(&id, &token);
    let r = request_with(&one, "POST", stat, &[sbx, source_tok, json], Some(&body));
    assert_eq!(r.status, 401, "{}", r.body);
    set_probe_kind(&c, pod_n, "probe");

    // The tenant's quota, in PostgreSQL, holds on the E2B routes.
    c.set_quota(1, "e2b-a", r#"{"total_sandboxes":2}"#);
    let r = e2b(
        &two,
        &key,
        "POST",
        "/v2/sandboxes",
        &[],
        Some(r#"{"templateID":"probe"}"#),
    );
    assert_eq!(r.status, 429, "{}", r.body);

    // Killed through replica 1: gone through replica 2.
    let fork_path = format!("/sandboxes/{fork_id}");
    expect(
        e2b(&one, &key, "DELETE", &fork_path, &[], None),
        204,
        "kill",
    );
    expect(e2b(&two, &key, "GET", &fork_path, &[], None), 404, "killed");
    expect(
        e2b(&two, &key, "DELETE", &fork_path, &[], None),
        404,
        "killed twice",
    );

    // Its pod down: its sandbox's routes and envd answer 503 until it is
    // back.
    c.kill(&format!("pod{pod_n}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = e2b(&two, &key, "GET", &path, &[], None);
        if r.status == 503 {
            break;
        }
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(Instant::now() < deadline, "the pod is still up");
        std::thread::sleep(Duration::from_millis(200));
    }
    let r = request_with(
        &one,
        "POST",
        stat,
        &[sbx, tok, json],
        Some(r#"{"path":"/"}"#),
    );
    let [sbx, tok] = envd_headers(&id, &token);
    let r2 = request_with(
        &one,
        "POST",
        stat,
        &[sbx, tok, json],
        Some(r#"{"path":"/"}"#),
    );
    assert_eq!(r.status, 404, "the killed fork: {}", r.body);
    assert_eq!(r2.status, 503, "{}", r2.body);
    assert_eq!(r2.json()["code"], "unavailable", "{}", r2.body);
    expect(
        e2b(&one, &key, "POST", &timeout, &[], Some(r#"{"timeout":60}"#)),
        503,
        "timeout",
    );
    c.start(&format!("pod{pod_n}"));
    c.wait_pods(2);
    expect(e2b(&one, &key, "DELETE", &path, &[], None), 204, "kill");
    expect(e2b(&two, &key, "GET", &path, &[], None), 404, "killed");
}

/// The official SDKs' control-plane scripts (`tests/e2b_sdk.rs` runs them
/// against embedded serve), Python's through one replica's E2B listener
/// and JS's through the other's: create,
/// get_info, timeouts, metrics, list with a metadata filter and paging,
/// pause → 409 → connect, a snapshot and a create from it, its deletion,
/// fork with a count, kill, and the SDK's errors. Needs the e2b venv and
/// npm e2b too (tests/needs).
#[test]
fn sdk_control_planes_on_a_cluster() {
    use common::e2b::{node_modules, python, run_script, Sdk};
    assert!(
        python().exists(),
        "the e2b venv is missing ({}): run scripts/setup test",
        python().display()
    );
    assert!(
        node_modules().join("e2b/package.json").exists(),
        "npm e2b is missing ({}): run scripts/setup test",
        node_modules().display()
    );
    let c = Cluster::up("e2b-sdk");
    let addr = with_e2b_listener(&c, 1);
    run_script(
        Sdk::Python,
        "sdk_control.py",
        &[],
        &format!("http://{addr}"),
        &c.token,
        &[],
        Duration::from_secs(300),
    );
    // And the JS SDK's, through the other replica.
    let addr = with_e2b_listener(&c, 2);
    run_script(
        Sdk::Js,
        "sdk_control.mjs",
        &[],
        &format!("http://{addr}"),
        &c.token,
        &[],
        Duration::from_secs(300),
    );
}
