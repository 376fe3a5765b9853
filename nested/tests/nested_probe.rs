//! End to end on hardware virtualization: boot the nested host (QEMU/TCG,
//! emulated AMD SVM+NPT, kvm_amd in L1) and run torpor's probe guest under
//! `torpor vmm` on L1's real /dev/kvm.
//!
//! This test does not skip by itself: without QEMU, the L1 kernel (run
//! `scripts/nested-host prepare`) or the torpor binary it fails and says
//! which is missing. `TORPOR_SKIP_NESTED=1 scripts/test` leaves it
//! out (the test itself never skips).
//! `TORPOR_NESTED_ECHO=1` streams the L1 console to stderr; `TORPOR_BIN`
//! picks the torpor binary (default: the one cargo built beside this test).

mod common;

use std::time::Duration;

use common::linux::torpor_binary;
use torpor_nested::NestedHost;

const PROBE_MIB: u32 = 2;
const PROBE_ITERS: u64 = 3;

#[test]
fn nested_probe_runs_on_hardware_kvm() {
    let torpor = torpor_binary();
    assert!(
        torpor.is_file(),
        "the torpor binary is missing at {}: build it (cargo build --bin torpor) or set TORPOR_BIN",
        torpor.display()
    );
    let host = NestedHost::builder()
        .file(&torpor, "/opt/torpor/torpor")
        // `torpor vmm` execs the per-VM binary beside it.
        .file(
            torpor.with_file_name("torpor-vmm"),
            "/opt/torpor/torpor-vmm",
        )
        .build()
        .unwrap_or_else(|e| {
            panic!("the nested hardware-virtualization host is not available: {e}")
        });
    let script = format!(
        "test -c /dev/kvm || {{ echo 'L1 has no /dev/kvm (kvm_amd did not load)'; exit 97; }}\n\
         /opt/torpor/torpor vmm --kernel builtin:probe --mem-mib 64 \
         --cmdline 'probe.iters={PROBE_ITERS} probe.mib={PROBE_MIB}'\n"
    );
    let out = host
        .run(&script, Duration::from_secs(900))
        .unwrap_or_else(|e| panic!("nested run failed: {e}"));
    eprintln!(
        "nested_probe: L1 boot {:.1}s, probe in L1 {:.1}s, total {:.1}s",
        out.boot.as_secs_f64(),
        out.script.as_secs_f64(),
        out.total.as_secs_f64()
    );
    assert_ne!(out.exit_code, 97, "{}", out.stdout);
    // Jailed, as everywhere (an unjailed VMM warns).
    assert!(!out.stdout.contains("without a jail"), "{}", out.stdout);
    assert_eq!(
        out.exit_code, 0,
        "torpor vmm failed inside L1; output:\n{}",
        out.stdout
    );
    let iters: Vec<(u64, u64)> = out
        .stdout
        .lines()
        .filter_map(|l| {
            let at = l.find(torpor_probe::ITER_PREFIX)?;
            torpor_probe::parse_iter_line(&l[at..])
        })
        .collect();
    let expected: Vec<(u64, u64)> = torpor_probe::expected_checksums(PROBE_MIB, PROBE_ITERS)
        .into_iter()
        .enumerate()
        .map(|(i, s)| (i as u64 + 1, s))
        .collect();
    assert_eq!(iters, expected, "output:\n{}", out.stdout);
    assert!(
        out.stdout
            .contains(&format!("TORPOR-PROBE DONE n={PROBE_ITERS}")),
        "output:\n{}",
        out.stdout
    );
}
