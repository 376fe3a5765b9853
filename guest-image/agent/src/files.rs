//! File operations: `read_file`, `write_file`, `list_dir`, `stat`, and
//! (1.1) `mkdir`, `remove`, `rename`; entries carry (1.2) the whole
//! `st_mode`, a symlink's resolved target and user metadata; (1.4)
//! `statfs`, a filesystem's size and free space. Every
//! failure is an [`ErrorReply`] naming the path; nothing here panics on input.

use crate::proto::{
    DirListing, ErrorReply, FileData, FileKind, FileStat, FsStats, MkdirRequest, ReadFileRequest,
    RenameRequest, StatRequest, WriteFileRequest, Written, MAX_DIR_ENTRIES, MAX_IO_CHUNK,
};
use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Paths must be absolute: the agent's own working directory is no business
/// of the host's.
fn absolute(path: &str) -> Result<&Path, ErrorReply> {
    if path.is_empty() || !path.starts_with('/') {
        return Err(ErrorReply::new(
            libc::EINVAL,
            format!("path must be absolute: {path:?}"),
        ));
    }
    if path.contains('\0') {
        return Err(ErrorReply::new(libc::EINVAL, "path contains a NUL byte"));
    }
    Ok(Path::new(path))
}

/// FIFOs and sockets would block the connection (opening a FIFO waits for a
/// writer), so they are refused up front.
fn refuse_fifo(path: &Path, name: &str) -> Result<(), ErrorReply> {
    if let Ok(meta) = fs::metadata(path) {
        let ft = meta.file_type();
        if ft.is_fifo() || ft.is_socket() {
            return Err(ErrorReply::new(
                libc::EINVAL,
                format!("{name}: is a FIFO or socket"),
            ));
        }
    }
    Ok(())
}

/// `read_file`: up to `max_bytes` (capped at [`MAX_IO_CHUNK`]) from `offset`.
pub fn read_file(req: &ReadFileRequest) -> Result<FileData, ErrorReply> {
    let path = absolute(&req.path)?;
    let err = |e: std::io::Error| ErrorReply::io(&req.path, &e);
    refuse_fifo(path, &req.path)?;
    let mut file = File::open(path).map_err(err)?;
    let meta = file.metadata().map_err(err)?;
    if meta.is_dir() {
        return Err(ErrorReply::new(
            libc::EISDIR,
            format!("{}: is a directory", req.path),
        ));
    }
    let size = meta.len();
    let want = req
        .max_bytes
        .unwrap_or(MAX_IO_CHUNK as u64)
        .min(MAX_IO_CHUNK as u64) as usize;
    if req.offset > 0 {
        file.seek(SeekFrom::Start(req.offset)).map_err(err)?;
    }
    // Read until `want` or EOF; files in /proc report size 0, so do not
    // trust `size` for how much there is.
    let mut data = Vec::with_capacity(want.min(size.saturating_sub(req.offset) as usize));
    let mut limited = (&mut file).take(want as u64);
    limited.read_to_end(&mut data).map_err(err)?;
    // EOF when fewer bytes than asked came back, or when asking stopped
    // exactly at the (regular) file's end.
    let end = req.offset + data.len() as u64;
    let eof = data.len() < want || (meta.is_file() && size > 0 && end >= size);
    Ok(FileData {
        data,
        offset: req.offset,
        size,
        eof,
    })
}

/// `write_file`: create/truncate (or append), optionally creating parents
/// and setting the mode exactly.
pub fn write_file(req: &WriteFileRequest) -> Result<Written, ErrorReply> {
    let path = absolute(&req.path)?;
    let err = |e: std::io::Error| ErrorReply::io(&req.path, &e);
    if req.data.len() > MAX_IO_CHUNK {
        return Err(ErrorReply::new(
            libc::EFBIG,
            format!(
                "{} bytes in one write_file (limit {MAX_IO_CHUNK}); append in chunks",
                req.data.len()
            ),
        ));
    }
    if let Some(mode) = req.mode {
        if mode & !0o7777 != 0 {
            return Err(ErrorReply::new(
                libc::EINVAL,
                format!("mode {mode:#o} has bits outside 0o7777"),
            ));
        }
    }
    let owner = req
        .owner
        .as_deref()
        .map(crate::users::by_name)
        .transpose()?;
    // The parent directories this request creates, deepest first.
    let mut created: Vec<&Path> = Vec::new();
    if req.create_parents {
        if let Some(parent) = path.parent() {
            created = parent
                .ancestors()
                .take_while(|p| fs::symlink_metadata(p).is_err())
                .collect();
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(parent)
                .map_err(|e| ErrorReply::io(&parent.to_string_lossy(), &e))?;
        }
    }
    refuse_fifo(path, &req.path)?;
    let mut opts = OpenOptions::new();
    opts.write(true)
        .create(true)
        .mode(req.mode.unwrap_or(0o644));
    if req.append {
        opts.append(true);
    } else {
        opts.truncate(true);
    }
    let mut file = opts.open(path).map_err(err)?;
    if let Some(mode) = req.mode {
        // The open mode is filtered by the umask and ignored for existing
        // files; the caller asked for exactly this.
        file.set_permissions(fs::Permissions::from_mode(mode))
            .map_err(err)?;
    }
    if let Some(u) = &owner {
        for dir in created.iter().rev() {
            std::os::unix::fs::lchown(dir, Some(u.uid), Some(u.gid))
                .map_err(|e| ErrorReply::io(&dir.to_string_lossy(), &e))?;
        }
        // The open file itself: no path to race with.
        std::os::unix::fs::fchown(&file, Some(u.uid), Some(u.gid)).map_err(err)?;
    }
    file.write_all(&req.data).map_err(err)?;
    let size = file.metadata().map_err(err)?.len();
    Ok(Written {
        bytes: req.data.len() as u64,
        size,
    })
}

fn kind_of(meta: &Metadata) -> FileKind {
    let ft = meta.file_type();
    if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    }
}

fn to_stat(name: String, meta: &Metadata, full: &Path) -> FileStat {
    let kind = kind_of(meta);
    let (link_target, resolved) = if kind == FileKind::Symlink {
        (
            fs::read_link(full)
                .ok()
                .map(|t| t.to_string_lossy().into_owned()),
            fs::canonicalize(full)
                .ok()
                .map(|t| t.to_string_lossy().into_owned()),
        )
    } else {
        (None, None)
    };
    FileStat {
        name,
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        mtime_ns: meta
            .mtime()
            .saturating_mul(1_000_000_000)
            .saturating_add(meta.mtime_nsec()),
        link_target,
        uid: Some(meta.uid()),
        gid: Some(meta.gid()),
        owner: crate::users::user_name(meta.uid()),
        group: crate::users::group_name(meta.gid()),
        st_mode: Some(meta.mode()),
        resolved,
        metadata: crate::xattrs::read(full),
    }
}

fn name_of(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "/".to_string())
}

fn stat_of(path: &Path, shown: &str) -> Result<FileStat, ErrorReply> {
    let meta = fs::symlink_metadata(path).map_err(|e| ErrorReply::io(shown, &e))?;
    Ok(to_stat(name_of(path), &meta, path))
}

/// `mkdir` (0o755): `EEXIST` when the path exists, unless `parents` and it
/// is a directory; the directories it creates go to `owner` (an unknown
/// owner is `ENOENT` before anything is created).
pub fn mkdir(req: &MkdirRequest) -> Result<FileStat, ErrorReply> {
    let path = absolute(&req.path)?;
    let mut b = fs::DirBuilder::new();
    b.mode(0o755).recursive(req.parents);
    if req.parents && path.exists() && !path.is_dir() {
        return Err(ErrorReply::new(
            libc::EEXIST,
            format!("{}: exists and is not a directory", req.path),
        ));
    }
    let owner = req
        .owner
        .as_deref()
        .map(crate::users::by_name)
        .transpose()?;
    // The directories this request creates, deepest first.
    let created: Vec<&Path> = path
        .ancestors()
        .take_while(|p| fs::symlink_metadata(p).is_err())
        .collect();
    b.create(path).map_err(|e| ErrorReply::io(&req.path, &e))?;
    if let Some(u) = owner {
        for dir in created.iter().rev() {
            std::os::unix::fs::lchown(dir, Some(u.uid), Some(u.gid))
                .map_err(|e| ErrorReply::io(&dir.to_string_lossy(), &e))?;
        }
    }
    stat_of(path, &req.path)
}

/// `remove`: a file, a symlink (not its target) or a directory tree.
pub fn remove(path: &str) -> Result<(), ErrorReply> {
    let p = absolute(path)?;
    if p == Path::new("/") {
        return Err(ErrorReply::new(libc::EBUSY, "will not remove /"));
    }
    let meta = fs::symlink_metadata(p).map_err(|e| ErrorReply::io(path, &e))?;
    if meta.is_dir() {
        fs::remove_dir_all(p)
    } else {
        fs::remove_file(p)
    }
    .map_err(|e| ErrorReply::io(path, &e))
}

/// `rename`: `rename(2)`, so only within one filesystem (`EXDEV`).
pub fn rename(req: &RenameRequest) -> Result<FileStat, ErrorReply> {
    let from = absolute(&req.from)?;
    let to = absolute(&req.to)?;
    fs::rename(from, to).map_err(|e| ErrorReply::io(&format!("{} -> {}", req.from, req.to), &e))?;
    stat_of(to, &req.to)
}

/// `list_dir`: entries sorted by name, symlinks not followed. Entries that
/// vanish while listing are skipped.
pub fn list_dir(path: &str) -> Result<DirListing, ErrorReply> {
    let dir = absolute(path)?;
    let err = |e: std::io::Error| ErrorReply::io(path, &e);
    let mut entries = Vec::new();
    let mut truncated = false;
    for entry in fs::read_dir(dir).map_err(err)? {
        let entry = entry.map_err(err)?;
        if entries.len() == MAX_DIR_ENTRIES {
            truncated = true;
            break;
        }
        let full = entry.path();
        let Ok(meta) = fs::symlink_metadata(&full) else {
            continue;
        };
        let name = entry.file_name().to_string_lossy().into_owned();
        entries.push(to_stat(name, &meta, &full));
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(DirListing { entries, truncated })
}

/// `stat`: one path, following symlinks unless asked not to.
pub fn stat(req: &StatRequest) -> Result<FileStat, ErrorReply> {
    let path = absolute(&req.path)?;
    let meta = if req.follow_symlinks {
        fs::metadata(path)
    } else {
        fs::symlink_metadata(path)
    }
    .map_err(|e| ErrorReply::io(&req.path, &e))?;
    Ok(to_stat(name_of(path), &meta, path))
}

/// `statfs` (1.4): the size and free space of the filesystem `path` is
/// on (`statvfs(3)`, counts times `f_frsize`, saturating).
pub fn statfs(path: &str) -> Result<FsStats, ErrorReply> {
    absolute(path)?;
    let c = std::ffi::CString::new(path)
        .map_err(|_| ErrorReply::new(libc::EINVAL, "path contains a NUL byte"))?;
    // SAFETY: `struct statvfs` is plain integers: all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` a writable statvfs that
    // outlives the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(ErrorReply::io(path, &std::io::Error::last_os_error()));
    }
    // Old filesystems leave f_frsize 0: then the block size is the unit.
    let unit = if st.f_frsize > 0 {
        st.f_frsize as u64
    } else {
        st.f_bsize as u64
    };
    let bytes = |blocks: u64| blocks.saturating_mul(unit);
    Ok(FsStats {
        block_size: unit,
        total_bytes: bytes(st.f_blocks as u64),
        free_bytes: bytes(st.f_bfree as u64),
        available_bytes: bytes(st.f_bavail as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_are_refused() {
        let e = list_dir("tmp").unwrap_err();
        assert_eq!(e.code, "EINVAL");
        let e = stat(&StatRequest {
            path: String::new(),
            follow_symlinks: true,
        })
        .unwrap_err();
        assert_eq!(e.code, "EINVAL");
        assert_eq!(statfs("tmp").unwrap_err().code, "EINVAL");
        assert_eq!(statfs("/a\0b").unwrap_err().code, "EINVAL");
        assert_eq!(statfs("/no/such/dir").unwrap_err().code, "ENOENT");
    }

    #[test]
    fn proc_files_read_despite_zero_size() {
        let d = read_file(&ReadFileRequest {
            path: "/proc/self/status".into(),
            offset: 0,
            max_bytes: None,
        })
        .unwrap();
        assert!(d.eof);
        assert!(String::from_utf8_lossy(&d.data).contains("Pid:"));
    }
}
