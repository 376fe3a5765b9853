//! The attack matrix against `torpor serve` on loopback (probe
//! templates), generated from the route tables of every surface: `/v1`
//! ([`torpor_api::ROUTES`]), E2B's control plane
//! ([`torpor_api::e2b::ROUTES`]), envd ([`rpc::METHODS`], `/files`,
//! `/health`) and guest ports (every way of naming one,
//! [`torpor_api::ports::ADDRESSING`]). Tenant `evil` aims every route that takes a sandbox id at
//! `acme`'s sandboxes (one running, one hibernated): each must answer
//! word for word what a sandbox that does not exist answers, and change
//! nothing (state, deadline, VMM, checkpoints, templates). Every list
//! shows evil nothing of acme's. A route naming an id that is not
//! declared to the gate fails here before any request is sent. It runs
//! against the local pod, the nested pod (attached without QEMU) and a
//! cluster. Then the
//! named attacks of issue 24 that the matrix does not reach by itself:
//! E2B's snapshot list (2), deleting another tenant's or a shared
//! template through E2B (3), snapshot-as-template past the snapshot-disk
//! quota (5), and envd's `/health` (10).

mod common;

use std::collections::BTreeMap;

use serde_json::{json, Value};
use torpor_api::e2b::envd::rpc;
use torpor_api::gate::{Admit, Gated};
use torpor_api::Route;

use common::http::{request, request_with, HttpResponse};
use common::serve::{DataDir, ServeProcess};

/// An id no sandbox has.
const MISSING: &str = "sbx_0123456789abcdef";

/// The API under attack: an embedded `torpor serve`, or a cluster's
/// replica (then another replica is where the tenants' tokens are made).
struct Serve {
    addr: String,
    admin: String,
    /// A new tenant's token, usable at `addr`.
    make_tenant: Box<dyn Fn(&str) -> String>,
    /// What keeps the API up (the serve process, the cluster).
    _keep: Box<dyn std::any::Any>,
}

/// Makes tenant tokens through `addr`'s `/v1/tokens` with `admin`.
fn tokens_of(addr: String, admin: String) -> Box<dyn Fn(&str) -> String> {
    Box::new(move |name| {
        let body = json!({ "tenant": name }).to_string();
        request(&addr, "POST", "/v1/tokens", Some(&admin), Some(&body))
            .ok_json("POST", "/v1/tokens")["token"]
            .as_str()
            .unwrap()
            .to_string()
    })
}

impl Serve {
    fn start(data: &std::path::Path) -> Self {
        let process = ServeProcess::start(data, &["--policy-interval-ms", "0"]);
        let admin = process.first_admin_token();
        let (addr, token) = (process.addr.clone(), admin.clone());
        Serve {
            addr: addr.clone(),
            admin,
            make_tenant: tokens_of(addr, token),
            _keep: Box::new(process),
        }
    }

    /// serve's API with a nested pod attached (no QEMU:
    /// `common::nested_pod`), its local pod full: every sandbox is the
    /// nested pod's, reached through serve's relay and typed calls.
    fn nested() -> Self {
        let rig = common::nested_pod::NestedRig::start("attack-nested", "matrix-admin-0123456789");
        rig.fill_local_pod();
        let (addr, token) = (rig.api.addr.clone(), rig.admin.clone());
        Serve {
            addr: addr.clone(),
            admin: token.clone(),
            make_tenant: tokens_of(addr, token),
            _keep: Box::new(rig),
        }
    }

    /// Replica 1 of a cluster of two replicas and two pods; tokens made
    /// through replica 2 (and seen by both).
    fn cluster(c: common::cluster::Cluster) -> Self {
        let c = std::rc::Rc::new(c);
        let maker = std::rc::Rc::clone(&c);
        Serve {
            addr: c.api(1),
            admin: c.token.trim().to_string(),
            make_tenant: Box::new(move |name| common::cluster::tenant_token(&maker, 2, name).0),
            _keep: Box::new(c),
        }
    }

    fn v1(&self, token: &str, method: &str, path: &str, body: Option<&Value>) -> HttpResponse {
        let body = body.map(Value::to_string);
        request(&self.addr, method, path, Some(token), body.as_deref())
    }

    fn e2b(&self, key: &str, method: &str, path: &str, body: Option<&Value>) -> HttpResponse {
        let body = body.map(Value::to_string);
        request_with(
            &self.addr,
            method,
            path,
            &[("X-API-KEY", key)],
            body.as_deref(),
        )
    }

    fn ok(&self, token: &str, method: &str, path: &str, body: Option<Value>) -> Value {
        self.v1(token, method, path, body.as_ref())
            .ok_json(method, path)
    }

    fn tenant(&self, name: &str) -> String {
        (self.make_tenant)(name)
    }

    /// A probe sandbox `key`'s tenant makes through E2B: its id and envd
    /// access token.
    fn e2b_sandbox(&self, key: &str) -> (String, String) {
        let made = self.e2b(
            key,
            "POST",
            "/sandboxes",
            Some(&json!({"templateID": "probe", "timeout": 600})),
        );
        assert_eq!(made.status, 201, "{}", made.body);
        let made = made.json();
        let field = |k: &str| made[k].as_str().unwrap().to_string();
        (field("sandboxID"), field("envdAccessToken"))
    }
}

/// What of a sandbox an attack must leave as it was (the admin's view).
fn fingerprint(s: &Serve, id: &str) -> Value {
    let v = s.ok(&s.admin, "GET", &format!("/v1/sandboxes/{id}"), None);
    let keys = [
        "state",
        "generation",
        "keep_alive_ms",
        "expires_at",
        "last_active_at",
        "vmm",
        "snapshot",
        "metadata",
        "on_timeout",
        "network",
    ];
    let mut out = BTreeMap::new();
    for k in keys {
        out.insert(k, v.get(k).cloned().unwrap_or(Value::Null));
    }
    json!(out)
}

/// [`fingerprint`] once two reads a heartbeat and more apart agree: on a
/// cluster a sandbox's row follows its pod's heartbeats, so a change
/// acme made just before (its checkpoint moves the sandbox's `snapshot`)
/// may show only after a second.
fn settled_fingerprint(s: &Serve, id: &str) -> Value {
    let mut last = fingerprint(s, id);
    for _ in 0..10 {
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let now = fingerprint(s, id);
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("sandbox {id} never settled: {last}");
}

/// A body that would do something on the route if it were let through.
fn body_for(operation: &str) -> Option<Value> {
    Some(match operation {
        "updateSandbox" => json!({"keep_alive_ms": 1}),
        "createCheckpoint" => json!({"name": "stolen"}),
        "restoreSandbox" => json!({"checkpoint": "cp1"}),
        "forkSandbox" | "e2bForkSandbox" => json!({}),
        "templateFromSandbox" => json!({"name": "stolen"}),
        "execSandbox" | "execSandboxStream" => json!({"argv": ["true"]}),
        "writeFile" => json!("x"),
        "updateSandboxNetwork" => json!({"allow_internet": true}),
        "exposePort" => json!({"guest_port": 80}),
        "e2bConnectSandbox" | "e2bConnectSandboxV2" | "e2bResumeSandbox" => {
            json!({"timeout": 3600})
        }
        "e2bSetTimeout" => json!({"timeout": 3600}),
        "e2bRefreshSandbox" => json!({"duration": 3600}),
        "e2bUpdateNetwork" => json!({"allowInternetAccess": true}),
        "e2bCreateSnapshot" => json!({"name": "stolen"}),
        _ => return None,
    })
}

/// The path of `route` on sandbox `id`, its other parameters filled in.
fn path_of(route: &Route, id: &str) -> String {
    let mut p = route
        .path
        .replace("{id}", id)
        .replace("{name}", "cp1")
        .replace("{guest_port}", "80");
    if matches!(route.operation, "readFile" | "writeFile" | "listFiles") {
        p.push_str("?path=/etc/hostname");
    }
    p
}

/// Every route whose path names something by `{id}` either reaches a
/// sandbox through the gate or is one of these (not a sandbox's id:
/// templates, tokens, pods, operations, each checked by its own rule).
const NOT_SANDBOX_IDS: &[&str] = &[
    "getTemplate",
    "deleteTemplate",
    "getPod",
    "updatePod",
    "deleteToken",
    "getOperation",
    "e2bDeleteTemplate",
    // Templates by the resolver; builds (and their files) are the
    // tenant's own in the build registry (api/tests/http_builds.rs).
    "renameTemplate",
    "getBuild",
    "cancelBuild",
    "e2bBuildFileLink",
    "e2bBuildFileUpload",
    "e2bStartBuild",
    "e2bBuildStatus",
    "e2bTemplateTags",
    "e2bUpdateTemplate",
    // Volumes: the key's tenant's own in the volume registry; their
    // content by the volume's token (tests/e2b_volumes.rs).
    "e2bGetVolume",
    "e2bDeleteVolume",
    "e2bVolumeContentListDir",
    "e2bVolumeContentMakeDir",
    "e2bVolumeContentReadFile",
    "e2bVolumeContentWriteFile",
    "e2bVolumeContentGetPath",
    "e2bVolumeContentPatchPath",
    "e2bVolumeContentDeletePath",
    // Secrets: the caller's tenant's own in the secrets store
    // (tests/e2b_secrets.rs).
    "e2bGetSecret",
    "e2bUpdateSecret",
    "e2bDeleteSecret",
];

fn gated(routes: &[Route]) -> Vec<(Route, Admit)> {
    let mut out = Vec::new();
    for r in routes {
        match r.gate {
            Gated::Sandbox(cost) => {
                assert!(r.path.contains("{id}"), "{} gated without an id", r.path);
                out.push((*r, cost));
            }
            Gated::No => assert!(
                !r.path.contains("{id}") || NOT_SANDBOX_IDS.contains(&r.operation),
                "{} {} names an {{id}} but is not declared to the gate",
                r.method,
                r.path
            ),
        }
    }
    out
}

/// `r`'s body with `id` written as `ID`.
fn shape(r: &HttpResponse, id: &str) -> String {
    r.body.replace(id, "ID")
}

#[test]
fn every_route_of_every_surface_hides_another_tenants_sandbox() {
    let data = DataDir::new("attack-matrix");
    matrix(&Serve::start(&data.0), "local pod");
}

/// The matrix on the nested pod: every sandbox of acme's is on it. (Its
/// name avoids `nested_`, which `TORPOR_SKIP_NESTED=1` leaves out: no
/// QEMU here.)
#[test]
fn attached_pod_every_route_hides_another_tenants_sandbox() {
    let pods = matrix(&Serve::nested(), "nested pod");
    assert!(pods.iter().all(|p| p != "pod_local"), "on {pods:?}");
}

/// The matrix on a cluster: replicas answer from PostgreSQL, commands go
/// through the pods' work queues, the data plane is relayed to the pods.
#[test]
fn cluster_every_route_hides_another_tenants_sandbox() {
    let c = common::cluster::Cluster::up("attack-matrix");
    matrix(&Serve::cluster(c), "cluster");
}

/// Runs the matrix (see the module documentation) against `s`; the pods
/// acme's sandboxes were on.
fn matrix(s: &Serve, label: &str) -> Vec<String> {
    let acme = s.tenant("acme");
    let evil = s.tenant("evil");

    // acme's: a running sandbox made through E2B (it has an envd token),
    // one hibernated, a checkpoint and a snapshot of its own.
    let (running, envd_token) = s.e2b_sandbox(&acme);
    let sleeping = s.ok(
        &acme,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "probe"})),
    )["id"]
        .as_str()
        .unwrap()
        .to_string();
    s.ok(
        &acme,
        "POST",
        &format!("/v1/sandboxes/{running}/checkpoints"),
        Some(json!({"name": "cp1"})),
    );
    s.ok(
        &acme,
        "POST",
        &format!("/v1/sandboxes/{sleeping}/hibernate"),
        None,
    );
    let snapshot = s.e2b(
        &acme,
        "POST",
        &format!("/sandboxes/{running}/snapshots"),
        Some(&json!({})),
    );
    assert_eq!(snapshot.status, 201, "{}", snapshot.body);
    let snapshot_id = snapshot.json()["snapshotID"].as_str().unwrap().to_string();
    let templates_before = s.ok(&s.admin, "GET", "/v1/templates", None);
    let before: Vec<Value> = [&running, &sleeping]
        .iter()
        .map(|id| settled_fingerprint(s, id))
        .collect();
    let checkpoints_before = s.ok(
        &acme,
        "GET",
        &format!("/v1/sandboxes/{running}/checkpoints"),
        None,
    );

    let v1 = gated(torpor_api::ROUTES);
    let e2b = gated(torpor_api::e2b::ROUTES);
    let mut attacks = 0;
    let mut failures = Vec::new();
    for (surface, routes) in [("v1", &v1), ("e2b", &e2b)] {
        for (route, _) in routes.iter() {
            if route.admin {
                continue; // 403 for every tenant, before the gate.
            }
            let body = body_for(route.operation);
            let send = |id: &str| {
                let path = path_of(route, id);
                if surface == "v1" {
                    s.v1(&evil, route.method, &path, body.as_ref())
                } else {
                    s.e2b(&evil, route.method, &path, body.as_ref())
                }
            };
            let absent = send(MISSING);
            for target in [&running, &sleeping] {
                attacks += 1;
                let r = send(target);
                if r.status != 404 || shape(&r, target) != shape(&absent, MISSING) {
                    failures.push(format!(
                        "{surface} {} {} on acme's {target}: {} {} (a missing id: {} {})",
                        route.method, route.path, r.status, r.body, absent.status, absent.body
                    ));
                }
                if r.body.contains(&envd_token) {
                    failures.push(format!("{} leaked acme's envd token", route.path));
                }
            }
        }
    }

    // envd: every method, /files and /health, with evil's key on acme's
    // running sandbox, answer as for a sandbox that does not exist.
    let envd = |id: &str, method: &str, path: &str, body: Option<&str>, ct: &str| {
        request_with(
            &s.addr,
            method,
            path,
            &[
                ("E2b-Sandbox-Id", id),
                ("X-API-KEY", evil.as_str()),
                ("Content-Type", ct),
                ("Connect-Protocol-Version", "1"),
            ],
            body,
        )
    };
    let mut envd_routes: Vec<(String, String, Option<String>, String)> = rpc::METHODS
        .iter()
        .map(|(service, method, kind)| {
            let ct = match kind {
                rpc::Kind::Unary => "application/json",
                rpc::Kind::ServerStream | rpc::Kind::ClientStream => "application/connect+json",
            };
            let body = match kind {
                rpc::Kind::Unary => "{}".to_string(),
                rpc::Kind::ServerStream | rpc::Kind::ClientStream => {
                    let msg =
                        br#"{"process":{"cmd":"true"},"path":"/","start":{"process":{"pid":1}}}"#;
                    let mut framed = vec![0u8];
                    framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
                    framed.extend_from_slice(msg);
                    String::from_utf8(framed).unwrap()
                }
            };
            (
                "POST".to_string(),
                format!("/{service}/{method}"),
                Some(body),
                ct.to_string(),
            )
        })
        .collect();
    envd_routes.push((
        "GET".into(),
        "/files?path=/etc/hostname".into(),
        None,
        "application/json".into(),
    ));
    envd_routes.push((
        "POST".into(),
        "/files?path=/tmp/x".into(),
        Some("x".into()),
        "application/octet-stream".into(),
    ));
    envd_routes.push((
        "GET".into(),
        "/health".into(),
        None,
        "application/json".into(),
    ));
    for (method, path, body, ct) in &envd_routes {
        let absent = envd(MISSING, method, path, body.as_deref(), ct);
        attacks += 1;
        let r = envd(&running, method, path, body.as_deref(), ct);
        if r.status != absent.status || shape(&r, &running) != shape(&absent, MISSING) {
            failures.push(format!(
                "envd {method} {path} on acme's: {} {} (a missing id: {} {})",
                r.status, r.body, absent.status, absent.body
            ));
        }
    }

    // Guest ports, every way of naming one (`ports::ADDRESSING`), with
    // evil's key on acme's running and hibernated sandboxes: as for a
    // sandbox that does not exist, and nothing woken (the fingerprints
    // below).
    let port = |way: torpor_api::ports::Addressing, id: &str| {
        let named = way.headers(id, 8000, "localhost");
        let mut headers: Vec<(&str, &str)> = named.iter().map(|(n, v)| (*n, v.as_str())).collect();
        headers.push(("X-API-KEY", evil.as_str()));
        request_with(&s.addr, "GET", "/", &headers, None)
    };
    for &way in torpor_api::ports::ADDRESSING {
        let absent = port(way, MISSING);
        for id in [&running, &sleeping] {
            attacks += 1;
            let r = port(way, id);
            if r.status != absent.status || shape(&r, id) != shape(&absent, MISSING) {
                failures.push(format!(
                    "guest port by {way:?} on acme's: {} {} (a missing id: {} {})",
                    r.status, r.body, absent.status, absent.body
                ));
            }
        }
    }

    // Lists: nothing of acme's.
    for (surface, path) in [
        ("v1", "/v1/sandboxes"),
        ("v1", "/v1/templates"),
        ("e2b", "/sandboxes"),
        ("e2b", "/v2/sandboxes"),
        ("e2b", "/v2/sandboxes?state=paused"),
        ("e2b", "/v2/sandboxes?order=asc&limit=1"),
        ("e2b", "/v2/sandboxes?metadata=k%3Dv&state=running"),
        ("e2b", "/snapshots"),
    ] {
        attacks += 1;
        let r = if surface == "v1" {
            s.v1(&evil, "GET", path, None)
        } else {
            s.e2b(&evil, "GET", path, None)
        };
        for secret in [&running, &sleeping, &snapshot_id] {
            if r.status != 200 || r.body.contains(secret.as_str()) {
                failures.push(format!("{surface} GET {path}: {} {}", r.status, r.body));
            }
        }
    }
    // E2B's running count: none of acme's counted for evil.
    attacks += 1;
    let r = s.e2b(&evil, "GET", "/v2/sandboxes", None);
    if r.header("x-total-running") != Some("0") {
        failures.push(format!(
            "e2b GET /v2/sandboxes: x-total-running {:?}",
            r.header("x-total-running")
        ));
    }
    // Metrics over a range (the routes' own rows above ask without one):
    // as for a sandbox that does not exist.
    for (surface, path) in [
        ("v1", "/v1/sandboxes/ID/metrics?from=0&to=9999999999999"),
        ("e2b", "/sandboxes/ID/metrics?start=0&end=9999999999"),
    ] {
        let send = |id: &str| {
            let path = path.replace("ID", id);
            if surface == "v1" {
                s.v1(&evil, "GET", &path, None)
            } else {
                s.e2b(&evil, "GET", &path, None)
            }
        };
        let absent = send(MISSING);
        for target in [&running, &sleeping] {
            attacks += 1;
            let r = send(target);
            if r.status != 404 || shape(&r, target) != shape(&absent, MISSING) {
                failures.push(format!(
                    "{surface} GET {path} on acme's {target}: {} {}",
                    r.status, r.body
                ));
            }
        }
    }
    // Templates by id: acme's snapshot is not there for evil.
    for (surface, method, path) in [
        ("v1", "GET", format!("/v1/templates/{snapshot_id}")),
        ("v1", "DELETE", format!("/v1/templates/{snapshot_id}")),
        ("e2b", "DELETE", format!("/templates/{snapshot_id}")),
    ] {
        attacks += 1;
        let r = if surface == "v1" {
            s.v1(&evil, method, &path, None)
        } else {
            s.e2b(&evil, method, &path, None)
        };
        if r.status != 404 {
            failures.push(format!(
                "{surface} {method} {path}: {} {}",
                r.status, r.body
            ));
        }
    }

    let after: Vec<Value> = [&running, &sleeping]
        .iter()
        .map(|id| fingerprint(s, id))
        .collect();
    assert_eq!(
        before, after,
        "acme's sandboxes changed under evil's attacks"
    );
    assert_eq!(before[1]["state"], "hibernated", "evil woke nothing");
    assert_eq!(
        s.ok(&s.admin, "GET", "/v1/templates", None),
        templates_before,
        "templates changed"
    );
    assert_eq!(
        s.ok(
            &acme,
            "GET",
            &format!("/v1/sandboxes/{running}/checkpoints"),
            None
        ),
        checkpoints_before
    );
    // Evil made nothing of its own either (no fork, no template).
    let mine = s.ok(&evil, "GET", "/v1/sandboxes", None);
    assert_eq!(mine["sandboxes"], json!([]), "{mine}");
    let routes = v1.len() + e2b.len() + envd_routes.len();
    let ways = torpor_api::ports::ADDRESSING.len();
    println!(
        "attack matrix: {attacks} attacks over {routes} routes (v1, E2B, envd) and {ways} \
         ways to a guest port, {label}"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // acme still reaches its own.
    let pods: Vec<String> = [&running, &sleeping]
        .iter()
        .map(|id| {
            s.ok(&s.admin, "GET", &format!("/v1/sandboxes/{id}"), None)["pod"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    let own = s.e2b(
        &acme,
        "POST",
        &format!("/v2/sandboxes/{running}/connect"),
        Some(&json!({"timeout": 600})),
    );
    assert_eq!(own.status, 200, "{}", own.body);
    // envd takes acme's own key for its own sandbox, wherever it runs.
    let health = request_with(
        &s.addr,
        "GET",
        "/health",
        &[
            ("E2b-Sandbox-Id", running.as_str()),
            ("X-API-KEY", acme.as_str()),
        ],
        None,
    );
    assert_eq!(health.status, 204, "{label}: {}", health.body);
    pods
}

#[test]
fn named_attacks_on_snapshots_templates_quotas_and_health() {
    let data = DataDir::new("attack-named");
    named(&Serve::start(&data.0));
}

/// The named attacks on a cluster (snapshot-as-template admitted there
/// too, its tenant's templates counted from the pods' catalogs).
#[test]
fn cluster_named_attacks_on_snapshots_templates_quotas_and_health() {
    let c = common::cluster::Cluster::up("attack-named");
    named(&Serve::cluster(c));
}

/// The named attacks of issue 24 the matrix does not reach by itself.
fn named(s: &Serve) {
    let acme = s.tenant("acme");
    let evil = s.tenant("evil");
    let (id, token) = s.e2b_sandbox(&acme);

    // 1: E2B's v2 connect with evil's key: 404, no token, no change.
    let before = fingerprint(s, &id);
    let r = s.e2b(
        &evil,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        Some(&json!({"timeout": 3600})),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(!r.body.contains(&token));
    assert_eq!(fingerprint(s, &id), before);

    // 2: GET /snapshots shows evil none of acme's.
    let snap = s.e2b(
        &acme,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        Some(&json!({})),
    );
    assert_eq!(snap.status, 201, "{}", snap.body);
    let snap_id = snap.json()["snapshotID"].as_str().unwrap().to_string();
    let mine = s.e2b(&acme, "GET", "/snapshots", None);
    assert!(mine.body.contains(&snap_id), "{}", mine.body);
    let theirs = s.e2b(&evil, "GET", "/snapshots", None);
    assert_eq!(theirs.status, 200, "{}", theirs.body);
    assert_eq!(theirs.json(), json!([]), "{}", theirs.body);
    let by_source = s.e2b(&evil, "GET", &format!("/snapshots?sandboxID={id}"), None);
    assert_eq!(by_source.json(), json!([]), "{}", by_source.body);

    // 3: E2B's DELETE /templates/{id}: another tenant's is 404 (by id or
    // name), a shared one 403, both kept; the owner's own goes.
    let name = snap.json()["names"][0].as_str().unwrap().to_string();
    for key in [&snap_id, &name] {
        let r = s.e2b(&evil, "DELETE", &format!("/templates/{key}"), None);
        assert_eq!(r.status, 404, "{key}: {}", r.body);
    }
    let r = s.e2b(&evil, "DELETE", "/templates/probe", None);
    assert_eq!(r.status, 403, "{}", r.body);
    let listed = s.ok(&s.admin, "GET", "/v1/templates", None).to_string();
    assert!(
        listed.contains(&snap_id) && listed.contains("\"probe\""),
        "{listed}"
    );

    // 5: snapshot-as-template is admitted against the snapshot-disk quota
    // (each template of the tenant's counts as its memory), through /v1
    // and E2B alike, and refused past it.
    let mem = s.ok(&acme, "GET", &format!("/v1/sandboxes/{id}"), None)["mem_mib"]
        .as_u64()
        .unwrap();
    let limit = 4 * mem;
    let quota = s.v1(
        &s.admin,
        "PUT",
        "/v1/tenants/acme/quota",
        Some(&json!({ "snapshot_disk_mib": limit })),
    );
    assert_eq!(quota.status, 200, "{}", quota.body);
    let mut made = 1; // the snapshot above
    let refused = loop {
        let r = if made % 2 == 0 {
            s.v1(
                &acme,
                "POST",
                &format!("/v1/sandboxes/{id}/template"),
                Some(&json!({})),
            )
        } else {
            s.e2b(
                &acme,
                "POST",
                &format!("/sandboxes/{id}/snapshots"),
                Some(&json!({})),
            )
        };
        if r.status == 429 {
            break r;
        }
        assert_eq!(r.status, 201, "{}", r.body);
        made += 1;
        assert!(
            made <= 4,
            "{made} templates of {mem} MiB made past {limit} MiB"
        );
    };
    assert!(
        refused.body.contains("snapshot_disk_mib"),
        "{}",
        refused.body
    );
    assert_eq!(made, 4, "exactly the quota's worth");
    // Both surfaces refuse past it, whichever reached it.
    let v1 = s.v1(
        &acme,
        "POST",
        &format!("/v1/sandboxes/{id}/template"),
        Some(&json!({})),
    );
    let e2b = s.e2b(
        &acme,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        Some(&json!({})),
    );
    assert_eq!(
        (v1.status, e2b.status),
        (429, 429),
        "{} / {}",
        v1.body,
        e2b.body
    );

    // 10: envd's /health tells a caller that may not use the sandbox
    // nothing: as for an unknown id (502); the owner's token sees it run.
    let health = |headers: &[(&str, &str)]| request_with(&s.addr, "GET", "/health", headers, None);
    assert_eq!(
        health(&[("E2b-Sandbox-Id", &id), ("X-Access-Token", &token)]).status,
        204
    );
    assert_eq!(
        health(&[("E2b-Sandbox-Id", &id), ("X-API-KEY", &acme)]).status,
        204
    );
    let unknown = health(&[("E2b-Sandbox-Id", MISSING)]);
    assert_eq!(unknown.status, 502);
    for headers in [
        vec![("E2b-Sandbox-Id", id.as_str())],
        vec![
            ("E2b-Sandbox-Id", id.as_str()),
            ("X-API-KEY", evil.as_str()),
        ],
        vec![("E2b-Sandbox-Id", id.as_str()), ("X-Access-Token", "wrong")],
    ] {
        let r = health(&headers);
        assert_eq!(
            (r.status, r.body.clone()),
            (unknown.status, unknown.body.clone())
        );
    }

    // 11: evil cannot mount acme's volume: by its name (E2B and /v1) it is
    // not there (404); by its id, a tenant may not name one (403). A
    // cluster keeps no volumes (503): the attempts are refused the same.
    let vol = s.e2b(
        &acme,
        "POST",
        "/volumes",
        Some(&json!({"name": "acme-data"})),
    );
    let vol_id = match vol.status {
        201 => vol.json()["volumeID"].as_str().unwrap().to_string(),
        status => {
            assert_eq!(status, 503, "{}", vol.body);
            "vol_000000000000000000000000".to_string()
        }
    };
    let mount = json!([{"name": "acme-data", "path": "/mnt/d"}]);
    let r = s.e2b(
        &evil,
        "POST",
        "/sandboxes",
        Some(&json!({"templateID": "probe", "volumeMounts": mount})),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    let r = s.v1(
        &evil,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"template": "probe", "volume_mounts": mount})),
    );
    assert_eq!(r.status, 404, "{}", r.body);
    let r = s.v1(
        &evil,
        "POST",
        "/v1/sandboxes",
        Some(&json!({"template": "probe", "volume_mounts":
            [{"name": "acme-data", "path": "/mnt/d", "id": vol_id}]})),
    );
    assert_eq!(r.status, 403, "{}", r.body);
}
