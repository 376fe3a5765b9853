//! A minimal HTTP/1.1 client over std TCP for the benches that drive
//! `torpor serve` on loopback (`density`, `api`): one request per
//! connection (`Connection: close`), every wait bounded.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// How long connecting and sending may take.
const SEND_LIMIT: Duration = Duration::from_secs(10);

/// One request to `addr` (`host:port`) with a bearer `token` and, if
/// given, a JSON body; (status, body). The service writes its answer once
/// it is ready, so `limit` (the read timeout) bounds the whole request.
pub fn request(
    addr: &str,
    token: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    limit: Duration,
) -> Result<(u16, String), String> {
    let sock: SocketAddr = addr.parse().map_err(|e| format!("address {addr}: {e}"))?;
    let mut s = TcpStream::connect_timeout(&sock, SEND_LIMIT)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = s.set_nodelay(true);
    let _ = s.set_write_timeout(Some(SEND_LIMIT));
    let _ = s.set_read_timeout(Some(limit));
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Authorization: Bearer {token}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .map_err(|e| format!("no complete answer (limit {limit:?}): {e}"))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok());
    let status = status.ok_or_else(|| format!("no status line in {head:?}"))?;
    // The API answers whole JSON documents with a Content-Length.
    if head.to_ascii_lowercase().contains("chunked") {
        return Err(format!("unexpected chunked answer: {text}"));
    }
    Ok((status, rest.to_string()))
}
