//! What a VMM started from a [`LaunchSpec`] needs from its jail: the
//! paths it reads and writes ([`Expose`]s) and the devices it opens. Apart
//! from the jail's own types (`jail.rs`), which a launch spec carries, so
//! that neither module imports the other both ways.

use std::path::{Path, PathBuf};

use crate::jail::{Device, Expose};
use crate::launch::{Console, KernelSource, LaunchMode, LaunchSpec, MemoryBackend, RestoreSpec};
use crate::lineage::Lineage;

/// What a VMM started from `spec` reads and writes, as exposes: the
/// directories it writes in (control socket, console, overlays, vsock
/// sockets) read-write, every layer of the snapshot's chain (from its
/// lineage record), kernel, initrd and disk image read-only, and
/// `/dev/shm` (read-only) for `uffd-shared`'s shmem templates. A restore that records
/// its working set writes beside the snapshot: that layer is read-write.
/// A standby shell's restore paths come with its restore request: see
/// the pod's standby pool.
pub fn exposes_for(spec: &LaunchSpec) -> Vec<Expose> {
    exposes_for_chain(spec, None)
}

/// [`exposes_for`] with a restore's chain given (`layers`, base first: one
/// the pod checked) instead of read from the snapshot's lineage record,
/// which the VMM that wrote the snapshot wrote too.
pub fn exposes_for_chain(spec: &LaunchSpec, layers: Option<&[PathBuf]>) -> Vec<Expose> {
    let mut out: Vec<Expose> = Vec::new();
    let mut add = |e: Expose| match out.iter_mut().find(|o| o.path == e.path) {
        Some(o) => o.read_only &= e.read_only,
        None => out.push(e),
    };
    let parent = |p: &Path| p.parent().unwrap_or(Path::new("/")).to_path_buf();
    if let Some(p) = &spec.control_socket {
        add(Expose::read_write(parent(p)));
    }
    if let Console::File { path, .. } = &spec.console {
        add(Expose::read_write(parent(path)));
    }
    match &spec.mode {
        LaunchMode::Boot {
            kernel,
            initrd,
            disk,
            vsock_uds,
            ..
        } => {
            if let KernelSource::Path(p) = kernel {
                add(Expose::read_only(p.clone()));
            }
            if let Some(p) = initrd {
                add(Expose::read_only(p.clone()));
            }
            if let Some(d) = disk {
                add(Expose::read_only(d.image.clone()));
                add(Expose::read_write(parent(&d.overlay)));
            }
            if let Some(p) = vsock_uds {
                add(Expose::read_write(parent(p)));
            }
        }
        LaunchMode::Restore {
            restore,
            record_working_set_ms,
            ..
        } => {
            for e in restore_exposes_of(restore, layers, record_working_set_ms.is_some()) {
                add(e);
            }
        }
        LaunchMode::Standby { .. } => {}
    }
    out
}

/// A restore's own paths as exposes (see [`exposes_for`]).
pub fn restore_exposes(restore: &RestoreSpec, writes_working_set: bool) -> Vec<Expose> {
    restore_exposes_of(restore, None, writes_working_set)
}

/// [`restore_exposes`] with the chain given (see [`exposes_for_chain`]).
pub fn restore_exposes_of(
    restore: &RestoreSpec,
    layers: Option<&[PathBuf]>,
    writes_working_set: bool,
) -> Vec<Expose> {
    let parent = |p: &Path| p.parent().unwrap_or(Path::new("/")).to_path_buf();
    let mut out = Vec::new();
    let layers = match layers {
        Some(l) => l.to_vec(),
        None => Lineage::read(&restore.snapshot)
            .map(|l| l.layers)
            .unwrap_or_else(|_| vec![restore.snapshot.clone()]),
    };
    for layer in layers {
        let top = layer == restore.snapshot;
        out.push(Expose {
            path: layer,
            read_only: !(top && writes_working_set),
        });
    }
    if let Some(p) = &restore.disk_overlay {
        out.push(Expose::read_write(parent(p)));
    }
    if let Some(p) = &restore.vsock_uds {
        out.push(Expose::read_write(parent(p)));
    }
    if let Some(p) = &restore.lazy_map {
        // The VMM posts wanted chunks in it.
        out.push(Expose::read_write(parent(p)));
    }
    if restore.backend == MemoryBackend::UffdShared {
        // The pod makes the shmem copies: see crate::shmem.
        out.push(Expose::read_only(crate::shmem::SHM_DIR));
    }
    out
}

/// The devices a VMM of `spec` opens.
pub fn devices_for(spec: &LaunchSpec) -> Vec<Device> {
    let uffd = match &spec.mode {
        LaunchMode::Restore { restore, .. } => restore.backend != MemoryBackend::File,
        // A shell's backend comes with its restore.
        LaunchMode::Standby { .. } => true,
        LaunchMode::Boot { .. } => false,
    };
    if uffd || spec.dirty_tracking.uffd_wp() {
        vec![Device::Kvm, Device::Userfaultfd]
    } else {
        vec![Device::Kvm]
    }
}
