//! The federation's own durable state, in `DATA_DIR/federation.db` (SQLite,
//! WAL, `synchronous=FULL`, mode 0600: it holds the pods' tokens):
//!
//! - `remote_pods`: id, address (`unix:PATH` or `tcp:HOST:PORT`), token;
//! - `remote_sandboxes`: which remote pod owns a sandbox, written before the
//!   API answers the create or fork that made it;
//! - `placements`: creates and forks sent to a pod and not yet answered,
//!   each tagged on the sandbox (`torpor.placement` metadata) so that a
//!   restart after a crash can adopt what the pod made.
//!
//! Kept apart from the local pod's `torpor.db` so that the service's schema
//! and migrations know nothing of remote pods.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection};
use torpor_scheduler::model::{random_hex, PodId, SandboxId, Timestamp};

/// The database file in the data directory.
pub const FEDERATION_DB: &str = "federation.db";

#[derive(Debug, thiserror::Error)]
pub enum FederationStoreError {
    #[error("federation store: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("federation store {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, FederationStoreError>;

/// A registered remote pod as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPod {
    pub id: PodId,
    pub address: String,
    pub token: String,
    /// The pinned certificate of a `tls:` pod (`sha256:HEX`).
    pub fingerprint: Option<String>,
}

/// A create or fork sent to a pod, not yet recorded as answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub id: String,
    pub pod: PodId,
    /// The tenant the sandbox will belong to.
    pub tenant: Option<String>,
}

/// A remote sandbox's record: its pod and its tenant.
pub type Owner = (PodId, Option<String>);

#[derive(Debug)]
pub struct FederationStore {
    conn: Mutex<Connection>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS remote_pods (
    id         TEXT PRIMARY KEY,
    address    TEXT NOT NULL UNIQUE,
    token      TEXT NOT NULL,
    created_at INTEGER NOT NULL
) STRICT;
CREATE TABLE IF NOT EXISTS remote_sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    pod_id     TEXT NOT NULL REFERENCES remote_pods (id) ON DELETE CASCADE
) STRICT;
-- What a remote create gave that its pod keeps but never shows: the envd
-- access token (E2B) the federation checks, and the environment (JSON)
-- the federation's envd runs commands under.
CREATE TABLE IF NOT EXISTS remote_secrets (
    sandbox_id   TEXT PRIMARY KEY REFERENCES remote_sandboxes (sandbox_id) ON DELETE CASCADE,
    access_token TEXT,
    env          TEXT NOT NULL
) STRICT;
CREATE TABLE IF NOT EXISTS placements (
    id         TEXT PRIMARY KEY,
    pod_id     TEXT NOT NULL REFERENCES remote_pods (id) ON DELETE CASCADE,
    created_at INTEGER NOT NULL
) STRICT;
";

impl FederationStore {
    pub fn open(dir: &Path) -> Result<Self> {
        let path = dir.join(FEDERATION_DB);
        let conn = Connection::open(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(
            |source| FederationStoreError::Io {
                path: path.display().to_string(),
                source,
            },
        )?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        // Stores made before pods spoke TLS have no fingerprint column.
        let has_fingerprint: bool = conn.query_row(
            "SELECT COUNT(*) > 0 FROM pragma_table_info('remote_pods') WHERE name = 'fingerprint'",
            [],
            |r| r.get(0),
        )?;
        if !has_fingerprint {
            conn.execute_batch("ALTER TABLE remote_pods ADD COLUMN fingerprint TEXT")?;
        }
        // Tenants came later: stores made before get the column.
        for table in ["remote_sandboxes", "placements"] {
            let has: bool = conn.query_row(
                &format!("SELECT EXISTS (SELECT 1 FROM pragma_table_info('{table}') WHERE name = 'tenant')"),
                [],
                |r| r.get(0),
            )?;
            if !has {
                conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN tenant TEXT"))?;
            }
        }
        Ok(FederationStore {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock leaves SQLite consistent (every
        // change is one statement or transaction).
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn pods(&self) -> Result<Vec<StoredPod>> {
        let conn = self.conn();
        let mut st = conn.prepare(
            "SELECT id, address, token, fingerprint FROM remote_pods ORDER BY created_at",
        )?;
        let rows = st.query_map([], |r| {
            Ok(StoredPod {
                id: PodId::new(r.get::<_, String>(0)?),
                address: r.get(1)?,
                token: r.get(2)?,
                fingerprint: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }

    pub fn add_pod(&self, pod: &StoredPod) -> Result<()> {
        self.conn().execute(
            "INSERT INTO remote_pods (id, address, token, fingerprint, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                pod.id.as_str(),
                pod.address,
                pod.token,
                pod.fingerprint,
                Timestamp::now().0
            ],
        )?;
        Ok(())
    }

    /// Removes the pod with its sandboxes' and placements' records.
    pub fn remove_pod(&self, id: &PodId) -> Result<()> {
        self.conn()
            .execute("DELETE FROM remote_pods WHERE id = ?1", [id.as_str()])?;
        Ok(())
    }

    pub fn owners(&self) -> Result<Vec<(SandboxId, Owner)>> {
        let conn = self.conn();
        let mut st = conn.prepare("SELECT sandbox_id, pod_id, tenant FROM remote_sandboxes")?;
        let rows = st.query_map([], |r| {
            Ok((
                SandboxId::new(r.get::<_, String>(0)?),
                (PodId::new(r.get::<_, String>(1)?), r.get(2)?),
            ))
        })?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }

    /// Keeps what remote sandbox `id`'s pod never shows: its envd access
    /// token and its environment.
    pub fn set_secrets(
        &self,
        id: &SandboxId,
        access_token: Option<&str>,
        env: &std::collections::BTreeMap<String, String>,
    ) -> Result<()> {
        let env = serde_json::to_string(env).unwrap_or_else(|_| "{}".into());
        self.conn().execute(
            "INSERT OR REPLACE INTO remote_secrets (sandbox_id, access_token, env) \
             VALUES (?1, ?2, ?3)",
            params![id.as_str(), access_token, env],
        )?;
        Ok(())
    }

    /// Remote sandbox `id`'s envd access token and environment (none and
    /// empty when nothing was kept).
    pub fn secrets(
        &self,
        id: &SandboxId,
    ) -> Result<(Option<String>, std::collections::BTreeMap<String, String>)> {
        use rusqlite::OptionalExtension;
        let row: Option<(Option<String>, String)> = self
            .conn()
            .query_row(
                "SELECT access_token, env FROM remote_secrets WHERE sandbox_id = ?1",
                [id.as_str()],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        Ok(match row {
            Some((token, env)) => (token, serde_json::from_str(&env).unwrap_or_default()),
            None => (None, Default::default()),
        })
    }

    /// Records a placement before the request goes to the pod.
    pub fn begin_placement(&self, pod: &PodId, tenant: Option<&str>) -> Result<Placement> {
        let placement = Placement {
            id: format!("plc_{}", random_hex(8)),
            pod: pod.clone(),
            tenant: tenant.map(str::to_string),
        };
        self.conn().execute(
            "INSERT INTO placements (id, pod_id, created_at, tenant) VALUES (?1, ?2, ?3, ?4)",
            params![
                placement.id,
                pod.as_str(),
                Timestamp::now().0,
                placement.tenant
            ],
        )?;
        Ok(placement)
    }

    /// Ends a placement: the sandbox it made (if any) becomes the pod's, in
    /// the same transaction.
    pub fn end_placement(&self, placement: &str, made: Option<(&SandboxId, &PodId)>) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        if let Some((sandbox, pod)) = made {
            tx.execute(
                "INSERT OR REPLACE INTO remote_sandboxes (sandbox_id, pod_id, tenant) \
                 SELECT ?1, ?2, (SELECT tenant FROM placements WHERE id = ?3)",
                [sandbox.as_str(), pod.as_str(), placement],
            )?;
        }
        tx.execute("DELETE FROM placements WHERE id = ?1", [placement])?;
        tx.commit()?;
        Ok(())
    }

    pub fn placements(&self) -> Result<Vec<Placement>> {
        let conn = self.conn();
        let mut st =
            conn.prepare("SELECT id, pod_id, tenant FROM placements ORDER BY created_at")?;
        let rows = st.query_map([], |r| {
            Ok(Placement {
                id: r.get(0)?,
                pod: PodId::new(r.get::<_, String>(1)?),
                tenant: r.get(2)?,
            })
        })?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_become_owners_and_pods_cascade() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let store = FederationStore::open(&dir).unwrap();
        let pod = StoredPod {
            id: PodId::new("pod_a"),
            address: "unix:/tmp/a.sock".into(),
            token: "t".into(),
            fingerprint: None,
        };
        store.add_pod(&pod).unwrap();
        assert!(store.add_pod(&pod).is_err(), "same id twice");
        let p1 = store.begin_placement(&pod.id, Some("acme")).unwrap();
        let p2 = store.begin_placement(&pod.id, None).unwrap();
        assert_eq!(store.placements().unwrap().len(), 2);
        let sbx = SandboxId::new("sbx_1");
        store.end_placement(&p1.id, Some((&sbx, &pod.id))).unwrap();
        store.end_placement(&p2.id, None).unwrap();
        assert!(store.placements().unwrap().is_empty());
        assert_eq!(
            store.owners().unwrap(),
            vec![(sbx, (pod.id.clone(), Some("acme".to_string())))]
        );
        drop(store);
        let store = FederationStore::open(&dir).unwrap();
        assert_eq!(store.pods().unwrap(), vec![pod.clone()]);
        store.remove_pod(&pod.id).unwrap();
        assert!(store.owners().unwrap().is_empty());
        let mode = std::fs::metadata(dir.join(FEDERATION_DB))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
