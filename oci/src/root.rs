//! A directory every write of an unpack or a template build stays in
//! ([`Root`]): paths are walked one component at a time from the root's
//! file descriptor with `O_NOFOLLOW`, and a symlink met on the way is
//! resolved by this code, never by the kernel, against the root:
//!
//! - [`Follow::Strict`] (every write): a relative target is followed while
//!   it stays under the root; an absolute target, or `..` climbing above
//!   the root, is refused ([`Refusal::SymlinkOutOfRoot`]);
//! - [`Follow::Chroot`] (looking a file up, as the guest will): an absolute
//!   target starts again at the root and `..` stops there, as in a chroot.
//!
//! Either way the kernel is only ever asked to open one name in a
//! directory already open, with `O_NOFOLLOW`, so no path handed to it can
//! leave the root, whatever the tree holds.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

use crate::error::Refusal;

/// Deepest path walked, in components.
pub(crate) const MAX_DEPTH: usize = 256;
/// Most symlinks followed in one walk (Linux's own limit).
const MAX_HOPS: usize = 40;

/// How symlinks met on a walk are treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Follow {
    /// Relative targets under the root only; the others are refused.
    Strict,
    /// Absolute targets from the root, `..` stopping at it.
    Chroot,
}

/// Why a walk stopped.
#[derive(Debug)]
pub(crate) enum WalkError {
    /// The tree or path is refused.
    Refused(Refusal),
    /// A system call failed.
    Io(io::Error),
}

impl From<io::Error> for WalkError {
    fn from(e: io::Error) -> WalkError {
        WalkError::Io(e)
    }
}

impl From<rustix::io::Errno> for WalkError {
    fn from(e: rustix::io::Errno) -> WalkError {
        WalkError::Io(e.into())
    }
}

/// A walk's result: the directory the path ends in and its last name
/// (`None`: the path is that directory itself).
#[derive(Debug)]
pub(crate) struct Walked {
    pub dir: OwnedFd,
    pub name: Option<OsString>,
    /// The directory's path in the root (for messages).
    pub at: PathBuf,
}

/// An open root directory.
#[derive(Debug)]
pub(crate) struct Root {
    fd: OwnedFd,
}

/// Flags of a directory opened on a walk.
fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

impl Root {
    /// Opens `path`, which must be a directory (not a symlink to one).
    pub(crate) fn open(path: &Path) -> io::Result<Root> {
        let fd = rustix::fs::open(path, dir_flags(), Mode::empty())?;
        Ok(Root { fd })
    }

    /// The root's descriptor.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Opens the directory at `resolved` (names of real directories from
    /// the root, as a walk leaves them).
    fn reopen(&self, resolved: &[OsString]) -> Result<OwnedFd, WalkError> {
        let mut fd = rustix::fs::openat(self.fd(), ".", dir_flags(), Mode::empty())?;
        for name in resolved {
            fd = rustix::fs::openat(&fd, name.as_os_str(), dir_flags(), Mode::empty())?;
        }
        Ok(fd)
    }

    /// Walks `components` from the root. Every component but the last
    /// must be a directory (or a symlink to one, per `follow`); missing
    /// ones are made (mode 0755, root's) when `create`. The last is
    /// followed too when `follow_last` and it is a symlink.
    pub(crate) fn walk(
        &self,
        components: &[OsString],
        follow: Follow,
        follow_last: bool,
        create: bool,
    ) -> Result<Walked, WalkError> {
        let mut todo: VecDeque<OsString> = components.iter().cloned().collect();
        let mut resolved: Vec<OsString> = Vec::new();
        let mut dir = self.reopen(&[])?;
        let mut hops = 0;
        while let Some(name) = todo.pop_front() {
            let last = todo.is_empty();
            if name.is_empty() || name == "." {
                continue;
            }
            if name == ".." {
                if resolved.pop().is_none() && follow == Follow::Strict {
                    // Only a symlink's target can bring `..` here (entry
                    // paths are refused before): the caller names the link.
                    return Err(WalkError::Refused(Refusal::ParentComponent));
                }
                dir = self.reopen(&resolved)?;
                continue;
            }
            if resolved.len() >= MAX_DEPTH {
                return Err(WalkError::Refused(Refusal::TooDeep { max: MAX_DEPTH }));
            }
            if last && !follow_last {
                return Ok(Walked {
                    dir,
                    name: Some(name),
                    at: resolved.iter().collect(),
                });
            }
            let stat = match rustix::fs::statat(&dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat) => Some(stat),
                Err(rustix::io::Errno::NOENT) => None,
                Err(e) => return Err(e.into()),
            };
            match stat.map(|s| FileType::from_raw_mode(s.st_mode)) {
                Some(FileType::Directory) => {
                    dir = rustix::fs::openat(&dir, name.as_os_str(), dir_flags(), Mode::empty())?;
                    resolved.push(name);
                }
                Some(FileType::Symlink) => {
                    hops += 1;
                    if hops > MAX_HOPS {
                        return Err(WalkError::Refused(Refusal::SymlinkLoop));
                    }
                    let target = rustix::fs::readlinkat(&dir, name.as_os_str(), Vec::new())?;
                    let target = PathBuf::from(OsStr::from_bytes(target.as_bytes()));
                    let link: PathBuf = resolved.iter().chain([&name]).collect();
                    let out = || {
                        WalkError::Refused(Refusal::SymlinkOutOfRoot {
                            link: link.clone(),
                            target: target.clone(),
                        })
                    };
                    if target.is_absolute() {
                        if follow == Follow::Strict {
                            return Err(out());
                        }
                        resolved.clear();
                        dir = self.reopen(&[])?;
                    } else if follow == Follow::Strict {
                        // Climbing above the root through this link?
                        let mut depth = resolved.len() as i64;
                        for c in target.components() {
                            match c {
                                Component::ParentDir => depth -= 1,
                                Component::Normal(_) => depth += 1,
                                _ => {}
                            }
                            if depth < 0 {
                                return Err(out());
                            }
                        }
                    }
                    for c in target.components().rev() {
                        match c {
                            Component::Normal(n) => todo.push_front(n.to_os_string()),
                            Component::ParentDir => todo.push_front("..".into()),
                            _ => {}
                        }
                    }
                }
                Some(_) if last => {
                    return Ok(Walked {
                        dir,
                        name: Some(name),
                        at: resolved.iter().collect(),
                    })
                }
                None if last => {
                    return Ok(Walked {
                        dir,
                        name: Some(name),
                        at: resolved.iter().collect(),
                    })
                }
                None if create => {
                    rustix::fs::mkdirat(&dir, name.as_os_str(), Mode::from_raw_mode(0o755))?;
                    dir = rustix::fs::openat(&dir, name.as_os_str(), dir_flags(), Mode::empty())?;
                    resolved.push(name);
                }
                None => return Err(WalkError::Io(io::ErrorKind::NotFound.into())),
                Some(_) => {
                    resolved.push(name);
                    return Err(WalkError::Refused(Refusal::NotADirectory {
                        path: resolved.iter().collect(),
                    }));
                }
            }
        }
        Ok(Walked {
            dir,
            name: None,
            at: resolved.iter().collect(),
        })
    }

    /// Walks a guest path (`/etc/passwd`, leading `/` meaning the root).
    pub(crate) fn walk_guest(
        &self,
        path: &str,
        follow: Follow,
        follow_last: bool,
        create: bool,
    ) -> Result<Walked, WalkError> {
        let components: Vec<OsString> = path
            .split('/')
            .filter(|c| !c.is_empty())
            .map(OsString::from)
            .collect();
        self.walk(&components, follow, follow_last, create)
    }
}

/// A layer entry's path as components: `.` dropped, `..` and absolute
/// paths refused.
pub(crate) fn entry_components(path: &Path) -> Result<Vec<OsString>, Refusal> {
    let mut out = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n.to_os_string()),
            Component::CurDir => {}
            Component::ParentDir => return Err(Refusal::ParentComponent),
            Component::RootDir | Component::Prefix(_) => return Err(Refusal::Absolute),
        }
    }
    if out.len() > MAX_DEPTH {
        return Err(Refusal::TooDeep { max: MAX_DEPTH });
    }
    Ok(out)
}

/// What `name` in `dir` is, without following it (`None`: nothing).
pub(crate) fn kind_of(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<FileType>> {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(s) => Ok(Some(FileType::from_raw_mode(s.st_mode))),
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Removes `name` from `dir`, a whole tree if it is a directory, never
/// following a symlink. Nothing there is fine.
pub(crate) fn remove(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match kind_of(dir, name)? {
        None => Ok(()),
        Some(FileType::Directory) => {
            let sub = rustix::fs::openat(dir, name, dir_flags(), Mode::empty())?;
            clear(sub.as_fd(), &|_| true)?;
            Ok(rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)?)
        }
        Some(_) => Ok(rustix::fs::unlinkat(dir, name, AtFlags::empty())?),
    }
}

/// Removes every entry of `dir` that `doomed` says so of.
pub(crate) fn clear(dir: BorrowedFd<'_>, doomed: &dyn Fn(&OsStr) -> bool) -> io::Result<()> {
    for name in names(dir)? {
        if doomed(&name) {
            remove(dir, &name)?;
        }
    }
    Ok(())
}

/// The names in `dir` (without `.` and `..`).
pub(crate) fn names(dir: BorrowedFd<'_>) -> io::Result<Vec<OsString>> {
    let mut out = Vec::new();
    let mut entries = rustix::fs::Dir::read_from(dir)?;
    while let Some(entry) = entries.read() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            out.push(OsStr::from_bytes(name).to_os_string());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn comps(p: &str) -> Vec<OsString> {
        entry_components(Path::new(p)).unwrap()
    }

    #[test]
    fn relative_links_are_followed_inside_and_refused_outside() {
        let dir = tempfile::tempdir().unwrap();
        let root_path = dir.path().join("root");
        std::fs::create_dir_all(root_path.join("usr/lib")).unwrap();
        symlink("usr/lib", root_path.join("lib")).unwrap();
        symlink("../../..", root_path.join("usr/up")).unwrap();
        symlink("/", root_path.join("abs")).unwrap();
        symlink("loop", root_path.join("loop")).unwrap();
        let root = Root::open(&root_path).unwrap();
        let w = root
            .walk(&comps("lib/x/y"), Follow::Strict, false, true)
            .unwrap();
        assert_eq!(w.at, Path::new("usr/lib/x"));
        assert!(root_path.join("usr/lib/x").is_dir());
        for (path, link) in [("usr/up/x", "usr/up"), ("abs/etc/x", "abs")] {
            match root.walk(&comps(path), Follow::Strict, false, true) {
                Err(WalkError::Refused(Refusal::SymlinkOutOfRoot { link: l, .. })) => {
                    assert_eq!(l, Path::new(link))
                }
                other => panic!("{path}: {other:?}"),
            }
        }
        assert!(matches!(
            root.walk(&comps("loop/x"), Follow::Strict, false, true),
            Err(WalkError::Refused(Refusal::SymlinkLoop))
        ));
        // As a chroot would: `/` is the root, `..` stops there.
        let w = root
            .walk(&comps("abs/usr/up/usr"), Follow::Chroot, true, false)
            .unwrap();
        assert_eq!((w.at.as_path(), w.name), (Path::new("usr"), None));
        assert_eq!(
            entry_components(Path::new("a/../b")),
            Err(Refusal::ParentComponent)
        );
        assert_eq!(entry_components(Path::new("/etc")), Err(Refusal::Absolute));
    }
}
