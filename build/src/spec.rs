//! The build spec: what a template is built from ([`Source`]), the steps
//! run on it ([`Step`]), and the command left running in its snapshot
//! ([`Start`]). It is the body of `POST /v1/templates/builds` (serde JSON,
//! tagged by `type`, unknown fields refused); E2B's build body
//! (`crate::e2b`) and Dockerfiles (`crate::dockerfile`) both become one.
//!
//! [`BuildSpec::validate`] (`crate::validate`) checks everything that can
//! be checked without the guest, each error naming the step and field.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ready::ReadyCheck;

/// At most this many steps in one build.
pub const MAX_STEPS: usize = 256;

/// At most this many bytes in one string of a spec (a command, a path, an
/// environment value).
pub const MAX_FIELD_BYTES: usize = 128 * 1024;

/// At most this long a [`ReadyCheck::Delay`] (E2B's ready timeout).
pub const MAX_READY_DELAY_MS: u64 = 10 * 60 * 1000;

/// At least this much memory for a template's sandbox.
pub const MIN_MEMORY_MIB: u32 = 128;

/// A credential: serialized as its text, never printed.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// A secret holding `text`.
    pub fn new(text: impl Into<String>) -> Secret {
        Secret(text.into())
    }

    /// The text, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// A template build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BuildSpec {
    /// What the first layer is.
    pub from: Source,
    /// Run in order on it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<Step>,
    /// Left running in the template's snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<Start>,
    /// Build every layer anew (the source pulled again, no step served
    /// from the cache); E2B's top-level `force`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub skip_cache: bool,
    /// vCPUs of the template's sandboxes (the service's default if absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_count: Option<u32>,
    /// Memory of the template's sandboxes, MiB (the service's default if
    /// absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
}

impl BuildSpec {
    /// The spec without the registry's username and password: what may be
    /// stored with the build or shown (its cache keys never hold them).
    pub fn without_credentials(&self) -> BuildSpec {
        let mut spec = self.clone();
        if let Source::Image {
            username, password, ..
        } = &mut spec.from
        {
            *username = None;
            *password = None;
        }
        spec
    }
}

fn is_false(b: &bool) -> bool {
    !b
}

/// What a build starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Source {
    /// An existing template (`base`, or `name:tag`).
    Template {
        /// Its name or id, with a tag if any.
        name: String,
    },
    /// An OCI image from a registry.
    Image {
        /// `[registry/]repository[:tag][@digest]`.
        reference: String,
        /// The registry's user, with `password`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        username: Option<String>,
        /// The registry's password or token, with `username`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        password: Option<Secret>,
    },
    /// An OCI layout or `docker save` tarball uploaded by its hash.
    Upload {
        /// Lowercase hex SHA-256 of the upload.
        hash: String,
    },
}

/// One build step. `force` makes this step and every one after it skip
/// the cache (E2B's `skip_cache()` before a step).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Step {
    /// A shell command: `/bin/bash -l -c cmd`.
    Run {
        /// The script.
        cmd: String,
        /// Run as this user instead of the current one (this step only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// Variables for this step only, over the build's environment (a
        /// Dockerfile's `ARG`s); the same syntax as [`Step::Env`].
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        env: BTreeMap<String, String>,
        /// Skip the cache from here on.
        #[serde(default, skip_serializing_if = "is_false")]
        force: bool,
    },
    /// Files uploaded once (a gzip'd tar, `crate::context`) put at `dest`.
    Copy {
        /// The path or glob in the build context, relative; the archive's
        /// entries are named from the context's root.
        src: String,
        /// Where in the guest; relative to the working directory (the
        /// user's home when none is set). A trailing `/` puts a file in
        /// that directory under its own name.
        dest: String,
        /// Lowercase hex SHA-256 naming the upload (empty while a parsed
        /// Dockerfile's context is not packed yet).
        files_hash: String,
        /// Owner, `user` or `user:group` (default: the current user).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<String>,
        /// Permissions given to every copied file and directory.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mode: Option<u32>,
        /// Skip the cache from here on.
        #[serde(default, skip_serializing_if = "is_false")]
        force: bool,
    },
    /// Environment variables for every later step and the start command.
    /// `$NAME`, `${NAME}`, `${NAME:-word}`, `${NAME-word}`,
    /// `${NAME:+word}` and `${NAME+word}` in a value are the variables
    /// before this step; a backslash takes the next character literally.
    Env {
        /// Name to value.
        vars: BTreeMap<String, String>,
        /// Skip the cache from here on.
        #[serde(default, skip_serializing_if = "is_false")]
        force: bool,
    },
    /// The working directory of later steps (relative: to the current
    /// one, or `/`); created, owned by the current user, if missing.
    Workdir {
        /// The directory.
        path: String,
        /// Skip the cache from here on.
        #[serde(default, skip_serializing_if = "is_false")]
        force: bool,
    },
    /// The user of later steps and the start command; created if missing.
    User {
        /// `user` or `user:group`, by name or number.
        name: String,
        /// Skip the cache from here on.
        #[serde(default, skip_serializing_if = "is_false")]
        force: bool,
    },
}

impl Step {
    /// Whether the cache is skipped from this step on.
    pub fn force(&self) -> bool {
        match self {
            Step::Run { force, .. }
            | Step::Copy { force, .. }
            | Step::Env { force, .. }
            | Step::Workdir { force, .. }
            | Step::User { force, .. } => *force,
        }
    }

    /// The step's `type`: `run`, `copy`, `env`, `workdir`, `user`.
    pub fn kind(&self) -> &'static str {
        match self {
            Step::Run { .. } => "run",
            Step::Copy { .. } => "copy",
            Step::Env { .. } => "env",
            Step::Workdir { .. } => "workdir",
            Step::User { .. } => "user",
        }
    }
}

/// The command started once the steps are done, and when it is ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Start {
    /// Started in the background (`/bin/bash -l -c`) as the last step's
    /// user, directory and environment. None: only the check is waited
    /// for (E2B's `set_ready_cmd` alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    /// When to snapshot. None: [`Start::ready_check`] says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<ReadyCheck>,
}

/// E2B's wait when a start command has no ready check (its template
/// manager's `sleep 20`).
pub const DEFAULT_READY_DELAY_MS: u64 = 20_000;

impl Start {
    /// The check the executor waits for: the one given; else, with a
    /// command, [`DEFAULT_READY_DELAY_MS`] (as E2B); else none to wait for
    /// (a zero delay).
    pub fn ready_check(&self) -> ReadyCheck {
        match (&self.ready, &self.cmd) {
            (Some(check), _) => check.clone(),
            (None, Some(_)) => ReadyCheck::Delay {
                ms: DEFAULT_READY_DELAY_MS,
            },
            (None, None) => ReadyCheck::Delay { ms: 0 },
        }
    }
}
