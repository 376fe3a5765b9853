//! Template builds (issue 28): a build runs a [`plan::Plan`] in a sandbox
//! of its tenant — create from the source (or the newest cached layer),
//! run each step through the guest agent, snapshot a cache layer after
//! each step that changed the guest, start the start command, wait for its
//! ready check, snapshot the result as the named template — on a thread
//! of its own (`run.rs`), through the same backend and admission as the
//! tenant's own sandboxes. A build FROM an OCI image (a registry's, or an
//! uploaded archive) first makes it a template of the tenant's, its
//! `base` phase ([`image`]).
//!
//! [`Builds`] keeps every build's record: status, the step it is on, its
//! log, why it failed. Records are written to the builds directory as
//! they change, so a restart keeps them; a build a restart interrupted
//! reads as failed ("the server restarted during the build").

pub mod image;
pub mod plan;
pub mod run;
pub mod start;
pub mod surface;

pub use crate::build_registry::*;
