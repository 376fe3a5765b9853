//! Where a diff snapshot's dirty pages come from.
//!
//! - [`DirtyTracking::Kvm`]: KVM's dirty log (`KVM_MEM_LOG_DIRTY_PAGES` on
//!   every memory slot, read and reset with `KVM_GET_DIRTY_LOG`).
//! - [`DirtyTracking::UffdWp`]: userfaultfd *asynchronous* write-protection
//!   (`UFFD_FEATURE_WP_ASYNC`, Linux 6.7+). Guest RAM is registered for WP
//!   faults and write-protected once; the kernel resolves a write to a
//!   protected page by itself (no round trip to user space) and leaves the
//!   page marked written. `PAGEMAP_SCAN` on `/proc/self/pagemap` with
//!   `PM_SCAN_WP_MATCHING` then lists the written pages and protects them
//!   again in one pass, which is what the next diff starts from. KVM reaches
//!   guest pages through get_user_pages, which breaks the protection like
//!   any other write, and the kernel's MMU notifier drops KVM's writable
//!   mappings when a page is protected again. With
//!   `UFFD_FEATURE_WP_UNPOPULATED`, pages not yet populated carry the
//!   protection too, so a page that is only read is not reported.
//! - [`DirtyTracking::Both`]: uffd-wp decides what the diff holds; KVM's
//!   dirty log is kept as well and each snapshot reports where the two
//!   differ. For tests and measurement.
//!
//! Measured on this host (kernel 6.18): asynchronous WP works on private
//! anonymous memory, on a `MAP_PRIVATE` mapping of a memfd and on a
//! `MAP_PRIVATE` mapping of an ext4 file, i.e. under every restore backend;
//! read-only touches are not reported in any of them.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};

use userfaultfd::{FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use crate::snapshot::{PageRuns, PAGE_SIZE};

use crate::uffd_abi::{
    new_userfaultfd, offered_features, uffdio_range, uffdio_writeprotect, PageRegion, PmScanArg,
    PAGEMAP_SCAN, PAGE_IS_WRITTEN, PM_SCAN_CHECK_WPASYNC, PM_SCAN_WP_MATCHING,
    UFFDIO_REGISTER_MODE_WP, UFFDIO_WRITEPROTECT, UFFDIO_WRITEPROTECT_MODE_WP,
    UFFD_FEATURE_WP_ASYNC, UFFD_FEATURE_WP_UNPOPULATED,
};

/// Page ranges read back per PAGEMAP_SCAN call (24 bytes each).
const SCAN_BATCH: usize = 8192;

pub use torpor_vmm_api::launch::DirtyTracking;

/// Errors of uffd-wp dirty tracking: each names why this host or mapping
/// cannot do it.
#[derive(Debug, thiserror::Error)]
pub enum DirtyError {
    #[error("uffd-wp dirty tracking needs a userfaultfd: {0} (root, CAP_SYS_PTRACE or /dev/userfaultfd)")]
    Userfaultfd(String),
    #[error(
        "uffd-wp dirty tracking needs asynchronous userfaultfd write-protection \
         (UFFD_FEATURE_WP_ASYNC and WP_UNPOPULATED, Linux 6.7+); this kernel offers \
         features {offered:#x}"
    )]
    NoWpAsync { offered: u64 },
    #[error("cannot register guest memory at {addr:#x} ({len} bytes) for write-protect faults: {reason}")]
    Register {
        addr: usize,
        len: usize,
        reason: String,
    },
    #[error("cannot write-protect guest memory at {addr:#x} ({len} bytes): {reason}")]
    Protect {
        addr: usize,
        len: usize,
        reason: String,
    },
    #[error("cannot open /proc/self/pagemap: {0}")]
    Pagemap(std::io::Error),
    #[error("PAGEMAP_SCAN of guest memory at {addr:#x} failed: {source}{hint}")]
    Scan {
        addr: usize,
        source: std::io::Error,
        hint: &'static str,
    },
}

/// The userfaultfd features this kernel offers (a UFFDIO_API handshake with
/// none requested, on a descriptor used for nothing else).
pub fn offered_uffd_features() -> Result<u64, DirtyError> {
    let fd = new_userfaultfd(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .map_err(|e| DirtyError::Userfaultfd(e.to_string()))?;
    offered_features(fd.as_fd()).map_err(|e| DirtyError::Userfaultfd(format!("UFFDIO_API: {e}")))
}

/// Checks that this kernel can track writes asynchronously; returns the
/// offered features.
pub fn check_wp_async() -> Result<u64, DirtyError> {
    let offered = offered_uffd_features()?;
    let need = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED;
    if offered & need != need {
        return Err(DirtyError::NoWpAsync { offered });
    }
    Ok(offered)
}

/// One host mapping of guest RAM: address, bytes, memory-file page of its
/// first page.
pub type Span = (usize, usize, u64);

/// The host spans of guest RAM, in memory-file page order.
pub fn guest_spans(mem: &vm_memory::GuestMemoryMmap) -> Vec<Span> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    let mut first_page = 0;
    mem.iter()
        .map(|r| {
            let span = (r.as_ptr() as usize, r.len() as usize, first_page);
            first_page += r.len() / PAGE_SIZE;
            span
        })
        .collect()
}

/// Reads (and resets) the pages written in guest RAM since the last read,
/// through PAGEMAP_SCAN. The ranges must be registered for asynchronous
/// write-protection (by [`WpTracker::start`] or by the page server).
pub struct WpTracker {
    pagemap: File,
    spans: Vec<Span>,
    /// The userfaultfd, when the tracker registered the memory itself.
    _uffd: Option<Uffd>,
}

impl std::fmt::Debug for WpTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WpTracker")
            .field("spans", &self.spans.len())
            .finish()
    }
}

impl WpTracker {
    /// Registers `spans` with a new userfaultfd for asynchronous
    /// write-protect faults only (allowed on any private mapping: anonymous,
    /// shmem or file) and protects all of it.
    ///
    /// # Safety
    ///
    /// Each span must be a live mapping of guest RAM that stays mapped as
    /// long as the tracker; no other userfaultfd may be registered on it.
    pub unsafe fn start(spans: Vec<Span>) -> Result<Self, DirtyError> {
        check_wp_async()?;
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            // KVM writes guest memory in kernel mode (get_user_pages).
            .user_mode_only(false)
            .require_features(FeatureFlags::from_bits_retain(
                UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED,
            ))
            .create()
            .map_err(|e| DirtyError::Userfaultfd(e.to_string()))?;
        for &(addr, len, _) in &spans {
            uffd.register_with_mode(
                addr as *mut libc::c_void,
                len,
                RegisterMode::from_bits_retain(UFFDIO_REGISTER_MODE_WP),
            )
            .map_err(|e| DirtyError::Register {
                addr,
                len,
                reason: e.to_string(),
            })?;
        }
        protect(&uffd, &spans)?;
        let mut tracker = Self::attach(spans)?;
        tracker._uffd = Some(uffd);
        Ok(tracker)
    }

    /// A tracker over ranges another userfaultfd (the page server's) has
    /// registered with write-protection. Checks (without resetting anything)
    /// that PAGEMAP_SCAN works on them, so a host without it is refused here
    /// rather than at the first diff.
    pub fn attach(spans: Vec<Span>) -> Result<Self, DirtyError> {
        let pagemap = File::open("/proc/self/pagemap").map_err(DirtyError::Pagemap)?;
        let tracker = Self {
            pagemap,
            spans,
            _uffd: None,
        };
        tracker.scan(false)?;
        Ok(tracker)
    }

    /// Pages written since the last call (or since start), in memory-file
    /// page numbers; protects them again.
    pub fn take_written(&self) -> Result<PageRuns, DirtyError> {
        self.scan(true)
    }

    /// Lists written pages; with `reset` protects them again, without it
    /// only checks the ranges (first page found only).
    fn scan(&self, reset: bool) -> Result<PageRuns, DirtyError> {
        let mut runs = PageRuns::default();
        let mut vec = vec![PageRegion::default(); if reset { SCAN_BATCH } else { 1 }];
        for &(addr, len, first_page) in &self.spans {
            let end = (addr + len) as u64;
            let mut start = addr as u64;
            while start < end {
                let mut arg = PmScanArg {
                    size: std::mem::size_of::<PmScanArg>() as u64,
                    flags: PM_SCAN_CHECK_WPASYNC | if reset { PM_SCAN_WP_MATCHING } else { 0 },
                    start,
                    end,
                    vec: vec.as_mut_ptr() as u64,
                    vec_len: vec.len() as u64,
                    max_pages: if reset { 0 } else { 1 },
                    category_mask: PAGE_IS_WRITTEN,
                    return_mask: PAGE_IS_WRITTEN,
                    ..Default::default()
                };
                // SAFETY: PAGEMAP_SCAN reads and writes one `struct
                // pm_scan_arg` (`arg`, live for the call) and writes at most
                // `vec_len` page_region entries into `vec`, which holds that
                // many. It only changes page protection inside the range,
                // which is registered guest RAM of this process.
                let n = unsafe {
                    libc::ioctl(
                        self.pagemap.as_raw_fd(),
                        PAGEMAP_SCAN as _,
                        &mut arg as *mut PmScanArg,
                    )
                };
                if n < 0 {
                    let source = std::io::Error::last_os_error();
                    let hint = match source.raw_os_error() {
                        Some(libc::ENOTTY) | Some(libc::EINVAL) => {
                            " (this kernel lacks PAGEMAP_SCAN, Linux 6.7+)"
                        }
                        Some(libc::EPERM) => {
                            " (the range is not registered for asynchronous write-protection)"
                        }
                        _ => "",
                    };
                    return Err(DirtyError::Scan { addr, source, hint });
                }
                for r in &vec[..n as usize] {
                    let first = first_page + (r.start - addr as u64) / PAGE_SIZE;
                    runs.push_run(first, (r.end - r.start) / PAGE_SIZE);
                }
                if !reset || arg.walk_end <= start {
                    break;
                }
                start = arg.walk_end;
            }
        }
        Ok(runs)
    }
}

/// Write-protects every span (unpopulated pages too, with WP_UNPOPULATED).
pub(crate) fn protect(uffd: &Uffd, spans: &[Span]) -> Result<(), DirtyError> {
    for &(addr, len, _) in spans {
        let mut arg = uffdio_writeprotect {
            range: uffdio_range {
                start: addr as u64,
                len: len as u64,
            },
            mode: UFFDIO_WRITEPROTECT_MODE_WP,
        };
        // SAFETY: UFFDIO_WRITEPROTECT reads one `struct uffdio_writeprotect`
        // (`arg`, live for the call); it only changes page protection in a
        // range registered with this userfaultfd (guest RAM).
        let ret = unsafe {
            libc::ioctl(
                uffd.as_raw_fd(),
                UFFDIO_WRITEPROTECT as _,
                &mut arg as *mut uffdio_writeprotect,
            )
        };
        if ret != 0 {
            return Err(DirtyError::Protect {
                addr,
                len,
                reason: std::io::Error::last_os_error().to_string(),
            });
        }
    }
    Ok(())
}

pub use torpor_vmm_api::control::Crosscheck;

/// Where KVM's log (`kvm`) and uffd-wp (`uffd_wp`) disagree.
pub fn crosscheck(kvm: &PageRuns, uffd_wp: &PageRuns) -> Crosscheck {
    let both = kvm.union(uffd_wp).page_count();
    Crosscheck {
        kvm_pages: kvm.page_count(),
        uffd_wp_pages: uffd_wp.page_count(),
        missed_by_uffd_wp: both - uffd_wp.page_count(),
        only_in_uffd_wp: both - kvm.page_count(),
    }
}

/// Reading (and resetting) the pages written since the last snapshot.
pub(crate) fn scan_syscalls(
    r: &mut crate::seccomp::Rules,
) -> Result<(), crate::seccomp::SeccompError> {
    r.allow_values(libc::SYS_ioctl, 1, &crate::seccomp::ioctls::dirty_scan())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = PAGE_SIZE as usize;

    struct Mapping {
        addr: *mut u8,
        len: usize,
    }

    impl Mapping {
        fn new(len: usize, fd: Option<&File>) -> Self {
            let (flags, fd) = match fd {
                Some(f) => (libc::MAP_PRIVATE, f.as_raw_fd()),
                None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
            };
            // SAFETY: a fresh mapping at an address the kernel picks.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags | libc::MAP_NORESERVE,
                    fd,
                    0,
                )
            };
            assert_ne!(addr, libc::MAP_FAILED);
            Self {
                addr: addr.cast(),
                len,
            }
        }

        fn write(&self, page: usize) {
            // SAFETY: `page` is inside this live mapping.
            unsafe { self.addr.add(page * PAGE).write_volatile(0x5a) }
        }

        fn read(&self, page: usize) -> u8 {
            // SAFETY: as above.
            unsafe { self.addr.add(page * PAGE).read_volatile() }
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: unmaps exactly what `new` mapped.
            unsafe { libc::munmap(self.addr.cast(), self.len) };
        }
    }

    fn runs(pages: &[(u64, u64)]) -> PageRuns {
        let mut r = PageRuns::default();
        for &(first, count) in pages {
            r.push_run(first, count);
        }
        r
    }

    /// Writes are reported once, reads never, and pages map to memory-file
    /// numbers through each span's first page.
    fn tracks_writes_only(mapping: &Mapping) {
        let spans = vec![
            (mapping.addr as usize, 64 * PAGE, 100),
            (mapping.addr as usize + 64 * PAGE, 64 * PAGE, 1000),
        ];
        // SAFETY: the spans are inside `mapping`, which outlives the tracker.
        let tracker = unsafe { WpTracker::start(spans) }.unwrap();
        assert_eq!(tracker.take_written().unwrap(), PageRuns::default());
        for p in 0..16 {
            mapping.read(p);
        }
        for p in [3, 4, 5, 63, 64, 70] {
            mapping.write(p);
        }
        assert_eq!(mapping.read(4), 0x5a);
        let first = tracker.take_written().unwrap();
        assert_eq!(first, runs(&[(103, 3), (163, 1), (1000, 1), (1006, 1)]));
        // Protected again: nothing new until the next write.
        assert_eq!(tracker.take_written().unwrap(), PageRuns::default());
        mapping.write(4);
        assert_eq!(tracker.take_written().unwrap(), runs(&[(104, 1)]));
    }

    #[test]
    fn anonymous_memory_reports_written_pages() {
        tracks_writes_only(&Mapping::new(128 * PAGE, None));
    }

    #[test]
    fn private_file_mapping_reports_written_pages() {
        let path = std::env::temp_dir().join(format!("torpor-wp-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, &[7u8; 4096], 0).unwrap();
        file.set_len(128 * PAGE as u64).unwrap();
        let mapping = Mapping::new(128 * PAGE, Some(&file));
        tracks_writes_only(&mapping);
        // Private: the file never sees the writes.
        let mut byte = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut byte, 3 * PAGE as u64).unwrap();
        assert_eq!(byte[0], 0);
    }

    #[test]
    fn a_range_without_wp_registration_is_refused() {
        let mapping = Mapping::new(16 * PAGE, None);
        mapping.write(0);
        let err = WpTracker::attach(vec![(mapping.addr as usize, 16 * PAGE, 0)]).unwrap_err();
        assert!(
            matches!(err, DirtyError::Scan { .. }),
            "unexpected error: {err}"
        );
    }

    #[test]
    fn crosscheck_counts_each_side() {
        let kvm = runs(&[(0, 10), (20, 1)]);
        let wp = runs(&[(0, 12)]);
        let c = crosscheck(&kvm, &wp);
        assert_eq!(c.kvm_pages, 11);
        assert_eq!(c.uffd_wp_pages, 12);
        assert_eq!(c.missed_by_uffd_wp, 1);
        assert_eq!(c.only_in_uffd_wp, 2);
    }

    #[test]
    fn names_round_trip() {
        for t in [
            DirtyTracking::Kvm,
            DirtyTracking::UffdWp,
            DirtyTracking::Both,
        ] {
            assert_eq!(DirtyTracking::parse(t.name()), Some(t));
        }
        assert_eq!(DirtyTracking::parse("soft-dirty"), None);
        assert!(DirtyTracking::Both.kvm_log() && DirtyTracking::Both.uffd_wp());
        assert!(!DirtyTracking::UffdWp.kvm_log());
    }
}
