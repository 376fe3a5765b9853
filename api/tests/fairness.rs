//! Fairness (issue 24, attack 9) over the in-memory fake: a tenant holds
//! at most its number of long requests (exec streams) at once, the next
//! answers 429 `rate_limited` with `Retry-After`, and another tenant's
//! creates, execs and streams answer meanwhile; a stream whose client
//! went away gives its slot back. (How long the other tenant's requests
//! take meanwhile: `api/benches/fairness.rs`.)

mod common;

use std::time::{Duration, Instant};

use common::{open_exec_stream, tenants_file, Server, TOKEN};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use torpor_api::ApiConfig;

const ACME: &str = "acme-token-0123456789";
const OTHER: &str = "other-token-0123456789";
const STREAMS: usize = 4;

/// An exec stream of `sleep secs` opened by `token` on `id`, kept open
/// after its `start` line; or the status it was refused with.
async fn open_stream(
    server: &Server,
    token: &str,
    id: &str,
    secs: u32,
) -> Result<BufReader<TcpStream>, String> {
    let secs = secs.to_string();
    let mut reader = open_exec_stream(server.addr, token, id, &["sleep", &secs]).await?;
    // Headers, then the chunked body's first chunk: the start line.
    let mut line = String::new();
    loop {
        line.clear();
        reader.read_line(&mut line).await.unwrap();
        if line.contains("\"start\"") {
            return Ok(reader);
        }
        assert!(!line.is_empty(), "the stream ended before its start line");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_stream_limit_leaves_others_answering() {
    let scratch = tempfile::tempdir().unwrap();
    let tenants = tenants_file(scratch.path(), &[("acme", ACME), ("other", OTHER)]);
    let mut config = ApiConfig {
        tenants_file: Some(tenants),
        ..Server::config()
    };
    config.rate_limit.streams_per_tenant = STREAMS;
    let server = Server::start_with(config).await;
    let mine = server.sandbox_as(ACME).await;
    let theirs = server.sandbox_as(OTHER).await;

    // acme holds its most; the next is refused with Retry-After.
    let mut held = Vec::new();
    for _ in 0..STREAMS {
        held.push(open_stream(&server, ACME, &mine, 60).await.unwrap());
    }
    let refused = open_stream(&server, ACME, &mine, 60).await.unwrap_err();
    assert!(refused.contains(" 429 "), "{refused}");
    let r = server
        .request(
            "POST",
            &format!("/v1/sandboxes/{mine}/exec/stream"),
            &[
                ("Authorization", format!("Bearer {ACME}")),
                ("Content-Type", "application/json".into()),
            ],
            Some(br#"{"argv":["echo","x"]}"#),
        )
        .await;
    r.assert_error(429, "rate_limited");
    assert!(r.header("retry-after").is_some());

    // The other tenant: creates, execs and its own streams answer.
    let r = server
        .request(
            "POST",
            &format!("/v1/sandboxes/{theirs}/exec"),
            &[
                ("Authorization", format!("Bearer {OTHER}")),
                ("Content-Type", "application/json".into()),
            ],
            Some(br#"{"argv":["echo","fine"]}"#),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let _more = server.sandbox_as(OTHER).await;
    let _theirs_too = open_stream(&server, OTHER, &theirs, 1).await.unwrap();
    // An admin is counted as its own tenant.
    let _admin = open_stream(&server, TOKEN, &mine, 1).await.unwrap();

    // A client that goes away gives its slot back.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match open_stream(&server, ACME, &mine, 1).await {
            Ok(_) => break,
            Err(status) => {
                assert!(
                    Instant::now() < deadline,
                    "the slot never came back: {status}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    drop(held);
    server.shutdown().await.unwrap();
}
