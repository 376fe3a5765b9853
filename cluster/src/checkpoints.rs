//! Checkpoints through a replica: taken and deleted on the sandbox's pod
//! (which holds its snapshots) through its work queue, as the sandbox's
//! other commands are (`Cluster::command`, the replica's `operate`);
//! listed and restored on that pod (relayed). Here: their results in
//! PostgreSQL.
//!
//! - A take (`POST /v1/sandboxes/{id}/checkpoints`) is one operation of
//!   kind `checkpoint` (`torpor_sandbox_api::Operation::Checkpoint`), admitted in PostgreSQL
//!   against the tenant's snapshot disk with it: a snapshot of the
//!   sandbox's memory (the quota's upper bound), counted while pending,
//!   then as the checkpoint's row, which the result writes with the
//!   operation in one statement (`checkpoints`, schema version 11;
//!   `Db::finish`). Two replicas taking checkpoints of one tenant at once
//!   cannot pass its quota together.
//! - A delete (`DELETE .../checkpoints/{name}`) is a `checkpoint_delete`;
//!   its result removes the row. A sandbox's delete removes its rows.
//! - Either, retried with its `Idempotency-Key`, is the first outcome.

use serde_json::Value;
use torpor_scheduler::model::{PodId, SandboxId};

/// A checkpoint's result with its operation, in one statement: a take
/// writes the checkpoint's row (its sandbox's tenant and memory, as the
/// quota counts it), a delete removes it; only if the operation was
/// pending (a result applied once).
pub(super) async fn finish(
    c: &tokio_postgres::Client,
    operation: &str,
    outcome: &Value,
    pod: &PodId,
    checkpoint: (&SandboxId, &str),
    taken: bool,
) -> Result<u64, tokio_postgres::Error> {
    const OP: &str = "WITH op AS (
            UPDATE operations SET status = 'done', outcome = $2, finished_at = now()
            WHERE id = $1 AND pod = $3 AND status = 'pending' RETURNING id)";
    let sql = if taken {
        format!(
            "{OP} INSERT INTO checkpoints (sandbox, name, tenant, mem_mib)
             SELECT s.id, $5::text, s.tenant, (s.body->>'mem_mib')::bigint
             FROM op, sandboxes s WHERE s.id = $4 AND s.pod = $3
             ON CONFLICT (sandbox, name) DO NOTHING"
        )
    } else {
        format!(
            "{OP} DELETE FROM checkpoints
             WHERE sandbox = $4 AND name = $5 AND EXISTS (SELECT 1 FROM op)"
        )
    };
    let (sandbox, name) = checkpoint;
    c.execute(
        &sql,
        &[&operation, outcome, &pod.as_str(), &sandbox.as_str(), &name],
    )
    .await
}
