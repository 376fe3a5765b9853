//! Sandbox networks on this machine, in a "host" namespace the test
//! creates (so the real host's tables and links are never touched), with
//! names of the test's own. Skips (loudly) without root, `ip`, `nft` or
//! /dev/net/tun.

use std::net::Ipv4Addr;
use std::process::Command;

use super::*;

/// A namespace standing in for the host, deleted on drop.
pub(crate) struct HostNs(pub(crate) String);

/// Removes what a failing test left (the host namespace goes after it).
pub(crate) struct Cleanup<'a>(pub(crate) &'a NetManager);

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let _ = self.0.recover();
    }
}

impl Drop for HostNs {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn tool(name: &str) -> bool {
    Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A manager whose "host" is a fresh namespace, with names of its own and
/// addresses from `pool`. Needs root, `nft` and /dev/net/tun: scripts/test
/// leaves these tests out where they are missing (tests/needs).
pub(crate) fn manager(tag: &str, pool: &str) -> Option<(NetManager, HostNs)> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(root, "{tag}: needs root for namespaces, veths and nftables");
    assert!(
        tool("nft") && std::path::Path::new("/dev/net/tun").exists(),
        "{tag}: needs nft (apt-get install nftables) and /dev/net/tun"
    );
    let id = format!("{:x}{}", std::process::id() & 0xffff, tag.len());
    let host = HostNs(format!("tnh-{id}-{tag}"));
    let ok = Command::new("ip")
        .args(["netns", "add", &host.0])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "{tag}: cannot create a network namespace");
    let config = NetConfig {
        netns_prefix: format!("tns-{id}-{tag}-"),
        veth_prefix: format!("v{id}x"),
        table: "torpor_test".into(),
        host_netns: Some(host.0.clone()),
        pool: pool.parse().unwrap(),
        dns_port: None,
        host_allow: Vec::new(),
    };
    Some((NetManager::new(config).unwrap(), host))
}

pub(crate) fn in_ns(ns: &str, args: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn networks_are_created_counted_and_removed_without_leftovers() {
    let Some((m, host)) = manager("life", "10.201.0.0/24") else {
        return;
    };
    let _cleanup = Cleanup(&m);
    assert_eq!(m.leftovers().unwrap(), Leftovers::default());
    let closed = EgressPolicy {
        allow_internet: false,
        allow_out: vec!["192.0.2.0/24".parse().unwrap()],
        deny_out: vec!["192.0.2.7/32".parse().unwrap()],
    };
    let a = m.create("sbx-a", &EgressPolicy::default()).unwrap();
    let b = m.create("sbx-b", &closed).unwrap();
    let c = m.create("sbx-c", &EgressPolicy::default()).unwrap();
    assert!(matches!(
        m.create("sbx-a", &closed),
        Err(NetError::Exists(_))
    ));
    // Unique host-side addresses; the same guest side everywhere.
    let addrs = [a.sandbox_addr, b.sandbox_addr, c.sandbox_addr];
    assert_eq!(
        addrs,
        [
            Ipv4Addr::new(10, 201, 0, 2),
            Ipv4Addr::new(10, 201, 0, 6),
            Ipv4Addr::new(10, 201, 0, 10),
        ]
    );
    for net in [&a, &b, &c] {
        let tap = in_ns(&net.netns, &["ip", "-o", "addr", "show", "dev", TAP_NAME]);
        assert!(tap.contains("172.16.0.1/30"), "{tap}");
        let nat = in_ns(&net.netns, &["nft", "list", "table", "ip", "torpor"]);
        assert!(
            nat.contains(&format!("snat to {}", net.sandbox_addr)),
            "{nat}"
        );
        assert!(nat.contains("dnat to 172.16.0.2"), "{nat}");
        let route = in_ns(&net.netns, &["ip", "route", "show", "default"]);
        assert!(route.contains(&net.host_addr.to_string()), "{route}");
    }
    // An open sandbox: 6 forward rules (established, link-local, other
    // sandboxes' veths and pool, the learned deny and allow sets) and 3
    // input (established, learned deny, the host closed); the closed one
    // adds its CIDRs (both chains for the deny) and the final forward drop:
    // 9 and 4; 2 counting rules and 2 sets each.
    let counted = m.leftovers().unwrap();
    assert_eq!(
        counted,
        Leftovers {
            namespaces: 3,
            veths: 3,
            rules: 11 + 15 + 11,
            sets: 6,
        }
    );
    let masq = in_ns(
        &host.0,
        &["nft", "list", "chain", "ip", "torpor_test", "postrouting"],
    );
    assert_eq!(masq.matches(MASQUERADE_TAG).count(), 1, "{masq}");

    // Policy changes at run time replace the sandbox's rules only.
    m.set_policy(&b, &EgressPolicy::default()).unwrap();
    assert_eq!(m.leftovers().unwrap().rules, 33);
    let forward = in_ns(
        &host.0,
        &["nft", "list", "chain", "ip", "torpor_test", "forward"],
    );
    assert!(!forward.contains("192.0.2"), "{forward}");

    m.delete(&a).unwrap();
    assert_eq!(
        m.leftovers().unwrap(),
        Leftovers {
            namespaces: 2,
            veths: 2,
            rules: 22,
            sets: 4,
        }
    );
    // The freed slot is reused.
    let d = m.create("sbx-d", &EgressPolicy::default()).unwrap();
    assert_eq!(d.index, 0);

    // A restarted service whose sandbox b still runs keeps b's network
    // (found by its rule tags) and removes the rest.
    let restarted = NetManager::new(m.config().clone()).unwrap();
    let kept = restarted.adopt(&|id| id == "sbx-b").unwrap();
    assert_eq!(kept, vec![b.clone()]);
    assert_eq!(
        restarted.leftovers().unwrap(),
        Leftovers {
            namespaces: 1,
            veths: 1,
            rules: 11,
            sets: 2,
        }
    );
    assert!(matches!(
        restarted.create("sbx-b", &EgressPolicy::default()),
        Err(NetError::Exists(_))
    ));
    let f = restarted.create("sbx-f", &EgressPolicy::default()).unwrap();
    assert_ne!(f.index, b.index, "the adopted slot stays taken");
    restarted.delete(&f).unwrap();
    let m = restarted;

    // A restarted service knows nothing: it removes everything left.
    let restarted = NetManager::new(m.config().clone()).unwrap();
    let found = restarted.recover().unwrap();
    assert_eq!(
        found,
        Leftovers {
            namespaces: 1,
            veths: 1,
            rules: 11,
            sets: 2,
        }
    );
    assert_eq!(restarted.leftovers().unwrap(), Leftovers::default());
    let tables = in_ns(&host.0, &["nft", "list", "tables"]);
    assert!(!tables.contains("torpor_test"), "{tables}");
    // And it can build again.
    let e = restarted.create("sbx-e", &EgressPolicy::default()).unwrap();
    restarted.delete(&e).unwrap();
    assert_eq!(restarted.leftovers().unwrap().namespaces, 0);
}

#[test]
fn cidrs_and_policies_parse() {
    assert_eq!(
        "10.0.0.0/8".parse::<Cidr>().unwrap().to_string(),
        "10.0.0.0/8"
    );
    assert_eq!("1.2.3.4".parse::<Cidr>().unwrap().len, 32);
    for bad in ["10.0.0.1/8", "10.0.0.0/33", "x/8", "10.0.0/8"] {
        assert!(bad.parse::<Cidr>().is_err(), "{bad}");
    }
    let p: EgressPolicy =
        serde_json::from_str(r#"{"allow_out":["10.0.0.0/8"],"deny_out":["10.1.0.0/16"]}"#).unwrap();
    assert!(p.allow_internet, "open by default");
    assert_eq!(p.deny_out[0], Target::Cidr("10.1.0.0/16".parse().unwrap()));
    assert_eq!(p.allow_out[0].to_string(), "10.0.0.0/8");
    assert!(serde_json::from_str::<EgressPolicy>(r#"{"allow_out":["no pe"]}"#).is_err());
    assert!(serde_json::from_str::<EgressPolicy>(r#"{"allow":true}"#).is_err());
}
