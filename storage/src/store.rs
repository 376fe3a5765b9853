//! The one storage interface: [`Storage`] over an `object_store` backend,
//! a local directory or an S3-compatible bucket, with the few requests the
//! layers need (put, get, head, list, delete) and their failures as
//! [`StorageError`]s that name the store and the key.
//!
//! Object keys, under the store's directory or prefix:
//!
//! | key                          | what                                   |
//! |------------------------------|----------------------------------------|
//! | `chunks/<2 hex>/<64 hex>`    | a chunk, by the SHA-256 of its content |
//! | `manifests/<id>`             | a layer's manifest (JSON)              |
//! | `leases/<id>`                | an upload in progress                  |
//! | `gc/<run>`                   | a garbage collection, running or done  |
//! | `names/<space>/<name>`       | the manifest a name stands for (JSON)  |

use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path as Key;
use object_store::prefix::PrefixStore;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, RetryConfig};

use crate::cache::ChunkCache;
use crate::chunk::DEFAULT_CHUNK_SIZE;
use crate::config::{check_endpoint, StoreConfig};
use crate::error::StorageError;

/// Timings and limits of uploads, reads and garbage collection.
#[derive(Debug, Clone)]
pub struct StorageOptions {
    /// The chunk size of new uploads ([`DEFAULT_CHUNK_SIZE`]).
    pub chunk_size: u64,
    /// Requests in flight per upload, download or read (8).
    pub concurrency: usize,
    /// How long an upload's lease, or a collection's record, counts as
    /// live after its last refresh (60 s). Each is refreshed every quarter
    /// of it, and its holder stops when one half of it passes without a
    /// refresh that succeeded. Recorded in the lease and the run record,
    /// so the other side reads it from there.
    pub lease_ttl: Duration,
    /// Unreferenced chunks younger than this are spared by a collection
    /// (1 h): room for clock steps of the store and for what no rule here
    /// foresaw. The uploads' safety does not rest on it (`gc.rs`).
    pub grace: Duration,
    /// How long a finished collection's record is kept (24 h): an upload
    /// older than that checks every chunk it names again before its
    /// manifest is written.
    pub gc_record_retention: Duration,
    /// How often an upload looks again for a collection it waits for
    /// (500 ms).
    pub poll: Duration,
    /// How long an upload waits for running collections (10 min).
    pub gc_wait_limit: Duration,
}

impl Default for StorageOptions {
    fn default() -> Self {
        Self {
            chunk_size: DEFAULT_CHUNK_SIZE,
            concurrency: 8,
            lease_ttl: Duration::from_secs(60),
            grace: Duration::from_secs(3600),
            gc_record_retention: Duration::from_secs(24 * 3600),
            poll: Duration::from_millis(500),
            gc_wait_limit: Duration::from_secs(600),
        }
    }
}

/// An object's key and what the store says of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Meta {
    /// The key, under the store's prefix.
    pub key: String,
    /// Its last modification, the store's clock, in ms since the epoch.
    pub modified_ms: i64,
    /// Its size.
    pub size: u64,
}

impl Meta {
    fn from(m: object_store::ObjectMeta) -> Self {
        Self {
            key: m.location.to_string(),
            modified_ms: m.last_modified.timestamp_millis(),
            size: m.size,
        }
    }
}

/// An object store holding layers: cheap to clone, shared by every
/// upload, reader and collection of a process.
#[derive(Clone)]
pub struct Storage {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn ObjectStore>,
    label: String,
    options: StorageOptions,
    /// Where downloads and lazy files take their chunks from first
    /// ([`Storage::with_cache`]).
    cache: Option<Arc<ChunkCache>>,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage")
            .field("store", &self.inner.label)
            .field("options", &self.inner.options)
            .finish()
    }
}

impl Storage {
    /// Opens the store `config` names (a local directory is made if
    /// missing), with the default options.
    pub fn open(config: &StoreConfig) -> Result<Self, StorageError> {
        Self::open_with(config, StorageOptions::default())
    }

    /// Opens the store `config` names with `options`.
    pub fn open_with(config: &StoreConfig, options: StorageOptions) -> Result<Self, StorageError> {
        let label = config.to_string();
        let open_err = |source| StorageError::Open {
            store: label.clone(),
            source: Box::new(source),
        };
        let store: Arc<dyn ObjectStore> = match config {
            StoreConfig::Local { dir } => {
                std::fs::create_dir_all(dir).map_err(|e| StorageError::io(dir, e))?;
                let dir = std::fs::canonicalize(dir).map_err(|e| StorageError::io(dir, e))?;
                Arc::new(
                    LocalFileSystem::new_with_prefix(&dir)
                        .map_err(open_err)?
                        .with_automatic_cleanup(true),
                )
            }
            StoreConfig::S3(s3) => {
                if let Some(e) = &s3.endpoint {
                    check_endpoint(e, s3.allow_http)?;
                }
                // reqwest's rustls has no provider of its own here: ring,
                // as the rest of the workspace (a provider already
                // installed stays).
                let _ = rustls::crypto::ring::default_provider().install_default();
                let mut b = AmazonS3Builder::new()
                    .with_bucket_name(&s3.bucket)
                    .with_region(&s3.region)
                    .with_access_key_id(&s3.access_key_id)
                    .with_secret_access_key(&s3.secret_access_key)
                    .with_virtual_hosted_style_request(false)
                    .with_retry(RetryConfig {
                        backoff: BackoffConfig {
                            init_backoff: Duration::from_millis(100),
                            max_backoff: Duration::from_secs(2),
                            base: 2.0,
                        },
                        max_retries: 4,
                        retry_timeout: Duration::from_secs(20),
                    })
                    .with_client_options(
                        ClientOptions::new()
                            .with_connect_timeout(Duration::from_secs(5))
                            .with_timeout(Duration::from_secs(60)),
                    );
                if let Some(t) = &s3.session_token {
                    b = b.with_token(t);
                }
                if let Some(e) = &s3.endpoint {
                    b = b
                        .with_endpoint(e.trim_end_matches('/'))
                        .with_allow_http(e.starts_with("http://"));
                }
                let s3_store = b.build().map_err(open_err)?;
                if s3.prefix.is_empty() {
                    Arc::new(s3_store)
                } else {
                    Arc::new(PrefixStore::new(s3_store, s3.prefix.as_str()))
                }
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                label,
                options,
                cache: None,
            }),
        })
    }

    /// The same store with other options.
    pub fn with_options(&self, options: StorageOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                store: self.inner.store.clone(),
                label: self.inner.label.clone(),
                options,
                cache: self.inner.cache.clone(),
            }),
        }
    }

    /// The same store whose layer downloads and lazy files
    /// ([`Storage::download_layer`], [`crate::LazyFile`]) read their chunks
    /// through `cache`: a chunk another layer brought to this host is not
    /// fetched again (a pod's sandboxes of one template share most).
    pub fn with_cache(&self, cache: Arc<ChunkCache>) -> Self {
        Self {
            inner: Arc::new(Inner {
                store: self.inner.store.clone(),
                label: self.inner.label.clone(),
                options: self.inner.options.clone(),
                cache: Some(cache),
            }),
        }
    }

    /// The chunk cache downloads go through, if any.
    pub fn cache(&self) -> Option<&Arc<ChunkCache>> {
        self.inner.cache.as_ref()
    }

    /// The store, as its configuration prints.
    pub fn describe(&self) -> &str {
        &self.inner.label
    }

    /// The options.
    pub fn options(&self) -> &StorageOptions {
        &self.inner.options
    }

    /// The `object_store` underneath, keys as in the module's table (tests
    /// and tools reach objects through it).
    pub fn object_store(&self) -> Arc<dyn ObjectStore> {
        self.inner.store.clone()
    }

    fn err(&self, op: &'static str, key: &str, source: object_store::Error) -> StorageError {
        StorageError::Store {
            store: self.inner.label.clone(),
            op,
            key: key.to_string(),
            source: Box::new(source),
        }
    }

    /// Stores `bytes` at `key` (replacing what is there).
    pub(crate) async fn put(&self, key: &str, bytes: Vec<u8>) -> Result<(), StorageError> {
        self.inner
            .store
            .put(&Key::from(key), bytes.into())
            .await
            .map(drop)
            .map_err(|e| self.err("put", key, e))
    }

    /// The object at `key`, `None` if there is none.
    pub(crate) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        Ok(self.get_with_meta(key).await?.map(|(bytes, _)| bytes))
    }

    /// The object at `key` and what the store says of that version of it
    /// (its modification time is the one of these bytes: a listing's may
    /// be of the version before, were the object written in between),
    /// `None` if there is none.
    pub(crate) async fn get_with_meta(
        &self,
        key: &str,
    ) -> Result<Option<(Vec<u8>, Meta)>, StorageError> {
        let got = match self.inner.store.get(&Key::from(key)).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.err("get", key, e)),
        };
        let meta = Meta::from(got.meta.clone());
        match got.bytes().await {
            Ok(b) => Ok(Some((b.to_vec(), meta))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("get", key, e)),
        }
    }

    /// What the store says of `key`, `None` if there is no such object.
    pub(crate) async fn head(&self, key: &str) -> Result<Option<Meta>, StorageError> {
        match self.inner.store.head(&Key::from(key)).await {
            Ok(m) => Ok(Some(Meta::from(m))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("head", key, e)),
        }
    }

    /// Every object under `prefix` (a directory of keys: `chunks`).
    pub(crate) async fn list(&self, prefix: &str) -> Result<Vec<Meta>, StorageError> {
        self.inner
            .store
            .list(Some(&Key::from(prefix)))
            .map_ok(Meta::from)
            .try_collect()
            .await
            .map_err(|e| self.err("list", prefix, e))
    }

    /// Deletes `key`; whether it was there (as far as the store tells:
    /// S3 answers a delete of nothing as a success).
    pub(crate) async fn delete(&self, key: &str) -> Result<bool, StorageError> {
        match self.inner.store.delete(&Key::from(key)).await {
            Ok(()) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.err("delete", key, e)),
        }
    }

    /// Stores `bytes` at `key` and returns the object's modification time:
    /// the store's clock at the write, in ms, which every time compared
    /// across pods here is read from.
    pub(crate) async fn stamp(&self, key: &str, bytes: Vec<u8>) -> Result<i64, StorageError> {
        self.put(key, bytes).await?;
        match self.head(key).await? {
            Some(m) => Ok(m.modified_ms),
            None => Err(self.err(
                "head",
                key,
                object_store::Error::NotFound {
                    path: key.to_string(),
                    source: "gone right after it was written".into(),
                },
            )),
        }
    }
}
