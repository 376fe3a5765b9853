//! Memory files: guest RAM laid out linearly, region after region in
//! guest-physical order, in 4 KiB pages (page `p` at byte `p * PAGE_SIZE`).
//!
//! All-zero pages are never written: the file is created at its full length
//! (a hole) and only runs of non-zero pages are written, so a mostly-empty
//! guest costs little disk and a read of a hole gives zeros. A diff layer
//! has the same length and layout but holds only the pages it lists.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use super::atomic::AtomicFile;
use super::{PageRuns, SnapshotError, PAGE_SIZE};

const PAGE: usize = PAGE_SIZE as usize;

/// What writing a memory file did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemoryFileInfo {
    /// Length of the file: the size of guest RAM.
    pub len_bytes: u64,
    /// Pages written with data (non-zero pages in the written range).
    pub data_pages: u64,
    /// Bytes passed to pwrite: `data_pages * PAGE_SIZE`.
    pub written_bytes: u64,
    /// pwrite calls made (adjacent data pages are coalesced into one).
    pub write_calls: u64,
    /// Disk space the file occupies (`st_blocks * 512`).
    pub allocated_bytes: u64,
}

/// Writes all of guest RAM (`regions`, in guest-physical order, each a
/// multiple of [`PAGE_SIZE`]) to `path` atomically, leaving zero pages as
/// holes. The guest must not run while this reads its memory.
///
/// Every page is read in first ([`populate`]): a page that cannot be read
/// fails the snapshot with [`SnapshotError::UnreadableMemory`] instead of
/// faulting while it is copied.
pub fn write_full_memory(path: &Path, regions: &[&[u8]]) -> Result<MemoryFileInfo, SnapshotError> {
    let layout = Layout::new(path, regions)?;
    populate(path, regions)?;
    let total = layout.total_pages;
    write_with(path, &layout, std::iter::once((0, total)))
}

/// Faults every page of `regions` in for reading with
/// `madvise(MADV_POPULATE_READ)` (Linux 5.14+), so that a page that cannot
/// be read is an error here rather than a SIGBUS in the copy that follows.
///
/// A full snapshot reads all of guest RAM, holes included. With the `file`
/// memory backend guest RAM is a private mapping of the layers' memory
/// files, and on a tmpfs reading a hole allocates a page of the tmpfs:
/// when it is full, that read is a SIGBUS, which ends the VMM. The kernel
/// tells the populate call the same thing as EFAULT. On a kernel without
/// `MADV_POPULATE_READ` (EINVAL) the pages are left to the copy, as before.
fn populate(path: &Path, regions: &[&[u8]]) -> Result<(), SnapshotError> {
    for (index, region) in regions.iter().enumerate() {
        if region.is_empty() {
            continue;
        }
        // madvise takes a page-aligned start; the page holding a region's
        // first byte is mapped with it.
        let start = region.as_ptr() as usize & !(PAGE - 1);
        let len = region.as_ptr() as usize + region.len() - start;
        loop {
            // SAFETY: `start..start + len` covers only pages that hold
            // bytes of `region`, a live mapping; MADV_POPULATE_READ only
            // faults pages in for reading and changes no contents.
            let rc =
                unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_READ) };
            if rc == 0 {
                break;
            }
            let source = std::io::Error::last_os_error();
            match source.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                Some(libc::EINVAL) | Some(libc::ENOSYS) => return Ok(()),
                _ => {
                    return Err(SnapshotError::UnreadableMemory {
                        path: path.to_path_buf(),
                        index,
                        source,
                    })
                }
            }
        }
    }
    Ok(())
}

/// Writes a diff layer: same length and layout as a full memory file, but
/// only the pages in `pages` are written (those that are all zero stay
/// holes; `pages` itself, stored in the snapshot state, says they belong to
/// the layer). Disk use is proportional to the listed pages.
pub fn write_memory_pages(
    path: &Path,
    regions: &[&[u8]],
    pages: &PageRuns,
) -> Result<MemoryFileInfo, SnapshotError> {
    let layout = Layout::new(path, regions)?;
    for &(first, count) in pages.runs() {
        match first.checked_add(count) {
            Some(end) if end <= layout.total_pages => {}
            _ => {
                return Err(SnapshotError::PageOutOfRange {
                    path: path.to_path_buf(),
                    page: first.max(layout.total_pages),
                    total_pages: layout.total_pages,
                })
            }
        }
    }
    write_with(path, &layout, pages.runs().iter().copied())
}

/// Opens a memory file read-only after checking that its length is
/// `expected_len` (the guest's RAM size).
pub fn check_memory_file(path: &Path, expected_len: u64) -> Result<File, SnapshotError> {
    let file = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => SnapshotError::MemoryFileMissing {
            path: path.to_path_buf(),
        },
        _ => SnapshotError::io(path, e),
    })?;
    let actual = file
        .metadata()
        .map_err(|e| SnapshotError::io(path, e))?
        .len();
    if actual != expected_len {
        return Err(SnapshotError::MemoryFileSize {
            path: path.to_path_buf(),
            expected: expected_len,
            actual,
        });
    }
    Ok(file)
}

/// Reads page `page` of a memory file (holes read as zeros).
pub fn read_page(file: &File, page: u64, buf: &mut [u8; PAGE]) -> std::io::Result<()> {
    read_pages(file, page, buf)
}

/// Reads `buf.len() / PAGE_SIZE` pages starting at `first_page`; `buf` must
/// be a whole number of pages. Reading past the end is `UnexpectedEof`.
pub fn read_pages(file: &File, first_page: u64, buf: &mut [u8]) -> std::io::Result<()> {
    if !buf.len().is_multiple_of(PAGE) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "buffer of {} bytes is not a whole number of pages",
                buf.len()
            ),
        ));
    }
    let offset = first_page.checked_mul(PAGE_SIZE).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "page index overflows")
    })?;
    file.read_exact_at(buf, offset)
}

/// Whether `buf` is all zero bytes. Runs over every byte of guest RAM, so
/// it works on 64-byte blocks that the compiler turns into vector ORs, and
/// stops at the first block with data.
pub(crate) fn is_zero(buf: &[u8]) -> bool {
    let mut blocks = buf.chunks_exact(64);
    blocks.by_ref().all(|b| {
        b.chunks_exact(8).fold(0u64, |acc, w| {
            acc | u64::from_ne_bytes(w.try_into().unwrap())
        }) == 0
    }) && blocks.remainder().iter().all(|&b| b == 0)
}

/// Guest RAM regions and where each starts in the file, in pages.
struct Layout<'a> {
    regions: &'a [&'a [u8]],
    first_pages: Vec<u64>,
    total_pages: u64,
}

impl<'a> Layout<'a> {
    fn new(path: &Path, regions: &'a [&'a [u8]]) -> Result<Self, SnapshotError> {
        let mut first_pages = Vec::with_capacity(regions.len());
        let mut total_pages = 0u64;
        for (index, r) in regions.iter().enumerate() {
            if r.len() % PAGE != 0 {
                return Err(SnapshotError::UnalignedRegion {
                    path: path.to_path_buf(),
                    index,
                    len: r.len() as u64,
                });
            }
            first_pages.push(total_pages);
            total_pages += (r.len() / PAGE) as u64;
        }
        Ok(Layout {
            regions,
            first_pages,
            total_pages,
        })
    }

    /// Writes the non-zero pages among `first..end` to `file`, one pwrite
    /// per run of adjacent non-zero pages within a region.
    fn write_range(
        &self,
        file: &File,
        first: u64,
        end: u64,
        info: &mut MemoryFileInfo,
    ) -> std::io::Result<()> {
        for (region, &base) in self.regions.iter().zip(&self.first_pages) {
            let region_end = base + (region.len() / PAGE) as u64;
            let (lo, hi) = (first.max(base), end.min(region_end));
            if lo >= hi {
                continue;
            }
            let page_bytes = |p: u64| {
                let off = (p - base) as usize * PAGE;
                &region[off..off + PAGE]
            };
            let mut flush = |from: u64, to: u64| {
                let bytes = &region[(from - base) as usize * PAGE..(to - base) as usize * PAGE];
                info.data_pages += to - from;
                info.written_bytes += bytes.len() as u64;
                info.write_calls += 1;
                file.write_all_at(bytes, from * PAGE_SIZE)
            };
            let mut run_start = None;
            for p in lo..hi {
                match (is_zero(page_bytes(p)), run_start) {
                    (false, None) => run_start = Some(p),
                    (true, Some(start)) => {
                        flush(start, p)?;
                        run_start = None;
                    }
                    _ => {}
                }
            }
            if let Some(start) = run_start {
                flush(start, hi)?;
            }
        }
        Ok(())
    }
}

/// Creates the file at full length (all holes), writes the non-zero pages
/// of each `(first_page, count)` range, and commits atomically.
fn write_with(
    path: &Path,
    layout: &Layout,
    ranges: impl Iterator<Item = (u64, u64)>,
) -> Result<MemoryFileInfo, SnapshotError> {
    let io = |e| SnapshotError::io(path, e);
    let tmp = AtomicFile::create(path)?;
    let mut info = MemoryFileInfo {
        len_bytes: layout.total_pages * PAGE_SIZE,
        ..Default::default()
    };
    tmp.file().set_len(info.len_bytes).map_err(io)?;
    for (first, count) in ranges {
        layout
            .write_range(tmp.file(), first, first + count, &mut info)
            .map_err(io)?;
    }
    let file = tmp.commit()?;
    info.allocated_bytes = file.metadata().map_err(io)?.blocks() * 512;
    Ok(info)
}

#[cfg(test)]
#[path = "memory_tests.rs"]
mod tests;
