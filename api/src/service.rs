//! The service types the API speaks, from `torpor_scheduler::service` (and
//! the store's list filter), re-exported so that implementers of
//! [`crate::SandboxApi`] need only this crate.

pub use torpor_scheduler::service::guest::{
    DirListing, ExecOutput, ExecRequest, ExitReply, FileKind, FileStat, OutputKind,
};
pub use torpor_scheduler::service::{
    CreateCheckpoint, CreateSandbox, CreateTemplate, ForkSandbox, GuestCall, GuestError, Outcome,
    PodView, RestoreCheckpoint, Service, ServiceError,
};
pub use torpor_scheduler::store::SandboxFilter;
