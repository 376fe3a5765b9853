//! The identity page: how a guest learns it was restored and gets a seed
//! of its own. Every clone of one snapshot would otherwise share RNG state
//! and identity; the guest (probe or agent) reads this page and reseeds.
//!
//! Layout at guest-physical `IDENTITY_PAGE`, little endian:
//! `0` magic "TORPORID", `8` generation (0 at cold boot, +1 per restore),
//! `16` 32 random bytes, `48` host wall clock in ns since the epoch.

use std::time::{SystemTime, UNIX_EPOCH};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout::IDENTITY_PAGE;

pub const IDENTITY_MAGIC: &[u8; 8] = b"TORPORID";
pub const OFFSET_GENERATION: u64 = 8;
pub const OFFSET_SEED: u64 = 16;
pub const SEED_LEN: usize = 32;
pub const OFFSET_CLOCK: u64 = 48;

/// Errors while writing the identity page.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("cannot get random bytes for the identity seed: {0}")]
    Random(std::io::Error),
    #[error("cannot write the identity page: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

/// What was written, for status reports and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub generation: u64,
    pub seed: [u8; SEED_LEN],
    pub clock_unix_ns: u64,
}

/// `N` random bytes from the kernel (`getrandom(2)`): the one place the
/// VMM asks for randomness (identity seeds, a restored vsock device's
/// host ports).
pub fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != N as isize {
        return Err(std::io::Error::last_os_error());
    }
    Ok(bytes)
}

fn random_seed() -> Result<[u8; SEED_LEN], IdentityError> {
    random_bytes().map_err(IdentityError::Random)
}

/// Nanoseconds since the Unix epoch on the host.
pub fn unix_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Writes a fresh identity with `generation` into guest memory.
pub fn write(mem: &GuestMemoryMmap, generation: u64) -> Result<Identity, IdentityError> {
    let id = Identity {
        generation,
        seed: random_seed()?,
        clock_unix_ns: unix_now_ns(),
    };
    let mut page = [0u8; 56];
    page[..8].copy_from_slice(IDENTITY_MAGIC);
    page[8..16].copy_from_slice(&id.generation.to_le_bytes());
    page[16..48].copy_from_slice(&id.seed);
    page[48..56].copy_from_slice(&id.clock_unix_ns.to_le_bytes());
    mem.write_slice(&page, GuestAddress(IDENTITY_PAGE))?;
    Ok(id)
}

/// The guest page index of the identity page, for diff tracking.
pub const fn page_index() -> u64 {
    IDENTITY_PAGE / 4096
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_distinct_seeds() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let a = write(&mem, 1).unwrap();
        let b = write(&mem, 2).unwrap();
        assert_ne!(a.seed, b.seed);
        let mut magic = [0u8; 8];
        mem.read_slice(&mut magic, GuestAddress(IDENTITY_PAGE))
            .unwrap();
        assert_eq!(&magic, IDENTITY_MAGIC);
        let gen: u64 = mem
            .read_obj(GuestAddress(IDENTITY_PAGE + OFFSET_GENERATION))
            .unwrap();
        assert_eq!(gen, 2);
    }
}
