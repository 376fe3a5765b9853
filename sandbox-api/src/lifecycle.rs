//! [`Lifecycle`]: the calls that move a sandbox between its states
//! (pause, resume, connect, the hibernations, reboot), one operation
//! ([`crate::Operation::Lifecycle`]) each named by its own `kind`.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A sandbox's lifecycle call: `POST /v1/sandboxes/{id}/<name>` (with
/// the body [`Lifecycle::body`] gives), one backend call (`SandboxApi::lifecycle`) for
/// all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifecycle {
    Pause,
    Resume,
    /// Resume or wake, and count as activity.
    Connect,
    Hibernate,
    /// Hibernate with the memory after checking the guest agent: one that
    /// does not answer is recorded, and the sandbox then wakes only by a
    /// reboot (E2B's pause).
    HibernateMarking,
    /// Hibernate with the memory, refused (503) while the guest agent does
    /// not answer (E2B's `requireHealthyGuest`).
    HibernateStrict,
    /// Hibernate keeping only the disk (the guest agent must answer to
    /// sync it); the wake reboots (E2B's `memory: false`).
    HibernateFilesystem,
    /// Connect, waking a hibernated sandbox by a reboot from its disk
    /// (E2B's `on_resume="reboot"`).
    Reboot,
}

impl Lifecycle {
    pub const ALL: [Lifecycle; 8] = [
        Lifecycle::Pause,
        Lifecycle::Resume,
        Lifecycle::Connect,
        Lifecycle::Hibernate,
        Lifecycle::HibernateMarking,
        Lifecycle::HibernateStrict,
        Lifecycle::HibernateFilesystem,
        Lifecycle::Reboot,
    ];

    /// Its route's suffix after `/v1/sandboxes/{id}` (what a relay
    /// forwards to the sandbox's pod, with [`Self::body`]).
    pub fn path(self) -> &'static str {
        match self {
            Lifecycle::Pause => "/pause",
            Lifecycle::Resume => "/resume",
            Lifecycle::Connect | Lifecycle::Reboot => "/connect",
            Lifecycle::Hibernate
            | Lifecycle::HibernateMarking
            | Lifecycle::HibernateStrict
            | Lifecycle::HibernateFilesystem => "/hibernate",
        }
    }

    /// The body its route takes to mean it (none: the route's default).
    pub fn body(self) -> Option<Value> {
        match self {
            Lifecycle::Pause | Lifecycle::Resume | Lifecycle::Connect | Lifecycle::Hibernate => {
                None
            }
            Lifecycle::HibernateMarking => Some(json!({ "guest_check": "mark" })),
            Lifecycle::HibernateStrict => Some(json!({ "guest_check": "require" })),
            Lifecycle::HibernateFilesystem => Some(json!({ "mode": "filesystem" })),
            Lifecycle::Reboot => Some(json!({ "mode": "reboot" })),
        }
    }

    /// Its `kind` on the wire ([`crate::Operation`]): its serde name.
    pub fn name(self) -> &'static str {
        match self {
            Lifecycle::HibernateMarking => "hibernate_marking",
            Lifecycle::HibernateStrict => "hibernate_strict",
            Lifecycle::HibernateFilesystem => "hibernate_filesystem",
            Lifecycle::Reboot => "reboot",
            plain => &plain.path()[1..],
        }
    }

    /// Whether a route's last segment is a lifecycle call's.
    pub fn is_route(segment: &str) -> bool {
        Lifecycle::ALL
            .into_iter()
            .any(|op| &op.path()[1..] == segment)
    }

    /// Whether it may wake a hibernated sandbox.
    pub fn wakes(self) -> bool {
        matches!(
            self,
            Lifecycle::Resume | Lifecycle::Connect | Lifecycle::Reboot
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lifecycle_call_is_named_as_serde_names_it() {
        for op in Lifecycle::ALL {
            assert_eq!(serde_json::to_value(op).unwrap(), op.name());
            assert!(Lifecycle::is_route(&op.path()[1..]));
        }
        assert!(!Lifecycle::is_route("fork"));
    }
}
