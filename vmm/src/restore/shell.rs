//! The VM shell a restore fills: a KVM VM with its vCPUs and memory slots
//! created and registered over placeholder memory.

use kvm_ioctls::{Cap, VcpuFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::builder::{self, BuildError, Timings};
use crate::dirty::DirtyTracking;
use crate::vm_state;
use crate::vstate::kvm::KvmContext;
use crate::vstate::memory::{ram_ranges, validate_mem_size, AnonymousBackend, MemoryBackend};
use crate::vstate::vm::Vm;

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
    let msr_indices = vm_state::saveable_msrs(&kvm.kvm)?;
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
