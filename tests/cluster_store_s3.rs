//! Snapshots in the object store (issue 29) on the loopback cluster, its
//! pods sharing an S3 bucket on SeaweedFS (`scripts/object-store`): the
//! scenario of `common/store.rs` (its corrupted chunk only on a
//! directory store, `tests/cluster_store.rs`). Needs postgres,
//! nats-server and SeaweedFS's weed (tests/needs leaves it out without
//! them).

mod common;
use common::cluster::Cluster;

#[test]
fn cluster_hibernated_sandboxes_outlive_a_lost_pod_on_s3() {
    let env = common::store::seaweedfs();
    // The pods (started by scripts/cluster) inherit the bucket and keys.
    for (k, v) in &env {
        std::env::set_var(k, v);
    }
    let url = format!(
        "{}/cluster-{}",
        env["TORPOR_OBJECT_STORE"],
        std::process::id()
    );
    std::env::set_var("TORPOR_CLUSTER_OBJECT_STORE", &url);
    std::env::set_var("TORPOR_LOG", "warn,torpor_scheduler::service::objects=info");
    let c = Cluster::up("store-s3");
    common::store::outlive_a_lost_pod(&c, None);
}
