//! `torpor vmm exec`: a command in the guest through torpor-agent, over the
//! VM's hybrid vsock socket (`CONNECT <port>` then the agent protocol).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use torpor_agent::proto::ExecRequest;
use torpor_agent::AgentClient;

use super::EXIT_FAILURE;
use crate::cli::GuestExecArgs;

/// Connects to guest port `port` through the VMM's vsock socket.
fn connect(args: &GuestExecArgs) -> Result<UnixStream, String> {
    let mut stream = UnixStream::connect(&args.vsock_uds)
        .map_err(|e| format!("cannot connect to {}: {e}", args.vsock_uds.display()))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(format!("CONNECT {}\n", args.port).as_bytes())
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    if !line.starts_with("OK ") {
        return Err(format!(
            "the guest refused port {}: {:?}",
            args.port,
            line.trim()
        ));
    }
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok(stream)
}

pub fn exec(args: GuestExecArgs) -> i32 {
    let deadline = Instant::now() + Duration::from_millis(args.wait_ms);
    let mut client = loop {
        match connect(&args)
            .and_then(|s| AgentClient::connect(s, "torpor-cli").map_err(|e| e.to_string()))
        {
            Ok(c) => break c,
            Err(e) if Instant::now() >= deadline => {
                eprintln!("torpor: error: no agent reachable: {e}");
                return EXIT_FAILURE;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
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
