//! A tar writer for tests that can write what a well-behaved tar library
//! refuses to (`..` and absolute names, escaping link targets), PAX
//! records (ownership, xattrs), gzip, and an OCI image layout archive of
//! given layers (what a client may upload). Shared by torpor-oci's tests
//! and the API's (`#[path]`): it needs `tar`, `flate2`, `sha2` and
//! `serde_json`.

#![allow(dead_code)]

use std::io::Write;

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

/// `sha256:<hex>` of `bytes`.
fn digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    let hash = sha2::Sha256::digest(bytes);
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// An OCI image layout as a tar (`oci-layout`, `index.json`, the
/// manifest, the config and the layers as blobs), linux/amd64, of these
/// layers (plain tar streams, written as they are), with `config` as the
/// config's `config` object and the layers' diff ids filled in.
pub fn layout_archive(layers: &[Vec<u8>], config: serde_json::Value) -> Vec<u8> {
    let diff_ids: Vec<String> = layers.iter().map(|l| digest(l)).collect();
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    })
    .to_string()
    .into_bytes();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": digest(&config),
            "size": config.len(),
        },
        "layers": layers.iter().map(|l| serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": digest(l),
            "size": l.len(),
        })).collect::<Vec<_>>(),
    })
    .to_string()
    .into_bytes();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest(&manifest),
            "size": manifest.len(),
            "platform": {"os": "linux", "architecture": "amd64"},
        }],
    })
    .to_string()
    .into_bytes();
    let mut t = Tar::new();
    t.file("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, 0o644)
        .file("index.json", &index, 0o644)
        .dir("blobs/", 0o755)
        .dir("blobs/sha256/", 0o755);
    let blob = |t: &mut Tar, bytes: &[u8]| {
        let name = format!("blobs/sha256/{}", &digest(bytes)["sha256:".len()..]);
        t.file(&name, bytes, 0o644);
    };
    blob(&mut t, &manifest);
    blob(&mut t, &config);
    for l in layers {
        blob(&mut t, l);
    }
    t.bytes()
}
