//! Sandbox networking end to end on this machine, without a guest kernel:
//! `scheduler::net` builds each sandbox's namespace (tap, veth, NAT, egress
//! rules) inside a "host" namespace the test creates, and a stand-in guest
//! (a namespace of its own whose tap is relayed frame by frame to the
//! sandbox's tap, vnet headers and all, as the VMM's virtio-net does) sends
//! and receives real datagrams. Shows: guest traffic leaves with the
//! sandbox's unique host-side address (clones told apart), the host reaches
//! the guest at that address (exposed ports), `allow_internet: false`
//! drops and counts, an `allow_out` CIDR reopens exactly that. Skips
//! loudly without root, nft or /dev/net/tun.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_scheduler::net::{Cidr, EgressPolicy, NetConfig, NetManager, SandboxNet};
use torpor_vmm::devices::net::{Tap, VNET_HDR_LEN};

struct Ns(String);

impl Ns {
    fn new(name: String) -> Self {
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        ip(&["netns", "add", &name]);
        Ns(name)
    }

    fn path(&self) -> std::path::PathBuf {
        std::path::Path::new("/run/netns").join(&self.0)
    }

    fn ip(&self, args: &[&str]) {
        let mut full = vec!["-n", self.0.as_str()];
        full.extend_from_slice(args);
        ip(&full);
    }

    /// Runs `f` on a thread inside the namespace (sockets made there
    /// belong there).
    fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
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

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Copies frames between two taps until dropped (what a VMM's virtio-net
/// does between the guest and its tap).
struct Relay {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Relay {
    fn new(a: Tap, b: Tap) -> Self {
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
struct Guest {
    ns: Ns,
    _relay: Relay,
}

fn guest_for(net: &SandboxNet, name: String) -> Guest {
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
fn deliver(send: impl Fn(), sock: &UdpSocket, payload: &[u8]) -> SocketAddrV4 {
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

struct Cleanup<'a>(&'a NetManager);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let _ = self.0.recover();
    }
}

#[test]
fn sandboxes_reach_the_host_with_their_own_addresses_under_policy() {
    // scripts/test leaves this out without root, nft or /dev/net/tun
    // (tests/needs).
    // SAFETY: geteuid has no preconditions.
    assert!(
        unsafe { libc::geteuid() } == 0,
        "needs root (namespaces, veths, nftables)"
    );
    let nft = Command::new("nft").arg("--version").output();
    assert!(
        nft.is_ok_and(|o| o.status.success()) && std::path::Path::new("/dev/net/tun").exists(),
        "needs nft (apt-get install nftables) and /dev/net/tun"
    );
    let tag = format!("{:x}", std::process::id() & 0xffff);
    let host = Ns::new(format!("tsn-host-{tag}"));
    host.ip(&["link", "set", "lo", "up"]);
    let manager = NetManager::new(NetConfig {
        netns_prefix: format!("tsn-{tag}-"),
        veth_prefix: format!("s{tag}v"),
        table: "torpor_e2e".into(),
        host_netns: Some(host.0.clone()),
        pool: "10.202.0.0/24".parse().unwrap(),
        dns_port: None,
    })
    .unwrap();
    // Whatever happens below, the sandbox namespaces go (the host's with it).
    let _cleanup = Cleanup(&manager);
    let a = manager.create("a", &EgressPolicy::default()).unwrap();
    let b = manager
        .create(
            "b",
            &EgressPolicy {
                allow_internet: false,
                ..EgressPolicy::default()
            },
        )
        .unwrap();
    let guest_a = guest_for(&a, format!("tsn-ga-{tag}"));
    let guest_b = guest_for(&b, format!("tsn-gb-{tag}"));

    // The host's server listens on the address every sandbox's gateway
    // routes to (its veth end; for sandbox a that is a.host_addr).
    let server =
        host.enter(|| UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 9000)).unwrap());
    let to_host = |net: &SandboxNet| SocketAddrV4::new(net.host_addr, 9000);

    // 1. Guest a → host: it arrives from a's unique address.
    let ga = guest_a.ns.enter(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    let from = deliver(
        || drop(ga.send_to(b"from a", to_host(&a))),
        &server,
        b"from a",
    );
    assert_eq!(
        *from.ip(),
        a.sandbox_addr,
        "SNAT to the sandbox's own address"
    );

    // 2. Host → a's address: DNAT to the guest (an exposed port).
    let listener = guest_a
        .ns
        .enter(|| UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::new(172, 16, 0, 2), 8080)).unwrap());
    let target = SocketAddrV4::new(a.sandbox_addr, 8080);
    deliver(|| drop(server.send_to(b"to a", target)), &listener, b"to a");

    // 3. b may not reach anything: dropped, and counted.
    let gb = guest_b.ns.enter(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while manager.policy_drops(&b).unwrap() == 0 {
        assert!(
            Instant::now() < deadline,
            "b's datagram was not dropped by policy"
        );
        gb.send_to(b"from b", to_host(&b)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(manager.policy_drops(&a).unwrap(), 0);

    // 4. An allow_out CIDR opens exactly that, at run time.
    let open_host = EgressPolicy {
        allow_internet: false,
        allow_out: vec![Cidr {
            addr: b.host_addr,
            len: 32,
        }
        .into()],
        deny_out: Vec::new(),
    };
    manager.set_policy(&b, &open_host).unwrap();
    let from = deliver(
        || drop(gb.send_to(b"from b", to_host(&b))),
        &server,
        b"from b",
    );
    assert_eq!(*from.ip(), b.sandbox_addr, "told apart from a by address");
    assert_ne!(a.sandbox_addr, b.sandbox_addr);

    drop((guest_a, guest_b));
    manager.delete(&a).unwrap();
    manager.delete(&b).unwrap();
    assert_eq!(manager.leftovers().unwrap(), Default::default());
}
