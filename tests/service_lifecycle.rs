//! The service in process over real probe VMMs: what concurrent lifecycle
//! requests may and may not do. Admission under 200 parallel creates, a
//! resume racing a hibernate, and lifetimes past their maximum through the
//! HTTP API.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, Barrier};

use common::http::{request, InProcessApi};
use common::serve::DataDir;
use serde_json::json;
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::{
    CreateSandbox, Service, ServiceConfig, ServiceError, LOCAL_POD, MAX_KEEP_ALIVE_MS,
    MAX_TIMEOUT_MS, PROBE_TEMPLATE,
};
use torpor_scheduler::store::SandboxFilter;
use torpor_scheduler::{PodId, SandboxState};

const TOKEN: &str = "test-token-0123456789";

/// A service on its own data directory, its policy off (tests run it
/// themselves); its sandboxes are deleted when the test ends.
struct Harness {
    service: Arc<Service>,
    _data: DataDir,
}

impl Harness {
    fn new(name: &str) -> Self {
        let data = DataDir::new(name);
        let mut config = ServiceConfig::new(
            data.0.clone(),
            PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
        );
        config.policy_interval_ms = 0;
        let service = Service::open(config).expect("open the service");
        Harness {
            service,
            _data: data,
        }
    }

    fn state(&self, id: &SandboxId) -> SandboxState {
        self.service.get_sandbox(id).unwrap().state
    }

    fn create(&self) -> Result<SandboxId, ServiceError> {
        self.service
            .create_sandbox(CreateSandbox {
                template: PROBE_TEMPLATE.into(),
                ..Default::default()
            })
            .map(|s| s.id)
    }

    /// Sets the local pod's admission limit to `mib` (ratio 1).
    fn set_admission_limit(&self, mib: u64) {
        let store = self.service.store();
        let pod = PodId::new(LOCAL_POD);
        let p = store.get_pod(&pod).unwrap();
        store
            .set_pod_capacity(&pod, mib << 20, p.vcpus, p.disk_bytes)
            .unwrap();
        store.set_ratio(&pod, 1.0).unwrap();
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        common::end_service(&self.service);
    }
}

/// Admission and the insert are one step: 200 creates at once against a
/// pod with room for exactly 50 admit 50 and refuse 150 with 429.
#[test]
fn parallel_creates_fill_the_pod_exactly() {
    const ROOM: usize = 50;
    const ASKED: usize = 200;
    let h = Harness::new("svc-admission");
    let mem = h
        .service
        .list_templates()
        .unwrap()
        .into_iter()
        .find(|t| t.name == PROBE_TEMPLATE)
        .expect("the probe template")
        .mem_mib;
    h.set_admission_limit(ROOM as u64 * u64::from(mem));

    let start = Arc::new(Barrier::new(ASKED));
    let results: Vec<Result<SandboxId, ServiceError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..ASKED)
            .map(|_| {
                let (h, start) = (&h, start.clone());
                scope.spawn(move || {
                    start.wait();
                    h.create()
                })
            })
            .collect();
        handles.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let mut admitted = 0;
    let mut refused = 0;
    for r in &results {
        match r {
            Ok(_) => admitted += 1,
            Err(ServiceError::Admission { .. }) => refused += 1,
            Err(e) => panic!("a create failed otherwise than by admission: {e}"),
        }
    }
    assert_eq!((admitted, refused), (ROOM, ASKED - ROOM));
    let running = h
        .service
        .list_sandboxes(SandboxFilter {
            states: vec![SandboxState::Running],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(running.len(), ROOM);
    let pods = h.service.list_pods().unwrap();
    assert_eq!(pods[0].committed_mib, ROOM as u64 * u64::from(mem));
}

/// `queue` still waits for room: refused at once without it, admitted once
/// a sandbox is deleted with it.
#[test]
fn a_queued_create_waits_for_room() {
    let h = Harness::new("svc-queue");
    let mem = h.service.list_templates().unwrap()[0].mem_mib;
    h.set_admission_limit(u64::from(mem));
    let first = h.create().unwrap();
    match h.create() {
        Err(ServiceError::Admission { message }) => assert!(message.contains("full"), "{message}"),
        other => panic!("{other:?}"),
    }
    std::thread::scope(|scope| {
        let queued = scope.spawn(|| {
            h.service.create_sandbox(CreateSandbox {
                template: PROBE_TEMPLATE.into(),
                queue: true,
                ..Default::default()
            })
        });
        h.service.delete_sandbox(&first).unwrap();
        let sandbox = queued.join().unwrap().expect("the queued create");
        assert_eq!(sandbox.state, SandboxState::Running);
    });
}

/// The first CPU this thread may run on.
fn first_cpu() -> usize {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set),
            0
        );
        (0..libc::CPU_SETSIZE as usize)
            .find(|&c| libc::CPU_ISSET(c, &set))
            .expect("a CPU")
    }
}

/// Pins the calling thread to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: as above; sched_setaffinity(0) affects the calling thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set),
            0
        );
    }
}

/// A resume of a paused sandbox holds its lock from the state it reads to
/// the state it writes: a hibernate racing it runs wholly before or after,
/// never in between (which answered 500: "sandbox ... has no VMM"). Both
/// threads run on one CPU, where the resume's release of the lock wakes
/// the hibernate onto the CPU the resume is on (before the fix, one run of
/// 60 rounds hit it about two times in three; the deterministic version is
/// the scheduler's `a_hibernate_waiting_for_the_lock_cannot_come_between_a_resume`).
#[test]
fn resume_racing_hibernate_on_a_paused_sandbox_never_fails() {
    const ROUNDS: usize = 60;
    let h = Harness::new("svc-resume-race");
    let id = h.create().unwrap();
    let cpu = first_cpu();
    for round in 0..ROUNDS {
        if h.state(&id) != SandboxState::Running {
            h.service.resume(&id).unwrap();
        }
        h.service.pause(&id).unwrap();
        let start = Barrier::new(2);
        let (resumed, hibernated) = std::thread::scope(|scope| {
            let resume = scope.spawn(|| {
                pin_to(cpu);
                start.wait();
                h.service.resume(&id)
            });
            let hibernate = scope.spawn(|| {
                pin_to(cpu);
                start.wait();
                h.service.hibernate(&id)
            });
            (resume.join().unwrap(), hibernate.join().unwrap())
        });
        for (what, r) in [
            ("resume", resumed.map(drop)),
            ("hibernate", hibernated.map(drop)),
        ] {
            match r {
                Ok(()) | Err(ServiceError::Conflict { .. }) => {}
                Err(e) => panic!("round {round}: {what} failed: {e}"),
            }
        }
        let state = h.state(&id);
        assert!(
            matches!(state, SandboxState::Running | SandboxState::Hibernated),
            "round {round}: {state}"
        );
    }
}

/// `timeout_ms` and `keep_alive_ms` past their maximum are 400 wherever
/// they enter (create, fork, PATCH), and leave the sandbox as it was: a
/// `timeout_ms` of u64::MAX used to wrap to an expiry in the past, and the
/// next policy round deleted the sandbox.
#[test]
fn lifetimes_past_their_maximum_are_400_and_the_sandbox_lives_on() {
    let h = Harness::new("svc-lifetimes");
    let config = torpor_api::ApiConfig {
        tokens: vec![TOKEN.into()],
        ..Default::default()
    };
    let api = InProcessApi::start(h.service.clone(), config);
    let call = |method: &str, path: &str, body: serde_json::Value| {
        let body = (!body.is_null()).then(|| body.to_string());
        request(&api.addr, method, path, Some(TOKEN), body.as_deref())
    };

    let r = call("POST", "/v1/sandboxes", json!({"template": PROBE_TEMPLATE}));
    assert_eq!(r.status, 201, "{}", r.body);
    let created = r.json();
    let id = created["id"].as_str().unwrap().to_string();
    let path = format!("/v1/sandboxes/{id}");

    for (field, max) in [
        ("timeout_ms", MAX_TIMEOUT_MS),
        ("keep_alive_ms", MAX_KEEP_ALIVE_MS),
    ] {
        for ms in [u64::MAX, i64::MAX as u64, i64::MAX as u64 + 1, max + 1] {
            let r = call("PATCH", &path, json!({ field: ms }));
            assert_eq!(r.status, 400, "PATCH {field} {ms}: {}", r.body);
            assert_eq!(r.json()["error"]["code"], "invalid_request", "{}", r.body);
            let body = json!({"template": PROBE_TEMPLATE, field: ms});
            let r = call("POST", "/v1/sandboxes", body);
            assert_eq!(r.status, 400, "create with {field} {ms}: {}", r.body);
            let r = call("POST", &format!("{path}/fork"), json!({ field: ms }));
            assert_eq!(r.status, 400, "fork with {field} {ms}: {}", r.body);
        }
    }
    // Nothing changed, and a policy round leaves it alone.
    h.service.run_policy();
    let r = call("GET", &path, serde_json::Value::Null);
    assert_eq!(r.status, 200, "{}", r.body);
    let now = r.json();
    assert_eq!(now["state"], "running", "{now}");
    assert_eq!(now["expires_at"], created["expires_at"], "{now}");
    assert_eq!(now["keep_alive_ms"], created["keep_alive_ms"], "{now}");
    let all = h.service.list_sandboxes(SandboxFilter::default()).unwrap();
    assert_eq!(all.len(), 1, "no sandbox was created by a refused request");

    // The maximum itself is taken.
    let r = call(
        "PATCH",
        &path,
        json!({"timeout_ms": MAX_TIMEOUT_MS, "keep_alive_ms": MAX_KEEP_ALIVE_MS}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let patched = r.json();
    assert_eq!(patched["keep_alive_ms"], MAX_KEEP_ALIVE_MS);
    assert!(patched["expires_at"].as_i64().unwrap() > now["created_at"].as_i64().unwrap());
    h.service.run_policy();
    assert_eq!(h.state(&SandboxId::new(id)), SandboxState::Running);
    drop(api);
}

/// What belongs together is one commit (one fsync): a create is two, the
/// admission with the row and the journal's start, then the VMM with the
/// journal's end, the state and the snapshot it runs from; a pause or a
/// resume one; a wake two (its end with the VMM and the activity).
#[test]
fn operations_commit_what_belongs_together_at_once() {
    let h = Harness::new("svc-commits");
    let store = h.service.store();
    let commits = |f: &dyn Fn()| {
        let before = store.commits();
        f();
        store.commits() - before
    };
    let before = store.commits();
    let id = h.create().unwrap();
    let create = store.commits() - before;
    let sandbox = h.service.get_sandbox(&id).unwrap();
    assert_eq!(sandbox.state, SandboxState::Running);
    assert!(sandbox.snapshot.is_some() && sandbox.vmm.is_some());
    assert!(store.interrupted_operations().unwrap().is_empty());
    let pause = commits(&|| drop(h.service.pause(&id).unwrap()));
    let resume = commits(&|| drop(h.service.resume(&id).unwrap()));
    h.service.hibernate(&id).unwrap();
    let wake = commits(&|| assert!(h.service.resume(&id).unwrap().resumed));
    assert_eq!((create, pause, resume, wake), (2, 1, 1, 2));
}
