//! Egress policy by domain through the pod's DNS forwarder, policy changes
//! at run time, exposed ports and traffic counters, on this machine without
//! a guest kernel: `scheduler::net` builds a sandbox's namespace inside a
//! "host" namespace the test creates, a stand-in guest (a namespace whose
//! tap is relayed to the sandbox's) sends real packets, and the upstream
//! resolver is a DNS server the test runs on the host namespace's
//! loopback. Needs root, nft and /dev/net/tun (tests/needs).

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::netns::{blocked, deliver, guest_for, ip, needs_root_and_nft, outside, resolve, Ns};
use hickory_proto::op::{Message, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use torpor_scheduler::net::dns::{DnsConfig, Forwarder};
use torpor_scheduler::net::ports::{PortProxy, PortTarget};
use torpor_scheduler::net::{EgressPolicy, NetConfig, NetManager, PolicyPatch};

const DNS_PORT: u16 = 10053;

struct Cleanup<'a>(&'a NetManager);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let _ = self.0.recover();
    }
}

/// The upstream resolver: `allowed.test` (and names under it) is
/// `allowed`, `denied.test` is `denied`, anything else NXDOMAIN. Counts
/// the queries it answers.
struct Upstream {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Upstream {
    fn start(socket: UdpSocket, allowed: Ipv4Addr, denied: Ipv4Addr) -> Self {
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let (flag, count) = (stop.clone(), answered.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !flag.load(Ordering::Relaxed) {
                let Ok((n, from)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                let query = Message::from_vec(&buf[..n]).unwrap();
                let q = query.queries[0].clone();
                let name = q.name().to_ascii();
                let addr = if name.ends_with("allowed.test.") {
                    Some(allowed)
                } else if name == "denied.test." {
                    Some(denied)
                } else {
                    None
                };
                let mut reply = Message::response(query.metadata.id, OpCode::Query);
                reply.queries.push(q.clone());
                match addr {
                    Some(a) if q.query_type() == RecordType::A => reply
                        .answers
                        .push(Record::from_rdata(q.name().clone(), 120, RData::A(A(a)))),
                    Some(_) => {}
                    None => reply.metadata.response_code = ResponseCode::NXDomain,
                }
                socket.send_to(&reply.to_vec().unwrap(), from).unwrap();
                count.fetch_add(1, Ordering::Relaxed);
            }
        });
        Upstream {
            stop,
            answered,
            thread: Some(thread),
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn a_records(m: &Message) -> Vec<Ipv4Addr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

/// Where the test's exposed port goes: the sandbox's address; counts the
/// calls (a service wakes the sandbox there).
struct Target {
    addr: Ipv4Addr,
    calls: AtomicUsize,
}

impl PortTarget for Target {
    fn target(&self, _sandbox: &str, guest_port: u16) -> Result<SocketAddrV4, String> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(SocketAddrV4::new(self.addr, guest_port))
    }
}

#[test]
fn domains_open_and_close_through_the_dns_forwarder_and_ports_forward() {
    needs_root_and_nft();
    let tag = format!("{:x}", std::process::id() & 0xffff);
    let host = Ns::new(format!("tnp-host-{tag}"));
    host.ip(&["link", "set", "lo", "up"]);
    // Beyond the host (sandboxes never reach the host's own addresses):
    // allowed.test is 10.98.4.2, denied.test 10.99.0.9.
    let world = outside(
        &host,
        format!("tnp-out-{tag}"),
        &format!("p{tag}o"),
        "10.98.4",
        &["10.99.0.9"],
    );
    let allowed_addr = Ipv4Addr::new(10, 98, 4, 2);
    let manager = Arc::new(
        NetManager::new(NetConfig {
            netns_prefix: format!("tnp-{tag}-"),
            veth_prefix: format!("p{tag}v"),
            table: "torpor_policy".into(),
            host_netns: Some(host.0.clone()),
            pool: "10.204.0.0/24".parse().unwrap(),
            dns_port: Some(DNS_PORT),
            host_allow: Vec::new(),
        })
        .unwrap(),
    );
    let _cleanup = Cleanup(&manager);
    let policy: EgressPolicy = serde_json::from_value(serde_json::json!({
        "allow_internet": false,
        "allow_out": ["allowed.test"],
        "deny_out": ["denied.test"],
    }))
    .unwrap();
    let net = manager.create("d", &policy).unwrap();
    let guest = guest_for(&net, format!("tnp-g-{tag}"));

    // The upstream resolver, and the forwarder asking it, both on the
    // host namespace.
    let upstream_sock = host.enter(|| UdpSocket::bind("127.0.0.1:0").unwrap());
    let upstream_addr = upstream_sock.local_addr().unwrap();
    let upstream = Upstream::start(upstream_sock, allowed_addr, Ipv4Addr::new(10, 99, 0, 9));
    let forwarder =
        Forwarder::start(manager.clone(), DnsConfig::new(DNS_PORT, upstream_addr)).unwrap();

    // A server on what allowed.test resolves to and on denied.test's
    // address.
    let server =
        world.enter(|| UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 9000)).unwrap());
    let allowed_dst = SocketAddrV4::new(allowed_addr, 9000);
    let denied_dst = SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 9), 9000);
    let g = guest.ns.enter(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    let dns = guest.ns.enter(|| UdpSocket::bind("0.0.0.0:0").unwrap());

    // 1. Not resolved yet: allow_internet is false, so it is dropped.
    assert!(blocked(|| drop(g.send_to(b"early", allowed_dst)), &server));
    let drops = manager.counters(&net).unwrap().dropped_packets;
    assert!(drops > 0, "the early datagrams were dropped by policy");

    // 2. Resolving the allowed domain (a name under it) opens its address.
    let reply = resolve(&dns, "www.allowed.test.");
    assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
    assert_eq!(a_records(&reply), vec![allowed_addr]);
    deliver(|| drop(g.send_to(b"open", allowed_dst)), &server, b"open");

    // 3. With internet off, a denied name and one neither allowed nor
    //    denied are REFUSED without asking upstream (a name is a channel
    //    out).
    let asked = upstream.answered.load(Ordering::Relaxed);
    for name in ["denied.test.", "other.example."] {
        let reply = resolve(&dns, name);
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::Refused,
            "{name}"
        );
        assert!(a_records(&reply).is_empty());
    }
    assert_eq!(
        upstream.answered.load(Ordering::Relaxed),
        asked,
        "not asked"
    );
    // With internet on, a denied domain is resolved so that its address
    // is closed even to a guest that knows it, and still REFUSED.
    let open = EgressPolicy {
        allow_internet: true,
        ..policy.clone()
    };
    manager.set_policy(&net, &open).unwrap();
    let reply = resolve(&dns, "denied.test.");
    assert_eq!(reply.metadata.response_code, ResponseCode::Refused);
    assert!(a_records(&reply).is_empty());
    let set = ip(&[
        "netns",
        "exec",
        &host.0,
        "nft",
        "list",
        "set",
        "ip",
        "torpor_policy",
        &format!("{}_d", net.host_veth),
    ]);
    assert!(set.contains("10.99.0.9"), "learned as denied: {set}");
    assert!(blocked(|| drop(g.send_to(b"denied", denied_dst)), &server));
    // Names neither allowed nor denied are answered as upstream says.
    let reply = resolve(&dns, "other.example.");
    assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
    manager.set_policy(&net, &policy).unwrap();
    // A repeated question is answered from the cache.
    let asked = upstream.answered.load(Ordering::Relaxed);
    let reply = resolve(&dns, "www.allowed.test.");
    assert_eq!(a_records(&reply), vec![allowed_addr]);
    assert_eq!(upstream.answered.load(Ordering::Relaxed), asked, "cached");

    // 4. At run time, a deny CIDR wins over the allowed domain's address.
    let closed = PolicyPatch {
        deny_out: Some(vec![format!("{allowed_addr}/32").parse().unwrap()]),
        ..PolicyPatch::default()
    }
    .apply(&policy)
    .unwrap();
    manager.set_policy(&net, &closed).unwrap();
    let _ = resolve(&dns, "www.allowed.test.");
    assert!(blocked(|| drop(g.send_to(b"late", allowed_dst)), &server));
    // ... and back.
    manager.set_policy(&net, &policy).unwrap();
    let _ = resolve(&dns, "allowed.test.");
    deliver(|| drop(g.send_to(b"again", allowed_dst)), &server, b"again");

    // 5. An exposed port on the host's loopback reaches a guest listener
    //    through the sandbox's NAT, under the closed policy too (replies
    //    are established traffic).
    let listener = guest.ns.enter(|| {
        TcpListener::bind(SocketAddrV4::new(Ipv4Addr::new(172, 16, 0, 2), 8080)).unwrap()
    });
    let echo = std::thread::spawn(move || {
        let (mut c, _) = listener.accept().unwrap();
        let mut buf = [0u8; 5];
        c.read_exact(&mut buf).unwrap();
        c.write_all(&buf).unwrap();
    });
    let target = Arc::new(Target {
        addr: net.sandbox_addr,
        calls: AtomicUsize::new(0),
    });
    let proxy = PortProxy::new(manager.clone(), Ipv4Addr::LOCALHOST.into(), target.clone());
    let exposed = proxy.expose("d", 8080, 0).unwrap();
    assert!(exposed.ip().is_loopback());
    assert!(proxy.expose("d", 8080, 0).is_err(), "exposed once");
    let before = manager.counters(&net).unwrap();
    let mut c =
        host.enter(|| TcpStream::connect_timeout(&exposed, Duration::from_secs(5)).unwrap());
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"hello").unwrap();
    let mut back = [0u8; 5];
    c.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"hello");
    echo.join().unwrap();
    assert_eq!(target.calls.load(Ordering::Relaxed), 1);
    let after = manager.counters(&net).unwrap();
    assert!(after.rx_packets > before.rx_packets && after.rx_bytes > before.rx_bytes);
    assert!(after.tx_packets > before.tx_packets && after.tx_bytes > before.tx_bytes);
    assert_eq!(proxy.list("d"), vec![(8080, exposed)]);
    proxy.unexpose("d", 8080).unwrap();
    assert!(proxy.list("d").is_empty());
    let refused = host.enter(|| TcpStream::connect_timeout(&exposed, Duration::from_secs(2)));
    assert!(refused.is_err(), "closed with its exposure");

    // 6. A query from an address that is not a sandbox's gets nothing.
    let stranger = host.enter(|| UdpSocket::bind("127.0.0.1:0").unwrap());
    stranger
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut q = Message::query();
    q.add_query(Query::query(
        Name::from_ascii("allowed.test.").unwrap(),
        RecordType::A,
    ));
    let to: SocketAddr = SocketAddr::from((Ipv4Addr::LOCALHOST, DNS_PORT));
    stranger.send_to(&q.to_vec().unwrap(), to).unwrap();
    assert!(
        stranger.recv(&mut [0u8; 512]).is_err(),
        "not an open resolver"
    );

    // 7. Bounds: an oversized query gets nothing, two questions NOTIMP, and
    //    a burst is cut to the sandbox's rate (50 a second).
    dns.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let gateway = "172.16.0.1:53";
    dns.send_to(&[0u8; 600], gateway).unwrap();
    assert!(dns.recv(&mut [0u8; 1500]).is_err(), "oversized: no answer");
    let mut two = Message::query();
    for name in ["a.allowed.test.", "b.allowed.test."] {
        two.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    }
    dns.send_to(&two.to_vec().unwrap(), gateway).unwrap();
    let mut buf = [0u8; 1500];
    let n = dns.recv(&mut buf).unwrap();
    let reply = Message::from_vec(&buf[..n]).unwrap();
    assert_eq!(reply.metadata.response_code, ResponseCode::NotImp);
    std::thread::sleep(Duration::from_secs(1)); // a full bucket
    let mut one = Message::query();
    one.add_query(Query::query(
        Name::from_ascii("x.example.").unwrap(),
        RecordType::A,
    ));
    for _ in 0..200 {
        dns.send_to(&one.to_vec().unwrap(), gateway).unwrap();
    }
    let mut answered = 0;
    while dns.recv(&mut buf).is_ok() {
        answered += 1;
    }
    assert!(
        (40..=120).contains(&answered),
        "{answered} of 200 answered at once"
    );

    drop((proxy, forwarder, upstream, guest));
    manager.delete(&net).unwrap();
    assert_eq!(manager.leftovers().unwrap(), Default::default());
}
