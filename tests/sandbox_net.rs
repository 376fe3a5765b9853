//! Sandbox networking end to end on this machine, without a guest kernel:
//! `scheduler::net` builds each sandbox's namespace (tap, veth, NAT, egress
//! rules) inside a "host" namespace the test creates, and a stand-in guest
//! (a namespace of its own whose tap is relayed frame by frame to the
//! sandbox's tap, vnet headers and all, as the VMM's virtio-net does) sends
//! and receives real datagrams. Shows: guest traffic leaves with the
//! sandbox's unique host-side address (clones told apart), the host reaches
//! the guest at that address (exposed ports), `allow_internet: false`
//! drops and counts, an `allow_out` CIDR reopens exactly that; and the
//! walls no policy opens: the host's own addresses (but for the DNS
//! forwarder and the operator's `host_allow`), other sandboxes and
//! link-local addresses, and DNS with internet off. Skips loudly without
//! root, nft or /dev/net/tun.

mod common;

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::netns::{blocked, deliver, guest_for, needs_root_and_nft, outside, resolve, Ns};
use hickory_proto::op::ResponseCode;
use torpor_scheduler::net::dns::{DnsConfig, Forwarder};
use torpor_scheduler::net::{Cidr, EgressPolicy, NetConfig, NetManager, SandboxNet};

struct Cleanup<'a>(&'a NetManager);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let _ = self.0.recover();
    }
}

#[test]
fn sandboxes_reach_the_host_with_their_own_addresses_under_policy() {
    needs_root_and_nft();
    let tag = format!("{:x}", std::process::id() & 0xffff);
    let host = Ns::new(format!("tsn-host-{tag}"));
    host.ip(&["link", "set", "lo", "up"]);
    let world = outside(
        &host,
        format!("tsn-out-{tag}"),
        &format!("s{tag}o"),
        "10.98.2",
        &[],
    );
    let manager = NetManager::new(NetConfig {
        netns_prefix: format!("tsn-{tag}-"),
        veth_prefix: format!("s{tag}v"),
        table: "torpor_e2e".into(),
        host_netns: Some(host.0.clone()),
        pool: "10.202.0.0/24".parse().unwrap(),
        dns_port: None,
        // The host's server below, open to sandboxes by the operator.
        host_allow: vec!["10.202.0.0/24:9000".parse().unwrap()],
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
    // A server beyond the host (the internet).
    let far = world.enter(|| UdpSocket::bind("10.98.2.2:9000").unwrap());
    let to_far: SocketAddrV4 = "10.98.2.2:9000".parse().unwrap();

    // 1. Guests → the operator's host service: it arrives from each
    //    sandbox's unique address (b's too: the host service is not the
    //    internet).
    let ga = guest_a.ns.enter(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    let gb = guest_b.ns.enter(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    for (g, net) in [(&ga, &a), (&gb, &b)] {
        let from = deliver(|| drop(g.send_to(b"hi", to_host(net))), &server, b"hi");
        assert_eq!(
            *from.ip(),
            net.sandbox_addr,
            "SNAT to the sandbox's own address"
        );
    }
    assert_ne!(a.sandbox_addr, b.sandbox_addr, "clones told apart");

    // 2. Host → a's address: DNAT to the guest (an exposed port).
    let listener = guest_a
        .ns
        .enter(|| UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::new(172, 16, 0, 2), 8080)).unwrap());
    let target = SocketAddrV4::new(a.sandbox_addr, 8080);
    deliver(|| drop(server.send_to(b"to a", target)), &listener, b"to a");

    // 3. a reaches the internet; b may not: dropped, and counted.
    deliver(|| drop(ga.send_to(b"from a", to_far)), &far, b"from a");
    let deadline = Instant::now() + Duration::from_secs(10);
    while manager.policy_drops(&b).unwrap() == 0 {
        assert!(
            Instant::now() < deadline,
            "b's datagram was not dropped by policy"
        );
        gb.send_to(b"from b", to_far).unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(blocked(|| drop(gb.send_to(b"from b", to_far)), &far));
    assert_eq!(manager.policy_drops(&a).unwrap(), 0);

    // 4. An allow_out CIDR opens exactly that, at run time.
    let open_far = EgressPolicy {
        allow_internet: false,
        allow_out: vec![Cidr {
            addr: *to_far.ip(),
            len: 32,
        }
        .into()],
        deny_out: Vec::new(),
    };
    manager.set_policy(&b, &open_far).unwrap();
    deliver(|| drop(gb.send_to(b"from b", to_far)), &far, b"from b");

    drop((guest_a, guest_b));
    manager.delete(&a).unwrap();
    manager.delete(&b).unwrap();
    assert_eq!(manager.leftovers().unwrap(), Default::default());
}

/// Whether a TCP connection from the guest namespace to `to` is made
/// within a second (a dropped SYN times out).
fn connects(guest: &Ns, to: SocketAddrV4) -> bool {
    guest.enter(|| TcpStream::connect_timeout(&to.into(), Duration::from_secs(1)).is_ok())
}

/// Attack 8 of issue 24: a guest whose policy opens everything still
/// cannot reach the host's own addresses (a PostgreSQL-like TCP listener
/// on 0.0.0.0, on its veth's host end and on another host address),
/// another sandbox (its guest, its host end), or 169.254.169.254 (routed
/// beyond the host, as a cloud's metadata service is); and with internet
/// off, the DNS forwarder refuses names not allowed without asking
/// upstream.
#[test]
fn guests_reach_neither_the_host_nor_other_sandboxes_nor_link_local() {
    needs_root_and_nft();
    let tag = format!("{:x}", std::process::id() & 0xffff);
    let host = Ns::new(format!("tsw-host-{tag}"));
    host.ip(&["link", "set", "lo", "up"]);
    // Another address of the host (a public one, say).
    host.ip(&["addr", "add", "10.97.0.1/32", "dev", "lo"]);
    let world = outside(
        &host,
        format!("tsw-out-{tag}"),
        &format!("w{tag}o"),
        "10.98.3",
        &["169.254.169.254"],
    );
    let dns_port = 10054;
    let manager = Arc::new(
        NetManager::new(NetConfig {
            netns_prefix: format!("tsw-{tag}-"),
            veth_prefix: format!("w{tag}v"),
            table: "torpor_walls".into(),
            host_netns: Some(host.0.clone()),
            pool: "10.206.0.0/24".parse().unwrap(),
            dns_port: Some(dns_port),
            host_allow: Vec::new(),
        })
        .unwrap(),
    );
    let _cleanup = Cleanup(&manager);
    // A tenant's widest policy: everything, those addresses by name too.
    let wide = EgressPolicy {
        allow_internet: true,
        allow_out: ["0.0.0.0/0", "169.254.169.254", "10.206.0.0/24", "10.97.0.1"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect(),
        deny_out: Vec::new(),
    };
    let a = manager.create("a", &wide).unwrap();
    let closed = EgressPolicy {
        allow_internet: false,
        ..EgressPolicy::default()
    };
    let b = manager.create("b", &closed).unwrap();
    let guest_a = guest_for(&a, format!("tsw-ga-{tag}"));
    let guest_b = guest_for(&b, format!("tsw-gb-{tag}"));

    // The upstream resolver: a socket that must never hear a query.
    let upstream = host.enter(|| UdpSocket::bind("127.0.0.1:0").unwrap());
    let forwarder = Forwarder::start(
        manager.clone(),
        DnsConfig::new(dns_port, upstream.local_addr().unwrap()),
    )
    .unwrap();

    // Listeners: the host's "PostgreSQL" on every host address, the
    // metadata service and a control beyond the host, b's guest.
    let pg = host.enter(|| TcpListener::bind("0.0.0.0:5432").unwrap());
    let meta = world.enter(|| TcpListener::bind("0.0.0.0:80").unwrap());
    let b_guest = guest_b
        .ns
        .enter(|| TcpListener::bind("172.16.0.2:8080").unwrap());
    for l in [&pg, &meta, &b_guest] {
        l.set_nonblocking(true).unwrap();
    }

    // The route beyond the host works (the control), so what follows is
    // dropped by the walls, not lost.
    let control: SocketAddrV4 = "10.98.3.2:80".parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !connects(&guest_a.ns, control) {
        assert!(Instant::now() < deadline, "the control never connected");
    }
    let before = manager.policy_drops(&a).unwrap();
    for (what, to) in [
        (
            "the host's end of a's veth",
            SocketAddrV4::new(a.host_addr, 5432),
        ),
        (
            "the host's end of b's veth",
            SocketAddrV4::new(b.host_addr, 5432),
        ),
        ("another host address", "10.97.0.1:5432".parse().unwrap()),
        (
            "the metadata service",
            "169.254.169.254:80".parse().unwrap(),
        ),
        ("another sandbox", SocketAddrV4::new(b.sandbox_addr, 8080)),
    ] {
        assert!(!connects(&guest_a.ns, to), "a reached {what} ({to})");
    }
    assert!(
        manager.policy_drops(&a).unwrap() > before,
        "dropped by the walls, counted"
    );
    // Nothing was accepted but the control.
    assert!(pg.accept().is_err(), "the host's listener was reached");
    assert!(b_guest.accept().is_err(), "b's guest was reached");
    assert!(meta.accept().is_ok(), "the control");
    assert!(meta.accept().is_err(), "the metadata service was reached");
    // UDP to the host, other than the DNS forwarder, too.
    let host_udp = host.enter(|| UdpSocket::bind("0.0.0.0:4222").unwrap());
    let ga = guest_a.ns.enter(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    let to = SocketAddrV4::new(a.host_addr, 4222);
    assert!(blocked(|| drop(ga.send_to(b"x", to)), &host_udp));

    // DNS: with internet off (b), any name is REFUSED and upstream is
    // never asked.
    let dns = guest_b.ns.enter(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    for name in ["example.com.", "c2VjcmV0.exfil.example."] {
        let reply = resolve(&dns, name);
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::Refused,
            "{name}"
        );
        assert!(reply.answers.is_empty());
    }
    upstream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    assert!(
        upstream.recv(&mut [0u8; 512]).is_err(),
        "a query went upstream"
    );

    drop((forwarder, guest_a, guest_b));
    manager.delete(&a).unwrap();
    manager.delete(&b).unwrap();
    assert_eq!(manager.leftovers().unwrap(), Default::default());
}
