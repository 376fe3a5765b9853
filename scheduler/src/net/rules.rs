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
use std::net::Ipv4Addr;

use super::{Cidr, EgressPolicy, GUEST_ADDR};

/// Comment on every per-sandbox rule: `torpor:<sandbox id>`.
pub const RULE_TAG: &str = "torpor:";
/// Comment on the shared masquerade rule.
pub const MASQUERADE_TAG: &str = "torpor-masquerade";

/// Chains of the host table whose rules carry per-sandbox tags: `forward`
/// (to the outside) and `input` (to the host itself).
pub const POLICY_CHAINS: [&str; 2] = ["forward", "input"];

/// The host table and its chains (idempotent: `table` in a script adds).
pub fn host_base(table: &str) -> String {
    format!(
        "table ip {table} {{\n\
         \tchain postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}\n\
         \tchain forward {{ type filter hook forward priority filter; policy accept; }}\n\
         \tchain input {{ type filter hook input priority filter; policy accept; }}\n\
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

/// The sandbox's egress policy on its veth `veth`, in both policy chains:
/// replies to connections already set up pass; then `deny_out` drops, then
/// `allow_out` accepts (deny wins), then everything else is dropped unless
/// `allow_internet`.
pub fn host_policy(table: &str, id: &str, veth: &str, policy: &EgressPolicy) -> String {
    let mut out = String::new();
    let tag = format!("{RULE_TAG}{id}");
    for chain in POLICY_CHAINS {
        let mut rule = |body: &str| {
            let _ = writeln!(
                out,
                "add rule ip {table} {chain} iifname \"{veth}\" {body} comment \"{tag}\""
            );
        };
        rule("ct state established,related accept");
        if !policy.deny_out.is_empty() {
            rule(&format!("ip daddr {} counter drop", set(&policy.deny_out)));
        }
        if !policy.allow_out.is_empty() {
            rule(&format!("ip daddr {} accept", set(&policy.allow_out)));
        }
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

/// The sandbox namespace's NAT: the guest is seen as `sandbox_addr`.
pub fn sandbox_nat(sandbox_addr: Ipv4Addr, uplink: &str) -> String {
    format!(
        "table ip torpor {{\n\
         \tchain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n\
         \t\tiifname \"{uplink}\" ip daddr {sandbox_addr} dnat to {GUEST_ADDR}\n\
         \t}}\n\
         \tchain postrouting {{ type nat hook postrouting priority srcnat; policy accept;\n\
         \t\toifname \"{uplink}\" ip saddr {GUEST_ADDR} snat to {sandbox_addr}\n\
         \t}}\n\
         }}\n"
    )
}

/// Packets dropped by the policy rules tagged for `id` in the output of
/// `nft list chain` (their counters).
pub fn dropped_packets(listing: &str, id: &str) -> u64 {
    let tag = format!("comment \"{RULE_TAG}{id}\"");
    listing
        .lines()
        .filter(|l| l.contains(&tag) && l.contains(" drop "))
        .filter_map(|l| {
            let rest = l.split_once("counter packets ")?.1;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
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
        let script = host_policy("torpor", "sbx-1", "tpv3", &policy);
        let forward: Vec<&str> = script.lines().filter(|l| l.contains(" forward ")).collect();
        assert_eq!(forward.len(), 4, "{script}");
        assert!(forward[0].contains("ct state established,related accept"));
        assert!(forward[1].contains("ip daddr { 10.1.2.0/24, 8.8.8.8/32 } counter drop"));
        assert!(forward[2].contains("ip daddr { 10.1.0.0/16 } accept"));
        assert!(forward[3].ends_with("counter drop comment \"torpor:sbx-1\""));
        assert!(script.lines().all(|l| l.contains("iifname \"tpv3\"")));
        assert_eq!(script.lines().filter(|l| l.contains(" input ")).count(), 4);
        // The open default: only the established rule per chain.
        let open = host_policy("torpor", "s", "v", &EgressPolicy::default());
        assert_eq!(open.lines().count(), 2, "{open}");
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
        let counted = "iifname \"v\" ip daddr { 1.2.3.4 } counter packets 3 bytes 180 drop comment \"torpor:a\"\n\
            iifname \"v\" counter packets 2 bytes 120 drop comment \"torpor:a\"\n\
            iifname \"w\" counter packets 9 bytes 1 drop comment \"torpor:b\"\n";
        assert_eq!(dropped_packets(counted, "a"), 5);
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
        let s = sandbox_nat(Ipv4Addr::new(10, 200, 0, 6), "eth0");
        assert!(s.contains("ip daddr 10.200.0.6 dnat to 172.16.0.2"), "{s}");
        assert!(s.contains("ip saddr 172.16.0.2 snat to 10.200.0.6"), "{s}");
    }
}
