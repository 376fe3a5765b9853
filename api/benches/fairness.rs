//! Fairness under one tenant's long requests (issue 24, attack 9): tenant
//! `other`'s creates and execs through the API, timed while tenant `acme`
//! is idle, then while acme holds its most exec streams (the default 32)
//! and keeps asking for more (each refused with 429). The backend is the
//! API tests' in-memory fake (its `sleep` streams until its client goes),
//! so what is measured is the API's own share: routing, the gate, the
//! blocking pool, the stream slots. Prints one table; the ratio column is
//! busy / idle in one run.
//!
//! `cargo bench -p torpor-api --bench fairness [-- --quick]`

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../../benches/common/stats.rs"]
#[allow(dead_code)]
mod stats;

use std::time::{Duration, Instant};

use comfy_table::Table;
use common::{open_exec_stream, tenants_file, Server};
use tokio::io::BufReader;
use tokio::net::TcpStream;
use torpor_api::ApiConfig;

const ACME: &str = "acme-token-0123456789";
const OTHER: &str = "other-token-0123456789";

async fn call(server: &Server, token: &str, method: &str, path: &str, body: &str) -> u16 {
    server
        .request(
            method,
            path,
            &[
                ("Authorization", format!("Bearer {token}")),
                ("Content-Type", "application/json".into()),
            ],
            Some(body.as_bytes()),
        )
        .await
        .status
}

/// An exec stream of acme's kept open, or its refusal's status line.
async fn hold(server: &Server, id: &str) -> Result<BufReader<TcpStream>, String> {
    open_exec_stream(server.addr, ACME, id, &["sleep", "600"]).await
}

/// The `p` percentile of `samples`, in milliseconds.
fn percentile(samples: &[Duration], p: f64) -> f64 {
    let ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    stats::percentile(&ms, p)
}

/// `n` of other's creates and execs: their latencies, sorted.
async fn measure(server: &Server, sandbox: &str, n: usize) -> (Vec<Duration>, Vec<Duration>) {
    let (mut creates, mut execs) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = Instant::now();
        let r = server
            .request(
                "POST",
                "/v1/sandboxes",
                &[
                    ("Authorization", format!("Bearer {OTHER}")),
                    ("Content-Type", "application/json".into()),
                ],
                Some(br#"{"template":"probe","metadata":{"agent":"fake"}}"#),
            )
            .await;
        creates.push(t.elapsed());
        assert_eq!(r.status, 201, "{}", r.text());
        // Deleted again (not timed): the fake pod's memory stays free.
        let made = r.json()["id"].as_str().unwrap().to_string();
        assert_eq!(
            call(
                server,
                OTHER,
                "DELETE",
                &format!("/v1/sandboxes/{made}"),
                ""
            )
            .await,
            204
        );
        let t = Instant::now();
        let s = call(
            server,
            OTHER,
            "POST",
            &format!("/v1/sandboxes/{sandbox}/exec"),
            r#"{"argv":["echo","hi"]}"#,
        )
        .await;
        assert_eq!(s, 200);
        execs.push(t.elapsed());
    }
    creates.sort();
    execs.sort();
    (creates, execs)
}

fn main() {
    // `cargo test --all-targets` runs this without `--bench`: a smoke run.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let smoke = !args.iter().any(|a| a == "--bench");
    let quick = smoke || args.iter().any(|a| a == "--quick");
    let n = if quick { 20 } else { 200 };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let scratch = tempfile::tempdir().unwrap();
        let tenants = tenants_file(scratch.path(), &[("acme", ACME), ("other", OTHER)]);
        let mut config = ApiConfig {
            tenants_file: Some(tenants),
            ..Server::config()
        };
        // The per-token request rate is not what is measured here: out of
        // the way, so other's back-to-back creates are never refused.
        config.rate_limit.per_second = 1e6;
        config.rate_limit.burst = 1_000_000;
        let limit = config.rate_limit.streams_per_tenant;
        let server = Server::start_with(config).await;
        let mine = server.sandbox_as(ACME).await;
        let theirs = server.sandbox_as(OTHER).await;

        let idle = measure(&server, &theirs, n).await;
        let mut held = Vec::new();
        for _ in 0..limit {
            held.push(hold(&server, &mine).await.expect("within acme's slots"));
        }
        // acme keeps knocking for more while other works.
        let knocking = {
            let addr = server.addr;
            let mine = mine.clone();
            tokio::spawn(async move {
                let (mut refused, mut tries) = (0u32, 0u32);
                let deadline = Instant::now() + Duration::from_secs(600);
                while Instant::now() < deadline && tries < 2000 {
                    let status = match open_exec_stream(addr, ACME, &mine, &["sleep", "600"]).await
                    {
                        Ok(_) => String::new(),
                        Err(status) => status,
                    };
                    tries += 1;
                    refused += u32::from(status.contains(" 429 "));
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                (refused, tries)
            })
        };
        let busy = measure(&server, &theirs, n).await;
        knocking.abort();
        drop(held);

        let mut table = Table::new();
        table.set_header(vec![
            "other's request",
            "acme idle p50 ms",
            "p99 ms",
            &format!("acme at {limit} streams p50 ms"),
            "p99 ms",
            "p50 ratio",
        ]);
        for (name, a, b) in [("create", &idle.0, &busy.0), ("exec", &idle.1, &busy.1)] {
            table.add_row(vec![
                name.to_string(),
                format!("{:.2}", percentile(a, 0.5)),
                format!("{:.2}", percentile(a, 0.99)),
                format!("{:.2}", percentile(b, 0.5)),
                format!("{:.2}", percentile(b, 0.99)),
                format!("{:.2}", percentile(b, 0.5) / percentile(a, 0.5)),
            ]);
        }
        println!("fairness: {n} creates and {n} execs of tenant other, each case (fake backend)");
        println!("{table}");
    });
}
