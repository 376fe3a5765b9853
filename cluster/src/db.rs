//! The cluster's shared state in PostgreSQL: pods and their last
//! heartbeat, sandbox → pod ownership, the operation journal (each
//! operation's pod, which is its placement, its idempotency key and its
//! outcome), and the tenants' tokens and quotas (`tenants.rs`). The schema is versioned (`schema.rs`'s [`MIGRATIONS`]) and migrated at
//! start under an advisory lock, so replicas starting together are safe.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, GenericClient, NoTls};
use torpor_scheduler::model::{PodId, Sandbox, SandboxId, Template};
use torpor_scheduler::service::held::LayerHeld;
use torpor_sync::Locked;

pub(super) use super::conn::pg;
pub use super::conn::{Conn, CONNECTIONS};
pub use super::schema::MIGRATIONS;
use super::wire::{Heartbeat, OpOutcome, Reply};
use super::ClusterError;
use torpor_gate::quota::Usage;
use torpor_gate::service::ServiceError;

/// The advisory lock key the migrations are applied under.
const MIGRATION_LOCK: i64 = 0x746f_7270_6f72; // "torpor"
/// The state of a deleted sandbox's row (a tombstone, see [`Db::finish`]).
const DELETED: &str = "deleted";
/// A tombstone's generation: above any a pod reports.
const TOMBSTONE: i64 = i64::MAX;

/// How long a catalog change waits for its pod's heartbeats to confirm
/// it (the `60` of `torpor_catalog_pending`).
pub const CHANGE_TTL_S: u64 = 60;

/// [`CONNECTIONS`] connections to PostgreSQL, taken in turn, each made
/// again when it broke; and one more, for the transactions of admission
/// (`admission.rs`), used by one task at a time.
pub struct Db {
    url: String,
    clients: [Mutex<Option<Arc<Conn>>>; CONNECTIONS],
    next: AtomicUsize,
    pub(super) admission: tokio::sync::Mutex<Option<Client>>,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may carry the database password: not printed.
        f.debug_struct("Db").finish_non_exhaustive()
    }
}

/// A pod row.
#[derive(Debug, Clone)]
pub struct PodRow {
    pub id: PodId,
    pub address: String,
    pub token: String,
    pub fingerprint: Option<String>,
    pub load: Value,
    pub templates: Vec<String>,
    /// The images it has installed, as its last heartbeat listed them.
    pub images: Vec<String>,
    pub headroom_mib: f64,
    pub running: i64,
    pub hibernated: i64,
    /// Seconds since its last heartbeat (the database's clock).
    pub silent_s: f64,
    /// How much of each stored layer it holds, as its last heartbeat said.
    pub layers: Vec<LayerHeld>,
}

/// An operation to journal.
#[derive(Debug, Clone, Copy)]
pub struct NewOp<'a> {
    pub id: &'a str,
    pub kind: &'a str,
    pub sandbox: Option<&'a SandboxId>,
    pub pod: &'a PodId,
    pub tenant: &'a str,
    pub idempotency_key: Option<&'a str>,
    /// The existing template it is on (a template's delete).
    pub template: Option<&'a str>,
    /// Its start window and the grace after it (`expiry.rs`): an
    /// operation admitted against its tenant's quota has them.
    pub deadlines: Option<(Duration, Duration)>,
}

/// Milliseconds as PostgreSQL's bigint.
fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Journals `op` on `c` (with what it `asked`, a create admitted against
/// its tenant's quota): false if its tenant used its idempotency key
/// already.
pub(super) async fn insert_operation(
    c: &impl GenericClient,
    op: &NewOp<'_>,
    asked: Option<&Usage>,
) -> Result<Option<OpRow>, ClusterError> {
    let values = Values::of(op, asked)?;
    let row = c
        .query_opt(&insert_sql(false), &values.params(op))
        .await
        .map_err(pg)?;
    Ok(row.map(|r| inserted_row(op, &r, 0)))
}

/// [`insert_operation`] unless `op`'s tenant has a quota row, in one
/// statement: `None` if it has one (its admission then locks and counts
/// it: `admission.rs`), else what [`insert_operation`] answers.
pub(super) async fn insert_operation_unless_quota(
    c: &Conn,
    op: &NewOp<'_>,
    asked: &Usage,
) -> Result<Option<Option<OpRow>>, ClusterError> {
    let values = Values::of(op, Some(asked))?;
    let sql = insert_sql(true);
    let r = c
        .query_opt_prepared(&sql, &values.params(op))
        .await?
        .ok_or_else(|| ClusterError::Postgres("an operation's insert returned no row".into()))?;
    if r.get::<_, bool>(0) {
        return Ok(None);
    }
    let inserted: Option<String> = r.get(1);
    Ok(Some(inserted.map(|_| inserted_row(op, &r, 1))))
}

/// The parameters of [`insert_sql`] that are not `NewOp` fields as they
/// are.
struct Values<'a> {
    sandbox: Option<&'a str>,
    pod: &'a str,
    asked: Option<Value>,
    start: Option<i64>,
    grace: Option<i64>,
}

impl<'a> Values<'a> {
    fn of(op: &NewOp<'a>, asked: Option<&Usage>) -> Result<Self, ClusterError> {
        Ok(Values {
            sandbox: op.sandbox.map(|s| s.as_str()),
            pod: op.pod.as_str(),
            asked: asked
                .map(serde_json::to_value)
                .transpose()
                .map_err(|e| ClusterError::Schema(format!("a create's usage: {e}")))?,
            start: op.deadlines.map(|d| ms(d.0)),
            grace: op.deadlines.map(|d| ms(d.1)),
        })
    }

    fn params<'b>(&'b self, op: &'b NewOp<'_>) -> [&'b (dyn ToSql + Sync); 10] {
        [
            &op.id,
            &op.kind,
            &self.sandbox,
            &self.pod,
            &op.tenant,
            &op.idempotency_key,
            &self.asked,
            &self.start,
            &self.grace,
            &op.template,
        ]
    }
}

/// The insert of an operation (parameters: [`insert_params`]), returning
/// its status and deadlines (none on its tenant's idempotency key used
/// already). `guarded`: only if its tenant has no quota row, the first
/// column saying whether it has one.
fn insert_sql(guarded: bool) -> String {
    let values = "$1::text, $2::text, $3::text, $4::text, $5::text, $6::text, $7::jsonb,
        now() + $8::bigint * interval '1 millisecond',
        now() + ($8::bigint + $9::bigint) * interval '1 millisecond', $10::text";
    let insert = "INSERT INTO operations (id, kind, sandbox, pod, tenant, idempotency_key,
        asked, start_by, expires_at, template)";
    let rest = "ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL
        DO NOTHING
        RETURNING status, (extract(epoch FROM start_by) * 1000)::bigint,
            (extract(epoch FROM expires_at) * 1000)::bigint";
    if guarded {
        format!(
            "WITH q AS (SELECT EXISTS (SELECT 1 FROM tenant_quotas WHERE tenant = $5) AS quota),
             ins AS ({insert} SELECT {values} FROM q WHERE NOT q.quota {rest})
             SELECT q.quota, ins.* FROM q LEFT JOIN ins ON true"
        )
    } else {
        format!("{insert} VALUES ({values}) {rest}")
    }
}

/// The row as inserted (no second read): what the request gave, and the
/// status and deadlines the insert returned from column `at` on.
fn inserted_row(op: &NewOp<'_>, r: &tokio_postgres::Row, at: usize) -> OpRow {
    OpRow {
        id: op.id.to_string(),
        kind: op.kind.to_string(),
        sandbox: op.sandbox.map(|s| s.to_string()),
        template: op.template.map(str::to_string),
        pod: op.pod.to_string(),
        tenant: op.tenant.to_string(),
        status: r.get(at),
        outcome: None,
        start_by_ms: r.get(at + 1),
        expires_ms: r.get(at + 2),
    }
}

/// An operation row.
#[derive(Debug, Clone)]
pub struct OpRow {
    pub id: String,
    pub kind: String,
    pub sandbox: Option<String>,
    /// The template of a template's delete.
    pub template: Option<String>,
    pub pod: String,
    pub tenant: String,
    pub status: String,
    pub outcome: Option<OpOutcome>,
    /// Its `start_by` and `expires_at`, unix ms (`expiry.rs`).
    pub start_by_ms: Option<i64>,
    pub expires_ms: Option<i64>,
}

impl OpRow {
    /// The answer to a request whose `Idempotency-Key` names this
    /// operation but which asks for something else (409).
    pub fn key_used_elsewhere(&self) -> ServiceError {
        ServiceError::ResourceConflict(format!(
            "Idempotency-Key was used for another request: operation {} ({} of {})",
            self.id,
            self.kind,
            self.sandbox.as_deref().unwrap_or("a new sandbox")
        ))
    }
}

impl Db {
    /// Connects and applies the migrations this build knows.
    pub async fn open(url: &str) -> Result<Db, ClusterError> {
        let db = Db {
            url: url.to_string(),
            clients: Default::default(),
            next: AtomicUsize::new(0),
            admission: tokio::sync::Mutex::new(None),
        };
        db.migrate().await?;
        Ok(db)
    }

    /// The next of the shared connections (statements only: a
    /// transaction or a session's lock takes a connection of its own,
    /// [`Db::connect`]).
    pub(super) async fn client(&self) -> Result<Arc<Conn>, ClusterError> {
        let slot = &self.clients[self.next.fetch_add(1, Ordering::Relaxed) % CONNECTIONS];
        if let Some(c) = slot.locked().as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let client = Arc::new(Conn {
            client: self.connect().await?,
            statements: Mutex::default(),
        });
        *slot.locked() = Some(client.clone());
        Ok(client)
    }

    /// A new connection (its task spawned).
    pub(super) async fn connect(&self) -> Result<Client, ClusterError> {
        let (client, connection) = tokio::time::timeout(
            Duration::from_secs(5),
            tokio_postgres::connect(&self.url, NoTls),
        )
        .await
        .map_err(|_| ClusterError::Postgres("connecting timed out".into()))?
        .map_err(pg)?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %e, "PostgreSQL connection ended");
            }
        });
        Ok(client)
    }

    async fn migrate(&self) -> Result<(), ClusterError> {
        let c = self.client().await?;
        c.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(pg)?;
        let applied = self.apply_migrations(&c).await;
        let unlocked = c
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(pg);
        applied?;
        unlocked.map(|_| ())
    }

    async fn apply_migrations(&self, c: &Client) -> Result<(), ClusterError> {
        c.batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (
                version integer PRIMARY KEY,
                applied_at timestamptz NOT NULL DEFAULT now()
            )",
        )
        .await
        .map_err(pg)?;
        let current = applied_version(c).await?;
        let newest = MIGRATIONS.last().map_or(0, |m| m.0);
        if current > newest {
            return Err(ClusterError::Schema(format!(
                "the database is at schema version {current}; this build knows up to {newest}"
            )));
        }
        for (version, sql) in MIGRATIONS.iter().filter(|m| m.0 > current) {
            let script = format!(
                "BEGIN; {sql}; INSERT INTO schema_migrations (version) VALUES ({version}); COMMIT;"
            );
            if let Err(e) = c.batch_execute(&script).await {
                let _ = c.batch_execute("ROLLBACK").await;
                return Err(ClusterError::Schema(format!("migration {version}: {e}")));
            }
            tracing::info!(version, "applied schema migration");
        }
        Ok(())
    }

    /// The schema version in force.
    pub async fn schema_version(&self) -> Result<i32, ClusterError> {
        applied_version(&**self.client().await?).await
    }

    pub async fn heartbeat(&self, pod: &PodId, hb: &Heartbeat) -> Result<(), ClusterError> {
        let c = self.client().await?;
        let catalog = serde_json::to_value(&hb.catalog)
            .map_err(|e| ClusterError::Schema(format!("a pod's templates: {e}")))?;
        // The templates and catalog as the pod lists them, with the
        // changes of builds and deletes it has not listed yet (a heartbeat
        // taken before a build's result, written after it, does not take
        // the template away again: `catalog.rs`).
        c.execute_prepared(
            "INSERT INTO pods (id, address, token, fingerprint, load, templates, headroom_mib,
                running, hibernated, catalog, images, layers, last_heartbeat)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, now())
             ON CONFLICT (id) DO UPDATE SET address = $2, token = $3, fingerprint = $4,
                load = $5, headroom_mib = $7, running = $8, hibernated = $9, images = $11,
                layers = $12, last_heartbeat = now(),
                templates = torpor_catalog_names($6,
                    torpor_catalog_pending($10, pods.catalog_changes)),
                catalog = torpor_catalog($10, torpor_catalog_pending($10, pods.catalog_changes)),
                catalog_changes = torpor_catalog_pending($10, pods.catalog_changes)",
            &[
                &pod.as_str(),
                &hb.address,
                &hb.token,
                &hb.fingerprint,
                &hb.load,
                &hb.templates,
                &hb.headroom_mib,
                &(hb.running as i64),
                &(hb.hibernated as i64),
                &catalog,
                &hb.images,
                &super::layers::layers_json(&hb.layers),
            ],
        )
        .await?;
        // Its sandboxes in one statement, as `upsert_sandbox` writes each
        // (one statement, and one commit, per sandbox held the replica's
        // connection for as many round trips and WAL flushes).
        let mut rows = SandboxRows::default();
        let mut listed = std::collections::HashSet::new();
        for s in hb.sandboxes.iter().filter(|s| listed.insert(&s.id)) {
            rows.push(s)?;
        }
        c.execute_prepared(
            "INSERT INTO sandboxes (id, pod, tenant, state, generation, body)
             SELECT n.id, $1::text, n.tenant, n.state, n.generation, n.body
             FROM unnest($2::text[], $3::text[], $4::text[], $5::bigint[], $6::jsonb[])
                AS n(id, tenant, state, generation, body)
             WHERE NOT EXISTS (SELECT 1 FROM operations
                WHERE sandbox = n.id AND kind = 'delete' AND status = 'done')
             ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state,
                generation = EXCLUDED.generation, body = EXCLUDED.body, updated_at = now()
             WHERE sandboxes.pod = $1 AND sandboxes.generation <= EXCLUDED.generation",
            &[
                &pod.as_str(),
                &rows.ids,
                &rows.tenants,
                &rows.states,
                &rows.generations,
                &rows.bodies,
            ],
        )
        .await?;
        // What the pod no longer holds (deleted by its timeout) and no
        // operation touched lately.
        c.execute_prepared(
            "DELETE FROM sandboxes WHERE pod = $1 AND NOT (id = ANY($2))
                AND updated_at < now() - interval '30 seconds'",
            &[&pod.as_str(), &rows.ids],
        )
        .await?;
        Ok(())
    }

    /// A sandbox row written or updated (only by its owner pod, never
    /// back to an older generation). From a heartbeat, a sandbox a delete
    /// operation removed is not made again: the heartbeat may have been
    /// taken before that delete and be read after it.
    pub(super) async fn upsert_sandbox(
        &self,
        c: &Client,
        pod: &PodId,
        s: &Sandbox,
        heartbeat: bool,
    ) -> Result<(), ClusterError> {
        let body = serde_json::to_value(s).map_err(|e| ClusterError::Postgres(e.to_string()))?;
        c.execute(
            "INSERT INTO sandboxes (id, pod, tenant, state, generation, body)
             SELECT $1::text, $2::text, $3::text, $4::text, $5::bigint, $6::jsonb
             WHERE NOT $7::boolean OR NOT EXISTS (SELECT 1 FROM operations
                WHERE sandbox = $1 AND kind = 'delete' AND status = 'done')
             ON CONFLICT (id) DO UPDATE SET state = $4, generation = $5, body = $6,
                updated_at = now()
             WHERE sandboxes.pod = $2 AND sandboxes.generation <= $5",
            &[
                &s.id.as_str(),
                &pod.as_str(),
                &s.tenant,
                &s.state.as_str(),
                &(s.generation as i64),
                &body,
                &heartbeat,
            ],
        )
        .await
        .map_err(pg)?;
        Ok(())
    }

    /// An operation's result: the journal row finished and the sandbox
    /// row written (or removed), atomically: one statement (the operation's
    /// update a data-modifying `WITH`). Not `BEGIN` ... `COMMIT` on the
    /// replica's one connection, which every task of the replica shares:
    /// its polls of the operation ran inside that open transaction, saw
    /// the outcome before the commit, and answered the client, whose next
    /// read through another replica found no sandbox yet (and a rollback
    /// took any other task's statement with it).
    pub async fn finish(
        &self,
        pod: &PodId,
        operation: &str,
        outcome: &OpOutcome,
    ) -> Result<(), ClusterError> {
        let c = self.client().await?;
        let json =
            serde_json::to_value(outcome).map_err(|e| ClusterError::Postgres(e.to_string()))?;
        let status = if matches!(outcome, OpOutcome::Failed(_)) {
            "failed"
        } else {
            "done"
        };
        // Applied once: a result delivered again (a redelivered event, a
        // pod republishing a journaled outcome) must not write its sandbox
        // again over later operations (a hibernate's result read twice
        // would bring back a sandbox deleted since).
        const PENDING: &str = "WITH op AS (
                UPDATE operations SET status = $2, outcome = $3, finished_at = now(),
                    sandbox = coalesce(sandbox, $4)
                WHERE id = $1 AND pod = $5 AND status = 'pending' RETURNING id)";
        match outcome {
            OpOutcome::Done(Reply::Sandbox { sandbox, .. }) => {
                let body = serde_json::to_value(sandbox)
                    .map_err(|e| ClusterError::Postgres(e.to_string()))?;
                let sql = format!(
                    "{PENDING}
                     INSERT INTO sandboxes (id, pod, tenant, state, generation, body)
                     SELECT $4::text, $5::text, $6::text, $7::text, $8::bigint, $9::jsonb FROM op
                     ON CONFLICT (id) DO UPDATE SET state = $7, generation = $8, body = $9,
                        updated_at = now()
                     WHERE sandboxes.pod = $5 AND sandboxes.generation <= $8"
                );
                // A create's and a wake's: prepared once.
                let statement = c.prepared(&sql).await?;
                let n = c
                    .execute(
                        &statement,
                        &[
                            &operation,
                            &status,
                            &json,
                            &sandbox.id.as_str(),
                            &pod.as_str(),
                            &sandbox.tenant,
                            &sandbox.state.as_str(),
                            &(sandbox.generation as i64),
                            &body,
                        ],
                    )
                    .await;
                if n.is_err() {
                    c.forget(&sql);
                }
                n
            }
            OpOutcome::Done(Reply::Deleted { sandbox }) => {
                // A tombstone (state `deleted`, the largest generation)
                // rather than no row: a heartbeat taken before the delete
                // and written at the same time (another replica) could
                // insert the row again once the delete committed, its
                // check for the finished delete made before that commit.
                // Against the tombstone it is an update to an older
                // generation: none. Reads skip tombstones; the heartbeat's
                // sweep removes them once their pod no longer lists them.
                // Its checkpoints went with it on its pod.
                let sql = format!(
                    "{PENDING}, gone AS (DELETE FROM checkpoints
                        WHERE sandbox = $4 AND EXISTS (SELECT 1 FROM op))
                     UPDATE sandboxes SET state = '{DELETED}', generation = {TOMBSTONE},
                        updated_at = now()
                     WHERE id = $4 AND pod = $5 AND EXISTS (SELECT 1 FROM op)"
                );
                c.execute(
                    &sql,
                    &[&operation, &status, &json, &sandbox.as_str(), &pod.as_str()],
                )
                .await
            }
            OpOutcome::Done(Reply::Sandboxes { sandboxes }) => {
                // A fork's: every new sandbox's row with the operation,
                // in the same one statement (the operation keeps its
                // source sandbox).
                let mut columns = SandboxRows::default();
                for s in sandboxes {
                    columns.push(s)?;
                }
                c.execute(
                    "WITH op AS (
                        UPDATE operations SET status = $2, outcome = $3, finished_at = now()
                        WHERE id = $1 AND pod = $4 AND status = 'pending' RETURNING id)
                     INSERT INTO sandboxes (id, pod, tenant, state, generation, body)
                     SELECT n.id, $4::text, n.tenant, n.state, n.generation, n.body
                     FROM op, unnest($5::text[], $6::text[], $7::text[], $8::bigint[],
                        $9::jsonb[]) AS n(id, tenant, state, generation, body)
                     ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state,
                        generation = EXCLUDED.generation, body = EXCLUDED.body,
                        updated_at = now()
                     WHERE sandboxes.pod = $4 AND sandboxes.generation <= EXCLUDED.generation",
                    &[
                        &operation,
                        &status,
                        &json,
                        &pod.as_str(),
                        &columns.ids,
                        &columns.tenants,
                        &columns.states,
                        &columns.generations,
                        &columns.bodies,
                    ],
                )
                .await
            }
            // A template built or deleted: the pod's catalog changed with
            // the operation, in the same one statement (`catalog.rs`).
            OpOutcome::Done(Reply::Template { template } | Reply::TemplateDeleted { template }) => {
                let built = matches!(outcome, OpOutcome::Done(Reply::Template { .. }));
                finish_template(&c, operation, &json, pod, template, built).await
            }
            OpOutcome::Done(Reply::Checkpoint { checkpoint }) => {
                let taken = (&checkpoint.sandbox, checkpoint.name.as_str());
                super::checkpoints::finish(&c, operation, &json, pod, taken, true).await
            }
            OpOutcome::Done(Reply::CheckpointDeleted { sandbox, name }) => {
                let deleted = (sandbox, name.as_str());
                super::checkpoints::finish(&c, operation, &json, pod, deleted, false).await
            }
            OpOutcome::Failed(_) => {
                let sql = format!("{PENDING} SELECT count(*) FROM op");
                c.execute(
                    &sql,
                    &[&operation, &status, &json, &None::<String>, &pod.as_str()],
                )
                .await
            }
        }
        .map_err(pg)?;
        Ok(())
    }

    /// Journals a new operation; with an idempotency key already used by
    /// its tenant, the existing operation instead (and `false`). With
    /// `asked`, a create admitted against its tenant's quota first
    /// ([`Db::admit`]): [`ClusterError::Quota`] past it.
    pub async fn begin_operation(
        &self,
        op: &NewOp<'_>,
        asked: Option<&Usage>,
    ) -> Result<(OpRow, bool), ClusterError> {
        let inserted = match asked {
            Some(asked) => self.admit(op, asked).await?,
            None => insert_operation(&**self.client().await?, op, None).await?,
        };
        let (id, tenant, idempotency_key) = (op.id, op.tenant, op.idempotency_key);
        if let Some(row) = inserted {
            return Ok((row, true));
        }
        let row = {
            let key = idempotency_key.unwrap_or_default();
            let row = self
                .client()
                .await?
                .query_opt(
                    "SELECT id FROM operations WHERE tenant = $1 AND idempotency_key = $2",
                    &[&tenant, &key],
                )
                .await
                .map_err(pg)?;
            match row {
                Some(r) => self.operation(r.get::<_, &str>(0)).await?,
                None => None,
            }
        };
        let row = row.ok_or_else(|| ClusterError::Postgres(format!("operation {id} vanished")))?;
        Ok((row, false))
    }

    /// The `kind` operation on `sandbox` journaled with `key` (the
    /// sandbox's tenant's: a key names one operation per tenant, and this
    /// one names its sandbox too).
    pub async fn operation_by_key(
        &self,
        key: &str,
        kind: &str,
        sandbox: &SandboxId,
    ) -> Result<Option<OpRow>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT id FROM operations
                 WHERE idempotency_key = $1 AND kind = $2 AND sandbox = $3",
                &[&key, &kind, &sandbox.as_str()],
            )
            .await
            .map_err(pg)?;
        match row {
            Some(r) => self.operation(r.get::<_, &str>(0)).await,
            None => Ok(None),
        }
    }

    /// The tenant of sandbox `id` once deleted through the cluster (its
    /// finished delete's), so that its owner may still retry, by key, a
    /// command it sent before the delete; none for any other id.
    pub async fn deleted_tenant(&self, id: &SandboxId) -> Result<Option<String>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT tenant FROM operations
                 WHERE sandbox = $1 AND kind IN ('delete', 'forget') AND status = 'done' LIMIT 1",
                &[&id.as_str()],
            )
            .await
            .map_err(pg)?;
        Ok(row.map(|r| r.get(0)))
    }

    pub async fn operation(&self, id: &str) -> Result<Option<OpRow>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt_prepared(
                "SELECT id, kind, sandbox, pod, tenant, status, outcome,
                    (extract(epoch FROM start_by) * 1000)::bigint,
                    (extract(epoch FROM expires_at) * 1000)::bigint, template
                 FROM operations WHERE id = $1",
                &[&id],
            )
            .await?;
        row.map(|r| {
            let outcome: Option<Value> = r.get(6);
            Ok(OpRow {
                id: r.get(0),
                kind: r.get(1),
                sandbox: r.get(2),
                pod: r.get(3),
                tenant: r.get(4),
                status: r.get(5),
                outcome: outcome
                    .map(serde_json::from_value)
                    .transpose()
                    .map_err(|e| ClusterError::Schema(format!("operation {id}: {e}")))?,
                start_by_ms: r.get(7),
                expires_ms: r.get(8),
                template: r.get(9),
            })
        })
        .transpose()
    }

    fn pod_row(r: &tokio_postgres::Row) -> PodRow {
        Self::pod_row_at(r, 0)
    }

    /// The pod of row `r`'s [`Db::POD_COLUMNS`] from column `at` on.
    fn pod_row_at(r: &tokio_postgres::Row, at: usize) -> PodRow {
        PodRow {
            id: PodId::new(r.get::<_, String>(at)),
            address: r.get(at + 1),
            token: r.get(at + 2),
            fingerprint: r.get(at + 3),
            load: r.get(at + 4),
            templates: r.get(at + 5),
            headroom_mib: r.get(at + 6),
            running: r.get(at + 7),
            hibernated: r.get(at + 8),
            silent_s: r.get(at + 9),
            images: r.get(at + 10),
            layers: super::layers::layers_of(r.get(at + 11)),
        }
    }

    const POD_COLUMNS: &'static str = "id, address, token, fingerprint, load, templates,
        headroom_mib, running, hibernated,
        extract(epoch FROM now() - last_heartbeat)::double precision, images, layers";

    pub async fn pods(&self) -> Result<Vec<PodRow>, ClusterError> {
        let c = self.client().await?;
        let rows = c
            .query(
                &format!("SELECT {} FROM pods ORDER BY id", Self::POD_COLUMNS),
                &[],
            )
            .await
            .map_err(pg)?;
        Ok(rows.iter().map(Self::pod_row).collect())
    }

    pub async fn pod(&self, id: &str) -> Result<Option<PodRow>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                &format!("SELECT {} FROM pods WHERE id = $1", Self::POD_COLUMNS),
                &[&id],
            )
            .await
            .map_err(pg)?;
        Ok(row.as_ref().map(Self::pod_row))
    }

    /// Moves sandbox `s` from pod `from` (lost, or up without room for
    /// its wake) to pod `to`, which adopted it from the object store: its
    /// row is `to`'s from now on (only `to`'s results and heartbeats
    /// change it). False if the row is no longer `from`'s, or no longer at
    /// `generation` when one is given.
    pub async fn move_sandbox(
        &self,
        s: &Sandbox,
        from: &PodId,
        to: &PodId,
        generation: Option<u64>,
    ) -> Result<bool, ClusterError> {
        let c = self.client().await?;
        let body = serde_json::to_value(s).map_err(|e| ClusterError::Postgres(e.to_string()))?;
        let n = c
            .execute(
                "UPDATE sandboxes SET pod = $3, state = $4, generation = $5, body = $6,
                    updated_at = now()
                 WHERE id = $1 AND pod = $2 AND ($7::bigint IS NULL OR generation = $7)",
                &[
                    &s.id.as_str(),
                    &from.as_str(),
                    &to.as_str(),
                    &s.state.as_str(),
                    &(s.generation as i64),
                    &body,
                    &generation.map(|g| g as i64),
                ],
            )
            .await
            .map_err(pg)?;
        Ok(n == 1)
    }

    /// Sandbox `id` and its pod's row (none if the pod is unknown), in
    /// one statement.
    pub async fn sandbox_and_pod(
        &self,
        id: &SandboxId,
    ) -> Result<Option<(Sandbox, PodId, Option<PodRow>)>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt_prepared(
                &format!(
                    "SELECT s.body, s.pod, p.* FROM sandboxes s
                     LEFT JOIN LATERAL (SELECT {} FROM pods WHERE pods.id = s.pod) p ON true
                     WHERE s.id = $1 AND s.state <> '{DELETED}'",
                    Self::POD_COLUMNS
                ),
                &[&id.as_str()],
            )
            .await?;
        let Some(r) = row else { return Ok(None) };
        let (sandbox, pod) = Self::sandbox_of(r.get(0), r.get(1))?;
        let known = r.get::<_, Option<String>>(2).is_some();
        Ok(Some((sandbox, pod, known.then(|| Self::pod_row_at(&r, 2)))))
    }

    /// The tenant of sandbox `id` (none for an admin's), without its body.
    pub async fn sandbox_tenant(
        &self,
        id: &SandboxId,
    ) -> Result<Option<Option<String>>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt_prepared(
                &format!("SELECT tenant FROM sandboxes WHERE id = $1 AND state <> '{DELETED}'"),
                &[&id.as_str()],
            )
            .await?;
        Ok(row.map(|r| r.get(0)))
    }

    pub(super) fn sandbox_of(body: Value, pod: String) -> Result<(Sandbox, PodId), ClusterError> {
        let mut s: Sandbox = serde_json::from_value(body)
            .map_err(|e| ClusterError::Schema(format!("a stored sandbox: {e}")))?;
        let pod = PodId::new(pod);
        s.pod = Some(pod.clone());
        Ok((s, pod))
    }

    /// Sandboxes of `tenant` (all with none).
    pub async fn sandboxes(&self, tenant: Option<&str>) -> Result<Vec<Sandbox>, ClusterError> {
        let c = self.client().await?;
        let rows = c
            .query(
                &format!(
                    "SELECT body, pod FROM sandboxes
                     WHERE ($1::text IS NULL OR tenant = $1) AND state <> '{DELETED}'
                     ORDER BY body->>'created_at', id"
                ),
                &[&tenant],
            )
            .await
            .map_err(pg)?;
        rows.into_iter()
            .map(|r| Self::sandbox_of(r.get(0), r.get(1)).map(|(s, _)| s))
            .collect()
    }
}

/// Sandboxes as the columns of their rows, written in one statement: a
/// fork's new ones ([`Db::finish`]), a heartbeat's ([`Db::heartbeat`]).
#[derive(Default)]
struct SandboxRows {
    ids: Vec<String>,
    tenants: Vec<Option<String>>,
    states: Vec<String>,
    generations: Vec<i64>,
    bodies: Vec<Value>,
}

impl SandboxRows {
    fn push(&mut self, s: &Sandbox) -> Result<(), ClusterError> {
        let body = serde_json::to_value(s).map_err(|e| ClusterError::Postgres(e.to_string()))?;
        self.ids.push(s.id.as_str().to_string());
        self.tenants.push(s.tenant.clone());
        self.states.push(s.state.as_str().to_string());
        self.generations.push(s.generation as i64);
        self.bodies.push(body);
        Ok(())
    }
}

/// A template's build or delete finished on `pod` (`Db::finish`): the
/// operation done and the pod's catalog changed, in one statement, only
/// while the operation was pending (a result applied once).
async fn finish_template(
    c: &tokio_postgres::Client,
    operation: &str,
    outcome: &Value,
    pod: &PodId,
    template: &Template,
    built: bool,
) -> Result<u64, tokio_postgres::Error> {
    let entry = if built {
        serde_json::to_value(template).ok()
    } else {
        None
    };
    c.execute(
        "WITH op AS (
            UPDATE operations SET status = 'done', outcome = $2, finished_at = now()
            WHERE id = $1 AND pod = $3 AND status = 'pending' RETURNING id),
         change AS (SELECT jsonb_build_object($4::text, jsonb_build_object(
            'template', $5::jsonb, 'name', $6::text, 'at', extract(epoch FROM now()))) AS c)
         UPDATE pods SET catalog_changes = pods.catalog_changes || change.c,
            catalog = torpor_catalog(pods.catalog, change.c),
            templates = torpor_catalog_names(pods.templates, change.c)
         FROM change WHERE pods.id = $3 AND EXISTS (SELECT 1 FROM op)",
        &[
            &operation,
            outcome,
            &pod.as_str(),
            &template.id.as_str(),
            &entry,
            &template.name,
        ],
    )
    .await
}

/// The newest schema migration applied to the database `c` is connected to.
async fn applied_version(c: &Client) -> Result<i32, ClusterError> {
    let row = c
        .query_one(
            "SELECT coalesce(max(version), 0) FROM schema_migrations",
            &[],
        )
        .await
        .map_err(pg)?;
    Ok(row.get(0))
}
