//! Templates: boot once, wait until the guest is ready, snapshot it.
//! Probe templates run here natively; Linux templates (see `linux.rs`) need
//! hardware virtualization: on PVM hosts, the nested host.

use std::path::Path;
use std::time::{Duration, Instant};

use torpor_sync::Locked;
use torpor_vmm_api::lineage::WORKING_SET_FILE;

use serde_json::json;

use torpor_vmm_api::launch::{
    Console, KernelSource, LaunchMode, LaunchSpec, MemoryBackend, RestoreSpec,
};

use super::linux::LINUX_CMDLINE;
use super::resident::Ask;

/// The window after a template's first restore whose page touches are its
/// working set.
pub const WORKING_SET_MS: u64 = 300;

use super::conclude::Undo;
use super::layers::template_files;
use super::vmm::{self, VmmFiles};
use super::{CreateTemplate, Service, ServiceError, PROBE_TEMPLATE};
use crate::model::{Template, TemplateId, TemplateKind, TemplateState, Timestamp};
use crate::store::{OperationKind, OperationStatus};

/// Longest `cmdline` a template may give (the OpenAPI document says the
/// same).
const MAX_CMDLINE: usize = 2048;

/// How long a template's first boot may take to print its ready line.
const READY_LIMIT: Duration = Duration::from_secs(60);
/// The probe's workload and pace in templates: 1 MiB, one iteration a second.
pub(super) const PROBE_CMDLINE: &str = "probe.mib=1 probe.ticks=100 probe.hz=100";

impl Service {
    /// Makes sure the built-in probe template exists and is ready.
    pub(super) fn ensure_probe_template(&self) -> Result<(), ServiceError> {
        let ready = self.list_templates()?.into_iter().any(|t| {
            t.name == PROBE_TEMPLATE && t.tenant.is_none() && t.state == TemplateState::Ready
        });
        if ready {
            return Ok(());
        }
        for stale in self
            .list_templates()?
            .into_iter()
            .filter(|t| t.name == PROBE_TEMPLATE && t.tenant.is_none())
        {
            let _ = self.store.delete_template(&stale.id);
        }
        self.build_template(CreateTemplate::probe(PROBE_TEMPLATE))
            .map(|_| ())
    }

    /// Registers a template and builds its snapshot.
    pub(super) fn build_template(&self, req: CreateTemplate) -> Result<Template, ServiceError> {
        let chars = req.name.chars().count();
        if chars == 0 || chars > 64 {
            return Err(ServiceError::Invalid(
                "template names are 1 to 64 characters".into(),
            ));
        }
        // The kernel's command line: printable ASCII (the VMM's loader
        // takes nothing else), bounded well within its 4 KiB page.
        if let Some(c) = &req.cmdline {
            if c.len() > MAX_CMDLINE || !c.bytes().all(|b| (b' '..=b'~').contains(&b)) {
                return Err(ServiceError::Invalid(format!(
                    "cmdline is at most {MAX_CMDLINE} printable ASCII characters"
                )));
            }
        }
        let linux = self.linux_image(&req)?;
        if !(16..=65536).contains(&req.mem_mib) || !(1..=254).contains(&req.vcpus) {
            return Err(ServiceError::Invalid(
                "mem_mib must be 16..65536 and vcpus 1..254".into(),
            ));
        }
        // A valid size this host cannot hold (the VMM would refuse it).
        if let Ok(host) = torpor_vmm_api::host::memory_bytes() {
            let host_mib = host >> 20;
            if u64::from(req.mem_mib) > host_mib {
                return Err(ServiceError::HostUnsupported(format!(
                    "mem_mib {} is larger than this host's {host_mib} MiB of RAM",
                    req.mem_mib
                )));
            }
        }
        // A build boots a VM of the template's size: admitted like a
        // create, and counted until it ends.
        let _building = self.admit_build(req.mem_mib)?;
        let template = Template {
            id: TemplateId::generate(),
            name: req.name,
            kernel: linux.as_ref().map_or_else(
                || "builtin:probe".into(),
                |l| l.kernel.to_string_lossy().into_owned(),
            ),
            image: linux.as_ref().map(|l| l.name.clone()),
            tenant: req.owner.filter(|o| !o.admin).map(|o| o.tenant),
            rootfs: linux.map(|l| l.rootfs),
            snapshot_dir: None,
            mem_mib: req.mem_mib,
            vcpus: req.vcpus,
            kind: req.kind,
            created_at: Timestamp::now(),
            state: TemplateState::Building,
            source: None,
            stored_snapshot: None,
        };
        let op = self.store.write(|tx| {
            tx.insert_template(&template)?;
            tx.begin_operation(
                None,
                OperationKind::BuildTemplate,
                &json!({ "template": template.id }),
                None,
            )
        })?;
        // The image's files are shared with this template (and the build's
        // VMM only checks what is outside the template's directory).
        let built =
            self.seal_shared(&template_files(&template))
                .and_then(|()| match template.kind {
                    TemplateKind::Probe => self.boot_and_snapshot(
                        &template,
                        req.cmdline.as_deref().unwrap_or(PROBE_CMDLINE),
                    ),
                    TemplateKind::Linux => self.boot_linux_and_snapshot(
                        &template,
                        req.cmdline.as_deref().unwrap_or(LINUX_CMDLINE),
                    ),
                });
        // Only uffd backends prefetch; `file` restores map the page cache.
        if let (Ok(snapshot), true) = (&built, self.config.memory_backend != MemoryBackend::File) {
            self.record_working_set(&template, snapshot);
        }
        // Built: its snapshot is shared with every sandbox made from it
        // from now on, so it is sealed before the template is ready.
        let built = built.and_then(|snapshot| {
            let owner = crate::store::LayerOwner::Template(template.id.clone());
            let chain = self.checked_chain(&owner, &snapshot)?;
            let layers: Vec<_> = chain.into_iter().map(|(dir, _)| dir).collect();
            self.seal_shared(&layers).map(|()| snapshot)
        });
        self.conclude(
            &op.id,
            built,
            |snapshot| {
                // The snapshot, the state and the operation's end: one commit.
                self.store.write(|tx| {
                    tx.set_template_snapshot(&template.id, Some(&snapshot))?;
                    tx.set_template_state(&template.id, &TemplateState::Ready)?;
                    tx.finish_operation(&op.id, OperationStatus::Done, None, None)?;
                    Ok(())
                })?;
                self.pool.want((template.mem_mib, template.vcpus));
                // Stored for other pods; failing that, its first sandbox's
                // hibernation stores it.
                if let Err(e) = self.store_layer(&snapshot) {
                    tracing::warn!(template = %template.id, "cannot store the template's snapshot: {e}");
                }
                Ok(self.store.get_template(&template.id)?)
            },
            |e| Undo::TemplateFailed(template.id.clone(), e.to_string()),
        )
    }

    fn boot_and_snapshot(
        &self,
        template: &Template,
        cmdline: &str,
    ) -> Result<std::path::PathBuf, ServiceError> {
        let dir = self.template_dir(&template.id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("create {}: {e}", dir.display())))?;
        record_cmdline(&dir, cmdline)?;
        let files = VmmFiles::in_dir(&dir);
        let boot = Boot {
            kernel: KernelSource::Builtin(PROBE_TEMPLATE.into()),
            cmdline: cmdline.to_string(),
            mem_mib: template.mem_mib,
            vcpus: template.vcpus,
            disk: None,
            vsock_uds: None,
            net: None,
            // The probe guest has no balloon driver.
            balloon: false,
        };
        let vmm::Spawned { child, handle, .. } = self.spawn_boot(&files, boot)?;
        let snapshot = dir.join("snapshot");
        let result = wait_ready(&files)
            .and_then(|()| vmm::pause_and_snapshot_full(&handle, &snapshot))
            .map(|()| snapshot);
        vmm::stop(&handle, Some(child));
        result
    }
}

/// The file in a built template's directory that keeps the kernel command
/// line it booted with: a sandbox rebooted from its disk boots with it.
pub(super) const CMDLINE_FILE: &str = "cmdline";

/// Keeps `cmdline` in the template directory `dir` ([`CMDLINE_FILE`]).
pub(super) fn record_cmdline(dir: &Path, cmdline: &str) -> Result<(), ServiceError> {
    let path = dir.join(CMDLINE_FILE);
    std::fs::write(&path, cmdline)
        .map_err(|e| ServiceError::Internal(format!("write {}: {e}", path.display())))
}

/// What a boot of a guest needs (a template's first boot, a sandbox's
/// reboot from its disk): [`Service::spawn_boot`].
pub(super) struct Boot {
    pub kernel: KernelSource,
    pub cmdline: String,
    pub mem_mib: u32,
    pub vcpus: u32,
    pub disk: Option<torpor_vmm_api::launch::DiskSpec>,
    pub vsock_uds: Option<std::path::PathBuf>,
    pub net: Option<torpor_vmm_api::launch::NetSpec>,
    pub balloon: bool,
}

impl Service {
    /// Starts a `torpor-vmm` booting `boot` with its files in `files`
    /// (jailed when the pod jails): the one launch of every boot.
    pub(super) fn spawn_boot(
        &self,
        files: &VmmFiles,
        boot: Boot,
    ) -> Result<vmm::Spawned, ServiceError> {
        let size = (u64::from(boot.mem_mib), u64::from(boot.vcpus));
        let spec = LaunchSpec {
            control_socket: Some(files.socket.clone()),
            mode: LaunchMode::Boot {
                kernel: boot.kernel,
                initrd: None,
                cmdline: Some(boot.cmdline),
                mem_mib: size.0,
                vcpus: u16::try_from(boot.vcpus).unwrap_or(u16::MAX),
                disk: boot.disk,
                vsock_uds: boot.vsock_uds,
                net: boot.net.map(Box::new),
                balloon: boot.balloon,
            },
            console: Console::file(&files.console),
            dirty_tracking: self.config.dirty_tracking,
            jail: None,
            seccomp: torpor_vmm_api::SeccompLevel::Enforce,
        };
        let (spawned, _) = super::jail::spawn(
            self.jails.as_deref(),
            &self.config.vmm_exe,
            spec,
            &files.log,
            size,
            &[],
            None,
        )?;
        Ok(spawned)
    }
}

/// Memory a template build holds in admission until dropped.
pub(super) struct BuildReservation<'a> {
    service: &'a Service,
    mem_mib: u64,
}

impl Drop for BuildReservation<'_> {
    fn drop(&mut self) {
        let mut building = self.service.building_mib.locked();
        *building = building.saturating_sub(self.mem_mib);
    }
}

impl Service {
    /// Removes an image (here, and from the object store: see
    /// `stored_images.rs`) unless a live template of this pod was built
    /// from it (its snapshot's disk still reads the rootfs).
    pub fn remove_image(&self, name: &str) -> Result<(), ServiceError> {
        crate::images::check_name(name)?;
        if let Some(t) = self
            .list_templates()?
            .into_iter()
            .find(|t| t.image.as_deref() == Some(name))
        {
            return Err(crate::images::ImageError::InUse {
                name: name.to_string(),
                template: t.name,
            }
            .into());
        }
        self.remove_image_files(name)
    }

    /// Admits a template build of `mem_mib`: refused (429) when it does not
    /// fit with the sandboxes' memory and the other builds'.
    pub(super) fn admit_build(&self, mem_mib: u32) -> Result<BuildReservation<'_>, ServiceError> {
        let mut building = self.building_mib.locked();
        let asked = u32::try_from(*building + u64::from(mem_mib)).unwrap_or(u32::MAX);
        self.admit(Ask::build(asked), false)?;
        *building += u64::from(mem_mib);
        Ok(BuildReservation {
            service: self,
            mem_mib: u64::from(mem_mib),
        })
    }

    /// Records the template's working set: restores it once with the pod's
    /// uffd backend, which notes the pages the guest touches in its first
    /// [`WORKING_SET_MS`] (`working-set` beside the snapshot), which every
    /// create and wake with a uffd backend then installs eagerly. Best
    /// effort: a host that cannot (no userfaultfd) builds templates
    /// without one, and restores fault pages in on demand.
    fn record_working_set(&self, template: &Template, snapshot: &Path) {
        let dir = self.template_dir(&template.id);
        let files = VmmFiles {
            socket: dir.join("record.sock"),
            console: dir.join("record.log"),
            log: dir.join("record-vmm.log"),
        };
        let mut restore = RestoreSpec::new(snapshot, self.config.memory_backend);
        if template.kind == TemplateKind::Linux {
            // The clone's own device files, thrown away afterwards.
            restore.disk_overlay = Some(dir.join("record-overlay"));
            restore.vsock_uds = Some(dir.join("record-vsock.sock"));
        }
        let spec = LaunchSpec {
            control_socket: Some(files.socket.clone()),
            mode: LaunchMode::Restore {
                restore,
                paused: false,
                record_working_set_ms: Some(WORKING_SET_MS),
            },
            console: Console::Discard,
            dirty_tracking: self.config.dirty_tracking,
            jail: None,
            seccomp: torpor_vmm_api::SeccompLevel::Enforce,
        };
        let recorded = snapshot.join(WORKING_SET_FILE);
        let owner = crate::store::LayerOwner::Template(template.id.clone());
        let spawned = self.checked_chain(&owner, snapshot).and_then(|chain| {
            let layers: Vec<_> = chain.into_iter().map(|(dir, _)| dir).collect();
            super::jail::spawn(
                self.jails.as_deref(),
                &self.config.vmm_exe,
                spec,
                &files.log,
                (u64::from(template.mem_mib), u64::from(template.vcpus)),
                &super::ops::template_exposes(template),
                Some(&layers),
            )
        });
        match spawned {
            Ok((up, _)) => {
                let deadline = Instant::now()
                    + Duration::from_millis(WORKING_SET_MS)
                    + Duration::from_secs(10);
                while !recorded.exists() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                vmm::stop(&up.handle, Some(up.child));
                if recorded.exists() {
                    tracing::info!(template = %template.name, "working set recorded");
                } else {
                    tracing::warn!(template = %template.name, "no working set was recorded");
                }
            }
            Err(e) => tracing::warn!(
                template = %template.name,
                "cannot record the working set ({e}); restores fault pages in on demand"
            ),
        }
        for f in [&files.console, &files.log, &dir.join("record-overlay")] {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// Waits for the probe's first iteration: booted, timer running, idle.
pub(super) fn wait_ready(files: &VmmFiles) -> Result<(), ServiceError> {
    let deadline = Instant::now() + READY_LIMIT;
    loop {
        let console = std::fs::read_to_string(&files.console).unwrap_or_default();
        if console.contains("TORPOR-PROBE ITER n=1 ") {
            return Ok(());
        }
        // The probe's one refusal: its workload (`probe.mib`, 4 MiB unless
        // the cmdline says) sits at 16 MiB and must fit in guest memory.
        if let Some(line) = console
            .lines()
            .find(|l| l.starts_with("TORPOR-PROBE ERROR "))
        {
            return Err(ServiceError::HostUnsupported(format!(
                "the probe guest cannot run with these settings ({}): it needs \
                 mem_mib of at least 16 plus its probe.mib workload (4 unless the \
                 cmdline sets it)",
                line.trim_start_matches("TORPOR-PROBE ERROR ").trim()
            )));
        }
        if Instant::now() > deadline {
            return Err(ServiceError::Internal(format!(
                "the template's guest did not become ready within {READY_LIMIT:?}: {}",
                vmm::log_tail(&files.log)
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
