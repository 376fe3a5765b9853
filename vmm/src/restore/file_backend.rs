//! The `file` backend: guest memory is the snapshot's memory files, mapped
//! privately (copy-on-write) over the shell's placeholder.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::snapshot::{self, PAGE_SIZE};

use super::{RestoreError, SnapshotChain, MAX_OVERLAY_MAPPINGS};

/// Host address and length of each guest RAM region, with the memory-file
/// page index it starts at.
fn region_spans(mem: &GuestMemoryMmap) -> Vec<(*mut u8, usize, u64)> {
    let mut first_page = 0;
    mem.iter()
        .map(|r| {
            let span = (r.as_ptr(), r.len() as usize, first_page);
            first_page += r.len() / PAGE_SIZE;
            span
        })
        .collect()
}

/// Maps `len` bytes of `file` at `offset` privately over `addr`.
pub(crate) fn map_fixed_private(
    addr: *mut u8,
    len: usize,
    file: &File,
    offset: u64,
    path: &Path,
) -> Result<(), RestoreError> {
    // SAFETY: `addr..addr+len` lies inside a guest RAM mapping this process
    // owns; MAP_FIXED replaces those pages atomically with a private view
    // of the file, and no vCPU runs yet.
    let ret = unsafe {
        libc::mmap(
            addr.cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
            file.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if ret == libc::MAP_FAILED {
        return Err(RestoreError::Map {
            path: path.to_path_buf(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Splits a run of memory-file pages at region boundaries: yields (host
/// address, bytes, file offset).
fn run_spans(
    spans: &[(*mut u8, usize, u64)],
    first: u64,
    count: u64,
) -> Vec<(*mut u8, usize, u64)> {
    let mut out = Vec::new();
    for &(addr, len, region_first) in spans {
        let region_pages = len as u64 / PAGE_SIZE;
        let start = first.max(region_first);
        let end = (first + count).min(region_first + region_pages);
        if start < end {
            // SAFETY: `start - region_first` pages lie within this region.
            let host = unsafe { addr.add(((start - region_first) * PAGE_SIZE) as usize) };
            out.push((
                host,
                ((end - start) * PAGE_SIZE) as usize,
                start * PAGE_SIZE,
            ));
        }
    }
    out
}

/// The `file` backend: the base mapped privately, each diff's pages mapped
/// over it (copied past the mapping budget). O(layers + runs), never
/// O(guest memory).
pub(super) fn map_file_layers(
    mem: &GuestMemoryMmap,
    chain: &SnapshotChain,
) -> Result<(), RestoreError> {
    let spans = region_spans(mem);
    let mut mappings = 0usize;
    for layer in &chain.layers {
        let path = layer.dir.join(snapshot::MEMORY_FILE);
        match &layer.pages {
            None => {
                for &(addr, len, first_page) in &spans {
                    map_fixed_private(addr, len, &layer.file, first_page * PAGE_SIZE, &path)?;
                }
            }
            Some(pages) => {
                for &(first, count) in pages.runs() {
                    for (host, len, offset) in run_spans(&spans, first, count) {
                        if mappings < MAX_OVERLAY_MAPPINGS {
                            map_fixed_private(host, len, &layer.file, offset, &path)?;
                            mappings += 1;
                        } else {
                            copy_from_file(host, len, &layer.file, offset, &path)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

fn copy_from_file(
    host: *mut u8,
    len: usize,
    file: &File,
    offset: u64,
    path: &Path,
) -> Result<(), RestoreError> {
    use std::os::unix::fs::FileExt;
    // SAFETY: `host..host+len` is guest RAM owned by this process and no
    // vCPU runs yet, so nothing else accesses it.
    let buf = unsafe { std::slice::from_raw_parts_mut(host, len) };
    file.read_exact_at(buf, offset)
        .map_err(|source| RestoreError::Copy {
            path: path.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_region_boundaries() {
        let a = 0x1000_0000usize as *mut u8;
        let b = 0x9000_0000usize as *mut u8;
        // Region 0: pages 0..4, region 1: pages 4..8.
        let spans = [(a, 4 * 4096, 0u64), (b, 4 * 4096, 4u64)];
        let out = run_spans(&spans, 2, 4);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], (a.wrapping_add(2 * 4096), 2 * 4096, 2 * 4096));
        assert_eq!(out[1], (b, 2 * 4096, 4 * 4096));
        assert!(run_spans(&spans, 8, 1).is_empty());
    }
}
