//! The host side of sandbox networking: one network namespace per sandbox
//! holding its tap, a veth pair to the host, and NAT, so that every clone
//! of a template keeps the template's guest address (172.16.0.2/30 behind
//! 172.16.0.1, MAC from the snapshot) and is still told apart on the host
//! by a unique address of its own.
//!
//! ```text
//!  guest eth0 172.16.0.2 ── tap0 172.16.0.1 │ sandbox netns │ eth0 10.200.x.2 ══ veth ══ tpvN 10.200.x.1 │ host
//!                                            SNAT 172.16.0.2 → 10.200.x.2, DNAT back      masquerade out, egress policy
//! ```
//!
//! Everything is done with the `ip` and `nft` tools (iproute2, nftables).
//! Names carry a configurable prefix, so a restarted service finds and
//! removes what an earlier one left ([`NetManager::recover`]).

/// `TryFrom<String>` (through `FromStr`) and `From<T> for String`
/// (through `Display`), for `#[serde(try_from = "String", into = "String")]`.
macro_rules! string_serde {
    ($t:ty) => {
        impl TryFrom<String> for $t {
            type Error = NetError;
            fn try_from(s: String) -> Result<Self, NetError> {
                s.parse()
            }
        }

        impl From<$t> for String {
            fn from(v: $t) -> String {
                v.to_string()
            }
        }
    };
}

pub mod dns;
mod policy;
pub mod ports;

mod rules;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use torpor_sync::Locked;

pub use policy::{EgressPolicy, NameVerdict, PolicyPatch, Target, MAX_ENTRIES};
pub use rules::{NetCounters, MASQUERADE_TAG, RULE_TAG};

/// The guest's address in every sandbox, its gateway (the tap), and the
/// prefix length of that link.
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
pub const GATEWAY_ADDR: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
pub const GUEST_PREFIX: u8 = 30;
/// The tap's name inside every sandbox namespace (what the VMM opens).
pub const TAP_NAME: &str = "tap0";
/// The gateway's (the tap's) MAC in every sandbox namespace: the same
/// everywhere, like the guest's address, so the gateway a guest learned
/// before a snapshot is still right in every clone and after every wake
/// (with a new MAC per namespace, a restored guest's replies went to the
/// old one until its neighbour entry expired, tens of seconds).
pub const GATEWAY_MAC: &str = "02:74:70:00:00:01";
/// The namespace's end of the veth.
pub const UPLINK: &str = "eth0";

/// An IPv4 network, `a.b.c.d/len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub len: u8,
}

impl FromStr for Cidr {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self, NetError> {
        let bad = || NetError::BadCidr(s.to_string());
        let (addr, len) = s.split_once('/').unwrap_or((s, "32"));
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
        let len: u8 = len.parse().map_err(|_| bad())?;
        if len > 32 || u32::from(addr) & !mask(len) != 0 {
            return Err(bad());
        }
        Ok(Cidr { addr, len })
    }
}

fn mask(len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

string_serde!(Cidr);

impl Cidr {
    /// Whether every address of `other` is in this network.
    pub fn contains(&self, other: &Cidr) -> bool {
        self.len <= other.len && u32::from(other.addr) & mask(self.len) == u32::from(self.addr)
    }
}

/// Link-local addresses (cloud metadata services live at 169.254.169.254):
/// never reachable from a sandbox, whatever its policy.
pub const LINK_LOCAL: Cidr = Cidr {
    addr: Ipv4Addr::new(169, 254, 0, 0),
    len: 16,
};

/// A service on the host that sandboxes may reach (`serve --host-allow
/// ADDR[/LEN]:PORT`, TCP and UDP): an operator's exception to the rule
/// that guests never reach the host's own addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct HostPort {
    pub net: Cidr,
    pub port: u16,
}

impl FromStr for HostPort {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self, NetError> {
        let bad = || NetError::Config(format!("`{s}` is not ADDR[/LEN]:PORT"));
        let (net, port) = s.rsplit_once(':').ok_or_else(bad)?;
        Ok(HostPort {
            net: net.parse()?,
            port: port.parse().ok().filter(|p| *p != 0).ok_or_else(bad)?,
        })
    }
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.net, self.port)
    }
}

string_serde!(HostPort);

/// Errors setting up or tearing down sandbox networks.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("`{0}` is not an IPv4 network (a.b.c.d/len, host bits zero)")]
    BadCidr(String),
    #[error("`{0}` is neither an IPv4 network nor a domain name")]
    BadTarget(String),
    #[error("cannot run {tool}: {source}")]
    Spawn {
        tool: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("no sandbox network left: all {0} link subnets are in use")]
    PoolExhausted(u32),
    #[error("sandbox `{0}` already has a network")]
    Exists(String),
    #[error("bad network configuration: {0}")]
    Config(String),
}

/// Names and addresses the manager uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// Namespaces are `{netns_prefix}{index}`.
    pub netns_prefix: String,
    /// Host-side veths are `{veth_prefix}{index}` (at most 9 characters:
    /// interface names have 15).
    pub veth_prefix: String,
    /// The nftables table (family ip) in the host namespace.
    pub table: String,
    /// The "host" namespace by name; `None` is this process's (tests put
    /// it in a namespace of their own).
    pub host_netns: Option<String>,
    /// Carved into /30 links: sandbox `i` has `pool + 4i + 1` on the host
    /// and `pool + 4i + 2` (its unique address) in its namespace.
    pub pool: Cidr,
    /// The UDP port the pod's DNS forwarder listens on in the host
    /// namespace (`dns::Forwarder`); guests' queries to their gateway are
    /// sent there. `None`: no forwarder (guests' queries go nowhere).
    pub dns_port: Option<u16>,
    /// Host services sandboxes may reach (`serve --host-allow`); every
    /// other address of the host is closed to them.
    pub host_allow: Vec<HostPort>,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            netns_prefix: "torpor-sbx-".into(),
            veth_prefix: "tpv".into(),
            table: "torpor".into(),
            host_netns: None,
            pool: Cidr {
                addr: Ipv4Addr::new(10, 200, 0, 0),
                len: 16,
            },
            dns_port: None,
            host_allow: Vec::new(),
        }
    }
}

/// One sandbox's network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxNet {
    pub sandbox: String,
    pub index: u32,
    /// The namespace (`/run/netns/<name>`) the sandbox's VMM runs in.
    pub netns: String,
    /// The tap inside it, for the VMM's `NetSpec`.
    pub tap: String,
    pub host_veth: String,
    pub host_addr: Ipv4Addr,
    /// The sandbox's own address on the host side (its guest's traffic
    /// leaves the namespace from it; exposed ports are reached at it).
    pub sandbox_addr: Ipv4Addr,
}

/// What is left on the host: namespaces, veths and tagged rules with this
/// manager's names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Leftovers {
    pub namespaces: usize,
    pub veths: usize,
    pub rules: usize,
    /// Learned-address sets (`{veth}_a`, `{veth}_d`).
    pub sets: usize,
}

/// Creates, changes and removes sandbox networks.
#[derive(Debug)]
pub struct NetManager {
    config: NetConfig,
    /// index → sandbox id.
    slots: Mutex<BTreeMap<u32, String>>,
    /// sandbox id → its egress policy (what the DNS forwarder judges by).
    policies: Mutex<BTreeMap<String, EgressPolicy>>,
}

fn run(tool: &str, args: &[&str], stdin: Option<&str>) -> Result<String, NetError> {
    let command = format!("{tool} {}", args.join(" "));
    let mut child = Command::new(tool)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| NetError::Spawn {
            tool: tool.to_string(),
            source,
        })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        let _ = pipe.write_all(text.as_bytes());
    }
    let out = child.wait_with_output().map_err(|source| NetError::Spawn {
        tool: tool.to_string(),
        source,
    })?;
    if !out.status.success() {
        return Err(NetError::Command {
            command,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether an error only says the thing is already gone.
fn is_gone(e: &NetError) -> bool {
    matches!(e, NetError::Command { stderr, .. }
        if stderr.contains("No such file") || stderr.contains("Cannot find device")
            || stderr.contains("does not exist") || stderr.contains("No such process"))
}

fn ignore_gone(r: Result<String, NetError>) -> Result<(), NetError> {
    match r {
        Ok(_) => Ok(()),
        Err(e) if is_gone(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

impl SandboxNet {
    /// The namespace file the VMM opens the tap in.
    pub fn netns_path(&self) -> std::path::PathBuf {
        std::path::Path::new("/run/netns").join(&self.netns)
    }

    /// What the sandbox's VMM is given (`LaunchSpec` boot or restore net),
    /// with the sandbox's rate limits.
    pub fn net_spec(
        &self,
        rx: torpor_vmm_api::RateLimit,
        tx: torpor_vmm_api::RateLimit,
    ) -> torpor_vmm_api::NetSpec {
        torpor_vmm_api::NetSpec {
            rx,
            tx,
            netns: Some(self.netns_path()),
            ..torpor_vmm_api::NetSpec::new(&self.tap)
        }
    }
}

impl NetManager {
    pub fn new(config: NetConfig) -> Result<Self, NetError> {
        if config.veth_prefix.is_empty() || config.veth_prefix.len() > 9 {
            return Err(NetError::Config(format!(
                "veth prefix `{}` must have 1 to 9 characters",
                config.veth_prefix
            )));
        }
        if config.pool.len > 30 {
            return Err(NetError::Config(format!(
                "pool {} is too small",
                config.pool
            )));
        }
        Ok(Self {
            config,
            slots: Mutex::new(BTreeMap::new()),
            policies: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    fn capacity(&self) -> u32 {
        let links = 1u64 << (32 - u32::from(self.config.pool.len)) >> 2;
        links.min(100_000) as u32
    }

    /// `ip` in the host namespace.
    fn host_ip(&self, args: &[&str]) -> Result<String, NetError> {
        match &self.config.host_netns {
            Some(ns) => {
                let mut full = vec!["-n", ns.as_str()];
                full.extend_from_slice(args);
                run("ip", &full, None)
            }
            None => run("ip", args, None),
        }
    }

    /// `nft` in the host namespace.
    fn host_nft(&self, args: &[&str], stdin: Option<&str>) -> Result<String, NetError> {
        match &self.config.host_netns {
            Some(ns) => {
                let mut full = vec!["netns", "exec", ns.as_str(), "nft"];
                full.extend_from_slice(args);
                run("ip", &full, stdin)
            }
            None => run("nft", args, stdin),
        }
    }

    /// Runs `f` on a thread in the host namespace (sockets made there
    /// belong there, wherever they are used afterwards).
    pub fn enter_host<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NetError> {
        let Some(ns) = &self.config.host_netns else {
            return Ok(f());
        };
        let path = std::path::Path::new("/run/netns").join(ns);
        let file = std::fs::File::open(&path).map_err(|source| NetError::Spawn {
            tool: format!("setns {}", path.display()),
            source,
        })?;
        std::thread::scope(|s| {
            s.spawn(|| {
                use std::os::fd::AsRawFd;
                // SAFETY: setns on a namespace descriptor we hold, on a
                // thread of our own that ends with `f`.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                if rc != 0 {
                    return Err(NetError::Spawn {
                        tool: format!("setns {}", path.display()),
                        source: std::io::Error::last_os_error(),
                    });
                }
                Ok(f())
            })
            .join()
            .unwrap_or_else(|_| Err(NetError::Config("a host-namespace thread panicked".into())))
        })
    }

    fn in_netns(
        ns: &str,
        tool: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<String, NetError> {
        let mut full = vec!["netns", "exec", ns, tool];
        full.extend_from_slice(args);
        run("ip", &full, stdin)
    }

    fn addrs(&self, index: u32) -> (Ipv4Addr, Ipv4Addr) {
        let base = u32::from(self.config.pool.addr) + 4 * index;
        (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
    }

    fn plan(&self, sandbox: &str, index: u32) -> SandboxNet {
        let (host_addr, sandbox_addr) = self.addrs(index);
        SandboxNet {
            sandbox: sandbox.to_string(),
            index,
            netns: format!("{}{index}", self.config.netns_prefix),
            tap: TAP_NAME.to_string(),
            host_veth: format!("{}{index}", self.config.veth_prefix),
            host_addr,
            sandbox_addr,
        }
    }

    fn allocate(&self, sandbox: &str) -> Result<u32, NetError> {
        let mut slots = self.slots.locked();
        if slots.values().any(|s| s == sandbox) {
            return Err(NetError::Exists(sandbox.to_string()));
        }
        let index = (0..self.capacity())
            .find(|i| !slots.contains_key(i))
            .ok_or(NetError::PoolExhausted(self.capacity()))?;
        slots.insert(index, sandbox.to_string());
        Ok(index)
    }

    fn release(&self, index: u32) {
        self.slots.locked().remove(&index);
    }

    /// The host table, forwarding and the shared masquerade rule, once.
    fn ensure_host(&self) -> Result<(), NetError> {
        let table = &self.config.table;
        self.host_nft(&["-f", "-"], Some(&rules::host_base(table)))?;
        let listing = self.host_nft(&["list", "chain", "ip", table, "postrouting"], None)?;
        if !listing.contains(MASQUERADE_TAG) {
            let rule = rules::host_masquerade(table, self.config.pool, &self.config.veth_prefix);
            self.host_nft(&["-f", "-"], Some(&rule))?;
        }
        self.host_sysctl_forward()
    }

    fn host_sysctl_forward(&self) -> Result<(), NetError> {
        let args = ["-qw", "net.ipv4.ip_forward=1"];
        match &self.config.host_netns {
            Some(ns) => Self::in_netns(ns, "sysctl", &args, None).map(drop),
            None => run("sysctl", &args, None).map(drop),
        }
    }

    /// Creates sandbox `sandbox`'s namespace, tap, veth pair, NAT and
    /// egress rules. On failure nothing of it is left.
    pub fn create(&self, sandbox: &str, policy: &EgressPolicy) -> Result<SandboxNet, NetError> {
        let index = self.allocate(sandbox)?;
        let net = self.plan(sandbox, index);
        match self.build(&net, policy) {
            Ok(()) => Ok(net),
            Err(e) => {
                if let Err(t) = self.remove(&net) {
                    tracing::warn!(sandbox, "cleaning up a failed network: {t}");
                }
                self.release(index);
                Err(e)
            }
        }
    }

    fn build(&self, net: &SandboxNet, policy: &EgressPolicy) -> Result<(), NetError> {
        self.ensure_host()?;
        let ns = net.netns.as_str();
        let host_cidr = format!("{}/30", net.host_addr);
        let sandbox_cidr = format!("{}/30", net.sandbox_addr);
        let gateway = format!("{GATEWAY_ADDR}/{GUEST_PREFIX}");
        run("ip", &["netns", "add", ns], None)?;
        self.host_ip(&[
            "link",
            "add",
            &net.host_veth,
            "type",
            "veth",
            "peer",
            "name",
            UPLINK,
            "netns",
            ns,
        ])?;
        self.host_ip(&["addr", "add", &host_cidr, "dev", &net.host_veth])?;
        self.host_ip(&["link", "set", &net.host_veth, "up"])?;
        let nsip = |args: &[&str]| {
            let mut full = vec!["-n", ns];
            full.extend_from_slice(args);
            run("ip", &full, None)
        };
        nsip(&["link", "set", "lo", "up"])?;
        nsip(&["addr", "add", &sandbox_cidr, "dev", UPLINK])?;
        nsip(&["link", "set", UPLINK, "up"])?;
        nsip(&["route", "add", "default", "via", &net.host_addr.to_string()])?;
        nsip(&["tuntap", "add", "dev", TAP_NAME, "mode", "tap"])?;
        nsip(&["link", "set", "dev", TAP_NAME, "address", GATEWAY_MAC])?;
        nsip(&["addr", "add", &gateway, "dev", TAP_NAME])?;
        nsip(&["link", "set", TAP_NAME, "up"])?;
        Self::in_netns(ns, "sysctl", &["-qw", "net.ipv4.ip_forward=1"], None)?;
        Self::in_netns(
            ns,
            "nft",
            &["-f", "-"],
            Some(&rules::sandbox_nat(net.sandbox_addr, UPLINK, self.dns(net))),
        )?;
        let table = &self.config.table;
        self.host_nft(
            &["-f", "-"],
            Some(&rules::host_sandbox(table, &net.sandbox, &net.host_veth)),
        )?;
        self.apply_policy(net, policy)
    }

    /// Where the sandbox's DNS queries go (the host end of its veth).
    fn dns(&self, net: &SandboxNet) -> Option<SocketAddrV4> {
        self.config
            .dns_port
            .map(|port| SocketAddrV4::new(net.host_addr, port))
    }

    /// What no sandbox reaches whatever its policy.
    fn walls(&self) -> rules::Walls<'_> {
        rules::Walls {
            pool: self.config.pool,
            veth_prefix: &self.config.veth_prefix,
            host_allow: &self.config.host_allow,
        }
    }

    fn apply_policy(&self, net: &SandboxNet, policy: &EgressPolicy) -> Result<(), NetError> {
        policy.check_at_most(2 * MAX_ENTRIES)?;
        let script = rules::host_policy(
            &self.config.table,
            &net.sandbox,
            &net.host_veth,
            policy,
            self.dns(net),
            &self.walls(),
        );
        self.host_nft(&["-f", "-"], Some(&script))?;
        self.policies
            .locked()
            .insert(net.sandbox.clone(), policy.clone());
        Ok(())
    }

    /// Replaces the sandbox's egress policy (at run time). Addresses
    /// learned under the old one are forgotten.
    pub fn set_policy(&self, net: &SandboxNet, policy: &EgressPolicy) -> Result<(), NetError> {
        policy.check_at_most(2 * MAX_ENTRIES)?;
        self.delete_rules(Some(&net.sandbox), &rules::POLICY_CHAINS)?;
        let table = &self.config.table;
        for set in rules::set_names(&net.host_veth) {
            self.host_nft(&["flush", "set", "ip", table, &set], None)?;
        }
        self.apply_policy(net, policy)
    }

    /// The policy the sandbox's rules were last built from.
    pub fn policy_of(&self, sandbox: &str) -> Option<EgressPolicy> {
        self.policies.locked().get(sandbox).cloned()
    }

    /// The network of the sandbox whose unique address is `addr` (where a
    /// query to the DNS forwarder came from).
    pub fn by_addr(&self, addr: Ipv4Addr) -> Option<SandboxNet> {
        let offset = u32::from(addr).checked_sub(u32::from(self.config.pool.addr))?;
        if offset % 4 != 2 {
            return None;
        }
        let index = offset / 4;
        let slots = self.slots.locked();
        slots.get(&index).map(|id| self.plan(id, index))
    }

    /// Opens (`allow`) or closes addresses a domain of the sandbox's
    /// policy resolved to, for `ttl_s` seconds.
    pub fn learn(
        &self,
        net: &SandboxNet,
        allow: bool,
        addrs: &[Ipv4Addr],
        ttl_s: u32,
    ) -> Result<(), NetError> {
        if addrs.is_empty() {
            return Ok(());
        }
        let [allowed, denied] = rules::set_names(&net.host_veth);
        let set = if allow { allowed } else { denied };
        let script = rules::learn(&self.config.table, &set, addrs, ttl_s);
        self.host_nft(&["-f", "-"], Some(&script)).map(drop)
    }

    /// The sandbox's traffic and policy drops (its rules' counters).
    pub fn counters(&self, net: &SandboxNet) -> Result<NetCounters, NetError> {
        Ok(self.counters_of(&[net])?.remove(0))
    }

    /// Counters of several sandboxes from one listing of the table.
    pub fn counters_of(&self, nets: &[&SandboxNet]) -> Result<Vec<NetCounters>, NetError> {
        let listing = self.host_nft(&["list", "table", "ip", &self.config.table], None)?;
        Ok(nets
            .iter()
            .map(|n| rules::counters(&listing, &n.sandbox))
            .collect())
    }

    /// Packets the sandbox's egress policy dropped (both chains).
    pub fn policy_drops(&self, net: &SandboxNet) -> Result<u64, NetError> {
        Ok(self.counters(net)?.dropped_packets)
    }

    fn delete_sets(&self, veth: &str) -> Result<(), NetError> {
        for set in rules::set_names(veth) {
            ignore_gone(self.host_nft(&["delete", "set", "ip", &self.config.table, &set], None))?;
        }
        Ok(())
    }

    /// Deletes the rules tagged for `sandbox` (every tagged rule: `None`)
    /// in `chains`.
    fn delete_rules(&self, sandbox: Option<&str>, chains: &[&str]) -> Result<usize, NetError> {
        let table = &self.config.table;
        let mut deleted = 0;
        for &chain in chains {
            let listing = match self.host_nft(&["-a", "list", "chain", "ip", table, chain], None) {
                Ok(l) => l,
                Err(e) if is_gone(&e) => continue,
                Err(e) => return Err(e),
            };
            for handle in rules::tagged_handles(&listing, sandbox) {
                let handle = handle.to_string();
                self.host_nft(
                    &["delete", "rule", "ip", table, chain, "handle", &handle],
                    None,
                )?;
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    fn remove(&self, net: &SandboxNet) -> Result<(), NetError> {
        self.delete_rules(Some(&net.sandbox), &rules::TAGGED_CHAINS)?;
        self.delete_sets(&net.host_veth)?;
        self.policies.locked().remove(&net.sandbox);
        ignore_gone(self.host_ip(&["link", "del", &net.host_veth]))?;
        // Takes the tap, the namespace's end of the veth and its table.
        ignore_gone(run("ip", &["netns", "del", &net.netns], None))
    }

    /// Removes the sandbox's network (delete, hibernate).
    pub fn delete(&self, net: &SandboxNet) -> Result<(), NetError> {
        self.remove(net)?;
        self.release(net.index);
        Ok(())
    }

    fn our_namespaces(&self) -> Result<Vec<String>, NetError> {
        let list = run("ip", &["netns", "list"], None)?;
        Ok(list
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&self.config.netns_prefix))
            .map(str::to_string)
            .collect())
    }

    fn our_veths(&self) -> Result<Vec<String>, NetError> {
        let list = self.host_ip(&["-o", "link", "show", "type", "veth"])?;
        Ok(list
            .lines()
            .filter_map(|l| l.split(':').nth(1))
            .map(|n| n.trim().split('@').next().unwrap_or("").to_string())
            .filter(|n| n.starts_with(&self.config.veth_prefix))
            .collect())
    }

    /// What exists on the host with this manager's names.
    pub fn leftovers(&self) -> Result<Leftovers, NetError> {
        let mut rules = 0;
        for chain in rules::TAGGED_CHAINS {
            match self.host_nft(
                &["-a", "list", "chain", "ip", &self.config.table, chain],
                None,
            ) {
                Ok(l) => rules += rules::tagged_handles(&l, None).len(),
                Err(e) if is_gone(&e) => {}
                Err(e) => return Err(e),
            }
        }
        let sets = match self.host_nft(&["list", "sets", "ip"], None) {
            Ok(l) => l
                .lines()
                .filter_map(|l| l.trim().strip_prefix("set "))
                .filter(|n| n.starts_with(&self.config.veth_prefix))
                .count(),
            Err(e) if is_gone(&e) => 0,
            Err(e) => return Err(e),
        };
        Ok(Leftovers {
            namespaces: self.our_namespaces()?.len(),
            veths: self.our_veths()?.len(),
            rules,
            sets,
        })
    }

    /// After a restart: keeps the networks of sandboxes `keep` says still
    /// run (their VMMs outlived the old service; owners are read back
    /// from the rule tags) and removes every other namespace, veth and rule
    /// with this manager's names. Returns the networks kept.
    pub fn adopt(&self, keep: &dyn Fn(&str) -> bool) -> Result<Vec<SandboxNet>, NetError> {
        let mut owners = Vec::new();
        match self.host_nft(
            &["list", "chain", "ip", &self.config.table, "forward"],
            None,
        ) {
            Ok(listing) => owners = rules::tagged_veths(&listing),
            Err(e) if is_gone(&e) => {}
            Err(e) => return Err(e),
        }
        let namespaces = self.our_namespaces()?;
        let mut kept = Vec::new();
        for (veth, id) in owners {
            let index = veth
                .strip_prefix(&self.config.veth_prefix)
                .and_then(|i| i.parse::<u32>().ok());
            let Some(index) = index else { continue };
            let net = self.plan(&id, index);
            if keep(&id) && namespaces.contains(&net.netns) {
                self.slots.locked().insert(index, id.clone());
                kept.push(net);
            } else {
                self.delete_rules(Some(&id), &rules::TAGGED_CHAINS)?;
                self.delete_sets(&veth)?;
            }
        }
        if kept.is_empty() {
            self.recover()?;
            return Ok(kept);
        }
        for ns in namespaces {
            if !kept.iter().any(|n| n.netns == ns) {
                ignore_gone(run("ip", &["netns", "del", &ns], None))?;
            }
        }
        for veth in self.our_veths()? {
            if !kept.iter().any(|n| n.host_veth == veth) {
                ignore_gone(self.host_ip(&["link", "del", &veth]))?;
            }
        }
        Ok(kept)
    }

    /// After a restart (the VMMs are gone with the old service): removes
    /// every namespace, veth and rule with this manager's names, and
    /// forgets every allocation. Returns what was there.
    pub fn recover(&self) -> Result<Leftovers, NetError> {
        let found = self.leftovers()?;
        for ns in self.our_namespaces()? {
            ignore_gone(run("ip", &["netns", "del", &ns], None))?;
        }
        for veth in self.our_veths()? {
            ignore_gone(self.host_ip(&["link", "del", &veth]))?;
        }
        ignore_gone(self.host_nft(&["delete", "table", "ip", &self.config.table], None))?;
        self.slots.locked().clear();
        self.policies.locked().clear();
        Ok(found)
    }
}
