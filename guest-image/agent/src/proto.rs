//! Protocol messages (see `PROTOCOL.md`). Host → agent: [`Request`]
//! (`{"id":N,"op":"…",…}`); agent → host: [`Reply`] (`{"id":N,"type":"…",…}`).
//! Unknown fields are ignored, so minor versions may add optional fields.

use crate::b64;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::io;

/// A protocol version. Peers must agree on `major`; `minor` only adds
/// optional fields and operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProtocolVersion {
    /// Incompatible changes bump this.
    pub major: u32,
    /// Compatible additions bump this.
    pub minor: u32,
}

impl fmt::Display for ProtocolVersion {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The version this crate speaks.
pub const PROTOCOL_VERSION: ProtocolVersion = ProtocolVersion { major: 1, minor: 5 };

/// This crate's version (the agent's version).
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// A host → agent message. `id` is chosen by the host and echoed in every
/// reply frame belonging to the request; ids of in-flight execs must differ.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Request id.
    pub id: u64,
    /// What to do.
    #[serde(flatten)]
    pub op: Op,
}

/// Every operation name, for telling "unknown op" from "bad arguments".
pub const KNOWN_OPS: &[&str] = &[
    "hello",
    "ping",
    "info",
    "exec",
    "read_file",
    "write_file",
    "list_dir",
    "stat",
    "resumed",
    // 1.1
    "spawn",
    "attach",
    "processes",
    "signal",
    "input",
    "close_stdin",
    "resize",
    "mkdir",
    "remove",
    "rename",
    "watch_add",
    "watch_events",
    "watch_remove",
    // 1.2
    "set_metadata",
    // 1.3
    "connect",
    // 1.4
    "statfs",
    // 1.5
    "mount_volumes",
];

/// The operations (`"op"` field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Version handshake; must be the first request. → `hello`
    Hello(Hello),
    /// Liveness. → `pong`
    Ping,
    /// Agent and guest facts. → `info`
    Info,
    /// Run a process. → `stdout`/`stderr` chunks, then `exit` (or `error`).
    Exec(ExecRequest),
    /// Read part of a file. → `file_data`
    ReadFile(ReadFileRequest),
    /// Write or append to a file. → `written`
    WriteFile(WriteFileRequest),
    /// List a directory. → `dir_entries`
    ListDir(PathRequest),
    /// Stat a path. → `stat`
    Stat(StatRequest),
    /// After a snapshot restore: clock, entropy, hostname, identity. → `resumed`
    Resumed(ResumedRequest),
    /// 1.1: start a process that outlives the connection. → `spawned`
    Spawn(SpawnRequest),
    /// 1.1: follow a spawned process's output. → `stdout`/`stderr`/`pty`
    /// chunks and `keepalive`s, then `exit`.
    Attach(AttachRequest),
    /// 1.1: the spawned processes still running. → `process_list`
    Processes,
    /// 1.1: signal a spawned process's group. → `done`
    Signal(SignalRequest),
    /// 1.1: bytes to a spawned process's stdin (or its PTY). → `done`
    Input(InputRequest),
    /// 1.1: close a spawned process's stdin. → `done`
    CloseStdin(PidRequest),
    /// 1.1: resize a spawned process's PTY. → `done`
    Resize(ResizeRequest),
    /// 1.1: create a directory. → `stat`
    Mkdir(MkdirRequest),
    /// 1.1: remove a file or a directory tree. → `done`
    Remove(PathRequest),
    /// 1.1: rename (move) a path. → `stat` (of the destination)
    Rename(RenameRequest),
    /// 1.1: watch a directory (inotify). → `watch`
    WatchAdd(WatchAddRequest),
    /// 1.1: the events a watch collected since the last call. → `watch_events`
    WatchEvents(WatchIdRequest),
    /// 1.1: stop a watch. → `done`
    WatchRemove(WatchIdRequest),
    /// 1.2: replace a file's user metadata (`user.e2b.*` xattrs). → `done`
    SetMetadata(SetMetadataRequest),
    /// 1.3: turn this connection into a byte pipe to a TCP port of the
    /// guest's loopback. → `connected`, then raw bytes both ways (no more
    /// frames); `ECONNREFUSED` when nothing listens there.
    Connect(ConnectRequest),
    /// 1.4: the size and free space of the filesystem a path is on
    /// (`statvfs`). → `statfs`
    Statfs(PathRequest),
    /// 1.5: mount volumes over NFS from the host (E2B's `volumeMounts`,
    /// `crate::volumes`). → `done`
    MountVolumes(MountVolumesRequest),
}

/// `mount_volumes` request (1.5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountVolumesRequest {
    /// The volumes; the same call again mounts only what is not mounted.
    pub mounts: Vec<VolumeMount>,
}

/// One volume at one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    /// The volume's name (the NFS export `/<name>` the host serves).
    pub name: String,
    /// Absolute path in the guest.
    pub path: String,
}

/// `connect` request (1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectRequest {
    /// The TCP port on 127.0.0.1 in the guest.
    pub port: u16,
}

/// `set_metadata` request (1.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SetMetadataRequest {
    /// Absolute path (followed if a symlink).
    pub path: String,
    /// The whole set: keys not named are removed; empty clears it.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// `hello` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// The host's protocol version.
    pub protocol: ProtocolVersion,
    /// Free-form name of the host side, for logs.
    #[serde(default)]
    pub client: String,
}

/// `exec` request.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Program and arguments; `argv[0]` is looked up in `PATH` unless it
    /// contains a `/`.
    pub argv: Vec<String>,
    /// Variables set on top of the agent's environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Start from an empty environment instead of the agent's.
    #[serde(default)]
    pub clear_env: bool,
    /// Working directory (default: the agent's, `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Bytes written to the process's stdin, which is then closed. Absent:
    /// stdin is `/dev/null`.
    #[serde(default, with = "b64::option", skip_serializing_if = "Option::is_none")]
    pub stdin: Option<Vec<u8>>,
    /// Kill the whole process group after this long. Absent or 0: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Bytes of stdout + stderr (together) forwarded at most; the rest is
    /// read and dropped and `exit.truncated` is set. Absent: 16 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
}

/// `read_file` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadFileRequest {
    /// Absolute path.
    pub path: String,
    /// Byte offset to start at.
    #[serde(default)]
    pub offset: u64,
    /// At most this many bytes (capped at [`MAX_IO_CHUNK`]; absent: the cap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

/// Largest `data` in one `read_file` reply or accepted in one `write_file`
/// (base64 grows it by 4/3, which still fits in a 16 MiB frame).
pub const MAX_IO_CHUNK: usize = 8 << 20;

/// `write_file` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteFileRequest {
    /// Absolute path.
    pub path: String,
    /// The bytes (base64).
    #[serde(with = "b64")]
    pub data: Vec<u8>,
    /// Permission bits (e.g. 420 = 0o644). Set exactly (umask ignored) when
    /// given; absent: 0o644 for new files, existing files keep theirs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    /// Create missing parent directories (mode 0o755).
    #[serde(default)]
    pub create_parents: bool,
    /// Append instead of truncating.
    #[serde(default)]
    pub append: bool,
    /// 1.4: the file, and the parent directories this request creates, go
    /// to this user and its group (an unknown user is `ENOENT` before
    /// anything is written). Absent: the agent's own user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// A request naming one path (`list_dir`, `remove`, 1.4 `statfs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathRequest {
    /// Absolute path.
    pub path: String,
}

/// `stat` request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatRequest {
    /// Absolute path.
    pub path: String,
    /// Stat the symlink's target (default) or the link itself.
    #[serde(default = "default_true")]
    pub follow_symlinks: bool,
}

fn default_true() -> bool {
    true
}

/// `resumed` request: every field is optional. When `wall_clock_ns` or
/// `seed` is absent, the agent reads the VMM's identity page for it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ResumedRequest {
    /// Host wall clock, ns since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_clock_ns: Option<u64>,
    /// Fresh random bytes (1..=512) for the kernel RNG.
    #[serde(default, with = "b64::option", skip_serializing_if = "Option::is_none")]
    pub seed: Option<Vec<u8>>,
    /// New hostname (1..=64 bytes of `[A-Za-z0-9.-]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Sandbox id written to the identity file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
}

pub use crate::proto_procs::*;
pub use crate::proto_stat::*;

/// An agent → host message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// The request's id; `null` for errors about frames that had none.
    pub id: Option<u64>,
    /// The content.
    #[serde(flatten)]
    pub body: ReplyBody,
}

/// Reply contents (`"type"` field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ReplyBody {
    /// To `hello`.
    Hello(HelloReply),
    /// To `ping`.
    Pong,
    /// To `info`.
    Info(InfoReply),
    /// Part of an exec's stdout.
    Stdout(OutputChunk),
    /// Part of an exec's stderr.
    Stderr(OutputChunk),
    /// The last frame of an exec.
    Exit(ExitReply),
    /// To `read_file`.
    FileData(FileData),
    /// To `write_file`.
    Written(Written),
    /// To `list_dir`.
    DirEntries(DirListing),
    /// To `stat`.
    Stat(FileStat),
    /// To `resumed`.
    Resumed(Box<ResumedReply>),
    /// Any request failed (or a frame could not be understood).
    Error(ErrorReply),
    /// 1.1: to `spawn`.
    Spawned(Spawned),
    /// 1.1: part of a PTY process's output (attach).
    Pty(OutputChunk),
    /// 1.1: an attach is alive but has nothing to say.
    Keepalive,
    /// 1.1: to `processes`.
    ProcessList(ProcessList),
    /// 1.1: a request without a result succeeded.
    Done,
    /// 1.1: to `watch_add`.
    Watch(WatchId),
    /// 1.1: to `watch_events`.
    WatchEvents(WatchEvents),
    /// 1.3: to `connect`: the last frame; raw bytes follow.
    Connected,
    /// 1.4: to `statfs`.
    Statfs(FsStats),
}

/// `statfs` reply (1.4): `statvfs(3)` of the path, in bytes (block counts
/// times the fragment size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsStats {
    /// The filesystem's fragment size (`f_frsize`), the unit of its counts.
    pub block_size: u64,
    /// Its size (`f_blocks`).
    pub total_bytes: u64,
    /// Free, including what only root may use (`f_bfree`).
    pub free_bytes: u64,
    /// Free for an unprivileged user (`f_bavail`).
    pub available_bytes: u64,
}

/// `hello` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HelloReply {
    /// The agent's protocol version.
    pub protocol: ProtocolVersion,
    /// The agent's crate version.
    pub agent_version: String,
}

/// `info` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InfoReply {
    /// The agent's crate version.
    pub agent_version: String,
    /// The agent's protocol version.
    pub protocol: ProtocolVersion,
    /// Milliseconds since the agent started.
    pub agent_uptime_ms: u64,
    /// Milliseconds since the guest booted (`CLOCK_BOOTTIME`).
    pub system_uptime_ms: u64,
    /// Current hostname.
    pub hostname: String,
    /// `/proc/sys/kernel/random/boot_id` (empty if unreadable).
    pub boot_id: String,
    /// Kernel release (`uname -r`).
    pub kernel: String,
}

/// A chunk of exec output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputChunk {
    /// The bytes (base64).
    #[serde(with = "b64")]
    pub data: Vec<u8>,
}

/// How an exec ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExitReply {
    /// Exit status when the process exited normally.
    pub code: Option<i32>,
    /// Signal number when it was killed by a signal.
    pub signal: Option<i32>,
    /// The timeout fired and the process group was killed.
    pub timed_out: bool,
    /// Output beyond `max_output_bytes` was dropped.
    pub truncated: bool,
    /// Microseconds from spawn to exit.
    pub duration_us: u64,
    /// Bytes the process wrote to stdout (forwarded or not).
    pub stdout_bytes: u64,
    /// Bytes the process wrote to stderr (forwarded or not).
    pub stderr_bytes: u64,
}

/// `read_file` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileData {
    /// The bytes read (base64).
    #[serde(with = "b64")]
    pub data: Vec<u8>,
    /// Offset of `data[0]`.
    pub offset: u64,
    /// The file's size when read.
    pub size: u64,
    /// `offset + data.len()` reached the end of the file.
    pub eof: bool,
}

/// `write_file` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Written {
    /// Bytes written.
    pub bytes: u64,
    /// The file's size afterwards.
    pub size: u64,
}

/// `list_dir` reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DirListing {
    /// Entries sorted by name, `.` and `..` excluded; symlinks not followed.
    pub entries: Vec<FileStat>,
    /// More than [`MAX_DIR_ENTRIES`] entries: the rest were left out.
    pub truncated: bool,
}

/// Most entries one `list_dir` reply carries.
pub const MAX_DIR_ENTRIES: usize = 50_000;

/// `resumed` reply: one [`Step`] per sub-step, in the order they run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumedReply {
    /// The identity page's generation, when the page was read.
    pub generation: Option<u64>,
    /// Reading the identity page (skipped when the host gave clock and seed).
    pub identity_page: Step,
    /// `clock_settime(CLOCK_REALTIME)`.
    pub clock: Step,
    /// Writing the seed to `/dev/urandom` (mixes it in, uncredited).
    pub rng_write: Step,
    /// `ioctl(RNDADDENTROPY)` (credits it; needs root).
    pub rng_credit: Step,
    /// `sethostname`.
    pub hostname: Step,
    /// Writing the identity file.
    pub identity: Step,
    /// Gratuitous ARP for the guest's addresses (absent from agents older
    /// than the network device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<Step>,
}

/// Outcome of one sub-step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// What happened.
    pub status: StepStatus,
    /// Why it was skipped, or what was done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorReply>,
}

impl Step {
    /// A step that succeeded.
    pub fn ok(detail: impl Into<String>) -> Step {
        Step {
            status: StepStatus::Ok,
            detail: Some(detail.into()),
            error: None,
        }
    }
    /// A step that was not attempted.
    pub fn skipped(why: impl Into<String>) -> Step {
        Step {
            status: StepStatus::Skipped,
            detail: Some(why.into()),
            error: None,
        }
    }
    /// A step that failed.
    pub fn failed(error: ErrorReply) -> Step {
        Step {
            status: StepStatus::Failed,
            detail: None,
            error: Some(error),
        }
    }
}

/// [`Step::status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    /// Done.
    Ok,
    /// Not attempted (nothing to do, or not permitted).
    Skipped,
    /// Attempted and failed.
    Failed,
}

/// A structured error: `code` is an errno name (`ENOENT`, `EINVAL`, …).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ErrorReply {
    /// errno name.
    pub code: String,
    /// errno number, when there is one.
    pub errno: Option<i32>,
    /// Human-readable detail.
    pub message: String,
}

impl ErrorReply {
    /// An error with errno `errno` and a message.
    pub fn new(errno: i32, message: impl Into<String>) -> ErrorReply {
        ErrorReply {
            code: errno_name(errno).to_string(),
            errno: Some(errno),
            message: message.into(),
        }
    }

    /// An I/O error, with `context` (e.g. the path) in front of the message.
    pub fn io(context: &str, err: &io::Error) -> ErrorReply {
        let errno = err.raw_os_error().unwrap_or(libc::EIO);
        ErrorReply::new(errno, format!("{context}: {err}"))
    }
}

/// The errno name for `errno` (`EUNKNOWN` for unlisted ones).
pub fn errno_name(errno: i32) -> &'static str {
    use libc::*;
    match errno {
        EPERM => "EPERM",
        ENOENT => "ENOENT",
        ESRCH => "ESRCH",
        EINTR => "EINTR",
        EIO => "EIO",
        ENXIO => "ENXIO",
        E2BIG => "E2BIG",
        ENOEXEC => "ENOEXEC",
        EBADF => "EBADF",
        ECHILD => "ECHILD",
        EAGAIN => "EAGAIN",
        ENOMEM => "ENOMEM",
        EACCES => "EACCES",
        EFAULT => "EFAULT",
        EBUSY => "EBUSY",
        EEXIST => "EEXIST",
        EXDEV => "EXDEV",
        ENODEV => "ENODEV",
        ENOTDIR => "ENOTDIR",
        EISDIR => "EISDIR",
        EINVAL => "EINVAL",
        ENFILE => "ENFILE",
        EMFILE => "EMFILE",
        ENOTTY => "ENOTTY",
        ETXTBSY => "ETXTBSY",
        EFBIG => "EFBIG",
        ENOSPC => "ENOSPC",
        ESPIPE => "ESPIPE",
        EROFS => "EROFS",
        EMLINK => "EMLINK",
        EPIPE => "EPIPE",
        ERANGE => "ERANGE",
        ENAMETOOLONG => "ENAMETOOLONG",
        ENOSYS => "ENOSYS",
        ENOTEMPTY => "ENOTEMPTY",
        ELOOP => "ELOOP",
        EOVERFLOW => "EOVERFLOW",
        EPROTO => "EPROTO",
        EBADMSG => "EBADMSG",
        EMSGSIZE => "EMSGSIZE",
        EOPNOTSUPP => "EOPNOTSUPP",
        ECONNRESET => "ECONNRESET",
        ETIMEDOUT => "ETIMEDOUT",
        ECONNREFUSED => "ECONNREFUSED",
        EHOSTUNREACH => "EHOSTUNREACH",
        EDQUOT => "EDQUOT",
        _ => "EUNKNOWN",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_shapes() {
        let req = Request {
            id: 7,
            op: Op::Exec(ExecRequest {
                argv: vec!["cat".into()],
                stdin: Some(b"hi\0".to_vec()),
                timeout_ms: Some(100),
                ..Default::default()
            }),
        };
        let json = serde_json::to_value(&req).unwrap();
        assert_eq!(json["id"], 7);
        assert_eq!(json["op"], "exec");
        assert_eq!(json["stdin"], "aGkA");
        assert_eq!(serde_json::from_value::<Request>(json).unwrap(), req);

        let ping: Request = serde_json::from_str(r#"{"id":1,"op":"ping","extra":true}"#).unwrap();
        assert_eq!(ping.op, Op::Ping);

        let reply = Reply {
            id: None,
            body: ReplyBody::Error(ErrorReply::new(libc::ENOENT, "x")),
        };
        let json = serde_json::to_string(&reply).unwrap();
        assert_eq!(
            json,
            r#"{"id":null,"type":"error","code":"ENOENT","errno":2,"message":"x"}"#
        );
        assert_eq!(serde_json::from_str::<Reply>(&json).unwrap(), reply);
        let pong = serde_json::to_string(&Reply {
            id: Some(3),
            body: ReplyBody::Pong,
        })
        .unwrap();
        assert_eq!(pong, r#"{"id":3,"type":"pong"}"#);
    }

    #[test]
    fn every_known_op_parses() {
        for op in KNOWN_OPS {
            let json = serde_json::json!({"id": 1, "op": op, "protocol": {"major": 1, "minor": 0},
                "argv": ["x"], "path": "/", "data": "", "pid": 1, "signal": 15, "cols": 80,
                "rows": 24, "from": "/a", "to": "/b", "watch_id": 1, "port": 8080,
                "mounts": []});
            serde_json::from_value::<Request>(json).unwrap_or_else(|e| panic!("{op}: {e}"));
        }
    }
}
