//! `torpor plan`: the table, `--json` and `--svg` on a small trace (the SVG
//! also rendered by headless Chromium and checked in its pixels); trace
//! errors with their line; the generators in scripts/; and, through a real
//! `torpor serve` with probe sandboxes, `serve --record-trace` writing a
//! trace `plan` accepts and `plan calibrate` measuring a calibration
//! `plan` uses.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

mod common;

use common::http::request;
use common::serve::{DataDir, ServeProcess};
use common::{stderr, stdout, torpor, wait_output, Scratch};

/// How long `plan calibrate` may take.
const CALIBRATE_LIMIT: Duration = Duration::from_secs(300);

const TOKEN: &str = "plan-test-token-0123456789";

/// Six 512 MiB sandboxes on a 1 GiB pod: idle gaps past a 5 s keep-alive,
/// then all woken at once.
const SMALL: &str = r#"{"t":0,"sandbox":"a","event":"create","mem_mib":512}
{"t":0.1,"sandbox":"b","event":"create","mem_mib":512}
{"t":0.2,"sandbox":"c","event":"create","mem_mib":512}
{"t":0.3,"sandbox":"d","event":"create","mem_mib":512}
{"t":0.4,"sandbox":"e","event":"create","mem_mib":512}
{"t":0.5,"sandbox":"f","event":"create","mem_mib":512}
{"t":1,"sandbox":"a","event":"request","duration_ms":300,"mem_mib":100}
{"t":1,"sandbox":"b","event":"request","duration_ms":300,"mem_mib":100}
{"t":30,"sandbox":"a","event":"request","duration_ms":10}
{"t":30,"sandbox":"b","event":"request","duration_ms":10}
{"t":30,"sandbox":"c","event":"request","duration_ms":10}
{"t":30,"sandbox":"d","event":"request","duration_ms":10}
{"t":40,"sandbox":"a","event":"delete"}
"#;

fn plan(trace: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "plan",
        "--trace",
        trace.to_str().unwrap(),
        "--pod-mem-gib",
        "1",
        "--ratios",
        "1,2,4",
        "--keep-alive-ms",
        "5000",
        "--data-dir",
        "/nonexistent-torpor-plan-test",
    ];
    args.extend(extra);
    run(&args)
}

/// Runs `torpor ARGS`, reading its output as it comes (a plan's JSON is
/// larger than a pipe holds).
fn run(args: &[&str]) -> std::process::Output {
    Command::new(common::TORPOR)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run torpor")
}

#[test]
fn plan_prints_a_table_json_and_an_svg() {
    let s = Scratch::new("plan-cli");
    let trace = s.path("t.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let o = plan(&trace, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("calibration: built-in default"), "{text}");
    assert!(
        text.contains("RATIO") && text.contains("WAKE-P99-MS"),
        "{text}"
    );
    assert!(text.contains("recommended (*): ratio 4"), "{text}");

    let svg = s.path("p.svg");
    let o = plan(&trace, &["--json", "--svg", svg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["calibration"]["source"], "builtin");
    assert_eq!(v["calibration_file"], "built-in default");
    assert_eq!(v["trace_events"], 13);
    let outcomes = v["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), 3);
    // Ratio 1 admits two 512 MiB sandboxes on 1 GiB, ratio 4 all six.
    assert_eq!(outcomes[0]["creates_admitted"], 2);
    assert_eq!(outcomes[0]["creates_rejected"], 4);
    assert_eq!(outcomes[2]["creates_admitted"], 6);
    for key in [
        "wakes",
        "wake_p50_ms",
        "wake_p99_ms",
        "mem_peak_mib",
        "mem_p99_mib",
        "resident_peak_mib",
        "pressure_refusals",
        "hibernations_watermark",
        "hibernations",
        "disk_peak_bytes",
        "core_seconds",
        "memory_series",
    ] {
        assert!(!outcomes[2][key].is_null(), "{key} missing");
    }
    assert!(outcomes[2]["wakes"].as_u64().unwrap() >= 4);
    // Within the pod's RAM at every ratio: recommended as before.
    assert!(outcomes.iter().all(|o| o["infeasible"].is_null()), "{v}");
    assert_eq!(v["recommended"], 2);

    // Well-formed XML with its axes labelled.
    let body = std::fs::read_to_string(&svg).unwrap();
    for label in [
        "oversubscription ratio",
        "peak memory (MiB)",
        "wake p99 (ms)",
        "time (s)",
        "memory (MiB)",
    ] {
        assert!(body.contains(label), "{label} not in the SVG");
    }
    let parsed = Command::new("python3")
        .args([
            "-c",
            "import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); \
             assert r.tag.endswith('svg'), r.tag; print(len(list(r.iter())))",
        ])
        .arg(&svg)
        .output()
        .expect("python3");
    assert!(parsed.status.success(), "{}", stderr(&parsed));
}

/// Six 512 MiB sandboxes that each dirty 400 MiB at once: 2.4 GiB
/// resident on a 1 GiB pod at ratio 4 (all admitted), 0.8 GiB at ratio 1.
fn overflowing() -> String {
    let mut lines: Vec<String> = (0..6)
        .map(|i| format!(r#"{{"t":0,"sandbox":"s{i}","event":"create","mem_mib":512}}"#))
        .collect();
    lines.extend((0..6).map(|i| {
        format!(r#"{{"t":1,"sandbox":"s{i}","event":"request","duration_ms":0,"mem_mib":400}}"#)
    }));
    lines.join("\n") + "\n"
}

#[test]
fn plan_never_recommends_a_setting_that_overflows_ram() {
    let s = Scratch::new("plan-overflow");
    let trace = s.path("t.jsonl");
    std::fs::write(&trace, overflowing()).unwrap();
    let o = plan(&trace, &["--max-reject-pct", "100"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("RESIDENT-PEAK/RAM-MIB"), "{text}");
    assert!(
        text.contains("infeasible (!): ratio 4 keep-alive 5000 ms watermark 0.9: resident memory peaks at 2406 MiB, past the pod's 1024 MiB of RAM"),
        "{text}"
    );
    assert!(text.contains("recommended (*): ratio 1 "), "{text}");
    let o = plan(&trace, &["--json"]);
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let infeasible: Vec<f64> = v["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| !o["infeasible"].is_null())
        .map(|o| o["setting"]["ratio"].as_f64().unwrap())
        .collect();
    assert_eq!(infeasible, [2.0, 4.0], "{v}");
    assert!(v["outcomes"][2]["resident_peak_mib"].as_f64().unwrap() > 1024.0);
}

#[test]
fn plan_reports_the_disk_and_a_slow_one_is_infeasible() {
    // SMALL's a and b dirty 100 MiB each and go idle together: 200 MiB
    // of snapshots for one round, 20 MiB/s over 10 policy intervals.
    let s = Scratch::new("plan-disk");
    let trace = s.path("t.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let o = plan(&trace, &[]);
    let text = stdout(&o);
    assert!(text.contains("DISK-NEED/HAVE-MIB-S"), "{text}");
    assert!(text.contains(" 20/1000 "), "{text}");
    assert!(
        text.contains("disk: writes 1000 MiB/s (the calibration's)"),
        "{text}"
    );
    let o = plan(&trace, &["--disk-mib-s", "10", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["disk_write_mib_s_from"], "--disk-mib-s");
    assert_eq!(v["calibration"]["disk_write_mib_s"], 10.0);
    for o in v["outcomes"].as_array().unwrap() {
        assert_eq!(o["exceeds"], serde_json::json!(["disk"]), "{o}");
        assert!(o["disk_needed_mib_s"].as_f64().unwrap() > 20.0, "{o}");
        assert_eq!(o["disk_write_mib_s"], 10.0);
        let backlog = o["write_backlog_peak_bytes"].as_f64().unwrap();
        assert!(backlog > 200.0 * 1048576.0, "{o}");
        assert!(o["snapshot_written_bytes"].as_f64().unwrap() >= backlog);
    }
    assert_eq!(v["recommended"], Value::Null);
    let o = plan(&trace, &["--disk-mib-s", "10"]);
    let text = stdout(&o);
    assert!(
        text.contains("infeasible (!): ratio 4 keep-alive 5000 ms watermark 0.9: hibernation writes need 20 MiB/s, past the disk's 10 MiB/s"),
        "{text}"
    );
    assert!(
        text.contains("and hibernation writes within its disk's bandwidth"),
        "{text}"
    );
    let o = plan(&trace, &["--disk-mib-s", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--disk-mib-s 0 is outside"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn plan_names_the_line_of_a_bad_trace() {
    let s = Scratch::new("plan-bad");
    let trace = s.path("t.jsonl");
    for (body, needle) in [
        (
            "{\"t\":0,\"sandbox\":\"a\",\"event\":\"create\",\"mem_mib\":1}\n{\"t\":1,\"sandbox\":\"z\",\"event\":\"request\"}\n",
            "line 2: sandbox z is used before its create",
        ),
        ("{\"t\":\"soon\"}\n", "line 1: not a trace event"),
    ] {
        std::fs::write(&trace, body).unwrap();
        let o = plan(&trace, &[]);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains(needle), "{}", stderr(&o));
    }
    let o = plan(&trace, &["--ratios", "0"]);
    assert!(stderr(&o).contains("outside (0, 100]"), "{}", stderr(&o));
    let o = plan(&s.path("missing.jsonl"), &[]);
    assert!(stderr(&o).contains("cannot open"), "{}", stderr(&o));
}

#[test]
fn generated_traces_are_seeded_and_planned() {
    let s = Scratch::new("plan-gen");
    for shape in ["bursty", "diurnal", "herd"] {
        let gen = |seed: &str| {
            let o = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gen-trace"))
                .args([
                    shape,
                    "--sandboxes",
                    "20",
                    "--seed",
                    seed,
                    "--duration-s",
                    "600",
                ])
                .args(["--period-s", "600", "--herd-at-s", "120", "--idle-s", "60"])
                .output()
                .expect("scripts/gen-trace");
            assert!(o.status.success(), "{}", stderr(&o));
            o.stdout
        };
        let a = gen("7");
        assert_eq!(a, gen("7"), "{shape}: the same seed gives the same trace");
        assert_ne!(a, gen("8"), "{shape}: another seed another trace");
        let trace = s.path(&format!("{shape}.jsonl"));
        std::fs::write(&trace, &a).unwrap();
        let o = plan(&trace, &["--json"]);
        assert!(o.status.success(), "{shape}: {}", stderr(&o));
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert!(v["trace_sandboxes"].as_u64().unwrap() > 0, "{shape}");
    }
}

fn call(serve: &ServeProcess, method: &str, path: &str, body: Option<&str>) -> Value {
    request(&serve.addr, method, path, Some(TOKEN), body).ok_json(method, path)
}

#[test]
fn recorded_traffic_is_a_trace_plan_accepts() {
    let data = DataDir::new("plan-record");
    let s = Scratch::new("plan-record-trace");
    let trace = s.path("live.jsonl");
    let serve = ServeProcess::start(
        &data.0,
        &[
            "--token",
            TOKEN,
            "--policy-interval-ms",
            "0",
            "--record-trace",
            trace.to_str().unwrap(),
        ],
    );
    let sb = call(
        &serve,
        "POST",
        "/v1/sandboxes",
        Some(r#"{"template":"probe"}"#),
    );
    let id = sb["id"].as_str().unwrap().to_string();
    call(
        &serve,
        "POST",
        &format!("/v1/sandboxes/{id}/hibernate"),
        None,
    );
    call(&serve, "POST", &format!("/v1/sandboxes/{id}/resume"), None);
    // A resume of a running sandbox is no activity; a connect is.
    call(&serve, "POST", &format!("/v1/sandboxes/{id}/resume"), None);
    call(&serve, "POST", &format!("/v1/sandboxes/{id}/connect"), None);
    call(&serve, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    common::wait_for(Duration::from_secs(10), || {
        std::fs::read_to_string(&trace).is_ok_and(|t| t.contains("\"delete\""))
    });
    let text = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let events: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["create", "request", "request", "delete"], "{text}");
    assert!(lines.iter().all(|l| l["sandbox"] == id.as_str()));
    let o = plan(&trace, &["--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["outcomes"][0]["creates_admitted"], 1);
    assert_eq!(v["outcomes"][0]["requests"], 2);
}

#[test]
fn calibrate_measures_through_the_api() {
    let data = DataDir::new("plan-calibrate");
    let serve = ServeProcess::start(&data.0, &["--token", TOKEN, "--policy-interval-ms", "0"]);
    let out = data.0.join("cal.json");
    let o = torpor(
        &[
            "plan",
            "calibrate",
            "--api",
            &serve.url(),
            "--token",
            TOKEN,
            "--samples",
            "2",
            "--mem-mib",
            "64",
            "--dirty-mib",
            "16",
            "--data-dir",
            data.0.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        CALIBRATE_LIMIT,
    );
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let cal: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(cal["source"], "measured");
    for key in ["create_ms", "wake_ms", "hibernate_ms"] {
        assert!(cal[key].as_f64().unwrap() > 0.0, "{key}: {cal}");
    }
    assert!(
        cal["description"]
            .as_str()
            .unwrap()
            .contains("snapshot sizes measured"),
        "{cal}"
    );
    // The dirtying probe's snapshots are larger: about a MiB per MiB.
    let per_mib = cal["snapshot_bytes_per_dirty_mib"].as_f64().unwrap();
    assert!(per_mib > 0.25 * 1048576.0, "{cal}");
    // The templates it built are gone.
    let t = call(&serve, "GET", "/v1/templates", None);
    assert!(!t.to_string().contains("plan-cal-"), "{t}");
    // plan uses it and says so.
    let trace = data.0.join("t.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let o = plan(&trace, &["--calibration", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("(measured: torpor plan calibrate"),
        "{}",
        stdout(&o)
    );
}

// The planner's SVG as an operator sees it: rendered by headless Chromium
// (Debian's `chromium-headless-shell`, or `TORPOR_CHROMIUM`) to a PNG, then
// checked pixel by pixel against what the SVG says it draws: every label
// has ink where it is anchored, every axis line is drawn, every data point
// of every series is in its colour, and the page stays a light background
// with dark ink (readable). `scripts/test` leaves it out where no Chromium
// is installed.

/// How long Chromium may take to start and render.
const RENDER_LIMIT: Duration = Duration::from_secs(120);

fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("TORPOR_CHROMIUM") {
        return PathBuf::from(p);
    }
    ["chromium-headless-shell", "chromium"]
        .iter()
        .flat_map(|n| ["/usr/bin", "/usr/lib/chromium"].map(|d| Path::new(d).join(n)))
        .find(|p| p.is_file())
        .expect("no chromium-headless-shell (apt-get install chromium-headless-shell)")
}

/// The value of attribute `name` in one element's tag text.
fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    let len = tag[start..].find('"')?;
    Some(&tag[start..start + len])
}

fn num(tag: &str, name: &str) -> f64 {
    attr(tag, name)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number {name} in {tag}"))
}

/// Each `<NAME ...>` element's tag text with what follows it up to the
/// next `<` (a text element's content).
fn elements<'a>(svg: &'a str, name: &str) -> Vec<(&'a str, &'a str)> {
    let open = format!("<{name} ");
    svg.match_indices(&open)
        .map(|(at, _)| {
            let rest = &svg[at..];
            let end = rest.find('>').expect("unclosed tag");
            let body = &rest[end + 1..];
            (&rest[..end], &body[..body.find('<').unwrap_or(body.len())])
        })
        .collect()
}

/// The screenshot as RGB rows.
struct Shot {
    width: usize,
    height: usize,
    rgb: Vec<[u8; 3]>,
}

impl Shot {
    fn decode(path: &Path) -> Shot {
        let file = std::fs::File::open(path).expect("open the screenshot");
        let mut reader = png::Decoder::new(file).read_info().expect("a PNG");
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).expect("a PNG frame");
        assert_eq!(info.bit_depth, png::BitDepth::Eight, "{info:?}");
        let step = match info.color_type {
            png::ColorType::Rgb => 3,
            png::ColorType::Rgba => 4,
            other => panic!("unexpected PNG colour type {other:?}"),
        };
        let rgb = buf[..info.buffer_size()]
            .chunks(step)
            .map(|p| [p[0], p[1], p[2]])
            .collect();
        Shot {
            width: info.width as usize,
            height: info.height as usize,
            rgb,
        }
    }

    fn at(&self, x: i64, y: i64) -> Option<[u8; 3]> {
        let (x, y) = (usize::try_from(x).ok()?, usize::try_from(y).ok()?);
        (x < self.width && y < self.height).then(|| self.rgb[y * self.width + x])
    }

    /// Pixels in the box (inclusive) that `pred` accepts.
    fn count(&self, x0: f64, y0: f64, x1: f64, y1: f64, pred: impl Fn([u8; 3]) -> bool) -> usize {
        let mut n = 0;
        for y in y0.floor() as i64..=y1.ceil() as i64 {
            for x in x0.floor() as i64..=x1.ceil() as i64 {
                n += self.at(x, y).is_some_and(&pred) as usize;
            }
        }
        n
    }
}

fn ink(p: [u8; 3]) -> bool {
    p.iter().map(|&c| c as u32).sum::<u32>() < 3 * 200
}

fn hex(colour: &str) -> [u8; 3] {
    let c = colour.trim_start_matches('#');
    let v = u32::from_str_radix(c, 16).unwrap_or_else(|_| panic!("colour {colour}"));
    [(v >> 16) as u8, (v >> 8) as u8, v as u8]
}

fn near(p: [u8; 3], want: [u8; 3]) -> bool {
    p.iter().zip(want).all(|(&a, b)| a.abs_diff(b) <= 48)
}

#[test]
fn plan_svg_renders_readably_in_a_browser() {
    let s = Scratch::new("plan-svg");
    let trace = s.path("t.jsonl");
    std::fs::write(&trace, SMALL).unwrap();
    let svg_path = s.path("plan.svg");
    let o = plan(&trace, &["--svg", svg_path.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    let (root, _) = elements(&svg, "svg")[0];
    let (width, height) = (num(root, "width"), num(root, "height"));

    let png = s.path("plan.png");
    let child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            &format!("--user-data-dir={}", s.path("profile").display()),
            &format!("--window-size={width},{height}"),
            &format!("--screenshot={}", png.display()),
        ])
        .arg(format!("file://{}", svg_path.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(s.path("chromium.log")).unwrap())
        .spawn()
        .expect("start chromium");
    let o = wait_output(child, RENDER_LIMIT);
    assert!(
        o.status.success() && png.is_file(),
        "chromium: {}\n{}",
        o.status,
        std::fs::read_to_string(s.path("chromium.log")).unwrap_or_default()
    );
    let shot = Shot::decode(&png);
    assert_eq!((shot.width, shot.height), (width as usize, height as usize));

    // A light page with dark ink: most pixels near white, some ink.
    let light = shot.count(0.0, 0.0, width - 1.0, height - 1.0, |p| {
        p.iter().all(|&c| c >= 230)
    });
    let total = shot.width * shot.height;
    assert!(light * 10 >= total * 7, "{light} of {total} pixels light");

    // Every label has ink where it is anchored: titles, tick values, axis
    // names (rotated ones around their anchor), line labels.
    let texts = elements(&svg, "text");
    assert!(texts.len() >= 20, "only {} labels", texts.len());
    for (tag, content) in &texts {
        let content = content.trim();
        if content.is_empty() {
            continue;
        }
        let (x, y) = (num(tag, "x"), num(tag, "y"));
        let size = attr(tag, "font-size").map_or(12.0, |v| v.parse().unwrap());
        let run = content.chars().count() as f64 * size * 0.62;
        let (x0, x1, y0, y1) = if attr(tag, "transform").is_some() {
            (x - size, x + 2.0, y - run / 2.0 - 2.0, y + run / 2.0 + 2.0)
        } else {
            let (x0, x1) = match attr(tag, "text-anchor") {
                Some("middle") => (x - run / 2.0, x + run / 2.0),
                Some("end") => (x - run, x),
                _ => (x, x + run),
            };
            (x0 - 2.0, x1 + 2.0, y - size, y + 3.0)
        };
        let dark = shot.count(x0, y0, x1, y1, |p| !p.iter().all(|&c| c >= 230));
        let want = (content.chars().filter(|c| !c.is_whitespace()).count() * 3).max(4);
        assert!(
            dark >= want,
            "label {content:?} at ({x}, {y}) has {dark} inked pixels (want {want})"
        );
    }

    // Every axis (black line) is drawn along its length.
    let axes: Vec<_> = elements(&svg, "line")
        .into_iter()
        .filter(|(t, _)| attr(t, "stroke") == Some("black"))
        .collect();
    assert!(axes.len() >= 6, "only {} axis lines", axes.len());
    for (tag, _) in axes {
        let (x1, y1, x2, y2) = (
            num(tag, "x1"),
            num(tag, "y1"),
            num(tag, "x2"),
            num(tag, "y2"),
        );
        for k in 1..10 {
            let f = k as f64 / 10.0;
            let (x, y) = (x1 + (x2 - x1) * f, y1 + (y2 - y1) * f);
            let n = shot.count(x - 1.0, y - 1.0, x + 1.0, y + 1.0, ink);
            assert!(n > 0, "axis {tag}> is not drawn at ({x:.0}, {y:.0})");
        }
    }

    // Every data point of every series is drawn in the series' colour.
    let series = elements(&svg, "polyline");
    assert!(series.len() >= 3, "only {} series", series.len());
    for (tag, _) in series {
        let colour = hex(attr(tag, "stroke").expect("a series colour"));
        for point in attr(tag, "points").unwrap().split_whitespace() {
            let (x, y) = point.split_once(',').unwrap();
            let (x, y): (f64, f64) = (x.parse().unwrap(), y.parse().unwrap());
            let n = shot.count(x - 2.0, y - 2.0, x + 2.0, y + 2.0, |p| near(p, colour));
            assert!(n > 0, "series {colour:?}: no point drawn at ({x}, {y})");
        }
    }
}
