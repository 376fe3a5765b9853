//! Routing to remote pods: a layer on every sandbox route (and on
//! `PATCH /v1/pods/{id}`) that, when the sandbox (or pod) is a remote pod's,
//! forwards the request to that pod as it came (method, path, query, body,
//! content type; the pod's own token) and passes its answer back: status,
//! error body, `Location` and `X-Torpor-*` headers, with the pod's
//! `pod_local` renamed to its id here. Exec streams are relayed chunk by
//! chunk. A pod that does not answer: 502 `pod_unreachable`.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use torpor_scheduler::model::{PodId, SandboxId};
use torpor_scheduler::service::LOCAL_POD;

use crate::backend::{Relay, SandboxApi};
use crate::error::ApiError;
use crate::pods::{rewrite_pod_ids, RemotePod};
use crate::service::ServiceError;
use crate::Route;
use torpor_client::{Answer, Streaming};

/// Whether a route may be forwarded: a sandbox's own routes, and a pod's
/// update.
/// Not the agent tunnel: an upgraded connection is not a request to
/// relay; `Nested`'s own handler tunnels through the pod itself.
pub fn forwards(route: &Route) -> bool {
    (route.path.starts_with("/v1/sandboxes/{id}") && route.operation != "agentTunnel")
        || (route.path == "/v1/pods/{id}" && route.method == "PATCH")
}

enum Target {
    Sandbox,
    Pod,
}

/// The layer; `max_body` is the API's body limit, applied while the body
/// is read (a chunked body has no declared length): past it, 413 and the
/// rest is never read.
pub async fn forward<S: SandboxApi>(
    State((service, max_body)): State<(Arc<S>, usize)>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path().to_string();
    let segments: Vec<&str> = path.split('/').collect();
    let target = match (segments.get(2).copied(), segments.get(3).copied()) {
        (Some("sandboxes"), Some(id)) => service
            .relay(Relay::Sandbox {
                id: &SandboxId::new(id),
                method: request.method().as_str(),
                path: &path,
            })
            .await
            .map(|p| (p, Target::Sandbox)),
        (Some("pods"), Some(id)) => service
            .relay(Relay::Pod(&PodId::new(id)))
            .await
            .map(|p| (p, Target::Pod)),
        _ => None,
    };
    let Some((pod, target)) = target else {
        return next.run(request).await;
    };
    // A tenant's snapshot-as-template is made for that tenant on the pod
    // (its name in that tenant's namespace there); a fork goes through
    // the registry, for its source's tenant.
    let pod = match request.extensions().get::<crate::auth::Principal>() {
        Some(p) if !p.sees_all() && request.method() == "POST" && path.ends_with("/template") => {
            pod.acting_for(Some(&p.owner().tenant))
        }
        _ => pod,
    };
    let method = request.method().as_str().to_string();
    let query = request
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = match read_limited(request.into_body(), max_body).await {
        Ok(b) => b,
        Err(e) => return e,
    };
    let remote_path = match target {
        Target::Pod => format!("/v1/pods/{LOCAL_POD}{query}"),
        Target::Sandbox => format!("{path}{query}"),
    };
    if method == "POST" && path.ends_with("/fork") {
        return fork(service, pod, remote_path, body).await;
    }
    if method == "POST" && path.ends_with("/exec/stream") {
        return stream(pod, remote_path, content_type, body).await;
    }
    let call_pod = pod.clone();
    let answer = tokio::task::spawn_blocking(move || {
        let body = outgoing(content_type.as_deref(), &body);
        call_pod.client.request(&method, &remote_path, body, None)
    })
    .await;
    match answer {
        Ok(Ok(answer)) => pass_back(&pod, target, answer),
        Ok(Err(e)) => ApiError::from(pod.unreachable(&e)).into_response(),
        Err(join) => ApiError::internal(format!("forwarding failed: {join}")).into_response(),
    }
}

/// The whole body, or 413 as soon as more than `max` bytes came (what is
/// past the limit is never read), or 400 if it broke off.
async fn read_limited(body: Body, max: usize) -> Result<Bytes, Response> {
    let mut stream = body.into_data_stream();
    let mut out = Vec::new();
    loop {
        let next =
            std::future::poll_fn(|cx| futures_core::Stream::poll_next(Pin::new(&mut stream), cx))
                .await;
        match next {
            None => return Ok(Bytes::from(out)),
            Some(Ok(chunk)) => {
                if out.len() + chunk.len() > max {
                    return Err(crate::too_large(max as u64));
                }
                out.extend_from_slice(&chunk);
            }
            Some(Err(e)) => {
                return Err(
                    ApiError::invalid(format!("cannot read the request body: {e}")).into_response(),
                )
            }
        }
    }
}

/// The body to send on: as it came, typed as it came (raw bytes when
/// untyped, as the file routes take them).
fn outgoing<'a>(content_type: Option<&'a str>, body: &'a [u8]) -> Option<(&'a str, &'a [u8])> {
    match content_type {
        Some(ct) => Some((ct, body)),
        None if body.is_empty() => None,
        None => Some(("application/octet-stream", body)),
    }
}

/// The pod's answer as ours: JSON successes renamed, the rest as it came.
fn pass_back(pod: &RemotePod, target: Target, answer: Answer) -> Response {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let json = answer
        .header("content-type")
        .is_some_and(|c| c.starts_with("application/json"));
    let body = match serde_json::from_slice::<Value>(&answer.body) {
        Ok(mut v) if json && answer.is_success() => {
            match target {
                Target::Pod => pod.rename(&mut v),
                Target::Sandbox => rewrite_pod_ids(&mut v, &pod.id),
            }
            Bytes::from(v.to_string())
        }
        _ => Bytes::from(answer.body.clone()),
    };
    let mut response = (status, body).into_response();
    copy_headers(&answer.headers, &mut response);
    response
}

/// Content type, `Location` and the `X-Torpor-*` headers.
fn copy_headers(from: &[(String, String)], response: &mut Response) {
    for (name, value) in from {
        let keep = name == "content-type" || name == "location" || name.starts_with("x-torpor-");
        if !keep {
            continue;
        }
        if let (Ok(n), Ok(v)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::from_str(value),
        ) {
            response.headers_mut().insert(n, v);
        }
    }
}

async fn fork<S: SandboxApi>(
    service: Arc<S>,
    pod: RemotePod,
    path: String,
    body: Bytes,
) -> Response {
    let body: Value = if body.is_empty() {
        Value::Object(Default::default())
    } else {
        match serde_json::from_slice(&body) {
            Ok(v @ Value::Object(_)) => v,
            _ => return ApiError::invalid("the fork body must be a JSON object").into_response(),
        }
    };
    if body.get("count").is_some() {
        // Its pod would answer a list, recorded here as one sandbox.
        return ApiError::from(crate::service::ServiceError::Unsupported(
            "a nested pod's sandbox is forked one at a time: no count".into(),
        ))
        .into_response();
    }
    let result = tokio::task::spawn_blocking(move || {
        crate::backend::registry(&*service)?.forward_fork(&pod, &path, body)
    })
    .await;
    match result {
        Ok(Ok(sandbox)) => {
            let building = sandbox["state"] == "creating";
            let location = format!(
                "/v1/sandboxes/{}",
                sandbox["id"].as_str().unwrap_or_default()
            );
            crate::handlers::created(location, building, sandbox)
        }
        Ok(Err(e)) => ApiError::from(e).into_response(),
        Err(join) => ApiError::internal(format!("forwarding failed: {join}")).into_response(),
    }
}

/// Relays an NDJSON exec stream as the pod sends it.
async fn stream(
    pod: RemotePod,
    path: String,
    content_type: Option<String>,
    body: Bytes,
) -> Response {
    let (head_tx, head_rx) = oneshot::channel::<(u16, Vec<(String, String)>)>();
    let (chunk_tx, chunk_rx) = mpsc::channel::<Bytes>(16);
    let call_pod = pod.clone();
    let task = tokio::task::spawn_blocking(move || {
        let mut head_tx = Some(head_tx);
        let mut on_head = |status: u16, headers: &[(String, String)]| {
            if let Some(tx) = head_tx.take() {
                let _ = tx.send((status, headers.to_vec()));
            }
        };
        let mut on_chunk = |chunk: &[u8]| {
            // A client gone away drops the receiver: the rest is discarded.
            let _ = chunk_tx.blocking_send(Bytes::copy_from_slice(chunk));
        };
        let body = outgoing(content_type.as_deref(), &body);
        call_pod.client.request(
            "POST",
            &path,
            body,
            Some(Streaming {
                on_head: &mut on_head,
                on_chunk: &mut on_chunk,
            }),
        )
    });
    match head_rx.await {
        Ok((status, headers)) if (200..300).contains(&status) => {
            let mut response = (
                StatusCode::from_u16(status).unwrap_or(StatusCode::OK),
                Body::from_stream(Chunks(chunk_rx)),
            )
                .into_response();
            copy_headers(&headers, &mut response);
            response
        }
        _ => match task.await {
            Ok(Ok(answer)) => pass_back(&pod, Target::Sandbox, answer),
            Ok(Err(e)) => ApiError::from(pod.unreachable(&e)).into_response(),
            Err(join) => {
                ApiError::from(ServiceError::Internal(format!("forwarding failed: {join}")))
                    .into_response()
            }
        },
    }
}

/// A response body of the chunks a blocking producer sends (a relayed
/// answer, a file read by a blocking thread).
#[derive(Debug)]
pub struct Chunks(pub mpsc::Receiver<Bytes>);

impl futures_core::Stream for Chunks {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|c| c.map(Ok))
    }
}
