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
//! So does one its pod refuses for room although its last heartbeat
//! showed room ([`Cluster::woken_elsewhere`]): the heartbeat was stale,
//! or what refused was not that headroom (the pod's memory pressure, its
//! jail's uids). Only such a refusal moves it ([`Cluster::refused_for_room`]: 429
//! `admission_refused` or `rate_limited` from the pod; never a tenant's
//! quota, the same on every pod, nor any other failure), once: the wake
//! is run again on a pod up with room but the refusing one, under the
//! request's `Idempotency-Key` with `#moved` added. With no such pod the
//! client gets the pod's 429, saying that no other pod had room; a move
//! that fails leaves the sandbox where it was, hibernated, and the client
//! the pod's 429. A guest call (`/v1` exec and files, envd) of a tenant
//! with a quota wakes a hibernated sandbox first as a `connect` through
//! the replica (`torpor_gate::tenancy::wake_first`), so it moves the
//! same way; one of an admin or of a tenant without a quota goes to the
//! pod (relayed, or through its agent tunnel), which wakes the sandbox
//! itself: a refusal there is the pod's 429 as yet.
//!
//! A pod that still holds a sandbox moved away (one back from lost, or
//! one up that had no room) is asked to release it (`events.rs`'s
//! `release_strays`, on its next heartbeat).
//!
//! Placement of a move: the pods up with admission headroom for the
//! sandbox's memory, those holding the most bytes of its layers (its
//! template's and its own snapshot's, on their disk or in their chunk
//! cache: `placement.rs`) first, then those that list its template, then
//! by headroom.
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

use torpor_scheduler::model::{
    random_hex, PodId, Sandbox, SandboxId, Template, TemplateId, Timestamp,
};
use torpor_scheduler::service::durable::has_durable_checkpoint;
use torpor_scheduler::state::SandboxState;

use super::db::{NewOp, PodRow};
use super::placement;
use super::replica::Cluster;
use super::wire::{OpError, OpOutcome, Operation, Reply};
use torpor_gate::error::code as error_code;
use torpor_gate::quota::Usage;
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
        let layer = template.stored_snapshot.as_deref();
        let to = move_target(&pods, &sandbox, &from, layer, |p| self.is_up(p))
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
    /// heartbeat and the sandbox is hibernated with its snapshot stored
    /// (its current state: what a wake on `from` would restore), moved to
    /// a pod up with room ([`Cluster::move_for_room`]) and woken there;
    /// else left where it is (its pod then answers the wake, and should
    /// it refuse it for room, [`Cluster::woken_elsewhere`] moves it then).
    /// A move that fails leaves it where it is too (logged): the wake is
    /// tried on its pod.
    pub(super) async fn roomier(
        &self,
        sandbox: Sandbox,
        from: PodRow,
    ) -> Result<(Sandbox, PodRow), ServiceError> {
        let hibernated = sandbox.state == SandboxState::Hibernated && movable(&sandbox);
        if !hibernated || from.headroom_mib >= f64::from(sandbox.mem_mib) {
            return Ok((sandbox, from));
        }
        let why = "its own pod has no room for it by its last heartbeat";
        match self.move_for_room(&sandbox, &from, why).await? {
            Ok(moved) => Ok(moved),
            Err(_) => Ok((sandbox, from)),
        }
    }

    /// A wake (`command`) of sandbox `id` that its pod `from` refused for
    /// room (`refusal`, [`Cluster::refused_for_room`]) although its last heartbeat
    /// showed room (it changed since, or what refused it was not that
    /// headroom: its memory pressure, its jail's uids): the sandbox, still
    /// `from`'s and hibernated with its snapshot stored as `from` has it
    /// now (as the refused wake left it), moved as [`Cluster::roomier`]
    /// moves one, to a pod up with room but `from`, and the wake run
    /// there, once (admitted against its tenant's quota for `asked` again:
    /// the refused one no longer counts), under the request's
    /// `Idempotency-Key` with `#moved` added (a retry of the request,
    /// whose first wake is the refused one, gets this one's outcome).
    /// Else `refusal`: saying that no other pod up had room when none had,
    /// as it came when the sandbox cannot move or its move failed (it is
    /// then where it was, hibernated, and wakes there once its pod has
    /// room).
    pub(super) async fn woken_elsewhere(
        &self,
        id: &SandboxId,
        from: &PodId,
        command: Operation,
        asked: Option<Usage>,
        refusal: ServiceError,
    ) -> Result<Reply, ServiceError> {
        let key = torpor_gate::request_context::idempotency_key().map(|k| format!("{k}#moved"));
        if let Some(key) = &key {
            if let Some(op) = self.db.operation_by_key(key, command.kind(), id).await? {
                return self.wait(op).await?.reply();
            }
        }
        let (_, pod) = self.owned(id).await?;
        if pod.id != *from {
            return Err(refusal);
        }
        // As its pod has it now, its row brought up to it: the refused
        // wake moved it to `resuming` and back, each a new generation,
        // which its row has only from a later heartbeat (the move is
        // made only at the generation read).
        let Ok(sandbox) = self.refreshed_on_pod(id).await else {
            return Err(refusal);
        };
        let hibernated = sandbox.state == SandboxState::Hibernated && movable(&sandbox);
        if sandbox.pod.as_ref() != Some(from) || !hibernated {
            return Err(refusal);
        }
        let why = format!("its own pod refused to wake it: {refusal}");
        let (sandbox, to) = match self.move_for_room(&sandbox, &pod, &why).await? {
            Ok((_, to)) if to.id == *from => return Err(refusal),
            Ok(moved) => moved,
            Err(Unmoved::NoRoom) => return Err(no_other_room(refusal, id)),
            Err(Unmoved::Failed) => return Err(refusal),
        };
        let tenant = sandbox.tenant.clone().unwrap_or_default();
        self.run_keyed(&to.id, &tenant, command, asked.as_ref(), key)
            .await?
            .reply()
    }

    /// Moves `sandbox` (hibernated, its snapshot stored) of pod `from`
    /// (up) for a wake `from` has no room for (`why`, logged): adopted by
    /// a pod up but `from` with room ([`move_target`]), which its template
    /// must be stored for, as a lost pod's sandbox is (`adopt_on`: its row
    /// moved only if still `from`'s at the generation read, `from` asked
    /// by its next heartbeat to release its copy: `events.rs`'s
    /// `release_strays`). The sandbox and its pod as its row has them
    /// after (still `from` if `from` changed it meanwhile); else why it
    /// did not move (a failed adopt logged): it is where it was.
    async fn move_for_room(
        &self,
        sandbox: &Sandbox,
        from: &PodRow,
        why: &str,
    ) -> Result<Result<(Sandbox, PodRow), Unmoved>, ServiceError> {
        let pods = self.db.pods().await?;
        let template = self.stored_template(&sandbox.template).await?;
        let layer = template.as_ref().and_then(|t| t.stored_snapshot.as_deref());
        let Some(to) = move_target(&pods, sandbox, from, layer, |p| self.is_up(p)).cloned() else {
            return Ok(Err(Unmoved::NoRoom));
        };
        let Some(template) = template else {
            return Ok(Err(Unmoved::Failed));
        };
        let id = &sandbox.id;
        tracing::info!(sandbox = %id, from = %from.id, to = %to.id,
            from_headroom_mib = from.headroom_mib, mem_mib = sandbox.mem_mib, why,
            "waking a sandbox on another pod");
        let generation = Some(sandbox.generation);
        match self
            .adopt_on(sandbox.clone(), template, from, &to, generation)
            .await
        {
            Ok(moved) => Ok(Ok(moved)),
            Err(e) => {
                tracing::warn!(sandbox = %id, to = %to.id, error = %e,
                    "could not move a sandbox to a pod with room; it stays on its own");
                Ok(Err(Unmoved::Failed))
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

/// Why [`Cluster::move_for_room`] left a sandbox where it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unmoved {
    /// No other pod up has admission headroom for it.
    NoRoom,
    /// Its template is not stored, or the adopt failed.
    Failed,
}

impl Cluster {
    /// Whether `e`, a pod's answer to a wake, refused it for room that
    /// another pod may have: the pod's admission (429 `admission_refused`:
    /// its memory's headroom, its jail's uids) or its memory pressure (429
    /// `rate_limited`). Not a tenant's quota (429 `quota_exceeded`, the same
    /// on every pod, and admitted by the replica before the pod is asked)
    /// nor any other failure: those do not move the sandbox.
    pub(super) fn refused_for_room(e: &ServiceError) -> bool {
        match e {
            ServiceError::Admission { .. } | ServiceError::Pressure { .. } => true,
            ServiceError::Pod {
                status: 429, code, ..
            } => code == error_code::ADMISSION_REFUSED || code == error_code::RATE_LIMITED,
            _ => false,
        }
    }
}

/// `refusal` (a wake's, [`Cluster::refused_for_room`]) of sandbox `id`, as its pod
/// answered it (status, code), saying that no other pod up had room.
fn no_other_room(refusal: ServiceError, id: &SandboxId) -> ServiceError {
    let OpError {
        status,
        code,
        message,
    } = super::wire::failure(refusal);
    ServiceError::Pod {
        status,
        code,
        message: format!("{message}; no other pod up had admission headroom to take sandbox {id}"),
    }
}

/// Where a sandbox of pod `from` moves: a pod `up` but `from` with the
/// admission headroom for its memory; of them, those holding the most
/// bytes of its layers (its own snapshot's, and its template's, stored
/// as `template_layer`: on their disk or in their chunk cache,
/// `placement.rs`), then those that list its template (its chunks, most
/// of a sibling's, are on their disk), then by headroom.
fn move_target<'a>(
    pods: &'a [PodRow],
    sandbox: &Sandbox,
    from: &PodRow,
    template_layer: Option<&str>,
    up: impl Fn(&PodRow) -> bool,
) -> Option<&'a PodRow> {
    let key = sandbox.template.to_string();
    let whole = placement::template_bytes(pods, &key);
    let fit = pods
        .iter()
        .filter(|p| p.id != from.id && up(p) && p.headroom_mib >= f64::from(sandbox.mem_mib));
    let (ranked, _) = placement::ranked(
        fit,
        |p| placement::sandbox_held(p, sandbox, template_layer, whole),
        |p| p.templates.contains(&key),
    );
    ranked.first().copied()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_pods::{holding, pod};
    use crate::ClusterError;
    use torpor_gate::quota::QuotaExceeded;

    /// `e` as a replica reads it from its pod's operation: the failure the
    /// pod journaled (`wire::failure`), back as the error it stands for.
    fn from_pod(e: ServiceError) -> ServiceError {
        super::super::wire::failure(e).into()
    }

    fn quota() -> QuotaExceeded {
        QuotaExceeded {
            tenant: "acme".into(),
            quota: "memory_mib",
            limit: 64,
            used: 64,
            asked: 64,
        }
    }

    #[test]
    fn only_a_pods_refusal_for_room_moves_a_wake() {
        let full = || ServiceError::Admission {
            message: "all 1 jail uids are in use by running VMMs".into(),
        };
        let pressed = || ServiceError::Pressure {
            resident_mib: 900,
            asked_mib: 64,
            hard_mib: 950,
            retry_after_s: 1,
        };
        // Its admission (its memory, its jail's uids) and its memory
        // pressure: as the pod answers them, and typed.
        for e in [full(), pressed()] {
            assert!(Cluster::refused_for_room(&e), "{e:?}");
            let e = from_pod(e);
            assert!(Cluster::refused_for_room(&e), "{e:?}");
        }
        // A tenant's quota: refused by the replica's admission (before the
        // pod), or by a pod; the same on every pod.
        let quota_refusals = [
            ServiceError::from(ClusterError::Quota(quota())),
            from_pod(quota().into()),
        ];
        for e in quota_refusals {
            assert!(!Cluster::refused_for_room(&e), "{e:?}");
        }
        // Nor anything else the pod answers.
        let id = SandboxId::new("sbx_0123456789abcdef");
        let others = [
            ServiceError::Conflict {
                id: id.to_string(),
                state: SandboxState::Running,
                message: "m".into(),
            },
            ServiceError::NotFound {
                kind: "sandbox",
                id: id.to_string(),
            },
            ServiceError::GuestUnresponsive { id: id.to_string() },
            ServiceError::Unavailable {
                message: "m".into(),
                retry_after_s: 1,
            },
            ServiceError::HostUnsupported("m".into()),
            ServiceError::Pod {
                status: 503,
                code: error_code::UNAVAILABLE.into(),
                message: "pod1 is down".into(),
            },
            // A 429 of no known refusal for room.
            ServiceError::Pod {
                status: 429,
                code: error_code::QUOTA_EXCEEDED.into(),
                message: "m".into(),
            },
        ];
        for e in others {
            assert!(!Cluster::refused_for_room(&e), "{e:?}");
            let e = from_pod(e);
            assert!(!Cluster::refused_for_room(&e), "{e:?}");
        }
    }

    #[test]
    fn a_refusal_nowhere_else_has_room_for_says_so() {
        let id = SandboxId::new("sbx_0123456789abcdef");
        let refusal = from_pod(ServiceError::Pressure {
            resident_mib: 900,
            asked_mib: 64,
            hard_mib: 950,
            retry_after_s: 1,
        });
        match no_other_room(refusal, &id) {
            ServiceError::Pod {
                status,
                code,
                message,
            } => {
                assert_eq!((status, code.as_str()), (429, error_code::RATE_LIMITED));
                assert!(message.contains("memory pressure"), "{message}");
                assert!(
                    message.ends_with(&format!(
                        "no other pod up had admission headroom to take sandbox {id}"
                    )),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_move_goes_to_another_pod_up_with_room_those_with_the_template_first() {
        let mut sandbox = Sandbox::new(TemplateId::new("probe"), 64, 1, 1000);
        sandbox.state = SandboxState::Hibernated;
        let from = pod("pod1", 4096.0, 0.1, &["probe"]);
        let up = |p: &PodRow| p.silent_s < 3.0;
        let pods = [
            from.clone(),
            pod("small", 32.0, 0.1, &["probe"]),
            pod("down", 4096.0, 9.0, &["probe"]),
            pod("bare", 2048.0, 0.1, &[]),
            pod("cached", 128.0, 0.1, &["probe"]),
        ];
        let to = move_target(&pods, &sandbox, &from, None, up).map(|p| p.id.as_str());
        assert_eq!(to, Some("cached"));
        // Without it, the one with the most headroom; never the refusing
        // pod, however much room its heartbeat showed.
        let to = move_target(&pods[..4], &sandbox, &from, None, up).map(|p| p.id.as_str());
        assert_eq!(to, Some("bare"));
        assert!(move_target(&pods[..3], &sandbox, &from, None, up).is_none());
    }

    #[test]
    fn a_move_goes_where_most_of_the_sandboxs_chunks_are() {
        const MIB: u64 = 1 << 20;
        let mut sandbox = Sandbox::new(TemplateId::new("tpl_1"), 64, 1, 1000);
        sandbox.state = SandboxState::Hibernated;
        sandbox.stored_snapshot = Some("m-own".into());
        let from = pod("pod1", 4096.0, 0.1, &["tpl_1"]);
        let up = |p: &PodRow| p.silent_s < 3.0;
        // Both list the template (its 200 MiB layer on their disk); `warm`
        // also has most of the sandbox's own 256 MiB layer in its cache.
        let warm = holding(
            pod("warm", 128.0, 0.1, &["tpl_1"]),
            "m-tpl",
            "tpl_1",
            200 * MIB,
            200 * MIB,
        );
        let warm = holding(warm, "m-own", "sbx_x", 256 * MIB, 230 * MIB);
        let cold = holding(
            pod("cold", 4000.0, 0.1, &["tpl_1"]),
            "m-tpl",
            "tpl_1",
            200 * MIB,
            200 * MIB,
        );
        let pods = [from.clone(), cold.clone(), warm.clone()];
        let to = move_target(&pods, &sandbox, &from, Some("m-tpl"), up).map(|p| p.id.as_str());
        assert_eq!(to, Some("warm"));
        // A close tie (an eighth) falls back to headroom.
        let cold2 = holding(cold.clone(), "m-own", "sbx_x", 256 * MIB, 200 * MIB);
        let pods = [from.clone(), cold2, warm.clone()];
        let to = move_target(&pods, &sandbox, &from, Some("m-tpl"), up).map(|p| p.id.as_str());
        assert_eq!(to, Some("cold"));
        // A pod down never wins, however much it holds; nor one without
        // room, nor the pod it moves from.
        let mut down = warm.clone();
        down.silent_s = 9.0;
        let mut full = warm.clone();
        full.id = PodId::new("full");
        full.headroom_mib = 32.0;
        let mut from_warm = warm.clone();
        from_warm.id = from.id.clone();
        let pods = [from_warm, down, full, cold];
        let to = move_target(&pods, &sandbox, &from, Some("m-tpl"), up).map(|p| p.id.as_str());
        assert_eq!(to, Some("cold"));
    }
}
