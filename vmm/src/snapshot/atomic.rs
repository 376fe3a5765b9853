//! Atomic file replacement: write a temporary file next to the target, fsync
//! it, rename it over the target, fsync the directory. Readers see either the
//! old file or the complete new one, never a partial write, even across a
//! crash or power loss.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::SnapshotError;

/// Snapshot files hold guest memory and state: owner-only.
const FILE_MODE: u32 = 0o600;

/// A temporary file that becomes `target` on [`AtomicFile::commit`] and is
/// removed if dropped before that (an error path).
pub(crate) struct AtomicFile {
    target: PathBuf,
    temp: PathBuf,
    file: File,
    committed: bool,
}

impl AtomicFile {
    /// Creates `.<name>.tmp-<pid>-<n>` in the directory of `target`.
    pub(crate) fn create(target: &Path) -> Result<Self, SnapshotError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = target.file_name().ok_or_else(|| {
            SnapshotError::io(
                target,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file path"),
            )
        })?;
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let temp = target.with_file_name(format!(
            ".{}.tmp-{}-{n}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(&temp)
            .map_err(|e| SnapshotError::io(target, e))?;
        Ok(AtomicFile {
            target: target.to_path_buf(),
            temp,
            file,
            committed: false,
        })
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Path used in error messages: the final name, which is what the user
    /// asked for.
    pub(crate) fn target(&self) -> &Path {
        &self.target
    }

    /// fsync, rename over the target, fsync the directory. Returns the file,
    /// still open (for its metadata).
    pub(crate) fn commit(mut self) -> Result<File, SnapshotError> {
        let io = |e| SnapshotError::io(&self.target, e);
        self.file.sync_all().map_err(io)?;
        std::fs::rename(&self.temp, &self.target).map_err(io)?;
        self.committed = true;
        sync_dir(&self.target)?;
        // `self` has a Drop impl, so the file cannot be moved out of it.
        self.file.try_clone().map_err(io)
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// fsync the directory holding `path`, so that a rename into it is durable.
fn sync_dir(path: &Path) -> Result<(), SnapshotError> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| SnapshotError::io(dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::TestDir;
    use std::os::unix::fs::{FileExt, PermissionsExt};

    #[test]
    fn commit_replaces_target_and_leaves_no_temp() {
        let dir = TestDir::new("atomic-commit");
        let target = dir.path("f");
        std::fs::write(&target, b"old contents").unwrap();
        let f = AtomicFile::create(&target).unwrap();
        f.file().write_all_at(b"new", 0).unwrap();
        // Until commit, the old file is intact.
        assert_eq!(std::fs::read(&target).unwrap(), b"old contents");
        f.commit().unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(dir.entries(), vec!["f".to_string()]);
        let mode = std::fs::metadata(&target).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, FILE_MODE);
    }

    #[test]
    fn drop_without_commit_removes_temp_and_keeps_target() {
        let dir = TestDir::new("atomic-drop");
        let target = dir.path("f");
        std::fs::write(&target, b"old").unwrap();
        {
            let f = AtomicFile::create(&target).unwrap();
            f.file().write_all_at(b"half-writ", 0).unwrap();
            assert_eq!(dir.entries().len(), 2);
        }
        assert_eq!(dir.entries(), vec!["f".to_string()]);
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
    }

    #[test]
    fn missing_directory_is_an_io_error_naming_the_path() {
        let dir = TestDir::new("atomic-missing");
        let target = dir.path("no/such/dir/state");
        let err = AtomicFile::create(&target).err().unwrap();
        assert!(matches!(err, SnapshotError::Io { .. }));
        assert!(err.to_string().contains("no/such/dir/state"), "{err}");
    }
}
