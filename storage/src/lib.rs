//! torpor-storage: snapshot layers in object storage (issue 29's
//! foundation; the scheduler stores hibernations and templates through
//! it: `scheduler/src/service/objects.rs`).
//!
//! A layer directory (a snapshot's `state` and `memory`, a disk's diff)
//! is uploaded as content-addressed chunks, compressed and checksummed,
//! each stored once however many layers hold it, and a small manifest per
//! layer ([`Storage::upload_layer`]). A layer is read back whole into a
//! directory, holes kept ([`Storage::download_layer`]), or at random
//! through a bounded on-disk LRU cache shared by all readers
//! ([`Storage::open_layer`], [`LayerReader::read_at`]). Manifests are
//! deleted by their owners; [`Storage::collect_garbage`] deletes the
//! chunks no manifest names, safe against uploads in progress (`gc.rs`).
//!
//! The store is a local directory (the embedded default) or an
//! S3-compatible bucket, through the `object_store` crate
//! ([`StoreConfig::parse`] reads `--object-store`). Layout and rules:
//! docs/storage.md, "Object storage: chunks and manifests".
//!
//! Everything is async on tokio; file I/O, hashing and compression run on
//! its blocking pool.

mod cache;
mod chunk;
mod config;
mod error;
mod gc;
mod id;
mod lease;
mod manifest;
mod names;
mod pause;
mod profile;
mod reader;
mod sparse;
mod store;
mod upload;

pub use cache::{CacheStats, ChunkCache};
pub use chunk::{ChunkHash, DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};
pub use config::{S3Config, StoreConfig, StoreUrl};
pub use error::{ChunkAt, ConfigError, StorageError};
pub use gc::{GcOptions, GcReport};
pub use id::{BadManifestId, ManifestId};
pub use manifest::{ChunkRun, FileEntry, Manifest, MANIFEST_VERSION};
pub use names::{is_storable_name, NameSpace, MAX_NAME};
pub use pause::{GcStage, PauseHandle, UploadStage};
pub use reader::{DownloadReport, LayerReader, LazyFile};
pub use sparse::allocated_bytes;
pub use store::{Storage, StorageOptions};
pub use upload::{UploadOptions, UploadReport};
