//! The lineage record of a snapshot layer: `lineage.json` in the layer's
//! directory, written by the VMM with the layer (before `state`, which
//! commits it), naming every layer of its chain base first. A pod lists a
//! chain by reading this one small file, not each layer's state.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The file that commits a snapshot layer (written last).
pub const STATE_FILE: &str = "state";
/// Pages a restore touched first, recorded beside a template's snapshot
/// (u64 page numbers, little endian; its first ms after a restore,
/// ascending) and prefetched by later restores.
pub const WORKING_SET_FILE: &str = "working-set";
/// The pages a sandbox's guest was given since its restore, recorded
/// beside a snapshot taken by a VMM whose memory a userfaultfd page server
/// serves (the format of [`WORKING_SET_FILE`], in the order first
/// installed). A lazy wake fetches their chunks first once the guest runs;
/// no restore prefetches them (a whole run's pages, installed eagerly,
/// slowed wakes: docs/history.md, "Object storage").
pub const TOUCHED_FILE: &str = "touched";
/// Most pages a working set holds (a writer keeps the first ones, a
/// reader ignores a longer file).
pub const MAX_WORKING_SET_PAGES: u64 = 1 << 22;
/// The layer's lineage record.
pub const LINEAGE_FILE: &str = "lineage.json";
/// Deepest chain a VMM restores or records.
pub const MAX_CHAIN_DEPTH: usize = 64;
/// Largest lineage record read.
pub const MAX_LINEAGE_BYTES: u64 = 256 * 1024;
const VERSION: u32 = 1;

/// A layer's chain, base (the full snapshot) first, this layer last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lineage {
    pub version: u32,
    pub layers: Vec<PathBuf>,
}

/// Why a lineage record cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LineageError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a lineage record: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

impl Lineage {
    /// A full snapshot's lineage: itself alone.
    pub fn base(dir: &Path) -> Self {
        Self {
            version: VERSION,
            layers: vec![dir.to_path_buf()],
        }
    }

    /// The lineage of a diff layer `dir` on top of this one.
    pub fn child(&self, dir: &Path) -> Self {
        let mut layers = self.layers.clone();
        layers.push(dir.to_path_buf());
        Self {
            version: VERSION,
            layers,
        }
    }

    /// The layer itself.
    pub fn top(&self) -> Option<&Path> {
        self.layers.last().map(PathBuf::as_path)
    }

    /// Number of layers, the layer itself included.
    pub fn depth(&self) -> usize {
        self.layers.len()
    }

    /// Reads and checks `dir`'s record: bounded, of this version, with
    /// 1..=MAX_CHAIN_DEPTH absolute layers ending in `dir` itself.
    pub fn read(dir: &Path) -> Result<Self, LineageError> {
        let path = dir.join(LINEAGE_FILE);
        let read = |source| LineageError::Read {
            path: path.clone(),
            source,
        };
        let mut text = Vec::new();
        // Never through a link: a pod reads records a VMM wrote.
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(read)?
            .take(MAX_LINEAGE_BYTES + 1)
            .read_to_end(&mut text)
            .map_err(read)?;
        let invalid = |reason: String| LineageError::Invalid {
            path: path.clone(),
            reason,
        };
        if text.len() as u64 > MAX_LINEAGE_BYTES {
            return Err(invalid(format!("longer than {MAX_LINEAGE_BYTES} bytes")));
        }
        let lineage: Lineage = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
        if lineage.version != VERSION {
            return Err(invalid(format!("version {}", lineage.version)));
        }
        if lineage.layers.is_empty() || lineage.layers.len() > MAX_CHAIN_DEPTH {
            return Err(invalid(format!(
                "{} layers (1..={MAX_CHAIN_DEPTH})",
                lineage.layers.len()
            )));
        }
        if let Some(rel) = lineage.layers.iter().find(|l| !l.is_absolute()) {
            return Err(invalid(format!("relative layer {}", rel.display())));
        }
        let same = |a: &Path, b: &Path| {
            a == b || std::fs::canonicalize(a).ok() == std::fs::canonicalize(b).ok()
        };
        if !lineage.top().is_some_and(|t| same(t, dir)) {
            return Err(invalid(format!(
                "its last layer is not {} itself",
                dir.display()
            )));
        }
        Ok(lineage)
    }

    /// Writes the record into `dir` (the last layer); synced, since the
    /// layer's `state` written after it commits both.
    pub fn write(&self, dir: &Path) -> Result<(), LineageError> {
        let path = dir.join(LINEAGE_FILE);
        let text = serde_json::to_vec(self).map_err(|e| LineageError::Invalid {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let write = |source| LineageError::Write {
            path: path.clone(),
            source,
        };
        let mut f = std::fs::File::create(&path).map_err(write)?;
        std::io::Write::write_all(&mut f, &text).map_err(write)?;
        f.sync_all().map_err(write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_are_written_and_read_back() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().to_path_buf();
        let (base, diff) = (root.join("base"), root.join("diff"));
        std::fs::create_dir_all(&base).unwrap();
        std::fs::create_dir_all(&diff).unwrap();
        let l0 = Lineage::base(&base);
        l0.write(&base).unwrap();
        let l1 = Lineage::read(&base).unwrap().child(&diff);
        l1.write(&diff).unwrap();
        let back = Lineage::read(&diff).unwrap();
        assert_eq!(back.layers, vec![base.clone(), diff.clone()]);
        assert_eq!(back.depth(), 2);
    }

    #[test]
    fn hostile_records_are_refused() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().to_path_buf();
        let write = |text: &str| std::fs::write(root.join(LINEAGE_FILE), text).unwrap();
        let top = root.display().to_string();
        write(&format!(r#"{{"version":1,"layers":["relative","{top}"]}}"#));
        assert!(Lineage::read(&root)
            .unwrap_err()
            .to_string()
            .contains("relative"));
        write(r#"{"version":1,"layers":["/elsewhere"]}"#);
        assert!(Lineage::read(&root)
            .unwrap_err()
            .to_string()
            .contains("last layer"));
        write(&format!(r#"{{"version":9,"layers":["{top}"]}}"#));
        assert!(Lineage::read(&root).is_err());
        write(r#"{"version":1,"layers":[]}"#);
        assert!(Lineage::read(&root).is_err());
        let many: Vec<String> = (0..=MAX_CHAIN_DEPTH)
            .map(|_| format!("\"{top}\""))
            .collect();
        write(&format!(r#"{{"version":1,"layers":[{}]}}"#, many.join(",")));
        assert!(Lineage::read(&root).is_err());
        write(&" ".repeat(MAX_LINEAGE_BYTES as usize + 1));
        assert!(Lineage::read(&root)
            .unwrap_err()
            .to_string()
            .contains("longer"));
    }
}
