//! torpor's scheduler: what a sandbox is, which state changes are legal, and
//! the durable store that records them.
//!
//! - [`model`]: the plain serde types (templates, sandboxes, pods,
//!   checkpoints) and their ids.
//! - [`state`]: the sandbox state machine: one table of legal transitions,
//!   and which API operations each state allows.
//! - [`store`]: SQLite in the data directory (`<data_dir>/torpor.db`): every
//!   mutating call is one transaction, committed (and fsynced) before it
//!   returns; an operations journal lets a restarted service find the work
//!   a crash interrupted.
//! - [`random`]: random bytes and hex from the kernel's CSPRNG (ids, temp
//!   names, tokens).
//! - [`files`]: crash-safe files for snapshots: atomic writes, and removal of
//!   temp files and snapshot directories the store no longer references.
//! - [`policy`]: the pod's admission and hibernation rules, driven by the
//!   service (wall clock, real VMMs) and by [`plan`] (simulated clock and
//!   pod, from an activity trace).
//! - [`trace`]: activity traces, as `torpor plan` reads them and `torpor
//!   serve --record-trace` writes them.
//! - [`net`]: the host side of sandbox networking: a namespace, tap, veth
//!   pair and NAT per sandbox, egress policy in nftables, leftover recovery.
//! - [`volumes`]: E2B's volumes served to guests over NFSv3, from a network
//!   namespace of the pod's own.
//!
//! Dependencies point one way: this crate may use `torpor-vmm`'s control
//! types, never the reverse. The API sits on top of it. Its modules import
//! each other one way too (tests/layering.rs): `random`, `state` and
//! `trace` at the bottom, then `net`, `model`, `names`, `policy`, `files`
//! and `images`, `volumes`, `store`, `service`, and `plan` on top.

/// An enum stored and shown as one lowercase word: `as_str`, `Display`,
/// `FromStr` and the list of all variants (`ALL`).
macro_rules! str_enum {
    ($(#[$meta:meta])* $vis:vis enum $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
                 serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
        #[serde(rename_all = "snake_case")]
        $vis enum $name { $($(#[$vmeta])* $variant,)+ }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The word this value is stored and shown as.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)+ }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = $crate::model::UnknownValue;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err($crate::model::UnknownValue {
                        kind: stringify!($name),
                        value: s.to_string(),
                    }),
                }
            }
        }
    };
}

pub mod files;
pub mod images;
pub mod model;
pub mod names;
pub mod net;
pub mod plan;
pub mod policy;
pub mod random;
pub mod service;
pub mod state;
pub mod store;
pub mod trace;
pub mod volumes;

pub use model::{
    Checkpoint, CheckpointId, OnTimeout, OperationId, Pod, PodAddress, PodId, Sandbox, SandboxId,
    Template, TemplateId, TemplateKind, TemplateState, Timestamp, VmmHandle,
};
pub use state::{can, transition, IllegalTransition, Operation, SandboxState};
pub use store::{Store, StoreError};
