//! Pods seen from an API server: how it calls a `torpor pod` (its REST
//! API with the pod's token, over a unix socket, plain loopback TCP or TLS
//! pinned to the pod's certificate; for a tenant, [`ON_BEHALF_OF`]), the
//! pod addresses it accepts, a pod's load for listing and placement, and
//! the API server's end of the agent tunnel ([`tunnel`]); `crate::relay`
//! forwards a request to the pod that serves it. Both the cluster's
//! replicas (their data plane) and `torpor serve`'s nested pod
//! (`crate::nested`) use them.

pub mod tunnel;

use std::time::Duration;

use serde_json::{json, Value};
use torpor_scheduler::model::{PodAddress, PodId};
use torpor_scheduler::service::LOCAL_POD;

use crate::error::code;
use crate::service::ServiceError;
use torpor_client::pin::Fingerprint;
use torpor_client::{error_fields, Answer, ClientError, Endpoint, HttpClient};

/// A registered remote pod and a client for it.
#[derive(Debug, Clone)]
pub struct RemotePod {
    /// Its id here (each pod calls itself `pod_local`).
    pub id: PodId,
    /// As registered: `unix:PATH`, `tcp:HOST:PORT` (loopback) or
    /// `tls:HOST:PORT`.
    pub address: String,
    /// For requests forwarded and operations (bounded by the API's request
    /// timeout).
    pub client: HttpClient,
    /// The pod's transport and token, for the agent tunnel.
    pub line: tunnel::PodLine,
    /// For reads that other answers wait on (lists, loads, placement): a
    /// pod that hangs must not hold up the other pods' part.
    lookup: HttpClient,
}

/// The header with which an admin principal acts for a tenant
/// (`crate::auth::Principal::on_behalf_of`): a pod's request for a
/// tenant carries it ([`RemotePod::acting_for`]); refused (403) from a
/// tenant's token.
pub const ON_BEHALF_OF: &str = "x-torpor-on-behalf-of";

/// Longest a lookup (list, load) waits for a pod.
pub const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// `unix:PATH`, `tcp:HOST:PORT` (a loopback host only: plain TCP carries
/// the pod's token and the sandboxes' traffic in clear) or `tls:HOST:PORT`
/// as the model's address.
pub fn pod_address(address: &str) -> Result<PodAddress, ServiceError> {
    if let Some(path) = address.strip_prefix("unix:").filter(|p| p.starts_with('/')) {
        return Ok(PodAddress::Unix { path: path.into() });
    }
    // The OpenAPI document's pattern says the same: a port is 1 to 5
    // digits up to 65535.
    let port = |p: &str| {
        (1..=5).contains(&p.len())
            && p.bytes().all(|b| b.is_ascii_digit())
            && p.parse::<u16>().is_ok()
    };
    let host_port = |a: &&str| {
        a.rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && port(p))
    };
    if let Some(addr) = address.strip_prefix("tls:").filter(host_port) {
        return Ok(PodAddress::Tls { addr: addr.into() });
    }
    if let Some(addr) = address.strip_prefix("tcp:").filter(host_port) {
        if !is_loopback_literal(addr) {
            return Err(ServiceError::Invalid(format!(
                "pod address {address:?}: plain TCP is for loopback only; a remote pod \
                 serves TLS: tls:HOST:PORT with its certificate's fingerprint"
            )));
        }
        return Ok(PodAddress::Tcp { addr: addr.into() });
    }
    Err(ServiceError::Invalid(format!(
        "pod address {address:?}: expected unix:/ABSOLUTE/PATH, tls:HOST:PORT or \
         tcp:LOOPBACK:PORT"
    )))
}

/// Whether `host:port`'s host is `localhost`, `127.A.B.C` (decimal
/// octets, no leading zeros) or `[::1]`: the loopback hosts a `tcp:` pod
/// address may name (the OpenAPI document's pattern for them).
fn is_loopback_literal(host_port: &str) -> bool {
    let Some((host, _)) = host_port.rsplit_once(':') else {
        return false;
    };
    let octet = |o: &str| {
        !o.is_empty()
            && o.len() <= 3
            && o.bytes().all(|b| b.is_ascii_digit())
            && !(o.len() > 1 && o.starts_with('0'))
            && o.parse::<u8>().is_ok()
    };
    let v4 = host
        .strip_prefix("127.")
        .is_some_and(|rest| rest.split('.').count() == 3 && rest.split('.').all(octet));
    host == "localhost" || host == "[::1]" || v4
}

/// Whether `host:port` names a loopback address (by literal or as
/// `localhost`).
pub fn is_loopback(host_port: &str) -> bool {
    let host = host_port
        .rsplit_once(':')
        .map_or(host_port, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl RemotePod {
    /// A client for the pod at `address`; a `tls:` address needs the
    /// fingerprint of the pod's certificate, the others take none.
    pub fn new(
        id: PodId,
        address: &str,
        token: &str,
        fingerprint: Option<Fingerprint>,
        io_timeout: Duration,
    ) -> Result<Self, ServiceError> {
        match (pod_address(address)?, fingerprint) {
            (PodAddress::Tls { .. }, None) => {
                return Err(ServiceError::Invalid(format!(
                    "pod address {address}: a TLS pod is reached with its certificate's \
                     fingerprint (printed by `torpor pod serve` when it starts)"
                )))
            }
            (PodAddress::Unix { .. } | PodAddress::Tcp { .. }, Some(_)) => {
                return Err(ServiceError::Invalid(format!(
                    "pod address {address}: a fingerprint applies to tls: addresses only"
                )))
            }
            _ => {}
        }
        let endpoint =
            Endpoint::parse(address).map_err(|e| ServiceError::Invalid(e.to_string()))?;
        let client = HttpClient::new(endpoint, Some(token.to_string()), io_timeout)
            .map_err(|e| ServiceError::Invalid(e.to_string()))?
            .pinned(fingerprint);
        let lookup = HttpClient::new(
            client.endpoint.clone(),
            Some(token.to_string()),
            io_timeout.min(LOOKUP_TIMEOUT),
        )
        .map_err(|e| ServiceError::Invalid(e.to_string()))?
        .pinned(fingerprint);
        let line = tunnel::PodLine {
            endpoint: client.endpoint.clone(),
            token: token.to_string(),
            pin: fingerprint,
        };
        Ok(RemotePod {
            id,
            address: address.to_string(),
            client,
            lookup,
            line,
        })
    }

    /// This pod called for `tenant` (none: as itself): every request
    /// carries [`ON_BEHALF_OF`], so that what the pod makes
    /// is that tenant's and template names resolve in its namespace there
    /// too. A tenant's create, fork and snapshot-as-template go so.
    pub fn acting_for(&self, tenant: Option<&str>) -> RemotePod {
        let Some(tenant) = tenant else {
            return self.clone();
        };
        let header = [(ON_BEHALF_OF, tenant)];
        RemotePod {
            client: self.client.clone().with_headers(&header),
            lookup: self.lookup.clone().with_headers(&header),
            ..self.clone()
        }
    }

    /// The error for a pod that did not answer.
    pub fn unreachable(&self, err: &ClientError) -> ServiceError {
        ServiceError::Pod {
            status: 502,
            code: code::POD_UNREACHABLE.into(),
            message: format!("pod {} ({}) is unreachable: {err}", self.id, self.address),
        }
    }

    /// One request with a JSON body (or none); the raw answer.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Answer, ServiceError> {
        self.send_with(&self.client, method, path, body)
    }

    fn send_with(
        &self,
        client: &HttpClient,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Answer, ServiceError> {
        let text = body.map(|b| b.to_string());
        let body = text.as_deref().map(|t| ("application/json", t.as_bytes()));
        client
            .request(method, path, body, None)
            .map_err(|e| self.unreachable(&e))
    }

    /// `PUT path` with `body` streamed as its octet-stream body (an
    /// image's file); its JSON answer.
    pub fn upload(&self, path: &str, body: &mut dyn std::io::Read) -> Result<Value, ServiceError> {
        let answer = self
            .client
            .upload("PUT", path, "application/octet-stream", body)
            .map_err(|e| self.unreachable(&e))?;
        self.json(answer, "PUT", path)
    }

    /// A `GET` other answers wait on, within [`LOOKUP_TIMEOUT`].
    pub fn look(&self, path: &str) -> Result<Value, ServiceError> {
        let answer = self.send_with(&self.lookup, "GET", path, None)?;
        self.json(answer, "GET", path)
    }

    /// One JSON request; 2xx answers give their JSON (`Null` when empty),
    /// error answers the pod's status, code and message.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ServiceError> {
        let answer = self.send(method, path, body)?;
        self.json(answer, method, path)
    }

    /// [`RemotePod::call`] from async code, on the caller's runtime.
    pub async fn fetch(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ServiceError> {
        let text = body.map(|b| b.to_string());
        let body = text.as_deref().map(|t| ("application/json", t.as_bytes()));
        let answer = self
            .client
            .fetch(method, path, body)
            .await
            .map_err(|e| self.unreachable(&e))?;
        self.json(answer, method, path)
    }

    fn json(&self, answer: Answer, method: &str, path: &str) -> Result<Value, ServiceError> {
        if !answer.is_success() {
            return Err(self.error(&answer));
        }
        if answer.body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&answer.body).map_err(|e| ServiceError::Pod {
            status: 502,
            code: code::POD_UNREACHABLE.into(),
            message: format!(
                "pod {}: the answer to {method} {path} is not JSON ({e})",
                self.id
            ),
        })
    }

    /// A pod's error answer as passed on.
    pub fn error(&self, answer: &Answer) -> ServiceError {
        let (code, message) = error_fields(&answer.body)
            .unwrap_or_else(|| (String::new(), String::from_utf8_lossy(&answer.body).into()));
        ServiceError::Pod {
            status: answer.status,
            code,
            message: format!("pod {}: {}", self.id, sanitized(&message)),
        }
    }

    /// The pod's own entry from its `GET /v1/pods`, as the server in front names
    /// it (id and address), with `reachable`; or the error.
    pub fn load(&self) -> Result<Value, ServiceError> {
        let answer = self.look("/v1/pods")?;
        let mut entry = answer["pods"]
            .as_array()
            .and_then(|pods| pods.iter().find(|p| p["id"] == LOCAL_POD).or(pods.first()))
            .cloned()
            .ok_or_else(|| ServiceError::Pod {
                status: 502,
                code: code::POD_UNREACHABLE.into(),
                message: format!("pod {} answered GET /v1/pods without a pod", self.id),
            })?;
        self.rename(&mut entry);
        entry["reachable"] = Value::Bool(true);
        Ok(entry)
    }

    /// The listing entry: the load, or `reachable: false` and the error.
    pub fn entry(&self) -> Value {
        match self.load() {
            Ok(v) => v,
            Err(e) => json!({
                "id": self.id,
                "address": pod_address(&self.address).ok(),
                "reachable": false,
                "error": e.to_string(),
            }),
        }
    }

    /// A pod entry the pod wrote about itself, renamed as registered here.
    pub fn rename(&self, entry: &mut Value) {
        entry["id"] = json!(self.id);
        entry["address"] = json!(pod_address(&self.address).ok());
    }
}

/// Free admission headroom of a pod entry, MiB: ratio × memory − committed.
pub fn headroom_mib(entry: &Value) -> f64 {
    let memory_mib = entry["memory_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64;
    let ratio = entry["oversubscription_ratio"].as_f64().unwrap_or(0.0);
    let committed = entry["committed_mib"].as_f64().unwrap_or(0.0);
    ratio * memory_mib - committed
}

/// Sets every `"pod": "pod_local"` in a pod's answer to the pod's id here.
pub fn rewrite_pod_ids(v: &mut Value, pod: &PodId) {
    match v {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                if key == "pod" && value == LOCAL_POD {
                    *value = json!(pod);
                } else {
                    rewrite_pod_ids(value, pod);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|i| rewrite_pod_ids(i, pod)),
        _ => {}
    }
}

pub use torpor_sandbox_api::sanitized;

/// Sandbox `id`'s metrics history as `pod` keeps it (its
/// `GET /v1/sandboxes/{id}/metrics`).
pub async fn metrics_history(
    pod: &RemotePod,
    id: &torpor_scheduler::model::SandboxId,
    range: crate::wire::Range,
) -> Result<Vec<torpor_scheduler::service::history::MetricSample>, crate::service::ServiceError> {
    let path = format!("/v1/sandboxes/{}/metrics{}", id.as_str(), range.query());
    let value = pod.fetch("GET", &path, None).await?;
    serde_json::from_value::<crate::wire::MetricHistory>(value)
        .map(|h| h.samples)
        .map_err(|e| crate::service::ServiceError::Pod {
            status: 502,
            code: crate::error::code::POD_UNREACHABLE.into(),
            message: format!("pod {}: its answer is not a metrics history ({e})", pod.id),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_headroom() {
        assert!(matches!(
            pod_address("unix:/run/p.sock"),
            Ok(PodAddress::Unix { .. })
        ));
        assert!(matches!(
            pod_address("tcp:127.0.0.1:7701"),
            Ok(PodAddress::Tcp { .. })
        ));
        assert!(matches!(
            pod_address("tcp:[::1]:7701"),
            Ok(PodAddress::Tcp { .. })
        ));
        assert!(matches!(
            pod_address("tls:10.1.2.3:7701"),
            Ok(PodAddress::Tls { .. })
        ));
        for bad in [
            "unix:rel",
            "tcp:host",
            "tcp::7",
            "http://h:1",
            "h:1",
            "tcp:10.1.2.3:7701",
            "tcp:example.com:7701",
            "tls:h",
        ] {
            assert!(pod_address(bad).is_err(), "{bad}");
        }
        let e =
            json!({"memory_bytes": 1u64 << 30, "oversubscription_ratio": 2.0, "committed_mib": 48});
        assert_eq!(headroom_mib(&e), 2000.0);
        let mut v = json!({"sandboxes": [{"id": "sbx_1", "pod": "pod_local"}], "sandbox": {"pod": "pod_x"}});
        rewrite_pod_ids(&mut v, &PodId::new("pod_r"));
        assert_eq!(v["sandboxes"][0]["pod"], "pod_r");
        assert_eq!(v["sandbox"]["pod"], "pod_x");
    }
}
