//! Layers made in the tests: a tar writer that can also write what a
//! well-behaved tar library refuses to (`..` and absolute names, escaping
//! link targets), PAX records (ownership, xattrs), gzip and zstd
//! (`tarball.rs`, which the API's tests share), and the loopback registry
//! of the registry test (`registry.rs`, shared too).

#![allow(dead_code)]

pub mod registry;
mod tarball;

use std::path::{Path, PathBuf};

#[allow(unused_imports)] // not every test uses all of them
pub use tarball::{gzip, layout_archive, Tar};

pub fn zstd(data: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(data, ruzstd::encoding::CompressionLevel::Fastest)
}

/// A scratch directory: `root/` (the unpack's), `outside/sentinel` beside
/// it, and layer files.
pub struct Scratch {
    pub dir: tempfile::TempDir,
    layers: usize,
}

pub const SENTINEL: &[u8] = b"the sentinel outside the root\n";

impl Scratch {
    pub fn new() -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("outside")).unwrap();
        std::fs::write(dir.path().join("outside/sentinel"), SENTINEL).unwrap();
        Scratch { dir, layers: 0 }
    }

    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    /// Writes a layer blob and describes it.
    pub fn layer(&mut self, bytes: &[u8]) -> torpor_oci::LayerFile {
        self.layers += 1;
        let path = self.dir.path().join(format!("layer{}", self.layers));
        std::fs::write(&path, bytes).unwrap();
        torpor_oci::LayerFile {
            name: format!("layer{}", self.layers),
            path,
            diff_id: None,
        }
    }

    /// The scratch directory holds only `root/`, `outside/sentinel` (as
    /// it was) and the layers: nothing was written beside the root.
    pub fn assert_outside_untouched(&self) {
        assert_eq!(
            std::fs::read(self.dir.path().join("outside/sentinel")).unwrap(),
            SENTINEL
        );
        let outside: Vec<_> = std::fs::read_dir(self.dir.path().join("outside"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(outside, ["sentinel"]);
        for e in std::fs::read_dir(self.dir.path()).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            assert!(
                name == "root" || name == "outside" || name.starts_with("layer"),
                "{name} was written beside the root"
            );
        }
    }
}

pub fn read(path: &Path) -> String {
    String::from_utf8(std::fs::read(path).unwrap()).unwrap()
}
