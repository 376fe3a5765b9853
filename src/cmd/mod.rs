//! One module per top-level subcommand (`plan calibrate` in its own).

mod checkpoint;
mod client;
mod cluster;
mod doctor;
mod files;
mod guest;
mod image;
mod nested_parts;
mod nested_pod;
mod nested_record;
mod nested_templates;
mod output;
pub mod plan;
pub mod plan_calibrate;
mod pod;
mod sandbox;
mod sandbox_guest;
mod serve;
mod server;
mod template;
mod template_build;
mod token;
mod vmm;

use crate::cli::{Cli, Command};

/// Exit statuses shared by all subcommands.
pub const EXIT_OK: i32 = 0;
pub const EXIT_FAILURE: i32 = 1;

pub fn dispatch(cli: Cli) -> i32 {
    match cli.command {
        Command::Vmm(v) => vmm::run(*v),
        Command::Doctor { json } => doctor::run(json),
        Command::Serve(args) => serve::run(*args),
        Command::Sandbox(c) => sandbox::run(c),
        Command::Template(c) => template::run(c),
        Command::Image(c) => image::run(c),
        Command::Token(c) => token::run(c),
        Command::Pod(c) => pod::run(c),
        Command::Plan(c) => plan::run(*c),
        Command::NestedVolumePipe { socket } => {
            match torpor_scheduler::service::volume_gateway::pipe_stdio(&socket) {
                Ok(()) => EXIT_OK,
                Err(_) => EXIT_FAILURE,
            }
        }
        Command::ProbeImage { out } => match std::fs::write(&out, torpor_probe::PROBE_ELF) {
            Ok(()) => EXIT_OK,
            Err(e) => {
                eprintln!("torpor: error: cannot write {}: {e}", out.display());
                EXIT_FAILURE
            }
        },
    }
}
