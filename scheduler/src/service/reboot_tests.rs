//! Filesystem-only hibernation and waking by a reboot, without a real
//! guest: a Linux template's sandbox with a stand-in VMM (`lifecycle_tests`)
//! and, where the guest must answer, a real torpor-agent behind a hybrid
//! vsock stand-in on this host (`guest_tests`). The boot itself (probe
//! guests, real VMMs) is in `tests/service_reboot.rs`.

use std::sync::Arc;
use std::time::Duration;

use torpor_agent::FakeOps;

use super::guest::tests::{vsock_agent, Behaviour};
use super::lifecycle_tests::{ends_within, service_with, with_vmm, FakeVmm};
use super::*;
use crate::model::{HibernationKind, Sandbox, Template, TemplateId};

/// A Linux template (its files need not exist: nothing boots it here).
fn linux_template(service: &Service, probe: &Template) -> Template {
    let t = Template {
        id: TemplateId::generate(),
        name: "linux".into(),
        kind: TemplateKind::Linux,
        kernel: "/nonexistent/vmlinux".into(),
        rootfs: Some("/nonexistent/rootfs.ext4".into()),
        ..probe.clone()
    };
    service.store().insert_template(&t).unwrap();
    t
}

fn sandbox_dir(service: &Service, s: &Sandbox) -> std::path::PathBuf {
    let dir = service.sandbox_dir(&s.id);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// While the guest agent does not answer, a hibernation that requires it
/// (a filesystem-only one always does) is refused with 503 and the sandbox
/// keeps running with its VMM.
#[test]
fn a_guest_that_does_not_answer_refuses_a_filesystem_or_strict_hibernation() {
    let (dir, service, probe) = service_with(|_| {});
    let linux = linux_template(&service, &probe);
    let vmm = FakeVmm::start(dir.path());
    let s = with_vmm(&service, &linux, &vmm, SandboxState::Running);
    // No agent behind its vsock socket: the guest refuses the port.
    let _agent = vsock_agent(
        &sandbox_dir(&service, &s),
        Arc::new(FakeOps::new()),
        Behaviour::Refuse,
    );
    let strict = Hibernation {
        kind: HibernationKind::Memory,
        guest: GuestCheck::Require,
    };
    for h in [strict, Hibernation::FILESYSTEM] {
        match service.hibernate_as(&s.id, h) {
            Err(ServiceError::Unavailable { message, .. }) => {
                assert!(message.contains("does not answer"), "{message}")
            }
            other => panic!("{h:?}: {other:?}"),
        }
        let after = service.get_sandbox(&s.id).unwrap();
        assert_eq!(after.state, SandboxState::Running, "{h:?}");
        assert_eq!(after.vmm.as_ref(), Some(&vmm.handle), "{h:?}");
        assert!(!after.disk_only && !after.guest_unresponsive_at_pause);
    }
    assert_eq!(service.lock_entries(), 0);
}

/// A filesystem-only hibernation syncs the guest through its agent, ends
/// the VMM without a snapshot and keeps the disk: the sandbox is
/// hibernated, `disk_only`, runs from no snapshot, and its disk overlay is
/// where it was. A wake whose boot fails (no kernel, no VMM binary here)
/// leaves it so, and says why.
#[test]
fn a_filesystem_hibernation_keeps_the_disk_and_a_failed_boot_leaves_it_hibernated() {
    let (dir, service, probe) = service_with(|_| {});
    let linux = linux_template(&service, &probe);
    let vmm = FakeVmm::start(dir.path());
    let s = with_vmm(&service, &linux, &vmm, SandboxState::Running);
    let sdir = sandbox_dir(&service, &s);
    let ops = Arc::new(FakeOps::new());
    let _agent = vsock_agent(&sdir, ops, Behaviour::Agent);
    let overlay = sdir.join(super::linux::OVERLAY_FILE);
    std::fs::write(&overlay, b"the sandbox's disk").unwrap();

    let out = service
        .hibernate_as(&s.id, Hibernation::FILESYSTEM)
        .expect("the filesystem hibernation");
    assert_eq!(out.sandbox.state, SandboxState::Hibernated);
    assert!(out.sandbox.disk_only, "{:?}", out.sandbox);
    assert_eq!(out.sandbox.snapshot, None);
    assert_eq!(out.sandbox.vmm, None);
    assert!(
        ends_within(vmm.handle.pid, Duration::from_secs(5)),
        "its VMM was ended"
    );
    assert_eq!(std::fs::read(&overlay).unwrap(), b"the sandbox's disk");
    // A checkpoint needs a snapshot it does not have.
    assert!(matches!(
        service.create_checkpoint(&s.id, CreateCheckpoint { name: "c".into() }),
        Err(ServiceError::Conflict { .. })
    ));

    // Any wake of it is a boot; this one cannot start a VMM.
    let e = service.connect(&s.id).expect_err("no VMM binary here");
    // It got as far as starting the VMM (the boot was tried).
    assert!(e.to_string().contains("/nonexistent/torpor"), "{e}");
    let after = service.get_sandbox(&s.id).unwrap();
    assert_eq!(after.state, SandboxState::Hibernated);
    assert!(after.disk_only);
    assert_eq!(after.vmm, None);
    assert_eq!(std::fs::read(&overlay).unwrap(), b"the sandbox's disk");
    // Delete is not held up by anything it left.
    service.delete_sandbox(&s.id).unwrap();
    assert_eq!(service.lock_entries(), 0);
}

/// Memory kept while the guest agent did not answer (E2B's
/// `envdUnresponsiveAtPause`) is never restored: every restoring wake is
/// refused with `GuestUnresponsive` (409) and the sandbox stays as it was;
/// a reboot is what wakes it.
#[test]
fn memory_kept_from_an_unresponsive_guest_wakes_only_by_a_reboot() {
    let (dir, service, probe) = service_with(|_| {});
    let linux = linux_template(&service, &probe);
    let vmm = FakeVmm::start(dir.path());
    let s = with_vmm(&service, &linux, &vmm, SandboxState::Hibernated);
    service
        .store()
        .write(|tx| {
            tx.set_sandbox_vmm(&s.id, None)?;
            tx.set_sandbox_hibernation(&s.id, false, true)
        })
        .unwrap();
    for (what, result) in [
        ("connect", service.connect(&s.id)),
        ("resume", service.resume(&s.id)),
        ("ensure_running", service.ensure_running(&s.id)),
    ] {
        match result {
            Err(ServiceError::GuestUnresponsive { id }) => assert_eq!(id, s.id.as_str()),
            other => panic!("{what}: {other:?}"),
        }
    }
    let after = service.get_sandbox(&s.id).unwrap();
    assert_eq!(after.state, SandboxState::Hibernated);
    assert!(after.guest_unresponsive_at_pause);
    // A reboot is tried (and fails here: no kernel, no VMM binary), not
    // refused; the mark stays until a wake succeeds.
    let overlay = sandbox_dir(&service, &s).join(super::linux::OVERLAY_FILE);
    std::fs::write(overlay, b"disk").unwrap();
    let e = service.reboot(&s.id).expect_err("nothing boots here");
    assert!(e.to_string().contains("/nonexistent/torpor"), "{e}");
    assert!(
        service
            .get_sandbox(&s.id)
            .unwrap()
            .guest_unresponsive_at_pause
    );
    assert_eq!(service.lock_entries(), 0);
}
