//! `torpor image list|upload|rm`: the images Linux templates are built
//! from, through the REST API (upload and rm need an admin token).

use super::client::{encode, Client, Error};
use super::output::text;
use crate::cli::{ImageAction, ImageCommand};

pub fn run(cmd: ImageCommand) -> i32 {
    Client::run(&cmd.client, |c| act(c, cmd.action))
}

fn act(c: &Client, action: ImageAction) -> Result<(), Error> {
    match action {
        ImageAction::List => {
            if let Some(v) = c.show("GET", "/v1/images", None)? {
                for name in v["images"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                {
                    println!("{}", text(name));
                }
            }
            Ok(())
        }
        ImageAction::Upload {
            name,
            kernel,
            rootfs,
        } => {
            for (part, file) in [("kernel", kernel), ("rootfs", rootfs)] {
                let Some(file) = file else { continue };
                let bytes = std::fs::read(&file).map_err(|e| {
                    Error::Transport(format!("cannot read {}: {e}", file.display()))
                })?;
                let path = format!("/v1/images/{}/{part}", encode(&name));
                c.raw("PUT", &path, Some(("application/octet-stream", &bytes)))?;
                println!("{name}: {part} uploaded ({} bytes)", bytes.len());
            }
            Ok(())
        }
        ImageAction::Rm { name } => {
            let path = format!("/v1/images/{}", encode(&name));
            if c.show("DELETE", &path, None)?.is_some() {
                println!("{name}: removed");
            }
            Ok(())
        }
    }
}
