//! Directory watches (protocol 1.1) on inotify. A watch owns one
//! non-blocking inotify fd; `watch_events` drains it (no thread per
//! watch). Recursive watches add the subdirectories present at
//! `watch_add` and those created later (seen when their creation is
//! drained; changes inside a new directory before that are missed).
//!
//! Bounds: [`MAX_WATCHES`] watches per agent, [`MAX_DIRS`] directories per
//! watch (past it, deeper directories go unwatched and `overflow` is set),
//! [`MAX_EVENTS`] events per `watch_events` (the rest wait in the kernel's
//! queue, whose own overflow sets `overflow`).

use crate::proto::{ErrorReply, WatchAddRequest, WatchEvent, WatchEventKind, WatchEvents};
use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use torpor_sync::Locked;

/// Watches at once per agent.
pub const MAX_WATCHES: usize = 64;
/// Directories one watch follows.
pub const MAX_DIRS: usize = 4096;
/// Events one `watch_events` answers with.
pub const MAX_EVENTS: usize = 4096;

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF;

#[derive(Debug)]
struct Watch {
    fd: OwnedFd,
    root: PathBuf,
    recursive: bool,
    /// Watch descriptor → directory.
    dirs: HashMap<i32, PathBuf>,
    overflow: bool,
}

impl Watch {
    fn add_dir(&mut self, dir: &Path) -> Result<(), std::io::Error> {
        if self.dirs.len() >= MAX_DIRS {
            self.overflow = true;
            return Ok(());
        }
        let c = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a valid fd and NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c.as_ptr(), MASK) };
        if wd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.dirs.insert(wd, dir.to_path_buf());
        Ok(())
    }

    /// Adds `dir`'s subdirectories, depth first, until the cap.
    fn add_tree(&mut self, dir: &Path) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) && self.dirs.len() < MAX_DIRS {
                let p = e.path();
                if self.add_dir(&p).is_ok() {
                    self.add_tree(&p);
                }
            }
        }
    }

    fn drain(&mut self) -> WatchEvents {
        let mut events = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        'read: while events.len() < MAX_EVENTS {
            // SAFETY: reads into a buffer of the given length.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            let n = n as usize;
            let mut off = 0;
            let header = std::mem::size_of::<libc::inotify_event>();
            while off + header <= n {
                // SAFETY: the kernel wrote whole events; read_unaligned
                // copes with the byte buffer's alignment.
                let ev: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
                let name_end = (off + header + ev.len as usize).min(n);
                let raw = &buf[off + header..name_end];
                let name = &raw[..raw.iter().position(|&b| b == 0).unwrap_or(raw.len())];
                off = name_end;
                if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                    self.overflow = true;
                    continue;
                }
                let Some(dir) = self.dirs.get(&ev.wd).cloned() else {
                    continue;
                };
                if ev.mask & libc::IN_IGNORED != 0 {
                    self.dirs.remove(&ev.wd);
                    continue;
                }
                let full = if name.is_empty() {
                    dir
                } else {
                    dir.join(std::ffi::OsStr::from_bytes(name))
                };
                if self.recursive
                    && ev.mask & libc::IN_ISDIR != 0
                    && ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0
                    && self.add_dir(&full).is_ok()
                {
                    self.add_tree(&full);
                }
                let kind = if ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                    WatchEventKind::Create
                } else if ev.mask & libc::IN_MODIFY != 0 {
                    WatchEventKind::Write
                } else if ev.mask & (libc::IN_DELETE | libc::IN_DELETE_SELF) != 0 {
                    WatchEventKind::Remove
                } else if ev.mask & (libc::IN_MOVED_FROM | libc::IN_MOVE_SELF) != 0 {
                    WatchEventKind::Rename
                } else if ev.mask & libc::IN_ATTRIB != 0 {
                    WatchEventKind::Chmod
                } else {
                    continue;
                };
                let rel = full.strip_prefix(&self.root).unwrap_or(&full);
                events.push(WatchEvent {
                    name: rel.to_string_lossy().into_owned(),
                    kind,
                });
                if events.len() >= MAX_EVENTS {
                    break 'read;
                }
            }
        }
        WatchEvents {
            events,
            overflow: std::mem::take(&mut self.overflow),
        }
    }
}

/// The agent's watches, shared by every connection.
#[derive(Default, Debug)]
pub struct Watches {
    map: Mutex<HashMap<u64, Watch>>,
    next: AtomicU64,
}

fn no_watch(id: u64) -> ErrorReply {
    ErrorReply::new(libc::ENOENT, format!("no watch {id}"))
}

impl Watches {
    /// `watch_add`: the directory must exist.
    pub fn add(&self, req: &WatchAddRequest) -> Result<u64, ErrorReply> {
        if !req.path.starts_with('/') {
            return Err(ErrorReply::new(
                libc::EINVAL,
                format!("path must be absolute: {:?}", req.path),
            ));
        }
        let root = PathBuf::from(&req.path);
        let meta = fs::metadata(&root).map_err(|e| ErrorReply::io(&req.path, &e))?;
        if !meta.is_dir() {
            return Err(ErrorReply::new(
                libc::ENOTDIR,
                format!("{}: not a directory", req.path),
            ));
        }
        let mut map = self.map.locked();
        if map.len() >= MAX_WATCHES {
            return Err(ErrorReply::new(
                libc::EAGAIN,
                format!("{MAX_WATCHES} watches already exist"),
            ));
        }
        // SAFETY: plain syscall.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(ErrorReply::io("inotify_init1", &e));
        }
        let mut watch = Watch {
            // SAFETY: inotify_init1 succeeded; the fd is ours alone.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            root: root.clone(),
            recursive: req.recursive,
            dirs: HashMap::new(),
            overflow: false,
        };
        watch
            .add_dir(&root)
            .map_err(|e| ErrorReply::io(&req.path, &e))?;
        if req.recursive {
            watch.add_tree(&root);
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        map.insert(id, watch);
        Ok(id)
    }

    /// `watch_events`: what happened since the last call.
    pub fn events(&self, id: u64) -> Result<WatchEvents, ErrorReply> {
        let mut map = self.map.locked();
        let watch = map.get_mut(&id).ok_or_else(|| no_watch(id))?;
        Ok(watch.drain())
    }

    /// `watch_remove`.
    pub fn remove(&self, id: u64) -> Result<(), ErrorReply> {
        self.map
            .locked()
            .remove(&id)
            .map(drop)
            .ok_or_else(|| no_watch(id))
    }
}
