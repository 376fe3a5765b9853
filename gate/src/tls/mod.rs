//! TLS between servers, the server side: a pod's (or the API's) identity,
//! made on first start as a self-signed certificate. Clients trust exactly
//! that certificate, pinned by its SHA-256 fingerprint
//! ([`torpor_client::pin`]: a cluster pod announces it in its heartbeats;
//! `torpor serve` makes its nested pod's identity itself; a CLI is given
//! `--api-fingerprint`). No CA is involved.

mod listener;

pub use listener::TlsListener;

use std::fmt;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use torpor_client::pin::{provider, BadFingerprint, Fingerprint};

/// Names of an identity's files in its directory.
pub const CERT_FILE: &str = "cert.pem";
pub const KEY_FILE: &str = "key.pem";

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a PEM {what}")]
    Pem { path: PathBuf, what: &'static str },
    #[error("cannot make a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    #[error(transparent)]
    BadFingerprint(#[from] BadFingerprint),
}

/// A server's certificate and key.
pub struct Identity {
    pub cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("fingerprint", &self.fingerprint())
            .finish_non_exhaustive()
    }
}

impl Identity {
    /// Reads `cert` and `key` (PEM).
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                path: path.into(),
                source,
            })
        };
        let cert_pem = read(cert)?;
        let key_pem = read(key)?;
        let cert_der = CertificateDer::from_pem_slice(&cert_pem).map_err(|_| TlsError::Pem {
            path: cert.into(),
            what: "certificate",
        })?;
        let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::Pem {
            path: key.into(),
            what: "private key",
        })?;
        Ok(Identity {
            cert: cert_der,
            key: key_der,
        })
    }

    /// The identity in `dir` (`cert.pem`, `key.pem`), made on first use: a
    /// self-signed certificate for `names` (DNS names or IP addresses) and
    /// a fresh ECDSA P-256 key, the key written 0600 and never replaced.
    /// The second value says whether it was made now.
    pub fn load_or_create(dir: &Path, names: &[String]) -> Result<(Self, bool), TlsError> {
        let cert = dir.join(CERT_FILE);
        let key = dir.join(KEY_FILE);
        if cert.exists() || key.exists() {
            return Ok((Self::from_files(&cert, &key)?, false));
        }
        let write_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TlsError::Write { path, source }
        };
        std::fs::create_dir_all(dir).map_err(write_err(dir))?;
        let made = rcgen::generate_simple_self_signed(names.to_vec())?;
        // The key first: a crash between the two leaves a key and no
        // certificate, which `from_files` refuses loudly rather than
        // silently making a second identity its callers never pinned.
        write_new(&key, made.signing_key.serialize_pem().as_bytes()).map_err(write_err(&key))?;
        write_new(&cert, made.cert.pem().as_bytes()).map_err(write_err(&cert))?;
        Ok((Self::from_files(&cert, &key)?, true))
    }

    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.cert)
    }

    /// The server side of TLS with this identity.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![self.cert.clone()], self.key.clone_key())?;
        Ok(Arc::new(config))
    }
}

/// Creates `path` exclusively, mode 0600, not following a symlink there.
fn write_new(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Names a self-signed identity is made for: loopback, and the host's name.
pub fn default_names() -> Vec<String> {
    let mut names = vec!["localhost".to_string(), "127.0.0.1".into(), "::1".into()];
    if let Ok(h) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let h = h.trim();
        if !h.is_empty() && h != "localhost" {
            names.push(h.to_string());
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_is_made_once_and_kept() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("dir");
        let (first, made) = Identity::load_or_create(&dir, &default_names()).unwrap();
        assert!(made);
        let (again, made) = Identity::load_or_create(&dir, &default_names()).unwrap();
        assert!(!made);
        assert_eq!(first.fingerprint(), again.fingerprint());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        first.server_config().unwrap();
        // A lone key (a crash between the two writes) is refused, not
        // silently replaced.
        std::fs::remove_file(dir.join(CERT_FILE)).unwrap();
        assert!(Identity::load_or_create(&dir, &default_names()).is_err());
    }
}
