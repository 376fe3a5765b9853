//! Network namespaces for tests: a namespace of the test's own, and a
//! stand-in guest (a namespace whose tap is relayed frame by frame to a
//! sandbox's tap, vnet headers and all, as the VMM's virtio-net does).

use std::net::{SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_scheduler::net::SandboxNet;
use torpor_vmm::devices::net::{Tap, VNET_HDR_LEN};

pub struct Ns(pub String);

impl Ns {
    pub fn new(name: String) -> Self {
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        ip(&["netns", "add", &name]);
        Ns(name)
    }

    pub fn path(&self) -> std::path::PathBuf {
        std::path::Path::new("/run/netns").join(&self.0)
    }

    pub fn ip(&self, args: &[&str]) {
        let mut full = vec!["-n", self.0.as_str()];
        full.extend_from_slice(args);
        ip(&full);
    }

    /// Runs `f` on a thread inside the namespace (sockets made there
    /// belong there).
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let file = std::fs::File::open(self.path()).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: setns on a namespace descriptor we hold; only this
                // short-lived thread changes namespace.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .unwrap()
        })
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// Runs `ip ARGS` (`ip netns exec NS CMD...` runs CMD in NS); its stdout.
pub fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Fails loudly without root, nft or /dev/net/tun (scripts/test leaves
/// such tests out where these are missing: tests/needs).
pub fn needs_root_and_nft() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(root, "needs root (namespaces, veths, nftables)");
    let nft = Command::new("nft").arg("--version").output();
    assert!(
        nft.is_ok_and(|o| o.status.success()) && std::path::Path::new("/dev/net/tun").exists(),
        "needs nft (apt-get install nftables) and /dev/net/tun"
    );
}

/// Copies frames between two taps until dropped (what a VMM's virtio-net
/// does between the guest and its tap).
pub struct Relay {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    pub fn new(a: Tap, b: Tap) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; VNET_HDR_LEN + 65_550];
            while !flag.load(Ordering::Relaxed) {
                let mut fds = [a.fd(), b.fd()].map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
                // SAFETY: `fds` is an array of two pollfds, alive for the call.
                unsafe { libc::poll(fds.as_mut_ptr(), 2, 20) };
                for (from, to) in [(&a, &b), (&b, &a)] {
                    while let Ok(n) = from.read(&mut buf) {
                        let _ = to.write(&buf[..n]);
                    }
                }
            }
        });
        Relay {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A stand-in guest for `net`: namespace with tap `g0` 172.16.0.2/30 via
/// 172.16.0.1, relayed to the sandbox's tap.
pub struct Guest {
    pub ns: Ns,
    _relay: Relay,
}

pub fn guest_for(net: &SandboxNet, name: String) -> Guest {
    let ns = Ns::new(name);
    ns.ip(&["link", "set", "lo", "up"]);
    ns.ip(&["tuntap", "add", "dev", "g0", "mode", "tap"]);
    ns.ip(&["addr", "add", "172.16.0.2/30", "dev", "g0"]);
    ns.ip(&["link", "set", "g0", "up"]);
    ns.ip(&["route", "add", "default", "via", "172.16.0.1"]);
    let guest_tap = Tap::open_in("g0", Some(&ns.path())).unwrap();
    let sandbox_tap = Tap::open_in(&net.tap, Some(&net.netns_path())).unwrap();
    Guest {
        ns,
        _relay: Relay::new(guest_tap, sandbox_tap),
    }
}

/// Sends `payload` every 50 ms (the first may meet a link not yet up, or
/// an ARP being resolved) until `sock` receives it; returns the sender.
pub fn deliver(send: impl Fn(), sock: &UdpSocket, payload: &[u8]) -> SocketAddrV4 {
    sock.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        send();
        let mut buf = [0u8; 1500];
        if let Ok((n, std::net::SocketAddr::V4(from))) = sock.recv_from(&mut buf) {
            if &buf[..n] == payload {
                return from;
            }
        }
        assert!(Instant::now() < deadline, "{payload:?} never arrived");
    }
}

/// A namespace standing for the world beyond `host`: a veth `veth` in
/// `host` with `{subnet}.1/24`, its peer `eth0` here with `{subnet}.2/24`
/// and a default route back; each of `extra` (addresses) on its loopback,
/// routed to it from `host`. What sandboxes reach through the host's
/// `forward` chain (the host's own addresses are closed to them).
pub fn outside(host: &Ns, name: String, veth: &str, subnet: &str, extra: &[&str]) -> Ns {
    let ns = Ns::new(name);
    host.ip(&[
        "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", &ns.0,
    ]);
    host.ip(&["addr", "add", &format!("{subnet}.1/24"), "dev", veth]);
    host.ip(&["link", "set", veth, "up"]);
    ns.ip(&["link", "set", "lo", "up"]);
    ns.ip(&["addr", "add", &format!("{subnet}.2/24"), "dev", "eth0"]);
    ns.ip(&["link", "set", "eth0", "up"]);
    ns.ip(&["route", "add", "default", "via", &format!("{subnet}.1")]);
    for addr in extra {
        ns.ip(&["addr", "add", &format!("{addr}/32"), "dev", "lo"]);
        host.ip(&[
            "route",
            "add",
            &format!("{addr}/32"),
            "via",
            &format!("{subnet}.2"),
        ]);
    }
    ns
}

/// Sends datagrams for a while; true if none arrived.
pub fn blocked(send: impl Fn(), sock: &UdpSocket) -> bool {
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    for _ in 0..5 {
        send();
        let mut buf = [0u8; 64];
        if sock.recv_from(&mut buf).is_ok() {
            return false;
        }
    }
    true
}

/// Asks the guest's resolver (its gateway, as the rootfs's resolv.conf
/// says) for `name`'s A records, retrying until an answer comes (the
/// first query may meet ARP being resolved).
pub fn resolve(sock: &UdpSocket, name: &str) -> hickory_proto::op::Message {
    use hickory_proto::op::{Message, MessageType, Query};
    use hickory_proto::rr::{Name, RecordType};
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut query = Message::query();
    query.metadata.message_type = MessageType::Query;
    query.metadata.recursion_desired = true;
    query.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    let bytes = query.to_vec().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        sock.send_to(&bytes, "172.16.0.1:53").unwrap();
        let mut buf = [0u8; 1500];
        if let Ok(n) = sock.recv(&mut buf) {
            let reply = Message::from_vec(&buf[..n]).unwrap();
            if reply.metadata.id == query.metadata.id {
                return reply;
            }
        }
        assert!(Instant::now() < deadline, "no answer for {name}");
    }
}
