//! The one dispatch of the contract's operations: [`dispatch`] runs an
//! [`Operation`] on any [`SandboxApi`] and answers its [`Reply`]; it is
//! [`SandboxApi::operate`]'s default. A cluster's pod worker runs each
//! operation of its work queue through it; a new operation's arm is
//! written here once, for every backend.

use torpor_sandbox_api::{LifecycleCall, Operation, Reply};

use super::{on_pod, Needs, SandboxApi};
use crate::service::{CreateSandbox, CreateTemplate, Owner, ServiceError, MAX_FORK_COUNT};
use torpor_scheduler::model::Sandbox;

/// Runs `op` on `s` as its caller's (a create or build is the tenant's the
/// operation names, an admin's shared), here: a pod named in the request
/// is this one.
pub async fn dispatch<S: SandboxApi + ?Sized>(s: &S, op: Operation) -> Result<Reply, ServiceError> {
    Ok(match op {
        Operation::Create {
            request,
            tenant,
            admin,
        } => {
            let owner = Some(Owner { tenant, admin });
            let request = CreateSandbox {
                owner,
                pod: None,
                ..*request
            };
            let sandbox = Box::new(s.create_sandbox(request).await?);
            Reply::Sandbox {
                sandbox,
                resumed: false,
            }
        }
        Operation::Lifecycle(LifecycleCall { op, sandbox }) => {
            let outcome = s.lifecycle(&sandbox, op).await?;
            Reply::Sandbox {
                sandbox: Box::new(outcome.sandbox),
                resumed: outcome.resumed,
            }
        }
        Operation::Delete { sandbox } => {
            s.delete_sandbox(&sandbox).await?;
            Reply::Deleted { sandbox }
        }
        Operation::Fork {
            sandbox,
            mut request,
        } => {
            // All of them or none (`fork_sandboxes` deletes those made if
            // one fails); each is the source's tenant's (`fork_sandbox`).
            let count = request.count.take().unwrap_or(1);
            if !(1..=MAX_FORK_COUNT).contains(&count) {
                return Err(ServiceError::Invalid(format!("a fork count of {count}")));
            }
            Reply::Sandboxes {
                sandboxes: s.fork_sandboxes(&sandbox, *request, count).await?,
            }
        }
        // The tenant's own (an admin's shared), as an embedded build.
        Operation::TemplateBuild {
            request,
            tenant,
            admin,
        } => Reply::Template {
            template: Box::new(
                s.create_template(CreateTemplate {
                    owner: Some(Owner { tenant, admin }),
                    pod: None,
                    ..*request
                })
                .await?,
            ),
        },
        // Refused (409) while sandboxes use it; answered with the template
        // as it reads after (`deleted`).
        Operation::TemplateDelete { template } => {
            s.delete_template(None, template.as_str()).await?;
            Reply::TemplateDeleted {
                template: Box::new(s.get_template(&template).await?),
            }
        }
        // On the pod's own service (its snapshots are there).
        Operation::Checkpoint { sandbox, request } => Reply::Checkpoint {
            checkpoint: Box::new(
                on_pod(s, Needs::Snapshots, move |p| {
                    p.create_checkpoint(&sandbox, *request)
                })
                .await?,
            ),
        },
        // On the pod's own service: its disk and its object store.
        Operation::Adopt {
            sandbox,
            template,
            env,
        } => Reply::Sandbox {
            sandbox: Box::new(
                on_pod(s, Needs::Snapshots, move |p| {
                    p.adopt_sandbox(Sandbox { env, ..*sandbox }, *template)
                })
                .await?,
            ),
            resumed: false,
        },
        Operation::Release { sandbox } => {
            let id = sandbox.clone();
            on_pod(s, Needs::Snapshots, move |p| p.release_sandbox(&id)).await?;
            Reply::Deleted { sandbox }
        }
        Operation::TemplateAdopt { template } => Reply::Template {
            template: Box::new(
                on_pod(s, Needs::Snapshots, move |p| p.adopt_template(*template)).await?,
            ),
        },
        Operation::CheckpointDelete { sandbox, name } => {
            let (id, checkpoint) = (sandbox.clone(), name.clone());
            on_pod(s, Needs::Snapshots, move |p| {
                p.delete_checkpoint(&id, &checkpoint)
            })
            .await?;
            Reply::CheckpointDeleted { sandbox, name }
        }
    })
}
