//! A small tmpfs mounted for a test's life (needs root), to run out of
//! space on purpose.

use std::path::{Path, PathBuf};

/// A tmpfs of `kib` KiB mounted at `dir` for the test's life, in the mount
/// namespace of process `pid` (a jailed VMM's: a mount made outside would
/// not show there; or this process's own, `std::process::id()`), owned by
/// that process's uid, mode 0700. Unmounted (lazily) on drop.
pub struct SmallDisk(PathBuf, u32);

/// Runs `f` on a thread that entered the mount namespace of `pid`.
fn in_mount_ns_of<T: Send + 'static>(pid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
    use std::os::fd::AsRawFd;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt")).unwrap();
    std::thread::spawn(move || {
        // SAFETY: flags and a descriptor we own; this thread only.
        unsafe {
            assert_eq!(libc::unshare(libc::CLONE_FS), 0);
            assert_eq!(libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS), 0);
        }
        f()
    })
    .join()
    .unwrap()
}

fn c_path(p: &Path) -> std::ffi::CString {
    std::ffi::CString::new(p.to_str().unwrap()).unwrap()
}

impl SmallDisk {
    pub fn mount(dir: &Path, kib: u64, pid: u32) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let uid: u32 = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|u| u.split_whitespace().next())
            .unwrap()
            .parse()
            .unwrap();
        let target = c_path(dir);
        let opts =
            std::ffi::CString::new(format!("size={kib}k,uid={uid},gid={uid},mode=0700")).unwrap();
        let ret = in_mount_ns_of(pid, move || {
            // SAFETY: NUL-terminated strings alive for the call.
            unsafe {
                libc::mount(
                    c"tmpfs".as_ptr(),
                    target.as_ptr(),
                    c"tmpfs".as_ptr(),
                    0,
                    opts.as_ptr().cast(),
                )
            }
        });
        assert_eq!(ret, 0, "this test mounts a small tmpfs (needs root)");
        SmallDisk(dir.to_path_buf(), pid)
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let target = c_path(&self.0);
        if std::path::Path::new(&format!("/proc/{}/ns/mnt", self.1)).exists() {
            // SAFETY: a NUL-terminated path alive for the call.
            in_mount_ns_of(self.1, move || unsafe {
                libc::umount2(target.as_ptr(), libc::MNT_DETACH)
            });
        }
    }
}
