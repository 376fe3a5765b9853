//! The tokens file: which token is which tenant's, with which scope, and
//! each tenant's quotas. `DATA_DIR/tenants.json`, mode 0600, replaced
//! atomically on every change. Tokens are kept as their SHA-256 only: a
//! token is shown once, when it is made.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use torpor_scheduler::model::{random_hex, Timestamp};

use super::Scope;
use crate::quota::Quota;

/// The file in the data directory.
pub const TENANTS_FILE: &str = "tenants.json";

/// At most this many tokens (each request's check reads them all).
pub const MAX_TOKENS: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("tokens file {path}: {detail}")]
    File { path: String, detail: String },
    #[error(
        "tenant names are 1 to 64 characters of a-z, A-Z, 0-9, `.`, `_` and `-`, not starting \
         with `.`"
    )]
    BadTenant,
    #[error("token {0} not found")]
    NotFound(String),
    #[error("{0} is the last admin token; make another admin token first")]
    LastAdmin(String),
    #[error("there are {MAX_TOKENS} tokens already, the most kept; remove some first")]
    TooMany,
    /// A fresh random token met a stored one's id or digest.
    #[error("a new token's id or digest is taken")]
    Taken,
    /// The [`super::store::TokenStore`] failed (the cluster's PostgreSQL
    /// down: `unavailable`).
    #[error("the tenants' store: {0}")]
    Store(#[source] torpor_scheduler::service::ServiceError),
}

/// One token as stored: never the token itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    /// `tok_` and 16 hex characters: how the token is named to list and
    /// remove it.
    pub id: String,
    pub tenant: String,
    pub scope: Scope,
    /// SHA-256 of the token, hex.
    pub sha256: String,
    pub created_at: Timestamp,
}

/// The file's content.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantsFile {
    #[serde(default)]
    pub tokens: Vec<TokenRecord>,
    /// Quotas by tenant; a tenant not here has [`Quota::default`].
    #[serde(default)]
    pub quotas: BTreeMap<String, Quota>,
}

/// SHA-256 of `token`.
pub fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl TokenRecord {
    /// A new record of `token` for `tenant` with `scope`, under a new id.
    pub fn new(tenant: &str, scope: Scope, token: &str) -> Result<Self, TokensError> {
        check_tenant(tenant)?;
        Ok(TokenRecord {
            id: format!("tok_{}", random_hex(8)),
            tenant: tenant.to_string(),
            scope,
            sha256: hex(&digest(token.as_bytes())),
            created_at: Timestamp::now(),
        })
    }

    /// The stored digest as bytes (a record with a malformed one matches
    /// no token).
    pub fn digest(&self) -> Option<[u8; 32]> {
        unhex(&self.sha256)
    }
}

/// A new random token: 32 bytes from the kernel, hex, prefixed `tpr_`.
pub fn random_token() -> Result<String, TokensError> {
    let mut raw = [0u8; 32];
    torpor_scheduler::model::random_bytes(&mut raw).map_err(|e| TokensError::File {
        path: "getrandom".into(),
        detail: format!("cannot get random bytes for a token: {e}"),
    })?;
    Ok(format!("tpr_{}", hex(&raw)))
}

/// Tenant names: like image names (plain, no path characters).
pub fn check_tenant(name: &str) -> Result<(), TokensError> {
    if torpor_scheduler::images::is_plain_name(name) {
        Ok(())
    } else {
        Err(TokensError::BadTenant)
    }
}

impl TenantsFile {
    /// Reads `path`; a missing file is an empty one.
    pub fn load(path: &Path) -> Result<Self, TokensError> {
        let err = |detail: String| TokensError::File {
            path: path.display().to_string(),
            detail,
        };
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| err(e.to_string())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// Writes it to `path` atomically, mode 0600.
    pub fn save(&self, path: &Path) -> Result<(), TokensError> {
        let err = |detail: String| TokensError::File {
            path: path.display().to_string(),
            detail,
        };
        let text = serde_json::to_vec_pretty(self).map_err(|e| err(e.to_string()))?;
        let tmp = tmp_path(path);
        {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .create_new(true)
                .write(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| err(e.to_string()))?;
            f.write_all(&text).map_err(|e| err(e.to_string()))?;
            f.sync_all().map_err(|e| err(e.to_string()))?;
        }
        std::fs::rename(&tmp, path).map_err(|e| err(e.to_string()))?;
        if let Some(dir) = path.parent() {
            let _ = torpor_scheduler::files::fsync_dir(dir);
        }
        Ok(())
    }

    /// Adds a token for `tenant` with `scope`; the record and the token.
    pub fn add(
        &mut self,
        tenant: &str,
        scope: Scope,
    ) -> Result<(TokenRecord, String), TokensError> {
        if self.tokens.len() >= MAX_TOKENS {
            return Err(TokensError::TooMany);
        }
        let token = random_token()?;
        let record = TokenRecord::new(tenant, scope, &token)?;
        self.tokens.push(record.clone());
        Ok((record, token))
    }

    /// Adds an existing `token` (a data directory's token from before the
    /// tokens file) for `tenant` with `scope`.
    pub fn import(
        &mut self,
        tenant: &str,
        scope: Scope,
        token: &str,
    ) -> Result<TokenRecord, TokensError> {
        let record = TokenRecord::new(tenant, scope, token)?;
        self.tokens.push(record.clone());
        Ok(record)
    }

    /// Removes token `id`; the last admin token stays (`keep_admin`).
    pub fn remove(&mut self, id: &str, keep_admin: bool) -> Result<TokenRecord, TokensError> {
        let at = self
            .tokens
            .iter()
            .position(|t| t.id == id)
            .ok_or_else(|| TokensError::NotFound(id.chars().take(40).collect()))?;
        let admins = self
            .tokens
            .iter()
            .filter(|t| t.scope == Scope::Admin)
            .count();
        if keep_admin && self.tokens[at].scope == Scope::Admin && admins == 1 {
            return Err(TokensError::LastAdmin(id.to_string()));
        }
        Ok(self.tokens.remove(at))
    }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_stored_hashed_and_round_trip() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let path = dir.join(TENANTS_FILE);
        let mut file = TenantsFile::load(&path).unwrap();
        let (admin, admin_token) = file.add("ops", Scope::Admin).unwrap();
        let (rec, token) = file.add("acme", Scope::Tenant).unwrap();
        file.save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            !text.contains(&token) && !text.contains(&admin_token),
            "{text}"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let mut back = TenantsFile::load(&path).unwrap();
        assert_eq!(back.tokens, vec![admin.clone(), rec.clone()]);
        assert_eq!(back.tokens[1].digest(), Some(digest(token.as_bytes())));
        assert!(matches!(
            back.remove(&admin.id, true),
            Err(TokensError::LastAdmin(_))
        ));
        back.remove(&rec.id, true).unwrap();
        assert!(back.remove(&rec.id, true).is_err());
        assert!(file.add("../etc", Scope::Tenant).is_err());
    }
}
