//! Directory watches (protocol 1.1) on inotify. Each watch has its own
//! thread, which reads its inotify fd as events come and queues them for
//! `watch_events` (up to [`MAX_QUEUED`]; past it events are dropped and
//! `overflow` is set). Recursive watches add the subdirectories present at
//! `watch_add` and each new one as soon as its creation is read; what a new
//! directory already holds by then is reported as created, so a file made
//! at once inside a new directory is not missed.
//!
//! Bounds: [`MAX_WATCHES`] watches (and so threads) per agent, [`MAX_DIRS`]
//! directories per watch (past it, deeper directories go unwatched and
//! `overflow` is set), [`MAX_EVENTS`] events per `watch_events`.

use crate::proto::{
    ErrorReply, FileKind, StatRequest, WatchAddRequest, WatchEvent, WatchEventKind, WatchEvents,
};
use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use std::thread::JoinHandle;
use torpor_sync::Locked;

/// `statfs` magic numbers of network filesystems (`linux/magic.h` and
/// the filesystems' own headers), by name.
const NETWORK_FILESYSTEMS: &[(i64, &str)] = &[
    (0x6969, "nfs"),
    (0x517b, "smb"),
    (0xff53_4d42, "cifs"),
    (0xfe53_4d42, "smb2"),
    (0x6573_5546, "fuse"),
    (0x0102_1997, "9p"),
    (0x00c3_6400, "ceph"),
    (0x5346_414f, "afs"),
    (0x7375_7245, "coda"),
    (0x564c, "ncp"),
];

/// The network filesystem `path` is on, if it is on one.
fn network_filesystem(path: &Path) -> Result<Option<&'static str>, ErrorReply> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| ErrorReply::new(libc::EINVAL, "a path with a NUL byte".to_string()))?;
    // SAFETY: zeroed plain-data struct, filled by the kernel.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and a struct of the right type.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(ErrorReply::io(&path.to_string_lossy(), &e));
    }
    let magic = st.f_type as i64 & 0xffff_ffff;
    Ok(NETWORK_FILESYSTEMS
        .iter()
        .find(|(m, _)| *m == magic)
        .map(|&(_, name)| name))
}

/// Watches at once per agent.
pub const MAX_WATCHES: usize = 64;
/// Directories one watch follows.
pub const MAX_DIRS: usize = 4096;
/// Events one `watch_events` answers with.
pub const MAX_EVENTS: usize = 4096;
/// Events a watch keeps until they are asked for.
pub const MAX_QUEUED: usize = 16 * 1024;

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF;

/// What a watch's thread hands to `watch_events`.
#[derive(Debug, Default)]
struct Queue {
    events: VecDeque<WatchEvent>,
    overflow: bool,
}

impl Queue {
    fn push(&mut self, event: WatchEvent) {
        if self.events.len() >= MAX_QUEUED {
            self.overflow = true;
        } else {
            self.events.push_back(event);
        }
    }
}

/// The inotify side of a watch, owned by its thread.
#[derive(Debug)]
struct Reader {
    fd: OwnedFd,
    root: PathBuf,
    recursive: bool,
    /// Events carry the stat of their path (1.2).
    include_entry: bool,
    /// Watch descriptor → directory.
    dirs: HashMap<i32, PathBuf>,
    queue: Arc<Mutex<Queue>>,
}

impl Reader {
    fn add_dir(&mut self, dir: &Path) -> Result<(), std::io::Error> {
        if self.dirs.len() >= MAX_DIRS {
            self.queue.locked().overflow = true;
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

    /// Adds `dir`'s subdirectories, depth first, until the cap; with
    /// `report`, every entry found is queued as created (a directory that
    /// appeared after the watch began may hold entries made before its
    /// own watch was added).
    fn add_tree(&mut self, dir: &Path, report: bool) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if report {
                self.queue_event(&p, WatchEventKind::Create);
            }
            if e.file_type().is_ok_and(|t| t.is_dir())
                && self.dirs.len() < MAX_DIRS
                && self.add_dir(&p).is_ok()
            {
                self.add_tree(&p, report);
            }
        }
    }

    fn queue_event(&self, full: &Path, kind: WatchEventKind) {
        let rel = full.strip_prefix(&self.root).unwrap_or(full);
        let mut event = WatchEvent {
            name: rel.to_string_lossy().into_owned(),
            kind,
            path: None,
            entry: None,
            target: None,
        };
        // As envd: only what still names the entry carries it (a removed
        // or renamed-away path may already hold another).
        let carries = matches!(
            kind,
            WatchEventKind::Create | WatchEventKind::Write | WatchEventKind::Chmod
        );
        if self.include_entry && carries {
            let path = full.to_string_lossy().into_owned();
            let stat = |follow_symlinks| {
                crate::files::stat(&StatRequest {
                    path: path.clone(),
                    follow_symlinks,
                })
                .ok()
                .map(Box::new)
            };
            event.entry = stat(false);
            if event
                .entry
                .as_ref()
                .is_some_and(|e| e.kind == FileKind::Symlink)
            {
                event.target = stat(true);
            }
            event.path = Some(path);
        }
        self.queue.locked().push(event);
    }

    /// Reads until `stop` is readable (or the fd fails).
    fn run(mut self, stop: OwnedFd) {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: self.fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: stop.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds, their count given.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n < 0 {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return;
            }
            if fds[1].revents != 0 {
                return;
            }
            if fds[0].revents & libc::POLLIN != 0 {
                self.read_events(&mut buf);
            } else if fds[0].revents != 0 {
                return;
            }
        }
    }

    fn read_events(&mut self, buf: &mut [u8]) {
        loop {
            // SAFETY: reads into a buffer of the given length.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return;
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
                self.one(&ev, name);
            }
        }
    }

    fn one(&mut self, ev: &libc::inotify_event, name: &[u8]) {
        if ev.mask & libc::IN_Q_OVERFLOW != 0 {
            self.queue.locked().overflow = true;
            return;
        }
        let Some(dir) = self.dirs.get(&ev.wd).cloned() else {
            return;
        };
        if ev.mask & libc::IN_IGNORED != 0 {
            self.dirs.remove(&ev.wd);
            return;
        }
        let full = if name.is_empty() {
            dir
        } else {
            dir.join(std::ffi::OsStr::from_bytes(name))
        };
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
            return;
        };
        self.queue_event(&full, kind);
        if self.recursive
            && ev.mask & libc::IN_ISDIR != 0
            && ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0
            && self.add_dir(&full).is_ok()
        {
            self.add_tree(&full, true);
        }
    }
}

/// A watch: its queue and its thread.
#[derive(Debug)]
struct Watch {
    queue: Arc<Mutex<Queue>>,
    /// Writing to (or closing) this ends the thread.
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    fn drain(&self) -> WatchEvents {
        let mut q = self.queue.locked();
        let take = q.events.len().min(MAX_EVENTS);
        WatchEvents {
            events: q.events.drain(..take).collect(),
            overflow: std::mem::take(&mut q.overflow),
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Closing the pipe's write end wakes the thread's poll.
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn pipe() -> Result<(OwnedFd, OwnedFd), ErrorReply> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(ErrorReply::io("pipe2", &std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 succeeded; both fds are ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
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
        if !req.allow_network_mounts {
            if let Some(fs) = network_filesystem(&root)? {
                return Err(ErrorReply::new(
                    libc::EREMOTE,
                    format!(
                        "{} is on a network filesystem ({fs}), where events may be late or \
                         never come: ask for allow_network_mounts to watch it anyway",
                        req.path
                    ),
                ));
            }
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
        let queue = Arc::new(Mutex::new(Queue::default()));
        let mut reader = Reader {
            // SAFETY: inotify_init1 succeeded; the fd is ours alone.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            root: root.clone(),
            recursive: req.recursive,
            include_entry: req.include_entry,
            dirs: HashMap::new(),
            queue: Arc::clone(&queue),
        };
        reader
            .add_dir(&root)
            .map_err(|e| ErrorReply::io(&req.path, &e))?;
        if req.recursive {
            reader.add_tree(&root, false);
        }
        let (stop_rx, stop_tx) = pipe()?;
        let thread = std::thread::Builder::new()
            .name("watch".into())
            .spawn(move || reader.run(stop_rx))
            .map_err(|e| ErrorReply::io("a watch thread", &e))?;
        let watch = Watch {
            queue,
            stop: Some(stop_tx),
            thread: Some(thread),
        };
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        map.insert(id, watch);
        Ok(id)
    }

    /// `watch_events`: what happened since the last call.
    pub fn events(&self, id: u64) -> Result<WatchEvents, ErrorReply> {
        let map = self.map.locked();
        let watch = map.get(&id).ok_or_else(|| no_watch(id))?;
        Ok(watch.drain())
    }

    /// `watch_remove`.
    pub fn remove(&self, id: u64) -> Result<(), ErrorReply> {
        // Taken out under the lock, joined (dropped) after it.
        let watch = self.map.locked().remove(&id).ok_or_else(|| no_watch(id))?;
        drop(watch);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_local_directory_is_no_network_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(network_filesystem(dir.path()).unwrap(), None);
        assert!(network_filesystem(Path::new("/no/such/dir")).is_err());
    }

    #[test]
    fn older_peers_leave_network_mounts_refused() {
        let req: WatchAddRequest =
            serde_json::from_str(r#"{"path": "/tmp", "recursive": true}"#).unwrap();
        assert!(!req.allow_network_mounts && !req.include_entry);
    }
}
