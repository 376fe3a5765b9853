//! The durable store: SQLite in the data directory (`<data_dir>/torpor.db`).
//!
//! - WAL journal, group commit ([`sync`]): a commit is on disk (WAL
//!   fsynced) before [`Store::write`] returns, so the API may answer once a
//!   call is back; the fsync runs after the connection's lock is released
//!   and one fsync covers every commit that waited for it. The exception,
//!   [`Store::write_relaxed`], does not wait for an fsync: for what a power
//!   cut would end anyway (a running VMM's state); it survives any crash
//!   of the process at once, and a power cut from the next durable commit
//!   on.
//! - Every mutating call is one `IMMEDIATE` transaction; several calls that
//!   must land together go through [`Store::write`] with one closure (for
//!   example "sandbox → hibernating" and "journal: hibernate started").
//! - Foreign keys on; `CHECK` constraints repeat the model's invariants so a
//!   bug cannot store nonsense.
//! - `schema_version` and forward-only migrations ([`schema`]); a database
//!   written by a newer torpor is refused rather than guessed at.
//! - The `operations` journal ([`journal`]) records every multi-step
//!   operation as started, then done or rolled back: after a crash,
//!   [`Store::interrupted_operations`] lists what must be finished or undone.
//! - An exclusive `flock` on `<data_dir>/torpor.lock` keeps a second
//!   `torpor serve` off the same data directory (released by the kernel when
//!   the process dies, even by SIGKILL).
//!
//! Threads: [`Store`] is `Send + Sync` and serialises calls on one
//! connection behind a mutex. Calls are short (well under a millisecond;
//! a durable write then waits for its group's fsync, without the mutex)
//! but they block: async callers run them off the async workers.

pub mod admission;
mod catalog;
pub mod journal;
mod layers;
mod nested;
mod network;
mod sandboxes;
pub mod schema;
pub mod secrets;
mod sql;
mod sync;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use rusqlite::{Connection, ErrorCode, OpenFlags, TransactionBehavior};
use torpor_sync::Locked;

pub use journal::{OperationKind, OperationRecord, OperationStatus, StateChange};
pub use layers::{KnownLayer, LayerOwner};
pub use nested::NestedSandbox;
pub use sandboxes::SandboxFilter;
pub use secrets::{NewSecret, SecretInfo, SecretUpdate, SecretValue};

use crate::model::{
    Checkpoint, CheckpointId, OperationId, Pod, PodId, Sandbox, SandboxId, SandboxNetwork,
    Template, TemplateId, TemplateState, Timestamp, VmmHandle,
};
use crate::state::{IllegalTransition, SandboxState};

/// The database file in the data directory.
pub const DB_FILE: &str = "torpor.db";
/// The lock file in the data directory.
pub const LOCK_FILE: &str = "torpor.lock";
/// How long a statement waits for a lock held by another connection.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// Prepared statements the store keeps (rusqlite's default is 16; the
/// store runs more distinct ones than that on a create and a delete).
const STATEMENT_CACHE: usize = 256;

/// Everything the store refuses or fails at.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{kind} {id} not found")]
    NotFound { kind: &'static str, id: String },
    #[error("{kind} {id} already exists")]
    AlreadyExists { kind: &'static str, id: String },
    /// A compare-and-set found another state than the caller expected.
    #[error("sandbox {id} is {current}, not {expected}")]
    Conflict {
        id: SandboxId,
        expected: SandboxState,
        current: SandboxState,
    },
    /// The transition table does not allow the change (`from` is current).
    #[error(transparent)]
    IllegalTransition(#[from] IllegalTransition),
    #[error("template {id} is {current}")]
    TemplateConflict {
        id: TemplateId,
        current: TemplateState,
    },
    #[error("{kind} {id} is in use by {users}")]
    InUse {
        kind: &'static str,
        id: String,
        users: String,
    },
    /// Admission refused: the pod has no room for the memory asked.
    #[error(
        "pod {pod} is full: {committed_mib} MiB committed + {asked_mib} MiB asked > {limit_mib:.0} MiB \
         (ratio {ratio} x {memory_mib} MiB); hibernate sandboxes or raise the ratio"
    )]
    Full {
        pod: PodId,
        committed_mib: u64,
        asked_mib: u32,
        limit_mib: f64,
        ratio: f64,
        memory_mib: u64,
    },
    #[error("oversubscription ratio {0} is outside (0, 100]")]
    InvalidRatio(f64),
    #[error("invalid {what}: {detail}")]
    Invalid { what: &'static str, detail: String },
    #[error("sandbox {id} has no snapshot to resume from")]
    NoSnapshot { id: SandboxId },
    #[error("operation {id} is already {status}")]
    OperationFinished { id: String, status: OperationStatus },
    #[error("data directory {} is in use by another process", dir.display())]
    Locked { dir: PathBuf },
    #[error("store schema version {found} is newer than this torpor supports ({supported})")]
    TooNew { found: i64, supported: i64 },
    #[error("store is corrupt: {0}")]
    Corrupt(String),
    #[error("sqlite: {0}")]
    Sqlite(rusqlite::Error),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl From<rusqlite::Error> for StoreError {
    fn from(err: rusqlite::Error) -> Self {
        use rusqlite::Error as E;
        match &err {
            E::FromSqlConversionFailure(..)
            | E::IntegralValueOutOfRange(..)
            | E::InvalidColumnType(..)
            | E::Utf8Error(..) => StoreError::Corrupt(err.to_string()),
            E::SqliteFailure(e, _)
                if matches!(e.code, ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) =>
            {
                StoreError::Corrupt(err.to_string())
            }
            _ => StoreError::Sqlite(err),
        }
    }
}

impl StoreError {
    fn io(context: impl Into<String>, source: io::Error) -> Self {
        StoreError::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn not_found(kind: &'static str, id: impl ToString) -> Self {
        StoreError::NotFound {
            kind,
            id: id.to_string(),
        }
    }
}

/// Shorthand for store results.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// The scheduler's durable state. See the module documentation.
#[derive(Debug)]
pub struct Store {
    conn: Mutex<Connection>,
    dir: PathBuf,
    /// Write transactions committed since the store was opened.
    commits: AtomicU64,
    /// Commits without an fsync ([`Store::write_relaxed`]).
    relaxed: AtomicU64,
    /// The group commit: fsyncs outside the connection's lock.
    sync: sync::GroupSync,
    /// Tests: hooks around each group commit's fsync.
    #[cfg(test)]
    hooks: std::sync::OnceLock<Box<dyn sync::SyncHooks>>,
    /// Holds the data directory's flock for as long as the store lives.
    _lock: File,
}

/// One open transaction: every read and write of the store is a method of
/// `Tx`, run inside [`Store::write`] or [`Store::read`].
#[derive(Debug)]
pub struct Tx<'c> {
    conn: &'c Connection,
}

impl Store {
    /// Opens (creating if needed) the store in `dir`: takes the directory's
    /// lock, configures SQLite, checks integrity and migrates the schema.
    pub fn open(dir: impl AsRef<Path>) -> Result<Store> {
        let dir = dir.as_ref().to_path_buf();
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| StoreError::io(format!("creating {}", dir.display()), e))?;
        let lock = lock_dir(&dir)?;
        let db = dir.join(DB_FILE);
        let mut conn = Connection::open_with_flags(
            &db,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_CREATE
                | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        // Every statement the store runs stays prepared: past rusqlite's
        // default of 16 the cache evicted its own, and each request
        // parsed its SQL again (a sixth of the service's CPU per create
        // under `perf`).
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        schema::configure(&conn)?;
        schema::check_integrity(&conn)?;
        let version = schema::migrate(&mut conn)?;
        let sync = sync::GroupSync::new(db.clone());
        // The migrations committed under synchronous=NORMAL.
        sync.sync_all()?;
        fs::set_permissions(&db, fs::Permissions::from_mode(0o600))
            .map_err(|e| StoreError::io(format!("chmod {}", db.display()), e))?;
        crate::files::fsync_dir(&dir)
            .map_err(|e| StoreError::io(format!("fsync {}", dir.display()), e))?;
        tracing::debug!(db = %db.display(), version, "store open");
        Ok(Store {
            conn: Mutex::new(conn),
            dir,
            commits: AtomicU64::new(0),
            relaxed: AtomicU64::new(0),
            sync,
            #[cfg(test)]
            hooks: std::sync::OnceLock::new(),
            _lock: lock,
        })
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic inside a closure unwinds through the transaction's drop,
        // which rolls it back: the connection is still sound.
        self.conn.locked()
    }

    /// Runs `f` in one transaction, committed (durably) if `f` returns Ok and
    /// rolled back if it returns an error or panics. The commit is written
    /// under the connection's lock; its fsync (shared with the commits that
    /// meet it, [`sync`]) is waited for after the lock is released.
    pub fn write<T>(&self, f: impl FnOnce(&Tx<'_>) -> Result<T>) -> Result<T> {
        let (out, seq) = self.commit(f)?;
        self.durable(seq)?;
        Ok(out)
    }

    /// [`Store::write`] without waiting for the fsync: when this returns
    /// the commit is in the WAL in the OS's page cache, so any crash of
    /// this process (kill -9 included) keeps it, and the next durable
    /// commit's fsync (any [`Store::write`]; the WAL is synced in order) or
    /// checkpoint puts it on disk. Only a power cut or kernel crash before
    /// then can lose it. For state a power cut ends anyway: a running VMM's
    /// (create, wake, pause, resume, last activity) and the first steps of
    /// an operation whose last step commits durably. Never for what
    /// outlives a power cut on its own (snapshots, deletions, templates).
    pub fn write_relaxed<T>(&self, f: impl FnOnce(&Tx<'_>) -> Result<T>) -> Result<T> {
        let (out, _) = self.commit(f)?;
        self.relaxed.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }

    /// One transaction of `f`, committed under the connection's lock
    /// (`synchronous=NORMAL`: no fsync); its group commit number.
    fn commit<T>(&self, f: impl FnOnce(&Tx<'_>) -> Result<T>) -> Result<(T, u64)> {
        let mut conn = self.lock();
        self.sync.check()?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let out = f(&Tx { conn: &tx })?;
        tx.commit()?;
        self.commits.fetch_add(1, Ordering::Relaxed);
        Ok((out, self.sync.committed()))
    }

    /// Waits until commit `seq` is durable.
    fn durable(&self, seq: u64) -> Result<()> {
        #[cfg(test)]
        if let Some(h) = self.hooks.get() {
            return self.sync.wait(seq, Some((h.as_ref(), self)));
        }
        self.sync.wait(seq, None)
    }

    /// How many fsyncs the store's commits cost (a group commit's fsync
    /// covers every commit that waited for it): [`Store::commits`] less
    /// [`Store::relaxed_commits`] over this is how many commits share one.
    pub fn syncs(&self) -> u64 {
        self.sync.syncs()
    }

    /// How many of [`Store::commits`] were [`Store::write_relaxed`]'s (not
    /// fsynced when they returned).
    pub fn relaxed_commits(&self) -> u64 {
        self.relaxed.load(Ordering::Relaxed)
    }

    /// How many write transactions this store has committed since it was
    /// opened, durable or relaxed: what an operation costs. Those not
    /// counted by [`Store::relaxed_commits`] waited for an fsync of the WAL
    /// ([`Store::syncs`]).
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Runs `f` on one consistent snapshot of the store. Anything `f` writes
    /// is rolled back: use [`Store::write`] to change the store.
    pub fn read<T>(&self, f: impl FnOnce(&Tx<'_>) -> Result<T>) -> Result<T> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Deferred)?;
        let out = f(&Tx { conn: &tx })?;
        tx.rollback()?;
        Ok(out)
    }

    /// The schema version the store is at.
    pub fn schema_version(&self) -> Result<i64> {
        schema::version(&self.lock())
    }
}

/// Takes the exclusive, non-blocking flock on `<dir>/torpor.lock`.
fn lock_dir(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK_FILE);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| StoreError::io(format!("opening {}", path.display()), e))?;
    // A child this process forks elsewhere shares the lock of a store just
    // dropped until it execs (the descriptor is close-on-exec, not
    // close-on-fork): held locks are retried for a moment before `Locked`.
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
    loop {
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(file);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
            continue;
        }
        return Err(if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            StoreError::Locked {
                dir: dir.to_path_buf(),
            }
        } else {
            StoreError::io(format!("locking {}", path.display()), err)
        });
    }
}

/// The store's calls, one transaction each. Each is `self.write(|tx| tx.…)`
/// (or `read`); the documentation is on [`Tx`]'s methods of the same name.
macro_rules! delegate {
    ($($via:ident fn $name:ident(&self $(, $arg:ident: $ty:ty)*) -> $ret:ty;)+) => {
        impl Store {$(
            #[doc = concat!("One transaction of [`Tx::", stringify!($name), "`].")]
            pub fn $name(&self $(, $arg: $ty)*) -> Result<$ret> {
                self.$via(|tx| tx.$name($($arg),*))
            }
        )+}
    };
}

delegate! {
    write fn insert_template(&self, template: &Template) -> ();
    read fn get_template(&self, id: &TemplateId) -> Template;
    read fn template_candidates(&self, key: &str) -> Vec<Template>;
    read fn template_name_conflict(&self, tenant: Option<&str>, name: &str) -> Option<(&'static str, String)>;
    read fn list_templates(&self, include_deleted: bool) -> Vec<Template>;
    write fn set_template_state(&self, id: &TemplateId, state: &TemplateState) -> Template;
    write fn set_template_snapshot(&self, id: &TemplateId, dir: Option<&Path>) -> ();
    write fn delete_template(&self, id: &TemplateId) -> Template;
    write fn rename_template(&self, id: &TemplateId, name: &str) -> Template;
    write fn insert_sandbox_template(&self, template: &Template, source: &SandboxId) -> ();
    read fn sandbox_templates(&self, source: Option<&SandboxId>) -> Vec<(Template, SandboxId)>;

    write fn insert_sandbox(&self, sandbox: &Sandbox) -> ();
    read fn get_sandbox(&self, id: &SandboxId) -> Sandbox;
    read fn list_sandboxes(&self, filter: &SandboxFilter) -> Vec<Sandbox>;
    write fn update_sandbox_state(
        &self,
        id: &SandboxId,
        expected_from: SandboxState,
        to: SandboxState,
        reason: Option<&str>
    ) -> Sandbox;
    write fn touch(&self, id: &SandboxId, now: Timestamp) -> ();
    write fn set_sandbox_snapshot(&self, id: &SandboxId, dir: Option<&Path>) -> ();
    write fn set_sandbox_vmm(&self, id: &SandboxId, vmm: Option<&VmmHandle>) -> ();
    write fn set_sandbox_hibernation(&self, id: &SandboxId, disk_only: bool, guest_unresponsive: bool) -> ();
    write fn set_sandbox_pod(&self, id: &SandboxId, pod: Option<&PodId>) -> ();
    write fn set_sandbox_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: u64,
        expires_at: Option<Timestamp>
    ) -> ();
    write fn set_sandbox_metadata(&self, id: &SandboxId, metadata: &BTreeMap<String, String>) -> ();
    write fn purge_sandbox(&self, id: &SandboxId) -> ();
    read fn get_sandbox_network(&self, id: &SandboxId) -> Option<SandboxNetwork>;
    write fn set_sandbox_network(&self, id: &SandboxId, network: &SandboxNetwork) -> ();
    write fn put_nested_sandbox(&self, sandbox: &NestedSandbox) -> ();
    write_relaxed fn set_nested_last_seen(&self, id: &SandboxId, sandbox: &Sandbox) -> ();
    read fn get_nested_sandbox(&self, id: &SandboxId) -> Option<NestedSandbox>;
    read fn nested_sandboxes(&self) -> Vec<NestedSandbox>;
    write fn remove_nested_sandbox(&self, id: &SandboxId) -> ();
    write fn mark_nested_lost(&self, keep: Option<&PodId>, reason: &str) -> usize;
    read fn deleted_before(&self, cutoff: Timestamp) -> Vec<SandboxId>;

    read fn committed_mib(&self) -> u64;

    write fn insert_pod(&self, pod: &Pod) -> ();
    read fn get_pod(&self, id: &PodId) -> Pod;
    read fn list_pods(&self) -> Vec<Pod>;
    write fn set_ratio(&self, id: &PodId, ratio: f64) -> Pod;
    write fn set_high_watermark(&self, id: &PodId, watermark: f64) -> Pod;
    write fn set_pod_capacity(
        &self,
        id: &PodId,
        memory_bytes: u64,
        vcpus: u32,
        disk_bytes: u64
    ) -> Pod;
    write fn delete_pod(&self, id: &PodId) -> ();

    write fn insert_checkpoint(&self, checkpoint: &Checkpoint) -> ();
    read fn get_checkpoint(&self, id: &CheckpointId) -> Checkpoint;
    read fn list_checkpoints(&self, sandbox: &SandboxId) -> Vec<Checkpoint>;
    write fn delete_checkpoint(&self, id: &CheckpointId) -> ();
    read fn referenced_paths(&self) -> HashSet<PathBuf>;
    read fn find_checkpoint(&self, sandbox: &SandboxId, name: &str) -> Checkpoint;
    write fn remove_checkpoint(&self, id: &CheckpointId) -> ();
    write fn remove_checkpoints_of_deleted(&self) -> usize;
    write fn register_layers(&self, chain: &[(PathBuf, Option<PathBuf>)]) -> ();
    read fn layer_registered(&self, dir: &Path) -> bool;
    read fn known_layers(&self, owner: &LayerOwner) -> Vec<KnownLayer>;
    write fn collect_dead_layers(&self) -> Vec<PathBuf>;
    read fn live_layers(&self) -> Vec<PathBuf>;
    write fn record_layer_object(&self, dir: &Path, manifest: &str, uploaded: bool) -> ();
    read fn layer_object(&self, dir: &Path) -> Option<String>;
    write fn forget_dead_layer_objects(&self) -> Vec<String>;
    write fn disown_layer_objects(&self, dir: &Path) -> usize;

    write fn begin_operation(
        &self,
        sandbox: Option<&SandboxId>,
        kind: OperationKind,
        detail: &serde_json::Value,
        change: Option<&StateChange>
    ) -> OperationRecord;
    write fn finish_operation(
        &self,
        id: &OperationId,
        outcome: OperationStatus,
        detail: Option<&serde_json::Value>,
        change: Option<&StateChange>
    ) -> OperationRecord;
    read fn get_operation(&self, id: &OperationId) -> OperationRecord;
    read fn interrupted_operations(&self) -> Vec<OperationRecord>;
    write fn prune_operations(&self, finished_before: Timestamp) -> usize;
}
