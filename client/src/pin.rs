//! Trusting exactly one certificate: its SHA-256 [`Fingerprint`], pinned
//! as SSH pins host keys (no CA, no name or date checks). A cluster pod
//! announces its fingerprint in its heartbeats; `torpor serve` makes its
//! nested pod's identity itself; a CLI is given `--api-fingerprint`. The
//! servers' side (their identities) is `torpor_api::tls`.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};

/// Text that is no SHA-256 fingerprint.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a SHA-256 fingerprint (64 hex digits, colons allowed)")]
pub struct BadFingerprint(pub String);

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
    pub fn parse(text: &str) -> Result<Self, BadFingerprint> {
        Self::parse_exact(text.trim())
    }

    /// `^(sha256:|SHA256:)?([0-9A-Fa-f]{64}|[0-9A-Fa-f]{2}(:[0-9A-Fa-f]{2}){31})$`
    /// (the OpenAPI document's pattern).
    pub fn parse_exact(text: &str) -> Result<Self, BadFingerprint> {
        let bad = || BadFingerprint(text.chars().take(120).collect());
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

/// The one crypto provider of torpor's TLS, client and server (ring).
pub fn provider() -> Arc<CryptoProvider> {
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
}
