//! The Linux templates `base` and `code-interpreter-v1` on a host whose
//! /dev/kvm cannot boot Linux (PVM): they run in a nested
//! hardware-virtualization host (torpor-nested: QEMU/TCG with kvm_amd
//! inside). `torpor serve` offers them on demand (the first request for
//! either starts it; `--nested-pod` starts it at once, `--no-nested-pod`
//! never): a background thread builds what is missing with this checkout's
//! scripts ([`super::nested_parts`]: the L1 kernel, the guest kernel, the
//! agent and the Debian rootfs, each cached by content hash, so only the
//! first start builds; the interpreter's rootfs when it is to be had),
//! boots L1 with this torpor binary, the guest kernel and the rootfses
//! carried in; inside, `torpor pod serve` listens on TCP (forwarded from a
//! free port on 127.0.0.1) and builds `base`, then the interpreter
//! ([`super::nested_templates`]); the thread attaches the pod once it
//! answers. QEMU outlives serve: it is recorded in the data directory
//! (`nested_record`), re-attached by the next serve ([`resume`]),
//! supervised, and booted again when it dies. Until a template is ready,
//! creating a sandbox from it answers 503 with `Retry-After` and the step
//! it is at (also logged as it goes).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use torpor_api::nested::{Nested, Starter};
use torpor_api::SandboxApi;
use torpor_nested::{NestedHost, RunningHost};
use torpor_scheduler::model::{PodId, SandboxId};
use torpor_scheduler::service::volume_gateway::VolumeGateway;
use torpor_scheduler::service::Service;

use super::nested_parts::{prepare, NestedPodConfig, Parts, Steps};
use super::nested_record;
use super::nested_templates::{self as templates, Later, BASE, INTERPRETER, POD_PORT};
use super::server::token_file;
use torpor_api::tls::{self, Identity};
use torpor_client::pin::Fingerprint;

/// Room for the pod's data on L1's payload disk (a sparse image in serve's
/// work directory: the host's disk holds what is written, given back as
/// L1 deletes it).
const SPARE_MIB: u64 = 32 << 10;
/// How long L1 may take from QEMU start to the pod answering.
const BOOT_LIMIT: Duration = Duration::from_secs(900);

/// The unix socket of serve's volume gateway for its nested host.
fn volume_socket(data_dir: &Path) -> PathBuf {
    data_dir.join("nested-volumes.sock")
}

/// Serve's volume gateway for the nested pod's sandboxes (their volumes
/// are on this host): it serves each connection the nested host's QEMU
/// hands to `torpor nested-volume-pipe` the volumes serve recorded for the
/// sandbox it names. Lives as long as the value.
pub fn volume_gateway(
    nested: &Arc<Nested<Service>>,
    service: &Arc<Service>,
    data_dir: &Path,
) -> Result<VolumeGateway, String> {
    let of = nested.clone();
    // The pod proves itself with its own token (the address is in the
    // nested host's network).
    let token = PodSecrets::load(data_dir)?.token;
    VolumeGateway::start(
        &volume_socket(data_dir),
        service.volume_mounts(),
        Arc::new(move |id: &SandboxId| of.volumes_of(id)),
        token,
    )
    .map_err(|e| e.to_string())
}

/// Offers the nested pod's templates on demand: the first request for any
/// of them calls [`start`], once.
pub fn on_demand(nested: Arc<Nested<Service>>, data_dir: &Path, config: NestedPodConfig) {
    let fed = nested.clone();
    let data_dir = data_dir.to_path_buf();
    let offered = config.offered();
    let starters = shared_start(&offered, move |name| {
        println!("torpor serve: `{name}` was asked for: starting the nested host");
        if let Err(e) = start(fed.clone(), &data_dir, config.clone()) {
            fail(&fed, &config, e);
        }
    });
    for (name, starter) in starters {
        nested.template_on_demand(
            name,
            "the nested host starts on the first request for it".into(),
            starter,
        );
    }
}

/// One starter per name in `names`; the first of them to run calls
/// `start` with its name, the others then do nothing.
fn shared_start(
    names: &[&'static str],
    start: impl FnOnce(&'static str) + Send + 'static,
) -> Vec<(&'static str, Starter)> {
    type Once = Box<dyn FnOnce(&'static str) + Send>;
    let slot: Arc<Mutex<Option<Once>>> = Arc::new(Mutex::new(Some(Box::new(start))));
    names
        .iter()
        .map(|&name| {
            let slot = slot.clone();
            let starter: Starter = Box::new(move || {
                let start = slot
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                if let Some(start) = start {
                    start(name);
                }
            });
            (name, starter)
        })
        .collect()
}

/// The nested pod's token and TLS identity (made on first use, kept in the
/// data directory) and the files carried into L1 for them.
struct PodSecrets {
    token: String,
    token_path: PathBuf,
    tls_dir: PathBuf,
    fingerprint: Fingerprint,
}

impl PodSecrets {
    fn load(data_dir: &Path) -> Result<PodSecrets, String> {
        let token_path = data_dir.join("nested-pod.token");
        let (token, _) = token_file(&token_path)?;
        // The pod in L1 serves TLS with an identity made here, so that the
        // certificate this server pins is known.
        let tls_dir = data_dir.join("nested-pod-tls");
        let (identity, _) = Identity::load_or_create(&tls_dir, &tls::default_names())
            .map_err(|e| format!("the nested pod's TLS identity: {e}"))?;
        Ok(PodSecrets {
            token,
            token_path,
            tls_dir,
            fingerprint: identity.fingerprint(),
        })
    }
}

/// At serve's start: re-attaches to the nested host an earlier serve on
/// this data directory recorded, if it still runs (the same QEMU, serving
/// this server's pod identity), and supervises it from then on; if it is
/// gone, its sandboxes are marked lost and a new nested host is started
/// (it ran before, so it is wanted). Whether a nested host is on its way
/// (else the templates are left on demand).
pub fn resume(
    nested: &Arc<Nested<Service>>,
    data_dir: &Path,
    config: &NestedPodConfig,
) -> Result<bool, String> {
    let Some(record) = nested_record::read(data_dir) else {
        // No host recorded: none of the kept sandboxes' hosts runs.
        if !nested.kept_pods().is_empty() {
            lose(nested, None, "its nested host is gone (not recorded)");
        }
        return Ok(false);
    };
    let secrets = PodSecrets::load(data_dir)?;
    let ours = secrets.fingerprint.to_string();
    match nested_record::adopt(&record, &ours, torpor_nested::echo_from_env()) {
        Ok(running) => {
            println!(
                "torpor serve: re-attaching to the nested host (QEMU pid {}, pod {} at {})",
                record.host.process.pid, record.pod, record.address
            );
            let built = record.templates();
            say(
                nested,
                &config.offered(),
                "the nested host is being re-attached",
            );
            for name in config.offered() {
                if !built.iter().any(|b| b == name) {
                    nested.template_coming(
                        name,
                        Some(
                            "the running nested host was started without it; the next one \
                             has it (start serve once with --no-nested-pod to stop this one)"
                                .into(),
                        ),
                    );
                }
            }
            spawn_host(
                nested.clone(),
                data_dir,
                config.clone(),
                secrets,
                Some((running, record.pod, built)),
            )?;
        }
        Err(e) => {
            println!("torpor serve: the recorded nested host is not re-attached: {e}; starting a new one");
            nested_record::remove(data_dir);
            lose(nested, None, &format!("its nested host stopped: {e}"));
            start(nested.clone(), data_dir, config.clone())?;
        }
    }
    Ok(true)
}

/// Marks the sandboxes of every nested pod but `keep` as lost, saying so.
fn lose(nested: &Nested<Service>, keep: Option<&PodId>, why: &str) {
    match nested.mark_lost(keep, why) {
        Ok(0) => {}
        Ok(n) => eprintln!("torpor serve: {n} sandbox(es) of the nested pod are lost: {why}"),
        Err(e) => eprintln!("torpor serve: marking the nested pod's sandboxes lost: {e}"),
    }
}

/// Starts the nested pod in the background; returns at once after making
/// its token and TLS identity.
pub fn start(
    nested: Arc<Nested<Service>>,
    data_dir: &Path,
    config: NestedPodConfig,
) -> Result<(), String> {
    let secrets = PodSecrets::load(data_dir)?;
    Steps {
        nested: &nested,
        config: &config,
    }
    .say(&format!(
        "the nested host is preparing (step 1 of {})",
        config.steps()
    ));
    spawn_host(nested, data_dir, config, secrets, None)
}

/// Restarts of a nested host that died after it was up, before serve
/// gives up on it (until its next start).
const RESTARTS: u32 = 3;

/// The thread that boots (or, given `adopted`, re-attaches to) the nested
/// host, brings its pod up, supervises it, and boots a new one when it
/// dies.
fn spawn_host(
    nested: Arc<Nested<Service>>,
    data_dir: &Path,
    config: NestedPodConfig,
    secrets: PodSecrets,
    adopted: Option<(RunningHost, PodId, Vec<String>)>,
) -> Result<(), String> {
    let data_dir = data_dir.to_path_buf();
    std::thread::Builder::new()
        .name("nested-pod".into())
        .spawn(move || {
            let mut adopted = adopted;
            let mut restarts = 0;
            loop {
                let started = Instant::now();
                let up = match adopted.take() {
                    Some((mut running, pod, built)) => {
                        match bring_up(&nested, &mut running, &pod, &secrets, ADOPT_LIMIT) {
                            Ok(()) => Ok((running, pod, built)),
                            Err(e) => {
                                let why = format!(
                                    "the re-attached nested host failed: {}",
                                    e.into_message()
                                );
                                running.kill();
                                Err(why)
                            }
                        }
                    }
                    None => boot(&nested, &data_dir, &config, &secrets),
                };
                let (mut running, pod, built) = match up {
                    Ok(up) => up,
                    Err(why) => {
                        nested_record::remove(&data_dir);
                        lose(&nested, None, &why);
                        return fail(&nested, &config, why);
                    }
                };
                // Sandboxes it no longer knows, and those of any other
                // (earlier) pod, are gone.
                match nested.reconcile(&pod) {
                    Ok(0) => {}
                    Ok(n) => eprintln!(
                        "torpor serve: {n} sandbox(es) the nested pod no longer knows are lost"
                    ),
                    Err(e) => eprintln!(
                        "torpor serve: the nested pod's sandboxes could not be checked: {e}"
                    ),
                }
                lose(
                    &nested,
                    Some(&pod),
                    "its nested host stopped and a new one took its place",
                );
                nested.template_coming(BASE, None);
                println!(
                    "torpor serve: Linux templates run in the nested host (pod {pod}), \
                     template `{BASE}` ready in {:.0}s",
                    started.elapsed().as_secs_f64()
                );
                // The templates built after `base` (the interpreter).
                let console = running
                    .record()
                    .map(|r| templates::console_file(&r.work_dir))
                    .unwrap_or_default();
                let mut later = Later::new(&built, console, config.builder.clone());
                later.coming(&nested, &pod);
                let why = supervise(&nested, &mut running, &pod, &mut later, started);
                eprintln!(
                    "torpor serve: {why}; nested host console:\n{}",
                    running.console_tail()
                );
                running.kill();
                nested.detach(&pod);
                nested_record::remove(&data_dir);
                lose(&nested, None, &why);
                restarts += 1;
                if restarts > RESTARTS {
                    return fail(
                        &nested,
                        &config,
                        format!("{why} (restarted {RESTARTS} times already: not again)"),
                    );
                }
                eprintln!(
                    "torpor serve: starting a new nested host (restart {restarts} of {RESTARTS})"
                );
                say(
                    &nested,
                    &config.offered(),
                    &format!("{why}; a new nested host is starting"),
                );
            }
        })
        .map_err(|e| format!("cannot start the nested pod's thread: {e}"))?;
    Ok(())
}

/// Boots a nested host (up to [`BOOT_ATTEMPTS`] times if its kernel
/// wedges before its pod answers), records it, and brings its pod up;
/// the templates it builds.
fn boot(
    nested: &Nested<Service>,
    data_dir: &Path,
    config: &NestedPodConfig,
    secrets: &PodSecrets,
) -> Result<(RunningHost, PodId, Vec<String>), String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the torpor executable: {e}"))?;
    let vmm = super::server::vmm_exe()?;
    let (pipe_exe, gateway) = (exe.display().to_string(), volume_socket(data_dir));
    let gateway = gateway.display().to_string();
    let Parts {
        kernel,
        rootfs,
        interpreter,
        l1,
    } = prepare(&Steps { nested, config })?;
    let mut built = vec![BASE];
    let mut host = NestedHost::builder()
        .memory_mib(config.mem_mib)
        .cpus(config.host_cpus)
        .spare_mib(SPARE_MIB)
        .l1_dir(l1)
        .guest_command(
            templates::VOLUMES_ADDR,
            &[&pipe_exe, "nested-volume-pipe", &gateway],
        )
        .file(exe, "/opt/torpor/torpor")
        .file(vmm, "/opt/torpor/torpor-vmm")
        .file(&kernel, "/opt/torpor/vmlinux")
        .file(&rootfs, "/opt/torpor/rootfs.ext4")
        .file(&secrets.token_path, "/opt/torpor/pod.token")
        .file(
            secrets.tls_dir.join(tls::CERT_FILE),
            "/opt/torpor/pod-cert.pem",
        )
        .file(
            secrets.tls_dir.join(tls::KEY_FILE),
            "/opt/torpor/pod-key.pem",
        );
    if let Some(rootfs) = interpreter {
        host = host.file(rootfs, templates::INTERPRETER_ROOTFS);
        built.push(INTERPRETER);
    }
    let host = host
        .build()
        .map_err(|e| format!("the nested pod cannot start: {e}"))?;
    say(
        nested,
        &built,
        &format!("the nested host is booting ({})", config.boot_step()),
    );
    let script = templates::script(&secrets.fingerprint, &built, config.vcpus);
    let built: Vec<String> = built.iter().map(|n| n.to_string()).collect();
    let work = data_dir.join(nested_record::WORK_DIR);
    let mut attempt = 1;
    loop {
        let mut running = host
            .start_detached(&script, &[POD_PORT], &work)
            .map_err(|e| format!("cannot start the nested host: {e}"))?;
        let pod = PodId::generate();
        let port = running
            .host_port(POD_PORT)
            .ok_or("the nested host has no forwarded port")?;
        let record = nested_record::Recorded {
            host: running
                .record()
                .ok_or("a detached nested host has no record")?,
            pod: pod.clone(),
            address: format!("tls:127.0.0.1:{port}"),
            fingerprint: secrets.fingerprint.to_string(),
            templates: built.clone(),
        };
        // Recorded from the start: a serve killed while L1 boots finds it.
        if let Err(e) = nested_record::write(data_dir, &record) {
            running.kill();
            return Err(e);
        }
        match bring_up(nested, &mut running, &pod, secrets, BOOT_LIMIT) {
            Ok(()) => return Ok((running, pod, built)),
            Err(BringUp::Wedged(line)) if attempt < BOOT_ATTEMPTS => {
                running.kill();
                nested.detach(&pod);
                eprintln!(
                    "torpor serve: the nested host's kernel wedged before its pod \
                     answered ({line}); booting it again (attempt {} of {BOOT_ATTEMPTS})",
                    attempt + 1
                );
                attempt += 1;
            }
            Err(e) => {
                eprintln!(
                    "torpor serve: nested host console:\n{}",
                    running.console_tail()
                );
                running.kill();
                nested.detach(&pod);
                return Err(e.into_message());
            }
        }
    }
}

/// How often a supervised nested host is looked at.
const WATCH_EVERY: Duration = Duration::from_secs(10);
/// How long its pod may not answer before its host counts as dead (TCG
/// under load answers slowly, not minutes late).
const UNANSWERED_LIMIT: Duration = Duration::from_secs(180);
/// How long a re-attached host's pod may take to answer again.
const ADOPT_LIMIT: Duration = Duration::from_secs(180);

/// Watches the running nested host until it is dead: QEMU exited, L1's
/// kernel locked up (or its console went silent), or its pod did not
/// answer for [`UNANSWERED_LIMIT`]; why. Meanwhile the templates it builds
/// after `base` become ready (or fail) as `later` sees them.
fn supervise(
    nested: &Nested<Service>,
    running: &mut RunningHost,
    pod: &PodId,
    later: &mut Later,
    started: Instant,
) -> String {
    let mut unanswered: Option<(Instant, String)> = None;
    loop {
        later.check(nested, pod, started);
        std::thread::sleep(WATCH_EVERY);
        if let Some(status) = running.exited() {
            return format!("the nested host stopped ({status})");
        }
        if let Some(line) = lockup(running) {
            return format!("the nested host's kernel locked up: {line}");
        }
        match nested.pod_answers(pod) {
            Ok(()) => unanswered = None,
            Err(e) => {
                let (since, _) = unanswered.get_or_insert_with(|| (Instant::now(), String::new()));
                if since.elapsed() > UNANSWERED_LIMIT {
                    return format!(
                        "the nested pod did not answer for {:.0} s ({e})",
                        since.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }
}

/// Says `why` for each of `names` (coming: 503 with it).
fn say(nested: &Nested<Service>, names: &[&str], why: &str) {
    for name in names {
        nested.template_coming(name, Some(why.to_string()));
    }
}

fn fail(nested: &Nested<Service>, config: &NestedPodConfig, why: String) {
    eprintln!("torpor serve: Linux templates are unavailable: {why}");
    say(nested, &config.offered(), &why);
}

/// Boots of the nested host before its pod answers: L1's kernel, running
/// kvm_amd under QEMU's TCG, now and then locks up for good while the pod
/// starts (its console says `soft lockup` within a minute); a fresh boot
/// gets past it.
const BOOT_ATTEMPTS: u32 = 3;

/// How a bring-up failed: L1's kernel locked up before the pod answered
/// (worth another boot), or anything else.
enum BringUp {
    Wedged(String),
    Failed(String),
}

impl BringUp {
    fn into_message(self) -> String {
        match self {
            BringUp::Wedged(line) => format!("the nested host's kernel locked up: {line}"),
            BringUp::Failed(message) => message,
        }
    }
}

impl From<String> for BringUp {
    fn from(message: String) -> Self {
        BringUp::Failed(message)
    }
}

impl From<&str> for BringUp {
    fn from(message: &str) -> Self {
        BringUp::Failed(message.to_string())
    }
}

/// The console line saying L1's kernel locked up, if it did; or that its
/// console went silent past [`torpor_nested::STALL_LIMIT`] (a frozen L1
/// prints nothing at all, not even its heartbeat).
fn lockup(running: &RunningHost) -> Option<String> {
    let silent = running.silent_for();
    if silent > torpor_nested::STALL_LIMIT {
        return Some(format!(
            "L1's console has been silent for {:.0} s (a frozen L1: its heartbeat comes every minute)",
            silent.as_secs_f64()
        ));
    }
    running
        .console_tail()
        .lines()
        .find(|l| torpor_nested::l1_wedged(l))
        .map(str::to_string)
}

/// With `--no-nested-pod`: a nested host an earlier serve recorded is
/// stopped (if it is still that QEMU) and its sandboxes marked lost.
pub fn stop_recorded(nested: &Nested<Service>, data_dir: &Path) {
    if let Some(record) = nested_record::read(data_dir) {
        if record.host.process.kill() {
            println!(
                "torpor serve: stopped the nested host an earlier serve left running (QEMU pid {}): \
                 --no-nested-pod",
                record.host.process.pid
            );
        }
        nested_record::remove(data_dir);
    }
    lose(nested, None, "serve was started with --no-nested-pod");
}

/// Waits for the pod to answer, attaches it, then waits for its template.
fn bring_up(
    nested: &Nested<Service>,
    running: &mut RunningHost,
    pod: &PodId,
    secrets: &PodSecrets,
    limit: Duration,
) -> Result<(), BringUp> {
    let port = running
        .host_port(POD_PORT)
        .ok_or("the nested host has no forwarded port")?;
    let address = format!("tls:127.0.0.1:{port}");
    let started = Instant::now();
    let mut last_error = String::new();
    loop {
        if let Some(status) = running.exited() {
            return Err(BringUp::Failed(format!(
                "the nested host stopped while booting ({status}); last error: {last_error}"
            )));
        }
        if let Some(line) = lockup(running) {
            return Err(BringUp::Wedged(line));
        }
        if started.elapsed() > limit {
            return Err(BringUp::Failed(format!(
                "the nested pod did not answer within {limit:?}: {last_error}"
            )));
        }
        let attached = nested.attach_as(
            pod.clone(),
            &address,
            &secrets.token,
            Some(secrets.fingerprint),
        );
        match attached {
            Ok(_) => break,
            Err(e) => last_error = e.to_string(),
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    println!(
        "torpor serve: nested pod {pod} at {address} is up after {:.0}s; building template `{BASE}`",
        started.elapsed().as_secs_f64()
    );
    nested.template_coming(
        BASE,
        Some(format!("the nested pod {pod} is still building it")),
    );
    let (ready, failed) = (templates::mark_ready(BASE), templates::mark_failed(BASE));
    loop {
        let console = running.console_tail();
        if let Some(line) = console.lines().find(|l| l.contains(&failed)) {
            return Err(line.into());
        }
        // A re-attached host's console may have scrolled past its mark.
        if console.contains(&ready) || templates::ready_on(nested, pod, BASE) {
            break;
        }
        if let Some(status) = running.exited() {
            return Err(format!("the nested host stopped ({status})").into());
        }
        // Attached by now: another boot would be another pod.
        if let Some(line) = lockup(running) {
            return Err(BringUp::Failed(format!(
                "the nested host's kernel locked up while its pod built `{BASE}`: {line}"
            )));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let entries = torpor_api::backend::wait(nested.template_entries())
        .map_err(|e| BringUp::Failed(format!("cannot list the templates: {e}")))?;
    let listed = entries
        .iter()
        .any(|t| t["name"] == BASE && t["pod"] == pod.as_str());
    if !listed {
        return Err(BringUp::Failed(format!(
            "the nested pod built `{BASE}` but this server does not list it"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_request_for_any_template_starts_the_one_host() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let seen = calls.clone();
        let starters = shared_start(&[BASE, INTERPRETER], move |name| {
            seen.lock().unwrap().push(name);
        });
        let mut starters: Vec<_> = starters.into_iter().collect();
        assert_eq!(starters.len(), 2);
        // The interpreter asked for first: it starts the host, `base`'s
        // request later finds it started.
        let (_, base) = starters.remove(0);
        let (name, interp) = starters.remove(0);
        assert_eq!(name, INTERPRETER);
        interp();
        base();
        assert_eq!(*calls.lock().unwrap(), [INTERPRETER]);
    }
}
