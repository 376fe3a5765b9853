//! A tiny blocking HTTP/1.1 client for the REST API, over TCP or a unix
//! socket: one request per connection; `Content-Length`, chunked or
//! read-to-end bodies; timeouts; TLS (rustls) to a server whose
//! certificate fingerprint is pinned ([`crate::tls`]). Used by the CLI (`torpor sandbox|template|pod`)
//! and by the federation to call remote pods (whose protocol is this API).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use rustls::pki_types::ServerName;

use crate::tls::{pinned_client_config, Fingerprint};

/// Longest wait for a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest response head and body accepted.
const MAX_HEAD: usize = 64 << 10;
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

enum Stream {
    Tcp(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
    Unix(UnixStream),
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}

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
        })
    }

    /// Trusts exactly the certificate with this fingerprint on a TLS
    /// endpoint (a TLS endpoint without a pin is refused at connect).
    pub fn pinned(mut self, pin: Option<Fingerprint>) -> Self {
        self.pin = pin;
        self
    }

    /// Sends one request (`body`: content type and bytes; `path` with its
    /// query) and reads the answer, whatever its status.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
        streaming: Option<Streaming<'_>>,
    ) -> Result<Answer, ClientError> {
        let mut stream = self.connect()?;
        let target = self.endpoint.describe();
        let io = |e: std::io::Error| {
            if let Some(tls) = e
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            {
                return ClientError::Tls {
                    target: target.clone(),
                    message: tls.to_string(),
                };
            }
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                ClientError::Transport(format!(
                    "the API at {target} did not answer within {}s",
                    self.io_timeout.as_secs()
                ))
            } else {
                ClientError::Transport(format!("talking to the API at {target}: {e}"))
            }
        };
        let (host, prefix) = match &self.endpoint {
            Endpoint::Tcp {
                authority, prefix, ..
            } => (authority.as_str(), prefix.as_str()),
            Endpoint::Unix { .. } => ("localhost", ""),
        };
        let mut head = format!(
            "{method} {prefix}{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\
             User-Agent: torpor/{}\r\nAccept: application/json\r\n",
            env!("CARGO_PKG_VERSION")
        );
        if let Some(t) = &self.token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        if let Some((content_type, b)) = body {
            head.push_str(&format!(
                "Content-Type: {content_type}\r\nContent-Length: {}\r\n",
                b.len()
            ));
        } else if matches!(method, "POST" | "PUT" | "PATCH") {
            head.push_str("Content-Length: 0\r\n");
        }
        head.push_str("\r\n");
        let mut request = head.into_bytes();
        request.extend_from_slice(body.map_or(&[][..], |(_, b)| b));
        stream.write_all(&request).map_err(io)?;
        stream.flush().map_err(io)?;
        read_response(&mut BufReader::new(stream), method, streaming).map_err(io)
    }

    fn connect(&self) -> Result<Stream, ClientError> {
        let target = self.endpoint.describe();
        let connect = |source| ClientError::Connect {
            target: target.clone(),
            source,
        };
        match &self.endpoint {
            Endpoint::Unix { path } => {
                let s = UnixStream::connect(path).map_err(connect)?;
                s.set_read_timeout(Some(self.io_timeout)).map_err(connect)?;
                s.set_write_timeout(Some(self.io_timeout))
                    .map_err(connect)?;
                Ok(Stream::Unix(s))
            }
            Endpoint::Tcp { authority, tls, .. } => {
                if !tls {
                    return Ok(Stream::Tcp(self.connect_tcp(authority, &connect)?));
                }
                let Some(pin) = self.pin else {
                    return Err(ClientError::BadAddress(format!(
                        "{target}: a TLS endpoint needs its certificate's SHA-256 \
                         fingerprint (printed by the server when it starts)"
                    )));
                };
                let tcp = self.connect_tcp(authority, &connect)?;
                let host = authority
                    .rsplit_once(':')
                    .map_or(authority.as_str(), |(h, _)| h)
                    .trim_start_matches('[')
                    .trim_end_matches(']');
                // The pin is the trust; the name only fills the handshake.
                let name = ServerName::try_from(host.to_string())
                    .unwrap_or_else(|_| ServerName::try_from("torpor.invalid").expect("valid"));
                let conn = rustls::ClientConnection::new(pinned_client_config(pin), name)
                    .map_err(|e| ClientError::Transport(format!("TLS to {target}: {e}")))?;
                Ok(Stream::Tls(Box::new(rustls::StreamOwned::new(conn, tcp))))
            }
        }
    }

    fn connect_tcp(
        &self,
        authority: &str,
        connect: &dyn Fn(std::io::Error) -> ClientError,
    ) -> Result<TcpStream, ClientError> {
        let addrs = authority.to_socket_addrs().map_err(connect)?;
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    s.set_read_timeout(Some(self.io_timeout)).map_err(connect)?;
                    s.set_write_timeout(Some(self.io_timeout))
                        .map_err(connect)?;
                    return Ok(s);
                }
                Err(e) => last = e,
            }
        }
        Err(connect(last))
    }
}

/// Reads one response (skipping 1xx).
fn read_response(
    r: &mut impl BufRead,
    method: &str,
    mut streaming: Option<Streaming<'_>>,
) -> std::io::Result<Answer> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    loop {
        let mut head_len = 0;
        let mut line = String::new();
        let mut next_line = |line: &mut String| -> std::io::Result<()> {
            line.clear();
            let n = r.take((MAX_HEAD - head_len) as u64).read_line(line)?;
            head_len += n;
            if n == 0 || !line.ends_with('\n') {
                return Err(bad("the connection closed inside the response head".into()));
            }
            Ok(())
        };
        next_line(&mut line)?;
        let status: u16 = line
            .strip_prefix("HTTP/1.")
            .and_then(|s| s.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad(format!("not an HTTP response: {:?}", line.trim_end())))?;
        let (mut length, mut chunked) = (None, false);
        let mut headers = Vec::new();
        loop {
            next_line(&mut line)?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            let Some((name, value)) = l.split_once(':') else {
                continue;
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = Some(value.parse::<u64>().map_err(|_| bad(l.into()))?);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.to_ascii_lowercase().contains("chunked");
            }
            headers.push((name.to_ascii_lowercase(), value.to_string()));
        }
        if (100..200).contains(&status) {
            continue;
        }
        let mut sink = None;
        if let Some(s) = streaming.take() {
            (s.on_head)(status, &headers);
            if (200..300).contains(&status) {
                sink = Some(s.on_chunk);
            }
        }
        let mut body = Vec::new();
        if method == "HEAD" || status == 204 || status == 304 {
        } else if chunked {
            read_chunked(r, &mut body, sink)?;
        } else if let Some(n) = length {
            if n > MAX_BODY {
                return Err(bad(format!("response body of {n} bytes is too large")));
            }
            r.take(n).read_to_end(&mut body)?;
            if body.len() as u64 != n {
                return Err(bad("the connection closed inside the response body".into()));
            }
        } else {
            r.take(MAX_BODY).read_to_end(&mut body)?;
        }
        return Ok(Answer {
            status,
            headers,
            body,
        });
    }
}

fn read_chunked(
    r: &mut impl BufRead,
    body: &mut Vec<u8>,
    mut sink: Option<ChunkSink<'_>>,
) -> std::io::Result<()> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let mut line = String::new();
    loop {
        line.clear();
        r.take(1024).read_line(&mut line)?;
        let size = line.split(';').next().unwrap_or("").trim();
        let n = u64::from_str_radix(size, 16).map_err(|_| bad("bad chunk size"))?;
        if n == 0 {
            // Trailers, up to the empty line (or the end of the stream).
            loop {
                line.clear();
                if r.take(8192).read_line(&mut line)? == 0 || line.trim_end().is_empty() {
                    return Ok(());
                }
            }
        }
        if body.len() as u64 + n > MAX_BODY {
            return Err(bad("response body is too large"));
        }
        let before = body.len();
        r.take(n).read_to_end(body)?;
        if (body.len() - before) as u64 != n {
            return Err(bad("the connection closed inside a chunk"));
        }
        if let Some(sink) = sink.as_mut() {
            sink(&body[before..]);
            body.truncate(before);
        }
        line.clear();
        r.take(2).read_line(&mut line)?;
    }
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
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let (mut heads, mut chunks) = (Vec::new(), Vec::new());
        let answer = read_response(
            &mut &raw[..],
            "POST",
            Some(Streaming {
                on_head: &mut |s, h| heads.push((s, h.to_vec())),
                on_chunk: &mut |c| chunks.push(c.to_vec()),
            }),
        )
        .unwrap();
        assert!(answer.body.is_empty());
        assert_eq!(chunks, [b"abc".to_vec(), b"de".to_vec()]);
        assert_eq!(heads[0].0, 200);
        assert_eq!(answer.header("x-a"), Some("1"));
    }
}
