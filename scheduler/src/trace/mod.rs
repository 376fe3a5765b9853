//! Activity traces: JSON lines, one event each,
//! `{"t": seconds, "sandbox": "id", "event": "create"|"request"|"delete",
//! "duration_ms": N, "mem_mib": M}`.
//!
//! - `t`: seconds from the trace's start (non-decreasing, at most
//!   [`MAX_T_S`]).
//! - `sandbox`: 1 to [`MAX_ID_LEN`] characters of `[A-Za-z0-9_.:-]`.
//! - `create`: `mem_mib` is the sandbox's memory size (what admission
//!   counts), 1 to [`MAX_MEM_MIB`]; `duration_ms` is not allowed.
//! - `request`: keeps the sandbox active for `duration_ms` (0 to
//!   [`MAX_DURATION_MS`], default 0) and dirties `mem_mib` of its memory
//!   (0 to [`MAX_MEM_MIB`], default 0).
//! - `delete`: no `duration_ms` nor `mem_mib`.
//!
//! A sandbox is created once, before its requests and delete; nothing
//! follows its delete. Every error names its line.
//!
//! `torpor plan` plays them ([`crate::plan`]); `torpor serve
//! --record-trace` writes them from live traffic ([`record`]).

pub mod record;

use std::io::BufRead;

use serde::{Deserialize, Serialize};

/// Latest event time: 30 days.
pub const MAX_T_S: f64 = 30.0 * 24.0 * 3600.0;
/// Longest sandbox id.
pub const MAX_ID_LEN: usize = 128;
/// Largest sandbox memory or request footprint: 1 TiB.
pub const MAX_MEM_MIB: u32 = 1 << 20;
/// Longest request: 24 hours.
pub const MAX_DURATION_MS: u64 = 24 * 3600 * 1000;
/// Longest line, in bytes.
pub const MAX_LINE: usize = 4096;
/// Most events in a trace.
pub const MAX_EVENTS: usize = 5_000_000;
/// Most distinct sandboxes in a trace.
pub const MAX_SANDBOXES: usize = 1_000_000;

/// What happens to a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    Create,
    Request,
    Delete,
}

/// One line of a trace, as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceLine {
    pub t: f64,
    pub sandbox: String,
    pub event: EventKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_mib: Option<u32>,
}

/// One validated event; sandboxes are numbered in order of creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// Milliseconds from the trace's start.
    pub t_ms: i64,
    pub sandbox: usize,
    pub kind: EventKind,
    pub duration_ms: u64,
    pub mem_mib: u32,
}

/// A validated trace.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub events: Vec<Event>,
    /// Sandbox ids, by number.
    pub sandboxes: Vec<String>,
}

/// A trace that cannot be read, with the line (1-based) at fault.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("line {line}: {message}")]
    Invalid { line: usize, message: String },
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
}

fn bad(line: usize, message: impl Into<String>) -> TraceError {
    TraceError::Invalid {
        line,
        message: message.into(),
    }
}

/// Whether `id` may name a sandbox in a trace.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
}

impl Trace {
    /// Reads and validates a trace (blank lines are skipped).
    pub fn read(input: impl BufRead) -> Result<Trace, TraceError> {
        let mut trace = Trace::default();
        // Per sandbox number: deleted yet?
        let mut deleted: Vec<bool> = Vec::new();
        let mut ids = std::collections::HashMap::new();
        let mut last_t = 0.0f64;
        let mut input = input;
        let mut buf = Vec::new();
        let mut n = 0usize;
        loop {
            buf.clear();
            n += 1;
            // Read at most one byte past the limit to know it was passed.
            let got = std::io::Read::take(input.by_ref(), MAX_LINE as u64 + 1)
                .read_until(b'\n', &mut buf)?;
            if got == 0 {
                break;
            }
            if buf.len() > MAX_LINE && buf.last() != Some(&b'\n') {
                return Err(bad(n, format!("longer than {MAX_LINE} bytes")));
            }
            let text = std::str::from_utf8(&buf).map_err(|_| bad(n, "not UTF-8"))?;
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            if trace.events.len() >= MAX_EVENTS {
                return Err(bad(n, format!("more than {MAX_EVENTS} events")));
            }
            let l: TraceLine = serde_json::from_str(text)
                .map_err(|e| bad(n, format!("not a trace event: {e}")))?;
            if !l.t.is_finite() || l.t < 0.0 || l.t > MAX_T_S {
                return Err(bad(
                    n,
                    format!("t {} is outside [0, {MAX_T_S}] seconds", l.t),
                ));
            }
            if l.t < last_t {
                return Err(bad(
                    n,
                    format!(
                        "t {} goes back in time (the previous event is at {last_t})",
                        l.t
                    ),
                ));
            }
            last_t = l.t;
            if !valid_id(&l.sandbox) {
                return Err(bad(
                    n,
                    format!("sandbox id must be 1 to {MAX_ID_LEN} characters of [A-Za-z0-9_.:-]"),
                ));
            }
            if l.duration_ms.is_some_and(|d| d > MAX_DURATION_MS) {
                return Err(bad(n, format!("duration_ms is above {MAX_DURATION_MS}")));
            }
            if l.mem_mib.is_some_and(|m| m > MAX_MEM_MIB) {
                return Err(bad(n, format!("mem_mib is above {MAX_MEM_MIB}")));
            }
            let known = ids.get(l.sandbox.as_str()).copied();
            let sandbox = match (l.event, known) {
                (EventKind::Create, Some(_)) => {
                    return Err(bad(n, format!("sandbox {} is created twice", l.sandbox)))
                }
                (EventKind::Create, None) => {
                    if l.duration_ms.is_some() {
                        return Err(bad(n, "a create has no duration_ms"));
                    }
                    if l.mem_mib.is_none_or(|m| m == 0) {
                        return Err(bad(n, "a create needs mem_mib (the sandbox's size, > 0)"));
                    }
                    if ids.len() >= MAX_SANDBOXES {
                        return Err(bad(n, format!("more than {MAX_SANDBOXES} sandboxes")));
                    }
                    let i = trace.sandboxes.len();
                    ids.insert(l.sandbox.clone(), i);
                    trace.sandboxes.push(l.sandbox.clone());
                    deleted.push(false);
                    i
                }
                (_, None) => {
                    return Err(bad(
                        n,
                        format!("sandbox {} is used before its create", l.sandbox),
                    ))
                }
                (_, Some(i)) if deleted[i] => {
                    return Err(bad(
                        n,
                        format!("sandbox {} is used after its delete", l.sandbox),
                    ))
                }
                (EventKind::Delete, Some(i)) => {
                    if l.duration_ms.is_some() || l.mem_mib.is_some() {
                        return Err(bad(n, "a delete has no duration_ms nor mem_mib"));
                    }
                    deleted[i] = true;
                    i
                }
                (EventKind::Request, Some(i)) => i,
            };
            trace.events.push(Event {
                t_ms: (l.t * 1000.0).round() as i64,
                sandbox,
                kind: l.event,
                duration_ms: l.duration_ms.unwrap_or(0),
                mem_mib: l.mem_mib.unwrap_or(0),
            });
        }
        Ok(trace)
    }

    /// The time of the last event, in ms.
    pub fn end_ms(&self) -> i64 {
        self.events.last().map_or(0, |e| e.t_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(s: &str) -> Result<Trace, TraceError> {
        Trace::read(s.as_bytes())
    }

    fn line_of(e: TraceError) -> usize {
        match e {
            TraceError::Invalid { line, .. } => line,
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_good_trace_reads() {
        let t = read(concat!(
            r#"{"t":0,"sandbox":"a","event":"create","mem_mib":256}"#,
            "\n\n",
            r#"{"t":1.5,"sandbox":"a","event":"request","duration_ms":200,"mem_mib":3}"#,
            "\n",
            r#"{"t":2,"sandbox":"a","event":"delete"}"#,
        ))
        .unwrap();
        assert_eq!(t.events.len(), 3);
        assert_eq!(t.events[1].t_ms, 1500);
        assert_eq!(t.events[1].duration_ms, 200);
        assert_eq!(t.sandboxes, vec!["a".to_string()]);
        assert_eq!(t.end_ms(), 2000);
    }

    #[test]
    fn errors_name_their_line() {
        let c = r#"{"t":0,"sandbox":"a","event":"create","mem_mib":64}"#;
        for (body, line, needle) in [
            ("{", 1, "not a trace event"),
            (r#"{"t":0,"sandbox":"a","event":"boot"}"#, 1, "not a trace event"),
            (r#"{"t":0,"sandbox":"a","event":"create","mem_mib":1,"x":1}"#, 1, "unknown field"),
            (&format!("{c}\n{c}"), 2, "created twice"),
            (&format!("{c}\n{{\"t\":-1,\"sandbox\":\"a\",\"event\":\"delete\"}}"), 2, "outside"),
            (&format!("{c}\n{{\"t\":1e300,\"sandbox\":\"a\",\"event\":\"delete\"}}"), 2, "outside"),
            (r#"{"t":0,"sandbox":"b","event":"request"}"#, 1, "before its create"),
            (r#"{"t":0,"sandbox":"a b","event":"create","mem_mib":1}"#, 1, "sandbox id"),
            (r#"{"t":0,"sandbox":"a","event":"create"}"#, 1, "needs mem_mib"),
            (r#"{"t":0,"sandbox":"a","event":"create","mem_mib":0}"#, 1, "needs mem_mib"),
            (r#"{"t":0,"sandbox":"a","event":"create","mem_mib":99999999}"#, 1, "above"),
            (&format!("{c}\n{{\"t\":1,\"sandbox\":\"a\",\"event\":\"request\",\"duration_ms\":999999999999}}"), 2, "above"),
            (&format!("\n{c}\n{{\"t\":1,\"sandbox\":\"a\",\"event\":\"delete\"}}\n{{\"t\":2,\"sandbox\":\"a\",\"event\":\"request\"}}"), 4, "after its delete"),
            ("{\"t\":5,\"sandbox\":\"a\",\"event\":\"create\",\"mem_mib\":1}\n{\"t\":4,\"sandbox\":\"a\",\"event\":\"request\"}", 2, "back in time"),
            (&format!("{c}\n{{\"t\":1,\"sandbox\":\"a\",\"event\":\"delete\",\"mem_mib\":1}}"), 2, "a delete has no"),
        ] {
            let e = read(body).unwrap_err();
            assert!(e.to_string().contains(needle), "{body}: {e}");
            assert_eq!(line_of(e), line, "{body}");
        }
        let long = format!("{{\"t\":0,\"sandbox\":\"{}\"}}", "a".repeat(MAX_LINE));
        assert!(read(&long).unwrap_err().to_string().contains("longer than"));
        assert!(read("\u{0}\u{ff}").is_err());
        assert!(Trace::read(&[0xffu8, b'\n'][..])
            .unwrap_err()
            .to_string()
            .contains("UTF-8"));
    }
}
