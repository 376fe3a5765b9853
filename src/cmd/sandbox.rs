//! `torpor sandbox create|list|get|pause|resume|hibernate|rm`: the
//! sandbox routes of the REST API, as tables or `--json` (`exec` and
//! `files`: `sandbox_guest.rs`; the checkpoint commands: `checkpoint.rs`).

use serde_json::{Map, Value};

use super::checkpoint;
use super::client::{encode, path, Client, Error};
use super::output::{age, fields, pairs, table, text, when};
use super::template;
use crate::cli::{SandboxAction, SandboxCommand, SandboxCreateArgs, SandboxListArgs};

pub fn run(cmd: SandboxCommand) -> i32 {
    match cmd.action {
        SandboxAction::Exec(a) => super::sandbox_guest::exec(&cmd.client, a),
        action => Client::run(&cmd.client, |c| act(c, action)),
    }
}

fn act(c: &Client, action: SandboxAction) -> Result<(), Error> {
    match action {
        SandboxAction::Create(args) => create(c, args),
        SandboxAction::List(args) => list(c, args),
        SandboxAction::Get(a) => {
            if let Some(v) = c.show("GET", &path(&a.id, ""), None)? {
                print!("{}", describe(&v, &template::names(c)));
            }
            Ok(())
        }
        SandboxAction::Files(a) => super::sandbox_guest::files(c, a),
        // Exits with the command's status, so `run` takes it first.
        SandboxAction::Exec(_) => unreachable!("exec is dispatched by run"),
        SandboxAction::Pause(a) => transition(c, &a.id, "pause"),
        SandboxAction::Resume(a) => transition(c, &a.id, "resume"),
        SandboxAction::Connect(a) => transition(c, &a.id, "connect"),
        SandboxAction::Hibernate(a) => transition(c, &a.id, "hibernate"),
        SandboxAction::Rm(a) => {
            if c.show("DELETE", &path(&a.id, ""), None)?.is_some() {
                println!("{}: deleted", a.id);
            }
            Ok(())
        }
        SandboxAction::Checkpoint(a) => checkpoint::create(c, &a),
        SandboxAction::Checkpoints(a) => checkpoint::list(c, &a.id),
        SandboxAction::RmCheckpoint(a) => checkpoint::delete(c, &a),
        SandboxAction::Restore(a) => checkpoint::restore(c, &a),
        SandboxAction::Fork(a) => checkpoint::fork(c, a),
    }
}

fn create(c: &Client, args: SandboxCreateArgs) -> Result<(), Error> {
    let mut body = Map::new();
    body.insert("template".into(), args.template.into());
    if let Some(ms) = args.keep_alive_ms {
        body.insert("keep_alive_ms".into(), ms.into());
    }
    if let Some(ms) = args.timeout_ms {
        body.insert("timeout_ms".into(), ms.into());
    }
    if !args.meta.is_empty() {
        let meta: Map<String, Value> = args.meta.into_iter().map(|(k, v)| (k, v.into())).collect();
        body.insert("metadata".into(), meta.into());
    }
    if args.queue {
        body.insert("queue".into(), true.into());
    }
    if let Some(pod) = args.pod {
        body.insert("pod".into(), pod.into());
    }
    let Some(v) = c.show("POST", "/v1/sandboxes", Some(&Value::Object(body)))? else {
        return Ok(());
    };
    println!("{}", text(&v["id"]));
    if v["state"] != "running" {
        eprintln!(
            "torpor: {} is {} (see `torpor sandbox get {}`)",
            text(&v["id"]),
            text(&v["state"]),
            text(&v["id"])
        );
    }
    Ok(())
}

fn list(c: &Client, args: SandboxListArgs) -> Result<(), Error> {
    let mut query = Vec::new();
    for s in &args.state {
        query.push(format!("state={}", encode(s)));
    }
    if let Some(t) = &args.template {
        query.push(format!("template={}", encode(&template::resolve(c, t)?)));
    }
    for (k, v) in &args.meta {
        query.push(format!("metadata.{}={}", encode(k), encode(v)));
    }
    let mut url = "/v1/sandboxes".to_string();
    if !query.is_empty() {
        url = format!("{url}?{}", query.join("&"));
    }
    let Some(v) = c.show("GET", &url, None)? else {
        return Ok(());
    };
    let names = template::names(c);
    let rows: Vec<Vec<String>> = v["sandboxes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|s| {
            vec![
                text(&s["id"]),
                text(&s["state"]),
                template::name_of(&names, &s["template"]),
                mib(&s["mem_mib"]),
                age(&s["created_at"]),
                age(&s["last_active_at"]),
                pairs(&s["metadata"]),
            ]
        })
        .collect();
    let header = [
        "ID",
        "STATE",
        "TEMPLATE",
        "MEM",
        "AGE",
        "LAST ACTIVE",
        "METADATA",
    ];
    print!("{}", table(&header, &rows));
    Ok(())
}

/// A byte count in whole KiB (what /proc shows, for scripts to compare).
fn kib(v: &Value) -> String {
    v.as_u64()
        .map_or_else(|| "-".into(), |n| format!("{} KiB", n >> 10))
}

fn mib(v: &Value) -> String {
    v.as_u64().map_or_else(|| "-".into(), |n| format!("{n}MiB"))
}

/// pause, resume or hibernate: the new state and, for a wake, its time.
fn transition(c: &Client, id: &str, op: &str) -> Result<(), Error> {
    let Some(v) = c.show("POST", &path(id, &format!("/{op}")), None)? else {
        return Ok(());
    };
    let sandbox = &v["sandbox"];
    let mut line = format!("{}: {}", text(&sandbox["id"]), text(&sandbox["state"]));
    if v["resumed"] == true {
        match v["resume_ms"].as_f64() {
            Some(ms) => line.push_str(&format!(" (woke it from hibernation in {ms:.1} ms)")),
            None => line.push_str(" (woke it from hibernation)"),
        }
    } else if op == "resume" {
        line.push_str(" (it was not hibernated: nothing to wake)");
    }
    println!("{line}");
    Ok(())
}

/// One sandbox as `key: value` lines.
fn describe(s: &Value, names: &Value) -> String {
    let mut rows = vec![
        ("id", text(&s["id"])),
        ("state", text(&s["state"])),
        ("template", template::name_of(names, &s["template"])),
        ("pod", text(&s["pod"])),
        ("memory", mib(&s["mem_mib"])),
        ("vcpus", text(&s["vcpus"])),
        ("keep alive", format!("{} ms", text(&s["keep_alive_ms"]))),
        ("expires", when(&s["expires_at"])),
        ("created", when(&s["created_at"])),
        ("last active", when(&s["last_active_at"])),
        ("metadata", pairs(&s["metadata"])),
    ];
    if !s["failure_reason"].is_null() {
        rows.push(("failure", text(&s["failure_reason"])));
    }
    rows.push(("vmm pid", text(&s["vmm"]["pid"])));
    rows.push(("vmm socket", text(&s["vmm"]["control_socket"])));
    let m = &s["memory"];
    if m.is_object() {
        rows.push(("host pss", kib(&m["pss_bytes"])));
        for (key, name) in [
            ("guest_used_bytes", "guest used"),
            ("guest_free_bytes", "guest free"),
            ("reported_bytes", "reported free"),
        ] {
            if !m[key].is_null() {
                rows.push((name, kib(&m[key])));
            }
        }
        if !m["balloon_target_mib"].is_null() || !m["balloon_actual_mib"].is_null() {
            let balloon = format!(
                "target {}, actual {}",
                mib(&m["balloon_target_mib"]),
                mib(&m["balloon_actual_mib"])
            );
            rows.push(("balloon", balloon));
        }
    }
    rows.push(("snapshot", text(&s["snapshot"])));
    fields(&rows)
}
