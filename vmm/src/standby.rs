//! Standby VMMs: a VM shell made before anyone asks for it (KVM VM, vCPUs,
//! memory slots registered: the costly part of a restore on these hosts),
//! waiting on its control socket for a `restore` request. A pod keeps a few
//! per memory size so that a restore only maps memory and loads state.
//!
//! The shell is served by the VMM's one control server
//! ([`control::server::serve_standby`], on the standby helper thread): this
//! module only says what `status`, `shutdown` and `restore` do to a shell
//! ([`control::server::StandbyController`]); the framing, the parsing, the
//! refusals and the answers are the server's. A restore ends that serving
//! and hands its connection, unanswered, to the restored VM, which answers
//! it once it runs.

use std::path::PathBuf;
use std::time::Instant;

use crate::builder::{BuiltVm, Timings};
use crate::control::server::{RestoreRequest, Restoring, StandbyController};
use crate::control::{self, VmState, VmStatus, PROTOCOL_VERSION};
use crate::dirty::DirtyTracking;
use crate::exit::{ExitReason, ExitSignal};
use crate::microvm::{launch_built, Launched, PendingRestore, Ready, RunError, RunReport, Spares};
use crate::restore::{self, RestoreOptions, Shell};
use crate::vstate::vcpu::{register_kick_handler, SpareThreads};
use torpor_vmm_api::VmError;

/// Whether this process gets SIGKILL when the thread that started it
/// ends. Set, it also ends now if that parent went while it was set.
fn die_with_parent(on: bool) {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let signal = if on { libc::SIGKILL } else { 0 };
    // SAFETY: PR_SET_PDEATHSIG with a signal number (or 0) changes only
    // this process's own death signal.
    let set = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) };
    if set != 0 {
        tracing::warn!(
            "cannot set the standby shell's parent-death signal: {}",
            std::io::Error::last_os_error()
        );
    }
    // SAFETY: as above.
    if on && unsafe { libc::getppid() } != parent {
        tracing::warn!("the pod that made this standby shell is gone");
        std::process::exit(0);
    }
}

fn standby_status(mem_mib: u64, vcpus: u16, started: Instant) -> VmStatus {
    VmStatus {
        protocol: PROTOCOL_VERSION,
        state: VmState::Standby,
        pid: std::process::id(),
        vcpus,
        mem_mib,
        kernel: String::new(),
        uptime_ms: started.elapsed().as_millis() as u64,
        generation: 0,
        memory_backend: String::new(),
        base_snapshot: None,
        guest_clock_ns: None,
        dirty_tracking: String::new(),
        console_dropped_bytes: 0,
    }
}

/// How a standby shell's waiting ended.
enum Outcome {
    /// Shut down before any restore.
    Ended(RunReport),
    /// Restored: every thread runs, the vCPUs held.
    Restored(Launched),
}

/// Makes a shell for `mem_mib`/`vcpus`, serves `socket` until a restore
/// request arrives, then runs the restored VM like any other, its diff
/// snapshots tracked with `dirty_tracking`. `ready` fires once the shell
/// is made and its socket serves.
///
/// The socket is bound here first, before any thread starts: on a busy
/// host a new thread can wait milliseconds for a CPU, and the pod waits
/// for the socket. The shell is then made and served on a helper thread
/// while this (main) thread confines itself at once, off any restore's
/// path (installing a filter costs ~0.15 ms here): the helper hands over
/// the launched VM and ends, and the main thread lets the vCPUs run once
/// it has.
pub fn standby(
    mem_mib: u64,
    vcpus: u16,
    socket: PathBuf,
    dirty_tracking: DirtyTracking,
    ready: Ready,
) -> Result<RunReport, RunError> {
    let listener = control::bind(&socket)?;
    let (done, outcome) = std::sync::mpsc::channel();
    let helper = std::thread::Builder::new()
        .name("standby".into())
        .spawn(move || {
            let served = serve(mem_mib, vcpus, socket, listener, dirty_tracking, ready);
            let _ = done.send(served);
        })
        .map_err(RunError::StandbyThread)?;
    crate::seccomp::install(crate::seccomp::ThreadKind::Main)?;
    let outcome = outcome.recv();
    // No unconfined thread is left once the helper has ended.
    let _ = helper.join();
    match outcome {
        Ok(Ok(Outcome::Ended(report))) => Ok(report),
        // The shell's ready hook fired when it was made.
        Ok(Ok(Outcome::Restored(vm))) => vm.run(Ready::none()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(RunError::Launch(VmError::internal(
            "the standby thread ended without an answer",
        ))),
    }
}

/// The standby shell's helper thread: makes the shell, serves it until a
/// restore or a shutdown ends it.
fn serve(
    mem_mib: u64,
    vcpus: u16,
    socket: PathBuf,
    listener: std::os::unix::net::UnixListener,
    dirty_tracking: DirtyTracking,
    mut ready: Ready,
) -> Result<Outcome, RunError> {
    let started = Instant::now();
    // A shell is its pod's: if the process that made it ends (a test, a
    // crashed service), nothing will ever hand it a snapshot, so it goes
    // too. Once restored it is a sandbox, which outlives service restarts.
    // (Armed on this thread, which re-arms and clears it later.)
    die_with_parent(true);
    let mut shell_timings = Timings::start();
    let mut shell = restore::create_shell(mem_mib, vcpus, dirty_tracking, &mut shell_timings)?;
    // Its console-open thread too: installing a thread's seccomp filter
    // on the restore path cost ~0.15 ms (filters are JIT-compiled).
    shell.console_opener =
        Some(crate::builder::ConsoleOpener::spawn().map_err(RunError::StandbyThread)?);
    register_kick_handler()?;
    // The vCPU threads too: a restore wakes them instead of creating them.
    // And the control server's, so a restore spawns no thread at all.
    let spares = Spares {
        vcpus: SpareThreads::spawn(shell.vcpus.len() as u8)?,
        control: control::SpareControl::spawn().map_err(RunError::ControlThread)?,
    };
    let exit = ExitSignal::new().map_err(RunError::ExitEvent)?;
    tracing::info!(timings = ?shell_timings, "standby shell ready");
    ready.fire();
    let (stream, end) = {
        let mut standby = Standby {
            mem_mib,
            vcpus,
            started,
            shell: Some(shell),
            dirty_tracking,
            exit: &exit,
        };
        control::server::serve_standby(&listener, &mut standby)
    };
    match end {
        End::Shutdown => {
            let _ = std::fs::remove_file(&socket);
            Ok(Outcome::Ended(RunReport {
                exit: ExitReason::ControlShutdown,
                timings: shell_timings,
                first_kvm_run_us: None,
            }))
        }
        // The refusal is answered: this VMM ends.
        End::Spent(e) => Err(e),
        // The restored VM answers the request once it runs.
        End::Restored {
            built,
            paused,
            received,
        } => launch_built(
            *built,
            Some((listener, socket)),
            paused,
            exit,
            started,
            Some(PendingRestore {
                stream,
                request_started: received,
            }),
            Some(spares),
        )
        .map(Outcome::Restored),
    }
}

/// A standby shell, as its control socket serves it.
struct Standby<'a> {
    mem_mib: u64,
    vcpus: u16,
    started: Instant,
    /// Until a restore consumes it.
    shell: Option<Shell>,
    dirty_tracking: DirtyTracking,
    exit: &'a ExitSignal,
}

/// What ended a standby shell's serving.
enum End {
    /// A `shutdown`, answered.
    Shutdown,
    /// A restore: the VM, ready to launch; its request is not answered yet.
    Restored {
        /// Boxed: the other ends are a tenth of its size.
        built: Box<BuiltVm>,
        paused: bool,
        received: Instant,
    },
    /// A restore that failed once the shell was consumed, answered.
    Spent(RunError),
}

impl StandbyController for Standby<'_> {
    type End = End;

    fn status(&self) -> VmStatus {
        standby_status(self.mem_mib, self.vcpus, self.started)
    }

    fn shutdown(&mut self) -> (VmStatus, End) {
        (self.status(), End::Shutdown)
    }

    fn restore(&mut self, request: RestoreRequest) -> Restoring<End> {
        let RestoreRequest {
            spec,
            console,
            paused,
            received,
        } = request;
        if let Err(e) = spec.check() {
            return Restoring::Refused(e);
        }
        die_with_parent(false);
        // Validate everything before the shell is consumed, so a bad
        // request leaves this standby VMM usable.
        let mut timings = Timings::start();
        let Some(shell) = self.shell.take() else {
            return Restoring::Refused(VmError::internal("this standby shell is spent"));
        };
        let chain = match restore::load_chain(&spec.snapshot)
            .and_then(|c| restore::check_fits(&shell, &c).map(|()| c))
        {
            Ok(c) => c,
            Err(e) => {
                // Still a shell of its pod's: it goes with the pod again.
                die_with_parent(true);
                self.shell = Some(shell);
                return Restoring::Refused(e.vm_error());
            }
        };
        let opts = RestoreOptions {
            snapshot: spec.snapshot,
            backend: spec.backend,
            serial: console,
            prefetch: spec.prefetch,
            lazy_map: spec.lazy_map,
            record_working_set_ms: None,
            virtio: crate::virtio_devices::VirtioRestorePaths {
                disk_overlay: spec.disk_overlay,
                vsock_uds: spec.vsock_uds,
                net: spec.net.map(|n| *n),
            },
            dirty_tracking: self.dirty_tracking,
        };
        timings.phase("read_state");
        match restore::restore_into(shell, chain, &opts, self.exit, timings) {
            Ok(built) => Restoring::Started(End::Restored {
                built: Box::new(built),
                paused,
                received,
            }),
            // The shell is spent: answer, then end this VMM.
            Err(e) => Restoring::Spent(e.vm_error(), End::Spent(e.into())),
        }
    }
}
