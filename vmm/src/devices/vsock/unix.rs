//! The host side of vsock, Firecracker's "hybrid" convention: the host
//! connects to the unix socket at `uds_path` and writes `CONNECT <port>\n`
//! to reach guest port `port` (answered `OK <host_port>\n`); a guest
//! connecting to host port P reaches the unix socket `<uds_path>_P`.

use std::io::{ErrorKind, Read};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Longest handshake line accepted ("CONNECT 4294967295\n" is 19 bytes).
const MAX_LINE: usize = 32;

/// Errors of the host-side unix sockets.
#[derive(Debug, thiserror::Error)]
pub enum UnixError {
    #[error("cannot bind the vsock socket {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("vsock socket {0} belongs to a live process")]
    InUse(PathBuf),
}

/// The listening socket, removed from the filesystem on drop if it is still
/// the one this device bound.
#[derive(Debug)]
pub struct Listener {
    pub socket: UnixListener,
    path: PathBuf,
    inode: Option<(u64, u64)>,
}

fn inode(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

impl Listener {
    /// Binds `path`, replacing a stale socket file but never one a live
    /// process still accepts on.
    pub fn bind(path: &Path) -> Result<Self, UnixError> {
        let bind_err = |source| UnixError::Bind {
            path: path.into(),
            source,
        };
        let socket = match UnixListener::bind(path) {
            Ok(s) => s,
            Err(e) if e.kind() == ErrorKind::AddrInUse => {
                if UnixStream::connect(path).is_ok() {
                    return Err(UnixError::InUse(path.into()));
                }
                std::fs::remove_file(path).map_err(bind_err)?;
                UnixListener::bind(path).map_err(bind_err)?
            }
            Err(e) => return Err(bind_err(e)),
        };
        socket.set_nonblocking(true).map_err(bind_err)?;
        Ok(Self {
            socket,
            path: path.into(),
            inode: inode(path),
        })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if self.inode.is_some() && inode(&self.path) == self.inode {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

pub use torpor_vmm_api::launch::guest_target;

/// Connects without blocking: a host listener whose backlog is full fails
/// the connection (EAGAIN) instead of stalling the device thread.
pub fn connect_nonblocking(path: &Path) -> std::io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    let mut addr = libc::sockaddr_un {
        sun_family: libc::AF_UNIX as libc::sa_family_t,
        sun_path: [0; 108],
    };
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(ErrorKind::InvalidInput.into());
    }
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a socket we just created and nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un that outlives the call and
    // `len` does not exceed its size (checked above).
    let r = unsafe {
        libc::connect(
            fd,
            (&addr as *const libc::sockaddr_un).cast::<libc::sockaddr>(),
            len as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(UnixStream::from(owned))
}

/// A host connection that has not yet said which guest port it wants.
#[derive(Debug)]
pub struct Handshake {
    pub stream: UnixStream,
    line: Vec<u8>,
    pub deadline: Instant,
}

/// Result of reading what a handshake has to say so far.
#[derive(Debug, PartialEq, Eq)]
pub enum HandshakeStep {
    /// Not a whole line yet.
    Incomplete,
    /// `CONNECT <port>` received.
    Connect(u32),
    /// Garbage, too long, or the host went away: drop it.
    Failed,
}

impl Handshake {
    pub fn new(stream: UnixStream, deadline: Instant) -> Self {
        Self {
            stream,
            line: Vec::new(),
            deadline,
        }
    }

    /// Reads byte by byte, so nothing after the line is consumed: data the
    /// host sends right behind it stays in the socket for the guest.
    pub fn advance(&mut self) -> HandshakeStep {
        let mut byte = [0u8; 1];
        loop {
            match self.stream.read(&mut byte) {
                Ok(0) => return HandshakeStep::Failed,
                Ok(_) if byte[0] == b'\n' => return parse_connect(&self.line),
                Ok(_) if self.line.len() >= MAX_LINE => return HandshakeStep::Failed,
                Ok(_) => self.line.push(byte[0]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return HandshakeStep::Incomplete,
                Err(_) => return HandshakeStep::Failed,
            }
        }
    }
}

/// Parses `CONNECT <port>` (a trailing `\r` is tolerated).
pub fn parse_connect(line: &[u8]) -> HandshakeStep {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    std::str::from_utf8(line)
        .ok()
        .and_then(|l| l.strip_prefix("CONNECT "))
        .and_then(|port| port.parse::<u32>().ok())
        .map_or(HandshakeStep::Failed, HandshakeStep::Connect)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_connect_lines() {
        assert_eq!(parse_connect(b"CONNECT 52"), HandshakeStep::Connect(52));
        assert_eq!(parse_connect(b"CONNECT 7\r"), HandshakeStep::Connect(7));
        for bad in [
            &b"CONNECT"[..],
            b"CONNECT -1",
            b"connect 5",
            b"CONNECT 99999999999",
            b"",
        ] {
            assert_eq!(parse_connect(bad), HandshakeStep::Failed);
        }
    }

    #[test]
    fn binds_over_stale_sockets_but_not_live_ones_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let first = Listener::bind(&path).unwrap();
        assert!(matches!(Listener::bind(&path), Err(UnixError::InUse(_))));
        drop(first);
        assert!(!path.exists(), "removed on drop");
        // A stale file (nobody listening) is replaced.
        drop(UnixListener::bind(&path).unwrap());
        let _second = Listener::bind(&path).unwrap();
        assert_eq!(guest_target(&path, 52), dir.path().join("v.sock_52"));
        assert!(connect_nonblocking(&guest_target(&path, 1)).is_err());
        assert!(connect_nonblocking(&path).is_ok());
    }
}
