//! Per-thread seccomp filters (docs/security.md), on real VMMs:
//!
//! - every thread of a VMM the service started runs filtered
//!   (`/proc/PID/task/*/status`: `Seccomp: 2`, at least one filter, and
//!   `NoNewPrivs: 1`), the vCPU, control and main threads among them;
//! - a forbidden system call (the debug-build `DebugForbiddenSyscall`
//!   control request) kills only that VMM, with SIGSYS; the service marks
//!   its sandbox failed with the reason, and another sandbox runs on;
//! - `torpor vmm` enforces by default, and `--seccomp off` is the only way
//!   to run unfiltered (it warns; the same request then comes back
//!   refused, the VMM alive).

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::http::{request, HttpResponse};
use common::serve::{DataDir, ServeProcess};
use common::{wait_for_line, Scratch, Vmm};
use serde_json::Value;
use torpor_vmm::control::{self, Request, VmState};

const TOKEN: &str = "seccomp-test-token";
const WAIT: Duration = Duration::from_secs(30);
const CTL: Duration = Duration::from_secs(10);

fn call(s: &ServeProcess, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
    request(&s.addr, method, path, Some(TOKEN), body)
}

/// A service whose policy loop runs often: it is what notices a VMM died.
fn serve(name: &str) -> (DataDir, ServeProcess) {
    let data = DataDir::new(name);
    let serve = ServeProcess::start(&data.0, &["--token", TOKEN, "--policy-interval-ms", "100"]);
    (data, serve)
}

fn create_probe(s: &ServeProcess) -> Value {
    let r = call(s, "POST", "/v1/sandboxes", Some(r#"{"template":"probe"}"#));
    assert_eq!(r.status, 201, "{}", r.body);
    r.json()
}

fn sandbox(s: &ServeProcess, id: &str) -> Value {
    let r = call(s, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// The pid and control socket of a sandbox's VMM.
fn vmm_of(sandbox: &Value) -> (u32, PathBuf) {
    let vmm = &sandbox["vmm"];
    let pid = vmm["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("no VMM: {sandbox}")) as u32;
    let socket = PathBuf::from(vmm["control_socket"].as_str().expect("control socket"));
    (pid, socket)
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

/// `key:\tvalue` of a /proc status file.
fn field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

/// (thread name, status) of every thread of `pid`.
fn threads(pid: u32) -> Vec<(String, String)> {
    let dir = format!("/proc/{pid}/task");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir}: {e}")) {
        let task = entry.unwrap().path();
        let (Ok(status), Ok(comm)) = (
            std::fs::read_to_string(task.join("status")),
            std::fs::read_to_string(task.join("comm")),
        ) else {
            continue; // a thread that just ended
        };
        out.push((comm.trim().to_string(), status));
    }
    out
}

#[test]
fn every_thread_of_a_service_vmm_is_filtered() {
    let (_data, s) = serve("seccomp-status");
    let created = create_probe(&s);
    let (pid, socket) = vmm_of(&created);
    // A status answer comes once the VM runs, so every thread is up.
    let status = control::request(&socket, &Request::Status, CTL).unwrap();
    assert_eq!(status.state, VmState::Running);
    let threads = threads(pid);
    let names: Vec<&str> = threads.iter().map(|(n, _)| n.as_str()).collect();
    for expected in ["torpor-vmm", "vcpu0", "control"] {
        assert!(names.contains(&expected), "no {expected} thread: {names:?}");
    }
    for (name, status) in &threads {
        assert_eq!(
            field(status, "Seccomp"),
            Some("2"),
            "thread {name} of VMM {pid} is not in seccomp filter mode"
        );
        let filters: u32 = field(status, "Seccomp_filters")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("thread {name}: no Seccomp_filters line"));
        assert!(filters >= 1, "thread {name} has {filters} filters");
        assert_eq!(field(status, "NoNewPrivs"), Some("1"), "thread {name}");
    }
}

#[test]
fn a_forbidden_syscall_kills_only_that_vmm() {
    let (_data, s) = serve("seccomp-kill");
    let victim = create_probe(&s);
    let bystander = create_probe(&s);
    let victim_id = victim["id"].as_str().unwrap().to_string();
    let bystander_id = bystander["id"].as_str().unwrap().to_string();
    let (victim_pid, victim_socket) = vmm_of(&victim);
    let (bystander_pid, bystander_socket) = vmm_of(&bystander);

    // The VMM dies before it can answer.
    let answer = control::call(&victim_socket, &Request::DebugForbiddenSyscall, CTL);
    assert!(
        answer.is_err(),
        "the VMM answered a forbidden system call: {answer:?}"
    );
    let deadline = Instant::now() + WAIT;
    let failed = loop {
        let v = sandbox(&s, &victim_id);
        if v["state"] == "failed" {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "the sandbox was not marked failed in {WAIT:?}: {v}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!alive(victim_pid), "VMM {victim_pid} still runs");
    let reason = failed["failure_reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("seccomp violation") && reason.contains("SIGSYS"),
        "failure reason: {failed}"
    );

    // The other sandbox runs on, its guest too.
    assert!(alive(bystander_pid));
    assert_eq!(sandbox(&s, &bystander_id)["state"], "running");
    let before = control::request(&bystander_socket, &Request::Status, CTL).unwrap();
    assert_eq!(before.state, VmState::Running);
    let console = PathBuf::from(&_data.0)
        .join("sandboxes")
        .join(&bystander_id)
        .join("console.log");
    let iterations = || {
        std::fs::read_to_string(&console)
            .unwrap_or_default()
            .matches("TORPOR-PROBE ITER")
            .count()
    };
    let seen = iterations();
    let deadline = Instant::now() + WAIT;
    while iterations() <= seen {
        assert!(
            Instant::now() < deadline,
            "the other sandbox's guest stopped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn probe_vmm(dir: &Scratch, extra: &[&str]) -> (Vmm, PathBuf) {
    let serial = dir.path("console.log");
    let sock = dir.path("ctl.sock");
    let mut args = vec![
        "--kernel",
        "builtin:probe",
        "--mem-mib",
        "32",
        "--cmdline",
        "probe.mib=1 probe.ticks=2",
        "--serial",
        serial.to_str().unwrap(),
        "--control-socket",
        sock.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let vmm = Vmm::spawn(&args);
    wait_for_line(&serial, WAIT, |l| l.starts_with("TORPOR-PROBE ITER n=1 "));
    (vmm, sock)
}

#[test]
fn torpor_vmm_enforces_by_default_and_off_is_explicit() {
    let dir = Scratch::new("seccomp-vmm-default");
    let (vmm, sock) = probe_vmm(&dir, &[]);
    assert!(control::call(&sock, &Request::DebugForbiddenSyscall, CTL).is_err());
    let out = vmm.wait(WAIT);
    assert_eq!(out.status.signal(), Some(libc::SIGSYS), "{:?}", out.status);
    // Before it dies, the VMM names the call and the thread that made it
    // (socket(2) from the control thread).
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "seccomp violation: system call {} on the control thread",
            libc::SYS_socket
        )),
        "{stderr}"
    );

    let dir = Scratch::new("seccomp-vmm-off");
    let (vmm, sock) = probe_vmm(&dir, &["--seccomp", "off"]);
    let e = control::call(&sock, &Request::DebugForbiddenSyscall, CTL).unwrap_err();
    assert!(e.to_string().contains("filters are off"), "{e}");
    assert_eq!(
        control::request(&sock, &Request::Status, CTL)
            .unwrap()
            .state,
        VmState::Running
    );
    control::request(&sock, &Request::Shutdown, CTL).unwrap();
    let out = vmm.wait(WAIT);
    assert!(out.status.success(), "{:?}", out.status);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: --seccomp off"),
        "no warning: {stderr}"
    );
}
