//! `torpor serve --nested-pod`: on a host whose /dev/kvm cannot boot Linux
//! (PVM), Linux templates run in a nested hardware-virtualization host
//! (torpor-nested: QEMU/TCG with kvm_amd inside). A background thread boots
//! it with this torpor binary, the guest kernel and the rootfs carried in;
//! inside, `torpor pod serve` listens on TCP (forwarded from a free port on
//! 127.0.0.1) and builds the template `linux`; the thread registers the pod
//! with the federation once it answers. Start-up does not wait for it: until
//! the template is ready, creating a sandbox from it answers 503 saying why.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_api::federation::{AddPod, Federation};
use torpor_api::SandboxApi;
use torpor_nested::{NestedHost, RunningHost};
use torpor_scheduler::model::PodId;
use torpor_scheduler::service::Service;

use super::serve::token_file;
use torpor_api::tls::{self, Fingerprint, Identity};

/// The template the nested pod builds.
pub const TEMPLATE: &str = "linux";
/// The pod's port inside L1.
const POD_PORT: u16 = 7801;
/// How long L1 may take from QEMU start to the pod answering.
const BOOT_LIMIT: Duration = Duration::from_secs(900);
/// Console lines the L1 script prints about the template.
const MARK_READY: &str = "TORPOR-NESTED-POD: template ready";
const MARK_FAILED: &str = "TORPOR-NESTED-POD: template failed:";

/// What the nested pod is made of.
pub struct NestedPodConfig {
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    pub mem_mib: u32,
}

/// The script L1 runs: the pod, and the template built through its API.
fn script(fingerprint: &Fingerprint) -> String {
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
$T pod serve --listen tcp:0.0.0.0:{POD_PORT} --token-file /opt/torpor/pod.token \
   --tls-cert /opt/torpor/pod-cert.pem --tls-key /opt/torpor/pod-key.pem \
   --data-dir /tmp/pod --images-dir "$IMAGES" --request-timeout-ms 1800000 \
   >/tmp/pod.log 2>&1 &
POD=$!
export TORPOR_API=https://127.0.0.1:{POD_PORT} TORPOR_API_FINGERPRINT={fingerprint} \
   TORPOR_TOKEN="$(cat /opt/torpor/pod.token)"
i=0; until $T template list >/dev/null 2>&1 || [ $i -ge 600 ]; do sleep 0.2; i=$((i+1)); done
if $T template create --name {TEMPLATE} --kind linux --image {TEMPLATE} \
     --mem-mib 512 --vcpus 2 >/tmp/template.out 2>&1; then
  echo '{MARK_READY}'
else
  echo "{MARK_FAILED} $(tr '\n' ' ' </tmp/template.out)"
  tail -n 30 /tmp/pod.log
fi
wait $POD
"#
    )
}

/// Starts the nested pod in the background; returns at once after checking
/// what it needs, which it names when missing.
pub fn start(
    federation: Arc<Federation<Service>>,
    data_dir: &Path,
    config: NestedPodConfig,
) -> Result<(), String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the torpor executable: {e}"))?;
    let token_path = data_dir.join("nested-pod.token");
    let (token, _) = token_file(&token_path)?;
    // The pod in L1 serves TLS with an identity made here, so that the
    // federation knows the fingerprint it pins.
    let tls_dir = data_dir.join("nested-pod-tls");
    let (identity, _) = Identity::load_or_create(&tls_dir, &tls::default_names())
        .map_err(|e| format!("the nested pod's TLS identity: {e}"))?;
    let fingerprint = identity.fingerprint();
    let host = NestedHost::builder()
        .memory_mib(config.mem_mib)
        .file(exe, "/opt/torpor/torpor")
        .file(super::serve::vmm_exe()?, "/opt/torpor/torpor-vmm")
        .file(&config.kernel, "/opt/torpor/vmlinux")
        .file(&config.rootfs, "/opt/torpor/rootfs.ext4")
        .file(&token_path, "/opt/torpor/pod.token")
        .file(tls_dir.join(tls::CERT_FILE), "/opt/torpor/pod-cert.pem")
        .file(tls_dir.join(tls::KEY_FILE), "/opt/torpor/pod-key.pem")
        .build()
        .map_err(|e| format!("the nested pod cannot start: {e}"))?;
    federation.template_coming(
        TEMPLATE,
        Some("the nested host (torpor serve --nested-pod) is still booting".into()),
    );
    let id_file = data_dir.join("nested-pod");
    std::thread::Builder::new()
        .name("nested-pod".into())
        .spawn(move || {
            // This thread owns QEMU (it dies with the thread: see
            // NestedHost::start) and lives as long as it.
            let started = Instant::now();
            let mut running = match host.start(&script(&fingerprint), &[POD_PORT]) {
                Ok(r) => r,
                Err(e) => return fail(&federation, format!("cannot start the nested host: {e}")),
            };
            match bring_up(&federation, &mut running, &token, fingerprint, &id_file) {
                Ok(pod) => {
                    federation.template_coming(TEMPLATE, None);
                    println!(
                        "torpor serve: Linux templates run in the nested host (pod {pod}), \
                         template `{TEMPLATE}` ready in {:.0}s",
                        started.elapsed().as_secs_f64()
                    );
                }
                Err(e) => {
                    fail(&federation, e);
                    eprintln!(
                        "torpor serve: nested host console:\n{}",
                        running.console_tail()
                    );
                    return;
                }
            }
            let status = running.wait();
            fail(&federation, format!("the nested host stopped ({status})"));
            eprintln!(
                "torpor serve: nested host console:\n{}",
                running.console_tail()
            );
        })
        .map_err(|e| format!("cannot start the nested pod's thread: {e}"))?;
    Ok(())
}

fn fail(federation: &Federation<Service>, why: String) {
    eprintln!("torpor serve: Linux templates are unavailable: {why}");
    federation.template_coming(TEMPLATE, Some(why));
}

/// Unregisters the nested pod of an earlier run, if any: its L1 died with
/// that `torpor serve` (and its sandboxes with it).
pub fn forget_previous(federation: &Federation<Service>, data_dir: &Path) {
    let file = data_dir.join("nested-pod");
    let Ok(id) = std::fs::read_to_string(&file) else {
        return;
    };
    let id = PodId::new(id.trim());
    match federation.unregister(&id) {
        Ok(()) => println!("torpor serve: unregistered {id}, the nested pod of an earlier run"),
        Err(e) => {
            tracing::warn!(pod = %id, error = %e, "cannot unregister the previous nested pod")
        }
    }
    let _ = std::fs::remove_file(file);
}

/// Waits for the pod to answer, registers it, then waits for its template.
fn bring_up(
    federation: &Federation<Service>,
    running: &mut RunningHost,
    token: &str,
    fingerprint: Fingerprint,
    id_file: &Path,
) -> Result<PodId, String> {
    let port = running
        .host_port(POD_PORT)
        .ok_or("the nested host has no forwarded port")?;
    let address = format!("tls:127.0.0.1:{port}");
    let started = Instant::now();
    let mut last_error = String::new();
    let pod = loop {
        if let Some(status) = running.exited() {
            return Err(format!(
                "the nested host stopped while booting ({status}); last error: {last_error}"
            ));
        }
        if started.elapsed() > BOOT_LIMIT {
            return Err(format!(
                "the nested pod did not answer within {BOOT_LIMIT:?}: {last_error}"
            ));
        }
        let req = AddPod {
            address: address.clone(),
            token: token.to_string(),
            fingerprint: Some(fingerprint.to_string()),
        };
        match federation.register(req) {
            Ok(entry) => break PodId::new(entry["id"].as_str().unwrap_or_default()),
            Err(e) => last_error = e.to_string(),
        }
        std::thread::sleep(Duration::from_secs(2));
    };
    let _ = std::fs::write(id_file, pod.as_str());
    println!(
        "torpor serve: nested pod {pod} at {address} is up after {:.0}s; building template `{TEMPLATE}`",
        started.elapsed().as_secs_f64()
    );
    federation.template_coming(
        TEMPLATE,
        Some(format!("the nested pod {pod} is still building it")),
    );
    loop {
        let console = running.console_tail();
        if let Some(line) = console.lines().find(|l| l.contains(MARK_FAILED)) {
            return Err(line.to_string());
        }
        if console.contains(MARK_READY) {
            break;
        }
        if let Some(status) = running.exited() {
            return Err(format!("the nested host stopped ({status})"));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let entries = federation
        .template_entries()
        .map_err(|e| format!("cannot list the templates: {e}"))?;
    let listed = entries
        .iter()
        .any(|t| t["name"] == TEMPLATE && t["pod"] == pod.as_str());
    if !listed {
        return Err(format!(
            "the nested pod built `{TEMPLATE}` but the federation does not list it"
        ));
    }
    Ok(pod)
}
