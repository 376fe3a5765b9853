//! Reading layers back: a whole layer into a directory
//! ([`Storage::download_layer`]: sparse files with their holes kept, each
//! file written under a temporary name, synced and renamed), or random
//! access to a layer's files ([`LayerReader::read_at`]) that fetches only
//! the chunks a read covers, through the shared [`ChunkCache`]: what a
//! page server serving faults from the store needs.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt, TryStreamExt};

use crate::cache::{ChunkCache, ChunkSource};
use crate::chunk::{self, ChunkHash};
use crate::error::{blocking, ChunkAt, StorageError};
use crate::id::ManifestId;
use crate::manifest::{FileEntry, Manifest};
use crate::sparse;
use crate::store::Storage;

/// How a download went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DownloadReport {
    /// The layer.
    pub id: ManifestId,
    /// Its files.
    pub files: usize,
    /// Their lengths added up.
    pub logical_bytes: u64,
    /// The bytes of their chunks that are not holes.
    pub data_bytes: u64,
    /// What was fetched: the chunks' stored bytes.
    pub fetched_bytes: u64,
    /// Chunks the layer's files name (fetched, or read from the chunk
    /// cache).
    pub chunks: u64,
    /// Of them, read from the chunk cache ([`Storage::with_cache`]):
    /// nothing fetched.
    pub from_cache: u64,
    /// All-zero chunks, left as holes.
    pub holes: u64,
    /// The time it took.
    pub elapsed: Duration,
}

impl ChunkSource for Storage {
    /// The content of the chunk `at` names, every check passed (of at most
    /// `max_len` bytes), and its stored length.
    async fn fetch_chunk(
        &self,
        at: &ChunkAt,
        max_len: u64,
    ) -> Result<(Vec<u8>, u64), StorageError> {
        let Some(stored) = self.get(&at.hash.key()).await? else {
            return Err(StorageError::ChunkMissing {
                at: Box::new(at.clone()),
            });
        };
        let stored_len = stored.len() as u64;
        let hash = at.hash;
        let raw = blocking(move || Ok(chunk::decode(&hash, &stored, max_len))).await?;
        match raw {
            Ok(raw) => Ok((raw, stored_len)),
            Err(why) => Err(StorageError::ChunkCorrupt {
                at: Box::new(at.clone()),
                why,
            }),
        }
    }
}

impl Storage {
    /// The content of the chunk `at` names (of at most `max_len` bytes)
    /// and the stored bytes fetched for it: through the store's chunk
    /// cache when it has one ([`Storage::with_cache`]; nothing fetched
    /// when it holds the chunk), else from the store.
    async fn chunk(&self, at: &ChunkAt, max_len: u64) -> Result<(Vec<u8>, u64), StorageError> {
        match self.cache() {
            Some(cache) => cache.chunk(self, at, max_len).await,
            None => self.fetch_chunk(at, max_len).await,
        }
    }

    /// A random-access reader of layer `id`, through `cache`.
    pub async fn open_layer(
        &self,
        id: &ManifestId,
        cache: Arc<ChunkCache>,
    ) -> Result<LayerReader, StorageError> {
        let manifest = self.manifest(id).await?;
        let files = manifest
            .files
            .iter()
            .map(|f| (f.path.clone(), (f.len, f.expand())))
            .collect();
        Ok(LayerReader {
            storage: self.clone(),
            cache,
            id: id.clone(),
            manifest: Arc::new(manifest),
            files,
        })
    }

    /// Writes layer `id` into `dir` (made if missing): each file at its
    /// length, its holes and all-zero pages left unwritten, synced, then
    /// renamed into place; a file of that name already there is replaced.
    pub async fn download_layer(
        &self,
        id: &ManifestId,
        dir: &Path,
    ) -> Result<DownloadReport, StorageError> {
        self.download_layer_except(id, dir, None)
            .await
            .map(|(report, _)| report)
    }

    /// [`Storage::download_layer`] but for file `lazy`, which is made at
    /// its length, a hole, and renamed into place with the others: its
    /// chunks are fetched afterwards, in any order, through the
    /// [`LazyFile`] returned (a cold wake's memory file, fetched while the
    /// guest runs). The report counts what was fetched here.
    pub async fn download_layer_lazy(
        &self,
        id: &ManifestId,
        dir: &Path,
        lazy: &str,
    ) -> Result<(DownloadReport, LazyFile), StorageError> {
        let (report, file) = self.download_layer_except(id, dir, Some(lazy)).await?;
        let Some((file, entry, chunk_size)) = file else {
            return Err(StorageError::NoSuchFile {
                layer: id.clone(),
                file: lazy.to_string(),
            });
        };
        Ok((
            report,
            LazyFile {
                storage: self.clone(),
                id: id.clone(),
                local: dir.join(&entry.path),
                chunks: entry.expand(),
                path: entry.path,
                len: entry.len,
                chunk_size,
                file,
            },
        ))
    }

    /// A [`LazyFile`] over `file`, the local copy at `local` of file
    /// `name` of layer `id` that an earlier [`Storage::download_layer_lazy`]
    /// made and did not finish (a pod that stopped while it arrived): its
    /// chunks fetched from here on are written into it again. The caller
    /// opened `file` (writable) as it trusts it; its length must be the
    /// manifest's.
    pub async fn resume_lazy(
        &self,
        id: &ManifestId,
        name: &str,
        local: &Path,
        file: File,
    ) -> Result<LazyFile, StorageError> {
        let manifest = self.manifest(id).await?;
        let entry = manifest
            .file(name)
            .cloned()
            .ok_or_else(|| StorageError::NoSuchFile {
                layer: id.clone(),
                file: name.to_string(),
            })?;
        let len = file
            .metadata()
            .map_err(|e| StorageError::io(local, e))?
            .len();
        if len != entry.len {
            return Err(StorageError::LocalMismatch {
                path: local.to_path_buf(),
                why: format!("{len} bytes where the manifest has {}", entry.len),
            });
        }
        Ok(LazyFile {
            storage: self.clone(),
            id: id.clone(),
            local: local.to_path_buf(),
            chunks: entry.expand(),
            path: entry.path,
            len: entry.len,
            chunk_size: manifest.chunk_size,
            file: Arc::new(file),
        })
    }

    async fn download_layer_except(
        &self,
        id: &ManifestId,
        dir: &Path,
        except: Option<&str>,
    ) -> Result<(DownloadReport, Option<(Arc<File>, FileEntry, u64)>), StorageError> {
        let begun = Instant::now();
        let manifest = self.manifest(id).await?;
        let cs = manifest.chunk_size;
        let temps = blocking({
            let (dir, manifest) = (dir.to_path_buf(), manifest.clone());
            move || create_temps(&dir, &manifest)
        })
        .await?;
        let mut work = Vec::new();
        let mut lazy = None;
        for (fi, f) in manifest.files.iter().enumerate() {
            if Some(f.path.as_str()) == except {
                lazy = Some((temps[fi].0.clone(), f.clone(), cs));
                continue;
            }
            for (i, c) in f.expand().into_iter().enumerate() {
                if let Some(hash) = c {
                    work.push((fi, i as u64, hash));
                }
            }
        }
        let chunks = work.len() as u64;
        let fetched = AtomicU64::new(0);
        let data = AtomicU64::new(0);
        let cached = AtomicU64::new(0);
        let written: Result<Vec<()>, StorageError> = stream::iter(work)
            .map(|(fi, index, hash)| {
                let at = ChunkAt {
                    layer: id.clone(),
                    file: manifest.files[fi].path.clone(),
                    index,
                    hash,
                };
                let (file, path) = (temps[fi].0.clone(), temps[fi].1.clone());
                let (fetched, data, cached) = (&fetched, &data, &cached);
                async move {
                    let (raw, stored) = self.chunk(&at, cs).await?;
                    fetched.fetch_add(stored, Ordering::Relaxed);
                    cached.fetch_add(u64::from(stored == 0), Ordering::Relaxed);
                    data.fetch_add(raw.len() as u64, Ordering::Relaxed);
                    blocking(move || {
                        sparse::write_sparse(&file, index * cs, &raw)
                            .map_err(|e| StorageError::io(&path, e))
                    })
                    .await
                }
            })
            .buffer_unordered(self.options().concurrency.max(1))
            .try_collect()
            .await;
        let finished = match written {
            Ok(_) => {
                blocking({
                    let (dir, manifest, temps) =
                        (dir.to_path_buf(), manifest.clone(), temps.clone());
                    move || finish(&dir, &manifest, &temps)
                })
                .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = finished {
            for (_, temp) in &temps {
                let _ = std::fs::remove_file(temp);
            }
            return Err(e);
        }
        let report = DownloadReport {
            id: id.clone(),
            files: manifest.files.len(),
            logical_bytes: manifest.logical_bytes(),
            data_bytes: data.into_inner(),
            fetched_bytes: fetched.into_inner(),
            chunks,
            from_cache: cached.into_inner(),
            holes: manifest
                .files
                .iter()
                .map(|f| f.expand().iter().filter(|c| c.is_none()).count() as u64)
                .sum(),
            elapsed: begun.elapsed(),
        };
        Ok((report, lazy))
    }
}

/// A file of a downloaded layer whose chunks arrive later
/// ([`Storage::download_layer_lazy`]): made at its length, a hole; each
/// [`LazyFile::fetch`] writes one chunk, checked, its zero pages left
/// unwritten.
#[derive(Debug)]
pub struct LazyFile {
    storage: Storage,
    id: ManifestId,
    path: String,
    local: PathBuf,
    file: Arc<File>,
    chunk_size: u64,
    chunks: Vec<Option<ChunkHash>>,
    len: u64,
}

impl LazyFile {
    /// The chunk size.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// The file's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its chunks.
    pub fn chunks(&self) -> u64 {
        self.chunks.len() as u64
    }

    /// Whether chunk `i` is a hole (nothing to fetch; past the end too).
    pub fn is_hole(&self, i: u64) -> bool {
        !matches!(self.chunks.get(i as usize), Some(Some(_)))
    }

    /// Fetches chunk `i` (a hole is nothing) and writes it into the file,
    /// every check passed: a corrupt chunk fails with
    /// [`StorageError::ChunkCorrupt`] naming the layer, the file and the
    /// chunk. The bytes fetched.
    pub async fn fetch(&self, i: u64) -> Result<u64, StorageError> {
        let Some(Some(hash)) = self.chunks.get(i as usize).copied() else {
            return Ok(0);
        };
        let at = ChunkAt {
            layer: self.id.clone(),
            file: self.path.clone(),
            index: i,
            hash,
        };
        let (raw, stored) = self.storage.chunk(&at, self.chunk_size).await?;
        let (file, path, offset) = (self.file.clone(), self.local.clone(), i * self.chunk_size);
        blocking(move || {
            sparse::write_sparse(&file, offset, &raw).map_err(|e| StorageError::io(&path, e))
        })
        .await?;
        Ok(stored)
    }

    /// Syncs the file (every chunk written).
    pub async fn sync(&self) -> Result<(), StorageError> {
        let (file, path) = (self.file.clone(), self.local.clone());
        blocking(move || file.sync_all().map_err(|e| StorageError::io(&path, e))).await
    }
}

/// Each file of `manifest` made under `dir` at a temporary name (mode
/// 0600 while written), at its full length: one hole.
fn create_temps(
    dir: &Path,
    manifest: &Manifest,
) -> Result<Vec<(Arc<File>, PathBuf)>, StorageError> {
    static N: AtomicU64 = AtomicU64::new(0);
    let mut out: Vec<(Arc<File>, PathBuf)> = Vec::new();
    for f in &manifest.files {
        let path = dir.join(&f.path);
        let parent = path.parent().unwrap_or(dir);
        let made = std::fs::create_dir_all(parent).map_err(|e| StorageError::io(parent, e));
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
        let temp = parent.join(format!(
            ".{name}.tmp-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let file = made.and_then(|()| {
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&temp)
                .map_err(|e| StorageError::io(&temp, e))?;
            file.set_len(f.len)
                .map_err(|e| StorageError::io(&temp, e))?;
            Ok(file)
        });
        match file {
            Ok(file) => out.push((Arc::new(file), temp)),
            Err(e) => {
                for (_, t) in &out {
                    let _ = std::fs::remove_file(t);
                }
                return Err(e);
            }
        }
    }
    Ok(out)
}

/// Syncs each written file, gives it its mode and renames it into place;
/// then syncs the directories.
fn finish(
    dir: &Path,
    manifest: &Manifest,
    temps: &[(Arc<File>, PathBuf)],
) -> Result<(), StorageError> {
    let mut dirs = Vec::new();
    for (f, (file, temp)) in manifest.files.iter().zip(temps) {
        file.sync_all().map_err(|e| StorageError::io(temp, e))?;
        file.set_permissions(std::fs::Permissions::from_mode(f.mode))
            .map_err(|e| StorageError::io(temp, e))?;
        let path = dir.join(&f.path);
        std::fs::rename(temp, &path).map_err(|e| StorageError::io(&path, e))?;
        let parent = path.parent().unwrap_or(dir).to_path_buf();
        if !dirs.contains(&parent) {
            dirs.push(parent);
        }
    }
    for d in dirs {
        File::open(&d)
            .and_then(|f| f.sync_all())
            .map_err(|e| StorageError::io(&d, e))?;
    }
    Ok(())
}

/// Random access to a layer's files: each read fetches the chunks it
/// covers that the cache lacks, and only those.
#[derive(Debug, Clone)]
pub struct LayerReader {
    storage: Storage,
    cache: Arc<ChunkCache>,
    id: ManifestId,
    manifest: Arc<Manifest>,
    /// Each file's length and chunks (`None` for a hole).
    files: HashMap<String, (u64, Vec<Option<ChunkHash>>)>,
}

impl LayerReader {
    /// The layer.
    pub fn id(&self) -> &ManifestId {
        &self.id
    }

    /// Its manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The length of `file`, if the layer has it.
    pub fn file_len(&self, file: &str) -> Option<u64> {
        self.files.get(file).map(|(len, _)| *len)
    }

    /// `len` bytes of `file` at `offset`; holes read as zeros. Every chunk
    /// the read covers is checked (or was, when it was cached): a corrupt
    /// one fails the read with [`StorageError::ChunkCorrupt`] naming the
    /// layer, the file and the chunk.
    pub async fn read_at(
        &self,
        file: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, StorageError> {
        let mut out = Vec::with_capacity(len as usize);
        for piece in self.pieces(file, offset, len, false).await? {
            out.extend_from_slice(&piece);
        }
        Ok(out)
    }

    /// Brings the chunks `len` bytes of `file` at `offset` cover into the
    /// cache (a working set, ahead of the reads).
    pub async fn prefetch(&self, file: &str, offset: u64, len: u64) -> Result<(), StorageError> {
        self.pieces(file, offset, len, true).await.map(drop)
    }

    async fn pieces(
        &self,
        file: &str,
        offset: u64,
        len: u64,
        only_fetch: bool,
    ) -> Result<Vec<Vec<u8>>, StorageError> {
        let Some((file_len, chunks)) = self.files.get(file) else {
            return Err(StorageError::NoSuchFile {
                layer: self.id.clone(),
                file: file.to_string(),
            });
        };
        let end = offset.checked_add(len).filter(|e| e <= file_len);
        let Some(end) = end else {
            return Err(StorageError::OutOfRange {
                layer: self.id.clone(),
                file: file.to_string(),
                offset,
                len,
                file_len: *file_len,
            });
        };
        if len == 0 {
            return Ok(Vec::new());
        }
        let cs = self.manifest.chunk_size;
        stream::iter(offset / cs..=(end - 1) / cs)
            .map(|i| {
                let start = i * cs;
                let lo = (offset.max(start) - start) as usize;
                let hi = (end.min(start + cs) - start) as usize;
                let hash = chunks[i as usize];
                async move {
                    let Some(hash) = hash else {
                        return Ok(if only_fetch {
                            Vec::new()
                        } else {
                            vec![0; hi - lo]
                        });
                    };
                    let at = ChunkAt {
                        layer: self.id.clone(),
                        file: file.to_string(),
                        index: i,
                        hash,
                    };
                    let (lo, n) = if only_fetch { (0, 0) } else { (lo, hi - lo) };
                    self.cache.read(&self.storage, &at, cs, lo, n).await
                }
            })
            .buffered(self.storage.options().concurrency.max(1))
            .try_collect()
            .await
    }
}
