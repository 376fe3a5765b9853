//! The memory-hog run (issue 30): probe guests that each rewrite 64 MiB
//! of their memory once a second, at ratio 4 on a pod given a memory budget
//! of about eight of them. Admission alone would let 32 in; the pressure
//! marks keep what they hold resident under the hard mark throughout:
//! above the high mark the policy hibernates the coldest down to the low
//! mark, and a create or wake whose sandbox (at what its template's
//! sandboxes hold) would take the pod past the hard mark answers 429
//! `rate_limited` with `Retry-After`; nothing is OOM-killed. It prints
//! the timeline.
//!
//! The service runs in process with real, jailed VMMs (resident memory is
//! read from their cgroups), its policy thread off: the test runs the
//! policy's rounds itself, after each paced create, and withholds them
//! during a burst (creates faster than the policy reacts), so what each
//! step meets is deterministic. Needs root (the jail): see tests/needs.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::http::{request, HttpResponse, InProcessApi};
use common::serve::DataDir;
use serde_json::{json, Value};
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::policy::Marks;
use torpor_scheduler::service::{Service, LOCAL_POD};
use torpor_scheduler::store::SandboxFilter;
use torpor_scheduler::{PodId, SandboxState};

const TOKEN: &str = "hog-test-token-0123456789";
/// What each guest rewrites every iteration, MiB.
const WORKLOAD_MIB: u64 = 64;
/// The pod's budget, in sandboxes' resident memory.
const BUDGET_SANDBOXES: u64 = 8;
/// The high watermark: low, high and hard marks at 0.63, 0.7 and 0.85 of
/// the budget, about 5, 5.6 and 6.8 sandboxes.
const HIGH_WATERMARK: f64 = 0.7;
/// How long a guest may take to touch its workload (a wait, not a check).
const WAIT: Duration = Duration::from_secs(30);
const MIB: u64 = 1 << 20;

/// One line of the timeline.
struct Step {
    at_ms: u128,
    what: String,
    resident_mib: u64,
    committed_mib: u64,
    running: usize,
    hibernated: usize,
    refused: usize,
}

struct Hog {
    service: Arc<Service>,
    api: InProcessApi,
    started: Instant,
    budget_mib: u64,
    /// The hard mark, MiB (0 until the budget is set).
    hard_mib: f64,
    timeline: Vec<Step>,
    refused: usize,
    _data: DataDir,
}

impl Hog {
    fn new() -> Self {
        let data = DataDir::new("memory-hog");
        // Only memory pressure hibernates; the guests rewrite their
        // workload once a second: light on the CPU, and a restored guest
        // has touched it within a second.
        let service = common::service_with_probe(
            &data.0,
            |c| c.default_keep_alive_ms = 3_600_000,
            "hog",
            128,
            &format!("probe.mib={WORKLOAD_MIB} probe.ticks=100 probe.hz=100"),
        );
        let api = InProcessApi::start(
            service.clone(),
            torpor_api::ApiConfig {
                tokens: vec![TOKEN.into()],
                ..Default::default()
            },
        );
        Hog {
            service,
            api,
            started: Instant::now(),
            budget_mib: 0,
            hard_mib: 0.0,
            timeline: Vec::new(),
            refused: 0,
            _data: data,
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> HttpResponse {
        let body = body.map(|b| b.to_string());
        request(&self.api.addr, method, path, Some(TOKEN), body.as_deref())
    }

    fn create(&self) -> HttpResponse {
        self.call("POST", "/v1/sandboxes", Some(json!({"template": "hog"})))
    }

    fn resident_mib(&self) -> u64 {
        self.service.pod_resident_bytes() / MIB
    }

    fn in_state(&self, state: SandboxState) -> Vec<SandboxId> {
        let filter = SandboxFilter {
            states: vec![state],
            ..Default::default()
        };
        let all = self.service.list_sandboxes(filter).unwrap();
        all.into_iter().map(|s| s.id).collect()
    }

    /// Waits until sandbox `id`'s guest holds its workload resident.
    fn touched(&self, id: &str) {
        let id = SandboxId::new(id);
        common::wait_for(WAIT, || {
            let s = self.service.get_sandbox(&id).unwrap();
            s.memory.and_then(|m| m.resident_bytes).unwrap_or(0) >= WORKLOAD_MIB * MIB
        });
    }

    /// Records a step of the timeline (the pod as `GET /v1/pods` shows
    /// it) and checks the hard mark was kept.
    fn step(&mut self, what: impl Into<String>) {
        let pods = self
            .call("GET", "/v1/pods", None)
            .ok_json("GET", "/v1/pods");
        let pod = &pods["pods"][0];
        let resident_mib = pod["resident_mib"].as_f64().unwrap() as u64;
        let step = Step {
            at_ms: self.started.elapsed().as_millis(),
            what: what.into(),
            resident_mib,
            committed_mib: pod["committed_mib"].as_u64().unwrap(),
            running: self.in_state(SandboxState::Running).len(),
            hibernated: self.in_state(SandboxState::Hibernated).len(),
            refused: self.refused,
        };
        assert!(
            self.hard_mib == 0.0 || resident_mib as f64 <= self.hard_mib,
            "{}: {resident_mib} MiB resident, past the pod's hard mark of {:.0} MiB",
            step.what,
            self.hard_mib
        );
        self.timeline.push(step);
    }

    /// One policy round, as the policy thread runs it.
    fn round(&mut self) {
        self.service.run_policy();
        self.step("policy round");
    }

    fn print(&self, marks: Marks) {
        let b = self.budget_mib as f64;
        println!(
            "memory-hog timeline: pod {} MiB, low {:.0} / high {:.0} / hard {:.0} MiB, ratio 4",
            self.budget_mib,
            b * marks.low,
            b * marks.high,
            b * marks.hard
        );
        println!(
            "{:>7} {:<28} {:>9} {:>10} {:>8} {:>11} {:>5}",
            "T-MS", "STEP", "RESIDENT", "COMMITTED", "RUNNING", "HIBERNATED", "429S"
        );
        for s in &self.timeline {
            println!(
                "{:>7} {:<28} {:>9} {:>10} {:>8} {:>11} {:>5}",
                s.at_ms,
                s.what,
                s.resident_mib,
                s.committed_mib,
                s.running,
                s.hibernated,
                s.refused
            );
        }
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        common::end_service(&self.service);
    }
}

/// A 429 of the pressure gate: `rate_limited`, `Retry-After`, and the
/// resident memory it saw with what the sandbox would add past the hard
/// mark.
fn assert_pressure_429(r: &HttpResponse, hard_mib: f64) {
    assert_eq!(r.status, 429, "{}", r.body);
    let body = r.json();
    assert_eq!(body["error"]["code"], "rate_limited", "{body}");
    assert!(r.header("retry-after").is_some(), "{}", r.head);
    let message = body["error"]["message"].as_str().unwrap();
    let number_before = |unit: &str| -> f64 {
        message
            .split(unit)
            .next()
            .and_then(|m| m.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {unit:?} in {message:?}"))
    };
    let seen = number_before(" MiB resident");
    let asked = number_before(" MiB for this sandbox");
    assert!(seen <= hard_mib, "{message} (hard mark {hard_mib:.0})");
    assert!(
        seen + asked > hard_mib - 1.0,
        "{message} (hard mark {hard_mib:.0})"
    );
}

#[test]
fn a_pod_of_memory_hogs_stays_within_its_ram() {
    let mut hog = Hog::new();
    let pod = PodId::new(LOCAL_POD);

    // The first guest sets the scale: the budget is eight of it.
    let first = hog.create().ok_json("POST", "/v1/sandboxes");
    let first_id = first["id"].as_str().unwrap().to_string();
    hog.touched(&first_id);
    // Settled (past another iteration of the guest), with a tenth more
    // for guests that hold more than the first.
    std::thread::sleep(Duration::from_millis(1200));
    let first = hog.service.get_sandbox(&SandboxId::new(&first_id)).unwrap();
    let settled = first.memory.and_then(|m| m.resident_bytes).unwrap();
    let each_mib = (settled * 11 / 10).div_ceil(MIB);
    let pid = first.vmm.expect("a running VMM").pid;
    assert!(
        torpor_scheduler::service::resident::cgroup_resident_bytes(pid).is_some(),
        "a jailed VMM is measured from its own cgroup"
    );
    hog.budget_mib = each_mib * BUDGET_SANDBOXES;
    let store = hog.service.store();
    let p = store.get_pod(&pod).unwrap();
    store
        .set_pod_capacity(&pod, hog.budget_mib * MIB, p.vcpus, p.disk_bytes)
        .unwrap();
    store.set_ratio(&pod, 4.0).unwrap();
    store.set_high_watermark(&pod, HIGH_WATERMARK).unwrap();
    let marks = Marks::of(HIGH_WATERMARK);
    let budget = hog.budget_mib as f64;
    let (low_mib, high_mib, hard_mib) =
        (budget * marks.low, budget * marks.high, budget * marks.hard);
    hog.hard_mib = hard_mib;
    hog.step(format!("create 1 ({each_mib} MiB each)"));
    hog.round();

    // Paced: a create, then a policy round. Past the high mark the round
    // hibernates the coldest until below the low mark.
    for n in 2..=8 {
        let created = hog.create().ok_json("POST", "/v1/sandboxes");
        hog.touched(created["id"].as_str().unwrap());
        hog.step(format!("create {n}"));
        hog.round();
        let resident = hog.timeline.last().unwrap().resident_mib as f64;
        assert!(
            resident <= high_mib,
            "after a round: {resident} MiB resident"
        );
    }
    let paced_hibernations = hog.in_state(SandboxState::Hibernated).len();
    assert!(paced_hibernations >= 2, "{paced_hibernations} hibernations");

    // A burst: four creates at once, no round between them. The gate
    // stops them before the hard mark: each counts at what the template's
    // sandboxes hold, not at the little a fresh restore holds yet.
    let answers: Vec<HttpResponse> = std::thread::scope(|scope| {
        let calls: Vec<_> = (0..4).map(|_| scope.spawn(|| hog.create())).collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let (refused, admitted): (Vec<_>, Vec<_>) = answers.into_iter().partition(|r| r.status == 429);
    for (n, r) in admitted.iter().enumerate() {
        let created = r.ok_json("POST", "/v1/sandboxes");
        hog.touched(created["id"].as_str().unwrap());
        hog.step(format!("burst create {}", n + 1));
    }
    assert!(!admitted.is_empty(), "the burst admitted nothing");
    assert!(!refused.is_empty(), "the burst was all admitted");
    for r in &refused {
        assert_pressure_429(r, hard_mib);
        hog.refused += 1;
    }
    hog.step(format!("burst: {} refused (429)", refused.len()));
    assert!(hog.resident_mib() as f64 > high_mib);

    // A wake, too, waits.
    let asleep = hog.in_state(SandboxState::Hibernated)[0].clone();
    let woken = hog.call("POST", &format!("/v1/sandboxes/{asleep}/resume"), None);
    assert_pressure_429(&woken, hard_mib);
    hog.refused += 1;
    hog.step("wake: 429");
    assert_eq!(
        hog.service.get_sandbox(&asleep).unwrap().state,
        SandboxState::Hibernated
    );

    // The next round reclaims, several sandboxes, and the pod admits
    // again.
    hog.round();
    assert!(
        (hog.resident_mib() as f64) <= low_mib * 1.05,
        "after the burst's round: {} MiB (low mark {low_mib:.0})",
        hog.resident_mib()
    );
    hog.call("POST", &format!("/v1/sandboxes/{asleep}/resume"), None)
        .ok_json("POST", "resume");
    hog.touched(asleep.as_str());
    hog.step("wake");
    hog.round();
    hog.print(marks);

    // Nothing was OOM-killed: every sandbox runs or is hibernated (a VMM
    // the OOM killer ends fails its sandbox, with the reason, at the next
    // round; the host's own count is not read: other processes share it).
    let all = hog
        .service
        .list_sandboxes(SandboxFilter::default())
        .unwrap();
    for s in &all {
        assert!(
            matches!(s.state, SandboxState::Running | SandboxState::Hibernated),
            "{}: {} ({:?})",
            s.id,
            s.state,
            s.failure_reason
        );
    }
    let metrics = hog.service.metrics();
    assert!(
        metrics.contains("torpor_hibernations_total{result=\"ok\"}"),
        "{metrics}"
    );
}
