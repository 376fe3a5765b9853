//! Requests to `torpor serve` on loopback for the tests, through the
//! project's HTTP client ([`torpor_client::HttpClient`]), one request
//! per connection.
#![allow(dead_code)]

use std::time::Duration;

use torpor_client::{Endpoint, HttpClient};

/// Status code and body of one response.
pub struct HttpResponse {
    pub status: u16,
    pub body: String,
    /// The status line and headers.
    pub head: String,
    /// Header names in lower case, in order.
    pub headers: Vec<(String, String)>,
}

impl HttpResponse {
    /// The first header of this name (matched case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// Asserts a 2xx answer to `method path`; its body as JSON (null when
    /// empty).
    pub fn ok_json(&self, method: &str, path: &str) -> serde_json::Value {
        assert!(
            (200..300).contains(&self.status),
            "{method} {path}: {} {}",
            self.status,
            self.body
        );
        if self.body.is_empty() {
            serde_json::Value::Null
        } else {
            self.json()
        }
    }
}

/// Sends one request; `token` adds a bearer Authorization header.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> HttpResponse {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| ("Authorization", a))
        .into_iter()
        .collect();
    request_with(addr, method, path, &headers, body)
}

/// Sends one request with these extra headers; a body (or a POST, PUT or
/// PATCH without one) goes as `application/json` unless they name a
/// `Content-Type`.
pub fn request_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    try_request_with(addr, method, path, headers, body, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// [`request_with`] with an I/O time limit, and a failure to connect or to
/// read a whole answer as an error rather than a panic (a server that is
/// down, on purpose, in the cluster's chaos run).
pub fn try_request_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
    limit: Duration,
) -> Result<HttpResponse, String> {
    let endpoint = Endpoint::parse(&format!("tcp:{addr}")).map_err(|e| e.to_string())?;
    let client = HttpClient::new(endpoint, None, limit)
        .map_err(|e| e.to_string())?
        .with_headers(headers);
    let content_type = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map_or("application/json", |(_, v)| v);
    try_send(&client, method, path, content_type, body)
}

/// Sends one request through `client`; a body (or a POST, PUT or PATCH
/// without one) goes as `content_type`.
pub fn send(
    client: &HttpClient,
    method: &str,
    path: &str,
    content_type: &str,
    body: Option<&str>,
) -> HttpResponse {
    try_send(client, method, path, content_type, body).unwrap_or_else(|e| panic!("{e}"))
}

/// [`send`], a request that got no whole answer as an error.
pub fn try_send(
    client: &HttpClient,
    method: &str,
    path: &str,
    content_type: &str,
    body: Option<&str>,
) -> Result<HttpResponse, String> {
    let body = body.unwrap_or("");
    let body = (!body.is_empty() || matches!(method, "POST" | "PUT" | "PATCH"))
        .then_some((content_type, body.as_bytes()));
    let answer = client
        .request(method, path, body, None)
        .map_err(|e| format!("{method} {path} to {}: {e}", client.endpoint.describe()))?;
    let mut head = format!("HTTP/1.1 {}", answer.status);
    for (name, value) in &answer.headers {
        head.push_str(&format!("\r\n{name}: {value}"));
    }
    Ok(HttpResponse {
        status: answer.status,
        body: String::from_utf8_lossy(&answer.body).into_owned(),
        head,
        headers: answer.headers,
    })
}

/// A JSON request that declares a `length`-byte body and sends none: what
/// a server answers from the headers alone (a body past its limit). A body
/// sent whole would race the server's close, whose reset can discard the
/// answer before the client reads it.
pub fn declared_only(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    length: usize,
) -> HttpResponse {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {length}\r\n"
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).unwrap();
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("{method} {path}: no answer from the headers: {e}"));
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.split("\r\n");
    let status = lines.next().and_then(|l| l.split(' ').nth(1)?.parse().ok());
    let status = status.unwrap_or_else(|| panic!("not an HTTP answer: {raw}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    HttpResponse {
        status,
        body: body.to_string(),
        head: head.to_string(),
        headers,
    }
}

/// The HTTP API served in process on a loopback port over `service`;
/// stopped (requests in flight finished) when dropped.
pub struct InProcessApi {
    pub addr: String,
    runtime: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl InProcessApi {
    pub fn start<S: torpor_api::SandboxApi>(
        service: std::sync::Arc<S>,
        config: torpor_api::ApiConfig,
    ) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = runtime.spawn(torpor_api::serve(listener, service, config, async {
            let _ = stopped.await;
        }));
        Self {
            addr,
            runtime,
            stop: Some(stop),
            server: Some(server),
        }
    }
}

impl Drop for InProcessApi {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let result = self.runtime.block_on(server);
            if !std::thread::panicking() {
                result.unwrap().unwrap();
            }
        }
    }
}
