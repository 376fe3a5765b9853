//! The service with sandbox networking, in a "host" namespace the test
//! creates: a restarted service removes the networks an earlier one left
//! (kill -9), a sandbox's network is made once for its VMM and goes when
//! the VMM stops. Skips (loudly) without root, nft or /dev/net/tun.

use std::process::Command;

use super::lifecycle_tests::{running, service_with};
use super::*;
use crate::net::{EgressPolicy, Leftovers, NetConfig, NetManager};

struct HostNs(String);

impl Drop for HostNs {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

#[test]
fn the_service_recovers_leftovers_and_ties_networks_to_vmms() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP service networking: needs root");
        return;
    }
    let nft = Command::new("nft").arg("--version").output();
    if !nft.is_ok_and(|o| o.status.success()) || !std::path::Path::new("/dev/net/tun").exists() {
        eprintln!("SKIP service networking: needs nft and /dev/net/tun");
        return;
    }
    let tag = format!("{:x}", std::process::id() & 0xffff);
    let host = HostNs(format!("tsvc-host-{tag}"));
    assert!(Command::new("ip")
        .args(["netns", "add", &host.0])
        .status()
        .unwrap()
        .success());
    let names = NetConfig {
        netns_prefix: format!("tsvc-{tag}-"),
        veth_prefix: format!("c{tag}v"),
        table: "torpor_svc".into(),
        host_netns: Some(host.0.clone()),
        pool: "10.203.0.0/24".parse().unwrap(),
    };
    // What a service killed with -9 left behind.
    let before = NetManager::new(names.clone()).unwrap();
    before.create("old-1", &EgressPolicy::default()).unwrap();
    before.create("old-2", &EgressPolicy::default()).unwrap();
    assert_eq!(before.leftovers().unwrap().namespaces, 2);

    let (_dir, service, template) = service_with(|c| {
        c.net = Some(SandboxNetworking {
            names: names.clone(),
            egress: EgressPolicy::default(),
        })
    });
    assert_eq!(
        before.leftovers().unwrap(),
        Leftovers::default(),
        "recovered at open"
    );

    let id = running(&service, &template);
    let spec = service.sandbox_net_spec(&id).unwrap().unwrap();
    assert_eq!(spec.tap, crate::net::TAP_NAME);
    let netns = spec.netns.clone().unwrap();
    assert!(netns.exists(), "{}", netns.display());
    // Asked again (a restart of its VMM): the same network.
    assert_eq!(service.sandbox_net_spec(&id).unwrap().unwrap(), spec);
    assert_eq!(before.leftovers().unwrap().namespaces, 1);

    let sandbox = service.store().get_sandbox(&id).unwrap();
    service.stop_vmm(&sandbox).unwrap();
    assert_eq!(
        before.leftovers().unwrap(),
        Leftovers::default(),
        "gone with the VMM"
    );
    assert!(!netns.exists());
}
