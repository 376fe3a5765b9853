//! An image as pulled or read from an archive ([`Image`]): its layers in
//! the blob directory, verified, in order, and its config ([`ImageConfig`]:
//! what the template builder turns into the start command and the
//! environment). Also the OCI documents both sources read (manifest,
//! index, config) and the platform choice: linux/amd64 only, the guests'.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::store::{BlobStore, Digest};

/// Largest manifest, index or config read (they are JSON documents of a
/// few KiB).
pub(crate) const MAX_DOCUMENT: u64 = 4 << 20;

/// An image ready to unpack: its layers, bottom first, in `blob_dir`.
#[derive(Debug, Clone)]
pub struct Image {
    pub(crate) store: BlobStore,
    pub(crate) blob_dir: PathBuf,
    pub(crate) manifest_digest: Digest,
    pub(crate) config_digest: Digest,
    pub(crate) config: ImageConfig,
    pub(crate) layers: Vec<Layer>,
}

impl Image {
    /// The layers, bottom first.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The image's config.
    pub fn config(&self) -> &ImageConfig {
        &self.config
    }

    /// The digest of the image's manifest (for a `docker save` archive,
    /// of its `manifest.json` entry).
    pub fn manifest_digest(&self) -> &Digest {
        &self.manifest_digest
    }

    /// The digest of the image's config blob.
    pub fn config_digest(&self) -> &Digest {
        &self.config_digest
    }

    /// The blob directory (`blobs/sha256/<hex>` under it).
    pub fn blob_dir(&self) -> &Path {
        &self.blob_dir
    }

    /// Where a layer's blob is.
    pub fn layer_path(&self, layer: &Layer) -> PathBuf {
        self.store.path(&layer.digest)
    }
}

/// One layer: a tar stream, plain or compressed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// The blob's digest (of its compressed bytes).
    pub digest: Digest,
    /// Its media type as the manifest says.
    pub media_type: String,
    /// Its size in bytes.
    pub size: u64,
    /// The digest of its uncompressed tar stream (the config's
    /// `rootfs.diff_ids`), checked when it is unpacked.
    pub diff_id: Option<Digest>,
}

/// What the image's config says about running it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    /// `os`.
    pub os: String,
    /// `architecture`.
    pub architecture: String,
    /// `config.Env`: `NAME=value` strings.
    pub env: Vec<String>,
    /// `config.Entrypoint`.
    pub entrypoint: Vec<String>,
    /// `config.Cmd`.
    pub cmd: Vec<String>,
    /// `config.WorkingDir`, if set.
    pub working_dir: Option<String>,
    /// `config.User` (`name`, `uid`, `uid:gid`...), if set.
    pub user: Option<String>,
    /// `config.ExposedPorts`: `8080/tcp`, `53/udp`, sorted.
    pub exposed_ports: Vec<String>,
    /// `config.Labels`.
    pub labels: BTreeMap<String, String>,
    /// `rootfs.diff_ids`, bottom layer first.
    pub diff_ids: Vec<Digest>,
}

impl ImageConfig {
    /// Parses an image config (OCI or Docker, the same JSON).
    pub fn parse(json: &[u8]) -> Result<ImageConfig> {
        let file: ConfigFile =
            serde_json::from_slice(json).map_err(|e| Error::malformed("image config", e))?;
        let run = file.config.unwrap_or_default();
        let diff_ids = file
            .rootfs
            .map(|r| r.diff_ids)
            .unwrap_or_default()
            .iter()
            .map(|d| Digest::parse(d))
            .collect::<Result<Vec<_>>>()?;
        let mut exposed_ports: Vec<String> =
            run.exposed_ports.unwrap_or_default().into_keys().collect();
        exposed_ports.sort();
        Ok(ImageConfig {
            os: file.os.unwrap_or_default(),
            architecture: file.architecture.unwrap_or_default(),
            env: run.env.unwrap_or_default(),
            entrypoint: run.entrypoint.unwrap_or_default(),
            cmd: run.cmd.unwrap_or_default(),
            working_dir: run.working_dir.filter(|w| !w.is_empty()),
            user: run.user.filter(|u| !u.is_empty()),
            exposed_ports,
            labels: run.labels.unwrap_or_default(),
            diff_ids,
        })
    }

    /// The command a container of the image starts: the entrypoint,
    /// then the cmd as its arguments (or the cmd alone).
    pub fn command(&self) -> Vec<String> {
        self.entrypoint
            .iter()
            .chain(self.cmd.iter())
            .cloned()
            .collect()
    }

    /// The environment as pairs (an entry without `=` is a name with an
    /// empty value).
    pub fn env_pairs(&self) -> Vec<(String, String)> {
        self.env
            .iter()
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (kv.clone(), String::new()),
            })
            .collect()
    }

    /// Refuses anything but linux/amd64.
    pub(crate) fn check_platform(&self) -> Result<()> {
        let arch_ok = matches!(self.architecture.as_str(), "amd64" | "x86_64" | "");
        let os_ok = matches!(self.os.as_str(), "linux" | "");
        if arch_ok && os_ok {
            Ok(())
        } else {
            Err(Error::Platform {
                found: format!("{}/{}", self.os, self.architecture),
            })
        }
    }
}

#[derive(Deserialize)]
struct ConfigFile {
    architecture: Option<String>,
    os: Option<String>,
    config: Option<RunConfig>,
    rootfs: Option<RootFs>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
struct RunConfig {
    env: Option<Vec<String>>,
    entrypoint: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
    working_dir: Option<String>,
    user: Option<String>,
    exposed_ports: Option<BTreeMap<String, serde_json::Value>>,
    labels: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

/// A descriptor in a manifest or an index.
#[derive(Debug, Deserialize, Clone)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: u64,
    pub platform: Option<Platform>,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize, Clone)]
pub(crate) struct Platform {
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub architecture: String,
}

/// An image manifest or an index: which one is told by `manifests` (an
/// index) or `layers` (an image).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Document {
    #[serde(default)]
    pub media_type: String,
    pub config: Option<Descriptor>,
    pub layers: Option<Vec<Descriptor>>,
    pub manifests: Option<Vec<Descriptor>>,
}

impl Document {
    pub(crate) fn parse(what: &str, json: &[u8]) -> Result<Document> {
        serde_json::from_slice(json).map_err(|e| Error::malformed(what, e))
    }
}

/// The linux/amd64 entry of an index (an entry without a platform counts
/// when it is the only one).
pub(crate) fn choose_platform<'a>(what: &str, entries: &'a [Descriptor]) -> Result<&'a Descriptor> {
    let images: Vec<&Descriptor> = entries
        .iter()
        .filter(|d| !d.media_type.contains("attestation"))
        .filter(|d| {
            d.annotations
                .get("vnd.docker.reference.type")
                .map(String::as_str)
                != Some("attestation-manifest")
        })
        .collect();
    if let Some(d) = images.iter().find(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
    }) {
        return Ok(d);
    }
    match images.as_slice() {
        [only] if only.platform.is_none() => Ok(only),
        [] => Err(Error::malformed(what, "no image in the index")),
        _ => Err(Error::Platform {
            found: images
                .iter()
                .map(|d| {
                    d.platform
                        .as_ref()
                        .map(|p| format!("{}/{}", p.os, p.architecture))
                        .unwrap_or_else(|| "unknown".into())
                })
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// The layers of a manifest, each with its diff id from the config.
pub(crate) fn layers_of(
    what: &str,
    layers: &[Descriptor],
    config: &ImageConfig,
) -> Result<Vec<Layer>> {
    if !config.diff_ids.is_empty() && config.diff_ids.len() != layers.len() {
        return Err(Error::malformed(
            what,
            format!(
                "{} layers but {} diff_ids in the config",
                layers.len(),
                config.diff_ids.len()
            ),
        ));
    }
    layers
        .iter()
        .enumerate()
        .map(|(i, d)| {
            Ok(Layer {
                digest: Digest::parse(&d.digest)?,
                media_type: d.media_type.clone(),
                size: d.size,
                diff_id: config.diff_ids.get(i).cloned(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_gives_the_command_and_environment() {
        let json = br#"{"architecture":"amd64","os":"linux",
            "config":{"Env":["PATH=/usr/bin","EMPTY"],"Entrypoint":["/bin/app"],
              "Cmd":["--port","8080"],"WorkingDir":"/srv","User":"1000:1000",
              "ExposedPorts":{"8080/tcp":{},"53/udp":{}}},
            "rootfs":{"type":"layers","diff_ids":[]}}"#;
        let c = ImageConfig::parse(json).unwrap();
        assert_eq!(c.command(), ["/bin/app", "--port", "8080"]);
        assert_eq!(c.env_pairs()[1], ("EMPTY".into(), String::new()));
        assert_eq!(c.working_dir.as_deref(), Some("/srv"));
        assert_eq!(c.user.as_deref(), Some("1000:1000"));
        assert_eq!(c.exposed_ports, ["53/udp", "8080/tcp"]);
        c.check_platform().unwrap();
        let arm = ImageConfig::parse(br#"{"architecture":"arm64","os":"linux"}"#).unwrap();
        assert!(matches!(arm.check_platform(), Err(Error::Platform { .. })));
    }

    #[test]
    fn an_index_gives_its_linux_amd64_image() {
        let d = |arch: &str| Descriptor {
            media_type: "application/vnd.oci.image.manifest.v1+json".into(),
            digest: format!("sha256:{}", "0".repeat(64)),
            size: 1,
            platform: Some(Platform {
                os: "linux".into(),
                architecture: arch.into(),
            }),
            annotations: BTreeMap::new(),
        };
        let entries = [d("arm64"), d("amd64")];
        let chosen = choose_platform("index", &entries).unwrap();
        assert_eq!(chosen.platform.as_ref().unwrap().architecture, "amd64");
        let err = choose_platform("index", &entries[..1]).unwrap_err();
        assert!(err.to_string().contains("linux/arm64"), "{err}");
    }
}
