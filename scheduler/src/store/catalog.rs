//! Templates, pods and checkpoints, and the set of snapshot paths the store
//! references.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use rusqlite::{params, OptionalExtension, Row};

use super::sql::{get_path, get_u64, opt_path_text, path_text, u64_sql};
use super::{Result, StoreError, Tx};
use crate::model::{
    Checkpoint, CheckpointId, Pod, PodAddress, PodId, SandboxId, Template, TemplateId,
    TemplateState, MAX_OVERSUBSCRIPTION_RATIO,
};
use crate::state::SandboxState;

const TEMPLATE_COLUMNS: &str = "id, name, kernel, rootfs, snapshot_dir, mem_mib, vcpus, kind, \
    state, failure_reason, created_at, tenant, image";
/// What a template is read with: its columns and the sandbox it was
/// snapshotted from, if any.
const TEMPLATE_SELECT: &str = "id, name, kernel, rootfs, snapshot_dir, mem_mib, vcpus, kind, \
    state, failure_reason, created_at, tenant, image, \
    (SELECT sandbox FROM template_sources WHERE template_sources.template = templates.id) AS source, \
    (SELECT manifest FROM layer_objects WHERE layer_objects.dir = snapshot_dir) AS stored_snapshot";
const POD_COLUMNS: &str = "id, address, token_hash, memory_bytes, vcpus, disk_bytes, \
    oversubscription_ratio, high_watermark, created_at";
pub(super) const CHECKPOINT_COLUMNS: &str = "id, sandbox, name, snapshot_dir, parent, created_at";

fn corrupt(
    col: &str,
    row: &Row<'_>,
    e: impl std::error::Error + Send + Sync + 'static,
) -> rusqlite::Error {
    let idx = row.as_ref().column_index(col).unwrap_or(0);
    rusqlite::Error::FromSqlConversionFailure(idx, rusqlite::types::Type::Text, Box::new(e))
}

fn template_from_row(row: &Row<'_>) -> rusqlite::Result<Template> {
    let state: String = row.get("state")?;
    let state = TemplateState::from_parts(&state, row.get("failure_reason")?)
        .map_err(|e| corrupt("state", row, e))?;
    Ok(Template {
        id: row.get("id")?,
        name: row.get("name")?,
        kernel: row.get("kernel")?,
        rootfs: get_path(row, "rootfs")?,
        snapshot_dir: get_path(row, "snapshot_dir")?,
        mem_mib: row.get("mem_mib")?,
        vcpus: row.get("vcpus")?,
        kind: row.get("kind")?,
        created_at: row.get("created_at")?,
        state,
        tenant: row.get("tenant")?,
        image: row.get("image")?,
        source: row.get("source")?,
        stored_snapshot: row.get("stored_snapshot")?,
    })
}

fn pod_from_row(row: &Row<'_>) -> rusqlite::Result<Pod> {
    let address: String = row.get("address")?;
    Ok(Pod {
        id: row.get("id")?,
        address: PodAddress::from_text(&address).map_err(|e| corrupt("address", row, e))?,
        token_hash: row.get("token_hash")?,
        memory_bytes: get_u64(row, "memory_bytes")?,
        vcpus: row.get("vcpus")?,
        disk_bytes: get_u64(row, "disk_bytes")?,
        oversubscription_ratio: row.get("oversubscription_ratio")?,
        high_watermark: row.get("high_watermark")?,
        created_at: row.get("created_at")?,
    })
}

pub(super) fn checkpoint_from_row(row: &Row<'_>) -> rusqlite::Result<Checkpoint> {
    Ok(Checkpoint {
        id: row.get("id")?,
        sandbox: row.get("sandbox")?,
        name: row.get("name")?,
        snapshot_dir: get_path(row, "snapshot_dir")?.unwrap_or_default(),
        parent: row.get("parent")?,
        created_at: row.get("created_at")?,
    })
}

/// 0 < ratio ≤ 100 (NaN and infinities refused).
pub fn validate_ratio(ratio: f64) -> Result<()> {
    if ratio > 0.0 && ratio <= MAX_OVERSUBSCRIPTION_RATIO {
        Ok(())
    } else {
        Err(StoreError::InvalidRatio(ratio))
    }
}

/// 0 < watermark ≤ 1.
fn validate_watermark(watermark: f64) -> Result<()> {
    if watermark > 0.0 && watermark <= 1.0 {
        Ok(())
    } else {
        Err(StoreError::Invalid {
            what: "high watermark",
            detail: format!("{watermark} is outside (0, 1]"),
        })
    }
}

impl Tx<'_> {
    // ---- templates ----

    /// Inserts a template. Its id must be new and its name free for its
    /// tenant ([`crate::names::name_conflict`]).
    pub fn insert_template(&self, t: &Template) -> Result<()> {
        if t.mem_mib == 0 || t.vcpus == 0 {
            return Err(StoreError::Invalid {
                what: "template",
                detail: format!("mem_mib {} and vcpus {} must be > 0", t.mem_mib, t.vcpus),
            });
        }
        if self.template_opt(&t.id)?.is_some() {
            return Err(StoreError::AlreadyExists {
                kind: "template",
                id: t.id.to_string(),
            });
        }
        if let Some((kind, id)) = self.template_name_conflict(t.tenant.as_deref(), &t.name)? {
            return Err(StoreError::AlreadyExists { kind, id });
        }
        self.conn.execute(
            &format!(
                "INSERT INTO templates ({TEMPLATE_COLUMNS}) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)"
            ),
            params![
                t.id,
                t.name,
                t.kernel,
                opt_path_text(t.rootfs.as_deref(), "rootfs")?,
                opt_path_text(t.snapshot_dir.as_deref(), "snapshot_dir")?,
                t.mem_mib,
                t.vcpus,
                t.kind,
                t.state.as_str(),
                t.state.reason(),
                t.created_at,
                t.tenant,
                t.image,
            ],
        )?;
        Ok(())
    }

    /// Inserts a template snapshotted from `source` (see
    /// [`Tx::insert_template`]) and records where it came from.
    pub fn insert_sandbox_template(&self, t: &Template, source: &SandboxId) -> Result<()> {
        self.insert_template(t)?;
        self.conn.execute(
            "INSERT INTO template_sources (template, sandbox) VALUES (?1, ?2)",
            params![t.id, source],
        )?;
        Ok(())
    }

    /// Templates snapshotted from sandboxes (of `source` only, if given)
    /// that are not deleted, oldest first, each with its source.
    pub fn sandbox_templates(
        &self,
        source: Option<&SandboxId>,
    ) -> Result<Vec<(Template, SandboxId)>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT t.id, s.sandbox FROM templates t JOIN template_sources s ON s.template = t.id \
             WHERE t.state != 'deleted' AND (?1 IS NULL OR s.sandbox = ?1) \
             ORDER BY t.created_at, t.id",
        )?;
        let ids = stmt
            .query_map(params![source], |r| {
                Ok((r.get::<_, TemplateId>(0)?, r.get::<_, SandboxId>(1)?))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        ids.into_iter()
            .map(|(t, s)| Ok((self.get_template(&t)?, s)))
            .collect()
    }

    fn template_opt(&self, id: &TemplateId) -> Result<Option<Template>> {
        Ok(self
            .conn
            .prepare_cached(&format!(
                "SELECT {TEMPLATE_SELECT} FROM templates WHERE id = ?1"
            ))?
            .query_row([id], template_from_row)
            .optional()?)
    }

    /// One template, deleted ones included.
    pub fn get_template(&self, id: &TemplateId) -> Result<Template> {
        self.template_opt(id)?
            .ok_or_else(|| StoreError::not_found("template", id))
    }

    /// The template of id `key` (deleted or not) and the live templates
    /// named `key`, whosever: what [`crate::names::resolve`] chooses
    /// among for a caller.
    pub fn template_candidates(&self, key: &str) -> Result<Vec<Template>> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT {TEMPLATE_SELECT} FROM templates WHERE id = ?1 \
             OR (name = ?1 AND state != 'deleted') ORDER BY created_at, id"
        ))?;
        let rows = stmt
            .query_map([key], template_from_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    /// Why a template of `tenant` (none: shared) may not be named `name`
    /// now, if it may not ([`crate::names::name_conflict`]).
    pub fn template_name_conflict(
        &self,
        tenant: Option<&str>,
        name: &str,
    ) -> Result<Option<(&'static str, String)>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT tenant FROM templates WHERE name = ?1 AND state != 'deleted'",
        )?;
        let tenants = stmt
            .query_map([name], |r| r.get::<_, Option<String>>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(crate::names::name_conflict(
            tenant,
            name,
            tenants.iter().map(Option::as_deref),
        ))
    }

    /// Templates, oldest first.
    pub fn list_templates(&self, include_deleted: bool) -> Result<Vec<Template>> {
        let filter = if include_deleted {
            ""
        } else {
            "WHERE state != 'deleted'"
        };
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT {TEMPLATE_SELECT} FROM templates {filter} ORDER BY created_at, id"
        ))?;
        let rows = stmt
            .query_map([], template_from_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    /// Sets a template's state. A deleted template stays deleted
    /// (`TemplateConflict`); setting `Deleted` is [`Tx::delete_template`].
    pub fn set_template_state(&self, id: &TemplateId, state: &TemplateState) -> Result<Template> {
        let current = self.get_template(id)?;
        if current.state == TemplateState::Deleted {
            return Err(StoreError::TemplateConflict {
                id: id.clone(),
                current: current.state,
            });
        }
        if *state == TemplateState::Deleted {
            return self.delete_template(id);
        }
        self.conn.execute(
            "UPDATE templates SET state = ?2, failure_reason = ?3 WHERE id = ?1",
            params![id, state.as_str(), state.reason()],
        )?;
        self.get_template(id)
    }

    /// Sets (or clears) a template's snapshot directory.
    pub fn set_template_snapshot(&self, id: &TemplateId, dir: Option<&Path>) -> Result<()> {
        let dir = opt_path_text(dir, "snapshot_dir")?;
        match self.conn.execute(
            "UPDATE templates SET snapshot_dir = ?2 WHERE id = ?1",
            params![id, dir],
        )? {
            0 => Err(StoreError::not_found("template", id)),
            _ => Ok(()),
        }
    }

    /// Renames a live template; refused (`AlreadyExists`) when another
    /// live template its tenant sees is named so.
    pub fn rename_template(&self, id: &TemplateId, name: &str) -> Result<Template> {
        let template = self.get_template(id)?;
        if template.name == name {
            return Ok(template);
        }
        if template.state == TemplateState::Deleted {
            return Err(StoreError::not_found("template", id));
        }
        if let Some((kind, other)) =
            self.template_name_conflict(template.tenant.as_deref(), name)?
        {
            return Err(StoreError::AlreadyExists { kind, id: other });
        }
        self.conn.execute(
            "UPDATE templates SET name = ?2 WHERE id = ?1",
            rusqlite::params![id, name],
        )?;
        self.get_template(id)
    }

    /// Marks a template deleted (the row stays for the sandboxes that name
    /// it). Refused with `InUse` while any sandbox that is not deleted uses
    /// it. Deleting a deleted template is a no-op.
    pub fn delete_template(&self, id: &TemplateId) -> Result<Template> {
        let template = self.get_template(id)?;
        if template.state == TemplateState::Deleted {
            return Ok(template);
        }
        let users: i64 = self.conn.query_row(
            "SELECT count(*) FROM sandboxes WHERE template = ?1 AND state != 'deleted'",
            [id],
            |r| r.get(0),
        )?;
        if users > 0 {
            return Err(StoreError::InUse {
                kind: "template",
                id: id.to_string(),
                users: format!("{users} sandboxes"),
            });
        }
        self.conn.execute(
            "UPDATE templates SET state = 'deleted', failure_reason = NULL WHERE id = ?1",
            [id],
        )?;
        self.get_template(id)
    }

    // ---- pods ----

    /// Inserts a pod (ratio and watermark validated; id must be new).
    pub fn insert_pod(&self, p: &Pod) -> Result<()> {
        validate_ratio(p.oversubscription_ratio)?;
        validate_watermark(p.high_watermark)?;
        if self.pod_opt(&p.id)?.is_some() {
            return Err(StoreError::AlreadyExists {
                kind: "pod",
                id: p.id.to_string(),
            });
        }
        let address = p.address.to_text().ok_or_else(|| StoreError::Invalid {
            what: "pod address",
            detail: format!("{:?} is not UTF-8", p.address),
        })?;
        self.conn.execute(
            &format!(
                "INSERT INTO pods ({POD_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
            ),
            params![
                p.id,
                address,
                p.token_hash,
                u64_sql(p.memory_bytes, "memory_bytes")?,
                p.vcpus,
                u64_sql(p.disk_bytes, "disk_bytes")?,
                p.oversubscription_ratio,
                p.high_watermark,
                p.created_at,
            ],
        )?;
        Ok(())
    }

    fn pod_opt(&self, id: &PodId) -> Result<Option<Pod>> {
        Ok(self
            .conn
            .prepare_cached(&format!("SELECT {POD_COLUMNS} FROM pods WHERE id = ?1"))?
            .query_row([id], pod_from_row)
            .optional()?)
    }

    /// One pod.
    pub fn get_pod(&self, id: &PodId) -> Result<Pod> {
        self.pod_opt(id)?
            .ok_or_else(|| StoreError::not_found("pod", id))
    }

    /// Every pod, oldest first.
    pub fn list_pods(&self) -> Result<Vec<Pod>> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT {POD_COLUMNS} FROM pods ORDER BY created_at, id"
        ))?;
        let rows = stmt
            .query_map([], pod_from_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    fn update_pod(&self, id: &PodId, sql: &str, params: &[&dyn rusqlite::ToSql]) -> Result<Pod> {
        let mut all: Vec<&dyn rusqlite::ToSql> = vec![id];
        all.extend_from_slice(params);
        match self.conn.prepare_cached(sql)?.execute(&*all)? {
            0 => Err(StoreError::not_found("pod", id)),
            _ => self.get_pod(id),
        }
    }

    /// Sets a pod's oversubscription ratio (0 < ratio ≤ 100, else
    /// `InvalidRatio`).
    pub fn set_ratio(&self, id: &PodId, ratio: f64) -> Result<Pod> {
        validate_ratio(ratio)?;
        self.update_pod(
            id,
            "UPDATE pods SET oversubscription_ratio = ?2 WHERE id = ?1",
            &[&ratio],
        )
    }

    /// Sets a pod's memory high-watermark (0 < watermark ≤ 1).
    pub fn set_high_watermark(&self, id: &PodId, watermark: f64) -> Result<Pod> {
        validate_watermark(watermark)?;
        self.update_pod(
            id,
            "UPDATE pods SET high_watermark = ?2 WHERE id = ?1",
            &[&watermark],
        )
    }

    /// Records a pod's capacity (as it reports it when it connects).
    pub fn set_pod_capacity(
        &self,
        id: &PodId,
        memory_bytes: u64,
        vcpus: u32,
        disk_bytes: u64,
    ) -> Result<Pod> {
        let memory = u64_sql(memory_bytes, "memory_bytes")?;
        let disk = u64_sql(disk_bytes, "disk_bytes")?;
        self.update_pod(
            id,
            "UPDATE pods SET memory_bytes = ?2, vcpus = ?3, disk_bytes = ?4 WHERE id = ?1",
            &[&memory, &vcpus, &disk],
        )
    }

    /// Removes a pod. Refused with `InUse` while sandboxes that are not
    /// deleted are placed on it; deleted ones are unplaced.
    pub fn delete_pod(&self, id: &PodId) -> Result<()> {
        self.get_pod(id)?;
        let users: i64 = self.conn.query_row(
            "SELECT count(*) FROM sandboxes WHERE pod = ?1 AND state != 'deleted'",
            [id],
            |r| r.get(0),
        )?;
        if users > 0 {
            return Err(StoreError::InUse {
                kind: "pod",
                id: id.to_string(),
                users: format!("{users} sandboxes"),
            });
        }
        self.conn
            .execute("UPDATE sandboxes SET pod = NULL WHERE pod = ?1", [id])?;
        self.conn.execute("DELETE FROM pods WHERE id = ?1", [id])?;
        Ok(())
    }

    // ---- checkpoints ----

    /// Inserts a checkpoint of a sandbox that is not deleted (else
    /// `NotFound`). Its name must be new for that sandbox; its parent, if
    /// any, must exist.
    pub fn insert_checkpoint(&self, c: &Checkpoint) -> Result<()> {
        if self.sandbox_state(&c.sandbox)? == SandboxState::Deleted {
            return Err(StoreError::not_found("sandbox", &c.sandbox));
        }
        if self.checkpoint_opt(&c.id)?.is_some() {
            return Err(StoreError::AlreadyExists {
                kind: "checkpoint",
                id: c.id.to_string(),
            });
        }
        let taken: bool = self.conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM checkpoints WHERE sandbox = ?1 AND name = ?2)",
            params![c.sandbox, c.name],
            |r| r.get(0),
        )?;
        if taken {
            return Err(StoreError::AlreadyExists {
                kind: "checkpoint named",
                id: c.name.clone(),
            });
        }
        if let Some(parent) = &c.parent {
            self.get_checkpoint(parent)?;
        }
        self.conn.execute(
            &format!(
                "INSERT INTO checkpoints ({CHECKPOINT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"
            ),
            params![
                c.id,
                c.sandbox,
                c.name,
                path_text(&c.snapshot_dir, "snapshot_dir")?,
                c.parent,
                c.created_at,
            ],
        )?;
        Ok(())
    }

    fn checkpoint_opt(&self, id: &CheckpointId) -> Result<Option<Checkpoint>> {
        Ok(self
            .conn
            .prepare_cached(&format!(
                "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE id = ?1"
            ))?
            .query_row([id], checkpoint_from_row)
            .optional()?)
    }

    /// One checkpoint.
    pub fn get_checkpoint(&self, id: &CheckpointId) -> Result<Checkpoint> {
        self.checkpoint_opt(id)?
            .ok_or_else(|| StoreError::not_found("checkpoint", id))
    }

    /// A sandbox's checkpoints, oldest first.
    pub fn list_checkpoints(&self, sandbox: &SandboxId) -> Result<Vec<Checkpoint>> {
        self.sandbox_state(sandbox)?;
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE sandbox = ?1 ORDER BY created_at, id"
        ))?;
        let rows = stmt
            .query_map([sandbox], checkpoint_from_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(rows)
    }

    /// Removes a checkpoint; refused with `InUse` while another checkpoint
    /// sits on it.
    pub fn delete_checkpoint(&self, id: &CheckpointId) -> Result<()> {
        self.get_checkpoint(id)?;
        let children: i64 = self.conn.query_row(
            "SELECT count(*) FROM checkpoints WHERE parent = ?1",
            [id],
            |r| r.get(0),
        )?;
        if children > 0 {
            return Err(StoreError::InUse {
                kind: "checkpoint",
                id: id.to_string(),
                users: format!("{children} child checkpoints"),
            });
        }
        self.conn
            .execute("DELETE FROM checkpoints WHERE id = ?1", [id])?;
        Ok(())
    }

    // ---- files ----

    /// Every snapshot path the store references: snapshots of templates and
    /// sandboxes that are not deleted, and every checkpoint's. What
    /// [`crate::files::cleanup_orphans`] must keep (together with the
    /// layers those snapshots' diff chains point to).
    pub fn referenced_paths(&self) -> Result<HashSet<PathBuf>> {
        let mut stmt = self.conn.prepare(
            "SELECT snapshot_dir FROM templates WHERE state != 'deleted' AND snapshot_dir IS NOT NULL \
             UNION SELECT snapshot FROM sandboxes WHERE state != 'deleted' AND snapshot IS NOT NULL \
             UNION SELECT snapshot_dir FROM checkpoints",
        )?;
        let paths = stmt
            .query_map([], |r| r.get::<_, String>(0).map(PathBuf::from))?
            .collect::<rusqlite::Result<_>>()?;
        Ok(paths)
    }
}
