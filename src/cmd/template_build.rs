//! `torpor template build [-f Dockerfile] [--name N] [CONTEXT]`: the
//! Dockerfile parsed here (torpor-build), each COPY's files packed from
//! the context and uploaded once by their hash (`PUT
//! /v1/build-files/{hash}`, skipped when the server has them), the build
//! started (`POST /v1/builds`) and followed: each step as it starts, its
//! output, then the template or the failed step with its exit code.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use torpor_build::context::pack;
use torpor_build::dockerfile::parse;
use torpor_build::validate::SpecError;

use super::client::{Client, Error};
use super::output::text;
use crate::cli::TemplateBuildArgs;

/// How often the build is polled.
const POLL: Duration = Duration::from_millis(500);

/// Why the build could not be started here.
#[derive(Debug, thiserror::Error)]
enum Local {
    #[error("{0}")]
    Spec(#[from] SpecError),
    #[error("{0}")]
    Api(String),
}

pub fn build(c: &Client, args: TemplateBuildArgs) -> Result<(), Error> {
    let context = args.context.as_path();
    let file = args
        .file
        .clone()
        .unwrap_or_else(|| context.join("Dockerfile"));
    let dockerfile = std::fs::read_to_string(&file)
        .map_err(|e| Error::Transport(format!("cannot read {}: {e}", file.display())))?;
    let mut build_args = BTreeMap::new();
    for a in &args.build_args {
        let (k, v) = a
            .split_once('=')
            .ok_or_else(|| Error::Transport(format!("--build-arg {a:?}: KEY=VALUE")))?;
        build_args.insert(k.to_string(), v.to_string());
    }
    let parsed = parse(&dockerfile, &build_args)
        .map_err(|e| Error::Transport(format!("{}: {e}", file.display())))?;
    let mut spec = parsed
        .into_spec(|src| upload(c, context, src).map_err(Local::Api))
        .map_err(|e| Error::Transport(format!("{}: {e}", file.display())))?;
    spec.skip_cache |= args.no_cache;
    let name = match &args.name {
        Some(n) => n.clone(),
        None => context_name(context)?,
    };
    let mut body = serde_json::to_value(&spec)
        .map_err(|e| Error::Transport(format!("the spec does not serialise: {e}")))?;
    body["name"] = json!(name);
    let record = c.call("POST", "/v1/builds", Some(&body))?;
    let id = text(&record["id"]);
    if args.detach {
        println!("{id}");
        return Ok(());
    }
    eprintln!("torpor: building template {name} (build {id})");
    follow(c, &id)
}

/// The context directory's own name.
fn context_name(context: &Path) -> Result<String, Error> {
    let full = std::fs::canonicalize(context)
        .map_err(|e| Error::Transport(format!("{}: {e}", context.display())))?;
    full.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
        .ok_or_else(|| Error::Transport("give the template a --name".into()))
}

/// Packs `src` of `context`, uploads it unless the server has it; its hash.
fn upload(c: &Client, context: &Path, src: &str) -> Result<String, String> {
    let packed = pack(context, src).map_err(|e| format!("COPY {src}: {e}"))?;
    let path = format!("/v1/build-files/{}", packed.sha256);
    let present = c
        .call("GET", &path, None)
        .map_err(|e| format!("COPY {src}: {e:?}"))?;
    if present["present"] != true {
        c.raw(
            "PUT",
            &path,
            Some(("application/octet-stream", &packed.archive)),
        )
        .map_err(|e| format!("COPY {src}: upload: {e:?}"))?;
        eprintln!(
            "torpor: uploaded {src} ({} bytes, {})",
            packed.archive.len(),
            &packed.sha256[..12]
        );
    }
    Ok(packed.sha256)
}

/// Prints the build's log as it grows until it ends; an error when it
/// failed, naming the step and its exit code.
fn follow(c: &Client, id: &str) -> Result<(), Error> {
    let mut offset = 0usize;
    loop {
        let r = c.call(
            "GET",
            &format!("/v1/builds/{id}?logs_offset={offset}"),
            None,
        )?;
        let logs = r["logs"].as_array().cloned().unwrap_or_default();
        for entry in &logs {
            println!("{}", text(&entry["message"]));
        }
        offset += logs.len();
        match r["status"].as_str() {
            Some("ready") => {
                println!(
                    "template {} ({}): {} steps cached, {} run",
                    text(&r["name"]),
                    text(&r["template_id"]),
                    r["cached_steps"],
                    r["run_steps"]
                );
                return Ok(());
            }
            Some("error") | Some("cancelled") => return Err(failed(&r)),
            _ => std::thread::sleep(POLL),
        }
    }
}

fn failed(r: &Value) -> Error {
    let f = &r["failure"];
    let mut m = format!(
        "build {} {}: {}",
        text(&r["id"]),
        text(&r["status"]),
        text(&f["message"])
    );
    if let Some(step) = f["step"].as_u64() {
        m.push_str(&format!(
            "\n  step {}: {}",
            step + 1,
            text(&f["instruction"])
        ));
    }
    if let Some(code) = f["exit_code"].as_i64() {
        m.push_str(&format!("\n  exit code {code}"));
    }
    if let Some(tail) = f["output_tail"].as_str().filter(|t| !t.is_empty()) {
        m.push_str(&format!("\n  output:\n{tail}"));
    }
    Error::Transport(m)
}
