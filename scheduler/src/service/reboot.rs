//! Filesystem-only hibernation and waking by a reboot (E2B's
//! `pause(mode="filesystem")`, `connect(on_resume="reboot")`).
//!
//! A filesystem-only hibernation asks a Linux guest to `sync`, ends the VMM
//! without a snapshot, and keeps the sandbox's disk: its overlay
//! (`disk.overlay` in its directory) stays where the VMM wrote it, the
//! memory snapshots it ran from are dropped (their layers collected) and
//! the sandbox is recorded `disk_only`. Its wake boots the template's
//! kernel again over that disk (the VMM reopens the overlay as it is,
//! `DiskSpec::keep_overlay`), waits for the agent as a template build does,
//! and runs the agent's `resumed` hook (clock, hostname, identity) as after
//! every restore; the environment and envd token live in the store and
//! apply to every command anyway. A memory hibernation may be woken the
//! same way (`reboot`): its memory is not restored and goes.
//!
//! Before a hibernation that asks, the guest agent is checked: a
//! filesystem-only one, or one that requires a healthy guest, is refused
//! (503, the sandbox keeps running) while the agent does not answer; a
//! memory one that only marks records `guest_unresponsive_at_pause`, and
//! such a sandbox then wakes only by a reboot ([`ServiceError::GuestUnresponsive`]).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use torpor_sync::Locked;
use torpor_vmm_api::control::Request;
use torpor_vmm_api::launch::{DiskSpec, KernelSource};

use super::guest::{AgentLink, ExecRequest, VSOCK_FILE};
use super::linux::{LINUX_CMDLINE, OVERLAY_FILE};
use super::resident::Ask;
use super::vmm::{self, VmmFiles};
use super::{Cancel, Outcome, Service, ServiceError, PROBE_TEMPLATE};
use crate::model::{
    HibernationKind, Sandbox, SandboxId, Template, TemplateKind, Timestamp, VmmHandle,
};
use crate::state::{can, Operation, SandboxState};
use crate::store::{OperationKind, OperationStatus, StateChange};

/// How long the guest agent may take to answer the check before a pause.
const GUEST_CHECK_LIMIT: Duration = Duration::from_secs(5);
/// How long the guest's `sync` may take before the hibernation gives up
/// (the sandbox keeps running).
const SYNC_LIMIT: Duration = Duration::from_secs(60);
/// How long a reboot may take until the guest's agent answers (a nested
/// host emulates the CPU: tens of seconds are normal there).
const BOOT_LIMIT: Duration = Duration::from_secs(180);

/// What the guest agent's check before a hibernation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestCheck {
    /// No check (torpor's own hibernation, the policy's).
    Skip,
    /// A memory hibernation goes on and records an agent that does not
    /// answer (E2B's default pause).
    Mark,
    /// Refused while the agent does not answer (E2B's
    /// `requireHealthyGuest`); a filesystem-only hibernation always is.
    Require,
}

/// A hibernation: what it keeps and how it checks the guest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hibernation {
    pub kind: HibernationKind,
    pub guest: GuestCheck,
}

impl Hibernation {
    /// Memory and disk, no check: what [`Service::hibernate`] does.
    pub const MEMORY: Hibernation = Hibernation {
        kind: HibernationKind::Memory,
        guest: GuestCheck::Skip,
    };
    /// The disk only (the guest must answer).
    pub const FILESYSTEM: Hibernation = Hibernation {
        kind: HibernationKind::Filesystem,
        guest: GuestCheck::Require,
    };
}

impl Service {
    /// Hibernates as `h` says (see the module's documentation).
    pub fn hibernate_as(&self, id: &SandboxId, h: Hibernation) -> Result<Outcome, ServiceError> {
        let _guard = self.lock_sandbox(id)?;
        self.hibernate_as_locked(id, h)
    }

    /// [`Self::hibernate_as`] with the sandbox's lock held (the policy's
    /// hibernation by a timeout comes here).
    pub(super) fn hibernate_as_locked(
        &self,
        id: &SandboxId,
        h: Hibernation,
    ) -> Result<Outcome, ServiceError> {
        let sandbox = self.store.get_sandbox(id)?;
        let path = can(Operation::Hibernate, sandbox.state)
            .map_err(|e| ServiceError::illegal(id, e, "hibernate"))?;
        if path.is_empty() {
            return Ok(Outcome {
                sandbox,
                resumed: false,
                resume_ms: None,
            });
        }
        let template = self.store.get_template(&sandbox.template)?;
        let check = h.kind == HibernationKind::Filesystem || h.guest != GuestCheck::Skip;
        // A paused guest cannot answer: it is not checked (a filesystem
        // hibernation resumes it to sync it, which checks it).
        let answers = if check
            && template.kind == TemplateKind::Linux
            && sandbox.state == SandboxState::Running
        {
            self.guest_answers(id)
        } else {
            Ok(())
        };
        if let Err(why) = &answers {
            if h.kind == HibernationKind::Filesystem || h.guest == GuestCheck::Require {
                return Err(ServiceError::Unavailable {
                    message: format!(
                        "the guest agent of sandbox {id} does not answer ({why}), so it is not \
                         hibernated and keeps running"
                    ),
                    retry_after_s: 1,
                });
            }
        }
        match h.kind {
            HibernationKind::Memory => {
                let outcome = self.hibernate_locked(id, super::hibernate::Exit::Later)?;
                if answers.is_err() {
                    tracing::warn!(sandbox = %id, "hibernated while its guest agent did not answer");
                    self.store.set_sandbox_hibernation(id, false, true)?;
                    return Ok(Outcome {
                        sandbox: self.store.get_sandbox(id)?,
                        ..outcome
                    });
                }
                Ok(outcome)
            }
            HibernationKind::Filesystem => self.hibernate_disk_locked(sandbox, &template),
        }
    }

    /// Whether the sandbox's guest agent answers a connection within
    /// [`GUEST_CHECK_LIMIT`]; why not otherwise.
    pub(super) fn guest_answers(&self, id: &SandboxId) -> Result<(), String> {
        let link = AgentLink::new(id.as_str(), self.sandbox_dir(id).join(VSOCK_FILE));
        link.connect(Some(GUEST_CHECK_LIMIT))
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// Filesystem-only hibernation (lock held, `sandbox` running or paused).
    fn hibernate_disk_locked(
        &self,
        sandbox: Sandbox,
        template: &Template,
    ) -> Result<Outcome, ServiceError> {
        let started = Instant::now();
        let id = &sandbox.id;
        let handle = Self::running_handle(&sandbox)?.clone();
        let from = sandbox.state;
        let change = StateChange::new(from, SandboxState::Hibernating);
        let op = self.store.begin_operation(
            Some(id),
            OperationKind::Hibernate,
            &json!({ "filesystem": true, "from": from }),
            Some(&change),
        )?;
        let work = (|| {
            if from == SandboxState::Paused {
                vmm::call(&handle, &Request::Resume)?;
            }
            if template.kind == TemplateKind::Linux {
                self.sync_guest(id)?;
            }
            Ok(())
        })();
        self.conclude(
            &op.id,
            work,
            |()| {
                self.stop_vmm(&sandbox)?;
                flush_overlay(&self.sandbox_dir(id).join(OVERLAY_FILE));
                let change = StateChange::new(SandboxState::Hibernating, SandboxState::Hibernated);
                self.store.write(|tx| {
                    tx.set_sandbox_snapshot(id, None)?;
                    tx.set_sandbox_hibernation(id, true, false)?;
                    tx.finish_operation(&op.id, OperationStatus::Done, None, Some(&change))
                })?;
                self.metrics
                    .observe_hibernate(started.elapsed().as_secs_f64() * 1000.0);
                // Its memory snapshots: nothing runs from them now.
                self.remove_dead_layers();
                Ok(Outcome {
                    sandbox: self.store.get_sandbox(id)?,
                    resumed: false,
                    resume_ms: None,
                })
            },
            |_| {
                self.metrics.hibernate_failed();
                if from == SandboxState::Paused {
                    let _ = vmm::call(&handle, &Request::Pause);
                }
                StateChange::new(SandboxState::Hibernating, from)
            },
        )
    }

    /// Runs `sync` in the guest: what it wrote reaches its disk before
    /// the VMM ends.
    pub(super) fn sync_guest(&self, id: &SandboxId) -> Result<(), ServiceError> {
        let link = AgentLink::new(id.as_str(), self.sandbox_dir(id).join(VSOCK_FILE));
        let req = ExecRequest {
            argv: vec!["sync".into()],
            env: Default::default(),
            clear_env: false,
            cwd: None,
            stdin: None,
            timeout_ms: Some(SYNC_LIMIT.as_millis() as u64),
            max_output_bytes: Some(4096),
        };
        let out = link.exec(req, &Cancel::default())?;
        if out.exit.code != Some(0) {
            return Err(ServiceError::Internal(format!(
                "`sync` in sandbox {id} failed: {:?} {}",
                out.exit,
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(())
    }

    /// A connect that wakes a hibernated sandbox by a reboot from its disk
    /// (E2B's `on_resume="reboot"`): any hibernated sandbox, whatever its
    /// hibernation kept. A sandbox that is not hibernated is connected as
    /// by [`Service::connect`].
    pub fn reboot(&self, id: &SandboxId) -> Result<Outcome, ServiceError> {
        let outcome = self.resume_as(id, true, true)?;
        self.store
            .write_relaxed(|tx| tx.touch(id, Timestamp::now()))?;
        Ok(outcome)
    }

    /// Wakes a hibernated sandbox by booting its template's kernel over the
    /// disk it kept (lock held). On failure it stays hibernated as it was.
    pub(super) fn boot_locked(&self, sandbox: Sandbox) -> Result<Outcome, ServiceError> {
        let started = Instant::now();
        let id = sandbox.id.clone();
        let template = self.store.get_template(&sandbox.template)?;
        let change = StateChange::new(SandboxState::Hibernated, SandboxState::Resuming);
        let op = self.admit_with(Ask::sandbox(&sandbox), false, |tx| {
            tx.begin_operation(
                Some(&id),
                OperationKind::Wake,
                &json!({ "boot": true }),
                Some(&change),
            )
        })?;
        let booted = self.boot_vmm(&sandbox, &template);
        self.conclude(
            &op.id,
            booted,
            |handle| {
                let change = StateChange::new(SandboxState::Resuming, SandboxState::Running);
                let woken = self.record_vmm(&sandbox, &handle, |tx| {
                    tx.set_sandbox_snapshot(&id, None)?;
                    tx.set_sandbox_hibernation(&id, false, false)?;
                    tx.finish_operation(&op.id, OperationStatus::Done, None, Some(&change))?;
                    tx.touch(&id, Timestamp::now())?;
                    tx.get_sandbox(&id)
                })?;
                // A memory snapshot it did not restore: nothing runs from it.
                self.remove_dead_layers();
                let ms = started.elapsed().as_secs_f64() * 1000.0;
                self.metrics.observe_resume(ms);
                tracing::info!(sandbox = %id, ms, "woken by a reboot from its disk");
                Ok(Outcome {
                    sandbox: woken,
                    resumed: true,
                    resume_ms: Some(ms),
                })
            },
            |_| {
                self.metrics.wake_failed();
                StateChange::new(SandboxState::Resuming, SandboxState::Hibernated)
            },
        )
    }

    /// Boots `sandbox`'s VMM from `template`'s kernel over its kept disk
    /// and waits until its guest is up (a Linux guest: its agent answers
    /// and its `resumed` hook ran, within [`BOOT_LIMIT`]; a delete ends
    /// the wait). The VMM is recorded while it boots, so a delete finds
    /// it; on failure it is stopped.
    pub(super) fn boot_vmm(
        &self,
        sandbox: &Sandbox,
        template: &Template,
    ) -> Result<VmmHandle, ServiceError> {
        let id = &sandbox.id;
        let dir = self.sandbox_dir(id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("create {}: {e}", dir.display())))?;
        self.mounts.serve(sandbox, &dir)?;
        let files = VmmFiles::in_dir(&dir);
        // A new boot's console: readiness is read from it.
        let _ = std::fs::remove_file(&files.console);
        let cmdline = self.template_cmdline(template);
        let (kernel, disk, vsock_uds, net, balloon) = match template.kind {
            TemplateKind::Probe => (
                KernelSource::Builtin(PROBE_TEMPLATE.into()),
                None,
                None,
                None,
                false,
            ),
            TemplateKind::Linux => {
                let rootfs = template.rootfs.clone().ok_or_else(|| {
                    ServiceError::Internal(format!("Linux template {} has no rootfs", template.id))
                })?;
                let overlay = dir.join(OVERLAY_FILE);
                if !overlay.exists() {
                    return Err(ServiceError::Internal(format!(
                        "sandbox {id} has no disk to boot from ({} is missing)",
                        overlay.display()
                    )));
                }
                let uds = dir.join(VSOCK_FILE);
                let _ = std::fs::remove_file(&uds);
                let disk = DiskSpec {
                    image: rootfs,
                    overlay,
                    read_only: false,
                    keep_overlay: true,
                };
                let net = self.sandbox_net_spec(id)?;
                (
                    KernelSource::Path(template.kernel.clone().into()),
                    Some(disk),
                    Some(uds),
                    net,
                    true,
                )
            }
        };
        let boot = super::template::Boot {
            kernel,
            cmdline,
            mem_mib: sandbox.mem_mib,
            vcpus: sandbox.vcpus,
            disk,
            vsock_uds,
            net,
            balloon,
        };
        let spawned = self.spawn_boot(&files, boot);
        let vmm::Spawned { child, handle, .. } = match spawned {
            Ok(s) => s,
            Err(e) => {
                self.drop_sandbox_net(id);
                return Err(e);
            }
        };
        self.children.locked().insert(id.clone(), child);
        self.record_vmm(sandbox, &handle, |_| Ok(()))?;
        let mut started = sandbox.clone();
        started.vmm = Some(handle.clone());
        let up = match template.kind {
            TemplateKind::Probe => super::template::wait_ready(&files),
            TemplateKind::Linux => self.wait_for_boot(&started, template, &handle, &files),
        };
        match up {
            Ok(()) => Ok(handle),
            Err(e) => {
                let _ = self.stop_vmm(&started);
                Err(e)
            }
        }
    }

    /// The kernel command line `template` was built with (kept in its
    /// directory), or its kind's default (a snapshot-as-template, a
    /// template built before the command line was kept).
    pub(super) fn template_cmdline(&self, template: &Template) -> String {
        let kept = self
            .template_dir(&template.id)
            .join(super::template::CMDLINE_FILE);
        std::fs::read_to_string(kept).unwrap_or_else(|_| {
            match template.kind {
                TemplateKind::Probe => super::template::PROBE_CMDLINE,
                TemplateKind::Linux => LINUX_CMDLINE,
            }
            .to_string()
        })
    }

    /// A booting Linux guest: its agent answers within [`BOOT_LIMIT`],
    /// then its `resumed` hook runs ([`Service::after_restore`]).
    fn wait_for_boot(
        &self,
        sandbox: &Sandbox,
        template: &Template,
        handle: &VmmHandle,
        files: &VmmFiles,
    ) -> Result<(), ServiceError> {
        let id = &sandbox.id;
        let link = AgentLink::new(id.as_str(), self.sandbox_dir(id).join(VSOCK_FILE));
        let alive = || {
            if self.locks.is_doomed(id) {
                Err("the sandbox is being deleted".to_string())
            } else if vmm::alive(handle) {
                Ok(())
            } else {
                Err(format!(
                    "the sandbox's VMM exited: {}",
                    vmm::log_tail(&files.log)
                ))
            }
        };
        let client = link.connect_waiting(BOOT_LIMIT, alive).map_err(|e| {
            tracing::warn!(
                sandbox = %id,
                console = %vmm::log_tail(&files.console),
                "a reboot's guest did not get its agent up"
            );
            ServiceError::from(e)
        })?;
        drop(client);
        self.after_restore(sandbox, template, handle)
    }
}

/// Flushes the kept overlay to the host's disk (best effort: the VMM wrote
/// it through the page cache, which a crash of the host would lose).
fn flush_overlay(path: &Path) {
    if let Err(e) = std::fs::File::open(path).and_then(|f| f.sync_all()) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("cannot flush {}: {e}", path.display());
        }
    }
}
