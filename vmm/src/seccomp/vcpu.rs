//! The vCPU threads' allow-list.
//!
//! A vCPU runs the guest (KVM_RUN) and handles its exits: port and MMIO
//! accesses to the emulated devices, virtio-blk requests (read and write
//! the disk image and overlay, which are already open), console output,
//! and eventfd writes that wake a device worker or raise an interrupt;
//! driver resets (a reset vsock device drops its host connections);
//! the tap's offloads when the guest's net driver starts or resets.
//! Snapshots read its state on its own thread while it is parked.

use super::ioctls;
use super::rules::{base, Arg, Rules};
use super::SeccompError;

pub fn rules() -> Result<Rules, SeccompError> {
    let mut r = base()?;
    r.allow(&[
        // Block requests: data at an offset, flushes.
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        libc::SYS_fdatasync,
        libc::SYS_fsync,
    ]);
    // A driver reset (Linux resets every virtio device when it probes it)
    // is handled on the vCPU that wrote the status register: vsock then
    // drops its host connections and takes their sockets out of its
    // worker's epoll set. Removal only; adding is the worker's own job.
    r.allow_if(
        libc::SYS_epoll_ctl,
        &[Arg::Eq(1, libc::EPOLL_CTL_DEL as u64)],
    )?;
    let mut requests = vec![ioctls::kvm_run()];
    requests.extend(ioctls::vcpu_save());
    // virtio-net: the tap's offloads follow what the guest negotiated,
    // set when it writes DRIVER_OK (or resets) on this thread.
    requests.push(ioctls::tun_set_offload());
    r.allow_values(libc::SYS_ioctl, 1, &requests)?;
    Ok(r)
}
