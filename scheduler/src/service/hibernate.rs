//! Hibernation: pause, snapshot (a diff on the snapshot the VM runs from,
//! full past `MAX_DIFF_DEPTH` layers or with an object store) and the
//! VMM's exit, in one request to it; the answer says where its time went
//! ([`HibernateReport`]).

use std::time::Instant;

use serde_json::json;

use super::ops::{Lap, VmmEnd};
use super::vmm;
use super::{Outcome, Service, ServiceError};
use crate::model::{HibernateReport, SandboxId};
use crate::state::{can, Operation, SandboxState};
use crate::store::{OperationKind, OperationStatus, StateChange};

/// Whether a hibernation waits for its VMM's exit before it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Exit {
    /// A client's: answered without the exit (the reaper waits for it).
    Later,
    /// The policy's, freeing memory: done when the memory is free.
    Waited,
}

impl Service {
    /// Hibernates: pause, diff snapshot on the snapshot it runs from (full
    /// past `MAX_DIFF_DEPTH` layers), end the VMM.
    /// The answer does not wait for the VMM's exit (it was told to exit
    /// with the snapshot): the reaper does.
    pub fn hibernate(&self, id: &SandboxId) -> Result<Outcome, ServiceError> {
        let _guard = self.lock_sandbox(id)?;
        self.hibernate_locked(id, Exit::Later)
    }

    /// [`Self::hibernate`] with the sandbox's lock held; `exit`: whether
    /// it returns before the VMM's exit.
    pub(super) fn hibernate_locked(
        &self,
        id: &SandboxId,
        exit: Exit,
    ) -> Result<Outcome, ServiceError> {
        let started = Instant::now();
        let mut lap = Lap::new();
        let sandbox = self.store.get_sandbox(id)?;
        let path = can(Operation::Hibernate, sandbox.state)
            .map_err(|e| ServiceError::illegal(id, e, "hibernate"))?;
        if path.is_empty() {
            // Hibernated already: a snapshot whose upload failed is
            // uploaded now (a hibernation is retried by asking again).
            let sandbox = self.store_hibernation(sandbox)?;
            return Ok(Outcome {
                sandbox,
                resumed: false,
                resume_ms: None,
            });
        }
        let handle = Self::running_handle(&sandbox)?.clone();
        // A memory file still arriving is waited for: the snapshot is
        // taken from a complete one.
        self.settle_lazy(id)?;
        let target = self
            .sandbox_dir(id)
            .join(format!("snap-{}", sandbox.generation + 1));
        let change = StateChange::new(sandbox.state, SandboxState::Hibernating);
        let op = self.store.begin_operation(
            Some(id),
            OperationKind::Hibernate,
            &json!({ "snapshot": target, "from": sandbox.state }),
            Some(&change),
        )?;
        let begin_ms = lap.next();
        // With an object store, a full snapshot: it restores alone, on any
        // pod (the store keeps what it shares with older layers once).
        let diff =
            self.objects.is_none() && super::layers::diff_allowed(sandbox.snapshot.as_deref());
        // One request: pause, snapshot and exit in the VMM; on failure the
        // VMM leaves the VM as it was (running or paused).
        let taken = vmm::hibernate(&handle, &target, diff);
        let vmm_ms = lap.next();
        self.conclude(
            &op.id,
            taken,
            |info| {
                let mut report = HibernateReport {
                    ms: 0.0,
                    vmm_ms: info.duration_us as f64 / 1000.0,
                    diff: info.diff,
                    memory_bytes: info.memory_allocated_bytes,
                    phases: vec![("begin".into(), begin_ms), ("vmm".into(), vmm_ms)],
                };
                self.end_vmm(
                    &sandbox,
                    match exit {
                        Exit::Later => VmmEnd::Told,
                        Exit::Waited => VmmEnd::Wait,
                    },
                )?;
                report.phase("stop", lap.next());
                if let Err(e) = self.set_snapshot_and_layers(id, &target) {
                    // The VMM reported a chain the gate refuses: its
                    // snapshot is not used, and its VM is gone.
                    self.metrics.hibernate_failed();
                    let _ = std::fs::remove_dir_all(&target);
                    let change = StateChange::failed(SandboxState::Hibernating, &e);
                    return self.roll_back(&op.id, change, e);
                }
                report.phase("record", lap.next());
                let change = StateChange::new(SandboxState::Hibernating, SandboxState::Hibernated);
                self.store
                    .finish_operation(&op.id, OperationStatus::Done, None, Some(&change))?;
                report.phase("commit", lap.next());
                // A full snapshot leaves the old chain to nothing; a diff
                // sits on the snapshot the sandbox ran from, so no layer
                // dies with it (and the sweep, a recursive query over
                // every layer, is 0.4 ms of a 5 ms hibernation).
                if !report.diff {
                    self.remove_dead_layers();
                }
                // Acknowledged once the snapshot is durable in the object
                // store, if there is one, unless `--hibernate-ack local`
                // (hibernated here either way: a failed upload is retried
                // by the next hibernate, and by the pod's upkeep:
                // `objects.rs`).
                let mut sandbox = self.hibernation_taken(self.store.get_sandbox(id)?)?;
                report.phase("store", lap.next());
                let ms = started.elapsed().as_secs_f64() * 1000.0;
                self.metrics.observe_hibernate(ms);
                report.ms = ms;
                sandbox.hibernation = Some(report);
                Ok(Outcome {
                    sandbox,
                    resumed: false,
                    resume_ms: None,
                })
            },
            |_| {
                self.metrics.hibernate_failed();
                let _ = std::fs::remove_dir_all(&target);
                // Back to where it came from: a paused sandbox stays paused.
                StateChange::new(SandboxState::Hibernating, sandbox.state)
            },
        )
    }
}
