//! A minimal writer for the "newc" cpio format the Linux kernel unpacks as
//! an initramfs. Entries are kept in memory; parent directories are added on
//! demand, so callers only name files.

use std::collections::BTreeSet;

/// An initramfs archive under construction.
#[derive(Debug, Default)]
pub struct Cpio {
    out: Vec<u8>,
    dirs: BTreeSet<String>,
    ino: u32,
}

impl Cpio {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a directory (and its parents), mode 0755.
    pub fn dir(&mut self, path: &str) {
        let path = path.trim_matches('/');
        if path.is_empty() || self.dirs.contains(path) {
            return;
        }
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
        self.dirs.insert(path.to_string());
        self.entry(path, 0o040_755, &[]);
    }

    /// Adds a regular file with the given permission bits (parents created).
    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) {
        let path = path.trim_matches('/');
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
        self.entry(path, 0o100_000 | (perm & 0o7777), data);
    }

    /// Finishes the archive (trailer record) and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.out
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0,
            0,
            0,
            0,
            name.len() as u32 + 1,
            0, // check
        ];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_aligned_and_parents_come_first() {
        let mut c = Cpio::new();
        c.file("a/b/c.txt", 0o644, b"hello");
        let out = c.finish();
        assert_eq!(out.len() % 4, 0);
        let text = String::from_utf8_lossy(&out);
        let a = text.find("a\0").unwrap();
        let ab = text.find("a/b\0").unwrap();
        let abc = text.find("a/b/c.txt\0").unwrap();
        assert!(a < ab && ab < abc);
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!"));
        // Every record starts with the newc magic.
        assert_eq!(text.matches("070701").count(), 4);
    }

    #[test]
    fn directories_are_added_once() {
        let mut c = Cpio::new();
        c.dir("x/y");
        c.dir("x/y/");
        c.file("x/y/z", 0o755, b"");
        let text = String::from_utf8_lossy(&c.finish()).into_owned();
        assert_eq!(text.matches("x/y\0").count(), 1);
    }
}
