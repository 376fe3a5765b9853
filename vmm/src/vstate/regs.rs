//! Initial vCPU state for the Linux 64-bit boot protocol: a flat GDT, an
//! identity page table, long mode, boot MSRs, FPU defaults and the LAPIC's
//! legacy interrupt wiring.

use kvm_bindings::{
    kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs,
};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::{
    BOOT_GDT, BOOT_IDT, BOOT_STACK_POINTER, PDE_START, PDPTE_START, PML4_START, ZERO_PAGE,
};

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// Selectors Linux's boot protocol expects (`__BOOT_CS`, `__BOOT_DS`).
const BOOT_CS_INDEX: usize = 2;
const BOOT_DS_INDEX: usize = 3;
const BOOT_TSS_INDEX: usize = 4;

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default memory type write-back.
const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

const APIC_LVT_LINT0: usize = 0x350;
const APIC_LVT_LINT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// Errors while setting a vCPU's initial state.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("cannot write boot structures to guest memory: {0}")]
    GuestMemory(#[from] vm_memory::GuestMemoryError),
    #[error("{what} failed: {source}")]
    Ioctl {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM accepted {set} of {wanted} boot MSRs")]
    Msrs { set: usize, wanted: usize },
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> RegsError {
    move |source| RegsError::Ioctl { what, source }
}

/// Packs a segment descriptor: `flags` holds the access byte in bits 0-7 and
/// the G/DB/L/AVL nibble in bits 12-15.
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
}

/// Expands a descriptor into the form KVM wants for a segment register.
fn segment_from_gdt(entry: u64, index: usize) -> kvm_segment {
    let base = ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000);
    let raw_limit = (entry & 0xffff) | ((entry >> 32) & 0x000f_0000);
    let granular = (entry >> 55) & 1;
    let limit = if granular == 1 {
        (raw_limit << 12) | 0xfff
    } else {
        raw_limit
    };
    kvm_segment {
        base,
        limit: limit as u32,
        selector: (index * 8) as u16,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: granular as u8,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: u8::from((entry >> 47) & 1 == 0),
    }
}

fn boot_gdt() -> [u64; 5] {
    [
        0,
        0,
        gdt_entry(0xa09b, 0, 0xfffff), // 64-bit code
        gdt_entry(0xc093, 0, 0xfffff), // data
        gdt_entry(0x808b, 0, 0xfffff), // TSS (unused, but KVM wants a valid TR)
    ]
}

/// Writes the GDT, an empty IDT and a 1 GiB identity map into guest memory.
/// Shared by all vCPUs; call once.
pub fn write_boot_tables(mem: &GuestMemoryMmap) -> Result<(), RegsError> {
    for (i, entry) in boot_gdt().iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(BOOT_GDT + i as u64 * 8))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT))?;
    mem.write_obj(PDPTE_START | 0x03, GuestAddress(PML4_START))?;
    mem.write_obj(PDE_START | 0x03, GuestAddress(PDPTE_START))?;
    for i in 0..512u64 {
        // Present, writable, 2 MiB page.
        mem.write_obj((i << 21) | 0x83, GuestAddress(PDE_START + i * 8))?;
    }
    Ok(())
}

/// Puts the boot vCPU in 64-bit mode at `entry` with RSI at the zero page.
pub fn setup_boot_vcpu(vcpu: &VcpuFd, entry: GuestAddress) -> Result<(), RegsError> {
    let mut sregs = vcpu.get_sregs().map_err(ioctl("KVM_GET_SREGS"))?;
    long_mode_sregs(&mut sregs);
    vcpu.set_sregs(&sregs).map_err(ioctl("KVM_SET_SREGS"))?;
    let regs = kvm_regs {
        rflags: 0x2,
        rip: entry.0,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(ioctl("KVM_SET_REGS"))
}

fn long_mode_sregs(sregs: &mut kvm_sregs) {
    let gdt = boot_gdt();
    let code = segment_from_gdt(gdt[BOOT_CS_INDEX], BOOT_CS_INDEX);
    let data = segment_from_gdt(gdt[BOOT_DS_INDEX], BOOT_DS_INDEX);
    let tss = segment_from_gdt(gdt[BOOT_TSS_INDEX], BOOT_TSS_INDEX);
    sregs.gdt.base = BOOT_GDT;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = BOOT_IDT;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
    sregs.efer |= EFER_LME | EFER_LMA;
}

/// Sets the MSRs every vCPU starts with.
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let entries: Vec<kvm_msr_entry> = [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
    .iter()
    .map(|&(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    })
    .collect();
    let msrs = Msrs::from_entries(&entries).expect("boot MSR list fits a KVM MSR array");
    let set = vcpu.set_msrs(&msrs).map_err(ioctl("KVM_SET_MSRS"))?;
    if set != entries.len() {
        return Err(RegsError::Msrs {
            set,
            wanted: entries.len(),
        });
    }
    Ok(())
}

/// x87 control word and MXCSR at their architectural reset values.
pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(ioctl("KVM_SET_FPU"))
}

/// Routes the legacy PIC to LINT0 (ExtINT) and NMIs to LINT1, as a PC does.
pub fn setup_lapic(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let mut lapic = vcpu.get_lapic().map_err(ioctl("KVM_GET_LAPIC"))?;
    set_lvt_mode(&mut lapic, APIC_LVT_LINT0, APIC_MODE_EXTINT);
    set_lvt_mode(&mut lapic, APIC_LVT_LINT1, APIC_MODE_NMI);
    vcpu.set_lapic(&lapic).map_err(ioctl("KVM_SET_LAPIC"))
}

fn set_lvt_mode(lapic: &mut kvm_lapic_state, offset: usize, mode: u32) {
    let reg = &mut lapic.regs[offset..offset + 4];
    let bytes: [u8; 4] = std::array::from_fn(|i| reg[i] as u8);
    let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
    for (dst, src) in reg.iter_mut().zip(value.to_le_bytes()) {
        *dst = src as _;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    #[test]
    fn gdt_entries_decode_to_flat_segments() {
        let code = segment_from_gdt(gdt_entry(0xa09b, 0, 0xfffff), 2);
        assert_eq!(
            (code.base, code.limit, code.selector),
            (0, 0xffff_ffff, 0x10)
        );
        assert_eq!(
            (code.l, code.db, code.g, code.present, code.s),
            (1, 0, 1, 1, 1)
        );
        assert_eq!(code.type_, 0xb);
        let data = segment_from_gdt(gdt_entry(0xc093, 0, 0xfffff), 3);
        assert_eq!((data.l, data.db, data.type_, data.unusable), (0, 1, 3, 0));
        assert_eq!(segment_from_gdt(0, 0).unusable, 1);
    }

    #[test]
    fn boot_tables_identity_map_one_gib() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_boot_tables(&mem).unwrap();
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_START)).unwrap();
        assert_eq!(pml4, PDPTE_START | 3);
        let last: u64 = mem.read_obj(GuestAddress(PDE_START + 511 * 8)).unwrap();
        assert_eq!(last, (511 << 21) | 0x83);
    }

    #[test]
    fn lvt_mode_is_replaced_not_ored() {
        let mut lapic = kvm_lapic_state::default();
        lapic.regs[APIC_LVT_LINT0 + 1] = 0x4; // NMI mode already set
        set_lvt_mode(&mut lapic, APIC_LVT_LINT0, APIC_MODE_EXTINT);
        assert_eq!(lapic.regs[APIC_LVT_LINT0 + 1] as u8, 0x7);
    }
}
