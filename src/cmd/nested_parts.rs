//! What the nested pod's templates are made of: the L1 kernel, the guest
//! kernel, the agent, `base`'s Debian rootfs and `code-interpreter-v1`'s
//! (the variant `interpreter` of that rootfs): given on the command line,
//! or built by this checkout's scripts, which cache by content hash (only a
//! machine's first start builds). Each build is a step of the template's
//! progress (the 503's message and serve's log). On a host whose own pod
//! runs Linux, the same parts make `base` on the local pod.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use torpor_api::nested::Nested;
use torpor_nested::L1Assets;
use torpor_scheduler::service::Service;

use super::nested_templates::{Builder, BASE, INTERPRETER};

/// What the nested pod is made of (`None`: built from this checkout).
#[derive(Clone)]
pub struct NestedPodConfig {
    pub kernel: Option<PathBuf>,
    pub rootfs: Option<PathBuf>,
    pub interpreter: InterpreterImage,
    pub mem_mib: u32,
    /// vCPUs of the nested host (L1) itself.
    pub host_cpus: u32,
    /// vCPUs of the template `base`.
    pub vcpus: u32,
    /// Serve's API once made: builds `code-interpreter-v1`.
    pub builder: Builder,
}

impl NestedPodConfig {
    /// The templates the nested pod will have, `base` first.
    pub fn offered(&self) -> Vec<&'static str> {
        match self.interpreter {
            InterpreterImage::Missing(_) => vec![BASE],
            _ => vec![BASE, INTERPRETER],
        }
    }

    /// The preparation's steps, booting L1 last.
    pub fn steps(&self) -> u32 {
        match self.interpreter {
            InterpreterImage::Cached => 6,
            _ => 5,
        }
    }

    /// The step that boots L1.
    pub fn boot_step(&self) -> String {
        let n = self.steps();
        format!("step {n} of {n}")
    }
}

/// Where `code-interpreter-v1`'s rootfs comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum InterpreterImage {
    /// `--nested-interpreter-rootfs`.
    Given(PathBuf),
    /// `scripts/build-rootfs --variant interpreter` has its tree cached:
    /// the image is made from it with this checkout's agent (seconds, and
    /// cached too).
    Cached,
    /// Not offered, and why.
    Missing(String),
}

impl InterpreterImage {
    /// The given image, else whether this checkout's build-rootfs has the
    /// interpreter's tree cached (its dry run says, building nothing).
    pub fn find(given: Option<PathBuf>) -> Self {
        if let Some(path) = given {
            return InterpreterImage::Given(path);
        }
        let script = scripts_dir().join("build-rootfs");
        if !script.is_file() {
            return InterpreterImage::Missing(format!(
                "{} is not there (this torpor binary was moved from its checkout): \
                 give --nested-interpreter-rootfs",
                script.display()
            ));
        }
        let out = Command::new(&script)
            .args(["--variant", "interpreter", "--dry-run"])
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output();
        let text = match out {
            Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
            Ok(out) => {
                return InterpreterImage::Missing(format!(
                    "scripts/build-rootfs --variant interpreter --dry-run failed ({})",
                    out.status
                ))
            }
            Err(e) => {
                return InterpreterImage::Missing(format!("cannot run {}: {e}", script.display()))
            }
        };
        interpreter_tree_cached(&text)
    }
}

/// What a dry run's output says about the interpreter's tree.
fn interpreter_tree_cached(dry_run: &str) -> InterpreterImage {
    match dry_run
        .lines()
        .find_map(|l| l.strip_prefix("variant tree: "))
    {
        Some(tree) if tree.trim_end().ends_with("(cached)") => InterpreterImage::Cached,
        _ => InterpreterImage::Missing(
            "no interpreter image: build it once with `scripts/build-rootfs --variant \
             interpreter` as root (scripts/setup test does), or give \
             --nested-interpreter-rootfs"
                .into(),
        ),
    }
}

/// The parts a nested host boots with.
pub struct Parts {
    pub kernel: PathBuf,
    pub rootfs: PathBuf,
    /// `code-interpreter-v1`'s rootfs, if it is offered and could be had.
    pub interpreter: Option<PathBuf>,
    pub l1: PathBuf,
}

/// Progress of the preparation, said for every template it is for.
pub struct Steps<'a> {
    pub nested: &'a Nested<Service>,
    pub config: &'a NestedPodConfig,
}

impl Steps<'_> {
    /// Marks every offered template as coming, for `why`.
    pub fn say(&self, why: &str) {
        for name in self.config.offered() {
            self.nested.template_coming(name, Some(why.to_string()));
        }
    }

    /// Runs `scripts/SCRIPT ARGS` as step `n` of the preparation, for
    /// template `who`: its stderr lines are logged and are the progress;
    /// the last line of its stdout is the path it made.
    fn run(
        &self,
        n: u32,
        who: &str,
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
        let step = format!("{what} (step {n} of {})", self.config.steps());
        println!("torpor serve: `{who}`: {step}");
        self.say(&step);
        let started = Instant::now();
        // The scripts fill a cache shared with other users of this
        // checkout: under their usual umask, not the service's 077.
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
            println!("torpor serve: `{who}`: {line}");
            let shown: String = line.chars().take(200).collect();
            self.say(&format!(
                "{step}, {:.0}s so far: {shown}",
                started.elapsed().as_secs_f64()
            ));
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
}

/// The guest kernel and agent templates built from OCI images get (the
/// API's `guest_kernel` and `guest_agent`): the built-in Linux template's.
/// The kernel: `--nested-kernel`, else where this checkout's
/// scripts/build-guest-kernel keeps it (`--path`: nothing is built; the
/// nested pod's preparation may build it later, and a build finds it
/// then). The agent: `--guest-agent`, else where scripts/build-agent puts
/// it (the same). `None` when not known: image builds are 501, naming it.
pub fn guest_files(
    kernel: &Option<PathBuf>,
    agent: &Option<PathBuf>,
) -> (Option<PathBuf>, Option<PathBuf>) {
    let printed = |script: &str| {
        let out = Command::new(scripts_dir().join(script))
            .arg("--path")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().last()?.trim();
        (!line.is_empty()).then(|| PathBuf::from(line))
    };
    (
        kernel.clone().or_else(|| printed("build-guest-kernel")),
        agent.clone().or_else(|| printed("build-agent")),
    )
}

/// This checkout's `scripts/` directory, which builds the nested pod's
/// parts.
fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts")
}

/// The L1 directory and the templates' parts: given, cached, or built now
/// by this checkout's scripts (which cache by content hash). The
/// interpreter's image failing leaves `base` to go on without it (the
/// interpreter then answers why).
pub fn prepare(steps: &Steps<'_>) -> Result<Parts, String> {
    // The L1 this checkout prepares (cached; its module set is this
    // checkout's), unless TORPOR_NESTED_L1 names one.
    let l1 = match std::env::var_os("TORPOR_NESTED_L1") {
        Some(_) => L1Assets::locate().map_err(|e| e.to_string())?.dir,
        None => steps.run(
            1,
            BASE,
            "preparing the nested host (QEMU and the L1 kernel)",
            "nested-host",
            &["prepare"],
        )?,
    };
    let (kernel, rootfs, agent) = guest_parts(steps)?;
    let interpreter = match &steps.config.interpreter {
        InterpreterImage::Missing(_) => None,
        InterpreterImage::Given(path) => Some(path.clone()),
        InterpreterImage::Cached => {
            let built = match agent {
                Some(agent) => Ok(agent),
                None => steps.run(3, INTERPRETER, "building the guest agent", "build-agent", &[]),
            }
            .and_then(|agent| {
                steps.run(
                    5,
                    INTERPRETER,
                    "building the code interpreter's root filesystem (seconds from its cached tree)",
                    "build-rootfs",
                    &["--variant", "interpreter", "--agent", &agent.to_string_lossy()],
                )
            });
            match built {
                Ok(path) => Some(path),
                Err(e) => {
                    eprintln!("torpor serve: `{INTERPRETER}` is not offered: {e}");
                    steps
                        .nested
                        .template_coming(INTERPRETER, Some(format!("its image failed: {e}")));
                    None
                }
            }
        }
    };
    Ok(Parts {
        kernel,
        rootfs,
        interpreter,
        l1,
    })
}

/// The guest kernel and `base`'s rootfs: given, or built by this
/// checkout's scripts (steps 2 to 4); and the agent, if it was built.
fn guest_parts(steps: &Steps<'_>) -> Result<(PathBuf, PathBuf, Option<PathBuf>), String> {
    let config = steps.config;
    let kernel = match &config.kernel {
        Some(k) => k.clone(),
        None => steps.run(
            2,
            BASE,
            "building the guest kernel (about 10 minutes the first time)",
            "build-guest-kernel",
            &[],
        )?,
    };
    let (rootfs, agent) = match &config.rootfs {
        Some(r) => (r.clone(), None),
        None => {
            let agent = steps.run(3, BASE, "building the guest agent", "build-agent", &[])?;
            let rootfs = steps.run(
                4,
                BASE,
                "building the Debian root filesystem (a few minutes the first time)",
                "build-rootfs",
                &["--agent", &agent.to_string_lossy()],
            )?;
            (rootfs, Some(agent))
        }
    };
    Ok((kernel, rootfs, agent))
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
        .map(|ts| ts.iter().any(|t| t.name == BASE && t.tenant.is_none()))
        .unwrap_or(false);
    if ready {
        return;
    }
    // `base` alone here: the interpreter is the nested pod's.
    let config = NestedPodConfig {
        interpreter: InterpreterImage::Missing("the local pod builds `base` only".into()),
        ..config
    };
    let fed = nested.clone();
    nested.template_on_demand(
        BASE,
        "it is built on the first request for it".into(),
        Box::new(move || {
            println!("torpor serve: `{BASE}` was asked for: building it");
            std::thread::spawn(move || match build_locally(&fed, &service, &config) {
                Ok(()) => {
                    fed.template_coming(BASE, None);
                    println!("torpor serve: template `{BASE}` is ready");
                }
                Err(e) => {
                    eprintln!("torpor serve: Linux templates are unavailable: {e}");
                    fed.template_coming(BASE, Some(e));
                }
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
    let (kernel, rootfs, _) = guest_parts(&Steps { nested, config })?;
    for (part, path) in [(ImagePart::Kernel, kernel), (ImagePart::Rootfs, rootfs)] {
        let mut file = std::fs::File::open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        service
            .images()
            .install(BASE, part, &mut file, u64::MAX)
            .map_err(|e| format!("installing the image {BASE}: {e}"))?;
    }
    nested.template_coming(
        BASE,
        Some(format!(
            "the local pod is building it ({})",
            config.boot_step()
        )),
    );
    service
        .create_template(CreateTemplate {
            name: BASE.into(),
            kind: TemplateKind::Linux,
            image: Some(BASE.into()),
            mem_mib: 512,
            vcpus: config.vcpus,
            cmdline: None,
            pod: None,
            owner: None,
        })
        .map(drop)
        .map_err(|e| format!("building the template {BASE}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interpreter_is_offered_when_its_tree_is_cached() {
        let cached = "variant: interpreter (x)\nvariant tree: /c/rootfs/tree-1 (cached)\n";
        assert_eq!(interpreter_tree_cached(cached), InterpreterImage::Cached);
        let missing = "variant tree: /c/rootfs/tree-1 (to build)\n";
        let InterpreterImage::Missing(why) = interpreter_tree_cached(missing) else {
            panic!("a tree to build is not an image");
        };
        assert!(
            why.contains("scripts/build-rootfs --variant interpreter"),
            "{why}"
        );
        let config = |interpreter| NestedPodConfig {
            kernel: None,
            rootfs: None,
            interpreter,
            mem_mib: 3072,
            host_cpus: 2,
            vcpus: 1,
            builder: Builder::default(),
        };
        assert_eq!(
            config(InterpreterImage::Cached).offered(),
            [BASE, INTERPRETER]
        );
        assert_eq!(config(InterpreterImage::Cached).boot_step(), "step 6 of 6");
        let given = config(InterpreterImage::Given("/i.ext4".into()));
        assert_eq!(given.offered(), [BASE, INTERPRETER]);
        assert_eq!(given.boot_step(), "step 5 of 5");
        let missing = config(InterpreterImage::Missing("no".into()));
        assert_eq!(missing.offered(), [BASE]);
    }
}
