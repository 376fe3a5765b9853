//! [`Operation`]: the one list of the sandbox operations a backend runs
//! for a caller (create, the lifecycle calls, delete, fork, template
//! builds and deletes, checkpoints), each with its typed request, and
//! [`Reply`]: what each answers. Serde-tagged by `kind`: the form the
//! cluster's work queue sends and the pods' journals keep.

use serde::{Deserialize, Serialize};
use torpor_scheduler::model::{Checkpoint, PodId, Sandbox, SandboxId, Template, TemplateId};
use torpor_scheduler::service::{CreateCheckpoint, CreateSandbox, CreateTemplate, ForkSandbox};

use crate::Lifecycle;

/// One operation with its request. A new operation is a variant here (its
/// `kind` on the wire), its [`Reply`], and its arm in the one dispatch
/// (`torpor_api::dispatch`); every surface, the cluster's queue and its
/// pod worker then carry it.
///
/// On the wire each lifecycle call is its own `kind` (`pause`,
/// `hibernate_marking`, ...: [`Lifecycle::name`]), so pods, API replicas
/// and queued messages of either build read each other. A field or kind
/// a build does not know is refused, not dropped.
///
/// `fork` is newer than the first kinds, with no version of its own: a
/// pod built before it drops a fork's work item as unreadable (and acks
/// it), so the operation stays pending (202, `GET /v1/operations/{id}`
/// `pending`) and a replica built before [`Reply::Sandboxes`] cannot read
/// its result. Upgrade replicas, then pods, before forking in a cluster
/// (the replicas first, as for heartbeats). So are `template_build` and
/// `template_delete` (and their replies [`Reply::Template`] and
/// [`Reply::TemplateDeleted`]): the same order before building or deleting
/// templates through a replica. Pods of later builds fail an operation
/// whose kind they cannot read (501 `unsupported`) rather than drop it,
/// so a kind added later ends at once on a pod not yet upgraded:
/// `checkpoint` and `checkpoint_delete` (and [`Reply::Checkpoint`],
/// [`Reply::CheckpointDeleted`]) are such kinds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Operation {
    /// A sandbox made for `tenant` (an admin's: `admin`); the reply is
    /// [`Reply::Sandbox`].
    Create {
        request: Box<CreateSandbox>,
        tenant: String,
        admin: bool,
    },
    Delete {
        sandbox: SandboxId,
    },
    /// `request.count` forks of `sandbox` (1 without it), made on its pod
    /// (which holds its snapshots), all or none; the reply is
    /// [`Reply::Sandboxes`].
    Fork {
        sandbox: SandboxId,
        request: Box<ForkSandbox>,
    },
    /// A template built for `tenant` (shared if `admin`, as embedded); the
    /// reply is [`Reply::Template`].
    TemplateBuild {
        request: Box<CreateTemplate>,
        tenant: String,
        admin: bool,
    },
    /// A template deleted (refused while sandboxes use it); the reply is
    /// [`Reply::TemplateDeleted`].
    TemplateDelete {
        template: TemplateId,
    },
    /// A checkpoint of `sandbox` taken on its pod (which holds its
    /// snapshots); the reply is [`Reply::Checkpoint`].
    Checkpoint {
        sandbox: SandboxId,
        request: Box<CreateCheckpoint>,
    },
    /// A checkpoint of `sandbox` deleted on its pod; the reply is
    /// [`Reply::CheckpointDeleted`].
    CheckpointDelete {
        sandbox: SandboxId,
        name: String,
    },
    /// A hibernated sandbox of a pod down for good, moved to this pod from
    /// the object store (its snapshot, and its template if this pod lacks
    /// it); the reply is [`Reply::Sandbox`], still hibernated. Newer still:
    /// a pod that cannot read it fails it (501).
    Adopt {
        sandbox: Box<Sandbox>,
        template: Box<Template>,
        /// The sandbox's environment (never in its serialized form):
        /// its commands' on the new pod, as on the old.
        #[serde(default)]
        env: std::collections::BTreeMap<String, String>,
    },
    /// A hibernated sandbox moved away to another pod while this one was
    /// lost: forgotten here (its files removed, its manifests left to the
    /// pod it moved to); the reply is [`Reply::Deleted`]. As new as
    /// `adopt`.
    Release {
        sandbox: SandboxId,
    },
    /// A template another pod built, fetched from the object store and
    /// registered on this pod under its id; the reply is
    /// [`Reply::Template`]. As new as `adopt`.
    TemplateAdopt {
        template: Box<Template>,
    },
    /// A lifecycle call, its `kind` its own ([`LifecycleCall`]); the reply
    /// is [`Reply::Sandbox`].
    #[serde(untagged)]
    Lifecycle(LifecycleCall),
}

/// A lifecycle call on a sandbox: `{"kind": "<its name>", "sandbox": ..}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleCall {
    #[serde(rename = "kind")]
    pub op: Lifecycle,
    pub sandbox: SandboxId,
}

impl Operation {
    /// Lifecycle call `op` on `sandbox`.
    pub fn lifecycle(sandbox: SandboxId, op: Lifecycle) -> Self {
        Operation::Lifecycle(LifecycleCall { op, sandbox })
    }

    /// Its `kind` (as on the wire, and as journaled).
    pub fn kind(&self) -> &'static str {
        match self {
            Operation::Create { .. } => "create",
            Operation::Lifecycle(call) => call.op.name(),
            Operation::Delete { .. } => "delete",
            Operation::Fork { .. } => "fork",
            Operation::TemplateBuild { .. } => "template_build",
            Operation::TemplateDelete { .. } => "template_delete",
            Operation::Checkpoint { .. } => "checkpoint",
            Operation::CheckpointDelete { .. } => "checkpoint_delete",
            Operation::Adopt { .. } => "adopt",
            Operation::Release { .. } => "release",
            Operation::TemplateAdopt { .. } => "template_adopt",
        }
    }

    /// The existing sandbox it is on.
    pub fn sandbox(&self) -> Option<&SandboxId> {
        match self {
            Operation::Create { .. }
            | Operation::TemplateBuild { .. }
            | Operation::TemplateDelete { .. }
            | Operation::TemplateAdopt { .. } => None,
            Operation::Adopt { sandbox, .. } => Some(&sandbox.id),
            Operation::Release { sandbox } => Some(sandbox),
            Operation::Lifecycle(LifecycleCall { sandbox, .. })
            | Operation::Delete { sandbox }
            | Operation::Fork { sandbox, .. }
            | Operation::Checkpoint { sandbox, .. }
            | Operation::CheckpointDelete { sandbox, .. } => Some(sandbox),
        }
    }

    /// The existing template it is on.
    pub fn template(&self) -> Option<&TemplateId> {
        match self {
            Operation::TemplateDelete { template } => Some(template),
            Operation::TemplateAdopt { template } => Some(&template.id),
            _ => None,
        }
    }
}

/// What an operation did, the variant of its [`Operation`]: the sandbox
/// after it (none after a delete; the new ones after a fork; the template
/// built or deleted; the checkpoint taken or deleted).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// A create's or a lifecycle call's sandbox (`resumed`: a lifecycle
    /// call resumed or woke it).
    Sandbox {
        sandbox: Box<Sandbox>,
        #[serde(default)]
        resumed: bool,
    },
    Deleted {
        sandbox: SandboxId,
    },
    /// A fork's sandboxes, all of its count (newer than the others: see
    /// [`Operation`] on upgrading).
    Sandboxes {
        sandboxes: Vec<Sandbox>,
    },
    /// A template as it was built (newer still: see [`Operation`]).
    Template {
        template: Box<Template>,
    },
    /// A template deleted, as it reads after (`state: deleted`): a retry
    /// of the delete with its `Idempotency-Key` finds it there.
    TemplateDeleted {
        template: Box<Template>,
    },
    /// A checkpoint as it was taken (newer still).
    Checkpoint {
        checkpoint: Box<Checkpoint>,
    },
    /// A checkpoint deleted.
    CheckpointDeleted {
        sandbox: SandboxId,
        name: String,
    },
}

impl Reply {
    /// The reply with its sandboxes shown as on `pod` (what a pod of a
    /// cluster reports).
    pub fn on_pod(mut self, pod: &PodId) -> Self {
        match &mut self {
            Reply::Sandbox { sandbox, .. } => sandbox.pod = Some(pod.clone()),
            Reply::Sandboxes { sandboxes } => {
                for s in sandboxes {
                    s.pod = Some(pod.clone());
                }
            }
            _ => {}
        }
        self
    }
}

#[cfg(test)]
#[path = "operation_tests.rs"]
mod tests;
