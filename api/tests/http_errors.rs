//! Auth, routing, malformed and oversized requests, limits: a real server on
//! loopback over the in-memory fake, spoken to in raw HTTP/1.1.

mod common;

use std::time::Duration;

use common::{Server, OTHER_TOKEN, TOKEN};
use serde_json::{json, Value};
use torpor_api::{ApiConfig, ROUTES};

#[tokio::test]
async fn health_and_openapi_need_no_token() {
    let server = Server::start().await;
    let r = server.request("GET", "/healthz", &[], None).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "ok");

    let r = server.request("GET", "/v1/openapi.json", &[], None).await;
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let doc = r.json();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    let served: Value = serde_json::from_str(torpor_api::openapi::text()).unwrap();
    assert_eq!(doc, served);
    // Every documented path is served.
    for route in ROUTES {
        assert!(doc["paths"][route.path][route.method.to_lowercase()].is_object());
    }
}

#[tokio::test]
async fn tokens_are_checked_on_every_other_route() {
    let server = Server::start().await;
    let bad_headers: [&[(&str, String)]; 6] = [
        &[],
        &[("Authorization", "Bearer wrong".into())],
        &[("Authorization", format!("Bearer {TOKEN}x"))],
        &[("Authorization", TOKEN[..TOKEN.len() - 1].to_string())],
        &[("Authorization", format!("Basic {TOKEN}"))],
        &[("Authorization", "Bearer ".into())],
    ];
    for headers in bad_headers {
        let r = server.request("GET", "/v1/sandboxes", headers, None).await;
        r.assert_error(401, "unauthorized");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{headers:?}");
    }
    for token in [TOKEN, OTHER_TOKEN] {
        let auth = [("Authorization", format!("Bearer {token}"))];
        let r = server.request("GET", "/v1/sandboxes", &auth, None).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json(), json!({"sandboxes": []}));
    }
    // The scheme is case-insensitive.
    let auth = [("Authorization", format!("bearer {TOKEN}"))];
    let r = server.request("GET", "/v1/pods", &auth, None).await;
    assert_eq!(r.status, 200);

    // Every authenticated route refuses before it reads a body or an id.
    for route in ROUTES.iter().filter(|r| r.auth) {
        let path = route.path.replace("{id}", "sbx_0000000000000000");
        let r = server
            .request(
                route.method,
                &path,
                &[("Content-Type", "application/json".into())],
                Some(b"{not json"),
            )
            .await;
        r.assert_error(401, "unauthorized");
    }
}

#[tokio::test]
async fn metrics_need_a_token_and_are_prometheus_text() {
    let server = Server::start().await;
    let r = server.request("GET", "/metrics", &[], None).await;
    r.assert_error(401, "unauthorized");
    let r = server.call("GET", "/metrics", None).await;
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    assert!(
        r.text().contains("torpor_sandboxes{state=\"running\"} 0"),
        "{}",
        r.text()
    );
}

/// The route table is what the router serves: every entry answers with
/// something other than "no route" or "method not allowed".
#[tokio::test]
async fn every_listed_route_is_routed() {
    let server = Server::start().await;
    for route in ROUTES {
        let path = route.path.replace("{id}", "sbx_0000000000000000");
        let body = matches!(route.method, "POST" | "PUT" | "PATCH").then(|| json!({}));
        let r = server.call(route.method, &path, body).await;
        assert_ne!(r.status, 405, "{} {}", route.method, route.path);
        if r.status == 404 {
            let message = r.json()["error"]["message"].as_str().unwrap().to_string();
            assert!(
                !message.starts_with("no route"),
                "{} {}",
                route.method,
                route.path
            );
        }
    }
}

#[tokio::test]
async fn unknown_routes_and_methods_get_the_error_body() {
    let server = Server::start().await;
    let r = server.call("GET", "/v1/nothing-here", None).await;
    let e = r.assert_error(404, "not_found");
    assert!(e["message"].as_str().unwrap().contains("/v1/nothing-here"));
    // Unknown routes say 404 with or without a token. (`/v2/sandboxes` is
    // E2B's: see e2b_routes.)
    let r = server.request("GET", "/v3/sandboxes", &[], None).await;
    r.assert_error(404, "not_found");

    let r = server.call("PUT", "/v1/sandboxes", Some(json!({}))).await;
    r.assert_error(405, "method_not_allowed");
    let allow = r.header("allow").expect("Allow header kept");
    assert!(allow.contains("GET") && allow.contains("POST"), "{allow}");
    let r = server.call("DELETE", "/healthz", None).await;
    r.assert_error(405, "method_not_allowed");
}

#[tokio::test]
async fn malformed_json_is_400_with_the_parser_message() {
    let server = Server::start().await;
    let auth = |ct: &str| {
        vec![
            ("Authorization", format!("Bearer {TOKEN}")),
            ("Content-Type", ct.to_string()),
        ]
    };
    let json_headers = auth("application/json");

    let r = server
        .request(
            "POST",
            "/v1/sandboxes",
            &json_headers,
            Some(b"{\"template\": "),
        )
        .await;
    let e = r.assert_error(400, "invalid_request");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .to_lowercase()
            .contains("eof"),
        "{e}"
    );

    let r = server
        .request("POST", "/v1/sandboxes", &json_headers, Some(b"[1,2"))
        .await;
    r.assert_error(400, "invalid_request");

    // Well-formed, wrong shape: a mistyped field, a missing one, an unknown one.
    for body in [
        json!({"template": 7}),
        json!({"mem_mib": 64}),
        json!({"template": "probe", "memory": 64}),
        json!({"template": "probe", "mem_mib": -1}),
    ] {
        let r = server
            .call("POST", "/v1/sandboxes", Some(body.clone()))
            .await;
        let e = r.assert_error(400, "invalid_request");
        assert!(e.get("state").is_none(), "{body}: {e}");
    }
    for body in [
        json!({}),
        json!({"ratio": 2.0}),
        json!({"oversubscription_ratio": "2"}),
    ] {
        let r = server.call("PATCH", "/v1/pods/pod_local", Some(body)).await;
        r.assert_error(400, "invalid_request");
    }
    let r = server
        .call("PATCH", "/v1/sandboxes/sbx_1", Some(json!({})))
        .await;
    r.assert_error(400, "invalid_request");

    // A JSON body needs the JSON content type.
    let r = server
        .request(
            "POST",
            "/v1/sandboxes",
            &auth("text/plain"),
            Some(b"{\"template\":\"probe\"}"),
        )
        .await;
    r.assert_error(415, "unsupported_media_type");
    let no_type = [("Authorization", format!("Bearer {TOKEN}"))];
    let r = server
        .request("POST", "/v1/templates", &no_type, Some(b"{}"))
        .await;
    r.assert_error(415, "unsupported_media_type");

    // A bad query.
    let r = server.call("GET", "/v1/sandboxes?state=sleepy", None).await;
    let e = r.assert_error(400, "invalid_request");
    assert!(e["message"].as_str().unwrap().contains("sleepy"));
    let r = server.call("GET", "/v1/sandboxes?colour=red", None).await;
    r.assert_error(400, "invalid_request");
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let server = Server::start_with(ApiConfig {
        max_body_bytes: 1024,
        ..Server::config()
    })
    .await;
    let padding = "x".repeat(2048);
    let body = json!({"template": "probe", "metadata": {"pad": padding}});

    // Declared too large: refused from the headers alone (no body sent).
    let raw = format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
         Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n\
         Content-Length: 5000000\r\n\r\n"
    );
    let r = server.raw(raw.as_bytes()).await;
    r.assert_error(413, "payload_too_large");

    // Declared, sent, too large.
    let r = server
        .call("POST", "/v1/sandboxes", Some(body.clone()))
        .await;
    r.assert_error(413, "payload_too_large");

    // Chunked, no length declared: refused while reading.
    let text = body.to_string();
    let raw = format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\
         Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n{:x}\r\n{text}\r\n0\r\n\r\n",
        text.len()
    );
    let r = server.raw(raw.as_bytes()).await;
    r.assert_error(413, "payload_too_large");
    assert!(server.fake.state.lock().unwrap().sandboxes.is_empty());

    // Under the limit is fine.
    let r = server
        .call("POST", "/v1/sandboxes", Some(json!({"template": "probe"})))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
}

#[tokio::test]
async fn slow_requests_time_out_with_504() {
    let server = Server::start_with(ApiConfig {
        request_timeout: Duration::from_millis(200),
        ..Server::config()
    })
    .await;
    let body = json!({"template": "probe", "metadata": {"sleep_ms": "1000"}});
    let r = server.call("POST", "/v1/sandboxes", Some(body)).await;
    let e = r.assert_error(504, "timeout");
    assert!(e["message"]
        .as_str()
        .unwrap()
        .contains("may still complete"));
    // The operation ran on to its end.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(server.fake.state.lock().unwrap().sandboxes.len(), 1);
}

#[tokio::test]
async fn a_panicking_service_call_is_500_and_the_server_lives_on() {
    let server = Server::start().await;
    let body = json!({"name": "panic", "kind": "probe", "mem_mib": 64, "vcpus": 1});
    let r = server.call("POST", "/v1/templates", Some(body)).await;
    r.assert_error(500, "internal");
    let r = server.call("GET", "/v1/templates", None).await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn no_configured_token_locks_every_authenticated_route() {
    let server = Server::start_with(ApiConfig::default()).await;
    let r = server.call("GET", "/v1/sandboxes", None).await;
    r.assert_error(401, "unauthorized");
    let r = server.request("GET", "/healthz", &[], None).await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn serve_stops_on_shutdown() {
    let server = Server::start().await;
    let r = server.request("GET", "/healthz", &[], None).await;
    assert_eq!(r.status, 200);
    let addr = server.addr;
    server.shutdown().await.unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
