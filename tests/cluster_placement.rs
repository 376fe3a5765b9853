//! Placement by bytes held (issue 29, `cluster/src/placement.rs`) on the
//! loopback cluster, end to end: the pods' heartbeats report the bytes
//! they hold of each stored layer (`scheduler/src/service/held.rs`), the
//! replicas keep them in `pods.layers`, and a create goes to the pod that
//! holds the most of its template's layers, then by admission headroom.
//!
//! A template is built on pod1 and stored (a directory object store);
//! pod2 fetches it while pod1 is down (a create from a template no pod up
//! lists), so both list it, whole. pod1 is given less headroom than pod2
//! (a smaller oversubscription ratio, through a replica). The replicas
//! pick the first pod ranked (`--cluster-placement-choices 1`, not at
//! random among the first two), so each outcome is one pod:
//!
//! - both hold the template's layer whole: creates go by headroom, to pod2;
//! - pod2's copy still arriving (the `.arriving` marker a lazy fetch
//!   leaves in a layer's directory until its memory file is whole,
//!   `scheduler/src/service/lazy.rs`; the pods keep no chunk cache,
//!   `--chunk-cache-mib 0`, so pod2 holds none of it): creates go to pod1,
//!   which holds it all, although pod2 has more headroom (a headroom-only
//!   rule sends them to pod2);
//! - the marker gone: to pod2 again.
//!
//! The replicas' waits for those creates are woken by their outcomes'
//! notifications (`cluster/src/finished.rs`), which their metrics count.
//!
//! A wake moves by the same rule (`cluster/src/moved.rs`' `move_target`),
//! on a cluster of three pods: a sandbox hibernated on pod1, which is then
//! lost, wakes on pod2, which holds its template's layer, although pod3
//! lists the template too (its copy still arriving) and has more
//! headroom; one whose template every pod holds wakes on pod3.
//!
//! Needs postgres and nats-server (tests/needs leaves it out without
//! them).

mod common;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::cluster::{Cluster, API_ARGS, POD_ARGS};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(30);

/// The pods' flags of both tests: no standby shells, and no chunk cache,
/// so a layer marked as still arriving holds none of its bytes.
const NO_CACHE: &str = "--standby-pool 0 --chunk-cache-mib 0";

/// One cluster of this file at a time (two would share two cores).
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

/// What a layer being fetched holds until its memory file is whole
/// (`scheduler/src/service/lazy.rs`'s `ARRIVING`).
const ARRIVING: &str = ".arriving";

/// Pod `pod`'s entry in `GET /v1/pods`.
fn pod_entry(c: &Cluster, pod: &str) -> Value {
    c.pods()
        .into_iter()
        .find(|p| p["id"] == pod)
        .unwrap_or_else(|| panic!("{pod} is not listed"))
}

/// Waits until replica 1 reads pod `pod` as reachable (`true`) or not.
fn wait_reachable(c: &Cluster, pod: &str, reachable: bool) {
    let deadline = Instant::now() + WAIT;
    while pod_entry(c, pod)["reachable"] != reachable {
        assert!(
            Instant::now() < deadline,
            "{pod} never read reachable={reachable}: {:?}",
            c.pods()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The layer of template `id` pod `pod`'s row lists (`pods.layers`, from
/// its heartbeats) once `ok(bytes, held)` holds of it: its manifest, its
/// bytes and how many of them the pod holds.
fn layer_of(c: &Cluster, pod: &str, id: &str, ok: impl Fn(u64, u64) -> bool) -> (String, u64, u64) {
    let query = format!(
        "SELECT l->>'layer', l->>'bytes', l->>'held' FROM pods, jsonb_array_elements(layers) l \
         WHERE id = '{pod}' AND l->>'of' = '{id}'"
    );
    let deadline = Instant::now() + WAIT;
    loop {
        let row = c.sql(&query);
        if let [layer, bytes, held] = row.split('|').collect::<Vec<_>>()[..] {
            let (bytes, held) = (bytes.parse().unwrap(), held.parse().unwrap());
            if ok(bytes, held) {
                return (layer.to_string(), bytes, held);
            }
        }
        assert!(
            Instant::now() < deadline,
            "{pod}'s layer of {id} never reported as wanted: {row:?}; its layers: {}",
            c.sql(&format!("SELECT layers FROM pods WHERE id = '{pod}'"))
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A sandbox of template `id` created through replica `n` (placed by
/// the replica) and deleted: the pod it was placed on.
fn placed(c: &Cluster, n: u16, id: &str) -> String {
    let body = format!(r#"{{"template":"{id}"}}"#);
    let r = c.call(n, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(r.status, 201, "{}", r.body);
    let s = r.json();
    let pod = s["pod"]
        .as_str()
        .unwrap_or_else(|| panic!("{s}"))
        .to_string();
    let path = format!("/v1/sandboxes/{}", s["id"].as_str().unwrap());
    let r = c.call(n, "DELETE", &path, None);
    assert_eq!(r.status, 204, "{}", r.body);
    pod
}

/// The pods' headroom as the replicas read it: (pod1's, pod2's).
fn headrooms(c: &Cluster) -> (f64, f64) {
    let of = |pod| pod_entry(c, pod)["headroom_mib"].as_f64().unwrap();
    (of("pod1"), of("pod2"))
}

/// Template `id`'s snapshot directory on pod `n` (its own API).
fn snapshot_dir(c: &Cluster, n: u16, id: &str) -> PathBuf {
    let path = format!("/v1/templates/{id}");
    let r = common::http::request(&c.pod_api(n), "GET", &path, Some(&c.pod_token(n)), None);
    assert_eq!(r.status, 200, "{}", r.body);
    let dir = r.json()["snapshot_dir"].as_str().map(PathBuf::from);
    let dir = dir.unwrap_or_else(|| panic!("no snapshot_dir: {}", r.body));
    assert!(dir.starts_with(c.dir.join(format!("pod{n}"))), "{dir:?}");
    dir
}

#[test]
fn cluster_creates_go_where_their_templates_bytes_are_then_by_headroom() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let c = Cluster::up_with_api(
        "placement",
        &format!("{POD_ARGS} {NO_CACHE}"),
        &format!("{API_ARGS} --cluster-placement-choices 1"),
    );

    let (id, manifest, bytes) = stored_on_pod1(&c, "placed");

    // pod2 fetches it while pod1 is down: a create from a template no pod
    // up lists goes to a pod up, which fetches it from the object store.
    c.stop("pod1");
    wait_reachable(&c, "pod1", false);
    assert_eq!(placed(&c, 2, &id), "pod2");
    c.start("pod1");
    c.wait_pods(2);
    let (layer, _, _) = layer_of(&c, "pod2", &id, |b, h| b == bytes && h == b);
    assert_eq!(layer, manifest);

    // pod1's headroom: half its ratio's, less than pod2's (a probe's
    // memory still fits on it many times over).
    scale_ratio(&c, "pod1", 0.5);
    let deadline = Instant::now() + WAIT;
    loop {
        let (one, two) = headrooms(&c);
        if one < two && one > 256.0 {
            println!("headroom: pod1 {one:.0} MiB, pod2 {two:.0} MiB");
            break;
        }
        assert!(Instant::now() < deadline, "headroom {one} and {two} MiB");
        std::thread::sleep(Duration::from_millis(100));
    }

    // Both hold it whole: the held bytes tie, headroom decides.
    for n in [1, 2] {
        assert_eq!(placed(&c, n, &id), "pod2", "both hold it: by headroom");
    }

    // pod2's copy still arriving, none of it held there: pod1 holds the
    // most, and takes the creates whatever pod2's headroom.
    let arriving = snapshot_dir(&c, 2, &id).join(ARRIVING);
    std::fs::write(&arriving, b"").unwrap();
    layer_of(&c, "pod2", &id, |b, h| b == bytes && h == 0);
    layer_of(&c, "pod1", &id, |b, h| b == bytes && h == b);
    let (one, two) = headrooms(&c);
    assert!(one < two, "pod1's headroom {one} MiB, pod2's {two} MiB");
    for n in [1, 2, 1] {
        assert_eq!(placed(&c, n, &id), "pod1", "only pod1 holds its bytes");
    }

    // Whole on pod2 again: by headroom again.
    std::fs::remove_file(&arriving).unwrap();
    layer_of(&c, "pod2", &id, |b, h| b == bytes && h == b);
    assert_eq!(placed(&c, 2, &id), "pod2", "both hold it again");

    // Each replica heard the outcomes as they were written
    // (`cluster/src/finished.rs`): its waits were woken, not only polled.
    for n in [1, 2] {
        let r = c.call(n, "GET", "/metrics", None);
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(
            r.body.contains("\ntorpor_cluster_outcome_listening 1\n"),
            "replica {n}: {}",
            r.body
        );
        let woke: u64 = r
            .body
            .lines()
            .find_map(|l| l.strip_prefix("torpor_cluster_outcome_wakeups_total "))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("replica {n}: no wakeups counted: {}", r.body));
        assert!(woke > 0, "replica {n}: no wait woken by its outcome");
    }
}

/// A probe template `name` built on pod1 and stored: pod1 reports its
/// layer, all of it held. Its id, manifest and bytes.
fn stored_on_pod1(c: &Cluster, name: &str) -> (String, String, u64) {
    let body = format!(r#"{{"name":"{name}","kind":"probe","mem_mib":64,"pod":"pod1"}}"#);
    let r = c.call(1, "POST", "/v1/templates", Some(&body));
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    let (manifest, bytes, _) = layer_of(c, "pod1", &id, |b, h| b > 0 && h == b);
    (id, manifest, bytes)
}

/// Pod `pod`'s ratio set to `factor` times its own, through replica 1;
/// waits until the replicas read its headroom lower.
fn scale_ratio(c: &Cluster, pod: &str, factor: f64) {
    let before = pod_entry(c, pod)["headroom_mib"].as_f64().unwrap();
    let ratio = pod_entry(c, pod)["oversubscription_ratio"]
        .as_f64()
        .unwrap_or_else(|| panic!("{pod}'s ratio"));
    let body = format!(r#"{{"oversubscription_ratio":{}}}"#, ratio * factor);
    let r = c.call(1, "PATCH", &format!("/v1/pods/{pod}"), Some(&body));
    assert_eq!(r.status, 200, "{}", r.body);
    let deadline = Instant::now() + WAIT;
    while pod_entry(c, pod)["headroom_mib"].as_f64().unwrap() >= before {
        assert!(
            Instant::now() < deadline,
            "{pod}'s headroom stayed {before} MiB"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A sandbox of `template` made on pod1 and hibernated there (its
/// snapshot stored): its id.
fn hibernated_on_pod1(c: &Cluster, template: &str) -> String {
    let body = format!(r#"{{"template":"{template}","pod":"pod1"}}"#);
    let r = c.call(1, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    let r = c.call(2, "POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.json()["sandbox"]["stored_snapshot"].is_string(),
        "{}",
        r.body
    );
    id
}

/// Wakes `id` through replica `n`, asked again while its pod is down
/// but not yet lost (503): the pod it runs on after.
fn woken_on(c: &Cluster, n: u16, id: &str) -> String {
    let deadline = Instant::now() + WAIT;
    let r = loop {
        let r = c.call(n, "POST", &format!("/v1/sandboxes/{id}/connect"), None);
        if r.status != 503 || Instant::now() >= deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(r.status, 200, "{}", r.body);
    let s = c
        .call(n, "GET", &format!("/v1/sandboxes/{id}"), None)
        .json();
    assert_eq!(s["state"], "running", "{s}");
    s["pod"]
        .as_str()
        .unwrap_or_else(|| panic!("{s}"))
        .to_string()
}

#[test]
fn cluster_a_lost_pods_sandbox_wakes_where_its_templates_bytes_are_then_by_headroom() {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let c = Cluster::up_pods(
        "moves",
        3,
        &format!("{POD_ARGS} {NO_CACHE}"),
        &format!("{API_ARGS} --cluster-lost-after-ms 4000"),
    );

    // A template built on pod1 and stored; pod2, then pod3, fetch it
    // while they are the one pod up (a create from a template no pod up
    // lists), so all three hold its layer whole.
    c.stop("pod3");
    let (template, _, bytes) = stored_on_pod1(&c, "moving");
    c.stop("pod1");
    wait_reachable(&c, "pod1", false);
    wait_reachable(&c, "pod3", false);
    assert_eq!(placed(&c, 2, &template), "pod2");
    c.start("pod3");
    c.stop("pod2");
    wait_reachable(&c, "pod2", false);
    wait_reachable(&c, "pod3", true);
    assert_eq!(placed(&c, 1, &template), "pod3");
    c.start("pod1");
    c.start("pod2");
    c.wait_pods(3);
    for pod in ["pod2", "pod3"] {
        layer_of(&c, pod, &template, |b, h| b == bytes && h == b);
    }

    // Two sandboxes hibernated on pod1: one of that template, one of the
    // built-in probe every pod has.
    let held = hibernated_on_pod1(&c, &template);
    let everywhere = hibernated_on_pod1(&c, "probe");

    // pod2's headroom below pod3's: by headroom alone, both would go to
    // pod3.
    scale_ratio(&c, "pod2", 0.5);
    let of = |pod| pod_entry(&c, pod)["headroom_mib"].as_f64().unwrap();
    let (two, three) = (of("pod2"), of("pod3"));
    assert!(
        two < three && two > 256.0,
        "pod2 {two} MiB, pod3 {three} MiB"
    );
    // pod3's copy still arriving: it lists the template but holds none
    // of its bytes (by listing alone, the two would tie, and headroom
    // would pick pod3).
    std::fs::write(snapshot_dir(&c, 3, &template).join(ARRIVING), b"").unwrap();
    layer_of(&c, "pod3", &template, |b, h| b == bytes && h == 0);

    // pod1 is lost; each sandbox wakes on the pod its rule picks.
    c.kill("pod1");
    wait_reachable(&c, "pod1", false);
    assert_eq!(
        woken_on(&c, 2, &held),
        "pod2",
        "the pod holding its template's bytes ranks first"
    );
    assert_eq!(
        woken_on(&c, 1, &everywhere),
        "pod3",
        "held bytes tie: the pod with the most headroom"
    );
}
