//! The agent tunnel (`POST /v1/sandboxes/{id}/agent`, `Upgrade:
//! torpor-agent`): the API server's dialer reaches a real torpor-agent
//! (behind the hybrid vsock stand-in) through a pod's API and runs the
//! agent protocol over it; what the pod refuses (no upgrade, a tenant's
//! token, an unknown sandbox) never becomes a stream.

mod common;

use common::{Server, TOKEN};
use serde_json::json;
use torpor_api::auth::tokens::TenantsFile;
use torpor_api::auth::Scope;
use torpor_api::pods::tunnel::{dialer, PodLine};
use torpor_api::ApiConfig;
use torpor_client::Endpoint;
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::{AgentLink, GuestError};

const TENANT: &str = "tenant-token-acme-0123456789";

/// A sandbox with the real agent, made through E2B's create.
async fn real_agent_sandbox(server: &Server) -> String {
    let body = json!({"templateID": "probe", "metadata": {"agent": "real"}}).to_string();
    let h = vec![
        ("X-API-KEY", TOKEN.to_string()),
        ("Content-Type", "application/json".to_string()),
    ];
    let r = server
        .request("POST", "/v2/sandboxes", &h, Some(body.as_bytes()))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["sandboxID"].as_str().unwrap().to_string()
}

/// Runs `argv` in sandbox `id` through the tunnel, with `token`.
async fn exec_through(
    server: &Server,
    token: &str,
    id: &str,
    argv: &[&str],
) -> Result<torpor_scheduler::service::guest::ExecOutput, GuestError> {
    let line = PodLine {
        endpoint: Endpoint::parse(&format!("tcp:{}", server.addr)).unwrap(),
        token: token.to_string(),
        pin: None,
    };
    let runtime = tokio::runtime::Handle::current();
    let id = id.to_string();
    let argv: Vec<String> = argv.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let dial = dialer(runtime, line, SandboxId::new(&id));
        let link = AgentLink::dialed(id.as_str(), "the test pod", dial);
        link.exec(
            torpor_scheduler::service::guest::ExecRequest {
                argv,
                timeout_ms: Some(10_000),
                ..Default::default()
            },
            &Default::default(),
        )
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_protocol_runs_through_a_pods_tunnel() {
    let scratch = tempfile::tempdir().unwrap();
    let tenants = scratch.path().join("tenants.json");
    let mut file = TenantsFile::default();
    file.import("acme", Scope::Tenant, TENANT).unwrap();
    file.save(&tenants).unwrap();
    let server = Server::start_with(ApiConfig {
        tenants_file: Some(tenants),
        ..Server::config()
    })
    .await;
    let id = real_agent_sandbox(&server).await;

    // Several calls, one tunnel each, with output both ways and the exit
    // status.
    for i in 0..3 {
        let script = format!("echo through-the-tunnel-{i}; echo err >&2; exit {i}");
        let out = exec_through(&server, TOKEN, &id, &["sh", "-c", &script])
            .await
            .unwrap_or_else(|e| panic!("exec {i} through the tunnel: {e}"));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("through-the-tunnel-{i}\n")
        );
        assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
        assert_eq!(out.exit.code, Some(i));
    }

    // A tenant's token is not a pod's: 403, no stream.
    let e = exec_through(&server, TENANT, &id, &["true"])
        .await
        .unwrap_err();
    assert!(
        matches!(&e, GuestError::Unreachable { reason, .. } if reason.contains("403")),
        "{e}"
    );
    // An unknown sandbox: 404, no stream.
    let e = exec_through(&server, TOKEN, "sbx_00000000000000ff", &["true"])
        .await
        .unwrap_err();
    assert!(
        matches!(&e, GuestError::Unreachable { reason, .. } if reason.contains("404")),
        "{e}"
    );
    // Without the upgrade headers the route is a plain 400.
    let h = vec![("Authorization", format!("Bearer {TOKEN}"))];
    let r = server
        .request("POST", &format!("/v1/sandboxes/{id}/agent"), &h, None)
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
}
