//! The volume gateway of a server in front of a nested pod. Its Linux
//! sandboxes run in the nested host, their volumes are on this host: the
//! nested pod relays each volume connection of a sandbox here
//! ([`crate::volumes::RelayHandle`]), through QEMU's user network (a
//! guest forward whose command, `torpor nested-volume-pipe`, connects to
//! this gateway's unix socket). A connection names its sandbox on its
//! first line; the gateway serves it the volumes this server recorded for
//! that sandbox when it created it (what the pod says is never asked), on
//! an export of its own for the connection's life, with the sandbox's
//! handle tag, so that its guest's mounts go on across pauses, restarts
//! of either server, and reconnections.

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::mounts::Mounts;
use super::ServiceError;
use crate::model::{MountedVolume, SandboxId};
use crate::volumes::{both_ways, read_greeting};

/// How long a connection may take to name its sandbox.
const GREETING_LIMIT: Duration = Duration::from_secs(10);

/// The volumes a sandbox of the nested pod mounts, as this server keeps
/// them (`None`: not one of its sandboxes, or none).
pub type VolumesOf = dyn Fn(&SandboxId) -> Option<Vec<MountedVolume>> + Send + Sync;

/// Whether `given` is `token` (in constant time).
fn same_token(given: &str, token: &str) -> bool {
    use subtle::ConstantTimeEq;
    given.as_bytes().ct_eq(token.as_bytes()).into()
}

/// The gateway, accepting until dropped.
#[derive(Debug)]
pub struct VolumeGateway {
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl VolumeGateway {
    /// Accepts on `socket` (mode 0600; a stale file replaced) and serves
    /// each connection the volumes `volumes_of` names for its sandbox,
    /// exported by `mounts` (this server's pod's). The per-connection
    /// exports' sockets are made in a directory beside `socket`.
    pub fn start(
        socket: &Path,
        mounts: Arc<Mounts>,
        volumes_of: Arc<VolumesOf>,
        token: String,
    ) -> Result<Self, ServiceError> {
        let io = |e: io::Error| {
            ServiceError::Internal(format!("volume gateway {}: {e}", socket.display()))
        };
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        match std::fs::remove_file(socket) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io(e)),
            _ => {}
        }
        let listener = UnixListener::bind(socket).map_err(io)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, dir) = (stop.clone(), socket.with_extension("d"));
        std::fs::create_dir_all(&dir).map_err(io)?;
        let thread = std::thread::Builder::new()
            .name("volume-gateway".into())
            .spawn(move || accept(&listener, &mounts, &*volumes_of, &token, &dir, &flag))
            .map_err(io)?;
        Ok(VolumeGateway {
            socket: socket.to_path_buf(),
            stop,
            thread: Some(thread),
        })
    }
}

fn accept(
    listener: &UnixListener,
    mounts: &Arc<Mounts>,
    volumes_of: &VolumesOf,
    token: &str,
    dir: &Path,
    stop: &AtomicBool,
) {
    static N: AtomicU64 = AtomicU64::new(0);
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(GREETING_LIMIT));
        let id = match read_greeting(&mut conn) {
            Ok((given, id)) if same_token(&given, token) => id,
            Ok(_) => {
                tracing::warn!("a volume gateway connection had a wrong token: closed");
                continue;
            }
            Err(e) => {
                tracing::warn!("a volume gateway connection did not name a sandbox: {e}");
                continue;
            }
        };
        let _ = conn.set_read_timeout(None);
        let Some(volumes) = volumes_of(&id).filter(|v| !v.is_empty()) else {
            tracing::warn!(sandbox = %id, "the nested pod relayed volumes of a sandbox that mounts none");
            continue;
        };
        let socket = dir.join(format!("{}.sock", N.fetch_add(1, Ordering::Relaxed)));
        let mounts = mounts.clone();
        let _ = std::thread::Builder::new()
            .name("volume-gateway-pipe".into())
            .spawn(move || {
                if let Err(e) = pipe(&mounts, &id, &volumes, &socket, conn) {
                    tracing::warn!(sandbox = %id, "a relayed volume connection failed: {e}");
                }
            });
    }
}

/// Serves `volumes` on an export of its own at `socket` and pipes `conn`
/// to it until either side ends.
fn pipe(
    mounts: &Mounts,
    id: &SandboxId,
    volumes: &[MountedVolume],
    socket: &Path,
    conn: UnixStream,
) -> Result<(), ServiceError> {
    let export = mounts.export(id, volumes, socket)?;
    let io = |e: io::Error| ServiceError::Internal(format!("volume export: {e}"));
    let nfs = UnixStream::connect(socket).map_err(io)?;
    both_ways(conn, nfs).map_err(io)?;
    drop(export);
    Ok(())
}

impl Drop for VolumeGateway {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = UnixStream::connect(&self.socket);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// `torpor nested-volume-pipe SOCKET`: what QEMU runs for each connection
/// of the nested host to the volume address (its stdin and stdout are the
/// connection): pipes them to the gateway's unix socket until either ends.
pub fn pipe_stdio(socket: &Path) -> io::Result<()> {
    use std::os::fd::AsFd;
    // The descriptors themselves: std's stdout buffers by line, and NFS
    // replies have no newlines.
    let mut stdin = std::fs::File::from(io::stdin().as_fd().try_clone_to_owned()?);
    let mut stdout = std::fs::File::from(io::stdout().as_fd().try_clone_to_owned()?);
    let gateway = UnixStream::connect(socket)?;
    let mut to_gateway = gateway.try_clone()?;
    let up = std::thread::spawn(move || {
        let _ = io::copy(&mut stdin, &mut to_gateway);
        let _ = to_gateway.shutdown(std::net::Shutdown::Write);
    });
    let mut from_gateway = gateway;
    let out = io::copy(&mut from_gateway, &mut stdout);
    drop(up);
    out.map(|_| ())
}
