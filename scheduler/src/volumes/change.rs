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
use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags, Stat, Timespec, Timestamps, CWD};

use super::fs::{
    attrs, existing_name, io_status, is_dir, is_file, is_link, new_name, proc_path, rx_status,
    Handle, Inner, Res, Target,
};
use super::usage::{OverLimit, TooManyEntries, Usage};

/// A file's size in bytes.
fn size_of(st: &Stat) -> u64 {
    st.st_size.max(0) as u64
}

/// A change past the volume's limit: the guest's write fails with
/// `EDQUOT` ("Disk quota exceeded").
fn over_limit(_: OverLimit) -> nfsstat3 {
    nfsstat3::NFS3ERR_DQUOT
}

/// A new name past the volume's limit on entries: the guest's create
/// fails with `EDQUOT` too.
fn too_many(_: TooManyEntries) -> nfsstat3 {
    nfsstat3::NFS3ERR_DQUOT
}

/// What `made` made, counted if it is a new name (its `bool`): past the
/// volume's limit on entries the name is taken back (`undo`) and the call
/// refused. (Made first, so that an existing name is never refused.)
fn counted<T>(usage: &Usage, made: Res<(T, bool)>, undo: impl FnOnce()) -> Res<T> {
    let (value, new) = made?;
    if new {
        if let Err(e) = usage.add_entry() {
            undo();
            return Err(too_many(e));
        }
    }
    Ok(value)
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
        let made = (|| {
            match rustix::fs::openat(
                &dir,
                name,
                base | OFlags::CREATE | OFlags::EXCL,
                Mode::from_raw_mode(mode),
            ) {
                Ok(fd) => {
                    // The umask may have taken bits: the client's mode it is.
                    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode)).map_err(rx_status)?;
                    Ok((File::from(fd), true))
                }
                // UNCHECKED: an existing file is opened and takes the
                // attributes (no new entry).
                Err(rustix::io::Errno::EXIST) => Ok((
                    File::from(
                        rustix::fs::openat(&dir, name, base, Mode::empty()).map_err(rx_status)?,
                    ),
                    false,
                )),
                Err(e) => Err(rx_status(e)),
            }
        })();
        let file = counted(self.usage(vol), made, || {
            let _ = rustix::fs::unlinkat(&dir, name, AtFlags::empty());
        })?;
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
        let made = match rustix::fs::openat(&dir, name, flags, Mode::from_raw_mode(0o600)) {
            Ok(fd) => Ok((Some(fd), true)),
            Err(rustix::io::Errno::EXIST) => Ok((None, false)),
            Err(e) => Err(rx_status(e)),
        };
        let made = counted(self.usage(vol), made, || {
            let _ = rustix::fs::unlinkat(&dir, name, AtFlags::empty());
        })?;
        match made {
            Some(fd) => {
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
            None => {
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
        }
    }

    pub(super) fn mkdir(&self, h: &Handle, name: &[u8]) -> Res<(Handle, fattr3)> {
        let (vol, rel, dir) = self.dir(h)?;
        let name = new_name(name)?;
        let made = rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o755))
            .map(|()| ((), true))
            .map_err(rx_status);
        counted(self.usage(vol), made, || {
            let _ = rustix::fs::unlinkat(&dir, name, AtFlags::REMOVEDIR);
        })?;
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
        let made = rustix::fs::symlinkat(OsStr::from_bytes(target), &dir, name)
            .map(|()| ((), true))
            .map_err(rx_status);
        counted(self.usage(vol), made, || {
            let _ = rustix::fs::unlinkat(&dir, name, AtFlags::empty());
        })?;
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
        self.unlinked(vol, &st);
        Ok(())
    }

    /// A name of volume `vol` unlinked by this call, which `st` showed
    /// just before: one entry fewer, and if it was the object's last name,
    /// its handle forgotten and a regular file's bytes freed.
    fn unlinked(&self, vol: u32, st: &Stat) {
        self.usage(vol).remove_entries(1);
        if st.st_nlink <= 1 || is_dir(st) {
            self.ids().remove(&(vol, st.st_ino));
            if is_file(st) {
                self.usage(vol).release(size_of(st));
            }
        }
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
        // Onto a free name nothing is replaced; onto a taken one, what it
        // replaces is counted off once (`rename_over`).
        match rustix::fs::renameat_with(
            &from_dir,
            from_name,
            &to_dir,
            to_name,
            RenameFlags::NOREPLACE,
        ) {
            Ok(()) => {}
            Err(rustix::io::Errno::EXIST) => {
                self.rename_over(to_vol, (&from_dir, from_name), (&to_dir, to_name))?
            }
            // A file system without the flag.
            Err(rustix::io::Errno::INVAL) => {
                self.rename_plainly(to_vol, (&from_dir, from_name), (&to_dir, to_name))?
            }
            Err(e) => return Err(rx_status(e)),
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

    /// A rename onto a name that is taken, so that what it replaces is
    /// counted off exactly once whatever runs beside it: the two names are
    /// exchanged (atomically), then the old object, now under the source
    /// name, is removed by this call's own unlink, which succeeds for one
    /// caller only (a REMOVE of the same name at the same time finds it
    /// gone, or removes it instead and the exchange finds the name free).
    /// Rename's rules hold: a directory only over an empty directory, a
    /// non-directory only over a non-directory, and onto another link of
    /// the same file nothing happens.
    fn rename_over(&self, vol: u32, from: (&File, &OsStr), to: (&File, &OsStr)) -> Res<()> {
        let nofollow = AtFlags::SYMLINK_NOFOLLOW;
        let src = rustix::fs::statat(from.0, from.1, nofollow).map_err(rx_status)?;
        let dst = rustix::fs::statat(to.0, to.1, nofollow).map_err(rx_status)?;
        if (src.st_dev, src.st_ino) == (dst.st_dev, dst.st_ino) {
            return Ok(());
        }
        match (is_dir(&src), is_dir(&dst)) {
            (true, false) => return Err(nfsstat3::NFS3ERR_NOTDIR),
            (false, true) => return Err(nfsstat3::NFS3ERR_ISDIR),
            _ => {}
        }
        let exchange = |a: (&File, &OsStr), b: (&File, &OsStr)| {
            rustix::fs::renameat_with(a.0, a.1, b.0, b.1, RenameFlags::EXCHANGE)
        };
        match exchange(from, to) {
            Ok(()) => {}
            // A file system without exchange.
            Err(rustix::io::Errno::INVAL) => return self.rename_plainly(vol, from, to),
            // Taken no more: a plain move, nothing replaced.
            Err(rustix::io::Errno::NOENT) => {
                return rustix::fs::renameat_with(
                    from.0,
                    from.1,
                    to.0,
                    to.1,
                    RenameFlags::NOREPLACE,
                )
                .map_err(rx_status)
            }
            Err(e) => return Err(rx_status(e)),
        }
        let old = rustix::fs::statat(from.0, from.1, nofollow).map_err(rx_status)?;
        let flags = if is_dir(&old) {
            AtFlags::REMOVEDIR
        } else {
            AtFlags::empty()
        };
        if let Err(e) = rustix::fs::unlinkat(from.0, from.1, flags) {
            // (A directory not empty: refused, the two names put back.)
            let _ = exchange(from, to);
            return Err(rx_status(e));
        }
        self.unlinked(vol, &old);
        Ok(())
    }

    /// A rename on a file system that has neither `RENAME_NOREPLACE` nor
    /// `RENAME_EXCHANGE`: what the name held just before counted off (a
    /// REMOVE of it at the same moment may count it off too: the count
    /// then reads low by one).
    fn rename_plainly(&self, vol: u32, from: (&File, &OsStr), to: (&File, &OsStr)) -> Res<()> {
        let nofollow = AtFlags::SYMLINK_NOFOLLOW;
        let replaced = rustix::fs::statat(to.0, to.1, nofollow).ok();
        rustix::fs::renameat(from.0, from.1, to.0, to.1).map_err(rx_status)?;
        if let Some(st) = replaced {
            // (Onto another link of the same file nothing is removed.)
            let same = rustix::fs::statat(to.0, to.1, nofollow)
                .is_ok_and(|now| (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino));
            if !same {
                self.usage(vol).remove_entries(1);
                if is_file(&st) && st.st_nlink <= 1 {
                    self.usage(vol).release(size_of(&st));
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
