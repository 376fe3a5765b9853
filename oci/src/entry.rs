//! One layer entry written into the root: whiteouts (`.wh.name`, opaque
//! `.wh..wh..opq`), directories, files, symlinks (stored as they are,
//! never followed), hard links (to a file already in the root), FIFOs and
//! device nodes (skipped where the kernel says no), then ownership, mode,
//! extended attributes (`SCHILY.xattr.*` PAX records) and times. Every
//! path goes through [`Root::walk`]; an entry that would write outside the
//! root is refused before anything of it is written.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, Timespec, Timestamps, Uid, XattrFlags};
use tar::EntryType;

use crate::error::{BombLimit, Error, Refusal, Result};
use crate::root::{self, Follow, Root, WalkError};

/// An entry's metadata from its header and PAX records.
#[derive(Debug, Default)]
pub(crate) struct Meta {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: (i64, i64),
    pub xattrs: Vec<(String, Vec<u8>)>,
}

/// Something an unpack left out, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The layer's digest (or file name).
    pub layer: String,
    /// The entry's path in the layer.
    pub entry: String,
    /// What was left out.
    pub what: String,
}

/// The xattr namespaces written: capabilities, user and trusted
/// attributes. Others (SELinux labels, ACLs) are left out and reported.
fn xattr_wanted(name: &str) -> bool {
    name.starts_with("user.") || name.starts_with("trusted.") || name == "security.capability"
}

/// Writes a layer's entries into a root.
pub(crate) struct Writer<'a> {
    pub root: &'a Root,
    pub layer: String,
    /// Paths this layer wrote (and their parents): an opaque whiteout
    /// keeps them.
    pub touched: HashSet<PathBuf>,
    /// Directories' times, set once every layer is in (writing into a
    /// directory changes its mtime).
    pub dir_times: &'a mut HashMap<PathBuf, (i64, i64)>,
    pub skipped: &'a mut Vec<Skipped>,
    /// File bytes written so far, all layers.
    pub bytes: &'a mut u64,
}

impl Writer<'_> {
    fn refused(&self, entry: &Path, reason: Refusal) -> Error {
        Error::Refused {
            layer: self.layer.clone(),
            entry: entry.display().to_string(),
            reason,
        }
    }

    fn walk_error(&self, entry: &Path, e: WalkError) -> Error {
        match e {
            WalkError::Refused(r) => self.refused(entry, r),
            WalkError::Io(e) => Error::io(format!("layer {}: {}", self.layer, entry.display()), e),
        }
    }

    fn io(&self, entry: &Path, e: impl Into<io::Error>) -> Error {
        Error::io(
            format!("layer {}: {}", self.layer, entry.display()),
            e.into(),
        )
    }

    fn skip(&mut self, entry: &Path, what: String) {
        tracing::debug!(layer = %self.layer, entry = %entry.display(), "skipped: {what}");
        self.skipped.push(Skipped {
            layer: self.layer.clone(),
            entry: entry.display().to_string(),
            what,
        });
    }

    /// Writes one entry. `max_file` and `max_total` are the limits on one
    /// file's and all files' bytes.
    pub(crate) fn apply<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        max_file: u64,
        max_total: u64,
    ) -> Result<()> {
        let path = entry
            .path()
            .map_err(|e| Error::malformed(format!("layer {}", self.layer), e))?
            .into_owned();
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            EntryType::XGlobalHeader
                | EntryType::XHeader
                | EntryType::GNULongName
                | EntryType::GNULongLink
        ) {
            return Ok(());
        }
        let components = root::entry_components(&path).map_err(|r| self.refused(&path, r))?;
        let Some((name, parents)) = components.split_last() else {
            // `./` itself: the root keeps its own mode and owner.
            return if kind == EntryType::Directory {
                Ok(())
            } else {
                Err(self.refused(&path, Refusal::ReplacesRoot))
            };
        };
        let layer_path: PathBuf = components.iter().collect();
        if let Some(hidden) = name.as_bytes().strip_prefix(b".wh.") {
            return self.whiteout(&path, parents, hidden);
        }
        let meta = self.meta(entry, &path)?;
        let walked = self
            .root
            .walk(&components, Follow::Strict, false, true)
            .map_err(|e| self.walk_error(&path, e))?;
        let dir = walked.dir.as_fd();
        let name = walked.name.unwrap_or_else(|| name.clone());
        let existing = root::kind_of(dir, &name).map_err(|e| self.io(&path, e))?;
        for p in layer_path.ancestors() {
            if !self.touched.insert(p.to_path_buf()) {
                break;
            }
        }
        let name = name.as_os_str();
        match kind {
            EntryType::Directory => {
                if existing != Some(FileType::Directory) {
                    root::remove(dir, name).map_err(|e| self.io(&path, e))?;
                    rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o700))
                        .map_err(|e| self.io(&path, e))?;
                }
                let fd = rustix::fs::openat(
                    dir,
                    name,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| self.io(&path, e))?;
                self.set_meta(fd.as_fd(), &meta, &path, false)?;
                self.dir_times.insert(walked.at.join(name), meta.mtime);
            }
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                let size = entry.size();
                if size > max_file {
                    return Err(self.bomb(BombLimit::FileBytes {
                        entry: path.display().to_string(),
                        size,
                        max: max_file,
                    }));
                }
                if self.bytes.saturating_add(size) > max_total {
                    return Err(self.bomb(BombLimit::TotalBytes { max: max_total }));
                }
                root::remove(dir, name).map_err(|e| self.io(&path, e))?;
                let fd = rustix::fs::openat(
                    dir,
                    name,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|e| self.io(&path, e))?;
                let mut file = File::from(fd);
                let written = io::copy(&mut entry.take(max_file.saturating_add(1)), &mut file)
                    .map_err(|e| self.io(&path, e))?;
                *self.bytes += written;
                if written > max_file {
                    return Err(self.bomb(BombLimit::FileBytes {
                        entry: path.display().to_string(),
                        size: written,
                        max: max_file,
                    }));
                }
                if *self.bytes > max_total {
                    return Err(self.bomb(BombLimit::TotalBytes { max: max_total }));
                }
                self.set_meta(file.as_fd(), &meta, &path, true)?;
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| {
                        Error::malformed(
                            format!("layer {}", self.layer),
                            "a symlink without a target",
                        )
                    })?
                    .into_owned();
                root::remove(dir, name).map_err(|e| self.io(&path, e))?;
                rustix::fs::symlinkat(OsStr::from_bytes(&target), dir, name)
                    .map_err(|e| self.io(&path, e))?;
                self.set_link_meta(dir, name, &meta, &path)?;
            }
            EntryType::Link => self.hard_link(entry, &path, dir, name)?,
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                let (file_type, dev) = match kind {
                    EntryType::Fifo => (FileType::Fifo, 0),
                    _ => {
                        let h = entry.header();
                        let major = h.device_major().ok().flatten().unwrap_or(0);
                        let minor = h.device_minor().ok().flatten().unwrap_or(0);
                        let t = if kind == EntryType::Char {
                            FileType::CharacterDevice
                        } else {
                            FileType::BlockDevice
                        };
                        (t, rustix::fs::makedev(major, minor))
                    }
                };
                root::remove(dir, name).map_err(|e| self.io(&path, e))?;
                match rustix::fs::mknodat(dir, name, file_type, Mode::from_raw_mode(0o600), dev) {
                    Ok(()) => {}
                    Err(rustix::io::Errno::PERM | rustix::io::Errno::ACCESS) => {
                        self.skip(&path, format!("{file_type:?}: mknod not permitted here"));
                        return Ok(());
                    }
                    Err(e) => return Err(self.io(&path, e)),
                }
                self.set_link_meta(dir, name, &meta, &path)?;
                rustix::fs::chmodat(dir, name, Mode::from_raw_mode(meta.mode), AtFlags::empty())
                    .map_err(|e| self.io(&path, e))?;
            }
            other => {
                return Err(self.refused(
                    &path,
                    Refusal::UnsupportedType {
                        flag: other.as_byte() as char,
                    },
                ))
            }
        }
        Ok(())
    }

    fn bomb(&self, limit: BombLimit) -> Error {
        Error::Bomb {
            layer: self.layer.clone(),
            limit,
        }
    }

    /// `.wh.NAME` removes NAME; `.wh..wh..opq` empties its directory of
    /// what lower layers put there.
    fn whiteout(&mut self, path: &Path, parents: &[OsString], hidden: &[u8]) -> Result<()> {
        let parent_path: PathBuf = parents.iter().collect();
        if hidden == b".wh..opq" {
            let walked = match self.root.walk(parents, Follow::Strict, true, false) {
                Ok(w) => w,
                Err(WalkError::Io(e)) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(self.walk_error(path, e)),
            };
            let dir = match &walked.name {
                // Not a directory (a file where the directory was): nothing under it.
                Some(_) => return Ok(()),
                None => walked.dir,
            };
            let touched = &self.touched;
            root::clear(dir.as_fd(), &|child| {
                !touched.contains(&parent_path.join(child))
            })
            .map_err(|e| self.io(path, e))?;
            for p in parent_path.ancestors() {
                self.touched.insert(p.to_path_buf());
            }
            return Ok(());
        }
        if hidden.starts_with(b".wh.") {
            // Other AUFS metadata (.wh..wh.plnk, .wh..wh.aufs): not content.
            return Ok(());
        }
        if hidden.is_empty() {
            return Err(self.refused(path, Refusal::EmptyWhiteout));
        }
        let mut target: Vec<OsString> = parents.to_vec();
        target.push(OsStr::from_bytes(hidden).to_os_string());
        match self.root.walk(&target, Follow::Strict, false, false) {
            Ok(walked) => {
                let name = walked.name.unwrap_or_default();
                root::remove(walked.dir.as_fd(), &name).map_err(|e| self.io(path, e))
            }
            Err(WalkError::Io(e)) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(WalkError::Refused(Refusal::NotADirectory { .. })) => Ok(()),
            Err(e) => Err(self.walk_error(path, e)),
        }
    }

    fn hard_link<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        path: &Path,
        dir: BorrowedFd<'_>,
        name: &OsStr,
    ) -> Result<()> {
        let raw = entry
            .link_name_bytes()
            .ok_or_else(|| {
                Error::malformed(
                    format!("layer {}", self.layer),
                    "a hard link without a target",
                )
            })?
            .into_owned();
        let shown = String::from_utf8_lossy(&raw).into_owned();
        let target_components = root::entry_components(Path::new(OsStr::from_bytes(&raw)))
            .map_err(|_| {
                self.refused(
                    path,
                    Refusal::HardLinkOutOfRoot {
                        target: shown.clone(),
                    },
                )
            })?;
        let missing = || Refusal::HardLinkTarget {
            target: shown.clone(),
        };
        if target_components.is_empty() {
            return Err(self.refused(path, missing()));
        }
        let target = match self
            .root
            .walk(&target_components, Follow::Strict, false, false)
        {
            Ok(t) => t,
            Err(WalkError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
                return Err(self.refused(path, missing()))
            }
            Err(WalkError::Refused(Refusal::NotADirectory { .. })) => {
                return Err(self.refused(path, missing()))
            }
            Err(e) => return Err(self.walk_error(path, e)),
        };
        let target_name = target.name.clone().unwrap_or_default();
        match root::kind_of(target.dir.as_fd(), &target_name).map_err(|e| self.io(path, e))? {
            None | Some(FileType::Directory) => return Err(self.refused(path, missing())),
            Some(_) => {}
        }
        let same_dir = rustix::fs::fstat(target.dir.as_fd())
            .and_then(|a| {
                rustix::fs::fstat(dir).map(|b| (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino))
            })
            .map_err(|e| self.io(path, e))?;
        if same_dir && target_name == name {
            return Ok(());
        }
        root::remove(dir, name).map_err(|e| self.io(path, e))?;
        rustix::fs::linkat(
            target.dir.as_fd(),
            &target_name,
            dir,
            name,
            AtFlags::empty(),
        )
        .map_err(|e| self.io(path, e))
    }

    /// Reads the entry's metadata: header, then PAX records over it.
    fn meta<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>, path: &Path) -> Result<Meta> {
        let bad =
            |e: io::Error| Error::malformed(format!("layer {}: {}", self.layer, path.display()), e);
        let h = entry.header();
        let id =
            |v: u64| u32::try_from(v).map_err(|_| bad(io::Error::other("uid or gid over 32 bits")));
        let mut meta = Meta {
            mode: h.mode().map_err(bad)? & 0o7777,
            uid: id(h.uid().map_err(bad)?)?,
            gid: id(h.gid().map_err(bad)?)?,
            mtime: (h.mtime().map_err(bad)? as i64, 0),
            xattrs: Vec::new(),
        };
        let mut dropped = Vec::new();
        if let Some(pax) = entry.pax_extensions().map_err(bad)? {
            for ext in pax {
                let ext = ext.map_err(bad)?;
                let Ok(key) = ext.key() else { continue };
                let value = ext.value().ok();
                match key {
                    "uid" => {
                        meta.uid = id(value
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(meta.uid as u64))?
                    }
                    "gid" => {
                        meta.gid = id(value
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(meta.gid as u64))?
                    }
                    "mtime" => {
                        if let Some(t) = value.and_then(parse_pax_time) {
                            meta.mtime = t;
                        }
                    }
                    _ => {
                        if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                            if xattr_wanted(name) {
                                meta.xattrs
                                    .push((name.to_string(), ext.value_bytes().to_vec()));
                            } else {
                                dropped.push(name.to_string());
                            }
                        }
                    }
                }
            }
        }
        for name in dropped {
            self.skip(path, format!("extended attribute {name}"));
        }
        Ok(meta)
    }

    /// Owner, mode, xattrs and (for files) times of an open entry.
    fn set_meta(&self, fd: BorrowedFd<'_>, meta: &Meta, path: &Path, times: bool) -> Result<()> {
        // The owner first: chown clears set-id bits and capabilities.
        rustix::fs::fchown(
            fd,
            Some(Uid::from_raw(meta.uid)),
            Some(Gid::from_raw(meta.gid)),
        )
        .map_err(|e| self.io(path, e))?;
        rustix::fs::fchmod(fd, Mode::from_raw_mode(meta.mode)).map_err(|e| self.io(path, e))?;
        for (name, value) in &meta.xattrs {
            rustix::fs::fsetxattr(fd, name.as_str(), value, XattrFlags::empty()).map_err(|e| {
                self.io(
                    path,
                    io::Error::new(io::Error::from(e).kind(), format!("xattr {name}: {e}")),
                )
            })?;
        }
        if times {
            rustix::fs::futimens(fd, &timestamps(meta.mtime)).map_err(|e| self.io(path, e))?;
        }
        Ok(())
    }

    /// Owner and times of a symlink or node, not followed.
    fn set_link_meta(
        &self,
        dir: BorrowedFd<'_>,
        name: &OsStr,
        meta: &Meta,
        path: &Path,
    ) -> Result<()> {
        rustix::fs::chownat(
            dir,
            name,
            Some(Uid::from_raw(meta.uid)),
            Some(Gid::from_raw(meta.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.io(path, e))?;
        rustix::fs::utimensat(
            dir,
            name,
            &timestamps(meta.mtime),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.io(path, e))
    }
}

/// Access and modification times both `t`.
pub(crate) fn timestamps(t: (i64, i64)) -> Timestamps {
    let ts = Timespec {
        tv_sec: t.0,
        tv_nsec: t.1 as _,
    };
    Timestamps {
        last_access: ts,
        last_modification: ts,
    }
}

/// A PAX time: seconds, optionally with a fraction (`1700000000.5`).
fn parse_pax_time(v: &str) -> Option<(i64, i64)> {
    let (secs, frac) = v.split_once('.').unwrap_or((v, ""));
    let secs: i64 = secs.parse().ok()?;
    let digits: String = frac.chars().take(9).collect();
    let nanos = if digits.is_empty() {
        0
    } else {
        digits.parse::<i64>().ok()? * 10i64.pow(9 - digits.len() as u32)
    };
    Some((secs, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_times_keep_their_fraction() {
        assert_eq!(parse_pax_time("1700000000"), Some((1_700_000_000, 0)));
        assert_eq!(
            parse_pax_time("1700000000.25"),
            Some((1_700_000_000, 250_000_000))
        );
        assert_eq!(parse_pax_time("x"), None);
    }
}
