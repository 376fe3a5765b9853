//! `torpor vmm`: the per-VM process, and its control-socket client.

use std::path::PathBuf;
use std::time::Duration;

use torpor_vmm::boot::KernelImage;
use torpor_vmm::control::{self, Request};
use torpor_vmm::vstate::memory::AnonymousBackend;
use torpor_vmm::{SerialOutput, VmConfig};

use super::{EXIT_FAILURE, EXIT_OK};
use crate::cli::{MemoryBackendArg, VmmAction, VmmCommand, VmmRunArgs};

const BUILTIN_PREFIX: &str = "builtin:";

pub fn run(cmd: VmmCommand) -> i32 {
    match cmd.action {
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
    };
    match control::request(&socket, &req, Duration::from_secs(10)) {
        Ok(status) => {
            println!("{}", serde_json::to_string(&status).unwrap_or_default());
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

fn run_vm(args: VmmRunArgs) -> i32 {
    let Some(kernel) = args.kernel.as_deref() else {
        eprintln!("torpor: error: --kernel is required (a vmlinux/bzImage path, or builtin:probe)");
        return 2;
    };
    let kernel = match kernel_image(kernel) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("torpor: error: {e}");
            return EXIT_FAILURE;
        }
    };
    let serial = match (args.serial, args.no_serial) {
        (Some(path), _) => SerialOutput::File(path),
        (None, true) => SerialOutput::Discard,
        (None, false) => SerialOutput::Stdout,
    };
    let config = VmConfig {
        kernel,
        initrd: args.initrd,
        cmdline: args.cmdline,
        mem_mib: args.mem_mib,
        vcpus: args.vcpus,
        serial,
    };
    let backend = match args.memory_backend {
        MemoryBackendArg::Anonymous => AnonymousBackend,
    };
    match torpor_vmm::run(&config, &backend, args.control_socket) {
        Ok(report) => {
            if args.report {
                eprintln!("{}", serde_json::to_string(&report).unwrap_or_default());
            }
            if let torpor_vmm::ExitReason::VcpuError(e) = &report.exit {
                eprintln!("torpor: error: the VM failed: {e}");
            }
            report.exit.exit_code()
        }
        Err(e) => {
            eprintln!("torpor: error: {e}");
            EXIT_FAILURE
        }
    }
}
