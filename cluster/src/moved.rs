//! Sandboxes and templates that move to another pod through the object
//! store (issue 29; pods with `--object-store`): a pod silent past
//! `lost_after` is lost for good, and a command on one of its hibernated
//! sandboxes whose snapshot is stored first has a pod up adopt it
//! ([`Operation::Adopt`]: its snapshot, and its template if that pod
//! lacks it, fetched whole into the pod's disk), then moves its row to
//! that pod and runs there; a create from a template no pod up lists has
//! a pod up fetch it ([`Operation::TemplateAdopt`]) and is placed there.
//!
//! A wake of a hibernated sandbox whose pod is up but has no admission
//! headroom for it (by its last heartbeat) moves the same way to a pod
//! with room, when its snapshot is stored ([`Cluster::roomier`]): a wake
//! need not go where the snapshot was taken, however full that pod is.
//!
//! A pod that still holds a sandbox moved away (one back from lost, or
//! one up that had no room) is asked to release it (`events.rs`'s
//! `release_strays`, on its next heartbeat).
//!
//! Placement of a move: the pods up with admission headroom for the
//! sandbox's memory, those that list its template first (its chunks are
//! in their cache), then by headroom.
//!
//! A running (or paused) sandbox of a lost pod whose pod stored durable
//! checkpoints of it (`--checkpoint-interval-s`: the scheduler's
//! `durable.rs`) moves as the hibernated sandbox its last checkpoint is,
//! and wakes as it was then.
//!
//! A sandbox of a lost pod that cannot move (running or paused without a
//! durable checkpoint, or hibernated without a stored snapshot: its state
//! went with the pod)
//! reads as [`SandboxState::Lost`], saying why in `failure_reason`; every
//! command on it but a delete answers 409 naming that state, and a delete
//! is journaled and finished here (a tombstone, its quota freed) without
//! its pod. Should that pod come back, its heartbeat still lists the
//! sandbox, and it is asked to delete it (`events.rs`).

use torpor_scheduler::model::{random_hex, Sandbox, SandboxId, Template, TemplateId, Timestamp};
use torpor_scheduler::service::durable::has_durable_checkpoint;
use torpor_scheduler::state::SandboxState;

use super::db::{NewOp, PodRow};
use super::replica::Cluster;
use super::wire::{OpOutcome, Operation, Reply};
use torpor_gate::service::ServiceError;

/// Whether `sandbox` can move to another pod through the object store:
/// hibernated with its memory, its snapshot stored; or running (or
/// paused) from a durable checkpoint its pod stored
/// (`--checkpoint-interval-s`), which it then wakes from, as it was then.
fn movable(sandbox: &Sandbox) -> bool {
    match sandbox.state {
        SandboxState::Hibernated => !sandbox.disk_only && sandbox.stored_snapshot.is_some(),
        SandboxState::Running | SandboxState::Paused => has_durable_checkpoint(sandbox),
        _ => false,
    }
}

impl Cluster {
    /// Whether `pod` has been silent long enough to be lost for good.
    pub(super) fn is_lost(&self, pod: &PodRow) -> bool {
        pod.silent_s >= self.config.lost_after.as_secs_f64()
    }

    /// `sandbox` of `pod` as a client reads it: [`SandboxState::Lost`],
    /// saying why, when that pod is lost for good and the sandbox cannot
    /// move; else as its row has it, but with no VMM when that pod is
    /// lost (one that moves runs nowhere until a command moves it).
    pub(super) fn lost_view(&self, mut sandbox: Sandbox, pod: &PodRow) -> Sandbox {
        let gone = matches!(sandbox.state, SandboxState::Deleted | SandboxState::Lost);
        if self.is_lost(pod) {
            sandbox.vmm = None;
        }
        if self.is_lost(pod) && !movable(&sandbox) && !gone {
            sandbox.failure_reason = Some(lost_reason(&sandbox, pod));
            sandbox.last_durable_at = own_stored_at(&sandbox);
            sandbox.state = SandboxState::Lost;
        }
        sandbox
    }

    /// A delete of sandbox `id` whose pod is lost for good and which
    /// cannot move: journaled for that pod and finished here at once (the
    /// tombstone a pod's own delete leaves, its quota freed); `None` when
    /// the sandbox is not such a one (the delete goes the usual way).
    pub(super) async fn delete_lost(&self, id: &SandboxId) -> Result<Option<Reply>, ServiceError> {
        let Ok((sandbox, pod)) = self.owned(id).await else {
            return Ok(None);
        };
        if self.is_up(&pod) || !self.is_lost(&pod) || movable(&sandbox) {
            return Ok(None);
        }
        let op_id = format!("op_{}", random_hex(12));
        let key = torpor_gate::request_context::idempotency_key();
        let tenant = sandbox.tenant.clone().unwrap_or_default();
        let new = NewOp {
            id: &op_id,
            // Not a pod's delete: `events.rs` asks the pod to delete it
            // should it come back.
            kind: "forget",
            sandbox: Some(id),
            template: None,
            pod: &pod.id,
            tenant: &tenant,
            idempotency_key: key.as_deref(),
            deadlines: None,
        };
        let (op, fresh) = self.db.begin_operation(&new, None).await?;
        // A retry's key names the first request's operation: this forget,
        // or a delete sent to the pod before it was lost.
        let same = matches!(op.kind.as_str(), "forget" | "delete")
            && op.sandbox.as_deref() == Some(id.as_str());
        if !fresh && !same {
            return Err(op.key_used_elsewhere());
        }
        // Finished here unless it has an outcome already (a forget's, or
        // the failure the sweep gave a delete the lost pod never answered:
        // `expiry.rs`); a delete still pending is finished as the forget
        // would be. Its outcome read back: the sweep may have ended it
        // first.
        if op.outcome.is_none() {
            let reply = Reply::Deleted {
                sandbox: id.clone(),
            };
            self.db
                .finish(&pod.id, &op.id, &OpOutcome::Done(reply))
                .await?;
        }
        let outcome = self
            .db
            .operation(&op.id)
            .await?
            .and_then(|row| row.outcome)
            .ok_or_else(|| {
                ServiceError::Internal(format!("operation {} has no outcome once finished", op.id))
            })?;
        let reply = outcome.reply()?;
        tracing::warn!(sandbox = %id, pod = %pod.id, "deleted a sandbox lost with its pod");
        Ok(Some(reply))
    }

    /// Sandbox `id`, whose pod failed the command with `e` (down): moved
    /// to a pod up when its pod is lost and its snapshot is stored, with
    /// that pod; else `e`.
    pub(super) async fn moved(
        &self,
        id: &SandboxId,
        e: ServiceError,
    ) -> Result<(Sandbox, PodRow), ServiceError> {
        let Ok((sandbox, from)) = self.owned(id).await else {
            return Err(e);
        };
        if self.is_up(&from) || !self.is_lost(&from) {
            return Err(e);
        }
        if !movable(&sandbox) {
            return Err(ServiceError::Conflict {
                id: id.to_string(),
                state: SandboxState::Lost,
                message: format!("{}; it can only be deleted", lost_reason(&sandbox, &from)),
            });
        }
        let template = self
            .stored_template(&sandbox.template)
            .await?
            .ok_or_else(|| {
                Self::down(
                    &from,
                    &format!(
                        "sandbox {id}'s template {} is not in the object store",
                        sandbox.template
                    ),
                )
            })?;
        let pods = self.db.pods().await?;
        let to = move_target(&pods, &sandbox, &from, |p| self.is_up(p))
            .cloned()
            .ok_or_else(|| ServiceError::Admission {
                message: format!(
                    "no pod up has admission headroom to take sandbox {id} from lost pod {}",
                    from.id
                ),
            })?;
        tracing::warn!(sandbox = %id, from = %from.id, to = %to.id, state = %sandbox.state,
            stored_at = ?sandbox.stored_at, "moving a sandbox of a lost pod");
        self.adopt_on(sandbox, template, &from, &to, None).await
    }

    /// Sandbox `sandbox` of pod `from` (up), which a wake is for: when
    /// `from` has no admission headroom for its memory by its last
    /// heartbeat, the sandbox is hibernated with its snapshot stored (its
    /// current state: what a wake on `from` would restore) and so is its
    /// template, and another pod up has the room, moved there as a lost
    /// pod's sandbox is (adopted, its row moved, `from` asked by its next
    /// heartbeat to release its copy: `events.rs`'s `release_strays`), and
    /// woken there; else left where it is (its pod then answers the wake,
    /// refusing it if it is full). A move that fails leaves it where it
    /// is too (logged): the wake is tried on its pod.
    pub(super) async fn roomier(
        &self,
        sandbox: Sandbox,
        from: PodRow,
    ) -> Result<(Sandbox, PodRow), ServiceError> {
        let hibernated = sandbox.state == SandboxState::Hibernated && movable(&sandbox);
        if !hibernated || from.headroom_mib >= f64::from(sandbox.mem_mib) {
            return Ok((sandbox, from));
        }
        let pods = self.db.pods().await?;
        let Some(to) = move_target(&pods, &sandbox, &from, |p| self.is_up(p)).cloned() else {
            return Ok((sandbox, from));
        };
        let Some(template) = self.stored_template(&sandbox.template).await? else {
            return Ok((sandbox, from));
        };
        let id = sandbox.id.clone();
        tracing::info!(sandbox = %id, from = %from.id, to = %to.id,
            from_headroom_mib = from.headroom_mib, mem_mib = sandbox.mem_mib,
            "waking a sandbox on another pod: its own has no room for it");
        let generation = sandbox.generation;
        match self
            .adopt_on(sandbox.clone(), template, &from, &to, Some(generation))
            .await
        {
            Ok(moved) => Ok(moved),
            Err(e) => {
                tracing::warn!(sandbox = %id, to = %to.id, error = %e,
                    "could not move a sandbox to a pod with room; waking it on its own");
                Ok((sandbox, from))
            }
        }
    }

    /// Has pod `to` adopt `sandbox` (hibernated with its snapshot stored,
    /// or running from a durable checkpoint, which it moves as) of pod
    /// `from`, with its template, then moves its row to `to` (only if
    /// still `from`'s, and at `generation` if given: another replica may
    /// have moved it meanwhile, or its pod changed it; `to`'s copy is then
    /// a stray its heartbeats have released). The sandbox and its pod as
    /// they are after.
    async fn adopt_on(
        &self,
        sandbox: Sandbox,
        template: Template,
        from: &PodRow,
        to: &PodRow,
        generation: Option<u64>,
    ) -> Result<(Sandbox, PodRow), ServiceError> {
        let id = sandbox.id.clone();
        let tenant = sandbox.tenant.clone().unwrap_or_default();
        let (_, env) = self.db.secrets(&id).await?;
        // A running one moves as the hibernated sandbox its durable
        // checkpoint is.
        let sandbox = Sandbox {
            state: SandboxState::Hibernated,
            vmm: None,
            ..sandbox
        };
        let adopt = Operation::Adopt {
            sandbox: Box::new(sandbox),
            template: Box::new(template),
            env,
        };
        let adopted = match self
            .run_keyed(&to.id, &tenant, adopt, None, None)
            .await?
            .reply()?
        {
            Reply::Sandbox { sandbox, .. } => *sandbox,
            other => {
                return Err(ServiceError::Internal(format!(
                    "an adopt of {id} answered {other:?}"
                )))
            }
        };
        // Its row is the adopting pod's from now on.
        self.db
            .move_sandbox(&adopted, &from.id, &to.id, generation)
            .await?;
        self.owned(&id).await
    }

    /// Template `id` as a pod (up or not) lists it with its snapshot in the
    /// object store, if one does.
    async fn stored_template(&self, id: &TemplateId) -> Result<Option<Template>, ServiceError> {
        Ok(self
            .db
            .listing(id, self.config.down_after)
            .await?
            .into_iter()
            .map(|l| l.template)
            .find(|t| t.stored_snapshot.is_some()))
    }

    /// A create's template `key` (its id) that no pod up lists but whose
    /// snapshot is stored: fetched by the pod up with the most headroom,
    /// which is then where the create goes. None if there is no such
    /// template or no pod up with headroom.
    pub(super) async fn template_elsewhere(
        &self,
        pods: &[PodRow],
        key: &str,
        tenant: &str,
    ) -> Result<Option<PodRow>, ServiceError> {
        let Some(template) = self.stored_template(&TemplateId::new(key)).await? else {
            return Ok(None);
        };
        let Some(to) = pods
            .iter()
            .filter(|p| self.is_up(p) && p.headroom_mib > 0.0)
            .max_by(|a, b| a.headroom_mib.total_cmp(&b.headroom_mib))
            .cloned()
        else {
            return Ok(None);
        };
        tracing::info!(template = key, to = %to.id, "fetching a template no pod up lists");
        let adopt = Operation::TemplateAdopt {
            template: Box::new(template),
        };
        match self
            .run_keyed(&to.id, tenant, adopt, None, None)
            .await?
            .reply()?
        {
            Reply::Template { .. } => Ok(Some(to)),
            other => Err(ServiceError::Internal(format!(
                "an adopt of template {key} answered {other:?}"
            ))),
        }
    }
}

/// Where a sandbox of pod `from` moves: a pod `up` but `from` with the
/// admission headroom for its memory, those that list its template
/// first (the template's chunks, most of a sibling's, are on their disk
/// and in their chunk cache), then by headroom.
fn move_target<'a>(
    pods: &'a [PodRow],
    sandbox: &Sandbox,
    from: &PodRow,
    up: impl Fn(&PodRow) -> bool,
) -> Option<&'a PodRow> {
    let key = sandbox.template.to_string();
    let has = |p: &PodRow| p.templates.contains(&key);
    pods.iter()
        .filter(|p| p.id != from.id && up(p) && p.headroom_mib >= f64::from(sandbox.mem_mib))
        .max_by(|a, b| {
            has(a)
                .cmp(&has(b))
                .then(a.headroom_mib.total_cmp(&b.headroom_mib))
        })
}

/// When the sandbox's own latest snapshot (a hibernation it was woken
/// from, in its directory `.../<id>/snap-N`) was stored; none for one
/// that runs from its template's snapshot (never hibernated: its template
/// is durable, not anything it did).
fn own_stored_at(sandbox: &Sandbox) -> Option<Timestamp> {
    let own = sandbox
        .snapshot
        .as_deref()
        .and_then(|p| p.parent())
        .and_then(|p| p.file_name())
        .is_some_and(|n| n == sandbox.id.as_str());
    sandbox.stored_at.filter(|_| own)
}

/// Why `sandbox` of lost pod `pod` is lost (no host path in it: tenants
/// read it).
fn lost_reason(sandbox: &Sandbox, pod: &PodRow) -> String {
    let kept = if sandbox.state == SandboxState::Hibernated {
        "hibernated without its snapshot in the object store".to_string()
    } else if let Some(at) = own_stored_at(sandbox) {
        format!(
            "{} past its last durable state (`last_durable_at`, {} ms since the epoch), \
             in no durable checkpoint since (`--checkpoint-interval-s`)",
            sandbox.state,
            at.millis()
        )
    } else {
        format!(
            "{}, its state in no durable checkpoint (`--checkpoint-interval-s`)",
            sandbox.state
        )
    };
    format!(
        "its pod {} was lost for good (no heartbeat for {:.0} s) while it was {kept}: \
         its state went with the pod",
        pod.id, pod.silent_s
    )
}
