//! The snapshot chain a restore reads: the top state and every memory
//! layer under it, each checked before anything is mapped or served.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::builder::BuildError;
use crate::snapshot::{self, PageRuns, PAGE_SIZE};
use crate::vm_state::{MemoryLayer, MicrovmState};
use crate::vstate::memory::validate_mem_size;

use super::{RestoreError, MAX_CHAIN_DEPTH};

/// One memory layer of a chain, bottom (the full snapshot) first.
#[derive(Debug)]
pub struct LayerFile {
    pub dir: PathBuf,
    pub file: File,
    /// `None` for the full base layer.
    pub pages: Option<PageRuns>,
}

/// A snapshot to restore: the top state and every memory layer under it.
#[derive(Debug)]
pub struct SnapshotChain {
    pub top_dir: PathBuf,
    pub state: MicrovmState,
    /// Bottom (full) first, top last.
    pub layers: Vec<LayerFile>,
}

/// Reads and checks the snapshot at `dir` and every parent it names.
/// Nothing is mapped or run unless all of it is valid.
pub fn load_chain(dir: &Path) -> Result<SnapshotChain, RestoreError> {
    let top_dir = dir.to_path_buf();
    let state: MicrovmState = snapshot::read_state(&dir.join(snapshot::STATE_FILE))?;
    let mem_len = validate_mem_size(state.machine.mem_mib).map_err(BuildError::from)?;
    if state.vcpus.len() != usize::from(state.machine.vcpus) {
        return Err(RestoreError::VcpuCount {
            snapshot: top_dir,
            found: state.vcpus.len(),
            expected: state.machine.vcpus,
        });
    }
    let mut layers = Vec::new();
    let mut current = (top_dir.clone(), state.memory.clone());
    loop {
        if layers.len() >= MAX_CHAIN_DEPTH {
            return Err(RestoreError::ChainTooDeep(top_dir));
        }
        let (layer_dir, layer) = current;
        let file = snapshot::check_memory_file(&layer_dir.join(snapshot::MEMORY_FILE), mem_len)?;
        match layer {
            MemoryLayer::Full => {
                layers.push(LayerFile {
                    dir: layer_dir,
                    file,
                    pages: None,
                });
                break;
            }
            MemoryLayer::Diff { parent, pages } => {
                check_pages(&layer_dir, &pages, mem_len)?;
                let parent = if parent.is_absolute() {
                    parent
                } else {
                    layer_dir.join(parent)
                };
                let parent_state: MicrovmState =
                    snapshot::read_state(&parent.join(snapshot::STATE_FILE))?;
                if parent_state.machine.mem_mib != state.machine.mem_mib {
                    return Err(RestoreError::ParentMismatch {
                        child: layer_dir,
                        parent,
                        detail: format!(
                            "{} MiB vs {} MiB",
                            state.machine.mem_mib, parent_state.machine.mem_mib
                        ),
                    });
                }
                layers.push(LayerFile {
                    dir: layer_dir,
                    file,
                    pages: Some(pages),
                });
                current = (parent, parent_state.memory);
            }
        }
    }
    layers.reverse();
    Ok(SnapshotChain {
        top_dir,
        state,
        layers,
    })
}

/// A diff layer's pages, decoded from its state file, must be sorted,
/// disjoint and inside guest memory before anything maps or serves them.
fn check_pages(layer: &Path, pages: &PageRuns, mem_len: u64) -> Result<(), RestoreError> {
    let total = mem_len / PAGE_SIZE;
    let detail = if !pages.is_well_formed() {
        "runs not sorted, empty, touching or overflowing".to_string()
    } else if pages.end_page() > total {
        format!(
            "pages up to {} in {total} pages of memory",
            pages.end_page()
        )
    } else {
        return Ok(());
    };
    Err(RestoreError::BadPages {
        layer: layer.to_path_buf(),
        detail,
    })
}

/// A diff layer's pages come from its state file: they are checked before
/// anything maps or serves them (review of the fuzz target
/// snapshot_layers, which asserts this of every chain that loads).
#[cfg(test)]
mod page_checks {
    use super::*;

    fn runs(r: &[(u64, u64)]) -> PageRuns {
        bincode::deserialize(&bincode::serialize(&r.to_vec()).unwrap()).unwrap()
    }

    #[test]
    fn diff_pages_must_be_sorted_and_inside_memory() {
        let dir = Path::new("/snap");
        let mem = 64 * PAGE_SIZE;
        assert!(check_pages(dir, &runs(&[(0, 2), (10, 54)]), mem).is_ok());
        for bad in [
            &[(0, 65)][..],
            &[(u64::MAX, 2)],
            &[(10, 1), (2, 1)],
            &[(3, 0)],
        ] {
            let e = check_pages(dir, &runs(bad), mem).expect_err("bad runs accepted");
            assert!(matches!(e, RestoreError::BadPages { .. }), "{e}");
            assert_eq!(e.vm_error().kind, torpor_vmm_api::ErrorKind::BadSnapshot);
        }
    }
}
