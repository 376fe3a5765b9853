//! Starting a build: the spec checked, its source resolved for the
//! tenant, its plan made and run on a thread of its own ([`launch`]); the
//! one path of `/v1`'s and E2B's build routes.

use std::sync::Arc;

use torpor_build::key::source_key;
use torpor_build::spec::{BuildSpec, Source};

use super::plan::{is_layer, plan};
use super::run::{spawn, Limits};
use super::Build;
use crate::auth::Principal;
use crate::backend::SandboxApi;
use crate::service::ServiceError;
use crate::tenancy::Tenancy;

/// Most builds a tenant may run at once (each also holds a sandbox,
/// counted against its quotas).
pub const MAX_RUNNING_PER_TENANT: usize = 4;

/// Whether `name` may name a built template: 1 to 128 characters, no
/// control characters or `/`, not a cache layer's.
pub fn check_name(name: &str) -> Result<(), ServiceError> {
    if name.is_empty()
        || name.len() > 128
        || name.chars().any(|c| c.is_control() || c == '/')
        || is_layer(name)
    {
        return Err(ServiceError::Invalid(format!(
            "template name {:?}: 1 to 128 characters, no control characters or '/', \
             not starting with {:?}",
            name.chars().take(130).collect::<String>(),
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
    plan: super::plan::Plan,
    shown: Option<serde_json::Value>,
    cpu_count: Option<u32>,
    memory_mib: Option<u32>,
}

/// Checks `spec`, resolves its source for `p` and plans template `name`
/// of `tenant` (blocking: call it on the blocking pool).
pub fn prepare<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    spec: BuildSpec,
    name: &str,
    tenant: Option<&str>,
) -> Result<Prepared, ServiceError> {
    spec.validate()
        .map_err(|e| ServiceError::Invalid(e.to_string()))?;
    let owner = p.owner();
    // An image reference that names one of the caller's templates (or a
    // shared one: `FROM base`) is that template.
    let named = match &spec.from {
        Source::Template { name } => Some(t.service.resolve_template(&owner, name)?),
        Source::Image { reference, .. } => match t.service.resolve_template(&owner, reference) {
            Ok(template) => Some(template),
            Err(ServiceError::NotFound { .. }) => None,
            Err(e) => return Err(e),
        },
        Source::Upload { .. } => None,
    };
    let (source, resolved) = match named {
        Some(template) => {
            let resolved = format!("{}@{}", template.id, template.created_at.0);
            (template, resolved)
        }
        None => {
            return Err(ServiceError::Unsupported(
                "builds from OCI images are not served yet: build from a template".into(),
            ))
        }
    };
    // A template a build made starts where that build ended (its user,
    // directory, variables); any other as E2B's base does.
    let start_env = t
        .builds
        .made(tenant, source.id.as_str())
        .and_then(|r| r.last_env)
        .unwrap_or_default();
    let key = source_key(&spec.from, &resolved);
    Ok(Prepared {
        plan: plan(&spec, source.id.as_str(), &key, name, start_env),
        shown: serde_json::to_value(spec.without_credentials()).ok(),
        cpu_count: spec.cpu_count,
        memory_mib: spec.memory_mib,
    })
}

/// Starts `build` on its prepared plan.
pub fn start<S: SandboxApi>(t: &Tenancy<S>, p: &Principal, build: &Arc<Build>, prepared: Prepared) {
    let Prepared {
        plan,
        shown,
        cpu_count,
        memory_mib,
    } = prepared;
    build.update(|r| {
        r.spec = shown;
        r.cpu_count = r.cpu_count.or(cpu_count);
        r.memory_mib = r.memory_mib.or(memory_mib);
        r.last_env = Some(plan.last.clone());
    });
    spawn(
        t.clone(),
        p.clone(),
        Arc::clone(build),
        plan,
        Limits::default(),
    );
}

/// [`prepare`]s `spec` for `build` and [`start`]s it; an error leaves the
/// build waiting (the caller fails it or answers the error).
pub fn launch<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Arc<Build>,
    spec: BuildSpec,
) -> Result<(), ServiceError> {
    let record = build.record();
    let prepared = prepare(t, p, spec, &record.name, record.tenant.as_deref())?;
    start(t, p, build, prepared);
    Ok(())
}
