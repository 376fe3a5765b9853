//! A running microVM: its vCPU threads, its control socket, snapshots of
//! it, and the wait for whatever ends it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use torpor_sync::Locked;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::builder::{BuildError, BuiltVm, Timings};
use crate::control::{
    self, BalloonStatus, ControlServer, SnapshotInfo, VmController, VmState, VmStatus,
    PROTOCOL_VERSION,
};
use crate::devices::serial::SerialDevice;
use crate::devices::Pausable;
use crate::dirty::{Crosscheck, DirtyTracking, WpTracker};
use crate::exit::{ExitReason, ExitSignal};
use crate::snapshot::{self, PageRuns, Persist, PAGE_SIZE};
use crate::vm_state::{self, DeviceStates, MachineConfig, MemoryLayer, MicrovmState, VcpuState};
use crate::vstate::vcpu::{register_kick_handler, VcpuSet};
use crate::vstate::vm::Vm;
use torpor_vmm_api::lineage::Lineage;
use torpor_vmm_api::vcpus::VcpuStates;
use torpor_vmm_api::{ErrorKind, VmError};

/// Errors of a VMM run, before the guest starts.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Bind(#[from] control::server::BindError),
    #[error(transparent)]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    #[error("cannot start the control server: {0}")]
    ControlThread(std::io::Error),
    #[error("cannot create the exit event: {0}")]
    ExitEvent(std::io::Error),
    #[error("cannot start the standby thread: {0}")]
    StandbyThread(std::io::Error),
    #[error(transparent)]
    Restore(#[from] crate::restore::RestoreError),
    #[error(transparent)]
    Launch(torpor_vmm_api::VmError),
    #[error(transparent)]
    Jail(#[from] crate::jail::JailError),
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
    /// A jailed VMM's tap, opened before it enters the jail.
    #[error(transparent)]
    Tap(#[from] crate::devices::net::TapError),
}

impl RunError {
    /// Classified for the pod.
    pub fn vm_error(&self) -> VmError {
        match self {
            RunError::Build(e) => e.vm_error(),
            RunError::Restore(e) => e.vm_error(),
            RunError::Launch(e) => e.clone(),
            RunError::Jail(e) => e.vm_error(),
            RunError::Bind(e) => VmError::new(ErrorKind::InvalidRequest, e.to_string()),
            other => VmError::internal(other.to_string()),
        }
    }
}

/// How a run ended, with the start-up timings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunReport {
    pub exit: ExitReason,
    pub timings: Timings,
    /// From the start of the run to the first KVM_RUN, in microseconds.
    pub first_kvm_run_us: Option<u64>,
}

/// Host views of guest RAM in memory-file order.
///
/// Only for a paused VM: no vCPU writes while the slices live.
fn guest_slices(mem: &GuestMemoryMmap) -> Vec<&[u8]> {
    mem.iter()
        .map(|r| {
            // SAFETY: the region is a live mapping of `len()` bytes owned by
            // `mem`, which outlives the slices; the VM is paused, so no vCPU
            // writes it concurrently (a userfaultfd server may still fill
            // pages in, which only replaces zeros the reader would not see).
            unsafe { std::slice::from_raw_parts(r.as_ptr(), r.len() as usize) }
        })
        .collect()
}

/// One vCPU's saved state, filled in by its own thread.
type SavedVcpu = Option<Result<VcpuState, String>>;

/// State that changes with each snapshot.
#[derive(Debug)]
struct SnapshotLineage {
    /// The chain of the snapshot the next diff is based on, base first.
    base: Option<Vec<PathBuf>>,
    /// Pages written since `base` that the dirty-tracking source will not
    /// report again: those the VMM itself wrote (KVM's dirty log misses
    /// them), and the dirty set a snapshot that then failed took from it.
    vmm_dirty: PageRuns,
}

#[derive(Debug)]
struct Controller {
    vm: Arc<Vm>,
    mem: Arc<GuestMemoryMmap>,
    vcpus: Arc<VcpuSet>,
    serial: Arc<Mutex<SerialDevice>>,
    exit: ExitSignal,
    started: Instant,
    machine: MachineConfig,
    generation: u64,
    backend: &'static str,
    msr_indices: Vec<u32>,
    virtio: Arc<crate::virtio_devices::VirtioDevices>,
    lineage: Mutex<SnapshotLineage>,
    dirty_tracking: DirtyTracking,
    wp_tracker: Option<WpTracker>,
    /// A uffd backend's installed pages: each snapshot's working set.
    installed_pages: Option<crate::uffd::InstalledPages>,
}

/// The dirty set of one snapshot and what reading it cost.
struct DirtySet {
    pages: PageRuns,
    collect_us: u64,
    crosscheck: Option<Crosscheck>,
}

impl Controller {
    fn refuse_if_ending(&self) -> Result<(), VmError> {
        match self.exit.reason() {
            Some(r) => Err(VmError::new(
                ErrorKind::GuestGone,
                format!("the VM is shutting down ({r:?})"),
            )),
            None => Ok(()),
        }
    }

    fn save_vcpus(&self) -> Result<Vec<VcpuState>, VmError> {
        let count = usize::from(self.machine.vcpus);
        let results: Arc<Mutex<Vec<SavedVcpu>>> =
            Arc::new(Mutex::new((0..count).map(|_| None).collect()));
        let (sink, msrs) = (results.clone(), self.msr_indices.clone());
        let ran = self.vcpus.run_on_paused(Arc::new(move |index, fd| {
            let r = vm_state::save_vcpu(fd, &msrs).map_err(|e| format!("vCPU {index}: {e}"));
            sink.locked()[usize::from(index)] = Some(r);
        }));
        if !ran {
            return Err(VmError::new(
                ErrorKind::NotPaused,
                "the VM must be paused to snapshot it",
            ));
        }
        let results = std::mem::take(&mut *results.locked());
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                r.unwrap_or_else(|| Err(format!("vCPU {i} has stopped and cannot be saved")))
            })
            .collect::<Result<_, _>>()
            .map_err(VmError::internal)
    }

    /// Pages written since the last call, from the VM's dirty-tracking
    /// source; reading resets it.
    fn take_dirty(&self) -> Result<DirtySet, VmError> {
        let started = Instant::now();
        let uffd_wp = match &self.wp_tracker {
            Some(t) => Some(
                t.take_written()
                    .map_err(|e| VmError::internal(e.to_string()))?,
            ),
            None => None,
        };
        let collect_us = started.elapsed().as_micros() as u64;
        let kvm = if self.dirty_tracking.kvm_log() {
            Some(self.take_kvm_dirty_log()?)
        } else {
            None
        };
        Ok(match (uffd_wp, kvm) {
            (Some(wp), Some(kvm)) => DirtySet {
                crosscheck: Some(crate::dirty::crosscheck(&kvm, &wp)),
                pages: wp,
                collect_us,
            },
            (Some(wp), None) => DirtySet {
                pages: wp,
                collect_us,
                crosscheck: None,
            },
            (None, Some(kvm)) => DirtySet {
                pages: kvm,
                collect_us: started.elapsed().as_micros() as u64,
                crosscheck: None,
            },
            (None, None) => return Err(VmError::internal("this VM tracks no dirty pages")),
        })
    }

    /// Pages KVM saw dirtied since the last call, in memory-file page numbers.
    fn take_kvm_dirty_log(&self) -> Result<PageRuns, VmError> {
        let mut dirty = PageRuns::default();
        let mut first_page = 0u64;
        for (slot, region) in self.mem.iter().enumerate() {
            let bitmap = self
                .vm
                .fd
                .get_dirty_log(slot as u32, region.len() as usize)
                .map_err(|e| VmError::internal(format!("KVM_GET_DIRTY_LOG of slot {slot}: {e}")))?;
            dirty = dirty.union(&PageRuns::from_bitmap(&bitmap, first_page));
            first_page += region.len() / PAGE_SIZE;
        }
        Ok(dirty)
    }

    fn write_snapshot(&self, dir: &Path, diff: bool) -> Result<SnapshotInfo, VmError> {
        let started = Instant::now();
        // Device threads too: one writing guest memory while it is copied
        // leaves it out of step with the saved queues and the dirty set.
        if !self.vcpus.is_paused() || !self.virtio.is_paused() {
            return Err(VmError::new(
                ErrorKind::NotPaused,
                "the VM must be paused to snapshot it (send pause first)",
            ));
        }
        let mut lineage = self.lineage.locked();
        let parent = match (diff, &lineage.base) {
            (true, None) => {
                return Err(VmError::new(ErrorKind::InvalidRequest, "a diff snapshot needs a base: this VM was not restored from a snapshot and has taken none; take a full snapshot first"))
            }
            (true, Some(base)) => Some(canonical_chain(base)),
            (false, _) => None,
        };
        let io = |what: &str, e: std::io::Error| {
            VmError::new(
                ErrorKind::of_io(&e),
                format!("cannot {what} {}: {e}", dir.display()),
            )
            .with_layer(dir)
        };
        std::fs::create_dir_all(dir).map_err(|e| io("create", e))?;
        let dir = dir.canonicalize().map_err(|e| io("resolve", e))?;
        let record = match &parent {
            Some(chain) => Lineage {
                version: Lineage::base(&dir).version,
                layers: chain.clone(),
            }
            .child(&dir),
            None => Lineage::base(&dir),
        };
        if record.depth() > crate::restore::MAX_CHAIN_DEPTH {
            return Err(VmError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "a diff here would make a chain of {} layers (at most {})",
                    record.depth(),
                    crate::restore::MAX_CHAIN_DEPTH
                ),
            ));
        }
        let parent = parent.and_then(|chain| chain.last().cloned());
        let vcpus = self.save_vcpus()?;
        let vm = vm_state::save_vm(&self.vm.fd).map_err(|e| VmError::internal(e.to_string()))?;
        let (virtio, device_dirty) = self
            .virtio
            .save(&dir)
            .map_err(|e| VmError::internal(e.to_string()))?;
        let devices = DeviceStates {
            serial: self.serial.locked().save(),
            virtio,
        };
        // Reading the dirty log also resets it: the next diff starts here.
        // Device writes to guest memory are not in it: add them.
        let dirty_set = match self.take_dirty() {
            Ok(set) => set,
            Err(e) => {
                lineage.vmm_dirty = lineage.vmm_dirty.union(&device_dirty);
                return Err(e);
            }
        };
        let dirty = dirty_set
            .pages
            .union(&lineage.vmm_dirty)
            .union(&device_dirty);
        let written = (|| {
            let slices = guest_slices(&self.mem);
            let memory_path = dir.join(snapshot::MEMORY_FILE);
            let (memory, info) = match parent {
                None => (
                    MemoryLayer::Full,
                    snapshot::write_full_memory(&memory_path, &slices).map_err(|e| e.vm_error())?,
                ),
                Some(parent) => {
                    let info = snapshot::write_memory_pages(&memory_path, &slices, &dirty)
                        .map_err(|e| e.vm_error())?;
                    (
                        MemoryLayer::Diff {
                            parent,
                            pages: dirty.clone(),
                        },
                        info,
                    )
                }
            };
            let state = MicrovmState {
                machine: self.machine.clone(),
                memory,
                vcpus,
                vm,
                devices,
                generation: self.generation,
                taken_unix_ns: crate::identity::unix_now_ns(),
            };
            self.write_touched(&dir);
            record.write(&dir).map_err(|e| match e {
                torpor_vmm_api::lineage::LineageError::Write { source, .. } => {
                    io("write the lineage record in", source)
                }
                other => VmError::internal(other.to_string()),
            })?;
            let state_bytes = snapshot::write_state(&dir.join(snapshot::STATE_FILE), &state)
                .map_err(|e| e.vm_error())?;
            Ok((info, state_bytes))
        })();
        let (info, state_bytes) = match written {
            Ok(written) => written,
            Err(e) => {
                // The tracking source has forgotten these pages, and the
                // base is still the last snapshot that succeeded: keep them
                // for the next diff (a failed snapshot retried once space is
                // freed would otherwise leave them out of it).
                lineage.vmm_dirty = dirty;
                return Err(e);
            }
        };
        lineage.base = Some(record.layers.clone());
        lineage.vmm_dirty = PageRuns::default();
        Ok(SnapshotInfo {
            path: dir,
            diff,
            pages: if diff {
                dirty.page_count()
            } else {
                info.data_pages
            },
            memory_allocated_bytes: info.allocated_bytes,
            state_bytes,
            duration_us: started.elapsed().as_micros() as u64,
            dirty_tracking: self.dirty_tracking.name().to_string(),
            dirty_collect_us: dirty_set.collect_us,
            dirty_crosscheck: dirty_set.crosscheck,
            lineage: record.layers,
        })
    }
}

impl Controller {
    /// Records the pages the page server installed since the restore
    /// beside snapshot `dir` (`TOUCHED_FILE`, written before its state,
    /// whose directory sync makes it durable too), whose chunks a lazy wake
    /// from it fetches first. Best effort: a snapshot without it restores
    /// all the same.
    fn write_touched(&self, dir: &Path) {
        let Some(installed) = &self.installed_pages else {
            return;
        };
        match installed.write(dir) {
            Ok(pages) => tracing::debug!(?pages, "working set recorded in {}", dir.display()),
            Err(e) => {
                tracing::warn!("cannot record the working set in {}: {e}", dir.display());
                let _ = std::fs::remove_file(dir.join(torpor_vmm_api::lineage::TOUCHED_FILE));
            }
        }
    }
}

/// A balloon request's refusal: no balloon, or a target past guest memory.
fn balloon_error(e: crate::virtio_devices::VirtioDevicesError) -> VmError {
    use crate::virtio_devices::VirtioDevicesError as E;
    let kind = match &e {
        E::NoBalloon => ErrorKind::Unsupported,
        _ => match e.device::<crate::devices::balloon::BalloonKind>() {
            Some(crate::devices::balloon::BalloonError::TargetTooLarge(_)) => {
                ErrorKind::InvalidRequest
            }
            _ => ErrorKind::Internal,
        },
    };
    VmError::new(kind, e.to_string())
}

/// A chain's layers as canonical paths (the lineage record's form); the
/// restore path records them as given, and resolving waits until a
/// snapshot needs them, off the restore's hot path.
fn canonical_chain(chain: &[PathBuf]) -> Vec<PathBuf> {
    chain
        .iter()
        .map(|d| d.canonicalize().unwrap_or_else(|_| d.clone()))
        .collect()
}

impl Controller {
    /// The `vcpu_state` answer: a running VM paused for the reading (each
    /// vCPU's thread saves its own state) and let run again; a paused
    /// one read as it is.
    fn read_vcpu_state(&self) -> Result<VcpuStates, VmError> {
        self.refuse_if_ending()?;
        let paused_here = self.vcpus.pause_if_running();
        if !paused_here && !self.vcpus.is_paused() {
            return Err(VmError::new(
                ErrorKind::WrongState,
                "the vCPUs are not running yet (or are ending)",
            ));
        }
        let saved = self.save_vcpus();
        if paused_here {
            self.vcpus.resume();
        }
        let vcpus = saved?
            .iter()
            .enumerate()
            .map(|(i, s)| crate::vcpu_report::vcpu(i as u8, s))
            .collect();
        let chip = vm_state::get_irqchip(&self.vm.fd, kvm_bindings::KVM_IRQCHIP_IOAPIC)
            .map_err(|e| VmError::internal(e.to_string()))?;
        let (ioapic, ioapic_irr) = crate::vcpu_report::ioapic(&chip);
        Ok(VcpuStates {
            vcpus,
            ioapic,
            ioapic_irr,
        })
    }
}

impl VmController for Controller {
    fn status(&self) -> VmStatus {
        let state = if self.exit.reason().is_some() {
            VmState::ShuttingDown
        } else if self.vcpus.is_paused() {
            VmState::Paused
        } else {
            VmState::Running
        };
        VmStatus {
            protocol: PROTOCOL_VERSION,
            state,
            pid: std::process::id(),
            vcpus: self.machine.vcpus,
            mem_mib: self.machine.mem_mib,
            kernel: self.machine.kernel.clone(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            generation: self.generation,
            memory_backend: self.backend.to_string(),
            base_snapshot: self
                .lineage
                .locked()
                .base
                .as_ref()
                .and_then(|chain| chain.last().cloned()),
            guest_clock_ns: vm_state::guest_clock_ns(&self.vm.fd).ok(),
            dirty_tracking: self.dirty_tracking.name().to_string(),
            console_dropped_bytes: crate::builder::console_dropped_bytes(),
        }
    }

    /// vCPUs first, so no new work reaches the devices; then the device
    /// threads, which finish what they hold (used rings, interrupts into
    /// the in-kernel irqchip) before anything is saved.
    fn pause(&self) -> Result<VmStatus, VmError> {
        self.refuse_if_ending()?;
        let was_paused = self.vcpus.is_paused();
        self.vcpus.pause();
        if let Err(e) = self.virtio.pause() {
            // Not left half paused: the device runs on, so do the vCPUs.
            if !was_paused {
                self.vcpus.resume();
            }
            return Err(VmError::internal(format!("cannot pause the devices: {e}")));
        }
        Ok(self.status())
    }

    /// The reverse: devices first, so the guest never runs against a
    /// stopped device.
    fn resume(&self) -> Result<VmStatus, VmError> {
        self.refuse_if_ending()?;
        self.virtio
            .resume()
            .map_err(|e| VmError::internal(format!("cannot resume the devices: {e}")))?;
        self.vcpus.resume();
        Ok(self.status())
    }

    fn shutdown(&self) -> Result<VmStatus, VmError> {
        self.exit.exit(ExitReason::ControlShutdown);
        Ok(self.status())
    }

    fn snapshot(&self, path: &Path, diff: bool) -> Result<SnapshotInfo, VmError> {
        self.refuse_if_ending()?;
        self.write_snapshot(path, diff)
    }

    fn set_balloon(&self, target_mib: u64) -> Result<BalloonStatus, VmError> {
        self.refuse_if_ending()?;
        self.virtio.set_balloon(target_mib).map_err(balloon_error)
    }

    fn vcpu_state(&self) -> Result<VcpuStates, VmError> {
        self.read_vcpu_state()
    }

    fn balloon(&self) -> Result<BalloonStatus, VmError> {
        self.virtio.balloon_status().map_err(balloon_error)
    }

    fn hibernate(&self, path: &Path, diff: bool) -> Result<SnapshotInfo, VmError> {
        let was_running = !self.vcpus.is_paused();
        self.pause()?;
        match self.write_snapshot(path, diff) {
            Ok(info) => {
                // The control server holds its answer lock while this
                // answer is written; the VMM ends after it.
                self.exit.exit(ExitReason::Hibernated);
                Ok(info)
            }
            Err(e) => {
                if was_running {
                    let _ = self.resume();
                }
                Err(e)
            }
        }
    }
}

/// A restore request of a standby VMM, answered once the vCPUs run.
#[derive(Debug)]
pub struct PendingRestore {
    pub stream: std::os::unix::net::UnixStream,
    pub request_started: Instant,
}

/// Threads a standby shell made ahead, each already under its filter: the
/// vCPU threads and the control server's.
#[derive(Debug)]
pub struct Spares {
    pub vcpus: crate::vstate::vcpu::SpareThreads,
    pub control: control::SpareControl,
}

/// What runs once the VMM's control socket serves (the VM built, or a
/// standby shell made): `torpor-vmm` writes its `ready` line there. Passed
/// down from the launch (`launch::run`); fires at most once.
#[derive(Default)]
pub struct Ready(Option<Box<dyn FnOnce() + Send>>);

impl Ready {
    /// Runs `hook` when the control socket serves.
    pub fn new(hook: impl FnOnce() + Send + 'static) -> Ready {
        Ready(Some(Box::new(hook)))
    }

    /// Nothing to run (already fired, or nobody waits).
    pub fn none() -> Ready {
        Ready(None)
    }

    /// Runs the hook, if it has not run.
    pub(crate) fn fire(&mut self) {
        if let Some(hook) = self.0.take() {
            hook();
        }
    }
}

impl std::fmt::Debug for Ready {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Ready(pending)"
        } else {
            "Ready(fired)"
        })
    }
}

/// A VM whose threads all run, each under its filter, with the vCPUs held
/// out of the guest until [`Launched::run`].
#[derive(Debug)]
pub struct Launched {
    vcpus: Arc<VcpuSet>,
    controller: Arc<Controller>,
    server: Option<ControlServer>,
    first_run: Arc<OnceLock<Instant>>,
    exit: ExitSignal,
    start_paused: bool,
    pending: Option<PendingRestore>,
    timings: Timings,
    keepalive: Option<Box<dyn std::any::Any + Send>>,
    started: Instant,
}

/// Starts a built VM's device, vCPU (held) and control threads;
/// [`Launched::run`] runs it until the guest or a control request ends it.
/// `started` is when the run began (process start, for restores).
pub fn launch_built(
    built: BuiltVm,
    listener: Option<(std::os::unix::net::UnixListener, PathBuf)>,
    start_paused: bool,
    exit: ExitSignal,
    started: Instant,
    pending: Option<PendingRestore>,
    spares: Option<Spares>,
) -> Result<Launched, RunError> {
    let (spare_vcpus, spare_control) = match spares {
        Some(s) => (Some(s.vcpus), Some(s.control)),
        None => (None, None),
    };
    register_kick_handler()?;
    let mut timings = built.timings;
    let first_run = Arc::new(OnceLock::new());
    let vm = Arc::new(built.vm);
    let mem = Arc::new(built.mem);
    let virtio = Arc::new(built.virtio);
    virtio
        .start(start_paused)
        .map_err(|e| RunError::Build(e.into()))?;
    let vcpus = Arc::new(VcpuSet::start(
        built.vcpus,
        built.bus.clone(),
        virtio.mmio.clone(),
        exit.clone(),
        first_run.clone(),
        start_paused,
        spare_vcpus,
    )?);
    timings.phase("vcpu_threads");
    let controller = Arc::new(Controller {
        vm: vm.clone(),
        mem: mem.clone(),
        vcpus: vcpus.clone(),
        serial: built.serial,
        exit: exit.clone(),
        started,
        machine: built.machine,
        generation: built.generation,
        backend: built.backend,
        msr_indices: built.msr_indices,
        virtio,
        lineage: Mutex::new(SnapshotLineage {
            base: built.base_chain,
            vmm_dirty: built.vmm_dirty,
        }),
        dirty_tracking: built.dirty_tracking,
        wp_tracker: built.wp_tracker,
        installed_pages: built.installed_pages,
    });
    // Before the control server answers: a status answer means it is done.
    release_freed_heap();
    let server = match listener {
        Some((l, path)) => Some(
            ControlServer::start(l, path, controller.clone(), spare_control)
                .map_err(RunError::ControlThread)?,
        ),
        None => None,
    };
    Ok(Launched {
        vcpus,
        controller,
        server,
        first_run,
        exit,
        start_paused,
        pending,
        timings,
        keepalive: built.keepalive,
        started,
    })
}

impl Launched {
    /// Confines the calling thread as the VMM's main thread (a standby
    /// shell's is already), lets the guest run, fires `ready`, and waits
    /// for its end.
    pub fn run(self, mut ready: Ready) -> Result<RunReport, RunError> {
        let Launched {
            vcpus,
            controller,
            server,
            first_run,
            exit,
            start_paused,
            pending,
            timings,
            keepalive,
            started,
        } = self;
        // Every long-lived thread runs (each under its own filter): confine
        // this one, then let the guest run.
        if let Err(e) = crate::seccomp::install(crate::seccomp::ThreadKind::Main) {
            vcpus.stop(std::time::Duration::from_millis(500));
            return Err(e.into());
        }
        vcpus.release();
        if let Some(p) = pending {
            answer_restore(p, &first_run, start_paused, &controller, &timings);
        }
        ready.fire();
        tracing::info!(?timings, "microVM started");
        let reason = exit.wait();
        vcpus.stop(std::time::Duration::from_millis(500));
        let _quiet = server.as_ref().map(|s| s.quiesce());
        // The page server (if any) must outlive every vCPU thread.
        drop(keepalive);
        // Guest memory and the VM (held by the controller) outlive both.
        drop(controller);
        Ok(RunReport {
            exit: reason,
            timings,
            first_kvm_run_us: first_run
                .get()
                .map(|t| t.duration_since(started).as_micros() as u64),
        })
    }
}

/// Hands the heap pages freed by start-up (snapshot state, page maps) back
/// to the kernel: an idle clone should hold only what it still uses, and
/// start-up's garbage is a third of a paused clone's private memory.
fn release_freed_heap() {
    // SAFETY: malloc_trim only releases free heap memory; no pointer we hold
    // is affected.
    unsafe { libc::malloc_trim(0) };
}

/// Cold-boots `config` and runs it until the guest or a control request
/// ends it; `ready` fires once its control socket serves.
pub fn boot(
    config: &crate::VmConfig,
    backend: &dyn crate::vstate::memory::MemoryBackend,
    control_socket: Option<PathBuf>,
    ready: Ready,
) -> Result<RunReport, RunError> {
    let started = Instant::now();
    crate::builder::validate(config)?;
    // Bind first: a socket in use must fail before any expensive work.
    let listener = bind_control(control_socket)?;
    let exit = ExitSignal::new().map_err(RunError::ExitEvent)?;
    let built = crate::builder::build(config, backend, &exit)?;
    launch_built(built, listener, false, exit, started, None, None)?.run(ready)
}

/// Binds the control socket, if one was asked for.
pub fn bind_control(
    path: Option<PathBuf>,
) -> Result<Option<(std::os::unix::net::UnixListener, PathBuf)>, RunError> {
    Ok(match path {
        Some(p) => Some((control::bind(&p)?, p)),
        None => None,
    })
}

/// Restores a snapshot into a fresh shell and runs it. With `paused`, the
/// vCPUs wait for a `resume` request. `ready` fires once the control
/// socket serves.
pub fn restore(
    opts: &crate::restore::RestoreOptions,
    control_socket: Option<PathBuf>,
    paused: bool,
    ready: Ready,
) -> Result<RunReport, RunError> {
    let started = Instant::now();
    let listener = bind_control(control_socket)?;
    let mut t = Timings::start();
    let chain = crate::restore::load_chain(&opts.snapshot)?;
    t.phase("read_state");
    let exit = ExitSignal::new().map_err(RunError::ExitEvent)?;
    let shell = crate::restore::create_shell(
        chain.state.machine.mem_mib,
        chain.state.machine.vcpus,
        opts.dirty_tracking,
        &mut t,
    )?;
    let built = crate::restore::restore_into(shell, chain, opts, &exit, t)?;
    launch_built(built, listener, paused, exit, started, None, None)?.run(ready)
}

/// Answers a standby restore request once a vCPU has entered KVM_RUN (or at
/// once when restored paused), with the request-to-running time.
fn answer_restore(
    p: PendingRestore,
    first_run: &OnceLock<Instant>,
    paused: bool,
    controller: &Controller,
    timings: &Timings,
) {
    use std::io::Write;
    let deadline = Instant::now() + std::time::Duration::from_secs(1);
    let running_at = loop {
        if paused {
            break Instant::now();
        }
        if let Some(t) = first_run.get() {
            break *t;
        }
        if Instant::now() > deadline {
            break Instant::now();
        }
        // Sleep, not spin: on a small host a spinning waiter takes the CPU
        // the vCPU thread needs to reach KVM_RUN. The vCPU thread stamps
        // `first_run` itself, so the measured time does not include this.
        std::thread::sleep(std::time::Duration::from_micros(20));
    };
    let response = control::Response {
        ok: true,
        status: Some(controller.status()),
        restore: Some(control::RestoreInfo {
            request_to_running_us: running_at.duration_since(p.request_started).as_micros() as u64,
            phases: timings
                .phases()
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
        }),
        ..Default::default()
    };
    let mut stream = p.stream;
    let line = serde_json::to_string(&response).unwrap_or_default() + "\n";
    if let Err(e) = stream.write_all(line.as_bytes()) {
        tracing::warn!("cannot answer the restore request: {e}");
    }
}

/// The main thread once the VM runs: waits for the end (the exit
/// eventfd), answers a standby's restore request (socket writes are
/// send(MSG_NOSIGNAL)) with the VM status, which carries the guest clock,
/// and removes the control socket's file at the end. Stopping the vCPUs
/// is their kick.
pub(crate) fn main_syscalls(
    r: &mut crate::seccomp::Rules,
) -> Result<(), crate::seccomp::SeccompError> {
    r.allow(&[libc::SYS_read, libc::SYS_sendto, libc::SYS_unlink]);
    r.allow_values(
        libc::SYS_ioctl,
        1,
        &[crate::seccomp::ioctls::kvm_get_clock()],
    )?;
    Ok(())
}
