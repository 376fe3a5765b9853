//! `torpor doctor` on the real host: the verdict, the exit status and the
//! JSON agree, and a PVM host is never reported as able to boot Linux.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{stdout, torpor};

#[test]
fn verdict_and_exit_status_agree() {
    let out = torpor(&["doctor"], Duration::from_secs(20));
    let text = stdout(&out);
    let code = out.status.code();
    let verdict = text
        .lines()
        .find_map(|l| l.strip_prefix("verdict: "))
        .unwrap_or_else(|| panic!("no verdict line:\n{text}"));
    match code {
        Some(0) => assert_eq!(verdict, "Linux and probe guests (hardware virtualization)"),
        Some(10) => assert_eq!(
            verdict,
            "probe guests only (Linux needs hardware virtualization or the nested host)"
        ),
        Some(1) => assert!(
            verdict.starts_with("no guests (KVM unusable: "),
            "{verdict}"
        ),
        other => panic!("unexpected exit status {other:?}:\n{text}"),
    }
    if Path::new("/sys/module/kvm_pvm").exists() {
        assert_eq!(code, Some(10), "PVM host must be probe-only:\n{text}");
        assert!(text.contains("PVM"), "{text}");
    }
    if code == Some(10) {
        assert!(
            text.contains("scripts/nested-host"),
            "probe-only hosts point to the nested host:\n{text}"
        );
    }
    for section in [
        "kvm",
        "virtualization",
        "userfaultfd",
        "huge pages",
        "cgroup",
    ] {
        assert!(
            text.lines().any(|l| l == section),
            "missing section {section}:\n{text}"
        );
    }
}

#[test]
fn json_report_matches_the_exit_status() {
    let out = torpor(&["doctor", "--json"], Duration::from_secs(20));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let verdict = report["verdict"].as_str().expect("verdict field");
    let expected = match verdict {
        "linux_and_probe" => 0,
        "probe_only" => 10,
        _ => 1,
    };
    assert_eq!(out.status.code(), Some(expected), "{report}");
}
