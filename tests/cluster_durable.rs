//! Durable checkpoints (issue 29): pods of a loopback cluster sharing a
//! directory object store checkpoint their running sandboxes every
//! second (`--checkpoint-interval-s 1`); a running sandbox of a pod lost
//! for good wakes on the other pod as it was at its last checkpoint. The
//! scenario is `common/store.rs`'s. Needs postgres and nats-server
//! (tests/needs leaves it out without them).

mod common;
use common::cluster::Cluster;

#[test]
fn cluster_running_sandboxes_checkpointed_in_the_background_outlive_a_lost_pod() {
    std::env::set_var("TORPOR_LOG", "warn,torpor_scheduler::service::durable=info");
    let c = Cluster::up_with(
        "durable",
        &format!("{} --checkpoint-interval-s 1", common::cluster::POD_ARGS),
    );
    common::store::durable_checkpoints_outlive_a_lost_pod(&c);
}
