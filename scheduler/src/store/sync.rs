//! Group commit: the fsync that makes commits durable runs outside the
//! store's connection lock, and one fsync covers every commit written
//! before it started.
//!
//! The connection runs `synchronous=NORMAL`: a commit writes its WAL frames
//! (into the OS's page cache) and returns without an fsync. Each commit
//! takes a sequence number under the connection's lock, after its frames
//! are written. A caller that needs its commit durable waits here until an
//! fsync that started after its number was taken has finished: the first
//! waiter becomes the leader, reads the highest number written so far,
//! fsyncs the WAL with no lock held, and wakes everyone its fsync covered;
//! commits that arrive meanwhile wait for the next leader, whose one fsync
//! covers them all. So a delete's fsync no longer holds creates off the
//! connection, and N commits that meet cost one fsync, not N.
//!
//! `fdatasync` of the WAL is what `synchronous=FULL` does at each commit
//! (the frames, and the file's size); SQLite's checkpoints under NORMAL
//! still sync the WAL before copying it and the database after. The WAL is
//! reopened if its inode changed (it never does while the store's one
//! connection is open, but a stale descriptor would sync nothing). A failed
//! fsync fails every write from then on (the kernel may have dropped the
//! pages it could not write: retrying would report a loss as success).
//!
//! What a reader sees: a commit is visible to the store's other calls as
//! soon as it is written, before its fsync ends. A power cut inside that
//! fsync (a millisecond or so) can undo what such a read answered; no
//! write acknowledged to its caller is undone, and a later write's
//! durability implies every earlier one's (the WAL is synced in order).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use torpor_sync::{Locked, Waited};

use super::{Result, Store, StoreError};

/// The group commit's state; see the module documentation.
#[derive(Debug)]
pub(super) struct GroupSync {
    /// The WAL (`<db>-wal`) and, when it is missing, the database.
    wal: PathBuf,
    db: PathBuf,
    /// The sequence number of the last commit written: bumped under the
    /// connection's lock once its frames are in the WAL.
    written: AtomicU64,
    state: Mutex<SyncState>,
    done: Condvar,
    /// The WAL's descriptor, used by the leader alone.
    file: Mutex<Option<(File, u64, u64)>>,
    /// fsyncs made (each covering one or more commits).
    syncs: AtomicU64,
}

#[derive(Debug, Default)]
struct SyncState {
    /// Every commit up to this number is durable.
    synced: u64,
    /// A leader is fsyncing.
    syncing: bool,
    /// An fsync failed: nothing written since can be called durable.
    failed: Option<String>,
}

impl GroupSync {
    pub(super) fn new(db: PathBuf) -> Self {
        let mut wal = db.clone().into_os_string();
        wal.push("-wal");
        Self {
            wal: wal.into(),
            db,
            written: AtomicU64::new(0),
            state: Mutex::new(SyncState::default()),
            done: Condvar::new(),
            file: Mutex::new(None),
            syncs: AtomicU64::new(0),
        }
    }

    /// Refuses writes once an fsync failed.
    pub(super) fn check(&self) -> Result<()> {
        match &self.state.locked().failed {
            Some(e) => Err(failed(e)),
            None => Ok(()),
        }
    }

    /// Takes the next sequence number: call under the connection's lock,
    /// right after a commit.
    pub(super) fn committed(&self) -> u64 {
        self.written.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// How many fsyncs the store made.
    pub(super) fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Returns once commit `seq` is durable: led by this caller, or by
    /// another whose fsync covered it. `before` runs in the leader just
    /// before it reads how far its fsync reaches (tests take their power
    /// cut images there); `after` once the fsync succeeded.
    pub(super) fn wait(&self, seq: u64, hooks: Option<(&dyn SyncHooks, &Store)>) -> Result<()> {
        let mut st = self.state.locked();
        loop {
            if let Some(e) = &st.failed {
                return Err(failed(e));
            }
            if st.synced >= seq {
                return Ok(());
            }
            if st.syncing {
                st = self.done.wait_locked(st);
                continue;
            }
            st.syncing = true;
            drop(st);
            let target = match hooks {
                Some((h, store)) => h.before(store, &|| self.written.load(Ordering::SeqCst)),
                None => self.written.load(Ordering::SeqCst),
            };
            let synced = self.fsync();
            if let (Ok(()), Some((h, _))) = (&synced, hooks) {
                h.after(target);
            }
            st = self.state.locked();
            st.syncing = false;
            match synced {
                Ok(()) => st.synced = st.synced.max(target),
                Err(e) => {
                    tracing::error!("store: fsync failed, refusing writes from now on: {e}");
                    st.failed = Some(e.to_string());
                }
            }
            self.done.notify_all();
        }
    }

    /// Makes every commit written so far durable (the store's open, after
    /// its migrations).
    pub(super) fn sync_all(&self) -> Result<()> {
        let seq = self.written.load(Ordering::SeqCst);
        if seq == 0 {
            self.fsync()
        } else {
            self.wait(seq, None)
        }
    }

    fn fsync(&self) -> Result<()> {
        let mut file = self.file.locked();
        let io = |what: &str, e: std::io::Error| StoreError::io(format!("{what}: fsync"), e);
        let path = if self.wal.exists() {
            &self.wal
        } else {
            &self.db
        };
        let meta = std::fs::metadata(path).map_err(|e| io(&path.display().to_string(), e))?;
        let same = file
            .as_ref()
            .is_some_and(|(_, dev, ino)| (*dev, *ino) == (meta.dev(), meta.ino()));
        if !same {
            let f = File::open(path).map_err(|e| io(&path.display().to_string(), e))?;
            *file = Some((f, meta.dev(), meta.ino()));
        }
        let (f, _, _) = file.as_ref().expect("opened above");
        f.sync_data()
            .map_err(|e| io(&path.display().to_string(), e))?;
        self.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn failed(e: &str) -> StoreError {
    StoreError::io(
        "an earlier fsync of the store failed; restart the service",
        std::io::Error::other(e.to_string()),
    )
}

/// Test hooks around a leader's fsync (power cut images, a slow disk).
pub(super) trait SyncHooks: Send + Sync + std::fmt::Debug {
    /// Runs before the fsync: returns how far it reaches (`written()`),
    /// read while the hook holds whatever it needs (`store`'s lock).
    fn before(&self, store: &Store, written: &dyn Fn() -> u64) -> u64;
    /// Runs once the fsync that reached `target` succeeded.
    fn after(&self, target: u64);
}
