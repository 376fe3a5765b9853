//! The tenants' secrets (E2B's `/secrets`, routes in `e2b/src/secrets.rs`):
//! what a secret may be ([`check_name`], [`check_metadata`],
//! [`check_value`] and the limits), and where secrets are kept, the one
//! typed interface [`SecretStore`]: the pod's SQLite store
//! (`torpor_scheduler::store::secrets`, through the pod's `Service`:
//! `backend/secrets.rs`) or
//! a cluster's PostgreSQL (`cluster/src/secrets.rs`), as the backend says
//! ([`crate::SandboxApi::secret_store`]).
//!
//! A secret is its tenant's: every call names the tenant (the caller's,
//! [`crate::auth::Principal::owner`]), so another tenant's secret is a
//! missing one (404), by id or by name. Values are write-only: the store
//! takes them ([`SecretValue`], whose `Debug` prints none of it) and no
//! call here gives one back; errors name the secret, never its value.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use torpor_scheduler::model::Timestamp;
pub use torpor_scheduler::store::secrets::SECRET_ID_PREFIX;
use torpor_scheduler::store::StoreError;
pub use torpor_scheduler::store::{NewSecret, SecretInfo, SecretUpdate, SecretValue};

/// Most secrets a tenant keeps.
pub const MAX_SECRETS_PER_TENANT: u64 = 1000;
/// Longest name (characters; E2B's limit).
pub const MAX_NAME_CHARS: usize = 128;
/// Largest value (bytes of UTF-8).
pub const MAX_VALUE_BYTES: usize = 64 * 1024;
/// Most metadata entries (E2B's limit).
pub const MAX_METADATA_ENTRIES: usize = 32;
/// Longest metadata key (bytes; E2B's limit).
pub const MAX_METADATA_KEY_BYTES: usize = 128;
/// Longest metadata value (bytes; E2B's limit).
pub const MAX_METADATA_VALUE_BYTES: usize = 1024;
/// Most metadata bytes, keys and values (E2B's limit).
pub const MAX_METADATA_BYTES: usize = 8192;

/// What a secrets call refuses or fails at. No variant carries a value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// No secret of the caller's by that id or name (404).
    #[error("secret {0} not found")]
    NotFound(String),
    /// The caller has a secret of that name already (409).
    #[error("a secret named {0:?} already exists")]
    NameTaken(String),
    /// A name, metadata, value or body the rules refuse (400).
    #[error("{0}")]
    Invalid(String),
    /// Past [`MAX_SECRETS_PER_TENANT`] (400).
    #[error("a tenant keeps at most {0} secrets; delete one first")]
    TooMany(u64),
    /// This backend keeps no secrets (501).
    #[error("this backend keeps no secrets")]
    Unsupported,
    /// The store failed (500; 503 for a cluster's PostgreSQL).
    #[error("the secrets store failed: {message}")]
    Store { message: String, unavailable: bool },
}

impl SecretError {
    pub fn store(message: impl Into<String>) -> Self {
        SecretError::Store {
            message: message.into(),
            unavailable: false,
        }
    }
}

/// What a [`SecretStore`] call returns.
pub type SecretFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, SecretError>> + Send + 'a>>;

/// Where the secrets are kept. `key` is a secret's id (`sec_...`) or its
/// canonical name; every call is within `tenant`.
pub trait SecretStore: Send + Sync {
    /// Stores `new` (version 1): [`SecretError::NameTaken`] if its tenant
    /// has that name, [`SecretError::TooMany`] if it has `max` secrets.
    fn create_secret(&self, new: NewSecret, max: u64) -> SecretFuture<'_, SecretInfo>;
    fn secret<'a>(&'a self, tenant: &'a str, key: &'a str) -> SecretFuture<'a, SecretInfo>;
    /// Every secret of `tenant`, oldest first (then by id).
    fn secrets<'a>(&'a self, tenant: &'a str) -> SecretFuture<'a, Vec<SecretInfo>>;
    /// Stores `update` as the next version.
    fn update_secret<'a>(
        &'a self,
        tenant: &'a str,
        key: &'a str,
        update: SecretUpdate,
    ) -> SecretFuture<'a, SecretInfo>;
    fn delete_secret<'a>(&'a self, tenant: &'a str, key: &'a str) -> SecretFuture<'a, ()>;
}

/// A name as stored: `[a-zA-Z0-9_-]`, 1 to [`MAX_NAME_CHARS`], lower
/// case; not starting with the ids' `sec_`. (The SDKs' placeholder
/// `${e2b.secrets.NAME}` needs no `{`, `}` or control character: none
/// passes.)
pub fn check_name(name: &str) -> Result<String, SecretError> {
    if name.is_empty() || name.chars().count() > MAX_NAME_CHARS {
        return Err(SecretError::Invalid(format!(
            "name: 1 to {MAX_NAME_CHARS} characters"
        )));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(SecretError::Invalid(
            "name: only letters, digits, '_' and '-' (it is the NAME of ${e2b.secrets.NAME})"
                .into(),
        ));
    }
    let name = name.to_ascii_lowercase();
    if name.starts_with(SECRET_ID_PREFIX) {
        return Err(SecretError::Invalid(format!(
            "name: the prefix {SECRET_ID_PREFIX:?} is reserved for secret ids"
        )));
    }
    Ok(name)
}

/// A path's `{id}` as a store key: an id as given, a name in its
/// canonical case.
pub fn key(id_or_name: &str) -> String {
    if id_or_name.starts_with(SECRET_ID_PREFIX) {
        id_or_name.to_string()
    } else {
        id_or_name.to_ascii_lowercase()
    }
}

/// A value within [`MAX_VALUE_BYTES`]. The error does not quote it.
pub fn check_value(value: &SecretValue) -> Result<(), SecretError> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(SecretError::Invalid(format!(
            "value: at most {MAX_VALUE_BYTES} bytes ({} given)",
            value.len()
        )));
    }
    Ok(())
}

/// Metadata within E2B's limits: [`MAX_METADATA_ENTRIES`] entries, keys
/// of 1 to [`MAX_METADATA_KEY_BYTES`], values up to
/// [`MAX_METADATA_VALUE_BYTES`], [`MAX_METADATA_BYTES`] in all.
pub fn check_metadata(m: &BTreeMap<String, String>) -> Result<(), SecretError> {
    let bad = |why: String| Err(SecretError::Invalid(format!("metadata: {why}")));
    if m.len() > MAX_METADATA_ENTRIES {
        return bad(format!("at most {MAX_METADATA_ENTRIES} entries"));
    }
    let mut total = 0;
    for (k, v) in m {
        if k.is_empty() || k.len() > MAX_METADATA_KEY_BYTES {
            return bad(format!("keys are 1 to {MAX_METADATA_KEY_BYTES} bytes"));
        }
        if v.len() > MAX_METADATA_VALUE_BYTES {
            return bad(format!(
                "the value of {k:?} is over {MAX_METADATA_VALUE_BYTES} bytes"
            ));
        }
        total += k.len() + v.len();
    }
    if total > MAX_METADATA_BYTES {
        return bad(format!("at most {MAX_METADATA_BYTES} bytes in all"));
    }
    Ok(())
}

/// A new secret's id: `sec_` and 16 hex characters.
pub fn new_id() -> String {
    format!(
        "{SECRET_ID_PREFIX}{}",
        torpor_scheduler::random::random_hex(8)
    )
}

/// A new secret of `tenant` made of checked parts, stamped now.
pub fn new_secret(
    tenant: &str,
    name: &str,
    value: SecretValue,
    metadata: BTreeMap<String, String>,
) -> Result<NewSecret, SecretError> {
    let name = check_name(name)?;
    check_value(&value)?;
    check_metadata(&metadata)?;
    Ok(NewSecret {
        id: new_id(),
        tenant: tenant.to_string(),
        name,
        value,
        metadata,
        at: Timestamp::now(),
    })
}

/// An update made of checked parts, stamped now.
pub fn secret_update(
    value: SecretValue,
    metadata: Option<BTreeMap<String, String>>,
) -> Result<SecretUpdate, SecretError> {
    check_value(&value)?;
    if let Some(m) = &metadata {
        check_metadata(m)?;
    }
    Ok(SecretUpdate {
        value,
        metadata,
        at: Timestamp::now(),
    })
}

impl From<StoreError> for SecretError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound { id, .. } => SecretError::NotFound(id),
            StoreError::AlreadyExists { id, .. } => SecretError::NameTaken(id),
            other => SecretError::store(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_e2bs_in_lower_case_and_never_an_id() {
        assert_eq!(check_name("OpenAI_Key-2").unwrap(), "openai_key-2");
        let longest = "a".repeat(MAX_NAME_CHARS);
        assert_eq!(check_name(&longest).unwrap(), longest);
        for bad in [
            "",
            "a{b",
            "b}",
            "new\nline",
            "nul\0",
            "sp ace",
            "dot.ted",
            "sec_abc",
            "SEC_abc",
            "é",
            &"a".repeat(MAX_NAME_CHARS + 1),
        ] {
            assert!(
                matches!(check_name(bad), Err(SecretError::Invalid(_))),
                "{bad:?}"
            );
        }
        assert_eq!(key("Api-Key"), "api-key");
        assert_eq!(key("sec_0123abcd"), "sec_0123abcd");
    }

    #[test]
    fn metadata_and_values_have_limits_and_errors_never_quote_a_value() {
        let m = |n: usize, k: usize, v: usize| -> BTreeMap<String, String> {
            (0..n)
                .map(|i| (format!("{i:0k$}"), "v".repeat(v)))
                .collect()
        };
        assert!(check_metadata(&m(32, 3, 10)).is_ok());
        assert!(check_metadata(&m(33, 3, 10)).is_err());
        assert!(check_metadata(&m(1, 129, 1)).is_err());
        assert!(check_metadata(&m(1, 3, 1025)).is_err());
        assert!(check_metadata(&m(9, 3, 1000)).is_err());
        assert!(check_metadata(&BTreeMap::from([(String::new(), "v".into())])).is_err());
        let big = "hunter2".repeat(MAX_VALUE_BYTES / 7 + 1);
        let e = check_value(&SecretValue::new(big)).unwrap_err().to_string();
        assert!(!e.contains("hunter2"), "{e}");
        assert!(check_value(&SecretValue::new("x".repeat(MAX_VALUE_BYTES))).is_ok());
        let made = new_secret("acme", "K", SecretValue::new("hunter2".into()), m(1, 1, 1));
        let text = format!("{made:?}");
        assert!(
            !text.contains("hunter2") && text.contains("\"k\""),
            "{text}"
        );
    }
}
