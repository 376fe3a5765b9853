//! `torpor vmm`: the per-VM process, and its control-socket client.

use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::time::Duration;

use torpor_vmm::control::{self, Request};
use torpor_vmm_api::jail::{self, Expose, JailSpec};
use torpor_vmm_api::launch::{
    Console, DiskSpec, KernelSource, LaunchMode, LaunchSpec, MemoryBackend, RestoreSpec,
};

use super::{EXIT_FAILURE, EXIT_OK};
use crate::cli::{MemoryBackendArg, VmmAction, VmmCommand, VmmRunArgs};

const EXIT_USAGE: i32 = 2;
/// The empty directory `torpor vmm`'s jail root is mounted on (in the
/// VMM's own mount namespace).
const CLI_JAIL_ROOT: &str = "/run/torpor/jail-root";

pub fn run(cmd: VmmCommand) -> i32 {
    match cmd.action {
        Some(VmmAction::Exec(args)) => super::guest::exec(args),
        Some(VmmAction::Resumed(args)) => super::guest::resumed(args),
        Some(VmmAction::Ping(args)) => super::guest::ping(args),
        Some(VmmAction::Files(args)) => super::files::run(args),
        Some(action) => control_request(action),
        None => run_vm(cmd.run),
    }
}

fn control_request(action: VmmAction) -> i32 {
    let (socket, req) = match action {
        VmmAction::Status(s) => (s.socket, Request::Status),
        VmmAction::Pause(s) => (s.socket, Request::Pause),
        VmmAction::Resume(s) => (s.socket, Request::Resume),
        VmmAction::Shutdown(s) => (s.socket, Request::Shutdown),
        VmmAction::Vcpus(s) => (s.socket, Request::VcpuState),
        VmmAction::Exec(args) => return super::guest::exec(args),
        VmmAction::Resumed(args) => return super::guest::resumed(args),
        VmmAction::Ping(args) => return super::guest::ping(args),
        VmmAction::Files(args) => return super::files::run(args),
        VmmAction::Balloon(b) => match b.target_mib {
            Some(target_mib) => (b.socket, Request::SetBalloon { target_mib }),
            None => (b.socket, Request::BalloonStats),
        },
        VmmAction::Snapshot(s) => (
            s.socket,
            Request::Snapshot {
                path: s.out,
                diff: s.diff,
            },
        ),
    };
    // Snapshots of large guests take as long as the disk needs.
    match control::call(&socket, &req, Duration::from_secs(600)) {
        Ok(response) => {
            println!("{}", serde_json::to_string(&response).unwrap_or_default());
            EXIT_OK
        }
        Err(e) => {
            eprintln!("torpor: error: {e}");
            EXIT_FAILURE
        }
    }
}

fn console(args: &VmmRunArgs) -> Console {
    match (&args.serial, args.no_serial) {
        (Some(path), _) => Console::file(path.clone()),
        (None, true) => Console::Discard,
        (None, false) => Console::Stdout,
    }
}

fn run_vm(args: VmmRunArgs) -> i32 {
    let spec = match launch_spec(&args) {
        Ok(spec) => spec,
        Err((code, message)) => {
            eprintln!("torpor: error: {message}");
            return code;
        }
    };
    if spec.seccomp != torpor_vmm_api::SeccompLevel::Enforce {
        eprintln!(
            "torpor: warning: --seccomp {}: this VMM's threads are not confined by seccomp; \
             a guest that escapes into it can make any system call",
            spec.seccomp.name()
        );
    }
    exec_vmm(&spec, args.report)
}

/// Becomes `torpor-vmm --cli` (the binary beside this one), its spec on
/// stdin: a VM started by hand is the same small process a pod starts,
/// with this process's pid, stdout (the guest's console) and stderr.
/// Returns only when that cannot be done.
fn exec_vmm(spec: &LaunchSpec, report: bool) -> i32 {
    use std::io::Write;
    use std::os::unix::process::CommandExt;
    let vmm = match super::server::vmm_exe() {
        Ok(vmm) => vmm,
        Err(e) => {
            eprintln!("torpor: error: {e}");
            return EXIT_FAILURE;
        }
    };
    let text = match serde_json::to_vec(spec) {
        Ok(text) if text.len() as u64 <= torpor_vmm_api::launch::MAX_SPEC_BYTES => text,
        Ok(text) => {
            eprintln!(
                "torpor: error: the launch spec is {} bytes, more than a VMM reads",
                text.len()
            );
            return EXIT_USAGE;
        }
        Err(e) => {
            eprintln!("torpor: error: cannot write the launch spec: {e}");
            return EXIT_FAILURE;
        }
    };
    // The spec (at most 64 KiB, a pipe's room) is written before the exec,
    // and the write end closed: the VMM reads it to its end.
    let written = std::io::pipe().and_then(|(reader, mut writer)| {
        writer.write_all(&text)?;
        Ok(reader)
    });
    let reader = match written {
        Ok(reader) => reader,
        Err(e) => {
            eprintln!(
                "torpor: error: cannot hand the launch spec to {}: {e}",
                vmm.display()
            );
            return EXIT_FAILURE;
        }
    };
    let mut cmd = std::process::Command::new(&vmm);
    cmd.arg("--cli").stdin(reader);
    if report {
        cmd.arg("--report");
    }
    let e = cmd.exec();
    eprintln!("torpor: error: cannot run {}: {e}", vmm.display());
    EXIT_FAILURE
}

type Failure = (i32, String);

/// The flags as the same `LaunchSpec` a pod hands `torpor-vmm`.
fn launch_spec(args: &VmmRunArgs) -> Result<LaunchSpec, Failure> {
    let mode = match (&args.restore, args.standby) {
        (Some(dir), _) => LaunchMode::Restore {
            restore: RestoreSpec {
                snapshot: dir.clone(),
                backend: restore_backend(args.memory_backend)?,
                prefetch: args.prefetch,
                disk_overlay: args.disk_overlay.clone(),
                vsock_uds: args.vsock_uds.clone(),
                net: args.net.clone().map(Box::new),
                lazy_map: None,
            },
            paused: args.paused,
            record_working_set_ms: args.record_working_set_ms,
        },
        (None, true) => {
            if args.control_socket.is_none() {
                return Err((EXIT_USAGE, "--standby needs --control-socket".into()));
            }
            LaunchMode::Standby {
                mem_mib: args.mem_mib,
                vcpus: args.vcpus,
            }
        }
        (None, false) => boot_mode(args)?,
    };
    let mut spec = LaunchSpec {
        control_socket: args.control_socket.clone(),
        mode,
        console: console(args),
        dirty_tracking: args.dirty_tracking.tracking(),
        jail: None,
        seccomp: args.seccomp.level(),
    };
    if args.no_jail {
        eprintln!(
            "torpor: warning: running the VMM without a jail (--no-jail): a guest that \
             escapes its VMM gets this process's privileges"
        );
    } else {
        spec.jail = Some(cli_jail(args, &spec)?);
        // Jailed, every path must be absolute and exposed.
        spec.check().map_err(|e| (EXIT_USAGE, e.to_string()))?;
    }
    Ok(spec)
}

/// `torpor vmm`'s own jail: the paths the spec names, the extra
/// `--jail-expose` ones, a cgroup when the guest's size is known.
fn cli_jail(args: &VmmRunArgs, spec: &LaunchSpec) -> Result<JailSpec, Failure> {
    let mut exposes = torpor_vmm_api::exposes::exposes_for(spec);
    for e in &args.jail_expose {
        let (path, read_only) = match e.strip_suffix(":ro") {
            Some(p) => (p, true),
            None => (e.as_str(), false),
        };
        exposes.push(Expose {
            path: PathBuf::from(path),
            read_only,
        });
    }
    if let LaunchMode::Restore { restore, .. } = &spec.mode {
        // The disk's base image is named in the snapshot, not on the
        // command line: read-only in the jail too.
        if let Some(image) = snapshot_base_image(&restore.snapshot) {
            if !exposes.iter().any(|e| e.path == image) {
                exposes.push(Expose::read_only(image));
            }
        }
    }
    let root = PathBuf::from(CLI_JAIL_ROOT);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&root)
        .map_err(|e| (EXIT_FAILURE, format!("cannot create {CLI_JAIL_ROOT}: {e}")))?;
    let cgroup = match &spec.mode {
        LaunchMode::Boot { mem_mib, vcpus, .. } | LaunchMode::Standby { mem_mib, vcpus } => {
            Some(jail::cgroup_for(
                format!("torpor/cli-{}", std::process::id()),
                *mem_mib,
                u64::from(*vcpus),
            ))
        }
        LaunchMode::Restore { .. } => None,
    };
    Ok(JailSpec {
        uid: args.jail_uid,
        gid: args.jail_gid.unwrap_or(args.jail_uid),
        root,
        exposes,
        devices: torpor_vmm_api::exposes::devices_for(spec),
        cgroup,
        rlimits: Default::default(),
        namespaces: jail::Namespaces {
            join_net: args.jail_netns.clone(),
            ..Default::default()
        },
    })
}

/// The base image of the snapshot's disk, if it has one (a snapshot that
/// cannot be read is the restore's to report, with its own error).
fn snapshot_base_image(dir: &std::path::Path) -> Option<PathBuf> {
    let state: torpor_vmm::vm_state::MicrovmState =
        torpor_vmm::snapshot::read_state(&dir.join(torpor_vmm::snapshot::STATE_FILE)).ok()?;
    let (_, block) = state.devices.virtio.block?;
    Some(block.device.base_path)
}

fn boot_mode(args: &VmmRunArgs) -> Result<LaunchMode, Failure> {
    let Some(kernel) = args.kernel.as_deref() else {
        return Err((
            EXIT_USAGE,
            "--kernel is required (a vmlinux/bzImage path, or builtin:probe)".into(),
        ));
    };
    match args.memory_backend {
        None | Some(MemoryBackendArg::Anonymous) => {}
        Some(other) => {
            return Err((
                EXIT_USAGE,
                format!("--memory-backend {other:?} maps a snapshot; use it with --restore")
                    .to_lowercase(),
            ))
        }
    }
    Ok(LaunchMode::Boot {
        kernel: KernelSource::parse(kernel),
        initrd: args.initrd.clone(),
        cmdline: Some(args.cmdline.clone()),
        mem_mib: args.mem_mib,
        vcpus: args.vcpus,
        disk: args.disk.clone().map(|image| DiskSpec {
            image,
            overlay: args.disk_overlay.clone().unwrap_or_default(),
            read_only: args.disk_read_only,
            keep_overlay: false,
        }),
        vsock_uds: args.vsock_uds.clone(),
        net: args.net.clone().map(Box::new),
        balloon: args.balloon,
    })
}

fn restore_backend(arg: Option<MemoryBackendArg>) -> Result<MemoryBackend, Failure> {
    match arg {
        None | Some(MemoryBackendArg::File) => Ok(MemoryBackend::File),
        Some(MemoryBackendArg::Uffd) => Ok(MemoryBackend::Uffd),
        Some(MemoryBackendArg::UffdShared) => Ok(MemoryBackend::UffdShared),
        Some(MemoryBackendArg::Anonymous) => Err((
            EXIT_USAGE,
            "--memory-backend anonymous is for cold boots; a restore maps memory with file, uffd or uffd-shared"
                .into(),
        )),
    }
}
