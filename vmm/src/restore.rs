//! Restore: a snapshot (a full one, or a chain of diffs on a full one) into
//! a VM shell. A shell is a KVM VM with its vCPUs and memory slots already
//! created and registered over placeholder memory; restoring maps the
//! snapshot's memory over the placeholder and loads state. The same path
//! serves a fresh `torpor vmm --restore` (shell made on the spot) and a
//! pre-created standby shell (made before the request arrives).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kvm_ioctls::{Cap, VcpuFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::builder::{self, BuildError, BuiltVm, SerialOutput, Timings};
use crate::devices::serial::SerialDevice;
use crate::dirty::{DirtyError, DirtyTracking, WpTracker};
use crate::exit::ExitSignal;
use crate::identity;
use crate::persist::{self, MemoryLayer, MicrovmState, Persist};
use crate::snapshot::{self, PageRuns, SnapshotError, PAGE_SIZE};
use crate::vstate::kvm::KvmContext;
use crate::vstate::memory::{ram_ranges, validate_mem_size, AnonymousBackend, MemoryBackend};
use crate::vstate::vcpu::Vcpu;
use crate::vstate::vm::Vm;

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
    State(#[from] persist::StateError),
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

/// One memory layer of a chain, bottom (the full snapshot) first.
#[derive(Debug)]
pub struct LayerFile {
    pub dir: PathBuf,
    pub file: File,
    /// `None` for the full base layer.
    pub pages: Option<PageRuns>,
}

/// A snapshot to restore: the top state and every memory layer under it.
#[derive(Debug)]
pub struct SnapshotChain {
    pub top_dir: PathBuf,
    pub state: MicrovmState,
    /// Bottom (full) first, top last.
    pub layers: Vec<LayerFile>,
}

/// Reads and checks the snapshot at `dir` and every parent it names.
/// Nothing is mapped or run unless all of it is valid.
pub fn load_chain(dir: &Path) -> Result<SnapshotChain, RestoreError> {
    let top_dir = dir.to_path_buf();
    let state: MicrovmState = snapshot::read_state(&dir.join(snapshot::STATE_FILE))?;
    let mem_len = validate_mem_size(state.machine.mem_mib).map_err(BuildError::from)?;
    if state.vcpus.len() != usize::from(state.machine.vcpus) {
        return Err(RestoreError::VcpuCount {
            snapshot: top_dir,
            found: state.vcpus.len(),
            expected: state.machine.vcpus,
        });
    }
    let mut layers = Vec::new();
    let mut current = (top_dir.clone(), state.memory.clone());
    loop {
        if layers.len() >= MAX_CHAIN_DEPTH {
            return Err(RestoreError::ChainTooDeep(top_dir));
        }
        let (layer_dir, layer) = current;
        let file = snapshot::check_memory_file(&layer_dir.join(snapshot::MEMORY_FILE), mem_len)?;
        match layer {
            MemoryLayer::Full => {
                layers.push(LayerFile {
                    dir: layer_dir,
                    file,
                    pages: None,
                });
                break;
            }
            MemoryLayer::Diff { parent, pages } => {
                check_pages(&layer_dir, &pages, mem_len)?;
                let parent = if parent.is_absolute() {
                    parent
                } else {
                    layer_dir.join(parent)
                };
                let parent_state: MicrovmState =
                    snapshot::read_state(&parent.join(snapshot::STATE_FILE))?;
                if parent_state.machine.mem_mib != state.machine.mem_mib {
                    return Err(RestoreError::ParentMismatch {
                        child: layer_dir,
                        parent,
                        detail: format!(
                            "{} MiB vs {} MiB",
                            state.machine.mem_mib, parent_state.machine.mem_mib
                        ),
                    });
                }
                layers.push(LayerFile {
                    dir: layer_dir,
                    file,
                    pages: Some(pages),
                });
                current = (parent, parent_state.memory);
            }
        }
    }
    layers.reverse();
    Ok(SnapshotChain {
        top_dir,
        state,
        layers,
    })
}

/// A diff layer's pages, decoded from its state file, must be sorted,
/// disjoint and inside guest memory before anything maps or serves them.
fn check_pages(layer: &Path, pages: &PageRuns, mem_len: u64) -> Result<(), RestoreError> {
    let total = mem_len / PAGE_SIZE;
    let detail = if !pages.is_well_formed() {
        "runs not sorted, empty, touching or overflowing".to_string()
    } else if pages.end_page() > total {
        format!(
            "pages up to {} in {total} pages of memory",
            pages.end_page()
        )
    } else {
        return Ok(());
    };
    Err(RestoreError::BadPages {
        layer: layer.to_path_buf(),
        detail,
    })
}

/// A VM with vCPUs and registered memory, waiting for state.
#[derive(Debug)]
pub struct Shell {
    pub kvm: KvmContext,
    pub vm: Vm,
    pub mem: GuestMemoryMmap,
    pub vcpus: Vec<VcpuFd>,
    pub serial_irq: EventFd,
    pub mem_mib: u64,
    pub vcpu_count: u16,
    pub msr_indices: Vec<u32>,
    pub xsave_size: i32,
    /// Whether the memory slots log dirty pages (KVM_MEM_LOG_DIRTY_PAGES).
    pub kvm_dirty_log: bool,
    /// A standby shell's console-open thread, made ahead.
    pub console_opener: Option<builder::ConsoleOpener>,
}

/// Creates a shell: KVM VM, placeholder memory registered as KVM slots,
/// vCPUs, the serial interrupt line. The slots log dirty pages if
/// `dirty_tracking` reads KVM's dirty log.
pub fn create_shell(
    mem_mib: u64,
    vcpus: u16,
    dirty_tracking: DirtyTracking,
    t: &mut Timings,
) -> Result<Shell, BuildError> {
    let (kvm, count) = builder::open_kvm(vcpus)?;
    let msr_indices = persist::saveable_msrs(&kvm.kvm)?;
    let xsave_size = kvm.kvm.check_extension_int(Cap::Xsave2);
    t.phase("kvm_open");
    let vm = Vm::create(&kvm)?;
    t.phase("vm_create");
    let mem = AnonymousBackend.map(&ram_ranges(validate_mem_size(mem_mib)?))?;
    vm.register_memory(&mem, dirty_tracking.kvm_log())?;
    t.phase("memory_slots");
    vm.create_irqchip()?;
    t.phase("irqchip");
    let mut fds = Vec::with_capacity(usize::from(count));
    for index in 0..count {
        fds.push(
            vm.fd
                .create_vcpu(u64::from(index))
                .map_err(|source| crate::vstate::vcpu::VcpuError::Create { index, source })?,
        );
    }
    let serial_irq = builder::serial_irq(&vm)?;
    t.phase("vcpu_create");
    Ok(Shell {
        kvm,
        vm,
        mem,
        vcpus: fds,
        serial_irq,
        mem_mib,
        vcpu_count: vcpus,
        msr_indices,
        xsave_size,
        kvm_dirty_log: dirty_tracking.kvm_log(),
        console_opener: None,
    })
}

/// Host address and length of each guest RAM region, with the memory-file
/// page index it starts at.
fn region_spans(mem: &GuestMemoryMmap) -> Vec<(*mut u8, usize, u64)> {
    let mut first_page = 0;
    mem.iter()
        .map(|r| {
            let span = (r.as_ptr(), r.len() as usize, first_page);
            first_page += r.len() / PAGE_SIZE;
            span
        })
        .collect()
}

/// Maps `len` bytes of `file` at `offset` privately over `addr`.
pub(crate) fn map_fixed_private(
    addr: *mut u8,
    len: usize,
    file: &File,
    offset: u64,
    path: &Path,
) -> Result<(), RestoreError> {
    // SAFETY: `addr..addr+len` lies inside a guest RAM mapping this process
    // owns; MAP_FIXED replaces those pages atomically with a private view
    // of the file, and no vCPU runs yet.
    let ret = unsafe {
        libc::mmap(
            addr.cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
            file.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if ret == libc::MAP_FAILED {
        return Err(RestoreError::Map {
            path: path.to_path_buf(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Splits a run of memory-file pages at region boundaries: yields (host
/// address, bytes, file offset).
fn run_spans(
    spans: &[(*mut u8, usize, u64)],
    first: u64,
    count: u64,
) -> Vec<(*mut u8, usize, u64)> {
    let mut out = Vec::new();
    for &(addr, len, region_first) in spans {
        let region_pages = len as u64 / PAGE_SIZE;
        let start = first.max(region_first);
        let end = (first + count).min(region_first + region_pages);
        if start < end {
            // SAFETY: `start - region_first` pages lie within this region.
            let host = unsafe { addr.add(((start - region_first) * PAGE_SIZE) as usize) };
            out.push((
                host,
                ((end - start) * PAGE_SIZE) as usize,
                start * PAGE_SIZE,
            ));
        }
    }
    out
}

/// The `file` backend: the base mapped privately, each diff's pages mapped
/// over it (copied past the mapping budget). O(layers + runs), never
/// O(guest memory).
fn map_file_layers(mem: &GuestMemoryMmap, chain: &SnapshotChain) -> Result<(), RestoreError> {
    let spans = region_spans(mem);
    let mut mappings = 0usize;
    for layer in &chain.layers {
        let path = layer.dir.join(snapshot::MEMORY_FILE);
        match &layer.pages {
            None => {
                for &(addr, len, first_page) in &spans {
                    map_fixed_private(addr, len, &layer.file, first_page * PAGE_SIZE, &path)?;
                }
            }
            Some(pages) => {
                for &(first, count) in pages.runs() {
                    for (host, len, offset) in run_spans(&spans, first, count) {
                        if mappings < MAX_OVERLAY_MAPPINGS {
                            map_fixed_private(host, len, &layer.file, offset, &path)?;
                            mappings += 1;
                        } else {
                            copy_from_file(host, len, &layer.file, offset, &path)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn copy_from_file(
    host: *mut u8,
    len: usize,
    file: &File,
    offset: u64,
    path: &Path,
) -> Result<(), RestoreError> {
    use std::os::unix::fs::FileExt;
    // SAFETY: `host..host+len` is guest RAM owned by this process and no
    // vCPU runs yet, so nothing else accesses it.
    let buf = unsafe { std::slice::from_raw_parts_mut(host, len) };
    file.read_exact_at(buf, offset)
        .map_err(|source| RestoreError::Copy {
            path: path.to_path_buf(),
            source,
        })
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
    let (keepalive, wp_tracker) = match opts.backend {
        RestoreBackend::File => {
            map_file_layers(&shell.mem, &chain)?;
            let tracker = if opts.dirty_tracking.uffd_wp() {
                // SAFETY: the spans are this VM's guest RAM, which lives in
                // the BuiltVm next to the tracker; nothing else registers it.
                Some(unsafe { WpTracker::start(spans) }?)
            } else {
                None
            };
            (None, tracker)
        }
        RestoreBackend::Uffd | RestoreBackend::UffdShared => {
            // The page server registers and protects the memory itself
            // (one userfaultfd per range), installing pages protected.
            let server = crate::uffd_backend::start(&shell.mem, &chain, opts, exit)?;
            let tracker = if opts.dirty_tracking.uffd_wp() {
                Some(WpTracker::attach(spans)?)
            } else {
                None
            };
            (Some(server), tracker)
        }
    };
    t.phase("memory_map");

    let mut vcpus = Vec::with_capacity(shell.vcpus.len());
    for (index, (fd, saved)) in shell.vcpus.into_iter().zip(&state.vcpus).enumerate() {
        persist::restore_vcpu(&fd, saved, shell.xsave_size)?;
        vcpus.push(Vcpu {
            index: index as u8,
            fd,
        });
    }
    persist::restore_vm(&shell.vm.fd, &state.vm)?;
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
        msr_indices: shell.msr_indices,
        virtio,
        dirty_tracking: opts.dirty_tracking,
        wp_tracker,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_region_boundaries() {
        let a = 0x1000_0000usize as *mut u8;
        let b = 0x9000_0000usize as *mut u8;
        // Region 0: pages 0..4, region 1: pages 4..8.
        let spans = [(a, 4 * 4096, 0u64), (b, 4 * 4096, 4u64)];
        let out = run_spans(&spans, 2, 4);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], (a.wrapping_add(2 * 4096), 2 * 4096, 2 * 4096));
        assert_eq!(out[1], (b, 2 * 4096, 4 * 4096));
        assert!(run_spans(&spans, 8, 1).is_empty());
    }
}

/// A diff layer's pages come from its state file: they are checked before
/// anything maps or serves them (review of the fuzz target
/// snapshot_layers, which asserts this of every chain that loads).
#[cfg(test)]
mod page_checks {
    use super::*;

    fn runs(r: &[(u64, u64)]) -> PageRuns {
        bincode::deserialize(&bincode::serialize(&r.to_vec()).unwrap()).unwrap()
    }

    #[test]
    fn diff_pages_must_be_sorted_and_inside_memory() {
        let dir = Path::new("/snap");
        let mem = 64 * PAGE_SIZE;
        assert!(check_pages(dir, &runs(&[(0, 2), (10, 54)]), mem).is_ok());
        for bad in [
            &[(0, 65)][..],
            &[(u64::MAX, 2)],
            &[(10, 1), (2, 1)],
            &[(3, 0)],
        ] {
            let e = check_pages(dir, &runs(bad), mem).expect_err("bad runs accepted");
            assert!(matches!(e, RestoreError::BadPages { .. }), "{e}");
            assert_eq!(e.vm_error().kind, torpor_vmm_api::ErrorKind::BadSnapshot);
        }
    }
}
