//! Sandbox networks in the store: policy and ports round-trip, what is
//! read from the host is not stored, the row goes with the sandbox.

use super::super::*;
use super::{sandbox_in, setup};
use crate::model::ExposedPort;
use crate::net::EgressPolicy;
use crate::state::SandboxState::*;

#[test]
fn a_sandbox_network_is_stored_and_goes_with_the_sandbox() {
    let (_dir, store, t) = setup();
    let s = sandbox_in(&store, &t, Running);
    assert_eq!(store.get_sandbox(&s.id).unwrap().network, None);
    let network = SandboxNetwork {
        policy: serde_json::from_str(
            r#"{"allow_internet":false,"allow_out":["pypi.org","10.0.0.0/8"]}"#,
        )
        .unwrap(),
        ports: vec![ExposedPort {
            guest_port: 8080,
            address: "127.0.0.1:40000".into(),
        }],
        address: Some("10.200.0.2".parse().unwrap()),
        counters: None,
    };
    store.set_sandbox_network(&s.id, &network).unwrap();
    let back = store.get_sandbox(&s.id).unwrap().network.unwrap();
    assert_eq!(back.policy, network.policy);
    assert_eq!(back.ports, network.ports);
    assert_eq!(back.address, None, "read from the host, not stored");
    let listed = store.list_sandboxes(&SandboxFilter::default()).unwrap();
    assert_eq!(listed[0].network.as_ref().unwrap().ports.len(), 1);
    let open = SandboxNetwork {
        policy: EgressPolicy::default(),
        ports: vec![],
        address: None,
        counters: None,
    };
    store.set_sandbox_network(&s.id, &open).unwrap();
    assert_eq!(store.get_sandbox(&s.id).unwrap().network, Some(open));
    assert!(matches!(
        store.set_sandbox_network(&SandboxId::new("nope"), &network),
        Err(StoreError::NotFound { .. })
    ));
    store
        .update_sandbox_state(&s.id, Running, Deleted, None)
        .unwrap();
    store.purge_sandbox(&s.id).unwrap();
    let gone: i64 = store
        .read(|tx| {
            Ok(tx
                .conn
                .query_row("SELECT count(*) FROM sandbox_network", [], |r| r.get(0))?)
        })
        .unwrap();
    assert_eq!(gone, 0);
}
