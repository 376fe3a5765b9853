//! The storage suite, once for every backend: `local.rs` runs it on a
//! local directory, `seaweedfs.rs` on a SeaweedFS S3 server on loopback
//! (`scripts/object-store`). Each scenario takes a [`Backend`]: a store of
//! its own (a directory, or a prefix of the bucket) and how long to wait
//! for the store's clock to tick (S3 dates have one-second resolution).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use object_store::path::Path as Key;
use object_store::ObjectStoreExt;
use torpor_storage::{
    ChunkCache, ChunkHash, GcOptions, GcStage, ManifestId, NameSpace, Storage, StorageError,
    StorageOptions, UploadOptions, UploadStage,
};

pub const MIB: u64 = 1 << 20;

/// A store for one scenario, and scratch space beside it.
pub struct Backend {
    pub storage: Storage,
    /// Longer than one tick of the store's modification times.
    pub tick: Duration,
    pub scratch: tempfile::TempDir,
}

impl Backend {
    pub fn new(storage: Storage, tick: Duration) -> Self {
        Self {
            storage,
            tick,
            scratch: tempfile::tempdir().unwrap(),
        }
    }

    pub fn dir(&self, name: &str) -> PathBuf {
        let d = self.scratch.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Waits until the store's clock has moved past everything so far.
    pub async fn tick(&self) {
        tokio::time::sleep(self.tick).await;
    }
}

/// The options the suite runs with: no grace period (the races are the
/// protocol's, not the grace's), short waits.
pub fn test_options() -> StorageOptions {
    StorageOptions {
        grace: Duration::ZERO,
        lease_ttl: Duration::from_secs(20),
        poll: Duration::from_millis(50),
        gc_wait_limit: Duration::from_secs(60),
        ..StorageOptions::default()
    }
}

/// `len` bytes of guest-memory-like content from `seed`: each page half
/// noise, half a repeated pattern (LZ4 halves it).
pub fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = vec![0u8; len];
    for (i, b) in out.iter_mut().enumerate() {
        if i % 4096 < 2048 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        } else {
            *b = (i % 251) as u8 | 1;
        }
    }
    out
}

/// A sparse file of `len` bytes holding `parts` (offset, bytes).
pub fn sparse_file(path: &Path, len: u64, parts: &[(u64, Vec<u8>)]) {
    let f = File::create(path).unwrap();
    f.set_len(len).unwrap();
    for (at, bytes) in parts {
        f.write_all_at(bytes, *at).unwrap();
    }
    f.sync_all().unwrap();
}

/// A layer like a snapshot's: `memory` (sparse), `state`, and a disk diff
/// in a subdirectory; `chunks` data chunks of `memory` from `seeds`.
pub fn layer(dir: &Path, seeds: &[u64]) {
    let parts: Vec<(u64, Vec<u8>)> = seeds
        .iter()
        .enumerate()
        .map(|(i, s)| (i as u64 * 2 * MIB, content(*s, MIB as usize)))
        .collect();
    sparse_file(&dir.join("memory"), seeds.len() as u64 * 2 * MIB, &parts);
    std::fs::write(dir.join("state"), content(7, 5000)).unwrap();
    std::fs::create_dir_all(dir.join("disks")).unwrap();
    sparse_file(
        &dir.join("disks/root.diff"),
        3 * MIB,
        &[(MIB, content(8, 4096))],
    );
}

fn assert_same_tree(a: &Path, b: &Path, files: &[&str]) {
    for f in files {
        let (x, y) = (
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
        );
        assert!(x == y, "{f} differs after the round trip");
        let (mx, my) = (
            std::fs::metadata(a.join(f)).unwrap(),
            std::fs::metadata(b.join(f)).unwrap(),
        );
        assert_eq!(
            mx.permissions().mode() & 0o777,
            my.permissions().mode() & 0o777,
            "{f}"
        );
    }
}

fn chunk_key(hash: &ChunkHash) -> Key {
    Key::from(hash.key())
}

async fn chunk_exists(storage: &Storage, hash: &ChunkHash) -> bool {
    storage.object_store().head(&chunk_key(hash)).await.is_ok()
}

async fn every_chunk_exists(storage: &Storage, id: &ManifestId) -> bool {
    let m = storage.manifest(id).await.unwrap();
    for h in m.chunk_set() {
        if !chunk_exists(storage, &h).await {
            return false;
        }
    }
    true
}

/// A sparse file of several chunks, with holes, a partial last chunk and
/// zero pages inside data chunks, goes up and comes back byte for byte,
/// its holes still holes; random reads match too.
pub async fn round_trip_of_a_sparse_multi_chunk_file(b: &Backend) {
    let src = b.dir("src");
    let len = 8 * MIB + 37;
    let mut zero_inside = content(2, MIB as usize);
    zero_inside[8192..3 * 4096].fill(0);
    let parts = vec![
        (0, content(1, MIB as usize)),
        (3 * MIB, zero_inside),
        (7 * MIB + 4096, content(3, 100)),
        (8 * MIB, content(4, 37)),
    ];
    sparse_file(&src.join("memory"), len, &parts);
    std::fs::write(src.join("state"), content(5, 9000)).unwrap();
    std::fs::set_permissions(src.join("state"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::create_dir_all(src.join("disks")).unwrap();
    sparse_file(
        &src.join("disks/root.diff"),
        2 * MIB,
        &[(MIB + 512, content(6, 4096))],
    );
    // A snapshot writer's leftover is not part of the layer.
    std::fs::write(src.join(".memory.tmp-1-2"), b"partial").unwrap();

    let up = b.storage.upload_layer(&src).await.unwrap();
    assert_eq!(up.files, 3);
    assert_eq!(up.logical_bytes, len + 9000 + 2 * MIB);
    // memory: 9 chunks, 4 with data; state: 1; root.diff: 2 chunks, 1.
    assert_eq!(up.chunks, 6, "{up:?}");
    assert_eq!(up.holes, 6, "{up:?}");
    assert_eq!(up.new_chunks, 6);
    assert!(up.uploaded_bytes < up.new_bytes, "compressed: {up:?}");

    let dst = b.dir("dst");
    let down = b.storage.download_layer(&up.id, &dst).await.unwrap();
    assert_eq!(down.chunks, 6);
    assert_eq!(down.data_bytes, up.data_bytes);
    assert_same_tree(&src, &dst, &["memory", "state", "disks/root.diff"]);
    assert!(!dst.join(".memory.tmp-1-2").exists());
    let memory = std::fs::metadata(dst.join("memory")).unwrap();
    assert_eq!(memory.len(), len);
    // Holes stay holes: about 2 MiB of data, 2 pages of zeros left out too.
    let allocated = memory.blocks() * 512;
    assert!(
        allocated <= 2 * MIB + 64 * 1024,
        "{allocated} bytes allocated"
    );
    let stray: Vec<_> = std::fs::read_dir(&dst)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(stray.is_empty(), "{stray:?}");

    let cache = ChunkCache::open(&b.dir("cache"), 64 * MIB).unwrap();
    let reader = b.storage.open_layer(&up.id, cache.clone()).await.unwrap();
    let whole = std::fs::read(src.join("memory")).unwrap();
    for (at, n) in [
        (0, 10),
        (MIB - 5, 10),
        (MIB, MIB),
        (3 * MIB + 8000, 9000),
        (2 * MIB + 100, 2 * MIB),
        (len - 40, 40),
        (0, len),
    ] {
        let got = reader.read_at("memory", at, n).await.unwrap();
        assert!(
            got == whole[at as usize..(at + n) as usize],
            "read {n} at {at}"
        );
    }
    assert_eq!(reader.file_len("memory"), Some(len));
    let e = reader.read_at("memory", len - 1, 2).await.unwrap_err();
    assert!(matches!(e, StorageError::OutOfRange { .. }), "{e}");
    let e = reader.read_at("swap", 0, 1).await.unwrap_err();
    assert!(matches!(e, StorageError::NoSuchFile { .. }), "{e}");
    // Four data chunks of memory were read, each fetched once.
    assert_eq!(cache.stats().fetches, 4, "{:?}", cache.stats());

    let listed = b.storage.list_manifests().await.unwrap();
    assert_eq!(listed, vec![up.id.clone()]);
}

/// Two layers sharing most chunks: the second stores only what differs.
pub async fn dedupe_across_layers_sharing_most_chunks(b: &Backend) {
    let seeds: Vec<u64> = (100..116).collect();
    let base = b.dir("base");
    layer(&base, &seeds);
    let first = b.storage.upload_layer(&base).await.unwrap();
    assert_eq!(first.new_chunks, 18, "{first:?}");

    let mut changed = seeds.clone();
    changed[3] = 900;
    changed[11] = 901;
    let next = b.dir("next");
    layer(&next, &changed);
    let second = b.storage.upload_layer(&next).await.unwrap();
    assert_eq!(second.chunks, 18);
    assert_eq!(second.new_chunks, 2, "{second:?}");
    assert_eq!(second.new_bytes, 2 * MIB);
    // 16 chunks of memory, the state, a whole chunk of the disk diff.
    assert_eq!(second.data_bytes, 17 * MIB + 5000);
    let ratio = second.dedupe_ratio();
    assert!(ratio > 8.4 && ratio < 8.6, "dedupe ratio {ratio}");
    // Both layers: 36 chunks named, 20 stored.
    let named = first.data_bytes + second.data_bytes;
    let stored = first.new_bytes + second.new_bytes;
    let overall = named as f64 / stored as f64;
    assert!(overall > 1.75, "{overall}");
    // A layer identical to one stored stores nothing.
    let again = b.storage.upload_layer(&next).await.unwrap();
    assert_eq!(again.new_chunks, 0);
    assert_eq!(again.uploaded_bytes, 0);
    assert_ne!(again.id, second.id);
    let dst = b.dir("dst");
    b.storage.download_layer(&second.id, &dst).await.unwrap();
    assert_same_tree(&next, &dst, &["memory", "state", "disks/root.diff"]);
}

/// A chunk corrupted in the store fails the download and the reads that
/// need it, with an error naming the layer, the file and the chunk; other
/// chunks still read; a missing chunk is reported as missing.
pub async fn corrupted_chunk_is_detected_and_named(b: &Backend) {
    let src = b.dir("src");
    layer(&src, &[11, 12, 13, 14]);
    let up = b.storage.upload_layer(&src).await.unwrap();
    let manifest = b.storage.manifest(&up.id).await.unwrap();
    let memory = manifest.file("memory").unwrap().expand();
    // Chunk 4 of memory (its third data chunk).
    let victim = memory[4].expect("data");
    let key = chunk_key(&victim);
    let store = b.storage.object_store();
    let mut bytes = store
        .get(&key)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    store.put(&key, bytes.into()).await.unwrap();

    let e = b
        .storage
        .download_layer(&up.id, &b.dir("dst"))
        .await
        .unwrap_err();
    match &e {
        StorageError::ChunkCorrupt { at, .. } => {
            assert_eq!(at.layer, up.id);
            assert_eq!(at.file, "memory");
            assert_eq!(at.index, 4);
            assert_eq!(at.hash, victim);
        }
        other => panic!("not a corrupt chunk: {other}"),
    }
    let text = e.to_string();
    assert!(
        text.contains(up.id.as_str()) && text.contains("chunk 4"),
        "{text}"
    );
    assert_eq!(
        dir_bytes(&b.dir("dst")),
        0,
        "a failed download leaves no file"
    );
    assert!(!b.dir("dst").join("memory").exists());

    let cache = ChunkCache::open(&b.dir("cache"), 64 * MIB).unwrap();
    let reader = b.storage.open_layer(&up.id, cache).await.unwrap();
    let e = reader
        .read_at("memory", 4 * MIB + 10, 10)
        .await
        .unwrap_err();
    assert!(matches!(e, StorageError::ChunkCorrupt { .. }), "{e}");
    let fine = reader.read_at("memory", 2 * MIB, 4096).await.unwrap();
    assert_eq!(fine, content(12, 4096));

    store.delete(&key).await.unwrap();
    let e = reader.read_at("memory", 4 * MIB, 1).await.unwrap_err();
    assert!(
        matches!(e, StorageError::ChunkMissing { ref at } if at.index == 4),
        "{e}"
    );
    assert!(e.to_string().contains("missing"), "{e}");
}

/// The cache's directory never holds more than its limit; the least
/// recently used chunk goes first; concurrent readers of one chunk fetch
/// it once; a reopened cache keeps what it had and drops a torn file.
pub async fn lru_cache_holds_its_bound(b: &Backend) {
    let src = b.dir("src");
    let seeds: Vec<u64> = (200..210).collect();
    layer(&src, &seeds);
    let up = b.storage.upload_layer(&src).await.unwrap();
    let cache_dir = b.dir("cache");
    let limit = 3 * MIB + MIB / 2;
    let cache = ChunkCache::open(&cache_dir, limit).unwrap();
    let reader = b.storage.open_layer(&up.id, cache.clone()).await.unwrap();
    for i in 0..seeds.len() as u64 {
        let got = reader.read_at("memory", i * 2 * MIB + 7, 3).await.unwrap();
        assert_eq!(got, content(seeds[i as usize], 10)[7..10]);
        let on_disk = dir_bytes(&cache_dir);
        assert!(on_disk <= limit, "{on_disk} bytes cached, limit {limit}");
        assert!(cache.stats().bytes <= limit);
    }
    let s = cache.stats();
    assert_eq!((s.fetches, s.chunks, s.evictions), (10, 3, 7), "{s:?}");
    // The three most recent are cached; the first is not.
    reader.read_at("memory", 9 * 2 * MIB, 1).await.unwrap();
    assert_eq!(cache.stats().hits, 1);
    reader.read_at("memory", 0, 1).await.unwrap();
    assert_eq!(cache.stats().fetches, 11);
    // Using chunk 8 makes chunk 9 the oldest: the next fetch evicts 9.
    reader.read_at("memory", 8 * 2 * MIB, 1).await.unwrap();
    reader.read_at("memory", 2 * 2 * MIB, 1).await.unwrap();
    let cached: Vec<u64> = (0..10)
        .filter(|i| {
            let h = reader.manifest().file("memory").unwrap().expand()[*i as usize * 2].unwrap();
            cache.contains(&h)
        })
        .collect();
    assert_eq!(cached, vec![0, 2, 8]);

    // Sixteen readers of one chunk, none cached: one fetch.
    let fresh = ChunkCache::open(&b.dir("fresh"), 64 * MIB).unwrap();
    let reader = Arc::new(b.storage.open_layer(&up.id, fresh.clone()).await.unwrap());
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let r = reader.clone();
            tokio::spawn(async move { r.read_at("memory", 5 * 2 * MIB + i * 100, 100).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let s = fresh.stats();
    assert_eq!((s.fetches, s.hits), (1, 15), "{s:?}");

    // Reopened: the chunks are still there, a torn one is dropped.
    drop(reader);
    let h = cache.stats();
    drop(cache);
    let victim = std::fs::read_dir(&cache_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .flat_map(|fan| {
            std::fs::read_dir(fan.path())
                .unwrap()
                .filter_map(|e| e.ok())
        })
        .map(|e| e.path())
        .next()
        .unwrap();
    OpenOptions::new()
        .write(true)
        .open(&victim)
        .unwrap()
        .set_len(100)
        .unwrap();
    std::fs::write(cache_dir.join(".tmp-1-1"), b"x").unwrap();
    let again = ChunkCache::open(&cache_dir, limit).unwrap();
    assert_eq!(again.stats().chunks, h.chunks - 1);
    assert!(!victim.exists() && !cache_dir.join(".tmp-1-1").exists());
}

/// Downloads through a store with a chunk cache fetch only what the cache
/// lacks: a second layer sharing most chunks with one downloaded before
/// fetches only its own; the same layer again fetches nothing; the files
/// are the same either way.
pub async fn downloads_through_the_cache_fetch_only_what_it_lacks(b: &Backend) {
    let seeds: Vec<u64> = (300..308).collect();
    let (one, two) = (b.dir("one"), b.dir("two"));
    layer(&one, &seeds);
    let mut changed = seeds.clone();
    changed[5] = 999;
    layer(&two, &changed);
    let first = b.storage.upload_layer(&one).await.unwrap();
    let second = b.storage.upload_layer(&two).await.unwrap();
    let cache = ChunkCache::open(&b.dir("cache"), 64 * MIB).unwrap();
    let cached = b.storage.with_cache(cache.clone());
    // How much of each layer the cache holds (a cluster's placement).
    let chunks_of = |m: torpor_storage::Manifest| m.chunk_lengths();
    let one_chunks = chunks_of(b.storage.manifest(&first.id).await.unwrap());
    let two_chunks = chunks_of(b.storage.manifest(&second.id).await.unwrap());
    let held = |chunks: &[(torpor_storage::ChunkHash, u64)]| {
        cache.cached_bytes(chunks.iter().map(|(h, _)| h))
    };
    let total = |chunks: &[(torpor_storage::ChunkHash, u64)]| -> u64 {
        chunks.iter().map(|(_, n)| n).sum()
    };
    assert_eq!(held(&one_chunks), 0);

    let a = cached.download_layer(&first.id, &b.dir("a")).await.unwrap();
    assert_eq!(a.from_cache, 0, "{a:?}");
    assert!(a.fetched_bytes > 0, "{a:?}");
    assert_eq!(held(&one_chunks), total(&one_chunks));
    // All of the second but its changed memory chunk.
    let missing = total(&two_chunks) - held(&two_chunks);
    assert!(missing > 0 && missing <= MIB, "{missing}");
    // The second layer: only its changed memory chunk is not cached (its
    // state and disk diff are the first's too).
    let d = cached
        .download_layer(&second.id, &b.dir("d"))
        .await
        .unwrap();
    assert_eq!(d.chunks - d.from_cache, 1, "{d:?}");
    assert!(d.fetched_bytes < a.fetched_bytes / 3, "{a:?} {d:?}");
    assert_same_tree(&two, &b.dir("d"), &["memory", "state", "disks/root.diff"]);
    // The first again: all from the cache.
    let again = cached
        .download_layer(&first.id, &b.dir("again"))
        .await
        .unwrap();
    assert_eq!(
        (again.from_cache, again.fetched_bytes),
        (again.chunks, 0),
        "{again:?}"
    );
    assert_same_tree(
        &one,
        &b.dir("again"),
        &["memory", "state", "disks/root.diff"],
    );
    let s = cache.stats();
    assert_eq!(s.fetches, a.chunks + 1, "{s:?}");
    // Without the cache, all of it again.
    let plain = b
        .storage
        .download_layer(&first.id, &b.dir("plain"))
        .await
        .unwrap();
    assert_eq!(plain.from_cache, 0);
    assert_eq!(plain.fetched_bytes, a.fetched_bytes);
}

fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).unwrap().filter_map(|e| e.ok()) {
        let m = e.metadata().unwrap();
        total += if m.is_dir() {
            dir_bytes(&e.path())
        } else {
            m.len()
        };
    }
    total
}

/// A manifest deleted: the next collection takes its chunks that no other
/// manifest names, and only those.
pub async fn deleted_manifest_unshared_chunks_are_collected(b: &Backend) {
    let a = b.dir("a");
    layer(&a, &[300, 301, 302, 303]);
    let c = b.dir("c");
    layer(&c, &[300, 301, 310, 311]);
    let la = b.storage.upload_layer(&a).await.unwrap();
    let lc = b.storage.upload_layer(&c).await.unwrap();
    let ma = b.storage.manifest(&la.id).await.unwrap();
    let mc = b.storage.manifest(&lc.id).await.unwrap();
    let only_a: Vec<ChunkHash> = ma
        .chunk_set()
        .difference(&mc.chunk_set())
        .copied()
        .collect();
    assert_eq!(only_a.len(), 2);

    let gc = b.storage.collect_garbage().await.unwrap();
    assert_eq!((gc.deleted, gc.manifests), (0, 2), "{gc:?}");

    assert!(b.storage.delete_manifest(&la.id).await.unwrap());
    assert!(!b.storage.delete_manifest(&la.id).await.unwrap());
    b.tick().await;
    let gc = b.storage.collect_garbage().await.unwrap();
    assert_eq!(gc.deleted, 2, "{gc:?}");
    assert_eq!(gc.manifests, 1);
    assert!(gc.deleted_bytes > 0);
    for h in &only_a {
        assert!(!chunk_exists(&b.storage, h).await);
    }
    assert!(every_chunk_exists(&b.storage, &lc.id).await);
    let e = b.storage.manifest(&la.id).await.unwrap_err();
    assert!(matches!(e, StorageError::ManifestNotFound { .. }), "{e}");
    b.storage
        .download_layer(&lc.id, &b.dir("dst"))
        .await
        .unwrap();
    let gc = b.storage.collect_garbage().await.unwrap();
    assert_eq!(gc.deleted, 0);

    // With a grace period, young garbage is left for later.
    assert!(b.storage.delete_manifest(&lc.id).await.unwrap());
    let patient = b.storage.with_options(StorageOptions {
        grace: Duration::from_secs(3600),
        ..test_options()
    });
    let gc = patient.collect_garbage().await.unwrap();
    assert_eq!((gc.deleted, gc.spared_young), (0, gc.chunks), "{gc:?}");
}

/// A name stands for one manifest at a time: written, read, moved to
/// another upload (the one it named before is returned for its writer to
/// delete), listed, removed; a collection keeps a named layer's chunks;
/// a name that cannot be a key is refused before any request.
pub async fn named_layers_point_at_their_manifests(b: &Backend) {
    let space = NameSpace::Images;
    let (a, c) = (b.dir("a"), b.dir("c"));
    layer(&a, &[400, 401]);
    layer(&c, &[400, 402]);
    let la = b.storage.upload_layer(&a).await.unwrap();
    let lc = b.storage.upload_layer(&c).await.unwrap();
    assert_eq!(b.storage.named_layer(space, "deb").await.unwrap(), None);
    let before = b.storage.name_layer(space, "deb", &la.id).await.unwrap();
    assert_eq!(before, None);
    assert_eq!(
        b.storage.name_layer(space, "deb", &la.id).await.unwrap(),
        None,
        "the same manifest again is not one to delete"
    );
    b.storage.name_layer(space, "alp", &la.id).await.unwrap();
    let before = b.storage.name_layer(space, "deb", &lc.id).await.unwrap();
    assert_eq!(before.as_ref(), Some(&la.id));
    assert_eq!(
        b.storage.named_layer(space, "deb").await.unwrap().as_ref(),
        Some(&lc.id)
    );
    assert_eq!(b.storage.names(space).await.unwrap(), ["alp", "deb"]);
    b.tick().await;
    let gc = b.storage.collect_garbage().await.unwrap();
    assert_eq!(gc.deleted, 0, "{gc:?}");
    let back = b.dir("back");
    b.storage.download_layer(&lc.id, &back).await.unwrap();
    assert_same_tree(&c, &back, &["memory", "state", "disks/root.diff"]);

    let removed = b.storage.remove_name(space, "deb").await.unwrap();
    assert_eq!(removed.as_ref(), Some(&lc.id));
    assert_eq!(b.storage.remove_name(space, "deb").await.unwrap(), None);
    assert_eq!(b.storage.names(space).await.unwrap(), ["alp"]);
    for bad in ["", ".x", "a/b", "../m"] {
        let e = b.storage.named_layer(space, bad).await.unwrap_err();
        assert!(matches!(e, StorageError::BadName { .. }), "{bad}: {e}");
        let e = b.storage.name_layer(space, bad, &la.id).await.unwrap_err();
        assert!(matches!(e, StorageError::BadName { .. }), "{bad}: {e}");
    }
}

/// A collection while an upload has stored its chunks but not written its
/// manifest: the new chunks are spared (the upload's lease).
pub async fn gc_spares_the_chunks_of_an_upload_in_progress(b: &Backend) {
    let src = b.dir("src");
    layer(&src, &[400, 401, 402]);
    let (opts, mut pause) = UploadOptions::pause_at(UploadStage::ChunksStored);
    let storage = b.storage.clone();
    let upload = tokio::spawn(async move { storage.upload_layer_with(&src, opts).await });
    pause.reached().await;
    b.tick().await;
    let gc = b.storage.collect_garbage().await.unwrap();
    assert_eq!(gc.live_leases, 1, "{gc:?}");
    assert_eq!((gc.deleted, gc.spared_young), (0, 5), "{gc:?}");
    pause.resume();
    let up = upload.await.unwrap().unwrap();
    assert!(every_chunk_exists(&b.storage, &up.id).await);
    assert_eq!(up.restored_chunks, 0);
    b.storage
        .download_layer(&up.id, &b.dir("dst"))
        .await
        .unwrap();
}

/// The race: an upload finds a chunk already stored (by a layer then
/// deleted) and skips it; a collection takes it before the manifest is
/// written. The upload sees that a collection ran, looks again, and stores
/// the chunk once more: its manifest names no missing chunk.
pub async fn gc_taking_a_reused_chunk_mid_upload_is_repaired(b: &Backend) {
    let old = b.dir("old");
    layer(&old, &[500, 501, 502]);
    let first = b.storage.upload_layer(&old).await.unwrap();
    b.tick().await;
    let new = b.dir("new");
    layer(&new, &[500, 501, 502, 503]);
    let (opts, mut pause) = UploadOptions::pause_at(UploadStage::ChunksStored);
    let storage = b.storage.clone();
    let upload = tokio::spawn(async move { storage.upload_layer_with(&new, opts).await });
    pause.reached().await;
    assert!(b.storage.delete_manifest(&first.id).await.unwrap());
    let gc = b.storage.collect_garbage().await.unwrap();
    // The old layer's chunks, older than the upload's lease, are gone.
    assert_eq!(gc.deleted, 5, "{gc:?}");
    pause.resume();
    let up = upload.await.unwrap().unwrap();
    assert!(up.rechecked);
    assert_eq!(up.restored_chunks, 5, "{up:?}");
    assert!(every_chunk_exists(&b.storage, &up.id).await);
    let dst = b.dir("dst");
    b.storage.download_layer(&up.id, &dst).await.unwrap();
    assert_same_tree(&b.dir("new"), &dst, &["memory", "state", "disks/root.diff"]);
}

/// A collection that starts once the upload's lease names its pending
/// manifest spares every chunk of it, shared ones too.
pub async fn gc_spares_the_pending_manifest_of_an_upload(b: &Backend) {
    let old = b.dir("old");
    layer(&old, &[600, 601]);
    let first = b.storage.upload_layer(&old).await.unwrap();
    b.tick().await;
    let new = b.dir("new");
    layer(&new, &[600, 601, 602]);
    let (opts, mut pause) = UploadOptions::pause_at(UploadStage::ManifestPending);
    let storage = b.storage.clone();
    let upload = tokio::spawn(async move { storage.upload_layer_with(&new, opts).await });
    pause.reached().await;
    assert!(b.storage.delete_manifest(&first.id).await.unwrap());
    let gc = b.storage.collect_garbage().await.unwrap();
    assert_eq!((gc.deleted, gc.referenced), (0, gc.chunks), "{gc:?}");
    pause.resume();
    let up = upload.await.unwrap().unwrap();
    assert_eq!(up.restored_chunks, 0, "{up:?}");
    assert!(every_chunk_exists(&b.storage, &up.id).await);
}

/// A collection already deleting when an upload is about to write its
/// manifest: the upload waits for it to end, then stores again what it
/// took.
pub async fn upload_waits_for_a_running_gc_then_repairs(b: &Backend) {
    let old = b.dir("old");
    layer(&old, &[700, 701]);
    let first = b.storage.upload_layer(&old).await.unwrap();
    assert!(b.storage.delete_manifest(&first.id).await.unwrap());
    b.tick().await;
    let (opts, mut gc_pause) = GcOptions::pause_at(GcStage::Marked);
    let storage = b.storage.clone();
    let gc = tokio::spawn(async move { storage.collect_garbage_with(opts).await });
    gc_pause.reached().await;

    let new = b.dir("new");
    layer(&new, &[700, 701, 702]);
    // The upload is held once its pending manifest is written, so it has
    // reached its check of the collections before the one paused ends
    // (on a loaded machine, a sleep alone let the collection end before
    // the upload had begun: nothing to recheck).
    let (opts, mut up_pause) = UploadOptions::pause_at(UploadStage::ManifestPending);
    let storage = b.storage.clone();
    let upload = tokio::spawn(async move { storage.upload_layer_with(&new, opts).await });
    up_pause.reached().await;
    up_pause.resume();
    tokio::time::sleep(Duration::from_millis(500) + b.tick).await;
    assert!(!upload.is_finished(), "the upload waits for the collection");
    gc_pause.resume();
    let gc = gc.await.unwrap().unwrap();
    assert_eq!(gc.deleted, 4, "{gc:?}");
    let up = upload.await.unwrap().unwrap();
    assert!(up.rechecked, "{up:?} {gc:?}");
    assert_eq!(up.restored_chunks, 4, "{up:?}");
    assert!(every_chunk_exists(&b.storage, &up.id).await);
    b.storage
        .download_layer(&up.id, &b.dir("dst"))
        .await
        .unwrap();
}

/// A lease its upload stopped refreshing (a crashed pod) protects
/// nothing: the next collection removes it and takes the chunks its
/// pending manifest named, once no manifest names them.
pub async fn a_stale_lease_is_removed(b: &Backend) {
    let src = b.dir("src");
    layer(&src, &[800, 801]);
    let up = b.storage.upload_layer(&src).await.unwrap();
    let manifest = b.storage.manifest(&up.id).await.unwrap();
    let body = serde_json::json!({
        "version": 1,
        "started_ms": null,
        "ttl_ms": 1,
        "holder": "a pod that crashed",
        "manifest": manifest,
    });
    let key = Key::from("leases/1-crashed");
    let store = b.storage.object_store();
    store
        .put(&key, serde_json::to_vec(&body).unwrap().into())
        .await
        .unwrap();
    assert!(b.storage.delete_manifest(&up.id).await.unwrap());
    b.tick().await;
    let gc = b.storage.collect_garbage().await.unwrap();
    assert_eq!((gc.stale_leases, gc.live_leases), (1, 0), "{gc:?}");
    assert_eq!(gc.deleted, 4, "{gc:?}");
    assert!(store.head(&key).await.is_err(), "the stale lease is gone");
}
