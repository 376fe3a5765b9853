//! The proxy's two halves: [`open`] reaches the guest port through the
//! sandbox's agent (waking the sandbox, holding it active on a blocking
//! thread for as long as the connection lives, as the agent tunnel does),
//! and [`send`] speaks HTTP/1.1 over it with hyper's client: the request
//! and response bodies stream through unbuffered, hop-by-hop headers are
//! dropped both ways (RFC 9110 §7.6.1), the caller's credentials never
//! reach the guest, and an `Upgrade` (WebSocket) the guest accepts becomes
//! a byte stream between the two upgraded connections.

use std::io;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Version};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::GuestError;

use torpor_gate::backend::SandboxApi;
use torpor_gate::service::ServiceError;
use torpor_gate::tenancy::Tenancy;
use torpor_gate::tenancy::Traffic;

/// Where a masked request's own `Host` goes (E2B's proxy's header).
const FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// What a proxied connection holds until it ends: the blocking thread
/// that keeps the sandbox active, and the wake's admission.
struct Held {
    _done: std::sync::mpsc::Sender<()>,
    _ticket: Option<torpor_gate::quota::Ticket>,
}

/// An open byte pipe to a guest port.
pub(super) struct Pipe {
    stream: tokio::net::UnixStream,
    held: Arc<Held>,
}

/// Why the port could not be reached.
#[derive(Debug, thiserror::Error)]
pub(super) enum OpenError {
    /// Nothing listens on it (or the sandbox has no agent).
    #[error("port not open")]
    Closed,
    /// The sandbox went away meanwhile.
    #[error("sandbox not found")]
    Gone,
    /// Anything else, with the status to answer.
    #[error("{1}")]
    Failed(StatusCode, String),
}

fn open_error(e: ServiceError) -> OpenError {
    match e {
        ServiceError::Guest(g) if g.is_port_closed() => OpenError::Closed,
        ServiceError::Guest(GuestError::NoAgent { .. }) => OpenError::Closed,
        ServiceError::Guest(GuestError::Agent { error, .. }) if error.code == "ENOSYS" => {
            OpenError::Failed(
                StatusCode::BAD_GATEWAY,
                "the sandbox's agent predates guest ports (protocol 1.3): rebuild its image".into(),
            )
        }
        ServiceError::NotFound { .. } => OpenError::Gone,
        other => {
            let e2b = crate::E2bError::from(other);
            let status = StatusCode::from_u16(e2b.code).unwrap_or(StatusCode::BAD_GATEWAY);
            OpenError::Failed(status, e2b.message)
        }
    }
}

/// Opens guest port `port` of `sandbox` (woken first if hibernated, with
/// `ticket` its admission), on a thread of its own that holds `slot`
/// for as long as the connection lives (`torpor_gate::streams::run_long`).
pub(super) async fn open<S: SandboxApi>(
    tenancy: &Tenancy<S>,
    sandbox: &SandboxId,
    port: u16,
    ticket: Option<torpor_gate::quota::Ticket>,
    slot: torpor_gate::streams::StreamSlot,
) -> Result<Pipe, OpenError> {
    let (stream_tx, stream_rx) =
        tokio::sync::oneshot::channel::<Result<UnixStream, ServiceError>>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let service = Arc::clone(&tenancy.service);
    let id = sandbox.clone();
    torpor_gate::streams::run_long(slot, "port", move || {
        let mut stream_tx = Some(stream_tx);
        let sent = &mut stream_tx;
        // On the port's own blocking thread.
        let held = torpor_gate::backend::wait(service.with_guest(&id, &mut move |link| {
            let raw = link.dial_port(port)?;
            if let Some(tx) = sent.take() {
                let _ = tx.send(Ok(raw));
            }
            // Until every holder of the pipe is gone.
            let _ = done_rx.recv();
            Ok(())
        }));
        if let (Err(e), Some(tx)) = (held, stream_tx.take()) {
            let _ = tx.send(Err(e));
        }
    });
    let raw = match stream_rx.await {
        Ok(Ok(raw)) => raw,
        Ok(Err(e)) => return Err(open_error(e)),
        Err(_) => {
            return Err(OpenError::Failed(
                StatusCode::BAD_GATEWAY,
                "the guest port could not be reached".into(),
            ))
        }
    };
    let stream = raw
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(raw))
        .map_err(|e| OpenError::Failed(StatusCode::BAD_GATEWAY, e.to_string()))?;
    Ok(Pipe {
        stream,
        held: Arc::new(Held {
            _done: done_tx,
            _ticket: ticket,
        }),
    })
}

/// The headers of one hop only: the fixed ones and those `Connection`
/// names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::try_from(n.trim()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ] {
        headers.remove(name);
    }
}

/// The protocol a request asks to upgrade to, if it does.
fn upgrade_of(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    asks.then(|| headers.get(header::UPGRADE).cloned())
        .flatten()
}

/// The request as the guest gets it: HTTP/1.1, origin-form, `Host` kept
/// (or made from an HTTP/2 authority), hop-by-hop headers and the
/// caller's credentials dropped. With `masked` (the sandbox's
/// `ingress_host` for this port, E2B's `maskRequestHost`), `Host` is
/// that, the caller's in `X-Forwarded-Host`, as E2B's proxy sends.
fn outgoing(request: Request, upgrade: Option<&HeaderValue>, masked: Option<&str>) -> Request {
    let (mut parts, body) = request.into_parts();
    let host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::try_from(a.as_str()).ok())
    });
    strip_hop_by_hop(&mut parts.headers);
    for secret in [
        crate::API_KEY_HEADER,
        crate::envd::files::ACCESS_TOKEN_HEADER,
        crate::TRAFFIC_HEADER,
    ] {
        parts.headers.remove(secret);
    }
    let masked = masked.and_then(|m| HeaderValue::from_str(m).ok());
    match (host, masked) {
        (host, Some(masked)) => {
            if let Some(host) = host {
                parts.headers.insert(FORWARDED_HOST, host);
            }
            parts.headers.insert(header::HOST, masked);
        }
        (Some(host), None) => {
            parts.headers.insert(header::HOST, host);
        }
        (None, None) => {}
    }
    if let Some(protocol) = upgrade {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, protocol.clone());
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    parts.uri = path.parse().unwrap_or_default();
    parts.version = Version::HTTP_11;
    Request::from_parts(parts, body)
}

/// Sends `request` over `pipe` and answers with the guest's response,
/// streamed; an accepted upgrade is spliced on the runtime.
pub(super) async fn send(
    pipe: Pipe,
    mut request: Request,
    masked: Option<String>,
    traffic: Arc<Traffic>,
    sandbox: SandboxId,
) -> Result<Response, String> {
    let label = Traffic::label(&sandbox);
    let io = Counted {
        inner: pipe.stream,
        to_guest: traffic.to_guest.get_or_create(&label).clone(),
        from_guest: traffic.from_guest.get_or_create(&label).clone(),
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(io))
        .await
        .map_err(|e| format!("the guest port: {e}"))?;
    let held = Arc::clone(&pipe.held);
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("guest port connection: {e}");
        }
        drop(held);
    });
    let upgrade = upgrade_of(request.headers());
    let client_side = upgrade.is_some().then(|| hyper::upgrade::on(&mut request));
    let out = outgoing(request, upgrade.as_ref(), masked.as_deref());
    let mut response = sender
        .send_request(out)
        .await
        .map_err(|e| format!("the guest port did not answer: {e}"))?;
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_side) = client_side else {
            return Err("the guest switched protocols unasked".into());
        };
        let guest_side = hyper::upgrade::on(&mut response);
        let held = Arc::clone(&pipe.held);
        tokio::spawn(async move {
            match tokio::try_join!(client_side, guest_side) {
                Ok((client, guest)) => {
                    let (mut client, mut guest) = (TokioIo::new(client), TokioIo::new(guest));
                    if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut guest).await {
                        tracing::debug!("upgraded guest port connection: {e}");
                    }
                }
                Err(e) => tracing::debug!("guest port upgrade: {e}"),
            }
            drop(held);
        });
        let (parts, _) = response.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// The pipe with its bytes counted.
struct Counted {
    inner: tokio::net::UnixStream,
    to_guest: Counter,
    from_guest: Counter,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        self.from_guest.inc_by(read as u64);
        polled
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &polled {
            self.to_guest.inc_by(*n as u64);
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_credentials_stay_here() {
        let request = Request::builder()
            .uri("http://8000-sb.example.com/a?b=1")
            .header("connection", "keep-alive, x-private")
            .header("x-private", "1")
            .header("keep-alive", "timeout=5")
            .header("te", "trailers")
            .header("x-api-key", "k")
            .header("x-access-token", "t")
            .header("e2b-traffic-access-token", "t")
            .header("authorization", "Basic dTo=")
            .header("x-kept", "yes")
            .body(Body::empty())
            .unwrap();
        let out = outgoing(request, None, None);
        assert_eq!(out.uri(), "/a?b=1");
        assert_eq!(out.version(), Version::HTTP_11);
        let h = out.headers();
        assert_eq!(h[header::HOST], "8000-sb.example.com");
        for gone in [
            "connection",
            "x-private",
            "keep-alive",
            "te",
            "x-api-key",
            "x-access-token",
            "e2b-traffic-access-token",
        ] {
            assert!(!h.contains_key(gone), "{gone}");
        }
        assert_eq!(h["authorization"], "Basic dTo=");
        assert_eq!(h["x-kept"], "yes");
    }

    #[test]
    fn a_masked_host_replaces_the_callers_which_is_forwarded() {
        let request = Request::builder()
            .uri("/p")
            .header("host", "8000-sb.example.com")
            .body(Body::empty())
            .unwrap();
        let out = outgoing(request, None, Some("localhost:8000"));
        assert_eq!(out.headers()[header::HOST], "localhost:8000");
        assert_eq!(out.headers()["x-forwarded-host"], "8000-sb.example.com");
        // Unmasked, nothing is forwarded.
        let request = Request::builder()
            .uri("/p")
            .header("host", "h")
            .body(Body::empty())
            .unwrap();
        let out = outgoing(request, None, None);
        assert_eq!(out.headers()[header::HOST], "h");
        assert!(!out.headers().contains_key("x-forwarded-host"));
    }

    #[test]
    fn an_upgrade_is_kept_as_asked() {
        let request = Request::builder()
            .uri("/ws")
            .header("host", "h")
            .header("connection", "Upgrade")
            .header("upgrade", "websocket")
            .body(Body::empty())
            .unwrap();
        let protocol = upgrade_of(request.headers()).unwrap();
        let out = outgoing(request, Some(&protocol), None);
        assert_eq!(out.headers()["connection"], "upgrade");
        assert_eq!(out.headers()["upgrade"], "websocket");
    }
}
