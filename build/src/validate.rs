//! The checks of a [`BuildSpec`] that need no guest
//! ([`BuildSpec::validate`]), and their errors: [`SpecError`] says where
//! (the source, a step by index and type, the start), [`Invalid`] what.

use std::collections::BTreeMap;

use crate::ready::ReadyCheck;
use crate::spec::{
    BuildSpec, Source, Start, Step, MAX_FIELD_BYTES, MAX_READY_DELAY_MS, MAX_STEPS, MIN_MEMORY_MIB,
};

/// A spec that cannot be built, and where.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    /// More than [`MAX_STEPS`].
    #[error("{count} steps: at most {max}")]
    TooManySteps {
        /// The steps given.
        count: usize,
        /// [`MAX_STEPS`].
        max: usize,
    },
    /// In `from`.
    #[error("from: {0}")]
    Source(Invalid),
    /// In a step.
    #[error("step {index} ({kind}): {problem}")]
    Step {
        /// Its index, from 0.
        index: usize,
        /// Its type.
        kind: &'static str,
        /// What is wrong.
        problem: Invalid,
    },
    /// In `start`.
    #[error("start: {0}")]
    Start(Invalid),
    /// `cpu_count: 0`.
    #[error("cpu_count 0: at least 1")]
    NoCpus,
    /// Less than [`MIN_MEMORY_MIB`].
    #[error("memory_mib {0}: at least {MIN_MEMORY_MIB}")]
    TooLittleMemory(u32),
}

/// What is wrong with one field.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Invalid {
    /// Empty, or only whitespace.
    #[error("{field} is empty")]
    Empty {
        /// The field.
        field: &'static str,
    },
    /// Holds a NUL byte.
    #[error("{field} contains a NUL byte")]
    Nul {
        /// The field.
        field: &'static str,
    },
    /// A name or reference with whitespace in it.
    #[error("{field} {value:?} contains whitespace")]
    Whitespace {
        /// The field.
        field: &'static str,
        /// The value.
        value: String,
    },
    /// Longer than [`MAX_FIELD_BYTES`].
    #[error("{field} is {len} bytes: at most {max}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// [`MAX_FIELD_BYTES`].
        max: usize,
    },
    /// Must be absolute.
    #[error("{field} {value:?} is not an absolute path")]
    NotAbsolute {
        /// The field.
        field: &'static str,
        /// The path.
        value: String,
    },
    /// Must be relative to the build context, and stay in it.
    #[error(
        "{field} {value:?} is not a path inside the build context (relative, no `..` above it)"
    )]
    OutsideContext {
        /// The field.
        field: &'static str,
        /// The path.
        value: String,
    },
    /// Not a lowercase hex SHA-256.
    #[error("{field} {value:?} is not a lowercase hex SHA-256 (64 characters)")]
    Hash {
        /// The field.
        field: &'static str,
        /// The value.
        value: String,
    },
    /// Not `[A-Za-z_][A-Za-z0-9_]*`.
    #[error("{name:?} is not an environment variable name (letters, digits, `_`, not starting with a digit)")]
    EnvName {
        /// The name.
        name: String,
    },
    /// An ENV step with no variables.
    #[error("no variables")]
    NoVars,
    /// Not `user` or `user:group` of names or numbers.
    #[error("{value:?} is not a user (`name`, `uid`, `name:group`)")]
    User {
        /// The value.
        value: String,
    },
    /// A mode above `0o7777`.
    #[error("mode {mode:#o} is not a file mode (at most 0o7777)")]
    Mode {
        /// The mode.
        mode: u32,
    },
    /// Port 0.
    #[error("port 0: 1 to 65535")]
    PortZero,
    /// Not `http://` or `https://`.
    #[error("url {url:?} is not an http:// or https:// URL")]
    Url {
        /// The URL.
        url: String,
    },
    /// A status outside 100..=599.
    #[error("status {status}: 100 to 599")]
    Status {
        /// The status.
        status: u16,
    },
    /// A delay of 0 or above [`MAX_READY_DELAY_MS`].
    #[error("delay {ms} ms: 1 to {MAX_READY_DELAY_MS}")]
    Delay {
        /// The delay.
        ms: u64,
    },
    /// A start with neither a command nor a check.
    #[error("neither a command nor a ready check")]
    NothingToStart,
    /// A username without its password, or the reverse.
    #[error("username and password go together")]
    Credentials,
}

impl BuildSpec {
    /// Every check that needs no guest: the first problem found.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.steps.len() > MAX_STEPS {
            return Err(SpecError::TooManySteps {
                count: self.steps.len(),
                max: MAX_STEPS,
            });
        }
        validate_source(&self.from).map_err(SpecError::Source)?;
        for (index, step) in self.steps.iter().enumerate() {
            validate_step(step).map_err(|problem| SpecError::Step {
                index,
                kind: step.kind(),
                problem,
            })?;
        }
        if let Some(start) = &self.start {
            validate_start(start).map_err(SpecError::Start)?;
        }
        if self.cpu_count == Some(0) {
            return Err(SpecError::NoCpus);
        }
        match self.memory_mib {
            Some(m) if m < MIN_MEMORY_MIB => Err(SpecError::TooLittleMemory(m)),
            _ => Ok(()),
        }
    }
}

/// `value` is non-empty, NUL-free and at most [`MAX_FIELD_BYTES`].
pub(crate) fn text(field: &'static str, value: &str) -> Result<(), Invalid> {
    if value.trim().is_empty() {
        return Err(Invalid::Empty { field });
    }
    any_text(field, value)
}

/// `value` is NUL-free and at most [`MAX_FIELD_BYTES`] (may be empty).
fn any_text(field: &'static str, value: &str) -> Result<(), Invalid> {
    if value.contains('\0') {
        return Err(Invalid::Nul { field });
    }
    if value.len() > MAX_FIELD_BYTES {
        return Err(Invalid::TooLong {
            field,
            len: value.len(),
            max: MAX_FIELD_BYTES,
        });
    }
    Ok(())
}

/// `value` is a lowercase hex SHA-256.
pub(crate) fn hash(field: &'static str, value: &str) -> Result<(), Invalid> {
    let ok = value.len() == 64
        && value
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if ok {
        Ok(())
    } else {
        Err(Invalid::Hash {
            field,
            value: value.to_string(),
        })
    }
}

/// `name` is a POSIX environment variable name.
pub fn valid_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b'A'..=b'Z' | b'a'..=b'z' | b'_'))
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// `value` is `user` or `user:group`, each a name (`[A-Za-z_][A-Za-z0-9_.-]*`,
/// an optional trailing `$`) or a number.
pub fn valid_user(value: &str) -> bool {
    fn part(p: &str) -> bool {
        if !p.is_empty() && p.len() <= 64 && p.bytes().all(|b| b.is_ascii_digit()) {
            return true;
        }
        let p = p.strip_suffix('$').unwrap_or(p);
        let mut bytes = p.bytes();
        p.len() <= 64
            && matches!(bytes.next(), Some(b'A'..=b'Z' | b'a'..=b'z' | b'_'))
            && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    }
    match value.split_once(':') {
        Some((user, group)) => part(user) && part(group),
        None => part(value),
    }
}

/// `src` is relative and stays inside the build context once `.` and `..`
/// are resolved.
pub(crate) fn inside_context(src: &str) -> bool {
    if src.starts_with('/') {
        return false;
    }
    let mut depth: usize = 0;
    for part in src.split('/') {
        match part {
            "" | "." => {}
            ".." => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return false,
            },
            _ => depth += 1,
        }
    }
    true
}

/// `value` is [`text`] without whitespace.
fn word(field: &'static str, value: &str) -> Result<(), Invalid> {
    text(field, value)?;
    if value.chars().any(char::is_whitespace) {
        return Err(Invalid::Whitespace {
            field,
            value: value.to_string(),
        });
    }
    Ok(())
}

fn user(value: &str) -> Result<(), Invalid> {
    if valid_user(value) {
        Ok(())
    } else {
        Err(Invalid::User {
            value: value.to_string(),
        })
    }
}

fn env_vars(vars: &BTreeMap<String, String>) -> Result<(), Invalid> {
    for (name, value) in vars {
        if !valid_env_name(name) {
            return Err(Invalid::EnvName { name: name.clone() });
        }
        any_text("value", value)?;
    }
    Ok(())
}

fn validate_source(source: &Source) -> Result<(), Invalid> {
    match source {
        Source::Template { name } => word("name", name),
        Source::Image {
            reference,
            username,
            password,
        } => {
            word("reference", reference)?;
            if username.is_some() != password.is_some() {
                return Err(Invalid::Credentials);
            }
            if let Some(u) = username {
                text("username", u)?;
            }
            if let Some(p) = password {
                text("password", p.expose())?;
            }
            Ok(())
        }
        Source::Upload { hash: h } => hash("hash", h),
    }
}

fn validate_step(step: &Step) -> Result<(), Invalid> {
    match step {
        Step::Run {
            cmd, user: u, env, ..
        } => {
            text("cmd", cmd)?;
            if let Some(u) = u {
                user(u)?;
            }
            env_vars(env)
        }
        Step::Copy {
            src,
            dest,
            files_hash,
            user: u,
            mode,
            ..
        } => {
            text("src", src)?;
            if !inside_context(src) {
                return Err(Invalid::OutsideContext {
                    field: "src",
                    value: src.clone(),
                });
            }
            text("dest", dest)?;
            hash("files_hash", files_hash)?;
            if let Some(u) = u {
                user(u)?;
            }
            match mode {
                Some(mode) if *mode > 0o7777 => Err(Invalid::Mode { mode: *mode }),
                _ => Ok(()),
            }
        }
        Step::Env { vars, .. } => {
            if vars.is_empty() {
                return Err(Invalid::NoVars);
            }
            env_vars(vars)
        }
        Step::Workdir { path, .. } => text("path", path),
        Step::User { name, .. } => user(name),
    }
}

fn validate_start(start: &Start) -> Result<(), Invalid> {
    if start.cmd.is_none() && start.ready.is_none() {
        return Err(Invalid::NothingToStart);
    }
    if let Some(cmd) = &start.cmd {
        text("cmd", cmd)?;
    }
    match &start.ready {
        None => Ok(()),
        Some(ReadyCheck::Port { port: 0 }) => Err(Invalid::PortZero),
        Some(ReadyCheck::Port { .. }) => Ok(()),
        Some(ReadyCheck::Url { url, status }) => {
            text("url", url)?;
            let scheme_ok = ["http://", "https://"]
                .iter()
                .any(|s| url.len() > s.len() && url[..s.len()].eq_ignore_ascii_case(s));
            if !scheme_ok || url.chars().any(char::is_whitespace) {
                return Err(Invalid::Url { url: url.clone() });
            }
            match status {
                Some(s) if !(100..=599).contains(s) => Err(Invalid::Status { status: *s }),
                _ => Ok(()),
            }
        }
        Some(ReadyCheck::File { path }) => {
            text("path", path)?;
            if path.starts_with('/') {
                Ok(())
            } else {
                Err(Invalid::NotAbsolute {
                    field: "path",
                    value: path.clone(),
                })
            }
        }
        Some(ReadyCheck::Process { name }) => text("name", name),
        Some(ReadyCheck::Command { cmd }) => text("cmd", cmd),
        Some(ReadyCheck::Delay { ms }) => {
            if *ms == 0 || *ms > MAX_READY_DELAY_MS {
                Err(Invalid::Delay { ms: *ms })
            } else {
                Ok(())
            }
        }
    }
}
