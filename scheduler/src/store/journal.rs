//! The operations journal: every multi-step operation (create, hibernate,
//! wake, ...) is recorded as `started` before its first side effect and as
//! `done` or `rolled_back` after its last. A crash leaves `started` rows;
//! [`Tx::interrupted_operations`] lists them for recovery at start-up.
//!
//! An operation's first and last sandbox state changes can be made in the
//! same transaction as its journal entry (`change`), so the journal and the
//! sandbox's state never disagree: a sandbox in a transitional state
//! (creating, hibernating, resuming) has a started operation.

use rusqlite::{params, OptionalExtension, Row};
use serde::{Deserialize, Serialize};

use super::{Result, StoreError, Tx};
use crate::model::{OperationId, SandboxId, Timestamp};
use crate::state::SandboxState;

str_enum! {
    /// What an operation does.
    pub enum OperationKind {
        /// Place and first restore of a new sandbox.
        Create => "create",
        Pause => "pause",
        Resume => "resume",
        /// Diff snapshot, then the VMM ends.
        Hibernate => "hibernate",
        /// Restore of a hibernated sandbox (resume, or a request that wakes it).
        Wake => "wake",
        Delete => "delete",
        /// A named checkpoint.
        Checkpoint => "checkpoint",
        /// Restore of a sandbox from one of its checkpoints.
        Restore => "restore",
        /// A new sandbox from a checkpoint.
        Fork => "fork",
        /// A running sandbox's state snapshotted for the object store
        /// (`--checkpoint-interval-s`; the sandbox runs on from it).
        Durable => "durable_checkpoint",
        /// Boot of a template and its snapshot.
        BuildTemplate => "build_template",
    }
}

str_enum! {
    /// Where an operation is.
    pub enum OperationStatus {
        Started => "started",
        Done => "done",
        RolledBack => "rolled_back",
    }
}

/// One journal entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperationRecord {
    pub id: OperationId,
    pub sandbox: Option<SandboxId>,
    pub kind: OperationKind,
    pub status: OperationStatus,
    pub started_at: Timestamp,
    pub finished_at: Option<Timestamp>,
    /// What recovery needs to finish or undo it (paths, pod, request id...).
    pub detail: serde_json::Value,
}

/// A compare-and-set state change of the operation's sandbox, made in the
/// same transaction as the journal entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateChange {
    pub from: SandboxState,
    pub to: SandboxState,
    /// Recorded when `to` is failed.
    pub reason: Option<String>,
}

impl StateChange {
    /// `from → to` without a reason.
    pub fn new(from: SandboxState, to: SandboxState) -> Self {
        StateChange {
            from,
            to,
            reason: None,
        }
    }

    /// `from → failed`, with why.
    pub fn failed(from: SandboxState, reason: impl std::fmt::Display) -> Self {
        StateChange {
            from,
            to: SandboxState::Failed,
            reason: Some(reason.to_string()),
        }
    }
}

const COLUMNS: &str = "id, sandbox, kind, state, started_at, finished_at, detail";

fn from_row(row: &Row<'_>) -> rusqlite::Result<OperationRecord> {
    let detail: String = row.get("detail")?;
    let detail = serde_json::from_str(&detail).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(6, rusqlite::types::Type::Text, Box::new(e))
    })?;
    Ok(OperationRecord {
        id: row.get("id")?,
        sandbox: row.get("sandbox")?,
        kind: row.get("kind")?,
        status: row.get("state")?,
        started_at: row.get("started_at")?,
        finished_at: row.get("finished_at")?,
        detail,
    })
}

impl Tx<'_> {
    fn apply_change(
        &self,
        sandbox: Option<&SandboxId>,
        change: Option<&StateChange>,
    ) -> Result<()> {
        if let Some(change) = change {
            let sandbox = sandbox.ok_or_else(|| StoreError::Invalid {
                what: "operation",
                detail: "a state change needs a sandbox".into(),
            })?;
            self.update_sandbox_state(sandbox, change.from, change.to, change.reason.as_deref())?;
        }
        Ok(())
    }

    /// Journals a started operation, and makes `change` (a compare-and-set
    /// of `sandbox`'s state) in the same transaction.
    pub fn begin_operation(
        &self,
        sandbox: Option<&SandboxId>,
        kind: OperationKind,
        detail: &serde_json::Value,
        change: Option<&StateChange>,
    ) -> Result<OperationRecord> {
        if let Some(id) = sandbox {
            self.sandbox_state(id)?;
        }
        self.apply_change(sandbox, change)?;
        let record = OperationRecord {
            id: OperationId::generate(),
            sandbox: sandbox.cloned(),
            kind,
            status: OperationStatus::Started,
            started_at: Timestamp::now(),
            finished_at: None,
            detail: detail.clone(),
        };
        self.conn
            .prepare_cached(&format!(
                "INSERT INTO operations ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, NULL, ?6)"
            ))?
            .execute(params![
                record.id,
                record.sandbox,
                record.kind,
                record.status,
                record.started_at,
                detail.to_string(),
            ])?;
        tracing::debug!(op = %record.id, %kind, sandbox = ?sandbox.map(|s| s.as_str()), "operation started");
        Ok(record)
    }

    /// Marks a started operation `outcome` (done or rolled back), replaces
    /// its detail if given, and makes `change` to its sandbox's state in the
    /// same transaction. Refused with `OperationFinished` if it is not
    /// started any more.
    pub fn finish_operation(
        &self,
        id: &OperationId,
        outcome: OperationStatus,
        detail: Option<&serde_json::Value>,
        change: Option<&StateChange>,
    ) -> Result<OperationRecord> {
        if outcome == OperationStatus::Started {
            return Err(StoreError::Invalid {
                what: "operation outcome",
                detail: "an operation finishes done or rolled back".into(),
            });
        }
        let op = self.get_operation(id)?;
        if op.status != OperationStatus::Started {
            return Err(StoreError::OperationFinished {
                id: id.to_string(),
                status: op.status,
            });
        }
        self.apply_change(op.sandbox.as_ref(), change)?;
        let detail = detail.unwrap_or(&op.detail).to_string();
        self.conn
            .prepare_cached(
                "UPDATE operations SET state = ?2, finished_at = ?3, detail = ?4 WHERE id = ?1",
            )?
            .execute(params![id, outcome, Timestamp::now(), detail])?;
        tracing::debug!(op = %id, %outcome, "operation finished");
        self.get_operation(id)
    }

    /// One journal entry.
    pub fn get_operation(&self, id: &OperationId) -> Result<OperationRecord> {
        self.conn
            .prepare_cached(&format!("SELECT {COLUMNS} FROM operations WHERE id = ?1"))?
            .query_row([id], from_row)
            .optional()?
            .ok_or_else(|| StoreError::not_found("operation", id))
    }

    /// Operations started and never finished (a crash interrupted them),
    /// oldest first.
    pub fn interrupted_operations(&self) -> Result<Vec<OperationRecord>> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT {COLUMNS} FROM operations WHERE state = 'started' ORDER BY started_at, rowid"
        ))?;
        let ops = stmt
            .query_map([], from_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(ops)
    }

    /// Removes finished operations that finished before `finished_before`;
    /// returns how many.
    pub fn prune_operations(&self, finished_before: Timestamp) -> Result<usize> {
        Ok(self.conn.execute(
            "DELETE FROM operations WHERE state != 'started' AND finished_at < ?1",
            [finished_before],
        )?)
    }
}
