//! The client side of the REST API for `torpor sandbox|template|pod`: a tiny
//! blocking HTTP/1.1 client over `std::net::TcpStream` (one request per
//! connection; `Content-Length`, chunked or read-to-end bodies; timeouts),
//! where the URL and token come from, and how errors are told.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde_json::Value;

use super::EXIT_FAILURE;
use crate::cli::ClientArgs;

/// Where the API is unless `--api` or TORPOR_API says otherwise.
const DEFAULT_API: &str = "http://127.0.0.1:7700";
/// Longest wait for a TCP connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for an answer (or, streaming, for the next chunk): the
/// server ends requests at its own limit (`serve --request-timeout-ms`,
/// 120 s by default), so this is only a backstop against a hung server.
const IO_TIMEOUT: Duration = Duration::from_secs(900);
/// Largest response head and body we accept.
const MAX_HEAD: usize = 64 << 10;
const MAX_BODY: u64 = 64 << 20;

/// Where a streamed response body goes, chunk by chunk.
type ChunkSink<'a> = &'a mut dyn FnMut(&[u8]);

/// Why a request failed.
#[derive(Debug)]
pub enum Error {
    /// No TCP connection to the API.
    Connect(std::io::Error),
    /// The connection broke, timed out or the answer was not HTTP.
    Transport(String),
    /// The API answered with an error status.
    Api {
        status: u16,
        code: String,
        message: String,
    },
}

/// One API endpoint, its token, and how the token was found (for messages).
pub struct Client {
    url: String,
    authority: String,
    prefix: String,
    token: Option<String>,
    token_source: String,
    pub json: bool,
}

impl Client {
    /// From the flags, environment and the default token file.
    pub fn new(args: &ClientArgs) -> Result<Client, String> {
        let url = args
            .api
            .clone()
            .or_else(|| std::env::var("TORPOR_API").ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| DEFAULT_API.to_string());
        let (authority, prefix) = parse_url(&url)?;
        let file = super::serve::default_data_dir().join("token");
        let env = std::env::var("TORPOR_TOKEN").ok().filter(|s| !s.is_empty());
        let (token, token_source) = if let Some(t) = &args.token {
            (Some(t.clone()), "the token given with --token".to_string())
        } else if let Some(t) = env {
            (Some(t), "the token in $TORPOR_TOKEN".to_string())
        } else {
            match std::fs::read_to_string(&file) {
                Ok(t) => (
                    Some(t.trim().to_string()),
                    format!("the token read from {}", file.display()),
                ),
                Err(e) => (
                    None,
                    format!("none was given (and {}: {e})", file.display()),
                ),
            }
        };
        if token
            .as_ref()
            .is_some_and(|t| t.chars().any(char::is_control))
        {
            return Err(format!("{token_source} holds control characters"));
        }
        Ok(Client {
            url: url.trim_end_matches('/').to_string(),
            authority,
            prefix,
            token,
            token_source,
            json: args.json,
        })
    }

    /// Runs `f` with a client made from the flags; the exit status.
    pub fn run(args: &ClientArgs, f: impl FnOnce(&Client) -> Result<(), Error>) -> i32 {
        match Client::new(args) {
            Ok(c) => match f(&c) {
                Ok(()) => super::EXIT_OK,
                Err(e) => c.fail(e),
            },
            Err(m) => {
                eprintln!("torpor: error: {m}");
                EXIT_FAILURE
            }
        }
    }

    /// Sends one request; 2xx answers give their JSON (`Null` when empty),
    /// others an [`Error::Api`].
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, Error> {
        self.exchange(method, path, body).map(|(v, _)| v)
    }

    /// As [`Self::call`], but with `--json` the answer is printed as it
    /// came (re-indented, fields in the API's order) and `None` returned.
    pub fn show(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Option<Value>, Error> {
        let (v, raw) = self.exchange(method, path, body)?;
        if !self.json {
            return Ok(Some(v));
        }
        if !raw.trim().is_empty() {
            println!("{}", super::sandbox::pretty(&raw));
        }
        Ok(None)
    }

    /// Sends one request with a raw body (`content_type`, bytes); 2xx
    /// answers give their raw body, others an [`Error::Api`].
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
    ) -> Result<Vec<u8>, Error> {
        let (status, bytes) = self.send_bytes(method, path, body, None)?;
        if (200..300).contains(&status) {
            return Ok(bytes);
        }
        Err(api_error(
            method,
            path,
            status,
            &String::from_utf8_lossy(&bytes),
        ))
    }

    /// Sends a JSON request whose 2xx answer is streamed: each chunk of
    /// the body goes to `on_chunk` as it arrives.
    pub fn stream(
        &self,
        path: &str,
        body: &Value,
        on_chunk: &mut dyn FnMut(&[u8]),
    ) -> Result<(), Error> {
        let text = body.to_string();
        let body = Some(("application/json", text.as_bytes()));
        let (status, bytes) = self.send_bytes("POST", path, body, Some(on_chunk))?;
        if (200..300).contains(&status) {
            return Ok(());
        }
        Err(api_error(
            "POST",
            path,
            status,
            &String::from_utf8_lossy(&bytes),
        ))
    }

    fn exchange(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(Value, String), Error> {
        let body = body.map(|b| b.to_string());
        let (status, text) = self.send(method, path, body.as_deref())?;
        if (200..300).contains(&status) {
            if text.trim().is_empty() {
                return Ok((Value::Null, text));
            }
            return match serde_json::from_str(&text) {
                Ok(v) => Ok((v, text)),
                Err(e) => Err(Error::Transport(format!(
                    "the answer to {method} {path} is not JSON ({e})"
                ))),
            };
        }
        Err(api_error(method, path, status, &text))
    }

    fn send(&self, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String), Error> {
        let body = body.map(|b| ("application/json", b.as_bytes()));
        let (status, bytes) = self.send_bytes(method, path, body, None)?;
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }

    fn send_bytes(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
        on_chunk: Option<ChunkSink<'_>>,
    ) -> Result<(u16, Vec<u8>), Error> {
        let mut stream = self.connect()?;
        let io = |e: std::io::Error| {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                Error::Transport(format!(
                    "the API at {} did not answer within {}s",
                    self.url,
                    IO_TIMEOUT.as_secs()
                ))
            } else {
                Error::Transport(format!("talking to the API at {}: {e}", self.url))
            }
        };
        let mut head = format!(
            "{method} {}{path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\
             User-Agent: torpor/{}\r\nAccept: application/json\r\n",
            self.prefix,
            self.authority,
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
        read_response(&mut BufReader::new(stream), method, on_chunk).map_err(io)
    }

    fn connect(&self) -> Result<TcpStream, Error> {
        let addrs = self.authority.to_socket_addrs().map_err(Error::Connect)?;
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    s.set_read_timeout(Some(IO_TIMEOUT))
                        .map_err(Error::Connect)?;
                    s.set_write_timeout(Some(IO_TIMEOUT))
                        .map_err(Error::Connect)?;
                    return Ok(s);
                }
                Err(e) => last = e,
            }
        }
        Err(Error::Connect(last))
    }

    /// Prints the error on stderr; the exit status for it.
    pub fn fail(&self, err: Error) -> i32 {
        match err {
            Error::Transport(m) => eprintln!("torpor: error: {m}"),
            Error::Connect(e) => {
                let why = if e.kind() == std::io::ErrorKind::ConnectionRefused {
                    "connection refused".to_string()
                } else {
                    e.to_string()
                };
                eprintln!(
                    "torpor: error: cannot connect to the torpor API at {} ({why}).\n\
                     Is it running? Start it with `torpor serve`, or point --api or \
                     $TORPOR_API at it.",
                    self.url
                );
            }
            Error::Api {
                status,
                code,
                message,
            } => {
                let code = if code.is_empty() {
                    String::new()
                } else {
                    format!(" {code}")
                };
                eprintln!("torpor: error: {message} (HTTP {status}{code})");
                if status == 401 {
                    let what = match self.token {
                        Some(_) => format!("refused {}", self.token_source),
                        None => format!("needs a token and {}", self.token_source),
                    };
                    eprintln!(
                        "torpor: the API at {} {what}. Tokens come from --token, \
                         $TORPOR_TOKEN, or the token file in `torpor serve`'s data directory \
                         (DATA_DIR/token; by default {}): use one the server was started with.",
                        self.url,
                        super::serve::default_data_dir().join("token").display()
                    );
                }
            }
        }
        EXIT_FAILURE
    }
}

/// An error answer as [`Error::Api`]: the error body's code and message,
/// else the start of the text.
fn api_error(method: &str, path: &str, status: u16, text: &str) -> Error {
    let parsed: Option<Value> = serde_json::from_str(text).ok();
    let field = |k: &str| {
        parsed
            .as_ref()
            .and_then(|v| v["error"][k].as_str())
            .map(str::to_string)
    };
    let message = field("message")
        .or_else(|| Some(text.trim().chars().take(400).collect()))
        .filter(|m: &String| !m.is_empty())
        .unwrap_or_else(|| format!("{method} {path} failed"));
    Error::Api {
        status,
        code: field("code").unwrap_or_default(),
        message,
    }
}

/// `http://host[:port][/prefix]` (the scheme may be left out) to the
/// `host:port` to connect to and the path prefix to put before `/v1/...`.
fn parse_url(url: &str) -> Result<(String, String), String> {
    let rest = if let Some(r) = url.strip_prefix("http://") {
        r
    } else if url.starts_with("https://") {
        return Err(format!(
            "{url}: https is not supported by this client; use http:// (put a TLS proxy \
             in front of it if the API is remote)"
        ));
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
        format!("{authority}:80")
    };
    Ok((authority, path.to_string()))
}

/// Reads one response (skipping 1xx): status and body. With `on_chunk`, a
/// 2xx chunked body goes to it chunk by chunk as it arrives instead.
fn read_response(
    r: &mut impl BufRead,
    method: &str,
    mut on_chunk: Option<ChunkSink<'_>>,
) -> std::io::Result<(u16, Vec<u8>)> {
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
        }
        if (100..200).contains(&status) {
            continue;
        }
        let mut body = Vec::new();
        if method == "HEAD" || status == 204 || status == 304 {
        } else if chunked {
            let sink = on_chunk.take().filter(|_| (200..300).contains(&status));
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
        return Ok((status, body));
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
