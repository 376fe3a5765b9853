//! The tenants' secrets (E2B's `/secrets`, served by `torpor-e2b` through
//! the gate's `SecretStore`): one row each, its value the current
//! version's only (an update overwrites it), never read back by any
//! route. Names are unique per tenant; ids (`sec_...`) across the pod.
//! Every read and write names the tenant, so one tenant's row is never
//! another's answer. What is checked before a row is written (names,
//! sizes, counts) is the gate's (`gate/src/secrets.rs`); the `CHECK`s
//! repeat the invariants only.

use std::collections::BTreeMap;
use std::fmt;

use rusqlite::{params, OptionalExtension, Row};

use super::{Result, StoreError, Tx};
use crate::model::Timestamp;

/// What every secret id starts with.
pub const SECRET_ID_PREFIX: &str = "sec_";

/// A secret's value: write-only. Its `Debug` and `Display` print no byte
/// of it, so a value in a struct that is logged or put in an error stays
/// out; the one way to read it is [`SecretValue::expose`] (the stores).
#[derive(Clone, PartialEq, Eq)]
pub struct SecretValue(String);

impl SecretValue {
    pub fn new(value: String) -> Self {
        SecretValue(value)
    }

    /// The value itself: for the stores that keep it, nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretValue([redacted])")
    }
}

impl fmt::Display for SecretValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// A secret as every route shows it: never its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretInfo {
    /// `sec_` and 16 hex characters.
    pub id: String,
    pub tenant: String,
    /// Canonical (lower case).
    pub name: String,
    /// 1 when created, one more at each update.
    pub version: u64,
    pub metadata: BTreeMap<String, String>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

/// A secret to store: its first version.
#[derive(Debug, Clone)]
pub struct NewSecret {
    pub id: String,
    pub tenant: String,
    pub name: String,
    pub value: SecretValue,
    pub metadata: BTreeMap<String, String>,
    pub at: Timestamp,
}

/// An update: the new version's value and, when given, the metadata that
/// replaces the stored one.
#[derive(Debug, Clone)]
pub struct SecretUpdate {
    pub value: SecretValue,
    pub metadata: Option<BTreeMap<String, String>>,
    pub at: Timestamp,
}

/// The columns every read takes: never `value`.
const COLUMNS: &str = "id, tenant, name, version, metadata, created_at, updated_at";

fn corrupt(e: serde_json::Error) -> StoreError {
    StoreError::Corrupt(format!("a secret's stored metadata: {e}"))
}

fn metadata_text(m: &BTreeMap<String, String>) -> Result<String> {
    serde_json::to_string(m).map_err(|e| StoreError::Invalid {
        what: "secret metadata",
        detail: e.to_string(),
    })
}

fn from_row(r: &Row<'_>) -> rusqlite::Result<(SecretInfo, String)> {
    let version: i64 = r.get(3)?;
    Ok((
        SecretInfo {
            id: r.get(0)?,
            tenant: r.get(1)?,
            name: r.get(2)?,
            version: u64::try_from(version)
                .map_err(|_| rusqlite::Error::IntegralValueOutOfRange(3, version))?,
            metadata: BTreeMap::new(),
            created_at: r.get(5)?,
            updated_at: r.get(6)?,
        },
        r.get(4)?,
    ))
}

fn parse((mut s, metadata): (SecretInfo, String)) -> Result<SecretInfo> {
    s.metadata = serde_json::from_str(&metadata).map_err(corrupt)?;
    Ok(s)
}

/// The `WHERE` of one secret of a tenant by `key`: its id when the key
/// has the id's prefix, else its name.
fn key_column(key: &str) -> &'static str {
    if key.starts_with(SECRET_ID_PREFIX) {
        "id"
    } else {
        "name"
    }
}

impl Tx<'_> {
    /// How many secrets `tenant` has.
    pub fn secret_count(&self, tenant: &str) -> Result<u64> {
        let n: i64 = self
            .conn
            .prepare_cached("SELECT count(*) FROM secrets WHERE tenant = ?1")?
            .query_row([tenant], |r| r.get(0))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Stores a new secret at version 1: `AlreadyExists` (kind `secret`,
    /// the name) if its tenant has one of that name.
    pub fn insert_secret(&self, s: &NewSecret) -> Result<SecretInfo> {
        if self.find_secret(&s.tenant, &s.name)?.is_some() {
            return Err(StoreError::AlreadyExists {
                kind: "secret",
                id: s.name.clone(),
            });
        }
        self.conn
            .prepare_cached(
                "INSERT INTO secrets (id, tenant, name, version, value, metadata, created_at, \
                 updated_at) VALUES (?1, ?2, ?3, 1, ?4, ?5, ?6, ?6)",
            )?
            .execute(params![
                s.id,
                s.tenant,
                s.name,
                s.value.expose(),
                metadata_text(&s.metadata)?,
                s.at
            ])?;
        self.secret(&s.tenant, &s.id)
    }

    /// `tenant`'s secret by id or name, if it has it.
    pub fn find_secret(&self, tenant: &str, key: &str) -> Result<Option<SecretInfo>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM secrets WHERE tenant = ?1 AND {} = ?2",
            key_column(key)
        );
        self.conn
            .prepare_cached(&sql)?
            .query_row(params![tenant, key], from_row)
            .optional()?
            .map(parse)
            .transpose()
    }

    /// `tenant`'s secret by id or name; `NotFound` (kind `secret`) if it
    /// has none (another tenant's is none).
    pub fn secret(&self, tenant: &str, key: &str) -> Result<SecretInfo> {
        self.find_secret(tenant, key)?.ok_or_else(|| {
            StoreError::not_found("secret", key.chars().take(64).collect::<String>())
        })
    }

    /// Every secret of `tenant`, oldest first (then by id).
    pub fn list_secrets(&self, tenant: &str) -> Result<Vec<SecretInfo>> {
        let sql =
            format!("SELECT {COLUMNS} FROM secrets WHERE tenant = ?1 ORDER BY created_at, id");
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt
            .query_map([tenant], from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        rows.into_iter().map(parse).collect()
    }

    /// Stores `update` as the secret's next version (its value replaces
    /// the stored one; its metadata too, when given).
    pub fn update_secret(
        &self,
        tenant: &str,
        key: &str,
        update: &SecretUpdate,
    ) -> Result<SecretInfo> {
        let current = self.secret(tenant, key)?;
        let metadata = match &update.metadata {
            Some(m) => metadata_text(m)?,
            None => metadata_text(&current.metadata)?,
        };
        self.conn
            .prepare_cached(
                "UPDATE secrets SET version = version + 1, value = ?3, metadata = ?4, \
                 updated_at = max(updated_at, ?5) WHERE tenant = ?1 AND id = ?2",
            )?
            .execute(params![
                tenant,
                current.id,
                update.value.expose(),
                metadata,
                update.at
            ])?;
        self.secret(tenant, &current.id)
    }

    /// Removes `tenant`'s secret by id or name (its value with it).
    pub fn delete_secret(&self, tenant: &str, key: &str) -> Result<SecretInfo> {
        let current = self.secret(tenant, key)?;
        self.conn
            .prepare_cached("DELETE FROM secrets WHERE tenant = ?1 AND id = ?2")?
            .execute(params![tenant, current.id])?;
        Ok(current)
    }

    /// The value of `tenant`'s secret by id or name: for what resolves
    /// `${e2b.secrets.NAME}` (no route returns it).
    pub fn secret_value(&self, tenant: &str, key: &str) -> Result<SecretValue> {
        let sql = format!(
            "SELECT value FROM secrets WHERE tenant = ?1 AND {} = ?2",
            key_column(key)
        );
        self.conn
            .prepare_cached(&sql)?
            .query_row(params![tenant, key], |r| r.get::<_, String>(0))
            .optional()?
            .map(SecretValue::new)
            .ok_or_else(|| {
                StoreError::not_found("secret", key.chars().take(64).collect::<String>())
            })
    }
}
