//! The object store scenario of issue 29 on a loopback cluster
//! (`tests/cluster_store.rs` on a directory, `tests/cluster_store_s3.rs`
//! on SeaweedFS): a hibernation answers once its snapshot is stored, a
//! pod lost for good has its hibernated sandboxes woken on the other pod
//! (the probe continuing its exact sequence) and its template created
//! from there; a corrupted chunk fails the wake naming the layer; a
//! sandbox running on the lost pod reads as lost and can be deleted, and
//! is deleted on that pod when it comes back; a wake its pod (up) refuses
//! for room is moved to the other pod (`tests/cluster_wake_refused.rs`).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::cluster::{as_token, tenant_token, Cluster, SHARED_WITHIN};
use super::snap::assert_exact_sequence;

/// The replicas' flags: a pod silent 4 s is lost for good.
const API_ARGS: &str = "--cluster-down-after-ms 3000 --cluster-lost-after-ms 4000";
/// The probe template's workload (`PROBE_CMDLINE`): 1 MiB.
const MIB: u32 = 1;
const WAIT: Duration = Duration::from_secs(30);

fn console(c: &Cluster, pod: u16, id: &str) -> PathBuf {
    c.dir
        .join(format!("pod{pod}/data/sandboxes/{id}/console.log"))
}

/// The probe's iterations in the sandbox's console on `pod` (its current
/// VMM's run), once at least `at_least` are there.
fn iterations(c: &Cluster, pod: u16, id: &str, at_least: usize) -> Vec<(u64, u64)> {
    let deadline = Instant::now() + WAIT;
    loop {
        let iters: Vec<(u64, u64)> = std::fs::read_to_string(console(c, pod, id))
            .unwrap_or_default()
            .lines()
            .filter_map(torpor_probe::parse_iter_line)
            .collect();
        if iters.len() >= at_least {
            return iters;
        }
        assert!(
            Instant::now() < deadline,
            "{id} on pod{pod}: {iters:?} in {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn post(c: &Cluster, n: u16, path: &str, body: Option<&str>, status: u16) -> Value {
    let r = c.call(n, "POST", path, body);
    assert_eq!(r.status, status, "POST {path}: {}", r.body);
    r.json()
}

/// A probe sandbox created on pod1 through replica 1; asked again while
/// pod1 answers 429 (on a pod that runs one VMM at a time, the last one's
/// may still be ending).
fn created_on_pod1(c: &Cluster) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let body = r#"{"template":"probe","pod":"pod1"}"#;
        let r = c.call(1, "POST", "/v1/sandboxes", Some(body));
        if r.status != 429 || Instant::now() >= deadline {
            assert_eq!(r.status, 201, "{}", r.body);
            return r.json();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A probe sandbox on pod1, running two iterations, then hibernated: its
/// id, its last iteration, and its snapshot's manifest.
fn hibernated_on_pod1(c: &Cluster) -> (String, u64, String) {
    let s = created_on_pod1(c);
    let id = s["id"].as_str().unwrap().to_string();
    assert_eq!(s["pod"], "pod1", "{s}");
    let before = iterations(c, 1, &id, 2);
    assert_exact_sequence(&before, MIB);
    let started = Instant::now();
    let h = post(c, 2, &format!("/v1/sandboxes/{id}/hibernate"), None, 200);
    println!(
        "hibernate with upload through a replica: {:.1} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    assert_eq!(h["sandbox"]["state"], "hibernated", "{h}");
    let manifest = h["sandbox"]["stored_snapshot"]
        .as_str()
        .unwrap_or_else(|| panic!("no stored snapshot: {h}"))
        .to_string();
    // Read back through PostgreSQL: the row keeps the manifest.
    let r = c.call(1, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(r.json()["stored_snapshot"], manifest.as_str(), "{}", r.body);
    let last = iterations(c, 1, &id, 2).last().unwrap().0;
    (id, last, manifest)
}

/// Waits until pod `pod`'s row lists layer `manifest` of `of` as its
/// heartbeats report it (`pods.layers`), all of its bytes held; and its
/// templates' layers beside it.
fn layer_reported(c: &Cluster, pod: &str, manifest: &str, of: &str) {
    let deadline = Instant::now() + WAIT;
    let query = format!(
        "SELECT l->>'of', l->>'bytes', l->>'held' FROM pods, jsonb_array_elements(layers) l \
         WHERE id = '{pod}' AND l->>'layer' = '{manifest}'"
    );
    loop {
        let row = c.sql(&query);
        let fields: Vec<&str> = row.split('|').collect();
        if let [who, bytes, held] = fields[..] {
            let bytes: u64 = bytes.parse().unwrap();
            assert_eq!(who, of, "{row}");
            assert!(bytes > 0, "{row}");
            assert_eq!(held.parse::<u64>().unwrap(), bytes, "{row}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{pod} never reported layer {manifest}: {}",
            c.sql(&format!("SELECT layers FROM pods WHERE id = '{pod}'"))
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let templates = c.sql(&format!(
        "SELECT count(*) FROM pods, jsonb_array_elements(layers) l \
         WHERE id = '{pod}' AND l->>'of' LIKE 'tpl_%' AND (l->>'held')::bigint > 0"
    ));
    assert_ne!(templates, "0", "{pod} lists no template layer held");
}

/// Sandbox `id`, running on pod1 when pod1 was lost for good: it reads
/// as lost through either replica (alone and in the list), every command
/// but a delete answers 409 naming that state, and a delete succeeds
/// without its pod.
fn lost_with_its_pod(c: &Cluster, id: &str, durable_at: Option<&Value>) {
    let path = format!("/v1/sandboxes/{id}");
    for n in [1, 2] {
        let r = c.call(n, "GET", &path, None);
        assert_eq!(r.status, 200, "{}", r.body);
        let s = r.json();
        assert_eq!(s["state"], "lost", "{s}");
        let why = s["failure_reason"].as_str().unwrap_or_default();
        assert!(
            why.contains("pod1 was lost for good") && why.contains("running"),
            "{s}"
        );
        // The time of its last durable state, if it had one.
        assert_eq!(s.get("last_durable_at"), durable_at, "{s}");
        let listed = c.call(n, "GET", "/v1/sandboxes", None).json();
        let listed = listed["sandboxes"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["id"] == id))
            .cloned()
            .unwrap_or_else(|| panic!("{id} not listed: {listed}"));
        assert_eq!(listed["state"], "lost", "{listed}");
    }
    println!(
        "read after its pod was lost: {}",
        c.call(1, "GET", &path, None).body
    );
    for command in ["connect", "hibernate", "pause"] {
        let r = c.call(2, "POST", &format!("{path}/{command}"), None);
        assert_eq!(r.status, 409, "{command}: {}", r.body);
        assert!(r.body.contains("lost"), "{command}: {}", r.body);
    }
    let r = c.call(2, "DELETE", &path, None);
    assert_eq!(r.status, 204, "{}", r.body);
    for n in [1, 2] {
        let r = c.call(n, "GET", &path, None);
        assert_eq!(r.status, 404, "{}", r.body);
    }
}

/// The lines of `part`'s log that say `what`.
fn print_log_lines(c: &Cluster, part: &str, what: &str) {
    let log = std::fs::read_to_string(c.dir.join(format!("{part}.log"))).unwrap_or_default();
    for line in log.lines().filter(|l| l.contains(what)) {
        println!("{part}: {line}");
    }
}

/// The chunk hashes a manifest names.
fn chunks_of(objects: &Path, manifest: &str) -> Vec<String> {
    let text = std::fs::read(objects.join("manifests").join(manifest)).unwrap();
    let m: Value = serde_json::from_slice(&text).unwrap();
    m["files"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|f| f["chunks"].as_array().unwrap().iter())
        .filter_map(|c| c.as_str().map(String::from))
        .collect()
}

/// A chunk only sandbox `bad`'s snapshot (`manifest`) names, corrupted
/// in the directory store `objects`: its wake fails naming the layer and
/// the chunk.
fn corrupted_chunk_fails_the_wake(c: &Cluster, objects: &Path, bad: &str, bad_manifest: &str) {
    // A chunk only the other sandbox's snapshot names, corrupted in the
    // store: its wake fails naming the layer and the chunk.
    let mut others = Vec::new();
    for e in std::fs::read_dir(objects.join("manifests")).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name != *bad_manifest {
            others.extend(chunks_of(objects, &name));
        }
    }
    let own = chunks_of(objects, bad_manifest)
        .into_iter()
        .find(|h| !others.contains(h))
        .expect("a chunk only the sandbox's snapshot has");
    let file = objects.join("chunks").join(&own[..2]).join(&own);
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let r = c.call(1, "POST", &format!("/v1/sandboxes/{bad}/connect"), None);
    assert_eq!(r.status, 500, "{}", r.body);
    let error = &r.json()["error"];
    assert_eq!(error["code"], "bad_snapshot", "{}", r.body);
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains(bad_manifest) && message.contains(&own) && message.contains("corrupt"),
        "{message}"
    );
}

/// Pod `n`'s oversubscription ratio, set through replica 1 (relayed to
/// the pod), once the replicas read its new headroom (`headroom_ok`) from
/// its heartbeats.
fn set_ratio(c: &Cluster, n: u16, ratio: f64, headroom_ok: impl Fn(f64) -> bool) {
    let body = format!(r#"{{"oversubscription_ratio":{ratio}}}"#);
    let r = c.call(1, "PATCH", &format!("/v1/pods/pod{n}"), Some(&body));
    assert_eq!(r.status, 200, "{}", r.body);
    let deadline = Instant::now() + WAIT;
    loop {
        let pods = c.pods();
        let headroom = pods
            .iter()
            .find(|p| p["id"] == format!("pod{n}").as_str())
            .and_then(|p| p["headroom_mib"].as_f64());
        if headroom.is_some_and(&headroom_ok) {
            return;
        }
        assert!(Instant::now() < deadline, "pod{n}'s headroom: {pods:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A sandbox hibernated on pod1, woken when pod1 (up) has no admission
/// room for it: woken on pod2 from the object store (the probe going on
/// with its exact sequence), and pod1's copy released (before: the wake
/// went to pod1, which refused it, 429, however much room pod2 had).
pub fn wake_where_there_is_room(c: &Cluster) {
    let (id, last, _) = hibernated_on_pod1(c);
    let ratio = c
        .pods()
        .iter()
        .find(|p| p["id"] == "pod1")
        .and_then(|p| p["oversubscription_ratio"].as_f64())
        .expect("pod1's ratio");
    // pod1's room: less than a probe's memory.
    set_ratio(c, 1, 0.001, |h| h < 64.0);
    let path = format!("/v1/sandboxes/{id}");
    let started = Instant::now();
    let w = post(c, 2, &format!("{path}/connect"), None, 200);
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(w["sandbox"]["state"], "running", "{w}");
    assert_eq!(w["sandbox"]["pod"], "pod2", "{w}");
    println!("wake on another pod, its own full, through a replica: {ms:.1} ms");
    let after = iterations(c, 2, &id, 2);
    assert!(
        after[0].0 > last && after[0].0 <= last + 1,
        "pod1 ran up to {last}, pod2 goes on from {after:?}"
    );
    assert_exact_sequence(&after, MIB);
    released_by_pod1(c, id.as_str(), &path);
    let r = c.call(1, "DELETE", &path, None);
    assert_eq!(r.status, 204, "{}", r.body);
    set_ratio(c, 1, ratio, |h| h >= 64.0);
}

/// A wake pod1 refuses for room while its heartbeats show room: pod1 runs
/// at most one VMM (`--jail-uids 1`: `TORPOR_CLUSTER_POD1_JAIL_UIDS`),
/// which a sandbox running there holds, so that its admission answers a
/// wake 429 `admission_refused` whatever its memory's headroom. The wake
/// is moved to pod2 and answers from there (its retry by key the same),
/// the probe going on with its exact sequence, pod1's copy released
/// (before: pod1's 429, however much room pod2 had). With pod2 full too,
/// such a wake answers pod1's 429 saying that no other pod had room, the
/// sandbox still pod1's, hibernated, and woken there once pod1 has a VMM
/// to spare. Then a tenant's exec (`guest_call_of_a_tenant_moves`).
pub fn wake_refused_by_its_pod(c: &Cluster) {
    let (id, last, _) = hibernated_on_pod1(c);
    let (stays, stays_last, _) = hibernated_on_pod1(c);
    // pod1's one VMM: a sandbox running there.
    let busy = created_on_pod1(c)["id"].as_str().unwrap().to_string();
    let pod1 = c.pods().into_iter().find(|p| p["id"] == "pod1").unwrap();
    assert!(
        pod1["headroom_mib"].as_f64().is_some_and(|h| h >= 64.0),
        "pod1's heartbeat shows room for a probe: {pod1}"
    );

    let path = format!("/v1/sandboxes/{id}");
    let connect = format!("{path}/connect");
    let key = [("Idempotency-Key", "a-wake-pod1-refuses")];
    let started = Instant::now();
    let r = c.call_with(2, "POST", &connect, &key, None);
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(r.status, 200, "{}", r.body);
    let w = r.json();
    assert_eq!(w["sandbox"]["state"], "running", "{w}");
    assert_eq!(w["sandbox"]["pod"], "pod2", "{w}");
    println!("wake refused by its pod, moved to another, through a replica: {ms:.1} ms");
    print_log_lines(c, "api2", "waking a sandbox on another pod");
    let after = iterations(c, 2, &id, 2);
    assert!(
        after[0].0 > last && after[0].0 <= last + 1,
        "pod1 ran up to {last}, pod2 goes on from {after:?}"
    );
    assert_exact_sequence(&after, MIB);
    // Its retry (by its key, through the other replica): the same answer.
    let r = c.call_with(1, "POST", &connect, &key, None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["sandbox"]["pod"], "pod2", "{}", r.body);
    released_by_pod1(c, id.as_str(), &path);

    // pod2 full too: pod1's refusal, saying so; the sandbox stays.
    let ratio = c
        .pods()
        .iter()
        .find(|p| p["id"] == "pod2")
        .and_then(|p| p["oversubscription_ratio"].as_f64())
        .expect("pod2's ratio");
    set_ratio(c, 2, 0.001, |h| h < 64.0);
    let stays_path = format!("/v1/sandboxes/{stays}");
    let r = c.call(1, "POST", &format!("{stays_path}/connect"), None);
    assert_eq!(r.status, 429, "{}", r.body);
    let error = &r.json()["error"];
    assert_eq!(error["code"], "admission_refused", "{}", r.body);
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("jail uids") && message.contains("no other pod up had admission headroom"),
        "{message}"
    );
    for n in [1, 2] {
        let s = c.call(n, "GET", &stays_path, None).json();
        assert_eq!(
            (&s["state"], &s["pod"]),
            (&"hibernated".into(), &"pod1".into()),
            "{s}"
        );
    }
    let held = c.pod_sandboxes(1);
    assert!(
        held.iter()
            .any(|s| s["id"] == stays.as_str() && s["state"] == "hibernated"),
        "pod1 holds {stays} hibernated: {held:?}"
    );
    // pod1 spares its VMM: the wake is pod1's again (asked again while
    // the running sandbox's VMM ends).
    assert_eq!(
        c.call(1, "DELETE", &format!("/v1/sandboxes/{busy}"), None)
            .status,
        204
    );
    let deadline = Instant::now() + WAIT;
    let w = loop {
        let r = c.call(1, "POST", &format!("{stays_path}/connect"), None);
        if r.status != 429 || Instant::now() >= deadline {
            assert_eq!(r.status, 200, "{}", r.body);
            break r.json();
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(w["sandbox"]["pod"], "pod1", "{w}");
    let after = iterations(c, 1, &stays, 2);
    assert!(
        after[0].0 > stays_last && after[0].0 <= stays_last + 1,
        "pod1 ran up to {stays_last}, then goes on from {after:?}"
    );
    assert_exact_sequence(&after, MIB);
    set_ratio(c, 2, ratio, |h| h >= 64.0);
    for gone in [&path, &stays_path] {
        assert_eq!(c.call(1, "DELETE", gone, None).status, 204);
    }
    guest_call_of_a_tenant_moves(c);
}

/// A probe sandbox of the tenant of `token` created through replica 1
/// and placed on pod `n` (a tenant names no pod: made again until
/// placement picks it, those placed on the other pod deleted, and asked
/// again while a pod refuses it).
fn tenant_sandbox_on(c: &Cluster, token: &str, n: u16) -> String {
    let body = Some(r#"{"template":"probe"}"#);
    let deadline = Instant::now() + WAIT;
    loop {
        let r = as_token(c, 1, token, "POST", "/v1/sandboxes", body);
        match r.status {
            201 if r.json()["pod"] == format!("pod{n}").as_str() => {
                return r.json()["id"].as_str().unwrap().to_string();
            }
            201 => {
                let other = format!("/v1/sandboxes/{}", r.json()["id"].as_str().unwrap());
                assert_eq!(as_token(c, 1, token, "DELETE", &other, None).status, 204);
            }
            429 => std::thread::sleep(Duration::from_millis(100)),
            _ => panic!("{} {}", r.status, r.body),
        }
        assert!(Instant::now() < deadline, "no sandbox placed on pod{n}");
    }
}

/// The same refusal met by a guest call (exec) of a tenant with a quota
/// (whose calls on a hibernated sandbox a replica wakes first, as a
/// `connect`): the wake moves to pod2 and the exec goes there (a probe
/// has no agent: 422). A wake refused by the tenant's quota (429
/// `quota_exceeded`, the same on every pod) does not move it.
fn guest_call_of_a_tenant_moves(c: &Cluster) {
    let (token, _) = tenant_token(c, 1, "mover");
    c.set_quota(1, "mover", r#"{"running_sandboxes":1}"#);
    // Replica 1 reads the tenants again within this (its guard wakes a
    // sandbox first only for a tenant with a quota).
    std::thread::sleep(SHARED_WITHIN);
    let id = tenant_sandbox_on(c, &token, 1);
    let path = format!("/v1/sandboxes/{id}");
    let r = as_token(c, 1, &token, "POST", &format!("{path}/hibernate"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    // pod1's one VMM taken (an admin's sandbox), the tenant's quota by
    // one running on pod2.
    let busy = created_on_pod1(c)["id"].as_str().unwrap().to_string();
    let running = tenant_sandbox_on(c, &token, 2);
    let r = as_token(c, 1, &token, "POST", &format!("{path}/connect"), None);
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "quota_exceeded", "{}", r.body);
    let s = as_token(c, 1, &token, "GET", &path, None).json();
    assert_eq!(
        (&s["state"], &s["pod"]),
        (&"hibernated".into(), &"pod1".into()),
        "{s}"
    );
    let r = as_token(
        c,
        1,
        &token,
        "DELETE",
        &format!("/v1/sandboxes/{running}"),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    // Room in the quota: an exec wakes it first, which pod1 refuses.
    let exec = format!("{path}/exec");
    let r = as_token(c, 1, &token, "POST", &exec, Some(r#"{"argv":["true"]}"#));
    assert_eq!(r.status, 422, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "no_agent", "{}", r.body);
    let s = as_token(c, 1, &token, "GET", &path, None).json();
    assert_eq!(
        (&s["state"], &s["pod"]),
        (&"running".into(), &"pod2".into()),
        "{s}"
    );
    for gone in [path, format!("/v1/sandboxes/{busy}")] {
        assert_eq!(c.call(1, "DELETE", &gone, None).status, 204);
    }
}

/// The scenario on cluster `c`, whose pods share an object store (at
/// `objects` if it is a directory): two sandboxes and a template on pod1,
/// pod1 lost, the first woken on pod2, the template created from on pod2,
/// the second's corrupted chunk (a directory store only) failing its wake.
pub fn outlive_a_lost_pod(c: &Cluster, objects: Option<&Path>) {
    for api in ["api1", "api2"] {
        c.kill(api);
        c.start_api(api, API_ARGS);
    }

    // A template built on pod1 (an admin's: shared).
    let t = post(
        c,
        1,
        "/v1/templates",
        Some(r#"{"name":"moving","kind":"probe","mem_mib":64,"pod":"pod1"}"#),
        201,
    );
    let template = t["id"].as_str().unwrap().to_string();

    // A wake its pod (up) has no room for goes to the other pod.
    wake_where_there_is_room(c);

    // Two sandboxes hibernated on pod1, their snapshots stored.
    let (id, last, manifest) = hibernated_on_pod1(c);
    // Its heartbeats list the layer, all of it held (on its disk), for
    // placement (`cluster/src/placement.rs`).
    layer_reported(c, "pod1", &manifest, &id);
    let (bad, _, bad_manifest) = hibernated_on_pod1(c);

    // And one running there, never hibernated: its state is on pod1 only.
    let s = post(
        c,
        1,
        "/v1/sandboxes",
        Some(r#"{"template":"probe","pod":"pod1"}"#),
        201,
    );
    let running = s["id"].as_str().unwrap().to_string();
    let s = post(
        c,
        1,
        "/v1/sandboxes",
        Some(r#"{"template":"probe","pod":"pod1"}"#),
        201,
    );
    let doomed = s["id"].as_str().unwrap().to_string();
    // And one woken on pod1 from its stored hibernation: running past it.
    let (woken, _, _) = hibernated_on_pod1(c);
    let w = post(c, 1, &format!("/v1/sandboxes/{woken}/connect"), None, 200);
    let durable_at = w["sandbox"]["stored_at"].clone();
    assert!(durable_at.is_i64(), "{w}");

    // What the uploads took, as pod1 logged them.
    print_log_lines(c, "pod1", "snapshot layer stored");

    // pod1 is lost for good.
    c.kill("pod1");
    // A command sent before the replicas know: journaled and published to
    // pod1, which never answers. Once pod1 is lost for good the replicas
    // end it as failed, and a retry with its key reads that failure
    // (before: 202 after the replica's 20 s wait, and each retry published
    // it to pod1 again and answered 202).
    // A delete sent alike, retried with its key once pod1 is lost: the
    // same failure (before: 204 while the sandbox stayed, read `lost`),
    // and a new delete is done without pod1.
    let key = [("Idempotency-Key", "to-a-pod-about-to-be-lost")];
    let hibernate = format!("/v1/sandboxes/{running}/hibernate");
    let delete_key = [("Idempotency-Key", "delete-to-a-pod-about-to-be-lost")];
    let delete = format!("/v1/sandboxes/{doomed}");
    let never_answered = |r: &super::http::HttpResponse, what: &str| {
        assert_eq!(r.status, 409, "{what}: {}", r.body);
        assert!(
            r.body.contains("pod1 was lost for good") && r.body.contains("answered operation"),
            "{what}: {}",
            r.body
        );
    };
    std::thread::scope(|scope| {
        let deleted = scope.spawn(|| c.call_with(1, "DELETE", &delete, &delete_key, None));
        for attempt in ["first", "retry"] {
            never_answered(&c.call_with(2, "POST", &hibernate, &key, None), attempt);
        }
        never_answered(&deleted.join().unwrap(), "delete");
    });
    never_answered(
        &c.call_with(2, "DELETE", &delete, &delete_key, None),
        "delete retried",
    );
    assert_eq!(c.call(1, "GET", &delete, None).json()["state"], "lost");
    assert_eq!(c.call(2, "DELETE", &delete, None).status, 204);
    assert_eq!(c.call(1, "GET", &delete, None).status, 404);
    let path = format!("/v1/sandboxes/{id}");
    // Read while its pod is lost, before a command moves it: its row,
    // running nowhere (before: 503 for good, as if pod1 were only down).
    for n in [1, 2] {
        let r = c.call(n, "GET", &path, None);
        println!("read while its pod is lost: {} {}", r.status, r.body);
        assert_eq!(r.status, 200, "{}", r.body);
        let s = r.json();
        assert_eq!(s["state"], "hibernated", "{s}");
        assert_eq!(s["pod"], "pod1", "{s}");
        assert!(
            s["vmm"].is_null() && s["stored_snapshot"].is_string(),
            "{s}"
        );
    }

    lost_with_its_pod(c, &running, None);
    lost_with_its_pod(c, &woken, Some(&durable_at));

    // A wake through the API: moved to pod2, its memory intact.
    let started = Instant::now();
    let w = post(c, 2, &format!("{path}/connect"), None, 200);
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(w["sandbox"]["state"], "running", "{w}");
    assert_eq!(w["sandbox"]["pod"], "pod2", "{w}");
    assert_eq!(w["resumed"], true, "{w}");
    println!("wake on another pod from the object store, through a replica: {ms:.1} ms");
    println!("its restore on pod2: {}", w["sandbox"]["restore"]);
    print_log_lines(c, "pod2", "object store");
    let after = iterations(c, 2, &id, 2);
    assert!(
        after[0].0 > last && after[0].0 <= last + 1,
        "pod1 ran up to {last}, pod2 goes on from {after:?}"
    );
    assert_exact_sequence(&after, MIB);
    let r = c.call(1, "GET", &path, None);
    assert_eq!(r.json()["pod"], "pod2", "{}", r.body);
    // It lives on pod2 now: hibernated and woken again there.
    let h = post(c, 1, &format!("{path}/hibernate"), None, 200);
    assert_eq!(h["sandbox"]["pod"], "pod2", "{h}");
    // The moment of a move: pod2 holds the sandbox it adopted, hibernated,
    // while its row still names pod1 (the replica has not moved the row
    // yet). pod2's heartbeats in that moment must not have it released
    // (before: a heartbeat handled then asked pod2 to release the copy the
    // replica was about to give it, and the sandbox went from both pods).
    c.sql(&format!(
        "UPDATE sandboxes SET pod = 'pod1' WHERE id = '{id}';
         INSERT INTO operations (id, kind, sandbox, pod, tenant, status)
         SELECT 'op_adoptinflight', 'adopt', id, 'pod2', coalesce(tenant, ''), 'pending'
         FROM sandboxes WHERE id = '{id}'"
    ));
    std::thread::sleep(Duration::from_secs(4));
    c.sql(&format!(
        "UPDATE sandboxes SET pod = 'pod2' WHERE id = '{id}';
         UPDATE operations SET status = 'done', finished_at = now() WHERE id = 'op_adoptinflight'"
    ));
    assert!(
        c.pod_sandboxes(2).iter().any(|s| s["id"] == id.as_str()),
        "pod2 released the sandbox it was adopting"
    );
    let w = post(c, 1, &format!("{path}/connect"), None, 200);
    assert_eq!(w["sandbox"]["state"], "running", "{w}");
    assert_exact_sequence(&iterations(c, 2, &id, 2), MIB);

    // The template pod1 built creates on pod2.
    let s = post(
        c,
        2,
        "/v1/sandboxes",
        Some(&format!(r#"{{"template":"{template}"}}"#)),
        201,
    );
    assert_eq!(s["pod"], "pod2", "{s}");
    assert_eq!(s["state"], "running", "{s}");
    let made = s["id"].as_str().unwrap().to_string();
    assert_exact_sequence(&iterations(c, 2, &made, 2), MIB);

    // A chunk corrupted in the store: the wake fails naming it.
    if let Some(objects) = objects {
        corrupted_chunk_fails_the_wake(c, objects, &bad, &bad_manifest);
    }
    // pod1 comes back: it releases the sandbox that moved away (asked
    // by a replica from its heartbeat), and wakes the one that did not
    // move from its own disk.
    c.start("pod1");
    let deadline = Instant::now() + WAIT;
    while c.pod_sandboxes(1).iter().any(|s| s["id"] == id.as_str()) {
        assert!(Instant::now() < deadline, "pod1 still holds {id}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = std::fs::read_to_string(c.dir.join("pod1.log")).unwrap();
    assert!(
        log.lines()
            .any(|l| l.contains("released a sandbox that moved") && l.contains(&id)),
        "pod1's log:\n{log}"
    );
    // And it deletes the one deleted while it was lost, whose VMM it
    // found still running.
    while c
        .pod_sandboxes(1)
        .iter()
        .any(|s| s["id"] == running.as_str())
    {
        assert!(Instant::now() < deadline, "pod1 still holds {running}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let r = c.call(1, "GET", &format!("/v1/sandboxes/{running}"), None);
    assert_eq!(r.status, 404, "{}", r.body);
    let mut woken = c.call(2, "POST", &format!("/v1/sandboxes/{bad}/connect"), None);
    while woken.status == 503 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        woken = c.call(2, "POST", &format!("/v1/sandboxes/{bad}/connect"), None);
    }
    assert_eq!(woken.status, 200, "{}", woken.body);
    assert_eq!(woken.json()["sandbox"]["pod"], "pod1", "{}", woken.body);
    assert_exact_sequence(&iterations(c, 1, &bad, 2), MIB);

    // Nothing else is affected.
    let r = c.call(2, "GET", &path, None);
    assert_eq!(r.json()["state"], "running", "{}", r.body);
    assert_eq!(c.call(2, "DELETE", &path, None).status, 204);
    assert_eq!(
        c.call(2, "DELETE", &format!("/v1/sandboxes/{made}"), None)
            .status,
        204
    );
}

/// SeaweedFS on loopback (`scripts/object-store start`: free ports, a
/// scratch directory, stopped when this process ends): its variables
/// (`TORPOR_OBJECT_STORE`, `AWS_*`).
pub fn seaweedfs() -> HashMap<String, String> {
    // One server per test binary: its tests start it one at a time (the
    // first starts it, the others find it running), since two starts at
    // once in one directory would each remove the other's.
    static STARTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = STARTING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("torpor-object-store-{}", std::process::id()));
    super::seaweedfs::start(&dir)
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .collect()
}

/// Durable checkpoints (pods with `--checkpoint-interval-s`) on cluster
/// `c`: a sandbox running on pod1, checkpointed there, wakes on pod2 once
/// pod1 is lost for good, as it was at its last checkpoint (the probe
/// going on with its exact sequence from an iteration pod1 ran); pod1,
/// back, releases its copy (its VMM stopped).
pub fn durable_checkpoints_outlive_a_lost_pod(c: &Cluster) {
    for api in ["api1", "api2"] {
        c.kill(api);
        c.start_api(api, API_ARGS);
    }
    let s = post(
        c,
        1,
        "/v1/sandboxes",
        Some(r#"{"template":"probe","pod":"pod1"}"#),
        201,
    );
    let id = s["id"].as_str().unwrap().to_string();
    let path = format!("/v1/sandboxes/{id}");
    // Three iterations run, then a checkpoint stored after them.
    let before = iterations(c, 1, &id, 3);
    let after_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let deadline = Instant::now() + WAIT;
    let checkpointed = loop {
        let r = c.call(2, "GET", &path, None).json();
        let durable = r["snapshot"]
            .as_str()
            .and_then(|p| Path::new(p).file_name())
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("durable-"));
        if durable && r["stored_snapshot"].is_string() && r["stored_at"].as_i64() > Some(after_ms) {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "no durable checkpoint after {before:?}: {r}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(checkpointed["state"], "running", "{checkpointed}");
    print_log_lines(c, "pod1", "durable checkpoint stored");

    // pod1 is lost for good, the sandbox running there.
    c.kill("pod1");
    let last = iterations(c, 1, &id, 3).last().unwrap().0;
    std::thread::sleep(Duration::from_secs(5));
    let started = Instant::now();
    let w = post(c, 2, &format!("{path}/connect"), None, 200);
    println!(
        "wake on another pod from a durable checkpoint: {:.1} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    assert_eq!(w["sandbox"]["state"], "running", "{w}");
    assert_eq!(w["sandbox"]["pod"], "pod2", "{w}");
    let woken = iterations(c, 2, &id, 2);
    assert_exact_sequence(&woken, MIB);
    // It goes on from an iteration pod1 ran after the first three: not
    // the template's start, not past what pod1 reached.
    let first = woken[0].0;
    assert!(
        first > before[2].0 && first <= last + 1,
        "pod1 ran {before:?} .. {last}, pod2 goes on from {woken:?}"
    );
    println!(
        "pod1 reached iteration {last}; pod2 went on from {first} ({} lost)",
        last + 1 - first
    );

    // pod1 comes back: it releases its copy, still running there. A
    // release asked of it before, which failed, does not stand in the
    // way: it is asked again.
    c.sql(&format!(
        "INSERT INTO operations (id, kind, sandbox, pod, tenant, idempotency_key, status,
             finished_at)
         SELECT 'op_failedrelease', 'release', id, 'pod1', coalesce(tenant, ''),
             'release-{id}-pod1', 'failed', now() - interval '1 minute'
         FROM sandboxes WHERE id = '{id}'"
    ));
    c.start("pod1");
    let deadline = Instant::now() + WAIT;
    while c.pod_sandboxes(1).iter().any(|s| s["id"] == id.as_str()) {
        assert!(Instant::now() < deadline, "pod1 still holds {id}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let r = c.call(1, "GET", &path, None);
    assert_eq!(r.json()["pod"], "pod2", "{}", r.body);
    assert_eq!(c.call(1, "DELETE", &path, None).status, 204);
}

/// pod1 is asked to release its copy of sandbox `id` moved to pod2 (by its
/// next heartbeat), and both replicas say it is pod2's (`path`: its URL).
fn released_by_pod1(c: &Cluster, id: &str, path: &str) {
    let deadline = Instant::now() + WAIT;
    while c.pod_sandboxes(1).iter().any(|s| s["id"] == id) {
        assert!(Instant::now() < deadline, "pod1 still holds {id}");
        std::thread::sleep(Duration::from_millis(200));
    }
    for n in [1, 2] {
        let r = c.call(n, "GET", path, None);
        assert_eq!(r.json()["pod"], "pod2", "{}", r.body);
    }
}
