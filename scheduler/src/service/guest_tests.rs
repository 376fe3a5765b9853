//! The service's agent glue against the real torpor-agent server, behind a
//! unix socket that speaks the VMM's hybrid vsock handshake (`CONNECT
//! <port>` → `OK <n>`) the way `torpor vmm --vsock-uds` does.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_agent::server::Stream;
use torpor_agent::{Agent, AgentConfig, FakeCall, FakeOps, IdentityPage};

use super::*;

/// `name` in `dir`, as a string.
fn file(dir: &tempfile::TempDir, name: &str) -> String {
    dir.path().join(name).to_string_lossy().into_owned()
}

/// Reads the handshake line a byte at a time.
fn read_line(s: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while s.read(&mut b).unwrap_or(0) == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    String::from_utf8_lossy(&line).into_owned()
}

/// What the fake VMM socket does with each connection.
#[derive(Clone, Copy)]
pub(in crate::service) enum Behaviour {
    /// Answer `CONNECT 52` with OK and hand the stream to the agent.
    Agent,
    /// Refuse every port (no listener in the guest).
    Refuse,
    /// Say OK, then hang up (the agent died).
    HangUp,
    /// The first connection is the agent's; every later one is never
    /// answered (a guest that stopped while a call ran on it).
    StallAfterFirst,
    /// The first connection greets as the agent does, reads one request
    /// and closes (a restored guest's driver handling its transport reset
    /// late); the others are the agent's.
    CloseFirstCall,
}

/// Greets as the agent does, reads one request, then closes.
fn greet_then_close(mut conn: UnixStream) {
    use torpor_agent::frame::{encode_frame, read_message, MAX_FRAME};
    conn.write_all(b"OK 1073741824\n").unwrap();
    let Ok(Some(hello)) = read_message::<torpor_agent::proto::Request>(&mut conn, MAX_FRAME) else {
        return;
    };
    let reply = serde_json::json!({"id": hello.id, "type": "hello",
        "protocol": {"major": 1, "minor": 4}, "agent_version": "closing"});
    conn.write_all(&encode_frame(&reply, MAX_FRAME).unwrap())
        .unwrap();
    let _ = read_message::<torpor_agent::proto::Request>(&mut conn, MAX_FRAME);
}

/// A hybrid vsock socket in `dir` in front of a real agent with `ops`.
pub(in crate::service) fn vsock_agent(
    dir: &Path,
    ops: Arc<FakeOps>,
    behaviour: Behaviour,
) -> AgentLink {
    let uds = dir.join(VSOCK_FILE);
    let listener = UnixListener::bind(&uds).unwrap();
    let agent = Agent::new(AgentConfig::new(ops));
    let closed_one = Arc::new(AtomicBool::new(false));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let agent = Arc::clone(&agent);
            let closed_one = Arc::clone(&closed_one);
            std::thread::spawn(move || {
                let line = read_line(&mut conn);
                match behaviour {
                    Behaviour::CloseFirstCall if !closed_one.swap(true, Ordering::SeqCst) => {
                        greet_then_close(conn)
                    }
                    Behaviour::StallAfterFirst if closed_one.swap(true, Ordering::SeqCst) => {
                        // Held without a word until the host gives up.
                        let _ = conn.read(&mut [0u8; 1]);
                    }
                    Behaviour::Agent | Behaviour::CloseFirstCall | Behaviour::StallAfterFirst
                        if line == format!("CONNECT {DEFAULT_VSOCK_PORT}") =>
                    {
                        conn.write_all(b"OK 1073741824\n").unwrap();
                        agent.serve_connection(Stream::Unix(conn));
                    }
                    Behaviour::HangUp => {
                        let _ = conn.write_all(b"OK 1073741825\n");
                    }
                    _ => drop(conn),
                }
            });
        }
    });
    AgentLink::new("sbx_0123456789abcdef", uds)
}

fn exec_req(argv: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        timeout_ms: Some(20_000),
        ..Default::default()
    }
}

#[test]
fn exec_collects_output_status_stdin_env_and_cwd() {
    let dir = tempfile::tempdir().unwrap();
    let link = vsock_agent(dir.path(), Arc::new(FakeOps::new()), Behaviour::Agent);
    let mut req = exec_req(&[
        "sh",
        "-c",
        "read line; echo \"$line $GREETING $(pwd)\"; echo oops >&2; exit 7",
    ]);
    req.stdin = Some(b"from-stdin\n".to_vec());
    req.env.insert("GREETING".into(), "hi".into());
    req.cwd = Some(dir.path().to_string_lossy().into_owned());
    let out = link.exec(req, &Cancel::default()).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("from-stdin hi {}\n", dir.path().display())
    );
    assert_eq!(out.stderr, b"oops\n");
    assert_eq!(out.exit.code, Some(7));
    assert!(!out.exit.timed_out && !out.exit.truncated);

    // A timeout kills it and says so; a size limit truncates and says so.
    let mut slow = exec_req(&["sleep", "30"]);
    slow.timeout_ms = Some(200);
    let out = link.exec(slow, &Cancel::default()).unwrap();
    assert!(out.exit.timed_out, "{:?}", out.exit);
    assert_eq!(out.exit.code, None);
    let mut big = exec_req(&["sh", "-c", "head -c 100000 /dev/zero"]);
    big.max_output_bytes = Some(1000);
    let out = link.exec(big, &Cancel::default()).unwrap();
    assert!(out.exit.truncated);
    assert_eq!(out.stdout.len(), 1000);
    assert_eq!(out.exit.stdout_bytes, 100_000);

    // A program that does not exist is the agent's error, with its errno.
    match link.exec(exec_req(&["/no/such/program"]), &Cancel::default()) {
        Err(GuestError::Agent { error, .. }) => assert_eq!(error.code, "ENOENT"),
        other => panic!("{other:?}"),
    }
}

/// A cancelled exec (its API client went away) ends at once, and the
/// agent kills the command: it does not run on to its timeout.
#[test]
fn a_cancelled_exec_ends_and_its_command_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let link = vsock_agent(dir.path(), Arc::new(FakeOps::new()), Behaviour::Agent);
    let pidfile = file(&dir, "pid");
    let req = exec_req(&["sh", "-c", &format!("echo $$ > {pidfile}; exec sleep 30")]);
    let cancel = Cancel::default();
    let started = Instant::now();
    let runner = {
        let cancel = cancel.clone();
        std::thread::spawn(move || link.exec(req, &cancel))
    };
    let pid = loop {
        let text = std::fs::read_to_string(&pidfile).unwrap_or_default();
        if let Ok(pid) = text.trim().parse::<u32>() {
            break pid;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the command never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    cancel.cancel();
    let result = runner.join().unwrap();
    assert!(result.is_err(), "{result:?}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the exec ran on after its cancel"
    );
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    while proc_dir.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the command (pid {pid}) still runs after its exec was cancelled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn exec_streams_chunks_as_they_come() {
    let dir = tempfile::tempdir().unwrap();
    let link = vsock_agent(dir.path(), Arc::new(FakeOps::new()), Behaviour::Agent);
    let started = Instant::now();
    let mut chunks: Vec<(OutputKind, Vec<u8>, Duration)> = Vec::new();
    let exit = link
        .exec_streaming(
            exec_req(&[
                "sh",
                "-c",
                "echo one; sleep 0.5; echo two >&2; sleep 0.5; echo three",
            ]),
            &Cancel::default(),
            &mut |kind, data| chunks.push((kind, data.to_vec(), started.elapsed())),
        )
        .unwrap();
    assert_eq!(exit.code, Some(0));
    let text = |k: OutputKind| -> String {
        chunks
            .iter()
            .filter(|c| c.0 == k)
            .map(|c| String::from_utf8_lossy(&c.1).into_owned())
            .collect()
    };
    assert_eq!(text(OutputKind::Stdout), "one\nthree\n");
    assert_eq!(text(OutputKind::Stderr), "two\n");
    // "one" arrived before the command ended: streamed, not collected.
    let first = chunks.first().expect("no chunk");
    assert_eq!(first.1, b"one\n");
    let last = chunks.last().unwrap();
    assert!(first.2 < last.2, "{chunks:?}");
}

#[test]
fn files_write_read_list_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let link = vsock_agent(dir.path(), Arc::new(FakeOps::new()), Behaviour::Agent);
    let path = file(&dir, "sub/dir/data.bin");
    let data: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    assert_eq!(link.write_file(&path, &data, Some(0o600)).unwrap(), 70_000);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        data,
        "written through the agent"
    );
    assert_eq!(link.read_file(&path, MAX_READ_BYTES).unwrap(), data);

    let listing = link.list_dir(&file(&dir, "sub/dir")).unwrap();
    assert_eq!(listing.entries.len(), 1);
    assert_eq!(listing.entries[0].name, "data.bin");
    assert_eq!(listing.entries[0].size, 70_000);
    assert_eq!(listing.entries[0].mode, 0o600);
    assert_eq!(listing.entries[0].kind, FileKind::File);

    match link.read_file(&path, 1000) {
        Err(GuestError::TooLarge { size, limit, .. }) => assert_eq!((size, limit), (70_000, 1000)),
        other => panic!("{other:?}"),
    }
    match link.read_file(&file(&dir, "missing"), MAX_READ_BYTES) {
        Err(GuestError::Agent { error, .. }) => assert_eq!(error.code, "ENOENT"),
        other => panic!("{other:?}"),
    }
    match link.list_dir(&path) {
        Err(GuestError::Agent { error, .. }) => assert_eq!(error.code, "ENOTDIR"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn resumed_sets_clock_reseeds_from_the_page_and_names_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let page = IdentityPage {
        generation: 3,
        seed: [7; 32],
        wall_clock_ns: 1,
    };
    let ops = Arc::new(FakeOps::new().root(true).page(page));
    let link = vsock_agent(dir.path(), ops.clone(), Behaviour::Agent);
    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let reply = link.resumed("sbx_0123456789abcdef", || Ok(())).unwrap();
    assert_eq!(reply.generation, Some(3));
    let calls = ops.calls();
    let clock = calls.iter().find_map(|c| match c {
        FakeCall::SetWallClock(ns) => Some(*ns),
        _ => None,
    });
    // The host's clock now, not the page's (older) time.
    assert!(clock.is_some_and(|ns| ns >= before), "{calls:?}");
    assert!(
        calls.contains(&FakeCall::WriteUrandom(vec![7; 32])),
        "{calls:?}"
    );
    assert!(calls.contains(&FakeCall::SetHostname("sbx-0123456789abcdef".into())));
    assert!(calls.contains(&FakeCall::WriteIdentity("sbx_0123456789abcdef".into())));
}

#[test]
fn resumed_goes_on_when_the_guest_closes_its_first_connection() {
    let dir = tempfile::tempdir().unwrap();
    let page = IdentityPage {
        generation: 2,
        seed: [9; 32],
        wall_clock_ns: 1,
    };
    let ops = Arc::new(FakeOps::new().root(true).page(page));
    let link = vsock_agent(dir.path(), ops.clone(), Behaviour::CloseFirstCall);
    let reply = link.resumed("sbx_0123456789abcdef", || Ok(())).unwrap();
    assert_eq!(reply.generation, Some(2));
    assert!(
        ops.calls().contains(&FakeCall::WriteUrandom(vec![9; 32])),
        "{:?}",
        ops.calls()
    );
    // Other calls are not tried again: an exec may have run.
    let dir = tempfile::tempdir().unwrap();
    let ops = Arc::new(FakeOps::new().root(true));
    let link = vsock_agent(dir.path(), ops, Behaviour::CloseFirstCall);
    match link.exec(exec_req(&["true"]), &Cancel::default()) {
        Err(GuestError::Unreachable { reason, .. }) => {
            assert!(reason.contains("closed the connection"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn resumed_fails_clearly_when_a_step_fails() {
    let dir = tempfile::tempdir().unwrap();
    let ops = Arc::new(
        FakeOps::new()
            .failing("SetWallClock", libc::EPERM)
            .page(IdentityPage {
                generation: 1,
                seed: [1; 32],
                wall_clock_ns: 1,
            }),
    );
    let link = vsock_agent(dir.path(), ops, Behaviour::Agent);
    match link.resumed("sbx_0123456789abcdef", || Ok(())) {
        Err(e @ GuestError::ResumeHook { .. }) => {
            let text = e.to_string();
            assert!(text.contains("clock") && text.contains("EPERM"), "{text}");
        }
        other => panic!("{other:?}"),
    }
    // No identity page: the seed is missing, so the reseed did not happen.
    let dir = tempfile::tempdir().unwrap();
    let link = vsock_agent(dir.path(), Arc::new(FakeOps::new()), Behaviour::Agent);
    match link.resumed("sbx_0123456789abcdef", || Ok(())) {
        Err(e @ GuestError::ResumeHook { .. }) => {
            assert!(e.to_string().contains("rng reseed"), "{e}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_exec_on_a_guest_that_stops_answering_fails_within_two_checks() {
    let dir = tempfile::tempdir().unwrap();
    let mut link = vsock_agent(
        dir.path(),
        Arc::new(FakeOps::new()),
        Behaviour::StallAfterFirst,
    );
    link.liveness = Duration::from_millis(300);
    let started = Instant::now();
    // Silent for 20 s, with a 20 s timeout: without the check, the exec
    // would wait for all of it.
    let mut req = exec_req(&["sleep", "20"]);
    req.timeout_ms = Some(20_000);
    match link.exec(req, &Cancel::default()) {
        Err(e @ GuestError::Unreachable { .. }) => {
            let shown = e.to_string();
            assert!(shown.contains("stopped answering"), "{shown}");
            assert!(!shown.contains(dir.path().to_str().unwrap()), "{shown}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the stalled guest held the exec for {:?}",
        started.elapsed()
    );
}

#[test]
fn a_silent_exec_on_a_guest_that_answers_runs_to_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut link = vsock_agent(dir.path(), Arc::new(FakeOps::new()), Behaviour::Agent);
    // Checked about ten times while the command says nothing.
    link.liveness = Duration::from_millis(100);
    let req = exec_req(&["sh", "-c", "sleep 1; echo done"]);
    let out = link.exec(req, &Cancel::default()).unwrap();
    assert_eq!(out.stdout, b"done\n");
    let mut chunks = Vec::new();
    let exit = link
        .exec_streaming(
            exec_req(&["sh", "-c", "echo a; sleep 1; echo b"]),
            &Cancel::default(),
            &mut |_, data| chunks.push(data.to_vec()),
        )
        .unwrap();
    assert_eq!(exit.code, Some(0));
    assert_eq!(chunks.concat(), b"a\nb\n");
}

#[test]
fn a_gone_agent_is_unreachable_not_a_hang() {
    // No socket at all.
    let dir = tempfile::tempdir().unwrap();
    let link = AgentLink::new("sbx_x", dir.path().join(VSOCK_FILE));
    match link.exec(exec_req(&["true"]), &Cancel::default()) {
        // The host's paths stay out of what API clients are told.
        Err(e @ GuestError::Unreachable { .. }) => {
            let shown = e.to_string();
            assert!(!shown.contains(dir.path().to_str().unwrap()), "{shown}");
        }
        other => panic!("{other:?}"),
    }
    // A VMM whose guest has no listener on the port.
    let refused = vsock_agent(dir.path(), Arc::new(FakeOps::new()), Behaviour::Refuse);
    match refused.list_dir("/") {
        Err(e @ GuestError::Unreachable { .. }) => {
            assert!(e.to_string().contains("refused"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    // Refused by a VMM whose guest shut down: the error says that, not
    // only the refusal (a guest's triple fault read as an agent refusing).
    std::fs::write(
        super::super::vmm::VmmFiles::in_dir(dir.path()).log,
        "WARN torpor_vmm::vstate::vcpu: the guest shut down (KVM_EXIT_SHUTDOWN: a triple \
         fault or a reset) vcpu=0 rip=0xfff0\n",
    )
    .unwrap();
    match refused.list_dir("/") {
        Err(e @ GuestError::Unreachable { .. }) => {
            let shown = e.to_string();
            assert!(
                shown.contains("refused") && shown.contains("the guest shut down"),
                "{shown}"
            );
            assert!(!shown.contains("rip="), "{shown}");
        }
        other => panic!("{other:?}"),
    }
    // The agent accepts, then dies.
    let dir2 = tempfile::tempdir().unwrap();
    let hangup = vsock_agent(dir2.path(), Arc::new(FakeOps::new()), Behaviour::HangUp);
    match hangup.read_file("/etc/hostname", MAX_READ_BYTES) {
        Err(e @ GuestError::Unreachable { .. }) => {
            let shown = e.to_string();
            assert!(!shown.contains("shut down"), "{shown}");
        }
        other => panic!("{other:?}"),
    }
    // The same, after its VMM said the guest shut down (a triple fault):
    // the error says so, without the VMM's own words.
    let files = super::super::vmm::VmmFiles::in_dir(dir2.path());
    std::fs::write(
        &files.log,
        "WARN torpor_vmm::vstate::vcpu: the guest shut down (KVM_EXIT_SHUTDOWN: a triple \
         fault or a reset) vcpu=0 rip=0xfff0\n",
    )
    .unwrap();
    match hangup.exec(exec_req(&["true"]), &Cancel::default()) {
        Err(e @ GuestError::Unreachable { .. }) => {
            let shown = e.to_string();
            assert!(shown.contains("the guest shut down"), "{shown}");
            assert!(!shown.contains("rip="), "{shown}");
        }
        other => panic!("{other:?}"),
    }
    // Waiting for an agent stops as soon as the VM is known to be gone.
    let started = Instant::now();
    match refused.resumed("sbx_x", || Err("the sandbox's VMM exited".into())) {
        Err(e @ GuestError::Unreachable { .. }) => {
            assert!(e.to_string().contains("VMM exited"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < AGENT_WAIT);
}

#[test]
fn hostnames_from_sandbox_ids() {
    assert_eq!(hostname_for("sbx_00ff"), "sbx-00ff");
    assert!(torpor_agent::resumed::valid_hostname(&hostname_for(
        crate::model::SandboxId::generate().as_str()
    )));
}
