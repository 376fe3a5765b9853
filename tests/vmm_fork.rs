//! The VMM fork server (`torpor-vmm --fork-server`, how a pod starts its
//! VMMs by default): a forked VMM is the pod's own child, serves as an
//! exec'd one does, and its exit status (a seccomp kill) reaches the pod;
//! the server refuses malformed requests and goes on, is replaced when it
//! dies and after its share of forks; `SpawnMode::Exec` execs.

use std::io::{BufRead, IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::net::{
    recvmsg, sendmsg, AddressFamily, RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use rustix::process::{Pid, Signal, WaitOptions};
use torpor_scheduler::service::vmm;
use torpor_scheduler::service::vmm_process::{self, SpawnMode, VmmChild};
use torpor_vmm_api::fork::{ForkReply, ForkRequest, MAX_FORKS_PER_SERVER};

const VMM: &str = env!("CARGO_BIN_EXE_torpor-vmm");

/// The spawn mode and the fork servers are this process's: one test at a
/// time uses them.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("torpor-vmm-fork-{name}-"))
        .tempdir()
        .unwrap()
}

/// A VMM started by `vmm_process::start` with `spec` on its stdin: the
/// child, its reply line's reader, and its log's path.
fn start(dir: &Path, name: &str, spec: &str) -> (VmmChild, std::io::PipeReader, PathBuf) {
    let (spec_in, mut spec_out) = std::io::pipe().unwrap();
    let (reply_in, reply_out) = std::io::pipe().unwrap();
    let log = dir.join(format!("{name}.log"));
    let log_file = std::fs::File::create(&log).unwrap();
    let child = vmm_process::start(
        Path::new(VMM),
        spec_in.into(),
        reply_out.into(),
        log_file.into(),
    )
    .unwrap();
    spec_out.write_all(spec.as_bytes()).unwrap();
    (child, reply_in, log)
}

fn standby_spec(sock: &Path) -> String {
    serde_json::json!({
        "control_socket": sock,
        "mode": {"kind": "standby", "mem_mib": 64, "vcpus": 1}
    })
    .to_string()
}

fn reply_line(reply: std::io::PipeReader) -> String {
    let mut line = String::new();
    std::io::BufReader::new(reply).read_line(&mut line).unwrap();
    line
}

/// A /proc/PID/status field.
fn status_field(pid: u32, field: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
}

#[test]
fn a_forked_vmm_is_the_pods_child_serves_and_its_seccomp_kill_is_seen() {
    let _one = serial();
    vmm_process::set_spawn_mode(SpawnMode::Fork);
    let dir = scratch("child");
    let sock = dir.path().join("ctl.sock");
    let (mut child, reply, log) = start(dir.path(), "standby", &standby_spec(&sock));
    let line = reply_line(reply);
    assert!(line.contains("\"ready\""), "{line}");
    assert!(child.forked(), "not forked");
    let pid = child.id();
    assert!(line.contains(&format!("\"pid\":{pid}")), "{line}");
    // CLONE_PARENT: this process is its parent, not the fork server.
    assert_eq!(
        status_field(pid, "PPid"),
        Some(std::process::id().to_string())
    );
    assert_ne!(
        vmm_process::fork_server_pid(Path::new(VMM)),
        Some(pid),
        "the server forked itself away"
    );
    // In a process group of its own.
    let pgid = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &pgid[pgid.rfind(')').unwrap() + 2..];
    assert_eq!(after.split(' ').nth(2), Some(pid.to_string().as_str()));
    // Named as an exec'd VMM, the server not.
    assert_eq!(status_field(pid, "Name").as_deref(), Some("torpor-vmm"));
    let server = vmm_process::fork_server_pid(Path::new(VMM)).unwrap();
    assert_eq!(
        status_field(server, "Name").as_deref(),
        Some("torpor-vmm-fork")
    );
    // Its stderr is the log it was given.
    let err = std::fs::read_link(format!("/proc/{pid}/fd/2")).unwrap();
    assert_eq!(err, log);
    // It serves its control socket as an exec'd standby shell does.
    let status = torpor_vmm_api::control::request(
        &sock,
        &torpor_vmm_api::control::Request::Status,
        Duration::from_secs(5),
    );
    assert!(status.is_ok(), "{status:?}");
    // What a seccomp kill looks like reaches this process as its parent,
    // whichever thread the signal lands on: sent to a thread without a
    // filter where there is one (the handler's trap is then allowed, and
    // the process must die of SIGSYS all the same), else to the process.
    let unfiltered = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| t.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|tid| {
            std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).is_ok_and(|s| {
                s.lines()
                    .any(|l| l.split_whitespace().eq(["Seccomp:", "0"]))
            })
        });
    match unfiltered {
        Some(tid) => {
            // SAFETY: tgkill takes no pointers; the thread is the child's.
            let rc = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGSYS) };
            assert_eq!(rc, 0);
        }
        None => {
            rustix::process::kill_process(Pid::from_raw(pid as i32).unwrap(), Signal::SYS).unwrap()
        }
    }
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGSYS), "{status}");
    let reason = vmm::exit_reason(status);
    assert!(reason.contains("seccomp"), "{reason}");
    assert!(child.try_wait().unwrap().is_some());
    child.kill().unwrap();
}

#[test]
fn a_bad_spec_fails_as_from_an_exec_and_exec_mode_execs() {
    let _one = serial();
    let dir = scratch("modes");
    for mode in [SpawnMode::Fork, SpawnMode::Exec] {
        vmm_process::set_spawn_mode(mode);
        let (mut child, reply, _) = start(dir.path(), "bad", "{\"mode\": 7}");
        let line = reply_line(reply);
        assert!(line.contains("\"failed\""), "{mode:?}: {line}");
        assert_eq!(child.forked(), mode == SpawnMode::Fork);
        assert_eq!(child.wait().unwrap().code(), Some(1), "{mode:?}");
    }
    vmm_process::set_spawn_mode(SpawnMode::Fork);
}

#[test]
fn a_dead_fork_server_is_replaced_and_a_worn_one_retired() {
    let _one = serial();
    vmm_process::set_spawn_mode(SpawnMode::Fork);
    let dir = scratch("replace");
    let exe = Path::new(VMM);
    let once = |name: &str| {
        let (mut child, reply, _) = start(dir.path(), name, "{}");
        assert!(reply_line(reply).contains("\"failed\""));
        assert!(child.forked());
        child.wait().unwrap();
    };
    once("first");
    let server = vmm_process::fork_server_pid(exe).expect("a fork server");
    rustix::process::kill_process(Pid::from_raw(server as i32).unwrap(), Signal::KILL).unwrap();
    // Its socket fails: a new server forks this one.
    once("after-kill");
    let next = vmm_process::fork_server_pid(exe).expect("a new fork server");
    assert_ne!(next, server);
    // The killed one was reaped by its retirement.
    assert_eq!(status_field(server, "State"), None);
    // Past its share of forks a server is retired for a new one (a new
    // address-space layout).
    let mut seen = vec![next];
    for i in 0..=MAX_FORKS_PER_SERVER {
        once(&format!("wear-{i}"));
        if let Some(p) = vmm_process::fork_server_pid(exe) {
            if !seen.contains(&p) {
                seen.push(p);
            }
        }
    }
    assert!(
        seen.len() >= 2,
        "no server retired after its share: {seen:?}"
    );
    let first = status_field(next, "State");
    assert_eq!(first, None, "the retired server still runs");
}

/// The fork server by hand on a socket pair.
struct Server {
    socket: OwnedFd,
    process: std::process::Child,
}

impl Server {
    fn start() -> Self {
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let process = Command::new(VMM)
            .arg("--fork-server")
            .stdin(Stdio::from(theirs))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Server {
            socket: ours,
            process,
        }
    }

    fn ask(&self, body: &[u8], fds: &[&OwnedFd]) -> ForkReply {
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !borrowed.is_empty() {
            assert!(control.push(SendAncillaryMessage::ScmRights(&borrowed)));
        }
        sendmsg(
            &self.socket,
            &[IoSlice::new(body)],
            &mut control,
            SendFlags::empty(),
        )
        .unwrap();
        let mut buf = [0u8; 4096];
        let mut none = RecvAncillaryBuffer::default();
        let got = recvmsg(
            &self.socket,
            &mut [IoSliceMut::new(&mut buf)],
            &mut none,
            RecvFlags::empty(),
        )
        .unwrap();
        ForkReply::from_bytes(&buf[..got.bytes]).unwrap()
    }
}

#[test]
fn the_fork_server_refuses_malformed_requests_goes_on_and_ends_with_its_socket() {
    let server = Server::start();
    let (r, w) = std::io::pipe().unwrap();
    let (a, b): (OwnedFd, OwnedFd) = (r.into(), w.into());
    let fork = ForkRequest::Fork {}.to_bytes();
    match server.ask(&fork, &[&a]) {
        ForkReply::Failed { message, .. } => {
            assert!(message.contains("3 descriptors"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    match server.ask(b"{\"op\":\"exec\",\"argv\":[\"/bin/sh\"]}", &[&a, &b, &b]) {
        ForkReply::Failed { message, .. } => {
            assert!(message.contains("not a fork request"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // Still serving: a real fork, whose child (this process's: CLONE_PARENT)
    // reads an empty spec from `a` once `b` is closed, fails and exits 1.
    let (reply_in, reply_out) = std::io::pipe().unwrap();
    let reply_out: OwnedFd = reply_out.into();
    let pid = match server.ask(&fork, &[&a, &reply_out, &reply_out]) {
        ForkReply::Forked { pid } => pid,
        other => panic!("{other:?}"),
    };
    drop((a, b, reply_out));
    assert!(reply_line(reply_in).contains("\"failed\""));
    let (_, status) = rustix::process::waitpid(Pid::from_raw(pid as i32), WaitOptions::empty())
        .unwrap()
        .expect("its status");
    assert_eq!(
        std::process::ExitStatus::from_raw(status.as_raw()).code(),
        Some(1)
    );
    // The pod closes its end: the server exits 0, having said nothing.
    let Server {
        socket,
        mut process,
    } = server;
    drop(socket);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = process.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the fork server did not exit");
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    process
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "{status}: {err}");
}
