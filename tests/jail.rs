//! Every VMM the service starts is jailed (docs/design.md, "The jail"):
//! seen from outside, through /proc, it runs as its own non-zero uid with
//! no capability and no_new_privs, in mount, pid, net, ipc and uts
//! namespaces of its own, with a root holding only its jail's files, in a
//! cgroup with its memory and pids limits; from inside, host paths (the
//! shadow file, the data directory's token, other sandboxes) do not exist.
//! Standby shells are jailed when they are made and restore into their
//! jail; hibernation writes its layer under the jail. A guest that touches
//! more memory than its cgroup allows is OOM-killed alone and the service
//! says why. Runs the service in process with real VMMs (probe guests);
//! needs root (the jail does).

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::serve::DataDir;
use torpor_scheduler::model::{RestorePath, Sandbox};
use torpor_scheduler::service::jail::JailConfig;
use torpor_scheduler::service::{CreateSandbox, CreateTemplate, Service, ServiceConfig};
use torpor_scheduler::SandboxState;
use torpor_vmm_api::jail::{DEFAULT_JAIL_UID_BASE, DEFAULT_PIDS_MAX, VMM_OVERHEAD_MIB};
use torpor_vmm_api::MemoryBackend;

const WAIT: Duration = Duration::from_secs(30);

/// The jail needs root: scripts/test leaves these tests out without it
/// (tests/needs).
fn root() -> bool {
    // SAFETY: geteuid cannot fail.
    assert!(unsafe { libc::geteuid() } == 0, "the jail needs root");
    true
}

fn service(data: &DataDir, pool: usize, jail: JailConfig, policy_ms: u64) -> Arc<Service> {
    let mut config = ServiceConfig::new(
        data.0.clone(),
        PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
    );
    config.policy_interval_ms = policy_ms;
    config.standby_pool = pool;
    config.memory_backend = MemoryBackend::File;
    config.jail = Some(jail);
    Service::open(config).expect("open the service")
}

fn create(service: &Service, template: &str) -> Sandbox {
    service
        .create_sandbox(CreateSandbox {
            template: template.into(),
            ..Default::default()
        })
        .expect("create")
}

fn data_path(data: &DataDir) -> PathBuf {
    data.0.canonicalize().unwrap()
}

fn status_field(pid: u32, key: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

fn console_lines(data: &DataDir, id: &str) -> usize {
    std::fs::read_to_string(data.0.join("sandboxes").join(id).join("console.log"))
        .unwrap_or_default()
        .matches("TORPOR-PROBE ITER")
        .count()
}

/// The probe's console in the sandbox's directory grows: the guest runs.
fn guest_runs(data: &DataDir, id: &str) {
    let before = console_lines(data, id);
    let deadline = Instant::now() + WAIT;
    while console_lines(data, id) <= before {
        assert!(Instant::now() < deadline, "the guest printed nothing new");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The cgroup file `file` of the VMM `pid`'s `controller` (v1) or unified
/// (v2) cgroup.
fn cgroup_file(pid: u32, controller: &str, v1: &str, v2: &str) -> String {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
        let dir = if controllers.split(',').any(|c| c == controller) {
            Path::new("/sys/fs/cgroup").join(controller)
        } else if controllers.is_empty() && Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
        {
            PathBuf::from("/sys/fs/cgroup")
        } else {
            continue;
        };
        let file = dir
            .join(path.trim_start_matches('/'))
            .join(if controllers.is_empty() { v2 } else { v1 });
        if let Ok(text) = std::fs::read_to_string(&file) {
            assert!(
                path.starts_with("/torpor/"),
                "VMM {pid} is not in a torpor cgroup: {line}"
            );
            return text.trim().to_string();
        }
    }
    panic!("VMM {pid} has no {controller} cgroup:\n{cgroups}");
}

/// Everything the jail promises, seen from outside through /proc.
fn assert_jailed(data: &DataDir, sandbox: &Sandbox, others: &[&Sandbox]) {
    let pid = sandbox
        .vmm
        .as_ref()
        .expect("a running sandbox has a VMM")
        .pid;
    // Credentials.
    let uid: u32 = status_field(pid, "Uid")
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(uid >= DEFAULT_JAIL_UID_BASE, "VMM {pid} runs as uid {uid}");
    assert!(
        status_field(pid, "Uid")
            .split_whitespace()
            .all(|u| u == uid.to_string()),
        "every uid of VMM {pid} is {uid}"
    );
    assert_ne!(
        status_field(pid, "Gid").split_whitespace().next(),
        Some("0")
    );
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    for caps in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, caps), "0000000000000000", "{caps}");
    }
    // Namespaces: its own, and pid 1 in its pid namespace.
    for ns in ["mnt", "pid", "net", "ipc", "uts"] {
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap();
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        assert_ne!(theirs, ours, "VMM {pid} shares our {ns} namespace");
    }
    assert!(
        status_field(pid, "NSpid").ends_with("\t1") || status_field(pid, "NSpid").ends_with(" 1"),
        "VMM {pid} is not pid 1 of its namespace: {}",
        status_field(pid, "NSpid")
    );
    // Its root holds only the jail: /dev, /proc, and the path down to
    // what it was given.
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let data = data_path(data);
    let top = data.components().nth(1).unwrap().as_os_str().to_owned();
    let mut names: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![std::ffi::OsString::from("dev"), "proc".into(), top]
    );
    let devices: Vec<_> = std::fs::read_dir(root.join("dev"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(devices.contains(&"kvm".to_string()), "{devices:?}");
    assert!(
        devices.iter().all(|d| d == "kvm" || d == "userfaultfd"),
        "{devices:?}"
    );
    let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap());
    let own = data.join("sandboxes").join(sandbox.id.as_str());
    assert!(
        inside(&own).join("console.log").exists(),
        "its own directory"
    );
    for hidden in [
        PathBuf::from("/etc/shadow"),
        PathBuf::from("/etc"),
        data.join("token"),
        data.join("torpor.db"),
    ] {
        assert!(
            !inside(&hidden).exists(),
            "{} is visible in the jail",
            hidden.display()
        );
    }
    // Of its template, only the snapshot it restores from (read-only), not
    // the build's console, log or socket.
    let template = data.join("templates").join(sandbox.template.as_str());
    assert!(template.join("console.log").exists());
    let seen: Vec<_> = std::fs::read_dir(inside(&template))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(seen, vec![std::ffi::OsString::from("snapshot")]);
    let probe = std::fs::OpenOptions::new()
        .write(true)
        .open(inside(&template.join("snapshot").join("lineage.json")));
    assert!(
        probe.is_err(),
        "the template's layer is writable in the jail"
    );
    for other in others {
        let dir = data.join("sandboxes").join(other.id.as_str());
        assert!(dir.exists());
        assert!(
            !inside(&dir).exists(),
            "another sandbox's directory is visible"
        );
    }
    // Its files are its own, private.
    let meta = std::fs::metadata(&own).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (uid, 0o700));
    for f in ["console.log", "vmm.log"] {
        let meta = std::fs::metadata(own.join(f)).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o777), (uid, 0o600), "{f}");
    }
    // Its cgroup, with the limits set.
    let memory: u64 = cgroup_file(pid, "memory", "memory.limit_in_bytes", "memory.max")
        .parse()
        .unwrap();
    assert_eq!(
        memory,
        (u64::from(sandbox.mem_mib) + VMM_OVERHEAD_MIB) << 20
    );
    // The VMM's own threads, plus one per vCPU.
    let pids = cgroup_file(pid, "pids", "pids.max", "pids.max");
    assert_eq!(
        pids,
        (DEFAULT_PIDS_MAX + u64::from(sandbox.vcpus)).to_string()
    );
}

#[test]
fn a_sandbox_vmm_is_jailed() {
    if !root() {
        return;
    }
    let data = DataDir::new("jail-cold");
    // A stand-in for the API token `torpor serve` keeps here.
    std::fs::write(data.0.join("token"), "secret\n").unwrap();
    let service = service(&data, 0, JailConfig::default(), 0);
    let a = create(&service, "probe");
    let b = create(&service, "probe");
    assert_eq!(a.restore.as_ref().unwrap().path, RestorePath::Cold);
    guest_runs(&data, a.id.as_str());
    assert_jailed(&data, &a, &[&b]);
    assert_jailed(&data, &b, &[&a]);
    let (pa, pb) = (a.vmm.as_ref().unwrap().pid, b.vmm.as_ref().unwrap().pid);
    assert_ne!(
        status_field(pa, "Uid"),
        status_field(pb, "Uid"),
        "two VMMs share a uid"
    );
    service.delete_sandbox(&a.id).unwrap();
    service.delete_sandbox(&b.id).unwrap();
}

#[test]
fn standby_shells_are_jailed_and_hibernate_under_the_jail() {
    if !root() {
        return;
    }
    let data = DataDir::new("jail-standby");
    let service = service(&data, 1, JailConfig::default(), 0);
    let wait_for_shell = || {
        let deadline = Instant::now() + WAIT;
        while !service
            .metrics()
            .lines()
            .any(|l| l.starts_with("torpor_standby_shells{") && !l.ends_with(" 0"))
        {
            assert!(Instant::now() < deadline, "no standby shell");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for_shell();
    let bystander = create(&service, "probe");
    wait_for_shell();
    let sandbox = create(&service, "probe");
    assert_eq!(sandbox.restore.as_ref().unwrap().path, RestorePath::Standby);
    guest_runs(&data, sandbox.id.as_str());
    assert_jailed(&data, &sandbox, &[&bystander]);

    // Hibernation writes its diff layer into the sandbox's directory from
    // inside the jail; the wake restores it into another jailed shell.
    service
        .hibernate(&sandbox.id)
        .expect("hibernate under the jail");
    let hibernated = service.get_sandbox(&sandbox.id).unwrap();
    assert_eq!(hibernated.state, SandboxState::Hibernated);
    let layer = hibernated.snapshot.clone().unwrap();
    assert!(layer.starts_with(data_path(&data).join("sandboxes").join(sandbox.id.as_str())));
    wait_for_shell();
    let woken = service.resume(&sandbox.id).expect("wake");
    assert_eq!(
        woken.sandbox.restore.as_ref().unwrap().path,
        RestorePath::Standby
    );
    guest_runs(&data, sandbox.id.as_str());
    let woken = service.get_sandbox(&sandbox.id).unwrap();
    assert_jailed(&data, &woken, &[&bystander]);
    // The layer it restored from is sealed: root's, read-only to VMMs.
    let meta = std::fs::metadata(&layer).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o755));
    service.delete_sandbox(&sandbox.id).unwrap();
    service.delete_sandbox(&bystander.id).unwrap();
    service.close();
}

#[test]
fn a_guest_over_its_memory_limit_is_oom_killed_alone() {
    if !root() {
        return;
    }
    // The probe touches only its workload: a template whose guest writes
    // 96 MiB every iteration, and sandboxes limited to 48 MiB (guest
    // memory + overhead would be 224 MiB: the guest could never reach it
    // by touching its own memory).
    let data = DataDir::new("jail-oom");
    let jail = JailConfig {
        sandbox_memory_max_mib: Some(48),
        ..JailConfig::default()
    };
    let service = service(&data, 0, jail, 100);
    service
        .create_template(CreateTemplate {
            name: "hungry".into(),
            kind: torpor_scheduler::model::TemplateKind::Probe,
            image: None,
            owner: None,
            mem_mib: 128,
            vcpus: 1,
            cmdline: Some("probe.mib=96 probe.ticks=20 probe.hz=100".into()),
            pod: None,
        })
        .expect("build the hungry template");
    let bystander = create(&service, "probe");
    let hungry = create(&service, "hungry");
    let deadline = Instant::now() + WAIT;
    let failed = loop {
        let s = service.get_sandbox(&hungry.id).unwrap();
        if s.state == SandboxState::Failed {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the hungry sandbox was not stopped: {:?}",
            s.state
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let reason = failed.failure_reason.unwrap_or_default();
    assert!(reason.contains("OOM killer"), "{reason}");
    // Only it: the other sandbox runs on.
    let bystander = service.get_sandbox(&bystander.id).unwrap();
    assert_eq!(bystander.state, SandboxState::Running);
    guest_runs(&data, bystander.id.as_str());
    service.delete_sandbox(&bystander.id).unwrap();
    service.close();
}
