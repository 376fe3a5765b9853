//! VMM processes of the local pod: starting `torpor-vmm` from a typed
//! [`LaunchSpec`] (JSON on its stdin, one [`LaunchReply`] line back on its
//! stdout), talking to its control socket, watching it, and measuring its
//! memory. This and `torpor_vmm_api` are the only way the scheduler starts
//! or drives a VMM.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use torpor_vmm_api::control::{self, Request, Response, SnapshotInfo, VmStatus};
use torpor_vmm_api::{LaunchReply, LaunchSpec, VmError};

use super::ServiceError;
use crate::model::VmmHandle;

/// How long a VMM may take to answer `ready` after spawn.
const START_LIMIT: Duration = Duration::from_secs(20);
/// Control requests; snapshots of large guests take as long as the disk.
const CONTROL_LIMIT: Duration = Duration::from_secs(300);

/// Files of one VMM run.
pub struct VmmFiles {
    pub socket: PathBuf,
    pub console: PathBuf,
    pub log: PathBuf,
}

impl VmmFiles {
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            socket: dir.join("ctl.sock"),
            console: dir.join("console.log"),
            log: dir.join("vmm.log"),
        }
    }
}

/// A started VMM: its process, its handle, and how long it took.
pub struct Spawned {
    pub child: Child,
    pub handle: VmmHandle,
    /// From spawn to its `ready` line.
    pub spawn_us: u64,
}

/// Starts `torpor-vmm` with `spec` (its control socket must be in
/// `spec`; stderr goes to `log`), in a process group of its own (a restart
/// of the service must not take running VMMs with it), and waits for its
/// `ready` line. A VMM that cannot start answers why, typed. The handle's
/// pid is the VMM's own (a jailed VMM runs under a supervisor, `child`).
pub fn spawn(exe: &Path, spec: &LaunchSpec, log: &Path) -> Result<Spawned, ServiceError> {
    let started = Instant::now();
    let Some(socket) = spec.control_socket.clone() else {
        return Err(ServiceError::Internal(
            "a pod's VMM needs a control socket".into(),
        ));
    };
    let _ = std::fs::remove_file(&socket);
    let log_file = create_private(log, spec.jail.as_ref().map(|j| j.uid))
        .map_err(|e| internal(&format!("create VMM log {}", log.display()), e))?;
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log_file)
        .process_group(0)
        .spawn()
        .map_err(|e| internal(&format!("spawn {}", exe.display()), e))?;
    let text = serde_json::to_vec(spec).map_err(|e| internal("encode the launch spec", e))?;
    let written = child
        .stdin
        .take()
        .map(|mut stdin| stdin.write_all(&text))
        .unwrap_or(Ok(()));
    let reply = match written {
        Ok(()) => read_reply(&mut child, START_LIMIT),
        Err(e) => Err(internal("hand the VMM its launch spec", e)),
    };
    let failed = |child: &mut Child, e: ServiceError| {
        let _ = child.kill();
        let _ = child.wait();
        Err(e)
    };
    let pid = match reply {
        Ok(LaunchReply::Ready { pid, .. }) => pid,
        Ok(LaunchReply::Failed(e)) => return failed(&mut child, ServiceError::Vm(e)),
        Err(e) => return failed(&mut child, e),
    };
    let handle = VmmHandle {
        pid,
        control_socket: socket,
    };
    Ok(Spawned {
        child,
        handle,
        spawn_us: started.elapsed().as_micros() as u64,
    })
}

/// A new file only its owner reads (0600, `uid`'s when given), never
/// through a link: an old one is removed first, then created with
/// `O_EXCL|O_NOFOLLOW`.
pub fn create_private(path: &Path, uid: Option<u32>) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    if let Some(uid) = uid {
        std::os::unix::fs::fchown(&file, Some(uid), Some(uid))?;
    }
    Ok(file)
}

/// Waits up to `limit` for the VMM's one reply line on its stdout.
fn read_reply(child: &mut Child, limit: Duration) -> Result<LaunchReply, ServiceError> {
    let Some(stdout) = child.stdout.take() else {
        return Err(ServiceError::Internal(
            "the VMM's stdout is not a pipe".into(),
        ));
    };
    let mut pfd = libc::pollfd {
        fd: stdout.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ServiceError::Internal(format!(
                "the VMM did not start within {limit:?}"
            )));
        }
        // SAFETY: one valid pollfd for a pipe we own, for the call's length.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(1000) as i32) };
        if n > 0 {
            break;
        }
        if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Err(internal(
                "wait for the VMM",
                std::io::Error::last_os_error(),
            ));
        }
    }
    match LaunchReply::read_from(stdout).map_err(ServiceError::Vm)? {
        Some(reply) => Ok(reply),
        None => {
            let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
            Err(ServiceError::Internal(format!(
                "the VMM exited at start ({status}) without a reply"
            )))
        }
    }
}

/// The last lines of a VMM's stderr log, for operators' messages.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

fn internal(what: &str, e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Internal(format!("{what}: {e}"))
}

/// One control request; a refusal keeps the VMM's kind.
pub fn call(handle: &VmmHandle, req: &Request) -> Result<Response, ServiceError> {
    control::call(&handle.control_socket, req, CONTROL_LIMIT)
        .map_err(|e| ServiceError::Vm(vm_error(handle, e)))
}

fn vm_error(handle: &VmmHandle, e: control::ClientError) -> VmError {
    let mut e = e.into_vm_error();
    e.message = format!("VMM {}: {}", handle.pid, e.message);
    e
}

/// The snapshot info of an answer that must carry one.
fn snapshot_info(r: Response) -> Result<SnapshotInfo, ServiceError> {
    r.snapshot.ok_or_else(|| {
        ServiceError::Internal("the VMM answered a snapshot without its info".into())
    })
}

/// Snapshots the paused VM to `path` (a diff on the snapshot it runs from
/// or last took, when `diff`).
pub fn snapshot(handle: &VmmHandle, path: &Path, diff: bool) -> Result<SnapshotInfo, ServiceError> {
    let req = Request::Snapshot {
        path: path.to_path_buf(),
        diff,
    };
    call(handle, &req).and_then(snapshot_info)
}

/// Pause + snapshot + exit in one request: the VMM ends once it answers;
/// on failure it is left as it was.
pub fn hibernate(
    handle: &VmmHandle,
    path: &Path,
    diff: bool,
) -> Result<SnapshotInfo, ServiceError> {
    let req = Request::Hibernate {
        path: path.to_path_buf(),
        diff,
    };
    call(handle, &req).and_then(snapshot_info)
}

/// Pauses the VM and takes a full snapshot at `path`: a template's.
pub fn pause_and_snapshot_full(handle: &VmmHandle, path: &Path) -> Result<(), ServiceError> {
    call(handle, &Request::Pause)?;
    snapshot(handle, path, false).map(drop)
}

/// The VMM's status, if it answers.
pub fn status(handle: &VmmHandle) -> Option<VmStatus> {
    control::request(
        &handle.control_socket,
        &Request::Status,
        Duration::from_secs(2),
    )
    .ok()
}

/// Why a VMM that nobody stopped ended, for its sandbox's error.
pub fn exit_reason(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if status.signal() == Some(libc::SIGSYS) {
        return format!(
            "its VMM was killed by its seccomp filter: a system call outside its \
             allow-list (seccomp violation, SIGSYS; {status})"
        );
    }
    format!("its VMM exited unexpectedly ({status})")
}

/// Whether a process with this pid exists.
pub fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for the process.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

/// Asks the VMM to stop, then makes sure it has: SIGKILL after a grace time.
pub fn stop(handle: &VmmHandle, child: Option<Child>) {
    let _ = control::request(
        &handle.control_socket,
        &Request::Shutdown,
        Duration::from_secs(5),
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    match child {
        Some(mut c) => {
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        None => {
            while alive(handle.pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if alive(handle.pid) {
                // SAFETY: signalling a pid we recorded as our VMM.
                unsafe { libc::kill(handle.pid as libc::pid_t, libc::SIGKILL) };
            }
        }
    }
    let _ = std::fs::remove_file(&handle.control_socket);
}

/// Proportional set size of a process in KiB, from
/// /proc/PID/smaps_rollup (None if it is gone). The one reader of PSS:
/// the pod's policy and metrics, and the benches.
pub fn pss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Page faults a process has taken, its threads included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageFaults {
    pub minor: u64,
    pub major: u64,
}

impl PageFaults {
    /// The larger of each count (counts of one process only grow).
    pub fn max(self, other: PageFaults) -> PageFaults {
        PageFaults {
            minor: self.minor.max(other.minor),
            major: self.major.max(other.major),
        }
    }

    pub fn add(&mut self, other: PageFaults) {
        self.minor += other.minor;
        self.major += other.major;
    }
}

/// A process's page faults from `/proc/PID/stat` (`None` if it is gone).
pub fn page_faults(pid: u32) -> Option<PageFaults> {
    parse_stat_faults(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// `minflt` and `majflt` (fields 10 and 12) of a stat line. The command
/// name (field 2) may hold spaces and parentheses, so fields are counted
/// from after its last `)`.
fn parse_stat_faults(stat: &str) -> Option<PageFaults> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `fields[0]` is field 3 (state).
    Some(PageFaults {
        minor: fields.get(10 - 3)?.parse().ok()?,
        major: fields.get(12 - 3)?.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seccomp_kill_is_named() {
        use std::os::unix::process::ExitStatusExt;
        let sigsys = exit_reason(std::process::ExitStatus::from_raw(libc::SIGSYS));
        assert!(sigsys.contains("seccomp violation"), "{sigsys}");
        let other = exit_reason(std::process::ExitStatus::from_raw(3 << 8));
        assert!(!other.contains("seccomp"), "{other}");
    }

    #[test]
    fn stat_faults_are_counted_after_the_command_name() {
        let line = "4242 (torpor vmm (x)) S 1 4242 4242 0 -1 4194560 1234 99 7 0 5 6 0 0 20 0 3 0";
        assert_eq!(
            parse_stat_faults(line),
            Some(PageFaults {
                minor: 1234,
                major: 7
            })
        );
        assert_eq!(parse_stat_faults("4242 (short) S 1 2"), None);
        let me = page_faults(std::process::id()).expect("own stat");
        assert!(me.minor > 0, "{me:?}");
        assert_eq!(page_faults(u32::MAX), None);
    }
}
