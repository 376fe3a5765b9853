//! The Connect side of envd's RPCs: the request's framing (a bare JSON
//! body for unary calls, one enveloped message for server-streaming ones),
//! the method table, errors in Connect's shape, and the streaming answer
//! (envelopes as the agent produces them, then the end-of-stream one).
//!
//! The agent work runs on a blocking thread through a [`Runner`], which
//! production builds from the service (it wakes a hibernated sandbox
//! first) and tests build from an [`AgentLink`] of their own.
//!
//! Bounds: a request message of at most [`MAX_MESSAGE`] bytes; at most
//! [`MAX_STREAMS_PER_SANDBOX`] streams at once per sandbox; every stream
//! ends when the client goes (seen at the next output or keepalive), at
//! `Connect-Timeout-Ms`, or when the guest stops answering.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::mpsc;
use torpor_scheduler::service::guest::AgentLink;
use torpor_scheduler::service::GuestError;
use torpor_sync::Locked;

use super::envelope::{self, ConnectError, Envelope};
use super::{connect_error, Code, CONNECT_STREAM_JSON};

/// Largest request message (unary body or streamed envelope).
pub const MAX_MESSAGE: usize = 8 << 20;
/// Streams open at once per sandbox.
pub const MAX_STREAMS_PER_SANDBOX: usize = 64;
/// Keepalive interval when the client names none (`Keepalive-Ping-Interval`).
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(30);
/// Envelopes buffered between the guest thread and the HTTP body.
const STREAM_BUFFER: usize = 32;

/// Runs agent work for one call: wakes the sandbox if need be and hands
/// `f` its agent. Errors are already Connect's.
pub type Runner = Arc<
    dyn Fn(
            &mut (dyn FnMut(&AgentLink) -> Result<(), GuestError> + Send),
        ) -> Result<(), ConnectError>
        + Send
        + Sync,
>;

/// What a call knows besides its message.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// The sandbox (for stream accounting and messages).
    pub sandbox: String,
    /// The user named by `Authorization: Basic base64(user:)`, if any.
    pub user: Option<String>,
    /// The sandbox's environment variables (under the request's own).
    pub env: BTreeMap<String, String>,
    /// Where a process starts when the request names no directory (a
    /// built template's last WORKDIR); none: the user's home.
    pub workdir: Option<String>,
    /// Who a process runs as when the request names nobody (a built
    /// template's last USER); none: `user`.
    pub default_user: Option<String>,
    /// Keepalive interval of streams.
    pub keepalive: Duration,
    /// `Connect-Timeout-Ms` from now.
    pub deadline: Option<Instant>,
    /// Whether the sandbox is gone (deleted, killed), asked when a stream's
    /// agent connection breaks.
    pub gone: Gone,
}

/// Asks whether a call's sandbox is gone ([`CallContext::gone`]).
#[derive(Clone, Default)]
pub struct Gone(Option<Arc<dyn Fn() -> bool + Send + Sync>>);

impl Gone {
    pub fn new(check: impl Fn() -> bool + Send + Sync + 'static) -> Gone {
        Gone(Some(Arc::new(check)))
    }

    /// True when the sandbox is known to be gone.
    pub fn check(&self) -> bool {
        self.0.as_ref().is_some_and(|f| f())
    }
}

impl std::fmt::Debug for Gone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gone")
    }
}

impl CallContext {
    /// The context a request's headers give.
    pub fn from_headers(
        sandbox: String,
        headers: &HeaderMap,
        env: BTreeMap<String, String>,
    ) -> Result<Self, ConnectError> {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let user = match text("authorization") {
            None => None,
            Some(v) => Some(basic_user(v).ok_or_else(|| {
                invalid("Authorization must be `Basic base64(user:)`".to_string())
            })?),
        }
        .filter(|u| !u.is_empty());
        let keepalive = text("keepalive-ping-interval")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&s| s > 0)
            .map(|s| Duration::from_secs(s.min(3600)))
            .unwrap_or(DEFAULT_KEEPALIVE);
        let deadline = match text("connect-timeout-ms") {
            None => None,
            Some(v) => {
                let ms: u64 = v
                    .trim()
                    .parse()
                    .ok()
                    .filter(|_| v.len() <= 10)
                    .ok_or_else(|| invalid(format!("bad Connect-Timeout-Ms {v:?}")))?;
                Some(Instant::now() + Duration::from_millis(ms))
            }
        };
        Ok(CallContext {
            sandbox,
            user,
            env,
            workdir: None,
            default_user: None,
            keepalive,
            deadline,
            gone: Gone::default(),
        })
    }

    /// Whether the call's deadline has passed.
    pub fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }
}

/// The user of `Basic base64(user:password)` (envd ignores the password).
fn basic_user(value: &str) -> Option<String> {
    let b = value.strip_prefix("Basic ")?.trim();
    let text = String::from_utf8(torpor_agent::b64::decode(b).ok()?).ok()?;
    let user = text.split(':').next()?.to_string();
    (user.len() <= 256 && !user.contains('\0')).then_some(user)
}

pub fn invalid(message: String) -> ConnectError {
    ConnectError {
        code: Code::InvalidArgument,
        message,
    }
}

/// Whether the agent refused because the guest has no such user (then a
/// request that named none falls back to the agent's own user).
pub fn unknown_user(e: &torpor_agent::proto::ErrorReply) -> bool {
    e.code == "ENOENT" && e.message.starts_with("no user ")
}

/// The Connect code of an agent errno name.
fn code_of_errno(code: &str) -> Code {
    match code {
        "ENOENT" | "ESRCH" => Code::NotFound,
        "EEXIST" | "ENOTEMPTY" => Code::AlreadyExists,
        "EINVAL" | "ENOTDIR" | "EISDIR" | "ENAMETOOLONG" | "ELOOP" | "EXDEV" | "EBUSY" => {
            Code::InvalidArgument
        }
        "EACCES" | "EPERM" | "EROFS" => Code::PermissionDenied,
        "EAGAIN" | "ENOSPC" | "EMFILE" | "ENFILE" | "EDQUOT" | "EMSGSIZE" => {
            Code::ResourceExhausted
        }
        // EREMOTE: a watch of a network filesystem without
        // `allowNetworkMounts` (envd's FailedPrecondition).
        "EPIPE" | "EREMOTE" => Code::FailedPrecondition,
        "ENOSYS" => Code::Unimplemented,
        _ => Code::Unknown,
    }
}

/// A guest failure as Connect's error.
pub fn guest_error(e: GuestError) -> ConnectError {
    let code = match &e {
        GuestError::Agent { error, .. } => code_of_errno(&error.code),
        GuestError::NoAgent { .. } => Code::FailedPrecondition,
        GuestError::Unreachable { .. } | GuestError::ResumeHook { .. } => Code::Unavailable,
        GuestError::Deadline { .. } => Code::DeadlineExceeded,
        GuestError::TooLarge { .. } => Code::ResourceExhausted,
        GuestError::Misbehaved { .. } => Code::Internal,
    };
    ConnectError {
        code,
        message: e.to_string(),
    }
}

/// What a method answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Unary,
    ServerStream,
    /// The client streams, the answer is one message
    /// ([`super::client_stream`]).
    ClientStream,
}

/// Every envd method served, with its kind. The one list: the router
/// dispatches on it and `tests/attack_matrix.rs` attacks each.
pub const METHODS: &[(&str, &str, Kind)] = &[
    ("process.Process", "Start", Kind::ServerStream),
    ("process.Process", "Connect", Kind::ServerStream),
    ("process.Process", "List", Kind::Unary),
    ("process.Process", "SendSignal", Kind::Unary),
    ("process.Process", "SendInput", Kind::Unary),
    ("process.Process", "CloseStdin", Kind::Unary),
    ("process.Process", "Update", Kind::Unary),
    ("process.Process", "StreamInput", Kind::ClientStream),
    ("filesystem.Filesystem", "WatchDir", Kind::ServerStream),
    ("filesystem.Filesystem", "Stat", Kind::Unary),
    ("filesystem.Filesystem", "ListDir", Kind::Unary),
    ("filesystem.Filesystem", "MakeDir", Kind::Unary),
    ("filesystem.Filesystem", "Remove", Kind::Unary),
    ("filesystem.Filesystem", "Move", Kind::Unary),
    ("filesystem.Filesystem", "CreateWatcher", Kind::Unary),
    ("filesystem.Filesystem", "GetWatcherEvents", Kind::Unary),
    ("filesystem.Filesystem", "RemoveWatcher", Kind::Unary),
];

/// The kind of envd's method `service`/`method`, if it is one
/// ([`METHODS`]).
pub fn method_kind(service: &str, method: &str) -> Option<Kind> {
    METHODS
        .iter()
        .find(|(s, m, _)| *s == service && *m == method)
        .map(|&(_, _, kind)| kind)
}

/// Parses a request message.
pub fn parse<T: DeserializeOwned>(message: &[u8]) -> Result<T, ConnectError> {
    let message = if message.is_empty() { b"{}" } else { message };
    serde_json::from_slice(message).map_err(|e| invalid(format!("bad request message: {e}")))
}

/// Sends a streamed call's messages; `false` once the client is gone (the
/// work then stops).
#[derive(Debug)]
pub struct StreamTx {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
}

impl StreamTx {
    /// Sends one message; `false` when the client went away.
    pub fn send<T: Serialize>(&self, message: &T) -> bool {
        let Ok(payload) = serde_json::to_vec(message) else {
            return false;
        };
        self.tx
            .blocking_send(Ok(Bytes::from(Envelope::message(payload).encode())))
            .is_ok()
    }

    /// Whether the client went away.
    pub fn closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// A unary method's work: the response message, as JSON.
pub type UnaryFn = fn(&AgentLink, &CallContext, &[u8]) -> Result<serde_json::Value, ConnectError>;
/// A streaming method's work: messages go to the [`StreamTx`].
pub type StreamFn = fn(&AgentLink, &CallContext, &[u8], &StreamTx) -> Result<(), ConnectError>;

/// Where a method's work is.
#[derive(Debug)]
pub enum Handler {
    Unary(UnaryFn),
    Stream(StreamFn),
}

fn handler(service: &str, method: &str) -> Option<Handler> {
    use super::{filesystem as fs, process as p};
    let h = match (service, method) {
        ("process.Process", "Start") => Handler::Stream(p::start),
        ("process.Process", "Connect") => Handler::Stream(p::connect_stream),
        ("process.Process", "List") => Handler::Unary(p::list),
        ("process.Process", "SendSignal") => Handler::Unary(p::send_signal),
        ("process.Process", "SendInput") => Handler::Unary(p::send_input),
        ("process.Process", "CloseStdin") => Handler::Unary(p::close_stdin),
        ("process.Process", "Update") => Handler::Unary(p::update),
        ("filesystem.Filesystem", "Stat") => Handler::Unary(fs::stat),
        ("filesystem.Filesystem", "ListDir") => Handler::Unary(fs::list_dir),
        ("filesystem.Filesystem", "MakeDir") => Handler::Unary(fs::make_dir),
        ("filesystem.Filesystem", "Remove") => Handler::Unary(fs::remove),
        ("filesystem.Filesystem", "Move") => Handler::Unary(fs::rename),
        ("filesystem.Filesystem", "CreateWatcher") => Handler::Unary(fs::create_watcher),
        ("filesystem.Filesystem", "GetWatcherEvents") => Handler::Unary(fs::watcher_events),
        ("filesystem.Filesystem", "RemoveWatcher") => Handler::Unary(fs::remove_watcher),
        ("filesystem.Filesystem", "WatchDir") => Handler::Stream(fs::watch_dir),
        _ => return None,
    };
    Some(h)
}

/// Streams open per sandbox.
static STREAMS: Mutex<Option<HashMap<String, usize>>> = Mutex::new(None);

struct StreamSlot(String);

impl StreamSlot {
    fn take(sandbox: &str) -> Option<StreamSlot> {
        let mut map = STREAMS.locked();
        let n = map
            .get_or_insert_with(HashMap::new)
            .entry(sandbox.to_string())
            .or_insert(0);
        if *n >= MAX_STREAMS_PER_SANDBOX {
            return None;
        }
        *n += 1;
        Some(StreamSlot(sandbox.to_string()))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut map = STREAMS.locked();
        if let Some(map) = map.as_mut() {
            if let Some(n) = map.get_mut(&self.0) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&self.0);
                }
            }
        }
    }
}

/// Whether the request is a Connect streaming call (enveloped).
pub fn is_streaming(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with(CONNECT_STREAM_JSON))
}

fn is_unary_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"))
}

/// Serves one call of `service/method`: `body` is the raw request body.
pub async fn handle(
    runner: Runner,
    ctx: CallContext,
    service: &str,
    method: &str,
    headers: &HeaderMap,
    body: Body,
    slot: Option<torpor_gate::streams::StreamSlot>,
) -> Response {
    let streaming = is_streaming(headers);
    let fail =
        |code: Code, message: String| connect_error(streaming, ConnectError { code, message });
    let Some(kind) = method_kind(service, method) else {
        return fail(
            Code::Unimplemented,
            format!("{service}/{method} is not an envd method offered here"),
        );
    };
    if !streaming && !is_unary_json(headers) {
        let mut r = fail(
            Code::InvalidArgument,
            "content type must be application/json (unary) or application/connect+json \
             (streaming); binary protobuf is not offered"
                .into(),
        );
        *r.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return r;
    }
    if (kind != Kind::Unary) != streaming {
        return fail(
            Code::InvalidArgument,
            format!(
                "{service}/{method} is {}: call it with {}",
                match kind {
                    Kind::Unary => "unary",
                    Kind::ServerStream => "server-streaming",
                    Kind::ClientStream => "client-streaming",
                },
                if streaming {
                    "application/json"
                } else {
                    CONNECT_STREAM_JSON
                }
            ),
        );
    }
    if headers
        .get("connect-content-encoding")
        .or_else(|| headers.get(header::CONTENT_ENCODING))
        .is_some_and(|v| v.as_bytes() != b"identity")
    {
        return fail(
            Code::Unimplemented,
            "compressed requests are not offered".into(),
        );
    }
    if kind == Kind::ClientStream {
        return match slot {
            Some(slot) => super::client_stream::serve(runner, ctx, body, slot).await,
            None => fail(Code::Internal, "a stream without its slot".into()),
        };
    }
    let limit = MAX_MESSAGE + envelope::HEADER_LEN;
    let bytes = match axum::body::to_bytes(body, limit).await {
        Ok(b) => b,
        Err(_) => {
            return fail(
                Code::ResourceExhausted,
                format!("request over {MAX_MESSAGE} bytes, or unreadable"),
            )
        }
    };
    let message = if streaming {
        match envelope::decode_all(&bytes, MAX_MESSAGE) {
            Ok(envs) => {
                let mut msgs = envs.into_iter().filter(|e| !e.is_end_stream());
                match (msgs.next(), msgs.next()) {
                    (Some(m), None) => m.payload,
                    (None, _) => return fail(Code::InvalidArgument, "no request message".into()),
                    (Some(_), Some(_)) => {
                        return fail(
                            Code::InvalidArgument,
                            "a server-streaming call takes one request message".into(),
                        )
                    }
                }
            }
            Err(e) => return fail(Code::InvalidArgument, format!("malformed envelope: {e}")),
        }
    } else {
        bytes.to_vec()
    };
    match handler(service, method) {
        Some(Handler::Unary(f)) => unary(runner, ctx, f, message).await,
        Some(Handler::Stream(f)) => match slot {
            Some(slot) => stream(runner, ctx, f, message, slot),
            None => fail(Code::Internal, "a stream without its slot".into()),
        },
        None => fail(Code::Unimplemented, format!("{service}/{method}")),
    }
}

async fn unary(runner: Runner, ctx: CallContext, f: UnaryFn, message: Vec<u8>) -> Response {
    let work = tokio::task::spawn_blocking(move || {
        let mut out = None;
        let ran = runner(&mut |link| {
            out = Some(f(link, &ctx, &message));
            Ok(())
        });
        ran.and_then(|()| {
            out.unwrap_or_else(|| {
                Err(ConnectError {
                    code: Code::Internal,
                    message: "the call did not run".into(),
                })
            })
        })
    })
    .await;
    match work {
        Ok(Ok(value)) => (StatusCode::OK, axum::Json(value)).into_response(),
        Ok(Err(e)) => connect_error(false, e),
        Err(_) => connect_error(
            false,
            ConnectError {
                code: Code::Internal,
                message: "the call failed".into(),
            },
        ),
    }
}

fn stream(
    runner: Runner,
    ctx: CallContext,
    f: StreamFn,
    message: Vec<u8>,
    slot: torpor_gate::streams::StreamSlot,
) -> Response {
    let Some(sandbox_slot) = StreamSlot::take(&ctx.sandbox) else {
        return connect_error(
            true,
            ConnectError {
                code: Code::ResourceExhausted,
                message: format!(
                    "{MAX_STREAMS_PER_SANDBOX} streams already open on sandbox {}",
                    ctx.sandbox
                ),
            },
        );
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(STREAM_BUFFER);
    let ctx_gone = ctx.gone.clone();
    torpor_gate::streams::run_long(slot, "envd", move || {
        let _slot = sandbox_slot;
        let out = StreamTx { tx };
        let mut result = None;
        let ran = runner(&mut |link| {
            result = Some(f(link, &ctx, &message, &out));
            Ok(())
        });
        let error = ran.and_then(|()| result.unwrap_or(Ok(()))).err();
        // A sandbox killed mid-stream: its agent connection broke. E2B's
        // proxy then drops the client's connection (its upstream is gone),
        // which the SDKs take for a transport failure, probe `/health`, and
        // report as the sandbox killed; an end-of-stream `unavailable`
        // reads as a timeout to the JS SDK. So the answer is cut off.
        let gone = error
            .as_ref()
            .is_some_and(|e| e.code == Code::Unavailable && ctx_gone.check());
        let last = if gone {
            Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the sandbox is gone",
            ))
        } else {
            Ok(Bytes::from(envelope::end_stream(error.as_ref()).encode()))
        };
        let _ = out.tx.blocking_send(last);
    });
    let mut r = (StatusCode::OK, Body::from_stream(Envelopes(rx))).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(CONNECT_STREAM_JSON),
    );
    r
}

/// The streamed answer's bytes; an error cuts the answer off.
struct Envelopes(mpsc::Receiver<Result<Bytes, std::io::Error>>);

impl futures_core::Stream for Envelopes {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_auth_names_the_user() {
        assert_eq!(basic_user("Basic dXNlcjo=").as_deref(), Some("user"));
        assert_eq!(basic_user("Basic cm9vdDpwdw==").as_deref(), Some("root"));
        assert_eq!(basic_user("Bearer x"), None);
        assert_eq!(basic_user("Basic !!"), None);
    }

    #[test]
    fn every_offered_method_has_a_handler() {
        for (service, methods) in [
            (
                "process.Process",
                &[
                    "Start",
                    "Connect",
                    "List",
                    "SendSignal",
                    "SendInput",
                    "CloseStdin",
                    "Update",
                ][..],
            ),
            (
                "filesystem.Filesystem",
                &[
                    "Stat",
                    "ListDir",
                    "MakeDir",
                    "Remove",
                    "Move",
                    "CreateWatcher",
                    "GetWatcherEvents",
                    "RemoveWatcher",
                    "WatchDir",
                ][..],
            ),
        ] {
            for m in methods {
                assert!(method_kind(service, m).is_some(), "{service}/{m}");
                assert!(handler(service, m).is_some(), "{service}/{m}");
            }
        }
        assert_eq!(
            method_kind("process.Process", "StreamInput"),
            Some(Kind::ClientStream)
        );
        assert!(method_kind("filesystem.Filesystem", "Start").is_none());
        assert_eq!(code_of_errno("ENOENT"), Code::NotFound);
        assert_eq!(code_of_errno("EEXIST"), Code::AlreadyExists);
    }
}
