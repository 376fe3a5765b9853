//! Device workers' and helper threads' allow-lists.

use super::ioctls;
use super::rules::{allow_fd_flags, base, Arg, Rules};
use super::SeccompError;

/// The epoll loop every device worker runs: wait, read its eventfds,
/// signal interrupts (eventfd writes, in the base set).
fn event_loop() -> Result<Rules, SeccompError> {
    let mut r = base()?;
    r.allow(&[
        libc::SYS_epoll_wait,
        libc::SYS_epoll_pwait,
        libc::SYS_epoll_ctl,
        libc::SYS_read,
    ]);
    Ok(r)
}

/// virtio-vsock: moves packets between the guest's queues and unix
/// sockets (Firecracker's hybrid vsock): accepts on the host socket,
/// connects to `<uds>_PORT` for guest-initiated connections.
pub fn vsock_rules() -> Result<Rules, SeccompError> {
    let mut r = event_loop()?;
    r.allow(&[
        libc::SYS_accept4,
        libc::SYS_connect,
        libc::SYS_recvfrom,
        libc::SYS_sendto,
        libc::SYS_shutdown,
        libc::SYS_getsockopt,
        libc::SYS_setsockopt,
        // The device removes its host socket file when it ends, if the
        // file is still the one it bound (the thread holding the last
        // reference drops it).
        libc::SYS_statx,
        libc::SYS_newfstatat,
        libc::SYS_unlink,
    ]);
    allow_fd_flags(&mut r)?;
    // Unix sockets only: no path to the host's network.
    r.allow_if(libc::SYS_socket, &[Arg::Eq(0, libc::AF_UNIX as u64)])?;
    r.allow_values(libc::SYS_ioctl, 1, &[ioctls::fionbio()])?;
    Ok(r)
}

/// virtio-net: the event loop, and the tap's frames in and out
/// (readv/writev on the tap descriptor opened before the guest ran).
pub fn net_rules() -> Result<Rules, SeccompError> {
    let mut r = event_loop()?;
    r.allow(&[libc::SYS_readv, libc::SYS_writev]);
    Ok(r)
}

/// virtio-balloon: the event loop only. Discarding guest pages is
/// `madvise(MADV_DONTNEED)`, which the base list already allows (and
/// nothing else of madvise).
pub fn balloon_rules() -> Result<Rules, SeccompError> {
    event_loop()
}

/// The userfaultfd page server: reads fault events, fills pages from the
/// snapshot's memory files (pread) with UFFDIO_COPY/CONTINUE.
pub fn uffd_rules() -> Result<Rules, SeccompError> {
    let mut r = base()?;
    r.allow(&[
        libc::SYS_read,
        libc::SYS_poll,
        libc::SYS_ppoll,
        libc::SYS_pread64,
    ]);
    allow_fd_flags(&mut r)?;
    r.allow_values(libc::SYS_ioctl, 1, &ioctls::uffd_serve())?;
    Ok(r)
}

/// Writes a working-set file next to the snapshot (temp file, sync,
/// rename), after reading the previous one.
pub fn working_set_rules() -> Result<Rules, SeccompError> {
    let mut r = base()?;
    r.allow(&[
        libc::SYS_openat,
        libc::SYS_read,
        libc::SYS_lseek,
        libc::SYS_fsync,
        libc::SYS_rename,
        libc::SYS_unlink,
        libc::SYS_statx,
        libc::SYS_newfstatat,
        libc::SYS_fstat,
    ]);
    allow_fd_flags(&mut r)?;
    Ok(r)
}

/// Creates the console file: one write-only open.
pub fn console_open_rules() -> Result<Rules, SeccompError> {
    let mut r = base()?;
    r.allow_if(
        libc::SYS_openat,
        &[Arg::Masked(
            2,
            libc::O_ACCMODE as u64,
            libc::O_WRONLY as u64,
        )],
    )?;
    Ok(r)
}
