//! Requests to `torpor serve` on loopback for the tests, through the
//! project's HTTP client ([`torpor_api::client::HttpClient`]), one request
//! per connection.
#![allow(dead_code)]

use std::time::Duration;

use torpor_api::client::{Endpoint, HttpClient};

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
    let endpoint = Endpoint::parse(&format!("tcp:{addr}")).unwrap();
    let client = HttpClient::new(endpoint, None, Duration::from_secs(120))
        .unwrap()
        .with_headers(headers);
    let content_type = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map_or("application/json", |(_, v)| v);
    send(&client, method, path, content_type, body)
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
    let body = body.unwrap_or("");
    let body = (!body.is_empty() || matches!(method, "POST" | "PUT" | "PATCH"))
        .then_some((content_type, body.as_bytes()));
    let answer = client
        .request(method, path, body, None)
        .unwrap_or_else(|e| panic!("{method} {path} to {}: {e}", client.endpoint.describe()));
    let mut head = format!("HTTP/1.1 {}", answer.status);
    for (name, value) in &answer.headers {
        head.push_str(&format!("\r\n{name}: {value}"));
    }
    HttpResponse {
        status: answer.status,
        body: String::from_utf8_lossy(&answer.body).into_owned(),
        head,
        headers: answer.headers,
    }
}
