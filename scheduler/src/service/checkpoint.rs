//! Named checkpoints of a sandbox, restoring a sandbox from one, and
//! forking a new sandbox from one.
//!
//! A checkpoint of a running or paused sandbox is a diff snapshot taken on
//! the paused VMM (full past `MAX_DIFF_DEPTH` layers), after which the
//! sandbox is left as it was; the VMM then diffs against the checkpoint, so
//! the sandbox's next hibernation sits on it. A checkpoint of a hibernated
//! sandbox is a reference to its hibernation snapshot, which nothing ever
//! writes again: no copy. Either way the checkpoint's layer chain is shared
//! (with the sandbox, with forks, with the template) and kept by the
//! store's layer reference counting, not by whoever wrote it.
//!
//! A checkpoint is journaled (operation `checkpoint`, with its id, name and
//! directory) before the VMM is paused, and listed in the same transaction
//! that ends the operation. The snapshot's `state` file, written last and
//! atomically by the VMM, is the commit point: after a crash, recovery
//! lists a checkpoint whose `state` exists (the VMM already diffs against
//! it) and removes the directory of one whose `state` does not. A restore
//! interrupted by a crash is finished by recovery (the checkpoint it names
//! is intact), whichever VMM the crash left.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;
use torpor_vmm_api::control::Request;

use super::conclude::Undo;
use super::layers::{commit_layer, diff_allowed, parent_checkpoint};
use super::lifetime::{check_lifetimes, expiry};
use super::resident::Ask;
use super::{vmm, Outcome, Service, ServiceError, LOCAL_POD};
use crate::model::{Checkpoint, CheckpointId, PodId, Sandbox, SandboxId, Timestamp};
use crate::state::SandboxState;
use crate::store::{LayerOwner, OperationKind, OperationStatus, StateChange, Tx};

/// Longest checkpoint name.
pub const MAX_CHECKPOINT_NAME: usize = 64;

/// Test hook: when this environment variable names a stall point
/// (`checkpoint-paused`: journaled and paused, nothing written;
/// `checkpoint-written`: the snapshot complete, not yet listed;
/// `restore-stopped`: the old VMM stopped, the new one not started), the
/// operation creates `<data_dir>/stalled-<point>` and waits there for good,
/// so a test can kill the service at exactly that point.
pub const STALL_ENV: &str = "TORPOR_TEST_STALL_AT";

/// Taking a checkpoint (the API's request body).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateCheckpoint {
    pub name: String,
}

/// Restoring a sandbox from one of its checkpoints (the API's request body).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RestoreCheckpoint {
    pub checkpoint: String,
}

/// Forking a new sandbox (the API's request body): from the named
/// checkpoint, or without one from a fresh snapshot of the current state.
/// Memory, vCPUs and template are the source's.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkSandbox {
    #[serde(default)]
    pub checkpoint: Option<String>,
    /// At most [`super::MAX_KEEP_ALIVE_MS`].
    #[serde(default)]
    pub keep_alive_ms: Option<u64>,
    /// At most [`super::MAX_TIMEOUT_MS`].
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Environment variables for every command, over the source's (which
    /// the fork keeps).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// What the fork's timeout does; the source's when absent.
    #[serde(default)]
    pub on_timeout: Option<crate::model::OnTimeout>,
    /// The fork's in-sandbox API token (E2B's `envdAccessToken`); not part
    /// of the API's body.
    #[serde(skip)]
    pub access_token: Option<String>,
    /// Wait (up to 30 s) for capacity instead of refusing at once.
    #[serde(default)]
    pub queue: bool,
    /// How many forks to make, 1 to [`MAX_FORK_COUNT`]: with it the API
    /// answers them as a list, all made or none (each admitted against the
    /// tenant's quota first). The API's: [`Service::fork_sandbox`] makes
    /// one, and refuses another count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
}

/// Largest `count` of one fork request (E2B's SDK's `MAX_FORK_COUNT`).
pub const MAX_FORK_COUNT: u32 = 20;

/// 1 to 64 characters of `A-Z a-z 0-9 . _ -`, starting with a letter or
/// digit (names appear in URLs and file listings).
pub fn validate_checkpoint_name(name: &str) -> Result<(), ServiceError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let valid = (1..=MAX_CHECKPOINT_NAME).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.chars().all(ok_char);
    if valid {
        Ok(())
    } else {
        Err(ServiceError::Invalid(format!(
            "checkpoint name {name:?} must be 1 to {MAX_CHECKPOINT_NAME} characters of \
             A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )))
    }
}

fn refuse(sandbox: &Sandbox, what: &str) -> ServiceError {
    ServiceError::Conflict {
        id: sandbox.id.to_string(),
        state: sandbox.state,
        message: format!(
            "cannot {what} a sandbox that is {}: it must be running, paused or hibernated",
            sandbox.state
        ),
    }
}

fn holds_snapshot(state: SandboxState) -> bool {
    matches!(
        state,
        SandboxState::Running | SandboxState::Paused | SandboxState::Hibernated
    )
}

/// A snapshot just written by a live VMM, not yet committed.
pub(super) struct Written {
    op: crate::model::OperationId,
    pub(super) dir: PathBuf,
}

impl Service {
    pub fn list_checkpoints(&self, id: &SandboxId) -> Result<Vec<Checkpoint>, ServiceError> {
        Ok(self.store.list_checkpoints(id)?)
    }

    pub fn get_checkpoint(&self, id: &SandboxId, name: &str) -> Result<Checkpoint, ServiceError> {
        Ok(self.store.find_checkpoint(id, name)?)
    }

    /// Takes a named checkpoint of a running, paused or hibernated sandbox
    /// and leaves it in the state it was in.
    pub fn create_checkpoint(
        &self,
        id: &SandboxId,
        req: CreateCheckpoint,
    ) -> Result<Checkpoint, ServiceError> {
        validate_checkpoint_name(&req.name)?;
        let _guard = self.lock_sandbox(id)?;
        let sandbox = self.store.get_sandbox(id)?;
        if !holds_snapshot(sandbox.state) {
            return Err(refuse(&sandbox, "checkpoint"));
        }
        if self.store.find_checkpoint(id, &req.name).is_ok() {
            return Err(ServiceError::ResourceConflict(format!(
                "sandbox {id} already has a checkpoint named {:?}",
                req.name
            )));
        }
        let checkpoint_id = CheckpointId::generate();
        let mut checkpoint = Checkpoint {
            id: checkpoint_id.clone(),
            sandbox: id.clone(),
            name: req.name.clone(),
            snapshot_dir: PathBuf::new(),
            parent: None,
            created_at: Timestamp::now(),
        };
        if sandbox.state == SandboxState::Hibernated {
            // Its hibernation snapshot is immutable: reference it.
            let dir = self.hibernation_snapshot(&sandbox)?;
            let chain = self.checked_chain(&LayerOwner::Sandbox(id.clone()), &dir)?;
            checkpoint.snapshot_dir = dir;
            self.store.write(|tx| {
                tx.register_layers(&chain)?;
                let mut c = checkpoint.clone();
                c.parent = parent_checkpoint(tx, id, &chain)?;
                tx.insert_checkpoint(&c)
            })?;
        } else {
            let target = self.sandbox_dir(id).join(format!(
                "ckpt-{}",
                checkpoint_id
                    .as_str()
                    .trim_start_matches(CheckpointId::PREFIX)
            ));
            let detail = json!({ "checkpoint": checkpoint_id, "name": req.name });
            let written =
                self.snapshot_live(&sandbox, OperationKind::Checkpoint, target, detail)?;
            checkpoint.snapshot_dir = written.dir.clone();
            self.commit_written(&sandbox, &written, Some(&checkpoint))?;
        }
        Ok(self.store.find_checkpoint(id, &req.name)?)
    }

    /// Removes a checkpoint's name; its layers stay while anything else
    /// (the sandbox's later snapshots, forks) sits on them.
    pub fn delete_checkpoint(&self, id: &SandboxId, name: &str) -> Result<(), ServiceError> {
        let _guard = self.lock_sandbox(id)?;
        let checkpoint = self.store.find_checkpoint(id, name)?;
        self.store.remove_checkpoint(&checkpoint.id)?;
        self.remove_dead_layers();
        Ok(())
    }

    /// Replaces the sandbox's VM with one restored from its checkpoint
    /// `name`; the sandbox runs afterwards.
    pub fn restore_checkpoint(
        &self,
        id: &SandboxId,
        req: RestoreCheckpoint,
    ) -> Result<Outcome, ServiceError> {
        let started = Instant::now();
        let _guard = self.lock_sandbox(id)?;
        let sandbox = self.store.get_sandbox(id)?;
        if !holds_snapshot(sandbox.state) {
            return Err(refuse(&sandbox, "restore"));
        }
        let checkpoint = self.store.find_checkpoint(id, &req.checkpoint)?;
        let from = sandbox.state;
        let snapshot = checkpoint.snapshot_dir.clone();
        let begin = |tx: &Tx<'_>| {
            tx.begin_operation(
                Some(id),
                OperationKind::Restore,
                &json!({ "checkpoint": checkpoint.id, "snapshot": snapshot, "from": from }),
                Some(&StateChange::new(from, SandboxState::Resuming)),
            )
        };
        // A hibernated sandbox's memory counts again once it is resuming.
        let op = if from == SandboxState::Hibernated {
            self.admit_with(Ask::sandbox(&sandbox), false, begin)?
        } else {
            self.store.write(begin)?
        };
        self.stop_vmm(&sandbox)?;
        self.stall("restore-stopped");
        self.conclude(
            &op.id,
            self.start_vmm(id, &snapshot),
            |_| {
                let chain = self.checked_chain(&LayerOwner::Sandbox(id.clone()), &snapshot)?;
                self.store.write(|tx| {
                    tx.register_layers(&chain)?;
                    tx.set_sandbox_snapshot(id, Some(&snapshot))?;
                    tx.set_sandbox_hibernation(id, false, false)?;
                    let change = StateChange::new(SandboxState::Resuming, SandboxState::Running);
                    tx.finish_operation(&op.id, OperationStatus::Done, None, Some(&change))?;
                    tx.touch(id, Timestamp::now())
                })?;
                // What the old VM ran from may be needed by nothing now.
                self.remove_dead_layers();
                Ok(Outcome {
                    sandbox: self.store.get_sandbox(id)?,
                    resumed: from == SandboxState::Hibernated,
                    resume_ms: Some(started.elapsed().as_secs_f64() * 1000.0),
                })
            },
            // A hibernated sandbox still has its snapshot; a live one's VM
            // is gone.
            |e| match from {
                SandboxState::Hibernated => {
                    StateChange::new(SandboxState::Resuming, SandboxState::Hibernated)
                }
                _ => StateChange::failed(
                    SandboxState::Resuming,
                    format!("restore from checkpoint {:?} failed: {e}", checkpoint.name),
                ),
            },
        )
    }

    /// Creates a new sandbox from the source's checkpoint, or from a fresh
    /// snapshot of its current state; the source goes on as it was.
    pub fn fork_sandbox(&self, id: &SandboxId, req: ForkSandbox) -> Result<Sandbox, ServiceError> {
        check_lifetimes(req.keep_alive_ms, req.timeout_ms)?;
        if req.count.is_some_and(|n| n != 1) {
            return Err(ServiceError::Invalid(
                "the service makes one fork per call; a count is the API's".into(),
            ));
        }
        if let Some(name) = &req.checkpoint {
            validate_checkpoint_name(name)?;
        }
        let source = self.store.get_sandbox(id)?;
        // Early, so that a full pod refuses before a snapshot is taken; the
        // admission that counts is the fork's insert below.
        self.admit(Ask::sandbox(&source), req.queue)?;
        let source_guard = self.lock_sandbox(id)?;
        let source = self.store.get_sandbox(id)?;
        let mut fork = Sandbox::new(
            source.template.clone(),
            source.mem_mib,
            source.vcpus,
            req.keep_alive_ms
                .unwrap_or(self.config.default_keep_alive_ms),
        );
        fork.metadata = req.metadata;
        fork.tenant = source.tenant.clone();
        fork.env = source.env.clone();
        fork.env.extend(req.env);
        // A fork keeps its source's egress policy, not its exposed ports.
        fork.network = source.network.clone().map(|mut n| {
            n.ports.clear();
            n.address = None;
            n.counters = None;
            n
        });
        fork.on_timeout = req.on_timeout.unwrap_or(source.on_timeout);
        fork.access_token = req.access_token;
        // And its guest ports' `Host`, as its egress policy.
        fork.ingress_host = source.ingress_host.clone();
        // Its guest has its source's volumes mounted.
        fork.volumes = source.volumes.clone();
        fork.pod = Some(PodId::new(LOCAL_POD));
        fork.expires_at = req
            .timeout_ms
            .map(|t| expiry(Timestamp::now(), t))
            .transpose()?;
        let snapshot = match &req.checkpoint {
            Some(name) => {
                if matches!(source.state, SandboxState::Deleted) {
                    return Err(refuse(&source, "fork"));
                }
                self.store.find_checkpoint(id, name)?.snapshot_dir
            }
            None if !holds_snapshot(source.state) => return Err(refuse(&source, "fork")),
            None if source.state == SandboxState::Hibernated => {
                self.hibernation_snapshot(&source)?
            }
            None => {
                let target = self.sandbox_dir(id).join(format!(
                    "fork-{}",
                    fork.id.as_str().trim_start_matches(SandboxId::PREFIX)
                ));
                let detail = json!({ "fork": fork.id });
                let written = self.snapshot_live(&source, OperationKind::Fork, target, detail)?;
                self.commit_written(&source, &written, None)?;
                written.dir
            }
        };
        // The fork's row references the snapshot before the source's lock
        // goes: from here on the layers are the fork's too.
        fork.snapshot = Some(snapshot.clone());
        let _fork_guard = self.lock_sandbox(&fork.id)?;
        // The snapshot is the source's: checked against what it knows.
        let chain = self.checked_chain(&LayerOwner::Sandbox(id.clone()), &snapshot)?;
        // Shared with the fork from here on: sealed now, while the source
        // is locked, since the fork's own starts and wakes seal nothing
        // outside its directory.
        let layers: Vec<PathBuf> = chain.iter().map(|(dir, _)| dir.clone()).collect();
        self.seal_shared(&layers)?;
        let op = self.admit_with(Ask::sandbox(&fork), false, |tx| {
            tx.register_layers(&chain)?;
            tx.insert_sandbox(&fork)?;
            tx.begin_operation(
                Some(&fork.id),
                OperationKind::Create,
                &json!({ "snapshot": snapshot, "fork_of": id }),
                None,
            )
        })?;
        drop(source_guard);
        self.conclude(
            &op.id,
            self.start_vmm(&fork.id, &snapshot),
            |_| {
                let change = StateChange::new(SandboxState::Creating, SandboxState::Running);
                Ok(self.store.write(|tx| {
                    tx.finish_operation(&op.id, OperationStatus::Done, None, Some(&change))?;
                    tx.get_sandbox(&fork.id)
                })?)
            },
            |e| StateChange::failed(SandboxState::Creating, e),
        )
    }

    fn hibernation_snapshot(&self, sandbox: &Sandbox) -> Result<PathBuf, ServiceError> {
        if sandbox.disk_only {
            return Err(ServiceError::Conflict {
                id: sandbox.id.to_string(),
                state: sandbox.state,
                message: "it kept only its disk, no snapshot: wake it (it reboots) first".into(),
            });
        }
        sandbox.snapshot.clone().ok_or_else(|| {
            ServiceError::Internal(format!("hibernated sandbox {} has no snapshot", sandbox.id))
        })
    }

    /// Journals the operation, pauses the VMM (if running), writes a diff
    /// snapshot on what it runs from into `target`, and lets it run again;
    /// the caller commits the result. On failure nothing is left.
    pub(super) fn snapshot_live(
        &self,
        sandbox: &Sandbox,
        kind: OperationKind,
        target: PathBuf,
        mut detail: serde_json::Value,
    ) -> Result<Written, ServiceError> {
        let handle = Self::running_handle(sandbox)?.clone();
        detail["snapshot"] = json!(target);
        detail["from"] = json!(sandbox.state);
        let op = self
            .store
            .begin_operation(Some(&sandbox.id), kind, &detail, None)?;
        let was_running = sandbox.state == SandboxState::Running;
        // A durable checkpoint is stored alone: full, as a hibernation to
        // the object store is.
        let diff = kind != OperationKind::Durable && diff_allowed(sandbox.snapshot.as_deref());
        let result = (|| {
            if was_running {
                vmm::call(&handle, &Request::Pause)?;
            }
            self.stall("checkpoint-paused");
            vmm::snapshot(&handle, &target, diff)?;
            self.stall("checkpoint-written");
            Ok(())
        })();
        if was_running {
            if let Err(e) = vmm::call(&handle, &Request::Resume) {
                // The policy fails the sandbox if its VMM is gone.
                tracing::warn!(sandbox = %sandbox.id, "cannot resume after the snapshot: {e}");
            }
        }
        // Once `state` is written the VMM diffs against this snapshot,
        // whatever the answer said (a reply lost to a timeout): keep it.
        let written = target.join(torpor_vmm_api::lineage::STATE_FILE).exists();
        let result = result.or_else(|e| if written { Ok(()) } else { Err(e) });
        self.conclude(&op.id, result, Ok, |_| {
            let _ = std::fs::remove_dir_all(&target);
            Undo::Nothing
        })?;
        // Ended by the caller's commit (`commit_written`).
        Ok(Written {
            op: op.id,
            dir: target,
        })
    }

    /// Records a written snapshot's layers, points the source at it, lists
    /// the checkpoint (if any) and ends the operation: one transaction.
    pub(super) fn commit_written(
        &self,
        sandbox: &Sandbox,
        written: &Written,
        checkpoint: Option<&Checkpoint>,
    ) -> Result<(), ServiceError> {
        let owner = LayerOwner::Sandbox(sandbox.id.clone());
        self.conclude(
            &written.op,
            self.checked_chain(&owner, &written.dir),
            |chain| {
                self.store.write(|tx| {
                    commit_layer(tx, &sandbox.id, &written.dir, &chain, checkpoint)?;
                    tx.finish_operation(&written.op, OperationStatus::Done, None, None)
                })?;
                Ok(())
            },
            |_| Undo::Nothing,
        )
    }

    /// The test hook of [`STALL_ENV`].
    fn stall(&self, point: &str) {
        if std::env::var(STALL_ENV).as_deref() != Ok(point) {
            return;
        }
        let marker = self.config.data_dir.join(format!("stalled-{point}"));
        let _ = std::fs::write(&marker, b"");
        tracing::warn!(point, "stalled by {STALL_ENV}");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_names() {
        for ok in ["a", "before-upgrade", "v1.2_rc", &"x".repeat(64), "9lives"] {
            validate_checkpoint_name(ok).unwrap();
        }
        for bad in [
            "",
            "-x",
            ".hidden",
            "a/b",
            "a b",
            "é",
            &"x".repeat(65),
            "..",
            "a\n",
        ] {
            assert!(
                matches!(validate_checkpoint_name(bad), Err(ServiceError::Invalid(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn fork_body_defaults_and_refuses_unknown_fields() {
        let f: ForkSandbox = serde_json::from_str("{}").unwrap();
        assert!(f.checkpoint.is_none() && !f.queue && f.metadata.is_empty());
        assert!(serde_json::from_str::<ForkSandbox>(r#"{"template":"x"}"#).is_err());
        assert!(serde_json::from_str::<CreateCheckpoint>(r#"{"name":"a","x":1}"#).is_err());
    }
}
