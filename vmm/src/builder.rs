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
use crate::exit::ExitSignal;
use crate::layout::EBDA_START;
use crate::mptable::{self, MptableError};
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

/// Where the guest console goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialOutput {
    Stdout,
    File(PathBuf),
    Discard,
}

/// Everything needed to boot a microVM.
#[derive(Debug, Clone)]
pub struct VmConfig {
    pub kernel: KernelImage,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub mem_mib: u64,
    pub vcpus: u16,
    pub serial: SerialOutput,
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
}

/// Microseconds spent in each build phase.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct BuildTimings {
    pub kvm_open_us: u64,
    pub vm_create_us: u64,
    pub memory_us: u64,
    pub load_us: u64,
    pub devices_us: u64,
    pub vcpu_setup_us: u64,
}

/// A built microVM whose vCPUs are ready to start.
pub struct BuiltVm {
    pub vm: Vm,
    pub mem: vm_memory::GuestMemoryMmap,
    pub vcpus: Vec<Vcpu>,
    pub bus: Arc<PioBus>,
    pub timings: BuildTimings,
}

fn elapsed_us(since: &mut Instant) -> u64 {
    let now = Instant::now();
    let us = now.duration_since(*since).as_micros() as u64;
    *since = now;
    us
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

/// Builds the VM in boot order.
pub fn build(
    config: &VmConfig,
    backend: &dyn MemoryBackend,
    exit: &ExitSignal,
) -> Result<BuiltVm, BuildError> {
    let mut t = BuildTimings::default();
    let mut clock = Instant::now();
    validate(config)?;
    let kvm = KvmContext::open()?;
    let max = kvm.max_vcpus.min(MAX_VCPUS);
    let vcpu_count = u8::try_from(config.vcpus)
        .ok()
        .filter(|n| usize::from(*n) <= max)
        .ok_or(BuildError::TooManyVcpus {
            requested: config.vcpus,
            max,
            kvm_max: kvm.max_vcpus,
        })?;
    let supported_cpuid = kvm.supported_cpuid()?;
    t.kvm_open_us = elapsed_us(&mut clock);

    let vm = Vm::create(&kvm)?;
    t.vm_create_us = elapsed_us(&mut clock);

    let mem_bytes = validate_mem_size(config.mem_mib)?;
    let mem = backend.map(&ram_ranges(mem_bytes))?;
    vm.register_memory(&mem)?;
    t.memory_us = elapsed_us(&mut clock);

    let cmdline = boot::parse_cmdline(&config.cmdline)?;
    let boot_info = boot::load(&mem, &config.kernel, config.initrd.as_deref(), &cmdline)?;
    regs::write_boot_tables(&mem)?;
    mptable::write(&mem, EBDA_START, vcpu_count)?;
    t.load_us = elapsed_us(&mut clock);

    let bus = Arc::new(build_devices(&vm, config, exit)?);
    t.devices_us = elapsed_us(&mut clock);

    let mut vcpus = Vec::with_capacity(config.vcpus.into());
    for index in 0..vcpu_count {
        vcpus.push(Vcpu::create(&vm, index, vcpu_count, &supported_cpuid)?);
    }
    regs::setup_boot_vcpu(&vcpus[0].fd, boot_info.entry)?;
    t.vcpu_setup_us = elapsed_us(&mut clock);

    Ok(BuiltVm {
        vm,
        mem,
        vcpus,
        bus,
        timings: t,
    })
}

fn build_devices(vm: &Vm, config: &VmConfig, exit: &ExitSignal) -> Result<PioBus, BuildError> {
    let out: Box<dyn Write + Send> = match &config.serial {
        SerialOutput::Stdout => Box::new(std::io::stdout()),
        SerialOutput::Discard => Box::new(std::io::sink()),
        SerialOutput::File(path) => {
            let f = File::create(path).map_err(|source| BuildError::SerialOutput {
                path: path.clone(),
                source,
            })?;
            Box::new(LineWriter::new(f))
        }
    };
    let irq = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(BuildError::EventFd)?;
    vm.register_irqfd(&irq, COM1_IRQ)?;
    let mut bus = PioBus::default();
    bus.insert(
        COM1_BASE,
        COM1_PORTS,
        Arc::new(Mutex::new(SerialDevice::new(irq, out))),
    )?;
    bus.insert(
        I8042_DATA_PORT,
        5,
        Arc::new(Mutex::new(I8042::new(exit.clone()))),
    )?;
    Ok(bus)
}
