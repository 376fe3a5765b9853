//! ioctl request numbers the filters allow, from the kernel's uapi headers
//! (kvm-ioctls keeps its own private). x86_64: `c_ulong` is `u64`.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_dirty_log, kvm_irqchip, kvm_lapic_state,
    kvm_mp_state, kvm_msrs, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave, KVMIO,
};
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

use crate::uffd_abi as abi;

ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);
ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
ioctl_ior_nr!(KVM_GET_XSAVE2, KVMIO, 0xcf, kvm_xsave);

ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_clock_data);
ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_irqchip);
ioctl_ior_nr!(KVM_GET_PIT2, KVMIO, 0x9f, kvm_pit_state2);

/// vCPU state a snapshot reads on each (parked) vCPU's own thread.
pub fn vcpu_save() -> Vec<u64> {
    vec![
        KVM_GET_REGS(),
        KVM_GET_SREGS(),
        KVM_GET_MSRS(),
        KVM_GET_LAPIC(),
        KVM_GET_CPUID2(),
        KVM_GET_MP_STATE(),
        KVM_GET_VCPU_EVENTS(),
        KVM_GET_DEBUGREGS(),
        KVM_GET_TSC_KHZ(),
        KVM_GET_XSAVE(),
        KVM_GET_XSAVE2(),
        KVM_GET_XCRS(),
    ]
}

/// VM-wide state the control thread reads: status, snapshots, dirty logs.
pub fn vm_read() -> Vec<u64> {
    vec![
        KVM_GET_CLOCK(),
        KVM_GET_DIRTY_LOG(),
        KVM_GET_IRQCHIP(),
        KVM_GET_PIT2(),
    ]
}

/// The guest clock, in every VM status.
pub fn kvm_get_clock() -> u64 {
    KVM_GET_CLOCK()
}

/// The vCPU's run call.
pub fn kvm_run() -> u64 {
    KVM_RUN()
}

/// userfaultfd: filling missing pages (copy, zero), mapping shmem pages
/// (continue), waking faulting threads, write-protection.
pub fn uffd_serve() -> Vec<u64> {
    vec![
        abi::UFFDIO_COPY.into(),
        abi::UFFDIO_ZEROPAGE.into(),
        abi::UFFDIO_CONTINUE.into(),
        abi::UFFDIO_WAKE.into(),
        abi::UFFDIO_WRITEPROTECT.into(),
    ]
}

/// Reading (and re-arming) uffd-wp dirty pages: `PAGEMAP_SCAN` on
/// /proc/self/pagemap, and `UFFDIO_WRITEPROTECT`.
pub fn dirty_scan() -> Vec<u64> {
    vec![abi::PAGEMAP_SCAN, abi::UFFDIO_WRITEPROTECT.into()]
}

/// `TUNSETOFFLOAD` on the tap (virtio-net's negotiated offloads).
pub fn tun_set_offload() -> u64 {
    libc::TUNSETOFFLOAD
}

/// `FIONBIO`: `set_nonblocking` on sockets.
pub fn fionbio() -> u64 {
    libc::FIONBIO
}
