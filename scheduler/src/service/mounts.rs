//! A sandbox's volumes (E2B's `volumeMounts`) served to its guest while its
//! VMM runs: before each VMM of a sandbox with volumes starts, the pod
//! serves them over NFS ([`crate::volumes`]) on the unix socket the VMM
//! sends the guest's vsock connections to host port 2049
//! (`<sandbox dir>/vsock.sock_2049`, bound before the jail is set up, so
//! that the jail's set-up gives it to the VMM's user); after the guest's
//! `resumed` hook the agent mounts each one (`mount_volumes`, idempotent).
//! Ending the VMM ends the serving.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use torpor_agent::proto::VolumeMount;
use torpor_agent::volumes::VOLUMES_PORT;
use torpor_sync::Locked;

use super::guest::{AgentLink, VSOCK_FILE};
use super::ServiceError;
use crate::model::{MountedVolume, Sandbox, SandboxId};
use crate::volumes::{VolumeExport, VolumeHandle, VolumeServer, VolumesRelay};

/// The longest a guest's `mount_volumes` may take (each mount's MOUNT and
/// first NFS calls go through the relay to this pod).
const MOUNT_LIMIT: Duration = Duration::from_secs(30);

/// The content directory of the volume `id` under a pod's volumes
/// directory (the API's `torpor_gate::volumes` layout:
/// `ROOT/ID/content/`), or `None` for an id that is not one.
pub fn content_dir(root: &Path, id: &str) -> Option<PathBuf> {
    let plain = (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    plain.then(|| root.join(id).join(CONTENT))
}

/// Checks a create's volume mounts as the guest's agent will
/// (`torpor_agent::volumes::check_mounts`: names, paths, how many), and
/// the ids a server in front of the pod gave, before anything starts.
pub fn check_requests(mounts: &[super::VolumeMountRequest]) -> Result<(), ServiceError> {
    let asked: Vec<VolumeMount> = mounts
        .iter()
        .map(|m| VolumeMount {
            name: m.name.clone(),
            path: m.path.clone(),
        })
        .collect();
    torpor_agent::volumes::check_mounts(&asked)
        .map_err(|e| ServiceError::Invalid(format!("volume mounts: {}", e.message)))?;
    for id in mounts.iter().filter_map(|m| m.id.as_deref()) {
        if !id.starts_with("vol_") || content_dir(Path::new("/"), id).is_none() {
            return Err(ServiceError::Invalid(format!(
                "volume id {id:?} is malformed"
            )));
        }
    }
    Ok(())
}

/// The name of a volume's content directory in its own directory.
pub const CONTENT: &str = "content";

/// The pod's volume serving: its server (started on first use) and what
/// each sandbox has served now.
#[derive(Debug)]
pub struct Mounts {
    /// Where the volumes are (`ServiceConfig::volumes_dir`); `None`: this
    /// pod serves none itself.
    root: Option<PathBuf>,
    /// Where a nested pod sends its sandboxes' volume connections instead
    /// (`ServiceConfig::volumes_relay`: the server in front of it, which
    /// has the volumes).
    relay: Option<VolumesRelay>,
    /// The most bytes a volume's files may hold.
    limit: u64,
    server: Mutex<Option<VolumeServer>>,
    served: Mutex<HashMap<SandboxId, Served>>,
}

/// One sandbox's volumes being served, or relayed.
#[derive(Debug)]
enum Served {
    /// Held for its drop, which ends the serving.
    Here { _export: VolumeHandle },
    /// Held for its drop, which ends the relaying.
    Relayed { _relay: crate::volumes::RelayHandle },
}

impl Mounts {
    /// Serving from the volumes under `root`, each limited to `limit`
    /// bytes, or relaying to `relay`.
    pub fn new(root: Option<PathBuf>, relay: Option<VolumesRelay>, limit: u64) -> Self {
        Mounts {
            root,
            relay,
            limit,
            server: Mutex::new(None),
            served: Mutex::new(HashMap::new()),
        }
    }

    /// Whether this pod mounts volumes into its sandboxes.
    pub fn offered(&self) -> bool {
        self.root.is_some() || self.relay.is_some()
    }

    /// The exports of `volumes`: each one's content directory, which must
    /// exist (a volume destroyed since is 404); a volume mounted at two
    /// paths is exported once.
    fn exports(&self, volumes: &[MountedVolume]) -> Result<Vec<VolumeExport>, ServiceError> {
        let root = self.root.as_deref().ok_or_else(|| {
            ServiceError::Invalid("this pod cannot mount volumes into its sandboxes".into())
        })?;
        let mut seen = std::collections::BTreeSet::new();
        volumes
            .iter()
            .filter(|v| seen.insert(v.name.as_str()))
            .map(|v| {
                let dir = content_dir(root, &v.id)
                    .filter(|d| d.is_dir())
                    .ok_or_else(|| ServiceError::NotFound {
                        kind: "volume",
                        id: v.name.clone(),
                    })?;
                Ok(VolumeExport {
                    name: v.name.clone(),
                    dir,
                    limit: self.limit,
                })
            })
            .collect()
    }

    /// Serves `volumes` (the sandbox `id`'s) on `socket` for as long as
    /// the handle lives: a sandbox's own, or, in the server in front of a
    /// nested pod, for each connection the pod relays.
    pub fn export(
        &self,
        id: &SandboxId,
        volumes: &[MountedVolume],
        socket: &Path,
    ) -> Result<VolumeHandle, ServiceError> {
        let exports = self.exports(volumes)?;
        let mut server = self.server.locked();
        if server.is_none() {
            *server = Some(VolumeServer::start().map_err(internal)?);
        }
        let server = server.as_ref().expect("started above");
        server.serve(socket, exports, tag_of(id)).map_err(internal)
    }

    /// Serves `sandbox`'s volumes (none: nothing) on the socket its VMM in
    /// `dir` connects to, replacing what it had served: from this pod's
    /// volumes, or relayed to the server in front of it.
    pub fn serve(&self, sandbox: &Sandbox, dir: &Path) -> Result<(), ServiceError> {
        self.stop(&sandbox.id);
        if sandbox.volumes.is_empty() {
            return Ok(());
        }
        let socket =
            torpor_vmm_api::launch::guest_target(&dir.join(VSOCK_FILE), u32::from(VOLUMES_PORT));
        let served = match (&self.root, &self.relay) {
            (None, Some(relay)) => Served::Relayed {
                _relay: crate::volumes::RelayHandle::start(&socket, relay, &sandbox.id)
                    .map_err(internal)?,
            },
            _ => Served::Here {
                _export: self.export(&sandbox.id, &sandbox.volumes, &socket)?,
            },
        };
        self.served.locked().insert(sandbox.id.clone(), served);
        Ok(())
    }

    /// Stops serving `id`'s volumes (its VMM ended).
    pub fn stop(&self, id: &SandboxId) {
        let served = self.served.locked().remove(id);
        drop(served);
    }
}

/// The tag of `id`'s export: the same for each of its VMMs and across
/// restarts of the pod (FNV-1a of its id), so that its guest's mounts go
/// on after a wake.
fn tag_of(id: &SandboxId) -> u64 {
    id.as_str().bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn internal(e: crate::volumes::VolumeError) -> ServiceError {
    ServiceError::Internal(format!("volumes: {e}"))
}

/// Has the guest behind `link` mount `volumes` (those already mounted are
/// left as they are).
pub fn mount_in_guest(link: &AgentLink, volumes: &[MountedVolume]) -> Result<(), ServiceError> {
    if volumes.is_empty() {
        return Ok(());
    }
    let mounts = volumes
        .iter()
        .map(|v| VolumeMount {
            name: v.name.clone(),
            path: v.path.clone(),
        })
        .collect();
    link.mount_volumes(mounts, MOUNT_LIMIT)
        .map_err(|e| ServiceError::Internal(format!("the guest could not mount its volumes: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_dirs_are_under_the_root_for_plain_ids_only() {
        let root = Path::new("/data/volumes");
        assert_eq!(
            content_dir(root, "vol_0a1b"),
            Some(PathBuf::from("/data/volumes/vol_0a1b/content"))
        );
        for bad in ["", "..", "a/b", "../x", "a b", &"x".repeat(65)] {
            assert_eq!(content_dir(root, bad), None, "{bad:?}");
        }
    }
}
