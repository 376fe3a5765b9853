//! Files a build copies into its sandbox (COPY steps): each uploaded once
//! per tenant as a gzip'd tar, named by the content hash its client gave
//! (E2B's `filesHash`, or `torpor template build`'s), kept until deleted
//! with the builds directory.
//!
//! E2B's SDKs upload to a URL the API hands out (`GET
//! /templates/{id}/files/{hash}`) without their API key: the URL carries
//! a one-time token ([`Files::grant`]) that names the tenant and the hash
//! and expires after [`GRANT_TTL`].

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use torpor_sync::Locked;

use crate::service::ServiceError;

/// How long an upload URL stays valid.
pub const GRANT_TTL: Duration = Duration::from_secs(3600);

/// Uploaded build files, per tenant.
#[derive(Debug)]
pub struct Files {
    dir: PathBuf,
    grants: Mutex<HashMap<String, Grant>>,
}

#[derive(Debug, Clone)]
struct Grant {
    tenant: Option<String>,
    hash: String,
    until: Instant,
}

/// An I/O error of the build files, as the service's.
pub(crate) fn io(e: std::io::Error) -> ServiceError {
    ServiceError::Internal(format!("build files: {e}"))
}

/// A content hash as a file name: 1 to 128 hex digits.
pub fn check_hash(hash: &str) -> Result<(), ServiceError> {
    if hash.is_empty() || hash.len() > 128 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ServiceError::Invalid(format!(
            "files hash {:?}: 1 to 128 hex digits",
            hash.chars().take(130).collect::<String>()
        )));
    }
    Ok(())
}

/// The directory name of `tenant`'s files: its name in hex, so that no
/// name is a path (`_shared` for an admin's).
pub(crate) fn owner_dir(tenant: Option<&str>) -> String {
    match tenant {
        Some(t) => t.bytes().map(|b| format!("{b:02x}")).collect(),
        None => "_shared".into(),
    }
}

impl Files {
    /// Files kept under `dir` (`None`: a directory of this process under
    /// the system's temporary directory).
    pub fn open(dir: Option<PathBuf>) -> Result<Self, ServiceError> {
        let dir = dir.unwrap_or_else(|| {
            std::env::temp_dir().join(format!("torpor-build-files-{}", std::process::id()))
        });
        std::fs::create_dir_all(&dir).map_err(io)?;
        Ok(Files {
            dir,
            grants: Mutex::new(HashMap::new()),
        })
    }

    /// Where `tenant`'s file `hash` is kept ([`owner_dir`]).
    pub fn path(&self, tenant: Option<&str>, hash: &str) -> Result<PathBuf, ServiceError> {
        check_hash(hash)?;
        Ok(self
            .dir
            .join(owner_dir(tenant))
            .join(format!("{}.tar.gz", hash.to_ascii_lowercase())))
    }

    /// Whether `tenant` has uploaded `hash`.
    pub fn present(&self, tenant: Option<&str>, hash: &str) -> Result<bool, ServiceError> {
        Ok(self.path(tenant, hash)?.is_file())
    }

    /// The file's bytes.
    pub fn read(&self, tenant: Option<&str>, hash: &str) -> Result<Vec<u8>, ServiceError> {
        let path = self.path(tenant, hash)?;
        std::fs::read(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ServiceError::Invalid(format!(
                "the files of hash {hash} were never uploaded (upload them before the build)"
            )),
            _ => io(e),
        })
    }

    /// Stores `body` as `tenant`'s file `hash` (at most `limit` bytes;
    /// more is refused and nothing is kept); its size.
    pub fn store(
        &self,
        tenant: Option<&str>,
        hash: &str,
        body: &mut dyn Read,
        limit: u64,
    ) -> Result<u64, ServiceError> {
        let path = self.path(tenant, hash)?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        let tmp = path.with_extension(format!("part-{}", torpor_scheduler::random::random_hex(6)));
        let written = (|| {
            let mut out = std::fs::File::create(&tmp).map_err(io)?;
            let size = std::io::copy(&mut body.take(limit + 1), &mut out).map_err(io)?;
            if size > limit {
                return Err(ServiceError::TooLarge(format!(
                    "build files of more than {limit} bytes"
                )));
            }
            out.flush().map_err(io)?;
            out.sync_all().map_err(io)?;
            std::fs::rename(&tmp, &path).map_err(io)?;
            Ok(size)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// A one-time token for uploading `hash` as `tenant`'s.
    pub fn grant(&self, tenant: Option<&str>, hash: &str) -> Result<String, ServiceError> {
        check_hash(hash)?;
        let token = torpor_scheduler::random::random_hex(24);
        let mut grants = self.grants.locked();
        let now = Instant::now();
        grants.retain(|_, g| g.until > now);
        grants.insert(
            token.clone(),
            Grant {
                tenant: tenant.map(str::to_string),
                hash: hash.to_string(),
                until: now + GRANT_TTL,
            },
        );
        Ok(token)
    }

    /// Takes the grant `token` for `hash`: the tenant it was given to.
    /// An unknown, used or expired token, or one for another hash, is
    /// refused alike.
    pub fn redeem(&self, token: &str, hash: &str) -> Result<Option<String>, ServiceError> {
        let mut grants = self.grants.locked();
        match grants.remove(token) {
            Some(g) if g.hash == hash && g.until > Instant::now() => Ok(g.tenant),
            _ => Err(ServiceError::Forbidden(
                "this upload URL is not valid (used, expired or for other files)".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uploads_are_per_tenant_and_grants_one_time() {
        let dir = std::env::temp_dir().join(format!("torpor-files-test-{}", std::process::id()));
        let files = Files::open(Some(dir.clone())).unwrap();
        let hash = "ab".repeat(32);
        assert!(!files.present(Some("t1"), &hash).unwrap());
        let size = files
            .store(Some("t1"), &hash, &mut &b"tar bytes"[..], 100)
            .unwrap();
        assert_eq!(size, 9);
        assert!(files.present(Some("t1"), &hash).unwrap());
        assert!(!files.present(Some("t2"), &hash).unwrap());
        assert_eq!(files.read(Some("t1"), &hash).unwrap(), b"tar bytes");
        assert!(matches!(
            files.store(Some("t1"), &hash, &mut &[0u8; 101][..], 100),
            Err(ServiceError::TooLarge(_))
        ));
        assert_eq!(files.read(Some("t1"), &hash).unwrap(), b"tar bytes");
        assert!(files.path(None, "../etc").is_err());
        let token = files.grant(Some("t1"), &hash).unwrap();
        assert!(files.redeem(&token, "cd").is_err());
        let token = files.grant(Some("t1"), &hash).unwrap();
        assert_eq!(files.redeem(&token, &hash).unwrap().as_deref(), Some("t1"));
        assert!(files.redeem(&token, &hash).is_err(), "one time");
        let _ = std::fs::remove_dir_all(dir);
    }
}
