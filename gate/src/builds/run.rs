//! Running a build ([`Plan`]) in a sandbox of its tenant, through the
//! backend every surface uses: the sandbox is created, each step run by
//! the guest agent, cache layers and the result snapshotted as templates,
//! all admitted against the tenant's quotas as the tenant's own calls
//! would be. Nothing of a build runs on the host.
//!
//! The cache: the longest prefix of cacheable steps whose layers exist
//! (templates named [`layer_name`] of their keys, the tenant's own) is
//! skipped and the sandbox starts from the newest of them; every step run
//! after it that changed the guest is snapshotted as its layer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_scheduler::model::{SandboxId, SandboxState, Template, Timestamp};

use super::image::ImageError;
use super::plan::{layer_name, Action, Plan, Start, Step};
use super::start::Base;
use super::{Build, BuildStatus, Failure, Level, Progress};
use crate::auth::Principal;
use crate::backend::{wait, SandboxApi};
use crate::quota::Usage;
use torpor_build::env::GuestCommand;

use crate::service::{Cancel, CreateSandbox, ExecRequest, OutputKind, ServiceError};
use crate::tenancy::{admit, admit_create, Tenancy};
use torpor_scheduler::service::GuestError;

/// How long a build's steps and waits may take.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// One RUN (or COPY) step; none: the service's longest exec.
    pub step: Option<Duration>,
    /// The start command's ready check, from the start.
    pub ready: Duration,
    /// The build sandbox's lifetime (it is deleted when the build ends;
    /// this bounds a build the server stopped in the middle).
    pub sandbox: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            step: None,
            ready: Duration::from_secs(5 * 60),
            sandbox: Duration::from_secs(2 * 3600),
        }
    }
}

/// Bytes of a failed step's output its failure keeps.
const TAIL_BYTES: usize = 4096;
/// Longest wait for a created sandbox to be running.
const CREATE_WAIT: Duration = Duration::from_secs(600);
/// Pause between two runs of the ready check.
const READY_EVERY: Duration = Duration::from_millis(500);
/// One run of the ready check.
const READY_RUN: Duration = Duration::from_secs(30);

/// How many times a build runs its plan when its sandbox's guest is
/// lost (see [`Stop::guest_lost`]).
const ATTEMPTS: u32 = 2;

/// How a build ended badly.
#[derive(Debug)]
struct Stop {
    status: BuildStatus,
    failure: Failure,
    /// The build's sandbox stopped answering (its guest crashed, shut
    /// down or dropped the agent's connection) rather than a step
    /// failing: the plan may run again from the layers cached so far.
    guest_lost: bool,
}

impl Stop {
    fn error(message: impl Into<String>) -> Stop {
        Stop::exited(message, None, String::new())
    }
    /// A guest command's failure: its exit code and the end of its output.
    fn exited(message: impl Into<String>, exit_code: Option<i32>, output_tail: String) -> Stop {
        Stop {
            status: BuildStatus::Error,
            failure: Failure {
                message: message.into(),
                step: None,
                instruction: None,
                exit_code,
                output_tail,
            },
            guest_lost: false,
        }
    }
    /// The `base` phase's failure (E2B's step `base`: no step index).
    fn base(e: ImageError) -> Stop {
        match e {
            ImageError::Cancelled => cancelled(),
            e => {
                let mut stop = Stop::error(e.to_string());
                stop.failure.instruction = Some("base".into());
                stop
            }
        }
    }
    fn at(mut self, index: usize, label: &str) -> Stop {
        self.failure.step.get_or_insert(index);
        self.failure
            .instruction
            .get_or_insert_with(|| label.to_string());
        self
    }
}

impl From<ServiceError> for Stop {
    fn from(e: ServiceError) -> Stop {
        let guest_lost = matches!(e, ServiceError::Guest(GuestError::Unreachable { .. }));
        Stop {
            guest_lost,
            ..Stop::error(e.to_string())
        }
    }
}

/// Starts the build on a thread of its own: its base (an image made a
/// template first), then its plan; its record says how it goes.
pub fn spawn<S: SandboxApi>(
    tenancy: Tenancy<S>,
    principal: Principal,
    build: Arc<Build>,
    base: Base,
    limits: Limits,
) {
    let name = format!("build-{}", build.record().id);
    // The API's runtime: the build's thread waits there for its backend
    // calls ([`wait`]) and what reaches remote pods (their agent tunnels).
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        build.update(|r| {
            r.status = BuildStatus::Error;
            r.failure = Some(Stop::error("a build started outside the API's runtime").failure);
        });
        return;
    };
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        let _entered = runtime.enter();
        execute(&tenancy, &principal, &build, base, limits);
    });
    if let Err(e) = spawned {
        tracing::error!("cannot start a build thread: {e}");
    }
}

/// Runs the build to its end, writing how it went into `build`'s record.
pub fn execute<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Build,
    base: Base,
    limits: Limits,
) {
    let started = Instant::now();
    build.update(|r| r.status = BuildStatus::Building);
    let result = base.plan(t, p, build).map_err(Stop::base).and_then(|plan| {
        build.log(
            Level::Info,
            format!("building template {} from {}", plan.name, plan.source),
        );
        build.update(|r| r.last_env = Some(plan.last.clone()));
        let mut attempt = 1;
        loop {
            let mut sandbox = None;
            let result = run(t, p, build, &plan, limits, &mut sandbox);
            if let Some(id) = &sandbox {
                if let Err(e) = wait(t.service.delete_sandbox(id)) {
                    build.log(
                        Level::Warn,
                        format!("cannot delete the build's sandbox {id}: {e}"),
                    );
                }
            }
            match result {
                Err(stop) if stop.guest_lost && attempt < ATTEMPTS => {
                    attempt += 1;
                    build.log(
                        Level::Warn,
                        format!(
                            "{}; the build goes on in a new sandbox from the layers cached \
                             so far (attempt {attempt} of {ATTEMPTS})",
                            stop.failure.message
                        ),
                    );
                }
                result => break result,
            }
        }
    });
    let took = started.elapsed().as_secs_f64();
    match result {
        Ok(template) => {
            build.log(
                Level::Info,
                format!(
                    "template {} ({}) ready in {took:.1} s",
                    template.name, template.id
                ),
            );
            build.update(|r| {
                r.status = BuildStatus::Ready;
                r.template_id = Some(template.id.to_string());
                r.finished_at = Some(Timestamp::now());
                r.step = None;
            });
        }
        Err(stop) => {
            build.log(Level::Error, stop.failure.message.clone());
            build.update(|r| {
                r.status = stop.status;
                r.failure = Some(stop.failure);
                r.finished_at = Some(Timestamp::now());
            });
        }
    }
}

/// The build's steps; `sandbox` is set once its sandbox exists (the
/// caller deletes it).
fn run<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Build,
    plan: &Plan,
    limits: Limits,
    sandbox: &mut Option<SandboxId>,
) -> Result<Template, Stop> {
    let s = &*t.service;
    let owner = p.owner();
    let total = plan.total();
    // The newest cached layer of an unbroken cacheable prefix.
    let mut parent = wait(s.resolve_template(&owner, &plan.source))?;
    let mut first = 0;
    let mut whole = true;
    for (i, step) in plan.steps.iter().enumerate() {
        if !step.cacheable {
            whole = false;
            break;
        }
        if step.action.is_none() {
            continue;
        }
        match cached(s, &owner, &step.key)? {
            Some(layer) => {
                parent = layer;
                first = i + 1;
            }
            None => {
                whole = false;
                break;
            }
        }
    }
    // Every step cached: the ENV, WORKDIR and USER after the last layer
    // are in its key chain too.
    if whole {
        first = plan.steps.len();
    }
    let mut start_cached = false;
    if let Some(start) = &plan.start {
        let all = plan.steps.iter().all(|s| s.cacheable);
        if first == plan.steps.len() && all && start.cacheable {
            if let Some(layer) = cached(s, &owner, &start.key)? {
                parent = layer;
                start_cached = true;
            }
        }
    }
    for (i, step) in plan.steps.iter().enumerate().take(first) {
        progress(build, i, total, &step.label, true);
        build.log(
            Level::Info,
            format!("[{}/{total}] CACHED {}", i + 1, step.label),
        );
    }
    build.update(|r| r.cached_steps = first + usize::from(start_cached));

    // The sandbox, from the newest layer.
    let cancel = &build.cancel;
    check_cancel(cancel)?;
    let id = create(t, p, build, &parent, limits)?;
    *sandbox = Some(id.clone());

    for (i, step) in plan.steps.iter().enumerate().skip(first) {
        check_cancel(cancel)?;
        progress(build, i, total, &step.label, false);
        build.log(Level::Info, format!("[{}/{total}] {}", i + 1, step.label));
        if let Some(action) = &step.action {
            act(s, &t.builds.files, build, &id, action, limits, cancel)
                .map_err(|e| e.at(i, &step.label))?;
            if step.cacheable {
                snapshot_layer(t, p, build, &id, step).map_err(|e| e.at(i, &step.label))?;
            }
        }
        build.update(|r| r.run_steps += 1);
    }
    if let Some(start) = &plan.start {
        let i = plan.steps.len();
        let label = start.label.clone();
        progress(build, i, total, &label, start_cached);
        if start_cached {
            build.log(Level::Info, format!("[{}/{total}] CACHED {label}", i + 1));
        } else {
            check_cancel(cancel)?;
            build.log(Level::Info, format!("[{}/{total}] {label}", i + 1));
            start_and_wait(s, build, &id, start, limits, cancel).map_err(|e| e.at(i, &label))?;
            if start.cacheable {
                let layer = Step {
                    key: start.key.clone(),
                    label: label.clone(),
                    action: None,
                    cacheable: true,
                };
                snapshot_layer(t, p, build, &id, &layer).map_err(|e| e.at(i, &label))?;
            }
            build.update(|r| r.run_steps += 1);
        }
    }
    check_cancel(cancel)?;
    let last = plan.steps.len();
    finish(t, p, build, &id, plan).map_err(|e| e.at(last, "finalize"))
}

/// The layer of `key` if the tenant has it.
fn cached<S: SandboxApi>(
    s: &S,
    owner: &crate::service::Owner,
    key: &str,
) -> Result<Option<Template>, ServiceError> {
    match wait(s.resolve_template(owner, &layer_name(key))) {
        Ok(t) => Ok(Some(t)),
        Err(ServiceError::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

fn progress(build: &Build, index: usize, total: usize, label: &str, cached: bool) {
    build.update(|r| {
        r.step = Some(Progress {
            index,
            total,
            label: label.to_string(),
            cached,
        })
    });
}

/// A guest call's error, or the cancellation that caused it.
fn or_cancelled(cancel: &Cancel, e: ServiceError) -> Stop {
    match check_cancel(cancel) {
        Err(stop) => stop,
        Ok(()) => e.into(),
    }
}

fn check_cancel(cancel: &Cancel) -> Result<(), Stop> {
    if cancel.is_cancelled() {
        return Err(cancelled());
    }
    Ok(())
}

fn cancelled() -> Stop {
    Stop {
        status: BuildStatus::Cancelled,
        failure: Failure {
            message: "the build was cancelled".into(),
            step: None,
            instruction: None,
            exit_code: None,
            output_tail: String::new(),
        },
        guest_lost: false,
    }
}

/// Creates the build's sandbox from `parent`, admitted as the tenant's
/// create, and waits until it runs.
fn create<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Build,
    parent: &Template,
    limits: Limits,
) -> Result<SandboxId, Stop> {
    let s = &*t.service;
    let record = build.record();
    let mut req = CreateSandbox {
        template: parent.id.to_string(),
        timeout_ms: Some(u64::try_from(limits.sandbox.as_millis()).unwrap_or(u64::MAX)),
        metadata: BTreeMap::from([("torpor.build".to_string(), record.id.clone())]),
        queue: true,
        owner: Some(p.owner()),
        ..CreateSandbox::default()
    };
    let sandbox = {
        let _ticket = wait(admit_create(t, p, s, &mut req))?;
        wait(s.create_sandbox(req))?
    };
    build.log(
        Level::Info,
        format!(
            "sandbox {} from {} ({})",
            sandbox.id, parent.name, parent.id
        ),
    );
    let deadline = Instant::now() + CREATE_WAIT;
    let mut state = sandbox.state;
    while state == SandboxState::Creating {
        if Instant::now() > deadline {
            return Err(Stop::error(format!(
                "the build's sandbox {} was not running after {} s",
                sandbox.id,
                CREATE_WAIT.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
        state = wait(s.get_sandbox(&sandbox.id))?.state;
    }
    if state != SandboxState::Running {
        return Err(Stop::error(format!(
            "the build's sandbox {} is {state:?}, not running",
            sandbox.id
        )));
    }
    Ok(sandbox.id)
}

/// The root shell script every guest command of a build runs under:
/// `$1` the directory (empty: the user's home; made, owned by the user,
/// when missing), `$2` `user[:group]` (made, as E2B does, when missing),
/// the rest the command, run as that user (`runuser`; root: directly).
const AS_USER: &str = r#"d=$1 u=${2%%:*} g=; case $2 in *:*) g=${2#*:};; esac; shift 2
if ! id -u "$u" >/dev/null 2>&1; then
  useradd --create-home --shell /bin/bash "$u" || { echo "torpor-build: cannot add user $u" >&2; exit 125; }
fi
[ -n "$d" ] || d=$(getent passwd "$u" | cut -d: -f6)
[ -n "$d" ] || d=/
if [ ! -d "$d" ]; then mkdir -p "$d" && chown "$u${g:+:$g}" "$d" || exit 125; fi
cd "$d" || exit 125
case $u in root|0) exec "$@";; esac
exec runuser -u "$u" ${g:+-g "$g"} -- "$@""#;

/// The exec request of `cmd`, under [`AS_USER`]; `timeout` none: the
/// service's longest (its `exec_timeout_ms`).
fn request(cmd: &GuestCommand, timeout: Option<Duration>) -> ExecRequest {
    let mut argv = vec![
        "/bin/sh".to_string(),
        "-c".into(),
        AS_USER.into(),
        "torpor-build".into(),
        cmd.cwd.clone().unwrap_or_default(),
        cmd.user.clone(),
    ];
    argv.extend(cmd.argv.iter().cloned());
    ExecRequest {
        argv,
        env: cmd.env.clone(),
        clear_env: false,
        cwd: Some("/".into()),
        stdin: None,
        timeout_ms: timeout.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        max_output_bytes: None,
    }
}

/// A root command of the build's own (`sh -c script` with `args`).
fn root(script: &str, args: &[&str]) -> GuestCommand {
    let mut argv = vec![
        "/bin/sh".to_string(),
        "-c".into(),
        script.into(),
        "sh".into(),
    ];
    argv.extend(args.iter().map(|a| a.to_string()));
    GuestCommand {
        argv,
        user: "root".into(),
        cwd: Some("/".into()),
        env: BTreeMap::new(),
    }
}

/// A COPY in the guest (as root): `$1` the archive (gzip'd or not), `$2`
/// a fresh directory to unpack it in, `$3` the entry to put, `$4` where
/// (relative: from `$5`, or the owner's home), `$6` `user:group`, `$7`
/// the mode (or empty). A directory's contents are merged into the
/// destination; a file (or link) is moved there, or into it when the
/// destination ends with `/` or is a directory.
const COPY: &str = r#"set -e
tar=$1 stage=$2 src=$3 dest=$4 cwd=$5 owner=$6 mode=$7
rm -rf "$stage"; mkdir -p "$stage"
tar -xf "$tar" -C "$stage" --no-same-owner
[ -n "$cwd" ] || cwd=$(getent passwd "${owner%%:*}" | cut -d: -f6)
[ -n "$cwd" ] || cwd=/
case $dest in /*) ;; *) dest="$cwd/$dest";; esac
s="$stage/$src"
if [ ! -e "$s" ] && [ ! -L "$s" ]; then echo "COPY: $src is not in the uploaded files" >&2; exit 1; fi
if [ -d "$s" ] && [ ! -L "$s" ]; then
  chown -R "$owner" "$s"; [ -z "$mode" ] || chmod -R "$mode" "$s"
  mkdir -p "$dest"; cp -a "$s/." "$dest/"
else
  chown -h "$owner" "$s"; [ -z "$mode" ] || [ -L "$s" ] || chmod "$mode" "$s"
  case $dest in */) mkdir -p "$dest"; t="$dest${s##*/}";; *) mkdir -p "$(dirname "$dest")"; t=$dest;; esac
  if [ -d "$t" ] && [ ! -L "$t" ]; then t="$t/${s##*/}"; fi
  rm -rf "$t"; mv "$s" "$t"
fi
rm -rf "$stage" "$tar""#;

/// Runs `argv` to its end, its output in the build's log; the exit code,
/// and the output's tail on failure.
fn exec_logged<S: SandboxApi>(
    s: &S,
    build: &Build,
    id: &SandboxId,
    req: ExecRequest,
    cancel: &Cancel,
) -> Result<(Option<i32>, String), Stop> {
    let mut tail: Vec<u8> = Vec::new();
    let mut pending: Vec<u8> = Vec::new();
    let mut on_output = |kind: OutputKind, bytes: &[u8]| {
        tail.extend_from_slice(bytes);
        if tail.len() > 2 * TAIL_BYTES {
            tail.drain(..tail.len() - TAIL_BYTES);
        }
        pending.extend_from_slice(bytes);
        while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            let level = match kind {
                OutputKind::Stdout => Level::Info,
                OutputKind::Stderr => Level::Warn,
            };
            build.log(level, text);
        }
    };
    let exit = wait(s.exec_streaming(id, req, cancel, &mut |_| {}, &mut on_output))
        .map_err(|e| or_cancelled(cancel, e))?;
    if !pending.is_empty() {
        build.log(Level::Info, String::from_utf8_lossy(&pending).into_owned());
    }
    let exit = exit.value;
    if exit.timed_out {
        return Err(Stop::error(
            "the step ran past its time limit and was killed",
        ));
    }
    let start = tail.len().saturating_sub(TAIL_BYTES);
    let tail = String::from_utf8_lossy(&tail[start..]).into_owned();
    Ok((exit.code.or(exit.signal.map(|s| 128 + s)), tail))
}

/// Runs `cmd`; a failure (non-zero exit) names its exit code and the
/// end of its output.
fn must<S: SandboxApi>(
    s: &S,
    build: &Build,
    id: &SandboxId,
    cmd: &GuestCommand,
    timeout: Option<Duration>,
    cancel: &Cancel,
    what: &str,
) -> Result<(), Stop> {
    match exec_logged(s, build, id, request(cmd, timeout), cancel)? {
        (Some(0), _) => Ok(()),
        (code, tail) => Err(Stop::exited(
            match code {
                Some(c) => format!("{what} exited with code {c}"),
                None => format!("{what} ended without an exit code"),
            },
            code,
            tail,
        )),
    }
}

/// Runs one step's action in the guest.
fn act<S: SandboxApi>(
    s: &S,
    files: &super::files::Files,
    build: &Build,
    id: &SandboxId,
    action: &Action,
    limits: Limits,
    cancel: &Cancel,
) -> Result<(), Stop> {
    match action {
        Action::Run(cmd) => {
            must(s, build, id, cmd, limits.step, cancel, "the command").map_err(|mut stop| {
                // E2B's words, which its SDKs show.
                if let Some(code) = stop.failure.exit_code {
                    let script = cmd.argv.last().map(String::as_str).unwrap_or_default();
                    stop.failure.message =
                        format!("failed to run command '{script}': exit status {code}");
                }
                stop
            })
        }
        Action::Copy { hash, plan } => {
            let tenant = build.record().tenant;
            let data = files.read(tenant.as_deref(), hash)?;
            let short = &hash[..hash.len().min(16)];
            let tar = format!("/tmp/.torpor-copy-{short}.tar");
            let stage = format!("/tmp/.torpor-copy-{short}");
            wait(s.write_file(id, &tar, &data, Some(0o600)))?;
            let mode = plan.mode.map(|m| format!("{m:o}")).unwrap_or_default();
            let cwd = plan.cwd.clone().unwrap_or_default();
            let args = [
                tar.as_str(),
                &stage,
                &plan.archive_path,
                &plan.dest,
                &cwd,
                &plan.owner,
                &mode,
            ];
            must(
                s,
                build,
                id,
                &root(COPY, &args),
                limits.step,
                cancel,
                "the copy",
            )
        }
    }
}

/// Starts the start command in the background (its own session, output
/// to `/tmp/.torpor-start.log`) and runs the ready check until it passes.
fn start_and_wait<S: SandboxApi>(
    s: &S,
    build: &Build,
    id: &SandboxId,
    start: &Start,
    limits: Limits,
    cancel: &Cancel,
) -> Result<(), Stop> {
    if let Some(cmd) = &start.cmd {
        // The command itself in the background, detached from the exec.
        let mut detached = cmd.clone();
        let mut argv = vec![
            "setsid".to_string(),
            "/bin/sh".into(),
            "-c".into(),
            r#"exec "$@" >/tmp/.torpor-start.log 2>&1 </dev/null &"#.into(),
            "sh".into(),
        ];
        argv.extend(cmd.argv.iter().cloned());
        detached.argv = argv;
        must(
            s,
            build,
            id,
            &detached,
            Some(READY_RUN),
            cancel,
            "starting the start command",
        )?;
        build.log(Level::Info, format!("started: {}", start.label));
    }
    let deadline = Instant::now() + limits.ready;
    let mut runs = 0u32;
    loop {
        check_cancel(cancel)?;
        runs += 1;
        let out = wait(s.exec(id, request(&start.ready, Some(READY_RUN)), cancel))
            .map_err(|e| or_cancelled(cancel, e))?
            .value;
        if out.exit.code == Some(0) {
            build.log(Level::Info, format!("ready after {runs} check(s)"));
            return Ok(());
        }
        if Instant::now() + READY_EVERY > deadline {
            let log = wait(s.read_file(id, "/tmp/.torpor-start.log"))
                .map(|l| l.value)
                .unwrap_or_default();
            let from = log.len().saturating_sub(TAIL_BYTES);
            return Err(Stop::exited(
                format!(
                    "the start command was not ready after {} s (the ready check's \
                     last run: {})",
                    limits.ready.as_secs(),
                    match out.exit.code {
                        Some(c) => format!("exit code {c}"),
                        None => "killed".into(),
                    }
                ),
                out.exit.code,
                String::from_utf8_lossy(&log[from..]).into_owned(),
            ));
        }
        std::thread::sleep(READY_EVERY);
    }
}

/// Snapshots the sandbox as `step`'s cache layer (admitted as the
/// tenant's snapshot); a layer made meanwhile by another build is kept.
fn snapshot_layer<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Build,
    id: &SandboxId,
    step: &Step,
) -> Result<(), Stop> {
    let s = &*t.service;
    let mem = u64::from(wait(s.get_sandbox(id))?.mem_mib);
    let _ticket = wait(admit(t, p, Usage::snapshot(mem)))?;
    let name = layer_name(&step.key);
    let req = crate::service::TemplateFromSandbox {
        name: Some(name.clone()),
        ..Default::default()
    };
    match wait(s.template_from_sandbox(id, req)) {
        Ok(layer) => {
            build.log(
                Level::Debug,
                format!("cached as layer {} ({})", name, layer.id),
            );
            Ok(())
        }
        // Another build of the tenant's made it meanwhile: kept.
        Err(e) => match cached(s, &p.owner(), &step.key) {
            Ok(Some(_)) => Ok(()),
            _ => Err(e.into()),
        },
    }
}

/// The prefix of a rebuilt template's old build, out of its name's way
/// (hidden from lists as a cache layer is; deleted once unused).
const RETIRED: &str = "build-layer-retired-";
/// The prefix of a build's template until it takes its name.
const STAGED: &str = "build-layer-staged-";

/// The name the build's template takes: its name with the `default` tag
/// (the tag a build with no other gets), else `name:tag` of its first tag.
pub fn template_name(name: &str, tags: &[String]) -> String {
    match tags.first() {
        Some(t) if !tags.iter().any(|t| t == "default") => format!("{name}:{t}"),
        _ => name.to_string(),
    }
}

/// The named template from the finished sandbox: an older template of
/// the tenant's of that name is renamed out of the way (and deleted if
/// no sandbox runs from it), as are older ones left by earlier builds.
fn finish<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Build,
    id: &SandboxId,
    plan: &Plan,
) -> Result<Template, Stop> {
    let s = &*t.service;
    let owner = p.owner();
    let name = template_name(&plan.name, &build.record().tags);
    let mem = u64::from(wait(s.get_sandbox(id))?.mem_mib);
    let _ticket = wait(admit(t, p, Usage::snapshot(mem)))?;
    let staged = format!("{STAGED}{}", build.record().id);
    let made = wait(s.template_from_sandbox(
        id,
        crate::service::TemplateFromSandbox {
            name: Some(staged.clone()),
            ..Default::default()
        },
    ))?;
    if let Ok(old) = wait(s.resolve_template(&owner, &name)) {
        if old.tenant == made.tenant {
            let retired = format!("{RETIRED}{}", old.id);
            wait(s.rename_template(Some(&owner), old.id.as_str(), &retired))?;
            build.log(
                Level::Info,
                format!("the previous {name} ({}) retired", old.id),
            );
        }
    }
    let made = wait(s.rename_template(Some(&owner), made.id.as_str(), &name))?;
    // Retired templates no sandbox runs from any more go (on every pod).
    for old in wait(s.template_entries())? {
        let (Some(name), Some(old_id)) = (old["name"].as_str(), old["id"].as_str()) else {
            continue;
        };
        if name.starts_with(RETIRED)
            && old["tenant"].as_str() == made.tenant.as_deref()
            && old_id != made.id.as_str()
            && wait(s.delete_template(Some(&owner), old_id)).is_ok()
        {
            build.log(Level::Debug, format!("deleted the retired {old_id}"));
        }
    }
    Ok(made)
}
