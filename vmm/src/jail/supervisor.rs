//! The jailed VMM's supervisor: with a pid namespace the VMM is a forked
//! child (pid 1 of its namespace) and the process the pod started stays
//! outside, unprivileged work aside: it waits for the VMM, reports an OOM
//! kill by its exit status, removes the cgroup, and exits as the VMM did.

use std::sync::atomic::{AtomicI32, Ordering};

use super::cgroup::Cgroup;
use super::{sys, JailError, EXIT_OOM};

/// The signals the supervisor passes on and the VMM ends on.
const TERMINATING: [libc::c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// The VMM's pid, for the supervisor's signal handler.
static VMM_PID: AtomicI32 = AtomicI32::new(0);

/// Passes a termination signal on to the VMM, so the supervisor outlives
/// it and cleans up.
extern "C" fn forward(signal: libc::c_int) {
    let pid = VMM_PID.load(Ordering::Relaxed);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(pid, signal) };
    }
}

/// The VMM's end on a termination signal. As pid 1 of its namespace it
/// would ignore one it has no handler for (the kernel protects a
/// namespace's init), so the supervisor's forwarded SIGTERM, SIGINT or
/// SIGHUP — `torpor vmm` stopped with Ctrl-C or `kill` — would leave it
/// running: it exits as the default action would have ended it.
extern "C" fn end_on(signal: libc::c_int) {
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(128 + signal) };
}

/// Forks the VMM into a new pid namespace. Returns, in the VMM, its pid as
/// seen from outside; the supervisor never returns.
pub fn fork_supervised(cgroup: Option<&Cgroup>) -> Result<u32, JailError> {
    let baseline = cgroup.map_or(0, Cgroup::oom_kills);
    // SAFETY: unshare takes flags only.
    let ret = unsafe { libc::unshare(libc::CLONE_NEWPID) };
    sys(ret, || "unshare the pid namespace".into())?;
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    let ret = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    sys(ret, || "make a pipe".into())?;
    let [read_end, write_end] = fds;
    // SAFETY: the process is single-threaded (checked by the caller's
    // contract), so the child may run Rust code after fork.
    let pid = unsafe { libc::fork() };
    sys(pid, || "fork the jailed VMM".into())?;
    if pid == 0 {
        // SAFETY: closing our copy of the write end; prctl with integers.
        unsafe {
            libc::close(write_end);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        }
        let mut buf = [0u8; 4];
        // SAFETY: reads at most 4 bytes into `buf`.
        let n = unsafe { libc::read(read_end, buf.as_mut_ptr().cast(), buf.len()) };
        // SAFETY: closing a descriptor we own.
        unsafe { libc::close(read_end) };
        if n != 4 {
            // The supervisor died before telling: nobody waits for us.
            std::process::exit(1);
        }
        for signal in TERMINATING {
            // SAFETY: the handler only calls _exit.
            unsafe { libc::signal(signal, end_on as *const () as libc::sighandler_t) };
        }
        return Ok(u32::from_ne_bytes(buf));
    }
    let bytes = (pid as u32).to_ne_bytes();
    // SAFETY: writes 4 bytes from `bytes`; closes descriptors we own. The
    // supervisor's stdin and stdout go to /dev/null: the pod sees the end
    // of the VMM's reply pipe when the VMM's own copy closes.
    unsafe {
        libc::close(read_end);
        libc::write(write_end, bytes.as_ptr().cast(), bytes.len());
        libc::close(write_end);
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            libc::dup2(null, 0);
            libc::dup2(null, 1);
            libc::close(null);
        }
    }
    VMM_PID.store(pid, Ordering::Relaxed);
    for signal in TERMINATING {
        // SAFETY: the handler only loads an atomic and calls kill.
        unsafe { libc::signal(signal, forward as *const () as libc::sighandler_t) };
    }
    let code = wait_for(pid, cgroup, baseline);
    if let Some(c) = cgroup {
        c.remove();
    }
    std::process::exit(code)
}

/// The VMM's exit status as the supervisor's: its code, [`EXIT_OOM`] for
/// an OOM kill in its cgroup, 128 + signal otherwise.
fn wait_for(pid: libc::pid_t, cgroup: Option<&Cgroup>, baseline: u64) -> i32 {
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child, writing its status.
        let ret = unsafe { libc::waitpid(pid, &mut status, 0) };
        if ret == pid {
            break;
        }
        if ret < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return 1;
        }
    }
    if libc::WIFEXITED(status) {
        return libc::WEXITSTATUS(status);
    }
    let signal = libc::WTERMSIG(status);
    let oom = cgroup.is_some_and(|c| c.oom_kills() > baseline);
    if signal == libc::SIGKILL && oom {
        eprintln!(
            "torpor-vmm: the VMM was killed by the OOM killer: its cgroup reached its \
             memory limit"
        );
        return EXIT_OOM;
    }
    eprintln!("torpor-vmm: the VMM was killed by signal {signal}");
    128 + signal
}
