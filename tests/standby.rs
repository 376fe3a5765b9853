//! Standby VMMs: a pre-created VM shell restores a snapshot on request and
//! continues the probe's exact sequence; bad requests leave it usable.

mod common;

use std::time::Duration;

use common::snap::{assert_exact_sequence, Vm};
use common::{wait_for, wait_for_line, Scratch, Vmm};
use torpor_vmm::control::{call, request, Request, VmState};
use torpor_vmm_api::{Console, ErrorKind, MemoryBackend, RestoreSpec};

const T: Duration = Duration::from_secs(30);

fn template(dir: &Scratch, mem: &str) -> (std::path::PathBuf, u64) {
    let vm = Vm::boot(
        dir,
        &format!("source{mem}"),
        &["--mem-mib", mem, "--cmdline", "probe.mib=2 probe.ticks=5"],
    );
    vm.wait_iter(3);
    vm.pause();
    let snap = dir.path(&format!("template{mem}"));
    vm.snapshot(&snap, false);
    let last = vm.iterations().last().unwrap().0;
    vm.shutdown();
    (snap, last)
}

fn standby_restores(backend: &str) {
    let dir = Scratch::new(&format!("standby-{backend}"));
    let (snap, last) = template(&dir, "64");
    let (other_size, _) = template(&dir, "32");
    let sock = dir.path("standby.sock");
    let vmm = Vmm::spawn(&[
        "--standby",
        "--mem-mib",
        "64",
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    wait_for(T, || request(&sock, &Request::Status, T).is_ok());
    assert_eq!(
        request(&sock, &Request::Status, T).unwrap().state,
        VmState::Standby
    );

    let backend: MemoryBackend = backend.parse().unwrap();
    let restore = |snapshot: &std::path::Path, backend: MemoryBackend| Request::Restore {
        restore: RestoreSpec::new(snapshot, backend),
        console: Console::file(dir.path("clone.log")),
        paused: false,
    };
    // Wrong size, unknown backend, missing snapshot: refused with their
    // kinds, still standby.
    let err = call(&sock, &restore(&other_size, backend), T).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
    assert!(err.to_string().contains("is for 32 MiB"), "{err}");
    let floppy = format!(
        r#"{{"op":"restore","snapshot":"{}","backend":"floppy"}}"#,
        snap.display()
    );
    let answer = raw_request(&sock, &floppy);
    assert!(answer.contains(r#""kind":"invalid_request""#), "{answer}");
    assert!(answer.contains("floppy"), "{answer}");
    let err = call(&sock, &restore(&dir.path("nope"), backend), T).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadSnapshot, "{err}");
    assert!(err.to_string().contains("nope/state"), "{err}");
    assert_eq!(
        request(&sock, &Request::Status, T).unwrap().state,
        VmState::Standby
    );

    let answer = call(&sock, &restore(&snap, backend), T).unwrap();
    let info = answer.restore.expect("restore timings");
    assert!(info.request_to_running_us > 0);
    assert_eq!(answer.status.unwrap().state, VmState::Running);
    let console = dir.path("clone.log");
    wait_for_line(&console, T, |l| {
        l.starts_with(&format!("TORPOR-PROBE ITER n={} ", last + 3))
    });
    let seen = common::probe_iterations(&std::fs::read_to_string(&console).unwrap());
    assert_eq!(seen[0].0, last + 1);
    assert_exact_sequence(&seen, 2);
    // It is now an ordinary VM: a second restore is refused.
    let err = call(&sock, &restore(&snap, backend), T)
        .unwrap_err()
        .to_string();
    assert!(err.contains("already runs a VM"), "{err}");
    request(&sock, &Request::Shutdown, T).unwrap();
    let out = vmm.wait(T);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One raw request line and its raw answer line.
fn raw_request(sock: &std::path::Path, line: &str) -> String {
    use std::io::{BufRead, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(sock).unwrap();
    stream.set_read_timeout(Some(T)).unwrap();
    stream.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut answer = String::new();
    std::io::BufReader::new(stream)
        .read_line(&mut answer)
        .unwrap();
    answer
}

#[test]
fn standby_shell_restores_file_backend() {
    standby_restores("file");
}

#[test]
fn standby_shell_restores_uffd_backend() {
    standby_restores("uffd");
}

#[test]
fn standby_shell_shuts_down_cleanly() {
    let dir = Scratch::new("standby-shutdown");
    let sock = dir.path("s.sock");
    let vmm = Vmm::spawn(&[
        "--standby",
        "--mem-mib",
        "32",
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    wait_for(T, || request(&sock, &Request::Status, T).is_ok());
    let err = call(&sock, &Request::Pause, T).unwrap_err().to_string();
    assert!(err.contains("on standby"), "{err}");
    request(&sock, &Request::Shutdown, T).unwrap();
    let out = vmm.wait(T);
    assert_eq!(out.status.code(), Some(0));
    assert!(!sock.exists());
}
