//! `torpor vmm`: the per-VM process, and its control-socket client.

use std::path::PathBuf;
use std::time::Duration;

use torpor_vmm::boot::KernelImage;
use torpor_vmm::control::{self, Request};
use torpor_vmm::restore::{RestoreBackend, RestoreOptions};
use torpor_vmm::virtio_devices::{DiskConfig, VirtioConfig, VirtioRestorePaths};
use torpor_vmm::vstate::memory::AnonymousBackend;
use torpor_vmm::{RunError, RunReport, SerialOutput, VmConfig};

use super::{EXIT_FAILURE, EXIT_OK};
use crate::cli::{DirtyTrackingArg, MemoryBackendArg, VmmAction, VmmCommand, VmmRunArgs};
use torpor_vmm::dirty::DirtyTracking;

const BUILTIN_PREFIX: &str = "builtin:";
const EXIT_USAGE: i32 = 2;

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
        VmmAction::Exec(args) => return super::guest::exec(args),
        VmmAction::Resumed(args) => return super::guest::resumed(args),
        VmmAction::Ping(args) => return super::guest::ping(args),
        VmmAction::Files(args) => return super::files::run(args),
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

fn kernel_image(spec: &str) -> Result<KernelImage, String> {
    match spec.strip_prefix(BUILTIN_PREFIX) {
        Some("probe") => Ok(KernelImage::Embedded {
            name: "probe",
            bytes: torpor_probe::PROBE_ELF,
        }),
        Some(other) => Err(format!(
            "unknown built-in kernel `{other}` (available: probe)"
        )),
        None => Ok(KernelImage::Path(PathBuf::from(spec))),
    }
}

fn serial_output(args: &VmmRunArgs) -> SerialOutput {
    match (&args.serial, args.no_serial) {
        (Some(path), _) => SerialOutput::File(path.clone()),
        (None, true) => SerialOutput::Discard,
        (None, false) => SerialOutput::Stdout,
    }
}

fn run_vm(args: VmmRunArgs) -> i32 {
    let result = match (&args.restore, args.standby, &args.control_socket) {
        (Some(dir), _, _) => restore_vm(&args, dir.clone()),
        (None, true, Some(socket)) => torpor_vmm::standby(
            args.mem_mib,
            args.vcpus,
            socket.clone(),
            dirty_tracking(args.dirty_tracking),
        )
        .map_err(failed),
        _ => boot_vm(&args),
    };
    match result {
        Ok(report) => {
            if args.report {
                eprintln!("{}", serde_json::to_string(&report).unwrap_or_default());
            }
            match &report.exit {
                torpor_vmm::ExitReason::VcpuError(e) => {
                    eprintln!("torpor: error: the VM failed: {e}")
                }
                torpor_vmm::ExitReason::PageServerFailed(e) => {
                    eprintln!(
                        "torpor: error: the VM was stopped because its page server failed: {e}"
                    )
                }
                _ => {}
            }
            report.exit.exit_code()
        }
        Err((code, message)) => {
            eprintln!("torpor: error: {message}");
            code
        }
    }
}

type Failure = (i32, String);

fn dirty_tracking(arg: DirtyTrackingArg) -> DirtyTracking {
    match arg {
        DirtyTrackingArg::Kvm => DirtyTracking::Kvm,
        DirtyTrackingArg::UffdWp => DirtyTracking::UffdWp,
        DirtyTrackingArg::Both => DirtyTracking::Both,
    }
}

fn failed(e: RunError) -> Failure {
    (EXIT_FAILURE, e.to_string())
}

fn boot_vm(args: &VmmRunArgs) -> Result<RunReport, Failure> {
    let Some(kernel) = args.kernel.as_deref() else {
        return Err((
            EXIT_USAGE,
            "--kernel is required (a vmlinux/bzImage path, or builtin:probe)".into(),
        ));
    };
    let kernel = kernel_image(kernel).map_err(|e| (EXIT_FAILURE, e))?;
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
    let config = VmConfig {
        kernel,
        initrd: args.initrd.clone(),
        cmdline: args.cmdline.clone(),
        mem_mib: args.mem_mib,
        vcpus: args.vcpus,
        serial: serial_output(args),
        virtio: VirtioConfig {
            disk: args.disk.clone().map(|image| DiskConfig {
                image,
                overlay: args.disk_overlay.clone().unwrap_or_default(),
                read_only: args.disk_read_only,
            }),
            vsock_uds: args.vsock_uds.clone(),
        },
        dirty_tracking: dirty_tracking(args.dirty_tracking),
    };
    torpor_vmm::boot(&config, &AnonymousBackend, args.control_socket.clone()).map_err(failed)
}

fn restore_vm(args: &VmmRunArgs, snapshot: PathBuf) -> Result<RunReport, Failure> {
    let backend = match args.memory_backend {
        None | Some(MemoryBackendArg::File) => RestoreBackend::File,
        Some(MemoryBackendArg::Uffd) => RestoreBackend::Uffd,
        Some(MemoryBackendArg::UffdShared) => RestoreBackend::UffdShared,
        Some(MemoryBackendArg::Anonymous) => {
            return Err((
                EXIT_USAGE,
                "--memory-backend anonymous is for cold boots; a restore maps memory with file, uffd or uffd-shared"
                    .into(),
            ))
        }
    };
    let opts = RestoreOptions {
        snapshot,
        backend,
        serial: serial_output(args),
        prefetch: args.prefetch,
        record_working_set_ms: args.record_working_set_ms,
        virtio: VirtioRestorePaths {
            disk_overlay: args.disk_overlay.clone(),
            vsock_uds: args.vsock_uds.clone(),
        },
        dirty_tracking: dirty_tracking(args.dirty_tracking),
    };
    torpor_vmm::restore(&opts, args.control_socket.clone(), args.paused).map_err(failed)
}
