//! The service in process over real probe VMMs: what concurrent lifecycle
//! requests may and may not do. Admission under 200 parallel creates.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, Barrier};

use common::serve::DataDir;
use common::TORPOR;
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::{
    CreateSandbox, Service, ServiceConfig, ServiceError, LOCAL_POD, PROBE_TEMPLATE,
};
use torpor_scheduler::store::SandboxFilter;
use torpor_scheduler::{PodId, SandboxState};

/// A service on its own data directory, its policy off (tests run it
/// themselves); its sandboxes are deleted when the test ends.
struct Harness {
    service: Arc<Service>,
    _data: DataDir,
}

impl Harness {
    fn new(name: &str) -> Self {
        let data = DataDir::new(name);
        let mut config = ServiceConfig::new(data.0.clone(), PathBuf::from(TORPOR));
        config.policy_interval_ms = 0;
        let service = Service::open(config).expect("open the service");
        Harness {
            service,
            _data: data,
        }
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
        self.service.close();
        for s in self
            .service
            .list_sandboxes(SandboxFilter::default())
            .unwrap_or_default()
        {
            let _ = self.service.delete_sandbox(&s.id);
        }
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
