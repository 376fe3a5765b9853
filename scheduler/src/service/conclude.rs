//! How an operation journaled as begun ends: done with its result, or
//! rolled back with what undoes it ([`Undo`]), the error returned. Each
//! live operation that can fail after it began ends through
//! [`Service::conclude`]: creates, forks, wakes (by restore or by reboot),
//! hibernations, checkpoint restores, template builds, and the snapshots
//! of a running sandbox that checkpoints and forks take. A delete, which
//! does not roll back, ends by hand; recovery ends the operations a crash
//! interrupted (`recovery.rs`, `layers.rs`).
//!
//! Each begins its own way at its call site: admitted against the pod's
//! room or not (queueing or not), with the rows it inserts in the same
//! commit, durable or relaxed, and some do a step between the beginning
//! and the work whose failure leaves the operation to recovery (a
//! restore ending the old VMM).

use super::{Service, ServiceError};
use crate::model::{OperationId, TemplateId, TemplateState};
use crate::store::{OperationStatus, StateChange};

/// What a failed operation's rollback changes besides its journal entry,
/// in the same commit.
#[derive(Debug)]
pub(super) enum Undo {
    /// Its sandbox's compensating state change.
    Sandbox(StateChange),
    /// The template it was building failed, saying why.
    TemplateFailed(TemplateId, String),
    /// Nothing: it changed no state before it failed (a snapshot of a
    /// sandbox as it runs).
    Nothing,
}

impl From<StateChange> for Undo {
    fn from(change: StateChange) -> Self {
        Undo::Sandbox(change)
    }
}

impl Service {
    /// How an operation journaled as begun ends. `work` is its long part
    /// (a launch, a snapshot); on success `done` records its result,
    /// ending the operation in that commit (or, for a snapshot its caller
    /// commits, later); on failure the operation is journaled rolled back
    /// with what `undo` says undoes it (run before that commit: it may
    /// clean up files or the VMM too), and the error returned.
    pub(super) fn conclude<W, T, U: Into<Undo>>(
        &self,
        op: &OperationId,
        work: Result<W, ServiceError>,
        done: impl FnOnce(W) -> Result<T, ServiceError>,
        undo: impl FnOnce(&ServiceError) -> U,
    ) -> Result<T, ServiceError> {
        match work {
            Ok(w) => done(w),
            Err(e) => {
                let undo = undo(&e);
                self.roll_back(op, undo, e)
            }
        }
    }

    /// Journals `op` rolled back with `undo` in one commit, and returns
    /// the error that caused it.
    pub(super) fn roll_back<T>(
        &self,
        op: &OperationId,
        undo: impl Into<Undo>,
        e: ServiceError,
    ) -> Result<T, ServiceError> {
        let undo = undo.into();
        self.store.write(|tx| {
            let change = match &undo {
                Undo::Sandbox(change) => Some(change),
                Undo::TemplateFailed(id, why) => {
                    tx.set_template_state(id, &TemplateState::Failed(why.clone()))?;
                    None
                }
                Undo::Nothing => None,
            };
            tx.finish_operation(op, OperationStatus::RolledBack, None, change)
        })?;
        Err(e)
    }
}
