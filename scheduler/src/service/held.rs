//! How much of each snapshot layer this pod holds (`serve
//! --object-store`), for a cluster's placement (`torpor-cluster`'s
//! `placement.rs`): each of its templates' layers and its hibernated
//! sandboxes' that is stored in the object store, by manifest, with its
//! stored chunks' bytes and how many of them are on this pod: all of a
//! layer whose files are whole on its disk, else those its chunk cache
//! holds (a layer still arriving after a lazy wake, or one whose files are
//! gone). A pod's heartbeat carries them, at most [`MAX_LAYERS_HELD`],
//! the most held first.
//!
//! A manifest's chunk list is read from the store once and kept in memory
//! (manifests never change), at most [`MAX_KNOWN`] of them.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use torpor_storage::{ChunkHash, ManifestId};
use torpor_sync::Locked;
use torpor_vmm_api::lineage::STATE_FILE;

use super::lazy::ARRIVING;
use super::objects::ObjectStore;
use super::{Service, ServiceError};
use crate::state::SandboxState;
use crate::store::SandboxFilter;

/// Most layers a heartbeat reports (about 120 bytes of JSON each: some
/// 30 KiB at most).
pub const MAX_LAYERS_HELD: usize = 256;

/// Most manifests' chunk lists kept in memory (dropped all at once past
/// it, and read again as needed).
const MAX_KNOWN: usize = 1024;

/// One snapshot layer a pod holds, and how much of it is on the pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerHeld {
    /// Its manifest in the object store.
    pub layer: String,
    /// The template or sandbox whose layer it is (its id).
    pub of: String,
    /// A template's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its stored chunks' bytes, uncompressed, each chunk once (holes
    /// left out).
    pub bytes: u64,
    /// Of them, those on this pod: on its disk or in its chunk cache.
    pub held: u64,
}

/// A manifest's chunks and their lengths.
type Chunks = Arc<Vec<(ChunkHash, u64)>>;

/// The manifests whose chunk lists this pod has read.
#[derive(Debug, Default)]
pub(super) struct KnownManifests(std::sync::Mutex<HashMap<String, Chunks>>);

impl ObjectStore {
    /// The chunks of manifest `id`, read from the store the first time.
    fn chunks_of(&self, id: &str) -> Result<Chunks, ServiceError> {
        if let Some(c) = self.known.0.locked().get(id) {
            return Ok(c.clone());
        }
        let mid = ManifestId::parse(id)
            .map_err(|e| ServiceError::Internal(format!("layer manifest {id}: {e}")))?;
        let storage = self.storage().clone();
        let manifest = self
            .run(async move { storage.manifest(&mid).await })?
            .map_err(|e| ServiceError::Internal(format!("layer manifest {id}: {e}")))?;
        let chunks: Chunks = Arc::new(manifest.chunk_lengths());
        let mut known = self.known.0.locked();
        if known.len() >= MAX_KNOWN {
            known.clear();
        }
        known.insert(id.to_string(), chunks.clone());
        Ok(chunks)
    }

    /// Layer `id` (at `dir` on this pod, if it has it there) as held here.
    fn held(&self, id: &str, dir: Option<&Path>) -> Result<(u64, u64), ServiceError> {
        let chunks = self.chunks_of(id)?;
        let bytes = chunks.iter().map(|(_, len)| len).sum();
        let whole = dir.is_some_and(|d| d.join(STATE_FILE).exists() && !d.join(ARRIVING).exists());
        let held = match (whole, self.storage().cache()) {
            (true, _) => bytes,
            (false, Some(cache)) => cache.cached_bytes(chunks.iter().map(|(h, _)| h)),
            (false, None) => 0,
        };
        Ok((bytes, held))
    }
}

impl Service {
    /// This pod's stored layers and how much of each it holds, at most
    /// `max`, the most held first; none without an object store. A layer
    /// whose manifest cannot be read now is left out (logged).
    pub fn layers_held(&self, max: usize) -> Result<Vec<LayerHeld>, ServiceError> {
        let Some(objects) = &self.objects else {
            return Ok(Vec::new());
        };
        let mut wanted = Vec::new();
        for t in self.store.list_templates(false)? {
            if let (Some(dir), Some(layer)) = (t.snapshot_dir, t.stored_snapshot) {
                wanted.push((layer, t.id.to_string(), Some(t.name), dir));
            }
        }
        let hibernated = SandboxFilter {
            states: vec![SandboxState::Hibernated],
            ..SandboxFilter::default()
        };
        for s in self.store.list_sandboxes(&hibernated)? {
            if let (Some(dir), Some(layer)) = (s.snapshot, s.stored_snapshot) {
                wanted.push((layer, s.id.to_string(), None, dir));
            }
        }
        let mut out = Vec::with_capacity(wanted.len());
        for (layer, of, name, dir) in wanted {
            match objects.held(&layer, Some(&dir)) {
                Ok((bytes, held)) => out.push(LayerHeld {
                    layer,
                    of,
                    name,
                    bytes,
                    held,
                }),
                Err(e) => tracing::debug!(layer, error = %e, "a layer's figures for placement"),
            }
        }
        out.sort_by(|a, b| b.held.cmp(&a.held).then_with(|| a.layer.cmp(&b.layer)));
        out.truncate(max);
        Ok(out)
    }
}
