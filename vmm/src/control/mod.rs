//! The per-VM control socket: a unix stream socket speaking one JSON object
//! per line. Each request gets exactly one response line.
//!
//! ```text
//! → {"op":"status"}
//! ← {"ok":true,"status":{"state":"running",...}}
//! → {"op":"pause"}
//! ← {"ok":true,"status":{"state":"paused",...}}
//! → {"op":"bogus"}
//! ← {"ok":false,"error":"invalid request: unknown variant `bogus` ..."}
//! ```

pub mod server;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use server::{bind, ControlServer, VmController};

/// Version of the control protocol, reported in every status.
pub const PROTOCOL_VERSION: u32 = 1;

/// A request on the control socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Status,
    Pause,
    Resume,
    Shutdown,
}

/// Run state as seen from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    Running,
    Paused,
    ShuttingDown,
}

/// Answer to every successful request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmStatus {
    pub protocol: u32,
    pub state: VmState,
    pub pid: u32,
    pub vcpus: u16,
    pub mem_mib: u64,
    pub kernel: String,
    pub uptime_ms: u64,
}

/// One response line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Response {
    Ok { ok: bool, status: VmStatus },
    Err { ok: bool, error: String },
}

/// Errors of a control-socket client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to control socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("control socket I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("the VMM closed the connection without answering")]
    NoAnswer,
    #[error("malformed answer from the VMM: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("the VMM refused the request: {0}")]
    Refused(String),
}

/// Sends one request and waits for its answer.
pub fn request(socket: &Path, req: &Request, timeout: Duration) -> Result<VmStatus, ClientError> {
    let mut stream = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
        path: socket.display().to_string(),
        source,
    })?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut line = serde_json::to_string(req)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut answer = String::new();
    if BufReader::new(stream).read_line(&mut answer)? == 0 {
        return Err(ClientError::NoAnswer);
    }
    match serde_json::from_str(&answer)? {
        Response::Ok { status, .. } => Ok(status),
        Response::Err { error, .. } => Err(ClientError::Refused(error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_is_stable() {
        assert_eq!(
            serde_json::to_string(&Request::Pause).unwrap(),
            r#"{"op":"pause"}"#
        );
        let r: Request = serde_json::from_str(r#"{"op":"shutdown"}"#).unwrap();
        assert_eq!(r, Request::Shutdown);
        assert!(serde_json::from_str::<Request>(r#"{"op":"explode"}"#).is_err());
        let e: Response = serde_json::from_str(r#"{"ok":false,"error":"x"}"#).unwrap();
        assert!(matches!(e, Response::Err { .. }));
    }
}
