//! vCPUs: creation and configuration, the run loop on a thread of its own,
//! and the gate that pauses and resumes all of them together.

use std::cell::Cell;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use kvm_bindings::CpuId;
use kvm_ioctls::{VcpuExit, VcpuFd};
use torpor_sync::{Locked, Waited};
use vmm_sys_util::signal::{register_signal_handler, Killable};

use super::cpuid;
use super::regs::{self, RegsError};
use super::vm::Vm;
use crate::devices::virtio::MmioBus;
use crate::devices::PioBus;
use crate::exit::{ExitReason, ExitSignal};

thread_local! {
    /// This thread's `kvm_run.immediate_exit`, for the kick signal handler.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let flag = IMMEDIATE_EXIT.with(|f| f.get());
    if !flag.is_null() {
        // SAFETY: the pointer targets this thread's mmap'd kvm_run, set while
        // the owning VcpuFd is alive on this thread and cleared before it is
        // dropped; a volatile byte store is async-signal-safe.
        unsafe { std::ptr::write_volatile(flag, 1) };
    }
}

/// Installs the kick handler once per process.
pub fn register_kick_handler() -> Result<(), VcpuError> {
    register_signal_handler(crate::signals::vcpu_kick(), handle_kick).map_err(VcpuError::Signal)
}

/// Errors while creating, configuring or running a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("cannot create vCPU {index}: {source}")]
    Create {
        index: u8,
        source: kvm_ioctls::Error,
    },
    #[error("cannot set CPUID of vCPU {index}: {source}")]
    Cpuid {
        index: u8,
        source: kvm_ioctls::Error,
    },
    #[error("cannot set up vCPU {index}: {source}")]
    Regs { index: u8, source: RegsError },
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(vmm_sys_util::errno::Error),
    #[error("cannot start the thread of vCPU {index}: {source}")]
    Spawn { index: u8, source: std::io::Error },
}

/// A configured vCPU, not yet running.
#[derive(Debug)]
pub struct Vcpu {
    pub index: u8,
    pub fd: VcpuFd,
}

impl Vcpu {
    /// Creates vCPU `index` and gives it CPUID, MSRs, FPU and LAPIC state.
    pub fn create(vm: &Vm, index: u8, count: u8, supported: &CpuId) -> Result<Self, VcpuError> {
        let fd = vm
            .fd
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Create { index, source })?;
        let mut cpuid = supported.clone();
        cpuid::normalize(&mut cpuid, index, count);
        fd.set_cpuid2(&cpuid)
            .map_err(|source| VcpuError::Cpuid { index, source })?;
        let regs_err = |source| VcpuError::Regs { index, source };
        regs::setup_msrs(&fd).map_err(regs_err)?;
        regs::setup_fpu(&fd).map_err(regs_err)?;
        regs::setup_lapic(&fd).map_err(regs_err)?;
        Ok(Self { index, fd })
    }
}

/// What the VMM wants the vCPUs to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// Started, not yet let into the guest: the VMM confines its main
    /// thread first (see [`VcpuSet::release`]).
    Hold,
    Run,
    Pause,
    Exit,
}

/// Work for parked vCPU threads to do on their own vCPU (e.g. save state).
pub type ParkedTask = Arc<dyn Fn(u8, &VcpuFd) + Send + Sync>;

struct GateState {
    target: Target,
    /// vCPU threads currently parked (paused or finished).
    parked: usize,
    /// vCPU threads that have left their run loop for good.
    finished: usize,
    task: Option<ParkedTask>,
    task_seq: u64,
    task_done: usize,
}

impl std::fmt::Debug for GateState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A parked task is a closure: only whether there is one.
        f.debug_struct("GateState")
            .field("target", &self.target)
            .field("parked", &self.parked)
            .field("finished", &self.finished)
            .field("task", &self.task.is_some())
            .field("task_seq", &self.task_seq)
            .field("task_done", &self.task_done)
            .finish_non_exhaustive()
    }
}

/// Pauses and resumes every vCPU thread together, and runs tasks on
/// parked vCPUs (KVM wants vCPU ioctls from the vCPU's own thread).
#[derive(Debug)]
pub struct RunGate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl RunGate {
    fn new(paused: bool) -> Self {
        Self {
            state: Mutex::new(GateState {
                target: if paused { Target::Pause } else { Target::Hold },
                parked: 0,
                finished: 0,
                task: None,
                task_seq: 0,
                task_done: 0,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.locked()
    }

    fn wait<'a>(
        &self,
        guard: std::sync::MutexGuard<'a, GateState>,
    ) -> std::sync::MutexGuard<'a, GateState> {
        self.changed.wait_locked(guard)
    }

    /// Called by a vCPU thread before each KVM_RUN. Blocks while paused,
    /// running any task posted meanwhile; returns false when the thread
    /// must exit.
    fn proceed(&self, vcpu: &mut Vcpu) -> bool {
        let mut s = self.lock();
        while s.target == Target::Hold {
            s = self.wait(s);
        }
        if s.target == Target::Pause {
            drop(s);
            complete_pending_io(vcpu);
            s = self.lock();
        }
        if s.target == Target::Pause {
            s.parked += 1;
            self.changed.notify_all();
            let mut seen = s.task_seq;
            while s.target == Target::Pause {
                if s.task_seq != seen {
                    seen = s.task_seq;
                    if let Some(task) = s.task.clone() {
                        drop(s);
                        task(vcpu.index, &vcpu.fd);
                        s = self.lock();
                    }
                    s.task_done += 1;
                    self.changed.notify_all();
                    continue;
                }
                s = self.wait(s);
            }
            s.parked -= 1;
            self.changed.notify_all();
        }
        s.target != Target::Exit
    }
}

type ThreadJob = Box<dyn FnOnce() + Send>;

/// Threads made ahead of time (by a standby shell) that become vCPU
/// threads: a restore then wakes a parked thread instead of creating one.
#[derive(Debug)]
pub struct SpareThreads {
    threads: Vec<(JoinHandle<()>, std::sync::mpsc::Sender<ThreadJob>)>,
}

impl SpareThreads {
    /// Spawns `count` threads, named `vcpu0..`, each waiting for one job.
    pub fn spawn(count: u8) -> Result<Self, VcpuError> {
        let mut threads = Vec::with_capacity(usize::from(count));
        for index in 0..count {
            let (tx, rx) = std::sync::mpsc::channel::<ThreadJob>();
            let handle = std::thread::Builder::new()
                .name(format!("vcpu{index}"))
                .spawn(move || {
                    // Confined before it waits, so a restore does not pay
                    // for it; the job (run_vcpu) finds it done.
                    crate::seccomp::enter(crate::seccomp::ThreadKind::Vcpu);
                    if let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .map_err(|source| VcpuError::Spawn { index, source })?;
            threads.push((handle, tx));
        }
        Ok(Self { threads })
    }

    /// Runs `job` on the next spare thread, or on a new one when none is
    /// left (or the spare is gone).
    fn run(&mut self, index: u8, job: ThreadJob) -> Result<JoinHandle<()>, VcpuError> {
        let job = match self.threads.pop() {
            Some((handle, tx)) => match tx.send(job) {
                Ok(()) => return Ok(handle),
                Err(std::sync::mpsc::SendError(job)) => job,
            },
            None => job,
        };
        std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(job)
            .map_err(|source| VcpuError::Spawn { index, source })
    }
}

/// The running vCPU threads of one VM.
#[derive(Debug)]
pub struct VcpuSet {
    gate: Arc<RunGate>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    count: usize,
}

impl VcpuSet {
    /// Starts one thread per vCPU, each running until the VM exits, once
    /// [`VcpuSet::release`]d. `first_run` records when the first vCPU
    /// first entered KVM_RUN; with `paused` the threads park until
    /// `resume`. Threads in `spares`
    /// are used before new ones are made.
    pub fn start(
        vcpus: Vec<Vcpu>,
        bus: Arc<PioBus>,
        mmio: Arc<MmioBus>,
        exit: ExitSignal,
        first_run: Arc<OnceLock<Instant>>,
        paused: bool,
        spares: Option<SpareThreads>,
    ) -> Result<Self, VcpuError> {
        let gate = Arc::new(RunGate::new(paused));
        let mut spares = spares.unwrap_or(SpareThreads {
            threads: Vec::new(),
        });
        // Hand out spares so that vCPU i runs on the thread named vcpu{i}.
        spares.threads.reverse();
        let mut threads = Vec::with_capacity(vcpus.len());
        for vcpu in vcpus {
            let index = vcpu.index;
            let (gate, exit, first_run) = (gate.clone(), exit.clone(), first_run.clone());
            let buses = (bus.clone(), mmio.clone());
            let job: ThreadJob = Box::new(move || run_vcpu(vcpu, &gate, &buses, &exit, &first_run));
            threads.push(spares.run(index, job)?);
        }
        let count = threads.len();
        Ok(Self {
            gate,
            threads: Mutex::new(threads),
            count,
        })
    }

    fn kick_all(&self) {
        for t in self.threads.locked().iter() {
            // A thread that already exited cannot be kicked; nothing to do.
            let _ = t.kill(crate::signals::vcpu_kick());
        }
    }

    /// Lets vCPUs started by [`VcpuSet::start`] (not paused) into the
    /// guest; a pause or stop requested meanwhile stands.
    pub fn release(&self) {
        let mut s = self.gate.lock();
        if s.target == Target::Hold {
            s.target = Target::Run;
            self.gate.changed.notify_all();
        }
    }

    /// Stops every vCPU outside KVM_RUN; returns once all are parked.
    pub fn pause(&self) {
        let mut s = self.gate.lock();
        if s.target != Target::Run && s.target != Target::Hold {
            return;
        }
        s.target = Target::Pause;
        self.gate.changed.notify_all();
        drop(s);
        self.kick_all();
        let mut s = self.gate.lock();
        // Finished threads count as parked, so this cannot wait forever.
        while s.target == Target::Pause && s.parked < self.count {
            s = self.gate.wait(s);
        }
    }

    /// Pauses the vCPUs if they run (not held before their release,
    /// paused already or ending); true if this call paused them.
    pub fn pause_if_running(&self) -> bool {
        if self.gate.lock().target != Target::Run {
            return false;
        }
        self.pause();
        true
    }

    /// Runs `task` on every paused vCPU, each on its own thread, and waits
    /// for all of them. Returns false if the vCPUs are not paused.
    pub fn run_on_paused(&self, task: ParkedTask) -> bool {
        let mut s = self.gate.lock();
        if s.target != Target::Pause {
            return false;
        }
        s.task = Some(task);
        s.task_seq += 1;
        s.task_done = 0;
        self.gate.changed.notify_all();
        while s.task_done < s.parked - s.finished && s.target == Target::Pause {
            s = self.gate.wait(s);
        }
        s.task = None;
        s.target == Target::Pause
    }

    /// Lets paused vCPUs run again.
    pub fn resume(&self) {
        let mut s = self.gate.lock();
        if s.target == Target::Pause {
            s.target = Target::Run;
            self.gate.changed.notify_all();
        }
    }

    /// True while the vCPUs are held outside KVM_RUN.
    pub fn is_paused(&self) -> bool {
        self.gate.lock().target == Target::Pause
    }

    /// Stops all vCPU threads and waits for them, at most `limit`: a vCPU
    /// stuck where no signal reaches it (a userfaultfd fault nobody will
    /// answer) must not keep the VMM alive; it dies with the process.
    pub fn stop(&self, limit: std::time::Duration) {
        self.gate.lock().target = Target::Exit;
        self.gate.changed.notify_all();
        self.kick_all();
        let deadline = Instant::now() + limit;
        let threads = std::mem::take(&mut *self.threads.locked());
        // Woken threads end within microseconds: polled from 20 µs,
        // doubling to 1 ms (a fixed 1 ms added a millisecond to every
        // VMM's exit).
        let mut nap = std::time::Duration::from_micros(20);
        for t in threads {
            while !t.is_finished() && Instant::now() < deadline {
                std::thread::sleep(nap);
                nap = (nap * 2).min(std::time::Duration::from_millis(1));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                tracing::warn!(
                    "a vCPU thread did not stop within {limit:?}; leaving it to process exit"
                );
            }
        }
    }
}

/// Lets KVM finish an I/O instruction whose exit we just handled (an `in`
/// gets its value into RAX only on the next KVM_RUN), without running any
/// guest code, so a saved state never holds a half-done instruction.
fn complete_pending_io(vcpu: &mut Vcpu) {
    vcpu.fd.set_kvm_immediate_exit(1);
    match vcpu.fd.run() {
        Err(e) if e.errno() == libc::EINTR => {}
        other => tracing::warn!(
            vcpu = vcpu.index,
            "unexpected result completing I/O: {other:?}"
        ),
    }
    vcpu.fd.set_kvm_immediate_exit(0);
}

/// The vCPU thread: KVM_RUN until the gate says exit or the guest ends.
fn run_vcpu(
    mut vcpu: Vcpu,
    gate: &RunGate,
    (bus, mmio): &(Arc<PioBus>, Arc<MmioBus>),
    exit: &ExitSignal,
    first_run: &OnceLock<Instant>,
) {
    // Before anything the guest controls: its first KVM_RUN.
    crate::seccomp::enter(crate::seccomp::ThreadKind::Vcpu);
    let run_flag: *mut u8 = &mut vcpu.fd.get_kvm_run().immediate_exit;
    IMMEDIATE_EXIT.with(|f| f.set(run_flag));
    while gate.proceed(&mut vcpu) {
        first_run.get_or_init(Instant::now);
        match vcpu.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => bus.read(port, data),
            Ok(VcpuExit::IoOut(port, data)) => bus.write(port, data),
            Ok(VcpuExit::MmioRead(addr, data)) => {
                mmio.read(addr, data);
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                mmio.write(addr, data);
            }
            Ok(VcpuExit::Hlt) => {}
            Ok(VcpuExit::Shutdown) => {
                // Where the vCPU was tells a triple fault in a secondary
                // CPU's real-mode start-up from one in the running kernel.
                let (rip, cs, cr0, efer) = match (vcpu.fd.get_regs(), vcpu.fd.get_sregs()) {
                    (Ok(r), Ok(s)) => (r.rip, s.cs.selector, s.cr0, s.efer),
                    _ => (0, 0, 0, 0),
                };
                tracing::warn!(
                    vcpu = vcpu.index,
                    rip = format_args!("{rip:#x}"),
                    cs = format_args!("{cs:#x}"),
                    cr0 = format_args!("{cr0:#x}"),
                    efer = format_args!("{efer:#x}"),
                    "the guest shut down (KVM_EXIT_SHUTDOWN: a triple fault or a reset)"
                );
                exit.exit(ExitReason::GuestShutdown);
                break;
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                tracing::warn!(
                    vcpu = vcpu.index,
                    kind,
                    "the guest ended the VM (system event)"
                );
                exit.exit(ExitReason::GuestShutdown);
                break;
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                exit.exit(ExitReason::VcpuError(format!(
                    "vCPU {} failed to enter the guest (hardware reason {reason:#x}, cpu {cpu})",
                    vcpu.index
                )));
                break;
            }
            Ok(VcpuExit::InternalError) => {
                exit.exit(ExitReason::VcpuError(format!(
                    "vCPU {} hit a KVM internal error (an instruction KVM cannot emulate?)",
                    vcpu.index
                )));
                break;
            }
            Ok(other) => {
                exit.exit(ExitReason::VcpuError(format!(
                    "vCPU {} stopped on an unexpected exit: {other:?}",
                    vcpu.index
                )));
                break;
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                vcpu.fd.set_kvm_immediate_exit(0);
            }
            Err(e) => {
                exit.exit(ExitReason::VcpuError(format!(
                    "vCPU {} KVM_RUN failed: {e}",
                    vcpu.index
                )));
                break;
            }
        }
    }
    IMMEDIATE_EXIT.with(|f| f.set(std::ptr::null_mut()));
    // Count this thread as parked so a pause in progress does not wait for it.
    let mut s = gate.lock();
    s.parked += 1;
    s.finished += 1;
    gate.changed.notify_all();
}

/// A vCPU thread's own calls: KVM_RUN, and reading its state for a
/// snapshot, on its own thread while it is parked. Its exits' handlers
/// (the devices) add theirs.
pub(crate) fn vcpu_syscalls(
    r: &mut crate::seccomp::Rules,
) -> Result<(), crate::seccomp::SeccompError> {
    let mut requests = vec![crate::seccomp::ioctls::kvm_run()];
    requests.extend(crate::seccomp::ioctls::vcpu_save());
    r.allow_values(libc::SYS_ioctl, 1, &requests)?;
    Ok(())
}

/// Stopping vCPUs: the kick signal sent to their threads.
pub(crate) fn kick_syscalls(
    r: &mut crate::seccomp::Rules,
) -> Result<(), crate::seccomp::SeccompError> {
    r.allow_values(libc::SYS_tgkill, 2, &[crate::signals::vcpu_kick() as u64])?;
    Ok(())
}
