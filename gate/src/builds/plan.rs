//! What a build does, step by step, in its sandbox: the [`Plan`] a build
//! spec (`/v1`'s JSON, E2B's build body or a Dockerfile, all parsed into a
//! [`BuildSpec`] by `torpor-build`) is turned into, with each step's
//! cache key.
//!
//! The steps are folded through `torpor-build`'s [`Environment`] (user,
//! working directory, variables, as E2B's template manager keeps them);
//! only RUN and COPY change the guest ([`Action`]) and only they are
//! snapshotted as cache layers; ENV, WORKDIR and USER change the actions
//! after them, and their keys are in the chain (a later step's key covers
//! them), so they need no layer of their own.

use torpor_build::env::{CopyPlan, Environment, GuestCommand};
use torpor_build::key::{layer_keys, Layer};
use torpor_build::spec::{BuildSpec, Step as SpecStep};

/// One thing a build does in its sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A command (RUN).
    Run(GuestCommand),
    /// The uploaded files `hash` put in place (COPY).
    Copy { hash: String, plan: CopyPlan },
}

/// One step of the build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Its cache key: the parent's key, the step and its inputs, hashed.
    pub key: String,
    /// How the logs and errors name it (`RUN apt-get install -y curl`).
    pub label: String,
    /// What it does in the guest; `None` for a step that only changes
    /// the ones after it (ENV, WORKDIR, USER).
    pub action: Option<Action>,
    /// Whether it may be served from the cache (not after a `force` or
    /// with `skip_cache`).
    pub cacheable: bool,
}

/// The start command, run in the background before the final snapshot,
/// and the check that says it is ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    pub key: String,
    /// None: only the ready check (E2B's `set_ready_cmd` alone).
    pub cmd: Option<GuestCommand>,
    /// Exits 0 once the start command is ready.
    pub ready: GuestCommand,
    pub label: String,
    pub cacheable: bool,
}

/// A whole build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The template the build starts from (its id, resolved for the
    /// build's tenant).
    pub source: String,
    pub steps: Vec<Step>,
    pub start: Option<Start>,
    /// The name of the template it makes.
    pub name: String,
    /// The user, directory and variables after the last step.
    pub last: Environment,
}

impl Plan {
    /// How many steps the progress counts (the start command is one).
    pub fn total(&self) -> usize {
        self.steps.len() + usize::from(self.start.is_some())
    }
}

/// How a step is named in logs and errors: its kind and what it does,
/// cut at 200 characters.
fn label(step: &SpecStep) -> String {
    let what = match step {
        SpecStep::Run { cmd, user, .. } => match user {
            Some(u) => format!("RUN (as {u}) {cmd}"),
            None => format!("RUN {cmd}"),
        },
        SpecStep::Copy { src, dest, .. } => format!("COPY {src} {dest}"),
        SpecStep::Env { vars, .. } => {
            let names: Vec<&str> = vars.keys().map(String::as_str).collect();
            format!("ENV {}", names.join(" "))
        }
        SpecStep::Workdir { path, .. } => format!("WORKDIR {path}"),
        SpecStep::User { name, .. } => format!("USER {name}"),
    };
    cut(&what, 200)
}

fn cut(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// The plan of `spec`, from template `source` (its id) whose content
/// `source_key` names ([`torpor_build::key::source_key`]), making
/// template `name`. `start_env` is the user, directory and variables the
/// steps start with (the source template's).
pub fn plan(
    spec: &BuildSpec,
    source: &str,
    source_key: &str,
    name: &str,
    start_env: Environment,
) -> Plan {
    let keys = layer_keys(spec, source_key);
    let mut env = start_env;
    let mut steps = Vec::with_capacity(spec.steps.len());
    let mut start = None;
    for k in keys {
        match k.layer {
            Layer::Step(i) => {
                let step = &spec.steps[i];
                let action = match step {
                    SpecStep::Run { .. } => env.run(step).map(Action::Run),
                    SpecStep::Copy { files_hash, .. } => env.copy(step).map(|plan| Action::Copy {
                        hash: files_hash.clone(),
                        plan,
                    }),
                    _ => None,
                };
                env.apply(step);
                steps.push(Step {
                    key: k.key,
                    label: label(step),
                    action,
                    cacheable: k.cacheable,
                });
            }
            Layer::Start => {
                if let Some(s) = &spec.start {
                    let label = match &s.cmd {
                        Some(cmd) => cut(&format!("START {cmd}"), 200),
                        None => "READY".to_string(),
                    };
                    start = Some(Start {
                        key: k.key,
                        cmd: env.start(s),
                        ready: env.ready(s),
                        label,
                        cacheable: k.cacheable,
                    });
                }
            }
        }
    }
    Plan {
        source: source.to_string(),
        steps,
        start,
        name: name.to_string(),
        last: env,
    }
}

pub use crate::build_registry::{is_layer, layer_name, LAYER_PREFIX};

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: &str) -> BuildSpec {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn steps_fold_their_environment_and_chain_their_keys() {
        let s = spec(
            r#"{"from": {"type": "template", "name": "base"}, "steps": [
                {"type": "env", "vars": {"GREETING": "hi"}},
                {"type": "workdir", "path": "/srv/app"},
                {"type": "run", "cmd": "echo $GREETING > out"},
                {"type": "copy", "src": "a.txt", "dest": "a.txt", "files_hash": "ab"}
            ], "start": {"cmd": "python3 -m http.server 8000", "ready": {"type": "port", "port": 8000}}}"#,
        );
        let p = plan(&s, "tpl_1", "src-key", "web", Environment::default());
        assert_eq!(p.total(), 5);
        assert_eq!(p.steps[0].action, None, "ENV changes no guest");
        assert_eq!(p.steps[1].action, None, "WORKDIR neither");
        let Some(Action::Run(run)) = &p.steps[2].action else {
            panic!("{:?}", p.steps[2]);
        };
        assert_eq!(run.cwd.as_deref(), Some("/srv/app"));
        assert_eq!(run.env.get("GREETING").map(String::as_str), Some("hi"));
        assert_eq!(run.user, "user");
        assert_eq!(p.steps[2].label, "RUN echo $GREETING > out");
        let Some(Action::Copy { hash, plan: copy }) = &p.steps[3].action else {
            panic!("{:?}", p.steps[3]);
        };
        assert_eq!(hash, "ab");
        assert_eq!(copy.cwd.as_deref(), Some("/srv/app"));
        let keys: std::collections::HashSet<&str> =
            p.steps.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(keys.len(), 4, "every step its own key");
        let start = p.start.as_ref().unwrap();
        assert!(start.cmd.is_some() && start.ready.argv.last().unwrap().contains("8000"));
        // Another source, the same steps: every key differs.
        let q = plan(&s, "tpl_1", "other-key", "web", Environment::default());
        assert!(p.steps.iter().zip(&q.steps).all(|(a, b)| a.key != b.key));
        assert!(is_layer(&layer_name(&p.steps[2].key)));
        assert!(!is_layer("web"));
    }
}
