//! Uploading a layer directory: every regular file under it cut into
//! chunks, the all-zero ones recorded as holes and never read past what
//! `SEEK_DATA` says, the others hashed, compressed and stored when the
//! store lacks them; then the manifest. The whole protocol, and why a
//! collection cannot take a chunk the manifest names, is `gc.rs`'s doc.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt, TryStreamExt};
use torpor_sync::Locked;

use crate::chunk::{self, ChunkHash};
use crate::error::{blocking, StorageError};
use crate::id::ManifestId;
use crate::lease::{Beacon, LeaseBody};
use crate::manifest::{check_path, FileEntry, Manifest, MANIFEST_VERSION};
use crate::pause::{pause, Pause, PauseHandle, UploadStage};
use crate::sparse;
use crate::store::Storage;

/// How an upload went.
#[derive(Debug, Clone, PartialEq)]
pub struct UploadReport {
    /// The layer's manifest.
    pub id: ManifestId,
    /// Its files.
    pub files: usize,
    /// Their lengths added up.
    pub logical_bytes: u64,
    /// The bytes of their chunks that are not holes.
    pub data_bytes: u64,
    /// Chunks that are not holes.
    pub chunks: u64,
    /// All-zero chunks, stored nowhere.
    pub holes: u64,
    /// Chunks this upload stored (the others were there already, or twice
    /// in the layer).
    pub new_chunks: u64,
    /// Their content's bytes.
    pub new_bytes: u64,
    /// What was sent for them: their compressed, framed bytes.
    pub uploaded_bytes: u64,
    /// Whether a collection ran during the upload, so every chunk was
    /// looked for again before the manifest was written.
    pub rechecked: bool,
    /// Chunks stored again because a collection had taken them.
    pub restored_chunks: u64,
    /// The time it took.
    pub elapsed: Duration,
}

impl UploadReport {
    /// Data bytes the layer names over the content bytes it added: how
    /// much the store saved by holding each chunk once (∞ when it added
    /// none, 1 when it added all).
    pub fn dedupe_ratio(&self) -> f64 {
        self.data_bytes as f64 / self.new_bytes as f64
    }
}

/// How to upload.
#[derive(Debug, Default)]
pub struct UploadOptions {
    pause: Option<(UploadStage, Pause)>,
}

impl UploadOptions {
    /// Options that pause the upload at `stage` until the handle resumes
    /// it (tests).
    pub fn pause_at(stage: UploadStage) -> (Self, PauseHandle) {
        let (p, handle) = pause();
        (
            Self {
                pause: Some((stage, p)),
            },
            handle,
        )
    }

    async fn reached(&mut self, stage: UploadStage) {
        if self.pause.as_ref().is_some_and(|(s, _)| *s == stage) {
            if let Some((_, p)) = self.pause.take() {
                p.wait().await;
            }
        }
    }
}

/// A file of the layer being uploaded.
#[derive(Debug)]
pub(crate) struct LocalFile {
    /// Its path in the layer.
    pub rel: String,
    pub path: PathBuf,
    pub len: u64,
    pub mode: u32,
}

/// Every regular file under `dir`, sorted by path. Temporary files of the
/// snapshot writer (`.<name>.tmp-*`) are left out; links and special
/// files are refused.
pub(crate) fn scan(dir: &Path) -> Result<Vec<LocalFile>, StorageError> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<LocalFile>) -> Result<(), StorageError> {
        let entries = std::fs::read_dir(dir).map_err(|e| StorageError::io(dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| StorageError::io(dir, e))?;
            let path = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                return Err(StorageError::UnsupportedEntry {
                    path,
                    why: "its name is not UTF-8",
                });
            };
            if name.starts_with('.') && name.contains(".tmp-") {
                continue;
            }
            let meta = std::fs::symlink_metadata(&path).map_err(|e| StorageError::io(&path, e))?;
            if meta.is_dir() {
                walk(root, &path, out)?;
            } else if meta.is_file() {
                let rel = path
                    .strip_prefix(root)
                    .expect("under the root")
                    .to_str()
                    .expect("UTF-8 names")
                    .to_string();
                if check_path(&rel).is_err() {
                    return Err(StorageError::UnsupportedEntry {
                        path,
                        why: "a name a manifest cannot hold",
                    });
                }
                out.push(LocalFile {
                    rel,
                    len: meta.len(),
                    mode: meta.permissions().mode() & 0o7777,
                    path,
                });
            } else {
                return Err(StorageError::UnsupportedEntry {
                    path,
                    why: "not a regular file or a directory",
                });
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(out)
}

/// A chunk read from a file: its content address and stored object, or a
/// hole.
enum Read {
    Hole,
    Data {
        hash: ChunkHash,
        raw_len: u64,
        stored: Vec<u8>,
    },
}

/// Reads chunk `index` of `file` (`chunk_size` bytes, fewer at its end).
fn read_chunk(
    file: &File,
    path: &Path,
    len: u64,
    chunk_size: u64,
    index: u64,
) -> Result<Read, StorageError> {
    let start = index * chunk_size;
    let n = (len - start).min(chunk_size) as usize;
    let mut buf = vec![0u8; n];
    file.read_exact_at(&mut buf, start)
        .map_err(|e| StorageError::io(path, e))?;
    if chunk::is_zero(&buf) {
        return Ok(Read::Hole);
    }
    Ok(Read::Data {
        hash: ChunkHash::of(&buf),
        raw_len: n as u64,
        stored: chunk::encode(&buf),
    })
}

/// What storing one chunk did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Hole,
    /// Stored now: its content and stored lengths.
    New(u64, u64),
    /// Already in the store, or earlier in this layer.
    There(u64),
}

impl Storage {
    /// Uploads the layer in `dir` (see [`Storage::upload_layer_with`]).
    pub async fn upload_layer(&self, dir: &Path) -> Result<UploadReport, StorageError> {
        self.upload_layer_with(dir, UploadOptions::default()).await
    }

    /// Uploads every regular file under `dir` as chunks and a manifest;
    /// the manifest's id once it is written. Holds a lease on
    /// `leases/<id>` throughout, removed at the end whether it succeeded or
    /// not.
    pub async fn upload_layer_with(
        &self,
        dir: &Path,
        mut opts: UploadOptions,
    ) -> Result<UploadReport, StorageError> {
        let begun = Instant::now();
        let files = blocking({
            let dir = dir.to_path_buf();
            move || scan(&dir)
        })
        .await?;
        let id = ManifestId::generate();
        let ttl = self.options().lease_ttl;
        let mut body = LeaseBody::new(ttl);
        let key = format!("leases/{id}");
        let (lease, started) =
            Beacon::start(self, key, serde_json::to_vec(&body).expect("json"), ttl).await?;
        body.started_ms = Some(started);
        let result = self
            .upload_leased(&id, &files, &lease, &mut body, &mut opts)
            .await;
        let ended = lease.end(None).await;
        let mut report = result?;
        if let Err(e) = ended {
            // The manifest is written: a lease left behind only expires.
            tracing::warn!("upload {id}: removing its lease: {e}");
        }
        report.elapsed = begun.elapsed();
        Ok(report)
    }

    async fn upload_leased(
        &self,
        id: &ManifestId,
        files: &[LocalFile],
        lease: &Beacon,
        body: &mut LeaseBody,
        opts: &mut UploadOptions,
    ) -> Result<UploadReport, StorageError> {
        let started = body.started_ms.expect("set once the lease is written");
        let (manifest, mut report) = self.store_chunks(id, files).await?;
        opts.reached(UploadStage::ChunksStored).await;

        // From here on every collection that lists the leases spares the
        // manifest's chunks; those that listed them before are waited for.
        body.manifest = Some(manifest.clone());
        lease
            .write(serde_json::to_vec(&*body).expect("json"))
            .await?;
        opts.reached(UploadStage::ManifestPending).await;
        if self.collections_overlapping(id, lease, started).await? {
            report.rechecked = true;
            report.restored_chunks = self.restore_missing(files, &manifest).await?;
        }
        if let Some((gap, limit)) = lease.lapsed() {
            return Err(StorageError::LeaseLost {
                layer: id.clone(),
                gap,
                limit,
            });
        }
        self.put(&id.key(), manifest.to_bytes()).await?;
        if let Some((gap, limit)) = lease.lapsed() {
            // It lapsed while the manifest was written: a collection may
            // have counted the upload dead. Nobody has the id yet: the
            // manifest is taken back.
            let _ = self.delete(&id.key()).await;
            return Err(StorageError::LeaseLost {
                layer: id.clone(),
                gap,
                limit,
            });
        }
        Ok(report)
    }

    /// Stores the chunks of `files` the store lacks; the manifest naming
    /// them all, and the counts.
    async fn store_chunks(
        &self,
        id: &ManifestId,
        files: &[LocalFile],
    ) -> Result<(Manifest, UploadReport), StorageError> {
        let cs = self.options().chunk_size;
        // Each file opened once, and which of its chunks hold data.
        let opened = blocking({
            let paths: Vec<(PathBuf, u64)> =
                files.iter().map(|f| (f.path.clone(), f.len)).collect();
            move || {
                paths
                    .into_iter()
                    .map(|(path, len)| {
                        let file = File::open(&path).map_err(|e| StorageError::io(&path, e))?;
                        let ranges = sparse::data_ranges(&file, len)
                            .map_err(|e| StorageError::io(&path, e))?;
                        let marks = sparse::chunks_with_data(&ranges, cs, len.div_ceil(cs));
                        Ok((Arc::new(file), marks))
                    })
                    .collect::<Result<Vec<_>, StorageError>>()
            }
        })
        .await?;

        let mut work = Vec::new();
        for (fi, (_, marks)) in opened.iter().enumerate() {
            for (i, data) in marks.iter().enumerate() {
                if *data {
                    work.push((fi, i as u64));
                }
            }
        }
        let claimed = Arc::new(Mutex::new(HashSet::new()));
        let outcomes: Vec<(usize, u64, Option<ChunkHash>, Outcome)> = stream::iter(work)
            .map(|(fi, i)| {
                let file = opened[fi].0.clone();
                let (path, len) = (files[fi].path.clone(), files[fi].len);
                let claimed = claimed.clone();
                async move {
                    let read = blocking(move || read_chunk(&file, &path, len, cs, i)).await?;
                    let Read::Data {
                        hash,
                        raw_len,
                        stored,
                    } = read
                    else {
                        return Ok((fi, i, None, Outcome::Hole));
                    };
                    if !claimed.locked().insert(hash) {
                        return Ok((fi, i, Some(hash), Outcome::There(raw_len)));
                    }
                    let key = hash.key();
                    if self.head(&key).await?.is_some() {
                        return Ok((fi, i, Some(hash), Outcome::There(raw_len)));
                    }
                    let sent = stored.len() as u64;
                    self.put(&key, stored).await?;
                    Ok::<_, StorageError>((fi, i, Some(hash), Outcome::New(raw_len, sent)))
                }
            })
            .buffered(self.options().concurrency.max(1))
            .try_collect()
            .await?;

        let mut chunks: Vec<Vec<Option<ChunkHash>>> = files
            .iter()
            .map(|f| vec![None; f.len.div_ceil(cs) as usize])
            .collect();
        let mut report = UploadReport {
            id: id.clone(),
            files: files.len(),
            logical_bytes: files.iter().map(|f| f.len).sum(),
            data_bytes: 0,
            chunks: 0,
            holes: 0,
            new_chunks: 0,
            new_bytes: 0,
            uploaded_bytes: 0,
            rechecked: false,
            restored_chunks: 0,
            elapsed: Duration::ZERO,
        };
        for (fi, i, hash, outcome) in outcomes {
            chunks[fi][i as usize] = hash;
            match outcome {
                Outcome::Hole => {}
                Outcome::New(raw, sent) => {
                    report.new_chunks += 1;
                    report.new_bytes += raw;
                    report.uploaded_bytes += sent;
                    report.data_bytes += raw;
                    report.chunks += 1;
                }
                Outcome::There(raw) => {
                    report.data_bytes += raw;
                    report.chunks += 1;
                }
            }
        }
        report.holes = chunks.iter().flatten().filter(|c| c.is_none()).count() as u64;
        let manifest = Manifest {
            version: MANIFEST_VERSION,
            chunk_size: cs,
            files: files
                .iter()
                .zip(&chunks)
                .map(|(f, c)| FileEntry {
                    path: f.rel.clone(),
                    len: f.len,
                    mode: f.mode,
                    chunks: FileEntry::runs(c),
                })
                .collect(),
        };
        Ok((manifest, report))
    }

    /// Every chunk `manifest` names looked for again; those missing (a
    /// collection took them) read from their file again and stored. How
    /// many were.
    async fn restore_missing(
        &self,
        files: &[LocalFile],
        manifest: &Manifest,
    ) -> Result<u64, StorageError> {
        let cs = manifest.chunk_size;
        let mut seen = HashSet::new();
        let mut each = Vec::new();
        for (fi, f) in manifest.files.iter().enumerate() {
            for (i, c) in f.expand().into_iter().enumerate() {
                if let Some(h) = c {
                    if seen.insert(h) {
                        each.push((fi, i as u64, h));
                    }
                }
            }
        }
        let restored: Vec<bool> = stream::iter(each)
            .map(|(fi, i, hash)| {
                let (path, len) = (files[fi].path.clone(), files[fi].len);
                async move {
                    if self.head(&hash.key()).await?.is_some() {
                        return Ok(false);
                    }
                    tracing::info!(
                        "chunk {hash} was collected during the upload: storing it again"
                    );
                    let read = blocking({
                        let path = path.clone();
                        move || {
                            let file = File::open(&path).map_err(|e| StorageError::io(&path, e))?;
                            read_chunk(&file, &path, len, cs, i)
                        }
                    })
                    .await?;
                    match read {
                        Read::Data {
                            hash: h, stored, ..
                        } if h == hash => {
                            self.put(&hash.key(), stored).await?;
                            Ok(true)
                        }
                        _ => Err(StorageError::FileChanged { path, index: i }),
                    }
                }
            })
            .buffered(self.options().concurrency.max(1))
            .try_collect()
            .await?;
        Ok(restored.into_iter().filter(|r| *r).count() as u64)
    }
}
