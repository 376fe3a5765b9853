//! A Dockerfile as a [`BuildSpec`], for `torpor template build -f
//! Dockerfile` ([`parse`]). One stage; what each instruction becomes:
//!
//! - `FROM image [AS name]`: the source image (`--platform` ignored); a
//!   second FROM (multi-stage) and `scratch` are errors. `ARG`s before
//!   FROM are usable in it only (and as defaults of a later `ARG NAME`).
//! - `RUN` (shell form as written; exec form `["a", "b"]` shell-quoted):
//!   a RUN step with the ARGs in scope as its own variables (Docker's
//!   semantics: not persisted in the template). `--mount=type=cache` is
//!   ignored (a plain directory then), `--network` and `--security` too;
//!   other mounts are errors.
//! - `COPY` / `ADD` of context paths: one COPY step per source, its
//!   `files_hash` empty until the CLI packs the context
//!   ([`ParsedDockerfile::into_spec`]); `--chown` and `--chmod` (octal)
//!   kept, `--link` ignored; `--from`, `--parents`, `--exclude`, ADD of a
//!   URL or git repository, and ADD of a local archive (Docker unpacks it)
//!   are errors.
//! - `ENV` (`k=v ...` and legacy `k v`): an ENV step; `$VAR` of ARGs is
//!   substituted now, of anything else (earlier ENVs, the image's own
//!   variables such as `PATH`) when the step runs (`crate::env::expand`).
//! - `ARG name[=default]`: substituted (`$VAR`, `${VAR}`, `${VAR:-d}`,
//!   `${VAR-d}`, `${VAR:+a}`, `${VAR+a}`) in later instructions, the
//!   caller's build args winning over defaults; no step.
//! - `WORKDIR`, `USER`: steps. As E2B's `from_dockerfile`, the steps start
//!   as `root` in `/` (Docker's defaults) and, unless the Dockerfile set
//!   them, end as `user` in `/home/user` (E2B's, for the sandboxes).
//! - `CMD` / `ENTRYPOINT`: the start command, combined by Docker's rules
//!   (exec ENTRYPOINT + CMD arguments; a shell-form ENTRYPOINT ignores
//!   CMD). Its ready check: `HEALTHCHECK CMD` when given (`NONE`: none);
//!   otherwise, when exactly one TCP port is EXPOSEd, that port
//!   listening; otherwise none (the executor's default wait).
//! - `SHELL ["bash"|"sh", options..., "-c"]`: the options become a `set`
//!   line before each later RUN; other shells are errors.
//! - `LABEL`, `MAINTAINER`, `STOPSIGNAL`, `VOLUME`: ignored. `ONBUILD`,
//!   heredocs (`<<EOF`) and unknown instructions are errors naming their
//!   line.
//!
//! Directives (`# escape=` and others at the top), comments, empty lines
//! and line continuations are read as Docker reads them.

mod error;
mod instructions;
mod lex;

use std::collections::BTreeMap;

pub use error::{DockerfileError, Problem};
use instructions::form;
use lex::{logical_lines, Line, Lookup, Var, Words};

use crate::ready::ReadyCheck;
use crate::spec::{BuildSpec, Source, Start, Step};
use crate::validate::SpecError;

/// A parsed Dockerfile: the spec, and the context paths its COPY steps
/// need packed (`crate::context`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedDockerfile {
    /// The build; each COPY's `files_hash` is empty.
    pub spec: BuildSpec,
    /// One per COPY step, in order.
    pub copies: Vec<CopyInput>,
}

/// A COPY step's source in the build context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyInput {
    /// Its index in `spec.steps`.
    pub step: usize,
    /// The path or glob, relative to the context.
    pub src: String,
    /// The Dockerfile line.
    pub line: usize,
}

impl ParsedDockerfile {
    /// The spec with each COPY's `files_hash` set to `hash(src)` (the
    /// packed context's SHA-256), validated.
    pub fn into_spec<E: From<SpecError>>(
        mut self,
        mut hash: impl FnMut(&str) -> Result<String, E>,
    ) -> Result<BuildSpec, E> {
        for copy in &self.copies {
            if let Some(Step::Copy { files_hash, .. }) = self.spec.steps.get_mut(copy.step) {
                *files_hash = hash(&copy.src)?;
            }
        }
        self.spec.validate()?;
        Ok(self.spec)
    }
}

/// The build of `text`, `build_args` overriding its ARG defaults.
pub fn parse(
    text: &str,
    build_args: &BTreeMap<String, String>,
) -> Result<ParsedDockerfile, DockerfileError> {
    let (escape, lines) = logical_lines(text)?;
    let mut p = Parser {
        escape,
        build_args,
        global: BTreeMap::new(),
        args: BTreeMap::new(),
        envs: BTreeMap::new(),
        from: None,
        steps: vec![
            Step::User {
                name: "root".into(),
                force: false,
            },
            Step::Workdir {
                path: "/".into(),
                force: false,
            },
        ],
        copies: Vec::new(),
        user_set: false,
        workdir_set: false,
        cmd: None,
        entrypoint: None,
        healthcheck: None,
        tcp_ports: Vec::new(),
        shell_prefix: None,
    };
    for line in &lines {
        p.instruction(line)?;
    }
    let Some(image) = p.from.take() else {
        return Err(DockerfileError {
            line: None,
            problem: Problem::NoFrom,
        });
    };
    let start = p.start();
    if !p.user_set {
        p.steps.push(Step::User {
            name: crate::env::DEFAULT_USER.into(),
            force: false,
        });
    }
    if !p.workdir_set {
        p.steps.push(Step::Workdir {
            path: "/home/user".into(),
            force: false,
        });
    }
    Ok(ParsedDockerfile {
        spec: BuildSpec {
            from: Source::Image {
                reference: image,
                username: None,
                password: None,
            },
            steps: p.steps,
            start,
            skip_cache: false,
            cpu_count: None,
            memory_mib: None,
        },
        copies: p.copies,
    })
}

/// CMD or ENTRYPOINT as written.
#[derive(Debug, Clone)]
enum Form {
    /// `["a", "b"]`.
    Exec(Vec<String>),
    /// A shell command.
    Shell(String),
}

struct Parser<'a> {
    escape: char,
    build_args: &'a BTreeMap<String, String>,
    /// ARGs declared before FROM: their values (None: no value).
    global: BTreeMap<String, Option<String>>,
    /// ARGs declared in the stage.
    args: BTreeMap<String, Option<String>>,
    /// ENV values so far, as plain text (for substitution in later
    /// instructions).
    envs: BTreeMap<String, String>,
    from: Option<String>,
    steps: Vec<Step>,
    copies: Vec<CopyInput>,
    user_set: bool,
    workdir_set: bool,
    cmd: Option<Form>,
    entrypoint: Option<Form>,
    /// Some(None): `HEALTHCHECK NONE`.
    healthcheck: Option<Option<String>>,
    tcp_ports: Vec<u16>,
    shell_prefix: Option<String>,
}

impl Parser<'_> {
    fn instruction(&mut self, line: &Line) -> Result<(), DockerfileError> {
        let n = line.number;
        let (name, rest) = match line.text.split_once(char::is_whitespace) {
            Some((name, rest)) => (name, rest.trim()),
            None => (line.text.as_str(), ""),
        };
        let upper = name.to_ascii_uppercase();
        let err = |problem| Err(DockerfileError::at(n, problem));
        if self.from.is_none() && !matches!(upper.as_str(), "FROM" | "ARG") {
            return match KNOWN.contains(&upper.as_str()) {
                true => err(Problem::BeforeFrom(upper)),
                false => err(Problem::UnknownInstruction(name.to_string())),
            };
        }
        match upper.as_str() {
            "FROM" => self.from_(n, rest),
            "ARG" => self.arg(n, rest),
            "RUN" => self.run(n, rest),
            "COPY" => self.copy(n, rest, "COPY"),
            "ADD" => self.copy(n, rest, "ADD"),
            "ENV" => self.env(n, rest),
            "WORKDIR" => {
                let path = self.plain(n).one(&self.need(n, rest, "WORKDIR")?)?;
                self.workdir_set = true;
                self.steps.push(Step::Workdir { path, force: false });
                Ok(())
            }
            "USER" => {
                let name = self.plain(n).one(&self.need(n, rest, "USER")?)?;
                self.user_set = true;
                self.steps.push(Step::User { name, force: false });
                Ok(())
            }
            "CMD" => {
                self.cmd = Some(form(rest));
                Ok(())
            }
            "ENTRYPOINT" => {
                self.entrypoint = Some(form(rest));
                Ok(())
            }
            "EXPOSE" => self.expose(n, rest),
            "HEALTHCHECK" => self.healthcheck(n, rest),
            "SHELL" => self.shell(n, rest),
            "LABEL" | "MAINTAINER" | "STOPSIGNAL" | "VOLUME" => Ok(()),
            "ONBUILD" => err(Problem::Unsupported("ONBUILD".into())),
            _ => err(Problem::UnknownInstruction(name.to_string())),
        }
    }

    /// `rest`, or an error when the instruction has no argument.
    fn need(
        &self,
        n: usize,
        rest: &str,
        instruction: &'static str,
    ) -> Result<String, DockerfileError> {
        if rest.is_empty() {
            return Err(DockerfileError::at(
                n,
                Problem::Args {
                    instruction,
                    expected: "an argument",
                },
            ));
        }
        Ok(rest.to_string())
    }

    /// The value of variable `name` in the stage (ENV over ARG).
    fn value(&self, name: &str) -> Var {
        if let Some(v) = self.envs.get(name) {
            return Var::Value(v.clone());
        }
        match self.args.get(name) {
            Some(Some(v)) => Var::Value(v.clone()),
            _ => Var::Unset,
        }
    }

    /// Words with the stage's variables, plain text.
    fn plain(&self, line: usize) -> Words<'_> {
        Words {
            escape: self.escape,
            line,
            lookup: self,
            for_env: false,
        }
    }

    // The instructions: instructions.rs.

    /// The start command and its ready check, from CMD, ENTRYPOINT,
    /// HEALTHCHECK and EXPOSE.
    fn start(&self) -> Option<Start> {
        let cmd = match (&self.entrypoint, &self.cmd) {
            (Some(Form::Exec(entry)), cmd) => {
                let mut argv = entry.clone();
                match cmd {
                    Some(Form::Exec(args)) => argv.extend(args.iter().cloned()),
                    Some(Form::Shell(text)) if !text.is_empty() => {
                        argv.extend(["/bin/sh".to_string(), "-c".to_string(), text.clone()])
                    }
                    _ => {}
                }
                crate::shell::join(&argv)
            }
            (Some(Form::Shell(text)), _) => text.clone(),
            (None, Some(Form::Exec(argv))) => crate::shell::join(argv),
            (None, Some(Form::Shell(text))) => text.clone(),
            (None, None) => String::new(),
        };
        if cmd.trim().is_empty() {
            return None;
        }
        let ready = match &self.healthcheck {
            Some(Some(check)) => Some(ReadyCheck::Command { cmd: check.clone() }),
            Some(None) => None,
            None => match self.tcp_ports.as_slice() {
                [port] => Some(ReadyCheck::Port { port: *port }),
                _ => None,
            },
        };
        Some(Start {
            cmd: Some(cmd),
            ready,
        })
    }
}

/// The instructions this parser knows (for "before FROM" errors).
const KNOWN: [&str; 18] = [
    "FROM",
    "ARG",
    "RUN",
    "COPY",
    "ADD",
    "ENV",
    "WORKDIR",
    "USER",
    "CMD",
    "ENTRYPOINT",
    "EXPOSE",
    "HEALTHCHECK",
    "SHELL",
    "LABEL",
    "MAINTAINER",
    "STOPSIGNAL",
    "VOLUME",
    "ONBUILD",
];

impl Lookup for Parser<'_> {
    fn lookup(&self, name: &str) -> Var {
        self.value(name)
    }
}
