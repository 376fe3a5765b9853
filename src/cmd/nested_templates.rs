//! The templates the nested pod builds, in order: `base`, then
//! `code-interpreter-v1` (E2B's code interpreter) when serve has its image
//! (`scripts/build-rootfs --variant interpreter`: the packages and the
//! server). The script L1 runs: install their images, serve the pod, make
//! them templates through its API (the interpreter's image as the hidden
//! layer [`INTERPRETER_LAYER`]), and say on the console how each went; and
//! how serve follows the templates that come after `base` (console marks
//! and the pod's template list) while the host runs: `code-interpreter-v1`
//! is built by serve's template builder from that layer
//! ([`INTERPRETER_SPEC`]: its start command, the server, snapshotted
//! running once it answers).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use torpor_api::build_registry::{Build, BuildStatus};
use torpor_api::nested::Nested;
use torpor_api::{Api, SandboxApi};
use torpor_build::spec::BuildSpec;
use torpor_client::pin::Fingerprint;
use torpor_scheduler::model::PodId;
use torpor_scheduler::service::Service;

/// E2B's default template: the one the nested pod always builds.
pub const BASE: &str = "base";
/// E2B's code interpreter template (`e2b-code-interpreter`'s default).
pub const INTERPRETER: &str = "code-interpreter-v1";
/// The interpreter's image made a template by the pod (booted, its
/// packages and server in it, nothing started): what
/// [`INTERPRETER_SPEC`] builds from. A build layer's name, so lists hide it.
pub const INTERPRETER_LAYER: &str = "build-layer-code-interpreter-v1-image";
/// `code-interpreter-v1`'s build spec: from [`INTERPRETER_LAYER`], the
/// server as its start command, ready once it answers `/health`.
pub const INTERPRETER_SPEC: &str = include_str!("../../guest-image/interpreter/template.json");
/// How long the interpreter's start command may take to answer: its
/// kernels load numpy, pandas and matplotlib (minutes under the nested
/// host's TCG).
const INTERPRETER_READY: Duration = Duration::from_secs(15 * 60);

/// Serve's API, once it is made: the template builder the nested pod's
/// follower builds `code-interpreter-v1` with.
pub type Builder = Arc<OnceLock<ServeApi>>;

/// Serve's API and the runtime it runs on (a build's thread waits there
/// for its backend calls, so it starts on it).
pub struct ServeApi {
    pub api: Api<Nested<Service>>,
    pub runtime: tokio::runtime::Handle,
}

/// The pod's port inside L1.
pub const POD_PORT: u16 = 7801;
/// Where the nested pod sends its sandboxes' volume connections: an
/// address of QEMU's user network whose connections QEMU hands to `torpor
/// nested-volume-pipe`, which pipes them to serve's volume gateway
/// (`nested_pod::volume_gateway`).
pub const VOLUMES_ADDR: &str = "10.0.2.100:2049";
/// Where L1 finds the interpreter's rootfs (carried on the payload disk).
pub const INTERPRETER_ROOTFS: &str = "/opt/torpor/interp-rootfs.ext4";

/// Every console mark starts so.
const MARK: &str = "TORPOR-NESTED-POD: template";

/// Memory and vCPUs of a template: the interpreter's kernels with numpy,
/// pandas and matplotlib loaded want more than `base`'s shell (L1 has
/// about 3 GiB for the pod and its sandboxes). One vCPU: with two, one
/// build lost its agent connection, the next killed L1's kernel ("BUG:
/// TASK stack guard page was hit" in the guest's `vcpu1` thread, as with
/// two-vCPU guests in `nested_net`), and a sandbox of the one that passed
/// triple-faulted during its first calls; with one, the build and the
/// SDKs' run went through.
fn size(name: &str, base_vcpus: u32) -> (u32, u32) {
    match name {
        INTERPRETER | INTERPRETER_LAYER => (1024, 1),
        _ => (512, base_vcpus),
    }
}

/// The console line saying `name` is ready (`base`'s is the one earlier
/// serves' scripts printed).
pub fn mark_ready(name: &str) -> String {
    match name {
        BASE => format!("{MARK} ready"),
        _ => format!("{MARK} {name} ready"),
    }
}

/// The start of the console line saying building `name` failed (and why).
pub fn mark_failed(name: &str) -> String {
    match name {
        BASE => format!("{MARK} failed:"),
        _ => format!("{MARK} {name} failed:"),
    }
}

/// The script L1 runs: the pod, and `templates` (`base` first) built
/// through its API one after the other; `base` gets `base_vcpus`.
pub fn script(fingerprint: &Fingerprint, templates: &[&str], base_vcpus: u32) -> String {
    let failed = mark_failed(BASE);
    let mut install = String::new();
    let mut build = String::new();
    for name in templates {
        // The interpreter boots `base`'s kernel with its own rootfs, as
        // the layer serve's builder starts its server in.
        let image: &str = name;
        let name = if image == INTERPRETER {
            INTERPRETER_LAYER
        } else {
            image
        };
        if image == INTERPRETER {
            install.push_str(&format!(
                r#"mkdir -p "$IMAGES/{image}"
cp "$IMAGES/{BASE}/vmlinux" "$IMAGES/{image}/vmlinux"
mv "$(readlink -f {INTERPRETER_ROOTFS})" "$IMAGES/{image}/rootfs.ext4"
chmod 0644 "$IMAGES/{image}/vmlinux" "$IMAGES/{image}/rootfs.ext4"
"#
            ));
        }
        let (mib, vcpus) = size(name, base_vcpus);
        let (ready, failed) = (mark_ready(name), mark_failed(name));
        build.push_str(&format!(
            r#"if tpl_create /tmp/template-{name}.out {name} --kind linux --image {image} \
     --mem-mib {mib} --vcpus {vcpus}; then
  echo '{ready}'
else
  echo "{failed} $(tr '\n' ' ' </tmp/template-{name}.out)"
  tail -n 30 /tmp/pod.log
fi
"#
        ));
    }
    format!(
        r#"
test -c /dev/kvm || {{ echo '{failed} L1 has no /dev/kvm'; exit 97; }}
# The pod jails its VMMs, as on any host (L1's init mounts cgroup2).
T=/opt/torpor/torpor
# The images the templates are built from, installed in the pod's images
# directory. L1's /opt/torpor/* are symlinks into its payload disk, and the
# pod opens images through no symlink: the files themselves move (a rename
# on the payload's filesystem, no copy of a rootfs in L1's RAM).
IMAGES="$(dirname "$(readlink -f /opt/torpor/rootfs.ext4)")/images"
mkdir -p "$IMAGES/{BASE}"
mv "$(readlink -f /opt/torpor/vmlinux)" "$(readlink -f /opt/torpor/rootfs.ext4)" "$IMAGES/{BASE}/"
# Jailed VMMs (their own uids) read the image: whatever mode it came with.
chmod 0644 "$IMAGES/{BASE}/vmlinux" "$IMAGES/{BASE}/rootfs.ext4"
{install}
# The pod's data (templates, snapshots, sandboxes' disks) on the payload
# disk's spare room, not L1's RAM: a full snapshot of a sandbox writes its
# whole memory (a tmpfs in L1's 3 GiB filled up at the 32nd hibernation).
# Warnings, and what a template's readiness check said.
TORPOR_LOG=warn,torpor_scheduler::service::linux=info \
$T pod serve --listen tcp:0.0.0.0:{POD_PORT} --token-file /opt/torpor/pod.token \
   --tls-cert /opt/torpor/pod-cert.pem --tls-key /opt/torpor/pod-key.pem \
   --data-dir /payload/pod --images-dir "$IMAGES" --request-timeout-ms 1800000 \
   --volumes-relay {VOLUMES_ADDR} --volumes-relay-token-file /opt/torpor/pod.token \
   2>&1 | tee /tmp/pod.log &
# The pod's log is on L1's console too: `torpor serve` shows its tail when
# the nested host fails, and all of it with TORPOR_NESTED_ECHO=1.
POD=$!
export TORPOR_API=https://127.0.0.1:{POD_PORT} TORPOR_API_FINGERPRINT={fingerprint} \
   TORPOR_TOKEN="$(cat /opt/torpor/pod.token)"
i=0; until $T template list >/dev/null 2>&1 || [ $i -ge 600 ]; do sleep 0.2; i=$((i+1)); done
{create_twice}
{build}
wait $POD
"#,
        create_twice = torpor_nested::TEMPLATE_CREATE_SH
    )
}

/// Whether `pod` lists template `name`, ready.
pub fn ready_on(nested: &Nested<Service>, pod: &PodId, name: &str) -> bool {
    torpor_api::backend::wait(nested.template_entries()).is_ok_and(|entries| {
        entries
            .iter()
            .any(|t| t["name"] == name && t["pod"] == pod.as_str() && t["state"] == "ready")
    })
}

/// Follows the templates a running nested host builds after `base`: each
/// is coming (503 with why) until the pod lists it ready or building it
/// failed. `code-interpreter-v1` is built by serve's template builder once
/// the pod has its image's layer.
pub struct Later {
    pending: Vec<String>,
    marks: ConsoleMarks,
    builder: Builder,
    /// `code-interpreter-v1`'s build, once started.
    building: Option<Arc<Build>>,
}

impl Later {
    /// `names` (besides `base`) built by the host whose console file is
    /// `console`, `code-interpreter-v1` with `builder`.
    pub fn new(names: &[String], console: PathBuf, builder: Builder) -> Self {
        Later {
            pending: names.iter().filter(|n| *n != BASE).cloned().collect(),
            marks: ConsoleMarks::new(console),
            builder,
            building: None,
        }
    }

    /// Marks every pending template as being built on `pod`.
    pub fn coming(&self, nested: &Nested<Service>, pod: &PodId) {
        for name in &self.pending {
            nested.template_coming(
                name,
                Some(format!(
                    "the nested pod {pod} is building it (after `{BASE}`)"
                )),
            );
        }
    }

    /// Looks at the console, the pod and the builds once: templates that
    /// became ready are there (said), those whose build failed answer why.
    pub fn check(&mut self, nested: &Nested<Service>, pod: &PodId, since: std::time::Instant) {
        if self.pending.is_empty() {
            return;
        }
        let lines = self.marks.scan();
        let (builder, building) = (&self.builder, &mut self.building);
        self.pending.retain(|name| {
            let made = if name == INTERPRETER {
                interpreter(nested, pod, &lines, builder, building)
            } else {
                made_by_pod(nested, pod, &lines, name)
            };
            match made {
                Made::Not => true,
                Made::Failed(why) => {
                    eprintln!("torpor serve: the nested pod could not build `{name}`: {why}");
                    nested.template_coming(name, Some(format!("building it failed: {why}")));
                    false
                }
                Made::Ready => {
                    nested.template_coming(name, None);
                    println!(
                        "torpor serve: template `{name}` ready in the nested host (pod {pod}) \
                         {:.0}s after it started",
                        since.elapsed().as_secs_f64()
                    );
                    false
                }
            }
        });
    }
}

/// Where a template after `base` is.
enum Made {
    Not,
    Ready,
    Failed(String),
}

/// Template `name` as the pod makes it: its console marks (`lines`), or
/// the pod listing it ready.
fn made_by_pod(nested: &Nested<Service>, pod: &PodId, lines: &[String], name: &str) -> Made {
    let failed = mark_failed(name);
    if let Some(line) = lines.iter().find(|l| l.contains(&failed)) {
        let why = line.split(&failed).nth(1).unwrap_or("").trim();
        return Made::Failed(why.to_string());
    }
    let ready = mark_ready(name);
    if lines.iter().any(|l| l.contains(&ready)) || ready_on(nested, pod, name) {
        return Made::Ready;
    }
    Made::Not
}

/// `code-interpreter-v1`: once the pod made [`INTERPRETER_LAYER`], built
/// by serve's template builder from [`INTERPRETER_SPEC`] (when serve's API
/// is up), and ready when that build is. A host serve re-attached to that
/// has it already is not built again.
fn interpreter(
    nested: &Nested<Service>,
    pod: &PodId,
    lines: &[String],
    builder: &Builder,
    building: &mut Option<Arc<Build>>,
) -> Made {
    if let Some(build) = building {
        let record = build.record();
        return match record.status {
            BuildStatus::Ready => Made::Ready,
            BuildStatus::Error | BuildStatus::Cancelled => Made::Failed(
                record
                    .failure
                    .map(|f| f.message)
                    .unwrap_or_else(|| "the build was cancelled".into()),
            ),
            BuildStatus::Waiting | BuildStatus::Building => Made::Not,
        };
    }
    if ready_on(nested, pod, INTERPRETER) {
        return Made::Ready;
    }
    match made_by_pod(nested, pod, lines, INTERPRETER_LAYER) {
        Made::Ready => {}
        other => return other,
    }
    let Some(serve) = builder.get() else {
        // Serve's API is not made yet: the next look (the pod lists the
        // layer ready).
        return Made::Not;
    };
    let spec = match interpreter_spec() {
        Ok(spec) => spec,
        Err(e) => return Made::Failed(e),
    };
    let started =
        serve
            .runtime
            .block_on(serve.api.build_shared(INTERPRETER, spec, INTERPRETER_READY));
    match started {
        Ok(build) => {
            println!(
                "torpor serve: building `{INTERPRETER}` on the nested pod with the template \
                 builder (build {}): its server started and snapshotted once it answers",
                build.record().id
            );
            *building = Some(build);
            Made::Not
        }
        Err(e) => Made::Failed(format!("its build could not start: {e}")),
    }
}

/// [`INTERPRETER_SPEC`], parsed.
pub fn interpreter_spec() -> Result<BuildSpec, String> {
    serde_json::from_str(INTERPRETER_SPEC)
        .map_err(|e| format!("guest-image/interpreter/template.json: {e}"))
}

/// Lines of L1's console file with [`MARK`] in them, read on from where
/// the last scan stopped (the console file keeps everything; the running
/// host's tail only its last lines, which a busy pod's log scrolls past).
struct ConsoleMarks {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl ConsoleMarks {
    fn new(path: PathBuf) -> Self {
        ConsoleMarks {
            path,
            offset: 0,
            partial: Vec::new(),
        }
    }

    /// The marked lines that came since the last scan.
    fn scan(&mut self) -> Vec<String> {
        let Ok(mut file) = File::open(&self.path) else {
            return Vec::new();
        };
        let mut fresh = Vec::new();
        if file.seek(SeekFrom::Start(self.offset)).is_err() || file.read_to_end(&mut fresh).is_err()
        {
            return Vec::new();
        }
        self.offset += fresh.len() as u64;
        self.partial.extend_from_slice(&fresh);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Vec::new();
        };
        let complete: Vec<u8> = self.partial.drain(..=end).collect();
        String::from_utf8_lossy(&complete)
            .lines()
            .filter(|l| l.contains(MARK))
            .map(|l| l.trim_end_matches('\r').to_string())
            .collect()
    }
}

/// The console file of a host started in `work` (`torpor_nested`'s).
pub fn console_file(work: &Path) -> PathBuf {
    work.join(torpor_nested::CONSOLE_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_distinct_per_template() {
        assert_eq!(mark_ready(BASE), "TORPOR-NESTED-POD: template ready");
        assert_eq!(mark_failed(BASE), "TORPOR-NESTED-POD: template failed:");
        let (ready, failed) = (mark_ready(INTERPRETER), mark_failed(INTERPRETER));
        for base in [mark_ready(BASE), mark_failed(BASE)] {
            assert!(!ready.contains(&base) && !failed.contains(&base));
        }
    }

    #[test]
    fn the_script_builds_the_interpreter_after_base() {
        let fp = Fingerprint::parse(&"ab".repeat(32)).unwrap();
        let alone = script(&fp, &[BASE], 1);
        assert!(alone.contains("--mem-mib 512 --vcpus 1"), "{alone}");
        assert!(!alone.contains(INTERPRETER), "{alone}");
        let both = script(&fp, &[BASE, INTERPRETER], 2);
        assert!(both.contains("--mem-mib 512 --vcpus 2"), "{both}");
        let base_at = both.find("tpl_create /tmp/template-base.out base").unwrap();
        // The interpreter's image becomes the layer its build starts from.
        let interp_at = both
            .find(&format!(
                "tpl_create /tmp/template-{INTERPRETER_LAYER}.out {INTERPRETER_LAYER} \
                 --kind linux --image {INTERPRETER}"
            ))
            .unwrap();
        assert!(base_at < interp_at, "{both}");
        assert!(both.contains("--mem-mib 1024 --vcpus 1"), "{both}");
        assert!(both.contains(&mark_ready(INTERPRETER_LAYER)), "{both}");
        assert!(both.contains(INTERPRETER_ROOTFS), "{both}");
    }

    #[test]
    fn the_interpreter_is_built_from_its_layer_with_its_server_as_start_command() {
        use torpor_build::ready::ReadyCheck;
        use torpor_build::spec::Source;
        let spec = interpreter_spec().unwrap();
        spec.validate().unwrap();
        assert_eq!(
            spec.from,
            Source::Template {
                name: INTERPRETER_LAYER.into()
            }
        );
        assert!(torpor_api::build_registry::is_layer(INTERPRETER_LAYER));
        let start = spec.start.unwrap();
        assert_eq!(
            start.cmd.as_deref(),
            Some("/usr/local/lib/torpor-interpreter/start")
        );
        assert_eq!(
            start.ready,
            Some(ReadyCheck::Url {
                url: "http://127.0.0.1:49999/health".into(),
                status: None
            })
        );
        // The start command is the image's (scripts/build-rootfs puts the
        // variant's files there), and executable.
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/guest-image/interpreter/start");
        let mode = std::fs::metadata(script).unwrap().permissions();
        assert_ne!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o111, 0);
    }

    #[test]
    fn console_marks_are_read_on_from_the_last_scan() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let mut file = File::create(&path).unwrap();
        let mut marks = ConsoleMarks::new(path);
        assert!(marks.scan().is_empty());
        write!(file, "booting\n{}\nhalf a ", mark_ready(BASE)).unwrap();
        assert_eq!(marks.scan(), [mark_ready(BASE)]);
        write!(file, "line {}\r\n", mark_ready(INTERPRETER)).unwrap();
        assert_eq!(
            marks.scan(),
            [format!("half a line {}", mark_ready(INTERPRETER))]
        );
        assert!(marks.scan().is_empty());
    }
}
