//! TLS between servers: a pod's (or the API's) identity, made on first
//! start as a self-signed certificate, and the client side that trusts
//! exactly one certificate, pinned by its SHA-256 fingerprint (a cluster
//! pod announces it in its heartbeats; `torpor serve` makes its nested
//! pod's identity itself; a CLI is given `--api-fingerprint`). No CA is
//! involved.

mod listener;

pub use listener::TlsListener;

use std::fmt;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, ServerConfig, SignatureScheme};
use sha2::{Digest, Sha256};

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
    #[error("{0:?} is not a SHA-256 fingerprint (64 hex digits, colons allowed)")]
    BadFingerprint(String),
}

/// A certificate's SHA-256 fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    pub fn of(cert: &[u8]) -> Self {
        Fingerprint(Sha256::digest(cert).into())
    }

    /// 64 hex digits, upper or lower case, optionally `sha256:`-prefixed
    /// and colon-separated (as `openssl x509 -fingerprint` prints it).
    /// Surrounding whitespace is dropped (a pasted value); the API takes
    /// [`Fingerprint::parse_exact`]'s form only.
    pub fn parse(text: &str) -> Result<Self, TlsError> {
        Self::parse_exact(text.trim())
    }

    /// `^(sha256:|SHA256:)?([0-9A-Fa-f]{64}|[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){31})$`
    /// (the OpenAPI document's pattern).
    pub fn parse_exact(text: &str) -> Result<Self, TlsError> {
        let bad = || TlsError::BadFingerprint(text.chars().take(120).collect());
        let t = text
            .strip_prefix("sha256:")
            .or_else(|| text.strip_prefix("SHA256:"))
            .unwrap_or(text);
        let hex: Vec<u8> = if t.len() == 95 {
            // Colon-separated pairs: a colon after every pair but the last.
            let colons = t.bytes().skip(2).step_by(3).all(|b| b == b':');
            if !colons {
                return Err(bad());
            }
            t.bytes().filter(|&b| b != b':').collect()
        } else {
            t.bytes().collect()
        };
        if hex.len() != 64 || !hex.iter().all(u8::is_ascii_hexdigit) {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (i, pair) in hex.chunks(2).enumerate() {
            let s = std::str::from_utf8(pair).map_err(|_| bad())?;
            out[i] = u8::from_str_radix(s, 16).map_err(|_| bad())?;
        }
        Ok(Fingerprint(out))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
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

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The client side of TLS that trusts exactly the certificate with
/// `pin`'s fingerprint (whatever name or dates it carries: the pin is the
/// trust, as with SSH host keys).
pub fn pinned_client_config(pin: Fingerprint) -> Arc<ClientConfig> {
    let provider = provider();
    let verifier = Arc::new(PinnedCert {
        pin,
        provider: provider.clone(),
    });
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Arc::new(config)
}

#[derive(Debug)]
struct PinnedCert {
    pin: Fingerprint,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let seen = Fingerprint::of(end_entity);
        // Fingerprints are public; comparing them need not be constant-time.
        if seen == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "the server's certificate is {seen}, not the pinned {}",
                self.pin
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
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
    fn fingerprints_parse_in_every_common_spelling() {
        let f = Fingerprint::of(b"x");
        let plain = f.to_string();
        assert!(plain.starts_with("sha256:"));
        assert_eq!(Fingerprint::parse(&plain).unwrap(), f);
        let hex = &plain["sha256:".len()..];
        assert_eq!(Fingerprint::parse(hex).unwrap(), f);
        let colons: Vec<String> = hex
            .as_bytes()
            .chunks(2)
            .map(|c| String::from_utf8_lossy(c).to_uppercase())
            .collect();
        assert_eq!(Fingerprint::parse(&colons.join(":")).unwrap(), f);
        assert!(Fingerprint::parse("abc").is_err());
        assert!(Fingerprint::parse(&"zz".repeat(32)).is_err());
    }

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
