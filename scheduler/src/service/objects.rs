//! Snapshot layers in the object store (`serve --object-store`, issue 29):
//! a hibernation's snapshot and a template's are uploaded through
//! torpor-storage (chunks, manifests: `storage/`), each layer once, and
//! recorded by directory in the store (`layer_objects`); a wake whose
//! snapshot is not on this pod's disk, and a pod adopting a sandbox or a
//! template another pod made, download the layer whole into its place.
//!
//! With an object store a hibernation writes a full snapshot: its layer
//! alone restores (the state names no parent directory of another pod),
//! and the store keeps the chunks it shares with the template's once.

use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_storage::{
    ChunkCache, DownloadReport, GcReport, ManifestId, Storage, StorageError, StoreConfig,
    UploadReport,
};
use torpor_sync::Locked;
use torpor_vmm_api::lineage::{Lineage, LINEAGE_FILE, STATE_FILE};

use super::{Service, ServiceError};
use crate::model::{PodId, Sandbox, SandboxId, Template, TemplateKind, TemplateState, Timestamp};
use crate::state::SandboxState;
use crate::store::SandboxFilter;

/// Why a layer could not be stored or fetched.
#[derive(Debug, thiserror::Error)]
pub enum ObjectStoreError {
    /// The store named by `--object-store` could not be opened.
    #[error("object store {url}: {source}")]
    Open {
        url: String,
        #[source]
        source: StorageError,
    },
    /// An upload or download of one layer failed (a corrupt or missing
    /// chunk names the manifest, the file and the chunk).
    #[error("snapshot layer {}: {source}", layer_name(dir))]
    Layer {
        dir: PathBuf,
        #[source]
        source: StorageError,
    },
    /// A layer fetched that is not a full snapshot: it would need layers
    /// of another pod under it.
    #[error("snapshot layer {}: {why}", layer_name(dir))]
    NotPortable { dir: PathBuf, why: String },
    /// An image stored, fetched, named or unnamed (`stored_images.rs`).
    #[error("image {name} in the object store: {source}")]
    Image {
        name: String,
        #[source]
        source: StorageError,
    },
    /// A local file of a layer being fetched.
    #[error("snapshot layer {}: {source}", layer_name(dir))]
    Io {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A manifest could not be deleted, or a collection failed.
    #[error("object store manifest {id}: {source}")]
    Manifest {
        id: String,
        #[source]
        source: StorageError,
    },
    /// The object store's runtime is gone (the service is closing).
    #[error("the object store's runtime stopped")]
    Stopped,
}

impl From<ObjectStoreError> for ServiceError {
    fn from(e: ObjectStoreError) -> Self {
        ServiceError::ObjectStore(Box::new(e))
    }
}

impl ObjectStoreError {
    /// Whether the store holds something wrong (a corrupt or missing chunk,
    /// a bad manifest, a layer that cannot move), rather than being
    /// unreachable for now.
    pub fn is_bad_layer(&self) -> bool {
        match self {
            Self::Layer { source, .. } | Self::Image { source, .. } => matches!(
                source,
                StorageError::ChunkCorrupt { .. }
                    | StorageError::ChunkMissing { .. }
                    | StorageError::ManifestNotFound { .. }
                    | StorageError::ManifestInvalid { .. }
                    | StorageError::BadManifestId(_)
            ),
            Self::NotPortable { .. } => true,
            _ => false,
        }
    }
}

/// A layer as errors name it: its owner's directory and its own
/// (`<sandbox id>/snap-3`), never the pod's host path.
fn layer_name(dir: &Path) -> String {
    let mut parts: Vec<String> = dir
        .components()
        .rev()
        .take(2)
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    parts.reverse();
    parts.join("/")
}

/// What a pass of [`Service::store_pending_hibernations`] did.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct PendingStored {
    /// Hibernations stored.
    pub stored: usize,
    /// Hibernations left for a later pass: their sandbox was busy.
    pub busy: usize,
}

/// When a hibernation is answered, with an object store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HibernateAck {
    /// Once its snapshot is durable in the object store: a pod lost for
    /// good loses no sandbox a client was told is hibernated.
    #[default]
    Stored,
    /// Once it is durable on the pod's disk; the upkeep thread uploads it
    /// right after (and every [`STORE_AGAIN_EVERY`] while the store
    /// fails). Faster answers, at a risk: until stored, the hibernated
    /// sandbox goes with its pod were the pod lost for good.
    Local,
}

/// A pod's object store: torpor-storage's [`Storage`] and the runtime its
/// requests run on (the service's calls are blocking).
pub struct ObjectStore {
    storage: Storage,
    ack: HibernateAck,
    /// A hibernation answered before its upload (`HibernateAck::Local`)
    /// asks the upkeep thread to store it now, not at its next pass.
    store_soon: std::sync::atomic::AtomicBool,
    runtime: Option<tokio::runtime::Runtime>,
    /// A lock per layer being stored ([`ObjectStore::layer_lock`]): two
    /// sandboxes of one template hibernating at once store its layer once.
    storing: std::sync::Mutex<HashMap<PathBuf, Arc<std::sync::Mutex<()>>>>,
    /// The images named in the store, as last listed
    /// (`stored_images.rs`).
    pub(super) image_names: super::stored_images::StoredNames,
    /// The manifests whose chunks placement's figures counted (`held.rs`).
    pub(super) known: super::held::KnownManifests,
    /// The layers of sandboxes this pod released (`held.rs`).
    pub(super) let_go: super::held::LetGo,
}

impl std::fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStore")
            .field("store", &self.storage.describe())
            .finish()
    }
}

impl Drop for ObjectStore {
    fn drop(&mut self) {
        // Allowed from any context, async or not.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl ObjectStore {
    /// Opens the store `url` names (`--object-store`: a directory, or
    /// `s3://bucket/prefix` with the usual AWS_* variables), its layers
    /// fetched through the pod's chunk cache `cache` (a directory and its
    /// bound in bytes; `--chunk-cache-mib`) when there is one.
    pub fn open(
        url: &str,
        ack: HibernateAck,
        cache: Option<(&Path, u64)>,
    ) -> Result<Self, ObjectStoreError> {
        let open = |source| ObjectStoreError::Open {
            url: url.to_string(),
            source,
        };
        let config = StoreConfig::parse(url).map_err(|e| open(e.into()))?;
        let mut storage = Storage::open(&config).map_err(open)?;
        if let Some((dir, limit)) = cache {
            storage = storage.with_cache(ChunkCache::open(dir, limit).map_err(open)?);
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("torpor-objects")
            .enable_all()
            .build()
            .map_err(|e| {
                open(StorageError::Io {
                    path: PathBuf::from(url),
                    source: e,
                })
            })?;
        Ok(Self {
            storage,
            ack,
            store_soon: Default::default(),
            runtime: Some(runtime),
            storing: Default::default(),
            image_names: Default::default(),
            known: Default::default(),
            let_go: Default::default(),
        })
    }

    /// Runs `f` holding layer `dir`'s lock; the lock's entry goes with its
    /// last holder.
    pub(super) fn with_layer_lock<T>(&self, dir: &Path, f: impl FnOnce() -> T) -> T {
        let lock = Arc::clone(self.storing.locked().entry(dir.to_path_buf()).or_default());
        let out = {
            // The guarded value is (): a poisoned lock guards nothing broken.
            let _held = lock.locked();
            f()
        };
        let mut storing = self.storing.locked();
        // Ours and the map's: no one else holds or waits for it (taking
        // another reference needs the map's lock, which this holds).
        if Arc::strong_count(&lock) == 2 {
            storing.remove(dir);
        }
        out
    }

    /// The store as its configuration prints.
    pub fn describe(&self) -> &str {
        self.storage.describe()
    }

    /// The store.
    pub(super) fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Starts `fut` on the store's runtime (a lazy wake's background
    /// fetch); nothing once the service is closing.
    pub(super) fn spawn(&self, fut: impl Future<Output = ()> + Send + 'static) {
        if let Some(rt) = &self.runtime {
            rt.spawn(fut);
        }
    }

    /// Runs `fut` on the store's runtime and waits for it (from any
    /// thread: no runtime is entered here).
    pub(super) fn run<T: Send + 'static>(
        &self,
        fut: impl Future<Output = T> + Send + 'static,
    ) -> Result<T, ObjectStoreError> {
        let rt = self.runtime.as_ref().ok_or(ObjectStoreError::Stopped)?;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().map_err(|_| ObjectStoreError::Stopped)
    }

    /// Uploads layer `dir`; durable once this returns.
    pub fn upload(&self, dir: &Path) -> Result<UploadReport, ObjectStoreError> {
        let (storage, d) = (self.storage.clone(), dir.to_path_buf());
        self.run(async move { storage.upload_layer(&d).await })?
            .map_err(|source| ObjectStoreError::Layer {
                dir: dir.to_path_buf(),
                source,
            })
    }

    /// Downloads layer `id` into `into` (made if missing).
    pub fn download(
        &self,
        id: &ManifestId,
        dir: &Path,
        into: &Path,
    ) -> Result<DownloadReport, ObjectStoreError> {
        let (storage, id, d) = (self.storage.clone(), id.clone(), into.to_path_buf());
        self.run(async move { storage.download_layer(&id, &d).await })?
            .map_err(|source| ObjectStoreError::Layer {
                dir: dir.to_path_buf(),
                source,
            })
    }
}

impl ObjectStore {
    /// Deletes manifest `id` (its chunks go with the next collection).
    pub fn delete_manifest(&self, id: &ManifestId) -> Result<bool, ObjectStoreError> {
        let (storage, m) = (self.storage.clone(), id.clone());
        self.run(async move { storage.delete_manifest(&m).await })?
            .map_err(|source| ObjectStoreError::Manifest {
                id: id.as_str().to_string(),
                source,
            })
    }

    /// A garbage collection: the chunks no manifest names deleted
    /// (torpor-storage's mark and sweep, safe against uploads).
    pub fn collect_garbage(&self) -> Result<GcReport, ObjectStoreError> {
        let storage = self.storage.clone();
        self.run(async move { storage.collect_garbage().await })?
            .map_err(|source| ObjectStoreError::Manifest {
                id: "(collection)".into(),
                source,
            })
    }
}

/// Where layer `dir` is fetched to before it is renamed into place (its
/// parent made, anything left there by an earlier fetch removed).
pub(super) fn fetch_temp(dir: &Path) -> std::io::Result<PathBuf> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let parent = dir.parent().unwrap_or(dir);
    std::fs::create_dir_all(parent)?;
    let temp = parent.join(format!(".{name}.fetch"));
    let _ = std::fs::remove_dir_all(&temp);
    Ok(temp)
}

/// Checks that the layer fetched into `temp` is a full snapshot (only
/// that restores alone) and rewrites its lineage for where it goes, `dir`
/// (the VMM that wrote it was elsewhere).
pub(super) fn make_portable(temp: &Path, dir: &Path) -> Result<(), ObjectStoreError> {
    let io = |source| ObjectStoreError::Io {
        dir: dir.to_path_buf(),
        source,
    };
    let text = std::fs::read(temp.join(LINEAGE_FILE)).map_err(io)?;
    let lineage: Lineage =
        serde_json::from_slice(&text).map_err(|e| ObjectStoreError::NotPortable {
            dir: dir.to_path_buf(),
            why: format!("its lineage: {e}"),
        })?;
    if lineage.depth() != 1 {
        return Err(ObjectStoreError::NotPortable {
            dir: dir.to_path_buf(),
            why: format!("a diff of {} layers, not a full snapshot", lineage.depth()),
        });
    }
    Lineage::base(dir)
        .write(temp)
        .map_err(|e| io(std::io::Error::other(e.to_string())))
}

/// How often a pod collects the object store's garbage.
const GC_EVERY: Duration = Duration::from_secs(3600);

/// How often a pod stores the hibernations not in the object store yet
/// (the first pass at its start).
const STORE_AGAIN_EVERY: Duration = Duration::from_secs(30);

/// Starts the thread that keeps the object store while the service runs:
/// at once and every [`STORE_AGAIN_EVERY`], the hibernations not stored
/// yet ([`Service::store_pending_hibernations`]); every [`GC_EVERY`], the
/// garbage collected.
pub(super) fn start_upkeep(service: &Arc<Service>) {
    let weak = Arc::downgrade(service);
    let stop = Arc::clone(&service.stop);
    let spawned = std::thread::Builder::new()
        .name("torpor-objects".into())
        .spawn(move || {
            let (mut stored_at, mut collected_at) = (None::<Instant>, Instant::now());
            loop {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let Some(service) = weak.upgrade() else {
                    return;
                };
                let Some(objects) = &service.objects else {
                    return;
                };
                let soon = objects.store_soon.swap(false, Ordering::SeqCst);
                if soon || stored_at.is_none_or(|t| t.elapsed() >= STORE_AGAIN_EVERY) {
                    // One held by its operation (a hibernation answered
                    // before its upload, still returning) is tried again
                    // at the next tick, not at the next pass.
                    if service.store_pending_hibernations().busy > 0 {
                        objects.store_soon.store(true, Ordering::SeqCst);
                    }
                    stored_at = Some(Instant::now());
                }
                if collected_at.elapsed() >= GC_EVERY {
                    match objects.collect_garbage() {
                        Ok(r) => tracing::info!(
                            chunks = r.chunks,
                            deleted = r.deleted,
                            bytes = r.deleted_bytes,
                            "object store collected"
                        ),
                        Err(e) => tracing::warn!("object store collection: {e}"),
                    }
                    collected_at = Instant::now();
                }
                drop(service);
                std::thread::sleep(Duration::from_secs(1));
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the object store's upkeep: {e}");
    }
}

impl Service {
    /// Stores every hibernation not in the object store yet: a pod stopped
    /// between a hibernation and its upload (the hibernation journaled,
    /// the upload never done), or a store down when it hibernated (its
    /// request answered the store's error, the sandbox hibernated on this
    /// pod's disk). Until stored, such a sandbox would go with this pod
    /// were it lost. A sandbox busy with another operation waits for the
    /// next pass. How many were stored, and how many were busy.
    pub(super) fn store_pending_hibernations(&self) -> PendingStored {
        let filter = SandboxFilter {
            states: vec![SandboxState::Hibernated],
            ..SandboxFilter::default()
        };
        let pending = match self.store.list_sandboxes(&filter) {
            Ok(list) => list,
            Err(e) => {
                tracing::warn!("cannot list the hibernations to store: {e}");
                return PendingStored::default();
            }
        };
        let mut out = PendingStored::default();
        for s in pending
            .iter()
            .filter(|s| !s.disk_only && s.snapshot.is_some() && s.stored_snapshot.is_none())
        {
            let Some(_guard) = self.locks.try_lock(&s.id) else {
                out.busy += 1;
                continue;
            };
            let now = self
                .store
                .get_sandbox(&s.id)
                .map_err(ServiceError::from)
                .and_then(|now| self.store_hibernation(now));
            match now {
                Ok(now) if now.stored_snapshot.is_some() => {
                    out.stored += 1;
                    tracing::info!(sandbox = %s.id, "a hibernation not stored yet is stored");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(sandbox = %s.id, "a hibernation not stored yet: {e}"),
            }
        }
        out
    }

    /// The manifests of the layers this pod uploaded whose files went
    /// (their sandbox or template deleted, an older hibernation of a
    /// sandbox that hibernated again), deleted from the object store;
    /// their chunks go with the next collection.
    pub(super) fn drop_dead_manifests(&self) {
        let Some(objects) = &self.objects else {
            return;
        };
        let dead = match self.store.forget_dead_layer_objects() {
            Ok(dead) => dead,
            Err(e) => {
                tracing::warn!("cannot list the stored layers that went: {e}");
                return;
            }
        };
        for m in dead {
            let deleted = ManifestId::parse(&m)
                .map_err(|e| e.to_string())
                .and_then(|id| objects.delete_manifest(&id).map_err(|e| e.to_string()));
            if let Err(e) = deleted {
                tracing::warn!(manifest = m, "cannot delete a stored layer's manifest: {e}");
            }
        }
    }

    /// Uploads layer `dir` to the object store unless it is there already
    /// (a layer never changes once written); its manifest, or None without
    /// an object store.
    pub(super) fn store_layer(&self, dir: &Path) -> Result<Option<String>, ServiceError> {
        let Some(objects) = &self.objects else {
            return Ok(None);
        };
        // Checked, uploaded and recorded under the layer's lock: another
        // hibernation storing the same layer (its template's) meanwhile
        // finds it recorded rather than uploading it a second time.
        objects.with_layer_lock(dir, || self.store_layer_locked(objects, dir))
    }

    fn store_layer_locked(
        &self,
        objects: &ObjectStore,
        dir: &Path,
    ) -> Result<Option<String>, ServiceError> {
        if let Some(m) = self.store.layer_object(dir)? {
            return Ok(Some(m));
        }
        let started = Instant::now();
        let uploaded = objects.upload(dir);
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        self.metrics.observe_upload(ms, uploaded.as_ref().ok());
        let report = uploaded?;
        tracing::info!(
            layer = %dir.display(),
            manifest = report.id.as_str(),
            bytes = report.data_bytes,
            new_bytes = report.new_bytes,
            sent = report.uploaded_bytes,
            ms = report.elapsed.as_millis() as u64,
            "snapshot layer stored"
        );
        self.store
            .record_layer_object(dir, report.id.as_str(), true)?;
        Ok(Some(report.id.as_str().to_string()))
    }

    /// Makes sure layer `dir` (a full snapshot) is on this pod's disk:
    /// downloaded whole from `manifest` when it is not, its lineage that of
    /// a full snapshot at `dir`. Whether it was fetched.
    pub(super) fn fetch_layer(&self, dir: &Path, manifest: &str) -> Result<bool, ServiceError> {
        if dir.join(STATE_FILE).exists() {
            return Ok(false);
        }
        let objects = self.objects.as_ref().ok_or_else(|| {
            ServiceError::Unsupported(format!(
                "snapshot layer {} is not on this pod and it has no object store \
                 (--object-store)",
                dir.display()
            ))
        })?;
        let id = ManifestId::parse(manifest)
            .map_err(|e| ServiceError::Internal(format!("layer {}: {e}", dir.display())))?;
        let io = |source| ObjectStoreError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        let temp = fetch_temp(dir).map_err(io)?;
        let started = Instant::now();
        let fetched = (|| -> Result<DownloadReport, ObjectStoreError> {
            let report = objects.download(&id, dir, &temp)?;
            make_portable(&temp, dir)?;
            std::fs::rename(&temp, dir).map_err(io)?;
            Ok(report)
        })();
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        self.metrics
            .observe_fetch(ms, fetched.as_ref().ok().map(|r| r.fetched_bytes));
        let report = match fetched {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&temp);
                return Err(e.into());
            }
        };
        tracing::info!(
            layer = %dir.display(),
            manifest,
            bytes = report.data_bytes,
            fetched = report.fetched_bytes,
            ms = report.elapsed.as_millis() as u64,
            "snapshot layer fetched from the object store"
        );
        self.store.record_layer_object(dir, manifest, false)?;
        Ok(true)
    }

    /// A template another pod built, stored in the object store: its
    /// snapshot fetched into this pod's template directory and the
    /// template registered here under the same id, ready. A template
    /// already here is answered as it is.
    pub fn adopt_template(&self, template: Template) -> Result<Template, ServiceError> {
        // One adoption at a time: two of one template (two sandboxes of it
        // moved at once) would fetch into the same place.
        static ADOPTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ADOPTING.locked();
        if let Ok(t) = self.store.get_template(&template.id) {
            if t.state != TemplateState::Deleted {
                return Ok(t);
            }
        }
        if template.kind != TemplateKind::Probe {
            // A Linux template's kernel and root filesystem are the
            // images of the pod that built it.
            return Err(ServiceError::Unsupported(format!(
                "template {}: only probe templates move between pods yet",
                template.id
            )));
        }
        let (Some(from), Some(manifest)) = (&template.snapshot_dir, &template.stored_snapshot)
        else {
            return Err(ServiceError::Unsupported(format!(
                "template {} is not in the object store",
                template.id
            )));
        };
        let dir = self
            .template_dir(&template.id)
            .join(from.file_name().unwrap_or_else(|| "snapshot".as_ref()));
        self.fetch_layer(&dir, manifest)?;
        // Each pod builds its own `probe`: another's keeps its id, and its
        // name if that is free here.
        let name = match self
            .store
            .template_name_conflict(template.tenant.as_deref(), &template.name)?
        {
            Some(_) => format!("{}@{}", template.name, template.id),
            None => template.name.clone(),
        };
        let here = Template {
            name,
            snapshot_dir: Some(dir.clone()),
            state: TemplateState::Ready,
            source: None,
            stored_snapshot: None,
            ..template
        };
        self.store.write(|tx| {
            tx.insert_template(&here)?;
            tx.register_layers(&[(dir.clone(), None)])?;
            tx.record_layer_object(&dir, manifest, false)
        })?;
        self.seal_shared(std::slice::from_ref(&dir))?;
        self.pool.want((here.mem_mib, here.vcpus));
        tracing::info!(template = %here.id, "adopted a template from the object store");
        Ok(self.store.get_template(&here.id)?)
    }

    /// A hibernated sandbox of another pod (one marked down for good),
    /// stored in the object store: its template adopted if this pod lacks
    /// it, its snapshot fetched into its directory here, and the sandbox
    /// registered here, hibernated (the next wake restores it). A sandbox
    /// already here is answered as it is.
    pub fn adopt_sandbox(
        &self,
        sandbox: Sandbox,
        template: Template,
    ) -> Result<Sandbox, ServiceError> {
        let _guard = self.lock_sandbox(&sandbox.id)?;
        if let Ok(s) = self.store.get_sandbox(&sandbox.id) {
            if s.state != SandboxState::Deleted {
                return Ok(s);
            }
        }
        if sandbox.state != SandboxState::Hibernated || sandbox.disk_only {
            return Err(ServiceError::Conflict {
                id: sandbox.id.to_string(),
                state: sandbox.state,
                message: "only a sandbox hibernated with its memory moves to another pod".into(),
            });
        }
        let (Some(from), Some(manifest)) = (&sandbox.snapshot, &sandbox.stored_snapshot) else {
            return Err(ServiceError::Unsupported(format!(
                "sandbox {}'s snapshot is not in the object store",
                sandbox.id
            )));
        };
        if template.id != sandbox.template {
            return Err(ServiceError::Invalid(format!(
                "sandbox {} is of template {}, not {}",
                sandbox.id, sandbox.template, template.id
            )));
        }
        let started = Instant::now();
        self.adopt_template(template)?;
        let dir = self
            .sandbox_dir(&sandbox.id)
            .join(from.file_name().unwrap_or_else(|| "snapshot".as_ref()));
        // With lazy wakes the wake that follows fetches it (its small files
        // and working set, the rest of its memory while the guest runs:
        // `snapshot_here`); else it is fetched whole now.
        if !self.lazy_wake() {
            self.fetch_layer(&dir, manifest)?;
        }
        let here = Sandbox {
            pod: Some(PodId::new(super::LOCAL_POD)),
            snapshot: Some(dir.clone()),
            stored_snapshot: None,
            vmm: None,
            restore: None,
            hibernation: None,
            network: None,
            usage: None,
            memory: None,
            last_active_at: Timestamp::now(),
            ..sandbox
        };
        // The layer's manifest is this pod's from now on (the pod it came
        // from disowns its copy's when it releases it): dropped here once
        // the layer goes, as a layer this pod uploaded.
        self.store.write(|tx| {
            tx.insert_sandbox(&here)?;
            tx.register_layers(&[(dir.clone(), None)])?;
            tx.record_layer_object(&dir, manifest, true)
        })?;
        tracing::info!(
            sandbox = %here.id,
            ms = started.elapsed().as_millis() as u64,
            "adopted a hibernated sandbox from the object store"
        );
        Ok(self.store.get_sandbox(&here.id)?)
    }

    /// A hibernation just taken, answered as `--hibernate-ack` says: stored
    /// now ([`Self::store_hibernation`]), or left to the upkeep thread,
    /// asked to store it at once.
    pub(super) fn hibernation_taken(&self, sandbox: Sandbox) -> Result<Sandbox, ServiceError> {
        match &self.objects {
            Some(o) if o.ack == HibernateAck::Local => {
                o.store_soon.store(true, Ordering::SeqCst);
                Ok(sandbox)
            }
            _ => self.store_hibernation(sandbox),
        }
    }

    /// A hibernated sandbox's snapshot, and its template's, uploaded to
    /// the object store unless they are there; the sandbox as it reads
    /// after (with its `stored_snapshot`). Without a store, as it is.
    pub(super) fn store_hibernation(&self, sandbox: Sandbox) -> Result<Sandbox, ServiceError> {
        let portable = self.objects.is_some()
            && sandbox.state == SandboxState::Hibernated
            && !sandbox.disk_only
            && sandbox.stored_snapshot.is_none();
        let Some(snapshot) = sandbox.snapshot.as_deref().filter(|_| portable) else {
            return Ok(sandbox);
        };
        // The template's too: a pod that adopts the sandbox needs it.
        if let Some(dir) = self.store.get_template(&sandbox.template)?.snapshot_dir {
            self.store_layer(&dir)?;
        }
        self.store_layer(snapshot)?;
        Ok(self.store.get_sandbox(&sandbox.id)?)
    }

    /// Forgets a sandbox that moved to another pod while this one was
    /// lost (a replica asks, `release`): hibernated, or running from the
    /// durable checkpoint it moved from (`durable.rs`), or failed here
    /// (its VMM died with the pod); deleted here (its
    /// VMM, if any, stopped), its files removed, the manifests of its
    /// snapshots left in the object store for the pod it moved to.
    pub fn release_sandbox(&self, id: &SandboxId) -> Result<(), ServiceError> {
        {
            let _guard = self.lock_sandbox(id)?;
            let s = self.store.get_sandbox(id)?;
            match s.state {
                SandboxState::Deleted => return Ok(()),
                // Failed: its VMM is gone (killed with the pod, found
                // dead at its restart): nothing here is newer than the
                // copy that moved.
                SandboxState::Hibernated | SandboxState::Failed => {}
                SandboxState::Running | SandboxState::Paused
                    if super::durable::has_durable_checkpoint(&s) => {}
                state => {
                    return Err(ServiceError::Conflict {
                        id: id.to_string(),
                        state,
                        message: "only a hibernated or failed sandbox, or one running from a \
                                  durable checkpoint, is released to another pod"
                            .into(),
                    })
                }
            }
            self.store.disown_layer_objects(&self.sandbox_dir(id))?;
            // What this pod's chunk cache keeps of it still counts for
            // placement (a move back).
            if let (Some(objects), Some(layer)) = (&self.objects, &s.stored_snapshot) {
                objects.let_go.remember(layer, id.as_str());
            }
        }
        tracing::warn!(sandbox = %id, "released a sandbox that moved to another pod");
        self.delete_sandbox(id)
    }

    /// The snapshot of `sandbox` (hibernated) on this pod's disk, fetched
    /// from the object store if it is not; the ms the fetch took, if one
    /// was needed.
    pub(super) fn snapshot_here(
        &self,
        id: &SandboxId,
        snapshot: &Path,
        stored: Option<&str>,
    ) -> Result<Option<f64>, ServiceError> {
        // A layer whose memory file never finished arriving is fetched
        // again.
        self.drop_partial_layer(id, snapshot);
        if snapshot.join(STATE_FILE).exists() {
            return Ok(None);
        }
        let Some(manifest) = stored else {
            return Err(ServiceError::Internal(format!(
                "sandbox {id}'s snapshot {} is gone and not in the object store",
                snapshot.display()
            )));
        };
        let started = Instant::now();
        if self.lazy_wake() {
            self.fetch_layer_lazy(id, snapshot, manifest)?;
        } else {
            self.fetch_layer(snapshot, manifest)?;
        }
        Ok(Some(started.elapsed().as_secs_f64() * 1000.0))
    }
}
