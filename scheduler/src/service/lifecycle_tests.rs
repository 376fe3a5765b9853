//! The service without VMMs: a data directory whose store already holds a
//! ready probe template (so opening boots nothing) and sandboxes written
//! straight to the store. For what needs no guest: locks, lookups, and
//! the rollbacks of operations that fail.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::*;
use crate::model::{Sandbox, Template, TemplateId, TemplateState, VmmHandle};
use crate::random::random_hex;

/// A service whose VMM executable does not exist, over a store with a
/// ready probe template.
fn service() -> (TempDir, Arc<Service>, Template) {
    service_with(|_| {})
}

/// `service` with `tweak` applied to its configuration.
pub(super) fn service_with(
    tweak: impl FnOnce(&mut ServiceConfig),
) -> (TempDir, Arc<Service>, Template) {
    let dir = tempfile::tempdir().unwrap();
    let template = Template {
        id: TemplateId::generate(),
        name: PROBE_TEMPLATE.into(),
        kernel: "builtin:probe".into(),
        rootfs: None,
        snapshot_dir: Some(dir.path().join("templates").join("probe").join("snapshot")),
        mem_mib: 64,
        vcpus: 1,
        kind: TemplateKind::Probe,
        created_at: Timestamp::now(),
        state: TemplateState::Ready,
        tenant: None,
        image: None,
        source: None,
        stored_snapshot: None,
    };
    Store::open(dir.path())
        .unwrap()
        .insert_template(&template)
        .unwrap();
    let mut config = ServiceConfig::new(
        dir.path().to_path_buf(),
        PathBuf::from("/nonexistent/torpor"),
    );
    config.policy_interval_ms = 0;
    config.standby_pool = 0; // no VMM binary here
    tweak(&mut config);
    let service = Service::open(config).unwrap();
    (dir, service, template)
}

/// A running sandbox row without a VMM.
pub(super) fn running(service: &Service, template: &Template) -> SandboxId {
    let mut s = Sandbox::new(template.id.clone(), 64, 1, 60_000);
    s.state = SandboxState::Running;
    s.pod = Some(PodId::new(LOCAL_POD));
    service.store().insert_sandbox(&s).unwrap();
    s.id
}

/// Every operation that takes a sandbox's lock, on `id`; their errors.
fn every_locking_operation(service: &Service, id: &SandboxId) -> Vec<(&'static str, ServiceError)> {
    let results: Vec<(&str, Result<(), ServiceError>)> = vec![
        ("pause", service.pause(id).map(drop)),
        ("resume", service.resume(id).map(drop)),
        ("connect", service.connect(id).map(drop)),
        ("hibernate", service.hibernate(id).map(drop)),
        ("ensure_running", service.ensure_running(id).map(drop)),
        (
            "create_checkpoint",
            service
                .create_checkpoint(id, CreateCheckpoint { name: "c".into() })
                .map(drop),
        ),
        ("delete_checkpoint", service.delete_checkpoint(id, "c")),
        (
            "restore_checkpoint",
            service
                .restore_checkpoint(
                    id,
                    RestoreCheckpoint {
                        checkpoint: "c".into(),
                    },
                )
                .map(drop),
        ),
        (
            "fork_sandbox",
            service.fork_sandbox(id, ForkSandbox::default()).map(drop),
        ),
        ("delete_sandbox", service.delete_sandbox(id)),
    ];
    results
        .into_iter()
        .filter_map(|(what, r)| r.err().map(|e| (what, e)))
        .collect()
}

#[test]
fn requests_on_bogus_ids_are_404_and_leave_no_lock_behind() {
    let (_dir, service, _) = service();
    let mut bogus: Vec<SandboxId> = [
        "",
        "nope",
        "sbx_",
        "sbx_0123",
        "../../etc/passwd",
        "sbx_0123456789ABCDEF",
        "tpl_0123456789abcdef",
    ]
    .into_iter()
    .map(SandboxId::new)
    .collect();
    // Well formed, but no such sandbox.
    bogus.extend((0..100).map(|_| SandboxId::generate()));
    for id in &bogus {
        let errors = every_locking_operation(&service, id);
        assert_eq!(errors.len(), 10, "{id:?}: every operation fails");
        for (what, e) in errors {
            assert!(
                matches!(e, ServiceError::NotFound { .. }),
                "{what} {id:?}: {e}"
            );
        }
    }
    assert_eq!(service.lock_entries(), 0);
}

#[test]
fn a_deleted_sandbox_leaves_no_lock_behind() {
    let (_dir, service, template) = service();
    let id = running(&service, &template);
    service.delete_sandbox(&id).unwrap();
    assert_eq!(
        service.get_sandbox(&id).unwrap().state,
        SandboxState::Deleted
    );
    assert_eq!(service.lock_entries(), 0);
    // Operations on it after its deletion leave none either.
    let errors = every_locking_operation(&service, &id);
    assert!(!errors.is_empty());
    assert_eq!(service.lock_entries(), 0);
}

/// A stand-in VMM: a harmless process for the pid and a control socket
/// that answers every request `{"ok":true}`.
pub(super) struct FakeVmm {
    process: Child,
    pub(super) handle: VmmHandle,
}

impl FakeVmm {
    pub(super) fn start(dir: &std::path::Path) -> Self {
        let socket = dir.join(format!("fake-{}.sock", random_hex(4)));
        let listener = UnixListener::bind(&socket).unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let mut line = String::new();
                if BufReader::new(&conn).read_line(&mut line).is_ok() {
                    let _ = conn.write_all(b"{\"ok\":true}\n");
                }
            }
        });
        let process = Command::new("sleep").arg("600").spawn().unwrap();
        let handle = VmmHandle {
            pid: process.id(),
            start_time: vmm::start_time(process.id()),
            control_socket: socket,
        };
        FakeVmm { process, handle }
    }
}

impl Drop for FakeVmm {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// A resume of a paused sandbox holds the sandbox's lock from the state it
/// reads to the state it writes. It used to release it in between and
/// take it again: a hibernate waiting for the lock got it there, and the
/// resume then found a hibernated sandbox without a VMM (500). The hook
/// runs that hibernate (its store changes) at the first release.
#[test]
fn a_hibernate_waiting_for_the_lock_cannot_come_between_a_resume() {
    let (dir, service, template) = service();
    let vmm = FakeVmm::start(dir.path());
    let mut s = Sandbox::new(template.id.clone(), 64, 1, 60_000);
    s.state = SandboxState::Paused;
    s.pod = Some(PodId::new(LOCAL_POD));
    s.snapshot = template.snapshot_dir.clone();
    s.vmm = Some(vmm.handle.clone());
    service.store().insert_sandbox(&s).unwrap();

    let weak = Arc::downgrade(&service);
    service.locks.on_next_release(move |id| {
        let Some(service) = weak.upgrade() else {
            return;
        };
        let _guard = service.locks.lock(id);
        let from = service.store().get_sandbox(id).unwrap().state;
        service
            .store()
            .write(|tx| {
                tx.update_sandbox_state(id, from, SandboxState::Hibernating, None)?;
                tx.set_sandbox_vmm(id, None)?;
                tx.update_sandbox_state(
                    id,
                    SandboxState::Hibernating,
                    SandboxState::Hibernated,
                    None,
                )
            })
            .unwrap();
    });
    let outcome = service.resume(&s.id).expect("the resume");
    assert_eq!(outcome.sandbox.state, SandboxState::Running);
    assert!(!outcome.resumed);
    // The hibernate ran after it.
    assert_eq!(
        service.get_sandbox(&s.id).unwrap().state,
        SandboxState::Hibernated
    );
}

/// The policy prunes the rows of sandboxes deleted longer ago than the
/// retention (`--deleted-retention-ms`), and only those.
#[test]
fn the_policy_prunes_deleted_rows_past_the_retention() {
    let (_dir, service, template) = service_with(|c| c.deleted_retention_ms = 300);
    let gone = running(&service, &template);
    let live = running(&service, &template);
    service.delete_sandbox(&gone).unwrap();
    service.run_policy();
    assert_eq!(
        service.get_sandbox(&gone).unwrap().state,
        SandboxState::Deleted,
        "kept within the retention"
    );
    std::thread::sleep(std::time::Duration::from_millis(400));
    service.run_policy();
    assert!(
        matches!(
            service.get_sandbox(&gone),
            Err(ServiceError::NotFound { .. })
        ),
        "pruned past the retention"
    );
    assert_eq!(
        service.get_sandbox(&live).unwrap().state,
        SandboxState::Running
    );
}

/// Whether process `pid` has ended (gone, or a zombie not reaped yet).
pub(super) fn ended(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
    })
}

/// Whether process `pid` ends within `limit` (a SIGKILL is delivered
/// asynchronously: its target may still run for a moment after `kill`).
pub(super) fn ends_within(pid: u32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while !ended(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    ended(pid)
}

/// A sandbox with a stand-in VMM, in `state`, stored.
pub(super) fn with_vmm(
    service: &Service,
    template: &Template,
    vmm: &FakeVmm,
    state: SandboxState,
) -> Sandbox {
    let mut s = Sandbox::new(template.id.clone(), 64, 1, 60_000);
    s.state = state;
    s.pod = Some(PodId::new(LOCAL_POD));
    s.snapshot = template.snapshot_dir.clone();
    s.vmm = Some(vmm.handle.clone());
    service.store().insert_sandbox(&s).unwrap();
    s
}

/// A delete does not queue behind another operation holding a running
/// sandbox's lock (a snapshot or a control call that waits on its VMM):
/// it ends the VMM, the operation lets go, and the delete goes through.
/// The holder here lets go when the VMM ends, or after a minute.
#[test]
fn a_delete_ends_the_vmm_an_operation_waits_on() {
    let (dir, service, template) = service();
    let vmm = FakeVmm::start(dir.path());
    let s = with_vmm(&service, &template, &vmm, SandboxState::Running);
    let (held_tx, held) = std::sync::mpsc::channel();
    let holder = {
        let (service, id, pid) = (service.clone(), s.id.clone(), vmm.handle.pid);
        std::thread::spawn(move || {
            let _guard = service.locks.lock(&id);
            held_tx.send(()).unwrap();
            ends_within(pid, Duration::from_secs(60))
        })
    };
    held.recv().unwrap();
    service.delete_sandbox(&s.id).expect("the delete");
    assert!(
        holder.join().unwrap(),
        "the holder let go only after a minute: the delete did not end its VMM"
    );
    assert_eq!(
        service.get_sandbox(&s.id).unwrap().state,
        SandboxState::Deleted
    );
    assert_eq!(service.lock_entries(), 0);
}

/// A wake waiting for its Linux guest's agent (up to a minute) gives up as
/// soon as a delete waits for the sandbox, and the delete goes through.
#[test]
fn a_delete_ends_a_wake_waiting_for_its_agent() {
    let (dir, service, template) = service();
    let vmm = FakeVmm::start(dir.path());
    let linux = Template {
        kind: TemplateKind::Linux,
        ..template.clone()
    };
    let mut s = with_vmm(&service, &template, &vmm, SandboxState::Resuming);
    // The wake's new VMM is not recorded until the wake ends.
    service
        .store()
        .write(|tx| tx.set_sandbox_vmm(&s.id, None))
        .unwrap();
    s.vmm = None;
    let (held_tx, held) = std::sync::mpsc::channel();
    let waker = {
        let (service, s, handle) = (service.clone(), s.clone(), vmm.handle.clone());
        std::thread::spawn(move || {
            let _guard = service.locks.lock(&s.id);
            held_tx.send(()).unwrap();
            service
                .after_restore(&s, &linux, &handle)
                .expect_err("no agent answers")
                .to_string()
        })
    };
    held.recv().unwrap();
    service.delete_sandbox(&s.id).expect("the delete");
    let error = waker.join().unwrap();
    assert!(error.contains("being deleted"), "{error}");
    assert!(
        ends_within(vmm.handle.pid, Duration::from_secs(5)),
        "the wake's VMM was stopped"
    );
    assert_eq!(
        service.get_sandbox(&s.id).unwrap().state,
        SandboxState::Deleted
    );
}

/// A template build that fails (no VMM executable here) leaves its
/// template failed, saying why, its operation rolled back in the same
/// commit (`conclude.rs`: `Undo::TemplateFailed`).
#[test]
fn a_failed_build_leaves_its_template_failed_and_its_operation_rolled_back() {
    let (_dir, service, _) = service();
    let e = service
        .create_template(CreateTemplate::probe("broken"))
        .expect_err("no VMM executable");
    let t = service.resolve_template(None, "broken").unwrap();
    assert_eq!(t.state, TemplateState::Failed(e.to_string()));
    assert_eq!(service.store().interrupted_operations().unwrap(), []);
}

/// A shared template answers to its short alias through the store
/// (`code-interpreter` for `code-interpreter-v1`), as to its name.
#[test]
fn a_shared_template_is_found_by_its_alias() {
    let (_dir, service, _) = service();
    // Its build fails here (no VMM executable); its row is named so.
    let _ = service.create_template(CreateTemplate::probe("code-interpreter-v1"));
    let by_name = service
        .resolve_template(None, "code-interpreter-v1")
        .unwrap();
    let by_alias = service.resolve_template(None, "code-interpreter").unwrap();
    assert_eq!(by_alias.id, by_name.id);
    assert!(service.resolve_template(None, "code-interp").is_err());
}

/// A checkpoint whose snapshot the VMM does not write (the fake answers
/// without one) leaves nothing: no checkpoint, no snapshot directory, its
/// operation rolled back, the sandbox as it was (`Undo::Nothing`).
#[test]
fn a_checkpoint_the_vmm_does_not_write_leaves_nothing() {
    let (dir, service, template) = service();
    let vmm = FakeVmm::start(dir.path());
    let s = with_vmm(&service, &template, &vmm, SandboxState::Running);
    service
        .create_checkpoint(&s.id, CreateCheckpoint { name: "c".into() })
        .expect_err("no snapshot written");
    assert_eq!(service.store().interrupted_operations().unwrap(), []);
    assert_eq!(service.store().list_checkpoints(&s.id).unwrap(), []);
    let left: Vec<_> = std::fs::read_dir(service.sandbox_dir(&s.id))
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(
        !left
            .iter()
            .any(|n| n.to_string_lossy().starts_with("ckpt-")),
        "{left:?}"
    );
    assert_eq!(
        service.get_sandbox(&s.id).unwrap().state,
        SandboxState::Running
    );
}

#[test]
fn shared_templates_are_read_only_for_tenants() {
    let (_dir, _service, mut shared) = service();
    shared.tenant = None;
    let owner = |tenant: &str, admin| Owner {
        tenant: tenant.into(),
        admin,
    };
    assert!(may_delete(Some(&owner("acme", false)), &shared).is_err());
    assert!(may_delete(Some(&owner("admin", true)), &shared).is_ok());
}
