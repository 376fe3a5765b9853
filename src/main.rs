//! `torpor`: the one user-facing binary. Subcommands live in `cmd/`.

mod cli;
mod cmd;

use clap::Parser;

fn main() {
    let cli = cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a VMM's stderr is its log file, whose
        // tail reaches API errors and operators' greps.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TORPOR_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    std::process::exit(cmd::dispatch(cli));
}
