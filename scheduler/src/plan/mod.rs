//! The planner behind `torpor plan`: an activity trace ([`trace`]) played
//! on a simulated pod ([`sim`]) that runs the service's own admission and
//! policy code ([`crate::policy`]) for each candidate setting, costed by a
//! [`calibration`] of this host; a recommendation for a stated target, and
//! an SVG chart ([`svg`]). `torpor serve --record-trace` writes traces
//! from live traffic ([`crate::trace::record`]).

pub mod calibration;
pub mod sim;
pub mod svg;

use serde::Serialize;

pub use calibration::{Calibration, CalibrationError};
pub use sim::{simulate, Limit, Outcome, PodShape, Setting};
// The traces it plays, also named here (`plan::trace`).
pub use crate::trace;
pub use crate::trace::{Trace, TraceError};

/// Most settings one plan compares.
pub const MAX_SETTINGS: usize = 256;

/// What an operator asks of a setting.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Target {
    pub wake_p99_ms: f64,
    pub max_reject_pct: f64,
}

/// A plan: every setting's outcome and the recommendation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub calibration: Calibration,
    pub pod: PodShape,
    pub target: Target,
    pub trace_events: usize,
    pub trace_sandboxes: usize,
    pub trace_seconds: f64,
    pub outcomes: Vec<Outcome>,
    /// Index in `outcomes` of the recommended setting.
    pub recommended: Option<usize>,
    /// Why it was chosen (or that none meets the target).
    pub reason: String,
}

/// Plays `trace` with every setting and picks one for `target`: among
/// the feasible ones (resident memory within the pod's RAM, hibernation
/// writes within its disk's bandwidth) within it
/// (wake p99 and reject %), the one that admits the most creates, then
/// the lowest wake p99, then the least core time, then the lowest ratio.
/// When none is within it, none is recommended and the closest feasible
/// one (fewest rejections, then lowest wake p99) is named; an infeasible
/// setting is never either.
pub fn plan(
    trace: &Trace,
    pod: PodShape,
    settings: &[Setting],
    target: Target,
    calibration: Calibration,
) -> Plan {
    let outcomes: Vec<Outcome> = settings
        .iter()
        .map(|s| simulate(trace, pod, *s, &calibration))
        .collect();
    let within = |o: &Outcome| {
        o.infeasible.is_none()
            && o.wake_p99_ms <= target.wake_p99_ms
            && o.reject_pct() <= target.max_reject_pct
    };
    let best = outcomes
        .iter()
        .enumerate()
        .filter(|(_, o)| within(o))
        .min_by(|(_, a), (_, b)| {
            b.creates_admitted
                .cmp(&a.creates_admitted)
                .then(a.wake_p99_ms.total_cmp(&b.wake_p99_ms))
                .then(a.core_seconds.total_cmp(&b.core_seconds))
                .then(a.setting.ratio.total_cmp(&b.setting.ratio))
        })
        .map(|(i, _)| i);
    let reason = match best {
        Some(i) => {
            let o = &outcomes[i];
            format!(
                "within the target (wake p99 {:.1} <= {} ms, rejected {:.2}% <= {}%), \
                 admitting the most creates ({}), then the lowest wake p99",
                o.wake_p99_ms,
                target.wake_p99_ms,
                o.reject_pct(),
                target.max_reject_pct,
                o.creates_admitted
            )
        }
        None => match outcomes
            .iter()
            .filter(|o| o.infeasible.is_none())
            .min_by(|a, b| {
                a.reject_pct()
                    .total_cmp(&b.reject_pct())
                    .then(a.wake_p99_ms.total_cmp(&b.wake_p99_ms))
            }) {
            Some(c) => format!(
                "no setting meets the target; the closest is ratio {} keep-alive {} ms \
                 watermark {} (rejected {:.2}%, wake p99 {:.1} ms): a larger pod is needed",
                c.setting.ratio,
                c.setting.keep_alive_ms,
                c.setting.high_watermark,
                c.reject_pct(),
                c.wake_p99_ms
            ),
            None if outcomes.is_empty() => "no setting given".into(),
            None => {
                let disk = outcomes.iter().any(|o| o.exceeds.contains(&Limit::Disk));
                format!(
                    "no setting keeps resident memory within the pod's RAM{} \
                     (every one is infeasible): {} is needed",
                    if disk {
                        " and hibernation writes within its disk's bandwidth"
                    } else {
                        ""
                    },
                    if disk {
                        "a larger pod, a faster disk or a lower ratio"
                    } else {
                        "a larger pod or a lower ratio"
                    }
                )
            }
        },
    };
    Plan {
        calibration,
        pod,
        target,
        trace_events: trace.events.len(),
        trace_sandboxes: trace.sandboxes.len(),
        trace_seconds: trace.end_ms() as f64 / 1000.0,
        outcomes,
        recommended: best,
        reason,
    }
}

#[cfg(test)]
mod tests;
