//! Saved microVM state: plain serde structs for the vCPUs, the VM's
//! in-kernel devices, emulated devices and memory, and the KVM calls that
//! save and restore them. Devices save themselves through
//! [`crate::snapshot::Persist`]; the encoding on disk is the snapshot
//! module's business.

use std::path::PathBuf;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    CpuId, Msrs, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

use crate::devices::serial::SerialPersistState;
use crate::snapshot::PageRuns;

/// Errors while saving or restoring KVM state.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("{what} failed: {source}")]
    Ioctl {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("saved state has {0} CPUID entries, more than KVM accepts")]
    TooManyCpuidEntries(usize),
    #[error("saved state has {0} MSRs, more than KVM accepts")]
    TooManyMsrs(usize),
    #[error("KVM's XSAVE area is {0} bytes; this VMM saves at most 4096")]
    XsaveTooLarge(i32),
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> StateError {
    move |source| StateError::Ioctl { what, source }
}

/// Everything one vCPU needs to continue exactly where it stopped.
#[derive(Serialize, Deserialize, Debug)]
pub struct VcpuState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub msrs: Vec<kvm_msr_entry>,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub lapic: kvm_lapic_state,
    pub mp_state: kvm_mp_state,
    pub vcpu_events: kvm_vcpu_events,
    pub debug_regs: kvm_debugregs,
    pub tsc_khz: Option<u32>,
}

/// The VM-wide in-kernel devices.
#[derive(Clone, Serialize, Deserialize, Debug)]
pub struct VmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

/// Emulated devices.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DeviceStates {
    pub serial: SerialPersistState,
    pub virtio: crate::virtio_devices::VirtioStates,
}

/// Where guest memory comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemoryLayer {
    /// The `memory` file holds every page (zero pages as holes).
    Full,
    /// The `memory` file holds only `pages`; the rest come from `parent`
    /// (a snapshot directory, resolved relative to this one if relative).
    Diff { parent: PathBuf, pages: PageRuns },
}

/// The machine's shape, fixed for its lifetime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineConfig {
    pub mem_mib: u64,
    pub vcpus: u16,
    pub kernel: String,
}

/// A whole microVM at one instant, as written into a snapshot's `state`.
#[derive(Serialize, Deserialize, Debug)]
pub struct MicrovmState {
    pub machine: MachineConfig,
    pub memory: MemoryLayer,
    pub vcpus: Vec<VcpuState>,
    pub vm: VmState,
    pub devices: DeviceStates,
    /// Restore generation of the snapshotted VM (0 for a cold boot).
    pub generation: u64,
    /// Host wall clock when the snapshot was taken, ns since the epoch.
    pub taken_unix_ns: u64,
}

/// MSRs to save: every index KVM reports it can save, read per vCPU.
pub fn saveable_msrs(kvm: &kvm_ioctls::Kvm) -> Result<Vec<u32>, StateError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(ioctl("KVM_GET_MSR_INDEX_LIST"))?;
    Ok(list.as_slice().to_vec())
}

/// Reads MSRs one batch at a time; KVM stops a batch at the first MSR it
/// cannot read, so that one is skipped and the rest retried.
fn read_msrs(vcpu: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, StateError> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let entries: Vec<kvm_msr_entry> = rest
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs =
            Msrs::from_entries(&entries).map_err(|_| StateError::TooManyMsrs(entries.len()))?;
        let read = vcpu.get_msrs(&mut msrs).map_err(ioctl("KVM_GET_MSRS"))?;
        out.extend_from_slice(&msrs.as_slice()[..read]);
        rest = &rest[(read + 1).min(rest.len())..];
    }
    Ok(out)
}

/// Saves one vCPU. The vCPU must be outside KVM_RUN. The multiprocessing
/// state first: reading it makes KVM accept pending APIC events (INIT,
/// SIPI), which may change the registers saved next; the events last,
/// after every other read that may move state into them.
pub fn save_vcpu(vcpu: &VcpuFd, msr_indices: &[u32]) -> Result<VcpuState, StateError> {
    let mp_state = vcpu.get_mp_state().map_err(ioctl("KVM_GET_MP_STATE"))?;
    Ok(VcpuState {
        cpuid: vcpu
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl("KVM_GET_CPUID2"))?
            .as_slice()
            .to_vec(),
        msrs: read_msrs(vcpu, msr_indices)?,
        regs: vcpu.get_regs().map_err(ioctl("KVM_GET_REGS"))?,
        sregs: vcpu.get_sregs().map_err(ioctl("KVM_GET_SREGS"))?,
        xsave: vcpu.get_xsave().map_err(ioctl("KVM_GET_XSAVE"))?,
        xcrs: vcpu.get_xcrs().map_err(ioctl("KVM_GET_XCRS"))?,
        lapic: vcpu.get_lapic().map_err(ioctl("KVM_GET_LAPIC"))?,
        mp_state,
        debug_regs: vcpu.get_debug_regs().map_err(ioctl("KVM_GET_DEBUGREGS"))?,
        tsc_khz: vcpu.get_tsc_khz().ok(),
        vcpu_events: vcpu
            .get_vcpu_events()
            .map_err(ioctl("KVM_GET_VCPU_EVENTS"))?,
    })
}

/// Restores one freshly created vCPU, in the order KVM needs: CPUID before
/// MSRs, sregs (APIC base) before the LAPIC, events last.
pub fn restore_vcpu(vcpu: &VcpuFd, state: &VcpuState, xsave_size: i32) -> Result<(), StateError> {
    if let Some(khz) = state.tsc_khz {
        // Hosts without TSC scaling refuse a different frequency; the guest
        // then sees the host's, which is what it saw before on this host.
        if let Err(e) = vcpu.set_tsc_khz(khz) {
            tracing::debug!("KVM_SET_TSC_KHZ({khz}) refused: {e}");
        }
    }
    let cpuid = CpuId::from_entries(&state.cpuid)
        .map_err(|_| StateError::TooManyCpuidEntries(state.cpuid.len()))?;
    vcpu.set_cpuid2(&cpuid).map_err(ioctl("KVM_SET_CPUID2"))?;
    vcpu.set_mp_state(state.mp_state)
        .map_err(ioctl("KVM_SET_MP_STATE"))?;
    vcpu.set_regs(&state.regs).map_err(ioctl("KVM_SET_REGS"))?;
    vcpu.set_sregs(&state.sregs)
        .map_err(ioctl("KVM_SET_SREGS"))?;
    if xsave_size > std::mem::size_of::<kvm_xsave>() as i32 {
        return Err(StateError::XsaveTooLarge(xsave_size));
    }
    // SAFETY: KVM reads at most `xsave_size` bytes, checked above to fit the
    // 4096-byte `kvm_xsave` we pass.
    unsafe { vcpu.set_xsave(&state.xsave) }.map_err(ioctl("KVM_SET_XSAVE"))?;
    vcpu.set_xcrs(&state.xcrs).map_err(ioctl("KVM_SET_XCRS"))?;
    vcpu.set_debug_regs(&state.debug_regs)
        .map_err(ioctl("KVM_SET_DEBUGREGS"))?;
    vcpu.set_lapic(&state.lapic)
        .map_err(ioctl("KVM_SET_LAPIC"))?;
    write_msrs(vcpu, &state.msrs)?;
    vcpu.set_vcpu_events(&state.vcpu_events)
        .map_err(ioctl("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

/// Writes MSRs, skipping (and logging) any this host refuses.
fn write_msrs(vcpu: &VcpuFd, entries: &[kvm_msr_entry]) -> Result<(), StateError> {
    let mut rest = entries;
    while !rest.is_empty() {
        let msrs = Msrs::from_entries(rest).map_err(|_| StateError::TooManyMsrs(rest.len()))?;
        let written = vcpu.set_msrs(&msrs).map_err(ioctl("KVM_SET_MSRS"))?;
        if written < rest.len() {
            tracing::debug!(
                msr = format!("{:#x}", rest[written].index),
                "MSR not restorable here"
            );
        }
        rest = &rest[(written + 1).min(rest.len())..];
    }
    Ok(())
}

pub(crate) fn get_irqchip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip, StateError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(ioctl("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

/// Saves the in-kernel PIC, IOAPIC, PIT and clock.
pub fn save_vm(vm: &VmFd) -> Result<VmState, StateError> {
    Ok(VmState {
        pic_master: get_irqchip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: get_irqchip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: get_irqchip(vm, KVM_IRQCHIP_IOAPIC)?,
        pit: vm.get_pit2().map_err(ioctl("KVM_GET_PIT2"))?,
        clock: vm.get_clock().map_err(ioctl("KVM_GET_CLOCK"))?,
    })
}

/// Restores VM-wide state. The clock is set to the saved value, so guest
/// time continues from the snapshot and never runs backwards.
pub fn restore_vm(vm: &VmFd, state: &VmState) -> Result<(), StateError> {
    vm.set_irqchip(&state.pic_master)
        .map_err(ioctl("KVM_SET_IRQCHIP(PIC master)"))?;
    vm.set_irqchip(&state.pic_slave)
        .map_err(ioctl("KVM_SET_IRQCHIP(PIC slave)"))?;
    vm.set_irqchip(&state.ioapic)
        .map_err(ioctl("KVM_SET_IRQCHIP(IOAPIC)"))?;
    vm.set_pit2(&state.pit).map_err(ioctl("KVM_SET_PIT2"))?;
    let clock = kvm_clock_data {
        clock: state.clock.clock,
        // Only the value: flags from the source host (e.g. KVM_CLOCK_TSC_STABLE)
        // are outputs of GET_CLOCK, not inputs.
        ..Default::default()
    };
    vm.set_clock(&clock).map_err(ioctl("KVM_SET_CLOCK"))?;
    Ok(())
}

/// Current guest clock (kvmclock) in ns.
pub fn guest_clock_ns(vm: &VmFd) -> Result<u64, StateError> {
    Ok(vm.get_clock().map_err(ioctl("KVM_GET_CLOCK"))?.clock)
}

/// Reading the VM-wide KVM state for a snapshot (irqchips, PIT, clock).
pub(crate) fn read_syscalls(
    r: &mut crate::seccomp::Rules,
) -> Result<(), crate::seccomp::SeccompError> {
    r.allow_values(libc::SYS_ioctl, 1, &crate::seccomp::ioctls::vm_read())?;
    Ok(())
}
