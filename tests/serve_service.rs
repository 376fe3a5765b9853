//! The service in process, driving real VMMs, for what needs a guest agent
//! on a host that runs only probe guests (PVM): a "Linux" template row whose
//! snapshot is the probe template's, so every create and wake spawns a real
//! `torpor vmm --restore ... --vsock-uds SANDBOX/vsock.sock` (the probe
//! snapshot has no vsock device, so the VMM ignores the path), and this
//! test answers that socket with the real torpor-agent server (its hybrid
//! vsock handshake, then the agent protocol), with `FakeOps` deciding
//! whether the clock/entropy/identity steps of `resumed` work. Everything
//! else is the service's own path: the journaled create and wake, the
//! `resumed` hook and its failure handling, exec, the policy.
//!
//! Covered: a failing `resumed` hook (create → failed with the reason and
//! the VMM stopped; wake → back to hibernated), the policy leaving sandboxes
//! with a guest request in flight alone (idle and watermark), the exec
//! timeout limit, and exec metrics.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::serve::DataDir;
use torpor_agent::server::Stream;
use torpor_agent::volumes::{RelayConfig, Upstream, VOLUMES_PORT};
use torpor_agent::{Agent, AgentConfig, FakeCall, FakeOps, IdentityPage, DEFAULT_VSOCK_PORT};
use torpor_scheduler::model::MountedVolume;
use torpor_scheduler::model::{SandboxId, Template, TemplateId, TemplateState, Timestamp};
use torpor_scheduler::service::guest::{hostname_for, ExecRequest, VSOCK_FILE};
use torpor_scheduler::service::VolumeMountRequest;
use torpor_scheduler::service::{
    Cancel, CreateSandbox, GuestError, Service, ServiceConfig, ServiceError, LOCAL_POD,
    PROBE_TEMPLATE,
};
use torpor_scheduler::store::SandboxFilter;
use torpor_scheduler::{PodId, SandboxState, TemplateKind};
use torpor_vmm_api::launch::guest_target;

const LINUX: &str = "linux-on-probe";
const WAIT: Duration = Duration::from_secs(60);

/// An agent whose post-restore steps all work.
fn good_ops() -> Arc<FakeOps> {
    Arc::new(FakeOps::new().root(true).page(IdentityPage {
        generation: 1,
        seed: [9; 32],
        wall_clock_ns: 1,
    }))
}

/// An agent that cannot set the clock.
fn clockless_ops() -> Arc<FakeOps> {
    Arc::new(
        FakeOps::new()
            .root(true)
            .failing("SetWallClock", libc::EPERM)
            .page(IdentityPage {
                generation: 1,
                seed: [9; 32],
                wall_clock_ns: 1,
            }),
    )
}

/// The service with a Linux-kind template over the probe snapshot, and a
/// thread that answers each new VMM's vsock socket with an agent.
struct Harness {
    service: Arc<Service>,
    /// The agent the next VMM's socket gets.
    ops: Arc<Mutex<Arc<FakeOps>>>,
    /// VMM pids whose socket got an agent, in order.
    served: Arc<Mutex<Vec<(SandboxId, u32)>>>,
    stop: Arc<AtomicBool>,
    data: DataDir,
}

impl Harness {
    fn new(name: &str, exec_timeout_ms: u64) -> Self {
        Harness::with(name, exec_timeout_ms, |_| {})
    }

    /// With `tweak` applied to the service's configuration.
    fn with(name: &str, exec_timeout_ms: u64, tweak: impl FnOnce(&mut ServiceConfig)) -> Self {
        let data = DataDir::new(name);
        let mut config = ServiceConfig::new(
            data.0.clone(),
            PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
        );
        config.policy_interval_ms = 0; // the tests run the policy themselves
        config.exec_timeout_ms = exec_timeout_ms;
        tweak(&mut config);
        let service = Service::open(config).expect("open the service");
        let probe = service
            .list_templates()
            .unwrap()
            .into_iter()
            .find(|t| t.name == PROBE_TEMPLATE && t.state == TemplateState::Ready)
            .expect("the probe template");
        service
            .store()
            .insert_template(&Template {
                id: TemplateId::generate(),
                name: LINUX.into(),
                kind: TemplateKind::Linux,
                rootfs: None,
                created_at: Timestamp::now(),
                ..probe
            })
            .unwrap();
        let h = Harness {
            service,
            ops: Arc::new(Mutex::new(good_ops())),
            served: Arc::default(),
            stop: Arc::default(),
            data,
        };
        h.spawn_binder();
        h
    }

    /// Binds the vsock socket of every VMM a create or wake just started
    /// (the service removes a stale socket before it spawns the VMM, and
    /// records the VMM before it runs the hook, which retries connecting).
    fn spawn_binder(&self) {
        let (service, ops, served, stop) = (
            self.service.clone(),
            self.ops.clone(),
            self.served.clone(),
            self.stop.clone(),
        );
        let data_dir = self.data.0.clone();
        std::thread::spawn(move || {
            let filter = SandboxFilter {
                states: vec![SandboxState::Creating, SandboxState::Resuming],
                ..Default::default()
            };
            while !stop.load(Ordering::SeqCst) {
                for s in service.store().list_sandboxes(&filter).unwrap_or_default() {
                    let Some(vmm) = s.vmm else { continue };
                    let mut served = served.lock().unwrap();
                    if served.iter().any(|(_, pid)| *pid == vmm.pid) {
                        continue;
                    }
                    let uds = data_dir
                        .canonicalize()
                        .unwrap()
                        .join("sandboxes")
                        .join(s.id.as_str())
                        .join(VSOCK_FILE);
                    let ops = ops.lock().unwrap().clone();
                    // Its volumes' relay sends guest connections where the
                    // VMM would: the pod's socket beside the vsock one.
                    let relay = RelayConfig {
                        port: 0,
                        upstream: Upstream::Unix(guest_target(&uds, u32::from(VOLUMES_PORT))),
                    };
                    let listener = UnixListener::bind(&uds).expect("bind vsock socket");
                    serve_agent(listener, ops, relay);
                    served.push((s.id.clone(), vmm.pid));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
    }

    fn set_ops(&self, ops: Arc<FakeOps>) {
        *self.ops.lock().unwrap() = ops;
    }

    fn create(&self, keep_alive_ms: Option<u64>) -> Result<SandboxId, ServiceError> {
        self.service
            .create_sandbox(CreateSandbox {
                template: LINUX.into(),
                keep_alive_ms,
                ..Default::default()
            })
            .map(|s| s.id)
    }

    fn state(&self, id: &SandboxId) -> SandboxState {
        self.service.get_sandbox(id).unwrap().state
    }

    /// The VMM pid the last agent was bound for.
    fn last_vmm(&self) -> (SandboxId, u32) {
        self.served.lock().unwrap().last().cloned().expect("a VMM")
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        common::end_service(&self.service);
    }
}

/// Accepts hybrid vsock connections (`CONNECT <port>` → `OK <n>`) and hands
/// them to a real agent.
fn serve_agent(listener: UnixListener, ops: Arc<FakeOps>, relay: RelayConfig) {
    let mut cfg = AgentConfig::new(ops);
    cfg.volume_relay = relay;
    let agent = Agent::new(cfg);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let agent = agent.clone();
            std::thread::spawn(move || {
                if read_line(&mut conn) == format!("CONNECT {DEFAULT_VSOCK_PORT}") {
                    let _ = conn.write_all(b"OK 1073741824\n");
                    agent.serve_connection(Stream::Unix(conn));
                }
            });
        }
    });
}

fn read_line(s: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while s.read(&mut b).unwrap_or(0) == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    String::from_utf8_lossy(&line).into_owned()
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

fn exec_req(script: &str, timeout_ms: Option<u64>) -> ExecRequest {
    ExecRequest {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        timeout_ms,
        ..Default::default()
    }
}

fn hook_failure(e: &ServiceError) -> bool {
    matches!(e, ServiceError::Guest(GuestError::ResumeHook { .. }))
        && e.to_string().contains("clock")
        && e.to_string().contains("EPERM")
}

#[test]
fn a_failing_resumed_hook_fails_a_create_and_rolls_back_a_wake() {
    let h = Harness::new("svc-hook", 60_000);

    // Create: the hook fails, so the sandbox is failed, with the reason,
    // and the VMM that was started is gone.
    h.set_ops(clockless_ops());
    let err = h.create(None).expect_err("a create whose hook fails");
    assert!(hook_failure(&err), "{err}");
    let (id, pid) = h.last_vmm();
    let sandbox = h.service.get_sandbox(&id).unwrap();
    assert_eq!(sandbox.state, SandboxState::Failed);
    let reason = sandbox.failure_reason.unwrap_or_default();
    assert!(
        reason.contains("post-restore hook") && reason.contains("clock"),
        "{reason}"
    );
    assert_eq!(sandbox.vmm, None);
    assert!(!alive(pid), "the VMM {pid} still runs");

    // A working hook: created, hostname and identity set by the hook.
    let ops = good_ops();
    h.set_ops(ops.clone());
    let id = h.create(None).unwrap();
    assert_eq!(h.state(&id), SandboxState::Running);
    let calls = format!("{:?}", ops.calls());
    assert!(calls.contains(&hostname_for(id.as_str())), "{calls}");
    h.service.hibernate(&id).unwrap();
    assert_eq!(h.state(&id), SandboxState::Hibernated);

    // Wake: the hook fails, so the sandbox goes back to hibernated and the
    // VMM the wake started is stopped.
    h.set_ops(clockless_ops());
    let err = h.service.resume(&id).expect_err("a wake whose hook fails");
    assert!(hook_failure(&err), "{err}");
    let (woken, pid) = h.last_vmm();
    assert_eq!(woken, id);
    let sandbox = h.service.get_sandbox(&id).unwrap();
    assert_eq!(sandbox.state, SandboxState::Hibernated);
    assert_eq!(sandbox.vmm, None);
    assert!(!alive(pid), "the VMM {pid} still runs");
    let metrics = h.service.metrics();
    assert!(
        metrics.contains("torpor_wakes_total{result=\"failed\"} 1\n"),
        "{metrics}"
    );

    // Its snapshot is intact: with a working hook it wakes.
    h.set_ops(good_ops());
    let outcome = h.service.resume(&id).unwrap();
    assert!(outcome.resumed);
    assert_eq!(h.state(&id), SandboxState::Running);
    let metrics = h.service.metrics();
    assert!(
        metrics.contains("torpor_wakes_total{result=\"ok\"} 1\n"),
        "{metrics}"
    );
}

#[test]
fn the_policy_leaves_sandboxes_with_a_request_in_flight() {
    let h = Harness::new("svc-inflight", 60_000);
    // One sandbox idle past its keep-alive at once, one never idle; the
    // pod's watermark so low that any running VMM is above it.
    let idle = h.create(Some(1)).unwrap();
    let busy = h.create(None).unwrap();
    h.service
        .store()
        .set_high_watermark(&PodId::new(LOCAL_POD), 1e-9)
        .unwrap();

    // The execs run until the test lets them end (the agent runs them on
    // this host), or 40 s at most: no race with the policy rounds below.
    let release = h.data.0.join("release");
    let script = format!(
        "i=0; while [ ! -e {} ] && [ $i -lt 2000 ]; do sleep 0.02; i=$((i+1)); done; echo done",
        release.display()
    );
    let execs: Vec<_> = [idle.clone(), busy.clone()]
        .into_iter()
        .map(|id| {
            let (service, script) = (h.service.clone(), script.clone());
            std::thread::spawn(move || {
                service.exec(&id, exec_req(&script, Some(50_000)), &Cancel::default())
            })
        })
        .collect();
    let deadline = Instant::now() + WAIT;
    while !(h.service.has_request_in_flight(&idle) && h.service.has_request_in_flight(&busy)) {
        assert!(Instant::now() < deadline, "the execs never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Policy rounds while the execs run: both stay running.
    for _ in 0..5 {
        h.service.run_policy();
        assert_eq!(h.state(&idle), SandboxState::Running);
        assert_eq!(h.state(&busy), SandboxState::Running);
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::write(&release, b"").unwrap();
    for exec in execs {
        let call = exec.join().unwrap().expect("the exec");
        assert!(!call.outcome.resumed);
        assert_eq!(call.value.stdout, b"done\n");
        assert_eq!(call.value.exit.code, Some(0));
    }
    assert!(!h.service.has_request_in_flight(&idle));

    // Done: the next round hibernates both, one as idle, one as the pod
    // is above its watermark.
    h.service.run_policy();
    assert_eq!(h.state(&idle), SandboxState::Hibernated);
    assert_eq!(h.state(&busy), SandboxState::Hibernated);

    let metrics = h.service.metrics();
    assert!(
        metrics.contains("torpor_execs_total{result=\"ok\"} 2\n"),
        "{metrics}"
    );
    assert!(metrics.contains("torpor_exec_ms_count 2\n"), "{metrics}");
    assert!(
        metrics.contains("torpor_hibernations_total{result=\"ok\"} 2\n"),
        "{metrics}"
    );
}

#[test]
fn execs_get_the_services_timeout_and_cannot_ask_for_more() {
    let h = Harness::new("svc-exec-limit", 500);
    let id = h.create(None).unwrap();

    // No timeout given: the service's 500 ms applies, the agent kills it.
    let out = h
        .service
        .exec(&id, exec_req("sleep 30", None), &Cancel::default())
        .unwrap()
        .value;
    assert!(out.exit.timed_out, "{:?}", out.exit);
    assert_eq!(out.exit.code, None);

    // Within the limit: as asked.
    let out = h
        .service
        .exec(&id, exec_req("echo ok", Some(400)), &Cancel::default())
        .unwrap()
        .value;
    assert_eq!(
        (out.stdout.as_slice(), out.exit.code),
        (&b"ok\n"[..], Some(0))
    );

    // Past the limit: refused before anything runs.
    let err = h
        .service
        .exec(&id, exec_req("true", Some(10_000)), &Cancel::default())
        .expect_err("a timeout past the limit");
    assert!(matches!(err, ServiceError::Invalid(_)), "{err}");
    assert!(err.to_string().contains("500 ms"), "{err}");
    let metrics = h.service.metrics();
    assert!(
        metrics.contains("torpor_execs_total{result=\"ok\"} 2\n"),
        "{metrics}"
    );
}

#[test]
fn a_sandboxs_env_is_under_every_exec_and_forks_keep_it() {
    let h = Harness::new("svc-exec-env", 10_000);
    let mut env = std::collections::BTreeMap::new();
    env.insert("FROM_SANDBOX".to_string(), "sbx".to_string());
    env.insert("BOTH".to_string(), "sbx".to_string());
    let id = h
        .service
        .create_sandbox(CreateSandbox {
            template: LINUX.into(),
            env,
            ..Default::default()
        })
        .unwrap()
        .id;
    // Stored, never shown.
    let stored = h.service.get_sandbox(&id).unwrap();
    assert_eq!(stored.env["FROM_SANDBOX"], "sbx");
    let shown = serde_json::to_string(&stored).unwrap();
    assert!(!shown.contains("FROM_SANDBOX"), "{shown}");

    let mut req = exec_req("echo \"$FROM_SANDBOX $BOTH\"", Some(5_000));
    req.env.insert("BOTH".into(), "request".into());
    let out = h.service.exec(&id, req, &Cancel::default()).unwrap().value;
    assert_eq!(out.stdout, b"sbx request\n", "the request's own win");
    // Streaming execs too.
    let mut streamed = Vec::new();
    h.service
        .exec_streaming(
            &id,
            exec_req("echo \"$FROM_SANDBOX\"", Some(5_000)),
            &Cancel::default(),
            &mut |_| {},
            &mut |_, data| streamed.extend_from_slice(data),
        )
        .unwrap();
    assert_eq!(streamed, b"sbx\n");

    // A fork keeps the source's, under its own.
    let mut extra = std::collections::BTreeMap::new();
    extra.insert("BOTH".to_string(), "fork".to_string());
    let fork = h
        .service
        .fork_sandbox(
            &id,
            torpor_scheduler::service::ForkSandbox {
                env: extra,
                ..Default::default()
            },
        )
        .unwrap()
        .id;
    let out = h
        .service
        .exec(
            &fork,
            exec_req("echo \"$FROM_SANDBOX $BOTH\"", Some(5_000)),
            &Cancel::default(),
        )
        .unwrap()
        .value;
    assert_eq!(out.stdout, b"sbx fork\n");
}

/// A client that goes away from `POST /v1/sandboxes/{id}/exec` or
/// `.../exec/stream` cancels its exec: the command is killed in the guest
/// (here, by the real agent on this host) instead of running to its
/// timeout.
#[test]
fn a_client_that_goes_away_cancels_its_exec() {
    const TOKEN: &str = "test-token-exec-cancel";
    let h = Harness::new("svc-exec-cancel", 60_000);
    let id = h.create(None).unwrap();
    let config = torpor_api::ApiConfig {
        tokens: vec![TOKEN.into()],
        ..Default::default()
    };
    let api = common::http::InProcessApi::start(h.service.clone(), config);
    let addr = api.addr.as_str();
    for route in ["exec", "exec/stream"] {
        let pidfile = h.data.0.join(format!("pid-{}", route.replace('/', "-")));
        let script = format!("echo $$ > {}; exec sleep 50", pidfile.display());
        let body =
            serde_json::json!({ "argv": ["sh", "-c", script], "timeout_ms": 55_000 }).to_string();
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        write!(
            client,
            "POST /v1/sandboxes/{id}/{route} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer \
             {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let started = Instant::now();
        let pid = loop {
            let text = std::fs::read_to_string(&pidfile).unwrap_or_default();
            if let Ok(pid) = text.trim().parse::<u32>() {
                break pid;
            }
            assert!(
                started.elapsed() < WAIT,
                "{route}: the command never started"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        if route == "exec/stream" {
            // The stream has begun (its `start` line) before the client goes.
            let mut first = [0u8; 12];
            client.read_exact(&mut first).unwrap();
            assert_eq!(&first, b"HTTP/1.1 200", "{route}");
        }
        drop(client);
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        let gone = Instant::now();
        while proc_dir.exists() {
            assert!(
                gone.elapsed() < Duration::from_secs(20),
                "{route}: the command (pid {pid}) runs on after its client went away"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // The sandbox is fine, and no request is left in flight.
        let deadline = Instant::now() + Duration::from_secs(20);
        while h.service.has_request_in_flight(&id) {
            assert!(
                Instant::now() < deadline,
                "{route}: the exec is still in flight"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(h.state(&id), SandboxState::Running, "{route}");
    }
    drop(api);
}

/// The agent's relay port the last `mount_volumes` mounted from (its
/// options' `port=`).
fn relay_port(ops: &FakeOps) -> Option<u16> {
    ops.calls().iter().rev().find_map(|c| match c {
        FakeCall::MountNfs { options, .. } => options
            .split(',')
            .find_map(|o| o.strip_prefix("port="))
            .map(|p| p.parse().unwrap()),
        _ => None,
    })
}

/// Reads `file` of the volume mounted as `export` through the guest's
/// relay on `port` (as the guest kernel's NFS client would: MOUNT, then
/// LOOKUP and READ on a connection of their own).
fn read_through_relay(port: u16, export: &str, file: &str) -> Result<Vec<u8>, String> {
    use nfs3_client::nfs3_types::mount::dirpath;
    use nfs3_client::nfs3_types::nfs3::{diropargs3, nfs_fh3, LOOKUP3args, Nfs3Result, READ3args};
    use nfs3_client::nfs3_types::xdr_codec::Opaque;
    use nfs3_client::tokio::TokioIo;
    use nfs3_client::{MountClient, Nfs3Client};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dial = || tokio::net::TcpStream::connect(("127.0.0.1", port));
        let mut mnt = MountClient::new(TokioIo::new(dial().await.map_err(|e| e.to_string())?));
        let root = mnt
            .mnt(dirpath(Opaque::borrowed(export.as_bytes())))
            .await
            .map_err(|e| format!("MOUNT {export}: {e}"))?;
        let root = nfs_fh3 {
            data: Opaque::owned(root.fhandle.0.to_vec()),
        };
        let mut nfs = Nfs3Client::new(TokioIo::new(dial().await.map_err(|e| e.to_string())?));
        let looked = nfs
            .lookup(&LOOKUP3args {
                what: diropargs3 {
                    dir: root,
                    name: file.as_bytes().into(),
                },
            })
            .await
            .map_err(|e| e.to_string())?;
        let Nfs3Result::Ok(found) = looked else {
            return Err(format!("LOOKUP {file} failed"));
        };
        let read = nfs
            .read(&READ3args {
                file: found.object,
                offset: 0,
                count: 4096,
            })
            .await
            .map_err(|e| e.to_string())?;
        match read {
            Nfs3Result::Ok(ok) => Ok(ok.data.to_vec()),
            Nfs3Result::Err((stat, _)) => Err(format!("READ: {stat:?}")),
        }
    })
}

#[test]
fn a_sandboxs_volumes_are_served_to_its_guest_while_its_vmm_runs() {
    let h = Harness::with("serve-service-volumes", 60_000, |c| {
        c.volumes_dir = Some(c.data_dir.join("volumes"));
    });
    let content = h.data.0.join("volumes/vol_0123456789ab/content");
    std::fs::create_dir_all(&content).unwrap();
    std::fs::write(content.join("hello.txt"), b"from the host").unwrap();
    let ops = good_ops();
    h.set_ops(ops.clone());
    let asked = vec![VolumeMountRequest {
        name: "data".into(),
        path: "/mnt/data".into(),
        id: None,
    }];
    let resolved = vec![MountedVolume {
        id: "vol_0123456789ab".into(),
        name: "data".into(),
        path: "/mnt/data".into(),
    }];
    let create = |template: &str, volumes: Vec<MountedVolume>| {
        h.service.create_sandbox(CreateSandbox {
            template: template.into(),
            volume_mounts: asked.clone(),
            volumes,
            ..Default::default()
        })
    };
    // Mounts the gate did not resolve, and a probe (no agent to mount
    // them), are refused before anything starts.
    let e = create(LINUX, Vec::new()).expect_err("unresolved mounts");
    assert!(e.to_string().contains("not resolved"), "{e}");
    let e = create(PROBE_TEMPLATE, resolved.clone()).expect_err("a probe with volumes");
    assert!(e.to_string().contains("Linux"), "{e}");

    let id = create(LINUX, resolved).expect("create with a volume").id;
    assert_eq!(
        h.service.get_sandbox(&id).unwrap().volumes[0].path,
        "/mnt/data"
    );
    let socket = h
        .data
        .0
        .canonicalize()
        .unwrap()
        .join("sandboxes")
        .join(id.as_str())
        .join(format!("{VSOCK_FILE}_2049"));
    assert!(socket.exists(), "no volume socket while the VMM runs");
    // The agent was asked to mount it, from its relay.
    let asked_mount = ops.calls().into_iter().find_map(|c| match c {
        FakeCall::MountNfs { source, target, .. } => Some((source, target)),
        _ => None,
    });
    assert_eq!(
        asked_mount,
        Some(("127.0.0.1:/data".to_string(), PathBuf::from("/mnt/data")))
    );
    let port = relay_port(&ops).expect("no mount_volumes call reached the agent");
    // What the guest kernel would read through that relay: the pod's NFS
    // server, the volume's file.
    assert_eq!(
        read_through_relay(port, "/data", "hello.txt").unwrap(),
        b"from the host"
    );
    assert!(read_through_relay(port, "/other", "hello.txt").is_err());

    // Hibernated: nothing served. Woken: served again, and mounted again
    // (an agent already holding the mount leaves it).
    h.service.hibernate(&id).unwrap();
    assert!(
        !socket.exists(),
        "a hibernated sandbox's volumes are still served"
    );
    h.service.resume(&id).unwrap();
    assert!(socket.exists());
    let mounts = ops
        .calls()
        .iter()
        .filter(|c| matches!(c, FakeCall::MountNfs { .. }))
        .count();
    assert_eq!(mounts, 2, "{:?}", ops.calls());
    std::fs::write(content.join("later.txt"), b"after the wake").unwrap();
    let (_, pid) = h.last_vmm();
    assert!(alive(pid));
    let port = relay_port(&ops).expect("no mount after the wake");
    assert_eq!(
        read_through_relay(port, "/data", "later.txt").unwrap(),
        b"after the wake"
    );
    h.service.delete_sandbox(&id).unwrap();
    assert!(
        !socket.exists(),
        "a deleted sandbox's volumes are still served"
    );
}

/// The nested pod's way: the pod has no volumes and relays each volume
/// connection of a sandbox (`--volumes-relay`) to an address whose
/// connections, as QEMU's guest forward does, each start `torpor
/// nested-volume-pipe GATEWAY` with the connection as its stdin and
/// stdout; serve's gateway then serves what it recorded for the sandbox.
#[test]
fn a_nested_pods_volumes_are_relayed_to_the_servers_gateway() {
    use std::collections::HashMap;
    use std::os::fd::OwnedFd;
    use std::process::{Command, Stdio};
    use torpor_scheduler::service::mounts::Mounts;
    use torpor_scheduler::service::volume_gateway::VolumeGateway;
    use torpor_scheduler::volumes::{greeting, VolumesRelay};

    // The server in front: the volumes, and its gateway.
    let outer = DataDir::new("serve-service-gateway");
    let content = outer.0.join("volumes/vol_0123456789ab/content");
    std::fs::create_dir_all(&content).unwrap();
    std::fs::write(content.join("hello.txt"), b"from the outer host").unwrap();
    let recorded: Arc<Mutex<HashMap<SandboxId, Vec<MountedVolume>>>> = Arc::default();
    let lookup = recorded.clone();
    let gateway_socket = outer.0.join("nested-volumes.sock");
    let _gateway = VolumeGateway::start(
        &gateway_socket,
        Arc::new(Mounts::new(
            Some(outer.0.join("volumes")),
            None,
            torpor_scheduler::volumes::usage::DEFAULT_LIMIT,
        )),
        Arc::new(move |id: &SandboxId| lookup.lock().unwrap().get(id).cloned()),
        "pod-token".into(),
    )
    .unwrap();
    // QEMU's guest forward, as a TCP listener here.
    let qemu = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let relay = qemu.local_addr().unwrap();
    let pipe_to = gateway_socket.clone();
    std::thread::spawn(move || {
        for conn in qemu.incoming() {
            let Ok(conn) = conn else { return };
            let fd = OwnedFd::from(conn);
            let _ = Command::new(env!("CARGO_BIN_EXE_torpor"))
                .arg("nested-volume-pipe")
                .arg(&pipe_to)
                .stdin(Stdio::from(fd.try_clone().unwrap()))
                .stdout(Stdio::from(fd))
                .stderr(Stdio::null())
                .spawn();
        }
    });

    // The nested pod: no volumes of its own.
    let h = Harness::with("serve-service-relay", 60_000, |c| {
        c.volumes_relay = Some(VolumesRelay {
            addr: relay,
            token: "pod-token".into(),
        });
    });
    let ops = good_ops();
    h.set_ops(ops.clone());
    let volumes = vec![MountedVolume {
        id: "vol_0123456789ab".into(),
        name: "data".into(),
        path: "/mnt/data".into(),
    }];
    let id = h
        .service
        .create_sandbox(CreateSandbox {
            template: LINUX.into(),
            volume_mounts: vec![VolumeMountRequest {
                name: "data".into(),
                path: "/mnt/data".into(),
                id: Some("vol_0123456789ab".into()),
            }],
            volumes: volumes.clone(),
            ..Default::default()
        })
        .expect("create with a relayed volume")
        .id;
    let port = relay_port(&ops).expect("no mount_volumes call reached the agent");
    // Until serve has recorded the sandbox's volumes, its gateway serves
    // it nothing (the connection is closed: raw bytes, since the NFS
    // client waits forever on a closed stream); then the guest reads the
    // outer host's file.
    let mut raw = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    raw.write_all(&[0x80, 0, 0, 4, 0, 0, 0, 0]).unwrap();
    assert_eq!(
        raw.read(&mut [0u8; 64]).unwrap(),
        0,
        "served a sandbox it has no record of"
    );
    recorded.lock().unwrap().insert(id.clone(), volumes);
    assert_eq!(
        read_through_relay(port, "/data", "hello.txt").unwrap(),
        b"from the outer host"
    );
    // A connection to the gateway without the pod's token gets nothing.
    let mut forged = UnixStream::connect(&gateway_socket).unwrap();
    forged
        .write_all(greeting("guessed", &id).as_bytes())
        .unwrap();
    forged
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    assert_eq!(
        forged.read(&mut [0u8; 64]).unwrap(),
        0,
        "served without the token"
    );
    h.service.delete_sandbox(&id).unwrap();
}
