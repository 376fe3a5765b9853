//! A request body read by blocking code (an image's upload, a build's
//! files): its frames moved one at a time to a `Read` that blocks, so
//! nothing holds the whole body in memory.

use std::future::Future;
use std::io::Read;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use tokio::sync::mpsc;

use crate::backend::SandboxApi;
use crate::handlers::{call, ApiResult, AppState};
use crate::service::ServiceError;

/// What of a refused request's body is still read, and for how long, so
/// that its client, still sending, reads the refusal: a body left unread
/// has the connection closed under the client's write, which then fails
/// with a broken pipe rather than the answer (E2B's Python SDK writing
/// past a volume's size saw that about one run in ten).
const DRAIN_LIMIT: u64 = 256 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// The backend call `f` makes with `body` as a blocking [`BodyReader`]
/// (read it only where blocking is allowed: [`crate::backend::blocking`]).
/// What `f` left unread of the body (a refusal midway) is read and
/// dropped before the answer (at most [`DRAIN_LIMIT`] bytes for
/// [`DRAIN_TIME`]).
pub async fn with_body<S, T, F, Fut>(st: &AppState<S>, body: Body, f: F) -> ApiResult<T>
where
    S: SandboxApi,
    T: Send + 'static,
    F: FnOnce(Arc<S>, BodyReader) -> Fut,
    Fut: Future<Output = Result<T, ServiceError>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Result<Bytes, String>>(4);
    let mut pump = tokio::spawn(pump(body, tx));
    let reader = BodyReader {
        rx,
        buf: Bytes::new(),
    };
    let out = call(st, move |s| f(s, reader)).await;
    // The reader is gone with `f`: the pump drains what is left (nothing
    // when `f` read it all; the rest of one it refused midway, whose
    // refusal may be an `Ok` of its own error type).
    let _ = tokio::time::timeout(DRAIN_TIME, &mut pump).await;
    pump.abort();
    out
}

/// Moves the body's frames to the blocking reader, one at a time; once
/// the reader is gone, drops the rest (at most [`DRAIN_LIMIT`] bytes).
async fn pump(body: Body, tx: mpsc::Sender<Result<Bytes, String>>) {
    let mut stream = body.into_data_stream();
    loop {
        let item = match next_frame(&mut stream).await {
            None => return,
            Some(Ok(b)) => Ok(b),
            Some(Err(e)) => Err(e.to_string()),
        };
        let failed = item.is_err();
        if failed {
            let _ = tx.send(item).await;
            return;
        }
        if tx.send(item).await.is_err() {
            break;
        }
    }
    let mut dropped = 0u64;
    while dropped < DRAIN_LIMIT {
        match next_frame(&mut stream).await {
            Some(Ok(b)) => dropped += b.len() as u64,
            None | Some(Err(_)) => return,
        }
    }
}

/// The body's next frame.
async fn next_frame(stream: &mut axum::body::BodyDataStream) -> Option<Result<Bytes, axum::Error>> {
    std::future::poll_fn(|cx| futures_core::Stream::poll_next(Pin::new(&mut *stream), cx)).await
}

/// The request body as a blocking `Read` (in
/// [`crate::backend::blocking`] or on a blocking thread).
#[derive(Debug)]
pub struct BodyReader {
    rx: mpsc::Receiver<Result<Bytes, String>>,
    buf: Bytes,
}

impl Read for BodyReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.buf.is_empty() {
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(Ok(b)) => self.buf = b,
                Some(Err(e)) => return Err(std::io::Error::other(e)),
            }
        }
        let n = out.len().min(self.buf.len());
        out[..n].copy_from_slice(&self.buf[..n]);
        self.buf = self.buf.slice(n..);
        Ok(n)
    }
}
