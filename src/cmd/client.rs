//! The client side of the REST API for `torpor sandbox|template|pod`: where
//! the URL (`http://...` or `unix:/path`) and token come from, JSON
//! requests over `torpor_client::HttpClient`, and how errors are told.

use std::time::Duration;

use serde_json::Value;
use torpor_client::pin::Fingerprint;
use torpor_client::{ClientError, Endpoint, HttpClient, Streaming};

use super::EXIT_FAILURE;
use crate::cli::ClientArgs;

/// Where the API is unless `--api` or TORPOR_API says otherwise.
const DEFAULT_API: &str = "http://127.0.0.1:7700";
/// Longest wait for an answer (or, streaming, for the next chunk): the
/// server ends requests at its own limit (`serve --request-timeout-ms`,
/// 120 s by default), so this is only a backstop against a hung server,
/// past the longest limit a server is given (the nested pod's 30 minutes,
/// for template builds under TCG: a 15-minute backstop cut the code
/// interpreter's build short and made its script try again meanwhile).
const IO_TIMEOUT: Duration = Duration::from_secs(3600);

/// Where a streamed response body goes, chunk by chunk.
type ChunkSink<'a> = &'a mut dyn FnMut(&[u8]);

/// Why a request failed.
#[derive(Debug)]
pub enum Error {
    /// No TCP connection to the API.
    Connect(std::io::Error),
    /// The connection broke, timed out or the answer was not HTTP.
    Transport(String),
    /// The API answered with an error status.
    Api {
        status: u16,
        code: String,
        message: String,
    },
}

/// One API endpoint, its token, and how the token was found (for messages).
pub struct Client {
    url: String,
    http: HttpClient,
    token: Option<String>,
    token_source: String,
    pub json: bool,
}

impl Client {
    /// From the flags, environment and the default token file.
    pub fn new(args: &ClientArgs) -> Result<Client, String> {
        let url = args
            .api
            .clone()
            .or_else(|| std::env::var("TORPOR_API").ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| DEFAULT_API.to_string());
        let endpoint = Endpoint::parse(&url).map_err(|e| e.to_string())?;
        let file = super::server::default_data_dir().join("token");
        let env = std::env::var("TORPOR_TOKEN").ok().filter(|s| !s.is_empty());
        let (token, token_source) = if let Some(t) = &args.token {
            (Some(t.clone()), "the token given with --token".to_string())
        } else if let Some(t) = env {
            (Some(t), "the token in $TORPOR_TOKEN".to_string())
        } else {
            match std::fs::read_to_string(&file) {
                Ok(t) => (
                    Some(t.trim().to_string()),
                    format!("the token read from {}", file.display()),
                ),
                Err(e) => (
                    None,
                    format!("none was given (and {}: {e})", file.display()),
                ),
            }
        };
        if token
            .as_ref()
            .is_some_and(|t| t.chars().any(char::is_control))
        {
            return Err(format!("{token_source} holds control characters"));
        }
        let pin = args
            .api_fingerprint
            .clone()
            .or_else(|| {
                std::env::var("TORPOR_API_FINGERPRINT")
                    .ok()
                    .filter(|s| !s.is_empty())
            })
            .map(|f| Fingerprint::parse(&f))
            .transpose()
            .map_err(|e| e.to_string())?;
        let http = HttpClient::new(endpoint, token.clone(), IO_TIMEOUT)
            .map_err(|_| format!("{token_source} holds control characters"))?
            .pinned(pin);
        Ok(Client {
            url: url.trim_end_matches('/').to_string(),
            http,
            token,
            token_source,
            json: args.json,
        })
    }

    /// Runs `f` with a client made from the flags; the exit status.
    pub fn run(args: &ClientArgs, f: impl FnOnce(&Client) -> Result<(), Error>) -> i32 {
        match Client::new(args) {
            Ok(c) => match f(&c) {
                Ok(()) => super::EXIT_OK,
                Err(e) => c.fail(e),
            },
            Err(m) => {
                eprintln!("torpor: error: {m}");
                EXIT_FAILURE
            }
        }
    }

    /// Sends one request; 2xx answers give their JSON (`Null` when empty),
    /// others an [`Error::Api`].
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, Error> {
        self.exchange(method, path, body).map(|(v, _)| v)
    }

    /// As [`Self::call`], but with `--json` the answer is printed as it
    /// came (re-indented, fields in the API's order) and `None` returned.
    pub fn show(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Option<Value>, Error> {
        let (v, raw) = self.exchange(method, path, body)?;
        if !self.json {
            return Ok(Some(v));
        }
        if !raw.trim().is_empty() {
            println!("{}", super::output::pretty(&raw));
        }
        Ok(None)
    }

    /// Sends one request with a raw body (`content_type`, bytes); 2xx
    /// answers give their raw body, others an [`Error::Api`].
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
    ) -> Result<Vec<u8>, Error> {
        let (status, bytes) = self.send_bytes(method, path, body, None)?;
        if (200..300).contains(&status) {
            return Ok(bytes);
        }
        Err(api_error(
            method,
            path,
            status,
            &String::from_utf8_lossy(&bytes),
        ))
    }

    /// Sends a JSON request whose 2xx answer is streamed: each chunk of
    /// the body goes to `on_chunk` as it arrives.
    pub fn stream(
        &self,
        path: &str,
        body: &Value,
        on_chunk: &mut dyn FnMut(&[u8]),
    ) -> Result<(), Error> {
        let text = body.to_string();
        let body = Some(("application/json", text.as_bytes()));
        let (status, bytes) = self.send_bytes("POST", path, body, Some(on_chunk))?;
        if (200..300).contains(&status) {
            return Ok(());
        }
        Err(api_error(
            "POST",
            path,
            status,
            &String::from_utf8_lossy(&bytes),
        ))
    }

    fn exchange(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(Value, String), Error> {
        let body = body.map(|b| b.to_string());
        let (status, text) = self.send(method, path, body.as_deref())?;
        if (200..300).contains(&status) {
            if text.trim().is_empty() {
                return Ok((Value::Null, text));
            }
            return match serde_json::from_str(&text) {
                Ok(v) => Ok((v, text)),
                Err(e) => Err(Error::Transport(format!(
                    "the answer to {method} {path} is not JSON ({e})"
                ))),
            };
        }
        Err(api_error(method, path, status, &text))
    }

    fn send(&self, method: &str, path: &str, body: Option<&str>) -> Result<(u16, String), Error> {
        let body = body.map(|b| ("application/json", b.as_bytes()));
        let (status, bytes) = self.send_bytes(method, path, body, None)?;
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }

    fn send_bytes(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
        on_chunk: Option<ChunkSink<'_>>,
    ) -> Result<(u16, Vec<u8>), Error> {
        let mut ignore_head = |_: u16, _: &[(String, String)]| {};
        let streaming = on_chunk.map(|on_chunk| Streaming {
            on_head: &mut ignore_head,
            on_chunk,
        });
        match self.http.request(method, path, body, streaming) {
            Ok(a) => Ok((a.status, a.body)),
            Err(ClientError::Connect { source, .. }) => Err(Error::Connect(source)),
            Err(e) => Err(Error::Transport(e.to_string())),
        }
    }

    /// Prints the error on stderr; the exit status for it.
    pub fn fail(&self, err: Error) -> i32 {
        match err {
            Error::Transport(m) => eprintln!("torpor: error: {m}"),
            Error::Connect(e) => {
                let why = if e.kind() == std::io::ErrorKind::ConnectionRefused {
                    "connection refused".to_string()
                } else {
                    e.to_string()
                };
                eprintln!(
                    "torpor: error: cannot connect to the torpor API at {} ({why}).\n\
                     Is it running? Start it with `torpor serve`, or point --api or \
                     $TORPOR_API at it.",
                    self.url
                );
            }
            Error::Api {
                status,
                code,
                message,
            } => {
                let code = if code.is_empty() {
                    String::new()
                } else {
                    format!(" {code}")
                };
                eprintln!("torpor: error: {message} (HTTP {status}{code})");
                if status == 401 {
                    let what = match self.token {
                        Some(_) => format!("refused {}", self.token_source),
                        None => format!("needs a token and {}", self.token_source),
                    };
                    eprintln!(
                        "torpor: the API at {} {what}. Tokens come from --token, \
                         $TORPOR_TOKEN, or the token file in `torpor serve`'s data directory \
                         (DATA_DIR/token; by default {}): use one the server was started with.",
                        self.url,
                        super::server::default_data_dir().join("token").display()
                    );
                }
            }
        }
        EXIT_FAILURE
    }
}

/// An error answer as [`Error::Api`]: the error body's code and message,
/// else the start of the text.
fn api_error(method: &str, path: &str, status: u16, text: &str) -> Error {
    let parsed: Option<Value> = serde_json::from_str(text).ok();
    let field = |k: &str| {
        parsed
            .as_ref()
            .and_then(|v| v["error"][k].as_str())
            .map(str::to_string)
    };
    let message = field("message")
        .or_else(|| Some(text.trim().chars().take(400).collect()))
        .filter(|m: &String| !m.is_empty())
        .unwrap_or_else(|| format!("{method} {path} failed"));
    Error::Api {
        status,
        code: field("code").unwrap_or_default(),
        message,
    }
}

pub use torpor_client::encode;

/// The API path of sandbox `id`, then `rest`.
pub(super) fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandboxes/{}{rest}", encode(id))
}
