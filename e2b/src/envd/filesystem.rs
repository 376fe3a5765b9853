//! `filesystem.Filesystem`: E2B's file operations on the agent's `stat`,
//! `list_dir`, `mkdir`, `remove`, `rename` and inotify watches (protocol
//! 1.1; 1.2 for entries as envd makes them: the whole `st_mode`, resolved
//! symlinks, metadata, and watch events with entries). Relative paths are
//! under the request user's home. Operations run as the agent's user (root
//! in torpor's images); the directories `MakeDir` creates are then given
//! to the request's user.
//!
//! Every watch reads its events on a thread of its own in the agent;
//! `WatchDir` asks for them every [`WATCH_POLL`] and streams them; its
//! watch is removed when the stream ends. `ListDir` with a depth lists at
//! most [`MAX_LIST_ENTRIES`] entries.

use std::time::{Duration, Instant};

use serde_json::Value;
use torpor_agent::proto::{FileKind, FileStat, WatchEventKind};
use torpor_agent::{AgentClient, ClientError};
use torpor_scheduler::model::Timestamp;
use torpor_scheduler::service::guest::{AgentLink, GuestStream};

use super::envelope::ConnectError;
use super::files::{resolve, DEFAULT_USER};
use super::json::{
    CreateWatcherResponse, Empty, EntryInfo, EntryResponse, FilesystemEvent, ListDirRequest,
    ListDirResponse, MoveRequest, PathRequest, WatchDirResponse, WatchEvent, WatchRequest,
    WatcherEventsResponse, WatcherRequest,
};
use super::rpc::{guest_error, invalid, parse, unknown_user, CallContext, StreamTx};
use super::Code;
use crate::time;

/// Most entries one `ListDir` answers.
pub const MAX_LIST_ENTRIES: usize = 50_000;
/// Deepest `ListDir`.
pub const MAX_DEPTH: u32 = 32;
/// How often `WatchDir` asks the agent for events.
pub const WATCH_POLL: Duration = Duration::from_millis(200);

type Client = AgentClient<GuestStream>;

fn connect(link: &AgentLink) -> Result<Client, ConnectError> {
    link.connect(Some(link.file_limit)).map_err(guest_error)
}

fn call_err(link: &AgentLink, e: ClientError) -> ConnectError {
    guest_error(link.error(e, Some(link.file_limit)))
}

fn path_of(ctx: &CallContext, path: &str) -> Result<String, ConnectError> {
    resolve(path, ctx.user.as_deref()).map_err(|e| invalid(e.message))
}

fn to_value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or_default()
}

fn kind_name(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

/// The whole `st_mode` of an entry: the agent's (1.2), else made from
/// its kind and permission bits (an older agent).
fn st_mode(st: &FileStat) -> u32 {
    st.st_mode.unwrap_or_else(|| {
        let kind = match st.kind {
            FileKind::Dir => libc::S_IFDIR,
            FileKind::Symlink => libc::S_IFLNK,
            FileKind::File => libc::S_IFREG,
            FileKind::Other => 0,
        };
        kind | (st.mode & 0o7777)
    })
}

/// `st_mode` as Go's `FileMode.String()` writes it (envd's
/// `permissions`): the type and special letters in Go's order
/// (`dalTLDpSugct?`, those Linux has), or `-` for none, then `rwxrwxrwx`.
pub fn permissions(st_mode: u32) -> String {
    let mut s = String::with_capacity(12);
    let fmt = st_mode & libc::S_IFMT;
    let letters = [
        ('d', fmt == libc::S_IFDIR),
        ('L', fmt == libc::S_IFLNK),
        ('D', fmt == libc::S_IFBLK || fmt == libc::S_IFCHR),
        ('p', fmt == libc::S_IFIFO),
        ('S', fmt == libc::S_IFSOCK),
        ('u', st_mode & libc::S_ISUID != 0),
        ('g', st_mode & libc::S_ISGID != 0),
        ('c', fmt == libc::S_IFCHR),
        ('t', st_mode & libc::S_ISVTX != 0),
    ];
    for (c, set) in letters {
        if set {
            s.push(c);
        }
    }
    if s.is_empty() {
        s.push('-');
    }
    for shift in [6, 3, 0] {
        let bits = (st_mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// envd's entry for `path`, as its `GetEntryInfo` makes it: `link` is the
/// path's own stat (not followed), `target` the followed one for a
/// symlink, when it resolves. Name, size, permissions, owner, group and
/// time are the path's own; a symlink's `type` and `mode` are its
/// target's (`FILE_TYPE_UNSPECIFIED` and 0 when it does not resolve), its
/// `symlinkTarget` the path with every link resolved (the path itself when
/// it does not resolve), and `isSymlink` marks it. `mode` has the
/// permission bits only. An owner or group without a name is its number.
pub fn entry(path: &str, link: &FileStat, target: Option<&FileStat>) -> EntryInfo {
    let is_symlink = link.kind == FileKind::Symlink;
    let (kind, mode) = if is_symlink {
        target.map_or(("FILE_TYPE_UNSPECIFIED", 0), |t| {
            (kind_name(t.kind), t.mode & 0o777)
        })
    } else {
        (kind_name(link.kind), link.mode & 0o777)
    };
    let symlink_target = is_symlink.then(|| match (&link.resolved, link.st_mode) {
        (Some(resolved), _) => resolved.clone(),
        // An agent of 1.2 resolves what resolves: this does not.
        (None, Some(_)) => path.to_string(),
        // An older agent: the link's text.
        (None, None) => link.link_target.clone().unwrap_or_else(|| path.to_string()),
    });
    let name = path
        .rsplit('/')
        .find(|s| !s.is_empty())
        .unwrap_or("/")
        .to_string();
    let id_name = |name: &Option<String>, id: Option<u32>| {
        name.clone()
            .or_else(|| id.map(|i| i.to_string()))
            .unwrap_or_default()
    };
    EntryInfo {
        name,
        kind,
        path: path.to_string(),
        size: link.size.to_string(),
        mode,
        permissions: permissions(st_mode(link)),
        owner: id_name(&link.owner, link.uid),
        group: id_name(&link.group, link.gid),
        modified_time: time::format(Timestamp(link.mtime_ns.div_euclid(1_000_000))),
        symlink_target,
        metadata: link.metadata.clone(),
        is_symlink,
    }
}

/// The entry of `path`, following a symlink for its type.
fn entry_of(link: &AgentLink, client: &mut Client, path: &str) -> Result<EntryInfo, ConnectError> {
    let own = client.stat(path, false).map_err(|e| call_err(link, e))?;
    let target = if own.kind == FileKind::Symlink {
        client.stat(path, true).ok()
    } else {
        None
    };
    Ok(entry(path, &own, target.as_ref()))
}

fn join(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// `Stat`.
pub fn stat(link: &AgentLink, ctx: &CallContext, message: &[u8]) -> Result<Value, ConnectError> {
    let req: PathRequest = parse(message)?;
    let path = path_of(ctx, &req.path)?;
    let mut client = connect(link)?;
    let entry = entry_of(link, &mut client, &path)?;
    Ok(to_value(&EntryResponse { entry }))
}

/// `ListDir`: `depth` levels (0 means 1) walked depth first in name
/// order, each directory's entries before the next one's, as Go's
/// `filepath.WalkDir` in envd; symlinks are not descended. A symlink to a
/// directory lists the directory, under the path asked for.
pub fn list_dir(
    link: &AgentLink,
    ctx: &CallContext,
    message: &[u8],
) -> Result<Value, ConnectError> {
    let req: ListDirRequest = parse(message)?;
    let depth = req.depth.max(1);
    if depth > MAX_DEPTH {
        return Err(invalid(format!("depth {depth} is over {MAX_DEPTH}")));
    }
    let root = path_of(ctx, &req.path)?;
    let mut client = connect(link)?;
    let mut entries = Vec::new();
    walk(link, &mut client, &root, depth, &mut entries)?;
    Ok(to_value(&ListDirResponse { entries }))
}

/// Appends `dir`'s entries, each directory followed by its own down to
/// `levels` levels.
fn walk(
    link: &AgentLink,
    client: &mut Client,
    dir: &str,
    levels: u32,
    entries: &mut Vec<EntryInfo>,
) -> Result<(), ConnectError> {
    let listing = client.list_dir(dir).map_err(|e| call_err(link, e))?;
    for st in listing.entries {
        let path = join(dir, &st.name);
        let target = if st.kind == FileKind::Symlink {
            client.stat(&path, true).ok()
        } else {
            None
        };
        entries.push(entry(&path, &st, target.as_ref()));
        if entries.len() > MAX_LIST_ENTRIES {
            return Err(ConnectError {
                code: Code::ResourceExhausted,
                message: format!("more than {MAX_LIST_ENTRIES} entries: list a smaller depth"),
            });
        }
        if st.kind == FileKind::Dir && levels > 1 {
            match walk(link, client, &path, levels - 1, entries) {
                // Gone since it was listed: skipped, as envd skips it.
                Err(e) if e.code == Code::NotFound => {}
                other => other?,
            }
        }
    }
    Ok(())
}

/// `MakeDir`: with missing parents; `already_exists` when it exists. The
/// directories it creates belong to the request's user (`user` by
/// default; the agent's own when the guest has no `user`).
pub fn make_dir(
    link: &AgentLink,
    ctx: &CallContext,
    message: &[u8],
) -> Result<Value, ConnectError> {
    let req: PathRequest = parse(message)?;
    let path = path_of(ctx, &req.path)?;
    let mut client = connect(link)?;
    if client.stat(&path, false).is_ok() {
        return Err(ConnectError {
            code: Code::AlreadyExists,
            message: format!("{path} already exists"),
        });
    }
    mkdir_for(link, &mut client, ctx, &path)?;
    let entry = entry_of(link, &mut client, &path)?;
    Ok(to_value(&EntryResponse { entry }))
}

/// Makes `path` with its missing parents, the new directories the
/// request's user's (`user` by default; the agent's own when the guest
/// has no `user`), as envd's `MakeDir` and `Move` do.
fn mkdir_for(
    link: &AgentLink,
    client: &mut Client,
    ctx: &CallContext,
    path: &str,
) -> Result<(), ConnectError> {
    let owner = ctx.user.as_deref().unwrap_or(DEFAULT_USER);
    match client.mkdir_as(path, true, Some(owner)) {
        Ok(_) => Ok(()),
        Err(ClientError::Agent(e)) if ctx.user.is_none() && unknown_user(&e) => client
            .mkdir(path, true)
            .map(drop)
            .map_err(|e| call_err(link, e)),
        Err(e) => Err(call_err(link, e)),
    }
}

/// `Remove`: a file, a link or a whole directory; nothing there is no
/// error (envd removes with Go's `os.RemoveAll`).
pub fn remove(link: &AgentLink, ctx: &CallContext, message: &[u8]) -> Result<Value, ConnectError> {
    let req: PathRequest = parse(message)?;
    let path = path_of(ctx, &req.path)?;
    match connect(link)?.remove(&path) {
        Ok(()) => {}
        Err(ClientError::Agent(e)) if e.code == "ENOENT" => {}
        Err(e) => return Err(call_err(link, e)),
    }
    Ok(Value::Object(Default::default()))
}

/// `Move`: a rename within the guest's filesystem; the destination's
/// missing parent directories are made first, the request's user's (as
/// envd's `EnsureDirs`).
pub fn rename(link: &AgentLink, ctx: &CallContext, message: &[u8]) -> Result<Value, ConnectError> {
    let req: MoveRequest = parse(message)?;
    let from = path_of(ctx, &req.source)?;
    let to = path_of(ctx, &req.destination)?;
    let mut client = connect(link)?;
    if let Some(parent) = std::path::Path::new(&to).parent().and_then(|p| p.to_str()) {
        if client.stat(parent, false).is_err() {
            mkdir_for(link, &mut client, ctx, parent)?;
        }
    }
    client.rename(&from, &to).map_err(|e| call_err(link, e))?;
    let entry = entry_of(link, &mut client, &to)?;
    Ok(to_value(&EntryResponse { entry }))
}

fn event_name(kind: WatchEventKind) -> &'static str {
    match kind {
        WatchEventKind::Create => "EVENT_TYPE_CREATE",
        WatchEventKind::Write => "EVENT_TYPE_WRITE",
        WatchEventKind::Remove => "EVENT_TYPE_REMOVE",
        WatchEventKind::Rename => "EVENT_TYPE_RENAME",
        WatchEventKind::Chmod => "EVENT_TYPE_CHMOD",
    }
}

/// The agent's events as envd's, with the entries the agent took when it
/// read them (a watch added with `include_entry`).
fn events(
    link: &AgentLink,
    client: &mut Client,
    id: u64,
) -> Result<Vec<FilesystemEvent>, ConnectError> {
    let got = client.watch_events(id).map_err(|e| call_err(link, e))?;
    Ok(got
        .events
        .into_iter()
        .map(|e| {
            let entry = match (&e.path, &e.entry) {
                (Some(path), Some(st)) => Some(entry(path, st, e.target.as_deref())),
                _ => None,
            };
            FilesystemEvent {
                name: e.name,
                kind: event_name(e.kind),
                entry,
            }
        })
        .collect())
}

fn watch_id(text: &str) -> Result<u64, ConnectError> {
    text.parse().map_err(|_| ConnectError {
        code: Code::NotFound,
        message: format!("no watcher {text:?}"),
    })
}

/// `CreateWatcher`.
pub fn create_watcher(
    link: &AgentLink,
    ctx: &CallContext,
    message: &[u8],
) -> Result<Value, ConnectError> {
    let req: WatchRequest = parse(message)?;
    let path = path_of(ctx, &req.path)?;
    let id = connect(link)?
        .watch_add_with(req.to_agent(path))
        .map_err(|e| call_err(link, e))?;
    Ok(to_value(&CreateWatcherResponse {
        watcher_id: id.to_string(),
    }))
}

/// `GetWatcherEvents`: what happened since the last call.
pub fn watcher_events(
    link: &AgentLink,
    _ctx: &CallContext,
    message: &[u8],
) -> Result<Value, ConnectError> {
    let req: WatcherRequest = parse(message)?;
    let id = watch_id(&req.watcher_id)?;
    let mut client = connect(link)?;
    let events = events(link, &mut client, id)?;
    Ok(to_value(&WatcherEventsResponse { events }))
}

/// `RemoveWatcher`.
pub fn remove_watcher(
    link: &AgentLink,
    _ctx: &CallContext,
    message: &[u8],
) -> Result<Value, ConnectError> {
    let req: WatcherRequest = parse(message)?;
    let id = watch_id(&req.watcher_id)?;
    connect(link)?
        .watch_remove(id)
        .map_err(|e| call_err(link, e))?;
    Ok(Value::Object(Default::default()))
}

/// `WatchDir` (server stream): a start event, then the events as they
/// come, keepalives in between.
pub fn watch_dir(
    link: &AgentLink,
    ctx: &CallContext,
    message: &[u8],
    out: &StreamTx,
) -> Result<(), ConnectError> {
    let req: WatchRequest = parse(message)?;
    let root = path_of(ctx, &req.path)?;
    // No overall deadline: each poll's answer within the file limit.
    let mut client = link.connect_idle(link.file_limit).map_err(guest_error)?;
    let id = client
        .watch_add_with(req.to_agent(root))
        .map_err(|e| call_err(link, e))?;
    let result = watch_loop(link, &mut client, ctx, id, out);
    let _ = client.watch_remove(id);
    result
}

fn watch_loop(
    link: &AgentLink,
    client: &mut Client,
    ctx: &CallContext,
    id: u64,
    out: &StreamTx,
) -> Result<(), ConnectError> {
    let send = |e: WatchEvent| out.send(&WatchDirResponse { event: e });
    if !send(WatchEvent::Start(Empty {})) {
        return Ok(());
    }
    let mut quiet_since = Instant::now();
    loop {
        std::thread::sleep(WATCH_POLL);
        if out.closed() {
            return Ok(());
        }
        if ctx.expired() {
            return Err(ConnectError {
                code: Code::DeadlineExceeded,
                message: "the call's timeout passed".into(),
            });
        }
        let evs = events(link, client, id)?;
        if evs.is_empty() {
            if quiet_since.elapsed() >= ctx.keepalive {
                if !send(WatchEvent::Keepalive(Empty {})) {
                    return Ok(());
                }
                quiet_since = Instant::now();
            }
            continue;
        }
        for e in evs {
            if !send(WatchEvent::Filesystem(Box::new(e))) {
                return Ok(());
            }
        }
        quiet_since = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissions_read_as_go_writes_them() {
        assert_eq!(permissions(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(permissions(libc::S_IFDIR | 0o755), "drwxr-xr-x");
        assert_eq!(permissions(libc::S_IFLNK | 0o777), "Lrwxrwxrwx");
        assert_eq!(permissions(libc::S_IFREG | 0o4755), "urwxr-xr-x");
        assert_eq!(permissions(libc::S_IFDIR | 0o2775), "dgrwxrwxr-x");
        assert_eq!(permissions(libc::S_IFDIR | 0o1777), "dtrwxrwxrwx");
        assert_eq!(permissions(libc::S_IFCHR | 0o666), "Dcrw-rw-rw-");
        assert_eq!(permissions(libc::S_IFBLK | 0o660), "Drw-rw----");
        assert_eq!(permissions(libc::S_IFIFO | 0o600), "prw-------");
        assert_eq!(permissions(libc::S_IFSOCK | 0o777), "Srwxrwxrwx");
    }

    fn stat(kind: FileKind, st_mode: u32, size: u64) -> FileStat {
        FileStat {
            name: String::new(),
            kind,
            size,
            mode: st_mode & 0o7777,
            mtime_ns: 1_500_000_000,
            link_target: None,
            uid: Some(4242),
            gid: Some(0),
            owner: None,
            group: Some("root".into()),
            st_mode: Some(st_mode),
            resolved: None,
            metadata: Default::default(),
        }
    }

    #[test]
    fn entries_are_envds() {
        let f = entry(
            "/d/f",
            &stat(FileKind::File, libc::S_IFREG | 0o4755, 5),
            None,
        );
        assert_eq!(
            (f.kind, f.mode, f.permissions.as_str()),
            ("FILE_TYPE_FILE", 0o755, "urwxr-xr-x")
        );
        assert_eq!(
            (f.owner.as_str(), f.group.as_str(), f.size.as_str()),
            ("4242", "root", "5")
        );
        assert_eq!(f.symlink_target, None);
        // A symlink: its own size and permissions, its target's type and
        // mode, the target resolved.
        let mut l = stat(FileKind::Symlink, libc::S_IFLNK | 0o777, 10);
        l.link_target = Some("target.txt".into());
        l.resolved = Some("/real/d/target.txt".into());
        let t = stat(FileKind::File, libc::S_IFREG | 0o640, 5);
        let e = entry("/d/link", &l, Some(&t));
        assert_eq!(
            (e.kind, e.mode, e.permissions.as_str()),
            ("FILE_TYPE_FILE", 0o640, "Lrwxrwxrwx")
        );
        assert_eq!((e.size.as_str(), e.is_symlink), ("10", true));
        assert_eq!(e.symlink_target.as_deref(), Some("/real/d/target.txt"));
        // Broken: no type, the path itself as its target.
        l.resolved = None;
        let b = entry("/d/broken", &l, None);
        assert_eq!((b.kind, b.mode), ("FILE_TYPE_UNSPECIFIED", 0));
        assert_eq!(b.symlink_target.as_deref(), Some("/d/broken"));
    }
}
