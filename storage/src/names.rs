//! Named layers: a small object per name, `names/<space>/<name>`, that
//! says which manifest holds the layer the name stands for now (an image
//! any pod may fetch by its name). Writing a name replaces what it named;
//! the manifest it named before is its writer's to delete
//! ([`Storage::name_layer`] returns it). A named manifest is deleted by
//! whoever removes the name; a collection never deletes a manifest, so a
//! named layer's chunks stay as long as its manifest does.

use serde::{Deserialize, Serialize};

use crate::error::StorageError;
use crate::id::ManifestId;
use crate::store::Storage;

/// The kinds of things named in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameSpace {
    /// Guest images (a kernel and a root filesystem), by image name.
    Images,
}

impl NameSpace {
    fn prefix(self) -> &'static str {
        match self {
            NameSpace::Images => "names/images",
        }
    }
}

/// Longest name.
pub const MAX_NAME: usize = 100;

/// Whether `name` can be one: 1 to [`MAX_NAME`] of `[A-Za-z0-9._-]`, not
/// starting with `.` (it becomes an object key).
pub fn is_storable_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// What a name's object holds.
#[derive(Debug, Serialize, Deserialize)]
struct Named {
    manifest: ManifestId,
}

impl Storage {
    fn name_key(space: NameSpace, name: &str) -> Result<String, StorageError> {
        if !is_storable_name(name) {
            return Err(StorageError::BadName {
                name: name.chars().take(MAX_NAME + 1).collect(),
            });
        }
        Ok(format!("{}/{name}", space.prefix()))
    }

    /// Points `name` at manifest `id`; the manifest it named before, if
    /// another (its writer deletes it once nothing else uses it).
    pub async fn name_layer(
        &self,
        space: NameSpace,
        name: &str,
        id: &ManifestId,
    ) -> Result<Option<ManifestId>, StorageError> {
        let key = Self::name_key(space, name)?;
        let before = self.named_layer(space, name).await?;
        let body = serde_json::to_vec(&Named {
            manifest: id.clone(),
        })
        .expect("a name's object is JSON");
        self.put(&key, body).await?;
        Ok(before.filter(|b| b != id))
    }

    /// The manifest `name` stands for, `None` if the name is not there.
    pub async fn named_layer(
        &self,
        space: NameSpace,
        name: &str,
    ) -> Result<Option<ManifestId>, StorageError> {
        let key = Self::name_key(space, name)?;
        let Some(bytes) = self.get(&key).await? else {
            return Ok(None);
        };
        let named: Named =
            serde_json::from_slice(&bytes).map_err(|e| StorageError::NameInvalid {
                key: key.clone(),
                why: e.to_string(),
            })?;
        Ok(Some(named.manifest))
    }

    /// Removes `name`; the manifest it stood for (for the caller to
    /// delete), `None` if it was not there.
    pub async fn remove_name(
        &self,
        space: NameSpace,
        name: &str,
    ) -> Result<Option<ManifestId>, StorageError> {
        let key = Self::name_key(space, name)?;
        let before = self.named_layer(space, name).await?;
        if before.is_some() {
            self.delete(&key).await?;
        }
        Ok(before)
    }

    /// Every name of `space`, sorted.
    pub async fn names(&self, space: NameSpace) -> Result<Vec<String>, StorageError> {
        let prefix = space.prefix();
        let mut names: Vec<String> = self
            .list(prefix)
            .await?
            .iter()
            .filter_map(|m| m.key.strip_prefix(prefix)?.strip_prefix('/'))
            .filter(|n| is_storable_name(n))
            .map(str::to_string)
            .collect();
        names.sort();
        Ok(names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain() {
        for ok in ["debian", "a", "deb-12.1_x", &"x".repeat(MAX_NAME)] {
            assert!(is_storable_name(ok), "{ok}");
        }
        for bad in ["", ".hidden", "a/b", "..", "a b", &"x".repeat(MAX_NAME + 1)] {
            assert!(!is_storable_name(bad), "{bad}");
        }
    }
}
