//! Leases and run records: an object an upload (`leases/<id>`) or a
//! garbage collection (`gc/<run>`) keeps fresh while it works, by writing
//! it again every quarter of its time to live. Its modification time, the
//! store's clock, says it is alive; its body says since when and, for an
//! upload, the manifest it is about to write once its chunks are known.
//!
//! A holder stops (its upload fails, its collection stops deleting) as
//! soon as half its time to live passes without a write that succeeded:
//! whoever reads the object within its time to live of its last write is
//! then right to count it alive. Writes are serialised: once a new body is
//! written, no older one is still on its way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Mutex as AsyncMutex};
use torpor_sync::Locked;

use crate::error::StorageError;
use crate::manifest::Manifest;
use crate::store::Storage;

/// The lease and record format.
const VERSION: u32 = 1;

/// An upload's lease: `leases/<manifest id>`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct LeaseBody {
    pub version: u32,
    /// The store's clock at its first write (unknown in that first write).
    pub started_ms: Option<i64>,
    /// Its time to live.
    pub ttl_ms: u64,
    /// Who holds it: host and process, for an operator reading the bucket.
    pub holder: String,
    /// The manifest the upload will write, once its chunks are stored: a
    /// collection spares every chunk it names.
    pub manifest: Option<Manifest>,
}

/// A garbage collection's record: `gc/<run>`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct GcRecord {
    pub version: u32,
    /// The store's clock when it began (unknown in its first write).
    pub started_ms: Option<i64>,
    /// Its time to live while it runs.
    pub ttl_ms: u64,
    /// Who runs it.
    pub holder: String,
    /// Whether it is over (it deletes nothing more).
    pub finished: bool,
    /// The chunks it deleted, once finished.
    pub deleted: u64,
}

impl LeaseBody {
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            version: VERSION,
            started_ms: None,
            ttl_ms: ttl.as_millis() as u64,
            holder: holder(),
            manifest: None,
        }
    }
}

impl GcRecord {
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            version: VERSION,
            started_ms: None,
            ttl_ms: ttl.as_millis() as u64,
            holder: holder(),
            finished: false,
            deleted: 0,
        }
    }
}

/// This host's name and this process.
fn holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}:{}", host.trim(), std::process::id())
}

/// How fresh a beacon's object was kept, by this side's clock. A write
/// counts from when it was sent (the object's time is no earlier) until
/// the next write that succeeded returned, so `worst` bounds how old the
/// newest object anyone could have read was at any moment.
#[derive(Debug)]
struct Freshness {
    last_sent: Instant,
    worst: Duration,
}

impl Freshness {
    /// A write sent at `sent` succeeded (now).
    fn written(&mut self, sent: Instant) {
        self.worst = self.worst.max(self.last_sent.elapsed());
        self.last_sent = self.last_sent.max(sent);
    }

    fn worst_until_now(&self) -> Duration {
        self.worst.max(self.last_sent.elapsed())
    }
}

/// An object kept fresh in the background until [`Beacon::end`].
#[derive(Debug)]
pub(crate) struct Beacon {
    storage: Storage,
    key: String,
    ttl: Duration,
    /// The body, locked across each write so writes never cross.
    body: Arc<AsyncMutex<Vec<u8>>>,
    /// How fresh the object was kept.
    fresh: Arc<std::sync::Mutex<Freshness>>,
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Beacon {
    /// Writes `body` at `key` and keeps writing it every `ttl / 4`; the
    /// store's time of that first write.
    pub(crate) async fn start(
        storage: &Storage,
        key: String,
        body: Vec<u8>,
        ttl: Duration,
    ) -> Result<(Self, i64), StorageError> {
        let sent = Instant::now();
        let stamp = storage.stamp(&key, body.clone()).await?;
        let body = Arc::new(AsyncMutex::new(body));
        let fresh = Arc::new(std::sync::Mutex::new(Freshness {
            last_sent: sent,
            worst: Duration::ZERO,
        }));
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn({
            let (storage, key, body, fresh) =
                (storage.clone(), key.clone(), body.clone(), fresh.clone());
            async move {
                let period = ttl / 4;
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep(period) => {}
                        _ = stopped.changed() => return,
                    }
                    let body = body.lock().await;
                    let sent = Instant::now();
                    match storage.put(&key, body.clone()).await {
                        Ok(()) => fresh.locked().written(sent),
                        Err(e) => tracing::warn!("refreshing {key}: {e}"),
                    }
                }
            }
        });
        Ok((
            Self {
                storage: storage.clone(),
                key,
                ttl,
                body,
                fresh,
                stop,
                task: Some(task),
            },
            stamp,
        ))
    }

    /// Writes `body` now (and in every refresh after); the store's time of
    /// the write.
    pub(crate) async fn write(&self, body: Vec<u8>) -> Result<i64, StorageError> {
        let mut current = self.body.lock().await;
        *current = body.clone();
        let sent = Instant::now();
        self.storage.put(&self.key, body).await?;
        self.fresh.locked().written(sent);
        match self.storage.head(&self.key).await? {
            Some(m) => Ok(m.modified_ms),
            None => Err(StorageError::Task(format!("{} vanished", self.key))),
        }
    }

    /// Writes the current body again: the store's time now.
    pub(crate) async fn touch(&self) -> Result<i64, StorageError> {
        let body = self.body.lock().await.clone();
        self.write(body).await
    }

    /// The longest the object went without a write, now included, if that
    /// passed the holder's limit (half the time to live): the gap and the
    /// limit.
    pub(crate) fn lapsed(&self) -> Option<(Duration, Duration)> {
        let gap = self.fresh.locked().worst_until_now();
        let limit = self.ttl / 2;
        (gap > limit).then_some((gap, limit))
    }

    /// Stops refreshing (waiting for a write on its way), then writes
    /// `last` as the object's final body, or deletes it when `None`.
    pub(crate) async fn end(mut self, last: Option<Vec<u8>>) -> Result<(), StorageError> {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        match last {
            Some(body) => self.storage.put(&self.key, body).await,
            None => self.storage.delete(&self.key).await.map(drop),
        }
    }
}

impl Drop for Beacon {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_gap_is_remembered() {
        let mut f = Freshness {
            last_sent: Instant::now(),
            worst: Duration::ZERO,
        };
        std::thread::sleep(Duration::from_millis(30));
        f.written(Instant::now());
        assert!(f.worst >= Duration::from_millis(30), "{f:?}");
        let worst = f.worst;
        // Quick writes after a slow one do not hide it.
        f.written(Instant::now());
        f.written(Instant::now());
        assert!(f.worst_until_now() >= worst);
        assert!(f.last_sent.elapsed() < Duration::from_millis(30));
    }
}
