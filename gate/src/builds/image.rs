//! Builds FROM an OCI image (issue 28): the build's `base` phase makes
//! the image a Linux template of the build's tenant, which the steps then
//! run on ([`materialize`], called by the run, on the build's thread).
//!
//! 1. The image: pulled from its registry (`torpor_oci::pull`, on the
//!    tokio runtime of the request that started the build, its layers
//!    logged as they come; cancellable), or read from the tenant's upload
//!    (`PUT /v1/build-files/{hash}`, checked against its hash) with
//!    `torpor_oci::from_archive`; into a scratch directory of the build
//!    (`BUILDS/work/<build>/`), removed when the phase ends.
//! 2. Unpacked there (`torpor_oci::unpack`, within its default limits:
//!    whiteouts, hard links, ownership, xattrs; `..`, links out of the
//!    root and tar bombs refused, naming the layer and entry), made a
//!    root filesystem (`make_template_rootfs`: torpor's init, the agent,
//!    user `user` with sudo, resolver; `mkfs.ext4 -d`).
//! 3. Installed with the guest kernel as image `oci-<16 hex>` through the
//!    backend (`ImageOp::Install`: the local pod, the nested pod, a
//!    cluster's pod alike), a hash of the tenant, the image's config
//!    digest and the provisioning inputs (agent, kernel, additions,
//!    headroom): no tenant sees another's image names.
//! 4. A template of the tenant's booted from it (`build-layer-oci-...`,
//!    hidden from lists as cache layers are), waited for until ready.
//!
//! Cached: the template is named by the image's digest and the
//! provisioning inputs, so an image made once is found again. What a
//! source resolved to (its digests and config) is remembered per tenant
//! (`BUILDS/images/<tenant>/`), so a rebuild from the same reference or
//! upload asks no registry and reads no archive, unless the spec says
//! `skip_cache` (then the reference is pulled again; a template of the
//! same digest is still reused: the same bytes). Credentials go to the
//! registry only: never stored, logged or part of a key.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use torpor_build::env::{resolve, Environment, DEFAULT_USER};
use torpor_build::spec::Source;
use torpor_oci::{from_archive, Credentials, Image, Reference};
use torpor_scheduler::model::Template;

use super::{Build, Builds, Level};
use crate::auth::Principal;
use crate::backend::{wait, SandboxApi};
use crate::service::{Owner, ServiceError};
use crate::tenancy::Tenancy;

mod cache;
mod fetch;
mod make;

use cache::{names, provision, read_memo, write_memo, Names};
use fetch::{check_upload, pull_image, Scratch};
use make::{make, wait_ready};

/// Longest wait for the image's template to boot and be snapshotted.
const TEMPLATE_WAIT: Duration = Duration::from_secs(20 * 60);
/// The template's size when neither the spec nor `base` says.
const DEFAULT_SHAPE: (u32, u32) = (512, 1);

pub use crate::build_registry::Guest;

/// Why the `base` phase failed (the build's failure message).
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("builds from OCI images need {what}, which this server was not given ({hint})")]
    NotConfigured {
        what: &'static str,
        hint: &'static str,
    },
    #[error("{what} {}: {source}", path.display())]
    GuestFile {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("pulling {reference}: {source}")]
    Pull {
        reference: String,
        source: torpor_oci::Error,
    },
    #[error("the pull of {0} ended without an answer")]
    PullLost(String),
    #[error("no async runtime to pull on (a build from a registry starts from a request)")]
    NoRuntime,
    #[error("the uploaded image {hash}: {source}")]
    Archive {
        hash: String,
        source: torpor_oci::Error,
    },
    #[error("the upload {hash} is not what its hash says (its SHA-256 is {actual})")]
    UploadHash { hash: String, actual: String },
    #[error("unpacking the image: {0}")]
    Unpack(torpor_oci::Error),
    #[error("making the template's root filesystem: {0}")]
    Rootfs(torpor_oci::Error),
    #[error("installing image {name}: {source}")]
    Install { name: String, source: ServiceError },
    #[error("template {name} ({id}) failed to build: {reason}")]
    TemplateFailed {
        name: String,
        id: String,
        reason: String,
    },
    #[error("template {name} ({id}) was not ready after {} s", TEMPLATE_WAIT.as_secs())]
    TemplateTimeout { name: String, id: String },
    #[error("the build was cancelled")]
    Cancelled,
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Service(#[from] ServiceError),
}

fn io(context: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> ImageError {
    move |source| ImageError::Io {
        context: context.to_string(),
        source,
    }
}

/// Where an image comes from, as the request gave it.
#[derive(Debug, Clone)]
pub enum Origin {
    Registry {
        reference: Reference,
        credentials: Option<Credentials>,
    },
    /// The tenant's upload of this SHA-256 (lowercase hex).
    Upload { hash: String },
}

impl Origin {
    /// How logs name it (never with credentials).
    fn shown(&self) -> String {
        match self {
            Origin::Registry { reference, .. } => reference.to_string(),
            Origin::Upload { hash } => format!("the upload {hash}"),
        }
    }
}

/// An image source to make into a template: what `prepare` checked.
#[derive(Debug, Clone)]
pub struct Request {
    pub origin: Origin,
    /// Pull again (a reference's resolution is not reused).
    pub skip_cache: bool,
    pub mem_mib: Option<u32>,
    pub vcpus: Option<u32>,
    /// The runtime pulls run on (the request's, captured as it starts the
    /// build).
    pub runtime: Option<tokio::runtime::Handle>,
}

/// An image source checked at request time (`prepare`): a bad reference
/// or an upload never made is 400; a server without a guest kernel or
/// agent 501, naming which.
pub fn check(
    builds: &Builds,
    source: &Source,
    tenant: Option<&str>,
) -> Result<Origin, ServiceError> {
    let unsupported = |e: ImageError| ServiceError::Unsupported(e.to_string());
    configured(&builds.guest).map_err(unsupported)?;
    match source {
        Source::Image {
            reference,
            username,
            password,
        } => {
            let reference: Reference = reference
                .parse()
                .map_err(|e: torpor_oci::Error| ServiceError::InvalidSpec(e.to_string()))?;
            let credentials = match (username, password) {
                (Some(u), Some(p)) => Some(Credentials {
                    username: u.clone(),
                    password: p.expose().to_string(),
                }),
                _ => None,
            };
            Ok(Origin::Registry {
                reference,
                credentials,
            })
        }
        Source::Upload { hash } => {
            if !builds.files.present(tenant, hash)? {
                return Err(ServiceError::InvalidSpec(format!(
                    "the image upload {hash} was never uploaded (PUT /v1/build-files/{hash} first)"
                )));
            }
            Ok(Origin::Upload {
                hash: hash.to_ascii_lowercase(),
            })
        }
        Source::Template { name } => Err(ServiceError::Internal(format!(
            "template {name} is not an image"
        ))),
    }
}

/// The kernel and agent, if the server was given them.
fn configured(guest: &Guest) -> Result<(&Path, &Path), ImageError> {
    let kernel = guest.kernel.as_deref().ok_or(ImageError::NotConfigured {
        what: "a guest kernel",
        hint: "ApiConfig::guest_kernel; torpor serve: --nested-kernel, or \
               scripts/build-guest-kernel before it starts",
    })?;
    let agent = guest.agent.as_deref().ok_or(ImageError::NotConfigured {
        what: "a guest agent",
        hint: "ApiConfig::guest_agent; torpor serve: --guest-agent, or scripts/build-agent",
    })?;
    Ok((kernel, agent))
}

/// What an image source resolved to: remembered per tenant so that a
/// rebuild from it asks no registry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Facts {
    pub manifest_digest: String,
    /// What names the image's content (its layers' diff ids are in it).
    pub config_digest: String,
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    /// Entrypoint and Cmd.
    pub command: Vec<String>,
}

impl Facts {
    fn of(image: &Image) -> Facts {
        let c = image.config();
        Facts {
            manifest_digest: image.manifest_digest().to_string(),
            config_digest: image.config_digest().to_string(),
            env: c.env.clone(),
            working_dir: c.working_dir.clone(),
            user: c.user.clone(),
            command: c.command(),
        }
    }
}

/// The template a build from an image starts from.
#[derive(Debug, Clone)]
pub struct Made {
    pub template: Template,
    pub facts: Facts,
}

impl Made {
    /// The source key's `resolved`: the template and the image's digest.
    pub fn resolved(&self) -> String {
        format!("{}@{}", self.template.id, self.facts.config_digest)
    }

    /// Where the steps start (E2B's from an image): the image's `Env` and
    /// `WorkingDir`, as user `user` (the image's `User` runs no step: E2B
    /// makes `user` and runs the steps as it).
    pub fn start_env(&self) -> Environment {
        let env = self
            .facts
            .env
            .iter()
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (kv.clone(), String::new()),
            })
            .filter(|(k, _)| !k.is_empty())
            .collect();
        Environment {
            user: DEFAULT_USER.to_string(),
            workdir: self.facts.working_dir.as_deref().map(|w| resolve("/", w)),
            env,
        }
    }
}

/// The `base` phase: the template `req`'s image is, made if need be.
pub fn materialize<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Build,
    req: &Request,
) -> Result<Made, ImageError> {
    let s = &*t.service;
    let builds = &*t.builds;
    let owner = p.owner();
    let record = build.record();
    let tenant = record.tenant.as_deref();
    let say = |message: String| build.log(Level::Info, format!("[base] {message}"));
    say(format!("FROM {}", req.origin.shown()));
    let (kernel, agent) = configured(&builds.guest)?;
    let provision = provision(kernel, agent, &builds.guest)?;
    let shape = shape(s, &owner, req);
    let memo = builds.memo_path(tenant, &req.origin);
    // One build of a tenant makes a source's image at a time; the others
    // wait for it and find it made.
    let _making = builds.making(&memo, build)?;
    if !req.skip_cache {
        if let Some(facts) = read_memo(&memo) {
            let names = names(tenant, &facts.config_digest, &provision, shape);
            if let Some(template) = cached(s, &owner, build, &names)? {
                say(format!(
                    "CACHED {} ({}): template {}",
                    req.origin.shown(),
                    facts.config_digest,
                    template.id
                ));
                return Ok(Made { template, facts });
            }
        }
    }
    let scratch = Scratch::new(builds.work_dir(&record.id))?;
    let image = match &req.origin {
        Origin::Registry {
            reference,
            credentials,
        } => pull_image(
            builds,
            build,
            req,
            reference,
            credentials.as_ref(),
            &scratch,
        )?,
        Origin::Upload { hash } => {
            let path = builds.files.path(tenant, hash)?;
            check_upload(&path, hash)?;
            say(format!("reading the uploaded archive {hash}"));
            from_archive(&path, &scratch.blobs()).map_err(|source| ImageError::Archive {
                hash: hash.clone(),
                source,
            })?
        }
    };
    let facts = Facts::of(&image);
    say(format!(
        "image {} (manifest {}): user {}, workdir {}, {} variable(s), command {:?} \
         (steps run as `{DEFAULT_USER}`; the image's command is not started: give the \
         build a start command to run it)",
        facts.config_digest,
        facts.manifest_digest,
        facts.user.as_deref().unwrap_or("root"),
        facts.working_dir.as_deref().unwrap_or("/"),
        facts.env.len(),
        facts.command,
    ));
    let names = names(tenant, &facts.config_digest, &provision, shape);
    let template = match cached(s, &owner, build, &names)? {
        Some(template) => {
            say(format!(
                "CACHED image {}: template {}",
                facts.config_digest, template.id
            ));
            template
        }
        None => make(t, p, build, &image, &scratch, &names, shape)?,
    };
    write_memo(&memo, &facts);
    Ok(Made { template, facts })
}

/// The template's memory and vCPUs: the spec's, else `base`'s, else
/// [`DEFAULT_SHAPE`].
fn shape<S: SandboxApi>(s: &S, owner: &Owner, req: &Request) -> (u32, u32) {
    let base = wait(s.resolve_template(owner, "base")).ok();
    (
        req.mem_mib
            .or(base.as_ref().map(|b| b.mem_mib))
            .unwrap_or(DEFAULT_SHAPE.0),
        req.vcpus
            .or(base.as_ref().map(|b| b.vcpus))
            .unwrap_or(DEFAULT_SHAPE.1),
    )
}

/// The image's template if the tenant has it (waited for if it is still
/// building; a failed one deleted, so that it is made again).
fn cached<S: SandboxApi>(
    s: &S,
    owner: &Owner,
    build: &Build,
    names: &Names,
) -> Result<Option<Template>, ImageError> {
    let found = match wait(s.resolve_template(owner, &names.template)) {
        Ok(t) => t,
        Err(ServiceError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    match wait_ready(s, build, found) {
        Ok(t) => Ok(Some(t)),
        Err(ImageError::TemplateFailed { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}
