//! Builds a microVM in boot order: KVM, VM, memory, kernel, boot tables,
//! devices, vCPUs. Each phase is timed for the boot benchmark.

use std::fs::File;
use std::io::{LineWriter, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use vmm_sys_util::eventfd::EventFd;

use crate::boot::{self, BootError, KernelImage};
use crate::devices::i8042::{I8042, I8042_DATA_PORT};
use crate::devices::serial::{SerialDevice, COM1_BASE, COM1_IRQ, COM1_PORTS};
use crate::devices::{BusError, PioBus};
use crate::dirty::{DirtyError, DirtyTracking, WpTracker};
use crate::exit::ExitSignal;
use crate::identity;
use crate::layout::EBDA_START;
use crate::mptable::{self, MptableError};
use crate::snapshot::PageRuns;
use crate::virtio_devices::VirtioDevices;
use crate::vm_state::{self, MachineConfig};
use crate::vstate::kvm::{KvmContext, KvmError};
use crate::vstate::memory::{ram_ranges, validate_mem_size, MemoryBackend, MemoryError};
use crate::vstate::regs::{self, RegsError};
use crate::vstate::vcpu::{Vcpu, VcpuError};
use crate::vstate::vm::{Vm, VmError};

/// Default command line for Linux guests: console on COM1, reboot through
/// the i8042 so the VMM sees it, no reboot loop on panic.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 pci=off nomodules";

/// The MP table numbers CPUs with 8-bit APIC ids, one id kept for the IOAPIC.
pub const MAX_VCPUS: usize = 254;

/// Where the guest console goes (the contract's `Console`: a file is
/// capped at `max_bytes`).
pub use torpor_vmm_api::Console as SerialOutput;

/// Everything needed to boot a microVM.
#[derive(Debug, Clone)]
pub struct VmConfig {
    pub kernel: KernelImage,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub mem_mib: u64,
    pub vcpus: u16,
    pub serial: SerialOutput,
    pub virtio: crate::virtio_devices::VirtioConfig,
    /// Where diff snapshots take their dirty pages from.
    pub dirty_tracking: DirtyTracking,
}

/// Errors while building a microVM, before any guest code runs.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Kvm(#[from] KvmError),
    #[error("at least one vCPU is needed")]
    NoVcpus,
    #[error("{requested} vCPUs requested but at most {max} are possible here (KVM allows {kvm_max}, the MP table {MAX_VCPUS})")]
    TooManyVcpus {
        requested: u16,
        max: usize,
        kvm_max: usize,
    },
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Boot(#[from] BootError),
    #[error(transparent)]
    Regs(#[from] RegsError),
    #[error(transparent)]
    Mptable(#[from] MptableError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("cannot open serial output {path}: {source}")]
    SerialOutput {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    #[error(transparent)]
    State(#[from] crate::vm_state::StateError),
    #[error(transparent)]
    Identity(#[from] crate::identity::IdentityError),
    #[error(transparent)]
    Virtio(#[from] crate::virtio_devices::VirtioDevicesError),
    #[error(transparent)]
    Dirty(#[from] DirtyError),
}

impl BuildError {
    /// Classified for the pod: bad input (sizes, kernel, files) is the
    /// request's fault; a host without what KVM needs cannot do it.
    pub fn vm_error(&self) -> torpor_vmm_api::VmError {
        use torpor_vmm_api::{ErrorKind, VmError};
        let kind = match self {
            BuildError::NoVcpus
            | BuildError::TooManyVcpus { .. }
            | BuildError::Memory(_)
            | BuildError::Boot(_) => ErrorKind::InvalidRequest,
            BuildError::SerialOutput { source, .. } => ErrorKind::of_io(source),
            BuildError::Kvm(_) | BuildError::Dirty(_) => ErrorKind::Unsupported,
            BuildError::State(_) => ErrorKind::BadSnapshot,
            _ => ErrorKind::Internal,
        };
        VmError::new(kind, self.to_string())
    }
}

/// Microseconds spent in each start-up phase, in order.
#[derive(Debug, Default, Clone)]
pub struct Timings {
    phases: Vec<(&'static str, u64)>,
    clock: Option<Instant>,
}

impl Timings {
    /// Starts timing; the first phase runs from now.
    pub fn start() -> Self {
        Self {
            phases: Vec::new(),
            clock: Some(Instant::now()),
        }
    }

    /// Ends phase `name` and starts the next one.
    pub fn phase(&mut self, name: &'static str) {
        let now = Instant::now();
        let since = self.clock.replace(now).unwrap_or(now);
        self.phases
            .push((name, now.duration_since(since).as_micros() as u64));
    }

    pub fn phases(&self) -> &[(&'static str, u64)] {
        &self.phases
    }
}

impl serde::Serialize for Timings {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.phases.iter().map(|(k, v)| (format!("{k}_us"), v)))
    }
}

/// A built microVM whose vCPUs are ready to start.
#[derive(Debug)]
pub struct BuiltVm {
    pub vm: Vm,
    pub mem: vm_memory::GuestMemoryMmap,
    pub vcpus: Vec<Vcpu>,
    pub bus: Arc<PioBus>,
    pub serial: Arc<Mutex<SerialDevice>>,
    pub timings: Timings,
    pub machine: MachineConfig,
    /// 0 for a cold boot; the snapshot's generation + 1 for a restore.
    pub generation: u64,
    /// The snapshot this VM was restored from, base of its next diff.
    /// The chain of the snapshot this VM runs from, base first (None for a
    /// cold boot): a diff snapshot's parent and lineage.
    pub base_chain: Option<Vec<PathBuf>>,
    /// Pages the VMM wrote that KVM's dirty log does not see.
    pub vmm_dirty: PageRuns,
    pub backend: &'static str,
    /// Whatever must outlive the vCPUs (a userfaultfd page server).
    pub keepalive: Option<Box<dyn std::any::Any + Send>>,
    /// The pages a uffd backend's page server installed, which a snapshot
    /// records as its working set (None for a boot and the `file`
    /// backend, which install no page themselves).
    pub installed_pages: Option<crate::uffd::InstalledPages>,
    pub msr_indices: Vec<u32>,
    pub virtio: crate::virtio_devices::VirtioDevices,
    pub dirty_tracking: DirtyTracking,
    /// Reads uffd-wp dirty pages (`dirty_tracking.uffd_wp()`).
    pub wp_tracker: Option<WpTracker>,
}

/// Checks what can be checked without touching KVM or the disk.
pub fn validate(config: &VmConfig) -> Result<(), BuildError> {
    if config.vcpus == 0 {
        return Err(BuildError::NoVcpus);
    }
    validate_mem_size(config.mem_mib)?;
    boot::parse_cmdline(&config.cmdline)?;
    Ok(())
}

/// Opens KVM and checks the vCPU count against what it and the MP table allow.
pub fn open_kvm(vcpus: u16) -> Result<(KvmContext, u8), BuildError> {
    if vcpus == 0 {
        return Err(BuildError::NoVcpus);
    }
    let kvm = KvmContext::open()?;
    let max = kvm.max_vcpus.min(MAX_VCPUS);
    let count = u8::try_from(vcpus)
        .ok()
        .filter(|n| usize::from(*n) <= max)
        .ok_or(BuildError::TooManyVcpus {
            requested: vcpus,
            max,
            kvm_max: kvm.max_vcpus,
        })?;
    Ok((kvm, count))
}

/// Builds the VM in boot order.
pub fn build(
    config: &VmConfig,
    backend: &dyn MemoryBackend,
    exit: &ExitSignal,
) -> Result<BuiltVm, BuildError> {
    let mut t = Timings::start();
    validate(config)?;
    let (kvm, vcpu_count) = open_kvm(config.vcpus)?;
    let supported_cpuid = kvm.supported_cpuid()?;
    let msr_indices = vm_state::saveable_msrs(&kvm.kvm)?;
    t.phase("kvm_open");

    let vm = Vm::create(&kvm)?;
    t.phase("vm_create");

    let mem_bytes = validate_mem_size(config.mem_mib)?;
    let mem = backend.map(&ram_ranges(mem_bytes))?;
    vm.register_memory(&mem, config.dirty_tracking.kvm_log())?;
    let wp_tracker = if config.dirty_tracking.uffd_wp() {
        // SAFETY: `mem` is this VM's fresh guest RAM; it lives in the
        // BuiltVm as long as the tracker does.
        Some(unsafe { WpTracker::start(crate::dirty::guest_spans(&mem)) }?)
    } else {
        None
    };
    t.phase("memory");
    vm.create_irqchip()?;
    t.phase("irqchip");

    let (virtio, devices_cmdline) = VirtioDevices::build(&vm, &mem, &config.virtio)?;
    let cmdline = boot::parse_cmdline(&format!("{}{devices_cmdline}", config.cmdline))?;
    let boot_info = boot::load(&mem, &config.kernel, config.initrd.as_deref(), &cmdline)?;
    regs::write_boot_tables(&mem)?;
    mptable::write(&mem, EBDA_START, vcpu_count)?;
    identity::write(&mem, 0)?;
    t.phase("load");

    let serial = Arc::new(Mutex::new(SerialDevice::new(
        serial_irq(&vm)?,
        serial_output(&config.serial)?,
    )));
    let bus = Arc::new(build_bus(serial.clone(), exit)?);
    t.phase("devices");

    let mut vcpus = Vec::with_capacity(config.vcpus.into());
    for index in 0..vcpu_count {
        vcpus.push(Vcpu::create(&vm, index, vcpu_count, &supported_cpuid)?);
    }
    regs::setup_boot_vcpu(&vcpus[0].fd, boot_info.entry)?;
    t.phase("vcpu_setup");

    Ok(BuiltVm {
        vm,
        mem,
        vcpus,
        bus,
        serial,
        timings: t,
        machine: MachineConfig {
            mem_mib: config.mem_mib,
            vcpus: config.vcpus,
            kernel: config.kernel.to_string(),
        },
        generation: 0,
        base_chain: None,
        vmm_dirty: PageRuns::default(),
        backend: backend.name(),
        keepalive: None,
        installed_pages: None,
        msr_indices,
        virtio,
        dirty_tracking: config.dirty_tracking,
        wp_tracker,
    })
}

/// Opens the console sink.
pub fn serial_output(serial: &SerialOutput) -> Result<Box<dyn Write + Send>, BuildError> {
    Ok(match serial {
        SerialOutput::Stdout => Box::new(std::io::stdout()),
        SerialOutput::Discard => Box::new(std::io::sink()),
        SerialOutput::File { path, max_bytes } => {
            let f = File::create(path).map_err(|source| BuildError::SerialOutput {
                path: path.clone(),
                source,
            })?;
            Box::new(Capped::new(LineWriter::new(f), *max_bytes))
        }
    })
}

/// Like [`serial_output`], but a console file is created on a helper
/// thread: creating (truncating) a file on a busy ext4 took ~0.25 ms of a
/// ~0.7 ms standby restore, and the guest prints only after it runs. Its
/// first write waits for the open. The directory is checked here, so the
/// usual mistake (a missing directory) still fails the restore up front.
///
/// A standby shell's `opener` thread, made ahead, opens it when given: no
/// thread is spawned (nor seccomp filter installed) on the restore path.
pub fn serial_output_deferred(
    serial: &SerialOutput,
    opener: Option<ConsoleOpener>,
) -> Result<Box<dyn Write + Send>, BuildError> {
    let SerialOutput::File { path, max_bytes } = serial else {
        return serial_output(serial);
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    if !dir.is_dir() {
        return Err(BuildError::SerialOutput {
            path: path.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no directory {}", dir.display()),
            ),
        });
    }
    let handed = match opener {
        Some(o) => o.path.send(path.clone()).ok().map(|()| o.opened),
        None => None,
    };
    let pending = match handed {
        Some(opened) => opened,
        None => {
            let open_path = path.clone();
            std::thread::Builder::new()
                .name("console-open".into())
                .spawn(move || {
                    crate::seccomp::enter(crate::seccomp::ThreadKind::ConsoleOpen);
                    File::create(open_path)
                })
                .map_err(|source| BuildError::SerialOutput {
                    path: path.clone(),
                    source,
                })?
        }
    };
    Ok(Box::new(Capped::new(
        DeferredFile {
            path: path.clone(),
            pending: Some(pending),
            file: None,
        },
        *max_bytes,
    )))
}

/// A console-open thread made ahead (by a standby shell), under its
/// seccomp filter, waiting for the path of the file to create.
#[derive(Debug)]
pub struct ConsoleOpener {
    path: std::sync::mpsc::Sender<PathBuf>,
    opened: std::thread::JoinHandle<std::io::Result<File>>,
}

impl ConsoleOpener {
    pub fn spawn() -> std::io::Result<Self> {
        let (path, wait) = std::sync::mpsc::channel::<PathBuf>();
        let opened = std::thread::Builder::new()
            .name("console-open".into())
            .spawn(move || {
                crate::seccomp::enter(crate::seccomp::ThreadKind::ConsoleOpen);
                let path = wait
                    .recv()
                    .map_err(|_| std::io::Error::other("no console file to open"))?;
                File::create(path)
            })?;
        Ok(Self { path, opened })
    }
}

/// Bytes the guest wrote to consoles past their limit, in this process.
static CONSOLE_DROPPED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Console bytes dropped at the limit so far (reported in the VM status).
pub fn console_dropped_bytes() -> u64 {
    CONSOLE_DROPPED.load(std::sync::atomic::Ordering::Relaxed)
}

/// A console sink that takes `limit` bytes, then one notice line, then
/// drops (and counts) the rest: the guest never blocks on its console and
/// never fills the host's disk through it.
struct Capped<W> {
    inner: W,
    left: u64,
    noticed: bool,
}

impl<W: Write> Capped<W> {
    fn new(inner: W, limit: u64) -> Self {
        Self {
            inner,
            left: limit,
            noticed: false,
        }
    }
}

impl<W: Write> Write for Capped<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let take = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        if take > 0 {
            let n = self.inner.write(&buf[..take])?;
            self.left -= n as u64;
            return Ok(n);
        }
        if !self.noticed {
            self.noticed = true;
            let _ = self
                .inner
                .write_all(b"\n[torpor: console limit reached; further output dropped]\n");
            let _ = self.inner.flush();
        }
        CONSOLE_DROPPED.fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A console file being created on another thread.
struct DeferredFile {
    path: PathBuf,
    pending: Option<std::thread::JoinHandle<std::io::Result<File>>>,
    file: Option<LineWriter<File>>,
}

impl DeferredFile {
    fn target(&mut self) -> std::io::Result<&mut LineWriter<File>> {
        if let Some(pending) = self.pending.take() {
            let opened = pending
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the console-open thread panicked")));
            match opened {
                Ok(f) => self.file = Some(LineWriter::new(f)),
                Err(e) => tracing::error!("cannot open serial output {}: {e}", self.path.display()),
            }
        }
        self.file.as_mut().ok_or_else(|| {
            std::io::Error::other(format!("serial output {} is not open", self.path.display()))
        })
    }
}

impl Write for DeferredFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.target()?.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.target()?.flush()
    }
}

/// The serial interrupt line: an eventfd KVM turns into GSI 4.
pub fn serial_irq(vm: &Vm) -> Result<EventFd, BuildError> {
    let irq = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(BuildError::EventFd)?;
    vm.register_irqfd(&irq, COM1_IRQ)?;
    Ok(irq)
}

/// The port-I/O bus with COM1 and the i8042.
pub fn build_bus(
    serial: Arc<Mutex<SerialDevice>>,
    exit: &ExitSignal,
) -> Result<PioBus, BuildError> {
    let mut bus = PioBus::default();
    bus.insert(COM1_BASE, COM1_PORTS, serial)?;
    bus.insert(
        I8042_DATA_PORT,
        5,
        Arc::new(Mutex::new(I8042::new(exit.clone()))),
    )?;
    Ok(bus)
}

/// The console-open helper thread: one write-only open (it creates, or
/// truncates, the console file off the restore path).
pub(crate) fn console_open_syscalls(
    r: &mut crate::seccomp::Rules,
) -> Result<(), crate::seccomp::SeccompError> {
    r.allow_if(
        libc::SYS_openat,
        &[crate::seccomp::Arg::Masked(
            2,
            libc::O_ACCMODE as u64,
            libc::O_WRONLY as u64,
        )],
    )?;
    Ok(())
}

#[cfg(test)]
mod console_tests {
    use super::*;

    #[test]
    fn deferred_console_file_gets_every_line() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let path = dir.join("console.log");
        std::fs::write(&path, "stale content from an earlier run\n").unwrap();
        let mut out = serial_output_deferred(&SerialOutput::file(path.clone()), None).unwrap();
        out.write_all(b"first line\nsecond ").unwrap();
        out.write_all(b"line\n").unwrap();
        out.flush().unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "first line\nsecond line\n"
        );
    }

    #[test]
    fn console_files_stop_at_their_limit() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let path = dir.join("console.log");
        let before = console_dropped_bytes();
        let console = SerialOutput::File {
            path: path.clone(),
            max_bytes: 10,
        };
        let mut out = serial_output(&console).unwrap();
        for _ in 0..100 {
            out.write_all(b"0123456789abcdef\n").unwrap();
        }
        out.flush().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with("0123456789\n[torpor: console limit"),
            "{text}"
        );
        assert!(text.len() < 80, "{} bytes", text.len());
        assert!(console_dropped_bytes() - before >= 100 * 17 - 10);
    }

    #[test]
    fn deferred_console_in_a_missing_directory_is_refused_up_front() {
        let path = PathBuf::from("/nonexistent-torpor-dir/console.log");
        let err = match serial_output_deferred(&SerialOutput::file(path), None) {
            Err(e) => e,
            Ok(_) => panic!("a console in a missing directory was accepted"),
        };
        assert!(err.to_string().contains("/nonexistent-torpor-dir"), "{err}");
    }
}
