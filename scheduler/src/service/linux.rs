//! Linux templates and sandboxes on the local pod.
//!
//! A Linux template boots the kernel with the rootfs as a virtio-blk disk
//! (through a copy-on-write overlay: the user's image is never written) and
//! virtio-vsock, waits until torpor-agent answers `hello`, pauses and takes
//! a full snapshot; an image whose services take longer to come up holds
//! [`READY_CHECK`], which the build runs through the agent first (the code
//! interpreter's waits for its server). The VMM freezes the overlay into the snapshot
//! (`disk0.overlay`); every restore copies the frozen overlay to the
//! sandbox's own `disk.overlay` and gives it its own `vsock.sock`, and the
//! next snapshot (hibernation) freezes that overlay again, so the disk
//! travels with the sandbox through hibernate and wake. After every restore
//! the agent's `resumed` hook runs before the operation answers.
//!
//! Linux guests need VMX/SVM: on a PVM host (software KVM) they are refused
//! with `Unsupported` and pointed to the nested host.

use super::vmm_process::VmmChild;
use std::path::{Path, PathBuf};
use std::time::Duration;

use torpor_vmm_api::launch::{DiskSpec, KernelSource, RestoreSpec};

use super::guest::{AgentLink, VSOCK_FILE};
use super::vmm::{self, VmmFiles};
use super::{CreateTemplate, Service, ServiceError};
use crate::model::{Sandbox, SandboxId, Template, TemplateKind, VmmHandle};

/// The overlay file in a sandbox or template directory.
pub const OVERLAY_FILE: &str = "disk.overlay";
/// The kernel command line of Linux templates unless one is given.
pub const LINUX_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda rw init=/sbin/init";
/// How long a Linux template's first boot may take until the agent answers
/// (nested hosts emulate the CPU: tens of seconds are normal).
const AGENT_READY_LIMIT: Duration = Duration::from_secs(300);
/// A template image's readiness check: if the guest has it, a Linux
/// template's build runs it through the agent once the agent answers and
/// takes the snapshot only after it exits 0, so that every sandbox starts
/// with the image's services up (E2B's template `ready_cmd`).
pub const READY_CHECK: &str = "/etc/torpor/ready";
/// How long [`READY_CHECK`] may run (an interpreter's kernels start in
/// seconds on hardware, in minutes under the nested host's TCG).
const READY_LIMIT: Duration = Duration::from_secs(900);
/// Smallest memory a Linux template boots with.
const MIN_LINUX_MIB: u32 = 128;

/// Which template kinds this host's local pod runs: the binary fills it
/// from `torpor doctor`'s probe of /dev/kvm (the scheduler does not link
/// the VMM's KVM code).
#[derive(Debug, Clone)]
pub struct HostGuests {
    /// Linux guests boot here (VMX/SVM).
    pub linux: bool,
    /// Probe guests run here (any usable KVM).
    pub probe: bool,
    /// /dev/kvm is PVM (software nested virtualization).
    pub pvm: bool,
    /// Doctor's one-line summary.
    pub summary: String,
}

impl HostGuests {
    /// Probe guests only, nothing known: what a service assumes unless told.
    pub fn probe_only(summary: impl Into<String>) -> Self {
        Self {
            linux: false,
            probe: true,
            pvm: false,
            summary: summary.into(),
        }
    }

    /// Why Linux templates cannot run here, or `None` when they can.
    pub fn linux_refusal(&self) -> Option<String> {
        if self.linux {
            return None;
        }
        let host = if self.pvm {
            "this host's KVM is PVM (software, no VMX/SVM)".to_string()
        } else {
            format!("this host runs {}", self.summary)
        };
        Some(format!(
            "Linux templates need hardware virtualization (VMX/SVM) and {host}; run \
             them on a host with VMX/SVM, such as the nested host \
             (scripts/nested-host; `torpor serve --nested-pod` runs one as a pod). \
             Probe templates run here."
        ))
    }

    /// The template kinds the local pod runs.
    pub fn kinds(&self) -> Vec<TemplateKind> {
        let mut kinds = Vec::new();
        if self.probe {
            kinds.push(TemplateKind::Probe);
        }
        if self.linux {
            kinds.push(TemplateKind::Linux);
        }
        kinds
    }
}

/// A Linux template's checked inputs: its image's name and files.
pub(super) struct LinuxImage {
    pub name: String,
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
}

impl Service {
    /// Checks a template request: `None` for probe templates; for Linux
    /// ones, the image's name and files (see `crate::images`: a bad name is
    /// refused before anything is opened), then refusal on hosts without
    /// VMX/SVM.
    pub(super) fn linux_image(
        &self,
        req: &CreateTemplate,
    ) -> Result<Option<LinuxImage>, ServiceError> {
        if req.kind != TemplateKind::Linux {
            if req.image.is_some() {
                return Err(ServiceError::Invalid(
                    "images are for Linux templates; probe templates boot the built-in probe"
                        .into(),
                ));
            }
            return Ok(None);
        }
        let name = req.image.as_deref().ok_or_else(|| {
            ServiceError::Invalid(
                "a Linux template needs `image`: the name of an installed image".into(),
            )
        })?;
        // The image is checked first: a bad name or file is 400 on every
        // host, before anything else is looked at.
        // Fetched from the object store when this pod lacks it.
        let files = self.resolve_image(name)?;
        if let Some(why) = self.config.host.linux_refusal() {
            return Err(ServiceError::HostUnsupported(why));
        }
        if req.mem_mib < MIN_LINUX_MIB {
            return Err(ServiceError::Invalid(format!(
                "Linux templates need mem_mib >= {MIN_LINUX_MIB}"
            )));
        }
        Ok(Some(LinuxImage {
            name: name.to_string(),
            kernel: files.kernel,
            rootfs: files.rootfs,
        }))
    }

    /// Boots a Linux template once, waits for its agent, snapshots it.
    pub(super) fn boot_linux_and_snapshot(
        &self,
        template: &Template,
        cmdline: &str,
    ) -> Result<PathBuf, ServiceError> {
        let rootfs = template
            .rootfs
            .as_ref()
            .ok_or_else(|| ServiceError::Internal("Linux template without rootfs".into()))?;
        let dir = self.template_dir(&template.id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("create {}: {e}", dir.display())))?;
        super::template::record_cmdline(&dir, cmdline)?;
        let files = VmmFiles::in_dir(&dir);
        let overlay = dir.join(OVERLAY_FILE);
        let uds = dir.join(VSOCK_FILE);
        let _ = std::fs::remove_file(&uds);
        // The network device must be in the snapshot for clones to have
        // one; the template's namespace goes once it is taken.
        let net = self.template_net(template.id.as_str())?;
        let boot = super::template::Boot {
            kernel: KernelSource::Path(PathBuf::from(&template.kernel)),
            cmdline: cmdline.to_string(),
            mem_mib: template.mem_mib,
            vcpus: template.vcpus,
            disk: Some(DiskSpec {
                image: rootfs.to_path_buf(),
                overlay: overlay.clone(),
                read_only: false,
                keep_overlay: false,
            }),
            vsock_uds: Some(uds.clone()),
            net: net
                .as_ref()
                .map(|n| n.net_spec(Default::default(), Default::default())),
            // In the template, so every clone has it: guests give back
            // the memory they free (free page reporting), report their
            // memory statistics, and can be asked to shrink.
            balloon: true,
        };
        let spawned = self.spawn_boot(&files, boot);
        let vmm::Spawned {
            mut child, handle, ..
        } = match spawned {
            Ok(spawned) => spawned,
            Err(e) => {
                self.drop_template_net(net);
                return Err(e);
            }
        };
        let link = AgentLink::new(template.id.as_str(), uds.clone());
        let result = link
            .connect_waiting(AGENT_READY_LIMIT, || vm_alive(&mut child, &files))
            .map_err(|e| {
                ServiceError::Internal(format!(
                    "the template's Linux guest did not get its agent up: {e}; console: {}",
                    console_tail(&files.console)
                ))
            })
            .and_then(|client| {
                // The agent's connection closes before the snapshot: clones
                // start with no stale host connection.
                drop(client);
                wait_ready_check(&link, &files)?;
                let snapshot = dir.join("snapshot");
                vmm::pause_and_snapshot_full(&handle, &snapshot).map(|()| snapshot)
            });
        vmm::stop(&handle, Some(child));
        self.drop_template_net(net);
        // The snapshot holds the frozen overlay; the live one is no use now.
        let _ = std::fs::remove_file(&overlay);
        let _ = std::fs::remove_file(&uds);
        result
    }

    /// A clone's own device files in `spec` (its disk overlay and vsock
    /// socket, and its network when the service has networking), for a
    /// sandbox of a Linux `template`.
    pub(super) fn guest_restore_paths(
        &self,
        id: &SandboxId,
        template: &Template,
        spec: &mut RestoreSpec,
    ) -> Result<(), ServiceError> {
        if template.kind != TemplateKind::Linux {
            return Ok(());
        }
        let dir = self.sandbox_dir(id);
        let uds = dir.join(VSOCK_FILE);
        let _ = std::fs::remove_file(&uds);
        spec.disk_overlay = Some(dir.join(OVERLAY_FILE));
        spec.vsock_uds = Some(uds);
        spec.net = self.sandbox_net_spec(id)?.map(Box::new);
        Ok(())
    }

    /// After a restore (create, wake) of a sandbox of a Linux `template`:
    /// its guest's `resumed` hook. On failure the VMM just started
    /// (`handle`) is stopped and the error returned.
    pub(super) fn after_restore(
        &self,
        sandbox: &Sandbox,
        template: &Template,
        handle: &VmmHandle,
    ) -> Result<(), ServiceError> {
        if template.kind != TemplateKind::Linux {
            return Ok(());
        }
        let id = &sandbox.id;
        let link = AgentLink::new(id.as_str(), self.sandbox_dir(id).join(VSOCK_FILE));
        // A delete waiting for this sandbox ends the wait too.
        let alive = || {
            if self.locks.is_doomed(id) {
                Err("the sandbox is being deleted".to_string())
            } else if vmm::alive(handle) {
                Ok(())
            } else {
                Err("the sandbox's VMM exited".to_string())
            }
        };
        let up = link.resumed(id.as_str(), alive).map_err(ServiceError::from);
        let up = up.and_then(|reply| {
            tracing::debug!(sandbox = %id, generation = ?reply.generation, "resumed hook ran");
            super::mounts::mount_in_guest(&link, &sandbox.volumes)
        });
        match up {
            Ok(()) => Ok(()),
            Err(e) => {
                let mut started = sandbox.clone();
                started.vmm = Some(handle.clone());
                let _ = self.stop_vmm(&started);
                Err(e)
            }
        }
    }
}

/// `Ok` while the VMM process runs; its exit and log otherwise.
fn vm_alive(child: &mut VmmChild, files: &VmmFiles) -> Result<(), String> {
    match child.try_wait() {
        Ok(None) => Ok(()),
        Ok(Some(status)) => Err(format!(
            "the VMM exited ({status}): {}; console: {}",
            vmm::log_tail(&files.log),
            console_tail(&files.console)
        )),
        Err(e) => Err(format!("cannot check the VMM: {e}")),
    }
}

/// The console's last lines, for error messages.
fn console_tail(path: &Path) -> String {
    vmm::log_tail(path)
}

/// What the VMM's log says ended the guest, if it did (its own words are
/// kept out: they may name the host's paths): a triple fault or reset
/// shows as the agent's connection closing, which explains nothing.
pub(super) fn guest_end(files: &VmmFiles) -> &'static str {
    if vmm::log_tail(&files.log).contains("the guest shut down (KVM_EXIT_SHUTDOWN") {
        "; the guest shut down (a triple fault or a reset, says its VMM)"
    } else {
        ""
    }
}

/// Runs the guest's [`READY_CHECK`], if it has one, until it exits (its
/// connection is closed when this returns); a failure or a timeout fails
/// the build with its output.
fn wait_ready_check(link: &AgentLink, files: &VmmFiles) -> Result<(), ServiceError> {
    let req = super::guest::ExecRequest {
        argv: vec![
            "/bin/sh".into(),
            "-c".into(),
            format!("[ ! -e {READY_CHECK} ] || exec {READY_CHECK}"),
        ],
        timeout_ms: Some(READY_LIMIT.as_millis() as u64),
        max_output_bytes: Some(16 << 10),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let out = link.exec(req, &super::Cancel::default()).map_err(|e| {
        ServiceError::Internal(format!(
            "the template's readiness check {READY_CHECK} did not run: {e}{}; console: {}",
            guest_end(files),
            console_tail(&files.console)
        ))
    })?;
    let said = String::from_utf8_lossy(&[out.stdout, out.stderr].concat())
        .trim()
        .to_string();
    if out.exit.code == Some(0) {
        if !said.is_empty() {
            tracing::info!(
                seconds = started.elapsed().as_secs(),
                output = %said,
                "the template's readiness check passed"
            );
        }
        return Ok(());
    }
    let how = if out.exit.timed_out {
        format!("did not pass within {READY_LIMIT:?}")
    } else {
        format!("failed ({:?})", out.exit)
    };
    Err(ServiceError::Internal(format!(
        "the template's readiness check {READY_CHECK} {how}: {said}; console: {}",
        console_tail(&files.console)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_that_shut_down_is_named_without_the_vmms_words() {
        let dir = tempfile::tempdir().unwrap();
        let files = VmmFiles::in_dir(dir.path());
        assert_eq!(guest_end(&files), "", "no log");
        std::fs::write(&files.log, "WARN vsock: /secret/host/path unanswered\n").unwrap();
        assert_eq!(guest_end(&files), "");
        std::fs::write(
            &files.log,
            "WARN torpor_vmm::vstate::vcpu: the guest shut down (KVM_EXIT_SHUTDOWN: a triple \
             fault or a reset) vcpu=0 rip=0xfff0 /secret/host/path\n",
        )
        .unwrap();
        let said = guest_end(&files);
        assert!(said.contains("the guest shut down"), "{said}");
        assert!(!said.contains("/secret"), "{said}");
    }
}
