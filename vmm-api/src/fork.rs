//! The VMM fork server's protocol: how a pod has `torpor-vmm --fork-server`
//! start its VMM processes by `fork` instead of `exec`.
//!
//! An exec'd VMM pays the kernel's exec, its static PIE's relocations and
//! its runtime's start (about 2 ms here, 0.7 ms of which any exec costs),
//! and each keeps its own relocated copy of the binary's read-only data
//! (~0.3 MiB of every clone's PSS). A fork server is one `torpor-vmm`
//! started once, which forks a child per request: the child has the
//! parent's relocated pages shared (copy-on-write, never written) and runs
//! exactly what an exec'd `torpor-vmm` runs from reading its
//! [`crate::LaunchSpec`] on.
//!
//! The pod and the fork server share a `SOCK_SEQPACKET` socket pair (the
//! server's stdin). Each request is one [`ForkRequest`] datagram (JSON)
//! carrying, as `SCM_RIGHTS`, exactly [`FORK_FDS`] descriptors: the
//! child's stdin (the pipe its launch spec comes through), stdout (its
//! reply line) and stderr (its log file). The server answers one
//! [`ForkReply`]. The child is made with `CLONE_PARENT`: it is the pod's
//! child, as an exec'd VMM is, so the pod waits for it and reads its exit
//! status itself; the fork server keeps nothing of it.
//!
//! All children of one fork server share its address-space layout (as
//! Android's zygote's do): a pod retires a fork server after
//! [`MAX_FORKS_PER_SERVER`] forks and starts a fresh one (a new layout).

use serde::{Deserialize, Serialize};

/// Descriptors each [`ForkRequest`] carries: stdin, stdout, stderr.
pub const FORK_FDS: usize = 3;
/// Largest request or reply datagram.
pub const MAX_FORK_MESSAGE: usize = 4096;
/// Forks after which a pod replaces its fork server (a new ASLR layout).
pub const MAX_FORKS_PER_SERVER: u64 = 256;

/// One request to the fork server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum ForkRequest {
    /// Fork a VMM with the [`FORK_FDS`] descriptors sent beside this as
    /// its stdin, stdout and stderr, in a process group of its own. (A
    /// struct variant: serde lets a unit variant of a tagged enum carry
    /// unknown fields.)
    Fork {},
}

/// The fork server's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case", deny_unknown_fields)]
pub enum ForkReply {
    /// The child runs; the pod is its parent.
    Forked { pid: u32 },
    /// No child: why (the request was malformed, or `clone` failed with
    /// `errno`).
    Failed {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        errno: Option<i32>,
        message: String,
    },
}

impl ForkRequest {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(b).map_err(|e| format!("not a fork request: {e}"))
    }
}

impl ForkReply {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(b).map_err(|e| format!("not a fork reply: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_keep_their_shape() {
        assert_eq!(ForkRequest::Fork {}.to_bytes(), br#"{"op":"fork"}"#);
        assert_eq!(
            ForkRequest::from_bytes(br#"{"op":"fork"}"#),
            Ok(ForkRequest::Fork {})
        );
        let r = ForkReply::Forked { pid: 42 };
        assert_eq!(r.to_bytes(), br#"{"result":"forked","pid":42}"#);
        assert_eq!(ForkReply::from_bytes(&r.to_bytes()), Ok(r));
        let f = ForkReply::Failed {
            errno: Some(11),
            message: "clone: EAGAIN".into(),
        };
        assert_eq!(ForkReply::from_bytes(&f.to_bytes()), Ok(f));
        assert!(ForkRequest::from_bytes(br#"{"op":"exec"}"#).is_err());
        assert!(ForkRequest::from_bytes(br#"{"op":"fork","argv":["sh"]}"#).is_err());
    }
}
