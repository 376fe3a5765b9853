//! `torpor template list|get|create|rm|build`: the template routes of the REST
//! API, as tables or `--json`. Templates are named by id or by name.

use serde_json::{Map, Value};

use super::client::{encode, Client, Error};
use super::output::{fields, table, text, when};
use crate::cli::{TemplateAction, TemplateCommand, TemplateCreateArgs, TemplateKindArg};

pub fn run(cmd: TemplateCommand) -> i32 {
    Client::run(&cmd.client, |c| act(c, cmd.action))
}

fn act(c: &Client, action: TemplateAction) -> Result<(), Error> {
    match action {
        TemplateAction::List => {
            let Some(v) = c.show("GET", "/v1/templates", None)? else {
                return Ok(());
            };
            let rows: Vec<Vec<String>> = list(&v)
                .iter()
                .map(|t| {
                    vec![
                        text(&t["id"]),
                        text(&t["name"]),
                        text(&t["kind"]),
                        text(&t["state"]),
                        format!("{}MiB", text(&t["mem_mib"])),
                        text(&t["pod"]),
                    ]
                })
                .collect();
            let header = ["ID", "NAME", "KIND", "STATE", "MEM", "POD"];
            print!("{}", table(&header, &rows));
            Ok(())
        }
        TemplateAction::Get(a) => {
            if let Some(v) = c.show("GET", &path(&resolve(c, &a.id)?), None)? {
                print!("{}", describe(&v));
            }
            Ok(())
        }
        TemplateAction::Create(args) => create(c, args),
        TemplateAction::Build(args) => super::template_build::build(c, args),
        TemplateAction::Rm(a) => {
            let id = resolve(c, &a.id)?;
            if c.show("DELETE", &path(&id), None)?.is_some() {
                println!("{id}: deleted");
            }
            Ok(())
        }
    }
}

fn path(id: &str) -> String {
    format!("/v1/templates/{}", encode(id))
}

fn list(v: &Value) -> &[Value] {
    v["templates"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// The id of a template given by id or name: a `tpl_` word is taken as an
/// id, anything else looked up by name (left as it is when nothing matches,
/// for the API to answer 404).
pub fn resolve(c: &Client, key: &str) -> Result<String, Error> {
    if key.starts_with("tpl_") {
        return Ok(key.to_string());
    }
    let v = c.call("GET", "/v1/templates", None)?;
    Ok(list(&v)
        .iter()
        .find(|t| t["name"] == key)
        .map_or_else(|| key.to_string(), |t| text(&t["id"])))
}

/// The template list, for showing names instead of ids (best effort:
/// `Null` when it cannot be had).
pub fn names(c: &Client) -> Value {
    c.call("GET", "/v1/templates", None).unwrap_or(Value::Null)
}

/// A template's name from [`names`], else its id.
pub fn name_of(names: &Value, id: &Value) -> String {
    list(names)
        .iter()
        .find(|t| &t["id"] == id)
        .map_or_else(|| text(id), |t| text(&t["name"]))
}

fn create(c: &Client, args: TemplateCreateArgs) -> Result<(), Error> {
    let kind = match args.kind {
        TemplateKindArg::Probe => "probe",
        TemplateKindArg::Linux => "linux",
    };
    let mut body = Map::new();
    body.insert("name".into(), args.name.into());
    body.insert("kind".into(), kind.into());
    if let Some(n) = args.mem_mib {
        body.insert("mem_mib".into(), n.into());
    }
    if let Some(n) = args.vcpus {
        body.insert("vcpus".into(), n.into());
    }
    if let Some(image) = args.image {
        body.insert("image".into(), image.into());
    }
    if let Some(c) = args.cmdline {
        body.insert("cmdline".into(), c.into());
    }
    if let Some(pod) = args.pod {
        body.insert("pod".into(), pod.into());
    }
    let Some(v) = c.show("POST", "/v1/templates", Some(&Value::Object(body)))? else {
        return Ok(());
    };
    println!("{}", text(&v["id"]));
    if v["state"] != "ready" {
        eprintln!(
            "torpor: {} is {} (see `torpor template get {}`)",
            text(&v["id"]),
            text(&v["state"]),
            text(&v["id"])
        );
    }
    Ok(())
}

/// One template as `key: value` lines.
fn describe(t: &Value) -> String {
    let mut rows = vec![
        ("id", text(&t["id"])),
        ("name", text(&t["name"])),
        ("kind", text(&t["kind"])),
        ("state", text(&t["state"])),
    ];
    if !t["reason"].is_null() {
        rows.push(("reason", text(&t["reason"])));
    }
    rows.extend([
        ("memory", format!("{}MiB", text(&t["mem_mib"]))),
        ("vcpus", text(&t["vcpus"])),
        ("image", text(&t["image"])),
        ("tenant", text(&t["tenant"])),
        ("kernel", text(&t["kernel"])),
        ("rootfs", text(&t["rootfs"])),
        ("snapshot", text(&t["snapshot_dir"])),
        ("created", when(&t["created_at"])),
    ]);
    fields(&rows)
}
