//! The operations of [`super::fs`] that change a volume: attributes,
//! data, names.

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;

use nfs3_server::nfs3_types::nfs3::{
    createverf3, fattr3, nfsstat3, nfstime3, sattr3, set_atime, set_mode3, set_mtime, set_size3,
    stable_how,
};
use rustix::fs::{AtFlags, Mode, OFlags, Stat, Timespec, Timestamps, CWD};

use super::fs::{
    attrs, existing_name, io_status, is_dir, is_file, is_link, new_name, proc_path, rx_status,
    Handle, Inner, Res, Target,
};
use super::usage::{OverLimit, Usage};

/// A file's size in bytes.
fn size_of(st: &Stat) -> u64 {
    st.st_size.max(0) as u64
}

/// A change past the volume's limit: the guest's write fails with
/// `EDQUOT` ("Disk quota exceeded").
fn over_limit(_: OverLimit) -> nfsstat3 {
    nfsstat3::NFS3ERR_DQUOT
}

impl Inner {
    pub(super) fn setattr(&self, h: &Handle, set: &sattr3) -> Res<fattr3> {
        let Target::Object {
            vol,
            volume,
            rel,
            ino,
        } = self.resolve(h)?
        else {
            return Err(nfsstat3::NFS3ERR_ROFS);
        };
        let (obj, st) = Self::open(volume, &rel, ino, libc::O_PATH)?;
        Self::apply(&obj, &st, set, &volume.usage)?;
        let st = rustix::fs::fstat(&obj).map_err(rx_status)?;
        Ok(attrs(vol, &st))
    }

    /// Applies mode, size and times to the object `obj` holds (uid and gid
    /// are accepted and ignored). A symbolic link takes none of them. A
    /// size past the volume's limit is `NFS3ERR_DQUOT`.
    fn apply(obj: &File, st: &Stat, set: &sattr3, usage: &Usage) -> Res<()> {
        let wants_change = matches!(set.mode, set_mode3::Some(_))
            || matches!(set.size, set_size3::Some(_))
            || !matches!(set.atime, set_atime::DONT_CHANGE)
            || !matches!(set.mtime, set_mtime::DONT_CHANGE);
        if !wants_change {
            return Ok(());
        }
        if is_link(st) {
            return Err(nfsstat3::NFS3ERR_NOTSUPP);
        }
        let path = proc_path(obj);
        if let set_size3::Some(size) = set.size {
            if is_dir(st) {
                return Err(nfsstat3::NFS3ERR_ISDIR);
            }
            if !is_file(st) {
                return Err(nfsstat3::NFS3ERR_INVAL);
            }
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(io_status)?;
            let old = size_of(st);
            usage.resize(old, size).map_err(over_limit)?;
            if let Err(e) = f.set_len(size) {
                let _ = usage.resize(size, old);
                return Err(io_status(e));
            }
        }
        if let set_mode3::Some(mode) = set.mode {
            rustix::fs::chmod(&path, Mode::from_raw_mode(mode & 0o7777)).map_err(rx_status)?;
        }
        let ts = |t: Option<&nfstime3>, now: bool| match (t, now) {
            (Some(t), _) => Timespec {
                tv_sec: i64::from(t.seconds),
                tv_nsec: t.nseconds.into(),
            },
            (None, true) => Timespec {
                tv_sec: 0,
                tv_nsec: rustix::fs::UTIME_NOW,
            },
            (None, false) => Timespec {
                tv_sec: 0,
                tv_nsec: rustix::fs::UTIME_OMIT,
            },
        };
        let atime = match &set.atime {
            set_atime::DONT_CHANGE => ts(None, false),
            set_atime::SET_TO_SERVER_TIME => ts(None, true),
            set_atime::SET_TO_CLIENT_TIME(t) => ts(Some(t), false),
        };
        let mtime = match &set.mtime {
            set_mtime::DONT_CHANGE => ts(None, false),
            set_mtime::SET_TO_SERVER_TIME => ts(None, true),
            set_mtime::SET_TO_CLIENT_TIME(t) => ts(Some(t), false),
        };
        if atime.tv_nsec != rustix::fs::UTIME_OMIT || mtime.tv_nsec != rustix::fs::UTIME_OMIT {
            let times = Timestamps {
                last_access: atime,
                last_modification: mtime,
            };
            rustix::fs::utimensat(CWD, &path, &times, AtFlags::empty()).map_err(rx_status)?;
        }
        Ok(())
    }

    pub(super) fn write(
        &self,
        h: &Handle,
        offset: u64,
        data: &[u8],
        stable: stable_how,
    ) -> Res<fattr3> {
        let Target::Object {
            vol,
            volume,
            rel,
            ino,
        } = self.resolve(h)?
        else {
            return Err(nfsstat3::NFS3ERR_ISDIR);
        };
        let (file, st) = Self::open(volume, &rel, ino, libc::O_WRONLY).map_err(|e| match e {
            nfsstat3::NFS3ERR_ISDIR => nfsstat3::NFS3ERR_INVAL,
            e => e,
        })?;
        if !is_file(&st) {
            return Err(nfsstat3::NFS3ERR_INVAL);
        }
        // The growth is counted before it is written; what a failed write
        // did not grow is given back after.
        let old = size_of(&st);
        let end = offset.saturating_add(data.len() as u64);
        volume.usage.resize(old, end.max(old)).map_err(over_limit)?;
        if let Err(e) = file.write_all_at(data, offset) {
            let now = rustix::fs::fstat(&file)
                .map(|st| size_of(&st))
                .unwrap_or(old);
            let _ = volume.usage.resize(end.max(old), now);
            return Err(io_status(e));
        }
        if stable != stable_how::UNSTABLE {
            file.sync_data().map_err(io_status)?;
        }
        let st = rustix::fs::fstat(&file).map_err(rx_status)?;
        Ok(attrs(vol, &st))
    }

    pub(super) fn create(&self, h: &Handle, name: &[u8], set: &sattr3) -> Res<(Handle, fattr3)> {
        let (vol, rel, dir) = self.dir(h)?;
        let name = new_name(name)?;
        let mode = match set.mode {
            set_mode3::Some(m) => m & 0o7777,
            set_mode3::None => 0o644,
        };
        let base = OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY;
        let file = match rustix::fs::openat(
            &dir,
            name,
            base | OFlags::CREATE | OFlags::EXCL,
            Mode::from_raw_mode(mode),
        ) {
            Ok(fd) => {
                // The umask may have taken bits: the client's mode it is.
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(rx_status)?;
                File::from(fd)
            }
            // UNCHECKED: an existing file is opened and takes the attributes.
            Err(rustix::io::Errno::EXIST) => {
                File::from(rustix::fs::openat(&dir, name, base, Mode::empty()).map_err(rx_status)?)
            }
            Err(e) => return Err(rx_status(e)),
        };
        let st = rustix::fs::fstat(&file).map_err(rx_status)?;
        Self::apply(&file, &st, set, self.usage(vol))?;
        let st = rustix::fs::fstat(&file).map_err(rx_status)?;
        let handle = self.remember(vol, st.st_ino, rel.join(name));
        Ok((handle, attrs(vol, &st)))
    }

    /// EXCLUSIVE: the verifier is kept in the new file's atime and mtime
    /// (as Linux's knfsd does), so a retransmitted create finds its file.
    pub(super) fn create_exclusive(
        &self,
        h: &Handle,
        name: &[u8],
        verf: &createverf3,
    ) -> Res<Handle> {
        let (vol, rel, dir) = self.dir(h)?;
        let name = new_name(name)?;
        let a = u32::from_be_bytes([verf.0[0], verf.0[1], verf.0[2], verf.0[3]]);
        let m = u32::from_be_bytes([verf.0[4], verf.0[5], verf.0[6], verf.0[7]]);
        let flags = OFlags::WRONLY
            | OFlags::NOFOLLOW
            | OFlags::CLOEXEC
            | OFlags::NOCTTY
            | OFlags::CREATE
            | OFlags::EXCL;
        match rustix::fs::openat(&dir, name, flags, Mode::from_raw_mode(0o600)) {
            Ok(fd) => {
                let times = Timestamps {
                    last_access: Timespec {
                        tv_sec: i64::from(a),
                        tv_nsec: 0,
                    },
                    last_modification: Timespec {
                        tv_sec: i64::from(m),
                        tv_nsec: 0,
                    },
                };
                rustix::fs::futimens(&fd, &times).map_err(rx_status)?;
                let st = rustix::fs::fstat(&fd).map_err(rx_status)?;
                Ok(self.remember(vol, st.st_ino, rel.join(name)))
            }
            Err(rustix::io::Errno::EXIST) => {
                let st =
                    rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(rx_status)?;
                let ours = is_file(&st)
                    && st.st_atime == i64::from(a)
                    && st.st_mtime == i64::from(m)
                    && st.st_size == 0;
                if ours {
                    Ok(self.remember(vol, st.st_ino, rel.join(name)))
                } else {
                    Err(nfsstat3::NFS3ERR_EXIST)
                }
            }
            Err(e) => Err(rx_status(e)),
        }
    }

    pub(super) fn mkdir(&self, h: &Handle, name: &[u8]) -> Res<(Handle, fattr3)> {
        let (vol, rel, dir) = self.dir(h)?;
        let name = new_name(name)?;
        rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o755)).map_err(rx_status)?;
        let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(rx_status)?;
        Ok((
            self.remember(vol, st.st_ino, rel.join(name)),
            attrs(vol, &st),
        ))
    }

    pub(super) fn symlink(&self, h: &Handle, name: &[u8], target: &[u8]) -> Res<(Handle, fattr3)> {
        let (vol, rel, dir) = self.dir(h)?;
        let name = new_name(name)?;
        if target.is_empty() || target.contains(&0) {
            return Err(nfsstat3::NFS3ERR_INVAL);
        }
        rustix::fs::symlinkat(OsStr::from_bytes(target), &dir, name).map_err(rx_status)?;
        let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(rx_status)?;
        Ok((
            self.remember(vol, st.st_ino, rel.join(name)),
            attrs(vol, &st),
        ))
    }

    /// REMOVE and RMDIR (the crate sends both here): a directory is
    /// removed as one, anything else unlinked.
    pub(super) fn remove(&self, h: &Handle, name: &[u8]) -> Res<()> {
        let (vol, _, dir) = self.dir(h)?;
        let name = existing_name(name)?;
        let st = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(rx_status)?;
        let flags = if is_dir(&st) {
            AtFlags::REMOVEDIR
        } else {
            AtFlags::empty()
        };
        rustix::fs::unlinkat(&dir, name, flags).map_err(rx_status)?;
        if st.st_nlink <= 1 || is_dir(&st) {
            self.ids().remove(&(vol, st.st_ino));
            if is_file(&st) {
                self.usage(vol).release(size_of(&st));
            }
        }
        Ok(())
    }

    /// Within one volume only (across volumes: XDEV); what the table knows
    /// under the old name is known under the new one after.
    pub(super) fn rename(
        &self,
        from: &Handle,
        from_name: &[u8],
        to: &Handle,
        to_name: &[u8],
    ) -> Res<()> {
        let (from_vol, from_rel, from_dir) = self.dir(from)?;
        let (to_vol, to_rel, to_dir) = self.dir(to)?;
        if from_vol != to_vol {
            return Err(nfsstat3::NFS3ERR_XDEV);
        }
        let from_name = existing_name(from_name)?;
        let to_name = new_name(to_name)?;
        // A regular file (its last link) renamed over is freed.
        let replaced = rustix::fs::statat(&to_dir, to_name, AtFlags::SYMLINK_NOFOLLOW)
            .ok()
            .filter(|st| is_file(st) && st.st_nlink <= 1);
        rustix::fs::renameat(&from_dir, from_name, &to_dir, to_name).map_err(rx_status)?;
        if let Some(st) = replaced {
            self.usage(to_vol).release(size_of(&st));
        }
        let old = from_rel.join(from_name);
        let new = to_rel.join(to_name);
        for ((vol, _), rel) in self.ids().iter_mut() {
            if *vol == from_vol {
                if let Ok(rest) = rel.strip_prefix(&old) {
                    // (`join("")` would add a trailing `/`.)
                    *rel = if rest.as_os_str().is_empty() {
                        new.clone()
                    } else {
                        new.join(rest)
                    };
                }
            }
        }
        Ok(())
    }

    pub(super) fn commit(&self, h: &Handle) -> Res<()> {
        if let Target::Object {
            volume, rel, ino, ..
        } = self.resolve(h)?
        {
            let (file, st) = Self::open(volume, &rel, ino, libc::O_PATH)?;
            if is_file(&st) {
                let f = File::open(proc_path(&file)).map_err(io_status)?;
                f.sync_all().map_err(io_status)?;
            }
        }
        Ok(())
    }
}
