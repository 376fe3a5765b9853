//! Lazy cold wakes (`serve --lazy-wake`, issue 29): a wake whose snapshot
//! is only in the object store downloads the layer's small files (state,
//! lineage, working set), makes its memory file at full length (a hole),
//! fetches the first chunks of the recorded working set, and restores; the
//! rest of the memory file arrives in the background while the guest runs,
//! the working set's other chunks first.
//! The pod and the VMM share a map file in the sandbox's directory
//! (`torpor_vmm_api::lazy`): a present bit per chunk, which the pod sets
//! once a chunk is written, checked; and a ring of wanted chunks, which
//! the VMM's page server posts a fault's chunk into and the pod fetches
//! before any other.
//!
//! A fetch that fails (the store cut, a corrupt chunk) marks the map
//! failed: a fault waiting for a chunk fails the restore at once. During
//! the wake, the wake fails with the store's error naming the layer and
//! the sandbox stays hibernated; after it answered, the sandbox's VMM is
//! stopped and the sandbox goes back to its hibernation (what the guest
//! did since the wake is lost, its stored snapshot is not). Either way
//! the layer's local copy goes and the next wake fetches it again.
//!
//! A layer whose memory file is still arriving holds an [`ARRIVING`]
//! marker, removed once every chunk is written and synced: a layer left
//! by a crash mid-fetch is fetched again rather than restored with holes.
//! A hibernation waits for its sandbox's memory file to arrive first.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use torpor_storage::{LazyFile, ManifestId, StorageError};
use torpor_sync::Locked;
use torpor_vmm_api::lazy::{FetchState, PodMap, LAZY_MAP_FILE};
use torpor_vmm_api::lineage::{MAX_WORKING_SET_PAGES, TOUCHED_FILE, WORKING_SET_FILE};

use super::objects::ObjectStoreError;
use super::{Service, ServiceError};
use crate::model::{Sandbox, SandboxId};
use crate::state::SandboxState;

/// In a layer whose memory file is still arriving.
pub(super) const ARRIVING: &str = ".arriving";
/// The memory file of a snapshot layer.
const MEMORY_FILE: &str = "memory";
/// How long a fault waits for its chunk before the restore fails.
const FAULT_DEADLINE: Duration = Duration::from_secs(20);
/// Chunks fetched at once in the background, in order.
const BACKGROUND: usize = 8;
/// Wanted chunks fetched at once beside them.
const WANTED: usize = 8;
/// How often the background fetch looks at the wanted ring while its
/// fetches are in flight.
const WANTED_POLL: Duration = Duration::from_millis(1);
/// Most bytes of the working set's chunks fetched before the restore; its
/// other chunks come first in the background (a large set fetched whole
/// first would make the wake wait for about all of the memory, as an
/// eager one does).
const BEFORE_RESTORE_BYTES: u64 = 4 << 20;

/// How an arrival ended.
enum Outcome {
    /// Every chunk written and synced: the bytes fetched in the background.
    Done { bytes: u64 },
    /// The error (taken by the first who reports it) and its text.
    Failed(Option<StorageError>, String),
}

/// One memory file arriving.
pub(super) struct Arrival {
    /// The layer.
    dir: PathBuf,
    /// The map file shared with the VMM.
    map: PathBuf,
    manifest: String,
    outcome: Mutex<Option<Outcome>>,
    ended: Condvar,
    cancel: AtomicBool,
}

impl Arrival {
    fn end(&self, outcome: Outcome) {
        *self.outcome.locked() = Some(outcome);
        self.ended.notify_all();
    }

    fn failed(&self) -> bool {
        matches!(*self.outcome.locked(), Some(Outcome::Failed(..)))
    }
}

/// The memory files arriving, by sandbox.
#[derive(Default)]
pub(super) struct Arrivals(Mutex<HashMap<SandboxId, Arc<Arrival>>>);

impl std::fmt::Debug for Arrivals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.locked().keys().map(|id| id.as_str().to_string()))
            .finish()
    }
}

impl Arrivals {
    fn get(&self, id: &SandboxId) -> Option<Arc<Arrival>> {
        self.0.locked().get(id).cloned()
    }

    /// Drops `id`'s arrival (the one given, if any), stopping its fetch.
    fn remove(&self, id: &SandboxId, only: Option<&Arc<Arrival>>) -> Option<Arc<Arrival>> {
        let mut all = self.0.locked();
        if let (Some(a), Some(cur)) = (only, all.get(id)) {
            if !Arc::ptr_eq(a, cur) {
                return None;
            }
        }
        let gone = all.remove(id);
        if let Some(a) = &gone {
            a.cancel.store(true, Ordering::SeqCst);
        }
        gone
    }

    /// The map a restore of layer `dir` for `id` waits on, if its memory
    /// file is arriving.
    pub(super) fn map_for(&self, id: &SandboxId, dir: &Path) -> Option<PathBuf> {
        self.get(id).filter(|a| a.dir == dir).map(|a| a.map.clone())
    }

    /// Whether `id`'s fetch failed and its sandbox is being put back:
    /// its VMM's exit is not a failure of the sandbox.
    pub(super) fn failing(&self, id: &SandboxId) -> bool {
        self.get(id).is_some_and(|a| a.failed())
    }

    /// Stops `id`'s fetch, if any (the sandbox is being deleted).
    pub(super) fn cancel(&self, id: &SandboxId) {
        self.remove(id, None);
    }
}

/// The chunks of `chunk_size` bytes the pages of file `name` of layer
/// `dir` fall in (a working set, [`WORKING_SET_FILE`], or the pages the
/// guest was given, [`TOUCHED_FILE`]), in their order, once each.
///
/// The layer's own set only: a lazily fetched layer is a full snapshot
/// (the object store keeps only those: `objects::make_portable` rewrites
/// its lineage to itself alone), so it has no parent layers whose sets a
/// union could take, and its template's layer may not be on this pod. A
/// uffd-backed VMM's snapshot records every page installed since its
/// restore in `touched`, the ones prefetched from its own chain's sets
/// (its template's among them) included.
fn working_set_chunks(dir: &Path, name: &str, chunk_size: u64, chunks: u64) -> Vec<u64> {
    let Ok(bytes) = std::fs::read(dir.join(name)) else {
        return Vec::new();
    };
    if !bytes.len().is_multiple_of(8) || bytes.len() as u64 / 8 > MAX_WORKING_SET_PAGES {
        return Vec::new();
    }
    let mut seen = vec![false; chunks as usize];
    let mut out = Vec::new();
    for page in bytes.chunks_exact(8) {
        let page = u64::from_le_bytes(page.try_into().expect("8 bytes"));
        let i = page.saturating_mul(4096) / chunk_size;
        if i < chunks && !seen[i as usize] {
            seen[i as usize] = true;
            out.push(i);
        }
    }
    out
}

impl Service {
    /// Whether a cold wake fetches its memory file lazily here (its
    /// restore then takes the `uffd` backend: `ops.rs`, `launch_vmm`).
    pub(super) fn lazy_wake(&self) -> bool {
        self.config.lazy_wake && self.objects.is_some()
    }

    /// The layer `dir` of sandbox `id` from `manifest`, all but its memory
    /// file's chunks, its working set's chunks first; the rest arriving in
    /// the background (see the module). The ms it took and the bytes
    /// fetched before the restore.
    pub(super) fn fetch_layer_lazy(
        &self,
        id: &SandboxId,
        dir: &Path,
        manifest: &str,
    ) -> Result<(), ServiceError> {
        let objects = self
            .objects
            .as_ref()
            .ok_or_else(|| ServiceError::Unsupported("a lazy wake needs an object store".into()))?;
        let mid = ManifestId::parse(manifest)
            .map_err(|e| ServiceError::Internal(format!("layer {}: {e}", dir.display())))?;
        let layer = |source| ObjectStoreError::Layer {
            dir: dir.to_path_buf(),
            source,
        };
        let io = |source| ObjectStoreError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        let started = Instant::now();
        let temp = super::objects::fetch_temp(dir).map_err(io)?;
        let (storage, d) = (objects.storage().clone(), temp.clone());
        let fetched = objects
            .run(async move { storage.download_layer_lazy(&mid, &d, MEMORY_FILE).await })?
            .map_err(layer);
        let (report, file) = match fetched {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&temp);
                self.metrics.observe_fetch(0.0, None);
                return Err(e.into());
            }
        };
        let file = Arc::new(file);
        let placed = (|| -> Result<PodMap, ObjectStoreError> {
            super::objects::make_portable(&temp, dir)?;
            // The manifest, for a pod started again while it arrives.
            std::fs::write(temp.join(ARRIVING), manifest).map_err(io)?;
            std::fs::rename(&temp, dir).map_err(io)?;
            let path = self.sandbox_dir(id).join(LAZY_MAP_FILE);
            let mut map = PodMap::create(&path, file.chunk_size(), file.len(), FAULT_DEADLINE)
                .map_err(|e| io(std::io::Error::other(e.to_string())))?;
            for i in (0..file.chunks()).filter(|&i| file.is_hole(i)) {
                map.mark_present(i).map_err(io)?;
            }
            Ok(map)
        })();
        let mut map = match placed {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&temp);
                let _ = std::fs::remove_dir_all(dir);
                return Err(e.into());
            }
        };
        // The working set's first chunks before the restore: what the guest
        // touches first; its other chunks first in the background, then
        // those of the pages the guest was given before its snapshot (a
        // whole run's: fetched before the restore, they slowed the wake).
        let chunks = |name| {
            working_set_chunks(dir, name, file.chunk_size(), file.chunks())
                .into_iter()
                .filter(|&i| !file.is_hole(i))
        };
        let mut first: Vec<u64> = chunks(WORKING_SET_FILE).collect();
        let mut then = first.split_off(first.len().min(before_restore_chunks(file.chunk_size())));
        then.extend(chunks(TOUCHED_FILE));
        let then_len = then.len();
        let f = Arc::clone(&file);
        let want = first.clone();
        let got = objects.run(async move {
            let mut flight = tokio::task::JoinSet::new();
            let (mut todo, mut done) = (want.into_iter(), Vec::new());
            loop {
                while flight.len() < BACKGROUND {
                    let Some(i) = todo.next() else { break };
                    let f = Arc::clone(&f);
                    flight.spawn(async move { f.fetch(i).await.map(|n| (i, n)) });
                }
                match flight.join_next().await {
                    None => return Ok(done),
                    Some(Ok(Ok(got))) => done.push(got),
                    Some(Ok(Err(e))) => return Err(e),
                    Some(Err(e)) => {
                        return Err(StorageError::Io {
                            path: PathBuf::from("(working set)"),
                            source: std::io::Error::other(e.to_string()),
                        })
                    }
                }
            }
        })?;
        let eager_bytes = report.fetched_bytes;
        let first_bytes = match got {
            Ok(done) => {
                let mut n = 0;
                for (i, b) in done {
                    map.mark_present(i).map_err(io)?;
                    n += b;
                }
                n
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(dir);
                return Err(layer(e).into());
            }
        };
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        self.metrics
            .observe_fetch(ms, Some(eager_bytes + first_bytes));
        tracing::info!(
            layer = %dir.display(),
            manifest,
            fetched = eager_bytes + first_bytes,
            working_set_chunks = first.len(),
            working_set_chunks_later = then_len,
            chunks = file.chunks(),
            ms = ms as u64,
            "snapshot layer's small files fetched; its memory file arrives while the guest runs"
        );
        self.start_arrival(id, dir, manifest, file, map, then);
        Ok(())
    }

    /// Registers the arrival of layer `dir`'s memory file for sandbox
    /// `id` and fetches its chunks not present yet in the background
    /// ([`arrive`]), `then` first after the wanted ones.
    fn start_arrival(
        &self,
        id: &SandboxId,
        dir: &Path,
        manifest: &str,
        file: Arc<LazyFile>,
        map: PodMap,
        then: Vec<u64>,
    ) {
        let Some(objects) = &self.objects else {
            return;
        };
        let arrival = Arc::new(Arrival {
            dir: dir.to_path_buf(),
            map: self.sandbox_dir(id).join(LAZY_MAP_FILE),
            manifest: manifest.to_string(),
            outcome: Mutex::new(None),
            ended: Condvar::new(),
            cancel: AtomicBool::new(false),
        });
        if let Some(old) = self
            .lazy
            .0
            .locked()
            .insert(id.clone(), Arc::clone(&arrival))
        {
            old.cancel.store(true, Ordering::SeqCst);
        }
        let (me, sid, a) = (self.me.clone(), id.clone(), Arc::clone(&arrival));
        objects.spawn(async move {
            let outcome = arrive(file, map, then, &a).await;
            let failed = matches!(outcome, Outcome::Failed(..));
            a.end(outcome);
            if failed && !a.cancel.load(Ordering::SeqCst) {
                // Off the store's runtime: this takes the sandbox's lock.
                let _ = std::thread::Builder::new()
                    .name("torpor-lazy-failed".into())
                    .spawn(move || {
                        if let Some(service) = me.upgrade() {
                            service.lazy_failed(&sid, &a);
                        }
                    });
            }
        });
    }

    /// A sandbox re-attached at the start of this service (its VMM ran on
    /// while the service was down) whose memory file was still arriving:
    /// the fetch goes on where the VMM waits for it, every chunk not a
    /// hole written again (what the stopped service wrote is not known
    /// here), the chunks its page server asks for first. Its VMM's faults
    /// wait up to the map's deadline, so a service back within it loses
    /// nothing. Whether a fetch was resumed.
    ///
    /// The map lies in the directory the sandbox's (jailed) VMM owns, the
    /// layer below it: each file is opened beneath the data directory
    /// through no symlink and must have one link, the layer's be this
    /// service's (sealed), so a VMM cannot point these writes at a file of
    /// the host.
    pub(super) fn resume_lazy(&self, sandbox: &Sandbox) -> Result<bool, ServiceError> {
        let (Some(objects), Some(dir)) = (&self.objects, sandbox.snapshot.as_deref()) else {
            return Ok(false);
        };
        let id = &sandbox.id;
        let map_path = self.sandbox_dir(id).join(LAZY_MAP_FILE);
        if !dir.join(ARRIVING).exists() || !map_path.exists() {
            return Ok(false);
        }
        let bad = |why: String| {
            ServiceError::Internal(format!(
                "sandbox {id}: its memory file was arriving and cannot go on: {why}"
            ))
        };
        let mine = |path: &Path, write: bool, owner| -> Result<std::fs::File, ServiceError> {
            open_made_here(&self.config.data_dir, path, write, owner)
                .map_err(|e| bad(format!("{}: {e}", path.display())))
        };
        let mut text = String::new();
        std::io::Read::read_to_string(
            &mut mine(&dir.join(ARRIVING), false, Owner::Service)?,
            &mut text,
        )
        .map_err(|e| bad(e.to_string()))?;
        let manifest = text.trim().to_string();
        let mid = ManifestId::parse(&manifest).map_err(|e| bad(e.to_string()))?;
        let memory_path = dir.join(MEMORY_FILE);
        let memory = mine(&memory_path, true, Owner::Service)?;
        let map_file = mine(&map_path, true, Owner::Any)?;
        let (storage, m, local) = (objects.storage().clone(), mid.clone(), memory_path.clone());
        let file = objects
            .run(async move { storage.resume_lazy(&m, MEMORY_FILE, &local, memory).await })?
            .map_err(|source| ObjectStoreError::Layer {
                dir: dir.to_path_buf(),
                source,
            })?;
        let mut map = PodMap::reopen(&map_path, map_file, file.chunk_size(), file.len())
            .map_err(|e| bad(e.to_string()))?;
        for i in (0..file.chunks()).filter(|&i| file.is_hole(i)) {
            map.mark_present(i).map_err(|e| bad(e.to_string()))?;
        }
        let then = [WORKING_SET_FILE, TOUCHED_FILE]
            .into_iter()
            .flat_map(|name| working_set_chunks(dir, name, file.chunk_size(), file.chunks()))
            .collect();
        tracing::info!(
            sandbox = %id,
            layer = %dir.display(),
            manifest,
            "its memory file was still arriving when the service stopped: the fetch goes on"
        );
        self.start_arrival(id, dir, &manifest, Arc::new(file), map, then);
        Ok(true)
    }

    /// The error of `id`'s lazy fetch, if it failed: what a wake that
    /// failed meanwhile answers (the store's, naming the layer).
    pub(super) fn lazy_error(&self, id: &SandboxId) -> Option<ServiceError> {
        let a = self.lazy.get(id)?;
        let mut outcome = a.outcome.locked();
        match &mut *outcome {
            Some(Outcome::Failed(e, text)) => Some(match e.take() {
                Some(source) => ObjectStoreError::Layer {
                    dir: a.dir.clone(),
                    source,
                }
                .into(),
                None => ServiceError::Internal(text.clone()),
            }),
            _ => None,
        }
    }

    /// Waits for `id`'s memory file to have arrived (before a snapshot of
    /// it is taken); its layer is then an ordinary local one.
    pub(super) fn settle_lazy(&self, id: &SandboxId) -> Result<(), ServiceError> {
        let Some(a) = self.lazy.get(id) else {
            return Ok(());
        };
        {
            let mut outcome = a.outcome.locked();
            while outcome.is_none() {
                outcome = a
                    .ended
                    .wait(outcome)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
        if let Some(e) = self.lazy_error(id) {
            return Err(e);
        }
        match &*a.outcome.locked() {
            Some(Outcome::Done { bytes }) => self.metrics.observe_arrival(*bytes),
            _ => {
                return Err(ServiceError::Internal(format!(
                    "sandbox {id}'s memory file did not arrive"
                )))
            }
        }
        self.lazy.remove(id, Some(&a));
        let _ = std::fs::remove_file(&a.map);
        self.store.record_layer_object(&a.dir, &a.manifest, false)?;
        Ok(())
    }

    /// A lazy fetch failed: its sandbox, if its VMM still runs from the
    /// layer, is stopped and put back to its hibernation; the layer's
    /// local copy goes.
    fn lazy_failed(&self, id: &SandboxId, a: &Arc<Arrival>) {
        let Ok(_guard) = self.lock_sandbox(id) else {
            return;
        };
        if self.lazy.get(id).is_none_or(|cur| !Arc::ptr_eq(&cur, a)) {
            return;
        }
        let reason = match &*a.outcome.locked() {
            Some(Outcome::Failed(_, text)) => text.clone(),
            _ => String::new(),
        };
        if let Ok(s) = self.store.get_sandbox(id) {
            let runs_it = s.snapshot.as_deref() == Some(a.dir.as_path())
                && matches!(s.state, SandboxState::Running | SandboxState::Paused);
            if runs_it {
                tracing::warn!(
                    sandbox = %id,
                    "its memory file did not arrive ({reason}): stopped, back to its hibernation"
                );
                let _ = self.stop_vmm(&s);
                // Its partial copy goes first: hibernated, it wakes from
                // the store again.
                let _ = std::fs::remove_dir_all(&a.dir);
                let _ = self.store.write(|tx| {
                    tx.update_sandbox_state(id, s.state, SandboxState::Hibernating, None)?;
                    tx.update_sandbox_state(
                        id,
                        SandboxState::Hibernating,
                        SandboxState::Hibernated,
                        None,
                    )
                });
                self.metrics.wake_failed();
            }
        }
        self.lazy.remove(id, Some(a));
        let _ = std::fs::remove_dir_all(&a.dir);
        let _ = std::fs::remove_file(&a.map);
    }

    /// A layer left with its memory file arriving (a crash, a fetch that
    /// failed) removed, so that the wake fetches it again. Whether there
    /// was one.
    pub(super) fn drop_partial_layer(&self, id: &SandboxId, dir: &Path) -> bool {
        if !dir.join(ARRIVING).exists() {
            return false;
        }
        self.lazy.remove(id, None);
        let _ = std::fs::remove_dir_all(dir);
        true
    }
}

/// Who must own a file [`open_made_here`] opens.
#[derive(Clone, Copy)]
enum Owner {
    /// This process's user: a layer's file, sealed (the VMM owns none).
    Service,
    /// Anyone: the lazy map, in the VMM's own directory, which the jail
    /// gave it with the directory. A file there with one link is the
    /// pod's map or one the VMM made itself, never a file of the host.
    Any,
}

/// `path` (beneath `data_dir`) opened through no symlink, for writing too
/// when `write`; refused unless it is a regular file with one link (not a
/// hard link a VMM made to a file of the host) owned as `owner` says.
fn open_made_here(
    data_dir: &Path,
    path: &Path,
    write: bool,
    owner: Owner,
) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::MetadataExt;
    let rel = path
        .strip_prefix(data_dir)
        .map_err(|_| std::io::Error::other("not in the data directory"))?;
    let root = std::fs::File::open(data_dir)?;
    let flags = if write { libc::O_RDWR } else { libc::O_RDONLY } | libc::O_NOFOLLOW;
    let file = crate::images::open_beneath(&root, rel, flags, 0)?;
    let meta = file.metadata()?;
    // SAFETY: geteuid has no arguments and cannot fail.
    let me = unsafe { libc::geteuid() };
    let owned = match owner {
        Owner::Service => meta.uid() == me,
        Owner::Any => true,
    };
    if !meta.is_file() || !owned || meta.nlink() != 1 {
        return Err(std::io::Error::other(
            "not a file this service made (its type, owner or links)",
        ));
    }
    Ok(file)
}

/// The working set's chunks of `chunk_size` fetched before a restore: at
/// least one.
fn before_restore_chunks(chunk_size: u64) -> usize {
    (BEFORE_RESTORE_BYTES / chunk_size.max(1)).max(1) as usize
}

/// Fetches the chunks of `file` not yet present, wanted ones first, then
/// those of `then` (the working set's rest) in its order, then the others
/// in order; marks each present once written; then syncs the file,
/// removes the layer's marker and marks the map complete.
async fn arrive(file: Arc<LazyFile>, mut map: PodMap, then: Vec<u64>, a: &Arrival) -> Outcome {
    let fail = |map: &PodMap, e: Option<StorageError>, text: String| {
        let _ = map.set_state(FetchState::Failed);
        Outcome::Failed(e, text)
    };
    let started = Instant::now();
    let n = file.chunks();
    let mut asked: Vec<bool> = (0..n).map(|i| map.is_present(i)).collect();
    let mut next = 0u64;
    let mut then = then.into_iter().filter(|&i| i < n);
    let mut front: VecDeque<u64> = VecDeque::new();
    let mut flight = tokio::task::JoinSet::new();
    let (mut in_order, mut wanted) = (0usize, 0usize);
    let mut bytes = 0u64;
    loop {
        if a.cancel.load(Ordering::SeqCst) {
            return fail(&map, None, "cancelled".into());
        }
        for i in map.take_wanted() {
            if !asked[i as usize] {
                asked[i as usize] = true;
                front.push_back(i);
            }
        }
        while wanted < WANTED {
            let Some(i) = front.pop_front() else { break };
            let f = Arc::clone(&file);
            flight.spawn(async move { (i, true, f.fetch(i).await) });
            wanted += 1;
        }
        while in_order < BACKGROUND {
            let i = match then.find(|&i| !asked[i as usize]) {
                Some(i) => i,
                None => {
                    while next < n && asked[next as usize] {
                        next += 1;
                    }
                    if next >= n {
                        break;
                    }
                    next
                }
            };
            asked[i as usize] = true;
            let f = Arc::clone(&file);
            flight.spawn(async move { (i, false, f.fetch(i).await) });
            in_order += 1;
        }
        if flight.is_empty() && front.is_empty() {
            break;
        }
        let joined = match tokio::time::timeout(WANTED_POLL, flight.join_next()).await {
            Err(_) | Ok(None) => continue,
            Ok(Some(j)) => j,
        };
        match joined {
            Ok((i, was_wanted, Ok(got))) => {
                if was_wanted {
                    wanted -= 1;
                } else {
                    in_order -= 1;
                }
                bytes += got;
                if let Err(e) = map.mark_present(i) {
                    return fail(&map, None, format!("lazy map: {e}"));
                }
            }
            Ok((_, _, Err(e))) => {
                let text = e.to_string();
                return fail(&map, Some(e), text);
            }
            Err(e) => return fail(&map, None, format!("a chunk fetch ended: {e}")),
        }
    }
    if let Err(e) = file.sync().await {
        let text = e.to_string();
        return fail(&map, Some(e), text);
    }
    let _ = std::fs::remove_file(a.dir.join(ARRIVING));
    let _ = map.set_state(FetchState::Complete);
    tracing::info!(
        layer = %a.dir.display(),
        bytes,
        ignored_wanted = map.ignored,
        ms = started.elapsed().as_millis() as u64,
        "snapshot layer's memory file arrived"
    );
    Outcome::Done { bytes }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a resumed fetch opens in a VMM's directory: a file with one
    /// link, through no symlink, inside the data directory; a layer's file
    /// only if the service owns it.
    #[test]
    fn a_resumed_fetch_opens_only_files_the_pod_made() {
        let data = tempfile::tempdir().unwrap();
        let dir = data.path().join("sandboxes/s1");
        std::fs::create_dir_all(&dir).unwrap();
        let map = dir.join(LAZY_MAP_FILE);
        std::fs::write(&map, b"map").unwrap();
        let open = |p: &Path, owner| open_made_here(data.path(), p, true, owner);
        open(&map, Owner::Any).unwrap();
        open(&map, Owner::Service).unwrap();

        let host = data.path().join("host-file");
        std::fs::write(&host, b"host").unwrap();
        let link = dir.join("symlinked");
        std::os::unix::fs::symlink(&host, &link).unwrap();
        assert!(open(&link, Owner::Any).is_err(), "a symlink");
        let hard = dir.join("hardlinked");
        std::fs::hard_link(&host, &hard).unwrap();
        assert!(open(&hard, Owner::Any).is_err(), "a second link");
        let through = data.path().join("through");
        std::os::unix::fs::symlink(&dir, &through).unwrap();
        assert!(open(&through.join(LAZY_MAP_FILE), Owner::Any).is_err());
        assert!(open(Path::new("/etc/hostname"), Owner::Any).is_err());
        assert!(open(&dir, Owner::Any).is_err(), "a directory");
        // SAFETY: geteuid has no arguments and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::lchown(&map, Some(4242), Some(4242)).unwrap();
            open(&map, Owner::Any).unwrap();
            assert!(open(&map, Owner::Service).is_err(), "another's file");
        }
    }
}
