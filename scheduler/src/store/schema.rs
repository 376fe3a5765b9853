//! Connection settings, integrity check and the schema's forward-only
//! migrations.
//!
//! `MIGRATIONS[i]` takes the schema from version `i` to `i + 1`. Migrations
//! are only ever appended, never edited: a released one has run on someone's
//! data. All pending ones run in one transaction with the version update, so
//! a crash mid-migration leaves the old version intact.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use super::{Result, StoreError};

/// Version 1: templates, pods, sandboxes (+ metadata), checkpoints, and the
/// operations journal.
const V1: &str = r#"
CREATE TABLE templates (
    id             TEXT PRIMARY KEY,
    name           TEXT NOT NULL,
    kernel         TEXT NOT NULL,
    rootfs         TEXT,
    snapshot_dir   TEXT,
    mem_mib        INTEGER NOT NULL CHECK (mem_mib > 0),
    vcpus          INTEGER NOT NULL CHECK (vcpus > 0),
    kind           TEXT NOT NULL CHECK (kind IN ('probe', 'linux')),
    state          TEXT NOT NULL
                   CHECK (state IN ('building', 'ready', 'failed', 'deleted')),
    failure_reason TEXT,
    created_at     INTEGER NOT NULL
) STRICT;
-- Names are unique among templates that are not deleted.
CREATE UNIQUE INDEX templates_live_name ON templates (name) WHERE state != 'deleted';

CREATE TABLE pods (
    id                     TEXT PRIMARY KEY,
    address                TEXT NOT NULL,
    token_hash             TEXT,
    memory_bytes           INTEGER NOT NULL CHECK (memory_bytes >= 0),
    vcpus                  INTEGER NOT NULL CHECK (vcpus >= 0),
    disk_bytes             INTEGER NOT NULL CHECK (disk_bytes >= 0),
    oversubscription_ratio REAL NOT NULL
                           CHECK (oversubscription_ratio > 0 AND oversubscription_ratio <= 100),
    high_watermark         REAL NOT NULL CHECK (high_watermark > 0 AND high_watermark <= 1),
    created_at             INTEGER NOT NULL
) STRICT;

CREATE TABLE sandboxes (
    id             TEXT PRIMARY KEY,
    template       TEXT NOT NULL REFERENCES templates (id),
    pod            TEXT REFERENCES pods (id),
    mem_mib        INTEGER NOT NULL CHECK (mem_mib > 0),
    vcpus          INTEGER NOT NULL CHECK (vcpus > 0),
    keep_alive_ms  INTEGER NOT NULL CHECK (keep_alive_ms >= 0),
    expires_at     INTEGER,
    state          TEXT NOT NULL CHECK (state IN ('creating', 'running', 'paused',
                   'hibernating', 'hibernated', 'resuming', 'deleted', 'failed')),
    failure_reason TEXT,
    created_at     INTEGER NOT NULL,
    last_active_at INTEGER NOT NULL,
    snapshot       TEXT,
    vmm_pid        INTEGER CHECK (vmm_pid > 0),
    vmm_socket     TEXT,
    generation     INTEGER NOT NULL DEFAULT 0 CHECK (generation >= 0),
    CHECK ((vmm_pid IS NULL) = (vmm_socket IS NULL))
) STRICT;
CREATE INDEX sandboxes_state ON sandboxes (state);
CREATE INDEX sandboxes_template ON sandboxes (template);
CREATE INDEX sandboxes_pod ON sandboxes (pod);

CREATE TABLE sandbox_metadata (
    sandbox TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    key     TEXT NOT NULL,
    value   TEXT NOT NULL,
    PRIMARY KEY (sandbox, key)
) STRICT, WITHOUT ROWID;
CREATE INDEX sandbox_metadata_pair ON sandbox_metadata (key, value);

CREATE TABLE checkpoints (
    id           TEXT PRIMARY KEY,
    sandbox      TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    name         TEXT NOT NULL,
    snapshot_dir TEXT NOT NULL,
    parent       TEXT REFERENCES checkpoints (id),
    created_at   INTEGER NOT NULL,
    UNIQUE (sandbox, name)
) STRICT;
CREATE INDEX checkpoints_parent ON checkpoints (parent);

-- The journal of multi-step operations. `sandbox` is deliberately not a
-- foreign key: the journal outlives purged sandboxes.
CREATE TABLE operations (
    id          TEXT PRIMARY KEY,
    sandbox     TEXT,
    kind        TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('started', 'done', 'rolled_back')),
    started_at  INTEGER NOT NULL,
    finished_at INTEGER,
    detail      TEXT NOT NULL DEFAULT '{}',
    CHECK ((state = 'started') = (finished_at IS NULL))
) STRICT;
CREATE INDEX operations_started ON operations (started_at) WHERE state = 'started';
CREATE INDEX operations_sandbox ON operations (sandbox);
"#;

/// Version 2: snapshot layers and their parents, so that layers shared by
/// sandboxes, forks and checkpoints are removed only when nothing needs
/// them any more (see `store/layers.rs`).
const V2: &str = r#"
CREATE TABLE snapshot_layers (
    dir        TEXT PRIMARY KEY,
    parent     TEXT REFERENCES snapshot_layers (dir),
    created_at INTEGER NOT NULL
) STRICT;
CREATE INDEX snapshot_layers_parent ON snapshot_layers (parent);
"#;

/// Version 3: tenants. Every sandbox and every template a tenant built
/// belongs to that tenant (`NULL`: rows made before tenants existed, and
/// shared templates such as the built-in probe, which every tenant may
/// use); a Linux template records the image it was built from by name.
const V3: &str = r#"
ALTER TABLE sandboxes ADD COLUMN tenant TEXT;
CREATE INDEX sandboxes_tenant ON sandboxes (tenant);
ALTER TABLE templates ADD COLUMN tenant TEXT;
ALTER TABLE templates ADD COLUMN image TEXT;
"#;

/// Version 4: the VMM's start time next to its pid, so that a recycled
/// pid is never signalled as the sandbox's VMM.
const V4: &str = r#"
ALTER TABLE sandboxes ADD COLUMN vmm_start INTEGER CHECK (vmm_start >= 0);
"#;

/// Version 5: what a sandbox's timeout does (`on_timeout`: delete, the
/// old behaviour and the default for existing rows, or hibernate), the
/// environment variables set for every command run in it, and the sandbox
/// a template was snapshotted from (and a sandbox's in-sandbox API access
/// token, E2B's `envdAccessToken`) (`POST /v1/sandboxes/{id}/template`; not
/// a foreign key: the template outlives it).
const V5: &str = r#"
CREATE TABLE template_sources (
    template TEXT PRIMARY KEY REFERENCES templates (id),
    sandbox  TEXT NOT NULL
) STRICT, WITHOUT ROWID;
CREATE INDEX template_sources_sandbox ON template_sources (sandbox);
ALTER TABLE sandboxes ADD COLUMN access_token TEXT;
ALTER TABLE sandboxes ADD COLUMN on_timeout TEXT NOT NULL DEFAULT 'delete'
    CHECK (on_timeout IN ('delete', 'hibernate'));
CREATE TABLE sandbox_env (
    sandbox TEXT NOT NULL REFERENCES sandboxes (id) ON DELETE CASCADE,
    key     TEXT NOT NULL,
    value   TEXT NOT NULL,
    PRIMARY KEY (sandbox, key)
) STRICT, WITHOUT ROWID;
"#;

/// Version 6: sandbox networks: each sandbox's egress policy and exposed
/// ports (JSON: `net::EgressPolicy`, `[model::ExposedPort]`), kept across
/// restarts and hibernation.
const V6: &str = r#"
CREATE TABLE sandbox_network (
    sandbox TEXT PRIMARY KEY REFERENCES sandboxes (id) ON DELETE CASCADE,
    policy  TEXT NOT NULL,
    ports   TEXT NOT NULL DEFAULT '[]'
) STRICT, WITHOUT ROWID;
"#;

/// Version 7: template names are per tenant (`crate::names`): unique
/// among the live templates of one tenant, or among the shared ones
/// (tenant `NULL`), instead of among all. Names were unique among all
/// before, so every existing row fits.
const V7: &str = r#"
DROP INDEX templates_live_name;
CREATE UNIQUE INDEX templates_live_tenant_name ON templates (ifnull(tenant, ''), name)
    WHERE state != 'deleted';
"#;

/// Version 8: filesystem-only hibernation: what a hibernation by the
/// timeout keeps (`timeout_hibernation`), whether a hibernated sandbox kept
/// only its disk (its wake boots it: `disk_only`), and whether its memory
/// was kept while its guest agent did not answer (it wakes only by a
/// reboot: `guest_unresponsive_at_pause`).
const V8: &str = r#"
ALTER TABLE sandboxes ADD COLUMN timeout_hibernation TEXT NOT NULL DEFAULT 'memory'
    CHECK (timeout_hibernation IN ('memory', 'filesystem'));
ALTER TABLE sandboxes ADD COLUMN disk_only INTEGER NOT NULL DEFAULT 0
    CHECK (disk_only IN (0, 1));
ALTER TABLE sandboxes ADD COLUMN guest_unresponsive_at_pause INTEGER NOT NULL DEFAULT 0
    CHECK (guest_unresponsive_at_pause IN (0, 1));
"#;

/// Version 9: `torpor serve`'s nested pod's sandboxes (`super::nested`):
/// their pod, tenant, envd token and environment (JSON), the pod's latest
/// answer about each (JSON) and, once their nested host is gone, why.
const V9: &str = r#"
CREATE TABLE nested_sandboxes (
    id           TEXT PRIMARY KEY,
    pod          TEXT NOT NULL,
    tenant       TEXT,
    access_token TEXT,
    env          TEXT NOT NULL DEFAULT '{}',
    last_seen    TEXT,
    lost         TEXT
) STRICT, WITHOUT ROWID;
"#;

/// Version 10: the snapshot layers in the object store (`serve
/// --object-store`): each layer directory's manifest there, which a pod
/// without the files downloads, and whether this pod uploaded it (its
/// manifest is deleted with the layer) or fetched it (`service/objects.rs`).
const V10: &str = r#"
CREATE TABLE layer_objects (
    dir       TEXT PRIMARY KEY,
    manifest  TEXT NOT NULL,
    uploaded  INTEGER NOT NULL CHECK (uploaded IN (0, 1)),
    stored_at TEXT NOT NULL
) STRICT, WITHOUT ROWID;
"#;

/// Version 11: the tenants' secrets (E2B's `/secrets`, `secrets.rs`): the
/// current version's value, never read by a route; a name unique per
/// tenant.
const V11: &str = r#"
CREATE TABLE secrets (
    id         TEXT PRIMARY KEY,
    tenant     TEXT NOT NULL,
    name       TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 128),
    version    INTEGER NOT NULL CHECK (version >= 1),
    value      TEXT NOT NULL,
    metadata   TEXT NOT NULL DEFAULT '{}',
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    UNIQUE (tenant, name)
) STRICT;
"#;

/// Version 12: the `Host` a sandbox's guest ports see (E2B's
/// `maskRequestHost`, `Sandbox::ingress_host`).
const V12: &str = r#"
ALTER TABLE sandboxes ADD COLUMN ingress_host TEXT;
"#;

/// Version 13: the volumes mounted in a sandbox (E2B's `volumeMounts`,
/// `Sandbox::volumes`), a JSON list; NULL for none.
const V13: &str = r#"
ALTER TABLE sandboxes ADD COLUMN volumes TEXT;
"#;

/// Version 14: the volumes a nested pod's sandbox mounts, as serve
/// resolved them (`NestedSandbox::volumes`), a JSON list; NULL for none.
const V14: &str = r#"
ALTER TABLE nested_sandboxes ADD COLUMN volumes TEXT;
"#;

/// Every migration, in order.
pub const MIGRATIONS: &[&str] = &[V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, V12, V13, V14];

/// The schema version this build writes.
pub const CURRENT_VERSION: i64 = MIGRATIONS.len() as i64;

/// WAL, synchronous=NORMAL (commits write the WAL; the store's group
/// commit fsyncs it, `store::sync`), foreign keys; each read back to make
/// sure it took.
pub(super) fn configure(conn: &Connection) -> Result<()> {
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Invalid {
            what: "journal mode",
            detail: format!("SQLite kept {mode:?} instead of WAL"),
        });
    }
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "foreign_keys", true)?;
    let sync: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0))?;
    let fk: i64 = conn.query_row("PRAGMA foreign_keys", [], |r| r.get(0))?;
    if sync != 1 || fk != 1 {
        return Err(StoreError::Invalid {
            what: "pragmas",
            detail: format!("synchronous={sync} foreign_keys={fk}"),
        });
    }
    Ok(())
}

/// `PRAGMA quick_check`: anything but "ok" is corruption.
pub(super) fn check_integrity(conn: &Connection) -> Result<()> {
    let mut stmt = conn.prepare("PRAGMA quick_check")?;
    let problems: Vec<String> = stmt
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    if problems.len() == 1 && problems[0] == "ok" {
        Ok(())
    } else {
        Err(StoreError::Corrupt(problems.join("; ")))
    }
}

/// The stored schema version (0 for a new database).
pub(super) fn version(conn: &Connection) -> Result<i64> {
    let exists: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version')",
        [],
        |r| r.get(0),
    )?;
    if !exists {
        return Ok(0);
    }
    let rows: i64 = conn.query_row("SELECT count(*) FROM schema_version", [], |r| r.get(0))?;
    if rows > 1 {
        return Err(StoreError::Corrupt(format!(
            "schema_version has {rows} rows"
        )));
    }
    Ok(conn
        .query_row("SELECT version FROM schema_version", [], |r| r.get(0))
        .optional()?
        .unwrap_or(0))
}

/// Applies every pending migration in one transaction; returns the version.
pub(super) fn migrate(conn: &mut Connection) -> Result<i64> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let found = version(&tx)?;
    if found > CURRENT_VERSION {
        return Err(StoreError::TooNew {
            found,
            supported: CURRENT_VERSION,
        });
    }
    if found < 0 {
        return Err(StoreError::Corrupt(format!("schema version {found}")));
    }
    if found == CURRENT_VERSION {
        return Ok(found);
    }
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL) STRICT",
    )?;
    for (from, sql) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        tracing::info!(from, to = from + 1, "migrating store schema");
        tx.execute_batch(sql)?;
    }
    tx.execute("DELETE FROM schema_version", [])?;
    tx.execute(
        "INSERT INTO schema_version (version) VALUES (?1)",
        [CURRENT_VERSION],
    )?;
    tx.commit()?;
    Ok(CURRENT_VERSION)
}
