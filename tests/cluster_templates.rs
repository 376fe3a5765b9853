//! Templates in the cluster (`scripts/cluster` on loopback, as
//! tests/cluster.rs): built on a pod through its work queue by any
//! replica, read from the pods' catalogs in PostgreSQL by any replica, and
//! deleted on the pods that list them (`cluster/src/templates.rs`).
//! Needs postgres and nats-server (tests/needs leaves it out without them).

use common::cluster::{as_token, finished, stored_sandboxes, tenant_token, Cluster};
use common::http::{request_with, HttpResponse};

mod common;

/// `METHOD path` on replica `n` with `token` and an `Idempotency-Key`.
fn keyed(
    c: &Cluster,
    n: u16,
    token: &str,
    key: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> HttpResponse {
    let auth = format!("Bearer {token}");
    let headers = [("Idempotency-Key", key), ("Authorization", auth.as_str())];
    request_with(&c.api(n), method, path, &headers, body)
}

/// `GET path` on pod `n`'s own API: the list under `key`.
fn pod_list(c: &Cluster, n: u16, path: &str, key: &str) -> Vec<serde_json::Value> {
    let r = common::http::request(&c.pod_api(n), "GET", path, Some(&c.pod_token(n)), None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()[key].as_array().unwrap().clone()
}

/// The templates named `name` that pod `n` itself lists.
fn on_pod(c: &Cluster, n: u16, name: &str) -> usize {
    let templates = pod_list(c, n, "/v1/templates", "templates");
    templates.iter().filter(|t| t["name"] == name).count()
}

#[test]
fn cluster_templates_are_built_read_and_deleted_through_any_replica() {
    let c = Cluster::up("templates-built");
    check_catalog_changes(&c);
    let admin = c.token.trim().to_string();
    let (acme, _) = tenant_token(&c, 1, "acme");
    let (other, _) = tenant_token(&c, 2, "other");

    // acme builds through replica 1: one operation on a pod, the template
    // acme's, answered once built (201), without host paths.
    let body = Some(r#"{"name":"acme-built","kind":"probe","mem_mib":64}"#);
    let r = keyed(&c, 1, &acme, "build-1", "POST", "/v1/templates", body);
    assert_eq!(r.status, 201, "{}", r.body);
    let built = r.json();
    let id = built["id"].as_str().unwrap().to_string();
    assert_eq!(built["tenant"], "acme", "{built}");
    assert_eq!(built["state"], "ready", "{built}");
    assert!(built.get("snapshot_dir").is_none(), "{built}");
    let path = format!("/v1/templates/{id}");
    assert_eq!(r.header("location"), Some(path.as_str()));

    // A create from it through replica 2 right away is placed on its pod
    // (the build's result wrote that pod's catalog, before a heartbeat).
    let create = format!(r#"{{"template":"{id}"}}"#);
    let r = as_token(&c, 2, &acme, "POST", "/v1/sandboxes", Some(&create));
    assert_eq!(r.status, 201, "{}", r.body);
    let sandbox = r.json()["id"].as_str().unwrap().to_string();
    let pod = r.json()["pod"].as_str().unwrap().to_string();
    assert_eq!(
        c.sql(
            "SELECT pod || '|' || kind || '|' || status || '|' || tenant FROM operations \
               WHERE idempotency_key = 'build-1'"
        ),
        format!("{pod}|template_build|done|acme")
    );
    let n: u16 = if pod == "pod1" { 1 } else { 2 };
    assert_eq!(on_pod(&c, n, "acme-built"), 1);
    assert_eq!(on_pod(&c, 3 - n, "acme-built"), 0);

    // A retry of the build with its key, through replica 2: the first
    // answer, nothing built again.
    let r = keyed(&c, 2, &acme, "build-1", "POST", "/v1/templates", body);
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["id"], id.as_str(), "{}", r.body);
    assert_eq!(
        c.sql("SELECT count(*) FROM operations WHERE kind = 'template_build'"),
        "1"
    );
    assert_eq!(on_pod(&c, n, "acme-built"), 1);
    // The same key on another command: 409.
    let r = keyed(&c, 2, &acme, "build-1", "DELETE", &path, None);
    assert_eq!(r.status, 409, "{}", r.body);

    // Read through either replica by acme and the admin (with its host
    // paths); another tenant neither reads, lists nor deletes it.
    for n in [1, 2] {
        let r = as_token(&c, n, &acme, "GET", &path, None);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["name"], "acme-built");
        assert!(r.json().get("kernel").is_none(), "{}", r.body);
        let r = as_token(&c, n, &admin, "GET", &path, None);
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.json()["snapshot_dir"].is_string(), "{}", r.body);
        assert_eq!(as_token(&c, n, &other, "GET", &path, None).status, 404);
    }
    let r = as_token(&c, 1, &other, "GET", "/v1/templates", None);
    assert!(!r.body.contains(&id), "{}", r.body);
    let r = as_token(&c, 2, &other, "DELETE", &path, None);
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(as_token(&c, 1, &acme, "GET", &path, None).status, 200);

    // In use by a sandbox: its pod refuses the delete (409), as embedded.
    let r = as_token(&c, 1, &acme, "DELETE", &path, None);
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.body.contains(&id), "{}", r.body);
    let r = as_token(
        &c,
        1,
        &acme,
        "DELETE",
        &format!("/v1/sandboxes/{sandbox}"),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(stored_sandboxes(&c, "acme"), "0");

    // Deleted through replica 2: gone at once from both replicas, and
    // from its pod; a create from it is 404; a retry with the key is the
    // first answer (204), without the key 404.
    let r = keyed(&c, 2, &acme, "delete-1", "DELETE", &path, None);
    assert_eq!(r.status, 204, "{}", r.body);
    for n in [1, 2] {
        assert_eq!(as_token(&c, n, &acme, "GET", &path, None).status, 404);
        assert_eq!(as_token(&c, n, &admin, "GET", &path, None).status, 404);
        let r = as_token(&c, n, &acme, "GET", "/v1/templates", None);
        assert!(!r.body.contains(&id), "{}", r.body);
        let r = as_token(&c, n, &acme, "POST", "/v1/sandboxes", Some(&create));
        assert_eq!(r.status, 404, "{}", r.body);
    }
    assert_eq!(on_pod(&c, n, "acme-built"), 0);
    for n in [1, 2] {
        let r = keyed(&c, n, &acme, "delete-1", "DELETE", &path, None);
        assert_eq!(r.status, 204, "{}", r.body);
    }
    assert_eq!(as_token(&c, 1, &acme, "DELETE", &path, None).status, 404);
    // Journaled on its pod with the key and the pod's id.
    let op = c.sql(&format!(
        "SELECT id FROM operations WHERE kind = 'template_delete' AND template = '{id}'
            AND idempotency_key = 'delete-1 {pod}'"
    ));
    let op = finished(&c, 1, &format!("/v1/operations/{op}"));
    assert_eq!(op["status"], "done", "{op}");
    assert_eq!(op["template"], id.as_str(), "{op}");
    assert_eq!(
        op["outcome"]["template_deleted"]["template"]["state"],
        "deleted"
    );
    // Two heartbeats later the pod's own list agrees.
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert_eq!(as_token(&c, 2, &acme, "GET", &path, None).status, 404);

    // The admin builds on a chosen pod: shared, every tenant reads it, a
    // tenant may not delete it (403) nor choose a pod; a failed build is
    // the pod's error.
    let shared = Some(r#"{"name":"shared-built","kind":"probe","mem_mib":64,"pod":"pod2"}"#);
    let r = as_token(&c, 1, &admin, "POST", "/v1/templates", shared);
    assert_eq!(r.status, 201, "{}", r.body);
    let shared_id = r.json()["id"].as_str().unwrap().to_string();
    assert!(r.json().get("tenant").is_none(), "{}", r.body);
    assert_eq!(on_pod(&c, 2, "shared-built"), 1);
    let shared_path = format!("/v1/templates/{shared_id}");
    let r = as_token(&c, 2, &other, "GET", &shared_path, None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        as_token(&c, 2, &other, "DELETE", &shared_path, None).status,
        403
    );
    let r = as_token(&c, 1, &other, "POST", "/v1/templates", shared);
    assert_eq!(r.status, 403, "{}", r.body);
    let bad = Some(r#"{"name":"tiny","kind":"probe","mem_mib":1}"#);
    let r = as_token(&c, 1, &acme, "POST", "/v1/templates", bad);
    assert_eq!(r.status, 400, "{}", r.body);
    let r = as_token(&c, 1, &admin, "DELETE", &shared_path, None);
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(
        as_token(&c, 2, &other, "GET", &shared_path, None).status,
        404
    );
    assert_eq!(on_pod(&c, 2, "shared-built"), 0);

    builds_are_admitted_in_postgresql(&c);
    images_are_indexed_in_postgresql(&c, &admin, &acme);

    // A replica that waits 1 ms answers a build 202 with its operation;
    // it goes on, and its outcome is the template, then read through the
    // other replica; a retry with the key is the built template (201).
    c.kill("api1");
    c.start_api("api1", "--cluster-down-after-ms 3000 --cluster-wait-ms 1");
    let slow = Some(r#"{"name":"acme-later","kind":"probe","mem_mib":64}"#);
    let r = keyed(&c, 1, &acme, "build-2", "POST", "/v1/templates", slow);
    assert_eq!(r.status, 202, "{}", r.body);
    let op = r.json();
    assert_eq!(op["kind"], "template_build", "{op}");
    assert_eq!(op["status"], "pending", "{op}");
    let location = r.header("location").unwrap().to_string();
    assert_eq!(
        location,
        format!("/v1/operations/{}", op["id"].as_str().unwrap())
    );
    let done = finished(&c, 2, &location);
    assert_eq!(done["status"], "done", "{done}");
    let later = done["outcome"]["template"]["template"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{done}"))
        .to_string();
    let r = as_token(&c, 2, &acme, "GET", &format!("/v1/templates/{later}"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["state"], "ready", "{}", r.body);
    let r = keyed(&c, 2, &acme, "build-2", "POST", "/v1/templates", slow);
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["id"], later.as_str(), "{}", r.body);
}

/// A build holds its tenant's quota (a sandbox of its size) while its
/// operation is pending, in PostgreSQL, so a create through the other
/// replica meanwhile does not pass a quota of one running sandbox. The
/// build is held pending without timing: nats-server is frozen (SIGSTOP)
/// between the build's journal and its publish, for well under the pods'
/// down time, and thawed once the create is refused.
fn builds_are_admitted_in_postgresql(c: &Cluster) {
    let (builder, _) = tenant_token(c, 1, "builder");
    c.set_quota(1, "builder", r#"{"running_sandboxes":1}"#);
    let pending = || {
        c.sql(
            "SELECT count(*) FROM operations WHERE tenant = 'builder' \
             AND kind = 'template_build' AND status = 'pending'",
        )
    };
    let create = Some(r#"{"template":"probe"}"#);
    let build = Some(r#"{"name":"builder-built","kind":"probe","mem_mib":64}"#);
    c.freeze("nats", true);
    let (refused, built) = std::thread::scope(|s| {
        let b = s.spawn(|| as_token(c, 2, &builder, "POST", "/v1/templates", build));
        let t0 = std::time::Instant::now();
        while pending() != "1" {
            if t0.elapsed() > std::time::Duration::from_secs(2) || b.is_finished() {
                c.freeze("nats", false);
                panic!("the build was not journaled: {:?}", b.join().unwrap().body);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let refused = as_token(c, 1, &builder, "POST", "/v1/sandboxes", create);
        c.freeze("nats", false);
        (refused, b.join().unwrap())
    });
    assert_eq!(refused.status, 429, "{}", refused.body);
    let e = &refused.json()["error"];
    assert_eq!(e["quota"], "running_sandboxes", "{}", refused.body);
    assert_eq!(e["used"], 1, "the build: {}", refused.body);
    assert_eq!(built.status, 201, "{}", built.body);
    // Built: it holds nothing now, so the create fits.
    assert_eq!(pending(), "0");
    let r = as_token(c, 1, &builder, "POST", "/v1/sandboxes", create);
    assert_eq!(r.status, 201, "{}", r.body);
    // With the sandbox running, a build through the other replica does not
    // fit either.
    let again = Some(r#"{"name":"builder-two","kind":"probe","mem_mib":64}"#);
    let r = as_token(c, 2, &builder, "POST", "/v1/templates", again);
    assert_eq!(r.status, 429, "{}", r.body);
    let id = r.json()["error"]["quota"].clone();
    assert_eq!(id, "running_sandboxes", "{}", r.body);
}

/// The catalog changes a build's or a delete's result records
/// (`cluster/src/catalog.rs`, schema version 8), applied by
/// PostgreSQL's `torpor_catalog*` functions over what a heartbeat lists:
/// checked on the cluster's own database.
fn check_catalog_changes(c: &Cluster) {
    // t1 built (ready), t2 deleted, recorded now; t9's change is stale.
    let changes = r#"jsonb_build_object(
        't1', jsonb_build_object('template', '{"id":"t1","state":"ready"}'::jsonb,
            'name', 'one', 'at', extract(epoch FROM now())),
        't2', jsonb_build_object('template', NULL::jsonb, 'name', 'two',
            'at', extract(epoch FROM now())),
        't9', jsonb_build_object('template', '{"id":"t9","state":"ready"}'::jsonb,
            'name', 'nine', 'at', 0))"#;
    let sql = |q: &str| c.sql(&q.replace("CHANGES", changes));
    // A heartbeat taken before both results: t1 building, t2 there.
    let before = r#"'[{"id":"t1","state":"building"},{"id":"t2","state":"ready"},
        {"id":"t3","state":"ready"}]'::jsonb"#;
    let q = format!("SELECT torpor_catalog({before}, torpor_catalog_pending({before}, CHANGES))");
    assert_eq!(
        sql(&q),
        r#"[{"id": "t3", "state": "ready"}, {"id": "t1", "state": "ready"}]"#
    );
    // Both changes wait for a heartbeat that agrees; the stale one goes.
    let q = format!(
        "SELECT torpor_catalog_pending({before}, CHANGES) ? 't1', \
                     torpor_catalog_pending({before}, CHANGES) ? 't2', \
                     torpor_catalog_pending({before}, CHANGES) ? 't9'"
    );
    assert_eq!(sql(&q), "t|t|f");
    // A heartbeat taken after both: nothing left to apply.
    let after = r#"'[{"id":"t1","state":"ready"},{"id":"t3","state":"ready"}]'::jsonb"#;
    let q = format!("SELECT torpor_catalog_pending({after}, CHANGES)");
    assert_eq!(sql(&q), "{}");
    // The names placement reads: t2 and its name gone, t1 and its added.
    let q = "SELECT array_to_string(ARRAY(SELECT unnest(
                torpor_catalog_names('{t2,t3,three,two}', CHANGES)) ORDER BY 1), ',')";
    assert_eq!(sql(q), "nine,one,t1,t3,t9,three");
}

/// The images pod `n` itself lists.
fn pod_images(c: &Cluster, n: u16) -> Vec<String> {
    let images = pod_list(c, n, "/v1/images", "images");
    images
        .iter()
        .map(|i| i.as_str().unwrap().to_string())
        .collect()
}

/// Pod `n`'s images directory, and the cluster's object store (a
/// directory: `scripts/cluster`'s default).
fn images_dir(c: &Cluster, n: u16) -> std::path::PathBuf {
    c.dir.join(format!("pod{n}/data/images"))
}

/// Waits until `check` holds, within the time the cluster shares state in.
fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !check() {
        assert!(t0.elapsed() < common::cluster::SHARED_WITHIN, "{what}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Images in the cluster (`cluster/src/images.rs`,
/// `scheduler/src/service/stored_images.rs`): an image uploaded through
/// a replica is streamed to the pod named, which stores it in the pods'
/// shared object store and names it there before answering; every pod
/// then lists it, PostgreSQL indexes it from their heartbeats, and a
/// Linux build on a pod that never had it fetches it, byte for byte; a
/// delete through a replica removes it from every pod and from the store.
fn images_are_indexed_in_postgresql(c: &Cluster, admin: &str, acme: &str) {
    let auth = format!("Bearer {admin}");
    let octets = [
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/octet-stream"),
    ];
    let mut uploaded = Vec::new();
    for part in ["kernel", "rootfs"] {
        let path = format!("/v1/images/img-a/{part}?pod=pod2");
        let body = format!("{part} bytes, streamed through replica 1");
        let r = request_with(&c.api(1), "PUT", &path, &octets, Some(&body));
        assert_eq!(r.status, 201, "{}", r.body);
        assert_eq!(r.json()["bytes"], body.len(), "{}", r.body);
        assert_eq!(r.json()["part"], part, "{}", r.body);
        uploaded.push(body);
    }
    let named = c.dir.join("objects/names/images/img-a");
    assert!(
        named.is_file(),
        "not named in the store: {}",
        named.display()
    );
    assert!(pod_images(c, 2).contains(&"img-a".to_string()));
    // pod1 lists it from the store, without a copy of its own yet.
    eventually("pod1 does not list the stored image", || {
        pod_images(c, 1).contains(&"img-a".to_string())
    });
    assert!(!images_dir(c, 1).join("img-a").exists());
    // Refused: a tenant's upload, an unknown pod.
    let r = as_token(c, 1, acme, "PUT", "/v1/images/img-b/kernel", Some("k"));
    assert_eq!(r.status, 403, "{}", r.body);
    let r = request_with(
        &c.api(2),
        "PUT",
        "/v1/images/img-b/kernel?pod=pod9",
        &octets,
        Some("k"),
    );
    assert_eq!(r.status, 404, "{}", r.body);

    // Indexed from the pods' next heartbeats: listed through either
    // replica, to a tenant too (names only); the pods' list says where.
    eventually("not indexed for both pods", || {
        c.sql("SELECT string_agg(id, ',' ORDER BY id) FROM pods WHERE 'img-a' = ANY(images)")
            == "pod1,pod2"
    });
    let r = as_token(c, 2, acme, "GET", "/v1/images", None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.json()["images"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i == "img-a"),
        "{}",
        r.body
    );
    let pods = c.call(1, "GET", "/v1/pods", None).json();
    let holders: Vec<_> = pods["pods"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["images"].as_array().unwrap().iter().any(|i| i == "img-a"))
        .map(|p| p["id"].clone())
        .collect();
    assert_eq!(holders, ["pod1", "pod2"], "{pods}");

    // A Linux template naming it, built on pod1: pod1 fetches the image
    // from the store first (then, on a host without VMX/SVM, answers 422
    // host_unsupported; an image nobody has is 400 at the replica).
    let linux = Some(r#"{"name":"lin","kind":"linux","image":"img-a","mem_mib":512,"pod":"pod1"}"#);
    let r = keyed(c, 2, admin, "lin-1", "POST", "/v1/templates", linux);
    assert!(![400, 404].contains(&r.status), "{}", r.body);
    assert_eq!(
        c.sql("SELECT pod FROM operations WHERE idempotency_key = 'lin-1'"),
        "pod1"
    );
    eventually("pod1 did not fetch the image", || {
        images_dir(c, 1).join("img-a/rootfs.ext4").is_file()
    });
    for (file, body) in ["vmlinux", "rootfs.ext4"].iter().zip(&uploaded) {
        let got = std::fs::read_to_string(images_dir(c, 1).join("img-a").join(file)).unwrap();
        assert_eq!(&got, body, "{file} fetched by pod1");
    }
    let none = Some(r#"{"name":"lin","kind":"linux","image":"img-z","mem_mib":512}"#);
    let r = as_token(c, 1, acme, "POST", "/v1/templates", none);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("img-z"), "{}", r.body);

    // Deleted through replica 2: gone from both pods, the store and the
    // index.
    let r = as_token(c, 2, admin, "DELETE", "/v1/images/img-a", None);
    assert_eq!(r.status, 204, "{}", r.body);
    assert!(!named.exists(), "still named in the store");
    for n in [1, 2] {
        assert!(!images_dir(c, n).join("img-a").exists(), "pod{n}'s copy");
        assert!(!pod_images(c, n).contains(&"img-a".to_string()), "pod{n}");
    }
    eventually("still indexed", || {
        c.sql("SELECT count(*) FROM pods WHERE 'img-a' = ANY(images)") == "0"
    });
    let r = as_token(c, 1, admin, "DELETE", "/v1/images/img-a", None);
    assert_eq!(r.status, 404, "{}", r.body);
}

/// The data plane over TLS (`TORPOR_CLUSTER_POD_TLS`): each pod serves its
/// API with its own self-signed certificate and announces its `tls:`
/// address and the certificate's fingerprint in its heartbeats; a replica
/// relays a sandbox's data-plane calls to the owning pod pinned to that
/// certificate, and the pod takes no plain HTTP.
#[test]
fn cluster_pods_serve_the_data_plane_over_tls() {
    let c = Cluster::up_tls("tls");
    let pods = c.call(2, "GET", "/v1/pods", None).json();
    for pod in pods["pods"].as_array().unwrap() {
        assert_eq!(pod["address"]["kind"], "tls", "{pod}");
    }
    let r = c.call(1, "POST", "/v1/sandboxes", Some(r#"{"template":"probe"}"#));
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    // Relayed over TLS through either replica: the pod's own answers (a
    // probe has no agent: 422; its checkpoints: none yet).
    let exec = format!("/v1/sandboxes/{id}/exec");
    let r = c.call(2, "POST", &exec, Some(r#"{"argv":["true"]}"#));
    assert_eq!(r.status, 422, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "no_agent", "{}", r.body);
    let r = c.call(1, "GET", &format!("/v1/sandboxes/{id}/checkpoints"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["checkpoints"], serde_json::json!([]), "{}", r.body);
    // Commands go through the queues as ever.
    let r = c.call(2, "POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    // A pod takes no plain HTTP.
    let plain = common::http::try_request_with(
        &c.pod_api(1),
        "GET",
        "/v1/pods",
        &[],
        None,
        std::time::Duration::from_secs(5),
    );
    if let Ok(r) = plain {
        assert_ne!(r.status, 200, "plain HTTP answered: {}", r.body);
    }
    let r = c.call(1, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(r.status, 204, "{}", r.body);
}
