//! E2B's egress settings as torpor's egress policy: `network` and
//! `allow_internet_access` on create, `PUT /sandboxes/{id}/network`.
//!
//! E2B: an address is reachable when it is in `allowOut`, or when it is not
//! in `denyOut` and internet access is on ("allowed entries always take
//! precedence over denied entries"). torpor's policy: reachable when
//! `allow_internet` or in `allow_out`, and not in `deny_out` (deny wins).
//! The mapping keeps E2B's meaning exactly:
//!
//! - all traffic denied (`allow_internet_access: false`, or `0.0.0.0/0` in
//!   `denyOut`): `allow_internet` false and `allow_out` = `allowOut`; the
//!   other denials are implied, so `deny_out` is empty;
//! - otherwise `allow_internet` true and `deny_out` = `denyOut` with
//!   `allowOut`'s networks cut out of it (a denied network with an allowed
//!   hole is split around the hole); allowed entries outside every denied
//!   network change nothing, in E2B as here. A domain in `allowOut` beside
//!   a partial `denyOut` cannot be cut out before it is resolved: 400.
//!
//! Domains in `denyOut` are refused, as E2B refuses them. `dnsServers` is
//! read and not used: a sandbox resolves through its pod's DNS forwarder,
//! which is what lets domain rules work. What torpor does not offer
//! (`egressProxy`, `rules`, `maskRequestHost`, `httpsPorts`,
//! `allowPublicTraffic: false`) is refused with 400 when set.

use serde::Deserialize;
use serde_json::Value;
use torpor_scheduler::net::{Cidr, PolicyPatch, Target};

use super::error::E2bError;

/// `network` of a create, and the body of `PUT /sandboxes/{id}/network`
/// (which also carries `allow_internet_access`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct E2bNetwork {
    #[serde(default)]
    pub allow_out: Option<Vec<String>>,
    #[serde(default)]
    pub deny_out: Option<Vec<String>>,
    /// Read, not used (see the module's note).
    #[serde(default)]
    pub dns_servers: Option<Vec<String>>,
    #[serde(default)]
    pub allow_public_traffic: Option<bool>,
    #[serde(default)]
    pub egress_proxy: Option<Value>,
    #[serde(default)]
    pub rules: Option<Value>,
    #[serde(default)]
    pub mask_request_host: Option<Value>,
    #[serde(default)]
    pub https_ports: Option<Value>,
    /// E2B spells this one in snake case, in both bodies.
    #[serde(default, rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
}

impl E2bNetwork {
    /// The policy this asks for, in full (E2B's update replaces the whole
    /// configuration; a create's policy is whole too). `allow_internet`
    /// is the create's top-level `allow_internet_access` where that is
    /// the one given.
    pub fn policy(&self, allow_internet: Option<bool>) -> Result<PolicyPatch, E2bError> {
        self.refuse_unoffered()?;
        let allow: Vec<Target> = parse(self.allow_out.as_deref().unwrap_or_default(), "allowOut")?;
        let deny: Vec<Target> = parse(self.deny_out.as_deref().unwrap_or_default(), "denyOut")?;
        let mut denied = Vec::with_capacity(deny.len());
        for t in deny {
            match t {
                Target::Cidr(c) => denied.push(c),
                Target::Domain(d) => {
                    return Err(E2bError::bad_request(format!(
                        "denyOut: `{d}`: domain names are not supported for deny rules"
                    )))
                }
            }
        }
        let internet = self.allow_internet_access.or(allow_internet) != Some(false)
            && !denied.iter().any(|c| c.len == 0);
        if !internet {
            return Ok(PolicyPatch {
                allow_internet: Some(false),
                allow_out: Some(allow),
                deny_out: Some(Vec::new()),
            });
        }
        if !denied.is_empty() {
            if let Some(Target::Domain(d)) = allow.iter().find(|t| matches!(t, Target::Domain(_))) {
                return Err(E2bError::bad_request(format!(
                    "allowOut: `{d}`: a domain can be allowed through a deny list only when the \
                     deny list covers all traffic (0.0.0.0/0); list its networks instead"
                )));
            }
        }
        let holes: Vec<Cidr> = allow
            .iter()
            .filter_map(|t| match t {
                Target::Cidr(c) => Some(*c),
                Target::Domain(_) => None,
            })
            .collect();
        let mut rest: Vec<Cidr> = holes.iter().fold(denied, |d, hole| {
            d.into_iter().flat_map(|n| subtract(n, *hole)).collect()
        });
        rest.sort_by_key(|c| (u32::from(c.addr), c.len));
        let deny_out = rest.into_iter().map(Target::Cidr).collect();
        Ok(PolicyPatch {
            allow_internet: Some(true),
            allow_out: Some(allow),
            deny_out: Some(deny_out),
        })
    }

    /// A create's `maskRequestHost` ([`torpor_scheduler::model::check_ingress_host`]):
    /// the `Host` its guest ports are sent, if given. `allowPublicTraffic:
    /// false` asks for nothing more: torpor's ports always ask for a
    /// credential (`crate::ports`).
    pub fn ingress_host(&self) -> Result<Option<String>, E2bError> {
        match &self.mask_request_host {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(host)) => torpor_scheduler::model::check_ingress_host(host)
                .map(|()| Some(host.clone()))
                .map_err(E2bError::bad_request),
            Some(other) => Err(E2bError::bad_request(format!(
                "mask request host is not valid: {other}"
            ))),
        }
    }

    /// This without what a create reads apart ([`Self::ingress_host`]):
    /// the egress part, which [`Self::policy`] reads.
    pub fn egress(&self) -> Self {
        E2bNetwork {
            mask_request_host: None,
            allow_public_traffic: None,
            ..self.clone()
        }
    }

    /// Whether it asks for an egress policy (any field [`Self::policy`]
    /// reads or refuses).
    pub fn asks_egress(&self) -> bool {
        let set = |v: &Option<Value>| v.as_ref().is_some_and(is_set);
        self.allow_out.is_some()
            || self.deny_out.is_some()
            || self.allow_internet_access.is_some()
            || set(&self.egress_proxy)
            || set(&self.rules)
            || set(&self.https_ports)
            || self.allow_public_traffic == Some(false)
            || set(&self.mask_request_host)
    }

    fn refuse_unoffered(&self) -> Result<(), E2bError> {
        for (name, value) in [
            ("egressProxy", &self.egress_proxy),
            ("rules", &self.rules),
            ("maskRequestHost", &self.mask_request_host),
            ("httpsPorts", &self.https_ports),
        ] {
            if value.as_ref().is_some_and(is_set) {
                return Err(E2bError::bad_request(format!(
                    "network.{name} is not offered by torpor (see docs/e2b.md)"
                )));
            }
        }
        if self.allow_public_traffic == Some(false) {
            return Err(E2bError::bad_request(
                "network.allowPublicTraffic cannot be changed after the create: a sandbox's \
                 ports always ask for a credential (see docs/e2b.md)",
            ));
        }
        Ok(())
    }
}

fn parse(entries: &[String], what: &str) -> Result<Vec<Target>, E2bError> {
    entries
        .iter()
        .map(|e| {
            e.parse::<Target>()
                .map_err(|err| E2bError::bad_request(format!("{what}: {err}")))
        })
        .collect()
}

/// `net` without `hole`: `net` when they do not overlap, nothing when
/// `hole` covers it, else the networks of `net` beside the hole's path
/// (one per prefix length from `net`'s to the hole's).
fn subtract(net: Cidr, hole: Cidr) -> Vec<Cidr> {
    let bits = |c: Cidr| u32::from(c.addr);
    let mask = |len: u8| {
        if len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(len))
        }
    };
    let overlap =
        bits(net) & mask(net.len.min(hole.len)) == bits(hole) & mask(net.len.min(hole.len));
    if !overlap {
        return vec![net];
    }
    if hole.len <= net.len {
        return Vec::new();
    }
    (net.len + 1..=hole.len)
        .map(|len| {
            let sibling = (bits(hole) & mask(len)) ^ (1 << (32 - u32::from(len)));
            Cidr {
                addr: sibling.into(),
                len,
            }
        })
        .collect()
}

/// Set to something other than null or an empty object/array.
pub(super) fn is_set(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Object(m) => !m.is_empty(),
        Value::Array(a) => !a.is_empty(),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> E2bNetwork {
        serde_json::from_str(s).unwrap()
    }
    fn strings(v: &Option<Vec<Target>>) -> Vec<String> {
        v.iter().flatten().map(ToString::to_string).collect()
    }

    #[test]
    fn deny_all_with_holes_is_allow_internet_off() {
        let p = net(r#"{"allowOut":["1.1.1.1","pypi.org"],"denyOut":["0.0.0.0/0","9.9.9.9"]}"#)
            .policy(None)
            .unwrap();
        assert_eq!(p.allow_internet, Some(false));
        assert_eq!(strings(&p.allow_out), ["1.1.1.1/32", "pypi.org"]);
        assert_eq!(strings(&p.deny_out), Vec::<String>::new());
        // allow_internet_access false is the same as denying 0.0.0.0/0,
        // from the create's top level or the update's body.
        let p = net(r#"{"allowOut":["10.0.0.0/8"]}"#)
            .policy(Some(false))
            .unwrap();
        assert_eq!(p.allow_internet, Some(false));
        let p = net(r#"{"allow_internet_access":false}"#)
            .policy(None)
            .unwrap();
        assert_eq!(
            (p.allow_internet, strings(&p.allow_out)),
            (Some(false), vec![])
        );
    }

    #[test]
    fn allowed_networks_are_cut_out_of_a_partial_deny_list() {
        let p = net(r#"{"allowOut":["10.1.0.0/16"],"denyOut":["10.0.0.0/14","192.168.0.0/16"]}"#)
            .policy(None)
            .unwrap();
        assert_eq!(p.allow_internet, Some(true));
        assert_eq!(
            strings(&p.deny_out),
            ["10.0.0.0/16", "10.2.0.0/15", "192.168.0.0/16"]
        );
        // An allowed network covering a denied one removes it.
        let p = net(r#"{"allowOut":["10.0.0.0/8"],"denyOut":["10.3.0.0/16"]}"#)
            .policy(None)
            .unwrap();
        assert!(strings(&p.deny_out).is_empty());
        // Nothing given: everything open, as E2B's default.
        let p = net("{}").policy(None).unwrap();
        assert_eq!(p.allow_internet, Some(true));
        assert!(strings(&p.deny_out).is_empty() && strings(&p.allow_out).is_empty());
    }

    #[test]
    fn subtraction_covers_exactly_the_rest() {
        let n: Cidr = "10.0.0.0/8".parse().unwrap();
        let h: Cidr = "10.200.3.4".parse().unwrap();
        let parts = subtract(n, h);
        assert_eq!(parts.len(), 24);
        let total: u64 = parts.iter().map(|c| 1u64 << (32 - c.len)).sum();
        assert_eq!(total, (1 << 24) - 1);
        let inside = |c: &Cidr, a: u32| {
            let m = if c.len == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(c.len))
            };
            a & m == u32::from(c.addr)
        };
        assert!(!parts.iter().any(|c| inside(c, u32::from(h.addr))));
        assert!(parts.iter().all(|c| inside(&n, u32::from(c.addr))));
        assert_eq!(subtract(n, "11.0.0.0/8".parse().unwrap()), vec![n]);
    }

    #[test]
    fn what_cannot_be_kept_exactly_or_is_not_offered_is_400() {
        for body in [
            r#"{"denyOut":["example.com"]}"#,
            r#"{"allowOut":["pypi.org"],"denyOut":["10.0.0.0/8"]}"#,
            r#"{"allowOut":["not a host!"]}"#,
            r#"{"denyOut":["10.0.0.1/8"]}"#,
            r#"{"egressProxy":{"address":"socks5://x"}}"#,
            r#"{"rules":{"api.example.com":[{}]}}"#,
            // A PUT cannot change what the create set of the ports.
            r#"{"maskRequestHost":"x"}"#,
            r#"{"allowPublicTraffic":false}"#,
        ] {
            let e = net(body).policy(None).unwrap_err();
            assert_eq!(e.code, 400, "{body}: {}", e.message);
        }
        // A create reads them apart: the mask checked in E2B's words.
        let masked = net(r#"{"maskRequestHost":"localhost:${PORT}","allowPublicTraffic":false}"#);
        assert_eq!(
            masked.ingress_host().unwrap().as_deref(),
            Some("localhost:${PORT}")
        );
        assert!(!masked.egress().asks_egress());
        masked.egress().policy(None).unwrap();
        for bad in [
            r#"{"maskRequestHost":"a b"}"#,
            r#"{"maskRequestHost":"h/x"}"#,
            r#"{"maskRequestHost":""}"#,
            r#"{"maskRequestHost":5}"#,
        ] {
            let e = net(bad).ingress_host().unwrap_err();
            assert!(
                e.message.starts_with("mask request host is not valid"),
                "{bad}: {e:?}"
            );
        }
        let e = net(r#"{"maskRequestHost":"bücher.example"}"#)
            .ingress_host()
            .unwrap_err();
        assert!(e.message.contains("is not ASCII"), "{e:?}");
        // Defaults and nulls are fine, and dnsServers is read.
        net(r#"{"allowPublicTraffic":true,"egressProxy":null,"dnsServers":["8.8.8.8"]}"#)
            .policy(None)
            .unwrap();
    }
}
