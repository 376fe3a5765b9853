//! Messages added in protocol 1.1 (see `PROTOCOL.md`): processes that
//! outlive a connection (`spawn`, `attach`, `processes`, `signal`, `input`,
//! `close_stdin`, `resize`), directory changes (`mkdir`, `remove`,
//! `rename`) and directory watches (`watch_add`, `watch_events`,
//! `watch_remove`). Re-exported by [`crate::proto`].

use crate::b64;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A terminal size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    /// Columns (1..=4096).
    pub cols: u16,
    /// Rows (1..=4096).
    pub rows: u16,
}

/// `spawn` request: like `exec`, but the process belongs to the agent, not
/// to the connection; its output is kept (bounded) for `attach`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SpawnRequest {
    /// Program and arguments (`argv[0]` looked up in `PATH` unless it has a `/`).
    pub argv: Vec<String>,
    /// Variables set on top of the agent's environment (and the user's
    /// `HOME`, `USER`, `LOGNAME`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory. Absent: the user's home when it exists, else `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Run as this user (`/etc/passwd` name). Absent: the agent's user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Run on a new pseudo-terminal of this size (stdin, stdout and stderr
    /// are its slave side; output comes as `pty` chunks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// Keep stdin open for `input` (a pipe). False: `/dev/null`.
    #[serde(default)]
    pub stdin: bool,
    /// A free-form tag (at most 256 bytes), listed with the process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// `spawned` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spawned {
    /// The process id (its process group and session id too).
    pub pid: u32,
}

/// `attach` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttachRequest {
    /// A spawned process.
    pub pid: u32,
    /// Start with the output the agent still keeps (since the spawn, at
    /// most the retention cap) instead of what comes from now on.
    #[serde(default)]
    pub replay: bool,
    /// Send `keepalive` after this long without output (default 10 000,
    /// at least 100): an attach to a dead connection ends at the next one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keepalive_ms: Option<u64>,
}

/// A request naming one spawned process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PidRequest {
    /// The process.
    pub pid: u32,
}

/// `signal` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignalRequest {
    /// The process (its whole process group gets the signal).
    pub pid: u32,
    /// Signal number (1..=64).
    pub signal: i32,
}

/// `input` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputRequest {
    /// The process.
    pub pid: u32,
    /// Bytes (base64) for its stdin pipe, or its PTY when it has one.
    #[serde(with = "b64")]
    pub data: Vec<u8>,
}

/// `resize` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResizeRequest {
    /// The process (started with a PTY).
    pub pid: u32,
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
}

/// A spawned process, as `processes` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// Its pid.
    pub pid: u32,
    /// Its argv.
    pub argv: Vec<String>,
    /// The environment the request set.
    pub env: BTreeMap<String, String>,
    /// Its working directory.
    pub cwd: String,
    /// The user it runs as, when the request named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Its tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Whether it runs on a PTY.
    pub pty: bool,
}

/// `process_list` reply: running spawned processes, by pid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessList {
    /// The processes.
    pub processes: Vec<ProcessInfo>,
}

/// `mkdir` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MkdirRequest {
    /// Absolute path.
    pub path: String,
    /// Create missing parents too (all 0o755).
    #[serde(default)]
    pub parents: bool,
    /// Give the directories this request creates to this user (and its
    /// primary group); checked before anything is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// `rename` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RenameRequest {
    /// Absolute source path.
    pub from: String,
    /// Absolute destination path (replaced when it is a file).
    pub to: String,
}

/// `watch_add` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchAddRequest {
    /// Absolute path of a directory.
    pub path: String,
    /// Watch its subdirectories too (those created later as well).
    #[serde(default)]
    pub recursive: bool,
    /// 1.2: events of what is there after them (`create`, `write`,
    /// `chmod`) carry its stat, taken when the event is read.
    #[serde(default)]
    pub include_entry: bool,
    /// 1.4: watch a directory on a network filesystem (NFS, CIFS/SMB,
    /// FUSE, ...), which is refused (`EREMOTE`) without it: events there
    /// may be late or never come.
    #[serde(default)]
    pub allow_network_mounts: bool,
}

/// A request naming one watch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchIdRequest {
    /// The watch.
    pub watch_id: u64,
}

/// `watch` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchId {
    /// Names the watch in `watch_events` and `watch_remove`.
    pub watch_id: u64,
}

/// What happened to a watched path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchEventKind {
    /// Created, or moved into the directory.
    Create,
    /// Written.
    Write,
    /// Deleted.
    Remove,
    /// Moved away.
    Rename,
    /// Permissions, owner or times changed.
    Chmod,
}

/// One change under a watched directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// The path relative to the watched directory (lossy UTF-8).
    pub name: String,
    /// What happened.
    pub kind: WatchEventKind,
    /// 1.2 (`include_entry`): the absolute path, with its stat (not
    /// followed) and, for a symlink, its target's when it resolves;
    /// absent when the path was gone by the time the event was read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry: Option<Box<crate::proto_stat::FileStat>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<Box<crate::proto_stat::FileStat>>,
}

/// `watch_events` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WatchEvents {
    /// The events since the last call, oldest first.
    pub events: Vec<WatchEvent>,
    /// Events were lost (the kernel's queue or the agent's cap overflowed).
    pub overflow: bool,
}
