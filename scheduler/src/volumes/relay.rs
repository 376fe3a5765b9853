//! A nested pod's end of its sandboxes' volumes. The volumes are on the
//! host of the server in front of the pod, not in the nested host: the pod
//! accepts a sandbox's guest connections on the same socket as a pod that
//! serves them itself (`<vsock uds>_2049`) and pipes each one to that
//! server (QEMU's user network forwards the address to the server's
//! volume gateway), after one line naming the sandbox and carrying the
//! pod's token ([`greeting`]: the address is one of the nested host's
//! network, which a guest with a network could reach too). The server
//! serves the volumes it recorded for that sandbox: the pod names the
//! sandbox, never a volume.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::serve::bind_socket;
use super::VolumeError;
use crate::model::SandboxId;

/// The first word of a relayed connection's first line.
const GREETING: &str = "TORPOR-VOLUMES/1";
/// The longest first line a gateway reads.
pub const MAX_GREETING: usize = 256;
/// How long the pod waits for the server's gateway to take a connection.
const CONNECT_LIMIT: Duration = Duration::from_secs(10);

/// Where a nested pod relays its sandboxes' volume connections, and the
/// token it proves itself with (the pod's own, which the server in front
/// of it made).
#[derive(Clone, PartialEq, Eq)]
pub struct VolumesRelay {
    /// The server's volume gateway, as the pod reaches it.
    pub addr: SocketAddr,
    /// 1 to 128 printable ASCII characters, no spaces.
    pub token: String,
}

impl std::fmt::Debug for VolumesRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumesRelay")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// The line a relayed connection starts with: the pod's token and which
/// sandbox it is for.
pub fn greeting(token: &str, id: &SandboxId) -> String {
    format!("{GREETING} {token} {id}\n")
}

/// Reads a relayed connection's first line (at most [`MAX_GREETING`]
/// bytes, one byte at a time: what follows is the client's NFS) and
/// answers the token and the sandbox it names.
pub fn read_greeting(conn: &mut impl Read) -> io::Result<(String, SandboxId)> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < MAX_GREETING {
        if conn.read(&mut byte)? == 0 {
            break;
        }
        if byte[0] == b'\n' {
            let bad = || io::Error::new(io::ErrorKind::InvalidData, "not a volume relay greeting");
            let text = std::str::from_utf8(&line).map_err(|_| bad())?;
            let (token, id) = text
                .strip_prefix(GREETING)
                .and_then(|r| r.strip_prefix(' '))
                .and_then(|r| r.split_once(' '))
                .filter(|(token, id)| {
                    (1..=128).contains(&token.len())
                        && token.bytes().all(|b| b.is_ascii_graphic())
                        && id.starts_with("sbx_")
                        && id.len() <= 64
                        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                })
                .ok_or_else(bad)?;
            return Ok((token.to_string(), SandboxId::new(id)));
        }
        line.push(byte[0]);
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "no volume relay greeting",
    ))
}

/// One sandbox's volume connections relayed to the server in front of the
/// pod, until dropped (the socket file is then removed).
#[derive(Debug)]
pub struct RelayHandle {
    socket: PathBuf,
    socket_id: (u64, u64),
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RelayHandle {
    /// Accepts on `socket` (bound now, a stale file replaced, mode 0600)
    /// and pipes each connection to `to`'s address, greeted with its token
    /// and `id`.
    pub fn start(socket: &Path, to: &VolumesRelay, id: &SandboxId) -> Result<Self, VolumeError> {
        let (listener, socket_id) = bind_socket(socket)?;
        listener
            .set_nonblocking(false)
            .map_err(|source| VolumeError::Socket {
                path: socket.to_path_buf(),
                source,
            })?;
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, hello, addr) = (stop.clone(), greeting(&to.token, id), to.addr);
        let thread = std::thread::Builder::new()
            .name("volume-relay".into())
            .spawn(move || accept(&listener, addr, &hello, &flag))
            .map_err(VolumeError::Runtime)?;
        Ok(RelayHandle {
            socket: socket.to_path_buf(),
            socket_id,
            stop,
            thread: Some(thread),
        })
    }
}

fn accept(listener: &UnixListener, to: SocketAddr, hello: &str, stop: &AtomicBool) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else { continue };
        let hello = hello.to_string();
        let _ = std::thread::Builder::new()
            .name("volume-pipe".into())
            .spawn(move || {
                if let Err(e) = pipe(conn, to, &hello) {
                    tracing::debug!("a relayed volume connection ended: {e}");
                }
            });
    }
}

/// Greets the server at `to` and pipes `guest` and it both ways until
/// either ends.
fn pipe(guest: UnixStream, to: SocketAddr, hello: &str) -> io::Result<()> {
    let mut server = TcpStream::connect_timeout(&to, CONNECT_LIMIT)?;
    let _ = server.set_nodelay(true);
    server.write_all(hello.as_bytes())?;
    both_ways(guest, server)
}

/// A connection [`both_ways`] pipes.
pub trait Duplex: Read + Write + Send + Sized + 'static {
    /// Another handle on it.
    fn another(&self) -> io::Result<Self>;
    /// `shutdown(2)`.
    fn end(&self, how: Shutdown);
}

impl Duplex for UnixStream {
    fn another(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn end(&self, how: Shutdown) {
        let _ = self.shutdown(how);
    }
}

impl Duplex for TcpStream {
    fn another(&self) -> io::Result<Self> {
        self.try_clone()
    }
    fn end(&self, how: Shutdown) {
        let _ = self.shutdown(how);
    }
}

/// Copies `a` to `b` and `b` to `a` until `b` ends (or either fails): `a`
/// ending shuts `b`'s writing side (its peer sees the end and may still
/// answer); then both are shut.
pub fn both_ways(a: impl Duplex, b: impl Duplex) -> io::Result<()> {
    let (mut from_a, mut to_b) = (a.another()?, b.another()?);
    let up = std::thread::spawn(move || {
        let _ = io::copy(&mut from_a, &mut to_b);
        to_b.end(Shutdown::Write);
    });
    let (mut from_b, mut to_a) = (b, a);
    let _ = io::copy(&mut from_b, &mut to_a);
    to_a.end(Shutdown::Both);
    from_b.end(Shutdown::Both);
    let _ = up.join();
    Ok(())
}

impl Drop for RelayHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept, which then sees the flag.
        let _ = UnixStream::connect(&self.socket);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        if let Ok(meta) = std::fs::symlink_metadata(&self.socket) {
            if (meta.dev(), meta.ino()) == self.socket_id {
                let _ = std::fs::remove_file(&self.socket);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn greetings_name_a_sandbox_and_nothing_else() {
        let id = SandboxId::new("sbx_0123456789abcdef");
        let mut line = io::Cursor::new(format!("{}NFS...", greeting("t0k3n", &id)));
        assert_eq!(read_greeting(&mut line).unwrap(), ("t0k3n".to_string(), id));
        let mut rest = String::new();
        line.read_to_string(&mut rest).unwrap();
        assert_eq!(
            rest, "NFS...",
            "the greeting's reader took the client's bytes"
        );
        for bad in [
            "TORPOR-VOLUMES/1 t ../etc\n",
            "TORPOR-VOLUMES/1 t sbx_a b\n",
            "TORPOR-VOLUMES/1 sbx_a\n",
            "TORPOR-VOLUMES/2 t sbx_a\n",
            "sbx_a\n",
            "TORPOR-VOLUMES/1 t sbx_a",
        ] {
            assert!(read_greeting(&mut io::Cursor::new(bad)).is_err(), "{bad:?}");
        }
        let long = format!("TORPOR-VOLUMES/1 t sbx_{}\n", "a".repeat(300));
        assert!(read_greeting(&mut io::Cursor::new(long)).is_err());
    }

    #[test]
    fn each_connection_is_greeted_and_piped_until_the_handle_drops() {
        let dir = tempfile::tempdir().unwrap();
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let to = server.local_addr().unwrap();
        let id = SandboxId::new("sbx_00aa");
        let socket = dir.path().join("vsock.sock_2049");
        let to = VolumesRelay {
            addr: to,
            token: "tok".into(),
        };
        let relay = RelayHandle::start(&socket, &to, &id).unwrap();
        let echo = std::thread::spawn(move || {
            for _ in 0..2 {
                let (mut c, _) = server.accept().unwrap();
                let (token, who) = read_greeting(&mut c).unwrap();
                assert_eq!(token, "tok");
                let mut buf = [0u8; 3];
                c.read_exact(&mut buf).unwrap();
                c.write_all(format!("{who}:").as_bytes()).unwrap();
                c.write_all(&buf).unwrap();
            }
        });
        for _ in 0..2 {
            let mut guest = UnixStream::connect(&socket).unwrap();
            guest.write_all(b"abc").unwrap();
            let mut back = String::new();
            guest.read_to_string(&mut back).unwrap();
            assert_eq!(back, "sbx_00aa:abc");
        }
        echo.join().unwrap();
        drop(relay);
        assert!(!socket.exists(), "the socket outlived its relay");
    }
}
