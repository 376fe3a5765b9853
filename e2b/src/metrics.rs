//! E2B's `GET /sandboxes/{id}/metrics?start=&end=` (the SDKs'
//! `get_metrics` / `getMetrics`): the sandbox's samples from its pod's
//! history (`service/history.rs`, one every 5 s, the last 1440) as E2B's
//! `SandboxMetric`s, oldest first.
//!
//! As E2B's API: `start` and `end` are unix seconds (integers, at least
//! 0), both included; `start` defaults to the sandbox's start and `end`
//! to whenever the read's own sample is taken (on the sandbox's pod,
//! which may be a second after the replica's now); `start` after `end` is
//! 400. A range of an hour or more is given in coarser steps, as E2B's
//! (`CalculateStep`): one entry per step, the mean CPU and memory of the
//! samples in it, stamped with the step's start.

use std::collections::BTreeMap;

use axum::extract::{Path, RawQuery};
use axum::response::{IntoResponse, Response};
use axum::Json;
use torpor_scheduler::model::Timestamp;
use torpor_scheduler::service::history::MetricSample;

use super::error::E2bError;
use super::request::query_pairs;
use super::routes::live;
use super::wire::SandboxMetric;
use torpor_gate::backend::SandboxApi;
use torpor_gate::handlers::{call, Api};
use torpor_gate::wire::Range;

/// E2B's step for a range of `secs` seconds (its `CalculateStep`).
fn step_seconds(secs: i64) -> i64 {
    const HOUR: i64 = 3600;
    match secs {
        s if s < HOUR => 5,
        s if s < 6 * HOUR => 30,
        s if s < 12 * HOUR => 60,
        s if s < 24 * HOUR => 120,
        s if s < 7 * 24 * HOUR => 300,
        _ => 900,
    }
}

/// A unix-seconds parameter: an integer, at least 0 (else 400).
fn seconds(q: &BTreeMap<String, String>, name: &str) -> Result<Option<i64>, E2bError> {
    q.get(name)
        .map(|v| {
            v.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                E2bError::bad_request(format!("{name} {v:?} is not a unix time in seconds"))
            })
        })
        .transpose()
}

fn metric(s: &MetricSample, at: Timestamp) -> SandboxMetric {
    SandboxMetric {
        timestamp: super::time::format(at),
        timestamp_unix: at.0.div_euclid(1000),
        cpu_count: s.cpu_count,
        cpu_used_pct: s.cpu_used_pct,
        mem_used: s.mem_used_bytes,
        mem_total: s.mem_total_bytes,
        mem_cache: 0,
        disk_used: s.disk_used_bytes,
        disk_total: s.disk_total_bytes,
    }
}

/// The samples as E2B's entries, `step` seconds apart at most one each
/// (a step of 5 s or less: each sample as it was taken).
pub fn entries(samples: &[MetricSample], step: i64) -> Vec<SandboxMetric> {
    if step <= 5 {
        return samples.iter().map(|s| metric(s, s.at)).collect();
    }
    let step_ms = step * 1000;
    let mut out = Vec::new();
    let mut bucket: &[MetricSample] = &[];
    let mut start = 0;
    for (i, s) in samples.iter().enumerate() {
        if bucket
            .first()
            .is_some_and(|f| f.at.0.div_euclid(step_ms) != s.at.0.div_euclid(step_ms))
        {
            out.extend(mean(bucket, step_ms));
            start = i;
        }
        bucket = &samples[start..=i];
    }
    out.extend(mean(bucket, step_ms));
    out
}

/// One entry for the samples of one step: the mean CPU and memory used,
/// the rest as the last sample had it, stamped with the step's start.
fn mean(bucket: &[MetricSample], step_ms: i64) -> Option<SandboxMetric> {
    let last = bucket.last()?;
    let n = bucket.len() as f64;
    let mut m = metric(last, Timestamp(last.at.0.div_euclid(step_ms) * step_ms));
    m.cpu_used_pct = bucket.iter().map(|s| s.cpu_used_pct).sum::<f64>() / n;
    m.mem_used = (bucket.iter().map(|s| s.mem_used_bytes as f64).sum::<f64>() / n) as u64;
    Some(m)
}

/// `GET /sandboxes/{id}/metrics`.
pub async fn get<S: SandboxApi>(
    state: Api<S>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<Response, E2bError> {
    let q = query_pairs(raw);
    let (start, end) = (seconds(&q, "start")?, seconds(&q, "end")?);
    let out = call(&state, move |s| async move {
        let s = &*s;
        let sandbox = live(s, &id).await?;
        let start = start.unwrap_or(sandbox.created_at.0.div_euclid(1000));
        // No `end`: open-ended, so that the sample the read takes now (on
        // the sandbox's pod, perhaps a second later than this replica's
        // now) is in the answer.
        let until = end;
        let end = end.unwrap_or(Timestamp::now().0.div_euclid(1000));
        if start > end {
            return Err(torpor_gate::service::ServiceError::Invalid(
                "Invalid time range for metrics: start time cannot be after end time".into(),
            ));
        }
        let range = Range {
            from: Some(Timestamp(start.saturating_mul(1000))),
            to: until.map(|end| Timestamp(end.saturating_mul(1000).saturating_add(999))),
        };
        let samples = s.metrics_history(&sandbox.id, range).await?;
        Ok(entries(&samples, step_seconds(end - start)))
    })
    .await?;
    Ok(Json(out).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_ms: i64, cpu: f64, mem: u64) -> MetricSample {
        MetricSample {
            at: Timestamp(at_ms),
            cpu_count: 1,
            cpu_used_pct: cpu,
            mem_used_bytes: mem,
            mem_total_bytes: 512,
            disk_used_bytes: 7,
            disk_total_bytes: 7,
        }
    }

    #[test]
    fn short_ranges_give_every_sample_long_ones_steps() {
        let samples: Vec<MetricSample> = (0..12)
            .map(|i| sample(1_000_000 + i * 5000, i as f64, 100 + i as u64))
            .collect();
        let all = entries(&samples, step_seconds(59 * 60));
        assert_eq!(all.len(), 12);
        assert_eq!(all[0].timestamp_unix, 1000);
        assert_eq!(all[0].timestamp, "1970-01-01T00:16:40.000Z");
        assert_eq!((all[3].mem_total, all[3].disk_total), (512, 7));
        // An hour or more: 30 s steps, means of what each holds.
        let coarse = entries(&samples, step_seconds(3600));
        assert_eq!(
            coarse.iter().map(|m| m.timestamp_unix).collect::<Vec<_>>(),
            [990, 1020, 1050]
        );
        assert_eq!(coarse[0].cpu_used_pct, 1.5);
        assert_eq!(coarse[0].mem_used, 101);
        assert_eq!(step_seconds(8 * 24 * 3600), 900);
    }

    #[test]
    fn start_and_end_are_unix_seconds() {
        let q: BTreeMap<String, String> = [("start".to_string(), "12".to_string())].into();
        assert_eq!(seconds(&q, "start").unwrap(), Some(12));
        assert_eq!(seconds(&q, "end").unwrap(), None);
        for bad in ["-1", "x", "1.5"] {
            let q: BTreeMap<String, String> = [("end".to_string(), bad.to_string())].into();
            assert!(seconds(&q, "end").is_err(), "{bad}");
        }
    }
}
