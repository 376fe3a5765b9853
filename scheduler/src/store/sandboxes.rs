//! Sandboxes: insert, read, filter, and the compare-and-set state change.

use std::collections::BTreeMap;
use std::path::Path;

use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, OptionalExtension, Row};

use super::sql::{get_path, get_u64, opt_path_text, path_text, u64_sql};
use super::{Result, StoreError, Tx};
use crate::model::{PodId, Sandbox, SandboxId, TemplateId, TemplateState, Timestamp, VmmHandle};
use crate::state::{transition, SandboxState};

const COLUMNS: &str = "id, template, pod, mem_mib, vcpus, keep_alive_ms, expires_at, state, \
    failure_reason, created_at, last_active_at, snapshot, vmm_pid, vmm_socket, generation, \
    vmm_start, tenant, on_timeout, access_token, timeout_hibernation, disk_only, \
    guest_unresponsive_at_pause, ingress_host, volumes";
/// What a sandbox is read with: its columns and the manifest its snapshot
/// is stored as in the object store, if it is.
const SELECT: &str = "id, template, pod, mem_mib, vcpus, keep_alive_ms, expires_at, state, \
    failure_reason, created_at, last_active_at, snapshot, vmm_pid, vmm_socket, generation, \
    vmm_start, tenant, on_timeout, access_token, timeout_hibernation, disk_only, \
    guest_unresponsive_at_pause, ingress_host, volumes, \
    (SELECT manifest FROM layer_objects WHERE layer_objects.dir = snapshot) AS stored_snapshot, \
    (SELECT CAST(stored_at AS INTEGER) FROM layer_objects WHERE layer_objects.dir = snapshot) \
    AS stored_at";

/// A sandbox's key/value tables.
#[derive(Clone, Copy)]
enum Pairs {
    Metadata,
    Env,
}

impl Pairs {
    fn table(self) -> &'static str {
        match self {
            Pairs::Metadata => "sandbox_metadata",
            Pairs::Env => "sandbox_env",
        }
    }
}

/// Which sandboxes [`Tx::list_sandboxes`] returns; every field set must match.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SandboxFilter {
    /// Any of these states; empty means every state but deleted.
    pub states: Vec<SandboxState>,
    pub template: Option<TemplateId>,
    pub pod: Option<PodId>,
    /// Every pair must be in the sandbox's metadata.
    pub metadata: BTreeMap<String, String>,
    /// Only this tenant's sandboxes.
    pub tenant: Option<String>,
}

/// A row without its metadata and environment (read separately).
fn from_row(row: &Row<'_>) -> rusqlite::Result<Sandbox> {
    let pid: Option<u32> = row.get("vmm_pid")?;
    let start_time = row
        .get::<_, Option<i64>>("vmm_start")?
        .and_then(|t| u64::try_from(t).ok());
    let socket = get_path(row, "vmm_socket")?;
    Ok(Sandbox {
        id: row.get("id")?,
        template: row.get("template")?,
        pod: row.get("pod")?,
        mem_mib: row.get("mem_mib")?,
        vcpus: row.get("vcpus")?,
        keep_alive_ms: get_u64(row, "keep_alive_ms")?,
        expires_at: row.get("expires_at")?,
        on_timeout: row.get("on_timeout")?,
        timeout_hibernation: row.get("timeout_hibernation")?,
        disk_only: row.get("disk_only")?,
        guest_unresponsive_at_pause: row.get("guest_unresponsive_at_pause")?,
        access_token: row.get("access_token")?,
        ingress_host: row.get("ingress_host")?,
        volumes: match row.get::<_, Option<String>>("volumes")? {
            None => Vec::new(),
            Some(json) => serde_json::from_str(&json).map_err(|e| {
                rusqlite::Error::FromSqlConversionFailure(0, rusqlite::types::Type::Text, e.into())
            })?,
        },
        metadata: BTreeMap::new(),
        env: BTreeMap::new(),
        state: row.get("state")?,
        failure_reason: row.get("failure_reason")?,
        created_at: row.get("created_at")?,
        last_active_at: row.get("last_active_at")?,
        snapshot: get_path(row, "snapshot")?,
        stored_snapshot: row.get("stored_snapshot")?,
        stored_at: row.get("stored_at")?,
        // Only a replica's view of a lost sandbox has it.
        last_durable_at: None,
        vmm: pid.zip(socket).map(|(pid, control_socket)| VmmHandle {
            pid,
            start_time,
            control_socket,
        }),
        generation: get_u64(row, "generation")?,
        restore: None,
        hibernation: None,
        tenant: row.get("tenant")?,
        network: None,
        usage: None,
        memory: None,
    })
}

/// A sandbox's volumes as stored: NULL for none, else a JSON list.
fn volumes_json(volumes: &[crate::model::MountedVolume]) -> Result<Option<String>> {
    if volumes.is_empty() {
        return Ok(None);
    }
    serde_json::to_string(volumes)
        .map(Some)
        .map_err(|e| StoreError::Invalid {
            what: "volumes",
            detail: e.to_string(),
        })
}

/// A VMM's start time as SQL.
fn vmm_start(vmm: Option<&VmmHandle>) -> Result<Option<i64>> {
    vmm.and_then(|v| v.start_time)
        .map(|t| u64_sql(t, "vmm start time"))
        .transpose()
}

fn check_shape(s: &Sandbox) -> Result<()> {
    if s.mem_mib == 0 || s.vcpus == 0 {
        return Err(StoreError::Invalid {
            what: "sandbox",
            detail: format!("mem_mib {} and vcpus {} must be > 0", s.mem_mib, s.vcpus),
        });
    }
    if s.vmm.as_ref().is_some_and(|v| v.pid == 0) {
        return Err(StoreError::Invalid {
            what: "vmm",
            detail: "pid 0".into(),
        });
    }
    Ok(())
}

impl Tx<'_> {
    /// Inserts a new sandbox with its metadata. Its template must exist and
    /// be ready, and its pod (if any) must exist; the id must be new.
    pub fn insert_sandbox(&self, s: &Sandbox) -> Result<()> {
        check_shape(s)?;
        if self.sandbox_state_opt(&s.id)?.is_some() {
            return Err(StoreError::AlreadyExists {
                kind: "sandbox",
                id: s.id.to_string(),
            });
        }
        let template = self.get_template(&s.template)?;
        if template.state != TemplateState::Ready {
            return Err(StoreError::TemplateConflict {
                id: template.id,
                current: template.state,
            });
        }
        if let Some(pod) = &s.pod {
            self.get_pod(pod)?;
        }
        self.conn
            .prepare_cached(&format!(
                "INSERT INTO sandboxes ({COLUMNS}) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24)"
            ))?
            .execute(params![
                s.id,
                s.template,
                s.pod,
                s.mem_mib,
                s.vcpus,
                u64_sql(s.keep_alive_ms, "keep_alive_ms")?,
                s.expires_at,
                s.state,
                s.failure_reason,
                s.created_at,
                s.last_active_at,
                opt_path_text(s.snapshot.as_deref(), "snapshot")?,
                s.vmm.as_ref().map(|v| v.pid),
                opt_path_text(
                    s.vmm.as_ref().map(|v| v.control_socket.as_path()),
                    "vmm socket"
                )?,
                u64_sql(s.generation, "generation")?,
                vmm_start(s.vmm.as_ref())?,
                s.tenant,
                s.on_timeout,
                s.access_token,
                s.timeout_hibernation,
                s.disk_only,
                s.guest_unresponsive_at_pause,
                s.ingress_host,
                volumes_json(&s.volumes)?,
            ])?;
        self.write_pairs(Pairs::Metadata, &s.id, &s.metadata)?;
        self.write_pairs(Pairs::Env, &s.id, &s.env)?;
        if let Some(network) = &s.network {
            self.set_sandbox_network(&s.id, network)?;
        }
        Ok(())
    }

    fn write_metadata(&self, id: &SandboxId, metadata: &BTreeMap<String, String>) -> Result<()> {
        self.write_pairs(Pairs::Metadata, id, metadata)
    }

    /// Replaces a sandbox's key/value pairs of one kind.
    fn write_pairs(
        &self,
        table: Pairs,
        id: &SandboxId,
        pairs: &BTreeMap<String, String>,
    ) -> Result<()> {
        let table = table.table();
        self.conn
            .prepare_cached(&format!("DELETE FROM {table} WHERE sandbox = ?1"))?
            .execute([id])?;
        let mut insert = self.conn.prepare_cached(&format!(
            "INSERT INTO {table} (sandbox, key, value) VALUES (?1, ?2, ?3)"
        ))?;
        for (key, value) in pairs {
            insert.execute(params![id, key, value])?;
        }
        Ok(())
    }

    fn read_pairs(&self, table: Pairs, id: &SandboxId) -> Result<BTreeMap<String, String>> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT key, value FROM {} WHERE sandbox = ?1",
            table.table()
        ))?;
        let pairs = stmt
            .query_map([id], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<rusqlite::Result<_>>()?;
        Ok(pairs)
    }

    /// The row's metadata and environment.
    fn read_details(&self, s: &mut Sandbox) -> Result<()> {
        s.metadata = self.read_pairs(Pairs::Metadata, &s.id)?;
        s.env = self.read_pairs(Pairs::Env, &s.id)?;
        s.network = self.get_sandbox_network(&s.id)?;
        Ok(())
    }

    /// One sandbox, whatever its state (deleted ones included).
    pub fn get_sandbox(&self, id: &SandboxId) -> Result<Sandbox> {
        let mut s = self
            .conn
            .prepare_cached(&format!("SELECT {SELECT} FROM sandboxes WHERE id = ?1"))?
            .query_row([id], from_row)
            .optional()?
            .ok_or_else(|| StoreError::not_found("sandbox", id))?;
        self.read_details(&mut s)?;
        Ok(s)
    }

    fn sandbox_state_opt(&self, id: &SandboxId) -> Result<Option<SandboxState>> {
        Ok(self
            .conn
            .prepare_cached("SELECT state FROM sandboxes WHERE id = ?1")?
            .query_row([id], |r| r.get(0))
            .optional()?)
    }

    /// A sandbox's current state.
    pub fn sandbox_state(&self, id: &SandboxId) -> Result<SandboxState> {
        self.sandbox_state_opt(id)?
            .ok_or_else(|| StoreError::not_found("sandbox", id))
    }

    /// Sandboxes matching `filter`, oldest first.
    pub fn list_sandboxes(&self, filter: &SandboxFilter) -> Result<Vec<Sandbox>> {
        let mut sql = format!("SELECT {SELECT} FROM sandboxes s WHERE 1");
        let mut args: Vec<Value> = Vec::new();
        fn arg(v: String, args: &mut Vec<Value>) -> String {
            args.push(Value::Text(v));
            format!("?{}", args.len())
        }
        if filter.states.is_empty() {
            sql.push_str(" AND state != 'deleted'");
        } else {
            let list: Vec<String> = filter
                .states
                .iter()
                .map(|s| arg(s.as_str().to_string(), &mut args))
                .collect();
            sql.push_str(&format!(" AND state IN ({})", list.join(", ")));
        }
        if let Some(t) = &filter.template {
            sql.push_str(&format!(
                " AND template = {}",
                arg(t.to_string(), &mut args)
            ));
        }
        if let Some(p) = &filter.pod {
            sql.push_str(&format!(" AND pod = {}", arg(p.to_string(), &mut args)));
        }
        if let Some(t) = &filter.tenant {
            sql.push_str(&format!(" AND tenant = {}", arg(t.clone(), &mut args)));
        }
        for (key, value) in &filter.metadata {
            let (k, v) = (arg(key.clone(), &mut args), arg(value.clone(), &mut args));
            sql.push_str(&format!(
                " AND EXISTS (SELECT 1 FROM sandbox_metadata m \
                 WHERE m.sandbox = s.id AND m.key = {k} AND m.value = {v})"
            ));
        }
        sql.push_str(" ORDER BY created_at, id");
        // Its text differs only by filter shape (the values are bound).
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let mut found = stmt
            .query_map(params_from_iter(args), from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        for s in &mut found {
            self.read_details(s)?;
        }
        Ok(found)
    }

    /// Compare-and-set of a sandbox's state: refused with `Conflict` (and the
    /// current state) unless it is `expected_from`, and with
    /// `IllegalTransition` unless the table allows `expected_from → to`.
    /// Going to `resuming` needs a snapshot, or the disk a filesystem-only
    /// hibernation kept (`disk_only`). Going to `failed` records
    /// `reason`; leaving `failed` (except to deleted) clears it. Bumps the
    /// generation. Returns the updated sandbox.
    pub fn update_sandbox_state(
        &self,
        id: &SandboxId,
        expected_from: SandboxState,
        to: SandboxState,
        reason: Option<&str>,
    ) -> Result<Sandbox> {
        let current = self.sandbox_state(id)?;
        if current != expected_from {
            return Err(StoreError::Conflict {
                id: id.clone(),
                expected: expected_from,
                current,
            });
        }
        transition(current, to)?;
        let sandbox = self.get_sandbox(id)?;
        if to == SandboxState::Resuming && sandbox.snapshot.is_none() && !sandbox.disk_only {
            return Err(StoreError::NoSnapshot { id: id.clone() });
        }
        let failure_reason = match to {
            SandboxState::Failed => Some(reason.unwrap_or("unknown").to_string()),
            SandboxState::Deleted => sandbox.failure_reason,
            _ => None,
        };
        self.conn
            .prepare_cached(
                "UPDATE sandboxes SET state = ?2, failure_reason = ?3, generation = generation + 1 \
                 WHERE id = ?1 AND state = ?4",
            )?
            .execute(params![id, to, failure_reason, current])?;
        tracing::debug!(sandbox = %id, from = %current, %to, "sandbox state");
        self.get_sandbox(id)
    }

    fn update_one(&self, id: &SandboxId, sql: &str, params: &[&dyn rusqlite::ToSql]) -> Result<()> {
        let mut all: Vec<&dyn rusqlite::ToSql> = vec![id];
        all.extend_from_slice(params);
        match self.conn.prepare_cached(sql)?.execute(&*all)? {
            0 => Err(StoreError::not_found("sandbox", id)),
            _ => Ok(()),
        }
    }

    /// Records activity at `now` (never moves `last_active_at` backwards).
    pub fn touch(&self, id: &SandboxId, now: Timestamp) -> Result<()> {
        self.update_one(
            id,
            "UPDATE sandboxes SET last_active_at = max(last_active_at, ?2) WHERE id = ?1",
            &[&now],
        )
    }

    /// Sets (or clears) the sandbox's latest snapshot directory.
    pub fn set_sandbox_snapshot(&self, id: &SandboxId, dir: Option<&Path>) -> Result<()> {
        let dir = opt_path_text(dir, "snapshot")?;
        self.update_one(
            id,
            "UPDATE sandboxes SET snapshot = ?2 WHERE id = ?1",
            &[&dir],
        )
    }

    /// Records what the sandbox's hibernation kept: only its disk
    /// (`disk_only`: its wake boots), and whether its memory was kept while
    /// its guest agent did not answer. Both false once it runs again.
    pub fn set_sandbox_hibernation(
        &self,
        id: &SandboxId,
        disk_only: bool,
        guest_unresponsive: bool,
    ) -> Result<()> {
        self.update_one(
            id,
            "UPDATE sandboxes SET disk_only = ?2, guest_unresponsive_at_pause = ?3 WHERE id = ?1",
            &[&disk_only, &guest_unresponsive],
        )
    }

    /// Sets (or clears) the VMM process that runs the sandbox.
    pub fn set_sandbox_vmm(&self, id: &SandboxId, vmm: Option<&VmmHandle>) -> Result<()> {
        let start = vmm_start(vmm)?;
        let (pid, socket) = match vmm {
            Some(v) if v.pid == 0 => {
                return Err(StoreError::Invalid {
                    what: "vmm",
                    detail: "pid 0".into(),
                })
            }
            Some(v) => (
                Some(v.pid),
                Some(path_text(&v.control_socket, "vmm socket")?),
            ),
            None => (None, None),
        };
        self.update_one(
            id,
            "UPDATE sandboxes SET vmm_pid = ?2, vmm_socket = ?3, vmm_start = ?4 WHERE id = ?1",
            &[&pid, &socket, &start],
        )
    }

    /// Places the sandbox on a pod (which must exist), or unplaces it.
    pub fn set_sandbox_pod(&self, id: &SandboxId, pod: Option<&PodId>) -> Result<()> {
        if let Some(pod) = pod {
            self.get_pod(pod)?;
        }
        self.update_one(id, "UPDATE sandboxes SET pod = ?2 WHERE id = ?1", &[&pod])
    }

    /// Sets the keep-alive (idle time before hibernation) and the deadline.
    pub fn set_sandbox_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: u64,
        expires_at: Option<Timestamp>,
    ) -> Result<()> {
        let keep_alive = u64_sql(keep_alive_ms, "keep_alive_ms")?;
        self.update_one(
            id,
            "UPDATE sandboxes SET keep_alive_ms = ?2, expires_at = ?3 WHERE id = ?1",
            &[&keep_alive, &expires_at],
        )
    }

    /// Replaces the sandbox's metadata.
    pub fn set_sandbox_metadata(
        &self,
        id: &SandboxId,
        metadata: &BTreeMap<String, String>,
    ) -> Result<()> {
        self.sandbox_state(id)?;
        self.write_metadata(id, metadata)
    }

    /// Deleted sandboxes deleted before `cutoff` (when the last operation
    /// on them ended; rows without one by their last activity), oldest
    /// first: what retention prunes.
    pub fn deleted_before(&self, cutoff: Timestamp) -> Result<Vec<SandboxId>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT s.id FROM sandboxes s WHERE s.state = 'deleted' AND \
             COALESCE((SELECT max(o.finished_at) FROM operations o WHERE o.sandbox = s.id), \
                      s.last_active_at) < ?1 \
             ORDER BY s.last_active_at, s.id",
        )?;
        let rows = stmt
            .query_map([cutoff], |r| r.get(0))?
            .collect::<rusqlite::Result<Vec<SandboxId>>>()?;
        Ok(rows)
    }

    /// Removes a deleted sandbox's row, its metadata and its checkpoints.
    /// Refused (`Conflict`) unless the sandbox is deleted.
    pub fn purge_sandbox(&self, id: &SandboxId) -> Result<()> {
        let current = self.sandbox_state(id)?;
        if current != SandboxState::Deleted {
            return Err(StoreError::Conflict {
                id: id.clone(),
                expected: SandboxState::Deleted,
                current,
            });
        }
        let children: i64 = self.conn.query_row(
            "SELECT count(*) FROM checkpoints c JOIN checkpoints p ON c.parent = p.id \
             WHERE p.sandbox = ?1 AND c.sandbox != ?1",
            [id],
            |r| r.get(0),
        )?;
        if children > 0 {
            return Err(StoreError::InUse {
                kind: "sandbox",
                id: id.to_string(),
                users: format!("{children} checkpoints of other sandboxes"),
            });
        }
        // Checkpoints of this sandbox may chain to each other: drop the links
        // first so the cascade never trips over the parent foreign key.
        self.conn.execute(
            "UPDATE checkpoints SET parent = NULL WHERE sandbox = ?1",
            [id],
        )?;
        self.conn
            .execute("DELETE FROM sandboxes WHERE id = ?1", [id])?;
        Ok(())
    }
}

#[cfg(test)]
mod retention_tests {
    use super::super::tests::{sandbox_in, setup};
    use crate::model::Timestamp;
    use crate::state::SandboxState;

    #[test]
    fn only_deleted_rows_older_than_the_cutoff_are_listed_and_purged() {
        let (_d, store, t) = setup();
        let live = sandbox_in(&store, &t, SandboxState::Running);
        let gone = sandbox_in(&store, &t, SandboxState::Running);
        store
            .update_sandbox_state(&gone.id, SandboxState::Running, SandboxState::Deleted, None)
            .unwrap();
        let later = Timestamp(Timestamp::now().0 + 1000);
        assert!(store.deleted_before(Timestamp(0)).unwrap().is_empty());
        assert_eq!(store.deleted_before(later).unwrap(), vec![gone.id.clone()]);
        store.purge_sandbox(&gone.id).unwrap();
        assert!(store.deleted_before(later).unwrap().is_empty());
        assert!(store.get_sandbox(&gone.id).is_err());
        assert!(store.get_sandbox(&live.id).is_ok());
    }
}
