//! `torpor sandbox checkpoint|checkpoints|rm-checkpoint|restore|fork`: the
//! checkpoint routes of the REST API, as tables or `--json`.

use serde_json::{json, Map, Value};

use super::client::{encode, path, Client, Error};
use super::output::{age, table, text};
use crate::cli::{CheckpointArgs, ForkArgs};

pub fn create(c: &Client, a: &CheckpointArgs) -> Result<(), Error> {
    let body = json!({ "name": a.name });
    if let Some(v) = c.show("POST", &path(&a.id, "/checkpoints"), Some(&body))? {
        println!(
            "{}: checkpoint {} ({})",
            a.id,
            text(&v["name"]),
            text(&v["id"])
        );
    }
    Ok(())
}

pub fn list(c: &Client, id: &str) -> Result<(), Error> {
    let Some(v) = c.show("GET", &path(id, "/checkpoints"), None)? else {
        return Ok(());
    };
    let all = v["checkpoints"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    // The parent link is an id: show the parent's name.
    let name_of = |parent: &Value| {
        all.iter()
            .find(|c| &c["id"] == parent)
            .map_or_else(|| text(parent), |c| text(&c["name"]))
    };
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|c| {
            vec![
                text(&c["name"]),
                text(&c["id"]),
                name_of(&c["parent"]),
                age(&c["created_at"]),
            ]
        })
        .collect();
    print!("{}", table(&["NAME", "ID", "PARENT", "AGE"], &rows));
    Ok(())
}

pub fn delete(c: &Client, a: &CheckpointArgs) -> Result<(), Error> {
    let route = path(&a.id, &format!("/checkpoints/{}", encode(&a.name)));
    if c.show("DELETE", &route, None)?.is_some() {
        println!("{}: checkpoint {} deleted", a.id, a.name);
    }
    Ok(())
}

pub fn restore(c: &Client, a: &CheckpointArgs) -> Result<(), Error> {
    let body = json!({ "checkpoint": a.name });
    let Some(v) = c.show("POST", &path(&a.id, "/restore"), Some(&body))? else {
        return Ok(());
    };
    let mut line = format!(
        "{}: {} (restored from checkpoint {}",
        text(&v["sandbox"]["id"]),
        text(&v["sandbox"]["state"]),
        a.name
    );
    if let Some(ms) = v["resume_ms"].as_f64() {
        line.push_str(&format!(" in {ms:.1} ms"));
    }
    println!("{line})");
    Ok(())
}

pub fn fork(c: &Client, a: ForkArgs) -> Result<(), Error> {
    let mut body = Map::new();
    if let Some(name) = a.name {
        body.insert("checkpoint".into(), name.into());
    }
    if let Some(ms) = a.keep_alive_ms {
        body.insert("keep_alive_ms".into(), ms.into());
    }
    if let Some(ms) = a.timeout_ms {
        body.insert("timeout_ms".into(), ms.into());
    }
    if !a.meta.is_empty() {
        let meta: Map<String, Value> = a.meta.into_iter().map(|(k, v)| (k, v.into())).collect();
        body.insert("metadata".into(), meta.into());
    }
    if a.queue {
        body.insert("queue".into(), true.into());
    }
    let body = Value::Object(body);
    if let Some(v) = c.show("POST", &path(&a.id, "/fork"), Some(&body))? {
        println!("{}", text(&v["id"]));
    }
    Ok(())
}
