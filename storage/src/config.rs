//! Which store: `--object-store` parsed into a [`StoreConfig`].
//!
//! | given                  | store                                        |
//! |------------------------|----------------------------------------------|
//! | `/var/lib/torpor/objects`, `./objects` | a local directory (made if missing) |
//! | `file:///var/lib/torpor/objects` | the same                           |
//! | `s3://bucket`, `s3://bucket/some/prefix` | an S3-compatible bucket, keys under the prefix |
//!
//! An S3 store's endpoint, region and keys come from the usual variables:
//! `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT`; unset: AWS itself),
//! `AWS_REGION` (or `AWS_DEFAULT_REGION`; unset: `us-east-1`),
//! `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (both required: no
//! instance-profile lookup), `AWS_SESSION_TOKEN` (optional) and
//! `AWS_ALLOW_HTTP`. A plain-`http://` endpoint is taken on loopback
//! (a test server) and elsewhere only with `AWS_ALLOW_HTTP=true`. What
//! the variables leave unset comes from the AWS shared files of
//! `AWS_PROFILE` (`~/.aws/credentials`, `~/.aws/config`: [`crate::profile`]).

use std::fmt;
use std::path::PathBuf;

use crate::error::ConfigError;
use crate::profile::Profile;

/// Where the objects live.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// A local directory (the embedded default).
    Local {
        /// The directory; relative paths are taken from the current one.
        dir: PathBuf,
    },
    /// An S3-compatible bucket.
    S3(S3Config),
}

/// An S3-compatible store.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    /// The bucket.
    pub bucket: String,
    /// The keys' prefix in it, without leading or trailing `/` (may be
    /// empty).
    pub prefix: String,
    /// The endpoint (`http(s)://host[:port]`); `None` is AWS's.
    pub endpoint: Option<String>,
    /// The region.
    pub region: String,
    /// The access key id.
    pub access_key_id: String,
    /// The secret key (never printed).
    pub secret_access_key: String,
    /// A session token, for temporary credentials.
    pub session_token: Option<String>,
    /// Whether a plain-HTTP endpoint is allowed.
    pub allow_http: bool,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .field("allow_http", &self.allow_http)
            .finish()
    }
}

impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local { dir } => f.debug_struct("Local").field("dir", dir).finish(),
            Self::S3(s3) => s3.fmt(f),
        }
    }
}

impl fmt::Display for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Local { dir } => write!(f, "file://{}", dir.display()),
            Self::S3(s3) => {
                write!(f, "s3://{}", s3.bucket)?;
                if !s3.prefix.is_empty() {
                    write!(f, "/{}", s3.prefix)?;
                }
                if let Some(e) = &s3.endpoint {
                    write!(f, " at {e}")?;
                }
                Ok(())
            }
        }
    }
}

/// What an `--object-store` string names, before the environment is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A local directory.
    Local(PathBuf),
    /// A bucket and a prefix.
    S3 {
        /// The bucket.
        bucket: String,
        /// The prefix (may be empty).
        prefix: String,
    },
}

impl StoreUrl {
    /// Parses `--object-store`: a directory, `file:///path` or
    /// `s3://bucket[/prefix]`.
    pub fn parse(url: &str) -> Result<Self, ConfigError> {
        let u = url.to_string();
        if url.trim().is_empty() {
            return Err(ConfigError::Empty);
        }
        let Some((scheme, rest)) = url.split_once("://") else {
            if let Some((scheme, _)) = url.split_once(':') {
                if scheme == "file" {
                    return Err(ConfigError::FileUrlPath { url: u });
                }
                if scheme == "s3" {
                    return Err(ConfigError::MissingBucket { url: u });
                }
            }
            return Ok(Self::Local(PathBuf::from(url)));
        };
        if rest.contains(['?', '#']) {
            return Err(ConfigError::QueryOrFragment { url: u });
        }
        match scheme {
            "file" => {
                let Some(path) = rest.strip_prefix('/') else {
                    return Err(ConfigError::FileUrlHost { url: u });
                };
                Ok(Self::Local(PathBuf::from(format!("/{path}"))))
            }
            "s3" => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(ConfigError::MissingBucket { url: u });
                }
                check_bucket(bucket).map_err(|why| ConfigError::BadBucket {
                    url: u.clone(),
                    bucket: bucket.into(),
                    why,
                })?;
                let prefix = prefix.strip_suffix('/').unwrap_or(prefix);
                check_prefix(prefix).map_err(|why| ConfigError::BadPrefix {
                    url: u.clone(),
                    prefix: prefix.into(),
                    why,
                })?;
                Ok(Self::S3 {
                    bucket: bucket.into(),
                    prefix: prefix.into(),
                })
            }
            other => Err(ConfigError::UnsupportedScheme {
                url: u.clone(),
                scheme: other.into(),
            }),
        }
    }
}

/// S3's bucket naming rules (the DNS-compatible ones).
fn check_bucket(b: &str) -> Result<(), &'static str> {
    if !(3..=63).contains(&b.len()) {
        return Err("3 to 63 characters");
    }
    if !b
        .bytes()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.')
    {
        return Err("only a-z, 0-9, - and .");
    }
    let first = b.as_bytes()[0];
    let last = b.as_bytes()[b.len() - 1];
    if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
        return Err("starts and ends with a letter or digit");
    }
    if b.contains("..") {
        return Err("no two dots in a row");
    }
    Ok(())
}

/// A prefix's segments are non-empty, not `.` or `..`, of printable ASCII
/// other than `\` (what every store keeps as is in a key).
fn check_prefix(p: &str) -> Result<(), &'static str> {
    if p.is_empty() {
        return Ok(());
    }
    if p.split('/').any(|s| s.is_empty() || s == "." || s == "..") {
        return Err("an empty, . or .. segment");
    }
    if !p.bytes().all(|c| c.is_ascii_graphic() && c != b'\\') {
        return Err("only printable ASCII, no spaces or backslashes");
    }
    Ok(())
}

impl StoreConfig {
    /// `--object-store` with the process's environment.
    pub fn parse(url: &str) -> Result<Self, ConfigError> {
        Self::parse_with_env(url, |k| std::env::var(k).ok())
    }

    /// `--object-store` with the environment `env` gives (tests pass
    /// their own).
    pub fn parse_with_env(
        url: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        match StoreUrl::parse(url)? {
            StoreUrl::Local(dir) => Ok(Self::Local { dir }),
            StoreUrl::S3 { bucket, prefix } => {
                let var = |k: &str| env(k).filter(|v| !v.is_empty());
                let profile = Profile::load(&var)?;
                let set = |k: &str| var(k).or_else(|| profile.get(k));
                let need = |var: &'static str| {
                    set(var).ok_or(ConfigError::MissingCredentials {
                        url: url.to_string(),
                        var,
                    })
                };
                let access_key_id = need("AWS_ACCESS_KEY_ID")?;
                let secret_access_key = need("AWS_SECRET_ACCESS_KEY")?;
                let allow_http = match set("AWS_ALLOW_HTTP") {
                    None => false,
                    Some(v) => parse_bool("AWS_ALLOW_HTTP", &v)?,
                };
                let endpoint = var("AWS_ENDPOINT_URL")
                    .or_else(|| var("AWS_ENDPOINT"))
                    .or_else(|| profile.get("AWS_ENDPOINT_URL"));
                if let Some(e) = &endpoint {
                    check_endpoint(e, allow_http)?;
                }
                Ok(Self::S3(S3Config {
                    bucket,
                    prefix,
                    endpoint,
                    region: var("AWS_REGION")
                        .or_else(|| var("AWS_DEFAULT_REGION"))
                        .or_else(|| profile.get("AWS_REGION"))
                        .unwrap_or_else(|| "us-east-1".into()),
                    access_key_id,
                    secret_access_key,
                    session_token: set("AWS_SESSION_TOKEN"),
                    allow_http,
                }))
            }
        }
    }
}

fn parse_bool(var: &'static str, v: &str) -> Result<bool, ConfigError> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(ConfigError::BadBool {
            var,
            value: v.into(),
        }),
    }
}

/// An endpoint is `http(s)://host[:port]` (a path is refused: the bucket
/// goes in the URL's path); plain HTTP only on loopback or when allowed.
pub(crate) fn check_endpoint(e: &str, allow_http: bool) -> Result<(), ConfigError> {
    let bad = |why| ConfigError::BadEndpoint {
        endpoint: e.into(),
        why,
    };
    let (scheme, rest) = e
        .split_once("://")
        .ok_or_else(|| bad("not a URL (http(s)://host[:port])"))?;
    let host_port = rest.strip_suffix('/').unwrap_or(rest);
    if host_port.is_empty() {
        return Err(bad("no host"));
    }
    if host_port.contains(['/', '?', '#', '@']) {
        return Err(bad("only a scheme, a host and a port"));
    }
    let host = match host_port.strip_prefix('[') {
        Some(v6) => v6
            .split_once(']')
            .map(|(h, _)| h)
            .ok_or_else(|| bad("bad IPv6 host"))?,
        None => host_port.split(':').next().unwrap_or(host_port),
    };
    match scheme {
        "https" => Ok(()),
        "http" if allow_http || is_loopback(host) => Ok(()),
        "http" => Err(ConfigError::InsecureEndpoint { endpoint: e.into() }),
        _ => Err(bad("the scheme is http or https")),
    }
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    const KEYS: [(&str, &str); 2] = [
        ("AWS_ACCESS_KEY_ID", "id"),
        ("AWS_SECRET_ACCESS_KEY", "s3cr3t-value"),
    ];

    #[test]
    fn local_forms() {
        let l = |s| StoreUrl::parse(s).unwrap();
        assert_eq!(l("/var/lib/x"), StoreUrl::Local("/var/lib/x".into()));
        assert_eq!(l("objects"), StoreUrl::Local("objects".into()));
        assert_eq!(l("file:///var/lib/x"), StoreUrl::Local("/var/lib/x".into()));
        assert_eq!(l("file:///"), StoreUrl::Local("/".into()));
        assert_eq!(StoreUrl::parse(""), Err(ConfigError::Empty));
        assert!(matches!(
            StoreUrl::parse("file://host/x"),
            Err(ConfigError::FileUrlHost { .. })
        ));
        assert!(matches!(
            StoreUrl::parse("file:relative"),
            Err(ConfigError::FileUrlPath { .. })
        ));
        assert!(matches!(
            StoreUrl::parse("file://"),
            Err(ConfigError::FileUrlHost { .. })
        ));
    }

    #[test]
    fn s3_forms() {
        assert_eq!(
            StoreUrl::parse("s3://snaps").unwrap(),
            StoreUrl::S3 {
                bucket: "snaps".into(),
                prefix: "".into()
            }
        );
        assert_eq!(
            StoreUrl::parse("s3://snaps/pods/eu-1/").unwrap(),
            StoreUrl::S3 {
                bucket: "snaps".into(),
                prefix: "pods/eu-1".into()
            }
        );
        let err = |s| StoreUrl::parse(s).unwrap_err();
        assert!(matches!(err("s3://"), ConfigError::MissingBucket { .. }));
        assert!(matches!(
            err("s3:bucket"),
            ConfigError::MissingBucket { .. }
        ));
        assert!(matches!(err("s3:///x"), ConfigError::MissingBucket { .. }));
        assert!(matches!(err("s3://Bucket"), ConfigError::BadBucket { .. }));
        assert!(matches!(err("s3://ab"), ConfigError::BadBucket { .. }));
        assert!(matches!(err("s3://a..b"), ConfigError::BadBucket { .. }));
        assert!(matches!(err("s3://-ab"), ConfigError::BadBucket { .. }));
        assert!(matches!(
            err("s3://bkt/x//y"),
            ConfigError::BadPrefix { .. }
        ));
        assert!(matches!(
            err("s3://bkt/x/../y"),
            ConfigError::BadPrefix { .. }
        ));
        assert!(matches!(err("s3://bkt/x y"), ConfigError::BadPrefix { .. }));
        assert!(matches!(
            err("s3://bkt/x?region=1"),
            ConfigError::QueryOrFragment { .. }
        ));
        let e = err("gs://bucket/x");
        assert!(matches!(e, ConfigError::UnsupportedScheme { ref scheme, .. } if scheme == "gs"));
        assert!(e.to_string().contains("gs"), "{e}");
    }

    #[test]
    fn s3_environment() {
        let c = StoreConfig::parse_with_env("s3://snaps/p", env(&KEYS)).unwrap();
        let StoreConfig::S3(s3) = &c else { panic!() };
        assert_eq!(s3.region, "us-east-1");
        assert_eq!(s3.endpoint, None);
        assert!(!format!("{c:?}").contains("s3cr3t"), "{c:?}");
        assert_eq!(c.to_string(), "s3://snaps/p");

        let mut vars = KEYS.to_vec();
        vars.push(("AWS_ENDPOINT_URL", "http://127.0.0.1:8333"));
        vars.push(("AWS_DEFAULT_REGION", "eu-west-3"));
        vars.push(("AWS_SESSION_TOKEN", "tok"));
        let StoreConfig::S3(s3) = StoreConfig::parse_with_env("s3://snaps", env(&vars)).unwrap()
        else {
            panic!()
        };
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:8333"));
        assert_eq!(s3.region, "eu-west-3");
        assert_eq!(s3.session_token.as_deref(), Some("tok"));

        let e = StoreConfig::parse_with_env("s3://snaps", env(&KEYS[..1])).unwrap_err();
        assert!(matches!(
            e,
            ConfigError::MissingCredentials {
                var: "AWS_SECRET_ACCESS_KEY",
                ..
            }
        ));

        let mut vars = KEYS.to_vec();
        vars.push(("AWS_ENDPOINT_URL", "http://minio.internal:9000"));
        let e = StoreConfig::parse_with_env("s3://snaps", env(&vars)).unwrap_err();
        assert!(matches!(e, ConfigError::InsecureEndpoint { .. }), "{e}");
        vars.push(("AWS_ALLOW_HTTP", "true"));
        assert!(StoreConfig::parse_with_env("s3://snaps", env(&vars)).is_ok());
        vars.pop();
        vars.push(("AWS_ALLOW_HTTP", "maybe"));
        let e = StoreConfig::parse_with_env("s3://snaps", env(&vars)).unwrap_err();
        assert!(matches!(e, ConfigError::BadBool { .. }), "{e}");

        for bad in ["127.0.0.1:9000", "ftp://x", "http://", "https://h/path"] {
            let mut vars = KEYS.to_vec();
            vars.push(("AWS_ENDPOINT_URL", bad));
            let e = StoreConfig::parse_with_env("s3://snaps", env(&vars)).unwrap_err();
            assert!(matches!(e, ConfigError::BadEndpoint { .. }), "{bad}: {e}");
        }
        for ok in [
            "http://localhost:1",
            "http://[::1]:9000",
            "https://s3.example.com/",
        ] {
            assert!(check_endpoint(ok, false).is_ok(), "{ok}");
        }
    }

    #[test]
    fn s3_settings_from_a_profile_where_the_environment_is_silent() {
        let dir = tempfile::tempdir().unwrap();
        let creds = dir.path().join("credentials");
        std::fs::write(
            &creds,
            "[ci]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n",
        )
        .unwrap();
        let config = dir.path().join("config");
        std::fs::write(
            &config,
            "[profile ci]\nregion = file-region\nendpoint_url = http://127.0.0.1:9\n",
        )
        .unwrap();
        let (creds, config) = (creds.display().to_string(), config.display().to_string());
        let files = [
            ("AWS_SHARED_CREDENTIALS_FILE", creds.as_str()),
            ("AWS_CONFIG_FILE", config.as_str()),
            ("AWS_PROFILE", "ci"),
        ];
        let StoreConfig::S3(s3) = StoreConfig::parse_with_env("s3://snaps", env(&files)).unwrap()
        else {
            panic!()
        };
        assert_eq!(s3.access_key_id, "FILEKEY");
        assert_eq!(s3.secret_access_key, "FILESECRET");
        assert_eq!(s3.region, "file-region");
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9"));
        // The environment comes first, AWS_DEFAULT_REGION before the file.
        let mut vars = files.to_vec();
        vars.extend(KEYS);
        vars.push(("AWS_DEFAULT_REGION", "env-region"));
        vars.push(("AWS_ENDPOINT", "http://127.0.0.1:10"));
        let StoreConfig::S3(s3) = StoreConfig::parse_with_env("s3://snaps", env(&vars)).unwrap()
        else {
            panic!()
        };
        assert_ne!(s3.access_key_id, "FILEKEY");
        assert_eq!(s3.region, "env-region");
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:10"));
        // A local store reads no file, even a missing one.
        let gone = [("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/creds")];
        assert!(StoreConfig::parse_with_env("/tmp/objects", env(&gone)).is_ok());
        assert!(matches!(
            StoreConfig::parse_with_env("s3://snaps", env(&gone)),
            Err(ConfigError::ProfileFile { .. })
        ));
    }
}
