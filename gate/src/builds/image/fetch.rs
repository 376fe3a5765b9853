//! Getting an image: pulled on the request's runtime (its events logged
//! as they come, a cancel aborting it), or an upload checked against its
//! hash; into the build's scratch directory.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use torpor_oci::{pull, Credentials, Image, Progress, PullEvent, PullOptions, Reach, Reference};

use super::cache::sha256_file;
use super::{io, ImageError, Request};
use crate::builds::{Build, Builds, Level};

/// Checks the upload against its name.
pub(super) fn check_upload(path: &Path, hash: &str) -> Result<(), ImageError> {
    let actual = sha256_file(path).map_err(io(format!("the upload {hash}")))?;
    if actual != hash {
        return Err(ImageError::UploadHash {
            hash: hash.to_string(),
            actual,
        });
    }
    Ok(())
}

/// A message of the pull's task.
enum Pulled {
    Event(PullEvent),
    Done(Box<Result<Image, torpor_oci::Error>>),
}

/// Pulls on the request's runtime, logging its events as they come; a
/// cancel aborts it.
pub(super) fn pull_image(
    builds: &Builds,
    build: &Build,
    req: &Request,
    reference: &Reference,
    credentials: Option<&Credentials>,
    scratch: &Scratch,
) -> Result<Image, ImageError> {
    let runtime = req.runtime.clone().ok_or(ImageError::NoRuntime)?;
    let mut options = PullOptions::new(scratch.blobs());
    options.reach = Reach::Global {
        except: builds.guest.private_registries.clone(),
    };
    if let Some(ca) = &builds.guest.registry_ca {
        options.extra_ca_pem = Some(std::fs::read(ca).map_err(io(ca.display()))?);
    }
    let (tx, rx) = mpsc::channel();
    let events = tx.clone();
    options.progress = Some(Progress::new(move |e| {
        let _ = events.send(Pulled::Event(e));
    }));
    let (r, c) = (reference.clone(), credentials.cloned());
    let task = runtime.spawn(async move {
        let pulled = pull(&r, c.as_ref(), &options).await;
        let _ = tx.send(Pulled::Done(Box::new(pulled)));
    });
    let mut layers = 0;
    loop {
        if build.cancel.is_cancelled() {
            task.abort();
            return Err(ImageError::Cancelled);
        }
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(Pulled::Event(e)) => log_event(build, &mut layers, e),
            Ok(Pulled::Done(pulled)) => {
                return (*pulled).map_err(|source| ImageError::Pull {
                    reference: reference.to_string(),
                    source,
                })
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(ImageError::PullLost(reference.to_string()))
            }
        }
    }
}

pub(super) fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

fn log_event(build: &Build, layers: &mut usize, event: PullEvent) {
    let n = *layers;
    let message = match event {
        PullEvent::Manifest {
            manifest,
            layers: count,
            bytes,
            ..
        } => {
            *layers = count;
            format!("manifest {manifest}: {count} layer(s), {}", mib(bytes))
        }
        PullEvent::LayerPresent { index, digest, .. } => {
            format!("layer {}/{n} {digest}: already here", index + 1)
        }
        PullEvent::LayerStarted {
            index,
            digest,
            size,
        } => format!("pulling layer {}/{n} {digest} ({})", index + 1, mib(size)),
        PullEvent::LayerProgress {
            index, bytes, size, ..
        } => format!("layer {}/{n}: {} of {}", index + 1, mib(bytes), mib(size)),
        PullEvent::LayerDone {
            index,
            digest,
            bytes,
        } => format!("pulled layer {}/{n} {digest} ({})", index + 1, mib(bytes)),
        other => format!("{other:?}"),
    };
    build.log(Level::Info, format!("[base] {message}"));
}

/// A build's scratch directory, removed when dropped.
pub(super) struct Scratch(PathBuf);

impl Scratch {
    pub(super) fn new(dir: PathBuf) -> Result<Scratch, ImageError> {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(io(dir.display()))?;
        Ok(Scratch(dir))
    }
    pub(super) fn blobs(&self) -> PathBuf {
        self.0.join("blobs")
    }
    pub(super) fn root(&self) -> PathBuf {
        self.0.join("root")
    }
    pub(super) fn ext4(&self) -> PathBuf {
        self.0.join("rootfs.ext4")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), "a build's scratch directory stays: {e}");
        }
    }
}
