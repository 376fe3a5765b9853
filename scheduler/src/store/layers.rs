//! Snapshot layers shared between templates, sandboxes, forks and
//! checkpoints, and the reference counting that decides when a layer's
//! files may go.
//!
//! A diff layer is only readable with every layer under it, and since
//! checkpoints and forks a layer can sit under several chains: a fork
//! restored from a checkpoint writes its hibernation diffs on the source's
//! checkpoint layer, which sits on the source's older layers and the
//! template's snapshot. `snapshot_layers` records every layer with its
//! parent. The *roots* are the snapshots the rest of the store names:
//! templates that are not deleted, sandboxes that are not deleted (the
//! snapshot their VMM runs from or will wake from) and checkpoints of
//! sandboxes that are not deleted. A layer is live while some root's chain
//! reaches it; [`Tx::collect_dead_layers`] forgets the others, in the same
//! transaction as nothing else, and returns their directories for the
//! caller to remove after the commit (a crash in between leaves directories
//! that no root reaches, which start-up's orphan sweep removes).

use std::path::{Path, PathBuf};

use rusqlite::{params, OptionalExtension};

use super::catalog::{checkpoint_from_row, CHECKPOINT_COLUMNS};
use super::sql::path_text;
use super::{Result, StoreError, Tx};
use crate::model::{Checkpoint, CheckpointId, SandboxId, TemplateId, Timestamp};

/// Whose known layers [`Tx::known_layers`] lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayerOwner {
    /// A sandbox: its snapshot, its checkpoints', its template's.
    Sandbox(SandboxId),
    /// A template: its snapshot.
    Template(TemplateId),
}

/// A layer the store knows for an owner: a root it names, or a recorded
/// layer one of its roots reaches. `parent` is the recorded parent; None
/// for a root the store has not recorded yet (its parent is unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownLayer {
    pub dir: PathBuf,
    pub parent: Option<Option<PathBuf>>,
}

/// Every layer some root reaches: the roots, then parents, recursively.
const LIVE_LAYERS: &str = "WITH RECURSIVE live(dir) AS (
        SELECT snapshot_dir FROM templates
            WHERE state != 'deleted' AND snapshot_dir IS NOT NULL
        UNION SELECT snapshot FROM sandboxes
            WHERE state != 'deleted' AND snapshot IS NOT NULL
        UNION SELECT c.snapshot_dir FROM checkpoints c
            JOIN sandboxes s ON s.id = c.sandbox WHERE s.state != 'deleted'
        UNION SELECT l.parent FROM snapshot_layers l JOIN live ON l.dir = live.dir
            WHERE l.parent IS NOT NULL
    )";

/// The roots of one sandbox (`?1`), then every recorded parent they reach.
const SANDBOX_ROOTS: &str = "SELECT snapshot FROM sandboxes WHERE id = ?1 AND snapshot IS NOT NULL
        UNION SELECT t.snapshot_dir FROM templates t JOIN sandboxes s ON s.template = t.id
            WHERE s.id = ?1 AND t.snapshot_dir IS NOT NULL
        UNION SELECT snapshot_dir FROM checkpoints WHERE sandbox = ?1";
/// The root of one template (`?1`).
const TEMPLATE_ROOTS: &str =
    "SELECT snapshot_dir FROM templates WHERE id = ?1 AND snapshot_dir IS NOT NULL";

impl Tx<'_> {
    /// Every layer the store knows for `owner`: the snapshots it names (a
    /// sandbox's own, its checkpoints', its template's) and every recorded
    /// layer under them. What a lineage a VMM reports is checked against.
    pub fn known_layers(&self, owner: &LayerOwner) -> Result<Vec<KnownLayer>> {
        let (roots, key) = match owner {
            LayerOwner::Sandbox(id) => (SANDBOX_ROOTS, id.as_str()),
            LayerOwner::Template(id) => (TEMPLATE_ROOTS, id.as_str()),
        };
        let sql = format!(
            "WITH RECURSIVE known(dir) AS ({roots}
                UNION SELECT l.parent FROM snapshot_layers l JOIN known ON l.dir = known.dir
                    WHERE l.parent IS NOT NULL
            )
            SELECT k.dir, l.dir IS NOT NULL, l.parent FROM known k
                LEFT JOIN snapshot_layers l ON l.dir = k.dir ORDER BY k.dir"
        );
        let known = self
            .conn
            .prepare_cached(&sql)?
            .query_map([key], |r| {
                let dir = PathBuf::from(r.get::<_, String>(0)?);
                let recorded: bool = r.get(1)?;
                let parent = r.get::<_, Option<String>>(2)?.map(PathBuf::from);
                Ok(KnownLayer {
                    dir,
                    parent: recorded.then_some(parent),
                })
            })?
            .collect::<rusqlite::Result<_>>()?;
        Ok(known)
    }

    /// A sandbox's checkpoint by name (`NotFound` if it has none so named).
    pub fn find_checkpoint(&self, sandbox: &SandboxId, name: &str) -> Result<Checkpoint> {
        self.conn
            .prepare_cached(&format!(
                "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE sandbox = ?1 AND name = ?2"
            ))?
            .query_row(params![sandbox, name], checkpoint_from_row)
            .optional()?
            .ok_or_else(|| StoreError::not_found("checkpoint", format!("{sandbox}/{name}")))
    }

    /// Removes a checkpoint's row. Checkpoints that named it as their parent
    /// lose the link: their layers stay readable through `snapshot_layers`,
    /// which is what keeps files, not the parent link.
    pub fn remove_checkpoint(&self, id: &CheckpointId) -> Result<()> {
        self.get_checkpoint(id)?;
        self.conn.execute(
            "UPDATE checkpoints SET parent = NULL WHERE parent = ?1",
            [id],
        )?;
        self.conn
            .execute("DELETE FROM checkpoints WHERE id = ?1", [id])?;
        Ok(())
    }

    /// Removes the checkpoints of deleted sandboxes (a delete interrupted
    /// between its two transactions leaves some); returns how many.
    pub fn remove_checkpoints_of_deleted(&self) -> Result<usize> {
        self.conn.execute(
            "UPDATE checkpoints SET parent = NULL WHERE parent IN (SELECT c.id FROM checkpoints c \
             JOIN sandboxes s ON s.id = c.sandbox WHERE s.state = 'deleted')",
            [],
        )?;
        Ok(self.conn.execute(
            "DELETE FROM checkpoints WHERE sandbox IN \
             (SELECT id FROM sandboxes WHERE state = 'deleted')",
            [],
        )?)
    }

    /// Records a chain of layers, base first: `(dir, parent)` where each
    /// parent is the previous entry's dir (or already recorded). Layers
    /// already recorded are left as they are (a layer never changes).
    pub fn register_layers(&self, chain: &[(PathBuf, Option<PathBuf>)]) -> Result<()> {
        let now = Timestamp::now();
        for (dir, parent) in chain {
            let dir = path_text(dir, "layer")?;
            let parent = parent
                .as_deref()
                .map(|p| path_text(p, "layer parent"))
                .transpose()?;
            if let Some(parent) = parent {
                if !self.layer_registered(Path::new(parent))? {
                    return Err(StoreError::Invalid {
                        what: "snapshot layer",
                        detail: format!("{dir} sits on {parent}, which is not recorded"),
                    });
                }
            }
            self.conn
                .prepare_cached(
                    "INSERT INTO snapshot_layers (dir, parent, created_at) VALUES (?1, ?2, ?3) \
                     ON CONFLICT (dir) DO NOTHING",
                )?
                .execute(params![dir, parent, now])?;
        }
        Ok(())
    }

    /// Whether `dir` is a recorded layer.
    pub fn layer_registered(&self, dir: &Path) -> Result<bool> {
        Ok(self
            .conn
            .prepare_cached("SELECT EXISTS (SELECT 1 FROM snapshot_layers WHERE dir = ?1)")?
            .query_row([path_text(dir, "layer")?], |r| r.get(0))?)
    }

    /// Every root and every recorded layer some root reaches: the layers
    /// whose files stay, as the store records them (never from a
    /// `lineage.json` a VMM wrote).
    pub fn live_layers(&self) -> Result<Vec<PathBuf>> {
        Ok(self
            .conn
            .prepare(&format!("{LIVE_LAYERS} SELECT dir FROM live ORDER BY dir"))?
            .query_map([], |r| r.get::<_, String>(0).map(PathBuf::from))?
            .collect::<rusqlite::Result<_>>()?)
    }

    /// Forgets every recorded layer no root reaches and returns their
    /// directories, whose files the caller removes after the commit.
    pub fn collect_dead_layers(&self) -> Result<Vec<PathBuf>> {
        let dead: Vec<PathBuf> = self
            .conn
            .prepare(&format!(
                "{LIVE_LAYERS} SELECT dir FROM snapshot_layers \
                 WHERE dir NOT IN (SELECT dir FROM live) ORDER BY dir"
            ))?
            .query_map([], |r| r.get::<_, String>(0).map(PathBuf::from))?
            .collect::<rusqlite::Result<_>>()?;
        // One statement: a dead layer's children are dead too, so the
        // foreign key holds once it is done.
        self.conn.execute(
            &format!(
                "{LIVE_LAYERS} DELETE FROM snapshot_layers WHERE dir NOT IN (SELECT dir FROM live)"
            ),
            [],
        )?;
        Ok(dead)
    }

    /// Records that layer `dir` is stored in the object store as
    /// `manifest` (a layer's files never change once written), uploaded by
    /// this pod or fetched (a layer this pod uploaded stays its upload when
    /// it fetches it back).
    ///
    /// A sandbox whose latest snapshot `dir` is moves to a new generation:
    /// its `stored_snapshot` changed without a state change, and a copy of
    /// its row taken before (a heartbeat read late by a cluster replica,
    /// which keeps the highest generation) must not replace the one that
    /// has it.
    pub fn record_layer_object(&self, dir: &Path, manifest: &str, uploaded: bool) -> Result<()> {
        let text = path_text(dir, "layer")?;
        self.conn
            .prepare_cached("UPDATE sandboxes SET generation = generation + 1 WHERE snapshot = ?1")?
            .execute([&text])?;
        self.conn
            .prepare_cached(
                "INSERT INTO layer_objects (dir, manifest, uploaded, stored_at) \
                 VALUES (?1, ?2, ?3, ?4) \
                 ON CONFLICT (dir) DO UPDATE SET manifest = excluded.manifest, \
                 uploaded = max(uploaded, excluded.uploaded), stored_at = excluded.stored_at",
            )?
            .execute(params![text, manifest, uploaded, Timestamp::now()])?;
        Ok(())
    }

    /// The manifest layer `dir` is stored as in the object store, if any.
    pub fn layer_object(&self, dir: &Path) -> Result<Option<String>> {
        Ok(self
            .conn
            .prepare_cached("SELECT manifest FROM layer_objects WHERE dir = ?1")?
            .query_row([path_text(dir, "layer")?], |r| r.get(0))
            .optional()?)
    }

    /// Marks the layers under `dir` (a sandbox's directory) as not this
    /// pod's uploads: their manifests stay when their files go (the
    /// sandbox moved to another pod, which uses them).
    pub fn disown_layer_objects(&self, dir: &Path) -> Result<usize> {
        let prefix = format!("{}/", path_text(dir, "layer")?);
        Ok(self.conn.execute(
            "UPDATE layer_objects SET uploaded = 0 WHERE substr(dir, 1, length(?1)) = ?1",
            [prefix],
        )?)
    }

    /// Forgets the object store's record of every layer no root reaches
    /// (the layers [`Tx::collect_dead_layers`] forgets, and roots gone
    /// that were never recorded as layers); the manifests of those this
    /// pod uploaded, which its caller deletes from the store.
    pub fn forget_dead_layer_objects(&self) -> Result<Vec<String>> {
        let uploaded: Vec<String> = self
            .conn
            .prepare(&format!(
                "{LIVE_LAYERS} SELECT manifest FROM layer_objects \
                 WHERE uploaded = 1 AND dir NOT IN (SELECT dir FROM live)"
            ))?
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        self.conn.execute(
            &format!(
                "{LIVE_LAYERS} DELETE FROM layer_objects WHERE dir NOT IN (SELECT dir FROM live)"
            ),
            [],
        )?;
        Ok(uploaded)
    }
}
