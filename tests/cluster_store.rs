//! Snapshots in the object store (issue 29) on the loopback cluster, its
//! pods sharing a directory store (`scripts/cluster`'s default): the
//! scenario of `common/store.rs`, a corrupted chunk included. Needs
//! postgres and nats-server (tests/needs leaves it out without them).

mod common;
use common::cluster::Cluster;

#[test]
fn cluster_hibernated_sandboxes_and_templates_outlive_a_lost_pod() {
    // The pods log what each upload and download took.
    std::env::set_var("TORPOR_LOG", "warn,torpor_scheduler::service::objects=info");
    let c = Cluster::up("store");
    let objects = c.dir.join("objects");
    common::store::outlive_a_lost_pod(&c, Some(&objects));
}
