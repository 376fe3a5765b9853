//! Exposed ports: a TCP listener on the pod (in the host namespace) per
//! exposed guest port, forwarding each connection to the sandbox's unique
//! address (its namespace DNATs that to the guest). Before connecting, the
//! proxy asks its [`PortTarget`] where the sandbox is now: that wakes a
//! hibernated sandbox (auto-resume on traffic) and follows it to the
//! network it was given on wake.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use torpor_sync::Locked;

use super::{NetError, NetManager};

/// Exposed ports a sandbox may have at most.
pub const MAX_PORTS_PER_SANDBOX: usize = 16;
/// Connections one exposed port carries at once; more wait in the
/// listen backlog.
const MAX_CONNECTIONS: usize = 64;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const ACCEPT_TICK: Duration = Duration::from_millis(50);

/// Where a sandbox's guest port is reachable now.
pub trait PortTarget: Send + Sync {
    /// Wakes the sandbox if it sleeps; its address for `guest_port`.
    fn target(&self, sandbox: &str, guest_port: u16) -> Result<SocketAddrV4, String>;
}

/// Errors exposing a port.
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    #[error("guest port {0} is already exposed")]
    Exists(u16),
    #[error("guest port {0} is not exposed")]
    NotExposed(u16),
    #[error("guest port must be 1 to 65535")]
    BadPort,
    #[error("a sandbox may expose at most {MAX_PORTS_PER_SANDBOX} ports")]
    TooMany,
    #[error("cannot listen for an exposed port: {0}")]
    Listen(String),
}

struct Listener {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The pod's exposed ports.
pub struct PortProxy {
    manager: Arc<NetManager>,
    ip: IpAddr,
    target: Arc<dyn PortTarget>,
    listeners: Mutex<HashMap<(String, u16), Listener>>,
}

impl std::fmt::Debug for PortProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortProxy").field("ip", &self.ip).finish()
    }
}

impl PortProxy {
    /// Ports listen on `ip` (loopback unless the operator says otherwise).
    pub fn new(manager: Arc<NetManager>, ip: IpAddr, target: Arc<dyn PortTarget>) -> Self {
        Self {
            manager,
            ip,
            target,
            listeners: Mutex::new(HashMap::new()),
        }
    }

    /// Exposes the sandbox's `guest_port` on `host_port` (0: any free
    /// one); returns the address it listens on.
    pub fn expose(
        &self,
        sandbox: &str,
        guest_port: u16,
        host_port: u16,
    ) -> Result<SocketAddr, PortError> {
        if guest_port == 0 {
            return Err(PortError::BadPort);
        }
        let mut listeners = self.listeners.locked();
        if listeners.contains_key(&(sandbox.to_string(), guest_port)) {
            return Err(PortError::Exists(guest_port));
        }
        if listeners.keys().filter(|(s, _)| s == sandbox).count() >= MAX_PORTS_PER_SANDBOX {
            return Err(PortError::TooMany);
        }
        let wanted = SocketAddr::new(self.ip, host_port);
        let socket = self
            .manager
            .enter_host(|| TcpListener::bind(wanted))
            .map_err(|e| PortError::Listen(e.to_string()))?
            .map_err(|e| PortError::Listen(format!("{wanted}: {e}")))?;
        let addr = socket
            .local_addr()
            .map_err(|e| PortError::Listen(e.to_string()))?;
        socket
            .set_nonblocking(true)
            .map_err(|e| PortError::Listen(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let accept = Accept {
            socket,
            stop: Arc::clone(&stop),
            sandbox: sandbox.to_string(),
            guest_port,
            manager: Arc::clone(&self.manager),
            target: Arc::clone(&self.target),
            open: Arc::new(AtomicUsize::new(0)),
        };
        let thread = std::thread::Builder::new()
            .name(format!("port-{guest_port}"))
            .spawn(move || accept.run())
            .map_err(|e| PortError::Listen(e.to_string()))?;
        listeners.insert(
            (sandbox.to_string(), guest_port),
            Listener {
                addr,
                stop,
                thread: Some(thread),
            },
        );
        tracing::info!(sandbox, guest_port, %addr, "exposed port");
        Ok(addr)
    }

    /// Stops forwarding the sandbox's `guest_port` (connections already
    /// made run on until either side closes).
    pub fn unexpose(&self, sandbox: &str, guest_port: u16) -> Result<(), PortError> {
        let removed = self
            .listeners
            .locked()
            .remove(&(sandbox.to_string(), guest_port));
        match removed {
            Some(listener) => {
                drop(listener);
                Ok(())
            }
            None => Err(PortError::NotExposed(guest_port)),
        }
    }

    /// Every port of the sandbox (it is deleted).
    pub fn unexpose_all(&self, sandbox: &str) {
        let gone: Vec<Listener> = {
            let mut listeners = self.listeners.locked();
            let keys: Vec<_> = listeners
                .keys()
                .filter(|(s, _)| s == sandbox)
                .cloned()
                .collect();
            keys.iter().filter_map(|k| listeners.remove(k)).collect()
        };
        drop(gone);
    }

    /// `(guest port, address)` of the sandbox's exposed ports.
    pub fn list(&self, sandbox: &str) -> Vec<(u16, SocketAddr)> {
        let mut out: Vec<_> = self
            .listeners
            .locked()
            .iter()
            .filter(|((s, _), _)| s == sandbox)
            .map(|((_, p), l)| (*p, l.addr))
            .collect();
        out.sort();
        out
    }
}

/// One exposed port's accept loop.
struct Accept {
    socket: TcpListener,
    stop: Arc<AtomicBool>,
    sandbox: String,
    guest_port: u16,
    manager: Arc<NetManager>,
    target: Arc<dyn PortTarget>,
    open: Arc<AtomicUsize>,
}

impl Accept {
    fn run(self) {
        while !self.stop.load(Ordering::Relaxed) {
            if self.open.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
                std::thread::sleep(ACCEPT_TICK);
                continue;
            }
            let client = match self.socket.accept() {
                Ok((client, _)) => client,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    std::thread::sleep(ACCEPT_TICK);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(sandbox = %self.sandbox, "exposed port accept: {e}");
                    std::thread::sleep(ACCEPT_TICK);
                    continue;
                }
            };
            self.open.fetch_add(1, Ordering::Relaxed);
            let (sandbox, port) = (self.sandbox.clone(), self.guest_port);
            let (manager, target, open) = (
                Arc::clone(&self.manager),
                Arc::clone(&self.target),
                Arc::clone(&self.open),
            );
            let spawned = std::thread::Builder::new()
                .name(format!("port-{port}-conn"))
                .spawn(move || {
                    if let Err(e) = forward(client, &sandbox, port, &manager, &*target) {
                        tracing::info!(%sandbox, port, "exposed port connection: {e}");
                    }
                    open.fetch_sub(1, Ordering::Relaxed);
                });
            if spawned.is_err() {
                self.open.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// Connects to where the sandbox is now and copies both ways.
fn forward(
    client: TcpStream,
    sandbox: &str,
    guest_port: u16,
    manager: &NetManager,
    target: &dyn PortTarget,
) -> Result<(), NetError> {
    let fail = |m: String| NetError::Config(m);
    client
        .set_nonblocking(false)
        .map_err(|e| fail(e.to_string()))?;
    let to = target.target(sandbox, guest_port).map_err(fail)?;
    let upstream = manager
        .enter_host(|| TcpStream::connect_timeout(&SocketAddr::V4(to), CONNECT_TIMEOUT))?
        .map_err(|e| fail(format!("{to}: {e}")))?;
    let _ = (client.set_nodelay(true), upstream.set_nodelay(true));
    let (c2, u2) = (
        client.try_clone().map_err(|e| fail(e.to_string()))?,
        upstream.try_clone().map_err(|e| fail(e.to_string()))?,
    );
    let back = std::thread::Builder::new()
        .name("port-copy".into())
        .spawn(move || copy(u2, c2))
        .map_err(|e| fail(e.to_string()))?;
    copy(client, upstream);
    let _ = back.join();
    Ok(())
}

/// Copies until EOF or an error, then half-closes the other side.
fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
