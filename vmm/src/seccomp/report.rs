//! The signal handlers behind the filters. SIGSYS (enforced filters) names
//! the forbidden call and the thread that made it, then lets the kernel
//! kill the process. SIGSEGV and SIGBUS (a memory fault: a file-backed
//! page of guest memory that cannot be read because its filesystem is
//! full, say) name the signal, the address and the thread, and let the
//! fault kill the process with its own signal.
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
    set_handler(libc::SIGSYS, on_sigsys, libc::SA_SIGINFO)
}

/// Installs [`on_memory_fault`] for SIGSEGV and SIGBUS, in place of Rust
/// std's handler (its stack-overflow detection). Call before any thread
/// enters a filter.
///
/// std's handler, for a fault that is not a stack overflow, restores the
/// default action with `rt_sigaction` and returns so the fault happens
/// again: under a filter that call is forbidden, and the VMM died of
/// SIGSYS, as if it had broken its allow-list, where a page of guest
/// memory could not be read (a full tmpfs under a full snapshot). This one
/// makes no call but `write(2)`: `SA_RESETHAND` has the kernel restore the
/// default action as it delivers the signal, so when the handler returns
/// the faulting access runs again and kills the process with its own
/// signal. `SA_ONSTACK` runs it on the thread's alternate stack where std
/// set one up, so a stack overflow is reported too.
pub(super) fn install_fault_handlers() -> std::io::Result<()> {
    let flags = libc::SA_SIGINFO | libc::SA_RESETHAND | libc::SA_ONSTACK;
    set_handler(libc::SIGSEGV, on_memory_fault, flags)?;
    set_handler(libc::SIGBUS, on_memory_fault, flags)
}

type Handler = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);

fn set_handler(signal: libc::c_int, handler: Handler, flags: libc::c_int) -> std::io::Result<()> {
    // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = handler as *const () as usize;
    action.sa_flags = flags;
    // SAFETY: `action` is initialised and outlives the call; the handlers
    // are async-signal-safe (see `on_sigsys` and `on_memory_fault`).
    let rc = unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A report line built in a stack buffer, without allocating (for signal
/// handlers); what does not fit is cut.
struct Line {
    buf: [u8; 192],
    len: usize,
}

impl Line {
    fn new() -> Self {
        Line {
            buf: [0; 192],
            len: 0,
        }
    }

    fn put(&mut self, bytes: &[u8]) -> &mut Self {
        let n = bytes.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
        self
    }

    fn decimal(&mut self, value: i64) -> &mut Self {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut rest = value.unsigned_abs();
        loop {
            at -= 1;
            digits[at] = b'0' + (rest % 10) as u8;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        if value < 0 {
            self.put(b"-");
        }
        self.put(&digits[at..])
    }

    fn hex(&mut self, value: u64) -> &mut Self {
        let mut digits = [0u8; 16];
        for (i, d) in digits.iter_mut().enumerate() {
            *d = b"0123456789abcdef"[((value >> (60 - 4 * i)) & 0xf) as usize];
        }
        self.put(b"0x").put(&digits)
    }

    fn thread(&mut self, kind: Option<ThreadKind>) -> &mut Self {
        self.put(kind.map_or("unfiltered", ThreadKind::name).as_bytes())
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// Writes the line to stderr (the VMM's log).
    fn write_to_stderr(&self) {
        let bytes = self.bytes();
        // SAFETY: writes the initialised bytes of `bytes` to stderr.
        unsafe { libc::write(libc::STDERR_FILENO, bytes.as_ptr().cast(), bytes.len()) };
    }
}

/// The seccomp violation report.
fn sigsys_report(syscall: i32, kind: Option<ThreadKind>) -> Line {
    let mut line = Line::new();
    line.put(b"torpor-vmm: seccomp violation: system call ")
        .decimal(syscall.into())
        .put(b" on the ")
        .thread(kind)
        .put(b" thread is outside its allow-list; the VMM stops (SIGSYS)\n");
    line
}

/// The memory fault report.
fn fault_report(signal: libc::c_int, address: u64, kind: Option<ThreadKind>) -> Line {
    let name: &[u8] = match signal {
        libc::SIGBUS => b"SIGBUS",
        libc::SIGSEGV => b"SIGSEGV",
        _ => b"signal",
    };
    let mut line = Line::new();
    line.put(b"torpor-vmm: memory fault (")
        .put(name)
        .put(b") at address ")
        .hex(address)
        .put(b" on the ")
        .thread(kind)
        .put(b" thread; the VMM stops (")
        .put(name)
        .put(b")\n");
    line
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
    sigsys_report(syscall, INSTALLED.with(|k| k.get())).write_to_stderr();
    // SAFETY: socket(2) takes no pointers. No filter allows an AF_INET
    // socket, so this traps again with SIGSYS blocked and the kernel kills
    // the process with it; the call does not return.
    unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    // Only reached on a thread without a filter, which a SIGSYS sent with
    // kill(2) may land on: the process dies of SIGSYS all the same (its
    // default action), so that its parent sees what a seccomp kill looks
    // like. SIGSYS is blocked while this handler runs: raised with the
    // default action, it is delivered as the handler returns.
    // SAFETY: signal(2) and raise(3) are async-signal-safe and take no
    // pointers but the handler value.
    unsafe {
        libc::signal(libc::SIGSYS, libc::SIG_DFL);
        libc::raise(libc::SIGSYS);
    }
}

/// SIGSEGV or SIGBUS: reports, then returns. The kernel restored the
/// default action as it delivered the signal (`SA_RESETHAND`), so the
/// faulting access, run again, kills the process with the same signal; a
/// signal someone sent with kill(2) is only reported.
extern "C" fn on_memory_fault(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _ctx: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo_t for an SA_SIGINFO
    // handler; for SIGSEGV and SIGBUS `si_addr` is the faulting address.
    let address = unsafe { (*info).si_addr() } as u64;
    fault_report(signal, address, INSTALLED.with(|k| k.get())).write_to_stderr();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_name_the_call_and_the_thread() {
        let line = sigsys_report(285, Some(ThreadKind::Vcpu));
        let text = std::str::from_utf8(line.bytes()).unwrap();
        assert_eq!(
            text,
            "torpor-vmm: seccomp violation: system call 285 on the vcpu thread \
             is outside its allow-list; the VMM stops (SIGSYS)\n"
        );
        let line = sigsys_report(-1, None);
        let text = std::str::from_utf8(line.bytes()).unwrap();
        assert!(text.contains("call -1 on the unfiltered thread"), "{text}");
    }

    #[test]
    fn fault_reports_name_the_signal_the_address_and_the_thread() {
        let line = fault_report(libc::SIGBUS, 0x7f12_3456_7000, Some(ThreadKind::Control));
        let text = std::str::from_utf8(line.bytes()).unwrap();
        assert_eq!(
            text,
            "torpor-vmm: memory fault (SIGBUS) at address 0x00007f1234567000 on the \
             control thread; the VMM stops (SIGBUS)\n"
        );
        let line = fault_report(libc::SIGSEGV, u64::MAX, None);
        let text = std::str::from_utf8(line.bytes()).unwrap();
        assert!(
            text.ends_with(
                "at address 0xffffffffffffffff on the unfiltered thread; the VMM stops (SIGSEGV)\n"
            ),
            "{text}"
        );
    }
}
