//! A wake its pod refuses for room (issue 29) on the loopback cluster,
//! its pods sharing a directory object store: pod1 runs at most one VMM
//! (`--jail-uids 1`), so that while a sandbox runs there its admission
//! refuses a wake whatever headroom its heartbeats show; the wake moves
//! to pod2. The scenario is `common/store.rs`'s `wake_refused_by_its_pod`.
//! Needs postgres and nats-server (tests/needs leaves it out without
//! them).

mod common;
use common::cluster::Cluster;

#[test]
fn cluster_a_wake_its_pod_refuses_for_room_moves_to_a_pod_with_room() {
    // Only pod1 so limited; no standby shell holds its one VMM.
    std::env::set_var("TORPOR_CLUSTER_POD1_JAIL_UIDS", "1");
    std::env::set_var("TORPOR_LOG", "warn,torpor_cluster::moved=info");
    let c = Cluster::up_with(
        "wake-refused",
        &format!("{} --standby-pool 0", common::cluster::POD_ARGS),
    );
    common::store::wake_refused_by_its_pod(&c);
}
