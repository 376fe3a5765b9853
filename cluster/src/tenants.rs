//! The tenants' tokens and quotas in PostgreSQL (schema version 3), shared
//! by every replica: the [`TokenStore`] [`torpor_gate::auth::Auth::shared`] caches and reads
//! again every [`torpor_gate::auth::SHARED_REFRESH`]. Kept as the embedded
//! `tenants.json` keeps them ([`torpor_gate::auth::tokens`]): a token is its
//! SHA-256, never the token; a tenant is the name its tokens and quota
//! carry.

use std::collections::BTreeMap;

use serde_json::Value;
use torpor_scheduler::model::Timestamp;

use super::db::{pg, Db};
use super::ClusterError;
use torpor_gate::auth::store::{StoreFuture, TokenStore};
use torpor_gate::auth::tokens::{TenantsFile, TokenRecord, TokensError, MAX_TOKENS};
use torpor_gate::auth::Scope;
use torpor_gate::quota::Quota;

const TOKEN_COLUMNS: &str = "id, tenant, scope, sha256, created_at_ms";

fn scope_of(s: &str) -> Result<Scope, ClusterError> {
    match s {
        "admin" => Ok(Scope::Admin),
        "tenant" => Ok(Scope::Tenant),
        other => Err(ClusterError::Schema(format!("a token's scope {other:?}"))),
    }
}

fn record(r: &tokio_postgres::Row) -> Result<TokenRecord, ClusterError> {
    Ok(TokenRecord {
        id: r.get(0),
        tenant: r.get(1),
        scope: scope_of(r.get(2))?,
        sha256: r.get(3),
        created_at: Timestamp(r.get(4)),
    })
}

/// `tenant`'s quota as stored.
pub(super) fn quota_of(tenant: &str, stored: Value) -> Result<Quota, ClusterError> {
    serde_json::from_value(stored)
        .map_err(|e| ClusterError::Schema(format!("tenant {tenant}'s quota: {e}")))
}

impl From<ClusterError> for TokensError {
    fn from(e: ClusterError) -> Self {
        TokensError::Store(e.into())
    }
}

impl TokenStore for Db {
    fn tenants(&self) -> StoreFuture<'_, TenantsFile> {
        Box::pin(async move { Ok(self.read_tenants().await?) })
    }

    fn add_token<'a>(&'a self, record: &'a TokenRecord, only_first: bool) -> StoreFuture<'a, bool> {
        Box::pin(self.insert_token(record, only_first))
    }

    fn remove_token<'a>(&'a self, id: &'a str) -> StoreFuture<'a, TokenRecord> {
        Box::pin(self.delete_token(id))
    }

    fn set_quota<'a>(
        &'a self,
        tenant: &'a str,
        quota: &'a Quota,
        replace: bool,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move { Ok(self.store_quota(tenant, quota, replace).await?) })
    }
}

impl Db {
    /// Every token (oldest first, at most [`MAX_TOKENS`]) and every quota.
    async fn read_tenants(&self) -> Result<TenantsFile, ClusterError> {
        let c = self.client().await?;
        let rows = c
            .query(
                &format!(
                    "SELECT {TOKEN_COLUMNS} FROM tenant_tokens ORDER BY created_at_ms, id LIMIT $1"
                ),
                &[&(MAX_TOKENS as i64)],
            )
            .await
            .map_err(pg)?;
        let tokens = rows.iter().map(record).collect::<Result<Vec<_>, _>>()?;
        let rows = c
            .query("SELECT tenant, quota FROM tenant_quotas", &[])
            .await
            .map_err(pg)?;
        let mut quotas = BTreeMap::new();
        for r in rows {
            let tenant: String = r.get(0);
            let quota = quota_of(&tenant, r.get(1))?;
            quotas.insert(tenant, quota);
        }
        Ok(TenantsFile { tokens, quotas })
    }

    /// Stores `record`: false if its id or its digest is there already
    /// (seeding the same token again changes nothing);
    /// [`TokensError::TooMany`] past [`MAX_TOKENS`]. With `only_first`,
    /// only into a table without any token (a first start's admin token).
    async fn insert_token(
        &self,
        record: &TokenRecord,
        only_first: bool,
    ) -> Result<bool, TokensError> {
        let c = self.client().await?;
        let added = c
            .execute(
                "INSERT INTO tenant_tokens (id, tenant, scope, sha256, created_at_ms)
                 SELECT $1::text, $2::text, $3::text, $4::text, $5::bigint
                 WHERE (SELECT count(*) FROM tenant_tokens) < $6::bigint
                    AND NOT ($7::boolean AND EXISTS (SELECT 1 FROM tenant_tokens))
                 ON CONFLICT DO NOTHING",
                &[
                    &record.id,
                    &record.tenant,
                    &record.scope.as_str(),
                    &record.sha256,
                    &record.created_at.millis(),
                    &(MAX_TOKENS as i64),
                    &only_first,
                ],
            )
            .await
            .map_err(pg)?;
        if added == 1 {
            return Ok(true);
        }
        let count: i64 = c
            .query_one("SELECT count(*) FROM tenant_tokens", &[])
            .await
            .map_err(pg)?
            .get(0);
        if count >= MAX_TOKENS as i64 {
            return Err(TokensError::TooMany);
        }
        Ok(false)
    }

    /// Removes token `id`, unless it is the last admin token. The admin
    /// tokens are locked (`FOR UPDATE`) before they are counted, so two
    /// replicas removing the last two admin tokens at once cannot both.
    async fn delete_token(&self, id: &str) -> Result<TokenRecord, TokensError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                &format!(
                    "WITH admins AS MATERIALIZED (
                        SELECT id FROM tenant_tokens WHERE scope = 'admin' FOR UPDATE)
                     DELETE FROM tenant_tokens
                     WHERE id = $1 AND (scope <> 'admin' OR (SELECT count(*) FROM admins) > 1)
                     RETURNING {TOKEN_COLUMNS}"
                ),
                &[&id],
            )
            .await
            .map_err(pg)?;
        if let Some(row) = row {
            return Ok(record(&row)?);
        }
        let there = c
            .query_opt("SELECT 1 FROM tenant_tokens WHERE id = $1", &[&id])
            .await
            .map_err(pg)?;
        Err(match there {
            Some(_) => TokensError::LastAdmin(id.to_string()),
            None => TokensError::NotFound(id.chars().take(40).collect()),
        })
    }

    /// Sets `tenant`'s quota; unless `replace`, only if it has none (a
    /// seed does not undo a quota set since).
    async fn store_quota(
        &self,
        tenant: &str,
        quota: &Quota,
        replace: bool,
    ) -> Result<(), ClusterError> {
        let c = self.client().await?;
        let json = serde_json::to_value(quota)
            .map_err(|e| ClusterError::Schema(format!("a quota: {e}")))?;
        c.execute(
            "INSERT INTO tenant_quotas (tenant, quota) VALUES ($1, $2)
             ON CONFLICT (tenant) DO UPDATE SET quota = $2, updated_at = now() WHERE $3::boolean",
            &[&tenant, &json, &replace],
        )
        .await
        .map_err(pg)?;
        Ok(())
    }
}
