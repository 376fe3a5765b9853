//! What makes an image's template found again: its names (a hash of the
//! tenant, the image's config digest and the provisioning inputs), what a
//! source resolved to (remembered per tenant), and one build at a time
//! making a source's image.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest as _, Sha256};
use torpor_sync::Locked;

use super::{Facts, Guest, ImageError, Origin};
use crate::builds::plan::LAYER_PREFIX;
use crate::builds::{Build, Builds, Level};

/// The image's names: its image (per tenant) and its template (hidden).
pub(super) struct Names {
    pub image: String,
    pub template: String,
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of `parts`, each length-prefixed.
fn hash(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex(&h.finalize())
}

pub(super) fn names(
    tenant: Option<&str>,
    config_digest: &str,
    provision: &str,
    shape: (u32, u32),
) -> Names {
    let owner = tenant.map_or(b"\0shared".as_slice(), str::as_bytes);
    let image_key = hash(&[
        b"torpor oci image v1".as_slice(),
        owner,
        config_digest.as_bytes(),
        provision.as_bytes(),
    ]);
    let image = format!("oci-{}", &image_key[..16]);
    let shape = format!("{}/{}", shape.0, shape.1);
    let template_key = hash(&[image.as_bytes(), shape.as_bytes()]);
    Names {
        template: format!("{LAYER_PREFIX}oci-{}", &template_key[..32]),
        image,
    }
}

/// The provisioning inputs, as one hash: the agent's and kernel's bytes,
/// what `make_template_rootfs` adds, the headroom.
pub(super) fn provision(kernel: &Path, agent: &Path, guest: &Guest) -> Result<String, ImageError> {
    let digest_of = |what: &'static str, path: &Path| {
        sha256_file(path).map_err(|source| ImageError::GuestFile {
            what,
            path: path.to_path_buf(),
            source,
        })
    };
    let kernel = digest_of("the guest kernel", kernel)?;
    let agent = digest_of("the guest agent", agent)?;
    let additions = torpor_oci::additions_digest().to_string();
    let headroom = guest.headroom_mib.to_string();
    Ok(hash(&[
        kernel.as_bytes(),
        agent.as_bytes(),
        additions.as_bytes(),
        headroom.as_bytes(),
    ]))
}

/// The lowercase hex SHA-256 of the file at `path`.
pub(super) fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = std::io::Read::read(&mut file, &mut buf)?;
        if n == 0 {
            return Ok(hex(&h.finalize()));
        }
        h.update(&buf[..n]);
    }
}

/// What the memo file says, if it is readable.
pub(super) fn read_memo(path: &Path) -> Option<Facts> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

pub(super) fn write_memo(path: &Path, facts: &Facts) {
    let written = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| {
            let tmp = path.with_extension("json.tmp");
            std::fs::write(&tmp, serde_json::to_vec(facts).unwrap_or_default())?;
            std::fs::rename(&tmp, path)
        });
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), "an image source's memo is not written: {e}");
    }
}

impl Builds {
    /// The memo of `tenant`'s image source `origin`.
    pub(super) fn memo_path(&self, tenant: Option<&str>, origin: &Origin) -> PathBuf {
        let id = match origin {
            Origin::Registry { reference, .. } => format!("registry {reference}"),
            Origin::Upload { hash } => format!("upload {hash}"),
        };
        let name = &hash(&[id.as_bytes()])[..32];
        self.root
            .join("images")
            .join(crate::builds::files::owner_dir(tenant))
            .join(format!("{name}.json"))
    }

    /// Build `id`'s scratch directory.
    pub(super) fn work_dir(&self, id: &str) -> PathBuf {
        self.root.join("work").join(id)
    }

    /// Holds `key` (one build at a time): waits for another build that
    /// holds it (said in `build`'s log), or for `build`'s cancel.
    pub(super) fn making(&self, key: &Path, build: &Build) -> Result<Making<'_>, ImageError> {
        let key = key.to_string_lossy().into_owned();
        let mut said = false;
        loop {
            if self.making.locked().insert(key.clone()) {
                return Ok(Making { builds: self, key });
            }
            if build.cancel.is_cancelled() {
                return Err(ImageError::Cancelled);
            }
            if !said {
                build.log(
                    Level::Info,
                    "[base] waiting for another build making this image",
                );
                said = true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A held image source ([`Builds::making`]).
pub(super) struct Making<'a> {
    builds: &'a Builds,
    key: String,
}

impl Drop for Making<'_> {
    fn drop(&mut self) {
        self.builds.making.locked().remove(&self.key);
    }
}
