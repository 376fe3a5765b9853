//! The API server's end of the agent tunnel (the pod's is
//! `torpor_api::agent_tunnel`): [`dialer`] makes a pod's `POST
//! /v1/sandboxes/{id}/agent` with `Upgrade: torpor-agent` with hyper's
//! client over the pod's transport ([`PodLine`]: unix socket, or TLS
//! pinned to the pod's certificate) and hands the agent client one end of
//! a socket pair, pumped to the upgraded connection on the runtime: the
//! agent client stays synchronous.

use std::io;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::runtime::Handle;
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::Dialer;

use super::sanitized;
use torpor_client::pin::{pinned_client_config, Fingerprint};
use torpor_client::Endpoint;

/// The `Upgrade` protocol name.
pub const PROTOCOL: &str = "torpor-agent";
/// Longest the API server waits for a pod's 101 (the pod may wake the
/// sandbox first).
const UPGRADE_LIMIT: Duration = Duration::from_secs(120);

/// How the API server reaches one pod.
#[derive(Clone)]
pub struct PodLine {
    pub endpoint: Endpoint,
    pub token: String,
    pub pin: Option<Fingerprint>,
}

impl std::fmt::Debug for PodLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodLine")
            .field("endpoint", &self.endpoint)
            .field("token", &"[redacted]")
            .field("pin", &self.pin)
            .finish()
    }
}

/// The API server's end: a [`Dialer`] for sandbox `id` on the pod behind
/// `line`. Called on a blocking thread of `runtime`.
pub fn dialer(runtime: Handle, line: PodLine, id: SandboxId) -> Dialer {
    Arc::new(move || {
        let (ours, theirs) = UnixStream::pair()?;
        theirs.set_nonblocking(true)?;
        let line = line.clone();
        let path = format!("/v1/sandboxes/{}/agent", id.as_str());
        runtime.block_on(async move {
            let upgraded = tokio::time::timeout(UPGRADE_LIMIT, upgrade(&line, &path))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the pod did not answer"))??;
            let mut theirs = tokio::net::UnixStream::from_std(theirs)?;
            tokio::spawn(async move {
                let mut upgraded = upgraded;
                let _ = tokio::io::copy_bidirectional(&mut upgraded, &mut theirs).await;
            });
            Ok::<_, io::Error>(())
        })?;
        Ok(ours)
    })
}

type Upgraded = TokioIo<hyper::upgrade::Upgraded>;

/// Sends the upgrade request over a new connection to the pod; the
/// upgraded connection, or why not (the pod's status and error text).
async fn upgrade(line: &PodLine, path: &str) -> io::Result<Upgraded> {
    match &line.endpoint {
        Endpoint::Unix { path: socket } => {
            let io = tokio::net::UnixStream::connect(socket).await?;
            handshake(io, "localhost", "", path, &line.token).await
        }
        Endpoint::Tcp {
            authority,
            prefix,
            tls,
        } => {
            let tcp = tokio::net::TcpStream::connect(authority.as_str()).await?;
            let _ = tcp.set_nodelay(true);
            if !tls {
                return handshake(tcp, authority, prefix, path, &line.token).await;
            }
            let pin = line.pin.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a TLS pod needs its fingerprint",
                )
            })?;
            // The pin is the trust; the name only fills the handshake.
            let name = rustls::pki_types::ServerName::try_from("torpor.invalid")
                .map_err(io::Error::other)?;
            let connector = tokio_rustls::TlsConnector::from(pinned_client_config(pin));
            let io = connector.connect(name, tcp).await?;
            handshake(io, authority, prefix, path, &line.token).await
        }
    }
}

async fn handshake<T>(
    io: T,
    host: &str,
    prefix: &str,
    path: &str,
    token: &str,
) -> io::Result<Upgraded>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let request = hyper::Request::post(format!("{prefix}{path}"))
        .header(header::HOST, host)
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, PROTOCOL)
        .body(Body::empty())
        .map_err(io::Error::other)?;
    let response = sender
        .send_request(request)
        .await
        .map_err(io::Error::other)?;
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        let status = response.status();
        let body = axum::body::to_bytes(Body::new(response.into_body()), 64 << 10)
            .await
            .unwrap_or_default();
        let message = torpor_client::error_fields(&body)
            .map(|(_, m)| sanitized(&m))
            .unwrap_or_default();
        let kind = if status == StatusCode::NOT_FOUND {
            io::ErrorKind::NotFound
        } else {
            io::ErrorKind::ConnectionRefused
        };
        return Err(io::Error::new(
            kind,
            format!("the pod answered {status}: {message}"),
        ));
    }
    let upgraded = hyper::upgrade::on(response)
        .await
        .map_err(io::Error::other)?;
    Ok(TokioIo::new(upgraded))
}
