//! envd's one client-streaming method, `process.Process/StreamInput`
//! (`commands.stream_input`, `pty.stream_input` in the Python SDK): the
//! client sends envelopes for as long as it likes — `start{process}` first,
//! then `data{input{stdin|pty}}` and `keepalive{}` in any number — and the
//! answer comes once its body ends: the empty response message and the
//! end-of-stream envelope, or the end-of-stream envelope with the error.
//!
//! Input is written to the process as each envelope arrives, in order,
//! through one agent connection (not buffered until the body ends: the
//! SDKs' input handles keep a stream open for a whole session). The body
//! is read on the runtime and handed over a bounded channel to the
//! blocking thread that talks to the agent, so a client sending faster
//! than the guest takes input is slowed down by TCP, never buffered here.
//! `Connect-Timeout-Ms` bounds the whole call.

use axum::body::{Body, Bytes};
use axum::http::header::{self, HeaderValue};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use tokio::sync::{mpsc, oneshot};

use super::envelope::{self, ConnectError, Decoder, Envelope};
use super::rpc::{invalid, CallContext, Runner, MAX_MESSAGE};
use super::{process, Code, CONNECT_STREAM_JSON};

/// Request messages buffered between the body's reader and the agent.
const INPUT_BUFFER: usize = 16;

/// The request's messages as the blocking side sees them.
#[derive(Debug)]
pub struct Messages(mpsc::Receiver<Result<Vec<u8>, ConnectError>>);

impl Messages {
    /// The next message; `None` once the client's body ended.
    pub fn recv(&mut self) -> Option<Result<Vec<u8>, ConnectError>> {
        self.0.blocking_recv()
    }
}

/// Serves one client-streaming call: `body` is read envelope by envelope.
pub async fn serve(
    runner: Runner,
    ctx: CallContext,
    body: Body,
    slot: torpor_gate::streams::StreamSlot,
) -> Response {
    let (tx, rx) = mpsc::channel(INPUT_BUFFER);
    let reader = tokio::spawn(read_body(body, ctx.deadline, tx));
    let (done_tx, done_rx) = oneshot::channel();
    torpor_gate::streams::run_long(slot, "envd-input", move || {
        let mut messages = Messages(rx);
        let mut result = None;
        let ran = runner(&mut |link| {
            result = Some(process::stream_input(link, &ctx, &mut messages));
            Ok(())
        });
        let _ = done_tx.send(ran.and_then(|()| result.unwrap_or(Ok(()))));
    });
    let outcome = done_rx.await.unwrap_or_else(|_| {
        Err(ConnectError {
            code: Code::Internal,
            message: "the input stream's worker ended without an answer".into(),
        })
    });
    // The worker is done: input the client still sends goes nowhere.
    reader.abort();
    let mut bytes = Vec::new();
    if outcome.is_ok() {
        bytes.extend(Envelope::message(b"{}".to_vec()).encode());
    }
    bytes.extend(envelope::end_stream(outcome.as_ref().err()).encode());
    let mut r = (StatusCode::OK, Bytes::from(bytes)).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(CONNECT_STREAM_JSON),
    );
    r
}

/// Reads `body`'s envelopes into `tx` until it ends, is malformed, or the
/// deadline passes (then the last item is the error).
async fn read_body(
    mut body: Body,
    deadline: Option<std::time::Instant>,
    tx: mpsc::Sender<Result<Vec<u8>, ConnectError>>,
) {
    let mut decoder = Decoder::new(MAX_MESSAGE);
    loop {
        let frame = match deadline {
            Some(d) => match tokio::time::timeout_at(d.into(), body.frame()).await {
                Ok(frame) => frame,
                Err(_) => {
                    let _ = tx
                        .send(Err(ConnectError {
                            code: Code::DeadlineExceeded,
                            message: "Connect-Timeout-Ms passed while the input streamed".into(),
                        }))
                        .await;
                    return;
                }
            },
            None => body.frame().await,
        };
        let data = match frame {
            None => {
                if let Err(e) = decoder.finish() {
                    let _ = tx
                        .send(Err(invalid(format!("malformed envelope: {e}"))))
                        .await;
                }
                return;
            }
            Some(Err(e)) => {
                let _ = tx
                    .send(Err(ConnectError {
                        code: Code::Canceled,
                        message: format!("the request body broke off: {e}"),
                    }))
                    .await;
                return;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                // Trailers: nothing to read.
                Err(_) => continue,
            },
        };
        decoder.push(&data);
        loop {
            match decoder.next_envelope() {
                Ok(None) => break,
                Ok(Some(e)) if e.is_end_stream() => continue,
                Ok(Some(e)) => {
                    if tx.send(Ok(e.payload)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = tx
                        .send(Err(invalid(format!("malformed envelope: {e}"))))
                        .await;
                    return;
                }
            }
        }
    }
}
