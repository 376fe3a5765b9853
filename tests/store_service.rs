//! One pod with an object store (`serve --object-store`, issue 29): a
//! hibernation answers once its full snapshot is stored, a wake whose
//! snapshot is gone from the pod's disk downloads it (the restore's
//! `fetch` phase) and the probe goes on with its exact sequence; an upload
//! that fails answers the error with the sandbox hibernated on the disk,
//! and a hibernate asked again stores it.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::serve::DataDir;
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::{CreateSandbox, Service, ServiceError};
use torpor_scheduler::SandboxState;
use torpor_vmm_api::lineage::Lineage;

const MIB: u32 = 1;
const WAIT: Duration = Duration::from_secs(30);

/// The probe's iterations in the sandbox's console (its current VMM's
/// run), once there are two, each reading what the one before wrote.
fn guest_iterates(data: &Path, id: &SandboxId) -> Vec<(u64, u64)> {
    let console = data.join("sandboxes").join(id.as_str()).join("console.log");
    let deadline = Instant::now() + WAIT;
    let iters = loop {
        let iters: Vec<(u64, u64)> = std::fs::read_to_string(&console)
            .unwrap_or_default()
            .lines()
            .filter_map(torpor_probe::parse_iter_line)
            .collect();
        if iters.len() >= 2 {
            break iters;
        }
        assert!(Instant::now() < deadline, "{id}: {iters:?} in {WAIT:?}");
        std::thread::sleep(Duration::from_millis(5));
    };
    common::snap::assert_exact_sequence(&iters, MIB);
    iters
}

fn hibernate(service: &Arc<Service>, id: &SandboxId) -> Result<String, ServiceError> {
    let started = Instant::now();
    let s = service.hibernate(id)?.sandbox;
    println!(
        "hibernate with upload: {:.1} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    assert_eq!(s.state, SandboxState::Hibernated);
    Ok(s.stored_snapshot.expect("a stored snapshot"))
}

#[test]
fn store_hibernations_are_stored_and_fetched_back() {
    let data = DataDir::new("store-service");
    let objects = data.0.join("objects");
    let service = common::service_with_probe(
        &data.0,
        |c| c.object_store = Some(objects.display().to_string()),
        "fast",
        64,
        &format!("probe.mib={MIB} probe.ticks=1 probe.hz=100"),
    );
    let id = service
        .create_sandbox(CreateSandbox {
            template: "fast".into(),
            ..Default::default()
        })
        .expect("create")
        .id;
    guest_iterates(&data.0, &id);

    // Stored, a full snapshot: it restores alone.
    let manifest = hibernate(&service, &id).unwrap();
    assert!(objects.join("manifests").join(&manifest).exists());
    let snapshot = service.get_sandbox(&id).unwrap().snapshot.unwrap();
    assert_eq!(Lineage::read(&snapshot).unwrap().depth(), 1);
    let template = service
        .list_templates()
        .unwrap()
        .into_iter()
        .find(|t| t.name == "fast")
        .unwrap();
    assert!(template.stored_snapshot.is_some(), "{template:?}");

    // Gone from the pod's disk: the wake fetches it.
    std::fs::remove_dir_all(&snapshot).unwrap();
    let woken = service.resume(&id).expect("wake from the object store");
    let report = woken.sandbox.restore.expect("a restore report");
    println!("wake from the object store: {report:?}");
    assert!(
        report.phases.iter().any(|(p, _)| p == "fetch"),
        "{report:?}"
    );
    guest_iterates(&data.0, &id);

    // The store fails (its directory replaced by a file): the hibernation
    // answers the error, the sandbox hibernated on the disk; asked again
    // once the store is back, it is stored.
    let aside = data.0.join("objects-aside");
    std::fs::rename(&objects, &aside).unwrap();
    std::fs::write(&objects, b"not a directory").unwrap();
    let e = hibernate(&service, &id).unwrap_err();
    println!("with the store gone: {e}");
    assert!(matches!(e, ServiceError::ObjectStore(_)), "{e}");
    let s = service.get_sandbox(&id).unwrap();
    assert_eq!(s.state, SandboxState::Hibernated);
    assert!(s.stored_snapshot.is_none(), "{s:?}");
    std::fs::remove_file(&objects).unwrap();
    std::fs::rename(&aside, &objects).unwrap();
    let again = hibernate(&service, &id).unwrap();
    assert_ne!(again, manifest);
    let woken = service.resume(&id).expect("wake");
    assert_eq!(woken.sandbox.state, SandboxState::Running);
    guest_iterates(&data.0, &id);
    // Once more, the template stored already: the steady state. The
    // snapshot it woke from is gone, and its manifest with it.
    let last = hibernate(&service, &id).unwrap();
    assert!(!objects.join("manifests").join(&again).exists());
    // Deleted: its last manifest goes; the template's stays.
    service.delete_sandbox(&id).unwrap();
    assert!(!objects.join("manifests").join(&last).exists());
    let kept = template.stored_snapshot.unwrap();
    assert!(objects.join("manifests").join(&kept).exists());
}
