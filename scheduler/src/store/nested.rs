//! What `torpor serve` keeps about the sandboxes of its nested pod (the
//! pod in L1, a separate torpor with its own store): who owns each, and
//! what that pod never shows (the envd token, the environment), so that a
//! restart of serve (kill -9 included) finds them again. Not the local
//! pod's sandboxes: no foreign key to `sandboxes`.

use std::collections::BTreeMap;

use rusqlite::{params, OptionalExtension, Row};

use super::{Result, StoreError, Tx};
use crate::model::{PodId, Sandbox, SandboxId};

/// A nested pod's sandbox as serve keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct NestedSandbox {
    pub id: SandboxId,
    pub pod: PodId,
    pub tenant: Option<String>,
    pub access_token: Option<String>,
    pub env: BTreeMap<String, String>,
    /// The pod's latest answer about it, shown once it is lost.
    pub last_seen: Option<Sandbox>,
    /// Why it is gone (its nested host stopped), once it is.
    pub lost: Option<String>,
    /// The volumes it mounts, as serve resolved them (serve's volume
    /// gateway serves these to it, whatever the pod says).
    pub volumes: Vec<crate::model::MountedVolume>,
}

fn invalid(what: &'static str, e: serde_json::Error) -> StoreError {
    StoreError::Invalid {
        what,
        detail: e.to_string(),
    }
}

const COLUMNS: &str = "id, pod, tenant, access_token, env, last_seen, lost, volumes";

type RowParts = (NestedSandbox, String, Option<String>, Option<String>);

fn from_row(r: &Row<'_>) -> rusqlite::Result<RowParts> {
    Ok((
        NestedSandbox {
            id: r.get(0)?,
            pod: r.get(1)?,
            tenant: r.get(2)?,
            access_token: r.get(3)?,
            env: BTreeMap::new(),
            last_seen: None,
            lost: r.get(6)?,
            volumes: Vec::new(),
        },
        r.get(4)?,
        r.get(5)?,
        r.get(7)?,
    ))
}

fn parse((mut s, env, last_seen, volumes): RowParts) -> Result<NestedSandbox> {
    s.env = serde_json::from_str(&env).map_err(|e| invalid("a nested sandbox's env", e))?;
    if let Some(v) = volumes {
        s.volumes =
            serde_json::from_str(&v).map_err(|e| invalid("a nested sandbox's volumes", e))?;
    }
    s.last_seen = last_seen
        .map(|j| serde_json::from_str(&j))
        .transpose()
        .map_err(|e| invalid("a nested sandbox's last answer", e))?;
    Ok(s)
}

impl Tx<'_> {
    /// Records (or replaces) a nested pod's sandbox.
    pub fn put_nested_sandbox(&self, s: &NestedSandbox) -> Result<()> {
        let env = serde_json::to_string(&s.env).map_err(|e| invalid("env", e))?;
        let last_seen = s
            .last_seen
            .as_ref()
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| invalid("a sandbox", e))?;
        let volumes = (!s.volumes.is_empty())
            .then(|| serde_json::to_string(&s.volumes))
            .transpose()
            .map_err(|e| invalid("volumes", e))?;
        self.conn
            .prepare_cached(
                "INSERT INTO nested_sandboxes \
                 (id, pod, tenant, access_token, env, last_seen, lost, volumes) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
                 ON CONFLICT (id) DO UPDATE SET pod = ?2, tenant = ?3, access_token = ?4, \
                 env = ?5, last_seen = ?6, lost = ?7, volumes = ?8",
            )?
            .execute(params![
                s.id,
                s.pod,
                s.tenant,
                s.access_token,
                env,
                last_seen,
                s.lost,
                volumes
            ])?;
        Ok(())
    }

    /// Updates the pod's latest answer about `id`, if it is recorded and
    /// not lost.
    pub fn set_nested_last_seen(&self, id: &SandboxId, sandbox: &Sandbox) -> Result<()> {
        let json = serde_json::to_string(sandbox).map_err(|e| invalid("a sandbox", e))?;
        self.conn
            .prepare_cached(
                "UPDATE nested_sandboxes SET last_seen = ?2 WHERE id = ?1 AND lost IS NULL",
            )?
            .execute(params![id, json])?;
        Ok(())
    }

    /// The recorded nested sandbox `id`, if any.
    pub fn get_nested_sandbox(&self, id: &SandboxId) -> Result<Option<NestedSandbox>> {
        let row = self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM nested_sandboxes WHERE id = ?1"
            ))?
            .query_row([id], from_row)
            .optional()?;
        row.map(parse).transpose()
    }

    /// Every recorded nested sandbox, lost ones included.
    pub fn nested_sandboxes(&self) -> Result<Vec<NestedSandbox>> {
        let rows = self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM nested_sandboxes ORDER BY id"
            ))?
            .query_map([], from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        rows.into_iter().map(parse).collect()
    }

    /// Forgets `id` (deleted through serve).
    pub fn remove_nested_sandbox(&self, id: &SandboxId) -> Result<()> {
        self.conn
            .prepare_cached("DELETE FROM nested_sandboxes WHERE id = ?1")?
            .execute([id])?;
        Ok(())
    }

    /// Marks every sandbox of a pod other than `keep` (none: of every pod)
    /// that is not lost yet as lost, for `reason`; how many.
    pub fn mark_nested_lost(&self, keep: Option<&PodId>, reason: &str) -> Result<usize> {
        Ok(self
            .conn
            .prepare_cached(
                "UPDATE nested_sandboxes SET lost = ?2 \
                 WHERE lost IS NULL AND (?1 IS NULL OR pod != ?1)",
            )?
            .execute(params![keep, reason])?)
    }
}
