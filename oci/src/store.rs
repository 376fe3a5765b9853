//! The content-addressed blob directory an image's manifest, config and
//! layers are kept in: `<dir>/blobs/sha256/<hex>`, as in an OCI layout.
//! A blob is written to a temporary name, its SHA-256 checked against the
//! digest that names it, and only then renamed into place, so a blob
//! present under its name is always whole and verified (a later pull of
//! the same layer finds it and skips the download).

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

use crate::error::{Error, Result};

/// A `sha256:<hex>` digest, validated (so that it is safe in a path).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:` followed by 64 lowercase hex digits.
    pub fn parse(text: &str) -> Result<Digest> {
        let hex = text
            .strip_prefix("sha256:")
            .ok_or_else(|| Error::BadDigest(text.to_string()))?;
        if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(Error::BadDigest(text.to_string()));
        }
        Ok(Digest(text.to_string()))
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Digest {
        Digest::from_hasher(Sha256::new_with_prefix(bytes))
    }

    pub(crate) fn from_hasher(hasher: Sha256) -> Digest {
        Digest(format!("sha256:{}", hex(&hasher.finalize())))
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// The whole digest, `sha256:<hex>`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A blob directory.
#[derive(Debug, Clone)]
pub(crate) struct BlobStore {
    dir: PathBuf,
}

impl BlobStore {
    /// The store under `dir` (created if missing).
    pub(crate) fn open(dir: &Path) -> Result<BlobStore> {
        let blobs = dir.join("blobs").join("sha256");
        fs::create_dir_all(&blobs).map_err(|e| Error::io(blobs.display(), e))?;
        Ok(BlobStore {
            dir: dir.to_path_buf(),
        })
    }

    /// Where the blob `digest` is (whether it is there or not).
    pub(crate) fn path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("blobs").join("sha256").join(digest.hex())
    }

    /// Whether the blob is there.
    pub(crate) fn has(&self, digest: &Digest) -> bool {
        self.path(digest).is_file()
    }

    /// A temporary file in the store to write a blob into.
    pub(crate) fn temp(&self) -> Result<(PathBuf, fs::File)> {
        let dir = self.dir.join("blobs").join("sha256");
        for attempt in 0..100u32 {
            let path = dir.join(format!(
                ".partial-{}-{}-{attempt}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.subsec_nanos())
                    .unwrap_or_default()
            ));
            match fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(file) => return Ok((path, file)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io(path.display(), e)),
            }
        }
        Err(Error::io(
            dir.display(),
            io::Error::other("no free temporary name"),
        ))
    }

    /// Moves a written temporary file into place as `digest`, once its
    /// content's digest `actual` is checked against it.
    pub(crate) fn commit(
        &self,
        temp: &Path,
        digest: &Digest,
        actual: &Digest,
        what: &str,
    ) -> Result<()> {
        if actual != digest {
            let _ = fs::remove_file(temp);
            return Err(Error::Digest {
                what: what.to_string(),
                expected: digest.to_string(),
                actual: actual.to_string(),
            });
        }
        let path = self.path(digest);
        fs::rename(temp, &path).map_err(|e| Error::io(path.display(), e))
    }

    /// Stores `bytes` as `digest` (checked).
    pub(crate) fn put_bytes(&self, digest: &Digest, bytes: &[u8], what: &str) -> Result<()> {
        if self.has(digest) {
            return Ok(());
        }
        let (temp, mut file) = self.temp()?;
        file.write_all(bytes)
            .map_err(|e| Error::io(temp.display(), e))?;
        self.commit(&temp, digest, &Digest::of(bytes), what)
    }

    /// Stores what `reader` gives (at most `limit` bytes) and returns its
    /// digest; `expected`, when given, must match it.
    pub(crate) fn put_reader(
        &self,
        reader: &mut dyn Read,
        expected: Option<&Digest>,
        limit: u64,
        what: &str,
    ) -> Result<Digest> {
        let (temp, file) = self.temp()?;
        let mut out = HashingWriter {
            inner: io::BufWriter::new(file),
            hasher: Sha256::new(),
        };
        let copied = io::copy(&mut reader.take(limit.saturating_add(1)), &mut out)
            .and_then(|n| out.inner.flush().map(|()| n));
        let copied = match copied {
            Ok(n) => n,
            Err(e) => {
                let _ = fs::remove_file(&temp);
                return Err(Error::io(what, e));
            }
        };
        if copied > limit {
            let _ = fs::remove_file(&temp);
            return Err(Error::BlobTooLarge {
                digest: expected.map(|d| d.to_string()).unwrap_or_default(),
                limit,
            });
        }
        let actual = Digest::from_hasher(out.hasher);
        let digest = expected.cloned().unwrap_or_else(|| actual.clone());
        self.commit(&temp, &digest, &actual, what)?;
        Ok(digest)
    }
}

/// A writer that hashes what goes through it.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_checked_before_they_name_a_path() {
        let good = format!("sha256:{}", "a1".repeat(32));
        assert_eq!(Digest::parse(&good).unwrap().hex(), "a1".repeat(32));
        for bad in [
            "sha512:00",
            "sha256:../../etc/passwd",
            "sha256:ABC",
            &format!("sha256:{}", "A1".repeat(32)),
            &format!("sha256:{}/", "a1".repeat(32)),
        ] {
            assert!(
                matches!(Digest::parse(bad), Err(Error::BadDigest(_))),
                "{bad}"
            );
        }
        assert_eq!(
            Digest::of(b"").as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn a_blob_is_kept_only_when_its_digest_matches() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::open(dir.path()).unwrap();
        let d = Digest::of(b"hello");
        store
            .put_reader(&mut &b"hello"[..], Some(&d), 100, "t")
            .unwrap();
        assert_eq!(fs::read(store.path(&d)).unwrap(), b"hello");
        let wrong = Digest::of(b"other");
        let err = store
            .put_reader(&mut &b"hello"[..], Some(&wrong), 100, "t")
            .unwrap_err();
        assert!(matches!(err, Error::Digest { .. }), "{err}");
        assert!(!store.has(&wrong));
        let err = store
            .put_reader(&mut &b"hello"[..], None, 3, "t")
            .unwrap_err();
        assert!(matches!(err, Error::BlobTooLarge { .. }), "{err}");
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(dir.path().join("blobs/sha256"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}
