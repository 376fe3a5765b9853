//! E2B snapshot ids. A snapshot is a named checkpoint of a sandbox
//! (`POST /sandboxes/{id}/snapshots`); its id, which `templateID` and
//! `DELETE /templates/{id}` take, is `SANDBOX_ID:CHECKPOINT_NAME`.

use std::fmt;

use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::validate_checkpoint_name;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotId {
    pub sandbox: SandboxId,
    pub name: String,
}

impl SnapshotId {
    /// The snapshot `text` names, if it is one (a template id or name is
    /// not: neither has a well-formed sandbox id before a colon).
    pub fn parse(text: &str) -> Option<Self> {
        let (sandbox, name) = text.split_once(':')?;
        if !SandboxId::is_well_formed(sandbox) || validate_checkpoint_name(name).is_err() {
            return None;
        }
        Some(SnapshotId {
            sandbox: SandboxId::new(sandbox),
            name: name.to_string(),
        })
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.sandbox, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_ids_round_trip_and_templates_are_not_snapshots() {
        let id = SnapshotId {
            sandbox: SandboxId::new("sbx_0123456789abcdef"),
            name: "before-upgrade".into(),
        };
        assert_eq!(id.to_string(), "sbx_0123456789abcdef:before-upgrade");
        assert_eq!(SnapshotId::parse(&id.to_string()), Some(id));
        for not in [
            "probe",
            "tpl_0123456789abcdef",
            "sbx_0123456789abcdef",
            "sbx_0123456789abcdef:",
            "sbx_0123:snap",
            "sbx_0123456789abcdef:../x",
        ] {
            assert_eq!(SnapshotId::parse(not), None, "{not:?}");
        }
    }
}
