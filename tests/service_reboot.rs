//! Filesystem-only hibernation and waking by a reboot with real VMMs
//! (probe guests, which run natively here): the service keeps no memory
//! (its snapshot layers go), the wake is a new boot of the template's
//! kernel (the probe starts counting from its first iteration again) and
//! the sandbox runs on: it hibernates and wakes by a restore again, and a
//! memory hibernation can be woken by a reboot as well. Linux guests (a
//! disk kept across the reboot, a new boot id) are checked in the nested
//! pod (`tests/nested_pod.rs`, `tests/e2b/sdk_lifecycle.py`).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::serve::DataDir;
use torpor_scheduler::model::Sandbox;
use torpor_scheduler::service::{CreateSandbox, Hibernation, Service, ServiceConfig};
use torpor_scheduler::SandboxState;

const WAIT: Duration = Duration::from_secs(30);
/// What the probe prints at its first iteration, after a boot only (a
/// restored probe goes on counting).
const FIRST_ITERATION: &str = "TORPOR-PROBE ITER n=1 ";

fn service(data: &DataDir) -> Arc<Service> {
    let mut config = ServiceConfig::new(
        data.0.clone(),
        PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
    );
    config.policy_interval_ms = 0;
    config.standby_pool = 0;
    Service::open(config).expect("open the service")
}

fn sandbox_dir(data: &DataDir, s: &Sandbox) -> PathBuf {
    data.0.join("sandboxes").join(s.id.as_str())
}

fn console(data: &DataDir, s: &Sandbox) -> String {
    std::fs::read_to_string(sandbox_dir(data, s).join("console.log")).unwrap_or_default()
}

/// The snapshot layers in the sandbox's directory.
fn layers(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The probe's console grows: its guest runs.
fn guest_runs(data: &DataDir, s: &Sandbox) {
    let count = || console(data, s).matches("TORPOR-PROBE ITER").count();
    let before = count();
    let deadline = Instant::now() + WAIT;
    while count() <= before {
        assert!(Instant::now() < deadline, "the guest printed nothing new");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_filesystem_hibernation_drops_memory_and_the_wake_boots_again() {
    let data = DataDir::new("service-reboot");
    let service = service(&data);
    let s = service
        .create_sandbox(CreateSandbox {
            template: "probe".into(),
            ..Default::default()
        })
        .expect("create");
    let dir = sandbox_dir(&data, &s);
    guest_runs(&data, &s);

    // A memory hibernation first: its layer is in the sandbox's directory.
    service.hibernate(&s.id).expect("hibernate");
    assert_eq!(layers(&dir).len(), 1, "one diff layer: {:?}", layers(&dir));
    service.connect(&s.id).expect("wake by a restore");
    guest_runs(&data, &s);
    assert!(
        !console(&data, &s).contains(FIRST_ITERATION),
        "a restore is no boot"
    );
    let restored_pid = service.get_sandbox(&s.id).unwrap().vmm.unwrap().pid;

    // Filesystem only: no VMM, no snapshot, no layer left.
    let out = service
        .hibernate_as(&s.id, Hibernation::FILESYSTEM)
        .expect("filesystem hibernation");
    let hibernated = out.sandbox;
    assert_eq!(hibernated.state, SandboxState::Hibernated);
    assert!(hibernated.disk_only);
    assert_eq!(hibernated.snapshot, None);
    assert_eq!(hibernated.vmm, None);
    assert!(
        layers(&dir).is_empty(),
        "memory layers left: {:?}",
        layers(&dir)
    );

    // The wake is a boot: a new VMM, no restore, the first iteration again.
    let woken = service.connect(&s.id).expect("wake by a reboot");
    assert!(woken.resumed);
    assert_eq!(woken.sandbox.state, SandboxState::Running);
    assert!(woken.sandbox.restore.is_none(), "a boot restores nothing");
    assert!(!woken.sandbox.disk_only);
    let booted = woken.sandbox.vmm.clone().expect("a VMM");
    assert_ne!(booted.pid, restored_pid);
    assert!(
        console(&data, &s).contains(FIRST_ITERATION),
        "{}",
        console(&data, &s)
    );
    guest_runs(&data, &s);

    // A booted sandbox hibernates (a full snapshot: no chain under it) and
    // wakes by a restore as any other.
    service
        .hibernate(&s.id)
        .expect("hibernate the booted sandbox");
    assert_eq!(layers(&dir).len(), 1, "{:?}", layers(&dir));
    let restored = service.resume(&s.id).expect("wake by a restore");
    assert!(restored.sandbox.restore.is_some());
    guest_runs(&data, &s);

    // A memory hibernation woken by a reboot: its memory goes.
    service.hibernate(&s.id).expect("hibernate");
    std::fs::remove_file(dir.join("console.log")).unwrap();
    let rebooted = service.reboot(&s.id).expect("reboot");
    assert!(rebooted.resumed);
    assert_eq!(rebooted.sandbox.snapshot, None);
    assert!(
        layers(&dir).is_empty(),
        "memory layers left: {:?}",
        layers(&dir)
    );
    let deadline = Instant::now() + WAIT;
    while !console(&data, &s).contains(FIRST_ITERATION) {
        assert!(
            Instant::now() < deadline,
            "no new boot: {}",
            console(&data, &s)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A reboot of a running sandbox is a connect: nothing happens to it.
    let again = service.reboot(&s.id).expect("reboot of a running one");
    assert!(!again.resumed);
    assert_eq!(again.sandbox.vmm, rebooted.sandbox.vmm);

    service.delete_sandbox(&s.id).unwrap();
    service.close();
}
