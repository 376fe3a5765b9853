//! `torpor serve --record-trace FILE`: live traffic written as a trace
//! `torpor plan` reads (see [`super`]). Creates (admitted or not),
//! requests (wakes, resumes, guest calls: exec, files) and deletes are
//! queued on a bounded channel to a writer thread; when the writer falls
//! behind, events are dropped and counted rather than slowing requests
//! down. Times are seconds since the recording started, never going back
//! (an event finished late is written at the latest time written). A
//! sandbox first seen after the recording started gets a `create` line
//! first, so the trace stands on its own.

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::time::Instant;

use super::{EventKind, TraceLine, MAX_DURATION_MS, MAX_SANDBOXES};

/// Events queued for the writer at most.
const QUEUE: usize = 16 * 1024;

struct Record {
    at: Instant,
    sandbox: String,
    kind: EventKind,
    duration_ms: u64,
    mem_mib: u32,
}

/// The recorder: cheap to call from request threads.
#[derive(Debug)]
pub struct Recorder {
    /// None once dropping: the writer then drains the queue and ends.
    tx: Option<SyncSender<Record>>,
    writer: Option<std::thread::JoinHandle<()>>,
    dropped: AtomicU64,
}

impl Recorder {
    /// Creates (truncates) `path` and starts the writer thread, which ends
    /// when the recorder is dropped.
    pub fn start(path: &Path) -> std::io::Result<Recorder> {
        let file = std::fs::File::create(path)?;
        let (tx, rx) = sync_channel::<Record>(QUEUE);
        let started = Instant::now();
        let writer = std::thread::Builder::new()
            .name("trace-recorder".into())
            .spawn(move || {
                let mut out = std::io::BufWriter::new(file);
                let mut seen: HashSet<String> = HashSet::new();
                let mut last = 0.0f64;
                loop {
                    let r = match rx.try_recv() {
                        Ok(r) => r,
                        Err(_) => {
                            // Flushed when idle, so the file is current.
                            let _ = out.flush();
                            match rx.recv() {
                                Ok(r) => r,
                                Err(_) => return,
                            }
                        }
                    };
                    let t =
                        r.at.saturating_duration_since(started)
                            .as_secs_f64()
                            .max(last);
                    last = t;
                    let t = (t * 1000.0).round() / 1000.0;
                    let known = seen.contains(&r.sandbox);
                    if !known && seen.len() >= MAX_SANDBOXES {
                        continue;
                    }
                    let mut lines = Vec::new();
                    if !known {
                        seen.insert(r.sandbox.clone());
                        lines.push(TraceLine {
                            t,
                            sandbox: r.sandbox.clone(),
                            event: EventKind::Create,
                            duration_ms: None,
                            mem_mib: Some(r.mem_mib.max(1)),
                        });
                    }
                    match r.kind {
                        EventKind::Create if !known => {}
                        // A create of an id already seen is not possible.
                        EventKind::Create => {}
                        EventKind::Request => lines.push(TraceLine {
                            t,
                            sandbox: r.sandbox.clone(),
                            event: EventKind::Request,
                            duration_ms: Some(r.duration_ms.min(MAX_DURATION_MS)),
                            mem_mib: Some(0),
                        }),
                        EventKind::Delete => {
                            seen.remove(&r.sandbox);
                            lines.push(TraceLine {
                                t,
                                sandbox: r.sandbox,
                                event: EventKind::Delete,
                                duration_ms: None,
                                mem_mib: None,
                            });
                        }
                    }
                    for l in lines {
                        let ok = serde_json::to_writer(&mut out, &l).is_ok()
                            && out.write_all(b"\n").is_ok();
                        if !ok {
                            tracing::warn!("trace recorder: write failed; recording stops");
                            return;
                        }
                    }
                }
            })?;
        Ok(Recorder {
            tx: Some(tx),
            writer: Some(writer),
            dropped: AtomicU64::new(0),
        })
    }

    /// Records `kind` on `sandbox` (of `mem_mib`), at `at`, lasting
    /// `duration_ms` (requests).
    pub fn record(
        &self,
        at: Instant,
        sandbox: &str,
        kind: EventKind,
        duration_ms: u64,
        mem_mib: u32,
    ) {
        let r = Record {
            at,
            sandbox: sandbox.to_string(),
            kind,
            duration_ms,
            mem_mib,
        };
        let Some(tx) = &self.tx else {
            return;
        };
        match tx.try_send(r) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::warn!("trace recorder behind: {n} events dropped");
                }
            }
        }
    }

    /// Events dropped so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl Drop for Recorder {
    /// Writes what is queued and flushes the file.
    fn drop(&mut self) {
        self.tx = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Trace;

    #[test]
    fn recorded_events_read_back_as_a_trace() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let path = dir.join("t.jsonl");
        let r = Recorder::start(&path).unwrap();
        let t0 = Instant::now();
        r.record(t0, "sbx_a", EventKind::Create, 0, 256);
        // A request finished late, recorded with its earlier start.
        r.record(
            t0 + std::time::Duration::from_millis(50),
            "sbx_a",
            EventKind::Request,
            40,
            256,
        );
        r.record(
            t0 + std::time::Duration::from_millis(10),
            "sbx_a",
            EventKind::Request,
            0,
            256,
        );
        // Seen first after the recording started: a create comes first.
        r.record(t0, "sbx_b", EventKind::Request, 5, 128);
        r.record(t0, "sbx_a", EventKind::Delete, 0, 256);
        assert_eq!(r.dropped(), 0);
        drop(r);
        let text = std::fs::read_to_string(&path).unwrap();
        let trace = Trace::read(text.as_bytes()).unwrap();
        assert_eq!(trace.sandboxes, ["sbx_a", "sbx_b"]);
        let kinds: Vec<EventKind> = trace.events.iter().map(|e| e.kind).collect();
        use EventKind::*;
        assert_eq!(kinds, [Create, Request, Request, Create, Request, Delete]);
        assert_eq!(trace.events[3].mem_mib, 128);
        // Never back in time.
        assert!(trace.events.windows(2).all(|w| w[0].t_ms <= w[1].t_ms));
    }
}
