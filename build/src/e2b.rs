//! E2B's build body, `TemplateBuildStartV2` (`POST
//! /v2/templates/{templateID}/builds/{buildID}`), as its SDKs send it
//! (Python 2.63.0 `Template._serialize`, JS 2.51.0 `serialize`: the same
//! JSON), and its conversion into a [`BuildSpec`].
//!
//! The wire form, per step (`type` read case-insensitively, as E2B's
//! template manager does):
//! - `RUN`: `args = [cmd]` or `[cmd, user]` (the user for that step only;
//!   `run_cmd(["a", "b"])` arrives joined as `a && b`; `apt_install`,
//!   `pip_install`, `npm_install`, `git_clone`, `remove`, `rename`,
//!   `make_dir`, `make_symlink` all arrive as RUN);
//! - `COPY`: `args = [src, dest, user, mode]`, user `""` for the current
//!   one, mode `""` or 4-digit octal (`"0755"`); `filesHash` names the
//!   upload (the SDK's own hash of the files, not the archive's);
//! - `ENV`: `args = [k1, v1, k2, v2, ...]` (values expanded in the guest
//!   when the step runs: `$VAR` is, a backslash is literal);
//! - `WORKDIR`: `args = [path]`; `USER`: `args = [name]`.
//!
//! `force` on a step: that step and every later one skip the cache (the
//! SDK's `skip_cache()` marks all following steps itself). Top-level
//! `force`: the whole build skips it (`skip_cache=True` of `build`).
//! `fromImage` or `fromTemplate` (exactly one), `fromImageRegistry`
//! `{type: registry, username, password}` (aws and gcp are refused here),
//! `startCmd`, `readyCmd` (a shell command; E2B runs `sleep 20` when a
//! start command has none). Steps also carry `forceUpload` (and from JS
//! `resolveSymlinks`, `gzip`): upload concerns, ignored here, as are
//! unknown fields (E2B's server ignores them too).

use serde::{Deserialize, Serialize};

use crate::ready::ReadyCheck;
use crate::spec::{BuildSpec, Secret, Source, Start, Step};
use crate::validate::SpecError;

/// `TemplateBuildStartV2`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuildStartV2 {
    /// An image reference (`e2bdev/base` when the SDK was given none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_image: Option<String>,
    /// A template's name or id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_template: Option<String>,
    /// Credentials for `fromImage`'s registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_image_registry: Option<RegistryConfig>,
    /// Build everything anew.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force: Option<bool>,
    /// The steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<TemplateStep>>,
    /// Started after the steps, left running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    /// Run until it exits 0, then the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
}

/// `TemplateStep`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateStep {
    /// `RUN`, `COPY`, `ENV`, `WORKDIR` or `USER`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The arguments, by type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Vec<String>>,
    /// COPY: the upload's name (lowercase hex SHA-256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files_hash: Option<String>,
    /// Skip the cache from here on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force: Option<bool>,
    /// COPY: upload even if the server has the files (client side only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force_upload: Option<bool>,
    /// COPY (JS SDK): whether the client followed symlinks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolve_symlinks: Option<bool>,
    /// COPY (JS SDK): whether the client gzip'd the upload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gzip: Option<bool>,
}

/// `fromImageRegistry`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "lowercase",
    rename_all_fields = "camelCase"
)]
pub enum RegistryConfig {
    /// Basic authentication to any registry.
    Registry {
        /// The user.
        username: String,
        /// The password or token.
        password: Secret,
    },
    /// AWS ECR (not supported here).
    Aws {
        /// `awsAccessKeyId`.
        aws_access_key_id: String,
        /// `awsSecretAccessKey`.
        aws_secret_access_key: Secret,
        /// `awsRegion`.
        aws_region: String,
    },
    /// Google Artifact or Container Registry (not supported here).
    Gcp {
        /// `serviceAccountJson`.
        service_account_json: Secret,
    },
}

/// An E2B build body that cannot become a spec.
#[derive(Debug, thiserror::Error)]
pub enum E2bError {
    /// Not JSON of the body's shape.
    #[error("invalid build body: {0}")]
    Json(#[from] serde_json::Error),
    /// Neither `fromImage` nor `fromTemplate`.
    #[error("neither fromImage nor fromTemplate is given")]
    NoSource,
    /// Both `fromImage` and `fromTemplate`.
    #[error("both fromImage and fromTemplate are given: exactly one")]
    BothSources,
    /// `fromImageRegistry` of type `aws` or `gcp`.
    #[error("fromImageRegistry of type {kind} is not supported: use type registry (username and password)")]
    UnsupportedRegistry {
        /// `aws` or `gcp`.
        kind: &'static str,
    },
    /// A step type other than the five.
    #[error("step {index}: unknown type {kind:?} (RUN, COPY, ENV, WORKDIR or USER)")]
    UnknownStep {
        /// Its index, from 0.
        index: usize,
        /// The type as sent.
        kind: String,
    },
    /// A step with the wrong number of arguments.
    #[error("step {index} ({kind}): {count} args, expected {expected}")]
    Args {
        /// Its index, from 0.
        index: usize,
        /// Its type.
        kind: &'static str,
        /// How many were sent.
        count: usize,
        /// How many it takes.
        expected: &'static str,
    },
    /// A COPY without `filesHash`.
    #[error("step {index} (COPY): no filesHash")]
    NoFilesHash {
        /// Its index, from 0.
        index: usize,
    },
    /// A COPY mode that is not octal.
    #[error("step {index} (COPY): mode {mode:?} is not an octal file mode")]
    Mode {
        /// Its index, from 0.
        index: usize,
        /// As sent.
        mode: String,
    },
    /// The converted spec is not valid.
    #[error(transparent)]
    Spec(#[from] SpecError),
}

impl TemplateBuildStartV2 {
    /// The body from its JSON.
    pub fn from_json(body: &[u8]) -> Result<TemplateBuildStartV2, E2bError> {
        Ok(serde_json::from_slice(body)?)
    }

    /// The build this body asks for, validated; `cpu_count` and
    /// `memory_mib` come from the template's creation (`POST
    /// /v3/templates`), not from this body.
    pub fn into_spec(
        self,
        cpu_count: Option<u32>,
        memory_mib: Option<u32>,
    ) -> Result<BuildSpec, E2bError> {
        let from = source(
            self.from_image.filter(|s| !s.is_empty()),
            self.from_template.filter(|s| !s.is_empty()),
            self.from_image_registry,
        )?;
        let steps = self
            .steps
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(index, step)| convert_step(index, step))
            .collect::<Result<Vec<_>, _>>()?;
        // E2B treats an empty string as no command.
        let cmd = self.start_cmd.filter(|s| !s.is_empty());
        let ready = self
            .ready_cmd
            .filter(|s| !s.is_empty())
            .map(|r| ReadyCheck::from_e2b(&r));
        let start = (cmd.is_some() || ready.is_some()).then_some(Start { cmd, ready });
        let spec = BuildSpec {
            from,
            steps,
            start,
            skip_cache: self.force.unwrap_or(false),
            cpu_count,
            memory_mib,
        };
        spec.validate()?;
        Ok(spec)
    }
}

fn source(
    image: Option<String>,
    template: Option<String>,
    registry: Option<RegistryConfig>,
) -> Result<Source, E2bError> {
    match (image, template) {
        (None, None) => Err(E2bError::NoSource),
        (Some(_), Some(_)) => Err(E2bError::BothSources),
        // The SDK keeps an earlier `from_image`'s credentials after a
        // `from_template`: E2B uses them for images only, and so here.
        (None, Some(name)) => Ok(Source::Template { name }),
        (Some(reference), None) => match registry {
            None => Ok(Source::Image {
                reference,
                username: None,
                password: None,
            }),
            Some(RegistryConfig::Registry { username, password }) => Ok(Source::Image {
                reference,
                username: Some(username),
                password: Some(password),
            }),
            Some(RegistryConfig::Aws { .. }) => Err(E2bError::UnsupportedRegistry { kind: "aws" }),
            Some(RegistryConfig::Gcp { .. }) => Err(E2bError::UnsupportedRegistry { kind: "gcp" }),
        },
    }
}

/// `Some(s)` unless `s` is empty (E2B's "not given").
fn given(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

fn convert_step(index: usize, step: TemplateStep) -> Result<Step, E2bError> {
    let args = step.args.unwrap_or_default();
    let force = step.force.unwrap_or(false);
    let count = |kind: &'static str, ok: bool, expected: &'static str| {
        if ok {
            Ok(())
        } else {
            Err(E2bError::Args {
                index,
                kind,
                count: args.len(),
                expected,
            })
        }
    };
    match step.kind.to_ascii_uppercase().as_str() {
        "RUN" => {
            count("RUN", (1..=2).contains(&args.len()), "1 or 2")?;
            Ok(Step::Run {
                cmd: args[0].clone(),
                user: args.get(1).and_then(|u| given(u)),
                env: Default::default(),
                force,
            })
        }
        "COPY" => {
            count("COPY", (2..=4).contains(&args.len()), "2 to 4")?;
            let files_hash = step
                .files_hash
                .filter(|h| !h.is_empty())
                .ok_or(E2bError::NoFilesHash { index })?;
            let mode = match args.get(3).map(String::as_str) {
                None | Some("") => None,
                Some(m) => Some(octal(m).ok_or_else(|| E2bError::Mode {
                    index,
                    mode: m.to_string(),
                })?),
            };
            Ok(Step::Copy {
                src: args[0].clone(),
                dest: args[1].clone(),
                files_hash,
                user: args.get(2).and_then(|u| given(u)),
                mode,
                force,
            })
        }
        "ENV" => {
            count(
                "ENV",
                !args.is_empty() && args.len().is_multiple_of(2),
                "pairs",
            )?;
            let vars = args
                .chunks(2)
                // E2B's backslash is literal; ours escapes.
                .map(|kv| (kv[0].clone(), kv[1].replace('\\', "\\\\")))
                .collect();
            Ok(Step::Env { vars, force })
        }
        "WORKDIR" => {
            count("WORKDIR", args.len() == 1, "1")?;
            Ok(Step::Workdir {
                path: args[0].clone(),
                force,
            })
        }
        "USER" => {
            count("USER", args.len() == 1, "1")?;
            Ok(Step::User {
                name: args[0].clone(),
                force,
            })
        }
        _ => Err(E2bError::UnknownStep {
            index,
            kind: step.kind,
        }),
    }
}

/// `m` as an octal mode: 1 to 4 octal digits.
fn octal(m: &str) -> Option<u32> {
    if m.is_empty() || m.len() > 4 || !m.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return None;
    }
    u32::from_str_radix(m, 8).ok()
}
