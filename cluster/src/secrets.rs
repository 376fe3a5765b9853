//! The tenants' secrets in PostgreSQL (schema version 13), shared by every
//! replica: the [`SecretStore`] a replica's E2B routes use
//! ([`torpor_gate::secrets`]), kept as the pod's store keeps them
//! (`torpor_scheduler::store::secrets`): the current version's value,
//! never selected by a read. A create counts its tenant's secrets and
//! inserts in one transaction under a lock of the tenant's
//! (`pg_advisory_xact_lock`), so replicas creating at once stay within
//! the limit. PostgreSQL's own error text may quote a row (a failed
//! constraint's `DETAIL`), so errors here carry its SQLSTATE only.

use std::collections::BTreeMap;

use tokio_postgres::Row;
use torpor_gate::secrets::{
    NewSecret, SecretError, SecretFuture, SecretInfo, SecretStore, SecretUpdate, SECRET_ID_PREFIX,
};
use torpor_scheduler::model::Timestamp;

use super::db::Db;
use super::ClusterError;

/// The columns every read takes: never `value`.
const COLUMNS: &str = "id, tenant, name, version, metadata, created_at_ms, updated_at_ms";

/// A PostgreSQL failure as a secrets error: its SQLSTATE, no text (which
/// may quote the row). A connection's failure is 503, as the cluster's.
fn pg(e: tokio_postgres::Error) -> SecretError {
    match e.code() {
        Some(code) => SecretError::store(format!("PostgreSQL error {}", code.code())),
        None => SecretError::Store {
            message: "PostgreSQL is unreachable".into(),
            unavailable: true,
        },
    }
}

impl From<ClusterError> for SecretError {
    fn from(e: ClusterError) -> Self {
        SecretError::Store {
            message: e.to_string(),
            unavailable: matches!(e, ClusterError::Postgres(_)),
        }
    }
}

fn info(r: &Row) -> Result<SecretInfo, SecretError> {
    let version: i64 = r.get(3);
    let metadata: BTreeMap<String, String> = serde_json::from_value(r.get(4))
        .map_err(|e| SecretError::store(format!("a secret's stored metadata: {e}")))?;
    Ok(SecretInfo {
        id: r.get(0),
        tenant: r.get(1),
        name: r.get(2),
        version: u64::try_from(version).unwrap_or(0),
        metadata,
        created_at: Timestamp(r.get(5)),
        updated_at: Timestamp(r.get(6)),
    })
}

fn json(m: &BTreeMap<String, String>) -> serde_json::Value {
    serde_json::Value::Object(
        m.iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect(),
    )
}

/// The `WHERE` column of a key: an id by its prefix, else a name.
fn key_column(key: &str) -> &'static str {
    if key.starts_with(SECRET_ID_PREFIX) {
        "id"
    } else {
        "name"
    }
}

fn not_found(key: &str) -> SecretError {
    SecretError::NotFound(key.chars().take(64).collect())
}

impl Db {
    async fn create_secret_in(&self, s: NewSecret, max: u64) -> Result<SecretInfo, SecretError> {
        // A connection of its own: the transaction holds it.
        let mut c = self.connect().await?;
        let tx = c.transaction().await.map_err(pg)?;
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('torpor secrets ' || $1, 0))",
            &[&s.tenant],
        )
        .await
        .map_err(pg)?;
        let count: i64 = tx
            .query_one(
                "SELECT count(*) FROM secrets WHERE tenant = $1",
                &[&s.tenant],
            )
            .await
            .map_err(pg)?
            .get(0);
        if count >= i64::try_from(max).unwrap_or(i64::MAX) {
            return Err(SecretError::TooMany(max));
        }
        let row = tx
            .query_opt(
                &format!(
                    "INSERT INTO secrets (id, tenant, name, version, value, metadata, \
                     created_at_ms, updated_at_ms) VALUES ($1, $2, $3, 1, $4, $5, $6, $6) \
                     ON CONFLICT (tenant, name) DO NOTHING RETURNING {COLUMNS}"
                ),
                &[
                    &s.id,
                    &s.tenant,
                    &s.name,
                    &s.value.expose(),
                    &json(&s.metadata),
                    &s.at.millis(),
                ],
            )
            .await
            .map_err(pg)?;
        let Some(row) = row else {
            return Err(SecretError::NameTaken(s.name));
        };
        let made = info(&row)?;
        tx.commit().await.map_err(pg)?;
        Ok(made)
    }

    async fn secret_of(&self, tenant: &str, key: &str) -> Result<SecretInfo, SecretError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                &format!(
                    "SELECT {COLUMNS} FROM secrets WHERE tenant = $1 AND {} = $2",
                    key_column(key)
                ),
                &[&tenant, &key],
            )
            .await
            .map_err(pg)?;
        info(&row.ok_or_else(|| not_found(key))?)
    }

    async fn secrets_of(&self, tenant: &str) -> Result<Vec<SecretInfo>, SecretError> {
        let c = self.client().await?;
        let rows = c
            .query(
                &format!(
                    "SELECT {COLUMNS} FROM secrets WHERE tenant = $1 ORDER BY created_at_ms, id"
                ),
                &[&tenant],
            )
            .await
            .map_err(pg)?;
        rows.iter().map(info).collect()
    }

    async fn update_secret_in(
        &self,
        tenant: &str,
        key: &str,
        u: SecretUpdate,
    ) -> Result<SecretInfo, SecretError> {
        let c = self.client().await?;
        let metadata = u.metadata.as_ref().map(json);
        let row = c
            .query_opt(
                &format!(
                    "UPDATE secrets SET version = version + 1, value = $3, \
                     metadata = COALESCE($4, metadata), \
                     updated_at_ms = GREATEST(updated_at_ms, $5) \
                     WHERE tenant = $1 AND {} = $2 RETURNING {COLUMNS}",
                    key_column(key)
                ),
                &[&tenant, &key, &u.value.expose(), &metadata, &u.at.millis()],
            )
            .await
            .map_err(pg)?;
        info(&row.ok_or_else(|| not_found(key))?)
    }

    async fn delete_secret_in(&self, tenant: &str, key: &str) -> Result<(), SecretError> {
        let c = self.client().await?;
        let n = c
            .execute(
                &format!(
                    "DELETE FROM secrets WHERE tenant = $1 AND {} = $2",
                    key_column(key)
                ),
                &[&tenant, &key],
            )
            .await
            .map_err(pg)?;
        if n == 0 {
            return Err(not_found(key));
        }
        Ok(())
    }
}

impl SecretStore for Db {
    fn create_secret(&self, new: NewSecret, max: u64) -> SecretFuture<'_, SecretInfo> {
        Box::pin(self.create_secret_in(new, max))
    }

    fn secret<'a>(&'a self, tenant: &'a str, key: &'a str) -> SecretFuture<'a, SecretInfo> {
        Box::pin(self.secret_of(tenant, key))
    }

    fn secrets<'a>(&'a self, tenant: &'a str) -> SecretFuture<'a, Vec<SecretInfo>> {
        Box::pin(self.secrets_of(tenant))
    }

    fn update_secret<'a>(
        &'a self,
        tenant: &'a str,
        key: &'a str,
        update: SecretUpdate,
    ) -> SecretFuture<'a, SecretInfo> {
        Box::pin(self.update_secret_in(tenant, key, update))
    }

    fn delete_secret<'a>(&'a self, tenant: &'a str, key: &'a str) -> SecretFuture<'a, ()> {
        Box::pin(self.delete_secret_in(tenant, key))
    }
}
