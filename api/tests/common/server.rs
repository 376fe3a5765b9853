//! The API server under test, its replies and request helpers.

use super::*;

/// A server on 127.0.0.1:0 over a [`Fake`].
pub struct Server {
    pub addr: SocketAddr,
    pub fake: Arc<Fake>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Server {
    /// A config with [`TOKEN`] and [`OTHER_TOKEN`] and the default limits.
    pub fn config() -> ApiConfig {
        ApiConfig {
            tokens: vec![TOKEN.into(), OTHER_TOKEN.into()],
            ..ApiConfig::default()
        }
    }

    pub async fn start() -> Server {
        Self::start_with(Self::config()).await
    }

    pub async fn start_with(config: ApiConfig) -> Server {
        let fake = Arc::new(Fake::new());
        Self::start_over(Arc::clone(&fake), fake, config).await
    }

    /// A server over `service` (a `Nested` over `fake`, say).
    pub async fn start_over<S: SandboxApi>(
        service: Arc<S>,
        fake: Arc<Fake>,
        config: ApiConfig,
    ) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(torpor_api::serve(listener, service, config, async {
            let _ = stopped.await;
        }));
        Server {
            addr,
            fake,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Asks for a graceful shutdown and waits for `serve` to return.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        let _ = self.stop.take().unwrap().send(());
        let task = self.task.take().unwrap();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("serve returns after shutdown")
            .unwrap()
    }

    /// A sandbox of the fake; `agent` says whether it has the fake agent.
    pub async fn sandbox(&self, agent: bool) -> String {
        let mut body = serde_json::json!({ "template": "probe" });
        if agent {
            body["metadata"] = serde_json::json!({ "agent": "fake" });
        }
        let r = self.call("POST", "/v1/sandboxes", Some(body)).await;
        assert_eq!(r.status, 201, "{}", r.text());
        r.json()["id"].as_str().unwrap().to_string()
    }

    /// A sandbox of `token`'s tenant with the fake agent: its id.
    pub async fn sandbox_as(&self, token: &str) -> String {
        let body = serde_json::json!({"template": "probe", "metadata": {"agent": "fake"}});
        let r = self
            .request(
                "POST",
                "/v1/sandboxes",
                &[
                    ("Authorization", format!("Bearer {token}")),
                    ("Content-Type", "application/json".into()),
                ],
                Some(body.to_string().as_bytes()),
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.text());
        r.json()["id"].as_str().unwrap().to_string()
    }

    /// `method path` with the test token and, if given, a JSON body.
    pub async fn call(&self, method: &str, path: &str, json: Option<Value>) -> Reply {
        let body = json.map(|v| v.to_string());
        let mut headers = vec![("Authorization", format!("Bearer {TOKEN}"))];
        if body.is_some() {
            headers.push(("Content-Type", "application/json".into()));
        }
        self.request(method, path, &headers, body.as_deref().map(str::as_bytes))
            .await
    }

    /// A request with these headers, through the project's HTTP client
    /// (which adds Host, Connection, User-Agent, Accept and Content-Length).
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, String)],
        body: Option<&[u8]>,
    ) -> Reply {
        let endpoint = Endpoint::parse(&format!("tcp:{}", self.addr)).unwrap();
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.clone()))
            .collect();
        let (method, path, body) = (
            method.to_string(),
            path.to_string(),
            body.map(<[u8]>::to_vec),
        );
        // The client blocks: off the runtime, which serves meanwhile.
        let answer = tokio::task::spawn_blocking(move || {
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            // The headers name the content type, if any.
            let body = body.as_deref().map(|b| ("", b));
            HttpClient::new(endpoint, None, Duration::from_secs(20))
                .unwrap()
                .with_headers(&headers)
                .request(&method, &path, body, None)
                .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
        })
        .await
        .unwrap();
        Reply {
            status: answer.status,
            headers: answer.headers,
            body: answer.body,
        }
    }

    /// Sends `raw` as is and reads the answer to the end of the connection.
    pub async fn raw(&self, raw: &[u8]) -> Reply {
        let exchange = async {
            let mut stream = TcpStream::connect(self.addr).await.unwrap();
            // The server may answer (413) and close before taking it all.
            if let Err(e) = stream.write_all(raw).await {
                eprintln!("write: {e}");
            }
            // A server that answers before reading a whole body may close
            // with a reset after its answer: keep what arrived.
            let mut answer = Vec::new();
            let mut buf = [0u8; 16384];
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => answer.extend_from_slice(&buf[..n]),
                    Err(e) if !answer.is_empty() => {
                        eprintln!("read after {} bytes: {e}", answer.len());
                        break;
                    }
                    Err(e) => panic!("read: {e}"),
                }
            }
            answer
        };
        let answer = tokio::time::timeout(Duration::from_secs(20), exchange)
            .await
            .expect("the server answers within 20 s");
        Reply::parse(&answer)
    }
}

/// A parsed HTTP/1.1 answer.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    fn parse(raw: &[u8]) -> Reply {
        let end = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no header end in {:?}", String::from_utf8_lossy(raw)));
        let head = std::str::from_utf8(&raw[..end]).unwrap();
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap();
        let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
        let headers: Vec<(String, String)> = lines
            .map(|l| {
                let (n, v) = l.split_once(':').unwrap();
                (n.trim().to_ascii_lowercase(), v.trim().to_string())
            })
            .collect();
        let rest = &raw[end + 4..];
        let chunked = headers
            .iter()
            .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
        let body = if chunked {
            dechunk(rest)
        } else {
            rest.to_vec()
        };
        Reply {
            status,
            headers,
            body,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.text()))
    }

    /// Asserts the standard error body with this status and code, and
    /// returns its `error` object.
    #[track_caller]
    pub fn assert_error(&self, status: u16, code: &str) -> Value {
        assert_eq!(self.status, status, "body: {}", self.text());
        assert!(
            self.header("content-type")
                .is_some_and(|c| c.starts_with("application/json")),
            "error content type: {:?}",
            self.header("content-type")
        );
        let v = self.json();
        let error = v["error"].clone();
        assert_eq!(error["code"], code, "body: {v}");
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "message in {v}"
        );
        error
    }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n").unwrap();
        let size_text = std::str::from_utf8(&raw[..line_end]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        raw = &raw[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

/// A tenants file in `dir` with these `(tenant, token)` tenant tokens.
pub fn tenants_file(dir: &std::path::Path, tenants: &[(&str, &str)]) -> std::path::PathBuf {
    let path = dir.join("tenants.json");
    let mut file = torpor_api::auth::tokens::TenantsFile::default();
    for (tenant, token) in tenants {
        file.import(tenant, torpor_api::auth::Scope::Tenant, token)
            .unwrap();
    }
    file.save(&path).unwrap();
    path
}

/// An exec stream of `argv` that `token` opens on sandbox `id`, kept open
/// after its status line (the connection, to read on or drop), or the
/// status line it was refused with.
pub async fn open_exec_stream(
    addr: SocketAddr,
    token: &str,
    id: &str,
    argv: &[&str],
) -> Result<tokio::io::BufReader<TcpStream>, String> {
    use tokio::io::AsyncBufReadExt;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let body = serde_json::json!({ "argv": argv }).to_string();
    let request = format!(
        "POST /v1/sandboxes/{id}/exec/stream HTTP/1.1\r\nHost: t\r\n\
         Authorization: Bearer {token}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reader = tokio::io::BufReader::new(stream);
    let mut status = String::new();
    reader.read_line(&mut status).await.unwrap();
    if status.contains(" 200 ") {
        Ok(reader)
    } else {
        Err(status)
    }
}
