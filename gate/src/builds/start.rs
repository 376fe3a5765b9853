//! Starting a build: the spec checked, its source resolved for the
//! tenant, its plan made and run on a thread of its own ([`launch`]); the
//! one path of `/v1`'s and E2B's build routes.
//!
//! A template source is resolved and the build planned in the request.
//! An OCI image (a registry's or an upload) is only checked there (its
//! reference parses, the upload exists, the server can make images):
//! pulling is slow, so the run makes it a template first, its `base`
//! phase ([`super::image`]), and plans the steps from that template.

use std::sync::Arc;

use torpor_build::key::source_key;
use torpor_build::spec::{BuildSpec, Source};

use super::image::{self, ImageError};
use super::plan::{is_layer, plan, Plan};
use super::run::{spawn, Limits};
use super::Build;
use crate::auth::Principal;
use crate::backend::SandboxApi;
use crate::service::ServiceError;
use crate::tenancy::Tenancy;

/// Most builds a tenant may run at once (each also holds a sandbox,
/// counted against its quotas).
pub const MAX_RUNNING_PER_TENANT: usize = 4;

/// Whether `name` may name a built template: a template's name
/// ([`crate::service::check_template_name`]) without `/`, not a cache
/// layer's. 422 `invalid_spec` otherwise, as every other build input.
pub fn check_name(name: &str) -> Result<(), ServiceError> {
    let usable = crate::service::check_template_name(name);
    if usable.is_err() || name.contains('/') || is_layer(name) {
        return Err(ServiceError::InvalidSpec(format!(
            "template name {:?}: 1 to {} characters, no control characters or '/', \
             not starting with {:?}",
            name.chars().take(130).collect::<String>(),
            crate::service::MAX_TEMPLATE_NAME_CHARS,
            super::plan::LAYER_PREFIX
        )));
    }
    Ok(())
}

/// Refused (429) when `tenant` runs [`MAX_RUNNING_PER_TENANT`] builds.
pub fn admit_build<S>(t: &Tenancy<S>, tenant: Option<&str>) -> Result<(), ServiceError> {
    let running = t.builds.running(tenant);
    if running >= MAX_RUNNING_PER_TENANT {
        return Err(ServiceError::Quota {
            tenant: tenant.unwrap_or("admin").to_string(),
            quota: "concurrent_builds",
            limit: MAX_RUNNING_PER_TENANT as u64,
            used: running as u64,
            asked: 1,
        });
    }
    Ok(())
}

/// A build checked and planned, ready to run.
#[derive(Debug)]
pub struct Prepared {
    base: Base,
    shown: Option<serde_json::Value>,
    cpu_count: Option<u32>,
    memory_mib: Option<u32>,
}

/// What a prepared build starts from.
#[derive(Debug)]
pub enum Base {
    /// A template: planned already.
    Planned(Box<Plan>),
    /// An OCI image: made a template by the run (its `base` phase), which
    /// then plans the steps from it.
    Image(Box<ImageBase>),
}

/// A build from an OCI image, as the request checked it.
#[derive(Debug)]
pub struct ImageBase {
    /// The spec, without credentials (they are in `request` only).
    pub spec: BuildSpec,
    /// The template the build makes.
    pub name: String,
    pub request: image::Request,
}

impl Base {
    /// The plan; an image is made a template first (the build's log
    /// shows how, and its failure is the build's, at step `base`).
    pub fn plan<S: SandboxApi>(
        self,
        t: &Tenancy<S>,
        p: &Principal,
        build: &Build,
    ) -> Result<Plan, ImageError> {
        match self {
            Base::Planned(plan) => Ok(*plan),
            Base::Image(b) => {
                let made = image::materialize(t, p, build, &b.request)?;
                let key = source_key(&b.spec.from, &made.resolved());
                Ok(plan(
                    &b.spec,
                    made.template.id.as_str(),
                    &key,
                    &b.name,
                    made.start_env(),
                ))
            }
        }
    }
}

/// Checks `spec`, resolves its source for `p` and plans template `name`
/// of `tenant`.
pub async fn prepare<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    spec: BuildSpec,
    name: &str,
    tenant: Option<&str>,
) -> Result<Prepared, ServiceError> {
    spec.validate()
        .map_err(|e| ServiceError::InvalidSpec(e.to_string()))?;
    let owner = p.owner();
    // An image reference that names one of the caller's templates (or a
    // shared one: `FROM base`) is that template.
    let named = match &spec.from {
        Source::Template { name } => Some(t.service.resolve_template(&owner, name).await?),
        Source::Image { reference, .. } => {
            match t.service.resolve_template(&owner, reference).await {
                Ok(template) => Some(template),
                Err(ServiceError::NotFound { .. }) => None,
                Err(e) => return Err(e),
            }
        }
        Source::Upload { .. } => None,
    };
    let shown = serde_json::to_value(spec.without_credentials()).ok();
    let (cpu_count, memory_mib) = (spec.cpu_count, spec.memory_mib);
    let base = match named {
        Some(source) => {
            let resolved = format!("{}@{}", source.id, source.created_at.0);
            // A template a build made starts where that build ended (its
            // user, directory, variables); any other as E2B's base does.
            let start_env = t
                .builds
                .made(tenant, source.id.as_str())
                .and_then(|r| r.last_env)
                .unwrap_or_default();
            let key = source_key(&spec.from, &resolved);
            Base::Planned(Box::new(plan(
                &spec,
                source.id.as_str(),
                &key,
                name,
                start_env,
            )))
        }
        None => {
            let origin = image::check(&t.builds, &spec.from, tenant)?;
            Base::Image(Box::new(ImageBase {
                request: image::Request {
                    origin,
                    skip_cache: spec.skip_cache,
                    mem_mib: spec.memory_mib,
                    vcpus: spec.cpu_count,
                    runtime: None,
                },
                spec: spec.without_credentials(),
                name: name.to_string(),
            }))
        }
    };
    Ok(Prepared {
        base,
        shown,
        cpu_count,
        memory_mib,
    })
}

/// Starts `build` on its prepared plan, from the API's runtime: a pull
/// runs on that runtime.
pub fn start<S: SandboxApi>(t: &Tenancy<S>, p: &Principal, build: &Arc<Build>, prepared: Prepared) {
    start_within(t, p, build, prepared, Limits::default())
}

/// [`start`] within `limits` (the service's own templates: a start
/// command slower to be ready than a tenant's may be).
pub fn start_within<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Arc<Build>,
    prepared: Prepared,
    limits: Limits,
) {
    let Prepared {
        mut base,
        shown,
        cpu_count,
        memory_mib,
    } = prepared;
    let last_env = match &mut base {
        Base::Planned(plan) => Some(plan.last.clone()),
        Base::Image(b) => {
            b.request.runtime = tokio::runtime::Handle::try_current().ok();
            None
        }
    };
    build.update(|r| {
        r.spec = shown;
        r.cpu_count = r.cpu_count.or(cpu_count);
        r.memory_mib = r.memory_mib.or(memory_mib);
        r.last_env = last_env;
        // Building from now: a second start of it is refused.
        r.status = super::BuildStatus::Building;
    });
    spawn(t.clone(), p.clone(), Arc::clone(build), base, limits);
}

/// [`prepare`]s `spec` for `build` and [`start`]s it; an error leaves the
/// build waiting (the caller fails it or answers the error).
pub async fn launch<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Arc<Build>,
    spec: BuildSpec,
) -> Result<(), ServiceError> {
    let record = build.record();
    let prepared = prepare(t, p, spec, &record.name, record.tenant.as_deref()).await?;
    start(t, p, build, prepared);
    Ok(())
}
