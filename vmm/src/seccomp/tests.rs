//! The filters compile, and confine: each case runs in a forked child
//! that installs one filter and makes one call; the parent checks how the
//! child ended.

use super::*;
use crate::confine::needs;

/// Set in the environment of a test process started by
/// [`run_in_confined_child`].
const CHILD_ENV: &str = "TORPOR_SECCOMP_TEST_CHILD";

/// For a test that checks real device code under its filter: true in the
/// child process [`run_in_confined_child`] started, with the filters set
/// up (enforced) so the device's threads install theirs as they start.
/// The test then runs its scenario; in the parent it calls
/// [`run_in_confined_child`] instead.
pub(crate) fn confined_child() -> bool {
    if std::env::var_os(CHILD_ENV).is_none() {
        return false;
    }
    init(SeccompLevel::Enforce, needs).expect("set the filters up");
    true
}

/// Runs test `name` (its full path) alone in a new process of this test
/// binary where [`confined_child`] is true; a system call outside a
/// filter kills that process with SIGSYS and fails this test.
pub(crate) fn run_in_confined_child(name: &str) {
    let status = confined_child_command(name)
        .status()
        .expect("run the confined test");
    use std::os::unix::process::ExitStatusExt;
    assert!(
        status.success(),
        "{name} under enforced seccomp filters: {status}{}",
        if status.signal() == Some(libc::SIGSYS) {
            " (a system call outside the allow-list; `dmesg | grep type=1326` names it)"
        } else {
            ""
        }
    );
}

/// The command that runs test `name` alone where [`confined_child`] is
/// true.
fn confined_child_command(name: &str) -> std::process::Command {
    let exe = std::env::current_exe().expect("the test binary");
    let mut command = std::process::Command::new(exe);
    command
        .args([name, "--exact", "--test-threads=1", "--nocapture"])
        .env(CHILD_ENV, "1");
    command
}

/// Forks; the child installs `kind`'s enforcing filter, runs `call` and
/// exits 0. Returns the child's wait status.
fn in_confined_child(kind: ThreadKind, call: impl FnOnce()) -> i32 {
    let program = compile(kind, needs(kind), SeccompAction::KillProcess).unwrap();
    // SAFETY: the child only makes raw system calls (no allocation, no
    // locks another thread may hold) before it _exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        if seccompiler::apply_filter(&program).is_err() {
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(3) };
        }
        call();
        // SAFETY: as above.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child with a valid status pointer.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    status
}

fn killed_by_sigsys(status: i32) -> bool {
    libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS
}

fn exited_cleanly(status: i32) -> bool {
    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}

#[test]
fn every_kind_compiles_for_every_level() {
    for kind in ThreadKind::ALL {
        for action in [SeccompAction::KillProcess, SeccompAction::Log] {
            let program = compile(kind, needs(kind), action).unwrap();
            assert!(!program.is_empty(), "{kind:?}");
        }
    }
}

#[test]
fn nobody_may_exec_fork_or_open_network_sockets() {
    for kind in ThreadKind::ALL {
        let rules = kind.rules(needs(kind)).unwrap();
        for forbidden in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_fork,
            libc::SYS_vfork,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_ptrace,
            libc::SYS_bind,
            libc::SYS_listen,
        ] {
            assert!(
                !rules.allows(forbidden),
                "{kind:?} allows syscall {forbidden}"
            );
        }
        if rules.allows(libc::SYS_socket) {
            assert!(rules.is_conditional(libc::SYS_socket), "{kind:?}");
        }
        assert!(rules.is_conditional(libc::SYS_mmap), "{kind:?}");
        assert!(rules.is_conditional(libc::SYS_mprotect), "{kind:?}");
        if rules.allows(libc::SYS_ioctl) {
            assert!(rules.is_conditional(libc::SYS_ioctl), "{kind:?}");
        }
    }
}

#[test]
fn an_allowed_call_runs_and_a_forbidden_one_kills() {
    let ok = in_confined_child(ThreadKind::Vcpu, || {
        // SAFETY: getpid has no preconditions.
        unsafe { libc::getpid() };
    });
    assert!(exited_cleanly(ok), "status {ok:#x}");
    let killed = in_confined_child(ThreadKind::Vcpu, || {
        // SAFETY: socket(2) takes no pointers.
        unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
    });
    assert!(killed_by_sigsys(killed), "status {killed:#x}");
}

#[test]
fn ioctls_are_filtered_by_request() {
    let run = in_confined_child(ThreadKind::Vcpu, || {
        // SAFETY: an ioctl on fd -1 fails with EBADF; nothing is touched.
        unsafe { libc::ioctl(-1, ioctls::kvm_run() as _, 0) };
    });
    assert!(exited_cleanly(run), "KVM_RUN: status {run:#x}");
    let tiocsti = in_confined_child(ThreadKind::Vcpu, || {
        // SAFETY: as above.
        unsafe { libc::ioctl(-1, libc::TIOCSTI as _, 0) };
    });
    assert!(killed_by_sigsys(tiocsti), "TIOCSTI: status {tiocsti:#x}");
}

#[test]
fn memory_may_not_become_executable() {
    let map = |prot: i32| {
        move || {
            // SAFETY: a fresh anonymous mapping, never dereferenced.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    prot,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
        }
    };
    let rw = in_confined_child(ThreadKind::Control, map(libc::PROT_READ | libc::PROT_WRITE));
    assert!(exited_cleanly(rw), "status {rw:#x}");
    let rx = in_confined_child(ThreadKind::Control, map(libc::PROT_READ | libc::PROT_EXEC));
    assert!(killed_by_sigsys(rx), "status {rx:#x}");
}

#[test]
fn vsock_may_open_unix_sockets_only() {
    let socket = |family: i32| {
        move || {
            // SAFETY: socket(2) takes no pointers.
            unsafe { libc::socket(family, libc::SOCK_STREAM, 0) };
        }
    };
    let unix = in_confined_child(ThreadKind::Vsock, socket(libc::AF_UNIX));
    assert!(exited_cleanly(unix), "status {unix:#x}");
    let inet = in_confined_child(ThreadKind::Vsock, socket(libc::AF_INET));
    assert!(killed_by_sigsys(inet), "status {inet:#x}");
}

/// `| `kind` | syscalls | with argument rules | ioctl requests |` rows of
/// docs/security.md: the documented counts are the filters' own.
#[test]
fn the_documented_counts_are_the_filters() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/security.md"))
        .expect("docs/security.md");
    let missing: Vec<String> = ThreadKind::ALL
        .into_iter()
        .map(|kind| {
            let rules = kind.rules(needs(kind)).unwrap();
            let syscalls = rules.syscalls().count();
            let conditional = rules
                .syscalls()
                .filter(|&s| rules.is_conditional(s))
                .count();
            let ioctls = rules.rule_count(libc::SYS_ioctl);
            format!(
                "| `{}` | {syscalls} | {conditional} | {ioctls} |",
                kind.name()
            )
        })
        .filter(|row| !doc.lines().any(|l| l.starts_with(row)))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/security.md lacks rows starting:\n{}",
        missing.join("\n")
    );
}

/// A page that cannot be read (here past the end of the file it maps; in
/// production a page of a full tmpfs) faults with SIGBUS. Rust std's
/// handler answered it with `rt_sigaction`, which no filter allows: the
/// VMM died of SIGSYS, as if it had broken its allow-list. The VMM's own
/// handler names the fault on stderr and lets it kill with SIGBUS.
#[test]
fn a_memory_fault_on_a_filtered_thread_kills_with_its_own_signal() {
    const NAME: &str =
        "seccomp::tests::a_memory_fault_on_a_filtered_thread_kills_with_its_own_signal";
    if confined_child() {
        // SAFETY: a NUL-terminated name and no flags.
        let fd = unsafe { libc::memfd_create(c"empty".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: a new shared read-only mapping of one page of an empty
        // file: any read of it faults with SIGBUS, which is the point.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED);
        let address = page as usize;
        println!("mapped at {address:#018x}");
        std::thread::spawn(move || {
            enter(ThreadKind::Control);
            // SAFETY: the page is mapped (read-only, past the file's end):
            // the read faults, and the process ends of it.
            unsafe { std::ptr::read_volatile(address as *const u8) };
        })
        .join()
        .unwrap();
        panic!("reading a page past the end of its file did not fault");
    }
    let out = confined_child_command(NAME)
        .output()
        .expect("run the confined test");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGBUS),
        "the faulting child ended with {} (SIGSYS is {}); stderr: {stderr}",
        out.status,
        libc::SIGSYS
    );
    let address = stdout
        .lines()
        .find_map(|l| l.split("mapped at ").nth(1))
        .expect("the child printed its mapping");
    let report = format!(
        "torpor-vmm: memory fault (SIGBUS) at address {address} on the control thread; \
         the VMM stops (SIGBUS)"
    );
    assert!(stderr.contains(&report), "{report:?} not in: {stderr}");
}
