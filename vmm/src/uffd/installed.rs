//! The pages a uffd-backed VM's page server installed since its restore,
//! written beside a snapshot (`torpor_vmm_api::lineage::TOUCHED_FILE`),
//! and the one writer of a page list file.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Weak};

use super::PageServer;

/// The pages a uffd-backed VM's page server installed since the restore
/// (by a fault or the prefetch), for a snapshot to record beside it.
/// Weak: the page server's life is the VM's memory's, not the snapshot
/// path's.
#[derive(Debug, Clone)]
pub struct InstalledPages(Weak<PageServer>);

impl InstalledPages {
    /// Those of `server`.
    pub fn of(server: &Arc<PageServer>) -> Self {
        Self(Arc::downgrade(server))
    }

    /// Writes them as `dir`'s `TOUCHED_FILE` (see
    /// [`PageServer::installed`]); the number of pages, or `None` when the
    /// page server is gone.
    pub fn write(&self, dir: &Path) -> std::io::Result<Option<usize>> {
        let Some(server) = self.0.upgrade() else {
            return Ok(None);
        };
        let pages = server.installed();
        drop(server);
        write_pages(dir, torpor_vmm_api::lineage::TOUCHED_FILE, &pages)?;
        Ok(Some(pages.len()))
    }
}

/// Writes `pages` (little-endian u64s) to `dir/name` atomically: a
/// temporary name, synced, then renamed.
pub(crate) fn write_pages(dir: &Path, name: &str, pages: &[u64]) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let mut f = File::create(&tmp)?;
    let bytes: Vec<u8> = pages.iter().flat_map(|p| p.to_le_bytes()).collect();
    f.write_all(&bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))
}
