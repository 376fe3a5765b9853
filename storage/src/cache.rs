//! The local chunk cache: chunks fetched from the store, uncompressed and
//! verified, kept in a directory on the pod (`<dir>/<2 hex>/<64 hex>`)
//! within a size limit, the least recently used evicted first. One cache
//! serves every reader of the process (chunks are content-addressed, so a
//! chunk shared by many layers is cached once), and concurrent readers of
//! an absent chunk fetch it once: the first fetches, the others wait for it.
//!
//! A cached file is written to a temporary name and renamed, after its
//! SHA-256 was checked against its key; [`ChunkCache::open`] hashes every
//! file already there again (a crash may have left one torn, since cached
//! files are not synced) and drops the ones that do not match, then
//! rebuilds the LRU order from their modification times.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Mutex as AsyncMutex;
use torpor_sync::Locked;

use crate::chunk::ChunkHash;
use crate::error::{blocking, ChunkAt, StorageError};

/// The cache's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Reads served from the cache.
    pub hits: u64,
    /// Chunks fetched from the store.
    pub fetches: u64,
    /// Their stored (compressed) bytes.
    pub fetched_bytes: u64,
    /// Chunks evicted.
    pub evictions: u64,
    /// Chunks in the cache now.
    pub chunks: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// The LRU index: each chunk's size and last use, and the chunks by last
/// use.
#[derive(Debug, Default)]
struct Lru {
    entries: HashMap<ChunkHash, (u64, u64)>,
    order: BTreeMap<u64, ChunkHash>,
    tick: u64,
    /// The bytes of the entries.
    bytes: u64,
    /// The bytes of chunks being written in, room made for them.
    reserved: u64,
}

impl Lru {
    fn touch(&mut self, hash: &ChunkHash) -> bool {
        let Some((_, used)) = self.entries.get_mut(hash) else {
            return false;
        };
        self.order.remove(used);
        self.tick += 1;
        *used = self.tick;
        self.order.insert(self.tick, *hash);
        true
    }

    fn insert(&mut self, hash: ChunkHash, size: u64) {
        if self.touch(&hash) {
            return;
        }
        self.tick += 1;
        self.entries.insert(hash, (size, self.tick));
        self.order.insert(self.tick, hash);
        self.bytes += size;
    }

    fn remove(&mut self, hash: &ChunkHash) {
        if let Some((size, used)) = self.entries.remove(hash) {
            self.order.remove(&used);
            self.bytes -= size;
        }
    }

    /// The least recently used chunks to drop for `incoming` more bytes
    /// to fit under `limit`, dropped from the index.
    fn make_room(&mut self, limit: u64, incoming: u64) -> Vec<ChunkHash> {
        let mut out = Vec::new();
        while self.bytes + self.reserved + incoming > limit {
            let Some(&oldest) = self.order.values().next() else {
                break;
            };
            self.remove(&oldest);
            out.push(oldest);
        }
        out
    }
}

/// Where a [`ChunkCache`] fetches a chunk it lacks: the object store
/// (`Storage`, in `reader.rs`; the cache names no store, which holds it).
pub(crate) trait ChunkSource: Sync {
    /// The content of the chunk `at` names, every check passed (of at
    /// most `max_len` bytes), and its stored length.
    fn fetch_chunk(
        &self,
        at: &ChunkAt,
        max_len: u64,
    ) -> impl std::future::Future<Output = Result<(Vec<u8>, u64), StorageError>> + Send;
}

/// A bounded chunk cache on local disk, shared by all readers.
#[derive(Debug)]
pub struct ChunkCache {
    dir: PathBuf,
    limit: u64,
    lru: Mutex<Lru>,
    /// A lock per chunk being fetched: the first reader holds it while it
    /// fetches, the others wait on it and then find the chunk cached.
    fetching: Mutex<HashMap<ChunkHash, Arc<AsyncMutex<()>>>>,
    hits: AtomicU64,
    fetches: AtomicU64,
    fetched_bytes: AtomicU64,
    evictions: AtomicU64,
    temp: AtomicU64,
}

impl ChunkCache {
    /// The cache in `dir` (made if missing), holding at most `limit_bytes`
    /// of chunks. Blocks: it reads and hashes what the directory holds.
    pub fn open(dir: &Path, limit_bytes: u64) -> Result<Arc<Self>, StorageError> {
        if limit_bytes == 0 {
            return Err(StorageError::CacheTooSmall {
                dir: dir.to_path_buf(),
                limit: limit_bytes,
            });
        }
        std::fs::create_dir_all(dir).map_err(|e| StorageError::io(dir, e))?;
        let mut found = Vec::new();
        for fan in std::fs::read_dir(dir).map_err(|e| StorageError::io(dir, e))? {
            let fan = fan.map_err(|e| StorageError::io(dir, e))?.path();
            if !fan.is_dir() {
                // A temporary file a crash left.
                if fan
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(".tmp-"))
                {
                    let _ = std::fs::remove_file(&fan);
                }
                continue;
            }
            for entry in std::fs::read_dir(&fan).map_err(|e| StorageError::io(&fan, e))? {
                let path = entry.map_err(|e| StorageError::io(&fan, e))?.path();
                let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
                let valid = ChunkHash::from_hex(name).and_then(|h| {
                    let data = std::fs::read(&path).ok()?;
                    (ChunkHash::of(&data) == h).then_some((h, data.len() as u64))
                });
                match valid {
                    Some((hash, size)) => {
                        let mtime = std::fs::metadata(&path)
                            .and_then(|m| m.modified())
                            .unwrap_or(std::time::UNIX_EPOCH);
                        found.push((mtime, hash, size, path));
                    }
                    // Temporary files, torn files, strangers.
                    None => {
                        let _ = std::fs::remove_file(&path);
                    }
                }
            }
        }
        found.sort_by_key(|(mtime, ..)| *mtime);
        let mut lru = Lru::default();
        for (_, hash, size, _) in &found {
            lru.insert(*hash, *size);
        }
        let cache = Self {
            dir: dir.to_path_buf(),
            limit: limit_bytes,
            lru: Mutex::new(lru),
            fetching: Mutex::new(HashMap::new()),
            hits: AtomicU64::new(0),
            fetches: AtomicU64::new(0),
            fetched_bytes: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            temp: AtomicU64::new(0),
        };
        let over = cache.lru.locked().make_room(limit_bytes, 0);
        for hash in over {
            let _ = std::fs::remove_file(cache.path(&hash));
        }
        Ok(Arc::new(cache))
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Its counters.
    pub fn stats(&self) -> CacheStats {
        let lru = self.lru.locked();
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            fetches: self.fetches.load(Ordering::Relaxed),
            fetched_bytes: self.fetched_bytes.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            chunks: lru.entries.len() as u64,
            bytes: lru.bytes,
        }
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: &ChunkHash) -> bool {
        self.lru.locked().entries.contains_key(hash)
    }

    /// The bytes of those of `hashes` that are cached (each counted once
    /// however often it comes): how much of a layer this host holds.
    pub fn cached_bytes<'a>(&self, hashes: impl IntoIterator<Item = &'a ChunkHash>) -> u64 {
        let lru = self.lru.locked();
        let mut seen = std::collections::HashSet::new();
        hashes
            .into_iter()
            .filter(|h| seen.insert(**h))
            .filter_map(|h| lru.entries.get(h).map(|(size, _)| *size))
            .sum()
    }

    fn path(&self, hash: &ChunkHash) -> PathBuf {
        let hex = hash.to_hex();
        self.dir.join(&hex[..2]).join(hex)
    }

    /// `len` bytes at `offset` of the chunk `at` names (of at most
    /// `max_len` bytes), from the cache or fetched from `source` into it.
    pub(crate) async fn read(
        &self,
        source: &impl ChunkSource,
        at: &ChunkAt,
        max_len: u64,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, StorageError> {
        let (buf, _) = self.get(source, at, max_len, Some((offset, len))).await?;
        Ok(buf)
    }

    /// The whole chunk `at` names (of at most `max_len` bytes), from the
    /// cache or fetched from `source` into it, and the stored bytes
    /// fetched for it (0 from the cache).
    pub(crate) async fn chunk(
        &self,
        source: &impl ChunkSource,
        at: &ChunkAt,
        max_len: u64,
    ) -> Result<(Vec<u8>, u64), StorageError> {
        self.get(source, at, max_len, None).await
    }

    /// The chunk's bytes in `range` (offset, length; all of it if none)
    /// and the stored bytes fetched.
    async fn get(
        &self,
        source: &impl ChunkSource,
        at: &ChunkAt,
        max_len: u64,
        range: Option<(usize, usize)>,
    ) -> Result<(Vec<u8>, u64), StorageError> {
        loop {
            if self.lru.locked().touch(&at.hash) {
                let path = self.path(&at.hash);
                let got = blocking(move || {
                    let file = match File::open(&path) {
                        Ok(f) => f,
                        // Evicted since: fetched again below.
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                        Err(e) => return Err(StorageError::io(&path, e)),
                    };
                    let (offset, len) = match range {
                        Some(r) => r,
                        None => {
                            let len = file.metadata().map_err(|e| StorageError::io(&path, e))?;
                            (0, len.len() as usize)
                        }
                    };
                    let mut buf = vec![0u8; len];
                    file.read_exact_at(&mut buf, offset as u64)
                        .map_err(|e| StorageError::io(&path, e))?;
                    Ok(Some(buf))
                })
                .await?;
                if let Some(buf) = got {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok((buf, 0));
                }
                self.lru.locked().remove(&at.hash);
            }
            let gate = self
                .fetching
                .locked()
                .entry(at.hash)
                .or_insert_with(|| Arc::new(AsyncMutex::new(())))
                .clone();
            let held = gate.lock().await;
            if self.contains(&at.hash) {
                // Another reader fetched it while this one waited.
                continue;
            }
            let fetched = self.fetch(source, at, max_len).await;
            drop(held);
            self.fetching.locked().remove(&at.hash);
            let (raw, stored) = fetched?;
            return Ok(match range {
                Some((offset, len)) => (raw[offset..offset + len].to_vec(), stored),
                None => (raw, stored),
            });
        }
    }

    /// Fetches the chunk `at` names, checks it and caches it; its content
    /// and its stored length.
    async fn fetch(
        &self,
        source: &impl ChunkSource,
        at: &ChunkAt,
        max_len: u64,
    ) -> Result<(Vec<u8>, u64), StorageError> {
        let (raw, stored_len) = source.fetch_chunk(at, max_len).await?;
        self.fetches.fetch_add(1, Ordering::Relaxed);
        self.fetched_bytes.fetch_add(stored_len, Ordering::Relaxed);
        let size = raw.len() as u64;
        if size > self.limit {
            // Larger than the whole cache: served, not kept.
            return Ok((raw, stored_len));
        }
        // Room first, so that the directory never holds more than the
        // limit: the victims' files go before this one is written.
        let victims = {
            let mut lru = self.lru.locked();
            let v = lru.make_room(self.limit, size);
            lru.reserved += size;
            v
        };
        self.evictions
            .fetch_add(victims.len() as u64, Ordering::Relaxed);
        let gone: Vec<PathBuf> = victims.iter().map(|h| self.path(h)).collect();
        let path = self.path(&at.hash);
        let temp = self.dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            self.temp.fetch_add(1, Ordering::Relaxed)
        ));
        let written = blocking(move || {
            for p in gone {
                let _ = std::fs::remove_file(p);
            }
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| StorageError::io(parent, e))?;
            }
            std::fs::write(&temp, &raw).map_err(|e| StorageError::io(&temp, e))?;
            std::fs::rename(&temp, &path).map_err(|e| StorageError::io(&path, e))?;
            Ok((raw, stored_len))
        })
        .await;
        let mut lru = self.lru.locked();
        lru.reserved -= size;
        if written.is_ok() {
            lru.insert(at.hash, size);
        }
        written
    }
}
