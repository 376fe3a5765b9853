//! `GET /metrics` of a real `torpor serve` with probe sandboxes: the text is
//! well-formed Prometheus exposition (every family with one HELP and one
//! TYPE before its samples, no series twice, numeric values), and the
//! counters move with activity: sandboxes by state, hibernations and wakes
//! with their latency histograms, and the VMMs' page faults, which keep
//! what ended VMMs took.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::http::request;
use common::serve::{DataDir, ServeProcess};

const TOKEN: &str = "metrics-token-0123456789";

/// Parsed exposition: series (`name{labels}`) → value.
struct Scrape {
    series: HashMap<String, f64>,
    text: String,
}

impl Scrape {
    fn get(&self, series: &str) -> f64 {
        *self
            .series
            .get(series)
            .unwrap_or_else(|| panic!("no series {series} in:\n{}", self.text))
    }
}

/// The metric family a sample belongs to (histogram samples carry a
/// `_bucket`, `_sum` or `_count` suffix).
fn family<'a>(name: &'a str, types: &HashMap<String, String>) -> &'a str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix) {
            if types.get(base).map(String::as_str) == Some("histogram") {
                return base;
            }
        }
    }
    name
}

/// Parses and checks the exposition format; panics on any violation.
fn parse(text: &str) -> Scrape {
    let mut helps = HashSet::new();
    let mut types: HashMap<String, String> = HashMap::new();
    let mut series = HashMap::new();
    let mut seen_families = HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("HELP without text");
            assert!(!help.trim().is_empty(), "empty HELP: {line}");
            assert!(helps.insert(name.to_string()), "HELP twice: {line}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE without kind");
            assert!(
                ["counter", "gauge", "histogram"].contains(&kind),
                "type: {line}"
            );
            assert!(helps.contains(name), "TYPE before HELP: {line}");
            assert!(
                types.insert(name.to_string(), kind.to_string()).is_none(),
                "TYPE twice: {line}"
            );
            continue;
        }
        assert!(
            !line.starts_with('#') && !line.is_empty(),
            "stray: {line:?}"
        );
        let (key, value) = line.rsplit_once(' ').expect("sample without value");
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("value: {line}"));
        let name = key.split('{').next().unwrap();
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "name: {line}"
        );
        if let Some(labels) = key.strip_prefix(name) {
            if !labels.is_empty() {
                assert!(
                    labels.starts_with('{') && labels.ends_with('}'),
                    "labels: {line}"
                );
                for pair in labels[1..labels.len() - 1].split(',') {
                    let (k, v) = pair.split_once('=').expect("label without =");
                    assert!(!k.is_empty() && v.len() >= 2, "label: {line}");
                    assert!(v.starts_with('"') && v.ends_with('"'), "label: {line}");
                }
            }
        }
        let fam = family(name, &types);
        assert!(types.contains_key(fam), "sample before its TYPE: {line}");
        seen_families.insert(fam.to_string());
        if types[fam] == "counter" {
            assert!(name.ends_with("_total"), "counter name: {line}");
        }
        assert!(
            series.insert(key.to_string(), value).is_none(),
            "series twice: {line}"
        );
    }
    for name in types.keys() {
        assert!(seen_families.contains(name), "family {name} has no sample");
    }
    Scrape {
        series,
        text: text.to_string(),
    }
}

const MINOR: &str = "torpor_pod_vmm_minor_page_faults_total{pod=\"pod_local\"}";
const MAJOR: &str = "torpor_pod_vmm_major_page_faults_total{pod=\"pod_local\"}";

#[test]
fn metrics_are_well_formed_and_move_with_activity() {
    let data = DataDir::new("metrics");
    let serve = ServeProcess::start(&data.0, &["--token", TOKEN, "--policy-interval-ms", "0"]);
    let call = |method: &str, path: &str, body: Option<&str>| {
        let r = request(&serve.addr, method, path, Some(TOKEN), body);
        assert!(
            (200..300).contains(&r.status),
            "{method} {path}: {} {}",
            r.status,
            r.body
        );
        r
    };
    let scrape = || parse(&call("GET", "/metrics", None).body);

    let before = scrape();
    for state in ["running", "hibernated", "failed"] {
        assert_eq!(
            before.get(&format!("torpor_sandboxes{{state=\"{state}\"}}")),
            0.0
        );
    }
    assert_eq!(before.get(MINOR), 0.0, "no VMM runs yet");
    for family in [
        "torpor_wakes_total",
        "torpor_hibernations_total",
        "torpor_execs_total",
    ] {
        for result in ["ok", "failed"] {
            assert_eq!(before.get(&format!("{family}{{result=\"{result}\"}}")), 0.0);
        }
    }

    let created = call("POST", "/v1/sandboxes", Some(r#"{"template":"probe"}"#)).json();
    let id = created["id"].as_str().unwrap().to_string();
    let running = scrape();
    assert_eq!(running.get("torpor_sandboxes{state=\"running\"}"), 1.0);
    assert!(running.get(MINOR) > 0.0, "a live VMM has faulted pages in");
    assert!(running.get("torpor_pod_pss_bytes{pod=\"pod_local\"}") > 0.0);
    // Its own memory, on the sandbox and by `sandbox`: the probe has no
    // balloon, so PSS only.
    let pss = format!("torpor_sandbox_memory_pss_bytes{{sandbox=\"{id}\"}}");
    assert!(running.get(&pss) > 0.0, "{}", running.text);
    assert!(!running.text.contains("torpor_sandbox_guest_memory"));
    let got = call("GET", &format!("/v1/sandboxes/{id}"), None).json();
    assert!(got["memory"]["pss_bytes"].as_u64().unwrap() > 0, "{got}");
    // Resident memory (its VMM's cgroup, or its PSS without one), on the
    // sandbox, by `sandbox` and for the pod.
    assert!(
        got["memory"]["resident_bytes"].as_u64().unwrap() > 0,
        "{got}"
    );
    let resident = format!("torpor_sandbox_memory_resident_bytes{{sandbox=\"{id}\"}}");
    assert!(running.get(&resident) > 0.0, "{}", running.text);
    assert!(running.get("torpor_pod_resident_bytes{pod=\"pod_local\"}") > 0.0);
    assert!(got["memory"]["balloon_actual_mib"].is_null(), "{got}");

    // Hibernation ends the VMM: its faults stay counted.
    call("POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
    let hibernated = scrape();
    assert_eq!(
        hibernated.get("torpor_sandboxes{state=\"hibernated\"}"),
        1.0
    );
    assert_eq!(hibernated.get("torpor_sandboxes{state=\"running\"}"), 0.0);
    assert_eq!(
        hibernated.get("torpor_hibernations_total{result=\"ok\"}"),
        1.0
    );
    assert_eq!(hibernated.get("torpor_hibernate_ms_count"), 1.0);
    assert!(!hibernated.text.contains(&pss), "no VMM, no PSS");
    let got = call("GET", &format!("/v1/sandboxes/{id}"), None).json();
    assert!(got["memory"].is_null(), "{got}");
    assert!(hibernated.get(MINOR) >= running.get(MINOR));
    assert!(hibernated.get(MAJOR) >= running.get(MAJOR));

    // A wake starts a new VMM, which faults its own pages in.
    let woken = call("POST", &format!("/v1/sandboxes/{id}/resume"), None).json();
    assert_eq!(woken["resumed"], true, "{woken}");
    let awake = scrape();
    assert_eq!(awake.get("torpor_wakes_total{result=\"ok\"}"), 1.0);
    assert_eq!(awake.get("torpor_resume_ms_count"), 1.0);
    assert_eq!(awake.get("torpor_resume_ms_bucket{le=\"+Inf\"}"), 1.0);
    assert!(awake.get("torpor_resume_ms_sum") > 0.0);
    assert!(
        awake.get(MINOR) > hibernated.get(MINOR),
        "{} -> {}",
        hibernated.get(MINOR),
        awake.get(MINOR)
    );

    // Deleted: no VMM left, and the counters do not go back.
    std::thread::sleep(Duration::from_millis(200));
    let late = scrape();
    call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    let deleted = scrape();
    assert_eq!(deleted.get("torpor_sandboxes{state=\"running\"}"), 0.0);
    assert!(deleted.get(MINOR) >= late.get(MINOR) && late.get(MINOR) >= awake.get(MINOR));
    assert!(deleted.get(MAJOR) >= awake.get(MAJOR));
}
