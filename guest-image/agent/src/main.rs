//! `torpor-agent`: listen on vsock (in the guest) or a unix socket (tests)
//! and serve the torpor agent protocol.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use torpor_agent::system::DEFAULT_IDENTITY_FILE;
use torpor_agent::{Agent, AgentConfig, FakeOps, ListenAddr, Listener, RealOps, SystemOps};

/// The in-guest agent of torpor: exec, files, and the post-restore hook
/// (clock, entropy, hostname, identity), over vsock.
#[derive(Parser, Debug)]
#[command(name = "torpor-agent", version)]
struct Cli {
    /// Where to listen: `vsock:PORT` (in the guest) or `unix:/path`.
    #[arg(long, default_value = "vsock:52")]
    listen: ListenAddr,
    /// File the `resumed` hook writes the sandbox id to.
    #[arg(long, default_value = DEFAULT_IDENTITY_FILE)]
    identity_file: PathBuf,
    /// Physical-memory device the VMM's identity page is read from.
    #[arg(long, default_value = "/dev/mem")]
    mem_device: PathBuf,
    /// Offset of the identity page in --mem-device (guest-physical address).
    #[arg(long, default_value = "0x9e000", value_parser = parse_u64)]
    identity_page_addr: u64,
    /// Do not really set the clock, hostname or entropy in `resumed`: only
    /// report success (for running the agent on a development host).
    #[arg(long)]
    fake_system: bool,
    /// Log connections and protocol errors to stderr.
    #[arg(long, short)]
    verbose: bool,
}

fn parse_u64(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("{s:?}: {e}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if std::env::var_os("PATH").is_none() {
        // Started by init with an empty environment: give execs a sane PATH.
        // Single-threaded here, before any thread exists.
        std::env::set_var(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        );
    }
    let ops: Arc<dyn SystemOps> = if cli.fake_system {
        Arc::new(FakeOps::new().root(true))
    } else {
        Arc::new(RealOps {
            identity_file: cli.identity_file,
            mem_device: cli.mem_device,
            identity_page_addr: cli.identity_page_addr,
        })
    };
    let listener = match Listener::bind(&cli.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("torpor-agent: cannot listen on {:?}: {e}", cli.listen);
            return ExitCode::from(1);
        }
    };
    eprintln!(
        "torpor-agent {} (protocol {}) listening on {:?}",
        torpor_agent::AGENT_VERSION,
        torpor_agent::PROTOCOL_VERSION,
        cli.listen
    );
    let mut cfg = AgentConfig::new(ops);
    cfg.verbose = cli.verbose;
    let agent = Agent::new(cfg);
    match agent.serve(&listener) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("torpor-agent: {e}");
            ExitCode::from(1)
        }
    }
}
