//! The server's thread in its private network namespace, the per-sandbox
//! NFS listeners there, and the relay from each sandbox's unix socket.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use nfs3_server::tcp::{NFSTcp, NFSTcpListener};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use super::fs::{Volume, VolumeFs};
use super::usage::Usage;
use super::{is_volume_name, VolumeError, VolumeExport};

/// How long [`VolumeServer::serve`] waits for the server's thread.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// One pod's NFS server for volumes: a thread in a network namespace of
/// its own, running the listeners and relays of every sandbox it serves
/// (module doc). Dropping it stops the thread and every export.
#[derive(Debug)]
pub struct VolumeServer {
    runtime: tokio::runtime::Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    netns: u64,
    generation: u64,
}

/// One sandbox's exports being served on its unix socket. Dropping it
/// stops serving them (the socket's connections included) and removes the
/// socket file.
#[derive(Debug)]
pub struct VolumeHandle {
    socket: PathBuf,
    /// The socket file's (device, inode): only that file is removed.
    socket_id: (u64, u64),
    port: u16,
    stop: Option<oneshot::Sender<()>>,
}

impl VolumeServer {
    /// Starts the server's thread: a new network namespace (which takes
    /// `CAP_SYS_ADMIN`), its `lo` up, and a current-thread runtime.
    pub fn start() -> Result<Self, VolumeError> {
        let (ready, started) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("torpor-volumes".into())
            .spawn(move || server_thread(ready))
            .map_err(VolumeError::Runtime)?;
        let (runtime, stop, netns) = started.recv().map_err(|_| VolumeError::Stopped)??;
        Ok(VolumeServer {
            runtime,
            stop: Some(stop),
            thread: Some(thread),
            netns,
            generation: generation(),
        })
    }

    /// The inode of the server's network namespace (`/proc/.../ns/net`):
    /// not the host's.
    pub fn netns_inode(&self) -> u64 {
        self.netns
    }

    /// Serve `exports` (one sandbox's volumes) to connections on the unix
    /// socket at `socket` (bound now, a stale file replaced, mode 0600).
    /// Dropping the handle stops serving and removes the socket file.
    /// Blocks the calling thread until the export's listener is bound on
    /// the server's thread (a round trip; at most 30 s before
    /// [`VolumeError::Stopped`]).
    ///
    /// `tag` is in every handle of the export: the same sandbox served
    /// again (its next VMM after a wake, or after a restart of the pod)
    /// with the same tag and the same exports in the same order keeps
    /// every handle its guest holds valid, so its mounts go on without a
    /// remount; another tag's handles are STALE.
    pub fn serve(
        &self,
        socket: &Path,
        exports: Vec<VolumeExport>,
        tag: u64,
    ) -> Result<VolumeHandle, VolumeError> {
        let volumes = open_exports(exports)?;
        let fs = VolumeFs::new(tag, volumes);
        let (listener, socket_id) = bind_socket(socket)?;
        let (ready, bound) = mpsc::channel();
        let (stop, stopped) = oneshot::channel();
        let generation = self.generation;
        self.runtime
            .spawn(export(listener, fs, generation, ready, stopped));
        let port = match bound.recv_timeout(READY_TIMEOUT) {
            Ok(Ok(port)) => port,
            Ok(Err(e)) => {
                let _ = std::fs::remove_file(socket);
                return Err(e);
            }
            Err(_) => {
                let _ = std::fs::remove_file(socket);
                return Err(VolumeError::Stopped);
            }
        };
        Ok(VolumeHandle {
            socket: socket.to_path_buf(),
            socket_id,
            port,
            stop: Some(stop),
        })
    }
}

impl Drop for VolumeServer {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl VolumeHandle {
    /// The unix socket served.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The port of this export's NFS listener on `127.0.0.1` in the
    /// server's own network namespace (not the host's).
    pub fn nfs_port(&self) -> u16 {
        self.port
    }
}

impl Drop for VolumeHandle {
    fn drop(&mut self) {
        self.stop.take();
        if let Ok(meta) = std::fs::symlink_metadata(&self.socket) {
            if (meta.dev(), meta.ino()) == self.socket_id {
                let _ = std::fs::remove_file(&self.socket);
            }
        }
    }
}

/// The crate's handle generation, and so its write verifier: one
/// constant, so that handles a guest holds stay valid across a restart of
/// the pod (our own checks, the tag and the inode, decide what a handle
/// names). The verifier exists to tell a client that unstable writes it
/// sent may be lost; this server writes them to the host's page cache,
/// which a restart of the pod keeps (a crash of the host does not: the
/// same as knfsd's verifier across a crash, which changes).
fn generation() -> u64 {
    u64::from_le_bytes(*b"torpor-v")
}

type Started = (tokio::runtime::Handle, oneshot::Sender<()>, u64);

/// The server's thread: into a namespace of its own, then the runtime
/// until the [`VolumeServer`] is dropped.
fn server_thread(ready: mpsc::Sender<Result<Started, VolumeError>>) {
    let setup = || -> Result<(tokio::runtime::Runtime, u64), VolumeError> {
        private_netns().map_err(VolumeError::Namespace)?;
        let netns = std::fs::metadata("/proc/thread-self/ns/net")
            .map_err(VolumeError::Namespace)?
            .ino();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("torpor-volumes-io")
            .build()
            .map_err(VolumeError::Runtime)?;
        Ok((runtime, netns))
    };
    match setup() {
        Err(e) => {
            let _ = ready.send(Err(e));
        }
        Ok((runtime, netns)) => {
            let (stop, stopped) = oneshot::channel::<()>();
            if ready
                .send(Ok((runtime.handle().clone(), stop, netns)))
                .is_ok()
            {
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            }
        }
    }
}

/// `unshare(CLONE_NEWNET)` for this thread, and `lo` up in the new
/// namespace.
fn private_netns() -> io::Result<()> {
    // SAFETY: unshare takes flags only; it changes this thread's namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let sock = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    // SAFETY: ifreq is plain data: all zeros is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS fills `req`, a valid ifreq that outlives the
    // call, on a socket we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS just set the union's flags member.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads `req`, a valid ifreq that outlives the
    // call, on a socket we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The exports checked and their directories open.
fn open_exports(exports: Vec<VolumeExport>) -> Result<Vec<Volume>, VolumeError> {
    let mut seen = HashSet::new();
    let mut volumes = Vec::with_capacity(exports.len());
    for VolumeExport { name, dir, limit } in exports {
        if !is_volume_name(&name) {
            return Err(VolumeError::BadName(name));
        }
        if !seen.insert(name.clone()) {
            return Err(VolumeError::DuplicateName(name));
        }
        let root = File::options()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&dir)
            .and_then(|f| Ok((f.metadata()?.ino(), f)))
            .and_then(|(ino, f)| Ok((ino, f, Usage::of(&dir, limit)?)));
        match root {
            Ok((ino, root, usage)) => volumes.push(Volume {
                name,
                root,
                ino,
                usage,
            }),
            Err(source) => {
                return Err(VolumeError::OpenVolume { name, dir, source });
            }
        }
    }
    Ok(volumes)
}

/// Binds the unix socket at `path` (a stale non-directory there removed),
/// mode 0600, non-blocking; answers it and its (device, inode).
pub(super) fn bind_socket(path: &Path) -> Result<(StdUnixListener, (u64, u64)), VolumeError> {
    let err = |source| VolumeError::Socket {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => return Err(err(io::Error::from_raw_os_error(libc::EISDIR))),
        Ok(_) => std::fs::remove_file(path).map_err(err)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let listener = StdUnixListener::bind(path).map_err(err)?;
    let setup = || -> io::Result<(u64, u64)> {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        let meta = std::fs::symlink_metadata(path)?;
        Ok((meta.dev(), meta.ino()))
    };
    match setup() {
        Ok(id) => Ok((listener, id)),
        Err(e) => {
            let _ = std::fs::remove_file(path);
            Err(err(e))
        }
    }
}

/// One sandbox's export, on the server's runtime: its NFS listener in the
/// namespace, and the relay from its unix socket, until `stopped`.
async fn export(
    socket: StdUnixListener,
    fs: VolumeFs,
    generation: u64,
    ready: mpsc::Sender<Result<u16, VolumeError>>,
    stopped: oneshot::Receiver<()>,
) {
    let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let nfs =
        match NFSTcpListener::bind_with_generation(&loopback.to_string(), fs, generation).await {
            Ok(nfs) => nfs,
            Err(e) => {
                let _ = ready.send(Err(VolumeError::Listener(e)));
                return;
            }
        };
    let port = nfs.get_listen_port();
    let socket = match UnixListener::from_std(socket) {
        Ok(socket) => socket,
        Err(e) => {
            let _ = ready.send(Err(VolumeError::Runtime(e)));
            return;
        }
    };
    if ready.send(Ok(port)).is_err() {
        return;
    }
    let mut relays = JoinSet::new();
    let target = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    tokio::select! {
        _ = stopped => {}
        r = nfs.handle_forever() => {
            tracing::warn!(error = ?r.err(), "volume NFS listener stopped");
        }
        () = accept(&socket, target, &mut relays) => {}
    }
    // Dropping `relays` aborts every relay: their NFS connections close.
}

/// Accepts the sandbox's connections, each relayed to its NFS listener.
async fn accept(socket: &UnixListener, target: SocketAddr, relays: &mut JoinSet<()>) {
    loop {
        while relays.try_join_next().is_some() {}
        match socket.accept().await {
            Ok((conn, _)) => {
                relays.spawn(relay(conn, target));
            }
            Err(e) => {
                // EMFILE and the like: try again soon rather than spin.
                tracing::warn!(error = %e, "volume socket accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One guest connection piped to the NFS listener (a TCP connection made
/// by this runtime's thread: in the server's namespace).
async fn relay(mut conn: UnixStream, target: SocketAddr) {
    let mut nfs = match TcpStream::connect(target).await {
        Ok(nfs) => nfs,
        Err(e) => {
            tracing::warn!(error = %e, "volume relay connect");
            return;
        }
    };
    let _ = nfs.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut conn, &mut nfs).await;
}
