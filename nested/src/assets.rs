//! Where the nested host's pieces live: QEMU (the cache's, else the PATH's), and the L1 kernel,
//! its modules and busybox in the directory `scripts/nested-host prepare`
//! fills (`${TORPOR_CACHE:-/var/cache/torpor}/nested/l1`).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

use crate::NestedError;

/// The QEMU system emulator the nested host runs on.
pub const QEMU: &str = "qemu-system-x86_64";

/// What `scripts/nested-host prepare` leaves in the L1 directory.
#[derive(Debug, Clone)]
pub struct L1Assets {
    /// The directory itself.
    pub dir: PathBuf,
    /// The L1 kernel (bzImage from Debian's linux-image-cloud-amd64).
    pub kernel: PathBuf,
    /// A static busybox: the L1 userland.
    pub busybox: PathBuf,
    /// Kernel modules (uncompressed .ko), in load order.
    pub modules: Vec<PathBuf>,
    /// The L1 kernel release, e.g. `6.1.0-57-cloud-amd64`.
    pub version: String,
}

/// `${TORPOR_CACHE:-/var/cache/torpor}/nested`: what `scripts/nested-host
/// prepare` fills.
fn nested_cache() -> PathBuf {
    env::var_os("TORPOR_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/torpor"))
        .join("nested")
}

/// The default L1 directory: `$TORPOR_NESTED_L1`, else
/// `${TORPOR_CACHE:-/var/cache/torpor}/nested/l1`.
pub fn default_l1_dir() -> PathBuf {
    if let Some(dir) = env::var_os("TORPOR_NESTED_L1") {
        return PathBuf::from(dir);
    }
    nested_cache().join("l1")
}

impl L1Assets {
    /// Loads the assets from [`default_l1_dir`].
    pub fn locate() -> Result<Self, NestedError> {
        Self::from_dir(&default_l1_dir())
    }

    /// Loads the assets from `dir`, naming the first piece that is missing.
    pub fn from_dir(dir: &Path) -> Result<Self, NestedError> {
        let missing = |what: &str, path: &Path| NestedError::L1Missing {
            what: what.to_string(),
            path: path.to_path_buf(),
        };
        if !dir.is_dir() {
            return Err(missing("the L1 directory", dir));
        }
        let kernel = dir.join("vmlinuz");
        if !kernel.is_file() {
            return Err(missing("the L1 kernel", &kernel));
        }
        let busybox = dir.join("busybox");
        if !busybox.is_file() {
            return Err(missing("busybox", &busybox));
        }
        let order = dir.join("modules").join("load-order");
        let list = fs::read_to_string(&order).map_err(|_| missing("the module list", &order))?;
        let mut modules = Vec::new();
        for name in list.split_whitespace() {
            let path = dir.join("modules").join(name);
            if !path.is_file() {
                return Err(missing("a kernel module", &path));
            }
            modules.push(path);
        }
        for needed in ["kvm.ko", "kvm-amd.ko"] {
            if !modules.iter().any(|m| m.ends_with(needed)) {
                return Err(missing(needed, &dir.join("modules").join(needed)));
            }
        }
        let version = fs::read_to_string(dir.join("version"))
            .map(|v| v.trim().to_string())
            .unwrap_or_default();
        Ok(Self {
            dir: dir.to_path_buf(),
            kernel,
            busybox,
            modules,
            version,
        })
    }
}

/// Finds QEMU: `$TORPOR_QEMU`, else the one `scripts/nested-host prepare`
/// unpacked into the cache (`.../nested/qemu/usr/bin/`: QEMU 10 from
/// bookworm-backports, sturdier under TCG than bookworm's 7.2), else
/// `qemu-system-x86_64` on the PATH.
pub fn find_qemu() -> Result<PathBuf, NestedError> {
    if let Some(q) = env::var_os("TORPOR_QEMU") {
        let q = PathBuf::from(q);
        return if q.is_file() {
            Ok(q)
        } else {
            Err(NestedError::QemuMissing {
                searched: q.display().to_string(),
            })
        };
    }
    let cached = nested_cache()
        .join("qemu")
        .join("usr")
        .join("bin")
        .join(QEMU);
    if cached.is_file() {
        return Ok(cached);
    }
    find_in_path(QEMU).ok_or_else(|| NestedError::QemuMissing {
        searched: format!("{} and {QEMU} on PATH", cached.display()),
    })
}

/// Looks a program up on the PATH.
pub fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_directory_is_named() {
        let err = L1Assets::from_dir(Path::new("/nonexistent/l1")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/l1"), "{msg}");
        assert!(msg.contains("scripts/nested-host prepare"), "{msg}");
    }

    #[test]
    fn a_missing_kernel_is_named() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let err = L1Assets::from_dir(&dir).unwrap_err();
        assert!(err.to_string().contains("L1 kernel"), "{err}");
    }
}
