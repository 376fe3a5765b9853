//! Layers made in the tests: a tar writer that can also write what a
//! well-behaved tar library refuses to (`..` and absolute names, escaping
//! link targets), PAX records (ownership, xattrs), gzip and zstd.

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};

use tar::{EntryType, Header};

/// A tar stream being written.
pub struct Tar {
    b: tar::Builder<Vec<u8>>,
}

/// One PAX record: `LEN key=value\n`, LEN counting itself.
fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let rest = key.len() + value.len() + 3;
    let mut len = rest + 1;
    while len.to_string().len() + rest != len {
        len += 1;
    }
    let mut out = format!("{len} {key}=").into_bytes();
    out.extend_from_slice(value);
    out.push(b'\n');
    out
}

impl Default for Tar {
    fn default() -> Self {
        Tar::new()
    }
}

impl Tar {
    pub fn new() -> Tar {
        Tar {
            b: tar::Builder::new(Vec::new()),
        }
    }

    /// A header with the name and link name written as raw bytes, none
    /// of the builder's checks.
    fn header(name: &[u8], kind: EntryType, size: u64, mode: u32, link: &[u8]) -> Header {
        let mut h = Header::new_ustar();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_600_000_000);
        let bytes = h.as_mut_bytes();
        assert!(name.len() <= 100 && link.len() <= 100);
        bytes[..name.len()].copy_from_slice(name);
        bytes[157..157 + link.len()].copy_from_slice(link);
        h
    }

    fn append(&mut self, mut h: Header, data: &[u8]) {
        h.set_cksum();
        self.b.append(&h, data).unwrap();
    }

    /// PAX records for the next entry.
    pub fn pax(&mut self, records: &[(&str, &[u8])]) -> &mut Tar {
        let data: Vec<u8> = records.iter().flat_map(|(k, v)| pax_record(k, v)).collect();
        let h = Tar::header(
            b"././@PaxHeader",
            EntryType::XHeader,
            data.len() as u64,
            0o644,
            b"",
        );
        self.append(h, &data);
        self
    }

    pub fn dir(&mut self, name: &str, mode: u32) -> &mut Tar {
        let h = Tar::header(name.as_bytes(), EntryType::Directory, 0, mode, b"");
        self.append(h, b"");
        self
    }

    pub fn file(&mut self, name: &str, data: &[u8], mode: u32) -> &mut Tar {
        self.file_owned(name, data, mode, 0, 0)
    }

    pub fn file_owned(
        &mut self,
        name: &str,
        data: &[u8],
        mode: u32,
        uid: u64,
        gid: u64,
    ) -> &mut Tar {
        let mut h = Tar::header(
            name.as_bytes(),
            EntryType::Regular,
            data.len() as u64,
            mode,
            b"",
        );
        h.set_uid(uid);
        h.set_gid(gid);
        self.append(h, data);
        self
    }

    pub fn symlink(&mut self, name: &str, target: &str) -> &mut Tar {
        let h = Tar::header(
            name.as_bytes(),
            EntryType::Symlink,
            0,
            0o777,
            target.as_bytes(),
        );
        self.append(h, b"");
        self
    }

    pub fn hardlink(&mut self, name: &str, target: &str) -> &mut Tar {
        let h = Tar::header(
            name.as_bytes(),
            EntryType::Link,
            0,
            0o644,
            target.as_bytes(),
        );
        self.append(h, b"");
        self
    }

    pub fn fifo(&mut self, name: &str) -> &mut Tar {
        let h = Tar::header(name.as_bytes(), EntryType::Fifo, 0, 0o600, b"");
        self.append(h, b"");
        self
    }

    pub fn char_device(&mut self, name: &str, major: u32, minor: u32) -> &mut Tar {
        let mut h = Tar::header(name.as_bytes(), EntryType::Char, 0, 0o666, b"");
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        self.append(h, b"");
        self
    }

    /// An entry of any type flag.
    pub fn raw(&mut self, name: &str, flag: u8, data: &[u8]) -> &mut Tar {
        let h = Tar::header(
            name.as_bytes(),
            EntryType::new(flag),
            data.len() as u64,
            0o644,
            b"",
        );
        self.append(h, data);
        self
    }

    pub fn bytes(self) -> Vec<u8> {
        self.b.into_inner().unwrap()
    }
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

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
