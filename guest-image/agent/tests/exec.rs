//! `exec` over a unix socket against an in-process agent.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use torpor_agent::proto::{ExecRequest, Op, ReplyBody};
use torpor_agent::ClientError;

fn argv(args: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: args.iter().map(|s| s.to_string()).collect(),
        timeout_ms: Some(15_000),
        ..Default::default()
    }
}

fn sh(script: &str) -> ExecRequest {
    argv(&["sh", "-c", script])
}

#[test]
fn echo_to_stdout() {
    let agent = default_agent();
    let out = agent
        .client()
        .exec_collect(argv(&["echo", "hello", "world"]))
        .unwrap();
    assert_eq!(out.stdout, b"hello world\n");
    assert!(out.stderr.is_empty());
    assert_eq!(out.exit.code, Some(0));
    assert_eq!(out.exit.signal, None);
    assert!(!out.exit.timed_out && !out.exit.truncated);
    assert_eq!(out.exit.stdout_bytes, 12);
}

#[test]
fn stderr_and_exit_code() {
    let agent = default_agent();
    let out = agent
        .client()
        .exec_collect(sh("echo out; echo err >&2; exit 3"))
        .unwrap();
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.exit.code, Some(3));
}

#[test]
fn killed_by_a_signal() {
    let agent = default_agent();
    let out = agent.client().exec_collect(sh("kill -TERM $$")).unwrap();
    assert_eq!(out.exit.code, None);
    assert_eq!(out.exit.signal, Some(libc::SIGTERM));
    assert!(!out.exit.timed_out);
}

#[test]
fn stdin_is_piped_binary_safe() {
    let agent = default_agent();
    let data: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let mut req = argv(&["cat"]);
    req.stdin = Some(data.clone());
    let out = agent.client().exec_collect(req).unwrap();
    assert_eq!(out.exit.code, Some(0));
    assert_eq!(out.stdout.len(), data.len());
    assert!(out.stdout == data);
}

#[test]
fn no_stdin_means_dev_null() {
    let agent = default_agent();
    let out = agent.client().exec_collect(argv(&["cat"])).unwrap();
    assert_eq!(out.exit.code, Some(0));
    assert!(out.stdout.is_empty());
}

#[test]
fn timeout_kills_the_process_group_including_grandchildren() {
    let agent = default_agent();
    let mut client = agent.client();

    let mut req = argv(&["sleep", "10"]);
    req.timeout_ms = Some(200);
    let t = Instant::now();
    let out = client.exec_collect(req).unwrap();
    assert!(out.exit.timed_out);
    assert_eq!(out.exit.signal, Some(libc::SIGKILL));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());

    // A background grandchild in the same group dies with its parent.
    let mut req = sh("sleep 30 & echo $!; sleep 30");
    req.timeout_ms = Some(300);
    let out = client.exec_collect(req).unwrap();
    assert!(out.exit.timed_out);
    let grandchild: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(
        wait_dead(grandchild, Duration::from_secs(5)),
        "grandchild {grandchild} survived the timeout"
    );
}

#[test]
fn output_is_truncated_at_the_limit() {
    let agent = default_agent();
    let mut req = sh("head -c 100000 /dev/zero; head -c 5000 /dev/zero >&2");
    req.max_output_bytes = Some(1000);
    let out = agent.client().exec_collect(req).unwrap();
    assert_eq!(out.exit.code, Some(0), "the process runs to the end");
    assert!(out.exit.truncated);
    assert_eq!(out.stdout.len() + out.stderr.len(), 1000);
    assert_eq!(out.exit.stdout_bytes, 100_000);
    assert_eq!(out.exit.stderr_bytes, 5_000);
}

#[test]
fn env_and_cwd() {
    let agent = default_agent();
    let mut client = agent.client();
    let dir = tempfile::tempdir().unwrap();
    let mut req = sh("echo \"$FOO|$BAR|$(pwd)\"");
    req.env = BTreeMap::from([("FOO".into(), "one two".into()), ("BAR".into(), "2".into())]);
    req.cwd = Some(dir.path().to_str().unwrap().into());
    let out = client.exec_collect(req).unwrap();
    let expect = format!("one two|2|{}\n", dir.path().display());
    assert_eq!(String::from_utf8_lossy(&out.stdout), expect);

    // clear_env: only what the request sets.
    let mut req = argv(&["/usr/bin/env"]);
    req.clear_env = true;
    req.env = BTreeMap::from([("ONLY".into(), "me".into())]);
    let out = client.exec_collect(req).unwrap();
    assert_eq!(out.stdout, b"ONLY=me\n");

    let mut req = argv(&["true"]);
    req.cwd = Some("/definitely/not/here".into());
    match client.exec_collect(req) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, "ENOENT", "{e}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn spawn_errors_are_structured() {
    let agent = default_agent();
    let mut client = agent.client();
    for (req, code) in [
        (argv(&["/no/such/program"]), "ENOENT"),
        (argv(&[]), "EINVAL"),
        (argv(&["echo", "nul\0byte"]), "EINVAL"),
        (argv(&["/"]), "EACCES"),
    ] {
        match client.exec_collect(req) {
            Err(ClientError::Agent(e)) => assert_eq!(e.code, code, "{e}"),
            other => panic!("{other:?}"),
        }
    }
    client.ping().unwrap();
}

#[test]
fn concurrent_execs_on_one_connection() {
    let agent = default_agent();
    let mut client = agent.client();
    let t = Instant::now();
    let mut ids = Vec::new();
    for i in 0..8 {
        let id = client
            .send(Op::Exec(sh(&format!("sleep 0.5; echo job{i}"))))
            .unwrap();
        ids.push((id, i));
    }
    let mut outputs = std::collections::HashMap::new();
    let mut exited = 0;
    while exited < ids.len() {
        let reply = client.recv().unwrap();
        let id = reply.id.unwrap();
        match reply.body {
            ReplyBody::Stdout(c) => outputs
                .entry(id)
                .or_insert_with(Vec::new)
                .extend_from_slice(&c.data),
            ReplyBody::Exit(e) => {
                assert_eq!(e.code, Some(0));
                exited += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    // Run in parallel: far less than 8 × 0.5 s.
    assert!(
        t.elapsed() < Duration::from_millis(3000),
        "{:?}",
        t.elapsed()
    );
    for (id, i) in ids {
        assert_eq!(outputs[&id], format!("job{i}\n").as_bytes());
    }
}

#[test]
fn a_running_exec_id_cannot_be_reused() {
    let agent = default_agent();
    let mut s = agent.raw();
    hello(&mut s);
    let exec = serde_json::json!({"id": 5, "op": "exec", "argv": ["sleep", "1"]});
    send_json(&mut s, exec.clone());
    send_json(&mut s, exec);
    let r = recv(&mut s).unwrap();
    assert_eq!(r.id, Some(5));
    match r.body {
        ReplyBody::Error(e) => assert_eq!(e.code, "EEXIST"),
        other => panic!("{other:?}"),
    }
    let r = recv(&mut s).unwrap();
    assert!(matches!(r.body, ReplyBody::Exit(_)), "{r:?}");
}

#[test]
fn closing_the_connection_kills_running_execs() {
    let agent = default_agent();
    let mut client = agent.client();
    client.send(Op::Exec(sh("echo $$; sleep 30"))).unwrap();
    let pid = match client.recv().unwrap().body {
        ReplyBody::Stdout(c) => String::from_utf8_lossy(&c.data)
            .trim()
            .parse::<i32>()
            .unwrap(),
        other => panic!("{other:?}"),
    };
    assert!(!is_dead(pid));
    drop(client);
    assert!(wait_dead(pid, Duration::from_secs(5)), "{pid} survived");
}

#[test]
fn background_children_holding_the_pipes_do_not_block_exit() {
    let agent = default_agent();
    let t = Instant::now();
    let out = agent
        .client()
        .exec_collect(sh("sleep 5 & echo started"))
        .unwrap();
    assert_eq!(out.exit.code, Some(0));
    assert_eq!(out.stdout, b"started\n");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}
