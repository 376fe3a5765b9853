//! Layers applied in order into a fresh directory ([`unpack`]): each blob
//! is decompressed by what its bytes are (gzip, zstd, plain tar), its
//! uncompressed stream checked against the config's diff id, and its
//! entries written by [`crate::entry`], under [`Limits`] that refuse a
//! tar bomb (entries, bytes, one file's bytes, compression ratio).

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use rustix::fs::{Gid, Mode, Uid};
use sha2::{Digest as _, Sha256};

use crate::entry::{self, Skipped, Writer};
use crate::error::{BombLimit, Error, Result};
use crate::image::Image;
use crate::root::{Follow, Root};
use crate::store::Digest;

/// What an unpack may take before it refuses a layer as a tar bomb.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Entries, all layers together.
    pub max_entries: u64,
    /// Bytes of regular files, all layers together.
    pub max_total_bytes: u64,
    /// Bytes of one regular file.
    pub max_file_bytes: u64,
    /// How many times its compressed size a layer may grow to...
    pub max_ratio: u64,
    /// ...once past this many uncompressed bytes (small layers of zeros
    /// compress far better than any ratio and harm no one).
    pub ratio_grace_bytes: u64,
}

impl Default for Limits {
    /// 1M entries, 32 GiB in all, 16 GiB in one file, 200x past 64 MiB.
    fn default() -> Limits {
        Limits {
            max_entries: 1_000_000,
            max_total_bytes: 32 << 30,
            max_file_bytes: 16 << 30,
            max_ratio: 200,
            ratio_grace_bytes: 64 << 20,
        }
    }
}

/// What an unpack wrote.
#[derive(Debug, Clone, Default)]
pub struct UnpackReport {
    /// Entries read, all layers.
    pub entries: u64,
    /// Bytes of regular files written.
    pub bytes: u64,
    /// What was left out (device nodes the kernel refused here, extended
    /// attributes outside `user.`, `trusted.`, `security.capability`).
    pub skipped: Vec<Skipped>,
}

/// A layer to apply: a name for messages, its blob, and the digest its
/// uncompressed stream must have, if known.
#[derive(Debug, Clone)]
pub struct LayerFile {
    /// How errors name the layer (its digest, or the file).
    pub name: String,
    /// The blob: a tar stream, plain, gzip or zstd.
    pub path: PathBuf,
    /// The digest of the uncompressed stream (an image's diff id).
    pub diff_id: Option<Digest>,
}

/// Applies `image`'s layers, bottom first, into `root`: a directory that
/// is missing or empty (made root's, mode 0755). Nothing is written
/// outside `root`; an entry that would be is refused
/// ([`Error::Refused`]), as is a layer past the `limits` ([`Error::Bomb`]).
/// On error `root` holds what was written before it: remove it.
pub fn unpack(image: &Image, root: &Path, limits: &Limits) -> Result<UnpackReport> {
    let layers: Vec<LayerFile> = image
        .layers()
        .iter()
        .map(|l| LayerFile {
            name: l.digest.to_string(),
            path: image.layer_path(l),
            diff_id: l.diff_id.clone(),
        })
        .collect();
    unpack_layers(&layers, root, limits)
}

/// [`unpack`] for layers that are not an image's (a build's own steps,
/// tests).
pub fn unpack_layers(layers: &[LayerFile], root: &Path, limits: &Limits) -> Result<UnpackReport> {
    fresh_root(root)?;
    let root = Root::open(root).map_err(|e| Error::io(root.display(), e))?;
    let mut report = UnpackReport::default();
    let mut dir_times = HashMap::new();
    for layer in layers {
        apply_layer(&root, layer, limits, &mut report, &mut dir_times)?;
    }
    // Directories' times last: their entries changed them.
    let mut dirs: Vec<_> = dir_times.into_iter().collect();
    dirs.sort_by_key(|(path, _)| std::cmp::Reverse(path.components().count()));
    for (path, time) in dirs {
        let components: Vec<_> = path.iter().map(|c| c.to_os_string()).collect();
        if let Ok(walked) = root.walk(&components, Follow::Strict, false, false) {
            if let Some(name) = walked.name {
                let _ = rustix::fs::utimensat(
                    walked.dir.as_fd(),
                    &name,
                    &entry::timestamps(time),
                    rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
                );
            }
        }
    }
    Ok(report)
}

/// Makes `root` (or checks it is empty), root's, mode 0755.
fn fresh_root(root: &Path) -> Result<()> {
    match fs::symlink_metadata(root) {
        Ok(m) if m.is_dir() => {
            let mut entries = fs::read_dir(root).map_err(|e| Error::io(root.display(), e))?;
            if entries.next().is_some() {
                return Err(Error::io(
                    root.display(),
                    io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "not empty: unpack needs a fresh directory",
                    ),
                ));
            }
        }
        Ok(_) => {
            return Err(Error::io(
                root.display(),
                io::Error::new(io::ErrorKind::AlreadyExists, "not a directory"),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir_all(root).map_err(|e| Error::io(root.display(), e))?
        }
        Err(e) => return Err(Error::io(root.display(), e)),
    }
    rustix::fs::chown(root, Some(Uid::ROOT), Some(Gid::ROOT))
        .map_err(|e| Error::io(root.display(), e.into()))?;
    rustix::fs::chmod(root, Mode::from_raw_mode(0o755))
        .map_err(|e| Error::io(root.display(), e.into()))
}

fn apply_layer(
    root: &Root,
    layer: &LayerFile,
    limits: &Limits,
    report: &mut UnpackReport,
    dir_times: &mut HashMap<PathBuf, (i64, i64)>,
) -> Result<()> {
    let file = File::open(&layer.path).map_err(|e| Error::io(layer.path.display(), e))?;
    let compressed = file
        .metadata()
        .map_err(|e| Error::io(layer.path.display(), e))?
        .len();
    let cap = limits
        .max_ratio
        .saturating_mul(compressed)
        .max(limits.ratio_grace_bytes);
    let tripped = Rc::new(Cell::new(None));
    let meter = Meter {
        inner: decoder(&layer.name, BufReader::new(file))?,
        hasher: Sha256::new(),
        out: 0,
        cap,
        tripped: tripped.clone(),
    };
    let bomb = |limit| Error::Bomb {
        layer: layer.name.clone(),
        limit,
    };
    let ratio = |unpacked| BombLimit::Ratio {
        max: limits.max_ratio,
        compressed,
        unpacked,
    };
    let malformed = |e: io::Error| match tripped.get() {
        Some(unpacked) => bomb(ratio(unpacked)),
        None => Error::malformed(format!("layer {}", layer.name), e),
    };
    let mut archive = tar::Archive::new(meter);
    {
        let mut writer = Writer {
            root,
            layer: layer.name.clone(),
            touched: HashSet::new(),
            dir_times,
            skipped: &mut report.skipped,
            bytes: &mut report.bytes,
        };
        for entry in archive.entries().map_err(malformed)? {
            let mut entry = entry.map_err(malformed)?;
            report.entries += 1;
            if report.entries > limits.max_entries {
                return Err(bomb(BombLimit::Entries {
                    max: limits.max_entries,
                }));
            }
            match writer.apply(&mut entry, limits.max_file_bytes, limits.max_total_bytes) {
                Ok(()) => {}
                // A read of the entry's data that tripped the ratio.
                Err(e) => match tripped.get() {
                    Some(unpacked) => return Err(bomb(ratio(unpacked))),
                    None => return Err(e),
                },
            }
        }
    }
    // The end-of-archive blocks and padding count in the diff id.
    let mut meter = archive.into_inner();
    io::copy(&mut meter, &mut io::sink()).map_err(malformed)?;
    if let Some(expected) = &layer.diff_id {
        let actual = Digest::from_hasher(meter.hasher);
        if &actual != expected {
            return Err(Error::Digest {
                what: format!("layer {} (uncompressed)", layer.name),
                expected: expected.to_string(),
                actual: actual.to_string(),
            });
        }
    }
    Ok(())
}

/// The reader that decompresses a layer, by its first bytes.
fn decoder(name: &str, mut file: BufReader<File>) -> Result<Box<dyn Read>> {
    let head = file.fill_buf().map_err(|e| Error::io(name, e))?.to_vec();
    let unsupported = |media_type: &str, hint| Error::UnsupportedLayer {
        layer: name.to_string(),
        media_type: media_type.to_string(),
        hint,
    };
    if head.starts_with(&[0x1f, 0x8b]) {
        Ok(Box::new(flate2::read::MultiGzDecoder::new(file)))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        zstd(name, file).ok_or_else(|| {
            unsupported(
                "zstd compression",
                " (this build has no zstd support: torpor-oci's `zstd` feature)",
            )
        })
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        Err(unsupported("xz compression", ""))
    } else if head.starts_with(b"BZh") {
        Err(unsupported("bzip2 compression", ""))
    } else {
        Ok(Box::new(file))
    }
}

#[cfg(feature = "zstd")]
fn zstd(_name: &str, file: BufReader<File>) -> Option<Box<dyn Read>> {
    Some(Box::new(ZstdFrames {
        source: Some(file),
        frame: None,
    }))
}

#[cfg(not(feature = "zstd"))]
fn zstd(_name: &str, _file: BufReader<File>) -> Option<Box<dyn Read>> {
    None
}

/// A zstd stream of one frame or several in a row (as multi-threaded
/// compressors write).
#[cfg(feature = "zstd")]
struct ZstdFrames {
    source: Option<BufReader<File>>,
    frame:
        Option<ruzstd::decoding::StreamingDecoder<BufReader<File>, ruzstd::decoding::FrameDecoder>>,
}

#[cfg(feature = "zstd")]
impl Read for ZstdFrames {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if let Some(frame) = self.frame.as_mut() {
                let n = frame.read(buf)?;
                if n > 0 || buf.is_empty() {
                    return Ok(n);
                }
                self.source = self.frame.take().map(|f| f.into_inner());
            }
            let Some(mut source) = self.source.take() else {
                return Ok(0);
            };
            if source.fill_buf()?.is_empty() {
                return Ok(0);
            }
            let frame = ruzstd::decoding::StreamingDecoder::new(source)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
            self.frame = Some(frame);
        }
    }
}

/// Counts and hashes the uncompressed stream; fails a read past `cap`.
struct Meter {
    inner: Box<dyn Read>,
    hasher: Sha256,
    out: u64,
    cap: u64,
    /// How much had come out when the cap was crossed.
    tripped: Rc<Cell<Option<u64>>>,
}

impl Read for Meter {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.out += n as u64;
        if self.out > self.cap {
            self.tripped.set(Some(self.out));
            return Err(io::Error::other("decompression ratio limit"));
        }
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}
