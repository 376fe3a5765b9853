//! E2B's volumes: a tenant's named directories, each with a token that
//! opens its content to the volume content API (`torpor-e2b`'s
//! `/volumes` and `/volumecontent/{id}/...` routes).
//!
//! Kept in the data directory of the server that serves them
//! (`DATA_DIR/volumes`, mode 0700): `ID/volume.json` (mode 0600: the
//! record, token included, since E2B's `GET /volumes/{id}` answers it) and
//! `ID/content/` (the files, [`fs`]). A volume is its tenant's only:
//! another tenant's reads as absent. Names are unique per tenant; a tenant
//! has at most [`Limits::per_tenant`] volumes of at most
//! [`Limits::bytes`] each. Below the tenancy state, which holds it.

pub mod fs;

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::service::VolumeMountRequest;
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;
use torpor_scheduler::model::{MountedVolume, Timestamp};
use torpor_sync::Locked;

/// Default [`Limits::per_tenant`].
pub const DEFAULT_PER_TENANT: usize = 100;
/// Default [`Limits::bytes`]: 10 GiB.
pub const DEFAULT_BYTES: u64 = torpor_scheduler::volumes::usage::DEFAULT_LIMIT;
/// Longest volume name.
pub const MAX_NAME: usize = 128;
/// A volume's record in its directory.
const RECORD: &str = "volume.json";
/// A volume's files in its directory.
use torpor_scheduler::service::mounts::CONTENT;

/// How many volumes a tenant has and how big each is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub per_tenant: usize,
    pub bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            per_tenant: DEFAULT_PER_TENANT,
            bytes: DEFAULT_BYTES,
        }
    }
}

/// Why a volume call failed.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// A name not of `[a-zA-Z0-9_-]`, 1 to [`MAX_NAME`] long (400).
    #[error("volume names are 1 to {MAX_NAME} characters of a-z, A-Z, 0-9, `_` and `-`")]
    BadName,
    /// The tenant has a volume of that name (409).
    #[error("a volume named {0:?} already exists")]
    Exists(String),
    /// The tenant has as many volumes as it may (400).
    #[error("a tenant has at most {0} volumes: destroy one first")]
    TooMany(usize),
    /// No such volume of the tenant's (404).
    #[error("volume {0} not found")]
    NotFound(String),
    /// The token does not open that volume (401).
    #[error("invalid volume token")]
    BadToken,
    /// The server keeps no volumes (no data directory) (503).
    #[error("this server has no data directory to keep volumes in")]
    NoDirectory,
    #[error("volumes directory: {0}")]
    Io(#[from] io::Error),
}

/// What is recorded of a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub tenant: String,
    pub name: String,
    /// Opens the content API (`Authorization: Bearer`); compared in
    /// constant time.
    pub token: String,
    pub created_at: Timestamp,
}

/// A volume: its record and content.
#[derive(Debug)]
pub struct Volume {
    pub record: Record,
    pub content: fs::Content,
}

/// Every volume of the server.
#[derive(Debug)]
pub struct Volumes {
    /// `None`: no data directory (a server in tests): no volume is made.
    dir: Option<PathBuf>,
    limits: Limits,
    all: Mutex<HashMap<String, Arc<Volume>>>,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn make_private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Why a create naming volumes is refused where sandboxes cannot mount
/// them ([`crate::backend::SandboxApi::mounts_volumes`]).
pub const NO_MOUNTS: &str =
    "volumeMounts is not offered by this server yet: a volume cannot be mounted into a \
     sandbox here; read and write a volume's files through the volume content API instead \
     (see docs/e2b.md)";

impl Volumes {
    /// The volumes in `dir` (made, mode 0700, if missing); a volume
    /// whose record does not read is left out (logged), its directory
    /// kept.
    pub fn open(dir: PathBuf, limits: Limits) -> io::Result<Volumes> {
        make_private_dir(&dir)?;
        let mut all = HashMap::new();
        for e in std::fs::read_dir(&dir)? {
            let e = e?;
            let path = e.path();
            if !path.symlink_metadata()?.is_dir() {
                continue;
            }
            let record = std::fs::read(path.join(RECORD))
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Record>(&b).map_err(|e| e.to_string()));
            match record {
                Ok(record) if record.id == e.file_name().to_string_lossy() => {
                    let content = fs::Content::open(path.join(CONTENT), limits.bytes)?;
                    all.insert(record.id.clone(), Arc::new(Volume { record, content }));
                }
                Ok(_) => {
                    tracing::warn!(dir = %path.display(), "a volume record names another id: left out")
                }
                Err(error) => {
                    tracing::warn!(dir = %path.display(), %error, "a volume record does not read: left out")
                }
            }
        }
        Ok(Volumes {
            dir: Some(dir),
            limits,
            all: Mutex::new(all),
        })
    }

    /// No volumes and none made ([`VolumeError::NoDirectory`]).
    pub fn none() -> Volumes {
        Volumes {
            dir: None,
            limits: Limits::default(),
            all: Mutex::new(HashMap::new()),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// A new volume `name` of `tenant`'s, with a new token.
    pub fn create(&self, tenant: &str, name: &str) -> Result<Arc<Volume>, VolumeError> {
        if !valid_name(name) {
            return Err(VolumeError::BadName);
        }
        let root = self.dir.as_ref().ok_or(VolumeError::NoDirectory)?;
        let mut all = self.all.locked();
        let mine = all.values().filter(|v| v.record.tenant == tenant);
        let mut count = 0;
        for v in mine {
            if v.record.name == name {
                return Err(VolumeError::Exists(name.to_string()));
            }
            count += 1;
        }
        if count >= self.limits.per_tenant {
            return Err(VolumeError::TooMany(self.limits.per_tenant));
        }
        let id = format!("vol_{}", torpor_scheduler::random::random_hex(12));
        let record = Record {
            id: id.clone(),
            tenant: tenant.to_string(),
            name: name.to_string(),
            token: format!("vtok_{}", torpor_scheduler::random::random_hex(32)),
            created_at: Timestamp::now(),
        };
        let dir = root.join(&id);
        make_private_dir(&dir)?;
        let made = (|| {
            let content = fs::Content::open(dir.join(CONTENT), self.limits.bytes)?;
            write_record(&dir, &record)?;
            Ok::<_, io::Error>(content)
        })();
        let content = match made {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e.into());
            }
        };
        let volume = Arc::new(Volume { record, content });
        all.insert(id, Arc::clone(&volume));
        Ok(volume)
    }

    /// `tenant`'s volumes, oldest first.
    pub fn list(&self, tenant: &str) -> Vec<Arc<Volume>> {
        let mut v: Vec<_> = self
            .all
            .locked()
            .values()
            .filter(|v| v.record.tenant == tenant)
            .cloned()
            .collect();
        v.sort_by(|a, b| {
            (a.record.created_at, &a.record.id).cmp(&(b.record.created_at, &b.record.id))
        });
        v
    }

    /// `tenant`'s volume `id`; another tenant's is [`VolumeError::NotFound`].
    pub fn get(&self, tenant: &str, id: &str) -> Result<Arc<Volume>, VolumeError> {
        self.all
            .locked()
            .get(id)
            .filter(|v| v.record.tenant == tenant)
            .cloned()
            .ok_or_else(|| VolumeError::NotFound(id.to_string()))
    }

    /// `tenant`'s volume named `name`.
    pub fn by_name(&self, tenant: &str, name: &str) -> Option<Arc<Volume>> {
        self.all
            .locked()
            .values()
            .find(|v| v.record.tenant == tenant && v.record.name == name)
            .cloned()
    }

    /// The volumes a create names (E2B's `volumeMounts`), resolved to
    /// `tenant`'s: a name the tenant has no volume of is
    /// [`VolumeError::NotFound`]. The only place a sandbox's
    /// [`MountedVolume`] ids come from.
    pub fn resolve_mounts(
        &self,
        tenant: &str,
        mounts: &[VolumeMountRequest],
    ) -> Result<Vec<MountedVolume>, VolumeError> {
        mounts
            .iter()
            .map(|m| {
                let v = self
                    .by_name(tenant, &m.name)
                    .ok_or_else(|| VolumeError::NotFound(format!("{:?}", m.name)))?;
                Ok(MountedVolume {
                    id: v.record.id.clone(),
                    name: m.name.clone(),
                    path: m.path.clone(),
                })
            })
            .collect()
    }

    /// Destroys `tenant`'s volume `id`: its record and every file.
    pub fn delete(&self, tenant: &str, id: &str) -> Result<(), VolumeError> {
        let volume = {
            let mut all = self.all.locked();
            match all.get(id) {
                Some(v) if v.record.tenant == tenant => all.remove(id),
                _ => None,
            }
        }
        .ok_or_else(|| VolumeError::NotFound(id.to_string()))?;
        let Some(root) = &self.dir else {
            return Ok(());
        };
        let dir = root.join(&volume.record.id);
        // The record first: a crash midway leaves no volume that reads.
        let _ = std::fs::remove_file(dir.join(RECORD));
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }

    /// Destroys every volume of `tenant`'s; how many.
    pub fn delete_tenant(&self, tenant: &str) -> Result<usize, VolumeError> {
        let ids: Vec<String> = self
            .list(tenant)
            .iter()
            .map(|v| v.record.id.clone())
            .collect();
        for id in &ids {
            self.delete(tenant, id)?;
        }
        Ok(ids.len())
    }

    /// Volume `id` if `token` is its token (compared in constant time);
    /// an unknown volume and a wrong token are the same answer.
    pub fn authorize(&self, id: &str, token: &str) -> Result<Arc<Volume>, VolumeError> {
        let volume = self.all.locked().get(id).cloned();
        match volume {
            Some(v) if bool::from(v.record.token.as_bytes().ct_eq(token.as_bytes())) => Ok(v),
            _ => Err(VolumeError::BadToken),
        }
    }
}

/// Writes `record` to `dir/volume.json` (mode 0600), whole or not at all.
fn write_record(dir: &Path, record: &Record) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = dir.join(format!("{}{RECORD}", fs::TEMP_PREFIX));
    let bytes = serde_json::to_vec_pretty(record).map_err(io::Error::other)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(RECORD))?;
    torpor_scheduler::files::fsync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volumes(limits: Limits) -> (tempfile::TempDir, Volumes) {
        let t = tempfile::tempdir().unwrap();
        let v = Volumes::open(t.path().join("volumes"), limits).unwrap();
        (t, v)
    }

    #[test]
    fn mounts_resolve_to_the_tenants_own_volumes_only() {
        let (_t, v) = volumes(Limits::default());
        let mine = v.create("acme", "data").unwrap();
        let theirs = v.create("other", "secret").unwrap();
        let m = |name: &str, path: &str| VolumeMountRequest {
            name: name.into(),
            path: path.into(),
            id: None,
        };
        let got = v.resolve_mounts("acme", &[m("data", "/mnt/d")]).unwrap();
        assert_eq!(
            got,
            [MountedVolume {
                id: mine.record.id.clone(),
                name: "data".into(),
                path: "/mnt/d".into()
            }]
        );
        // Another tenant's volume is not there for this one, by its name
        // or by its id.
        for name in ["secret", theirs.record.id.as_str()] {
            let e = v.resolve_mounts("acme", &[m("data", "/a"), m(name, "/b")]);
            assert!(matches!(e, Err(VolumeError::NotFound(_))), "{e:?}");
        }
        assert!(v.resolve_mounts("acme", &[]).unwrap().is_empty());
        // What the scheduler then checks: the resolved list covers the
        // request, or the create is refused.
        let mut req = crate::service::CreateSandbox {
            volume_mounts: vec![m("data", "/mnt/d")],
            ..Default::default()
        };
        assert!(req.resolved_volumes().is_err(), "unresolved mounts pass");
        req.volumes = got;
        assert_eq!(req.resolved_volumes().unwrap().len(), 1);
        req.volumes[0].path = "/elsewhere".into();
        assert!(req.resolved_volumes().is_err(), "a changed path passes");
    }

    #[test]
    fn tenants_see_only_their_own_names_are_unique_and_counted() {
        let (t, v) = volumes(Limits {
            per_tenant: 2,
            bytes: 1 << 20,
        });
        let a = v.create("acme", "data").unwrap();
        assert!(matches!(
            v.create("acme", "data"),
            Err(VolumeError::Exists(_))
        ));
        // Another tenant may use the name; it sees nothing of acme's.
        let b = v.create("bravo", "data").unwrap();
        assert!(matches!(
            v.get("bravo", &a.record.id),
            Err(VolumeError::NotFound(_))
        ));
        assert!(matches!(
            v.delete("bravo", &a.record.id),
            Err(VolumeError::NotFound(_))
        ));
        assert_eq!(v.list("bravo").len(), 1);
        v.create("acme", "two").unwrap();
        assert!(matches!(
            v.create("acme", "three"),
            Err(VolumeError::TooMany(2))
        ));
        assert!(matches!(
            v.create("acme", "no/slash"),
            Err(VolumeError::BadName)
        ));
        assert!(matches!(v.create("acme", ""), Err(VolumeError::BadName)));
        // Tokens: only the volume's own opens it.
        assert!(v.authorize(&a.record.id, &a.record.token).is_ok());
        assert!(matches!(
            v.authorize(&a.record.id, &b.record.token),
            Err(VolumeError::BadToken)
        ));
        assert!(matches!(
            v.authorize("vol_nope", &a.record.token),
            Err(VolumeError::BadToken)
        ));
        // The records read back after a restart, private to the server.
        let dir = t.path().join("volumes");
        drop(v);
        let v = Volumes::open(dir.clone(), Limits::default()).unwrap();
        assert_eq!(v.list("acme").len(), 2);
        use std::os::unix::fs::PermissionsExt;
        let rec = dir.join(&a.record.id).join(RECORD);
        assert_eq!(
            std::fs::metadata(&rec).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
            0o700
        );
        // Destroying removes the directory; a tenant's all go.
        std::fs::write(dir.join(&a.record.id).join(CONTENT).join("f"), b"x").unwrap();
        v.delete("acme", &a.record.id).unwrap();
        assert!(!dir.join(&a.record.id).exists());
        assert_eq!(v.delete_tenant("acme").unwrap(), 1);
        assert!(v.list("acme").is_empty());
        assert_eq!(v.list("bravo").len(), 1);
    }
}
