//! Guest ports the way E2B's SDKs reach them (`torpor_api::ports`), over
//! the fake service's real agent: its "guest" is this host, so a guest
//! port is a port on this host's loopback, served here by small servers
//! written for each test. Both addressing styles (E2B's headers on any
//! path, `{port}-{id}.{domain}` hosts), streaming, a WebSocket upgrade,
//! the refusals E2B's proxy answers, waking by traffic, the metrics.

mod common;

use std::time::Duration;

use common::ports::{
    echo_server, guest_port, read_head, rig, str_of, websocket_echo, websocket_request, ACME,
    DOMAIN, UMBRELLA,
};
use common::{Server, TOKEN};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// `GET path` with these headers, `Connection: close`, raw.
async fn get(server: &Server, path: &str, headers: &[(&str, &str)]) -> common::Reply {
    let mut raw = format!("GET {path} HTTP/1.1\r\nconnection: close\r\n");
    if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("host")) {
        raw.push_str("host: 127.0.0.1\r\n");
    }
    for (n, v) in headers {
        raw.push_str(&format!("{n}: {v}\r\n"));
    }
    raw.push_str("\r\n");
    server.raw(raw.as_bytes()).await
}

/// `GET /` by host name `host` with traffic token `traffic` (`get_host`'s
/// way): it must answer 200; what the echoing guest saw.
async fn seen_by_host(server: &Server, host: &str, traffic: &str) -> Value {
    let r = get(
        server,
        "/",
        &[("Host", host), ("E2B-Traffic-Access-Token", traffic)],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[tokio::test]
async fn a_guest_port_answers_through_both_addressing_styles() {
    let rig = rig().await;
    let (server, scratch) = (&rig.server, &rig.scratch);
    let (id, envd, traffic) = (rig.id.as_str(), rig.envd.as_str(), rig.traffic.as_str());
    assert_ne!(envd, traffic);
    let port = echo_server().await;
    let port_s = port.to_string();

    // E2B_SANDBOX_URL's way: the headers, on any path.
    let r = get(
        server,
        "/any/path?x=1",
        &[
            ("E2b-Sandbox-Id", id),
            ("E2b-Sandbox-Port", &port_s),
            ("X-Access-Token", envd),
        ],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = r.json();
    assert_eq!(seen["line"], "GET /any/path?x=1 HTTP/1.1", "{seen}");
    // The caller's credentials stay with the proxy.
    assert!(seen["headers"].get("x-access-token").is_none(), "{seen}");
    assert_eq!(seen["headers"]["e2b-sandbox-id"], id);

    // get_host(port)'s way: the host name, with the traffic token.
    let host = format!("{port}-{id}.{DOMAIN}:7700");
    let seen = seen_by_host(server, &host, traffic).await;
    assert_eq!(seen["line"], "GET / HTTP/1.1");
    assert_eq!(seen["headers"]["host"], host.as_str(), "{seen}");
    assert!(seen["headers"].get("e2b-traffic-access-token").is_none());

    // The tenant's API key works too; the key does not reach the guest.
    let r = get(server, "/", &[("Host", &host), ("X-API-KEY", ACME)]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["headers"].get("x-api-key").is_none());

    // envd's port by host name is envd itself.
    let envd_host = format!("49983-{id}.{DOMAIN}");
    std::fs::write(scratch.path().join("f"), b"envd's").unwrap();
    let file = format!("/files?path={}", scratch.path().join("f").display());
    let r = get(
        server,
        &file,
        &[("Host", &envd_host), ("X-Access-Token", envd)],
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.body, b"envd's");
    // Another host is the API's own routes.
    let r = get(server, "/healthz", &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());

    // Counted per sandbox.
    let metrics = server.call("GET", "/metrics", None).await.text();
    let requests = format!("torpor_sandbox_port_requests_total{{sandbox=\"{id}\"}} 3");
    assert!(metrics.contains(&requests), "{metrics}");
    assert!(
        metrics.contains(&format!(
            "torpor_sandbox_port_tx_bytes_total{{sandbox=\"{id}\"}}"
        )),
        "{metrics}"
    );
}

/// E2B's `network.maskRequestHost` (with `allowPublicTraffic: false`,
/// which torpor's ports always are): the guest gets the mask as `Host`,
/// `${PORT}` its port, and the caller's `Host` in `X-Forwarded-Host`;
/// the detail shows it. A mask that is not a host is 400 in E2B's words,
/// as is `allowPublicTraffic: false` without `secure`.
#[tokio::test]
async fn a_masked_request_host_is_what_the_guest_sees() {
    let rig = rig().await;
    let server = &rig.server;
    let h = vec![
        ("X-API-KEY", ACME.to_string()),
        ("Content-Type", "application/json".to_string()),
    ];
    let create = |network: &str, secure: bool| {
        format!(
            r#"{{"templateID":"probe","metadata":{{"agent":"real"}},"secure":{secure},"network":{network}}}"#
        )
    };
    let masked = create(
        r#"{"allowPublicTraffic":false,"maskRequestHost":"localhost:${PORT}"}"#,
        true,
    );
    let r = server
        .request("POST", "/v2/sandboxes", &h, Some(masked.as_bytes()))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let created = r.json();
    let (id, traffic) = (
        str_of(&created, "sandboxID"),
        str_of(&created, "trafficAccessToken"),
    );
    let port = echo_server().await;
    let host = format!("{port}-{id}.{DOMAIN}");
    let seen = seen_by_host(server, &host, traffic).await;
    assert_eq!(
        seen["headers"]["host"],
        format!("localhost:{port}"),
        "{seen}"
    );
    assert_eq!(seen["headers"]["x-forwarded-host"], host.as_str(), "{seen}");
    // Without a credential: E2B's 403, as for every sandbox here.
    let r = get(server, "/", &[("Host", &host)]).await;
    assert_eq!(r.status, 403, "{}", r.text());
    let detail = server
        .request("GET", &format!("/sandboxes/{id}"), &h, None)
        .await
        .json();
    assert_eq!(
        detail["network"]["maskRequestHost"], "localhost:${PORT}",
        "{detail}"
    );
    assert_eq!(detail["network"]["allowPublicTraffic"], false, "{detail}");

    for (network, secure, says) in [
        (
            r#"{"maskRequestHost":"a b"}"#,
            true,
            "mask request host is not valid: a b",
        ),
        (r#"{"maskRequestHost":"bücher.de"}"#, true, "is not ASCII"),
        (
            r#"{"allowPublicTraffic":false}"#,
            false,
            "You cannot create a sandbox without public access",
        ),
    ] {
        let body = create(network, secure);
        let r = server
            .request("POST", "/v2/sandboxes", &h, Some(body.as_bytes()))
            .await;
        assert_eq!(r.status, 400, "{network}: {}", r.text());
        assert!(r.text().contains(says), "{network}: {}", r.text());
    }
}

#[tokio::test]
async fn refusals_answer_as_e2b_proxy_does_and_tell_nobody_what_exists() {
    let rig = rig().await;
    let server = &rig.server;
    let (id, traffic) = (rig.id.as_str(), rig.traffic.as_str());
    let port = echo_server().await;
    let host = format!("{port}-{id}.{DOMAIN}");
    let ask = |headers: Vec<(&'static str, String)>, host: String| async move {
        let mut h: Vec<(&str, &str)> = vec![("Host", host.as_str())];
        h.extend(headers.iter().map(|(n, v)| (*n, v.as_str())));
        let r = get(server, "/", &h).await;
        let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        (r.status, v)
    };
    // No credential: E2B's 403 for a secured sandbox, before any lookup.
    let (status, v) = ask(vec![], host.clone()).await;
    assert_eq!(status, 403, "{v}");
    assert!(
        str_of(&v, "message").contains("e2b-traffic-access-token"),
        "{v}"
    );
    let (status, _) = ask(vec![], format!("{port}-sbx_00000000000000ff.{DOMAIN}")).await;
    assert_eq!(status, 403);

    // Another tenant's key, a wrong token, an unknown sandbox: one answer.
    let gone = |v: &Value| {
        assert_eq!(v["message"], "The sandbox was not found", "{v}");
        assert_eq!(v["code"], 502, "{v}");
    };
    let (status, v) = ask(vec![("X-API-KEY", UMBRELLA.into())], host.clone()).await;
    assert_eq!(status, 502);
    gone(&v);
    let wrong = "0".repeat(traffic.len());
    let (status, v) = ask(vec![("E2B-Traffic-Access-Token", wrong)], host.clone()).await;
    assert_eq!(status, 502);
    gone(&v);
    let unknown = format!("{port}-sbx_00000000000000ff.{DOMAIN}");
    let (status, v) = ask(vec![("X-API-KEY", ACME.into())], unknown).await;
    assert_eq!(status, 502);
    gone(&v);

    // A port nothing listens on.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (status, v) = ask(
        vec![("E2B-Traffic-Access-Token", traffic.into())],
        format!("{closed}-{id}.{DOMAIN}"),
    )
    .await;
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["message"], "The sandbox is running but port is not open");
    assert_eq!(v["port"], closed);
    assert_eq!(v["sandboxId"], id);

    // A port header that is not a port.
    let r = get(
        server,
        "/",
        &[("E2b-Sandbox-Id", id), ("E2b-Sandbox-Port", "http")],
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    // An admin's key reaches every sandbox.
    let (status, _) = ask(vec![("X-API-KEY", TOKEN.into())], host).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_streamed_response_arrives_as_the_guest_sends_it() {
    let rig = rig().await;
    let (server, id, token) = (&rig.server, &rig.id, &rig.envd);
    let (listener, port) = guest_port().await;
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut reader = BufReader::new(stream);
        read_head(&mut reader).await;
        let s = reader.get_mut();
        s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nfirst\n\r\n")
            .await
            .unwrap();
        // The second chunk only once the client has read the first.
        go_rx.await.unwrap();
        s.write_all(b"7\r\nsecond\n\r\n0\r\n\r\n").await.unwrap();
    });
    let mut client = TcpStream::connect(server.addr).await.unwrap();
    let request = format!(
        "GET /events HTTP/1.1\r\nhost: 127.0.0.1\r\ne2b-sandbox-id: {id}\r\n\
         e2b-sandbox-port: {port}\r\nx-access-token: {token}\r\nconnection: close\r\n\r\n"
    );
    client.write_all(request.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let first = async {
        while !String::from_utf8_lossy(&seen).contains("first") {
            let n = client.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the first chunk");
            seen.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(20), first)
        .await
        .expect("the first chunk arrives before the guest sends the second");
    assert!(!String::from_utf8_lossy(&seen).contains("second"));
    go_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(20), client.read_to_end(&mut seen))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&seen);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("second"), "{text}");
}

#[tokio::test]
async fn a_websocket_upgrade_passes_through() {
    let rig = rig().await;
    let (server, id, traffic) = (&rig.server, &rig.id, &rig.traffic);
    let (listener, port) = guest_port().await;
    // The guest: accepts the upgrade, then echoes bytes back.
    let guest = websocket_echo(listener);
    let mut client = TcpStream::connect(server.addr).await.unwrap();
    let request = websocket_request(&format!(
        "host: {port}-{id}.{DOMAIN}\r\ne2b-traffic-access-token: {traffic}\r\n"
    ));
    client.write_all(request.as_bytes()).await.unwrap();
    let exchange = async {
        let mut reader = BufReader::new(&mut client);
        let head = read_head(&mut reader).await;
        assert!(head[0].starts_with("HTTP/1.1 101"), "{head:?}");
        let stream = reader.into_inner();
        for word in [&b"ping"[..], b"\x81\x05hello"] {
            stream.write_all(word).await.unwrap();
            let mut back = vec![0u8; word.len()];
            stream.read_exact(&mut back).await.unwrap();
            assert_eq!(back, word);
        }
    };
    tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .expect("the upgraded connection echoes");
    drop(client);
    let head = tokio::time::timeout(Duration::from_secs(20), guest)
        .await
        .expect("the guest sees the end")
        .unwrap();
    let lower: Vec<String> = head.iter().map(|l| l.to_ascii_lowercase()).collect();
    assert!(
        lower.contains(&"upgrade: websocket".to_string()),
        "{head:?}"
    );
    assert!(
        lower.contains(&"connection: upgrade".to_string()),
        "{head:?}"
    );
}

#[tokio::test]
async fn traffic_wakes_a_hibernated_sandbox() {
    let rig = rig().await;
    let server = &rig.server;
    let (id, traffic) = (rig.id.as_str(), rig.traffic.as_str());
    let port = echo_server().await;
    let r = server
        .call("POST", &format!("/v1/sandboxes/{id}/hibernate"), None)
        .await;
    assert!(r.status < 300, "{}", r.text());
    let path = format!("/v1/sandboxes/{id}");
    let state = || async { server.call("GET", &path, None).await.json()["state"].clone() };
    assert_eq!(state().await, "hibernated");
    let host = format!("{port}-{id}.{DOMAIN}");
    seen_by_host(server, &host, traffic).await;
    assert_eq!(state().await, "running");
}

#[tokio::test]
async fn an_http2_request_reaches_the_guest_as_http1() {
    let rig = rig().await;
    let port = echo_server().await;
    // h2c with prior knowledge: the API's listener offers HTTP/2 too.
    let tcp = TcpStream::connect(rig.server.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let authority = format!("{port}-{}.{DOMAIN}", rig.id);
    let request = hyper::Request::get(format!("http://{authority}/h2?q=1"))
        .header("e2b-traffic-access-token", &rig.traffic)
        .body(http_body_util::Empty::<axum::body::Bytes>::new())
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(20), sender.send_request(request))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), hyper::Version::HTTP_2);
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    let seen: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(seen["line"], "GET /h2?q=1 HTTP/1.1", "{seen}");
    assert_eq!(seen["headers"]["host"], authority.as_str(), "{seen}");
}
