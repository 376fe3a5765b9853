//! The jail's file system, built in the VMM's own mount namespace: a small
//! tmpfs root on the spec's root directory, each exposed path bind-mounted
//! at its own path (read-only where asked; never suid, dev or exec), the
//! device nodes the VMM needs, a `/proc` of its pid namespace, then
//! `pivot_root` into it and the host's tree detached.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use torpor_vmm_api::jail::{Device, JailSpec};

use super::{sys, JailError};

/// A host device node's numbers, read before the host's `/dev` goes.
#[derive(Debug, Clone, Copy)]
pub struct DeviceNode {
    pub device: Device,
    pub rdev: libc::dev_t,
}

/// Reads the host nodes of `devices` (a missing one is an error: the VMM
/// would fail later with a worse message).
pub fn host_devices(devices: &[Device]) -> Result<Vec<DeviceNode>, JailError> {
    devices
        .iter()
        .map(|&device| {
            let meta = std::fs::metadata(device.path()).map_err(|e| JailError::Device {
                path: device.path(),
                source: e,
            })?;
            Ok(DeviceNode {
                device,
                rdev: meta.rdev() as libc::dev_t,
            })
        })
        .collect()
}

fn cstr(path: &Path) -> Result<CString, JailError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| JailError::BadPath(path.to_path_buf()))
}

fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), JailError> {
    let source_c = source.map(cstr).transpose()?;
    let target_c = cstr(target)?;
    let fstype_c = fstype.map(|f| CString::new(f).unwrap_or_default());
    let data_c = data.map(|d| CString::new(d).unwrap_or_default());
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a NUL-terminated string alive for
    // the call; mount(2) reads them only.
    let ret = unsafe {
        libc::mount(
            ptr(&source_c),
            target_c.as_ptr(),
            ptr(&fstype_c),
            flags,
            ptr(&data_c).cast(),
        )
    };
    sys(ret, || format!("mount {}", target.display()))
}

/// The jail path of host path `path` under the new root.
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// Builds the jail under `spec.root` and pivots into it. Runs as root in
/// a fresh mount namespace.
pub fn build(spec: &JailSpec, nodes: &[DeviceNode]) -> Result<(), JailError> {
    let root = spec.root.as_path();
    // The jail's directories get exactly the modes asked (the pod's umask
    // is 077); the VMM's own umask is set when it drops privileges.
    // SAFETY: umask takes and returns a mode only.
    unsafe { libc::umask(0) };
    // Nothing mounted here may propagate back to the host.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    mount(
        Some(Path::new("tmpfs")),
        root,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=0755,size=1m,nr_inodes=4096"),
    )?;
    // Parents before children: a read-only layer inside the writable
    // sandbox directory is mounted over it.
    let mut exposes = spec.exposes.clone();
    exposes.sort_by_key(|e| e.path.components().count());
    for e in &exposes {
        let target = under(root, &e.path);
        let meta = std::fs::metadata(&e.path).map_err(|source| JailError::Expose {
            path: e.path.clone(),
            source,
        })?;
        let made = if meta.is_dir() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(&target)
        } else {
            target
                .parent()
                .map_or(Ok(()), |p| {
                    std::fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o755)
                        .create(p)
                })
                .and_then(|()| {
                    std::fs::OpenOptions::new()
                        .create(true)
                        .truncate(false)
                        .write(true)
                        .open(&target)
                        .map(drop)
                })
        };
        made.map_err(|source| JailError::Expose {
            path: e.path.clone(),
            source,
        })?;
        mount(Some(&e.path), &target, None, libc::MS_BIND, None)?;
        let mut flags =
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        if e.read_only {
            flags |= libc::MS_RDONLY;
        }
        mount(None, &target, None, flags, None)?;
    }
    make_devices(spec, root, nodes)?;
    let proc_dir = root.join("proc");
    mkdir(&proc_dir, 0o555)?;
    // Its processes only (`subset=pid`, Linux 5.8): no /proc/net, whose
    // unix-socket table would list the sockets of every VMM sharing the
    // pod's network namespace, nor /proc/sys and the host-wide files. An
    // older kernel refuses the option: the whole /proc of its pid
    // namespace then.
    let proc_flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    let source = Some(Path::new("proc"));
    mount(
        source,
        &proc_dir,
        Some("proc"),
        proc_flags,
        Some("subset=pid"),
    )
    .or_else(|_| mount(source, &proc_dir, Some("proc"), proc_flags, None))?;
    pivot(root)
}

fn mkdir(path: &Path, mode: u32) -> Result<(), JailError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(path)
        .map_err(|source| JailError::Expose {
            path: path.to_path_buf(),
            source,
        })
}

/// The device nodes, owned by the jail's uid, mode 0600.
fn make_devices(spec: &JailSpec, root: &Path, nodes: &[DeviceNode]) -> Result<(), JailError> {
    mkdir(&root.join("dev"), 0o755)?;
    for node in nodes {
        let path = under(root, Path::new(node.device.path()));
        if let Some(parent) = path.parent() {
            mkdir(parent, 0o755)?;
        }
        let c = cstr(&path)?;
        // SAFETY: a NUL-terminated path alive for the call.
        let ret = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, node.rdev) };
        sys(ret, || format!("mknod {}", node.device.path()))?;
        // SAFETY: as above.
        let ret = unsafe { libc::chown(c.as_ptr(), spec.uid, spec.gid) };
        sys(ret, || format!("chown {}", node.device.path()))?;
    }
    Ok(())
}

/// `pivot_root` into `root`, the old root detached and its mount point
/// removed, the new root remounted read-only.
///
/// A host running from its initramfs (the nested host, some appliance
/// images) has the initial rootfs as `/`, which `pivot_root` refuses
/// (EINVAL). There the jail does what `switch_root` does: the jail's root
/// mount is moved over `/` and the process chroots into it. The host's
/// tree is then covered by the jail's root in this mount namespace, so
/// nothing of it is reachable by path; and the VMM keeps no descriptor
/// outside the jail and drops CAP_SYS_CHROOT with every other capability,
/// so it cannot chroot back out.
fn pivot(root: &Path) -> Result<(), JailError> {
    let old = root.join(".old-root");
    mkdir(&old, 0o700)?;
    let (new_c, old_c) = (cstr(root)?, cstr(&old)?);
    // SAFETY: two NUL-terminated paths alive for the call.
    let ret = unsafe { libc::syscall(libc::SYS_pivot_root, new_c.as_ptr(), old_c.as_ptr()) };
    if ret != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINVAL) && root_is_initramfs() {
            let _ = std::fs::remove_dir(&old);
            return move_root(root);
        }
        return Err(JailError::Sys {
            what: "pivot_root".into(),
            source: err,
        });
    }
    std::env::set_current_dir("/").map_err(|source| JailError::Sys {
        what: "chdir /".into(),
        source,
    })?;
    let old_in = c"/.old-root";
    // SAFETY: a NUL-terminated literal.
    let ret = unsafe { libc::umount2(old_in.as_ptr(), libc::MNT_DETACH) };
    sys(ret, || "detach the host's root".to_string())?;
    std::fs::remove_dir("/.old-root").map_err(|source| JailError::Sys {
        what: "remove the old root's mount point".into(),
        source,
    })?;
    remount_root_read_only()
}

/// Whether `/` is the kernel's initial rootfs (ramfs or tmpfs), which
/// cannot be pivoted away from.
fn root_is_initramfs() -> bool {
    use crate::fsmagic::{of_path, RAMFS_MAGIC, TMPFS_MAGIC};
    of_path(c"/").is_ok_and(|m| matches!(m, RAMFS_MAGIC | TMPFS_MAGIC))
}

/// `switch_root`'s way into `root` from an initramfs: move the jail's root
/// mount over `/`, chroot into it.
fn move_root(root: &Path) -> Result<(), JailError> {
    std::env::set_current_dir(root).map_err(|source| JailError::Sys {
        what: format!("chdir {}", root.display()),
        source,
    })?;
    mount(
        Some(Path::new(".")),
        Path::new("/"),
        None,
        libc::MS_MOVE,
        None,
    )?;
    // SAFETY: a NUL-terminated literal.
    let ret = unsafe { libc::chroot(c".".as_ptr()) };
    sys(ret, || "chroot into the jail".to_string())?;
    std::env::set_current_dir("/").map_err(|source| JailError::Sys {
        what: "chdir /".into(),
        source,
    })?;
    remount_root_read_only()
}

fn remount_root_read_only() -> Result<(), JailError> {
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC,
        None,
    )
}
