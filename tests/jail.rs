//! Every VMM the service starts is jailed (docs/vmm.md, "The jail"):
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
    // Its /proc holds processes only: no /proc/net (the unix sockets of
    // every VMM in the shared network namespace), no /proc/sys.
    for hidden in ["net", "sys", "meminfo"] {
        assert!(
            !root.join("proc").join(hidden).exists(),
            "/proc/{hidden} is visible in the jail"
        );
    }
    assert!(root.join("proc/self/maps").exists() || root.join("proc/1/maps").exists());
    // The network namespace is the pod's shared empty one, the same for
    // every VMM without a sandbox network: a loopback interface and
    // nothing else.
    let net = std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    // (nsenter is util-linux's, in every Debian; /proc/net is the
    // network namespace of the process reading it.)
    let dev = std::process::Command::new("nsenter")
        .args([&format!("--net=/proc/{pid}/ns/net"), "cat", "/proc/net/dev"])
        .output()
        .unwrap();
    let dev = String::from_utf8_lossy(&dev.stdout).into_owned();
    let links: Vec<&str> = dev
        .lines()
        .filter_map(|l| l.split_once(':').map(|(name, _)| name.trim()))
        .collect();
    assert_eq!(links, ["lo"], "{dev}");
    for other in others {
        let theirs = other.vmm.as_ref().map(|v| v.pid);
        if let Some(theirs) = theirs {
            assert_eq!(
                std::fs::read_link(format!("/proc/{theirs}/ns/net")).unwrap(),
                net,
                "VMMs {pid} and {theirs} are in different network namespaces"
            );
        }
    }
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

/// Owner, group and mode of `path` (not following a link).
fn owner_mode(path: &Path) -> (u32, u32, u32) {
    let m = std::fs::symlink_metadata(path).unwrap();
    (m.uid(), m.gid(), m.mode() & 0o7777)
}

/// Attack 4 of issue 24: the jailed VMM writes `lineage.json`, so a
/// compromised one can name another sandbox's directory as a layer of its
/// snapshot. The service checks the chain against the sandbox's own
/// directory and the layers the store knows for it before it seals or
/// mounts anything: the wake fails with `bad_snapshot` naming the layer,
/// and the victim's files keep their owner and mode (another sandbox's,
/// 0700: unreadable to the attacker) and it hibernates and wakes as before.
#[test]
fn a_forged_lineage_is_refused() {
    use torpor_scheduler::service::ServiceError;
    use torpor_vmm_api::lineage::{Lineage, LINEAGE_FILE};
    use torpor_vmm_api::ErrorKind;
    if !root() {
        return;
    }
    let data = DataDir::new("jail-lineage");
    let service = service(&data, 0, JailConfig::default(), 0);
    let sandboxes = data_path(&data).join("sandboxes");
    let victim = create(&service, "probe");
    let attacker = create(&service, "probe");
    for s in [&victim, &attacker] {
        service.hibernate(&s.id).expect("hibernate");
    }
    let victim_dir = sandboxes.join(victim.id.as_str());
    let victim_layer = service.get_sandbox(&victim.id).unwrap().snapshot.unwrap();
    let attacker_dir = sandboxes.join(attacker.id.as_str());
    let layer = service.get_sandbox(&attacker.id).unwrap().snapshot.unwrap();
    let honest = Lineage::read(&layer).unwrap();
    let record = layer.join(LINEAGE_FILE);
    let honest_text = std::fs::read(&record).unwrap();
    let before = [&victim_dir, &victim_layer].map(|p| owner_mode(p));
    assert_ne!(before[0].0, 0, "the victim's directory is its VMM's uid's");

    let link = attacker_dir.join("evil");
    std::os::unix::fs::symlink(&victim_layer, &link).unwrap();
    let dotted = PathBuf::from(format!(
        "{}/../{}/{}",
        attacker_dir.display(),
        victim.id,
        victim_layer.file_name().unwrap().to_string_lossy()
    ));
    // Each forged layer goes where the attacker's chain has its base.
    for forged in [
        victim_layer.clone(),
        victim_dir.clone(),
        dotted.clone(),
        link.clone(),
    ] {
        let mut layers = honest.layers.clone();
        layers.insert(layers.len() - 1, forged.clone());
        let text = serde_json::json!({ "version": 1, "layers": layers }).to_string();
        std::fs::write(&record, text).unwrap();
        let e = service
            .resume(&attacker.id)
            .expect_err("a forged chain wakes");
        let ServiceError::Vm(vm) = &e else {
            panic!("{}: not a VMM error: {e:?}", forged.display())
        };
        assert_eq!(vm.kind, ErrorKind::BadSnapshot, "{e}");
        assert_eq!(vm.layer.as_deref(), Some(forged.as_path()), "{e}");
        assert!(e.to_string().contains(&forged.display().to_string()), "{e}");
        let after = service.get_sandbox(&attacker.id).unwrap();
        assert_eq!(after.state, SandboxState::Hibernated, "{e}");
        assert!(after.vmm.is_none());
        // A checkpoint of the hibernated sandbox reads the same chain.
        let ckpt = service.create_checkpoint(
            &attacker.id,
            torpor_scheduler::service::CreateCheckpoint { name: "c".into() },
        );
        assert!(ckpt.is_err(), "a checkpoint took a forged chain");
        assert_eq!(
            [&victim_dir, &victim_layer].map(|p| owner_mode(p)),
            before,
            "{}: the victim's files changed",
            forged.display()
        );
    }
    // The record itself a link to the victim's.
    std::fs::remove_file(&record).unwrap();
    std::os::unix::fs::symlink(victim_layer.join(LINEAGE_FILE), &record).unwrap();
    let e = service
        .resume(&attacker.id)
        .expect_err("a linked record wakes");
    assert!(
        matches!(&e, ServiceError::Vm(vm) if vm.kind == ErrorKind::BadSnapshot),
        "{e:?}"
    );
    assert_eq!([&victim_dir, &victim_layer].map(|p| owner_mode(p)), before);

    // The honest record wakes the attacker; the victim is untouched and
    // goes on hibernating and waking.
    std::fs::remove_file(&record).unwrap();
    std::fs::remove_file(&link).unwrap();
    std::fs::write(&record, &honest_text).unwrap();
    service
        .resume(&attacker.id)
        .expect("the honest chain wakes");
    service.resume(&victim.id).expect("the victim wakes");
    guest_runs(&data, victim.id.as_str());
    service
        .hibernate(&victim.id)
        .expect("the victim hibernates");
    service.resume(&victim.id).expect("the victim wakes again");
    service.delete_sandbox(&attacker.id).unwrap();
    service.delete_sandbox(&victim.id).unwrap();
    service.close();
}

/// Owner, group, mode and change time of every file and directory in the
/// layers `layers` (not following links).
fn stamps(layers: &[PathBuf]) -> Vec<(PathBuf, u32, u32, u32, i64, i64)> {
    fn walk(p: &Path, out: &mut Vec<(PathBuf, u32, u32, u32, i64, i64)>) {
        let m = std::fs::symlink_metadata(p).unwrap();
        out.push((
            p.to_path_buf(),
            m.uid(),
            m.gid(),
            m.mode() & 0o7777,
            m.ctime(),
            m.ctime_nsec(),
        ));
        if m.is_dir() {
            let mut entries: Vec<_> = std::fs::read_dir(p)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            entries.sort();
            for e in entries {
                walk(&e, out);
            }
        }
    }
    let mut out = Vec::new();
    for l in layers {
        walk(l, &mut out);
    }
    out
}

/// The layers of `sandbox`'s snapshot that are outside its own directory.
fn outside_layers(data: &DataDir, service: &Service, sandbox: &Sandbox) -> Vec<PathBuf> {
    let own = data_path(data).join("sandboxes").join(sandbox.id.as_str());
    let snapshot = service.get_sandbox(&sandbox.id).unwrap().snapshot.unwrap();
    torpor_vmm_api::lineage::Lineage::read(&snapshot)
        .unwrap()
        .layers
        .into_iter()
        .filter(|l| !l.starts_with(&own))
        .collect()
}

/// Issue 24: a wake changes no owner or mode outside the waking sandbox's
/// own directory. The layers a fork sits on (its source's checkpoint) and
/// those of a snapshot made a template (the source's layers, the probe
/// template's snapshot) are sealed when they become shared (the fork, the
/// template); a wake of the fork or of a sandbox made from the template
/// only checks them. They are left sealed but not as sealing leaves them
/// (0555/0444), so a wake that sealed them would show in their modes and
/// change times. One that is not sealed (another owner) fails the wake
/// with `bad_snapshot` naming it, and is not changed either.
#[test]
fn a_wake_changes_nothing_outside_its_own_directory() {
    use std::os::unix::fs::PermissionsExt;
    use torpor_scheduler::service::{
        CreateCheckpoint, ForkSandbox, ServiceError, TemplateFromSandbox,
    };
    use torpor_vmm_api::ErrorKind;
    if !root() {
        return;
    }
    let data = DataDir::new("jail-shared");
    let service = service(&data, 0, JailConfig::default(), 0);
    let source = create(&service, "probe");
    service
        .create_checkpoint(&source.id, CreateCheckpoint { name: "c".into() })
        .expect("checkpoint");
    let fork = service
        .fork_sandbox(
            &source.id,
            ForkSandbox {
                checkpoint: Some("c".into()),
                ..Default::default()
            },
        )
        .expect("fork");
    let template = service
        .template_from_sandbox(&source.id, TemplateFromSandbox::default())
        .expect("snapshot as a template");
    let child = create(&service, template.id.as_str());
    for s in [&fork, &child] {
        service.hibernate(&s.id).expect("hibernate");
    }
    let set = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    // Sealed when shared.
    for s in [&fork, &child] {
        let outside = outside_layers(&data, &service, s);
        assert!(outside.len() >= 2, "{outside:?}");
        for (path, uid, gid, mode, ..) in stamps(&outside) {
            let want = if path.is_dir() { 0o755 } else { 0o644 };
            assert_eq!((uid, gid, mode), (0, 0, want), "{}", path.display());
        }
    }
    for s in [&fork, &child] {
        let outside = outside_layers(&data, &service, s);
        for (path, ..) in stamps(&outside) {
            set(&path, if path.is_dir() { 0o555 } else { 0o444 });
        }
        let before = stamps(&outside);
        service.resume(&s.id).expect("wake");
        guest_runs(&data, s.id.as_str());
        assert_eq!(stamps(&outside), before, "a wake changed a shared layer");
        service.hibernate(&s.id).expect("hibernate again");
    }

    // A shared layer that is not sealed: the wake fails, naming it, and
    // leaves it as it is.
    let outside = outside_layers(&data, &service, &fork);
    let file = outside
        .iter()
        .map(|l| l.join("state"))
        .find(|f| f.exists())
        .expect("a layer with a state file");
    std::os::unix::fs::lchown(&file, Some(4242), Some(4242)).unwrap();
    let before = stamps(&outside);
    let e = service
        .resume(&fork.id)
        .expect_err("a wake on an unsealed layer");
    let ServiceError::Vm(vm) = &e else {
        panic!("not a VMM error: {e:?}")
    };
    assert_eq!(vm.kind, ErrorKind::BadSnapshot, "{e}");
    assert_eq!(vm.layer.as_deref(), Some(file.as_path()), "{e}");
    assert!(e.to_string().contains("not sealed"), "{e}");
    assert_eq!(stamps(&outside), before, "a refused wake changed a layer");
    assert_eq!(
        service.get_sandbox(&fork.id).unwrap().state,
        SandboxState::Hibernated
    );
    std::os::unix::fs::lchown(&file, Some(0), Some(0)).unwrap();
    service.resume(&fork.id).expect("wake once sealed");
    for s in [&fork, &child, &source] {
        service.delete_sandbox(&s.id).unwrap();
    }
    service.close();
}

/// `torpor vmm` jailed (the CLI's own jail: the VMM is pid 1 of its pid
/// namespace, its supervisor outside) stops on SIGTERM, SIGINT and SIGHUP
/// as an unjailed one does: the supervisor passes the signal on, and the
/// VMM, which as a namespace's init would ignore a signal it has no
/// handler for, ends with the shell's 128 + signal. Before, it ran on and
/// its supervisor waited for it.
#[test]
fn a_jailed_cli_vmm_stops_on_a_termination_signal() {
    use std::os::unix::process::ExitStatusExt;
    assert!(root());
    let scratch = common::Scratch::new("jail-signal");
    let uid = torpor_vmm_api::jail::CLI_JAIL_UID;
    std::os::unix::fs::chown(&scratch.0, Some(uid), Some(uid)).unwrap();
    for (signal, name) in [
        (libc::SIGTERM, "TERM"),
        (libc::SIGINT, "INT"),
        (libc::SIGHUP, "HUP"),
    ] {
        let sock = scratch.0.join(format!("{name}.sock"));
        let mut child = std::process::Command::new(common::TORPOR)
            .args(["vmm", "--standby", "--mem-mib", "64", "--control-socket"])
            .arg(&sock)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        common::wait_for(WAIT, || sock.exists());
        let vmm = std::fs::read_to_string(format!("/proc/{}/task/{0}/children", child.id()))
            .unwrap_or_default();
        assert!(
            !vmm.trim().is_empty(),
            "SIG{name}: no jailed VMM under its supervisor"
        );
        // SAFETY: kill with a pid we spawned and a signal number.
        assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("SIG{name}: the jailed VMM still runs 10 s after the signal");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(
            (status.code(), status.signal()),
            (Some(128 + signal), None),
            "SIG{name}"
        );
        assert!(!sock.exists() || std::os::unix::net::UnixStream::connect(&sock).is_err());
    }
}
