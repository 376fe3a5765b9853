//! `torpor plan`: replays an activity trace on a simulated pod for each
//! candidate setting (the service's own admission and policy code, see
//! `torpor_scheduler::plan`), prints a table (or `--json`), writes an SVG
//! chart, and recommends a setting for a stated target.
//! `torpor plan calibrate` measures this host's costs (plan_calibrate.rs).

use torpor_scheduler::plan::{self, calibration, Calibration, PodShape, Setting, Target, Trace};

use super::{EXIT_FAILURE, EXIT_OK};
use crate::cli::{PlanAction, PlanArgs, PlanCommand};

/// Largest pod the planner takes: 64 TiB.
const MAX_POD_GIB: f64 = 65536.0;

pub fn run(c: PlanCommand) -> i32 {
    let result = match c.action {
        Some(PlanAction::Calibrate(a)) => return super::plan_calibrate::run(a),
        None => run_plan(&c.run),
    };
    match result {
        Ok(()) => EXIT_OK,
        Err(e) => {
            eprintln!("torpor plan: error: {e}");
            EXIT_FAILURE
        }
    }
}

/// Checks the settings and builds every combination.
fn settings(a: &PlanArgs) -> Result<Vec<Setting>, String> {
    for &r in &a.ratios {
        if !(r.is_finite() && r > 0.0 && r <= 100.0) {
            return Err(format!("ratio {r} is outside (0, 100]"));
        }
    }
    for &w in &a.watermarks {
        if !(w.is_finite() && w > 0.0 && w <= 1.0) {
            return Err(format!("watermark {w} is outside (0, 1]"));
        }
    }
    for &k in &a.keep_alive_ms {
        if k > torpor_scheduler::service::MAX_KEEP_ALIVE_MS {
            return Err(format!("keep-alive {k} ms is above 30 days"));
        }
    }
    let mut out = Vec::new();
    for &ratio in &a.ratios {
        for &keep_alive_ms in &a.keep_alive_ms {
            for &high_watermark in &a.watermarks {
                out.push(Setting {
                    ratio,
                    keep_alive_ms,
                    high_watermark,
                });
            }
        }
    }
    if out.is_empty() || out.len() > plan::MAX_SETTINGS {
        return Err(format!(
            "{} settings: give 1 to {} combinations of ratios, keep-alives and watermarks",
            out.len(),
            plan::MAX_SETTINGS
        ));
    }
    Ok(out)
}

/// The calibration named, else the data directory's, else the built-in.
fn calibration(a: &PlanArgs) -> Result<(Calibration, String), String> {
    if let Some(p) = &a.calibration {
        let c = Calibration::load(p).map_err(|e| e.to_string())?;
        return Ok((c, p.display().to_string()));
    }
    let dir = a
        .data_dir
        .clone()
        .unwrap_or_else(super::server::default_data_dir);
    let p = dir.join(calibration::FILE_NAME);
    if p.exists() {
        let c = Calibration::load(&p).map_err(|e| e.to_string())?;
        return Ok((c, p.display().to_string()));
    }
    Ok((Calibration::builtin(), "built-in default".into()))
}

fn run_plan(a: &PlanArgs) -> Result<(), String> {
    let path = a.trace.as_ref().ok_or("--trace FILE is required")?;
    let gib = a.pod_mem_gib.ok_or("--pod-mem-gib G is required")?;
    if !(gib.is_finite() && gib > 0.0 && gib <= MAX_POD_GIB) {
        return Err(format!("--pod-mem-gib {gib} is outside (0, {MAX_POD_GIB}]"));
    }
    if !(1..=1024).contains(&a.pod_cores) {
        return Err("--pod-cores must be 1 to 1024".into());
    }
    if !(1..=3_600_000).contains(&a.policy_interval_ms) {
        return Err("--policy-interval-ms must be 1 to 3600000".into());
    }
    for (name, v) in [
        ("--target-wake-p99-ms", a.target_wake_p99_ms),
        ("--max-reject-pct", a.max_reject_pct),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("{name} {v} must be a number >= 0"));
        }
    }
    let settings = settings(a)?;
    let (mut cal, cal_from) = calibration(a)?;
    let disk_from = match a.disk_mib_s {
        Some(v) if !(v.is_finite() && v > 0.0 && v <= calibration::MAX_DISK_WRITE_MIB_S) => {
            return Err(format!(
                "--disk-mib-s {v} is outside (0, {}]",
                calibration::MAX_DISK_WRITE_MIB_S
            ));
        }
        Some(v) => {
            cal.disk_write_mib_s = v;
            "--disk-mib-s"
        }
        None => "calibration",
    };
    let file =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let trace = Trace::read(std::io::BufReader::new(file))
        .map_err(|e| format!("trace {}: {e}", path.display()))?;
    let pod = PodShape {
        memory_mib: (gib * 1024.0).round() as u64,
        cores: a.pod_cores,
        policy_interval_ms: a.policy_interval_ms,
    };
    let target = Target {
        wake_p99_ms: a.target_wake_p99_ms,
        max_reject_pct: a.max_reject_pct,
    };
    let p = plan::plan(&trace, pod, &settings, target, cal);
    if let Some(svg) = &a.svg {
        std::fs::write(svg, plan::svg::render(&p))
            .map_err(|e| format!("cannot write {}: {e}", svg.display()))?;
    }
    if a.json {
        let mut v = serde_json::to_value(&p).map_err(|e| e.to_string())?;
        v["calibration_file"] = serde_json::json!(cal_from);
        v["disk_write_mib_s_from"] = serde_json::json!(disk_from);
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    print!("{}", render_table(&p, &cal_from, disk_from));
    Ok(())
}

fn mib(v: f64) -> String {
    format!("{v:.0}")
}

/// A disk rate, MiB/s: whole MiB, a decimal below 10.
fn disk_rate(v: f64) -> String {
    if v > 0.0 && v < 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// The plan as text: what was played, a row per setting, the choice.
fn render_table(p: &plan::Plan, cal_from: &str, disk_from: &str) -> String {
    let c = &p.calibration;
    let mut out = format!(
        "trace: {} events, {} sandboxes, {:.0} s; pod: {} MiB, {} cores, policy every {} ms\n\
         calibration: {} ({}: {}; create {:.1} ms, wake {:.1} ms{}, hibernate {:.1} ms + {:.2} ms/dirty MiB, \
         snapshot {:.0} B + {:.0} B/dirty MiB, fresh sandbox {:.1} MiB)\n\
         disk: writes {:.0} MiB/s ({}); a setting whose hibernations leave more \
         to write than that in {} policy intervals is infeasible\n\n",
        p.trace_events,
        p.trace_sandboxes,
        p.trace_seconds,
        p.pod.memory_mib,
        p.pod.cores,
        p.pod.policy_interval_ms,
        cal_from,
        c.source,
        c.description,
        c.create_ms,
        c.wake_ms,
        match c.wake_ms_spread.last() {
            Some(max) => format!(" (charged across {} measured wakes up to {max:.1} ms)", c.wake_ms_spread.len()),
            None => String::new(),
        },
        c.hibernate_ms,
        c.hibernate_ms_per_dirty_mib,
        c.snapshot_base_bytes,
        c.snapshot_bytes_per_dirty_mib,
        c.fresh_pss_mib,
        c.disk_write_mib_s,
        if disk_from == "calibration" {
            "the calibration's"
        } else {
            "from --disk-mib-s"
        },
        plan::sim::DISK_BACKLOG_INTERVALS,
    );
    let header = [
        "",
        "RATIO",
        "KEEP-ALIVE-MS",
        "WATERMARK",
        "ADMITTED",
        "REJECTED",
        "WAKES",
        "WAKES-REFUSED",
        "WAKE-P50-MS",
        "WAKE-P99-MS",
        "RESIDENT-PEAK/RAM-MIB",
        "MEM-P99-MIB",
        "HIBERNATIONS",
        "PRESSURE-HIB",
        "PRESSURE-429",
        "DISK-PEAK-MIB",
        "DISK-NEED/HAVE-MIB-S",
        "CORE-S",
    ];
    let rows: Vec<Vec<String>> = p
        .outcomes
        .iter()
        .enumerate()
        .map(|(i, o)| {
            vec![
                match (p.recommended == Some(i), o.infeasible.is_some()) {
                    (true, _) => "*",
                    (false, true) => "!",
                    (false, false) => "",
                }
                .to_string(),
                o.setting.ratio.to_string(),
                o.setting.keep_alive_ms.to_string(),
                o.setting.high_watermark.to_string(),
                o.creates_admitted.to_string(),
                o.creates_rejected.to_string(),
                o.wakes.to_string(),
                o.wakes_rejected.to_string(),
                format!("{:.1}", o.wake_p50_ms),
                format!("{:.1}", o.wake_p99_ms),
                format!("{}/{}", mib(o.resident_peak_mib), p.pod.memory_mib),
                mib(o.mem_p99_mib),
                o.hibernations.to_string(),
                o.hibernations_watermark.to_string(),
                o.pressure_refusals.to_string(),
                mib(o.disk_peak_bytes / 1048576.0),
                format!(
                    "{}/{}",
                    disk_rate(o.disk_needed_mib_s),
                    disk_rate(o.disk_write_mib_s)
                ),
                format!("{:.2}", o.core_seconds),
            ]
        })
        .collect();
    out.push_str(&super::output::table(&header, &rows));
    out.push('\n');
    for o in p.outcomes.iter().filter(|o| o.infeasible.is_some()) {
        out.push_str(&format!(
            "infeasible (!): ratio {} keep-alive {} ms watermark {}: {}\n",
            o.setting.ratio,
            o.setting.keep_alive_ms,
            o.setting.high_watermark,
            o.infeasible.as_deref().unwrap_or_default()
        ));
    }
    match p.recommended {
        Some(i) => {
            let s = p.outcomes[i].setting;
            out.push_str(&format!(
                "recommended (*): ratio {} keep-alive {} ms watermark {}: {}\n\
                 apply: torpor pod set pod_local --ratio {}; torpor pod set pod_local \
                 --high-watermark {}; torpor serve --keep-alive-ms {} (or each sandbox's keep_alive_ms)\n",
                s.ratio,
                s.keep_alive_ms,
                s.high_watermark,
                p.reason,
                s.ratio,
                s.high_watermark,
                s.keep_alive_ms
            ));
        }
        None => out.push_str(&format!("recommended: none: {}\n", p.reason)),
    }
    out
}
