//! A lazily fetched memory file: what the pod and a restored VMM share
//! while a snapshot layer's `memory` arrives from the object store after
//! the restore started (a cold wake, issue 29; docs/storage.md, "The wake
//! path").
//!
//! The pod makes the layer's memory file at its full length (a hole) and,
//! in the sandbox's directory, a small *map file* in the layout below: one
//! *present* bit per chunk of the memory file, set by the pod once the
//! chunk's bytes are written (checked against its hash), and a ring of
//! *wanted* slots the VMM's page server posts a chunk index into when a
//! fault lands in a chunk whose bit is clear. The pod fetches wanted
//! chunks before anything else; the page server waits for the bit (a
//! short bounded poll), up to the deadline the pod wrote, and fails the
//! restore when it passes or when the pod marks the fetch failed.
//!
//! Trust runs one way. The VMM trusts what the pod writes (it is its
//! supervisor). The pod trusts nothing the VMM writes: it reads only the
//! wanted ring, through `pread` on the descriptor it made the file with
//! (never the path, which lies in a directory the VMM owns; never a
//! mapping, which a VMM that truncated the file would turn into a SIGBUS
//! in the pod), ignores an index past the chunk count, reads at most the
//! ring's slots however far the VMM moved its head, and never reads the
//! present bits back (it keeps its own). A VMM that writes nonsense hurts
//! only its own guest.
//!
//! The map file, little endian:
//!
//! | offset | size | field                                             |
//! |-------:|-----:|---------------------------------------------------|
//! |      0 |    4 | magic `TPLZ`                                      |
//! |      4 |    4 | version, 1                                        |
//! |      8 |    8 | chunk size (a power of two, at least a page)     |
//! |     16 |    8 | chunks in the memory file                         |
//! |     24 |    8 | the memory file's length                          |
//! |     32 |    4 | state (pod): 0 fetching, 1 complete, 2 failed     |
//! |     36 |    4 | a fault's deadline, ms (pod)                      |
//! |     40 |    4 | wanted head (VMM): slots posted so far, wrapping  |
//! |     44 |   20 | reserved, 0                                       |
//! |     64 |  512 | [`WANTED_SLOTS`] wanted slots, u64 chunk indexes  |
//! |    576 |    … | present bits, bit `i % 8` of byte `i / 8`         |

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// The map file's name in the sandbox's directory.
pub const LAZY_MAP_FILE: &str = "lazy.map";
/// Slots in the wanted ring.
pub const WANTED_SLOTS: usize = 64;

const MAGIC: [u8; 4] = *b"TPLZ";
const VERSION: u32 = 1;
const STATE_AT: u64 = 32;
const HEAD_AT: u64 = 40;
const SLOTS_AT: u64 = 64;
const BITS_AT: u64 = SLOTS_AT + 8 * WANTED_SLOTS as u64;
/// The most chunks a map describes (16 Ki chunks of 1 MiB: 16 GiB; a
/// 2 KiB bitmap).
pub const MAX_CHUNKS: u64 = 1 << 20;
const PAGE: u64 = 4096;

/// Where a lazily fetched memory file stands (the pod's word).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchState {
    /// Chunks are still arriving.
    Fetching,
    /// Every chunk is in the file.
    Complete,
    /// The fetch failed: a chunk not present now never will be.
    Failed,
}

impl FetchState {
    fn word(self) -> u32 {
        match self {
            Self::Fetching => 0,
            Self::Complete => 1,
            Self::Failed => 2,
        }
    }
}

/// Why a map file cannot be made or used.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("lazy map {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("lazy map {path}: {why}")]
    Invalid { path: String, why: String },
}

/// Why a wait for a chunk ended without it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WaitError {
    #[error("chunk {chunk} of the lazily fetched memory file: the pod's fetch failed")]
    Failed { chunk: u64 },
    #[error("chunk {chunk} of the lazily fetched memory file did not arrive within {ms} ms")]
    TimedOut { chunk: u64, ms: u64 },
    #[error("chunk {chunk} is past the lazily fetched memory file's {chunks} chunks")]
    OutOfRange { chunk: u64, chunks: u64 },
}

/// The map's length for `chunks` chunks.
fn map_len(chunks: u64) -> u64 {
    BITS_AT + chunks.div_ceil(8)
}

/// The pod's side of a map file: made with [`PodMap::create`], written and
/// read through the descriptor it was made with.
#[derive(Debug)]
pub struct PodMap {
    file: File,
    chunks: u64,
    /// The present bits as the pod set them (never read back).
    present: Vec<u8>,
    /// The wanted head as last read.
    seen: u32,
    /// Wanted indexes past the chunk count seen so far (a hostile VMM).
    pub ignored: u64,
}

impl PodMap {
    /// Makes the map file at `path` (replacing one there) for a memory file
    /// of `file_len` bytes in chunks of `chunk_size`, every chunk absent
    /// but for those `present` marks (holes: nothing to fetch).
    pub fn create(
        path: &Path,
        chunk_size: u64,
        file_len: u64,
        deadline: Duration,
    ) -> Result<Self, LazyError> {
        let invalid = |why: String| LazyError::Invalid {
            path: path.display().to_string(),
            why,
        };
        if !chunk_size.is_power_of_two() || chunk_size < PAGE {
            return Err(invalid(format!("chunk size {chunk_size}")));
        }
        let chunks = file_len.div_ceil(chunk_size);
        if chunks > MAX_CHUNKS {
            return Err(invalid(format!("{chunks} chunks, more than {MAX_CHUNKS}")));
        }
        let io = |source| LazyError::Io {
            path: path.display().to_string(),
            source,
        };
        let _ = std::fs::remove_file(path);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io)?;
        let mut head = vec![0u8; BITS_AT as usize];
        head[0..4].copy_from_slice(&MAGIC);
        head[4..8].copy_from_slice(&VERSION.to_le_bytes());
        head[8..16].copy_from_slice(&chunk_size.to_le_bytes());
        head[16..24].copy_from_slice(&chunks.to_le_bytes());
        head[24..32].copy_from_slice(&file_len.to_le_bytes());
        let ms = u32::try_from(deadline.as_millis()).unwrap_or(u32::MAX);
        head[36..40].copy_from_slice(&ms.to_le_bytes());
        file.write_all_at(&head, 0).map_err(io)?;
        let present = vec![0u8; chunks.div_ceil(8) as usize];
        file.write_all_at(&present, BITS_AT).map_err(io)?;
        Ok(Self {
            file,
            chunks,
            present,
            seen: 0,
            ignored: 0,
        })
    }

    /// The map a pod made earlier at `path` and stopped with (a pod
    /// started again while the memory file still arrives), opened by the
    /// caller as `file` (writable, as it trusts it): checked against the
    /// memory file it describes (`chunk_size`, `file_len`). The present
    /// bits there are not read back (see the module): every chunk counts as
    /// absent here until marked again, and the whole wanted ring is read
    /// once more, so the chunks the VMM waits for come first.
    pub fn reopen(
        path: &Path,
        file: File,
        chunk_size: u64,
        file_len: u64,
    ) -> Result<Self, LazyError> {
        let invalid = |why: String| LazyError::Invalid {
            path: path.display().to_string(),
            why,
        };
        let mut head = [0u8; HEAD_AT as usize + 4];
        file.read_exact_at(&mut head, 0)
            .map_err(|source| LazyError::Io {
                path: path.display().to_string(),
                source,
            })?;
        let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
        if head[0..4] != MAGIC || head[4..8] != VERSION.to_le_bytes() {
            return Err(invalid("not a lazy map of this version".into()));
        }
        let chunks = file_len.div_ceil(chunk_size.max(1));
        if u64_at(8) != chunk_size || u64_at(16) != chunks || u64_at(24) != file_len {
            return Err(invalid(format!(
                "it describes {} chunks of {} bytes ({} bytes), not the memory file's \
                 {chunks} of {chunk_size} ({file_len})",
                u64_at(16),
                u64_at(8),
                u64_at(24)
            )));
        }
        let wanted_head = u32::from_le_bytes(head[HEAD_AT as usize..].try_into().expect("4 bytes"));
        Ok(Self {
            file,
            chunks,
            present: vec![0u8; chunks.div_ceil(8) as usize],
            seen: wanted_head.saturating_sub(WANTED_SLOTS as u32),
            ignored: 0,
        })
    }

    /// The chunk count.
    pub fn chunks(&self) -> u64 {
        self.chunks
    }

    /// Whether the pod marked chunk `i` present.
    pub fn is_present(&self, i: u64) -> bool {
        i < self.chunks && self.present[(i / 8) as usize] & (1 << (i % 8)) != 0
    }

    /// Marks chunk `i` present: its bytes must be in the memory file
    /// (written with `pwrite`, which the VMM's `pread` after seeing the bit
    /// sees).
    pub fn mark_present(&mut self, i: u64) -> std::io::Result<()> {
        if i >= self.chunks {
            return Ok(());
        }
        let byte = (i / 8) as usize;
        self.present[byte] |= 1 << (i % 8);
        self.file
            .write_all_at(&self.present[byte..byte + 1], BITS_AT + byte as u64)
    }

    /// Says where the fetch stands (what a waiting page server reads).
    pub fn set_state(&self, state: FetchState) -> std::io::Result<()> {
        self.file
            .write_all_at(&state.word().to_le_bytes(), STATE_AT)
    }

    /// The chunks the VMM posted since the last call, in the order it
    /// posted them, each once, not yet present and within the chunk count
    /// (others are counted in [`PodMap::ignored`]). At most the ring's
    /// slots however far the head moved; a short read (a truncated file)
    /// is nothing wanted.
    pub fn take_wanted(&mut self) -> Vec<u64> {
        let mut raw = [0u8; (BITS_AT - HEAD_AT) as usize];
        if self.file.read_exact_at(&mut raw, HEAD_AT).is_err() {
            return Vec::new();
        }
        let head = u32::from_le_bytes(raw[0..4].try_into().expect("4 bytes"));
        let new = head.wrapping_sub(self.seen).min(WANTED_SLOTS as u32);
        self.seen = head;
        let slots = &raw[(SLOTS_AT - HEAD_AT) as usize..];
        let mut out = Vec::new();
        for k in (0..new).rev() {
            let slot = head.wrapping_sub(k + 1) as usize % WANTED_SLOTS;
            let i = u64::from_le_bytes(slots[slot * 8..slot * 8 + 8].try_into().expect("8"));
            if i >= self.chunks {
                self.ignored += 1;
            } else if !self.is_present(i) && !out.contains(&i) {
                out.push(i);
            }
        }
        out
    }
}

/// The VMM's side of a map file: a shared mapping of it, read with atomic
/// loads; it writes only the wanted ring.
#[derive(Debug)]
pub struct VmmMap {
    base: *mut u8,
    len: usize,
    chunk_size: u64,
    chunks: u64,
    file_len: u64,
    deadline: Duration,
}

// SAFETY: the mapping is only accessed through atomics, and it lives as
// long as the value (unmapped in Drop).
unsafe impl Send for VmmMap {}
// SAFETY: as above.
unsafe impl Sync for VmmMap {}

impl VmmMap {
    /// Maps `file` (the pod's map file), checked: its magic, version, chunk
    /// size and length, and that it describes a memory file of
    /// `memory_len` bytes.
    pub fn open(file: &File, name: &str, memory_len: u64) -> Result<Self, LazyError> {
        let invalid = |why: String| LazyError::Invalid {
            path: name.to_string(),
            why,
        };
        let mut head = [0u8; 64];
        file.read_exact_at(&mut head, 0)
            .map_err(|source| LazyError::Io {
                path: name.to_string(),
                source,
            })?;
        let word = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8"));
        if head[0..4] != MAGIC {
            return Err(invalid("not a lazy map (bad magic)".into()));
        }
        let version = u32::from_le_bytes(head[4..8].try_into().expect("4"));
        if version != VERSION {
            return Err(invalid(format!("version {version}")));
        }
        let (chunk_size, chunks, file_len) = (word(8), word(16), word(24));
        if !chunk_size.is_power_of_two() || chunk_size < PAGE {
            return Err(invalid(format!("chunk size {chunk_size}")));
        }
        if chunks > MAX_CHUNKS || chunks != file_len.div_ceil(chunk_size) {
            return Err(invalid(format!("{chunks} chunks for {file_len} bytes")));
        }
        if file_len != memory_len {
            return Err(invalid(format!(
                "for a memory file of {file_len} bytes, not {memory_len}"
            )));
        }
        let len = map_len(chunks);
        let actual = file.metadata().map(|m| m.len()).unwrap_or(0);
        if actual < len {
            return Err(invalid(format!("{actual} bytes, not {len}")));
        }
        let ms = u32::from_le_bytes(head[36..40].try_into().expect("4"));
        // SAFETY: a fresh shared mapping of `len` bytes of a file at least
        // that long, readable and writable, at an address the kernel picks;
        // nothing else is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(file),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(LazyError::Io {
                path: name.to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(Self {
            base: base.cast(),
            len: len as usize,
            chunk_size,
            chunks,
            file_len,
            deadline: Duration::from_millis(u64::from(ms).clamp(100, 600_000)),
        })
    }

    /// The chunk size.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// The memory file's length.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    fn u32_at(&self, at: u64) -> &AtomicU32 {
        debug_assert!(at.is_multiple_of(4) && at + 4 <= self.len as u64);
        // SAFETY: `at` is a 4-aligned offset inside the mapping (a page
        // aligned base), which lives as long as `self`.
        unsafe { &*self.base.add(at as usize).cast::<AtomicU32>() }
    }

    fn state(&self) -> u32 {
        self.u32_at(STATE_AT).load(Ordering::Acquire)
    }

    /// Whether chunk `i` is in the memory file.
    pub fn is_present(&self, i: u64) -> bool {
        if i >= self.chunks {
            return false;
        }
        if self.state() == FetchState::Complete.word() {
            return true;
        }
        let at = BITS_AT + i / 8;
        // SAFETY: `at` is inside the mapping (i < chunks), which lives as
        // long as `self`.
        let byte = unsafe { &*self.base.add(at as usize).cast::<AtomicU8>() };
        byte.load(Ordering::Acquire) & (1 << (i % 8)) != 0
    }

    /// Posts chunk `i` as wanted.
    pub fn post_wanted(&self, i: u64) {
        let head = self.u32_at(HEAD_AT);
        let h = head.load(Ordering::Relaxed);
        let slot = SLOTS_AT + 8 * (h as usize % WANTED_SLOTS) as u64;
        // SAFETY: an 8-aligned slot inside the mapping.
        let slot = unsafe { &*self.base.add(slot as usize).cast::<AtomicU64>() };
        slot.store(i, Ordering::Relaxed);
        head.store(h.wrapping_add(1), Ordering::Release);
    }

    /// Waits until every chunk of bytes `offset..offset + len` of the
    /// memory file is present, posting each absent one as wanted (again
    /// every few ms while it waits, in case the pod missed it), up to the
    /// pod's deadline per chunk.
    pub fn wait_range(&self, offset: u64, len: u64) -> Result<(), WaitError> {
        if len == 0 {
            return Ok(());
        }
        let first = offset / self.chunk_size;
        let last = (offset.saturating_add(len) - 1) / self.chunk_size;
        for i in first..=last {
            self.wait(i)?;
        }
        Ok(())
    }

    /// Waits for chunk `i` (see [`VmmMap::wait_range`]).
    pub fn wait(&self, i: u64) -> Result<(), WaitError> {
        if i >= self.chunks {
            return Err(WaitError::OutOfRange {
                chunk: i,
                chunks: self.chunks,
            });
        }
        if self.is_present(i) {
            return Ok(());
        }
        let started = Instant::now();
        let mut posted = started;
        self.post_wanted(i);
        let mut nap = Duration::from_micros(20);
        loop {
            if self.is_present(i) {
                return Ok(());
            }
            if self.state() == FetchState::Failed.word() {
                return Err(WaitError::Failed { chunk: i });
            }
            let now = Instant::now();
            if now.duration_since(started) > self.deadline {
                return Err(WaitError::TimedOut {
                    chunk: i,
                    ms: self.deadline.as_millis() as u64,
                });
            }
            if now.duration_since(posted) > Duration::from_millis(5) {
                self.post_wanted(i);
                posted = now;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_micros(500));
        }
    }
}

impl Drop for VmmMap {
    fn drop(&mut self) {
        // SAFETY: the mapping this value made, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn pair(len: u64) -> (tempfile::TempDir, PodMap, VmmMap) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LAZY_MAP_FILE);
        let pod = PodMap::create(&path, MIB, len, Duration::from_millis(300)).unwrap();
        // The VMM maps it read-write.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let vmm = VmmMap::open(&f, "m", len).unwrap();
        (dir, pod, vmm)
    }

    #[test]
    fn present_bits_and_wanted_ring() {
        let (_d, mut pod, vmm) = pair(10 * MIB + 5);
        assert_eq!(pod.chunks(), 11);
        assert!(!vmm.is_present(3));
        vmm.post_wanted(3);
        vmm.post_wanted(7);
        vmm.post_wanted(3);
        assert_eq!(pod.take_wanted(), vec![3, 7]);
        assert!(pod.take_wanted().is_empty());
        pod.mark_present(3).unwrap();
        assert!(vmm.is_present(3) && !vmm.is_present(2));
        vmm.post_wanted(3);
        assert!(pod.take_wanted().is_empty(), "present ones are not wanted");
        assert_eq!(vmm.wait_range(3 * MIB, MIB), Ok(()));
        // A wait that the pod answers from another thread.
        let waiter = std::thread::scope(|s| {
            let h = s.spawn(|| vmm.wait_range(9 * MIB + 100, 2 * MIB - 100));
            let deadline = Instant::now() + Duration::from_secs(2);
            let mut got = Vec::new();
            while got.len() < 2 && Instant::now() < deadline {
                for i in pod.take_wanted() {
                    got.push(i);
                    pod.mark_present(i).unwrap();
                }
            }
            assert_eq!(got, vec![9, 10]);
            h.join().unwrap()
        });
        assert_eq!(waiter, Ok(()));
        pod.set_state(FetchState::Complete).unwrap();
        assert!(vmm.is_present(0));
    }

    /// A pod started again reopens the map its predecessor made: the
    /// VMM's bits stay as they were, the wanted chunks it posted before
    /// come first again, and a map of another memory file is refused.
    #[test]
    fn a_map_reopened_after_its_pod_stopped() {
        let (dir, mut pod, vmm) = pair(10 * MIB);
        pod.mark_present(1).unwrap();
        vmm.post_wanted(4);
        vmm.post_wanted(6);
        drop(pod);
        let path = dir.path().join(LAZY_MAP_FILE);
        let open = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap()
        };
        let mut again = PodMap::reopen(&path, open(), MIB, 10 * MIB).unwrap();
        assert_eq!(again.chunks(), 10);
        assert!(vmm.is_present(1), "what the pod before marked stays");
        assert!(!again.is_present(1), "not read back");
        assert_eq!(again.take_wanted(), vec![4, 6]);
        again.mark_present(4).unwrap();
        assert!(vmm.is_present(4));
        vmm.post_wanted(8);
        assert_eq!(again.take_wanted(), vec![8]);
        for (cs, len) in [(2 * MIB, 10 * MIB), (MIB, 11 * MIB), (MIB, 10 * MIB - 4096)] {
            let e = PodMap::reopen(&path, open(), cs, len).unwrap_err();
            assert!(matches!(e, LazyError::Invalid { .. }), "{e}");
        }
        std::fs::write(
            &path,
            b"not a map at all, but long enough to read a header from it",
        )
        .unwrap();
        assert!(PodMap::reopen(&path, open(), MIB, 10 * MIB).is_err());
    }

    #[test]
    fn waits_end_at_failure_or_deadline() {
        let (_d, pod, vmm) = pair(4 * MIB);
        let t = Instant::now();
        assert_eq!(vmm.wait(1), Err(WaitError::TimedOut { chunk: 1, ms: 300 }));
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert!(matches!(vmm.wait(4), Err(WaitError::OutOfRange { .. })));
        pod.set_state(FetchState::Failed).unwrap();
        assert_eq!(vmm.wait(2), Err(WaitError::Failed { chunk: 2 }));
    }

    /// What a hostile VMM can write: any head, any slot, a truncated file.
    #[test]
    fn hostile_vmm_values_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LAZY_MAP_FILE);
        let mut pod = PodMap::create(&path, MIB, 8 * MIB, Duration::from_secs(1)).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        // Slots past the chunk count, u64::MAX, and a head moved by 2^31.
        for (k, v) in [u64::MAX, 8, 1 << 40, 5].iter().enumerate() {
            f.write_all_at(&v.to_le_bytes(), SLOTS_AT + 8 * k as u64)
                .unwrap();
        }
        f.write_all_at(&(1u32 << 31).to_le_bytes(), HEAD_AT)
            .unwrap();
        // The head moved by 2^31: the ring's 64 slots are read, no more
        // (the untouched ones name chunk 0).
        let got = pod.take_wanted();
        assert_eq!(got, vec![5, 0], "only in-range slots, each once");
        assert!(pod.ignored >= 3, "{}", pod.ignored);
        // The head moved back: at most the ring is read.
        f.write_all_at(&7u32.to_le_bytes(), HEAD_AT).unwrap();
        assert!(pod.take_wanted().len() <= WANTED_SLOTS);
        // The present bits the VMM sets are never read back.
        f.write_all_at(&[0xff], BITS_AT).unwrap();
        assert!(!pod.is_present(0));
        // Truncated under the pod: nothing wanted, no fault, and marking
        // still works (the pod writes at its offsets).
        f.set_len(10).unwrap();
        assert!(pod.take_wanted().is_empty());
        pod.mark_present(2).unwrap();
        pod.mark_present(1 << 50).unwrap();
        assert!(pod.is_present(2) && !pod.is_present(1 << 50));
        // The path replaced by a link: the pod writes through its own
        // descriptor, never the path.
        let target = dir.path().join("victim");
        std::fs::write(&target, b"keep").unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        pod.mark_present(3).unwrap();
        pod.set_state(FetchState::Failed).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    }

    #[test]
    fn bad_maps_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LAZY_MAP_FILE);
        assert!(PodMap::create(&path, 1000, MIB, Duration::from_secs(1)).is_err());
        PodMap::create(&path, MIB, 4 * MIB, Duration::from_secs(1)).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let e = VmmMap::open(&f, "m", 8 * MIB).unwrap_err();
        assert!(e.to_string().contains("not 8388608"), "{e}");
        f.write_all_at(b"XXXX", 0).unwrap();
        assert!(VmmMap::open(&f, "m", 4 * MIB).is_err());
    }
}
