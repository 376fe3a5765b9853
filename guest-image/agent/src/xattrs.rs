//! User metadata of files (protocol 1.2), kept as extended attributes
//! under [`PREFIX`] as E2B's envd keeps it: `set_metadata` replaces a
//! file's whole set, `stat` and `list_dir` entries show it. Keys and values
//! are printable ASCII, keys non-empty; a set is at most [`MAX_TOTAL`]
//! bytes (names with the prefix, plus values: one ext4 block). A
//! filesystem without user xattrs (tmpfs before 6.6, /proc) reads as no
//! metadata and refuses a non-empty set with `EOPNOTSUPP`.

use crate::proto::{ErrorReply, SetMetadataRequest};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The xattr namespace of user metadata.
pub const PREFIX: &str = "user.e2b.";
/// Most bytes of one file's metadata (names with the prefix, and values).
pub const MAX_TOTAL: usize = 4096;
/// Longest key (the kernel's 255-byte xattr name, less the prefix).
pub const MAX_KEY: usize = 255 - PREFIX.len();

fn cpath(path: &Path) -> Result<CString, ErrorReply> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| ErrorReply::new(libc::EINVAL, "path contains a NUL byte"))
}

fn last_error(path: &Path, what: &str) -> ErrorReply {
    let e = std::io::Error::last_os_error();
    ErrorReply::io(&format!("{}: {what}", path.display()), &e)
}

fn unsupported(errno: Option<i32>) -> bool {
    matches!(errno, Some(libc::ENOTSUP))
}

/// Every xattr name of `path` (followed).
fn names(path: &Path) -> Result<Vec<Vec<u8>>, ErrorReply> {
    let c = cpath(path)?;
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: `c` is NUL-terminated; `buf` has the length passed.
        let n = unsafe { libc::listxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            buf.truncate(n as usize);
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) && buf.len() < (1 << 20) {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if unsupported(e.raw_os_error()) {
            return Ok(Vec::new());
        }
        return Err(ErrorReply::io(&path.to_string_lossy(), &e));
    }
    Ok(buf
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
        .map(<[u8]>::to_vec)
        .collect())
}

fn get(path: &Path, name: &[u8]) -> Option<Vec<u8>> {
    let c = cpath(path).ok()?;
    let n = CString::new(name).ok()?;
    let mut buf = vec![0u8; MAX_TOTAL];
    // SAFETY: both strings are NUL-terminated; `buf` has the length passed.
    let got = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if got < 0 {
        return None;
    }
    buf.truncate(got as usize);
    Some(buf)
}

/// The metadata of `path` (followed): empty without any, or where it
/// cannot be read. Entries that are not UTF-8 are left out.
pub fn read(path: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(names) = names(path) else {
        return out;
    };
    for name in names {
        let Some(key) = name.strip_prefix(PREFIX.as_bytes()) else {
            continue;
        };
        let (Ok(key), Some(value)) = (std::str::from_utf8(key), get(path, &name)) else {
            continue;
        };
        if let Ok(value) = String::from_utf8(value) {
            out.insert(key.to_string(), value);
        }
    }
    out
}

fn printable(s: &str) -> bool {
    s.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

/// Why `metadata` cannot be stored, if it cannot.
pub fn validate(metadata: &BTreeMap<String, String>) -> Result<(), ErrorReply> {
    let bad = |m: String| Err(ErrorReply::new(libc::EINVAL, m));
    let mut total = 0;
    for (k, v) in metadata {
        if k.is_empty() || k.len() > MAX_KEY {
            return bad(format!("metadata key {k:?}: 1 to {MAX_KEY} bytes"));
        }
        if !printable(k) || !printable(v) {
            return bad(format!("metadata {k:?}: printable ASCII only"));
        }
        total += PREFIX.len() + k.len() + v.len();
    }
    if total > MAX_TOTAL {
        return bad(format!("metadata of {total} bytes is over {MAX_TOTAL}"));
    }
    Ok(())
}

/// `set_metadata`: `path`'s metadata becomes exactly `metadata`.
pub fn set(req: &SetMetadataRequest) -> Result<(), ErrorReply> {
    if !req.path.starts_with('/') {
        return Err(ErrorReply::new(
            libc::EINVAL,
            format!("path must be absolute: {:?}", req.path),
        ));
    }
    validate(&req.metadata)?;
    let path = Path::new(&req.path);
    std::fs::metadata(path).map_err(|e| ErrorReply::io(&req.path, &e))?;
    let c = cpath(path)?;
    for name in names(path)? {
        let Some(key) = name.strip_prefix(PREFIX.as_bytes()) else {
            continue;
        };
        if std::str::from_utf8(key).is_ok_and(|k| req.metadata.contains_key(k)) {
            continue;
        }
        let n = CString::new(name).map_err(|_| ErrorReply::new(libc::EINVAL, "NUL in a name"))?;
        // SAFETY: both strings are NUL-terminated.
        if unsafe { libc::removexattr(c.as_ptr(), n.as_ptr()) } < 0
            && std::io::Error::last_os_error().raw_os_error() != Some(libc::ENODATA)
        {
            return Err(last_error(path, "removexattr"));
        }
    }
    for (k, v) in &req.metadata {
        let n = CString::new(format!("{PREFIX}{k}"))
            .map_err(|_| ErrorReply::new(libc::EINVAL, "NUL in a key"))?;
        // SAFETY: both strings are NUL-terminated; the value's length is given.
        let rc = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        if rc < 0 {
            return Err(last_error(path, "setxattr"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_on(path: &Path, pairs: &[(&str, &str)]) -> Result<(), ErrorReply> {
        set(&SetMetadataRequest {
            path: path.to_string_lossy().into_owned(),
            metadata: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        })
    }

    #[test]
    fn a_set_replaces_the_whole_metadata() {
        // The build directory: a disk filesystem (tmpfs may lack user xattrs).
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, "x").unwrap();
        assert!(read(&f).is_empty());
        set_on(&f, &[("author", "me"), ("purpose", "test")]).unwrap();
        let got = read(&f);
        assert_eq!(got.get("author").map(String::as_str), Some("me"));
        assert_eq!(got.len(), 2);
        set_on(&f, &[("purpose", "again")]).unwrap();
        let got = read(&f);
        assert_eq!(
            got.into_iter().collect::<Vec<_>>(),
            vec![("purpose".to_string(), "again".to_string())]
        );
        set_on(&f, &[]).unwrap();
        assert!(read(&f).is_empty());
        assert_eq!(set_on(&f, &[("", "v")]).unwrap_err().code, "EINVAL");
        assert_eq!(set_on(&f, &[("k", "\u{7}")]).unwrap_err().code, "EINVAL");
        let big = "v".repeat(MAX_TOTAL);
        assert_eq!(set_on(&f, &[("k", &big)]).unwrap_err().code, "EINVAL");
        assert_eq!(
            set_on(&dir.path().join("missing"), &[]).unwrap_err().code,
            "ENOENT"
        );
    }
}
