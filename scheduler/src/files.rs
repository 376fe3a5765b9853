//! Crash-safe snapshot files.
//!
//! Nothing is written in place: a file or directory is built under a temp
//! name (starting with [`TEMP_PREFIX`]) in the directory it will live in,
//! fsynced, renamed to its final name, and the directory fsynced, so after a
//! crash a path is either absent or complete. What a crash leaves behind
//! (temp names, snapshot directories the store never recorded or no longer
//! references) is removed at start-up by [`cleanup_orphans`].

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::random::random_hex;

/// Every temp file or directory name starts with this.
pub const TEMP_PREFIX: &str = ".torpor-tmp.";

/// A filesystem call that failed, with the path it failed on.
#[derive(Debug, thiserror::Error)]
#[error("{op} {}: {source}", path.display())]
pub struct FilesError {
    pub op: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

type Result<T, E = FilesError> = std::result::Result<T, E>;

fn ctx<T>(op: &'static str, path: &Path, r: io::Result<T>) -> Result<T> {
    r.map_err(|source| FilesError {
        op,
        path: path.to_path_buf(),
        source,
    })
}

/// fsyncs a directory, making renames and creations in it durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// A fresh temp path next to `final_path` (same directory, so the rename is
/// atomic): `.torpor-tmp.<name>.<random>`.
pub fn temp_path_for(final_path: &Path) -> PathBuf {
    let name = final_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    parent_of(final_path).join(format!("{TEMP_PREFIX}{name}.{}", random_hex(8)))
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory,
/// fsync, rename over `path`, fsync the directory. On failure the temp file
/// is removed and `path` is untouched.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path_for(path);
    let written = (|| {
        let mut file = ctx(
            "creating",
            &tmp,
            fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp),
        )?;
        ctx("writing", &tmp, file.write_all(bytes))?;
        ctx("fsync", &tmp, file.sync_all())?;
        ctx("renaming", &tmp, fs::rename(&tmp, path))
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    let dir = parent_of(path);
    ctx("fsync", dir, fsync_dir(dir))
}

/// Creates a temp directory next to `final_path` for a snapshot to be
/// written into, then published with [`commit_dir`].
pub fn create_temp_dir_for(final_path: &Path) -> Result<PathBuf> {
    let tmp = temp_path_for(final_path);
    ctx("creating", &tmp, fs::create_dir(&tmp))?;
    Ok(tmp)
}

/// Publishes a directory built under a temp name: fsyncs every regular file
/// directly in it and the directory itself, renames it to `final_path`
/// (which must not exist, or be an empty directory) and fsyncs the parent.
pub fn commit_dir(tmp: &Path, final_path: &Path) -> Result<()> {
    for entry in ctx("listing", tmp, fs::read_dir(tmp))? {
        let entry = ctx("listing", tmp, entry)?;
        let path = entry.path();
        if ctx("stat", &path, entry.file_type())?.is_file() {
            ctx("fsync", &path, File::open(&path).and_then(|f| f.sync_all()))?;
        }
    }
    ctx("fsync", tmp, fsync_dir(tmp))?;
    ctx("renaming", tmp, fs::rename(tmp, final_path))?;
    let parent = parent_of(final_path);
    ctx("fsync", parent, fsync_dir(parent))
}

/// What [`cleanup_orphans`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// Temp files and directories (interrupted writes).
    pub temp: Vec<PathBuf>,
    /// Directories no live path is in or under.
    pub orphans: Vec<PathBuf>,
}

impl CleanupReport {
    /// Everything removed.
    pub fn removed(&self) -> impl Iterator<Item = &PathBuf> {
        self.temp.iter().chain(&self.orphans)
    }
}

/// Lexical normal form for comparing paths: no `.` components, no trailing
/// slash, no doubled slashes.
fn normal(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| !matches!(c, std::path::Component::CurDir))
        .collect()
}

/// Removes, under `dir`, what a crash or a forgotten sandbox left behind:
/// every temp file or directory (name starting with [`TEMP_PREFIX`]), and
/// every directory that is not in `live` and holds nothing in `live`.
/// Directories that hold live paths are searched the same way; other files
/// are left alone (the store's own files live in the data directory).
/// Symlinks are never followed.
///
/// `live` is every snapshot directory the store references (and the layers
/// their diff chains point to), written the same way as `dir` (absolute
/// paths, as the store keeps them). Run it at start-up, before any operation
/// can be writing snapshots. A missing `dir` is an empty one.
pub fn cleanup_orphans(dir: &Path, live: &HashSet<PathBuf>) -> Result<CleanupReport> {
    let live: HashSet<PathBuf> = live.iter().map(|p| normal(p)).collect();
    let mut report = CleanupReport::default();
    let dir = normal(dir);
    if live.contains(&dir) {
        return Ok(report);
    }
    match fs::symlink_metadata(&dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(report),
        other => {
            ctx("stat", &dir, other)?;
        }
    }
    sweep(&dir, &live, &mut report)?;
    for path in report.removed() {
        tracing::info!(path = %path.display(), "removed orphaned snapshot file");
    }
    Ok(report)
}

fn remove(path: &Path, is_dir: bool) -> Result<()> {
    if is_dir {
        ctx("removing", path, fs::remove_dir_all(path))
    } else {
        ctx("removing", path, fs::remove_file(path))
    }
}

fn sweep(dir: &Path, live: &HashSet<PathBuf>, report: &mut CleanupReport) -> Result<()> {
    let mut entries = Vec::new();
    for entry in ctx("listing", dir, fs::read_dir(dir))? {
        let entry = ctx("listing", dir, entry)?;
        let is_dir = ctx("stat", &entry.path(), entry.file_type())?.is_dir();
        entries.push((entry.path(), entry.file_name(), is_dir));
    }
    entries.sort();
    for (path, name, is_dir) in entries {
        if name.to_string_lossy().starts_with(TEMP_PREFIX) {
            remove(&path, is_dir)?;
            report.temp.push(path);
        } else if !is_dir || live.contains(&path) {
            continue;
        } else if live.iter().any(|l| l.starts_with(&path)) {
            sweep(&path, live, report)?;
        } else {
            remove(&path, true)?;
            report.orphans.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_whole_and_leaves_no_temp() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let path = dir.join("state");
        atomic_write(&path, b"one").unwrap();
        atomic_write(&path, b"two, longer").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two, longer");
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state")]);
        // A directory that does not exist: error, nothing created.
        let err = atomic_write(&dir.join("missing/state"), b"x").unwrap_err();
        assert_eq!(err.op, "creating");
    }

    #[test]
    fn commit_dir_publishes_a_temp_dir() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let final_path = dir.join("snap");
        let tmp = create_temp_dir_for(&final_path).unwrap();
        assert!(tmp
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(TEMP_PREFIX));
        fs::write(tmp.join("memory"), b"m").unwrap();
        fs::write(tmp.join("state"), b"s").unwrap();
        commit_dir(&tmp, &final_path).unwrap();
        assert!(!tmp.exists());
        assert_eq!(fs::read(final_path.join("state")).unwrap(), b"s");
    }

    #[test]
    fn cleanup_keeps_live_paths_and_their_ancestors() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let mk = |p: &str| {
            let p = dir.join(p);
            fs::create_dir_all(&p).unwrap();
            fs::write(p.join("state"), b"s").unwrap();
            p
        };
        let template = mk("templates/tpl_a");
        let _orphan_template = mk("templates/tpl_gone");
        let layer = mk("sandboxes/sbx_a/gen2");
        let _old_layer = mk("sandboxes/sbx_a/gen1");
        let _orphan_sandbox = mk("sandboxes/sbx_b/gen1");
        let half_written = mk("sandboxes/sbx_a/.torpor-tmp.gen3.0011223344556677");
        fs::write(dir.join(".torpor-tmp.torpor.json.00"), b"partial").unwrap();
        fs::write(dir.join("torpor.db"), b"not ours to judge").unwrap();
        let live: HashSet<PathBuf> = [template.clone(), layer.join(".")].into_iter().collect();

        let report = cleanup_orphans(&dir, &live).unwrap();
        assert_eq!(
            report.temp,
            vec![dir.join(".torpor-tmp.torpor.json.00"), half_written]
        );
        assert_eq!(
            report.orphans,
            vec![
                dir.join("sandboxes/sbx_a/gen1"),
                dir.join("sandboxes/sbx_b"),
                dir.join("templates/tpl_gone"),
            ]
        );
        assert!(template.join("state").exists());
        assert!(layer.join("state").exists());
        assert!(dir.join("torpor.db").exists());
        // Nothing left to do the second time; a missing dir is empty.
        assert_eq!(
            cleanup_orphans(&dir, &live).unwrap(),
            CleanupReport::default()
        );
        assert_eq!(
            cleanup_orphans(&dir.join("absent"), &live).unwrap(),
            CleanupReport::default()
        );
    }

    #[cfg(unix)]
    #[test]
    fn cleanup_never_follows_symlinks() {
        let (scratch, scratch_out) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (dir, outside) = (
            scratch.path().to_path_buf(),
            scratch_out.path().to_path_buf(),
        );
        fs::write(outside.join("keep"), b"k").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
        let report = cleanup_orphans(&dir, &HashSet::new()).unwrap();
        assert_eq!(report, CleanupReport::default());
        assert!(outside.join("keep").exists());
    }
}
