//! torpor-sandbox-api: the contract between the surfaces (/v1, E2B,
//! envd, the CLI) and the backends that serve them (a pod's own service,
//! the nested pod, a cluster's replicas and its pods' workers).
//!
//! [`Operation`] is the one list of the sandbox operations, a serde-tagged
//! enum with a typed request per operation; [`Reply`] the typed answer of
//! each. A cluster's replica sends an [`Operation`] through a pod's work
//! queue and the pod's worker dispatches it as it came, so a new operation
//! is one variant here and one arm in the dispatch (`torpor_api::dispatch`).

mod lifecycle;
mod operation;

pub use lifecycle::Lifecycle;
pub use operation::{LifecycleCall, Operation, Reply};
