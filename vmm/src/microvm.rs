//! A running microVM: its vCPU threads, its control socket, and the wait
//! for whatever ends it.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::builder::{self, BuildError, BuildTimings, VmConfig};
use crate::control::{self, ControlServer, VmController, VmState, VmStatus, PROTOCOL_VERSION};
use crate::exit::{ExitReason, ExitSignal};
use crate::vstate::memory::MemoryBackend;
use crate::vstate::vcpu::{register_kick_handler, VcpuSet};

/// Errors of a VMM run, before the guest starts.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Bind(#[from] control::server::BindError),
    #[error(transparent)]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    #[error("cannot start the control server: {0}")]
    ControlThread(std::io::Error),
    #[error("cannot create the exit event: {0}")]
    ExitEvent(std::io::Error),
}

/// How a run ended, with the boot timings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunReport {
    pub exit: ExitReason,
    pub timings: BuildTimings,
    /// From the start of the run to the first KVM_RUN, in microseconds.
    pub first_kvm_run_us: Option<u64>,
}

struct Controller {
    vcpus: Arc<VcpuSet>,
    exit: ExitSignal,
    started: Instant,
    vcpu_count: u16,
    mem_mib: u64,
    kernel: String,
}

impl VmController for Controller {
    fn status(&self) -> VmStatus {
        let state = if self.exit.reason().is_some() {
            VmState::ShuttingDown
        } else if self.vcpus.is_paused() {
            VmState::Paused
        } else {
            VmState::Running
        };
        VmStatus {
            protocol: PROTOCOL_VERSION,
            state,
            pid: std::process::id(),
            vcpus: self.vcpu_count,
            mem_mib: self.mem_mib,
            kernel: self.kernel.clone(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
        }
    }

    fn pause(&self) -> Result<VmStatus, String> {
        self.refuse_if_ending()?;
        self.vcpus.pause();
        Ok(self.status())
    }

    fn resume(&self) -> Result<VmStatus, String> {
        self.refuse_if_ending()?;
        self.vcpus.resume();
        Ok(self.status())
    }

    fn shutdown(&self) -> Result<VmStatus, String> {
        self.exit.exit(ExitReason::ControlShutdown);
        Ok(self.status())
    }
}

impl Controller {
    fn refuse_if_ending(&self) -> Result<(), String> {
        match self.exit.reason() {
            Some(r) => Err(format!("the VM is shutting down ({r:?})")),
            None => Ok(()),
        }
    }
}

/// Boots `config` and runs it until the guest or a control request ends it.
pub fn run(
    config: &VmConfig,
    backend: &dyn MemoryBackend,
    control_socket: Option<PathBuf>,
) -> Result<RunReport, RunError> {
    let started = Instant::now();
    builder::validate(config)?;
    // Bind first: a socket in use must fail before any expensive work.
    let listener = control_socket.as_deref().map(control::bind).transpose()?;
    let exit = ExitSignal::new().map_err(RunError::ExitEvent)?;
    let built = builder::build(config, backend, &exit)?;
    register_kick_handler()?;
    let first_run = Arc::new(OnceLock::new());
    let vcpus = Arc::new(VcpuSet::start(
        built.vcpus,
        built.bus.clone(),
        exit.clone(),
        first_run.clone(),
    )?);
    let controller = Arc::new(Controller {
        vcpus: vcpus.clone(),
        exit: exit.clone(),
        started,
        vcpu_count: config.vcpus,
        mem_mib: config.mem_mib,
        kernel: config.kernel.to_string(),
    });
    let _server = match (listener, control_socket) {
        (Some(l), Some(path)) => {
            Some(ControlServer::start(l, path, controller).map_err(RunError::ControlThread)?)
        }
        _ => None,
    };
    tracing::info!(timings = ?built.timings, "microVM started");
    let reason = exit.wait();
    vcpus.stop();
    // Guest memory and the VM stay alive until every vCPU thread is gone.
    drop(built.mem);
    drop(built.vm);
    Ok(RunReport {
        exit: reason,
        timings: built.timings,
        first_kvm_run_us: first_run
            .get()
            .map(|t| t.duration_since(started).as_micros() as u64),
    })
}
