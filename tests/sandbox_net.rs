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

mod common;

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use common::netns::{deliver, guest_for, needs_root_and_nft, Ns};
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
