//! What torpor's pod and its VMM processes share, and nothing else.
//!
//! - [`launch`]: the [`LaunchSpec`] a VMM process starts from (read as one
//!   JSON document on its stdin) and the one-line [`LaunchReply`] it
//!   answers with on stdout once its control socket serves, or with the
//!   typed reason it could not start.
//! - [`control`]: the per-VM control socket's requests and answers, and a
//!   blocking client.
//! - [`error`]: [`ErrorKind`], how the VMM classifies a failure so the API
//!   can answer with the right status.
//! - [`jail`]: the [`JailSpec`] a VMM confines itself to before any guest
//!   code runs.
//! - [`lineage`]: the small record written with each snapshot layer that
//!   names its chain, so nobody reads layers' state to list it.
//!
//! - [`fork`]: the VMM fork server's requests and replies (a pod's VMMs
//!   forked from one `torpor-vmm` rather than exec'd).
//! - [`lazy`]: the map a lazily fetched memory file is shared through
//!   (present bits, wanted chunks) while a cold wake runs.
//! - [`shmem`]: `uffd-shared`'s shared template copies.
//!
//! Depends on serde (and libc): the scheduler links this, not KVM, vm-memory or
//! userfaultfd.

pub mod control;
pub mod error;
pub mod exposes;
pub mod fork;
pub mod host;
pub mod jail;
pub mod launch;
pub mod lazy;
pub mod lineage;
pub mod shmem;
pub mod sparse;
pub mod vcpus;

pub use error::{ErrorKind, VmError};
pub use jail::JailSpec;
pub use launch::{
    Console, DirtyTracking, DiskSpec, KernelSource, LaunchMode, LaunchReply, LaunchSpec, MacAddr,
    MemoryBackend, NetSpec, RateLimit, RestoreSpec, SeccompLevel, TokenRate,
};
pub use lineage::Lineage;
