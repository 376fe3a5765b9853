//! `uffd-shared`'s shmem copies of template memory files: one per template
//! in `/dev/shm`, shared by every clone. Named after the template file's
//! device, inode, size and mtime, so a rewritten template gets a new copy.
//!
//! A jailed VMM must not make one: another VMM's guests would run from
//! memory it wrote. The pod ([`ensure`], as root, before it starts a VMM)
//! makes it root-owned and read-only for the others; jailed VMMs see
//! `/dev/shm` read-only and only open it.

use std::fs::File;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Where the copies live.
pub const SHM_DIR: &str = "/dev/shm";

/// The copy's path for a base memory file with metadata `meta`.
pub fn copy_path(meta: &std::fs::Metadata) -> PathBuf {
    let name = format!(
        "torpor-template-{:x}-{:x}-{:x}-{:x}.mem",
        meta.dev(),
        meta.ino(),
        meta.size(),
        meta.mtime_nsec() as u64 ^ (meta.mtime() as u64) << 30
    );
    Path::new(SHM_DIR).join(name)
}

/// The copy of `base`, made if missing.
pub fn open_or_make(base: &File) -> std::io::Result<(File, PathBuf)> {
    let meta = base.metadata()?;
    let path = copy_path(&meta);
    if let Ok(f) = File::open(&path) {
        if f.metadata().map(|m| m.len()).ok() == Some(meta.len()) {
            return Ok((f, path));
        }
    }
    // Unique among concurrent makers, jailed (pid 1 each) or not.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = path.with_extension(format!("tmp{}-{nanos}", std::process::id()));
    let mut out = File::create(&tmp)?;
    let made = crate::sparse::copy_sparse(base, &mut out, meta.len())
        .and_then(|()| out.set_permissions(std::fs::Permissions::from_mode(0o644)))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = made {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok((File::open(&path)?, path))
}

/// The pod's side: makes sure the copy of the memory file at `base_path`
/// exists (root-owned, 0644) before a jailed VMM restores from it.
pub fn ensure(base_path: &Path) -> std::io::Result<PathBuf> {
    let base = File::open(base_path)?;
    open_or_make(&base).map(|(_, path)| path)
}
