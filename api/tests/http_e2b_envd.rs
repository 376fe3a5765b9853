//! envd's file transfer (`GET /files`, octet-stream `POST /files`) over the
//! fake service's agent: paths, users, statuses, what is refused, and the
//! key it needs until per-sandbox access tokens exist.

mod common;

use common::{Server, TOKEN};
use serde_json::{json, Value};

fn headers<'a>(
    key: Option<&str>,
    id: Option<&str>,
    extra: &[(&'a str, &str)],
) -> Vec<(&'a str, String)> {
    let mut h = Vec::new();
    if let Some(k) = key {
        h.push(("X-API-KEY", k.to_string()));
    }
    if let Some(i) = id {
        h.push(("E2b-Sandbox-Id", i.to_string()));
    }
    for (k, v) in extra {
        h.push((*k, v.to_string()));
    }
    h
}

fn e2b_error(r: &common::Reply, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["code"], status, "{v}");
    assert!(v["message"].is_string(), "{v}");
    v
}

const OCTETS: (&str, &str) = ("Content-Type", "application/octet-stream");

#[tokio::test]
async fn files_upload_and_download_through_the_agent() {
    let server = Server::start().await;
    let id = server.sandbox(true).await;
    let up = |path: &'static str, body: &'static [u8]| {
        let h = headers(Some(TOKEN), Some(&id), &[OCTETS]);
        let server = &server;
        async move {
            server
                .request("POST", &format!("/files?path={path}"), &h, Some(body))
                .await
        }
    };
    let r = up("/tmp/a.txt", b"hello\0bytes").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json(),
        json!([{"name": "a.txt", "type": "file", "path": "/tmp/a.txt"}])
    );
    let down = |path: &str| {
        let h = headers(Some(TOKEN), Some(&id), &[]);
        let path = format!("/files?{path}");
        let server = &server;
        async move { server.request("GET", &path, &h, None).await }
    };
    let r = down("path=/tmp/a.txt").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.body, b"hello\0bytes");
    assert_eq!(r.header("content-type"), Some("application/octet-stream"));

    // Relative paths are under the user's home.
    let r = up("notes.txt", b"n").await;
    assert_eq!(r.json()[0]["path"], "/home/user/notes.txt", "{}", r.text());
    assert_eq!(down("path=/home/user/notes.txt").await.body, b"n");
    assert_eq!(down("path=notes.txt&username=user").await.body, b"n");
    e2b_error(&down("path=notes.txt&username=root").await, 404);

    e2b_error(&down("path=/tmp/missing").await, 404);
    e2b_error(&down("").await, 400);
    e2b_error(&down("path=a&username=..").await, 400);
}

#[tokio::test]
async fn files_refuse_what_is_not_offered_and_need_the_key() {
    let server = Server::start().await;
    let id = server.sandbox(true).await;
    let plain = server.sandbox(false).await;
    let post = |h: Vec<(&'static str, String)>| {
        let server = &server;
        async move {
            server
                .request("POST", "/files?path=/tmp/x", &h, Some(b"x"))
                .await
        }
    };
    // A malformed multipart body (no parts, no boundary) and gzip: 400.
    e2b_error(
        &post(headers(
            Some(TOKEN),
            Some(&id),
            &[("Content-Type", "multipart/form-data; boundary=b")],
        ))
        .await,
        400,
    );
    e2b_error(
        &post(headers(
            Some(TOKEN),
            Some(&id),
            &[OCTETS, ("Content-Encoding", "gzip")],
        ))
        .await,
        400,
    );
    // The key, the sandbox header, a sandbox that exists and has an agent.
    e2b_error(&post(headers(None, Some(&id), &[OCTETS])).await, 401);
    e2b_error(
        &post(headers(Some("wrong"), Some(&id), &[OCTETS])).await,
        401,
    );
    e2b_error(&post(headers(Some(TOKEN), None, &[OCTETS])).await, 400);
    e2b_error(
        &post(headers(
            Some(TOKEN),
            Some("sbx_0000000000000000"),
            &[OCTETS],
        ))
        .await,
        502,
    );
    e2b_error(
        &post(headers(Some(TOKEN), Some(&plain), &[OCTETS])).await,
        422,
    );
    let r = server
        .request(
            "GET",
            "/files?path=/tmp/x",
            &headers(None, Some(&id), &[]),
            None,
        )
        .await;
    e2b_error(&r, 401);
}

#[tokio::test]
async fn the_access_token_of_the_create_answer_opens_that_sandboxs_files() {
    let server = Server::start().await;
    let create = |agent: bool| {
        let server = &server;
        async move {
            let body = if agent {
                br#"{"templateID":"probe","metadata":{"agent":"fake"}}"#.as_slice()
            } else {
                br#"{"templateID":"probe"}"#.as_slice()
            };
            let h = headers(Some(TOKEN), None, &[("Content-Type", "application/json")]);
            let r = server
                .request("POST", "/v2/sandboxes", &h, Some(body))
                .await;
            assert_eq!(r.status, 201, "{}", r.text());
            r.json()
        }
    };
    let a = create(true).await;
    let b = create(false).await;
    let (id, token) = (
        a["sandboxID"].as_str().unwrap().to_string(),
        a["envdAccessToken"].as_str().unwrap().to_string(),
    );
    let other = b["envdAccessToken"].as_str().unwrap().to_string();
    assert_eq!(token.len(), 32);
    assert_ne!(token, other);
    let post = |t: &str| {
        let h = headers(None, Some(&id), &[OCTETS, ("X-Access-Token", t)]);
        let server = &server;
        async move {
            server
                .request("POST", "/files?path=/t", &h, Some(b"via token"))
                .await
        }
    };
    assert_eq!(post(&token).await.status, 200);
    let h = headers(None, Some(&id), &[("X-Access-Token", &token)]);
    let r = server.request("GET", "/files?path=/t", &h, None).await;
    assert_eq!(r.body, b"via token");
    // Another sandbox's token, a wrong one, none: 401.
    e2b_error(&post(&other).await, 401);
    e2b_error(&post("0123").await, 401);
    e2b_error(&post("").await, 401);
    // Never shown by the native API.
    let r = server
        .call("GET", &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert!(!r.text().contains(&token), "{}", r.text());
}
