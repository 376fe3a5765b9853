//! The per-VM control socket: a unix stream socket speaking one JSON object
//! per line. Each request gets exactly one answer line.
//!
//! ```text
//! → {"op":"status"}
//! ← {"ok":true,"status":{"state":"running",...}}
//! → {"op":"snapshot","path":"/s"}
//! ← {"ok":false,"kind":"not_paused","error":"the VM must be paused to snapshot it"}
//! ```

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{ErrorKind, VmError};
use crate::launch::{Console, RestoreSpec};
use crate::vcpus::VcpuStates;

/// Version of the control protocol, reported in every status.
/// (3: `set_balloon` and `balloon_stats`; 4: `vcpu_state`.)
pub const PROTOCOL_VERSION: u32 = 4;
/// Longest request line a VMM reads, and longest answer a client reads.
pub const MAX_LINE: u64 = 64 * 1024;

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
    /// Pause (if running), snapshot into `path` (a diff with `diff`), and
    /// end the VMM once the answer is written. If the snapshot fails the VM
    /// stays as it was before the request (running or paused).
    Hibernate {
        path: PathBuf,
        #[serde(default)]
        diff: bool,
    },
    /// Only for a standby VMM: restore into the pre-created VM. The answer
    /// comes once a vCPU runs (or, with `paused`, once it is ready to).
    Restore {
        #[serde(flatten)]
        restore: RestoreSpec,
        #[serde(default)]
        console: Console,
        #[serde(default)]
        paused: bool,
    },
    /// Test hook, in debug builds only (release builds have no such
    /// request): the control thread makes a system call its seccomp
    /// filter forbids, so tests can watch the VMM die of SIGSYS.
    #[cfg(debug_assertions)]
    DebugForbiddenSyscall,
    /// Ask the guest's balloon driver to hold `target_mib` MiB (0 gives
    /// everything back). The guest inflates or deflates in its own time;
    /// `balloon_stats` shows how far it got.
    SetBalloon {
        target_mib: u64,
    },
    /// The balloon's target, actual size, counters and the guest's last
    /// memory statistics (and asks the guest for fresh ones).
    BalloonStats,
    /// Where each vCPU stands and which interrupts wait for it (registers,
    /// pending events, the local APIC, the IOAPIC's pins): for a guest
    /// that stopped answering. A running VM is paused while its vCPUs
    /// are read (their threads save their own state) and runs on; a
    /// paused one stays paused.
    VcpuState,
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
    /// Console bytes the guest wrote past the console file's limit.
    #[serde(default)]
    pub console_dropped_bytes: u64,
}

/// Where the dirty log and uffd-wp disagree, from one snapshot with
/// dirty tracking `both`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Crosscheck {
    pub kvm_pages: u64,
    pub uffd_wp_pages: u64,
    /// Pages in KVM's log that uffd-wp did not report (a diff would lose them).
    pub missed_by_uffd_wp: u64,
    /// Pages uffd-wp reported that KVM's log does not hold.
    pub only_in_uffd_wp: u64,
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
    pub dirty_crosscheck: Option<Crosscheck>,
    /// The new layer's chain, base first, this layer last (as written in
    /// its lineage record).
    #[serde(default)]
    pub lineage: Vec<PathBuf>,
}

/// Memory statistics a guest's balloon driver reported (virtio 1.2,
/// 5.5.6.3); `None` for a tag the guest did not send. Sizes in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestMemoryStats {
    pub swap_in: Option<u64>,
    pub swap_out: Option<u64>,
    pub major_faults: Option<u64>,
    pub minor_faults: Option<u64>,
    pub free_memory: Option<u64>,
    pub total_memory: Option<u64>,
    pub available_memory: Option<u64>,
    pub disk_caches: Option<u64>,
    pub hugetlb_allocations: Option<u64>,
    pub hugetlb_failures: Option<u64>,
    pub oom_kills: Option<u64>,
    pub alloc_stalls: Option<u64>,
}

/// Counters of the balloon device since this VMM started it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonCounters {
    /// 4 KiB pages the guest put into the balloon (discarded on the host).
    pub inflated_pages: u64,
    /// Pages the guest took back out.
    pub deflated_pages: u64,
    /// Bytes of free memory the guest reported (discarded on the host).
    pub reported_bytes: u64,
    /// Page numbers or ranges outside guest memory, refused.
    pub refused_ranges: u64,
    /// Chains that broke the virtio rules, returned unused.
    pub malformed_chains: u64,
    /// Discards the host refused (madvise failed).
    pub discard_failures: u64,
    /// Statistics buffers the guest filled.
    pub stats_updates: u64,
}

/// State of the virtio-balloon device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonStatus {
    /// What the host asked the guest to hold, in MiB.
    pub target_mib: u64,
    /// What the guest says it holds, in MiB (rounded down).
    pub actual_mib: u64,
    /// The driver is up (the guest negotiated the device).
    pub active: bool,
    /// The guest negotiated free page reporting.
    pub free_page_reporting: bool,
    pub counters: BalloonCounters,
    /// The guest's last statistics, and how old they are (ms), if any came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<GuestMemoryStats>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats_age_ms: Option<u64>,
}

/// One answer line: `ok` with the VM's status (and what a snapshot wrote),
/// or not `ok` with the failure's kind and message.
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
    pub balloon: Option<BalloonStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<VcpuStates>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ErrorKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<PathBuf>,
}

impl Response {
    /// The refusal answer for `e`.
    pub fn refusal(e: VmError) -> Self {
        Response {
            ok: false,
            kind: Some(e.kind),
            error: Some(e.message),
            layer: e.layer,
            ..Default::default()
        }
    }

    /// A refusal as a typed error (`None` for an `ok` answer).
    pub fn vm_error(&self) -> Option<VmError> {
        (!self.ok).then(|| VmError {
            kind: self.kind.unwrap_or(ErrorKind::Internal),
            message: self.error.clone().unwrap_or_default(),
            layer: self.layer.clone(),
        })
    }
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
    Refused(VmError),
}

impl ClientError {
    /// How the failure is classified: the VMM's own kind for a refusal; a
    /// VMM that is not there (or went away mid-answer) is gone.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClientError::Refused(e) => e.kind,
            ClientError::Connect { .. } | ClientError::NoAnswer => ErrorKind::GuestGone,
            ClientError::Io(_) => ErrorKind::GuestGone,
            ClientError::Malformed(_) => ErrorKind::Internal,
        }
    }

    /// The refusal's typed error, or this client error classified.
    pub fn into_vm_error(self) -> VmError {
        match self {
            ClientError::Refused(e) => e,
            other => VmError::new(other.kind(), other.to_string()),
        }
    }
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
    if BufReader::new(stream.take(MAX_LINE)).read_line(&mut answer)? == 0 {
        return Err(ClientError::NoAnswer);
    }
    let response: Response = serde_json::from_str(&answer)?;
    match response.vm_error() {
        None => Ok(response),
        Some(e) => Err(ClientError::Refused(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::MemoryBackend;

    #[test]
    fn wire_format_is_stable() {
        assert_eq!(
            serde_json::to_string(&Request::Pause).unwrap(),
            r#"{"op":"pause"}"#
        );
        let r: Request = serde_json::from_str(r#"{"op":"shutdown"}"#).unwrap();
        assert_eq!(r, Request::Shutdown);
        assert_eq!(
            serde_json::to_string(&Request::VcpuState).unwrap(),
            r#"{"op":"vcpu_state"}"#
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"explode"}"#).is_err());
        let e: Response = serde_json::from_str(r#"{"ok":false,"error":"x"}"#).unwrap();
        assert_eq!(e.vm_error().unwrap().kind, ErrorKind::Internal);
        let s: Request = serde_json::from_str(r#"{"op":"snapshot","path":"/s"}"#).unwrap();
        assert_eq!(
            s,
            Request::Snapshot {
                path: "/s".into(),
                diff: false
            }
        );
        let h: Request =
            serde_json::from_str(r#"{"op":"hibernate","path":"/h","diff":true}"#).unwrap();
        assert_eq!(
            h,
            Request::Hibernate {
                path: "/h".into(),
                diff: true
            }
        );
    }

    #[test]
    fn restore_requests_carry_a_restore_spec() {
        let text = r#"{"op":"restore","snapshot":"/t","backend":"uffd","prefetch":true,"console":{"to":"file","path":"/c"}}"#;
        let Request::Restore {
            restore,
            console,
            paused,
        } = serde_json::from_str(text).unwrap()
        else {
            panic!("not a restore");
        };
        assert_eq!(restore.backend, MemoryBackend::Uffd);
        assert!(restore.prefetch && !paused);
        assert_eq!(console, Console::file("/c"));
        let back = serde_json::to_string(&Request::Restore {
            restore,
            console,
            paused,
        })
        .unwrap();
        assert!(back.contains(r#""snapshot":"/t""#), "{back}");
    }

    #[test]
    fn refusals_carry_their_kind() {
        let r = Response::refusal(VmError::new(ErrorKind::NotPaused, "run").with_layer("/l"));
        let json = serde_json::to_string(&r).unwrap();
        let back: Response = serde_json::from_str(&json).unwrap();
        let e = back.vm_error().unwrap();
        assert_eq!(
            (e.kind, e.layer.clone()),
            (ErrorKind::NotPaused, Some("/l".into()))
        );
        assert_eq!(ClientError::Refused(e).kind(), ErrorKind::NotPaused);
        assert_eq!(ClientError::NoAnswer.kind(), ErrorKind::GuestGone);
    }
}
