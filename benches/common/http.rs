//! Requests to `torpor serve` on loopback for the benches (`density`,
//! `api`), through the project's HTTP client
//! ([`torpor_client::HttpClient`]): one request per connection, every
//! wait bounded.

use std::time::Duration;

use torpor_client::{Endpoint, HttpClient};

/// One request to `addr` (`host:port`) with a bearer `token` and, if
/// given, a JSON body; (status, body). The service writes its answer once
/// it is ready, so `limit` (the I/O timeout) bounds the whole request.
pub fn request(
    addr: &str,
    token: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    limit: Duration,
) -> Result<(u16, String), String> {
    let body = body.unwrap_or("");
    request_bytes(
        addr,
        token,
        method,
        path,
        ("application/json", body.as_bytes()),
        limit,
    )
}

/// [`request`] with a body of any type (`content_type`, bytes).
pub fn request_bytes(
    addr: &str,
    token: &str,
    method: &str,
    path: &str,
    body: (&str, &[u8]),
    limit: Duration,
) -> Result<(u16, String), String> {
    let endpoint = Endpoint::parse(&format!("tcp:{addr}")).map_err(|e| e.to_string())?;
    let client = HttpClient::new(endpoint, Some(token.into()), limit).map_err(|e| e.to_string())?;
    let answer = client
        .request(method, path, Some(body), None)
        .map_err(|e| format!("no complete answer (limit {limit:?}): {e}"))?;
    let text = String::from_utf8_lossy(&answer.body).into_owned();
    // The API answers whole JSON documents with a Content-Length.
    if answer
        .header("transfer-encoding")
        .is_some_and(|v| v.contains("chunked"))
    {
        return Err(format!("unexpected chunked answer: {text}"));
    }
    Ok((answer.status, text))
}
