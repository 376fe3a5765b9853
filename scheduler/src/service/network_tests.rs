//! The service with sandbox networking, in a "host" namespace the test
//! creates: a restarted service removes the networks an earlier one left
//! (kill -9), a sandbox's network is made once for its VMM and goes when
//! the VMM stops. Skips (loudly) without root, nft or /dev/net/tun.

use super::lifecycle_tests::{running, service_with};
use super::*;
use crate::net::tests::{manager, Cleanup};
use crate::net::{EgressPolicy, Leftovers};

#[test]
fn the_service_recovers_leftovers_and_ties_networks_to_vmms() {
    let Some((before, _host)) = manager("svc", "10.203.0.0/24") else {
        return;
    };
    let _cleanup = Cleanup(&before);
    let names = before.config().clone();
    // What a service killed with -9 left behind.
    before.create("old-1", &EgressPolicy::default()).unwrap();
    before.create("old-2", &EgressPolicy::default()).unwrap();
    assert_eq!(before.leftovers().unwrap().namespaces, 2);

    let (_dir, service, template) = service_with(|c| {
        c.net = Some(SandboxNetworking {
            names: names.clone(),
            ..SandboxNetworking::default()
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
    // Its traffic, on the sandbox and in the metrics.
    let shown = service.get_sandbox(&id).unwrap().network;
    assert_eq!(shown, None, "a row made before networking has none stored");
    service
        .set_network_policy(&id, &crate::net::PolicyPatch::default())
        .unwrap();
    let shown = service.get_sandbox(&id).unwrap().network.unwrap();
    assert!(shown.address.is_some(), "{shown:?}");
    assert_eq!(shown.counters, Some(Default::default()), "nothing sent yet");
    let metrics = service.metrics();
    assert!(
        metrics.contains(&format!(
            "torpor_sandbox_net_policy_dropped_packets_total{{sandbox=\"{id}\"}} 0\n"
        )),
        "{metrics}"
    );

    let sandbox = service.store().get_sandbox(&id).unwrap();
    service.stop_vmm(&sandbox).unwrap();
    assert_eq!(
        before.leftovers().unwrap(),
        Leftovers::default(),
        "gone with the VMM"
    );
    assert!(!netns.exists());
}
