//! A create's (or a fork's, all of its count at once, or a wake's)
//! admission against its tenant's quota, in PostgreSQL: the one
//! source of truth every replica counts in, atomically. In one transaction
//! (on the connection kept for it, [`Db`]'s `admission`): the tenant's
//! quota row is locked (`FOR UPDATE`), its use counted in one statement
//! (its sandboxes, as [`torpor_gate::quota::usage_of`] counts them, plus what
//! its pending creates asked: [`usage`]), checked ([`torpor_gate::quota::check`]), and the create journaled
//! with what it asks; the commit frees the lock. A replica admitting for
//! the same tenant at the same time waits for the lock, and its count,
//! read after, sees that create. A create is counted while it is pending
//! (its `asked`), then as its sandbox (written with its outcome in one
//! statement, `Db::finish`), never both or neither; a failed create no
//! more. A tenant without a quota row is not locked or counted: its
//! create is journaled in one statement that checks there is none
//! (`insert_operation_unless_quota`), on the connection requests share.

use std::time::Duration;

use serde_json::Value;
use tokio_postgres::{Client, Transaction};

use super::db::{insert_operation, insert_operation_unless_quota, pg, Db, NewOp, OpRow};
use super::ClusterError;
use torpor_gate::quota::{check, usage_of, Quota, Usage};

/// How long an admission waits for its tenant's lock before it answers
/// 503 (another replica's admission holds it for a few reads).
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

impl Db {
    /// Journals the create `op` if its tenant's quota admits `asked`
    /// more: its row if journaled, none if its tenant used its idempotency
    /// key already (that create was admitted then: not counted again);
    /// [`ClusterError::Quota`] past the quota.
    pub(super) async fn admit(
        &self,
        op: &NewOp<'_>,
        asked: &Usage,
    ) -> Result<Option<OpRow>, ClusterError> {
        // A tenant without a quota row has nothing to lock or count: one
        // statement on the shared connection (which requests share at
        // once), not a transaction on the one kept for admissions.
        let shared = self.client().await?;
        if let Some(inserted) = insert_operation_unless_quota(&shared, op, asked).await? {
            return Ok(inserted);
        }
        let mut conn = self.admission.lock().await;
        let client = match conn.take().filter(|c| !c.is_closed()) {
            Some(c) => conn.insert(c),
            None => conn.insert(self.connect().await?),
        };
        let admitted = admit_on(client, op, asked).await;
        if let Err(ClusterError::Postgres(_)) = admitted {
            // A transaction left open on a broken connection: closed with
            // it (the server rolls it back); the next admission connects.
            *conn = None;
        }
        admitted
    }
}

async fn admit_on(
    c: &mut Client,
    op: &NewOp<'_>,
    asked: &Usage,
) -> Result<Option<OpRow>, ClusterError> {
    let tx = c.transaction().await.map_err(pg)?;
    tx.batch_execute(&format!(
        "SET LOCAL lock_timeout = '{}ms'",
        LOCK_TIMEOUT.as_millis()
    ))
    .await
    .map_err(pg)?;
    let quota = tx
        .query_opt(
            "SELECT quota FROM tenant_quotas WHERE tenant = $1 FOR UPDATE",
            &[&op.tenant],
        )
        .await
        .map_err(pg)?
        .map(|r| super::tenants::quota_of(op.tenant, r.get(0)))
        .transpose()?
        .unwrap_or_default();
    if let Some(key) = op.idempotency_key {
        let used = tx
            .query_opt(
                "SELECT 1 FROM operations WHERE tenant = $1 AND idempotency_key = $2",
                &[&op.tenant, &key],
            )
            .await
            .map_err(pg)?;
        if used.is_some() {
            return Ok(None);
        }
    }
    if quota != Quota::default() {
        let used = usage(&tx, op.tenant).await?;
        check(op.tenant, &quota, &used, asked)?;
    }
    let inserted = insert_operation(&tx, op, Some(asked)).await?;
    tx.commit().await.map_err(pg)?;
    Ok(inserted)
}

/// `tenant`'s use: its sandboxes, as [`usage_of`] counts them, its
/// checkpoints (each as its sandbox's memory, `checkpoints.rs`), its
/// templates in the pods' catalogs (each as its memory: built, or made
/// from a sandbox, as `quota.rs` counts them on one pod), plus
/// what its pending creates, forks, wakes, builds and checkpoints asked. One statement, so one snapshot: read
/// in two, a create finished between them (its operation done and its
/// sandbox written at once) was in neither (tests/cluster.rs admitted 4
/// against a quota of 3 under load). A sandbox a heartbeat wrote before
/// its create's result is counted twice until then: a refusal at the
/// limit, never an admission past it.
async fn usage(tx: &Transaction<'_>, tenant: &str) -> Result<Usage, ClusterError> {
    let rows = tx
        .query(
            "SELECT body, pod, NULL::jsonb FROM sandboxes
                WHERE tenant = $1 AND state <> 'deleted'
             UNION ALL
             SELECT NULL, NULL, asked FROM operations
                WHERE tenant = $1 AND status = 'pending' AND asked IS NOT NULL
             UNION ALL
             SELECT NULL, NULL, jsonb_build_object('running_sandboxes', 0,
                    'total_sandboxes', 0, 'memory_mib', 0, 'snapshot_disk_mib', c.mem_mib)
                FROM checkpoints c JOIN sandboxes s ON s.id = c.sandbox
                WHERE c.tenant = $1 AND s.state <> 'deleted'
             UNION ALL
             SELECT NULL, NULL, jsonb_build_object('running_sandboxes', 0,
                    'total_sandboxes', 0, 'memory_mib', 0, 'snapshot_disk_mib', t.mem)
                FROM (SELECT DISTINCT t->>'id' AS id, (t->>'mem_mib')::bigint AS mem
                      FROM pods, jsonb_array_elements(catalog) t
                      WHERE t->>'tenant' = $1 AND t->>'state' <> 'deleted') t",
            &[&tenant],
        )
        .await
        .map_err(pg)?;
    let mut sandboxes = Vec::new();
    let mut pending = Usage::default();
    for r in rows {
        match (r.get::<_, Option<Value>>(0), r.get::<_, Option<String>>(1)) {
            (Some(body), Some(pod)) => sandboxes.push(Db::sandbox_of(body, pod)?.0),
            _ => {
                let asked: Value = r.get(2);
                let asked: Usage = serde_json::from_value(asked)
                    .map_err(|e| ClusterError::Schema(format!("a create's usage: {e}")))?;
                pending.add(&asked);
            }
        }
    }
    let mut used = usage_of(&sandboxes);
    used.add(&pending);
    Ok(used)
}
