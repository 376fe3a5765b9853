//! Snapshots in the object store (issue 29) on the loopback cluster, its
//! pods sharing an S3 bucket on SeaweedFS (which `scripts/cluster up`
//! starts with `TORPOR_CLUSTER_OBJECT_STORE=seaweedfs`): the
//! scenario of `common/store.rs` (its corrupted chunk only on a
//! directory store, `tests/cluster_store.rs`). Needs postgres,
//! nats-server and SeaweedFS's weed (tests/needs leaves it out without
//! them).

mod common;
use common::cluster::Cluster;

#[test]
fn cluster_hibernated_sandboxes_outlive_a_lost_pod_on_s3() {
    // `scripts/cluster up` starts SeaweedFS itself (and `down` stops it);
    // the pods share its bucket.
    let port = common::seaweedfs::free_ports().unwrap_or_else(|e| panic!("{e}"));
    std::env::set_var("TORPOR_CLUSTER_OBJECT_STORE", "seaweedfs");
    std::env::set_var("TORPOR_CLUSTER_OBJECT_STORE_PORT", port.to_string());
    std::env::set_var("TORPOR_LOG", "warn,torpor_scheduler::service::objects=info");
    let c = Cluster::up("store-s3");
    let status = c.status();
    assert!(status.contains("seaweedfs running"), "{status}");
    common::store::outlive_a_lost_pod(&c, None);
}
