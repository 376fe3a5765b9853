//! The API benchmark's table: one column per configuration, targets
//! marked met or missed.

use super::*;

#[derive(Clone, Copy)]
enum Fmt {
    Ms,
    Pct,
    /// A percentage with two decimals.
    Pct2,
    Rate,
    Mib,
    Count,
}

struct Target {
    text: String,
    /// Applies to pool configurations (and the defaults) only.
    pool_only: bool,
    met: fn(f64) -> bool,
}

/// A row's value for one configuration's results.
type Value = Box<dyn Fn(&Results) -> Option<f64>>;

struct Row {
    label: String,
    fmt: Fmt,
    target: Option<Target>,
    value: Value,
}

fn p(v: &[f64], q: f64) -> Option<f64> {
    (!v.is_empty()).then(|| percentile(v, q))
}

fn api_p(v: &[Sample], q: f64) -> Option<f64> {
    p(&v.iter().map(|s| s.api_ms).collect::<Vec<_>>(), q)
}

fn vmm_p50(v: &[Sample]) -> Option<f64> {
    p(
        &v.iter().filter_map(Sample::vmm_ms).collect::<Vec<_>>(),
        0.5,
    )
}

/// p50 of one service phase of the answers.
fn phase_p50(v: &[Sample], name: &str) -> Option<f64> {
    let ms: Vec<f64> = v
        .iter()
        .filter_map(|s| s.restore.as_ref()?.phases.get(name).copied())
        .collect();
    p(&ms, 0.5)
}

/// p50 of what the phases do not account for: HTTP, JSON, the blocking
/// pool hand-off, locks.
fn rest_p50(v: &[Sample]) -> Option<f64> {
    let ms: Vec<f64> = v
        .iter()
        .filter_map(|s| {
            let phases = &s.restore.as_ref()?.phases;
            (!phases.is_empty()).then(|| s.api_ms - phases.values().sum::<f64>())
        })
        .collect();
    p(&ms, 0.5)
}

fn service_p50(v: &[Sample]) -> Option<f64> {
    p(
        &v.iter().filter_map(Sample::service_ms).collect::<Vec<_>>(),
        0.5,
    )
}

/// p50 of API time - vmm_ms, per sample.
fn overhead_p50(v: &[Sample]) -> Option<f64> {
    let d: Vec<f64> = v
        .iter()
        .filter_map(|s| s.vmm_ms().map(|m| s.api_ms - m))
        .collect();
    p(&d, 0.5)
}

/// Percent of creates that took the standby path: from the answers, else
/// from the metrics.
fn standby_pct(r: &Results) -> Option<f64> {
    let paths: Vec<&str> = r.create.iter().filter_map(Sample::path).collect();
    if !paths.is_empty() {
        let n = paths.iter().filter(|p| **p == "standby").count();
        return Some(100.0 * n as f64 / paths.len() as f64);
    }
    let m = r.create_metrics.as_ref()?;
    let all: f64 = m.values().sum();
    (all > 0.0).then(|| 100.0 * m.get("standby").copied().unwrap_or(0.0) / all)
}

fn row(label: &str, fmt: Fmt, value: impl Fn(&Results) -> Option<f64> + 'static) -> Row {
    Row {
        label: label.to_string(),
        fmt,
        target: None,
        value: Box::new(value),
    }
}

fn goal(mut r: Row, text: impl Into<String>, pool_only: bool, met: fn(f64) -> bool) -> Row {
    r.target = Some(Target {
        text: text.into(),
        pool_only,
        met,
    });
    r
}

/// p50 of API time - restore.ms (the service's restore step), per sample:
/// the admission and end commits and the API layer.
fn over_service_p50(v: &[Sample]) -> Option<f64> {
    let d: Vec<f64> = v
        .iter()
        .filter_map(|s| s.service_ms().map(|m| s.api_ms - m))
        .collect();
    p(&d, 0.5)
}

/// The latency rows of one restore path (`create`, `wake`): p50, p90 and
/// p99 with their goals (`p99`: with one; `pool`: goals of pool
/// configurations only), then where the p50 goes.
fn restore_rows(name: &str, samples: fn(&Results) -> &[Sample], p99: bool, pool: bool) -> Vec<Row> {
    let note = if pool { " (pool)" } else { "" };
    let p99_row = row(&format!("{name} p99"), Fmt::Ms, move |r| {
        api_p(samples(r), 0.99)
    });
    let mut rows = vec![
        goal(
            row(&format!("{name} p50"), Fmt::Ms, move |r| {
                api_p(samples(r), 0.5)
            }),
            format!("<= 2 ms{note}"),
            pool,
            |v| v <= 2.0,
        ),
        row(&format!("{name} p90"), Fmt::Ms, move |r| {
            api_p(samples(r), 0.9)
        }),
        if p99 {
            goal(p99_row, format!("<= 10 ms{note}"), pool, |v| v <= 10.0)
        } else {
            p99_row
        },
        row("  VMM restore (vmm_ms) p50", Fmt::Ms, move |r| {
            vmm_p50(samples(r))
        }),
        row("  service (restore.ms) p50", Fmt::Ms, move |r| {
            service_p50(samples(r))
        }),
    ];
    let phases = [
        ("admit", "admission commit"),
        ("prepare", "reads, shell"),
        ("jail", "mounts into the shell"),
        ("vmm", "restore round trip"),
        ("record", "VMM handle commit"),
        ("commit", "operation end"),
    ];
    for (phase, what) in phases {
        rows.push(row(
            &format!("    {phase}: {what} p50"),
            Fmt::Ms,
            move |r| phase_p50(samples(r), phase),
        ));
    }
    rows.push(row("    HTTP, JSON, hand-offs p50", Fmt::Ms, move |r| {
        rest_p50(samples(r))
    }));
    rows.push(row("  API - restore.ms p50", Fmt::Ms, move |r| {
        over_service_p50(samples(r))
    }));
    rows.push(goal(
        row("  API overhead (API - vmm_ms) p50", Fmt::Ms, move |r| {
            overhead_p50(samples(r))
        }),
        "<= 1 ms",
        false,
        |v| v <= 1.0,
    ));
    rows
}

fn rows(o: &Opts) -> Vec<Row> {
    let t = o.threads;
    let mut rows = restore_rows("create", |r| &r.create, true, true);
    rows.push(row("  creates via standby", Fmt::Pct, standby_pct));
    rows.extend(restore_rows("wake", |r| &r.wake, true, false));
    rows.extend([
        row("  wake -> first new line p50", Fmt::Ms, |r| {
            p(&r.wake_line, 0.5)
        }),
        row("  wake -> first new line p99", Fmt::Ms, |r| {
            p(&r.wake_line, 0.99)
        }),
        row("pause p50", Fmt::Ms, |r| p(&r.pause, 0.5)),
        row("resume (paused) p50", Fmt::Ms, |r| p(&r.resume, 0.5)),
        goal(
            row("hibernate p50", Fmt::Ms, |r| p(&r.hibernate, 0.5)),
            "<= 5 ms (idle, ~1 % dirty)",
            false,
            |v| v <= 5.0,
        ),
        row("  its diff, % of guest memory p50", Fmt::Pct2, |r| {
            p(&r.hibernate_dirty_pct, 0.5)
        }),
        row("  VMM snapshot (vmm_ms) p50", Fmt::Ms, |r| {
            p(&r.hibernate_vmm, 0.5)
        }),
        goal(
            row(&format!("creates/s ({t} threads)"), Fmt::Rate, |r| {
                let s = r.sustained.as_ref()?;
                (s.creates > 0).then(|| s.creates as f64 / s.secs)
            }),
            ">= 300/s",
            false,
            |v| v >= 300.0,
        ),
        row("  pool refills/s (service)", Fmt::Rate, |r| {
            let s = r.sustained.as_ref()?;
            Some(s.refills? / s.secs)
        }),
        row("  CPU ms per create (+delete)", Fmt::Ms, |r| {
            let s = r.sustained.as_ref()?;
            let c = s.cpu?;
            (s.creates > 0).then(|| c.busy_ms / s.creates as f64)
        }),
        row("  CPU busy meanwhile", Fmt::Pct, |r| {
            let c = r.sustained.as_ref()?.cpu?;
            let all = c.busy_ms + c.idle_ms;
            (all > 0.0).then(|| 100.0 * c.busy_ms / all)
        }),
        row("  ceiling at that CPU cost (/s)", Fmt::Rate, |r| {
            let s = r.sustained.as_ref()?;
            let c = s.cpu?;
            (c.busy_ms > 0.0).then(|| c.cpus as f64 * 1000.0 * s.creates as f64 / c.busy_ms)
        }),
        row("  create p50 under load", Fmt::Ms, |r| {
            p(&r.sustained.as_ref()?.lat, 0.5)
        }),
        row("  create p99 under load", Fmt::Ms, |r| {
            p(&r.sustained.as_ref()?.lat, 0.99)
        }),
        row("  delete p50 under load", Fmt::Ms, |r| {
            p(&r.sustained.as_ref()?.delete_lat, 0.5)
        }),
        row("  via standby under load", Fmt::Pct, |r| {
            let s = r.sustained.as_ref()?;
            (s.with_path > 0).then(|| 100.0 * s.standby as f64 / s.with_path as f64)
        }),
        goal(
            row("burst: answered (of fired)", Fmt::Pct, |r| {
                let b = r.burst.as_ref()?;
                (b.fired > 0).then(|| 100.0 * b.lat.len() as f64 / b.fired as f64)
            }),
            "all (100%)",
            false,
            |v| v >= 100.0,
        ),
        row("  burst p50", Fmt::Ms, |r| p(&r.burst.as_ref()?.lat, 0.5)),
        goal(
            row("  burst p95", Fmt::Ms, |r| p(&r.burst.as_ref()?.lat, 0.95)),
            "<= 25 ms",
            false,
            |v| v <= 25.0,
        ),
        row("  burst max", Fmt::Ms, |r| p(&r.burst.as_ref()?.lat, 1.0)),
        row("  burst via standby", Fmt::Pct, |r| {
            let b = r.burst.as_ref()?;
            (!b.lat.is_empty()).then(|| 100.0 * b.standby as f64 / b.lat.len() as f64)
        }),
        row("  shells ready at the burst", Fmt::Count, |r| {
            r.burst.as_ref()?.ready_before
        }),
        row("  pool refill, burst to full (shells/s)", Fmt::Rate, |r| {
            let (made, secs) = r.burst.as_ref()?.refill?;
            (secs > 0.0).then(|| made / secs)
        }),
        goal(
            row("PSS / paused clone", Fmt::Mib, |r| r.pss_paused),
            "<= 0.5 MiB",
            false,
            |v| v <= 0.5,
        ),
        row("PSS / running clone", Fmt::Mib, |r| r.pss_running),
        row("standby shells (count)", Fmt::Count, |r| {
            r.shells_pss.map(|s| s.0 as f64)
        }),
        row("standby shells PSS, all", Fmt::Mib, |r| {
            r.shells_pss.map(|s| s.1)
        }),
    ]);
    // Where a hibernation's time goes, after the rows above (moved under
    // the hibernate row when printed).
    let at = rows
        .iter()
        .position(|r| r.label.starts_with("  VMM snapshot (vmm_ms)"))
        .map_or(rows.len(), |i| i + 1);
    let phases = [
        ("begin", "journal start"),
        ("vmm", "request round trip"),
        ("stop", "VMM exit handed off"),
        ("record", "layers checked"),
        ("commit", "operation end"),
        ("store", "upload, bookkeeping"),
    ];
    for (i, (phase, what)) in phases.into_iter().enumerate() {
        rows.insert(
            at + i,
            row(&format!("    {phase}: {what} p50"), Fmt::Ms, move |r| {
                p(r.hibernate_phases.get(phase)?, 0.5)
            }),
        );
    }
    rows
}

fn cell(v: Option<f64>, fmt: Fmt) -> String {
    match v.filter(|v| v.is_finite()) {
        None => "-".into(),
        Some(v) => match fmt {
            Fmt::Ms => format!("{v:.2}"),
            Fmt::Pct => format!("{v:.0}%"),
            Fmt::Pct2 => format!("{v:.2}%"),
            Fmt::Rate => format!("{v:.0}"),
            Fmt::Mib => format!("{v:.2}"),
            Fmt::Count => format!("{v:.0}"),
        },
    }
}

const LABEL_W: usize = 36;
const COL_W: usize = 14;

/// One table for one guest size: a row per measurement, a column per
/// configuration, the target in the last column.
pub(super) fn print_table(mem: u32, done: &[(Config, Results)], o: &Opts) -> Vec<String> {
    let mut summary = Vec::new();
    println!(
        "\n== probe template {mem} MiB: through the REST API (ms unless said; {} samples per \
         latency, {} clones, {} s sustained)",
        o.runs, o.clones, o.secs
    );
    let head = |last: &str, f: &dyn Fn(&Config, &Results) -> String| {
        let cols: String = done
            .iter()
            .map(|(c, r)| format!("{:>COL_W$}", f(c, r)))
            .collect();
        println!("{:<LABEL_W$}{cols}  {last}", "");
    };
    head("target", &|c, _| match c.pool {
        Some(p) => pool_word(p).to_string(),
        None => "default".into(),
    });
    head("", &|c, r| match c.backend {
        Some(b) => b.to_string(),
        None => match r.backend_seen.keys().next() {
            Some(b) => format!("({b})"),
            None => "(no flags)".into(),
        },
    });
    head("", &|c, _| {
        if c.jail { "jailed" } else { "no jail" }.to_string()
    });
    if o.ab.is_some() {
        head("", &|c, _| {
            if c.baseline { "A: baseline" } else { "B: this" }.to_string()
        });
    }
    let mut score: Vec<(usize, usize, Vec<String>)> = vec![(0, 0, Vec::new()); done.len()];
    let mut section = String::new();
    for row in rows(o) {
        if !row.label.starts_with(' ') {
            section = row.label.split(' ').next().unwrap_or_default().to_string();
        }
        let mut line = format!("{:<LABEL_W$}", row.label);
        for (i, (c, r)) in done.iter().enumerate() {
            let v = (row.value)(r).filter(|v| v.is_finite());
            let mut text = cell(v, row.fmt);
            if let (Some(t), Some(v)) = (&row.target, v) {
                if !t.pool_only || c.pool_targets() {
                    let met = (t.met)(v);
                    text.push_str(if met { " ok" } else { " MISS" });
                    score[i].1 += 1;
                    if met {
                        score[i].0 += 1;
                    } else {
                        let what = row.label.trim();
                        score[i].2.push(if row.label.starts_with(' ') {
                            format!("{section} {what}")
                        } else {
                            what.to_string()
                        });
                    }
                }
            }
            line.push_str(&format!("{text:>COL_W$}"));
        }
        if let Some(t) = &row.target {
            line.push_str(&format!("  {}", t.text));
        }
        println!("{line}");
    }
    for ((c, r), (met, of, missed)) in done.iter().zip(&score) {
        let mut line = format!("{}: {met} of {of} targets met", c.name());
        if r.failed {
            line.push_str(" (FAILED part-way: its column holds what was measured)");
        }
        if !missed.is_empty() {
            line.push_str(&format!(" (missed: {})", missed.join(", ")));
        }
        summary.push(line);
    }
    summary
}
