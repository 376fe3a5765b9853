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

/// The backend call `f` makes with `body` as a blocking [`BodyReader`]
/// (read it only where blocking is allowed: [`crate::backend::blocking`]).
pub async fn with_body<S, T, F, Fut>(st: &AppState<S>, body: Body, f: F) -> ApiResult<T>
where
    S: SandboxApi,
    T: Send + 'static,
    F: FnOnce(Arc<S>, BodyReader) -> Fut,
    Fut: Future<Output = Result<T, ServiceError>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Result<Bytes, String>>(4);
    let pump = tokio::spawn(pump(body, tx));
    let reader = BodyReader {
        rx,
        buf: Bytes::new(),
    };
    let out = call(st, move |s| f(s, reader)).await;
    pump.abort();
    out
}

/// Moves the body's frames to the blocking reader, one at a time.
async fn pump(body: Body, tx: mpsc::Sender<Result<Bytes, String>>) {
    let mut stream = body.into_data_stream();
    loop {
        let next =
            std::future::poll_fn(|cx| futures_core::Stream::poll_next(Pin::new(&mut stream), cx))
                .await;
        let item = match next {
            None => return,
            Some(Ok(b)) => Ok(b),
            Some(Err(e)) => Err(e.to_string()),
        };
        let failed = item.is_err();
        if tx.send(item).await.is_err() || failed {
            return;
        }
    }
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
