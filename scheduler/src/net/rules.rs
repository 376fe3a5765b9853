//! The nftables rule sets, as `nft -f` scripts (pure text, tested apart).
//!
//! Inside a sandbox's namespace (table `ip torpor`, gone with the
//! namespace): traffic from the guest (always 172.16.0.2) leaving through
//! the veth is SNATed to the sandbox's unique address, and traffic to that
//! address is DNATed to the guest. In the host namespace (one table, name
//! configurable): sandbox addresses are masqueraded to the outside, and each
//! sandbox's egress policy is a handful of rules on its veth, tagged with a
//! comment naming the sandbox so they can be found, replaced and removed.

use std::fmt::Write;
use std::net::{Ipv4Addr, SocketAddrV4};

use super::{Cidr, EgressPolicy, HostPort, GATEWAY_ADDR, GUEST_ADDR, LINK_LOCAL};

/// Comment on every per-sandbox rule: `torpor:<sandbox id>`.
pub const RULE_TAG: &str = "torpor:";
/// Comment on the shared masquerade rule.
pub const MASQUERADE_TAG: &str = "torpor-masquerade";

/// Chains of the host table holding the egress policy: `forward` (to the
/// outside) and `input` (to the host itself).
pub const POLICY_CHAINS: [&str; 2] = ["forward", "input"];
/// Every chain with per-sandbox tagged rules: the policy's, and those
/// counting the sandbox's traffic, `acct_in` (prerouting: what it sends)
/// and `acct_out` (postrouting: what it receives).
pub const TAGGED_CHAINS: [&str; 4] = ["forward", "input", "acct_in", "acct_out"];

/// The host table and its chains (idempotent: `table` in a script adds).
pub fn host_base(table: &str) -> String {
    format!(
        "table ip {table} {{\n\
         \tchain postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}\n\
         \tchain forward {{ type filter hook forward priority filter; policy accept; }}\n\
         \tchain input {{ type filter hook input priority filter; policy accept; }}\n\
         \tchain acct_in {{ type filter hook prerouting priority mangle; policy accept; }}\n\
         \tchain acct_out {{ type filter hook postrouting priority 300; policy accept; }}\n\
         }}\n"
    )
}

/// Masquerades sandbox addresses (`pool`) going anywhere but another
/// sandbox's veth.
pub fn host_masquerade(table: &str, pool: Cidr, veth_prefix: &str) -> String {
    format!(
        "add rule ip {table} postrouting ip saddr {pool} oifname != \"{veth_prefix}*\" masquerade comment \"{MASQUERADE_TAG}\"\n"
    )
}

/// The sandbox's sets of addresses learned by the DNS forwarder: those of
/// allowed domains (`{veth}_a`) and of denied ones (`{veth}_d`), each
/// element with the TTL of the answer that brought it.
pub fn set_names(veth: &str) -> [String; 2] {
    [format!("{veth}_a"), format!("{veth}_d")]
}

/// Creates the sandbox's learned-address sets and its traffic counters.
pub fn host_sandbox(table: &str, id: &str, veth: &str) -> String {
    let mut out = String::new();
    for set in set_names(veth) {
        let _ = writeln!(
            out,
            "add set ip {table} {set} {{ type ipv4_addr; flags timeout; }}"
        );
    }
    let tag = format!("{RULE_TAG}{id}");
    let _ = writeln!(
        out,
        "add rule ip {table} acct_in iifname \"{veth}\" counter comment \"{tag}\""
    );
    let _ = writeln!(
        out,
        "add rule ip {table} acct_out oifname \"{veth}\" counter comment \"{tag}\""
    );
    out
}

/// Adds `addrs` to a learned set for `ttl_s` seconds (re-adding refreshes
/// the timeout: delete, then add, in one transaction).
pub fn learn(table: &str, set: &str, addrs: &[Ipv4Addr], ttl_s: u32) -> String {
    let items: Vec<String> = addrs.iter().map(Ipv4Addr::to_string).collect();
    let timed: Vec<String> = items
        .iter()
        .map(|a| format!("{a} timeout {ttl_s}s"))
        .collect();
    let (items, timed) = (items.join(", "), timed.join(", "));
    format!(
        "add element ip {table} {set} {{ {items} }}\n\
         delete element ip {table} {set} {{ {items} }}\n\
         add element ip {table} {set} {{ {timed} }}\n"
    )
}

/// What no sandbox reaches whatever its policy says: the host itself
/// (but for the DNS forwarder and `host_allow`), the other sandboxes (their
/// veths, the `pool` they are addressed from) and link-local addresses.
#[derive(Debug, Clone, Copy)]
pub struct Walls<'a> {
    pub pool: Cidr,
    pub veth_prefix: &'a str,
    pub host_allow: &'a [HostPort],
}

/// The sandbox's egress policy on its veth `veth`, in both policy chains.
/// Replies to connections already set up pass. `forward` (to the
/// outside): link-local addresses, other sandboxes' veths and the pool
/// drop, whatever the policy; then `deny_out` networks and addresses of
/// denied domains drop, then `allow_out` networks and addresses of
/// allowed domains pass (deny wins), then everything else is dropped
/// unless `allow_internet`. `input` (to the host itself): queries to the
/// DNS forwarder at `dns` pass; denied addresses drop; the operator's
/// `host_allow` services pass; everything else drops, whatever the policy
/// (the host's own addresses are not the internet).
pub fn host_policy(
    table: &str,
    id: &str,
    veth: &str,
    policy: &EgressPolicy,
    dns: Option<SocketAddrV4>,
    walls: &Walls<'_>,
) -> String {
    let mut out = String::new();
    let tag = format!("{RULE_TAG}{id}");
    let [allowed, denied] = set_names(veth);
    let deny = EgressPolicy::cidrs(&policy.deny_out);
    let allow = EgressPolicy::cidrs(&policy.allow_out);
    for chain in POLICY_CHAINS {
        let mut rule = |body: &str| {
            let _ = writeln!(
                out,
                "add rule ip {table} {chain} iifname \"{veth}\" {body} comment \"{tag}\""
            );
        };
        let input = chain == "input";
        rule("ct state established,related accept");
        if let (Some(dns), true) = (dns, input) {
            rule(&format!(
                "ip daddr {} udp dport {} accept",
                dns.ip(),
                dns.port()
            ));
        }
        if !input {
            rule(&format!("ip daddr {LINK_LOCAL} counter drop"));
            rule(&format!("oifname \"{}*\" counter drop", walls.veth_prefix));
            rule(&format!("ip daddr {} counter drop", walls.pool));
        }
        if !deny.is_empty() {
            rule(&format!("ip daddr {} counter drop", set(&deny)));
        }
        rule(&format!("ip daddr @{denied} counter drop"));
        if input {
            for h in walls.host_allow {
                rule(&format!(
                    "ip daddr {} meta l4proto {{ tcp, udp }} th dport {} accept",
                    h.net, h.port
                ));
            }
            rule("counter drop");
            continue;
        }
        if !allow.is_empty() {
            rule(&format!("ip daddr {} accept", set(&allow)));
        }
        rule(&format!("ip daddr @{allowed} accept"));
        if !policy.allow_internet {
            rule("counter drop");
        }
    }
    out
}

fn set(cidrs: &[Cidr]) -> String {
    let items: Vec<String> = cidrs.iter().map(Cidr::to_string).collect();
    format!("{{ {} }}", items.join(", "))
}

/// The sandbox namespace's NAT: the guest is seen as `sandbox_addr`, and
/// its DNS queries to its gateway go to the pod's forwarder at `dns`.
pub fn sandbox_nat(sandbox_addr: Ipv4Addr, uplink: &str, dns: Option<SocketAddrV4>) -> String {
    let dns = dns
        .map(|d| {
            format!(
                "\t\tiifname != \"{uplink}\" ip daddr {GATEWAY_ADDR} udp dport 53 dnat to {d}\n"
            )
        })
        .unwrap_or_default();
    format!(
        "table ip torpor {{\n\
         \tchain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n\
         \t\tiifname \"{uplink}\" ip daddr {sandbox_addr} dnat to {GUEST_ADDR}\n\
         {dns}\
         \t}}\n\
         \tchain postrouting {{ type nat hook postrouting priority srcnat; policy accept;\n\
         \t\toifname \"{uplink}\" ip saddr {GUEST_ADDR} snat to {sandbox_addr}\n\
         \t}}\n\
         }}\n"
    )
}

/// A sandbox's traffic, from its rules' counters.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    utoipa::ToSchema,
)]
pub struct NetCounters {
    /// Sent by the sandbox (leaving its veth towards the host).
    pub tx_bytes: u64,
    pub tx_packets: u64,
    /// Received by the sandbox.
    pub rx_bytes: u64,
    pub rx_packets: u64,
    /// Packets its egress policy dropped.
    pub dropped_packets: u64,
}

/// `(packets, bytes)` of a rule line's counter.
fn counter(line: &str) -> Option<(u64, u64)> {
    let rest = line.split_once("counter packets ")?.1;
    let mut words = rest.split_whitespace();
    let packets = words.next()?.parse().ok()?;
    let bytes = match (words.next(), words.next()) {
        (Some("bytes"), Some(b)) => b.parse().ok()?,
        _ => 0,
    };
    Some((packets, bytes))
}

/// Sandbox `id`'s counters in the output of `nft list table` (its tagged
/// rules, by chain).
pub fn counters(listing: &str, id: &str) -> NetCounters {
    let tag = format!("comment \"{RULE_TAG}{id}\"");
    let mut out = NetCounters::default();
    let mut chain = "";
    for line in listing.lines() {
        let trimmed = line.trim();
        if let Some(name) = trimmed
            .strip_prefix("chain ")
            .and_then(|r| r.strip_suffix(" {"))
        {
            chain = name;
            continue;
        }
        if !trimmed.contains(&tag) {
            continue;
        }
        let Some((packets, bytes)) = counter(trimmed) else {
            continue;
        };
        match chain {
            "acct_in" => {
                out.tx_packets += packets;
                out.tx_bytes += bytes;
            }
            "acct_out" => {
                out.rx_packets += packets;
                out.rx_bytes += bytes;
            }
            _ if trimmed.contains(" drop ") => out.dropped_packets += packets,
            _ => {}
        }
    }
    out
}

/// `(veth, sandbox id)` of every tagged rule in an `nft list chain`
/// output: which sandbox owns which veth, as a restarted service finds it.
pub fn tagged_veths(listing: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = listing
        .lines()
        .filter_map(|l| {
            let veth = l.split_once("iifname \"")?.1.split_once('"')?.0;
            let id = l
                .split_once(&format!("comment \"{RULE_TAG}"))?
                .1
                .split_once('"')?
                .0;
            Some((veth.to_string(), id.to_string()))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Handles of the rules tagged for sandbox `id` (or, with `None`, for any
/// sandbox) in the output of `nft -a list chain`.
pub fn tagged_handles(listing: &str, id: Option<&str>) -> Vec<u64> {
    let wanted = match id {
        Some(id) => format!("comment \"{RULE_TAG}{id}\""),
        None => format!("comment \"{RULE_TAG}"),
    };
    listing
        .lines()
        .filter(|l| l.contains(&wanted))
        .filter_map(|l| l.rsplit_once("# handle ")?.1.trim().parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walls(host_allow: &[HostPort]) -> Walls<'_> {
        Walls {
            pool: "10.200.0.0/16".parse().unwrap(),
            veth_prefix: "tpv",
            host_allow,
        }
    }

    #[test]
    fn policy_rules_put_deny_before_allow() {
        let policy = EgressPolicy {
            allow_internet: false,
            allow_out: vec!["10.1.0.0/16".parse().unwrap()],
            deny_out: vec![
                "10.1.2.0/24".parse().unwrap(),
                "8.8.8.8/32".parse().unwrap(),
            ],
        };
        let dns = SocketAddrV4::new(Ipv4Addr::new(10, 200, 0, 1), 10053);
        let script = host_policy("torpor", "sbx-1", "tpv3", &policy, Some(dns), &walls(&[]));
        let forward: Vec<&str> = script.lines().filter(|l| l.contains(" forward ")).collect();
        assert_eq!(forward.len(), 9, "{script}");
        assert!(forward[0].contains("ct state established,related accept"));
        assert!(forward[4].contains("ip daddr { 10.1.2.0/24, 8.8.8.8/32 } counter drop"));
        assert!(forward[5].contains("ip daddr @tpv3_d counter drop"));
        assert!(forward[6].contains("ip daddr { 10.1.0.0/16 } accept"));
        assert!(forward[7].contains("ip daddr @tpv3_a accept"));
        assert!(forward[8].ends_with("counter drop comment \"torpor:sbx-1\""));
        assert!(script.lines().all(|l| l.contains("iifname \"tpv3\"")));
        let input: Vec<&str> = script.lines().filter(|l| l.contains(" input ")).collect();
        assert_eq!(input.len(), 5, "{script}");
        assert!(input[1].contains("ip daddr 10.200.0.1 udp dport 10053 accept"));
        // The open default: the walls, the learned sets, no CIDR rules; the
        // host stays closed.
        let open = host_policy(
            "torpor",
            "s",
            "v",
            &EgressPolicy::default(),
            None,
            &walls(&[]),
        );
        assert_eq!(open.lines().count(), 9, "{open}");
        assert!(
            !open.contains("forward iifname \"v\" counter drop"),
            "{open}"
        );
        assert!(open.contains("input iifname \"v\" counter drop"), "{open}");
    }

    /// The host, the other sandboxes and link-local addresses are closed
    /// before anything a tenant's policy opens, even an allow-everything
    /// one; the operator's host services and the DNS forwarder stay open.
    #[test]
    fn walls_hold_whatever_the_policy() {
        let wide = EgressPolicy {
            allow_internet: true,
            allow_out: vec![
                "0.0.0.0/0".parse().unwrap(),
                "169.254.169.254".parse().unwrap(),
                "10.200.0.0/16".parse().unwrap(),
            ],
            deny_out: Vec::new(),
        };
        let dns = SocketAddrV4::new(Ipv4Addr::new(10, 200, 0, 1), 10053);
        let pg: HostPort = "10.0.0.5:5432".parse().unwrap();
        let script = host_policy("t", "s", "tpv0", &wide, Some(dns), &walls(&[pg]));
        let chain = |name: &str| -> Vec<String> {
            script
                .lines()
                .filter(|l| l.starts_with(&format!("add rule ip t {name} ")))
                .map(|l| l.split_once(" iifname \"tpv0\" ").unwrap().1.to_string())
                .map(|l| l.replace(" comment \"torpor:s\"", ""))
                .collect()
        };
        let forward = chain("forward");
        let first_accept = |rules: &[String]| {
            rules
                .iter()
                .skip(1)
                .position(|r| r.ends_with("accept"))
                .map_or(usize::MAX, |i| i + 1)
        };
        for wall in [
            "ip daddr 169.254.0.0/16 counter drop",
            "oifname \"tpv*\" counter drop",
            "ip daddr 10.200.0.0/16 counter drop",
        ] {
            let at = forward.iter().position(|r| r == wall);
            assert!(
                at.is_some_and(|i| i < first_accept(&forward)),
                "{wall} before any accept: {forward:#?}"
            );
        }
        let input = chain("input");
        assert_eq!(
            input,
            [
                "ct state established,related accept",
                "ip daddr 10.200.0.1 udp dport 10053 accept",
                "ip daddr @tpv0_d counter drop",
                "ip daddr 10.0.0.5/32 meta l4proto { tcp, udp } th dport 5432 accept",
                "counter drop",
            ],
            "the host is closed but for DNS and the operator's list"
        );
        assert_eq!(
            "10.0.0.0/8:80".parse::<HostPort>().unwrap().to_string(),
            "10.0.0.0/8:80"
        );
        for bad in [
            "10.0.0.1",
            "10.0.0.1:0",
            "10.0.0.1:x",
            "h:80",
            "10.0.0.1/8:80",
        ] {
            assert!(bad.parse::<HostPort>().is_err(), "{bad}");
        }
    }

    #[test]
    fn handles_are_found_by_tag() {
        let listing = "table ip torpor {\n\
            \tchain forward {\n\
            \t\ttype filter hook forward priority filter; policy accept;\n\
            \t\tiifname \"tpv0\" ct state established,related accept comment \"torpor:a\" # handle 7\n\
            \t\tiifname \"tpv1\" drop comment \"torpor:ab\" # handle 9\n\
            \t}\n}\n";
        assert_eq!(tagged_handles(listing, Some("a")), vec![7]);
        assert_eq!(tagged_handles(listing, Some("ab")), vec![9]);
        assert_eq!(tagged_handles(listing, None), vec![7, 9]);
        let counted = "chain forward {\n\
            iifname \"v\" ip daddr { 1.2.3.4 } counter packets 3 bytes 180 drop comment \"torpor:a\"\n\
            iifname \"v\" counter packets 2 bytes 120 drop comment \"torpor:a\"\n\
            iifname \"w\" counter packets 9 bytes 1 drop comment \"torpor:b\"\n\
            }\n\
            chain acct_in {\n\
            iifname \"v\" counter packets 10 bytes 1000 comment \"torpor:a\"\n\
            }\n\
            chain acct_out {\n\
            oifname \"v\" counter packets 4 bytes 400 comment \"torpor:a\"\n\
            }\n";
        assert_eq!(
            counters(counted, "a"),
            NetCounters {
                tx_bytes: 1000,
                tx_packets: 10,
                rx_bytes: 400,
                rx_packets: 4,
                dropped_packets: 5
            }
        );
        assert_eq!(
            tagged_veths(counted),
            vec![
                ("v".to_string(), "a".to_string()),
                ("w".to_string(), "b".to_string())
            ]
        );
    }

    #[test]
    fn the_sandbox_nat_maps_the_guest_both_ways() {
        let dns = SocketAddrV4::new(Ipv4Addr::new(10, 200, 0, 5), 10053);
        let s = sandbox_nat(Ipv4Addr::new(10, 200, 0, 6), "eth0", Some(dns));
        assert!(s.contains("ip daddr 10.200.0.6 dnat to 172.16.0.2"), "{s}");
        assert!(
            s.contains("ip daddr 172.16.0.1 udp dport 53 dnat to 10.200.0.5:10053"),
            "{s}"
        );
        let learned = learn("t", "v_a", &[Ipv4Addr::new(1, 2, 3, 4)], 60);
        assert!(
            learned.ends_with("add element ip t v_a { 1.2.3.4 timeout 60s }\n"),
            "{learned}"
        );
        assert!(s.contains("ip saddr 172.16.0.2 snat to 10.200.0.6"), "{s}");
    }
}
