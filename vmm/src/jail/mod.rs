//! The jail a VMM process confines itself to, as root, from its
//! [`JailSpec`], before any guest code runs (see `docs/vmm.md`, "The
//! jail").
//!
//! [`enter`] does, in order:
//! 1. the cgroup: made (or the uid slot's reused) with its memory, pids
//!    and cpu limits ([`cgroup`], v1 or v2, detected);
//! 2. a pid namespace: `unshare(CLONE_NEWPID)` and a fork. The child is
//!    the VMM, pid 1 of its namespace; the parent stays outside as its
//!    supervisor ([`supervisor`]): it does nothing but wait, tells an OOM
//!    kill apart ([`EXIT_OOM`]) and removes the cgroup, and the VMM gets
//!    SIGKILL if the supervisor dies (so killing the process the pod
//!    started still ends the VM). The VMM reports its host pid in its
//!    `ready` line;
//! 3. in the VMM: the cgroup joined, new mount, ipc, uts and net
//!    namespaces, the jail's file system and `pivot_root` ([`mounts`]);
//! 4. rlimits, every capability dropped, the uid and gid, no_new_privs
//!    ([`creds`]).

pub mod cgroup;
mod creds;
mod mounts;
mod supervisor;

use std::path::PathBuf;

use torpor_vmm_api::jail::JailSpec;
use torpor_vmm_api::{ErrorKind, VmError};

pub use torpor_vmm_api::launch::EXIT_OOM;

/// Why a jail could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("setting up a jail needs root (running as uid {0}); use --no-jail to run without")]
    NotRoot(u32),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("jail: cannot {what}: {source}")]
    Sys {
        what: String,
        source: std::io::Error,
    },
    #[error("jail: device {path}: {source}")]
    Device {
        path: &'static str,
        source: std::io::Error,
    },
    #[error("jail: cannot expose {path}: {source}")]
    Expose {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("jail: path with a NUL byte: {0}")]
    BadPath(PathBuf),
}

impl JailError {
    /// Classified for the pod: a host that cannot jail is `unsupported`.
    pub fn vm_error(&self) -> VmError {
        let kind = match self {
            JailError::NotRoot(_) | JailError::Cgroup(_) | JailError::Device { .. } => {
                ErrorKind::Unsupported
            }
            JailError::Expose { .. } | JailError::BadPath(_) => ErrorKind::InvalidRequest,
            JailError::Sys { .. } => ErrorKind::Internal,
        };
        VmError::new(kind, self.to_string())
    }
}

/// `-1` return values as typed errors.
fn sys(ret: i32, what: impl FnOnce() -> String) -> Result<(), JailError> {
    if ret < 0 {
        Err(JailError::Sys {
            what: what(),
            source: std::io::Error::last_os_error(),
        })
    } else {
        Ok(())
    }
}

/// The jailed VMM.
#[derive(Debug, Clone, Copy)]
pub struct Entered {
    /// Its pid as the pod sees it (not 1, its pid in its own namespace).
    pub host_pid: u32,
}

/// Joins the network namespace at `path` (a sandbox's, with its tap).
pub(crate) fn join_net(path: &std::path::Path) -> Result<(), JailError> {
    use std::os::fd::AsRawFd;
    let ns = std::fs::File::open(path).map_err(|source| JailError::Sys {
        what: format!("open the network namespace {}", path.display()),
        source,
    })?;
    // SAFETY: setns takes a namespace descriptor we own and a flag; the
    // process is single-threaded here.
    let ret = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    sys(ret, || {
        format!("join the network namespace {}", path.display())
    })
}

/// Confines the calling process as `spec` says. Must run before any
/// thread is started (unshare of the mount namespace and fork need a
/// single-threaded process). With a pid namespace, the calling process
/// becomes the supervisor and never returns from here; the VMM does.
pub fn enter(spec: &JailSpec) -> Result<Entered, JailError> {
    // SAFETY: geteuid has no arguments and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(JailError::NotRoot(euid));
    }
    let nodes = mounts::host_devices(&spec.devices)?;
    let cgroup = spec
        .cgroup
        .as_ref()
        .map(cgroup::create_limited)
        .transpose()?;
    let host_pid = if spec.namespaces.pid {
        supervisor::fork_supervised(cgroup.as_ref())?
    } else {
        std::process::id()
    };
    if let Some(c) = &cgroup {
        c.join_self()?;
    }
    if let Some(path) = &spec.namespaces.join_net {
        join_net(path)?;
    }
    let mut flags = libc::CLONE_NEWNS;
    for (on, flag) in [
        (spec.namespaces.ipc, libc::CLONE_NEWIPC),
        (spec.namespaces.uts, libc::CLONE_NEWUTS),
        (
            spec.namespaces.net && spec.namespaces.join_net.is_none(),
            libc::CLONE_NEWNET,
        ),
    ] {
        if on {
            flags |= flag;
        }
    }
    // SAFETY: unshare takes flags only; the process is single-threaded.
    let ret = unsafe { libc::unshare(flags) };
    sys(ret, || "unshare the namespaces".into())?;
    if spec.namespaces.uts {
        let name = b"torpor-vmm";
        // SAFETY: a buffer of `name.len()` bytes alive for the call.
        let ret = unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) };
        sys(ret, || "set the host name".into())?;
    }
    mounts::build(spec, &nodes)?;
    creds::limit(&spec.rlimits)?;
    creds::drop_privileges(spec)?;
    if spec.namespaces.pid {
        // Changing credentials cleared the parent-death signal the fork
        // set: set it again, so the VMM dies with its supervisor.
        // SAFETY: prctl with integer arguments only.
        let ret = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
        sys(ret, || "set the parent-death signal".into())?;
    }
    Ok(Entered { host_pid })
}
