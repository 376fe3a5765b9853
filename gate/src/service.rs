//! The service types the API speaks, from `torpor_scheduler::service` (and
//! the store's list filter), re-exported so that implementers of
//! [`crate::SandboxApi`] need only this crate.

pub use torpor_scheduler::service::guest::{
    AgentLink, DirListing, ExecOutput, ExecRequest, ExitReply, FileKind, FileStat, OutputKind,
};
pub use torpor_scheduler::service::{
    check_lifetimes, check_template_name, Cancel, CreateCheckpoint, CreateSandbox, CreateTemplate,
    ForkSandbox, GuestCall, GuestError, Outcome, Owner, PodView, RestoreCheckpoint, Service,
    ServiceError, TemplateFromSandbox, VolumeMountRequest, MAX_FORK_COUNT, MAX_KEEP_ALIVE_MS,
    MAX_TEMPLATE_NAME_CHARS, MAX_TIMEOUT_MS,
};
pub use torpor_scheduler::store::SandboxFilter;
