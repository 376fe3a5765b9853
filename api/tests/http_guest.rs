//! Exec and files through HTTP over the fake service: request checks,
//! error statuses, the NDJSON stream, raw file bodies, and the `resumed`
//! report when a request wakes a hibernated sandbox.

mod common;

use common::Server;
use serde_json::{json, Value};

#[tokio::test]
async fn exec_and_files_on_a_sandbox_without_agent_are_422_no_agent() {
    let server = Server::start().await;
    let id = server.sandbox(false).await;
    for (method, path, body) in [
        (
            "POST",
            format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"argv": ["true"]})),
        ),
        (
            "POST",
            format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"argv": ["true"]})),
        ),
        (
            "GET",
            format!("/v1/sandboxes/{id}/files?path=/etc/hostname"),
            None,
        ),
        ("GET", format!("/v1/sandboxes/{id}/files/list?path=/"), None),
    ] {
        let r = server.call(method, &path, body.clone()).await;
        let e = r.assert_error(422, "no_agent");
        assert!(
            e["message"].as_str().unwrap().contains("no guest agent"),
            "{e}"
        );
        // Still behind the token.
        let r = server.request(method, &path, &[], None).await;
        r.assert_error(401, "unauthorized");
    }
    let r = server
        .call(
            "POST",
            "/v1/sandboxes/sbx_nope/exec",
            Some(json!({"argv": ["true"]})),
        )
        .await;
    r.assert_error(404, "not_found");
}

#[tokio::test]
async fn bad_exec_bodies_and_file_queries_are_400() {
    let server = Server::start().await;
    let id = server.sandbox(true).await;
    let exec = format!("/v1/sandboxes/{id}/exec");
    for bad in [
        json!({"argv": []}),
        json!({"argv": [""]}),
        json!({}),
        json!({"argv": ["cat"], "stdin_base64": "%%%"}),
        json!({"argv": ["cat"], "stdin": "a", "stdin_base64": "YQ=="}),
        json!({"cmd": ["true"]}),
    ] {
        for path in [exec.clone(), format!("{exec}/stream")] {
            let r = server.call("POST", &path, Some(bad.clone())).await;
            r.assert_error(400, "invalid_request");
        }
    }
    for query in [
        "",
        "?path=relative",
        "?path=/a&mode=99x",
        "?path=/a&bogus=1",
    ] {
        let r = server
            .call("GET", &format!("/v1/sandboxes/{id}/files{query}"), None)
            .await;
        r.assert_error(400, "invalid_request");
    }
}

#[tokio::test]
async fn exec_answers_output_and_wakes_a_hibernated_sandbox() {
    let server = Server::start().await;
    let id = server.sandbox(true).await;
    let r = server
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"argv": ["echo", "hi", "there"]})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["stdout"], "hi there\n");
    assert_eq!(v["encoding"], "utf-8");
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["resumed"], false);

    // Hibernated: the request wakes it and says so.
    let r = server
        .call("POST", &format!("/v1/sandboxes/{id}/hibernate"), None)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = server
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"argv": ["echo"]})),
        )
        .await;
    let v = r.json();
    assert_eq!(v["resumed"], true, "{v}");
    assert_eq!(v["resume_ms"], 3.5);

    // The agent's ENOENT is a 404.
    let r = server
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"argv": ["nope"]})),
        )
        .await;
    r.assert_error(404, "not_found");
}

#[tokio::test]
async fn exec_stream_is_ndjson_start_chunks_exit() {
    let server = Server::start().await;
    let id = server.sandbox(true).await;
    let r = server
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"argv": ["echo", "a", "b"]})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    let lines: Vec<Value> = r
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let types: Vec<&str> = lines.iter().map(|l| l["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        ["start", "stdout", "stdout", "stderr", "exit"],
        "{lines:?}"
    );
    assert_eq!(lines[0]["resumed"], false);
    assert_eq!(lines[1]["data"], "YQo="); // "a\n"
    assert_eq!(lines[2]["data"], "Ygo="); // "b\n"
    assert_eq!(lines[4]["exit_code"], 3);
    // An agent error before the command starts is a plain error answer.
    let r = server
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"argv": ["nope"]})),
        )
        .await;
    r.assert_error(404, "not_found");
}

#[tokio::test]
async fn files_put_get_list_with_raw_bodies() {
    let server = Server::start().await;
    let id = server.sandbox(true).await;
    let auth = vec![("Authorization", format!("Bearer {}", common::TOKEN))];
    let data: Vec<u8> = (0..=255u8).collect();
    let r = server
        .request(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path=/work/a.bin&mode=600"),
            &auth,
            Some(&data),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["size"], 256);
    let r = server
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=%2Fwork%2Fa.bin"),
            None,
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, data);
    assert_eq!(r.header("content-type"), Some("application/octet-stream"));
    assert_eq!(r.header("x-torpor-resumed"), Some("false"));
    let r = server
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/files/list?path=/work"),
            None,
        )
        .await;
    let v = r.json();
    assert_eq!(v["entries"][0]["name"], "a.bin", "{v}");
    assert_eq!(v["entries"][0]["size"], 256);
    let r = server
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=/work/missing"),
            None,
        )
        .await;
    r.assert_error(404, "not_found");
}
