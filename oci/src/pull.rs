//! Images pulled from a registry ([`pull`]) with the oras project's
//! `oci-client` (the registry protocol, token and basic auth, manifest
//! lists): the linux/amd64 manifest, its config and layers, each blob
//! streamed into the blob directory and checked against its digest. A
//! layer already there (verified when it was stored) is not downloaded
//! again.
//!
//! Plain HTTP goes only to a loopback registry unless the caller says
//! [`PullOptions::insecure`]; TLS verifies against the system's roots plus
//! an extra CA the caller gives (a self-signed registry's).

use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

use crate::error::{Error, Result};
use crate::image::{self, Image, ImageConfig};
use crate::store::{BlobStore, Digest};

/// An image reference: `[registry[:port]/]repository[:tag][@digest]`.
/// Without a registry it is Docker Hub's (`docker.io`, `library/` for
/// one-word names); without a tag or digest, `:latest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference(oci_client::Reference);

impl FromStr for Reference {
    type Err = Error;

    fn from_str(text: &str) -> Result<Reference> {
        oci_client::Reference::from_str(text)
            .map(Reference)
            .map_err(|e| Error::Reference {
                reference: text.to_string(),
                reason: e.to_string(),
            })
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.whole())
    }
}

impl Reference {
    /// The registry as written (`docker.io` for Docker Hub).
    pub fn registry(&self) -> &str {
        self.0.registry()
    }

    /// The repository (`library/debian`).
    pub fn repository(&self) -> &str {
        self.0.repository()
    }

    /// The tag, if any.
    pub fn tag(&self) -> Option<&str> {
        self.0.tag()
    }

    /// The digest, if any.
    pub fn digest(&self) -> Option<&str> {
        self.0.digest()
    }

    /// Whether the registry is on this host's loopback.
    pub fn is_loopback(&self) -> bool {
        let (host, _) = crate::reach::host_port(self.registry());
        host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
    }
}

/// A registry account.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The user name.
    pub username: String,
    /// The password or token.
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// What a pull reports as it goes, to [`PullOptions::progress`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PullEvent {
    /// The manifest and config are read.
    Manifest {
        /// The manifest's digest.
        manifest: Digest,
        /// The config's digest.
        config: Digest,
        /// How many layers the image has.
        layers: usize,
        /// Their compressed size, all together (as the manifest says).
        bytes: u64,
    },
    /// Layer `index` (0-based, bottom first) was in the blob directory
    /// already: not downloaded.
    LayerPresent {
        /// Its place in the image.
        index: usize,
        /// Its digest.
        digest: Digest,
        /// Its size as the manifest says.
        size: u64,
    },
    /// Layer `index` is being downloaded.
    LayerStarted {
        /// Its place in the image.
        index: usize,
        /// Its digest.
        digest: Digest,
        /// Its size as the manifest says.
        size: u64,
    },
    /// Every [`PROGRESS_EVERY`] bytes of a layer's download.
    LayerProgress {
        /// Its place in the image.
        index: usize,
        /// Its digest.
        digest: Digest,
        /// Bytes downloaded so far.
        bytes: u64,
        /// Its size as the manifest says.
        size: u64,
    },
    /// Layer `index` is downloaded and its digest checked.
    LayerDone {
        /// Its place in the image.
        index: usize,
        /// Its digest.
        digest: Digest,
        /// Bytes downloaded.
        bytes: u64,
    },
}

/// How often a download reports [`PullEvent::LayerProgress`]: 64 MiB.
pub const PROGRESS_EVERY: u64 = 64 << 20;

/// Where a pull's [`PullEvent`]s go: called on the pull's task, so it
/// should return at once (send them on a channel, say).
#[derive(Clone)]
pub struct Progress(Arc<dyn Fn(PullEvent) + Send + Sync>);

impl Progress {
    /// Events to `f`.
    pub fn new(f: impl Fn(PullEvent) + Send + Sync + 'static) -> Progress {
        Progress(Arc::new(f))
    }

    fn emit(&self, event: PullEvent) {
        (self.0)(event)
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress(..)")
    }
}

/// How to pull.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Where blobs go (`blobs/sha256/<hex>` under it).
    pub blob_dir: PathBuf,
    /// Speak plain HTTP (allowed to loopback registries, or anywhere with
    /// `insecure`).
    pub plain_http: bool,
    /// Allow plain HTTP to a registry that is not on loopback.
    pub insecure: bool,
    /// An extra CA to trust (PEM), for a registry with a self-signed
    /// certificate.
    pub extra_ca_pem: Option<Vec<u8>>,
    /// The largest blob taken.
    pub max_blob_bytes: u64,
    /// The whole pull's time limit.
    pub timeout: Duration,
    /// Where progress goes, if anywhere.
    pub progress: Option<Progress>,
    /// Which registries may be reached (checked before the first
    /// request, on the registry's addresses).
    pub reach: crate::Reach,
}

impl PullOptions {
    /// HTTPS, no extra CA, blobs up to 16 GiB, 30 minutes, no progress,
    /// any registry.
    pub fn new(blob_dir: impl Into<PathBuf>) -> PullOptions {
        PullOptions {
            blob_dir: blob_dir.into(),
            plain_http: false,
            insecure: false,
            extra_ca_pem: None,
            max_blob_bytes: 16 << 30,
            timeout: Duration::from_secs(1800),
            progress: None,
            reach: crate::Reach::Any,
        }
    }
}

/// Pulls `reference`'s linux/amd64 image into `options.blob_dir`.
pub async fn pull(
    reference: &Reference,
    credentials: Option<&Credentials>,
    options: &PullOptions,
) -> Result<Image> {
    let registry = reference.registry().to_string();
    match tokio::time::timeout(options.timeout, pull_inner(reference, credentials, options)).await {
        Ok(result) => result,
        Err(_) => Err(Error::Timeout {
            registry,
            seconds: options.timeout.as_secs(),
        }),
    }
}

async fn pull_inner(
    reference: &Reference,
    credentials: Option<&Credentials>,
    options: &PullOptions,
) -> Result<Image> {
    let registry = reference.registry().to_string();
    if options.plain_http && !options.insecure && !reference.is_loopback() {
        return Err(Error::PlainHttpRefused { registry });
    }
    let port = if options.plain_http { 80 } else { 443 };
    crate::reach::check(&registry, &options.reach, port).await?;
    let mut extra_roots = Vec::new();
    if let Some(pem) = &options.extra_ca_pem {
        use rustls::pki_types::pem::PemObject as _;
        let certs = rustls::pki_types::CertificateDer::pem_slice_iter(pem)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Certificate(e.to_string()))?;
        if certs.is_empty() {
            return Err(Error::Certificate("no CERTIFICATE in the PEM given".into()));
        }
        extra_roots.push(Certificate {
            encoding: CertificateEncoding::Pem,
            data: pem.clone(),
        });
    }
    // reqwest's rustls has no provider of its own here: ring, as the
    // workspace's other TLS (a second install is a no-op).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = ClientConfig {
        protocol: if options.plain_http {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        },
        extra_root_certificates: extra_roots,
        platform_resolver: Some(Box::new(oci_client::client::linux_amd64_resolver)),
        connect_timeout: Some(Duration::from_secs(30)),
        read_timeout: Some(Duration::from_secs(120)),
        ..ClientConfig::default()
    };
    let client = oci_client::Client::try_from(config).map_err(|e| registry_error(&registry, e))?;
    let auth = match credentials {
        Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
        None => RegistryAuth::Anonymous,
    };
    let oci_ref = &reference.0;
    let (manifest, manifest_digest, config_json) = client
        .pull_manifest_and_config(oci_ref, &auth)
        .await
        .map_err(|e| registry_error(&registry, e))?;
    let manifest_digest = Digest::parse(&manifest_digest)?;
    let store = BlobStore::open(&options.blob_dir)?;
    let config_bytes = config_json.into_bytes();
    let config_digest = Digest::parse(&manifest.config.digest)?;
    store.put_bytes(&config_digest, &config_bytes, "image config")?;
    let config = ImageConfig::parse(&config_bytes)?;
    config.check_platform()?;
    let descriptors: Vec<image::Descriptor> = manifest
        .layers
        .iter()
        .map(|l| image::Descriptor {
            media_type: l.media_type.clone(),
            digest: l.digest.clone(),
            size: u64::try_from(l.size).unwrap_or(0),
            platform: None,
            annotations: Default::default(),
        })
        .collect();
    let layers = image::layers_of(&reference.to_string(), &descriptors, &config)?;
    let emit = |event| {
        if let Some(p) = &options.progress {
            p.emit(event)
        }
    };
    emit(PullEvent::Manifest {
        manifest: manifest_digest.clone(),
        config: config_digest.clone(),
        layers: layers.len(),
        bytes: layers.iter().map(|l| l.size).sum(),
    });
    for (index, (layer, descriptor)) in layers.iter().zip(&manifest.layers).enumerate() {
        if store.has(&layer.digest) {
            emit(PullEvent::LayerPresent {
                index,
                digest: layer.digest.clone(),
                size: layer.size,
            });
            continue;
        }
        emit(PullEvent::LayerStarted {
            index,
            digest: layer.digest.clone(),
            size: layer.size,
        });
        let limit = if layer.size > 0 {
            layer.size.min(options.max_blob_bytes)
        } else {
            options.max_blob_bytes
        };
        let bytes = download(
            &client,
            oci_ref,
            descriptor,
            &store,
            &layer.digest,
            limit,
            &registry,
            &|bytes| {
                emit(PullEvent::LayerProgress {
                    index,
                    digest: layer.digest.clone(),
                    bytes,
                    size: layer.size,
                })
            },
        )
        .await?;
        emit(PullEvent::LayerDone {
            index,
            digest: layer.digest.clone(),
            bytes,
        });
    }
    Ok(Image {
        store,
        blob_dir: options.blob_dir.clone(),
        manifest_digest,
        config_digest,
        config,
        layers,
    })
}

/// Streams one blob into the store: at most `limit` bytes, checked; its
/// size. `progress` is told every [`PROGRESS_EVERY`] bytes.
#[allow(clippy::too_many_arguments)]
async fn download(
    client: &oci_client::Client,
    reference: &oci_client::Reference,
    descriptor: &oci_client::manifest::OciDescriptor,
    store: &BlobStore,
    digest: &Digest,
    limit: u64,
    registry: &str,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<u64> {
    let (temp, file) = store.temp()?;
    let result = async {
        let mut stream = client
            .pull_blob_stream(reference, descriptor)
            .await
            .map_err(|e| registry_error(registry, e))?;
        let mut out = tokio::fs::File::from_std(file);
        let mut hasher = Sha256::new();
        let mut written = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| Error::io(format!("registry {registry}: blob {digest}"), e))?;
            let before = written;
            written += chunk.len() as u64;
            if written / PROGRESS_EVERY > before / PROGRESS_EVERY {
                progress(written);
            }
            if written > limit {
                return Err(Error::BlobTooLarge {
                    digest: digest.to_string(),
                    limit,
                });
            }
            hasher.update(&chunk);
            out.write_all(&chunk)
                .await
                .map_err(|e| Error::io(temp.display(), e))?;
        }
        out.flush()
            .await
            .map_err(|e| Error::io(temp.display(), e))?;
        Ok((Digest::from_hasher(hasher), written))
    }
    .await;
    match result {
        Ok((actual, written)) => store
            .commit(&temp, digest, &actual, &format!("blob {digest}"))
            .map(|()| written),
        Err(e) => {
            let _ = std::fs::remove_file(&temp);
            Err(e)
        }
    }
}

/// The client's error as ours: refused credentials are [`Error::Auth`].
fn registry_error(registry: &str, e: OciDistributionError) -> Error {
    let auth = |detail: String| Error::Auth {
        registry: registry.to_string(),
        detail,
    };
    match e {
        OciDistributionError::AuthenticationFailure(detail) => auth(detail),
        OciDistributionError::UnauthorizedError { url } => {
            auth(format!("401 Unauthorized at {url}"))
        }
        OciDistributionError::RegistryError { envelope, url }
            if envelope
                .errors
                .iter()
                .any(|e| matches!(e.code, OciErrorCode::Unauthorized | OciErrorCode::Denied)) =>
        {
            auth(format!(
                "{} at {url}",
                envelope
                    .errors
                    .iter()
                    .map(|e| e.message.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            ))
        }
        OciDistributionError::ServerError {
            code: 401,
            url,
            message,
        } => auth(format!("401 at {url}: {message}")),
        OciDistributionError::DigestError(d) => Error::Digest {
            what: format!("registry {registry}"),
            expected: String::new(),
            actual: d.to_string(),
        },
        other => {
            // reqwest's message alone hides the cause (an unknown issuer).
            let mut detail = other.to_string();
            let mut cause = std::error::Error::source(&other);
            while let Some(c) = cause {
                detail.push_str(&format!(": {c}"));
                cause = c.source();
            }
            Error::Registry {
                registry: registry.to_string(),
                detail,
                source: Box::new(other),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_default_to_docker_hub_and_know_loopback() {
        let r: Reference = "debian".parse().unwrap();
        assert_eq!(r.registry(), "docker.io");
        assert_eq!(r.repository(), "library/debian");
        assert!(!r.is_loopback());
        let r: Reference = "127.0.0.1:5000/team/app:v1".parse().unwrap();
        assert_eq!(
            (r.registry(), r.repository(), r.tag()),
            ("127.0.0.1:5000", "team/app", Some("v1"))
        );
        assert!(r.is_loopback());
        assert!("localhost:5000/a"
            .parse::<Reference>()
            .unwrap()
            .is_loopback());
        assert!(!"10.0.0.1:5000/a"
            .parse::<Reference>()
            .unwrap()
            .is_loopback());
        let d = format!("sha256:{}", "ab".repeat(32));
        let r: Reference = format!("quay.io/x/y@{d}").parse().unwrap();
        assert_eq!(r.digest(), Some(d.as_str()));
        assert!(matches!(
            "UPPER/Case".parse::<Reference>(),
            Err(Error::Reference { .. })
        ));
    }

    /// The service spawns pulls on its runtime.
    #[test]
    fn a_pull_can_be_spawned() {
        fn send<T: Send + 'static>(_: &T) {}
        let r: Reference = "a/b".parse().unwrap();
        let options = PullOptions::new("/nonexistent");
        send(&async move { pull(&r, None, &options).await });
    }

    #[tokio::test]
    async fn plain_http_goes_to_loopback_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut options = PullOptions::new(dir.path());
        options.plain_http = true;
        let r: Reference = "registry.example:5000/a:b".parse().unwrap();
        let err = pull(&r, None, &options).await.unwrap_err();
        assert!(matches!(err, Error::PlainHttpRefused { .. }), "{err}");
        options.plain_http = false;
        options.extra_ca_pem = Some(b"not a certificate".to_vec());
        let err = pull(&r, None, &options).await.unwrap_err();
        assert!(matches!(err, Error::Certificate(_)), "{err}");
    }
}
