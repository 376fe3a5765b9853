//! A plan as an SVG chart an operator opens in a browser: peak resident
//! memory and wake p99 against the oversubscription ratio (for the chosen
//! keep-alive and watermark; an infeasible setting, whose resident memory
//! would exceed the pod's RAM or whose hibernations would write more than
//! its disk gives, ringed in red and labelled `infeasible`, `infeasible
//! (disk)` or both), and memory
//! over time for the chosen setting, with the pod's memory and high
//! watermark drawn across.

use std::fmt::Write;

use super::{Limit, Outcome, Plan};

const W: f64 = 900.0;
const PANEL_H: f64 = 260.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
/// The colour of the pod's limits and of infeasible settings.
const INFEASIBLE: &str = "#c00";

/// Escapes text for XML.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" upper bound and step for an axis up to `max`.
fn ticks(max: f64) -> (f64, f64) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

fn num(v: f64) -> String {
    if v >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// One panel: axes with ticks and labels, then `series` as polylines
/// (colour, points) and `hlines` as dashed lines (colour, y, label).
struct Panel<'a> {
    top: f64,
    title: String,
    x_label: &'a str,
    y_label: &'a str,
    x_max: f64,
    y_max: f64,
}

impl Panel<'_> {
    fn x(&self, v: f64) -> f64 {
        LEFT + v / self.x_max * (W - LEFT - RIGHT)
    }

    fn y(&self, v: f64) -> f64 {
        self.top + TOP + (1.0 - v / self.y_max) * (PANEL_H - TOP - BOTTOM)
    }

    fn axes(&mut self, out: &mut String, x_ticks: &[f64]) {
        let (y_max, y_step) = ticks(self.y_max);
        self.y_max = y_max;
        let (x0, x1) = (LEFT, W - RIGHT);
        let (y0, y1) = (self.y(0.0), self.y(y_max));
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="15" font-weight="bold">{}</text>"#,
            LEFT,
            self.top + 22.0,
            esc(&self.title)
        );
        let _ = writeln!(
            out,
            r#"<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/><line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>"#
        );
        let mut v = 0.0;
        while v <= y_max + y_step / 2.0 {
            let y = self.y(v);
            let _ = writeln!(
                out,
                r##"<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" font-size="11" text-anchor="end">{}</text>"##,
                x0 - 6.0,
                y + 4.0,
                num(v)
            );
            v += y_step;
        }
        for &t in x_ticks {
            let x = self.x(t);
            let _ = writeln!(
                out,
                r#"<line x1="{x}" y1="{y0}" x2="{x}" y2="{}" stroke="black"/><text x="{x}" y="{}" font-size="11" text-anchor="middle">{}</text>"#,
                y0 + 5.0,
                y0 + 18.0,
                num(t)
            );
        }
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" font-size="12" text-anchor="middle">{}</text>"#,
            (x0 + x1) / 2.0,
            y0 + 38.0,
            esc(self.x_label)
        );
        let cy = (y0 + y1) / 2.0;
        let _ = writeln!(
            out,
            r#"<text x="18" y="{cy}" font-size="12" text-anchor="middle" transform="rotate(-90 18 {cy})">{}</text>"#,
            esc(self.y_label)
        );
    }

    fn line(&self, out: &mut String, colour: &str, points: &[(f64, f64)], dots: bool) {
        let pts: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", self.x(x), self.y(y)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
        if dots {
            for &(x, y) in points {
                let _ = writeln!(
                    out,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{colour}"/>"#,
                    self.x(x),
                    self.y(y)
                );
            }
        }
    }

    /// Rings the points of infeasible settings in red, labelled.
    fn infeasible(&self, out: &mut String, points: &[(f64, f64, Option<&str>)]) {
        for &(x, y, label) in points {
            let Some(label) = label else {
                continue;
            };
            let (cx, cy) = (self.x(x), self.y(y));
            let _ = writeln!(
                out,
                r##"<circle cx="{cx:.1}" cy="{cy:.1}" r="8" fill="none" stroke="{INFEASIBLE}" stroke-width="2"/><text x="{cx:.1}" y="{:.1}" font-size="11" fill="{INFEASIBLE}" text-anchor="middle">{label}</text>"##,
                cy - 12.0
            );
        }
    }

    fn hline(&self, out: &mut String, colour: &str, v: f64, label: &str) {
        let y = self.y(v);
        let _ = writeln!(
            out,
            r#"<line x1="{LEFT}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="{colour}" stroke-dasharray="6 4"/><text x="{}" y="{:.1}" font-size="11" fill="{colour}" text-anchor="end">{}</text>"#,
            W - RIGHT,
            W - RIGHT - 4.0,
            y - 4.0,
            esc(label)
        );
    }
}

/// How an infeasible setting's points are labelled: by the limits it
/// exceeds (RAM alone says `infeasible`).
fn infeasible_label(o: &Outcome) -> Option<&'static str> {
    match (
        o.exceeds.contains(&Limit::Ram),
        o.exceeds.contains(&Limit::Disk),
    ) {
        (true, false) => Some("infeasible"),
        (false, true) => Some("infeasible (disk)"),
        (true, true) => Some("infeasible (RAM, disk)"),
        (false, false) => o.infeasible.is_some().then_some("infeasible"),
    }
}

/// The chart of `plan`, as an SVG document.
pub fn render(plan: &Plan) -> String {
    let chosen = plan.recommended.or(if plan.outcomes.is_empty() {
        None
    } else {
        Some(0)
    });
    let mut out = String::new();
    let height = 3.0 * PANEL_H + 40.0;
    let _ = writeln!(
        out,
        r#"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif">
<rect width="100%" height="100%" fill="white"/>"#
    );
    let Some(c) = chosen.map(|i| &plan.outcomes[i]) else {
        out.push_str("<text x=\"20\" y=\"30\">no setting</text>\n</svg>\n");
        return out;
    };
    let label = if plan.recommended.is_some() {
        "recommended"
    } else {
        "no setting meets the target; first"
    };
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="24" font-size="13">{}</text>"#,
        esc(&format!(
            "torpor plan: {} setting ratio {} keep-alive {} ms watermark {}; pod {} MiB; calibration: {}",
            label,
            c.setting.ratio,
            c.setting.keep_alive_ms,
            c.setting.high_watermark,
            plan.pod.memory_mib,
            plan.calibration.source
        ))
    );
    // The chosen keep-alive and watermark, across ratios.
    let mut by_ratio: Vec<&Outcome> = plan
        .outcomes
        .iter()
        .filter(|o| {
            o.setting.keep_alive_ms == c.setting.keep_alive_ms
                && o.setting.high_watermark == c.setting.high_watermark
        })
        .collect();
    by_ratio.sort_by(|a, b| a.setting.ratio.total_cmp(&b.setting.ratio));
    let ratios: Vec<f64> = by_ratio.iter().map(|o| o.setting.ratio).collect();
    let x_max = ratios.iter().copied().fold(1.0, f64::max);
    let pod_mib = plan.pod.memory_mib as f64;
    let mem: Vec<(f64, f64)> = by_ratio
        .iter()
        .map(|o| (o.setting.ratio, o.resident_peak_mib))
        .collect();
    let marked = |v: &[(f64, f64)]| -> Vec<(f64, f64, Option<&'static str>)> {
        v.iter()
            .zip(&by_ratio)
            .map(|(&(x, y), o)| (x, y, infeasible_label(o)))
            .collect()
    };
    let mut p = Panel {
        top: 30.0,
        title: format!(
            "Peak resident memory against ratio (keep-alive {} ms, watermark {})",
            c.setting.keep_alive_ms, c.setting.high_watermark
        ),
        x_label: "oversubscription ratio",
        y_label: "peak memory (MiB)",
        x_max,
        y_max: mem.iter().map(|m| m.1).fold(pod_mib, f64::max) * 1.1,
    };
    p.axes(&mut out, &ratios);
    p.hline(&mut out, "#c00", pod_mib, "pod memory");
    p.line(&mut out, "#1f77b4", &mem, true);
    p.infeasible(&mut out, &marked(&mem));
    let wake: Vec<(f64, f64)> = by_ratio
        .iter()
        .map(|o| (o.setting.ratio, o.wake_p99_ms))
        .collect();
    let mut p = Panel {
        top: 30.0 + PANEL_H,
        title: "Wake p99 against ratio (queueing included)".into(),
        x_label: "oversubscription ratio",
        y_label: "wake p99 (ms)",
        x_max,
        y_max: wake
            .iter()
            .map(|w| w.1)
            .fold(plan.target.wake_p99_ms, f64::max)
            * 1.05,
    };
    p.axes(&mut out, &ratios);
    p.hline(&mut out, "#c00", plan.target.wake_p99_ms, "target wake p99");
    p.line(&mut out, "#ff7f0e", &wake, true);
    p.infeasible(&mut out, &marked(&wake));
    let t_max = c
        .memory_series
        .last()
        .map_or(1.0, |&(t, _)| t)
        .max(plan.trace_seconds)
        .max(1.0);
    let (t_axis, t_step) = ticks(t_max);
    let t_ticks: Vec<f64> = (0..=((t_axis / t_step).round() as usize))
        .map(|i| i as f64 * t_step)
        .collect();
    let mut p = Panel {
        top: 30.0 + 2.0 * PANEL_H,
        title: format!("Memory over time (ratio {})", c.setting.ratio),
        x_label: "time (s)",
        y_label: "memory (MiB)",
        x_max: t_axis,
        y_max: c.resident_peak_mib.max(pod_mib) * 1.05,
    };
    p.axes(&mut out, &t_ticks);
    p.hline(&mut out, "#c00", pod_mib, "pod memory");
    p.hline(
        &mut out,
        "#888",
        pod_mib * c.setting.high_watermark,
        "high watermark",
    );
    p.line(&mut out, "#2ca02c", &c.memory_series, false);
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infeasible_settings_are_marked() {
        use crate::plan::{Calibration, PodShape, Setting, Target, Trace};
        // Two 512 MiB sandboxes dirtying 400 MiB each at once on 512 MiB:
        // infeasible at ratio 2 (both admitted), not at ratio 1.
        let t = Trace::read(
            "{\"t\":0,\"sandbox\":\"a\",\"event\":\"create\",\"mem_mib\":512}\n\
             {\"t\":0,\"sandbox\":\"b\",\"event\":\"create\",\"mem_mib\":512}\n\
             {\"t\":1,\"sandbox\":\"a\",\"event\":\"request\",\"duration_ms\":0,\"mem_mib\":400}\n\
             {\"t\":1,\"sandbox\":\"b\",\"event\":\"request\",\"duration_ms\":0,\"mem_mib\":400}\n"
                .as_bytes(),
        )
        .unwrap();
        let pod = PodShape {
            memory_mib: 512,
            cores: 2,
            policy_interval_ms: 1000,
        };
        let settings: Vec<Setting> = [1.0, 2.0]
            .map(|ratio| Setting {
                ratio,
                keep_alive_ms: 60_000,
                high_watermark: 0.9,
            })
            .to_vec();
        let target = Target {
            wake_p99_ms: 1e9,
            max_reject_pct: 100.0,
        };
        let p = crate::plan::plan(&t, pod, &settings, target, Calibration::builtin());
        assert!(p.outcomes[0].infeasible.is_none() && p.outcomes[1].infeasible.is_some());
        let svg = render(&p);
        // Ratio 2's points, in both panels against the ratio.
        assert_eq!(svg.matches(">infeasible</text>").count(), 2, "{svg}");
        assert_eq!(svg.matches(r#"r="8" fill="none""#).count(), 2);

        // A disk that writes 1 MiB/s and a 2 s keep-alive: ratio 1's
        // sandbox goes idle and leaves 400 MiB to write, more than that
        // disk writes in 10 policy intervals: infeasible for the disk
        // alone; ratio 2 for both.
        let t = Trace::read(
            "{\"t\":0,\"sandbox\":\"a\",\"event\":\"create\",\"mem_mib\":512}\n\
             {\"t\":0,\"sandbox\":\"b\",\"event\":\"create\",\"mem_mib\":512}\n\
             {\"t\":1,\"sandbox\":\"a\",\"event\":\"request\",\"duration_ms\":0,\"mem_mib\":400}\n\
             {\"t\":1,\"sandbox\":\"b\",\"event\":\"request\",\"duration_ms\":0,\"mem_mib\":400}\n\
             {\"t\":5,\"sandbox\":\"a\",\"event\":\"request\",\"duration_ms\":0,\"mem_mib\":0}\n"
                .as_bytes(),
        )
        .unwrap();
        let mut slow = Calibration::builtin();
        slow.disk_write_mib_s = 1.0;
        let idle: Vec<Setting> = settings
            .iter()
            .map(|s| Setting {
                keep_alive_ms: 2_000,
                ..*s
            })
            .collect();
        let p = crate::plan::plan(&t, pod, &idle, target, slow);
        assert_eq!(p.outcomes[0].exceeds, [Limit::Disk], "{:?}", p.outcomes[0]);
        let svg = render(&p);
        assert_eq!(svg.matches(">infeasible (disk)</text>").count(), 2, "{svg}");
        assert_eq!(
            svg.matches(">infeasible (RAM, disk)</text>").count(),
            2,
            "{svg}"
        );
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(ticks(97.0), (100.0, 20.0));
        assert_eq!(ticks(0.0), (1.0, 0.2));
        assert_eq!(ticks(f64::NAN), (1.0, 0.2));
        assert_eq!(esc("a<b&\""), "a&lt;b&amp;&quot;");
    }
}
