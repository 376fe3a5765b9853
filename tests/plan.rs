//! `torpor plan`: the table, `--json` and `--svg` on a small trace; trace
//! errors with their line; the generators in scripts/; and, through a real
//! `torpor serve` with probe sandboxes, `serve --record-trace` writing a
//! trace `plan` accepts and `plan calibrate` measuring a calibration
//! `plan` uses.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

mod common;

use common::http::request;
use common::serve::{DataDir, ServeProcess};
use common::{stderr, stdout, torpor, Scratch};

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
        "hibernations",
        "disk_peak_bytes",
        "core_seconds",
        "memory_series",
    ] {
        assert!(!outcomes[2][key].is_null(), "{key} missing");
    }
    assert!(outcomes[2]["wakes"].as_u64().unwrap() >= 4);
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
