//! `filesystem.Filesystem`: E2B's file operations on the agent's `stat`,
//! `list_dir`, `mkdir`, `remove`, `rename` and inotify watches (protocol
//! 1.1). Relative paths are under the request user's home. Operations run
//! as the agent's user (root in torpor's images); the directories
//! `MakeDir` creates are then given to the request's user.
//!
//! `WatchDir` polls the agent's watch every [`WATCH_POLL`] and streams
//! what it collected; the watch is removed when the stream ends.
//! `ListDir` with a depth lists at most [`MAX_LIST_ENTRIES`] entries.

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
use crate::e2b::time;

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

/// `-rw-r--r--` as Go's `FileMode.String()` writes it (envd's format).
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// envd's entry for `path`: `link` is the path's own stat (not followed);
/// `target` the followed one for a symlink, when it resolves.
pub fn entry(path: &str, link: &FileStat, target: Option<&FileStat>) -> EntryInfo {
    let is_symlink = link.kind == FileKind::Symlink;
    let shown = if is_symlink {
        target.unwrap_or(link)
    } else {
        link
    };
    let name = path
        .rsplit('/')
        .find(|s| !s.is_empty())
        .unwrap_or("/")
        .to_string();
    EntryInfo {
        name,
        kind: kind_name(shown.kind),
        path: path.to_string(),
        size: shown.size.to_string(),
        mode: shown.mode & 0o777,
        permissions: permissions(shown.kind, shown.mode),
        owner: link.owner.clone().unwrap_or_default(),
        group: link.group.clone().unwrap_or_default(),
        modified_time: time::format(Timestamp(link.mtime_ns.div_euclid(1_000_000))),
        symlink_target: link.link_target.clone(),
        metadata: Default::default(),
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

/// `ListDir`: `depth` levels (0 means 1), directories first visited
/// breadth-first, symlinks not descended.
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
    let mut level = vec![root];
    for _ in 0..depth {
        let mut next = Vec::new();
        for dir in level {
            let listing = client.list_dir(&dir).map_err(|e| call_err(link, e))?;
            for st in listing.entries {
                let path = join(&dir, &st.name);
                let target = if st.kind == FileKind::Symlink {
                    client.stat(&path, true).ok()
                } else {
                    None
                };
                if st.kind == FileKind::Dir {
                    next.push(path.clone());
                }
                entries.push(entry(&path, &st, target.as_ref()));
                if entries.len() > MAX_LIST_ENTRIES {
                    return Err(ConnectError {
                        code: Code::ResourceExhausted,
                        message: format!(
                            "more than {MAX_LIST_ENTRIES} entries: list a smaller depth"
                        ),
                    });
                }
            }
        }
        level = next;
    }
    Ok(to_value(&ListDirResponse { entries }))
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
    let owner = ctx.user.as_deref().unwrap_or(DEFAULT_USER);
    match client.mkdir_as(&path, true, Some(owner)) {
        Ok(_) => {}
        Err(ClientError::Agent(e)) if ctx.user.is_none() && unknown_user(&e) => {
            client.mkdir(&path, true).map_err(|e| call_err(link, e))?;
        }
        Err(e) => return Err(call_err(link, e)),
    }
    let entry = entry_of(link, &mut client, &path)?;
    Ok(to_value(&EntryResponse { entry }))
}

/// `Remove`: a file, a link or a whole directory.
pub fn remove(link: &AgentLink, ctx: &CallContext, message: &[u8]) -> Result<Value, ConnectError> {
    let req: PathRequest = parse(message)?;
    let path = path_of(ctx, &req.path)?;
    connect(link)?
        .remove(&path)
        .map_err(|e| call_err(link, e))?;
    Ok(Value::Object(Default::default()))
}

/// `Move`: a rename within the guest's filesystem.
pub fn rename(link: &AgentLink, ctx: &CallContext, message: &[u8]) -> Result<Value, ConnectError> {
    let req: MoveRequest = parse(message)?;
    let from = path_of(ctx, &req.source)?;
    let to = path_of(ctx, &req.destination)?;
    let mut client = connect(link)?;
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

/// The agent's events as envd's, with entries when asked (and the path
/// still exists).
fn events(
    link: &AgentLink,
    client: &mut Client,
    root: &str,
    id: u64,
    include_entry: bool,
) -> Result<Vec<FilesystemEvent>, ConnectError> {
    let got = client.watch_events(id).map_err(|e| call_err(link, e))?;
    let mut out = Vec::with_capacity(got.events.len());
    for e in got.events {
        let entry = if include_entry && e.kind != WatchEventKind::Remove {
            entry_of(link, client, &join(root, &e.name)).ok()
        } else {
            None
        };
        out.push(FilesystemEvent {
            name: e.name,
            kind: event_name(e.kind),
            entry,
        });
    }
    Ok(out)
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
        .watch_add(&path, req.recursive)
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
    let events = events(link, &mut client, "", id, false)?;
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
        .watch_add(&root, req.recursive)
        .map_err(|e| call_err(link, e))?;
    let result = watch_loop(link, &mut client, ctx, &root, id, req.include_entry, out);
    let _ = client.watch_remove(id);
    result
}

fn watch_loop(
    link: &AgentLink,
    client: &mut Client,
    ctx: &CallContext,
    root: &str,
    id: u64,
    include_entry: bool,
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
        let evs = events(link, client, root, id, include_entry)?;
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
        assert_eq!(permissions(FileKind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::Symlink, 0o777), "Lrwxrwxrwx");
    }
}
