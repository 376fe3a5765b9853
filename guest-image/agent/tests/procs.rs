//! Spawned processes (protocol 1.1) against a real agent on this host:
//! they outlive the connection that started them, reconnect by pid, take
//! streamed stdin, run on a PTY that resizes, run as a named user, list
//! and signal.

mod common;

use common::{default_agent, wait_dead, ScratchPaths};
use std::collections::BTreeMap;
use std::time::Duration;
use torpor_agent::proto::{AttachRequest, PtySize, SpawnRequest};
use torpor_agent::{AgentClient, AttachEvent, ClientError, OutputKind};

fn sh(script: &str) -> SpawnRequest {
    SpawnRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

fn attach_all(
    c: &mut AgentClient<std::os::unix::net::UnixStream>,
    pid: u32,
    replay: bool,
) -> (Vec<u8>, Vec<u8>, Vec<u8>, torpor_agent::proto::ExitReply) {
    let (mut out, mut err, mut pty) = (Vec::new(), Vec::new(), Vec::new());
    let req = AttachRequest {
        pid,
        replay,
        keepalive_ms: Some(200),
    };
    let exit = c
        .attach(req, |e| {
            match e {
                AttachEvent::Output(OutputKind::Stdout, d) => out.extend_from_slice(d),
                AttachEvent::Output(OutputKind::Stderr, d) => err.extend_from_slice(d),
                AttachEvent::Pty(d) => pty.extend_from_slice(d),
                AttachEvent::Keepalive => {}
            }
            true
        })
        .unwrap()
        .expect("attach ends with exit");
    (out, err, pty, exit)
}

#[test]
fn spawned_output_replays_and_exit_code_arrives() {
    let agent = default_agent();
    let mut c = agent.client();
    let mut req = sh("echo out; echo err >&2; echo \"$FOO\"; pwd; exit 3");
    req.env = BTreeMap::from([("FOO".to_string(), "bar".to_string())]);
    req.cwd = Some(agent.dir.file(""));
    let pid = c.spawn(req).unwrap();
    let (out, err, pty, exit) = attach_all(&mut c, pid, true);
    let pwd = agent.dir.path().to_str().unwrap();
    assert_eq!(
        String::from_utf8(out).unwrap(),
        format!("out\nbar\n{pwd}\n")
    );
    assert_eq!(err, b"err\n");
    assert!(pty.is_empty());
    assert_eq!(exit.code, Some(3));
    // An exited process is not listed, and cannot be signalled.
    assert!(c.processes().unwrap().iter().all(|p| p.pid != pid));
    let e = c.signal(pid, 15).unwrap_err();
    assert!(
        matches!(e, ClientError::Agent(ref r) if r.code == "ESRCH"),
        "{e}"
    );
    // But still attachable for its exit.
    assert_eq!(attach_all(&mut c, pid, false).3.code, Some(3));
}

#[test]
fn a_process_outlives_its_connection_and_reconnects_by_pid() {
    let agent = default_agent();
    let mut first = agent.client();
    let mut req = sh("echo started; read line; echo \"got $line\"; cat; echo done");
    req.stdin = true;
    req.tag = Some("worker".into());
    let pid = first.spawn(req).unwrap();
    drop(first);
    std::thread::sleep(Duration::from_millis(200));
    let mut second = agent.client();
    let listed = second.processes().unwrap();
    let me = listed.iter().find(|p| p.pid == pid).expect("still running");
    assert_eq!(me.tag.as_deref(), Some("worker"));
    assert_eq!(me.argv[0], "/bin/sh");
    assert!(!me.pty);
    // Streaming stdin: several inputs, then EOF ends `cat`.
    second.input(pid, b"hello\n").unwrap();
    second.input(pid, b"more").unwrap();
    second.close_stdin(pid).unwrap();
    let mut third = agent.client();
    let (out, _, _, exit) = attach_all(&mut third, pid, true);
    assert_eq!(
        String::from_utf8(out).unwrap(),
        "started\ngot hello\nmoredone\n"
    );
    assert_eq!(exit.code, Some(0));
    // A process without stdin refuses input.
    let pid = second.spawn(sh("sleep 0.1")).unwrap();
    let e = second.input(pid, b"x").unwrap_err();
    assert!(
        matches!(e, ClientError::Agent(ref r) if r.code == "EPIPE"),
        "{e}"
    );
}

#[test]
fn signals_reach_the_whole_group() {
    let agent = default_agent();
    let mut c = agent.client();
    let pid = c.spawn(sh("sleep 300 & echo $!; wait")).unwrap();
    let mut line = Vec::new();
    let mut watcher = agent.client();
    // Read the grandchild's pid, then stop following.
    watcher
        .attach(
            AttachRequest {
                pid,
                replay: true,
                keepalive_ms: None,
            },
            |e| {
                if let AttachEvent::Output(_, d) = e {
                    line.extend_from_slice(d);
                }
                !line.ends_with(b"\n")
            },
        )
        .unwrap();
    let grandchild: i32 = String::from_utf8(line).unwrap().trim().parse().unwrap();
    assert!(c.processes().unwrap().iter().any(|p| p.pid == pid));
    let e = c.signal(pid, 0).unwrap_err();
    assert!(
        matches!(e, ClientError::Agent(ref r) if r.code == "EINVAL"),
        "{e}"
    );
    c.signal(pid, 9).unwrap();
    let exit = attach_all(&mut c, pid, false).3;
    assert_eq!(exit.signal, Some(9));
    assert!(wait_dead(grandchild, Duration::from_secs(5)));
    let e = c.signal(99_999_999, 9).unwrap_err();
    assert!(
        matches!(e, ClientError::Agent(ref r) if r.code == "ESRCH"),
        "{e}"
    );
}

#[test]
fn a_pty_process_sees_a_terminal_that_resizes() {
    let agent = default_agent();
    let mut c = agent.client();
    let mut req = sh("stty size; read x; stty size; test -t 0 && echo tty; exit 5");
    req.pty = Some(PtySize {
        cols: 100,
        rows: 30,
    });
    let pid = c.spawn(req).unwrap();
    assert!(c.processes().unwrap().iter().any(|p| p.pid == pid && p.pty));
    // Wait for the first size to be printed before resizing.
    let mut seen = Vec::new();
    let mut follower = agent.client();
    follower
        .attach(
            AttachRequest {
                pid,
                replay: true,
                keepalive_ms: None,
            },
            |e| {
                if let AttachEvent::Pty(d) = e {
                    seen.extend_from_slice(d);
                }
                !String::from_utf8_lossy(&seen).contains("30 100")
            },
        )
        .unwrap();
    c.resize(pid, 132, 43).unwrap();
    let e = c.close_stdin(pid).unwrap_err();
    assert!(
        matches!(e, ClientError::Agent(ref r) if r.code == "EINVAL"),
        "{e}"
    );
    c.input(pid, b"go\n").unwrap();
    let (out, err, pty, exit) = attach_all(&mut c, pid, true);
    assert!(out.is_empty() && err.is_empty());
    let text = String::from_utf8_lossy(&pty);
    assert!(text.contains("30 100"), "{text:?}");
    assert!(text.contains("43 132"), "{text:?}");
    assert!(text.contains("tty"), "{text:?}");
    assert_eq!(exit.code, Some(5));
    // Sizes out of range are refused.
    let mut bad = sh("true");
    bad.pty = Some(PtySize { cols: 0, rows: 24 });
    assert!(c.spawn(bad).is_err());
}

#[test]
fn a_named_user_runs_with_its_ids_home_and_environment() {
    let agent = default_agent();
    let mut c = agent.client();
    // This host runs the tests as some user; that user's name must work.
    // SAFETY: no preconditions.
    let uid = unsafe { libc::geteuid() };
    let me = torpor_agent::users::user_name(uid).expect("the test user has a name");
    let home = torpor_agent::users::by_name(&me).unwrap().home;
    let mut req = sh("id -u; echo \"$USER $HOME\"; pwd");
    req.user = Some(me.clone());
    let pid = c.spawn(req).unwrap();
    let (out, _, _, exit) = attach_all(&mut c, pid, true);
    assert_eq!(exit.code, Some(0));
    let want_cwd = if home.is_dir() {
        home.to_str().unwrap().to_string()
    } else {
        "/".into()
    };
    assert_eq!(
        String::from_utf8(out).unwrap(),
        format!("{uid}\n{me} {}\n{want_cwd}\n", home.display())
    );
    // Root may switch users: `nobody` runs with nobody's uid.
    if uid == 0 {
        if let Ok(nobody) = torpor_agent::users::by_name("nobody") {
            let mut req = sh("id -u");
            req.user = Some("nobody".into());
            req.cwd = Some("/".into());
            let pid = c.spawn(req).unwrap();
            let (out, _, _, _) = attach_all(&mut c, pid, true);
            assert_eq!(
                String::from_utf8(out).unwrap().trim(),
                nobody.uid.to_string()
            );
        }
    }
    let mut req = sh("true");
    req.user = Some("no-such-user-torpor".into());
    let e = c.spawn(req).unwrap_err();
    assert!(
        matches!(e, ClientError::Agent(ref r) if r.code == "ENOENT"),
        "{e}"
    );
}

#[test]
fn the_process_table_is_bounded() {
    let agent = common::start_agent_with(torpor_agent::FakeOps::new().root(true), |cfg| {
        cfg.max_processes = 2
    });
    let mut c = agent.client();
    let a = c.spawn(sh("sleep 30")).unwrap();
    let b = c.spawn(sh("sleep 30")).unwrap();
    let e = c.spawn(sh("true")).unwrap_err();
    assert!(
        matches!(e, ClientError::Agent(ref r) if r.code == "EAGAIN"),
        "{e}"
    );
    // An exited process makes room.
    c.signal(a, 9).unwrap();
    attach_all(&mut c, a, false);
    let d = c.spawn(sh("true")).unwrap();
    assert!(d != b);
    c.signal(b, 9).unwrap();
}
