//! The pod's DNS forwarder: a small UDP proxy in the host namespace that
//! every sandbox uses as its resolver (the guest asks its gateway
//! 172.16.0.1:53; the sandbox namespace's NAT sends that here, see
//! `rules::sandbox_nat`). It forwards queries to the host's resolver and
//! reads the answers, so that a domain in a sandbox's policy works:
//!
//! - a name under an `allow_out` domain: its A records are added to the
//!   sandbox's allow set for their TTL (before the answer is passed on, so
//!   the guest's connection right after finds them open);
//! - a name under a `deny_out` domain (with internet on): its A records
//!   are added to the deny set, and the guest is answered REFUSED (deny
//!   wins);
//! - any other name: answered as is, with internet on; with internet
//!   off it is REFUSED without asking upstream (a name the guest makes up
//!   would otherwise carry data to that zone's servers), and so is a
//!   denied one.
//!
//! Queries come only from sandbox addresses (anything else is dropped,
//! unanswered), are at most [`MAX_QUERY`] bytes with exactly one question,
//! and are rate-limited per sandbox; answers are cached (at most
//! `cache_entries`, for their TTL) and matched to queries by a fresh id
//! and the question. Messages are parsed and written with `hickory-proto`.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::RData;
use torpor_sync::Locked;

use super::{NameVerdict, NetError, NetManager, SandboxNet};

/// Queries longer than this are dropped (plain DNS over UDP).
pub const MAX_QUERY: usize = 512;
/// Answers longer than this from upstream are dropped (EDNS0's common
/// buffer size).
pub const MAX_ANSWER: usize = 4096;
/// Queries waiting for upstream at once; past that new ones are refused.
const MAX_PENDING: usize = 1024;
/// A query upstream has not answered in this long is forgotten.
const PENDING_TIMEOUT: Duration = Duration::from_secs(5);
/// Learned addresses stay open at least this long, at most a day, whatever
/// the TTL says (a TTL of 0 would close them before the guest connects).
const MIN_LEARN_S: u32 = 30;
const MAX_LEARN_S: u32 = 86_400;

/// Where the forwarder listens and whom it asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsConfig {
    /// In the host namespace; the port is `NetConfig::dns_port`.
    pub listen: SocketAddr,
    /// The host's resolver ([`upstream_from_resolv_conf`]).
    pub upstream: SocketAddr,
    /// Cached answers at most.
    pub cache_entries: usize,
    /// Queries a second each sandbox may send (and as many at once).
    pub queries_per_second: u32,
}

impl DnsConfig {
    pub fn new(port: u16, upstream: SocketAddr) -> Self {
        Self {
            listen: SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
            upstream,
            cache_entries: 4096,
            queries_per_second: 50,
        }
    }
}

/// The first `nameserver` of a resolv.conf text. A loopback stub
/// (systemd-resolved's 127.0.0.53) is fine: the forwarder runs on the host.
pub fn upstream_from_resolv_conf(text: &str) -> Option<SocketAddr> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .next()
}

/// What a query waiting for upstream needs to be answered.
struct Pending {
    client: SocketAddrV4,
    client_id: u16,
    net: SandboxNet,
    verdict: NameVerdict,
    key: (String, u16),
    sent: Instant,
}

struct Cached {
    message: Message,
    stored: Instant,
    ttl: Duration,
}

/// Per-sandbox token buckets.
#[derive(Default)]
struct Limiter {
    buckets: HashMap<String, (f64, Instant)>,
}

impl Limiter {
    fn allow(&mut self, sandbox: &str, per_second: u32, now: Instant) -> bool {
        let rate = f64::from(per_second.max(1));
        if self.buckets.len() > 100_000 {
            self.buckets.clear();
        }
        let (tokens, last) = self
            .buckets
            .entry(sandbox.to_string())
            .or_insert((rate, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * rate).min(rate);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

struct State {
    manager: Arc<NetManager>,
    config: DnsConfig,
    pending: Mutex<HashMap<u16, Pending>>,
    cache: Mutex<HashMap<(String, u16), Cached>>,
    limiter: Mutex<Limiter>,
    listen: UdpSocket,
    upstream: UdpSocket,
    stop: AtomicBool,
}

/// The running forwarder; stops when dropped.
pub struct Forwarder {
    state: Arc<State>,
    threads: Vec<std::thread::JoinHandle<()>>,
    local: SocketAddr,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("local", &self.local)
            .finish()
    }
}

impl Forwarder {
    /// Binds (in the manager's host namespace) and starts serving.
    pub fn start(manager: Arc<NetManager>, config: DnsConfig) -> Result<Self, NetError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| NetError::Spawn { tool: what, source }
        };
        let (listen, upstream) = manager
            .enter_host(|| {
                let listen = UdpSocket::bind(config.listen)?;
                let upstream = UdpSocket::bind(SocketAddr::new(
                    match config.upstream {
                        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                        SocketAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
                    },
                    0,
                ))?;
                Ok::<_, std::io::Error>((listen, upstream))
            })?
            .map_err(io("dns forwarder socket"))?;
        let tick = Some(Duration::from_millis(200));
        listen
            .set_read_timeout(tick)
            .map_err(io("dns listen socket"))?;
        upstream
            .set_read_timeout(tick)
            .map_err(io("dns upstream socket"))?;
        let local = listen.local_addr().map_err(io("dns listen socket"))?;
        let state = Arc::new(State {
            manager,
            config,
            pending: Mutex::new(HashMap::new()),
            cache: Mutex::new(HashMap::new()),
            limiter: Mutex::new(Limiter::default()),
            listen,
            upstream,
            stop: AtomicBool::new(false),
        });
        let queries = Arc::clone(&state);
        let answers = Arc::clone(&state);
        let threads = vec![
            std::thread::Builder::new()
                .name("dns-queries".into())
                .spawn(move || queries.serve_queries())
                .map_err(io("dns thread"))?,
            std::thread::Builder::new()
                .name("dns-answers".into())
                .spawn(move || answers.serve_answers())
                .map_err(io("dns thread"))?,
        ];
        tracing::info!(%local, upstream = %state.config.upstream, "DNS forwarder");
        Ok(Self {
            state,
            threads,
            local,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn refused(query: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut reply = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.queries = query.queries.clone();
    reply.to_vec().ok()
}

/// The A records of an answer, and the smallest TTL among them.
fn addresses(message: &Message) -> (Vec<Ipv4Addr>, u32) {
    let mut ttl = u32::MAX;
    let addrs = message
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => {
                ttl = ttl.min(r.ttl);
                Some(a.0)
            }
            _ => None,
        })
        .collect();
    (addrs, ttl)
}

impl State {
    fn serve_queries(&self) {
        let mut buf = [0u8; MAX_QUERY + 1];
        while !self.stop.load(Ordering::Relaxed) {
            let Ok((n, from)) = self.listen.recv_from(&mut buf) else {
                continue;
            };
            let SocketAddr::V4(from) = from else { continue };
            if n > MAX_QUERY {
                continue;
            }
            // Only sandboxes are answered: anyone else gets nothing (no
            // reflection, no open resolver).
            let Some(net) = self.manager.by_addr(*from.ip()) else {
                continue;
            };
            let allowed = self.limiter.locked().allow(
                &net.sandbox,
                self.config.queries_per_second,
                Instant::now(),
            );
            if !allowed {
                continue;
            }
            self.query(&buf[..n], from, net);
        }
    }

    fn reply(&self, to: SocketAddrV4, bytes: Option<Vec<u8>>) {
        if let Some(bytes) = bytes {
            let _ = self.listen.send_to(&bytes, to);
        }
    }

    fn query(&self, bytes: &[u8], from: SocketAddrV4, net: SandboxNet) {
        let Ok(query) = Message::from_vec(bytes) else {
            return;
        };
        if query.metadata.message_type != MessageType::Query {
            return;
        }
        if query.metadata.op_code != OpCode::Query || query.queries.len() != 1 {
            return self.reply(from, refused(&query, ResponseCode::NotImp));
        }
        let question = &query.queries[0];
        let name = question.name().to_lowercase().to_ascii();
        let name = name.strip_suffix('.').unwrap_or(&name).to_string();
        let policy = self.manager.policy_of(&net.sandbox).unwrap_or_default();
        let verdict = policy.judge(&name);
        if !policy.resolves(&name) {
            // With internet off only allowed names are asked upstream: any
            // other name is a channel out (to its zone's servers).
            return self.reply(from, refused(&query, ResponseCode::Refused));
        }
        let key = (name, u16::from(question.query_type()));
        if let Some(message) = self.cached(&key) {
            return self.answer(message, query.metadata.id, from, &net, verdict);
        }
        let mut pending = self.pending.locked();
        let now = Instant::now();
        pending.retain(|_, p| now.duration_since(p.sent) < PENDING_TIMEOUT);
        if pending.len() >= MAX_PENDING {
            drop(pending);
            return self.reply(from, refused(&query, ResponseCode::Refused));
        }
        let mut id = [0u8; 2];
        let id = loop {
            if crate::random::random_bytes(&mut id).is_err() {
                return;
            }
            let id = u16::from_be_bytes(id);
            if !pending.contains_key(&id) {
                break id;
            }
        };
        let mut upstream = query.clone();
        upstream.metadata.id = id;
        let Ok(out) = upstream.to_vec() else { return };
        pending.insert(
            id,
            Pending {
                client: from,
                client_id: query.metadata.id,
                net,
                verdict,
                key,
                sent: now,
            },
        );
        drop(pending);
        if let Err(e) = self.upstream.send_to(&out, self.config.upstream) {
            tracing::debug!("dns upstream: {e}");
        }
    }

    fn cached(&self, key: &(String, u16)) -> Option<Message> {
        let cache = self.cache.locked();
        let entry = cache.get(key)?;
        let age = entry.stored.elapsed();
        if age >= entry.ttl {
            return None;
        }
        let mut message = entry.message.clone();
        let age = age.as_secs() as u32;
        for r in message.answers.iter_mut() {
            r.ttl = r.ttl.saturating_sub(age);
        }
        Some(message)
    }

    fn store(&self, key: (String, u16), message: &Message) {
        if message.metadata.response_code != ResponseCode::NoError || message.metadata.truncation {
            return;
        }
        let ttl = message.answers.iter().map(|r| r.ttl).min().unwrap_or(0);
        if ttl == 0 || self.config.cache_entries == 0 {
            return;
        }
        let mut cache = self.cache.locked();
        if cache.len() >= self.config.cache_entries {
            cache.retain(|_, c| c.stored.elapsed() < c.ttl);
        }
        if cache.len() >= self.config.cache_entries {
            // Still full of live entries: the one closest to expiry goes.
            let oldest = cache
                .iter()
                .min_by_key(|(_, c)| c.ttl.saturating_sub(c.stored.elapsed()))
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                cache.remove(&k);
            }
        }
        cache.insert(
            key,
            Cached {
                message: message.clone(),
                stored: Instant::now(),
                ttl: Duration::from_secs(u64::from(ttl)),
            },
        );
    }

    /// Learns the answer's addresses per the verdict, then answers the
    /// sandbox (REFUSED for a denied name).
    fn answer(
        &self,
        mut message: Message,
        client_id: u16,
        to: SocketAddrV4,
        net: &SandboxNet,
        verdict: NameVerdict,
    ) {
        let (addrs, ttl) = addresses(&message);
        let ttl = ttl.clamp(MIN_LEARN_S, MAX_LEARN_S);
        let learned = match verdict {
            NameVerdict::Pass => Ok(()),
            NameVerdict::Allow => self.manager.learn(net, true, &addrs, ttl),
            NameVerdict::Deny => self.manager.learn(net, false, &addrs, ttl),
        };
        if let Err(e) = learned {
            tracing::warn!(sandbox = %net.sandbox, "cannot record resolved addresses: {e}");
            if verdict == NameVerdict::Allow {
                // Not opened: saying so beats a connection that hangs.
                message.metadata.id = client_id;
                return self.reply(to, refused(&message, ResponseCode::ServFail));
            }
        }
        message.metadata.id = client_id;
        if verdict == NameVerdict::Deny {
            return self.reply(to, refused(&message, ResponseCode::Refused));
        }
        self.reply(to, message.to_vec().ok());
    }

    fn serve_answers(&self) {
        let mut buf = vec![0u8; MAX_ANSWER + 1];
        while !self.stop.load(Ordering::Relaxed) {
            let Ok((n, from)) = self.upstream.recv_from(&mut buf) else {
                continue;
            };
            if from != self.config.upstream || n > MAX_ANSWER {
                continue;
            }
            let Ok(message) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            if message.metadata.message_type != MessageType::Response {
                continue;
            }
            let waiting = {
                let mut pending = self.pending.locked();
                // The id and the question must both match what was asked.
                let matches = pending.get(&message.metadata.id).is_some_and(|p| {
                    message.queries.len() == 1
                        && u16::from(message.queries[0].query_type()) == p.key.1
                        && message.queries[0]
                            .name()
                            .to_lowercase()
                            .to_ascii()
                            .trim_end_matches('.')
                            == p.key.0
                });
                if matches {
                    pending.remove(&message.metadata.id)
                } else {
                    None
                }
            };
            let Some(p) = waiting else { continue };
            self.store(p.key.clone(), &message);
            self.answer(message, p.client_id, p.client, &p.net, p.verdict);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upstream_is_the_first_nameserver() {
        let conf = "# hi\nsearch x\nnameserver 127.0.0.53\nnameserver 8.8.8.8\n";
        assert_eq!(
            upstream_from_resolv_conf(conf),
            Some("127.0.0.53:53".parse().unwrap())
        );
        assert_eq!(upstream_from_resolv_conf("nameserver bogus\n"), None);
    }

    #[test]
    fn each_sandbox_has_its_own_rate() {
        let mut l = Limiter::default();
        let now = Instant::now();
        assert!((0..5).all(|_| l.allow("a", 5, now)));
        assert!(!l.allow("a", 5, now), "the burst is spent");
        assert!(l.allow("b", 5, now), "b is not a");
        assert!(l.allow("a", 5, now + Duration::from_millis(250)));
    }
}
