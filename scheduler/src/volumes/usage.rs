//! A volume's size limit (`serve --volume-max-mib`): the bytes its files
//! hold, counted once per content directory in this process and shared by
//! everything that writes there — the content API (`torpor_gate::volumes`)
//! and the NFS server its guests write through ([`super::VolumeServer`]) —
//! so that neither can take a volume past its limit behind the other's
//! back.
//!
//! The count starts as the sum of the sizes of the regular files under the
//! directory (no link followed) when it is first asked for, and then
//! follows each change made through either path: a write that grows a file
//! reserves the growth first (refused past the limit), a truncation, a
//! removal or a replacement releases what it freed. Sizes are apparent
//! sizes (`st_size`), as a tenant listing the volume sees them.
//!
//! Its entries (the names of files, directories and links under it) are
//! counted and limited the same way: an empty file costs the host an inode
//! whatever its size, so a guest making empty files or directories without
//! end would exhaust the host's file system while its bytes stayed at
//! nothing. The limit is the volume's bytes over [`BYTES_PER_ENTRY`] (at
//! least [`MIN_ENTRIES`]): 2,621,440 entries for the default 10 GiB.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use torpor_sync::Locked;

/// The default limit of a volume: 10 GiB.
pub const DEFAULT_LIMIT: u64 = 10 << 30;

/// A change refused because it would take the volume past its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the volume is limited to {limit} bytes: this write would take it past that")]
pub struct OverLimit {
    /// The volume's limit, in bytes.
    pub limit: u64,
}

/// What one entry counts against a volume's limit on entries: the volume
/// may hold its limit in bytes over this many entries.
pub const BYTES_PER_ENTRY: u64 = 4096;
/// The fewest entries a volume may hold, however small its limit.
pub const MIN_ENTRIES: u64 = 1024;

/// A new entry refused because the volume holds as many as it may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the volume is limited to {limit} files, directories and links: this would take it past that"
)]
pub struct TooManyEntries {
    /// The volume's limit on entries.
    pub limit: u64,
}

/// The most entries a volume limited to `limit` bytes may hold.
pub fn max_entries(limit: u64) -> u64 {
    (limit / BYTES_PER_ENTRY).max(MIN_ENTRIES)
}

/// The bytes one volume's files hold and its entries, against their
/// limits.
#[derive(Debug)]
pub struct Usage {
    used: AtomicU64,
    limit: u64,
    entries: AtomicU64,
    max_entries: u64,
}

/// What [`count`] found under a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counted {
    /// Bytes its regular files hold.
    pub bytes: u64,
    /// Its entries (every name under it, the directory itself not).
    pub entries: u64,
}

/// Every volume counted in this process, by its content directory
/// (canonical); an entry lives as long as someone holds its [`Usage`].
fn book() -> &'static Mutex<HashMap<PathBuf, Weak<Usage>>> {
    static BOOK: OnceLock<Mutex<HashMap<PathBuf, Weak<Usage>>>> = OnceLock::new();
    BOOK.get_or_init(Default::default)
}

impl Usage {
    /// The count of the content directory `root` (which must exist): the
    /// one this process already keeps for it, or a new one limited to
    /// `limit` bytes, its files counted now.
    pub fn of(root: &Path, limit: u64) -> io::Result<Arc<Usage>> {
        let key = std::fs::canonicalize(root)?;
        let mut book = book().locked();
        if let Some(usage) = book.get(&key).and_then(Weak::upgrade) {
            return Ok(usage);
        }
        book.retain(|_, u| u.strong_count() > 0);
        let counted = count(&key)?;
        let usage = Arc::new(Usage {
            used: AtomicU64::new(counted.bytes),
            limit,
            entries: AtomicU64::new(counted.entries),
            max_entries: max_entries(limit),
        });
        book.insert(key, Arc::downgrade(&usage));
        Ok(usage)
    }

    /// Bytes its files hold.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Bytes they may hold.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Counts `n` more bytes, or refuses them past the limit (nothing
    /// counted then).
    pub fn reserve(&self, n: u64) -> Result<(), OverLimit> {
        if n == 0 {
            return Ok(());
        }
        if !add_within(&self.used, n, self.limit) {
            return Err(OverLimit { limit: self.limit });
        }
        Ok(())
    }

    /// Counts `n` bytes fewer (never below 0).
    pub fn release(&self, n: u64) {
        take(&self.used, n)
    }

    /// Entries under it.
    pub fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    /// Entries it may hold.
    pub fn max_entries(&self) -> u64 {
        self.max_entries
    }

    /// Counts one more entry (before it is made), or refuses it past the
    /// limit (nothing counted then).
    pub fn add_entry(&self) -> Result<(), TooManyEntries> {
        if !add_within(&self.entries, 1, self.max_entries) {
            return Err(TooManyEntries {
                limit: self.max_entries,
            });
        }
        Ok(())
    }

    /// Counts `n` entries fewer (never below 0): removed, or counted by
    /// [`Usage::add_entry`] and then not made.
    pub fn remove_entries(&self, n: u64) {
        take(&self.entries, n)
    }

    /// A file going from `old` to `new` bytes: the growth reserved (or
    /// refused), a shrink released.
    pub fn resize(&self, old: u64, new: u64) -> Result<(), OverLimit> {
        if new > old {
            self.reserve(new - old)
        } else {
            self.release(old - new);
            Ok(())
        }
    }
}

/// Adds `n` to `count` unless that takes it past `limit` (then nothing is
/// added): whether it was added.
fn add_within(count: &AtomicU64, n: u64, limit: u64) -> bool {
    let before = count.fetch_add(n, Ordering::AcqRel);
    if before.saturating_add(n) > limit {
        count.fetch_sub(n, Ordering::AcqRel);
        return false;
    }
    true
}

/// Takes `n` from `count`, never below 0.
fn take(count: &AtomicU64, n: u64) {
    let _ = count.fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
        Some(c.saturating_sub(n))
    });
}

/// The bytes the regular files under `root` hold and its entries (no
/// link followed).
pub fn count(root: &Path) -> io::Result<Counted> {
    let mut counted = Counted {
        bytes: 0,
        entries: 0,
    };
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir)? {
            let e = e?;
            counted.entries += 1;
            let meta = e.path().symlink_metadata()?;
            if meta.is_dir() {
                stack.push(e.path());
            } else if meta.is_file() {
                counted.bytes += meta.len();
            }
        }
    }
    Ok(counted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_count_per_directory_counted_from_disk_and_limited() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/a"), vec![0u8; 300]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("link")).unwrap();
        let a = Usage::of(dir.path(), 1000).unwrap();
        assert_eq!(a.used(), 300, "files only, links not followed");
        assert_eq!(a.entries(), 3, "sub, sub/a and link");
        // Another path to the same directory shares the count (and its
        // limit, whatever the second caller asks).
        let b = Usage::of(&dir.path().join("sub/.."), 5).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(b.limit(), 1000);
        b.reserve(700).unwrap();
        assert_eq!(a.used(), 1000);
        assert_eq!(a.reserve(1), Err(OverLimit { limit: 1000 }));
        assert_eq!(a.used(), 1000, "a refusal counts nothing");
        a.resize(700, 100).unwrap();
        assert_eq!(b.used(), 400);
        assert_eq!(a.resize(100, 800), Err(OverLimit { limit: 1000 }));
        a.release(10_000);
        assert_eq!(a.used(), 0);
        // Once nobody holds it, the directory is counted again.
        drop((a, b));
        let c = Usage::of(dir.path(), 2000).unwrap();
        assert_eq!((c.used(), c.limit()), (300, 2000));
    }

    #[test]
    fn entries_are_limited_by_the_volumes_bytes_and_counted_back() {
        assert_eq!(max_entries(10 << 30), 2_621_440);
        assert_eq!(
            max_entries(4 << 20),
            MIN_ENTRIES,
            "a small volume keeps the floor"
        );
        let dir = tempfile::tempdir().unwrap();
        for i in 0..MIN_ENTRIES - 2 {
            std::fs::write(dir.path().join(i.to_string()), b"").unwrap();
        }
        let u = Usage::of(dir.path(), 1 << 20).unwrap();
        assert_eq!(u.entries(), MIN_ENTRIES - 2);
        u.add_entry().unwrap();
        u.add_entry().unwrap();
        assert_eq!(u.add_entry(), Err(TooManyEntries { limit: MIN_ENTRIES }));
        assert_eq!(u.entries(), MIN_ENTRIES, "a refusal counts nothing");
        u.remove_entries(1);
        u.add_entry().unwrap();
        u.remove_entries(u64::MAX);
        assert_eq!(u.entries(), 0);
    }
}
