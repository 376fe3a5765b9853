//! The images index: each pod's installed images, in PostgreSQL (the
//! `images` column of its row, schema version 12) from its heartbeats, so
//! any replica lists them, places a Linux template's build on a pod that
//! has its image (`templates.rs`), and reaches the pods that hold one.
//! An image's bytes are on the pods' disks and, when the pods share an
//! object store, in the store too: every pod then lists the images stored
//! there with its own and fetches one a build names when it lacks it
//! (`scheduler/src/service/stored_images.rs`), so an image outlives the pod
//! it was uploaded to.
//!
//! - `GET /v1/images`: the images of the pods up (each name once; `GET
//!   /v1/pods` shows which pod has which).
//! - `PUT /v1/images/{name}/{part}[?pod=ID]`: the body streamed through
//!   the replica to the pod named, else to the pod up with the most
//!   admission headroom (the one a build goes to), within the replica's
//!   own upload limit too; indexed from that pod's next heartbeat.
//! - `DELETE /v1/images/{name}`: on every pod that lists it but those
//!   lost for good (any of them down: 503 and nothing deleted; a pod
//!   whose template uses it refuses, 409, as embedded), unlisted with each
//!   pod's answer; the first removes it from the object store.
//!
//! Uploads and deletes are admin calls to the pods' APIs, as the data
//! plane is (an upload is a stream, not a message), not commands through
//! the work queues.

use std::io::Read;

use torpor_scheduler::images::ImageError;
use torpor_scheduler::model::PodId;
use torpor_scheduler::service::ServiceError;

use super::db::{pg, PodRow};
use super::replica::Cluster;
use torpor_client::encode;
use torpor_gate::backend::blocking;
use torpor_gate::calls::{ImageOp, ImageReply};

/// A reader that fails once more than `left` bytes were read through it.
struct Limited<'a> {
    inner: &'a mut dyn Read,
    left: u64,
    over: bool,
}

impl Read for Limited<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(out)?;
        if n as u64 > self.left {
            self.over = true;
            return Err(std::io::Error::other("the upload is larger than the limit"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

impl Cluster {
    pub(super) async fn image_call(&self, op: ImageOp<'_>) -> Result<ImageReply, ServiceError> {
        let pods = self.db.pods().await?;
        match op {
            ImageOp::List => {
                let mut names: Vec<String> = pods
                    .iter()
                    .filter(|p| self.is_up(p))
                    .flat_map(|p| p.images.iter().cloned())
                    .collect();
                names.sort();
                names.dedup();
                Ok(ImageReply::List(names))
            }
            ImageOp::Install {
                name,
                part,
                body,
                limit,
                pod,
            } => {
                let target = self.upload_pod(&pods, pod)?;
                let remote = self.remote(target).ok_or_else(|| unusable(&target.id))?;
                let path = format!("/v1/images/{}/{}", encode(name), part.as_str());
                let mut limited = Limited {
                    inner: body,
                    left: limit,
                    over: false,
                };
                // The upload reads its body, which blocks.
                let answer = blocking(|| remote.upload(&path, &mut limited));
                if limited.over {
                    return Err(ImageError::TooLarge { limit }.into());
                }
                let bytes = answer?.get("bytes").and_then(|b| b.as_u64());
                let bytes = bytes.ok_or_else(|| {
                    ServiceError::Internal(format!("pod {}: an upload's answer", target.id))
                })?;
                Ok(ImageReply::Installed(bytes))
            }
            ImageOp::Delete(name) => {
                // A pod lost for good holds nothing any more: its copy
                // went with it, and a stored image is removed from the
                // store by any pod that still lists it.
                let holding: Vec<&PodRow> = pods
                    .iter()
                    .filter(|p| p.images.iter().any(|i| i == name) && !self.is_lost(p))
                    .collect();
                if holding.is_empty() {
                    return Err(ImageError::NotFound(name.to_string()).into());
                }
                if let Some(down) = holding.iter().find(|p| !self.is_up(p)) {
                    return Err(Self::down(down, &format!("image {name} is on it too")));
                }
                let path = format!("/v1/images/{}", encode(name));
                for pod in holding {
                    let remote = self.remote(pod).ok_or_else(|| unusable(&pod.id))?;
                    remote.fetch("DELETE", &path, None).await?;
                    async {
                        let c = self.db.client().await?;
                        c.execute(
                            "UPDATE pods SET images = array_remove(images, $2) WHERE id = $1",
                            &[&pod.id.as_str(), &name],
                        )
                        .await
                        .map_err(pg)
                    }
                    .await?;
                }
                Ok(ImageReply::Deleted)
            }
        }
    }

    /// The pod an upload goes to: the one named (up), else the pod up with
    /// the most admission headroom.
    fn upload_pod<'p>(
        &self,
        pods: &'p [PodRow],
        named: Option<&PodId>,
    ) -> Result<&'p PodRow, ServiceError> {
        match named {
            Some(want) => self.named_pod(pods, want, "no image is installed on it"),
            None => pods
                .iter()
                .filter(|p| self.is_up(p))
                .max_by(|a, b| a.headroom_mib.total_cmp(&b.headroom_mib))
                .ok_or_else(|| ServiceError::Unavailable {
                    message: "no pod is up to install the image on".into(),
                    retry_after_s: 1,
                }),
        }
    }
}

fn unusable(pod: &PodId) -> ServiceError {
    ServiceError::Internal(format!(
        "pod {pod} has an address or fingerprint this replica cannot use"
    ))
}
