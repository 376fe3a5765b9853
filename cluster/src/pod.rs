//! A pod in the cluster (`torpor pod serve --cluster ...`): it publishes a
//! heartbeat with its load every period, and takes the operations of its
//! own durable work queue. Each operation id runs at most once: the local
//! journal (SQLite, beside the pod's store) records it before it runs and
//! keeps its outcome; the outcome is published, then the message acked. A
//! message delivered again (the pod died before the ack) republishes the
//! recorded outcome; one that was running when the pod died is reported
//! failed (`interrupted`), never run twice.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use rusqlite::{params, Connection, OptionalExtension};
use torpor_scheduler::model::{PodId, Sandbox, SandboxState};
use torpor_scheduler::service::held::{LayerHeld, MAX_LAYERS_HELD};
use torpor_scheduler::service::ServiceError;
use torpor_sync::Locked;

use torpor_gate::service::SandboxFilter;

use super::expiry::{self, Deadlines};
use super::wire::{
    self, Event, Heartbeat, OpError, OpOutcome, Operation, Reply, WorkItem, MAX_REPORTED,
};
use super::{ClusterConfig, ClusterError};
use torpor_gate::backend::{blocking, SandboxApi};

/// Operations run at once.
const CONCURRENCY: usize = 8;
/// How this pod is reached for the data plane, and its id.
#[derive(Debug, Clone)]
pub struct PodIdentity {
    pub id: PodId,
    pub address: String,
    pub token: String,
    pub fingerprint: Option<String>,
}

/// The journal: operation id → outcome (none while it runs).
#[derive(Debug)]
pub struct Journal {
    db: Mutex<Connection>,
}

fn journal_err(e: rusqlite::Error) -> ClusterError {
    ClusterError::Journal(e.to_string())
}

/// What the journal knows of an operation.
#[derive(Debug, Clone)]
pub enum Journaled {
    New,
    Running,
    Done(OpOutcome),
}

impl Journal {
    pub fn open(path: &Path) -> Result<Self, ClusterError> {
        let db = Connection::open(path).map_err(journal_err)?;
        db.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;
             CREATE TABLE IF NOT EXISTS operations (
                id TEXT PRIMARY KEY,
                outcome TEXT,
                started_at INTEGER NOT NULL DEFAULT (unixepoch())
             );",
        )
        .map_err(journal_err)?;
        Ok(Journal { db: Mutex::new(db) })
    }

    /// Records `op` as running unless the journal has it; what it had.
    pub fn begin(&self, op: &str) -> Result<Journaled, ClusterError> {
        let db = self.db.locked();
        // Prepared once each (the connection's statement cache).
        let row: Option<Option<String>> = db
            .prepare_cached("SELECT outcome FROM operations WHERE id = ?1")
            .and_then(|mut s| s.query_row([op], |r| r.get(0)).optional())
            .map_err(journal_err)?;
        match row {
            None => {
                db.prepare_cached("INSERT INTO operations (id) VALUES (?1)")
                    .and_then(|mut s| s.execute([op]))
                    .map_err(journal_err)?;
                Ok(Journaled::New)
            }
            Some(None) => Ok(Journaled::Running),
            Some(Some(text)) => serde_json::from_str(&text)
                .map(Journaled::Done)
                .map_err(|e| ClusterError::Journal(format!("operation {op}: {e}"))),
        }
    }

    pub fn finish(&self, op: &str, outcome: &OpOutcome) -> Result<(), ClusterError> {
        let text =
            serde_json::to_string(outcome).map_err(|e| ClusterError::Journal(e.to_string()))?;
        let db = self.db.locked();
        db.prepare_cached("UPDATE operations SET outcome = ?2 WHERE id = ?1")
            .and_then(|mut s| s.execute(params![op, text]))
            .map_err(journal_err)?;
        Ok(())
    }
}

/// Runs the pod's cluster side until the process ends.
pub async fn run<S: SandboxApi>(
    service: Arc<S>,
    me: PodIdentity,
    journal: Arc<Journal>,
    config: ClusterConfig,
) -> Result<(), ClusterError> {
    if !wire::valid_pod_id(me.id.as_str()) {
        return Err(ClusterError::Config(format!(
            "pod id {:?}: 1-64 of a-z, 0-9 and -",
            me.id.as_str()
        )));
    }
    let nats = super::connect_nats(&config.urls.nats).await?;
    let js = jetstream::new(nats);
    wire::ensure_streams(&js).await?;
    let layers = Arc::new(Mutex::new(Vec::new()));
    tokio::spawn(layer_figures(
        service.clone(),
        layers.clone(),
        config.heartbeat,
    ));
    tokio::spawn(heartbeats(
        service.clone(),
        me.clone(),
        js.clone(),
        config.heartbeat,
        layers,
    ));
    let running = Arc::new(Mutex::new(HashSet::new()));
    let permits = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
    loop {
        if let Err(e) = work(&service, &me, &journal, &js, &running, &permits).await {
            tracing::warn!(error = %e, "work queue: starting over");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn work<S: SandboxApi>(
    service: &Arc<S>,
    me: &PodIdentity,
    journal: &Arc<Journal>,
    js: &jetstream::Context,
    running: &Arc<Mutex<HashSet<String>>>,
    permits: &Arc<tokio::sync::Semaphore>,
) -> Result<(), ClusterError> {
    let mut messages = wire::durable_messages(
        js,
        wire::WORK_STREAM,
        &wire::pod_consumer(&me.id),
        &wire::work_subject(&me.id),
        wire::ACK_WAIT,
        CONCURRENCY,
    )
    .await?;
    while let Some(message) = messages.next().await {
        let message = message?;
        let item: WorkItem = match serde_json::from_slice(&message.payload) {
            Ok(i) => i,
            Err(e) => {
                // A command of a newer build (a replica upgraded before
                // this pod) fails its operation at once, rather than
                // leaving it pending; anything else is dropped.
                let Some((op, outcome)) = unreadable(&message.payload, &me.id, &e) else {
                    tracing::warn!(error = %e, "a work item that is not one: dropped");
                    let _ = message.ack().await;
                    continue;
                };
                tracing::warn!(operation = %op, error = %e, "a work item this pod cannot read: failed");
                match publish_result(js, &me.id, &op, outcome).await {
                    Ok(()) => {
                        let _ = wire::ack_confirmed(&message).await;
                    }
                    Err(e) => {
                        tracing::warn!(operation = %op, error = %e, "operation left for redelivery");
                        let again = AckKind::Nak(Some(Duration::from_secs(1)));
                        let _ = message.ack_with(again).await;
                    }
                }
                continue;
            }
        };
        if !running.locked().insert(item.operation.clone()) {
            // Delivered again while it runs here: again in a few seconds
            // (then its journaled outcome is published and it is acked),
            // not left unacked until the ack wait.
            let _ = message
                .ack_with(AckKind::Nak(Some(Duration::from_secs(2))))
                .await;
            continue;
        }
        let deadlines = Deadlines::from_headers(message.headers.as_ref());
        // Kept from a redelivery while it waits for its turn and runs.
        let progress = wire::InProgress::start(&message);
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| ClusterError::Nats(e.to_string()))?;
        let (service, me, journal, js, running) = (
            service.clone(),
            me.clone(),
            journal.clone(),
            js.clone(),
            running.clone(),
        );
        tokio::spawn(async move {
            let op = item.operation.clone();
            let taken = take(service, &me, journal, &js, item, deadlines).await;
            drop(progress);
            match taken {
                Ok(()) => {
                    // Confirmed: a lost ack would leave the item to come
                    // again after the ack wait (its journaled outcome
                    // published again), and unacked until then.
                    if let Err(e) = wire::ack_confirmed(&message).await {
                        tracing::warn!(operation = %op, error = %e, "work ack");
                    }
                }
                Err(e) => {
                    // Delivered again in a second rather than after the
                    // ack wait (if NATS is back by then).
                    tracing::warn!(operation = %op, error = %e, "operation left for redelivery");
                    let again = AckKind::Nak(Some(Duration::from_secs(1)));
                    if let Err(e) = message.ack_with(again).await {
                        tracing::warn!(operation = %op, error = %e, "work nak");
                    }
                }
            }
            running.locked().remove(&op);
            drop(permit);
        });
    }
    Ok(())
}

/// Runs `item` unless the journal has it, and publishes its outcome.
async fn take<S: SandboxApi>(
    service: Arc<S>,
    me: &PodIdentity,
    journal: Arc<Journal>,
    js: &jetstream::Context,
    item: WorkItem,
    deadlines: Option<Deadlines>,
) -> Result<(), ClusterError> {
    let pod = me.id.clone();
    let op = item.operation.clone();
    let op_id = op.clone();
    // The journal (SQLite) blocks; the operation is the backend's, async.
    let outcome = async move {
        let begun = blocking(|| journal.begin(&item.operation))?;
        let outcome = match begun {
            Journaled::Done(outcome) => return Ok::<_, ClusterError>(outcome),
            Journaled::Running => OpOutcome::Failed(OpError {
                status: 500,
                code: torpor_gate::error::code::INTERNAL.into(),
                message: format!(
                    "operation {} was interrupted by a restart of pod {pod}: read the sandbox \
                     to see its state",
                    item.operation
                ),
            }),
            Journaled::New => in_time(&*service, &pod, &op_id, item.command, deadlines).await,
        };
        blocking(|| journal.finish(&item.operation, &outcome))?;
        Ok(outcome)
    }
    .await?;
    publish_result(js, &me.id, &op, outcome).await
}

/// Publishes operation `op`'s outcome on `pod`'s events.
async fn publish_result(
    js: &jetstream::Context,
    pod: &PodId,
    op: &str,
    outcome: OpOutcome,
) -> Result<(), ClusterError> {
    let event = Event::Result {
        pod: pod.clone(),
        operation: op.to_string(),
        outcome,
    };
    wire::publish(
        js,
        wire::events_subject(pod),
        Some(&format!("result-{op}")),
        &event,
    )
    .await
}

/// A work item this build cannot read (`error`) that still names its
/// operation (`op_` and hex, as replicas make them): that operation and
/// its failure, 501 `unsupported`, saying to upgrade the pod; none for
/// anything else.
fn unreadable(
    payload: &[u8],
    pod: &PodId,
    error: &serde_json::Error,
) -> Option<(String, OpOutcome)> {
    let item: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let op = item.get("operation")?.as_str()?;
    let hex = op.strip_prefix("op_")?;
    if hex.is_empty() || hex.len() > 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let kind = item["command"]["kind"].as_str().unwrap_or("?");
    let kind: String = kind.chars().take(64).collect();
    let message = format!(
        "pod {pod} cannot read operation {op} (a {kind:?} command: {error}); it was built \
         before that command: upgrade it"
    );
    Some((
        op.to_string(),
        OpOutcome::Failed(wire::failure(ServiceError::Unsupported(message))),
    ))
}

fn named(mut s: Sandbox, pod: &PodId) -> Sandbox {
    s.pod = Some(pod.clone());
    s
}

/// `command` through the one dispatch ([`SandboxApi::operate`]), unless it
/// is taken past its start deadline (refused, not run); a create (or a
/// fork's sandboxes, or a checkpoint) that ended past its expiry deleted
/// again (a replica may have ended its operation: `expiry.rs`).
async fn in_time<S: SandboxApi>(
    service: &S,
    pod: &PodId,
    op: &str,
    command: Operation,
    deadlines: Option<Deadlines>,
) -> OpOutcome {
    let deadlines = deadlines.as_ref();
    if let Some(refused) = expiry::not_started(deadlines, expiry::now_ms(), pod, op) {
        tracing::warn!(operation = op, "taken past its start deadline: not run");
        return refused;
    }
    let create = matches!(command, Operation::Create { .. });
    let outcome = service.operate(command).await.map(|r| r.on_pod(pod));
    let late = expiry::too_late(deadlines, expiry::now_ms(), pod, op);
    let Some(late) = late else {
        return wire::outcome(outcome);
    };
    match outcome {
        Ok(Reply::Sandbox { sandbox, resumed }) if create => {
            match service.delete_sandbox(&sandbox.id).await {
                Ok(()) => late,
                Err(e) => {
                    // It stays: reported as made (its heartbeat lists it,
                    // so it is counted against its tenant's quota).
                    tracing::warn!(operation = op, error = %e, "a late create not deleted");
                    OpOutcome::Done(Reply::Sandbox { sandbox, resumed })
                }
            }
        }
        Ok(Reply::Checkpoint { checkpoint }) => {
            // As a late create: a replica may have ended its operation, so
            // nothing would count it.
            match service
                .delete_checkpoint(&checkpoint.sandbox, &checkpoint.name)
                .await
            {
                Ok(()) => late,
                Err(e) => {
                    tracing::warn!(operation = op, error = %e, "a late checkpoint not deleted");
                    OpOutcome::Done(Reply::Checkpoint { checkpoint })
                }
            }
        }
        Ok(Reply::Sandboxes { sandboxes }) => {
            let mut left = Vec::new();
            for fork in sandboxes {
                if let Err(e) = service.delete_sandbox(&fork.id).await {
                    // As for a create: it stays, listed and counted.
                    tracing::warn!(operation = op, fork = %fork.id, error = %e, "a late fork not deleted");
                    left.push(fork);
                }
            }
            if left.is_empty() {
                late
            } else {
                OpOutcome::Done(Reply::Sandboxes { sandboxes: left })
            }
        }
        outcome => wire::outcome(outcome),
    }
}

/// The pod's load and sandboxes now.
async fn heartbeat<S: SandboxApi>(
    service: &S,
    me: &PodIdentity,
    layers: &Mutex<Vec<LayerHeld>>,
) -> Result<Heartbeat, ServiceError> {
    let load = service
        .pod_entries()
        .await?
        .into_iter()
        .next()
        .unwrap_or_default();
    let headroom_mib = torpor_gate::pods::headroom_mib(&load);
    let mut catalog = service.list_templates().await?;
    let mut templates = Vec::new();
    for t in &catalog {
        templates.push(t.id.to_string());
        templates.push(t.name.clone());
    }
    templates.sort();
    templates.dedup();
    catalog.truncate(MAX_REPORTED);
    let mut images = service.image_names().await?;
    images.truncate(MAX_REPORTED);
    let layers = layers.locked().clone();
    let mut sandboxes = service.list_sandboxes(SandboxFilter::default()).await?;
    let running = sandboxes
        .iter()
        .filter(|s| s.state != SandboxState::Hibernated)
        .count() as u64;
    let hibernated = sandboxes.len() as u64 - running;
    sandboxes.truncate(MAX_REPORTED);
    let sandboxes = sandboxes.into_iter().map(|s| named(s, &me.id)).collect();
    Ok(Heartbeat {
        address: me.address.clone(),
        token: me.token.clone(),
        fingerprint: me.fingerprint.clone(),
        load,
        headroom_mib,
        templates,
        catalog,
        images,
        layers,
        running,
        hibernated,
        sandboxes,
    })
}

/// Keeps `out` to how much of each stored layer the pod holds, for
/// placement (`placement.rs`), read again every `period` (at least 1 s)
/// apart from the heartbeats: reading a manifest the pod has not read
/// yet goes to the object store, which must not hold a heartbeat up
/// (they carry the last figures). None from a backend without its own
/// service; the last figures kept when they cannot be read.
async fn layer_figures<S: SandboxApi>(
    service: Arc<S>,
    out: Arc<Mutex<Vec<LayerHeld>>>,
    period: Duration,
) {
    let mut tick = tokio::time::interval(period.max(Duration::from_secs(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(own) = service.service() else {
            return;
        };
        match torpor_gate::backend::detached(own, |s| s.layers_held(MAX_LAYERS_HELD)).await {
            Ok(layers) => *out.locked() = layers,
            Err(e) => tracing::warn!(error = %e, "the layers held, for placement"),
        }
    }
}

async fn heartbeats<S: SandboxApi>(
    service: Arc<S>,
    me: PodIdentity,
    js: jetstream::Context,
    period: Duration,
    layers: Arc<Mutex<Vec<LayerHeld>>>,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let hb = match heartbeat(&*service, &me, &layers).await {
            Ok(hb) => hb,
            Err(e) => {
                tracing::warn!(error = %e, "heartbeat: the pod's load");
                continue;
            }
        };
        let event = Event::Heartbeat {
            pod: me.id.clone(),
            heartbeat: Box::new(hb),
        };
        if let Err(e) = wire::publish(&js, wire::events_subject(&me.id), None, &event).await {
            tracing::warn!(error = %e, "heartbeat not published");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_journal_runs_an_operation_once() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let path = dir.join("journal.db");
        let _ = std::fs::remove_file(&path);
        let j = Journal::open(&path).unwrap();
        assert!(matches!(j.begin("op_1").unwrap(), Journaled::New));
        // Delivered again before it finished (a restart): it ran, or began.
        let j = Journal::open(&path).unwrap();
        assert!(matches!(j.begin("op_1").unwrap(), Journaled::Running));
        let out = OpOutcome::Failed(OpError {
            status: 409,
            code: "conflict".into(),
            message: "m".into(),
        });
        j.finish("op_1", &out).unwrap();
        match j.begin("op_1").unwrap() {
            Journaled::Done(OpOutcome::Failed(e)) => assert_eq!(e.status, 409),
            other => panic!("{other:?}"),
        }
        assert!(matches!(j.begin("op_2").unwrap(), Journaled::New));
    }

    /// A command of a newer build fails its operation (501, naming the
    /// pod and the kind); what names no operation is dropped.
    #[test]
    fn a_command_this_pod_cannot_read_fails_its_operation() {
        let pod = PodId::new("pod7");
        let read = |payload: &str| {
            let e = serde_json::from_str::<WorkItem>(payload).unwrap_err();
            unreadable(payload.as_bytes(), &pod, &e)
        };
        let newer = r#"{"operation":"op_0a1b","command":{"kind":"template_build","x":1}}"#;
        let (op, outcome) = read(newer).expect("a failed outcome");
        assert_eq!(op, "op_0a1b");
        match outcome {
            OpOutcome::Failed(e) => {
                assert_eq!((e.status, e.code.as_str()), (501, "unsupported"), "{e:?}");
                assert!(e.message.contains("pod pod7"), "{}", e.message);
                assert!(e.message.contains("\"template_build\""), "{}", e.message);
                assert!(e.message.contains("upgrade it"), "{}", e.message);
            }
            other => panic!("{other:?}"),
        }
        // Known to this build: read, not failed.
        let known = r#"{"operation":"op_01","command":{"kind":"delete","sandbox":"sbx_01"}}"#;
        assert!(serde_json::from_str::<WorkItem>(known).is_ok());
        for junk in [
            "not json",
            r#"{"command":{"kind":"x"}}"#,
            r#"{"operation":"op_","command":{"kind":"x"}}"#,
            r#"{"operation":"op_zz","command":{"kind":"x"}}"#,
            r#"{"operation":"sbx_01","command":{"kind":"x"}}"#,
            r#"{"operation":7,"command":{"kind":"x"}}"#,
        ] {
            let e = serde_json::from_str::<WorkItem>(junk).unwrap_err();
            assert!(unreadable(junk.as_bytes(), &pod, &e).is_none(), "{junk}");
        }
        let long = format!(
            r#"{{"operation":"op_{}","command":{{"kind":"x"}}}}"#,
            "a".repeat(65)
        );
        let e = serde_json::from_str::<WorkItem>(&long).unwrap_err();
        assert!(unreadable(long.as_bytes(), &pod, &e).is_none());
    }
}
