//! A layer's manifest: its files, each one's length, mode and chunk list
//! (a chunk's hash, or a run of all-zero chunks that are stored nowhere),
//! as versioned JSON under `manifests/<id>`. An upload writes it after
//! every chunk it names is stored, so a manifest in the store never names
//! a missing chunk (until a garbage collection is wrong, which the
//! readers report as [`crate::StorageError::ChunkMissing`]).
//!
//! ```json
//! {"version":1,"chunk_size":1048576,"files":[
//!   {"path":"memory","len":268435456,"mode":384,"chunks":["9f2c…",3,"07ab…",252]},
//!   {"path":"state","len":41022,"mode":384,"chunks":["c1d0…"]}]}
//! ```

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::chunk::{ChunkHash, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};
use crate::error::StorageError;

/// The manifest format this crate writes and reads.
pub const MANIFEST_VERSION: u32 = 1;

/// One entry of a file's chunk list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ChunkRun {
    /// A stored chunk.
    Data(ChunkHash),
    /// This many all-zero chunks in a row: stored nowhere, read as zeros.
    Holes(u64),
}

/// One file of a layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Its path inside the layer directory, `/`-separated, relative.
    pub path: String,
    /// Its length in bytes.
    pub len: u64,
    /// Its permission bits.
    pub mode: u32,
    /// Its chunks in order, runs of holes counted.
    pub chunks: Vec<ChunkRun>,
}

impl FileEntry {
    /// Its chunk list with runs expanded: `None` for a hole.
    pub fn expand(&self) -> Vec<Option<ChunkHash>> {
        let mut out = Vec::new();
        for run in &self.chunks {
            match *run {
                ChunkRun::Data(h) => out.push(Some(h)),
                ChunkRun::Holes(n) => out.extend(std::iter::repeat_n(None, n as usize)),
            }
        }
        out
    }

    /// The chunk list of `chunks` (one entry per chunk), holes run-length
    /// counted.
    pub fn runs(chunks: &[Option<ChunkHash>]) -> Vec<ChunkRun> {
        let mut out: Vec<ChunkRun> = Vec::new();
        for c in chunks {
            match (c, out.last_mut()) {
                (Some(h), _) => out.push(ChunkRun::Data(*h)),
                (None, Some(ChunkRun::Holes(n))) => *n += 1,
                (None, _) => out.push(ChunkRun::Holes(1)),
            }
        }
        out
    }

    /// How many chunks the list covers.
    fn count(&self) -> u64 {
        self.chunks
            .iter()
            .map(|r| match r {
                ChunkRun::Data(_) => 1,
                ChunkRun::Holes(n) => *n,
            })
            .sum()
    }
}

/// A layer's manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub version: u32,
    /// The chunk size its files were cut at.
    pub chunk_size: u64,
    /// Its files, sorted by path.
    pub files: Vec<FileEntry>,
}

impl Manifest {
    /// The file at `path`.
    pub fn file(&self, path: &str) -> Option<&FileEntry> {
        self.files.iter().find(|f| f.path == path)
    }

    /// Every stored chunk it names, once each.
    pub fn chunk_set(&self) -> HashSet<ChunkHash> {
        self.files
            .iter()
            .flat_map(|f| &f.chunks)
            .filter_map(|r| match r {
                ChunkRun::Data(h) => Some(*h),
                ChunkRun::Holes(_) => None,
            })
            .collect()
    }

    /// Every stored chunk it names, once each, with its length (the last
    /// chunk of a file may be short), in the order first named.
    pub fn chunk_lengths(&self) -> Vec<(ChunkHash, u64)> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for f in &self.files {
            for (i, c) in f.expand().iter().enumerate() {
                if let Some(h) = c.filter(|h| seen.insert(*h)) {
                    let start = i as u64 * self.chunk_size;
                    out.push((h, (f.len - start).min(self.chunk_size)));
                }
            }
        }
        out
    }

    /// The files' lengths added up.
    pub fn logical_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.len).sum()
    }

    /// The bytes of its stored chunks (holes left out), shared ones
    /// counted each time.
    pub fn data_bytes(&self) -> u64 {
        let mut total = 0;
        for f in &self.files {
            for (i, c) in f.expand().iter().enumerate() {
                if c.is_some() {
                    let start = i as u64 * self.chunk_size;
                    total += (f.len - start).min(self.chunk_size);
                }
            }
        }
        total
    }

    /// The JSON bytes stored.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a manifest serialises")
    }

    /// A manifest read from `bytes` (stored under `id`), checked: its
    /// version, chunk size, paths and chunk counts.
    pub fn from_bytes(id: &str, bytes: &[u8]) -> Result<Self, StorageError> {
        let invalid = |why: String| StorageError::ManifestInvalid {
            id: id.to_string(),
            why,
        };
        // The version first, so a newer format says so rather than failing
        // to decode.
        #[derive(Deserialize)]
        struct Version {
            version: u32,
        }
        let v: Version = serde_json::from_slice(bytes).map_err(|e| invalid(e.to_string()))?;
        if v.version != MANIFEST_VERSION {
            return Err(invalid(format!(
                "format version {} (this torpor reads {MANIFEST_VERSION})",
                v.version
            )));
        }
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| invalid(e.to_string()))?;
        m.check().map_err(invalid)?;
        Ok(m)
    }

    /// Whether it holds together.
    fn check(&self) -> Result<(), String> {
        let cs = self.chunk_size;
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&cs) || !cs.is_power_of_two() {
            return Err(format!(
                "chunk size {cs}: a power of two from {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE}"
            ));
        }
        let mut seen = HashSet::new();
        for f in &self.files {
            check_path(&f.path).map_err(|why| format!("file {:?}: {why}", f.path))?;
            if !seen.insert(f.path.as_str()) {
                return Err(format!("file {:?} twice", f.path));
            }
            if f.count() != f.len.div_ceil(cs) {
                return Err(format!(
                    "file {:?}: {} chunks for {} bytes",
                    f.path,
                    f.count(),
                    f.len
                ));
            }
        }
        Ok(())
    }
}

/// Whether `path` is a relative `/`-separated path with no empty, `.` or
/// `..` segment (it is joined to a directory on download).
pub(crate) fn check_path(path: &str) -> Result<(), &'static str> {
    if path.is_empty() || path.starts_with('/') {
        return Err("not a relative path");
    }
    if path
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == ".." || s.contains('\0'))
    {
        return Err("an empty, . or .. segment");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        let a = ChunkHash::of(b"a");
        let b = ChunkHash::of(b"b");
        let chunks = [Some(a), None, None, None, Some(b), None];
        Manifest {
            version: MANIFEST_VERSION,
            chunk_size: 4096,
            files: vec![FileEntry {
                path: "memory".into(),
                len: 5 * 4096 + 100,
                mode: 0o600,
                chunks: FileEntry::runs(&chunks),
            }],
        }
    }

    #[test]
    fn runs_count_holes_and_round_trip() {
        let m = sample();
        let f = &m.files[0];
        assert_eq!(f.chunks.len(), 4);
        assert_eq!(f.chunks[1], ChunkRun::Holes(3));
        assert_eq!(f.expand().len(), 6);
        let bytes = m.to_bytes();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.contains(",3,"), "{text}");
        assert_eq!(Manifest::from_bytes("x", &bytes).unwrap(), m);
        assert_eq!(m.chunk_set().len(), 2);
        assert_eq!(m.data_bytes(), 2 * 4096);
        let a = ChunkHash::of(b"a");
        let b = ChunkHash::of(b"b");
        assert_eq!(m.chunk_lengths(), [(a, 4096), (b, 4096)]);
        assert_eq!(m.logical_bytes(), 5 * 4096 + 100);
    }

    #[test]
    fn bad_manifests_are_refused() {
        let mut m = sample();
        m.files[0].len += 4096;
        let e = Manifest::from_bytes("x", &m.to_bytes()).unwrap_err();
        assert!(
            e.to_string().contains("7 chunks") || e.to_string().contains("chunks for"),
            "{e}"
        );
        let mut m = sample();
        m.files[0].path = "../etc/passwd".into();
        assert!(Manifest::from_bytes("x", &m.to_bytes()).is_err());
        let mut m = sample();
        m.chunk_size = 1000;
        assert!(Manifest::from_bytes("x", &m.to_bytes()).is_err());
        let mut m = sample();
        m.version = 2;
        let e = Manifest::from_bytes("x", &m.to_bytes()).unwrap_err();
        assert!(e.to_string().contains("format version 2"), "{e}");
        assert!(Manifest::from_bytes("x", b"{").is_err());
    }
}
