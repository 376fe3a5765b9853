//! The main thread's and the control server's allow-lists.
//!
//! Once the VM runs, the main thread only waits for its end, stops the
//! vCPUs (kick signals) and cleans up. The control server accepts on its
//! socket and answers status, pause/resume and snapshot requests: it
//! reads VM-wide KVM state, kicks vCPUs, reads guest memory in before a
//! full snapshot (madvise MADV_POPULATE_READ), and writes snapshot files
//! (open, write, sync, rename) and disk overlay copies.

use super::ioctls;
use super::rules::{allow_fd_flags, base, Arg, Rules};
use super::SeccompError;
use crate::signals::vcpu_kick;

pub fn main_rules() -> Result<Rules, SeccompError> {
    let mut r = base()?;
    r.allow(&[
        // The exit eventfd.
        libc::SYS_read,
        // The answer to a standby's restore request (socket writes are
        // send(MSG_NOSIGNAL)).
        libc::SYS_sendto,
        // The control socket's file, removed at the end.
        libc::SYS_unlink,
    ]);
    r.allow_values(libc::SYS_tgkill, 2, &[vcpu_kick() as u64])?;
    // That answer carries the VM status, with the guest clock.
    r.allow_values(libc::SYS_ioctl, 1, &[ioctls::kvm_get_clock()])?;
    Ok(r)
}

pub fn control_rules() -> Result<Rules, SeccompError> {
    let mut r = base()?;
    r.allow(&[
        // The control socket.
        libc::SYS_accept4,
        libc::SYS_read,
        libc::SYS_recvfrom,
        libc::SYS_sendto,
        libc::SYS_setsockopt,
        // Snapshot files and disk overlay copies.
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
    allow_fd_flags(&mut r)?;
    // A full snapshot reads guest memory in first, so that a page that
    // cannot be read is an error, not a SIGBUS (snapshot/memory.rs).
    r.allow_if(
        libc::SYS_madvise,
        &[Arg::Eq(2, libc::MADV_POPULATE_READ as u64)],
    )?;
    r.allow_values(libc::SYS_tgkill, 2, &[vcpu_kick() as u64])?;
    let mut requests = ioctls::vm_read();
    requests.extend(ioctls::dirty_scan());
    r.allow_values(libc::SYS_ioctl, 1, &requests)?;
    Ok(r)
}
