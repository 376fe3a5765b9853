//! The guest-port rig (`tests/http_e2b_ports.rs`, `benches/ports.rs`): a
//! server with tenants and the ports domain, a sandbox of acme's whose
//! agent is a real torpor-agent on this host (so its "guest" is this
//! host: a guest port is a port on this host's loopback), and small
//! "guest" servers on free loopback ports.

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use torpor_api::ApiConfig;

use super::{tenants_file, Server};

/// `serve --proxy-domain` of the rig.
pub const DOMAIN: &str = "sbx.test";
/// The tenant whose sandbox the rig makes.
pub const ACME: &str = "acme-key-0123456789";
/// Another tenant.
pub const UMBRELLA: &str = "umbrella-key-0123456789";

/// A server with the tenants acme and umbrella and the ports domain,
/// `tune` applied to its config.
pub async fn server(scratch: &tempfile::TempDir, tune: impl FnOnce(&mut ApiConfig)) -> Server {
    let tenants = tenants_file(scratch.path(), &[("acme", ACME), ("umbrella", UMBRELLA)]);
    let mut config = ApiConfig {
        tenants_file: Some(tenants),
        proxy_domain: Some(DOMAIN.into()),
        ..Server::config()
    };
    tune(&mut config);
    Server::start_with(config).await
}

/// A sandbox of acme with the real agent, made through E2B's create: its
/// create answer.
pub async fn sandbox(server: &Server) -> Value {
    let body = json!({"templateID": "probe", "metadata": {"agent": "real"}}).to_string();
    let h = vec![
        ("X-API-KEY", ACME.to_string()),
        ("Content-Type", "application/json".to_string()),
    ];
    let r = server
        .request("POST", "/v2/sandboxes", &h, Some(body.as_bytes()))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()
}

/// A server, acme's sandbox on it (its id, envd and traffic tokens), and
/// the scratch directory the tenants file is in.
pub struct Rig {
    pub server: Server,
    pub id: String,
    pub envd: String,
    pub traffic: String,
    pub scratch: tempfile::TempDir,
}

/// The rig with the default config.
pub async fn rig() -> Rig {
    rig_with(|_| {}).await
}

/// The rig, `tune` applied to the server's config.
pub async fn rig_with(tune: impl FnOnce(&mut ApiConfig)) -> Rig {
    let scratch = tempfile::tempdir().unwrap();
    let server = server(&scratch, tune).await;
    let created = sandbox(&server).await;
    assert_eq!(created["domain"], DOMAIN, "{created}");
    let field = |k: &str| str_of(&created, k).to_string();
    Rig {
        id: field("sandboxID"),
        envd: field("envdAccessToken"),
        traffic: field("trafficAccessToken"),
        server,
        scratch,
    }
}

pub fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or_else(|| panic!("{key} in {v}"))
}

/// A listener on a free loopback port (a "guest" port) and its port.
pub async fn guest_port() -> (TcpListener, u16) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    (listener, port)
}

/// Reads one HTTP/1.1 request head; its lines.
pub async fn read_head<R: tokio::io::AsyncRead + Unpin>(reader: &mut BufReader<R>) -> Vec<String> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await.unwrap() == 0 {
            return lines;
        }
        let line = line.trim_end().to_string();
        if line.is_empty() {
            return lines;
        }
        lines.push(line);
    }
}

/// A guest HTTP server, keep-alive: answers every request with its
/// request line and headers as JSON (`{"line", "headers": {name:
/// value}}`), but `GET /bytes/{n}` with `n` bytes (written 64 KiB at a
/// time, with a Content-Length).
pub async fn echo_server() -> u16 {
    let (listener, port) = guest_port().await;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let mut reader = BufReader::new(stream);
                loop {
                    let head = read_head(&mut reader).await;
                    if head.is_empty() {
                        return;
                    }
                    let sent = match bytes_asked(&head[0]) {
                        Some(n) => write_bytes(reader.get_mut(), n).await,
                        None => echo(reader.get_mut(), &head).await,
                    };
                    if sent.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// `n` of a `GET /bytes/{n} HTTP/1.1` request line.
fn bytes_asked(line: &str) -> Option<usize> {
    line.strip_prefix("GET /bytes/")?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

async fn echo<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, head: &[String]) -> std::io::Result<()> {
    let headers: serde_json::Map<String, Value> = head[1..]
        .iter()
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.to_ascii_lowercase(), Value::from(v.trim())))
        .collect();
    let body = json!({"line": head[0], "headers": headers}).to_string();
    let answer = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    w.write_all(answer.as_bytes()).await
}

async fn write_bytes<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, n: usize) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n\
         content-length: {n}\r\n\r\n"
    );
    w.write_all(head.as_bytes()).await?;
    let chunk = vec![b'x'; 64 << 10];
    let mut left = n;
    while left > 0 {
        let k = left.min(chunk.len());
        w.write_all(&chunk[..k]).await?;
        left -= k;
    }
    Ok(())
}

/// A guest WebSocket server for one connection on `listener`: accepts the
/// upgrade (101), then echoes bytes back until the caller closes; the
/// request head it got.
pub fn websocket_echo(listener: TcpListener) -> JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let _ = stream.set_nodelay(true);
        let mut reader = BufReader::new(stream);
        let head = read_head(&mut reader).await;
        reader
            .get_mut()
            .write_all(
                b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\
                  connection: upgrade\r\nsec-websocket-accept: x\r\n\r\n",
            )
            .await
            .unwrap();
        let mut buf = [0u8; 4096];
        loop {
            let n = reader.read(&mut buf).await.unwrap();
            if n == 0 {
                return head;
            }
            reader.get_mut().write_all(&buf[..n]).await.unwrap();
        }
    })
}

/// A WebSocket upgrade request for `GET /ws` with these header lines
/// (`name: value`, each ending in CRLF), a `Host` among them.
pub fn websocket_request(headers: &str) -> String {
    format!(
        "GET /ws HTTP/1.1\r\n{headers}connection: Upgrade\r\nupgrade: websocket\r\n\
         sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
    )
}
