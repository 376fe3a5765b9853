//! The per-VM control socket: a unix stream socket speaking one JSON object
//! per line. Each request gets exactly one response line.
//!
//! ```text
//! → {"op":"status"}
//! ← {"ok":true,"status":{"state":"running",...}}
//! → {"op":"pause"}
//! ← {"ok":true,"status":{"state":"paused",...}}
//! → {"op":"bogus"}
//! ← {"ok":false,"error":"invalid request: unknown variant `bogus` ..."}
//! ```

pub mod server;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use server::{bind, ControlServer, VmController};

/// Version of the control protocol, reported in every status.
pub const PROTOCOL_VERSION: u32 = 1;

/// A request on the control socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Status,
    Pause,
    Resume,
    Shutdown,
    /// Snapshot the paused VM into directory `path` (created if missing).
    /// `diff` writes only the pages dirtied since the snapshot or restore
    /// this VM last started from.
    Snapshot {
        path: PathBuf,
        #[serde(default)]
        diff: bool,
    },
    /// Only for a standby VMM (`torpor vmm --standby`): restore `snapshot`
    /// into the pre-created VM. The answer comes once a vCPU runs (or, with
    /// `paused`, once it is ready to).
    Restore {
        snapshot: PathBuf,
        #[serde(default = "default_backend")]
        backend: String,
        /// Console file; none discards the console.
        #[serde(default)]
        serial: Option<PathBuf>,
        #[serde(default)]
        paused: bool,
        /// Install the snapshot's recorded working set eagerly (uffd backends).
        #[serde(default)]
        prefetch: bool,
        /// The clone's own disk overlay (snapshots with a disk).
        #[serde(default)]
        disk_overlay: Option<PathBuf>,
        /// The clone's own vsock host socket (snapshots with vsock).
        #[serde(default)]
        vsock_uds: Option<PathBuf>,
    },
}

fn default_backend() -> String {
    "file".into()
}

/// Timings of a restore into a standby VMM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreInfo {
    /// From the request arriving to the first vCPU entering KVM_RUN (or, if
    /// restored paused, to the VM being ready).
    pub request_to_running_us: u64,
    /// Per-phase microseconds of the restore itself.
    pub phases: Vec<(String, u64)>,
}

/// Run state as seen from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// A pre-created VM waiting for a `restore` request.
    Standby,
    Running,
    Paused,
    ShuttingDown,
}

/// Answer to every successful request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmStatus {
    pub protocol: u32,
    pub state: VmState,
    pub pid: u32,
    pub vcpus: u16,
    pub mem_mib: u64,
    pub kernel: String,
    pub uptime_ms: u64,
    /// 0 for a cold boot, +1 for every restore in this VM's history.
    pub generation: u64,
    /// How guest memory is mapped ("anonymous", "file", "uffd", ...).
    pub memory_backend: String,
    /// The snapshot a diff snapshot of this VM would be based on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_snapshot: Option<PathBuf>,
    /// kvmclock as the guest sees it, in ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_clock_ns: Option<u64>,
    /// Where diff snapshots take dirty pages from ("kvm", "uffd-wp", "both").
    #[serde(default)]
    pub dirty_tracking: String,
}

/// What a snapshot request wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub path: PathBuf,
    pub diff: bool,
    /// Pages recorded in this snapshot's memory layer.
    pub pages: u64,
    /// Bytes the memory file occupies on disk.
    pub memory_allocated_bytes: u64,
    pub state_bytes: u64,
    pub duration_us: u64,
    /// The dirty-page source ("kvm", "uffd-wp", "both").
    #[serde(default)]
    pub dirty_tracking: String,
    /// Time spent reading (and resetting) the dirty set, in microseconds.
    #[serde(default)]
    pub dirty_collect_us: u64,
    /// With "both": where uffd-wp and KVM's dirty log disagreed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_crosscheck: Option<crate::dirty::Crosscheck>,
}

/// One response line: `ok` with the VM's status (and what a snapshot
/// wrote), or not `ok` with an error message.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<VmStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<RestoreInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Errors of a control-socket client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to control socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("control socket I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the VMM closed the connection without answering")]
    NoAnswer,
    #[error("malformed answer from the VMM: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("the VMM refused the request: {0}")]
    Refused(String),
}

/// Sends one request and returns the VM's status from the answer.
pub fn request(socket: &Path, req: &Request, timeout: Duration) -> Result<VmStatus, ClientError> {
    call(socket, req, timeout)?
        .status
        .ok_or(ClientError::NoAnswer)
}

/// Sends one request and returns the whole successful answer.
pub fn call(socket: &Path, req: &Request, timeout: Duration) -> Result<Response, ClientError> {
    let mut stream = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
        path: socket.display().to_string(),
        source,
    })?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut line = serde_json::to_string(req)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut answer = String::new();
    if BufReader::new(stream).read_line(&mut answer)? == 0 {
        return Err(ClientError::NoAnswer);
    }
    let response: Response = serde_json::from_str(&answer)?;
    if response.ok {
        Ok(response)
    } else {
        Err(ClientError::Refused(response.error.unwrap_or_default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_is_stable() {
        assert_eq!(
            serde_json::to_string(&Request::Pause).unwrap(),
            r#"{"op":"pause"}"#
        );
        let r: Request = serde_json::from_str(r#"{"op":"shutdown"}"#).unwrap();
        assert_eq!(r, Request::Shutdown);
        assert!(serde_json::from_str::<Request>(r#"{"op":"explode"}"#).is_err());
        let e: Response = serde_json::from_str(r#"{"ok":false,"error":"x"}"#).unwrap();
        assert!(!e.ok);
        let s: Request = serde_json::from_str(r#"{"op":"snapshot","path":"/s"}"#).unwrap();
        assert_eq!(
            s,
            Request::Snapshot {
                path: "/s".into(),
                diff: false
            }
        );
    }
}
