//! A probe VM with virtio-net on a tap in a namespace the test creates:
//! the VMM opens the tap there (`--net tap=..,netns=..`), the device's
//! state goes into the snapshot, and a restore reopens the tap by its
//! saved name in its saved namespace while the guest continues. (The
//! probe does not drive virtio-net; the device tests in
//! `vmm/src/devices/net` move frames.) Skips loudly without root or tun.

mod common;

use std::process::Command;

use common::snap::{assert_exact_sequence, Vm};
use common::Scratch;

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn tap_exists(ns: &str, tap: &str) -> bool {
    Command::new("ip")
        .args(["-n", ns, "link", "show", tap])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn the_tap_is_reopened_by_name_in_its_namespace_after_a_restore() {
    // scripts/test leaves this out without root or /dev/net/tun (tests/needs).
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root && std::path::Path::new("/dev/net/tun").exists(),
        "needs root and /dev/net/tun"
    );
    let ns = Netns(format!("tnsnap-{}", std::process::id()));
    let ok = Command::new("ip")
        .args(["netns", "add", &ns.0])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "cannot create a network namespace");
    let net = format!(
        "tap=tpsnap0,mac=06:00:00:00:00:42,netns=/run/netns/{}",
        ns.0
    );
    let dir = Scratch::new("net-snapshot");
    let vm = Vm::boot(
        &dir,
        "source",
        &[
            "--mem-mib",
            "64",
            "--cmdline",
            "probe.mib=2 probe.ticks=5",
            "--net",
            &net,
        ],
    );
    assert!(
        tap_exists(&ns.0, "tpsnap0"),
        "the VMM made its tap in the namespace"
    );
    vm.wait_iter(3);
    vm.pause();
    let snap = dir.path("snap");
    vm.snapshot(&snap, false);
    let last = vm.iterations().last().unwrap().0;
    vm.shutdown();
    assert!(
        !tap_exists(&ns.0, "tpsnap0"),
        "a tap the VMM made goes with it"
    );

    // No --net: the saved name, in the saved namespace.
    let vm = Vm::restore(&dir, "clone", &snap, "file", &[]);
    assert!(
        tap_exists(&ns.0, "tpsnap0"),
        "the restored VMM reopened its tap"
    );
    vm.wait_iter(last + 2);
    let seen = vm.iterations();
    assert_eq!(seen[0].0, last + 1);
    assert_exact_sequence(&seen, 2);
    vm.shutdown();
}
