//! Names: a manifest's id ([`ManifestId`]) and the unique names of
//! uploads and collection runs ([`unique_name`]). Below [`crate::error`],
//! which names manifests in its errors.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::chunk::ChunkHash;

/// A manifest id that is not one (it becomes an object key).
#[derive(Debug, thiserror::Error)]
#[error("bad manifest id {id:?}: {why}")]
pub struct BadManifestId {
    /// The id as given.
    pub id: String,
    /// The rule it breaks.
    pub why: &'static str,
}

/// A manifest's id: the key `manifests/<id>`. New ids are the upload's
/// start in milliseconds (13 decimal digits, so they sort by time) and 16
/// hex digits that make it unique: `1767225600000-3f9a0c…`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ManifestId(String);

impl ManifestId {
    /// A new, unique id.
    pub fn generate() -> Self {
        Self(unique_name())
    }

    /// `id` if it can be one: 1 to 100 of `[0-9a-z-]`.
    pub fn parse(id: &str) -> Result<Self, BadManifestId> {
        let bad = |why| BadManifestId {
            id: id.to_string(),
            why,
        };
        if id.is_empty() || id.len() > 100 {
            return Err(bad("1 to 100 characters"));
        }
        if !id
            .bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-')
        {
            return Err(bad("only 0-9, a-z and -"));
        }
        Ok(Self(id.to_string()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Its object key.
    pub(crate) fn key(&self) -> String {
        format!("manifests/{}", self.0)
    }
}

impl TryFrom<String> for ManifestId {
    type Error = BadManifestId;
    fn try_from(s: String) -> Result<Self, BadManifestId> {
        Self::parse(&s)
    }
}

impl From<ManifestId> for String {
    fn from(id: ManifestId) -> String {
        id.0
    }
}

impl fmt::Display for ManifestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ManifestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ManifestId({})", self.0)
    }
}

/// A name no other process makes: the time in milliseconds and 16 hex
/// digits of a hash over the time in nanoseconds, the process and a
/// counter.
pub(crate) fn unique_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let seed = format!(
        "{}:{}:{}",
        now.as_nanos(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let hash = ChunkHash::of(seed.as_bytes()).to_hex();
    format!("{:013}-{}", now.as_millis(), &hash[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_sorted_and_checked() {
        let a = ManifestId::generate();
        let b = ManifestId::generate();
        assert_ne!(a, b);
        assert_eq!(ManifestId::parse(a.as_str()).unwrap(), a);
        assert!(a.as_str().len() == 13 + 1 + 16, "{a}");
        assert!(ManifestId::parse("").is_err());
        assert!(ManifestId::parse("a/b").is_err());
        assert!(ManifestId::parse("A").is_err());
        assert_eq!(a.key(), format!("manifests/{a}"));
    }
}
