//! The cluster under faults (`tests/cluster_chaos.rs` with a few,
//! `benches/cluster_chaos.rs` with ≥ 100): clients run creates,
//! hibernates, wakes and deletes with idempotency keys through random
//! replicas while a driver injects faults (kill -9 of a replica, a pod or
//! nats-server; a restart of PostgreSQL), each followed by a restart of
//! what it hit, and, with [`Chaos::lose_pod`], once a pod lost for good
//! (killed with its VMMs, as its machine would be, and never restarted:
//! its hibernated sandboxes wake on the other pod from the object store,
//! its running ones read `lost`). Then the checks: every operation
//! acknowledged to a client is reflected in the final state, and every
//! sandbox acknowledged hibernated wakes; no sandbox exists twice; no VMM
//! runs that no pod accounts for; no JetStream message is left unacked.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::cluster::Cluster;
use super::http::HttpResponse;

/// The pods run no standby pool (every VMM is a sandbox's, so VMMs can be
/// counted against sandboxes) and no idle policy (states change only by
/// the clients' commands).
pub const POD_ARGS: &str = "--policy-interval-ms 0 --standby-pool 0";
/// The replicas': a pod silent 3 s is down, 8 s lost for good (a pod a
/// fault killed is back well within that).
pub const API_ARGS: &str = "--cluster-down-after-ms 3000 --cluster-lost-after-ms 8000";
/// An operation gets a definite answer within this, retries included
/// (a pod's unacked work item comes again after the consumer's 10 s ack
/// wait; a pod down holds its queue until it is back).
const ANSWER_LIMIT: Duration = Duration::from_secs(240);
/// Each request's own limit.
const REQUEST_LIMIT: Duration = Duration::from_secs(60);
/// Sandboxes a client keeps at most.
const MAX_LIVE: usize = 4;

pub const KINDS: [&str; 4] = ["replica", "pod", "nats", "postgres"];
/// The fault [`Chaos::lose_pod`] adds once.
pub const POD_LOST: &str = "pod lost for good";

/// What to run.
pub struct Chaos {
    pub faults: usize,
    pub clients: usize,
    pub seed: u64,
    /// Pause between faults, ms (a random one in this range).
    pub pause_ms: (u64, u64),
    /// Whether one of the faults, a third to two thirds into the run, is a
    /// pod lost for good.
    pub lose_pod: bool,
}

/// The cluster the run needs, started ([`POD_ARGS`], [`API_ARGS`]).
pub fn cluster(name: &str) -> Cluster {
    Cluster::up_with_api(name, POD_ARGS, API_ARGS)
}

/// What happened and what the checks found.
#[derive(Debug, Default)]
pub struct Report {
    pub attempted: usize,
    pub acknowledged: usize,
    pub retried: usize,
    /// Operations whose definite answer was an error (not acknowledged).
    pub refused: usize,
    pub faults: BTreeMap<&'static str, usize>,
    /// Acknowledged operations the final state does not reflect, and
    /// sandboxes acknowledged hibernated that did not wake.
    pub lost: Vec<String>,
    /// Sandboxes acknowledged hibernated, woken at the end (of them, on
    /// the pod lost for good).
    pub woken: usize,
    pub woken_from_lost_pod: usize,
    /// Sandboxes hibernated on the pod lost for good when it was lost, as
    /// the replicas knew them, their snapshots stored; of them, those on
    /// the other pod at the end (moved by a wake during the run or at the
    /// end) and those a client deleted.
    pub hibernated_on_lost_pod: Vec<String>,
    /// Sandboxes hibernated there whose snapshot was not stored (were its
    /// hibernation acknowledged, the state check would count it lost).
    pub unstored_on_lost_pod: Vec<String>,
    pub moved_from_lost_pod: usize,
    /// Of them, those still there at the end (no command came for them
    /// during the run), moved by a wake at the end.
    pub moved_at_the_end: usize,
    pub deleted_from_lost_pod: usize,
    /// Of them, those a client changed between the listing and the kill
    /// (a wake the pod answered: a later generation), which went with it.
    pub changed_before_the_kill: usize,
    /// Sandboxes running on the pod lost for good, read `lost` at the end
    /// (their state went with the pod: not an acknowledged operation lost).
    pub running_lost_with_pod: usize,
    /// The pod lost for good.
    pub lost_pod: Option<u16>,
    /// Sandboxes more than once (on two pods, or a create made twice).
    pub doubled: Vec<String>,
    /// VMMs no pod accounts for, and sandboxes a pod says run without one.
    pub stray_vmms: Vec<String>,
    /// JetStream messages left unacked.
    pub unacked: Vec<String>,
    pub elapsed: Duration,
}

impl Report {
    pub fn table(&self) -> String {
        let mut t = comfy_table::Table::new();
        t.load_style(comfy_table::presets::UTF8_FULL_CONDENSED);
        t.set_header(vec!["chaos", "count"]);
        let mut row = |k: String, v: usize| {
            t.add_row(vec![k, v.to_string()]);
        };
        row("operations attempted".into(), self.attempted);
        row("acknowledged".into(), self.acknowledged);
        row("retried (requests)".into(), self.retried);
        row("answered with an error".into(), self.refused);
        for kind in KINDS.into_iter().chain([POD_LOST]) {
            row(
                format!("faults: {kind}"),
                self.faults.get(kind).copied().unwrap_or(0),
            );
        }
        row("hibernated, woken at the end".into(), self.woken);
        row(
            "  of them moved from the lost pod".into(),
            self.woken_from_lost_pod,
        );
        row(
            "running on the lost pod, read lost".into(),
            self.running_lost_with_pod,
        );
        row(
            "hibernated on the lost pod when lost".into(),
            self.hibernated_on_lost_pod.len(),
        );
        row(
            "  without a stored snapshot (not counted)".into(),
            self.unstored_on_lost_pod.len(),
        );
        row(
            "  of them on the other pod at the end".into(),
            self.moved_from_lost_pod,
        );
        row(
            "    moved by a wake at the end".into(),
            self.moved_at_the_end,
        );
        row(
            "  of them deleted by a client".into(),
            self.deleted_from_lost_pod,
        );
        row(
            "  of them changed before the kill".into(),
            self.changed_before_the_kill,
        );
        row("lost (must be 0)".into(), self.lost.len());
        row("doubled sandboxes".into(), self.doubled.len());
        row("unaccounted VMMs".into(), self.stray_vmms.len());
        row("unacked JetStream messages".into(), self.unacked.len());
        let mut text = format!("{t}\nin {:.0} s\n", self.elapsed.as_secs_f64());
        for (what, list) in [
            ("lost", &self.lost),
            ("doubled", &self.doubled),
            ("unaccounted VMM", &self.stray_vmms),
            ("unacked", &self.unacked),
        ] {
            for item in list {
                text.push_str(&format!("{what}: {item}\n"));
            }
        }
        text
    }
}

/// xorshift64*: enough randomness for a workload, reproducible by seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A seed from the clock, printed so a run can be repeated.
pub fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id())
}

/// What a client believes of one of its sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    Running,
    Hibernated,
    Deleted,
    /// Its last operation was answered with an error: read it again.
    Unknown,
    /// Read again and found failed or paused: deleted next.
    Other,
}

#[derive(Default)]
struct Counters {
    attempted: AtomicUsize,
    acknowledged: AtomicUsize,
    retried: AtomicUsize,
    refused: AtomicUsize,
}

/// One client's sandboxes (what it believes of each, and whether that
/// is an acknowledged operation's outcome rather than a read) and the
/// creates whose answer was an error (each may or may not have made one).
#[derive(Default)]
struct Model {
    sandboxes: BTreeMap<String, (Known, bool)>,
    uncertain_creates: usize,
}

/// Sends one operation until it has a definite answer: a connection that
/// failed, a 202 (still running), 429, 502, 503 and 504 are retried with
/// the same `Idempotency-Key` through a random replica.
fn definite(
    c: &Cluster,
    rng: &mut Rng,
    counters: &Counters,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&str>,
) -> HttpResponse {
    let started = Instant::now();
    let mut tries = 0u32;
    loop {
        if tries > 0 {
            counters.retried.fetch_add(1, Ordering::Relaxed);
            let pause = 100 * u64::from(tries.min(10));
            std::thread::sleep(Duration::from_millis(pause));
        }
        tries += 1;
        let n = 1 + rng.below(2) as u16;
        let headers: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
        let last = match c.try_call(n, method, path, &headers, body, REQUEST_LIMIT) {
            Ok(r) if !matches!(r.status, 202 | 429 | 502 | 503 | 504) => return r,
            Ok(r) => format!("{} {}", r.status, r.body),
            Err(e) => e,
        };
        assert!(
            started.elapsed() < ANSWER_LIMIT,
            "{method} {path} (key {key:?}) has no definite answer after {ANSWER_LIMIT:?}: {last}"
        );
    }
}

/// One client's workload until `stop`.
fn client(c: &Cluster, n: usize, seed: u64, stop: &AtomicBool, counters: &Counters) -> Model {
    let mut rng = Rng::new(seed);
    let mut model = Model::default();
    let mut op = 0usize;
    while !stop.load(Ordering::Relaxed) {
        op += 1;
        let key = format!("chaos-{seed:x}-{n}-{op}");
        let live: Vec<(String, Known)> = model
            .sandboxes
            .iter()
            .filter(|(_, (k, _))| *k != Known::Deleted)
            .map(|(id, (k, _))| (id.clone(), *k))
            .collect();
        if live.len() < 2 || (live.len() < MAX_LIVE && rng.below(4) == 0) {
            counters.attempted.fetch_add(1, Ordering::Relaxed);
            let body = Some(r#"{"template":"probe"}"#);
            let r = definite(
                c,
                &mut rng,
                counters,
                "POST",
                "/v1/sandboxes",
                Some(&key),
                body,
            );
            if r.status == 201 {
                let id = r.json()["id"].as_str().unwrap().to_string();
                counters.acknowledged.fetch_add(1, Ordering::Relaxed);
                model.sandboxes.insert(id, (Known::Running, true));
            } else {
                counters.refused.fetch_add(1, Ordering::Relaxed);
                model.uncertain_creates += 1;
            }
            continue;
        }
        let (id, known) = &live[rng.below(live.len() as u64) as usize];
        let path = format!("/v1/sandboxes/{id}");
        if *known == Known::Unknown {
            // Read it again (not an operation).
            let r = definite(c, &mut rng, counters, "GET", &path, None, None);
            let state = (r.status == 200).then(|| r.json()["state"].clone());
            let now = match (r.status, state.as_ref().and_then(Value::as_str)) {
                (404, _) => Known::Deleted,
                (200, Some("running")) => Known::Running,
                (200, Some("hibernated")) => Known::Hibernated,
                // Failed, paused, or between states: delete it next.
                _ => Known::Other,
            };
            model.sandboxes.insert(id.clone(), (now, false));
            continue;
        }
        counters.attempted.fetch_add(1, Ordering::Relaxed);
        let delete = *known == Known::Other || rng.below(5) == 0;
        let (method, path, want, after) = match (known, delete) {
            (_, true) => ("DELETE", path, 204, Known::Deleted),
            (Known::Running, false) => {
                ("POST", format!("{path}/hibernate"), 200, Known::Hibernated)
            }
            _ => ("POST", format!("{path}/connect"), 200, Known::Running),
        };
        let r = definite(c, &mut rng, counters, method, &path, Some(&key), None);
        // A retry answers the first outcome: a delete retried after its
        // first attempt removed the sandbox is 204 too, not 404.
        if r.status == want {
            counters.acknowledged.fetch_add(1, Ordering::Relaxed);
            model.sandboxes.insert(id.clone(), (after, true));
        } else {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            model.sandboxes.insert(id.clone(), (Known::Unknown, false));
        }
    }
    model
}

/// Injects `chaos.faults` faults, each followed by a restart of what it
/// hit but the pod lost for good ([`Chaos::lose_pod`]), which it sets in
/// `lost`.
fn driver(
    c: &Cluster,
    chaos: &Chaos,
    faults: &Mutex<BTreeMap<&'static str, usize>>,
    lost: &Mutex<Option<(u16, Vec<Value>)>>,
) {
    let mut rng = Rng::new(chaos.seed ^ 0x5eed);
    let (lo, hi) = chaos.pause_ms;
    let third = chaos.faults / 3;
    let loss_at = chaos
        .lose_pod
        .then(|| third + rng.below(third as u64 + 1) as usize);
    for i in 0..chaos.faults {
        std::thread::sleep(Duration::from_millis(
            lo + rng.below(hi.saturating_sub(lo) + 1),
        ));
        let gone = lost.lock().unwrap().as_ref().map(|(pod, _)| *pod);
        if loss_at == Some(i) {
            // The pod holding more hibernated sandboxes (the loss
            // is about them), either on a tie; as the replicas know
            // them (what a pod did but could not report yet is not
            // known to be there).
            let known = listed_now(c);
            let hibernated = |n: u16| -> Vec<Value> {
                let pod = format!("pod{n}");
                known
                    .values()
                    .filter(|s| s["state"] == "hibernated" && s["pod"] == pod.as_str())
                    .cloned()
                    .collect()
            };
            let (one, two) = (hibernated(1), hibernated(2));
            let first = 1 + rng.below(2) as u16;
            let pod = match one.len().cmp(&two.len()) {
                std::cmp::Ordering::Greater => 1,
                std::cmp::Ordering::Less => 2,
                std::cmp::Ordering::Equal => first,
            };
            let held = if pod == 1 { one } else { two };
            eprintln!(
                "chaos: fault {}/{}: pod{pod} lost for good, {} sandbox(es) hibernated there",
                i + 1,
                chaos.faults,
                held.len()
            );
            lose_pod(c, pod);
            *lost.lock().unwrap() = Some((pod, held));
            *faults.lock().unwrap().entry(POD_LOST).or_default() += 1;
            continue;
        }
        let kind = KINDS[rng.below(KINDS.len() as u64) as usize];
        let part = match kind {
            "replica" => format!("api{}", 1 + rng.below(2)),
            // The pod lost stays so: the other one.
            "pod" => match gone {
                Some(pod) => format!("pod{}", 3 - pod),
                None => format!("pod{}", 1 + rng.below(2)),
            },
            other => other.to_string(),
        };
        eprintln!("chaos: fault {}/{}: {kind} ({part})", i + 1, chaos.faults);
        if kind == "postgres" {
            c.stop("postgres");
        } else {
            c.kill(&part);
        }
        // Down for a moment, then back.
        std::thread::sleep(Duration::from_millis(200 + rng.below(800)));
        c.start(&part);
        *faults.lock().unwrap().entry(kind).or_default() += 1;
    }
}

/// Pod `pod` gone as its machine would go: `kill -9` of it and of every
/// VMM it ran; never restarted.
fn lose_pod(c: &Cluster, pod: u16) {
    c.kill(&format!("pod{pod}"));
    let pids: Vec<String> = c
        .vmms()
        .iter()
        .filter(|v| v.pod == pod)
        .map(|v| v.pid.to_string())
        .collect();
    if !pids.is_empty() {
        // Some may have ended meanwhile: the status is not checked.
        let _ = std::process::Command::new("kill")
            .arg("-9")
            .args(&pids)
            .status();
    }
}

/// Runs the workload and the faults, then checks the cluster.
pub fn run(c: &Cluster, chaos: &Chaos) -> Report {
    let started = Instant::now();
    let counters = Counters::default();
    let stop = AtomicBool::new(false);
    let faults = Mutex::new(BTreeMap::new());
    let lost = Mutex::new(None::<(u16, Vec<Value>)>);
    let models: Vec<Model> = std::thread::scope(|s| {
        let clients: Vec<_> = (0..chaos.clients)
            .map(|n| {
                let (stop, counters) = (&stop, &counters);
                let seed = chaos.seed.wrapping_add(n as u64 * 7919);
                s.spawn(move || client(c, n, seed, stop, counters))
            })
            .collect();
        // The clients stop with the driver, also when it panics.
        let driven = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            driver(c, chaos, &faults, &lost)
        }));
        stop.store(true, Ordering::Relaxed);
        let models = clients.into_iter().map(|h| h.join().unwrap()).collect();
        if let Err(panic) = driven {
            std::panic::resume_unwind(panic);
        }
        models
    });
    let mut report = Report {
        attempted: counters.attempted.load(Ordering::Relaxed),
        acknowledged: counters.acknowledged.load(Ordering::Relaxed),
        retried: counters.retried.load(Ordering::Relaxed),
        refused: counters.refused.load(Ordering::Relaxed),
        faults: faults.into_inner().unwrap(),
        ..Report::default()
    };
    let mut held_then = BTreeMap::new();
    if let Some((pod, held)) = lost.into_inner().unwrap() {
        report.lost_pod = Some(pod);
        for s in held {
            let id = s["id"].as_str().unwrap_or_default().to_string();
            if s["stored_snapshot"].is_string() {
                report.hibernated_on_lost_pod.push(id.clone());
                held_then.insert(id, s);
            } else {
                report.unstored_on_lost_pod.push(id);
            }
        }
    }
    c.wait_pods(if report.lost_pod.is_some() { 1 } else { 2 });
    check_state(c, &models, &mut report);
    check_wakes(c, chaos.seed, &models, &mut report);
    check_moved(c, chaos.seed, &models, &held_then, &mut report);
    check_vmms(c, &mut report);
    // What the lost pod was sent stays unacked in its consumer: its
    // operations are ended by the replicas (`expiry.rs`).
    let lost_consumer = report.lost_pod.map(|p| format!("pod-pod{p}"));
    let skip: Vec<&str> = lost_consumer.iter().map(String::as_str).collect();
    report.unacked = c.unacked_messages_but(Duration::from_secs(30), &skip);
    report.elapsed = started.elapsed();
    report
}

/// [`listed`] while faults come and go: through either replica, until
/// one answers (30 s).
fn listed_now(c: &Cluster) -> BTreeMap<String, Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for n in [1, 2] {
            match c.try_call(n, "GET", "/v1/sandboxes", &[], None, REQUEST_LIMIT) {
                Ok(r) if r.status == 200 => {
                    return r.json()["sandboxes"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|s| (s["id"].as_str().unwrap().to_string(), s.clone()))
                        .collect()
                }
                _ => {}
            }
        }
        assert!(
            Instant::now() < deadline,
            "no replica lists the sandboxes in 30 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The sandboxes in PostgreSQL (through a replica).
fn listed(c: &Cluster) -> BTreeMap<String, Value> {
    let r = c.call(1, "GET", "/v1/sandboxes", None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["id"].as_str().unwrap().to_string(), s.clone()))
        .collect()
}

/// Acknowledged states against the final one; sandboxes twice.
fn check_state(c: &Cluster, models: &[Model], report: &mut Report) {
    let listed = listed(c);
    let mut known = BTreeSet::new();
    for model in models {
        for (id, (k, acknowledged)) in &model.sandboxes {
            known.insert(id.clone());
            let state = listed.get(id).and_then(|s| s["state"].as_str());
            let pod = listed.get(id).and_then(|s| s["pod"].as_str());
            let on_lost_pod = report.lost_pod.map(|p| format!("pod{p}")).as_deref() == pod;
            if *acknowledged && *k == Known::Running && state == Some("lost") && on_lost_pod {
                report.running_lost_with_pod += 1;
                continue;
            }
            let ok = !acknowledged
                || match k {
                    Known::Running => state == Some("running"),
                    Known::Hibernated => state == Some("hibernated"),
                    Known::Deleted => state.is_none(),
                    Known::Unknown | Known::Other => true,
                };
            if !ok {
                report
                    .lost
                    .push(format!("sandbox {id}: acknowledged {k:?}, final {state:?}"));
            }
        }
    }
    // Each pod's own sandboxes: none on two pods; none the clients do not
    // know beyond the creates answered with an error.
    let mut on: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    for pod in [1, 2].into_iter().filter(|p| Some(*p) != report.lost_pod) {
        for s in c.pod_sandboxes(pod) {
            on.entry(s["id"].as_str().unwrap().to_string())
                .or_default()
                .push(pod);
        }
    }
    for (id, pods) in &on {
        if pods.len() > 1 {
            report.doubled.push(format!("{id} on pods {pods:?}"));
        }
    }
    let unknown: Vec<&String> = on.keys().filter(|id| !known.contains(*id)).collect();
    let uncertain: usize = models.iter().map(|m| m.uncertain_creates).sum();
    if unknown.len() > uncertain {
        report.doubled.push(format!(
            "{} sandboxes no client made ({unknown:?}), {uncertain} creates answered with an error",
            unknown.len()
        ));
    }
}

/// Every sandbox acknowledged hibernated (and so listed) wakes through a
/// replica, running on a pod up: those of the pod lost for good move to
/// the other one from the object store.
fn check_wakes(c: &Cluster, seed: u64, models: &[Model], report: &mut Report) {
    let mut rng = Rng::new(seed ^ 0x3a4e);
    let counters = Counters::default();
    let listed = listed(c);
    let lost_pod = report.lost_pod.map(|p| format!("pod{p}"));
    for model in models {
        for (id, (k, acknowledged)) in &model.sandboxes {
            let Some(before) = listed.get(id) else {
                continue;
            };
            if !(*acknowledged && *k == Known::Hibernated && before["state"] == "hibernated") {
                continue;
            }
            let key = format!("chaos-{seed:x}-wake-{id}");
            let path = format!("/v1/sandboxes/{id}/connect");
            let r = definite(c, &mut rng, &counters, "POST", &path, Some(&key), None);
            let after = (r.status == 200).then(|| r.json()["sandbox"].clone());
            let running = after.as_ref().is_some_and(|s| s["state"] == "running");
            let pod = after.as_ref().and_then(|s| s["pod"].as_str());
            if !running || pod.is_none() || pod == lost_pod.as_deref() {
                report.lost.push(format!(
                    "sandbox {id}: acknowledged hibernated on {}, its wake answered {} {}",
                    before["pod"], r.status, r.body
                ));
                continue;
            }
            report.woken += 1;
            if before["pod"].as_str() == lost_pod.as_deref() {
                report.woken_from_lost_pod += 1;
            }
        }
    }
}

/// What became of the sandboxes hibernated on the pod lost for good
/// (`held`: as listed just before the kill): each is on the other pod
/// now, or a client deleted it (acknowledged); one still listed on the
/// lost pod, hibernated (no command came for it), moves with a wake now.
/// One a client changed after the listing, before the kill (its
/// generation later, read lost: a wake the pod answered) went with the
/// pod; anything else is lost.
fn check_moved(
    c: &Cluster,
    seed: u64,
    models: &[Model],
    held: &BTreeMap<String, Value>,
    report: &mut Report,
) {
    let mut rng = Rng::new(seed ^ 0x40fe);
    let counters = Counters::default();
    let listed = listed(c);
    let lost_pod = report.lost_pod.map(|p| format!("pod{p}"));
    for id in report.hibernated_on_lost_pod.clone() {
        let deleted = models
            .iter()
            .any(|m| m.sandboxes.get(&id) == Some(&(Known::Deleted, true)));
        let then = held[&id]["generation"].as_u64().unwrap_or_default();
        match listed.get(&id) {
            None if deleted => report.deleted_from_lost_pod += 1,
            Some(s) if s["pod"].as_str() != lost_pod.as_deref() => report.moved_from_lost_pod += 1,
            Some(s) if s["state"] == "hibernated" => {
                let key = format!("chaos-{seed:x}-move-{id}");
                let path = format!("/v1/sandboxes/{id}/connect");
                let r = definite(c, &mut rng, &counters, "POST", &path, Some(&key), None);
                let after = (r.status == 200).then(|| r.json()["sandbox"].clone());
                let pod = after.as_ref().and_then(|s| s["pod"].as_str());
                if after.as_ref().is_some_and(|s| s["state"] == "running")
                    && pod.is_some()
                    && pod != lost_pod.as_deref()
                {
                    report.moved_from_lost_pod += 1;
                    report.moved_at_the_end += 1;
                } else {
                    report.lost.push(format!(
                        "sandbox {id}: hibernated on the lost pod, its wake at the end answered {} {}",
                        r.status, r.body
                    ));
                }
            }
            Some(s) if s["state"] == "lost" && s["generation"].as_u64() > Some(then) => {
                report.changed_before_the_kill += 1;
            }
            other => report.lost.push(format!(
                "sandbox {id}: hibernated on the lost pod (generation {then}), at the end {}",
                other.map_or("not listed (no delete acknowledged)".to_string(), |s| s
                    .to_string())
            )),
        }
    }
}

/// Every VMM under the cluster's directory is a running or paused sandbox
/// of the pod it belongs to, and every such sandbox has one. Pods restart
/// and re-attach: a few tries.
fn check_vmms(c: &Cluster, report: &mut Report) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut problems = Vec::new();
        let vmms = c.vmms();
        for pod in [1u16, 2]
            .into_iter()
            .filter(|p| Some(*p) != report.lost_pod)
        {
            let live: BTreeSet<String> = c
                .pod_sandboxes(pod)
                .iter()
                .filter(|s| matches!(s["state"].as_str(), Some("running" | "paused")))
                .map(|s| s["id"].as_str().unwrap().to_string())
                .collect();
            // A jailed VMM runs under its supervisor (a torpor-vmm too):
            // one VMM per sandbox is one process tree.
            let mut running: BTreeMap<String, Vec<(u32, u32)>> = BTreeMap::new();
            for v in vmms.iter().filter(|v| v.pod == pod) {
                running
                    .entry(v.sandbox.clone())
                    .or_default()
                    .push((v.pid, v.ppid));
            }
            for (id, procs) in &running {
                let roots: Vec<u32> = procs
                    .iter()
                    .filter(|(_, ppid)| !procs.iter().any(|(p, _)| p == ppid))
                    .map(|(p, _)| *p)
                    .collect();
                if !live.contains(id) || roots.len() > 1 {
                    problems.push(format!(
                        "pod{pod}: VMM(s) {roots:?} of {id}; running there: {}",
                        live.contains(id)
                    ));
                }
            }
            for id in live.iter().filter(|id| !running.contains_key(*id)) {
                problems.push(format!("pod{pod}: sandbox {id} runs without a VMM"));
            }
        }
        if problems.is_empty() || Instant::now() >= deadline {
            report.stray_vmms = problems;
            return;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}
