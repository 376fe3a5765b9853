//! `torpor token create|list|rm`: the token routes of the REST API (an
//! admin token is needed). A new token is printed once; the server keeps
//! only its SHA-256.

use serde_json::json;

use super::client::{encode, Client, Error};
use super::output::{table, text, when};
use crate::cli::{TokenAction, TokenCommand};

pub fn run(cmd: TokenCommand) -> i32 {
    Client::run(&cmd.client, |c| act(c, cmd.action))
}

fn act(c: &Client, action: TokenAction) -> Result<(), Error> {
    match action {
        TokenAction::Create { tenant, admin } => {
            let scope = if admin { "admin" } else { "tenant" };
            let body = json!({"tenant": tenant, "scope": scope});
            let Some(v) = c.show("POST", "/v1/tokens", Some(&body))? else {
                return Ok(());
            };
            eprintln!(
                "torpor: token {} for tenant {} ({}); it is shown this once:",
                text(&v["id"]),
                text(&v["tenant"]),
                text(&v["scope"])
            );
            println!("{}", text(&v["token"]));
            Ok(())
        }
        TokenAction::List => {
            let Some(v) = c.show("GET", "/v1/tokens", None)? else {
                return Ok(());
            };
            let rows: Vec<Vec<String>> = v["tokens"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|t| {
                    vec![
                        text(&t["id"]),
                        text(&t["tenant"]),
                        text(&t["scope"]),
                        when(&t["created_at"]),
                    ]
                })
                .collect();
            print!("{}", table(&["ID", "TENANT", "SCOPE", "CREATED"], &rows));
            Ok(())
        }
        TokenAction::Rm { id } => {
            let path = format!("/v1/tokens/{}", encode(&id));
            if c.show("DELETE", &path, None)?.is_some() {
                println!("{id}: revoked");
            }
            Ok(())
        }
    }
}
