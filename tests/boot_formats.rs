//! Both kernel formats boot through the same path: an ELF vmlinux (the probe)
//! elsewhere, and here a real bzImage (Debian's cloud kernel, which
//! `scripts/nested-host prepare` caches for the nested host). On PVM hosts a
//! Linux kernel cannot finish booting, so this checks that the image loads,
//! the vCPU runs, and the VMM stays controllable; on hardware KVM it boots on.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{wait_for, Scratch, Vmm};
use torpor_vmm::control::{request, Request, VmState};

#[test]
fn a_real_bzimage_loads_and_runs() {
    let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/nested-host"))
        .arg("prepare")
        .output()
        .expect("run scripts/nested-host prepare");
    assert!(
        out.status.success(),
        "scripts/nested-host prepare failed (it provides the bzImage):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let l1 = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .trim()
        .to_string();
    let bzimage = std::path::Path::new(&l1).join("vmlinuz");
    assert!(bzimage.is_file(), "no bzImage at {}", bzimage.display());

    let dir = Scratch::new("bzimage");
    let sock = dir.path("ctl.sock");
    let mut vmm = Vmm::spawn(&[
        "--kernel",
        bzimage.to_str().unwrap(),
        "--mem-mib",
        "256",
        "--no-serial",
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    let t = Duration::from_secs(10);
    wait_for(Duration::from_secs(30), || {
        request(&sock, &Request::Status, t).is_ok()
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        vmm.try_status().is_none(),
        "the VMM exited while the bzImage kernel ran"
    );
    let status = request(&sock, &Request::Status, t).unwrap();
    assert_eq!(status.state, VmState::Running);
    assert!(status.kernel.ends_with("vmlinuz"));
    request(&sock, &Request::Shutdown, t).unwrap();
    let out = vmm.wait(Duration::from_secs(30));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
