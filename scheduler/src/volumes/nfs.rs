//! [`super::fs::VolumeFs`] as `nfs3_server`'s filesystem: each call on
//! the runtime's blocking threads.

use nfs3_server::nfs3_types::nfs3::{createverf3, fattr3, filename3, nfspath3, sattr3, stable_how};
use nfs3_server::vfs::{
    DirEntryPlus, NextResult, NfsFileSystem, NfsReadFileSystem, ReadDirPlusIterator,
};

use super::fs::{Handle, Res, VolumeFs};

/// A directory's entries from a cookie on (cookie `n`: after the `n`th).
#[derive(Debug)]
pub(super) struct Entries {
    entries: std::vec::IntoIter<DirEntryPlus<Handle>>,
}

impl ReadDirPlusIterator<Handle> for Entries {
    async fn next(&mut self) -> NextResult<DirEntryPlus<Handle>> {
        match self.entries.next() {
            Some(e) => NextResult::Ok(e),
            None => NextResult::Eof,
        }
    }
}

impl NfsReadFileSystem for VolumeFs {
    type Handle = Handle;

    fn root_dir(&self) -> Handle {
        self.root()
    }

    async fn lookup(&self, dir: &Handle, name: &filename3<'_>) -> Res<Handle> {
        let (dir, name) = (*dir, name.as_ref().to_vec());
        self.blocking(move |fs| fs.lookup(&dir, &name)).await
    }

    async fn getattr(&self, id: &Handle) -> Res<fattr3> {
        let id = *id;
        self.blocking(move |fs| fs.getattr(&id)).await
    }

    async fn read(&self, id: &Handle, offset: u64, count: u32) -> Res<(Vec<u8>, bool)> {
        let id = *id;
        self.blocking(move |fs| fs.read(&id, offset, count)).await
    }

    async fn readdirplus(
        &self,
        dir: &Handle,
        cookie: u64,
    ) -> Res<impl ReadDirPlusIterator<Handle>> {
        let dir = *dir;
        let mut all = self.blocking(move |fs| fs.readdir(&dir)).await?;
        for (i, e) in all.iter_mut().enumerate() {
            e.cookie = i as u64 + 1;
        }
        let skip = usize::try_from(cookie).unwrap_or(usize::MAX).min(all.len());
        Ok(Entries {
            entries: all.split_off(skip).into_iter(),
        })
    }

    async fn readlink(&self, id: &Handle) -> Res<nfspath3<'_>> {
        let id = *id;
        self.blocking(move |fs| fs.readlink(&id))
            .await
            .map(Into::into)
    }
}

impl NfsFileSystem for VolumeFs {
    async fn setattr(&self, id: &Handle, set: sattr3) -> Res<fattr3> {
        let id = *id;
        self.blocking(move |fs| fs.setattr(&id, &set)).await
    }

    async fn write(
        &self,
        id: &Handle,
        offset: u64,
        data: &[u8],
        stable: stable_how,
    ) -> Res<(fattr3, stable_how)> {
        let (id, data) = (*id, data.to_vec());
        let attrs = self
            .blocking(move |fs| fs.write(&id, offset, &data, stable))
            .await?;
        Ok((attrs, stable))
    }

    async fn create(
        &self,
        dir: &Handle,
        name: &filename3<'_>,
        set: sattr3,
    ) -> Res<(Handle, fattr3)> {
        let (dir, name) = (*dir, name.as_ref().to_vec());
        self.blocking(move |fs| fs.create(&dir, &name, &set)).await
    }

    async fn create_exclusive(
        &self,
        dir: &Handle,
        name: &filename3<'_>,
        verf: createverf3,
    ) -> Res<Handle> {
        let (dir, name) = (*dir, name.as_ref().to_vec());
        self.blocking(move |fs| fs.create_exclusive(&dir, &name, &verf))
            .await
    }

    async fn mkdir(&self, dir: &Handle, name: &filename3<'_>) -> Res<(Handle, fattr3)> {
        let (dir, name) = (*dir, name.as_ref().to_vec());
        self.blocking(move |fs| fs.mkdir(&dir, &name)).await
    }

    async fn remove(&self, dir: &Handle, name: &filename3<'_>) -> Res<()> {
        let (dir, name) = (*dir, name.as_ref().to_vec());
        self.blocking(move |fs| fs.remove(&dir, &name)).await
    }

    async fn rename<'a>(
        &self,
        from: &Handle,
        from_name: &filename3<'a>,
        to: &Handle,
        to_name: &filename3<'a>,
    ) -> Res<()> {
        let (from, to) = (*from, *to);
        let (from_name, to_name) = (from_name.as_ref().to_vec(), to_name.as_ref().to_vec());
        self.blocking(move |fs| fs.rename(&from, &from_name, &to, &to_name))
            .await
    }

    async fn symlink<'a>(
        &self,
        dir: &Handle,
        name: &filename3<'a>,
        target: &nfspath3<'a>,
        _attr: &sattr3,
    ) -> Res<(Handle, fattr3)> {
        let (dir, name, target) = (*dir, name.as_ref().to_vec(), target.as_ref().to_vec());
        self.blocking(move |fs| fs.symlink(&dir, &name, &target))
            .await
    }

    async fn commit(&self, id: &Handle, _offset: u64, _count: u32) -> Res<()> {
        let id = *id;
        self.blocking(move |fs| fs.commit(&id)).await
    }
}
