//! torpor-sandbox-api: the contract between the surfaces (/v1, E2B,
//! envd, the CLI) and the backends that serve them (a pod's own service,
//! the nested pod, a cluster's replicas and its pods' workers).
//!
//! [`Operation`] is the one list of the sandbox operations, a serde-tagged
//! enum with a typed request per operation; [`Reply`] the typed answer of
//! each; [`OpOutcome`] a reply or its [`OpError`] between processes, its
//! kinds the error [`code`]s every surface answers with. A cluster's replica sends an [`Operation`] through a pod's work
//! queue and the pod's worker dispatches it as it came, so a new operation
//! is one variant here and one arm in the dispatch (`torpor_api::dispatch`).

pub mod code;
mod lifecycle;
mod operation;
mod outcome;

pub use lifecycle::Lifecycle;
pub use operation::{LifecycleCall, Operation, Reply};
pub use outcome::{sanitized, OpError, OpOutcome};
