//! `torpor pod list|set`: the pod routes of the REST API, as tables or
//! `--json`.

use serde_json::{Map, Value};

use super::client::{encode, Client, Error};
use super::output::{fields, table, text, when};
use crate::cli::{PodAction, PodCommand, PodSetArgs};

pub fn run(cmd: PodCommand) -> i32 {
    if let PodAction::Serve(args) = cmd.action {
        return super::serve::run_pod(*args);
    }
    Client::run(&cmd.client, |c| act(c, cmd.action))
}

fn act(c: &Client, action: PodAction) -> Result<(), Error> {
    match action {
        PodAction::List => {
            let Some(v) = c.show("GET", "/v1/pods", None)? else {
                return Ok(());
            };
            let rows: Vec<Vec<String>> = v["pods"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|p| {
                    if p["reachable"] == false {
                        let why = format!("unreachable: {}", text(&p["error"]));
                        return vec![
                            text(&p["id"]),
                            address(&p["address"]),
                            "-".into(),
                            "-".into(),
                            "-".into(),
                            "-".into(),
                            "-".into(),
                            "-".into(),
                            why,
                        ];
                    }
                    vec![
                        text(&p["id"]),
                        address(&p["address"]),
                        bytes(&p["memory_bytes"]),
                        text(&p["oversubscription_ratio"]),
                        text(&p["high_watermark"]),
                        format!("{}MiB", text(&p["committed_mib"])),
                        mib(&p["pss_mib"]),
                        mib(&p["resident_mib"]),
                        counts(&p["sandboxes"]),
                    ]
                })
                .collect();
            let header = [
                "ID",
                "ADDRESS",
                "MEMORY",
                "RATIO",
                "WATERMARK",
                "COMMITTED",
                "PSS",
                "RESIDENT",
                "SANDBOXES",
            ];
            print!("{}", table(&header, &rows));
            Ok(())
        }
        PodAction::Set(args) => set(c, args),
        PodAction::Serve(_) => unreachable!("`pod serve` runs a pod, handled in run"),
    }
}

fn set(c: &Client, args: PodSetArgs) -> Result<(), Error> {
    let mut body = Map::new();
    if let Some(r) = args.ratio {
        body.insert("oversubscription_ratio".into(), r.into());
    }
    if let Some(w) = args.high_watermark {
        body.insert("high_watermark".into(), w.into());
    }
    let path = format!("/v1/pods/{}", encode(&args.id));
    let Some(p) = c.show("PATCH", &path, Some(&Value::Object(body)))? else {
        return Ok(());
    };
    let address = address(&p["address"]);
    print!(
        "{}",
        fields(&[
            ("id", text(&p["id"])),
            ("address", address),
            ("memory", bytes(&p["memory_bytes"])),
            ("vcpus", text(&p["vcpus"])),
            ("disk", bytes(&p["disk_bytes"])),
            ("ratio", text(&p["oversubscription_ratio"])),
            ("watermark", text(&p["high_watermark"])),
            ("committed", format!("{}MiB", text(&p["committed_mib"]))),
            ("pss", mib(&p["pss_mib"])),
            ("resident", mib(&p["resident_mib"])),
            ("sandboxes", counts(&p["sandboxes"])),
            ("created", when(&p["created_at"])),
        ])
    );
    Ok(())
}

/// `local`, `unix:PATH` or `tcp:HOST:PORT`.
fn address(a: &Value) -> String {
    match a["kind"].as_str() {
        Some("unix") => format!("unix:{}", text(&a["path"])),
        Some("tcp") => format!("tcp:{}", text(&a["addr"])),
        Some("tls") => format!("tls:{}", text(&a["addr"])),
        _ => text(&a["kind"]),
    }
}

/// Bytes as MiB or GiB.
fn bytes(v: &Value) -> String {
    let Some(b) = v.as_u64() else {
        return "-".into();
    };
    let mib = b as f64 / (1u64 << 20) as f64;
    if mib >= 10240.0 {
        format!("{:.1}GiB", mib / 1024.0)
    } else {
        format!("{mib:.0}MiB")
    }
}

/// A measured size in MiB, one decimal (`-` when absent).
fn mib(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| "-".into(), |m| format!("{m:.1}MiB"))
}

/// `{"running": 2, "hibernated": 1}` as `2 running, 1 hibernated` (or 0).
fn counts(v: &Value) -> String {
    let parts: Vec<String> = v
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, n)| n.as_u64() != Some(0))
        .map(|(state, n)| format!("{} {state}", text(n)))
        .collect();
    if parts.is_empty() {
        "0".into()
    } else {
        parts.join(", ")
    }
}
