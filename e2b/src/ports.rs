//! Guest ports the way E2B's SDKs reach them: a request names a sandbox
//! and a TCP port of its guest either by the headers `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port` (on any path of a listener that serves envd: the
//! SDKs with `E2B_SANDBOX_URL`) or by its host name,
//! `{port}-{sandbox id}.{domain}` (`sandbox.get_host(port)`, the domain
//! the create and connect answers carry: `serve --proxy-domain`). Such a
//! request is proxied, as HTTP/1.1, to that port on the guest's loopback
//! through the sandbox's agent (its `connect`, protocol 1.3: no sandbox
//! network needed), the bodies streamed both ways and an `Upgrade`
//! (WebSocket) passed through ([`forward`]). envd's own port (49983)
//! named by host is served by envd's routes.
//!
//! Access ([`admit`]): every request needs a credential, checked before
//! anything is looked up: the sandbox's traffic token
//! (`E2B-Traffic-Access-Token`, `trafficAccessToken` in the create
//! answer), its envd access token (`X-Access-Token`) or an API key of its
//! tenant (`X-API-KEY`); none at all is E2B's 403 for a secured sandbox.
//! A wrong one, another tenant's key, an unknown or gone sandbox all
//! answer alike: E2B's 502 "The sandbox was not found" (the tenancy gate's
//! rule: nobody learns whether another's id exists). A hibernated sandbox
//! is woken, admitted against its tenant's quotas like any wake, and kept
//! active while a connection to its port lasts. Nothing listening on the
//! port is E2B's 502 "port is not open". Requests and bytes are counted
//! per sandbox ([`torpor_gate::tenancy::Traffic`], on `/metrics`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use torpor_scheduler::model::SandboxId;

use crate::envd::files::{self, Caller, Refused};
use crate::envd::SANDBOX_HEADER;
use crate::TRAFFIC_HEADER;
use torpor_gate::backend::SandboxApi;
use torpor_gate::tenancy::Tenancy;

mod forward;

/// The header naming the guest port (E2B's SDKs).
pub const PORT_HEADER: &str = "e2b-sandbox-port";
/// envd's port: served by envd's routes, never proxied.
pub const ENVD_PORT: u16 = 49983;

/// The ways a request names a guest port: the proxy's surface, which
/// `tests/attack_matrix.rs` aims at another tenant's sandboxes (a new way
/// belongs here, so the matrix covers it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addressing {
    /// `E2b-Sandbox-Id` and `E2b-Sandbox-Port` on any path.
    Headers,
    /// `Host: {port}-{id}.{domain}`.
    Host,
}

/// Every [`Addressing`].
pub const ADDRESSING: &[Addressing] = &[Addressing::Headers, Addressing::Host];

impl Addressing {
    /// The headers naming port `port` of sandbox `id` this way.
    pub fn headers(self, id: &str, port: u16, domain: &str) -> Vec<(&'static str, String)> {
        match self {
            Addressing::Headers => vec![
                ("E2b-Sandbox-Id", id.to_string()),
                ("E2b-Sandbox-Port", port.to_string()),
            ],
            Addressing::Host => vec![("Host", format!("{port}-{id}.{domain}"))],
        }
    }
}

/// What the router needs: the tenancy (tokens, quotas, the service, the
/// domain of host names: `None`, headers only).
pub struct Ports<S> {
    pub tenancy: Tenancy<S>,
}

impl<S> std::fmt::Debug for Ports<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ports")
            .field("domain", &self.tenancy.domain)
            .finish_non_exhaustive()
    }
}

impl<S> Clone for Ports<S> {
    fn clone(&self) -> Self {
        Ports {
            tenancy: self.tenancy.clone(),
        }
    }
}

/// Where a request goes.
#[derive(Debug, PartialEq, Eq)]
enum Target {
    /// Not a port request: the listener's own routes.
    Routes,
    /// envd named by host: envd's routes, with the sandbox's header set.
    Envd(String),
    /// A guest port.
    Port { id: String, port: u16 },
    /// A port header that is not a port.
    Bad(String),
}

/// The request's host (the `Host` header, or the URI's authority), its
/// port cut, lowercase.
fn host_of(request: &Request) -> Option<String> {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .or_else(|| request.uri().authority().map(|a| a.as_str().to_string()))?;
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host.as_str(),
    };
    Some(name.to_ascii_lowercase())
}

/// `{port}-{id}.{domain}` read from a host name.
fn parse_host(host: &str, domain: &str) -> Option<(u16, String)> {
    let label = host.strip_suffix(domain)?.strip_suffix('.')?;
    if label.contains('.') {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    (!id.is_empty()).then(|| (port, id.to_string()))
}

fn target(request: &Request, domain: Option<&str>) -> Target {
    if let Some(port) = request.headers().get(PORT_HEADER) {
        let Some(port) = port
            .to_str()
            .ok()
            .and_then(|p| p.trim().parse::<u16>().ok())
            .filter(|p| *p != 0)
        else {
            return Target::Bad("E2b-Sandbox-Port is not a port number".into());
        };
        if port == ENVD_PORT {
            return Target::Routes;
        }
        let id = request
            .headers()
            .get(SANDBOX_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty());
        return match id {
            Some(id) => Target::Port {
                id: id.to_string(),
                port,
            },
            None => Target::Bad("E2b-Sandbox-Port needs E2b-Sandbox-Id".into()),
        };
    }
    let Some(domain) = domain else {
        return Target::Routes;
    };
    match host_of(request).and_then(|h| parse_host(&h, domain)) {
        Some((ENVD_PORT, id)) => Target::Envd(id),
        Some((port, id)) => Target::Port { id, port },
        None => Target::Routes,
    }
}

/// The middleware in front of a listener's routes (see the module
/// documentation).
pub async fn route<S: SandboxApi>(
    State(ports): State<Ports<S>>,
    mut request: Request,
    next: Next,
) -> Response {
    match target(&request, ports.tenancy.domain.as_deref()) {
        Target::Routes => next.run(request).await,
        Target::Envd(id) => match HeaderValue::try_from(id) {
            Ok(id) => {
                request.headers_mut().insert(SANDBOX_HEADER, id);
                next.run(request).await
            }
            Err(_) => refusal(StatusCode::BAD_REQUEST, "", None, "bad sandbox id"),
        },
        Target::Bad(why) => refusal(StatusCode::BAD_REQUEST, "", None, &why),
        Target::Port { id, port } => proxy(ports.tenancy, id, port, request).await,
    }
}

/// E2B's proxy's error body: `{sandboxId, message, code}` (and `port`).
fn refusal(status: StatusCode, id: &str, port: Option<u16>, message: &str) -> Response {
    let mut body = json!({"sandboxId": id, "message": message, "code": status.as_u16()});
    if let Some(port) = port {
        body["port"] = port.into();
    }
    (status, axum::Json(body)).into_response()
}

/// E2B's words for a sandbox it cannot route to.
fn not_found(id: &str) -> Response {
    refusal(
        StatusCode::BAD_GATEWAY,
        id,
        None,
        "The sandbox was not found",
    )
}

/// E2B's words for a port nothing listens on.
fn port_closed(id: &str, port: u16) -> Response {
    refusal(
        StatusCode::BAD_GATEWAY,
        id,
        Some(port),
        "The sandbox is running but port is not open",
    )
}

/// A caller admitted to a sandbox's port.
struct Admitted {
    sandbox: SandboxId,
    /// The `Host` its guest ports are sent, if it says one
    /// (`Sandbox::ingress_host`, E2B's `maskRequestHost`).
    ingress_host: Option<String>,
    /// The wake's admission, if it is hibernated.
    ticket: Option<torpor_gate::quota::Ticket>,
    /// The connection's slot among its tenant's long requests.
    slot: torpor_gate::streams::StreamSlot,
}

/// Who may reach the port: the sandbox, the wake's admission and a slot of
/// its tenant's long requests (a connection may last: it holds a thread).
async fn admit<S: SandboxApi>(
    tenancy: &Tenancy<S>,
    id: &str,
    headers: &HeaderMap,
) -> Result<Admitted, Response> {
    if !Caller::shows_any(headers) {
        return Err(refusal(
            StatusCode::FORBIDDEN,
            id,
            None,
            &format!(
                "Sandbox is secured with traffic access token. Token header '{TRAFFIC_HEADER}' \
                 is missing"
            ),
        ));
    }
    let caller = Caller::for_ports(headers, &tenancy.auth);
    let t = tenancy.clone();
    let shown = id.to_string();
    let found: Result<_, torpor_gate::service::ServiceError> = async move {
        let s = &*t.service;
        match files::target_sandbox(s, &shown, &caller).await? {
            Ok(sandbox) => {
                let id = sandbox.id;
                let ticket = crate::envd::wake_ticket(s, &t, &id).await?;
                let tenant = s.sandbox_tenant(&id).await?;
                Ok(Ok((id, sandbox.ingress_host, ticket, tenant)))
            }
            Err(refused) => Ok(Err(refused)),
        }
    }
    .await;
    match found {
        Ok(Ok((sandbox, ingress_host, ticket, tenant))) => {
            let tenant = tenant.as_deref().unwrap_or(torpor_gate::auth::ADMIN_TENANT);
            match tenancy.streams.take(tenant) {
                Ok(slot) => Ok(Admitted {
                    sandbox,
                    ingress_host,
                    ticket,
                    slot,
                }),
                Err(e) => Err(refusal(e.status, id, None, &e.message)),
            }
        }
        // Not found, not the caller's, a wrong token: one answer.
        Ok(Err(Refused::Gone | Refused::Unauthorized)) => Err(not_found(id)),
        Err(e) => {
            let e2b = crate::E2bError::from(e);
            let status = StatusCode::from_u16(e2b.code).unwrap_or(StatusCode::BAD_GATEWAY);
            Err(refusal(status, id, None, &e2b.message))
        }
    }
}

/// A request for guest port `port` of sandbox `id`.
async fn proxy<S: SandboxApi>(
    tenancy: Tenancy<S>,
    id: String,
    port: u16,
    request: Request,
) -> Response {
    let Admitted {
        sandbox,
        ingress_host,
        ticket,
        slot,
    } = match admit(&tenancy, &id, request.headers()).await {
        Ok(admitted) => admitted,
        Err(refused) => return refused,
    };
    tenancy.traffic.request(&sandbox);
    let pipe = match forward::open(&tenancy, &sandbox, port, ticket, slot).await {
        Ok(pipe) => pipe,
        Err(forward::OpenError::Closed) => return port_closed(&id, port),
        Err(forward::OpenError::Gone) => return not_found(&id),
        Err(forward::OpenError::Failed(status, message)) => {
            return refusal(status, &id, Some(port), &message)
        }
    };
    let host = ingress_host.map(|h| torpor_scheduler::model::ingress_host_for(&h, port));
    forward::send(pipe, request, host, Arc::clone(&tenancy.traffic), sandbox)
        .await
        .unwrap_or_else(|message| refusal(StatusCode::BAD_GATEWAY, &id, Some(port), &message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    fn req(host: &str, headers: &[(&str, &str)]) -> Request {
        let mut b = Request::builder().uri("/x").header(header::HOST, host);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(Body::empty()).unwrap()
    }

    #[test]
    fn targets_by_header_and_by_host() {
        let d = Some("sbx.example.com");
        assert_eq!(
            target(&req("127.0.0.1:7700", &[]), d),
            Target::Routes,
            "no header, another host"
        );
        assert_eq!(
            target(
                &req(
                    "127.0.0.1",
                    &[(PORT_HEADER, "8000"), (SANDBOX_HEADER, "sb_1")]
                ),
                d
            ),
            Target::Port {
                id: "sb_1".into(),
                port: 8000
            }
        );
        assert_eq!(
            target(
                &req("x", &[(PORT_HEADER, "49983"), (SANDBOX_HEADER, "sb_1")]),
                d
            ),
            Target::Routes
        );
        assert!(matches!(
            target(&req("x", &[(PORT_HEADER, "http")]), d),
            Target::Bad(_)
        ));
        assert!(matches!(
            target(&req("x", &[(PORT_HEADER, "80")]), d),
            Target::Bad(_)
        ));
        assert_eq!(
            target(&req("8000-sb_1.SBX.example.com:443", &[]), d),
            Target::Port {
                id: "sb_1".into(),
                port: 8000
            }
        );
        assert_eq!(
            target(&req("49983-sb_1.sbx.example.com", &[]), d),
            Target::Envd("sb_1".into())
        );
        for other in [
            "8000-sb_1.example.com",
            "a.8000-sb_1.sbx.example.com",
            "0-sb_1.sbx.example.com",
            "x-sb_1.sbx.example.com",
            "8000-.sbx.example.com",
            "sbx.example.com",
        ] {
            assert_eq!(target(&req(other, &[]), d), Target::Routes, "{other}");
        }
        assert_eq!(
            target(&req("8000-sb_1.sbx.example.com", &[]), None),
            Target::Routes
        );
    }
}
