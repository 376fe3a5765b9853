//! Garbage collection: manifests are deleted by their owners; a
//! collection deletes the chunks no manifest names (mark and sweep), and
//! never one an upload in progress is about to name.
//!
//! Chunks are shared, and an upload skips the chunks the store already
//! has, so the danger is a chunk that no manifest names when a collection
//! lists it (its last layer was just deleted) while an upload has just
//! found it present and will name it. An object store has no transactions;
//! the rule here uses only what every S3-compatible store does (a write is
//! atomic and listed after it returns, objects carry the store's
//! modification time) and two kinds of marker objects, each kept fresh by
//! its holder ([`crate::lease`]):
//!
//! * an upload holds `leases/<id>` from before it looks at any chunk until
//!   after its manifest is written. Once its chunks are stored it writes
//!   the manifest it is about to publish into the lease (the *pending*
//!   manifest), then writes the lease once more: `X` is the store time of
//!   that second write, sent once the first returned (a store stamps a
//!   write before it is listed: `X` is after the pending manifest was);
//! * a collection holds `gc/<run>` from its start (store time `T0`) until
//!   it has deleted its last chunk, then marks it finished (kept
//!   `gc_record_retention`, 24 h).
//!
//! A collection: (1) lists the leases: each live lease (written within its
//! time to live) adds its pending manifest's chunks to the marked set and
//! its start to the cutoff; stale ones are removed; (2) lists the
//! manifests and marks their chunks; (3) lists the chunks and deletes
//! those unmarked whose modification time is before the cutoff:
//! `min(T0 - grace, start of the oldest live lease)`.
//!
//! An upload, once its lease holds the pending manifest, looks at the
//! collections: it waits for each one that began at or before `X` and
//! still runs (or has not yet gone stale); then, if any such collection
//! ran at all after the upload's lease began (or the upload is older than
//! the records are kept), it looks for every chunk its manifest names
//! again and stores again those that are gone (read from its files once
//! more, their hash checked). Only then is the manifest written.
//!
//! Why no chunk of a written manifest is missing: a collection that began
//! after `X` listed the leases after the pending manifest was in one, and
//! the lease was live (its holder stops before half its time to live
//! passes without a refresh, and fails the upload); so it spared every
//! chunk the manifest names, and the manifest itself is written before the
//! lease goes, so a collection that lists the leases after that lists the
//! manifest. A collection that began at or before `X` has ended (it
//! deletes nothing more) by the time the upload looks again, and anything
//! it took is stored again then. Collections do not need to exclude each
//! other or uploads: none waits for a lock, an upload only waits for
//! collections already running, and a collection never waits.
//!
//! The cutoff is not what keeps uploads safe: it keeps a chunk an upload
//! has just stored (not yet in any manifest) from being deleted by a
//! collection that saw its lease, so the check after it rarely finds
//! anything to store again; and `grace` covers what no rule foresaw.
//! Comparisons of times are inclusive on the safe side, since S3 dates
//! have one-second resolution.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use futures_util::{stream, StreamExt, TryStreamExt};

use crate::chunk::ChunkHash;
use crate::error::StorageError;
use crate::id::{unique_name, ManifestId};
use crate::lease::{Beacon, GcRecord, LeaseBody};
use crate::manifest::Manifest;
use crate::pause::{pause, GcStage, Pause, PauseHandle};
use crate::store::Storage;

/// How to collect.
#[derive(Debug, Default)]
pub struct GcOptions {
    pause: Option<(GcStage, Pause)>,
}

impl GcOptions {
    /// Options that pause the collection at `stage` until the handle
    /// resumes it (tests).
    pub fn pause_at(stage: GcStage) -> (Self, PauseHandle) {
        let (p, handle) = pause();
        (
            Self {
                pause: Some((stage, p)),
            },
            handle,
        )
    }

    async fn reached(&mut self, stage: GcStage) {
        if self.pause.as_ref().is_some_and(|(s, _)| *s == stage) {
            if let Some((_, p)) = self.pause.take() {
                p.wait().await;
            }
        }
    }
}

/// What a collection found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcReport {
    /// Its run (`gc/<run>`).
    pub run: String,
    /// Manifests read.
    pub manifests: u64,
    /// Uploads in progress whose chunks were spared.
    pub live_leases: u64,
    /// Leases of uploads that stopped, removed.
    pub stale_leases: u64,
    /// Chunks in the store.
    pub chunks: u64,
    /// Chunks a manifest or a pending one names.
    pub referenced: u64,
    /// Unreferenced chunks spared as younger than the cutoff.
    pub spared_young: u64,
    /// Chunks deleted.
    pub deleted: u64,
    /// Their stored bytes.
    pub deleted_bytes: u64,
    /// The time it took.
    pub elapsed: Duration,
}

/// A collection's record as an upload sees it.
#[derive(Debug)]
pub(crate) struct RunSeen {
    pub key: String,
    pub modified_ms: i64,
    pub record: GcRecord,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Storage {
    /// The manifest `id`.
    pub async fn manifest(&self, id: &ManifestId) -> Result<Manifest, StorageError> {
        match self.get(&id.key()).await? {
            Some(bytes) => Manifest::from_bytes(id.as_str(), &bytes),
            None => Err(StorageError::ManifestNotFound { id: id.clone() }),
        }
    }

    /// Every manifest's id.
    pub async fn list_manifests(&self) -> Result<Vec<ManifestId>, StorageError> {
        let mut ids: Vec<ManifestId> = self
            .list("manifests")
            .await?
            .iter()
            .filter_map(|m| m.key.strip_prefix("manifests/"))
            .filter_map(|id| ManifestId::parse(id).ok())
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Deletes the manifest `id` (its chunks go with the next collection
    /// unless another manifest names them); whether it was there.
    pub async fn delete_manifest(&self, id: &ManifestId) -> Result<bool, StorageError> {
        if self.head(&id.key()).await?.is_none() {
            return Ok(false);
        }
        self.delete(&id.key()).await
    }

    /// Collects garbage (see the module's doc).
    pub async fn collect_garbage(&self) -> Result<GcReport, StorageError> {
        self.collect_garbage_with(GcOptions::default()).await
    }

    /// Collects garbage with `opts`.
    pub async fn collect_garbage_with(
        &self,
        mut opts: GcOptions,
    ) -> Result<GcReport, StorageError> {
        let begun = Instant::now();
        let run = unique_name();
        let ttl = self.options().lease_ttl;
        let mut record = GcRecord::new(ttl);
        let json = |r: &GcRecord| serde_json::to_vec(r).expect("json");
        let (beacon, t0) = Beacon::start(self, format!("gc/{run}"), json(&record), ttl).await?;
        record.started_ms = Some(t0);
        let result = match beacon.write(json(&record)).await {
            Ok(_) => self.collect(&run, &beacon, t0, &mut opts).await,
            Err(e) => Err(e),
        };
        // Over either way: it deletes nothing more.
        record.finished = true;
        record.deleted = result.as_ref().map_or(0, |r| r.deleted);
        let ended = beacon.end(Some(json(&record))).await;
        let mut report = result?;
        ended?;
        self.prune_runs(t0).await?;
        report.elapsed = begun.elapsed();
        Ok(report)
    }

    async fn collect(
        &self,
        run: &str,
        beacon: &Beacon,
        t0: i64,
        opts: &mut GcOptions,
    ) -> Result<GcReport, StorageError> {
        let mut report = GcReport {
            run: run.to_string(),
            manifests: 0,
            live_leases: 0,
            stale_leases: 0,
            chunks: 0,
            referenced: 0,
            spared_young: 0,
            deleted: 0,
            deleted_bytes: 0,
            elapsed: Duration::ZERO,
        };
        let mut marked: HashSet<ChunkHash> = HashSet::new();
        let mut cutoff = t0.saturating_sub(ms(self.options().grace));

        // Uploads in progress first, then the manifests: an upload's
        // manifest is written before its lease goes.
        for lease in self.list("leases").await? {
            // The version read, with its own time (see `gc_runs`).
            let Some((bytes, lease)) = self.get_with_meta(&lease.key).await? else {
                continue;
            };
            let body: LeaseBody =
                serde_json::from_slice(&bytes).map_err(|e| StorageError::ManifestInvalid {
                    id: lease.key.clone(),
                    why: format!("an unreadable lease stops the collection: {e}"),
                })?;
            let ttl = i64::try_from(body.ttl_ms).unwrap_or(i64::MAX);
            if lease.modified_ms.saturating_add(ttl) > t0 {
                report.live_leases += 1;
                cutoff = cutoff.min(body.started_ms.unwrap_or(lease.modified_ms));
                if let Some(m) = &body.manifest {
                    marked.extend(m.chunk_set());
                }
            } else {
                tracing::info!("gc {run}: removing the stale lease {}", lease.key);
                report.stale_leases += 1;
                self.delete(&lease.key).await?;
            }
        }
        for m in self.list("manifests").await? {
            let Some(bytes) = self.get(&m.key).await? else {
                continue;
            };
            let id = m.key.strip_prefix("manifests/").unwrap_or(&m.key);
            marked.extend(Manifest::from_bytes(id, &bytes)?.chunk_set());
            report.manifests += 1;
        }
        let mut doomed = Vec::new();
        for c in self.list("chunks").await? {
            let Some(hash) = ChunkHash::from_key(&c.key) else {
                continue;
            };
            report.chunks += 1;
            if marked.contains(&hash) {
                report.referenced += 1;
            } else if c.modified_ms < cutoff {
                doomed.push(c);
            } else {
                report.spared_young += 1;
            }
        }
        opts.reached(GcStage::Marked).await;

        for batch in doomed.chunks(64) {
            if let Some((gap, limit)) = beacon.lapsed() {
                return Err(StorageError::GcStalled {
                    run: run.to_string(),
                    gap,
                    limit,
                });
            }
            let keys: Vec<String> = batch.iter().map(|c| c.key.clone()).collect();
            let _: Vec<bool> = stream::iter(keys)
                .map(|key| async move { self.delete(&key).await })
                .buffer_unordered(self.options().concurrency.max(1))
                .try_collect()
                .await?;
            report.deleted += batch.len() as u64;
            report.deleted_bytes += batch.iter().map(|c| c.size).sum::<u64>();
        }
        Ok(report)
    }

    /// The collections' records, running and finished.
    pub(crate) async fn gc_runs(&self) -> Result<Vec<RunSeen>, StorageError> {
        let mut out = Vec::new();
        for m in self.list("gc").await? {
            // The time of the version read, not the listing's: a record
            // finished between the two read with the listing's time made
            // a collection that ended after an upload began look over
            // before it (`upload_waits_for_a_running_gc_then_repairs`
            // failed one run in about 30 under load).
            let Some((bytes, m)) = self.get_with_meta(&m.key).await? else {
                continue;
            };
            // A record that does not read counts as running since ever.
            let record = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                let mut r = GcRecord::new(self.options().lease_ttl);
                r.holder = "unreadable record".into();
                r
            });
            out.push(RunSeen {
                key: m.key,
                modified_ms: m.modified_ms,
                record,
            });
        }
        Ok(out)
    }

    /// Removes the records of collections finished (or gone stale) more
    /// than `gc_record_retention` before `t0`.
    async fn prune_runs(&self, t0: i64) -> Result<(), StorageError> {
        let keep = ms(self.options().gc_record_retention);
        for r in self.gc_runs().await? {
            let ttl = if r.record.finished {
                0
            } else {
                i64::try_from(r.record.ttl_ms).unwrap_or(i64::MAX)
            };
            if r.modified_ms.saturating_add(ttl).saturating_add(keep) < t0 {
                self.delete(&r.key).await?;
            }
        }
        Ok(())
    }

    /// For an upload whose lease began at `started` (a store time) and
    /// holds its pending manifest (written just before): waits for the
    /// collections that may have listed the leases before that manifest
    /// was in its lease to end, then whether any of them ran after
    /// `started` (so its chunks must be looked for again).
    ///
    /// Which collections: those that began at or before the store time of
    /// a write sent after the pending manifest's write returned (the
    /// first touch here), not the pending write's own time. A store
    /// stamps a write before it is visible (a directory store's file
    /// takes its time when written, then is renamed into place), so a
    /// collection could begin after that stamp and still list the lease
    /// without the manifest; one that began after a write sent once the
    /// manifest was visible cannot. With the pending write's own time,
    /// `store_gc_racing_hibernations_and_cold_wakes_takes_nothing_they_need`
    /// (tests/store_service.rs) lost a chunk about one run in four.
    pub(crate) async fn collections_overlapping(
        &self,
        id: &ManifestId,
        lease: &Beacon,
        started: i64,
    ) -> Result<bool, StorageError> {
        let since = Instant::now();
        let opts = self.options();
        let mut visible = None;
        loop {
            let now = lease.touch().await?;
            let visible = *visible.get_or_insert(now);
            let runs: Vec<RunSeen> = self
                .gc_runs()
                .await?
                .into_iter()
                .filter(|r| r.record.started_ms.is_none_or(|t| t <= visible))
                .collect();
            let ttl = |r: &RunSeen| i64::try_from(r.record.ttl_ms).unwrap_or(i64::MAX);
            let running = runs
                .iter()
                .find(|r| !r.record.finished && r.modified_ms.saturating_add(ttl(r)) > now);
            match running {
                None => {
                    let overlapped = runs.iter().any(|r| {
                        let until = if r.record.finished { 0 } else { ttl(r) };
                        r.modified_ms.saturating_add(until) >= started
                    });
                    let records_kept = ms(opts.gc_record_retention) - ms(opts.lease_ttl);
                    return Ok(overlapped || now - started >= records_kept);
                }
                Some(r) if since.elapsed() > opts.gc_wait_limit => {
                    return Err(StorageError::GcBusy {
                        layer: id.clone(),
                        run: r.key.clone(),
                        waited: since.elapsed(),
                    })
                }
                Some(r) => {
                    tracing::debug!("upload {id}: waiting for {} to end", r.key);
                    tokio::time::sleep(opts.poll).await;
                }
            }
        }
    }
}
