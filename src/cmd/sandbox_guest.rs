//! `torpor sandbox exec` and `torpor sandbox files get|put|ls`: commands and
//! files in a sandbox's guest through the API (Linux templates).

use std::io::{Read, Write};

use serde_json::{json, Map, Value};
use torpor_agent::b64;

use super::client::{encode, path, Client, Error};
use super::output::{table, text};
use super::EXIT_FAILURE;
use crate::cli::{ClientArgs, ExecArgs, FilesAction};

/// Exit status of a command that timed out (as timeout(1)).
const EXIT_TIMED_OUT: i32 = 124;

/// Runs the command; the exit status is the command's.
pub fn exec(args: &ClientArgs, a: ExecArgs) -> i32 {
    let client = match Client::new(args) {
        Ok(c) => c,
        Err(m) => {
            eprintln!("torpor: error: {m}");
            return EXIT_FAILURE;
        }
    };
    let mut body = Map::new();
    body.insert("argv".into(), json!(a.argv));
    if a.timeout_ms > 0 {
        body.insert("timeout_ms".into(), a.timeout_ms.into());
    }
    if let Some(cwd) = a.cwd {
        body.insert("cwd".into(), cwd.into());
    }
    if !a.env.is_empty() {
        let env: Map<String, Value> = a.env.into_iter().map(|(k, v)| (k, v.into())).collect();
        body.insert("env".into(), env.into());
    }
    if a.stdin {
        let mut input = Vec::new();
        if let Err(e) = std::io::stdin().read_to_end(&mut input) {
            eprintln!("torpor: error: cannot read stdin: {e}");
            return EXIT_FAILURE;
        }
        body.insert("stdin_base64".into(), b64::encode(&input).into());
    }
    let body = Value::Object(body);
    if a.stream && !client.json {
        return stream(&client, &a.id, &body);
    }
    let answer = match client.show("POST", &path(&a.id, "/exec"), Some(&body)) {
        Ok(Some(v)) => v,
        // --json: printed as it came.
        Ok(None) => return super::EXIT_OK,
        Err(e) => return client.fail(e),
    };
    let decode = |v: &Value| -> Vec<u8> {
        let s = v.as_str().unwrap_or_default();
        if answer["encoding"] == "base64" {
            b64::decode(s).unwrap_or_default()
        } else {
            s.as_bytes().to_vec()
        }
    };
    let _ = std::io::stdout().write_all(&decode(&answer["stdout"]));
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().write_all(&decode(&answer["stderr"]));
    finish(&answer)
}

/// The exit status for an exec's end (`exit` fields), saying on stderr why
/// it is not the command's own.
fn finish(answer: &Value) -> i32 {
    if answer["truncated"] == true {
        eprintln!(
            "torpor: output truncated ({} bytes of stdout, {} of stderr written by the command)",
            text(&answer["stdout_bytes"]),
            text(&answer["stderr_bytes"])
        );
    }
    if answer["timed_out"] == true {
        eprintln!("torpor: the command timed out and was killed");
        return EXIT_TIMED_OUT;
    }
    match (answer["exit_code"].as_i64(), answer["signal"].as_i64()) {
        (Some(code), _) => code as i32,
        (None, Some(sig)) => {
            eprintln!("torpor: the command was killed by signal {sig}");
            128 + sig as i32
        }
        _ => EXIT_FAILURE,
    }
}

/// `exec --stream`: NDJSON lines as the agent sends output.
fn stream(client: &Client, id: &str, body: &Value) -> i32 {
    let mut pending: Vec<u8> = Vec::new();
    let mut end: Option<Value> = None;
    let mut on_chunk = |chunk: &[u8]| {
        pending.extend_from_slice(chunk);
        while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            let Ok(event) = serde_json::from_slice::<Value>(&line) else {
                continue;
            };
            let data =
                || b64::decode(event["data"].as_str().unwrap_or_default()).unwrap_or_default();
            match event["type"].as_str() {
                Some("stdout") => {
                    let mut out = std::io::stdout();
                    let _ = out.write_all(&data()).and_then(|()| out.flush());
                }
                Some("stderr") => {
                    let _ = std::io::stderr().write_all(&data());
                }
                Some("start") if event["resumed"] == true => eprintln!(
                    "torpor: woke {id} from hibernation in {:.1} ms",
                    event["resume_ms"].as_f64().unwrap_or_default()
                ),
                Some("exit") | Some("error") => end = Some(event),
                _ => {}
            }
        }
    };
    if let Err(e) = client.stream(&path(id, "/exec/stream"), body, &mut on_chunk) {
        return client.fail(e);
    }
    match end {
        Some(e) if e["type"] == "exit" => finish(&e),
        Some(e) => {
            eprintln!(
                "torpor: error: {} (HTTP {} {})",
                text(&e["message"]),
                text(&e["status"]),
                text(&e["code"])
            );
            EXIT_FAILURE
        }
        None => {
            eprintln!("torpor: error: the stream ended before the command did");
            EXIT_FAILURE
        }
    }
}

fn file_path(id: &str, rest: &str, guest_path: &str) -> String {
    format!("{}?path={}", path(id, rest), encode(guest_path))
}

/// `files get|put|ls`.
pub fn files(c: &Client, action: FilesAction) -> Result<(), Error> {
    match action {
        FilesAction::Get(a) => {
            let data = c.raw("GET", &file_path(&a.id, "/files", &a.path), None)?;
            match a.out {
                Some(out) => std::fs::write(&out, &data).map_err(|e| {
                    Error::Transport(format!("cannot write {}: {e}", out.display()))
                })?,
                None => {
                    let mut stdout = std::io::stdout();
                    let _ = stdout.write_all(&data).and_then(|()| stdout.flush());
                }
            }
            Ok(())
        }
        FilesAction::Put(a) => {
            let data = match &a.from {
                Some(f) => std::fs::read(f)
                    .map_err(|e| Error::Transport(format!("cannot read {}: {e}", f.display())))?,
                None => {
                    let mut d = Vec::new();
                    std::io::stdin()
                        .read_to_end(&mut d)
                        .map_err(|e| Error::Transport(format!("cannot read stdin: {e}")))?;
                    d
                }
            };
            let mut url = file_path(&a.id, "/files", &a.path);
            if let Some(m) = &a.mode {
                url.push_str(&format!("&mode={}", encode(m)));
            }
            let answer = c.raw("PUT", &url, Some(("application/octet-stream", &data)))?;
            if c.json {
                println!(
                    "{}",
                    super::output::pretty(&String::from_utf8_lossy(&answer))
                );
            } else {
                let v: Value = serde_json::from_slice(&answer).unwrap_or_default();
                println!("{}: {} bytes", a.path, text(&v["size"]));
            }
            Ok(())
        }
        FilesAction::Ls(a) => {
            let Some(v) = c.show("GET", &file_path(&a.id, "/files/list", &a.path), None)? else {
                return Ok(());
            };
            let rows: Vec<Vec<String>> = v["entries"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|e| {
                    vec![
                        text(&e["kind"]),
                        e["mode"].as_u64().map_or("-".into(), |m| format!("{m:o}")),
                        text(&e["size"]),
                        text(&e["name"]),
                    ]
                })
                .collect();
            print!("{}", table(&["KIND", "MODE", "SIZE", "NAME"], &rows));
            if v["truncated"] == true {
                eprintln!("torpor: the listing was truncated");
            }
            Ok(())
        }
    }
}
