//! Sandbox networks: each sandbox's egress policy and exposed ports, one
//! row (JSON columns), removed with the sandbox's row.

use rusqlite::{params, OptionalExtension};

use super::{Result, StoreError, Tx};
use crate::model::{ExposedPort, SandboxId, SandboxNetwork};
use crate::net::EgressPolicy;

fn invalid(what: &'static str, e: serde_json::Error) -> StoreError {
    StoreError::Invalid {
        what,
        detail: e.to_string(),
    }
}

impl Tx<'_> {
    /// The sandbox's stored network (policy and ports), if it has one.
    pub fn get_sandbox_network(&self, id: &SandboxId) -> Result<Option<SandboxNetwork>> {
        let row: Option<(String, String)> = self
            .conn
            .prepare_cached("SELECT policy, ports FROM sandbox_network WHERE sandbox = ?1")?
            .query_row([id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        let Some((policy, ports)) = row else {
            return Ok(None);
        };
        let policy: EgressPolicy =
            serde_json::from_str(&policy).map_err(|e| invalid("stored egress policy", e))?;
        let ports: Vec<ExposedPort> =
            serde_json::from_str(&ports).map_err(|e| invalid("stored exposed ports", e))?;
        Ok(Some(SandboxNetwork {
            policy,
            ports,
            address: None,
            counters: None,
        }))
    }

    /// Replaces the sandbox's stored policy and ports (what is read from
    /// the host, address and counters, is not stored).
    pub fn set_sandbox_network(&self, id: &SandboxId, network: &SandboxNetwork) -> Result<()> {
        self.sandbox_state(id)?;
        let policy =
            serde_json::to_string(&network.policy).map_err(|e| invalid("egress policy", e))?;
        let ports =
            serde_json::to_string(&network.ports).map_err(|e| invalid("exposed ports", e))?;
        self.conn
            .prepare_cached(
                "INSERT INTO sandbox_network (sandbox, policy, ports) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (sandbox) DO UPDATE SET policy = ?2, ports = ?3",
            )?
            .execute(params![id, policy, ports])?;
        Ok(())
    }
}
