//! Guest memory: the layout of guest-physical RAM and the backends that map it.
//!
//! Layout: RAM starts at 0 and runs up to `MMIO_GAP_START` (3 GiB); anything
//! beyond continues at 4 GiB so that the LAPIC/IOAPIC window stays free.
//! The backend decides *how* RAM is mapped (anonymous memory today; a file
//! mapping or a userfaultfd-served region for restores).

use std::fmt;

use vm_memory::{GuestAddress, GuestMemoryMmap};

/// Start of the hole below 4 GiB reserved for device MMIO (LAPIC, IOAPIC).
pub const MMIO_GAP_START: u64 = 0xC000_0000;
/// End of that hole.
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Smallest guest we accept: the boot structures and a kernel must fit.
pub const MIN_MEM_MIB: u64 = 16;

/// Errors while creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("memory size must be at least {MIN_MEM_MIB} MiB, got {0} MiB")]
    TooSmall(u64),
    #[error("memory size {requested_mib} MiB is larger than this host's {host_mib} MiB of RAM")]
    LargerThanHost { requested_mib: u64, host_mib: u64 },
    #[error("cannot read host memory size: {0}")]
    HostMemory(std::io::Error),
    #[error("cannot map guest memory: {0}")]
    Map(#[from] vm_memory::mmap::FromRangesError),
}

/// The guest-physical RAM ranges of a VM with `mem_bytes` of memory.
pub fn ram_ranges(mem_bytes: u64) -> Vec<(GuestAddress, usize)> {
    if mem_bytes <= MMIO_GAP_START {
        vec![(GuestAddress(0), mem_bytes as usize)]
    } else {
        vec![
            (GuestAddress(0), MMIO_GAP_START as usize),
            (
                GuestAddress(MMIO_GAP_END),
                (mem_bytes - MMIO_GAP_START) as usize,
            ),
        ]
    }
}

/// Checks a requested memory size against the limits and the host's RAM.
pub fn validate_mem_size(mem_mib: u64) -> Result<u64, MemoryError> {
    if mem_mib < MIN_MEM_MIB {
        return Err(MemoryError::TooSmall(mem_mib));
    }
    let host_mib = host_memory_bytes().map_err(MemoryError::HostMemory)? >> 20;
    if mem_mib > host_mib {
        return Err(MemoryError::LargerThanHost {
            requested_mib: mem_mib,
            host_mib,
        });
    }
    Ok(mem_mib << 20)
}

/// Total physical RAM of the host, in bytes. Read once per process: every
/// restore validates its size, and reading /proc/meminfo is not free.
pub use torpor_vmm_api::host::memory_bytes as host_memory_bytes;

/// How guest RAM is mapped into the VMM. Later backends map a snapshot's
/// memory file privately or serve pages through userfaultfd.
pub trait MemoryBackend: fmt::Debug + Send + Sync {
    /// Short name used in logs and status ("anonymous", "file", ...).
    fn name(&self) -> &'static str;
    /// Maps guest RAM for the given guest-physical ranges.
    fn map(&self, ranges: &[(GuestAddress, usize)]) -> Result<GuestMemoryMmap, MemoryError>;
}

/// Fresh zeroed anonymous memory (MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE):
/// pages cost nothing until the guest touches them.
#[derive(Debug, Default, Clone, Copy)]
pub struct AnonymousBackend;

impl MemoryBackend for AnonymousBackend {
    fn name(&self) -> &'static str {
        "anonymous"
    }

    fn map(&self, ranges: &[(GuestAddress, usize)]) -> Result<GuestMemoryMmap, MemoryError> {
        Ok(GuestMemoryMmap::from_ranges(ranges)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryBackend;

    #[test]
    fn small_guest_is_one_range() {
        let r = ram_ranges(256 << 20);
        assert_eq!(r, vec![(GuestAddress(0), 256 << 20)]);
    }

    #[test]
    fn large_guest_skips_the_mmio_gap() {
        let r = ram_ranges(4 << 30);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], (GuestAddress(0), MMIO_GAP_START as usize));
        assert_eq!(r[1].0, GuestAddress(MMIO_GAP_END));
        assert_eq!(r[1].1 as u64, (4 << 30) - MMIO_GAP_START);
    }

    #[test]
    fn size_limits() {
        assert!(matches!(
            validate_mem_size(0),
            Err(MemoryError::TooSmall(0))
        ));
        assert!(matches!(
            validate_mem_size(1 << 40),
            Err(MemoryError::LargerThanHost { .. })
        ));
        assert_eq!(validate_mem_size(64).unwrap(), 64 << 20);
    }

    #[test]
    fn anonymous_backend_maps_zeroed_memory() {
        let mem = AnonymousBackend.map(&ram_ranges(32 << 20)).unwrap();
        assert_eq!(mem.num_regions(), 1);
        let v: u64 = vm_memory::Bytes::read_obj(&mem, GuestAddress(0x1000)).unwrap();
        assert_eq!(v, 0);
    }
}
