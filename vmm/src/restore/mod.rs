//! Restore: a snapshot (a full one, or a chain of diffs on a full one) into
//! a VM shell. A shell is a KVM VM with its vCPUs and memory slots already
//! created and registered over placeholder memory; restoring maps the
//! snapshot's memory over the placeholder and loads state. The same path
//! serves a fresh `torpor vmm --restore` (shell made on the spot) and a
//! pre-created standby shell (made before the request arrives).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::builder::{self, BuildError, BuiltVm, SerialOutput, Timings};
use crate::devices::serial::SerialDevice;
use crate::dirty::{DirtyError, DirtyTracking, WpTracker};
use crate::exit::ExitSignal;
use crate::identity;
use crate::snapshot::{PageRuns, Persist, SnapshotError};
use crate::vm_state;
use crate::vstate::vcpu::Vcpu;

mod chain;
mod file_backend;
mod shell;
pub(crate) mod uffd_backend;

pub use chain::{load_chain, LayerFile, SnapshotChain};
use file_backend::map_file_layers;
pub(crate) use file_backend::map_fixed_private;
pub use shell::{create_shell, Shell};

/// Longest chain of diff snapshots we follow before assuming a loop.
pub use torpor_vmm_api::lineage::MAX_CHAIN_DEPTH;
/// Diff runs mapped individually over the base; beyond this many, the rest
/// are copied so the process stays well inside the kernel's mapping limit.
const MAX_OVERLAY_MAPPINGS: usize = 16_384;

/// How restored guest memory is backed (the contract's `MemoryBackend`).
pub use torpor_vmm_api::launch::MemoryBackend as RestoreBackend;

/// What to restore and how.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    pub snapshot: PathBuf,
    pub backend: RestoreBackend,
    pub serial: SerialOutput,
    /// Install the pages of the snapshot's recorded working set eagerly.
    pub prefetch: bool,
    /// The map file of a memory file still arriving from the object store
    /// (`torpor_vmm_api::lazy`): the page server waits for a chunk's
    /// present bit before it reads the chunk (uffd backend).
    pub lazy_map: Option<PathBuf>,
    /// Record pages first touched in this window after restore (uffd).
    pub record_working_set_ms: Option<u64>,
    /// The clone's own disk overlay and vsock socket.
    pub virtio: crate::virtio_devices::VirtioRestorePaths,
    /// Where this VM's diff snapshots take their dirty pages from; the
    /// shell's KVM slots must have been made for it (`create_shell`).
    pub dirty_tracking: DirtyTracking,
}

/// Errors while restoring.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    State(#[from] vm_state::StateError),
    #[error("snapshot chain from {0} is longer than {MAX_CHAIN_DEPTH} layers (a loop?)")]
    ChainTooDeep(PathBuf),
    #[error(
        "snapshot {child} is a diff of {parent}, which describes a different machine ({detail})"
    )]
    ParentMismatch {
        child: PathBuf,
        parent: PathBuf,
        detail: String,
    },
    #[error("snapshot {snapshot} is for {snapshot_mib} MiB and {snapshot_vcpus} vCPUs; this shell has {shell_mib} MiB and {shell_vcpus} vCPUs")]
    ShellMismatch {
        snapshot: PathBuf,
        snapshot_mib: u64,
        snapshot_vcpus: u16,
        shell_mib: u64,
        shell_vcpus: u16,
    },
    #[error("snapshot {layer}'s diff pages are invalid: {detail}")]
    BadPages { layer: PathBuf, detail: String },
    #[error("snapshot {snapshot} has {found} vCPU states but describes {expected} vCPUs")]
    VcpuCount {
        snapshot: PathBuf,
        found: usize,
        expected: u16,
    },
    #[error("cannot map memory file {path}: {source}")]
    Map {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot copy diff pages from {path}: {source}")]
    Copy {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the {backend} memory backend is unavailable: {reason}")]
    Backend {
        backend: &'static str,
        reason: String,
    },
    #[error("serial state: {0}")]
    Serial(#[from] crate::devices::serial::SerialError),
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    #[error(transparent)]
    Virtio(#[from] crate::virtio_devices::VirtioDevicesError),
    #[error(transparent)]
    Dirty(#[from] DirtyError),
    #[error("this shell was made for {shell} dirty tracking, the restore asks for {requested}")]
    DirtyTrackingMismatch {
        shell: &'static str,
        requested: &'static str,
    },
}

impl RestoreError {
    /// Classified for the pod: which layer is bad, a request that does not
    /// fit, a backend this host lacks, or an I/O failure.
    pub fn vm_error(&self) -> torpor_vmm_api::VmError {
        use torpor_vmm_api::{ErrorKind, VmError};
        let msg = self.to_string();
        match self {
            RestoreError::Snapshot(e) => e.vm_error(),
            RestoreError::Build(e) => e.vm_error(),
            RestoreError::ChainTooDeep(dir) => {
                VmError::new(ErrorKind::BadSnapshot, msg).with_layer(dir)
            }
            RestoreError::ParentMismatch { child, .. } => {
                VmError::new(ErrorKind::BadSnapshot, msg).with_layer(child)
            }
            RestoreError::VcpuCount { snapshot, .. }
            | RestoreError::BadPages {
                layer: snapshot, ..
            } => VmError::new(ErrorKind::BadSnapshot, msg).with_layer(snapshot),
            RestoreError::State(_) => VmError::new(ErrorKind::BadSnapshot, msg),
            RestoreError::ShellMismatch { .. } | RestoreError::DirtyTrackingMismatch { .. } => {
                VmError::new(ErrorKind::InvalidRequest, msg)
            }
            RestoreError::Map { path, source } | RestoreError::Copy { path, source } => {
                VmError::new(ErrorKind::of_io(source), msg)
                    .with_layer(path.parent().unwrap_or(path))
            }
            RestoreError::Backend { .. } | RestoreError::Dirty(_) => {
                VmError::new(ErrorKind::Unsupported, msg)
            }
            RestoreError::Serial(_) | RestoreError::Identity(_) | RestoreError::Virtio(_) => {
                VmError::internal(msg)
            }
        }
    }
}

/// Checks that a snapshot has the shell's shape.
pub fn check_fits(shell: &Shell, chain: &SnapshotChain) -> Result<(), RestoreError> {
    let m = &chain.state.machine;
    if m.mem_mib != shell.mem_mib || m.vcpus != shell.vcpu_count {
        return Err(RestoreError::ShellMismatch {
            snapshot: chain.top_dir.clone(),
            snapshot_mib: m.mem_mib,
            snapshot_vcpus: m.vcpus,
            shell_mib: shell.mem_mib,
            shell_vcpus: shell.vcpu_count,
        });
    }
    Ok(())
}

/// Restores `chain` into `shell`: memory, vCPU and VM state, devices, and a
/// fresh identity. Returns a VM ready to run.
pub fn restore_into(
    shell: Shell,
    chain: SnapshotChain,
    opts: &RestoreOptions,
    exit: &ExitSignal,
    mut t: Timings,
) -> Result<BuiltVm, RestoreError> {
    check_fits(&shell, &chain)?;
    if shell.kvm_dirty_log != opts.dirty_tracking.kvm_log() {
        return Err(RestoreError::DirtyTrackingMismatch {
            shell: if shell.kvm_dirty_log {
                "kvm"
            } else {
                "uffd-wp"
            },
            requested: opts.dirty_tracking.name(),
        });
    }
    let state = &chain.state;
    let spans = crate::dirty::guest_spans(&shell.mem);
    let (keepalive, installed_pages, wp_tracker) = match opts.backend {
        RestoreBackend::File => {
            map_file_layers(&shell.mem, &chain)?;
            let tracker = if opts.dirty_tracking.uffd_wp() {
                // SAFETY: the spans are this VM's guest RAM, which lives in
                // the BuiltVm next to the tracker; nothing else registers it.
                Some(unsafe { WpTracker::start(spans) }?)
            } else {
                None
            };
            // The kernel maps the files: no page server sees what the
            // guest touches, so its snapshots record no working set.
            (None, None, tracker)
        }
        RestoreBackend::Uffd | RestoreBackend::UffdShared => {
            // The page server registers and protects the memory itself
            // (one userfaultfd per range), installing pages protected.
            let server = uffd_backend::start(&shell.mem, &chain, opts, exit)?;
            let tracker = if opts.dirty_tracking.uffd_wp() {
                Some(WpTracker::attach(spans)?)
            } else {
                None
            };
            let installed = server.installed_pages();
            let keepalive: Box<dyn std::any::Any + Send> = Box::new(server);
            (Some(keepalive), Some(installed), tracker)
        }
    };
    t.phase("memory_map");

    let mut vcpus = Vec::with_capacity(shell.vcpus.len());
    for (index, (fd, saved)) in shell.vcpus.into_iter().zip(&state.vcpus).enumerate() {
        vm_state::restore_vcpu(&fd, saved, shell.xsave_size)?;
        vcpus.push(Vcpu {
            index: index as u8,
            fd,
        });
    }
    vm_state::restore_vm(&shell.vm.fd, &state.vm)?;
    t.phase("state");

    let out = builder::serial_output_deferred(&opts.serial, shell.console_opener)?;
    t.phase("console_open");
    let serial = Arc::new(Mutex::new(SerialDevice::restore(
        (shell.serial_irq, out),
        &state.devices.serial,
    )?));
    let bus = Arc::new(builder::build_bus(serial.clone(), exit)?);
    let virtio = crate::virtio_devices::VirtioDevices::restore(
        &shell.vm,
        &shell.mem,
        &state.devices.virtio,
        &opts.virtio,
    )?;
    t.phase("devices");
    let generation = state.generation + 1;
    identity::write(&shell.mem, generation)?;
    let mut vmm_dirty = PageRuns::default();
    vmm_dirty.push_run(identity::page_index(), 1);
    t.phase("identity");

    Ok(BuiltVm {
        vm: shell.vm,
        mem: shell.mem,
        vcpus,
        bus,
        serial,
        timings: t,
        machine: chain.state.machine.clone(),
        generation,
        base_chain: Some(chain.layers.iter().map(|l| l.dir.clone()).collect()),
        vmm_dirty,
        backend: opts.backend.name(),
        keepalive,
        installed_pages,
        msr_indices: shell.msr_indices,
        virtio,
        dirty_tracking: opts.dirty_tracking,
        wp_tracker,
    })
}
