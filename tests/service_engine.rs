//! The service uses its engine: creates and wakes take standby shells from
//! the pool (and say so), fall back to a cold `torpor-vmm` when the pool
//! has none, and VMM failures reach the caller typed. Runs the service in
//! process with real VMMs (probe guests).
//!
//! Covered: the standby and cold paths of create and wake (in answers and
//! metrics) with each memory backend; a hibernation that fails leaves a
//! paused sandbox paused (it used to come back running) and a running one
//! running; a full disk under a hibernation is `NoSpace` (507 in the API),
//! not an internal error; a standby shell restored for a wake whose VMM
//! handle was never recorded (the pod stopped dead) is ended on restart;
//! the pool grows under a burst and shrinks back when idle.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::disk::SmallDisk;
use common::serve::DataDir;
use torpor_scheduler::model::{RestorePath, RestoreReport};
use torpor_scheduler::service::{CreateSandbox, Service, ServiceConfig, ServiceError};
use torpor_scheduler::SandboxState;
use torpor_vmm_api::{ErrorKind, MemoryBackend};

const WAIT: Duration = Duration::from_secs(30);

fn service(data: &DataDir, pool: usize, backend: MemoryBackend) -> Arc<Service> {
    let mut config = ServiceConfig::new(
        data.0.clone(),
        PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
    );
    config.policy_interval_ms = 0;
    config.standby_pool = pool;
    config.memory_backend = backend;
    Service::open(config).expect("open the service")
}

fn create(service: &Service) -> torpor_scheduler::model::Sandbox {
    service
        .create_sandbox(CreateSandbox {
            template: "probe".into(),
            ..Default::default()
        })
        .expect("create")
}

/// Creates a sandbox once the pool holds a shell, and checks it took one;
/// its restore report.
fn create_from_a_shell(service: &Service) -> (torpor_scheduler::model::Sandbox, RestoreReport) {
    wait_for_shell(service);
    let sandbox = create(service);
    let report = sandbox
        .restore
        .clone()
        .expect("a create reports its restore");
    assert_eq!(report.path, RestorePath::Standby, "{report:?}");
    (sandbox, report)
}

/// Waits until the pool holds a shell (it fills in the background).
fn wait_for_shell(service: &Service) {
    let deadline = Instant::now() + WAIT;
    while !service
        .metrics()
        .lines()
        .any(|l| l.starts_with("torpor_standby_shells{") && !l.ends_with(" 0"))
    {
        assert!(
            Instant::now() < deadline,
            "the pool made no shell in {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The probe's console in the sandbox's directory grows: the guest runs.
fn guest_runs(data: &DataDir, id: &str) {
    let console = data.0.join("sandboxes").join(id).join("console.log");
    let lines = |p: &Path| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .matches("TORPOR-PROBE ITER")
            .count()
    };
    let before = lines(&console);
    let deadline = Instant::now() + WAIT;
    while lines(&console) <= before {
        assert!(
            Instant::now() < deadline,
            "the restored guest printed nothing new in {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn creates_and_wakes_take_standby_shells(backend: MemoryBackend) {
    let data = DataDir::new(&format!("engine-pool-{backend}"));
    let service = service(&data, 1, backend);
    let (sandbox, report) = create_from_a_shell(&service);
    assert_eq!(report.backend, backend.name());
    assert!(
        report.vmm_ms > 0.0 && report.ms >= report.vmm_ms,
        "{report:?}"
    );
    guest_runs(&data, sandbox.id.as_str());

    let old_vmm = sandbox.vmm.as_ref().expect("a running sandbox's VMM").pid;
    let hibernated = service.hibernate(&sandbox.id).expect("hibernate");
    // Answered without waiting for the VMM's exit; the reaper sees it end
    // (reaped: no zombie left either), and the sandbox records no VMM.
    assert_eq!(hibernated.sandbox.vmm, None);
    assert!(
        reaped_within(old_vmm, Duration::from_secs(10)),
        "the hibernated VMM {old_vmm} still runs or was not reaped"
    );
    // The answer says where the hibernation's time went and what it wrote.
    let h = hibernated
        .sandbox
        .hibernation
        .expect("a hibernation report");
    let names: Vec<&str> = h.phases.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["begin", "vmm", "stop", "record", "commit", "store"],
        "{h:?}"
    );
    let phases: f64 = h.phases.iter().map(|(_, ms)| ms).sum();
    assert!(
        h.vmm_ms > 0.0 && h.ms >= phases && phases >= h.vmm_ms,
        "{h:?}"
    );
    assert!(h.diff && h.memory_bytes > 0, "{h:?}");
    wait_for_shell(&service);
    let woken = service.resume(&sandbox.id).expect("wake");
    assert!(woken.resumed);
    let report = woken.sandbox.restore.expect("a wake reports its restore");
    assert_eq!(report.path, RestorePath::Standby, "{report:?}");
    guest_runs(&data, sandbox.id.as_str());

    let metrics = service.metrics();
    let line = format!(
        "torpor_restores_total{{path=\"standby\",backend=\"{}\"}} 2",
        backend.name()
    );
    assert!(metrics.contains(&line), "{line} missing from:\n{metrics}");
    // A delete answers without the VMM's exit too; the reaper sees it end.
    let woken_vmm = service.get_sandbox(&sandbox.id).unwrap().vmm.unwrap().pid;
    service.delete_sandbox(&sandbox.id).unwrap();
    assert!(
        reaped_within(woken_vmm, Duration::from_secs(10)),
        "the deleted sandbox's VMM {woken_vmm} still runs or was not reaped"
    );
    service.close();
}

#[test]
fn standby_shells_serve_the_file_backend() {
    creates_and_wakes_take_standby_shells(MemoryBackend::File);
}

#[test]
fn standby_shells_serve_the_uffd_shared_backend() {
    creates_and_wakes_take_standby_shells(MemoryBackend::UffdShared);
}

#[test]
fn standby_shells_serve_the_uffd_backend() {
    creates_and_wakes_take_standby_shells(MemoryBackend::Uffd);
}

#[test]
fn without_a_pool_creates_restore_cold() {
    let data = DataDir::new("engine-cold");
    let service = service(&data, 0, MemoryBackend::File);
    let sandbox = create(&service);
    let report = sandbox.restore.clone().unwrap();
    assert_eq!(report.path, RestorePath::Cold, "{report:?}");
    guest_runs(&data, sandbox.id.as_str());
    let metrics = service.metrics();
    assert!(
        metrics.contains("torpor_restores_total{path=\"cold\",backend=\"file\"} 1"),
        "{metrics}"
    );
    service.delete_sandbox(&sandbox.id).unwrap();
}

/// A gauge or counter of the service's metrics (the first series of
/// `name`), 0 when absent.
fn metric(service: &Service, name: &str) -> u64 {
    service
        .metrics()
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A burst of creates grows the pool past its minimum: its target to the
/// burst's size and shells made up to it; idle past
/// `standby_pool_idle_ms`, it shrinks back to the minimum, stopping the
/// shells beyond. Fails with a fixed pool (the target stays 1).
#[test]
fn the_pool_grows_under_a_burst_and_shrinks_when_idle() {
    const BURST: usize = 6;
    let data = DataDir::new("engine-pool-adaptive");
    let mut config = ServiceConfig::new(
        data.0.clone(),
        PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
    );
    config.policy_interval_ms = 0;
    config.standby_pool = 1;
    config.standby_pool_max = BURST;
    // Long enough for the shells to be made on a loaded host before the
    // burst is forgotten.
    config.standby_pool_idle_ms = 10_000;
    let service = Service::open(config).expect("open the service");
    wait_for_shell(&service);
    assert_eq!(metric(&service, "torpor_standby_shells_target"), 1);

    let made: Vec<_> = std::thread::scope(|s| {
        let creates: Vec<_> = (0..BURST).map(|_| s.spawn(|| create(&service))).collect();
        creates.into_iter().map(|c| c.join().unwrap()).collect()
    });
    wait_until("the pool grows to the burst", || {
        metric(&service, "torpor_standby_shells") == BURST as u64
    });
    assert_eq!(
        metric(&service, "torpor_standby_shells_target"),
        BURST as u64
    );
    for s in &made {
        service.delete_sandbox(&s.id).unwrap();
    }
    wait_until("the pool shrinks back to its minimum", || {
        metric(&service, "torpor_standby_shells") == 1
            && metric(&service, "torpor_standby_shells_target") == 1
    });
    assert!(metric(&service, "torpor_standby_shells_shrunk_total") >= (BURST - 1) as u64);
    service.close();
}

/// The directory the next hibernation of `sandbox` writes.
fn next_snapshot_dir(data: &DataDir, s: &torpor_scheduler::model::Sandbox) -> PathBuf {
    data.0
        .canonicalize()
        .unwrap()
        .join("sandboxes")
        .join(s.id.as_str())
        .join(format!("snap-{}", s.generation + 1))
}

#[test]
fn a_failed_hibernation_returns_to_the_state_it_came_from() {
    let data = DataDir::new("engine-rollback");
    let service = service(&data, 0, MemoryBackend::File);
    for paused in [true, false] {
        let sandbox = create(&service);
        if paused {
            service.pause(&sandbox.id).expect("pause");
        }
        let sandbox = service.get_sandbox(&sandbox.id).unwrap();
        // A file where the snapshot directory goes: the VMM cannot write it.
        std::fs::write(next_snapshot_dir(&data, &sandbox), b"in the way").unwrap();
        let err = service
            .hibernate(&sandbox.id)
            .expect_err("hibernate must fail");
        assert!(
            matches!(&err, ServiceError::Vm(e) if e.kind == ErrorKind::Io),
            "{err:?}"
        );
        let after = service.get_sandbox(&sandbox.id).unwrap();
        let want = if paused {
            SandboxState::Paused
        } else {
            SandboxState::Running
        };
        assert_eq!(after.state, want, "paused={paused}");
        // The VMM is still there and in that state.
        let status = torpor_vmm_api::control::request(
            &after.vmm.as_ref().unwrap().control_socket,
            &torpor_vmm_api::control::Request::Status,
            WAIT,
        )
        .unwrap();
        let vm_state = if paused {
            torpor_vmm_api::control::VmState::Paused
        } else {
            torpor_vmm_api::control::VmState::Running
        };
        assert_eq!(status.state, vm_state);
        service.delete_sandbox(&sandbox.id).unwrap();
    }
}

#[test]
fn a_full_disk_under_a_hibernation_is_no_space() {
    let data = DataDir::new("engine-enospc");
    let service = service(&data, 0, MemoryBackend::File);
    let sandbox = create(&service);
    guest_runs(&data, sandbox.id.as_str());
    let sandbox = service.get_sandbox(&sandbox.id).unwrap();
    let err = {
        let pid = sandbox.vmm.as_ref().unwrap().pid;
        let _disk = SmallDisk::mount(&next_snapshot_dir(&data, &sandbox), 16, pid);
        service
            .hibernate(&sandbox.id)
            .expect_err("16 KiB cannot hold it")
    };
    assert!(
        matches!(&err, ServiceError::Vm(e) if e.kind == ErrorKind::NoSpace),
        "{err:?}"
    );
    assert_eq!(
        service.get_sandbox(&sandbox.id).unwrap().state,
        SandboxState::Running
    );
    service.delete_sandbox(&sandbox.id).unwrap();
}

/// Whether process `pid` is gone within `limit`: ended and reaped (the
/// test process is the parent of an unjailed VMM, forked by the fork
/// server with `CLONE_PARENT`).
fn reaped_within(pid: u32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Path::new(&format!("/proc/{pid}")).exists() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// Whether process `pid` has ended (gone, or a zombie not reaped yet)
/// within `limit`.
fn ends_within(pid: u32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        let ended = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        };
        if ended {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A pod stopped dead in the middle of a wake that took a standby shell:
/// the restore sent (the shell runs the sandbox's guest, its death-with-
/// the-pod signal cleared), the VMM's handle not recorded yet. The shell
/// was made under `pool/`, but its socket and log move into the sandbox's
/// directory before the restore is sent, so the restarted service's
/// recovery finds it by its log and ends it: the wake goes back to
/// hibernated and no VMM runs unaccounted for.
#[test]
fn a_shell_restored_for_an_unrecorded_wake_is_ended_on_restart() {
    use torpor_scheduler::store::{OperationKind, StateChange, Store};
    let data = DataDir::new("engine-shell-recovery");
    let service = service(&data, 1, MemoryBackend::File);
    let (sandbox, _) = create_from_a_shell(&service);
    guest_runs(&data, sandbox.id.as_str());
    let pid = sandbox.vmm.as_ref().expect("a running sandbox's VMM").pid;
    let log = std::fs::read_link(format!("/proc/{pid}/fd/2")).unwrap();
    assert_eq!(
        log,
        data.0
            .canonicalize()
            .unwrap()
            .join("sandboxes")
            .join(sandbox.id.as_str())
            .join("vmm.log"),
        "the shell's log moved into the sandbox's directory"
    );
    // Stopped as a kill -9 leaves it: sandboxes' VMMs live on (closing
    // ends only the shells still waiting).
    service.close();
    drop(service);

    // The store as a wake interrupted between the restore into the shell
    // and the record of its handle leaves it.
    let store = Store::open(&data.0).unwrap();
    let id = &sandbox.id;
    store
        .write(|tx| {
            tx.set_sandbox_vmm(id, None)?;
            tx.update_sandbox_state(id, SandboxState::Running, SandboxState::Hibernating, None)?;
            tx.update_sandbox_state(
                id,
                SandboxState::Hibernating,
                SandboxState::Hibernated,
                None,
            )?;
            tx.begin_operation(
                Some(id),
                OperationKind::Wake,
                &serde_json::json!({}),
                Some(&StateChange::new(
                    SandboxState::Hibernated,
                    SandboxState::Resuming,
                )),
            )
        })
        .unwrap();
    drop(store);
    assert!(!ends_within(pid, Duration::from_millis(100)));

    let service = self::service(&data, 0, MemoryBackend::File);
    let after = service.get_sandbox(id).unwrap();
    assert_eq!(after.state, SandboxState::Hibernated);
    assert!(after.vmm.is_none(), "{after:?}");
    assert!(
        ends_within(pid, Duration::from_secs(5)),
        "the shell restored for the interrupted wake still runs"
    );
    service.close();
}
