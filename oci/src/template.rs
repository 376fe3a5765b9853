//! An unpacked image made into a torpor Linux template's root filesystem
//! ([`make_template_rootfs`]): what `scripts/build-rootfs` gives the base
//! image, done here in Rust on the tree, then `mkfs.ext4 -d` (nothing is
//! mounted). Added:
//!
//! - torpor's init (`guest-image/rootfs/init`, POSIX sh: the image must
//!   have `/bin/sh`) as `/usr/local/sbin/torpor-init`, and as `/sbin/init`
//!   unless the image has one of its own (then it is kept, and the
//!   template boots with `init=/usr/local/sbin/torpor-init`:
//!   [`TemplateReport::init`]);
//! - the agent at `/usr/local/bin/torpor-agent` (root's, 0755) and an
//!   empty `/etc/torpor/init.d/`;
//! - the user `user` (uid 1000, or the next free one; home `/home/user`
//!   from `/etc/skel`) with passwordless sudo (`/etc/sudoers.d/user`) if
//!   the image has no such user: the account files are edited directly.
//!   An image without a sudo binary gets the sudoers file but no sudo
//!   ([`TemplateReport::sudo`] says so);
//! - `/etc/resolv.conf` (the sandbox's gateway, where the pod's DNS
//!   forwarder answers), `/etc/hostname`, `/etc/hosts`, `/etc/fstab`;
//! - `reboot`, `poweroff` and `halt` in `/usr/local/sbin` (they need
//!   python3, so only where the image has it), and pip's "externally
//!   managed" marker removed, as on the base image.
//!
//! Every write goes through [`Root`]: a path is resolved as the guest
//! will (an absolute symlink from the root), never out of it, and a file
//! is replaced, never written through a symlink.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::fs::{FileType, Gid, Mode, OFlags, Uid};

use crate::error::{Error, Result};
use crate::root::{self, Follow, Root, WalkError};
use crate::users::{self, NewUser};

/// torpor's guest init.
const INIT: &str = include_str!("../../guest-image/rootfs/init");
/// The base image's reboot (reboot(2) through python3).
const REBOOT: &str = include_str!("../../guest-image/rootfs/reboot");
/// Where torpor's init always is.
pub const TORPOR_INIT: &str = "/usr/local/sbin/torpor-init";
/// Where the agent is.
pub const AGENT: &str = "/usr/local/bin/torpor-agent";

/// What [`make_template_rootfs`] adds besides the agent, as a digest: its
/// init, its `reboot` and the version of its layout (users, sudoers,
/// resolver...). A cache of images made from unpacked trees keys on it,
/// with the image's and the agent's digests, so that a change of what is
/// added makes new images.
pub fn additions_digest() -> crate::Digest {
    let mut all = Vec::with_capacity(INIT.len() + REBOOT.len() + 64);
    all.extend_from_slice(b"torpor-oci template additions v1\0");
    all.extend_from_slice(INIT.as_bytes());
    all.push(0);
    all.extend_from_slice(REBOOT.as_bytes());
    crate::Digest::of(&all)
}

/// What to add and how large an image to make.
#[derive(Debug, Clone)]
pub struct TemplateOptions {
    /// The agent binary on this host (a static build: the image's libc is
    /// not torpor's).
    pub agent: PathBuf,
    /// `/etc/hostname` (init sets it, or `torpor.hostname=`).
    pub hostname: String,
    /// The resolver in `/etc/resolv.conf`: the sandbox's gateway.
    pub nameserver: String,
    /// The sandbox user's name and the uid it gets if that is free.
    pub user: String,
    /// See `user`.
    pub uid: u32,
    /// The image's size; `None`: the tree's, plus `headroom_percent`,
    /// plus `headroom_bytes`.
    pub size_bytes: Option<u64>,
    /// See `size_bytes`.
    pub headroom_percent: u64,
    /// See `size_bytes`.
    pub headroom_bytes: u64,
}

impl TemplateOptions {
    /// As `scripts/build-rootfs`: hostname `torpor`, resolver 172.16.0.1,
    /// `user` (uid 1000), size = tree + 30% + 64 MiB.
    pub fn new(agent: impl Into<PathBuf>) -> TemplateOptions {
        TemplateOptions {
            agent: agent.into(),
            hostname: "torpor".into(),
            nameserver: "172.16.0.1".into(),
            user: "user".into(),
            uid: 1000,
            size_bytes: None,
            headroom_percent: 30,
            headroom_bytes: 64 << 20,
        }
    }
}

/// What [`make_template_rootfs`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateReport {
    /// The init to boot with: `/sbin/init`, or [`TORPOR_INIT`] when the
    /// image keeps an init of its own (pass `init=` on the command line).
    pub init: String,
    /// The sandbox user, its uid and gid, and whether it was added.
    pub user: (String, u32, u32),
    /// Whether the user was added (false: the image had it).
    pub user_added: bool,
    /// Whether the image has a sudo binary.
    pub sudo: bool,
    /// Whether `reboot` was installed (the image has python3).
    pub reboot: bool,
    /// The image's size in bytes (0 until the ext4 image is made).
    pub size_bytes: u64,
}

/// Adds what every torpor template needs to the unpacked tree at `root`
/// (see the module's docs), then makes the ext4 image `out` from it.
pub fn make_template_rootfs(
    root: &Path,
    options: &TemplateOptions,
    out: &Path,
) -> Result<TemplateReport> {
    let mut report = prepare_root(root, options)?;
    let size = match options.size_bytes {
        Some(size) => size,
        None => {
            let content = tree_bytes(root)?;
            content + content * options.headroom_percent / 100 + options.headroom_bytes
        }
    };
    make_ext4(root, out, size)?;
    report.size_bytes = size;
    Ok(report)
}

/// The additions alone, without the image.
pub fn prepare_root(root: &Path, options: &TemplateOptions) -> Result<TemplateReport> {
    let root = Root::open(root).map_err(|e| Error::io(root.display(), e))?;
    if !is_file(&root, "/bin/sh")? {
        return Err(Error::NoShell);
    }
    let agent = fs::read(&options.agent).map_err(|e| Error::io(options.agent.display(), e))?;
    put(&root, AGENT, &agent, 0o755)?;
    put(&root, TORPOR_INIT, INIT.as_bytes(), 0o755)?;
    let image_init = exists(&root, "/sbin/init")?;
    if !image_init {
        put(&root, "/sbin/init", INIT.as_bytes(), 0o755)?;
    }
    mkdir(&root, "/etc/torpor/init.d", 0o755, 0, 0)?;
    let hostname = &options.hostname;
    put(
        &root,
        "/etc/hostname",
        format!("{hostname}\n").as_bytes(),
        0o644,
    )?;
    let hosts = format!(
        "127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    );
    put(&root, "/etc/hosts", hosts.as_bytes(), 0o644)?;
    put(
        &root,
        "/etc/fstab",
        b"# root is mounted read-write by the kernel (root=/dev/vda rw)\n",
        0o644,
    )?;
    let resolv = format!(
        "nameserver {}\noptions timeout:2 attempts:2\n",
        options.nameserver
    );
    put(&root, "/etc/resolv.conf", resolv.as_bytes(), 0o644)?;
    let reboot = is_file(&root, "/usr/bin/python3")?;
    if reboot {
        put(&root, "/usr/local/sbin/reboot", REBOOT.as_bytes(), 0o755)?;
        for name in ["poweroff", "halt"] {
            symlink(&root, &format!("/usr/local/sbin/{name}"), "reboot")?;
        }
    }
    drop_externally_managed(&root)?;
    let (user, user_added) = add_user(&root, options)?;
    let sudo = is_file(&root, "/usr/bin/sudo")? || is_file(&root, "/bin/sudo")?;
    Ok(TemplateReport {
        init: if image_init {
            TORPOR_INIT.into()
        } else {
            "/sbin/init".into()
        },
        user,
        user_added,
        sudo,
        reboot,
        size_bytes: 0,
    })
}

fn walk_error(path: &str, e: WalkError) -> Error {
    match e {
        WalkError::Io(e) => Error::io(format!("template: {path}"), e),
        WalkError::Refused(reason) => Error::TemplatePath {
            path: path.to_string(),
            reason,
        },
    }
}

/// Whether `path` is there (a dangling symlink counts).
fn exists(root: &Root, path: &str) -> Result<bool> {
    match root.walk_guest(path, Follow::Chroot, false, false) {
        Ok(w) => match w.name {
            Some(name) => Ok(root::kind_of(w.dir.as_fd(), &name)
                .map_err(|e| Error::io(path, e))?
                .is_some()),
            None => Ok(true),
        },
        Err(WalkError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(WalkError::Refused(_)) => Ok(false),
        Err(e) => Err(walk_error(path, e)),
    }
}

/// Whether `path`, symlinks followed as the guest would, is a file.
fn is_file(root: &Root, path: &str) -> Result<bool> {
    match root.walk_guest(path, Follow::Chroot, true, false) {
        Ok(w) => match w.name {
            Some(name) => Ok(matches!(
                root::kind_of(w.dir.as_fd(), &name).map_err(|e| Error::io(path, e))?,
                Some(FileType::RegularFile)
            )),
            None => Ok(false),
        },
        Err(WalkError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(WalkError::Refused(_)) => Ok(false),
        Err(e) => Err(walk_error(path, e)),
    }
}

/// A file of the image as read: its bytes, mode, uid and gid.
struct ImageFile {
    bytes: Vec<u8>,
    mode: u32,
    uid: u32,
    gid: u32,
}

/// The file at `path` (at most 16 MiB); `None` if there is none.
fn read(root: &Root, path: &str) -> Result<Option<ImageFile>> {
    let w = match root.walk_guest(path, Follow::Chroot, true, false) {
        Ok(w) => w,
        Err(WalkError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(walk_error(path, e)),
    };
    let Some(name) = w.name else { return Ok(None) };
    if root::kind_of(w.dir.as_fd(), &name).map_err(|e| Error::io(path, e))?
        != Some(FileType::RegularFile)
    {
        return Ok(None);
    }
    let fd = rustix::fs::openat(
        &w.dir,
        &name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::io(path, e.into()))?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| Error::io(path, e.into()))?;
    let mut bytes = Vec::new();
    fs::File::from(fd)
        .take(16 << 20)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    Ok(Some(ImageFile {
        bytes,
        mode: stat.st_mode & 0o7777,
        uid: stat.st_uid,
        gid: stat.st_gid,
    }))
}

/// Writes `path` (replacing whatever is there), root's, `mode`.
fn put(root: &Root, path: &str, bytes: &[u8], mode: u32) -> Result<()> {
    put_owned(root, path, bytes, mode, 0, 0)
}

fn put_owned(root: &Root, path: &str, bytes: &[u8], mode: u32, uid: u32, gid: u32) -> Result<()> {
    let w = root
        .walk_guest(path, Follow::Chroot, false, true)
        .map_err(|e| walk_error(path, e))?;
    let name = w
        .name
        .ok_or_else(|| Error::io(path, std::io::ErrorKind::IsADirectory.into()))?;
    root::remove(w.dir.as_fd(), &name).map_err(|e| Error::io(path, e))?;
    let fd = rustix::fs::openat(
        &w.dir,
        &name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| Error::io(path, e.into()))?;
    rustix::fs::fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
        .map_err(|e| Error::io(path, e.into()))?;
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(|e| Error::io(path, e.into()))?;
    fs::File::from(fd)
        .write_all(bytes)
        .map_err(|e| Error::io(path, e))
}

/// Makes the directory `path` (and its parents) if it is missing.
fn mkdir(root: &Root, path: &str, mode: u32, uid: u32, gid: u32) -> Result<()> {
    let w = root
        .walk_guest(path, Follow::Chroot, false, true)
        .map_err(|e| walk_error(path, e))?;
    let Some(name) = w.name else { return Ok(()) };
    match root::kind_of(w.dir.as_fd(), &name).map_err(|e| Error::io(path, e))? {
        Some(FileType::Directory) => return Ok(()),
        Some(_) => root::remove(w.dir.as_fd(), &name).map_err(|e| Error::io(path, e))?,
        None => {}
    }
    rustix::fs::mkdirat(&w.dir, &name, Mode::from_raw_mode(0o700))
        .map_err(|e| Error::io(path, e.into()))?;
    let fd = rustix::fs::openat(
        &w.dir,
        &name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| Error::io(path, e.into()))?;
    rustix::fs::fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
        .map_err(|e| Error::io(path, e.into()))?;
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(|e| Error::io(path, e.into()))
}

fn symlink(root: &Root, path: &str, target: &str) -> Result<()> {
    let w = root
        .walk_guest(path, Follow::Chroot, false, true)
        .map_err(|e| walk_error(path, e))?;
    let name = w
        .name
        .ok_or_else(|| Error::io(path, std::io::ErrorKind::IsADirectory.into()))?;
    root::remove(w.dir.as_fd(), &name).map_err(|e| Error::io(path, e))?;
    rustix::fs::symlinkat(target, &w.dir, &name).map_err(|e| Error::io(path, e.into()))
}

/// Debian's python refuses `pip install` outside a venv while
/// `EXTERNALLY-MANAGED` is there; E2B's images let pip install.
fn drop_externally_managed(root: &Root) -> Result<()> {
    let w = match root.walk_guest("/usr/lib", Follow::Chroot, true, false) {
        Ok(w) if w.name.is_none() => w,
        _ => return Ok(()),
    };
    for name in root::names(w.dir.as_fd()).map_err(|e| Error::io("/usr/lib", e))? {
        if name.to_string_lossy().starts_with("python3") {
            let marker = format!("/usr/lib/{}/EXTERNALLY-MANAGED", name.to_string_lossy());
            if let Ok(m) = root.walk_guest(&marker, Follow::Chroot, false, false) {
                if let Some(n) = m.name {
                    root::remove(m.dir.as_fd(), &n).map_err(|e| Error::io(&marker, e))?;
                }
            }
        }
    }
    Ok(())
}

/// The sandbox user, added to the account files unless there.
fn add_user(root: &Root, options: &TemplateOptions) -> Result<((String, u32, u32), bool)> {
    let name = &options.user;
    let default = |text: &[u8]| ImageFile {
        bytes: text.to_vec(),
        mode: 0o644,
        uid: 0,
        gid: 0,
    };
    let passwd_file =
        read(root, "/etc/passwd")?.unwrap_or_else(|| default(b"root:x:0:0:root:/root:/bin/sh\n"));
    let (passwd, passwd_mode) = (passwd_file.bytes, passwd_file.mode);
    let passwd = String::from_utf8_lossy(&passwd).into_owned();
    let accounts = users::accounts(&passwd);
    if let Some(a) = accounts.iter().find(|a| &a.name == name) {
        return Ok(((name.clone(), a.uid, a.gid), false));
    }
    let group_file = read(root, "/etc/group")?.unwrap_or_else(|| default(b"root:x:0:\n"));
    let group_mode = group_file.mode;
    let group = String::from_utf8_lossy(&group_file.bytes).into_owned();
    let groups = users::groups(&group);
    let uid = users::free_id(
        options.uid,
        &accounts.iter().map(|a| a.uid).collect::<Vec<_>>(),
    );
    let existing_group = groups.iter().find(|(g, _)| g == name).map(|(_, gid)| *gid);
    let gid = existing_group.unwrap_or_else(|| {
        users::free_id(uid, &groups.iter().map(|(_, g)| *g).collect::<Vec<_>>())
    });
    let home = format!("/home/{name}");
    let shell = if is_file(root, "/bin/bash")? {
        "/bin/bash"
    } else {
        "/bin/sh"
    };
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() / 86400)
        .unwrap_or(0);
    let lines = NewUser::new(name, uid, gid, &home, shell, days);
    put(
        root,
        "/etc/passwd",
        users::append_line(&passwd, &lines.passwd).as_bytes(),
        passwd_mode,
    )?;
    if existing_group.is_none() {
        put(
            root,
            "/etc/group",
            users::append_line(&group, &lines.group).as_bytes(),
            group_mode,
        )?;
    }
    for (path, line) in [
        ("/etc/shadow", &lines.shadow),
        ("/etc/gshadow", &lines.gshadow),
    ] {
        if let Some(file) = read(root, path)? {
            let text = String::from_utf8_lossy(&file.bytes).into_owned();
            if path == "/etc/gshadow" && existing_group.is_some() {
                continue;
            }
            put_owned(
                root,
                path,
                users::append_line(&text, line).as_bytes(),
                file.mode,
                file.uid,
                file.gid,
            )?;
        }
    }
    mkdir(root, "/home", 0o755, 0, 0)?;
    mkdir(root, &home, 0o755, uid, gid)?;
    copy_skel(root, &home, uid, gid)?;
    mkdir(root, "/etc/sudoers.d", 0o755, 0, 0)?;
    put(
        root,
        &format!("/etc/sudoers.d/{name}"),
        format!("{name} ALL=(ALL:ALL) NOPASSWD: ALL\n").as_bytes(),
        0o440,
    )?;
    Ok(((name.clone(), uid, gid), true))
}

/// `/etc/skel`'s files (not its subdirectories) into a new home.
fn copy_skel(root: &Root, home: &str, uid: u32, gid: u32) -> Result<()> {
    let w = match root.walk_guest("/etc/skel", Follow::Chroot, true, false) {
        Ok(w) if w.name.is_none() => w,
        _ => return Ok(()),
    };
    for name in root::names(w.dir.as_fd()).map_err(|e| Error::io("/etc/skel", e))? {
        let name = name.to_string_lossy().into_owned();
        let from = format!("/etc/skel/{name}");
        if let Some(file) = read(root, &from)? {
            put_owned(
                root,
                &format!("{home}/{name}"),
                &file.bytes,
                file.mode & 0o777,
                uid,
                gid,
            )?;
        }
    }
    Ok(())
}

/// The bytes the tree takes on ext4: files in 4 KiB blocks, plus an
/// inode's worth per entry.
fn tree_bytes(root: &Path) -> Result<u64> {
    let mut total = 0u64;
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in fs::read_dir(&dir).map_err(|e| Error::io(dir.display(), e))? {
            let entry = entry.map_err(|e| Error::io(dir.display(), e))?;
            let meta = entry
                .metadata()
                .map_err(|e| Error::io(entry.path().display(), e))?;
            total += 4096 + meta.len().div_ceil(4096) * 4096;
            if meta.file_type().is_dir() {
                todo.push(entry.path());
            }
        }
    }
    Ok(total)
}

/// `mkfs.ext4 -d root` into `out` (written beside it, then renamed).
pub fn make_ext4(root: &Path, out: &Path, size_bytes: u64) -> Result<()> {
    let mkfs = ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("mkfs.ext4"));
    let mut temp = out.as_os_str().to_os_string();
    temp.push(".tmp");
    let temp = PathBuf::from(temp);
    let _ = fs::remove_file(&temp);
    let output = Command::new(&mkfs)
        .args(["-q", "-F", "-b", "4096", "-L", "torpor-root", "-d"])
        .arg(root)
        .arg(&temp)
        .arg(format!("{}k", size_bytes.div_ceil(1024)))
        .output()
        .map_err(|e| {
            Error::Mkfs(format!(
                "{}: {e} (apt-get install e2fsprogs)",
                mkfs.display()
            ))
        })?;
    if !output.status.success() {
        let _ = fs::remove_file(&temp);
        return Err(Error::Mkfs(format!(
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    fs::rename(&temp, out).map_err(|e| Error::io(out.display(), e))
}
