//! Images: the kernels and root filesystems Linux templates are built from,
//! installed by the operator (files in the images directory) or uploaded by
//! an admin (`PUT /v1/images/{name}/kernel|rootfs`), and named by clients.
//!
//! An image is a directory `IMAGES/NAME/` holding `vmlinux` and
//! `rootfs.ext4`. A client never names a host path: only an image name,
//! checked ([`check_name`]) before anything is opened, and the files are
//! opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS)` from the images directory, so a symlink or a
//! `..` inside it cannot lead out of it. Every failure to find a usable
//! file is one answer ([`ImageError::Unusable`]) that says nothing of what
//! exists on the host.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The kernel file in an image directory.
pub const KERNEL_FILE: &str = "vmlinux";
/// The root filesystem file in an image directory.
pub const ROOTFS_FILE: &str = "rootfs.ext4";
/// Longest image name.
pub const MAX_IMAGE_NAME: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(
        "image names are 1 to {MAX_IMAGE_NAME} characters of a-z, A-Z, 0-9, `.`, `_` and `-`, \
         not starting with `.`"
    )]
    BadName,
    #[error("unknown image part {0:?}: `kernel` or `rootfs`")]
    BadPart(String),
    /// Missing, not a regular file, behind a symlink: one answer for all.
    #[error("image {name} has no usable {file} (install it in the images directory or upload it)")]
    Unusable { name: String, file: &'static str },
    #[error("the upload is larger than the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("image {name} is in use by template {template}")]
    InUse { name: String, template: String },
    #[error("an empty upload: {0} needs its bytes in the request's body")]
    Empty(&'static str),
    #[error("image {0} not found")]
    NotFound(String),
    #[error("image store: {0}")]
    Io(String),
}

/// One of an image's two files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImagePart {
    Kernel,
    Rootfs,
}

impl ImagePart {
    /// `kernel` or `rootfs` (the upload route's last segment).
    pub fn parse(s: &str) -> Result<Self, ImageError> {
        match s {
            "kernel" => Ok(ImagePart::Kernel),
            "rootfs" => Ok(ImagePart::Rootfs),
            other => Err(ImageError::BadPart(other.chars().take(32).collect())),
        }
    }

    /// The name [`ImagePart::parse`] reads.
    pub fn as_str(self) -> &'static str {
        match self {
            ImagePart::Kernel => "kernel",
            ImagePart::Rootfs => "rootfs",
        }
    }

    pub fn file_name(self) -> &'static str {
        match self {
            ImagePart::Kernel => KERNEL_FILE,
            ImagePart::Rootfs => ROOTFS_FILE,
        }
    }
}

/// A plain name (images, tenants): 1 to 64 characters of a-z, A-Z, 0-9,
/// `.`, `_` and `-`, not starting with `.` (so no `/`, no `..`): the
/// object store's rule for names ([`torpor_storage::is_storable_name`],
/// which images are stored under), shorter.
pub fn is_plain_name(name: &str) -> bool {
    name.len() <= MAX_IMAGE_NAME && torpor_storage::is_storable_name(name)
}

/// Refuses anything but a plain name ([`is_plain_name`]).
pub fn check_name(name: &str) -> Result<(), ImageError> {
    if is_plain_name(name) {
        Ok(())
    } else {
        Err(ImageError::BadName)
    }
}

/// `openat2(dir, rel, flags, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
/// RESOLVE_NO_MAGICLINKS)`: `rel` resolved inside `dir` only, through no
/// symlink at all. The one such opener of the service's directories
/// (E2B's volumes resolve every path with it too: `torpor_gate::volumes`).
pub fn open_beneath(dir: &File, rel: &Path, flags: i32, mode: u32) -> std::io::Result<File> {
    let rel = std::ffi::CString::new(rel.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: open_how is plain integers: all zeros is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = u64::from(mode);
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: `rel` is a NUL-terminated string and `how` a valid open_how
    // that both outlive the call; the size passed is the struct's own.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd as i32) })
}

/// The images directory of a service.
#[derive(Debug, Clone)]
pub struct Images {
    dir: PathBuf,
}

/// Where [`Images::stage`] and [`Images::fetch_dir`] put their
/// directories, inside the images directory.
const STAGE_PREFIX: &str = ".stage-";
const FETCH_PREFIX: &str = ".fetch-";

/// A working directory inside the images directory (an image staged for
/// its upload, or being fetched), removed with whatever it still holds
/// when dropped.
#[derive(Debug)]
pub struct ImageDir(PathBuf);

impl ImageDir {
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ImageDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An image's checked files, as paths under the images directory.
#[derive(Debug, Clone)]
pub struct ImageFiles {
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
}

impl Images {
    /// Creates `dir` if needed (mode 0700 when new).
    pub fn open(dir: PathBuf) -> Result<Self, ImageError> {
        use std::os::unix::fs::DirBuilderExt;
        if !dir.is_dir() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(|e| ImageError::Io(format!("create the images directory: {e}")))?;
        }
        let dir = std::fs::canonicalize(&dir)
            .map_err(|e| ImageError::Io(format!("resolve the images directory: {e}")))?;
        // What a stop in the middle of storing or fetching an image left
        // (no image name starts with `.`).
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(STAGE_PREFIX) || name.starts_with(FETCH_PREFIX) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        Ok(Images { dir })
    }

    /// Image `name`'s two files, hard-linked into a directory of their
    /// own for an upload to read while new parts may be installed (an
    /// installed file is never written again, only replaced); removed
    /// when the returned guard drops.
    pub fn stage(&self, name: &str) -> Result<ImageDir, ImageError> {
        let files = self.resolve(name)?;
        let dir = self.dir.join(format!(
            "{STAGE_PREFIX}{name}-{}",
            crate::random::random_hex(8)
        ));
        let staged = ImageDir(dir.clone());
        std::fs::create_dir(&dir)
            .map_err(|e| ImageError::Io(format!("stage image {name}: {e}")))?;
        for (from, file) in [(files.kernel, KERNEL_FILE), (files.rootfs, ROOTFS_FILE)] {
            std::fs::hard_link(&from, dir.join(file))
                .map_err(|e| ImageError::Io(format!("stage image {name}: {e}")))?;
        }
        Ok(staged)
    }

    /// An empty place to fetch image `name` into before
    /// [`Images::place`] installs it; removed when the guard drops.
    pub fn fetch_dir(&self, name: &str) -> Result<ImageDir, ImageError> {
        check_name(name)?;
        Ok(ImageDir(self.dir.join(format!(
            "{FETCH_PREFIX}{name}-{}",
            crate::random::random_hex(8)
        ))))
    }

    /// Installs the image fetched into `fetched` as image `name`: both
    /// files regular (no links, nothing else), sealed as an upload is,
    /// renamed into place whole. Refused when `name` is already here,
    /// even in part.
    pub fn place(&self, name: &str, fetched: &ImageDir) -> Result<ImageFiles, ImageError> {
        check_name(name)?;
        let unusable = |file| ImageError::Unusable {
            name: name.to_string(),
            file,
        };
        for file in [KERNEL_FILE, ROOTFS_FILE] {
            let path = fetched.path().join(file);
            match std::fs::symlink_metadata(&path) {
                Ok(m) if m.is_file() => {}
                _ => return Err(unusable(file)),
            }
            std::fs::set_permissions(
                &path,
                <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o644),
            )
            .map_err(|e| ImageError::Io(format!("seal fetched image {name}: {e}")))?;
        }
        std::fs::set_permissions(
            fetched.path(),
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o700),
        )
        .map_err(|e| ImageError::Io(format!("fetched image {name}: {e}")))?;
        // rename(2) onto a directory that exists (empty or not) fails or
        // replaces an empty one; either way no half image is mixed in.
        let to = self.dir.join(name);
        if std::fs::symlink_metadata(&to).is_ok() {
            return Err(ImageError::Io(format!(
                "image {name} is here in part: upload its missing part or delete it"
            )));
        }
        std::fs::rename(fetched.path(), &to)
            .map_err(|e| ImageError::Io(format!("install fetched image {name}: {e}")))?;
        self.resolve(name)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn root(&self) -> Result<File, ImageError> {
        File::open(&self.dir).map_err(|e| ImageError::Io(format!("open the images directory: {e}")))
    }

    /// Checks that image `name` has both files, each a regular file reached
    /// without a symlink; their paths. Opens nothing for a bad name.
    pub fn resolve(&self, name: &str) -> Result<ImageFiles, ImageError> {
        check_name(name)?;
        let root = self.root()?;
        for file in [KERNEL_FILE, ROOTFS_FILE] {
            let unusable = || ImageError::Unusable {
                name: name.to_string(),
                file,
            };
            let f = open_beneath(
                &root,
                &Path::new(name).join(file),
                libc::O_RDONLY | libc::O_NOFOLLOW,
                0,
            )
            .map_err(|_| unusable())?;
            let meta = f.metadata().map_err(|_| unusable())?;
            if !meta.is_file() {
                return Err(unusable());
            }
        }
        Ok(ImageFiles {
            kernel: self.dir.join(name).join(KERNEL_FILE),
            rootfs: self.dir.join(name).join(ROOTFS_FILE),
        })
    }

    /// Installs one file of image `name` from `body`, at most `limit`
    /// bytes: written to a temporary file beside it and renamed over it
    /// once complete (a reader never sees half an image). Returns the size.
    pub fn install(
        &self,
        name: &str,
        part: ImagePart,
        body: &mut dyn Read,
        limit: u64,
    ) -> Result<u64, ImageError> {
        check_name(name)?;
        let root = self.root()?;
        match open_beneath(
            &root,
            Path::new(name),
            libc::O_RDONLY | libc::O_DIRECTORY,
            0,
        ) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                let c = std::ffi::CString::new(name).map_err(|_| ImageError::BadName)?;
                // SAFETY: mkdirat on our directory's descriptor with a
                // checked plain name (no `/`, no `..`), NUL-terminated.
                let rc = unsafe { libc::mkdirat(root.as_raw_fd(), c.as_ptr(), 0o700) };
                if rc != 0 {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EEXIST) {
                        return Err(ImageError::Io(format!("create image {name}: {e}")));
                    }
                }
            }
            Err(_) => {
                return Err(ImageError::Unusable {
                    name: name.into(),
                    file: part.file_name(),
                })
            }
        }
        let tmp_name = format!(
            "{}.upload-{}",
            part.file_name(),
            crate::random::random_hex(8)
        );
        let tmp_rel = Path::new(name).join(&tmp_name);
        let mut tmp = open_beneath(
            &root,
            &tmp_rel,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
        )
        .map_err(|e| ImageError::Io(format!("create an upload file: {e}")))?;
        let tmp_path = self.dir.join(&tmp_rel);
        let result = copy_limited(body, &mut tmp, limit).and_then(|n| {
            if n == 0 {
                return Err(ImageError::Empty(part.file_name()));
            }
            // Installed sealed (read-only for all, written by nobody but
            // the service): a re-upload under a template's image is what
            // its sandboxes' jails may expose (`service/jail.rs`), never
            // refused there as unsealed. The images directory itself stays
            // the service's alone (0700).
            tmp.set_permissions(
                <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o644),
            )
            .map_err(|e| ImageError::Io(format!("chmod the upload: {e}")))?;
            tmp.sync_all()
                .map_err(|e| ImageError::Io(format!("sync the upload: {e}")))?;
            std::fs::rename(&tmp_path, self.dir.join(name).join(part.file_name()))
                .map_err(|e| ImageError::Io(format!("install the upload: {e}")))?;
            Ok(n)
        });
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp_path);
        }
        result
    }

    /// Image names with both files present, sorted.
    pub fn list(&self) -> Vec<String> {
        let mut out: Vec<String> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| self.resolve(n).is_ok())
            .collect();
        out.sort();
        out
    }

    /// Removes image `name` (its directory, whatever it holds: a half
    /// uploaded image too); `NotFound` without one (a symlink is none).
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        check_name(name)?;
        let dir = self.dir.join(name);
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&dir)
                .map_err(|e| ImageError::Io(format!("remove image {name}: {e}"))),
            _ => Err(ImageError::NotFound(name.to_string())),
        }
    }
}

fn copy_limited(from: &mut dyn Read, to: &mut File, limit: u64) -> Result<u64, ImageError> {
    use std::io::Write;
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        let n = from
            .read(&mut buf)
            .map_err(|e| ImageError::Io(format!("read the upload: {e}")))?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
        if total > limit {
            return Err(ImageError::TooLarge { limit });
        }
        to.write_all(&buf[..n])
            .map_err(|e| ImageError::Io(format!("write the upload: {e}")))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain() {
        for ok in ["debian", "a", "deb-12.1_x"] {
            check_name(ok).unwrap();
        }
        for bad in [
            "",
            "..",
            ".x",
            "a/b",
            "/etc/shadow",
            "../x",
            "a b",
            &"x".repeat(65),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn resolve_refuses_symlinks_out_and_missing_files_alike() {
        let scratch = tempfile::tempdir().unwrap();
        let d = scratch.path().to_path_buf();
        let images = Images::open(d.join("images")).unwrap();
        let good = images.dir().join("good");
        std::fs::create_dir_all(&good).unwrap();
        std::fs::write(good.join(KERNEL_FILE), b"k").unwrap();
        std::fs::write(good.join(ROOTFS_FILE), b"r").unwrap();
        let files = images.resolve("good").unwrap();
        assert!(files.kernel.starts_with(images.dir()));

        // A symlink out of the directory, and a symlinked image directory.
        let outside = d.join("secret");
        std::fs::write(&outside, b"secret").unwrap();
        let evil = images.dir().join("evil");
        std::fs::create_dir_all(&evil).unwrap();
        std::os::unix::fs::symlink(&outside, evil.join(KERNEL_FILE)).unwrap();
        std::fs::write(evil.join(ROOTFS_FILE), b"r").unwrap();
        std::os::unix::fs::symlink(&good, images.dir().join("alias")).unwrap();
        let missing = images.resolve("missing").unwrap_err().to_string();
        for name in ["evil", "alias"] {
            let e = images.resolve(name).unwrap_err().to_string();
            assert_eq!(e.replace(name, "X"), missing.replace("missing", "X"));
            assert!(!e.contains(&d.display().to_string()), "{e}");
        }
        assert_eq!(images.list(), ["good"]);
    }

    #[test]
    fn install_is_capped_and_atomic() {
        let scratch = tempfile::tempdir().unwrap();
        let d = scratch.path().to_path_buf();
        let images = Images::open(d.join("images")).unwrap();
        let n = images
            .install("img", ImagePart::Kernel, &mut &b"kernel"[..], 100)
            .unwrap();
        assert_eq!(n, 6);
        let big = vec![7u8; 1000];
        let e = images
            .install("img", ImagePart::Rootfs, &mut &big[..], 100)
            .unwrap_err();
        assert!(matches!(e, ImageError::TooLarge { limit: 100 }), "{e}");
        let left: Vec<_> = std::fs::read_dir(images.dir().join("img"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, [std::ffi::OsString::from(KERNEL_FILE)]);
        assert!(images.resolve("img").is_err());
        images
            .install("img", ImagePart::Rootfs, &mut &b"fs"[..], 100)
            .unwrap();
        images.resolve("img").unwrap();
        // Installed readable by all, written by none but its owner.
        let mode = std::fs::metadata(images.dir().join("img").join(KERNEL_FILE))
            .unwrap()
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o644
        );
        assert!(images
            .install("../x", ImagePart::Kernel, &mut &b""[..], 1)
            .is_err());
    }
}
