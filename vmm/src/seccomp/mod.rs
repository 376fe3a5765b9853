//! Per-thread seccomp filters (docs/security.md).
//!
//! Every thread of a VMM runs under an allow-list made for what it does:
//! the main thread once the VM runs ([`ThreadKind::Main`]), the control
//! server, each vCPU, each device worker, the userfaultfd page server and
//! the short-lived helpers. A call outside the list kills the whole VMM
//! with SIGSYS: a guest that takes over one thread cannot make the host do
//! anything that thread was not already doing. A memory fault (SIGSEGV,
//! SIGBUS) kills the VMM with its own signal, named on stderr, not with
//! SIGSYS (`report.rs`). The filter traps
//! (`SECCOMP_RET_TRAP`) so that a handler first names the call and the
//! thread on stderr (the VMM's log), then makes a second forbidden call
//! from inside the handler, where SIGSYS is blocked: the kernel then
//! resets SIGSYS to its default action and the process dies of it, as
//! with `SECCOMP_RET_KILL_PROCESS`, and never runs on past the call.
//!
//! Filters are per thread (no TSYNC), so each thread installs its own with
//! [`enter`] at its start, before it touches anything the guest controls;
//! the main thread installs its own last, after it has spawned every other
//! long-lived thread (a thread inherits the filters of the thread that
//! spawns it, and the intersection would leave it less than it needs),
//! and before the vCPUs first enter the guest. [`init`] only records the
//! level: the first [`install`] compiles every kind's filter at once (so
//! later ones are a single `seccomp(2)` call), off the start's own path
//! where it can: a standby shell's main thread compiles them while its
//! helper binds the control socket and makes the VM.
//!
//! This module knows no mechanism. Each one declares the calls its
//! thread makes, next to the code that makes them (a `Declare`:
//! `devices/worker.rs`'s event loop, `vstate/vcpu.rs`'s KVM_RUN, ...);
//! `confine.rs` lists which declarations make up each [`ThreadKind`]'s
//! list, a table (`Needs`) the launch gives to [`init`]. Here: the calls
//! every thread needs (`rules.rs`'s base list, under every kind's
//! declarations), the ioctl request numbers (`ioctls.rs`), compiling,
//! installing, and naming a violation (`report.rs`).

pub(crate) mod ioctls;
mod report;
mod rules;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};
use torpor_vmm_api::SeccompLevel;

pub(crate) use rules::{allow_fd_flags, Arg, Rules};

/// A mechanism's declaration: adds the calls it makes on a thread to that
/// thread's list.
pub(crate) type Declare = fn(&mut Rules) -> Result<(), SeccompError>;

/// Which declarations make up a thread kind's list, beyond the base list
/// every thread gets (`confine::needs`).
pub(crate) type Needs = fn(ThreadKind) -> &'static [Declare];

/// The kinds of thread a VMM runs, each with its own allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ThreadKind {
    /// The main thread once the VM runs: waits for the end, stops the
    /// vCPUs, cleans up.
    Main,
    /// The control-socket server: status, pause/resume, snapshots.
    Control,
    /// A vCPU: KVM_RUN, port and MMIO exits, virtio-blk I/O (done on the
    /// vCPU that notified the queue), console output.
    Vcpu,
    /// The virtio-vsock worker: the guest's packets and the host's unix
    /// sockets.
    Vsock,
    /// The virtio-net worker (reserved: the net device adds its tap calls
    /// to this list when it lands).
    Net,
    /// The virtio-balloon worker: takes the guest's page lists and free
    /// page reports and discards those pages (madvise MADV_DONTNEED).
    Balloon,
    /// The userfaultfd page server of the uffd memory backends.
    UffdPages,
    /// Saves a restore's working set after its recording window.
    WorkingSet,
    /// Opens (truncates) a restore's console file off the restore path.
    ConsoleOpen,
}

impl ThreadKind {
    pub const ALL: [ThreadKind; 9] = [
        Self::Main,
        Self::Control,
        Self::Vcpu,
        Self::Vsock,
        Self::Net,
        Self::Balloon,
        Self::UffdPages,
        Self::WorkingSet,
        Self::ConsoleOpen,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Main => "main",
            ThreadKind::Control => "control",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Vsock => "vsock",
            ThreadKind::Net => "net",
            ThreadKind::Balloon => "balloon",
            ThreadKind::UffdPages => "uffd-pages",
            ThreadKind::WorkingSet => "working-set",
            ThreadKind::ConsoleOpen => "console-open",
        }
    }

    /// This kind's allow-list: the base list, then each of `needs` in
    /// order; syscall number to the argument rules that allow it (an
    /// empty list allows it whatever its arguments).
    pub fn rules(self, needs: &[Declare]) -> Result<Rules, SeccompError> {
        let mut r = rules::base()?;
        for declare in needs {
            declare(&mut r)?;
        }
        Ok(r)
    }
}

/// Errors building or installing a filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp rule for syscall {syscall} is malformed: {source}")]
    Rule {
        syscall: i64,
        source: seccompiler::BackendError,
    },
    #[error("cannot compile the {kind} seccomp filter: {source}")]
    Compile {
        kind: &'static str,
        source: seccompiler::BackendError,
    },
    #[error("cannot install the {kind} seccomp filter: {source}")]
    Install {
        kind: &'static str,
        source: seccompiler::Error,
    },
    #[error("seccomp filters were already set up for this process")]
    AlreadyInitialized,
    /// The one compilation of every filter failed (its error, as text:
    /// each thread that installs a filter reports it).
    #[error("{0}")]
    Compiled(String),
    #[error("cannot install the {what} handler: {source}")]
    Handler {
        what: &'static str,
        source: std::io::Error,
    },
}

/// The compiled filters of one process.
struct Filters {
    programs: BTreeMap<ThreadKind, BpfProgram>,
}

/// What [`init`] set up: the filters are compiled from it when the first
/// thread installs one.
struct Setup {
    on_mismatch: SeccompAction,
    needs: Needs,
}

static SETUP: OnceLock<Setup> = OnceLock::new();

static FILTERS: OnceLock<Result<Filters, String>> = OnceLock::new();

/// The process's compiled filters, compiled now if no thread did before;
/// None when filters are off.
fn filters() -> Option<Result<&'static Filters, SeccompError>> {
    let setup = SETUP.get()?;
    let compiled = FILTERS.get_or_init(|| {
        let mut programs = BTreeMap::new();
        for kind in ThreadKind::ALL {
            let program = compile(kind, (setup.needs)(kind), setup.on_mismatch.clone())
                .map_err(|e| e.to_string())?;
            programs.insert(kind, program);
        }
        Ok(Filters { programs })
    });
    Some(
        compiled
            .as_ref()
            .map_err(|e| SeccompError::Compiled(e.clone())),
    )
}

thread_local! {
    /// The kind whose filter this thread runs under, once installed.
    pub(crate) static INSTALLED: Cell<Option<ThreadKind>> = const { Cell::new(None) };
}

/// Compiles `kind`'s filter from its `needs`: calls outside its list get
/// `on_mismatch`.
pub fn compile(
    kind: ThreadKind,
    needs: &[Declare],
    on_mismatch: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let arch =
        TargetArch::try_from(std::env::consts::ARCH).map_err(|source| SeccompError::Compile {
            kind: kind.name(),
            source,
        })?;
    let compile_err = |source| SeccompError::Compile {
        kind: kind.name(),
        source,
    };
    let filter = SeccompFilter::new(
        kind.rules(needs)?.into_map(),
        on_mismatch,
        SeccompAction::Allow,
        arch,
    )
    .map_err(compile_err)?;
    BpfProgram::try_from(filter).map_err(compile_err)
}

/// Sets this process's filters up for `level`, each kind's list made of
/// the declarations `needs` gives it (compiled by the first [`install`]);
/// with [`SeccompLevel::Off`] every later [`enter`] does nothing. Call
/// once, before any VMM thread starts.
pub fn init(level: SeccompLevel, needs: Needs) -> Result<(), SeccompError> {
    let on_mismatch = match level {
        SeccompLevel::Off => return Ok(()),
        SeccompLevel::Enforce => SeccompAction::Trap,
        SeccompLevel::Log => SeccompAction::Log,
    };
    keep_malloc_within_the_filters();
    SETUP
        .set(Setup { on_mismatch, needs })
        .map_err(|_| SeccompError::AlreadyInitialized)?;
    // Before any thread enters a filter: Rust std's own SIGSEGV/SIGBUS
    // handler makes a call no filter allows (report.rs).
    report::install_fault_handlers().map_err(|source| SeccompError::Handler {
        what: "SIGSEGV/SIGBUS (memory fault)",
        source,
    })?;
    if level == SeccompLevel::Enforce {
        report::install_handler().map_err(|source| SeccompError::Handler {
            what: "SIGSYS (seccomp violation)",
            source,
        })?;
    }
    Ok(())
}

/// glibc's malloc, the first time it trims a thread arena's heap, reads
/// `/proc/sys/vm/overcommit_memory` (an `openat` no worker thread's
/// filter allows, nor should): a device thread that freed a large buffer
/// died with SIGSYS, now and then, in the middle of a guest's work. Heaps
/// are never trimmed instead (freed memory stays with the process for
/// reuse; blocks past the mmap threshold are still mapped and unmapped on
/// their own, and guest memory is not malloc's).
fn keep_malloc_within_the_filters() {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallopt only sets malloc's parameters; it takes no
        // pointers.
        let set = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX) };
        if set != 1 {
            tracing::warn!("mallopt(M_TRIM_THRESHOLD) failed: heaps may be trimmed");
        }
    }
}

/// Installs `kind`'s filter on the calling thread, once: a thread that
/// already runs under it (a spare vCPU thread given its job) is left as
/// it is. Does nothing when filters are off.
pub fn install(kind: ThreadKind) -> Result<(), SeccompError> {
    if INSTALLED.with(|k| k.get()) == Some(kind) {
        return Ok(());
    }
    let Some(filters) = filters() else {
        return Ok(());
    };
    let filters = filters?;
    let program = &filters.programs[&kind];
    seccompiler::apply_filter(program).map_err(|source| SeccompError::Install {
        kind: kind.name(),
        source,
    })?;
    INSTALLED.with(|k| k.set(Some(kind)));
    Ok(())
}

/// [`install`] for a thread with no error path: a thread that cannot be
/// confined must not run (fail closed), so the process ends.
pub fn enter(kind: ThreadKind) {
    if let Err(e) = install(kind) {
        eprintln!("torpor-vmm: {e}; stopping");
        std::process::abort();
    }
}

/// Makes one system call that no thread's filter allows (a TCP socket),
/// for tests: under an enforced filter the process dies with SIGSYS.
/// Returns what the call returned when it was let through (filters off).
#[cfg(debug_assertions)]
pub fn forbidden_syscall() -> std::io::Result<()> {
    // SAFETY: socket(2) takes no pointers; the fd it may return is closed
    // at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is the socket just created, owned by nothing else.
    unsafe { libc::close(fd) };
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests;
