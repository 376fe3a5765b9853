//! Egress policy: what a sandbox may reach, by network (CIDR) or by domain
//! name (`allow_out` / `deny_out`; deny wins over allow here, where E2B
//! lets allow win: `torpor_api`'s E2B layer maps one onto the other).
//!
//! A domain entry matches the name itself and every name under it
//! (`example.com` matches `example.com` and `pypi.example.com`). Domains
//! are enforced through the pod's DNS forwarder (`super::dns`): the
//! addresses it resolves for an allowed domain are added to the sandbox's
//! allow set for the answer's TTL, those of a denied domain to its deny set
//! (and the guest is answered REFUSED).

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{Cidr, NetError};

/// At most this many entries in each of `allow_out` and `deny_out`.
pub const MAX_ENTRIES: usize = 64;

/// One `allow_out` / `deny_out` entry: a network or a domain name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Target {
    Cidr(Cidr),
    /// Lower case, no trailing dot, checked by [`Target::from_str`].
    Domain(String),
}

/// In the OpenAPI document: the text it is read from and written as.
impl utoipa::PartialSchema for Target {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .description(Some(
                "An IPv4 network (`a.b.c.d/len`, host bits zero; a bare address is `/32`) or \
                 a domain name (matches the name and every name under it; enforced through \
                 the pod's DNS forwarder).",
            ))
            .examples(["10.0.0.0/8", "pypi.org"])
            .into()
    }
}

impl utoipa::ToSchema for Target {}

impl FromStr for Target {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self, NetError> {
        if s.bytes().next().is_some_and(|b| b.is_ascii_digit()) && s.contains(['.', '/']) {
            if let Ok(c) = s.parse::<Cidr>() {
                return Ok(Target::Cidr(c));
            }
            if s.bytes()
                .all(|b| b.is_ascii_digit() || b == b'.' || b == b'/')
            {
                return Err(NetError::BadCidr(s.to_string()));
            }
        }
        let name = s.strip_suffix('.').unwrap_or(s).to_ascii_lowercase();
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(NetError::BadTarget(s.chars().take(100).collect()));
        }
        Ok(Target::Domain(name))
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Cidr(c) => c.fmt(f),
            Target::Domain(d) => f.write_str(d),
        }
    }
}

string_serde!(Target);

impl From<Cidr> for Target {
    fn from(c: Cidr) -> Self {
        Target::Cidr(c)
    }
}

/// What a sandbox may reach (deny wins over allow).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = NetworkPolicy)]
#[serde(deny_unknown_fields)]
pub struct EgressPolicy {
    /// Everything not denied; when false only `allow_out` is reachable
    /// (and the pod's DNS forwarder).
    #[serde(default = "default_true")]
    pub allow_internet: bool,
    #[serde(default)]
    pub allow_out: Vec<Target>,
    #[serde(default)]
    pub deny_out: Vec<Target>,
}

fn default_true() -> bool {
    true
}

impl Default for EgressPolicy {
    fn default() -> Self {
        Self {
            allow_internet: true,
            allow_out: Vec::new(),
            deny_out: Vec::new(),
        }
    }
}

/// How a domain list judges a name.
fn matches(list: &[Target], name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    list.iter().any(|t| match t {
        Target::Domain(d) => {
            name.eq_ignore_ascii_case(d)
                || (name.len() > d.len()
                    && name.as_bytes()[name.len() - d.len() - 1] == b'.'
                    && name[name.len() - d.len()..].eq_ignore_ascii_case(d))
        }
        Target::Cidr(_) => false,
    })
}

/// Whether entry `outer` covers all of `inner` (a network containing
/// another, a domain with a name under it). A network never covers a
/// domain nor a domain a network: what a name resolves to is not known
/// here.
fn covers(outer: &Target, inner: &Target) -> bool {
    match (outer, inner) {
        (Target::Cidr(o), Target::Cidr(i)) => o.contains(i),
        (Target::Domain(_), Target::Domain(i)) => matches(std::slice::from_ref(outer), i),
        _ => false,
    }
}

/// The entries of `a` covered by some entry of `b` and of `b` covered by
/// some entry of `a`, redundant ones left out: what both lists allow
/// (networks and domain names nest or are apart, so each pair's
/// intersection is the smaller of the two or nothing).
fn intersect(a: &[Target], b: &[Target]) -> Vec<Target> {
    let mut out: Vec<Target> = Vec::new();
    let kept = a
        .iter()
        .filter(|x| b.iter().any(|y| covers(y, x)))
        .chain(b.iter().filter(|y| a.iter().any(|x| covers(x, y))));
    for t in kept {
        if out.iter().any(|o| covers(o, t)) {
            continue;
        }
        out.retain(|o| !covers(t, o));
        out.push(t.clone());
    }
    out
}

/// `a` then the entries of `b` not already in it.
fn union(a: &[Target], b: &[Target]) -> Vec<Target> {
    let mut out = a.to_vec();
    for t in b {
        if !out.contains(t) {
            out.push(t.clone());
        }
    }
    out
}

/// What the DNS forwarder does with a name a sandbox asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameVerdict {
    /// A denied domain: answer REFUSED, remember its addresses as denied.
    Deny,
    /// An allowed domain: answer, and open its addresses for their TTL.
    Allow,
    /// Neither: answer (CIDR rules and `allow_internet` decide).
    Pass,
}

impl EgressPolicy {
    pub fn cidrs(list: &[Target]) -> Vec<Cidr> {
        list.iter()
            .filter_map(|t| match t {
                Target::Cidr(c) => Some(*c),
                Target::Domain(_) => None,
            })
            .collect()
    }

    /// Deny wins: a name under both lists is denied.
    pub fn judge(&self, name: &str) -> NameVerdict {
        if matches(&self.deny_out, name) {
            NameVerdict::Deny
        } else if matches(&self.allow_out, name) {
            NameVerdict::Allow
        } else {
            NameVerdict::Pass
        }
    }

    /// This policy narrowed to `ceiling` (the operator's pod policy):
    /// what both allow, so a tenant's policy can never reach what the
    /// operator's does not. Internet only if both say so; every deny entry
    /// of either; `allow_out` the tenant's where the ceiling has internet,
    /// the ceiling's where the tenant has, else the entries both cover (a
    /// domain under a ceiling network, or the reverse, is left out: what
    /// the name resolves to is not known here). The result may have up to
    /// twice [`MAX_ENTRIES`] entries a list when both are full.
    pub fn within(&self, ceiling: &EgressPolicy) -> EgressPolicy {
        let allow_out = match (ceiling.allow_internet, self.allow_internet) {
            (true, _) => self.allow_out.clone(),
            (false, true) => ceiling.allow_out.clone(),
            (false, false) => intersect(&ceiling.allow_out, &self.allow_out),
        };
        EgressPolicy {
            allow_internet: ceiling.allow_internet && self.allow_internet,
            allow_out,
            deny_out: union(&ceiling.deny_out, &self.deny_out),
        }
    }

    /// Whether `name` may be resolved by the DNS forwarder at all: with
    /// internet off only names under `allow_out` domains (others are
    /// REFUSED without asking upstream: a name is a channel out).
    pub fn resolves(&self, name: &str) -> bool {
        match self.judge(name) {
            NameVerdict::Allow => true,
            NameVerdict::Pass | NameVerdict::Deny => self.allow_internet,
        }
    }

    /// Refuses lists longer than [`MAX_ENTRIES`] (what a tenant or the
    /// operator may give).
    pub fn check(&self) -> Result<(), NetError> {
        self.check_at_most(MAX_ENTRIES)
    }

    /// Refuses lists longer than `max` (a policy narrowed to the ceiling
    /// may hold both sides' entries: twice [`MAX_ENTRIES`]).
    pub fn check_at_most(&self, max: usize) -> Result<(), NetError> {
        for (name, list) in [("allow_out", &self.allow_out), ("deny_out", &self.deny_out)] {
            if list.len() > max {
                return Err(NetError::Config(format!(
                    "{name} has {} entries; at most {max}",
                    list.len()
                )));
            }
        }
        Ok(())
    }
}

/// A change of policy (the create request's `network`, and
/// `PATCH /v1/sandboxes/{id}/network`): what is given replaces that part,
/// what is left out is kept (the pod default at create).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(as = NetworkPolicyPatch)]
#[serde(deny_unknown_fields)]
pub struct PolicyPatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_internet: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<Target>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<Target>>,
}

impl PolicyPatch {
    pub fn is_empty(&self) -> bool {
        self.allow_internet.is_none() && self.allow_out.is_none() && self.deny_out.is_none()
    }

    /// `base` with this patch applied, checked, then narrowed to the
    /// operator's `ceiling` ([`EgressPolicy::within`]): what a tenant's
    /// patch becomes (it can add denies, narrow `allow_out`, turn internet
    /// off; never widen what the operator allows).
    pub fn apply_within(
        &self,
        base: &EgressPolicy,
        ceiling: &EgressPolicy,
    ) -> Result<EgressPolicy, NetError> {
        Ok(self.apply(base)?.within(ceiling))
    }

    /// `base` with this patch applied, checked.
    pub fn apply(&self, base: &EgressPolicy) -> Result<EgressPolicy, NetError> {
        let policy = EgressPolicy {
            allow_internet: self.allow_internet.unwrap_or(base.allow_internet),
            allow_out: self
                .allow_out
                .clone()
                .unwrap_or_else(|| base.allow_out.clone()),
            deny_out: self
                .deny_out
                .clone()
                .unwrap_or_else(|| base.deny_out.clone()),
        };
        policy.check()?;
        Ok(policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Target {
        s.parse().unwrap()
    }

    #[test]
    fn entries_are_networks_or_domain_names() {
        assert_eq!(t("10.0.0.0/8"), Target::Cidr("10.0.0.0/8".parse().unwrap()));
        assert_eq!(t("1.2.3.4"), Target::Cidr("1.2.3.4/32".parse().unwrap()));
        assert_eq!(t("PyPI.org."), Target::Domain("pypi.org".into()));
        assert_eq!(t("3com.example"), Target::Domain("3com.example".into()));
        for bad in [
            "10.0.0.1/8",
            "1.2.3.4/33",
            "",
            "a..b",
            "-a.b",
            "a b",
            "*.x.com",
            "x/y",
        ] {
            assert!(bad.parse::<Target>().is_err(), "{bad:?} accepted");
        }
        let long = format!("{}.com", "a".repeat(64));
        assert!(long.parse::<Target>().is_err());
        let policy: EgressPolicy =
            serde_json::from_str(r#"{"allow_out":["pypi.org","10.1.0.0/16"]}"#).unwrap();
        assert!(policy.allow_internet);
        assert_eq!(EgressPolicy::cidrs(&policy.allow_out).len(), 1);
        assert!(serde_json::from_str::<EgressPolicy>(r#"{"allow_out":["1.2.3.4/40"]}"#).is_err());
    }

    #[test]
    fn deny_wins_and_subdomains_match() {
        let policy = EgressPolicy {
            allow_internet: false,
            allow_out: vec![t("example.com"), t("pypi.org")],
            deny_out: vec![t("evil.example.com")],
        };
        assert_eq!(policy.judge("example.com"), NameVerdict::Allow);
        assert_eq!(policy.judge("WWW.Example.com."), NameVerdict::Allow);
        assert_eq!(policy.judge("evil.example.com"), NameVerdict::Deny);
        assert_eq!(policy.judge("a.evil.example.com"), NameVerdict::Deny);
        assert_eq!(policy.judge("notexample.com"), NameVerdict::Pass);
        assert_eq!(policy.judge("com"), NameVerdict::Pass);
    }

    #[test]
    fn a_patch_replaces_only_what_it_names() {
        let base = EgressPolicy {
            allow_internet: false,
            allow_out: vec![t("pypi.org")],
            deny_out: vec![],
        };
        let patch: PolicyPatch = serde_json::from_str(r#"{"deny_out":["10.0.0.0/8"]}"#).unwrap();
        let out = patch.apply(&base).unwrap();
        assert!(!out.allow_internet);
        assert_eq!(out.allow_out, base.allow_out);
        assert_eq!(out.deny_out, vec![t("10.0.0.0/8")]);
        let many = PolicyPatch {
            allow_out: Some(vec![t("a.com"); MAX_ENTRIES + 1]),
            ..PolicyPatch::default()
        };
        assert!(many.apply(&base).is_err());
        assert!(serde_json::from_str::<PolicyPatch>(r#"{"allow":[]}"#).is_err());
    }
    /// The operator's pod policy is a ceiling: a tenant's patch can add
    /// denies, narrow `allow_out` and turn internet off, never the reverse.
    #[test]
    fn a_tenant_cannot_widen_the_operators_policy() {
        let ceiling = EgressPolicy {
            allow_internet: false,
            allow_out: vec![t("10.1.0.0/16"), t("pypi.org"), t("192.0.2.0/24")],
            deny_out: vec![t("10.1.9.0/24"), t("evil.pypi.org")],
        };
        // Everything a tenant could ask to widen with.
        let widen: PolicyPatch = serde_json::from_str(
            r#"{"allow_internet":true,"allow_out":["0.0.0.0/0","10.0.0.0/8","example.com",
                "10.1.2.0/24","files.pypi.org","198.51.100.0/24"],"deny_out":[]}"#,
        )
        .unwrap();
        let got = widen.apply_within(&ceiling, &ceiling).unwrap();
        assert!(!got.allow_internet, "internet stays off");
        assert_eq!(got.deny_out, ceiling.deny_out, "operator denies stay");
        // The tenant asked for everything: what both allow is the
        // ceiling's list.
        assert_eq!(got.allow_out, ceiling.allow_out);
        assert!(!got.resolves("example.com") && !got.resolves("evil.pypi.org"));
        // Without internet, what both lists allow: the ceiling's networks
        // under the tenant's wider ones, the tenant's narrower ones, and
        // nothing the ceiling lacks.
        let list = PolicyPatch {
            allow_internet: None,
            ..widen.clone()
        };
        let narrowed = list.apply_within(&ceiling, &ceiling).unwrap();
        assert_eq!(
            narrowed.allow_out,
            vec![t("10.1.0.0/16"), t("192.0.2.0/24"), t("files.pypi.org"),],
        );
        for name in ["example.com", "pypi.org", "evil.pypi.org"] {
            assert!(!narrowed.resolves(name), "{name} resolved");
        }
        assert!(narrowed.resolves("files.pypi.org"));
        // On top of an earlier narrowing too (PATCH after create).
        let earlier = PolicyPatch {
            allow_out: Some(vec![t("pypi.org")]),
            ..PolicyPatch::default()
        }
        .apply_within(&ceiling, &ceiling)
        .unwrap();
        assert_eq!(earlier.allow_out, vec![t("pypi.org")]);
        let again = widen.apply_within(&earlier, &ceiling).unwrap();
        assert_eq!(again, got);

        // An open pod with denies: the tenant may turn internet off and
        // add denies, but the operator's denies cannot be dropped.
        let open = EgressPolicy {
            deny_out: vec![t("10.0.0.0/8")],
            ..EgressPolicy::default()
        };
        let narrow: PolicyPatch = serde_json::from_str(
            r#"{"allow_internet":false,"allow_out":["pypi.org"],"deny_out":["203.0.113.0/24"]}"#,
        )
        .unwrap();
        let got = narrow.apply_within(&open, &open).unwrap();
        assert!(!got.allow_internet);
        assert_eq!(got.allow_out, vec![t("pypi.org")]);
        assert_eq!(got.deny_out, vec![t("10.0.0.0/8"), t("203.0.113.0/24")]);
        let undo: PolicyPatch =
            serde_json::from_str(r#"{"allow_internet":true,"deny_out":[]}"#).unwrap();
        let got = undo.apply_within(&got, &open).unwrap();
        assert!(got.allow_internet, "the tenant's own narrowing is undone");
        assert_eq!(got.deny_out, open.deny_out, "but not the operator's");
        // A closed pod without allow_out resolves nothing.
        let closed = EgressPolicy {
            allow_internet: false,
            ..EgressPolicy::default()
        };
        assert!(!closed.resolves("example.com"));
        assert!(EgressPolicy::default().resolves("example.com"));
        // Both lists full: the narrowed policy still passes the manager's
        // bound.
        let full = |p: &str| {
            (0..MAX_ENTRIES)
                .map(|i| t(&format!("{p}{i}.com")))
                .collect()
        };
        let a = EgressPolicy {
            deny_out: full("a"),
            ..EgressPolicy::default()
        };
        let b = EgressPolicy {
            deny_out: full("b"),
            ..EgressPolicy::default()
        };
        assert!(b.within(&a).check_at_most(2 * MAX_ENTRIES).is_ok());
    }
}
