//! The SIGSYS handler behind enforced filters: names the forbidden call and
//! the thread that made it, then lets the kernel kill the process.
//!
//! The handler runs on the offending thread, under that thread's filter,
//! so it uses only `write(2)` (in every allow-list) on a stack buffer and
//! then makes a call no filter allows. SIGSYS is blocked while its handler
//! runs, and a seccomp trap that finds SIGSYS blocked resets it to the
//! default action and delivers it: the process dies of SIGSYS, exactly as
//! under `SECCOMP_RET_KILL_PROCESS`.

use super::{ThreadKind, INSTALLED};

/// `siginfo_t` for SIGSYS on x86_64 and aarch64: `si_signo`, `si_errno`,
/// `si_code`, padding, then `_sigsys { void *_call_addr; int _syscall;
/// unsigned int _arch; }`: the syscall number is the 32-bit word at
/// byte 24.
const SI_SYSCALL_OFFSET: usize = 24;

/// Installs [`on_sigsys`] for the whole process. Call before any thread
/// enters a filter (rt_sigaction is in no allow-list).
pub(super) fn install_handler() -> std::io::Result<()> {
    // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigsys as *const () as usize;
    action.sa_flags = libc::SA_SIGINFO;
    // SAFETY: `action` is initialised and outlives the call; the handler
    // is async-signal-safe (see `on_sigsys`).
    let rc = unsafe { libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Formats the report into `buf` without allocating; returns its length.
fn format_report(buf: &mut [u8; 160], syscall: i32, kind: Option<ThreadKind>) -> usize {
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        let n = bytes.len().min(buf.len() - len);
        buf[len..len + n].copy_from_slice(&bytes[..n]);
        len += n;
    };
    put(b"torpor-vmm: seccomp violation: system call ");
    let mut digits = [0u8; 12];
    let mut at = digits.len();
    let mut value = syscall.unsigned_abs();
    loop {
        at -= 1;
        digits[at] = b'0' + (value % 10) as u8;
        value /= 10;
        if value == 0 {
            break;
        }
    }
    if syscall < 0 {
        at -= 1;
        digits[at] = b'-';
    }
    put(&digits[at..]);
    put(b" on the ");
    put(kind.map_or("unfiltered", ThreadKind::name).as_bytes());
    put(b" thread is outside its allow-list; the VMM stops (SIGSYS)\n");
    len
}

extern "C" fn on_sigsys(_signal: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for an SA_SIGINFO
    // handler; for a seccomp SIGSYS its `_sigsys` member is filled in.
    let syscall = unsafe {
        (info as *const u8)
            .add(SI_SYSCALL_OFFSET)
            .cast::<i32>()
            .read_unaligned()
    };
    let kind = INSTALLED.with(|k| k.get());
    let mut buf = [0u8; 160];
    let len = format_report(&mut buf, syscall, kind);
    // SAFETY: writes `len` initialised bytes of `buf` to stderr.
    unsafe { libc::write(libc::STDERR_FILENO, buf.as_ptr().cast(), len) };
    // SAFETY: socket(2) takes no pointers. No filter allows an AF_INET
    // socket, so this traps again with SIGSYS blocked and the kernel kills
    // the process with it; the call does not return.
    unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    // Only reached if some filter let the call through: stop all the same.
    // SAFETY: _exit ends the process at once.
    unsafe { libc::_exit(128 + libc::SIGSYS) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_name_the_call_and_the_thread() {
        let mut buf = [0u8; 160];
        let n = format_report(&mut buf, 285, Some(ThreadKind::Vcpu));
        let text = std::str::from_utf8(&buf[..n]).unwrap();
        assert_eq!(
            text,
            "torpor-vmm: seccomp violation: system call 285 on the vcpu thread \
             is outside its allow-list; the VMM stops (SIGSYS)\n"
        );
        let n = format_report(&mut buf, -1, None);
        let text = std::str::from_utf8(&buf[..n]).unwrap();
        assert!(text.contains("call -1 on the unfiltered thread"), "{text}");
    }
}
