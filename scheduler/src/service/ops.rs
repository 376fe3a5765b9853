//! Sandbox and template operations. Each journals its start (with the state
//! change it begins), does the work, then journals the end with the final
//! state, so a crash in between leaves a record recovery can act on.

use crate::trace::EventKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use torpor_sync::Locked;
use torpor_vmm_api::control::Request;
use torpor_vmm_api::jail::Expose;
use torpor_vmm_api::launch::{Console, LaunchMode, LaunchSpec, MemoryBackend, RestoreSpec};

use super::lifetime::{check_lifetimes, expiry};
use super::locks::SandboxGuard;
use super::pool::Shell;
use super::resident::Ask;
use super::vmm::{self, VmmFiles};
use super::{
    CreateSandbox, CreateTemplate, Outcome, Owner, PodView, Service, ServiceError, LOCAL_POD,
};
use crate::model::{
    PodId, RestorePath, RestoreReport, Sandbox, SandboxId, Template, TemplateId, TemplateKind,
    TemplateState, Timestamp, VmmHandle,
};
use crate::state::{can, Operation, SandboxState};
use crate::store::{
    OperationKind, OperationStatus, Result as StoreResult, SandboxFilter, StateChange, StoreError,
    Tx,
};

/// Diff snapshots on top of each other before a hibernation writes a full
/// one instead (restores read every layer of the chain).
pub(super) const MAX_DIFF_DEPTH: usize = 16;

/// How long a create or fork with `queue` waits for room on the pod.
const QUEUE_LIMIT: Duration = Duration::from_secs(30);
/// How often a queued create or fork looks for room again.
const QUEUE_POLL: Duration = Duration::from_millis(100);

/// How long a delete waits for another operation on its sandbox to let go
/// after ending that sandbox's VMM (a wake notices within its poll).
pub const DELETE_LOCK_WAIT: Duration = Duration::from_secs(10);

/// Whether `owner` may delete `t` (resolved for it): an admin (or the
/// service itself) every one, a tenant its own; shared ones are
/// read-only for tenants (their existence is no secret: 403).
pub fn may_delete(owner: Option<&Owner>, t: &Template) -> Result<(), ServiceError> {
    match owner.filter(|o| !o.admin) {
        Some(_) if t.tenant.is_none() => Err(ServiceError::Forbidden(
            "shared templates are read-only for tenants".into(),
        )),
        _ => Ok(()),
    }
}

/// How [`Service::end_vmm`] ends a VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum VmmEnd {
    /// Asked to exit, SIGKILL after a grace time, waited for.
    Wait,
    /// Asked to exit (SIGKILL if it does not answer), not waited for: a
    /// delete's.
    Ask,
    /// Already told to exit (a hibernation's VMM ends itself after its
    /// snapshot), not waited for.
    Told,
}

impl Service {
    pub fn list_templates(&self) -> Result<Vec<Template>, ServiceError> {
        Ok(self.store.list_templates(false)?)
    }

    pub fn get_template(&self, id: &TemplateId) -> Result<Template, ServiceError> {
        Ok(self.store.get_template(id)?)
    }

    /// What `key` (a template id or name) names for `owner`
    /// ([`crate::names`]: its own, then shared ones; every one for an
    /// admin and for the service's own calls, `None`); another tenant's
    /// is not found, as a missing one. The one place a key becomes a
    /// template: creates, reads and deletes go through it.
    pub fn resolve_template(
        &self,
        owner: Option<&Owner>,
        key: &str,
    ) -> Result<Template, ServiceError> {
        let mut candidates = self.store.template_candidates(key)?;
        if let Some(name) = crate::names::alias_target(key) {
            candidates.extend(self.store.template_candidates(name)?);
        }
        crate::names::resolve(&candidates, owner, key)
            .cloned()
            .ok_or_else(|| ServiceError::NotFound {
                kind: "template",
                id: key.to_string(),
            })
    }

    /// Deletes the template `key` names for `owner` (see
    /// [`Self::resolve_template`]): a tenant its own (a shared one is
    /// 403, another tenant's not found).
    pub fn delete_template_as(&self, owner: Option<&Owner>, key: &str) -> Result<(), ServiceError> {
        let t = self.resolve_template(owner, key)?;
        may_delete(owner, &t)?;
        self.delete_template(&t.id)
    }

    /// Renames the template `key` names for `owner` (a tenant its own; a
    /// shared one is 403, another tenant's not found) to `name`: 1 to 128
    /// characters, no control characters, free among what its tenant sees.
    pub fn rename_template_as(
        &self,
        owner: Option<&Owner>,
        key: &str,
        name: &str,
    ) -> Result<Template, ServiceError> {
        super::check_template_name(name)?;
        let t = self.resolve_template(owner, key)?;
        may_delete(owner, &t)?;
        Ok(self.store.rename_template(&t.id, name)?)
    }

    pub fn create_template(&self, req: CreateTemplate) -> Result<Template, ServiceError> {
        self.build_template(req)
    }

    /// Deletes a template: a built one's directory goes; a sandbox's
    /// (snapshot-as-template) leaves its layers to the layer collection,
    /// which removes them once nothing else sits on them; a filesystem-only
    /// one's directory (its disk) goes.
    pub fn delete_template(&self, id: &TemplateId) -> Result<(), ServiceError> {
        let t = self.store.delete_template(id)?;
        let own = self.template_dir(id);
        match t
            .snapshot_dir
            .and_then(|d| d.parent().map(Path::to_path_buf))
        {
            Some(dir) if dir == own => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Some(_) => self.remove_dead_layers(),
            // A filesystem-only snapshot's disk and command line.
            None if t.source.is_some() => {
                let _ = std::fs::remove_dir_all(own);
            }
            None => {}
        }
        Ok(())
    }

    pub fn get_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        let mut sandbox = self.store.get_sandbox(id)?;
        self.read_network(&mut sandbox);
        sandbox.usage = sandbox
            .vmm
            .as_ref()
            .and_then(|h| super::vmm::usage(h, sandbox.vcpus));
        sandbox.memory = self.read_memory(&sandbox);
        Ok(sandbox)
    }

    pub fn list_sandboxes(&self, filter: SandboxFilter) -> Result<Vec<Sandbox>, ServiceError> {
        Ok(self.store.list_sandboxes(&filter)?)
    }

    /// Memory (MiB) of sandboxes on the pod that hold a VMM.
    fn committed_mib(&self) -> Result<u64, ServiceError> {
        Ok(self.store.committed_mib()?)
    }

    /// Runs `f` in one transaction with the admission of `ask` on the
    /// local pod, so that the check and what makes the memory count (an
    /// insert, a state change in `f`) land together. A full pod, or one
    /// whose resident memory with what `ask` will hold would pass its hard
    /// mark, is refused (429), or with `queue` retried for up to
    /// [`QUEUE_LIMIT`]. The commit is relaxed (no fsync, see
    /// [`crate::store::Store::write_relaxed`]): it starts an operation
    /// whose end commits.
    pub(super) fn admit_with<T>(
        &self,
        ask: Ask<'_>,
        queue: bool,
        f: impl Fn(&Tx<'_>) -> StoreResult<T>,
    ) -> Result<T, ServiceError> {
        let pod = PodId::new(LOCAL_POD);
        self.admission_loop(&ask, true, queue, || {
            self.store.write_relaxed(|tx| {
                tx.admit(&pod, ask.mem_mib)?;
                f(tx)
            })
        })
    }

    /// Whether `ask` fits on the local pod now (or, with `queue`, within
    /// [`QUEUE_LIMIT`]), without counting it: a cheap early refusal before
    /// expensive work; the admission that counts is [`Self::admit_with`].
    pub(super) fn admit(&self, ask: Ask<'_>, queue: bool) -> Result<(), ServiceError> {
        let pod = PodId::new(LOCAL_POD);
        self.admission_loop(&ask, false, queue, || {
            self.store.read(|tx| tx.admit(&pod, ask.mem_mib))
        })
    }

    fn admission_loop<T>(
        &self,
        ask: &Ask<'_>,
        count: bool,
        queue: bool,
        mut attempt: impl FnMut() -> StoreResult<T>,
    ) -> Result<T, ServiceError> {
        let deadline = Instant::now() + QUEUE_LIMIT;
        loop {
            // Past the hard mark nothing is admitted, whatever the ratio.
            let pressure = self.pressure_gate(ask, count);
            match pressure.map(|()| attempt()) {
                Err(ServiceError::Pressure { .. }) | Ok(Err(StoreError::Full { .. }))
                    if queue && Instant::now() <= deadline =>
                {
                    std::thread::sleep(QUEUE_POLL);
                }
                Err(e) => return Err(e),
                Ok(other) => return Ok(other?),
            }
        }
    }

    /// Whether this pod mounts volumes into its Linux sandboxes
    /// (`ServiceConfig::volumes_dir`).
    pub fn mounts_volumes(&self) -> bool {
        self.mounts.offered()
    }

    /// This pod's volume serving (what serve's volume gateway exports its
    /// nested pod's sandboxes' volumes with).
    pub fn volume_mounts(&self) -> std::sync::Arc<super::mounts::Mounts> {
        self.mounts.clone()
    }

    /// Creates a sandbox from a ready template: restore of its snapshot,
    /// or a boot from the disk a filesystem-only one keeps.
    pub fn create_sandbox(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError> {
        check_lifetimes(req.keep_alive_ms, req.timeout_ms)?;
        let volumes = req.resolved_volumes()?;
        // Another tenant's template is not there for this caller.
        let template = self.resolve_template(req.owner.as_ref(), &req.template)?;
        let snapshot = template
            .snapshot_dir
            .clone()
            .filter(|_| template.state == TemplateState::Ready);
        if snapshot.is_none() && !template.boots_from_disk() {
            return Err(ServiceError::Invalid(format!(
                "template {} is not ready",
                template.id
            )));
        }
        let keep_alive = req
            .keep_alive_ms
            .unwrap_or(self.config.default_keep_alive_ms);
        let mut sandbox = Sandbox::new(
            template.id.clone(),
            template.mem_mib,
            template.vcpus,
            keep_alive,
        );
        if let Some(id) = req.id {
            if !SandboxId::is_well_formed(id.as_str()) {
                return Err(ServiceError::Invalid(format!(
                    "sandbox id {id:?} is malformed"
                )));
            }
            sandbox.id = id;
        }
        sandbox.metadata = req.metadata;
        sandbox.tenant = req.owner.map(|o| o.tenant);
        sandbox.env = req.env;
        sandbox.on_timeout = req.on_timeout;
        sandbox.timeout_hibernation = req.timeout_hibernation;
        sandbox.access_token = req.access_token;
        if let Some(host) = &req.ingress_host {
            crate::model::check_ingress_host(host).map_err(ServiceError::Invalid)?;
        }
        sandbox.ingress_host = req.ingress_host;
        if !volumes.is_empty() {
            if !self.mounts.offered() {
                return Err(ServiceError::Invalid(
                    "this pod cannot mount volumes into its sandboxes".into(),
                ));
            }
            if template.kind != TemplateKind::Linux {
                // No agent in its guest to mount them.
                return Err(super::guest::GuestError::NoAgent {
                    id: sandbox.id.to_string(),
                    kind: template.kind,
                }
                .into());
            }
        }
        sandbox.volumes = volumes;
        sandbox.network = self.initial_network(req.network.as_ref())?;
        sandbox.pod = Some(PodId::new(LOCAL_POD));
        sandbox.expires_at = req
            .timeout_ms
            .map(|t| expiry(Timestamp::now(), t))
            .transpose()?;
        let _guard = self.lock_sandbox(&sandbox.id)?;
        self.record(
            Instant::now(),
            &sandbox.id,
            EventKind::Create,
            0,
            template.mem_mib,
        );
        let mut lap = Lap::new();
        let op = self.admit_with(Ask::sandbox(&sandbox), req.queue, |tx| {
            tx.insert_sandbox(&sandbox)?;
            tx.begin_operation(
                Some(&sandbox.id),
                OperationKind::Create,
                &match &snapshot {
                    Some(snapshot) => json!({ "snapshot": snapshot }),
                    None => json!({ "boot": true }),
                },
                None,
            )
        })?;
        let admit_ms = lap.next();
        let launched = match &snapshot {
            Some(snapshot) => self
                .launch_vmm(&sandbox, &template, snapshot)
                .map(|l| (l.handle, Some(l.report))),
            None => self
                .boot_from_disk(&sandbox, &template)
                .map(|handle| (handle, None)),
        };
        self.conclude(
            &op.id,
            launched,
            |(handle, report)| {
                // The VMM, the operation's end, the state and the snapshot
                // the VMM runs from (none after a boot): one commit,
                // relaxed: what it records is a running VMM, which a power
                // cut ends anyway; a crash of this process keeps it.
                lap.next();
                let change = StateChange::new(SandboxState::Creating, SandboxState::Running);
                let mut created = self.record_vmm(&sandbox, &handle, |tx| {
                    tx.set_sandbox_snapshot(&sandbox.id, snapshot.as_deref())?;
                    tx.finish_operation(&op.id, OperationStatus::Done, None, Some(&change))?;
                    tx.get_sandbox(&sandbox.id)
                })?;
                created.restore = report.map(|mut report| {
                    report.phases.insert(0, ("admit".into(), admit_ms));
                    report.phase("commit", lap.next());
                    report
                });
                Ok(created)
            },
            |e| StateChange::failed(SandboxState::Creating, e),
        )
    }

    /// Brings up the sandbox's VMM restoring `snapshot` (see
    /// [`Service::launch_vmm`]) and records it (one commit of its own).
    pub(super) fn start_vmm(
        &self,
        id: &SandboxId,
        snapshot: &Path,
    ) -> Result<RestoreReport, ServiceError> {
        let sandbox = self.store.get_sandbox(id)?;
        let template = self.store.get_template(&sandbox.template)?;
        let launched = self.launch_vmm(&sandbox, &template, snapshot)?;
        self.record_vmm(&sandbox, &launched.handle, |_| Ok(()))?;
        Ok(launched.report)
    }

    /// Commits a VMM [`Service::launch_vmm`] started: its handle, with what
    /// else `f` writes, in one relaxed transaction. A crash before the
    /// commit leaves a VMM no sandbox records, which recovery ends (by its
    /// log in the sandbox's directory, `recovery.rs`); a failed commit
    /// stops it here.
    pub(super) fn record_vmm<T>(
        &self,
        sandbox: &Sandbox,
        handle: &VmmHandle,
        f: impl FnOnce(&Tx<'_>) -> StoreResult<T>,
    ) -> Result<T, ServiceError> {
        let written = self.store.write_relaxed(|tx| {
            tx.set_sandbox_vmm(&sandbox.id, Some(handle))?;
            f(tx)
        });
        written.map_err(|e| {
            let mut started = sandbox.clone();
            started.vmm = Some(handle.clone());
            let _ = self.stop_vmm(&started);
            e.into()
        })
    }

    /// Brings up the VMM of `sandbox` (of `template`) restoring `snapshot`
    /// (from a standby shell of its shape when the pool has one, else a
    /// cold `torpor-vmm`) and runs a Linux guest's `resumed` hook; the
    /// caller records the VMM ([`Service::record_vmm`]).
    pub(super) fn launch_vmm(
        &self,
        sandbox: &Sandbox,
        template: &Template,
        snapshot: &Path,
    ) -> Result<Launched, ServiceError> {
        let started = Instant::now();
        let mut lap = Lap::new();
        let id = &sandbox.id;
        // What the VMM that wrote the snapshot says it sits on, checked
        // before anything is sealed or mounted: the layers the jail gets.
        let owner = crate::store::LayerOwner::Sandbox(id.clone());
        let layers: Vec<PathBuf> = self
            .checked_chain(&owner, snapshot)?
            .into_iter()
            .map(|(dir, _)| dir)
            .collect();
        let dir = self.sandbox_dir(id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("create {}: {e}", dir.display())))?;
        // Before the jail is set up, which gives its socket to the VMM.
        self.mounts.serve(sandbox, &dir)?;
        let files = VmmFiles::in_dir(&dir);
        // A memory file still arriving (a lazy cold wake): the page server
        // waits on its map. Only the `uffd` backend has one (the others map
        // the file), so such a restore takes it whatever the pod's; the
        // sandbox's next wake from its disk takes the pod's again.
        let lazy_map = self.lazy.map_for(id, snapshot);
        let backend = match lazy_map {
            Some(_) => MemoryBackend::Uffd,
            None => self.config.memory_backend,
        };
        let mut restore = RestoreSpec::new(snapshot, backend);
        // The template's recorded working set, installed eagerly (uffd
        // backends; `file` maps the page cache, which needs no prefetch).
        restore.prefetch = backend != MemoryBackend::File;
        restore.lazy_map = lazy_map;
        self.guest_restore_paths(id, template, &mut restore)?;
        // A jailed VMM joins its sandbox's network namespace as it starts
        // (as root, before it drops its rights): a shell made earlier sits
        // in a namespace of its own, so a networked sandbox restores cold.
        let networked = restore.net.as_ref().is_some_and(|n| n.netns.is_some());
        let shell = if networked && self.jails.is_some() {
            None
        } else {
            self.pool.take((sandbox.mem_mib, sandbox.vcpus))
        };
        let template_files = template_exposes(template);
        let prepare_ms = lap.next();
        // Mounting the sandbox's files into a jailed shell, apart from the
        // restore round trip.
        let mut jail_ms = 0.0;
        let from_shell = shell.and_then(|shell| {
            let jailed = self.jail_shell(&shell, &dir, &restore, &layers, &template_files);
            jail_ms = lap.next();
            let up = jailed.and_then(|()| shell.restore_into(&files, &restore));
            match up {
                Ok(up) => Some(up),
                Err(e) => {
                    tracing::warn!(sandbox = %id, "standby restore failed, restoring cold: {e}");
                    None
                }
            }
        });
        let (child, handle, path, vmm_us) = match from_shell {
            Some((child, handle, us)) => (child, handle, RestorePath::Standby, us),
            None => {
                let spec = LaunchSpec {
                    control_socket: Some(files.socket.clone()),
                    mode: LaunchMode::Restore {
                        restore,
                        paused: false,
                        record_working_set_ms: None,
                    },
                    console: Console::file(&files.console),
                    dirty_tracking: self.config.dirty_tracking,
                    jail: None,
                    seccomp: torpor_vmm_api::SeccompLevel::Enforce,
                };
                let (up, _) = super::jail::spawn(
                    self.jails.as_deref(),
                    &self.config.vmm_exe,
                    spec,
                    &files.log,
                    (u64::from(sandbox.mem_mib), u64::from(sandbox.vcpus)),
                    &template_files,
                    Some(&layers),
                )?;
                (up.child, up.handle, RestorePath::Cold, up.spawn_us)
            }
        };
        let vmm_ms = lap.next();
        self.children.locked().insert(id.clone(), child);
        if template.kind == TemplateKind::Linux {
            // Recorded before the guest's `resumed` hook, which may wait
            // for its agent up to a minute: the VMM shows on the sandbox
            // (and in its metrics) meanwhile. A probe's restore records it
            // with its caller's commit only.
            self.record_vmm(sandbox, &handle, |_| Ok(()))?;
        }
        self.after_restore(sandbox, template, &handle)?;
        let mut report = RestoreReport {
            path,
            backend: backend.name().to_string(),
            ms: started.elapsed().as_secs_f64() * 1000.0,
            vmm_ms: vmm_us as f64 / 1000.0,
            phases: Vec::new(),
        };
        report.phase("prepare", prepare_ms);
        if path == RestorePath::Standby && self.jails.is_some() {
            report.phase("jail", jail_ms);
        }
        report.phase("vmm", vmm_ms);
        report.phase("hook", lap.next());
        self.metrics.observe_restore(&report);
        Ok(Launched { report, handle })
    }

    /// Hands a jailed standby shell what a restore of `restore` into the
    /// sandbox directory `dir` needs: `dir` becomes the shell's uid's, and
    /// it and the snapshot's layers (`layers`, its checked chain) are
    /// mounted into the shell's jail.
    fn jail_shell(
        &self,
        shell: &Shell,
        dir: &Path,
        restore: &RestoreSpec,
        layers: &[PathBuf],
        template_files: &[Expose],
    ) -> Result<(), ServiceError> {
        let (Some(jails), Some(uid)) = (&self.jails, shell.uid) else {
            return Ok(());
        };
        let mut exposes = vec![Expose::read_write(dir)];
        exposes.extend(
            torpor_vmm_api::exposes::restore_exposes_of(restore, Some(layers), false)
                .into_iter()
                // The shell has /dev/shm already when the pod uses it.
                .filter(|e| !e.path.starts_with("/dev") && e.path != dir),
        );
        exposes.extend_from_slice(template_files);
        super::jail::ensure_shared_copy(restore, layers)?;
        jails.prepare(uid, Some(dir), &exposes)?;
        super::jail::inject(shell.handle.pid, &exposes)
    }

    /// Stops the sandbox's VMM, if it has one.
    pub(super) fn stop_vmm(&self, sandbox: &Sandbox) -> Result<(), ServiceError> {
        self.end_vmm(sandbox, VmmEnd::Wait)
    }

    /// Ends the sandbox's VMM, if it has one, as `how` says. Unless it
    /// waits, its control socket's file is removed now (a VMM started
    /// next for the sandbox binds its own there) and the wait for its
    /// exit is left to the reaper ([`super::vmm_process::Reaper`]), so
    /// the operation answers without the kernel's teardown of the process.
    pub(super) fn end_vmm(&self, sandbox: &Sandbox, how: VmmEnd) -> Result<(), ServiceError> {
        if let Some(handle) = &sandbox.vmm {
            let child = self.children.locked().remove(&sandbox.id);
            self.metrics.vmm_ending(handle.pid);
            match how {
                VmmEnd::Wait => vmm::stop(handle, child),
                VmmEnd::Ask | VmmEnd::Told => {
                    if how == VmmEnd::Ask {
                        vmm::tell_to_exit(handle, Duration::from_secs(5));
                    }
                    let _ = std::fs::remove_file(&handle.control_socket);
                    let handle = handle.clone();
                    self.reaper.reap(move || vmm::reap_exiting(&handle, child));
                }
            }
            self.last_resident.forget();
            self.mounts.stop(&sandbox.id);
            // Relaxed: the operation that stops a VMM ends with a commit.
            self.store
                .write_relaxed(|tx| tx.set_sandbox_vmm(&sandbox.id, None))?;
        }
        self.drop_sandbox_net(&sandbox.id);
        Ok(())
    }

    pub(super) fn running_handle(
        sandbox: &Sandbox,
    ) -> Result<&crate::model::VmmHandle, ServiceError> {
        sandbox
            .vmm
            .as_ref()
            .ok_or_else(|| ServiceError::Internal(format!("sandbox {} has no VMM", sandbox.id)))
    }

    pub fn pause(&self, id: &SandboxId) -> Result<Outcome, ServiceError> {
        let held = self.lock_sandbox(id)?;
        let sandbox = self.store.get_sandbox(id)?;
        self.transition_locked(
            &held,
            sandbox,
            Operation::Pause,
            OperationKind::Pause,
            Request::Pause,
        )
    }

    /// Resumes a paused sandbox, or wakes a hibernated one; the sandbox's
    /// lock is held from the state read to the state written, so nothing
    /// (a hibernate) comes in between.
    pub fn resume(&self, id: &SandboxId) -> Result<Outcome, ServiceError> {
        self.resume_for(id, false)
    }

    /// [`Self::resume`]; recorded in the trace as a request when it makes
    /// the sandbox active (a wake, a resume of a paused one, or any
    /// `connect`).
    fn resume_for(&self, id: &SandboxId, connect: bool) -> Result<Outcome, ServiceError> {
        self.resume_as(id, connect, false)
    }

    /// [`Self::resume_for`]; with `reboot`, a hibernated sandbox is woken
    /// by a reboot from its disk ([`Self::boot_locked`]) whatever its
    /// hibernation kept.
    pub(super) fn resume_as(
        &self,
        id: &SandboxId,
        connect: bool,
        reboot: bool,
    ) -> Result<Outcome, ServiceError> {
        let started = Instant::now();
        let held = self.lock_sandbox(id)?;
        let sandbox = self.store.get_sandbox(id)?;
        if connect
            || matches!(
                sandbox.state,
                SandboxState::Hibernated | SandboxState::Paused
            )
        {
            self.record(started, id, EventKind::Request, 0, sandbox.mem_mib);
        }
        if sandbox.state == SandboxState::Hibernated {
            return self.wake_any_locked(sandbox, reboot);
        }
        self.transition_locked(
            &held,
            sandbox,
            Operation::Resume,
            OperationKind::Resume,
            Request::Resume,
        )
    }

    /// Pause or resume of `sandbox` as read under its lock, which the
    /// caller holds (`_held`) until this returns: one control request and
    /// one state change.
    fn transition_locked(
        &self,
        _held: &SandboxGuard<'_>,
        sandbox: Sandbox,
        op: Operation,
        kind: OperationKind,
        req: Request,
    ) -> Result<Outcome, ServiceError> {
        let id = &sandbox.id;
        let path =
            can(op, sandbox.state).map_err(|e| ServiceError::illegal(id, e, kind.as_str()))?;
        let Some(&to) = path.last() else {
            return Ok(Outcome {
                sandbox,
                resumed: false,
                resume_ms: None,
            });
        };
        let handle = Self::running_handle(&sandbox)?;
        vmm::call(handle, &req)?;
        // Relaxed: a paused or running VMM is what a power cut ends anyway.
        let sandbox = self.store.write_relaxed(|tx| {
            tx.update_sandbox_state(id, sandbox.state, to, None)?;
            tx.touch(id, Timestamp::now())?;
            tx.get_sandbox(id)
        })?;
        Ok(Outcome {
            sandbox,
            resumed: false,
            resume_ms: None,
        })
    }

    /// Wakes a hibernated sandbox (lock held): by a reboot from its disk
    /// when asked (`reboot`) or when its hibernation kept only its disk,
    /// else by restoring its snapshot, which a memory kept while its guest
    /// agent did not answer refuses ([`ServiceError::GuestUnresponsive`]).
    fn wake_any_locked(&self, sandbox: Sandbox, reboot: bool) -> Result<Outcome, ServiceError> {
        if reboot || sandbox.disk_only {
            return self.boot_locked(sandbox);
        }
        if sandbox.guest_unresponsive_at_pause {
            return Err(ServiceError::GuestUnresponsive {
                id: sandbox.id.to_string(),
            });
        }
        self.wake_locked(sandbox)
    }

    /// Restores a hibernated sandbox from its snapshot (lock held).
    fn wake_locked(&self, sandbox: Sandbox) -> Result<Outcome, ServiceError> {
        let started = Instant::now();
        let snapshot = sandbox.snapshot.clone().ok_or_else(|| {
            ServiceError::Internal(format!("hibernated sandbox {} has no snapshot", sandbox.id))
        })?;
        // Not on this pod's disk (another pod hibernated it, or the local
        // copy is gone): fetched whole from the object store first.
        let fetch_ms =
            self.snapshot_here(&sandbox.id, &snapshot, sandbox.stored_snapshot.as_deref())?;
        let change = StateChange::new(SandboxState::Hibernated, SandboxState::Resuming);
        let mut lap = Lap::new();
        let op = self.admit_with(Ask::sandbox(&sandbox), false, |tx| {
            tx.begin_operation(
                Some(&sandbox.id),
                OperationKind::Wake,
                &json!({}),
                Some(&change),
            )
        })?;
        let admit_ms = lap.next();
        let launched = self
            .store
            .get_template(&sandbox.template)
            .map_err(ServiceError::from)
            .and_then(|template| self.launch_vmm(&sandbox, &template, &snapshot))
            // A restore that failed because its memory file stopped
            // arriving answers the store's error, naming the layer.
            .map_err(|e| self.lazy_error(&sandbox.id).unwrap_or(e));
        self.conclude(
            &op.id,
            launched,
            |Launched { mut report, handle }| {
                lap.next();
                // The VMM and the operation's end, one commit, relaxed like
                // a create's: a power cut leaves it hibernated.
                let change = StateChange::new(SandboxState::Resuming, SandboxState::Running);
                let mut woken = self.record_vmm(&sandbox, &handle, |tx| {
                    tx.finish_operation(&op.id, OperationStatus::Done, None, Some(&change))?;
                    tx.touch(&sandbox.id, Timestamp::now())?;
                    tx.get_sandbox(&sandbox.id)
                })?;
                report.phases.insert(0, ("admit".into(), admit_ms));
                if let Some(ms) = fetch_ms {
                    report.phases.insert(0, ("fetch".into(), ms));
                }
                report.phase("commit", lap.next());
                let ms = started.elapsed().as_secs_f64() * 1000.0;
                self.metrics.observe_resume(ms);
                woken.restore = Some(report);
                Ok(Outcome {
                    sandbox: woken,
                    resumed: true,
                    resume_ms: Some(ms),
                })
            },
            |_| {
                self.metrics.wake_failed();
                StateChange::new(SandboxState::Resuming, SandboxState::Hibernated)
            },
        )
    }

    /// A client (re)connects: the sandbox runs afterwards, resumed if
    /// paused, woken if hibernated, and counts as active (E2B's `connect`).
    pub fn connect(&self, id: &SandboxId) -> Result<Outcome, ServiceError> {
        let outcome = self.resume_for(id, true)?;
        self.store
            .write_relaxed(|tx| tx.touch(id, Timestamp::now()))?;
        Ok(outcome)
    }

    /// Makes sure the sandbox runs (waking it if hibernated) and marks it
    /// active: what every guest-facing request does first.
    pub fn ensure_running(&self, id: &SandboxId) -> Result<Outcome, ServiceError> {
        let _guard = self.lock_sandbox(id)?;
        let sandbox = self.store.get_sandbox(id)?;
        can(Operation::Exec, sandbox.state).map_err(|e| ServiceError::illegal(id, e, "reach"))?;
        if sandbox.state == SandboxState::Hibernated {
            return self.wake_any_locked(sandbox, false);
        }
        // Relaxed: the last activity of a running sandbox.
        self.store
            .write_relaxed(|tx| tx.touch(id, Timestamp::now()))?;
        Ok(Outcome {
            sandbox,
            resumed: false,
            resume_ms: None,
        })
    }

    /// Deletes a sandbox: its VMM and files go, its row stays as deleted.
    /// It does not wait behind another operation on the sandbox
    /// ([`Self::lock_for_delete`]).
    pub fn delete_sandbox(&self, id: &SandboxId) -> Result<(), ServiceError> {
        let _guard = self.lock_for_delete(id)?;
        let sandbox = self.store.get_sandbox(id)?;
        if sandbox.state == SandboxState::Deleted {
            return Ok(());
        }
        self.record(Instant::now(), id, EventKind::Delete, 0, sandbox.mem_mib);
        // Relaxed: its end below commits durably before any file goes.
        let op = self.store.write_relaxed(|tx| {
            tx.begin_operation(Some(id), OperationKind::Delete, &json!({}), None)
        })?;
        // Answered without the VMM's exit: the reaper waits for it.
        self.end_vmm(&sandbox, VmmEnd::Ask)?;
        self.lazy.cancel(id);
        self.close_ports(&sandbox);
        self.forget_memory(id);
        self.forget_history(id);
        let change = StateChange::new(sandbox.state, SandboxState::Deleted);
        self.store
            .finish_operation(&op.id, OperationStatus::Done, None, Some(&change))?;
        // Layers forks or other chains sit on stay.
        self.remove_sandbox_files(id);
        Ok(())
    }

    /// The sandbox's lock for a delete. If another operation holds it (a
    /// wake waiting for its guest, a snapshot, a control call), the
    /// sandbox is marked doomed, which ends a wait on its guest at the
    /// next check, and its recorded VMM is killed, which ends a control
    /// call or snapshot at once; the operation rolls back and lets go.
    /// [`DELETE_LOCK_WAIT`] at most, then 503 (try again).
    fn lock_for_delete(&self, id: &SandboxId) -> Result<SandboxGuard<'_>, ServiceError> {
        if !SandboxId::is_well_formed(id.as_str()) {
            return self.lock_sandbox(id);
        }
        if let Some(guard) = self.locks.try_lock(id) {
            return Ok(guard);
        }
        let _doomed = self.locks.doom(id);
        if let Some(handle) = self.store.get_sandbox(id).ok().and_then(|s| s.vmm) {
            tracing::info!(sandbox = %id, pid = handle.pid, "a delete ends the VMM of a busy sandbox");
            vmm::kill_and_wait(handle.pid, handle.start_time, DELETE_LOCK_WAIT);
        }
        self.locks
            .lock_within(id, DELETE_LOCK_WAIT)
            .ok_or_else(|| ServiceError::Unavailable {
                message: format!(
                    "sandbox {id} is still busy with another operation after {}s; delete it again",
                    DELETE_LOCK_WAIT.as_secs()
                ),
                retry_after_s: 1,
            })
    }

    /// Sets the keep-alive and (from now) the timeout; each at most its
    /// maximum ([`super::MAX_KEEP_ALIVE_MS`], [`super::MAX_TIMEOUT_MS`]).
    pub fn set_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<Sandbox, ServiceError> {
        check_lifetimes(keep_alive_ms, timeout_ms)?;
        let sandbox = self.store.get_sandbox(id)?;
        let keep_alive = keep_alive_ms.unwrap_or(sandbox.keep_alive_ms);
        let expires = match timeout_ms {
            Some(t) => Some(expiry(Timestamp::now(), t)?),
            None => sandbox.expires_at,
        };
        self.store.set_sandbox_timeout(id, keep_alive, expires)?;
        Ok(self.store.get_sandbox(id)?)
    }

    pub fn list_pods(&self) -> Result<Vec<PodView>, ServiceError> {
        let pods = self.store.list_pods()?;
        let sandboxes = self.store.list_sandboxes(&SandboxFilter::default())?;
        pods.into_iter()
            .map(|pod| {
                let mine: Vec<&Sandbox> = sandboxes
                    .iter()
                    .filter(|s| s.pod.as_ref() == Some(&pod.id))
                    .collect();
                let mut by_state = std::collections::BTreeMap::new();
                for s in &mine {
                    *by_state.entry(s.state.to_string()).or_insert(0) += 1;
                }
                Ok(PodView {
                    committed_mib: self.committed_mib()?,
                    pss_mib: mine
                        .iter()
                        .filter_map(|s| s.vmm.as_ref())
                        .map(|h| vmm::pss_kib(h.pid).unwrap_or(0) as f64 / 1024.0)
                        .sum(),
                    resident_mib: mine
                        .iter()
                        .filter_map(|s| s.vmm.as_ref())
                        .map(|h| super::resident::resident_bytes(h).unwrap_or(0) as f64 / 1048576.0)
                        .sum(),
                    sandboxes: by_state,
                    pod,
                })
            })
            .collect()
    }

    pub fn set_pod(
        &self,
        id: &PodId,
        ratio: Option<f64>,
        high_watermark: Option<f64>,
    ) -> Result<PodView, ServiceError> {
        if let Some(r) = ratio {
            self.store.set_ratio(id, r)?;
        }
        if let Some(w) = high_watermark {
            self.store.set_high_watermark(id, w)?;
        }
        self.list_pods()?
            .into_iter()
            .find(|p| &p.pod.id == id)
            .ok_or(ServiceError::NotFound {
                kind: "pod",
                id: id.to_string(),
            })
    }

    /// Where templates keep their files.
    pub(super) fn template_dir(&self, id: &TemplateId) -> PathBuf {
        self.config.data_dir.join("templates").join(id.as_str())
    }
}

/// Milliseconds between successive calls.
pub(super) struct Lap(Instant);

impl Lap {
    pub(super) fn new() -> Self {
        Lap(Instant::now())
    }

    pub(super) fn next(&mut self) -> f64 {
        let now = Instant::now();
        let ms = now.duration_since(self.0).as_secs_f64() * 1000.0;
        self.0 = now;
        ms
    }
}

/// A VMM [`Service::launch_vmm`] started, not yet recorded.
pub(super) struct Launched {
    pub report: RestoreReport,
    pub handle: VmmHandle,
}

/// Files of a template a VMM of its sandboxes reads besides snapshot
/// layers: a Linux template's root disk image.
pub(super) fn template_exposes(template: &Template) -> Vec<Expose> {
    template
        .rootfs
        .iter()
        .map(|r| Expose::read_only(r.clone()))
        .collect()
}
