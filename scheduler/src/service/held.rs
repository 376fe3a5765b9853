//! How much of each snapshot layer this pod holds (`serve
//! --object-store`), for a cluster's placement (`torpor-cluster`'s
//! `placement.rs`): each of its templates' layers and its hibernated
//! sandboxes' that is stored in the object store, by manifest, with its
//! stored chunks' bytes and how many of them are on this pod: all of a
//! layer whose files are whole on its disk, else those its chunk cache
//! holds (a layer still arriving after a lazy wake, or one whose files are
//! gone). A sandbox's layer this pod let go of (the sandbox moved to
//! another pod, which it released here) is still reported while its chunk
//! cache keeps some of it ([`LetGo`]): a move back finds those chunks
//! here. A pod's heartbeat carries them, at most [`MAX_LAYERS_HELD`], the
//! most held first.
//!
//! A manifest's chunk list is read from the store once and kept in memory
//! (manifests never change), at most [`MAX_KNOWN`] of them.

use std::collections::{HashMap, VecDeque};
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

/// Most layers let go of that are remembered ([`LetGo`]; the oldest
/// forgotten past it).
const MAX_LET_GO: usize = 256;

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

/// The layers this pod let go of (a released sandbox's, by its manifest
/// and the sandbox's id), the newest last, at most [`MAX_LET_GO`]: reported
/// by what the chunk cache still keeps of them, and forgotten once it
/// keeps none, the pod holds the layer again, or its manifest cannot be
/// read (deleted from the store, or the store unreachable then).
#[derive(Debug, Default)]
pub(super) struct LetGo(std::sync::Mutex<VecDeque<(String, String)>>);

impl LetGo {
    /// Layer `layer` (a manifest) of `of`, let go of now.
    pub(super) fn remember(&self, layer: &str, of: &str) {
        let mut all = self.0.locked();
        all.retain(|(l, _)| l != layer);
        if all.len() >= MAX_LET_GO {
            all.pop_front();
        }
        all.push_back((layer.to_string(), of.to_string()));
    }

    fn all(&self) -> Vec<(String, String)> {
        self.0.locked().iter().cloned().collect()
    }

    fn forget(&self, layer: &str) {
        self.0.locked().retain(|(l, _)| l != layer);
    }
}

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
        // Those let go of, the pod's chunk cache's only: none held here
        // (or held again, then among `wanted`) and they are forgotten.
        for (layer, of) in objects.let_go.all() {
            if wanted.iter().any(|w| w.0 == layer) {
                objects.let_go.forget(&layer);
                continue;
            }
            match objects.held(&layer, None) {
                Ok((_, 0)) => objects.let_go.forget(&layer),
                Ok((bytes, held)) => out.push(LayerHeld {
                    layer,
                    of,
                    name: None,
                    bytes,
                    held,
                }),
                Err(e) => {
                    tracing::debug!(layer, error = %e, "a layer let go of, for placement");
                    objects.let_go.forget(&layer);
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use torpor_storage::ManifestId;

    use super::super::lifecycle_tests::service_with;
    use super::*;
    use crate::model::{PodId, Sandbox};

    /// A sandbox that moved away (released here) leaves its layer's chunks
    /// in this pod's chunk cache: its layer is still reported, by what the
    /// cache keeps of it (before: not at all, its files gone).
    #[test]
    fn a_released_sandboxs_layer_counts_by_what_the_chunk_cache_keeps() {
        let objects_dir = tempfile::tempdir().unwrap();
        let url = objects_dir.path().to_str().unwrap().to_string();
        let (dir, service, template) = service_with(|c| c.object_store = Some(url));
        let objects = service.objects.as_ref().expect("an object store");
        // A layer stored from elsewhere: a state file and 1 MiB of memory.
        let made = dir.path().join("made");
        std::fs::create_dir_all(&made).unwrap();
        std::fs::write(made.join(STATE_FILE), b"a state").unwrap();
        let memory: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8 + 1).collect();
        std::fs::write(made.join("memory"), memory).unwrap();
        let manifest = objects.upload(&made).unwrap().id;
        // A sandbox hibernated here from it, fetched through the cache.
        let mut s = Sandbox::new(template.id.clone(), 64, 1, 60_000);
        let snap = service.sandbox_dir(&s.id).join("snap-1");
        objects
            .download(&manifest, &snap, &snap)
            .expect("the layer fetched");
        s.state = SandboxState::Hibernated;
        s.pod = Some(PodId::new(super::super::LOCAL_POD));
        s.snapshot = Some(snap.clone());
        service.store().insert_sandbox(&s).unwrap();
        service
            .store()
            .write(|tx| {
                tx.register_layers(&[(snap.clone(), None)])?;
                tx.record_layer_object(&snap, manifest.as_str(), true)
            })
            .unwrap();
        let layer = |all: &[LayerHeld]| {
            all.iter()
                .find(|l| l.layer == manifest.as_str())
                .cloned()
                .unwrap_or_else(|| panic!("{manifest} not reported: {all:?}"))
        };
        let whole = layer(&service.layers_held(MAX_LAYERS_HELD).unwrap());
        assert_eq!(whole.of, s.id.as_str());
        assert!(whole.bytes >= 1 << 20, "{whole:?}");
        assert_eq!(whole.held, whole.bytes);

        // Moved away: released here, its files gone, its chunks cached.
        service.release_sandbox(&s.id).unwrap();
        assert!(!snap.exists());
        let cached = layer(&service.layers_held(MAX_LAYERS_HELD).unwrap());
        assert_eq!(cached, whole);

        // Remembered layers are bounded, the oldest forgotten first.
        for i in 0..=MAX_LET_GO {
            objects.let_go.remember(&format!("m{i}"), "sbx");
        }
        let all = objects.let_go.all();
        assert_eq!(all.len(), MAX_LET_GO);
        assert!(!all
            .iter()
            .any(|(l, _)| *l == manifest.as_str() || l == "m0"));
        // Those whose manifests cannot be read are forgotten.
        let none = ManifestId::generate();
        objects.let_go.remember(none.as_str(), "sbx");
        let held = service.layers_held(MAX_LAYERS_HELD).unwrap();
        assert!(held.iter().all(|l| l.of != "sbx"), "{held:?}");
        assert!(objects.let_go.all().is_empty());
    }
}
