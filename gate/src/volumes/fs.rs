//! A volume's content: a directory on the host (`DATA_DIR/volumes/ID/content`)
//! every path of the volume content API is resolved beneath.
//!
//! A volume path ([`VolumePath`]) is split into plain names: `..` is
//! refused (never clamped), `.` and empty components dropped, a leading
//! `/` is the volume's root (so `/etc/passwd` is the volume's own
//! `etc/passwd`). The directory holding the last name is opened with
//! [`torpor_scheduler::images::open_beneath`] (`openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS)` from the volume's root), and the last name is
//! reached relative to that descriptor without following a link
//! (`O_NOFOLLOW`, `AT_SYMLINK_NOFOLLOW`, changes through an open
//! descriptor): a symbolic link anywhere on the way is refused, whatever
//! put it there, and no path leaves the root.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, RenameFlags, Stat, Uid};
use torpor_scheduler::model::Timestamp;
use torpor_scheduler::volumes::usage::Usage;

/// Most entries one directory listing returns.
pub const MAX_LIST_ENTRIES: usize = 10_000;
/// Deepest listing (`depth`).
pub const MAX_LIST_DEPTH: u32 = 32;
/// Longest volume path, in bytes.
pub const MAX_PATH: usize = 4096;
/// A file being written is built under a name starting with this, in its
/// directory, and renamed over its name once complete.
pub const TEMP_PREFIX: &str = ".torpor-tmp.";
/// Default mode of a new file and a new directory (as E2B's).
pub const FILE_MODE: u32 = 0o644;
pub const DIR_MODE: u32 = 0o755;

/// Why a volume content call failed; each is one status of E2B's
/// volume content API ([`FsError::status`]).
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// A path or value that is refused (400).
    #[error("{0}")]
    Invalid(String),
    /// Nothing there, or not the kind of entry asked for (404).
    #[error("path {0} not found")]
    NotFound(String),
    /// Something there already (409).
    #[error("{0}")]
    Conflict(String),
    /// Past the volume's size (413).
    #[error("the volume is limited to {limit} bytes: this write would take it past that")]
    TooLarge { limit: u64 },
    /// Past the volume's entries (413): files, directories and links.
    #[error("the volume is limited to {limit} files, directories and links: this would take it past that")]
    TooManyEntries { limit: u64 },
    /// A system call failed (500).
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
}

impl FsError {
    /// The HTTP status E2B's volume content API answers it with.
    pub fn status(&self) -> u16 {
        match self {
            FsError::Invalid(_) => 400,
            FsError::NotFound(_) => 404,
            FsError::Conflict(_) => 409,
            FsError::TooLarge { .. } | FsError::TooManyEntries { .. } => 413,
            FsError::Io { .. } => 500,
        }
    }
}

/// A volume path, checked: the names from the root, and as shown (`/a/b`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePath {
    names: Vec<OsString>,
}

impl VolumePath {
    /// Parses `text`: 400 for an empty path, NUL, `..` or a name of ours
    /// ([`TEMP_PREFIX`]).
    pub fn parse(text: &str) -> Result<VolumePath, FsError> {
        if text.is_empty() {
            return Err(FsError::Invalid("path is required".into()));
        }
        if text.len() > MAX_PATH {
            return Err(FsError::Invalid(format!(
                "path is longer than {MAX_PATH} bytes"
            )));
        }
        if text.contains('\0') {
            return Err(FsError::Invalid("path contains NUL".into()));
        }
        let mut names = Vec::new();
        for part in text.split('/') {
            match part {
                "" | "." => {}
                ".." => {
                    return Err(FsError::Invalid(format!(
                        "path {text:?} is refused: `..` is not allowed in a volume path"
                    )))
                }
                name if name.starts_with(TEMP_PREFIX) => {
                    return Err(FsError::Invalid(format!(
                        "path {text:?} is refused: names starting with {TEMP_PREFIX} are reserved"
                    )))
                }
                name => names.push(OsString::from(name)),
            }
        }
        Ok(VolumePath { names })
    }

    /// Whether it is the volume's root.
    pub fn is_root(&self) -> bool {
        self.names.is_empty()
    }

    /// As the API shows it: `/` and the names joined by `/`.
    pub fn shown(&self) -> String {
        let mut s = String::from("/");
        let parts: Vec<_> = self.names.iter().map(|n| n.to_string_lossy()).collect();
        s.push_str(&parts.join("/"));
        s
    }

    fn parent_rel(&self) -> PathBuf {
        let mut p = PathBuf::new();
        for n in &self.names[..self.names.len().saturating_sub(1)] {
            p.push(n);
        }
        p
    }

    fn last(&self) -> Option<&OsStr> {
        self.names.last().map(OsString::as_os_str)
    }

    fn child(&self, name: &OsStr) -> VolumePath {
        let mut names = self.names.clone();
        names.push(name.to_os_string());
        VolumePath { names }
    }
}

/// What an entry is (E2B's `type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryType {
    File,
    Directory,
    Symlink,
    Unknown,
}

impl EntryType {
    pub fn as_str(self) -> &'static str {
        match self {
            EntryType::File => "file",
            EntryType::Directory => "directory",
            EntryType::Symlink => "symlink",
            EntryType::Unknown => "unknown",
        }
    }
}

/// An entry's metadata (E2B's `VolumeEntryStat`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryStat {
    pub name: String,
    pub kind: EntryType,
    pub path: String,
    pub size: u64,
    /// Permission bits only (`0o644`), as E2B's.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    /// A symbolic link's target (shown, never followed).
    pub target: Option<String>,
}

/// Owner and mode asked for (`uid`, `gid`, `mode`); unset ones unchanged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Meta {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

impl Meta {
    /// 400 for a mode past the permission bits (no set-id or sticky bits
    /// on the host) or an id of -1.
    pub fn check(&self) -> Result<(), FsError> {
        if let Some(m) = self.mode {
            if m > 0o777 {
                return Err(FsError::Invalid(format!(
                    "mode {m:#o} is refused: only the permission bits (0 to 0o777) may be set"
                )));
            }
        }
        if self.uid == Some(u32::MAX) || self.gid == Some(u32::MAX) {
            return Err(FsError::Invalid("uid and gid are 0 to 4294967294".into()));
        }
        Ok(())
    }
}

/// A volume's content directory and the bytes its files hold.
#[derive(Debug)]
pub struct Content {
    root: PathBuf,
    /// Shared with the NFS server guests write through
    /// (`torpor_scheduler::volumes::usage`).
    usage: Arc<Usage>,
}

fn io_err<'a>(op: &'static str, path: &'a VolumePath) -> impl FnOnce(io::Error) -> FsError + 'a {
    move |source| FsError::Io {
        op,
        path: path.shown(),
        source,
    }
}

/// An error opening the way to `path`: 404 for what is not there or not
/// a directory, 400 for a symbolic link on the way.
fn on_the_way(path: &VolumePath, e: io::Error) -> FsError {
    match e.raw_os_error() {
        Some(libc::ENOENT | libc::ENOTDIR) => FsError::NotFound(path.shown()),
        Some(libc::ELOOP | libc::EXDEV) => FsError::Invalid(format!(
            "path {} is refused: it is reached through a symbolic link",
            path.shown()
        )),
        _ => FsError::Io {
            op: "open",
            path: path.shown(),
            source: e,
        },
    }
}

fn ms(sec: i64, nsec: u64) -> Timestamp {
    Timestamp(sec.saturating_mul(1000) + (nsec / 1_000_000) as i64)
}

fn kind_of(st: &Stat) -> EntryType {
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => EntryType::File,
        FileType::Directory => EntryType::Directory,
        FileType::Symlink => EntryType::Symlink,
        _ => EntryType::Unknown,
    }
}

fn entry(path: &VolumePath, st: &Stat, target: Option<String>) -> EntryStat {
    let kind = kind_of(st);
    EntryStat {
        name: path
            .last()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        kind,
        path: path.shown(),
        size: if kind == EntryType::File {
            st.st_size.max(0) as u64
        } else {
            0
        },
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        atime: ms(st.st_atime, st.st_atime_nsec),
        mtime: ms(st.st_mtime, st.st_mtime_nsec),
        ctime: ms(st.st_ctime, st.st_ctime_nsec),
        target,
    }
}

/// `name` in `dir`, not followed.
fn stat_in(dir: BorrowedFd<'_>, name: &OsStr, path: &VolumePath) -> Result<EntryStat, FsError> {
    let st = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| {
        if e == rustix::io::Errno::NOENT {
            FsError::NotFound(path.shown())
        } else {
            io_err("stat", path)(e.into())
        }
    })?;
    let target = if kind_of(&st) == EntryType::Symlink {
        rustix::fs::readlinkat(dir, name, Vec::new())
            .ok()
            .map(|t| t.to_string_lossy().into_owned())
    } else {
        None
    };
    Ok(entry(path, &st, target))
}

/// Sets what `meta` asks for on the open `fd` (the default `mode` when
/// it asks none and `default_mode` is given).
fn apply(
    fd: BorrowedFd<'_>,
    meta: &Meta,
    default_mode: Option<u32>,
    path: &VolumePath,
) -> Result<(), FsError> {
    if meta.uid.is_some() || meta.gid.is_some() {
        rustix::fs::fchown(fd, meta.uid.map(Uid::from_raw), meta.gid.map(Gid::from_raw)).map_err(
            |e| {
                if e == rustix::io::Errno::PERM {
                    FsError::Invalid(format!(
                        "the owner of {} cannot be changed by this server (it does not run as root)",
                        path.shown()
                    ))
                } else {
                    io_err("chown", path)(e.into())
                }
            },
        )?;
    }
    if let Some(mode) = meta.mode.or(default_mode) {
        rustix::fs::fchmod(fd, Mode::from_raw_mode(mode))
            .map_err(|e| io_err("chmod", path)(e.into()))?;
    }
    Ok(())
}

fn open_flags() -> OFlags {
    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK | OFlags::NOCTTY
}

impl Content {
    /// The content directory `root` (made, mode 0700, if missing), its
    /// files' bytes counted, writes refused past `limit` bytes.
    pub fn open(root: PathBuf, limit: u64) -> io::Result<Content> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&root)?;
        let usage = Usage::of(&root, limit)?;
        Ok(Content { root, usage })
    }

    /// Bytes its files hold.
    pub fn used(&self) -> u64 {
        self.usage.used()
    }

    pub fn limit(&self) -> u64 {
        self.usage.limit()
    }

    fn root(&self, path: &VolumePath) -> Result<File, FsError> {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(&self.root)
            .map_err(io_err("open the volume root for", path))
    }

    /// The directory `rel` beneath the root (the root itself when empty).
    fn dir(&self, rel: &Path, path: &VolumePath) -> Result<OwnedFd, FsError> {
        let root = self.root(path)?;
        if rel.as_os_str().is_empty() {
            return Ok(root.into());
        }
        torpor_scheduler::images::open_beneath(
            &root,
            rel,
            // No O_NOFOLLOW: on a link it would make ENOTDIR of what
            // RESOLVE_NO_SYMLINKS answers ELOOP (refused, not absent).
            libc::O_RDONLY | libc::O_DIRECTORY,
            0,
        )
        .map(OwnedFd::from)
        .map_err(|e| on_the_way(path, e))
    }

    /// The directory holding `path`'s last name (404 when missing).
    fn parent(&self, path: &VolumePath) -> Result<OwnedFd, FsError> {
        self.dir(&path.parent_rel(), path)
    }

    /// `GET /path`: `path`'s metadata, a link's not followed.
    pub fn stat(&self, path: &VolumePath) -> Result<EntryStat, FsError> {
        match path.last() {
            None => {
                let root = self.root(path)?;
                let st = rustix::fs::fstat(&root).map_err(|e| io_err("stat", path)(e.into()))?;
                Ok(entry(path, &st, None))
            }
            Some(name) => stat_in(self.parent(path)?.as_fd(), name, path),
        }
    }

    /// `GET /dir`: what is in directory `path`, `depth` levels down (1:
    /// its own entries).
    pub fn list(&self, path: &VolumePath, depth: u32) -> Result<Vec<EntryStat>, FsError> {
        if depth == 0 || depth > MAX_LIST_DEPTH {
            return Err(FsError::Invalid(format!("depth is 1 to {MAX_LIST_DEPTH}")));
        }
        let mut rel = path.parent_rel();
        if let Some(n) = path.last() {
            rel.push(n);
        }
        let dir = self.dir(&rel, path)?;
        let mut out = Vec::new();
        list_into(dir, path, depth, &mut out)?;
        Ok(out)
    }

    /// `POST /dir`: makes directory `path` (its parents too with `force`;
    /// with `force` an existing directory is no error).
    pub fn make_dir(
        &self,
        path: &VolumePath,
        meta: &Meta,
        force: bool,
    ) -> Result<EntryStat, FsError> {
        meta.check()?;
        if path.is_root() {
            return if force {
                self.stat(path)
            } else {
                Err(FsError::Conflict("path / already exists".into()))
            };
        }
        let mut dir: OwnedFd = if force {
            self.root(path)?.into()
        } else {
            self.parent(path)?
        };
        let names: Vec<OsString> = if force {
            path.names.clone()
        } else {
            vec![path.last().unwrap_or_default().to_os_string()]
        };
        let mut so_far = if force {
            VolumePath { names: Vec::new() }
        } else {
            VolumePath {
                names: path.names[..path.names.len() - 1].to_vec(),
            }
        };
        for (i, name) in names.iter().enumerate() {
            so_far = so_far.child(name);
            let last = i + 1 == names.len();
            let mkdir = rustix::fs::mkdirat(&dir, name.as_os_str(), Mode::from_raw_mode(0o700));
            if mkdir.is_ok() {
                // A new entry: taken back past the volume's limit on them
                // (an existing directory needs none).
                if let Err(e) = self.add_entry() {
                    let _ = rustix::fs::unlinkat(&dir, name.as_os_str(), AtFlags::REMOVEDIR);
                    return Err(e);
                }
            }
            let made = match mkdir {
                Ok(()) => true,
                Err(rustix::io::Errno::EXIST) => {
                    let st = stat_in(dir.as_fd(), name, &so_far)?;
                    match st.kind {
                        EntryType::Directory if force => false,
                        EntryType::Directory => {
                            return Err(FsError::Conflict(format!(
                                "path {} already exists",
                                so_far.shown()
                            )))
                        }
                        EntryType::Symlink => {
                            return Err(on_the_way(
                                &so_far,
                                io::Error::from_raw_os_error(libc::ELOOP),
                            ))
                        }
                        _ => {
                            return Err(FsError::Conflict(format!(
                                "path {} is not a directory",
                                so_far.shown()
                            )))
                        }
                    }
                }
                Err(rustix::io::Errno::NOENT) => return Err(FsError::NotFound(so_far.shown())),
                Err(e) => return Err(io_err("mkdir", &so_far)(e.into())),
            };
            let next = rustix::fs::openat(
                &dir,
                name.as_os_str(),
                open_flags() | OFlags::DIRECTORY,
                Mode::empty(),
            )
            .map_err(|e| on_the_way(&so_far, e.into()))?;
            if made {
                apply(next.as_fd(), meta, Some(DIR_MODE), &so_far)?;
            }
            if last {
                let st = rustix::fs::fstat(&next).map_err(|e| io_err("stat", &so_far)(e.into()))?;
                return Ok(entry(&so_far, &st, None));
            }
            dir = next;
        }
        unreachable!("a path with names made its last directory")
    }

    /// `GET /file`: file `path` opened for reading (404 when it is not a
    /// file, 400 through a symbolic link) and its size.
    pub fn open_file(&self, path: &VolumePath) -> Result<(File, u64), FsError> {
        let name = path.last().ok_or_else(|| FsError::NotFound(path.shown()))?;
        let dir = self.parent(path)?;
        let fd = rustix::fs::openat(&dir, name, open_flags(), Mode::empty())
            .map_err(|e| on_the_way(path, e.into()))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err("stat", path)(e.into()))?;
        if kind_of(&st) != EntryType::File {
            return Err(FsError::NotFound(path.shown()));
        }
        let file = File::from(fd);
        // Reads block from here on: O_NONBLOCK was for opening only.
        rustix::fs::fcntl_setfl(&file, OFlags::empty())
            .map_err(|e| io_err("open", path)(e.into()))?;
        Ok((file, st.st_size.max(0) as u64))
    }

    /// `PUT /file`: `body` written to file `path` (its directory must
    /// exist), built under a temporary name beside it and renamed over
    /// it once complete; an existing file is replaced only with `force`
    /// (409 otherwise), a directory never. 413 past the volume's limit.
    pub fn write_file(
        &self,
        path: &VolumePath,
        body: &mut dyn Read,
        meta: &Meta,
        force: bool,
    ) -> Result<EntryStat, FsError> {
        meta.check()?;
        let name = path
            .last()
            .ok_or_else(|| FsError::Conflict("path / is a directory".into()))?;
        let dir = self.parent(path)?;
        let replaced = match stat_in(dir.as_fd(), name, path) {
            Ok(st) if st.kind == EntryType::Directory => {
                return Err(FsError::Conflict(format!(
                    "path {} is a directory",
                    path.shown()
                )))
            }
            Ok(_) if !force => {
                return Err(FsError::Conflict(format!(
                    "path {} already exists (write with force to replace it)",
                    path.shown()
                )))
            }
            Ok(st) => Some(st.size),
            Err(FsError::NotFound(_)) => None,
            Err(e) => return Err(e),
        };
        let temp = format!("{TEMP_PREFIX}{}", torpor_scheduler::random::random_hex(8));
        // The new name (the temporary one, renamed into place) is an entry;
        // one it replaces is one fewer once the rename is done.
        self.add_entry()?;
        let fd = rustix::fs::openat(
            &dir,
            temp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| {
            self.usage.remove_entries(1);
            io_err("create", path)(e.into())
        })?;
        let mut file = File::from(fd);
        let mut written = 0u64;
        let result = (|| {
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                let n = body
                    .read(&mut buf)
                    .map_err(io_err("read the body for", path))?;
                if n == 0 {
                    break;
                }
                self.reserve(n as u64)?;
                written += n as u64;
                file.write_all(&buf[..n]).map_err(io_err("write", path))?;
            }
            apply(file.as_fd(), meta, Some(FILE_MODE), path)?;
            file.sync_all().map_err(io_err("sync", path))?;
            let flags = if force {
                RenameFlags::empty()
            } else {
                RenameFlags::NOREPLACE
            };
            rustix::fs::renameat_with(&dir, temp.as_str(), &dir, name, flags).map_err(|e| {
                if e == rustix::io::Errno::EXIST {
                    FsError::Conflict(format!("path {} already exists", path.shown()))
                } else if e == rustix::io::Errno::ISDIR {
                    FsError::Conflict(format!("path {} is a directory", path.shown()))
                } else {
                    io_err("rename", path)(e.into())
                }
            })
        })();
        if let Err(e) = result {
            let _ = rustix::fs::unlinkat(&dir, temp.as_str(), AtFlags::empty());
            self.release(written);
            self.usage.remove_entries(1);
            return Err(e);
        }
        if let Some(size) = replaced {
            self.release(size);
            self.usage.remove_entries(1);
        }
        stat_in(dir.as_fd(), name, path)
    }

    /// `PATCH /path`: owner and mode of `path` (a link's are refused).
    pub fn set_meta(&self, path: &VolumePath, meta: &Meta) -> Result<EntryStat, FsError> {
        meta.check()?;
        let fd: OwnedFd = match path.last() {
            None => self.root(path)?.into(),
            Some(name) => {
                let dir = self.parent(path)?;
                rustix::fs::openat(&dir, name, open_flags(), Mode::empty())
                    .map_err(|e| on_the_way(path, e.into()))?
            }
        };
        apply(fd.as_fd(), meta, None, path)?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err("stat", path)(e.into()))?;
        Ok(entry(path, &st, None))
    }

    /// `DELETE /path`: removes `path`, a directory with all it holds (a
    /// link itself, never what it points to). The root is not removed.
    pub fn remove(&self, path: &VolumePath) -> Result<(), FsError> {
        let name = path.last().ok_or_else(|| FsError::NotFound(path.shown()))?;
        let dir = self.parent(path)?;
        let st = stat_in(dir.as_fd(), name, path)?;
        let freed = if st.kind == EntryType::Directory {
            remove_tree(dir.as_fd(), name, path)?
        } else {
            rustix::fs::unlinkat(&dir, name, AtFlags::empty())
                .map_err(|e| io_err("remove", path)(e.into()))?;
            Freed {
                bytes: st.size,
                entries: 1,
            }
        };
        self.release(freed.bytes);
        self.usage.remove_entries(freed.entries);
        Ok(())
    }

    /// Counts `n` more bytes: 413 past the limit.
    fn reserve(&self, n: u64) -> Result<(), FsError> {
        self.usage
            .reserve(n)
            .map_err(|e| FsError::TooLarge { limit: e.limit })
    }

    fn release(&self, n: u64) {
        self.usage.release(n)
    }

    /// Counts one more entry: 413 past the limit on them.
    fn add_entry(&self) -> Result<(), FsError> {
        self.usage
            .add_entry()
            .map_err(|e| FsError::TooManyEntries { limit: e.limit })
    }
}

/// The entries of the open directory `dir` (shown under `path`) into
/// `out`, `depth` levels down; none of [`TEMP_PREFIX`]'s.
fn list_into(
    dir: OwnedFd,
    path: &VolumePath,
    depth: u32,
    out: &mut Vec<EntryStat>,
) -> Result<(), FsError> {
    let names: Vec<OsString> = names_in(&dir, path)?
        .into_iter()
        .filter(|n| !n.as_bytes().starts_with(TEMP_PREFIX.as_bytes()))
        .collect();
    for name in names {
        if out.len() >= MAX_LIST_ENTRIES {
            return Err(FsError::Invalid(format!(
                "the listing has more than {MAX_LIST_ENTRIES} entries: list a smaller depth"
            )));
        }
        let child = path.child(&name);
        let st = match stat_in(dir.as_fd(), &name, &child) {
            Ok(st) => st,
            Err(FsError::NotFound(_)) => continue, // removed meanwhile
            Err(e) => return Err(e),
        };
        let recurse = depth > 1 && st.kind == EntryType::Directory;
        out.push(st);
        if recurse {
            if let Ok(sub) = rustix::fs::openat(
                &dir,
                name.as_os_str(),
                open_flags() | OFlags::DIRECTORY,
                Mode::empty(),
            ) {
                list_into(sub, &child, depth - 1, out)?;
            }
        }
    }
    Ok(())
}

/// The names in the open directory `dir` (shown as `path`), sorted,
/// without `.` and `..`.
fn names_in(dir: &OwnedFd, path: &VolumePath) -> Result<Vec<OsString>, FsError> {
    let reader = rustix::fs::Dir::read_from(dir).map_err(|e| io_err("list", path)(e.into()))?;
    let mut names = Vec::new();
    for item in reader {
        let item = item.map_err(|e| io_err("list", path)(e.into()))?;
        let name = OsStr::from_bytes(item.file_name().to_bytes());
        if name != "." && name != ".." {
            names.push(name.to_os_string());
        }
    }
    names.sort();
    Ok(names)
}

/// What a removal freed.
#[derive(Debug, Default)]
struct Freed {
    /// Bytes its files held.
    bytes: u64,
    /// Its entries, itself included.
    entries: u64,
}

/// Removes directory `name` in `parent` and all it holds, each entry
/// relative to its directory's descriptor, no link followed; what that
/// freed. (Whatever it removed before a failure stays counted: the
/// volume's count is then high, which refuses early, never late.)
fn remove_tree(parent: BorrowedFd<'_>, name: &OsStr, path: &VolumePath) -> Result<Freed, FsError> {
    let dir = rustix::fs::openat(
        parent,
        name,
        open_flags() | OFlags::DIRECTORY,
        Mode::empty(),
    )
    .map_err(|e| on_the_way(path, e.into()))?;
    let mut freed = Freed::default();
    for n in names_in(&dir, path)? {
        let child = path.child(&n);
        let st = rustix::fs::statat(&dir, n.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_err("stat", &child)(e.into()))?;
        if kind_of(&st) == EntryType::Directory {
            let under = remove_tree(dir.as_fd(), &n, &child)?;
            freed.bytes += under.bytes;
            freed.entries += under.entries;
        } else {
            rustix::fs::unlinkat(&dir, n.as_os_str(), AtFlags::empty())
                .map_err(|e| io_err("remove", &child)(e.into()))?;
            freed.entries += 1;
            if kind_of(&st) == EntryType::File {
                freed.bytes += st.st_size.max(0) as u64;
            }
        }
    }
    rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
        .map_err(|e| io_err("remove", path)(e.into()))?;
    freed.entries += 1;
    Ok(freed)
}

#[cfg(test)]
#[path = "fs_tests.rs"]
mod tests;
