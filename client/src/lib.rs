//! The blocking HTTP/1.1 client for the REST API (hyper's connection API),
//! over TCP or a unix socket: one request per connection; bounded bodies,
//! streamed or collected; timeouts; TLS (rustls) to a server whose
//! certificate fingerprint is pinned ([`pin`]). Used by the CLI (`torpor
//! sandbox|template|pod`), by `torpor serve` in front of its nested pod and
//! by a cluster's replicas in front of their pods (whose protocol is this
//! API).

pub mod pin;

use std::cell::Cell;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame};
use hyper::client::conn::http1::SendRequest;
use hyper::{header, Request};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

use pin::{pinned_client_config, Fingerprint};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where one exchange's futures run: the caller's runtime when the caller
/// is a blocking thread of a multi-threaded one (a service's request on
/// its blocking pool, a cluster replica's `block_in_place`: no request
/// builds a runtime of its own), else a current-thread runtime made for
/// the exchange (the CLI, a plain thread). A current-thread runtime of
/// the caller's is not used: only its own `block_on` drives its I/O.
enum Exchange {
    Ambient(tokio::runtime::Handle),
    Own(tokio::runtime::Runtime),
}

thread_local! {
    /// Runtimes this thread made for one exchange (see [`Exchange`]), for
    /// the tests.
    static OWN_RUNTIMES: Cell<usize> = const { Cell::new(0) };
}

impl Exchange {
    fn new() -> Result<Self, ClientError> {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
                return Ok(Exchange::Ambient(handle));
            }
        }
        OWN_RUNTIMES.with(|n| n.set(n.get() + 1));
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(Exchange::Own)
            .map_err(|e| ClientError::Transport(format!("cannot start a runtime: {e}")))
    }

    fn block_on<F: Future>(&self, f: F) -> F::Output {
        match self {
            Exchange::Ambient(handle) => handle.block_on(f),
            Exchange::Own(rt) => rt.block_on(f),
        }
    }

    fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match self {
            Exchange::Ambient(handle) => handle.spawn(f),
            Exchange::Own(rt) => rt.spawn(f),
        }
    }
}

/// A response's status and headers (values as text, lossily).
fn head_of(response: &hyper::Response<hyper::body::Incoming>) -> (u16, Vec<(String, String)>) {
    let headers = response
        .headers()
        .iter()
        .map(|(n, v)| {
            let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
            (n.as_str().to_string(), v)
        })
        .collect();
    (response.status().as_u16(), headers)
}

/// Longest wait for a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest response body accepted.
const MAX_BODY: u64 = 64 << 20;

/// Where an API listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `host:port`, a path prefix put before `/v1/...`, and whether the
    /// connection is TLS (`https://`, `tls:`).
    Tcp {
        authority: String,
        prefix: String,
        tls: bool,
    },
    /// A unix socket.
    Unix { path: PathBuf },
}

/// Why an address or a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0}")]
    BadAddress(String),
    /// No connection to the API.
    #[error("cannot connect to {target}: {source}")]
    Connect {
        target: String,
        source: std::io::Error,
    },
    /// The connection broke, timed out or the answer was not HTTP.
    #[error("{0}")]
    Transport(String),
    /// The TLS handshake failed: a certificate other than the pinned one,
    /// or a server that does not speak TLS.
    #[error("TLS to {target}: {message}")]
    Tls { target: String, message: String },
}

impl Endpoint {
    /// `http://host[:port][/prefix]` (the scheme may be left out),
    /// `https://host[:port][/prefix]`, `tcp:host:port` (plain),
    /// `tls:host:port` or `unix:/path`.
    pub fn parse(address: &str) -> Result<Endpoint, ClientError> {
        if let Some(path) = address.strip_prefix("unix:") {
            if !path.starts_with('/') {
                return Err(ClientError::BadAddress(format!(
                    "{address}: a unix socket path must be absolute"
                )));
            }
            return Ok(Endpoint::Unix { path: path.into() });
        }
        let (url, tls) = if let Some(rest) = address.strip_prefix("tls:") {
            (rest, true)
        } else if let Some(rest) = address.strip_prefix("https://") {
            (rest, true)
        } else {
            (address.strip_prefix("tcp:").unwrap_or(address), false)
        };
        let (authority, prefix) = parse_url(url, tls).map_err(ClientError::BadAddress)?;
        Ok(Endpoint::Tcp {
            authority,
            prefix,
            tls,
        })
    }

    /// How the endpoint is written in messages.
    pub fn describe(&self) -> String {
        match self {
            Endpoint::Tcp {
                authority,
                prefix,
                tls,
            } => {
                let scheme = if *tls { "https" } else { "http" };
                format!("{scheme}://{authority}{prefix}")
            }
            Endpoint::Unix { path } => format!("unix:{}", path.display()),
        }
    }
}

/// `[http://]host[:port][/prefix]` to the `host:port` to connect to and the
/// path prefix to put before `/v1/...` (the default port is 443 for TLS).
fn parse_url(url: &str, tls: bool) -> Result<(String, String), String> {
    let rest = if let Some(r) = url.strip_prefix("http://").filter(|_| !tls) {
        r
    } else if url.contains("://") {
        return Err(format!("{url}: not an http:// URL"));
    } else {
        url
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if authority.is_empty() || authority.contains('@') {
        return Err(format!("{url}: expected http://HOST[:PORT][/PREFIX]"));
    }
    let has_port = match authority.rfind(']') {
        Some(close) => authority[close..].contains(':'),
        None => authority.contains(':'),
    };
    let authority = if has_port {
        authority.to_string()
    } else {
        format!("{authority}:{}", if tls { 443 } else { 80 })
    };
    Ok((authority, path.to_string()))
}

/// One answer: status, headers (lower-case names) and body.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// How a response is streamed: `on_head` sees the status and headers once
/// they are read; a 2xx chunked body then goes to `on_chunk` chunk by chunk
/// as it arrives (any other body is collected into the [`Answer`]).
pub struct Streaming<'a> {
    pub on_head: HeadSink<'a>,
    pub on_chunk: ChunkSink<'a>,
}

impl std::fmt::Debug for Streaming<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Both sinks are closures: nothing to print.
        f.debug_struct("Streaming").finish_non_exhaustive()
    }
}

/// Sees a response's status and headers.
pub type HeadSink<'a> = &'a mut dyn FnMut(u16, &[(String, String)]);
/// Sees a response body's chunks.
pub type ChunkSink<'a> = &'a mut dyn FnMut(&[u8]);

/// An endpoint, its bearer token and its I/O timeout.
#[derive(Clone)]
pub struct HttpClient {
    pub endpoint: Endpoint,
    token: Option<String>,
    io_timeout: Duration,
    /// The only certificate a TLS endpoint may present.
    pin: Option<Fingerprint>,
    /// Headers sent with every request, over the client's own.
    extra: Vec<(String, String)>,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "[redacted]"))
            .field("pin", &self.pin)
            .finish()
    }
}

/// A connected stream: TCP, TLS over TCP, or a unix socket.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static> Io for T {}

impl HttpClient {
    /// `token` must not hold control characters (it goes in a header).
    pub fn new(
        endpoint: Endpoint,
        token: Option<String>,
        io_timeout: Duration,
    ) -> Result<Self, ClientError> {
        if token
            .as_ref()
            .is_some_and(|t| t.chars().any(char::is_control))
        {
            return Err(ClientError::BadAddress(
                "the token holds control characters".into(),
            ));
        }
        Ok(HttpClient {
            endpoint,
            token,
            io_timeout,
            pin: None,
            extra: Vec::new(),
        })
    }

    /// Trusts exactly the certificate with this fingerprint on a TLS
    /// endpoint (a TLS endpoint without a pin is refused at connect).
    pub fn pinned(mut self, pin: Option<Fingerprint>) -> Self {
        self.pin = pin;
        self
    }

    /// Sends these headers with every request; each replaces the client's
    /// own header of that name (`Host`, `Accept`, ...).
    pub fn with_headers(mut self, headers: &[(&str, &str)]) -> Self {
        self.extra = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        self
    }

    /// Sends one request (`body`: content type, none when empty, and
    /// bytes; `path` with its query) and reads the answer, whatever its
    /// status. Blocking: the
    /// exchange runs on a runtime of its own, and the sinks of `streaming`
    /// are called outside it (they may block).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
        streaming: Option<Streaming<'_>>,
    ) -> Result<Answer, ClientError> {
        let rt = Exchange::new()?;
        let request = self.build(method, path, body)?;
        let response = rt.block_on(async {
            let mut sender = self.open().await?;
            self.bounded(sender.send_request(request)).await
        })?;
        self.answer(&rt, method, response, streaming)
    }

    /// Sends `body`, read to its end on this thread, as a chunked request
    /// body of `content_type` (an upload of any size: each chunk waits for
    /// the server at most the I/O timeout), and reads the answer. A read
    /// error of `body` ends the request unfinished (the server sees a cut
    /// body) and is returned.
    pub fn upload(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: &mut dyn std::io::Read,
    ) -> Result<Answer, ClientError> {
        type Chunk = Result<Frame<Bytes>, BoxError>;
        let rt = Exchange::new()?;
        let (tx, rx) = tokio::sync::mpsc::channel::<Chunk>(4);
        let chunks = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|chunk| (chunk, rx))
        });
        let mut request = self.head(method, path)?;
        if let Some(headers) = request.headers_mut() {
            let value = header::HeaderValue::from_str(content_type)
                .map_err(|e| ClientError::BadAddress(format!("content type: {e}")))?;
            headers.insert(header::CONTENT_TYPE, value);
        }
        let request = request
            .body(StreamBody::new(chunks))
            .map_err(|e| ClientError::BadAddress(format!("{method} {path}: {e}")))?;
        let client = self.clone();
        let sent = rt.spawn(async move {
            let mut sender = client.open().await?;
            sender
                .send_request(request)
                .await
                .map_err(|e| client.transport(&e))
        });
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = match body.read(&mut buf) {
                Ok(n) => n,
                Err(e) => {
                    let cut: BoxError = format!("the upload's source failed: {e}").into();
                    let _ = rt.block_on(tx.send(Err(cut)));
                    sent.abort();
                    return Err(ClientError::Transport(format!("reading the upload: {e}")));
                }
            };
            if n == 0 {
                break;
            }
            let chunk = Ok(Frame::data(Bytes::copy_from_slice(&buf[..n])));
            // (The timer is made inside the runtime.)
            let send = async { tokio::time::timeout(self.io_timeout, tx.send(chunk)).await };
            match rt.block_on(send) {
                Ok(Ok(())) => {}
                // The request ended (the server answered before the end, or
                // the connection broke): its answer or error says why.
                Ok(Err(_)) => break,
                Err(_) => {
                    sent.abort();
                    return Err(self.timed_out());
                }
            }
        }
        drop(tx);
        let answered = async { tokio::time::timeout(self.io_timeout, sent).await };
        let response = match rt.block_on(answered) {
            Ok(Ok(r)) => r?,
            Ok(Err(e)) => return Err(ClientError::Transport(format!("the upload: {e}"))),
            Err(_) => return Err(self.timed_out()),
        };
        self.answer(&rt, method, response, None)
    }

    /// A connection and its HTTP/1.1 handshake; the connection is driven
    /// by a task on the current runtime.
    async fn open<B>(&self) -> Result<SendRequest<B>, ClientError>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        let stream = self.connect().await?;
        // Title-case names (`Content-Length`), as servers most often see.
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .title_case_headers(true)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|e| self.transport(&e))?;
        tokio::spawn(conn);
        Ok(sender)
    }

    /// One request (as [`HttpClient::request`], without streaming) from
    /// async code, on the caller's runtime: its answer read whole
    /// (bounded), whatever its status.
    pub async fn fetch(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
    ) -> Result<Answer, ClientError> {
        let request = self.build(method, path, body)?;
        let mut sender = self.open().await?;
        let response = self.bounded(sender.send_request(request)).await?;
        let (status, headers) = head_of(&response);
        let mut answer = Answer {
            status,
            headers,
            body: Vec::new(),
        };
        if !self.has_body(method, &response)? {
            return Ok(answer);
        }
        let mut incoming = response.into_body();
        while let Some(frame) = self
            .bounded(async { incoming.frame().await.transpose() })
            .await?
        {
            if let Ok(data) = frame.into_data() {
                if (answer.body.len() + data.len()) as u64 > MAX_BODY {
                    return Err(self.too_large());
                }
                answer.body.extend_from_slice(&data);
            }
        }
        Ok(answer)
    }

    /// Whether `response` to `method` has a body to read; a declared one
    /// over [`MAX_BODY`] is an error.
    fn has_body(
        &self,
        method: &str,
        response: &hyper::Response<hyper::body::Incoming>,
    ) -> Result<bool, ClientError> {
        let status = response.status().as_u16();
        if method == "HEAD" || status == 204 || status == 304 {
            return Ok(false);
        }
        let length = response
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if length.is_some_and(|n| n > MAX_BODY) {
            return Err(self.too_large());
        }
        Ok(true)
    }

    /// The answer to a request: its status, headers and body (bounded;
    /// streamed to `streaming`'s sink when it is chunked and 2xx).
    fn answer(
        &self,
        rt: &Exchange,
        method: &str,
        response: hyper::Response<hyper::body::Incoming>,
        streaming: Option<Streaming<'_>>,
    ) -> Result<Answer, ClientError> {
        let (status, headers) = head_of(&response);
        let answer = |body| Answer {
            status,
            headers: headers.clone(),
            body,
        };
        let chunked = response
            .headers()
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .any(|v| {
                v.to_str()
                    .is_ok_and(|v| v.to_ascii_lowercase().contains("chunked"))
            });
        let mut sink = None;
        if let Some(s) = streaming {
            (s.on_head)(status, &headers);
            if (200..300).contains(&status) && chunked {
                sink = Some(s.on_chunk);
            }
        }
        if !self.has_body(method, &response)? {
            return Ok(answer(Vec::new()));
        }
        let mut incoming = response.into_body();
        let mut collected = Vec::new();
        let mut streamed = 0u64;
        while let Some(frame) =
            rt.block_on(self.bounded(async { incoming.frame().await.transpose() }))?
        {
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            streamed += data.len() as u64;
            if streamed > MAX_BODY {
                return Err(self.too_large());
            }
            match sink.as_mut() {
                Some(sink) => sink(&data),
                None => collected.extend_from_slice(&data),
            }
        }
        Ok(answer(collected))
    }

    /// The request: method, the prefix and path, and the headers.
    fn build(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
    ) -> Result<Request<Full<Bytes>>, ClientError> {
        let mut request = self.head(method, path)?;
        if let Some(headers) = request.headers_mut() {
            match body {
                Some((content_type, b)) => {
                    if !content_type.is_empty() {
                        let value = header::HeaderValue::from_str(content_type)
                            .map_err(|e| ClientError::BadAddress(format!("content type: {e}")))?;
                        headers.insert(header::CONTENT_TYPE, value);
                    }
                    headers.insert(header::CONTENT_LENGTH, b.len().into());
                }
                None if matches!(method, "POST" | "PUT" | "PATCH") => {
                    headers.insert(header::CONTENT_LENGTH, 0.into());
                }
                None => {}
            }
        }
        let bytes = Bytes::copy_from_slice(body.map_or(&[][..], |(_, b)| b));
        request
            .body(Full::new(bytes))
            .map_err(|e| ClientError::BadAddress(format!("{method} {path}: {e}")))
    }

    /// A request's method, the prefix and path, and the headers every
    /// request has (the client's own, then [`HttpClient::with_headers`]').
    fn head(&self, method: &str, path: &str) -> Result<hyper::http::request::Builder, ClientError> {
        let (host, prefix) = match &self.endpoint {
            Endpoint::Tcp {
                authority, prefix, ..
            } => (authority.as_str(), prefix.as_str()),
            Endpoint::Unix { .. } => ("localhost", ""),
        };
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{prefix}{path}"))
            .header(header::HOST, host)
            .header(header::CONNECTION, "close")
            .header(
                header::USER_AGENT,
                concat!("torpor/", env!("CARGO_PKG_VERSION")),
            )
            .header(header::ACCEPT, "application/json");
        if let Some(t) = &self.token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let bad = |e: &dyn std::fmt::Display| {
            ClientError::BadAddress(format!("{method} {prefix}{path}: {e}"))
        };
        for (name, value) in &self.extra {
            let name = header::HeaderName::from_bytes(name.as_bytes()).map_err(|e| bad(&e))?;
            let value = header::HeaderValue::from_str(value).map_err(|e| bad(&e))?;
            if let Some(headers) = request.headers_mut() {
                headers.insert(name, value);
            }
        }
        Ok(request)
    }

    /// `fut`, or a timeout error after the I/O timeout.
    async fn bounded<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, hyper::Error>>,
    ) -> Result<T, ClientError> {
        match tokio::time::timeout(self.io_timeout, fut).await {
            Ok(r) => r.map_err(|e| self.transport(&e)),
            Err(_) => Err(self.timed_out()),
        }
    }

    fn timed_out(&self) -> ClientError {
        ClientError::Transport(format!(
            "the API at {} did not answer within {}s",
            self.endpoint.describe(),
            self.io_timeout.as_secs()
        ))
    }

    fn transport(&self, e: &hyper::Error) -> ClientError {
        let target = self.endpoint.describe();
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(err) = source {
            if let Some(tls) = err.downcast_ref::<rustls::Error>() {
                return ClientError::Tls {
                    target,
                    message: tls.to_string(),
                };
            }
            source = err.source();
        }
        ClientError::Transport(format!("talking to the API at {target}: {e}"))
    }

    fn too_large(&self) -> ClientError {
        ClientError::Transport(format!(
            "talking to the API at {}: the response body is larger than {MAX_BODY} bytes",
            self.endpoint.describe()
        ))
    }

    async fn connect(&self) -> Result<Box<dyn Io>, ClientError> {
        let target = self.endpoint.describe();
        let connect = |source| ClientError::Connect {
            target: target.clone(),
            source,
        };
        match &self.endpoint {
            Endpoint::Unix { path } => {
                let s = within(tokio::net::UnixStream::connect(path))
                    .await
                    .map_err(connect)?;
                Ok(Box::new(s))
            }
            Endpoint::Tcp { authority, tls, .. } => {
                if !tls {
                    return Ok(Box::new(connect_tcp(authority).await.map_err(connect)?));
                }
                let Some(pin) = self.pin else {
                    return Err(ClientError::BadAddress(format!(
                        "{target}: a TLS endpoint needs its certificate's SHA-256 \
                         fingerprint (printed by the server when it starts)"
                    )));
                };
                let tcp = connect_tcp(authority).await.map_err(connect)?;
                let host = authority
                    .rsplit_once(':')
                    .map_or(authority.as_str(), |(h, _)| h)
                    .trim_start_matches('[')
                    .trim_end_matches(']');
                // The pin is the trust; the name only fills the handshake.
                let name = ServerName::try_from(host.to_string())
                    .unwrap_or_else(|_| ServerName::try_from("torpor.invalid").expect("valid"));
                let tls = TlsConnector::from(pinned_client_config(pin));
                match tokio::time::timeout(self.io_timeout, tls.connect(name, tcp)).await {
                    Ok(Ok(s)) => Ok(Box::new(s)),
                    Ok(Err(e)) => Err(
                        match e
                            .get_ref()
                            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                        {
                            Some(tls) => ClientError::Tls {
                                target,
                                message: tls.to_string(),
                            },
                            None => ClientError::Transport(format!("TLS to {target}: {e}")),
                        },
                    ),
                    Err(_) => Err(ClientError::Transport(format!(
                        "the API at {target} did not answer within {}s",
                        self.io_timeout.as_secs()
                    ))),
                }
            }
        }
    }
}

/// A connection attempt, bounded by [`CONNECT_TIMEOUT`].
async fn within<T>(
    fut: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    tokio::time::timeout(CONNECT_TIMEOUT, fut)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

/// The first address of `authority` that accepts a connection.
async fn connect_tcp(authority: &str) -> std::io::Result<tokio::net::TcpStream> {
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
    for addr in within(tokio::net::lookup_host(authority)).await? {
        match within(tokio::net::TcpStream::connect(addr)).await {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Percent-encodes a path segment or query value.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The `code` and `message` of an error body, if it is one.
pub fn error_fields(body: &[u8]) -> Option<(String, String)> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let code = v["error"]["code"].as_str()?.to_string();
    let message = v["error"]["message"].as_str().unwrap_or("").to_string();
    Some((code, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!(
            Endpoint::parse("unix:/run/p.sock").unwrap(),
            Endpoint::Unix {
                path: "/run/p.sock".into()
            }
        );
        assert!(Endpoint::parse("unix:rel.sock").is_err());
        assert_eq!(
            Endpoint::parse("tcp:10.0.0.2:7701").unwrap(),
            Endpoint::Tcp {
                authority: "10.0.0.2:7701".into(),
                prefix: String::new(),
                tls: false
            }
        );
        assert_eq!(
            Endpoint::parse("http://h/api/").unwrap(),
            Endpoint::Tcp {
                authority: "h:80".into(),
                prefix: "/api".into(),
                tls: false
            }
        );
        assert_eq!(
            Endpoint::parse("https://h").unwrap(),
            Endpoint::Tcp {
                authority: "h:443".into(),
                prefix: String::new(),
                tls: true
            }
        );
        assert_eq!(
            Endpoint::parse("tls:10.0.0.2:7701").unwrap().describe(),
            "https://10.0.0.2:7701"
        );
        assert!(Endpoint::parse("ftp://h").is_err());
        assert!(Endpoint::parse("https://http://h").is_err());
    }

    #[test]
    fn chunked_bodies_stream_to_the_sink() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8];
            while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap() == 1 {
                head.push(byte[0]);
            }
            s.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
                .unwrap();
            String::from_utf8(head).unwrap()
        });
        let endpoint = Endpoint::parse(&format!("tcp:{addr}")).unwrap();
        let client = HttpClient::new(endpoint, None, Duration::from_secs(10)).unwrap();
        let (mut heads, mut chunks) = (Vec::new(), Vec::new());
        let answer = client
            .request(
                "POST",
                "/x",
                None,
                Some(Streaming {
                    on_head: &mut |s, h| heads.push((s, h.to_vec())),
                    on_chunk: &mut |c| chunks.extend_from_slice(c),
                }),
            )
            .unwrap();
        assert!(answer.body.is_empty());
        assert_eq!(chunks, b"abcde");
        assert_eq!(heads[0].0, 200);
        assert_eq!(answer.header("x-a"), Some("1"));
        let head = server.join().unwrap();
        assert!(head.starts_with("POST /x HTTP/1.1\r\n"), "{head}");
        assert!(
            head.to_ascii_lowercase().contains("content-length: 0\r\n"),
            "{head}"
        );
    }

    /// A server answering `n` requests with 200 `ok`, each on a connection
    /// of its own.
    fn ok_server(n: usize) -> std::net::SocketAddr {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for _ in 0..n {
                let (mut s, _) = listener.accept().unwrap();
                let mut head = Vec::new();
                let mut byte = [0u8];
                while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap() == 1 {
                    head.push(byte[0]);
                }
                s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .unwrap();
            }
        });
        addr
    }

    #[test]
    fn an_async_fetch_runs_on_the_callers_runtime_and_reads_the_whole_answer() {
        let addr = ok_server(1);
        let endpoint = Endpoint::parse(&format!("tcp:{addr}")).unwrap();
        let client = HttpClient::new(endpoint, None, Duration::from_secs(10)).unwrap();
        // A current-thread runtime: the fetch is driven by its caller's
        // `block_on` alone, and makes no runtime of its own.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let answer = rt.block_on(client.fetch("GET", "/v1/x", None)).unwrap();
        assert_eq!((answer.status, answer.body.as_slice()), (200, &b"ok"[..]));
        assert_eq!(answer.header("content-length"), Some("2"));
        assert_eq!(OWN_RUNTIMES.with(Cell::get), 0);
    }

    #[test]
    fn a_request_on_a_services_blocking_pool_runs_on_its_runtime() {
        let addr = ok_server(2);
        let endpoint = Endpoint::parse(&format!("tcp:{addr}")).unwrap();
        let client = HttpClient::new(endpoint, None, Duration::from_secs(10)).unwrap();
        let service = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let on_pool = client.clone();
        let on_the_pool = service.spawn_blocking(move || {
            let answer = on_pool.request("GET", "/v1/x", None, None).unwrap();
            (answer.body, OWN_RUNTIMES.with(Cell::get))
        });
        let (body, made) = service.block_on(on_the_pool).unwrap();
        assert_eq!((body.as_slice(), made), (&b"ok"[..], 0));
        // Outside any runtime (the CLI), the exchange makes its own.
        let answer = client.request("GET", "/v1/x", None, None).unwrap();
        assert_eq!(answer.body, b"ok");
        assert_eq!(OWN_RUNTIMES.with(Cell::get), 1);
    }

    /// What [`chunked_server`] received: the head, and the body.
    type Received = (String, Option<Vec<u8>>);

    /// A fake server: the request's head, then its chunked body decoded
    /// (`None` if it was cut before the last chunk); answers 201.
    fn chunked_server() -> (std::net::SocketAddr, std::thread::JoinHandle<Received>) {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut head = String::new();
            while !head.ends_with("\r\n\r\n") {
                if r.read_line(&mut head).unwrap() == 0 {
                    return (head, None);
                }
            }
            let mut body = Vec::new();
            loop {
                let mut size = String::new();
                if r.read_line(&mut size).unwrap_or(0) == 0 {
                    return (head, None);
                }
                let n = usize::from_str_radix(size.trim(), 16).unwrap();
                let mut chunk = vec![0u8; n + 2];
                if r.read_exact(&mut chunk).is_err() {
                    return (head, None);
                }
                if n == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..n]);
            }
            let mut s = s;
            s.write_all(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
                .unwrap();
            (head, Some(body))
        });
        (addr, server)
    }

    #[test]
    fn uploads_stream_a_reader_as_a_chunked_body() {
        let (addr, server) = chunked_server();
        let endpoint = Endpoint::parse(&format!("tcp:{addr}")).unwrap();
        let client = HttpClient::new(endpoint, Some("t".into()), Duration::from_secs(10)).unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let answer = client
            .upload(
                "PUT",
                "/v1/images/a/rootfs",
                "application/octet-stream",
                &mut std::io::Cursor::new(data.clone()),
            )
            .unwrap();
        assert_eq!((answer.status, answer.body.as_slice()), (201, &b"ok"[..]));
        let (head, body) = server.join().unwrap();
        let head = head.to_ascii_lowercase();
        assert!(
            head.starts_with("put /v1/images/a/rootfs http/1.1\r\n"),
            "{head}"
        );
        assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
        assert!(
            head.contains("content-type: application/octet-stream\r\n"),
            "{head}"
        );
        assert!(head.contains("authorization: bearer t\r\n"), "{head}");
        assert_eq!(body.unwrap(), data);

        // A source that fails half way: an error here, a cut body there.
        struct Failing(usize);
        impl std::io::Read for Failing {
            fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
                if self.0 == 0 {
                    return Err(std::io::Error::other("disk gone"));
                }
                self.0 -= 1;
                out[..1000].fill(7);
                Ok(1000)
            }
        }
        let (addr, server) = chunked_server();
        let endpoint = Endpoint::parse(&format!("tcp:{addr}")).unwrap();
        let client = HttpClient::new(endpoint, None, Duration::from_secs(10)).unwrap();
        let err = client
            .upload("PUT", "/x", "application/octet-stream", &mut Failing(5))
            .unwrap_err();
        assert!(err.to_string().contains("disk gone"), "{err}");
        let (_, body) = server.join().unwrap();
        assert_eq!(body, None, "the server saw a complete body");
    }
}
