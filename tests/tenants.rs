//! Tenants, scopes, images and abuse limits against `torpor serve` on
//! loopback (probe templates): attacks that must fail. A first start's
//! admin token, tenant tokens, another tenant's sandbox (404 for every
//! route, and unchanged), admin-only routes (403), templates naming host
//! paths or `..` (400), a symlink out of the images directory (404, as a
//! missing image), 200
//! parallel creates past a quota (exactly the quota admitted, the rest
//! 429) and pagination. (A rogue pod and a 64 MiB chunked body to a
//! relayed route: `api/tests/rogue_pod.rs`.)

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use common::http::{request, request_with, HttpResponse};
use common::serve::{DataDir, ServeProcess};

/// The service under test and its admin token.
struct Serve {
    process: ServeProcess,
    admin: String,
}

impl Serve {
    /// A first start (no `--token`): the admin token is read from what
    /// `serve` printed.
    fn first_start(data: &Path) -> Self {
        Self::first_start_with(data, &[])
    }

    /// [`Serve::first_start`] with more `serve` arguments.
    fn first_start_with(data: &Path, args: &[&str]) -> Self {
        let args: Vec<&str> = ["--policy-interval-ms", "0"]
            .iter()
            .chain(args)
            .copied()
            .collect();
        let process = ServeProcess::start(data, &args);
        let admin = process.first_admin_token();
        Serve { process, admin }
    }

    fn call(&self, token: &str, method: &str, path: &str, body: Option<Value>) -> HttpResponse {
        let body = body.map(|b| b.to_string());
        request(
            &self.process.addr,
            method,
            path,
            Some(token),
            body.as_deref(),
        )
    }

    fn ok(&self, token: &str, method: &str, path: &str, body: Option<Value>) -> Value {
        self.call(token, method, path, body).ok_json(method, path)
    }

    /// A new probe sandbox of `token`'s: its JSON.
    fn create_probe(&self, token: &str) -> Value {
        self.ok(
            token,
            "POST",
            "/v1/sandboxes",
            Some(json!({"template": "probe"})),
        )
    }

    /// A new tenant token.
    fn tenant(&self, name: &str) -> String {
        let v = self.ok(
            &self.admin,
            "POST",
            "/v1/tokens",
            Some(json!({"tenant": name})),
        );
        assert_eq!(
            (v["tenant"].as_str(), v["scope"].as_str()),
            (Some(name), Some("tenant"))
        );
        v["token"].as_str().unwrap().to_string()
    }
}

fn code(r: &HttpResponse) -> String {
    r.json()["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn ids(list: &Value) -> Vec<String> {
    list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn tenants_see_only_their_own_and_cannot_reach_host_paths() {
    let data = DataDir::new("tenants");
    let s = Serve::first_start(&data.0);
    // Stored hashed: the token is nowhere in the data directory's files.
    let stored = std::fs::read_to_string(data.0.join("tenants.json")).unwrap();
    assert!(!stored.contains(&s.admin), "{stored}");
    assert!(stored.contains("\"admin\""), "{stored}");
    let a = s.tenant("acme");
    let b = s.tenant("bravo");
    assert!(!std::fs::read_to_string(data.0.join("tenants.json"))
        .unwrap()
        .contains(&a));
    assert_eq!(
        s.call("wrong-token", "GET", "/v1/sandboxes", None).status,
        401
    );

    let sa = s.create_probe(&a);
    let id = sa["id"].as_str().unwrap().to_string();
    assert_eq!(sa["tenant"], "acme");
    // No host paths or pids in a tenant's answers; the admin sees them.
    assert!(
        sa.get("vmm").is_none() && sa.get("snapshot").is_none(),
        "{sa}"
    );
    let mine = s.ok(&a, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert!(mine.get("vmm").is_none(), "{mine}");
    let seen = s.ok(&s.admin, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert!(seen["vmm"]["pid"].as_u64().is_some(), "{seen}");
    let tpl = s.ok(&a, "GET", "/v1/templates", None);
    assert!(tpl["templates"][0].get("snapshot_dir").is_none(), "{tpl}");
    assert!(
        !tpl.to_string().contains(&data.0.display().to_string()),
        "{tpl}"
    );

    // Tenant B: A's sandbox is not there, whatever the route.
    assert!(ids(&s.ok(&b, "GET", "/v1/sandboxes", None)).is_empty());
    let probes: [(&str, String, Option<Value>); 9] = [
        ("GET", format!("/v1/sandboxes/{id}"), None),
        (
            "POST",
            format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": ["true"]})),
        ),
        (
            "POST",
            format!("/v1/sandboxes/{id}/checkpoints"),
            Some(json!({"name": "b"})),
        ),
        ("GET", format!("/v1/sandboxes/{id}/checkpoints"), None),
        ("POST", format!("/v1/sandboxes/{id}/fork"), Some(json!({}))),
        ("POST", format!("/v1/sandboxes/{id}/pause"), None),
        (
            "PATCH",
            format!("/v1/sandboxes/{id}"),
            Some(json!({"keep_alive_ms": 1})),
        ),
        (
            "GET",
            format!("/v1/sandboxes/{id}/files?path=/etc/hostname"),
            None,
        ),
        ("DELETE", format!("/v1/sandboxes/{id}"), None),
    ];
    let missing = s.call(&b, "GET", "/v1/sandboxes/sbx_0123456789abcdef", None);
    assert_eq!(missing.status, 404);
    for (method, path, body) in probes {
        let r = s.call(&b, method, &path, body);
        assert_eq!(r.status, 404, "B {method} {path}: {}", r.body);
        assert_eq!(code(&r), "not_found", "{}", r.body);
        // Word for word what a sandbox that does not exist answers.
        let template = r.body.replace(&id, "ID");
        let absent = missing.body.replace("sbx_0123456789abcdef", "ID");
        assert_eq!(template, absent);
    }
    let after = s.ok(&s.admin, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(after["state"], "running");
    assert_eq!(
        after["generation"], seen["generation"],
        "A's sandbox unchanged"
    );
    assert_eq!(after["vmm"]["pid"], seen["vmm"]["pid"]);
    assert!(
        s.ok(&a, "GET", &format!("/v1/sandboxes/{id}/checkpoints"), None)["checkpoints"]
            .as_array()
            .unwrap()
            .is_empty()
    );

    // Admin-only routes: 403 for a tenant, before anything is done.
    for (method, path, body) in [
        (
            "PATCH",
            "/v1/pods/pod_local",
            Some(json!({"oversubscription_ratio": 100.0})),
        ),
        ("GET", "/v1/pods", None),
        ("GET", "/metrics", None),
        (
            "POST",
            "/v1/tokens",
            Some(json!({"tenant": "bravo", "scope": "admin"})),
        ),
        ("GET", "/v1/tokens", None),
        ("PUT", "/v1/tenants/bravo/quota", Some(json!({}))),
        ("DELETE", "/v1/images/x", None),
    ] {
        let r = s.call(&b, method, path, body);
        assert_eq!(r.status, 403, "B {method} {path}: {}", r.body);
        assert_eq!(code(&r), "forbidden");
    }
    let pods = s.ok(&s.admin, "GET", "/v1/pods", None);
    assert_ne!(pods["pods"][0]["oversubscription_ratio"], 100.0, "{pods}");
    let put = request(
        &s.process.addr,
        "PUT",
        "/v1/images/evil/kernel",
        Some(&b),
        Some("not a kernel"),
    );
    assert_eq!(put.status, 403, "{}", put.body);
    assert!(!data.0.join("images/evil").exists());
    // A tenant reads its own quota and use, not another's.
    let own = s.ok(&b, "GET", "/v1/tenants/bravo", None);
    assert_eq!(own["usage"]["total_sandboxes"], 0, "{own}");
    assert_eq!(s.call(&b, "GET", "/v1/tenants/acme", None).status, 404);

    // Templates never name host paths: these are refused (400; a plain
    // name that is no usable image, symlinks included, 404 as a missing
    // one) for the admin as for a tenant, and what they name is never
    // opened.
    let images = data.0.join("images");
    let other = data.0.join("sandboxes").join(&id);
    let evil = images.join("evil");
    std::fs::create_dir_all(&evil).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", evil.join("vmlinux")).unwrap();
    std::os::unix::fs::symlink(&other, evil.join("rootfs.ext4")).unwrap();
    std::os::unix::fs::symlink(&other, images.join("overlay")).unwrap();
    let absent = s.call(
        &s.admin,
        "POST",
        "/v1/templates",
        Some(json!({"name": "x", "kind": "linux", "image": "absent", "mem_mib": 256})),
    );
    assert_eq!(absent.status, 404, "{}", absent.body);
    for token in [&s.admin, &a] {
        for body in [
            json!({"name": "x", "kind": "linux", "kernel": "/etc/shadow", "rootfs": "/etc/shadow"}),
            json!({"name": "x", "kind": "linux", "image": "/etc/shadow"}),
            json!({"name": "x", "kind": "linux", "image": "../sandboxes"}),
            json!({"name": "x", "kind": "linux", "image": ".."}),
            json!({"name": "x", "kind": "linux", "image": format!("../sandboxes/{id}")}),
            json!({"name": "x", "kind": "linux", "image": "evil", "mem_mib": 256}),
            json!({"name": "x", "kind": "linux", "image": "overlay", "mem_mib": 256}),
        ] {
            let r = s.call(token, "POST", "/v1/templates", Some(body.clone()));
            let plain = body["image"] == "evil" || body["image"] == "overlay";
            assert_eq!(
                r.status,
                if plain { 404 } else { 400 },
                "{body}: {}",
                r.body
            );
            assert!(
                !r.body.contains("/etc") && !r.body.contains(&data.0.display().to_string()),
                "{body}: {}",
                r.body
            );
            if body["image"] == "evil" || body["image"] == "overlay" {
                // A symlink answers exactly as a missing image does.
                let name = body["image"].as_str().unwrap();
                assert_eq!(
                    r.body.replace(name, "N"),
                    absent.body.replace("absent", "N")
                );
            }
        }
    }
    assert!(s.ok(&s.admin, "GET", "/v1/templates", None)["templates"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["name"] != "x"));
    let listed = s.ok(&a, "GET", "/v1/images", None);
    assert_eq!(
        listed["images"],
        json!([]),
        "symlinked images are not images: {listed}"
    );

    // Pagination: one at a time, with the token in body and header.
    let second = s.create_probe(&a);
    let r = s.call(&a, "GET", "/v1/sandboxes?limit=1", None);
    let page1 = r.json();
    let next = page1["next"].as_str().expect("a next page").to_string();
    assert_eq!(r.header("x-next-token"), Some(next.as_str()));
    let page2 = s.ok(
        &a,
        "GET",
        &format!("/v1/sandboxes?limit=1&next={next}"),
        None,
    );
    assert!(page2.get("next").is_none(), "{page2}");
    let mut both = ids(&page1);
    both.extend(ids(&page2));
    assert_eq!(
        both,
        vec![id.clone(), second["id"].as_str().unwrap().to_string()]
    );
    assert_eq!(s.call(&a, "GET", "/v1/sandboxes?limit=0", None).status, 400);

    // Quotas: 200 parallel creates past `running_sandboxes` 3 (two run):
    // exactly one more admitted, every other one 429.
    let q = s.ok(
        &s.admin,
        "PUT",
        "/v1/tenants/acme/quota",
        Some(json!({"running_sandboxes": 3})),
    );
    assert_eq!(q["usage"]["running_sandboxes"], 2, "{q}");
    let results: Vec<HttpResponse> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..200)
            .map(|_| {
                scope.spawn(|| {
                    s.call(
                        &a,
                        "POST",
                        "/v1/sandboxes",
                        Some(json!({"template": "probe"})),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut by_code: BTreeMap<String, usize> = BTreeMap::new();
    for r in &results {
        let key = if r.status == 201 {
            "created".to_string()
        } else {
            assert_eq!(r.status, 429, "{}", r.body);
            if code(r) == "rate_limited" {
                assert!(r
                    .header("retry-after")
                    .is_some_and(|v| v.parse::<u64>().unwrap() >= 1));
            } else {
                assert_eq!(code(r), "quota_exceeded", "{}", r.body);
                let e = &r.json()["error"];
                assert_eq!(
                    (e["quota"].as_str(), e["limit"].as_u64()),
                    (Some("running_sandboxes"), Some(3))
                );
            }
            code(r)
        };
        *by_code.entry(key).or_default() += 1;
    }
    assert_eq!(by_code.get("created"), Some(&1), "{by_code:?}");
    assert!(
        by_code.get("quota_exceeded").is_some_and(|n| *n > 0),
        "{by_code:?}"
    );
    assert_eq!(ids(&s.ok(&a, "GET", "/v1/sandboxes", None)).len(), 3);
    assert_eq!(
        ids(&s.ok(&s.admin, "GET", "/v1/sandboxes", None)).len(),
        3,
        "nothing else runs"
    );

    // A revoked token is refused.
    let tokens = s.ok(&s.admin, "GET", "/v1/tokens", None);
    assert!(!tokens.to_string().contains(&b), "tokens are never listed");
    let bravo = tokens["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"] == "bravo")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    s.ok(&s.admin, "DELETE", &format!("/v1/tokens/{bravo}"), None);
    assert_eq!(s.call(&b, "GET", "/v1/sandboxes", None).status, 401);

    // The admin token is printed on the first start only.
    drop(s);
    let again = ServeProcess::start(&data.0, &["--policy-interval-ms", "0"]);
    assert!(
        !again.banner.iter().any(|l| l.contains("admin token:")),
        "{:?}",
        again.banner
    );
}

/// Quotas hold on a wake too (a hibernated sandbox woken at the tenant's
/// running-sandboxes quota is 429 with the quota and the use, and stays
/// hibernated), and E2B's routes, on the API's listener and on one of
/// their own (`--e2b-listen`), share the API's tokens and quotas: a token
/// made through `/v1` after the start works there, and E2B's creates and
/// wakes are admitted like `/v1`'s.
#[test]
fn wakes_and_e2b_routes_are_admitted_against_the_same_quotas() {
    let data = DataDir::new("tenants-wake");
    let s = Serve::first_start_with(&data.0, &["--e2b-listen", "127.0.0.1:0"]);
    let e2b_addr = s
        .process
        .stdout_line("E2B API on http://")
        .expect("the E2B listener's address");
    let a = s.tenant("wake");
    let e2b = |addr: &str, method: &str, path: &str, body: Option<Value>| {
        let body = body.map(|b| b.to_string());
        request_with(addr, method, path, &[("X-API-KEY", &a)], body.as_deref())
    };
    let r = e2b(&e2b_addr, "GET", "/v2/sandboxes", None);
    assert_eq!(
        r.status, 200,
        "a token made after the start, on E2B's listener: {}",
        r.body
    );

    s.ok(
        &s.admin,
        "PUT",
        "/v1/tenants/wake/quota",
        Some(json!({"running_sandboxes": 1})),
    );
    let first = s.create_probe(&a)["id"].as_str().unwrap().to_string();
    s.ok(
        &a,
        "POST",
        &format!("/v1/sandboxes/{first}/hibernate"),
        None,
    );
    // The hibernated one holds no VM: a create on E2B's listener fits.
    let r = e2b(
        &e2b_addr,
        "POST",
        "/sandboxes",
        Some(json!({"templateID": "probe"})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let second = r.json()["sandboxID"].as_str().unwrap().to_string();

    // At the quota: every wake and create is refused, naming the quota.
    for path in ["connect", "resume"] {
        let r = s.call(&a, "POST", &format!("/v1/sandboxes/{first}/{path}"), None);
        assert_eq!(r.status, 429, "{path}: {}", r.body);
        assert_eq!(code(&r), "quota_exceeded", "{}", r.body);
        let e = &r.json()["error"];
        assert_eq!(
            (e["quota"].as_str(), e["limit"].as_u64(), e["used"].as_u64()),
            (Some("running_sandboxes"), Some(1), Some(1)),
            "{}",
            r.body
        );
    }
    for addr in [&e2b_addr, &s.process.addr] {
        let r = e2b(
            addr,
            "POST",
            &format!("/sandboxes/{first}/connect"),
            Some(json!({"timeout": 60})),
        );
        assert_eq!(r.status, 429, "E2B connect: {}", r.body);
        assert!(r.body.contains("running_sandboxes"), "{}", r.body);
        let r = e2b(
            addr,
            "POST",
            "/sandboxes",
            Some(json!({"templateID": "probe"})),
        );
        assert_eq!(r.status, 429, "E2B create: {}", r.body);
    }
    // envd (E2B's in-sandbox API) would wake it too: refused alike.
    let envd = [
        ("X-API-KEY", a.as_str()),
        ("E2b-Sandbox-Id", first.as_str()),
        ("Content-Type", "application/json"),
    ];
    let r = request_with(
        &s.process.addr,
        "POST",
        "/process.Process/List",
        &envd,
        Some("{}"),
    );
    assert_eq!(r.status, 429, "envd RPC: {}", r.body);
    assert!(r.body.contains("running_sandboxes"), "{}", r.body);
    let r = request_with(
        &s.process.addr,
        "GET",
        "/files?path=/etc/hostname",
        &envd[..2],
        None,
    );
    assert_eq!(r.status, 429, "envd files: {}", r.body);
    let state = |id: &str| s.ok(&a, "GET", &format!("/v1/sandboxes/{id}"), None)["state"].clone();
    assert_eq!(state(&first), "hibernated");

    // Room again: the wake goes through.
    s.ok(&a, "DELETE", &format!("/v1/sandboxes/{second}"), None);
    s.ok(&a, "POST", &format!("/v1/sandboxes/{first}/connect"), None);
    assert_eq!(state(&first), "running");
}

/// A fork with `count` is admitted for all of its forks before the first
/// is made: past the quota 429 and none made; within it, all of them,
/// listed, the tenant's.
#[test]
fn a_fork_count_is_admitted_all_or_none() {
    let data = DataDir::new("tenants-fork");
    let s = Serve::first_start(&data.0);
    let a = s.tenant("forks");
    s.ok(
        &s.admin,
        "PUT",
        "/v1/tenants/forks/quota",
        Some(json!({"total_sandboxes": 3})),
    );
    let src = s.create_probe(&a)["id"].as_str().unwrap().to_string();
    let fork = format!("/v1/sandboxes/{src}/fork");
    let r = s.call(&a, "POST", &fork, Some(json!({"count": 3})));
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(code(&r), "quota_exceeded", "{}", r.body);
    assert_eq!(ids(&s.ok(&a, "GET", "/v1/sandboxes", None)).len(), 1);
    let r = s.call(&a, "POST", &fork, Some(json!({"count": 21})));
    assert_eq!(r.status, 400, "{}", r.body);
    let made = s.ok(&a, "POST", &fork, Some(json!({"count": 2})));
    let forks = made["sandboxes"]
        .as_array()
        .unwrap_or_else(|| panic!("{made}"));
    assert_eq!(forks.len(), 2, "{made}");
    for f in forks {
        assert_eq!(f["tenant"], "forks", "{f}");
        assert_eq!(f["state"], "running", "{f}");
    }
    assert_eq!(ids(&s.ok(&a, "GET", "/v1/sandboxes", None)).len(), 3);
    let r = s.call(&a, "POST", &fork, Some(json!({})));
    assert_eq!(r.status, 429, "{}", r.body);
}

/// Attack 6 of issue 24: template names are per tenant. A tenant's
/// template named like a shared one (`base`) made every other tenant's
/// create from that name 404, and a 409 on another tenant's name told it
/// that name exists.
#[test]
fn template_names_are_per_tenant() {
    let data = DataDir::new("tenants-names");
    let s = Serve::first_start(&data.0);
    let acme = s.tenant("acme");
    let evil = s.tenant("evil");
    let build = |token: &str, name: &str| {
        s.call(
            token,
            "POST",
            "/v1/templates",
            Some(json!({"name": name, "kind": "probe"})),
        )
    };
    let built = |token: &str, name: &str| {
        let r = build(token, name);
        assert_eq!(r.status, 201, "{name}: {}", r.body);
        r.json()["id"].as_str().unwrap().to_string()
    };
    let e2b = |key: &str, method: &str, path: &str, body: Option<Value>| {
        let body = body.map(|b| b.to_string());
        request_with(
            &s.process.addr,
            method,
            path,
            &[("X-API-KEY", key)],
            body.as_deref(),
        )
    };
    // `base`, the nested pod's shared template, is offered before it is
    // built (on demand): no tenant takes its name, not even now.
    let r = build(&evil, "base");
    assert_eq!(
        (r.status, code(&r).as_str()),
        (409, "conflict"),
        "{}",
        r.body
    );
    assert!(r.body.contains("shared template"), "{}", r.body);
    // A name evil took before the admin built a shared one (`team`, as
    // `base` would be on a host where it came later): acme's creates from
    // it, on /v1 and E2B's, are the shared one's.
    let evil_base = built(&evil, "team");
    let shared_base = built(&s.admin, "team");
    let v1 = s.ok(
        &acme,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "team"})),
    );
    assert_eq!(v1["template"], shared_base.as_str(), "{v1}");
    let r = e2b(
        &acme,
        "POST",
        "/v2/sandboxes",
        Some(json!({"templateID": "team"})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let made = s.ok(
        &acme,
        "GET",
        &format!("/v1/sandboxes/{}", r.json()["sandboxID"].as_str().unwrap()),
        None,
    );
    assert_eq!(made["template"], shared_base.as_str(), "{made}");
    // evil's own name is its own.
    let own = s.ok(
        &evil,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "team"})),
    );
    assert_eq!(own["template"], evil_base.as_str(), "{own}");

    // A tenant cannot shadow a shared template: 409, saying so.
    for name in ["team", "probe"] {
        let r = build(&acme, name);
        assert_eq!(
            (r.status, code(&r).as_str()),
            (409, "conflict"),
            "{}",
            r.body
        );
        assert!(r.body.contains("shared template"), "{}", r.body);
    }
    // Two tenants each have an `x`; a second `x` of one's own is 409.
    let acme_x = built(&acme, "x");
    let evil_x = built(&evil, "x");
    assert_eq!(build(&evil, "x").status, 409);
    // No 409 tells acme a name of evil's exists, nor a snapshot's.
    built(&evil, "evil-secret");
    built(&acme, "evil-secret");
    let sandbox = v1["id"].as_str().unwrap();
    let snap = |name: &str| {
        s.call(
            &acme,
            "POST",
            &format!("/v1/sandboxes/{sandbox}/template"),
            Some(json!({ "name": name })),
        )
    };
    assert_eq!(snap("x").status, 409, "acme's own x");
    let r = snap("evil-only");
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["tenant"], "acme", "{}", r.body);
    built(&evil, "evil-only-2");
    let r = e2b(
        &acme,
        "POST",
        &format!("/sandboxes/{sandbox}/snapshots"),
        Some(json!({"name": "evil-only-2"})),
    );
    assert_eq!(r.status, 201, "{}", r.body);

    // Another tenant's template, by id or by name, is a missing one.
    let r = s.call(&acme, "GET", &format!("/v1/templates/{acme_x}"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    let missing = s.call(&acme, "GET", "/v1/templates/tpl_0000000000000000", None);
    assert_eq!(missing.status, 404);
    for path in [
        format!("/v1/templates/{evil_x}"),
        format!("/v1/templates/{evil_base}"),
    ] {
        let got = s.call(&acme, "GET", &path, None);
        assert_eq!(
            (got.status, code(&got).as_str()),
            (404, "not_found"),
            "{path}"
        );
        let deleted = s.call(&acme, "DELETE", &path, None);
        assert_eq!(deleted.status, 404, "{path}: {}", deleted.body);
    }
    for template in [&evil_x, &evil_base] {
        let r = s.call(
            &acme,
            "POST",
            "/v1/sandboxes",
            Some(json!({ "template": template })),
        );
        assert_eq!(r.status, 404, "{}", r.body);
        let r = e2b(
            &acme,
            "POST",
            "/v2/sandboxes",
            Some(json!({ "templateID": template })),
        );
        assert_eq!(r.status, 404, "{}", r.body);
        let r = e2b(&acme, "DELETE", &format!("/templates/{template}"), None);
        assert_eq!(r.status, 404, "{}", r.body);
    }
    // Still there for evil; a shared one is read-only for tenants.
    assert_eq!(
        s.call(&evil, "GET", &format!("/v1/templates/{evil_x}"), None)
            .status,
        200
    );
    let r = s.call(
        &evil,
        "DELETE",
        &format!("/v1/templates/{shared_base}"),
        None,
    );
    assert_eq!(r.status, 403, "{}", r.body);
    // A list shows a tenant its own and the shared ones only.
    let listed = s.ok(&acme, "GET", "/v1/templates", None);
    let listed: Vec<&str> = listed["templates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert!(listed.contains(&acme_x.as_str()) && listed.contains(&shared_base.as_str()));
    assert!(!listed.contains(&evil_x.as_str()) && !listed.contains(&evil_base.as_str()));
    // evil deletes its `team`; its create from `team` is the shared one's.
    let r = s.call(
        &evil,
        "DELETE",
        &format!("/v1/sandboxes/{}", own["id"].as_str().unwrap()),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let r = s.call(&evil, "DELETE", "/v1/templates/team", None);
    assert_eq!(r.status, 204, "by name, its own: {}", r.body);
    let again = s.ok(
        &evil,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "team"})),
    );
    assert_eq!(again["template"], shared_base.as_str(), "{again}");
}
