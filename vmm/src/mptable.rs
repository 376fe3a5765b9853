//! Intel MultiProcessor Specification 1.4 table, so a Linux guest finds every
//! vCPU, the IOAPIC and the ISA interrupt routing without ACPI.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::{APIC_BASE, IOAPIC_BASE};

const MPC_SPEC_REV: u8 = 4;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const ISA_IRQS: u8 = 16;
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTSTRAP: u8 = 2;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
/// Family 6 signature and FPU|APIC feature flags, as a generic PC reports.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;
/// Size of the floating pointer structure that precedes the table.
const FLOATING_POINTER_SIZE: u64 = 16;

/// Errors while writing the MP table.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    #[error("the MP table supports at most 254 vCPUs, got {0}")]
    TooManyCpus(u8),
    #[error("cannot write the MP table to guest memory: {0}")]
    GuestMemory(#[from] vm_memory::GuestMemoryError),
}

/// Little-endian byte builder for the table's packed structures.
#[derive(Default)]
struct Table(Vec<u8>);

impl Table {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
}

/// Two's-complement byte that makes `bytes` sum to zero.
fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// Builds the floating pointer structure followed by the configuration
/// table, as it must appear at guest-physical address `base`.
pub fn build(base: u64, vcpus: u8) -> Result<Vec<u8>, MptableError> {
    if vcpus > 254 {
        return Err(MptableError::TooManyCpus(vcpus));
    }
    let ioapic_id = vcpus + 1;
    let mut entries = Table::default();
    for cpu in 0..vcpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOTSTRAP } else { 0 };
        entries
            .u8(ENTRY_PROCESSOR)
            .u8(cpu)
            .u8(APIC_VERSION)
            .u8(flags)
            .u32(CPU_SIGNATURE)
            .u32(CPU_FEATURES)
            .bytes(&[0; 8]);
    }
    entries.u8(ENTRY_BUS).u8(0).bytes(b"ISA   ");
    entries
        .u8(ENTRY_IOAPIC)
        .u8(ioapic_id)
        .u8(IOAPIC_VERSION)
        .u8(1)
        .u32(IOAPIC_BASE);
    for irq in 0..ISA_IRQS {
        entries
            .u8(ENTRY_IO_INTERRUPT)
            .u8(INT_TYPE_INT)
            .u16(0)
            .u8(0)
            .u8(irq)
            .u8(ioapic_id)
            .u8(irq);
    }
    for (kind, lint) in [(INT_TYPE_EXTINT, 0u8), (INT_TYPE_NMI, 1u8)] {
        entries
            .u8(ENTRY_LOCAL_INTERRUPT)
            .u8(kind)
            .u16(0)
            .u8(0)
            .u8(0)
            .u8(0xff) // every local APIC
            .u8(lint);
    }
    let entry_count = u16::from(vcpus) + 1 + 1 + u16::from(ISA_IRQS) + 2;
    let header_len = 44u16;
    let table_len = header_len + entries.0.len() as u16;

    let mut config = Table::default();
    config
        .bytes(b"PCMP")
        .u16(table_len)
        .u8(MPC_SPEC_REV)
        .u8(0) // checksum, patched below
        .bytes(b"TORPOR  ")
        .bytes(b"MICROVM     ")
        .u32(0)
        .u16(0)
        .u16(entry_count)
        .u32(APIC_BASE)
        .u16(0)
        .u8(0)
        .u8(0)
        .bytes(&entries.0);
    config.0[7] = checksum(&config.0);

    let mut out = Table::default();
    out.bytes(b"_MP_")
        .u32((base + FLOATING_POINTER_SIZE) as u32)
        .u8(1) // length in 16-byte units
        .u8(MPC_SPEC_REV)
        .u8(0) // checksum, patched below
        .bytes(&[0; 5]);
    out.0[10] = checksum(&out.0);
    out.bytes(&config.0);
    Ok(out.0)
}

/// Writes the MP table for `vcpus` vCPUs at `base`.
pub fn write(mem: &GuestMemoryMmap, base: u64, vcpus: u8) -> Result<(), MptableError> {
    mem.write_slice(&build(base, vcpus)?, GuestAddress(base))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_lengths_are_valid() {
        for vcpus in [1u8, 2, 8, 254] {
            let t = build(0x9fc00, vcpus).unwrap();
            assert_eq!(&t[..4], b"_MP_");
            assert_eq!(sum(&t[..16]), 0);
            let cfg = &t[16..];
            assert_eq!(&cfg[..4], b"PCMP");
            let len = u16::from_le_bytes([cfg[4], cfg[5]]) as usize;
            assert_eq!(len, cfg.len());
            assert_eq!(sum(cfg), 0);
            let count = u16::from_le_bytes([cfg[34], cfg[35]]);
            assert_eq!(count, u16::from(vcpus) + 20);
            assert_eq!(len, 44 + 20 * vcpus as usize + 8 + 8 + 16 * 8 + 2 * 8);
        }
    }

    #[test]
    fn pointer_points_at_config_table() {
        let t = build(0x9fc00, 2).unwrap();
        assert_eq!(u32::from_le_bytes([t[4], t[5], t[6], t[7]]), 0x9fc10);
    }

    #[test]
    fn rejects_too_many_cpus() {
        assert!(matches!(build(0, 255), Err(MptableError::TooManyCpus(255))));
    }
}
