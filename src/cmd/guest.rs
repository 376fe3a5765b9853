//! `torpor vmm exec`, `resumed` and `ping`: talk to torpor-agent in a
//! Linux guest over the VM's hybrid vsock socket (`CONNECT <port>`, then the
//! agent protocol). `torpor vmm files` is in `files.rs`.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use torpor_agent::client::connect_vsock;
use torpor_agent::proto::{ExecRequest, ResumedRequest, Step, StepStatus};
use torpor_agent::AgentClient;

use super::EXIT_FAILURE;
use crate::cli::{GuestAgentArgs, GuestExecArgs};

/// Connects to guest port `port` through the VMM's vsock socket (the
/// agent crate's handshake), then lets reads wait as long as they need.
fn connect(uds: &Path, port: u32) -> Result<UnixStream, String> {
    let stream = connect_vsock(uds, port, Duration::from_secs(10))
        .map_err(|e| format!("{}: {e}", uds.display()))?;
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    stream.set_write_timeout(None).map_err(|e| e.to_string())?;
    Ok(stream)
}

/// Between attempts to reach the agent: short, because `torpor vmm ping`
/// and the first exec after a restore are timed by scripts.
const RETRY_INTERVAL: Duration = Duration::from_millis(25);

/// Connects and greets the agent, retrying until `wait_ms` has passed (the
/// guest may still be booting, or re-accepting after a restore).
pub(super) fn agent(
    uds: &Path,
    port: u32,
    wait_ms: u64,
) -> Result<AgentClient<UnixStream>, String> {
    let deadline = Instant::now() + Duration::from_millis(wait_ms);
    loop {
        let attempt = connect(uds, port)
            .and_then(|s| AgentClient::connect(s, "torpor-cli").map_err(|e| e.to_string()));
        match attempt {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() >= deadline => return Err(format!("no agent reachable: {e}")),
            Err(_) => std::thread::sleep(RETRY_INTERVAL),
        }
    }
}

/// `torpor vmm resumed`: the agent's post-restore hook, with the values
/// from the identity page the VMM wrote at restore.
pub fn resumed(args: GuestAgentArgs) -> i32 {
    let mut client = match agent(&args.vsock_uds, args.port, args.wait_ms) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("torpor: error: {e}");
            return EXIT_FAILURE;
        }
    };
    // The identity page's clock is the restore's moment; by now (an exec or
    // a slow guest in between) it may be seconds old, so send ours.
    let now_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()
        .and_then(|d| u64::try_from(d.as_nanos()).ok());
    let req = ResumedRequest {
        wall_clock_ns: now_ns,
        ..Default::default()
    };
    match client.resumed(req) {
        Ok(reply) => {
            println!("{}", serde_json::to_string(&reply).unwrap_or_default());
            let ok = |s: &Step| s.status == StepStatus::Ok;
            if ok(&reply.clock) && ok(&reply.rng_write) {
                0
            } else {
                eprintln!("torpor: error: the agent could not set the clock or reseed its RNG");
                EXIT_FAILURE
            }
        }
        Err(e) => {
            eprintln!("torpor: error: resumed failed: {e}");
            EXIT_FAILURE
        }
    }
}

/// `torpor vmm ping`: waits for the agent's hello, prints its protocol and
/// version.
pub fn ping(args: GuestAgentArgs) -> i32 {
    match agent(&args.vsock_uds, args.port, args.wait_ms) {
        Ok(client) => {
            let hello = client.agent();
            println!(
                "torpor-agent {} protocol {}",
                hello.agent_version, hello.protocol
            );
            0
        }
        Err(e) => {
            eprintln!("torpor: error: {e}");
            EXIT_FAILURE
        }
    }
}

/// `torpor vmm exec`: prints the command's output, exits with its status.
pub fn exec(args: GuestExecArgs) -> i32 {
    let mut client = match agent(&args.vsock_uds, args.port, args.wait_ms) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("torpor: error: {e}");
            return EXIT_FAILURE;
        }
    };
    let req = ExecRequest {
        argv: args.argv.clone(),
        timeout_ms: (args.timeout_ms > 0).then_some(args.timeout_ms),
        ..Default::default()
    };
    match client.exec_collect(req) {
        Ok(out) => {
            let _ = std::io::stdout().write_all(&out.stdout);
            let _ = std::io::stderr().write_all(&out.stderr);
            match out.exit.code {
                Some(code) => code,
                None => {
                    eprintln!(
                        "torpor: the command ended without an exit code: {:?}",
                        out.exit
                    );
                    EXIT_FAILURE
                }
            }
        }
        Err(e) => {
            eprintln!("torpor: error: exec failed: {e}");
            EXIT_FAILURE
        }
    }
}
