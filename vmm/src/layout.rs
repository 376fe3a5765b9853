//! Where the VMM puts things in guest-physical memory at boot.
//!
//! Everything below 1 MiB follows the conventions Linux expects of a
//! direct-boot loader; the kernel itself is loaded at `HIMEM_START`.

/// Global descriptor table used for the 64-bit entry.
pub const BOOT_GDT: u64 = 0x500;
/// An empty IDT: the guest installs its own before enabling interrupts.
pub const BOOT_IDT: u64 = 0x520;
/// The Linux "zero page" (`struct boot_params`).
pub const ZERO_PAGE: u64 = 0x7000;
/// Initial stack pointer for the boot vCPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity page tables: one PML4, one PDPT, one PD of 2 MiB pages (1 GiB).
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
/// Kernel command line, NUL-terminated.
pub const CMDLINE_START: u64 = 0x20000;
/// Longest command line we accept, including the NUL.
pub const CMDLINE_MAX_SIZE: usize = 4096;
/// End of conventional memory below the EBDA, where the MP table goes.
pub const EBDA_START: u64 = 0x9fc00;
/// First byte above the legacy hole: kernels load here.
pub const HIMEM_START: u64 = 0x10_0000;
/// Local APIC and IOAPIC MMIO bases.
pub const APIC_BASE: u32 = 0xfee0_0000;
pub const IOAPIC_BASE: u32 = 0xfec0_0000;
/// The identity page: generation, per-clone seed and wall clock, written by
/// the VMM at boot and at every restore (see `identity.rs`).
pub const IDENTITY_PAGE: u64 = 0x9e000;
