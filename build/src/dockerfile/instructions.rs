//! Each instruction's handling (`Parser`'s methods), and how their
//! arguments are read: exec or shell form, leading flags.

use std::collections::BTreeMap;

use super::lex::{has_heredoc, raw_words, Var, Words};
use super::{CopyInput, DockerfileError, Form, Parser, Problem};
use crate::env::literal;
use crate::spec::Step;
use crate::validate::{inside_context, valid_env_name};

impl Parser<'_> {
    pub(super) fn from_(&mut self, n: usize, rest: &str) -> Result<(), DockerfileError> {
        if self.from.is_some() {
            return Err(DockerfileError::at(n, Problem::MultiStage));
        }
        let (flags, rest) = flags(rest);
        for flag in flags {
            if !flag.starts_with("--platform=") {
                return Err(flag_error(n, "FROM", flag));
            }
        }
        let global = |name: &str| match self.global.get(name) {
            Some(Some(v)) => Var::Value(v.clone()),
            _ => Var::Unset,
        };
        let words = Words {
            escape: self.escape,
            line: n,
            lookup: &global,
            for_env: false,
        }
        .split(rest)?;
        let image = match words.as_slice() {
            [image] => image,
            [image, as_, _] if as_.eq_ignore_ascii_case("as") => image,
            _ => {
                return Err(DockerfileError::at(
                    n,
                    Problem::Args {
                        instruction: "FROM",
                        expected: "an image, and optionally AS name",
                    },
                ))
            }
        };
        if image.eq_ignore_ascii_case("scratch") {
            return Err(DockerfileError::at(n, Problem::Scratch));
        }
        self.from = Some(image.clone());
        Ok(())
    }

    pub(super) fn arg(&mut self, n: usize, rest: &str) -> Result<(), DockerfileError> {
        let words = raw_words(&self.need(n, rest, "ARG")?, self.escape);
        for word in words {
            let (name, default) = match word.split_once('=') {
                Some((name, d)) => (name.to_string(), Some(self.plain(n).one(d)?)),
                None => (word, None),
            };
            if !valid_env_name(&name) {
                return Err(DockerfileError::at(n, Problem::EnvName(name)));
            }
            let inherited = self.global.get(&name).cloned().flatten();
            let value = self
                .build_args
                .get(&name)
                .cloned()
                .or(default)
                .or(if self.from.is_some() { inherited } else { None });
            if self.from.is_some() {
                self.args.insert(name, value);
            } else {
                self.global.insert(name, value);
            }
        }
        Ok(())
    }

    pub(super) fn run(&mut self, n: usize, rest: &str) -> Result<(), DockerfileError> {
        let (flags, rest) = flags(rest);
        for flag in flags {
            let ignored = flag.starts_with("--network=")
                || flag.starts_with("--security=")
                || (flag.starts_with("--mount=") && flag.contains("type=cache"));
            if !ignored {
                return Err(flag_error(n, "RUN", flag));
            }
        }
        if has_heredoc(rest) {
            return Err(DockerfileError::at(n, Problem::Heredoc));
        }
        let mut cmd = match form(rest) {
            Form::Exec(argv) => crate::shell::join(&argv),
            Form::Shell(text) => text,
        };
        if cmd.trim().is_empty() {
            return Err(DockerfileError::at(
                n,
                Problem::Args {
                    instruction: "RUN",
                    expected: "a command",
                },
            ));
        }
        if let Some(prefix) = &self.shell_prefix {
            cmd = format!("{prefix}\n{cmd}");
        }
        let env = self
            .args
            .iter()
            .filter(|(name, _)| !self.envs.contains_key(*name))
            .filter_map(|(name, v)| v.as_ref().map(|v| (name.clone(), literal(v))))
            .collect();
        self.steps.push(Step::Run {
            cmd,
            user: None,
            env,
            force: false,
        });
        Ok(())
    }

    pub(super) fn copy(
        &mut self,
        n: usize,
        rest: &str,
        instruction: &'static str,
    ) -> Result<(), DockerfileError> {
        let (flags, rest) = flags(rest);
        let mut user = None;
        let mut mode = None;
        for flag in flags {
            let value = |prefix: &str| flag.strip_prefix(prefix).map(str::to_string);
            if let Some(v) = value("--chown=") {
                user = Some(self.plain(n).one(&v)?);
            } else if let Some(v) = value("--chmod=") {
                let v = self.plain(n).one(&v)?;
                let octal =
                    (3..=4).contains(&v.len()) && v.bytes().all(|b| (b'0'..=b'7').contains(&b));
                mode = Some(
                    u32::from_str_radix(&v, 8)
                        .ok()
                        .filter(|_| octal)
                        .ok_or_else(|| DockerfileError::at(n, Problem::Chmod(v.clone())))?,
                );
            } else if flag.starts_with("--from=") {
                return Err(DockerfileError::at(n, Problem::CopyFrom));
            } else if flag != "--link" && flag != "--link=true" {
                return Err(flag_error(n, instruction, flag));
            }
        }
        if has_heredoc(rest) {
            return Err(DockerfileError::at(n, Problem::Heredoc));
        }
        let words = match form(rest) {
            Form::Exec(words) => words
                .iter()
                .map(|w| self.plain(n).one(w))
                .collect::<Result<Vec<_>, _>>()?,
            Form::Shell(text) => self.plain(n).split(&text)?,
        };
        let Some((dest, srcs)) = words.split_last().filter(|(_, s)| !s.is_empty()) else {
            return Err(DockerfileError::at(
                n,
                Problem::Args {
                    instruction,
                    expected: "one or more sources and a destination",
                },
            ));
        };
        for src in srcs {
            if instruction == "ADD" {
                if is_remote(src) {
                    return Err(DockerfileError::at(n, Problem::RemoteAdd(src.clone())));
                }
                if is_archive(src) {
                    return Err(DockerfileError::at(n, Problem::AddArchive(src.clone())));
                }
            }
            if src.is_empty() || !inside_context(src) {
                return Err(DockerfileError::at(n, Problem::OutsideContext(src.clone())));
            }
            self.copies.push(CopyInput {
                step: self.steps.len(),
                src: src.clone(),
                line: n,
            });
            self.steps.push(Step::Copy {
                src: src.clone(),
                dest: dest.clone(),
                files_hash: String::new(),
                user: user.clone(),
                mode,
                force: false,
            });
        }
        Ok(())
    }

    pub(super) fn env(&mut self, n: usize, rest: &str) -> Result<(), DockerfileError> {
        let rest = self.need(n, rest, "ENV")?;
        let words = raw_words(&rest, self.escape);
        // ARGs now; anything else when the step runs.
        let args_only = |name: &str| match (self.envs.contains_key(name), self.args.get(name)) {
            (false, Some(Some(v))) => Var::Value(v.clone()),
            _ => Var::Keep,
        };
        let for_env = Words {
            escape: self.escape,
            line: n,
            lookup: &args_only,
            for_env: true,
        };
        let mut pairs = Vec::new();
        if words[0].contains('=') {
            for word in &words {
                let Some((name, value)) = word.split_once('=') else {
                    return Err(DockerfileError::at(
                        n,
                        Problem::Args {
                            instruction: "ENV",
                            expected: "name=value pairs",
                        },
                    ));
                };
                pairs.push((self.plain(n).one(name)?, for_env.one(value)?));
            }
        } else {
            let (name, value) = rest.split_once(char::is_whitespace).ok_or_else(|| {
                DockerfileError::at(
                    n,
                    Problem::Args {
                        instruction: "ENV",
                        expected: "name=value, or name and value",
                    },
                )
            })?;
            pairs.push((name.to_string(), for_env.one(value.trim())?));
        }
        let mut vars = BTreeMap::new();
        let before = self.envs.clone();
        for (name, value) in pairs {
            if !valid_env_name(&name) {
                return Err(DockerfileError::at(n, Problem::EnvName(name)));
            }
            self.envs
                .insert(name.clone(), crate::env::expand(&value, &before));
            vars.insert(name, value);
        }
        self.steps.push(Step::Env { vars, force: false });
        Ok(())
    }

    pub(super) fn expose(&mut self, n: usize, rest: &str) -> Result<(), DockerfileError> {
        for word in self.plain(n).split(rest)? {
            let (ports, proto) = word.split_once('/').unwrap_or((&word, "tcp"));
            let bad = || DockerfileError::at(n, Problem::Port(word.clone()));
            let port = |p: &str| p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(bad);
            let (lo, hi) = match ports.split_once('-') {
                Some((lo, hi)) => (port(lo)?, port(hi)?),
                None => (port(ports)?, port(ports)?),
            };
            if lo > hi || !matches!(proto.to_ascii_lowercase().as_str(), "tcp" | "udp" | "sctp") {
                return Err(bad());
            }
            if proto.eq_ignore_ascii_case("tcp") {
                self.tcp_ports.extend(lo..=hi);
            }
        }
        Ok(())
    }

    pub(super) fn healthcheck(&mut self, n: usize, rest: &str) -> Result<(), DockerfileError> {
        let (_options, rest) = flags(rest);
        let (word, cmd) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        self.healthcheck = match word.to_ascii_uppercase().as_str() {
            "NONE" => Some(None),
            "CMD" if !cmd.trim().is_empty() => Some(Some(match form(cmd.trim()) {
                Form::Exec(argv) => crate::shell::join(&argv),
                Form::Shell(text) => text,
            })),
            _ => {
                return Err(DockerfileError::at(
                    n,
                    Problem::Args {
                        instruction: "HEALTHCHECK",
                        expected: "NONE, or [options] CMD command",
                    },
                ))
            }
        };
        Ok(())
    }

    pub(super) fn shell(&mut self, n: usize, rest: &str) -> Result<(), DockerfileError> {
        let unsupported = || DockerfileError::at(n, Problem::Unsupported(format!("SHELL {rest}")));
        let Form::Exec(argv) = form(rest) else {
            return Err(unsupported());
        };
        let program = argv.first().map(|p| p.rsplit('/').next().unwrap_or(p));
        if !matches!(program, Some("bash" | "sh" | "dash"))
            || argv.last().map(String::as_str) != Some("-c")
        {
            return Err(unsupported());
        }
        let options = &argv[1..argv.len() - 1];
        self.shell_prefix =
            (!options.is_empty()).then(|| format!("set {}", crate::shell::join(options)));
        Ok(())
    }
}

/// `rest` as CMD, ENTRYPOINT, RUN or SHELL read it: a JSON array of
/// strings (exec form), else the text (shell form).
pub(super) fn form(rest: &str) -> Form {
    let trimmed = rest.trim();
    if trimmed.starts_with('[') {
        if let Ok(argv) = serde_json::from_str::<Vec<String>>(trimmed) {
            return Form::Exec(argv);
        }
    }
    Form::Shell(trimmed.to_string())
}

/// The leading `--flag[=value]` words of `rest`, and what follows them.
fn flags(rest: &str) -> (Vec<&str>, &str) {
    let mut flags = Vec::new();
    let mut rest = rest.trim_start();
    while rest.starts_with("--") {
        let (flag, after) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        flags.push(flag);
        rest = after.trim_start();
    }
    (flags, rest)
}

fn flag_error(line: usize, instruction: &'static str, flag: &str) -> DockerfileError {
    DockerfileError::at(
        line,
        Problem::Flag {
            instruction,
            flag: flag.to_string(),
        },
    )
}

/// A URL (`scheme://`) or a git remote (`git@host:path`).
fn is_remote(src: &str) -> bool {
    let scheme = src.split_once("://").is_some_and(|(s, _)| {
        s.starts_with(|c: char| c.is_ascii_alphabetic())
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+.-".contains(&b))
    });
    scheme || src.starts_with("git@")
}

/// A local archive that Docker's ADD unpacks.
fn is_archive(src: &str) -> bool {
    let lower = src.to_ascii_lowercase();
    [
        ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tbz", ".tar.xz", ".txz", ".tar.zst",
        ".tzst",
    ]
    .iter()
    .any(|ext| lower.ends_with(ext))
}
