//! The crate's errors: one enum, [`StorageError`], whose every variant
//! names what it is about (the object key, the layer, the file and the
//! chunk index, the local path), and [`ConfigError`] for a store's
//! configuration (the `--object-store` URL and its environment).

use std::path::PathBuf;
use std::time::Duration;

use crate::chunk::ChunkHash;
use crate::id::ManifestId;

/// Where a chunk belongs: which layer, which of its files, which chunk of
/// that file. Every error about a chunk's content names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkAt {
    /// The layer's manifest.
    pub layer: ManifestId,
    /// The file's path inside the layer.
    pub file: String,
    /// The chunk's index in that file (its offset over the chunk size).
    pub index: u64,
    /// The chunk's content address.
    pub hash: ChunkHash,
}

impl std::fmt::Display for ChunkAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "layer {}, file {}, chunk {} ({})",
            self.layer, self.file, self.index, self.hash
        )
    }
}

/// A store's configuration that cannot be used: the URL or the
/// environment it reads.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// An empty `--object-store`.
    #[error("empty object store URL: give a directory, file:///path or s3://bucket/prefix")]
    Empty,
    /// A scheme other than `file` and `s3`.
    #[error("object store {url:?}: unsupported scheme {scheme:?} (file:///path, a directory, or s3://bucket/prefix)")]
    UnsupportedScheme {
        /// The URL as given.
        url: String,
        /// Its scheme.
        scheme: String,
    },
    /// `file://host/...`: only local paths.
    #[error("object store {url:?}: a file URL names no host (file:///absolute/path)")]
    FileUrlHost {
        /// The URL as given.
        url: String,
    },
    /// `file:relative` or `file:///` alone.
    #[error("object store {url:?}: a file URL needs an absolute path (file:///absolute/path)")]
    FileUrlPath {
        /// The URL as given.
        url: String,
    },
    /// `s3://` without a bucket.
    #[error("object store {url:?}: no bucket (s3://bucket/prefix)")]
    MissingBucket {
        /// The URL as given.
        url: String,
    },
    /// A bucket name S3 would refuse.
    #[error("object store {url:?}: bad bucket name {bucket:?}: {why}")]
    BadBucket {
        /// The URL as given.
        url: String,
        /// The bucket as given.
        bucket: String,
        /// The rule it breaks.
        why: &'static str,
    },
    /// A prefix with empty, `.` or `..` segments, or characters keys may
    /// not hold.
    #[error("object store {url:?}: bad prefix {prefix:?}: {why}")]
    BadPrefix {
        /// The URL as given.
        url: String,
        /// The prefix as given.
        prefix: String,
        /// The rule it breaks.
        why: &'static str,
    },
    /// A URL with a query or a fragment, which nothing here reads.
    #[error("object store {url:?}: no query or fragment is read; give the endpoint and credentials in the environment")]
    QueryOrFragment {
        /// The URL as given.
        url: String,
    },
    /// An S3 store without its keys.
    #[error("object store {url:?}: {var} is not set (the S3 store's access key id and secret key come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the AWS_PROFILE's section of ~/.aws/credentials)")]
    MissingCredentials {
        /// The URL as given.
        url: String,
        /// The variable missing.
        var: &'static str,
    },
    /// `AWS_PROFILE` names a profile neither shared file has.
    #[error("AWS_PROFILE {profile:?} is in neither the credentials nor the config file (~/.aws/credentials, ~/.aws/config, or AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE)")]
    MissingProfile {
        /// The profile's name.
        profile: String,
    },
    /// A shared credentials or config file that cannot be read.
    #[error("AWS profile file {path:?}: {why}")]
    ProfileFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// An endpoint that is not an `http(s)://host[:port]` URL.
    #[error("object store endpoint {endpoint:?}: {why}")]
    BadEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A plain-HTTP endpoint off loopback without `AWS_ALLOW_HTTP=true`.
    #[error("object store endpoint {endpoint:?} is plain HTTP off loopback: use https, or set AWS_ALLOW_HTTP=true to send keys and data in the clear")]
    InsecureEndpoint {
        /// The endpoint as given.
        endpoint: String,
    },
    /// A boolean variable that is neither true nor false.
    #[error("{var}={value:?}: expected true or false")]
    BadBool {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
}

/// What went wrong with the object store, a layer or the chunk cache.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The store's configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The store could not be opened (the local directory, the S3 client).
    #[error("object store {store}: cannot open: {source}")]
    Open {
        /// The store, as [`crate::StoreConfig`] prints it.
        store: String,
        /// Why.
        #[source]
        source: Box<object_store::Error>,
    },
    /// A request to the store failed (after its retries).
    #[error("object store {store}: {op} {key}: {source}")]
    Store {
        /// The store.
        store: String,
        /// The request: get, put, head, list, delete.
        op: &'static str,
        /// The object key (or prefix), under the store's prefix.
        key: String,
        /// Why.
        #[source]
        source: Box<object_store::Error>,
    },
    /// A local file or directory.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A layer directory holds something that is not a regular file or a
    /// directory (a symbolic link, a socket), or a name that is not UTF-8.
    #[error("layer {}: {why}", path.display())]
    UnsupportedEntry {
        /// The entry.
        path: PathBuf,
        /// What it is.
        why: &'static str,
    },
    /// No manifest of that id in the store.
    #[error("layer {id}: no such manifest")]
    ManifestNotFound {
        /// The manifest.
        id: ManifestId,
    },
    /// A manifest id that is not one (it becomes an object key).
    #[error(transparent)]
    BadManifestId(#[from] crate::id::BadManifestId),
    /// A manifest that does not decode or does not hold together.
    #[error("layer {id}: invalid manifest: {why}")]
    ManifestInvalid {
        /// The manifest.
        id: String,
        /// What is wrong.
        why: String,
    },
    /// A name for a layer that cannot be one (it becomes an object key).
    #[error(
        "bad name {name:?}: 1 to 100 of A-Z, a-z, 0-9, `.`, `_` and `-`, not starting with `.`"
    )]
    BadName {
        /// The name as given (cut short).
        name: String,
    },
    /// A name's object that does not decode.
    #[error("{key}: invalid name object: {why}")]
    NameInvalid {
        /// Its key.
        key: String,
        /// What is wrong.
        why: String,
    },
    /// A chunk a manifest names is not in the store.
    #[error("{at}: missing from the object store")]
    ChunkMissing {
        /// The chunk.
        at: Box<ChunkAt>,
    },
    /// A chunk whose bytes do not check: its CRC, its codec, its length
    /// or its SHA-256 against its key.
    #[error("{at}: corrupt in the object store: {why}")]
    ChunkCorrupt {
        /// The chunk.
        at: Box<ChunkAt>,
        /// Which check failed.
        why: String,
    },
    /// A read of a file the layer does not have.
    #[error("layer {layer}: no file {file:?}")]
    NoSuchFile {
        /// The layer.
        layer: ManifestId,
        /// The file asked for.
        file: String,
    },
    /// A local copy of a layer's file that is not what its manifest says
    /// (a lazy fetch resumed over a file of another length).
    #[error("{}: {why}", path.display())]
    LocalMismatch {
        /// The local file.
        path: PathBuf,
        /// How it differs.
        why: String,
    },
    /// A read past a file's end.
    #[error("layer {layer}, file {file}: read of {len} bytes at {offset} passes its end ({file_len} bytes)")]
    OutOfRange {
        /// The layer.
        layer: ManifestId,
        /// The file.
        file: String,
        /// The read's offset.
        offset: u64,
        /// The read's length.
        len: u64,
        /// The file's length.
        file_len: u64,
    },
    /// A file changed while its layer was uploaded: a chunk read again
    /// (to store it once more after a garbage collection) has another hash.
    #[error("{}: chunk {index} changed during the upload", path.display())]
    FileChanged {
        /// The file.
        path: PathBuf,
        /// The chunk.
        index: u64,
    },
    /// An upload's lease could not be kept fresh: a garbage collection may
    /// have taken the upload for dead, so no manifest is written.
    #[error("upload of layer {layer}: its lease was not refreshed for {gap:?} (the limit is {limit:?}); no manifest written")]
    LeaseLost {
        /// The layer being uploaded.
        layer: ManifestId,
        /// The time since the last refresh that succeeded.
        gap: Duration,
        /// The most a refresh may lag.
        limit: Duration,
    },
    /// A garbage collection could not keep its run record fresh: it stops
    /// deleting (an upload may already count it as ended).
    #[error("garbage collection {run}: its record was not refreshed for {gap:?} (the limit is {limit:?}); stopped before deleting more")]
    GcStalled {
        /// The run.
        run: String,
        /// The time since the last refresh that succeeded.
        gap: Duration,
        /// The most a refresh may lag.
        limit: Duration,
    },
    /// An upload waited too long for garbage collections to end.
    #[error("upload of layer {layer}: garbage collection {run} still runs after {waited:?}")]
    GcBusy {
        /// The layer being uploaded.
        layer: ManifestId,
        /// The run it waits for.
        run: String,
        /// How long it waited.
        waited: Duration,
    },
    /// A cache whose limit cannot hold one chunk.
    #[error("chunk cache {}: a limit of {limit} bytes holds no chunk", dir.display())]
    CacheTooSmall {
        /// The cache's directory.
        dir: PathBuf,
        /// Its limit.
        limit: u64,
    },
    /// A blocking task (file I/O, hashing, compression) panicked.
    #[error("a blocking task failed: {0}")]
    Task(String),
}

impl StorageError {
    /// An I/O error on `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// A blocking closure's result on tokio's blocking pool, its panic as
/// [`StorageError::Task`].
pub(crate) async fn blocking<T, F>(f: F) -> Result<T, StorageError>
where
    F: FnOnce() -> Result<T, StorageError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StorageError::Task(e.to_string()))?
}
