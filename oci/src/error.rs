//! The crate's errors: one [`Error`] for every operation, with typed
//! reasons for what unpacking refuses ([`Refusal`]) and which tar-bomb
//! limit a layer crossed ([`BombLimit`]), so that callers and tests match
//! on them and users read which entry of which layer was refused.

use std::fmt;
use std::path::PathBuf;

/// Every error of torpor-oci.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An image reference that does not parse.
    #[error("invalid image reference {reference:?}: {reason}")]
    Reference {
        /// The text given.
        reference: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The registry refused the credentials (or asked for some and none
    /// were given).
    #[error("registry {registry}: authentication failed: {detail}")]
    Auth {
        /// The registry's host (and port).
        registry: String,
        /// What the registry or the client said.
        detail: String,
    },
    /// Plain HTTP to a registry that is not on loopback, without
    /// [`crate::PullOptions::insecure`].
    #[error(
        "registry {registry}: plain HTTP is allowed only to a loopback registry \
         (set the insecure option to allow it elsewhere)"
    )]
    PlainHttpRefused {
        /// The registry's host (and port).
        registry: String,
    },
    /// A registry that resolves to an address only this host may reach
    /// (loopback, a private network, link-local...), under
    /// [`crate::Reach::Global`] without naming it.
    #[error(
        "registry {registry} resolves to {address}, not a global address: a registry on a \
         private network is pulled from only when the server's operator names it"
    )]
    NotGlobal {
        /// The registry's host (and port).
        registry: String,
        /// The address that is not global.
        address: std::net::IpAddr,
    },
    /// The registry's name does not resolve.
    #[error("registry {registry} does not resolve: {detail}")]
    Unresolved {
        /// The registry's host (and port).
        registry: String,
        /// The resolver's word.
        detail: String,
    },
    /// The extra CA certificate given for the registry is not PEM.
    #[error("extra CA certificate: {0}")]
    Certificate(String),
    /// Any other failure talking to the registry (TLS, network, the
    /// registry's own errors).
    #[error("registry {registry}: {detail}")]
    Registry {
        /// The registry's host (and port).
        registry: String,
        /// The error and its causes, as one line.
        detail: String,
        /// The client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The pull did not finish in the time given.
    #[error("registry {registry}: the pull took longer than {seconds} s")]
    Timeout {
        /// The registry's host (and port).
        registry: String,
        /// The limit.
        seconds: u64,
    },
    /// Content whose SHA-256 is not the one that names it.
    #[error("{what}: digest mismatch: expected {expected}, got {actual}")]
    Digest {
        /// What was checked (a blob, a layer's uncompressed content).
        what: String,
        /// The digest that names it.
        expected: String,
        /// The digest of what was read.
        actual: String,
    },
    /// A digest that is not `sha256:` and 64 lowercase hex digits.
    #[error("unsupported or malformed digest {0:?} (sha256:<64 hex digits> only)")]
    BadDigest(String),
    /// A blob larger than its descriptor says, or than the pull's limit.
    #[error("blob {digest} is larger than {limit} bytes")]
    BlobTooLarge {
        /// The blob.
        digest: String,
        /// The limit it crossed.
        limit: u64,
    },
    /// The image has no linux/amd64 variant.
    #[error("no linux/amd64 image: {found}")]
    Platform {
        /// What the image offers.
        found: String,
    },
    /// A manifest, index or config that is not what the OCI or Docker
    /// formats say.
    #[error("{what}: {reason}")]
    Malformed {
        /// Which document.
        what: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A layer compressed in a way this build cannot read.
    #[error("layer {layer}: {media_type} is not supported{hint}")]
    UnsupportedLayer {
        /// The layer's digest.
        layer: String,
        /// Its media type (or the compression its bytes show).
        media_type: String,
        /// How to get support, if there is a way.
        hint: &'static str,
    },
    /// An entry of a layer that unpacking refuses (nothing of it was
    /// written).
    #[error("layer {layer}: entry {entry:?} refused: {reason}")]
    Refused {
        /// The layer's digest.
        layer: String,
        /// The entry's path in the layer.
        entry: String,
        /// Why.
        reason: Refusal,
    },
    /// A layer that crosses one of the [`crate::Limits`].
    #[error("layer {layer}: refused as a tar bomb: {limit}")]
    Bomb {
        /// The layer's digest.
        layer: String,
        /// The limit crossed.
        limit: BombLimit,
    },
    /// The image has no `/bin/sh`, which torpor's init needs.
    #[error("the image has no /bin/sh: torpor's init (/sbin/init) is a POSIX sh script")]
    NoShell,
    /// A file the template adds cannot be written where the image's tree
    /// says (a loop of symlinks, a file where a directory must be).
    #[error("template: cannot write {path}: {reason}")]
    TemplatePath {
        /// The guest path.
        path: String,
        /// Why.
        reason: Refusal,
    },
    /// `mkfs.ext4` is missing or failed.
    #[error("mkfs.ext4: {0}")]
    Mkfs(String),
    /// An I/O error, with the path or step it happened at.
    #[error("{context}: {source}")]
    Io {
        /// The path or step.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// An [`Error::Io`] at `context`.
    pub(crate) fn io(context: impl fmt::Display, source: std::io::Error) -> Error {
        Error::Io {
            context: context.to_string(),
            source,
        }
    }

    /// An [`Error::Malformed`].
    pub(crate) fn malformed(what: impl fmt::Display, reason: impl fmt::Display) -> Error {
        Error::Malformed {
            what: what.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// Why an entry of a layer was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The path has a `..` component.
    ParentComponent,
    /// The path is absolute.
    Absolute,
    /// The path (or a hard link's target) goes through a symlink whose
    /// target is absolute or climbs out of the root with `..`.
    SymlinkOutOfRoot {
        /// The symlink, as a path in the root.
        link: PathBuf,
        /// Its target.
        target: PathBuf,
    },
    /// More than 40 symlinks on the way (a loop).
    SymlinkLoop,
    /// A component on the way is neither a directory nor a symlink.
    NotADirectory {
        /// The component, as a path in the root.
        path: PathBuf,
    },
    /// A hard link whose target is outside the root (`..`, absolute).
    HardLinkOutOfRoot {
        /// The target as the layer names it.
        target: String,
    },
    /// A hard link whose target does not exist (or is a directory).
    HardLinkTarget {
        /// The target as the layer names it.
        target: String,
    },
    /// A whiteout without a name (`.wh.`).
    EmptyWhiteout,
    /// A path deeper than the unpacker walks.
    TooDeep {
        /// The limit, in components.
        max: usize,
    },
    /// An entry type this unpacker does not write.
    UnsupportedType {
        /// The tar type flag.
        flag: char,
    },
    /// The entry replaces the root directory itself with something else.
    ReplacesRoot,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::ParentComponent => write!(f, "its path has a `..` component"),
            Refusal::Absolute => write!(f, "its path is absolute"),
            Refusal::SymlinkOutOfRoot { link, target } => write!(
                f,
                "it goes through the symlink /{} -> {}, which points out of the root",
                link.display(),
                target.display()
            ),
            Refusal::SymlinkLoop => write!(f, "too many symlinks on its path (a loop?)"),
            Refusal::NotADirectory { path } => {
                write!(f, "/{} on its path is not a directory", path.display())
            }
            Refusal::HardLinkOutOfRoot { target } => {
                write!(f, "it is a hard link to {target:?}, outside the root")
            }
            Refusal::HardLinkTarget { target } => write!(
                f,
                "it is a hard link to {target:?}, which is missing or a directory"
            ),
            Refusal::EmptyWhiteout => write!(f, "a whiteout without a name"),
            Refusal::TooDeep { max } => write!(f, "its path is deeper than {max} components"),
            Refusal::UnsupportedType { flag } => {
                write!(f, "tar entry type {flag:?} is not supported")
            }
            Refusal::ReplacesRoot => write!(f, "it would replace the root directory"),
        }
    }
}

/// The [`crate::Limits`] a layer crossed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BombLimit {
    /// More entries (all layers together) than allowed.
    Entries {
        /// The limit.
        max: u64,
    },
    /// More file bytes (all layers together) than allowed.
    TotalBytes {
        /// The limit.
        max: u64,
    },
    /// One file larger than allowed.
    FileBytes {
        /// The entry.
        entry: String,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A layer that decompresses to more than its compressed size times
    /// the ratio allowed.
    Ratio {
        /// The limit.
        max: u64,
        /// The compressed size.
        compressed: u64,
        /// How much had come out when it was stopped.
        unpacked: u64,
    },
}

impl fmt::Display for BombLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BombLimit::Entries { max } => write!(f, "more than {max} entries"),
            BombLimit::TotalBytes { max } => write!(f, "more than {max} bytes of files"),
            BombLimit::FileBytes { entry, size, max } => {
                write!(f, "{entry:?} has {size} bytes, more than {max}")
            }
            BombLimit::Ratio {
                max,
                compressed,
                unpacked,
            } => write!(
                f,
                "{compressed} compressed bytes grew past {unpacked} (more than {max} times)"
            ),
        }
    }
}

/// The crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
