//! The NFS filesystem of one sandbox's exports: a virtual read-only root
//! listing the volumes by name, each volume a host directory reached only
//! through [`open_beneath`] from its root's descriptor (the module doc of
//! [`super`] has the rules).

use std::collections::HashMap;
use std::ffi::{CStr, OsStr};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use nfs3_server::nfs3_types::nfs3::{fattr3, ftype3, nfsstat3, nfstime3, specdata3};
use nfs3_server::vfs::{DirEntryPlus, FileHandle};
use rustix::fs::{AtFlags, Stat};

use crate::images::open_beneath;

/// The uid and gid every object is reported as: the guest's `user`.
pub(super) const OWNER: u32 = 1000;
/// The inode number the virtual root's handle carries.
const ROOT_INO: u64 = 1;
/// The fileid of the virtual root.
const ROOT_FILEID: u64 = 1;
/// Past this many remembered objects, an arbitrary one is forgotten (its
/// handle turns STALE; the client looks the name up again).
const MAX_IDS: usize = 1 << 20;
/// The longest name a directory entry may have.
const NAME_MAX: usize = 255;

pub(super) type Res<T> = Result<T, nfsstat3>;

/// A file handle: the export's tag (random per [`super::VolumeServer::serve`]),
/// the volume (0 the virtual root, `i + 1` the `i`th volume) and the
/// object's host inode number.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Handle([u8; 20]);

impl Handle {
    fn new(tag: u64, vol: u32, ino: u64) -> Self {
        let mut b = [0u8; 20];
        b[..8].copy_from_slice(&tag.to_le_bytes());
        b[8..12].copy_from_slice(&vol.to_le_bytes());
        b[12..].copy_from_slice(&ino.to_le_bytes());
        Handle(b)
    }
    fn tag(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().unwrap_or_default())
    }
    fn vol(&self) -> u32 {
        u32::from_le_bytes(self.0[8..12].try_into().unwrap_or_default())
    }
    fn ino(&self) -> u64 {
        u64::from_le_bytes(self.0[12..].try_into().unwrap_or_default())
    }
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Handle(vol {}, ino {})", self.vol(), self.ino())
    }
}

impl FileHandle for Handle {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn as_bytes(&self) -> &[u8] {
        &self.0
    }
    fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Handle)
    }
}

/// One exported volume: its name and its root, open.
#[derive(Debug)]
pub(super) struct Volume {
    pub(super) name: String,
    pub(super) root: File,
    pub(super) ino: u64,
    /// The bytes its files hold, against its limit.
    pub(super) usage: Arc<super::usage::Usage>,
}

/// What a handle names.
pub(super) enum Target<'a> {
    Root,
    Object {
        vol: u32,
        volume: &'a Volume,
        rel: PathBuf,
        ino: u64,
    },
}

/// The state shared by every connection of one export.
#[derive(Debug)]
pub(super) struct Inner {
    tag: u64,
    volumes: Vec<Volume>,
    /// (volume, inode) → path relative to the volume's root.
    ids: Mutex<HashMap<(u32, u64), PathBuf>>,
    started: nfstime3,
}

/// The [`NfsFileSystem`] of one sandbox's volumes.
#[derive(Debug, Clone)]
pub(super) struct VolumeFs {
    inner: Arc<Inner>,
}

impl VolumeFs {
    /// The filesystem over `volumes`, its handles tagged with `tag`.
    pub(super) fn new(tag: u64, volumes: Vec<Volume>) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        VolumeFs {
            inner: Arc::new(Inner {
                tag,
                volumes,
                ids: Mutex::new(HashMap::new()),
                started: nfstime3 {
                    seconds: u32::try_from(now.as_secs()).unwrap_or(u32::MAX),
                    nseconds: now.subsec_nanos(),
                },
            }),
        }
    }

    /// The virtual root's handle.
    pub(super) fn root(&self) -> Handle {
        self.inner.root_handle()
    }

    /// Runs `f` on the runtime's blocking threads (file system calls).
    pub(super) async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Res<T> + Send + 'static,
    ) -> Res<T> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .unwrap_or(Err(nfsstat3::NFS3ERR_SERVERFAULT))
    }
}

/// An errno as the NFS status that says it.
pub(super) fn status_of_errno(errno: i32) -> nfsstat3 {
    use nfsstat3::*;
    match errno {
        libc::EPERM => NFS3ERR_PERM,
        libc::ENOENT => NFS3ERR_NOENT,
        libc::ENXIO => NFS3ERR_NXIO,
        libc::EACCES => NFS3ERR_ACCES,
        libc::EEXIST => NFS3ERR_EXIST,
        libc::EXDEV => NFS3ERR_XDEV,
        libc::ENODEV => NFS3ERR_NODEV,
        libc::ENOTDIR => NFS3ERR_NOTDIR,
        libc::EISDIR => NFS3ERR_ISDIR,
        libc::EINVAL | libc::ELOOP => NFS3ERR_INVAL,
        libc::EFBIG => NFS3ERR_FBIG,
        libc::ENOSPC => NFS3ERR_NOSPC,
        libc::EROFS => NFS3ERR_ROFS,
        libc::EMLINK => NFS3ERR_MLINK,
        libc::ENAMETOOLONG => NFS3ERR_NAMETOOLONG,
        libc::ENOTEMPTY => NFS3ERR_NOTEMPTY,
        libc::EDQUOT => NFS3ERR_DQUOT,
        libc::ESTALE => NFS3ERR_STALE,
        libc::EOPNOTSUPP => NFS3ERR_NOTSUPP,
        libc::EAGAIN | libc::EBUSY => NFS3ERR_JUKEBOX,
        _ => NFS3ERR_IO,
    }
}

pub(super) fn io_status(e: std::io::Error) -> nfsstat3 {
    e.raw_os_error()
        .map_or(nfsstat3::NFS3ERR_IO, status_of_errno)
}

pub(super) fn rx_status(e: rustix::io::Errno) -> nfsstat3 {
    status_of_errno(e.raw_os_error())
}

/// A name a client may create: no `/`, no NUL, not `.` or `..`, not empty.
pub(super) fn new_name(name: &[u8]) -> Res<&OsStr> {
    match name {
        b"." | b".." => Err(nfsstat3::NFS3ERR_EXIST),
        _ => existing_name(name),
    }
}

/// A name a client may look up or remove (`.` and `..` are handled, or
/// refused, by the caller).
pub(super) fn existing_name(name: &[u8]) -> Res<&OsStr> {
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return Err(nfsstat3::NFS3ERR_ACCES);
    }
    if name.len() > NAME_MAX {
        return Err(nfsstat3::NFS3ERR_NAMETOOLONG);
    }
    if name == b"." || name == b".." {
        return Err(nfsstat3::NFS3ERR_INVAL);
    }
    Ok(OsStr::from_bytes(name))
}

fn time(sec: i64, nsec: u32) -> nfstime3 {
    nfstime3 {
        seconds: u32::try_from(sec.max(0)).unwrap_or(u32::MAX),
        nseconds: nsec,
    }
}

fn kind(st: &Stat) -> ftype3 {
    match st.st_mode & libc::S_IFMT {
        libc::S_IFDIR => ftype3::NF3DIR,
        libc::S_IFLNK => ftype3::NF3LNK,
        libc::S_IFBLK => ftype3::NF3BLK,
        libc::S_IFCHR => ftype3::NF3CHR,
        libc::S_IFSOCK => ftype3::NF3SOCK,
        libc::S_IFIFO => ftype3::NF3FIFO,
        _ => ftype3::NF3REG,
    }
}

/// The NFS attributes of a host object of volume `vol`.
pub(super) fn attrs(vol: u32, st: &Stat) -> fattr3 {
    let size = u64::try_from(st.st_size).unwrap_or(0);
    fattr3 {
        type_: kind(st),
        mode: st.st_mode & 0o7777,
        nlink: u32::try_from(st.st_nlink).unwrap_or(u32::MAX),
        uid: OWNER,
        gid: OWNER,
        size,
        used: u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512),
        rdev: specdata3::default(),
        fsid: 0,
        fileid: fileid(vol, st.st_ino),
        atime: time(st.st_atime, st.st_atime_nsec as u32),
        mtime: time(st.st_mtime, st.st_mtime_nsec as u32),
        ctime: time(st.st_ctime, st.st_ctime_nsec as u32),
    }
}

fn fileid(vol: u32, ino: u64) -> u64 {
    ino ^ (u64::from(vol) << 56)
}

pub(super) fn is_dir(st: &Stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

pub(super) fn is_link(st: &Stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFLNK
}

pub(super) fn is_file(st: &Stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFREG
}

/// The most entries [`find`] looks at in one volume.
const MAX_WALK: usize = 1 << 18;

/// Where in `volume` the object of inode `ino` is: a breadth-first walk
/// from its root through directories only (never a symbolic link), at most
/// [`MAX_WALK`] entries; `None` when it is not there (removed: the handle
/// is stale).
fn find(volume: &Volume, ino: u64) -> Option<PathBuf> {
    let mut queue = std::collections::VecDeque::from([PathBuf::new()]);
    let mut seen = 0usize;
    while let Some(rel) = queue.pop_front() {
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
        let Ok(dir) = open_beneath(&volume.root, dot(&rel), flags, 0) else {
            continue;
        };
        let Ok(entries) = rustix::fs::Dir::read_from(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            seen += 1;
            if seen > MAX_WALK {
                return None;
            }
            let path = rel.join(OsStr::from_bytes(name));
            if entry.ino() == ino {
                return Some(path);
            }
            if entry.file_type() == rustix::fs::FileType::Directory {
                queue.push_back(path);
            }
        }
    }
    None
}

/// `rel`, or `.` for the volume's root.
fn dot(rel: &Path) -> &Path {
    if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    }
}

/// The magic link of an open descriptor, to change the object it holds
/// (never a symbolic link: callers check) without naming a path again.
pub(super) fn proc_path(fd: &impl AsRawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

impl Inner {
    pub(super) fn ids(&self) -> MutexGuard<'_, HashMap<(u32, u64), PathBuf>> {
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn root_handle(&self) -> Handle {
        Handle::new(self.tag, 0, ROOT_INO)
    }

    /// Remembers where an object is, and answers its handle.
    pub(super) fn remember(&self, vol: u32, ino: u64, rel: PathBuf) -> Handle {
        let volume_root = self.volumes[vol as usize - 1].ino == ino && rel.as_os_str().is_empty();
        if !volume_root {
            let mut ids = self.ids();
            if ids.len() >= MAX_IDS && !ids.contains_key(&(vol, ino)) {
                if let Some(k) = ids.keys().next().copied() {
                    ids.remove(&k);
                }
            }
            ids.insert((vol, ino), rel);
        }
        Handle::new(self.tag, vol, ino)
    }

    pub(super) fn resolve(&self, h: &Handle) -> Res<Target<'_>> {
        if h.tag() != self.tag {
            return Err(nfsstat3::NFS3ERR_STALE);
        }
        let vol = h.vol();
        if vol == 0 {
            return if h.ino() == ROOT_INO {
                Ok(Target::Root)
            } else {
                Err(nfsstat3::NFS3ERR_STALE)
            };
        }
        let volume = self
            .volumes
            .get(vol as usize - 1)
            .ok_or(nfsstat3::NFS3ERR_STALE)?;
        let rel = if h.ino() == volume.ino {
            PathBuf::new()
        } else {
            let known = self.ids().get(&(vol, h.ino())).cloned();
            match known {
                Some(rel) => rel,
                // A handle from before this export (the guest's mount went
                // on across a wake or a restart of the pod): found again
                // by its inode.
                None => {
                    let rel = find(volume, h.ino()).ok_or(nfsstat3::NFS3ERR_STALE)?;
                    self.remember(vol, h.ino(), rel.clone());
                    rel
                }
            }
        };
        Ok(Target::Object {
            vol,
            volume,
            rel,
            ino: h.ino(),
        })
    }

    /// Opens the object at `rel` (never through a symbolic link, never
    /// outside the volume) and checks it is still inode `ino`.
    pub(super) fn open(volume: &Volume, rel: &Path, ino: u64, flags: i32) -> Res<(File, Stat)> {
        let file = open_beneath(&volume.root, dot(rel), flags | libc::O_NOFOLLOW, 0).map_err(
            |e| match e.raw_os_error() {
                Some(libc::ENOENT | libc::ENOTDIR | libc::EXDEV) => nfsstat3::NFS3ERR_STALE,
                _ => io_status(e),
            },
        )?;
        let st = rustix::fs::fstat(&file).map_err(rx_status)?;
        if st.st_ino != ino {
            return Err(nfsstat3::NFS3ERR_STALE);
        }
        Ok((file, st))
    }

    /// A directory of a volume, open (`O_PATH`) to make or remove names in
    /// it; the virtual root is read-only.
    /// The count of the bytes volume `vol`'s files hold.
    pub(super) fn usage(&self, vol: u32) -> &super::usage::Usage {
        &self.volumes[vol as usize - 1].usage
    }

    pub(super) fn dir(&self, h: &Handle) -> Res<(u32, PathBuf, File)> {
        match self.resolve(h)? {
            Target::Root => Err(nfsstat3::NFS3ERR_ROFS),
            Target::Object {
                vol,
                volume,
                rel,
                ino,
            } => {
                let (dir, st) = Self::open(volume, &rel, ino, libc::O_PATH)?;
                if !is_dir(&st) {
                    return Err(nfsstat3::NFS3ERR_NOTDIR);
                }
                if st.st_mode & 0o300 != 0o300 {
                    return Err(nfsstat3::NFS3ERR_ACCES);
                }
                Ok((vol, rel, dir))
            }
        }
    }

    fn root_attrs(&self) -> fattr3 {
        fattr3 {
            type_: ftype3::NF3DIR,
            mode: 0o555,
            nlink: 2,
            uid: OWNER,
            gid: OWNER,
            size: 4096,
            used: 4096,
            rdev: specdata3::default(),
            fsid: 0,
            fileid: ROOT_FILEID,
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
        }
    }

    pub(super) fn getattr(&self, h: &Handle) -> Res<fattr3> {
        match self.resolve(h)? {
            Target::Root => Ok(self.root_attrs()),
            Target::Object {
                vol,
                volume,
                rel,
                ino,
            } => Self::open(volume, &rel, ino, libc::O_PATH).map(|(_, st)| attrs(vol, &st)),
        }
    }

    pub(super) fn lookup(&self, h: &Handle, name: &[u8]) -> Res<Handle> {
        let (vol, volume, rel, ino) = match self.resolve(h)? {
            Target::Root => {
                if name == b"." || name == b".." {
                    return Ok(self.root_handle());
                }
                let i = self
                    .volumes
                    .iter()
                    .position(|v| v.name.as_bytes() == name)
                    .ok_or(nfsstat3::NFS3ERR_NOENT)?;
                return Ok(Handle::new(self.tag, i as u32 + 1, self.volumes[i].ino));
            }
            Target::Object {
                vol,
                volume,
                rel,
                ino,
            } => (vol, volume, rel, ino),
        };
        let (dir, st) = Self::open(volume, &rel, ino, libc::O_PATH)?;
        if !is_dir(&st) {
            return Err(nfsstat3::NFS3ERR_NOTDIR);
        }
        match name {
            b"." => return Ok(*h),
            // `..` of a volume's root is that root: the volume is all the
            // client sees of the host.
            b".." => {
                let parent = rel.parent().map(Path::to_path_buf).unwrap_or_default();
                let up = open_beneath(&volume.root, dot(&parent), libc::O_PATH, 0)
                    .map_err(|_| nfsstat3::NFS3ERR_STALE)?;
                let pst = rustix::fs::fstat(&up).map_err(rx_status)?;
                return Ok(self.remember(vol, pst.st_ino, parent));
            }
            _ => {}
        }
        let name = existing_name(name)?;
        let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(rx_status)?;
        Ok(self.remember(vol, st.st_ino, rel.join(name)))
    }

    pub(super) fn read(&self, h: &Handle, offset: u64, count: u32) -> Res<(Vec<u8>, bool)> {
        let Target::Object {
            volume, rel, ino, ..
        } = self.resolve(h)?
        else {
            return Err(nfsstat3::NFS3ERR_ISDIR);
        };
        let (file, st) = Self::open(volume, &rel, ino, libc::O_RDONLY)?;
        if is_dir(&st) {
            return Err(nfsstat3::NFS3ERR_ISDIR);
        }
        let mut buf = vec![0u8; count as usize];
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_status(e)),
            }
        }
        buf.truncate(done);
        let size = u64::try_from(st.st_size).unwrap_or(0);
        Ok((buf, offset + done as u64 >= size))
    }

    pub(super) fn readlink(&self, h: &Handle) -> Res<Vec<u8>> {
        let Target::Object {
            volume, rel, ino, ..
        } = self.resolve(h)?
        else {
            return Err(nfsstat3::NFS3ERR_INVAL);
        };
        let (link, st) = Self::open(volume, &rel, ino, libc::O_PATH)?;
        if !is_link(&st) {
            return Err(nfsstat3::NFS3ERR_INVAL);
        }
        let target = rustix::fs::readlinkat(&link, "", Vec::new()).map_err(rx_status)?;
        Ok(target.into_bytes())
    }

    pub(super) fn readdir(&self, h: &Handle) -> Res<Vec<DirEntryPlus<Handle>>> {
        let mut out = Vec::new();
        let (vol, volume, rel, ino) = match self.resolve(h)? {
            Target::Root => {
                for (i, v) in self.volumes.iter().enumerate() {
                    let vol = i as u32 + 1;
                    let st = rustix::fs::fstat(&v.root).ok();
                    out.push(DirEntryPlus {
                        fileid: fileid(vol, v.ino),
                        name: v.name.as_bytes().to_vec().into(),
                        cookie: 0,
                        name_attributes: st.map(|st| attrs(vol, &st)),
                        name_handle: Some(Handle::new(self.tag, vol, v.ino)),
                    });
                }
                return Ok(out);
            }
            Target::Object {
                vol,
                volume,
                rel,
                ino,
            } => (vol, volume, rel, ino),
        };
        let (dir, st) = Self::open(volume, &rel, ino, libc::O_RDONLY | libc::O_DIRECTORY)?;
        if !is_dir(&st) {
            return Err(nfsstat3::NFS3ERR_NOTDIR);
        }
        let mut names = Vec::new();
        let mut entries = rustix::fs::Dir::read_from(&dir).map_err(rx_status)?;
        while let Some(entry) = entries.read() {
            let entry = entry.map_err(rx_status)?;
            let name: &CStr = entry.file_name();
            let name = name.to_bytes();
            if name != b"." && name != b".." {
                names.push(name.to_vec());
            }
        }
        names.sort();
        for name in names {
            let name_os = OsStr::from_bytes(&name);
            let Ok(st) = rustix::fs::statat(&dir, name_os, AtFlags::SYMLINK_NOFOLLOW) else {
                continue;
            };
            let handle = self.remember(vol, st.st_ino, rel.join(name_os));
            out.push(DirEntryPlus {
                fileid: fileid(vol, st.st_ino),
                name: name.into(),
                cookie: 0,
                name_attributes: Some(attrs(vol, &st)),
                name_handle: Some(handle),
            });
        }
        Ok(out)
    }
}
