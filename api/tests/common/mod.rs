//! Test harness: an in-memory [`SandboxApi`], a real server on
//! 127.0.0.1:0, requests to it through the project's HTTP client, and raw
//! bytes over a TCP stream for malformed requests.

#![allow(dead_code)]

pub mod ports;
mod server;
pub use server::*;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use torpor_api::backend::pod_entry;
use torpor_api::calls::{ImageOp, ImageReply};
use torpor_api::service::{
    AgentLink, Cancel, CreateSandbox, CreateTemplate, DirListing, ExecOutput, ExecRequest,
    ExitReply, FileKind, FileStat, GuestCall, GuestError, Outcome, OutputKind, PodView,
    SandboxFilter, ServiceError,
};
use torpor_api::{
    ApiConfig, ExecMode, ExecReply, FileOp, FileReply, Lifecycle, SandboxApi, TemplateOp,
    TemplateReply,
};
use torpor_client::{Endpoint, HttpClient};
use torpor_scheduler::model::{
    Pod, PodAddress, PodId, Sandbox, SandboxId, SandboxState, Template, TemplateId, TemplateKind,
    TemplateState, Timestamp,
};
use torpor_scheduler::service::guest::ErrorReply;

pub const TOKEN: &str = "test-token-0123456789";
pub const OTHER_TOKEN: &str = "second-token";
pub const TEMPLATE_ID: &str = "tpl_00000000000000aa";
pub const POD_ID: &str = "pod_local";
/// The kernel of a fake template whose sandboxes (and the templates made
/// from them) have the real agent: exec and files on this host.
pub const REAL_AGENT_KERNEL: &str = "real-agent";
/// The fake pod's physical memory.
pub const POD_MIB: u64 = 1024;

/// What the fake holds.
pub struct FakeState {
    pub templates: BTreeMap<TemplateId, Template>,
    pub sandboxes: BTreeMap<SandboxId, Sandbox>,
    pub pod: Pod,
    /// The filter of the last list_sandboxes call.
    pub last_filter: Option<SandboxFilter>,
    /// The last set_timeout call.
    pub last_timeout: Option<(SandboxId, Option<u64>, Option<u64>)>,
    /// Files of the fake agent, by path.
    pub files: BTreeMap<String, Vec<u8>>,
    /// Image files installed (`ImageOp::Install`): image name and file,
    /// in order.
    pub installs: Vec<(String, &'static str)>,
    /// The Linux templates created, as asked.
    pub linux_creates: Vec<CreateTemplate>,
    /// An exec with this text in an argument loses its guest instead (the
    /// agent's connection closes, as when a guest crashes), this many
    /// more times ([`Fake::lose_guest`]).
    pub lose_guest: Option<(String, u32)>,
}

/// An in-memory service with the real state rules for the operations the
/// API exposes, a pod whose admission follows its ratio, and two test
/// hooks: a template named `panic` panics, and metadata `sleep_ms` makes
/// create_sandbox sleep. Sandboxes have no agent (as probe sandboxes)
/// unless their metadata says `agent=fake`: then exec runs `echo` (streamed
/// one argument per chunk), and files live in memory; or `agent=real`:
/// then files and envd's RPCs go to a real torpor-agent on this host
/// (behind the hybrid vsock stand-in, [`Fake::real_agent`]). Images are
/// installed as files in [`Fake::images`]; a Linux template of an image
/// installed there is made (building, then ready when it is next read),
/// without booting anything.
pub struct Fake {
    pub state: Mutex<FakeState>,
    /// The images directory: `NAME/vmlinux`, `NAME/rootfs.ext4`.
    pub images: tempfile::TempDir,
    /// A real torpor-agent behind a hybrid vsock stand-in, started on
    /// first use by `with_guest` (envd's RPCs): the directory holding its
    /// sockets (removed on drop) and the stand-in's socket.
    pub real_agent: Mutex<Option<(tempfile::TempDir, std::path::PathBuf)>>,
}

impl Fake {
    pub fn new() -> Self {
        let template = Template {
            id: TemplateId::new(TEMPLATE_ID),
            name: "probe".into(),
            kernel: "builtin:probe".into(),
            rootfs: None,
            snapshot_dir: Some("/tmp/none".into()),
            mem_mib: 256,
            vcpus: 1,
            kind: TemplateKind::Probe,
            created_at: Timestamp(1),
            state: TemplateState::Ready,
            tenant: None,
            image: None,
            source: None,
            stored_snapshot: None,
        };
        let pod = Pod {
            id: PodId::new(POD_ID),
            address: PodAddress::Local,
            token_hash: None,
            memory_bytes: POD_MIB << 20,
            vcpus: 2,
            disk_bytes: 1 << 40,
            oversubscription_ratio: 1.0,
            high_watermark: 0.9,
            created_at: Timestamp(0),
        };
        Fake {
            state: Mutex::new(FakeState {
                templates: BTreeMap::from([(template.id.clone(), template)]),
                sandboxes: BTreeMap::new(),
                pod,
                last_filter: None,
                last_timeout: None,
                files: BTreeMap::new(),
                installs: Vec::new(),
                linux_creates: Vec::new(),
                lose_guest: None,
            }),
            images: tempfile::tempdir().unwrap(),
            real_agent: Mutex::new(None),
        }
    }

    /// A Linux template of an image installed here (both files), as the
    /// service makes it: building.
    fn linux_template(&self, req: &CreateTemplate) -> Option<Template> {
        let dir = self.images.path().join(req.image.as_deref()?);
        let (kernel, rootfs) = (dir.join("vmlinux"), dir.join("rootfs.ext4"));
        if !kernel.is_file() || !rootfs.is_file() {
            return None;
        }
        Some(Template {
            id: TemplateId::generate(),
            name: req.name.clone(),
            kernel: kernel.to_string_lossy().into_owned(),
            rootfs: Some(rootfs),
            snapshot_dir: None,
            mem_mib: req.mem_mib,
            vcpus: req.vcpus,
            kind: TemplateKind::Linux,
            created_at: Timestamp::now(),
            state: TemplateState::Building,
            tenant: req.owner.clone().filter(|o| !o.admin).map(|o| o.tenant),
            image: req.image.clone(),
            source: None,
            stored_snapshot: None,
        })
    }

    /// The real agent's link for a sandbox with `agent=real`.
    /// Execs with `marker` in an argument find their guest lost (the
    /// agent's connection closed) the next `times` times.
    pub fn lose_guest(&self, marker: &str, times: u32) {
        self.state.lock().unwrap().lose_guest = Some((marker.to_string(), times));
    }

    /// [`Fake::lose_guest`]'s error, if this exec is one it takes.
    fn lost_guest(&self, id: &SandboxId, req: &ExecRequest) -> Result<(), ServiceError> {
        let mut st = self.state.lock().unwrap();
        let Some((marker, left)) = st.lose_guest.as_mut() else {
            return Ok(());
        };
        if *left == 0 || !req.argv.iter().any(|a| a.contains(marker.as_str())) {
            return Ok(());
        }
        *left -= 1;
        Err(ServiceError::Guest(GuestError::Unreachable {
            id: id.to_string(),
            reason: "the agent closed the connection".into(),
        }))
    }

    fn real_link(&self, id: &SandboxId) -> Option<AgentLink> {
        let st = self.state.lock().unwrap();
        let real = st.sandboxes.get(id).is_some_and(|s| {
            s.metadata.get("agent").map(String::as_str) == Some("real")
                || st
                    .templates
                    .get(&s.template)
                    .is_some_and(|t| t.kernel == REAL_AGENT_KERNEL)
        });
        drop(st);
        real.then(|| AgentLink::new(id.as_str(), self.real_agent()))
    }

    /// Adds the shared template `realbase`: the probe's, but its sandboxes
    /// (and templates made from them) have the real agent.
    pub fn add_real_template(&self) {
        let mut st = self.state.lock().unwrap();
        let probe = st.templates[&TemplateId::new(TEMPLATE_ID)].clone();
        let real = Template {
            id: TemplateId::new("tpl_00000000000000bb"),
            name: "realbase".into(),
            kernel: REAL_AGENT_KERNEL.into(),
            tenant: None,
            ..probe
        };
        st.templates.insert(real.id.clone(), real);
    }

    /// The stand-in socket of the real agent, started on first use.
    pub fn real_agent(&self) -> std::path::PathBuf {
        let mut slot = self.real_agent.lock().unwrap();
        let (_, vsock) = slot.get_or_insert_with(|| {
            let dir = tempfile::tempdir().unwrap();
            let vsock = torpor_agent::standin::start(dir.path(), |_| {}).unwrap();
            (dir, vsock)
        });
        vsock.clone()
    }

    fn view(st: &FakeState) -> PodView {
        let mut sandboxes = BTreeMap::new();
        for s in st.sandboxes.values() {
            *sandboxes.entry(s.state.to_string()).or_insert(0) += 1;
        }
        PodView {
            pod: st.pod.clone(),
            committed_mib: committed(st),
            pss_mib: 12.5,
            resident_mib: 10.0,
            sandboxes,
        }
    }

    fn sandbox<'a>(st: &'a mut FakeState, id: &SandboxId) -> Result<&'a mut Sandbox, ServiceError> {
        st.sandboxes
            .get_mut(id)
            .ok_or_else(|| ServiceError::NotFound {
                kind: "sandbox",
                id: id.to_string(),
            })
    }

    /// Moves `id` from one of `from` to `to`, or a conflict naming its state.
    fn transition(
        &self,
        id: &SandboxId,
        from: &[SandboxState],
        to: SandboxState,
    ) -> Result<(Sandbox, SandboxState), ServiceError> {
        let mut st = self.state.lock().unwrap();
        let sandbox = Self::sandbox(&mut st, id)?;
        let was = sandbox.state;
        if !from.contains(&was) {
            return Err(ServiceError::Conflict {
                id: id.to_string(),
                state: was,
                message: format!("sandbox {id} is {was}: cannot go to {to}"),
            });
        }
        sandbox.state = to;
        sandbox.generation += 1;
        Ok((sandbox.clone(), was))
    }
}

/// Memory of sandboxes that hold a VMM.
fn committed(st: &FakeState) -> u64 {
    st.sandboxes
        .values()
        .filter(|s| matches!(s.state, SandboxState::Running | SandboxState::Paused))
        .map(|s| u64::from(s.mem_mib))
        .sum()
}

fn agent_error(code: &str) -> ServiceError {
    ServiceError::Guest(GuestError::Agent {
        id: "fake".into(),
        error: ErrorReply {
            code: code.into(),
            errno: None,
            message: format!("fake agent: {code}"),
        },
    })
}

fn exit(code: i32) -> ExitReply {
    ExitReply {
        code: Some(code),
        signal: None,
        timed_out: false,
        truncated: false,
        duration_us: 1000,
        stdout_bytes: 0,
        stderr_bytes: 0,
    }
}

impl Fake {
    /// A new probe template (not stored): the create's checks and test
    /// hook.
    fn new_template(req: CreateTemplate) -> Result<Template, ServiceError> {
        if req.name == "panic" {
            panic!("test hook: template named panic");
        }
        if req.name.is_empty() {
            return Err(ServiceError::Invalid("template name is empty".into()));
        }
        Ok(Template {
            id: TemplateId::generate(),
            name: req.name,
            kernel: "builtin:probe".into(),
            rootfs: None,
            snapshot_dir: None,
            mem_mib: req.mem_mib,
            vcpus: req.vcpus,
            kind: req.kind,
            created_at: Timestamp::now(),
            state: TemplateState::Building,
            tenant: req.owner.filter(|o| !o.admin).map(|o| o.tenant),
            image: req.image,
            source: None,
            stored_snapshot: None,
        })
    }

    /// The fake agent's sandbox, woken if hibernated.
    fn guest(&self, id: &SandboxId) -> Result<Outcome, ServiceError> {
        let mut st = self.state.lock().unwrap();
        let sandbox = Self::sandbox(&mut st, id)?.clone();
        let real_template = st
            .templates
            .get(&sandbox.template)
            .is_some_and(|t| t.kernel == REAL_AGENT_KERNEL);
        let sandbox = Self::sandbox(&mut st, id)?;
        if !real_template
            && !matches!(
                sandbox.metadata.get("agent").map(String::as_str),
                Some("fake" | "real")
            )
        {
            return Err(ServiceError::Guest(GuestError::NoAgent {
                id: id.to_string(),
                kind: TemplateKind::Probe,
            }));
        }
        let woke = sandbox.state == SandboxState::Hibernated;
        sandbox.state = SandboxState::Running;
        Ok(outcome(sandbox.clone(), woke))
    }

    fn echo(argv: &[String]) -> Result<Vec<String>, ServiceError> {
        match argv.split_first() {
            Some((p, rest)) if p == "echo" => Ok(rest.to_vec()),
            _ => Err(agent_error("ENOENT")),
        }
    }
}

fn outcome(sandbox: Sandbox, resumed: bool) -> Outcome {
    Outcome {
        sandbox,
        resumed,
        resume_ms: resumed.then_some(3.5),
    }
}

/// The fake agent's entries under `path`.
fn list(st: &FakeState, path: &str) -> DirListing {
    let prefix = format!("{}/", path.trim_end_matches('/'));
    let entries = (st.files.iter())
        .filter_map(|(p, data)| {
            let name = p.strip_prefix(&prefix)?;
            Some(FileStat {
                name: name.to_string(),
                kind: FileKind::File,
                size: data.len() as u64,
                mode: 0o644,
                mtime_ns: 0,
                link_target: None,
                uid: None,
                gid: None,
                owner: None,
                group: None,
                st_mode: None,
                resolved: None,
                metadata: Default::default(),
            })
        })
        .collect();
    DirListing {
        entries,
        truncated: false,
    }
}

impl SandboxApi for Fake {
    async fn templates(&self, op: TemplateOp<'_>) -> Result<TemplateReply, ServiceError> {
        let mut st = self.state.lock().unwrap();
        let missing = |id: &str| ServiceError::NotFound {
            kind: "template",
            id: id.to_string(),
        };
        match op {
            TemplateOp::List => Ok(TemplateReply::List(
                st.templates.values().cloned().collect(),
            )),
            TemplateOp::Get { key, owner } => {
                let mut t = torpor_scheduler::names::resolve(st.templates.values(), owner, key)
                    .cloned()
                    .ok_or_else(|| missing(key))?;
                // A Linux template has booted by the time it is read again.
                if t.kind == TemplateKind::Linux && t.state == TemplateState::Building {
                    t.state = TemplateState::Ready;
                    st.templates.insert(t.id.clone(), t.clone());
                }
                Ok(TemplateReply::one(t))
            }
            TemplateOp::Create(req) if req.kind == TemplateKind::Linux => {
                let Some(t) = self.linux_template(&req) else {
                    return Err(ServiceError::Unsupported(
                        "no Linux templates in this build (install the image first)".into(),
                    ));
                };
                st.linux_creates.push(req);
                st.templates.insert(t.id.clone(), t.clone());
                Ok(TemplateReply::one(t))
            }
            TemplateOp::Create(req) => {
                drop(st);
                Self::new_template(req).map(|t| {
                    let mut st = self.state.lock().unwrap();
                    st.templates.insert(t.id.clone(), t.clone());
                    TemplateReply::one(t)
                })
            }
            TemplateOp::Delete { key, owner } => {
                let t = torpor_scheduler::names::resolve(st.templates.values(), owner, key)
                    .cloned()
                    .ok_or_else(|| missing(key))?;
                torpor_scheduler::service::may_delete(owner, &t)?;
                let id = &t.id;
                if st
                    .sandboxes
                    .values()
                    .any(|s| &s.template == id && s.state != SandboxState::Deleted)
                {
                    return Err(ServiceError::ResourceConflict(format!(
                        "template {id} is in use by sandboxes; delete them first"
                    )));
                }
                st.templates.remove(id);
                Ok(TemplateReply::Deleted)
            }
            TemplateOp::Rename { key, owner, name } => {
                let t = torpor_scheduler::names::resolve(st.templates.values(), owner, key)
                    .cloned()
                    .ok_or_else(|| missing(key))?;
                torpor_scheduler::service::may_delete(owner, &t)?;
                if st
                    .templates
                    .values()
                    .any(|o| o.name == name && o.tenant == t.tenant && o.id != t.id)
                {
                    return Err(ServiceError::ResourceConflict(format!(
                        "template {name} already exists"
                    )));
                }
                let renamed = st.templates.get_mut(&t.id).unwrap();
                renamed.name = name.to_string();
                Ok(TemplateReply::one(renamed.clone()))
            }
        }
    }

    /// Images as files in [`Fake::images`].
    async fn images(&self, op: ImageOp<'_>) -> Result<ImageReply, ServiceError> {
        match op {
            ImageOp::List => Ok(ImageReply::List(
                std::fs::read_dir(self.images.path())
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect(),
            )),
            ImageOp::Install {
                name,
                part,
                body,
                limit,
                pod,
            } => {
                assert!(pod.is_none(), "the fake has one pod");
                torpor_scheduler::images::check_name(name)?;
                let dir = self.images.path().join(name);
                std::fs::create_dir_all(&dir).unwrap();
                let mut file = std::fs::File::create(dir.join(part.file_name())).unwrap();
                let n = std::io::copy(&mut std::io::Read::take(body, limit), &mut file)
                    .map_err(|e| ServiceError::Internal(e.to_string()))?;
                let mut st = self.state.lock().unwrap();
                st.installs.push((name.to_string(), part.file_name()));
                Ok(ImageReply::Installed(n))
            }
            ImageOp::Delete(name) => {
                std::fs::remove_dir_all(self.images.path().join(name))
                    .map_err(|e| ServiceError::Internal(e.to_string()))?;
                Ok(ImageReply::Deleted)
            }
        }
    }

    async fn create_sandbox(&self, req: CreateSandbox) -> Result<Sandbox, ServiceError> {
        if let Some(ms) = req.metadata.get("sleep_ms") {
            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
        }
        let mut st = self.state.lock().unwrap();
        let template = torpor_scheduler::names::resolve(
            st.templates.values(),
            req.owner.as_ref(),
            &req.template,
        )
        .cloned()
        .ok_or_else(|| ServiceError::NotFound {
            kind: "template",
            id: req.template.clone(),
        })?;
        let mem = template.mem_mib;
        let capacity = (POD_MIB as f64 * st.pod.oversubscription_ratio) as u64;
        let fits = committed(&st) + u64::from(mem) <= capacity;
        if !fits && !req.queue {
            return Err(ServiceError::Admission {
                message: format!(
                    "pod {POD_ID} is full: {} MiB committed of {capacity} MiB allowed",
                    committed(&st)
                ),
            });
        }
        let mut sandbox = Sandbox::new(
            template.id,
            mem,
            template.vcpus,
            req.keep_alive_ms.unwrap_or(60_000),
        );
        sandbox.metadata = req.metadata;
        sandbox.access_token = req.access_token;
        sandbox.ingress_host = req.ingress_host;
        sandbox.env = req.env;
        sandbox.tenant = req.owner.filter(|o| !o.admin).map(|o| o.tenant);
        sandbox.pod = Some(st.pod.id.clone());
        if fits {
            sandbox.state = SandboxState::Running;
        }
        st.sandboxes.insert(sandbox.id.clone(), sandbox.clone());
        Ok(sandbox)
    }

    async fn get_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        let mut st = self.state.lock().unwrap();
        Self::sandbox(&mut st, id).map(|s| s.clone())
    }

    async fn list_sandboxes(&self, filter: SandboxFilter) -> Result<Vec<Sandbox>, ServiceError> {
        let mut st = self.state.lock().unwrap();
        st.last_filter = Some(filter.clone());
        Ok(st
            .sandboxes
            .values()
            .filter(|s| {
                (filter.states.is_empty() && s.state != SandboxState::Deleted
                    || filter.states.contains(&s.state))
                    && filter.template.as_ref().is_none_or(|t| &s.template == t)
                    && filter
                        .pod
                        .as_ref()
                        .is_none_or(|p| s.pod.as_ref() == Some(p))
                    && filter
                        .metadata
                        .iter()
                        .all(|(k, v)| s.metadata.get(k) == Some(v))
                    && filter
                        .tenant
                        .as_ref()
                        .is_none_or(|t| s.tenant.as_ref() == Some(t))
            })
            .cloned()
            .collect())
    }

    async fn lifecycle(&self, id: &SandboxId, op: Lifecycle) -> Result<Outcome, ServiceError> {
        use SandboxState::*;
        let current = self.get_sandbox(id).await?;
        let (from, to): (&[SandboxState], _) = match op {
            Lifecycle::Pause => (&[Running], Paused),
            Lifecycle::Connect | Lifecycle::Reboot if current.state == Running => {
                return Ok(outcome(current, false));
            }
            // The service's rule: memory kept while the guest did not
            // answer wakes only by a reboot.
            Lifecycle::Resume | Lifecycle::Connect
                if current.state == Hibernated && current.guest_unresponsive_at_pause =>
            {
                return Err(ServiceError::GuestUnresponsive { id: id.to_string() });
            }
            Lifecycle::Resume | Lifecycle::Connect | Lifecycle::Reboot => {
                (&[Paused, Hibernated], Running)
            }
            Lifecycle::Hibernate
            | Lifecycle::HibernateMarking
            | Lifecycle::HibernateStrict
            | Lifecycle::HibernateFilesystem => (&[Running, Paused], Hibernated),
        };
        let (_, was) = self.transition(id, from, to)?;
        // What the service records: the hibernation's kind (a fake guest
        // answers every check), cleared by a wake.
        let mut st = self.state.lock().unwrap();
        let s = Self::sandbox(&mut st, id)?;
        s.disk_only = op == Lifecycle::HibernateFilesystem;
        s.guest_unresponsive_at_pause = false;
        Ok(outcome(s.clone(), to == Running && was == Hibernated))
    }

    async fn delete_sandbox(&self, id: &SandboxId) -> Result<(), ServiceError> {
        use SandboxState::*;
        let from = [Creating, Running, Paused, Hibernated, Failed];
        self.transition(id, &from, Deleted).map(|_| ())
    }

    async fn set_timeout(
        &self,
        id: &SandboxId,
        keep_alive_ms: Option<u64>,
        timeout_ms: Option<u64>,
    ) -> Result<Sandbox, ServiceError> {
        let mut st = self.state.lock().unwrap();
        st.last_timeout = Some((id.clone(), keep_alive_ms, timeout_ms));
        let sandbox = Self::sandbox(&mut st, id)?;
        if let Some(k) = keep_alive_ms {
            sandbox.keep_alive_ms = k;
        }
        if let Some(t) = timeout_ms {
            sandbox.expires_at = Some(Timestamp(Timestamp::now().0 + t as i64));
        }
        Ok(sandbox.clone())
    }

    async fn pod_entries(&self) -> Result<Vec<Value>, ServiceError> {
        Ok(vec![pod_entry(Self::view(&self.state.lock().unwrap()))?])
    }

    async fn set_pod(
        &self,
        id: &PodId,
        ratio: Option<f64>,
        high_watermark: Option<f64>,
    ) -> Result<PodView, ServiceError> {
        let mut st = self.state.lock().unwrap();
        if id != &st.pod.id {
            return Err(ServiceError::NotFound {
                kind: "pod",
                id: id.to_string(),
            });
        }
        if let Some(r) = ratio {
            if !(r > 0.0 && r <= 100.0) {
                return Err(ServiceError::Invalid(format!(
                    "oversubscription ratio {r} is outside (0, 100]"
                )));
            }
            st.pod.oversubscription_ratio = r;
        }
        if let Some(w) = high_watermark {
            st.pod.high_watermark = w;
        }
        Ok(Self::view(&st))
    }

    async fn metrics(&self) -> String {
        let st = self.state.lock().unwrap();
        format!(
            "# TYPE torpor_sandboxes gauge\ntorpor_sandboxes{{state=\"running\"}} {}\n",
            st.sandboxes
                .values()
                .filter(|s| s.state == SandboxState::Running)
                .count()
        )
    }

    async fn execute(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        mut mode: ExecMode<'_>,
    ) -> Result<GuestCall<ExecReply>, ServiceError> {
        let outcome = self.guest(id)?;
        self.lost_guest(id, &req)?;
        if let Some(link) = self.real_link(id) {
            let value = match mode {
                ExecMode::Collect => ExecReply::Collected(link.exec(req, cancel)?),
                ExecMode::Stream {
                    on_start,
                    on_output,
                } => {
                    on_start(&outcome);
                    ExecReply::Streamed(link.exec_streaming(req, cancel, on_output)?)
                }
            };
            return Ok(GuestCall { outcome, value });
        }
        // `sleep S`, streamed: a long request that runs until S seconds
        // have passed or its client has gone (the fairness tests).
        if let (Some("sleep"), ExecMode::Stream { on_start, .. }) =
            (req.argv.first().map(String::as_str), &mut mode)
        {
            let secs: u64 = req.argv.get(1).and_then(|s| s.parse().ok()).unwrap_or(1);
            on_start(&outcome);
            let until = std::time::Instant::now() + Duration::from_secs(secs);
            while std::time::Instant::now() < until && !cancel.is_cancelled() {
                std::thread::sleep(Duration::from_millis(10));
            }
            return Ok(GuestCall {
                outcome,
                value: ExecReply::Streamed(exit(0)),
            });
        }
        let words = Self::echo(&req.argv)?;
        let value = match mode {
            ExecMode::Collect => ExecReply::Collected(ExecOutput {
                stdout: format!("{}\n", words.join(" ")).into_bytes(),
                stderr: Vec::new(),
                exit: exit(0),
            }),
            ExecMode::Stream {
                on_start,
                on_output,
            } => {
                on_start(&outcome);
                for w in &words {
                    on_output(OutputKind::Stdout, format!("{w}\n").as_bytes());
                }
                on_output(OutputKind::Stderr, b"done\n");
                ExecReply::Streamed(exit(3))
            }
        };
        Ok(GuestCall { outcome, value })
    }

    async fn files(
        &self,
        id: &SandboxId,
        op: FileOp<'_>,
    ) -> Result<GuestCall<FileReply>, ServiceError> {
        let outcome = self.guest(id)?;
        if let Some(link) = self.real_link(id) {
            if !matches!(op, FileOp::List { .. }) {
                let value = op.run(&link)?;
                return Ok(GuestCall { outcome, value });
            }
        }
        let mut st = self.state.lock().unwrap();
        let value = match op {
            FileOp::Read { path } => FileReply::Read(
                st.files
                    .get(path)
                    .cloned()
                    .ok_or_else(|| agent_error("ENOENT"))?,
            ),
            FileOp::Write { path, data, .. } => {
                st.files.insert(path.to_string(), data.to_vec());
                FileReply::Written(data.len() as u64)
            }
            FileOp::List { path } => FileReply::List(list(&st, path)),
        };
        Ok(GuestCall { outcome, value })
    }
    /// A template of the sandbox's template (its kernel, memory; its
    /// tenant's), named as asked.
    async fn template_from_sandbox(
        &self,
        id: &SandboxId,
        req: torpor_api::service::TemplateFromSandbox,
    ) -> Result<Template, ServiceError> {
        let mut st = self.state.lock().unwrap();
        let sandbox = Self::sandbox(&mut st, id)?.clone();
        let name = req.name.unwrap_or_else(|| format!("{id}-snapshot"));
        let taken = st
            .templates
            .values()
            .any(|t| t.name == name && t.tenant == sandbox.tenant);
        if taken {
            return Err(ServiceError::ResourceConflict(format!(
                "template {name} already exists"
            )));
        }
        let base = st
            .templates
            .get(&sandbox.template)
            .cloned()
            .ok_or_else(|| ServiceError::NotFound {
                kind: "template",
                id: sandbox.template.to_string(),
            })?;
        let t = Template {
            id: TemplateId::generate(),
            name,
            tenant: sandbox.tenant.clone(),
            source: Some(id.clone()),
            created_at: Timestamp::now(),
            ..base
        };
        st.templates.insert(t.id.clone(), t.clone());
        Ok(t)
    }
    /// A real agent (the host's filesystem and processes) behind the
    /// hybrid vsock stand-in, for sandboxes whose metadata says
    /// `agent=real` (or `fake`).
    async fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut (dyn FnMut(&AgentLink) -> Result<(), GuestError> + Send),
    ) -> Result<Outcome, ServiceError> {
        let outcome = self.guest(id)?;
        let link = AgentLink::new(id.as_str(), self.real_agent());
        f(&link)?;
        Ok(outcome)
    }
}
