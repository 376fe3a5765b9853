//! Which filesystem a path or an open file lives on: statfs(2) magic
//! numbers (from <linux/magic.h>) and the two calls that read them.

use std::ffi::CStr;
use std::io;
use std::os::fd::AsRawFd;

pub const TMPFS_MAGIC: i64 = 0x0102_1994;
pub const RAMFS_MAGIC: i64 = 0x8584_58f6;
pub const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
pub const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;

/// The filesystem magic of `path`.
pub fn of_path(path: &CStr) -> io::Result<i64> {
    // SAFETY: `struct statfs` is plain integers, so all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` is a writable statfs that
    // outlives the call.
    if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// The filesystem magic of the open file `fd`.
pub fn of_fd(fd: &impl AsRawFd) -> io::Result<i64> {
    // SAFETY: as above.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is open for the borrow's length and `st` is a
    // writable statfs that outlives the call.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_and_an_open_file_are_told() {
        const PROC_SUPER_MAGIC: i64 = 0x9fa0;
        assert_eq!(of_path(c"/proc").unwrap(), PROC_SUPER_MAGIC);
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(of_fd(&f).unwrap(), PROC_SUPER_MAGIC);
        assert!(of_path(c"/no/such/path").is_err());
    }
}
