//! The snapshot on-disk format: what a snapshot directory holds and how each
//! file is framed, checked and written.
//!
//! A snapshot directory holds two files (see `docs/snapshot-format.md`):
//!
//! - `state`: a 32-byte header (magic, format version, lengths, CRC32s)
//!   followed by a bincode-encoded payload, the `MicrovmState` of
//!   `vm_state.rs`. [`write_state`] / [`read_state`] frame and check it; the
//!   payload type is the caller's.
//! - `memory`: guest RAM laid out linearly, region after region in
//!   guest-physical order, 4 KiB pages; all-zero pages are holes. A diff
//!   snapshot's `memory` has the same length and layout but holds only the
//!   pages its state lists ([`PageRuns`]).
//!
//! Every file is written atomically (temporary file in the same directory,
//! fsync, rename, fsync of the directory), so a crash never leaves a
//! half-written file under its final name.

mod atomic;
mod format;
mod memory;
mod page_runs;
mod persist;

use std::path::PathBuf;

pub use format::{
    encode, read_state, read_state_bytes, read_state_with_header, write_state, StateHeader,
    FORMAT_MAJOR, FORMAT_MINOR, HEADER_LEN, MAGIC, MAX_STATE_BYTES,
};
pub use memory::{
    check_memory_file, read_page, read_pages, write_full_memory, write_memory_pages, MemoryFileInfo,
};
pub use page_runs::PageRuns;
pub use persist::Persist;

/// Size of a guest page in the memory file: page `p` is at byte `p * PAGE_SIZE`.
pub const PAGE_SIZE: u64 = 4096;

/// File name of the state file inside a snapshot directory.
pub const STATE_FILE: &str = "state";
/// File name of the memory file inside a snapshot directory.
pub const MEMORY_FILE: &str = "memory";

/// Everything that can go wrong reading or writing snapshot files. Every
/// variant names the file it is about.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("snapshot file {path} is truncated: expected {expected} bytes, found {actual}")]
    Truncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("{path} is not a torpor snapshot state file (bad magic)")]
    NotASnapshot { path: PathBuf },
    #[error(
        "snapshot state {path} has a corrupt header: header CRC32 {computed:#010x}, \
         header says {stored:#010x}"
    )]
    Corrupt {
        path: PathBuf,
        stored: u32,
        computed: u32,
    },
    #[error(
        "snapshot state {path} has format version {found_major}.{found_minor}; \
         this torpor reads {supported_major}.x"
    )]
    UnsupportedVersion {
        path: PathBuf,
        found_major: u16,
        found_minor: u16,
        supported_major: u16,
    },
    #[error(
        "snapshot state {path} has a payload of {len} bytes, more than the limit of {max} bytes"
    )]
    TooLarge { path: PathBuf, len: u64, max: u64 },
    #[error(
        "snapshot state {path} is corrupt: payload CRC32 {computed:#010x}, \
         header says {stored:#010x}"
    )]
    CrcMismatch {
        path: PathBuf,
        stored: u32,
        computed: u32,
    },
    #[error("snapshot state {path} has {actual} bytes, but its header accounts for {expected}")]
    TrailingData {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("cannot decode snapshot state {path}: {source}")]
    Decode {
        path: PathBuf,
        #[source]
        source: bincode::Error,
    },
    #[error("cannot encode snapshot state for {path}: {source}")]
    Encode {
        path: PathBuf,
        #[source]
        source: bincode::Error,
    },
    #[error("snapshot memory file {path} is missing")]
    MemoryFileMissing { path: PathBuf },
    #[error(
        "snapshot memory file {path} is {actual} bytes, but the snapshot's guest memory \
         is {expected} bytes"
    )]
    MemoryFileSize {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error(
        "cannot write snapshot memory {path}: guest memory region {index} is {len} bytes, \
         not a multiple of the {PAGE_SIZE}-byte page"
    )]
    UnalignedRegion {
        path: PathBuf,
        index: usize,
        len: u64,
    },
    #[error(
        "cannot write snapshot memory {path}: page {page} is beyond guest memory \
         ({total_pages} pages)"
    )]
    PageOutOfRange {
        path: PathBuf,
        page: u64,
        total_pages: u64,
    },
    /// A page of guest memory could not be read in (EFAULT: the file it
    /// maps is on a full filesystem such as a tmpfs, or was cut short).
    #[error(
        "cannot write snapshot memory {path}: guest memory region {index} has pages that \
         cannot be read ({source}); the files it maps are on a full filesystem or were \
         truncated"
    )]
    UnreadableMemory {
        path: PathBuf,
        index: usize,
        #[source]
        source: std::io::Error,
    },
}

impl SnapshotError {
    /// The file this error is about.
    pub fn path(&self) -> &std::path::Path {
        match self {
            SnapshotError::Io { path, .. }
            | SnapshotError::Truncated { path, .. }
            | SnapshotError::NotASnapshot { path }
            | SnapshotError::Corrupt { path, .. }
            | SnapshotError::UnsupportedVersion { path, .. }
            | SnapshotError::TooLarge { path, .. }
            | SnapshotError::CrcMismatch { path, .. }
            | SnapshotError::TrailingData { path, .. }
            | SnapshotError::Decode { path, .. }
            | SnapshotError::Encode { path, .. }
            | SnapshotError::MemoryFileMissing { path }
            | SnapshotError::MemoryFileSize { path, .. }
            | SnapshotError::UnalignedRegion { path, .. }
            | SnapshotError::PageOutOfRange { path, .. }
            | SnapshotError::UnreadableMemory { path, .. } => path,
        }
    }

    /// Classified for the pod: a host I/O failure (a full disk told apart)
    /// or a bad layer, named by its directory.
    pub fn vm_error(&self) -> torpor_vmm_api::VmError {
        use torpor_vmm_api::{ErrorKind, VmError};
        let layer = self.path().parent().unwrap_or(self.path());
        match self {
            // A layer that is not there is a broken chain, not a host fault.
            SnapshotError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                VmError::new(ErrorKind::BadSnapshot, self.to_string()).with_layer(layer)
            }
            SnapshotError::Io { source, .. } => {
                VmError::new(ErrorKind::of_io(source), self.to_string()).with_layer(layer)
            }
            // Out of space (or of memory) to back guest memory: 507, like
            // a full disk under the write.
            SnapshotError::UnreadableMemory { .. } => {
                VmError::new(ErrorKind::NoSpace, self.to_string()).with_layer(layer)
            }
            SnapshotError::Encode { .. }
            | SnapshotError::UnalignedRegion { .. }
            | SnapshotError::PageOutOfRange { .. } => VmError::internal(self.to_string()),
            _ => VmError::new(ErrorKind::BadSnapshot, self.to_string()).with_layer(layer),
        }
    }

    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        SnapshotError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Writing a snapshot: its files and disk overlay copies (open, write at
/// offsets, sync, rename, truncate, directories), and, for a full
/// snapshot, reading guest memory in first (madvise MADV_POPULATE_READ),
/// so that a page that cannot be read is an error, not a SIGBUS
/// (`memory.rs`).
pub(crate) fn write_syscalls(
    r: &mut crate::seccomp::Rules,
) -> Result<(), crate::seccomp::SeccompError> {
    r.allow(&[
        libc::SYS_openat,
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        libc::SYS_lseek,
        libc::SYS_fsync,
        libc::SYS_fdatasync,
        libc::SYS_ftruncate,
        libc::SYS_mkdir,
        libc::SYS_rename,
        libc::SYS_unlink,
        libc::SYS_statx,
        libc::SYS_newfstatat,
        libc::SYS_fstat,
        libc::SYS_readlink,
        libc::SYS_getcwd,
    ]);
    crate::seccomp::allow_fd_flags(r)?;
    r.allow_if(
        libc::SYS_madvise,
        &[crate::seccomp::Arg::Eq(2, libc::MADV_POPULATE_READ as u64)],
    )?;
    Ok(())
}

/// A fresh directory under the system temp dir, removed on drop.
#[cfg(test)]
pub(crate) struct TestDir(tempfile::TempDir);

#[cfg(test)]
impl TestDir {
    pub(crate) fn new(tag: &str) -> Self {
        let prefix = format!("torpor-snapshot-test-{tag}-");
        TestDir(tempfile::Builder::new().prefix(&prefix).tempdir().unwrap())
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }

    /// Names of every entry in the directory, sorted.
    pub(crate) fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.0.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}
