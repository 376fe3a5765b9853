//! Glue between a restore and the userfaultfd page server: regions from
//! guest memory, layers from the snapshot chain, the shmem template for
//! `uffd-shared`, working-set prefetch and recording.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::exit::{ExitReason, ExitSignal};
use crate::restore::{
    map_fixed_private, RestoreBackend, RestoreError, RestoreOptions, SnapshotChain,
};
use crate::snapshot::{self, PAGE_SIZE};
use crate::uffd::{InstalledPages, Layers, Mode, PageServer, Region, ServerOptions};

/// Longest working set we read back (a corrupt file must not eat memory)
/// or write.
use torpor_vmm_api::lineage::MAX_WORKING_SET_PAGES;
/// The working set recorded after a restore, next to the snapshot's state:
/// little-endian u64 page numbers.
pub use torpor_vmm_api::lineage::WORKING_SET_FILE;

fn backend_err(backend: RestoreBackend, reason: impl Into<String>) -> RestoreError {
    RestoreError::Backend {
        backend: backend.name(),
        reason: reason.into(),
    }
}

/// Reads a recorded working set; a missing file is an empty set.
pub fn read_working_set(dir: &Path) -> Vec<u64> {
    let path = dir.join(WORKING_SET_FILE);
    let Ok(bytes) = std::fs::read(&path) else {
        return Vec::new();
    };
    if bytes.len() as u64 > MAX_WORKING_SET_PAGES * 8 || bytes.len() % 8 != 0 {
        tracing::warn!("ignoring malformed working set {}", path.display());
        return Vec::new();
    }
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect()
}

/// The working sets of `chain`'s layers (templates' recorded windows),
/// newest first, each page once (at most [`MAX_WORKING_SET_PAGES`]). Not
/// the pages a sandbox's snapshot records it was given (`TOUCHED_FILE`):
/// a whole run's pages, prefetched, slowed wakes (docs/history.md).
fn chain_working_set(chain: &SnapshotChain) -> Vec<u64> {
    union_newest_first(chain.layers.iter().rev().map(|l| read_working_set(&l.dir)))
}

/// `sets` one after the other, each page once, at most
/// [`MAX_WORKING_SET_PAGES`].
fn union_newest_first(sets: impl Iterator<Item = Vec<u64>>) -> Vec<u64> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for page in sets.flatten() {
        if out.len() as u64 >= MAX_WORKING_SET_PAGES {
            break;
        }
        if seen.insert(page) {
            out.push(page);
        }
    }
    out
}

/// Writes a working set atomically (temp name, then rename).
pub(crate) fn write_working_set(dir: &Path, pages: &[u64]) -> std::io::Result<()> {
    crate::uffd::write_pages(dir, WORKING_SET_FILE, pages)
}

/// The shared shmem copy of the base memory file (see
/// [`torpor_vmm_api::shmem`]): opened when the pod made it (a jailed VMM
/// sees `/dev/shm` read-only), made here otherwise.
fn shmem_template(base: &File, base_path: &Path) -> Result<(File, PathBuf), RestoreError> {
    torpor_vmm_api::shmem::open_or_make(base).map_err(|e| {
        backend_err(
            RestoreBackend::UffdShared,
            format!("shmem copy of {}: {e}", base_path.display()),
        )
    })
}

/// What keeps a uffd-backed VM's memory served.
pub struct UffdMemory {
    server: Arc<PageServer>,
}

impl UffdMemory {
    /// What the VM's snapshots read their working set from.
    pub fn installed_pages(&self) -> InstalledPages {
        InstalledPages::of(&self.server)
    }
}

/// Starts serving the chain's pages into `mem`.
pub fn start(
    mem: &GuestMemoryMmap,
    chain: &SnapshotChain,
    opts: &RestoreOptions,
    exit: &ExitSignal,
) -> Result<UffdMemory, RestoreError> {
    let backend = opts.backend;
    let clone = |f: &File| {
        f.try_clone()
            .map_err(|e| backend_err(backend, format!("dup memory file: {e}")))
    };
    let (base_layer, diff_layers) = chain
        .layers
        .split_first()
        .expect("a chain has a base layer");
    let mut regions = Vec::new();
    let mut first_page = 0u64;
    for r in mem.iter() {
        regions.push(Region {
            host_addr: r.as_ptr() as usize,
            len: r.len() as usize,
            first_page,
        });
        first_page += r.len() / PAGE_SIZE;
    }
    let base = match backend {
        RestoreBackend::UffdShared => {
            let base_path = base_layer.dir.join(snapshot::MEMORY_FILE);
            let (shm, shm_path) = shmem_template(&base_layer.file, &base_path)?;
            for r in &regions {
                map_fixed_private(
                    r.host_addr as *mut u8,
                    r.len,
                    &shm,
                    r.first_page * PAGE_SIZE,
                    &shm_path,
                )?;
            }
            shm
        }
        _ => clone(&base_layer.file)?,
    };
    let mut diffs = Vec::with_capacity(diff_layers.len());
    for layer in diff_layers {
        let pages = layer.pages.clone().unwrap_or_default();
        diffs.push((clone(&layer.file)?, pages));
    }
    let mut layers = Layers::new(base, diffs);
    if let Some(path) = &opts.lazy_map {
        if backend != RestoreBackend::Uffd || !diff_layers.is_empty() {
            return Err(backend_err(
                backend,
                "a lazily fetched memory file needs the uffd backend and a full snapshot",
            ));
        }
        let memory_len = base_layer
            .file
            .metadata()
            .map_err(|e| backend_err(backend, format!("memory file: {e}")))?
            .len();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| backend_err(backend, format!("lazy map {}: {e}", path.display())))?;
        let map =
            torpor_vmm_api::lazy::VmmMap::open(&file, &path.display().to_string(), memory_len)
                .map_err(|e| backend_err(backend, e.to_string()))?;
        layers = layers.with_lazy_base(map);
    }
    let server_opts = ServerOptions {
        mode: if backend == RestoreBackend::UffdShared {
            Mode::Minor
        } else {
            Mode::Missing
        },
        prefetch: if opts.prefetch {
            chain_working_set(chain)
        } else {
            Vec::new()
        },
        record_for: opts.record_working_set_ms.map(Duration::from_millis),
        write_protect: opts.dirty_tracking.uffd_wp(),
        // The VMM writes the identity page right after this.
        install_first: vec![crate::identity::page_index()],
    };
    let exit = exit.clone();
    let on_failure = Box::new(move |msg: String| exit.exit(ExitReason::PageServerFailed(msg)));
    // SAFETY: the regions are this VM's guest RAM, untouched since they were
    // mapped (anonymous, or privately mapped from the shmem template), and
    // they stay mapped until the returned value (which owns the server) is
    // dropped after every vCPU has stopped.
    let server = unsafe { PageServer::start(regions, layers, server_opts, on_failure) }
        .map_err(|e| backend_err(backend, e.to_string()))?;
    let server = Arc::new(server);
    if let Some(ms) = opts.record_working_set_ms {
        spawn_recorder(
            Arc::downgrade(&server),
            chain.top_dir.clone(),
            Duration::from_millis(ms),
        );
    }
    Ok(UffdMemory { server })
}

/// After the recording window, saves the pages first touched in it next to
/// the snapshot, for `--prefetch` on later restores. Prefetched pages never
/// fault, so the saved set is the union with what was prefetched.
fn spawn_recorder(server: Weak<PageServer>, dir: PathBuf, after: Duration) {
    let spawned = std::thread::Builder::new()
        .name("working-set".into())
        .spawn(move || {
            crate::seccomp::enter(crate::seccomp::ThreadKind::WorkingSet);
            std::thread::sleep(after + Duration::from_millis(5));
            let Some(server) = server.upgrade() else {
                return;
            };
            let mut pages = server.working_set();
            pages.extend(read_working_set(&dir));
            pages.sort_unstable();
            pages.dedup();
            match write_working_set(&dir, &pages) {
                Ok(()) => tracing::info!(
                    pages = pages.len(),
                    "recorded working set in {}",
                    dir.display()
                ),
                Err(e) => tracing::warn!("cannot record working set in {}: {e}", dir.display()),
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the working-set recorder: {e}");
    }
}

/// The working-set recorder's thread: reads the previous set, writes the
/// new one next to the snapshot (temp file, sync, rename).
pub(crate) fn working_set_syscalls(
    r: &mut crate::seccomp::Rules,
) -> Result<(), crate::seccomp::SeccompError> {
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
    crate::seccomp::allow_fd_flags(r)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_are_joined_newest_first_each_page_once() {
        let newest = tempfile::tempdir().unwrap();
        let template = tempfile::tempdir().unwrap();
        write_working_set(newest.path(), &[40, 7, 41, 2]).unwrap();
        write_working_set(template.path(), &[1, 2, 3, 7]).unwrap();
        assert_eq!(read_working_set(newest.path()), vec![40, 7, 41, 2]);
        let none = tempfile::tempdir().unwrap();
        let sets = [newest.path(), none.path(), template.path()].map(read_working_set);
        assert_eq!(
            union_newest_first(sets.into_iter()),
            vec![40, 7, 41, 2, 1, 3]
        );
    }
}
