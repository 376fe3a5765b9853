//! The userfaultfd page server: guest RAM of a restored microVM, filled lazily
//! from a template memory file and the diff layers laid over it.
//!
//! # Memory layout
//!
//! Guest RAM is one or more host mappings ([`Region`]s). Each covers a
//! contiguous range of the linear memory-file layout of `snapshot/`: page `p`
//! lives at byte `p * PAGE_SIZE` of every layer file, and a region starting at
//! page `first_page` maps pages `first_page..first_page + len / PAGE_SIZE`.
//!
//! # Layers
//!
//! [`Layers`] holds a base memory file (sparse: a hole reads as a zero page)
//! and zero or more diff layers, oldest first. A diff layer is a file with the
//! same layout plus the [`PageRuns`](crate::snapshot::PageRuns) it holds; the
//! newest diff holding a page wins, pages held by no diff come from the base.
//! Looking a page up is O(diffs × log runs).
//!
//! # Modes
//!
//! - [`Mode::Missing`]: the regions are private anonymous memory registered
//!   for MISSING faults. A fault reads the page from its layer and installs
//!   it with `UFFDIO_COPY`, or with `UFFDIO_ZEROPAGE` when it reads as zeros
//!   (a hole or a zero page; a write fault on a zero page gets a zeroed copy
//!   at once instead, which saves the copy-on-write fault that would follow).
//!   Every touched page is a private copy.
//! - [`Mode::Minor`] ("uffd-shared"): the base is a shmem file (memfd or a
//!   tmpfs file) and every region maps it `MAP_PRIVATE`. The regions are
//!   registered for MINOR *and* MISSING faults:
//!   - a base page present in the shared file raises a MINOR fault, answered
//!     by `UFFDIO_CONTINUE`: the clone maps the template's page-cache page
//!     read-only, and its first write copies it (kernel copy-on-write), so
//!     clones share every page they only read;
//!   - a hole of the base raises a MISSING fault, answered by
//!     `UFFDIO_ZEROPAGE` (or a zeroed `UFFDIO_COPY` on a write). Measured on
//!     kernel 6.18: without MISSING registration a read *or* a write of a hole
//!     through a private mapping allocates a zero page in the shared file
//!     (even one sealed with `F_SEAL_WRITE`), so clones would grow the
//!     template; `UFFDIO_ZEROPAGE`/`UFFDIO_COPY` on a private shmem mapping
//!     install anonymous pages and leave the file untouched;
//!   - a page held by a diff layer is installed with `UFFDIO_COPY` from the
//!     diff on whichever fault it raises (MINOR when the base has the page,
//!     MISSING when the base has a hole there), so it is a private copy and
//!     the template's page is never mapped. This costs nothing at start (no
//!     pre-population proportional to the diff) and works because the kernel
//!     accepts `UFFDIO_COPY` on a MINOR-registered private shmem mapping
//!     whose page-table entry is empty. Fault-around is disabled by the kernel
//!     on MINOR-registered mappings, so no template page is ever mapped
//!     without a fault.
//!
//!   The caller must not touch or populate a region before `start`
//!   (no `MAP_POPULATE`, no writes), or the kernel resolves those pages
//!   without asking the server. Seal the template memfd with
//!   `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE`: a fault past the end of a
//!   shmem file raises SIGBUS in the kernel before userfaultfd is consulted,
//!   so in this mode the server cannot report a truncated base.
//!
//! # Checks at start
//!
//! `start` is O(regions + diffs + host mappings), nothing proportional to
//! guest memory or to the prefetch list: regions aligned and disjoint (in
//! host addresses and in pages), the base long enough for every region, each
//! diff long enough for its page list, the base on shmem in minor mode, and,
//! from `/proc/self/maps`, that every region is what its mode needs (private
//! anonymous memory; or a private mapping of the base file at offset
//! `first_page * PAGE_SIZE`), because a mapping of the wrong file or at the
//! wrong offset would not fail but quietly serve the wrong pages.
//!
//! # Prefetch and working set
//!
//! [`ServerOptions::prefetch`] lists pages to install eagerly, in the given
//! order, in batches of up to [`PREFETCH_BATCH`] consecutive pages; between
//! batches the server polls the userfaultfd with a zero timeout and answers
//! pending faults first, so a vCPU never waits behind the prefetch.
//! [`ServerOptions::record_for`] records the pages that *fault* within that
//! window after `start` ([`PageServer::working_set`]); prefetched pages never
//! fault, so a caller that wants the next prefetch list takes the union of the
//! two. [`PageServer::installed`] lists every page installed since `start`,
//! by a fault or the prefetch, once each, in that order, for the whole run:
//! a snapshot's working set. With a base still arriving (a lazy wake), the
//! prefetch leaves out pages whose chunk is not there yet; they fault in.
//!
//! # Failure
//!
//! Any unexpected error (a short read because a layer file was truncated, an
//! ioctl failing with something other than `EEXIST`/`EAGAIN`, a fault outside
//! every region, the server thread panicking) calls `on_failure` once with a
//! message naming the page and the file, and the server stops answering. It
//! does *not* hand out made-up (zero) pages: the guest could act on them
//! (write a corrupted block to its disk) before the caller has stopped it.
//! A thread blocked in a fault the server will never answer stays blocked
//! until either
//! - a signal interrupts it: vCPU threads fault through KVM's GUP with
//!   `FOLL_INTERRUPTIBLE`, so the pause kick makes `KVM_RUN` return `EINTR`
//!   and the vCPU can be parked and stopped as usual (seen on the PVM host:
//!   a probe guest blocked in an unanswered fault paused in 0.3 ms and shut
//!   down cleanly); or
//! - the [`PageServer`] is dropped: closing the userfaultfd wakes every
//!   waiter and unregisters the ranges, after which the kernel resolves
//!   faults as for ordinary memory (zeros for anonymous memory, the file's
//!   page for a private file mapping). Stop the vCPUs before dropping.
//!
//! `on_failure` runs on the server thread: it must return promptly, must not
//! wait for vCPUs blocked in faults and must not drop the `PageServer`.
//!
//! # Kernel-mode faults and KVM
//!
//! The userfaultfd is created without `UFFD_USER_MODE_ONLY`: KVM reaches guest
//! memory through get_user_pages and device emulation through system calls,
//! and both fault in kernel mode. This needs `CAP_SYS_PTRACE` (root) or
//! access to `/dev/userfaultfd`. On the PVM host the probe guest ran with its
//! RAM served in each mode (minor over a zero-filled template: every fault a
//! CONTINUE; minor over a template of holes; missing) and printed the exact
//! checksum sequence, the template file unchanged. In minor mode a page the
//! guest first reads is mapped shared and read-only; a later guest write
//! takes a second fault that the kernel resolves by copy-on-write, without
//! the server.
//!
//! Pages installed by the server are not dirty in KVM's dirty log; only guest
//! writes are. A diff taken from the dirty log after a restore from a diff
//! chain therefore holds only the newly dirtied pages: the next snapshot must
//! keep (or merge) the older diffs.
//!
//! With [`ServerOptions::write_protect`] (uffd-wp dirty tracking, see
//! `crate::dirty`) the regions are also registered for asynchronous
//! write-protect faults and protected once at start; every fill then
//! installs the page protected unless a write fault asked for it, so
//! `PAGEMAP_SCAN` reports exactly the pages written after the restore.

mod installed;
mod layers;
mod regions;
pub(crate) mod server;
#[cfg(test)]
mod tests;

use std::time::Duration;

pub(crate) use installed::write_pages;
pub use installed::InstalledPages;
pub use layers::{Layers, Source};
pub use server::{PageServer, Stats};

/// Size of a page in guest memory and in every layer file.
pub const PAGE_SIZE: usize = crate::snapshot::PAGE_SIZE as usize;

/// Most pages installed by one prefetch step before pending faults are served.
pub const PREFETCH_BATCH: usize = 32;

/// How the regions are backed and which faults the server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Private anonymous memory, MISSING faults answered with
    /// `UFFDIO_COPY`/`UFFDIO_ZEROPAGE`.
    #[default]
    Missing,
    /// `MAP_PRIVATE` mappings of a shmem base file, MINOR faults answered with
    /// `UFFDIO_CONTINUE` (shared pages), MISSING faults (holes) with zero pages,
    /// diff pages with `UFFDIO_COPY`.
    Minor,
}

impl Mode {
    /// Short name for logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Missing => "missing",
            Mode::Minor => "minor",
        }
    }
}

/// One host mapping of guest RAM.
///
/// `host_addr` is an address (not a pointer) so that a `Region` can move to
/// the server thread; the mapping itself is the caller's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Start of the mapping; page-aligned.
    pub host_addr: usize,
    /// Length in bytes; a non-zero multiple of [`PAGE_SIZE`].
    pub len: usize,
    /// Page index, in the memory-file layout, of the region's first page.
    pub first_page: u64,
}

impl Region {
    /// Number of pages in the region.
    pub fn pages(&self) -> u64 {
        (self.len / PAGE_SIZE) as u64
    }

    /// One past the last page of the region, in the memory-file layout.
    pub fn end_page(&self) -> u64 {
        self.first_page + self.pages()
    }
}

/// What the server does beyond answering faults.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    pub mode: Mode,
    /// Pages (memory-file page indexes) to install eagerly, in this order,
    /// right after registration. Pages outside every region are skipped with
    /// a warning (a working set recorded for a different memory size).
    pub prefetch: Vec<u64>,
    /// Record the pages that fault within this long after `start`.
    pub record_for: Option<Duration>,
    /// Pages installed by `start` itself, on the calling thread, before it
    /// returns (counted as prefetched): pages the caller writes next, such
    /// as the identity page, then cost no fault round trip.
    pub install_first: Vec<u64>,
    /// Also register for asynchronous write-protect faults and install every
    /// page write-protected (unless a write fault asked for it), so that
    /// [`crate::dirty::WpTracker`] sees exactly the pages written after start
    /// (uffd-wp dirty tracking). Zero pages are then installed as copies of
    /// zeros, since `UFFDIO_ZEROPAGE` has no write-protect mode.
    pub write_protect: bool,
}

/// Called once, from the server thread, when the server fails.
pub type FailureHandler = Box<dyn Fn(String) + Send>;

/// Errors of [`PageServer::start`]. Failures after start go to `on_failure`.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    #[error(
        "cannot create a userfaultfd for {mode} mode: {reason} (the VMM needs root, \
         CAP_SYS_PTRACE or access to /dev/userfaultfd, since KVM faults on guest memory \
         in kernel mode; minor mode also needs a kernel with UFFD_FEATURE_MINOR_SHMEM, 5.13+)"
    )]
    Create { mode: &'static str, reason: String },
    #[error("no memory regions to serve")]
    NoRegions,
    #[error(
        "memory region {index} (host {addr:#x}, {len} bytes, first page {first_page}) \
         is invalid: {reason}"
    )]
    InvalidRegion {
        index: usize,
        addr: usize,
        len: usize,
        first_page: u64,
        reason: &'static str,
    },
    #[error("memory region {index} (host {addr:#x}) cannot be served in {mode} mode: {reason}")]
    WrongMapping {
        index: usize,
        addr: usize,
        mode: &'static str,
        reason: String,
    },
    #[error("memory regions {a} and {b} overlap ({what})")]
    OverlappingRegions {
        a: usize,
        b: usize,
        what: &'static str,
    },
    #[error(
        "cannot register memory region {index} (host {addr:#x}, {len} bytes) for {mode} \
         faults: {reason}{hint}"
    )]
    Register {
        index: usize,
        addr: usize,
        len: usize,
        mode: &'static str,
        hint: &'static str,
        reason: String,
    },
    #[error(
        "memory region {index} registered for {mode} faults lacks the {missing} ioctl \
         (kernel offers {offered:#x})"
    )]
    MissingIoctl {
        index: usize,
        mode: &'static str,
        missing: &'static str,
        offered: u64,
    },
    #[error("cannot inspect {file}: {source}")]
    Inspect {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "base memory file {file} is {len} bytes, but memory region {index} reaches \
         page {end_page} ({need} bytes)"
    )]
    BaseTooShort {
        file: String,
        len: u64,
        index: usize,
        end_page: u64,
        need: u64,
    },
    #[error(
        "diff layer {index} ({file}) is {len} bytes, but its page list reaches \
         page {end_page} ({need} bytes)"
    )]
    DiffTooShort {
        index: usize,
        file: String,
        len: u64,
        end_page: u64,
        need: u64,
    },
    #[error(
        "minor mode needs the base memory file on shmem (a memfd or a tmpfs file), \
         but {file} is on a filesystem of type {fs_type:#x}"
    )]
    BaseNotShmem { file: String, fs_type: i64 },
    #[error("cannot create the page server's stop eventfd: {0}")]
    StopEvent(#[source] std::io::Error),
    #[error("cannot start the page server thread: {0}")]
    Spawn(#[source] std::io::Error),
    #[error(transparent)]
    WriteProtect(crate::dirty::DirtyError),
    #[error("cannot install a page at start: {0}")]
    InstallFirst(String),
}
