//! The pod's end of the agent tunnel: a sandbox's agent through the pod
//! that runs it, the API server's way to a remote sandbox's guest for the
//! calls that speak the agent protocol themselves (E2B's envd RPCs:
//! processes, PTYs, watches).
//!
//! `POST /v1/sandboxes/{id}/agent` with `Upgrade: torpor-agent` (admin
//! only, so a pod's own token) wakes the sandbox, opens its agent's vsock
//! port and answers 101; from then on the connection carries the agent
//! protocol both ways until either side closes, the sandbox counting as
//! active all along. The API server's end, which makes that request, is
//! [`crate::pods::tunnel`].

use std::io;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use torpor_scheduler::model::SandboxId;

use crate::backend::SandboxApi;
use crate::error::ApiError;
use crate::pods::tunnel::PROTOCOL;
use crate::AppState;

/// The pod's end: `POST /v1/sandboxes/{id}/agent`.
pub async fn serve<S: SandboxApi>(
    State(state): State<AppState<S>>,
    Path(id): Path<String>,
    mut request: Request,
) -> Response {
    let asks = request
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(PROTOCOL));
    if !asks {
        return ApiError::invalid(format!(
            "this route upgrades the connection: send `Connection: Upgrade` and \
             `Upgrade: {PROTOCOL}`"
        ))
        .into_response();
    }
    let upgrade = hyper::upgrade::on(&mut request);
    let id = SandboxId::new(&id);
    let (stream_tx, stream_rx) = tokio::sync::oneshot::channel::<UnixStream>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Ended>();
    let service = Arc::clone(&state.service);
    // The agent stream is opened, and the sandbox kept active, on a
    // blocking thread for as long as the tunnel lives.
    let held = tokio::task::spawn_blocking(move || {
        let mut stream_tx = Some(stream_tx);
        torpor_gate::backend::wait(service.with_guest(&id, &mut move |link| {
            let raw = link.connect_raw()?;
            if let Some(tx) = stream_tx.take() {
                let _ = tx.send(raw);
            }
            // Until the tunnel ends (its sender says how, or is dropped).
            // The agent's end closing first is no news by itself (a
            // guest port's server hung up); a guest that shut down under
            // it is: the operator learns what its console and VMM said.
            if let Ok(Ended::ByTheAgent) = done_rx.recv() {
                let end = link.guest_end();
                if !end.is_empty() {
                    link.log_dropped(&format!("the agent tunnel ended{end}"));
                }
            }
            Ok(())
        }))
    });
    let raw = match stream_rx.await {
        Ok(raw) => raw,
        Err(_) => {
            return match held.await {
                Ok(Err(e)) => ApiError::from(e).into_response(),
                Ok(Ok(_)) => ApiError::internal("the agent stream was lost").into_response(),
                Err(join) => ApiError::internal(format!("agent tunnel: {join}")).into_response(),
            }
        }
    };
    tokio::spawn(async move {
        let ended = match pump(raw, upgrade).await {
            Ok(ended) => ended,
            Err(e) => {
                tracing::debug!("agent tunnel ended: {e}");
                Ended::ByTheClient
            }
        };
        let _ = done_tx.send(ended);
    });
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static(PROTOCOL));
    response
}

/// Which end of a tunnel closed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// The API server's end (the usual way: its call is done).
    ByTheClient,
    /// The guest's agent, with the API server's end still open.
    ByTheAgent,
}

/// Copies both ways until both ends are closed, each end's close passed
/// on to the other; says which closed first.
async fn pump(raw: UnixStream, upgrade: hyper::upgrade::OnUpgrade) -> io::Result<Ended> {
    use tokio::io::AsyncWriteExt;
    raw.set_nonblocking(true)?;
    let agent = tokio::net::UnixStream::from_std(raw)?;
    let client = TokioIo::new(upgrade.await.map_err(io::Error::other)?);
    let (mut from_client, mut to_client) = tokio::io::split(client);
    let (mut from_agent, mut to_agent) = agent.into_split();
    let up = async {
        let copied = tokio::io::copy(&mut from_client, &mut to_agent).await;
        let _ = to_agent.shutdown().await;
        copied
    };
    let down = async {
        let copied = tokio::io::copy(&mut from_agent, &mut to_client).await;
        let _ = to_client.shutdown().await;
        copied
    };
    tokio::pin!(up, down);
    tokio::select! {
        copied = &mut up => {
            copied?;
            down.await?;
            Ok(Ended::ByTheClient)
        }
        copied = &mut down => {
            copied?;
            up.await?;
            Ok(Ended::ByTheAgent)
        }
    }
}
