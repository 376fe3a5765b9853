//! Durable checkpoints (issue 29, `--checkpoint-interval-s N`): on a pod
//! with an object store, every running or paused sandbox's state is
//! snapshotted every N seconds and stored there, so that a pod lost for
//! good loses at most about N seconds of it: a cluster's replica then
//! moves the sandbox to a pod up, which wakes it from that snapshot
//! (`torpor_cluster`'s `moved.rs`). Without it, such a sandbox is lost
//! with its pod.
//!
//! A checkpoint is the snapshot a named checkpoint takes of a live
//! sandbox (`checkpoint.rs`'s `snapshot_live`: the VMM paused, the
//! snapshot written, the VMM running again), but full, as a hibernation
//! to the object store is (a stored layer restores alone), in
//! `sandboxes/<id>/durable-<n>`, which the sandbox then runs from (its
//! next snapshot diffs against it; the one before goes once nothing sits
//! on it). It is uploaded after the sandbox's lock is released, so the
//! sandbox's own operations wait only for the snapshot; the sandbox's
//! `stored_snapshot` and `stored_at` say what is durable and since when.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{Service, ServiceError};
use crate::model::{Sandbox, SandboxId};
use crate::state::SandboxState;
use crate::store::{OperationKind, SandboxFilter};

/// The name of a durable checkpoint's directory begins with this: a
/// replica moves a running sandbox of a lost pod only from such a layer
/// (a running sandbox's snapshot may also be its template's, or the
/// hibernation it woke from, which are not its current state).
pub const DURABLE_PREFIX: &str = "durable-";

/// Whether `sandbox` (running or paused) runs from a durable checkpoint
/// stored in the object store.
pub fn has_durable_checkpoint(sandbox: &Sandbox) -> bool {
    sandbox.stored_snapshot.is_some()
        && sandbox
            .snapshot
            .as_deref()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(DURABLE_PREFIX))
}

/// Starts the thread that checkpoints every running or paused sandbox
/// every `every` (the service's own thread; it ends with the service).
pub(super) fn start(service: &Arc<Service>, every: Duration) {
    let weak = Arc::downgrade(service);
    let stop = Arc::clone(&service.stop);
    let spawned = std::thread::Builder::new()
        .name("torpor-durable".into())
        .spawn(move || loop {
            let started = Instant::now();
            while started.elapsed() < every {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(every.min(Duration::from_millis(200)));
            }
            let Some(service) = weak.upgrade() else {
                return;
            };
            service.checkpoint_all();
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the durable checkpoints' thread: {e}");
    }
}

impl Service {
    /// One round: every running or paused sandbox checkpointed, one after
    /// another (a failure is logged; the next round tries again).
    fn checkpoint_all(&self) {
        let filter = SandboxFilter {
            states: vec![SandboxState::Running, SandboxState::Paused],
            ..Default::default()
        };
        let sandboxes = match self.store.list_sandboxes(&filter) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("durable checkpoints: cannot list sandboxes: {e}");
                return;
            }
        };
        for s in sandboxes {
            if let Err(e) = self.durable_checkpoint(&s.id) {
                tracing::warn!(sandbox = %s.id, "durable checkpoint: {e}");
            }
        }
    }

    /// Sandbox `id`'s state, if it is running or paused, snapshotted and
    /// stored in the object store; the sandbox as it reads after, or None
    /// when there was nothing to do (no object store, another state).
    pub fn durable_checkpoint(&self, id: &SandboxId) -> Result<Option<Sandbox>, ServiceError> {
        if self.objects.is_none() {
            return Ok(None);
        }
        let started = Instant::now();
        let (dir, snapshot_ms) = {
            let _guard = self.lock_sandbox(id)?;
            let sandbox = self.store.get_sandbox(id)?;
            let live = matches!(sandbox.state, SandboxState::Running | SandboxState::Paused);
            if !live || sandbox.vmm.is_none() {
                return Ok(None);
            }
            let target = self.sandbox_dir(id).join(format!(
                "{DURABLE_PREFIX}{}",
                crate::model::Timestamp::now().0
            ));
            let detail = json!({ "durable": true });
            let written = self.snapshot_live(&sandbox, OperationKind::Durable, target, detail)?;
            self.commit_written(&sandbox, &written, None)?;
            (written.dir, started.elapsed().as_secs_f64() * 1000.0)
        };
        // Uploaded with the sandbox's lock released: its operations go on
        // meanwhile (a delete removing the directory fails the upload,
        // which is then only logged). The template's too: the pod that
        // takes the sandbox needs it.
        let template = self.store.get_sandbox(id)?.template;
        if let Some(t) = self.store.get_template(&template)?.snapshot_dir {
            self.store_layer(&t)?;
        }
        self.store_layer(&dir)?;
        tracing::info!(
            sandbox = %id,
            snapshot_ms,
            total_ms = started.elapsed().as_secs_f64() * 1000.0,
            "durable checkpoint stored"
        );
        Ok(Some(self.store.get_sandbox(id)?))
    }
}
