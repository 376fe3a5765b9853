//! The Linux template `base` on a host whose /dev/kvm cannot boot Linux
//! (PVM): it runs in a nested hardware-virtualization host (torpor-nested:
//! QEMU/TCG with kvm_amd inside). `torpor serve` offers it on demand (the
//! first request for `base` starts it; `--nested-pod` starts it at once,
//! `--no-nested-pod` never): a background thread builds what is missing
//! with this checkout's scripts (the L1 kernel, the guest kernel, the agent
//! and the Debian rootfs, each cached by content hash, so only the first
//! start builds), boots L1 with this torpor binary, the guest kernel and
//! the rootfs carried in; inside, `torpor pod serve` listens on TCP
//! (forwarded from a free port on 127.0.0.1) and builds the template; the
//! thread attaches the pod once it answers. QEMU outlives serve: it is
//! recorded in the data directory (`nested_record`), re-attached by the next
//! serve ([`resume`]), supervised, and booted again when it dies.
//! Until the
//! template is ready, creating a sandbox from it answers 503 with
//! `Retry-After` and the step it is at (also logged as it goes).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_api::nested::Nested;
use torpor_api::SandboxApi;
use torpor_nested::{L1Assets, NestedHost, RunningHost};
use torpor_scheduler::model::PodId;
use torpor_scheduler::service::Service;

use super::nested_record;
use super::serve::token_file;
use torpor_api::tls::{self, Identity};
use torpor_client::pin::Fingerprint;

/// The template the nested pod builds: E2B's default template name.
pub const TEMPLATE: &str = "base";
/// The pod's port inside L1.
const POD_PORT: u16 = 7801;
/// Room for the pod's data on L1's payload disk (a sparse image in serve's
/// work directory: the host's disk holds what is written, given back as
/// L1 deletes it).
const SPARE_MIB: u64 = 32 << 10;
/// How long L1 may take from QEMU start to the pod answering.
const BOOT_LIMIT: Duration = Duration::from_secs(900);
/// Console lines the L1 script prints about the template.
const MARK_READY: &str = "TORPOR-NESTED-POD: template ready";
const MARK_FAILED: &str = "TORPOR-NESTED-POD: template failed:";

/// What the nested pod is made of (`None`: built from this checkout).
#[derive(Clone)]
pub struct NestedPodConfig {
    pub kernel: Option<PathBuf>,
    pub rootfs: Option<PathBuf>,
    pub mem_mib: u32,
    /// vCPUs of the template `base`.
    pub vcpus: u32,
}

/// The script L1 runs: the pod, and the template built through its API.
fn script(fingerprint: &Fingerprint, vcpus: u32) -> String {
    format!(
        r#"
test -c /dev/kvm || {{ echo '{MARK_FAILED} L1 has no /dev/kvm'; exit 97; }}
# The pod jails its VMMs, as on any host (L1's init mounts cgroup2).
T=/opt/torpor/torpor
# The image the template is built from, installed in the pod's images
# directory. L1's /opt/torpor/* are symlinks into its payload disk, and the
# pod opens images through no symlink: the files themselves move (a rename
# on the payload's filesystem, no copy of the rootfs in L1's RAM).
IMAGES="$(dirname "$(readlink -f /opt/torpor/rootfs.ext4)")/images"
mkdir -p "$IMAGES/{TEMPLATE}"
mv "$(readlink -f /opt/torpor/vmlinux)" "$(readlink -f /opt/torpor/rootfs.ext4)" "$IMAGES/{TEMPLATE}/"
# Jailed VMMs (their own uids) read the image: whatever mode it came with.
chmod 0644 "$IMAGES/{TEMPLATE}/vmlinux" "$IMAGES/{TEMPLATE}/rootfs.ext4"
# The pod's data (templates, snapshots, sandboxes' disks) on the payload
# disk's spare room, not L1's RAM: a full snapshot of a sandbox writes its
# whole memory (a tmpfs in L1's 3 GiB filled up at the 32nd hibernation).
$T pod serve --listen tcp:0.0.0.0:{POD_PORT} --token-file /opt/torpor/pod.token \
   --tls-cert /opt/torpor/pod-cert.pem --tls-key /opt/torpor/pod-key.pem \
   --data-dir /payload/pod --images-dir "$IMAGES" --request-timeout-ms 1800000 \
   2>&1 | tee /tmp/pod.log &
# The pod's log is on L1's console too: `torpor serve` shows its tail when
# the nested host fails, and all of it with TORPOR_NESTED_ECHO=1.
POD=$!
export TORPOR_API=https://127.0.0.1:{POD_PORT} TORPOR_API_FINGERPRINT={fingerprint} \
   TORPOR_TOKEN="$(cat /opt/torpor/pod.token)"
i=0; until $T template list >/dev/null 2>&1 || [ $i -ge 600 ]; do sleep 0.2; i=$((i+1)); done
{create_twice}
if tpl_create /tmp/template.out {TEMPLATE} --kind linux --image {TEMPLATE} \
     --mem-mib 512 --vcpus {vcpus}; then
  echo '{MARK_READY}'
else
  echo "{MARK_FAILED} $(tr '\n' ' ' </tmp/template.out)"
  tail -n 30 /tmp/pod.log
fi
wait $POD
"#,
        create_twice = torpor_nested::TEMPLATE_CREATE_SH
    )
}

/// Offers `base` on demand: the first request for it calls [`start`].
pub fn on_demand(nested: Arc<Nested<Service>>, data_dir: &Path, config: NestedPodConfig) {
    let fed = nested.clone();
    let data_dir = data_dir.to_path_buf();
    nested.template_on_demand(
        TEMPLATE,
        "the nested host starts on the first request for it".into(),
        Box::new(move || {
            println!("torpor serve: `{TEMPLATE}` was asked for: starting the nested host");
            if let Err(e) = start(fed.clone(), &data_dir, config) {
                fail(&fed, e);
            }
        }),
    );
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
/// (else `base` is left on demand).
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
            nested.template_coming(
                TEMPLATE,
                Some("the nested host is being re-attached".into()),
            );
            spawn_host(
                nested.clone(),
                data_dir,
                config.clone(),
                secrets,
                Some((running, record.pod)),
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
    nested.template_coming(
        TEMPLATE,
        Some("the nested host is preparing (step 1 of 5)".into()),
    );
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
    adopted: Option<(RunningHost, PodId)>,
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
                    Some((mut running, pod)) => {
                        match bring_up(&nested, &mut running, &pod, &secrets, ADOPT_LIMIT) {
                            Ok(()) => Ok((running, pod)),
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
                let (mut running, pod) = match up {
                    Ok(up) => up,
                    Err(why) => {
                        nested_record::remove(&data_dir);
                        lose(&nested, None, &why);
                        return fail(&nested, why);
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
                nested.template_coming(TEMPLATE, None);
                println!(
                    "torpor serve: Linux templates run in the nested host (pod {pod}), \
                     template `{TEMPLATE}` ready in {:.0}s",
                    started.elapsed().as_secs_f64()
                );
                let why = supervise(&nested, &mut running, &pod);
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
                        format!("{why} (restarted {RESTARTS} times already: not again)"),
                    );
                }
                eprintln!(
                    "torpor serve: starting a new nested host (restart {restarts} of {RESTARTS})"
                );
                nested.template_coming(
                    TEMPLATE,
                    Some(format!("{why}; a new nested host is starting")),
                );
            }
        })
        .map_err(|e| format!("cannot start the nested pod's thread: {e}"))?;
    Ok(())
}

/// Boots a nested host (up to [`BOOT_ATTEMPTS`] times if its kernel
/// wedges before its pod answers), records it, and brings its pod up.
fn boot(
    nested: &Nested<Service>,
    data_dir: &Path,
    config: &NestedPodConfig,
    secrets: &PodSecrets,
) -> Result<(RunningHost, PodId), String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the torpor executable: {e}"))?;
    let vmm = super::serve::vmm_exe()?;
    let (kernel, rootfs, l1) = prepare(nested, config)?;
    let host = NestedHost::builder()
        .memory_mib(config.mem_mib)
        .spare_mib(SPARE_MIB)
        .l1_dir(l1)
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
        )
        .build()
        .map_err(|e| format!("the nested pod cannot start: {e}"))?;
    nested.template_coming(
        TEMPLATE,
        Some("the nested host is booting (step 5 of 5)".into()),
    );
    let work = data_dir.join(nested_record::WORK_DIR);
    let mut attempt = 1;
    loop {
        let mut running = host
            .start_detached(
                &script(&secrets.fingerprint, config.vcpus),
                &[POD_PORT],
                &work,
            )
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
        };
        // Recorded from the start: a serve killed while L1 boots finds it.
        if let Err(e) = nested_record::write(data_dir, &record) {
            running.kill();
            return Err(e);
        }
        match bring_up(nested, &mut running, &pod, secrets, BOOT_LIMIT) {
            Ok(()) => return Ok((running, pod)),
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
/// answer for [`UNANSWERED_LIMIT`]; why.
fn supervise(nested: &Nested<Service>, running: &mut RunningHost, pod: &PodId) -> String {
    let mut unanswered: Option<(Instant, String)> = None;
    loop {
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

/// This checkout's `scripts/` directory, which builds the nested pod's
/// parts.
fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts")
}

/// The guest kernel, the rootfs and the L1 directory: given, cached, or
/// built now by this checkout's scripts (which cache by content hash).
fn prepare(
    nested: &Nested<Service>,
    config: &NestedPodConfig,
) -> Result<(PathBuf, PathBuf, PathBuf), String> {
    // The L1 this checkout prepares (cached; its module set is this
    // checkout's), unless TORPOR_NESTED_L1 names one.
    let l1 = match std::env::var_os("TORPOR_NESTED_L1") {
        Some(_) => L1Assets::locate().map_err(|e| e.to_string())?.dir,
        None => run_step(
            nested,
            1,
            "preparing the nested host (QEMU and the L1 kernel)",
            "nested-host",
            &["prepare"],
        )?,
    };
    let (kernel, rootfs) = guest_parts(nested, config)?;
    Ok((kernel, rootfs, l1))
}

/// The guest kernel and the rootfs of `base`: given, or built by this
/// checkout's scripts (steps 2 to 4).
fn guest_parts(
    nested: &Nested<Service>,
    config: &NestedPodConfig,
) -> Result<(PathBuf, PathBuf), String> {
    let kernel = match &config.kernel {
        Some(k) => k.clone(),
        None => run_step(
            nested,
            2,
            "building the guest kernel (about 10 minutes the first time)",
            "build-guest-kernel",
            &[],
        )?,
    };
    let rootfs = match &config.rootfs {
        Some(r) => r.clone(),
        None => {
            let agent = run_step(nested, 3, "building the guest agent", "build-agent", &[])?;
            let agent = agent.to_string_lossy().into_owned();
            run_step(
                nested,
                4,
                "building the Debian root filesystem (a few minutes the first time)",
                "build-rootfs",
                &["--agent", &agent],
            )?
        }
    };
    Ok((kernel, rootfs))
}

/// On a host whose own pod runs Linux (VMX/SVM): `base` is built by the
/// local pod on the first request for it, from the same parts (installed
/// as the image `base`), unless the store has it already. Not exercised on
/// this project's PVM test host (no VMX/SVM); the parts and the template
/// build are the nested pod's and the API's, which are.
pub fn local_on_demand(
    nested: Arc<Nested<Service>>,
    service: Arc<Service>,
    config: NestedPodConfig,
) {
    let ready = service
        .list_templates()
        // The shared one: a tenant's template of that name is its own.
        .map(|ts| ts.iter().any(|t| t.name == TEMPLATE && t.tenant.is_none()))
        .unwrap_or(false);
    if ready {
        return;
    }
    let fed = nested.clone();
    nested.template_on_demand(
        TEMPLATE,
        "it is built on the first request for it".into(),
        Box::new(move || {
            println!("torpor serve: `{TEMPLATE}` was asked for: building it");
            std::thread::spawn(move || match build_locally(&fed, &service, &config) {
                Ok(()) => {
                    fed.template_coming(TEMPLATE, None);
                    println!("torpor serve: template `{TEMPLATE}` is ready");
                }
                Err(e) => fail(&fed, e),
            });
        }),
    );
}

fn build_locally(
    nested: &Nested<Service>,
    service: &Service,
    config: &NestedPodConfig,
) -> Result<(), String> {
    use torpor_scheduler::images::ImagePart;
    use torpor_scheduler::model::TemplateKind;
    use torpor_scheduler::service::CreateTemplate;
    let (kernel, rootfs) = guest_parts(nested, config)?;
    for (part, path) in [(ImagePart::Kernel, kernel), (ImagePart::Rootfs, rootfs)] {
        let mut file = std::fs::File::open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        service
            .images()
            .install(TEMPLATE, part, &mut file, u64::MAX)
            .map_err(|e| format!("installing the image {TEMPLATE}: {e}"))?;
    }
    nested.template_coming(
        TEMPLATE,
        Some("the local pod is building it (step 5 of 5)".into()),
    );
    service
        .create_template(CreateTemplate {
            name: TEMPLATE.into(),
            kind: TemplateKind::Linux,
            image: Some(TEMPLATE.into()),
            mem_mib: 512,
            vcpus: config.vcpus,
            cmdline: None,
            pod: None,
            owner: None,
        })
        .map(drop)
        .map_err(|e| format!("building the template {TEMPLATE}: {e}"))
}

/// Runs `scripts/SCRIPT ARGS` as step `n` of the preparation: its stderr
/// lines are logged and are the template's progress; the last line of its
/// stdout is the path it made.
fn run_step(
    nested: &Nested<Service>,
    n: u32,
    what: &str,
    script: &str,
    args: &[&str],
) -> Result<PathBuf, String> {
    let path = scripts_dir().join(script);
    if !path.is_file() {
        return Err(format!(
            "{what}: {} is not there (this torpor binary was moved from its checkout): \
             give --nested-kernel and --nested-rootfs, built with that checkout's scripts",
            path.display()
        ));
    }
    let step = format!("{what} (step {n} of 5)");
    println!("torpor serve: `{TEMPLATE}`: {step}");
    nested.template_coming(TEMPLATE, Some(step.clone()));
    let started = Instant::now();
    // The scripts fill a cache shared with other users of this checkout:
    // under their usual umask, not the service's 077.
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg("umask 022; exec \"$0\" \"$@\"")
        .arg(&path)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: cannot run {}: {e}", path.display()))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let out = std::thread::spawn(move || {
        let mut last = String::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if !line.trim().is_empty() {
                last = line;
            }
        }
        last
    });
    let mut tail: Vec<String> = Vec::new();
    let stderr = child.stderr.take().expect("piped stderr");
    for line in BufReader::new(stderr).lines().map_while(Result::ok) {
        println!("torpor serve: `{TEMPLATE}`: {line}");
        let shown: String = line.chars().take(200).collect();
        nested.template_coming(
            TEMPLATE,
            Some(format!(
                "{step}, {:.0}s so far: {shown}",
                started.elapsed().as_secs_f64()
            )),
        );
        tail.push(line);
        if tail.len() > 20 {
            tail.remove(0);
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("{what}: waiting for {script}: {e}"))?;
    let last = out.join().unwrap_or_default();
    if !status.success() {
        return Err(format!(
            "{what}: {script} failed ({status}): {}",
            tail.join(" | ")
        ));
    }
    let made = PathBuf::from(last.trim());
    if !made.exists() {
        return Err(format!(
            "{what}: {script} did not name what it made (last line: {last:?})"
        ));
    }
    Ok(made)
}

fn fail(nested: &Nested<Service>, why: String) {
    eprintln!("torpor serve: Linux templates are unavailable: {why}");
    nested.template_coming(TEMPLATE, Some(why));
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

/// Whether `pod` lists the template, ready.
fn template_ready(nested: &Nested<Service>, pod: &PodId) -> bool {
    nested.template_entries().is_ok_and(|entries| {
        entries
            .iter()
            .any(|t| t["name"] == TEMPLATE && t["pod"] == pod.as_str() && t["state"] == "ready")
    })
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
        "torpor serve: nested pod {pod} at {address} is up after {:.0}s; building template `{TEMPLATE}`",
        started.elapsed().as_secs_f64()
    );
    nested.template_coming(
        TEMPLATE,
        Some(format!("the nested pod {pod} is still building it")),
    );
    loop {
        let console = running.console_tail();
        if let Some(line) = console.lines().find(|l| l.contains(MARK_FAILED)) {
            return Err(line.into());
        }
        // A re-attached host's console may have scrolled past its mark.
        if console.contains(MARK_READY) || template_ready(nested, pod) {
            break;
        }
        if let Some(status) = running.exited() {
            return Err(format!("the nested host stopped ({status})").into());
        }
        // Attached by now: another boot would be another pod.
        if let Some(line) = lockup(running) {
            return Err(BringUp::Failed(format!(
                "the nested host's kernel locked up while its pod built `{TEMPLATE}`: {line}"
            )));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let entries = nested
        .template_entries()
        .map_err(|e| BringUp::Failed(format!("cannot list the templates: {e}")))?;
    let listed = entries
        .iter()
        .any(|t| t["name"] == TEMPLATE && t["pod"] == pod.as_str());
    if !listed {
        return Err(BringUp::Failed(format!(
            "the nested pod built `{TEMPLATE}` but this server does not list it"
        )));
    }
    Ok(())
}
