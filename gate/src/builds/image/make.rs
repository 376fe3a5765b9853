//! Making an image's template: unpacked, its root filesystem made,
//! installed with the kernel through the backend, booted once.

use std::time::{Duration, Instant};

use torpor_oci::{make_template_rootfs, unpack, Image, Limits, TemplateOptions};
use torpor_scheduler::images::ImagePart;
use torpor_scheduler::model::{PodId, Template, TemplateKind, TemplateState};
use torpor_scheduler::service::LINUX_CMDLINE;

use super::cache::Names;
use super::fetch::{mib, Scratch};
use super::{configured, io, ImageError, TEMPLATE_WAIT};
use crate::auth::Principal;
use crate::backend::{wait, SandboxApi};
use crate::builds::{Build, Level};
use crate::calls::ImageOp;
use crate::quota::Usage;
use crate::service::{CreateTemplate, ServiceError};
use crate::tenancy::{admit, Tenancy};

/// Unpacks, makes the root filesystem, installs the image and boots its
/// template.
pub(super) fn make<S: SandboxApi>(
    t: &Tenancy<S>,
    p: &Principal,
    build: &Build,
    image: &Image,
    scratch: &Scratch,
    names: &Names,
    shape: (u32, u32),
) -> Result<Template, ImageError> {
    let s = &*t.service;
    let guest = &t.builds.guest;
    let (kernel, agent) = configured(guest)?;
    let say = |message: String| build.log(Level::Info, format!("[base] {message}"));
    let check_cancel = || match build.cancel.is_cancelled() {
        true => Err(ImageError::Cancelled),
        false => Ok(()),
    };
    check_cancel()?;
    say(format!("unpacking {} layer(s)", image.layers().len()));
    let root = scratch.root();
    let unpacked = unpack(image, &root, &Limits::default()).map_err(ImageError::Unpack)?;
    say(format!(
        "unpacked {} entries, {} of files",
        unpacked.entries,
        mib(unpacked.bytes)
    ));
    for skipped in unpacked.skipped.iter().take(20) {
        build.log(
            Level::Warn,
            format!(
                "[base] left out of layer {}: {} ({})",
                skipped.layer, skipped.entry, skipped.what
            ),
        );
    }
    if unpacked.skipped.len() > 20 {
        say(format!("... {} more left out", unpacked.skipped.len() - 20));
    }
    check_cancel()?;
    let mut options = TemplateOptions::new(agent);
    options.headroom_bytes = guest.headroom_mib << 20;
    let ext4 = scratch.ext4();
    say("adding torpor's init, the agent and user `user`; making the ext4 image".into());
    let report = make_template_rootfs(&root, &options, &ext4).map_err(ImageError::Rootfs)?;
    let _ = std::fs::remove_dir_all(&root);
    let (user, uid, gid) = &report.user;
    say(format!(
        "root filesystem: {} ext4, init {}, user {user} ({uid}:{gid}, {}), sudo {}",
        mib(report.size_bytes),
        report.init,
        if report.user_added {
            "added"
        } else {
            "the image's"
        },
        if report.sudo {
            "yes"
        } else {
            "no (the image has none)"
        },
    ));
    check_cancel()?;
    let pod = linux_pod(s);
    for (part, path) in [(ImagePart::Kernel, kernel), (ImagePart::Rootfs, &ext4)] {
        let install = |source| ImageError::Install {
            name: names.image.clone(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(io(path.display()))?;
        let len = file.metadata().map_err(io(path.display()))?.len();
        wait(s.images(ImageOp::Install {
            name: &names.image,
            part,
            body: &mut file,
            limit: len,
            pod: pod.as_ref(),
        }))
        .map_err(install)?;
    }
    let on = pod
        .as_ref()
        .map(|p| format!(" on pod {p}"))
        .unwrap_or_default();
    say(format!("installed image {}{on}", names.image));
    let owner = p.owner();
    let req = CreateTemplate {
        name: names.template.clone(),
        kind: TemplateKind::Linux,
        image: Some(names.image.clone()),
        mem_mib: shape.0,
        vcpus: shape.1,
        // An image that keeps its own /sbin/init boots torpor's.
        cmdline: (report.init != "/sbin/init")
            .then(|| LINUX_CMDLINE.replace("init=/sbin/init", &format!("init={}", report.init))),
        pod,
        owner: Some(owner.clone()),
    };
    let created = {
        let _ticket = if s.admits_creates() {
            None
        } else {
            wait(admit(t, p, Usage::build(u64::from(shape.0))))?
        };
        wait(s.create_template(req))
    };
    let template = match created {
        Ok(template) => template,
        // Made meanwhile (by a build on another replica).
        Err(ServiceError::ResourceConflict(_)) => {
            wait(s.resolve_template(&owner, &names.template))?
        }
        Err(e) => return Err(e.into()),
    };
    say(format!(
        "template {} ({}): booting it once for its snapshot ({} MiB, {} vCPU)",
        template.name, template.id, shape.0, shape.1
    ));
    let started = Instant::now();
    let template = wait_ready(s, build, template)?;
    say(format!(
        "template {} ready in {:.1} s",
        template.id,
        started.elapsed().as_secs_f64()
    ));
    Ok(template)
}

/// The pod Linux templates are built on: the shared `base` template's
/// when it is on another pod (the nested pod, a cluster's), else this
/// one (`None`).
fn linux_pod<S: SandboxApi>(s: &S) -> Option<PodId> {
    let entries = wait(s.template_entries()).ok()?;
    let base = entries
        .iter()
        .find(|e| e["name"] == "base" && e["tenant"].is_null() && e["kind"] == "linux")?;
    let pod = base["pod"].as_str()?;
    (pod != torpor_scheduler::service::LOCAL_POD).then(|| PodId::new(pod))
}

/// Polls `template` until it is ready; a failed one is deleted.
pub(super) fn wait_ready<S: SandboxApi>(
    s: &S,
    build: &Build,
    mut template: Template,
) -> Result<Template, ImageError> {
    let deadline = Instant::now() + TEMPLATE_WAIT;
    loop {
        let failed = |reason: String| ImageError::TemplateFailed {
            name: template.name.clone(),
            id: template.id.to_string(),
            reason,
        };
        match &template.state {
            TemplateState::Ready => return Ok(template),
            TemplateState::Failed(reason) => {
                let _ = wait(s.delete_template(None, template.id.as_str()));
                return Err(failed(reason.clone()));
            }
            TemplateState::Deleted => return Err(failed("it was deleted".into())),
            TemplateState::Building => {}
        }
        if build.cancel.is_cancelled() {
            return Err(ImageError::Cancelled);
        }
        if Instant::now() > deadline {
            return Err(ImageError::TemplateTimeout {
                name: template.name.clone(),
                id: template.id.to_string(),
            });
        }
        std::thread::sleep(Duration::from_millis(500));
        template = wait(s.get_template(&template.id))?;
    }
}
