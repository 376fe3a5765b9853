//! What the API tier and the pods send each other over NATS JetStream: the
//! streams, their subjects, and the messages (JSON, checked on receipt).
//!
//! - `TORPOR_WORK` (limits retention, file storage): `torpor.work.<pod>`, one
//!   [`WorkItem`] per operation, deduplicated by its operation id; each
//!   pod consumes its own subject through its durable consumer
//!   `pod-<pod>`.
//! - `TORPOR_EVENTS` (limits retention, file storage): `torpor.events.<pod>`,
//!   the pods' [`Event`]s (results of operations and heartbeats), consumed
//!   by the API tier's one durable consumer `api` (whichever replica pulls
//!   a message writes it to PostgreSQL, then acks it).

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use torpor_scheduler::model::{PodId, Sandbox, Template};
use torpor_scheduler::service::held::{LayerHeld, MAX_LAYERS_HELD};
use torpor_scheduler::service::ServiceError;

use super::ClusterError;
use torpor_gate::error::ApiError;
pub use torpor_sandbox_api::{OpError, OpOutcome, Operation, Reply};

pub const WORK_STREAM: &str = "TORPOR_WORK";
pub const EVENTS_STREAM: &str = "TORPOR_EVENTS";
/// The API tier's durable consumer of [`EVENTS_STREAM`].
pub const API_CONSUMER: &str = "api";
/// Largest message either side accepts (the server's own limit is 1 MiB).
pub const MAX_MESSAGE: usize = 1 << 20;

pub fn work_subject(pod: &PodId) -> String {
    format!("torpor.work.{}", pod.as_str())
}

pub fn events_subject(pod: &PodId) -> String {
    format!("torpor.events.{}", pod.as_str())
}

pub fn pod_consumer(pod: &PodId) -> String {
    format!("pod-{}", pod.as_str())
}

/// A pod id usable in a subject and a consumer name: 1-64 of
/// `[a-z0-9-]`.
pub fn valid_pod_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// One operation for one pod. Its deadlines, if it has any, travel as
/// headers beside it, not as fields (`expiry.rs`: an older pod refuses an
/// unknown field).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkItem {
    pub operation: String,
    /// The operation itself (the contract's, as the pod dispatches it).
    pub command: Operation,
}

/// `e` as its operation's failure: what the pod's own API would answer.
pub fn failure(e: ServiceError) -> OpError {
    ApiError::from(e).into()
}

/// An operation's outcome from what the dispatch answered.
pub fn outcome(r: Result<Reply, ServiceError>) -> OpOutcome {
    r.map_err(failure).into()
}

/// A pod's load and reach, every heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// Its API for the data plane: `tcp:LOOPBACK:PORT`, `tls:HOST:PORT`
    /// or `unix:/PATH`.
    pub address: String,
    /// The bearer token of that API.
    pub token: String,
    /// A `tls:` address's certificate fingerprint.
    pub fingerprint: Option<String>,
    /// Its `GET /v1/pods` entry (memory, ratio, committed, counts).
    pub load: Value,
    /// Admission headroom, MiB.
    pub headroom_mib: f64,
    /// Template ids and names present.
    pub templates: Vec<String>,
    /// Those templates as its `GET /v1/templates` lists them (at most
    /// 2000), for the cluster's list (`catalog.rs`); none from a pod
    /// built before it was sent.
    #[serde(default)]
    pub catalog: Vec<Template>,
    /// The images it has installed (at most 2000; none from a pod built
    /// before it was sent), for the cluster's images index.
    #[serde(default)]
    pub images: Vec<String>,
    /// How much of each stored layer it holds (its templates' and its
    /// hibernated sandboxes'; at most [`MAX_LAYERS_HELD`], the most held
    /// first; none from a pod without an object store or built before it
    /// was sent), for placement (`placement.rs`).
    #[serde(default)]
    pub layers: Vec<LayerHeld>,
    pub running: u64,
    pub hibernated: u64,
    /// Every sandbox it holds, as it is now (states changed by the pod
    /// itself: keep-alive hibernation, timeouts).
    pub sandboxes: Vec<Sandbox>,
}

/// Longest manifest id, template or sandbox id and template name a
/// heartbeat's layers carry.
pub const MAX_LAYER_NAME: usize = 128;

/// Most entries a heartbeat's lists carry (a pod truncates its own; past
/// it, sandboxes' states come with results only).
pub const MAX_REPORTED: usize = 2000;

impl Heartbeat {
    /// What a replica checks before it writes a heartbeat of `pod`: its
    /// lists within [`MAX_REPORTED`], its sandboxes its own, its images'
    /// names plain (they are shown to tenants and put in pods' URLs).
    pub fn check(&self, pod: &PodId) -> Result<(), String> {
        for (what, n) in [
            ("sandboxes", self.sandboxes.len()),
            ("templates", self.catalog.len()),
            ("images", self.images.len()),
        ] {
            if n > MAX_REPORTED {
                return Err(format!(
                    "pod {pod} reports {n} {what}, more than {MAX_REPORTED}"
                ));
            }
        }
        if self.layers.len() > MAX_LAYERS_HELD {
            return Err(format!(
                "pod {pod} reports {} layers, more than {MAX_LAYERS_HELD}",
                self.layers.len()
            ));
        }
        if let Some(l) = self.layers.iter().find(|l| {
            [Some(&l.layer), Some(&l.of), l.name.as_ref()]
                .into_iter()
                .flatten()
                .any(|t| t.len() > MAX_LAYER_NAME)
        }) {
            let shown: String = l.layer.chars().take(64).collect();
            return Err(format!(
                "pod {pod} reports a layer named past {MAX_LAYER_NAME} bytes: {shown:?}"
            ));
        }
        if let Some(s) = self
            .sandboxes
            .iter()
            .find(|s| s.pod.as_ref().is_some_and(|p| p != pod))
        {
            return Err(format!("pod {pod} reports sandbox {} of another pod", s.id));
        }
        if let Some(bad) = self
            .images
            .iter()
            .find(|i| !torpor_scheduler::images::is_plain_name(i))
        {
            let shown: String = bad.chars().take(64).collect();
            return Err(format!("pod {pod} reports an image named {shown:?}"));
        }
        Ok(())
    }
}

/// What a pod publishes on its events subject.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case", deny_unknown_fields)]
pub enum Event {
    Heartbeat {
        pod: PodId,
        heartbeat: Box<Heartbeat>,
    },
    Result {
        pod: PodId,
        operation: String,
        outcome: OpOutcome,
    },
}

/// The two streams, made if missing (either side may come up first).
///
/// Limits retention, not a work queue: an ack moves only the consumer's
/// state, messages go by age (and size). In a work queue an ack also
/// removes the message, and a kill -9 of nats-server (2.9) could keep the
/// removal but lose the consumer's ack: the consumer then held the removed
/// message as delivered and unacked for ever (it cannot be delivered again
/// to be acked; the chaos run's last unacked work item). Now a message
/// whose ack was lost is there to be delivered again, and each side takes
/// a message twice harmlessly (the pod's journal, a result applied once, a
/// heartbeat's generation). Streams made by an older build stay work
/// queues (nats-server does not change a stream's retention).
pub async fn ensure_streams(js: &jetstream::Context) -> Result<(), ClusterError> {
    for (name, subjects, max_age) in [
        (WORK_STREAM, "torpor.work.*", Duration::from_secs(24 * 3600)),
        // Heartbeats every second: kept for less. A result past it is
        // republished by the pod when a retry of its operation comes.
        (EVENTS_STREAM, "torpor.events.*", Duration::from_secs(3600)),
    ] {
        js.get_or_create_stream(stream::Config {
            name: name.to_string(),
            subjects: vec![subjects.to_string()],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            max_message_size: MAX_MESSAGE as i32,
            max_age,
            max_bytes: 1 << 30,
            discard: stream::DiscardPolicy::Old,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map_err(|e| ClusterError::Nats(format!("stream {name}: {e}")))?;
    }
    Ok(())
}

/// How long a consumer waits for an ack before it delivers a message
/// again. Short, so that an ack lost across a restart of nats-server (a
/// kill -9 can drop the consumer's last acks before they are on disk) is
/// made up for soon; a message worked on for longer is kept by progress
/// acks ([`InProgress`]).
pub const ACK_WAIT: Duration = Duration::from_secs(10);
/// The period of those progress acks.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(3);
/// How long [`ack_confirmed`] keeps trying.
const ACK_PATIENCE: Duration = Duration::from_secs(20);

/// The messages of a durable pull consumer of `stream` (made if missing),
/// pulled `batch` at a time,
/// its errors as [`ClusterError::Nats`]. A message pulled waits unacked in
/// the client until it is taken: a small batch keeps few waiting.
pub async fn durable_messages(
    js: &jetstream::Context,
    stream: &str,
    name: &str,
    filter: &str,
    ack_wait: Duration,
    batch: usize,
) -> Result<
    impl futures_util::Stream<Item = Result<jetstream::Message, ClusterError>> + Unpin,
    ClusterError,
> {
    let s = js
        .get_stream(stream)
        .await
        .map_err(|e| ClusterError::Nats(format!("stream {stream}: {e}")))?;
    let config = consumer::pull::Config {
        durable_name: Some(name.to_string()),
        filter_subject: filter.to_string(),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait,
        ..Default::default()
    };
    let consumer: consumer::PullConsumer = s
        .get_or_create_consumer(name, config)
        .await
        .map_err(|e| ClusterError::Nats(format!("consumer {name}: {e}")))?;
    let had = consumer.cached_info().config.ack_wait;
    if had != ack_wait {
        // Made by an older build (nats-server 2.9 cannot update it in
        // place): messages whose ack is lost come again after `had`.
        tracing::warn!(consumer = name, ?had, want = ?ack_wait, "a consumer with another ack wait");
    }
    let messages = consumer
        .stream()
        .max_messages_per_batch(batch)
        .heartbeat(Duration::from_secs(5))
        .messages()
        .await
        .map_err(|e| ClusterError::Nats(e.to_string()))?;
    Ok(futures_util::StreamExt::map(messages, |m| {
        m.map_err(|e| ClusterError::Nats(e.to_string()))
    }))
}

/// Acks `message` and waits for the server's confirmation, again (NATS may
/// be restarting) until it comes or [`ACK_PATIENCE`] has passed. A plain
/// ack is sent and forgotten: one lost with a restart of nats-server left
/// its message delivered but unacked until the ack wait.
pub async fn ack_confirmed(message: &jetstream::Message) -> Result<(), ClusterError> {
    let deadline = tokio::time::Instant::now() + ACK_PATIENCE;
    let mut pause = Duration::from_millis(100);
    loop {
        match message.double_ack().await {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() + pause >= deadline => {
                return Err(ClusterError::Nats(format!("ack: {e}")))
            }
            Err(_) => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// While it lives, a progress ack (`+WPI`, which starts the message's ack
/// wait over) every [`PROGRESS_EVERY`]: a message worked on for longer
/// than [`ACK_WAIT`] is not delivered again meanwhile.
#[derive(Debug)]
pub struct InProgress(tokio::task::JoinHandle<()>);

impl InProgress {
    pub fn start(message: &jetstream::Message) -> Self {
        let message = message.clone();
        InProgress(tokio::spawn(async move {
            let mut tick = tokio::time::interval(PROGRESS_EVERY);
            tick.tick().await;
            loop {
                tick.tick().await;
                if let Err(e) = message.ack_with(jetstream::AckKind::Progress).await {
                    tracing::debug!(error = %e, "progress ack");
                }
            }
        }))
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What one stream holds now: messages stored (acked ones too, until their
/// age; a stream made as a work queue by an older build keeps only those
/// not acked yet) and, per consumer, those not delivered yet and
/// those delivered but not acked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backlog {
    pub stream: String,
    pub messages: u64,
    /// (consumer, not delivered, delivered and unacked)
    pub consumers: Vec<(String, u64, usize)>,
}

impl Backlog {
    /// Nothing left for a consumer: none undelivered, none unacked (the
    /// stream's own count keeps acked messages).
    pub fn is_empty(&self) -> bool {
        self.consumers.iter().all(|c| c.1 == 0 && c.2 == 0)
    }
}

/// The backlog of both streams (operators and the chaos checks: nothing
/// is left unacked once the cluster is quiet).
pub async fn backlog(js: &jetstream::Context) -> Result<Vec<Backlog>, ClusterError> {
    use futures_util::TryStreamExt;
    let nats = |e: &dyn std::fmt::Display| ClusterError::Nats(e.to_string());
    let mut all = Vec::new();
    for name in [WORK_STREAM, EVENTS_STREAM] {
        let mut s = js.get_stream(name).await.map_err(|e| nats(&e))?;
        let messages = s.info().await.map_err(|e| nats(&e))?.state.messages;
        let mut consumers = Vec::new();
        let mut list = s.consumers();
        while let Some(c) = list.try_next().await.map_err(|e| nats(&e))? {
            consumers.push((c.name, c.num_pending, c.num_ack_pending));
        }
        all.push(Backlog {
            stream: name.to_string(),
            messages,
            consumers,
        });
    }
    Ok(all)
}

/// [`backlog`] of the server at `url`, on a connection of its own.
pub async fn backlog_at(url: &str) -> Result<Vec<Backlog>, ClusterError> {
    let js = jetstream::new(super::connect_nats(url).await?);
    backlog(&js).await
}

/// Publishes `value` on `subject` and waits for the stream's ack;
/// `msg_id` deduplicates a republish.
pub async fn publish<T: Serialize>(
    js: &jetstream::Context,
    subject: String,
    msg_id: Option<&str>,
    value: &T,
) -> Result<(), ClusterError> {
    publish_with(js, subject, msg_id, async_nats::HeaderMap::new(), value).await
}

/// [`publish`] with these `headers` too.
pub async fn publish_with<T: Serialize>(
    js: &jetstream::Context,
    subject: String,
    msg_id: Option<&str>,
    mut headers: async_nats::HeaderMap,
    value: &T,
) -> Result<(), ClusterError> {
    let body = serde_json::to_vec(value).map_err(|e| ClusterError::Nats(e.to_string()))?;
    if body.len() > MAX_MESSAGE {
        return Err(ClusterError::Nats(format!(
            "a message of {} bytes is over the {MAX_MESSAGE} byte limit",
            body.len()
        )));
    }
    if let Some(id) = msg_id {
        headers.insert("Nats-Msg-Id", id);
    }
    js.publish_with_headers(subject, headers, body.into())
        .await
        .map_err(|e| ClusterError::Nats(e.to_string()))?
        .await
        .map_err(|e| ClusterError::Nats(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_what_the_api_answers() {
        let e = failure(ServiceError::Invalid("bad".into()));
        assert_eq!((e.status, e.code.as_str()), (400, "invalid_request"));
        assert!(matches!(
            outcome(Err(ServiceError::Unsupported("no".into()))),
            OpOutcome::Failed(OpError { status: 501, .. })
        ));
    }

    #[test]
    fn heartbeats_are_checked_on_receipt() {
        let pod = PodId::new("pod1");
        let beat = |images: Value| -> Heartbeat {
            serde_json::from_value(serde_json::json!({
                "address": "tcp:127.0.0.1:1", "token": "t", "fingerprint": null,
                "load": {}, "headroom_mib": 1.0, "templates": [], "images": images,
                "running": 0, "hibernated": 0, "sandboxes": [],
            }))
            .unwrap()
        };
        beat(serde_json::json!(["debian", "deb-12.1_x"]))
            .check(&pod)
            .unwrap();
        for bad in [serde_json::json!(["../etc"]), serde_json::json!(["a b"])] {
            let e = beat(bad).check(&pod).unwrap_err();
            assert!(e.contains("an image named"), "{e}");
        }
        let many: Vec<String> = (0..=MAX_REPORTED).map(|i| format!("i{i}")).collect();
        let e = beat(serde_json::json!(many)).check(&pod).unwrap_err();
        assert!(e.contains("more than 2000"), "{e}");
    }

    #[test]
    fn a_heartbeat_carries_its_layers_within_bounds() {
        let pod = PodId::new("pod1");
        let beat = |layers: Value| -> Result<Heartbeat, serde_json::Error> {
            serde_json::from_value(serde_json::json!({
                "address": "tcp:127.0.0.1:1", "token": "t", "fingerprint": null,
                "load": {}, "headroom_mib": 1.0, "templates": [], "layers": layers,
                "running": 0, "hibernated": 0, "sandboxes": [],
            }))
        };
        let one = |i: usize| {
            serde_json::json!({"layer": format!("1767225600000-{i:016x}"), "of": "tpl_1",
                "name": "probe", "bytes": 4 << 20, "held": 3 << 20})
        };
        let hb = beat(serde_json::json!([one(0)])).unwrap();
        hb.check(&pod).unwrap();
        assert_eq!(hb.layers[0].held, 3 << 20);
        assert_eq!(hb.layers[0].name.as_deref(), Some("probe"));
        // A pod built before them sends none.
        let old = serde_json::json!({
            "address": "tcp:127.0.0.1:1", "token": "t", "fingerprint": null,
            "load": {}, "headroom_mib": 1.0, "templates": [],
            "running": 0, "hibernated": 0, "sandboxes": [],
        });
        assert!(serde_json::from_value::<Heartbeat>(old)
            .unwrap()
            .layers
            .is_empty());
        let many: Vec<Value> = (0..=MAX_LAYERS_HELD).map(one).collect();
        let e = beat(Value::Array(many)).unwrap().check(&pod).unwrap_err();
        assert!(e.contains("more than 256"), "{e}");
        let mut long = one(1);
        long["of"] = Value::String("x".repeat(MAX_LAYER_NAME + 1));
        let e = beat(serde_json::json!([long]))
            .unwrap()
            .check(&pod)
            .unwrap_err();
        assert!(e.contains("past 128 bytes"), "{e}");
    }
}
