//! The guest-port proxy's cost per request (issue 27): the same small GET
//! straight to a "guest" HTTP server on this host's loopback (the floor,
//! no proxy), and through torpor's port proxy by E2B's headers
//! (`E2b-Sandbox-Id`/`E2b-Sandbox-Port`) and by host name
//! (`{port}-{id}.{domain}`), with the traffic token; envd's own round trip
//! on the same listener (`GET /health`, answered by the API, and a small
//! `GET /files`, one call to the agent); a new connection per request
//! against keep-alive; a WebSocket echo after one upgrade; and one
//! streamed 10 MiB response, direct and proxied. p50/p99 per row and the
//! p50 as a multiple of the direct row of the same kind of connection.
//!
//! The rig is `tests/http_e2b_ports.rs`'s (`tests/common/ports.rs`): the
//! API's in-memory fake backend, a sandbox whose agent is a real
//! torpor-agent on this host behind the hybrid vsock stand-in (as a VMM's
//! vsock would splice it), so the "guest" is this host and everything
//! (client, API, agent, guest servers) runs in this one process. The
//! client is hyper 1's HTTP/1.1 connection API, one connection per row
//! kept alive and reused as a pooled client (reqwest, httpx) would;
//! requests of all rows interleave, round by round, so machine noise
//! falls on each alike.
//!
//! `cargo bench -p torpor-api --bench ports [-- --rounds N]` (default
//! 200; 5 warm-up rounds first). Without `--bench` (`cargo test
//! --all-targets`) a smoke run: 5 rounds, a 1 MiB response.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../../benches/common/stats.rs"]
mod stats;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use common::ports::{
    echo_server, guest_port, read_head, rig_with, websocket_echo, websocket_request, Rig, DOMAIN,
};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use stats::{median, percentile};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use torpor_scheduler::model::{SandboxId, VmmHandle};

/// envd's port.
const ENVD_PORT: u16 = 49983;
/// Warm-up rounds, not recorded.
const WARM: usize = 5;
/// Every request or exchange ends within this.
const LIMIT: Duration = Duration::from_secs(30);
/// The WebSocket message: a masked 26-byte text frame, 32 bytes.
const FRAME: &[u8; 32] = b"\x81\x9a\x01\x02\x03\x04abcdefghijklmnopqrstuvwxyz";

type Sender = SendRequest<Empty<Bytes>>;

/// A kept-alive HTTP/1.1 connection to `addr`.
async fn open(addr: SocketAddr) -> Sender {
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

/// `GET path` with these headers (`Host` among them) on `sender`; the
/// body's length, read to its end. Panics unless 2xx.
async fn get(sender: &mut Sender, path: &str, headers: &[(&str, String)]) -> usize {
    let exchange = async {
        sender.ready().await.unwrap();
        let mut request = hyper::Request::get(path);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let response = sender
            .send_request(request.body(Empty::new()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let mut body = response.into_body();
        let mut n = 0;
        let mut text = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                n += data.len();
                if !status.is_success() && text.len() < 4096 {
                    text.extend_from_slice(&data);
                }
            }
        }
        assert!(
            status.is_success(),
            "GET {path}: {status} {}",
            String::from_utf8_lossy(&text)
        );
        n
    };
    tokio::time::timeout(LIMIT, exchange)
        .await
        .unwrap_or_else(|_| panic!("GET {path} within {LIMIT:?}"))
}

/// An upgraded WebSocket connection to `addr` with these header lines.
async fn upgrade(addr: SocketAddr, headers: &str) -> BufReader<TcpStream> {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    tcp.write_all(websocket_request(headers).as_bytes())
        .await
        .unwrap();
    let mut reader = BufReader::new(tcp);
    let head = read_head(&mut reader).await;
    assert!(
        head.first().is_some_and(|l| l.starts_with("HTTP/1.1 101")),
        "{head:?}"
    );
    reader
}

/// One frame out and its echo back.
async fn echo(ws: &mut BufReader<TcpStream>) {
    let exchange = async {
        ws.get_mut().write_all(FRAME).await.unwrap();
        let mut back = [0u8; FRAME.len()];
        ws.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, FRAME);
    };
    tokio::time::timeout(LIMIT, exchange)
        .await
        .expect("the echo within the limit");
}

/// What connection a row's requests use.
#[derive(Clone, Copy, PartialEq)]
enum Conn {
    KeptAlive,
    New,
    Upgraded,
}

impl Conn {
    fn name(self) -> &'static str {
        match self {
            Conn::KeptAlive => "kept alive",
            Conn::New => "new per request",
            Conn::Upgraded => "upgraded once",
        }
    }
}

/// The rows, in the table's order.
#[derive(Clone, Copy, PartialEq)]
enum Row {
    Direct,
    ByHeaders,
    ByHost,
    EnvdHealth,
    EnvdFile,
    DirectNew,
    ByHeadersNew,
    WsDirect,
    WsProxied,
}

const ROWS: [Row; 9] = [
    Row::Direct,
    Row::ByHeaders,
    Row::ByHost,
    Row::EnvdHealth,
    Row::EnvdFile,
    Row::DirectNew,
    Row::ByHeadersNew,
    Row::WsDirect,
    Row::WsProxied,
];

impl Row {
    fn name(self) -> &'static str {
        match self {
            Row::Direct | Row::DirectNew => "GET, direct to the guest server (floor)",
            Row::ByHeaders | Row::ByHeadersNew => {
                "GET via proxy, E2b-Sandbox-Id/-Port headers + traffic token"
            }
            Row::ByHost => "GET via proxy, Host {port}-{id}.{domain} + traffic token",
            Row::EnvdHealth => "envd GET /health (Host 49983-{id}.{domain})",
            Row::EnvdFile => "envd GET /files, 16 B file (one agent call)",
            Row::WsDirect => "WebSocket 32 B echo, direct (floor)",
            Row::WsProxied => "WebSocket 32 B echo via proxy, by host name",
        }
    }

    fn conn(self) -> Conn {
        match self {
            Row::DirectNew | Row::ByHeadersNew => Conn::New,
            Row::WsDirect | Row::WsProxied => Conn::Upgraded,
            _ => Conn::KeptAlive,
        }
    }

    /// The row its p50 is divided by.
    fn floor(self) -> Row {
        match self.conn() {
            Conn::KeptAlive => Row::Direct,
            Conn::New => Row::DirectNew,
            Conn::Upgraded => Row::WsDirect,
        }
    }
}

/// The connections and the headers of every row.
struct Bench {
    guest: SocketAddr,
    api: SocketAddr,
    direct: Sender,
    proxy: Sender,
    /// The `Host` of a direct request.
    guest_host: String,
    /// Headers naming the guest port by E2B's headers, and by host name.
    by_headers: Vec<(&'static str, String)>,
    by_host: Vec<(&'static str, String)>,
    /// envd by host name, with the envd token.
    envd: Vec<(&'static str, String)>,
    file_path: String,
    ws_direct: BufReader<TcpStream>,
    ws_proxied: BufReader<TcpStream>,
}

impl Bench {
    async fn new(rig: &Rig) -> Bench {
        let port = echo_server().await;
        let guest: SocketAddr = ([127, 0, 0, 1], port).into();
        let api = rig.server.addr;
        let traffic = ("E2B-Traffic-Access-Token", rig.traffic.clone());
        let by_headers = vec![
            ("Host", api.to_string()),
            ("E2b-Sandbox-Id", rig.id.clone()),
            ("E2b-Sandbox-Port", port.to_string()),
            traffic.clone(),
        ];
        let by_host = vec![
            ("Host", format!("{port}-{}.{DOMAIN}", rig.id)),
            traffic.clone(),
        ];
        let envd = vec![
            ("Host", format!("{ENVD_PORT}-{}.{DOMAIN}", rig.id)),
            ("X-Access-Token", rig.envd.clone()),
        ];
        let file = rig.scratch.path().join("small");
        std::fs::write(&file, [b'f'; 16]).unwrap();
        let (direct_ws, direct_ws_port) = guest_port().await;
        let (proxied_ws, proxied_ws_port) = guest_port().await;
        // Each serves its one connection for the rest of the run.
        drop(websocket_echo(direct_ws));
        drop(websocket_echo(proxied_ws));
        let ws_direct = upgrade(
            ([127, 0, 0, 1], direct_ws_port).into(),
            &format!("host: 127.0.0.1:{direct_ws_port}\r\n"),
        )
        .await;
        let ws_proxied = upgrade(
            api,
            &format!(
                "host: {proxied_ws_port}-{}.{DOMAIN}\r\ne2b-traffic-access-token: {}\r\n",
                rig.id, rig.traffic
            ),
        )
        .await;
        Bench {
            guest,
            api,
            direct: open(guest).await,
            proxy: open(api).await,
            guest_host: guest.to_string(),
            by_headers,
            by_host,
            envd,
            file_path: format!("/files?path={}", file.display()),
            ws_direct,
            ws_proxied,
        }
    }

    /// One request (or exchange) of `row`.
    async fn once(&mut self, row: Row) {
        let host = vec![("Host", self.guest_host.clone())];
        match row {
            Row::Direct => {
                get(&mut self.direct, "/", &host).await;
            }
            Row::ByHeaders => {
                get(&mut self.proxy, "/", &self.by_headers).await;
            }
            Row::ByHost => {
                get(&mut self.proxy, "/", &self.by_host).await;
            }
            Row::EnvdHealth => {
                get(&mut self.proxy, "/health", &self.envd).await;
            }
            Row::EnvdFile => {
                let n = get(&mut self.proxy, &self.file_path, &self.envd).await;
                assert_eq!(n, 16);
            }
            Row::DirectNew => {
                get(&mut open(self.guest).await, "/", &host).await;
            }
            Row::ByHeadersNew => {
                get(&mut open(self.api).await, "/", &self.by_headers).await;
            }
            Row::WsDirect => echo(&mut self.ws_direct).await,
            Row::WsProxied => echo(&mut self.ws_proxied).await,
        }
    }

    /// One `GET /bytes/{n}`, direct or by headers through the proxy,
    /// on the kept-alive connection: its time.
    async fn stream(&mut self, n: usize, proxied: bool) -> Duration {
        let path = format!("/bytes/{n}");
        let t = Instant::now();
        let got = if proxied {
            get(&mut self.proxy, &path, &self.by_headers).await
        } else {
            let host = vec![("Host", self.guest_host.clone())];
            get(&mut self.direct, &path, &host).await
        };
        let took = t.elapsed();
        assert_eq!(got, n);
        took
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let smoke = !args.iter().any(|a| a == "--bench");
    let rounds: usize = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(if smoke { 5 } else { 200 });
    let (stream_bytes, streams) = if smoke { (1 << 20, 1) } else { (10 << 20, 5) };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let rig = rig_with(|config| {
            // The per-token request rate is not what is measured.
            config.rate_limit.per_second = 1e6;
            config.rate_limit.burst = 1_000_000;
        })
        .await;
        // envd's `/health` answers 204 for a sandbox with a VMM: the fake
        // records none, so one is written in (nothing signals it).
        rig.server
            .fake
            .state
            .lock()
            .unwrap()
            .sandboxes
            .get_mut(&SandboxId::new(&rig.id))
            .unwrap()
            .vmm = Some(VmmHandle {
            pid: std::process::id(),
            start_time: None,
            control_socket: rig.scratch.path().join("none.sock"),
        });
        let mut bench = Bench::new(&rig).await;
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); ROWS.len()];
        for round in 0..WARM + rounds {
            for (i, &row) in ROWS.iter().enumerate() {
                let t = Instant::now();
                bench.once(row).await;
                if round >= WARM {
                    samples[i].push(ms(t.elapsed()));
                }
            }
        }
        let p50 = |row: Row| median(samples[ROWS.iter().position(|r| *r == row).unwrap()].clone());
        let mut table = Table::new();
        table.load_style(UTF8_FULL_CONDENSED).set_header([
            "request",
            "connection",
            "n",
            "p50 ms",
            "p99 ms",
            "p50 ÷ direct",
        ]);
        for (i, &row) in ROWS.iter().enumerate() {
            let v = &samples[i];
            table.add_row([
                row.name().to_string(),
                row.conn().name().to_string(),
                v.len().to_string(),
                format!("{:.3}", median(v.clone())),
                format!("{:.3}", percentile(v, 0.99)),
                format!("{:.2}", median(v.clone()) / p50(row.floor())),
            ]);
        }

        // The streamed response, direct and proxied alternately.
        let (mut direct, mut proxied) = (Vec::new(), Vec::new());
        for _ in 0..streams + 1 {
            direct.push(ms(bench.stream(stream_bytes, false).await));
            proxied.push(ms(bench.stream(stream_bytes, true).await));
        }
        // The first of each warms up.
        let (direct, proxied) = (&direct[1..], &proxied[1..]);
        let mb_s = |v: &[f64]| stream_bytes as f64 / 1e6 / (median(v.to_vec()) / 1000.0);
        let mut streamed = Table::new();
        streamed.load_style(UTF8_FULL_CONDENSED).set_header([
            format!("one {} MiB response (kept alive)", stream_bytes >> 20),
            "n".into(),
            "p50 ms".into(),
            "MB/s at p50".into(),
            "÷ direct".into(),
        ]);
        for (name, v) in [
            ("direct to the guest server", direct),
            ("via proxy, by headers", proxied),
        ] {
            streamed.add_row([
                name.to_string(),
                v.len().to_string(),
                format!("{:.1}", median(v.to_vec())),
                format!("{:.0}", mb_s(v)),
                format!("{:.2}", mb_s(v) / mb_s(direct)),
            ]);
        }
        println!(
            "ports: {rounds} rounds (+{WARM} warm-up), rows interleaved; hyper 1 HTTP/1.1 \
             client; fake backend, real agent in this process{}",
            if smoke {
                " (smoke run: pass --bench)"
            } else {
                ""
            }
        );
        println!("{table}\n{streamed}");
    });
}
