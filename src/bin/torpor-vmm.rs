//! `torpor-vmm`: the process a pod starts for each microVM. It links only
//! the VMM crates (no HTTP, no async runtime, no SQLite), so it execs fast
//! and a paused clone holds little.
//!
//! It reads one `LaunchSpec` (JSON, at most 64 KiB) from stdin, and writes
//! one `LaunchReply` line to stdout: `ready` once its control socket
//! serves, or `failed` with the typed reason. Exit status as `torpor vmm`:
//! 0 when the VM ended in order, 1 when it could not start, 3 when it
//! failed while running. Logs go to stderr (`TORPOR_LOG`).
//!
//! `--fork-server`: a pod's fork server (`torpor_vmm_api::fork`): stdin is
//! the socket its requests come on; each forked child goes on as above
//! with the request's descriptors as its stdin, stdout and stderr.
//!
//! `--cli [--report]`: `torpor vmm` for people, which execs this binary
//! with its spec on stdin so that a VM started by hand is the same small
//! process a pod starts: no reply line (stdout is the guest's console
//! then), errors as `torpor: error: ...` on stderr, and with `--report`
//! the run's report as JSON on stderr at its end.

use std::io::Write;
use std::time::Instant;

use torpor_vmm_api::{LaunchReply, LaunchSpec};

const EXIT_FAILURE: i32 = 1;

/// How this process was asked to run.
struct Mode {
    /// `torpor vmm`'s exec (`--cli`): no reply line.
    cli: bool,
    /// With `--cli`: the report on stderr at the end.
    report: bool,
    /// `--fork-server`: fork a VMM per request on stdin.
    fork_server: bool,
}

fn mode() -> Mode {
    let usage = "usage: torpor-vmm [--cli [--report] | --fork-server] < LAUNCH_SPEC.json  \
                 (torpor's per-VM process; people use `torpor vmm`)";
    let mut mode = Mode {
        cli: false,
        report: false,
        fork_server: false,
    };
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--version" => {
                println!("torpor-vmm {}", env!("CARGO_PKG_VERSION"));
                std::process::exit(0)
            }
            "--cli" if !mode.fork_server => mode.cli = true,
            "--fork-server" if !mode.cli => mode.fork_server = true,
            "--report" if mode.cli => mode.report = true,
            _ => {
                eprintln!("{usage}");
                std::process::exit(2)
            }
        }
    }
    mode
}

fn main() {
    let mut started = Instant::now();
    let mode = mode();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TORPOR_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a VMM's stderr is its log file, whose
        // tail reaches API errors and operators' greps.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if mode.fork_server {
        fork_child();
        // A forked VMM: its start is the fork, not the server's exec.
        started = Instant::now();
    }
    // What `torpor vmm` prints its errors as, for people.
    let me = if mode.cli { "torpor" } else { "torpor-vmm" };
    let spec = match LaunchSpec::read_from(std::io::stdin().lock()) {
        Ok(spec) => spec,
        Err(e) if mode.cli => {
            eprintln!("{me}: error: {e}");
            std::process::exit(EXIT_FAILURE);
        }
        Err(e) => {
            reply(&LaunchReply::Failed(e));
            std::process::exit(EXIT_FAILURE);
        }
    };
    let builtins = [("probe", torpor_probe::PROBE_ELF)];
    let cli = mode.cli;
    let result = torpor_vmm::launch::run(&spec, &builtins, move |pid| {
        if !cli {
            reply(&LaunchReply::Ready {
                pid,
                start_us: started.elapsed().as_micros() as u64,
            })
        }
    });
    match result {
        Ok(report) => {
            if mode.report {
                eprintln!("{}", serde_json::to_string(&report).unwrap_or_default());
            }
            if let Some(message) = report.exit.failure() {
                eprintln!("{me}: error: {message}");
            }
            std::process::exit(report.exit.exit_code())
        }
        Err(e) => {
            eprintln!("{me}: error: {e}");
            if !mode.cli {
                reply(&LaunchReply::Failed(e.vm_error()));
            }
            std::process::exit(EXIT_FAILURE)
        }
    }
}

/// Serves fork requests on stdin; returns in each forked child, whose
/// stdin, stdout and stderr are then its request's.
fn fork_child() {
    use std::os::fd::AsFd;
    let socket = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("torpor-vmm: error: the fork server's socket: {e}");
            std::process::exit(EXIT_FAILURE)
        }
    };
    if let Err(e) = torpor_vmm::fork_server::serve(socket) {
        // Its stderr may not be its log yet: the reply line may not reach
        // the pod either, which then sees the child exit without one.
        eprintln!("torpor-vmm: error: {e}");
        std::process::exit(EXIT_FAILURE)
    }
}

/// Writes the reply line; a pod that stopped listening is no error here.
fn reply(r: &LaunchReply) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(r.to_line().as_bytes());
    let _ = out.flush();
}
