//! How a VMM classifies what went wrong, so that a pod and its API answer
//! with the right status instead of a bare internal error.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The kind of a VMM failure. The API maps it to a status: `InvalidRequest`
/// 400, `WrongState` and `NotPaused` 409, `NoSpace` 507, `Unsupported` 501,
/// `GuestGone` 410, the rest 500.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request or launch spec is malformed or names something invalid.
    InvalidRequest,
    /// A snapshot of a VM that is not paused.
    NotPaused,
    /// The VM is in the wrong state for the request (e.g. a restore sent to
    /// a VMM that already runs a VM).
    WrongState,
    /// The disk (or a quota) is full: `ENOSPC`, `EDQUOT`, `EFBIG`.
    NoSpace,
    /// A snapshot layer is corrupt, truncated, of another version or of
    /// another machine; [`VmError::layer`] names it.
    BadSnapshot,
    /// The VM has ended or is ending (guest reset, vCPU failure, shutdown).
    GuestGone,
    /// This host cannot do it (e.g. a memory backend the kernel lacks).
    Unsupported,
    /// Any other host I/O failure.
    Io,
    /// A bug or a state the VMM did not expect.
    Internal,
}

impl ErrorKind {
    /// The kind of a host I/O error: a full disk is told apart.
    pub fn of_io(e: &std::io::Error) -> Self {
        const NO_SPACE: [i32; 3] = [
            28,  /* ENOSPC */
            122, /* EDQUOT */
            27,  /* EFBIG */
        ];
        match e.raw_os_error() {
            Some(code) if NO_SPACE.contains(&code) => ErrorKind::NoSpace,
            _ if e.kind() == std::io::ErrorKind::StorageFull => ErrorKind::NoSpace,
            _ => ErrorKind::Io,
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::NotPaused => "not_paused",
            ErrorKind::WrongState => "wrong_state",
            ErrorKind::NoSpace => "no_space",
            ErrorKind::BadSnapshot => "bad_snapshot",
            ErrorKind::GuestGone => "guest_gone",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Io => "io",
            ErrorKind::Internal => "internal",
        };
        f.write_str(name)
    }
}

/// A classified VMM failure with its message (and the snapshot layer it
/// concerns, for [`ErrorKind::BadSnapshot`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct VmError {
    pub kind: ErrorKind,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<PathBuf>,
}

impl VmError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            layer: None,
        }
    }

    pub fn with_layer(mut self, layer: impl Into<PathBuf>) -> Self {
        self.layer = Some(layer.into());
        self
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_disks_are_told_apart() {
        let full = std::io::Error::from_raw_os_error(28);
        assert_eq!(ErrorKind::of_io(&full), ErrorKind::NoSpace);
        let quota = std::io::Error::from_raw_os_error(122);
        assert_eq!(ErrorKind::of_io(&quota), ErrorKind::NoSpace);
        let denied = std::io::Error::from_raw_os_error(13);
        assert_eq!(ErrorKind::of_io(&denied), ErrorKind::Io);
    }

    #[test]
    fn wire_names_are_snake_case() {
        let e = VmError::new(ErrorKind::BadSnapshot, "crc").with_layer("/s/1");
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(
            json,
            r#"{"kind":"bad_snapshot","message":"crc","layer":"/s/1"}"#
        );
        assert_eq!(serde_json::from_str::<VmError>(&json).unwrap(), e);
        assert_eq!(ErrorKind::NoSpace.to_string(), "no_space");
    }
}
