//! VMM processes of the local pod: spawning `torpor vmm`, talking to its
//! control socket, watching it, and measuring its memory.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use torpor_vmm::control::{self, Request, Response, VmStatus};

use super::ServiceError;
use crate::model::VmmHandle;

/// How long a VMM may take to answer on its control socket after spawn.
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

/// Spawns `torpor vmm ARGS` with its control socket and console in
/// `files`, in a process group of its own (a restart of the service must
/// not take running VMMs with it), and waits until it answers.
pub fn spawn(
    exe: &Path,
    args: &[&str],
    files: &VmmFiles,
) -> Result<(Child, VmmHandle), ServiceError> {
    let _ = std::fs::remove_file(&files.socket);
    let log = File::create(&files.log).map_err(|e| internal("create VMM log", e))?;
    let mut child = Command::new(exe)
        .arg("vmm")
        .args(args)
        .arg("--serial")
        .arg(&files.console)
        .arg("--control-socket")
        .arg(&files.socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(|e| internal(&format!("spawn {}", exe.display()), e))?;
    let deadline = Instant::now() + START_LIMIT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(ServiceError::Internal(format!(
                "the VMM exited at start ({status}): {}",
                log_tail(&files.log)
            )));
        }
        if control::request(&files.socket, &Request::Status, Duration::from_secs(2)).is_ok() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ServiceError::Internal(format!(
                "the VMM did not answer within {START_LIMIT:?}: {}",
                log_tail(&files.log)
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let handle = VmmHandle {
        pid: child.id(),
        control_socket: files.socket.clone(),
    };
    Ok((child, handle))
}

/// The last lines of a VMM's stderr log, for error messages.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

fn internal(what: &str, e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Internal(format!("{what}: {e}"))
}

/// One control request; an unreachable VMM is an internal error.
pub fn call(handle: &VmmHandle, req: &Request) -> Result<Response, ServiceError> {
    control::call(&handle.control_socket, req, CONTROL_LIMIT)
        .map_err(|e| ServiceError::Internal(format!("VMM {}: {e}", handle.pid)))
}

/// Snapshots the paused VM to `path` (a diff on the snapshot it runs from
/// or last took, when `diff`).
pub fn snapshot(handle: &VmmHandle, path: &Path, diff: bool) -> Result<Response, ServiceError> {
    call(
        handle,
        &Request::Snapshot {
            path: path.to_path_buf(),
            diff,
        },
    )
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

/// Proportional set size of a process in KiB (0 if it is gone).
pub fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Pss:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
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
