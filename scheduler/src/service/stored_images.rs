//! Images in the object store (issue 29): with `--object-store`, an image
//! whose two files are installed is uploaded as one layer (chunks and a
//! manifest, deduplicated with every other layer) and named
//! `names/images/<name>` in the store; a pod that lacks an image a build
//! names fetches it from there, so an image is usable on every pod and
//! outlives the pod it was uploaded to. Each pod lists the images named in
//! the store with its own (cached for [`NAMES_FRESH`]); a delete removes
//! the pod's copy, the name and the manifest it stood for.
//!
//! An upload is answered once the image is durable in the store: a store
//! that fails leaves the part installed on this pod and answers the
//! store's error, and the upload may be sent again.

use std::time::{Duration, Instant};

use torpor_storage::{ManifestId, NameSpace, StorageError};
use torpor_sync::Locked;

use super::objects::{ObjectStore, ObjectStoreError};
use super::{Service, ServiceError};
use crate::images::{ImageError, ImageFiles, ImagePart};

/// How long a pod's list of the store's image names is used before it is
/// listed again (its own stores and deletes refresh it at once).
pub(super) const NAMES_FRESH: Duration = Duration::from_secs(5);

/// The image names last listed from the store, and when.
#[derive(Debug, Default)]
pub(crate) struct StoredNames(std::sync::Mutex<Option<(Instant, Vec<String>)>>);

impl StoredNames {
    fn forget(&self) {
        *self.0.locked() = None;
    }
}

fn image_err(name: &str) -> impl FnOnce(StorageError) -> ObjectStoreError + '_ {
    move |source| ObjectStoreError::Image {
        name: name.to_string(),
        source,
    }
}

impl ObjectStore {
    /// The manifest image `name` stands for in the store.
    fn named_image(&self, name: &str) -> Result<Option<ManifestId>, ObjectStoreError> {
        let (storage, n) = (self.storage().clone(), name.to_string());
        self.run(async move { storage.named_layer(NameSpace::Images, &n).await })?
            .map_err(image_err(name))
    }

    /// Deletes manifest `id`, which the name of image `name` stood for
    /// (each upload's manifest is named once); a failure is logged and
    /// leaves its chunks in the store.
    fn drop_image_manifest(&self, name: &str, id: &ManifestId) {
        if let Err(e) = self.delete_manifest(id) {
            tracing::warn!(image = name, manifest = %id, "cannot delete an image's old manifest: {e}");
        }
    }
}

impl Service {
    /// Installs one part of image `name` (see [`crate::images::Images::install`]);
    /// with an object store, once both parts are here the image is stored
    /// and named there before the answer.
    pub fn install_image(
        &self,
        name: &str,
        part: ImagePart,
        body: &mut dyn std::io::Read,
        limit: u64,
    ) -> Result<u64, ServiceError> {
        let n = self.images.install(name, part, body, limit)?;
        if self.objects.is_some() && self.images.resolve(name).is_ok() {
            self.store_image(name)?;
        }
        Ok(n)
    }

    /// Uploads image `name` (both files, as installed now) and points its
    /// name in the store at the upload; the manifest it named before is
    /// deleted. One store of an image at a time, so the last files
    /// installed are the ones named.
    fn store_image(&self, name: &str) -> Result<(), ServiceError> {
        let Some(objects) = &self.objects else {
            return Ok(());
        };
        let dir = self.images.dir().join(name);
        objects.with_layer_lock(&dir, || {
            let staged = self.images.stage(name)?;
            let started = Instant::now();
            let (storage, from) = (objects.storage().clone(), staged.path().to_path_buf());
            let report = objects
                .run(async move { storage.upload_layer(&from).await })?
                .map_err(image_err(name))?;
            drop(staged);
            let (storage, n, id) = (objects.storage().clone(), name.to_string(), report.id);
            let before = objects
                .run(async move {
                    let before = storage.name_layer(NameSpace::Images, &n, &id).await;
                    before.map(|b| (b, id))
                })?
                .map_err(image_err(name))?;
            let (before, id) = before;
            if let Some(old) = before {
                objects.drop_image_manifest(name, &old);
            }
            objects.image_names.forget();
            tracing::info!(
                image = name,
                manifest = %id,
                bytes = report.data_bytes,
                new_bytes = report.new_bytes,
                ms = started.elapsed().as_millis() as u64,
                "image stored"
            );
            Ok(())
        })
    }

    /// Image `name`'s files on this pod; with an object store, an image
    /// not here is fetched from it first (whole, checked chunk by chunk),
    /// and one in neither place is not found.
    pub(super) fn resolve_image(&self, name: &str) -> Result<ImageFiles, ServiceError> {
        let missing = match self.images.resolve(name) {
            Ok(files) => return Ok(files),
            Err(e @ ImageError::Unusable { .. }) => e,
            Err(e) => return Err(e.into()),
        };
        let Some(objects) = &self.objects else {
            return Err(missing.into());
        };
        let dir = self.images.dir().join(name);
        objects.with_layer_lock(&dir, || {
            // Fetched by another build while this one waited.
            if let Ok(files) = self.images.resolve(name) {
                return Ok(files);
            }
            let Some(id) = objects.named_image(name)? else {
                return Err(missing.into());
            };
            let into = self.images.fetch_dir(name)?;
            let started = Instant::now();
            let (storage, to, m) = (
                objects.storage().clone(),
                into.path().to_path_buf(),
                id.clone(),
            );
            let report = objects
                .run(async move { storage.download_layer(&m, &to).await })?
                .map_err(image_err(name))?;
            let files = self.images.place(name, &into)?;
            tracing::info!(
                image = name,
                manifest = %id,
                bytes = report.data_bytes,
                fetched = report.fetched_bytes,
                ms = started.elapsed().as_millis() as u64,
                "image fetched from the object store"
            );
            Ok(files)
        })
    }

    /// The images this pod can use: its own, and with an object store the
    /// ones named there (listed at most every [`NAMES_FRESH`]; a store
    /// that does not answer leaves the last list, or none). Sorted.
    pub fn image_names(&self) -> Vec<String> {
        let mut names = self.images.list();
        if let Some(objects) = &self.objects {
            names.extend(self.stored_image_names(objects));
            names.sort();
            names.dedup();
        }
        names
    }

    fn stored_image_names(&self, objects: &ObjectStore) -> Vec<String> {
        if let Some((at, names)) = &*objects.image_names.0.locked() {
            if at.elapsed() < NAMES_FRESH {
                return names.clone();
            }
        }
        let storage = objects.storage().clone();
        let listed = objects
            .run(async move { storage.names(NameSpace::Images).await })
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        let mut cached = objects.image_names.0.locked();
        match listed {
            Ok(names) => {
                *cached = Some((Instant::now(), names.clone()));
                names
            }
            Err(e) => {
                tracing::warn!("cannot list the images in the object store: {e}");
                cached.as_ref().map(|(_, n)| n.clone()).unwrap_or_default()
            }
        }
    }

    /// Removes image `name` from this pod and, with an object store, from
    /// the store (its name, then the manifest it stood for); not found
    /// only when it was in neither.
    pub(super) fn remove_image_files(&self, name: &str) -> Result<(), ServiceError> {
        let here = match self.images.remove(name) {
            Ok(()) => true,
            Err(ImageError::NotFound(_)) => false,
            Err(e) => return Err(e.into()),
        };
        let mut stored = false;
        if let Some(objects) = &self.objects {
            let dir = self.images.dir().join(name);
            stored = objects.with_layer_lock(&dir, || -> Result<bool, ServiceError> {
                let (storage, n) = (objects.storage().clone(), name.to_string());
                let removed = objects
                    .run(async move { storage.remove_name(NameSpace::Images, &n).await })?
                    .map_err(image_err(name))?;
                objects.image_names.forget();
                if let Some(id) = &removed {
                    objects.drop_image_manifest(name, id);
                }
                Ok(removed.is_some())
            })?;
        }
        if here || stored {
            Ok(())
        } else {
            Err(ImageError::NotFound(name.to_string()).into())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    use super::super::lifecycle_tests::service_with;
    use super::*;

    fn install(s: &Service, name: &str, part: ImagePart, bytes: &[u8]) {
        let mut body = bytes;
        s.install_image(name, part, &mut body, 1 << 20).unwrap();
    }

    fn files_in(dir: &Path) -> usize {
        std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
    }

    /// Three pods over one store: the first stores an image once both
    /// parts are in (and again, its old manifest deleted, when a part is
    /// replaced); the second lists it and fetches it byte for byte on
    /// first use; a corrupted chunk fails the third's fetch naming the
    /// image, leaving nothing behind; a delete removes the name, and the
    /// second pod's own copy is its own to delete.
    #[test]
    fn an_image_stored_by_one_pod_is_listed_fetched_and_deleted_by_another() {
        let objects = tempfile::tempdir().unwrap();
        let url = objects.path().to_str().unwrap().to_string();
        let open = || service_with(|c| c.object_store = Some(url.clone()));
        let ((_da, a, _), (_db, b, _), (_dc, c, _)) = (open(), open(), open());
        let named = objects.path().join("names/images/deb");
        let manifests = objects.path().join("manifests");

        install(&a, "deb", ImagePart::Kernel, b"kernel one");
        assert!(!named.exists(), "stored with one part only");
        let rootfs: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        install(&a, "deb", ImagePart::Rootfs, &rootfs);
        assert!(named.is_file());
        assert_eq!(files_in(&manifests), 1);
        assert_eq!(b.image_names(), ["deb"]);
        assert!(b.images.resolve("deb").is_err(), "b has no copy yet");

        // A part replaced: stored again, the old manifest deleted.
        install(&a, "deb", ImagePart::Kernel, b"kernel two");
        assert_eq!(files_in(&manifests), 1);

        let files = b.resolve_image("deb").unwrap();
        assert_eq!(std::fs::read(&files.kernel).unwrap(), b"kernel two");
        assert_eq!(std::fs::read(&files.rootfs).unwrap(), rootfs);
        for f in [&files.kernel, &files.rootfs] {
            let mode = std::fs::metadata(f).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o644, "{}", f.display());
        }
        assert_eq!(b.images.list(), ["deb"]);

        // Every chunk corrupted: c's fetch fails naming the image, with
        // nothing left in its images directory.
        for fan in std::fs::read_dir(objects.path().join("chunks")).unwrap() {
            for chunk in std::fs::read_dir(fan.unwrap().path()).unwrap() {
                let path = chunk.unwrap().path();
                let mut bytes = std::fs::read(&path).unwrap();
                let at = bytes.len() - 1;
                bytes[at] ^= 0xff;
                std::fs::write(&path, bytes).unwrap();
            }
        }
        let e = c.resolve_image("deb").unwrap_err();
        assert!(
            matches!(&e, ServiceError::ObjectStore(o) if o.is_bad_layer()),
            "{e}"
        );
        assert!(e.to_string().contains("image deb"), "{e}");
        assert_eq!(files_in(c.images.dir()), 0, "left behind");
        // Not in the store at all: not found, as without one.
        let e = c.resolve_image("alp").unwrap_err();
        assert!(matches!(e, ServiceError::NotFound { .. }), "{e}");

        a.remove_image_files("deb").unwrap();
        assert!(!named.exists());
        assert_eq!(files_in(&manifests), 0);
        assert_eq!(a.image_names(), Vec::<String>::new());
        assert_eq!(b.images.list(), ["deb"], "b's own copy stays");
        b.remove_image_files("deb").unwrap();
        let e = b.remove_image_files("deb").unwrap_err();
        assert!(matches!(e, ServiceError::NotFound { .. }), "{e}");
    }
}
