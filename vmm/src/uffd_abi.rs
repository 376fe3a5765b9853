//! The userfaultfd and pagemap kernel ABI: the one place the VMM declares
//! it, and the ioctls every user of it shares.
//!
//! Ioctl numbers, argument structs and feature bits come from
//! `userfaultfd-sys` (generated from <linux/userfaultfd.h>, its Linux 5.13
//! set). What is newer is declared here by hand, with the kernel that added
//! it: the asynchronous write-protect features and `PAGEMAP_SCAN` (6.7),
//! `UFFDIO_CONTINUE_MODE_WP` (6.2), `/dev/userfaultfd` (6.1).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

pub use userfaultfd_sys::{
    uffdio_api, uffdio_continue, uffdio_copy, uffdio_range, uffdio_writeprotect, uffdio_zeropage,
    _UFFDIO_CONTINUE, _UFFDIO_COPY, _UFFDIO_WAKE, _UFFDIO_WRITEPROTECT, _UFFDIO_ZEROPAGE,
    UFFDIO_API, UFFDIO_CONTINUE, UFFDIO_COPY, UFFDIO_COPY_MODE_WP, UFFDIO_REGISTER_MODE_WP,
    UFFDIO_WAKE, UFFDIO_WRITEPROTECT, UFFDIO_WRITEPROTECT_MODE_WP, UFFDIO_ZEROPAGE, UFFD_API,
    UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_MINOR_HUGETLBFS, UFFD_FEATURE_MINOR_SHMEM,
    UFFD_FEATURE_MISSING_SHMEM, UFFD_FEATURE_PAGEFAULT_FLAG_WP, UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
};

/// Map write-protected with `UFFDIO_CONTINUE` (6.2).
pub const UFFDIO_CONTINUE_MODE_WP: u64 = 1 << 1;
/// Write-protect pages not yet populated (6.4).
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// `UFFDIO_POISON` (6.6).
pub const UFFD_FEATURE_POISON: u64 = 1 << 14;
/// Write-protect faults resolved by the kernel, recorded for
/// `PAGEMAP_SCAN` (6.7).
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
/// `UFFDIO_MOVE` (6.8).
pub const UFFD_FEATURE_MOVE: u64 = 1 << 16;
/// userfaultfd(2) flag: only faults from user mode.
pub const UFFD_USER_MODE_ONLY: libc::c_int = 1;
/// `_IO(0xAA, 0x00)` on /dev/userfaultfd: a new userfaultfd (6.1).
pub const USERFAULTFD_IOC_NEW: u64 = 0xAA00;

/// The bit of ioctl number `nr` (`_UFFDIO_*`) in the `ioctls` masks that
/// UFFDIO_API and UFFDIO_REGISTER answer.
pub const fn ioctl_bit(nr: u64) -> u64 {
    1 << nr
}

/// `_IOWR('f', 16, struct pm_scan_arg)` on /proc/PID/pagemap (<linux/fs.h>).
pub const PAGEMAP_SCAN: u64 = 0xc060_6610;
pub const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
pub const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;

/// `struct pm_scan_arg`.
#[repr(C)]
#[derive(Debug, Default)]
pub struct PmScanArg {
    pub size: u64,
    pub flags: u64,
    pub start: u64,
    pub end: u64,
    pub walk_end: u64,
    pub vec: u64,
    pub vec_len: u64,
    pub max_pages: u64,
    pub category_inverted: u64,
    pub category_mask: u64,
    pub category_anyof_mask: u64,
    pub return_mask: u64,
}

/// `struct page_region`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct PageRegion {
    pub start: u64,
    pub end: u64,
    pub categories: u64,
}

/// userfaultfd(2) with `flags` (O_CLOEXEC, O_NONBLOCK, UFFD_USER_MODE_ONLY).
pub fn new_userfaultfd(flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: userfaultfd(2) takes only flags and returns a new descriptor
    // (or -1), which is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The UFFDIO_API handshake asking for no feature: the kernel answers with
/// every feature it offers. The descriptor is then only good for that.
pub fn offered_features(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut api = uffdio_api {
        api: UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes one `struct uffdio_api` (`api`,
    // live for the call) on a descriptor the caller borrows to us.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut api as *mut uffdio_api) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(api.features)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_declared_layouts_match_the_kernel() {
        // <linux/fs.h>: 12 u64 and 3 u64.
        assert_eq!(std::mem::size_of::<PmScanArg>(), 96);
        assert_eq!(std::mem::size_of::<PageRegion>(), 24);
        // _IOWR('f', 16, 96 bytes).
        assert_eq!(
            PAGEMAP_SCAN,
            (3 << 30) | (96 << 16) | (b'f' as u64) << 8 | 16
        );
        assert_eq!(ioctl_bit(_UFFDIO_COPY), 1 << 3);
        assert_eq!(ioctl_bit(_UFFDIO_CONTINUE), 1 << 7);
    }
}
