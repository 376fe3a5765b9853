//! Where each page of guest memory comes from: the base memory file or one of
//! the diff layers over it.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use torpor_vmm_api::lazy::VmmMap;

use crate::snapshot::PageRuns;

use super::{UffdError, PAGE_SIZE};

/// The layer a page is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// The base memory file.
    Base,
    /// Diff layer `i`, counted from the oldest (0) to the newest.
    Diff(usize),
}

/// An open layer file and a name for messages (its path when it has one).
#[derive(Debug)]
pub(crate) struct LayerFile {
    pub(crate) file: File,
    pub(crate) name: String,
}

impl LayerFile {
    fn new(file: File) -> Self {
        let name = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| format!("fd {}", file.as_raw_fd()));
        LayerFile { file, name }
    }

    pub(crate) fn len(&self) -> Result<u64, UffdError> {
        self.file
            .metadata()
            .map(|m| m.len())
            .map_err(|source| UffdError::Inspect {
                file: self.name.clone(),
                source,
            })
    }
}

/// A base memory file and the diff layers over it, oldest first.
#[derive(Debug)]
pub struct Layers {
    base: LayerFile,
    diffs: Vec<(LayerFile, PageRuns)>,
    /// The base is still arriving (a cold wake): a chunk is read once its
    /// present bit is set.
    lazy: Option<VmmMap>,
}

impl Layers {
    /// `diffs` go oldest first: where two diffs hold a page, the later wins.
    pub fn new(base: File, diffs: Vec<(File, PageRuns)>) -> Self {
        Layers {
            base: LayerFile::new(base),
            diffs: diffs
                .into_iter()
                .map(|(file, runs)| (LayerFile::new(file), runs))
                .collect(),
            lazy: None,
        }
    }

    /// The base is a memory file still arriving, as `map` tells: every read
    /// of it waits for the chunks it covers (posting them as wanted), and
    /// fails when the pod's fetch failed or a chunk's deadline passed.
    pub fn with_lazy_base(mut self, map: VmmMap) -> Self {
        self.lazy = Some(map);
        self
    }

    /// The layer page `page` is read from: the newest diff holding it, else
    /// the base. O(diffs × log runs).
    pub fn source(&self, page: u64) -> Source {
        self.diffs
            .iter()
            .rposition(|(_, runs)| runs.contains(page))
            .map_or(Source::Base, Source::Diff)
    }

    /// Number of diff layers.
    pub fn diff_count(&self) -> usize {
        self.diffs.len()
    }

    pub(crate) fn base(&self) -> &LayerFile {
        &self.base
    }

    pub(crate) fn file(&self, source: Source) -> &LayerFile {
        match source {
            Source::Base => &self.base,
            Source::Diff(i) => &self.diffs[i].0,
        }
    }

    /// Human-readable name of a layer for messages.
    pub(crate) fn describe(&self, source: Source) -> String {
        match source {
            Source::Base => format!("base memory file {}", self.base.name),
            Source::Diff(i) => format!("diff layer {i} ({})", self.diffs[i].0.name),
        }
    }

    /// Checks that the base covers pages `..end_page` and that every diff file
    /// covers the pages it claims to hold. O(diffs).
    pub(crate) fn check_lengths(&self, region_ends: &[(usize, u64)]) -> Result<(), UffdError> {
        let base_len = self.base.len()?;
        for &(index, end_page) in region_ends {
            let need = end_page * PAGE_SIZE as u64;
            if base_len < need {
                return Err(UffdError::BaseTooShort {
                    file: self.base.name.clone(),
                    len: base_len,
                    index,
                    end_page,
                    need,
                });
            }
        }
        for (index, (file, runs)) in self.diffs.iter().enumerate() {
            let len = file.len()?;
            let need = runs.end_page() * PAGE_SIZE as u64;
            if len < need {
                return Err(UffdError::DiffTooShort {
                    index,
                    file: file.name.clone(),
                    len,
                    end_page: runs.end_page(),
                    need,
                });
            }
        }
        Ok(())
    }

    /// Whether `pages` pages from `page` of `source` can be read without
    /// waiting: always, unless the base is still arriving and a chunk
    /// they fall in is not there yet.
    pub(crate) fn arrived(&self, source: Source, page: u64, pages: u64) -> bool {
        let (Source::Base, Some(map)) = (source, &self.lazy) else {
            return true;
        };
        let size = map.chunk_size();
        let (start, end) = (page * PAGE_SIZE as u64, (page + pages) * PAGE_SIZE as u64);
        (start / size..end.div_ceil(size)).all(|i| map.is_present(i))
    }

    /// Reads `buf.len() / PAGE_SIZE` consecutive pages starting at `page` from
    /// `source`. A short read (the file was truncated) or an I/O error is a
    /// message naming the page and the file.
    pub(crate) fn read_pages(
        &self,
        source: Source,
        page: u64,
        buf: &mut [u8],
    ) -> Result<(), String> {
        let file = self.file(source);
        let offset = page * PAGE_SIZE as u64;
        if let (Source::Base, Some(map)) = (source, &self.lazy) {
            map.wait_range(offset, buf.len() as u64).map_err(|e| {
                format!("cannot read page {page} of {}: {e}", self.describe(source))
            })?;
        }
        let mut done = 0;
        while done < buf.len() {
            match file.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    let bad = page + (done / PAGE_SIZE) as u64;
                    return Err(format!(
                        "short read of page {bad} from {}: end of file at byte {} \
                         (was the file truncated?)",
                        self.describe(source),
                        offset + done as u64
                    ));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let bad = page + (done / PAGE_SIZE) as u64;
                    return Err(format!(
                        "cannot read page {bad} from {} at byte {}: {e}",
                        self.describe(source),
                        offset + done as u64
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Whether every byte of `buf` is zero. OR-folds 64-byte blocks, which the
/// compiler vectorises, and stops at the first non-zero block.
pub(crate) fn is_zero(buf: &[u8]) -> bool {
    let mut blocks = buf.chunks_exact(64);
    blocks.all(|b| b.iter().fold(0u8, |acc, &x| acc | x) == 0)
        && blocks.remainder().iter().all(|&x| x == 0)
}

/// A page-aligned buffer of [`super::PREFETCH_BATCH`] pages: the source of
/// every `UFFDIO_COPY`.
#[repr(C, align(4096))]
pub(crate) struct PageBuf(pub(crate) [u8; super::PREFETCH_BATCH * PAGE_SIZE]);

impl PageBuf {
    pub(crate) fn new_boxed() -> Box<PageBuf> {
        // Box::new of a 128 KiB array may pass through the stack in debug
        // builds; the server thread's stack is 2 MiB, so that is fine.
        Box::new(PageBuf([0; super::PREFETCH_BATCH * PAGE_SIZE]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection() {
        let mut page = vec![0u8; PAGE_SIZE];
        assert!(is_zero(&page));
        page[PAGE_SIZE - 1] = 1;
        assert!(!is_zero(&page));
        page[PAGE_SIZE - 1] = 0;
        page[0] = 0x80;
        assert!(!is_zero(&page));
        assert!(is_zero(&[0u8; 70]));
        let mut odd = [0u8; 70];
        odd[69] = 1;
        assert!(!is_zero(&odd));
    }
}
