//! The state a build's steps are folded through ([`Environment`]: the
//! current user, working directory and variables, as E2B's template
//! manager keeps them), and what the executor runs in the guest for a
//! step: a [`GuestCommand`] for RUN, the start command and the ready
//! check, a [`CopyPlan`] for COPY.
//!
//! E2B's behaviour, which these follow: every command is
//! `/bin/bash -l -c CMD` with the user, directory and variables of the
//! step; a RUN's own user is for that step only; ENV values are expanded
//! when the ENV step runs; WORKDIR and USER change the later steps (the
//! executor creates a missing directory, owned by the current user, and a
//! missing user with `useradd --create-home --shell /bin/bash`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::spec::{Start, Step};

/// The user of a build's first step from an image (E2B creates `user`,
/// with passwordless sudo, before the steps) and of `base`.
pub const DEFAULT_USER: &str = "user";

/// What E2B appends to a `PATH` that a build sets, so that the usual tools
/// stay found.
pub const PATH_TAIL: &str = ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The current user, directory and variables between steps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Environment {
    /// Who later commands run as: `user` or `user:group`.
    pub user: String,
    /// Where later commands run; None: the user's home.
    pub workdir: Option<String>,
    /// The variables the build set (not the guest's own).
    pub env: BTreeMap<String, String>,
}

impl Default for Environment {
    /// [`DEFAULT_USER`] in its home, no variables: E2B's state before the
    /// first step of a build from an image.
    fn default() -> Environment {
        Environment {
            user: DEFAULT_USER.to_string(),
            workdir: None,
            env: BTreeMap::new(),
        }
    }
}

/// A command for the guest: argv, as whom, where, with what variables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestCommand {
    /// `["/bin/bash", "-l", "-c", script]`.
    pub argv: Vec<String>,
    /// `user` or `user:group`.
    pub user: String,
    /// The directory; None: the user's home.
    pub cwd: Option<String>,
    /// Variables over the guest's own (`PATH` with [`PATH_TAIL`]).
    pub env: BTreeMap<String, String>,
}

/// What a COPY step does in the guest, as E2B's template manager does it:
/// the archive (`files_hash`) is unpacked as root into an empty directory;
/// the entry at `archive_path` in it is given `owner` (and `mode`, to every
/// file and directory under it) and then put at `dest`:
/// - a directory: its contents merged into `dest` (created), existing
///   directories kept and files overwritten;
/// - a file or symlink: moved to `dest`, or into it under its own name
///   when `dest` ends with `/` (parents created).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyPlan {
    /// The entry of the archive to put: the source's path before its
    /// first glob character (`app/src` for `app/src/*.py`), `.` for the
    /// archive's root.
    pub archive_path: String,
    /// Where, as given: relative paths are from `cwd`.
    pub dest: String,
    /// The working directory; None: the current user's home.
    pub cwd: Option<String>,
    /// `user:group` (a user alone owns with its same-named group).
    pub owner: String,
    /// Permissions for every copied entry.
    pub mode: Option<u32>,
}

impl Environment {
    /// The state after `step`: ENV sets its variables (each value expanded
    /// against the variables before the step, [`expand`]), WORKDIR the
    /// directory (a relative one from the current one, or `/`, cleaned),
    /// USER the user. RUN and COPY change nothing.
    pub fn apply(&mut self, step: &Step) {
        match step {
            Step::Env { vars, .. } => {
                let expanded: Vec<(String, String)> = vars
                    .iter()
                    .map(|(k, v)| (k.clone(), expand(v, &self.env)))
                    .collect();
                self.env.extend(expanded);
            }
            Step::Workdir { path, .. } => {
                let base = self.workdir.as_deref().unwrap_or("/");
                self.workdir = Some(resolve(base, path));
            }
            Step::User { name, .. } => self.user = name.clone(),
            Step::Run { .. } | Step::Copy { .. } => {}
        }
    }

    /// `script` run now: as the current user, in the current directory,
    /// with the build's variables.
    pub fn command(&self, script: &str) -> GuestCommand {
        let mut env = self.env.clone();
        if let Some(path) = env.get_mut("PATH") {
            path.push_str(PATH_TAIL);
        }
        GuestCommand {
            argv: ["/bin/bash", "-l", "-c", script].map(String::from).to_vec(),
            user: self.user.clone(),
            cwd: self.workdir.clone(),
            env,
        }
    }

    /// What a RUN step runs (None for other steps): its command, as its
    /// own user if it has one, with its own variables over the build's.
    pub fn run(&self, step: &Step) -> Option<GuestCommand> {
        let Step::Run { cmd, user, env, .. } = step else {
            return None;
        };
        let mut this = self.clone();
        if let Some(user) = user {
            this.user = user.clone();
        }
        let own: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.clone(), expand(v, &self.env)))
            .collect();
        this.env.extend(own);
        Some(this.command(cmd))
    }

    /// What a COPY step does (None for other steps).
    pub fn copy(&self, step: &Step) -> Option<CopyPlan> {
        let Step::Copy {
            src,
            dest,
            user,
            mode,
            ..
        } = step
        else {
            return None;
        };
        let owner = user.as_deref().unwrap_or(&self.user);
        let owner = if owner.contains(':') {
            owner.to_string()
        } else {
            format!("{owner}:{owner}")
        };
        Some(CopyPlan {
            archive_path: archive_path(src),
            dest: dest.clone(),
            cwd: self.workdir.clone(),
            owner,
            mode: *mode,
        })
    }

    /// The start command, started in the background and left running
    /// (None when the start has no command).
    pub fn start(&self, start: &Start) -> Option<GuestCommand> {
        start.cmd.as_deref().map(|cmd| self.command(cmd))
    }

    /// The ready check, run until it exits 0 ([`Start::ready_check`]).
    pub fn ready(&self, start: &Start) -> GuestCommand {
        self.command(&start.ready_check().command())
    }
}

/// `path` from `base`, cleaned (`.` and `..` resolved, `..` stopping at
/// `/`): always absolute.
pub fn resolve(base: &str, path: &str) -> String {
    let joined = if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{base}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

/// The entry of a COPY archive that `src` names: its path up to the last
/// `/` before its first glob character (`*?[{\`), cleaned; `.` for the
/// archive's root. E2B's `doublestar.SplitPattern(src + "/")`.
pub fn archive_path(src: &str) -> String {
    let with_slash = if src.ends_with('/') {
        src.to_string()
    } else {
        format!("{src}/")
    };
    let base = match with_slash.find(['*', '?', '[', '{', '\\']) {
        Some(meta) => match with_slash[..meta].rfind('/') {
            Some(slash) => &with_slash[..slash],
            None => "",
        },
        None => &with_slash[..with_slash.len() - 1],
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in base.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    if parts.is_empty() {
        ".".to_string()
    } else {
        parts.join("/")
    }
}

/// `value` written so that [`expand`] gives it back unchanged (`\` and `$`
/// escaped).
pub fn literal(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if c == '\\' || c == '$' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `value` with its variables replaced from `vars`: `$NAME`, `${NAME}`,
/// `${NAME:-word}` (word if unset or empty), `${NAME-word}` (if unset),
/// `${NAME:+word}` (word if set and not empty), `${NAME+word}` (if set);
/// an unset variable is empty; a backslash takes the next character
/// literally; anything else (`$(`, `$1`, a `${` left open) is literal.
pub fn expand(value: &str, vars: &BTreeMap<String, String>) -> String {
    let chars: Vec<char> = value.chars().collect();
    let mut out = String::with_capacity(value.len());
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '\\' if i + 1 < chars.len() => {
                out.push(chars[i + 1]);
                i += 2;
            }
            '$' => match substitution(&chars, i, vars) {
                Some((text, next)) => {
                    out.push_str(&text);
                    i = next;
                }
                None => {
                    out.push('$');
                    i += 1;
                }
            },
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

fn name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The substitution at `chars[at] == '$'`: its text and the index past it.
fn substitution(
    chars: &[char],
    at: usize,
    vars: &BTreeMap<String, String>,
) -> Option<(String, usize)> {
    let mut i = at + 1;
    if chars.get(i).copied().is_some_and(name_start) {
        let start = i;
        while chars.get(i).copied().is_some_and(name_char) {
            i += 1;
        }
        let name: String = chars[start..i].iter().collect();
        return Some((vars.get(&name).cloned().unwrap_or_default(), i));
    }
    if chars.get(i) != Some(&'{') {
        return None;
    }
    i += 1;
    let start = i;
    if !chars.get(i).copied().is_some_and(name_start) {
        return None;
    }
    while chars.get(i).copied().is_some_and(name_char) {
        i += 1;
    }
    let name: String = chars[start..i].iter().collect();
    let value = vars.get(&name);
    if chars.get(i) == Some(&'}') {
        return Some((value.cloned().unwrap_or_default(), i + 1));
    }
    let colon = chars.get(i) == Some(&':');
    if colon {
        i += 1;
    }
    let op = *chars.get(i)?;
    if op != '-' && op != '+' {
        return None;
    }
    i += 1;
    // The word: up to the matching `}`, escapes and nested `${` skipped.
    let word_start = i;
    let mut depth = 0;
    loop {
        match chars.get(i)? {
            '\\' => i += 2,
            '$' if chars.get(i + 1) == Some(&'{') => {
                depth += 1;
                i += 2;
            }
            '}' if depth == 0 => break,
            '}' => {
                depth -= 1;
                i += 1;
            }
            _ => i += 1,
        }
    }
    let word: String = chars[word_start..i.min(chars.len())].iter().collect();
    let set = value.is_some();
    let set_nonempty = value.is_some_and(|v| !v.is_empty());
    let use_value_test = if colon { set_nonempty } else { set };
    let text = match op {
        '-' if use_value_test => value.cloned().unwrap_or_default(),
        '-' => expand(&word, vars),
        _ if use_value_test => expand(&word, vars),
        _ => String::new(),
    };
    Some((text, i + 1))
}
