//! Build-context files for a COPY, packed by the CLI ([`pack`]): the
//! files a source names (a file, a directory, or a glob as Docker allows,
//! `**` as E2B allows), minus `.dockerignore`'s, as a gzip'd tar, and the
//! archive's SHA-256 (the COPY step's `files_hash`, the upload's name).
//!
//! The archive is laid out as E2B's SDKs lay theirs (`tar_file_stream`),
//! so one unpack path in the guest serves both: entries named by their
//! path from the context's root (`app/src/main.py`, not from the source;
//! a directory as `app/` followed by everything under it; the root as
//! `./` when the source is `.`), matched files only for a glob (no entries
//! for their parent directories), symlinks stored as links, never
//! followed. Unlike theirs it is deterministic: entries sorted by path,
//! mtime 0, uid and gid 0 (`root`), modes kept, no extended headers; the
//! same files give the same hash on any machine.
//!
//! A source must stay inside the context: absolute paths, `..` above the
//! root, a path through a symlink that leads out of the context, and a
//! symlink whose target is absolute or climbs out of the context are
//! errors ([`ContextError`]), as are sockets, FIFOs and devices.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::ignore::{check, component_match, has_meta, BadPattern, Ignore};

/// A source that cannot be packed.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// An empty source.
    #[error("empty COPY source")]
    Empty,
    /// An absolute source.
    #[error("COPY source {0:?} is absolute: give a path relative to the build context")]
    Absolute(String),
    /// A source with `..` above the context's root.
    #[error("COPY source {0:?} leaves the build context")]
    Escapes(String),
    /// Nothing matches (or everything that does is ignored).
    #[error("COPY source {0:?} matches no file in the build context")]
    NoMatch(String),
    /// A symlink that leads out of the context.
    #[error("{path}: symlink to {target:?} leads out of the build context")]
    SymlinkEscapes {
        /// The symlink, from the context's root.
        path: String,
        /// Where it points.
        target: PathBuf,
    },
    /// A socket, FIFO or device.
    #[error("{0}: not a regular file, directory or symlink")]
    Special(String),
    /// A file that changed size while it was read.
    #[error("{0}: changed while it was packed")]
    Changed(String),
    /// A bad glob or `.dockerignore` pattern.
    #[error(transparent)]
    Pattern(#[from] BadPattern),
    /// Reading the context or writing the archive.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
}

/// A packed source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed {
    /// The gzip'd tar.
    pub archive: Vec<u8>,
    /// Its lowercase hex SHA-256.
    pub sha256: String,
    /// The entries' names, in order.
    pub entries: Vec<String>,
}

/// What [`pack_into`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackSummary {
    /// The archive's lowercase hex SHA-256.
    pub sha256: String,
    /// Its size.
    pub bytes: u64,
    /// The entries' names, in order.
    pub entries: Vec<String>,
}

/// `src` of the context at `context`, `.dockerignore` applied, in memory.
pub fn pack(context: &Path, src: &str) -> Result<Packed, ContextError> {
    let ignore = Ignore::load(context)?;
    let mut archive = Vec::new();
    let summary = pack_into(context, src, &ignore, &mut archive)?;
    Ok(Packed {
        archive,
        sha256: summary.sha256,
        entries: summary.entries,
    })
}

/// `src` of the context at `context`, minus what `ignore` ignores, written
/// to `out` as a gzip'd tar.
pub fn pack_into<W: Write>(
    context: &Path,
    src: &str,
    ignore: &Ignore,
    out: W,
) -> Result<PackSummary, ContextError> {
    let entries = list(context, src, ignore)?;
    let mut hashing = Hashing {
        inner: out,
        hash: Sha256::new(),
        bytes: 0,
    };
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ContextError::Io { path, source }
    };
    let archive = Path::new("<archive>");
    {
        let gz = flate2::write::GzEncoder::new(&mut hashing, flate2::Compression::default());
        let mut tar = tar::Builder::new(gz);
        for (name, entry) in &entries {
            let mut header = tar::Header::new_gnu();
            header.set_mode(entry.mode & 0o7777);
            header.set_uid(0);
            header.set_gid(0);
            header.set_mtime(0);
            let _ = header.set_username("root");
            let _ = header.set_groupname("root");
            match &entry.kind {
                Kind::Dir => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_size(0);
                    tar.append_data(&mut header, name, io::empty())
                        .map_err(io_err(archive))?;
                }
                Kind::Symlink(target) => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_size(0);
                    tar.append_link(&mut header, name, target)
                        .map_err(io_err(archive))?;
                }
                Kind::File(size) => {
                    let path = context.join(name);
                    let file = fs::File::open(&path).map_err(io_err(&path))?;
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_size(*size);
                    let mut reader = Counted {
                        inner: file.take(*size),
                        read: 0,
                    };
                    tar.append_data(&mut header, name, &mut reader)
                        .map_err(io_err(&path))?;
                    if reader.read != *size {
                        return Err(ContextError::Changed(name.clone()));
                    }
                }
            }
        }
        let gz = tar.into_inner().map_err(io_err(archive))?;
        gz.finish().map_err(io_err(archive))?;
    }
    Ok(PackSummary {
        sha256: crate::key::hex(&hashing.hash.finalize()),
        bytes: hashing.bytes,
        entries: entries.into_keys().collect(),
    })
}

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Dir,
    /// Its size when listed.
    File(u64),
    /// Its target.
    Symlink(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    kind: Kind,
    mode: u32,
}

/// The entries `src` names, by archive name (`dir/` for a directory).
fn list(
    context: &Path,
    src: &str,
    ignore: &Ignore,
) -> Result<BTreeMap<String, Entry>, ContextError> {
    if src.is_empty() {
        return Err(ContextError::Empty);
    }
    if src.starts_with('/') {
        return Err(ContextError::Absolute(src.to_string()));
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in src.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts
                    .pop()
                    .ok_or_else(|| ContextError::Escapes(src.to_string()))?;
            }
            p => {
                check(p)?;
                parts.push(p);
            }
        }
    }
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ContextError::Io { path, source }
    };
    let root = fs::canonicalize(context).map_err(io_err(context))?;
    let matches = expand(&root, &parts)?;
    if matches.is_empty() {
        return Err(ContextError::NoMatch(src.to_string()));
    }
    let mut entries = BTreeMap::new();
    let mut walked: Vec<String> = Vec::new();
    // Parents before their children: what a walk took is not taken again.
    let mut by_depth: Vec<&String> = matches.iter().collect();
    by_depth.sort_by_key(|m| {
        (
            m.matches('/').count() + usize::from(!m.is_empty()),
            m.to_string(),
        )
    });
    for rel in by_depth {
        let under = |w: &String| w.is_empty() || rel == w || rel.starts_with(&format!("{w}/"));
        if walked.iter().any(under) || (!rel.is_empty() && ignore.is_ignored(rel)) {
            continue;
        }
        inside(&root, rel)?;
        if add(&root, rel, &mut entries)? {
            walk(&root, rel, ignore, &mut entries)?;
            walked.push(rel.clone());
        }
    }
    if entries.is_empty() {
        return Err(ContextError::NoMatch(src.to_string()));
    }
    Ok(entries)
}

/// The paths (from the root, `""` for it) matching the components
/// `parts`.
fn expand(root: &Path, parts: &[&str]) -> Result<Vec<String>, ContextError> {
    let mut found: Vec<String> = vec![String::new()];
    for part in parts {
        let mut next = Vec::new();
        for base in &found {
            let dir = root.join(base);
            let join = |name: &str| {
                if base.is_empty() {
                    name.to_string()
                } else {
                    format!("{base}/{name}")
                }
            };
            if *part == "**" {
                next.push(base.clone());
                descendants(&dir, base, &mut next)?;
            } else if has_meta(part) {
                for name in names(&dir)? {
                    if component_match(part, &name) {
                        next.push(join(&name));
                    }
                }
            } else if fs::symlink_metadata(dir.join(part)).is_ok() {
                next.push(join(part));
            }
        }
        next.sort();
        next.dedup();
        found = next;
    }
    Ok(found)
}

/// The names in `dir`, sorted; none if it is not a readable directory.
fn names(dir: &Path) -> Result<Vec<String>, ContextError> {
    let Ok(read) = fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut names = Vec::new();
    for entry in read {
        let entry = entry.map_err(|source| ContextError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

/// Every path under `dir` (`rel` from the root), symlinked directories
/// not entered.
fn descendants(dir: &Path, rel: &str, out: &mut Vec<String>) -> Result<(), ContextError> {
    for name in names(dir)? {
        let child = if rel.is_empty() {
            name.clone()
        } else {
            format!("{rel}/{name}")
        };
        let path = dir.join(&name);
        let is_dir = fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        out.push(child.clone());
        if is_dir {
            descendants(&path, &child, out)?;
        }
    }
    Ok(())
}

/// `rel`'s parent directory, symlinks resolved, is inside `root`.
fn inside(root: &Path, rel: &str) -> Result<(), ContextError> {
    let Some((parent, _)) = rel.rsplit_once('/') else {
        return Ok(());
    };
    let real = fs::canonicalize(root.join(parent)).map_err(|source| ContextError::Io {
        path: root.join(parent),
        source,
    })?;
    if real.starts_with(root) {
        Ok(())
    } else {
        Err(ContextError::SymlinkEscapes {
            path: parent.to_string(),
            target: real,
        })
    }
}

/// Adds `rel` to `entries`; true when it is a directory to walk.
fn add(
    root: &Path,
    rel: &str,
    entries: &mut BTreeMap<String, Entry>,
) -> Result<bool, ContextError> {
    use std::os::unix::fs::PermissionsExt;
    let path = root.join(rel);
    let meta = fs::symlink_metadata(&path).map_err(|source| ContextError::Io {
        path: path.clone(),
        source,
    })?;
    let mode = meta.permissions().mode();
    let (name, kind) = if meta.is_dir() {
        let name = if rel.is_empty() {
            "./".to_string()
        } else {
            format!("{rel}/")
        };
        (name, Kind::Dir)
    } else if meta.is_file() {
        (rel.to_string(), Kind::File(meta.len()))
    } else if meta.file_type().is_symlink() {
        let target = fs::read_link(&path).map_err(|source| ContextError::Io {
            path: path.clone(),
            source,
        })?;
        if !link_inside(rel, &target) {
            return Err(ContextError::SymlinkEscapes {
                path: rel.to_string(),
                target,
            });
        }
        (rel.to_string(), Kind::Symlink(target))
    } else {
        return Err(ContextError::Special(rel.to_string()));
    };
    let is_dir = kind == Kind::Dir;
    entries.insert(name, Entry { kind, mode });
    Ok(is_dir)
}

/// Whether the symlink at `rel` pointing at `target` stays in the
/// context: a relative target that does not climb above the root.
fn link_inside(rel: &str, target: &Path) -> bool {
    let Some(target) = target.to_str() else {
        return false;
    };
    if target.starts_with('/') || target.is_empty() {
        return false;
    }
    let mut depth = rel.matches('/').count();
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return false,
            },
            _ => depth += 1,
        }
    }
    true
}

/// Everything under the directory `rel`, `ignore` applied.
fn walk(
    root: &Path,
    rel: &str,
    ignore: &Ignore,
    entries: &mut BTreeMap<String, Entry>,
) -> Result<(), ContextError> {
    for name in names(&root.join(rel))? {
        let child = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        let ignored = ignore.is_ignored(&child);
        let is_dir = if ignored {
            fs::symlink_metadata(root.join(&child)).is_ok_and(|m| m.is_dir())
        } else {
            add(root, &child, entries)?
        };
        if is_dir && (!ignored || ignore.has_exceptions()) {
            walk(root, &child, ignore, entries)?;
        }
    }
    Ok(())
}

impl Ignore {
    /// The rules of `context/.dockerignore`; none if it does not exist.
    pub fn load(context: &Path) -> Result<Ignore, ContextError> {
        let path = context.join(".dockerignore");
        match std::fs::read_to_string(&path) {
            Ok(text) => Ignore::parse(&text).map_err(ContextError::Pattern),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Ignore::default()),
            Err(source) => Err(ContextError::Io { path, source }),
        }
    }
}

/// A writer that hashes and counts what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A reader that counts what it gave.
struct Counted<R> {
    inner: R,
    read: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}
