//! A copy-on-write disk: a base image opened read-only (the template's,
//! shared by every clone) plus a per-VM sparse overlay file of the same
//! size, and a bitmap of the 4 KiB chunks the overlay holds. Reads come from
//! the overlay where it holds the chunk, else from the base; writes always
//! go to the overlay, copying a chunk up from the base first when a write
//! covers only part of it. The base is never written.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub const SECTOR_SIZE: u64 = 512;
/// Overlay granularity.
pub const CHUNK_SIZE: u64 = 4096;
/// How much more data than allocation a kept overlay's filesystem may
/// report (rounding at the file's end) before it counts as reporting no
/// holes ([`CowDisk::open_kept`]).
const KEPT_SLACK: u64 = 1 << 16;
/// Copies between overlays go in pieces of at most this much.
const COPY_PIECE: u64 = 1 << 20;

/// Errors of the copy-on-write disk.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cannot open {what} {path}: {source}")]
    Open {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("base image {path} is {size} bytes, not a whole number of 512-byte sectors")]
    Unaligned { path: PathBuf, size: u64 },
    #[error("{path} is {actual} bytes but the saved disk is {expected}")]
    SizeChanged {
        path: PathBuf,
        actual: u64,
        expected: u64,
    },
    #[error("saved overlay map is invalid: {0}")]
    BadMap(String),
    #[error("{what} failed: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("access of {len} bytes at {offset} is beyond the disk's {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("the disk is read-only")]
    ReadOnly,
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> DiskError {
    move |source| DiskError::Io { what, source }
}

/// Which overlay chunks hold data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayMap {
    words: Vec<u64>,
    chunks: u64,
}

impl OverlayMap {
    pub fn new(chunks: u64) -> Self {
        Self {
            words: vec![0; chunks.div_ceil(64) as usize],
            chunks,
        }
    }

    pub fn chunks(&self) -> u64 {
        self.chunks
    }

    pub fn get(&self, chunk: u64) -> bool {
        chunk < self.chunks && self.words[(chunk / 64) as usize] & (1 << (chunk % 64)) != 0
    }

    fn set(&mut self, chunk: u64) {
        if chunk < self.chunks {
            self.words[(chunk / 64) as usize] |= 1 << (chunk % 64);
        }
    }

    /// Number of chunks the overlay holds.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The set chunks as sorted `(first, count)` runs.
    pub fn to_runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for chunk in (0..self.chunks).filter(|&c| self.get(c)) {
            match runs.last_mut() {
                Some((first, count)) if *first + *count == chunk => *count += 1,
                _ => runs.push((chunk, 1)),
            }
        }
        runs
    }

    /// The map of sorted, disjoint `(first, count)` runs within `chunks`
    /// (so building it costs at most `chunks` steps, whatever the runs).
    pub fn from_runs(chunks: u64, runs: &[(u64, u64)]) -> Result<Self, DiskError> {
        let mut map = Self::new(chunks);
        let mut done = 0;
        for &(first, count) in runs {
            match first.checked_add(count) {
                Some(end) if end <= chunks && first >= done => {
                    (first..end).for_each(|c| map.set(c));
                    done = end;
                }
                _ => {
                    return Err(DiskError::BadMap(format!(
                        "run {first}+{count} beyond {chunks} chunks or not after chunk {done}"
                    )))
                }
            }
        }
        Ok(map)
    }
}

/// The disk the guest sees.
#[derive(Debug)]
pub struct CowDisk {
    base: File,
    base_path: PathBuf,
    size: u64,
    overlay: Option<(File, PathBuf)>,
    map: OverlayMap,
}

fn open_base(path: &Path) -> Result<(File, u64), DiskError> {
    let base = File::open(path).map_err(|source| DiskError::Open {
        what: "base image",
        path: path.into(),
        source,
    })?;
    let size = base.metadata().map_err(io("stat of the base image"))?.len();
    if !size.is_multiple_of(SECTOR_SIZE) {
        return Err(DiskError::Unaligned {
            path: path.into(),
            size,
        });
    }
    Ok((base, size))
}

/// The base image, which must have `size` bytes.
fn open_base_sized(path: &Path, size: u64) -> Result<File, DiskError> {
    let (base, actual) = open_base(path)?;
    if actual != size {
        return Err(DiskError::SizeChanged {
            path: path.into(),
            actual,
            expected: size,
        });
    }
    Ok(base)
}

/// Checks that the base image at `path` has `size` bytes: a saved disk
/// size is checked against the real file before anything is sized by it.
pub fn check_base(path: &Path, size: u64) -> Result<(), DiskError> {
    open_base_sized(path, size).map(drop)
}

fn open_overlay(path: &Path, truncate: bool) -> Result<File, DiskError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(truncate)
        .truncate(truncate)
        .open(path)
        .map_err(|source| DiskError::Open {
            what: "overlay",
            path: path.into(),
            source,
        })
}

impl CowDisk {
    /// A disk over `base` with a fresh, empty overlay at `overlay` (created
    /// or truncated), or a read-only disk without one.
    pub fn open(base: &Path, overlay: Option<&Path>) -> Result<Self, DiskError> {
        let (base_file, size) = open_base(base)?;
        let overlay = match overlay {
            Some(path) => {
                let f = open_overlay(path, true)?;
                f.set_len(size).map_err(io("sizing the overlay"))?;
                Some((f, path.to_path_buf()))
            }
            None => None,
        };
        Ok(Self {
            base: base_file,
            base_path: base.into(),
            size,
            overlay,
            map: OverlayMap::new(size.div_ceil(CHUNK_SIZE)),
        })
    }

    /// A disk over `base` with the overlay at `overlay` kept as it is: how a
    /// sandbox reboots with the disk it kept (its VMM ended without a
    /// snapshot, so no map was saved). The overlay is sparse and every
    /// chunk the disk put there was written whole (a partial write copies
    /// the chunk up first), so the chunks it holds are those with data.
    /// Refused when the overlay's size is not the base's, or when its
    /// filesystem reports more data than it allocated (no hole reporting:
    /// unwritten chunks would read as zeros instead of the base).
    pub fn open_kept(base: &Path, overlay: &Path) -> Result<Self, DiskError> {
        let (base_file, size) = open_base(base)?;
        let f = open_overlay(overlay, false)?;
        let actual = f.metadata().map_err(io("stat of the overlay"))?.len();
        if actual != size {
            return Err(DiskError::SizeChanged {
                path: overlay.into(),
                actual,
                expected: size,
            });
        }
        let extents = torpor_vmm_api::sparse::data_extents(&f, size)
            .map_err(io("finding the overlay's data"))?;
        let data: u64 = extents.iter().map(|(_, len)| len).sum();
        let allocated =
            torpor_vmm_api::sparse::allocated_bytes(&f).map_err(io("stat of the overlay"))?;
        if data > allocated.saturating_add(KEPT_SLACK) {
            return Err(DiskError::BadMap(format!(
                "the overlay's filesystem reports {data} bytes of data but allocated \
                 {allocated}: it does not report holes, so the chunks it holds are unknown"
            )));
        }
        let mut map = OverlayMap::new(size.div_ceil(CHUNK_SIZE));
        for (start, len) in extents {
            (start / CHUNK_SIZE..(start + len).div_ceil(CHUNK_SIZE)).for_each(|c| map.set(c));
        }
        Ok(Self {
            base: base_file,
            base_path: base.into(),
            size,
            overlay: Some((f, overlay.to_path_buf())),
            map,
        })
    }

    /// Reopens a saved disk: the base must still have the saved size, the
    /// overlay must exist and `map` says which of its chunks hold data.
    pub fn reopen(
        base: &Path,
        overlay: Option<&Path>,
        size: u64,
        map: OverlayMap,
    ) -> Result<Self, DiskError> {
        let base_file = open_base_sized(base, size)?;
        if map.chunks() != size.div_ceil(CHUNK_SIZE) {
            return Err(DiskError::BadMap(format!(
                "{} chunks for a disk of {size} bytes",
                map.chunks()
            )));
        }
        let overlay = match overlay {
            Some(path) => {
                let f = open_overlay(path, false)?;
                let actual = f.metadata().map_err(io("stat of the overlay"))?.len();
                if actual != size {
                    return Err(DiskError::SizeChanged {
                        path: path.into(),
                        actual,
                        expected: size,
                    });
                }
                Some((f, path.to_path_buf()))
            }
            None if map.count() > 0 => {
                return Err(DiskError::BadMap("chunks mapped but no overlay".into()))
            }
            None => None,
        };
        Ok(Self {
            base: base_file,
            base_path: base.into(),
            size,
            overlay,
            map,
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn is_read_only(&self) -> bool {
        self.overlay.is_none()
    }

    pub fn map(&self) -> &OverlayMap {
        &self.map
    }

    pub fn base_path(&self) -> &Path {
        &self.base_path
    }

    pub fn overlay_path(&self) -> Option<&Path> {
        self.overlay.as_ref().map(|(_, p)| p.as_path())
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), DiskError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(DiskError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// Reads `buf.len()` bytes at `offset`, each run of chunks from
    /// whichever file holds it.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DiskError> {
        self.check_range(offset, buf.len() as u64)?;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let in_overlay = self.map.get(pos / CHUNK_SIZE);
            // Extend over following chunks from the same source.
            let mut end = (pos / CHUNK_SIZE + 1) * CHUNK_SIZE;
            let stop = offset + buf.len() as u64;
            while end < stop && self.map.get(end / CHUNK_SIZE) == in_overlay {
                end += CHUNK_SIZE;
            }
            let n = (end.min(stop) - pos) as usize;
            let file = match &self.overlay {
                Some((f, _)) if in_overlay => f,
                _ => &self.base,
            };
            file.read_exact_at(&mut buf[done..done + n], pos)
                .map_err(io("disk read"))?;
            done += n;
        }
        Ok(())
    }

    /// Copies chunk `chunk` from the base into the overlay.
    fn copy_up(&mut self, chunk: u64) -> Result<(), DiskError> {
        let start = chunk * CHUNK_SIZE;
        let len = CHUNK_SIZE.min(self.size - start) as usize;
        let mut buf = vec![0u8; len];
        self.base
            .read_exact_at(&mut buf, start)
            .map_err(io("copy-up read of the base image"))?;
        let (overlay, _) = self.overlay.as_ref().ok_or(DiskError::ReadOnly)?;
        overlay
            .write_all_at(&buf, start)
            .map_err(io("copy-up write of the overlay"))?;
        self.map.set(chunk);
        Ok(())
    }

    /// Writes `data` at `offset` into the overlay.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), DiskError> {
        if self.overlay.is_none() {
            return Err(DiskError::ReadOnly);
        }
        self.check_range(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let end = offset + data.len() as u64;
        let (first, last) = (offset / CHUNK_SIZE, (end - 1) / CHUNK_SIZE);
        // Only the end chunks can be partly covered.
        for chunk in [first, last] {
            let start = chunk * CHUNK_SIZE;
            let chunk_end = (start + CHUNK_SIZE).min(self.size);
            let covered = offset <= start && end >= chunk_end;
            if !covered && !self.map.get(chunk) {
                self.copy_up(chunk)?;
            }
        }
        let (overlay, _) = self.overlay.as_ref().ok_or(DiskError::ReadOnly)?;
        overlay
            .write_all_at(data, offset)
            .map_err(io("overlay write"))?;
        (first..=last).for_each(|c| self.map.set(c));
        Ok(())
    }

    /// Makes every write so far durable.
    pub fn flush(&self) -> Result<(), DiskError> {
        match &self.overlay {
            Some((f, _)) => f.sync_data().map_err(io("overlay flush")),
            None => Ok(()),
        }
    }
}

/// Copies the chunks `map` marks from overlay `src` into a new sparse
/// overlay `dst` of `size` bytes (created or truncated). This is how a clone
/// gets its own overlay and a snapshot keeps a frozen one.
pub fn copy_overlay(src: &Path, dst: &Path, size: u64, map: &OverlayMap) -> Result<(), DiskError> {
    let from = File::open(src).map_err(|source| DiskError::Open {
        what: "overlay",
        path: src.into(),
        source,
    })?;
    let to = open_overlay(dst, true)?;
    to.set_len(size).map_err(io("sizing the overlay copy"))?;
    let mut buf = Vec::new();
    for (first, count) in map.to_runs() {
        let mut pos = first * CHUNK_SIZE;
        let end = ((first + count) * CHUNK_SIZE).min(size);
        while pos < end {
            let n = (end - pos).min(COPY_PIECE) as usize;
            buf.resize(n, 0);
            from.read_exact_at(&mut buf, pos)
                .map_err(io("overlay copy read"))?;
            to.write_all_at(&buf, pos)
                .map_err(io("overlay copy write"))?;
            pos += n as u64;
        }
    }
    to.sync_data().map_err(io("overlay copy flush"))
}
