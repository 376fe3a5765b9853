//! `mount_volumes` (1.5): E2B's `volumeMounts`, the way E2B's envd mounts
//! them: the guest kernel's NFSv3 client mounts `127.0.0.1:/<volume>` at
//! the requested path. Nothing in the guest serves NFS: the agent listens
//! on the guest's loopback, port [`VOLUMES_PORT`], and relays each
//! connection over vsock to the same port on the host, where the VMM hands
//! it to the pod's NFS server for this sandbox's volumes (a unix socket
//! `<vsock uds>_2049`). The guest needs no network device for it.
//!
//! The mount is `hard` without attribute or lookup caching (E2B's options):
//! a pause cuts the relay's vsock connections, and the client retries on a
//! new connection after the resume instead of failing calls or serving
//! what another sandbox changed meanwhile. `nolock`: there is no lock
//! manager behind the relay (locks stay local to the guest).

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use crate::portfwd::{splice, Ends};
use crate::proto::{ErrorReply, MountVolumesRequest};
use crate::system::SystemOps;
use crate::vsock::VsockStream;

/// The NFS port: the guest's loopback listener, and the host's vsock port.
pub const VOLUMES_PORT: u16 = 2049;

/// `VMADDR_CID_HOST`.
const HOST_CID: u32 = 2;

/// At most this many volumes in one sandbox.
pub const MAX_MOUNTS: usize = 16;

/// Where the relay sends guest connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upstream {
    /// vsock to the host (`VMADDR_CID_HOST`), this port.
    Vsock(u32),
    /// A unix socket (host-side tests).
    Unix(PathBuf),
}

impl Default for Upstream {
    fn default() -> Self {
        Upstream::Vsock(u32::from(VOLUMES_PORT))
    }
}

/// The relay's settings: where it listens (a port of the guest's IPv4
/// loopback; 0 picks one, for tests) and where it sends connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayConfig {
    /// The loopback port.
    pub port: u16,
    /// The other end.
    pub upstream: Upstream,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            port: VOLUMES_PORT,
            upstream: Upstream::default(),
        }
    }
}

/// The relay, started by the first `mount_volumes` and kept for the
/// agent's life (it is in the guest's memory across snapshots).
#[derive(Debug, Default)]
pub struct Volumes {
    /// The port the relay listens on once started.
    relay: Mutex<Option<u16>>,
}

impl Volumes {
    /// Checks `req`, starts the relay if it is not running, and mounts each
    /// volume not already mounted at its path.
    pub fn mount(
        &self,
        req: &MountVolumesRequest,
        relay: &RelayConfig,
        ops: &dyn SystemOps,
    ) -> Result<(), ErrorReply> {
        check_mounts(&req.mounts)?;
        let port = self.relay_port(relay)?;
        for m in &req.mounts {
            let source = format!("127.0.0.1:/{}", m.name);
            ops.mount_nfs(&source, Path::new(&m.path), &options(port))
                .map_err(|e| ErrorReply::io(&m.path, &e))?;
        }
        Ok(())
    }

    fn relay_port(&self, cfg: &RelayConfig) -> Result<u16, ErrorReply> {
        let mut relay = self.relay.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(port) = *relay {
            return Ok(port);
        }
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, cfg.port));
        let listener = TcpListener::bind(addr)
            .map_err(|e| ErrorReply::io(&format!("volume relay on {addr}"), &e))?;
        let port = listener
            .local_addr()
            .map_err(|e| ErrorReply::io("volume relay", &e))?
            .port();
        let upstream = cfg.upstream.clone();
        std::thread::Builder::new()
            .name("volume-relay".into())
            .spawn(move || accept_loop(listener, upstream))
            .map_err(|e| ErrorReply::io("volume relay thread", &e))?;
        *relay = Some(port);
        Ok(port)
    }
}

/// The names and paths E2B accepts: a volume name of `[a-zA-Z0-9_-]`, 1 to
/// 128, and an absolute path that is not `/`, without `.`/`..` parts;
/// no path twice; at most [`MAX_MOUNTS`]. The host checks a create's
/// mounts with it too, before anything starts.
pub fn check_mounts(mounts: &[crate::proto::VolumeMount]) -> Result<(), ErrorReply> {
    if mounts.len() > MAX_MOUNTS {
        let msg = format!("at most {MAX_MOUNTS} volumes per sandbox");
        return Err(ErrorReply::new(libc::EINVAL, msg));
    }
    let mut seen = std::collections::BTreeSet::new();
    for m in mounts {
        let good_name = (1..=128).contains(&m.name.len())
            && m.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !good_name {
            let msg = format!("volume name {:?}: 1 to 128 of [a-zA-Z0-9_-]", m.name);
            return Err(ErrorReply::new(libc::EINVAL, msg));
        }
        let path = Path::new(&m.path);
        let mut parts = m.path.split('/').filter(|p| !p.is_empty()).peekable();
        let plain = m.path.starts_with('/')
            && !m.path.contains('\0')
            && parts.peek().is_some()
            && parts.all(|p| p != "." && p != "..");
        if !plain {
            let msg = format!(
                "mount path {:?}: an absolute path other than / without . or ..",
                m.path
            );
            return Err(ErrorReply::new(libc::EINVAL, msg));
        }
        if !seen.insert(path.components().collect::<PathBuf>()) {
            let msg = format!("mount path {:?} twice", m.path);
            return Err(ErrorReply::new(libc::EINVAL, msg));
        }
    }
    Ok(())
}

/// The kernel's NFS mount options (mount(2) data, as `mount.nfs` would
/// pass them): E2B's envd's set, with the addresses the kernel needs when
/// no `mount.nfs` resolves them, and `nolock`.
pub fn options(port: u16) -> String {
    format!(
        "vers=3,proto=tcp,port={port},mountvers=3,mountproto=tcp,mountport={port},\
         addr=127.0.0.1,mountaddr=127.0.0.1,hard,nolock,noacl,noac,lookupcache=none,\
         rsize=1048576,wsize=1048576"
    )
}

fn accept_loop(listener: TcpListener, upstream: Upstream) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let upstream = upstream.clone();
        let _ = std::thread::Builder::new()
            .name("volume-pipe".into())
            .spawn(move || relay(conn, &upstream));
    }
}

/// Pipes one guest connection to the host until either side ends it.
fn relay(guest: TcpStream, upstream: &Upstream) -> io::Result<()> {
    let _ = guest.set_nodelay(true);
    match upstream {
        Upstream::Vsock(port) => {
            let host = VsockStream::connect(HOST_CID, *port)?;
            let (reader, closer) = (host.try_clone()?, host.try_clone()?);
            let ends = Ends {
                from_host: reader,
                to_host: host,
                close_host: Box::new(move || closer.shutdown()),
            };
            splice(ends, guest)
        }
        Upstream::Unix(path) => {
            let host = UnixStream::connect(path)?;
            let (reader, closer) = (host.try_clone()?, host.try_clone()?);
            let ends = Ends {
                from_host: reader,
                to_host: host,
                close_host: Box::new(move || drop(closer.shutdown(std::net::Shutdown::Both))),
            };
            splice(ends, guest)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::VolumeMount;
    use crate::system::{FakeCall, FakeOps};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    fn req(mounts: &[(&str, &str)]) -> MountVolumesRequest {
        MountVolumesRequest {
            mounts: mounts
                .iter()
                .map(|(name, path)| VolumeMount {
                    name: (*name).into(),
                    path: (*path).into(),
                })
                .collect(),
        }
    }

    #[test]
    fn names_and_paths_are_checked_before_anything_is_mounted() {
        let ops = FakeOps::new().root(true);
        let v = Volumes::default();
        let cfg = RelayConfig {
            port: 0,
            upstream: Upstream::Unix("/nonexistent".into()),
        };
        for (bad, why) in [
            (req(&[("a/b", "/mnt/a")]), "volume name"),
            (req(&[("", "/mnt/a")]), "volume name"),
            (req(&[("data", "mnt/a")]), "mount path"),
            (req(&[("data", "/")]), "mount path"),
            (req(&[("data", "/mnt/../etc")]), "mount path"),
            (req(&[("data", "/mnt/./a")]), "mount path"),
            (req(&[("a", "/mnt/a"), ("b", "/mnt/a/")]), "twice"),
        ] {
            let e = v.mount(&bad, &cfg, &ops).unwrap_err();
            assert_eq!(e.code, "EINVAL", "{e}");
            assert!(e.message.contains(why), "{e}");
        }
        let many: Vec<(String, String)> = (0..=MAX_MOUNTS)
            .map(|i| (format!("v{i}"), format!("/mnt/{i}")))
            .collect();
        let many: Vec<(&str, &str)> = many.iter().map(|(a, b)| (&**a, &**b)).collect();
        assert_eq!(v.mount(&req(&many), &cfg, &ops).unwrap_err().code, "EINVAL");
        assert!(ops.calls().is_empty(), "{:?}", ops.calls());
        assert!(v.relay.lock().unwrap().is_none());
    }

    #[test]
    fn each_volume_is_mounted_from_the_relay_with_e2bs_options() {
        let ops = FakeOps::new().root(true);
        let v = Volumes::default();
        let cfg = RelayConfig {
            port: 0,
            upstream: Upstream::Unix("/nonexistent".into()),
        };
        v.mount(
            &req(&[("data", "/mnt/data"), ("b-2", "/home/user/b")]),
            &cfg,
            &ops,
        )
        .unwrap();
        let port = v.relay.lock().unwrap().unwrap();
        assert_ne!(port, 0);
        let want = |source: &str, target: &str| FakeCall::MountNfs {
            source: source.into(),
            target: target.into(),
            options: options(port),
        };
        assert_eq!(
            ops.calls(),
            [
                want("127.0.0.1:/data", "/mnt/data"),
                want("127.0.0.1:/b-2", "/home/user/b")
            ]
        );
        let o = options(port);
        for opt in [
            "vers=3",
            "proto=tcp",
            "hard",
            "nolock",
            "noac",
            "lookupcache=none",
        ] {
            assert!(o.split(',').any(|x| x == opt), "{o}");
        }
        assert!(o.contains(&format!(",port={port},")) && o.contains(&format!("mountport={port}")));
        // A second call reuses the relay; a failing mount names its path.
        let failing = FakeOps::new().root(true).failing("MountNfs", libc::EACCES);
        let e = v.mount(&req(&[("x", "/x")]), &cfg, &failing).unwrap_err();
        assert_eq!(
            (e.code.as_str(), e.message.contains("/x")),
            ("EACCES", true),
            "{e}"
        );
        assert_eq!(v.relay.lock().unwrap().unwrap(), port);
    }

    #[test]
    fn the_relay_pipes_each_guest_connection_to_the_host() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("v.sock_2049");
        let host = UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            for _ in 0..2 {
                let (mut s, _) = host.accept().unwrap();
                let mut buf = [0u8; 4];
                s.read_exact(&mut buf).unwrap();
                buf.reverse();
                s.write_all(&buf).unwrap();
            }
        });
        let v = Volumes::default();
        let cfg = RelayConfig {
            port: 0,
            upstream: Upstream::Unix(sock),
        };
        v.mount(&req(&[]), &cfg, &FakeOps::new()).unwrap();
        let port = v.relay.lock().unwrap().unwrap();
        // Two connections in turn, as a client reconnecting after a resume.
        for _ in 0..2 {
            let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
            c.write_all(b"abcd").unwrap();
            let mut back = [0u8; 4];
            c.read_exact(&mut back).unwrap();
            assert_eq!(&back, b"dcba");
            // The host's side ended: so does the guest's.
            assert_eq!(c.read(&mut back).unwrap(), 0);
        }
        server.join().unwrap();
    }
}
