//! VMM processes of the local pod: starting `torpor-vmm` from a typed
//! [`LaunchSpec`] (JSON on its stdin, one [`LaunchReply`] line back on its
//! stdout), talking to its control socket, watching it, and measuring its
//! memory. This and `torpor_vmm_api` are the only way the scheduler starts
//! or drives a VMM.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use torpor_vmm_api::control::{self, Request, Response, SnapshotInfo, VmStatus};
use torpor_vmm_api::{LaunchReply, LaunchSpec, VmError};

use super::vmm_process::{self, VmmChild};
use super::ServiceError;
use crate::model::VmmHandle;

/// Largest VMM log (its stderr) kept: past it the policy rotates the log
/// ([`cap_log`]), so a VMM that logs in a loop holds at most about
/// 1.5 times this on disk.
pub const MAX_LOG_BYTES: u64 = 4 << 20;

/// How long a VMM may take to answer `ready` after spawn.
const START_LIMIT: Duration = Duration::from_secs(20);
/// Control requests; snapshots of large guests take as long as the disk.
const CONTROL_LIMIT: Duration = Duration::from_secs(300);
/// Status reads beside an answer (balloon statistics for a sandbox's GET
/// or the metrics): a VMM busy with a long request (a snapshot, which its
/// control server answers first) must not hold up the read; past this the
/// reader goes without.
const STATUS_LIMIT: Duration = Duration::from_millis(500);

/// Files of one VMM run.
#[derive(Debug)]
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
#[derive(Debug)]
pub struct Spawned {
    pub child: VmmChild,
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
    let pipes = std::io::pipe().and_then(|spec| Ok((spec, std::io::pipe()?)));
    let ((spec_in, mut spec_out), (reply_in, reply_out)) =
        pipes.map_err(|e| internal("make the VMM's pipes", e))?;
    let mut child = vmm_process::start(exe, spec_in.into(), reply_out.into(), log_file.into())
        .map_err(|e| internal(&format!("spawn {}", exe.display()), e))?;
    let text = serde_json::to_vec(spec).map_err(|e| internal("encode the launch spec", e))?;
    let written = spec_out.write_all(&text);
    drop(spec_out);
    let reply = match written {
        Ok(()) => read_reply(reply_in, &mut child, START_LIMIT),
        Err(e) => Err(internal("hand the VMM its launch spec", e)),
    };
    let failed = |child: &mut VmmChild, e: ServiceError| {
        let _ = child.kill();
        let _ = child.wait();
        Err(e)
    };
    let pid = match reply {
        Ok(LaunchReply::Ready { pid, .. }) => pid,
        Ok(LaunchReply::Failed(e)) => return failed(&mut child, ServiceError::Vm(e)),
        Err(e) => return failed(&mut child, e),
    };
    // The VMM just answered: its pid cannot have been recycled, so this is
    // its start time.
    let handle = VmmHandle {
        pid,
        start_time: start_time(pid),
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
    // Appending: the pod rotates a VMM log under the VMM (cap_log).
    let file = std::fs::OpenOptions::new()
        .append(true)
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
fn read_reply(
    stdout: std::io::PipeReader,
    child: &mut VmmChild,
    limit: Duration,
) -> Result<LaunchReply, ServiceError> {
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

/// Rotates a VMM log longer than `max` bytes: its last `max / 2` bytes
/// replace `<log>.1` and the log is truncated; the VMM, appending, goes on
/// at the new end. Lines written between the copy and the truncation are
/// lost. Returns whether it rotated.
pub fn cap_log(path: &Path, max: u64) -> std::io::Result<bool> {
    let len = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if len <= max {
        return Ok(false);
    }
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let keep = max / 2;
    file.seek(SeekFrom::Start(len - keep))?;
    let mut tail = Vec::with_capacity(keep as usize);
    Read::by_ref(&mut file).take(keep).read_to_end(&mut tail)?;
    let mut old = path.as_os_str().to_owned();
    old.push(".1");
    std::fs::write(&old, &tail)?;
    file.set_len(0)?;
    Ok(true)
}

/// The last lines of a VMM's stderr log or a guest's console, for
/// operators' messages: at most five lines from the file's last 4 KiB,
/// each cut to 1,200 characters, control characters dropped (a console is
/// the guest's to write).
pub fn log_tail(path: &Path) -> String {
    // Whole lines: the vsock device's ring states run past 240 characters
    // (their transmit and event rings were cut off in the soak's log).
    const LOG_LINE_CHARS: usize = 1200;
    const WINDOW: u64 = 4096;
    let mut tail = Vec::new();
    if let Ok(mut file) = std::fs::File::open(path) {
        let len = file.metadata().map_or(0, |m| m.len());
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(WINDOW)));
        let _ = file.take(WINDOW).read_to_end(&mut tail);
    }
    let text = String::from_utf8_lossy(&tail);
    let lines: Vec<String> = text
        .lines()
        .rev()
        .filter(|l| !l.trim().is_empty())
        .take(5)
        .map(|l| {
            l.chars()
                .filter(|c| !c.is_control())
                .take(LOG_LINE_CHARS)
                .collect()
        })
        .collect();
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

/// A status read ([`STATUS_LIMIT`]): `None` when the VMM does not answer
/// at once (busy with a long request, or gone) or refuses.
pub fn peek(handle: &VmmHandle, req: &Request) -> Option<Response> {
    control::call(&handle.control_socket, req, STATUS_LIMIT).ok()
}

/// What the VMM at `socket` says of its vCPUs (`vcpu_state`: registers,
/// pending events, APIC and IOAPIC), as one log field for an operator
/// looking at a guest that stopped answering, or why there is none. The
/// answer is the VMM's, parsed into its typed form and only logged.
pub fn vcpu_state_text(socket: &Path) -> String {
    match control::call(socket, &Request::VcpuState, STATUS_LIMIT) {
        Ok(Response { vcpus: Some(v), .. }) => serde_json::to_string(&v).unwrap_or_default(),
        Ok(_) => "(the VMM answered without its vCPUs)".into(),
        Err(e) => format!("(none: {e})"),
    }
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
    // Unjailed, the VMM is the child; jailed, the child is its supervisor,
    // which exits with 128 + the signal that killed the VMM.
    let killed_by =
        |signal: i32| status.signal() == Some(signal) || status.code() == Some(128 + signal);
    if killed_by(libc::SIGSYS) {
        return format!(
            "its VMM was killed by its seccomp filter: a system call outside its \
             allow-list (seccomp violation, SIGSYS; {status})"
        );
    }
    for (signal, name) in [(libc::SIGBUS, "SIGBUS"), (libc::SIGSEGV, "SIGSEGV")] {
        if killed_by(signal) {
            return memory_fault_reason(name, &status.to_string());
        }
    }
    format!("its VMM exited unexpectedly ({status})")
}

/// A VMM that died of a memory fault: a page it could not read (a memory
/// file on a full filesystem, most often), not a seccomp violation.
fn memory_fault_reason(signal: &str, status: &str) -> String {
    format!(
        "its VMM hit a memory fault ({signal}): a page of memory it could not read, such as \
         a snapshot memory file on a full filesystem ({status})"
    )
}

/// Why a VMM whose exit status was not seen ended, from the last lines of
/// its log (what its signal handlers wrote), if they say.
pub fn exit_reason_from_log(tail: &str) -> Option<String> {
    if tail.contains("seccomp violation") {
        return Some(
            "its VMM was killed by its seccomp filter: a system call outside its \
             allow-list (seccomp violation, SIGSYS; exit status not seen)"
                .into(),
        );
    }
    ["SIGBUS", "SIGSEGV"].into_iter().find_map(|signal| {
        tail.contains(&format!("torpor-vmm: memory fault ({signal})"))
            .then(|| memory_fault_reason(signal, "exit status not seen"))
    })
}

/// A process's start time: `/proc/PID/stat` field 22, in clock ticks
/// after boot (`None` if it is gone).
pub fn start_time(pid: u32) -> Option<u64> {
    parse_stat_start(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Field 22 (`starttime`) of a stat line, counted after the command name.
fn parse_stat_start(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// Whether `pid` is still the process `handle` recorded: same start time
/// or, for a handle recorded without one, a `torpor-vmm` process.
fn is_recorded(handle: &VmmHandle) -> bool {
    is_process(handle.pid, handle.start_time)
}

/// Whether `pid` is the process that had start time `start` (for `None`,
/// any `torpor-vmm` process): a recycled pid does not count.
pub fn is_process(pid: u32, start: Option<u64>) -> bool {
    match start {
        Some(t) => start_time(pid) == Some(t),
        None => std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|c| c.trim_end() == "torpor-vmm"),
    }
}

/// Whether the VMM of `handle` still runs (a recycled pid does not count).
pub fn alive(handle: &VmmHandle) -> bool {
    is_recorded(handle)
}

/// A pidfd: a reference to one process that a recycled pid cannot
/// redirect.
struct PidFd(std::os::fd::OwnedFd);

impl PidFd {
    fn open(pid: u32) -> std::io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by pidfd_open and nothing else owns it.
        Ok(PidFd(unsafe {
            std::os::fd::OwnedFd::from_raw_fd(fd as libc::c_int)
        }))
    }

    /// Waits until the process has exited or `deadline` passed; whether
    /// it exited. A pidfd turns readable when its process ends.
    fn wait_exit(&self, deadline: Instant) -> bool {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd {
                fd: self.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd on a pidfd we own, for the call's length.
            let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(1000) as i32) };
            if n > 0 {
                return true;
            }
            let interrupted =
                n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted;
            if (n < 0 && !interrupted) || Instant::now() >= deadline {
                return false;
            }
        }
    }

    fn signal(&self, sig: libc::c_int) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: a pidfd we own, a signal number, no siginfo, no flags.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Sends `sig` to the VMM of `handle`, never to another process that now
/// has its pid: a pidfd is opened on the pid first, then the pid is checked
/// to still be the recorded process (start time). A process recorded
/// before the pidfd was opened cannot have been replaced by one that
/// passes the check, so the signal reaches the VMM or no one. Returns
/// whether it was sent.
pub fn signal(handle: &VmmHandle, sig: libc::c_int) -> bool {
    let Ok(pidfd) = PidFd::open(handle.pid) else {
        return false;
    };
    if !is_recorded(handle) {
        tracing::warn!(
            pid = handle.pid,
            "not signalling pid: it is no longer the VMM recorded (recycled)"
        );
        return false;
    }
    pidfd.signal(sig).is_ok()
}

/// Asks the VMM to stop, then makes sure it has: SIGKILL after a grace time.
pub fn stop(handle: &VmmHandle, child: Option<VmmChild>) {
    let _ = control::request(
        &handle.control_socket,
        &Request::Shutdown,
        Duration::from_secs(5),
    );
    reap_exiting(handle, child);
    let _ = std::fs::remove_file(&handle.control_socket);
}

/// Asks the VMM to exit (a shutdown request, answered before it ends)
/// and, if it does not answer within `limit`, kills it; returns without
/// waiting for the exit ([`reap_exiting`] does).
pub fn tell_to_exit(handle: &VmmHandle, limit: Duration) {
    if control::request(&handle.control_socket, &Request::Shutdown, limit).is_err() {
        signal(handle, libc::SIGKILL);
    }
}

/// Waits for the exit of a VMM told to exit (5 s at most, then SIGKILL)
/// and reaps it; its control socket's file is left alone.
pub fn reap_exiting(handle: &VmmHandle, child: Option<VmmChild>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    match child {
        Some(mut c) => {
            // Woken by the exit itself (a pidfd), not a polling interval:
            // a delete waits for the VMM's exit.
            match PidFd::open(c.id()) {
                Ok(fd) if c.try_wait().ok().flatten().is_none() => {
                    fd.wait_exit(deadline);
                }
                Ok(_) => {}
                Err(_) => {
                    while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        None => {
            // The pidfd is opened before the check that the pid is still
            // the VMM's, so it cannot be a recycled pid's.
            match PidFd::open(handle.pid) {
                Ok(fd) if is_recorded(handle) => {
                    fd.wait_exit(deadline);
                }
                Ok(_) => {}
                Err(_) => {
                    while alive(handle) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
            signal(handle, libc::SIGKILL);
        }
    }
}

/// A `torpor-vmm` process found by its log rather than a handle: its
/// stderr (the VMM's log, see [`spawn`]) is a file under some directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggingVmm {
    pub pid: u32,
    pub ppid: u32,
    pub start_time: Option<u64>,
    /// Its log, relative to the directory searched.
    pub log: PathBuf,
}

/// Every live `torpor-vmm` process whose log is under `root`: those a pod
/// started (a jailed VMM and its supervisor both log there), including
/// those it never recorded a handle for (it died between the spawn and
/// the record).
pub fn logging_under(root: &Path) -> Vec<LoggingVmm> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for pid in entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
    {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let (state, ppid) = (fields.next(), fields.next().and_then(|p| p.parse().ok()));
        if !head.ends_with("(torpor-vmm") || state == Some("Z") {
            continue;
        }
        let Ok(target) = std::fs::read_link(format!("/proc/{pid}/fd/2")) else {
            continue;
        };
        // A log removed under its writer reads `PATH (deleted)`.
        let text = target.to_string_lossy();
        let path = Path::new(text.strip_suffix(" (deleted)").unwrap_or(&text));
        let Ok(log) = path.strip_prefix(root) else {
            continue;
        };
        found.push(LoggingVmm {
            pid,
            ppid: ppid.unwrap_or(0),
            start_time: parse_stat_start(&stat),
            log: log.to_path_buf(),
        });
    }
    found
}

/// Ends the process `pid` had at start time `start` (SIGKILL; never a
/// recycled pid's) and waits up to `limit` for it to exit; whether it has.
pub fn kill_and_wait(pid: u32, start: Option<u64>, limit: Duration) -> bool {
    let Ok(pidfd) = PidFd::open(pid) else {
        return true;
    };
    if start.is_none() || !is_process(pid, start) {
        return true;
    }
    let _ = pidfd.signal(libc::SIGKILL);
    pidfd.wait_exit(Instant::now() + limit)
}

/// Proportional set size of a process in KiB, from
/// /proc/PID/smaps_rollup (None if it is gone). The one reader of PSS:
/// the pod's policy and metrics, and the benches.
pub fn pss_kib(pid: u32) -> Option<u64> {
    rollup_kib(pid, "Pss")
}

/// A field of /proc/PID/smaps_rollup (`Pss`, `Rss`, ...) in KiB; None if
/// the process is gone.
pub fn rollup_kib(pid: u32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    torpor_vmm_api::host::kib_field(&text, key)
}

/// Clock ticks per second: the unit of the CPU times in `/proc/PID/stat`.
pub fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as f64 }
}

/// The VMM's (utime, stime, starttime) in clock ticks, from
/// `/proc/PID/stat`; None when it is gone, or its pid names another
/// process now.
fn cpu_ticks(handle: &VmmHandle) -> Option<(f64, f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", handle.pid)).ok()?;
    // Fields after the command, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    // utime and stime are fields 14 and 15 of stat(5), starttime 22; the
    // list starts at field 3.
    let (utime, stime, start) = (ticks(11)?, ticks(12)?, ticks(19)?);
    if handle.start_time.is_some_and(|t| t as f64 != start) {
        return None;
    }
    Some((utime, stime, start))
}

/// CPU time the VMM of `handle` has used, in seconds (the history's CPU
/// rate is the difference of two readings).
pub fn cpu_seconds(handle: &VmmHandle) -> Option<f64> {
    let (utime, stime, _) = cpu_ticks(handle)?;
    let hz = clock_ticks_per_second();
    (hz > 0.0).then(|| (utime + stime) / hz)
}

/// What the VMM of `handle` uses now (a sandbox of `vcpus` vCPUs); None
/// when it is gone, or its pid names another process now.
pub fn usage(handle: &VmmHandle, vcpus: u32) -> Option<crate::model::SandboxUsage> {
    let (utime, stime, start) = cpu_ticks(handle)?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let hz = clock_ticks_per_second();
    let alive = uptime - start / hz;
    let cpu_used_pct = if alive > 0.0 && hz > 0.0 {
        ((utime + stime) / hz / alive / f64::from(vcpus.max(1)) * 100.0).min(100.0)
    } else {
        0.0
    };
    Some(crate::model::SandboxUsage { cpu_used_pct })
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

    /// A VMM that logs without end leaves at most `max` plus `max / 2`
    /// bytes: the log rotates under its appending writer.
    #[test]
    fn a_flooded_log_is_rotated_under_its_writer() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let log = dir.join("vmm.log");
        let mut writer = create_private(&log, None).unwrap();
        let line = [b'w'; 1000];
        for round in 0..20 {
            for _ in 0..100 {
                writer.write_all(&line).unwrap();
            }
            let rotated = cap_log(&log, 64_000).unwrap();
            assert!(rotated, "round {round}: 100 KB is past 64 KB");
            assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        }
        writer.write_all(b"last\n").unwrap();
        // Appends go to the new end: no hole where the old bytes were.
        assert_eq!(std::fs::read(&log).unwrap(), b"last\n");
        assert_eq!(
            std::fs::metadata(dir.join("vmm.log.1")).unwrap().len(),
            32_000
        );
        assert!(!cap_log(&log, 64_000).unwrap());
        assert!(!cap_log(&dir.join("missing"), 64_000).unwrap());
    }

    #[test]
    fn start_time_is_field_22() {
        let line = "4242 (torpor vmm (x)) S 1 4242 4242 0 -1 4194560 1234 99 7 0 5 6 0 0 20 0 3 0 987654 1000";
        assert_eq!(parse_stat_start(line), Some(987_654));
        assert_eq!(parse_stat_start("4242 (short) S 1 2"), None);
        assert!(start_time(std::process::id()).is_some());
    }

    /// A handle whose pid now belongs to another process (a recycled pid:
    /// same pid, other start time) is neither alive nor signalled; the
    /// right start time is.
    #[test]
    fn a_recycled_pid_is_not_killed() {
        let mut other = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .unwrap();
        let pid = other.id();
        let real = start_time(pid).expect("start time");
        let stale = VmmHandle {
            pid,
            start_time: Some(real.wrapping_sub(1)),
            control_socket: PathBuf::from("/nonexistent/ctl.sock"),
        };
        assert!(!alive(&stale));
        assert!(
            !signal(&stale, libc::SIGKILL),
            "a recycled pid was signalled"
        );
        stop(&stale, None);
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            other.try_wait().unwrap().is_none(),
            "the other process died"
        );
        // Without a start time only a torpor-vmm process is taken for one.
        let legacy = VmmHandle {
            start_time: None,
            ..stale.clone()
        };
        assert!(!alive(&legacy));
        assert!(!signal(&legacy, libc::SIGKILL));
        assert!(
            other.try_wait().unwrap().is_none(),
            "the other process died"
        );

        let right = VmmHandle {
            start_time: Some(real),
            ..stale
        };
        assert!(alive(&right));
        assert!(signal(&right, libc::SIGKILL));
        let status = other.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn a_seccomp_kill_is_named() {
        use std::os::unix::process::ExitStatusExt;
        let sigsys = exit_reason(std::process::ExitStatus::from_raw(libc::SIGSYS));
        assert!(sigsys.contains("seccomp violation"), "{sigsys}");
        let other = exit_reason(std::process::ExitStatus::from_raw(3 << 8));
        assert!(!other.contains("seccomp"), "{other}");
    }

    /// A VMM killed by SIGBUS or SIGSEGV (itself, or its jail's supervisor
    /// exiting 128 + the signal) hit a memory fault; so says its log when
    /// its status was not seen.
    #[test]
    fn a_memory_fault_is_named() {
        use std::os::unix::process::ExitStatusExt;
        for (raw, signal) in [
            (libc::SIGBUS, "SIGBUS"),
            ((128 + libc::SIGBUS) << 8, "SIGBUS"),
            (libc::SIGSEGV, "SIGSEGV"),
            ((128 + libc::SIGSEGV) << 8, "SIGSEGV"),
        ] {
            let reason = exit_reason(std::process::ExitStatus::from_raw(raw));
            assert!(
                reason.starts_with(&format!("its VMM hit a memory fault ({signal})")),
                "{reason}"
            );
            assert!(!reason.contains("seccomp"), "{reason}");
        }
        let tail = "torpor-vmm: memory fault (SIGBUS) at address 0x00007f0000001000 on the \
                    control thread; the VMM stops (SIGBUS)\n";
        let reason = exit_reason_from_log(tail).unwrap();
        assert!(
            reason.starts_with("its VMM hit a memory fault (SIGBUS)"),
            "{reason}"
        );
        let tail = "torpor-vmm: seccomp violation: system call 13 on the control thread";
        assert!(exit_reason_from_log(tail)
            .unwrap()
            .contains("seccomp violation"));
        assert_eq!(exit_reason_from_log("torpor-vmm: error: guest reset"), None);
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
