//! After an unclean stop (kill -9 of `torpor serve`): finish or roll back
//! interrupted operations, re-attach to VMMs that still answer, mark the
//! sandboxes whose VMM is gone failed, end the VMMs no sandbox keeps, and
//! remove orphaned files.

use std::collections::{HashMap, HashSet};

use super::vmm;
use super::{Service, ServiceError};
use crate::files::cleanup_orphans;
use crate::model::Sandbox;
use crate::state::SandboxState;
use crate::store::{OperationKind, OperationStatus, SandboxFilter, StateChange};

impl Service {
    pub(super) fn recover(&self) -> Result<(), ServiceError> {
        for op in self.store.interrupted_operations()? {
            let Some(id) = op.sandbox.clone() else {
                self.store
                    .finish_operation(&op.id, OperationStatus::RolledBack, None, None)?;
                continue;
            };
            let sandbox = self.store.get_sandbox(&id)?;
            if self.recover_snapshot_op(&op, &sandbox)? {
                continue;
            }
            let answers = sandbox.vmm.as_ref().and_then(vmm::status).is_some();
            let snapshot_done = op
                .detail
                .get("snapshot")
                .and_then(|s| s.as_str())
                .map(|s| {
                    std::path::Path::new(s)
                        .join(torpor_vmm_api::lineage::STATE_FILE)
                        .exists()
                })
                .unwrap_or(false);
            // A filesystem-only hibernation writes no snapshot: once its
            // VMM is gone the disk it kept is what there is.
            let filesystem = op.detail.get("filesystem") == Some(&serde_json::Value::Bool(true));
            let boot = op.detail.get("boot") == Some(&serde_json::Value::Bool(true));
            let (outcome, to, reason) = match (op.kind, sandbox.state) {
                (OperationKind::Hibernate, SandboxState::Hibernating) if filesystem && !answers => {
                    (OperationStatus::Done, SandboxState::Hibernated, None)
                }
                (OperationKind::Create, SandboxState::Creating) if answers => {
                    (OperationStatus::Done, SandboxState::Running, None)
                }
                (OperationKind::Create, SandboxState::Creating) => (
                    OperationStatus::RolledBack,
                    SandboxState::Failed,
                    Some("the service stopped while creating it"),
                ),
                (OperationKind::Hibernate, SandboxState::Hibernating) if snapshot_done => {
                    (OperationStatus::Done, SandboxState::Hibernated, None)
                }
                // Back where it came from: a paused sandbox stays paused.
                (OperationKind::Hibernate, SandboxState::Hibernating) if answers => (
                    OperationStatus::RolledBack,
                    hibernated_from(&op.detail),
                    None,
                ),
                (OperationKind::Hibernate, SandboxState::Hibernating) => (
                    OperationStatus::RolledBack,
                    SandboxState::Failed,
                    Some("the service and the VMM stopped while hibernating it"),
                ),
                (OperationKind::Wake, SandboxState::Resuming) if answers => {
                    (OperationStatus::Done, SandboxState::Running, None)
                }
                (OperationKind::Wake, SandboxState::Resuming) => {
                    (OperationStatus::RolledBack, SandboxState::Hibernated, None)
                }
                // Pause, resume, delete: the state change is made at the
                // end, so the row still holds the state before the operation.
                (_, current) => (OperationStatus::RolledBack, current, None),
            };
            if filesystem && to == SandboxState::Hibernated {
                self.store.set_sandbox_snapshot(&id, None)?;
                self.store.set_sandbox_hibernation(&id, true, false)?;
            }
            if boot && to == SandboxState::Running {
                self.store.set_sandbox_snapshot(&id, None)?;
                self.store.set_sandbox_hibernation(&id, false, false)?;
            }
            if to == SandboxState::Hibernated {
                if let Some(snapshot) = op.detail.get("snapshot").and_then(|s| s.as_str()) {
                    if sandbox.state == SandboxState::Hibernating {
                        self.store
                            .set_sandbox_snapshot(&id, Some(std::path::Path::new(snapshot)))?;
                    }
                }
                if let Some(handle) = &sandbox.vmm {
                    vmm::stop(handle, None);
                    self.store.set_sandbox_vmm(&id, None)?;
                }
            }
            let change = (to != sandbox.state).then(|| StateChange {
                from: sandbox.state,
                to,
                reason: reason.map(String::from),
            });
            tracing::warn!(op = %op.id, kind = %op.kind, sandbox = %id, %outcome, "finishing an interrupted operation");
            self.store
                .finish_operation(&op.id, outcome, None, change.as_ref())?;
        }
        self.reattach()?;
        self.end_stray_vmms()?;
        self.recover_layers()?;
        self.remove_orphans()
    }

    /// Running or paused sandboxes keep their VMM if it still answers.
    fn reattach(&self) -> Result<(), ServiceError> {
        let filter = SandboxFilter {
            states: vec![SandboxState::Running, SandboxState::Paused],
            ..Default::default()
        };
        for sandbox in self.store.list_sandboxes(&filter)? {
            self.reattach_one(&sandbox)?;
        }
        Ok(())
    }

    fn reattach_one(&self, sandbox: &Sandbox) -> Result<(), ServiceError> {
        match sandbox.vmm.as_ref().map(|h| (h, vmm::status(h))) {
            Some((h, Some(_))) => {
                if let Some(jails) = &self.jails {
                    jails.note_running(h.pid);
                }
                tracing::info!(sandbox = %sandbox.id, pid = h.pid, "re-attached to its VMM");
                // A lazy wake's memory file still arriving: the fetch the
                // stopped service ran goes on (else its VMM's next fault on
                // a missing chunk fails it at the map's deadline).
                if let Err(e) = self.resume_lazy(sandbox) {
                    tracing::warn!(sandbox = %sandbox.id, "{e}");
                }
            }
            _ => {
                tracing::warn!(sandbox = %sandbox.id, "its VMM is gone; marking it failed");
                self.store.set_sandbox_vmm(&sandbox.id, None)?;
                self.store.update_sandbox_state(
                    &sandbox.id,
                    sandbox.state,
                    SandboxState::Failed,
                    Some("its VMM process ended while the service was down"),
                )?;
            }
        }
        Ok(())
    }

    /// Ends every VMM running in a sandbox's directory that the sandbox
    /// does not keep: afterwards the running and paused sandboxes are
    /// exactly the VMMs whose log is in this data directory. A stop in the
    /// middle of a create or a wake leaves one whose handle was never
    /// recorded (the process up, its commit not made), which the steps
    /// above cannot see: the create is rolled back (failed), the wake back
    /// to hibernated, and the VMM would run on, unaccounted for. Found by
    /// its log (`sandboxes/ID/vmm.log`, its stderr) rather than its control
    /// socket, which a VMM still starting has not bound yet.
    fn end_stray_vmms(&self) -> Result<(), ServiceError> {
        let root = self.config.data_dir.join("sandboxes");
        let found = vmm::logging_under(&root);
        if found.is_empty() {
            return Ok(());
        }
        let kept: HashMap<String, u32> = self
            .store
            .list_sandboxes(&SandboxFilter {
                states: vec![SandboxState::Running, SandboxState::Paused],
                ..Default::default()
            })?
            .into_iter()
            .filter_map(|s| Some((s.id.as_str().to_string(), s.vmm?.pid)))
            .collect();
        for p in &found {
            let sandbox = p
                .log
                .components()
                .next()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .unwrap_or_default();
            // A kept sandbox's VMM and (jailed) its supervisor stay.
            let keep = kept.get(&sandbox).is_some_and(|&pid| {
                p.pid == pid || found.iter().any(|c| c.pid == pid && c.ppid == p.pid)
            });
            if keep {
                continue;
            }
            tracing::warn!(%sandbox, pid = p.pid, "a VMM no sandbox keeps: ending it");
            if !vmm::kill_and_wait(p.pid, p.start_time, std::time::Duration::from_secs(5)) {
                tracing::warn!(%sandbox, pid = p.pid, "the VMM did not exit within 5 s");
            }
        }
        Ok(())
    }

    /// Snapshot layers and temp files no sandbox or template references.
    fn remove_orphans(&self) -> Result<(), ServiceError> {
        let mut live: HashSet<std::path::PathBuf> = self.store.referenced_paths()?;
        // Every layer of every referenced chain is live too: as the store
        // records them (`recover_layers` recorded each root's chain once
        // the gate checked it), never as a VMM's `lineage.json` says, so a
        // forged record keeps nothing and points nowhere.
        live.extend(self.store.live_layers()?);
        // Sandbox directories of sandboxes that are not deleted hold their
        // VMM's socket and console.
        for s in self.store.list_sandboxes(&SandboxFilter::default())? {
            live.insert(self.sandbox_dir(&s.id).join("ctl.sock"));
            live.insert(self.sandbox_dir(&s.id).join("console.log"));
        }
        // A filesystem-only snapshot's directory holds its disk.
        for t in self.store.list_templates(false)? {
            if t.boots_from_disk() {
                live.insert(self.template_dir(&t.id));
            }
        }
        for sub in ["sandboxes", "templates"] {
            let dir = self.config.data_dir.join(sub);
            match cleanup_orphans(&dir, &live) {
                Ok(report) => {
                    tracing::info!(?report, "removed orphaned files in {}", dir.display())
                }
                Err(e) => tracing::warn!("cannot clean {}: {e}", dir.display()),
            }
        }
        Ok(())
    }
}

/// The state a hibernation started from (its operation's `from`), Running
/// for records that do not say.
fn hibernated_from(detail: &serde_json::Value) -> SandboxState {
    detail
        .get("from")
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .filter(|s| matches!(s, SandboxState::Paused | SandboxState::Running))
        .unwrap_or(SandboxState::Running)
}
