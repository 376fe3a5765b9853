//! Exec and files: the routes that reach into a sandbox's guest through its
//! agent. Each wakes a hibernated sandbox first and says so (`resumed`,
//! `resume_ms`; for raw file reads in `X-Torpor-Resumed` and
//! `X-Torpor-Resume-Ms` headers).
//!
//! - `POST /v1/sandboxes/{id}/exec`: runs a command to its end; the answer
//!   has its output (UTF-8 text, or base64 when either stream is not
//!   UTF-8: `encoding`), exit code or signal, and whether it timed out or
//!   its output was truncated at `max_output_bytes`.
//! - `POST /v1/sandboxes/{id}/exec/stream`: the same request; the answer is
//!   NDJSON, one line per event as the agent streams it: `start`, then
//!   `stdout`/`stderr` chunks (base64 `data`), then `exit` (or `error`).
//! - `GET|PUT /v1/sandboxes/{id}/files?path=`: a whole file as raw bytes;
//!   `GET /v1/sandboxes/{id}/files/list?path=`: a directory.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, Path, Query, State};
use axum::http::header::{self, HeaderValue};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::mpsc;
use torpor_agent::b64;
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::cancel::OnDrop;

use crate::backend::SandboxApi;
use crate::error::ApiError;
use crate::handlers::{call, Api, ApiResult};
use crate::service::{
    Cancel, DirListing, ExecOutput, ExecRequest, ExitReply, GuestCall, Outcome, OutputKind,
    ServiceError,
};

/// Output kept by `exec` unless the request asks for another limit.
pub const DEFAULT_MAX_OUTPUT: u64 = 1 << 20;
/// Largest `max_output_bytes` accepted (the agent's own cap).
pub const MAX_OUTPUT_LIMIT: u64 = 16 << 20;

/// The body of both exec routes (unknown fields refused).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[schema(as = ExecRequest)]
#[serde(deny_unknown_fields)]
pub struct ExecBody {
    /// Program and arguments (`argv[0]` looked up in `PATH`).
    pub argv: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Text written to stdin (then closed); absent: `/dev/null`.
    #[serde(default)]
    pub stdin: Option<String>,
    /// The same as base64, for bytes that are not text.
    #[serde(default)]
    pub stdin_base64: Option<String>,
    /// Kill the command's process group after this long (absent or 0: the
    /// service's `--exec-timeout-ms`, default 10 min, which is also the
    /// most one may ask for; more is refused with 400).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// stdout + stderr kept at most; the rest is dropped and flagged.
    #[serde(default)]
    pub max_output_bytes: Option<u64>,
}

impl ExecBody {
    /// The agent's request, or 400 for what the agent would refuse anyway.
    pub fn into_request(self, default_max_output: u64) -> Result<ExecRequest, ApiError> {
        if self.argv.first().is_none_or(|a| a.is_empty()) {
            return Err(ApiError::invalid(
                "argv must name a program: a non-empty list whose first item is not empty",
            ));
        }
        let stdin = match (self.stdin, self.stdin_base64) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "give stdin (text) or stdin_base64 (bytes), not both",
                ))
            }
            (Some(text), None) => Some(text.into_bytes()),
            (None, Some(encoded)) => Some(
                b64::decode(&encoded)
                    .map_err(|e| ApiError::invalid(format!("stdin_base64 is not base64: {e}")))?,
            ),
            (None, None) => None,
        };
        let max_output = self.max_output_bytes.unwrap_or(default_max_output);
        if max_output > MAX_OUTPUT_LIMIT {
            return Err(ApiError::invalid(format!(
                "max_output_bytes is at most {MAX_OUTPUT_LIMIT}"
            )));
        }
        Ok(ExecRequest {
            argv: self.argv,
            env: self.env,
            clear_env: false,
            cwd: self.cwd,
            stdin,
            timeout_ms: self.timeout_ms.filter(|&t| t > 0),
            max_output_bytes: Some(max_output),
        })
    }
}

/// How an exec ended (also the stream's `exit` line).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ExitBody {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub truncated: bool,
    pub duration_ms: f64,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
}

impl From<&ExitReply> for ExitBody {
    fn from(e: &ExitReply) -> Self {
        ExitBody {
            exit_code: e.code,
            signal: e.signal,
            timed_out: e.timed_out,
            truncated: e.truncated,
            duration_ms: e.duration_us as f64 / 1000.0,
            stdout_bytes: e.stdout_bytes,
            stderr_bytes: e.stderr_bytes,
        }
    }
}

/// `POST .../exec`'s answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = ExecResult)]
pub struct ExecAnswer {
    #[serde(flatten)]
    pub exit: ExitBody,
    /// `utf-8`, or `base64` when either stream is not valid UTF-8.
    pub encoding: &'static str,
    pub stdout: String,
    pub stderr: String,
    pub resumed: bool,
    pub resume_ms: Option<f64>,
}

impl From<GuestCall<ExecOutput>> for ExecAnswer {
    fn from(c: GuestCall<ExecOutput>) -> Self {
        let out = c.value;
        let (encoding, stdout, stderr) = match (
            String::from_utf8(out.stdout.clone()),
            String::from_utf8(out.stderr.clone()),
        ) {
            (Ok(o), Ok(e)) => ("utf-8", o, e),
            _ => ("base64", b64::encode(&out.stdout), b64::encode(&out.stderr)),
        };
        ExecAnswer {
            exit: ExitBody::from(&out.exit),
            encoding,
            stdout,
            stderr,
            resumed: c.outcome.resumed,
            resume_ms: c.outcome.resume_ms,
        }
    }
}

pub async fn exec<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    crate::wire::ApiJson(body): crate::wire::ApiJson<ExecBody>,
) -> ApiResult<Json<ExecAnswer>> {
    let req = body.into_request(DEFAULT_MAX_OUTPUT)?;
    let id = SandboxId::new(id);
    // A client that goes away drops this future: the guard cancels the
    // exec, and the agent kills the command.
    let cancel = Cancel::default();
    let guard = cancel.on_drop();
    let answer = call(&st, move |s| async move {
        let s = &*s;
        s.exec(&id, req, &cancel).await
    })
    .await;
    guard.disarm();
    Ok(Json(answer?.into()))
}

/// What the blocking exec hands to the streaming body.
enum Event {
    Started(Outcome),
    Output(OutputKind, Vec<u8>),
    Done(Result<GuestCall<ExitReply>, ServiceError>),
}

/// The NDJSON body: one line per event, ending after `exit` or `error`.
/// Dropped before its end (the client went away), it cancels the exec.
struct Lines {
    rx: mpsc::Receiver<Event>,
    ended: bool,
    cancel: Option<OnDrop>,
}

fn line(v: serde_json::Value) -> Bytes {
    let mut text = v.to_string();
    text.push('\n');
    Bytes::from(text)
}

impl futures_core::Stream for Lines {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let bytes = loop {
            let event = match self.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(e) => e,
            };
            break match event {
                // Sent once, before the stream was built.
                Some(Event::Started(_)) => continue,
                Some(Event::Output(kind, data)) => {
                    let kind = match kind {
                        OutputKind::Stdout => "stdout",
                        OutputKind::Stderr => "stderr",
                    };
                    line(json!({ "type": kind, "data": b64::encode(&data) }))
                }
                Some(Event::Done(Ok(done))) => {
                    self.ended = true;
                    if let Some(guard) = self.cancel.take() {
                        guard.disarm();
                    }
                    let mut v =
                        serde_json::to_value(ExitBody::from(&done.value)).unwrap_or_default();
                    v["type"] = "exit".into();
                    line(v)
                }
                Some(Event::Done(Err(e))) => {
                    self.ended = true;
                    if let Some(guard) = self.cancel.take() {
                        guard.disarm();
                    }
                    let e = ApiError::from(e);
                    line(
                        json!({ "type": "error", "status": e.status.as_u16(), "code": e.code,
                                 "message": e.message }),
                    )
                }
                None => {
                    self.ended = true;
                    line(json!({ "type": "error", "status": 500, "code": "internal",
                                 "message": "the exec ended without an exit (service failure)" }))
                }
            };
        };
        Poll::Ready(Some(Ok(bytes)))
    }
}

/// `POST .../exec/stream`. Errors before the command starts (unknown or
/// probe sandbox, bad state, failed wake) are ordinary error answers; once
/// it runs the status is 200 and a failure is the stream's `error` line.
pub async fn exec_stream<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<crate::auth::Principal>,
    Path(id): Path<String>,
    crate::wire::ApiJson(body): crate::wire::ApiJson<ExecBody>,
) -> ApiResult<Response> {
    let req = body.into_request(MAX_OUTPUT_LIMIT)?;
    let id = SandboxId::new(id);
    // A slot of the caller's tenant for as long as it streams, on a thread
    // of its own (`crate::streams`).
    let slot = st.tenancy.streams.take(&p.owner().tenant)?;
    let (tx, mut rx) = mpsc::channel::<Event>(64);
    let service = std::sync::Arc::clone(&st.service);
    // A client that goes away (before the first line, or while the body
    // streams) cancels the exec: the agent kills the command.
    let cancel = Cancel::default();
    let guard = cancel.on_drop();
    crate::streams::run_long(slot, "exec", move || {
        // On the stream's own blocking thread.
        let result = torpor_gate::backend::wait(service.exec_streaming(
            &id,
            req,
            &cancel,
            &mut |outcome| drop(tx.blocking_send(Event::Started(outcome.clone()))),
            &mut |kind, data| drop(tx.blocking_send(Event::Output(kind, data.to_vec()))),
        ));
        let _ = tx.blocking_send(Event::Done(result));
    });
    let outcome = match rx.recv().await {
        Some(Event::Started(outcome)) => outcome,
        Some(Event::Done(Err(e))) => return Err(e.into()),
        _ => {
            return Err(ApiError::internal(
                "the service failed while starting the command",
            ))
        }
    };
    let start = line(json!({
        "type": "start",
        "sandbox": outcome.sandbox.id,
        "resumed": outcome.resumed,
        "resume_ms": outcome.resume_ms,
    }));
    let body = Body::from_stream(Chain {
        first: Some(start),
        rest: Lines {
            rx,
            ended: false,
            cancel: Some(guard),
        },
    });
    let mut response = (StatusCode::OK, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    Ok(response)
}

/// The `start` line, then the rest.
struct Chain {
    first: Option<Bytes>,
    rest: Lines,
}

impl futures_core::Stream for Chain {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(first)));
        }
        Pin::new(&mut self.rest).poll_next(cx)
    }
}

/// `?path=` (absolute), and for writes `mode=` (octal, e.g. `644`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileQuery {
    pub path: String,
    #[serde(default)]
    pub mode: Option<String>,
}

fn file_query(
    q: Result<Query<FileQuery>, QueryRejection>,
    allow_mode: bool,
) -> Result<(String, Option<u32>), ApiError> {
    let Query(q) = q.map_err(|e| ApiError::invalid(e.body_text()))?;
    if !q.path.starts_with('/') {
        return Err(ApiError::invalid(format!(
            "path must be absolute, got {:?}",
            q.path
        )));
    }
    let mode = match q.mode {
        None => None,
        Some(_) if !allow_mode => return Err(ApiError::invalid("mode is only for writes")),
        Some(m) => Some(
            // 1 to 4 octal digits (the OpenAPI document's pattern).
            Some(&m)
                .filter(|m| {
                    (1..=4).contains(&m.len()) && m.bytes().all(|b| (b'0'..=b'7').contains(&b))
                })
                .and_then(|m| u32::from_str_radix(m, 8).ok())
                .ok_or_else(|| ApiError::invalid(format!("mode {m:?} is not octal 0..7777")))?,
        ),
    };
    Ok((q.path, mode))
}

fn resume_headers(response: &mut Response, outcome: &Outcome) {
    let headers = response.headers_mut();
    headers.insert(
        "x-torpor-resumed",
        HeaderValue::from_static(if outcome.resumed { "true" } else { "false" }),
    );
    if let Some(ms) = outcome.resume_ms {
        if let Ok(v) = HeaderValue::from_str(&format!("{ms:.3}")) {
            headers.insert("x-torpor-resume-ms", v);
        }
    }
}

/// `GET .../files?path=`: the file's bytes.
pub async fn read_file<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    query: Result<Query<FileQuery>, QueryRejection>,
) -> ApiResult<Response> {
    let (path, _) = file_query(query, false)?;
    let id = SandboxId::new(id);
    let got = call(&st, move |s| async move {
        let s = &*s;
        s.read_file(&id, &path).await
    })
    .await?;
    let mut response = (StatusCode::OK, got.value).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    resume_headers(&mut response, &got.outcome);
    Ok(response)
}

/// `PUT .../files` answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = FileWritten)]
pub struct WrittenAnswer {
    pub path: String,
    pub size: u64,
    pub resumed: bool,
    pub resume_ms: Option<f64>,
}

/// `PUT .../files?path=[&mode=]`: the raw body becomes the file (parents
/// created).
pub async fn write_file<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    query: Result<Query<FileQuery>, QueryRejection>,
    body: Bytes,
) -> ApiResult<Json<WrittenAnswer>> {
    let (path, mode) = file_query(query, true)?;
    let id = SandboxId::new(id);
    let answer_path = path.clone();
    let done = call(&st, move |s| async move {
        let s = &*s;
        s.write_file(&id, &path, &body, mode).await
    })
    .await?;
    Ok(Json(WrittenAnswer {
        path: answer_path,
        size: done.value,
        resumed: done.outcome.resumed,
        resume_ms: done.outcome.resume_ms,
    }))
}

/// `GET .../files/list` answer.
#[derive(Debug, Serialize)]
pub struct ListAnswer {
    pub path: String,
    #[serde(flatten)]
    pub listing: DirListing,
    pub resumed: bool,
    pub resume_ms: Option<f64>,
}

/// `GET .../files/list?path=`: entries sorted by name.
pub async fn list_files<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    query: Result<Query<FileQuery>, QueryRejection>,
) -> ApiResult<Json<ListAnswer>> {
    let (path, _) = file_query(query, false)?;
    let id = SandboxId::new(id);
    let answer_path = path.clone();
    let got = call(&st, move |s| async move {
        let s = &*s;
        s.list_dir(&id, &path).await
    })
    .await?;
    Ok(Json(ListAnswer {
        path: answer_path,
        listing: got.value,
        resumed: got.outcome.resumed,
        resume_ms: got.outcome.resume_ms,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: serde_json::Value) -> Result<ExecBody, serde_json::Error> {
        serde_json::from_value(v)
    }

    #[test]
    fn exec_bodies_are_checked() {
        let ok = body(json!({"argv": ["cat"], "stdin_base64": "aGkA", "timeout_ms": 0}))
            .unwrap()
            .into_request(DEFAULT_MAX_OUTPUT)
            .unwrap();
        assert_eq!(ok.stdin.as_deref(), Some(&b"hi\0"[..]));
        assert_eq!(ok.timeout_ms, None);
        assert_eq!(ok.max_output_bytes, Some(DEFAULT_MAX_OUTPUT));
        let text = body(json!({"argv": ["cat"], "stdin": "héllo"})).unwrap();
        assert_eq!(
            text.into_request(1).unwrap().stdin.unwrap(),
            "héllo".as_bytes()
        );
        for bad in [
            json!({"argv": []}),
            json!({"argv": [""]}),
            json!({"argv": ["cat"], "stdin_base64": "not base64!"}),
            json!({"argv": ["cat"], "stdin": "a", "stdin_base64": "YQ=="}),
            json!({"argv": ["cat"], "max_output_bytes": MAX_OUTPUT_LIMIT + 1}),
        ] {
            let err = body(bad.clone())
                .unwrap()
                .into_request(DEFAULT_MAX_OUTPUT)
                .unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{bad}");
        }
        assert!(body(json!({"cmd": ["true"]})).is_err(), "unknown field");
    }

    #[test]
    fn output_that_is_not_utf8_is_base64() {
        let outcome = Outcome {
            sandbox: torpor_scheduler::model::Sandbox::new(
                torpor_scheduler::model::TemplateId::new("tpl_x"),
                64,
                1,
                0,
            ),
            resumed: true,
            resume_ms: Some(1.5),
        };
        let exit = ExitReply {
            code: Some(0),
            signal: None,
            timed_out: false,
            truncated: false,
            duration_us: 2500,
            stdout_bytes: 2,
            stderr_bytes: 0,
        };
        let call = |stdout: &[u8]| GuestCall {
            outcome: outcome.clone(),
            value: ExecOutput {
                stdout: stdout.to_vec(),
                stderr: b"".to_vec(),
                exit: exit.clone(),
            },
        };
        let text = serde_json::to_value(ExecAnswer::from(call(b"hi"))).unwrap();
        assert_eq!(text["encoding"], "utf-8");
        assert_eq!(text["stdout"], "hi");
        assert_eq!(text["exit_code"], 0);
        assert_eq!(text["duration_ms"], 2.5);
        assert_eq!(text["resumed"], true);
        let bin = serde_json::to_value(ExecAnswer::from(call(b"\xff\x00"))).unwrap();
        assert_eq!(bin["encoding"], "base64");
        assert_eq!(bin["stdout"], "/wA=");
    }

    #[test]
    fn file_queries() {
        let q = |s: &str| {
            file_query(
                Query::try_from_uri(&format!("http://x/f?{s}").parse().unwrap()),
                true,
            )
        };
        assert_eq!(
            q("path=/a/b&mode=640").unwrap(),
            ("/a/b".into(), Some(0o640))
        );
        assert_eq!(q("path=%2Ftmp%2Fx").unwrap(), ("/tmp/x".into(), None));
        for bad in ["path=rel", "path=/a&mode=9", "mode=644", "path=/a&x=1"] {
            assert_eq!(q(bad).unwrap_err().status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }
}
